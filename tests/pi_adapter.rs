//! The Pi harness adapter (`adapters/pi`, issue 9) run by a real Brain: real `node` processes
//! running the real `@mariozechner/pi-coding-agent`, the `scripted` model provider and the `local`
//! tool driver. Needs `npm ci` in `adapters/pi` (scripts/test does it).

mod common;

use brain::protocol::harness::UserInput;
use brain::session::CreateSession;
use brain::{Activation, Brain, OutcomeKind, Registration, Session};
use brain::{SessionStatus, WorkerState};
use common::adapter::*;
use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The checkout, where `examples/pi.json` and `adapters/pi` live.
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The adapter's registration, after checking that its dependencies are installed.
fn pi() -> Registration {
    adapter_registration("pi", "@mariozechner/pi-coding-agent")
}

fn start_pi(tag: &str) -> Brain {
    start(vec![pi()], adapter_options(tag))
}

/// Blocks until the session's journal holds a record of `kind` (bounded by WAIT).
fn wait_for_record(session: &Session, kind: &str) {
    session
        .wait_for_events(WAIT, |events| events.iter().any(|e| e.event_type == kind))
        .unwrap_or_else(|_| panic!("no {kind} record in session {}", session.id()));
}

fn kill(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the worker");
}

/// A session declaring tool `lookup` in a `local` environment running `script` with /bin/sh.
fn with_lookup_tool(script_for_model: Value, shell: &str) -> Value {
    lookup_request("pi", script_for_model, shell)
}

/// An opaque provider block Pi must hand back to Brain untouched.
fn native() -> Value {
    json!({"type": "native", "format": "test.reasoning",
           "data": {"id": "rs_1", "encrypted_content": "gAAA"}})
}

fn asks_for(tool: &str, input: Value) -> Value {
    json!({"message": {"role": "assistant", "content": [
              native(),
              {"type": "text", "text": "Let me check."},
              {"type": "tool_use", "id": "tu_1", "name": tool, "input": input}]},
           "stop_reason": "tool_use", "usage": {}})
}

#[test]
fn the_model_asks_for_a_tool_the_local_driver_runs_it_and_the_model_answers() {
    let brain = start_pi("tool");
    let script = json!([
        asks_for("lookup", json!({"word": "pi"})),
        answers("pi is 3.14")
    ]);
    let request = with_lookup_tool(script, "cat > input.json; echo found-314");
    let (session, requests) = a_tool_round_trip(&brain, request);

    // The second model call saw the first answer exactly as the model gave it (the native block
    // included), then the tool's result.
    assert_eq!(
        requests[1]["messages"][1],
        json!({"role": "assistant", "content": [
            native(),
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "tu_1", "name": "lookup", "input": {"word": "pi"}}]})
    );
    let last = requests[1]["messages"].as_array().unwrap().last().unwrap();
    assert_eq!(last["role"], "user");
    assert_eq!(last["content"][0]["type"], "tool_result");
    assert_eq!(last["content"][0]["tool_use_id"], "tu_1");
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
    assert_eq!(texts(&transcript[3]), ["pi is 3.14"]);

    // Pi and its libraries printed nothing but protocol lines on stdout.
    assert_eq!(brain.status().worker("pi", 0).unwrap().violations, 0);
}

/// The Pi session files in a session's native state directory.
fn native_sessions(state_dir: &Path) -> Vec<PathBuf> {
    let dir = state_dir.join("pi/sessions");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    files
}

/// The messages (role and text) Pi's native session file holds.
fn native_messages(file: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .filter(|entry| entry["type"] == "message")
        .map(|entry| {
            let message = &entry["message"];
            let text = message["content"]
                .as_array()
                .map(|parts| {
                    parts
                        .iter()
                        .filter_map(|p| p["text"].as_str())
                        .collect::<String>()
                })
                .unwrap_or_default();
            (message["role"].as_str().unwrap().to_owned(), text)
        })
        .collect()
}

