//! Registrations: the name-to-harness map Brain reads at startup.
//!
//! A registration names a harness command and how many workers of it to run. Brain reads the whole
//! map once, before it reports ready, from `--agentloops VALUE` or, when the flag is absent, the
//! `BRAIN_AGENTLOOPS` environment variable. VALUE is inline JSON when it starts with `{` and a path
//! to a JSON file otherwise:
//!
//! ```json
//! {
//!   "pi":   {"command": "node", "args": ["adapters/pi/harness.mjs"], "workers": 2,
//!            "env": {"NODE_OPTIONS": "--max-old-space-size=2048"}},
//!   "echo": {"command": "brain-reference-harness"}
//! }
//! ```
//!
//! Parsing is strict: anything this module does not understand is refused with a [`ConfigError`]
//! that names where the map came from, the registration, the field and the offending value. A
//! [`Registrations`] value therefore always holds at least one registration, and every
//! [`Registration`] in it satisfies every rule listed on [`Registrations::parse`].

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fmt;
use std::io::{self, Read};
use std::marker::PhantomData;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The command-line flag that carries the registrations.
pub const FLAG: &str = "--agentloops";

/// The environment variable read when [`FLAG`] is absent.
pub const ENV_VAR: &str = "BRAIN_AGENTLOOPS";

/// The default number of workers of a registration.
pub const DEFAULT_WORKERS: u32 = 1;

/// The default number of concurrently running activations per worker.
pub const DEFAULT_MAX_CONCURRENCY: u32 = 64;

/// The largest accepted `workers`: a typo must not fork-bomb the host.
pub const MAX_WORKERS: u32 = 256;

/// The largest accepted `max_concurrency`.
pub const MAX_CONCURRENCY: u32 = 65536;

/// The longest accepted registration name, in bytes (names are ASCII).
pub const MAX_NAME_LEN: usize = 64;

/// A registrations file larger than this is refused rather than read into memory.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// How many characters of an offending value an error message shows.
const SHOWN: usize = 100;

/// How many characters of a path an error message shows.
const SHOWN_PATH: usize = 256;

/// How many candidates of a failed `PATH` search an error message lists.
const SHOWN_TRIED: usize = 8;

/// The keys a registration object may contain.
const KEYS: [&str; 8] = [
    "command",
    "args",
    "configuration",
    "workers",
    "max_concurrency",
    "env",
    "cwd",
    "sandbox",
];

/// One named harness command: what to run and how many of it.
///
/// The fields are public so that embedders can read them freely. A `Registration` built by hand is
/// not checked until it goes through [`Registrations::from_vec`]; every `Registration` obtained from
/// a [`Registrations`] satisfies the rules listed on [`Registrations::parse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The registration's name: 1–64 ASCII letters, digits, `_` or `-`. Sessions select a
    /// registration by this name.
    pub name: String,
    /// The command as written in the configuration: non-empty, without NUL bytes. Use
    /// [`Registration::resolve_command`] to turn it into the file to execute.
    pub command: String,
    /// Arguments passed to the command, without NUL bytes. Default: none.
    pub args: Vec<String>,
    /// The deployment configuration handed to the harness. Default: `{}`.
    pub configuration: Map<String, Value>,
    /// How many worker processes to run, from 1 to [`MAX_WORKERS`]. Default: 1.
    pub workers: u32,
    /// How many activations may run at once on one worker, from 1 to [`MAX_CONCURRENCY`].
    /// Default: 64.
    pub max_concurrency: u32,
    /// Extra environment variables for the harness (an extension to the seed). Names are non-empty
    /// and contain neither `=` nor NUL; values contain no NUL. Default: none.
    pub env: BTreeMap<String, String>,
    /// The harness's working directory (an extension to the seed), as written: non-empty, without
    /// NUL bytes. `None`, the default, means Brain's own working directory.
    pub cwd: Option<PathBuf>,
    /// Whether each worker runs under bubblewrap (`"sandbox": true`), seeing its own
    /// `agentloops/<name>/` read-write and nothing else of the data directory (docs/SECURITY.md).
    /// Brain refuses to start when bubblewrap cannot sandbox on the host. Default: false.
    pub sandbox: bool,
}

impl Registration {
    /// A registration running `command` under `name`, with every other field at its default.
    ///
    /// Nothing is checked here; [`Registrations::from_vec`] checks.
    pub fn new(name: impl Into<String>, command: impl Into<String>) -> Registration {
        Registration {
            name: name.into(),
            command: command.into(),
            args: Vec::new(),
            configuration: Map::new(),
            workers: DEFAULT_WORKERS,
            max_concurrency: DEFAULT_MAX_CONCURRENCY,
            env: BTreeMap::new(),
            cwd: None,
            sandbox: false,
        }
    }

    /// Replaces the arguments.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> Registration
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Replaces the deployment configuration.
    #[must_use]
    pub fn configuration(mut self, configuration: Map<String, Value>) -> Registration {
        self.configuration = configuration;
        self
    }

    /// Sets the number of workers.
    #[must_use]
    pub fn workers(mut self, workers: u32) -> Registration {
        self.workers = workers;
        self
    }

    /// Sets the number of concurrently running activations per worker.
    #[must_use]
    pub fn max_concurrency(mut self, max_concurrency: u32) -> Registration {
        self.max_concurrency = max_concurrency;
        self
    }

    /// Adds (or replaces) one extra environment variable.
    #[must_use]
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Registration {
        self.env.insert(name.into(), value.into());
        self
    }

    /// Runs the workers under bubblewrap, or not.
    #[must_use]
    pub fn sandbox(mut self, sandbox: bool) -> Registration {
        self.sandbox = sandbox;
        self
    }

    /// Sets the harness's working directory.
    #[must_use]
    pub fn cwd(mut self, cwd: impl Into<PathBuf>) -> Registration {
        self.cwd = Some(cwd.into());
        self
    }

    /// Resolves `command` to the file Brain executes.
    ///
    /// A command containing a `/` is a path: a relative one is resolved against `brain_cwd`,
    /// Brain's own working directory (never the registration's `cwd`). A command without a `/` is
    /// searched in the directories of `PATH`, in order: the registration's `env` `PATH` when it sets
    /// one, else Brain's own `PATH`. Empty `PATH` entries are skipped (they do not mean the current
    /// directory) and relative entries are resolved against `brain_cwd`; candidates that are not
    /// executable regular files are passed over, as `execvp` does.
    ///
    /// The returned path exists, is a regular file (after following symbolic links) and has at
    /// least one execute bit set (`mode & 0o111`). It is not canonicalized. Anything else is a
    /// [`ConfigError`] naming the registration and the field `command`, and saying which paths were
    /// tried. This looks at the file system once; the file can of course change before it is
    /// executed.
    pub fn resolve_command(&self, brain_cwd: &Path) -> Result<PathBuf, ConfigError> {
        let fail = |kind| {
            ConfigError::new(kind)
                .with_registration(&self.name)
                .with_field("command")
        };
        check_command(&self.command).map_err(fail)?;
        if self.command.contains('/') {
            let path = brain_cwd.join(&self.command);
            return match check_executable(&path) {
                Ok(()) => Ok(path),
                Err(kind) => Err(fail(kind)),
            };
        }
        let (search, source) = match self.env.get("PATH") {
            Some(path) => (Some(OsString::from(path)), PathSource::Registration),
            None => (std::env::var_os("PATH"), PathSource::Brain),
        };
        let search = match search {
            Some(search) if !search.is_empty() => search,
            _ => {
                return Err(fail(Kind::NoSearchPath {
                    command: self.command.clone(),
                    source,
                }));
            }
        };
        let mut tried = Vec::new();
        for dir in std::env::split_paths(&search) {
            if dir.as_os_str().is_empty() {
                continue;
            }
            let candidate = brain_cwd.join(dir).join(&self.command);
            if check_executable(&candidate).is_ok() {
                return Ok(candidate);
            }
            tried.push(candidate);
        }
        Err(fail(Kind::NotOnPath {
            command: self.command.clone(),
            source,
            tried,
        }))
    }

