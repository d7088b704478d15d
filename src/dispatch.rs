//! The dispatcher thread: the one owner of worker, session and activation state.
//!
//! Four channels feed it, polled in priority order: due deadlines from the timer thread; internal
//! completions (a record became durable, a callback finished);
//! commands from API callers; and events from the workers' threads. Deadlines come first so that a
//! harness flooding its stdout cannot delay a kill; completions next because they free resources.
//! The dispatcher never blocks on anything but these channels: pipe writes belong to writer
//! threads, waits for processes to waiter threads, fsyncs to the journal, effects to the callback
//! executor.

use crate::api::{Activation, ApiError, Cancelled, SessionInfo};
use crate::callbacks::{CallbackDone, Executor};
use crate::capacity::CapacityQueue;
use crate::effects::Effects;
use crate::journal::{Journal, JournalError};
use crate::options::Options;
use crate::pool::{Deadline, Happening, Pool, StartupRefusal};
use crate::protocol::harness::UserInput;
use crate::session::{CreateSession, Keyed, SessionId, SessionIdMap};
use crate::sessions::{DurableToken, QueueEntry, SessionState};
use crate::timer::Timer;
use crate::worker::{WorkerEvent, WorkerKey};
use crossbeam_channel::{Receiver, Sender, never, select_biased};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where the dispatcher answers a command: the caller waits on the other half.
pub(crate) type Reply<T> = crate::handoff::Promise<Result<T, ApiError>>;

/// Requests from API callers to the dispatcher. Each carries the channel its answer goes to.
#[derive(Debug)]
pub(crate) enum Command {
    /// Stop: refuse new work, let running activations finish within `drain`, cancel what still
    /// runs, stop every worker (killing each `grace` after its `shutdown`), end the loop; `done` is
    /// dropped at the end. A second request skips whatever wait is left.
    Shutdown {
        drain: Duration,
        grace: Duration,
        done: Sender<()>,
    },
    /// Create a session (already parsed and validated by the caller).
    Create {
        id: SessionId,
        request: Box<CreateSession>,
        state_dir: PathBuf,
        /// Where the session's tools work: `<data>/workspaces/<id>`, one directory per environment.
        workspace_dir: PathBuf,
        /// The client's idempotency key with the request's digest: a create that repeats one is
        /// answered with the session it created.
        key: Option<Keyed>,
        reply: Reply<SessionInfo>,
    },
    /// Start an activation.
    Send {
        session: SessionId,
        input: Option<UserInput>,
        deadline: Option<Duration>,
        /// The client's idempotency key with the request's digest: a send that repeats one is
        /// answered with the activation it admitted.
        key: Option<Keyed>,
        reply: Reply<Activation>,
    },
    /// Cancel the session's activation (this one, when `sequence` is given).
    Cancel {
        session: SessionId,
        sequence: Option<u64>,
        reply: Reply<Cancelled>,
    },
    /// Passivate a session.
    Passivate {
        session: SessionId,
        reply: Reply<SessionInfo>,
    },
    /// Close a session.
    Close {
        session: SessionId,
        reply: Reply<SessionInfo>,
    },
    /// Delete a session; answers with its state and workspace directories for the caller to
    /// remove once the deletion is durable.
    Delete {
        session: SessionId,
        reply: Reply<[PathBuf; 2]>,
    },
    /// Append a client event for the harness to see at its next activation.
    ClientEvent {
        session: SessionId,
        event_type: String,
        data: serde_json::Value,
        reply: Reply<u64>,
    },
    /// View one session.
    Info {
        session: SessionId,
        reply: Reply<SessionInfo>,
    },
    /// View every session.
    List { reply: Reply<Vec<SessionInfo>> },
}

/// Completions the dispatcher's own helpers report.
pub(crate) enum Internal {
    /// Records up to a sequence are durable (or failed to become so).
    Durable {
        token: DurableToken,
        result: Result<(), JournalError>,
    },
    /// A callback finished on the executor.
    CallbackDone(CallbackDone),
    /// Quiet reports wait that the dispatcher must take now (see `Executor::take_quiet_reports`).
    QuietReports,
}

