//! Bubblewrap: how Brain confines the processes it starts (docs/SECURITY.md).
//!
//! Two things run under it: tool commands of the [`SandboxDriver`](crate::effects::SandboxDriver)
//! ([`Bubblewrap::tool_command`]) and, for a registration with `"sandbox": true`, harness workers
//! ([`Bubblewrap::worker_command`]). Both get fresh pid, ipc, uts and cgroup namespaces (and a
//! fresh network namespace unless allowed the network), a new `/proc` that shows only their own
//! processes, `/dev` with the harmless devices, `--die-with-parent` and `--new-session`. The host's
//! system directories are mounted read-only; nothing of Brain's data directory is visible except
//! what each command needs.
//!
//! A sandbox never holds capabilities. When Brain runs as an ordinary user, bubblewrap puts the
//! command in a user namespace of its own with every capability dropped. When Brain runs as root,
//! bubblewrap sets up the mounts with root's powers and the command then runs as
//! [`SANDBOX_UID`] (`nobody`) with no capabilities at all (through `setpriv`): the kernel does not
//! enforce `RLIMIT_NPROC` against uid 0, nor file permissions against a capable process.

use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The uid and gid that sandboxed tools run as when Brain runs as root: `nobody` / `nogroup`.
pub const SANDBOX_UID: u32 = 65534;

/// Where a tool's workspace appears inside its sandbox; it is also the tool's working directory
/// and `HOME`.
pub const WORKSPACE_MOUNT: &str = "/workspace";

/// The host directories mounted read-only into every sandbox (those that exist; a symbolic link,
/// as on merged-`/usr` systems, is recreated as the same link).
const SYSTEM_DIRS: [&str; 7] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// The files and directories of `/etc` a tool may need (the dynamic linker's cache, user names,
/// time zone, certificates), mounted read-only when they exist. Nothing else of `/etc` is seen.
const ETC_ENTRIES: [&str; 11] = [
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/hosts",
    "/etc/ssl",
    "/etc/ca-certificates",
];

/// How long the startup probe may take before bubblewrap is declared unusable.
const PROBE_DEADLINE: Duration = Duration::from_secs(10);

/// Why the sandbox cannot be used on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxUnavailable(String);

impl fmt::Display for SandboxUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SandboxUnavailable {}

/// Per-call resource limits of a sandboxed tool, applied with `prlimit` inside the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// CPU time, in seconds (`RLIMIT_CPU`).
    pub cpu_seconds: u64,
    /// The largest file the tool may write, in bytes (`RLIMIT_FSIZE`): past it the write fails
    /// and the writer gets `SIGXFSZ`.
    pub file_size_bytes: u64,
    /// How many processes the tool's user may have (`RLIMIT_NPROC`), the fork-bomb limit.
    pub processes: u64,
    /// Address space per process, in bytes (`RLIMIT_AS`).
    pub address_space_bytes: u64,
}

impl Default for Limits {
    /// 30 s of CPU, 256 MiB per file, 256 processes, 4 GiB of address space.
    fn default() -> Limits {
        Limits {
            cpu_seconds: 30,
            file_size_bytes: 256 << 20,
            processes: 256,
            address_space_bytes: 4 << 30,
        }
    }
}

/// A bubblewrap that was found and proven able to create the namespaces Brain needs.
#[derive(Debug, Clone)]
pub struct Bubblewrap {
    bwrap: PathBuf,
    prlimit: PathBuf,
    setpriv: PathBuf,
    as_root: bool,
}

