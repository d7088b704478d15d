//! A real provider through Brain's effect barrier: when the connection breaks after the request
//! was sent, the call is recorded `unknown`, answered `outcome_unknown` (not fatal), and never sent
//! again.

mod common;

use brain::effects::{Effects, OpenAiProvider};
use brain::protocol::harness::{Block, UserInput};
use brain::{Brain, Config, OutcomeKind, Registrations};
use common::*;
use serde_json::json;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Accepts connections; reads each request whole, then closes without answering.
fn cutting_server(listener: TcpListener, requests: Arc<AtomicUsize>) {
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let _ = stream.set_read_timeout(Some(WAIT));
            let mut reader = BufReader::new(stream);
            let mut length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = value.trim().parse().unwrap_or(0);
                }
                if line == "\r\n" {
                    let mut body = vec![0; length];
                    let _ = reader.read_exact(&mut body);
                    requests.fetch_add(1, Ordering::SeqCst);
                    break;
                }
            }
            // Dropping the stream cuts the connection after the request was received.
        }
    });
}

#[test]
fn a_connection_cut_after_sending_is_recorded_unknown_and_not_resent() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicUsize::new(0));
    cutting_server(listener, requests.clone());
    let mut config = Config::new(Registrations::from_vec(vec![fault("f", &[])]).unwrap());
    config.options = fast_options("provider-cut");
    config.effects = Effects::default()
        .with_provider("openai", Arc::new(OpenAiProvider::new(base, "sk-test-cut")));
    let brain = Brain::start(config).unwrap();
    let calls = json!([
        {"method": "model", "input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}},
        {"method": "kv.put", "input": {"key": "after", "value": true}}
    ]);
    let session = brain
        .create_session_json(
            json!({"agentloop": {"name": "f", "configuration": {"fault": "calls", "calls": calls}},
                   "model": {"provider": "openai", "name": "gpt-test"}})
            .to_string()
            .as_bytes(),
        )
        .unwrap();
    let outcome = session
        .send(UserInput {
            content: vec![Block::text("go")],
        })
        .unwrap()
        .wait_timeout(WAIT)
        .expect("the activation ended");
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    let answers = &outcome.result.unwrap()["answers"];
    // Not fatal: the harness stopped at the error by its own rule, and could have gone on.
    assert_eq!(answers[0]["error"]["code"], "outcome_unknown");
    assert_eq!(answers[0]["error"]["fatal"], false);
    let events = session.events(0, 100).unwrap();
    let finished = events
        .iter()
        .find(|e| e.event_type == "model_call_finished")
        .expect("the call's outcome was recorded");
    assert_eq!(finished.data["outcome"], "unknown");
    assert_eq!(requests.load(Ordering::SeqCst), 1, "the request was resent");
    assert!(
        brain
            .metrics_text()
            .contains("brain_unknown_outcomes_total 1")
    );
}
