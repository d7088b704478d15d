//! The Codex harness adapter (`adapters/codex`, issue 23) run by a real Brain: real `node`
//! processes running the adapter, each session's real `codex app-server` 0.169.0 from the npm
//! lockfile, the `scripted` model provider behind the adapter's Responses gateway, and the `local`
//! tool driver. Needs `npm ci` in `adapters/codex` (scripts/test does it).

mod common;

use brain::session::CreateSession;
use brain::{Activation, Brain, OutcomeKind, Registration, Session};
use brain::{SessionStatus, WorkerState};
use common::adapter::*;
use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The adapter's registration, after checking that its dependencies are installed.
fn codex() -> Registration {
    adapter_registration("codex", "@openai/codex/package.json")
}

/// Brain's cancel grace in these tests: the protocol's 5 s.
const GRACE: Duration = Duration::from_secs(5);

fn start_codex(tag: &str) -> Running {
    start_codex_with(tag, codex())
}

fn start_codex_with(tag: &str, registration: Registration) -> Running {
    Running::start(vec![registration], adapter_options(tag))
}

/// Blocks until the session's journal holds a record of `kind` (bounded by WAIT).
fn wait_for_record(session: &Session, kind: &str) {
    session
        .wait_for_events(WAIT, |events| events.iter().any(|e| e.event_type == kind))
        .unwrap_or_else(|_| panic!("no {kind} record in session {}", session.id()));
}

/// The running `codex` processes whose CODEX_HOME is this session's (read from /proc).
fn codex_processes(state_dir: &Path) -> Vec<u32> {
    let wanted = format!("CODEX_HOME={}", state_dir.join("codex").display());
    all_pids()
        .into_iter()
        .filter(|&pid| !not_running(pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|environ| {
                environ
                    .split(|&b| b == 0)
                    .any(|var| var == wanted.as_bytes())
            })
        })
        .collect()
}

