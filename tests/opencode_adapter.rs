//! The OpenCode harness adapter (`adapters/opencode`, issue 29) run by a real Brain: real `node`
//! processes running the adapter, each session's real `opencode serve` 1.18.33 (opencode-linux-x64) from the npm
//! lockfile, the `scripted` model provider behind the adapter's Chat Completions gateway, and the
//! `local` tool driver. Needs `npm ci` in `adapters/opencode` (scripts/test does it).

mod common;

// More of the matrix, by concern (tests/opencode_adapter/*.rs).
#[path = "opencode_adapter/containment.rs"]
mod containment;
#[path = "opencode_adapter/gateway.rs"]
mod gateway;

use brain::SessionStatus;
use brain::{Brain, OutcomeKind, Registration, Session};
use common::adapter::*;
use common::*;
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

/// The checkout, where `examples/opencode.json` and `adapters/opencode` live.
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The adapter's registration, after checking that its dependencies are installed.
fn opencode() -> Registration {
    adapter_registration("opencode", "opencode-linux-x64/package.json")
}

fn start_opencode(tag: &str) -> Running {
    Running::start(vec![opencode()], adapter_options(tag))
}

/// The session's user and assistant texts of a model request (role, texts).
fn conversation(request: &Value) -> Vec<(String, Vec<String>)> {
    request["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "user" || m["role"] == "assistant")
        .map(|m| {
            (
                m["role"].as_str().unwrap_or_default().to_owned(),
                texts(m).into_iter().map(str::to_owned).collect::<Vec<_>>(),
            )
        })
        .filter(|(_, texts)| !texts.is_empty())
        .collect()
}

fn asks_for(tool: &str, input: Value) -> Value {
    json!({"message": {"role": "assistant", "content": [
              {"type": "text", "text": "Let me check."},
              {"type": "tool_use", "id": "call_1", "name": tool, "input": input}]},
           "stop_reason": "tool_use", "usage": {}})
}

#[test]
fn a_text_turn_completes_with_opencode_s_answer() {
    let brain = start_opencode("oc-text");
    let session = create(
        &brain,
        json!({"agentloop": {"name": "opencode"}, "model": model(Some(json!([answers("hello there")]))),
               "system": "You are terse."}),
    );
    let result = a_completed_turn(&session, "hi");
    assert_eq!(result["text"], "hello there");
    assert_eq!(result["model_calls"], 1);

    let requests = model_requests(&session);
    assert_eq!(requests.len(), 1, "{requests:#?}");
    let users: Vec<_> = conversation(&requests[0])
        .into_iter()
        .filter(|(role, _)| role == "user")
        .collect();
    assert_eq!(users.len(), 1);
    assert!(users[0].1.iter().any(|t| t == "hi"), "{users:?}");
    // No tools declared, and OpenCode's built-in tools are all excluded.
    assert_eq!(offered(&requests[0]), Vec::<String>::new());

    let (transcript, _) = session.transcript().unwrap();
    let transcript = serde_json::to_value(&transcript).unwrap();
    assert_eq!(
        transcript[transcript.as_array().map_or(0, Vec::len) - 1]["content"][0]["text"],
        "hello there"
    );
    let state_dir = session.info().unwrap().state_dir;
    assert!(state_dir.join("opencode/session.json").is_file());
    assert_nothing_installed(&state_dir);
    // stdout carried protocol lines only: Brain counted no violation of the worker's.
    assert_eq!(brain.status().worker("opencode", 0).unwrap().violations, 0);
}

/// A session declaring tool `lookup` in a `local` environment running `script` with /bin/sh.
fn with_lookup_tool(script_for_model: Value, shell: &str) -> Value {
    lookup_request("opencode", script_for_model, shell)
}

#[test]
fn the_model_asks_for_a_tool_brain_runs_it_and_the_model_answers() {
    let brain = start_opencode("oc-tool");
    let script = json!([
        asks_for("lookup", json!({"word": "pi"})),
        answers("pi is 3.14")
    ]);
    let request = with_lookup_tool(script, "cat > input.json; echo found-314");
    let (_session, requests) = a_tool_round_trip(&brain, request);

    // Only Brain's tool is offered: OpenCode's built-in tools are excluded.
    for request in &requests {
        assert_eq!(offered(request), ["lookup"], "{request}");
    }
    let messages = requests[1]["messages"].as_array().unwrap();
    let asked = &messages[messages.len() - 2];
    assert_eq!(asked["role"], "assistant");
    assert!(
        asked["content"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["type"] == "tool_use" && b["name"] == "lookup" && b["id"] == "call_1"),
        "{asked}"
    );
    let last = messages.last().unwrap();
    assert_eq!(last["role"], "user");
    assert_eq!(last["content"][0]["type"], "tool_result");
    assert_eq!(last["content"][0]["tool_use_id"], "call_1");
    assert!(
        last["content"][0].to_string().contains("found-314"),
        "{last}"
    );
}

/// The OpenCode session id the adapter keeps in the session's state_dir.
fn opencode_session_id(session: &Session) -> Value {
    let path = session
        .info()
        .unwrap()
        .state_dir
        .join("opencode/session.json");
    let text = std::fs::read_to_string(&path).expect("session.json");
    serde_json::from_str(&text).expect("session.json is JSON")
}

/// No package was installed at run time: every node_modules in OpenCode's directories is empty
/// (the adapter seeds the config directory's, with a lockfile naming the settled dependencies, so
/// that OpenCode's background `npm install @opencode-ai/plugin` never starts).
fn assert_nothing_installed(state_dir: &Path) {
    fn walk(dir: &Path) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.file_name().is_some_and(|n| n == "node_modules") {
                let installed: Vec<_> = std::fs::read_dir(&path)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
                    .collect();
                assert!(
                    installed.is_empty(),
                    "OpenCode installed packages at run time: {installed:?}"
                );
            } else if path.is_dir() && !path.is_symlink() {
                walk(&path);
            }
        }
    }
    let config = state_dir.join("opencode/config/opencode");
    assert!(
        config.join("node_modules").is_dir(),
        "the adapter seeds {}",
        config.display()
    );
    walk(&state_dir.join("opencode"));
}