/// Two messages in one session; `between` runs after the first. The second model request must
/// hold the first exchange, and Pi's one native session must hold both.
fn second_message_sees_the_first(tag: &str, between: impl FnOnce(&Brain, &Session)) {
    let brain = start_pi(tag);
    // No script: the scripted provider echoes the last user text.
    let session = create(
        &brain,
        json!({"agentloop": {"name": "pi"}, "model": model(None)}),
    );
    let first = wait(&session.send(text("remember the word kumquat")).unwrap());
    assert_eq!(first.outcome, OutcomeKind::Completed, "{first:?}");
    let state_dir = session.info().unwrap().state_dir;
    let native = native_sessions(&state_dir);
    assert_eq!(native.len(), 1, "one native Pi session: {native:?}");

    between(&brain, &session);

    let second = wait(&session.send(text("which word?")).unwrap());
    assert_eq!(second.outcome, OutcomeKind::Completed, "{second:?}");
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 2);
    let messages = requests[1]["messages"].as_array().unwrap();
    let seen: Vec<(&str, Vec<&str>)> = messages
        .iter()
        .map(|m| (m["role"].as_str().unwrap(), texts(m)))
        .collect();
    assert_eq!(
        seen,
        [
            ("user", vec!["remember the word kumquat"]),
            ("assistant", vec!["remember the word kumquat"]),
            ("user", vec!["which word?"]),
        ]
    );
    // The continuation is Pi's own session file, reopened and appended to (a session rebuilt
    // from Brain's transcript would be a new file).
    assert_eq!(native_sessions(&state_dir), native);
    let words: Vec<(String, String)> = native_messages(&native[0]);
    assert_eq!(
        words,
        [
            ("user".into(), "remember the word kumquat".into()),
            ("assistant".into(), "remember the word kumquat".into()),
            ("user".into(), "which word?".into()),
            ("assistant".into(), "which word?".into()),
        ]
    );
}

#[test]
fn a_second_message_sees_the_first_exchange() {
    second_message_sees_the_first("second", |_, _| {});
}

#[test]
fn a_second_message_sees_the_first_exchange_after_the_idle_worker_was_killed() {
    second_message_sees_the_first("second-killed", |brain, session| {
        let pid = worker_pid(brain, "pi");
        kill(pid);
        let status = brain
            .wait_for(WAIT, |s| {
                s.worker("pi", 0).is_some_and(|w| {
                    w.state == WorkerState::Healthy && w.pid.is_some_and(|p| p != pid)
                })
            })
            .expect("the worker was respawned");
        assert!(status.worker("pi", 0).unwrap().restarts >= 1);
        assert_eq!(session.info().unwrap().status, SessionStatus::Open);
    });
}

/// A session whose model asks for `lookup`, which blocks until killed; returns once the tool runs.
fn blocked_in_a_tool(brain: &Brain) -> (Session, Activation) {
    let script = json!([
        asks_for("lookup", json!({"word": "slow"})),
        answers("never")
    ]);
    let session = create(brain, with_lookup_tool(script, "exec sleep 60"));
    let activation = session.send(text("take your time")).unwrap();
    wait_for_record(&session, "tool_call_started");
    (session, activation)
}

#[test]
fn cancel_mid_run_ends_cancelled_within_the_grace() {
    let brain = start_pi("cancel");
    let grace = adapter_options("grace").cancel_grace;
    let (session, activation) = blocked_in_a_tool(&brain);
    let pid = worker_pid(&brain, "pi");
    let asked = Instant::now();
    assert!(session.cancel().unwrap().was_running);
    let outcome = wait(&activation);
    let took = asked.elapsed();
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled, "{outcome:?}");
    assert_eq!(outcome.error.as_ref().unwrap().code.as_str(), "cancelled");
    assert!(took < grace, "cancel took {took:?}, the grace is {grace:?}");
    // The adapter answered by itself: Brain did not have to kill it.
    assert_eq!(worker_pid(&brain, "pi"), pid);
    assert_eq!(brain.status().worker("pi", 0).unwrap().restarts, 0);
    // No further model call started after the cancel.
    assert_eq!(model_requests(&session).len(), 1);
    assert_eq!(session.info().unwrap().status, SessionStatus::Interrupted);
}

#[test]
fn a_fatal_callback_error_stops_the_turn_promptly_with_no_further_callback() {
    let brain = Running::start_with(vec![pi()], adapter_options("pi-fatal"), fatal_second_call());
    let script = json!([asks_for("lookup", json!({"word": "pi"})), answers("never")]);
    assert_a_fatal_error_stops_the_turn(&brain, "pi", with_lookup_tool(script, "echo found-314"));
}

