//! The fault matrix (docs/RELIABILITY.md): every misbehaviour a harness can commit, in each phase
//! where it can happen, against a real Brain with its durable data directory and real harness
//! processes over real pipes.
//!
//! Each row asserts its typed outcome (or worker state) within its deadline. Then, for every row,
//! a well-behaved registration (`good`) running beside the faulty one must still complete an
//! activation, and after a shutdown an independent check reads every journal back from disk: each
//! `activation_queued` has exactly one `activation_finished`, each `*_started` effect exactly one
//! `*_finished` (before its activation's), and every outcome a caller was given is the one recorded.
//!
//! The rows run in one test, a few at a time; `FAULT_MATRIX_ROW=<part of a row id>` runs only the
//! matching ones. Deadlines are short (through [`Options`]) so that the file stays well under a
//! minute on two cores. Nothing sleeps to synchronise: every wait is on a condition, bounded.
//!
//! Misbehaviours the fault harness cannot produce (a duplicate request id, a response to an id that
//! was already answered, garbage in the middle of a run) come from a short `sh` harness
//! defined here ([`SH_HARNESS`]).

mod common;

use brain::cancel::CancelToken;
use brain::effects::{EffectError, Effects, ModelCall, ModelProvider};
use brain::protocol::harness::{Block, Event, ModelResult, UserInput};
use brain::protocol::jsonrpc::Violation;
use brain::status::{FailureReason, WorkerFailure, WorkerStatus};
use brain::worker::process::ExitReason;
use brain::{
    Activation, Brain, Config, Options, Outcome, OutcomeKind, Registration, Registrations, Session,
    SessionStatus, WorkerState,
};
use common::journal::{check_session, read_all};
use common::*;
use serde_json::{Value, json};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The cancel grace of every row: how long Brain waits for `run` after `cancel` before it kills.
const GRACE: Duration = Duration::from_millis(300);

/// Scheduling slack on top of a deadline, for a loaded two-core machine.
const SLACK: Duration = Duration::from_secs(3);

/// How long a well-behaved activation may take while a neighbour misbehaves.
const SERVE: Duration = Duration::from_secs(5);

/// Rows run at once.
const PARALLEL: usize = 3;

/// One row of the matrix. `id` is how docs/RELIABILITY.md names it.
struct Row {
    id: &'static str,
    /// Run the row; returns the rig for the checks every row shares.
    run: fn(&'static str) -> Rig,
}

/// The matrix. Its rows, in this order, are the table in docs/RELIABILITY.md.
const MATRIX: &[Row] = &[
    row("init.never", never_initializes),
    row("init.wrong_protocol", speaks_another_protocol),
    row("init.error", answers_initialize_with_an_error),
    row("crash.initialize", crashes_during_initialize),
    row("crash.idle", crashes_while_idle),
    row("crash.queued", crashes_with_an_activation_queued),
    row("crash.quarantine", crashes_past_the_restart_budget),
    row("crash.running", crashes_while_running),
    row("crash.callback", crashes_inside_a_callback),
    row("crash.after_answer", crashes_after_answering),
    row("late_callback.after_answer", calls_back_after_answering),
    row("garbage.idle", writes_garbage_while_idle),
    row("garbage.limit", writes_garbage_past_the_limit),
    row("garbage.running", writes_garbage_while_running),
    row("overlong.idle", writes_an_overlong_line),
    row("invalid_utf8.idle", writes_invalid_utf8),
    row("invalid_utf8.limit", writes_invalid_utf8_past_the_limit),
    row("unknown_response.idle", answers_an_id_never_sent),
    row("answered_response.idle", answers_an_id_twice),
    row("duplicate_id.callback", reuses_an_outstanding_request_id),
    row("flood.running", floods_stdout),
    row("ignore_cancel.running", ignores_cancel),
    row("ignore_cancel.deadline", ignores_the_cancel_of_a_deadline),
    row("ignore_cancel.shutdown", ignores_cancel_at_shutdown),
    row("ignore_shutdown.shutdown", ignores_shutdown),
    row("outstanding.answer", answers_with_a_callback_outstanding),
    row("malformed.answer", answers_malformed),
    row("fatal_ignored.cancel", ignores_a_fatal_callback_error),
    row("saturate.callback", saturates_its_callbacks),
    row(
        "foreign.other_worker",
        calls_back_for_another_workers_session,
    ),
    row(
        "foreign.other_registration",
        calls_back_for_another_registrations_session,
    ),
    row("foreign.guessed", calls_back_for_a_guessed_session),
    row("foreign.ended", calls_back_for_an_ended_activation),
];

const fn row(id: &'static str, run: fn(&'static str) -> Rig) -> Row {
    Row { id, run }
}

#[test]
fn every_misbehaviour_in_every_phase_ends_in_its_typed_outcome() {
    let filter = std::env::var("FAULT_MATRIX_ROW").ok();
    let rows: Vec<&Row> = MATRIX
        .iter()
        .filter(|row| filter.as_deref().is_none_or(|f| row.id.contains(f)))
        .collect();
    assert!(!rows.is_empty(), "no row matches {filter:?}");
    let next = AtomicUsize::new(0);
    let failures = parking_lot::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..PARALLEL.min(rows.len()) {
            scope.spawn(|| {
                while let Some(row) = rows.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let began = Instant::now();
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        (row.run)(row.id).finish();
                    }));
                    let verdict = if result.is_ok() { "ok" } else { "FAILED" };
                    eprintln!(
                        "fault matrix: {:<28} {:>6} ms  {verdict}",
                        row.id,
                        began.elapsed().as_millis()
                    );
                    if let Err(panic) = result {
                        failures
                            .lock()
                            .push(format!("{}: {}", row.id, panic_text(&*panic)));
                    }
                }
            });
        }
    });
    let failures = failures.into_inner();
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}

