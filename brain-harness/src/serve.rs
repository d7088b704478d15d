//! The high-level loop: [`Handler`], [`serve`] and [`serve_connection`].

use super::activation::Activation;
use super::connection::Connection;
use super::error::{HandlerError, SendError};
use super::request::BrainRequest;
use super::runners::Runners;
use crate::cancel::CancelToken;
use brain_protocol::harness::{InitializeParams, InitializeResult, method};
use brain_protocol::jsonrpc::{
    INVALID_PARAMS, METHOD_NOT_FOUND, RequestId, RpcError, SERVER_ERROR,
};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread::Scope;

/// What a harness does; [`serve`] calls it. Shared by reference across the threads of concurrent
/// activations, hence `Sync`.
pub trait Handler: Sync {
    /// Answers Brain's `initialize` (PROTOCOL.md §4): the protocol, identity, state version and
    /// capabilities. An error is answered as a JSON-RPC error, and Brain then stops the worker.
    /// Runs on the serve loop's thread, which handles no other request meanwhile; Brain's 30-second
    /// deadline counts from the process's spawn.
    ///
    /// # Errors
    /// Answered to Brain as `{"code":-32000,"message":…,"data":{"code":…}}`.
    fn initialize(&self, params: &InitializeParams) -> Result<InitializeResult, HandlerError>;

    /// Called on the serve loop's thread right after a successful `initialize` answer has been
    /// queued (not necessarily written: use [`Connection::flush`] for that). The place to start
    /// background work that needs the connection. Default: nothing.
    fn initialized(&self, connection: &Connection) {
        let _ = connection;
    }

    /// Executes one activation on a thread of its own (named `harness-run`), so activations of
    /// different sessions run concurrently. Blocks as long as the activation runs. The thread is
    /// kept for later activations once this one has been answered, so thread-local state outlives
    /// the activation.
    ///
    /// `Ok(Some(value))` is answered as `{"result": value}`, `Ok(None)` as `{}` (completed with no
    /// result), `Err(error)` as a JSON-RPC error with `data.code = error.code`. The answer is what
    /// the handler returns even after a cancel: return [`HandlerError::cancelled`] when the work
    /// stopped because [`Activation::cancel_token`] was cancelled. A panic is caught and answered
    /// as `harness_error`. Await every [`Activation::call`] before returning.
    ///
    /// # Errors
    /// The activation's failure, answered to Brain as described.
    fn run(&self, activation: &Activation) -> Result<Option<Value>, HandlerError>;

    /// Called on the activation's thread right after its `run` answer has been queued (not
    /// necessarily written: [`Connection::flush`] waits for that). The place for work that must
    /// follow the answer. Default: nothing.
    fn answered(&self, session_id: &str, sequence: u64) {
        let _ = (session_id, sequence);
    }

    /// Brain closed, passivated or deleted a session (`reason` is `closed`, `passivated` or
    /// `deleted`): release its in-memory state. Runs on the serve loop's thread; `{}` is answered
    /// when it returns. Default: nothing.
    fn close(&self, session_id: &str, reason: &str) {
        let _ = (session_id, reason);
    }

    /// Brain is about to stop this worker: it will close stdin, wait 5 seconds and kill the
    /// process group. Runs on the serve loop's thread; `{}` is answered when it returns, and
    /// [`serve`] returns once stdin closes. Default: nothing.
    fn shutdown(&self) {}
}

/// Serves brain/harness/v1 on stdin and stdout until Brain closes stdin, with the default 16 MiB
/// line limit (a Brain configured with a larger limit needs [`Connection::new`] with that limit
/// and [`serve_connection`]).
///
/// Blocks for the life of the harness. When stdin closes it cancels every activation still
/// running, waits for their answers, writes everything queued, and returns.
///
/// # Errors
/// When the I/O threads cannot start, or reading stdin failed (rather than reaching its end).
pub fn serve<H: Handler + ?Sized>(handler: &H) -> std::io::Result<()> {
    let (connection, threads) = Connection::stdio()?;
    serve_connection(&connection, handler);
    connection.close();
    drop(connection);
    threads.join()
}

