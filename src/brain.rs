//! The embedding API: start Brain, watch its workers, shut it down.

use crate::api::{self, ApiError, CreateOptions, Session, SessionInfo};
use crate::callbacks::Executor;
use crate::capacity::CapacityQueue;
use crate::config::{ConfigError, Registrations};
use crate::datadir::DataDir;
use crate::dispatch::{Command, Dispatcher, Inputs};
use crate::effects::Effects;
use crate::journal::{DiskJournal, Journal, MemoryJournal};
use crate::metrics::Metrics;
use crate::options::Options;
use crate::pool::{Pool, StartupRefusal};
use crate::protocol::harness::ErrorCode;
use crate::recovery::dormant_sessions;
use crate::session::{CreateSession, Keyed, SessionId};
use crate::sessions::QueueEntry;
use crate::status::{PoolStatus, StatusBoard};
use crate::timer::Timer;
use crate::watch::WatchedJournal;
use crossbeam_channel::Sender;
use std::fmt;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Where Brain keeps its records.
#[derive(Clone)]
pub enum Storage {
    /// The durable journal in `options.data_dir` (the default): the directory is locked for the
    /// process's life, its format checked, harness identities bound to it, and sessions recovered
    /// from it at start.
    DataDir,
    /// In memory: no lock, no journal, format or identity file, and nothing survives the
    /// process. For `brain check`, tests and benchmarks. Sessions created on it still get a native
    /// state directory for their harness under `<data_dir>/agentloops/`.
    Ephemeral,
    /// An embedder's journal. Sessions already in it are recovered at start (interrupted
    /// activations recorded, unknown effects finished) before anything is served.
    Journal(Arc<dyn Journal>),
}

/// What [`Brain::start`] needs: the registrations, the tunables, where records go, and the model
/// providers and environment drivers.
#[derive(Clone)]
pub struct Config {
    /// The harness registrations, by name.
    pub registrations: Registrations,
    /// Deadlines, limits and the data directory.
    pub options: Options,
    /// Where records go.
    pub storage: Storage,
    /// Model providers and environment drivers by name (`scripted` is always there).
    pub effects: Effects,
}

impl Config {
    /// A configuration with these registrations and default options.
    pub fn new(registrations: Registrations) -> Config {
        Config {
            registrations,
            options: Options::default(),
            storage: Storage::DataDir,
            effects: Effects::default(),
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("registrations", &self.registrations)
            .field("options", &self.options)
            .field(
                "storage",
                &match self.storage {
                    Storage::DataDir => "data directory",
                    Storage::Ephemeral => "ephemeral",
                    Storage::Journal(_) => "journal",
                },
            )
            .finish()
    }
}

/// Why Brain refused to start. [`StartError::is_configuration`] tells whether the operator's
/// configuration is at fault (the binary exits 78 then).
#[derive(Debug)]
pub struct StartError {
    kind: StartErrorKind,
}

#[derive(Debug)]
enum StartErrorKind {
    DataDir(crate::datadir::DataDirError),
    Config(ConfigError),
    Refused(StartupRefusal),
    /// A registration asks for `"sandbox": true` and bubblewrap cannot sandbox here.
    Sandbox(crate::sandbox::SandboxUnavailable),
    Io(String, std::io::Error),
    Aborted,
}

impl StartError {
    /// Whether the configuration (registrations, declarations) was refused, as opposed to an
    /// operating-system failure.
    pub fn is_configuration(&self) -> bool {
        match &self.kind {
            StartErrorKind::Config(_) | StartErrorKind::Refused(_) | StartErrorKind::Sandbox(_) => {
                true
            }
            StartErrorKind::DataDir(error) => error.is_configuration(),
            StartErrorKind::Io(..) | StartErrorKind::Aborted => false,
        }
    }

    /// Whether startup was abandoned (a signal, or a shutdown during startup) rather than failed.
    pub fn aborted(&self) -> bool {
        matches!(self.kind, StartErrorKind::Aborted)
    }

