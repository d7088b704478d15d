//! The `openai` and `anthropic` model providers against a local HTTP server that speaks each
//! API's real wire format: request and response mapping, error bodies, a connection cut after
//! the request, cancel while waiting, an unreachable port, and no trace of the key in any error.
//!
//! Every server here is a thread on 127.0.0.1 serving one connection; every wait is bounded by a
//! channel's `recv_timeout`.

use brain::cancel::CancelToken;
use brain::effects::{AnthropicProvider, EffectError, ModelCall, ModelProvider, OpenAiProvider};
use brain::protocol::harness::{
    Block, ErrorCode, Message, ModelMetadata, ModelRequest, ModelResult, Role, StopReason,
    ToolDefinition, Usage,
};
use brain::session::SessionId;
use crossbeam_channel::{Receiver, Sender, bounded};
use serde_json::{Map, Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

const OPENAI_KEY: &str = "sk-test-OPENAI-0123456789abcdef";
const ANTHROPIC_KEY: &str = "sk-ant-test-ANTHROPIC-0123456789";

/// Bounds every wait in these tests.
const BOUND: Duration = Duration::from_secs(20);

/// One HTTP request as the server read it.
#[derive(Debug)]
struct Received {
    method: String,
    path: String,
    /// Header names in lower case.
    headers: Vec<(String, String)>,
    body: Value,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// What the server does once it has read the request.
enum Answer {
    /// Writes this status and JSON body.
    Respond(u16, String),
    /// Closes the connection without a word.
    Close,
    /// Holds the connection open until `release` yields (or is dropped), then closes it.
    Hold(Receiver<()>),
    /// Writes a plain-text HTTP answer at once, without reading: what a client that speaks TLS
    /// to a plain HTTP server gets back.
    PlainAtOnce,
}

/// Serves one connection on 127.0.0.1 and reports what it read. Returns the base address
/// (`http://127.0.0.1:PORT`) and the channel of requests.
fn serve(answer: Answer) -> (String, Receiver<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
    let address = listener.local_addr().expect("an address");
    let (tell, told) = bounded(1);
    thread::spawn(move || {
        let Ok((stream, _)) = listener.accept() else {
            return;
        };
        handle(stream, answer, &tell);
    });
    (format!("http://{address}"), told)
}

fn handle(mut stream: TcpStream, answer: Answer, tell: &Sender<Received>) {
    stream
        .set_read_timeout(Some(BOUND))
        .expect("a read timeout");
    if let Answer::PlainAtOnce = answer {
        let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    let Some(received) = read_request(&stream) else {
        return;
    };
    let _ = tell.send(received);
    match answer {
        Answer::Respond(status, body) => {
            let reason = match status {
                200 => "OK",
                400 => "Bad Request",
                401 => "Unauthorized",
                429 => "Too Many Requests",
                500 => "Internal Server Error",
                529 => "Overloaded",
                _ => "Whatever",
            };
            let response = format!(
                "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes());
            let _ = stream.flush();
        }
        Answer::Close | Answer::PlainAtOnce => {}
        Answer::Hold(release) => {
            let _ = release.recv_timeout(BOUND);
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

fn read_request(stream: &TcpStream) -> Option<Received> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut words = line.split_whitespace();
    let method = words.next()?.to_owned();
    let path = words.next()?.to_owned();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let length: usize = headers
        .iter()
        .find(|(name, _)| name == "content-length")
        .and_then(|(_, value)| value.parse().ok())?;
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(Received {
        method,
        path,
        headers,
        body: serde_json::from_slice(&body).ok()?,
    })
}

fn session() -> SessionId {
    SessionId::parse("ses_01HZX8Y2K3M4N5P6Q7R8").expect("a valid id")
}

fn metadata(provider: &str, name: &str, max_output_tokens: Option<u64>) -> ModelMetadata {
    ModelMetadata {
        provider: provider.into(),
        name: name.into(),
        context_window: None,
        max_output_tokens,
        extra: Map::new(),
    }
}

/// A conversation with a system prompt, a tool, an assistant tool call and its result.
fn conversation(max_output_tokens: Option<u64>) -> ModelRequest {
    ModelRequest {
        system: Some("You are terse.".into()),
        messages: vec![
            Message::text(Role::User, "List the files."),
            Message {
                role: Role::Assistant,
                content: vec![
                    Block::text("Let me look."),
                    Block::ToolUse {
                        id: "call_1".into(),
                        name: "bash".into(),
                        input: json!({"command": "ls"}),
                    },
                ],
            },
            Message {
                role: Role::User,
                content: vec![
                    Block::ToolResult {
                        tool_use_id: "call_1".into(),
                        content: vec![Block::text("a.txt\nb.txt")],
                        is_error: false,
                    },
                    Block::text("Now read a.txt."),
                ],
            },
        ],
        tools: Some(vec![ToolDefinition {
            name: "bash".into(),
            description: "Run a command".into(),
            input_schema: json!({"type": "object", "properties": {"command": {"type": "string"}}}),
        }]),
        max_output_tokens,
        options: None,
    }
}

/// Runs `provider.call` on a thread; the result arrives on the returned channel.
fn call_in_background(
    provider: Box<dyn ModelProvider>,
    model: ModelMetadata,
    request: ModelRequest,
    cancel: CancelToken,
) -> Receiver<Result<ModelResult, EffectError>> {
    let (done, result) = bounded(1);
    thread::spawn(move || {
        let id = session();
        let call = ModelCall {
            session_id: &id,
            sequence: 42,
            ordinal: 0,
            model: &model,
            request: &request,
        };
        let _ = done.send(provider.call(&call, &cancel));
    });
    result
}

fn call(
    provider: Box<dyn ModelProvider>,
    model: ModelMetadata,
    request: ModelRequest,
) -> Result<ModelResult, EffectError> {
    call_in_background(provider, model, request, CancelToken::new())
        .recv_timeout(BOUND)
        .expect("the call ends in time")
}

/// Asserts that neither the error's Display nor its Debug holds `key` (or a long piece of it).
fn assert_no_key(error: &EffectError, key: &str) {
    for text in [error.to_string(), format!("{error:?}")] {
        assert!(!text.contains(key), "the key leaked: {text}");
        assert!(
            !text.contains(&key[key.len() - 10..]),
            "a key piece leaked: {text}"
        );
    }
}

fn failed_message(result: Result<ModelResult, EffectError>, key: &str) -> String {
    match result {
        Err(
            error @ EffectError::Failed {
                code: ErrorCode::ModelFailed,
                ..
            },
        ) => {
            assert_no_key(&error, key);
            error.to_string()
        }
        other => panic!("expected model_failed, got {other:?}"),
    }
}

fn unknown_message(result: Result<ModelResult, EffectError>, key: &str) -> String {
    match result {
        Err(error @ EffectError::Unknown { .. }) => {
            assert_no_key(&error, key);
            error.to_string()
        }
        other => panic!("expected an unknown outcome, got {other:?}"),
    }
}

/// Makes a provider talking to a base address.
type MakeProvider = fn(&str) -> Box<dyn ModelProvider>;

fn openai(base: &str) -> Box<dyn ModelProvider> {
    Box::new(OpenAiProvider::new(format!("{base}/v1"), OPENAI_KEY))
}

fn anthropic(base: &str) -> Box<dyn ModelProvider> {
    Box::new(AnthropicProvider::new(base, ANTHROPIC_KEY))
}

// ------------------------------------------------------------------------------------------------
// OpenAI-compatible Chat Completions.

#[test]
fn openai_request_and_response_map_both_ways() {
    let response = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
        "model": "gpt-test-2025-01-01",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": null,
            "message": {"role": "assistant", "content": "Reading it.", "refusal": null,
                "tool_calls": [{"id": "call_2", "type": "function",
                    "function": {"name": "bash", "arguments": "{\"command\":\"cat a.txt\"}"}}]}}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 15, "total_tokens": 135}
    });
    let (base, requests) = serve(Answer::Respond(200, response.to_string()));
    let result = call(
        openai(&base),
        metadata("openai", "gpt-test", Some(32000)),
        conversation(Some(512)),
    )
    .expect("a result");

    let sent = requests.recv_timeout(BOUND).expect("the request");
    assert_eq!(sent.method, "POST");
    assert_eq!(sent.path, "/v1/chat/completions");
    assert_eq!(
        sent.header("authorization"),
        Some(format!("Bearer {OPENAI_KEY}").as_str())
    );
    assert_eq!(sent.header("content-type"), Some("application/json"));
    assert_eq!(
        sent.body,
        json!({
            "model": "gpt-test",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "List the files."},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
                {"role": "user", "content": "Now read a.txt."}
            ],
            "tools": [{"type": "function", "function": {"name": "bash",
                "description": "Run a command",
                "parameters": {"type": "object",
                               "properties": {"command": {"type": "string"}}}}}],
            "max_tokens": 512
        })
    );

    assert_eq!(
        result,
        ModelResult {
            message: Message {
                role: Role::Assistant,
                content: vec![
                    Block::text("Reading it."),
                    Block::ToolUse {
                        id: "call_2".into(),
                        name: "bash".into(),
                        input: json!({"command": "cat a.txt"}),
                    },
                ],
            },
            stop_reason: StopReason::ToolUse,
            usage: Usage {
                input_tokens: Some(120),
                output_tokens: Some(15),
                ..Usage::default()
            },
            model: Some("gpt-test-2025-01-01".into()),
        }
    );
    // Counters the server did not report are absent on the wire, not zero.
    assert_eq!(
        serde_json::to_value(&result.usage).expect("serializable"),
        json!({"input_tokens": 120, "output_tokens": 15})
    );
}

