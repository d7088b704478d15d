//! The built-in `local` environment driver: runs tools as commands on the Brain host
//! (PROTOCOL.md §9).
//!
//! An environment with `"driver": "local"` declares its tools in its configuration:
//!
//! ```json
//! {"tools": {"grep": {"command": ["rg", "--json"], "timeout_ms": 10000, "max_output_bytes": 65536}}}
//! ```
//!
//! Each call spawns the tool's `command` afresh, in a process group of its own, in the
//! environment's workspace (`<data>/workspaces/<session_id>/<environment>/`, created 0700 at the
//! first call; or the configuration's `workspace`, which must lie inside a root the deployment
//! allowed with [`LocalDriver::with_workspace_roots`]), with a cleared environment (only [`ALLOWED_ENV`] is passed on from Brain's,
//! so Brain's credentials never reach a tool). The tool input arrives on stdin as one line of JSON,
//! then stdin is closed; the tool answers on stdout with `{"content":[Block],"is_error"?}` or with
//! plain text (taken as one text block). At its deadline, or when its call is cancelled, the whole
//! process group is killed with `SIGKILL`. When the tool's own process exits, whatever it left
//! running in its group is killed too: nothing a tool starts outlives its call.
//!
//! Once the process started, every ending is a [`ToolResult`]: `ok` (exit status 0), `error`
//! (any other exit, or death by a signal Brain did not send), `timeout` or `cancelled`. Only a tool
//! that never started is an `Err`: an undeclared tool, an unusable workspace, a command that
//! cannot be executed.
//!
//! `local` confines nothing: a tool runs as Brain's user, with the host's file system and network
//! in reach. The [`SandboxDriver`](super::SandboxDriver) runs the same tools under bubblewrap;
//! docs/SECURITY.md compares the two.

use super::{EffectError, EnvironmentDriver, ToolCall};
use crate::cancel::CancelToken;
use crate::protocol::harness::{Block, ErrorCode, ToolOutcome, ToolResult};
use crate::worker::process::{self, Exit, ExitReason, ProcessHandle, SpawnSpec};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// A tool's deadline when its configuration gives no `timeout_ms`: 30 seconds.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;

/// How much of a tool's stdout is kept when its configuration gives no `max_output_bytes`: 1 MiB.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 1 << 20;

/// The variables of Brain's own environment that a tool inherits (those that are set); a tool
/// sees no other variable. `PATH` defaults to [`DEFAULT_PATH`] when Brain has none.
pub const ALLOWED_ENV: [&str; 6] = ["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR"];

/// The `PATH` a tool gets when Brain's environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// At most this much of the end of a tool's stderr is kept (less when `max_output_bytes` is
/// smaller): it is only shown when a failing tool wrote nothing on stdout.
const STDERR_TAIL_BYTES: usize = 8 * 1024;

/// How long the output readers may take to reach end-of-file once the tool's process group is
/// gone. Only a process that left the group (`setsid`) while holding the pipes open makes them
/// wait; the call then returns what was read so far.
const READER_GRACE: Duration = Duration::from_secs(2);

/// The size of one read from a tool's stdout or stderr.
const READ_CHUNK: usize = 64 * 1024;

/// The built-in `local` environment driver (see the [module documentation](self)).
///
/// Stateless: every call reads its tool from the environment's configuration, which
/// [`validate_configuration`] checks when the session is created. Setup does nothing and there is
/// no driver-specific method (the [`EnvironmentDriver`] defaults).
///
/// ```
/// use brain::effects::{Effects, LocalDriver};
/// use std::sync::Arc;
///
/// let effects = Effects::default().with_driver(LocalDriver::NAME, Arc::new(LocalDriver::new()));
/// assert!(effects.driver("local").is_some());
/// ```
#[derive(Debug, Clone, Default)]
pub struct LocalDriver {
    roots: WorkspaceRoots,
}

impl LocalDriver {
    /// The name under which the driver is meant to be registered, and that environments name as
    /// their `driver`: `local`.
    pub const NAME: &'static str = "local";

    /// The driver; no environment may name a `workspace` of its own.
    pub fn new() -> LocalDriver {
        LocalDriver::default()
    }

