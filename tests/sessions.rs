//! Sessions, activations and callbacks against real harness processes: capacity and FIFO order,
//! cancellation, authority, draining, balancing, and every row of the outcome table.

mod common;

use brain::cancel::CancelToken;
use brain::effects::{EffectError, Effects, ModelCall, ModelProvider};
use brain::protocol::harness::{Block, ModelResult, UserInput};
use brain::session::CreateSession;
use brain::{Activation, Brain, Options, Outcome, OutcomeKind, Session, SessionStatus};
use common::*;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

fn text(text: &str) -> UserInput {
    UserInput {
        content: vec![Block::text(text)],
    }
}

/// A create-session request for `registration` whose merged configuration selects a fault mode.
fn request(registration: &str, configuration: Value) -> CreateSession {
    CreateSession::parse(
        json!({"agentloop": {"name": registration, "configuration": configuration}})
            .to_string()
            .as_bytes(),
    )
    .expect("valid request")
}

fn create(brain: &Brain, registration: &str, configuration: Value) -> Session {
    brain
        .create_session(request(registration, configuration))
        .unwrap_or_else(|error| panic!("create session: {error}"))
}

fn wait(activation: &Activation) -> Outcome {
    activation
        .wait_timeout(WAIT)
        .unwrap_or_else(|| panic!("activation {} did not end", activation.sequence()))
}

fn kinds(session: &Session) -> Vec<String> {
    session
        .events(0, 10_000)
        .expect("events")
        .into_iter()
        .map(|e| e.event_type)
        .collect()
}

fn error_code(outcome: &Outcome) -> &str {
    outcome.error.as_ref().map_or("", |e| e.code.as_str())
}

/// Blocks until the session's journal holds a record of `kind` (bounded by WAIT).
fn wait_for_record(session: &Session, kind: &str) {
    session
        .wait_for_events(WAIT, |events| events.iter().any(|e| e.event_type == kind))
        .unwrap_or_else(|_| panic!("no {kind} record in session {}", session.id()));
}

fn options(tag: &str) -> Options {
    let mut options = fast_options(tag);
    options.cancel_grace = Duration::from_millis(300);
    options
}

#[test]
fn an_activation_completes_with_the_harness_result_and_a_complete_journal() {
    let brain = start(vec![fault("echo", &[])], options("complete"));
    let session = create(&brain, "echo", json!({}));
    let outcome = wait(&session.send(text("hi")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    let echoed = outcome.result.expect("a result");
    assert_eq!(echoed["echo"]["input"]["input"]["content"][0]["text"], "hi");
    assert_eq!(
        kinds(&session),
        [
            "session_created",
            "activation_queued",
            "activation_started",
            "activation_finished"
        ]
    );
    let info = session.info().unwrap();
    assert_eq!(info.status, SessionStatus::Open);
    assert_eq!(info.marker, None);
}

#[test]
fn capacity_runs_two_and_queues_three_in_fifo_order() {
    let brain = start(
        vec![fault("cap", &[]).max_concurrency(2)],
        options("capacity"),
    );
    let sessions: Vec<Session> = (0..5)
        .map(|_| create(&brain, "cap", json!({"fault": "hang"})))
        .collect();
    let activations: Vec<Activation> = sessions
        .iter()
        .map(|s| s.send(text("wait")).unwrap())
        .collect();
    wait_for_record(&sessions[0], "activation_started");
    wait_for_record(&sessions[1], "activation_started");
    for waiting in &sessions[2..] {
        assert!(!kinds(waiting).contains(&"activation_started".to_owned()));
    }
    // Each cancel frees one unit of capacity; the next in send order starts, and only it.
    for next in 2..5 {
        sessions[next - 2].cancel().unwrap();
        assert_eq!(wait(&activations[next - 2]).outcome, OutcomeKind::Cancelled);
        wait_for_record(&sessions[next], "activation_started");
        for later in &sessions[next + 1..] {
            assert!(
                !kinds(later).contains(&"activation_started".to_owned()),
                "a later session started before session {next}"
            );
        }
    }
}

/// On a registration with `max_concurrency` 1: a `hang` session whose activation holds the only
/// unit of capacity (its marker written), and an idle second session whose next activation will
/// have to wait.
fn occupied_with_one_more(brain: &Brain, registration: &str) -> (Session, Activation, Session) {
    let blocker = create(brain, registration, json!({"fault": "hang"}));
    let other = create(brain, registration, json!({}));
    let running = blocker.send(text("block")).unwrap();
    wait_for_record(&blocker, "activation_started");
    (blocker, running, other)
}

#[test]
fn cancelling_a_queued_activation_never_reaches_the_harness() {
    let brain = start(
        vec![fault("q", &[]).max_concurrency(1)],
        options("cancel-queued"),
    );
    let (blocker, running, queued) = occupied_with_one_more(&brain, "q");
    let waiting = queued.send(text("never")).unwrap();
    let cancelled = waiting.canceller().cancel().unwrap();
    assert!(!cancelled.was_running);
    let outcome = wait(&waiting);
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled);
    assert!(!kinds(&queued).contains(&"activation_started".to_owned()));
    let info = queued.info().unwrap();
    assert_eq!(info.status, SessionStatus::Open);
    assert_eq!(info.marker, None);
    // The session is usable: once capacity frees, its next activation runs.
    blocker.cancel().unwrap();
    wait(&running);
    assert_eq!(
        wait(&queued.send(text("now")).unwrap()).outcome,
        OutcomeKind::Completed
    );
}

#[test]
fn a_cooperative_cancel_interrupts_the_session() {
    let brain = start(vec![fault("c", &[])], options("cancel-running"));
    let session = create(&brain, "c", json!({"fault": "hang", "announce": true}));
    let activation = session.send(text("long")).unwrap();
    wait_for_record(&session, "event_emitted");
    assert!(session.cancel().unwrap().was_running);
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled);
    assert_eq!(error_code(&outcome), "cancelled");
    assert_interrupted(&session, activation.sequence());
}

