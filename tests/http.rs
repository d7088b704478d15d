//! The HTTP API over real sockets: a real Brain with real harness processes, the server on
//! 127.0.0.1:0, and a minimal HTTP/1.1 client written here over `TcpStream`. Every read is bounded
//! by a read timeout; nothing sleeps to synchronise.

mod common;

use common::http::{Api, Reply, Sse, connect, encode, exchange, read_reply};

use brain::http::{HttpOptions, HttpServer};
use brain::{Brain, Registration};
use common::*;
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "test-token-3f9a1c";

/// A Brain and its HTTP server; stops both when dropped.
struct Server {
    brain: Arc<Brain>,
    http: Option<HttpServer>,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(http) = self.http.take() {
            http.stop();
        }
        self.brain.shutdown(Duration::ZERO);
    }
}

/// What a message sent with [`Api::message_in_background`] was answered.
fn answered(waiter: std::thread::JoinHandle<std::io::Result<Reply>>) -> Reply {
    waiter.join().expect("the waiter").expect("a reply")
}

fn reference() -> Registration {
    Registration::new("ref", REFERENCE_HARNESS)
}

fn serve(registrations: Vec<Registration>, tag: &str, options: HttpOptions) -> Server {
    let brain = Arc::new(start(registrations, fast_options(tag)));
    let http = HttpServer::start(brain.clone(), "127.0.0.1:0", TOKEN.to_owned(), options)
        .expect("the HTTP server starts");
    let addr = http.local_addr();
    Server {
        brain,
        http: Some(http),
        addr,
    }
}

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

impl Api for Server {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn token(&self) -> &str {
        TOKEN
    }
}

impl Server {
    /// Blocks (bounded) until the session's journal holds `count` records of `kind`.
    fn wait_for_records(&self, id: &str, kind: &str, count: usize) {
        let id = brain::session::SessionId::parse(id).expect("a session id");
        self.brain
            .session(&id)
            .wait_for_events(WAIT, |events| {
                events.iter().filter(|e| e.event_type == kind).count() >= count
            })
            .unwrap_or_else(|_| panic!("session {id} has no {count} {kind} records"));
    }

