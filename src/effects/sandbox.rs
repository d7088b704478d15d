//! The built-in `sandbox` environment driver: the `local` driver's tools, each call confined by
//! bubblewrap (docs/SECURITY.md).
//!
//! Its configuration is a `local` one (`tools`, optionally `workspace`) plus:
//!
//! ```json
//! {"tools": {"bash": {"command": ["bash", "-c", "…"], "timeout_ms": 10000}},
//!  "network": false,
//!  "limits": {"cpu_seconds": 30, "file_size_bytes": 268435456, "processes": 256,
//!             "address_space_bytes": 4294967296}}
//! ```
//!
//! Every call runs its command in a sandbox of its own ([`Bubblewrap::tool_command`]): the host's
//! system directories read-only, the environment's workspace read-write at `/workspace` (its
//! working directory and `HOME`), a private `/tmp`, fresh pid, ipc, uts, cgroup and network
//! namespaces (`"network": true` keeps the host's network), a cleared environment, no view of
//! Brain's data directory, of other sessions or of Brain's processes, and the per-call
//! [`Limits`] (each `limits` key optional; the defaults are [`Limits::default`]). The `local`
//! driver's deadline, output cap and process-group kill apply unchanged: killing bubblewrap
//! ends the sandbox's pid namespace, and with it everything the tool started.

use super::local::{self, WorkspaceRoots};
use super::{EffectError, EnvironmentDriver, ToolCall};
use crate::cancel::CancelToken;
use crate::protocol::harness::{ErrorCode, ToolResult};
use crate::sandbox::{Bubblewrap, Limits, SANDBOX_UID, SandboxUnavailable, WORKSPACE_MOUNT};
use crate::worker::process::SpawnSpec;
use serde_json::{Map, Value};
use std::path::PathBuf;

/// The keys of a `sandbox` environment's configuration.
const SANDBOX_KEYS: &[&str] = &["tools", "workspace", "network", "limits"];

/// The keys of its `limits`.
const LIMIT_KEYS: [&str; 4] = [
    "cpu_seconds",
    "file_size_bytes",
    "processes",
    "address_space_bytes",
];

/// The built-in `sandbox` environment driver (see the [module documentation](self)).
#[derive(Debug, Clone)]
pub struct SandboxDriver {
    bubblewrap: Bubblewrap,
    roots: WorkspaceRoots,
}

impl SandboxDriver {
    /// The name environments give as their `driver`: `sandbox`.
    pub const NAME: &'static str = "sandbox";

    /// The driver, once bubblewrap has proven it can sandbox on this host
    /// ([`Bubblewrap::probe`]). Refuses, naming the cause, where it cannot: tools are never run
    /// unsandboxed instead.
    pub fn probe() -> Result<SandboxDriver, SandboxUnavailable> {
        Ok(SandboxDriver {
            bubblewrap: Bubblewrap::probe()?,
            roots: WorkspaceRoots::default(),
        })
    }

    /// Lets an environment's `workspace` name a directory inside one of `roots`, as for
    /// [`LocalDriver::with_workspace_roots`](super::LocalDriver::with_workspace_roots).
    pub fn with_workspace_roots(mut self, roots: Vec<PathBuf>) -> SandboxDriver {
        self.roots = WorkspaceRoots::new(roots);
        self
    }
}

/// The `network` and `limits` of a configuration.
fn settings(configuration: &Map<String, Value>) -> Result<(bool, Limits), String> {
    let network = match configuration.get("network") {
        None => false,
        Some(Value::Bool(network)) => *network,
        Some(_) => return Err("network: must be true or false".into()),
    };
    let mut limits = Limits::default();
    match configuration.get("limits") {
        None => {}
        Some(Value::Object(given)) => {
            for (key, value) in given {
                let Some(number) = value.as_u64().filter(|n| *n > 0) else {
                    return Err(format!("limits.{key}: must be a positive integer"));
                };
                match key.as_str() {
                    "cpu_seconds" => limits.cpu_seconds = number,
                    "file_size_bytes" => limits.file_size_bytes = number,
                    "processes" => limits.processes = number,
                    "address_space_bytes" => limits.address_space_bytes = number,
                    _ => {
                        return Err(format!(
                            "limits.{key}: unknown key (known: {})",
                            LIMIT_KEYS.join(", ")
                        ));
                    }
                }
            }
        }
        Some(_) => {
            return Err(format!(
                "limits: must be an object of {}",
                LIMIT_KEYS.join(", ")
            ));
        }
    }
    Ok((network, limits))
}