#[test]
fn a_harness_ignoring_cancel_is_killed_and_only_its_worker_is_affected() {
    let brain = start(vec![fault("w", &[]).workers(2)], options("ignore-cancel"));
    // Placement alternates between the two slots.
    let stubborn = create(
        &brain,
        "w",
        json!({"fault": "ignore_cancel", "announce": true}),
    );
    let other_worker = create(&brain, "w", json!({"fault": "hang", "announce": true}));
    let neighbour = create(&brain, "w", json!({"fault": "hang", "announce": true}));
    let spare = create(&brain, "w", json!({}));
    assert_eq!(stubborn.info().unwrap().worker, 0);
    assert_eq!(other_worker.info().unwrap().worker, 1);
    assert_eq!(neighbour.info().unwrap().worker, 0);
    assert_eq!(spare.info().unwrap().worker, 1);
    let doomed = stubborn.send(text("x")).unwrap();
    let survivor = other_worker.send(text("x")).unwrap();
    let collateral = neighbour.send(text("x")).unwrap();
    for session in [&stubborn, &other_worker, &neighbour] {
        wait_for_record(session, "event_emitted");
    }
    stubborn.cancel().unwrap();
    let outcome = wait(&doomed);
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled, "{outcome:?}");
    let outcome = wait(&collateral);
    assert_eq!(outcome.outcome, OutcomeKind::Failed);
    assert_eq!(error_code(&outcome), "worker_lost");
    // The other worker was untouched: its activation still runs and ends cooperatively.
    assert!(survivor.outcome().is_none());
    other_worker.cancel().unwrap();
    assert_eq!(wait(&survivor).outcome, OutcomeKind::Cancelled);
    assert_eq!(
        wait(&spare.send(text("ok")).unwrap()).outcome,
        OutcomeKind::Completed
    );
    let status = brain.status();
    assert_eq!(status.worker("w", 1).unwrap().restarts, 0);
}

/// A model provider that answers only once Brain cancels the call: Brain does that when the
/// activation ends, so a call to it is certainly outstanding when the harness answers `run`.
struct UntilCancelled;

impl ModelProvider for UntilCancelled {
    fn call(&self, _: &ModelCall<'_>, cancel: &CancelToken) -> Result<ModelResult, EffectError> {
        cancel.wait();
        Err(EffectError::Cancelled { sent: true })
    }
}

