//! brain/harness/v1 payloads: the single source of truth for what crosses a harness's stdio.
//!
//! Every params and result object of every method is a serde type here. Unknown fields in a
//! harness's messages are ignored (serde's default); strictness belongs to registrations, session
//! requests and configuration, which are parsed elsewhere.

use crate::jsonrpc::{RequestId, RpcError};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
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
    /// An idempotency key came back with another request than the one it was first sent with.
    IdempotencyKeyReused,
}

impl ErrorCode {
    /// Every code, in the order of PROTOCOL.md §10.
    pub const ALL: [ErrorCode; 34] = [
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
        ErrorCode::IdempotencyKeyReused,
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
            ErrorCode::IdempotencyKeyReused => "idempotency_key_reused",
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
        use crate::jsonrpc;
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

/// Params of `shutdown`: an empty object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownParams {}

/// An empty object: the answer to `cancel`, `close`, `shutdown` and `telemetry`, and the input of
/// `environments.list`. Members a peer adds anyway are ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// Most callbacks of one activation that may be unanswered at once; more fail `overloaded`.
pub const MAX_OUTSTANDING_CALLBACKS: usize = 64;

/// Most events in `run`'s `input.events` and in one `events.read` page.
pub const MAX_EVENTS_PAGE: usize = 1000;

/// The kv key prefix reserved for Brain's own keys; `kv.put`/`kv.delete` on it fail `reserved_key`.
pub const RESERVED_KEY_PREFIX: &str = "brain.";

// ------------------------------------------------------------------------------------------------
// Content: messages and blocks.

/// Who wrote a [`Message`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The user.
    User,
    /// The model.
    Assistant,
    /// The developer (system-level instructions inside the transcript).
    Developer,
}

/// One transcript entry: a role and its content blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// What it says, in order.
    pub content: Vec<Block>,
}

impl Message {
    /// A message holding one text block.
    pub fn text(role: Role, text: impl Into<String>) -> Message {
        Message {
            role,
            content: vec![Block::text(text)],
        }
    }

    /// The message's text blocks, concatenated without a separator (other blocks are skipped).
    pub fn text_content(&self) -> String {
        self.content
            .iter()
            .filter_map(|block| match block {
                Block::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// One piece of content, tagged by its `type` member. (Read by a hand-written `Deserialize` that
/// takes the tag first when it comes first: see `protocol/block.rs`.)
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Block {
    /// Plain text.
    Text {
        /// The text.
        text: String,
    },
    /// An image by URL (only `https:` URLs are accepted, and only by harnesses declaring `media`).
    Image {
        /// Where the image is.
        url: String,
    },
    /// A file by URL (same rules as images).
    File {
        /// The file's media type, e.g. `application/pdf`.
        media_type: String,
        /// Where the file is.
        url: String,
    },
    /// The model asks for a tool call.
    ToolUse {
        /// The call's id, echoed by the matching `tool_result`.
        id: String,
        /// The tool's name.
        name: String,
        /// The tool's input.
        input: Value,
    },
    /// The result of a tool call, fed back to the model.
    ToolResult {
        /// The id of the `tool_use` block this answers.
        tool_use_id: String,
        /// The result's content.
        content: Vec<Block>,
        /// Whether the tool reported an error; absent is false.
        #[serde(default)]
        is_error: bool,
    },
    /// Provider continuation state, passed through untouched.
    Native {
        /// Names the provider format of `data`.
        format: String,
        /// Opaque data.
        data: Value,
    },
}

impl Block {
    /// A text block.
    pub fn text(text: impl Into<String>) -> Block {
        Block::Text { text: text.into() }
    }
}

/// The user's input to one activation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UserInput {
    /// What the user sent.
    pub content: Vec<Block>,
}

/// Who caused an [`Event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OriginKind {
    /// A harness's `emit` during an activation.
    Agentloop,
    /// A tool call.
    Tool,
    /// A client of Brain's API.
    Client,
}

/// Where an [`Event`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EventOrigin {
    /// The kind of source.
    pub kind: OriginKind,
    /// The journal sequence of the source (the activation, the tool call, or the client's record).
    pub sequence: u64,
}

/// An `event_emitted` journal record as a harness sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The record's journal sequence.
    pub sequence: u64,
    /// The event's type, chosen by whoever emitted it.
    #[serde(rename = "type")]
    pub event_type: String,
    /// When Brain recorded it, in milliseconds since the Unix epoch.
    pub recorded_at_ms: u64,
    /// The event's payload.
    pub data: Value,
    /// Who emitted it, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<EventOrigin>,
}

// ------------------------------------------------------------------------------------------------
// `run`.

/// Advisory model metadata for an activation: never credentials.
///
/// Keys beyond the named ones (e.g. `options`) are kept in [`ModelMetadata::extra`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelMetadata {
    /// The provider, e.g. `openai` or `scripted`.
    pub provider: String,
    /// The model's name.
    pub name: String,
    /// The context window in tokens, when supplied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u64>,
    /// The output limit in tokens, when supplied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// Every other key, kept as given.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// An environment incarnation: the environment's name and the sequence of the record that last set
/// it up.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EnvironmentRef {
    /// The environment's name.
    pub environment: String,
    /// The incarnation's sequence.
    pub sequence: u64,
}

/// A tool the session declares, with where it can run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDeclaration {
    /// The tool's name.
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// The JSON Schema of the tool's input.
    pub input_schema: Value,
    /// The environments it runs in, current incarnations; the first is the default.
    #[serde(default)]
    pub placements: Vec<EnvironmentRef>,
}

/// The deterministic envelope of an activation: a pure function of session id and sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Runtime {
    /// The activation's logical clock, in milliseconds.
    pub logical_time_ms: u64,
    /// A seed for anything the harness randomises (64 hex characters).
    pub deterministic_seed: String,
}

/// What an activation works on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInput {
    /// The user's input; absent when the activation only delivers pending events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<UserInput>,
    /// The session's transcript so far.
    #[serde(default)]
    pub transcript: Vec<Message>,
    /// The session's kv, without the reserved `brain.` keys.
    #[serde(default)]
    pub kv: Map<String, Value>,
    /// Pending events after the session's events cursor, oldest first, excluding the harness's own.
    #[serde(default)]
    pub events: Vec<Event>,
    /// The session's tool declarations with their current placements.
    #[serde(default)]
    pub tools: Vec<ToolDeclaration>,
    /// The session's system prompt, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// The merged configuration (registration's, overridden key by key by the session's).
    #[serde(default)]
    pub configuration: Map<String, Value>,
    /// The deterministic envelope.
    pub runtime: Runtime,
}

/// Params of `run`: one activation of one session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunParams {
    /// The session.
    pub session_id: String,
    /// The activation's sequence (its `activation_queued` record).
    pub sequence: u64,
    /// The session's native state directory, owned by the harness.
    pub state_dir: String,
    /// Advisory model metadata.
    pub model: ModelMetadata,
    /// What to work on.
    pub input: RunInput,
}

/// [`RunParams`] borrowed from where Brain keeps them (the session's state and its journal view),
/// for encoding a `run` request without copying the transcript, kv and configuration first. It
/// encodes exactly as the `RunParams` holding the same values does, the kv without the reserved
/// `brain.` keys (a test holds the two together).
#[derive(Serialize)]
#[doc(hidden)]
pub struct RunParamsRef<'a> {
    pub session_id: &'a str,
    pub sequence: u64,
    pub state_dir: &'a str,
    pub model: &'a ModelMetadata,
    pub input: RunInputRef<'a>,
}

/// [`RunInput`] borrowed: see [`RunParamsRef`].
#[derive(Serialize)]
#[doc(hidden)]
pub struct RunInputRef<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<&'a UserInput>,
    pub transcript: &'a [Message],
    /// The whole kv: the reserved keys are left out as it is encoded.
    #[serde(serialize_with = "without_reserved_keys")]
    pub kv: &'a Map<String, Value>,
    pub events: &'a [Event],
    pub tools: &'a [ToolDeclaration],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system: Option<&'a str>,
    /// The configuration's JSON text (an object), copied verbatim.
    pub configuration: &'a RawValue,
    pub runtime: &'a Runtime,
}