/// The channels the dispatcher reads.
pub(crate) struct Inputs {
    pub(crate) deadlines: Receiver<Deadline>,
    pub(crate) internal: Receiver<Internal>,
    pub(crate) commands: Receiver<Command>,
    pub(crate) events: Receiver<(WorkerKey, WorkerEvent)>,
}

/// Everything the dispatcher owns.
pub(crate) struct Dispatcher {
    pub(crate) pool: Pool,
    pub(crate) sessions: SessionIdMap<SessionId, SessionState>,
    pub(crate) journal: Arc<dyn Journal>,
    pub(crate) effects: Effects,
    /// Capacity queues by registration and slot.
    pub(crate) queues: Vec<Vec<Arc<CapacityQueue<QueueEntry>>>>,
    pub(crate) executor: Executor,
    pub(crate) internal: Sender<Internal>,
    pub(crate) commands: Sender<Command>,
    pub(crate) timer: Timer<Deadline>,
    pub(crate) options: Options,
    /// Set once shutdown began: the grace for the workers' `shutdown`, and whether the workers
    /// have been told to stop.
    pub(crate) stopping: Option<Stopping>,
    /// Activations taken off their slot's capacity queue and not yet started, oldest first, with
    /// their registration and slot: started by [`Dispatcher::settle`].
    pub(crate) feeding: std::collections::VecDeque<(usize, u32, QueueEntry)>,
    /// Encoded `run` lines waiting for their `activation_started` record to become durable.
    pub(crate) pending_runs: SessionIdMap<(SessionId, u64), Vec<u8>>,
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
    /// Sessions found in the journal at start and not used since, or passivated or closed since:
    /// their placement. A session is recovered and loaded on its next use.
    pub(crate) dormant: crate::dormant::DormantSessions,
    /// Where native state lives, for sessions loaded on first use.
    pub(crate) data_dir: std::path::PathBuf,
    /// A [`Deadline::TrimHeap`] is set: sessions were made dormant or deleted since the last
    /// trim.
    pub(crate) trim_due: bool,
    /// The registrations, in the pool's order, for sessions loaded on first use.
    pub(crate) registrations: Vec<crate::config::Registration>,
    /// The idempotency keys sessions were created with.
    pub(crate) create_keys: crate::retries::CreateKeys,
}

/// Shutdown progress.
pub(crate) struct Stopping {
    pub(crate) grace: Duration,
    pub(crate) workers_stopped: bool,
}

impl Dispatcher {
    /// Runs until shutdown completes. Sends the startup outcome on `startup` once every worker's
    /// first spawn has settled.
    pub(crate) fn run(mut self, inputs: Inputs, startup: Sender<Result<(), StartupRefusal>>) {
        let Inputs {
            deadlines,
            internal,
            mut commands,
            events,
        } = inputs;
        let mut startup = Some(startup);
        let mut shutdown_waiters: Vec<Sender<()>> = Vec::new();
        self.pool.spawn_all();
        self.settle();
        loop {
            if let Some(reply) = startup.take_if(|_| self.pool.all_settled()) {
                let outcome = self.pool.finish_startup();
                self.pool.publish();
                self.settle();
                let _ = reply.send(outcome);
            }
            if self.finished() {
                break;
            }
            // Before it sleeps, the dispatcher takes the quiet reports sent meanwhile: a success
            // reported after an activation was cancelled here is found now, or finds the
            // cancel and wakes the dispatcher (see `Reply::send`).
            self.take_quiet_reports();
            self.settle();
            select_biased! {
                recv(deadlines) -> deadline => match deadline {
                    Ok(deadline) => self.on_deadline(deadline),
                    Err(_) => break,
                },
                recv(internal) -> completion => match completion {
                    Ok(completion) => self.on_internal(completion),
                    Err(_) => break,
                },
                recv(commands) -> command => match command {
                    Ok(Command::Shutdown { drain, grace, done }) => {
                        shutdown_waiters.push(done);
                        self.begin_shutdown(drain, grace);
                    }
                    Ok(command) => self.on_command(command),
                    Err(_) => {
                        // Every handle is gone without a shutdown: stop at once.
                        commands = never();
                        self.begin_shutdown(Duration::ZERO, Duration::ZERO);
                    }
                },
                recv(events) -> event => match event {
                    Ok((key, event)) => {
                        self.take_reports(&internal);
                        self.pool.on_worker_event(key, event);
                    }
                    Err(_) => break,
                },
            }
            self.settle();
        }
        for queue in self.queues.iter().flatten() {
            queue.stop();
        }
        drop(shutdown_waiters);
    }

