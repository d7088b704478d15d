//! The real `brain serve` binary, end to end: started as an operator starts it (registrations in
//! `--agentloops`, an ephemeral port read from its log), driven over HTTP by a minimal HTTP/1.1
//! client written here over `TcpStream`, and stopped with real signals.
//!
//! Every wait is bounded: reads by a socket read timeout, log lines and process exits by channel
//! receives with a deadline. Nothing sleeps to synchronise: the tests wait for HTTP answers, SSE
//! records (the fault harness's `announce` event says a run is really executing), log lines and
//! exits. Every process a test starts is killed and reaped when the test ends, pass or fail.

mod common;

use common::http::read_reply;
use common::server::*;

use common::*;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// The log line the dispatcher writes once shutdown has begun with a drain (admission refused).
const DRAINING: &str = "shutting down: draining running activations";

impl Served {
    fn metrics(&self) -> String {
        let reply = self
            .exchange(&encode("GET", "/metrics", &[], b""))
            .expect(200, None);
        assert!(
            reply
                .header("content-type")
                .is_some_and(|t| t.starts_with("text/plain; version=0.0.4")),
            "{:?}",
            reply.headers
        );
        String::from_utf8(reply.body).expect("UTF-8 metrics")
    }
}

fn fault_registration() -> Value {
    json!({"f": {"command": FAULT_HARNESS}})
}

fn data_dir(tag: &str) -> PathBuf {
    temp_dir(tag).join("data")
}

/// Where activation `sequence` is in `events`: its queued record and its outcome record.
fn activation_records(events: &[Value], sequence: u64) -> (Option<&Value>, Option<&Value>) {
    let queued = events
        .iter()
        .find(|e| e["sequence"] == sequence && e["type"] == "activation_queued");
    let finished = events
        .iter()
        .find(|e| e["type"] == "activation_finished" && e["data"]["activation"] == sequence);
    (queued, finished)
}

// ----- the API -----

#[test]
fn sessions_are_created_messaged_synchronously_and_asynchronously_and_run_their_lifecycle() {
    let data = data_dir("e2e-lifecycle");
    let mut server = serve(
        &data,
        json!({"f": {"command": FAULT_HARNESS}, "ref": {"command": REFERENCE_HARNESS}}),
        &[],
    );
    let id = server.create("f", json!({}));

    // Sync: 200 with the outcome and the harness's result.
    let outcome = server.message(&id, "hello", &[]).expect(200, None).json();
    assert_eq!(outcome["session_id"], id.as_str());
    assert_eq!(outcome["outcome"], "completed", "{outcome}");
    assert_eq!(
        outcome["result"]["echo"]["input"]["input"]["content"][0]["text"], "hello",
        "{outcome}"
    );
    let first = outcome["sequence"].as_u64().expect("a sequence");

    // Async: 202 at once; the outcome lands in the journal and shows in the events page.
    let accepted = server
        .message(&id, "later", &[("prefer", "respond-async")])
        .expect(202, None);
    assert_eq!(accepted.header("preference-applied"), Some("respond-async"));
    let accepted = accepted.json();
    assert_eq!(accepted["session_id"], id.as_str());
    let second = accepted["sequence"].as_u64().expect("a sequence");
    assert!(second > first);
    let streamed = server.wait_finished(&id, second);
    assert_eq!(streamed.data["data"]["outcome"], "completed");
    let page = server
        .call(
            "GET",
            &format!("/v1/sessions/{id}/events?after={first}"),
            None,
        )
        .expect(200, None)
        .json();
    let events = page["events"].as_array().expect("events");
    let (queued, finished) = activation_records(events, second);
    assert!(
        queued.is_some_and(|q| q.to_string().contains("later")),
        "{page}"
    );
    let finished = finished.expect("the async outcome in the page");
    assert_eq!(finished["data"]["outcome"], "completed", "{finished}");
    assert_eq!(
        finished["data"]["result"]["echo"]["input"]["input"]["content"][0]["text"],
        "later"
    );
    // The whole journal, paged.
    let kinds: Vec<String> = server
        .events(&id)
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds[0], "session_created");
    assert_eq!(
        kinds.iter().filter(|k| *k == "activation_finished").count(),
        2,
        "{kinds:?}"
    );

    // Listed.
    let list = server.call("GET", "/v1/sessions", None).expect(200, None);
    assert!(
        list.json()["sessions"]
            .as_array()
            .expect("sessions")
            .iter()
            .any(|s| s["session_id"] == id.as_str() && s["status"] == "open"),
        "{}",
        list.text()
    );

    // The transcript the reference harness saves.
    let conversation = server.create("ref", json!({}));
    let answered = server
        .message(&conversation, "hello transcript", &[])
        .expect(200, None)
        .json();
    assert_eq!(answered["outcome"], "completed", "{answered}");
    assert_eq!(answered["result"]["text"], "hello transcript", "{answered}");
    let transcript = server
        .call(
            "GET",
            &format!("/v1/sessions/{conversation}/transcript"),
            None,
        )
        .expect(200, None)
        .json();
    let messages = transcript["messages"].as_array().expect("messages");
    assert!(messages.len() >= 2, "{transcript}");
    assert_eq!(messages[0]["content"][0]["text"], "hello transcript");
    assert!(
        transcript["through"].as_u64().expect("through") > answered["sequence"].as_u64().unwrap(),
        "{transcript}"
    );

    // Passivate; a message reopens the session.
    let passivated = server
        .call("POST", &format!("/v1/sessions/{id}/passivate"), None)
        .expect(200, None)
        .json();
    assert_eq!(passivated["status"], "passivated", "{passivated}");
    assert_eq!(server.view(&id)["status"], "passivated");
    let again = server.message(&id, "again", &[]).expect(200, None).json();
    assert_eq!(again["outcome"], "completed", "{again}");
    assert_eq!(server.view(&id)["status"], "open");

    // An open session cannot be deleted; close it, and it refuses messages; delete it, and it is
    // gone.
    server
        .call("DELETE", &format!("/v1/sessions/{id}"), None)
        .expect(422, Some("invalid_request"));
    let closed = server
        .call("POST", &format!("/v1/sessions/{id}/close"), None)
        .expect(200, None)
        .json();
    assert_eq!(closed["status"], "closed", "{closed}");
    server
        .message(&id, "late", &[])
        .expect(409, Some("session_closed"));
    server
        .call("DELETE", &format!("/v1/sessions/{id}"), None)
        .expect(204, None);
    for (method, path) in [
        ("GET", format!("/v1/sessions/{id}")),
        ("GET", format!("/v1/sessions/{id}/events")),
        ("DELETE", format!("/v1/sessions/{id}")),
    ] {
        server
            .call(method, &path, None)
            .expect(404, Some("unknown_session"));
    }
    server.terminate(WAIT);
}

