//! What the library API hands to callers: sessions, activation handles, outcomes, errors.

use crate::dispatch::Command;
use crate::journal::Journal;
use crate::protocol::harness::{ErrorCode, Event, UserInput};
use crate::session::{IdempotencyKey, SessionId};
use crate::watch::WatchedJournal;
use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use serde_json::Value;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why Brain refused a call. `code` is what callers match on (PROTOCOL.md §10).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiError {
    /// The error code.
    pub code: ErrorCode,
    /// What was wrong, for people.
    pub message: String,
}

impl ApiError {
    /// An error with this code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn shutting_down() -> ApiError {
        ApiError::new(ErrorCode::ShuttingDown, "Brain is shutting down")
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

/// A session's status as callers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    /// Accepts activations.
    Open,
    /// Memory released; the next activation reopens it.
    Passivated,
    /// The activation marker is set and nothing runs: every activation is refused.
    Interrupted,
    /// No further activations; still readable.
    Closed,
}

/// A view of one session.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionInfo {
    /// Its id.
    pub session_id: SessionId,
    /// Its status.
    pub status: SessionStatus,
    /// The registration it runs on.
    pub registration: String,
    /// The worker slot it is placed on, for its whole life.
    pub worker: u32,
    /// The activation queued or running, if any.
    pub active: Option<u64>,
    /// The activation marker (`brain.harness.activation`), if set.
    pub marker: Option<u64>,
    /// The native state directory of the session.
    pub state_dir: PathBuf,
}

/// How an activation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKind {
    /// The harness answered `run` with a result.
    Completed,
    /// It was cancelled.
    Cancelled,
    /// It failed; the error says why.
    Failed,
}

impl OutcomeKind {
    /// `completed`, `cancelled` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeKind::Completed => "completed",
            OutcomeKind::Cancelled => "cancelled",
            OutcomeKind::Failed => "failed",
        }
    }
}

/// The error of an activation that did not complete. `code` is a protocol code, or the harness's
/// own `data.code` when it gave a valid one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ActivationError {
    /// The failure code.
    pub code: String,
    /// What happened (at most 4 KiB).
    pub message: String,
}

/// The recorded outcome of an activation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    /// The session.
    pub session_id: SessionId,
    /// The activation's sequence.
    pub sequence: u64,
    /// How it ended.
    pub outcome: OutcomeKind,
    /// The harness's result, when it completed with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Why it did not complete.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ActivationError>,
}

/// A one-shot cell an activation's outcome is written to, and callers wait on.
#[derive(Debug, Default)]
pub(crate) struct OutcomeCell {
    outcome: Mutex<Option<Outcome>>,
    done: Condvar,
}

impl OutcomeCell {
    /// Sets the outcome (the first one wins) and wakes every waiter.
    pub(crate) fn complete(&self, outcome: Outcome) {
        let mut slot = self.outcome.lock();
        if slot.is_none() {
            *slot = Some(outcome);
            self.done.notify_all();
        }
    }

    fn wait_until(&self, deadline: Option<Instant>) -> Option<Outcome> {
        let mut slot = self.outcome.lock();
        loop {
            if let Some(outcome) = slot.as_ref() {
                return Some(outcome.clone());
            }
            match deadline {
                Some(deadline) => {
                    if self.done.wait_until(&mut slot, deadline).timed_out() {
                        return slot.clone();
                    }
                }
                None => self.done.wait(&mut slot),
            }
        }
    }
}

/// An admitted activation. Its `activation_queued` record is durable; its outcome will be
/// recorded whatever happens (Brain records `interrupted` for it if Brain itself stops first).
///
/// `Send + Sync`; wait from any thread, cancel from any other with a [`Canceller`].
#[derive(Debug, Clone)]
pub struct Activation {
    pub(crate) session_id: SessionId,
    pub(crate) sequence: u64,
    pub(crate) cell: Arc<OutcomeCell>,
    pub(crate) commands: Sender<Command>,
}