#[test]
fn answering_run_with_a_callback_outstanding_fails_and_the_callback_still_drains() {
    let registrations =
        brain::Registrations::from_vec(vec![fault("o", &[])]).expect("registrations");
    let mut config = brain::Config::new(registrations);
    config.options = options("outstanding");
    config.effects = Effects::default().with_provider("blocking", Arc::new(UntilCancelled));
    let brain = Brain::start(config).expect("start");
    let session = brain
        .create_session_json(
            json!({
                "agentloop": {"name": "o", "configuration": {
                    "fault": "callbacks_outstanding",
                    "call": {"method": "model", "input": {"messages": []}}}},
                "model": {"provider": "blocking", "name": "m"}
            })
            .to_string()
            .as_bytes(),
        )
        .expect("create");
    let outcome = wait(&session.send(text("x")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Failed);
    assert_eq!(error_code(&outcome), "callbacks_outstanding");
    // The admitted model call ran to its end and was recorded before the outcome.
    let kinds = kinds(&session);
    let finished_call = kinds
        .iter()
        .position(|k| k == "model_call_finished")
        .expect("model_call_finished recorded");
    let finished = kinds
        .iter()
        .position(|k| k == "activation_finished")
        .unwrap();
    assert!(finished_call < finished, "{kinds:?}");
    let record = &session.events(0, 100).unwrap()[finished_call];
    assert_eq!(record.data["outcome"], "unknown", "{record:?}");
}

#[test]
fn callbacks_for_sessions_a_worker_does_not_own_are_refused_without_a_record() {
    let brain = start(vec![fault("a", &[]).workers(2)], options("authority"));
    let victim = create(&brain, "a", json!({"fault": "hang"}));
    // The victim's first activation is its second record: session_created is 1.
    let target = |session: &str| json!({"fault": "foreign_callback", "target_session": session, "target_sequence": 2});
    let victim_id = victim.id().to_string();
    let other_worker = create(&brain, "a", target(&victim_id));
    let same_worker = create(&brain, "a", target(&victim_id));
    let guesser = create(&brain, "a", target("ses_00000000000000000000"));
    let placed: Vec<u32> = [&victim, &other_worker, &same_worker, &guesser]
        .iter()
        .map(|s| s.info().unwrap().worker)
        .collect();
    assert_eq!(placed, [0, 1, 0, 1]);
    let running = victim.send(text("x")).unwrap();
    assert_eq!(running.sequence(), 2);
    wait_for_record(&victim, "activation_started");
    let records_before = kinds(&victim).len();
    let attack = |attacker: &Session| {
        let outcome = wait(&attacker.send(text("attack")).unwrap());
        assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
        outcome.result.unwrap()["error"].clone()
    };
    // From another worker while the victim's activation runs, and with a guessed id.
    assert_eq!(attack(&other_worker), "activation_not_active");
    assert_eq!(attack(&guesser), "activation_not_active");
    assert_eq!(kinds(&victim).len(), records_before, "a record was written");
    victim.cancel().unwrap();
    wait(&running);
    // From the victim's own worker after its activation ended: its authority is closed.
    assert_eq!(attack(&same_worker), "activation_closed");
    let after = kinds(&victim);
    assert_eq!(after.len(), records_before + 1, "{after:?}");
    assert_eq!(after.last().unwrap(), "activation_finished");
}

#[test]
fn three_workers_nine_sessions_three_each_and_kept_across_a_respawn() {
    let brain = start(vec![fault("b", &[]).workers(3)], options("balance"));
    let sessions: Vec<Session> = (0..9).map(|_| create(&brain, "b", json!({}))).collect();
    let mut per_worker = [0; 3];
    let placed: Vec<u32> = sessions.iter().map(|s| s.info().unwrap().worker).collect();
    for &worker in &placed {
        per_worker[worker as usize] += 1;
    }
    assert_eq!(per_worker, [3, 3, 3]);
    let pid = brain.status().worker("b", 1).unwrap().pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    brain
        .wait_for(WAIT, |s| {
            s.worker("b", 1)
                .is_some_and(|w| w.restarts == 1 && w.state == brain::WorkerState::Healthy)
        })
        .expect("respawned");
    for (session, worker) in sessions.iter().zip(&placed) {
        assert_eq!(session.info().unwrap().worker, *worker);
        assert_eq!(
            wait(&session.send(text("after")).unwrap()).outcome,
            OutcomeKind::Completed
        );
    }
}

#[test]
fn configuration_merges_and_the_runtime_envelope_is_deterministic() {
    let mut deployment = serde_json::Map::new();
    deployment.insert("depth".into(), json!(1));
    deployment.insert("nested".into(), json!({"a": 1, "b": 2}));
    let brain = start(
        vec![fault("m", &[]).configuration(deployment)],
        options("merge"),
    );
    let session = create(&brain, "m", json!({"nested": {"b": 3}, "extra": true}));
    let outcome = wait(&session.send(text("x")).unwrap());
    let input = &outcome.result.unwrap()["echo"]["input"];
    assert_eq!(
        input["configuration"],
        json!({"depth": 1, "nested": {"a": 1, "b": 3}, "extra": true})
    );
    let runtime = &input["runtime"];
    let expected = brain::session::runtime_envelope(session.id(), outcome.sequence);
    assert_eq!(runtime, &serde_json::to_value(expected).unwrap());
}

#[test]
fn a_worker_lost_with_activations_queued_runs_them_after_the_respawn() {
    let brain = start(vec![fault("r", &[]).max_concurrency(1)], options("requeue"));
    let crasher = create(&brain, "r", json!({"fault": "crash"}));
    let patient = create(&brain, "r", json!({}));
    let crashed = crasher.send(text("boom")).unwrap();
    let waiting = patient.send(text("later")).unwrap();
    let outcome = wait(&crashed);
    assert_eq!(error_code(&outcome), "worker_lost");
    assert_eq!(wait(&waiting).outcome, OutcomeKind::Completed);
    assert_eq!(brain.status().worker("r", 0).unwrap().restarts, 1);
}

#[test]
fn quarantine_ends_queued_activations_agentloop_unavailable() {
    let mut options = options("quarantine-queue");
    options.restart_budget = 0;
    let brain = start(vec![fault("z", &[]).max_concurrency(1)], options);
    let holder = create(&brain, "z", json!({"fault": "hang"}));
    let patient = create(&brain, "z", json!({}));
    let held = holder.send(text("hold")).unwrap();
    // The holder has the worker's one place from its marker on, so the patient waits behind it.
    wait_for_record(&holder, "activation_started");
    let waiting = patient.send(text("later")).unwrap();
    let pid = brain.status().worker("z", 0).unwrap().pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert_eq!(error_code(&wait(&held)), "worker_lost");
    let outcome = wait(&waiting);
    assert_eq!(outcome.outcome, OutcomeKind::Failed);
    assert_eq!(error_code(&outcome), "agentloop_unavailable");
    assert!(!kinds(&patient).contains(&"activation_started".to_owned()));
    let refused = patient.send(text("again")).unwrap_err();
    assert_eq!(refused.code.as_str(), "agentloop_unavailable");
}

#[test]
fn the_wall_deadline_cancels_and_records_deadline_exceeded() {
    let brain = start(vec![fault("d", &[])], options("deadline"));
    let session = create(&brain, "d", json!({"fault": "hang"}));
    let activation = session
        .send_with_deadline(text("slow"), Duration::from_millis(200))
        .unwrap();
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Failed);
    assert_eq!(error_code(&outcome), "deadline_exceeded");
}

#[test]
fn one_activation_per_session() {
    let brain = start(vec![fault("one", &[])], options("busy"));
    let session = create(&brain, "one", json!({"fault": "hang"}));
    let running = session.send(text("a")).unwrap();
    let refused = session.send(text("b")).unwrap_err();
    assert_eq!(refused.code.as_str(), "session_busy");
    for refusal in [
        session.passivate().unwrap_err(),
        session.close().unwrap_err(),
        session.delete().unwrap_err(),
    ] {
        assert_eq!(refusal.code.as_str(), "session_busy");
    }
    session.cancel().unwrap();
    wait(&running);
}

