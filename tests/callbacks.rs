//! Each `brain/call` method through a real harness, tools through an embedder's environment
//! driver, client events through event-only activations, and admission limits.

mod common;

use brain::cancel::CancelToken;
use brain::effects::{EffectError, Effects, EnvironmentDriver, ModelCall, ModelProvider, ToolCall};
use brain::protocol::harness::{
    Block, ErrorCode, Event, Message, ModelResult, Role, StopReason, ToolOutcome, ToolResult,
    Usage, UserInput,
};
use brain::{Activation, Brain, Config, Options, Outcome, OutcomeKind, Registrations, Session};
use common::*;
use serde_json::{Value, json};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

fn text(text: &str) -> UserInput {
    UserInput {
        content: vec![Block::text(text)],
    }
}

fn wait(activation: &Activation) -> Outcome {
    activation.wait_timeout(WAIT).expect("the activation ended")
}

fn create(brain: &Brain, body: Value) -> Session {
    brain
        .create_session_json(body.to_string().as_bytes())
        .unwrap_or_else(|error| panic!("create: {error}"))
}

fn options(tag: &str) -> Options {
    let mut options = fast_options(tag);
    options.cancel_grace = Duration::from_millis(300);
    options
}

/// Runs the fault harness's `calls` mode with these callbacks and returns its answers.
fn answers(brain: &Brain, calls: Value) -> (Session, Vec<Value>) {
    let session = create(
        brain,
        json!({"agentloop": {"name": "h", "configuration": {"fault": "calls", "calls": calls}}}),
    );
    let outcome = wait(&session.send(text("go")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    let answers = outcome.result.unwrap()["answers"]
        .as_array()
        .cloned()
        .unwrap();
    (session, answers)
}

fn kinds(session: &Session) -> Vec<String> {
    session
        .events(0, 10_000)
        .unwrap()
        .into_iter()
        .map(|e| e.event_type)
        .collect()
}

#[test]
fn kv_methods_store_read_and_delete_including_null() {
    let brain = start(vec![fault("h", &[])], options("kv"));
    let (session, answers) = answers(
        &brain,
        json!([
            {"method": "kv.put", "input": {"key": "plan", "value": {"step": 2}}},
            {"method": "kv.get", "input": {"key": "plan"}},
            {"method": "kv.get", "input": {"key": "absent"}},
            {"method": "kv.put", "input": {"key": "nothing", "value": null}},
            {"method": "kv.get", "input": {"key": "nothing"}},
            {"method": "kv.delete", "input": {"key": "plan"}},
            {"method": "kv.delete", "input": {"key": "never-there"}},
            {"method": "kv.get", "input": {"key": "plan"}},
            {"method": "kv.get", "input": {"key": "brain.harness.activation"}},
        ]),
    );
    assert!(answers[0]["sequence"].is_u64());
    assert_eq!(answers[1], json!({"found": true, "value": {"step": 2}}));
    assert_eq!(answers[2], json!({"found": false}));
    assert_eq!(answers[4], json!({"found": true, "value": null}));
    assert!(
        answers[6]["sequence"].is_u64(),
        "a kv_delete is written even for an absent key"
    );
    assert_eq!(answers[7], json!({"found": false}));
    // Reserved keys are readable: the marker of the running activation.
    assert_eq!(answers[8]["found"], true);
    assert!(answers[8]["value"]["sequence"].is_u64());
    let kinds = kinds(&session);
    assert_eq!(kinds.iter().filter(|k| *k == "kv_set").count(), 2);
    assert_eq!(kinds.iter().filter(|k| *k == "kv_delete").count(), 2);
}

#[test]
fn refusals_carry_code_and_fatal_and_write_nothing() {
    let brain = start(vec![fault("h", &[])], options("refusals"));
    for (call, code) in [
        (
            json!({"method": "kv.put", "input": {"key": "brain.x", "value": 1}}),
            "reserved_key",
        ),
        (
            json!({"method": "kv.delete", "input": {"key": "brain.events_cursor"}}),
            "reserved_key",
        ),
        (
            json!({"method": "emit", "input": {"type": "kv_set", "data": {}}}),
            "invalid_input",
        ),
        (
            json!({"method": "kv.get", "input": {"nokey": 1}}),
            "invalid_input",
        ),
        (
            json!({"method": "frobnicate", "input": {}}),
            "unknown_method",
        ),
        (
            json!({"method": "tool", "input": {"name": "undeclared", "input": {}}}),
            "invalid_input",
        ),
    ] {
        let (session, answers) = answers(&brain, json!([call]));
        assert_eq!(answers[0]["error"]["code"], code, "{call}");
        assert_eq!(answers[0]["error"]["fatal"], false, "{call}");
        let kinds = kinds(&session);
        assert_eq!(
            kinds,
            [
                "session_created",
                "activation_queued",
                "activation_started",
                "activation_finished"
            ],
            "{call}"
        );
    }
}

#[test]
fn transcript_set_is_stored_as_a_delta_and_emit_and_events_read_work() {
    let brain = start(vec![fault("h", &[])], options("transcript"));
    let first = json!({"role": "user", "content": [{"type": "text", "text": "a"}]});
    let second = json!({"role": "assistant", "content": [{"type": "text", "text": "b"}]});
    let (session, answers) = answers(
        &brain,
        json!([
            {"method": "transcript.set", "input": {"messages": [first]}},
            {"method": "transcript.set", "input": {"messages": [first, second]}},
            {"method": "emit", "input": {"type": "progress", "data": {"pct": 50}}},
            {"method": "telemetry", "input": {"tokens": 12}},
            {"method": "events.read", "input": {"after": 0, "limit": 3}},
        ]),
    );
    assert_eq!(answers[3], json!({}));
    let page = &answers[4];
    assert_eq!(page["events"].as_array().unwrap().len(), 3);
    assert_eq!(page["next_after"], 3);
    let events = session.events(0, 100).unwrap();
    let deltas: Vec<&Value> = events
        .iter()
        .filter(|e| e.event_type == "transcript_delta")
        .map(|e| &e.data)
        .collect();
    assert_eq!(deltas[0], &json!({"keep": 0, "append": [first]}));
    assert_eq!(deltas[1], &json!({"keep": 1, "append": [second]}));
    let emitted = first_of(&events, "event_emitted");
    assert_eq!(
        emitted.data,
        json!({"type": "progress", "data": {"pct": 50}})
    );
    assert_eq!(emitted.sequence, answers[2]["sequence"]);
    // The origin names the activation that emitted it.
    let origin = emitted.origin.as_ref().unwrap();
    assert_eq!(origin.kind, brain::protocol::harness::OriginKind::Agentloop);
    assert_eq!(origin.sequence, 2);
    // Telemetry is never journaled.
    assert!(!events.iter().any(|e| e.data.get("tokens").is_some()));
}

#[test]
fn client_events_reach_the_next_activation_once() {
    let brain = start(vec![fault("h", &[])], options("client-events"));
    let session = create(&brain, json!({"agentloop": {"name": "h"}}));
    session.append_event("ticket", json!({"id": 1})).unwrap();
    session.append_event("ticket", json!({"id": 2})).unwrap();
    let refused = session
        .append_event("activation_started", json!({}))
        .unwrap_err();
    assert_eq!(refused.code.as_str(), "invalid_request");
    let outcome = wait(&session.deliver_events().unwrap());
    let input = &outcome.result.unwrap()["echo"]["input"];
    assert!(
        input.get("input").is_none(),
        "an event-only activation has no user input"
    );
    let events = input["events"].as_array().unwrap();
    assert_eq!(events.len(), 2);
    assert_eq!(events[0]["type"], "ticket");
    assert_eq!(events[1]["data"], json!({"id": 2}));
    assert_eq!(events[0]["origin"]["kind"], "client");
    // Delivered events advance the cursor: the next activation sees only newer ones.
    session.append_event("ticket", json!({"id": 3})).unwrap();
    let outcome = wait(&session.send(text("next")).unwrap());
    let events = outcome.result.unwrap()["echo"]["input"]["events"].clone();
    assert_eq!(events.as_array().unwrap().len(), 1);
    assert_eq!(events[0]["data"], json!({"id": 3}));
}

/// An environment driver of the embedder's: adds two numbers.
struct Calculator;

impl EnvironmentDriver for Calculator {
    fn call_tool(
        &self,
        call: &ToolCall<'_>,
        _cancel: &CancelToken,
    ) -> Result<ToolResult, EffectError> {
        let sum = call.input["a"].as_i64().unwrap_or(0) + call.input["b"].as_i64().unwrap_or(0);
        Ok(ToolResult {
            outcome: ToolOutcome::Ok,
            content: vec![Block::text(sum.to_string())],
            is_error: false,
        })
    }
}

/// The first record of `kind` among `events`; panics, naming the kind, when there is none.
fn first_of<'a>(events: &'a [Event], kind: &str) -> &'a Event {
    events
        .iter()
        .find(|e| e.event_type == kind)
        .unwrap_or_else(|| panic!("no {kind} record in {events:?}"))
}