#[test]
fn openai_without_usage_reports_no_counters() {
    let response = json!({
        "model": "llama-3",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Hello"}}]
    });
    let (base, _requests) = serve(Answer::Respond(200, response.to_string()));
    let result = call(
        openai(&base),
        metadata("openai", "llama-3", None),
        ModelRequest {
            system: None,
            messages: vec![Message::text(Role::User, "Hi")],
            tools: None,
            max_output_tokens: None,
            options: None,
        },
    )
    .expect("a result");
    assert_eq!(result.stop_reason, StopReason::EndTurn);
    assert_eq!(result.message, Message::text(Role::Assistant, "Hello"));
    assert_eq!(result.usage, Usage::default());
}

#[test]
fn openai_error_status_fails_with_the_servers_message() {
    let body = json!({"error": {
        "message": format!("Incorrect API key provided: sk-test-********************cdef. \
                            You can find your API key at the dashboard."),
        "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}});
    let (base, _requests) = serve(Answer::Respond(401, body.to_string()));
    let message = failed_message(
        call(
            openai(&base),
            metadata("openai", "gpt-test", None),
            conversation(None),
        ),
        OPENAI_KEY,
    );
    assert!(message.contains("HTTP 401"), "{message}");
    assert!(
        message.contains("invalid_request_error/invalid_api_key"),
        "{message}"
    );
    assert!(message.contains("Incorrect API key provided"), "{message}");
    assert!(!message.contains("****"), "{message}");

    let body = json!({"error": {"message": "The server had an error while processing your request.",
                                "type": "server_error", "param": null, "code": null}});
    let (base, _requests) = serve(Answer::Respond(500, body.to_string()));
    let message = failed_message(
        call(
            openai(&base),
            metadata("openai", "gpt-test", None),
            conversation(None),
        ),
        OPENAI_KEY,
    );
    assert!(
        message.contains("HTTP 500") && message.contains("server_error: The server had an error"),
        "{message}"
    );
}

#[test]
fn openai_connection_cut_after_the_request_is_unknown() {
    let (base, requests) = serve(Answer::Close);
    let message = unknown_message(
        call(
            openai(&base),
            metadata("openai", "gpt-test", None),
            conversation(None),
        ),
        OPENAI_KEY,
    );
    assert!(message.contains("was sent"), "{message}");
    // The request did arrive, exactly once.
    requests.recv_timeout(BOUND).expect("the request arrived");
}

#[test]
fn openai_unparseable_success_is_unknown() {
    let (base, _requests) = serve(Answer::Respond(200, "{\"choices\": [".into()));
    let message = unknown_message(
        call(
            openai(&base),
            metadata("openai", "gpt-test", None),
            conversation(None),
        ),
        OPENAI_KEY,
    );
    assert!(message.contains("not a valid response"), "{message}");

    let (base, _requests) = serve(Answer::Respond(200, json!({"choices": []}).to_string()));
    let message = unknown_message(
        call(
            openai(&base),
            metadata("openai", "gpt-test", None),
            conversation(None),
        ),
        OPENAI_KEY,
    );
    assert!(message.contains("no choices"), "{message}");
}

#[test]
fn openai_cancel_while_waiting_returns_promptly() {
    cancel_while_the_server_holds_the_answer(openai);
}

#[test]
fn openai_unreachable_port_fails_definitely() {
    unreachable_port_fails(openai, OPENAI_KEY);
}

// ------------------------------------------------------------------------------------------------
// Anthropic Messages.

#[test]
fn anthropic_request_and_response_map_both_ways() {
    let thinking = json!({"type": "thinking", "thinking": "ls showed a.txt", "signature": "sig=="});
    let response = json!({
        "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-test-20250101",
        "content": [thinking.clone(), {"type": "text", "text": "Reading it."},
                    {"type": "tool_use", "id": "toolu_02", "name": "bash",
                     "input": {"command": "cat a.txt"}}],
        "stop_reason": "tool_use", "stop_sequence": null,
        "usage": {"input_tokens": 210, "output_tokens": 31}
    });
    let (base, requests) = serve(Answer::Respond(200, response.to_string()));
    let result = call(
        anthropic(&base),
        metadata("anthropic", "claude-test", Some(8192)),
        conversation(None),
    )
    .expect("a result");

    let sent = requests.recv_timeout(BOUND).expect("the request");
    assert_eq!(sent.method, "POST");
    assert_eq!(sent.path, "/v1/messages");
    assert_eq!(sent.header("x-api-key"), Some(ANTHROPIC_KEY));
    assert_eq!(sent.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(sent.header("authorization"), None);
    assert_eq!(
        sent.body,
        json!({
            "model": "claude-test",
            // No limit in the request: the model metadata's.
            "max_tokens": 8192,
            "system": "You are terse.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "call_1", "name": "bash",
                     "input": {"command": "ls"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1",
                     "content": [{"type": "text", "text": "a.txt\nb.txt"}], "is_error": false},
                    {"type": "text", "text": "Now read a.txt."}]}
            ],
            "tools": [{"name": "bash", "description": "Run a command",
                       "input_schema": {"type": "object",
                                        "properties": {"command": {"type": "string"}}}}]
        })
    );

    assert_eq!(
        result,
        ModelResult {
            message: Message {
                role: Role::Assistant,
                content: vec![
                    Block::Native {
                        format: AnthropicProvider::NATIVE_FORMAT.into(),
                        data: thinking,
                    },
                    Block::text("Reading it."),
                    Block::ToolUse {
                        id: "toolu_02".into(),
                        name: "bash".into(),
                        input: json!({"command": "cat a.txt"}),
                    },
                ],
            },
            stop_reason: StopReason::ToolUse,
            usage: Usage {
                input_tokens: Some(210),
                output_tokens: Some(31),
                ..Usage::default()
            },
            model: Some("claude-test-20250101".into()),
        }
    );
    assert_eq!(
        serde_json::to_value(&result.usage).expect("serializable"),
        json!({"input_tokens": 210, "output_tokens": 31})
    );
}

#[test]
fn anthropic_uses_the_requests_limit_then_the_default_and_reports_cache_counters() {
    let response = json!({
        "id": "msg_02", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "text", "text": "Done."}],
        "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_input_tokens": 100,
                  "cache_creation_input_tokens": 0}
    });
    let (base, requests) = serve(Answer::Respond(200, response.to_string()));
    let result = call(
        anthropic(&base),
        metadata("anthropic", "claude-test", Some(8192)),
        conversation(Some(256)),
    )
    .expect("a result");
    assert_eq!(
        requests.recv_timeout(BOUND).expect("sent").body["max_tokens"],
        256
    );
    assert_eq!(result.stop_reason, StopReason::EndTurn);
    assert_eq!(
        result.usage,
        Usage {
            input_tokens: Some(3),
            output_tokens: Some(2),
            cache_read_input_tokens: Some(100),
            cache_creation_input_tokens: Some(0),
            reasoning_tokens: None,
        }
    );

    let (base, requests) = serve(Answer::Respond(200, response.to_string()));
    call(
        anthropic(&base),
        metadata("anthropic", "claude-test", None),
        conversation(None),
    )
    .expect("a result");
    assert_eq!(
        requests.recv_timeout(BOUND).expect("sent").body["max_tokens"],
        4096
    );
}