/// A second message continues the OpenCode session of the first, after `between` did what it
/// does to the Brain and the session (nothing, a worker kill, a Brain restart).
fn second_message_continues(tag: &str, between: impl FnOnce(&mut Running, &Session)) {
    let mut brain = start_opencode(tag);
    // No script: the scripted provider echoes the last user text.
    let session = create(
        &brain,
        json!({"agentloop": {"name": "opencode"}, "model": model(None)}),
    );
    let first = wait(&session.send(text("remember the word kumquat")).unwrap());
    assert_eq!(first.outcome, OutcomeKind::Completed, "{first:?}");
    let id = opencode_session_id(&session);
    let state_dir = session.info().unwrap().state_dir;

    between(&mut brain, &session);
    let session = brain.session(session.id());
    let second = wait(&session.send(text("which word?")).unwrap());
    assert_eq!(second.outcome, OutcomeKind::Completed, "{second:?}");
    assert_eq!(opencode_session_id(&session), id);
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 2);
    let said: Vec<_> = conversation(&requests[1])
        .into_iter()
        .flat_map(|(_, texts)| texts)
        .collect();
    assert!(
        said.iter().any(|t| t.contains("kumquat")) && said.iter().any(|t| t == "which word?"),
        "{said:?}"
    );
    assert_nothing_installed(&state_dir);
}

#[test]
fn a_second_message_after_brain_restarted_continues_the_same_opencode_session() {
    second_message_continues("oc-restart", |brain, _| brain.restart());
}

#[test]
fn brain_run_completes_with_the_example_registration() {
    brain_run_example("opencode", "oc-run", false);
}

#[test]
fn brain_run_completes_with_no_network_but_loopback() {
    brain_run_example("opencode", "oc-offline", true);
}