#[test]
fn the_adapter_killed_mid_run_leaves_the_session_interrupted() {
    let brain = start_pi("killed");
    let (session, activation) = blocked_in_a_tool(&brain);
    kill(worker_pid(&brain, "pi"));
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Failed, "{outcome:?}");
    assert_eq!(outcome.error.as_ref().unwrap().code.as_str(), "worker_lost");
    assert_interrupted(&session, activation.sequence());
}

#[test]
fn unknown_configuration_keys_and_missing_model_metadata_are_refused_at_creation() {
    let brain = start_pi("refusals");
    let parse = |request: Value| CreateSession::parse(request.to_string().as_bytes()).unwrap();
    let (unknown, missing) = assert_creation_refusals(&brain, "pi");
    // The refusal names the keys Pi does take, and only the metadata that is missing.
    assert!(unknown.contains("compaction"), "{unknown}");
    assert!(!missing.contains("context_window"), "{missing}");

    let defaulted = brain
        .create_session(parse(json!({"agentloop": {"name": "pi"}})))
        .unwrap_err();
    assert_eq!(defaulted.code.as_str(), "missing_model_metadata");
    assert!(
        defaulted.message.contains("context_window"),
        "{}",
        defaulted.message
    );
}

#[test]
fn an_https_image_in_the_input_reaches_the_model_request() {
    let brain = start_pi("image");
    let session = create(
        &brain,
        json!({"agentloop": {"name": "pi"}, "model": model(None)}),
    );
    let input: UserInput = serde_json::from_value(json!({"content": [
        {"type": "text", "text": "What does this show?"},
        {"type": "image", "url": "https://example.com/chart.png"}]}))
    .unwrap();
    let outcome = wait(&session.send(input).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    let requests = model_requests(&session);
    let user = requests[0]["messages"].as_array().unwrap().last().unwrap();
    assert_eq!(user["role"], "user");
    assert_eq!(
        user["content"],
        json!([{"type": "text", "text": "What does this show?"},
               {"type": "image", "url": "https://example.com/chart.png"}])
    );
}

#[test]
fn a_tool_the_session_did_not_admit_is_never_offered_nor_run() {
    let brain = start_pi("admitted");
    // The model asks for Pi's built-in `bash`, which this session did not declare.
    let script = json!([
        asks_for("bash", json!({"command": "touch pwned"})),
        answers("ok")
    ]);
    let session = create(&brain, with_lookup_tool(script, "echo found"));
    a_completed_turn(&session, "run something");
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 2);
    for request in &requests {
        let offered: Vec<&str> = request["tools"]
            .as_array()
            .expect("the adapter names the tools it offers")
            .iter()
            .map(|tool| tool["name"].as_str().unwrap())
            .collect();
        assert_eq!(offered, ["lookup"], "{request}");
    }
    // Nothing ran: no tool call reached Brain, and Pi's own bash never ran on the host.
    assert!(records(&session, "tool_call_started").is_empty());
    let state_dir = session.info().unwrap().state_dir;
    assert!(!state_dir.join("pwned").exists());
    // The model was told the tool does not exist.
    let last = requests[1]["messages"].as_array().unwrap().last().unwrap();
    assert_eq!(last["content"][0]["type"], "tool_result");
    assert_eq!(last["content"][0]["is_error"], true);
}

#[test]
fn a_session_tool_named_like_a_pi_builtin_runs_through_brain() {
    let brain = start_pi("builtin-name");
    let script = json!([
        asks_for("read", json!({"path": "/etc/hostname"})),
        answers("read it")
    ]);
    let session = create(
        &brain,
        json!({
            "agentloop": {"name": "pi"},
            "model": model(Some(script)),
            "tools": [{"name": "read", "description": "Read through Brain",
                       "input_schema": {"type": "object"}, "placements": ["host"]}],
            "environments": [{"name": "host", "driver": "local", "configuration": {
                "tools": {"read": {"command": ["/bin/sh", "-c", "echo from-brain"]}}}}],
        }),
    );
    a_completed_turn(&session, "read the hostname");
    let requests = model_requests(&session);
    // Offered with the session's declaration, not Pi's.
    assert_eq!(
        requests[0]["tools"],
        json!([{"name": "read", "description": "Read through Brain",
                "input_schema": {"type": "object"}}])
    );
    // Executed by Brain's driver: the model reads its output, not the file.
    assert_eq!(records(&session, "tool_call_finished").len(), 1);
    let last = requests[1]["messages"].as_array().unwrap().last().unwrap();
    assert_eq!(last["content"][0]["content"][0]["text"], "from-brain\n");
}

