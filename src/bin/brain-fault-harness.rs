//! brain-fault-harness: a harness that misbehaves on request, for Brain's tests.
//!
//! Without flags it is a correct harness (identity `brain-fault-harness`) whose `run` echoes its
//! params: `{"result":{"echo": <params>}}`. Each flag adds one worker-wide fault; flags combine.
//! Faults that the SDK would refuse to produce (garbage, over-long lines) are written raw.
//! Diagnostics go to stderr only. Unknown arguments print the usage to stderr and exit 2.
//!
//! # Per-session faults
//!
//! Each `run` also picks its own behaviour from the run input's merged configuration key `fault`
//! (`params.input.configuration.fault`, a string), so one worker serves well-behaved and faulty
//! sessions at once. Other configuration keys the modes read are named with them:
//!
//! - absent or `"echo"`: answer `{"result":{"echo": <params>, "closed": [<every close so far,
//!   as {"session_id","reason"}>]}}`.
//! - `"hang"`: answer nothing until the activation is cancelled, then answer error `cancelled`.
//! - `"ignore_cancel"`: never answer, whatever happens (Brain must kill the worker after the cancel
//!   grace); the worker then outlives the end of its stdin.
//! - `"crash"`: exit the process with status 4 as soon as the run arrives.
//! - `"callbacks_outstanding"`: write the request `call` (`{"method","input"}`, default a `kv.get`
//!   of key `x`) for its own activation, then
//!   answer `{"result":{"ok":true}}` at once without waiting for Brain's answer. The request is
//!   written with an id of its own (`fault-outstanding-<n>`) ahead of the run answer, so Brain
//!   always sees it first; Brain's later answer to it is logged by the SDK as unexpected.
//! - `"foreign_callback"`: call `kv.put` `{"key":"k","value":1}` naming `target_session` (string)
//!   and `target_sequence` (integer) instead of its own activation; answer
//!   `{"result":{"error": <Brain's error code, or null when it succeeded>}}`.
//! - `"callback_after_answer"`: answer `{}`, and once that answer is written send `kv.get` (key `x`)
//!   for its own activation; Brain's answer is logged to stderr as
//!   `late callback answered: <code>` (`ok` when it succeeded). With `exit_with_answer: true` the
//!   process then exits with status 5 when the answer was `activation_closed`, 6 otherwise.
//! - `"fatal_then_succeed"`: call `model` (first waiting for Brain's `cancel` when
//!   `after_cancel` is `true`); when it fails fatally, ignore that and answer
//!   `{"result":{"ignored": <the code>}}` (`null` when the call did not fail fatally).
//! - `"fail"`: answer `run` with an error whose `data.code` is `code` (default `harness_error`).
//! - `"saturate"`: write `count` (default 64) `model` callbacks without awaiting them, then call
//!   `kv.get`; exit with status 7 if Brain refused it `overloaded`, 8 otherwise.
//! - `"complete_on_cancel"`: wait for Brain's `cancel`, then answer with a result anyway.
//! - `"malformed"`: answer `run` with `{"result":"a bare string"}` (bypassing the SDK), then wait
//!   for cancellation.
//! - `"calls"`: perform the callbacks in `calls` — an array of `{"method", "input"}` — in order,
//!   stopping at the first error, and answer `{"result":{"answers":[…], "tools": <input.tools>}}`, one entry per callback
//!   made: its result, or `{"error":{"code","fatal"}}`.
//! - `"slow_calls"`: as `calls`, but waits `delay_ms` (integer) before each callback; a cancel during
//!   a wait answers error `cancelled` at once.
//!
//! With `announce: true` (any mode) the run first emits an event of type `running`, so a host's
//! test can wait until the run is really executing.
//!
//! A `fault` that is not a string or names no mode, and a malformed `calls`, `delay_ms` or target,
//! fail the run with `harness_error`.