    /// The driver, letting an environment's `workspace` name a directory inside one of `roots`
    /// (absolute paths the deployment chose). Nothing outside them can be named.
    pub fn with_workspace_roots(roots: Vec<PathBuf>) -> LocalDriver {
        LocalDriver {
            roots: WorkspaceRoots(roots.into()),
        }
    }
}

/// The directories inside which a deployment lets an environment's configuration place its
/// workspace (the `workspace` key). Empty: every tool works in its session's own workspace.
#[derive(Debug, Clone, Default)]
pub(crate) struct WorkspaceRoots(Arc<[PathBuf]>);

impl WorkspaceRoots {
    pub(crate) fn new(roots: Vec<PathBuf>) -> WorkspaceRoots {
        WorkspaceRoots(roots.into())
    }

    /// Checks a configured workspace: an absolute, plain path (no `.` or `..`) inside a root.
    fn check(&self, path: &str) -> Result<PathBuf, String> {
        let path = Path::new(path);
        if !path.is_absolute() {
            return Err(format!("workspace: {path:?} is not an absolute path"));
        }
        if path
            .components()
            .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
        {
            return Err(format!(
                "workspace: {path:?} must not contain \".\" or \"..\""
            ));
        }
        if self.0.iter().any(|root| path.starts_with(root)) {
            Ok(path.to_path_buf())
        } else if self.0.is_empty() {
            Err(
                "workspace: this deployment allows no workspace roots (the session's own \
                 workspace is used when the key is left out)"
                    .to_owned(),
            )
        } else {
            Err(format!(
                "workspace: {path:?} is not inside a workspace root this deployment allows ({})",
                self.0
                    .iter()
                    .map(|root| root.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }
    }

    /// Creates `workspace` and checks, with every symbolic link resolved, that it still lies
    /// inside a root: a link planted inside a root cannot lead a later session outside it.
    fn confirm(&self, workspace: &Path) -> Result<PathBuf, String> {
        create_private_dir(workspace).map_err(|error| {
            format!(
                "cannot create the workspace {}: {error}",
                workspace.display()
            )
        })?;
        let real = workspace.canonicalize().map_err(|error| {
            format!(
                "cannot resolve the workspace {}: {error}",
                workspace.display()
            )
        })?;
        let inside = self
            .0
            .iter()
            .any(|root| root.canonicalize().is_ok_and(|root| real.starts_with(root)));
        if inside {
            Ok(real)
        } else {
            Err(format!(
                "the workspace {} resolves to {}, outside every allowed root",
                workspace.display(),
                real.display()
            ))
        }
    }
}

/// Checks a `local` environment's configuration, for use when a session is created: `tools` is
/// an object mapping each tool name to `{"command": [program, args…], "timeout_ms"?,
/// "max_output_bytes"?}`; `command` is a non-empty array of strings whose first is non-empty;
/// `timeout_ms` and `max_output_bytes` are positive integers; `workspace`, when given, is an
/// absolute path (checked against the driver's roots by [`EnvironmentDriver::validate`]). Any
/// other key is refused.
///
/// The error names the offending field by its path, e.g. `tools.grep.timeout_ms: must be a
/// positive integer (milliseconds)`.
pub fn validate_configuration(configuration: &Map<String, Value>) -> Result<(), String> {
    parse_configuration(configuration, LOCAL_KEYS).map(|_| ())
}

/// The keys of a `local` environment's configuration.
const LOCAL_KEYS: &[&str] = &["tools", "workspace"];

/// One declared tool, as its configuration says.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolSpec {
    pub(crate) command: Vec<String>,
    timeout_ms: u64,
    max_output_bytes: usize,
}

/// Parses the `tools` of a configuration whose keys must be among `known` (`tools` first).
pub(crate) fn parse_configuration(
    configuration: &Map<String, Value>,
    known: &[&str],
) -> Result<BTreeMap<String, ToolSpec>, String> {
    if let Some(key) = configuration
        .keys()
        .find(|key| !known.contains(&key.as_str()))
    {
        return Err(format!("{key}: unknown key (known: {})", known.join(", ")));
    }
    if let Some(workspace) = configuration.get("workspace")
        && !workspace.as_str().is_some_and(|path| path.starts_with('/'))
    {
        return Err("workspace: must be an absolute path (a string)".into());
    }
    let tools = match configuration.get("tools") {
        None => {
            return Err("tools: missing (an object of tool names to {\"command\": [...]})".into());
        }
        Some(Value::Object(tools)) => tools,
        Some(_) => {
            return Err("tools: must be an object of tool names to {\"command\": [...]}".into());
        }
    };
    let mut parsed = BTreeMap::new();
    for (name, tool) in tools {
        if name.is_empty() {
            return Err("tools: a tool name must not be empty".into());
        }
        parsed.insert(name.clone(), parse_tool(name, tool)?);
    }
    Ok(parsed)
}

fn parse_tool(name: &str, tool: &Value) -> Result<ToolSpec, String> {
    let Value::Object(tool) = tool else {
        return Err(format!(
            "tools.{name}: must be an object with a \"command\""
        ));
    };
    if let Some(key) = tool
        .keys()
        .find(|key| !matches!(key.as_str(), "command" | "timeout_ms" | "max_output_bytes"))
    {
        return Err(format!(
            "tools.{name}.{key}: unknown key (known: command, timeout_ms, max_output_bytes)"
        ));
    }
    let command = match tool.get("command") {
        None => return Err(format!("tools.{name}.command: missing")),
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|item| item.as_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| format!("tools.{name}.command: every element must be a string"))?,
        Some(_) => {
            return Err(format!(
                "tools.{name}.command: must be a non-empty array of strings (program, then arguments)"
            ));
        }
    };
    if command[0].is_empty() {
        return Err(format!(
            "tools.{name}.command: the program (first element) must not be empty"
        ));
    }
    let timeout_ms =
        positive(tool, name, "timeout_ms", "milliseconds")?.unwrap_or(DEFAULT_TIMEOUT_MS);
    let max_output_bytes =
        positive(tool, name, "max_output_bytes", "bytes")?.unwrap_or(DEFAULT_MAX_OUTPUT_BYTES);
    Ok(ToolSpec {
        command,
        timeout_ms,
        max_output_bytes: usize::try_from(max_output_bytes).unwrap_or(usize::MAX),
    })
}

fn positive(
    tool: &Map<String, Value>,
    name: &str,
    key: &str,
    unit: &str,
) -> Result<Option<u64>, String> {
    match tool.get(key) {
        None => Ok(None),
        Some(value) => match value.as_u64() {
            Some(number) if number > 0 => Ok(Some(number)),
            _ => Err(format!(
                "tools.{name}.{key}: must be a positive integer ({unit})"
            )),
        },
    }
}

fn tool_failed(message: String) -> EffectError {
    EffectError::Failed {
        code: ErrorCode::ToolFailed,
        message,
    }
}

impl EnvironmentDriver for LocalDriver {
    fn validate(&self, configuration: &Map<String, Value>) -> Result<(), String> {
        check_configuration(configuration, LOCAL_KEYS, &self.roots)
    }

