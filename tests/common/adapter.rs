//! What the upstream adapters' tests (`pi_adapter`, `codex_adapter`, `opencode_adapter`) share: a
//! Brain that cleans up after a passing test, the scripted model with the metadata every adapter
//! requires, and readers of what the journal recorded.

use super::{BRAIN, WAIT, run_bounded, temp_dir};
use brain::effects::Effects;
use brain::protocol::harness::{Block, Event, UserInput};
use brain::session::CreateSession;
use brain::{Activation, Brain, Config, Options, Outcome, Registration, Registrations, Session};
use serde_json::{Value, json};
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A test's scratch directory: removed when the test passes, kept (and named) when it fails.
pub struct Scratch(pub PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept the failed test's directory {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A running Brain and its scratch directory; Brain stops before the directory goes.
pub struct Running {
    brain: Option<Brain>,
    options: Options,
    registrations: Vec<Registration>,
    effects: Effects,
    _scratch: Scratch,
}

impl Deref for Running {
    type Target = Brain;
    fn deref(&self) -> &Brain {
        self.brain.as_ref().expect("a running Brain")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(brain) = self.brain.take() {
            brain.shutdown(Duration::from_secs(5));
        }
    }
}

impl Running {
    /// Starts Brain with `registrations`; the data directory's parent is the test's scratch.
    pub fn start(registrations: Vec<Registration>, options: Options) -> Running {
        Running::start_with(registrations, options, Effects::default())
    }

    /// [`Running::start`] with these model providers and environment drivers.
    pub fn start_with(
        registrations: Vec<Registration>,
        options: Options,
        effects: Effects,
    ) -> Running {
        let scratch = Scratch(
            options
                .data_dir
                .parent()
                .expect("the data dir has a parent")
                .to_path_buf(),
        );
        let brain = start_brain(&registrations, &options, &effects);
        Running {
            brain: Some(brain),
            options,
            registrations,
            effects,
            _scratch: scratch,
        }
    }

    /// Stops this Brain and starts another with the same registrations on the same data
    /// directory.
    pub fn restart(&mut self) {
        if let Some(brain) = self.brain.take() {
            brain.shutdown(Duration::from_secs(5));
        }
        self.brain = Some(start_brain(
            &self.registrations,
            &self.options,
            &self.effects,
        ));
    }
}

fn start_brain(registrations: &[Registration], options: &Options, effects: &Effects) -> Brain {
    let registrations =
        Registrations::from_vec(registrations.to_vec()).expect("valid registrations");
    let mut config = Config::new(registrations);
    config.options = options.clone();
    config.effects = effects.clone();
    Brain::start(config).unwrap_or_else(|error| panic!("Brain refused to start: {error}"))
}

/// The model every adapter session uses: the scripted provider with the metadata the adapters
/// require; `script` is its list of ModelResults, one per model call (none: it echoes).
pub fn model(script: Option<Value>) -> Value {
    let mut model = json!({"provider": "scripted", "name": "default",
                           "context_window": 200_000, "max_output_tokens": 8192});
    if let Some(script) = script {
        model["options"] = json!({ "script": script });
    }
    model
}

pub fn create(brain: &Brain, request: Value) -> Session {
    let request = CreateSession::parse(request.to_string().as_bytes()).expect("a valid request");
    brain
        .create_session(request)
        .unwrap_or_else(|error| panic!("create session: {error}"))
}

pub fn text(text: &str) -> UserInput {
    UserInput {
        content: vec![Block::text(text)],
    }
}

pub fn wait(activation: &Activation) -> Outcome {
    activation
        .wait_timeout(WAIT)
        .unwrap_or_else(|| panic!("activation {} did not end", activation.sequence()))
}

pub fn records(session: &Session, kind: &str) -> Vec<Event> {
    session
        .events(0, 100_000)
        .expect("events")
        .into_iter()
        .filter(|event| event.event_type == kind)
        .collect()
}

/// The requests of the session's model calls, in order.
pub fn model_requests(session: &Session) -> Vec<Value> {
    records(session, "model_call_started")
        .into_iter()
        .map(|event| event.data["request"].clone())
        .collect()
}

/// The text of a message's text blocks.
pub fn texts(message: &Value) -> Vec<&str> {
    message["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter_map(|block| block["text"].as_str())
        .collect()
}

pub fn answers(text: &str) -> Value {
    json!({"message": {"role": "assistant", "content": [{"type": "text", "text": text}]},
           "stop_reason": "end_turn", "usage": {}})
}

pub fn kill(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the process");
}

/// `brain run --agentloops examples/ADAPTER.json --agentloop ADAPTER MESSAGE` from the checkout,
/// optionally in a fresh network namespace with only loopback up; the scripted model echoes.
pub fn brain_run_example(adapter: &str, tag: &str, offline: bool) {
    let scratch = Scratch(temp_dir(tag));
    let data = scratch.0.join("data");
    let mut command = if offline {
        let unshare = ["/usr/bin/unshare", "/bin/unshare"]
            .into_iter()
            .find(|path| Path::new(path).exists())
            .expect("unshare (util-linux) is needed for the offline test");
        let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
            .into_iter()
            .find(|path| Path::new(path).exists())
            .expect("ip (iproute2) is needed to bring loopback up for the offline test");
        let mut command = std::process::Command::new(unshare);
        command.args([
            "-n",
            "--",
            "/bin/sh",
            "-c",
            "\"$0\" link set lo up && exec \"$@\"",
            ip,
            BRAIN,
        ]);
        command
    } else {
        std::process::Command::new(BRAIN)
    };
    let output = run_bounded(
        command
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["run", "--data-dir"])
            .arg(&data)
            .args(["--agentloops", &format!("examples/{adapter}.json")])
            .args(["--agentloop", adapter])
            .arg("hello from brain run"),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "brain run failed: {stderr}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "hello from brain run\n"
    );
}

/// The creation refusals of an adapter that requires the model's limits: an unknown
/// configuration key (`invalid_configuration`) and a model without `max_output_tokens`
/// (`missing_model_metadata`), each naming what was wrong. Their messages, for the suite's own
/// checks.
pub fn assert_creation_refusals(brain: &Brain, adapter: &str) -> (String, String) {
    let parse = |request: Value| CreateSession::parse(request.to_string().as_bytes()).unwrap();
    let unknown = brain
        .create_session(parse(json!({
            "agentloop": {"name": adapter, "configuration": {"temprature": 0.2}},
            "model": model(None)})))
        .unwrap_err();
    assert_eq!(unknown.code.as_str(), "invalid_configuration");
    assert!(
        unknown.message.contains("temprature"),
        "{}",
        unknown.message
    );

    let missing = brain
        .create_session(parse(json!({
            "agentloop": {"name": adapter},
            "model": {"provider": "scripted", "name": "default", "context_window": 1000}})))
        .unwrap_err();
    assert_eq!(missing.code.as_str(), "missing_model_metadata");
    assert!(
        missing.message.contains("max_output_tokens"),
        "{}",
        missing.message
    );
    (unknown.message, missing.message)
}

/// The refusals of a text-only adapter that starts from native state and requires the model's
/// limits: [`assert_creation_refusals`], and an imported transcript at creation and media at
/// send (`unsupported_input`). Returns the valid session it created for the last check.
pub fn assert_text_only_refusals(brain: &Brain, adapter: &str) -> Session {
    assert_creation_refusals(brain, adapter);
    let parse = |request: Value| CreateSession::parse(request.to_string().as_bytes()).unwrap();
    let imported = brain
        .create_session(parse(json!({
            "agentloop": {"name": adapter}, "model": model(None),
            "transcript": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})))
        .unwrap_err();
    assert_eq!(imported.code.as_str(), "unsupported_input");
    let session = create(
        brain,
        json!({"agentloop": {"name": adapter}, "model": model(None)}),
    );
    let image: UserInput = serde_json::from_value(json!({"content": [
        {"type": "text", "text": "What does this show?"},
        {"type": "image", "url": "https://example.com/chart.png"}]}))
    .unwrap();
    assert_eq!(
        session.send(image).unwrap_err().code.as_str(),
        "unsupported_input"
    );
    session
}

/// The `scripted` provider, except that the session's second model call fails with a fatal
/// code: what Brain answers when its journal cannot record the call (`journal_failed`).
struct FatalSecondCall(brain::effects::ScriptedProvider);

impl brain::effects::ModelProvider for FatalSecondCall {
    fn call(
        &self,
        call: &brain::effects::ModelCall<'_>,
        cancel: &brain::cancel::CancelToken,
    ) -> Result<brain::protocol::harness::ModelResult, brain::effects::EffectError> {
        if call.ordinal == 1 {
            return Err(brain::effects::EffectError::Failed {
                code: brain::protocol::harness::ErrorCode::JournalFailed,
                message: "the test's journal cannot record this call".to_owned(),
            });
        }
        self.0.call(call, cancel)
    }
}

/// Effects with a model provider named `fatal-second-call`: the scripted model, whose second
/// call of a session fails fatally (`journal_failed`), for the adapters' fatal-error tests.
pub fn fatal_second_call() -> Effects {
    Effects::default().with_provider(
        "fatal-second-call",
        std::sync::Arc::new(FatalSecondCall(brain::effects::ScriptedProvider::new())),
    )
}

/// Waits until the session has `count` finished model calls.
pub fn wait_for_finished_model_calls(session: &Session, count: usize) {
    session
        .wait_for_events(WAIT, |events| {
            let finished = events
                .iter()
                .filter(|e| e.event_type == "model_call_finished");
            finished.count() == count
        })
        .unwrap_or_else(|_| {
            panic!(
                "session {} has no {count} finished model calls",
                session.id()
            )
        });
}

/// Brain refused no callback (a refused callback writes no record, but Brain counts it).
pub fn assert_no_refused_callbacks(brain: &Brain) {
    let metrics = brain.metrics_text();
    let refused: Vec<_> = metrics
        .lines()
        .filter(|line| line.starts_with("brain_callbacks_total{method=\"refused\""))
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
}

/// Runs a turn of `request` (whose first scripted answer asks for a tool) on the provider of
/// [`fatal_second_call`], so that the model call after the tool's result fails fatally, and checks
/// what the protocol asks of every adapter then: the run ends `journal_failed` well within the
/// fatal grace (5 s) on the same worker, no callback follows the fatal one (none started, none
/// refused), and the session is left interrupted. The session, for the suite's own checks.
pub fn assert_a_fatal_error_stops_the_turn(
    brain: &Brain,
    registration: &str,
    mut request: Value,
) -> Session {
    request["model"]["provider"] = json!("fatal-second-call");
    let session = create(brain, request);
    let worker = || {
        let status = brain.status();
        let worker = status.worker(registration, 0).expect("the worker");
        (worker.pid, worker.restarts)
    };
    let before = worker();
    let activation = session.send(text("what is pi?")).unwrap();
    wait_for_finished_model_calls(&session, 2);
    let failed_at = std::time::Instant::now();
    let outcome = wait(&activation);
    let took = failed_at.elapsed();
    assert_eq!(outcome.outcome, brain::OutcomeKind::Failed, "{outcome:?}");
    assert_eq!(outcome.error.as_ref().unwrap().code, "journal_failed");
    assert!(
        took < Duration::from_secs(3),
        "run answered {took:?} after the fatal error"
    );
    assert_eq!(worker(), before, "the worker was killed or restarted");
    assert_eq!(records(&session, "model_call_started").len(), 2);
    assert_eq!(records(&session, "tool_call_started").len(), 1);
    let events = session.events(0, usize::MAX).unwrap();
    let fatal = events
        .iter()
        .rposition(|e| e.event_type == "model_call_finished")
        .unwrap();
    let after: Vec<_> = events[fatal + 1..]
        .iter()
        .map(|e| e.event_type.as_str())
        .collect();
    assert!(
        after.iter().all(|kind| !kind.ends_with("_started")),
        "{after:?}"
    );
    assert_no_refused_callbacks(brain);
    super::assert_interrupted(&session, activation.sequence());
    session
}

/// The pid of `registration`'s first worker, which must be running.
pub fn worker_pid(brain: &Brain, registration: &str) -> u32 {
    brain
        .status()
        .worker(registration, 0)
        .and_then(|worker| worker.pid)
        .expect("a running worker")
}

/// The names of the tools a journaled model request offered.
pub fn offered(request: &Value) -> Vec<String> {
    request["tools"]
        .as_array()
        .expect("the adapter names the tools it offers")
        .iter()
        .map(|tool| tool["name"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// A session of `agentloop` with one tool, `lookup`, that the `local` driver runs as `shell`, and
/// the scripted model answering `script_for_model`.
pub fn lookup_request(agentloop: &str, script_for_model: Value, shell: &str) -> Value {
    json!({
        "agentloop": {"name": agentloop},
        "model": model(Some(script_for_model)),
        "tools": [{"name": "lookup", "description": "Look a word up",
                   "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
                   "placements": ["host"]}],
        "environments": [{"name": "host", "driver": "local", "configuration": {
            "tools": {"lookup": {"command": ["/bin/sh", "-c", shell]}}}}],
    })
}

/// A turn of `request` (a [`lookup_request`] whose model asks for `lookup` with `{"word": "pi"}`,
/// the tool printing `found-314`, then answers `pi is 3.14`): it completes after two model calls,
/// and the tool ran once through Brain with the model's input. The session and its journaled
/// model requests, for the suite's own checks of what its upstream sent.
pub fn a_tool_round_trip(brain: &Brain, request: Value) -> (Session, Vec<Value>) {
    let session = create(brain, request);
    let result = a_completed_turn(&session, "what is pi?");
    assert_eq!(result["text"], "pi is 3.14");
    assert_eq!(result["model_calls"], 2);
    // The tool ran through the local driver, with the model's input.
    let finished = records(&session, "tool_call_finished");
    assert_eq!(finished.len(), 1, "{finished:?}");
    assert_eq!(finished[0].data["outcome"], "ok");
    assert_eq!(
        finished[0].data["result"]["content"][0]["text"],
        "found-314\n"
    );
    let started = &records(&session, "tool_call_started")[0];
    assert_eq!(started.data["name"], "lookup", "{}", started.data);
    assert_eq!(started.data["environment"], "host");
    assert_eq!(started.data["input"], json!({"word": "pi"}));
    let requests = model_requests(&session);
    assert_eq!(requests.len(), 2);
    (session, requests)
}

/// The registration of the adapter in `adapters/<name>`, run sandboxed (issue 24: an adapter and
/// its upstream need nothing outside the registration's state root), after checking that its
/// dependencies are installed: `installed` is a path beneath its `node_modules`.
pub fn adapter_registration(name: &str, installed: &str) -> Registration {
    let root = env!("CARGO_MANIFEST_DIR");
    let installed = Path::new(root)
        .join("adapters")
        .join(name)
        .join("node_modules")
        .join(installed);
    assert!(
        installed.exists(),
        "{} is missing: run `npm ci` in adapters/{name} (scripts/test does)",
        installed.display()
    );
    Registration::new(name, "node")
        .args([format!("{root}/adapters/{name}/harness.mjs")])
        .sandbox(true)
}

/// Options for the adapters' tests: short deadlines, but 30 s for a worker's `initialize` (node
/// and the upstream take a few seconds to start on a loaded machine) and the protocol's 5 s
/// cancel grace.
pub fn adapter_options(tag: &str) -> Options {
    let mut options = super::fast_options(tag);
    options.init_deadline = Duration::from_secs(30);
    options.cancel_grace = Duration::from_secs(5);
    options
}

/// A turn of `agentloop` in a 4,000-token window with 1,000 for output, whose first answer
/// (`asks`, a call of `lookup`) reports 3,500 input tokens, more than the window leaves: the
/// upstream compacts through Brain (the scripted model's second answer is the summary,
/// `SUMMARY-OF-THE-WORK`) and the turn completes with the third, `done`. The session and the
/// run's result.
pub fn a_compacting_turn(brain: &Brain, agentloop: &str, mut asks: Value) -> (Session, Value) {
    asks["usage"] = json!({"input_tokens": 3500, "output_tokens": 10});
    let script = json!([asks, answers("SUMMARY-OF-THE-WORK"), answers("done")]);
    let mut request = lookup_request(agentloop, script, "echo found-314");
    request["model"]["context_window"] = json!(4000);
    request["model"]["max_output_tokens"] = json!(1000);
    let session = create(brain, request);
    let result = a_completed_turn(&session, "what is pi?");
    assert_eq!(result["text"], "done");
    (session, result)
}

/// Sends `said` and waits for the turn, which must complete; its result.
pub fn a_completed_turn(session: &Session, said: &str) -> Value {
    let outcome = wait(&session.send(text(said)).unwrap());
    assert_eq!(
        outcome.outcome,
        brain::OutcomeKind::Completed,
        "{outcome:?}"
    );
    outcome.result.expect("a result")
}