#[test]
fn passivate_close_delete() {
    let brain = start(vec![fault("life", &[])], options("lifecycle"));
    let session = create(&brain, "life", json!({}));
    wait(&session.send(text("a")).unwrap());
    assert_eq!(
        session.passivate().unwrap().status,
        SessionStatus::Passivated
    );
    assert_eq!(
        session.passivate().unwrap().status,
        SessionStatus::Passivated
    );
    // The next activation reopens it.
    assert_eq!(
        wait(&session.send(text("b")).unwrap()).outcome,
        OutcomeKind::Completed
    );
    assert_eq!(session.info().unwrap().status, SessionStatus::Open);
    let refused = session.delete().unwrap_err();
    assert_eq!(refused.code.as_str(), "invalid_request");
    let state_dir = session.info().unwrap().state_dir;
    assert!(state_dir.is_dir());
    assert_eq!(session.close().unwrap().status, SessionStatus::Closed);
    assert_eq!(session.close().unwrap().status, SessionStatus::Closed);
    assert_eq!(
        session.send(text("c")).unwrap_err().code.as_str(),
        "session_closed"
    );
    assert!(kinds(&session).contains(&"session_closed".to_owned()));
    session.delete().unwrap();
    assert!(!state_dir.exists());
    assert_eq!(session.info().unwrap_err().code.as_str(), "unknown_session");
    assert_eq!(
        session.delete().unwrap_err().code.as_str(),
        "unknown_session"
    );
}

#[test]
fn a_send_racing_a_passivation_never_loses_the_session() {
    // A passivated session leaves the dispatcher's memory once its record is durable, unless an
    // activation arrived in between. Race the two many times: every send must complete and the
    // session must stay whole, whichever won.
    let brain = start(vec![fault("race", &[])], options("passivate-race"));
    let session = create(&brain, "race", json!({}));
    let id = session.id().clone();
    for round in 0..40 {
        let (passivated, sent) = std::thread::scope(|scope| {
            let racer = scope.spawn(|| brain.session(&id).send(text("race")));
            let passivated = session.passivate();
            (passivated, racer.join().expect("the racing thread"))
        });
        if let Err(error) = &passivated {
            assert_eq!(
                error.code.as_str(),
                "session_busy",
                "round {round}: {error}"
            );
        }
        let activation = sent.unwrap_or_else(|error| panic!("round {round}: send: {error}"));
        assert_eq!(
            wait(&activation).outcome,
            OutcomeKind::Completed,
            "round {round}"
        );
        let status = session.info().expect("the session still exists").status;
        assert!(
            matches!(status, SessionStatus::Open | SessionStatus::Passivated),
            "round {round}: {status:?}"
        );
    }
    assert_eq!(
        wait(&session.send(text("after")).unwrap()).outcome,
        OutcomeKind::Completed
    );
}

