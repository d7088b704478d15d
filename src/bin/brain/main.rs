//! The `brain` command.
//!
//! Exit codes are a contract: 0 ok, 1 not ready / failed, 2 usage, 78 configuration refused.

mod client;
mod router;
mod serve;

use brain::effects::{Effects, LocalDriver, SandboxDriver, ScriptedProvider};
use brain::protocol::harness::{Block, UserInput};
use brain::session::{CreateSession, SessionId};
use brain::{
    Brain, Config, Options, OutcomeKind, Registration, Registrations, Storage, WorkerState,
};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

const USAGE: &str = "\
usage: brain <command> [options]

commands:
  serve     run the server: the HTTP API over a durable Brain; SIGTERM/SIGINT drain, a second
            signal skips the drain
  ready     exit 0 when the server at --listen is ready (a probe)
  sessions  list | show ID | events ID [AFTER] | cancel ID | close ID | delete ID, against the
            server at --listen (token from BRAIN_API_TOKEN or <data-dir>/operator.token)
  router-config --instance NAME=HOST:PORT ... [--listen ADDR]: print the nginx configuration
            routing to these named instances (docs/SCALING.md)
  journal   DATA_DIR SESSION_ID [--json]: print a session's records offline, read-only (safe
            beside a running server)
  run       start Brain, create a session (or continue --session), send MESSAGE, print the
            activation's result or error, stop. Exit 0 completed, 1 failed or cancelled.
  check     validate registrations, start every worker, report each, stop them
            (takes no lock and writes nothing: safe beside a running server)

brain run [options] [--agentloop NAME] [--session ID] [--script FILE] [--json] MESSAGE
  --agentloop NAME           the registration to run (default: the only one, else reference)
  --session ID               continue this session instead of creating one
  --script FILE              a JSON list of model results for the scripted provider
  --model PROVIDER:NAME      the session's model; openai and anthropic need OPENAI_API_KEY /
                             ANTHROPIC_API_KEY in Brain's env. Default: scripted:default with a
                             200000-token context window and 8192 output tokens, so that a
                             harness requiring that metadata (Pi) runs without --model
  --model JSON               the whole model object, e.g. with context_window and
                             max_output_tokens for a harness that requires them
  --json                     print one JSON object: session_id, sequence, outcome, result|error

brain serve [options] [--listen ADDR] [--drain DURATION] [--script FILE] [--log-format json]
  --listen ADDR              where to serve (default 127.0.0.1:3210)
  --drain DURATION           how long running activations may finish at shutdown (default 30s)
  --http-threads N           HTTP request threads (default 16)
  --http-queue N             requests ready for a thread that may wait for one; past it 503
                             overloaded (default 64)
  --http-read-timeout DURATION
                             the time a client has to send a whole request, head and body
                             (default 30s; then 408)

brain ready [--listen ADDR]
brain sessions [--listen ADDR] [--data-dir DIR] SUBCOMMAND ...
brain sessions list --instance NAME=HOST:PORT ...: every instance's listing, merged (one token)

brain check [options] [--json]
  --json                     print the report as JSON

options (serve, run, check):
  --agentloops FILE|JSON     registrations (default: $BRAIN_AGENTLOOPS, else the bundled
                             reference harness)
  --data-dir DIR             data directory (default ./brain-data)
  --instance NAME            (serve) this instance's name behind a router, 1-4 letters or
                             digits: recorded in the data directory, carried by session ids
  --init-deadline DURATION   initialize deadline (default 30s)
  --cancel-grace DURATION    grace before a kill after cancel or shutdown (default 5s)
  --max-line-bytes N         line limit (default 16777216)
  --restart-budget N         failures per window before quarantine (default 5)
  --restart-window DURATION  restart budget window (default 60s)
  --respawn-backoff DURATION first respawn delay (default 100ms)
  --respawn-backoff-max DURATION  longest respawn delay (default 30s)
  --workspace-root DIR       an absolute directory inside which an environment's configuration
                             may name its `workspace` (repeatable; default: none)
  --no-sandbox               (serve, run) start without the `sandbox` tool driver; by default
                             bubblewrap must work here, or the start is refused (78)