#[test]
fn anthropic_error_status_fails_with_the_apis_message() {
    let body = json!({"type": "error",
                      "error": {"type": "overloaded_error", "message": "Overloaded"},
                      "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy"});
    let (base, _requests) = serve(Answer::Respond(529, body.to_string()));
    let message = failed_message(
        call(
            anthropic(&base),
            metadata("anthropic", "claude-test", None),
            conversation(None),
        ),
        ANTHROPIC_KEY,
    );
    assert!(
        message.contains("HTTP 529") && message.contains("overloaded_error: Overloaded"),
        "{message}"
    );
    assert!(
        message.contains("req_011CSHoEeqs5C35K2UUqR7Fy"),
        "{message}"
    );

    let body = json!({"type": "error", "error": {"type": "invalid_request_error",
                      "message": "max_tokens: Field required"}});
    let (base, _requests) = serve(Answer::Respond(400, body.to_string()));
    let message = failed_message(
        call(
            anthropic(&base),
            metadata("anthropic", "claude-test", None),
            conversation(None),
        ),
        ANTHROPIC_KEY,
    );
    assert!(
        message.contains("HTTP 400")
            && message.contains("invalid_request_error: max_tokens: Field required"),
        "{message}"
    );
}

#[test]
fn anthropic_connection_cut_after_the_request_is_unknown() {
    let (base, requests) = serve(Answer::Close);
    let message = unknown_message(
        call(
            anthropic(&base),
            metadata("anthropic", "claude-test", None),
            conversation(None),
        ),
        ANTHROPIC_KEY,
    );
    assert!(message.contains("was sent"), "{message}");
    requests.recv_timeout(BOUND).expect("the request arrived");
}

