//! The server handle, the shared state, the worker pool and the request loop of a connection.

use super::HttpOptions;
use super::metrics::HttpCounters;
use super::poller::Poller;
use super::request::{self, ReadError};
use super::response::Response;
use super::routes::{self, Reply};
use crate::brain::Brain;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a long wait or an SSE follower checks for a stopping server or a vanished client.
pub(crate) const CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Requests served back to back from one connection's buffer before it goes back to the poller.
const MAX_PIPELINED: usize = 16;

/// Most unread bytes discarded before closing a connection whose request was not read whole.
const LINGER_BYTES: usize = 1024 * 1024;

/// How long a closing connection's unread bytes are discarded.
const LINGER_TIME: Duration = Duration::from_secs(1);

/// Stack of the worker, wait and SSE threads: handlers recurse only through serde, which is
/// depth-limited.
const THREAD_STACK: usize = 512 * 1024;

/// A counting limit with a condvar, for open connections, long waits and SSE followers.
#[derive(Debug)]
pub(crate) struct Limit {
    max: usize,
    in_use: Mutex<usize>,
    freed: Condvar,
}

impl Limit {
    pub(crate) fn new(max: usize) -> Arc<Limit> {
        Arc::new(Limit {
            max,
            in_use: Mutex::new(0),
            freed: Condvar::new(),
        })
    }

    /// A permit, unless `max` are in use.
    pub(crate) fn try_acquire(self: &Arc<Limit>) -> Option<Permit> {
        let mut in_use = self.in_use.lock();
        if *in_use >= self.max {
            return None;
        }
        *in_use += 1;
        Some(Permit(self.clone()))
    }

    pub(crate) fn in_use(&self) -> usize {
        *self.in_use.lock()
    }

    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Blocks until no permit is held or `deadline` passes; whether none is held.
    fn wait_idle(&self, deadline: Instant) -> bool {
        let mut in_use = self.in_use.lock();
        while *in_use > 0 {
            if self.freed.wait_until(&mut in_use, deadline).timed_out() {
                return *in_use == 0;
            }
        }
        true
    }
}

/// One unit of a [`Limit`], given back on drop (on every path).
#[derive(Debug)]
pub(crate) struct Permit(Arc<Limit>);

impl Drop for Permit {
    fn drop(&mut self) {
        let mut in_use = self.0.in_use.lock();
        *in_use = in_use.saturating_sub(1);
        self.0.freed.notify_all();
    }
}

/// An open client connection and the bytes read from it but not yet used.
#[derive(Debug)]
pub(crate) struct Conn {
    pub stream: TcpStream,
    pub buf: Vec<u8>,
    pub peer: SocketAddr,
    _open: Permit,
}

impl Conn {
    pub(crate) fn new(stream: TcpStream, peer: SocketAddr, open: Permit) -> Conn {
        Conn {
            stream,
            buf: Vec::new(),
            peer,
            _open: open,
        }
    }

    /// Whether the client has closed its side (or the connection failed). Never blocks. Bytes
    /// already buffered or waiting (a pipelined request) count as "still there".
    pub(crate) fn peer_closed(&self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        if self.stream.set_nonblocking(true).is_err() {
            return true;
        }
        let mut byte = [0u8; 1];
        let closed = match self.stream.peek(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(error) => !matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
        };
        self.stream.set_nonblocking(false).is_err() || closed
    }

