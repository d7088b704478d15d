//! Security: what a hostile harness, a hostile client or a hostile id can and cannot do.
//!
//! - A harness acts on no session but its own: callbacks naming another worker's, another
//!   registration's, a guessed or an ended activation are refused and write nothing.
//! - Ids and names never escape their directories: traversal attempts are refused by the library,
//!   by every HTTP route (against the real `brain serve`), by the CLI and at registration parsing.
//! - A harness's environment holds none of Brain's secrets (read from `/proc/<pid>/environ` of the
//!   workers of a real `brain serve` started with provider keys and an API token).
//! - The data directory is 0700 and the token file 0600, even under a umask of 0.
//! - Every `/v1` route of the real binary refuses a missing or wrong token and does nothing.
//! - Oversized bodies are refused before they are read, and hundreds of idle connections neither
//!   starve the probes nor grow the server's threads; half-sent requests do not stall the server,
//!   and idle connections closing at once do not get real requests refused.
//!
//! Every wait is bounded; every `brain serve` is stopped and reaped on every path.

mod common;

use common::http::{Reply, encode, read_reply};
use common::server::{Api, Served, Start};

use brain::session::{CreateSession, SessionId};
use brain::{Activation, Brain, OutcomeKind, Registration, Registrations, Session};
use common::*;
use serde_json::{Value, json};
use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const OPENAI_KEY: &str = "sk-security-test-openai-7f3e9a1b2c";
const ANTHROPIC_KEY: &str = "sk-ant-security-test-anthropic-4d8c";
const API_TOKEN: &str = "brain-security-test-token-5c1d0e";

/// How long a probe may take to answer while the server is under attack.
const PROMPT: Duration = Duration::from_secs(2);

/// Ids that try to leave their directory, in the encodings a client might try.
const HOSTILE_IDS: &[&str] = &[
    "..",
    ".",
    "../",
    "../../etc/passwd",
    "/etc/passwd",
    "ses_../../../../etc/passw",
    "ses_/../../../../../../tmp",
    "ses_1234567890123456789/",
    "ses_12345678901234567890/..",
    "ses_1234567890123456789.",
    "ses_123456789012345678..",
    "ses_1234567890123456789\\",
    "%2e%2e",
    "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "ses_%2e%2e%2f%2e%2e%2fetc%2fp",
    "ses_..%2f..%2f..%2fetc%2fpasswd",
    "ses_12345678901234567890%2f..",
    "ses_12345678901234567890%00",
    ".ses_12345678901234567890",
    "ses_１２３４５６７８９０１２３４５６７８９０",
    "ses_123456789012345678\u{0}0",
];

fn text(text: &str) -> brain::protocol::harness::UserInput {
    brain::protocol::harness::UserInput {
        content: vec![brain::protocol::harness::Block::text(text)],
    }
}

// ------------------------------------------------------------------------------------------------
// A hostile harness acts on no session but its own.

fn create(brain: &Brain, registration: &str, configuration: Value) -> Session {
    brain
        .create_session_json(
            json!({"agentloop": {"name": registration, "configuration": configuration}})
                .to_string()
                .as_bytes(),
        )
        .unwrap_or_else(|error| panic!("create: {error}"))
}

fn kinds(session: &Session) -> Vec<String> {
    session
        .events(0, usize::MAX)
        .expect("events")
        .into_iter()
        .map(|e| e.event_type)
        .collect()
}

fn wait(activation: &Activation) -> brain::Outcome {
    activation
        .wait_timeout(WAIT)
        .unwrap_or_else(|| panic!("activation {} did not end", activation.sequence()))
}

/// A session whose harness calls `kv.put` in the name of `session` / `sequence`.
fn attacker(brain: &Brain, registration: &str, session: &str, sequence: u64) -> Session {
    create(
        brain,
        registration,
        json!({"fault": "foreign_callback", "target_session": session, "target_sequence": sequence}),
    )
}