/// The running `opencode` processes whose XDG_CONFIG_HOME is this session's (read from /proc).
fn opencode_processes(state_dir: &Path) -> Vec<u32> {
    let wanted = format!(
        "XDG_CONFIG_HOME={}",
        state_dir.join("opencode/config").display()
    );
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

/// Waits (bounded) until no OpenCode process of the session runs.
fn assert_no_opencode(state_dir: &Path) {
    let deadline = Instant::now() + WAIT;
    loop {
        let pids = opencode_processes(state_dir);
        if pids.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "opencode processes left for {}: {pids:?}",
            state_dir.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A session whose activation is running a tool that takes a minute.
fn blocked_in_a_tool(brain: &Brain) -> (Session, brain::Activation) {
    let script = json!([
        asks_for("lookup", json!({"word": "slow"})),
        answers("never")
    ]);
    let session = create(brain, with_lookup_tool(script, "exec sleep 60"));
    let activation = session.send(text("take your time")).unwrap();
    session
        .wait_for_events(WAIT, |events| {
            events.iter().any(|e| e.event_type == "tool_call_started")
        })
        .unwrap_or_else(|_| panic!("no tool_call_started in session {}", session.id()));
    (session, activation)
}

#[test]
fn cancel_mid_turn_aborts_the_opencode_session_and_ends_cancelled_within_the_grace() {
    let brain = start_opencode("oc-cancel");
    let (session, activation) = blocked_in_a_tool(&brain);
    let grace = Duration::from_secs(5);
    let asked = Instant::now();
    assert!(session.cancel().unwrap().was_running);
    let outcome = wait(&activation);
    let took = asked.elapsed();
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled, "{outcome:?}");
    assert!(took < grace, "cancel took {took:?}, the grace is {grace:?}");
    eprintln!("cancel answered in {took:?}");
    assert_eq!(brain.status().worker("opencode", 0).unwrap().restarts, 0);
    // No model call started after the cancel.
    assert_eq!(model_requests(&session).len(), 1);
}

#[test]
fn a_failing_model_call_fails_the_turn_after_exactly_one_journaled_call() {
    let brain = start_opencode("oc-fail");
    // An empty script: the first model call fails ("script exhausted").
    let session = create(
        &brain,
        json!({"agentloop": {"name": "opencode"}, "model": model(Some(json!([])))}),
    );
    let outcome = wait(&session.send(text("hi")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Failed, "{outcome:?}");
    // The turn fails with Brain's own error, not a later OpenCode one.
    assert_eq!(
        outcome.error.as_ref().unwrap().code.as_str(),
        "model_failed"
    );
    assert_eq!(
        records(&session, "model_call_started").len(),
        1,
        "OpenCode retried the failed model call"
    );
}

#[test]
fn close_stops_the_session_s_opencode_server() {
    let brain = start_opencode("oc-close");
    let session = create(
        &brain,
        json!({"agentloop": {"name": "opencode"}, "model": model(None)}),
    );
    a_completed_turn(&session, "hi");
    let state_dir = session.info().unwrap().state_dir;
    let pids = opencode_processes(&state_dir);
    assert_eq!(
        pids.len(),
        1,
        "one opencode serve per open session: {pids:?}"
    );
    session.close().unwrap();
    assert!(
        stops_within(pids[0], WAIT),
        "opencode {} outlived close",
        pids[0]
    );
    assert_no_opencode(&state_dir);
    assert_eq!(session.info().unwrap().status, SessionStatus::Closed);
}

#[test]
fn initialize_declares_the_adapter_s_and_opencode_s_versions_and_text_only_capabilities() {
    let output = run_bounded(std::process::Command::new(BRAIN).current_dir(ROOT).args([
        "check",
        "--json",
        "--agentloops",
        "examples/opencode.json",
    ]));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "brain check failed: {stdout}");
    let report: Value = serde_json::from_str(&stdout).expect("brain check --json prints JSON");
    let initialized = &report["registrations"][0]["workers"][0]["initialized"];
    assert_eq!(
        *initialized,
        json!({
            "protocol": "brain/harness/v1",
            "identity": {"name": "agentloop-opencode", "version": "0.1.0+opencode.1.18.33"},
            "state_version": "1",
            "capabilities": {"media": false, "transcript_import": false, "fixed_tool_catalogue": true},
            "configuration_keys": [],
            "required_model_metadata": ["context_window", "max_output_tokens"],
        })
    );
}

#[test]
fn a_second_message_after_the_idle_worker_was_killed_continues_the_same_opencode_session() {
    second_message_continues("oc-killed-idle", |brain, session| {
        let state_dir = session.info().unwrap().state_dir;
        assert_eq!(opencode_processes(&state_dir).len(), 1);
        let pid = worker_pid(brain, "opencode");
        kill(pid);
        brain
            .wait_for(WAIT, |s| {
                s.worker("opencode", 0).is_some_and(|w| {
                    w.state == brain::WorkerState::Healthy && w.pid.is_some_and(|p| p != pid)
                })
            })
            .expect("the worker was respawned");
        // The worker's OpenCode server went with it.
        assert_no_opencode(&state_dir);
        assert_eq!(session.info().unwrap().status, SessionStatus::Open);
    });
}

#[test]
fn the_adapter_killed_mid_run_leaves_the_session_interrupted() {
    let brain = start_opencode("oc-killed-run");
    let (session, activation) = blocked_in_a_tool(&brain);
    let state_dir = session.info().unwrap().state_dir;
    assert_eq!(opencode_processes(&state_dir).len(), 1);
    kill(worker_pid(&brain, "opencode"));
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Failed, "{outcome:?}");
    assert_eq!(outcome.error.as_ref().unwrap().code.as_str(), "worker_lost");
    assert_interrupted(&session, activation.sequence());
    assert_no_opencode(&state_dir);
}

#[test]
fn unknown_configuration_keys_missing_model_metadata_and_media_are_refused_at_creation() {
    let brain = start_opencode("oc-refusals");
    let session = assert_text_only_refusals(&brain, "opencode");
    // Nothing was started for any of them.
    assert!(opencode_processes(&session.info().unwrap().state_dir).is_empty());
}

#[test]
fn deleting_the_session_removes_all_of_opencode_s_state() {
    let brain = start_opencode("oc-delete");
    let session = create(
        &brain,
        json!({"agentloop": {"name": "opencode"}, "model": model(None)}),
    );
    a_completed_turn(&session, "hi");
    let state_dir = session.info().unwrap().state_dir;
    let native = state_dir.join("opencode");
    assert!(native.join("session.json").is_file());
    let pid = opencode_processes(&state_dir)[0];
    session.close().unwrap();
    assert!(stops_within(pid, WAIT), "opencode {pid} outlived close");
    session.delete().unwrap();
    assert!(!native.exists(), "{} is still there", native.display());
    assert!(!state_dir.exists());
}

#[test]
fn a_small_context_window_makes_opencode_compact_through_brain_and_the_turn_completes() {
    let brain = start_opencode("oc-compaction");
    // OpenCode compacts once a step's tokens reach its usable window, context - output -
    // min(20,000, output): 4,000 - 1,000 - 1,000 here. The first answer reports 3,500 input
    // tokens, so after its tool call OpenCode summarises the history through the gateway, then
    // goes on from the summary with a synthetic "Continue" message.
    let asks = asks_for("lookup", json!({"word": "pi"}));
    let (session, result) = a_compacting_turn(&brain, "opencode", asks);
    assert_eq!(result["model_calls"], 3);

    // Every model call, the compaction's too, was a Brain model call.
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 3, "{requests:#?}");
    assert_eq!(offered(&requests[0]), ["lookup"]);
    // The compaction request: OpenCode's summarising agent, no tools (explicitly none, not the
    // session's), the history as text in one user message.
    assert_eq!(requests[1]["tools"], json!([]), "{}", requests[1]);
    assert!(
        requests[1]["system"]
            .as_str()
            .is_some_and(|s| s.contains("summar")),
        "{}",
        requests[1]["system"]
    );
    let compaction = requests[1]["messages"].as_array().unwrap();
    assert_eq!(compaction.len(), 1, "{}", requests[1]);
    let history = texts(&compaction[0]).concat();
    assert!(
        history.contains("what is pi?") && history.contains("found-314"),
        "{history}"
    );
    // The next request goes on from the summary alone, with the tools again.
    assert_eq!(offered(&requests[2]), ["lookup"]);
    let said: Vec<_> = conversation(&requests[2])
        .into_iter()
        .flat_map(|(_, texts)| texts)
        .collect();
    assert!(said.iter().any(|t| t == "SUMMARY-OF-THE-WORK"), "{said:?}");
    assert!(!requests[2].to_string().contains("found-314"));
    // The transcript keeps the conversation, not OpenCode's summary or its synthetic messages.
    let (transcript, _) = session.transcript().unwrap();
    let transcript = serde_json::to_value(&transcript).unwrap();
    assert_eq!(transcript.as_array().unwrap().len(), 4, "{transcript}");
    assert!(!transcript.to_string().contains("SUMMARY-OF-THE-WORK"));
    assert!(
        !transcript
            .to_string()
            .contains("Continue if you have next steps")
    );
}
#[test]
fn a_changed_tool_catalogue_fails_explicitly() {
    let mut brain = start_opencode("oc-catalogue");
    let session = create(&brain, with_lookup_tool(json!([answers("one")]), "echo x"));
    let first = wait(&session.send(text("first")).unwrap());
    assert_eq!(first.outcome, OutcomeKind::Completed, "{first:?}");
    // Brain keeps the first catalogue (the adapter declares fixed_tool_catalogue) ...
    let started = records(&session, "activation_started");
    assert_eq!(started[0].data["catalogue"][0]["name"], "lookup");
    // ... and so does the adapter, with the OpenCode session it was created for.
    let state_dir = session.info().unwrap().state_dir;
    let file = state_dir.join("opencode/session.json");
    let mut saved: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(saved["tools"][0]["name"], "lookup", "{saved}");
    // What an OpenCode session created with another catalogue looks like (its MCP tools, names
    // and permissions were fixed when its server started), met by a new worker.
    saved["tools"][0]["name"] = json!("search");
    std::fs::write(&file, saved.to_string()).unwrap();
    brain.restart();
    let session = brain.session(session.id());

    let second = wait(&session.send(text("second")).unwrap());
    assert_eq!(second.outcome, OutcomeKind::Failed, "{second:?}");
    let error = second.error.as_ref().unwrap();
    assert_eq!(error.code.as_str(), "unsupported_input");
    assert!(
        error.message.contains("tool catalogue changed") && error.message.contains("search"),
        "{}",
        error.message
    );
    // Refused before OpenCode started or the model was called.
    assert_eq!(records(&session, "model_call_started").len(), 1);
    assert!(opencode_processes(&state_dir).is_empty());
}