/// The loop behind [`serve`], over any connection: takes Brain's requests from
/// [`Connection::requests`] until the input ends, and answers each.
///
/// - `initialize`: [`Handler::initialize`]; a success also sets the outgoing line limit to
///   Brain's `max_line_bytes` and then calls [`Handler::initialized`].
/// - `run`: reads `session_id` (string) and `sequence` (non-negative integer) — anything else is
///   answered `invalid_input` (-32602) — and starts [`Handler::run`] on an activation thread with an
///   [`Activation`]. A second `run` for an activation that is still running is refused
///   (`session_busy`).
/// - `cancel`: answers `{}` at once, then cancels the named activation's token. Idempotent; an
///   unknown session or sequence, or an activation that already ended, is just `{}`.
/// - `close` and `shutdown`: the handler's hook, then `{}`.
/// - anything else: JSON-RPC error -32601 with `data.code` `unknown_method`.
///
/// Returns once the input has ended and every activation has answered; at that point it cancels
/// the activations still running. Does not close the connection: the caller decides (see
/// [`Connection::close`]). A panic in a hook other than `run` propagates out of this function.
pub fn serve_connection<H: Handler + ?Sized>(connection: &Connection, handler: &H) {
    let running = Running::default();
    let runners = Arc::new(Runners::new());
    std::thread::scope(|scope| {
        for request in connection.requests().iter() {
            let id = &request.id;
            match request.method.as_str() {
                method::INITIALIZE => initialize(connection, handler, &request),
                method::RUN => {
                    let context = RunContext {
                        connection,
                        handler,
                        running: &running,
                        runners: &runners,
                    };
                    start_run(scope, &context, request);
                }
                // Small params: a tree is the plainest way to read them. (One nested too deep
                // to build is read as no params, and refused as such.)
                method::CANCEL => {
                    let params = request.params_as::<Value>().unwrap_or(Value::Null);
                    cancel(connection, &running, id, &params);
                }
                method::CLOSE => {
                    let params = request.params_as::<Value>().unwrap_or(Value::Null);
                    close(connection, handler, id, &params);
                }
                method::SHUTDOWN => {
                    handler.shutdown();
                    answer(connection, id, &json!({}));
                }
                other => {
                    log::warn!("Brain called an unknown method: {other}");
                    let message = format!("unknown method: {other}");
                    let error = rpc_error(METHOD_NOT_FOUND, "unknown_method", message);
                    answer_error(connection, id, &error);
                }
            }
        }
        let still_running = running.all();
        if !still_running.is_empty() {
            log::info!(
                "Brain closed the input; cancelling {} running activation(s)",
                still_running.len()
            );
        }
        for token in still_running {
            token.cancel();
        }
        runners.close();
    });
}

/// The tokens of the activations currently running, by (session, sequence).
#[derive(Default)]
struct Running(Mutex<HashMap<(String, u64), CancelToken>>);

impl Running {
    /// Registers an activation; `None` when it is already running.
    fn start(&self, session_id: &str, sequence: u64) -> Option<CancelToken> {
        let mut map = self.0.lock();
        let key = (session_id.to_owned(), sequence);
        if map.contains_key(&key) {
            return None;
        }
        let token = CancelToken::new();
        map.insert(key, token.clone());
        Some(token)
    }

    fn finish(&self, session_id: &str, sequence: u64) {
        self.0.lock().remove(&(session_id.to_owned(), sequence));
    }

    /// The tokens of `session_id`'s running activations (with `sequence`, if given).
    fn matching(&self, session_id: &str, sequence: Option<u64>) -> Vec<CancelToken> {
        self.0
            .lock()
            .iter()
            .filter(|((session, seq), _)| {
                session == session_id && sequence.is_none_or(|wanted| wanted == *seq)
            })
            .map(|(_, token)| token.clone())
            .collect()
    }

    fn all(&self) -> Vec<CancelToken> {
        self.0.lock().values().cloned().collect()
    }
}