    /// Handles every report already sent on `internal`. Called before a worker's message: an
    /// executor reports a callback finished and only then writes its answer, so whatever the
    /// harness says after reading that answer must find the callback counted as answered (the
    /// `select` above may see the worker's message first, as it looks at each channel in turn).
    fn take_reports(&mut self, internal: &Receiver<Internal>) {
        // Only those sent by now: reports that keep arriving meanwhile must not hold the worker's
        // message back for ever.
        for _ in 0..internal.len() {
            let Ok(report) = internal.try_recv() else {
                break;
            };
            self.on_internal(report);
            self.settle();
        }
        self.take_quiet_reports();
        self.settle();
    }

    /// Handles what the pool reported and starts the activations taken off capacity queues,
    /// until neither is left.
    fn settle(&mut self) {
        loop {
            let happenings = self.pool.take_happenings();
            if happenings.is_empty() {
                match self.feeding.pop_front() {
                    Some((registration, slot, entry)) => self.on_fed(registration, slot, entry),
                    None => break,
                }
                continue;
            }
            for happening in happenings {
                match happening {
                    Happening::Request { key, request } => self.on_harness_request(key, request),
                    Happening::Call { key, id, call } => self.on_brain_call(key, id, Ok(call)),
                    Happening::Answered {
                        key,
                        request,
                        outcome,
                    } => self.on_answer(key, request, outcome),
                    Happening::Lost {
                        key,
                        failure,
                        unanswered,
                    } => self.on_worker_lost(key, &failure, unanswered),
                    Happening::SlotState {
                        registration,
                        slot,
                        state,
                    } => self.on_slot_state(registration, slot, state),
                }
            }
        }
        if self.stopping.as_ref().is_some_and(|s| !s.workers_stopped) && self.nothing_running() {
            self.stop_workers();
        }
    }

    fn on_deadline(&mut self, deadline: Deadline) {
        match deadline {
            Deadline::CancelGrace { session, sequence } => {
                self.on_grace_expired(&session, sequence, "cancel")
            }
            Deadline::FatalGrace { session, sequence } => {
                self.on_grace_expired(&session, sequence, "fatal callback error")
            }
            Deadline::Wall { session, sequence } => self.on_wall_deadline(&session, sequence),
            Deadline::ShutdownProceed => {
                if self.stopping.as_ref().is_some_and(|s| !s.workers_stopped) {
                    self.stop_workers();
                }
            }
            Deadline::DrainExpired => {
                if self.stopping.as_ref().is_some_and(|s| !s.workers_stopped) {
                    self.cancel_and_proceed();
                }
            }
            Deadline::TrimHeap => {
                self.trim_due = false;
                crate::heap::give_back();
            }
            other => self.pool.on_deadline(other),
        }
    }

    fn on_internal(&mut self, completion: Internal) {
        match completion {
            Internal::Durable { token, result } => self.on_durable(token, result),
            Internal::CallbackDone(done) => self.on_callback_done(done),
            Internal::QuietReports => self.take_quiet_reports(),
        }
    }

    /// Handles the reports of callbacks that succeeded without waking the dispatcher.
    fn take_quiet_reports(&mut self) {
        for done in self.executor.take_quiet_reports() {
            self.on_callback_done(done);
        }
    }