#[test]
fn the_reliability_document_names_every_row() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/RELIABILITY.md");
    let document = std::fs::read_to_string(&path).expect("docs/RELIABILITY.md");
    for row in MATRIX {
        assert!(
            document.contains(&format!("`{}`", row.id)),
            "docs/RELIABILITY.md does not name row `{}`",
            row.id
        );
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

// ------------------------------------------------------------------------------------------------
// The rig: a Brain with the faulty registrations and a well-behaved one, `good`.

/// A model provider that answers only when Brain cancels the call (bounded by [`WAIT`]), so that a
/// call to it is certainly in flight while a row does its damage.
struct Blocking;

impl ModelProvider for Blocking {
    fn call(&self, _: &ModelCall<'_>, cancel: &CancelToken) -> Result<ModelResult, EffectError> {
        if cancel.wait_timeout(WAIT) {
            Err(EffectError::Cancelled { sent: true })
        } else {
            Err(EffectError::Unknown {
                message: "the test's blocking provider was never cancelled".to_owned(),
            })
        }
    }
}

/// A model provider that SIGKILLs the process in `target` (the harness waiting for this very
/// call), then blocks like [`Blocking`]: the harness dies inside its callback.
struct Killer {
    target: Arc<AtomicU32>,
}

impl ModelProvider for Killer {
    fn call(&self, call: &ModelCall<'_>, cancel: &CancelToken) -> Result<ModelResult, EffectError> {
        let pid = self.target.load(Ordering::SeqCst);
        assert_ne!(pid, 0, "the killer provider has no target");
        // The target is a child of this test process that Brain has not reaped (it is running):
        // its pid cannot have been reused.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill the harness");
        Blocking.call(call, cancel)
    }
}

struct Rig {
    row: &'static str,
    brain: Brain,
    stopped: Cell<bool>,
    data_dir: PathBuf,
    /// The pid the `killer` provider kills.
    target: Arc<AtomicU32>,
    /// Every outcome a caller was given, to compare with the journal.
    seen: RefCell<Vec<Outcome>>,
    /// How often `good` was seen serving.
    good_served: Cell<usize>,
}

fn text(text: &str) -> UserInput {
    UserInput {
        content: vec![Block::text(text)],
    }
}

impl Rig {
    /// Starts Brain with `faulty` and `good` (the fault harness without faults), the `blocking`
    /// and `killer` model providers, and short deadlines; `tweak` adjusts the options.
    fn start(
        row: &'static str,
        faulty: Vec<Registration>,
        tweak: impl FnOnce(&mut Options),
    ) -> Rig {
        let mut options = fast_options(&row.replace('.', "-"));
        options.cancel_grace = GRACE;
        options.init_deadline = Duration::from_secs(5);
        options.respawn_backoff = Duration::from_millis(20);
        options.respawn_backoff_max = Duration::from_millis(200);
        tweak(&mut options);
        let data_dir = options.data_dir.clone();
        let mut registrations = faulty;
        registrations.push(fault("good", &[]));
        let target = Arc::new(AtomicU32::new(0));
        let mut config =
            Config::new(Registrations::from_vec(registrations).expect("registrations"));
        config.options = options;
        config.effects = Effects::default()
            .with_provider("blocking", Arc::new(Blocking))
            .with_provider(
                "killer",
                Arc::new(Killer {
                    target: target.clone(),
                }),
            );
        let brain =
            Brain::start(config).unwrap_or_else(|error| panic!("{row}: Brain refused: {error}"));
        Rig {
            row,
            brain,
            stopped: Cell::new(false),
            data_dir,
            target,
            seen: RefCell::new(Vec::new()),
            good_served: Cell::new(0),
        }
    }

    fn brain(&self) -> &Brain {
        assert!(!self.stopped.get(), "{}: Brain was shut down", self.row);
        &self.brain
    }

    fn create_body(&self, body: Value) -> Session {
        self.brain()
            .create_session_json(body.to_string().as_bytes())
            .unwrap_or_else(|error| panic!("{}: create {body}: {error}", self.row))
    }

    /// A session of `registration` whose merged configuration is `configuration`.
    fn create(&self, registration: &str, configuration: Value) -> Session {
        self.create_body(
            json!({"agentloop": {"name": registration, "configuration": configuration}}),
        )
    }

    /// Why creating a session of `registration` is refused.
    fn refusal(&self, registration: &str) -> String {
        let body = json!({"agentloop": {"name": registration}}).to_string();
        match self.brain().create_session_json(body.as_bytes()) {
            Ok(session) => panic!("{}: session {} was created", self.row, session.id()),
            Err(error) => error.code.as_str().to_owned(),
        }
    }

    fn send(&self, session: &Session) -> Activation {
        session
            .send(text("go"))
            .unwrap_or_else(|error| panic!("{}: send to {}: {error}", self.row, session.id()))
    }

    /// Waits at most `within` for the outcome, and remembers it for the journal check.
    fn outcome(&self, activation: &Activation, within: Duration) -> Outcome {
        let outcome = activation.wait_timeout(within).unwrap_or_else(|| {
            panic!(
                "{}: activation {} of {} did not end within {within:?}",
                self.row,
                activation.sequence(),
                activation.session_id()
            )
        });
        self.seen.borrow_mut().push(outcome.clone());
        outcome
    }

    /// Waits at most `within` for the outcome and asserts its kind and code.
    fn expect(
        &self,
        activation: &Activation,
        kind: OutcomeKind,
        code: Option<&str>,
        within: Duration,
    ) -> Outcome {
        let outcome = self.outcome(activation, within);
        assert_eq!(outcome.outcome, kind, "{}: {outcome:?}", self.row);
        assert_eq!(
            outcome.error.as_ref().map(|e| e.code.as_str()),
            code,
            "{}: {outcome:?}",
            self.row
        );
        outcome
    }

    /// Blocks (bounded by [`WAIT`]) until the session's journal holds a record of `kind`.
    fn record(&self, session: &Session, kind: &str) {
        session
            .wait_for_events(WAIT, |events| events.iter().any(|e| e.event_type == kind))
            .unwrap_or_else(|_| panic!("{}: no {kind} record in {}", self.row, session.id()));
    }

    fn kinds(&self, session: &Session) -> Vec<String> {
        session
            .events(0, usize::MAX)
            .unwrap_or_else(|error| panic!("{}: events: {error}", self.row))
            .into_iter()
            .map(|e| e.event_type)
            .collect()
    }

    fn status(&self, session: &Session) -> SessionStatus {
        session
            .info()
            .unwrap_or_else(|error| panic!("{}: info: {error}", self.row))
            .status
    }

    fn worker(&self, registration: &str, slot: u32) -> WorkerStatus {
        self.brain
            .status()
            .worker(registration, slot)
            .cloned()
            .unwrap_or_else(|| panic!("{}: no worker {registration}/{slot}", self.row))
    }

    fn pid(&self, registration: &str, slot: u32) -> u32 {
        self.worker(registration, slot)
            .pid
            .unwrap_or_else(|| panic!("{}: {registration}/{slot} runs no process", self.row))
    }

    /// Waits at most `within` until the worker satisfies `done`.
    fn wait_worker(
        &self,
        registration: &str,
        slot: u32,
        within: Duration,
        what: &str,
        mut done: impl FnMut(&WorkerStatus) -> bool,
    ) -> WorkerStatus {
        match self.brain.wait_for(within, |s| {
            s.worker(registration, slot).is_some_and(&mut done)
        }) {
            Ok(status) => status.worker(registration, slot).cloned().unwrap(),
            Err(status) => panic!(
                "{}: {registration}/{slot} not {what} within {within:?}: {:?}",
                self.row,
                status.worker(registration, slot)
            ),
        }
    }

    /// Waits at most `within` for a recorded failure of the worker that satisfies `done`.
    fn wait_failure(
        &self,
        registration: &str,
        slot: u32,
        within: Duration,
        mut done: impl FnMut(&WorkerFailure) -> bool,
    ) -> WorkerFailure {
        self.wait_worker(registration, slot, within, "failed so", |w| {
            w.last_failure.as_ref().is_some_and(&mut done)
        })
        .last_failure
        .unwrap()
    }

    /// Waits until the slot was respawned `restarts` times and is healthy again.
    fn wait_respawned(&self, registration: &str, slot: u32, restarts: u64) -> WorkerStatus {
        self.wait_worker(registration, slot, SLACK, "respawned and healthy", |w| {
            w.restarts == restarts && w.state == WorkerState::Healthy
        })
    }

    /// A fresh echo session of `registration` completes within [`SERVE`].
    fn serves(&self, registration: &str) {
        self.brain()
            .wait_for(SERVE, |s| {
                s.registration(registration).is_some_and(|r| r.available())
            })
            .unwrap_or_else(|s| {
                panic!(
                    "{}: {registration} has no healthy worker: {:?}",
                    self.row,
                    s.registration(registration)
                )
            });
        let session = self.create(registration, json!({}));
        let outcome = self.expect(&self.send(&session), OutcomeKind::Completed, None, SERVE);
        assert_eq!(
            outcome.result.unwrap()["echo"]["input"]["input"]["content"][0]["text"],
            "go",
            "{}",
            self.row
        );
    }

    /// The well-behaved registration beside the faulty one still completes an activation.
    fn good_keeps_serving(&self) {
        self.serves("good");
        self.good_served.set(self.good_served.get() + 1);
    }

    /// Shuts Brain down with `drain` and `grace`; returns how long it took.
    fn shutdown_after(&self, drain: Duration, grace: Duration) -> Duration {
        let began = Instant::now();
        self.brain().shutdown_after(drain, grace);
        self.stopped.set(true);
        began.elapsed()
    }

    /// The checks every row shares: `good` still serves, and after a shutdown every journal on disk
    /// is consistent and agrees with every outcome a caller was given.
    fn finish(self) {
        if !self.stopped.get() {
            self.good_keeps_serving();
            self.shutdown_after(Duration::ZERO, GRACE);
        }
        assert!(
            self.good_served.get() > 0,
            "{}: the row never checked that `good` kept serving",
            self.row
        );
        let Rig {
            row,
            brain,
            data_dir,
            seen,
            ..
        } = self;
        drop(brain);
        check_journals(row, &data_dir, &seen.into_inner());
    }
}

/// Reads every session's journal from disk, independently of the Brain that wrote it, and checks
/// the invariants; then that each outcome a caller saw is the recorded one.
fn check_journals(row: &str, data_dir: &std::path::Path, seen: &[Outcome]) {
    let sessions = read_all(data_dir);
    assert!(!sessions.is_empty(), "{row}: no session was journaled");
    let mut finished: HashMap<(String, u64), (String, Option<String>)> = HashMap::new();
    for (id, records) in &sessions {
        check_session(row, id.as_str(), records);
        for record in records
            .iter()
            .filter(|r| r.event_type == "activation_finished")
        {
            finished.insert(
                (id.to_string(), record.data["activation"].as_u64().unwrap()),
                (
                    record.data["outcome"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    record.data["code"].as_str().map(str::to_owned),
                ),
            );
        }
    }
    for outcome in seen {
        let key = (outcome.session_id.to_string(), outcome.sequence);
        let recorded = finished
            .get(&key)
            .unwrap_or_else(|| panic!("{row}: no activation_finished for {key:?}"));
        let given = (
            outcome.outcome.as_str().to_owned(),
            outcome.error.as_ref().map(|e| e.code.clone()),
        );
        assert_eq!(
            recorded, &given,
            "{row}: {key:?} recorded otherwise than given"
        );
    }
}

fn count(kinds: &[String], kind: &str) -> usize {
    kinds.iter().filter(|k| *k == kind).count()
}

// ------------------------------------------------------------------------------------------------
// A hostile harness in `sh`, for what the fault harness cannot do. `$1` picks the mode:
//
// - `double_init`: answers `initialize` twice (the second answers an id already answered);
// - `duplicate_id`: on `run`, sends the same `brain/call` (a `model` call, id `"dup"`) twice in one
//   write; once cancelled and the first call answered, answers `run` with error `cancelled`;
// - `garbage_in_run`: on `run`, writes ten lines that are not JSON;
// - anything else: answers `run` with `{}`.
//
// It answers `cancel`, `close` and `shutdown` with `{}`, and exits at the end of its stdin.

const SH_HARNESS: &str = r#"
mode=$1
init='{"jsonrpc":"2.0","id":1,"result":{"protocol":"brain/harness/v1","identity":{"name":"sh-harness","version":"1"},"state_version":"1"}}'
IFS= read -r line || exit 0
printf '%s\n' "$init"
if [ "$mode" = double_init ]; then printf '%s\n' "$init"; fi
run= cancelled= answered=
while IFS= read -r line; do
  case $line in *'"id":"dup","result"'*|*'"id":"dup","error"'*) answered=1 ;; esac
  set -- $(printf '%s\n' "$line" | sed -n 's/^{"jsonrpc":"2.0","id":\([0-9][0-9]*\),"method":"\([a-z]*\)".*/\1 \2/p')
  case $2 in
  run)
    run=$1
    target=$(printf '%s\n' "$line" | sed -n 's/.*"params":{"session_id":"\(ses_[0-9A-Za-z]*\)","sequence":\([0-9]*\),.*/"session_id":"\1","sequence":\2/p')
    case $mode in
    duplicate_id)
      call='{"jsonrpc":"2.0","id":"dup","method":"brain/call","params":{'"$target"',"method":"model","input":{"messages":[]}}}'
      printf '%s\n%s\n' "$call" "$call" ;;
    garbage_in_run)
      for i in 0 1 2 3 4 5 6 7 8 9; do printf 'not json %s\n' "$i"; done ;;
    *) printf '{"jsonrpc":"2.0","id":%s,"result":{}}\n' "$1" ;;
    esac ;;
  cancel) cancelled=1; printf '{"jsonrpc":"2.0","id":%s,"result":{}}\n' "$1" ;;
  close|shutdown) printf '{"jsonrpc":"2.0","id":%s,"result":{}}\n' "$1" ;;
  esac
  if [ -n "$cancelled" ] && [ -n "$answered" ] && [ -n "$run" ]; then
    printf '{"jsonrpc":"2.0","id":%s,"error":{"code":-32000,"message":"cancelled","data":{"code":"cancelled"}}}\n' "$run"
    run=
  fi