    /// The checks shared by JSON parsing and [`Registrations::from_vec`]: everything that a typed
    /// `Registration` can still get wrong.
    fn validate(&self) -> Result<(), ConfigError> {
        let fail = |field: Option<&str>, kind| {
            let error = ConfigError::new(kind).with_registration(&self.name);
            match field {
                Some(field) => error.with_field(field),
                None => error,
            }
        };
        check_name(&self.name).map_err(|kind| fail(None, kind))?;
        check_command(&self.command).map_err(|kind| fail(Some("command"), kind))?;
        for (index, arg) in self.args.iter().enumerate() {
            if arg.contains('\0') {
                return Err(fail(
                    Some("args"),
                    Kind::ArgNul {
                        index,
                        got: show_str(arg),
                    },
                ));
            }
        }
        check_count(u64::from(self.workers), MAX_WORKERS)
            .map_err(|kind| fail(Some("workers"), kind))?;
        check_count(u64::from(self.max_concurrency), MAX_CONCURRENCY)
            .map_err(|kind| fail(Some("max_concurrency"), kind))?;
        for (name, value) in &self.env {
            check_env_var(name, value).map_err(|kind| fail(Some("env"), kind))?;
        }
        if let Some(cwd) = &self.cwd {
            let bytes = cwd.as_os_str().as_bytes();
            if bytes.is_empty() {
                return Err(fail(Some("cwd"), Kind::Empty));
            }
            if bytes.contains(&0) {
                return Err(fail(
                    Some("cwd"),
                    Kind::Nul {
                        got: show_str(&cwd.to_string_lossy()),
                    },
                ));
            }
        }
        Ok(())
    }
}

/// A non-empty set of valid registrations with unique names, in name order.
///
/// The only ways to get one are [`Registrations::parse`], [`Registrations::load`],
/// [`Registrations::from_flag_or_env`] and [`Registrations::from_vec`], all of which refuse
/// anything invalid; so holding a `Registrations` means every rule on [`Registrations::parse`]
/// holds.
#[derive(Debug, Clone)]
pub struct Registrations {
    /// Sorted by name; names are unique.
    regs: Vec<Registration>,
}

impl Registrations {
    /// Parses a JSON object mapping registration names to registrations.
    ///
    /// `origin` says where `json` came from (`--agentloops`, `BRAIN_AGENTLOOPS`, a file) and
    /// starts every error message.
    ///
    /// Refused, each with an error naming the registration and the field where there is one, and
    /// the offending value (shortened to about 100 characters):
    ///
    /// * malformed JSON (the message gives serde_json's line and column), trailing data, a top
    ///   level that is not an object, and an empty object;
    /// * a registration name given twice, and a key given twice inside one registration (and inside
    ///   its `configuration` or `env` objects; duplicates deeper inside `configuration` keep the
    ///   last value, as serde_json does);
    /// * names that are not 1–64 ASCII letters, digits, `_` or `-`;
    /// * a registration that is not an object, and any key other than `command`, `args`,
    ///   `configuration`, `workers`, `max_concurrency`, `env` and `cwd`;
    /// * a missing `command`, or one that is not a non-empty string without NUL bytes;
    /// * `args` that is not an array of strings without NUL bytes;
    /// * `configuration` that is not an object;
    /// * `workers` or `max_concurrency` that is not a JSON integer (`1.0`, `1e3`, `"3"` and `null`
    ///   are refused) from 1 to [`MAX_WORKERS`] or [`MAX_CONCURRENCY`] respectively;
    /// * `env` that is not an object of strings, a variable name that is empty or contains `=` or
    ///   NUL, and a value containing NUL;
    /// * `cwd` that is not a non-empty string without NUL bytes.
    ///
    /// Only the first error is reported: a duplicate registration name before anything else, then
    /// the registrations in document order, each checked for a duplicate key first and its keys in
    /// document order after. Nothing here touches the file system: whether `command` exists is
    /// [`Registration::resolve_command`]'s business.
    pub fn parse(json: &str, origin: &str) -> Result<Registrations, ConfigError> {
        parse_json(json).map_err(|error| error.with_origin(origin))
    }

    /// Reads registrations from a `--agentloops`-style VALUE.
    ///
    /// VALUE is inline JSON when, after leading whitespace, it starts with `{`; otherwise it is the
    /// path of a JSON file, taken exactly as written (relative to Brain's working directory) and
    /// parsed as by [`Registrations::parse`]. Errors from the file's contents name both `origin`
    /// and the file.
    ///
    /// Refused besides what `parse` refuses: an empty or all-whitespace VALUE, a file that cannot
    /// be read (the error names the file and carries the I/O error as its source), a file larger
    /// than 16 MiB, and a file that is not UTF-8.
    pub fn load(value: &str, origin: &str) -> Result<Registrations, ConfigError> {
        let trimmed = value.trim_start();
        if trimmed.starts_with('{') {
            return Registrations::parse(value, origin);
        }
        if trimmed.is_empty() {
            return Err(ConfigError::new(Kind::EmptyValue).with_origin(origin));
        }
        let path = Path::new(value);
        let text = read_file(path).map_err(|kind| ConfigError::new(kind).with_origin(origin))?;
        let file_origin = format!("{origin} file \"{}\"", show_path(path));
        Registrations::parse(&text, &file_origin)
    }

    /// Reads registrations from the `--agentloops` flag's value when it was given, else from the
    /// `BRAIN_AGENTLOOPS` environment variable, as [`Registrations::load`] does.
    ///
    /// Returns `Ok(None)` when neither is set; an empty environment variable counts as unset, but
    /// an empty flag value is refused. The flag wins even when both are set. A `BRAIN_AGENTLOOPS`
    /// that is not valid UTF-8 is refused.
    pub fn from_flag_or_env(flag: Option<&str>) -> Result<Option<Registrations>, ConfigError> {
        from_sources(flag, std::env::var_os(ENV_VAR))
    }

    /// Checks registrations built in code with the same rules as [`Registrations::parse`] (names,
    /// commands, arguments, counts, environment, working directory), and refuses an empty vector
    /// and duplicate names. The first invalid registration, in the vector's order, is reported;
    /// errors carry no origin. The result is sorted by name.
    pub fn from_vec(regs: Vec<Registration>) -> Result<Registrations, ConfigError> {
        if regs.is_empty() {
            return Err(ConfigError::new(Kind::NoRegistrations));
        }
        let mut seen = BTreeSet::new();
        for reg in &regs {
            reg.validate()?;
            if !seen.insert(reg.name.as_str()) {
                return Err(ConfigError::new(Kind::DuplicateName).with_registration(&reg.name));
            }
        }
        let mut regs = regs;
        regs.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Registrations { regs })
    }

    /// The registrations in name order.
    pub fn iter(&self) -> impl Iterator<Item = &Registration> {
        self.regs.iter()
    }

    /// The registration called `name`, if there is one. Names are compared exactly.
    pub fn get(&self, name: &str) -> Option<&Registration> {
        self.regs
            .binary_search_by(|reg| reg.name.as_str().cmp(name))
            .ok()
            .map(|index| &self.regs[index])
    }

    /// How many registrations there are; never zero.
    pub fn len(&self) -> usize {
        self.regs.len()
    }

    /// Always false: an empty map is refused. Present for API symmetry with [`Registrations::len`].
    pub fn is_empty(&self) -> bool {
        self.regs.is_empty()
    }
}