    fn on_command(&mut self, command: Command) {
        match &command {
            Command::Send { session, .. }
            | Command::Cancel { session, .. }
            | Command::Passivate { session, .. }
            | Command::ClientEvent { session, .. } => self.ensure_loaded(&session.clone()),
            // Each decides whether a dormant session needs loading (`Dispatcher::info_of`,
            // `Dispatcher::close`, `Dispatcher::delete`).
            Command::Info { .. }
            | Command::Close { .. }
            | Command::Delete { .. }
            | Command::List { .. }
            | Command::Shutdown { .. }
            | Command::Create { .. } => {}
        }
        match command {
            Command::Shutdown { .. } => {} // handled in the loop
            Command::Create {
                id,
                request,
                state_dir,
                workspace_dir,
                key,
                reply,
            } => self.create_session(id, *request, [state_dir, workspace_dir], key, reply),
            Command::Send {
                session,
                input,
                deadline,
                key,
                reply,
            } => self.send(&session, input, deadline, key, reply),
            Command::Cancel {
                session,
                sequence,
                reply,
            } => {
                reply.deliver(self.cancel(&session, sequence));
            }
            Command::Passivate { session, reply } => self.passivate(&session, reply),
            Command::Close { session, reply } => self.close(&session, reply),
            Command::Delete { session, reply } => {
                reply.deliver(self.delete(&session));
            }
            Command::ClientEvent {
                session,
                event_type,
                data,
                reply,
            } => self.client_event(&session, event_type, data, reply),
            Command::Info { session, reply } => reply.deliver(self.info_of(&session)),
            Command::List { reply } => reply.deliver(Ok(self.list())),
        }
    }

    /// Recovers and loads a session found in the journal at start, on its first use. Recovery
    /// appends (rare: only for a session a stopped Brain left mid-activation) are waited for here,
    /// so that nothing is served before they are durable.
    pub(crate) fn ensure_loaded(&mut self, session: &SessionId) {
        let Some(_) = self.dormant.remove(session) else {
            return;
        };
        let mut report = crate::recovery::Recovered::default();
        match crate::recovery::recover_session(
            &*self.journal,
            session,
            &self.registrations,
            &self.data_dir,
            &mut report,
        ) {
            Ok(state) => {
                if report.interrupted_activations
                    + report.cancelled_activations
                    + report.unknown_effects
                    > 0
                {
                    log::warn!(
                        "session {session}: recovered: {} activation interrupted, {} queued one cancelled, {} effects finished unknown",
                        report.interrupted_activations,
                        report.cancelled_activations,
                        report.unknown_effects
                    );
                }
                self.sessions.insert(session.clone(), state);
            }
            Err(error) => log::error!("session {session}: cannot be recovered: {error}"),
        }
    }

    /// Begins shutdown: refuse new work, end queued activations, cancel running ones, and stop
    /// the workers once nothing runs (or one cancel grace later).
    fn begin_shutdown(&mut self, drain: Duration, grace: Duration) {
        if let Some(stopping) = &mut self.stopping {
            // A second request skips the drain: the workers are sent `shutdown` now, even with runs
            // in flight, and killed `grace` later (PROTOCOL.md §5.1). A zero grace kills at once.
            stopping.grace = stopping.grace.min(grace);
            let already = stopping.workers_stopped;
            if !already {
                self.stop_workers();
            } else if grace.is_zero() {
                self.pool.begin_shutdown(Duration::ZERO);
            }
            return;
        }
        self.stopping = Some(Stopping {
            grace,
            workers_stopped: false,
        });
        self.pool.mark_shutting_down();
        self.end_queued_for_shutdown();
        if grace.is_zero() {
            self.stop_workers();
        } else if drain.is_zero() || self.nothing_running() {
            self.cancel_and_proceed();
        } else {
            log::info!("shutting down: draining running activations for at most {drain:?}");
            self.timer
                .at(std::time::Instant::now() + drain, Deadline::DrainExpired);
        }
    }

    /// Cancels what still runs and stops the workers once it has ended, or one cancel grace later.
    fn cancel_and_proceed(&mut self) {
        self.cancel_all_running();
        self.timer.at(
            std::time::Instant::now() + self.options.cancel_grace,
            Deadline::ShutdownProceed,
        );
    }

    /// Sends `shutdown` to the workers (kill `grace` later) once; later calls do nothing.
    fn stop_workers(&mut self) {
        let grace = match &mut self.stopping {
            Some(stopping) if !stopping.workers_stopped => {
                stopping.workers_stopped = true;
                stopping.grace
            }
            Some(_) | None => return,
        };
        self.pool.begin_shutdown(grace);
    }

    /// Shutdown is complete: the workers are reaped and no activation is waiting for a record.
    fn finished(&self) -> bool {
        self.stopping.as_ref().is_some_and(|s| s.workers_stopped)
            && self.pool.stopped()
            && self.nothing_running()
    }
}
