//! Idempotent admission over the real `brain serve` binary: a client that retries a create or a
//! message with its `Idempotency-Key` gets what the first attempt got — the same session, the same
//! activation and its outcome — and the journal holds one record of it, also when Brain was
//! SIGKILLed between the two attempts; the same key with another body is refused and writes
//! nothing.

mod common;

use common::adapter::Scratch;
use common::server::*;
use common::*;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::io::Write;
use std::path::Path;

fn registration() -> Value {
    json!({"f": {"command": FAULT_HARNESS}})
}

fn text(text: &str) -> Value {
    json!({"content": [{"type": "text", "text": text}]})
}

fn queued(events: &[Value]) -> Vec<&Value> {
    events
        .iter()
        .filter(|e| e["type"] == "activation_queued")
        .collect()
}

/// Sends a keyed message that waits for its outcome and hangs up once the activation runs: the
/// client never sees the answer. The activation's sequence.
fn send_and_hang_up(server: &Served, id: &str, key: &str, body: Value) -> u64 {
    let raw = server.request(
        "POST",
        &format!("/v1/sessions/{id}/messages"),
        &[("idempotency-key", key)],
        Some(body),
    );
    let stream = server.connect();
    (&stream).write_all(&raw).expect("send the request");
    let running = server.wait_running(id);
    drop(stream);
    running.data["origin"]["sequence"]
        .as_u64()
        .expect("the running event names its activation")
}

fn session_count(server: &Served) -> usize {
    server
        .call("GET", "/v1/sessions", None)
        .expect(200, None)
        .json()["sessions"]
        .as_array()
        .expect("sessions")
        .len()
}

fn create_keyed(server: &Served, key: &str, body: &Value) -> common::http::Reply {
    server.call_with(
        "POST",
        "/v1/sessions",
        &[("idempotency-key", key)],
        Some(body.clone()),
    )
}

#[test]
fn a_message_retried_with_its_key_after_the_client_was_cut_off_gets_the_original_outcome_once() {
    let scratch = Scratch(temp_dir("idem-retry"));
    let mut server = serve(&scratch.0.join("data"), registration(), &[]);
    let configuration = json!({
        "fault": "slow_calls", "announce": true, "delay_ms": 700,
        "calls": [{"method": "kv.get", "input": {"key": "x"}}],
    });
    let id = server.create("f", configuration);
    let sequence = send_and_hang_up(&server, &id, "m-1", text("once"));

    // The retry arrives while the first attempt's activation still runs: it waits for it.
    let outcome = server
        .message(&id, "once", &[("idempotency-key", "m-1")])
        .expect(200, None)
        .json();
    assert_eq!(outcome["sequence"], sequence, "{outcome}");
    assert_eq!(outcome["outcome"], "completed", "{outcome}");
    // Another retry after it ended, async or not, and after passivation (the session's keys are
    // read back from the journal): the same activation, nothing admitted.
    let again = server
        .message(&id, "once", &[("idempotency-key", "m-1")])
        .expect(200, None)
        .json();
    assert_eq!(again, outcome);
    let accepted = server
        .message(
            &id,
            "once",
            &[("idempotency-key", "m-1"), ("prefer", "respond-async")],
        )
        .expect(202, None)
        .json();
    assert_eq!(accepted, json!({"session_id": id, "sequence": sequence}));
    server
        .call("POST", &format!("/v1/sessions/{id}/passivate"), None)
        .expect(200, None);
    let passivated = server
        .message(&id, "once", &[("idempotency-key", "m-1")])
        .expect(200, None)
        .json();
    assert_eq!(passivated, outcome);
    assert_eq!(server.view(&id)["status"], "passivated");

    let events = server.events(&id);
    assert_eq!(queued(&events).len(), 1, "{events:?}");
    let finished: Vec<_> = events
        .iter()
        .filter(|e| e["type"] == "activation_finished")
        .collect();
    assert_eq!(finished.len(), 1, "{events:?}");

    // A new key is a new message; the same key with another body is refused and writes nothing.
    let second = server
        .message(&id, "twice", &[("idempotency-key", "m-2")])
        .expect(200, None)
        .json();
    assert!(second["sequence"].as_u64() > Some(sequence), "{second}");
    let before = server.events(&id).len();
    let refused = server
        .message(&id, "not once", &[("idempotency-key", "m-1")])
        .expect(422, Some("idempotency_key_reused"));
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("\"m-1\"") && m.contains(&format!("activation {sequence}"))),
        "{}",
        refused.text()
    );
    server
        .call_with(
            "POST",
            &format!("/v1/sessions/{id}/activations"),
            &[("idempotency-key", "m-1")],
            None,
        )
        .expect(422, Some("idempotency_key_reused"));
    assert_eq!(server.events(&id).len(), before);

    // Malformed keys are refused before anything is admitted, naming the header.
    for bad in ["", "two words", &"k".repeat(256)] {
        let reply = server
            .message(&id, "bad", &[("idempotency-key", bad)])
            .expect(400, Some("invalid_request"));
        assert!(reply.text().contains("Idempotency-Key"), "{}", reply.text());
    }
    assert_eq!(server.events(&id).len(), before);
    server.terminate(WAIT);
}