#[test]
fn cancelling_a_running_activation_interrupts_the_session() {
    let data = data_dir("e2e-cancel");
    let mut server = serve(&data, fault_registration(), &[]);
    let id = server.create("f", json!({"fault": "hang", "announce": true}));
    let waiter = server.message_in_background(&id, "hang");
    let running = server.wait_running(&id);
    let sequence = running.data["origin"]["sequence"]
        .as_u64()
        .expect("the running event names its activation");

    // Busy while it runs.
    server
        .message(&id, "again", &[])
        .expect(409, Some("session_busy"));
    server
        .call("POST", &format!("/v1/sessions/{id}/passivate"), None)
        .expect(409, Some("session_busy"));
    let view = server.view(&id);
    assert_eq!(view["status"], "open", "{view}");
    assert!(!view["active"].is_null(), "{view}");

    let cancelled = server
        .call("POST", &format!("/v1/sessions/{id}/cancel"), None)
        .expect(200, None)
        .json();
    assert_eq!(
        cancelled,
        json!({"sequence": sequence, "was_running": true, "interrupted": true})
    );
    // The waiting request gets the outcome.
    let outcome = waiter
        .join()
        .expect("the waiter thread")
        .expect("the waiting request's answer")
        .expect(200, None)
        .json();
    assert_eq!(outcome["sequence"], sequence, "{outcome}");
    assert_eq!(outcome["outcome"], "cancelled", "{outcome}");
    assert_eq!(outcome["error"]["code"], "cancelled", "{outcome}");

    assert_eq!(server.view(&id)["status"], "interrupted");
    server
        .message(&id, "again", &[])
        .expect(409, Some("session_interrupted"));
    server
        .call("POST", &format!("/v1/sessions/{id}/cancel"), None)
        .expect(409, Some("activation_not_active"));
    let events = server.events(&id);
    let (queued, finished) = activation_records(&events, sequence);
    assert!(queued.is_some(), "{events:?}");
    assert_eq!(
        finished.expect("the outcome record")["data"]["outcome"],
        "cancelled"
    );
    // An interrupted session can be deleted.
    server
        .call("DELETE", &format!("/v1/sessions/{id}"), None)
        .expect(204, None);
    server.terminate(WAIT);
}