    /// Closes after a response while the client may still be sending (a body that was not read):
    /// half-closes, then discards what arrives for a moment, so the response is not lost to a
    /// reset.
    pub(crate) fn close_lingering(mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
        let deadline = Instant::now() + LINGER_TIME;
        let mut discarded = 0;
        let mut chunk = [0u8; 8192];
        while discarded < LINGER_BYTES {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero()
                || self
                    .stream
                    .set_read_timeout(Some(remaining.max(Duration::from_millis(1))))
                    .is_err()
            {
                return;
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => discarded += n,
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }
}

/// What every thread of one server shares.
pub(crate) struct Shared {
    pub brain: Arc<Brain>,
    pub token: String,
    pub options: HttpOptions,
    pub stopping: AtomicBool,
    pub connections: Arc<Limit>,
    pub long_waits: Arc<Limit>,
    pub followers: Arc<Limit>,
    pub counters: HttpCounters,
    /// Connections handed back for keep-alive, to the poller.
    returned: Sender<Conn>,
    /// Wakes the poller (one byte; a full pipe means a wake is already pending).
    waker: UnixStream,
}

impl Shared {
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    pub(crate) fn wake_poller(&self) {
        let _ = (&self.waker).write(&[1]);
    }

    /// Gives a kept-alive connection back to the poller to wait for its next request.
    pub(crate) fn give_back(&self, conn: Conn) {
        if self.stopping() {
            return;
        }
        if self.returned.send(conn).is_ok() {
            self.wake_poller();
        }
    }

    /// Writes a response. Returns the connection when it may serve another request.
    pub(crate) fn respond(
        &self,
        conn: Conn,
        response: &Response,
        wants_keep_alive: bool,
    ) -> Option<Conn> {
        let keep_alive = wants_keep_alive && !response.close && !self.stopping();
        self.counters.responded(response.status);
        if let Err(error) = response.write_to(&conn.stream, keep_alive) {
            log::debug!("writing a response to {} failed: {error}", conn.peer);
            return None;
        }
        keep_alive.then_some(conn)
    }

    /// Writes a response with `Connection: close`, then closes without losing it to a reset
    /// while the client may still be sending.
    pub(crate) fn respond_closing(&self, conn: Conn, response: &Response) {
        self.counters.responded(response.status);
        match response.write_to(&conn.stream, false) {
            Ok(()) => conn.close_lingering(),
            Err(error) => log::debug!("writing a response to {} failed: {error}", conn.peer),
        }
    }
}

/// Runs `job(state)` on a new named thread; when no thread can be started it runs here instead.
pub(crate) fn spawn_or_run<S: Send + 'static>(name: &str, state: S, job: fn(S)) {
    let cell = Arc::new(Mutex::new(Some(state)));
    let theirs = cell.clone();
    let spawned = std::thread::Builder::new()
        .name(name.to_owned())
        .stack_size(THREAD_STACK)
        .spawn(move || {
            if let Some(state) = theirs.lock().take() {
                job(state);
            }
        });
    if let Err(error) = spawned {
        log::warn!("starting a {name} thread failed ({error}); serving on this one");
        let state = cell.lock().take();
        if let Some(state) = state {
            job(state);
        }
    }
}

/// A running HTTP server. Dropping it stops it as [`HttpServer::stop`] does.
pub struct HttpServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    poller: Option<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for HttpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpServer")
            .field("local_addr", &self.local_addr)
            .field("threads", &self.workers.len())
            .finish()
    }
}

impl HttpServer {
    /// Binds `addr` (e.g. `"127.0.0.1:3210"`, or port 0 for any free port), starts the accept
    /// thread (`brain-http-poll`) and the workers (`brain-http-0` …), and returns at once.
    /// Every `/v1` route requires `Authorization: Bearer <token>`.
    ///
    /// Fails when the address cannot be bound or a thread cannot be started; an `options` with
    /// zero threads is refused (`InvalidInput`).
    pub fn start(
        brain: Arc<Brain>,
        addr: &str,
        token: String,
        options: HttpOptions,
    ) -> std::io::Result<HttpServer> {
        if options.threads == 0 || options.accept_queue == 0 {
            return Err(std::io::Error::new(
                ErrorKind::InvalidInput,
                "the HTTP server needs at least one thread and an accept queue of at least one",
            ));
        }
        let token = token.trim().to_owned();
        if token.is_empty() {
            return Err(std::io::Error::new(
                ErrorKind::InvalidInput,
                "the API token is empty",
            ));
        }
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let (waker, wakee) = UnixStream::pair()?;
        waker.set_nonblocking(true)?;
        wakee.set_nonblocking(true)?;
        let (returned_tx, returned_rx) = crossbeam_channel::unbounded();
        let (work_tx, work_rx) = crossbeam_channel::bounded(options.accept_queue);
        let shared = Arc::new(Shared {
            brain,
            token,
            connections: Limit::new(options.max_connections),
            long_waits: Limit::new(options.max_long_waits),
            followers: Limit::new(options.max_sse),
            options,
            stopping: AtomicBool::new(false),
            counters: HttpCounters::default(),
            returned: returned_tx,
            waker,
        });
        let mut server = HttpServer {
            shared: shared.clone(),
            local_addr,
            poller: None,
            workers: Vec::new(),
        };
        for index in 0..shared.options.threads {
            let shared = shared.clone();
            let work: Receiver<Conn> = work_rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("brain-http-{index}"))
                .stack_size(THREAD_STACK)
                .spawn(move || {
                    while let Ok(conn) = work.recv() {
                        serve(&shared, conn);
                    }
                });
            match handle {
                Ok(handle) => server.workers.push(handle),
                Err(error) => {
                    drop(work_tx);
                    server.shutdown();
                    return Err(error);
                }
            }
        }
        drop(work_rx);
        let poller = Poller::new(listener, wakee, returned_rx, work_tx, shared);
        let handle = std::thread::Builder::new()
            .name("brain-http-poll".into())
            .spawn(move || poller.run());
        match handle {
            Ok(handle) => server.poller = Some(handle),
            Err(error) => {
                server.shutdown();
                return Err(error);
            }
        }
        log::info!("serving the HTTP API on http://{local_addr}");
        Ok(server)
    }

    /// The bound address (with the port chosen when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops the server: no new connection is accepted and idle ones are closed; requests being
    /// read or answered finish (each bounded by the read and write timeouts) and are answered
    /// with `Connection: close`; long waits answer `202` with what they know, SSE streams end;
    /// then the threads are joined. Waits for the long waits and SSE followers at most
    /// [`HttpOptions::stop_timeout`].
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.wake_poller();
        if let Some(poller) = self.poller.take()
            && poller.join().is_err()
        {
            log::error!("the HTTP accept thread panicked");
        }
        for worker in self.workers.drain(..) {
            if worker.join().is_err() {
                log::error!("an HTTP worker thread panicked");
            }
        }
        let deadline = Instant::now() + self.shared.options.stop_timeout;
        let waits = self.shared.long_waits.wait_idle(deadline);
        let follows = self.shared.followers.wait_idle(deadline);
        if !(waits && follows) {
            log::warn!(
                "the HTTP server stopped with {} long waits and {} SSE followers still ending",
                self.shared.long_waits.in_use(),
                self.shared.followers.in_use()
            );
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if self.poller.is_some() || !self.workers.is_empty() {
            self.shutdown();
        }
    }
}