impl Activation {
    /// The session.
    pub fn session_id(&self) -> &SessionId {
        &self.session_id
    }

    /// The activation's sequence: the `activation_queued` record that admitted it.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Blocks until the outcome is recorded.
    pub fn wait(&self) -> Outcome {
        // Without a deadline the cell only returns with an outcome.
        self.cell
            .wait_until(None)
            .unwrap_or_else(|| unreachable_outcome(self))
    }

    /// Blocks until the outcome is recorded or `timeout` passes (`None`).
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Outcome> {
        self.cell.wait_until(Some(Instant::now() + timeout))
    }

    /// The outcome, if already recorded. Never blocks.
    pub fn outcome(&self) -> Option<Outcome> {
        self.cell.outcome.lock().clone()
    }

    /// A handle that cancels this activation from any thread.
    pub fn canceller(&self) -> Canceller {
        Canceller {
            session_id: self.session_id.clone(),
            sequence: self.sequence,
            commands: self.commands.clone(),
        }
    }
}

fn unreachable_outcome(activation: &Activation) -> Outcome {
    Outcome {
        session_id: activation.session_id.clone(),
        sequence: activation.sequence,
        outcome: OutcomeKind::Failed,
        result: None,
        error: Some(ActivationError {
            code: ErrorCode::Interrupted.as_str().to_owned(),
            message: "the outcome was never recorded".to_owned(),
        }),
    }
}

/// What a cancel did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Cancelled {
    /// The activation's sequence.
    pub sequence: u64,
    /// `true` when the activation had started: the harness was sent `cancel`, and the session
    /// will be `interrupted` (its marker stays) unless the harness completes anyway.
    pub was_running: bool,
}

/// Cancels one activation; `Send + Clone`, usable from any thread.
#[derive(Debug, Clone)]
pub struct Canceller {
    session_id: SessionId,
    sequence: u64,
    commands: Sender<Command>,
}

impl Canceller {
    /// Cancels the activation: a queued one is removed and never reaches the harness; a running
    /// one is sent `cancel`, and its worker is killed if `run` is still unanswered one cancel grace
    /// later. Blocks only for the dispatcher's answer. Refuses `activation_not_active` when the
    /// activation already ended.
    pub fn cancel(&self) -> Result<Cancelled, ApiError> {
        request(&self.commands, |reply| Command::Cancel {
            session: self.session_id.clone(),
            sequence: Some(self.sequence),
            reply,
        })
    }
}

/// Sends a command built around a reply channel and blocks for the answer.
pub(crate) fn request<T>(
    commands: &Sender<Command>,
    build: impl FnOnce(crate::dispatch::Reply<T>) -> Command,
) -> Result<T, ApiError> {
    let (reply, answer) = crate::handoff::oneshot();
    commands
        .send(build(reply))
        .map_err(|_| ApiError::shutting_down())?;
    answer.wait().ok_or_else(ApiError::shutting_down)?
}

/// Options of [`crate::Brain::create_session_with`].
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    /// Continue this `interrupted` or `closed` session's conversation
    /// ([`crate::Brain::create_session_from`]).
    pub from: Option<SessionId>,
    /// A retried create with this key and the same request gets the session the first one made.
    pub idempotency_key: Option<IdempotencyKey>,
}

/// Options of [`Session::send_with`].
#[derive(Debug, Clone, Default)]
pub struct SendOptions {
    /// A wall deadline: when it expires the activation is cancelled and recorded `failed` /
    /// `deadline_exceeded`.
    pub deadline: Option<Duration>,
    /// A retried send with this key and the same input and deadline gets the activation the first
    /// one admitted.
    pub idempotency_key: Option<IdempotencyKey>,
}

