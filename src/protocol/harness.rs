//! brain/harness/v1 payloads: the single source of truth for what crosses a harness's stdio.
//!
//! Every params and result object of every method is a serde type here. Unknown fields in a
//! harness's messages are ignored (serde's default); strictness belongs to registrations, session
//! requests and configuration, which are parsed elsewhere.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt;
use std::str::FromStr;

/// The protocol name, sent in `initialize` and required back.
pub const PROTOCOL: &str = "brain/harness/v1";

/// Method names Brain calls on a harness.
pub mod method {
    /// The first request on every worker.
    pub const INITIALIZE: &str = "initialize";
    /// Start an activation.
    pub const RUN: &str = "run";
    /// Cancel a running activation.
    pub const CANCEL: &str = "cancel";
    /// Release a session's in-memory state.
    pub const CLOSE: &str = "close";
    /// The worker is about to be stopped.
    pub const SHUTDOWN: &str = "shutdown";
    /// The one method a harness calls on Brain.
    pub const BRAIN_CALL: &str = "brain/call";
}

/// Brain's name and version, sent in `initialize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BrainInfo {
    /// Always `"brain"`.
    pub name: String,
    /// Brain's version.
    pub version: String,
}

/// Params of `initialize`, Brain's first request to every worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitializeParams {
    /// Always [`PROTOCOL`].
    pub protocol: String,
    /// Who is calling.
    pub brain: BrainInfo,
    /// The registration this worker belongs to.
    pub registration: String,
    /// The worker's slot number within its registration.
    pub worker: u32,
    /// The deployment configuration of the registration.
    pub configuration: Map<String, Value>,
    /// The directory beneath which session state directories live (`<data>/agentloops/<name>`).
    pub state_root: String,
    /// How many activations Brain runs on this worker at once.
    pub max_concurrency: u32,
    /// The longest line Brain writes or accepts, in bytes.
    pub max_line_bytes: u64,
}

/// A harness's name and version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The harness's name, e.g. `agentloop-pi`.
    pub name: String,
    /// The harness's version.
    pub version: String,
}

/// What a harness supports beyond the base protocol. Absent is false; unknown keys are ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Capabilities {
    /// Accepts media blocks (https URLs only).
    pub media: bool,
    /// Accepts an imported transcript at session creation.
    pub transcript_import: bool,
    /// Keeps a session's first tool catalogue for the session's life.
    pub fixed_tool_catalogue: bool,
}

/// The answer to `initialize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitializeResult {
    /// Must equal [`PROTOCOL`].
    pub protocol: String,
    /// The harness's identity, bound to the data directory.
    pub identity: Identity,
    /// The version of the harness's native state format, bound to the data directory.
    pub state_version: String,
    /// Optional capabilities; absent is all false.
    #[serde(default)]
    pub capabilities: Capabilities,
    /// The configuration keys the harness understands; absent accepts every key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configuration_keys: Option<Vec<String>>,
    /// Model metadata a session must supply (e.g. `context_window`); absent is none.
    #[serde(default)]
    pub required_model_metadata: Vec<String>,
}

/// Params of `shutdown`: an empty object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownParams {}

/// The `data.code` values of Brain's errors (PROTOCOL.md §10). Callers match on these strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// A request is malformed or names something it may not.
    InvalidRequest,
    /// A configuration key or value is refused.
    InvalidConfiguration,
    /// Model metadata the harness requires is missing.
    MissingModelMetadata,
    /// The harness cannot accept this input.
    UnsupportedInput,
    /// No registration has that name.
    UnknownAgentloop,
    /// The registration has no healthy worker.
    AgentloopUnavailable,
    /// No session has that id.
    UnknownSession,
    /// An activation is queued or running.
    SessionBusy,
    /// The session's activation marker is set.
    SessionInterrupted,
    /// The session is closed.
    SessionClosed,
    /// The callback names nothing this worker owns.
    ActivationNotActive,
    /// The callback's activation has closed its authority.
    ActivationClosed,
    /// `run` was answered while callbacks were unanswered.
    CallbacksOutstanding,
    /// The method is unknown.
    UnknownMethod,
    /// A field has the wrong type or value.
    InvalidInput,
    /// A harness answered with the wrong shape.
    InvalidResponse,
    /// A harness failed without a usable code.
    HarnessError,
    /// A `brain.` key was written.
    ReservedKey,
    /// The environment or permission was not granted.
    NotGranted,
    /// The model call failed.
    ModelFailed,
    /// The tool never started.
    ToolFailed,
    /// The effect may or may not have happened.
    OutcomeUnknown,
    /// The activation was cancelled.
    Cancelled,
    /// The worker died or was killed.
    WorkerLost,
    /// The worker did not answer `initialize` in time.
    InitTimeout,
    /// The harness identity does not match the data directory.
    IdentityMismatch,
    /// A line would exceed the line limit.
    InputTooLarge,
    /// The journal could not make a record durable.
    JournalFailed,
    /// Brain stopped while this was in flight.
    Interrupted,
    /// Brain is shutting down.
    ShuttingDown,
    /// A request reused an outstanding id.
    DuplicateId,
    /// Too many requests at once.
    Overloaded,
    /// The activation's wall deadline expired.
    DeadlineExceeded,
}