#[test]
fn sse_catches_up_then_follows_live_and_resumes_from_last_event_id() {
    let data = data_dir("e2e-sse");
    let mut server = serve(&data, fault_registration(), &[]);
    let id = server.create("f", json!({}));
    server.message(&id, "first", &[]).expect(200, None);

    // Catch-up: the journal so far, ids in order from 1.
    let mut stream = server.open_stream(&id, "", &[]);
    let caught_up = stream.until(|e| e.event == "activation_finished");
    let ids: Vec<u64> = caught_up.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>());
    assert_eq!(caught_up[0].event, "session_created");
    for event in &caught_up {
        assert_eq!(event.data["sequence"], event.id);
        assert_eq!(event.data["type"], event.event.as_str());
    }
    let last = caught_up.last().unwrap().id;

    // Live: a client event appended now arrives on the open stream.
    let appended = server
        .call(
            "POST",
            &format!("/v1/sessions/{id}/events"),
            Some(json!({"type": "note", "data": {"n": 7}})),
        )
        .expect(201, None)
        .json();
    let note = appended["sequence"].as_u64().expect("a sequence");
    assert_eq!(note, last + 1);
    let live = stream.next();
    assert_eq!(live.id, note);
    assert_eq!(live.data["data"]["type"], "note", "{:?}", live.data);
    assert_eq!(live.data["data"]["data"]["n"], 7, "{:?}", live.data);
    assert_eq!(live.data["origin"]["kind"], "client", "{:?}", live.data);

    // An event-only activation delivers it to the harness; its records follow live too.
    let delivered = server
        .call("POST", &format!("/v1/sessions/{id}/activations"), None)
        .expect(200, None)
        .json();
    assert_eq!(delivered["outcome"], "completed", "{delivered}");
    let events = delivered["result"]["echo"]["input"]["events"].to_string();
    assert!(events.contains("\"note\""), "{delivered}");
    let following = stream.until(|e| e.event == "activation_finished");
    assert_eq!(following[0].id, note + 1);
    assert_eq!(following[0].event, "activation_queued");
    let end = following.last().unwrap().id;
    assert_eq!(end, server.events(&id).len() as u64);
    drop(stream);

    // Resume: Last-Event-ID starts after it (and wins over the query).
    let mut resumed = server.open_stream(&id, "?after=0", &[("last-event-id", &last.to_string())]);
    let replayed = resumed.until(|e| e.id == end);
    let ids: Vec<u64> = replayed.iter().map(|e| e.id).collect();
    assert_eq!(ids, (last + 1..=end).collect::<Vec<_>>());
    drop(resumed);
    let mut from_query = server.open_stream(&id, &format!("?after={}", end - 1), &[]);
    assert_eq!(from_query.next().id, end);
    drop(from_query);

    // Refusals come with their status, not as a stream.
    server
        .call_with(
            "GET",
            "/v1/sessions/ses_00000000000000000000/events",
            &[("accept", "text/event-stream")],
            None,
        )
        .expect(404, Some("unknown_session"));
    server
        .call_with(
            "GET",
            &format!("/v1/sessions/{id}/events"),
            &[("accept", "text/event-stream"), ("last-event-id", "x")],
            None,
        )
        .expect(400, Some("invalid_request"));
    server.terminate(WAIT);
}

