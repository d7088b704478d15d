//! The three threads of a worker: stdout reader, stdin writer, stderr logger (and
//! exit watcher).
//!
//! Each pipe has one thread that owns it. The reader decodes lines (parsing happens here, off the
//! dispatcher) and forwards messages and violations to the dispatcher's channel, which counts
//! them: a worker's violations are rate-limited by the faulty rule, so they cost the dispatcher
//! little. The writer writes what the dispatcher queues for stdin; the dispatcher writes a line
//! itself with [`write_now`] when the writer is idle (see `crate::capacity`). Stdin closes when
//! the writer has returned and the capacity queue has let go of its handle.

use super::process::Exit;
use super::{WorkerEvent, WorkerKey, WorkerLabel};
use crate::protocol::framing::{Frame, LineReader, PREFIX_BYTES};
use crate::protocol::harness::BrainCall;
use crate::protocol::jsonrpc::{self, Violation};
use crossbeam_channel::Sender;
use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::io::{self, BufWriter, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::process::{ChildStderr, ChildStdin};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How many bytes of a harness's stderr are kept for error reports.
pub const STDERR_TAIL_BYTES: usize = 2048;

/// The longest stderr line Brain logs whole; longer lines are logged truncated.
const STDERR_LINE_BYTES: usize = 8 * 1024;

/// The reader thread's body: reads stdout until EOF or error, then reports `StdoutClosed`.
pub fn read_stdout(
    stdout: impl Read,
    limit: usize,
    key: WorkerKey,
    label: WorkerLabel,
    events: Sender<(WorkerKey, WorkerEvent)>,
) {
    let mut reader = LineReader::new(stdout, limit);
    loop {
        let outcome = match reader.next_frame() {
            Ok(None) => break,
            Ok(Some(Frame::Line(line))) => match BrainCall::decode_request(line) {
                // The common case, typed here without a `Value` tree and off the dispatcher.
                Some((id, call)) => Ok(WorkerEvent::Call(id, call)),
                None => match jsonrpc::decode(line) {
                    Ok(message) => Ok(WorkerEvent::Message(message)),
                    Err(violation) => Err((violation, prefix_of(line), line.len() as u64)),
                },
            },
            Ok(Some(Frame::TooLong { prefix, length })) => Err((
                Violation::LineTooLong,
                String::from_utf8_lossy(prefix).into_owned(),
                length,
            )),
            Err(error) => {
                log::warn!("worker {label}: reading stdout failed: {error}");
                break;
            }
        };
        let event = match outcome {
            Ok(event) => event,
            Err((violation, prefix, length)) => {
                log::warn!(
                    "worker {label}: protocol violation {violation} ({length} bytes): {prefix:?}"
                );
                WorkerEvent::Violation(violation)
            }
        };
        if events.send((key, event)).is_err() {
            return; // The dispatcher is gone; nobody is listening.
        }
    }
    let _ = events.send((key, WorkerEvent::StdoutClosed));
}

/// A bounded, lossy rendering of a line for logs.
pub fn prefix_of(line: &[u8]) -> String {
    let end = line.len().min(PREFIX_BYTES);
    String::from_utf8_lossy(&line[..end]).into_owned()
}

/// The writer thread's body: writes each batch of lines from `outbox`, each with its newline, and
/// flushes after the batch. Returns when the outbox says so or the pipe breaks; stdin closes once
/// the other handle (see [`write_now`]) is dropped too.
pub fn write_stdin(stdin: Arc<ChildStdin>, mut outbox: super::Outbox, label: WorkerLabel) {
    let mut out = BufWriter::with_capacity(64 * 1024, &*stdin);
    while let Some(lines) = outbox() {
        for mut line in lines {
            line.push(b'\n');
            if let Err(error) = out.write_all(&line) {
                finish_write(error, label);
                return;
            }
        }
        if let Err(error) = out.flush() {
            finish_write(error, label);
            return;
        }
    }
}

/// Writes as much of `line` and its newline to `stdin` as the pipe takes without waiting, and
/// returns how many bytes that was (`line.len() + 1` when all of it).
///
/// Lets the dispatcher write a line itself when the writer thread is idle, sparing it a wake-up
/// and a hand-off. Never blocks: it is one `pwritev2` with `RWF_NOWAIT`, which pipes honour since
/// Linux 5.x (an older kernel answers `EOPNOTSUPP`, and the caller leaves lines to the writer
/// thread). Fails with `WouldBlock` when the pipe is full, and with the write's error otherwise.
pub fn write_now(stdin: &ChildStdin, line: &[u8]) -> io::Result<usize> {
    let parts = [
        libc::iovec {
            iov_base: line.as_ptr() as *mut libc::c_void,
            iov_len: line.len(),
        },
        libc::iovec {
            iov_base: b"\n".as_ptr() as *mut libc::c_void,
            iov_len: 1,
        },
    ];
    // SAFETY: the two iovecs describe `line` and a static byte, both alive and unchanged for the
    // whole call, and the kernel only reads from them (a write); the descriptor is `stdin`'s,
    // open for as long as the borrow lasts. Offset -1 means the file's current position (a pipe
    // has none), as `writev` would.
    let written =
        unsafe { libc::pwritev2(stdin.as_raw_fd(), parts.as_ptr(), 2, -1, libc::RWF_NOWAIT) };
    // A negative result is the only failure; anything else is a byte count.
    usize::try_from(written).map_err(|_| io::Error::last_os_error())
}

fn finish_write(error: io::Error, label: WorkerLabel) {
    // A broken pipe means the harness went away; the reader and waiter report that.
    if error.kind() != io::ErrorKind::BrokenPipe {
        log::warn!("worker {label}: writing stdin failed: {error}");
    }
}

/// The last bytes a harness wrote to stderr, for error reports.
#[derive(Debug, Default)]
pub struct StderrTail {
    bytes: Mutex<VecDeque<u8>>,
}

impl StderrTail {
    fn push_line(&self, line: &[u8]) {
        let mut bytes = self.bytes.lock();
        let keep = line.len().min(STDERR_TAIL_BYTES - 1);
        bytes.extend(&line[line.len() - keep..]);
        bytes.push_back(b'\n');
        while bytes.len() > STDERR_TAIL_BYTES {
            bytes.pop_front();
        }
    }

    /// The tail as text (lossy UTF-8), without a trailing newline.
    pub fn snapshot(&self) -> String {
        let bytes = self.bytes.lock();
        let (a, b) = bytes.as_slices();
        let mut all = Vec::with_capacity(a.len() + b.len());
        all.extend_from_slice(a);
        all.extend_from_slice(b);
        let text = String::from_utf8_lossy(&all);
        text.trim_end_matches('\n').to_owned()
    }
}

/// The stderr thread's body: logs each line tagged with the worker and keeps a bounded tail.
/// Sends on `done` (if given) when stderr closes, so that exit reports can include the last lines.
/// How long Brain keeps reading the stderr of a process that exited: a descendant that escaped the
/// process group may hold it open forever.
const STDERR_DRAIN: Duration = Duration::from_millis(500);

/// How often the exit is looked for when it cannot be watched through a pidfd.
pub const EXIT_POLL: Duration = Duration::from_millis(100);

/// How the stderr thread notices the harness process's exit while it reads stderr.
pub enum ExitWatch {
    /// A pidfd, polled together with stderr (Linux 5.3 or later): noticed at once.
    Pidfd(OwnedFd),
    /// Asked every [`EXIT_POLL`] (where `pidfd_open` is missing: older kernels, valgrind).
    Poll(Box<dyn Fn() -> bool + Send>),
}

/// The stderr thread's body: logs each stderr line tagged with the worker and keeps the tail, and
/// watches for the process's exit. When the process exits it calls `reap` (which kills the group
/// and reaps the leader), reads what is left on stderr for at most [`STDERR_DRAIN`], and returns
/// the exit. If stderr closes first, it waits for the exit in `reap`.
pub fn watch_stderr_and_exit(
    stderr: ChildStderr,
    watch: ExitWatch,
    label: WorkerLabel,
    tail: Arc<StderrTail>,
    reap: impl FnOnce() -> Exit,
) -> Exit {
    if let Err(error) = fcntl(&stderr, FcntlArg::F_SETFL(OFlag::O_NONBLOCK)) {
        // Blocking reads still log everything; the exit is then noticed once stderr closes.
        log::warn!("worker {label}: stderr stays blocking ({error})");
    }
    let mut watched = UntilExit {
        stderr,
        watch,
        reap: Some(reap),
        exit: None,
        drain_until: None,
    };
    read_stderr(&mut watched, &label, &tail);
    match (watched.exit, watched.reap) {
        (Some(exit), _) => exit,
        (None, Some(reap)) => reap(),
        // `exit` is set whenever `reap` was taken.
        (None, None) => unreachable_exit(),
    }
}

fn unreachable_exit() -> Exit {
    log::error!("the stderr watcher lost an exit");
    Exit {
        reason: super::process::ExitReason::Code(-1),
        killed_by_brain: false,
    }
}

/// Stderr as a blocking reader that also notices the process's exit: it reaps on the exit and then
/// reports end of file once stderr is drained or [`STDERR_DRAIN`] has passed.
struct UntilExit<F> {
    stderr: ChildStderr,
    watch: ExitWatch,
    reap: Option<F>,
    exit: Option<Exit>,
    drain_until: Option<Instant>,
}

impl<F: FnOnce() -> Exit> Read for UntilExit<F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.stderr.read(buf) {
                Ok(n) => return Ok(n),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            }
            let mut wait = match self.drain_until {
                None => None,
                Some(until) => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(0);
                    }
                    Some(left)
                }
            };
            let polling_exit = self.reap.is_some() && matches!(self.watch, ExitWatch::Poll(_));
            if polling_exit {
                wait = Some(wait.map_or(EXIT_POLL, |left| left.min(EXIT_POLL)));
            }
            // Rounded up, so that the deadline has passed when poll returns.
            let timeout = wait.map_or(PollTimeout::NONE, |wait| {
                PollTimeout::try_from(wait.as_millis() + 1).unwrap_or(PollTimeout::MAX)
            });
            let exited = {
                let mut fds = vec![PollFd::new(self.stderr.as_fd(), PollFlags::POLLIN)];
                if let (Some(_), ExitWatch::Pidfd(pidfd)) = (&self.reap, &self.watch) {
                    fds.push(PollFd::new(pidfd.as_fd(), PollFlags::POLLIN));
                }
                loop {
                    match poll(&mut fds, timeout) {
                        Ok(_) => break,
                        Err(Errno::EINTR) => continue,
                        Err(error) => return Err(error.into()),
                    }
                }
                match &self.watch {
                    ExitWatch::Pidfd(_) => fds
                        .get(1)
                        .and_then(PollFd::revents)
                        .is_some_and(|events| !events.is_empty()),
                    ExitWatch::Poll(exited) => polling_exit && exited(),
                }
            };
            if exited && let Some(reap) = self.reap.take() {
                self.exit = Some(reap());
                self.drain_until = Some(Instant::now() + STDERR_DRAIN);
            }
        }
    }
}