    fn kinds(&self, id: &str) -> Vec<String> {
        let page = self
            .call("GET", &format!("/v1/sessions/{id}/events?limit=1000"), None)
            .expect(200, None)
            .json();
        page["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e["type"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

#[test]
fn every_v1_route_refuses_a_missing_or_wrong_token() {
    let server = serve(vec![reference()], "http-auth", HttpOptions::default());
    let id = server.create("ref", json!({}));
    let routes = [
        ("GET", "/v1/sessions".to_owned()),
        ("POST", "/v1/sessions".to_owned()),
        ("GET", format!("/v1/sessions/{id}")),
        ("DELETE", format!("/v1/sessions/{id}")),
        ("POST", format!("/v1/sessions/{id}/messages")),
        ("POST", format!("/v1/sessions/{id}/events")),
        ("GET", format!("/v1/sessions/{id}/events")),
        ("POST", format!("/v1/sessions/{id}/activations")),
        ("POST", format!("/v1/sessions/{id}/cancel")),
        ("POST", format!("/v1/sessions/{id}/passivate")),
        ("POST", format!("/v1/sessions/{id}/close")),
        ("GET", format!("/v1/sessions/{id}/transcript")),
        ("GET", "/v1/no-such-route".to_owned()),
    ];
    let wrong = format!("Bearer {TOKEN}x");
    let short = format!("Bearer {}", &TOKEN[..TOKEN.len() - 1]);
    let basic = format!("Basic {TOKEN}");
    for (method, path) in &routes {
        for auth in [
            None,
            Some(wrong.as_str()),
            Some(short.as_str()),
            Some(basic.as_str()),
        ] {
            let mut headers = vec![("connection", "close")];
            if let Some(auth) = auth {
                headers.push(("authorization", auth));
            }
            let reply = exchange(server.addr, &encode(method, path, &headers, b""));
            assert_eq!(reply.status, 401, "{method} {path} with {auth:?}");
            assert_eq!(reply.header("www-authenticate"), Some("Bearer"));
            assert_eq!(reply.code(), "invalid_request");
        }
    }
    // Nothing was done by the refused requests.
    let view = server
        .call("GET", &format!("/v1/sessions/{id}"), None)
        .expect(200, None);
    assert_eq!(view.json()["status"], "open");
    // The probes need no token.
    exchange(server.addr, &encode("GET", "/health/live", &[], b"")).expect(204, None);
    exchange(server.addr, &encode("GET", "/health/ready", &[], b"")).expect(204, None);
}

#[test]
fn sessions_are_created_viewed_listed_and_refused_with_the_right_status() {
    let server = serve(vec![reference()], "http-create", HttpOptions::default());
    let id = server.create("ref", json!({}));
    let view = server
        .call("GET", &format!("/v1/sessions/{id}"), None)
        .expect(200, None)
        .json();
    assert_eq!(view["session_id"], id.as_str());
    assert_eq!(view["status"], "open");
    assert_eq!(view["registration"], "ref");
    let list = server.call("GET", "/v1/sessions", None).expect(200, None);
    assert!(
        list.json()["sessions"]
            .as_array()
            .expect("sessions")
            .iter()
            .any(|s| s["session_id"] == id.as_str())
    );

    let post = |body: &[u8], content_type: &str| {
        let auth = bearer();
        exchange(
            server.addr,
            &encode(
                "POST",
                "/v1/sessions",
                &[("authorization", &auth), ("content-type", content_type)],
                body,
            ),
        )
    };
    // Malformed JSON is 400; a parsed body with a bad field is 422.
    post(b"{\"agentloop\":", "application/json").expect(400, Some("invalid_request"));
    post(b"", "application/json").expect(400, Some("invalid_request"));
    post(b"[1]", "application/json").expect(422, Some("invalid_request"));
    let unknown_key = post(
        br#"{"agentloop": {"name": "ref"}, "colour": "blue"}"#,
        "application/json; charset=utf-8",
    )
    .expect(422, Some("invalid_request"));
    assert!(
        unknown_key.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("colour")
    );
    post(
        br#"{"agentloop": {"name": "ref", "command": "sh"}}"#,
        "application/json",
    )
    .expect(422, Some("invalid_request"));
    post(br#"{"model": null}"#, "application/json").expect(422, Some("invalid_request"));
    post(br#"{"agentloop": {"name": "nope"}}"#, "application/json")
        .expect(404, Some("unknown_agentloop"));
    post(br#"{"agentloop": {"name": "ref"}}"#, "text/plain").expect(415, Some("invalid_request"));
    let untyped = exchange(
        server.addr,
        &encode(
            "POST",
            "/v1/sessions",
            &[("authorization", &bearer())],
            br#"{"agentloop": {"name": "ref"}}"#,
        ),
    );
    untyped.expect(415, Some("invalid_request"));

    // Ids in paths are validated before use.
    for bad in [
        "nope",
        "ses_..%2F..%2Fetc",
        "ses_%2e%2e",
        "ses_0123456789abcdefghijK",
    ] {
        server
            .call("GET", &format!("/v1/sessions/{bad}"), None)
            .expect(400, Some("invalid_request"));
    }
    server
        .call(
            "GET",
            "/v1/sessions/ses_00000000000000000000/transcript",
            None,
        )
        .expect(404, Some("unknown_session"));
    server
        .call(
            "POST",
            "/v1/sessions/ses_00000000000000000000/messages",
            Some(json!({"content": []})),
        )
        .expect(404, Some("unknown_session"));
    let refused = server.call("PUT", &format!("/v1/sessions/{id}"), None);
    assert_eq!(refused.status, 405);
    assert_eq!(refused.header("allow"), Some("GET, DELETE"));
    server
        .call("GET", "/v1/sessions/x/y/z", None)
        .expect(404, Some("invalid_request"));
    server
        .call("GET", &format!("/v1/sessions/{id}/events?after=x"), None)
        .expect(400, Some("invalid_request"));
    server
        .call("GET", &format!("/v1/sessions/{id}/events?limit=0"), None)
        .expect(400, Some("invalid_request"));
    server
        .call("GET", &format!("/v1/sessions/{id}/events?after=%zz"), None)
        .expect(400, Some("invalid_request"));
}

#[test]
fn a_message_answers_its_outcome_and_the_transcript_and_events_show_it() {
    let server = serve(vec![reference()], "http-message", HttpOptions::default());
    let id = server.create("ref", json!({}));
    let outcome = server
        .message(&id, "hello over http", &[])
        .expect(200, None)
        .json();
    assert_eq!(outcome["session_id"], id.as_str());
    assert_eq!(outcome["outcome"], "completed", "{outcome}");
    assert_eq!(outcome["result"]["text"], "hello over http", "{outcome}");
    let sequence = outcome["sequence"].as_u64().expect("a sequence");

    let transcript = server
        .call("GET", &format!("/v1/sessions/{id}/transcript"), None)
        .expect(200, None)
        .json();
    let messages = transcript["messages"].as_array().expect("messages");
    assert!(messages.len() >= 2, "{transcript}");
    assert_eq!(messages[0]["content"][0]["text"], "hello over http");
    assert!(transcript["through"].as_u64().expect("through") > sequence);

    // Pages of the journal.
    let all = server.kinds(&id);
    assert_eq!(all[0], "session_created");
    assert!(all.contains(&"activation_finished".to_owned()), "{all:?}");
    let page = server
        .call(
            "GET",
            &format!("/v1/sessions/{id}/events?after=1&limit=2"),
            None,
        )
        .expect(200, None)
        .json();
    let sequences: Vec<u64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(sequences, [2, 3]);
    assert_eq!(page["next_after"], 3);
    assert_eq!(page["events"][0]["type"], "activation_queued");
    let past_the_end = server
        .call(
            "GET",
            &format!("/v1/sessions/{id}/events?after=100000"),
            None,
        )
        .expect(200, None)
        .json();
    assert_eq!(past_the_end["events"], json!([]));
    assert_eq!(past_the_end["next_after"], 100000);

    // Malformed and invalid inputs are refused without admitting anything.
    let before = server.kinds(&id).len();
    let auth = bearer();
    exchange(
        server.addr,
        &encode(
            "POST",
            &format!("/v1/sessions/{id}/messages"),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            b"{not json",
        ),
    )
    .expect(400, Some("invalid_request"));
    server
        .call(
            "POST",
            &format!("/v1/sessions/{id}/messages"),
            Some(json!({"content": "hi", "x": 1})),
        )
        .expect(422, Some("invalid_request"));
    server
        .call(
            "POST",
            &format!("/v1/sessions/{id}/messages"),
            Some(json!({"content": [{"type": "sound"}]})),
        )
        .expect(422, Some("invalid_request"));
    assert_eq!(server.kinds(&id).len(), before);

    // Passivate, then a message reopens it.
    let passivated = server
        .call("POST", &format!("/v1/sessions/{id}/passivate"), None)
        .expect(200, None)
        .json();
    assert_eq!(passivated["status"], "passivated");
    let again = server.message(&id, "again", &[]).expect(200, None).json();
    assert_eq!(again["result"]["text"], "again");
}

#[test]
fn client_events_event_only_activations_and_async_messages() {
    let server = serve(vec![fault("f", &[])], "http-events", HttpOptions::default());
    let id = server.create("f", json!({}));
    let appended = server
        .call(
            "POST",
            &format!("/v1/sessions/{id}/events"),
            Some(json!({"type": "note", "data": {"n": 1}})),
        )
        .expect(201, None)
        .json();
    let sequence = appended["sequence"].as_u64().expect("a sequence");
    for bad in [
        json!({"data": 1}),
        json!({"type": 5}),
        json!({"type": "x", "extra": 1}),
    ] {
        server
            .call("POST", &format!("/v1/sessions/{id}/events"), Some(bad))
            .expect(422, Some("invalid_request"));
    }
    // An event-only activation delivers it: the echo harness shows its input.
    let outcome = server
        .call("POST", &format!("/v1/sessions/{id}/activations"), None)
        .expect(200, None)
        .json();
    assert_eq!(outcome["outcome"], "completed", "{outcome}");
    let echoed = outcome["result"]["echo"]["input"]["events"].to_string();
    assert!(echoed.contains("\"note\""), "{outcome}");
    assert!(echoed.contains(&sequence.to_string()), "{outcome}");
    server
        .call(
            "POST",
            &format!("/v1/sessions/{id}/activations"),
            Some(json!({"x": 1})),
        )
        .expect(422, Some("invalid_request"));

    // Preferences Brain does not know are ignored, as RFC 7240 asks: the request waits as usual.
    let waited = server
        .message(&id, "waits", &[("prefer", "handling=lenient, wait=5")])
        .expect(200, None);
    assert_eq!(waited.header("preference-applied"), None);
    assert_eq!(waited.json()["outcome"], "completed");

    // Prefer: respond-async answers 202 at once; the outcome lands in the journal.
    let accepted = server
        .message(&id, "later", &[("prefer", "respond-async")])
        .expect(202, None);
    assert_eq!(accepted.header("preference-applied"), Some("respond-async"));
    let accepted = accepted.json();
    assert_eq!(accepted["session_id"], id.as_str());
    let sequence = accepted["sequence"].as_u64().expect("a sequence");
    server.wait_for_records(&id, "activation_finished", 3);
    let page = server
        .call(
            "GET",
            &format!("/v1/sessions/{id}/events?after={sequence}"),
            None,
        )
        .expect(200, None)
        .json();
    let finished = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "activation_finished")
        .cloned()
        .expect("the outcome is in the journal");
    assert!(finished.to_string().contains("completed"), "{finished}");
}

#[test]
fn cancelling_a_running_activation_interrupts_the_session_and_lifecycle_statuses_follow() {
    let server = serve(vec![fault("f", &[])], "http-cancel", HttpOptions::default());
    let id = server.create("f", json!({"fault": "hang"}));
    // The message waits for its outcome on a thread of the test.
    let waiter = server.message_in_background(&id, "hang");
    server.wait_for_records(&id, "activation_started", 1);
    server
        .message(&id, "again", &[])
        .expect(409, Some("session_busy"));
    server
        .call("POST", &format!("/v1/sessions/{id}/passivate"), None)
        .expect(409, Some("session_busy"));
    server
        .call("DELETE", &format!("/v1/sessions/{id}"), None)
        .expect(409, Some("session_busy"));

    let cancelled = server
        .call("POST", &format!("/v1/sessions/{id}/cancel"), None)
        .expect(200, None)
        .json();
    let outcome = answered(waiter).expect(200, None).json();
    assert_eq!(outcome["outcome"], "cancelled", "{outcome}");
    assert_eq!(outcome["error"]["code"], "cancelled", "{outcome}");
    let sequence = outcome["sequence"].as_u64().expect("a sequence");
    assert_eq!(
        cancelled,
        json!({"sequence": sequence, "was_running": true, "interrupted": true})
    );
    let view = server
        .call("GET", &format!("/v1/sessions/{id}"), None)
        .expect(200, None)
        .json();
    assert_eq!(view["status"], "interrupted", "{view}");
    server
        .message(&id, "again", &[])
        .expect(409, Some("session_interrupted"));
    server
        .call("POST", &format!("/v1/sessions/{id}/cancel"), None)
        .expect(409, Some("activation_not_active"));

    // An open session cannot be deleted; a closed one can, and is gone.
    let open = server.create("f", json!({}));
    server
        .call("DELETE", &format!("/v1/sessions/{open}"), None)
        .expect(422, Some("invalid_request"));
    let closed = server
        .call("POST", &format!("/v1/sessions/{open}/close"), None)
        .expect(200, None)
        .json();
    assert_eq!(closed["status"], "closed");
    server
        .message(&open, "late", &[])
        .expect(409, Some("session_closed"));
    server
        .call("DELETE", &format!("/v1/sessions/{open}"), None)
        .expect(204, None);
    server
        .call("GET", &format!("/v1/sessions/{open}"), None)
        .expect(404, Some("unknown_session"));
    server
        .call("GET", &format!("/v1/sessions/{open}/events"), None)
        .expect(404, Some("unknown_session"));
    // The interrupted one can be deleted too.
    server
        .call("DELETE", &format!("/v1/sessions/{id}"), None)
        .expect(204, None);
    server
        .call("DELETE", &format!("/v1/sessions/{id}"), None)
        .expect(404, Some("unknown_session"));
}

#[test]
fn a_new_session_can_continue_a_closed_one_with_from() {
    let server = serve(
        vec![reference(), fault("f", &[])],
        "http-from",
        HttpOptions::default(),
    );
    let old = server.create("ref", json!({}));
    server.message(&old, "remember me", &[]).expect(200, None);
    // Still open: it cannot be continued yet.
    server
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"from": old, "agentloop": {"name": "ref"}})),
        )
        .expect(422, Some("invalid_request"));
    server
        .call("POST", &format!("/v1/sessions/{old}/close"), None)
        .expect(200, None);
    let created = server
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"from": old, "agentloop": {"name": "ref"}})),
        )
        .expect(201, None)
        .json();
    let new = created["session_id"].as_str().unwrap();
    assert_ne!(new, old);
    let transcript = server
        .call("GET", &format!("/v1/sessions/{new}/transcript"), None)
        .expect(200, None)
        .json();
    assert!(
        transcript.to_string().contains("remember me"),
        "{transcript}"
    );
    server
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"from": "../x", "agentloop": {"name": "ref"}})),
        )
        .expect(422, Some("invalid_request"));
    server
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"from": "ses_00000000000000000000", "agentloop": {"name": "ref"}})),
        )
        .expect(404, Some("unknown_session"));
}