impl EnvironmentDriver for SandboxDriver {
    fn validate(&self, configuration: &Map<String, Value>) -> Result<(), String> {
        local::check_configuration(configuration, SANDBOX_KEYS, &self.roots)?;
        settings(configuration).map(|_| ())
    }

    fn call_tool(
        &self,
        call: &ToolCall<'_>,
        cancel: &CancelToken,
    ) -> Result<ToolResult, EffectError> {
        let (network, limits) =
            settings(&call.environment.configuration).map_err(|error| EffectError::Failed {
                code: ErrorCode::ToolFailed,
                message: format!(
                    "environment {:?} has an invalid configuration: {error}",
                    call.environment.name
                ),
            })?;
        let prepared = local::prepare(call, SANDBOX_KEYS, &self.roots, cancel)?;
        if self.bubblewrap.runs_tools_as_nobody() {
            // The tool runs as nobody: its workspace must be nobody's to write in.
            std::os::unix::fs::chown(&prepared.workspace, Some(SANDBOX_UID), Some(SANDBOX_UID))
                .map_err(|error| EffectError::Failed {
                    code: ErrorCode::ToolFailed,
                    message: format!(
                        "cannot hand the workspace {} to the sandbox's user: {error}",
                        prepared.workspace.display()
                    ),
                })?;
        }
        let spawn = SpawnSpec {
            program: self.bubblewrap.program().to_path_buf(),
            args: self.bubblewrap.tool_command(
                &prepared.workspace,
                network,
                &limits,
                &prepared.tool.command,
            ),
            env: sandbox_environment(),
            cwd: Some(PathBuf::from("/")),
        };
        local::run(call, &prepared.tool, spawn, prepared.input, cancel)
    }
}

/// The whole environment a sandboxed tool gets: a `PATH` of the system directories, `HOME` and
/// the working directory at the workspace, `/tmp` as `TMPDIR`, and Brain's locale settings.
fn sandbox_environment() -> Vec<(String, String)> {
    let mut env = vec![
        ("PATH".to_owned(), local::DEFAULT_PATH.to_owned()),
        ("HOME".to_owned(), WORKSPACE_MOUNT.to_owned()),
        ("TMPDIR".to_owned(), "/tmp".to_owned()),
    ];
    for name in ["LANG", "LC_ALL", "TZ"] {
        if let Ok(value) = std::env::var(name) {
            env.push((name.to_owned(), value));
        }
    }
    env
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
    fn limits_default_and_each_key_overrides_one() {
        let (network, limits) = settings(&config(json!({"tools": {}}))).expect("valid");
        assert!(!network);
        assert_eq!(limits, Limits::default());
        let (network, limits) = settings(&config(
            json!({"network": true, "limits": {"processes": 8, "cpu_seconds": 2}}),
        ))
        .expect("valid");
        assert!(network);
        assert_eq!(limits.processes, 8);
        assert_eq!(limits.cpu_seconds, 2);
        assert_eq!(limits.file_size_bytes, Limits::default().file_size_bytes);
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        for (bad, expected) in [
            (json!({"network": "yes"}), "network: must be true or false"),
            (
                json!({"limits": {"processes": 0}}),
                "limits.processes: must be a positive integer",
            ),
            (json!({"limits": {"pids": 3}}), "limits.pids: unknown key"),
            (json!({"limits": 3}), "limits: must be an object"),
        ] {
            let error = settings(&config(bad)).expect_err("refused");
            assert!(error.starts_with(expected), "{error}");
        }
    }
}