/// A Brain with one reference-harness worker, `ref`, and an embedder's environment driver.
fn reference_brain(tag: &str, driver_name: &str, driver: Arc<dyn EnvironmentDriver>) -> Brain {
    let registrations =
        Registrations::from_vec(vec![brain::Registration::new("ref", REFERENCE_HARNESS)]).unwrap();
    let mut config = Config::new(registrations);
    config.options = options(tag);
    config.effects = Effects::default().with_driver(driver_name, driver);
    Brain::start(config).unwrap()
}

/// A session on `ref` whose scripted model answers with `script`, with one tool, `tool`, placed in
/// the environment `env` that `driver` runs.
fn tool_session(brain: &Brain, script: &Value, tool: &str, driver: &str, system: &str) -> Session {
    create(
        brain,
        json!({
            "agentloop": {"name": "ref"},
            "model": {"provider": "scripted", "name": "s", "options": {"script": script}},
            "system": system,
            "tools": [{"name": tool, "description": tool, "input_schema": {"type": "object"},
                       "placements": ["env"]}],
            "environments": [{"name": "env", "driver": driver}]
        }),
    )
}

#[test]
fn the_reference_harness_runs_a_tool_loop_through_brain() {
    let brain = reference_brain("tool-loop", "calc", Arc::new(Calculator));
    let script = json!([
        {"message": {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}}]},
         "stop_reason": "tool_use"},
        {"message": {"role": "assistant", "content": [{"type": "text", "text": "it is 5"}]},
         "stop_reason": "end_turn", "usage": {"output_tokens": 4}}
    ]);
    let session = tool_session(&brain, &script, "add", "calc", "You add.");
    let outcome = wait(&session.send(text("2+3?")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    let result = outcome.result.unwrap();
    assert_eq!(result["text"], "it is 5");
    assert_eq!(result["rounds"], 2);
    let events = session.events(0, 100).unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "session_created",
            "activation_queued",
            "activation_started",
            "model_call_started",
            "model_call_finished",
            "tool_call_started",
            "tool_call_finished",
            "model_call_started",
            "model_call_finished",
            "transcript_delta",
            "activation_finished"
        ]
    );
    // The model saw the session's system prompt and tools; usage counters stay absent unless
    // the provider reported them.
    let first_call = &events[3].data["request"];
    assert_eq!(first_call["system"], "You add.");
    assert_eq!(first_call["tools"][0]["name"], "add");
    assert_eq!(events[4].data["result"]["usage"], json!({}));
    assert_eq!(
        events[8].data["result"]["usage"],
        json!({"output_tokens": 4})
    );
    let tool = &events[6].data;
    assert_eq!(tool["started"], events[5].sequence);
    assert_eq!(tool["result"]["content"][0]["text"], "5");
    let transcript = &events[9].data["append"];
    assert_eq!(transcript.as_array().unwrap().len(), 4);
    // The harness kept its native state in the session's state directory.
    let state_dir = session.info().unwrap().state_dir;
    assert!(state_dir.join("reference-state.json").is_file());
}