/// A handle on one session: send it input, cancel, passivate, close, delete.
///
/// Cheap to clone, `Send + Sync`. Every method blocks only until the dispatcher has answered and
/// any record it wrote is durable.
#[derive(Clone)]
pub struct Session {
    pub(crate) id: SessionId,
    pub(crate) commands: Sender<Command>,
    pub(crate) journal: Arc<WatchedJournal>,
    /// Whether this handle has made sure the session was recovered (sessions found in the
    /// journal at start are recovered on first use, by the dispatcher).
    pub(crate) recovered: Arc<std::sync::atomic::AtomicBool>,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session").field("id", &self.id).finish()
    }
}

impl Session {
    /// The session's id.
    pub fn id(&self) -> &SessionId {
        &self.id
    }

    /// Starts an activation with this user input. Returns once it is admitted (its
    /// `activation_queued` record durable); the activation then waits for capacity and runs.
    /// Refuses `session_busy` (one is queued or running), `session_interrupted`, `session_closed`,
    /// `agentloop_unavailable`, `overloaded` (the slot's queue is full), `unsupported_input`
    /// (media the harness does not accept) and `shutting_down`.
    pub fn send(&self, input: UserInput) -> Result<Activation, ApiError> {
        self.start(Some(input), SendOptions::default())
    }

    /// [`Session::send`] with a wall deadline: when it expires the activation is cancelled and
    /// recorded `failed` / `deadline_exceeded`.
    pub fn send_with_deadline(
        &self,
        input: UserInput,
        deadline: Duration,
    ) -> Result<Activation, ApiError> {
        let options = SendOptions {
            deadline: Some(deadline),
            ..SendOptions::default()
        };
        self.start(Some(input), options)
    }

    /// [`Session::send`] with [`SendOptions`]. A send that repeats an idempotency key with the
    /// same input and deadline is answered with the activation the first one admitted — its
    /// handle, whose outcome is already set when it has ended — and admits nothing, whatever
    /// the session's state now (busy, interrupted or closed by that very activation); with other
    /// input it is refused `idempotency_key_reused` and nothing is written. The key is recorded
    /// in `activation_queued`, so this holds across restarts, for the session's whole life.
    pub fn send_with(
        &self,
        input: UserInput,
        options: SendOptions,
    ) -> Result<Activation, ApiError> {
        self.start(Some(input), options)
    }

    /// Starts an activation without user input, to deliver pending events.
    pub fn deliver_events(&self) -> Result<Activation, ApiError> {
        self.start(None, SendOptions::default())
    }

    /// [`Session::deliver_events`] with [`SendOptions`] (an idempotency key, as for
    /// [`Session::send_with`]).
    pub fn deliver_events_with(&self, options: SendOptions) -> Result<Activation, ApiError> {
        self.start(None, options)
    }

    fn start(
        &self,
        input: Option<UserInput>,
        options: SendOptions,
    ) -> Result<Activation, ApiError> {
        let SendOptions {
            deadline,
            idempotency_key,
        } = options;
        let key = idempotency_key.map(|key| {
            let asked = serde_json::json!({
                "input": input,
                "deadline_ms": deadline.map(|d| d.as_millis() as u64),
            });
            crate::session::Keyed::new(&key, &asked)
        });
        request(&self.commands, |reply| Command::Send {
            session: self.id.clone(),
            input,
            deadline,
            key,
            reply,
        })
    }

    /// Appends a client event (`event_emitted`, origin `client`) for the harness to see in the
    /// `events` of its next activation. Returns the record's sequence once it is durable. Refuses
    /// `session_closed`, and `invalid_request` for an empty type or one of Brain's record kinds.
    pub fn append_event(&self, event_type: &str, data: serde_json::Value) -> Result<u64, ApiError> {
        request(&self.commands, |reply| Command::ClientEvent {
            session: self.id.clone(),
            event_type: event_type.to_owned(),
            data,
            reply,
        })
    }

    /// Cancels the session's queued or running activation (see [`Canceller::cancel`]).
    pub fn cancel(&self) -> Result<Cancelled, ApiError> {
        request(&self.commands, |reply| Command::Cancel {
            session: self.id.clone(),
            sequence: None,
            reply,
        })
    }

