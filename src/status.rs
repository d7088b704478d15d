//! What callers can see of the worker pool: a snapshot published by the dispatcher.
//!
//! The dispatcher owns the pool; after every change it publishes a fresh [`PoolStatus`] to the
//! [`StatusBoard`], a small mutex-and-condvar cell. Readers (readiness probes, `brain check`,
//! tests) read or wait on the board and never touch the dispatcher's state.

use crate::protocol::harness::{ErrorCode, InitializeResult};
use crate::protocol::jsonrpc::Violation;
use crate::worker::process::Exit;
use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use std::fmt;
use std::time::{Duration, Instant};

/// The life-cycle state of one worker slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Spawned; `initialize` not yet answered.
    Starting,
    /// Answered `initialize`; serving.
    Healthy,
    /// Lost or refused; being killed, or waiting for its respawn.
    Failed,
    /// Failed too often (or changed identity): not respawned until Brain restarts.
    Quarantined,
    /// Being shut down.
    Stopping,
    /// Shut down.
    Stopped,
}

/// Why a worker was lost or refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureReason {
    /// The process could not be started.
    SpawnFailed(String),
    /// `initialize` was not answered within the deadline.
    InitTimeout,
    /// `initialize` was answered with an error.
    InitError(String),
    /// `initialize` was answered with another protocol.
    WrongProtocol(String),
    /// The `initialize` answer had the wrong shape.
    InvalidInitialize(String),
    /// The harness's identity or declarations differ from its registration's.
    IdentityMismatch(String),
    /// The process exited (or its stdout closed) on its own.
    Exited,
    /// Too many protocol violations; the last one is named.
    Faulty(Violation),
    /// Brain killed it: the reason says why (a cancel grace that expired, …).
    Killed(String),
}

impl FailureReason {
    /// The protocol error code this failure maps to.
    pub fn code(&self) -> ErrorCode {
        match self {
            FailureReason::InitTimeout => ErrorCode::InitTimeout,
            FailureReason::IdentityMismatch(_) => ErrorCode::IdentityMismatch,
            FailureReason::InitError(_)
            | FailureReason::WrongProtocol(_)
            | FailureReason::InvalidInitialize(_) => ErrorCode::InvalidResponse,
            FailureReason::SpawnFailed(_)
            | FailureReason::Exited
            | FailureReason::Faulty(_)
            | FailureReason::Killed(_) => ErrorCode::WorkerLost,
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureReason::SpawnFailed(why) => write!(f, "could not start: {why}"),
            FailureReason::InitTimeout => f.write_str("did not answer initialize in time"),
            FailureReason::InitError(why) => write!(f, "answered initialize with an error: {why}"),
            FailureReason::WrongProtocol(got) => {
                write!(f, "speaks protocol {got:?}, not brain/harness/v1")
            }
            FailureReason::InvalidInitialize(why) => {
                write!(f, "answered initialize with an invalid result: {why}")
            }
            FailureReason::IdentityMismatch(why) => write!(f, "identity mismatch: {why}"),
            FailureReason::Exited => f.write_str("exited"),
            FailureReason::Faulty(last) => {
                write!(f, "too many protocol violations (last: {last})")
            }
            FailureReason::Killed(why) => write!(f, "killed: {why}"),
        }
    }
}

/// A worker's last failure: why, how the process ended, and what it last wrote to stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerFailure {
    /// Why it failed.
    pub reason: FailureReason,
    /// How the process ended; `None` when it never started.
    pub exit: Option<Exit>,
    /// The last lines of its stderr (at most 2 KiB).
    pub stderr_tail: String,
}

impl fmt::Display for WorkerFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]", self.reason, self.reason.code())?;
        if let Some(exit) = &self.exit {
            write!(f, "; {exit}")?;
        }
        if !self.stderr_tail.is_empty() {
            write!(f, "; stderr tail:\n{}", self.stderr_tail)?;
        }
        Ok(())
    }
}

impl Serialize for WorkerFailure {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("WorkerFailure", 4)?;
        s.serialize_field("code", self.reason.code().as_str())?;
        s.serialize_field("reason", &self.reason.to_string())?;
        s.serialize_field("exit", &self.exit.map(|exit| exit.to_string()))?;
        s.serialize_field("stderr_tail", &self.stderr_tail)?;
        s.end()
    }
}

/// One worker slot as callers see it.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerStatus {
    /// The slot number.
    pub slot: u32,
    /// Its state.
    pub state: WorkerState,
    /// The pid of its current process, if one is running.
    pub pid: Option<u32>,
    /// How many times the slot was respawned.
    pub restarts: u64,
    /// The latest `initialize` answer of this slot.
    pub initialized: Option<InitializeResult>,
    /// Spawn-to-answer latency of that `initialize`, in milliseconds.
    pub init_latency_ms: Option<f64>,
    /// The most recent failure, if any.
    pub last_failure: Option<WorkerFailure>,
    /// Protocol violations seen from its current process.
    pub violations: u64,
}

/// One registration's workers.
#[derive(Debug, Clone, Serialize)]
pub struct RegistrationStatus {
    /// The registration's name.
    pub name: String,
    /// Its slots, in slot order.
    pub workers: Vec<WorkerStatus>,
}

impl RegistrationStatus {
    /// Whether any worker of this registration can serve requests.
    pub fn available(&self) -> bool {
        self.workers.iter().any(|w| w.state == WorkerState::Healthy)
    }
}

/// A snapshot of the whole pool.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PoolStatus {
    /// Whether Brain is shutting down.
    pub shutting_down: bool,
    /// Why the journal can no longer make records durable, once a write or flush failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal_failure: Option<String>,
    /// Every registration, in name order.
    pub registrations: Vec<RegistrationStatus>,
}

impl PoolStatus {
    /// Readiness: not shutting down, the journal healthy, and some worker of some registration
    /// healthy.
    pub fn ready(&self) -> bool {
        !self.shutting_down
            && self.journal_failure.is_none()
            && self.registrations.iter().any(RegistrationStatus::available)
    }

    /// The registration with this name.
    pub fn registration(&self, name: &str) -> Option<&RegistrationStatus> {
        self.registrations.iter().find(|r| r.name == name)
    }

    /// The worker in this slot of this registration.
    pub fn worker(&self, registration: &str, slot: u32) -> Option<&WorkerStatus> {
        self.registration(registration)?
            .workers
            .iter()
            .find(|w| w.slot == slot)
    }
}

/// The published snapshot and a condvar to wait for changes.
#[derive(Debug, Default)]
pub(crate) struct StatusBoard {
    status: Mutex<PoolStatus>,
    changed: Condvar,
}

impl StatusBoard {
    pub(crate) fn publish(&self, status: PoolStatus) {
        *self.status.lock() = status;
        self.changed.notify_all();
    }

    pub(crate) fn snapshot(&self) -> PoolStatus {
        self.status.lock().clone()
    }

    /// Blocks until `done` holds for the published status or `timeout` passes; returns the last
    /// status seen and whether `done` held.
    pub(crate) fn wait_until(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&PoolStatus) -> bool,
    ) -> (PoolStatus, bool) {
        let deadline = Instant::now() + timeout;
        let mut status = self.status.lock();
        loop {
            if done(&status) {
                return (status.clone(), true);
            }
            if self.changed.wait_until(&mut status, deadline).timed_out() {
                let held = done(&status);
                return (status.clone(), held);
            }
        }
    }
}
