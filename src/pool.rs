//! The worker pool: every slot's state machine, owned by the dispatcher thread.
//!
//! Nothing here is shared. The dispatcher calls into [`Pool`] for each event it receives (a worker
//! message, a worker's exit, a due deadline, a command) and the pool publishes a fresh
//! [`PoolStatus`] after each change.
//!
//! A slot moves `Starting → Healthy` when its `initialize` answer is accepted. Any failure moves it
//! to `Failed`: the process group is killed (if it still runs), and when the waiter reports the exit
//! the failure is recorded, every request still pending on the worker fails with the exit status,
//! and the slot is respawned after a backoff — or `Quarantined` when it failed more than the budget
//! allows within the window, or changed identity. Shutdown moves slots to `Stopping → Stopped`
//! without counting anything against them.

use crate::capacity::CapacityQueue;
use crate::config::Registration;
use crate::datadir::DataDir;
use crate::options::Options;
use crate::protocol::harness::{
    self, BrainCall, BrainInfo, InitializeParams, InitializeResult, PROTOCOL, ShutdownParams,
};
use crate::protocol::jsonrpc::{self, Message, Request, RequestId, Response, RpcError, Violation};
use crate::session::SessionId;
use crate::sessions::QueueEntry;
use crate::status::{
    FailureReason, PoolStatus, RegistrationStatus, StatusBoard, WorkerFailure, WorkerState,
    WorkerStatus,
};
use crate::timer::Timer;
use crate::worker::process::{Exit, SpawnSpec};
use crate::worker::violations::ViolationWindow;
use crate::worker::{self, Running, WorkerEvent, WorkerKey, WorkerLabel};
use crossbeam_channel::Sender;
use serde_json::Value;
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long after stdout closes Brain waits for the process to exit on its own before killing it.
/// The exit status is the better report, and it usually arrives within microseconds.
const STDOUT_CLOSED_GRACE: Duration = Duration::from_secs(1);

/// Deadlines set on the timer thread: the pool's own, and the session layer's.
#[derive(Debug, Clone)]
pub(crate) enum Deadline {
    /// `cancel` was sent this long ago; kill the worker if `run` is still unanswered.
    CancelGrace { session: SessionId, sequence: u64 },
    /// A fatal callback error was answered this long ago; kill the worker if `run` is still
    /// unanswered.
    FatalGrace { session: SessionId, sequence: u64 },
    /// The activation's wall deadline.
    Wall { session: SessionId, sequence: u64 },
    /// Shutdown waited long enough for running activations; stop the workers now.
    ShutdownProceed,
    /// The shutdown drain window is over: cancel what still runs.
    DrainExpired,
    /// The worker must have answered `initialize` by now.
    Initialize(WorkerKey),
    /// Stdout closed this long ago and the process has not exited: kill it.
    StdoutClosed(WorkerKey),
    /// Respawn a failed slot; `generation` is the incarnation that failed.
    Respawn(WorkerKey),
    /// `shutdown` was sent this long ago: kill whatever is left.
    ShutdownKill(WorkerKey),
    /// Sessions were made dormant or deleted a moment ago: give the memory they freed back.
    TrimHeap,
}

/// A request Brain sent to a worker and still waits for.
#[derive(Debug)]
pub(crate) enum Pending {
    /// The worker's `initialize`.
    Initialize,
    /// The worker's `shutdown`.
    Shutdown,
    /// A request on behalf of a session; its answer goes to the session layer.
    Session(SessionRequest),
}

/// Session-level requests to a worker, named so their answers can be routed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SessionRequest {
    /// `run` of this activation.
    Run { session: SessionId, sequence: u64 },
    /// `cancel` of this activation.
    Cancel { session: SessionId, sequence: u64 },
    /// `close` of this session.
    Close { session: SessionId },
}

/// What the pool tells the session layer after handling an event.
#[derive(Debug)]
pub(crate) enum Happening {
    /// A harness request (not a duplicate) to be answered with [`Pool::answer`].
    Request { key: WorkerKey, request: Request },
    /// A `brain/call` (not a duplicate) typed by the reader thread, to be answered with
    /// [`Pool::answer`].
    Call {
        key: WorkerKey,
        id: RequestId,
        call: BrainCall,
    },
    /// A session request was answered.
    Answered {
        key: WorkerKey,
        request: SessionRequest,
        outcome: Result<Value, RpcError>,
    },
    /// The worker is gone; these session requests will never be answered.
    Lost {
        key: WorkerKey,
        failure: WorkerFailure,
        unanswered: Vec<SessionRequest>,
    },
    /// The slot's state changed (healthy, failed, quarantined, stopping, stopped).
    SlotState {
        registration: usize,
        slot: u32,
        state: WorkerState,
    },
}

/// Registration-level facts fixed by the first initialize answers.
#[derive(Debug)]
struct RegistrationState {
    registration: Registration,
    program: PathBuf,
    state_root: PathBuf,
    slots: Vec<Slot>,
    /// The declarations every worker of this registration must repeat; set at startup, or by the
    /// first worker to become healthy after it.
    agreed: Option<InitializeResult>,
}