/// Runs the attacker's activation; returns Brain's answer to its foreign callback.
fn attack(attacker: &Session) -> String {
    let outcome = wait(&attacker.send(text("attack")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    outcome.result.unwrap()["error"]
        .as_str()
        .unwrap_or("<none: the foreign callback succeeded>")
        .to_owned()
}

#[test]
fn a_hostile_harness_cannot_act_on_any_session_but_its_own() {
    let mut options = fast_options("security-authority");
    options.cancel_grace = Duration::from_millis(300);
    let brain = start(vec![fault("a", &[]).workers(2), fault("b", &[])], options);
    let running = json!({"fault": "hang", "announce": true});
    let victim_a = create(&brain, "a", running.clone());
    let victim_b = create(&brain, "b", running);
    let (id_a, id_b) = (victim_a.id().to_string(), victim_b.id().to_string());
    // Placement: fewest open sessions, ties to the lowest slot.
    let other_worker = attacker(&brain, "a", &id_a, 2);
    let other_registration = attacker(&brain, "b", &id_a, 2);
    let into_b = attacker(&brain, "a", &id_b, 2);
    let guessed = attacker(&brain, "a", "ses_00000000000000000000", 2);
    let not_an_activation = attacker(&brain, "a", &id_a, 1);
    let future = attacker(&brain, "b", &id_a, 3);
    let traversal = attacker(&brain, "b", "../../../../etc/passwd", 2);
    let placed: Vec<(String, u32)> = [
        &victim_a,
        &victim_b,
        &other_worker,
        &other_registration,
        &into_b,
        &guessed,
        &not_an_activation,
        &future,
        &traversal,
    ]
    .iter()
    .map(|s| {
        let info = s.info().unwrap();
        (info.registration, info.worker)
    })
    .collect();
    let at = |r: &str, w: u32| (r.to_owned(), w);
    assert_eq!(
        placed,
        [
            at("a", 0),
            at("b", 0),
            at("a", 1),
            at("b", 0),
            at("a", 0),
            at("a", 1),
            at("a", 0),
            at("b", 0),
            at("b", 0),
        ]
    );
    let running_a = victim_a.send(text("x")).unwrap();
    let running_b = victim_b.send(text("x")).unwrap();
    assert_eq!((running_a.sequence(), running_b.sequence()), (2, 2));
    for victim in [&victim_a, &victim_b] {
        victim
            .wait_for_events(WAIT, |events| {
                events.iter().any(|e| e.event_type == "event_emitted")
            })
            .expect("the victim runs");
    }
    let before_a = kinds(&victim_a);
    let before_b = kinds(&victim_b);
    // While the victims run: another worker, another registration, a guessed id, a sequence that
    // is no activation (from the victim's own worker), a future sequence, a traversal id.
    for (attacker, expected) in [
        (&other_worker, "activation_not_active"),
        (&other_registration, "activation_not_active"),
        (&into_b, "activation_not_active"),
        (&guessed, "activation_not_active"),
        (&not_an_activation, "activation_not_active"),
        (&future, "activation_not_active"),
        (&traversal, "activation_not_active"),
    ] {
        let placed = attacker.info().unwrap();
        assert_eq!(
            attack(attacker),
            expected,
            "attacker on {}/{}",
            placed.registration,
            placed.worker
        );
    }
    assert_eq!(kinds(&victim_a), before_a, "a record was written");
    assert_eq!(kinds(&victim_b), before_b, "a record was written");
    // After the victim's activation ended, its own worker is told `activation_closed`, any
    // other `activation_not_active`; still nothing is written.
    victim_a.cancel().unwrap();
    assert_eq!(wait(&running_a).outcome, OutcomeKind::Cancelled);
    let before_a = kinds(&victim_a);
    let late = [
        attacker(&brain, "a", &id_a, 2),
        attacker(&brain, "a", &id_a, 2),
    ];
    let mut workers: Vec<u32> = late.iter().map(|s| s.info().unwrap().worker).collect();
    for (attacker, worker) in late.iter().zip(&workers) {
        let expected = if *worker == 0 {
            "activation_closed"
        } else {
            "activation_not_active"
        };
        assert_eq!(attack(attacker), expected, "late attacker on a/{worker}");
    }
    workers.sort_unstable();
    assert_eq!(workers, [0, 1], "one late attacker on each worker");
    assert_eq!(kinds(&victim_a), before_a, "a record was written");
    // No session anywhere holds a kv record: not one foreign kv.put took effect.
    for info in brain.sessions().unwrap() {
        let session = brain.session(&info.session_id);
        assert!(
            !kinds(&session).iter().any(|k| k == "kv_set"),
            "session {} was written to",
            info.session_id
        );
    }
    victim_b.cancel().unwrap();
    assert_eq!(wait(&running_b).outcome, OutcomeKind::Cancelled);
}

// ------------------------------------------------------------------------------------------------
// Ids and names never escape their directories.

#[test]
fn session_ids_that_would_leave_their_directory_are_refused_by_the_library() {
    for id in HOSTILE_IDS {
        assert!(SessionId::parse(id).is_err(), "{id:?} accepted");
        let quoted = serde_json::to_string(id).unwrap();
        assert!(
            serde_json::from_str::<SessionId>(&quoted).is_err(),
            "{id:?} deserialized"
        );
    }
    // Names that become path components are refused in session requests too.
    for name in ["..", "../x", "a/b", "/abs", "x\\y", "%2e%2e"] {
        let request = json!({"agentloop": {"name": name}}).to_string();
        let error = CreateSession::parse(request.as_bytes())
            .and_then(|r| r.validate().map(|()| r))
            .map(|_| ())
            .expect_err(name);
        assert_eq!(error.code.as_str(), "invalid_request", "{name}: {error:?}");
    }
}

#[test]
fn registration_names_that_would_leave_their_directory_are_refused_at_parse() {
    for name in [
        "..", ".", "../x", "x/..", "a/b", "/abs", "a\\b", "%2e%2e", "", "a\u{0}b",
    ] {
        let document = json!({ name: {"command": FAULT_HARNESS} }).to_string();
        let error = Registrations::parse(&document, "test")
            .map(|_| ())
            .expect_err(&format!("{name:?} accepted"));
        assert!(
            error.to_string().contains("name") || error.to_string().contains(name),
            "{name:?}: {error}"
        );
        let built = Registrations::from_vec(vec![Registration::new(name, FAULT_HARNESS)]);
        assert!(built.is_err(), "{name:?} accepted by from_vec");
    }
    // And from the binary: exit 78.
    let output = run_bounded(
        Command::new(BRAIN)
            .args(["check", "--agentloops"])
            .arg(json!({"../escape": {"command": FAULT_HARNESS}}).to_string())
            .env_remove("BRAIN_AGENTLOOPS"),
    );
    assert_eq!(
        output.status.code(),
        Some(78),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Every file and directory below `root`, relative, sorted.
fn tree(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            out.push(path.strip_prefix(root).unwrap().to_owned());
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                walk(root, &path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

#[test]
fn traversal_ids_are_refused_by_every_http_route_and_the_cli() {
    let (data, mut server) = serve_f("security-traversal", Some(API_TOKEN), &[], None);
    let id = server.create("f", json!({}));
    let root = data.parent().unwrap().to_owned();
    let before = tree(&root);
    let records = server.call("GET", &format!("/v1/sessions/{id}/events"), None);
    assert_eq!(records.status, 200);
    let message = json!({"content": [{"type": "text", "text": "x"}]});
    for hostile in HOSTILE_IDS {
        // What a client could put in a request target (no space, no control byte).
        if !hostile.bytes().any(|b| b <= b' ') {
            let single_segment = !hostile.contains('/');
            for (method, path, body) in [
                ("GET", format!("/v1/sessions/{hostile}"), None),
                ("DELETE", format!("/v1/sessions/{hostile}"), None),
                ("GET", format!("/v1/sessions/{hostile}/events"), None),
                ("GET", format!("/v1/sessions/{hostile}/transcript"), None),
                (
                    "POST",
                    format!("/v1/sessions/{hostile}/messages"),
                    Some(message.clone()),
                ),
                ("POST", format!("/v1/sessions/{hostile}/close"), None),
            ] {
                let reply = server.call(method, &path, body);
                if single_segment {
                    assert_eq!(reply.status, 400, "{method} {path}: {reply:?}");
                    assert_eq!(reply.code(), "invalid_request", "{method} {path}");
                } else {
                    // Extra path segments match no route at all.
                    assert!(
                        matches!(reply.status, 400 | 404),
                        "{method} {path}: {reply:?}"
                    );
                }
            }
        }
        let from = json!({"agentloop": {"name": "f"}, "from": hostile});
        let reply = server.call("POST", "/v1/sessions", Some(from));
        assert!(
            matches!(reply.status, 400 | 422),
            "from {hostile:?}: {reply:?}"
        );
        assert_eq!(reply.code(), "invalid_request");
        // The CLI refuses it before touching anything (an argument cannot hold a NUL).
        if !hostile.contains('\0') {
            let data = data.to_string_lossy().into_owned();
            let address = server.addr.to_string();
            for args in [
                vec!["journal", data.as_str(), hostile],
                vec![
                    "sessions",
                    "--listen",
                    address.as_str(),
                    "--data-dir",
                    data.as_str(),
                    "show",
                    hostile,
                ],
                vec![
                    "run",
                    "--data-dir",
                    data.as_str(),
                    "--session",
                    hostile,
                    "x",
                ],
            ] {
                let output = run_bounded(Command::new(BRAIN).args(&args));
                assert_eq!(output.status.code(), Some(2), "brain {args:?}");
            }
        }
    }
    // Registration names in a session request are refused too.
    for name in ["../../f", "f/../f", ".."] {
        let body = json!({"agentloop": {"name": name}});
        let reply = server.call("POST", "/v1/sessions", Some(body));
        assert_eq!(reply.status, 422, "{name}: {reply:?}");
    }
    // Nothing was created, removed or renamed anywhere near the data directory, and the one
    // real session is untouched.
    assert_eq!(tree(&root), before);
    let after = server.call("GET", &format!("/v1/sessions/{id}/events"), None);
    assert_eq!(after.body, records.body);
    let list = server.call("GET", "/v1/sessions", None).json();
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(1), "{list}");
    server.terminate(WAIT);
}

// ------------------------------------------------------------------------------------------------
// Secrets and permissions.

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle.as_bytes())
}

#[test]
fn a_harness_environment_holds_none_of_brains_secrets() {
    let (_data, mut server) = serve_f(
        "security-environ",
        Some(API_TOKEN),
        &[
            ("OPENAI_API_KEY", OPENAI_KEY),
            ("ANTHROPIC_API_KEY", ANTHROPIC_KEY),
        ],
        None,
    );
    // The control: Brain itself has the secrets.
    let own = std::fs::read(format!("/proc/{}/environ", server.pid)).expect("brain's environ");
    for secret in [OPENAI_KEY, ANTHROPIC_KEY, API_TOKEN] {
        assert!(contains(&own, secret), "brain serve was not given {secret}");
    }
    // Two workers of brain serve.
    for pid in server.workers(2) {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
        assert!(
            contains(&environ, "BRAIN_HARNESS_PROTOCOL=brain/harness/v1"),
            "{pid} is not a harness"
        );
        for secret in [
            OPENAI_KEY,
            ANTHROPIC_KEY,
            API_TOKEN,
            "OPENAI_API_KEY",
            "ANTHROPIC_API_KEY",
            "BRAIN_API_TOKEN",
        ] {
            assert!(!contains(&environ, secret), "harness {pid} holds {secret}");
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
        assert!(!contains(&cmdline, API_TOKEN) && !contains(&cmdline, OPENAI_KEY));
    }
    server.terminate(WAIT);
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

#[test]
fn the_data_directory_is_0700_and_the_token_file_0600_even_under_umask_0() {
    // No BRAIN_API_TOKEN: the server generates the token file.
    let (data, mut server) = serve_f("security-modes", None, &[], Some(0));
    assert_eq!(mode(&data), 0o700, "the data directory");
    let token_file = data.join("operator.token");
    assert_eq!(mode(&token_file), 0o600, "the token file");
    let token = std::fs::read_to_string(&token_file).unwrap();
    let token = token.trim().to_owned();
    assert!(
        token.len() >= 32,
        "a short token: {} characters",
        token.len()
    );
    assert_eq!(mode(&data.join("journal")), 0o700, "the journal directory");
    // A session, with the generated token (which `Start` read from the same file): its state
    // directory and the journal's segments.
    let id = server.create("f", json!({}));
    let state_dir = data.join("agentloops").join("f").join(&id);
    assert_eq!(mode(&state_dir), 0o700, "the session's state directory");
    let segments: Vec<PathBuf> = std::fs::read_dir(data.join("journal"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    assert!(!segments.is_empty());
    for segment in &segments {
        assert_eq!(mode(segment), 0o600, "{}", segment.display());
    }
    // Nothing inside is world- or group-writable, whatever the umask.
    for path in tree(&data) {
        let full = data.join(&path);
        assert_eq!(
            mode(&full) & 0o022,
            0,
            "{} is mode {:o}",
            path.display(),
            mode(&full)
        );
    }
    server.terminate(WAIT);
}

// ------------------------------------------------------------------------------------------------
// The HTTP server of the real binary.

#[test]
fn every_v1_route_of_the_binary_refuses_a_missing_or_wrong_token() {
    let (_data, mut server) = serve_f("security-auth", Some(API_TOKEN), &[], None);
    let id = server.create("f", json!({}));
    let records = server.call("GET", &format!("/v1/sessions/{id}/events"), None);
    let message = json!({"content": [{"type": "text", "text": "x"}]}).to_string();
    let create = json!({"agentloop": {"name": "f"}}).to_string();
    let routes = [
        ("GET", "/v1/sessions".to_owned(), String::new()),
        ("POST", "/v1/sessions".to_owned(), create),
        ("GET", format!("/v1/sessions/{id}"), String::new()),
        ("POST", format!("/v1/sessions/{id}/messages"), message),
        ("GET", format!("/v1/sessions/{id}/events"), String::new()),
        ("POST", format!("/v1/sessions/{id}/cancel"), String::new()),
        ("POST", format!("/v1/sessions/{id}/close"), String::new()),
        ("DELETE", format!("/v1/sessions/{id}"), String::new()),
        ("GET", "/v1/no-such-route".to_owned(), String::new()),
    ];
    let wrong = format!("Bearer {API_TOKEN}0");
    let prefix = format!("Bearer {}", &API_TOKEN[..API_TOKEN.len() - 1]);
    let basic = format!("Basic {API_TOKEN}");
    let bare = API_TOKEN.to_owned();
    for (method, path, body) in &routes {
        for auth in [None, Some(&wrong), Some(&prefix), Some(&basic), Some(&bare)] {
            let mut headers = vec![("connection", "close")];
            if let Some(auth) = auth {
                headers.push(("authorization", auth.as_str()));
            }
            if !body.is_empty() {
                headers.push(("content-type", "application/json"));
            }
            let reply = server.exchange(&encode(method, path, &headers, body.as_bytes()));
            assert_eq!(reply.status, 401, "{method} {path} with {auth:?}");
            assert_eq!(reply.header("www-authenticate"), Some("Bearer"));
            assert_eq!(reply.code(), "invalid_request");
        }
        // A token in the query string is no token.
        let query = format!("{path}?token={API_TOKEN}&access_token={API_TOKEN}");
        let reply = server.exchange(&encode(method, &query, &[], b""));
        assert_eq!(reply.status, 401, "{method} {query}");
    }
    // Nothing was done: one session, still open, its journal as it was.
    let list = server.call("GET", "/v1/sessions", None);
    assert_eq!(list.status, 200);
    assert_eq!(list.json()["sessions"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        server
            .call("GET", &format!("/v1/sessions/{id}"), None)
            .json()["status"],
        "open"
    );
    let after = server.call("GET", &format!("/v1/sessions/{id}/events"), None);
    assert_eq!(after.body, records.body);
    // The probes and the metrics need no token, and give away neither the token nor an id.
    assert_eq!(
        server
            .exchange(&encode("GET", "/health/live", &[], b""))
            .status,
        204
    );
    let metrics = server.exchange(&encode("GET", "/metrics", &[], b""));
    assert_eq!(metrics.status, 200);
    assert!(!contains(&metrics.body, API_TOKEN) && !contains(&metrics.body, &id));
    server.terminate(WAIT);
}

#[test]
fn oversized_bodies_are_refused_before_they_are_read() {
    let (_data, mut server) = serve_f("security-oversized", Some(API_TOKEN), &[], None);
    let rss_before = rss_kb(server.pid);
    let auth = format!("Bearer {API_TOKEN}");
    // 16 MiB is the default limit. The head alone is answered; the body is never sent.
    let oversized = 16 * 1024 * 1024 + 1;
    let mut streams = Vec::new();
    for _ in 0..8 {
        let head = format!(
            "POST /v1/sessions HTTP/1.1\r\nauthorization: {auth}\r\ncontent-type: application/json\r\ncontent-length: {oversized}\r\n\r\n"
        );
        let stream = server.connect();
        (&stream).write_all(head.as_bytes()).unwrap();
        streams.push(stream);
    }
    for stream in streams {
        let began = Instant::now();
        let reply = read_reply(&mut BufReader::new(stream)).expect("an answer before the body");
        assert!(began.elapsed() < PROMPT, "{:?}", began.elapsed());
        assert_eq!(reply.status, 413, "{reply:?}");
        assert_eq!(reply.code(), "input_too_large");
        assert_eq!(reply.header("connection"), Some("close"));
    }
    // A body that is really sent and really too big: refused, the server unharmed.
    let stream = server.connect();
    let head = format!(
        "POST /v1/sessions HTTP/1.1\r\nauthorization: {auth}\r\ncontent-type: application/json\r\ncontent-length: {oversized}\r\n\r\n"
    );
    (&stream).write_all(head.as_bytes()).unwrap();
    // The server may close before all of it is sent: a write error is expected then.
    let chunk = vec![b' '; 1024 * 1024];
    for _ in 0..17 {
        if (&stream).write_all(&chunk).is_err() {
            break;
        }
    }
    let reply = read_reply(&mut BufReader::new(stream));
    if let Ok(reply) = reply {
        assert_eq!(reply.status, 413, "{reply:?}");
    }
    let grown = rss_kb(server.pid).saturating_sub(rss_before);
    assert!(grown < 16 * 1024, "brain serve grew by {grown} kB");
    assert_eq!(
        server
            .exchange(&encode("GET", "/health/live", &[], b""))
            .status,
        204
    );
    assert_eq!(server.call("GET", "/v1/sessions", None).status, 200);
    server.terminate(WAIT);
}

#[test]
fn hundreds_of_idle_connections_do_not_exhaust_the_server() {
    let (_data, mut server) = serve_f("security-idle", Some(API_TOKEN), &[], None);
    assert_eq!(server.call("GET", "/v1/sessions", None).status, 200);
    let threads_before = threads(server.pid);
    let rss_before = rss_kb(server.pid);
    // 300 connections that send nothing, and 100 kept alive after one request.
    let mut held: Vec<TcpStream> = (0..300).map(|_| server.connect()).collect();
    for _ in 0..100 {
        let stream = server.connect();
        (&stream)
            .write_all(&encode("GET", "/health/live", &[], b""))
            .unwrap();
        let reply = read_reply(&mut BufReader::new(stream.try_clone().unwrap())).unwrap();
        assert_eq!(reply.status, 204);
        held.push(stream);
    }
    answers_promptly(&server, "with the connections open");
    // Idle connections cost descriptors, not threads, and little memory.
    let threads_after = threads(server.pid);
    assert!(
        threads_after <= threads_before + 4,
        "threads grew from {threads_before} to {threads_after}"
    );
    let grown = rss_kb(server.pid).saturating_sub(rss_before);
    assert!(grown < 32 * 1024, "brain serve grew by {grown} kB");
    // And the API still runs activations.
    let id = server.create("f", json!({}));
    let reply = server.call(
        "POST",
        &format!("/v1/sessions/{id}/messages"),
        Some(json!({"content": [{"type": "text", "text": "still here"}]})),
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["outcome"], "completed");
    server.terminate(WAIT);
    drop(held);
}

#[test]
fn idle_connections_closing_at_once_do_not_refuse_real_requests() {
    let (_data, mut server) = serve_f("security-mass-close", Some(API_TOKEN), &[], None);
    let mut refused = Vec::new();
    // A race, so several rounds: 700 idle connections close while 4 clients probe.
    for round in 0..8 {
        let held: Vec<TcpStream> = (0..700).map(|_| server.connect()).collect();
        answers_promptly(
            &server,
            &format!("round {round}, 700 idle connections open"),
        );
        let start = std::sync::Barrier::new(5);
        let answers = parking_lot::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    start.wait();
                    for _ in 0..25 {
                        let probe = encode("GET", "/health/live", &[], b"");
                        answers.lock().push(exchange_within(&server, &probe).status);
                    }
                });
            }
            start.wait();
            drop(held);
        });
        let answers = answers.into_inner();
        refused.extend(answers.into_iter().filter(|status| *status != 204));
    }
    assert!(
        refused.is_empty(),
        "probes refused while idle connections closed: {refused:?}"
    );
    server.terminate(WAIT);
}

#[test]
fn half_sent_requests_do_not_stall_the_server() {
    let (_data, mut server) = serve_f("security-slow", Some(API_TOKEN), &[], None);
    assert_eq!(server.call("GET", "/v1/sessions", None).status, 200);
    // One half-sent request head per HTTP worker thread of brain serve (16 by default).
    let held: Vec<TcpStream> = (0..16)
        .map(|_| {
            let stream = server.connect();
            (&stream)
                .write_all(b"GET /v1/sessions HTTP/1.1\r\nhost: slow\r\nauthorization: Bea")
                .unwrap();
            stream
        })
        .collect();
    answers_promptly(&server, "with the half-sent requests open");
    drop(held);
    server.terminate(WAIT);
}

/// `/health/live`, an authorised list and an activation, each answered within [`PROMPT`].
fn answers_promptly(server: &Served, when: &str) {
    let began = Instant::now();
    let live = exchange_within(server, &encode("GET", "/health/live", &[], b""));
    assert_eq!(live.status, 204, "{when}: {live:?}");
    assert!(
        began.elapsed() < PROMPT,
        "/health/live took {:?}",
        began.elapsed()
    );
    let began = Instant::now();
    let auth = format!("Bearer {API_TOKEN}");
    let headers = [("authorization", auth.as_str())];
    let list = exchange_within(server, &encode("GET", "/v1/sessions", &headers, b""));
    assert_eq!(list.status, 200, "{when}: {list:?}");
    assert!(
        began.elapsed() < PROMPT,
        "/v1/sessions took {:?}",
        began.elapsed()
    );
}

/// [`Api::exchange`] with reads bounded by [`PROMPT`] rather than [`WAIT`].
fn exchange_within(server: &Served, raw: &[u8]) -> Reply {
    let stream = server.connect();
    stream.set_read_timeout(Some(PROMPT)).expect("read timeout");
    (&stream).write_all(raw).expect("send the request");
    read_reply(&mut BufReader::new(stream))
        .unwrap_or_else(|error| panic!("no answer within {PROMPT:?}: {error}"))
}

/// A number from `/proc/<pid>/status`.
fn status_field(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

fn threads(pid: u32) -> u64 {
    status_field(pid, "Threads:")
}

fn rss_kb(pid: u32) -> u64 {
    status_field(pid, "VmRSS:")
}

// ------------------------------------------------------------------------------------------------
// `brain serve` as a child process.

/// Starts `brain serve` on a fresh data directory with one registration `f` (the fault harness,
/// two workers), `token` as its `BRAIN_API_TOKEN` (without one it generates
/// `<data>/operator.token`), `env` and `umask`; the data directory and the server, which is killed
/// and reaped with its workers when dropped, on every path.
fn serve_f(
    tag: &str,
    token: Option<&str>,
    env: &[(&str, &str)],
    umask: Option<u32>,
) -> (PathBuf, Served) {
    let data = temp_dir(tag).join("data");
    let served = Start {
        data: &data,
        registrations: json!({"f": {"command": FAULT_HARNESS, "workers": 2}}),
        extra: &[],
        token,
        env,
        uid: None,
        umask,
    }
    .run();
    (data, served)
}
