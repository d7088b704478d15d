//! The Brain arms: callbacks, activations and turns through an embedded Brain, with harness
//! workers that are this binary (`__harness`) or the reference harness.

use crate::Window;
use crate::stats::{Histogram, Trial, unix_nanos};
use brain::cancel::CancelToken;
use brain::effects::{EffectError, Effects, EnvironmentDriver, ScriptedProvider, ToolCall};
use brain::protocol::harness::{
    Block, Message, ModelResult, Role, StopReason, ToolOutcome, ToolResult, Usage, UserInput,
};
use brain::session::CreateSession;
use brain::{Brain, Config, Outcome, OutcomeKind, Registration, Registrations, Session, Storage};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Where things are: this binary (also the bench harness), the reference harness, and the root
/// under which each arm gets a fresh data directory.
#[derive(Clone, Debug)]
pub struct Setup {
    pub exe: PathBuf,
    pub reference: Option<PathBuf>,
    pub root: PathBuf,
}

impl Setup {
    /// This binary, the reference harness beside it (if built), and `root` for data directories.
    pub fn here(root: PathBuf) -> Result<Setup, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let reference = exe
            .parent()
            .map(|dir| dir.join("brain-reference-harness"))
            .filter(|path| path.is_file());
        Ok(Setup {
            exe,
            reference,
            root,
        })
    }
}

/// Which harness serves the sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Harness {
    /// `brain-bench __harness`.
    Bench,
    /// `brain-reference-harness`.
    Reference,
}

/// The registration name of the harness.
fn registration_name(harness: Harness) -> &'static str {
    match harness {
        Harness::Bench => "bench",
        Harness::Reference => "reference",
    }
}

fn registration(setup: &Setup, harness: Harness, workers: u32) -> Result<Registration, String> {
    let registration = match harness {
        Harness::Bench => {
            Registration::new("bench", setup.exe.to_string_lossy()).args(["__harness"])
        }
        Harness::Reference => {
            let path = setup
                .reference
                .as_ref()
                .ok_or("brain-reference-harness was not built beside brain-bench")?;
            Registration::new("reference", path.to_string_lossy())
        }
    };
    Ok(registration.workers(workers).max_concurrency(64))
}