#[test]
fn refusals_have_the_documented_statuses_and_admit_nothing() {
    let data = data_dir("e2e-errors");
    let mut server = serve(&data, fault_registration(), &[]);
    let id = server.create("f", json!({}));

    // 401: no token, a wrong one, another scheme; the probes need none.
    let wrong = format!("Bearer {}x", server.token);
    let basic = format!("Basic {}", server.token);
    for (method, path) in [
        ("GET", "/v1/sessions".to_owned()),
        ("POST", "/v1/sessions".to_owned()),
        ("GET", format!("/v1/sessions/{id}")),
        ("POST", format!("/v1/sessions/{id}/messages")),
        ("GET", format!("/v1/sessions/{id}/events")),
        ("POST", format!("/v1/sessions/{id}/cancel")),
        ("DELETE", format!("/v1/sessions/{id}")),
    ] {
        for auth in [None, Some(wrong.as_str()), Some(basic.as_str())] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let reply = server
                .exchange(&encode(method, &path, &headers, b""))
                .expect(401, Some("invalid_request"));
            assert_eq!(
                reply.header("www-authenticate"),
                Some("Bearer"),
                "{method} {path}"
            );
        }
    }
    server
        .exchange(&encode("GET", "/health/live", &[], b""))
        .expect(204, None);
    server
        .exchange(&encode("GET", "/health/ready", &[], b""))
        .expect(204, None);

    let auth = server.bearer();
    let post = |path: &str, content_type: Option<&str>, body: &[u8]| {
        let mut headers = vec![("authorization", auth.as_str())];
        if let Some(content_type) = content_type {
            headers.push(("content-type", content_type));
        }
        server.exchange(&encode("POST", path, &headers, body))
    };
    let json = Some("application/json");
    let messages = format!("/v1/sessions/{id}/messages");

    // 400: malformed JSON, an empty body, a bad id in the path, a bad query value.
    post("/v1/sessions", json, b"{\"agentloop\":").expect(400, Some("invalid_request"));
    post(&messages, json, b"{not json").expect(400, Some("invalid_request"));
    post(&messages, json, b"").expect(400, Some("invalid_request"));
    server
        .call("GET", "/v1/sessions/not-an-id", None)
        .expect(400, Some("invalid_request"));
    server
        .call("GET", &format!("/v1/sessions/{id}/events?after=x"), None)
        .expect(400, Some("invalid_request"));
    server
        .call("GET", &format!("/v1/sessions/{id}/events?limit=0"), None)
        .expect(400, Some("invalid_request"));

    // 404: an unknown session, an unknown registration, no such route.
    for (method, path) in [
        ("GET", "/v1/sessions/ses_00000000000000000000"),
        ("POST", "/v1/sessions/ses_00000000000000000000/cancel"),
        ("GET", "/v1/sessions/ses_00000000000000000000/transcript"),
    ] {
        server
            .call(method, path, None)
            .expect(404, Some("unknown_session"));
    }
    server
        .call(
            "POST",
            "/v1/sessions/ses_00000000000000000000/messages",
            Some(json!({"content": [{"type": "text", "text": "x"}]})),
        )
        .expect(404, Some("unknown_session"));
    server
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "nope"}})),
        )
        .expect(404, Some("unknown_agentloop"));
    server
        .call("GET", "/v1/nothing/here", None)
        .expect(404, Some("invalid_request"));

    // 409: no activation to cancel (busy, interrupted and closed are met in the other tests).
    server
        .call("POST", &format!("/v1/sessions/{id}/cancel"), None)
        .expect(409, Some("activation_not_active"));

    // 413: a body over the 16 MiB limit is refused on its Content-Length, before it is sent.
    let head = format!(
        "POST {messages} HTTP/1.1\r\nhost: brain\r\nauthorization: {auth}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        16 * 1024 * 1024 + 1
    );
    let too_large = server
        .exchange(head.as_bytes())
        .expect(413, Some("input_too_large"));
    assert_eq!(too_large.header("connection"), Some("close"));

    // 415: not JSON, or an untyped body.
    post(
        &messages,
        Some("text/plain"),
        br#"{"content": [{"type": "text", "text": "x"}]}"#,
    )
    .expect(415, Some("invalid_request"));
    post("/v1/sessions", None, br#"{"agentloop": {"name": "f"}}"#)
        .expect(415, Some("invalid_request"));

    // 422: JSON with a bad field.
    let unknown_key = post(
        "/v1/sessions",
        json,
        br#"{"agentloop": {"name": "f"}, "colour": "blue"}"#,
    )
    .expect(422, Some("invalid_request"));
    assert!(
        unknown_key.text().contains("colour"),
        "{}",
        unknown_key.text()
    );
    post("/v1/sessions", json, b"[1]").expect(422, Some("invalid_request"));
    post(&messages, json, br#"{"content": "hi", "x": 1}"#).expect(422, Some("invalid_request"));
    post(&messages, json, br#"{"content": [{"type": "sound"}]}"#)
        .expect(422, Some("invalid_request"));
    post(
        &format!("/v1/sessions/{id}/events"),
        json,
        br#"{"data": 1}"#,
    )
    .expect(422, Some("invalid_request"));
    post(
        &format!("/v1/sessions/{id}/activations"),
        json,
        br#"{"x": 1}"#,
    )
    .expect(422, Some("invalid_request"));

    // 405 with Allow.
    let refused = server.call("PUT", &format!("/v1/sessions/{id}"), None);
    assert_eq!(refused.status, 405, "{}", refused.text());
    assert_eq!(refused.header("allow"), Some("GET, DELETE"));

    // None of it admitted anything, and only the one session exists.
    let kinds: Vec<Value> = server
        .events(&id)
        .iter()
        .map(|e| e["type"].clone())
        .collect();
    assert_eq!(kinds, [json!("session_created")]);
    let list = server
        .call("GET", "/v1/sessions", None)
        .expect(200, None)
        .json();
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(1), "{list}");
    server.terminate(WAIT);
}

/// Checks that `text` is Prometheus text format: `# HELP`/`# TYPE` comments, and samples
/// `name{labels} value` with a float value whose family has a `# TYPE`. Returns the samples,
/// keyed by `name{labels}`.
fn parse_prometheus(text: &str) -> BTreeMap<String, f64> {
    fn is_name(name: &str) -> bool {
        let mut chars = name.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }
    let mut types = BTreeMap::new();
    let mut samples = BTreeMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(comment) = line.strip_prefix('#') {
            let words: Vec<&str> = comment.split_whitespace().collect();
            match words.as_slice() {
                ["TYPE", name, kind] => {
                    assert!(is_name(name), "{line:?}");
                    assert!(
                        ["counter", "gauge", "histogram", "summary", "untyped"].contains(kind),
                        "{line:?}"
                    );
                    types.insert((*name).to_owned(), (*kind).to_owned());
                }
                ["HELP", name, ..] => assert!(is_name(name), "{line:?}"),
                _ => {}
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("not a sample: {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("not a float value: {line:?}"));
        let name = match series.split_once('{') {
            Some((name, labels)) => {
                let labels = labels
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels: {line:?}"));
                // Label values hold no commas or quotes here; each pair is name="value".
                for pair in labels.split(',').filter(|p| !p.is_empty()) {
                    let (label, quoted) = pair
                        .split_once('=')
                        .unwrap_or_else(|| panic!("not a label: {line:?}"));
                    assert!(is_name(label), "{line:?}");
                    assert!(
                        quoted.len() >= 2 && quoted.starts_with('"') && quoted.ends_with('"'),
                        "{line:?}"
                    );
                }
                name
            }
            None => series,
        };
        assert!(is_name(name), "{line:?}");
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|base| types.get(*base).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        assert!(types.contains_key(family), "no # TYPE for {line:?}");
        assert!(
            samples.insert(series.to_owned(), value).is_none(),
            "repeated {line:?}"
        );
    }
    samples
}

/// The sum of the samples whose series starts with `prefix`.
fn matching(samples: &BTreeMap<String, f64>, prefix: &str) -> f64 {
    samples
        .iter()
        .filter(|(series, _)| series.starts_with(prefix))
        .map(|(_, value)| value)
        .sum()
}

/// The sum of every sample of `name` (any labels).
fn total(samples: &BTreeMap<String, f64>, name: &str) -> f64 {
    samples
        .iter()
        .filter(|(series, _)| series.split('{').next() == Some(name))
        .map(|(_, value)| value)
        .sum()
}

#[test]
fn probes_answer_and_metrics_parse_as_prometheus_text_and_count_activations() {
    let data = data_dir("e2e-metrics");
    let mut server = serve(
        &data,
        json!({"f": {"command": FAULT_HARNESS, "workers": 2}}),
        &[],
    );
    server
        .exchange(&encode("GET", "/health/live", &[], b""))
        .expect(204, None);
    server
        .exchange(&encode("GET", "/health/ready", &[], b""))
        .expect(204, None);

    let before = parse_prometheus(&server.metrics());
    assert_eq!(
        before.get("brain_workers{registration=\"f\",state=\"healthy\"}"),
        Some(&2.0),
        "{before:?}"
    );
    let ended_before = total(&before, "brain_activations_total");
    let completed = "brain_activations_total{outcome=\"completed\"";
    let failed = "brain_activations_total{outcome=\"failed\",code=\"model_refused\"}";
    let completed_before = matching(&before, completed);

    let ok = server.create("f", json!({}));
    let failing = server.create("f", json!({"fault": "fail", "code": "model_refused"}));
    for n in 0..3 {
        let outcome = server
            .message(&ok, &format!("n{n}"), &[])
            .expect(200, None)
            .json();
        assert_eq!(outcome["outcome"], "completed", "{outcome}");
    }
    let refused = server.message(&failing, "x", &[]).expect(200, None).json();
    assert_eq!(refused["outcome"], "failed", "{refused}");

    // The counters moved by exactly what ran (this process served nothing else).
    let after = parse_prometheus(&server.metrics());
    assert_eq!(total(&after, "brain_activations_total"), ended_before + 4.0);
    assert_eq!(
        matching(&after, completed),
        completed_before + 3.0,
        "{after:?}"
    );
    assert_eq!(
        after.get(failed).copied().unwrap_or(0.0),
        before.get(failed).copied().unwrap_or(0.0) + 1.0,
        "{after:?}"
    );
    assert!(
        total(&after, "brain_activation_seconds_count")
            >= total(&before, "brain_activation_seconds_count") + 4.0,
        "{after:?}"
    );
    assert!(
        after.get("brain_http_responses_total{status=\"201\"}") >= Some(&2.0),
        "{after:?}"
    );
    server.terminate(WAIT);
}

// ----- signals and shutdown -----

#[test]
fn sigterm_under_load_drains_cancels_the_rest_loses_nothing_and_leaves_no_process() {
    let data = data_dir("e2e-drain");
    let token = "e2e-drain-token";
    let registrations = json!({"f": {"command": FAULT_HARNESS, "workers": 2}});
    let drain = Duration::from_secs(3);
    let mut server = Start {
        data: &data,
        registrations: registrations.clone(),
        extra: &["--drain", "3s"],
        token: Some(token),
        env: &[],
        uid: None,
        umask: None,
    }
    .run();
    // Each slow run waits 400 ms before each of its two callbacks: it is still running when the
    // signal comes, and done long before the drain ends. The hanging one ends only when cancelled.
    let slow = json!({
        "fault": "slow_calls", "announce": true, "delay_ms": 400,
        "calls": [
            {"method": "kv.put", "input": {"key": "k", "value": 1}},
            {"method": "kv.get", "input": {"key": "k"}},
        ],
    });
    let waiting = server.create("f", slow.clone());
    let asynchronous = server.create("f", slow.clone());
    let event_only = server.create("f", slow);
    let hanging = server.create("f", json!({"fault": "hang", "announce": true}));
    let idle = server.create("f", json!({}));

    // Acknowledged before the signal: two 202s; two requests that wait for their outcome.
    let waiting_reply = server.message_in_background(&waiting, "wait for me");
    let hanging_reply = server.message_in_background(&hanging, "hang");
    let async_sequence = server
        .message(&asynchronous, "async", &[("prefer", "respond-async")])
        .expect(202, None)
        .json()["sequence"]
        .as_u64()
        .expect("a sequence");
    let event_only_sequence = server
        .call_with(
            "POST",
            &format!("/v1/sessions/{event_only}/activations"),
            &[("prefer", "respond-async")],
            None,
        )
        .expect(202, None)
        .json()["sequence"]
        .as_u64()
        .expect("a sequence");
    let mut running = BTreeMap::new();
    for id in [&waiting, &asynchronous, &event_only, &hanging] {
        let announced = server.wait_running(id);
        running.insert(
            id.clone(),
            announced.data["origin"]["sequence"]
                .as_u64()
                .expect("the activation"),
        );
    }
    assert_eq!(running[&asynchronous], async_sequence);
    assert_eq!(running[&event_only], event_only_sequence);
    let workers = server.workers(2);

    let signalled = Instant::now();
    server.signal(Signal::SIGTERM);
    server.wait_line(DRAINING, WAIT);
    // Draining: nothing new is admitted; the probe says so; liveness holds.
    server
        .exchange(&encode("GET", "/health/ready", &[], b""))
        .expect(503, Some("shutting_down"));
    server
        .message(&idle, "too late", &[])
        .expect(503, Some("shutting_down"));
    server
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "f"}})),
        )
        .expect(503, Some("shutting_down"));
    server
        .exchange(&encode("GET", "/health/live", &[], b""))
        .expect(204, None);

    let status = server.wait_exit(WAIT);
    let took = signalled.elapsed();
    assert!(
        status.is_some_and(|s| s.code() == Some(0)),
        "exit {status:?}; stderr:\n{}",
        server.stderr()
    );
    // The hanging run kept the drain open to its end, no longer.
    assert!(took >= drain, "exited after {took:?}, inside the drain");
    assert!(took < drain + Duration::from_secs(10), "took {took:?}");
    for pid in &workers {
        assert!(!harness_alive(*pid), "worker {pid} outlived brain serve");
    }

    // The requests that waited got their outcomes.
    let waited = waiting_reply
        .join()
        .expect("the waiter thread")
        .expect("an answer before the server stopped")
        .expect(200, None)
        .json();
    assert_eq!(waited["outcome"], "completed", "{waited}");
    assert_eq!(waited["sequence"], running[&waiting]);
    let hung = hanging_reply
        .join()
        .expect("the waiter thread")
        .expect("an answer before the server stopped")
        .expect(200, None)
        .json();
    assert_eq!(hung["sequence"], running[&hanging]);
    // Cancelled when the drain ran out; the harness answered the cancel.
    assert_eq!(hung["outcome"], "cancelled", "{hung}");
    assert_eq!(hung["error"]["code"], "cancelled", "{hung}");

    // Started again on the same data directory, every acknowledged activation is there with its
    // outcome; the refused message is not.
    let mut again = Start {
        data: &data,
        registrations,
        extra: &[],
        token: Some(token),
        env: &[],
        uid: None,
        umask: None,
    }
    .run();
    for (id, sequence) in &running {
        let events = again.events(id);
        let (queued, finished) = activation_records(&events, *sequence);
        assert!(
            queued.is_some(),
            "{id}: no activation_queued {sequence}: {events:?}"
        );
        let finished = finished
            .unwrap_or_else(|| panic!("{id}: no outcome of {sequence}: {events:?}"))["data"]
            .clone();
        if id == &hanging {
            assert_eq!(finished["outcome"], "cancelled", "{finished}");
            assert_eq!(finished["code"], "cancelled", "{finished}");
        } else {
            assert_eq!(finished["outcome"], "completed", "{id}: {finished}");
            assert_eq!(
                finished["result"]["answers"][1],
                json!({"found": true, "value": 1}),
                "{id}: {finished}"
            );
        }
    }
    let idle_kinds: Vec<Value> = again
        .events(&idle)
        .iter()
        .map(|e| e["type"].clone())
        .collect();
    assert_eq!(idle_kinds, [json!("session_created")]);
    assert_eq!(again.view(&hanging)["status"], "interrupted");
    again.terminate(WAIT);
}