#[test]
fn keyed_creates_and_messages_are_answered_the_same_after_brain_was_killed_between_attempts() {
    let scratch = Scratch(temp_dir("idem-kill"));
    let data = scratch.0.join("data");
    let mut server = serve(&data, registration(), &[]);
    let body =
        json!({"agentloop": {"name": "f", "configuration": {"fault": "hang", "announce": true}}});
    let created = create_keyed(&server, "c-1", &body).expect(201, None).json();
    let id = created["session_id"].as_str().expect("an id").to_owned();
    // The same create again: the same session, no second one.
    let again = create_keyed(&server, "c-1", &body).expect(201, None);
    assert_eq!(again.json()["session_id"], id.as_str());
    assert_eq!(
        again.header("location"),
        Some(format!("/v1/sessions/{id}").as_str())
    );
    assert_eq!(session_count(&server), 1);

    // The client's message is admitted and runs; the client is cut off; Brain is SIGKILLed.
    let sequence = send_and_hang_up(&server, &id, "m-1", text("hang"));
    let workers = server.workers(1);
    server.signal(Signal::SIGKILL);
    assert!(server.wait_exit(WAIT).is_some(), "brain serve did not die");
    for pid in workers {
        assert!(stops_within(pid, WAIT), "worker {pid} outlived Brain");
    }

    let mut server = serve(&data, registration(), &[]);
    // The create key was read back at start: the retried create names the same session.
    let recreated = create_keyed(&server, "c-1", &body).expect(201, None).json();
    assert_eq!(recreated["session_id"], id.as_str(), "{recreated}");
    assert_eq!(recreated["status"], "interrupted", "{recreated}");
    // The retried message gets the original activation's recorded outcome: Brain stopped while
    // it ran. Nothing new is admitted, though the session is interrupted now.
    let outcome = server
        .message(&id, "hang", &[("idempotency-key", "m-1")])
        .expect(200, None)
        .json();
    assert_eq!(outcome["sequence"], sequence, "{outcome}");
    assert_eq!(outcome["outcome"], "failed", "{outcome}");
    assert_eq!(outcome["error"]["code"], "interrupted", "{outcome}");
    let events = server.events(&id);
    assert_eq!(queued(&events).len(), 1, "{events:?}");

    // Other bodies under the same keys are refused, and write nothing.
    let other = json!({"agentloop": {"name": "f", "configuration": {"fault": "echo"}}});
    let refused = create_keyed(&server, "c-1", &other).expect(422, Some("idempotency_key_reused"));
    assert!(refused.text().contains(&id), "{}", refused.text());
    server
        .message(&id, "something else", &[("idempotency-key", "m-1")])
        .expect(422, Some("idempotency_key_reused"));
    assert_eq!(server.events(&id).len(), events.len());
    assert_eq!(session_count(&server), 1);

    // Deleting the session frees its create key: the key then creates a new session.
    server
        .call("DELETE", &format!("/v1/sessions/{id}"), None)
        .expect(204, None);
    let fresh = create_keyed(&server, "c-1", &other)
        .expect(201, None)
        .json();
    assert_ne!(fresh["session_id"], id.as_str(), "{fresh}");
    server.terminate(WAIT);
}

#[test]
fn the_library_retries_a_keyed_send_and_create_without_admitting_twice() {
    use brain::protocol::harness::{Block, UserInput};
    use brain::session::{CreateSession, IdempotencyKey};
    use brain::{CreateOptions, SendOptions};

    let options = fast_options("idem-lib");
    let data = options.data_dir.clone();
    let _scratch = Scratch(data.parent().map_or(data.clone(), Path::to_path_buf));
    let brain = start(vec![fault("f", &[])], options);
    let key = |k: &str| Some(IdempotencyKey::parse(k).expect("a valid key"));
    let request =
        || CreateSession::parse(br#"{"agentloop": {"name": "f"}}"#).expect("a valid request");
    let create = |k: &str| {
        brain.create_session_with(
            request(),
            CreateOptions {
                idempotency_key: key(k),
                ..CreateOptions::default()
            },
        )
    };
    let session = create("c").expect("created");
    assert_eq!(create("c").expect("the same").id(), session.id());
    assert_eq!(brain.sessions().expect("list").len(), 1);

    let input = |t: &str| UserInput {
        content: vec![Block::text(t)],
    };
    let send = |t: &str, k: &str| {
        session.send_with(
            input(t),
            SendOptions {
                idempotency_key: key(k),
                ..SendOptions::default()
            },
        )
    };
    let first = send("hi", "s").expect("admitted").wait();
    let again = send("hi", "s").expect("the same activation");
    assert_eq!(again.outcome().as_ref(), Some(&first), "already ended: set");
    let refused = send("ho", "s").expect_err("another input");
    assert_eq!(refused.code.as_str(), "idempotency_key_reused");
    // A different deadline is a different request.
    let with_deadline = session.send_with(
        input("hi"),
        SendOptions {
            idempotency_key: key("s"),
            deadline: Some(std::time::Duration::from_secs(60)),
        },
    );
    assert_eq!(
        with_deadline.expect_err("another deadline").code.as_str(),
        "idempotency_key_reused"
    );
    let events = session.events(0, usize::MAX).expect("events");
    let queued = events
        .iter()
        .filter(|e| e.event_type == "activation_queued")
        .count();
    assert_eq!(queued, 1);
    brain.shutdown(WAIT);
}
