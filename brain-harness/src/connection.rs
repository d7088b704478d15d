//! [`Connection`]: the low-level, blocking JSON-RPC connection of a harness to Brain.

use super::error::{CallError, SendError};
use super::handoff::Expected;
use super::io::{self, IoThreads, Output};
use super::pending::{Answer, Pending};
use super::request::BrainRequest;
use crate::cancel::CancelToken;
use brain_protocol::harness::method;
use brain_protocol::jsonrpc::{self, RequestId, RpcError};
use crossbeam_channel::Receiver;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::io::{Read, Write};
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The line limit a connection starts with: 16 MiB, Brain's default `max_line_bytes`.
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// How many messages may wait for the writer before senders block. Bounds memory when Brain reads
/// slowly; a sender then blocks until the pipe drains.
const OUTGOING_QUEUE: usize = 1024;

/// A harness's connection to Brain: line-delimited JSON-RPC 2.0 over a reader (Brain → harness,
/// normally stdin) and a writer (harness → Brain, normally stdout).
///
/// Two named threads do the I/O (see [`IoThreads`]): `harness-read` splits the input into lines of
/// at most the line limit, decodes them, delivers Brain's requests on [`requests`](Self::requests)
/// and hands responses to the [`call`](Self::call) waiting for them. Each message is written as one
/// line and flushed, in the order given: by the sending thread itself when no earlier message waits
/// to be written, else by `harness-write`, which drains a bounded queue. Lines that are not valid
/// JSON-RPC, over-long lines and
/// responses nobody waits for are logged at `warn` and skipped, never answered.
///
/// A `Connection` is a cheap handle: clone it to use it from several threads; every method takes
/// `&self`. When Brain closes the input (or reading fails), every pending and later `call` fails at
/// once with [`CallError::CONNECTION_CLOSED`] and `requests` disconnects once drained. When the
/// output breaks (Brain closed its end), the writer stops quietly, pending calls fail the same way
/// and later sends return [`SendError::Closed`].
#[derive(Clone)]
pub struct Connection {
    output: Arc<Output>,
    requests: Receiver<BrainRequest>,
    pending: Arc<Pending>,
    next_call: Arc<AtomicU64>,
    outgoing_limit: Arc<AtomicU64>,
}

impl Connection {
    /// A connection over the process's stdin and stdout with the default 16 MiB line limit.
    ///
    /// Each message is written to stdout with a single `write_all` call, which takes stdout's lock
    /// for the whole line; so code that holds `std::io::stdout().lock()` while it writes complete
    /// lines of its own never splits one of the SDK's lines (and vice versa).
    ///
    /// # Errors
    /// When the I/O threads cannot be spawned.
    pub fn stdio() -> std::io::Result<(Connection, IoThreads)> {
        Connection::new(std::io::stdin(), std::io::stdout(), DEFAULT_MAX_LINE_BYTES)
    }

    /// A connection over any reader and writer, e.g. a pipe pair in tests. `max_line_bytes` bounds
    /// every incoming line (memory held is at most that plus 64 KiB) and, until
    /// [`set_max_outgoing_line_bytes`](Self::set_max_outgoing_line_bytes) changes it, every outgoing
    /// one.
    ///
    /// # Errors
    /// When the I/O threads cannot be spawned.
    pub fn new<R, W>(
        reader: R,
        writer: W,
        max_line_bytes: usize,
    ) -> std::io::Result<(Connection, IoThreads)>
    where
        R: Read + Send + 'static,
        W: Write + Send + 'static,
    {
        let (requests_tx, requests) = crossbeam_channel::unbounded();
        let pending = Arc::new(Pending::default());
        let (output, threads) = io::start(
            reader,
            writer,
            max_line_bytes,
            OUTGOING_QUEUE,
            requests_tx,
            pending.clone(),
        )?;
        let connection = Connection {
            output,
            requests,
            pending,
            next_call: Arc::new(AtomicU64::new(1)),
            outgoing_limit: Arc::new(AtomicU64::new(max_line_bytes as u64)),
        };
        Ok((connection, threads))
    }

    /// Brain's requests, in arrival order. All clones share this one queue: each request is
    /// delivered to exactly one receiver. The queue is unbounded (Brain bounds what it sends by
    /// `max_concurrency`), so the reader never blocks on a slow consumer. It disconnects after the
    /// input has ended and every queued request has been taken.
    pub fn requests(&self) -> &Receiver<BrainRequest> {
        &self.requests
    }