done
"#;

/// A registration running [`SH_HARNESS`] in `mode`.
fn sh(name: &str, mode: &str) -> Registration {
    Registration::new(name, "sh").args(["-c", SH_HARNESS, "sh-harness", mode])
}

// ------------------------------------------------------------------------------------------------
// Initialize.

fn never_initializes(row: &'static str) -> Rig {
    let deadline = Duration::from_millis(500);
    let began = Instant::now();
    let rig = Rig::start(row, vec![fault("f", &["--never-init"])], |o| {
        o.init_deadline = deadline;
    });
    // Startup waited for the deadline, and no longer.
    let startup = began.elapsed();
    assert!(
        startup >= deadline && startup < deadline + SLACK,
        "{row}: {startup:?}"
    );
    let failure = rig.wait_failure("f", 0, SLACK, |f| f.reason == FailureReason::InitTimeout);
    assert_eq!(failure.reason.code().as_str(), "init_timeout");
    assert!(failure.exit.unwrap().killed_by_brain, "{row}: {failure}");
    assert_eq!(rig.refusal("f"), "agentloop_unavailable");
    rig
}

fn speaks_another_protocol(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &["--wrong-protocol"])], |_| {});
    let failure = rig.wait_failure("f", 0, SLACK, |f| {
        f.reason == FailureReason::WrongProtocol("brain/harness/v0".into())
    });
    assert_eq!(failure.reason.code().as_str(), "invalid_response");
    assert!(failure.exit.unwrap().killed_by_brain, "{row}: {failure}");
    assert_eq!(rig.refusal("f"), "agentloop_unavailable");
    rig
}