/// Opens an SSE stream and checks its head.
fn open_stream(server: &Server, id: &str, headers: &[(&str, &str)]) -> Sse {
    let stream = connect(server.addr);
    let auth = bearer();
    let mut all = vec![
        ("authorization", auth.as_str()),
        ("accept", "text/event-stream"),
    ];
    all.extend_from_slice(headers);
    (&stream)
        .write_all(&encode(
            "GET",
            &format!("/v1/sessions/{id}/events"),
            &all,
            b"",
        ))
        .expect("send");
    Sse::open(stream)
}

#[test]
fn sse_catches_up_follows_live_and_resumes_from_last_event_id() {
    let server = serve(vec![reference()], "http-sse", HttpOptions::default());
    let id = server.create("ref", json!({}));
    server.message(&id, "first", &[]).expect(200, None);

    let mut stream = open_stream(&server, &id, &[]);
    let caught_up = stream.until(|e| e.event == "activation_finished");
    let ids: Vec<u64> = caught_up.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>());
    assert_eq!(caught_up[0].event, "session_created");
    for event in &caught_up {
        assert_eq!(event.data["sequence"], event.id);
        assert_eq!(event.data["type"], event.event.as_str());
    }
    let last = caught_up.last().unwrap().id;

    // Live: a second turn's records arrive on the open stream.
    server.message(&id, "second", &[]).expect(200, None);
    let live = stream.until(|e| e.event == "activation_finished");
    assert_eq!(live[0].id, last + 1);
    assert_eq!(live[0].event, "activation_queued");
    assert!(live[0].data.to_string().contains("second"));
    let end = live.last().unwrap().id;
    drop(stream);

    // Resume: Last-Event-ID wins over the query and starts after it.
    let mut resumed = open_stream(&server, &id, &[("last-event-id", &last.to_string())]);
    let replayed = resumed.until(|e| e.event == "activation_finished");
    assert_eq!(replayed[0].id, last + 1);
    assert_eq!(replayed.last().unwrap().id, end);
    let mut from_query = {
        let stream = connect(server.addr);
        let auth = bearer();
        let headers = [
            ("authorization", auth.as_str()),
            ("accept", "text/event-stream"),
        ];
        (&stream)
            .write_all(&encode(
                "GET",
                &format!("/v1/sessions/{id}/events?after={}", end - 1),
                &headers,
                b"",
            ))
            .unwrap();
        Sse::open(stream)
    };
    assert_eq!(from_query.next().id, end);

    // An unknown session is refused with its status, not streamed; a bad Last-Event-ID is 400.
    let unknown = server.call_with(
        "GET",
        "/v1/sessions/ses_00000000000000000000/events",
        &[("accept", "text/event-stream")],
        None,
    );
    unknown.expect(404, Some("unknown_session"));
    server
        .call_with(
            "GET",
            &format!("/v1/sessions/{id}/events"),
            &[("accept", "text/event-stream"), ("last-event-id", "x")],
            None,
        )
        .expect(400, Some("invalid_request"));
    // So it is on a page, which does not use it (found by schemathesis: it was ignored there).
    let refused = server
        .call_with(
            "GET",
            &format!("/v1/sessions/{id}/events"),
            &[("last-event-id", "")],
            None,
        )
        .expect(400, Some("invalid_request"));
    assert!(
        refused.text().contains("Last-Event-ID"),
        "{}",
        refused.text()
    );

    // Stopping the server ends open streams.
    let mut server = server;
    server.http.take().unwrap().stop();
    let mut rest = Vec::new();
    let ended = resumed.0.read_to_end(&mut rest);
    assert!(ended.is_ok(), "the stream ends cleanly: {ended:?}");
}

