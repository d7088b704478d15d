//! Helpers shared by the integration tests: real harness binaries, short deadlines, /proc checks.

#![allow(dead_code)] // Each test crate uses a different subset.

pub mod adapter;
pub mod http;
pub mod journal;
pub mod server;

use brain::{Brain, Config, Options, Registration, Registrations};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The fault harness built from this repository.
pub const FAULT_HARNESS: &str = env!("CARGO_BIN_EXE_brain-fault-harness");
/// The reference harness built from this repository.
pub const REFERENCE_HARNESS: &str = env!("CARGO_BIN_EXE_brain-reference-harness");
/// The brain binary.
pub const BRAIN: &str = env!("CARGO_BIN_EXE_brain");

/// How long any single wait in a test may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(20);

/// Asserts that `session` is interrupted, its marker at `marker`, and that it refuses a new
/// message with `session_interrupted`.
pub fn assert_interrupted(session: &brain::Session, marker: u64) {
    use brain::protocol::harness::{Block, UserInput};
    let info = session.info().expect("the session's info");
    assert_eq!(info.status, brain::SessionStatus::Interrupted, "{info:?}");
    assert_eq!(info.marker, Some(marker));
    let message = UserInput {
        content: vec![Block::text("again")],
    };
    let refused = session
        .send(message)
        .expect_err("an interrupted session refuses");
    assert_eq!(refused.code.as_str(), "session_interrupted");
}

/// A registration running the fault harness with `args`.
pub fn fault(name: &str, args: &[&str]) -> Registration {
    Registration::new(name, FAULT_HARNESS).args(args.iter().copied())
}

/// A fresh, empty directory for one test.
pub fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "brain-test-{}-{}-{tag}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// Options with deadlines short enough for a fast suite on two cores.
pub fn fast_options(tag: &str) -> Options {
    Options {
        data_dir: temp_dir(tag).join("data"),
        init_deadline: Duration::from_secs(10),
        cancel_grace: Duration::from_millis(500),
        respawn_backoff: Duration::from_millis(20),
        respawn_backoff_max: Duration::from_millis(200),
        ..Options::default()
    }
}

/// Starts Brain with these registrations and options, panicking with the error if it refuses.
pub fn start(registrations: Vec<Registration>, options: Options) -> Brain {
    let registrations = Registrations::from_vec(registrations).expect("valid registrations");
    let mut config = Config::new(registrations);
    config.options = options;
    Brain::start(config).unwrap_or_else(|error| panic!("Brain refused to start: {error}"))
}

/// The one-letter state of a process from /proc, or `None` when no such process exists.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state follows the parenthesised command name, which may itself contain spaces.
    let after = stat.rsplit_once(')')?.1;
    after.trim_start().chars().next()
}

/// Whether a process is no longer running: gone, or a zombie waiting for its (other) parent.
pub fn not_running(pid: u32) -> bool {
    matches!(proc_state(pid), None | Some('Z') | Some('X'))
}

/// Waits until `pid` is no longer running, for at most `limit`; returns whether it stopped. A
/// process killed with SIGKILL dies when it next runs, so on a busy machine it may outlive the
/// call that killed it by a moment.
pub fn stops_within(pid: u32, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while !not_running(pid) {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        // Nothing to wait on for a process that is not our child: look again shortly.
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// Every pid in /proc now.
pub fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .collect()
}

/// The parent pid of a process, from /proc.
pub fn parent_of(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Runs a command to completion, failing the test if it takes longer than [`WAIT`].
pub fn run_bounded(command: &mut std::process::Command) -> std::process::Output {
    run_within(command, WAIT)
}

/// Runs a command to completion, failing the test (and killing it) if it takes longer than `limit`.
pub fn run_within(
    command: &mut std::process::Command,
    limit: std::time::Duration,
) -> std::process::Output {
    use std::process::Stdio;
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("spawn {command:?}: {error}"));
    let pid = child.id();
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(output) => output.expect("wait for command"),
        Err(_) => {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("command {command:?} did not finish within {limit:?}");
        }
    }
}

/// A tiny deterministic generator (a 64-bit LCG) for random kill points and choices that a seed
/// can replay.
#[derive(Debug, Clone)]
pub struct Lcg(pub u64);

impl Lcg {
    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }

    /// A new generator for a worker thread, its stream drawn from this one.
    pub fn fork(&mut self) -> Lcg {
        Lcg(self.below(u64::MAX) ^ 0x9e37_79b9_7f4a_7c15)
    }
}