fn answers_initialize_with_an_error(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &["--init-error"])], |_| {});
    let failure = rig.wait_failure("f", 0, SLACK, |f| {
        matches!(f.reason, FailureReason::InitError(_))
    });
    assert_eq!(failure.reason.code().as_str(), "invalid_response");
    assert_eq!(rig.refusal("f"), "agentloop_unavailable");
    rig
}

// ------------------------------------------------------------------------------------------------
// Crashes.

fn crashes_during_initialize(row: &'static str) -> Rig {
    let began = Instant::now();
    let rig = Rig::start(
        row,
        vec![fault(
            "f",
            &["--init-delay-ms", "60000", "--crash-after-ms", "50"],
        )],
        |_| {},
    );
    // Startup saw the exit; it did not wait for the 5 s initialize deadline.
    let startup = began.elapsed();
    assert!(startup < Duration::from_secs(5), "{row}: {startup:?}");
    let failure = rig.wait_failure("f", 0, SLACK, |f| f.reason == FailureReason::Exited);
    assert_eq!(failure.reason.code().as_str(), "worker_lost");
    let exit = failure.exit.unwrap();
    assert_eq!(exit.reason, ExitReason::Code(3), "{row}: {failure}");
    assert!(!exit.killed_by_brain);
    assert!(
        failure.stderr_tail.contains("crashing with status 3"),
        "{row}: {failure}"
    );
    rig
}

