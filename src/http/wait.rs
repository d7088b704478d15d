//! Long waits: a `POST …/messages` (or `…/activations`) that waits for its activation's outcome
//! on a thread of its own (`brain-http-wait`), holding one of [`HttpOptions::max_long_waits`]
//! permits, so that waiting clients never occupy a worker.
//!
//! [`HttpOptions::max_long_waits`]: super::HttpOptions::max_long_waits

use super::response::Response;
use super::routes::accepted;
use super::server::{CHECK_INTERVAL, Conn, Permit, Shared, spawn_or_run};
use crate::api::Activation;
use std::sync::Arc;
use std::time::Instant;

/// An admitted activation whose outcome a client waits for.
pub(crate) struct Wait {
    pub activation: Activation,
    pub permit: Permit,
}

struct Job {
    shared: Arc<Shared>,
    conn: Conn,
    wait: Wait,
    keep_alive: bool,
}

/// Hands the connection to a wait thread.
pub(crate) fn start(shared: Arc<Shared>, conn: Conn, wait: Wait, keep_alive: bool) {
    let job = Job {
        shared,
        conn,
        wait,
        keep_alive,
    };
    spawn_or_run("brain-http-wait", job, run);
}

/// Waits on the outcome's condvar, waking once a [`CHECK_INTERVAL`] to notice a stopping server
/// (answered `202`), the end of [`HttpOptions::message_wait`](super::HttpOptions::message_wait)
/// (`202`) or a client that went away (nothing to answer; the activation goes on).
fn run(job: Job) {
    let Job {
        shared,
        conn,
        wait: Wait { activation, permit },
        keep_alive,
    } = job;
    let deadline = Instant::now() + shared.options.message_wait;
    let response = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(outcome) = activation.wait_timeout(CHECK_INTERVAL.min(left)) {
            break Response::json(200, &outcome);
        }
        if shared.stopping() || Instant::now() >= deadline {
            break accepted(&activation);
        }
        if conn.peer_closed() {
            log::debug!(
                "session {}: the client waiting for activation {} went away",
                activation.session_id(),
                activation.sequence()
            );
            return;
        }
    };
    if let Some(conn) = shared.respond(conn, &response, keep_alive) {
        shared.give_back(conn);
    }
    drop(permit);
}