#[test]
fn a_session_created_with_a_transcript_continues_from_it() {
    let brain = start_pi("import");
    let imported = json!([
        {"role": "user", "content": [{"type": "text", "text": "my name is Ada"}]},
        {"role": "assistant", "content": [native(), {"type": "text", "text": "hello Ada"}]}]);
    let session = create(
        &brain,
        json!({"agentloop": {"name": "pi"}, "model": model(None), "transcript": imported}),
    );
    a_completed_turn(&session, "what is my name?");
    let mut expected = imported.as_array().unwrap().clone();
    expected
        .push(json!({"role": "user", "content": [{"type": "text", "text": "what is my name?"}]}));
    assert_eq!(
        model_requests(&session)[0]["messages"],
        Value::Array(expected)
    );
}

/// `brain run --agentloops examples/pi.json --agentloop pi MESSAGE`, with `extra` arguments.
fn brain_run_pi(tag: &str, extra: &[String]) {
    let data = temp_dir(tag).join("data");
    let output = run_bounded(
        std::process::Command::new(BRAIN)
            .current_dir(ROOT)
            .args(["run", "--data-dir"])
            .arg(&data)
            .args(["--agentloops", "examples/pi.json", "--agentloop", "pi"])
            .args(extra)
            .arg("hello from brain run"),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "brain run failed: {stderr}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "hello from brain run\n"
    );
}

#[test]
fn brain_run_completes_with_the_example_registration() {
    // Exactly the command of issue 9's "done when": brain run's default model states metadata.
    brain_run_pi("pi-run", &[]);
}

#[test]
fn brain_run_completes_with_a_whole_model_object() {
    brain_run_pi("pi-run-model", &["--model".into(), model(None).to_string()]);
}

#[test]
fn pi_sandboxed_runs_a_sandboxed_tool_and_keeps_its_state_beneath_its_registration() {
    let registrations =
        brain::Registrations::from_vec(vec![pi().sandbox(true)]).expect("valid registrations");
    let mut config = brain::Config::new(registrations);
    config.options = adapter_options("pi-sandboxed");
    let sandbox = brain::effects::SandboxDriver::probe().unwrap_or_else(|why| {
        panic!("bubblewrap must sandbox here (scripts/test installs it): {why}")
    });
    config.effects = config.effects.with_driver(
        brain::effects::SandboxDriver::NAME,
        std::sync::Arc::new(sandbox),
    );
    let data = config.options.data_dir.clone();
    let brain = Brain::start(config).unwrap_or_else(|error| panic!("Brain refused: {error}"));
    let script = json!([
        asks_for("lookup", json!({"word": "pi"})),
        answers("pi is 3.14")
    ]);
    let mut request = with_lookup_tool(script, "cat > input.json; pwd; ls ..");
    request["environments"][0]["driver"] = json!("sandbox");
    let session = create(&brain, request);
    assert_eq!(
        a_completed_turn(&session, "what is pi?")["text"],
        "pi is 3.14"
    );
    // The tool ran in its workspace at the sandbox's fixed path, seeing nothing beside it.
    let finished = records(&session, "tool_call_finished");
    assert_eq!(finished[0].data["outcome"], "ok", "{:?}", finished[0].data);
    let seen = finished[0].data["result"]["content"][0]["text"]
        .as_str()
        .expect("the tool's output");
    assert!(seen.starts_with("/workspace\n"), "{seen}");
    for hidden in ["operator.token", "journal", "agentloops", "workspaces"] {
        assert!(
            !seen.contains(hidden),
            "the sandbox's root shows {hidden}: {seen}"
        );
    }
    let workspace = data
        .join("workspaces")
        .join(session.id().as_str())
        .join("host");
    assert!(workspace.join("input.json").is_file());
    // Pi's native state went where its sandbox lets it write: beneath agentloops/pi/.
    let state = data
        .join("agentloops")
        .join("pi")
        .join(session.id().as_str());
    assert!(state.is_dir(), "{}", state.display());
    brain.shutdown(Duration::from_secs(5));
}