fn crashes_while_idle(row: &'static str) -> Rig {
    let marker = temp_dir("matrix-crash-idle").join("crashed");
    let marker = marker.to_string_lossy().into_owned();
    let rig = Rig::start(
        row,
        vec![fault(
            "f",
            &["--crash-after-ms", "300", "--crash-once", &marker],
        )],
        |_| {},
    );
    let first = rig.pid("f", 0);
    let worker = rig.wait_respawned("f", 0, 1);
    let failure = worker.last_failure.unwrap();
    assert_eq!(failure.reason, FailureReason::Exited);
    assert_eq!(failure.exit.unwrap().reason, ExitReason::Code(3));
    assert_ne!(worker.pid, Some(first));
    assert_eq!(
        proc_state(first),
        None,
        "{row}: the crashed harness was not reaped"
    );
    rig.serves("f");
    rig
}

fn crashes_with_an_activation_queued(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[]).max_concurrency(1)], |_| {});
    let crasher = rig.create("f", json!({"fault": "crash"}));
    let patient = rig.create("f", json!({}));
    let crashed = rig.send(&crasher);
    let queued = rig.send(&patient);
    rig.expect(&crashed, OutcomeKind::Failed, Some("worker_lost"), SLACK);
    // The queued activation waited for the respawn and ran on the new process.
    rig.expect(&queued, OutcomeKind::Completed, None, SLACK);
    assert_eq!(rig.status(&crasher), SessionStatus::Interrupted);
    assert_eq!(rig.status(&patient), SessionStatus::Open);
    assert_eq!(rig.worker("f", 0).restarts, 1);
    rig
}

fn crashes_past_the_restart_budget(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[]).max_concurrency(1)], |o| {
        o.restart_budget = 0;
    });
    let crasher = rig.create("f", json!({"fault": "hang", "announce": true}));
    let patient = rig.create("f", json!({}));
    let crashed = rig.send(&crasher);
    rig.record(&crasher, "event_emitted");
    let queued = rig.send(&patient);
    // The worker dies with the patient queued behind the running activation (killed here, not
    // crashing by itself, so that the patient is surely queued before the slot is quarantined).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(rig.pid("f", 0) as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the harness");
    rig.expect(&crashed, OutcomeKind::Failed, Some("worker_lost"), SLACK);
    // The slot is quarantined at its first failure: what waited for it fails, never started.
    rig.expect(
        &queued,
        OutcomeKind::Failed,
        Some("agentloop_unavailable"),
        SLACK,
    );
    assert!(
        !rig.kinds(&patient)
            .contains(&"activation_started".to_owned())
    );
    assert_eq!(rig.status(&patient), SessionStatus::Open);
    assert_eq!(rig.worker("f", 0).state, WorkerState::Quarantined);
    let refused = patient.send(text("again")).unwrap_err();
    assert_eq!(refused.code.as_str(), "agentloop_unavailable");
    assert_eq!(rig.refusal("f"), "agentloop_unavailable");
    rig
}

fn crashes_while_running(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let neighbour = rig.create("f", json!({"fault": "hang", "announce": true}));
    let crasher = rig.create("f", json!({"fault": "crash"}));
    let running = rig.send(&neighbour);
    rig.record(&neighbour, "event_emitted");
    let crashed = rig.send(&crasher);
    rig.expect(&crashed, OutcomeKind::Failed, Some("worker_lost"), SLACK);
    rig.expect(&running, OutcomeKind::Failed, Some("worker_lost"), SLACK);
    for session in [&neighbour, &crasher] {
        assert_eq!(rig.status(session), SessionStatus::Interrupted);
        let refused = session.send(text("again")).unwrap_err();
        assert_eq!(refused.code.as_str(), "session_interrupted");
    }
    let failure = rig.worker("f", 0).last_failure.unwrap();
    assert_eq!(failure.exit.unwrap().reason, ExitReason::Code(4));
    rig.wait_respawned("f", 0, 1);
    rig.serves("f");
    rig
}

fn crashes_inside_a_callback(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let session = rig.create_body(json!({
        "agentloop": {"name": "f", "configuration": {"fault": "calls",
            "calls": [{"method": "model", "input": {"messages": []}}]}},
        "model": {"provider": "killer", "name": "k"}
    }));
    rig.target.store(rig.pid("f", 0), Ordering::SeqCst);
    let activation = rig.send(&session);
    rig.expect(&activation, OutcomeKind::Failed, Some("worker_lost"), SLACK);
    let failure = rig.worker("f", 0).last_failure.unwrap();
    let exit = failure.exit.unwrap();
    assert_eq!(exit.reason, ExitReason::Signal(9), "{row}: {failure}");
    assert!(!exit.killed_by_brain);
    // The call the harness died in still got its one finished record, before the outcome.
    let events = session.events(0, usize::MAX).unwrap();
    let finished: Vec<&Event> = events
        .iter()
        .filter(|e| e.event_type == "model_call_finished")
        .collect();
    assert_eq!(finished.len(), 1, "{row}: {events:?}");
    assert_eq!(finished[0].data["outcome"], "unknown", "{row}: {events:?}");
    // It names the started record it finishes.
    let started = events
        .iter()
        .find(|e| e.event_type == "model_call_started")
        .map(|e| e.sequence);
    assert_eq!(
        finished[0].data["started"].as_u64(),
        started,
        "{row}: {events:?}"
    );
    assert_eq!(rig.status(&session), SessionStatus::Interrupted);
    rig.wait_respawned("f", 0, 1);
    rig.serves("f");
    rig
}