fn without_reserved_keys<S: serde::Serializer>(
    kv: &&Map<String, Value>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(
        kv.iter()
            .filter(|(key, _)| !key.starts_with(RESERVED_KEY_PREFIX)),
    )
}

/// The answer to `run`. It nests: the JSON-RPC `result` is this object, and its own `result` member
/// is the activation's result. `{}` completes with no result; `{"result":null}` completes with a
/// JSON `null` result.
///
/// Deserializing refuses anything but an object (a bare string, an array, `null`): Brain answers
/// those with `invalid_response`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunResult {
    /// The activation's result, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
}

impl<'de> Deserialize<'de> for RunResult {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<RunResult, D::Error> {
        let mut object = Map::<String, Value>::deserialize(deserializer)?;
        Ok(RunResult {
            result: object.remove("result"),
        })
    }
}

/// The `data` of an error a harness answers `run` with. Only `code` means something to Brain.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HarnessErrorData {
    /// The failure code Brain records, if it is valid (see [`run_failure_code`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
}

/// The failure code Brain records for a harness's error answer to `run`: its `data.code` when that is
/// a non-empty string of at most 64 characters from `[a-z0-9_.]`, otherwise `harness_error`.
pub fn run_failure_code(error: &RpcError) -> String {
    let code = error
        .data
        .as_ref()
        .and_then(|data| data.get("code"))
        .and_then(Value::as_str)
        .filter(|code| {
            !code.is_empty()
                && code.len() <= 64
                && code
                    .bytes()
                    .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.'))
        });
    match code {
        Some(code) => code.to_owned(),
        None => ErrorCode::HarnessError.as_str().to_owned(),
    }
}

/// Params of `cancel`: end a running activation. Answered `{}` at once, also when nothing matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelParams {
    /// The session.
    pub session_id: String,
    /// The activation to cancel.
    pub sequence: u64,
}

/// Why a session's in-memory state is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloseReason {
    /// The session was closed; its native state stays.
    Closed,
    /// The session was passivated; its next activation reopens it.
    Passivated,
    /// The session was deleted; Brain removes its native state directory.
    Deleted,
}

/// Params of `close`: release a session's in-memory state. Answered `{}`; idempotent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloseParams {
    /// The session.
    pub session_id: String,
    /// Why.
    pub reason: CloseReason,
}

// ------------------------------------------------------------------------------------------------
// `brain/call`.

/// Params of `brain/call`, the one method a harness calls on Brain.
///
/// `input` stays untyped here so that an unknown method and a malformed input can be told apart;
/// [`CallbackInput::decode`] types it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BrainCallParams {
    /// The session of the activation making the call.
    pub session_id: String,
    /// The activation's sequence.
    pub sequence: u64,
    /// The callback method, e.g. `model` or `kv.get` (see [`CallbackMethod`]).
    pub method: String,
    /// The method's input.
    pub input: Value,
}

/// The methods of `brain/call`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CallbackMethod {
    /// Call the model (an effect).
    #[serde(rename = "model")]
    Model,
    /// Call a declared tool (an effect).
    #[serde(rename = "tool")]
    Tool,
    /// Record an event.
    #[serde(rename = "emit")]
    Emit,
    /// Replace the transcript.
    #[serde(rename = "transcript.set")]
    TranscriptSet,
    /// Read a kv entry.
    #[serde(rename = "kv.get")]
    KvGet,
    /// Write a kv entry.
    #[serde(rename = "kv.put")]
    KvPut,
    /// Delete a kv entry.
    #[serde(rename = "kv.delete")]
    KvDelete,
    /// Read a page of events.
    #[serde(rename = "events.read")]
    EventsRead,
    /// Best-effort diagnostics, never journaled.
    #[serde(rename = "telemetry")]
    Telemetry,
    /// List the granted environments.
    #[serde(rename = "environments.list")]
    EnvironmentsList,
    /// Describe one granted environment.
    #[serde(rename = "environments.get")]
    EnvironmentsGet,
    /// Set an environment up anew (an effect).
    #[serde(rename = "environments.setup")]
    EnvironmentsSetup,
    /// Call an environment (an effect).
    #[serde(rename = "environments.call")]
    EnvironmentsCall,
}

impl CallbackMethod {
    /// Every method, in the order of PROTOCOL.md §7 and §9.
    pub const ALL: [CallbackMethod; 13] = [
        CallbackMethod::Model,
        CallbackMethod::Tool,
        CallbackMethod::Emit,
        CallbackMethod::TranscriptSet,
        CallbackMethod::KvGet,
        CallbackMethod::KvPut,
        CallbackMethod::KvDelete,
        CallbackMethod::EventsRead,
        CallbackMethod::Telemetry,
        CallbackMethod::EnvironmentsList,
        CallbackMethod::EnvironmentsGet,
        CallbackMethod::EnvironmentsSetup,
        CallbackMethod::EnvironmentsCall,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            CallbackMethod::Model => "model",
            CallbackMethod::Tool => "tool",
            CallbackMethod::Emit => "emit",
            CallbackMethod::TranscriptSet => "transcript.set",
            CallbackMethod::KvGet => "kv.get",
            CallbackMethod::KvPut => "kv.put",
            CallbackMethod::KvDelete => "kv.delete",
            CallbackMethod::EventsRead => "events.read",
            CallbackMethod::Telemetry => "telemetry",
            CallbackMethod::EnvironmentsList => "environments.list",
            CallbackMethod::EnvironmentsGet => "environments.get",
            CallbackMethod::EnvironmentsSetup => "environments.setup",
            CallbackMethod::EnvironmentsCall => "environments.call",
        }
    }
}

impl fmt::Display for CallbackMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CallbackMethod {
    type Err = ();

    fn from_str(s: &str) -> Result<CallbackMethod, ()> {
        CallbackMethod::ALL
            .into_iter()
            .find(|method| method.as_str() == s)
            .ok_or(())
    }
}

/// A tool as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// The tool's name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// The JSON Schema of its input.
    pub input_schema: Value,
}

/// Input of the `model` callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    /// The system prompt; absent means the session's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// The conversation to continue.
    pub messages: Vec<Message>,
    /// The tools offered; absent means the session's, `[]` means none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<ToolDefinition>>,
    /// An output limit for this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// Provider-specific options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<Map<String, Value>>,
}

/// Why the model stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// It finished its turn.
    EndTurn,
    /// It asks for tool calls.
    ToolUse,
    /// It hit the output limit.
    MaxTokens,
    /// It produced a stop sequence.
    StopSequence,
    /// It refused.
    Refusal,
    /// The provider did not say, or said something else.
    Unknown,
}

/// Token counts the provider reported. A counter it did not report stays absent: never zero-filled,
/// never estimated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Input tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    /// Output tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    /// Input tokens read from the provider's cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<u64>,
    /// Input tokens written to the provider's cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_creation_input_tokens: Option<u64>,
    /// Reasoning tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
}

/// What the model answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelResult {
    /// The assistant's message.
    pub message: Message,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// Reported token counts; absent is all counters absent.
    #[serde(default)]
    pub usage: Usage,
    /// The model that actually answered, when the provider says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Result of the `model` callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCallResult {
    /// The sequence of the `model_call_started` record.
    pub sequence: u64,
    /// The model's answer.
    pub result: ModelResult,
}

/// Input of the `tool` callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallInput {
    /// A declared tool's name.
    pub name: String,
    /// The tool's input.
    pub input: Value,
    /// One of the tool's placements; absent means its first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
}

/// How a started tool call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolOutcome {
    /// It ran and answered.
    Ok,
    /// It ran and failed.
    Error,
    /// It hit its deadline and was killed.
    Timeout,
    /// It was cancelled.
    Cancelled,
    /// Nobody knows whether it took effect.
    Unknown,
}

impl ToolOutcome {
    /// The outcome as it is written on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolOutcome::Ok => "ok",
            ToolOutcome::Error => "error",
            ToolOutcome::Timeout => "timeout",
            ToolOutcome::Cancelled => "cancelled",
            ToolOutcome::Unknown => "unknown",
        }
    }
}