use brain::harness::{Activation, CallError, Connection, Handler, HandlerError, serve_connection};
use brain::protocol::harness::{
    Capabilities, Identity, InitializeParams, InitializeResult, PROTOCOL,
};
use nix::sys::signal::{SigSet, Signal};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

const USAGE: &str = "\
usage: brain-fault-harness [FLAG]...
  --never-init                   read stdin, answer nothing, exit at stdin EOF
  --wrong-protocol               answer initialize with protocol brain/harness/v0
  --init-error                   answer initialize with a JSON-RPC error
  --init-delay-ms N              wait N ms before answering initialize
  --crash-after-ms N             exit with status 3 N ms after start
  --crash-once FILE              with --crash-after-ms: crash only if FILE does not exist (creating it)
  --garbage N                    after initialize, write N garbage lines (6 kinds, cycling)
  --invalid-utf8 N               after initialize, write N lines of invalid UTF-8
  --overlong BYTES               after initialize, write one line of BYTES 'x' bytes
  --flood                        after initialize, write noise notifications forever
  --ignore-shutdown              answer shutdown, then never exit (ignores EOF, SIGTERM, SIGINT)
  --grandchild FILE              spawn `sleep 1000`, write \"<pid> <grandchild pid>\" to FILE
  --identity NAME                identity.name (default brain-fault-harness)
  --state-version V              state_version (default 1); {worker} becomes $BRAIN_WORKER
  --state-version-file FILE      read state_version from FILE at initialize (overrides --state-version)
  --configuration-keys a,b       declare configuration_keys
  --required-model-metadata a,b  declare required_model_metadata
  --capability NAME              declare media, transcript_import or fixed_tool_catalogue (repeatable)