impl<'a> IntoIterator for &'a Registrations {
    type Item = &'a Registration;
    type IntoIter = std::slice::Iter<'a, Registration>;

    fn into_iter(self) -> Self::IntoIter {
        self.regs.iter()
    }
}

/// Why registrations were refused.
///
/// The message (its `Display`) starts with where the registrations came from, then the
/// registration and the field when known, then what is wrong and the offending value shortened to
/// about 100 characters, e.g.
/// `--agentloops: registration "pi": field "workers": must be an integer >= 1, got 0`.
/// Errors from reading a file carry the I/O error as their [`std::error::Error::source`].
#[derive(Debug)]
pub struct ConfigError(Box<ErrorInner>);

#[derive(Debug)]
struct ErrorInner {
    origin: Option<String>,
    registration: Option<String>,
    field: Option<String>,
    kind: Kind,
}

impl ConfigError {
    fn new(kind: Kind) -> ConfigError {
        ConfigError(Box::new(ErrorInner {
            origin: None,
            registration: None,
            field: None,
            kind,
        }))
    }

    fn with_origin(mut self, origin: &str) -> ConfigError {
        self.0.origin = Some(origin.to_owned());
        self
    }

    fn with_registration(mut self, registration: &str) -> ConfigError {
        self.0.registration = Some(registration.to_owned());
        self
    }

    fn with_field(mut self, field: &str) -> ConfigError {
        self.0.field = Some(field.to_owned());
        self
    }

    /// The name of the registration at fault, in full, when the error concerns one.
    pub fn registration(&self) -> Option<&str> {
        self.0.registration.as_deref()
    }

    /// The registration key at fault (`"command"`, `"workers"`, an unknown key, ...), when the
    /// error concerns one.
    pub fn field(&self) -> Option<&str> {
        self.0.field.as_deref()
    }

    /// Where the registrations came from (`--agentloops`, `BRAIN_AGENTLOOPS`, a file), when known.
    /// Errors from [`Registrations::from_vec`] and [`Registration::resolve_command`] have none.
    pub fn origin(&self) -> Option<&str> {
        self.0.origin.as_deref()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.0;
        if let Some(origin) = &inner.origin {
            write!(f, "{origin}: ")?;
        }
        if let Some(registration) = &inner.registration {
            write!(f, "registration {}: ", show_str(registration))?;
        }
        if let Some(field) = &inner.field {
            write!(f, "field {}: ", show_str(field))?;
        }
        write!(f, "{}", inner.kind)
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.0.kind {
            Kind::Read { error, .. } | Kind::Stat { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// Which `PATH` a command search used.
#[derive(Debug, Clone, Copy)]
enum PathSource {
    Brain,
    Registration,
}

impl fmt::Display for PathSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathSource::Brain => f.write_str("Brain's PATH"),
            PathSource::Registration => f.write_str("the registration's env PATH"),
        }
    }
}

/// What is wrong. Strings holding offending values are already shortened and quoted for display.
#[derive(Debug)]
enum Kind {
    Syntax(String),
    EmptyValue,
    EnvNotUnicode,
    Read {
        path: PathBuf,
        error: io::Error,
    },
    FileTooLarge {
        path: PathBuf,
    },
    FileNotUtf8 {
        path: PathBuf,
    },
    TopNotObject {
        got: String,
    },
    NoRegistrations,
    DuplicateName,
    BadName {
        reason: String,
    },
    NotObject {
        got: String,
    },
    DuplicateKey,
    UnknownKey,
    Missing,
    WrongType {
        expected: &'static str,
        got: String,
    },
    Empty,
    Nul {
        got: String,
    },
    DuplicateEntry {
        key: String,
    },
    ArgNotString {
        index: usize,
        got: String,
    },
    ArgNul {
        index: usize,
        got: String,
    },
    CountNotPositive {
        got: String,
    },
    CountTooLarge {
        max: u32,
        got: String,
    },
    EnvName {
        name: String,
        reason: &'static str,
    },
    EnvValueNotString {
        name: String,
        got: String,
    },
    EnvValueNul {
        name: String,
        got: String,
    },
    NoSuchFile {
        path: PathBuf,
    },
    Stat {
        path: PathBuf,
        error: io::Error,
    },
    NotRegularFile {
        path: PathBuf,
    },
    NotExecutable {
        path: PathBuf,
        mode: u32,
    },
    NoSearchPath {
        command: String,
        source: PathSource,
    },
    NotOnPath {
        command: String,
        source: PathSource,
        tried: Vec<PathBuf>,
    },
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kind::Syntax(message) => write!(f, "malformed JSON: {message}"),
            Kind::EmptyValue => f.write_str(
                "empty value: expected inline JSON starting with '{' or the path of a JSON file",
            ),
            Kind::EnvNotUnicode => f.write_str("value is not valid UTF-8"),
            Kind::Read { path, error } => write!(
                f,
                "cannot read registrations file \"{}\": {error}",
                show_path(path)
            ),
            Kind::FileTooLarge { path } => write!(
                f,
                "registrations file \"{}\" is larger than the limit of {MAX_FILE_BYTES} bytes",
                show_path(path)
            ),
            Kind::FileNotUtf8 { path } => write!(
                f,
                "registrations file \"{}\" is not valid UTF-8",
                show_path(path)
            ),
            Kind::TopNotObject { got } => write!(
                f,
                "must be a JSON object mapping registration names to registrations, got {got}"
            ),
            Kind::NoRegistrations => {
                f.write_str("no registrations: at least one registration is required")
            }
            Kind::DuplicateName => f.write_str("name given more than once"),
            Kind::BadName { reason } => write!(
                f,
                "invalid name ({reason}): names are 1 to {MAX_NAME_LEN} ASCII letters, digits, \
                 '_' or '-'"
            ),
            Kind::NotObject { got } => write!(f, "must be a JSON object, got {got}"),
            Kind::DuplicateKey => f.write_str("given more than once"),
            Kind::UnknownKey => write!(f, "unknown key (known keys: {})", KEYS.join(", ")),
            Kind::Missing => f.write_str("required but missing"),
            Kind::WrongType { expected, got } => write!(f, "must be {expected}, got {got}"),
            Kind::Empty => f.write_str("must not be empty"),
            Kind::Nul { got } => write!(f, "must not contain a NUL byte, got {got}"),
            Kind::DuplicateEntry { key } => write!(f, "key {key} given more than once"),
            Kind::ArgNotString { index, got } => {
                write!(f, "element {index} must be a string, got {got}")
            }
            Kind::ArgNul { index, got } => {
                write!(f, "element {index} must not contain a NUL byte, got {got}")
            }
            Kind::CountNotPositive { got } => write!(f, "must be an integer >= 1, got {got}"),
            Kind::CountTooLarge { max, got } => {
                write!(f, "must be an integer <= {max}, got {got}")
            }
            Kind::EnvName { name, reason } => write!(f, "variable name {name} {reason}"),
            Kind::EnvValueNotString { name, got } => {
                write!(f, "variable {name} must be a string, got {got}")
            }
            Kind::EnvValueNul { name, got } => {
                write!(f, "variable {name} must not contain a NUL byte, got {got}")
            }
            Kind::NoSuchFile { path } => write!(f, "\"{}\" does not exist", show_path(path)),
            Kind::Stat { path, error } => {
                write!(f, "cannot inspect \"{}\": {error}", show_path(path))
            }
            Kind::NotRegularFile { path } => {
                write!(f, "\"{}\" is not a regular file", show_path(path))
            }
            Kind::NotExecutable { path, mode } => write!(
                f,
                "\"{}\" is not executable (mode {:o})",
                show_path(path),
                mode & 0o7777
            ),
            Kind::NoSearchPath { command, source } => write!(
                f,
                "{} has no '/' and {source} is unset or empty, so there is nowhere to search",
                show_str(command)
            ),
            Kind::NotOnPath {
                command,
                source,
                tried,
            } => {
                write!(
                    f,
                    "{} not found as an executable regular file on {source}; tried ",
                    show_str(command)
                )?;
                if tried.is_empty() {
                    return f.write_str("nothing (no non-empty PATH entries)");
                }
                for (index, path) in tried.iter().take(SHOWN_TRIED).enumerate() {
                    if index > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "\"{}\"", show_path(path))?;
                }
                if tried.len() > SHOWN_TRIED {
                    write!(f, " and {} more", tried.len() - SHOWN_TRIED)?;
                }
                Ok(())
            }
        }
    }
}