/// A slot's capacity queue, which also carries the lines for its process's stdin.
pub(crate) type SlotQueue = Arc<CapacityQueue<QueueEntry>>;

#[derive(Debug)]
struct Slot {
    index: u32,
    queue: SlotQueue,
    state: WorkerState,
    generation: u64,
    live: Option<Live>,
    /// Failures within the restart window, oldest first.
    failures: VecDeque<Instant>,
    restarts: u64,
    last_failure: Option<WorkerFailure>,
    initialized: Option<InitializeResult>,
    init_latency: Option<Duration>,
    /// Whether the slot's first spawn has come to an answer or a failure (startup waits for it).
    settled: bool,
    /// What was last published of the slot, and its last failure (its state also serves the
    /// change notices).
    shown: Option<(Shown, Option<WorkerFailure>)>,
}

/// The parts of a slot's status that a worker event may change, as last published with its last
/// failure. Publishing rebuilds the whole status, with a copy of each worker's `initialize`
/// answer; most worker events, every callback among them, change none of these parts, and then
/// there is nothing to publish.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shown {
    state: WorkerState,
    generation: u64,
    pid: Option<u32>,
    restarts: u64,
    initialized: bool,
    violations: u64,
}

impl Slot {
    fn pid(&self) -> Option<u32> {
        self.live.as_ref().map(|l| l.running.process.pid())
    }

    fn violations(&self) -> u64 {
        self.live.as_ref().map_or(0, |l| l.violations.total())
    }

    /// What the slot would publish now (its last failure by reference).
    fn showing(&self) -> (Shown, Option<&WorkerFailure>) {
        let shown = Shown {
            state: self.state,
            generation: self.generation,
            pid: self.pid(),
            restarts: self.restarts,
            initialized: self.initialized.is_some(),
            violations: self.violations(),
        };
        (shown, self.last_failure.as_ref())
    }

    /// Whether the slot's status is still what was last published.
    fn shows_as_published(&self) -> bool {
        self.shown
            .as_ref()
            .is_some_and(|(shown, failure)| (*shown, failure.as_ref()) == self.showing())
    }
}

#[derive(Debug)]
struct Live {
    running: Running,
    spawned_at: Instant,
    next_id: i64,
    pending: HashMap<i64, Pending>,
    /// Ids of the harness's requests that Brain has not answered yet.
    incoming: HashSet<RequestId>,
    /// Set once the slot is being taken down: why.
    failing: Option<FailureReason>,
    violations: ViolationWindow,
}

/// The outcome of startup: `Ok` once every slot settled and the declarations agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StartupRefusal {
    /// Two healthy workers of one registration declared different things.
    Disagreement {
        registration: String,
        detail: String,
    },
    /// The deployment configuration has a key the harness does not declare.
    UndeclaredKey { registration: String, key: String },
    /// The workers' identity differs from the one bound to the data directory (or binding it
    /// failed).
    Binding {
        registration: String,
        detail: String,
    },
}

pub(crate) struct Pool {
    registrations: Vec<RegistrationState>,
    options: Options,
    events: Sender<(WorkerKey, WorkerEvent)>,
    timer: Timer<Deadline>,
    board: Arc<StatusBoard>,
    base_env: Vec<(String, String)>,
    shutting_down: bool,
    /// `shutting_down` as last published; `None` before the first publish.
    shown_shutting_down: Option<bool>,
    started: bool,
    jitter: Jitter,
    happenings: Vec<Happening>,
    /// The data directory identities are bound to; `None` when nothing is written (ephemeral).
    datadir: Option<Arc<DataDir>>,
    /// Runs the workers of `"sandbox": true` registrations; present when any exists.
    bubblewrap: Option<crate::sandbox::Bubblewrap>,
}

impl Pool {
    pub(crate) fn new(
        registrations: Vec<(Registration, PathBuf, Vec<SlotQueue>)>,
        options: Options,
        events: Sender<(WorkerKey, WorkerEvent)>,
        timer: Timer<Deadline>,
        board: Arc<StatusBoard>,
        datadir: Option<Arc<DataDir>>,
    ) -> Pool {
        let registrations = registrations
            .into_iter()
            .map(|(registration, program, queues)| RegistrationState {
                state_root: options.data_dir.join("agentloops").join(&registration.name),
                slots: queues
                    .iter()
                    .zip(0..registration.workers)
                    .map(|(queue, index)| Slot {
                        index,
                        queue: queue.clone(),
                        state: WorkerState::Starting,
                        generation: 0,
                        live: None,
                        failures: VecDeque::new(),
                        restarts: 0,
                        last_failure: None,
                        initialized: None,
                        init_latency: None,
                        settled: false,
                        shown: None,
                    })
                    .collect(),
                registration,
                program,
                agreed: None,
            })
            .collect();
        Pool {
            registrations,
            options,
            events,
            timer,
            board,
            base_env: inherited_env(),
            shutting_down: false,
            shown_shutting_down: None,
            started: false,
            jitter: Jitter::seeded(),
            happenings: Vec::new(),
            datadir,
            bubblewrap: None,
        }
    }