impl ErrorCode {
    /// Every code, in the order of PROTOCOL.md §10.
    pub const ALL: [ErrorCode; 33] = [
        ErrorCode::InvalidRequest,
        ErrorCode::InvalidConfiguration,
        ErrorCode::MissingModelMetadata,
        ErrorCode::UnsupportedInput,
        ErrorCode::UnknownAgentloop,
        ErrorCode::AgentloopUnavailable,
        ErrorCode::UnknownSession,
        ErrorCode::SessionBusy,
        ErrorCode::SessionInterrupted,
        ErrorCode::SessionClosed,
        ErrorCode::ActivationNotActive,
        ErrorCode::ActivationClosed,
        ErrorCode::CallbacksOutstanding,
        ErrorCode::UnknownMethod,
        ErrorCode::InvalidInput,
        ErrorCode::InvalidResponse,
        ErrorCode::HarnessError,
        ErrorCode::ReservedKey,
        ErrorCode::NotGranted,
        ErrorCode::ModelFailed,
        ErrorCode::ToolFailed,
        ErrorCode::OutcomeUnknown,
        ErrorCode::Cancelled,
        ErrorCode::WorkerLost,
        ErrorCode::InitTimeout,
        ErrorCode::IdentityMismatch,
        ErrorCode::InputTooLarge,
        ErrorCode::JournalFailed,
        ErrorCode::Interrupted,
        ErrorCode::ShuttingDown,
        ErrorCode::DuplicateId,
        ErrorCode::Overloaded,
        ErrorCode::DeadlineExceeded,
    ];

    /// The snake_case string callers match on.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::InvalidConfiguration => "invalid_configuration",
            ErrorCode::MissingModelMetadata => "missing_model_metadata",
            ErrorCode::UnsupportedInput => "unsupported_input",
            ErrorCode::UnknownAgentloop => "unknown_agentloop",
            ErrorCode::AgentloopUnavailable => "agentloop_unavailable",
            ErrorCode::UnknownSession => "unknown_session",
            ErrorCode::SessionBusy => "session_busy",
            ErrorCode::SessionInterrupted => "session_interrupted",
            ErrorCode::SessionClosed => "session_closed",
            ErrorCode::ActivationNotActive => "activation_not_active",
            ErrorCode::ActivationClosed => "activation_closed",
            ErrorCode::CallbacksOutstanding => "callbacks_outstanding",
            ErrorCode::UnknownMethod => "unknown_method",
            ErrorCode::InvalidInput => "invalid_input",
            ErrorCode::InvalidResponse => "invalid_response",
            ErrorCode::HarnessError => "harness_error",
            ErrorCode::ReservedKey => "reserved_key",
            ErrorCode::NotGranted => "not_granted",
            ErrorCode::ModelFailed => "model_failed",
            ErrorCode::ToolFailed => "tool_failed",
            ErrorCode::OutcomeUnknown => "outcome_unknown",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::WorkerLost => "worker_lost",
            ErrorCode::InitTimeout => "init_timeout",
            ErrorCode::IdentityMismatch => "identity_mismatch",
            ErrorCode::InputTooLarge => "input_too_large",
            ErrorCode::JournalFailed => "journal_failed",
            ErrorCode::Interrupted => "interrupted",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::DuplicateId => "duplicate_id",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
        }
    }

    /// Whether a callback error with this code stops the activation (PROTOCOL.md §10).
    pub fn is_fatal(self) -> bool {
        matches!(
            self,
            ErrorCode::JournalFailed
                | ErrorCode::ActivationClosed
                | ErrorCode::Cancelled
                | ErrorCode::WorkerLost
                | ErrorCode::ShuttingDown
        )
    }

    /// The JSON-RPC error code Brain sends with this `data.code` (PROTOCOL.md §3).
    pub fn rpc_code(self) -> i64 {
        use crate::protocol::jsonrpc;
        match self {
            ErrorCode::UnknownMethod => jsonrpc::METHOD_NOT_FOUND,
            ErrorCode::InvalidInput => jsonrpc::INVALID_PARAMS,
            ErrorCode::InvalidRequest => jsonrpc::INVALID_REQUEST,
            _ => jsonrpc::SERVER_ERROR,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ErrorCode {
    type Err = ();

    fn from_str(s: &str) -> Result<ErrorCode, ()> {
        ErrorCode::ALL
            .into_iter()
            .find(|code| code.as_str() == s)
            .ok_or(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_round_trip_through_serde_and_strings() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, Value::String(code.as_str().into()));
            assert_eq!(code.as_str().parse::<ErrorCode>(), Ok(code));
        }
        let fatal: Vec<_> = ErrorCode::ALL
            .into_iter()
            .filter(|c| c.is_fatal())
            .map(ErrorCode::as_str)
            .collect();
        assert_eq!(
            fatal,
            [
                "activation_closed",
                "cancelled",
                "worker_lost",
                "journal_failed",
                "shutting_down"
            ]
        );
    }
}