    fn call_tool(
        &self,
        call: &ToolCall<'_>,
        cancel: &CancelToken,
    ) -> Result<ToolResult, EffectError> {
        let prepared = prepare(call, LOCAL_KEYS, &self.roots, cancel)?;
        let spawn = SpawnSpec {
            program: PathBuf::from(&prepared.tool.command[0]),
            args: prepared.tool.command[1..].to_vec(),
            env: tool_environment(),
            cwd: Some(prepared.workspace.clone()),
        };
        run(call, &prepared.tool, spawn, prepared.input, cancel)
    }
}

/// Checks a configuration's keys, tools and `workspace` (against `roots`).
pub(crate) fn check_configuration(
    configuration: &Map<String, Value>,
    known: &[&str],
    roots: &WorkspaceRoots,
) -> Result<(), String> {
    parse_configuration(configuration, known)?;
    match configuration.get("workspace").and_then(Value::as_str) {
        Some(workspace) => roots.check(workspace).map(|_| ()),
        None => Ok(()),
    }
}

/// A tool call made ready to start: its declared tool, its workspace (created), its input line.
pub(crate) struct Prepared {
    pub(crate) tool: ToolSpec,
    pub(crate) workspace: PathBuf,
    pub(crate) input: Vec<u8>,
}

/// Finds the called tool in the environment's configuration and creates its workspace: the
/// session's own (`<workspace_dir>/<environment>`, 0700), or the configured one inside `roots`.
pub(crate) fn prepare(
    call: &ToolCall<'_>,
    known: &[&str],
    roots: &WorkspaceRoots,
    cancel: &CancelToken,
) -> Result<Prepared, EffectError> {
    let environment = &call.environment.name;
    let invalid = |error: String| {
        tool_failed(format!(
            "environment {environment:?} has an invalid configuration: {error}"
        ))
    };
    let mut tools = parse_configuration(&call.environment.configuration, known).map_err(invalid)?;
    let Some(tool) = tools.remove(call.tool) else {
        return Err(tool_failed(format!(
            "environment {environment:?} declares no tool {:?}",
            call.tool
        )));
    };
    if cancel.is_cancelled() {
        return Err(EffectError::Cancelled { sent: false });
    }
    let workspace = match call
        .environment
        .configuration
        .get("workspace")
        .and_then(Value::as_str)
    {
        Some(configured) => {
            let checked = roots.check(configured).map_err(invalid)?;
            roots.confirm(&checked).map_err(tool_failed)?
        }
        None => {
            let workspace = call.workspace();
            create_private_dir(&workspace).map_err(|error| {
                tool_failed(format!(
                    "cannot create the workspace {}: {error}",
                    workspace.display()
                ))
            })?;
            workspace
        }
    };
    let mut input = serde_json::to_vec(call.input)
        .map_err(|error| tool_failed(format!("cannot encode the tool input: {error}")))?;
    input.push(b'\n');
    Ok(Prepared {
        tool,
        workspace,
        input,
    })
}

/// Creates `path` and its missing parents, each 0700.
fn create_private_dir(path: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
}

/// The environment a tool runs with: the allowed variables Brain has, and always a `PATH`.
fn tool_environment() -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = ALLOWED_ENV
        .iter()
        .filter_map(|name| {
            std::env::var(name)
                .ok()
                .map(|value| ((*name).to_owned(), value))
        })
        .collect();
    if !env.iter().any(|(name, _)| name == "PATH") {
        env.push(("PATH".to_owned(), DEFAULT_PATH.to_owned()));
    }
    env
}

