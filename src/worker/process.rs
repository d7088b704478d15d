//! One harness process: spawned in its own process group, killed as a group, reaped exactly once.
//!
//! The worker's stderr thread owns the [`Child`]. It waits with `waitid(WNOWAIT)`, so the exited
//! leader stays a zombie — its pid, and therefore its process group id, cannot be reused — while
//! the group is killed (taking any grandchildren with it). Only then does it reap. A kill from
//! another thread takes the same lock and does nothing once the leader is reaped, so Brain never
//! signals a pid that may belong to someone else.

use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;
use parking_lot::Mutex;
use std::fmt;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};

/// Everything needed to start a harness process.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    /// The resolved executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// The complete environment: nothing else is inherited.
    pub env: Vec<(String, String)>,
    /// The working directory; `None` inherits Brain's.
    pub cwd: Option<PathBuf>,
}

/// How a harness process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitReason {
    /// It exited with this status code.
    Code(i32),
    /// It was terminated by this signal number.
    Signal(i32),
}

impl fmt::Display for ExitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitReason::Code(code) => write!(f, "exited with status {code}"),
            ExitReason::Signal(signal) => {
                let name = Signal::try_from(*signal)
                    .map(Signal::as_str)
                    .unwrap_or("unknown signal");
                write!(f, "killed by signal {signal} ({name})")
            }
        }
    }
}

impl ExitReason {
    fn from_status(status: ExitStatus) -> ExitReason {
        match (status.code(), status.signal()) {
            (Some(code), _) => ExitReason::Code(code),
            (None, Some(signal)) => ExitReason::Signal(signal),
            // Neither is impossible for a reaped child on Unix; report it as an odd code.
            (None, None) => ExitReason::Code(-1),
        }
    }
}

#[derive(Debug, Default)]
struct ReapState {
    reaped: bool,
    killed_by_brain: bool,
}

/// A shareable handle to a running harness process, for killing it.
///
/// Guarantees: [`ProcessHandle::kill`] signals the whole process group, never after the leader was
/// reaped; the handle can be cloned into timer and dispatcher code freely.
#[derive(Debug)]
pub struct ProcessHandle {
    pid: u32,
    state: Mutex<ReapState>,
}

impl ProcessHandle {
    /// The leader's pid (also the process group id).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends SIGKILL to the whole process group, unless the leader has been reaped already.
    /// Returns whether a signal was sent. Records that Brain killed it.
    pub fn kill(&self) -> bool {
        let mut state = self.state.lock();
        if state.reaped {
            return false;
        }
        state.killed_by_brain = true;
        signal_group(self.pid, Signal::SIGKILL);
        true
    }
}

fn signal_group(pid: u32, signal: Signal) {
    let Ok(raw) = i32::try_from(pid) else {
        return;
    };
    match killpg(Pid::from_raw(raw), signal) {
        // ESRCH: the group is already empty.
        Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
        Err(error) => log::warn!("signalling process group {pid} failed: {error}"),
    }
}

/// The pipes of a freshly spawned process and the child, which goes to the waiter.
pub struct Spawned {
    /// Shared kill handle.
    pub handle: std::sync::Arc<ProcessHandle>,
    /// Brain → harness.
    pub stdin: ChildStdin,
    /// Harness → Brain.
    pub stdout: ChildStdout,
    /// Diagnostics.
    pub stderr: ChildStderr,
    /// The child itself; only [`wait_and_reap`] may wait on it.
    pub child: Child,
}

/// Starts the process in a new process group with piped stdio and exactly `spec.env`.
///
/// Descriptors Brain opens are close-on-exec (the standard library opens everything with
/// `O_CLOEXEC`), so a harness inherits only its three pipes.
pub fn spawn(spec: &SpawnSpec) -> io::Result<Spawned> {
    let mut command = Command::new(&spec.program);
    command
        .args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if let Some(cwd) = &spec.cwd {
        command.current_dir(cwd);
    }
    let mut child = command.spawn()?;
    let (Some(stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        // Cannot happen with Stdio::piped(); clean up rather than leak the child.
        let _ = child.kill();
        let _ = child.wait();
        return Err(io::Error::other("spawned child has no stdio pipes"));
    };
    let handle = std::sync::Arc::new(ProcessHandle {
        pid: child.id(),
        state: Mutex::new(ReapState::default()),
    });
    Ok(Spawned {
        handle,
        stdin,
        stdout,
        stderr,
        child,
    })
}

/// How the process ended and whether Brain had killed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Exit code or signal.
    pub reason: ExitReason,
    /// Whether Brain sent the kill.
    pub killed_by_brain: bool,
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.reason)?;
        if self.killed_by_brain {
            f.write_str(" (killed by Brain)")?;
        }
        Ok(())
    }
}

/// Blocks until the leader exits, kills the rest of its group, reaps the leader and reports.
///
/// Runs on the worker's stderr thread. After it returns, no process of the group is left running
/// (a grandchild that moved to another process group is beyond reach, and is logged nowhere).
pub fn wait_and_reap(handle: &ProcessHandle, mut child: Child) -> Exit {
    let Ok(raw) = i32::try_from(handle.pid) else {
        return reap(handle, &mut child);
    };
    loop {
        match waitid(
            Id::Pid(Pid::from_raw(raw)),
            WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT,
        ) {
            Ok(_) => break,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(error) => {
                log::error!("waitid on harness pid {raw} failed: {error}");
                break;
            }
        }
    }
    reap(handle, &mut child)
}

/// Whether the harness process has exited, without reaping it (it stays a zombie for
/// [`wait_and_reap`]): how the exit is noticed where [`open_pidfd`] is not available. A failure
/// to ask (the process was reaped already) counts as exited.
pub fn has_exited(handle: &ProcessHandle) -> bool {
    let Ok(raw) = i32::try_from(handle.pid) else {
        return true;
    };
    loop {
        match waitid(
            Id::Pid(Pid::from_raw(raw)),
            WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT | WaitPidFlag::WNOHANG,
        ) {
            Ok(WaitStatus::StillAlive) => return false,
            Ok(_) => return true,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(error) => {
                log::error!("waitid on harness pid {raw} failed: {error}");
                return true;
            }
        }
    }
}

/// A pidfd of the harness process (Linux 5.3 or later), which polls readable once it has
/// exited: it lets one thread wait for the exit and for stderr together. The process must not have
/// been reaped, so the pid cannot name anyone else.
pub fn open_pidfd(handle: &ProcessHandle) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(handle.pid)
        .map_err(|_| io::Error::other(format!("pid {} out of range", handle.pid)))?;
    // SAFETY: pidfd_open takes two integers and returns a new descriptor or -1; no memory is
    // shared with the kernel. The caller holds the unreaped `Child`, so the pid is its child.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd =
        RawFd::try_from(fd).map_err(|_| io::Error::other("pidfd_open: descriptor out of range"))?;
    // SAFETY: the descriptor was just created by pidfd_open and nothing else refers to it, so
    // this OwnedFd is its only owner and closes it exactly once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn reap(handle: &ProcessHandle, child: &mut Child) -> Exit {
    let mut state = handle.state.lock();
    // The leader is a zombie now: its pid still names the group, so this cannot hit a stranger.
    signal_group(handle.pid, Signal::SIGKILL);
    let reason = match child.wait() {
        Ok(status) => ExitReason::from_status(status),
        Err(error) => {
            log::error!("reaping harness pid {} failed: {error}", handle.pid);
            ExitReason::Code(-1)
        }
    };
    state.reaped = true;
    Exit {
        reason,
        killed_by_brain: state.killed_by_brain,
    }
}