fn initialize<H: Handler + ?Sized>(connection: &Connection, handler: &H, request: &BrainRequest) {
    let id = &request.id;
    let params: InitializeParams = match request.params_as() {
        Ok(params) => params,
        Err(error) => return invalid_input(connection, id, format!("initialize: {error}")),
    };
    match handler.initialize(&params) {
        Ok(result) => {
            connection.set_max_outgoing_line_bytes(params.max_line_bytes);
            answer(connection, id, &result);
            handler.initialized(connection);
        }
        Err(error) => {
            log::warn!("initialize refused: {error}");
            answer_error(connection, id, &handler_error(&error));
        }
    }
}

/// What an activation's thread borrows from the serve loop.
struct RunContext<'a, 'env, H: ?Sized> {
    connection: &'env Connection,
    handler: &'env H,
    running: &'env Running,
    runners: &'a Arc<Runners<'env>>,
}

/// The members `run` needs before the handler reads the rest.
#[derive(serde::Deserialize)]
struct Names {
    session_id: String,
    sequence: u64,
}

/// The names of `run` params that begin as Brain writes them, `{"session_id":"<id>",
/// "sequence":<n>` (no space, no escape in the id), read off that beginning. Reading them as
/// [`Names`] scans the whole params, transcript and all, which the handler then reads again: a
/// fifteenth of what a text turn cost the reference harness (docs/BENCHMARKS.md). The params
/// are JSON already (the reader checked them); params that begin otherwise are read as `Names`.
fn leading_names(params: &str) -> Option<Names> {
    let rest = params.strip_prefix(r#"{"session_id":""#)?;
    let end = rest.find(|c: char| c == '"' || c == '\\' || c < ' ')?;
    let (session_id, rest) = rest.split_at(end);
    let rest = rest.strip_prefix(r#"","sequence":"#)?;
    let digits = rest.find(|c: char| !c.is_ascii_digit())?;
    if !matches!(rest.as_bytes()[digits], b',' | b'}') {
        return None;
    }
    Some(Names {
        session_id: session_id.to_owned(),
        sequence: rest[..digits].parse().ok()?,
    })
}

fn start_run<'scope, 'env, H: Handler + ?Sized>(
    scope: &'scope Scope<'scope, 'env>,
    context: &RunContext<'_, 'env, H>,
    request: BrainRequest,
) {
    let RunContext {
        connection,
        handler,
        running,
        runners,
    } = *context;
    let BrainRequest { id, params, .. } = request;
    // An object only: serde would also read the two members from an array.
    let names = leading_names(params.get()).map(Ok).or_else(|| {
        params
            .get()
            .starts_with('{')
            .then(|| serde_json::from_str::<Names>(params.get()))
    });
    let Some(Ok(Names {
        session_id,
        sequence,
    })) = names
    else {
        let message = "run: params need a string session_id and a non-negative integer sequence";
        return invalid_input(connection, &id, message.to_owned());
    };
    let Some(token) = running.start(&session_id, sequence) else {
        let message = format!("activation {sequence} of {session_id} is already running");
        return answer_error(
            connection,
            &id,
            &rpc_error(SERVER_ERROR, "session_busy", message),
        );
    };
    let activation = Activation::new(
        session_id.clone(),
        sequence,
        params,
        token,
        connection.clone(),
        id.clone(),
    );
    let started = runners.run(scope, {
        let id = id.clone();
        let session_id = session_id.clone();
        Box::new(move || {
            let outcome = catch_unwind(AssertUnwindSafe(|| handler.run(&activation)))
                .unwrap_or_else(|_| Err(HandlerError::harness("the harness panicked")));
            drop(activation);
            running.finish(&session_id, sequence);
            answer_run(connection, &id, outcome);
            if catch_unwind(AssertUnwindSafe(|| handler.answered(&session_id, sequence))).is_err() {
                log::error!(
                    "the harness panicked after answering activation {sequence} of {session_id}"
                );
            }
        })
    });
    if let Err(error) = started {
        running.finish(&session_id, sequence);
        let message = format!("could not start a thread for the activation: {error}");
        answer_error(
            connection,
            &id,
            &handler_error(&HandlerError::harness(message)),
        );
    }
}

fn answer_run(
    connection: &Connection,
    id: &RequestId,
    outcome: Result<Option<Value>, HandlerError>,
) {
    let sent = match outcome {
        Ok(Some(result)) => connection.respond(id, &json!({ "result": result })),
        Ok(None) => connection.respond(id, &json!({})),
        Err(error) => connection.respond_error(id, &handler_error(&error)),
    };
    match sent {
        Ok(()) => {}
        Err(SendError::TooLong { length, limit }) => {
            let message =
                format!("the run answer is {length} bytes, more than the line limit of {limit}");
            log::warn!("{message}");
            answer_error(
                connection,
                id,
                &handler_error(&HandlerError::harness(message)),
            );
        }
        Err(SendError::Closed) => log::debug!("the run answer to {id} could not be sent: closed"),
    }
}

fn cancel(connection: &Connection, running: &Running, id: &RequestId, params: &Value) {
    let Some(session_id) = params.get("session_id").and_then(Value::as_str) else {
        return invalid_input(connection, id, "cancel: session_id must be a string".into());
    };
    let sequence = match params.get("sequence") {
        None => None,
        Some(value) => match value.as_u64() {
            Some(sequence) => Some(sequence),
            None => {
                let message = "cancel: sequence must be a non-negative integer".to_owned();
                return invalid_input(connection, id, message);
            }
        },
    };
    let tokens = running.matching(session_id, sequence);
    answer(connection, id, &json!({}));
    for token in tokens {
        token.cancel();
    }
}

fn close<H: Handler + ?Sized>(
    connection: &Connection,
    handler: &H,
    id: &RequestId,
    params: &Value,
) {
    let session_id = params.get("session_id").and_then(Value::as_str);
    let reason = params.get("reason").and_then(Value::as_str);
    let (Some(session_id), Some(reason)) = (session_id, reason) else {
        let message = "close: session_id and reason must be strings".to_owned();
        return invalid_input(connection, id, message);
    };
    handler.close(session_id, reason);
    answer(connection, id, &json!({}));
}

fn rpc_error(rpc_code: i64, code: &str, message: String) -> RpcError {
    RpcError {
        code: rpc_code,
        message,
        data: Some(json!({ "code": code })),
    }
}

fn handler_error(error: &HandlerError) -> RpcError {
    rpc_error(SERVER_ERROR, &error.code, error.message.clone())
}

fn invalid_input(connection: &Connection, id: &RequestId, message: String) {
    log::warn!("{message}");
    answer_error(
        connection,
        id,
        &rpc_error(INVALID_PARAMS, "invalid_input", message),
    );
}

fn answer(connection: &Connection, id: &RequestId, result: &impl serde::Serialize) {
    if let Err(error) = connection.respond(id, result) {
        log::warn!("the answer to {id} could not be sent: {error}");
    }
}

fn answer_error(connection: &Connection, id: &RequestId, error: &RpcError) {
    if let Err(send_error) = connection.respond_error(id, error) {
        log::warn!("the error answer to {id} could not be sent: {send_error}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_off_params_that_begin_as_brain_writes_them() {
        for params in [
            r#"{"session_id":"s_1","sequence":7,"state_dir":"/d","input":{"transcript":[]}}"#,
            r#"{"session_id":"","sequence":0}"#,
            r#"{"session_id":"é","sequence":18446744073709551615,"x":"\"sequence\":1"}"#,
        ] {
            let Names {
                session_id,
                sequence,
            } = leading_names(params).expect(params);
            let whole: Names = serde_json::from_str(params).unwrap();
            assert_eq!((session_id, sequence), (whole.session_id, whole.sequence));
        }
        // Everything else is left to the whole read, which decides.
        for params in [
            r#"{"sequence":7,"session_id":"s_1"}"#,
            r#"{"session_id":"s\u0031","sequence":7}"#,
            r#"{ "session_id":"s_1","sequence":7}"#,
            r#"{"session_id":"s_1", "sequence":7}"#,
            r#"{"session_id":"s_1","sequence":7.0}"#,
            r#"{"session_id":"s_1","sequence":7e0}"#,
            r#"{"session_id":"s_1","sequence":-1}"#,
            r#"{"session_id":"s_1","sequence":"7"}"#,
            r#"{"session_id":"s_1","sequence":18446744073709551616}"#,
            r#"{"session_id":"s_1","sequence":7 }"#,
            r#"["s_1",7]"#,
        ] {
            assert!(leading_names(params).is_none(), "{params}");
        }
    }
}
