//! The OpenCode adapter's gateway on the wire: streamed Chat Completions chunks, opaque provider
//! blocks kept byte for byte, and a fatal callback error stopping the turn.

use super::*;

/// An opaque provider block with the awkward parts real ones have: escapes, non-ASCII text,
/// nesting, empty members, large (JavaScript-safe) integers.
fn opaque() -> Value {
    json!({"type": "native", "format": "openai.chat.reasoning",
           "data": {"id": "rs_1", "encrypted_content": "gAAAAB\u{e9}==\n\"q\"\\/\t\u{1}",
                    "summary": [], "signature": "ü✓🚀", "meta": {"empty": {}, "none": null,
                    "flags": [true, false], "n": 9_007_199_254_740_991_u64, "x": -0.125}}})
}

/// The number of times `needle` occurs in the session journal's segment files under `data`.
fn occurrences_in_journal(data: &Path, needle: &[u8]) -> usize {
    let mut count = 0;
    for entry in std::fs::read_dir(data.join("journal")).unwrap().flatten() {
        let bytes = std::fs::read(entry.path()).unwrap_or_default();
        count += bytes.windows(needle.len()).filter(|w| *w == needle).count();
    }
    count
}

#[test]
fn opaque_provider_blocks_come_back_byte_for_byte() {
    let brain = start_opencode("oc-opaque");
    let mut asks = asks_for("lookup", json!({"word": "pi"}));
    asks["message"]["content"]
        .as_array_mut()
        .unwrap()
        .insert(0, opaque());
    let script = json!([asks, answers("pi is 3.14")]);
    let session = create(&brain, with_lookup_tool(script, "echo found-314"));
    a_completed_turn(&session, "what is pi?");

    // The second request holds the first answer exactly as the model gave it: the opaque block,
    // in its place, then the text and the tool call (OpenCode's copy of that message holds only
    // the text and the call; the adapter put Brain's blocks back).
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 2);
    let messages = requests[1]["messages"].as_array().unwrap();
    let asked = &messages[messages.len() - 2];
    assert_eq!(
        *asked,
        json!({"role": "assistant", "content": [
            opaque(),
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"word": "pi"}}]})
    );
    // Byte for byte: Brain's encoding of the block is in the journal twice, in the first
    // call's result and in the second call's request.
    let block: brain::protocol::harness::Block = serde_json::from_value(opaque()).unwrap();
    let bytes = serde_json::to_vec(&block).unwrap();
    assert_eq!(
        serde_json::to_vec(&asked["content"][0]).unwrap(),
        serde_json::to_vec(&opaque()).unwrap()
    );
    let state_dir = session.info().unwrap().state_dir;
    let data = state_dir.ancestors().nth(3).unwrap();
    assert_eq!(
        occurrences_in_journal(data, &bytes),
        2,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
}

/// The configuration the adapter gave a session's `opencode serve` (from its environment).
fn opencode_config(pid: u32) -> Value {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("opencode's environment");
    let content = environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(b"OPENCODE_CONFIG_CONTENT="))
        .expect("the SDK passes OpenCode its configuration in OPENCODE_CONFIG_CONTENT");
    serde_json::from_slice(content).expect("OpenCode's configuration is JSON")
}

/// POSTs `body` to the gateway's Chat Completions endpoint as HTTP/1.0 (so the answer is not
/// chunked and ends at the close): the status line, the headers and the body.
fn chat_completions(base: &str, token: &str, body: &Value) -> (String, String, String) {
    use std::io::{Read, Write};
    let rest = base.strip_prefix("http://").expect("an http URL");
    let (host, path) = rest.split_once('/').expect("a path");
    let mut stream = std::net::TcpStream::connect(host).expect("connect to the gateway");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let body = body.to_string();
    write!(
        stream,
        "POST /{path}/chat/completions HTTP/1.0\r\nhost: {host}\r\ncontent-type: application/json\r\n\
         authorization: Bearer {token}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .expect("the gateway's answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a complete answer");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_owned(), headers.to_lowercase(), body.to_owned())
}

/// The `data:` payloads of a server-sent event stream, in order.
fn sse_data(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "an unterminated stream: {body:?}");
    body.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"))
                .to_owned()
        })
        .collect()
}