#[test]
fn long_waits_and_sse_streams_are_bounded() {
    let options = HttpOptions {
        max_long_waits: 1,
        max_sse: 1,
        ..HttpOptions::default()
    };
    let server = serve(vec![fault("f", &[]).workers(2)], "http-bounds", options);
    let held = server.create("f", json!({"fault": "hang"}));
    let other = server.create("f", json!({"fault": "hang"}));

    // The one long wait is held by a message on a hanging session.
    let waiter = server.message_in_background(&held, "hold");
    // Its permit is taken before the activation is admitted.
    server.wait_for_records(&held, "activation_started", 1);
    let refused = server
        .message(&other, "second", &[])
        .expect(503, Some("overloaded"));
    assert_eq!(refused.header("retry-after"), Some("1"));
    // A refused message was not admitted.
    assert_eq!(server.kinds(&other), ["session_created"]);
    // Without waiting, it is admitted.
    server
        .message(&other, "async", &[("prefer", "respond-async")])
        .expect(202, None);

    // One SSE stream; the second is refused.
    let _stream = open_stream(&server, &held, &[]);
    server
        .call_with(
            "GET",
            &format!("/v1/sessions/{other}/events"),
            &[("accept", "text/event-stream")],
            None,
        )
        .expect(503, Some("overloaded"));
    // Pages are not streams: still served.
    server
        .call("GET", &format!("/v1/sessions/{other}/events"), None)
        .expect(200, None);

    // Cancelling the held activation answers the waiting request with its outcome.
    server
        .call("POST", &format!("/v1/sessions/{held}/cancel"), None)
        .expect(200, None);
    let outcome = answered(waiter).expect(200, None).json();
    assert_eq!(outcome["outcome"], "cancelled", "{outcome}");
    assert_eq!(outcome["error"]["code"], "cancelled", "{outcome}");
}