/// The threads that serve one tool process, started before it so that a failure to start a
/// thread leaves nothing running. Each waits for its end of the process, then does its job.
struct Helpers {
    stdin: Sender<(ChildStdin, Vec<u8>)>,
    stdout: Sender<ChildStdout>,
    stderr: Sender<ChildStderr>,
    waiter: Sender<(Arc<ProcessHandle>, Child)>,
    stdout_capture: Arc<Mutex<Capture>>,
    stderr_capture: Arc<Mutex<Capture>>,
    readers_done: Receiver<()>,
    exit: Receiver<Exit>,
}

/// Starts a thread named `name` that waits for one `T`, then runs `job` with it. When the sender
/// is dropped instead, the thread ends without running `job`.
fn helper<T: Send + 'static>(
    name: String,
    job: impl FnOnce(T) + Send + 'static,
) -> io::Result<Sender<T>> {
    let (sender, receiver) = crossbeam_channel::bounded::<T>(1);
    thread::Builder::new().name(name).spawn(move || {
        if let Ok(value) = receiver.recv() {
            job(value);
        }
    })?;
    Ok(sender)
}

fn start_helpers(sequence: u64, spec: &ToolSpec) -> io::Result<Helpers> {
    let stdout_capture = Arc::new(Mutex::new(Capture::head(spec.max_output_bytes)));
    let stderr_capture = Arc::new(Mutex::new(Capture::tail(
        spec.max_output_bytes.min(STDERR_TAIL_BYTES),
    )));
    let (done_tx, readers_done) = crossbeam_channel::bounded(2);
    let (exit_tx, exit) = crossbeam_channel::bounded(1);
    let stdin = helper(
        format!("brain-tool:{sequence}-stdin"),
        |(mut pipe, input): (ChildStdin, Vec<u8>)| {
            // A tool may exit without reading its input: the broken pipe is its business.
            if let Err(error) = pipe.write_all(&input) {
                log::debug!("writing a tool's input stopped: {error}");
            }
        },
    )?;
    let stdout = {
        let capture = stdout_capture.clone();
        let done = done_tx.clone();
        helper(
            format!("brain-tool:{sequence}-stdout"),
            move |pipe: ChildStdout| {
                drain(pipe, &capture);
                let _ = done.send(());
            },
        )?
    };
    let stderr = {
        let capture = stderr_capture.clone();
        helper(
            format!("brain-tool:{sequence}-stderr"),
            move |pipe: ChildStderr| {
                drain(pipe, &capture);
                let _ = done_tx.send(());
            },
        )?
    };
    let waiter = helper(
        format!("brain-tool:{sequence}-wait"),
        move |(handle, child): (Arc<ProcessHandle>, Child)| {
            let _ = exit_tx.send(process::wait_and_reap(&handle, child));
        },
    )?;
    Ok(Helpers {
        stdin,
        stdout,
        stderr,
        waiter,
        stdout_capture,
        stderr_capture,
        readers_done,
        exit,
    })
}

