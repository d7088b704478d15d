//! The SDK's error types: [`SendError`] (a message could not be queued), [`CallError`] (a
//! `brain/call` failed) and [`HandlerError`] (a handler refuses `initialize` or fails a `run`).

use brain_protocol::jsonrpc::RpcError;
use serde_json::Value;
use std::fmt;

/// Why a message could not be queued for writing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendError {
    /// The writer has stopped: Brain closed the harness's stdout, a write failed, or
    /// [`Connection::close`](super::Connection::close) was called. Nothing more can be sent.
    Closed,
    /// The encoded message is longer than the outgoing line limit; it was not sent. Brain would
    /// discard such a line as a violation, so the SDK refuses it before it reaches the pipe.
    TooLong {
        /// The encoded length in bytes, without the newline.
        length: usize,
        /// The limit in force.
        limit: u64,
    },
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::Closed => f.write_str("the connection to Brain is closed"),
            SendError::TooLong { length, limit } => write!(
                f,
                "the message is {length} bytes, more than the line limit of {limit} bytes"
            ),
        }
    }
}

impl std::error::Error for SendError {}

/// A failed `brain/call`: Brain's error answer, or a local failure that kept the call from being
/// answered.
///
/// Brain's errors carry `data.code` (a string from PROTOCOL.md §10, e.g. `not_granted`) and
/// `data.fatal`; both are copied here. Local failures use the codes
/// [`CONNECTION_CLOSED`](CallError::CONNECTION_CLOSED) (fatal) and
/// [`INPUT_TOO_LARGE`](CallError::INPUT_TOO_LARGE) (not fatal).
#[derive(Debug, Clone, PartialEq)]
pub struct CallError {
    /// The error code callers match on (`data.code`).
    pub code: String,
    /// Whether the error stops the activation (`data.fatal`). When a callback made through
    /// [`Activation::call`](super::Activation::call) fails fatally, the SDK has already cancelled
    /// the activation's [`CancelToken`](super::CancelToken).
    pub fatal: bool,
    /// A human-readable message.
    pub message: String,
    /// The error's whole `data` member as Brain sent it; `None` for local failures.
    pub data: Option<Value>,
}

impl CallError {
    /// Local code: the connection closed (or its writer stopped) before the call was answered.
    /// Fatal: Brain is gone or is stopping this worker.
    pub const CONNECTION_CLOSED: &'static str = "connection_closed";
    /// Local code: the encoded call exceeds the line limit, so it was never sent. Not fatal.
    pub const INPUT_TOO_LARGE: &'static str = "input_too_large";
    /// The code given to an error answer whose `data.code` is missing or not a string.
    pub const INVALID_RESPONSE: &'static str = "invalid_response";

    pub(crate) fn connection_closed(reason: &str) -> CallError {
        CallError {
            code: CallError::CONNECTION_CLOSED.to_owned(),
            fatal: true,
            message: reason.to_owned(),
            data: None,
        }
    }

    pub(crate) fn invalid_response(message: String) -> CallError {
        CallError {
            code: CallError::INVALID_RESPONSE.to_owned(),
            fatal: false,
            message,
            data: None,
        }
    }

    pub(crate) fn too_large(length: usize, limit: u64) -> CallError {
        CallError {
            code: CallError::INPUT_TOO_LARGE.to_owned(),
            fatal: false,
            message: SendError::TooLong { length, limit }.to_string(),
            data: None,
        }
    }

    pub(crate) fn from_rpc(error: RpcError) -> CallError {
        let field = |name: &str| error.data.as_ref().and_then(|data| data.get(name));
        let code = field("code")
            .and_then(Value::as_str)
            .unwrap_or(CallError::INVALID_RESPONSE)
            .to_owned();
        let fatal = field("fatal").and_then(Value::as_bool).unwrap_or(false);
        CallError {
            code,
            fatal,
            message: error.message,
            data: error.data,
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fatal = if self.fatal { ", fatal" } else { "" };
        write!(
            f,
            "brain/call failed ({}{fatal}): {}",
            self.code, self.message
        )
    }
}

impl std::error::Error for CallError {}

/// A handler's failure: answered to Brain as a JSON-RPC error
/// `{"code":-32000,"message":<message>,"data":{"code":<code>}}`.
///
/// Brain records `code` as the activation's failure code when it is at most 64 characters from
/// `[a-z0-9_.]`, and `harness_error` otherwise. Return [`HandlerError::cancelled`] from a `run`
/// that stopped because its token was cancelled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerError {
    /// The `data.code` Brain matches on, e.g. `cancelled` or `harness_error`.
    pub code: String,
    /// A human-readable message (Brain keeps at most 4 KiB of it).
    pub message: String,
}

impl HandlerError {
    /// An error with any code and message.
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> HandlerError {
        HandlerError {
            code: code.into(),
            message: message.into(),
        }
    }

    /// The activation stopped because it was cancelled (code `cancelled`).
    pub fn cancelled() -> HandlerError {
        HandlerError::new("cancelled", "the activation was cancelled")
    }

    /// A failure of the harness itself (code `harness_error`).
    pub fn harness(message: impl Into<String>) -> HandlerError {
        HandlerError::new("harness_error", message)
    }
}

/// A failed callback becomes the handler's failure with the same code, so `?` on
/// [`Activation::call`](super::Activation::call) ends the activation the way Brain expects (a fatal
/// `cancelled` answers `cancelled`).
impl From<CallError> for HandlerError {
    fn from(error: CallError) -> HandlerError {
        HandlerError {
            code: error.code,
            message: error.message,
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for HandlerError {}