    /// A page of the session's journal: records with sequence above `after`, oldest first, at
    /// most `limit`. Reads the journal directly; never waits for the dispatcher.
    pub fn events(&self, after: u64, limit: usize) -> Result<Vec<Event>, ApiError> {
        self.ensure_recovered()?;
        self.journal
            .read(&self.id, after, limit)
            .map_err(|error| ApiError::new(error.code(), error.to_string()))
    }

    /// Blocks until `condition` holds for the session's whole journal, or `timeout` passes.
    /// Returns the records: `Ok` when the condition held, `Err` on timeout. Wakes on every new
    /// record (no polling).
    pub fn wait_for_events(
        &self,
        timeout: Duration,
        mut condition: impl FnMut(&[Event]) -> bool,
    ) -> Result<Vec<Event>, Vec<Event>> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.journal.version();
            let events = self.events(0, usize::MAX).unwrap_or_default();
            if condition(&events) {
                return Ok(events);
            }
            if !self.journal.wait_change(seen, deadline) {
                return Err(events);
            }
        }
    }

    /// The saved transcript (the projection of `transcript_delta` records) and the sequence of the
    /// record it is current through (0 when nothing was saved). Reads the journal directly.
    pub fn transcript(&self) -> Result<(Vec<crate::protocol::harness::Message>, u64), ApiError> {
        self.ensure_recovered()?;
        let view = self
            .journal
            .view(&self.id)
            .map_err(|error| ApiError::new(error.code(), error.to_string()))?;
        Ok((view.transcript, view.transcript_through))
    }

    /// Reads go to the journal directly; the first one through a handle first asks the dispatcher
    /// for the session, which recovers it if this is its first use since the start, so that a
    /// reader never sees what a stopped Brain left unfinished.
    fn ensure_recovered(&self) -> Result<(), ApiError> {
        use std::sync::atomic::Ordering;
        if !self.recovered.load(Ordering::Acquire) {
            self.info()?;
            self.recovered.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// The session's current view.
    pub fn info(&self) -> Result<SessionInfo, ApiError> {
        request(&self.commands, |reply| Command::Info {
            session: self.id.clone(),
            reply,
        })
    }

    /// `open` → `passivated`: the harness is sent `close` (`passivated`) to release memory; the
    /// session keeps its slot and its next activation reopens it. Refuses `session_busy`,
    /// `session_interrupted`, `session_closed`. A second call is a no-op.
    pub fn passivate(&self) -> Result<SessionInfo, ApiError> {
        request(&self.commands, |reply| Command::Passivate {
            session: self.id.clone(),
            reply,
        })
    }

    /// → `closed`: no further activations; journal, transcript and native state stay readable.
    /// Refuses `session_busy`. A second call is a no-op.
    pub fn close(&self) -> Result<SessionInfo, ApiError> {
        request(&self.commands, |reply| Command::Close {
            session: self.id.clone(),
            reply,
        })
    }

    /// Removes a `closed` or `interrupted` session: its journal becomes unreadable at once and its
    /// native state directory is removed. Afterwards the id answers `unknown_session`. Refuses
    /// `session_busy`, and `invalid_request` for a session that is still open or passivated.
    pub fn delete(&self) -> Result<(), ApiError> {
        let dirs = request(&self.commands, |reply| Command::Delete {
            session: self.id.clone(),
            reply,
        })?;
        // The deletion must be durable before the native state and the workspaces go: a crash in
        // between must not bring back a session whose directories are gone.
        self.journal
            .sync()
            .map_err(|error| ApiError::new(error.code(), error.to_string()))?;
        for dir in dirs.iter().filter(|dir| !dir.as_os_str().is_empty()) {
            match std::fs::remove_dir_all(dir) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(ApiError::new(
                        ErrorCode::JournalFailed,
                        format!(
                            "session deleted, but removing {} failed: {error}",
                            dir.display()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}