Durations are written like 200ms, 30s or 5m.
";

/// Exit code for refused configuration (sysexits EX_CONFIG).
const EXIT_CONFIG: u8 = 78;
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    // SAFETY: the first statement of main: no other thread exists yet.
    unsafe { brain::hardening::harden() };
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("check") => check(&args[1..]),
        Some("run") => run(&args[1..]),
        Some("serve") => serve_command(&args[1..]),
        Some("ready") => ready_command(&args[1..]),
        Some("sessions") => sessions_command(&args[1..]),
        Some("journal") => journal_command(&args[1..]),
        Some("router-config") => router_command(&args[1..]),
        Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => usage_error(&format!("unknown command {other:?}")),
        None => usage_error("no command given"),
    }
}

fn usage_error(message: &str) -> ExitCode {
    eprintln!("brain: {message}\n\n{USAGE}");
    ExitCode::from(EXIT_USAGE)
}

fn init_logging(default: &str) {
    init_logging_as(default, false);
}

/// Logs to stderr through env_logger (`RUST_LOG`); `json` writes one JSON object a line.
fn init_logging_as(default: &str, json: bool) {
    let mut builder =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default));
    builder
        .format_timestamp_millis()
        // The HTTP client's protocol layer dumps raw requests (provider keys included) at trace.
        .filter_module("ureq_proto", log::LevelFilter::Debug);
    if json {
        builder.format(|out, record| {
            use std::io::Write;
            let millis = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            let line = serde_json::json!({
                "ts_ms": millis as u64,
                "level": record.level().as_str(),
                "target": record.target(),
                "thread": std::thread::current().name().unwrap_or(""),
                "message": record.args().to_string(),
            });
            writeln!(out, "{line}")
        });
    }
    builder.init();
}

/// Starts Brain from a full configuration or reports why not, as an exit code.
fn start_config(config: Config) -> Result<Brain, ExitCode> {
    Brain::start(config).map_err(|error| report_start_error(&error))
}

/// Reports a refused start and turns it into its exit code (78 for refused configuration).
fn report_start_error(error: &brain::StartError) -> ExitCode {
    if error.is_configuration() {
        eprintln!("brain: configuration refused: {error}");
        ExitCode::from(EXIT_CONFIG)
    } else {
        eprintln!("brain: {error}");
        ExitCode::FAILURE
    }
}

const DEFAULT_LISTEN: &str = "127.0.0.1:3210";

fn serve_command(args: &[String]) -> ExitCode {
    let (common, rest) = match parse_common(args) {
        Ok(parsed) => parsed,
        Err(message) => return usage_error(&message),
    };
    let (mut listen, mut drain, mut script, mut json_logs) = (
        DEFAULT_LISTEN.to_owned(),
        Duration::from_secs(30),
        None,
        false,
    );
    let mut http = brain::http::HttpOptions::default();
    let mut rest = rest.into_iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--listen"
            | "--drain"
            | "--script"
            | "--log-format"
            | "--http-threads"
            | "--http-queue"
            | "--http-read-timeout" => {
                let Some(value) = rest.next() else {
                    return usage_error(&format!("{arg} needs a value"));
                };
                let positive = |value: &str| match number::<usize>(&arg, value) {
                    Ok(0) => Err(format!("{arg}: must be at least 1")),
                    parsed => parsed,
                };
                let set = match arg.as_str() {
                    "--listen" => {
                        listen = value;
                        Ok(())
                    }
                    "--drain" => duration(&arg, &value).map(|d| drain = d),
                    "--script" => {
                        script = Some(value);
                        Ok(())
                    }
                    "--http-threads" => positive(&value).map(|n| http.threads = n),
                    "--http-queue" => positive(&value).map(|n| http.accept_queue = n),
                    "--http-read-timeout" => match duration(&arg, &value) {
                        Ok(Duration::ZERO) => Err(format!("{arg}: must be longer than 0")),
                        parsed => parsed.map(|d| http.read_timeout = d),
                    },
                    _ => match value.as_str() {
                        "json" | "text" => {
                            json_logs = value == "json";
                            Ok(())
                        }
                        other => Err(format!("--log-format: {other:?} is not json or text")),
                    },
                };
                if let Err(message) = set {
                    return usage_error(&message);
                }
            }
            "-h" | "--help" => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => return usage_error(&format!("serve: unknown argument {other:?}")),
        }
    }
    init_logging_as("info", json_logs);
    let registrations = match registrations(common.agentloops.as_deref()) {
        Ok(registrations) => registrations,
        Err(code) => return code,
    };
    let effects = match effects_with_script(script.as_deref(), &common) {
        Ok(effects) => effects,
        Err(code) => return code,
    };
    let mut config = Config::new(registrations);
    config.options = common.options;
    config.effects = effects;
    config.storage = Storage::DataDir;
    serve::serve(serve::Serve {
        config,
        listen,
        drain,
        http,
    })
}