#[test]
fn creation_refusals_name_what_was_wrong() {
    let brain = start(
        vec![
            fault("strict", &["--configuration-keys", "depth"]),
            fault("meta", &["--required-model-metadata", "context_window"]),
        ],
        options("refusals"),
    );
    let unknown = brain
        .create_session(request("nope", json!({})))
        .unwrap_err();
    assert_eq!(unknown.code.as_str(), "unknown_agentloop");
    let config = brain
        .create_session(request("strict", json!({"speed": 1})))
        .unwrap_err();
    assert_eq!(config.code.as_str(), "invalid_configuration");
    assert!(config.message.contains("speed"), "{}", config.message);
    let meta = brain
        .create_session(request("meta", json!({})))
        .unwrap_err();
    assert_eq!(meta.code.as_str(), "missing_model_metadata");
    assert!(meta.message.contains("context_window"));
    let code = brain
        .create_session_json(br#"{"agentloop": {"name": "strict", "command": "rm -rf /"}}"#)
        .unwrap_err();
    assert_eq!(code.code.as_str(), "invalid_request");
    assert!(code.message.contains("command"), "{}", code.message);
}

#[test]
fn an_unavailable_registration_refuses_creation() {
    let mut options = options("unavailable");
    options.respawn_backoff = Duration::from_secs(60);
    let brain = start(
        vec![fault("down", &["--wrong-protocol"]), fault("up", &[])],
        options,
    );
    let refused = brain
        .create_session(request("down", json!({})))
        .unwrap_err();
    assert_eq!(refused.code.as_str(), "agentloop_unavailable");
    create(&brain, "up", json!({}));
}

#[test]
fn a_thousand_sessions_over_four_workers_all_complete_with_correct_journals() {
    let brain = start(vec![fault("load", &[]).workers(4)], options("load"));
    let calls = json!([
        {"method": "kv.put", "input": {"key": "n", "value": 1}},
        {"method": "kv.get", "input": {"key": "n"}},
        {"method": "emit", "input": {"type": "progress", "data": {"step": 1}}},
    ]);
    let sessions: Vec<Session> = (0..1000)
        .map(|_| create(&brain, "load", json!({"fault": "calls", "calls": calls})))
        .collect();
    let activations: Vec<Activation> = sessions
        .iter()
        .map(|s| s.send(text("go")).unwrap())
        .collect();
    for (session, activation) in sessions.iter().zip(&activations) {
        let outcome = wait(activation);
        assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
        let answers = &outcome.result.unwrap()["answers"];
        assert_eq!(answers[1]["found"], true);
        assert_eq!(answers[1]["value"], 1);
        assert_eq!(
            kinds(session),
            [
                "session_created",
                "activation_queued",
                "activation_started",
                "kv_set",
                "event_emitted",
                "activation_finished"
            ]
        );
    }
}

// ----- the outcome table (PROTOCOL.md §6), row by row -----

#[test]
fn outcome_a_harness_error_is_failed_with_its_code() {
    let brain = start(vec![fault("f", &[])], options("fail-code"));
    let valid = create(
        &brain,
        "f",
        json!({"fault": "fail", "code": "model_refused"}),
    );
    let outcome = wait(&valid.send(text("x")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Failed);
    assert_eq!(error_code(&outcome), "model_refused");
    assert_eq!(valid.info().unwrap().status, SessionStatus::Interrupted);
    let invalid = create(&brain, "f", json!({"fault": "fail", "code": "Not A Code!"}));
    let outcome = wait(&invalid.send(text("x")).unwrap());
    assert_eq!(error_code(&outcome), "harness_error");
    assert!(outcome.error.unwrap().message.contains("on purpose"));
}

#[test]
fn outcome_a_malformed_answer_is_invalid_response() {
    let brain = start(vec![fault("m", &[])], options("malformed"));
    let session = create(&brain, "m", json!({"fault": "malformed"}));
    let outcome = wait(&session.send(text("x")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Failed);
    assert_eq!(error_code(&outcome), "invalid_response");
}

#[test]
fn outcome_a_fatal_callback_error_overrides_a_successful_answer() {
    let brain = start(vec![fault("fatal", &[])], options("fatal"));
    let session = create(
        &brain,
        "fatal",
        json!({"fault": "fatal_then_succeed", "after_cancel": true, "announce": true}),
    );
    let activation = session.send(text("x")).unwrap();
    wait_for_record(&session, "event_emitted");
    session.cancel().unwrap();
    let outcome = wait(&activation);
    // The harness swallowed the fatal `cancelled` and answered with a result: the fatal error,
    // answered first, fixed the outcome.
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled, "{outcome:?}");
    assert_eq!(error_code(&outcome), "cancelled");
    assert_eq!(outcome.result, None);
    // No model effect started after the cancel.
    assert!(!kinds(&session).contains(&"model_call_started".to_owned()));
}

#[test]
fn outcome_a_result_after_cancel_is_completed() {
    let brain = start(vec![fault("late", &[])], options("complete-after-cancel"));
    let session = create(
        &brain,
        "late",
        json!({"fault": "complete_on_cancel", "announce": true}),
    );
    let activation = session.send(text("x")).unwrap();
    wait_for_record(&session, "event_emitted");
    assert!(session.cancel().unwrap().was_running);
    let outcome = wait(&activation);
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    assert_eq!(outcome.result.unwrap()["completed_after_cancel"], true);
    // A completed activation clears the marker: the session goes on.
    assert_eq!(session.info().unwrap().status, SessionStatus::Open);
}

#[test]
fn a_cancel_racing_callbacks_leaves_every_started_effect_finished() {
    let brain = start(vec![fault("race", &[])], options("race"));
    let calls: Vec<Value> = (0..50)
        .map(|_| json!({"method": "model", "input": {"messages": []}}))
        .collect();
    let session = create(&brain, "race", json!({"fault": "calls", "calls": calls}));
    let activation = session.send(text("x")).unwrap();
    wait_for_record(&session, "model_call_started");
    session.cancel().unwrap();
    let outcome = wait(&activation);
    let kinds = kinds(&session);
    let started = kinds.iter().filter(|k| *k == "model_call_started").count();
    let finished = kinds.iter().filter(|k| *k == "model_call_finished").count();
    assert_eq!(started, finished, "{kinds:?}");
    if started < 50 {
        // The cancel landed before the last call: a model call was refused `cancelled` (fatal).
        assert_eq!(outcome.outcome, OutcomeKind::Cancelled, "{outcome:?}");
    } else {
        assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    }
    assert_eq!(kinds.last().unwrap(), "activation_finished");
}

#[test]
fn a_callback_after_the_answer_is_refused_activation_closed() {
    let mut options = options("late-callback");
    options.respawn_backoff = Duration::from_secs(60);
    let brain = start(vec![fault("late", &[])], options);
    let session = create(
        &brain,
        "late",
        json!({"fault": "callback_after_answer", "exit_with_answer": true}),
    );
    let outcome = wait(&session.send(text("x")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed);
    // The harness exits 5 when its late callback was answered `activation_closed`.
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("late", 0)
                .is_some_and(|w| w.last_failure.is_some())
        })
        .expect("the harness exited after its late callback");
    let exit = status
        .worker("late", 0)
        .unwrap()
        .last_failure
        .clone()
        .unwrap()
        .exit;
    assert_eq!(
        exit.unwrap().reason,
        brain::worker::process::ExitReason::Code(5)
    );
    assert_eq!(kinds(&session).last().unwrap(), "activation_finished");
}

#[test]
fn shutdown_cancels_queued_and_running_activations_and_refuses_new_work() {
    let brain = start(
        vec![fault("s", &[]).max_concurrency(1)],
        options("shutdown"),
    );
    let (_running_session, running, queued_session) = occupied_with_one_more(&brain, "s");
    let queued = queued_session.send(text("y")).unwrap();
    brain.shutdown(Duration::from_secs(5));
    let outcome = wait(&queued);
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled);
    assert_eq!(error_code(&outcome), "shutting_down");
    let outcome = wait(&running);
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled);
    let refused = brain.create_session(request("s", json!({}))).unwrap_err();
    assert_eq!(refused.code.as_str(), "shutting_down");
}