fn crashes_after_answering(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let session = rig.create("f", json!({}));
    rig.expect(&rig.send(&session), OutcomeKind::Completed, None, SERVE);
    let pid = rig.pid("f", 0);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the harness");
    let worker = rig.wait_respawned("f", 0, 1);
    let exit = worker.last_failure.unwrap().exit.unwrap();
    assert_eq!(exit.reason, ExitReason::Signal(9));
    assert!(!exit.killed_by_brain);
    // A completed activation is settled: the session is open and goes on on the new process.
    let info = session.info().unwrap();
    assert_eq!((info.status, info.marker), (SessionStatus::Open, None));
    rig.expect(&rig.send(&session), OutcomeKind::Completed, None, SERVE);
    rig
}

fn calls_back_after_answering(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let session = rig.create(
        "f",
        json!({"fault": "callback_after_answer", "exit_with_answer": true}),
    );
    rig.expect(&rig.send(&session), OutcomeKind::Completed, None, SERVE);
    // The harness exits 5 when its late callback was refused `activation_closed`.
    let failure = rig.wait_failure("f", 0, SLACK, |f| f.reason == FailureReason::Exited);
    assert_eq!(
        failure.exit.unwrap().reason,
        ExitReason::Code(5),
        "{row}: {failure}"
    );
    let kinds = rig.kinds(&session);
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("activation_finished")
    );
    assert_eq!(kinds.len(), 4, "{row}: the late callback wrote {kinds:?}");
    assert_eq!(rig.status(&session), SessionStatus::Open);
    rig.wait_respawned("f", 0, 1);
    rig
}

// ------------------------------------------------------------------------------------------------
// Framing violations.

/// Waits until the worker counted exactly `violations`, and checks it stays healthy and serving.
fn counts_and_keeps_serving(rig: &Rig, violations: u64) {
    rig.wait_worker("f", 0, SLACK, &format!("at {violations} violations"), |w| {
        w.violations == violations
    });
    rig.serves("f");
    let worker = rig.worker("f", 0);
    assert_eq!(worker.violations, violations, "{}", rig.row);
    assert_eq!(
        (worker.state, worker.restarts),
        (WorkerState::Healthy, 0),
        "{}",
        rig.row
    );
}

fn writes_garbage_while_idle(row: &'static str) -> Rig {
    // The first four kinds: not JSON, an array, a number, an object without "jsonrpc".
    let rig = Rig::start(row, vec![fault("f", &["--garbage", "4"])], |_| {});
    counts_and_keeps_serving(&rig, 4);
    rig
}

fn writes_garbage_past_the_limit(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &["--garbage", "12"])], |_| {});
    let failure = rig.wait_failure("f", 0, SLACK, |f| {
        matches!(f.reason, FailureReason::Faulty(_))
    });
    assert_eq!(failure.reason.code().as_str(), "worker_lost");
    assert!(failure.exit.unwrap().killed_by_brain, "{row}: {failure}");
    rig
}

fn writes_garbage_while_running(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![sh("f", "garbage_in_run")], |_| {});
    let session = rig.create("f", json!({}));
    let activation = rig.send(&session);
    rig.expect(&activation, OutcomeKind::Failed, Some("worker_lost"), SLACK);
    let failure = rig.worker("f", 0).last_failure.unwrap();
    assert_eq!(
        failure.reason,
        FailureReason::Faulty(Violation::InvalidJson),
        "{row}: {failure}"
    );
    assert!(failure.exit.unwrap().killed_by_brain);
    assert_eq!(rig.status(&session), SessionStatus::Interrupted);
    rig
}

fn writes_an_overlong_line(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &["--overlong", "1048576"])], |o| {
        o.max_line_bytes = 64 * 1024;
    });
    counts_and_keeps_serving(&rig, 1);
    rig
}

fn writes_invalid_utf8(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &["--invalid-utf8", "3"])], |_| {});
    counts_and_keeps_serving(&rig, 3);
    rig
}

fn writes_invalid_utf8_past_the_limit(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &["--invalid-utf8", "10"])], |_| {});
    let failure = rig.wait_failure("f", 0, SLACK, |f| {
        f.reason == FailureReason::Faulty(Violation::InvalidUtf8)
    });
    assert!(failure.exit.unwrap().killed_by_brain, "{row}: {failure}");
    rig
}

fn answers_an_id_never_sent(row: &'static str) -> Rig {
    // The fifth kind of garbage is a response to id 999999, which Brain never sent: one more
    // violation than `garbage.idle`.
    let rig = Rig::start(row, vec![fault("f", &["--garbage", "5"])], |_| {});
    counts_and_keeps_serving(&rig, 5);
    rig
}

fn answers_an_id_twice(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![sh("f", "double_init")], |_| {});
    let worker = rig.wait_worker("f", 0, SLACK, "at one violation", |w| w.violations == 1);
    assert_eq!((worker.state, worker.restarts), (WorkerState::Healthy, 0));
    // Still serving: the sh harness answers `run` with `{}`.
    let session = rig.create("f", json!({}));
    rig.expect(&rig.send(&session), OutcomeKind::Completed, None, SERVE);
    assert_eq!(rig.worker("f", 0).violations, 1);
    rig
}