/// The flag-or-environment choice of [`Registrations::from_flag_or_env`], with the environment
/// variable's value injected so it can be tested without touching the process environment.
fn from_sources(
    flag: Option<&str>,
    env: Option<OsString>,
) -> Result<Option<Registrations>, ConfigError> {
    if let Some(value) = flag {
        log::debug!("reading registrations from {FLAG}");
        return Registrations::load(value, FLAG).map(Some);
    }
    let Some(value) = env else {
        return Ok(None);
    };
    if value.is_empty() {
        return Ok(None);
    }
    match value.into_string() {
        Ok(value) => {
            log::debug!("reading registrations from {ENV_VAR}");
            Registrations::load(&value, ENV_VAR).map(Some)
        }
        Err(_) => Err(ConfigError::new(Kind::EnvNotUnicode).with_origin(ENV_VAR)),
    }
}

/// Reads a registrations file of at most [`MAX_FILE_BYTES`].
fn read_file(path: &Path) -> Result<String, Kind> {
    let read_error = |error| Kind::Read {
        path: path.to_path_buf(),
        error,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(Kind::FileTooLarge {
            path: path.to_path_buf(),
        });
    }
    String::from_utf8(bytes).map_err(|_| Kind::FileNotUtf8 {
        path: path.to_path_buf(),
    })
}

/// [`Registrations::parse`] without the origin.
fn parse_json(json: &str) -> Result<Registrations, ConfigError> {
    let top: Raw<Raw<Raw<Value>>> = serde_json::from_str(json)
        .map_err(|error| ConfigError::new(Kind::Syntax(error.to_string())))?;
    let (entries, duplicate) = match top {
        Raw::Other(value) => {
            return Err(ConfigError::new(Kind::TopNotObject {
                got: preview(&value),
            }));
        }
        Raw::Object { entries, duplicate } => (entries, duplicate),
    };
    if entries.is_empty() {
        return Err(ConfigError::new(Kind::NoRegistrations));
    }
    if let Some(name) = duplicate {
        return Err(ConfigError::new(Kind::DuplicateName).with_registration(&name));
    }
    let mut regs = Vec::with_capacity(entries.len());
    for (name, raw) in entries {
        let reg = registration_from_json(name, raw)?;
        reg.validate()?;
        regs.push(reg);
    }
    Registrations::from_vec(regs)
}

/// Type-checks one registration object; [`Registration::validate`] checks the values.
fn registration_from_json(name: String, raw: Raw<Raw<Value>>) -> Result<Registration, ConfigError> {
    let fail = |field: Option<&str>, kind| {
        let error = ConfigError::new(kind).with_registration(&name);
        match field {
            Some(field) => error.with_field(field),
            None => error,
        }
    };
    check_name(&name).map_err(|kind| fail(None, kind))?;
    let (entries, duplicate) = match raw {
        Raw::Other(value) => {
            return Err(fail(
                None,
                Kind::NotObject {
                    got: preview(&value),
                },
            ));
        }
        Raw::Object { entries, duplicate } => (entries, duplicate),
    };
    if let Some(key) = duplicate {
        return Err(fail(Some(&key), Kind::DuplicateKey));
    }
    let mut reg = Registration::new(String::new(), String::new());
    let mut command = None;
    for (key, value) in entries {
        let field = key.as_str();
        let result = match field {
            "command" => json_string(value).map(|value| command = Some(value)),
            "args" => json_args(value).map(|value| reg.args = value),
            "configuration" => json_object(value).map(|value| reg.configuration = value),
            "workers" => json_count(value, MAX_WORKERS).map(|value| reg.workers = value),
            "max_concurrency" => {
                json_count(value, MAX_CONCURRENCY).map(|value| reg.max_concurrency = value)
            }
            "env" => json_env(value).map(|value| reg.env = value),
            "cwd" => json_string(value).map(|value| reg.cwd = Some(PathBuf::from(value))),
            "sandbox" => match value {
                Raw::Other(Value::Bool(sandbox)) => {
                    reg.sandbox = sandbox;
                    Ok(())
                }
                other => Err(Kind::WrongType {
                    expected: "true or false",
                    got: preview(&other.into_value()),
                }),
            },
            _ => Err(Kind::UnknownKey),
        };
        result.map_err(|kind| fail(Some(field), kind))?;
    }
    let Some(command) = command else {
        return Err(fail(Some("command"), Kind::Missing));
    };
    reg.command = command;
    reg.name = name;
    Ok(reg)
}

fn json_string(value: Raw<Value>) -> Result<String, Kind> {
    match value {
        Raw::Other(Value::String(value)) => Ok(value),
        other => Err(Kind::WrongType {
            expected: "a string",
            got: preview(&other.into_value()),
        }),
    }
}

fn json_args(value: Raw<Value>) -> Result<Vec<String>, Kind> {
    let items = match value {
        Raw::Other(Value::Array(items)) => items,
        other => {
            return Err(Kind::WrongType {
                expected: "an array of strings",
                got: preview(&other.into_value()),
            });
        }
    };
    let mut args = Vec::with_capacity(items.len());
    for (index, item) in items.into_iter().enumerate() {
        match item {
            Value::String(arg) => args.push(arg),
            other => {
                return Err(Kind::ArgNotString {
                    index,
                    got: preview(&other),
                });
            }
        }
    }
    Ok(args)
}

fn json_object(value: Raw<Value>) -> Result<Map<String, Value>, Kind> {
    match value {
        Raw::Object {
            duplicate: Some(key),
            ..
        } => Err(Kind::DuplicateEntry {
            key: show_str(&key),
        }),
        Raw::Object { entries, .. } => Ok(entries.into_iter().collect()),
        Raw::Other(other) => Err(Kind::WrongType {
            expected: "a JSON object",
            got: preview(&other),
        }),
    }
}

fn json_count(value: Raw<Value>, max: u32) -> Result<u32, Kind> {
    let value = value.into_value();
    match value.as_u64() {
        Some(count) => check_count(count, max),
        None => Err(Kind::CountNotPositive {
            got: preview(&value),
        }),
    }
}

fn json_env(value: Raw<Value>) -> Result<BTreeMap<String, String>, Kind> {
    let mut env = BTreeMap::new();
    for (name, value) in json_object(value).map_err(|kind| match kind {
        Kind::WrongType { got, .. } => Kind::WrongType {
            expected: "a JSON object of strings",
            got,
        },
        kind => kind,
    })? {
        match value {
            Value::String(value) => {
                env.insert(name, value);
            }
            other => {
                return Err(Kind::EnvValueNotString {
                    name: show_str(&name),
                    got: preview(&other),
                });
            }
        }
    }
    Ok(env)
}

fn check_name(name: &str) -> Result<(), Kind> {
    let reason = if name.is_empty() {
        "empty".to_owned()
    } else if name.len() > MAX_NAME_LEN {
        format!("{} bytes long", name.len())
    } else if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        format!("contains {bad:?}")
    } else {
        return Ok(());
    };
    Err(Kind::BadName { reason })
}

