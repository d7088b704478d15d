//! The embedding API: start Brain, watch its workers, shut it down.

use crate::config::{ConfigError, Registrations};
use crate::dispatch::{self, Command, Inputs};
use crate::options::Options;
use crate::pool::{Pool, StartupRefusal};
use crate::status::{PoolStatus, StatusBoard};
use crate::timer::Timer;
use crossbeam_channel::Sender;
use std::fmt;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// What [`Brain::start`] needs: the registrations and the tunables.
#[derive(Debug, Clone)]
pub struct Config {
    /// The harness registrations, by name.
    pub registrations: Registrations,
    /// Deadlines, limits and the data directory.
    pub options: Options,
}

impl Config {
    /// A configuration with these registrations and default options.
    pub fn new(registrations: Registrations) -> Config {
        Config {
            registrations,
            options: Options::default(),
        }
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
    Config(ConfigError),
    Refused(StartupRefusal),
    Io(String, std::io::Error),
    Aborted,
}

impl StartError {
    /// Whether the configuration (registrations, declarations) was refused, as opposed to an
    /// operating-system failure.
    pub fn is_configuration(&self) -> bool {
        matches!(
            self.kind,
            StartErrorKind::Config(_) | StartErrorKind::Refused(_)
        )
    }

    /// The registration at fault, when one is.
    pub fn registration(&self) -> Option<&str> {
        match &self.kind {
            StartErrorKind::Config(error) => error.registration(),
            StartErrorKind::Refused(
                StartupRefusal::Disagreement { registration, .. }
                | StartupRefusal::UndeclaredKey { registration, .. },
            ) => Some(registration),
            StartErrorKind::Io(..) | StartErrorKind::Aborted => None,
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
            StartErrorKind::Refused(StartupRefusal::UndeclaredKey { registration, key }) => write!(
                f,
                "registration {registration:?}: field \"configuration\": key {key:?} is not among the harness's configuration_keys"
            ),
            StartErrorKind::Io(what, error) => write!(f, "{what}: {error}"),
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
    dispatcher: Option<JoinHandle<()>>,
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
    pub fn start(config: Config) -> Result<Brain, StartError> {
        let cwd = std::env::current_dir().map_err(io_error("reading the working directory"))?;
        let mut resolved = Vec::with_capacity(config.registrations.len());
        for registration in config.registrations.iter() {
            let program = registration.resolve_command(&cwd)?;
            resolved.push((registration.clone(), program));
        }
        let mut options = config.options;
        options.data_dir = cwd.join(&options.data_dir);

        let (deadline_tx, deadlines) = crossbeam_channel::unbounded();
        let timer = Timer::start(deadline_tx).map_err(io_error("starting the timer thread"))?;
        let (commands_tx, commands) = crossbeam_channel::unbounded();
        let (events_tx, events) = crossbeam_channel::bounded(1024);
        let (startup_tx, startup) = crossbeam_channel::bounded(1);
        let board = Arc::new(StatusBoard::default());
        let pool = Pool::new(resolved, options, events_tx, timer, board.clone());
        let inputs = Inputs {
            deadlines,
            commands,
            events,
        };
        let dispatcher = std::thread::Builder::new()
            .name("brain-dispatch".into())
            .spawn(move || dispatch::run(pool, inputs, startup_tx))
            .map_err(io_error("starting the dispatcher thread"))?;
        let mut brain = Brain {
            commands: commands_tx,
            board,
            dispatcher: Some(dispatcher),
        };
        match startup.recv() {
            Ok(Ok(())) => Ok(brain),
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

    /// Readiness: some worker of some registration is healthy and Brain is not shutting down.
    /// Never blocks on the dispatcher.
    pub fn ready(&self) -> bool {
        self.board.snapshot().ready()
    }

    /// A snapshot of every registration and worker. Never blocks on the dispatcher.
    pub fn status(&self) -> PoolStatus {
        self.board.snapshot()
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

    /// Stops every worker: each healthy one is sent `shutdown`, its stdin is closed once it
    /// answers, and its process group is killed if it is still running `grace` later (a zero grace
    /// kills at once). Blocks until every worker has been reaped. Calling it again does nothing.
    pub fn shutdown(&mut self, grace: Duration) {
        self.stop(grace);
    }

    fn stop(&mut self, grace: Duration) {
        let Some(dispatcher) = self.dispatcher.take() else {
            return;
        };
        let (done, finished) = crossbeam_channel::bounded::<()>(0);
        if self
            .commands
            .send(Command::Shutdown { grace, done })
            .is_ok()
        {
            // Returns when the dispatcher drops `done`, i.e. when it has stopped.
            let _ = finished.recv();
        }
        if dispatcher.join().is_err() {
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
            .field("running", &self.dispatcher.is_some())
            .finish()
    }
}