#[test]
fn a_second_signal_skips_the_drain() {
    let data = data_dir("e2e-second-signal");
    let registrations =
        json!({"stubborn": {"command": FAULT_HARNESS, "args": ["--ignore-shutdown"]}});
    let mut server = serve(&data, registrations.clone(), &["--drain", "60s"]);
    let id = server.create(
        "stubborn",
        json!({"fault": "ignore_cancel", "announce": true}),
    );
    let sequence = server
        .message(&id, "never answered", &[("prefer", "respond-async")])
        .expect(202, None)
        .json()["sequence"]
        .as_u64()
        .expect("a sequence");
    server.wait_running(&id);
    let workers = server.workers(1);

    server.signal(Signal::SIGTERM);
    server.wait_line(DRAINING, WAIT);
    // The first signal drains: the run that never ends holds the process up.
    assert_eq!(server.wait_exit(Duration::from_secs(2)), None);
    server
        .exchange(&encode("GET", "/health/ready", &[], b""))
        .expect(503, Some("shutting_down"));

    let second = Instant::now();
    server.signal(Signal::SIGTERM);
    let status = server.wait_exit(Duration::from_secs(10));
    assert!(
        status.is_some_and(|s| s.code() == Some(0)),
        "exit {status:?} after the second signal; stderr:\n{}",
        server.stderr()
    );
    assert!(second.elapsed() < Duration::from_secs(10));
    // The worker ignores shutdown and SIGTERM: it was killed.
    for pid in &workers {
        assert!(!harness_alive(*pid), "worker {pid} outlived brain serve");
    }

    // The acknowledged activation is in the journal with an outcome.
    let mut again = serve(&data, registrations, &[]);
    let events = again.events(&id);
    let (queued, finished) = activation_records(&events, sequence);
    assert!(queued.is_some(), "{events:?}");
    let finished = finished.unwrap_or_else(|| panic!("no outcome of {sequence}: {events:?}"));
    // The run never answered: it ended with its worker (today `failed`, `worker_lost`: the second
    // signal kills at once), or cancelled.
    let outcome = &finished["data"]["outcome"];
    assert!(outcome == "failed" || outcome == "cancelled", "{finished}");
    again.workers(1);
    again.terminate(WAIT);
}