/// A new, empty directory for one trial: `root/name-N`, N counting trials in this run.
///
/// Nothing is deleted until the run ends. ext4 without a journal (this project's benchmark
/// machine) will not reuse an inode freed in the last 60–360 s and scans past every such inode on
/// each allocation, so deleting one trial's thousands of files would slow the next trial's
/// session creations — a cost of the bench's own cleanup, not of Brain.
pub fn trial_dir(root: &Path, name: &str) -> Result<PathBuf, String> {
    static TRIALS: AtomicUsize = AtomicUsize::new(0);
    let n = TRIALS.fetch_add(1, Ordering::Relaxed);
    let dir = root.join(format!("{name}-{n}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    Ok(dir)
}

/// A fresh, empty directory `root/name`.
pub fn fresh_dir(root: &Path, name: &str) -> Result<PathBuf, String> {
    let dir = root.join(name);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(format!("removing {}: {error}", dir.display())),
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    Ok(dir)
}

/// Starts Brain with one registration of `harness` and checks that it is ready.
pub fn start_brain(
    setup: &Setup,
    harness: Harness,
    workers: u32,
    storage: Storage,
    dir: &Path,
    effects: Effects,
) -> Result<Brain, String> {
    let registrations = Registrations::from_vec(vec![registration(setup, harness, workers)?])
        .map_err(|e| e.to_string())?;
    let mut config = Config::new(registrations);
    config.options.data_dir = dir.to_path_buf();
    config.storage = storage;
    config.effects = effects;
    let brain = Brain::start(config).map_err(|e| format!("starting Brain: {e}"))?;
    let ready = brain.wait_for(Duration::from_secs(30), |status| {
        status
            .registration(registration_name(harness))
            .is_some_and(|registration| {
                registration
                    .workers
                    .iter()
                    .all(|w| w.state == brain::WorkerState::Healthy)
            })
    });
    if ready.is_err() {
        brain.shutdown(Duration::ZERO);
        return Err("the workers did not all become healthy".into());
    }
    Ok(brain)
}

/// The journal's records made durable per `fdatasync` so far, from Brain's metrics; `None`
/// without a durable journal (no flush yet).
fn records_per_flush(brain: &Brain) -> Option<f64> {
    let metrics = brain.metrics_text();
    let counter = |name: &str| -> Option<f64> {
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
    };
    let flushes = counter("brain_journal_flushes_total")?;
    let records = counter("brain_journal_records_total")?;
    (flushes > 0.0).then(|| records / flushes)
}

/// Stops Brain. Its data directory stays until the run ends (see [`trial_dir`]).
pub fn finish(brain: Brain) {
    brain.shutdown(Duration::from_secs(5));
}

/// Creates a session from a JSON request.
pub fn create(brain: &Brain, request: &Value) -> Result<Session, String> {
    let request = CreateSession::parse(request.to_string().as_bytes())
        .map_err(|e| format!("create-session request: {}", e.message))?;
    brain
        .create_session(request)
        .map_err(|e| format!("creating a session: {e}"))
}

/// A user input of one text block.
pub fn text(text: impl Into<String>) -> UserInput {
    UserInput {
        content: vec![Block::text(text)],
    }
}

/// The result of a completed activation, or why it did not complete.
pub fn completed(outcome: &Outcome) -> Result<Option<&Value>, String> {
    match outcome.outcome {
        OutcomeKind::Completed => Ok(outcome.result.as_ref()),
        kind => Err(format!(
            "activation {} of {} ended {}: {}",
            outcome.sequence,
            outcome.session_id,
            kind.as_str(),
            outcome
                .error
                .as_ref()
                .map(|e| format!("{}: {}", e.code, e.message))
                .unwrap_or_default()
        )),
    }
}

/// Callbacks in a loop (`mode` `kv` or `model`) from `sessions` sessions on one worker, each with
/// one callback in flight; the latency is measured in the harness around each call.
pub fn callbacks(
    setup: &Setup,
    name: &str,
    mode: &str,
    storage: Storage,
    sessions: usize,
    window: &Window,
) -> Result<Trial, String> {
    let dir = trial_dir(&setup.root, name)?;
    let brain = start_brain(setup, Harness::Bench, 1, storage, &dir, Effects::default())?;
    let result = (|| {
        let request = json!({"agentloop": {"name": "bench", "configuration": {"bench": mode}}});
        let handles = (0..sessions)
            .map(|_| create(&brain, &request))
            .collect::<Result<Vec<_>, _>>()?;
        let start_ns = unix_nanos() + window.warmup.as_nanos() as u64;
        let end_ns = start_ns + window.measure.as_nanos() as u64;
        let plan = json!({"start_ns": start_ns, "end_ns": end_ns}).to_string();
        let activations = handles
            .iter()
            .map(|session| session.send(text(plan.clone())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("send: {e}"))?;
        let mut histogram = Histogram::default();
        let mut late = 0u64;
        for activation in activations {
            let outcome = activation
                .wait_timeout(window.warmup + window.measure + Duration::from_secs(120))
                .ok_or("an activation did not finish")?;
            let result = completed(&outcome)?.ok_or("the harness answered no result")?;
            histogram.merge(&Histogram::from_json(&result["hist"]));
            late = late.max(result["late_ms"].as_u64().unwrap_or(0));
        }
        if late > 50 {
            log::warn!(
                "{name}: a session's first timed callback came {late} ms after the window opened"
            );
        }
        let rate = histogram.count() as f64 / window.measure.as_secs_f64();
        Ok(Trial {
            records_per_flush: records_per_flush(&brain),
            ..Trial::from_histogram(&histogram, rate)
        })
    })();
    finish(brain);
    result
}

/// `run` round trips without callbacks, durable, from `sessions` client threads (one session
/// each) on one worker; the latency is `send` to outcome, measured by the caller.
pub fn activations(
    setup: &Setup,
    name: &str,
    sessions: usize,
    window: &Window,
) -> Result<Trial, String> {
    let dir = trial_dir(&setup.root, name)?;
    let brain = start_brain(
        setup,
        Harness::Bench,
        1,
        Storage::DataDir,
        &dir,
        Effects::default(),
    )?;
    let result = (|| {
        let request = json!({"agentloop": {"name": "bench", "configuration": {"bench": "none"}}});
        let handles = (0..sessions)
            .map(|_| create(&brain, &request))
            .collect::<Result<Vec<_>, _>>()?;
        let (start, end) = window.instants();
        let histogram = run_clients(handles, move |session| {
            let mut histogram = Histogram::default();
            loop {
                let began = Instant::now();
                if began >= end {
                    return Ok(histogram);
                }
                let activation = session.send(text("{}")).map_err(|e| format!("send: {e}"))?;
                completed(&activation.wait())?;
                if began >= start {
                    histogram.record(began.elapsed().as_nanos() as u64);
                }
            }
        })?;
        let rate = histogram.count() as f64 / window.measure.as_secs_f64();
        Ok(Trial {
            records_per_flush: records_per_flush(&brain),
            ..Trial::from_histogram(&histogram, rate)
        })
    })();
    finish(brain);
    result
}

/// Runs `client` on a thread per item and merges their histograms; the first error wins.
fn run_clients<T: Send + 'static>(
    items: Vec<T>,
    client: impl Fn(T) -> Result<Histogram, String> + Send + Sync + Clone + 'static,
) -> Result<Histogram, String> {
    let threads: Vec<_> = items
        .into_iter()
        .map(|item| {
            let client = client.clone();
            std::thread::spawn(move || client(item))
        })
        .collect();
    let mut histogram = Histogram::default();
    let mut failure = None;
    for thread in threads {
        match thread.join() {
            Ok(Ok(mine)) => histogram.merge(&mine),
            Ok(Err(error)) => {
                failure.get_or_insert(error);
            }
            Err(_) => {
                failure.get_or_insert("a client thread panicked".to_owned());
            }
        }
    }
    match failure {
        Some(error) => Err(error),
        None => Ok(histogram),
    }
}

/// An environment driver whose tools answer at once, so that the tool-loop turns measure Brain
/// and not process spawning.
struct InstantDriver;

impl EnvironmentDriver for InstantDriver {
    fn call_tool(&self, call: &ToolCall<'_>, _: &CancelToken) -> Result<ToolResult, EffectError> {
        Ok(ToolResult {
            outcome: ToolOutcome::Ok,
            content: vec![Block::text(format!("{} ok", call.tool))],
            is_error: false,
        })
    }

    fn answers_at_once(&self) -> bool {
        true
    }
}

/// Tool calls per round and rounds with tools per tool-loop turn.
pub const TOOLS_PER_ROUND: usize = 4;
pub const TOOL_ROUNDS: usize = 2;

/// The model results of `turns` tool-loop turns: per turn, [`TOOL_ROUNDS`] answers asking for
/// [`TOOLS_PER_ROUND`] tool calls each, then a text answer.
fn tool_script(turns: usize) -> Vec<ModelResult> {
    let mut script = Vec::new();
    for turn in 0..turns {
        for round in 0..TOOL_ROUNDS {
            let content = (0..TOOLS_PER_ROUND)
                .map(|call| Block::ToolUse {
                    id: format!("tu_{turn}_{round}_{call}"),
                    name: "t".to_owned(),
                    input: json!({"n": call}),
                })
                .collect();
            script.push(ModelResult {
                message: Message {
                    role: Role::Assistant,
                    content,
                },
                stop_reason: StopReason::ToolUse,
                usage: Usage::default(),
                model: None,
            });
        }
        script.push(ModelResult {
            message: Message::text(Role::Assistant, "done"),
            stop_reason: StopReason::EndTurn,
            usage: Usage::default(),
            model: None,
        });
    }
    script
}

/// What a turns arm runs.
#[derive(Clone, Copy, Debug)]
pub struct TurnArm {
    pub harness: Harness,
    /// `None`: text turns (one model call); `Some(driver)`: tool-loop turns with the tools in an
    /// environment of that driver (`bench`: instant, in-process; `local`: a process per call).
    pub tools: Option<&'static str>,
}

/// A Brain for turns of `arm` on two workers, durable, in `dir`, and the request that creates
/// one of its sessions; each session's scripted tool-loop model covers `per_session` turns.
pub fn turn_brain(
    setup: &Setup,
    dir: &Path,
    arm: TurnArm,
    per_session: usize,
) -> Result<(Brain, Value), String> {
    let effects = Effects::default()
        .with_driver("bench", Arc::new(InstantDriver))
        .with_provider(
            "bench-tools",
            Arc::new(ScriptedProvider::with_script(tool_script(per_session))),
        );
    let brain = start_brain(setup, arm.harness, 2, Storage::DataDir, dir, effects)?;
    let configuration = match arm.harness {
        Harness::Bench => json!({"bench": "turn"}),
        Harness::Reference => json!({}),
    };
    let mut request = json!({"agentloop": {
        "name": registration_name(arm.harness), "configuration": configuration,
    }});
    if let Some(driver) = arm.tools {
        let driver_configuration = if driver == "local" {
            json!({"tools": {"t": {"command": ["/bin/echo", "ok"]}}})
        } else {
            json!({})
        };
        request["model"] = json!({"provider": "bench-tools", "name": "bench"});
        request["tools"] = json!([{
            "name": "t", "description": "a tool", "input_schema": {"type": "object"},
            "placements": ["box"],
        }]);
        request["environments"] = json!([{
            "name": "box", "driver": driver, "configuration": driver_configuration,
        }]);
    }
    Ok((brain, request))
}

/// Turns from `sessions` client threads on two workers, durable; each client replaces its
/// session every `per_session` turns so that transcripts stay short. The latency is `send` to
/// outcome.
pub fn turns(
    setup: &Setup,
    name: &str,
    arm: TurnArm,
    sessions: usize,
    per_session: usize,
    window: &Window,
) -> Result<Trial, String> {
    let dir = trial_dir(&setup.root, name)?;
    let (brain, request) = turn_brain(setup, &dir, arm, per_session)?;
    let brain = Arc::new(brain);
    let (start, end) = window.instants();
    let clients = (0..sessions)
        .map(|_| (brain.clone(), request.clone()))
        .collect();
    let result = run_clients(clients, move |(brain, request)| {
        let mut histogram = Histogram::default();
        let mut session: Option<Session> = None;
        let mut done = 0;
        loop {
            if session.is_none() || done == per_session {
                if let Some(old) = session.take() {
                    old.close().map_err(|e| format!("close: {e}"))?;
                }
                session = Some(create(&brain, &request)?);
                done = 0;
            }
            let began = Instant::now();
            if began >= end {
                break;
            }
            let current = session.as_ref().ok_or("no session")?;
            let activation = current
                .send(text("hello"))
                .map_err(|e| format!("send: {e}"))?;
            completed(&activation.wait())?;
            done += 1;
            if began >= start {
                histogram.record(began.elapsed().as_nanos() as u64);
            }
        }
        if let Some(old) = session.take() {
            old.close().map_err(|e| format!("close: {e}"))?;
        }
        Ok(histogram)
    })
    .map(|histogram| {
        let rate = histogram.count() as f64 / window.measure.as_secs_f64();
        Trial {
            records_per_flush: records_per_flush(&brain),
            ..Trial::from_histogram(&histogram, rate)
        }
    });
    match Arc::try_unwrap(brain) {
        Ok(brain) => finish(brain),
        Err(brain) => brain.shutdown(Duration::from_secs(5)),
    }
    result
}