#[test]
fn anthropic_unparseable_success_is_unknown() {
    let (base, _requests) = serve(Answer::Respond(200, "<html>oops</html>".into()));
    let message = unknown_message(
        call(
            anthropic(&base),
            metadata("anthropic", "claude-test", None),
            conversation(None),
        ),
        ANTHROPIC_KEY,
    );
    assert!(message.contains("not JSON"), "{message}");
}

#[test]
fn anthropic_cancel_while_waiting_returns_promptly() {
    cancel_while_the_server_holds_the_answer(anthropic);
}

#[test]
fn anthropic_unreachable_port_fails_definitely() {
    unreachable_port_fails(anthropic, ANTHROPIC_KEY);
}

// ------------------------------------------------------------------------------------------------
// Shared.

/// The server reads the request and holds the answer; a cancel then ends the call at once with
/// `Cancelled { sent: true }`.
fn cancel_while_the_server_holds_the_answer(provider: MakeProvider) {
    let (release, held) = bounded::<()>(1);
    let (base, requests) = serve(Answer::Hold(held));
    let cancel = CancelToken::new();
    let result = call_in_background(
        provider(&base),
        metadata("any", "model", None),
        conversation(None),
        cancel.clone(),
    );
    requests
        .recv_timeout(BOUND)
        .expect("the server read the request");
    assert!(
        result.try_recv().is_err(),
        "the call must still be waiting for the answer"
    );
    let cancelled_at = Instant::now();
    cancel.cancel();
    let outcome = result
        .recv_timeout(BOUND)
        .expect("the call returns after the cancel");
    assert_eq!(outcome, Err(EffectError::Cancelled { sent: true }));
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(5),
        "took {:?}",
        cancelled_at.elapsed()
    );
    drop(release);
}

