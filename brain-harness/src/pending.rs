//! The harness's outstanding `brain/call` requests: id → the promise of its answer.
//!
//! Kept apart from the transport (as lsp-server's `req_queue.rs` does). Closing is one step under the
//! lock: it marks the map closed and drops every waiting promise, so each blocked caller wakes at
//! once, and no caller can register after the close and then wait forever.

use crate::handoff::Promise;
use brain_protocol::jsonrpc::{RequestId, RpcError};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use std::collections::HashMap;

/// What a caller receives: the response's outcome, the result still as JSON text (the caller
/// types it).
pub(crate) type Answer = Result<ResultText, RpcError>;

/// A success response's result, not read yet.
pub(crate) enum ResultText {
    /// The whole line, which starts as a success response does
    /// ([`jsonrpc::result_line_id`](brain_protocol::jsonrpc::result_line_id)) and is read only
    /// when the caller types it.
    Line(Vec<u8>),
    /// The result alone, as a line read the general way held it.
    Raw(Box<RawValue>),
}

impl ResultText {
    /// The result typed as `O`, or what is wrong with it (or, for a line, with the line).
    pub(crate) fn typed<O: DeserializeOwned>(&self) -> Result<O, String> {
        match self {
            ResultText::Line(line) => brain_protocol::jsonrpc::decode_result_line(line),
            ResultText::Raw(raw) => serde_json::from_str(raw.get()).map_err(|e| e.to_string()),
        }
    }
}

#[derive(Default)]
pub(crate) struct Pending {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// `Some(reason)` once the connection closed; no call may register after that.
    closed: Option<String>,
    calls: HashMap<RequestId, Promise<Answer>>,
}

impl Pending {
    /// Registers a call. Fails with the close reason when the connection is already closed.
    pub(crate) fn register(&self, id: RequestId, answer: Promise<Answer>) -> Result<(), String> {
        let mut state = self.state.lock();
        if let Some(reason) = &state.closed {
            return Err(reason.clone());
        }
        state.calls.insert(id, answer);
        Ok(())
    }

    /// Forgets a call whose request could not be sent.
    pub(crate) fn forget(&self, id: &RequestId) {
        self.state.lock().calls.remove(id);
    }

    /// Hands the answer to call `id` to its caller. False when no call has that id (never sent,
    /// or already answered): a violation for the caller to log.
    pub(crate) fn complete(&self, id: &RequestId, outcome: Answer) -> bool {
        let Some(answer) = self.state.lock().calls.remove(id) else {
            return false;
        };
        answer.deliver(outcome);
        true
    }

    /// Marks the map closed (the first reason wins) and fails every waiting call at once.
    pub(crate) fn close(&self, reason: &str) {
        let calls = {
            let mut state = self.state.lock();
            state.closed.get_or_insert_with(|| reason.to_owned());
            std::mem::take(&mut state.calls)
        };
        if !calls.is_empty() {
            log::debug!("failing {} pending brain/call(s): {reason}", calls.len());
        }
        // Dropping the promises wakes each caller empty-handed, which it reports as closed.
        drop(calls);
    }

    /// The reason the connection closed, if it has.
    pub(crate) fn closed_reason(&self) -> Option<String> {
        self.state.lock().closed.clone()
    }
}
