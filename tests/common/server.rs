//! `brain serve` as a real process for the tests that drive the binary: started as an operator
//! starts it (registrations in `--agentloops`, an ephemeral port read from its log), talked to over
//! HTTP/1.1 on fresh connections, stopped with real signals, and killed and reaped with its
//! workers when the test ends, pass or fail. Shared by tests/serve_e2e.rs, tests/soak.rs,
//! tests/security.rs, tests/isolation.rs, tests/scaling.rs, tests/packages.rs,
//! tests/idempotency.rs and tests/openapi.rs.

pub use super::http::Api;
use super::{BRAIN, WAIT, all_pids, not_running, parent_of};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The log line `brain serve` writes once it listens; the address follows it.
pub const SERVING: &str = "serving on http://";

/// A `brain serve` process. Dropping it kills it and its workers (SIGKILL) unless it has exited,
/// and reaps it.
pub struct Served {
    pub pid: u32,
    pub addr: SocketAddr,
    pub token: String,
    /// Stderr lines as they arrive.
    pub lines: Receiver<String>,
    /// Every stderr line so far, for failure messages.
    pub log: Arc<Mutex<Vec<String>>>,
    /// The exit status, from the thread that waits for the process.
    pub exited: Receiver<std::io::Result<ExitStatus>>,
    pub status: Option<ExitStatus>,
    /// Worker pids to kill too if they are still there when this is dropped.
    pub workers: Vec<u32>,
}

/// How to start `brain serve`.
pub struct Start<'a> {
    pub data: &'a Path,
    pub registrations: Value,
    pub extra: &'a [&'a str],
    /// `BRAIN_API_TOKEN`; without it the token is generated into `<data>/operator.token`.
    pub token: Option<&'a str>,
    /// More environment variables for the server.
    pub env: &'a [(&'a str, &'a str)],
    /// Run the server as this uid and gid (the tests run as root) instead of the test's own.
    pub uid: Option<u32>,
    /// Start the server under this umask instead of the test's own: `Some(0)` shows that Brain
    /// sets the modes of what it creates itself rather than relying on the operator's umask.
    pub umask: Option<u32>,
}

impl Start<'_> {
    pub fn run(&self) -> Served {
        let mut command = Command::new(BRAIN);
        command
            .arg("serve")
            .arg("--data-dir")
            .arg(self.data)
            .args(["--listen", "127.0.0.1:0", "--cancel-grace", "500ms"])
            .arg("--agentloops")
            .arg(self.registrations.to_string())
            .args(self.extra)
            .env_remove("BRAIN_AGENTLOOPS")
            .env_remove("BRAIN_API_TOKEN")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        command.envs(self.env.iter().copied());
        if let Some(uid) = self.uid {
            command.uid(uid).gid(uid);
        }
        if let Some(umask) = self.umask {
            let umask = nix::sys::stat::Mode::from_bits_truncate(umask);
            // SAFETY: umask(2) is async-signal-safe and changes only the child.
            unsafe {
                command.pre_exec(move || {
                    nix::sys::stat::umask(umask);
                    Ok(())
                });
            }
        }
        if let Some(token) = self.token {
            command.env("BRAIN_API_TOKEN", token);
        }
        let mut child = command.spawn().expect("spawn brain serve");
        let pid = child.id();
        let stderr = child.stderr.take();
        // The child is reaped by this thread on every path; the guard below kills it if need be.
        let (exit_tx, exited) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = exit_tx.send(child.wait());
        });
        let (line_tx, lines) = crossbeam_channel::unbounded();
        let log = Arc::new(Mutex::new(Vec::new()));
        if let Some(stderr) = stderr {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    log.lock().unwrap().push(line.clone());
                    let _ = line_tx.send(line);
                }
            });
        }
        let mut served = Served {
            pid,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: String::new(),
            lines,
            log,
            exited,
            status: None,
            workers: Vec::new(),
        };
        let line = served.wait_line(SERVING, WAIT);
        let rest = line.split(SERVING).nth(1).expect("an address");
        served.addr = rest
            .split_whitespace()
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        served.token = match self.token {
            Some(token) => token.to_owned(),
            None => std::fs::read_to_string(self.data.join("operator.token"))
                .expect("the generated operator.token")
                .trim()
                .to_owned(),
        };
        served
    }
}