#[test]
fn a_tool_the_session_did_not_admit_is_never_offered_nor_run() {
    let brain = start_opencode("oc-admitted");
    // The model asks for OpenCode's built-in bash, which is off and which the session did not
    // declare.
    let script = json!([
        asks_for(
            "bash",
            json!({"command": "touch pwned", "description": "x"})
        ),
        answers("ok")
    ]);
    let session = create(&brain, with_lookup_tool(script, "echo found"));
    assert_eq!(a_completed_turn(&session, "run something")["text"], "ok");
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 2, "{requests:#?}");
    for request in &requests {
        assert_eq!(offered(request), ["lookup"], "{request}");
    }
    // Nothing ran: no tool call reached Brain, and no shell ran in OpenCode's workspace.
    assert!(records(&session, "tool_call_started").is_empty());
    let state_dir = session.info().unwrap().state_dir;
    assert!(!state_dir.join("opencode/workspace/pwned").exists());
    // The model was told the call went nowhere.
    let last = requests[1]["messages"].as_array().unwrap().last().unwrap();
    assert_eq!(last["content"][0]["type"], "tool_result", "{last}");
    assert_eq!(last["content"][0]["tool_use_id"], "call_1");
    let told = last["content"][0]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(
        told.contains("unavailable tool") && told.contains("Available tools: brain_lookup."),
        "{last}"
    );
}