#[test]
fn bodies_over_the_limit_and_malformed_framing_are_refused() {
    let options = HttpOptions {
        max_body_bytes: 1024,
        ..HttpOptions::default()
    };
    let server = serve(vec![reference()], "http-limits", options);
    let auth = bearer();
    let json = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    let big = format!(
        r#"{{"agentloop": {{"name": "ref"}}, "metadata": {{"pad": "{}"}}}}"#,
        "x".repeat(2048)
    );
    let reply = exchange(
        server.addr,
        &encode("POST", "/v1/sessions", &json, big.as_bytes()),
    )
    .expect(413, Some("input_too_large"));
    assert_eq!(reply.header("connection"), Some("close"));
    // Refused on the Content-Length alone, before any of the body is sent.
    let head = format!(
        "POST /v1/sessions HTTP/1.1\r\nauthorization: {auth}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        64 * 1024 * 1024
    );
    exchange(server.addr, head.as_bytes()).expect(413, Some("input_too_large"));
    let chunked = format!(
        "POST /v1/sessions HTTP/1.1\r\nauthorization: {auth}\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    );
    exchange(server.addr, chunked.as_bytes()).expect(411, Some("invalid_request"));
    let huge_header = format!(
        "GET /health/live HTTP/1.1\r\nx-pad: {}\r\n\r\n",
        "y".repeat(20 * 1024)
    );
    exchange(server.addr, huge_header.as_bytes()).expect(431, Some("invalid_request"));
    exchange(server.addr, b"NOT A REQUEST\r\n\r\n").expect(400, Some("invalid_request"));
    // Expect: 100-continue gets the interim answer, then the final one.
    let body = br#"{"agentloop": {"name": "ref"}}"#;
    let stream = connect(server.addr);
    let head = format!(
        "POST /v1/sessions HTTP/1.1\r\nauthorization: {auth}\r\ncontent-type: application/json\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    (&stream).write_all(head.as_bytes()).unwrap();
    let mut reader = BufReader::new(stream);
    let mut interim = String::new();
    reader.read_line(&mut interim).unwrap();
    assert_eq!(interim, "HTTP/1.1 100 Continue\r\n");
    reader.read_line(&mut interim).unwrap();
    let mut writer = reader.get_ref();
    writer.write_all(body).unwrap();
    read_reply(&mut reader).unwrap().expect(201, None);
}

#[test]
fn connections_are_kept_alive_and_pipelined() {
    let server = serve(vec![reference()], "http-keepalive", HttpOptions::default());
    let stream = connect(server.addr);
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let auth = bearer();
    let headers = [("authorization", auth.as_str())];
    for _ in 0..3 {
        (&stream)
            .write_all(&encode("GET", "/v1/sessions", &headers, b""))
            .unwrap();
        let reply = read_reply(&mut reader).unwrap().expect(200, None);
        assert_eq!(reply.header("connection"), None);
    }
    // Two requests in one write; the answers come in order.
    let mut both = encode("GET", "/health/live", &[], b"");
    both.extend(encode("GET", "/v1/nothing", &headers, b""));
    (&stream).write_all(&both).unwrap();
    read_reply(&mut reader).unwrap().expect(204, None);
    read_reply(&mut reader).unwrap().expect(404, None);
    // Connection: close is honoured.
    (&stream)
        .write_all(&encode(
            "GET",
            "/health/live",
            &[("connection", "close")],
            b"",
        ))
        .unwrap();
    let reply = read_reply(&mut reader).unwrap().expect(204, None);
    assert_eq!(reply.header("connection"), Some("close"));
    let mut rest = Vec::new();
    assert_eq!(reader.read_to_end(&mut rest).unwrap(), 0);
}

#[test]
fn slow_and_idle_clients_do_not_block_others() {
    // One worker: a client that sends half a request holds it only until the read timeout.
    let options = HttpOptions {
        threads: 1,
        read_timeout: Duration::from_millis(300),
        ..HttpOptions::default()
    };
    let server = serve(vec![reference()], "http-slow", options);
    let slow = connect(server.addr);
    (&slow)
        .write_all(b"GET /health/live HTTP/1.1\r\nhost: slow\r\n")
        .unwrap();
    exchange(server.addr, &encode("GET", "/health/live", &[], b"")).expect(204, None);
    read_reply(&mut BufReader::new(slow))
        .unwrap()
        .expect(408, Some("invalid_request"));
    drop(server);

    // Idle connections (nothing sent, or kept alive after a request) never hold the worker: with
    // timeouts far beyond WAIT, a request on a third connection is still answered at once.
    let options = HttpOptions {
        threads: 1,
        read_timeout: Duration::from_secs(600),
        idle_timeout: Duration::from_secs(600),
        ..HttpOptions::default()
    };
    let server = serve(vec![reference()], "http-idle", options);
    let _silent = connect(server.addr);
    let kept = connect(server.addr);
    (&kept)
        .write_all(&encode("GET", "/health/live", &[], b""))
        .unwrap();
    read_reply(&mut BufReader::new(kept.try_clone().unwrap()))
        .unwrap()
        .expect(204, None);
    for _ in 0..3 {
        exchange(server.addr, &encode("GET", "/health/live", &[], b"")).expect(204, None);
    }

    // A client trickling a body holds no worker either: its request waits in the accept thread
    // until the whole body is there, while others are answered; then it is answered too.
    let body = json!({"agentloop": {"name": "ref", "configuration": {}}}).to_string();
    let request = create_request(&body);
    let (head_and_half, rest) = request.split_at(request.len() - body.len() / 2);
    let trickling = connect(server.addr);
    (&trickling).write_all(head_and_half).unwrap();
    for _ in 0..3 {
        exchange(server.addr, &encode("GET", "/health/live", &[], b"")).expect(204, None);
    }
    (&trickling).write_all(rest).unwrap();
    read_reply(&mut BufReader::new(trickling))
        .unwrap()
        .expect(201, None);
}

/// The bytes of an authorised `POST /v1/sessions` with this body.
fn create_request(body: &str) -> Vec<u8> {
    let auth = bearer();
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    encode("POST", "/v1/sessions", &headers, body.as_bytes())
}

/// Writes `rest` a byte every 20 ms on its own thread until the server stops reading (it
/// answered and closed); what the server answered.
fn trickle(stream: std::net::TcpStream, rest: Vec<u8>) -> std::thread::JoinHandle<Reply> {
    std::thread::spawn(move || {
        let reader = stream.try_clone().expect("clone the stream");
        let writer = std::thread::spawn(move || {
            for byte in rest {
                if (&stream).write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let reply = read_reply(&mut BufReader::new(reader)).expect("an answer");
        let _ = writer.join();
        reply
    })
}

#[test]
fn a_trickled_body_is_cut_off_at_its_deadline_while_other_requests_are_served() {
    // The deadline is the whole request's, from its first byte: a client that keeps sending a byte
    // now and then is cut off all the same. Small bodies wait in the accept thread, large ones on
    // a request thread; both are cut at the deadline, and others are answered meanwhile.
    let read_timeout = Duration::from_millis(600);
    let options = HttpOptions {
        threads: 2,
        read_timeout,
        ..HttpOptions::default()
    };
    let server = serve(vec![reference()], "http-trickle", options);
    for size in [200, 100 * 1024] {
        let body = format!(
            "{{\"agentloop\": {{\"name\": \"ref\"}}, \"metadata\": {{\"pad\": \"{}\"}}}}",
            "x".repeat(size)
        );
        let request = create_request(&body);
        // The head and all of the body but its last 100 bytes at once; those a byte at a time.
        let (first, rest) = request.split_at(request.len() - 100);
        let stream = connect(server.addr);
        let started = Instant::now();
        (&stream).write_all(first).unwrap();
        let trickling = trickle(stream, rest.to_vec());
        for _ in 0..3 {
            exchange(server.addr, &encode("GET", "/health/live", &[], b"")).expect(204, None);
        }
        let reply = trickling.join().expect("the trickling client");
        let took = started.elapsed();
        reply.expect(408, Some("invalid_request"));
        assert!(
            took >= read_timeout && took < read_timeout + Duration::from_secs(2),
            "a {size}-byte body was cut off after {took:?}, not at its {read_timeout:?} deadline"
        );
    }
    // Nothing was created from the cut-off bodies.
    let sessions = server
        .call("GET", "/v1/sessions", None)
        .expect(200, None)
        .json();
    assert_eq!(sessions["sessions"], json!([]));
}

#[test]
fn readiness_and_metrics_follow_the_pool() {
    let server = serve(vec![reference()], "http-ready", HttpOptions::default());
    exchange(server.addr, &encode("GET", "/health/ready", &[], b"")).expect(204, None);
    let id = server.create("ref", json!({}));
    server.message(&id, "count me", &[]).expect(200, None);
    let metrics = exchange(server.addr, &encode("GET", "/metrics", &[], b"")).expect(200, None);
    assert!(
        metrics
            .header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = String::from_utf8(metrics.body).unwrap();
    assert!(
        text.contains("brain_workers{registration=\"ref\",state=\"healthy\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("brain_http_responses_total{status=\"201\"} 1"),
        "{text}"
    );
    // The gauge itself may still count the waiter that answered: only its bound is fixed.
    assert!(text.contains("brain_http_long_waits_limit 256"), "{text}");
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let value = line.rsplit(' ').next().unwrap();
        assert!(value.parse::<f64>().is_ok(), "not a sample: {line:?}");
    }

    server.brain.shutdown(Duration::ZERO);
    let unready = exchange(server.addr, &encode("GET", "/health/ready", &[], b""))
        .expect(503, Some("shutting_down"));
    assert_eq!(unready.json()["error"]["detail"]["shutting_down"], true);
    assert!(unready.json()["error"]["detail"]["registrations"].is_array());
    server
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "ref"}})),
        )
        .expect(503, Some("shutting_down"));
    exchange(server.addr, &encode("GET", "/health/live", &[], b"")).expect(204, None);
}

/// The SSE streams open, from the metrics.
fn sse_followers(server: &Server) -> u64 {
    let metrics = exchange(server.addr, &encode("GET", "/metrics", &[], b"")).expect(200, None);
    let text = String::from_utf8(metrics.body).unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix("brain_http_sse_followers "))
        .and_then(|count| count.parse().ok())
        .expect("the metrics count SSE followers")
}