fn check_command(command: &str) -> Result<(), Kind> {
    if command.is_empty() {
        return Err(Kind::Empty);
    }
    if command.contains('\0') {
        return Err(Kind::Nul {
            got: show_str(command),
        });
    }
    Ok(())
}

fn check_count(count: u64, max: u32) -> Result<u32, Kind> {
    if count == 0 {
        return Err(Kind::CountNotPositive {
            got: count.to_string(),
        });
    }
    match u32::try_from(count) {
        Ok(count) if count <= max => Ok(count),
        _ => Err(Kind::CountTooLarge {
            max,
            got: count.to_string(),
        }),
    }
}

fn check_env_var(name: &str, value: &str) -> Result<(), Kind> {
    let reason = if name.is_empty() {
        Some("must not be empty")
    } else if name.contains('=') {
        Some("must not contain '='")
    } else if name.contains('\0') {
        Some("must not contain a NUL byte")
    } else {
        None
    };
    if let Some(reason) = reason {
        return Err(Kind::EnvName {
            name: show_str(name),
            reason,
        });
    }
    if value.contains('\0') {
        return Err(Kind::EnvValueNul {
            name: show_str(name),
            got: show_str(value),
        });
    }
    Ok(())
}

/// Succeeds when `path` is a regular file (following symbolic links) with an execute bit set.
fn check_executable(path: &Path) -> Result<(), Kind> {
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            return Err(Kind::NoSuchFile {
                path: path.to_path_buf(),
            });
        }
        Err(error) => {
            return Err(Kind::Stat {
                path: path.to_path_buf(),
                error,
            });
        }
    };
    if !metadata.is_file() {
        return Err(Kind::NotRegularFile {
            path: path.to_path_buf(),
        });
    }
    let mode = metadata.permissions().mode();
    if mode & 0o111 == 0 {
        return Err(Kind::NotExecutable {
            path: path.to_path_buf(),
            mode,
        });
    }
    Ok(())
}

/// `s` shortened to [`SHOWN`] characters and quoted with escapes.
fn show_str(s: &str) -> String {
    match s.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{:?}…", &s[..end]),
        None => format!("{s:?}"),
    }
}

/// A JSON value as JSON text, shortened to [`SHOWN`] characters.
fn preview(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text,
    }
}

/// A path for display, shortened to [`SHOWN_PATH`] characters.
fn show_path(path: &Path) -> String {
    let text = path.to_string_lossy();
    match text.char_indices().nth(SHOWN_PATH) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.into_owned(),
    }
}

/// A JSON value whose objects keep their keys in document order and remember the first duplicate
/// key, which `serde_json::Map` would silently drop. Values of objects are `V`. Numbers arrive
/// through `visit_u64`/`visit_i64`/`visit_f64`, which holds while serde_json's
/// `arbitrary_precision` feature is off (the `counts` test would catch it being turned on).
enum Raw<V> {
    Object {
        entries: Vec<(String, V)>,
        duplicate: Option<String>,
    },
    Other(Value),
}