/// Starts `brain serve` with a generated token.
pub fn serve(data: &Path, registrations: Value, extra: &[&str]) -> Served {
    Start {
        data,
        registrations,
        extra,
        token: None,
        env: &[],
        uid: None,
        umask: None,
    }
    .run()
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.status.is_none() {
            if let Ok(status) = self.exited.try_recv() {
                self.status = status.ok();
            } else {
                // Still running: its workers first, while it still holds them, then the server;
                // then reap it. Each worker leads a process group of its own (Brain puts it
                // there), which holds what the harness started: an adapter's `opencode serve`
                // outlived a kill of the adapter's pid alone.
                for pid in children_of(self.pid) {
                    signal_group(pid, Signal::SIGKILL);
                }
                signal(self.pid, Signal::SIGKILL);
                let _ = self.exited.recv_timeout(WAIT);
            }
        }
        // Workers that outlived it (a failed test): only if the pid still runs a harness.
        for &pid in &self.workers {
            if harness_alive(pid) {
                signal_group(pid, Signal::SIGKILL);
            }
        }
    }
}

/// Sends `signal` to the process group `pid` leads, or to `pid` alone if it leads none.
pub fn signal_group(pid: u32, signal: Signal) {
    let leads = nix::unistd::getpgid(Some(Pid::from_raw(pid as i32)))
        .is_ok_and(|group| group.as_raw() == pid as i32);
    if leads {
        let _ = nix::sys::signal::killpg(Pid::from_raw(pid as i32), signal);
    } else {
        self::signal(pid, signal);
    }
}

pub fn signal(pid: u32, signal: Signal) {
    let _ = kill(Pid::from_raw(pid as i32), signal);
}

/// The pids whose parent is `parent`, from /proc (this kernel has no `/proc/*/task/*/children`).
pub fn children_of(parent: u32) -> Vec<u32> {
    all_pids()
        .into_iter()
        .filter(|&pid| parent_of(pid) == Some(parent))
        .collect()
}

/// Whether `pid` is a live (not zombie) harness process of this repository.
pub fn harness_alive(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&cmdline);
    !not_running(pid) && cmdline.contains("-harness")
}

impl Served {
    pub fn stderr(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Waits for a stderr line containing `needle`, failing the test after `within`.
    pub fn wait_line(&self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            match self.lines.recv_deadline(deadline) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(error) => panic!(
                    "brain serve logged no {needle:?} ({error}); its stderr:\n{}",
                    self.stderr()
                ),
            }
        }
    }

    pub fn signal(&self, which: Signal) {
        kill(Pid::from_raw(self.pid as i32), which).expect("signal brain serve");
    }

    /// The exit status once the process has exited, or `None` if it still runs after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        if self.status.is_none() {
            match self.exited.recv_timeout(within) {
                Ok(status) => self.status = Some(status.expect("wait for brain serve")),
                Err(RecvTimeoutError::Timeout) => return None,
                Err(RecvTimeoutError::Disconnected) => panic!("the waiter thread is gone"),
            }
        }
        self.status
    }

    /// Sends SIGTERM and expects exit status 0 within `within`.
    pub fn terminate(&mut self, within: Duration) {
        self.signal(Signal::SIGTERM);
        let status = self.wait_exit(within);
        assert!(
            status.is_some_and(|s| s.code() == Some(0)),
            "brain serve exited {status:?} within {within:?}; its stderr:\n{}",
            self.stderr()
        );
    }

    /// The current workers (children) of the server; remembered so that they are killed if the
    /// test fails with them still alive.
    pub fn workers(&mut self, expected: usize) -> Vec<u32> {
        let pids: Vec<u32> = children_of(self.pid)
            .into_iter()
            .filter(|&pid| harness_alive(pid))
            .collect();
        assert_eq!(pids.len(), expected, "workers {pids:?}");
        self.workers.extend(&pids);
        pids
    }
}

/// Encodes a request with `Connection: close`; `headers` come after it.
pub fn encode(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut all = vec![("connection", "close")];
    all.extend_from_slice(headers);
    super::http::encode(method, path, &all, body)
}

impl Api for Served {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn token(&self) -> &str {
        &self.token
    }
}
