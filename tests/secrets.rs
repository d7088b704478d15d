//! Provider keys stay in Brain: after a real turn through the `openai` provider (against a local
//! server speaking the Chat Completions wire format), the key appears nowhere in the journal, the
//! native state, the logs (at trace level) or the answer, and the server did receive it.

mod common;

use common::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::Command;

const KEY: &str = "sk-test-0123456789abcdefSECRET";

/// Serves one Chat Completions request; returns the request's headers and body.
fn serve_one(listener: TcpListener) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        stream.set_read_timeout(Some(WAIT)).expect("read timeout");
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let mut head = String::new();
        let mut length = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).expect("header line");
            if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = value.trim().parse().expect("length");
            }
            head.push_str(&line);
            if line == "\r\n" || line.is_empty() {
                break;
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).expect("body");
        let answer = serde_json::json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-test",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hi from the model"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
        })
        .to_string();
        let mut stream = stream;
        write!(
            stream,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
            answer.len()
        )
        .expect("answer");
        head + &String::from_utf8_lossy(&body)
    })
}

fn files_containing(dir: &std::path::Path, needle: &[u8], found: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_containing(&path, needle, found);
        } else if let Ok(bytes) = std::fs::read(&path)
            && bytes.windows(needle.len()).any(|w| w == needle)
        {
            found.push(path.display().to_string());
        }
    }
}

#[test]
fn a_provider_key_reaches_the_provider_and_nowhere_else() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    let server = serve_one(listener);
    let data = temp_dir("secrets").join("data");
    let output = run_bounded(
        Command::new(BRAIN)
            .args([
                "run",
                "--data-dir",
                &data.to_string_lossy(),
                "--model",
                "openai:gpt-test",
            ])
            .arg("say hi")
            .env_remove("BRAIN_AGENTLOOPS")
            .env("OPENAI_API_KEY", KEY)
            .env("OPENAI_BASE_URL", &base)
            .env("RUST_LOG", "trace"),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), "hi from the model");
    let request = server.join().expect("the server saw the request");
    assert!(
        request.to_ascii_lowercase().contains(&format!(
            "authorization: bearer {}",
            KEY.to_ascii_lowercase()
        )),
        "the provider did not receive the key"
    );
    assert!(request.contains("\"model\":\"gpt-test\""), "{request}");
    // The logs at trace level, the answer, and every file Brain or the harness wrote.
    assert!(!stderr.contains(KEY), "the key is in the logs");
    assert!(!stdout.contains(KEY));
    let mut found = Vec::new();
    files_containing(&data, KEY.as_bytes(), &mut found);
    assert!(found.is_empty(), "the key is in {found:?}");
    // The journal did record the model call, so the scan looked at real records.
    let mut journaled = Vec::new();
    files_containing(&data.join("journal"), b"hi from the model", &mut journaled);
    assert!(!journaled.is_empty());
}