// ----- brain ready -----

fn ready(address: &str) -> Option<i32> {
    run_bounded(
        Command::new(BRAIN)
            .args(["ready", "--listen", address])
            .env_remove("BRAIN_API_TOKEN"),
    )
    .status
    .code()
}

#[test]
fn ready_exits_zero_against_a_ready_server_and_one_otherwise() {
    // Nothing listens on a port just released.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("an address");
    assert_eq!(ready(&free.to_string()), Some(1));

    let data = data_dir("e2e-ready");
    let mut server = serve(&data, fault_registration(), &[]);
    let address = server.addr.to_string();
    assert_eq!(ready(&address), Some(0));
    server.terminate(WAIT);
    assert_eq!(ready(&address), Some(1));

    // Running but not ready: no registration has a healthy worker. The probe says why; work is
    // refused 503 agentloop_unavailable.
    let data = data_dir("e2e-unready");
    let mut unready = serve(
        &data,
        json!({"silent": {"command": FAULT_HARNESS, "args": ["--never-init"]}}),
        &["--init-deadline", "300ms"],
    );
    assert_eq!(ready(&unready.addr.to_string()), Some(1));
    let probe = unready
        .exchange(&encode("GET", "/health/ready", &[], b""))
        .expect(503, Some("agentloop_unavailable"))
        .json();
    assert_eq!(
        probe["error"]["detail"]["registrations"][0]["name"], "silent",
        "{probe}"
    );
    assert!(
        probe["error"]["detail"]["registrations"][0]["workers"].is_array(),
        "{probe}"
    );
    unready
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "silent"}})),
        )
        .expect(503, Some("agentloop_unavailable"));
    unready
        .exchange(&encode("GET", "/health/live", &[], b""))
        .expect(204, None);
    unready.terminate(WAIT);
}