fn reuses_an_outstanding_request_id(row: &'static str) -> Rig {
    // A well-behaved answer to the cancel is expected here, not a kill: on a loaded host a shell
    // harness may take longer than the matrix's short grace to write it.
    let rig = Rig::start(row, vec![sh("f", "duplicate_id")], |options| {
        options.cancel_grace = SLACK;
    });
    let session = rig.create_body(json!({
        "agentloop": {"name": "f"}, "model": {"provider": "blocking", "name": "b"}
    }));
    let activation = rig.send(&session);
    // The second request with the outstanding id is a violation; the first runs unaffected.
    rig.wait_worker("f", 0, SLACK, "at one violation", |w| w.violations == 1);
    rig.record(&session, "model_call_started");
    session.cancel().unwrap();
    rig.expect(
        &activation,
        OutcomeKind::Cancelled,
        Some("cancelled"),
        GRACE + SLACK,
    );
    let kinds = rig.kinds(&session);
    assert_eq!(count(&kinds, "model_call_started"), 1, "{row}: {kinds:?}");
    assert_eq!(count(&kinds, "model_call_finished"), 1, "{row}: {kinds:?}");
    let worker = rig.worker("f", 0);
    assert_eq!((worker.state, worker.violations), (WorkerState::Healthy, 1));
    rig
}

fn floods_stdout(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &["--flood"])], |_| {});
    // The flooding worker's own activations still get through.
    let session = rig.create("f", json!({}));
    rig.expect(&rig.send(&session), OutcomeKind::Completed, None, SERVE);
    // Deadlines and cancels on the other registration are served promptly.
    let timed = rig.create("good", json!({"fault": "hang"}));
    let deadline = Duration::from_millis(300);
    let began = Instant::now();
    let activation = timed.send_with_deadline(text("slow"), deadline).unwrap();
    rig.expect(
        &activation,
        OutcomeKind::Failed,
        Some("deadline_exceeded"),
        deadline + SLACK,
    );
    assert!(began.elapsed() >= deadline, "{row}: {:?}", began.elapsed());
    let worker = rig.worker("f", 0);
    assert_eq!(
        (worker.state, worker.violations, worker.restarts),
        (WorkerState::Healthy, 0, 0),
        "{row}: notifications are not violations"
    );
    rig
}

// ------------------------------------------------------------------------------------------------
// Cancel and shutdown.

fn ignores_cancel(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let stubborn = rig.create("f", json!({"fault": "ignore_cancel", "announce": true}));
    let neighbour = rig.create("f", json!({"fault": "hang", "announce": true}));
    let doomed = rig.send(&stubborn);
    let collateral = rig.send(&neighbour);
    rig.record(&stubborn, "event_emitted");
    rig.record(&neighbour, "event_emitted");
    let pid = rig.pid("f", 0);
    let began = Instant::now();
    assert!(stubborn.cancel().unwrap().was_running);
    rig.expect(
        &doomed,
        OutcomeKind::Cancelled,
        Some("cancelled"),
        GRACE + SLACK,
    );
    assert!(began.elapsed() >= GRACE, "{row}: killed before the grace");
    rig.expect(&collateral, OutcomeKind::Failed, Some("worker_lost"), SLACK);
    let failure = rig.worker("f", 0).last_failure.unwrap();
    assert!(
        matches!(failure.reason, FailureReason::Killed(_)),
        "{row}: {failure}"
    );
    assert!(failure.exit.unwrap().killed_by_brain);
    rig.wait_respawned("f", 0, 1);
    assert_eq!(
        proc_state(pid),
        None,
        "{row}: the killed harness was not reaped"
    );
    rig.serves("f");
    rig
}

fn ignores_the_cancel_of_a_deadline(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let session = rig.create("f", json!({"fault": "ignore_cancel"}));
    let deadline = Duration::from_millis(200);
    let activation = session.send_with_deadline(text("x"), deadline).unwrap();
    rig.expect(
        &activation,
        OutcomeKind::Failed,
        Some("deadline_exceeded"),
        deadline + GRACE + SLACK,
    );
    let failure = rig.wait_failure("f", 0, SLACK, |f| {
        matches!(f.reason, FailureReason::Killed(_))
    });
    assert!(failure.exit.unwrap().killed_by_brain);
    rig.wait_respawned("f", 0, 1);
    rig
}

fn ignores_cancel_at_shutdown(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    rig.good_keeps_serving();
    let session = rig.create("f", json!({"fault": "ignore_cancel", "announce": true}));
    let activation = rig.send(&session);
    rig.record(&session, "event_emitted");
    let pid = rig.pid("f", 0);
    let drain = Duration::from_millis(200);
    let took = rig.shutdown_after(drain, GRACE);
    // The drain, then the cancel grace, then the kill; the shutdown grace is not needed.
    assert!(took >= drain + GRACE, "{row}: {took:?}");
    assert!(took < drain + GRACE + GRACE + SLACK, "{row}: {took:?}");
    rig.expect(
        &activation,
        OutcomeKind::Cancelled,
        Some("cancelled"),
        Duration::ZERO,
    );
    assert_eq!(proc_state(pid), None, "{row}: the harness was not reaped");
    rig
}

fn ignores_shutdown(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &["--ignore-shutdown"])], |_| {});
    rig.good_keeps_serving();
    let pid = rig.pid("f", 0);
    let good = rig.pid("good", 0);
    let took = rig.shutdown_after(Duration::ZERO, GRACE);
    assert!(took >= GRACE && took < GRACE + SLACK, "{row}: {took:?}");
    for pid in [pid, good] {
        assert_eq!(proc_state(pid), None, "{row}: {pid} was not reaped");
    }
    let status = rig.brain.status();
    for registration in ["f", "good"] {
        let worker = status.worker(registration, 0).unwrap();
        assert_eq!(worker.state, WorkerState::Stopped, "{row}: {worker:?}");
        assert!(worker.last_failure.is_none(), "{row}: {worker:?}");
    }
    rig
}

// ------------------------------------------------------------------------------------------------
// Answers.