/// Reads `pipe` to its end, keeping what `capture` allows: past the cap it keeps reading (so the
/// tool never blocks on a full pipe) and throws the bytes away.
fn drain(mut pipe: impl Read, capture: &Mutex<Capture>) {
    let mut buffer = vec![0u8; READ_CHUNK];
    loop {
        match pipe.read(&mut buffer) {
            Ok(0) => return,
            Ok(read) => capture.lock().push(&buffer[..read]),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => {
                log::debug!("reading a tool's output stopped: {error}");
                return;
            }
        }
    }
}

/// What is kept of one output stream: its first `limit` bytes (`head`) or its last (`tail`).
#[derive(Debug)]
struct Capture {
    bytes: Vec<u8>,
    limit: usize,
    keep_tail: bool,
    total: u64,
}

impl Capture {
    fn head(limit: usize) -> Capture {
        Capture {
            bytes: Vec::new(),
            limit,
            keep_tail: false,
            total: 0,
        }
    }

    fn tail(limit: usize) -> Capture {
        Capture {
            keep_tail: true,
            ..Capture::head(limit)
        }
    }

    fn push(&mut self, data: &[u8]) {
        self.total = self.total.saturating_add(data.len() as u64);
        if self.keep_tail {
            self.bytes.extend_from_slice(data);
            // Trim in batches so that a chatty stream costs amortised linear time.
            if self.bytes.len() > self.limit.saturating_mul(2) {
                let excess = self.bytes.len() - self.limit;
                self.bytes.drain(..excess);
            }
        } else {
            let room = self.limit.saturating_sub(self.bytes.len());
            self.bytes.extend_from_slice(&data[..data.len().min(room)]);
        }
    }

    fn truncated(&self) -> bool {
        self.total > self.limit as u64
    }

    /// The kept bytes as text: invalid UTF-8 replaced, and a character cut in half at the cut
    /// (the end of a head, the start of a tail) dropped rather than mangled.
    fn text(&self) -> String {
        let mut bytes = self.bytes.as_slice();
        if self.keep_tail {
            if bytes.len() > self.limit {
                bytes = &bytes[bytes.len() - self.limit..];
            }
            if self.truncated() {
                let skip = bytes
                    .iter()
                    .take(3)
                    .take_while(|byte| (**byte & 0xC0) == 0x80)
                    .count();
                bytes = &bytes[skip..];
            }
        } else if self.truncated()
            && let Err(error) = std::str::from_utf8(bytes)
            && error.error_len().is_none()
        {
            bytes = &bytes[..error.valid_up_to()];
        }
        String::from_utf8_lossy(bytes).into_owned()
    }
}

/// How the wait for the tool ended.
enum Ending {
    Exited(Exit),
    TimedOut,
    Cancelled,
}