impl Bubblewrap {
    /// Finds `bwrap`, `prlimit` and `setpriv` on `PATH` (or in `/usr/bin`) and runs a sandbox
    /// with every namespace a tool gets, to prove this host allows them (some containers do
    /// not). Refuses, naming the cause, when anything is missing or the trial fails.
    pub fn probe() -> Result<Bubblewrap, SandboxUnavailable> {
        let bwrap = find("bwrap", "install Debian's bubblewrap package")?;
        let prlimit = find("prlimit", "it comes with util-linux")?;
        let setpriv = find("setpriv", "it comes with util-linux")?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let as_root = unsafe { libc::geteuid() } == 0;
        let bubblewrap = Bubblewrap {
            bwrap,
            prlimit,
            setpriv,
            as_root,
        };
        let root = std::env::temp_dir();
        let mut args = bubblewrap.confinement(false);
        args.extend([
            "--tmpfs".into(),
            "/tmp".into(),
            "--bind".into(),
            root.to_string_lossy().into_owned(),
            WORKSPACE_MOUNT.into(),
            "--".into(),
        ]);
        args.extend(bubblewrap.drop_privileges());
        args.push("true".into());
        bubblewrap.trial(&args)?;
        Ok(bubblewrap)
    }

    /// Whether tools run as [`SANDBOX_UID`] (Brain runs as root), so that their workspaces must
    /// belong to that uid.
    pub fn runs_tools_as_nobody(&self) -> bool {
        self.as_root
    }

    /// The bubblewrap executable.
    pub fn program(&self) -> &Path {
        &self.bwrap
    }

    /// The arguments that run `command` (program, then arguments) as a tool: `workspace`
    /// read-write at [`WORKSPACE_MOUNT`] (its working directory), a private `/tmp`, no network
    /// unless `network`, and `limits` applied to the command and everything it starts.
    pub fn tool_command(
        &self,
        workspace: &Path,
        network: bool,
        limits: &Limits,
        command: &[String],
    ) -> Vec<String> {
        let mut args = self.confinement(network);
        args.extend(
            [
                "--tmpfs",
                "/tmp",
                "--bind",
                &workspace.to_string_lossy(),
                WORKSPACE_MOUNT,
                "--chdir",
                WORKSPACE_MOUNT,
                "--hostname",
                "brain-sandbox",
                "--",
            ]
            .map(str::to_owned),
        );
        args.extend(self.drop_privileges());
        args.extend([
            self.prlimit.to_string_lossy().into_owned(),
            format!("--cpu={}", limits.cpu_seconds),
            format!("--fsize={}", limits.file_size_bytes),
            format!("--nproc={}", limits.processes),
            format!("--as={}", limits.address_space_bytes),
            "--".into(),
        ]);
        args.extend(command.iter().cloned());
        args
    }

    /// The arguments that run a harness worker `program` with `args`: the whole host file system
    /// read-only except `data_dir`, which is hidden, and `state_root` (its registration's
    /// `agentloops/<registration>/`), which is read-write; a private `/tmp` (unless the worker's
    /// program, arguments or working directory `worker_cwd` lie there); no network. Harness
    /// workers keep the user Brain runs as (they are the operator's code).
    pub fn worker_command(
        &self,
        data_dir: &Path,
        state_root: &Path,
        worker_cwd: Option<&Path>,
        program: &Path,
        args: &[String],
    ) -> Vec<String> {
        let mut bwrap = vec![
            "--unshare-pid".to_owned(),
            "--unshare-ipc".into(),
            "--unshare-uts".into(),
            "--unshare-net".into(),
            "--unshare-cgroup-try".into(),
            "--die-with-parent".into(),
            "--new-session".into(),
            "--cap-drop".into(),
            "ALL".into(),
            "--ro-bind".into(),
            "/".into(),
            "/".into(),
            "--dev".into(),
            "/dev".into(),
            "--proc".into(),
            "/proc".into(),
        ];
        if !self.as_root {
            bwrap.insert(0, "--unshare-user".into());
        }
        // The data directory is replaced by an empty one, and so is /tmp unless the worker needs
        // something there (its program, an argument naming a file, its working directory, the
        // data directory); its state root is then mounted back, read-write, at its own path.
        let shown = |path: &Path| path.to_string_lossy().into_owned();
        let tmp = Path::new("/tmp");
        let cwd = std::env::current_dir().unwrap_or_default();
        let needs_tmp = [program, data_dir, state_root, cwd.as_path()]
            .into_iter()
            .chain(args.iter().map(Path::new))
            .chain(worker_cwd)
            .any(|path| path.starts_with(tmp));
        if !needs_tmp {
            bwrap.extend(["--tmpfs".into(), "/tmp".into()]);
        }
        bwrap.extend(["--tmpfs".into(), shown(data_dir)]);
        bwrap.extend(["--bind".into(), shown(state_root), shown(state_root)]);
        // Nothing can be written beside the state root either (the tmpfs is only a veil).
        bwrap.extend(["--remount-ro".into(), shown(data_dir)]);
        bwrap.push("--".into());
        bwrap.push(shown(program));
        bwrap.extend(args.iter().cloned());
        bwrap
    }