/// The result of a tool call that started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// How it ended.
    pub outcome: ToolOutcome,
    /// What it returned.
    pub content: Vec<Block>,
    /// Whether the model should read it as an error; absent is false.
    #[serde(default)]
    pub is_error: bool,
}

/// Result of the `tool` callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallResult {
    /// The sequence of the `tool_call_started` record.
    pub sequence: u64,
    /// How the tool ended.
    pub result: ToolResult,
}

/// Input of the `emit` callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmitInput {
    /// The event's type; the names of Brain's own records ([`RecordKind`]) are refused.
    #[serde(rename = "type")]
    pub event_type: String,
    /// The event's payload; absent is `null`.
    #[serde(default)]
    pub data: Value,
}

/// The result of a callback that wrote one record: `emit`, `transcript.set`, `kv.put`, `kv.delete`
/// and `environments.setup`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceResult {
    /// The record's sequence (for `environments.setup`: the new incarnation).
    pub sequence: u64,
}

/// Input of the `transcript.set` callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TranscriptSetInput {
    /// The whole new transcript (Brain stores it as a `{keep, append}` delta).
    pub messages: Vec<Message>,
}

/// Input of the `kv.get` and `kv.delete` callbacks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvKeyInput {
    /// The key.
    pub key: String,
}

/// Input of the `kv.put` callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvPutInput {
    /// The key; `brain.` keys are refused.
    pub key: String,
    /// The value; `null` is stored like any other value.
    pub value: Value,
}

/// Result of the `kv.get` callback: `{"found":true,"value":…}` or `{"found":false}`. A stored JSON
/// `null` is found: `value` is then `Some(Value::Null)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvGetResult {
    /// Whether the key exists.
    pub found: bool,
    /// The value when found.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub value: Option<Value>,
}

impl KvGetResult {
    /// A key holding `value`.
    pub fn found(value: Value) -> KvGetResult {
        KvGetResult {
            found: true,
            value: Some(value),
        }
    }

    /// An absent key.
    pub fn missing() -> KvGetResult {
        KvGetResult {
            found: false,
            value: None,
        }
    }
}

/// Deserializes a member that is present (even as `null`) into `Some`.
fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(deserializer).map(Some)
}

/// Input of the `events.read` callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsReadInput {
    /// Read events with a sequence greater than this.
    pub after: u64,
    /// At most this many; absent or above [`MAX_EVENTS_PAGE`] is [`MAX_EVENTS_PAGE`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
}

/// Result of the `events.read` callback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventsReadResult {
    /// The page, oldest first.
    pub events: Vec<Event>,
    /// Pass as `after` to read the next page.
    pub next_after: u64,
}

/// Input of `environments.get` and `environments.setup`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentNameInput {
    /// The environment's name.
    pub name: String,
}

/// One granted environment in `environments.list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentSummary {
    /// The environment's name.
    pub name: String,
    /// Its current incarnation.
    pub sequence: u64,
    /// Its status, as its driver reports it.
    pub status: String,
}

/// Result of `environments.list`: the granted environments only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentsListResult {
    /// The granted environments.
    pub environments: Vec<EnvironmentSummary>,
}

/// Result of `environments.get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentInfo {
    /// The environment's name.
    pub name: String,
    /// Its current incarnation.
    pub sequence: u64,
    /// Its status, as its driver reports it.
    pub status: String,
    /// Its driver, e.g. `local`.
    pub driver: String,
}

/// Input of `environments.call`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvironmentsCallInput {
    /// The environment's name.
    pub name: String,
    /// The driver's method.
    pub method: String,
    /// The method's input.
    pub input: Value,
}

/// Result of `environments.call`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvironmentsCallResult {
    /// The sequence of the `environment_started` record.
    pub sequence: u64,
    /// What the driver answered.
    pub result: Value,
}

/// A `brain/call` input, typed by its method. Serializes as the bare input.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum CallbackInput {
    /// `model`.
    Model(ModelRequest),
    /// `tool`.
    Tool(ToolCallInput),
    /// `emit`.
    Emit(EmitInput),
    /// `transcript.set`.
    TranscriptSet(TranscriptSetInput),
    /// `kv.get`.
    KvGet(KvKeyInput),
    /// `kv.put`.
    KvPut(KvPutInput),
    /// `kv.delete`.
    KvDelete(KvKeyInput),
    /// `events.read`.
    EventsRead(EventsReadInput),
    /// `telemetry`: any JSON.
    Telemetry(Value),
    /// `environments.list`.
    EnvironmentsList(Empty),
    /// `environments.get`.
    EnvironmentsGet(EnvironmentNameInput),
    /// `environments.setup`.
    EnvironmentsSetup(EnvironmentNameInput),
    /// `environments.call`.
    EnvironmentsCall(EnvironmentsCallInput),
}

impl CallbackInput {
    /// Types a `brain/call` input by its method name. Fails with the error Brain answers: an unknown
    /// method is `unknown_method` (-32601), a malformed input `invalid_input` (-32602).
    pub fn decode(method: &str, input: Value) -> Result<CallbackInput, RpcError> {
        let Ok(method) = method.parse::<CallbackMethod>() else {
            let shown: String = method.chars().take(64).collect();
            return Err(call_error(
                ErrorCode::UnknownMethod,
                format!("unknown brain/call method {shown:?}"),
            ));
        };
        CallbackInput::typed(method, input).map_err(|error| {
            call_error(
                ErrorCode::InvalidInput,
                format!("invalid input for {method}: {error}"),
            )
        })
    }

    /// As [`decode`](Self::decode), straight from the input's JSON text: no `Value` tree is built
    /// for an input that types. An input that does not is typed again through a `Value`, so that
    /// the result is always what `decode` gives (the same refusal and message; and duplicate
    /// object keys, which typing from text refuses, are read as `decode` reads them: the last
    /// wins).
    pub fn decode_json(method: &str, input: &RawValue) -> Result<CallbackInput, RpcError> {
        if let Ok(known) = method.parse::<CallbackMethod>() {
            let mut text = serde_json::Deserializer::from_str(input.get());
            let typed = CallbackInput::typed(known, &mut text);
            if let Ok(typed) = typed.and_then(|typed| text.end().map(|()| typed)) {
                return Ok(typed);
            }
        }
        let value = serde_json::from_str(input.get()).unwrap_or(Value::Null);
        CallbackInput::decode(method, value)
    }

    /// Types `input` — a `Value`, or JSON text — as the input of `method`.
    fn typed<'de, D: Deserializer<'de>>(
        method: CallbackMethod,
        input: D,
    ) -> Result<CallbackInput, D::Error> {
        Ok(match method {
            CallbackMethod::Model => CallbackInput::Model(Deserialize::deserialize(input)?),
            CallbackMethod::Tool => CallbackInput::Tool(Deserialize::deserialize(input)?),
            CallbackMethod::Emit => CallbackInput::Emit(Deserialize::deserialize(input)?),
            CallbackMethod::TranscriptSet => {
                CallbackInput::TranscriptSet(Deserialize::deserialize(input)?)
            }
            CallbackMethod::KvGet => CallbackInput::KvGet(Deserialize::deserialize(input)?),
            CallbackMethod::KvPut => CallbackInput::KvPut(Deserialize::deserialize(input)?),
            CallbackMethod::KvDelete => CallbackInput::KvDelete(Deserialize::deserialize(input)?),
            CallbackMethod::EventsRead => {
                CallbackInput::EventsRead(Deserialize::deserialize(input)?)
            }
            CallbackMethod::Telemetry => CallbackInput::Telemetry(Deserialize::deserialize(input)?),
            CallbackMethod::EnvironmentsList => {
                CallbackInput::EnvironmentsList(Deserialize::deserialize(input)?)
            }
            CallbackMethod::EnvironmentsGet => {
                CallbackInput::EnvironmentsGet(Deserialize::deserialize(input)?)
            }
            CallbackMethod::EnvironmentsSetup => {
                CallbackInput::EnvironmentsSetup(Deserialize::deserialize(input)?)
            }
            CallbackMethod::EnvironmentsCall => {
                CallbackInput::EnvironmentsCall(Deserialize::deserialize(input)?)
            }
        })
    }