/// Runs `spawn_spec` (which starts `spec`'s command, directly or through a sandbox) to its end.
pub(crate) fn run(
    call: &ToolCall<'_>,
    spec: &ToolSpec,
    spawn_spec: SpawnSpec,
    input: Vec<u8>,
    cancel: &CancelToken,
) -> Result<ToolResult, EffectError> {
    // Thread names carry only the sequence: a tool name could hold a NUL, which no thread name may.
    let helpers = start_helpers(call.sequence, spec).map_err(|error| {
        tool_failed(format!(
            "cannot start the threads to run tool {:?}: {error}",
            call.tool
        ))
    })?;
    // On failure the helpers' senders are dropped with `helpers`, and their threads end.
    let spawned = process::spawn(&spawn_spec).map_err(|error| {
        tool_failed(format!(
            "cannot start tool {:?} ({:?}): {error}",
            call.tool, spec.command[0]
        ))
    })?;
    let handle = spawned.handle.clone();
    let started = Instant::now();
    log::debug!(
        "session {} tool {:?} (sequence {}) started as process group {}",
        call.session_id,
        call.tool,
        call.sequence,
        handle.pid()
    );
    if let Err(error) = helpers.waiter.send((spawned.handle, spawned.child)) {
        // The waiter thread is gone (it cannot be, short of a panic): reap here instead.
        let (handle, child) = error.into_inner();
        handle.kill();
        let exit = process::wait_and_reap(&handle, child);
        return Err(EffectError::Unknown {
            message: format!(
                "tool {:?} was started, then lost its waiter thread ({exit})",
                call.tool
            ),
        });
    }
    // A failed send means a helper thread is gone, and with it its end of the pipe: the pipe is
    // closed by the drop, and the tool sees end-of-file or a broken pipe.
    let _ = helpers.stdin.send((spawned.stdin, input));
    let _ = helpers.stdout.send(spawned.stdout);
    let _ = helpers.stderr.send(spawned.stderr);

    let (cancel_tx, cancel_rx) = crossbeam_channel::bounded(1);
    cancel.on_cancel(move || {
        let _ = cancel_tx.try_send(());
    });
    let deadline = started.checked_add(Duration::from_millis(spec.timeout_ms));
    let timer = match deadline {
        Some(deadline) => crossbeam_channel::at(deadline),
        None => crossbeam_channel::never(),
    };
    let ending = crossbeam_channel::select! {
        recv(helpers.exit) -> exit => match exit {
            Ok(exit) => Ending::Exited(exit),
            Err(_) => return Err(lost_waiter(call)),
        },
        recv(cancel_rx) -> _ => Ending::Cancelled,
        recv(timer) -> _ => Ending::TimedOut,
    };
    let ending = match ending {
        Ending::Exited(exit) => Ending::Exited(exit),
        killing => {
            let killed = handle.kill();
            let Ok(exit) = helpers.exit.recv() else {
                return Err(lost_waiter(call));
            };
            // A leader reaped before the kill ended on its own, just in time.
            if killed {
                killing
            } else {
                Ending::Exited(exit)
            }
        }
    };
    // The group is dead: the pipes reach end-of-file unless a process that left the group holds
    // them, in which case the readers are left behind to finish whenever it lets go.
    let grace = Instant::now() + READER_GRACE;
    for _ in 0..2 {
        if helpers.readers_done.recv_deadline(grace).is_err() {
            log::warn!(
                "tool {:?} (session {}, sequence {}): a process outside its group keeps its output open; \
                 returning what was read",
                call.tool,
                call.session_id,
                call.sequence
            );
            break;
        }
    }
    let stdout = helpers.stdout_capture.lock();
    let stderr = helpers.stderr_capture.lock();
    let result = finish(call.tool, spec, ending, &stdout, &stderr);
    log::debug!(
        "session {} tool {:?} (sequence {}) ended {:?} after {} ms",
        call.session_id,
        call.tool,
        call.sequence,
        result.outcome,
        started.elapsed().as_millis()
    );
    Ok(result)
}

fn lost_waiter(call: &ToolCall<'_>) -> EffectError {
    EffectError::Unknown {
        message: format!(
            "tool {:?} was started, then lost its waiter thread",
            call.tool
        ),
    }
}