/// The one Codex process of a session, waiting (bounded) for it to appear.
fn codex_process(state_dir: &Path) -> u32 {
    let deadline = Instant::now() + WAIT;
    loop {
        let pids = codex_processes(state_dir);
        if pids.len() == 1 {
            return pids[0];
        }
        assert!(
            Instant::now() < deadline,
            "no single codex process for {}: {pids:?}",
            state_dir.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits (bounded) until no Codex process of the session runs.
fn assert_no_codex(state_dir: &Path) {
    let deadline = Instant::now() + WAIT;
    loop {
        let pids = codex_processes(state_dir);
        if pids.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "codex processes left for {}: {pids:?}",
            state_dir.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A session declaring tool `lookup` in a `local` environment running `script` with /bin/sh.
fn with_lookup_tool(script_for_model: Value, shell: &str) -> Value {
    lookup_request("codex", script_for_model, shell)
}

/// An opaque provider block Codex must hand back to Brain untouched.
fn native() -> Value {
    json!({"type": "native", "format": "openai.responses.reasoning",
           "data": {"id": "rs_1", "encrypted_content": "gAAA", "summary": []}})
}

fn asks_for(tool: &str, input: Value) -> Value {
    json!({"message": {"role": "assistant", "content": [
              native(),
              {"type": "text", "text": "Let me check."},
              {"type": "tool_use", "id": "call_1", "name": tool, "input": input}]},
           "stop_reason": "tool_use", "usage": {}})
}

/// The session's user and assistant messages of a model request (role, texts).
fn conversation(request: &Value) -> Vec<(String, Vec<String>)> {
    request["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "user" || m["role"] == "assistant")
        .map(|m| {
            (
                m["role"].as_str().unwrap_or_default().to_owned(),
                texts(m).into_iter().map(str::to_owned).collect(),
            )
        })
        .collect()
}

fn assert_no_violations(brain: &Brain) {
    assert_eq!(
        brain
            .status()
            .worker("codex", 0)
            .expect("worker")
            .violations,
        0,
        "the worker's stdout carried something other than protocol lines"
    );
}

#[test]
fn a_text_turn_completes_with_codex_s_answer_and_the_session_s_system_prompt() {
    let brain = start_codex("text");
    let session = create(
        &brain,
        json!({"agentloop": {"name": "codex"}, "model": model(Some(json!([answers("hello there")]))),
               "system": "You are terse."}),
    );
    let result = a_completed_turn(&session, "hi");
    assert_eq!(result["text"], "hello there");
    assert_eq!(result["model_calls"], 1);

    let requests = model_requests(&session);
    assert_eq!(requests.len(), 1);
    // The session's system prompt is Codex's base instructions, and the request's system prompt.
    assert_eq!(requests[0]["system"], "You are terse.");
    assert_eq!(
        conversation(&requests[0]),
        [("user".to_owned(), vec!["hi".to_owned()])]
    );
    // No tools at all: request_user_input, which Codex always offers, is filtered out.
    assert_eq!(offered(&requests[0]), Vec::<String>::new());

    let (transcript, _) = session.transcript().unwrap();
    assert_eq!(
        serde_json::to_value(&transcript).unwrap(),
        json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "hello there"}]}])
    );
    // Codex's native state lives under the session's state_dir.
    let state_dir = session.info().unwrap().state_dir;
    assert!(state_dir.join("codex/sessions").is_dir());
    assert!(state_dir.join("brain-codex.json").is_file());
    assert_no_violations(&brain);
}

#[test]
fn the_model_asks_for_a_tool_the_local_driver_runs_it_and_the_model_answers() {
    let brain = start_codex("tool");
    let script = json!([
        asks_for("lookup", json!({"word": "pi"})),
        answers("pi is 3.14")
    ]);
    let request = with_lookup_tool(script, "cat > input.json; echo found-314");
    let (session, requests) = a_tool_round_trip(&brain, request);

    // The second model call saw the first answer exactly as the model gave it (the native block
    // came back byte for byte), then the tool's result.
    for request in &requests {
        assert_eq!(offered(request), ["lookup"], "{request}");
    }
    let messages = requests[1]["messages"].as_array().unwrap();
    assert_eq!(
        messages[messages.len() - 2],
        json!({"role": "assistant", "content": [
            native(),
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"word": "pi"}}]})
    );
    let last = messages.last().unwrap();
    assert_eq!(last["role"], "user");
    assert_eq!(last["content"][0]["type"], "tool_result");
    assert_eq!(last["content"][0]["tool_use_id"], "call_1");
    assert_eq!(last["content"][0]["content"][0]["text"], "found-314\n");

    // The transcript was saved before the answer: question, tool use, tool result, answer.
    let (transcript, _) = session.transcript().unwrap();
    let transcript = serde_json::to_value(&transcript).unwrap();
    let roles: Vec<&str> = transcript
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert_eq!(transcript[1], messages[messages.len() - 2]);
    assert_eq!(texts(&transcript[3]), ["pi is 3.14"]);
    assert_no_violations(&brain);
}

/// The rollout files of the session's Codex home.
fn rollouts(state_dir: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "jsonl") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&state_dir.join("codex/sessions"), &mut out);
    out.sort();
    out
}

/// Two messages in one session; `between` runs after the first. The second model request must
/// hold the first exchange, from Codex's one thread resumed.
fn second_message_sees_the_first(tag: &str, between: impl FnOnce(&mut Running, &Session)) {
    let mut brain = start_codex(tag);
    // No script: the scripted provider echoes the last user text.
    let session = create(
        &brain,
        json!({"agentloop": {"name": "codex"}, "model": model(None)}),
    );
    let first = wait(&session.send(text("remember the word kumquat")).unwrap());
    assert_eq!(first.outcome, OutcomeKind::Completed, "{first:?}");
    let state_dir = session.info().unwrap().state_dir;
    let thread = first.result.expect("a result")["thread_id"].clone();
    let native = rollouts(&state_dir);
    assert_eq!(native.len(), 1, "one Codex thread: {native:?}");

    between(&mut brain, &session);
    let session = brain.session(session.id());

    let second = wait(&session.send(text("which word?")).unwrap());
    assert_eq!(second.outcome, OutcomeKind::Completed, "{second:?}");
    assert_eq!(second.result.expect("a result")["thread_id"], thread);
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 2);
    let words = |s: &str| vec![s.to_owned()];
    assert_eq!(
        conversation(&requests[1]),
        [
            ("user".to_owned(), words("remember the word kumquat")),
            ("assistant".to_owned(), words("remember the word kumquat")),
            ("user".to_owned(), words("which word?")),
        ]
    );
    // The continuation is Codex's own thread, resumed (a new thread would be a new rollout).
    assert_eq!(rollouts(&state_dir), native);
    let (transcript, _) = session.transcript().unwrap();
    assert_eq!(transcript.len(), 4);
    assert_no_violations(&brain);
}