Per-session faults: each run reads the string params.input.configuration.fault:
  (absent), echo          answer {\"result\":{\"echo\": <params>}}
  hang                    answer only when cancelled, with error cancelled
  ignore_cancel           never answer; ignore cancel (and stdin EOF)
  crash                   exit with status 4 at once
  callbacks_outstanding   write a kv.get (key x) and answer {\"ok\":true} without awaiting it
  foreign_callback        kv.put {key k, value 1} as target_session/target_sequence;
                          answer {\"error\": <code or null>}
  callback_after_answer   answer {}, then send kv.get (key x); log \"late callback answered: <code>\"
  fatal_then_succeed      call model; ignore a fatal error; answer {\"ignored\": <code or null>}
  calls                   perform configuration.calls [{method, input}] in order, stop at the first
                          error; answer {\"answers\": [<result or {\"error\":{code,fatal}}>]}
  slow_calls              as calls, waiting delay_ms before each (a cancel answers cancelled)";

/// Exit status after `callback_after_answer` with `exit_with_answer`, by Brain's answer.
const LATE_CLOSED_STATUS: i32 = 5;
const LATE_OTHER_STATUS: i32 = 6;

/// Exit statuses of `saturate`: the extra callback was refused `overloaded`, or not.
const SATURATED_STATUS: i32 = 7;
const NOT_SATURATED_STATUS: i32 = 8;

/// Exit status of `--crash-after-ms`.
const CRASH_STATUS: i32 = 3;

/// Exit status of the per-session fault `crash`.
const RUN_CRASH_STATUS: i32 = 4;

/// Bytes per write of `--overlong`: the line is never held whole.
const OVERLONG_CHUNK: usize = 64 * 1024;

/// The six kinds of `--garbage` line, in cycling order.
const GARBAGE: [&[u8]; 6] = [
    b"this is not json",
    b"[1,2,3]",
    b"42",
    br#"{"id":1,"method":"noise","params":{}}"#,
    br#"{"jsonrpc":"2.0","id":999999,"result":{}}"#,
    b"\xff\xfe invalid utf-8 \xc3\x28",
];

/// One line of `--invalid-utf8`.
const INVALID_UTF8: &[u8] = b"\xc3\x28\xa0\xa1 not utf-8 \xff";

#[derive(Debug, Default)]
struct Options {
    never_init: bool,
    wrong_protocol: bool,
    init_error: bool,
    init_delay: Option<Duration>,
    crash_after: Option<Duration>,
    crash_once: Option<PathBuf>,
    garbage: u64,
    invalid_utf8: u64,
    overlong: Option<u64>,
    flood: bool,
    ignore_shutdown: bool,
    grandchild: Option<PathBuf>,
    identity: Option<String>,
    state_version: Option<String>,
    state_version_file: Option<PathBuf>,
    configuration_keys: Option<Vec<String>>,
    required_model_metadata: Vec<String>,
    capabilities: Capabilities,
}

enum Parsed {
    Run(Box<Options>),
    Help,
}

fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Parsed, String> {
    let mut options = Options::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let arg = arg
            .into_string()
            .map_err(|arg| format!("argument is not UTF-8: {arg:?}"))?;
        let mut value = || -> Result<String, String> {
            args.next()
                .ok_or_else(|| format!("{arg} needs a value"))?
                .into_string()
                .map_err(|value| format!("the value of {arg} is not UTF-8: {value:?}"))
        };
        match arg.as_str() {
            "-h" | "--help" => return Ok(Parsed::Help),
            "--never-init" => options.never_init = true,
            "--wrong-protocol" => options.wrong_protocol = true,
            "--init-error" => options.init_error = true,
            "--init-delay-ms" => options.init_delay = Some(millis(&arg, &value()?)?),
            "--crash-after-ms" => options.crash_after = Some(millis(&arg, &value()?)?),
            "--crash-once" => options.crash_once = Some(PathBuf::from(value()?)),
            "--garbage" => options.garbage = number(&arg, &value()?)?,
            "--invalid-utf8" => options.invalid_utf8 = number(&arg, &value()?)?,
            "--overlong" => options.overlong = Some(number(&arg, &value()?)?),
            "--flood" => options.flood = true,
            "--ignore-shutdown" => options.ignore_shutdown = true,
            "--grandchild" => options.grandchild = Some(PathBuf::from(value()?)),
            "--identity" => options.identity = Some(value()?),
            "--state-version" => options.state_version = Some(value()?),
            "--state-version-file" => options.state_version_file = Some(PathBuf::from(value()?)),
            "--configuration-keys" => options.configuration_keys = Some(list(&value()?)),
            "--required-model-metadata" => options.required_model_metadata = list(&value()?),
            "--capability" => match value()?.as_str() {
                "media" => options.capabilities.media = true,
                "transcript_import" => options.capabilities.transcript_import = true,
                "fixed_tool_catalogue" => options.capabilities.fixed_tool_catalogue = true,
                other => return Err(format!("unknown capability: {other}")),
            },
            other => return Err(format!("unknown argument: {other}")),
        }
    }
    if options.crash_once.is_some() && options.crash_after.is_none() {
        return Err("--crash-once needs --crash-after-ms".to_owned());
    }
    Ok(Parsed::Run(Box::new(options)))
}

fn number(flag: &str, value: &str) -> Result<u64, String> {
    value
        .parse()
        .map_err(|_| format!("{flag} needs a non-negative integer, not {value:?}"))
}

fn millis(flag: &str, value: &str) -> Result<Duration, String> {
    number(flag, value).map(Duration::from_millis)
}

fn list(value: &str) -> Vec<String> {
    value
        .split(',')
        .filter(|item| !item.is_empty())
        .map(str::to_owned)
        .collect()
}

fn main() -> ExitCode {
    let started = Instant::now();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .target(env_logger::Target::Stderr)
        .init();
    let options = match parse(std::env::args_os().skip(1)) {
        Ok(Parsed::Run(options)) => options,
        Ok(Parsed::Help) => {
            eprintln!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("brain-fault-harness: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if options.ignore_shutdown {
        // Blocked before any thread starts, so every thread inherits the mask and the signals stay
        // pending forever. Children get a clean mask: std resets it at exec.
        let signals = SigSet::from_iter([Signal::SIGTERM, Signal::SIGINT]);
        if let Err(error) = signals.thread_block() {
            eprintln!("brain-fault-harness: blocking SIGTERM and SIGINT failed: {error}");
            return ExitCode::FAILURE;
        }
    }
    if let Some(file) = &options.grandchild
        && let Err(error) = spawn_grandchild(file)
    {
        eprintln!(
            "brain-fault-harness: --grandchild {}: {error}",
            file.display()
        );
        return ExitCode::FAILURE;
    }
    if let Some(after) = options.crash_after {
        let deadline = started + after;
        let once = options.crash_once.clone();
        let timer = thread::Builder::new()
            .name("fault-crash".into())
            .spawn(move || crash_at(deadline, once.as_deref()));
        if let Err(error) = timer {
            eprintln!("brain-fault-harness: starting the crash timer failed: {error}");
            return ExitCode::FAILURE;
        }
    }
    let ignore_shutdown = options.ignore_shutdown;
    let status = if options.never_init {
        never_init()
    } else {
        serve_faults(*options)
    };
    if ignore_shutdown {
        eprintln!("brain-fault-harness: stdin closed; ignoring it (--ignore-shutdown)");
        loop {
            thread::park();
        }
    }
    status
}

/// `--never-init`: swallow stdin until EOF, answer nothing.
fn never_init() -> ExitCode {
    match io::copy(&mut io::stdin().lock(), &mut io::sink()) {
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("brain-fault-harness: reading stdin failed: {error}");
            ExitCode::FAILURE
        }
    }
}

fn serve_faults(options: Options) -> ExitCode {
    let (connection, threads) = match Connection::stdio() {
        Ok(pair) => pair,
        Err(error) => {
            eprintln!("brain-fault-harness: starting the connection failed: {error}");
            return ExitCode::FAILURE;
        }
    };
    let fault = Fault {
        options,
        connection: connection.clone(),
        raw_ids: AtomicU64::new(1),
        closed: parking_lot::Mutex::new(Vec::new()),
        late: parking_lot::Mutex::new(HashMap::new()),
    };
    serve_connection(&connection, &fault);
    drop(fault);
    connection.close();
    drop(connection);
    match threads.join() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("brain-fault-harness: reading stdin failed: {error}");
            ExitCode::FAILURE
        }
    }
}

/// `--crash-after-ms` (with `--crash-once`): exit 3 at `deadline`, whatever is going on.
fn crash_at(deadline: Instant, once: Option<&Path>) {
    thread::sleep(deadline.saturating_duration_since(Instant::now()));
    if let Some(file) = once {
        match OpenOptions::new().write(true).create_new(true).open(file) {
            Ok(_) => {}
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                eprintln!(
                    "brain-fault-harness: --crash-once {} exists; not crashing",
                    file.display()
                );
                return;
            }
            Err(error) => eprintln!(
                "brain-fault-harness: --crash-once: creating {} failed ({error}); crashing anyway",
                file.display()
            ),
        }
    }
    eprintln!("brain-fault-harness: crashing with status {CRASH_STATUS} (--crash-after-ms)");
    std::process::exit(CRASH_STATUS);
}

/// `--grandchild FILE`: start `sleep 1000` in our process group and record both pids atomically.
fn spawn_grandchild(file: &Path) -> io::Result<()> {
    let mut child = Command::new("sleep")
        .arg("1000")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let pids = format!("{} {}\n", std::process::id(), child.id());
    let mut temporary = file.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, pids)?;
    std::fs::rename(&temporary, file)?;
    // Reap the grandchild if it ever exits while we live; when we die first, init adopts it.
    thread::Builder::new()
        .name("fault-grandchild".into())
        .spawn(move || child.wait())?;
    Ok(())
}

/// The handler: correct by default, faulty where the options or the session's configuration say
/// so.
struct Fault {
    options: Options,
    /// For callbacks that do not belong to the activation at hand (foreign, late, raw).
    connection: Connection,
    /// Numbers the ids of raw `brain/call` lines.
    raw_ids: AtomicU64,
    /// Every `close` received, as `{"session_id","reason"}`, reported by `echo`.
    closed: parking_lot::Mutex<Vec<Value>>,
    /// The late callbacks waiting for their activation's answer, by (session, sequence): dropping
    /// the sender (in [`Handler::answered`]) lets the late thread go.
    late: parking_lot::Mutex<HashMap<(String, u64), crossbeam_channel::Sender<()>>>,
}

impl Handler for Fault {
    fn initialize(&self, _: &InitializeParams) -> Result<InitializeResult, HandlerError> {
        let options = &self.options;
        if let Some(delay) = options.init_delay {
            thread::sleep(delay);
        }
        if options.init_error {
            return Err(HandlerError::harness("initialize refused (--init-error)"));
        }
        let protocol = if options.wrong_protocol {
            "brain/harness/v0"
        } else {
            PROTOCOL
        };
        let worker = std::env::var("BRAIN_WORKER").unwrap_or_default();
        let from_file = match &options.state_version_file {
            Some(file) => Some(std::fs::read_to_string(file).map_err(|error| {
                HandlerError::harness(format!("--state-version-file {}: {error}", file.display()))
            })?),
            None => None,
        };
        let state_version = from_file
            .as_deref()
            .map(str::trim)
            .or(options.state_version.as_deref())
            .unwrap_or("1")
            .replace("{worker}", &worker);
        Ok(InitializeResult {
            protocol: protocol.to_owned(),
            identity: Identity {
                name: options
                    .identity
                    .clone()
                    .unwrap_or_else(|| "brain-fault-harness".to_owned()),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            },
            state_version,
            capabilities: options.capabilities.clone(),
            configuration_keys: options.configuration_keys.clone(),
            required_model_metadata: options.required_model_metadata.clone(),
        })
    }

    fn initialized(&self, connection: &Connection) {
        let options = &self.options;
        let garbage = GARBAGE.iter().cycle().take(saturate(options.garbage));
        let invalid = std::iter::repeat_n(INVALID_UTF8, saturate(options.invalid_utf8));
        for line in garbage.copied().chain(invalid) {
            if connection.send_raw_line(line.to_vec()).is_err() {
                return;
            }
        }
        if let Some(bytes) = options.overlong
            && let Err(error) = write_overlong(connection, bytes)
        {
            eprintln!("brain-fault-harness: --overlong: {error}");
            return;
        }
        if options.flood {
            let connection = connection.clone();
            let flood = thread::Builder::new()
                .name("fault-flood".into())
                .spawn(move || flood(&connection));
            if let Err(error) = flood {
                eprintln!("brain-fault-harness: --flood: starting the thread failed: {error}");
            }
        }
    }

    fn run(&self, activation: &Activation) -> Result<Option<Value>, HandlerError> {
        let configuration = activation
            .params()
            .pointer("/input/configuration")
            .cloned()
            .unwrap_or(Value::Null);
        let mode = match configuration.get("fault") {
            None => "echo",
            Some(Value::String(mode)) => mode.as_str(),
            Some(other) => {
                return Err(HandlerError::harness(format!(
                    "configuration.fault must be a string, not {other}"
                )));
            }
        };
        if configuration.get("announce") == Some(&Value::Bool(true)) {
            // Lets a host's test wait until this run is really executing.
            activation.call("emit", json!({"type": "running", "data": {}}))?;
        }
        match mode {
            "echo" => Ok(Some(json!({
                "echo": activation.params(),
                "closed": *self.closed.lock(),
            }))),
            "hang" => {
                activation.cancel_token().wait();
                Err(HandlerError::cancelled())
            }
            "ignore_cancel" => {
                eprintln!(
                    "brain-fault-harness: activation {} of {} will never answer (ignore_cancel)",
                    activation.sequence(),
                    activation.session_id()
                );
                loop {
                    thread::park();
                }
            }
            "crash" => {
                eprintln!(
                    "brain-fault-harness: crashing with status {RUN_CRASH_STATUS} (fault crash)"
                );
                std::process::exit(RUN_CRASH_STATUS);
            }
            "callbacks_outstanding" => self.callbacks_outstanding(activation, &configuration),
            "foreign_callback" => self.foreign_callback(&configuration),
            "callback_after_answer" => self.callback_after_answer(activation, &configuration),
            "fatal_then_succeed" => fatal_then_succeed(activation, &configuration),
            "fail" => Err(HandlerError::new(
                configuration
                    .get("code")
                    .and_then(Value::as_str)
                    .unwrap_or("harness_error"),
                "failed on purpose (fault fail)",
            )),
            "saturate" => self.saturate(activation, &configuration),
            "complete_on_cancel" => {
                activation.cancel_token().wait();
                Ok(Some(json!({"completed_after_cancel": true})))
            }
            "malformed" => {
                // The SDK always nests `run` answers correctly; a malformed one must bypass it.
                // The SDK numbers nothing here: Brain's id for this run is in the params' echo
                // only as the request id, which the activation exposes.
                let line = format!(
                    r#"{{"jsonrpc":"2.0","id":{},"result":"a bare string"}}"#,
                    activation.request_id()
                );
                self.connection
                    .send_raw_line(line.into_bytes())
                    .map_err(|error| HandlerError::harness(format!("sending: {error}")))?;
                activation.cancel_token().wait();
                Err(HandlerError::cancelled())
            }
            "calls" => calls(activation, &configuration, None),
            "slow_calls" => {
                let delay = configuration
                    .get("delay_ms")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| {
                        HandlerError::harness("slow_calls needs an integer configuration.delay_ms")
                    })?;
                calls(
                    activation,
                    &configuration,
                    Some(Duration::from_millis(delay)),
                )
            }
            other => Err(HandlerError::harness(format!(
                "unknown fault mode: {other}"
            ))),
        }
    }

    fn answered(&self, session_id: &str, sequence: u64) {
        self.late.lock().remove(&(session_id.to_owned(), sequence));
    }

    fn close(&self, session_id: &str, reason: &str) {
        self.closed
            .lock()
            .push(json!({"session_id": session_id, "reason": reason}));
    }

    fn shutdown(&self) {
        if self.options.ignore_shutdown {
            eprintln!("brain-fault-harness: shutdown answered; not exiting (--ignore-shutdown)");
        }
    }
}