    /// The method this input belongs to.
    pub fn method(&self) -> CallbackMethod {
        match self {
            CallbackInput::Model(_) => CallbackMethod::Model,
            CallbackInput::Tool(_) => CallbackMethod::Tool,
            CallbackInput::Emit(_) => CallbackMethod::Emit,
            CallbackInput::TranscriptSet(_) => CallbackMethod::TranscriptSet,
            CallbackInput::KvGet(_) => CallbackMethod::KvGet,
            CallbackInput::KvPut(_) => CallbackMethod::KvPut,
            CallbackInput::KvDelete(_) => CallbackMethod::KvDelete,
            CallbackInput::EventsRead(_) => CallbackMethod::EventsRead,
            CallbackInput::Telemetry(_) => CallbackMethod::Telemetry,
            CallbackInput::EnvironmentsList(_) => CallbackMethod::EnvironmentsList,
            CallbackInput::EnvironmentsGet(_) => CallbackMethod::EnvironmentsGet,
            CallbackInput::EnvironmentsSetup(_) => CallbackMethod::EnvironmentsSetup,
            CallbackInput::EnvironmentsCall(_) => CallbackMethod::EnvironmentsCall,
        }
    }
}

/// A `brain/call` request typed as far as admission needs: the activation it names and its input,
/// or why the input was refused (answered only after the activation's authority is checked, so
/// that a caller without authority learns nothing about its input).
#[derive(Debug, PartialEq)]
pub struct BrainCall {
    /// The session of the activation making the call.
    pub session_id: String,
    /// The activation's sequence.
    pub sequence: u64,
    /// The typed input, or the refusal (`unknown_method`, `invalid_input`) to answer.
    pub input: Result<CallbackInput, RpcError>,
}

impl BrainCall {
    /// Types decoded `brain/call` params. Fails `invalid_input` when they are not
    /// [`BrainCallParams`].
    pub fn from_params(params: Value) -> Result<BrainCall, RpcError> {
        let params: BrainCallParams = serde_json::from_value(params).map_err(|error| {
            call_error(
                ErrorCode::InvalidInput,
                format!("brain/call params: {error}"),
            )
        })?;
        Ok(BrainCall {
            input: CallbackInput::decode(&params.method, params.input),
            session_id: params.session_id,
            sequence: params.sequence,
        })
    }

    /// Decodes a whole line that is a well-formed JSON-RPC 2.0 `brain/call` request with
    /// well-formed params, without building a `Value` tree for it. `None` for any other line
    /// (another message, a malformed one, params that are not [`BrainCallParams`]): decode those
    /// with [`jsonrpc::decode`](crate::jsonrpc::decode) and
    /// [`from_params`](Self::from_params), which name what is wrong. Both ways give the same
    /// result for every line this one accepts.
    pub fn decode_request(line: &[u8]) -> Option<(RequestId, BrainCall)> {
        // Every other line (a `run` answer, say) would be scanned whole before the typed parse
        // failed, and then parsed again by the general path. A line this function accepts holds
        // these bytes (an escaped method is refused below anyway), so the look costs nothing in
        // what it accepts.
        // A finder built once: building one per line cost ≈ 500 instructions per callback.
        static BRAIN_CALL: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
            std::sync::LazyLock::new(|| memchr::memmem::Finder::new(br#""brain/call""#));
        BRAIN_CALL.find(line)?;
        // First with the input typed in the same pass; a line whose input does not type (or
        // whose params are otherwise refused) is read again with the input kept as text, so that
        // the refusal is answered as before.
        let (id, params) = match Self::decode_wire::<true>(line) {
            Some(decoded) => decoded,
            None => Self::decode_wire::<false>(line)?,
        };
        let input = match params.input {
            ParamsInput::Typed(typed) => Ok(typed),
            ParamsInput::Raw(raw) => CallbackInput::decode_json(&params.method, raw),
        };
        Some((
            id,
            BrainCall {
                session_id: params.session_id,
                sequence: params.sequence,
                input,
            },
        ))
    }

    /// The id and params of a `brain/call` line; the input typed in the same pass when `TYPED`
    /// (see [`Params`]).
    fn decode_wire<const TYPED: bool>(line: &[u8]) -> Option<(RequestId, CallParts<'_>)> {
        #[derive(Deserialize)]
        struct Wire<'a, const TYPED: bool> {
            jsonrpc: &'a str,
            #[serde(borrow)]
            id: &'a RawValue,
            method: &'a str,
            // Typed in the same pass: scanning the params as raw text first cost as much again.
            #[serde(borrow)]
            params: Object<Params<'a, TYPED>>,
        }
        // A JSON text is UTF-8 throughout, so checking the line once refuses nothing the parse
        // would take, and spares the check of each string on its own (`from_slice` checks every
        // string it reads: ≈ 7 % of a tool-loop turn's instructions, in calls of ≈ 80 each).
        let text = std::str::from_utf8(line).ok()?;
        let Object(wire) = serde_json::from_str::<Object<Wire<TYPED>>>(text).ok()?;
        if wire.jsonrpc != "2.0" || wire.method != method::BRAIN_CALL {
            return None;
        }
        let id = match serde_json::from_str::<Value>(wire.id.get()).ok()? {
            Value::Number(n) => RequestId::Int(n.as_i64()?),
            Value::String(s) => RequestId::Str(s),
            _ => return None,
        };
        let Object(params) = wire.params;
        Some((
            id,
            CallParts {
                session_id: params.session_id,
                sequence: params.sequence,
                method: params.method,
                input: params.input,
            },
        ))
    }
}

/// The params of a `brain/call` line as [`BrainCall::decode_request`] reads them. With `TYPED`
/// the input is typed in the same pass when `method` (a known one) comes before it, as Brain's
/// SDK writes them, and an input that does not type fails the read; otherwise, and without
/// `TYPED`, it is kept as text and typed afterwards. Scanning the input as text first and typing
/// it again cost as much as the typing (docs/BENCHMARKS.md). A field given twice fails the read,
/// as the derived impl failed it.
struct Params<'a, const TYPED: bool> {
    session_id: String,
    sequence: u64,
    method: String,
    input: ParamsInput<'a>,
}

/// [`Params`] once read, whichever way.
struct CallParts<'a> {
    session_id: String,
    sequence: u64,
    method: String,
    input: ParamsInput<'a>,
}

enum ParamsInput<'a> {
    Typed(CallbackInput),
    Raw(&'a RawValue),
}

/// A key of the `brain/call` params, read without allocating (an escaped key arrives owned).
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Field {
    SessionId,
    Sequence,
    Method,
    Input,
    #[serde(other)]
    Other,
}

/// Types an input of a known method from the deserializer, as [`CallbackInput::typed`] does.
struct TypedInput(CallbackMethod);

impl<'de> serde::de::DeserializeSeed<'de> for TypedInput {
    type Value = CallbackInput;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<CallbackInput, D::Error> {
        CallbackInput::typed(self.0, deserializer)
    }
}

impl<'de: 'a, 'a, const TYPED: bool> Deserialize<'de> for Params<'a, TYPED> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Params<'a, TYPED>, D::Error> {
        struct Fields<'a, const TYPED: bool>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a, const TYPED: bool> serde::de::Visitor<'de> for Fields<'a, TYPED> {
            type Value = Params<'a, TYPED>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("brain/call params")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Params<'a, TYPED>, A::Error> {
                use serde::de::Error;
                let mut session_id = None;
                let mut sequence = None;
                let mut method: Option<String> = None;
                let mut input = None;
                while let Some(key) = map.next_key::<Field>()? {
                    match key {
                        Field::SessionId if session_id.is_none() => {
                            session_id = Some(map.next_value()?)
                        }
                        Field::Sequence if sequence.is_none() => sequence = Some(map.next_value()?),
                        Field::Method if method.is_none() => method = Some(map.next_value()?),
                        Field::Input if input.is_none() => {
                            let known = method
                                .as_deref()
                                .filter(|_| TYPED)
                                .and_then(|m| m.parse::<CallbackMethod>().ok());
                            input = Some(match known {
                                Some(known) => {
                                    ParamsInput::Typed(map.next_value_seed(TypedInput(known))?)
                                }
                                None => ParamsInput::Raw(map.next_value()?),
                            });
                        }
                        Field::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                        _ => return Err(A::Error::custom("duplicate field")),
                    }
                }
                Ok(Params {
                    session_id: session_id.ok_or_else(|| A::Error::missing_field("session_id"))?,
                    sequence: sequence.ok_or_else(|| A::Error::missing_field("sequence"))?,
                    method: method.ok_or_else(|| A::Error::missing_field("method"))?,
                    input: input.ok_or_else(|| A::Error::missing_field("input"))?,
                })
            }
        }
        deserializer.deserialize_map(Fields(std::marker::PhantomData))
    }
}