#[test]
fn a_slow_sse_reader_is_dropped_and_never_holds_up_the_session() {
    let options = HttpOptions {
        write_timeout: Duration::from_millis(200),
        max_sse: 1,
        ..HttpOptions::default()
    };
    let server = serve(vec![reference()], "http-slow-sse", options);
    let id = server.create("ref", json!({}));
    // The reader takes the head, then stops reading.
    let mut slow = open_stream(&server, &id, &[]);
    // Far more than the socket buffers hold is appended; no append waits for the reader.
    let session = server
        .brain
        .session(&brain::session::SessionId::parse(&id).unwrap());
    let pad = "z".repeat(512 * 1024);
    let mut last = 0;
    for n in 0..24 {
        last = session
            .append_event("pad", json!({"n": n, "pad": pad}))
            .expect("append");
    }
    // The stream is dropped while its reader reads nothing (the appends may end before the
    // stream has filled the socket buffers, so this waits for the drop itself). Reading at
    // last, the reader finds its stream cut short.
    let deadline = Instant::now() + Duration::from_secs(10);
    while sse_followers(&server) > 0 {
        assert!(
            Instant::now() < deadline,
            "the slow reader's stream is still open"
        );
        std::thread::yield_now();
    }
    let mut last_id = 0;
    loop {
        let mut line = String::new();
        let read = slow
            .0
            .read_line(&mut line)
            .expect("the dropped stream ends, rather than staying open");
        if read == 0 {
            break;
        }
        if let Some(id) = line.strip_prefix("id: ") {
            last_id = id.trim().parse().expect("an id");
        }
    }
    assert!(
        last_id < last,
        "the slow reader got every record up to {last}"
    );
    // Its place is free again, and a new stream resumes where it left off.
    let mut again = open_stream(&server, &id, &[("last-event-id", &last_id.to_string())]);
    assert_eq!(again.next().id, last_id + 1);
}