fn saturate(count: u64) -> usize {
    usize::try_from(count).unwrap_or(usize::MAX)
}

/// `--overlong`: one line of `bytes` 'x' bytes written straight to stdout, in chunks. Everything
/// the SDK queued before is flushed first; holding stdout's lock keeps SDK lines out of the middle.
fn write_overlong(connection: &Connection, bytes: u64) -> io::Result<()> {
    connection.flush().map_err(io::Error::other)?;
    let chunk = vec![b'x'; OVERLONG_CHUNK];
    let mut out = io::stdout().lock();
    let mut left = bytes;
    while left > 0 {
        let n = usize::try_from(left).map_or(OVERLONG_CHUNK, |left| left.min(OVERLONG_CHUNK));
        out.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    out.write_all(b"\n")?;
    out.flush()
}

/// `--flood`: valid notifications as fast as the pipe takes them, until the writer stops.
fn flood(connection: &Connection) {
    let mut n: u64 = 0;
    loop {
        let line = format!(r#"{{"jsonrpc":"2.0","method":"noise","params":{{"n":{n}}}}}"#);
        if connection.send_raw_line(line.into_bytes()).is_err() {
            return;
        }
        n = n.wrapping_add(1);
    }
}

impl Fault {
    /// `callbacks_outstanding`: queue a `kv.get` line ahead of the run answer and never wait for it.
    ///
    /// Written raw, with an id the SDK does not track, because a tracked call would have to be
    /// awaited; queued on the same writer before `run` returns, so it precedes the answer on stdout.
    fn callbacks_outstanding(
        &self,
        activation: &Activation,
        configuration: &Value,
    ) -> Result<Option<Value>, HandlerError> {
        let call = configuration
            .get("call")
            .cloned()
            .unwrap_or_else(|| json!({"method": "kv.get", "input": {"key": "x"}}));
        let n = self.raw_ids.fetch_add(1, Ordering::Relaxed);
        let request = json!({
            "jsonrpc": "2.0",
            "id": format!("fault-outstanding-{n}"),
            "method": "brain/call",
            "params": {
                "session_id": activation.session_id(),
                "sequence": activation.sequence(),
                "method": call.get("method").cloned().unwrap_or(Value::Null),
                "input": call.get("input").cloned().unwrap_or_else(|| json!({})),
            },
        });
        let line = serde_json::to_vec(&request)
            .map_err(|error| HandlerError::harness(format!("encoding kv.get: {error}")))?;
        self.connection
            .send_raw_line(line)
            .map_err(|error| HandlerError::harness(format!("sending kv.get: {error}")))?;
        Ok(Some(json!({ "ok": true })))
    }

    /// `saturate`: `count` (default 64) raw `model` callbacks that are never awaited, then a
    /// `kv.get` through the SDK; exits with status 7 when Brain refused that one `overloaded`, 8
    /// otherwise (a test observes the exit status, since the activation cannot complete).
    fn saturate(
        &self,
        activation: &Activation,
        configuration: &Value,
    ) -> Result<Option<Value>, HandlerError> {
        let count = configuration
            .get("count")
            .and_then(Value::as_u64)
            .unwrap_or(64);
        for _ in 0..count {
            let n = self.raw_ids.fetch_add(1, Ordering::Relaxed);
            let request = json!({
                "jsonrpc": "2.0",
                "id": format!("fault-saturate-{n}"),
                "method": "brain/call",
                "params": {
                    "session_id": activation.session_id(),
                    "sequence": activation.sequence(),
                    "method": "model",
                    "input": {"messages": []},
                },
            });
            let line = serde_json::to_vec(&request)
                .map_err(|error| HandlerError::harness(format!("encoding: {error}")))?;
            self.connection
                .send_raw_line(line)
                .map_err(|error| HandlerError::harness(format!("sending: {error}")))?;
        }
        let status = match activation.call("kv.get", json!({"key": "x"})) {
            Err(error) if error.code == "overloaded" => SATURATED_STATUS,
            _ => NOT_SATURATED_STATUS,
        };
        eprintln!("brain-fault-harness: saturate: exiting with status {status}");
        std::process::exit(status);
    }

    /// `foreign_callback`: `kv.put` in the name of another activation.
    fn foreign_callback(&self, configuration: &Value) -> Result<Option<Value>, HandlerError> {
        let session = configuration.get("target_session").and_then(Value::as_str);
        let sequence = configuration.get("target_sequence").and_then(Value::as_u64);
        let (Some(session), Some(sequence)) = (session, sequence) else {
            return Err(HandlerError::harness(
                "foreign_callback needs a string target_session and an integer target_sequence",
            ));
        };
        let answer =
            self.connection
                .call(session, sequence, "kv.put", json!({"key": "k", "value": 1}));
        let error = answer.err().map(|error| error.code);
        Ok(Some(json!({ "error": error })))
    }

    /// `callback_after_answer`: a `kv.get` for this activation sent after its run answer.
    ///
    /// The SDK queues the answer right after [`Handler::run`] returns and then calls
    /// [`Handler::answered`], which drops the sender the late thread waits on; a flush then makes
    /// sure the answer has been written before the callback is sent.
    fn callback_after_answer(
        &self,
        activation: &Activation,
        configuration: &Value,
    ) -> Result<Option<Value>, HandlerError> {
        let exit_with_answer = configuration.get("exit_with_answer") == Some(&Value::Bool(true));
        let (answered_tx, answered_rx) = crossbeam_channel::bounded::<()>(0);
        let connection = self.connection.clone();
        let session = activation.session_id().to_owned();
        let sequence = activation.sequence();
        self.late
            .lock()
            .insert((session.clone(), sequence), answered_tx);
        let late = thread::Builder::new()
            .name(format!("fault-late-{sequence}"))
            .spawn(move || {
                // Disconnected (never a message) once the run has been answered.
                let _ = answered_rx.recv();
                if let Err(error) = connection.flush() {
                    eprintln!("brain-fault-harness: flushing before the late callback: {error}");
                    return;
                }
                let code = match connection.call(&session, sequence, "kv.get", json!({"key": "x"}))
                {
                    Ok(_) => "ok".to_owned(),
                    Err(error) => error.code,
                };
                eprintln!("late callback answered: {code}");
                if exit_with_answer {
                    // Lets a host's test observe the answer through the worker's exit status.
                    std::process::exit(if code == "activation_closed" {
                        LATE_CLOSED_STATUS
                    } else {
                        LATE_OTHER_STATUS
                    });
                }
            });
        if let Err(error) = late {
            self.late
                .lock()
                .remove(&(activation.session_id().to_owned(), sequence));
            return Err(HandlerError::harness(format!(
                "starting the late callback's thread failed: {error}"
            )));
        }
        Ok(None)
    }
}

/// `fatal_then_succeed`: a `model` call whose fatal failure is swallowed. With
/// `after_cancel: true` it first waits for Brain's `cancel`, so that the call fails `cancelled`.
fn fatal_then_succeed(
    activation: &Activation,
    configuration: &Value,
) -> Result<Option<Value>, HandlerError> {
    if configuration.get("after_cancel") == Some(&Value::Bool(true)) {
        activation.cancel_token().wait();
    }
    let request = json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "fatal_then_succeed"}]}
    ]});
    let ignored = match activation.call("model", request) {
        Err(error) if error.fatal => Some(error.code),
        _ => None,
    };
    Ok(Some(json!({ "ignored": ignored })))
}