/// Nothing listens on the port: nothing was sent, so the call failed definitely.
fn unreachable_port_fails(provider: MakeProvider, key: &str) {
    let closed = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = closed.local_addr().expect("an address");
    drop(closed);
    let message = failed_message(
        call(
            provider(&format!("http://{address}")),
            metadata("any", "model", None),
            conversation(None),
        ),
        key,
    );
    assert!(message.contains("could not send"), "{message}");
}

#[test]
fn a_deadline_after_the_request_was_sent_is_unknown() {
    let short = Duration::from_millis(300);
    let providers: [(MakeProvider, &str); 2] = [
        (
            |base| {
                Box::new(
                    OpenAiProvider::new(base, OPENAI_KEY).with_timeout(Duration::from_millis(300)),
                )
            },
            OPENAI_KEY,
        ),
        (
            |base| {
                Box::new(
                    AnthropicProvider::new(base, ANTHROPIC_KEY)
                        .with_timeout(Duration::from_millis(300)),
                )
            },
            ANTHROPIC_KEY,
        ),
    ];
    for (provider, key) in providers {
        let (_release, held) = bounded::<()>(1);
        let (base, requests) = serve(Answer::Hold(held));
        let started = Instant::now();
        let message = unknown_message(
            call(
                provider(&base),
                metadata("any", "model", None),
                conversation(None),
            ),
            key,
        );
        assert!(started.elapsed() >= short, "{:?}", started.elapsed());
        assert!(
            message.contains("was sent") && message.contains("timeout"),
            "{message}"
        );
        requests.recv_timeout(BOUND).expect("the request arrived");
    }
}