    /// The registration at fault, when one is.
    pub fn registration(&self) -> Option<&str> {
        match &self.kind {
            StartErrorKind::Config(error) => error.registration(),
            StartErrorKind::Refused(
                StartupRefusal::Disagreement { registration, .. }
                | StartupRefusal::UndeclaredKey { registration, .. }
                | StartupRefusal::Binding { registration, .. },
            ) => Some(registration),
            StartErrorKind::Io(..)
            | StartErrorKind::Aborted
            | StartErrorKind::DataDir(_)
            | StartErrorKind::Sandbox(_) => None,
        }
    }
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            StartErrorKind::Config(error) => write!(f, "{error}"),
            StartErrorKind::Refused(StartupRefusal::Disagreement {
                registration,
                detail,
            }) => write!(
                f,
                "registration {registration:?}: workers disagree on their declarations: {detail}"
            ),
            StartErrorKind::Refused(StartupRefusal::Binding { detail, .. }) => f.write_str(detail),
            StartErrorKind::Refused(StartupRefusal::UndeclaredKey { registration, key }) => write!(
                f,
                "registration {registration:?}: field \"configuration\": key {key:?} is not among the harness's configuration_keys"
            ),
            StartErrorKind::Io(what, error) => write!(f, "{what}: {error}"),
            StartErrorKind::DataDir(error) => write!(f, "{error}"),
            StartErrorKind::Sandbox(why) => write!(
                f,
                "a registration runs its workers sandboxed, but the sandbox cannot run here: {why}"
            ),
            StartErrorKind::Aborted => f.write_str("startup was aborted by a shutdown"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            StartErrorKind::Config(error) => Some(error),
            StartErrorKind::Io(_, error) => Some(error),
            _ => None,
        }
    }
}

impl From<ConfigError> for StartError {
    fn from(error: ConfigError) -> StartError {
        StartError {
            kind: StartErrorKind::Config(error),
        }
    }
}

fn io_error(what: &str) -> impl FnOnce(std::io::Error) -> StartError + '_ {
    move |error| StartError {
        kind: StartErrorKind::Io(what.to_owned(), error),
    }
}

/// A running Brain: its worker pools and the dispatcher that owns them.
///
/// `Brain` is `Send + Sync`; every method may be called from any thread. Dropping it without
/// [`Brain::shutdown`] kills every worker's process group at once.
pub struct Brain {
    commands: Sender<Command>,
    board: Arc<StatusBoard>,
    /// Taken by the first shutdown; later ones find it empty and return at once.
    dispatcher: parking_lot::Mutex<Option<JoinHandle<()>>>,
    options: Options,
    journal: Arc<WatchedJournal>,
    metrics: Arc<Metrics>,
    /// Every slot's capacity queue, for the queue-depth and slots-in-use gauges.
    queues: Vec<(String, u32, Arc<CapacityQueue<QueueEntry>>)>,
    /// The durable journal, for its flush counters.
    disk: Option<Arc<DiskJournal>>,
    /// Dropping it stops the compaction thread.
    _compactor: Option<Sender<()>>,
}

/// How often deleted sessions' space is reclaimed while Brain runs.
const COMPACTION_INTERVAL: Duration = Duration::from_secs(600);

/// Reclaims the segments that hold only deleted sessions' records; logs what it did.
fn compact(journal: &DiskJournal) {
    match journal.compact() {
        Ok(report) if report.segments_removed > 0 => log::info!(
            "journal compaction removed {} segments ({} bytes)",
            report.segments_removed,
            report.bytes_reclaimed
        ),
        Ok(_) => {}
        Err(error) => log::warn!("journal compaction failed: {error}"),
    }
}

/// Compacts the journal every [`COMPACTION_INTERVAL`] until the returned sender is dropped.
fn start_compactor(journal: Arc<DiskJournal>) -> std::io::Result<Sender<()>> {
    let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
    std::thread::Builder::new()
        .name("brain-compact".into())
        .spawn(move || {
            while let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(COMPACTION_INTERVAL)
            {
                compact(&journal);
            }
        })?;
    Ok(stop)
}

fn registration_list(
    resolved: &[(crate::config::Registration, std::path::PathBuf)],
) -> Vec<crate::config::Registration> {
    resolved
        .iter()
        .map(|(registration, _)| registration.clone())
        .collect()
}