/// `calls` and `slow_calls`: the callbacks of `configuration.calls`, in order, until one fails.
fn calls(
    activation: &Activation,
    configuration: &Value,
    delay: Option<Duration>,
) -> Result<Option<Value>, HandlerError> {
    let planned = configuration
        .get("calls")
        .and_then(Value::as_array)
        .ok_or_else(|| HandlerError::harness("configuration.calls must be an array"))?;
    let mut steps = Vec::with_capacity(planned.len());
    for (index, call) in planned.iter().enumerate() {
        let Some(method) = call.get("method").and_then(Value::as_str) else {
            return Err(HandlerError::harness(format!(
                "configuration.calls[{index}].method must be a string"
            )));
        };
        let input = call.get("input").cloned().unwrap_or_else(|| json!({}));
        steps.push((method, input));
    }
    let mut answers = Vec::with_capacity(steps.len());
    for (method, input) in steps {
        if let Some(delay) = delay
            && activation.cancel_token().wait_timeout(delay)
        {
            return Err(HandlerError::cancelled());
        }
        match activation.call(method, input) {
            Ok(result) => answers.push(result),
            Err(CallError { code, fatal, .. }) => {
                answers.push(json!({"error": {"code": code, "fatal": fatal}}));
                break;
            }
        }
    }
    let tools = activation
        .params()
        .pointer("/input/tools")
        .cloned()
        .unwrap_or(Value::Null);
    Ok(Some(json!({ "answers": answers, "tools": tools })))
}