    /// Namespaces, session, system directories, `/proc` and `/dev`: the options every tool
    /// sandbox starts with (the command and its `--` come after the caller's own options).
    fn confinement(&self, network: bool) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        if !self.as_root {
            args.extend(
                ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"].map(str::to_owned),
            );
        }
        args.extend(
            [
                "--unshare-pid",
                "--unshare-ipc",
                "--unshare-uts",
                "--unshare-cgroup-try",
                "--die-with-parent",
                "--new-session",
            ]
            .map(str::to_owned),
        );
        if !network {
            args.push("--unshare-net".into());
        }
        for dir in SYSTEM_DIRS {
            match std::fs::symlink_metadata(dir) {
                Ok(meta) if meta.file_type().is_symlink() => {
                    if let Ok(target) = std::fs::read_link(dir) {
                        args.extend([
                            "--symlink".into(),
                            target.to_string_lossy().into_owned(),
                            dir.into(),
                        ]);
                    }
                }
                Ok(meta) if meta.is_dir() => {
                    args.extend(["--ro-bind".into(), dir.into(), dir.into()]);
                }
                _ => {}
            }
        }
        for entry in ETC_ENTRIES {
            args.extend(["--ro-bind-try".into(), entry.into(), entry.into()]);
        }
        if network {
            args.extend([
                "--ro-bind-try".into(),
                "/etc/resolv.conf".into(),
                "/etc/resolv.conf".into(),
            ]);
        }
        args.extend(["--proc", "/proc", "--dev", "/dev"].map(str::to_owned));
        args
    }

    /// As root, the command drops to [`SANDBOX_UID`] with no capabilities and no way to gain
    /// any; otherwise the user namespace already holds none, and nothing is added.
    fn drop_privileges(&self) -> Vec<String> {
        if !self.as_root {
            return Vec::new();
        }
        vec![
            self.setpriv.to_string_lossy().into_owned(),
            format!("--reuid={SANDBOX_UID}"),
            format!("--regid={SANDBOX_UID}"),
            "--clear-groups".into(),
            "--inh-caps=-all".into(),
            "--bounding-set=-all".into(),
            "--no-new-privs".into(),
        ]
    }

    /// Runs bubblewrap with `args` to its end, within [`PROBE_DEADLINE`].
    fn trial(&self, args: &[String]) -> Result<(), SandboxUnavailable> {
        let mut child = Command::new(&self.bwrap)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|error| {
                SandboxUnavailable(format!("cannot run {}: {error}", self.bwrap.display()))
            })?;
        let deadline = Instant::now() + PROBE_DEADLINE;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(SandboxUnavailable(format!(
                        "{} did not finish a trial sandbox within {} s",
                        self.bwrap.display(),
                        PROBE_DEADLINE.as_secs()
                    )));
                }
                Err(error) => {
                    return Err(SandboxUnavailable(format!(
                        "waiting for {}: {error}",
                        self.bwrap.display()
                    )));
                }
            }
        };
        if status.success() {
            return Ok(());
        }
        let mut stderr = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            use std::io::Read;
            let _ = pipe.read_to_string(&mut stderr);
        }
        Err(SandboxUnavailable(format!(
            "bubblewrap ({}) cannot create the namespaces a sandbox needs on this host ({status}): {}",
            self.bwrap.display(),
            stderr.trim()
        )))
    }
}

/// Finds `name` in Brain's `PATH`, else in `/usr/bin`.
fn find(name: &str, hint: &str) -> Result<PathBuf, SandboxUnavailable> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(OsStr::new(name)))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| SandboxUnavailable(format!("{name} is not installed ({hint})")))
}