impl Brain {
    /// Validates the configuration, starts every worker and blocks until each has answered
    /// `initialize` or failed (at most the initialize deadline, plus the time to reap).
    ///
    /// Refuses (and stops whatever it started): a command that cannot be resolved, healthy workers
    /// of one registration that disagree on identity, state version, capabilities, configuration
    /// keys or required model metadata, and deployment configuration keys the harness does not
    /// declare. Workers that failed are not a refusal: they are respawned, and [`Brain::ready`]
    /// tells whether any worker serves.
    ///
    /// On glibc, Brain tunes the process's allocator so that memory freed by passivated or
    /// deleted sessions goes back to the operating system: it caps malloc's arenas at one per
    /// CPU (at least two) before it starts its threads, once started it fixes malloc's trim
    /// threshold at 128 KiB, and it trims the heap shortly after sessions are passivated or
    /// deleted. A program embedding Brain shares this.
    pub fn start(config: Config) -> Result<Brain, StartError> {
        Brain::start_until(config, &crossbeam_channel::never())
    }

    /// [`Brain::start`], abandoned as soon as `abort` receives (or disconnects): whatever was
    /// started is stopped at once and the error says so ([`StartError::aborted`]). `brain serve`
    /// passes its signals here, so a signal during startup aborts it.
    pub fn start_until(
        config: Config,
        abort: &crossbeam_channel::Receiver<()>,
    ) -> Result<Brain, StartError> {
        crate::heap::few_arenas();
        let cwd = std::env::current_dir().map_err(io_error("reading the working directory"))?;
        let mut resolved = Vec::with_capacity(config.registrations.len());
        for registration in config.registrations.iter() {
            let program = registration.resolve_command(&cwd)?;
            resolved.push((registration.clone(), program));
        }
        let bubblewrap = if resolved
            .iter()
            .any(|(registration, _)| registration.sandbox)
        {
            match crate::sandbox::Bubblewrap::probe() {
                Ok(bubblewrap) => Some(bubblewrap),
                Err(why) => {
                    return Err(StartError {
                        kind: StartErrorKind::Sandbox(why),
                    });
                }
            }
        } else {
            None
        };
        let mut options = config.options;
        options.data_dir = cwd.join(&options.data_dir);
        let mut disk = None;
        let (journal, datadir): (Arc<dyn Journal>, Option<Arc<DataDir>>) = match config.storage {
            Storage::DataDir => {
                let datadir = DataDir::open(&options.data_dir).map_err(|error| StartError {
                    kind: StartErrorKind::DataDir(error),
                })?;
                datadir
                    .bind_instance(options.instance.as_ref())
                    .map_err(|error| StartError {
                        kind: StartErrorKind::DataDir(error),
                    })?;
                let journal =
                    Arc::new(DiskJournal::open(&datadir.journal_dir()).map_err(|error| {
                        StartError {
                            kind: StartErrorKind::Io(
                                "opening the journal".to_owned(),
                                std::io::Error::other(error.to_string()),
                            ),
                        }
                    })?);
                compact(&journal);
                disk = Some(journal.clone());
                (journal, Some(Arc::new(datadir)))
            }
            Storage::Ephemeral => (Arc::new(MemoryJournal::new()), None),
            Storage::Journal(journal) => (journal, None),
        };
        let compactor = match &disk {
            Some(journal) => Some(
                start_compactor(journal.clone())
                    .map_err(io_error("starting the compaction thread"))?,
            ),
            None => None,
        };
        // Sessions are recovered on first use: startup reads one record of each.
        let registrations = registration_list(&resolved);
        let (dormant, create_keys) =
            dormant_sessions(&*journal, &registrations).map_err(|error| StartError {
                kind: StartErrorKind::Io(
                    "listing sessions in the journal".to_owned(),
                    std::io::Error::other(error.to_string()),
                ),
            })?;
        if !dormant.is_empty() {
            log::info!(
                "{} sessions in the journal; each is recovered on first use",
                dormant.len()
            );
        }
        if let Some(datadir) = &datadir {
            // Every session the journal holds, readable or not: only the state of a session it
            // does not hold at all is removed.
            let live = journal.sessions().map_err(|error| StartError {
                kind: StartErrorKind::Io(
                    "listing sessions in the journal".to_owned(),
                    std::io::Error::other(error.to_string()),
                ),
            })?;
            datadir.remove_orphaned_state(&live.into_iter().collect());
        }
        let journal = Arc::new(WatchedJournal::new(journal));

        let (deadline_tx, deadlines) = crossbeam_channel::unbounded();
        let timer = Timer::start(deadline_tx).map_err(io_error("starting the timer thread"))?;
        let (commands_tx, commands) = crossbeam_channel::unbounded();
        let (internal_tx, internal) = crossbeam_channel::unbounded();
        let (events_tx, events) = crossbeam_channel::bounded(1024);
        let (startup_tx, startup) = crossbeam_channel::bounded(1);
        let board = Arc::new(StatusBoard::default());

        let queues: Vec<Vec<_>> = resolved
            .iter()
            .map(|(registration, _)| {
                (0..registration.workers)
                    .map(|_| {
                        Arc::new(CapacityQueue::new(
                            registration.max_concurrency as usize,
                            options.queue_bound,
                        ))
                    })
                    .collect()
            })
            .collect();
        let metrics = Arc::new(Metrics::default());
        let gauge_queues = queues
            .iter()
            .zip(&resolved)
            .flat_map(|(slots, (registration, _))| {
                slots
                    .iter()
                    .enumerate()
                    .map(|(slot, queue)| (registration.name.clone(), slot as u32, queue.clone()))
            })
            .collect();
        let executor = Executor::start(
            options.callback_threads,
            journal.clone(),
            config.effects.clone(),
            internal_tx.clone(),
        )
        .map_err(io_error("starting the callback threads"))?;
        let pool = Pool::new(
            resolved
                .into_iter()
                .zip(&queues)
                .map(|((registration, program), queues)| (registration, program, queues.clone()))
                .collect(),
            options.clone(),
            events_tx,
            timer.clone(),
            board.clone(),
            datadir,
        )
        .with_bubblewrap(bubblewrap);
        let dispatcher = Dispatcher {
            pool,
            sessions: Default::default(),
            dormant: crate::dormant::DormantSessions::found_at_start(dormant),
            create_keys,
            data_dir: options.data_dir.clone(),
            trim_due: false,
            registrations,
            journal: journal.clone(),
            effects: config.effects,
            queues,
            executor,
            internal: internal_tx,
            commands: commands_tx.clone(),
            timer,
            options: options.clone(),
            stopping: None,
            feeding: Default::default(),
            pending_runs: Default::default(),
            metrics: metrics.clone(),
        };
        let inputs = Inputs {
            deadlines,
            internal,
            commands,
            events,
        };
        let dispatcher = std::thread::Builder::new()
            .name("brain-dispatch".into())
            .spawn(move || dispatcher.run(inputs, startup_tx))
            .map_err(io_error("starting the dispatcher thread"))?;
        let brain = Brain {
            commands: commands_tx,
            board,
            dispatcher: parking_lot::Mutex::new(Some(dispatcher)),
            options,
            journal,
            metrics,
            queues: gauge_queues,
            _compactor: compactor,
            disk,
        };
        let outcome = crossbeam_channel::select! {
            recv(startup) -> outcome => outcome,
            recv(abort) -> _ => Err(crossbeam_channel::RecvError),
        };
        match outcome {
            Ok(Ok(())) => {
                // After recovery, whose large read buffers glibc has learnt to keep on the heap.
                crate::heap::keep_little();
                Ok(brain)
            }
            Ok(Err(refusal)) => {
                brain.stop(Duration::ZERO);
                Err(StartError {
                    kind: StartErrorKind::Refused(refusal),
                })
            }
            Err(_) => {
                brain.stop(Duration::ZERO);
                Err(StartError {
                    kind: StartErrorKind::Aborted,
                })
            }
        }
    }