fn read_stderr(stderr: impl Read, label: &WorkerLabel, tail: &StderrTail) {
    let mut reader = LineReader::new(stderr, STDERR_LINE_BYTES);
    loop {
        match reader.next_frame() {
            Ok(Some(Frame::Line(line))) => {
                tail.push_line(line);
                log::info!(target: "brain::harness", "[{label}] {}", String::from_utf8_lossy(line));
            }
            Ok(Some(Frame::TooLong { prefix, length })) => {
                tail.push_line(prefix);
                log::info!(
                    target: "brain::harness",
                    "[{label}] {}… ({length} bytes)",
                    String::from_utf8_lossy(prefix)
                );
            }
            Ok(None) => break,
            Err(error) => {
                log::debug!("worker {label}: reading stderr failed: {error}");
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_tail_keeps_the_last_bytes() {
        let tail = StderrTail::default();
        for i in 0..1000 {
            tail.push_line(format!("line {i}").as_bytes());
        }
        let text = tail.snapshot();
        assert!(text.len() <= STDERR_TAIL_BYTES);
        assert!(text.ends_with("line 999"));
        assert!(!text.contains("line 1\n"));
    }

    /// Both ways of watching the exit notice it while a descendant keeps stderr open, reap the
    /// process (killing its group, and so the descendant) and keep what it wrote.
    #[test]
    fn an_exit_is_noticed_with_stderr_held_open_by_pidfd_or_by_polling() {
        use crate::worker::process::{self, ExitReason, SpawnSpec};
        for polled in [false, true] {
            let spec = SpawnSpec {
                program: "/bin/sh".into(),
                args: vec!["-c".into(), "echo bye >&2; sleep 30 & exit 3".into()],
                env: vec![("PATH".into(), "/usr/bin:/bin".into())],
                cwd: None,
            };
            let spawned = process::spawn(&spec).unwrap();
            let handle = spawned.handle.clone();
            let watch = if polled {
                let handle = handle.clone();
                ExitWatch::Poll(Box::new(move || process::has_exited(&handle)))
            } else {
                ExitWatch::Pidfd(process::open_pidfd(&handle).unwrap())
            };
            let tail = Arc::new(StderrTail::default());
            let (done_tx, done) = crossbeam_channel::bounded(1);
            let watcher = {
                let tail = tail.clone();
                let (stderr, child) = (spawned.stderr, spawned.child);
                std::thread::spawn(move || {
                    let label = crate::worker::WorkerLabel::new("t", 0);
                    let exit = watch_stderr_and_exit(stderr, watch, label, tail, || {
                        process::wait_and_reap(&handle, child)
                    });
                    done_tx.send(exit).unwrap();
                })
            };
            // The sleeping descendant holds stderr for 30 s: only the exit watch ends this.
            let exit = done
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("the exit went unnoticed (polled: {polled})"));
            watcher.join().unwrap();
            assert_eq!(exit.reason, ExitReason::Code(3), "polled: {polled}");
            assert!(tail.snapshot().contains("bye"), "polled: {polled}");
        }
    }
}