#[test]
fn the_gateway_streams_text_and_tool_calls_as_chat_completions_chunks_without_invented_usage() {
    // Unsandboxed, so that the test can reach the gateway (a sandboxed worker has a network
    // namespace of its own). While OpenCode waits in a tool call, the test sends the gateway two
    // streamed requests of its own, then lets the tool finish and the turn complete.
    let brain = Running::start(
        vec![opencode().sandbox(false)],
        adapter_options("oc-stream"),
    );
    let go = temp_dir("oc-stream-go").join("go");
    let scratch = Scratch(go.parent().unwrap().to_path_buf());
    let shell = format!(
        "i=0; while [ ! -e '{}' ] && [ $i -lt 1000 ]; do sleep 0.02; i=$((i+1)); done; echo found-314",
        go.display()
    );
    let probe_tools = json!({"message": {"role": "assistant", "content": [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "call_9", "name": "lookup", "input": {"word": "e", "n": [1, 2]}}]},
        "stop_reason": "tool_use", "usage": {}});
    let mut probe_usage = answers("seven");
    probe_usage["usage"] = json!({"output_tokens": 3});
    let script = json!([
        asks_for("lookup", json!({"word": "pi"})),
        probe_tools,
        probe_usage,
        answers("done")
    ]);
    let session = create(&brain, with_lookup_tool(script, &shell));
    let activation = session.send(text("what is pi?")).unwrap();
    session
        .wait_for_events(WAIT, |events| {
            events.iter().any(|e| e.event_type == "tool_call_started")
        })
        .expect("OpenCode called the tool");
    let state_dir = session.info().unwrap().state_dir;
    let config = opencode_config(opencode_processes(&state_dir)[0]);
    let provider = &config["provider"]["brain"]["options"];
    let (base, token) = (
        provider["baseURL"].as_str().unwrap(),
        provider["apiKey"].as_str().unwrap(),
    );
    let request = |stream: bool| {
        json!({"model": "default", "stream": stream,
               "messages": [{"role": "user", "content": "probe"}],
               "tools": [{"type": "function", "function": {"name": "brain_lookup",
                          "parameters": {"type": "object"}}}]})
    };

    // Text and a tool call, no usage from Brain: no usage chunk at all.
    let (status, headers, body) = chat_completions(base, token, &request(true));
    assert!(status.contains(" 200 "), "{status}");
    assert!(
        headers.contains("content-type: text/event-stream"),
        "{headers}"
    );
    let events = sse_data(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("a JSON chunk"))
        .collect();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        assert_eq!(chunk["id"], chunks[0]["id"]);
        assert!(chunk.get("usage").is_none(), "usage invented: {chunk}");
    }
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]).collect();
    assert_eq!(
        deltas[0]["delta"],
        json!({"role": "assistant", "content": "Looking."})
    );
    let call = &deltas[1]["delta"]["tool_calls"][0];
    assert_eq!(call["index"], 0);
    assert_eq!(call["id"], "call_9");
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "brain_lookup");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"word": "e", "n": [1, 2]}));
    assert_eq!(deltas.last().unwrap()["finish_reason"], "tool_calls");
    assert!(
        deltas[..deltas.len() - 1]
            .iter()
            .all(|d| d["finish_reason"].is_null())
    );

    // Only the counters Brain has: output tokens, and nothing zero-filled beside them.
    let (_, _, body) = chat_completions(base, token, &request(true));
    let events = sse_data(&body);
    let usage: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter(|c| c.get("usage").is_some())
        .collect();
    assert_eq!(usage.len(), 1, "{body}");
    assert_eq!(usage[0]["usage"], json!({"completion_tokens": 3}));
    assert_eq!(usage[0]["choices"], json!([]));

    // The probes were model calls of the running activation, as Brain journaled them.
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 3);
    assert_eq!(
        conversation(&requests[1]),
        [("user".to_owned(), vec!["probe".to_owned()])]
    );

    // OpenCode's own streamed turn goes on and completes; the transcript is its conversation.
    std::fs::write(&go, "").unwrap();
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    assert_eq!(outcome.result.expect("a result")["text"], "done");
    let (transcript, _) = session.transcript().unwrap();
    let transcript = serde_json::to_value(&transcript).unwrap();
    let roles: Vec<_> = transcript
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        roles,
        ["user", "assistant", "user", "assistant"],
        "{transcript}"
    );
    assert_eq!(transcript[2]["content"][0]["tool_use_id"], "call_1");
    assert_eq!(
        transcript[3]["content"],
        json!([{"type": "text", "text": "done"}])
    );
    drop(scratch);
}

#[test]
fn a_fatal_callback_error_stops_the_turn_promptly_with_no_further_callback() {
    let brain = Running::start_with(
        vec![opencode()],
        adapter_options("oc-fatal"),
        fatal_second_call(),
    );
    // The first call asks for the tool; the second, after the tool's result, fails fatally.
    let script = json!([
        asks_for("lookup", json!({"word": "pi"})),
        answers("never used"),
        answers("never")
    ]);
    let request = with_lookup_tool(script, "echo found-314");
    let session = assert_a_fatal_error_stops_the_turn(&brain, "opencode", request);
    // OpenCode's turn was aborted, not left running: its server still serves the session, and
    // stops at close.
    let state_dir = session.info().unwrap().state_dir;
    let pids = opencode_processes(&state_dir);
    assert_eq!(pids.len(), 1, "{pids:?}");
    session.close().unwrap();
    assert!(
        stops_within(pids[0], WAIT),
        "opencode {} outlived close",
        pids[0]
    );
}
