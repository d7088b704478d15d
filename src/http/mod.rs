//! The HTTP API (PRODUCT.md "HTTP API"): a synchronous HTTP/1.1 server over `std::net`.
//!
//! The shape, after tiny-http and rouille (STYLE.md §5) with their gaps filled:
//!
//! - One thread, `brain-http-poll`, accepts connections and owns every idle one (a fresh one, or
//!   a keep-alive one between requests). It waits in `poll(2)` and hands a connection to the
//!   workers only once it has bytes to read, so idle clients never occupy a worker. Idle
//!   connections are closed after [`HttpOptions::idle_timeout`]; past
//!   [`HttpOptions::max_connections`] open connections, new ones are answered `503` at once.
//! - A fixed pool of [`HttpOptions::threads`] workers (`brain-http-N`) takes ready connections
//!   from a bounded queue ([`HttpOptions::accept_queue`]; when it is full the connection is
//!   answered `503 overloaded` at once). A worker reads one request (head ≤ 16 KiB and ≤ 100
//!   headers, a `Content-Length` body of at most [`HttpOptions::max_body_bytes`], the whole
//!   request within [`HttpOptions::read_timeout`]), answers it, and gives the connection back.
//!   Each handler runs under `catch_unwind`: a panic answers `500`.
//! - Long waits (`POST …/messages` without `Prefer: respond-async`) and SSE followers never
//!   occupy a worker: the connection is handed to a thread of its own (`brain-http-wait`,
//!   `brain-http-sse`), at most [`HttpOptions::max_long_waits`] and [`HttpOptions::max_sse`] of
//!   them; past either bound the request is answered `503 overloaded` (a message is then not
//!   admitted). Those threads wake on a condvar (the outcome, or a new journal record), and once a
//!   second to notice a stopping server or a client that went away.
//!
//! Errors are `{"error":{"code","message"}}` with PRODUCT.md's statuses; see [`status_for`].

mod auth;
mod metrics;
mod poller;
pub(crate) mod request;
mod response;
mod routes;
pub(crate) mod server;
mod sse;
mod wait;

pub use auth::load_or_create_token;
pub use response::status_for;
pub use routes::{OPENAPI, OPENAPI_PATH, routes};
pub use server::HttpServer;

use std::time::Duration;

/// Limits and timeouts of the HTTP server. `HttpOptions::default()` holds the production figures.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// The largest request body accepted; a larger `Content-Length` is answered `413`
    /// (`input_too_large`) before any of the body is read (default 16 MiB).
    pub max_body_bytes: usize,
    /// Worker threads that read requests and answer them (default 16).
    pub threads: usize,
    /// `POST …/messages` and `…/activations` requests that may wait for their outcome at once;
    /// past it they are answered `503 overloaded` without being admitted (default 256).
    pub max_long_waits: usize,
    /// SSE followers at once; past it `503 overloaded` (default 256).
    pub max_sse: usize,
    /// Open connections at once, idle ones included; past it new connections are answered `503`
    /// and closed (default 1024). The process needs that many file descriptors to spare.
    pub max_connections: usize,
    /// Connections with a request ready that may wait for a free worker; when the queue is full a
    /// connection is answered `503 overloaded` at once (default 64).
    pub accept_queue: usize,
    /// The time a client has to send a whole request, head and body, once its first byte is
    /// there; then it is answered `408` and closed (default 30 s).
    pub read_timeout: Duration,
    /// The longest a single write to a client may block; a client that reads slower is dropped.
    /// This is what drops a slow SSE reader (default 30 s).
    pub write_timeout: Duration,
    /// How long a kept-alive connection may sit idle between requests before it is closed
    /// (default 60 s). A new connection must send its first request within
    /// [`HttpOptions::read_timeout`].
    pub idle_timeout: Duration,
    /// How long `POST …/messages` waits for the outcome; past it the answer is `202` with
    /// `{"session_id","sequence"}` and the outcome is left to the events (default 1 hour).
    pub message_wait: Duration,
    /// The interval of SSE heartbeat comments on an otherwise quiet stream (default 15 s).
    pub sse_heartbeat: Duration,
    /// How long [`HttpServer::stop`] waits for long waits and SSE followers to end (default 5 s);
    /// the accept thread and the workers are always joined.
    pub stop_timeout: Duration,
}

impl Default for HttpOptions {
    fn default() -> HttpOptions {
        HttpOptions {
            max_body_bytes: 16 * 1024 * 1024,
            threads: 16,
            max_long_waits: 256,
            max_sse: 256,
            max_connections: 1024,
            accept_queue: 64,
            read_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            message_wait: Duration::from_secs(3600),
            sse_heartbeat: Duration::from_secs(15),
            stop_timeout: Duration::from_secs(5),
        }
    }
}