/// A `T` that must be a JSON object. serde's derived impls also take a JSON array, field by field
/// in order, which JSON-RPC and this protocol do not allow (the general path refuses it).
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Object<T>, D::Error> {
        struct OnlyMaps<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for OnlyMaps<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        deserializer
            .deserialize_map(OnlyMaps(std::marker::PhantomData))
            .map(Object)
    }
}

/// A `brain/call` result, typed by its method. Serializes as the bare result.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum CallbackResult {
    /// `model`.
    Model(ModelCallResult),
    /// `tool`.
    Tool(ToolCallResult),
    /// `emit`, `transcript.set`, `kv.put`, `kv.delete`, `environments.setup`.
    Sequence(SequenceResult),
    /// `kv.get`.
    KvGet(KvGetResult),
    /// `events.read`.
    EventsRead(EventsReadResult),
    /// `telemetry`.
    Empty(Empty),
    /// `environments.list`.
    EnvironmentsList(EnvironmentsListResult),
    /// `environments.get`.
    EnvironmentsGet(EnvironmentInfo),
    /// `environments.call`.
    EnvironmentsCall(EnvironmentsCallResult),
}

impl CallbackResult {
    /// Types a `brain/call` result by the method that was called (a harness SDK's side).
    pub fn decode(method: CallbackMethod, result: Value) -> serde_json::Result<CallbackResult> {
        use serde_json::from_value;
        Ok(match method {
            CallbackMethod::Model => CallbackResult::Model(from_value(result)?),
            CallbackMethod::Tool => CallbackResult::Tool(from_value(result)?),
            CallbackMethod::Emit
            | CallbackMethod::TranscriptSet
            | CallbackMethod::KvPut
            | CallbackMethod::KvDelete
            | CallbackMethod::EnvironmentsSetup => CallbackResult::Sequence(from_value(result)?),
            CallbackMethod::KvGet => CallbackResult::KvGet(from_value(result)?),
            CallbackMethod::EventsRead => CallbackResult::EventsRead(from_value(result)?),
            CallbackMethod::Telemetry => CallbackResult::Empty(from_value(result)?),
            CallbackMethod::EnvironmentsList => {
                CallbackResult::EnvironmentsList(from_value(result)?)
            }
            CallbackMethod::EnvironmentsGet => CallbackResult::EnvironmentsGet(from_value(result)?),
            CallbackMethod::EnvironmentsCall => {
                CallbackResult::EnvironmentsCall(from_value(result)?)
            }
        })
    }
}

/// The `data` of every error Brain answers a `brain/call` with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallErrorData {
    /// The error code (a string from [`ErrorCode`]); what callers match on.
    pub code: String,
    /// Whether the error stops the activation.
    pub fatal: bool,
}

impl CallErrorData {
    /// The data Brain sends with `code`.
    pub fn new(code: ErrorCode) -> CallErrorData {
        CallErrorData {
            code: code.as_str().to_owned(),
            fatal: code.is_fatal(),
        }
    }

    /// Reads the data of an error Brain answered with; `None` when it has no such data.
    pub fn from_rpc_error(error: &RpcError) -> Option<CallErrorData> {
        error
            .data
            .as_ref()
            .and_then(|data| CallErrorData::deserialize(data).ok())
    }

    /// The code as an [`ErrorCode`], when it is one this Brain knows.
    pub fn error_code(&self) -> Option<ErrorCode> {
        self.code.parse().ok()
    }
}

/// Builds the error Brain answers a `brain/call` with: the JSON-RPC code from
/// [`ErrorCode::rpc_code`] and `data` `{"code", "fatal"}`.
pub fn call_error(code: ErrorCode, message: impl Into<String>) -> RpcError {
    let mut data = Map::new();
    data.insert("code".to_owned(), Value::String(code.as_str().to_owned()));
    data.insert("fatal".to_owned(), Value::Bool(code.is_fatal()));
    RpcError {
        code: code.rpc_code(),
        message: message.into(),
        data: Some(Value::Object(data)),
    }
}

// ------------------------------------------------------------------------------------------------
// Journal record kinds (names only; the journal is specified as it is built).

/// The kinds of a session's journal records, which clients also read as events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordKind {
    /// The session exists: its selection, slot, grants, tools and environments.
    SessionCreated,
    /// An activation was admitted with its input; its sequence names the activation.
    ActivationQueued,
    /// The activation marker was set and `run` is about to be sent.
    ActivationStarted,
    /// The activation's outcome.
    ActivationFinished,
    /// A model call is about to be sent.
    ModelCallStarted,
    /// A model call's result or error.
    ModelCallFinished,
    /// A tool call is about to start.
    ToolCallStarted,
    /// A tool call's result.
    ToolCallFinished,
    /// An environment setup or call is about to start.
    EnvironmentStarted,
    /// An environment setup's or call's result.
    EnvironmentFinished,
    /// A transcript change as `{keep, append}`.
    TranscriptDelta,
    /// A kv write.
    KvSet,
    /// A kv deletion.
    KvDelete,
    /// An event.
    EventEmitted,
    /// The session was passivated.
    SessionPassivated,
    /// The session was closed.
    SessionClosed,
}

impl RecordKind {
    /// Every kind, in the order of PROTOCOL.md §7.2.
    pub const ALL: [RecordKind; 16] = [
        RecordKind::SessionCreated,
        RecordKind::ActivationQueued,
        RecordKind::ActivationStarted,
        RecordKind::ActivationFinished,
        RecordKind::ModelCallStarted,
        RecordKind::ModelCallFinished,
        RecordKind::ToolCallStarted,
        RecordKind::ToolCallFinished,
        RecordKind::EnvironmentStarted,
        RecordKind::EnvironmentFinished,
        RecordKind::TranscriptDelta,
        RecordKind::KvSet,
        RecordKind::KvDelete,
        RecordKind::EventEmitted,
        RecordKind::SessionPassivated,
        RecordKind::SessionClosed,
    ];

    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordKind::SessionCreated => "session_created",
            RecordKind::ActivationQueued => "activation_queued",
            RecordKind::ActivationStarted => "activation_started",
            RecordKind::ActivationFinished => "activation_finished",
            RecordKind::ModelCallStarted => "model_call_started",
            RecordKind::ModelCallFinished => "model_call_finished",
            RecordKind::ToolCallStarted => "tool_call_started",
            RecordKind::ToolCallFinished => "tool_call_finished",
            RecordKind::EnvironmentStarted => "environment_started",
            RecordKind::EnvironmentFinished => "environment_finished",
            RecordKind::TranscriptDelta => "transcript_delta",
            RecordKind::KvSet => "kv_set",
            RecordKind::KvDelete => "kv_delete",
            RecordKind::EventEmitted => "event_emitted",
            RecordKind::SessionPassivated => "session_passivated",
            RecordKind::SessionClosed => "session_closed",
        }
    }
}

impl fmt::Display for RecordKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RecordKind {
    type Err = ();