#[test]
fn a_second_message_sees_the_first_exchange() {
    second_message_sees_the_first("second", |_, _| {});
}

#[test]
fn a_second_message_sees_the_first_exchange_after_the_idle_worker_was_killed() {
    second_message_sees_the_first("second-killed", |brain, session| {
        let state_dir = session.info().unwrap().state_dir;
        let codex = codex_process(&state_dir);
        let pid = worker_pid(brain, "codex");
        kill(pid);
        let status = brain
            .wait_for(WAIT, |s| {
                s.worker("codex", 0).is_some_and(|w| {
                    w.state == WorkerState::Healthy && w.pid.is_some_and(|p| p != pid)
                })
            })
            .expect("the worker was respawned");
        assert!(status.worker("codex", 0).unwrap().restarts >= 1);
        // The worker's Codex went with it.
        assert!(
            stops_within(codex, WAIT),
            "codex {codex} outlived its worker"
        );
        assert_eq!(session.info().unwrap().status, SessionStatus::Open);
    });
}

#[test]
fn a_second_message_sees_the_first_exchange_after_brain_restarted() {
    second_message_sees_the_first("second-restart", |brain, session| {
        let state_dir = session.info().unwrap().state_dir;
        brain.restart();
        assert_no_codex(&state_dir);
    });
}

#[test]
fn codex_dying_while_idle_is_restarted_at_the_next_activation() {
    second_message_sees_the_first("second-idle-death", |brain, session| {
        let state_dir = session.info().unwrap().state_dir;
        let first = codex_process(&state_dir);
        kill(first);
        assert!(stops_within(first, WAIT));
        // The worker lives on; the next activation starts another Codex on the same thread.
        assert_eq!(brain.status().worker("codex", 0).unwrap().restarts, 0);
        assert_no_codex(&state_dir);
    });
}

#[test]
fn passivation_stops_codex_and_the_next_activation_resumes_the_thread() {
    second_message_sees_the_first("second-passivated", |_, session| {
        let state_dir = session.info().unwrap().state_dir;
        let pid = codex_process(&state_dir);
        session.passivate().unwrap();
        assert!(stops_within(pid, WAIT), "codex {pid} outlived close");
        assert_no_codex(&state_dir);
    });
}

/// A session whose model asks for `lookup`, which runs `shell`; returns once the tool runs.
fn blocked_in_a_tool(brain: &Brain, shell: &str) -> (Session, Activation) {
    let script = json!([
        asks_for("lookup", json!({"word": "slow"})),
        answers("never")
    ]);
    let session = create(brain, with_lookup_tool(script, shell));
    let activation = session.send(text("take your time")).unwrap();
    wait_for_record(&session, "tool_call_started");
    (session, activation)
}

#[test]
fn cancel_mid_turn_ends_cancelled_within_the_grace_and_leaves_no_codex_process() {
    let brain = start_codex("cancel");
    let grace = GRACE;
    let (session, activation) = blocked_in_a_tool(&brain, "exec sleep 60");
    let state_dir = session.info().unwrap().state_dir;
    let codex = codex_process(&state_dir);
    let pid = worker_pid(&brain, "codex");
    let asked = Instant::now();
    assert!(session.cancel().unwrap().was_running);
    let outcome = wait(&activation);
    let took = asked.elapsed();
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled, "{outcome:?}");
    assert_eq!(outcome.error.as_ref().unwrap().code.as_str(), "cancelled");
    assert!(took < grace, "cancel took {took:?}, the grace is {grace:?}");
    eprintln!("cancel answered in {took:?}");
    // The adapter answered by itself: Brain did not have to kill it.
    assert_eq!(worker_pid(&brain, "codex"), pid);
    assert_eq!(brain.status().worker("codex", 0).unwrap().restarts, 0);
    // The interrupted session's Codex is gone, and no model call started after the cancel.
    assert!(stops_within(codex, Duration::from_secs(1)));
    assert!(codex_processes(&state_dir).is_empty());
    assert_eq!(model_requests(&session).len(), 1);
    assert_eq!(session.info().unwrap().status, SessionStatus::Interrupted);
    assert_no_violations(&brain);
}