/// Serves the requests of a connection that has bytes to read, then gives it back.
fn serve(shared: &Arc<Shared>, mut conn: Conn) {
    for _ in 0..MAX_PIPELINED {
        match serve_one(shared, conn) {
            Some(kept) if !kept.buf.is_empty() => conn = kept,
            Some(kept) => return shared.give_back(kept),
            None => return,
        }
    }
    shared.give_back(conn);
}

/// Reads, answers and accounts one request. Returns the connection when it stays open.
fn serve_one(shared: &Arc<Shared>, mut conn: Conn) -> Option<Conn> {
    let deadline = Instant::now() + shared.options.read_timeout;
    let head = match request::read_head(&mut conn, deadline) {
        Ok(head) => head,
        Err(error) => {
            refuse_read(shared, conn, error);
            return None;
        }
    };
    let keep_alive = head.keep_alive();
    let body_pending = head.content_length > 0;
    if let Some(response) = routes::before_body(shared, &head) {
        // The body, if any, is not read: the connection cannot be reused.
        if body_pending {
            shared.respond_closing(conn, &response);
            return None;
        }
        return shared.respond(conn, &response, keep_alive);
    }
    if body_pending && head.expects_continue() {
        let mut writer = &conn.stream;
        if writer.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err() {
            return None;
        }
    }
    let body = match request::read_body(&mut conn, head.content_length, deadline) {
        Ok(body) => body,
        Err(error) => {
            refuse_read(shared, conn, error);
            return None;
        }
    };
    let handled = catch_unwind(AssertUnwindSafe(|| routes::handle(shared, &head, body)));
    let reply = handled.unwrap_or_else(|_| {
        log::error!("the handler of {} {} panicked", head.method, head.path);
        Reply::Done(Response::error(
            500,
            "internal_error",
            "the request handler failed; see the server's log",
        ))
    });
    match reply {
        Reply::Done(response) => shared.respond(conn, &response, keep_alive),
        Reply::Wait(wait) => {
            super::wait::start(shared.clone(), conn, wait, keep_alive);
            None
        }
        Reply::Follow(follow) => {
            super::sse::start(shared.clone(), conn, follow);
            None
        }
    }
}

/// Answers a request that could not be read, when there is someone to answer, and closes.
fn refuse_read(shared: &Shared, conn: Conn, error: ReadError) {
    let response = match error {
        ReadError::Closed | ReadError::Timeout { started: false } => return,
        ReadError::Io(error) => {
            log::debug!("reading a request from {} failed: {error}", conn.peer);
            return;
        }
        ReadError::Timeout { started: true } => {
            Response::error(408, "invalid_request", "the request did not arrive in time")
        }
        ReadError::Refused(413, message) => Response::error(413, "input_too_large", message),
        ReadError::Refused(status, message) => Response::error(status, "invalid_request", message),
    };
    shared.respond_closing(conn, &response);
}