fn listen_and_rest(args: &[String]) -> Result<(String, std::path::PathBuf, Vec<String>), String> {
    let (mut listen, mut data_dir, mut rest) = (
        DEFAULT_LISTEN.to_owned(),
        std::path::PathBuf::from("brain-data"),
        Vec::new(),
    );
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => listen = args.next().ok_or("--listen needs a value")?.clone(),
            "--data-dir" => {
                data_dir = std::path::PathBuf::from(args.next().ok_or("--data-dir needs a value")?)
            }
            _ => rest.push(arg.clone()),
        }
    }
    Ok((listen, data_dir, rest))
}

fn journal_command(args: &[String]) -> ExitCode {
    let mut json = false;
    let mut positional = Vec::new();
    for arg in args {
        match arg.as_str() {
            "--json" => json = true,
            "-h" | "--help" => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other if other.starts_with("--") => {
                return usage_error(&format!("journal: unknown argument {other:?}"));
            }
            _ => positional.push(arg.clone()),
        }
    }
    let [data_dir, session] = positional.as_slice() else {
        return usage_error("journal: give DATA_DIR and SESSION_ID");
    };
    let session = match SessionId::parse(session) {
        Ok(session) => session,
        Err(why) => return usage_error(&format!("journal: {why}")),
    };
    let journal_dir = std::path::Path::new(data_dir).join("journal");
    let journal = match brain::journal::DiskJournal::open_read_only(&journal_dir) {
        Ok(journal) => journal,
        Err(error) => {
            eprintln!("brain: {error}");
            return ExitCode::FAILURE;
        }
    };
    let records = match brain::journal::Journal::read(&journal, &session, 0, usize::MAX) {
        Ok(records) => records,
        Err(error) => {
            eprintln!("brain: session {session}: {error}");
            return ExitCode::FAILURE;
        }
    };
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for record in records {
        let line = if json {
            match serde_json::to_string(&record) {
                Ok(line) => line,
                Err(error) => {
                    eprintln!("brain: rendering record {}: {error}", record.sequence);
                    return ExitCode::FAILURE;
                }
            }
        } else {
            let mut data = record.data.to_string();
            if data.len() > 200 {
                let mut end = 200;
                while !data.is_char_boundary(end) {
                    end -= 1;
                }
                data.truncate(end);
                data.push('…');
            }
            format!(
                "{:>6}  {:>13}  {:<20}  {data}",
                record.sequence, record.recorded_at_ms, record.event_type
            )
        };
        // A reader that went away (`brain journal … | head`) is not an error.
        if let Err(error) = writeln!(out, "{line}") {
            if error.kind() == std::io::ErrorKind::BrokenPipe {
                return ExitCode::SUCCESS;
            }
            eprintln!("brain: writing: {error}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// The `--instance NAME=HOST:PORT` arguments (each name once) and the rest.
fn instances_and_rest(args: &[String]) -> Result<(Vec<router::Instance>, Vec<String>), String> {
    let (mut instances, mut rest): (Vec<router::Instance>, _) = (Vec::new(), Vec::new());
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if arg != "--instance" {
            rest.push(arg.clone());
            continue;
        }
        let instance = router::parse_instance(args.next().ok_or("--instance needs a value")?)?;
        if instances.iter().any(|i| i.name == instance.name) {
            return Err(format!("instance {} given twice", instance.name));
        }
        instances.push(instance);
    }
    Ok((instances, rest))
}

fn router_command(args: &[String]) -> ExitCode {
    let (instances, rest) = match instances_and_rest(args) {
        Ok(parsed) => parsed,
        Err(message) => return usage_error(&format!("router-config: {message}")),
    };
    let listen = match rest.as_slice() {
        [] => "8080".to_owned(),
        [flag, listen] if flag == "--listen" => listen.clone(),
        [flag] if flag == "--listen" => {
            return usage_error("router-config: --listen needs a value");
        }
        other => return usage_error(&format!("router-config: unknown argument {:?}", other[0])),
    };
    if instances.is_empty() {
        return usage_error("router-config: at least one --instance NAME=HOST:PORT is needed");
    }
    print!("{}", router::render(&instances, &listen));
    ExitCode::SUCCESS
}

fn ready_command(args: &[String]) -> ExitCode {
    match listen_and_rest(args) {
        Ok((listen, _, rest)) if rest.is_empty() => client::ready(&listen),
        Ok((_, _, rest)) => usage_error(&format!("ready: unknown argument {:?}", rest[0])),
        Err(message) => usage_error(&message),
    }
}

fn sessions_command(args: &[String]) -> ExitCode {
    let (listen, data_dir, rest) = match listen_and_rest(args) {
        Ok(parsed) => parsed,
        Err(message) => return usage_error(&message),
    };
    let (instances, rest) = match instances_and_rest(&rest) {
        Ok(parsed) => parsed,
        Err(message) => return usage_error(&format!("sessions: {message}")),
    };
    let outcome = match (rest.first().map(String::as_str), instances.is_empty()) {
        (_, true) => client::sessions(&listen, &data_dir, &rest),
        (Some("list"), false) if rest.len() == 1 => client::list_merged(&instances, &data_dir),
        _ => return usage_error("sessions: --instance goes with `list` alone"),
    };
    match outcome {
        Ok(code) => code,
        Err(client::Failure::Usage(message)) => usage_error(&message),
        Err(client::Failure::Other(message)) => {
            eprintln!("brain: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The default effects, the providers whose keys are set, `--script` when given, the `local`
/// driver with the `--workspace-root`s and, unless `--no-sandbox`, the `sandbox` driver: when
/// bubblewrap cannot sandbox here, the start is refused (78) rather than run tools unconfined.
fn effects_with_script(script: Option<&str>, common: &Common) -> Result<Effects, ExitCode> {
    let mut effects = Effects::default().with_env_providers().with_driver(
        LocalDriver::NAME,
        Arc::new(LocalDriver::with_workspace_roots(
            common.workspace_roots.clone(),
        )),
    );
    if common.sandbox {
        match SandboxDriver::probe() {
            Ok(driver) => {
                let driver = driver.with_workspace_roots(common.workspace_roots.clone());
                effects = effects.with_driver(SandboxDriver::NAME, Arc::new(driver));
            }
            Err(why) => {
                eprintln!(
                    "brain: configuration refused: the sandbox driver cannot run here: {why}; \
                     start with --no-sandbox to serve without it (sessions naming it are then \
                     refused)"
                );
                return Err(ExitCode::from(EXIT_CONFIG));
            }
        }
    }
    match script {
        None => Ok(effects),
        Some(script) => match ScriptedProvider::load(script) {
            Ok(provider) => Ok(effects.with_provider("scripted", Arc::new(provider))),
            Err(why) => {
                eprintln!("brain: configuration refused: --script: {why}");
                Err(ExitCode::from(EXIT_CONFIG))
            }
        },
    }
}

/// Options shared by the commands that start workers.
struct Common {
    agentloops: Option<String>,
    options: Options,
    /// `--workspace-root`: where an environment's `workspace` may point.
    workspace_roots: Vec<PathBuf>,
    /// Whether the `sandbox` driver is registered (bubblewrap must work); `--no-sandbox` clears.
    sandbox: bool,
}

/// Parses the common flags out of `args`, returning the ones it does not know.
fn parse_common(args: &[String]) -> Result<(Common, Vec<String>), String> {
    let mut common = Common {
        agentloops: None,
        options: Options::default(),
        workspace_roots: Vec::new(),
        sandbox: true,
    };
    let mut rest = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag, Some(value.to_owned())),
            _ => (arg.as_str(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next().cloned())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let o = &mut common.options;
        match flag {
            "--agentloops" => common.agentloops = Some(value()?),
            "--no-sandbox" => common.sandbox = false,
            "--workspace-root" => {
                let root = PathBuf::from(value()?);
                if !root.is_absolute() {
                    return Err(format!(
                        "--workspace-root: {} is not an absolute path",
                        root.display()
                    ));
                }
                common.workspace_roots.push(root);
            }
            "--data-dir" => o.data_dir = PathBuf::from(value()?),
            "--instance" => {
                let name = value()?;
                o.instance = Some(
                    brain::session::InstanceName::parse(&name)
                        .map_err(|error| format!("--instance: {error}"))?,
                );
            }
            "--init-deadline" => o.init_deadline = duration(flag, &value()?)?,
            "--cancel-grace" => o.cancel_grace = duration(flag, &value()?)?,
            "--max-line-bytes" => o.max_line_bytes = number(flag, &value()?)?,
            "--restart-budget" => o.restart_budget = number(flag, &value()?)?,
            "--restart-window" => o.restart_window = duration(flag, &value()?)?,
            "--respawn-backoff" => o.respawn_backoff = duration(flag, &value()?)?,
            "--respawn-backoff-max" => o.respawn_backoff_max = duration(flag, &value()?)?,
            _ => rest.push(arg.clone()),
        }
    }
    Ok((common, rest))
}

fn number<T: std::str::FromStr>(flag: &str, text: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{flag}: {text:?} is not a valid number"))
}

/// Parses `200ms`, `30s`, `5m`; a bare number is seconds.
fn duration(flag: &str, text: &str) -> Result<Duration, String> {
    let (digits, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, ""), |at| text.split_at(at));
    let amount: u64 = digits
        .parse()
        .map_err(|_| format!("{flag}: {text:?} is not a duration like 200ms, 30s or 5m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(amount)),
        "" | "s" => Ok(Duration::from_secs(amount)),
        "m" => Ok(Duration::from_secs(amount.saturating_mul(60))),
        _ => Err(format!(
            "{flag}: {text:?} is not a duration like 200ms, 30s or 5m"
        )),
    }
}

/// The registrations from `--agentloops`, `BRAIN_AGENTLOOPS`, or the embedded default: one
/// registration `reference` running the reference harness installed beside this executable.
/// A refusal is reported and becomes exit code 78.
fn registrations(flag: Option<&str>) -> Result<Registrations, ExitCode> {
    embedded_or(flag).map_err(|message| {
        eprintln!("brain: configuration refused: {message}");
        ExitCode::from(EXIT_CONFIG)
    })
}

fn embedded_or(flag: Option<&str>) -> Result<Registrations, String> {
    if let Some(registrations) =
        Registrations::from_flag_or_env(flag).map_err(|error| error.to_string())?
    {
        return Ok(registrations);
    }
    let exe = std::env::current_exe()
        .map_err(|error| format!("locating the brain executable: {error}"))?;
    let harness = exe.with_file_name("brain-reference-harness");
    Registrations::from_vec(vec![Registration::new(
        "reference",
        harness.to_string_lossy(),
    )])
    .map_err(|error| error.to_string())
}

/// Starts Brain or reports why not, as an exit code.
fn start_brain(
    registrations: Registrations,
    options: Options,
    effects: Effects,
    storage: Storage,
) -> Result<Brain, ExitCode> {
    let mut config = Config::new(registrations);
    config.options = options;
    config.effects = effects;
    config.storage = storage;
    start_config(config)
}

fn run(args: &[String]) -> ExitCode {
    let (common, rest) = match parse_common(args) {
        Ok(parsed) => parsed,
        Err(message) => return usage_error(&message),
    };
    let (mut json, mut agentloop, mut session, mut script, mut message) =
        (false, None, None, None, None);
    let mut model = None;
    let mut rest = rest.into_iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--agentloop" | "--session" | "--script" | "--model" => {
                let Some(value) = rest.next() else {
                    return usage_error(&format!("{arg} needs a value"));
                };
                match arg.as_str() {
                    "--agentloop" => agentloop = Some(value),
                    "--session" => session = Some(value),
                    // A JSON object is the whole model selection, metadata included (e.g.
                    // context_window for a harness that requires it); CreateSession checks it.
                    "--model" if value.trim_start().starts_with('{') => {
                        match serde_json::from_str::<serde_json::Value>(&value) {
                            Ok(object @ serde_json::Value::Object(_)) => model = Some(object),
                            _ => {
                                return usage_error(&format!(
                                    "--model: {value:?} is not a JSON object"
                                ));
                            }
                        }
                    }
                    "--model" => match value.split_once(':') {
                        Some((provider, name)) if !provider.is_empty() && !name.is_empty() => {
                            model = Some(serde_json::json!({"provider": provider, "name": name}));
                        }
                        _ => {
                            return usage_error(&format!(
                                "--model: {value:?} is not PROVIDER:NAME (e.g. openai:gpt-5-mini)"
                            ));
                        }
                    },
                    _ => script = Some(value),
                }
            }
            "-h" | "--help" => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other if other.starts_with("--") => {
                return usage_error(&format!("run: unknown argument {other:?}"));
            }
            _ if message.is_some() => return usage_error("run: give exactly one MESSAGE"),
            _ => message = Some(arg),
        }
    }
    let Some(message) = message else {
        return usage_error("run: no MESSAGE given");
    };
    let session = match session.map(|id| SessionId::parse(&id)).transpose() {
        Ok(session) => session,
        Err(why) => return usage_error(&format!("run: --session: {why}")),
    };
    init_logging("warn");
    let registrations = match registrations(common.agentloops.as_deref()) {
        Ok(registrations) => registrations,
        Err(code) => return code,
    };
    let name = match agentloop {
        Some(name) => name,
        None if registrations.len() == 1 => match registrations.iter().next() {
            Some(only) => only.name.clone(),
            None => return usage_error("run: no registration"),
        },
        None => "reference".to_owned(),
    };
    let effects = match effects_with_script(script.as_deref(), &common) {
        Ok(effects) => effects,
        Err(code) => return code,
    };
    let grace = common.options.cancel_grace;
    let brain = match start_brain(registrations, common.options, effects, Storage::DataDir) {
        Ok(brain) => brain,
        Err(code) => return code,
    };
    let outcome = turn(&brain, &name, model, session.as_ref(), &message);
    brain.shutdown(grace);
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(error) => {
            if json {
                println!(
                    "{}",
                    serde_json::json!({"outcome": "refused", "error": error})
                );
            } else {
                eprintln!("brain: {error}");
            }
            return ExitCode::FAILURE;
        }
    };
    if json {
        match serde_json::to_string(&outcome) {
            Ok(text) => println!("{text}"),
            Err(error) => {
                eprintln!("brain: rendering the outcome: {error}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        match (&outcome.result, &outcome.error) {
            (_, Some(error)) => eprintln!(
                "brain: activation {} {}: {}: {}",
                outcome.sequence,
                outcome.outcome.as_str(),
                error.code,
                error.message
            ),
            (Some(result), None) => match result.get("text").and_then(|t| t.as_str()) {
                Some(text) => println!("{text}"),
                None => println!("{result}"),
            },
            (None, None) => {}
        }
        eprintln!(
            "session {} activation {}",
            outcome.session_id, outcome.sequence
        );
    }
    if outcome.outcome == OutcomeKind::Completed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// One turn: create (or find) the session, send the message, wait for the outcome.
fn turn(
    brain: &Brain,
    agentloop: &str,
    model: Option<serde_json::Value>,
    session: Option<&SessionId>,
    message: &str,
) -> Result<brain::Outcome, brain::ApiError> {
    let session = match session {
        Some(id) => brain.session(id),
        None => {
            let model = model.unwrap_or_else(|| {
                // The scripted provider has no limits; stating some lets `brain run` drive a
                // harness that requires model metadata (Pi) without a --model. Sessions created
                // through the API or the library get no metadata unless they ask for it.
                serde_json::json!({"provider": "scripted", "name": "default",
                                   "context_window": 200_000, "max_output_tokens": 8_192})
            });
            let body = serde_json::json!({"agentloop": {"name": agentloop}, "model": model});
            let request = CreateSession::parse(body.to_string().as_bytes())
                .map_err(|error| brain::ApiError::new(error.code, error.message))?;
            brain.create_session(request)?
        }
    };
    let activation = session.send(UserInput {
        content: vec![Block::text(message)],
    })?;
    Ok(activation.wait())
}

fn check(args: &[String]) -> ExitCode {
    let (common, rest) = match parse_common(args) {
        Ok(parsed) => parsed,
        Err(message) => return usage_error(&message),
    };
    let mut json = false;
    for arg in rest {
        match arg.as_str() {
            "--json" => json = true,
            "-h" | "--help" => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => return usage_error(&format!("check: unknown argument {other:?}")),
        }
    }
    init_logging("warn");
    let registrations = match registrations(common.agentloops.as_deref()) {
        Ok(registrations) => registrations,
        Err(code) => return code,
    };
    let grace = common.options.cancel_grace;
    // check takes no lock and writes nothing: it is safe beside a running server.
    let brain = match start_brain(
        registrations,
        common.options,
        Effects::default(),
        Storage::Ephemeral,
    ) {
        Ok(brain) => brain,
        Err(code) => return code,
    };
    let status = brain.status();
    brain.shutdown(grace);
    if json {
        match serde_json::to_string_pretty(&serde_json::json!({
            "ready": status.ready(),
            "registrations": status.registrations,
        })) {
            Ok(text) => println!("{text}"),
            Err(error) => {
                eprintln!("brain: rendering the report: {error}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print_table(&status);
    }
    if status.ready() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn print_table(status: &brain::PoolStatus) {
    let mut rows = vec![[
        "REGISTRATION".to_owned(),
        "WORKER".to_owned(),
        "STATE".to_owned(),
        "PID".to_owned(),
        "IDENTITY".to_owned(),
        "STATE_VERSION".to_owned(),
        "INIT_MS".to_owned(),
        "LAST_FAILURE".to_owned(),
    ]];
    for registration in &status.registrations {
        for worker in &registration.workers {
            let init = worker.initialized.as_ref();
            rows.push([
                registration.name.clone(),
                worker.slot.to_string(),
                state_name(worker.state).to_owned(),
                worker.pid.map_or("-".into(), |pid| pid.to_string()),
                init.map_or("-".into(), |i| {
                    format!("{} {}", i.identity.name, i.identity.version)
                }),
                init.map_or("-".into(), |i| i.state_version.clone()),
                worker
                    .init_latency_ms
                    .map_or("-".into(), |ms| format!("{ms:.1}")),
                worker.last_failure.as_ref().map_or("-".into(), |f| {
                    let mut text = format!("{} [{}]", f.reason, f.reason.code());
                    if let Some(exit) = f.exit {
                        text.push_str(&format!("; {exit}"));
                    }
                    text
                }),
            ]);
        }
    }
    let mut widths = [0usize; 8];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:width$}"))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
    println!("ready: {}", if status.ready() { "yes" } else { "no" });
    for registration in &status.registrations {
        for worker in &registration.workers {
            if let Some(failure) = &worker.last_failure
                && !failure.stderr_tail.is_empty()
            {
                println!(
                    "\n{}/{} stderr tail:\n{}",
                    registration.name, worker.slot, failure.stderr_tail
                );
            }
        }
    }
}

fn state_name(state: WorkerState) -> &'static str {
    match state {
        WorkerState::Starting => "starting",
        WorkerState::Healthy => "healthy",
        WorkerState::Failed => "failed",
        WorkerState::Quarantined => "quarantined",
        WorkerState::Stopping => "stopping",
        WorkerState::Stopped => "stopped",
    }
}