#[test]
fn the_adapter_killed_mid_run_leaves_the_session_interrupted() {
    let brain = start_codex("killed");
    let (session, activation) = blocked_in_a_tool(&brain, "exec sleep 60");
    let state_dir = session.info().unwrap().state_dir;
    let codex = codex_process(&state_dir);
    kill(worker_pid(&brain, "codex"));
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Failed, "{outcome:?}");
    assert_eq!(outcome.error.as_ref().unwrap().code.as_str(), "worker_lost");
    assert_interrupted(&session, activation.sequence());
    assert!(
        stops_within(codex, WAIT),
        "codex {codex} outlived its worker"
    );
}

#[test]
fn codex_dying_mid_run_fails_the_run_and_leaves_the_session_interrupted() {
    let brain = start_codex("codex-killed");
    // A short tool: the adapter answers run once the callback it started was answered.
    let (session, activation) = blocked_in_a_tool(&brain, "exec sleep 2");
    let state_dir = session.info().unwrap().state_dir;
    kill(codex_process(&state_dir));
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Failed, "{outcome:?}");
    let error = outcome.error.as_ref().unwrap();
    assert_eq!(error.code.as_str(), "harness_error");
    assert!(error.message.contains("died mid-run"), "{}", error.message);
    assert_interrupted(&session, activation.sequence());
    // The worker survived it.
    assert_eq!(brain.status().worker("codex", 0).unwrap().restarts, 0);
}

#[test]
fn unknown_configuration_keys_missing_model_metadata_and_media_are_refused_at_creation() {
    let brain = start_codex("refusals");
    assert_text_only_refusals(&brain, "codex");
    // Media in an imported transcript is refused at creation too.
    let parse = |request: Value| CreateSession::parse(request.to_string().as_bytes()).unwrap();
    let media = brain
        .create_session(parse(json!({
            "agentloop": {"name": "codex"}, "model": model(None),
            "transcript": [{"role": "user", "content": [
                {"type": "image", "url": "https://example.com/chart.png"}]}]})))
        .unwrap_err();
    assert_eq!(media.code.as_str(), "unsupported_input");

    // A known key with a wrong value fails the activation, naming it, before Codex starts.
    let wrong = create(
        &brain,
        json!({"agentloop": {"name": "codex", "configuration": {"auto_compact_token_limit": "big"}},
               "model": model(None)}),
    );
    let outcome = wait(&wrong.send(text("hi")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Failed, "{outcome:?}");
    let error = outcome.error.as_ref().unwrap();
    assert_eq!(error.code.as_str(), "invalid_configuration");
    assert!(
        error.message.contains("auto_compact_token_limit"),
        "{}",
        error.message
    );
    assert!(records(&wrong, "model_call_started").is_empty());
    assert!(codex_processes(&wrong.info().unwrap().state_dir).is_empty());
}

#[test]
fn a_tool_the_session_did_not_admit_is_never_offered_nor_run() {
    let brain = start_codex("admitted");
    // The model asks for Codex's built-in shell, which this session did not declare, and for the
    // request_user_input tool Codex always has.
    let script = json!([
        asks_for("shell", json!({"command": ["touch", "pwned"]})),
        answers("ok")
    ]);
    let session = create(&brain, with_lookup_tool(script, "echo found"));
    a_completed_turn(&session, "run something");
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 2);
    for request in &requests {
        assert_eq!(offered(request), ["lookup"], "{request}");
        assert!(!request.to_string().contains("request_user_input"));
    }
    // Nothing ran: no tool call reached Brain, and no shell ran on the host.
    assert!(records(&session, "tool_call_started").is_empty());
    let state_dir = session.info().unwrap().state_dir;
    assert!(!state_dir.join("pwned").exists());
    // The model was told the call went nowhere.
    let last = requests[1]["messages"].as_array().unwrap().last().unwrap();
    assert_eq!(last["content"][0]["type"], "tool_result");
    assert_eq!(last["content"][0]["tool_use_id"], "call_1");
}