    /// Sets the longest line this connection will write, e.g. to the `max_line_bytes` Brain sent
    /// in `initialize` ([`serve`](super::serve) does this). Does not change the incoming limit,
    /// which is fixed when the connection is made.
    pub fn set_max_outgoing_line_bytes(&self, limit: u64) {
        self.outgoing_limit.store(limit, Ordering::Relaxed);
    }

    /// Answers Brain's request `id` with `result`.
    ///
    /// Blocks only while Brain is not reading: while this thread writes the line, or while the
    /// outgoing queue is full.
    ///
    /// # Errors
    /// [`SendError::TooLong`] when the encoded answer exceeds the outgoing limit (nothing is sent;
    /// answer with an error instead), [`SendError::Closed`] when the writer has stopped.
    pub fn respond(&self, id: &RequestId, result: &impl Serialize) -> Result<(), SendError> {
        self.send_checked(jsonrpc::encode_result(id, result))
    }

    /// Answers Brain's request `id` with a JSON-RPC error. Brain matches on `data.code`, so give
    /// one: `{"code": "<code>"}`.
    ///
    /// # Errors
    /// As [`respond`](Self::respond).
    pub fn respond_error(&self, id: &RequestId, error: &RpcError) -> Result<(), SendError> {
        self.send_checked(jsonrpc::encode_error(id, error))
    }

    /// Sends a `brain/call` for activation `sequence` of `session_id` and blocks until Brain
    /// answers it. Callable from any thread; calls from several threads run concurrently. Each call
    /// gets a fresh string id (`"c1"`, `"c2"`, …) that is never reused on this connection.
    ///
    /// Never hangs on a lost peer: when the input ends or the writer stops, the call fails at once
    /// with [`CallError::CONNECTION_CLOSED`] (fatal). Brain itself answers every admitted call.
    /// This low-level call does not touch any [`CancelToken`](super::CancelToken);
    /// [`Activation::call`](super::Activation::call) does.
    ///
    /// # Errors
    /// Brain's error answer (code and fatality copied from `data`), or a local failure:
    /// [`CallError::CONNECTION_CLOSED`], [`CallError::INPUT_TOO_LARGE`] (not sent).
    pub fn call(
        &self,
        session_id: &str,
        sequence: u64,
        method: &str,
        input: Value,
    ) -> Result<Value, CallError> {
        self.call_typed(session_id, sequence, method, &input)
    }

    /// As [`call`](Self::call), with the input encoded straight from `input` and the answer's
    /// result typed as `O` straight from its JSON text: no `Value` tree on either side. Use the
    /// protocol's result types (`ModelCallResult`, `SequenceResult`, …) or `Value`.
    ///
    /// # Errors
    /// As [`call`](Self::call); and [`CallError::INVALID_RESPONSE`] (not fatal) when the result is
    /// not an `O`.
    pub fn call_typed<I: Serialize + ?Sized, O: DeserializeOwned>(
        &self,
        session_id: &str,
        sequence: u64,
        method: &str,
        input: &I,
    ) -> Result<O, CallError> {
        self.start_call_typed(session_id, sequence, method, input)?
            .wait()
    }