/// Turns how the tool ended, and what it wrote, into its result.
fn finish(
    tool: &str,
    spec: &ToolSpec,
    ending: Ending,
    stdout: &Capture,
    stderr: &Capture,
) -> ToolResult {
    let text = stdout.text();
    let truncation = stdout.truncated().then(|| {
        Block::text(format!(
            "[output truncated: {} of {} bytes kept]",
            stdout.bytes.len(),
            stdout.total
        ))
    });
    let mut content = Vec::new();
    let (outcome, is_error) = match ending {
        Ending::Exited(Exit {
            reason: ExitReason::Code(0),
            ..
        }) => {
            if let Some((blocks, is_error)) = structured(&text, stdout.truncated()) {
                return ToolResult {
                    outcome: ToolOutcome::Ok,
                    content: blocks,
                    is_error,
                };
            }
            if !text.is_empty() {
                content.push(Block::text(text));
            }
            content.extend(truncation);
            (ToolOutcome::Ok, false)
        }
        Ending::Exited(exit) => {
            if !text.is_empty() {
                content.push(Block::text(text));
                content.extend(truncation);
            } else {
                let tail = stderr.text();
                if !tail.is_empty() {
                    content.push(Block::text(tail));
                }
            }
            content.push(Block::text(format!("tool {tool:?} {}", exit.reason)));
            (ToolOutcome::Error, true)
        }
        Ending::TimedOut => {
            if !text.is_empty() {
                content.push(Block::text(text));
                content.extend(truncation);
            }
            content.push(Block::text(format!(
                "tool {tool:?} timed out after {} ms and was killed",
                spec.timeout_ms
            )));
            (ToolOutcome::Timeout, true)
        }
        Ending::Cancelled => {
            content.push(Block::text(format!(
                "tool {tool:?} was cancelled and killed"
            )));
            (ToolOutcome::Cancelled, true)
        }
    };
    ToolResult {
        outcome,
        content,
        is_error,
    }
}

/// The blocks of a `{"content":[Block],"is_error"?}` answer, if stdout is one (complete) answer.
/// Other keys are ignored.
fn structured(text: &str, truncated: bool) -> Option<(Vec<Block>, bool)> {
    if truncated {
        return None;
    }
    let Ok(Value::Object(mut answer)) = serde_json::from_str::<Value>(text) else {
        return None;
    };
    let is_error = match answer.get("is_error") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(is_error)) => *is_error,
        Some(_) => return None,
    };
    let blocks = serde_json::from_value::<Vec<Block>>(answer.remove("content")?).ok()?;
    Some((blocks, is_error))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn defaults_fill_what_the_configuration_leaves_out() {
        let tools = parse_configuration(
            &config(json!({"tools": {"t": {"command": ["true"]}}})),
            LOCAL_KEYS,
        )
        .expect("valid");
        assert_eq!(
            tools["t"],
            ToolSpec {
                command: vec!["true".into()],
                timeout_ms: DEFAULT_TIMEOUT_MS,
                max_output_bytes: 1 << 20,
            }
        );
    }

    #[test]
    fn a_head_capture_keeps_the_first_bytes_and_never_cuts_a_character() {
        let mut capture = Capture::head(4);
        capture.push("abé".as_bytes());
        capture.push("xyz".as_bytes());
        assert!(capture.truncated());
        assert_eq!(capture.total, 7);
        assert_eq!(capture.text(), "abé");
        let mut capture = Capture::head(3);
        capture.push("abé".as_bytes());
        assert_eq!(capture.text(), "ab");
        let mut exact = Capture::head(3);
        exact.push(b"abc");
        assert!(!exact.truncated());
        assert_eq!(exact.text(), "abc");
    }

    #[test]
    fn a_tail_capture_keeps_the_last_bytes() {
        let mut capture = Capture::tail(4);
        for chunk in ["one ", "two ", "three ", "éfin"] {
            capture.push(chunk.as_bytes());
        }
        assert!(capture.truncated());
        assert_eq!(capture.text(), "fin");
        let mut short = Capture::tail(10);
        short.push(b"short");
        assert!(!short.truncated());
        assert_eq!(short.text(), "short");
    }

    #[test]
    fn only_a_well_formed_answer_is_structured() {
        assert_eq!(
            structured(
                r#"{"content":[{"type":"text","text":"x"}],"is_error":true}"#,
                false
            ),
            Some((vec![Block::text("x")], true))
        );
        assert_eq!(
            structured(r#"{"content":[]}"#, false),
            Some((vec![], false))
        );
        assert_eq!(structured(r#"{"content":[]}"#, true), None);
        assert_eq!(structured(r#"{"content":"x"}"#, false), None);
        assert_eq!(
            structured(r#"{"content":[],"is_error":"yes"}"#, false),
            None
        );
        assert_eq!(structured(r#"[1]"#, false), None);
        assert_eq!(structured("plain", false), None);
    }
}