impl Raw<Value> {
    fn into_value(self) -> Value {
        match self {
            Raw::Object { entries, .. } => Value::Object(entries.into_iter().collect()),
            Raw::Other(value) => value,
        }
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Raw<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Raw<V>, D::Error> {
        deserializer.deserialize_any(RawVisitor(PhantomData))
    }
}

struct RawVisitor<V>(PhantomData<V>);

impl<'de, V: Deserialize<'de>> Visitor<'de> for RawVisitor<V> {
    type Value = Raw<V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Raw<V>, E> {
        Ok(Raw::Other(Value::Bool(value)))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Raw<V>, E> {
        Ok(Raw::Other(Value::from(value)))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Raw<V>, E> {
        Ok(Raw::Other(Value::from(value)))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Raw<V>, E> {
        Ok(Raw::Other(Value::from(value)))
    }

    fn visit_str<E>(self, value: &str) -> Result<Raw<V>, E> {
        Ok(Raw::Other(Value::String(value.to_owned())))
    }

    fn visit_string<E>(self, value: String) -> Result<Raw<V>, E> {
        Ok(Raw::Other(Value::String(value)))
    }

    fn visit_unit<E>(self) -> Result<Raw<V>, E> {
        Ok(Raw::Other(Value::Null))
    }

    fn visit_none<E>(self) -> Result<Raw<V>, E> {
        Ok(Raw::Other(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Raw<V>, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Value>()? {
            items.push(item);
        }
        Ok(Raw::Other(Value::Array(items)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Raw<V>, A::Error> {
        let mut entries = Vec::new();
        let mut seen = BTreeSet::new();
        let mut duplicate = None;
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value::<V>()?;
            if seen.contains(&key) {
                duplicate.get_or_insert(key);
            } else {
                seen.insert(key.clone());
                entries.push((key, value));
            }
        }
        Ok(Raw::Object { entries, duplicate })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const ORIGIN: &str = "--agentloops";

    /// Parses `json`, expecting a refusal.
    fn refused(json: &str) -> ConfigError {
        match Registrations::parse(json, ORIGIN) {
            Ok(regs) => panic!("accepted {json}: {regs:?}"),
            Err(error) => error,
        }
    }

    /// Parses `{"a": {"command": "x", <fields>}}`, expecting a refusal of registration `a`.
    fn refused_field(fields: &str) -> ConfigError {
        let error = refused(&format!(r#"{{"a": {{"command": "x", {fields}}}}}"#));
        assert_eq!(error.registration(), Some("a"), "{error}");
        error
    }

    /// Asserts the error's field and that its message contains every one of `needles`.
    fn assert_error(error: &ConfigError, field: Option<&str>, needles: &[&str]) {
        assert_eq!(error.field(), field, "{error}");
        let message = error.to_string();
        assert!(message.starts_with(ORIGIN), "{message}");
        for needle in needles {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
    }

    /// A unique path under the temporary directory, removed (file or directory) on drop.
    struct Temp(PathBuf);

    impl Temp {
        fn new(tag: &str) -> Temp {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let name = format!("brain-config-test-{}-{tag}-{n}", std::process::id());
            Temp(std::env::temp_dir().join(name))
        }

        fn file(tag: &str, contents: &str) -> Temp {
            let temp = Temp::new(tag);
            std::fs::write(&temp.0, contents).unwrap();
            temp
        }

        fn dir(tag: &str) -> Temp {
            let temp = Temp::new(tag);
            std::fs::create_dir(&temp.0).unwrap();
            temp
        }
    }

    impl Drop for Temp {
        fn drop(&mut self) {
            if std::thread::panicking() {
                eprintln!("kept the failed test's file {}", self.0.display());
            } else {
                let _ = std::fs::remove_dir_all(&self.0);
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    fn write_mode(path: &Path, mode: u32) {
        std::fs::write(path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn defaults() {
        let regs = Registrations::parse(r#"{"echo": {"command": "x"}}"#, ORIGIN).unwrap();
        assert_eq!(regs.len(), 1);
        assert!(!regs.is_empty());
        let reg = regs.get("echo").unwrap();
        assert_eq!(reg, &Registration::new("echo", "x"));
        assert_eq!(reg.command, "x");
        assert!(reg.args.is_empty());
        assert!(reg.configuration.is_empty());
        assert_eq!(reg.workers, 1);
        assert_eq!(reg.max_concurrency, 64);
        assert!(reg.env.is_empty());
        assert_eq!(reg.cwd, None);
    }

    #[test]
    fn every_field() {
        let json = r#"{
            "pi": {"command": "node", "args": ["a.mjs", ""], "configuration": {"thinking": "low"},
                   "workers": 256, "max_concurrency": 65536, "env": {"NODE_OPTIONS": "x=y", "E": ""},
                   "cwd": "work/dir"},
            "Echo_2-x": {"command": "./bin/echo"}
        }"#;
        let regs = Registrations::parse(json, ORIGIN).unwrap();
        let mut config = Map::new();
        config.insert("thinking".into(), Value::from("low"));
        let expected = Registration::new("pi", "node")
            .args(["a.mjs", ""])
            .configuration(config)
            .workers(256)
            .max_concurrency(65536)
            .env("NODE_OPTIONS", "x=y")
            .env("E", "")
            .cwd("work/dir");
        assert_eq!(regs.get("pi"), Some(&expected));
        assert_eq!(regs.get("Echo_2-x").unwrap().command, "./bin/echo");
        assert_eq!(regs.get("echo_2-x"), None);
        assert_eq!(regs.get("nope"), None);
        // Name order (byte order: upper case first), whatever the document order.
        let names: Vec<&str> = regs.iter().map(|reg| reg.name.as_str()).collect();
        assert_eq!(names, ["Echo_2-x", "pi"]);
        let names: Vec<&str> = (&regs).into_iter().map(|reg| reg.name.as_str()).collect();
        assert_eq!(names, ["Echo_2-x", "pi"]);
    }

    #[test]
    fn names() {
        let ok = ["a", "_", "-", "A-z_0-9", &"n".repeat(64)];
        for name in ok {
            let json = format!(r#"{{"{name}": {{"command": "x"}}}}"#);
            let regs = Registrations::parse(&json, ORIGIN).unwrap();
            assert!(regs.get(name).is_some(), "{name}");
        }
        let long = "n".repeat(65);
        let bad = [
            ("", "empty"),
            ("a b", "' '"),
            ("a.b", "'.'"),
            ("é", "contains 'é'"),
            ("a/b", "'/'"),
            (&long, "65 bytes long"),
        ];
        for (name, reason) in bad {
            let error = refused(&format!(r#"{{"{name}": {{"command": "x"}}}}"#));
            assert_eq!(error.registration(), Some(name));
            assert_error(&error, None, &[reason, "invalid name"]);
        }
        // A bad name is reported before a bad body.
        let error = refused(r#"{"a b": 3}"#);
        assert_error(&error, None, &["invalid name"]);
    }

    #[test]
    fn exact_message() {
        let error = refused(r#"{"pi": {"command": "x", "workers": 0}}"#);
        assert_eq!(
            error.to_string(),
            r#"--agentloops: registration "pi": field "workers": must be an integer >= 1, got 0"#
        );
        assert_eq!(error.origin(), Some(ORIGIN));
    }

    #[test]
    fn malformed_json() {
        for json in [
            "",
            "{",
            r#"{"a": {"command": "x"},}"#,
            "{\n  \"a\": {\"command\": x}\n}",
            r#"{"a": {"command": "x"}} trailing"#,
        ] {
            let error = refused(json);
            assert_eq!(error.registration(), None);
            assert_error(&error, None, &["malformed JSON", "line ", "column "]);
        }
        let error = refused("{\n  \"a\": {\"command\": x}\n}");
        assert_error(&error, None, &["line 2 column"]);
    }

    #[test]
    fn top_level_not_object() {
        for (json, got) in [
            ("[1, 2]", "[1,2]"),
            (r#""x""#, r#""x""#),
            ("null", "null"),
            ("3", "3"),
            ("true", "true"),
        ] {
            let error = refused(json);
            assert_eq!(error.registration(), None);
            assert_error(&error, None, &["must be a JSON object", got]);
        }
    }

    #[test]
    fn empty_map() {
        let error = refused(" {} ");
        assert_eq!(error.registration(), None);
        assert_error(&error, None, &["no registrations"]);
    }

    #[test]
    fn duplicate_names() {
        let error =
            refused(r#"{"a": {"command": "x"}, "b": {"command": "y"}, "a": {"command": "z"}}"#);
        assert_eq!(error.registration(), Some("a"));
        assert_error(&error, None, &["\"a\"", "more than once"]);
    }

    #[test]
    fn duplicate_keys() {
        let error = refused_field(r#""workers": 1, "workers": 2"#);
        assert_error(&error, Some("workers"), &["more than once"]);
        let error = refused(r#"{"a": {"command": "x", "command": "x"}}"#);
        assert_error(&error, Some("command"), &["more than once"]);
        let error = refused_field(r#""configuration": {"k": 1, "k": 2}"#);
        assert_error(&error, Some("configuration"), &["\"k\"", "more than once"]);
        let error = refused_field(r#""env": {"K": "1", "K": "2"}"#);
        assert_error(&error, Some("env"), &["\"K\"", "more than once"]);
        // Deeper inside configuration, serde_json's last-wins applies.
        let regs = Registrations::parse(
            r#"{"a": {"command": "x", "configuration": {"k": {"d": 1, "d": 2}}}}"#,
            ORIGIN,
        )
        .unwrap();
        assert_eq!(regs.get("a").unwrap().configuration["k"]["d"], 2);
    }

    #[test]
    fn registration_not_object() {
        for (body, got) in [
            ("3", "3"),
            ("[]", "[]"),
            ("null", "null"),
            (r#""node""#, r#""node""#),
        ] {
            let error = refused(&format!(r#"{{"a": {body}}}"#));
            assert_eq!(error.registration(), Some("a"));
            assert_error(&error, None, &["must be a JSON object", got]);
        }
    }

    #[test]
    fn unknown_key() {
        let error = refused_field(r#""comand": "y""#);
        assert_error(&error, Some("comand"), &["unknown key", "\"comand\""]);
        let error = refused_field(r#""Workers": 1"#);
        assert_error(&error, Some("Workers"), &["unknown key"]);
    }

    #[test]
    fn command() {
        let error = refused(r#"{"a": {"args": []}}"#);
        assert_eq!(error.registration(), Some("a"));
        assert_error(&error, Some("command"), &["missing"]);
        let error = refused(r#"{"a": {}}"#);
        assert_error(&error, Some("command"), &["missing"]);
        for (value, needle) in [
            (r#""""#, "must not be empty"),
            ("3", "must be a string, got 3"),
            ("null", "must be a string, got null"),
            (r#"["node"]"#, r#"got ["node"]"#),
            (r#""no\u0000de""#, r#"NUL byte, got "no\0de""#),
        ] {
            let error = refused(&format!(r#"{{"a": {{"command": {value}}}}}"#));
            assert_eq!(error.registration(), Some("a"));
            assert_error(&error, Some("command"), &[needle]);
        }
    }

    #[test]
    fn args() {
        for (value, needle) in [
            (r#""a b""#, r#"must be an array of strings, got "a b""#),
            ("{}", "got {}"),
            (r#"["a", 3]"#, "element 1 must be a string, got 3"),
            (r#"[null]"#, "element 0 must be a string, got null"),
            (
                r#"["ok", "b\u0000d"]"#,
                r#"element 1 must not contain a NUL byte, got "b\0d""#,
            ),
        ] {
            let error = refused_field(&format!(r#""args": {value}"#));
            assert_error(&error, Some("args"), &[needle]);
        }
    }

    #[test]
    fn configuration() {
        for (value, got) in [
            ("[]", "[]"),
            (r#""x""#, r#""x""#),
            ("null", "null"),
            ("1", "1"),
        ] {
            let error = refused_field(&format!(r#""configuration": {value}"#));
            assert_error(
                &error,
                Some("configuration"),
                &["must be a JSON object", got],
            );
        }
    }

    #[test]
    fn counts() {
        for field in ["workers", "max_concurrency"] {
            for value in [
                "0", "-1", "1.5", "1.0", "1e3", r#""3""#, "null", "true", "[1]", "{}",
            ] {
                let error = refused_field(&format!(r#""{field}": {value}"#));
                assert_error(&error, Some(field), &["must be an integer >= 1, got"]);
                let message = error.to_string();
                let got = message.rsplit("got ").next().unwrap();
                assert_eq!(
                    serde_json::from_str::<Value>(got).unwrap(),
                    serde_json::from_str::<Value>(value).unwrap(),
                    "{message}"
                );
            }
        }
        for (field, value, limit) in [
            ("workers", "257", "256"),
            ("workers", "100000000000", "256"),
            ("max_concurrency", "65537", "65536"),
            ("max_concurrency", "18446744073709551615", "65536"),
        ] {
            let error = refused_field(&format!(r#""{field}": {value}"#));
            assert_error(
                &error,
                Some(field),
                &[&format!("<= {limit}"), &format!("got {value}")],
            );
        }
        // Integers too large for u64 become floats in serde_json: still refused.
        let error = refused_field(r#""workers": 18446744073709551616"#);
        assert_error(&error, Some("workers"), &["must be an integer >= 1"]);
    }

    #[test]
    fn env() {
        for (value, needle) in [
            ("[]", "must be a JSON object of strings, got []"),
            (r#""A=1""#, r#"got "A=1""#),
            (r#"{"A": 1}"#, r#"variable "A" must be a string, got 1"#),
            (
                r#"{"A": null}"#,
                r#"variable "A" must be a string, got null"#,
            ),
            (r#"{"": "1"}"#, r#"variable name "" must not be empty"#),
            (
                r#"{"A=B": "1"}"#,
                r#"variable name "A=B" must not contain '='"#,
            ),
            (
                r#"{"A\u0000": "1"}"#,
                r#"variable name "A\0" must not contain a NUL"#,
            ),
            (
                r#"{"A": "x\u0000"}"#,
                r#"variable "A" must not contain a NUL byte, got "x\0""#,
            ),
        ] {
            let error = refused_field(&format!(r#""env": {value}"#));
            assert_error(&error, Some("env"), &[needle]);
        }
    }

    #[test]
    fn cwd() {
        for (value, needle) in [
            (r#""""#, "must not be empty"),
            ("3", "must be a string, got 3"),
            ("null", "must be a string, got null"),
            (r#""a\u0000""#, "NUL byte"),
        ] {
            let error = refused_field(&format!(r#""cwd": {value}"#));
            assert_error(&error, Some("cwd"), &[needle]);
        }
    }

    #[test]
    fn errors_follow_document_order() {
        let error = refused(r#"{"b": {"command": "x", "workers": 0}, "a": {"command": ""}}"#);
        assert_eq!(error.registration(), Some("b"));
        let error = refused_field(r#""nope": 1, "workers": 0"#);
        assert_eq!(error.field(), Some("nope"));
    }

    #[test]
    fn long_values_are_shortened() {
        let long = "x".repeat(10_000);
        let error = refused_field(&format!(r#""workers": "{long}""#));
        let message = error.to_string();
        assert!(message.len() < 250, "{message}");
        assert!(message.ends_with('…'), "{message}");
        let error = refused(&format!(r#"{{"{long}": {{"command": "x"}}}}"#));
        assert_eq!(error.registration(), Some(long.as_str()));
        assert!(error.to_string().len() < 300);
        let error = refused_field(&format!(r#""{long}": 1"#));
        assert_eq!(error.field(), Some(long.as_str()));
        assert!(error.to_string().len() < 400);
    }

    #[test]
    fn from_vec_validates() {
        let regs = Registrations::from_vec(vec![
            Registration::new("b", "y").workers(2),
            Registration::new("a", "x"),
        ])
        .unwrap();
        let names: Vec<&str> = regs.iter().map(|reg| reg.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(regs.get("b").unwrap().workers, 2);

        let error = Registrations::from_vec(Vec::new()).unwrap_err();
        assert_eq!(error.registration(), None);
        assert!(error.to_string().contains("no registrations"));
        assert_eq!(error.origin(), None);

        let cases = [
            (
                vec![Registration::new("a", "x"), Registration::new("a", "y")],
                "a",
                None,
                "more than once",
            ),
            (
                vec![Registration::new("a b", "x")],
                "a b",
                None,
                "invalid name",
            ),
            (
                vec![Registration::new("a", "")],
                "a",
                Some("command"),
                "must not be empty",
            ),
            (
                vec![Registration::new("a", "x\0")],
                "a",
                Some("command"),
                "NUL",
            ),
            (
                vec![Registration::new("a", "x").args(["\0"])],
                "a",
                Some("args"),
                "element 0",
            ),
            (
                vec![Registration::new("a", "x").workers(0)],
                "a",
                Some("workers"),
                ">= 1, got 0",
            ),
            (
                vec![Registration::new("a", "x").workers(257)],
                "a",
                Some("workers"),
                "<= 256",
            ),
            (
                vec![Registration::new("a", "x").max_concurrency(0)],
                "a",
                Some("max_concurrency"),
                "got 0",
            ),
            (
                vec![Registration::new("a", "x").max_concurrency(65537)],
                "a",
                Some("max_concurrency"),
                "<= 65536, got 65537",
            ),
            (
                vec![Registration::new("a", "x").env("A=B", "1")],
                "a",
                Some("env"),
                "'='",
            ),
            (
                vec![Registration::new("a", "x").env("", "1")],
                "a",
                Some("env"),
                "empty",
            ),
            (
                vec![Registration::new("a", "x").env("A", "\0")],
                "a",
                Some("env"),
                "NUL",
            ),
            (
                vec![Registration::new("a", "x").cwd("")],
                "a",
                Some("cwd"),
                "empty",
            ),
            (
                vec![Registration::new("a", "x").cwd("a\0")],
                "a",
                Some("cwd"),
                "NUL",
            ),
        ];
        for (regs, name, field, needle) in cases {
            let error = Registrations::from_vec(regs).unwrap_err();
            assert_eq!(error.registration(), Some(name), "{error}");
            assert_eq!(error.field(), field, "{error}");
            assert!(error.to_string().contains(needle), "{error}");
        }
    }

    #[test]
    fn load_inline() {
        let regs = Registrations::load(" \n\t{\"a\": {\"command\": \"x\"}}", ORIGIN).unwrap();
        assert!(regs.get("a").is_some());
        let error =
            Registrations::load(r#"{"a": {"command": "x", "workers": 0}}"#, ORIGIN).unwrap_err();
        assert_eq!(error.origin(), Some(ORIGIN));
        assert_error(&error, Some("workers"), &["got 0"]);
    }

    #[test]
    fn load_file() {
        let file = Temp::file("load", r#"{"a": {"command": "x", "workers": 3}}"#);
        let path = file.0.to_str().unwrap();
        let regs = Registrations::load(path, ORIGIN).unwrap();
        assert_eq!(regs.get("a").unwrap().workers, 3);

        let bad = Temp::file("bad", "\n{\"a\": {\"command\": \"x\", \"workers\": -2}}");
        let bad_path = bad.0.to_str().unwrap();
        let error = Registrations::load(bad_path, ORIGIN).unwrap_err();
        assert_error(&error, Some("workers"), &[bad_path, "got -2"]);
        assert_eq!(
            error.origin(),
            Some(format!("{ORIGIN} file \"{bad_path}\"").as_str())
        );

        let syntax = Temp::file("syntax", "{\n\"a\": }");
        let error = Registrations::load(syntax.0.to_str().unwrap(), ORIGIN).unwrap_err();
        assert_error(&error, None, &["malformed JSON", "line 2 column"]);
    }

    #[test]
    fn load_file_errors() {
        let missing = Temp::new("missing");
        let path = missing.0.to_str().unwrap();
        let error = Registrations::load(path, ORIGIN).unwrap_err();
        assert_error(&error, None, &["cannot read registrations file", path]);
        let source = std::error::Error::source(&error).unwrap();
        assert!(source.downcast_ref::<io::Error>().is_some());

        let dir = Temp::dir("isdir");
        let error = Registrations::load(dir.0.to_str().unwrap(), ORIGIN).unwrap_err();
        assert_error(&error, None, &["cannot read registrations file"]);

        let latin1 = Temp::new("latin1");
        std::fs::write(&latin1.0, b"{\"a\xe9\": {}}").unwrap();
        let error = Registrations::load(latin1.0.to_str().unwrap(), ORIGIN).unwrap_err();
        assert_error(&error, None, &["not valid UTF-8"]);

        for value in ["", "   ", "\n"] {
            let error = Registrations::load(value, ORIGIN).unwrap_err();
            assert_error(&error, None, &["empty value"]);
        }
        // Not starting with '{': a path, even if it looks like JSON.
        let error = Registrations::load("[]", ORIGIN).unwrap_err();
        assert_error(&error, None, &["cannot read registrations file \"[]\""]);
    }

    #[test]
    fn flag_and_env_sources() {
        let json = r#"{"a": {"command": "x"}}"#;
        let regs = Registrations::from_flag_or_env(Some(json))
            .unwrap()
            .unwrap();
        assert!(regs.get("a").is_some());
        let error = Registrations::from_flag_or_env(Some("")).unwrap_err();
        assert_eq!(error.origin(), Some("--agentloops"));

        assert!(from_sources(None, None).unwrap().is_none());
        assert!(from_sources(None, Some(OsString::new())).unwrap().is_none());
        let regs = from_sources(None, Some(OsString::from(json)))
            .unwrap()
            .unwrap();
        assert!(regs.get("a").is_some());
        // The flag wins over the environment.
        let other = r#"{"b": {"command": "x"}}"#;
        let regs = from_sources(Some(other), Some(OsString::from(json)))
            .unwrap()
            .unwrap();
        assert!(regs.get("b").is_some() && regs.get("a").is_none());
        let error = from_sources(None, Some(OsString::from("{}"))).unwrap_err();
        assert_eq!(error.origin(), Some(ENV_VAR));
        assert_error_env(&error, "no registrations");
        let error = from_sources(None, Some(OsString::from("   "))).unwrap_err();
        assert_error_env(&error, "empty value");
        let not_utf8 = std::os::unix::ffi::OsStringExt::from_vec(vec![b'{', 0xff]);
        let error = from_sources(None, Some(not_utf8)).unwrap_err();
        assert_error_env(&error, "not valid UTF-8");
    }

    fn assert_error_env(error: &ConfigError, needle: &str) {
        let message = error.to_string();
        assert!(message.starts_with("BRAIN_AGENTLOOPS: "), "{message}");
        assert!(message.contains(needle), "{message}");
    }

    #[test]
    fn resolve_relative_and_absolute_paths() {
        let dir = Temp::dir("resolve-path");
        std::fs::create_dir(dir.0.join("bin")).unwrap();
        write_mode(&dir.0.join("bin/tool"), 0o755);
        write_mode(&dir.0.join("bin/only-owner"), 0o700);
        write_mode(&dir.0.join("bin/plain"), 0o644);

        // Relative to Brain's working directory, not the registration's cwd.
        let reg = Registration::new("a", "./bin/tool").cwd("/nonexistent");
        assert_eq!(
            reg.resolve_command(&dir.0).unwrap(),
            dir.0.join("./bin/tool")
        );
        let reg = Registration::new("a", "bin/only-owner");
        assert_eq!(
            reg.resolve_command(&dir.0).unwrap(),
            dir.0.join("bin/only-owner")
        );
        let absolute = dir.0.join("bin/tool");
        let reg = Registration::new("a", absolute.to_str().unwrap());
        assert_eq!(
            reg.resolve_command(Path::new("/elsewhere")).unwrap(),
            absolute
        );

        let cases = [
            ("bin/plain", "is not executable (mode 644)"),
            ("bin/missing", "does not exist"),
            ("bin/", "is not a regular file"),
            ("./bin", "is not a regular file"),
        ];
        for (command, needle) in cases {
            let error = Registration::new("a", command)
                .resolve_command(&dir.0)
                .unwrap_err();
            assert_eq!(error.registration(), Some("a"));
            assert_eq!(error.field(), Some("command"));
            let message = error.to_string();
            assert!(message.contains(needle), "{message}");
            assert!(
                message.contains(&dir.0.join(command).display().to_string()),
                "{message}"
            );
        }
        let error = Registration::new("a", "")
            .resolve_command(&dir.0)
            .unwrap_err();
        assert_eq!(error.field(), Some("command"));
    }

    #[test]
    fn resolve_on_registration_path() {
        let dir = Temp::dir("resolve-env");
        for sub in ["one", "two", "three"] {
            std::fs::create_dir(dir.0.join(sub)).unwrap();
        }
        write_mode(&dir.0.join("one/tool"), 0o644);
        std::fs::create_dir(dir.0.join("two/tool")).unwrap();
        write_mode(&dir.0.join("three/tool"), 0o755);
        let one = dir.0.join("one");
        let path = format!("{}::two:{}", one.display(), dir.0.join("three").display());
        // Non-executable files and directories are passed over; "two" is relative to brain_cwd.
        let reg = Registration::new("a", "tool").env("PATH", path.clone());
        assert_eq!(
            reg.resolve_command(&dir.0).unwrap(),
            dir.0.join("three/tool")
        );

        let reg = Registration::new("a", "nothing-here").env("PATH", path);
        let error = reg.resolve_command(&dir.0).unwrap_err();
        assert_eq!(error.registration(), Some("a"));
        assert_eq!(error.field(), Some("command"));
        let message = error.to_string();
        for needle in [
            "\"nothing-here\" not found",
            "the registration's env PATH",
            &one.join("nothing-here").display().to_string(),
            &dir.0.join("two/nothing-here").display().to_string(),
        ] {
            assert!(message.contains(needle), "{message} lacks {needle}");
        }

        // Only a non-executable candidate: refused, naming it.
        let reg = Registration::new("a", "tool").env("PATH", one.display().to_string());
        let error = reg.resolve_command(&dir.0).unwrap_err();
        assert!(
            error
                .to_string()
                .contains(&one.join("tool").display().to_string())
        );

        // The registration's PATH replaces Brain's: "sh" is not in our directory.
        let reg = Registration::new("a", "sh").env("PATH", one.display().to_string());
        assert!(reg.resolve_command(&dir.0).is_err());

        let reg = Registration::new("a", "tool").env("PATH", "");
        let error = reg.resolve_command(&dir.0).unwrap_err();
        assert!(error.to_string().contains("nowhere to search"), "{error}");
        let reg = Registration::new("a", "tool").env("PATH", ":");
        let error = reg.resolve_command(&dir.0).unwrap_err();
        assert!(error.to_string().contains("tried nothing"), "{error}");
    }

    #[test]
    fn resolve_on_brain_path() {
        // Every POSIX system has `sh` on PATH; this reads the test process's PATH without changing it.
        let reg = Registration::new("a", "sh");
        let resolved = reg.resolve_command(Path::new("/")).unwrap();
        assert!(
            resolved.ends_with("sh") && resolved.is_file(),
            "{resolved:?}"
        );
        let reg = Registration::new("a", "brain-config-test-no-such-command");
        let error = reg.resolve_command(Path::new("/")).unwrap_err();
        assert!(error.to_string().contains("Brain's PATH"), "{error}");
    }

    #[test]
    fn many_candidates_are_bounded() {
        let dir = Temp::dir("resolve-many");
        let path = (0..20)
            .map(|i| format!("d{i}"))
            .collect::<Vec<_>>()
            .join(":");
        let reg = Registration::new("a", "tool").env("PATH", path);
        let error = reg.resolve_command(&dir.0).unwrap_err();
        assert!(error.to_string().contains("and 12 more"), "{error}");
    }
}
