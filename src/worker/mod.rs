//! Harness worker processes: spawning, the per-pipe threads, and what they report.
//!
//! A worker is one process of a registration, in a numbered slot. [`start`] spawns it and three
//! named threads: `brain-w:<reg>/<slot>-read` (stdout → decoded messages), `-write` (lines →
//! stdin, see `crate::capacity`) and `-stderr` (diagnostics
//! → log and a bounded tail; it also watches the process through a pidfd, reaps it and reports its
//! exit). All of them report to the dispatcher through one channel of `(WorkerKey, WorkerEvent)`;
//! none of them touches the dispatcher's state.

pub mod io;
pub mod process;
pub mod violations;

use crate::protocol::harness::BrainCall;
use crate::protocol::jsonrpc::{Message, RequestId, Violation};
use crossbeam_channel::Sender;
use process::{Exit, ProcessHandle, SpawnSpec};
use std::fmt;
use std::process::ChildStdin;
use std::sync::Arc;

/// Names one incarnation of one worker slot. Events of an older generation are stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkerKey {
    /// Index of the registration (in name order).
    pub registration: usize,
    /// Slot number within the registration.
    pub slot: u32,
    /// Incremented at every spawn of the slot.
    pub generation: u64,
}

/// `registration/slot`, for logs and thread names.
#[derive(Debug, Clone)]
pub struct WorkerLabel(Arc<str>);

impl WorkerLabel {
    /// The label of `slot` of `registration`.
    pub fn new(registration: &str, slot: u32) -> WorkerLabel {
        WorkerLabel(format!("{registration}/{slot}").into())
    }
}

impl fmt::Display for WorkerLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a worker's threads report to the dispatcher.
#[derive(Debug)]
pub enum WorkerEvent {
    /// A decoded message from stdout.
    Message(Message),
    /// A `brain/call` request from stdout, typed by the reader thread (see
    /// [`BrainCall::decode_request`]); other requests come as [`WorkerEvent::Message`].
    Call(RequestId, BrainCall),
    /// A line that could not be used (already logged).
    Violation(Violation),
    /// Stdout reached end of file or failed.
    StdoutClosed,
    /// The process exited and was reaped (its whole group killed).
    Exited(Exit),
}

/// The parts of a running worker that the dispatcher keeps.
#[derive(Debug)]
pub struct Running {
    /// Kills the process group.
    pub process: Arc<ProcessHandle>,
    /// The stderr tail, for error reports.
    pub stderr_tail: Arc<io::StderrTail>,
}

/// What the writer thread writes: each call blocks until there are lines (written in order, then
/// flushed) or returns `None` when stdin is to be closed.
pub type Outbox = Box<dyn FnMut() -> Option<Vec<Vec<u8>>> + Send>;

/// Spawns the process and its three threads. Events go to `events`, tagged with `key`; the lines
/// for stdin come from `outbox`. Also returns a second handle on stdin, for [`io::write_now`]:
/// the harness sees its stdin close only once the writer thread has returned and that handle
/// is dropped.
///
/// Guarantees: on `Ok`, exactly one `WorkerEvent::Exited` for `key` will follow eventually (the
/// waiter reports it after reaping), and a `StdoutClosed` before or after it. On `Err` nothing is
/// left running.
pub fn start(
    spec: &SpawnSpec,
    key: WorkerKey,
    label: &WorkerLabel,
    max_line_bytes: usize,
    outbox: Outbox,
    events: &Sender<(WorkerKey, WorkerEvent)>,
) -> std::io::Result<(Running, Arc<ChildStdin>)> {
    let spawned = process::spawn(spec)?;
    let stdin = Arc::new(spawned.stdin);
    let process = spawned.handle.clone();
    let stderr_tail = Arc::new(io::StderrTail::default());
    let watch = match process::open_pidfd(&process) {
        Ok(pidfd) => io::ExitWatch::Pidfd(pidfd),
        Err(error) if error.raw_os_error() == Some(libc::ENOSYS) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                log::warn!(
                    "pidfd_open is not available (Linux before 5.3, or valgrind): harness exits \
                     are noticed within {:?} instead of at once",
                    io::EXIT_POLL
                );
            });
            let process = process.clone();
            io::ExitWatch::Poll(Box::new(move || process::has_exited(&process)))
        }
        Err(error) => {
            process.kill();
            let _ = process::wait_and_reap(&process, spawned.child);
            return Err(std::io::Error::new(
                error.kind(),
                format!("pidfd_open (Linux 5.3 or later) failed: {error}"),
            ));
        }
    };

    let threads = [
        (
            "read",
            Box::new({
                let (events, label) = (events.clone(), label.clone());
                let stdout = spawned.stdout;
                move || io::read_stdout(stdout, max_line_bytes, key, label, events)
            }) as Box<dyn FnOnce() + Send>,
        ),
        (
            "write",
            Box::new({
                let (label, stdin) = (label.clone(), stdin.clone());
                move || io::write_stdin(stdin, outbox, label)
            }),
        ),
        (
            "stderr",
            Box::new({
                let (label, tail, stderr) = (label.clone(), stderr_tail.clone(), spawned.stderr);
                let (events, process, child) = (events.clone(), process.clone(), spawned.child);
                move || {
                    let exit = io::watch_stderr_and_exit(stderr, watch, label, tail, || {
                        process::wait_and_reap(&process, child)
                    });
                    let _ = events.send((key, WorkerEvent::Exited(exit)));
                }
            }),
        ),
    ];
    for (role, body) in threads {
        let spawned_thread = std::thread::Builder::new()
            .name(format!("brain-w:{label}-{role}"))
            .spawn(body);
        if let Err(error) = spawned_thread {
            // Without its threads the worker cannot be supervised: take it down. The threads that
            // did start end on their own once the group is dead.
            process.kill();
            return Err(error);
        }
    }
    Ok((
        Running {
            process,
            stderr_tail,
        },
        stdin,
    ))
}