#[test]
fn passivate_close_and_delete_tell_the_harness_to_release_memory() {
    let brain = start(vec![fault("mem", &[])], options("close-requests"));
    let passivated = create(&brain, "mem", json!({}));
    let closed = create(&brain, "mem", json!({}));
    let interrupted = create(&brain, "mem", json!({"fault": "fail"}));
    let observer = create(&brain, "mem", json!({}));
    for session in [&passivated, &closed] {
        wait(&session.send(text("x")).unwrap());
    }
    wait(&interrupted.send(text("x")).unwrap());
    assert_eq!(
        interrupted.info().unwrap().status,
        SessionStatus::Interrupted
    );
    passivated.passivate().unwrap();
    closed.close().unwrap();
    interrupted.delete().unwrap();
    // A closed session that was passivated first is not sent a second close.
    passivated.close().unwrap();
    let outcome = wait(&observer.send(text("who closed?")).unwrap());
    let reported = outcome.result.unwrap()["closed"].clone();
    assert_eq!(
        reported,
        json!([
            {"session_id": passivated.id(), "reason": "passivated"},
            {"session_id": closed.id(), "reason": "closed"},
            {"session_id": interrupted.id(), "reason": "deleted"},
        ])
    );
}

#[test]
fn at_most_64_callbacks_of_an_activation_are_unanswered_at_once() {
    let registrations =
        brain::Registrations::from_vec(vec![fault("sat", &[])]).expect("registrations");
    let mut config = brain::Config::new(registrations);
    config.options = options("saturate");
    config.options.respawn_backoff = Duration::from_secs(60);
    config.effects = Effects::default().with_provider("blocking", Arc::new(UntilCancelled));
    let brain = Brain::start(config).expect("start");
    let session = brain
        .create_session_json(
            json!({"agentloop": {"name": "sat", "configuration": {"fault": "saturate"}},
                   "model": {"provider": "blocking", "name": "m"}})
            .to_string()
            .as_bytes(),
        )
        .unwrap();
    let activation = session.send(text("x")).unwrap();
    // The harness exits 7 when its 65th unanswered callback was refused `overloaded`.
    let outcome = wait(&activation);
    assert_eq!(error_code(&outcome), "worker_lost");
    let status = brain.status();
    let exit = status
        .worker("sat", 0)
        .unwrap()
        .last_failure
        .clone()
        .unwrap()
        .exit;
    assert_eq!(
        exit.unwrap().reason,
        brain::worker::process::ExitReason::Code(7)
    );
    // Every admitted model call still got its finished record.
    let kinds = kinds(&session);
    let started = kinds.iter().filter(|k| *k == "model_call_started").count();
    let finished = kinds.iter().filter(|k| *k == "model_call_finished").count();
    assert_eq!((started, finished), (64, 64));
}

