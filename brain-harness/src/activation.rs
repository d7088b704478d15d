//! [`Activation`]: what a handler's `run` sees of the activation it executes.

use super::connection::{Connection, PendingCall};
use super::error::CallError;
use crate::cancel::CancelToken;
use brain_protocol::jsonrpc::RequestId;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use serde_json::value::RawValue;
use std::sync::OnceLock;

/// One activation (one `run` request) being executed by a [`Handler`](super::Handler).
///
/// It names the activation (`session_id`, `sequence`), carries the `run` params exactly as Brain
/// sent them, makes callbacks to Brain on the activation's behalf, and holds its [`CancelToken`].
///
/// The params are kept as the JSON text Brain sent: [`params_as`](Self::params_as) types them
/// straight from it (the cheap way to read a transcript), and [`params`](Self::params) builds a
/// `Value` tree the first time it is asked for.
pub struct Activation {
    session_id: String,
    sequence: u64,
    params: Box<RawValue>,
    tree: OnceLock<Value>,
    cancel: CancelToken,
    connection: Connection,
    request_id: RequestId,
}

impl Activation {
    pub(crate) fn new(
        session_id: String,
        sequence: u64,
        params: Box<RawValue>,
        cancel: CancelToken,
        connection: Connection,
        request_id: RequestId,
    ) -> Activation {
        Activation {
            session_id,
            sequence,
            params,
            tree: OnceLock::new(),
            cancel,
            connection,
            request_id,
        }
    }

    /// The JSON-RPC id of the `run` request (for harnesses that answer it themselves, such as a
    /// fault harness testing how a host treats malformed answers).
    pub fn request_id(&self) -> &RequestId {
        &self.request_id
    }

    /// The session this activation belongs to.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// The activation's sequence (its `activation_queued` record), named in every callback.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The `run` params as Brain sent them (PROTOCOL.md §6): `session_id`, `sequence`,
    /// `state_dir`, `model`, `input`, … The tree is built on the first call and kept; prefer
    /// [`params_as`](Self::params_as) to read the transcript. `Value::Null` when the params nest
    /// deeper than serde_json's recursion limit (128 levels).
    pub fn params(&self) -> &Value {
        self.tree
            .get_or_init(|| serde_json::from_str(self.params.get()).unwrap_or(Value::Null))
    }

    /// The `run` params typed as `T` (usually [`RunParams`](brain_protocol::harness::RunParams))
    /// straight from the JSON text Brain sent: no `Value` tree is built.
    ///
    /// # Errors
    /// When the params are not a `T`.
    pub fn params_as<T: DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_str(self.params.get())
    }

    /// The params' `input` member (`input.input`, `transcript`, `kv`, `events`, `tools`, …), if
    /// present.
    pub fn input(&self) -> Option<&Value> {
        self.params().get("input")
    }

    /// The activation's cancellation signal. Cancelled when Brain sends `cancel` for it, when a
    /// callback fails fatally, or when the connection closes.
    pub fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// Shorthand for `self.cancel_token().is_cancelled()`.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Calls Brain (`brain/call`) as this activation, e.g. `call("model", request)` or
    /// `call("kv.get", json!({"key": "plan"}))`, and blocks until the answer arrives. Callable from
    /// any thread the handler starts; calls run concurrently.
    ///
    /// When the call fails with a fatal error (Brain's `data.fatal`, or the connection closing),
    /// the activation's token is cancelled — its hooks run — before this returns, as the seed's
    /// TypeScript binding aborts `ctx.signal`. Calls still work after a cancel: Brain keeps
    /// answering `kv.*`, `transcript.set`, `emit` and `events.read` so the harness can save its
    /// state, and fails effects with `cancelled`. Await every call before returning from `run`.
    ///
    /// # Errors
    /// As [`Connection::call`].
    pub fn call(&self, method: &str, input: Value) -> Result<Value, CallError> {
        self.call_typed(method, &input)
    }

    /// As [`call`](Self::call), typed both ways: see [`Connection::call_typed`]. E.g.
    /// `call_typed::<_, ModelCallResult>("model", &request)`.
    ///
    /// # Errors
    /// As [`Connection::call_typed`].
    pub fn call_typed<I: Serialize + ?Sized, O: DeserializeOwned>(
        &self,
        method: &str,
        input: &I,
    ) -> Result<O, CallError> {
        self.start_call_typed(method, input)?.wait()
    }

    /// Sends a call as [`call_typed`](Self::call_typed) does without waiting for its answer, so
    /// that this thread can have several calls in flight, e.g. every tool call a model asked for
    /// at once; [`PendingCall::wait`] blocks for the answer and, as `call` does, cancels this
    /// activation's token before returning a fatal error. Wait for every call before returning
    /// from `run`.
    ///
    /// # Errors
    /// As [`Connection::start_call_typed`]: the call was not sent.
    pub fn start_call_typed<I: Serialize + ?Sized, O: DeserializeOwned>(
        &self,
        method: &str,
        input: &I,
    ) -> Result<PendingCall<'_, O>, CallError> {
        let pending =
            self.connection
                .start_call_typed(&self.session_id, self.sequence, method, input);
        match pending {
            Ok(pending) => Ok(pending.cancelling_on_fatal(&self.cancel)),
            Err(error) => {
                if error.fatal {
                    self.cancel.cancel();
                }
                Err(error)
            }
        }
    }
}

impl std::fmt::Debug for Activation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activation")
            .field("session_id", &self.session_id)
            .field("sequence", &self.sequence)
            .field("cancelled", &self.cancel.is_cancelled())
            .finish_non_exhaustive()
    }
}