    /// Sends the call as [`call_typed`](Self::call_typed) does and returns without waiting for
    /// the answer, so that one thread can have several calls in flight (a model's parallel tool
    /// calls, say): [`PendingCall::wait`] blocks for this call's answer. Calls are sent in the
    /// order they are started; Brain may answer them in any order.
    ///
    /// # Errors
    /// A call that could not be sent: [`CallError::CONNECTION_CLOSED`],
    /// [`CallError::INPUT_TOO_LARGE`].
    pub fn start_call_typed<I: Serialize + ?Sized, O: DeserializeOwned>(
        &self,
        session_id: &str,
        sequence: u64,
        method: &str,
        input: &I,
    ) -> Result<PendingCall<'_, O>, CallError> {
        #[derive(Serialize)]
        struct Params<'a, I: ?Sized> {
            session_id: &'a str,
            sequence: u64,
            method: &'a str,
            input: &'a I,
        }
        let n = self.next_call.fetch_add(1, Ordering::Relaxed);
        let id = RequestId::Str(format!("c{n}"));
        let params = Params {
            session_id,
            sequence,
            method,
            input,
        };
        let line = jsonrpc::encode_request(&id, method::BRAIN_CALL, &params);
        let limit = self.outgoing_limit.load(Ordering::Relaxed);
        if line.len() as u64 > limit {
            return Err(CallError::too_large(line.len(), limit));
        }
        let (promise, answer) = crate::handoff::oneshot();
        self.pending
            .register(id.clone(), promise)
            .map_err(|reason| CallError::connection_closed(&reason))?;
        if !self.output.line(line, &self.pending) {
            self.pending.forget(&id);
            return Err(self.closed_error());
        }
        Ok(PendingCall {
            connection: self,
            method: method.to_owned(),
            answer,
            cancel_on_fatal: None,
            typed: PhantomData,
        })
    }

    /// **For testing hosts.** Writes `line` as one line (the SDK appends the newline) without
    /// validating it in any way: not JSON, invalid UTF-8, over the limit — all are written as
    /// given. A correct harness never needs this.
    ///
    /// Blocks only while Brain is not reading (see [`respond`](Self::respond)).
    ///
    /// # Errors
    /// [`SendError::Closed`] when the writer has stopped.
    pub fn send_raw_line(&self, line: Vec<u8>) -> Result<(), SendError> {
        if self.output.line(line, &self.pending) {
            Ok(())
        } else {
            Err(SendError::Closed)
        }
    }

    /// Blocks until every message queued before this call (from any clone) has been written and
    /// flushed. May block for as long as Brain does not read.
    ///
    /// # Errors
    /// [`SendError::Closed`] when the writer stopped before reaching this point.
    pub fn flush(&self) -> Result<(), SendError> {
        if self.output.flush() {
            Ok(())
        } else {
            Err(SendError::Closed)
        }
    }

    /// Stops the writer once the messages already queued are written: afterwards every send from
    /// any clone fails with [`SendError::Closed`] and pending calls fail. Idempotent. Blocks only
    /// while the outgoing queue is full. The input side is unaffected: requests still arrive until
    /// Brain closes it.
    pub fn close(&self) {
        self.output.close();
    }

    fn send_checked(&self, line: Vec<u8>) -> Result<(), SendError> {
        let limit = self.outgoing_limit.load(Ordering::Relaxed);
        if line.len() as u64 > limit {
            return Err(SendError::TooLong {
                length: line.len(),
                limit,
            });
        }
        self.send_raw_line(line)
    }

    fn closed_error(&self) -> CallError {
        let reason = self
            .pending
            .closed_reason()
            .unwrap_or_else(|| "the connection's writer stopped".to_owned());
        CallError::connection_closed(&reason)
    }
}

/// A `brain/call` that was sent and is not answered yet: [`Connection::start_call_typed`] and
/// [`Activation::start_call_typed`](super::Activation::start_call_typed) return it, and
/// [`wait`](Self::wait) blocks until its answer arrives. Dropping it without waiting discards the
/// answer when it comes; the call itself still runs in Brain, so a `run` must wait for every call
/// it started before it returns.
#[must_use = "wait for every call before returning from run"]
pub struct PendingCall<'a, O> {
    connection: &'a Connection,
    method: String,
    answer: Expected<Answer>,
    /// Cancelled before `wait` returns a fatal error (the activation's token, for a call started
    /// through [`Activation`](super::Activation)).
    cancel_on_fatal: Option<&'a CancelToken>,
    typed: PhantomData<fn() -> O>,
}

impl<'a, O: DeserializeOwned> PendingCall<'a, O> {
    /// Cancels `token` when the answer is a fatal error, before [`wait`](Self::wait) returns it.
    pub(crate) fn cancelling_on_fatal(mut self, token: &'a CancelToken) -> PendingCall<'a, O> {
        self.cancel_on_fatal = Some(token);
        self
    }

    /// The method called (`model`, `tool`, …).
    pub fn method(&self) -> &str {
        &self.method
    }

    /// Blocks until the answer arrives and types its result as `O`.
    ///
    /// # Errors
    /// As [`Connection::call_typed`].
    pub fn wait(self) -> Result<O, CallError> {
        let result = match self.answer.wait() {
            Some(Ok(result)) => result.typed().map_err(|error| {
                CallError::invalid_response(format!(
                    "the answer to {} is malformed: {error}",
                    self.method
                ))
            }),
            Some(Err(error)) => Err(CallError::from_rpc(error)),
            None => Err(self.connection.closed_error()),
        };
        if let (Err(error), Some(token)) = (&result, self.cancel_on_fatal)
            && error.fatal
        {
            log::debug!(
                "cancelling the activation: {} failed fatally with {}",
                self.method,
                error.code
            );
            token.cancel();
        }
        result
    }
}

impl<O> std::fmt::Debug for PendingCall<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingCall")
            .field("method", &self.method)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("closed", &self.pending.closed_reason())
            .finish_non_exhaustive()
    }
}