#[test]
fn an_interrupted_conversation_continues_in_a_new_session_from_its_transcript() {
    let brain = start(
        vec![
            brain::Registration::new("ref", REFERENCE_HARNESS),
            fault("plain", &[]),
        ],
        options("from"),
    );
    let script = json!([{"message": {"role": "assistant", "content": [{"type": "text", "text": "first answer"}]},
                         "stop_reason": "end_turn"}]);
    let old = brain
        .create_session_json(
            json!({"agentloop": {"name": "ref"},
                   "model": {"provider": "scripted", "name": "s", "options": {"script": script}}})
            .to_string()
            .as_bytes(),
        )
        .unwrap();
    assert_eq!(
        wait(&old.send(text("one")).unwrap()).outcome,
        OutcomeKind::Completed
    );
    // The script is exhausted: the second turn fails and interrupts the session.
    let failed = wait(&old.send(text("two")).unwrap());
    assert_eq!(error_code(&failed), "model_failed");
    assert_eq!(old.info().unwrap().status, SessionStatus::Interrupted);
    let (transcript, _) = old.transcript().unwrap();
    assert_eq!(transcript.len(), 2);
    let new = brain
        .create_session_from(request("ref", json!({})), old.id())
        .unwrap();
    assert_eq!(new.transcript().unwrap().0, transcript);
    let outcome = wait(&new.send(text("three")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed);
    assert_eq!(new.transcript().unwrap().0.len(), 4);
    // A harness without transcript_import cannot continue it; an open session cannot be a source.
    let refused = brain
        .create_session_from(request("plain", json!({})), old.id())
        .unwrap_err();
    assert_eq!(refused.code.as_str(), "unsupported_input");
    let refused = brain
        .create_session_from(request("ref", json!({})), new.id())
        .unwrap_err();
    assert_eq!(refused.code.as_str(), "invalid_request");
}

#[test]
fn media_and_transcript_imports_follow_the_capabilities() {
    let brain = start(
        vec![
            fault("plain", &[]),
            fault(
                "rich",
                &["--capability", "media", "--capability", "transcript_import"],
            ),
        ],
        options("capabilities"),
    );
    let transcript = json!([{"role": "user", "content": [{"type": "text", "text": "earlier"}]}]);
    let refused = brain
        .create_session_json(
            json!({"agentloop": {"name": "plain"}, "transcript": transcript})
                .to_string()
                .as_bytes(),
        )
        .unwrap_err();
    assert_eq!(refused.code.as_str(), "unsupported_input");
    let rich = brain
        .create_session_json(
            json!({"agentloop": {"name": "rich"}, "transcript": transcript})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
    assert_eq!(rich.transcript().unwrap().0.len(), 1);
    let image = |url: &str| UserInput {
        content: vec![Block::Image {
            url: url.to_owned(),
        }],
    };
    let refused = rich.send(image("http://example.com/cat.png")).unwrap_err();
    assert_eq!(refused.code.as_str(), "unsupported_input");
    assert!(refused.message.contains("http"), "{}", refused.message);
    assert_eq!(
        wait(&rich.send(image("https://example.com/cat.png")).unwrap()).outcome,
        OutcomeKind::Completed
    );
    let plain = create(&brain, "plain", json!({}));
    let refused = plain
        .send(image("https://example.com/cat.png"))
        .unwrap_err();
    assert_eq!(refused.code.as_str(), "unsupported_input");
}

#[test]
fn shutdown_drains_running_activations_with_their_callbacks_served() {
    let brain = Arc::new(start(
        vec![fault("drain", &[]).max_concurrency(1)],
        options("drain"),
    ));
    let calls = json!([{"method": "kv.put", "input": {"key": "k", "value": 1}}]);
    let finishing = create(
        &brain,
        "drain",
        json!({"fault": "slow_calls", "delay_ms": 300, "calls": calls, "announce": true}),
    );
    let queued = create(&brain, "drain", json!({}));
    let running = finishing.send(text("x")).unwrap();
    wait_for_record(&finishing, "event_emitted");
    let waiting = queued.send(text("y")).unwrap();
    let stopper = {
        let brain = brain.clone();
        std::thread::spawn(move || {
            brain.shutdown_after(Duration::from_secs(20), Duration::from_secs(5))
        })
    };
    brain
        .wait_for(WAIT, |s| s.shutting_down)
        .expect("readiness fails at once");
    assert!(!brain.ready());
    assert_eq!(
        queued.send(text("z")).unwrap_err().code.as_str(),
        "shutting_down"
    );
    // The running activation finishes normally: its callback is still served during the drain.
    let outcome = wait(&running);
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    assert!(outcome.result.unwrap()["answers"][0]["sequence"].is_u64());
    assert_eq!(error_code(&wait(&waiting)), "shutting_down");
    stopper.join().unwrap();
}

#[test]
fn shutdown_cancels_what_outlives_the_drain_and_a_second_request_skips_the_wait() {
    let brain = Arc::new(start(vec![fault("drain", &[])], options("drain-expired")));
    let stubborn = create(&brain, "drain", json!({"fault": "hang", "announce": true}));
    let running = stubborn.send(text("x")).unwrap();
    wait_for_record(&stubborn, "event_emitted");
    let began = std::time::Instant::now();
    brain.shutdown_after(Duration::from_millis(200), Duration::from_secs(5));
    let outcome = wait(&running);
    assert_eq!(outcome.outcome, OutcomeKind::Cancelled);
    assert!(began.elapsed() >= Duration::from_millis(200));

    // A harness ignoring both cancel and shutdown: a second request skips the drain, sends
    // `shutdown` at once although a run is in flight, and kills the worker one (shorter) grace
    // later.
    let brain = Arc::new(start(
        vec![fault("deaf", &["--ignore-shutdown"])],
        options("second-signal"),
    ));
    let deaf = create(
        &brain,
        "deaf",
        json!({"fault": "ignore_cancel", "announce": true}),
    );
    let running = deaf.send(text("x")).unwrap();
    wait_for_record(&deaf, "event_emitted");
    let first = {
        let brain = brain.clone();
        std::thread::spawn(move || {
            brain.shutdown_after(Duration::from_secs(60), Duration::from_secs(60))
        })
    };
    brain
        .wait_for(WAIT, |s| s.shutting_down)
        .expect("shutting down");
    let began = std::time::Instant::now();
    brain.shutdown_after(Duration::from_secs(60), Duration::from_millis(300));
    first.join().unwrap();
    assert!(began.elapsed() >= Duration::from_millis(300));
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(wait(&running).outcome, OutcomeKind::Failed);
}

/// The journal's gauge of sessions whose projections are in memory.
fn loaded_sessions(brain: &Brain) -> u64 {
    let text = brain.metrics_text();
    text.lines()
        .find_map(|line| line.strip_prefix("brain_journal_loaded_sessions "))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no brain_journal_loaded_sessions gauge in:\n{text}"))
}

/// The ids of every session `brain` lists.
fn listed_ids(brain: &Brain) -> Vec<brain::session::SessionId> {
    brain
        .sessions()
        .unwrap()
        .into_iter()
        .map(|info| info.session_id)
        .collect()
}

/// Blocks until the journal holds `count` sessions' projections (bounded by WAIT).
fn wait_for_loaded(brain: &Brain, count: u64) {
    let deadline = std::time::Instant::now() + WAIT;
    while loaded_sessions(brain) != count {
        assert!(
            std::time::Instant::now() < deadline,
            "{} sessions still loaded, not {count}",
            loaded_sessions(brain)
        );
        std::thread::yield_now();
    }
}

#[test]
fn a_closed_session_leaves_memory_and_stops_counting_for_placement() {
    let brain = start(
        vec![fault("shut", &[]).workers(2)],
        options("closed-dormant"),
    );
    let sessions: Vec<Session> = (0..4).map(|_| create(&brain, "shut", json!({}))).collect();
    let placed: Vec<u32> = sessions.iter().map(|s| s.info().unwrap().worker).collect();
    assert_eq!(placed, [0, 1, 0, 1]);
    wait(&sessions[1].send(text("a")).unwrap());
    for closed in [&sessions[1], &sessions[3]] {
        assert_eq!(closed.close().unwrap().status, SessionStatus::Closed);
    }
    assert_eq!(
        sessions[2].passivate().unwrap().status,
        SessionStatus::Passivated
    );
    // Closed and passivated sessions are let go of once their record is durable, and asking
    // for their status does not load them again.
    wait_for_loaded(&brain, 1);
    assert_eq!(
        sessions[2].info().unwrap().status,
        SessionStatus::Passivated
    );
    assert_eq!(sessions[3].info().unwrap().status, SessionStatus::Closed);
    assert_eq!(sessions[3].info().unwrap().worker, 1);
    assert_eq!(loaded_sessions(&brain), 1);
    // Closing a closed session again answers it as it is, still without loading it.
    assert_eq!(sessions[3].close().unwrap().status, SessionStatus::Closed);
    assert_eq!(loaded_sessions(&brain), 1);

    // Worker 0 holds an open and a passivated session, worker 1 two closed ones: the next two
    // sessions go to worker 1, which then has one that counts, then two.
    let newer: Vec<u32> = (0..2)
        .map(|_| create(&brain, "shut", json!({})).info().unwrap().worker)
        .collect();
    assert_eq!(newer, [1, 1]);

    // Described from the journal, and loaded again when named: closed, with its history.
    let listed = brain.sessions().unwrap();
    let described = |session: &Session| {
        listed
            .iter()
            .find(|info| &info.session_id == session.id())
            .cloned()
            .expect("listed")
    };
    assert_eq!(described(&sessions[1]).status, SessionStatus::Closed);

    // Deleted without being loaded again: its directory goes, its id is unknown from then on.
    let state_dir = described(&sessions[3]).state_dir;
    assert!(state_dir.is_dir(), "{}", state_dir.display());
    sessions[3].delete().unwrap();
    assert_eq!(
        loaded_sessions(&brain),
        3,
        "the open session and the two new ones"
    );
    assert!(!state_dir.exists(), "{} is removed", state_dir.display());
    let unknown = sessions[3].info().unwrap_err();
    assert_eq!(unknown.code.as_str(), "unknown_session");
    let ids = listed_ids(&brain);
    assert!(!ids.contains(sessions[3].id()), "{ids:?}");
    let refused = sessions[1].send(text("again")).unwrap_err();
    assert_eq!(refused.code.as_str(), "session_closed");
    assert_eq!(sessions[1].info().unwrap().status, SessionStatus::Closed);
    let history = kinds(&sessions[1]);
    assert!(
        history.contains(&"activation_finished".to_owned()),
        "{history:?}"
    );
    assert_eq!(history.last().map(String::as_str), Some("session_closed"));
}

#[test]
fn listing_describes_passivated_sessions_without_loading_them_again() {
    let brain = start(vec![fault("list", &[])], options("list-dormant"));
    let passivated: Vec<Session> = (0..4).map(|_| create(&brain, "list", json!({}))).collect();
    for session in &passivated {
        wait(&session.send(text("x")).unwrap());
    }
    let before: Vec<_> = passivated.iter().map(|s| s.info().unwrap()).collect();
    let open = create(&brain, "list", json!({}));
    for session in &passivated {
        session.passivate().unwrap();
    }
    // A passivated session's projections are let go of once its record is durable.
    wait_for_loaded(&brain, 1);

    let listed = brain.sessions().unwrap();
    assert_eq!(listed.len(), 5);
    assert_eq!(
        listed
            .iter()
            .find(|i| i.session_id == *open.id())
            .unwrap()
            .status,
        SessionStatus::Open
    );
    for info in before {
        let now = listed
            .iter()
            .find(|i| i.session_id == info.session_id)
            .expect("a passivated session is listed");
        assert_eq!(now.status, SessionStatus::Passivated);
        assert_eq!(
            (&now.registration, now.worker, now.marker, &now.state_dir),
            (
                &info.registration,
                info.worker,
                info.marker,
                &info.state_dir
            )
        );
    }
    assert_eq!(
        loaded_sessions(&brain),
        1,
        "listing loaded the passivated sessions"
    );
    // A listed session is recovered on its next use as before.
    let outcome = wait(&passivated[0].send(text("again")).unwrap());
    assert_eq!(outcome.outcome, OutcomeKind::Completed, "{outcome:?}");
    assert_eq!(passivated[0].info().unwrap().status, SessionStatus::Open);
}

#[test]
fn a_restart_removes_the_state_a_stopped_deletion_left_and_nothing_else() {
    let first = options("orphans");
    let data_dir = first.data_dir.clone();
    let brain = start(vec![fault("orph", &[])], first);
    let kept = create(&brain, "orph", json!({}));
    let deleted = create(&brain, "orph", json!({}));
    for session in [&kept, &deleted] {
        wait(&session.send(text("x")).unwrap());
        session.close().unwrap();
    }
    let kept_dir = kept.info().unwrap().state_dir;
    let deleted_dir = deleted.info().unwrap().state_dir;
    std::fs::write(kept_dir.join("native"), "kept").unwrap();
    deleted.delete().unwrap();
    assert!(!deleted_dir.exists());
    // What a stop between the deletion's durable record and the removal of the state leaves.
    std::fs::create_dir_all(&deleted_dir).unwrap();
    std::fs::write(deleted_dir.join("native"), "deleted").unwrap();
    // An operator's directory, not a session's.
    let notes = deleted_dir.parent().unwrap().join("notes");
    std::fs::create_dir_all(&notes).unwrap();
    brain.shutdown(Duration::from_secs(5));
    drop(brain);

    let mut second = options("orphans-again");
    second.data_dir = data_dir;
    let brain = start(vec![fault("orph", &[])], second);
    assert!(
        !deleted_dir.exists(),
        "the deleted session's state came back"
    );
    assert_eq!(
        std::fs::read_to_string(kept_dir.join("native")).unwrap(),
        "kept"
    );
    assert!(notes.is_dir());
    assert_eq!(listed_ids(&brain), [kept.id().clone()]);
}