    /// Spawns every slot. Called once, by the dispatcher, before its loop.
    pub(crate) fn spawn_all(&mut self) {
        for r in 0..self.registrations.len() {
            for s in 0..self.registrations[r].slots.len() {
                self.spawn(r, s);
            }
        }
        self.publish();
    }

    /// Whether every slot's first spawn has settled (answered or failed).
    pub(crate) fn all_settled(&self) -> bool {
        self.registrations
            .iter()
            .all(|r| r.slots.iter().all(|s| s.settled))
    }

    /// Ends the startup phase: checks that the healthy workers of each registration agree, fixes the
    /// agreed declarations, and checks the deployment configuration against them.
    pub(crate) fn finish_startup(&mut self) -> Result<(), StartupRefusal> {
        self.started = true;
        for reg in &mut self.registrations {
            let mut answers = reg.slots.iter().filter_map(|slot| {
                (slot.state == WorkerState::Healthy)
                    .then_some(slot.initialized.as_ref())
                    .flatten()
                    .map(|init| (slot.index, init))
            });
            let Some((first_slot, first)) = answers.next() else {
                continue;
            };
            for (slot, other) in answers {
                if let Some(difference) = declaration_difference(first, other) {
                    return Err(StartupRefusal::Disagreement {
                        registration: reg.registration.name.clone(),
                        detail: format!("worker {first_slot} and worker {slot}: {difference}"),
                    });
                }
            }
            check_configuration_keys(&reg.registration, first)?;
            if let Some(datadir) = &self.datadir {
                datadir
                    .bind_identity(&reg.registration.name, first)
                    .map_err(|error| StartupRefusal::Binding {
                        registration: reg.registration.name.clone(),
                        detail: error.to_string(),
                    })?;
            }
            reg.agreed = Some(first.clone());
        }
        Ok(())
    }