#[test]
fn a_failing_model_call_fails_the_run_with_its_code_after_exactly_one_call() {
    let brain = start_codex("model-failed");
    // An entry that is no ModelResult: the scripted provider fails the call model_failed.
    let session = create(
        &brain,
        json!({"agentloop": {"name": "codex"}, "model": model(Some(json!([{"bogus": true}])))}),
    );
    let activation = session.send(text("hi")).unwrap();
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Failed, "{outcome:?}");
    assert_eq!(
        outcome.error.as_ref().unwrap().code.as_str(),
        "model_failed"
    );
    // Codex did not retry: one journaled model call.
    assert_eq!(records(&session, "model_call_started").len(), 1);
    assert_interrupted(&session, activation.sequence());
    assert_no_codex(&session.info().unwrap().state_dir);
}

#[test]
fn a_fatal_callback_error_stops_the_turn_promptly_with_no_further_callback() {
    let brain = Running::start_with(
        vec![codex()],
        adapter_options("codex-fatal"),
        fatal_second_call(),
    );
    let script = json!([asks_for("lookup", json!({"word": "pi"})), answers("never")]);
    assert_a_fatal_error_stops_the_turn(
        &brain,
        "codex",
        with_lookup_tool(script, "echo found-314"),
    );
    assert_no_violations(&brain);
}

#[test]
fn a_small_context_window_makes_codex_compact_through_brain_and_the_turn_completes() {
    let brain = start_codex("compaction");
    // The first answer reports more input tokens than the window leaves before compaction
    // (4,000 - 1,000 for output): Codex summarises through the gateway, then goes on.
    let asks = asks_for("lookup", json!({"word": "pi"}));
    let (session, _) = a_compacting_turn(&brain, "codex", asks);

    let requests = model_requests(&session);
    assert_eq!(requests.len(), 3);
    // The compaction request: no tools, the history and Codex's summarising prompt.
    assert_eq!(offered(&requests[1]), Vec::<String>::new());
    let compaction = requests[1]["messages"].as_array().unwrap();
    assert!(
        texts(compaction.last().unwrap())
            .concat()
            .contains("COMPACTION"),
        "{}",
        requests[1]
    );
    // The next request goes on from the summary, with the tools again.
    assert_eq!(offered(&requests[2]), ["lookup"]);
    assert!(requests[2].to_string().contains("SUMMARY-OF-THE-WORK"));
    assert!(!requests[2].to_string().contains("found-314"));
    // The transcript keeps the conversation, not Codex's summary.
    let (transcript, _) = session.transcript().unwrap();
    let transcript = serde_json::to_value(&transcript).unwrap();
    assert_eq!(transcript.as_array().unwrap().len(), 4, "{transcript}");
    assert!(!transcript.to_string().contains("SUMMARY-OF-THE-WORK"));
    assert_no_violations(&brain);
}

#[test]
fn a_changed_tool_catalogue_fails_explicitly() {
    let brain = start_codex("catalogue");
    let session = create(&brain, with_lookup_tool(json!([answers("one")]), "echo x"));
    let first = wait(&session.send(text("first")).unwrap());
    assert_eq!(first.outcome, OutcomeKind::Completed, "{first:?}");
    // What a thread created with another catalogue looks like: Codex fixed other dynamic tools.
    let state_dir = session.info().unwrap().state_dir;
    let file = state_dir.join("brain-codex.json");
    let mut saved: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(saved["tools"][0]["name"], "lookup");
    saved["tools"][0]["name"] = json!("search");
    std::fs::write(&file, saved.to_string()).unwrap();

    let second = wait(&session.send(text("second")).unwrap());
    assert_eq!(second.outcome, OutcomeKind::Failed, "{second:?}");
    let error = second.error.as_ref().unwrap();
    assert_eq!(error.code.as_str(), "unsupported_input");
    assert!(
        error.message.contains("tool catalogue changed"),
        "{}",
        error.message
    );
    // No model call of the refused activation.
    assert_eq!(records(&session, "model_call_started").len(), 1);
}

