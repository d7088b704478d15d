//! The accept thread: owns the listener and every idle connection, waits in `poll(2)`, and hands
//! a connection to the workers once it has bytes to read.

use super::request::{MAX_HEAD_BYTES, parse_head};
use super::response::Response;
use super::server::{Conn, Shared};
use crossbeam_channel::{Receiver, Sender, TrySendError};
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use std::io::{ErrorKind, Read};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long accepting pauses after an error such as running out of file descriptors.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// How long the answer to a refused connection may take to write.
const REFUSE_WRITE_TIMEOUT: Duration = Duration::from_millis(200);

pub(crate) struct Poller {
    listener: TcpListener,
    wakee: UnixStream,
    returned: Receiver<Conn>,
    work: Sender<Conn>,
    shared: Arc<Shared>,
    /// Idle connections and when each is closed if nothing arrives.
    idle: Vec<(Conn, Instant)>,
    /// Accepting is paused until then after an accept error.
    paused_until: Option<Instant>,
}

impl Poller {
    pub(crate) fn new(
        listener: TcpListener,
        wakee: UnixStream,
        returned: Receiver<Conn>,
        work: Sender<Conn>,
        shared: Arc<Shared>,
    ) -> Poller {
        Poller {
            listener,
            wakee,
            returned,
            work,
            shared,
            idle: Vec::new(),
            paused_until: None,
        }
    }

    /// Runs until the server stops; then drops the listener, the idle connections and the work
    /// queue's sender (which ends the workers once the queue is empty).
    pub(crate) fn run(mut self) {
        while !self.shared.stopping() {
            self.take_returned();
            let now = Instant::now();
            let shared = self.shared.clone();
            self.idle.retain(|(conn, deadline)| {
                if *deadline > now {
                    return true;
                }
                // Part of a request arrived, the rest did not in time: say so and close.
                if !conn.buf.is_empty() {
                    refuse(
                        &shared,
                        &conn.stream,
                        Response::error(
                            408,
                            "invalid_request",
                            "the request did not arrive in time",
                        ),
                    );
                }
                false
            });
            if self.paused_until.is_some_and(|until| until <= now) {
                self.paused_until = None;
            }
            let accepting = self.paused_until.is_none();
            let ready = match self.wait(now, accepting) {
                Ok(ready) => ready,
                Err(error) => {
                    log::error!("the HTTP accept thread cannot poll: {error}");
                    break;
                }
            };
            self.drain_wakes();
            // Take the ready connections out (from the back, so indices stay valid), then read
            // what they sent without blocking.
            let mut readable = Vec::new();
            for index in (0..ready.idle.len()).rev() {
                if ready.idle[index] {
                    readable.push(self.idle.swap_remove(index));
                }
            }
            for (conn, deadline) in readable {
                self.receive(conn, deadline);
            }
            if accepting && ready.listener {
                self.accept_all();
            }
        }
        log::debug!(
            "the HTTP accept thread stops; closing {} idle connections",
            self.idle.len()
        );
    }

    fn take_returned(&mut self) {
        while let Ok(conn) = self.returned.try_recv() {
            if request_ready(&conn.buf) {
                self.dispatch(conn);
            } else if conn.buf.is_empty() {
                let deadline = Instant::now() + self.shared.options.idle_timeout;
                self.idle.push((conn, deadline));
            } else {
                // The start of the next request came with the last one: the rest has a request's
                // time to arrive.
                let deadline = Instant::now() + self.shared.options.read_timeout;
                self.idle.push((conn, deadline));
            }
        }
    }

    /// Polls the listener, the waker and the idle connections until one is ready or the next
    /// idle deadline (or the end of an accept pause) comes.
    fn wait(&self, now: Instant, accepting: bool) -> nix::Result<Ready> {
        let mut wake_at = self.idle.iter().map(|(_, deadline)| *deadline).min();
        if let Some(until) = self.paused_until {
            wake_at = Some(wake_at.map_or(until, |at| at.min(until)));
        }
        let timeout = match wake_at {
            None => PollTimeout::NONE,
            Some(at) => {
                // Round up so that the deadline has passed when poll returns.
                let millis = at.saturating_duration_since(now).as_millis() + 1;
                PollTimeout::try_from(millis).unwrap_or(PollTimeout::MAX)
            }
        };
        let readable = PollFlags::POLLIN;
        let mut fds = Vec::with_capacity(2 + self.idle.len());
        fds.push(PollFd::new(self.wakee.as_fd(), readable));
        fds.push(PollFd::new(
            self.listener.as_fd(),
            if accepting {
                readable
            } else {
                PollFlags::empty()
            },
        ));
        for (conn, _) in &self.idle {
            fds.push(PollFd::new(conn.stream.as_fd(), readable));
        }
        loop {
            match poll(&mut fds, timeout) {
                Ok(_) => break,
                Err(Errno::EINTR) => continue,
                Err(error) => return Err(error),
            }
        }
        let fired = |fd: &PollFd| fd.revents().is_some_and(|events| !events.is_empty());
        Ok(Ready {
            listener: fired(&fds[1]),
            idle: fds[2..].iter().map(fired).collect(),
        })
    }

    fn drain_wakes(&mut self) {
        let mut bytes = [0u8; 64];
        while matches!(self.wakee.read(&mut bytes), Ok(n) if n > 0) {}
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer),
                Err(error) if error.kind() == ErrorKind::WouldBlock => return,
                Err(error)
                    if matches!(
                        error.kind(),
                        ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                    ) => {}
                Err(error) => {
                    log::warn!("accepting an HTTP connection failed: {error}; pausing accepts");
                    self.paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }

    fn admit(&mut self, stream: TcpStream, peer: std::net::SocketAddr) {
        let configured = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_nodelay(true))
            .and_then(|()| stream.set_write_timeout(Some(self.shared.options.write_timeout)));
        if let Err(error) = configured {
            log::debug!("configuring the connection from {peer} failed: {error}");
            return;
        }
        let Some(open) = self.shared.connections.try_acquire() else {
            let max = self.shared.connections.max();
            refuse(
                &self.shared,
                &stream,
                Response::overloaded(format!(
                    "the server has {max} open connections, its limit; retry later"
                )),
            );
            return;
        };
        // A new connection waits here for its first request like an idle one, but only as long as
        // a request may take.
        let deadline = Instant::now() + self.shared.options.read_timeout;
        self.idle.push((Conn::new(stream, peer, open), deadline));
    }

    /// Reads what a readable connection sent, without blocking. Only a whole request (a complete
    /// head and, up to [`MAX_POLLED_BODY_BYTES`], its whole body; or a head already too large or
    /// malformed, or a client that closed after part of one) goes to a worker: a client trickling
    /// part of a request keeps no worker waiting, and a connection that was merely closed is
    /// dropped here instead of taking a place in the workers' queue. Once a kept-alive
    /// connection's next request begins, its deadline is a request's ([`HttpOptions::read_timeout`]),
    /// not the idle timeout.
    ///
    /// [`HttpOptions::read_timeout`]: super::HttpOptions::read_timeout
    fn receive(&mut self, mut conn: Conn, mut deadline: Instant) {
        let was_empty = conn.buf.is_empty();
        let available = read_available(&mut conn);
        if was_empty && !conn.buf.is_empty() {
            deadline = deadline.min(Instant::now() + self.shared.options.read_timeout);
        }
        match available {
            Available::Closed if conn.buf.is_empty() => {}
            Available::Closed => self.dispatch(conn),
            Available::More if request_ready(&conn.buf) => self.dispatch(conn),
            Available::More => self.idle.push((conn, deadline)),
        }
    }

    /// Queues a connection with a request ready for the workers; when the queue is full it is
    /// answered `503 overloaded` at once.
    fn dispatch(&mut self, conn: Conn) {
        match self.work.try_send(conn) {
            Ok(()) => {}
            Err(TrySendError::Full(conn)) => refuse(
                &self.shared,
                &conn.stream,
                Response::overloaded("every HTTP worker is busy; retry later"),
            ),
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

/// What a non-blocking read found.
enum Available {
    /// The bytes that had arrived are in the buffer; more may come.
    More,
    /// The client closed its side (or the connection failed).
    Closed,
}

/// Appends every byte that has arrived to the connection's buffer without blocking, stopping a
/// little past the head limit.
fn read_available(conn: &mut Conn) -> Available {
    if conn.stream.set_nonblocking(true).is_err() {
        return Available::Closed;
    }
    let mut chunk = [0u8; 8192];
    let found = loop {
        if conn.buf.len() > MAX_HEAD_BYTES + MAX_POLLED_BODY_BYTES {
            break Available::More;
        }
        match conn.stream.read(&mut chunk) {
            Ok(0) => break Available::Closed,
            Ok(n) => conn.buf.extend_from_slice(&chunk[..n]),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break Available::More,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break Available::Closed,
        }
    };
    if conn.stream.set_nonblocking(false).is_err() {
        return Available::Closed;
    }
    found
}

/// Bodies up to this size are gathered here, before a worker is given the connection, so that a
/// client trickling a small body holds no worker; a larger body is read by the worker under the
/// request's deadline once the head's checks (token, route, size) have passed.
const MAX_POLLED_BODY_BYTES: usize = 64 * 1024;

/// Whether a worker should take the connection now: the buffer holds a whole request head and,
/// for a body of at most [`MAX_POLLED_BODY_BYTES`], the whole body; or the head is too large or
/// malformed, which a worker answers at once.
fn request_ready(buf: &[u8]) -> bool {
    // Empty lines before a request line are ignored (RFC 9112 §2.2), as the worker does.
    let start = buf
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count();
    let Some(at) = buf[start..].windows(4).position(|w| w == b"\r\n\r\n") else {
        return buf.len() > MAX_HEAD_BYTES;
    };
    let end = start + at + 4;
    if end - start > MAX_HEAD_BYTES {
        return true;
    }
    match parse_head(&buf[start..end - 4]) {
        // A client that sent `Expect: 100-continue` waits for the worker's interim answer
        // before it sends the body.
        Ok(head)
            if head.content_length <= MAX_POLLED_BODY_BYTES as u64 && !head.expects_continue() =>
        {
            (buf.len() - end) as u64 >= head.content_length
        }
        _ => true,
    }
}

/// Which of the polled descriptors are ready.
struct Ready {
    listener: bool,
    idle: Vec<bool>,
}

/// Answers a connection at once without reading its request and closes it. Never blocks long:
/// what has arrived is discarded without waiting (so that closing does not reset the answer away),
/// and the write is bounded by a short timeout.
fn refuse(shared: &Shared, stream: &TcpStream, response: Response) {
    shared.counters.responded(response.status);
    if stream.set_nonblocking(true).is_ok() {
        let mut chunk = [0u8; 8192];
        let mut reader = stream;
        for _ in 0..8 {
            if !matches!(reader.read(&mut chunk), Ok(n) if n > 0) {
                break;
            }
        }
    }
    let written = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_write_timeout(Some(REFUSE_WRITE_TIMEOUT)))
        .and_then(|()| response.write_to(stream, false));
    if let Err(error) = written {
        log::debug!("answering a refused connection failed: {error}");
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
}