    /// Readiness: the journal can still make records durable, some worker of some registration
    /// is healthy, and Brain is not shutting down. Never blocks on the dispatcher.
    pub fn ready(&self) -> bool {
        self.status().ready()
    }

    /// A snapshot of every registration and worker, and of the journal's health. Never blocks on
    /// the dispatcher.
    pub fn status(&self) -> PoolStatus {
        let mut status = self.board.snapshot();
        status.journal_failure = self.journal.failure();
        status
    }

    /// Blocks until `condition` holds for the pool's status, or `timeout` passes. Returns the last
    /// status seen: `Ok` when the condition held, `Err` on timeout. Wakes on every status change
    /// (no polling).
    pub fn wait_for(
        &self,
        timeout: Duration,
        condition: impl FnMut(&PoolStatus) -> bool,
    ) -> Result<PoolStatus, PoolStatus> {
        match self.board.wait_until(timeout, condition) {
            (status, true) => Ok(status),
            (status, false) => Err(status),
        }
    }

    /// This Brain's instance name (`--instance`), if it has one.
    pub fn instance(&self) -> Option<&crate::session::InstanceName> {
        self.options.instance.as_ref()
    }

    /// Creates a session (PROTOCOL.md §2) and returns its handle once `session_created` is
    /// durable. Refuses, naming what was wrong: an invalid request (`invalid_request`),
    /// `unknown_agentloop`, `agentloop_unavailable` (no healthy worker), `invalid_configuration`,
    /// `missing_model_metadata`, `unsupported_input`, `shutting_down`.
    pub fn create_session(&self, request: CreateSession) -> Result<Session, ApiError> {
        self.create_session_with(request, CreateOptions::default())
    }