fn answers_with_a_callback_outstanding(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let session = rig.create_body(json!({
        "agentloop": {"name": "f", "configuration": {"fault": "callbacks_outstanding",
            "call": {"method": "model", "input": {"messages": []}}}},
        "model": {"provider": "blocking", "name": "b"}
    }));
    let activation = rig.send(&session);
    rig.expect(
        &activation,
        OutcomeKind::Failed,
        Some("callbacks_outstanding"),
        SLACK,
    );
    let kinds = rig.kinds(&session);
    assert_eq!(count(&kinds, "model_call_finished"), 1, "{row}: {kinds:?}");
    assert_eq!(rig.status(&session), SessionStatus::Interrupted);
    assert_eq!(
        rig.worker("f", 0).restarts,
        0,
        "{row}: the worker is not at fault"
    );
    rig
}

fn answers_malformed(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let session = rig.create("f", json!({"fault": "malformed"}));
    let activation = rig.send(&session);
    rig.expect(
        &activation,
        OutcomeKind::Failed,
        Some("invalid_response"),
        SLACK,
    );
    assert_eq!(rig.status(&session), SessionStatus::Interrupted);
    rig.serves("f");
    rig
}

fn ignores_a_fatal_callback_error(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let session = rig.create(
        "f",
        json!({"fault": "fatal_then_succeed", "after_cancel": true, "announce": true}),
    );
    let activation = rig.send(&session);
    rig.record(&session, "event_emitted");
    session.cancel().unwrap();
    // The harness swallowed the fatal `cancelled` of its model call and answered a result.
    let outcome = rig.expect(
        &activation,
        OutcomeKind::Cancelled,
        Some("cancelled"),
        SLACK,
    );
    assert_eq!(outcome.result, None);
    assert_eq!(count(&rig.kinds(&session), "model_call_started"), 0);
    rig
}

fn saturates_its_callbacks(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let session = rig.create_body(json!({
        "agentloop": {"name": "f", "configuration": {"fault": "saturate"}},
        "model": {"provider": "blocking", "name": "b"}
    }));
    let activation = rig.send(&session);
    // The harness exits 7 once its 65th unanswered callback was refused `overloaded`.
    rig.expect(&activation, OutcomeKind::Failed, Some("worker_lost"), SLACK);
    let failure = rig.worker("f", 0).last_failure.unwrap();
    assert_eq!(
        failure.exit.unwrap().reason,
        ExitReason::Code(7),
        "{row}: {failure}"
    );
    let kinds = rig.kinds(&session);
    assert_eq!(count(&kinds, "model_call_started"), 64, "{row}");
    assert_eq!(count(&kinds, "model_call_finished"), 64, "{row}");
    rig
}

// ------------------------------------------------------------------------------------------------
// Authority.

fn foreign(target: &Session, sequence: u64) -> Value {
    json!({"fault": "foreign_callback", "target_session": target.id(), "target_sequence": sequence})
}

/// Runs the attacker's activation; returns Brain's error code for its foreign `kv.put`.
fn attack(rig: &Rig, attacker: &Session) -> String {
    let outcome = rig.expect(&rig.send(attacker), OutcomeKind::Completed, None, SERVE);
    outcome.result.unwrap()["error"]
        .as_str()
        .unwrap_or("<none: the callback succeeded>")
        .to_owned()
}

/// The victim's journal is exactly what it was: no record (so no kv entry, no effect).
fn untouched(rig: &Rig, victim: &Session, before: &[String]) {
    assert_eq!(
        &rig.kinds(victim),
        before,
        "{}: a record was written",
        rig.row
    );
}

/// A victim running `hang` on `registration`; returns it, its activation and its records.
fn running_victim(rig: &Rig, registration: &str) -> (Session, Activation, Vec<String>) {
    let victim = rig.create(registration, json!({"fault": "hang", "announce": true}));
    let activation = rig.send(&victim);
    rig.record(&victim, "event_emitted");
    let before = rig.kinds(&victim);
    (victim, activation, before)
}

/// Cancels the victim's activation, which then ends `cancelled` as usual.
fn release(rig: &Rig, victim: &Session, activation: &Activation) {
    victim.cancel().unwrap();
    rig.expect(activation, OutcomeKind::Cancelled, Some("cancelled"), SLACK);
}

fn calls_back_for_another_workers_session(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[]).workers(2)], |_| {});
    let (victim, running, before) = running_victim(&rig, "f");
    let attacker = rig.create("f", foreign(&victim, running.sequence()));
    assert_eq!(victim.info().unwrap().worker, 0);
    assert_eq!(attacker.info().unwrap().worker, 1);
    assert_eq!(attack(&rig, &attacker), "activation_not_active");
    untouched(&rig, &victim, &before);
    release(&rig, &victim, &running);
    rig
}

fn calls_back_for_another_registrations_session(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let (victim, running, before) = running_victim(&rig, "good");
    let attacker = rig.create("f", foreign(&victim, running.sequence()));
    assert_eq!(attack(&rig, &attacker), "activation_not_active");
    untouched(&rig, &victim, &before);
    release(&rig, &victim, &running);
    rig
}

fn calls_back_for_a_guessed_session(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let guessed = json!({"fault": "foreign_callback",
        "target_session": "ses_00000000000000000000", "target_sequence": 2});
    let attacker = rig.create("f", guessed);
    assert_eq!(attack(&rig, &attacker), "activation_not_active");
    rig
}

fn calls_back_for_an_ended_activation(row: &'static str) -> Rig {
    let rig = Rig::start(row, vec![fault("f", &[])], |_| {});
    let (victim, running, before) = running_victim(&rig, "f");
    release(&rig, &victim, &running);
    let mut before = before;
    before.push("activation_finished".to_owned());
    // From the victim's own worker, after the victim's activation ended: its authority is closed.
    let attacker = rig.create("f", foreign(&victim, running.sequence()));
    assert_eq!(attack(&rig, &attacker), "activation_closed");
    untouched(&rig, &victim, &before);
    rig
}