/// An environment driver that loses track of every call after sending it.
struct Lost;

impl EnvironmentDriver for Lost {
    fn call_tool(
        &self,
        _call: &ToolCall<'_>,
        _cancel: &CancelToken,
    ) -> Result<ToolResult, EffectError> {
        Err(EffectError::Unknown {
            message: "the sandbox stopped answering".to_owned(),
        })
    }
}

#[test]
fn a_tool_call_of_unknown_outcome_is_recorded_answered_and_counted_as_such() {
    let brain = reference_brain("tool-unknown", "lost", Arc::new(Lost));
    let script = json!([
        {"message": {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "rm", "input": {"path": "x"}}]},
         "stop_reason": "tool_use"},
        {"message": {"role": "assistant", "content": [{"type": "text", "text": "unsure"}]},
         "stop_reason": "end_turn"}
    ]);
    let session = tool_session(&brain, &script, "rm", "lost", "You remove.");
    let outcome = wait(&session.send(text("remove x")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    let events = session.events(0, 100).unwrap();
    let started = first_of(&events, "tool_call_started");
    assert_eq!(started.data["input"], json!({"path": "x"}));
    assert_eq!(started.data["environment"], "env");
    let finished = first_of(&events, "tool_call_finished");
    assert_eq!(finished.data["started"], started.sequence);
    assert_eq!(finished.data["outcome"], "unknown");
    assert_eq!(finished.data["result"]["is_error"], true);
    assert_eq!(
        finished.data["result"]["content"][0]["text"],
        "the sandbox stopped answering"
    );
    // The harness was answered with the same result, and the model saw it.
    let second_call = events
        .iter()
        .filter(|e| e.event_type == "model_call_started")
        .nth(1)
        .expect("a second model call");
    let messages = second_call.data["request"]["messages"].as_array().unwrap();
    let tool_result = &messages.last().unwrap()["content"][0];
    assert_eq!(tool_result["type"], "tool_result");
    assert_eq!(tool_result["is_error"], true);
    assert!(
        brain
            .metrics_text()
            .contains("brain_unknown_outcomes_total 1"),
        "{}",
        brain.metrics_text()
    );
}

#[test]
fn a_full_queue_refuses_overloaded_and_an_oversized_run_fails_before_its_marker() {
    let mut options = options("limits");
    options.queue_bound = 1;
    options.max_line_bytes = 64 * 1024;
    let brain = start(vec![fault("h", &[]).max_concurrency(1)], options);
    let busy = create(
        &brain,
        json!({"agentloop": {"name": "h", "configuration": {"fault": "hang"}}}),
    );
    let waiting = create(&brain, json!({"agentloop": {"name": "h"}}));
    let refused = create(&brain, json!({"agentloop": {"name": "h"}}));
    let running = busy.send(text("x")).unwrap();
    busy.wait_for_events(WAIT, |events| {
        events.iter().any(|e| e.event_type == "activation_started")
    })
    .unwrap();
    let queued = waiting.send(text("y")).unwrap();
    let error = refused.send(text("z")).unwrap_err();
    assert_eq!(error.code.as_str(), "overloaded");
    busy.cancel().unwrap();
    wait(&running);
    assert_eq!(wait(&queued).outcome, OutcomeKind::Completed);
    // A run line over the line limit fails input_too_large without a marker.
    let huge = "x".repeat(100 * 1024);
    let outcome = wait(&refused.send(text(&huge)).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Failed);
    assert_eq!(outcome.error.unwrap().code, "input_too_large");
    let info = refused.info().unwrap();
    assert_eq!(info.marker, None);
    assert_eq!(info.status, brain::SessionStatus::Open);
    assert!(!kinds(&refused).contains(&"activation_started".to_owned()));
}

/// An environment driver of the embedder's: counts setups, echoes calls.
#[derive(Default)]
struct Sandbox {
    setups: std::sync::atomic::AtomicUsize,
}

impl EnvironmentDriver for Sandbox {
    fn call_tool(
        &self,
        _call: &ToolCall<'_>,
        _cancel: &CancelToken,
    ) -> Result<ToolResult, EffectError> {
        Ok(ToolResult {
            outcome: ToolOutcome::Ok,
            content: vec![],
            is_error: false,
        })
    }

    fn setup(
        &self,
        _environment: &brain::effects::EnvironmentSpec,
        _session: &brain::session::SessionId,
        _cancel: &CancelToken,
    ) -> Result<(), EffectError> {
        self.setups
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    fn call(
        &self,
        environment: &brain::effects::EnvironmentSpec,
        method: &str,
        input: &Value,
        _cancel: &CancelToken,
    ) -> Result<Value, EffectError> {
        Ok(json!({"environment": environment.name, "method": method, "input": input}))
    }
}

#[test]
fn environment_operations_follow_the_grants_and_setup_makes_a_new_incarnation() {
    let sandbox = Arc::new(Sandbox::default());
    let registrations = Registrations::from_vec(vec![fault("h", &[])]).unwrap();
    let mut config = Config::new(registrations);
    config.options = options("environments");
    config.effects = Effects::default().with_driver("sandbox", sandbox.clone());
    let brain = Brain::start(config).unwrap();
    let calls = json!([
        {"method": "environments.list", "input": {}},
        {"method": "environments.get", "input": {"name": "box"}},
        {"method": "environments.call", "input": {"name": "box", "method": "ping", "input": {"n": 1}}},
        {"method": "environments.setup", "input": {"name": "lab"}},
        {"method": "environments.get", "input": {"name": "lab"}},
        {"method": "environments.setup", "input": {"name": "box"}},
    ]);
    let session = create(
        &brain,
        json!({
            "agentloop": {"name": "h", "configuration": {"fault": "calls", "calls": calls},
                          "environments": [
                              {"environment": "box", "permissions": ["read", "call"]},
                              {"environment": "lab", "permissions": ["read", "setup"]}]},
            "tools": [{"name": "probe", "placements": ["lab"]}],
            "environments": [{"name": "box", "driver": "sandbox"},
                             {"name": "lab", "driver": "sandbox"},
                             {"name": "hidden", "driver": "sandbox"}]
        }),
    );
    let outcome = wait(&session.send(text("go")).unwrap());
    let answers = outcome.result.unwrap()["answers"].clone();
    // Only granted environments are listed; both start at the session_created incarnation.
    assert_eq!(
        answers[0],
        json!({"environments": [
            {"name": "box", "sequence": 1, "status": "ready"},
            {"name": "lab", "sequence": 1, "status": "ready"}]})
    );
    assert_eq!(answers[1]["driver"], "sandbox");
    assert_eq!(answers[2]["result"]["method"], "ping");
    let setup = answers[3]["sequence"].as_u64().unwrap();
    assert_eq!(answers[4]["sequence"], setup);
    assert_eq!(answers[5]["error"]["code"], "not_granted");
    assert_eq!(answers[5]["error"]["fatal"], false);
    assert_eq!(sandbox.setups.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Every effect crossed the barrier; the refused setup wrote nothing.
    let events = session.events(0, 100).unwrap();
    let started: Vec<&Value> = events
        .iter()
        .filter(|e| e.event_type == "environment_started")
        .map(|e| &e.data)
        .collect();
    assert_eq!(started.len(), 2);
    assert_eq!(started[0]["operation"], "call");
    assert_eq!(started[1]["operation"], "setup");
    assert_eq!(
        events
            .iter()
            .filter(|e| e.event_type == "environment_finished")
            .count(),
        2
    );
    // The next activation's tool placements carry the new incarnation.
    let outcome = wait(&session.send(text("again")).unwrap());
    let result = outcome.result.unwrap();
    assert_eq!(
        result["tools"][0]["placements"],
        json!([{"environment": "lab", "sequence": setup}])
    );
}

#[test]
fn a_fixed_tool_catalogue_is_recorded_with_the_first_activation() {
    let registrations =
        Registrations::from_vec(vec![fault("h", &["--capability", "fixed_tool_catalogue"])])
            .unwrap();
    let mut config = Config::new(registrations);
    config.options = options("catalogue");
    config.effects = Effects::default().with_driver("sandbox", Arc::new(Sandbox::default()));
    let brain = Brain::start(config).unwrap();
    let session = create(
        &brain,
        json!({"agentloop": {"name": "h"},
               "tools": [{"name": "probe", "description": "looks", "placements": ["lab"]}],
               "environments": [{"name": "lab", "driver": "sandbox"}]}),
    );
    for _ in 0..2 {
        assert_eq!(
            wait(&session.send(text("x")).unwrap()).outcome,
            OutcomeKind::Completed
        );
    }
    let started: Vec<Value> = session
        .events(0, 100)
        .unwrap()
        .into_iter()
        .filter(|e| e.event_type == "activation_started")
        .map(|e| e.data)
        .collect();
    // Declarations and placement names, never incarnation sequences; only the first records it.
    assert_eq!(
        started[0]["catalogue"],
        json!([{"name": "probe", "description": "looks",
                "input_schema": {"type": "object"}, "placements": ["lab"]}])
    );
    assert!(started[1].get("catalogue").is_none());
}

#[test]
fn metrics_count_activations_callbacks_and_latencies() {
    let brain = start(vec![fault("h", &[])], options("metrics"));
    answers(
        &brain,
        json!([{"method": "kv.put", "input": {"key": "a", "value": 1}},
               {"method": "kv.put", "input": {"key": "brain.a", "value": 1}}]),
    );
    let text = brain.metrics_text();
    for expected in [
        "brain_ready 1",
        "brain_workers{registration=\"h\",state=\"healthy\"} 1",
        "brain_activations_total{outcome=\"completed\",code=\"\"} 1",
        "brain_callbacks_total{method=\"kv.put\",code=\"ok\"} 1",
        "brain_callbacks_total{method=\"kv.put\",code=\"reserved_key\"} 1",
        "brain_schedule_to_start_seconds_count 1",
        "brain_activation_seconds_count 1",
        "brain_queue_depth{registration=\"h\",worker=\"0\"} 0",
        "brain_slots_in_use{registration=\"h\",worker=\"0\"} 0",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
}

#[test]
fn the_built_in_local_driver_runs_tools_as_commands() {
    let registrations =
        Registrations::from_vec(vec![brain::Registration::new("ref", REFERENCE_HARNESS)]).unwrap();
    let mut config = Config::new(registrations);
    config.options = options("local-driver");
    let brain = Brain::start(config).unwrap();
    let script = json!([
        {"message": {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "echo", "input": {"a": 2}}]},
         "stop_reason": "tool_use"},
        {"message": {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
         "stop_reason": "end_turn"}
    ]);
    let session = create(
        &brain,
        json!({
            "agentloop": {"name": "ref"},
            "model": {"provider": "scripted", "name": "s", "options": {"script": script}},
            "tools": [{"name": "echo", "placements": ["shell"]}],
            "environments": [{"name": "shell", "driver": "local",
                              "configuration": {"tools": {"echo": {"command": ["cat"]}}}}]
        }),
    );
    let outcome = wait(&session.send(text("echo it")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    let events = session.events(0, 100).unwrap();
    let finished = first_of(&events, "tool_call_finished");
    assert_eq!(finished.data["outcome"], "ok");
    let output = finished.data["result"]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(output.contains(r#""a":2"#), "{output}");
    // The tool ran in the session's working directory, beneath its state directory.
    assert!(session.info().unwrap().state_dir.is_dir());
    // A bad local configuration is refused at creation, naming the field.
    let refused = brain
        .create_session_json(
            json!({"agentloop": {"name": "ref"},
                   "environments": [{"name": "shell", "driver": "local",
                                     "configuration": {"tools": {"x": {"command": []}}}}]})
            .to_string()
            .as_bytes(),
        )
        .unwrap_err();
    assert_eq!(refused.code.as_str(), "invalid_request");
    assert!(
        refused.message.contains("tools.x.command"),
        "{}",
        refused.message
    );
}

/// A model provider whose calls answer only once `needed` calls have come in: they can all
/// answer only if all of them were inside it at the same time.
struct Gathering {
    needed: usize,
    arrived: Mutex<usize>,
    all_in: Condvar,
}

impl ModelProvider for Gathering {
    fn call(&self, _: &ModelCall<'_>, _: &CancelToken) -> Result<ModelResult, EffectError> {
        let mut arrived = self.arrived.lock().unwrap();
        *arrived += 1;
        self.all_in.notify_all();
        let (arrived, waited) = self
            .all_in
            .wait_timeout_while(arrived, Duration::from_secs(10), |arrived| {
                *arrived < self.needed
            })
            .unwrap();
        if waited.timed_out() {
            return Err(EffectError::Failed {
                code: ErrorCode::ModelFailed,
                message: format!("only {} of {} calls ran at once", *arrived, self.needed),
            });
        }
        Ok(ModelResult {
            message: Message::text(Role::Assistant, "all in"),
            stop_reason: StopReason::EndTurn,
            usage: Usage::default(),
            model: None,
        })
    }
}

/// The callback threads wake each other only up to one running per CPU; a model call that may
/// block must still get a thread of its own, or calls queued behind it wait for it.
#[test]
fn model_calls_that_block_all_run_at_once_on_any_number_of_cpus() {
    // More calls than CPUs, so that only the hand-off can get them all running (the executors
    // wake each other up to one running per CPU), and fewer than the executors.
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let sessions = (cpus + 6).max(8);
    let registrations = Registrations::from_vec(vec![fault("h", &[])]).unwrap();
    let mut config = Config::new(registrations);
    config.options = options("gather");
    config.options.callback_threads = config.options.callback_threads.max(sessions + 2);
    let gathering = Gathering {
        needed: sessions,
        arrived: Mutex::new(0),
        all_in: Condvar::new(),
    };
    config.effects = Effects::default().with_provider("gathering", Arc::new(gathering));
    let brain = Brain::start(config).unwrap();
    let calls = json!([{"method": "model", "input": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}}]);
    let activations: Vec<Activation> = (0..sessions)
        .map(|_| {
            let session = create(
                &brain,
                json!({"agentloop": {"name": "h", "configuration": {"fault": "calls", "calls": calls}},
                       "model": {"provider": "gathering", "name": "m"}}),
            );
            session.send(text("go")).unwrap()
        })
        .collect();
    for activation in &activations {
        let outcome = wait(activation);
        assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
        let answers = &outcome.result.unwrap()["answers"];
        assert_eq!(
            answers[0]["result"]["message"]["content"][0]["text"], "all in",
            "{answers}"
        );
    }
}