    /// Creates a session that continues the conversation of an `interrupted` or `closed` one: the
    /// new session imports the old one's saved transcript (so its harness must declare
    /// `transcript_import`, else `unsupported_input`). Any transcript in `request` is replaced.
    /// Refuses `unknown_session`, and `invalid_request` when `from` is still open or passivated.
    pub fn create_session_from(
        &self,
        request: CreateSession,
        from: &SessionId,
    ) -> Result<Session, ApiError> {
        let options = CreateOptions {
            from: Some(from.clone()),
            ..CreateOptions::default()
        };
        self.create_session_with(request, options)
    }

    /// [`Brain::create_session`] with [`CreateOptions`]: a session to continue
    /// ([`Brain::create_session_from`]) and an idempotency key. A create that repeats a key with
    /// the same request and `from` answers the session the first one created (whatever its status
    /// now) and creates nothing; with another request it is refused `idempotency_key_reused`. The
    /// key is recorded in `session_created`, so this holds across restarts, until the session is
    /// deleted.
    pub fn create_session_with(
        &self,
        mut request: CreateSession,
        options: CreateOptions,
    ) -> Result<Session, ApiError> {
        request
            .validate()
            .map_err(|error| ApiError::new(error.code, error.message))?;
        let key = options.idempotency_key.as_ref().map(|key| {
            let asked = serde_json::json!({"request": request, "from": options.from});
            Keyed::new(key, &asked)
        });
        if let Some(from) = &options.from {
            let source = self.session(from);
            let status = source.info()?.status;
            if !matches!(
                status,
                crate::api::SessionStatus::Interrupted | crate::api::SessionStatus::Closed
            ) {
                return Err(ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!(
                        "from: session {from} is {status:?}; only an interrupted or closed session can be continued"
                    ),
                ));
            }
            request.transcript = source.transcript()?.0;
            if request.transcript.is_empty() {
                // Nothing to import: the capability check must not refuse an empty continuation.
                log::info!("session {from} has no saved transcript; the new session starts empty");
            }
        }
        let id = match &self.options.instance {
            Some(instance) => SessionId::generate_for(instance),
            None => SessionId::generate(),
        }
        .map_err(|error| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("generating a session id: {error}"),
            )
        })?;
        let [state_dir, workspace_dir] =
            crate::datadir::session_dirs(&self.options.data_dir, &request.agentloop.name, &id);
        let info: SessionInfo = api::request(&self.commands, |reply| Command::Create {
            id,
            request: Box::new(request),
            state_dir,
            workspace_dir,
            key,
            reply,
        })?;
        // A repeated key answers the session the first create made, under its id.
        let id = info.session_id.clone();
        let created = std::os::unix::fs::DirBuilderExt::mode(
            std::fs::DirBuilder::new().recursive(true),
            0o700,
        )
        .create(&info.state_dir);
        if let Err(error) = created {
            log::warn!(
                "session {id}: creating its state directory {} failed: {error}",
                info.state_dir.display()
            );
        }
        Ok(self.session(&id))
    }

    /// Parses a create-session request from JSON (strictly) and creates it.
    pub fn create_session_json(&self, json: &[u8]) -> Result<Session, ApiError> {
        let request =
            CreateSession::parse(json).map_err(|error| ApiError::new(error.code, error.message))?;
        self.create_session(request)
    }

    /// A handle on an existing session. Never blocks; calls on it answer `unknown_session` if
    /// there is no such session.
    pub fn session(&self, id: &SessionId) -> Session {
        Session {
            id: id.clone(),
            commands: self.commands.clone(),
            journal: self.journal.clone(),
            recovered: Arc::default(),
        }
    }

    /// Prometheus text: workers by state, restarts, activations by outcome, queue depth, slots in
    /// use, schedule-to-start and activation latency histograms, callbacks by method and code,
    /// unknown outcomes. Never blocks on the dispatcher.
    pub fn metrics_text(&self) -> String {
        let status = self.status();
        let queues = self
            .queues
            .iter()
            .map(|(name, slot, queue)| (name.clone(), *slot, queue.waiting(), queue.running()))
            .collect();
        self.metrics.render(&crate::metrics::Gauges {
            status: &status,
            queues,
            journal: self.disk.as_ref().map(|disk| {
                let stats = disk.stats();
                (stats.flushes, stats.records, stats.loaded_sessions)
            }),
        })
    }

    /// Every session, in id order.
    pub fn sessions(&self) -> Result<Vec<SessionInfo>, ApiError> {
        api::request(&self.commands, |reply| Command::List { reply })
    }

    /// Stops Brain: new sessions and activations are refused (`shutting_down`), queued activations
    /// end `cancelled` (`shutting_down`), running ones are sent `cancel` (and their workers killed
    /// one cancel grace later if they do not answer); then each healthy worker is sent `shutdown`,
    /// its stdin is closed once it answers, and its process group is killed if it is still running
    /// `grace` later (a zero grace skips the cancel and kills at once). Blocks until every worker
    /// has been reaped. Calling it again does nothing.
    pub fn shutdown(&self, grace: Duration) {
        self.stop(grace);
    }

    /// Shuts down as PROTOCOL.md §12 says: new sessions and activations are refused
    /// (`shutting_down`) and readiness fails at once; queued activations end `cancelled`
    /// (`shutting_down`); running ones may finish within `drain`, their callbacks still served;
    /// what still runs then is cancelled (and its worker killed one cancel grace later if it does
    /// not answer); then every worker is sent `shutdown` and killed `grace` later if still there.
    /// Blocks until every worker is reaped. Calling it again while it waits — from another thread,
    /// e.g. on a second signal — skips whatever wait is left.
    pub fn shutdown_after(&self, drain: Duration, grace: Duration) {
        self.stop_with(drain, grace);
    }

    fn stop(&self, grace: Duration) {
        self.stop_with(Duration::ZERO, grace);
    }

    fn stop_with(&self, drain: Duration, grace: Duration) {
        let (done, finished) = crossbeam_channel::bounded::<()>(0);
        if self
            .commands
            .send(Command::Shutdown { drain, grace, done })
            .is_ok()
        {
            // Returns when the dispatcher drops `done`, i.e. when it has stopped.
            let _ = finished.recv();
        }
        let dispatcher = self.dispatcher.lock().take();
        if let Some(dispatcher) = dispatcher
            && dispatcher.join().is_err()
        {
            log::error!("the dispatcher thread panicked");
        }
    }
}

impl Drop for Brain {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

impl fmt::Debug for Brain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Brain")
            .field("running", &self.dispatcher.lock().is_some())
            .finish()
    }
}