#[test]
fn a_failed_tls_handshake_fails_definitely() {
    for (provider, key) in [
        (openai as MakeProvider, OPENAI_KEY),
        (anthropic, ANTHROPIC_KEY),
    ] {
        let (base, _requests) = serve(Answer::PlainAtOnce);
        let https = base.replacen("http://", "https://", 1);
        let message = failed_message(
            call(
                provider(&https),
                metadata("any", "model", None),
                conversation(None),
            ),
            key,
        );
        assert!(message.contains("could not send"), "{message}");
    }
}

#[test]
fn a_call_cancelled_before_it_starts_sends_nothing() {
    let (base, requests) = serve(Answer::Respond(200, "{}".into()));
    for provider in [openai(&base), anthropic(&base)] {
        let cancel = CancelToken::new();
        cancel.cancel();
        let outcome = call_in_background(
            provider,
            metadata("any", "model", None),
            conversation(None),
            cancel,
        )
        .recv_timeout(BOUND)
        .expect("the call returns");
        assert_eq!(outcome, Err(EffectError::Cancelled { sent: false }));
    }
    assert!(requests.try_recv().is_err(), "nothing reached the server");
}

#[test]
fn providers_never_show_their_keys() {
    let openai = OpenAiProvider::new("https://user:pw@example.com/v1", OPENAI_KEY)
        .with_timeout(Duration::from_secs(5));
    let anthropic = AnthropicProvider::new("https://example.com", ANTHROPIC_KEY);
    let shown = format!("{openai:?} {anthropic:?}");
    assert!(
        !shown.contains(OPENAI_KEY) && !shown.contains(ANTHROPIC_KEY),
        "{shown}"
    );
    assert!(!shown.contains("pw"), "{shown}");
    assert_eq!(openai.timeout(), Duration::from_secs(5));
    assert_eq!(anthropic.timeout(), AnthropicProvider::DEFAULT_TIMEOUT);
}