#[test]
fn deleting_the_session_removes_its_codex_home() {
    let brain = start_codex("delete");
    let session = create(
        &brain,
        json!({"agentloop": {"name": "codex"}, "model": model(None)}),
    );
    a_completed_turn(&session, "hi");
    let state_dir = session.info().unwrap().state_dir;
    let home = state_dir.join("codex");
    assert!(home.join("sessions").is_dir());
    let pid = codex_process(&state_dir);
    session.close().unwrap();
    assert!(stops_within(pid, WAIT), "codex {pid} outlived close");
    session.delete().unwrap();
    assert!(!home.exists(), "{} is still there", home.display());
    assert!(!state_dir.exists());
}

#[test]
fn brain_run_completes_with_the_example_registration() {
    brain_run_example("codex", "codex-run", false);
}

#[test]
fn brain_run_completes_with_no_network_but_loopback() {
    brain_run_example("codex", "codex-offline", true);
}

/// The gateway's base URL as the session's Codex was given it, from its command line.
fn gateway_url(codex: u32) -> String {
    let cmdline = std::fs::read(format!("/proc/{codex}/cmdline")).expect("codex's command line");
    cmdline
        .split(|&b| b == 0)
        .filter_map(|arg| std::str::from_utf8(arg).ok())
        .find_map(|arg| arg.strip_prefix("model_providers.brain.base_url=\""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("codex was given the gateway's base URL")
        .to_owned()
}

/// POSTs `body` to `url` (http://127.0.0.1:PORT/PATH) with an optional Authorization header;
/// returns the status line.
fn post(url: &str, authorization: Option<&str>, body: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("an http URL");
    let (host, path) = rest.split_once('/').expect("a path");
    let mut stream = std::net::TcpStream::connect(host).expect("connect to the gateway");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let auth = authorization
        .map(|value| format!("authorization: {value}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "POST /{path}/responses HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n\
         {auth}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.lines().next().unwrap_or_default().to_owned()
}

#[test]
fn the_gateway_refuses_a_request_without_the_workers_token() {
    // Unsandboxed, so that this test can reach the gateway at all: a sandboxed worker's gateway
    // is in a network namespace of its own, out of every other process's reach.
    let brain = start_codex_with("gateway", codex().sandbox(false));
    // A running activation, so that a request with the right token would reach Brain.
    let (session, activation) = blocked_in_a_tool(&brain, "exec sleep 60");
    let state_dir = session.info().unwrap().state_dir;
    let url = gateway_url(codex_process(&state_dir));
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let body = json!({"model": "default", "input": [], "tools": []}).to_string();
    assert!(post(&url, None, &body).contains(" 401 "));
    let forged = format!("Bearer {}", "0".repeat(64));
    assert!(post(&url, Some(&forged), &body).contains(" 401 "));
    // Neither reached Brain.
    assert_eq!(model_requests(&session).len(), 1);
    session.cancel().unwrap();
    assert_eq!(wait(&activation).outcome, OutcomeKind::Cancelled);
}

#[test]
fn two_sessions_at_once_each_run_their_own_codex() {
    let brain = start_codex("two");
    let sessions: Vec<Session> = ["first", "second"]
        .iter()
        .map(|word| {
            create(
                &brain,
                json!({"agentloop": {"name": "codex"},
                       "model": model(Some(json!([answers(&format!("answer for {word}"))])))}),
            )
        })
        .collect();
    let activations: Vec<Activation> = sessions
        .iter()
        .map(|session| session.send(text("go")).unwrap())
        .collect();
    for (word, activation) in ["first", "second"].iter().zip(&activations) {
        let outcome = wait(activation);
        assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
        assert_eq!(
            outcome.result.expect("a result")["text"],
            format!("answer for {word}")
        );
    }
    let pids: Vec<u32> = sessions
        .iter()
        .map(|session| codex_process(&session.info().unwrap().state_dir))
        .collect();
    assert_ne!(pids[0], pids[1]);
    for session in &sessions {
        assert_eq!(model_requests(session).len(), 1);
    }
    assert_no_violations(&brain);
}