#[test]
fn the_http_thread_count_and_ready_queue_are_set_by_flags() {
    use std::io::BufRead;
    let data = temp_dir("serve-http-flags");
    let served = serve(
        &data,
        json!({"f": {"command": FAULT_HARNESS}}),
        &["--http-threads", "1", "--http-queue", "1"],
    );
    // The one request thread is held by a client that asked to continue and then sends nothing:
    // the interim answer shows the thread has it.
    let body = br#"{"agentloop": {"name": "f"}}"#;
    let holder = common::http::connect(served.addr);
    write!(
        &holder,
        "POST /v1/sessions HTTP/1.1\r\nauthorization: {}\r\ncontent-type: application/json\r\n\
         expect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        served.bearer(),
        body.len()
    )
    .unwrap();
    let mut holder = BufReader::new(holder);
    let mut interim = String::new();
    holder.read_line(&mut interim).unwrap();
    assert_eq!(interim, "HTTP/1.1 100 Continue\r\n");
    holder.read_line(&mut interim).unwrap();
    // Of two more ready requests, one waits in the queue of one and the other is refused at once
    // (which is which depends on the order the accept thread reads them).
    let (replies, answered) = crossbeam_channel::unbounded();
    for _ in 0..2 {
        let replies = replies.clone();
        let stream = common::http::connect(served.addr);
        (&stream)
            .write_all(b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n")
            .unwrap();
        std::thread::spawn(move || {
            let _ = replies.send(read_reply(&mut BufReader::new(stream)).map(|r| r.status));
        });
    }
    let first = answered.recv_timeout(WAIT).expect("an answer in time");
    assert_eq!(
        first.unwrap(),
        503,
        "the second ready request must be refused"
    );
    // The holder finishes; both it and the queued request are answered.
    holder.get_ref().write_all(body).unwrap();
    read_reply(&mut holder).unwrap().expect(201, None);
    let second = answered.recv_timeout(WAIT).expect("an answer in time");
    assert_eq!(second.unwrap(), 204);
    drop(served);
    std::fs::remove_dir_all(&data).unwrap();

    // Refused flags name what was wrong and exit 2.
    for (flag, value) in [
        ("--http-queue", "0"),
        ("--http-threads", "many"),
        ("--http-read-timeout", "0"),
    ] {
        let output = run_bounded(Command::new(BRAIN).args(["serve", flag, value]));
        assert_eq!(output.status.code(), Some(2), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(flag), "{stderr}");
    }
}