    fn from_str(s: &str) -> Result<RecordKind, ()> {
        RecordKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The borrowed `run` params encode byte for byte as the owned ones.
    #[test]
    fn borrowed_run_params_encode_as_the_owned_ones() {
        let full: Map<String, Value> = serde_json::from_value(
            serde_json::json!({"plan": [1, {"a": null}], "brain.harness.activation": 3, "z": "y"}),
        )
        .unwrap();
        let configuration: Map<String, Value> =
            serde_json::from_value(serde_json::json!({"depth": 2, "name": "x\"q"})).unwrap();
        let owned = RunParams {
            session_id: "ses_0123456789ABCDEFabcd".into(),
            sequence: 9,
            state_dir: "/data/agentloops/r/ses_0123456789ABCDEFabcd".into(),
            model: serde_json::from_value(serde_json::json!({
                "provider": "scripted", "name": "m", "context_window": 1000, "options": {"t": 1}
            }))
            .unwrap(),
            input: RunInput {
                input: Some(UserInput {
                    content: vec![Block::text("hi")],
                }),
                transcript: vec![
                    Message::text(Role::User, "a"),
                    Message::text(Role::Assistant, "b"),
                ],
                kv: full
                    .iter()
                    .filter(|(key, _)| !key.starts_with(RESERVED_KEY_PREFIX))
                    .map(|(key, value)| (key.clone(), value.clone()))
                    .collect(),
                events: vec![Event {
                    sequence: 4,
                    event_type: "note".into(),
                    recorded_at_ms: 17,
                    data: serde_json::json!({"k": 1}),
                    origin: None,
                }],
                tools: vec![ToolDeclaration {
                    name: "t".into(),
                    description: "d".into(),
                    input_schema: serde_json::json!({"type": "object"}),
                    placements: Vec::new(),
                }],
                system: Some("be brief".into()),
                configuration,
                runtime: Runtime {
                    logical_time_ms: 9,
                    deterministic_seed: "ab".repeat(32),
                },
            },
        };
        fn borrowed<'a>(
            owned: &'a RunParams,
            kv: &'a Map<String, Value>,
            input: Option<&'a UserInput>,
            system: Option<&'a str>,
            configuration: &'a RawValue,
        ) -> RunParamsRef<'a> {
            RunParamsRef {
                session_id: &owned.session_id,
                sequence: owned.sequence,
                state_dir: &owned.state_dir,
                model: &owned.model,
                input: RunInputRef {
                    input,
                    transcript: &owned.input.transcript,
                    kv,
                    events: &owned.input.events,
                    tools: &owned.input.tools,
                    system,
                    configuration,
                    runtime: &owned.input.runtime,
                },
            }
        }
        let configuration = serde_json::value::to_raw_value(&owned.input.configuration).unwrap();
        let both = borrowed(
            &owned,
            &full,
            owned.input.input.as_ref(),
            owned.input.system.as_deref(),
            &configuration,
        );
        assert_eq!(
            serde_json::to_string(&both).unwrap(),
            serde_json::to_string(&owned).unwrap()
        );
        // Without the optional members, both leave them out.
        let mut bare = owned.clone();
        bare.input.input = None;
        bare.input.system = None;
        assert_eq!(
            serde_json::to_string(&borrowed(&bare, &full, None, None, &configuration)).unwrap(),
            serde_json::to_string(&bare).unwrap()
        );
    }
    use serde_json::json;

    /// Parses `text` as `T`, checks that serializing gives back exactly the same JSON, returns it.
    fn round_trip<T: serde::de::DeserializeOwned + Serialize + PartialEq + fmt::Debug>(
        text: &str,
    ) -> T {
        let original: Value = serde_json::from_str(text).unwrap();
        let typed: T = serde_json::from_value(original.clone()).unwrap();
        let again = serde_json::to_value(&typed).unwrap();
        assert_eq!(again, original, "{text}");
        let typed_again: T = serde_json::from_value(again).unwrap();
        assert_eq!(typed_again, typed);
        typed
    }

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

    #[test]
    fn initialize_round_trips_from_the_contract_examples() {
        let params: InitializeParams = round_trip(
            r#"{"protocol":"brain/harness/v1","brain":{"name":"brain","version":"0.1.0"},
                "registration":"pi","worker":0,"configuration":{"thinking":"low"},
                "state_root":"/var/lib/brain/agentloops/pi","max_concurrency":64,
                "max_line_bytes":16777216}"#,
        );
        assert_eq!(params.protocol, PROTOCOL);
        let result: InitializeResult = round_trip(
            r#"{"protocol":"brain/harness/v1",
                "identity":{"name":"agentloop-pi","version":"11.0.0"},
                "state_version":"3",
                "capabilities":{"media":true,"transcript_import":true,"fixed_tool_catalogue":true},
                "configuration_keys":["thinking","compact_at"],
                "required_model_metadata":["context_window","max_output_tokens"]}"#,
        );
        assert!(result.capabilities.fixed_tool_catalogue);

        // Absent means empty; unknown keys (also unknown capabilities) are ignored.
        let minimal: InitializeResult = serde_json::from_value(json!({
            "protocol": PROTOCOL, "identity": {"name": "echo", "version": "1"},
            "state_version": "1", "capabilities": {"streaming": true}, "extra": [1]
        }))
        .unwrap();
        assert_eq!(minimal.capabilities, Capabilities::default());
        assert_eq!(minimal.configuration_keys, None);
        assert!(minimal.required_model_metadata.is_empty());
    }

    #[test]
    fn run_params_round_trip_from_the_contract_example() {
        let params: RunParams = round_trip(
            r#"{"session_id":"ses_01HZX8Y2K3M4N5P6Q7R8","sequence":12,
                "state_dir":"/var/lib/brain/agentloops/pi/ses_01HZX8Y2K3M4N5P6Q7R8",
                "model":{"provider":"openai","name":"gpt-5-mini","context_window":400000,
                         "max_output_tokens":32000},
                "input":{
                  "input":{"content":[{"type":"text","text":"fix the flaky test"}]},
                  "transcript":[], "kv":{"plan":"step 2"}, "events":[],
                  "tools":[{"name":"bash","description":"Run a command",
                            "input_schema":{"type":"object"},
                            "placements":[{"environment":"workspace","sequence":3}]}],
                  "system":"You are terse.", "configuration":{"thinking":"high"},
                  "runtime":{"logical_time_ms":12,"deterministic_seed":"00ff"}}}"#,
        );
        assert_eq!(params.sequence, 12);
        assert_eq!(params.model.context_window, Some(400_000));
        assert_eq!(
            params.input.tools[0].placements,
            [EnvironmentRef {
                environment: "workspace".into(),
                sequence: 3
            }]
        );

        // Only events to deliver: no user input, no system prompt; extra model keys are kept.
        let params: RunParams = round_trip(
            r#"{"session_id":"ses_01HZX8Y2K3M4N5P6Q7R8","sequence":13,"state_dir":"/s",
                "model":{"provider":"scripted","name":"default","options":{"script":[]}},
                "input":{"transcript":[],"kv":{},"events":[{"sequence":9,"type":"ci.finished",
                  "recorded_at_ms":1700000000000,"data":{"ok":true},
                  "origin":{"kind":"client","sequence":9}}],"tools":[],"configuration":{},
                  "runtime":{"logical_time_ms":13,"deterministic_seed":"ab"}}}"#,
        );
        assert_eq!(params.input.input, None);
        assert_eq!(params.model.extra["options"], json!({"script": []}));
    }

    #[test]
    fn the_run_answer_nests_and_refuses_other_shapes() {
        let done: RunResult = round_trip(r#"{"result":{"summary":"done"}}"#);
        assert_eq!(done.result, Some(json!({"summary":"done"})));
        let nothing: RunResult = round_trip("{}");
        assert_eq!(nothing.result, None);
        let null: RunResult = round_trip(r#"{"result":null}"#);
        assert_eq!(null.result, Some(Value::Null));
        let extra: RunResult = serde_json::from_value(json!({"result": 1, "x": 2})).unwrap();
        assert_eq!(extra.result, Some(json!(1)));
        for bad in [json!("done"), json!([]), json!([1]), Value::Null, json!(3)] {
            assert!(
                serde_json::from_value::<RunResult>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn run_error_codes_are_validated() {
        let error = |data: Value| RpcError {
            code: -32000,
            message: "m".into(),
            data: Some(data),
        };
        assert_eq!(
            run_failure_code(&error(json!({"code":"model_refused"}))),
            "model_refused"
        );
        assert_eq!(run_failure_code(&error(json!({"code":"a.b_9"}))), "a.b_9");
        for bad in [
            json!({"code":"Bad"}),
            json!({"code":""}),
            json!({"code":7}),
            json!({"code":"x".repeat(65)}),
            json!({"code":"a-b"}),
            json!("model_refused"),
            json!({}),
        ] {
            assert_eq!(
                run_failure_code(&error(bad.clone())),
                "harness_error",
                "{bad}"
            );
        }
        let no_data = RpcError {
            code: -32000,
            message: "m".into(),
            data: None,
        };
        assert_eq!(run_failure_code(&no_data), "harness_error");
        round_trip::<HarnessErrorData>(r#"{"code":"model_refused"}"#);
    }

    #[test]
    fn cancel_close_shutdown_and_empty_answers_round_trip() {
        round_trip::<CancelParams>(r#"{"session_id":"ses_01HZX8Y2K3M4N5P6Q7R8","sequence":12}"#);
        for reason in ["closed", "passivated", "deleted"] {
            let text =
                format!(r#"{{"session_id":"ses_01HZX8Y2K3M4N5P6Q7R8","reason":"{reason}"}}"#);
            round_trip::<CloseParams>(&text);
        }
        assert!(
            serde_json::from_value::<CloseParams>(json!({"session_id":"s","reason":"gone"}))
                .is_err()
        );
        round_trip::<ShutdownParams>("{}");
        round_trip::<Empty>("{}");
        assert_eq!(
            serde_json::from_value::<Empty>(json!({"ignored": true})).unwrap(),
            Empty {}
        );
    }

    #[test]
    fn blocks_and_messages_round_trip() {
        let message: Message = round_trip(
            r#"{"role":"assistant","content":[
                {"type":"text","text":"Let me look."},
                {"type":"image","url":"https://example.com/a.png"},
                {"type":"file","media_type":"application/pdf","url":"https://example.com/a.pdf"},
                {"type":"tool_use","id":"tu_1","name":"bash","input":{"command":"ls"}},
                {"type":"tool_result","tool_use_id":"tu_1",
                 "content":[{"type":"text","text":"a.txt"}],"is_error":false},
                {"type":"native","format":"openai.responses","data":{"id":"rs_1"}}]}"#,
        );
        assert_eq!(message.role, Role::Assistant);
        assert_eq!(message.content.len(), 6);
        round_trip::<Message>(r#"{"role":"developer","content":[]}"#);
        round_trip::<UserInput>(r#"{"content":[{"type":"text","text":"hi"}]}"#);
        assert_eq!(
            serde_json::to_value(Message::text(Role::User, "Hello")).unwrap(),
            json!({"role":"user","content":[{"type":"text","text":"Hello"}]})
        );
        assert!(serde_json::from_value::<Block>(json!({"type":"video","url":"x"})).is_err());
        assert!(serde_json::from_value::<Message>(json!({"role":"system","content":[]})).is_err());
    }

    #[test]
    fn events_round_trip_with_and_without_origin() {
        let event: Event = round_trip(
            r#"{"sequence":41,"type":"progress","recorded_at_ms":1700000000000,
                "data":{"step":2},"origin":{"kind":"agentloop","sequence":40}}"#,
        );
        assert_eq!(event.event_type, "progress");
        assert_eq!(event.origin.map(|o| o.kind), Some(OriginKind::Agentloop));
        let event: Event =
            round_trip(r#"{"sequence":42,"type":"note","recorded_at_ms":0,"data":null}"#);
        assert_eq!(event.origin, None);
    }

    #[test]
    fn brain_call_params_round_trip_from_the_contract_example() {
        let params: BrainCallParams = round_trip(
            r#"{"session_id":"ses_01HZX8Y2K3M4N5P6Q7R8","sequence":12,"method":"model",
                "input":{"messages":[{"role":"user","content":[{"type":"text","text":"Hello"}]}],
                         "tools":[]}}"#,
        );
        let input = CallbackInput::decode(&params.method, params.input.clone()).unwrap();
        assert_eq!(input.method(), CallbackMethod::Model);
        let CallbackInput::Model(request) = &input else {
            panic!("not a model request")
        };
        assert_eq!(request.tools, Some(vec![]));
        assert_eq!(request.system, None);
        assert_eq!(serde_json::to_value(&input).unwrap(), params.input);

        // `input` is required; unknown members are ignored.
        assert!(
            serde_json::from_value::<BrainCallParams>(
                json!({"session_id":"s","sequence":1,"method":"telemetry"})
            )
            .is_err()
        );
        let params: BrainCallParams = serde_json::from_value(
            json!({"session_id":"s","sequence":1,"method":"telemetry","input":null,"x":1}),
        )
        .unwrap();
        assert_eq!(params.input, Value::Null);
    }

    #[test]
    fn callback_methods_round_trip_as_wire_names() {
        for method in CallbackMethod::ALL {
            assert_eq!(
                serde_json::to_value(method).unwrap(),
                Value::String(method.as_str().into())
            );
            assert_eq!(method.as_str().parse::<CallbackMethod>(), Ok(method));
            assert_eq!(method.to_string(), method.as_str());
        }
        assert_eq!("kv.list".parse::<CallbackMethod>(), Err(()));
    }

    #[test]
    fn every_callback_input_decodes_and_re_encodes() {
        let cases = [
            (
                "model",
                json!({"system":"Be brief.","messages":[{"role":"user","content":[]}],
                       "tools":[{"name":"bash","description":"Run","input_schema":{"type":"object"}}],
                       "max_output_tokens":1024,"options":{"temperature":0}}),
            ),
            (
                "tool",
                json!({"name":"bash","input":{"command":"ls"},"environment":"workspace"}),
            ),
            ("tool", json!({"name":"bash","input":{}})),
            ("emit", json!({"type":"progress","data":{"step":1}})),
            (
                "transcript.set",
                json!({"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}),
            ),
            ("kv.get", json!({"key":"plan"})),
            ("kv.put", json!({"key":"plan","value":null})),
            ("kv.delete", json!({"key":"plan"})),
            ("events.read", json!({"after":0,"limit":100})),
            ("events.read", json!({"after":7})),
            ("telemetry", json!({"tokens_estimate":1234})),
            ("telemetry", json!("anything")),
            ("environments.list", json!({})),
            ("environments.get", json!({"name":"workspace"})),
            ("environments.setup", json!({"name":"workspace"})),
            (
                "environments.call",
                json!({"name":"workspace","method":"exec","input":{"argv":["ls"]}}),
            ),
        ];
        let mut seen = Vec::new();
        for (method, input) in cases {
            let typed = CallbackInput::decode(method, input.clone()).unwrap();
            assert_eq!(typed.method().as_str(), method);
            assert_eq!(serde_json::to_value(&typed).unwrap(), input, "{method}");
            let text = serde_json::value::to_raw_value(&input).unwrap();
            assert_eq!(CallbackInput::decode_json(method, &text), Ok(typed.clone()));
            seen.push(typed.method());
        }
        for method in CallbackMethod::ALL {
            assert!(seen.contains(&method), "{method} untested");
        }
    }

    /// The worker reader's typed path against the general one (`jsonrpc::decode`, then
    /// `BrainCall::from_params`): the same call for every line it takes, and no line taken that the
    /// general path would read differently.
    #[test]
    fn the_typed_brain_call_path_agrees_with_the_general_one() {
        use crate::jsonrpc::{self, Message};
        let general = |line: &str| match jsonrpc::decode(line.as_bytes()) {
            Ok(Message::Request(request)) if request.method == method::BRAIN_CALL => {
                Some((request.id, BrainCall::from_params(request.params)))
            }
            _ => None,
        };
        let taken = [
            r#"{"jsonrpc":"2.0","id":"c1","method":"brain/call","params":{"session_id":"ses_a","sequence":3,"method":"kv.get","input":{"key":"k"}}}"#,
            r#"{"params":{"input":{"messages":[]},"method":"model","sequence":0,"session_id":"s"},"method":"brain/call","id":7,"jsonrpc":"2.0","extra":1}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get","input":{"key":5}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.list","input":{}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get","input":null}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get","input":{"key":"a","key":"b"}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"telemetry","input":[1,2.5,"x"]}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","extra":[1,{"a":2}],"sequence":1,"method":"kv.get","input":{"key":"k"}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get","input":{"key":"k\u00e9\n"}}}"#,
        ];
        for line in taken {
            let (id, call) = BrainCall::decode_request(line.as_bytes())
                .unwrap_or_else(|| panic!("the typed path refused {line}"));
            assert_eq!(general(line), Some((id, Ok(call))), "{line}");
        }
        let left_to_the_general_path = [
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"environments.list"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain\/call","params":{"session_id":"s","sequence":1,"method":"kv.get","input":{"key":"k"}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":["s",1,"kv.get",{"key":"k"}]}"#,
            r#"["2.0",1,"brain/call",{"session_id":"s","sequence":1,"method":"kv.get","input":{"key":"k"}}]"#,
            r#"{"jsonrpc":"2.0","id":1.5,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get"}}"#,
            r#"{"jsonrpc":"2.0","method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get"}}"#,
            r#"{"jsonrpc":"1.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":-1,"method":"kv.get"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get","method":"kv.put","input":{"key":"k"}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"brain/call","params":{"session_id":"s","sequence":1,"method":"kv.get","input":{"key":"k"},"input":{"key":"j"}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"run","params":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
            "not json",
        ];
        for line in left_to_the_general_path {
            assert!(
                BrainCall::decode_request(line.as_bytes()).is_none(),
                "{line}"
            );
        }
    }

    #[test]
    fn bad_callbacks_fail_with_the_errors_brain_sends() {
        let error = CallbackInput::decode("kv.list", json!({})).unwrap_err();
        assert_eq!(error.code, -32601);
        assert_eq!(
            error.data,
            Some(json!({"code":"unknown_method","fatal":false}))
        );
        for (method, input) in [
            ("kv.get", json!({"key": 5})),
            ("kv.put", json!({"key": "k"})),
            ("events.read", json!({"after": -1})),
            ("model", json!({"messages": "hi"})),
            ("environments.list", Value::Null),
        ] {
            let error = CallbackInput::decode(method, input).unwrap_err();
            assert_eq!(error.code, -32602, "{method}");
            assert_eq!(
                CallErrorData::from_rpc_error(&error).and_then(|d| d.error_code()),
                Some(ErrorCode::InvalidInput)
            );
        }
        // A long unknown method name is not echoed whole.
        let error = CallbackInput::decode(&"x".repeat(10_000), json!({})).unwrap_err();
        assert!(error.message.len() < 200);
    }

    #[test]
    fn call_errors_carry_code_and_fatal() {
        let error = call_error(
            ErrorCode::NotGranted,
            "environment workspace is not granted",
        );
        assert_eq!(
            serde_json::to_value(&error).unwrap(),
            json!({"code":-32000,"message":"environment workspace is not granted",
                   "data":{"code":"not_granted","fatal":false}})
        );
        let error = call_error(ErrorCode::Cancelled, "the activation was cancelled");
        assert_eq!(
            CallErrorData::from_rpc_error(&error),
            Some(CallErrorData {
                code: "cancelled".into(),
                fatal: true
            })
        );
        for code in ErrorCode::ALL {
            let error = call_error(code, "m");
            assert_eq!(error.code, code.rpc_code());
            assert_eq!(
                CallErrorData::from_rpc_error(&error),
                Some(CallErrorData::new(code))
            );
        }
        round_trip::<CallErrorData>(r#"{"code":"not_granted","fatal":false}"#);
    }

    #[test]
    fn model_results_keep_absent_usage_counters_absent() {
        let result: ModelResult = round_trip(
            r#"{"message":{"role":"assistant","content":[{"type":"text","text":"Hello"}]},
                "stop_reason":"end_turn","usage":{}}"#,
        );
        assert_eq!(result.usage, Usage::default());
        let result: ModelResult = round_trip(
            r#"{"message":{"role":"assistant","content":[]},"stop_reason":"tool_use",
                "usage":{"input_tokens":10,"output_tokens":0,"cache_read_input_tokens":3,
                         "cache_creation_input_tokens":1,"reasoning_tokens":5},
                "model":"gpt-5-mini-2025-08-07"}"#,
        );
        // A reported zero stays a zero; it is not confused with absence.
        assert_eq!(result.usage.output_tokens, Some(0));
        let partial = Usage {
            input_tokens: Some(7),
            ..Usage::default()
        };
        assert_eq!(
            serde_json::to_value(partial).unwrap(),
            json!({"input_tokens": 7})
        );
        // Absent usage is all counters absent.
        let result: ModelResult = serde_json::from_value(
            json!({"message":{"role":"assistant","content":[]},"stop_reason":"refusal"}),
        )
        .unwrap();
        assert_eq!(result.usage, Usage::default());
        for reason in [
            "end_turn",
            "tool_use",
            "max_tokens",
            "stop_sequence",
            "refusal",
            "unknown",
        ] {
            let text = format!(r#""{reason}""#);
            round_trip::<StopReason>(&text);
        }
        round_trip::<ModelCallResult>(
            r#"{"sequence":14,"result":{"message":{"role":"assistant","content":[]},
                "stop_reason":"max_tokens","usage":{"output_tokens":32000}}}"#,
        );
    }

    #[test]
    fn tool_results_round_trip_with_every_outcome() {
        for outcome in ["ok", "error", "timeout", "cancelled", "unknown"] {
            let text = format!(
                r#"{{"outcome":"{outcome}","content":[{{"type":"text","text":"x"}}],"is_error":true}}"#
            );
            let result: ToolResult = round_trip(&text);
            assert_eq!(result.outcome.as_str(), outcome);
        }
        round_trip::<ToolCallResult>(
            r#"{"sequence":15,"result":{"outcome":"ok","content":[],"is_error":false}}"#,
        );
    }

    #[test]
    fn kv_get_results_tell_a_stored_null_from_a_missing_key() {
        let found_null: KvGetResult = round_trip(r#"{"found":true,"value":null}"#);
        assert_eq!(found_null, KvGetResult::found(Value::Null));
        let found: KvGetResult = round_trip(r#"{"found":true,"value":{"step":2}}"#);
        assert_eq!(found, KvGetResult::found(json!({"step": 2})));
        let missing: KvGetResult = round_trip(r#"{"found":false}"#);
        assert_eq!(missing, KvGetResult::missing());
    }

    #[test]
    fn other_callback_results_round_trip() {
        round_trip::<SequenceResult>(r#"{"sequence":16}"#);
        round_trip::<EventsReadResult>(
            r#"{"events":[{"sequence":3,"type":"note","recorded_at_ms":5,"data":{},
                "origin":{"kind":"tool","sequence":2}}],"next_after":3}"#,
        );
        round_trip::<EnvironmentsListResult>(
            r#"{"environments":[{"name":"workspace","sequence":1,"status":"ready"}]}"#,
        );
        round_trip::<EnvironmentInfo>(
            r#"{"name":"workspace","sequence":1,"status":"ready","driver":"local"}"#,
        );
        round_trip::<EnvironmentsCallResult>(r#"{"sequence":20,"result":{"exit":0}}"#);
        for (method, result) in [
            (CallbackMethod::KvPut, json!({"sequence": 1})),
            (CallbackMethod::KvGet, json!({"found": false})),
            (CallbackMethod::Telemetry, json!({})),
            (CallbackMethod::EnvironmentsSetup, json!({"sequence": 4})),
        ] {
            let typed = CallbackResult::decode(method, result.clone()).unwrap();
            assert_eq!(serde_json::to_value(&typed).unwrap(), result);
        }
        assert!(CallbackResult::decode(CallbackMethod::Emit, json!({})).is_err());
    }

    #[test]
    fn record_kinds_have_their_journal_names() {
        let names: Vec<_> = RecordKind::ALL
            .into_iter()
            .map(RecordKind::as_str)
            .collect();
        assert_eq!(
            names,
            [
                "session_created",
                "activation_queued",
                "activation_started",
                "activation_finished",
                "model_call_started",
                "model_call_finished",
                "tool_call_started",
                "tool_call_finished",
                "environment_started",
                "environment_finished",
                "transcript_delta",
                "kv_set",
                "kv_delete",
                "event_emitted",
                "session_passivated",
                "session_closed",
            ]
        );
        for kind in RecordKind::ALL {
            assert_eq!(
                serde_json::to_value(kind).unwrap(),
                Value::String(kind.as_str().into())
            );
            assert_eq!(kind.as_str().parse::<RecordKind>(), Ok(kind));
        }
    }
}