    pub(crate) fn status(&self) -> PoolStatus {
        PoolStatus {
            shutting_down: self.shutting_down,
            journal_failure: None,
            registrations: self
                .registrations
                .iter()
                .map(|reg| RegistrationStatus {
                    name: reg.registration.name.clone(),
                    workers: reg
                        .slots
                        .iter()
                        .map(|slot| WorkerStatus {
                            slot: slot.index,
                            state: slot.state,
                            pid: slot.pid(),
                            restarts: slot.restarts,
                            initialized: slot.initialized.clone(),
                            init_latency_ms: slot.init_latency.map(|d| d.as_secs_f64() * 1e3),
                            last_failure: slot.last_failure.clone(),
                            violations: slot.violations(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    /// Publishes the status, if it changed, and notes every slot whose state changed since the
    /// last publish.
    pub(crate) fn publish(&mut self) {
        let unchanged = self.shown_shutting_down == Some(self.shutting_down)
            && self
                .registrations
                .iter()
                .all(|reg| reg.slots.iter().all(Slot::shows_as_published));
        if unchanged {
            return;
        }
        let status = self.status();
        self.shown_shutting_down = Some(self.shutting_down);
        for (r, registration) in self.registrations.iter_mut().enumerate() {
            for slot in &mut registration.slots {
                let (shown, failure) = slot.showing();
                let failure = failure.cloned();
                if slot.shown.as_ref().map(|(s, _)| s.state) != Some(shown.state) {
                    self.happenings.push(Happening::SlotState {
                        registration: r,
                        slot: slot.index,
                        state: shown.state,
                    });
                }
                slot.shown = Some((shown, failure));
            }
        }
        self.board.publish(status);
    }

    /// What happened since the last call, in order.
    pub(crate) fn take_happenings(&mut self) -> Vec<Happening> {
        std::mem::take(&mut self.happenings)
    }

    /// Whether shutdown has finished: no slot has a live process.
    pub(crate) fn stopped(&self) -> bool {
        self.shutting_down
            && self
                .registrations
                .iter()
                .all(|r| r.slots.iter().all(|s| s.live.is_none()))
    }

    fn label(&self, r: usize, s: usize) -> WorkerLabel {
        WorkerLabel::new(&self.registrations[r].registration.name, s as u32)
    }

    fn slot_mut(&mut self, key: WorkerKey) -> Option<&mut Slot> {
        let slot = self
            .registrations
            .get_mut(key.registration)?
            .slots
            .get_mut(key.slot as usize)?;
        (slot.generation == key.generation).then_some(slot)
    }

    fn key(&self, r: usize, s: usize) -> WorkerKey {
        WorkerKey {
            registration: r,
            slot: s as u32,
            generation: self.registrations[r].slots[s].generation,
        }
    }

    // ----- spawning -----

    /// Runs the workers of `"sandbox": true` registrations under `bubblewrap`.
    pub(crate) fn with_bubblewrap(
        mut self,
        bubblewrap: Option<crate::sandbox::Bubblewrap>,
    ) -> Pool {
        self.bubblewrap = bubblewrap;
        self
    }

    fn spawn(&mut self, r: usize, s: usize) {
        let label = self.label(r, s);
        let reg = &self.registrations[r];
        let mut spec = SpawnSpec {
            program: reg.program.clone(),
            args: reg.registration.args.clone(),
            env: self.worker_env(r, s),
            cwd: reg.registration.cwd.clone(),
        };
        if reg.registration.sandbox
            && let Some(bubblewrap) = &self.bubblewrap
        {
            // Its state root must exist to be mounted; a failure shows as the worker's own.
            if let Err(error) = std::os::unix::fs::DirBuilderExt::mode(
                std::fs::DirBuilder::new().recursive(true),
                0o700,
            )
            .create(&reg.state_root)
            {
                log::warn!("creating {}: {error}", reg.state_root.display());
            }
            spec.args = bubblewrap.worker_command(
                &self.options.data_dir,
                &reg.state_root,
                spec.cwd.as_deref(),
                &spec.program,
                &spec.args,
            );
            spec.program = bubblewrap.program().to_path_buf();
        }
        let slot = &mut self.registrations[r].slots[s];
        slot.generation += 1;
        slot.state = WorkerState::Starting;
        slot.initialized = None;
        slot.init_latency = None;
        let key = self.key(r, s);
        let queue = self.registrations[r].slots[s].queue.clone();
        queue.attach_writer(key.generation);
        let outbox = Box::new(move || queue.next_for_writer(key.generation));
        match worker::start(
            &spec,
            key,
            &label,
            self.options.max_line_bytes,
            outbox,
            &self.events,
        ) {
            Ok((running, stdin)) => {
                log::info!(
                    "worker {label}: started pid {} ({})",
                    running.process.pid(),
                    spec.program.display()
                );
                self.registrations[r].slots[s]
                    .queue
                    .attach_stdin(key.generation, stdin);
                let spawned_at = Instant::now();
                self.registrations[r].slots[s].live = Some(Live {
                    running,
                    spawned_at,
                    next_id: 1,
                    pending: HashMap::new(),
                    incoming: HashSet::new(),
                    failing: None,
                    violations: ViolationWindow::new(
                        self.options.violation_limit,
                        self.options.violation_window,
                    ),
                });
                let params = self.initialize_params(r, s);
                self.send_request(
                    key,
                    harness::method::INITIALIZE,
                    &params,
                    Pending::Initialize,
                );
                self.timer.at(
                    spawned_at + self.options.init_deadline,
                    Deadline::Initialize(key),
                );
            }
            Err(error) => {
                log::error!(
                    "worker {label}: could not start {}: {error}",
                    spec.program.display()
                );
                self.settle_failure(
                    key,
                    WorkerFailure {
                        reason: FailureReason::SpawnFailed(error.to_string()),
                        exit: None,
                        stderr_tail: String::new(),
                    },
                );
            }
        }
    }

    fn worker_env(&self, r: usize, s: usize) -> Vec<(String, String)> {
        let registration = &self.registrations[r].registration;
        let mut env: Vec<(String, String)> = self.base_env.clone();
        for (name, value) in &registration.env {
            env.retain(|(existing, _)| existing != name);
            env.push((name.clone(), value.clone()));
        }
        for (name, value) in [
            ("BRAIN_HARNESS_PROTOCOL", PROTOCOL.to_owned()),
            ("BRAIN_REGISTRATION", registration.name.clone()),
            ("BRAIN_WORKER", s.to_string()),
        ] {
            env.retain(|(existing, _)| existing != name);
            env.push((name.to_owned(), value));
        }
        env
    }

    fn initialize_params(&self, r: usize, s: usize) -> InitializeParams {
        let reg = &self.registrations[r];
        InitializeParams {
            protocol: PROTOCOL.to_owned(),
            brain: BrainInfo {
                name: "brain".to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            },
            registration: reg.registration.name.clone(),
            worker: s as u32,
            configuration: reg.registration.configuration.clone(),
            state_root: reg.state_root.to_string_lossy().into_owned(),
            max_concurrency: reg.registration.max_concurrency,
            max_line_bytes: self.options.max_line_bytes as u64,
        }
    }

    fn send_request(
        &mut self,
        key: WorkerKey,
        method: &str,
        params: &impl serde::Serialize,
        pending: Pending,
    ) {
        let Some(live) = self.slot_mut(key).and_then(|slot| slot.live.as_mut()) else {
            return;
        };
        let id = live.next_id;
        live.next_id += 1;
        live.pending.insert(id, pending);
        let line = jsonrpc::encode_request(&RequestId::Int(id), method, params);
        self.send_line(key, line);
    }

    /// Queues a line for the worker's stdin. A closed stdin or a gone incarnation drops it: the
    /// worker is going away, and its exit event fails whatever the line asked.
    pub(crate) fn send_line(&mut self, key: WorkerKey, line: Vec<u8>) {
        if let Some(slot) = self.slot_mut(key).filter(|slot| slot.live.is_some()) {
            slot.queue.send_line(key.generation, line);
        }
    }

    // ----- events -----

    pub(crate) fn on_worker_event(&mut self, key: WorkerKey, event: WorkerEvent) {
        if self.slot_mut(key).is_none() {
            log::debug!("ignoring a stale event of {key:?}");
            return;
        }
        match event {
            WorkerEvent::Message(message) => self.on_message(key, message),
            WorkerEvent::Call(id, call) => {
                if self.take_incoming(key, &id) {
                    self.happenings.push(Happening::Call { key, id, call });
                }
            }
            WorkerEvent::Violation(violation) => self.violation(key, violation, None),
            WorkerEvent::StdoutClosed => self.on_stdout_closed(key),
            WorkerEvent::Exited(exit) => self.on_exit(key, exit),
        }
        self.publish();
    }

    pub(crate) fn on_deadline(&mut self, deadline: Deadline) {
        match deadline {
            Deadline::Initialize(key) => {
                if self
                    .slot_mut(key)
                    .is_some_and(|slot| slot.state == WorkerState::Starting)
                {
                    self.fail(key, FailureReason::InitTimeout);
                }
            }
            Deadline::StdoutClosed(key) => {
                if let Some(live) = self.slot_mut(key).and_then(|slot| slot.live.as_ref()) {
                    live.running.process.kill();
                }
            }
            Deadline::Respawn(key) => {
                let respawn = !self.shutting_down
                    && self.slot_mut(key).is_some_and(|slot| {
                        slot.state == WorkerState::Failed && slot.live.is_none()
                    });
                if respawn {
                    let (r, s) = (key.registration, key.slot as usize);
                    self.registrations[r].slots[s].restarts += 1;
                    self.spawn(r, s);
                }
            }
            Deadline::CancelGrace { .. }
            | Deadline::FatalGrace { .. }
            | Deadline::Wall { .. }
            | Deadline::ShutdownProceed
            | Deadline::DrainExpired
            | Deadline::TrimHeap => {
                log::error!("the pool was handed a session deadline: {deadline:?}");
            }
            Deadline::ShutdownKill(key) => {
                let label = self.label(key.registration, key.slot as usize);
                if let Some(live) = self.slot_mut(key).and_then(|slot| slot.live.as_ref()) {
                    log::warn!(
                        "worker {label}: still running after the shutdown grace; killing it"
                    );
                    live.running.process.kill();
                }
            }
        }
        self.publish();
    }

    fn on_message(&mut self, key: WorkerKey, message: Message) {
        match message {
            Message::Response(response) => self.on_response(key, response),
            Message::Request(request) => self.on_request(key, request),
            Message::Notification(notification) => log::debug!(
                "worker {}: ignoring notification {:?}",
                self.label(key.registration, key.slot as usize),
                notification.method
            ),
        }
    }

    fn on_response(&mut self, key: WorkerKey, response: Response) {
        let pending = match (
            &response.id,
            self.slot_mut(key).and_then(|slot| slot.live.as_mut()),
        ) {
            (RequestId::Int(id), Some(live)) => live.pending.remove(id),
            _ => None,
        };
        match pending {
            None => self.violation(key, Violation::UnknownResponseId, Some(&response.id)),
            Some(Pending::Initialize) => self.on_initialize_answer(key, response.outcome),
            Some(Pending::Shutdown) => {
                // The harness released everything; closing stdin tells it to exit.
                if let Some(slot) = self.slot_mut(key) {
                    slot.queue.close_stdin(key.generation);
                }
            }
            Some(Pending::Session(request)) => self.happenings.push(Happening::Answered {
                key,
                request,
                outcome: response.outcome,
            }),
        }
    }

    fn on_request(&mut self, key: WorkerKey, request: Request) {
        if self.take_incoming(key, &request.id) {
            self.happenings.push(Happening::Request { key, request });
        }
    }

    /// Registers a harness request's id as outstanding until [`Pool::answer`]. False (and a
    /// violation counted) for an id already outstanding, or when that incarnation is gone.
    fn take_incoming(&mut self, key: WorkerKey, id: &RequestId) -> bool {
        let Some(live) = self.slot_mut(key).and_then(|slot| slot.live.as_mut()) else {
            return false;
        };
        if !live.incoming.insert(id.clone()) {
            self.violation(key, Violation::DuplicateId, Some(id));
            return false;
        }
        true
    }

    /// Answers a harness request delivered as [`Happening::Request`]: its id is no longer
    /// outstanding, and the answer line is queued to the worker (if that incarnation still runs).
    pub(crate) fn answer(&mut self, key: WorkerKey, id: &RequestId, line: Vec<u8>) {
        self.answered(key, id);
        self.send_line(key, line);
    }

    /// A harness request that somebody else answers (a callback's executor writes its answer to
    /// the slot's queue itself): its id is no longer outstanding, so the harness may use it again.
    pub(crate) fn answered(&mut self, key: WorkerKey, id: &RequestId) {
        if let Some(live) = self.slot_mut(key).and_then(|slot| slot.live.as_mut()) {
            live.incoming.remove(id);
        }
    }

    /// Registers a session request as pending on the worker and returns its encoded line
    /// without sending it (the caller sends it with [`Pool::send_line`] once it may). `None` when
    /// that incarnation no longer runs.
    pub(crate) fn prepare_request(
        &mut self,
        key: WorkerKey,
        method: &str,
        params: &impl serde::Serialize,
        request: SessionRequest,
    ) -> Option<Vec<u8>> {
        let live = self.slot_mut(key).and_then(|slot| slot.live.as_mut())?;
        if live.failing.is_some() {
            return None;
        }
        let id = live.next_id;
        live.next_id += 1;
        live.pending.insert(id, Pending::Session(request));
        Some(jsonrpc::encode_request(&RequestId::Int(id), method, params))
    }

    /// Sends a session request now. Returns whether the worker took it.
    pub(crate) fn request(
        &mut self,
        key: WorkerKey,
        method: &str,
        params: &impl serde::Serialize,
        request: SessionRequest,
    ) -> bool {
        match self.prepare_request(key, method, params, request) {
            Some(line) => {
                self.send_line(key, line);
                true
            }
            None => false,
        }
    }

    /// Forgets a prepared request that will never be sent.
    pub(crate) fn forget_request(&mut self, key: WorkerKey, request: &SessionRequest) {
        if let Some(live) = self.slot_mut(key).and_then(|slot| slot.live.as_mut()) {
            live.pending
                .retain(|_, pending| !matches!(pending, Pending::Session(r) if r == request));
        }
    }

    /// Kills a worker's process group for `reason` (a cancel grace that expired, …). Counts as a
    /// failure of the slot.
    pub(crate) fn kill(&mut self, key: WorkerKey, reason: FailureReason) {
        self.fail(key, reason);
    }

    /// The current incarnation of a slot, when it is healthy and can take requests.
    pub(crate) fn healthy_key(&self, registration: usize, slot: u32) -> Option<WorkerKey> {
        let state = self
            .registrations
            .get(registration)?
            .slots
            .get(slot as usize)?;
        (state.state == WorkerState::Healthy && state.live.is_some()).then_some(WorkerKey {
            registration,
            slot,
            generation: state.generation,
        })
    }

    /// Whether this incarnation is still the slot's live process.
    pub(crate) fn is_live(&self, key: WorkerKey) -> bool {
        self.registrations
            .get(key.registration)
            .and_then(|r| r.slots.get(key.slot as usize))
            .is_some_and(|slot| {
                slot.generation == key.generation
                    && slot.live.as_ref().is_some_and(|l| l.failing.is_none())
            })
    }

    /// The state of a slot.
    pub(crate) fn slot_state(&self, registration: usize, slot: u32) -> Option<WorkerState> {
        Some(
            self.registrations
                .get(registration)?
                .slots
                .get(slot as usize)?
                .state,
        )
    }

    /// The index of the registration with this name.
    pub(crate) fn registration_index(&self, name: &str) -> Option<usize> {
        self.registrations
            .iter()
            .position(|r| r.registration.name == name)
    }

    /// A registration by index.
    pub(crate) fn registration(&self, registration: usize) -> &Registration {
        &self.registrations[registration].registration
    }

    /// The declarations every worker of the registration repeats, once known.
    pub(crate) fn agreed(&self, registration: usize) -> Option<&InitializeResult> {
        self.registrations.get(registration)?.agreed.as_ref()
    }

    /// Counts a violation; the reader thread already logged framing violations, id violations
    /// (which carry the id) are logged here.
    fn violation(&mut self, key: WorkerKey, violation: Violation, id: Option<&RequestId>) {
        if let Some(id) = id {
            let label = self.label(key.registration, key.slot as usize);
            log::warn!("worker {label}: protocol violation {violation} (id {id})");
        }
        let tripped = self
            .slot_mut(key)
            .and_then(|slot| slot.live.as_mut())
            .is_some_and(|live| live.violations.record(Instant::now()));
        if tripped {
            self.fail(key, FailureReason::Faulty(violation));
        }
    }

    fn on_initialize_answer(&mut self, key: WorkerKey, outcome: Result<Value, RpcError>) {
        let accepted = match outcome {
            Err(error) => Err(FailureReason::InitError(error.message)),
            Ok(value) => match serde_json::from_value::<InitializeResult>(value) {
                Err(error) => Err(FailureReason::InvalidInitialize(error.to_string())),
                Ok(result) if result.protocol != PROTOCOL => {
                    Err(FailureReason::WrongProtocol(result.protocol))
                }
                Ok(result) => Ok(result),
            },
        };
        let result = match accepted {
            Ok(result) => result,
            Err(reason) => return self.fail(key, reason),
        };
        let reg = &self.registrations[key.registration];
        if let Some(agreed) = &reg.agreed
            && let Some(difference) = declaration_difference(agreed, &result)
        {
            return self.fail(key, FailureReason::IdentityMismatch(difference));
        }
        let started = self.started;
        let label = self.label(key.registration, key.slot as usize);
        let reg = &mut self.registrations[key.registration];
        let set_agreement = started && reg.agreed.is_none();
        if set_agreement && let Err(refusal) = check_configuration_keys(&reg.registration, &result)
        {
            let reason = match refusal {
                StartupRefusal::UndeclaredKey { key, .. } => {
                    format!("deployment configuration key {key:?} is not declared")
                }
                StartupRefusal::Disagreement { detail, .. }
                | StartupRefusal::Binding { detail, .. } => detail,
            };
            return self.fail(key, FailureReason::IdentityMismatch(reason));
        }
        if set_agreement {
            if let Some(datadir) = &self.datadir
                && let Err(error) = datadir.bind_identity(&reg.registration.name, &result)
            {
                return self.fail(key, FailureReason::IdentityMismatch(error.to_string()));
            }
            reg.agreed = Some(result.clone());
        }
        let Some(slot) = reg.slots.get_mut(key.slot as usize) else {
            return;
        };
        let latency = slot.live.as_ref().map(|l| l.spawned_at.elapsed());
        log::info!(
            "worker {label}: healthy: {} {} (state version {}) in {:?}",
            result.identity.name,
            result.identity.version,
            result.state_version,
            latency.unwrap_or_default()
        );
        slot.state = WorkerState::Healthy;
        slot.initialized = Some(result);
        slot.init_latency = latency;
        slot.settled = true;
    }

    fn on_stdout_closed(&mut self, key: WorkerKey) {
        let Some(live) = self.slot_mut(key).and_then(|slot| slot.live.as_mut()) else {
            return;
        };
        if live.failing.is_none() {
            live.failing = Some(FailureReason::Exited);
        }
        if let Some(slot) = self.slot_mut(key)
            && matches!(slot.state, WorkerState::Starting | WorkerState::Healthy)
        {
            slot.state = WorkerState::Failed;
        }
        self.timer.at(
            Instant::now() + STDOUT_CLOSED_GRACE,
            Deadline::StdoutClosed(key),
        );
    }

    /// Takes a worker down for `reason`: unhealthy at once, its group killed; the exit event
    /// finishes the job.
    fn fail(&mut self, key: WorkerKey, reason: FailureReason) {
        let label = self.label(key.registration, key.slot as usize);
        let Some(slot) = self.slot_mut(key) else {
            return;
        };
        let Some(live) = slot.live.as_mut() else {
            return;
        };
        if live.failing.is_some() {
            return;
        }
        log::warn!("worker {label}: {reason}; killing it");
        live.running.process.kill();
        live.failing = Some(reason);
        if slot.state != WorkerState::Stopping {
            slot.state = WorkerState::Failed;
        }
    }

    fn on_exit(&mut self, key: WorkerKey, exit: Exit) {
        let label = self.label(key.registration, key.slot as usize);
        let Some(slot) = self.slot_mut(key) else {
            return;
        };
        let Some(live) = slot.live.take() else {
            return;
        };
        // Its writer returns (it may wait for lines that will never come).
        slot.queue.close_stdin(key.generation);
        let failure = WorkerFailure {
            reason: live.failing.clone().unwrap_or(FailureReason::Exited),
            exit: Some(exit),
            stderr_tail: live.running.stderr_tail.snapshot(),
        };
        let stopping = slot.state == WorkerState::Stopping;
        let unanswered = live
            .pending
            .into_values()
            .filter_map(|pending| match pending {
                Pending::Session(request) => Some(request),
                Pending::Initialize | Pending::Shutdown => None,
            })
            .collect();
        self.happenings.push(Happening::Lost {
            key,
            failure: failure.clone(),
            unanswered,
        });
        if stopping {
            log::info!("worker {label}: stopped ({exit})");
            if let Some(slot) = self.slot_mut(key) {
                slot.state = WorkerState::Stopped;
            }
            return;
        }
        self.settle_failure(key, failure);
    }

    /// Records a failure of the slot's current incarnation, then respawns or quarantines it.
    fn settle_failure(&mut self, key: WorkerKey, failure: WorkerFailure) {
        let label = self.label(key.registration, key.slot as usize);
        let now = Instant::now();
        let (budget, window) = (self.options.restart_budget, self.options.restart_window);
        let shutting_down = self.shutting_down;
        let Some(slot) = self.slot_mut(key) else {
            return;
        };
        log::warn!("worker {label}: lost: {failure}");
        let identity_changed = matches!(failure.reason, FailureReason::IdentityMismatch(_));
        slot.last_failure = Some(failure);
        slot.settled = true;
        if shutting_down {
            slot.state = WorkerState::Stopped;
            return;
        }
        slot.failures.push_back(now);
        while slot
            .failures
            .front()
            .is_some_and(|&at| now.duration_since(at) >= window)
        {
            slot.failures.pop_front();
        }
        let recent = slot.failures.len();
        if identity_changed || recent > budget as usize {
            log::error!(
                "worker {label}: quarantined ({recent} failures within {window:?}); not respawned until Brain restarts"
            );
            slot.state = WorkerState::Quarantined;
            return;
        }
        slot.state = WorkerState::Failed;
        let delay = self.backoff(recent);
        log::info!("worker {label}: respawning in {delay:?}");
        self.timer.at(now + delay, Deadline::Respawn(key));
    }

    /// The respawn delay after the `failures`-th failure in the window: the base doubled per
    /// failure, capped, with ±20 % jitter.
    fn backoff(&mut self, failures: usize) -> Duration {
        let doublings = failures.saturating_sub(1).min(30) as u32;
        let delay = self
            .options
            .respawn_backoff
            .saturating_mul(1 << doublings)
            .min(self.options.respawn_backoff_max);
        delay.mul_f64(self.jitter.factor())
    }

    // ----- shutdown -----

    /// Readiness fails from now on; nothing else changes yet.
    pub(crate) fn mark_shutting_down(&mut self) {
        self.shutting_down = true;
        self.publish();
    }

    /// Begins shutdown: healthy workers get `shutdown` (and are killed after the grace if they
    /// are still there), starting workers are killed, nothing is respawned any more.
    pub(crate) fn begin_shutdown(&mut self, grace: Duration) {
        self.shutting_down = true;
        let now = Instant::now();
        for r in 0..self.registrations.len() {
            for s in 0..self.registrations[r].slots.len() {
                let key = self.key(r, s);
                let slot = &mut self.registrations[r].slots[s];
                let Some(live) = slot.live.as_mut() else {
                    if slot.state != WorkerState::Quarantined {
                        slot.state = WorkerState::Stopped;
                    }
                    continue;
                };
                let serving = slot.state == WorkerState::Healthy;
                slot.state = WorkerState::Stopping;
                if !serving || grace.is_zero() {
                    live.running.process.kill();
                } else {
                    self.send_request(
                        key,
                        harness::method::SHUTDOWN,
                        &ShutdownParams {},
                        Pending::Shutdown,
                    );
                    self.timer.at(now + grace, Deadline::ShutdownKill(key));
                }
            }
        }
        self.publish();
    }
}

/// What differs between two initialize answers in the parts workers of one registration must share.
fn declaration_difference(a: &InitializeResult, b: &InitializeResult) -> Option<String> {
    if a.identity.name != b.identity.name {
        return Some(format!(
            "identity {:?} versus {:?}",
            a.identity.name, b.identity.name
        ));
    }
    if a.state_version != b.state_version {
        return Some(format!(
            "state version {:?} versus {:?}",
            a.state_version, b.state_version
        ));
    }
    if a.capabilities != b.capabilities {
        return Some(format!(
            "capabilities {:?} versus {:?}",
            a.capabilities, b.capabilities
        ));
    }
    if a.configuration_keys != b.configuration_keys {
        return Some(format!(
            "configuration keys {:?} versus {:?}",
            a.configuration_keys, b.configuration_keys
        ));
    }
    if a.required_model_metadata != b.required_model_metadata {
        return Some(format!(
            "required model metadata {:?} versus {:?}",
            a.required_model_metadata, b.required_model_metadata
        ));
    }
    None
}

fn check_configuration_keys(
    registration: &Registration,
    declared: &InitializeResult,
) -> Result<(), StartupRefusal> {
    let Some(keys) = &declared.configuration_keys else {
        return Ok(());
    };
    match registration
        .configuration
        .keys()
        .find(|key| !keys.iter().any(|k| k == *key))
    {
        Some(key) => Err(StartupRefusal::UndeclaredKey {
            registration: registration.name.clone(),
            key: key.clone(),
        }),
        None => Ok(()),
    }
}

/// The variables a harness inherits from Brain: an allow-list, nothing else.
const INHERITED_VARIABLES: [&str; 6] = ["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR"];

fn inherited_env() -> Vec<(String, String)> {
    INHERITED_VARIABLES
        .iter()
        .filter_map(|name| Some((name.to_string(), std::env::var(name).ok()?)))
        .collect()
}

/// A small xorshift generator for backoff jitter; quality does not matter, independence from other
/// Brains started at the same moment does (the pid goes into the seed).
#[derive(Debug)]
struct Jitter(u64);

impl Jitter {
    fn seeded() -> Jitter {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Jitter((nanos ^ (u64::from(std::process::id()) << 32)) | 1)
    }

    /// A factor in [0.8, 1.2).
    fn factor(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        0.8 + 0.4 * ((x >> 11) as f64 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_twenty_percent() {
        let mut jitter = Jitter::seeded();
        for _ in 0..10_000 {
            let f = jitter.factor();
            assert!((0.8..1.2).contains(&f), "{f}");
        }
    }
}
