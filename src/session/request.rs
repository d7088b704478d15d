//! Create-session requests: the types, strict parsing of untrusted JSON, and validation.
//!
//! A request arrives from HTTP or from a library caller. Parsing is strict: unknown keys are
//! refused at the top level, in `agentloop`, in each grant, tool and environment, naming the key.
//! `agentloop` in particular accepts only `name`, `configuration` and `environments`: sessions
//! never choose what runs. Inside `model`, `transcript`, `metadata` and the free-form
//! configurations, keys are not checked here (model metadata keeps extra keys by design; transcript
//! blocks follow the protocol types; configurations are checked against the harness's declared keys
//! by [`check_against_harness`](crate::session::check_against_harness)).
//!
//! Every refusal is an [`ErrorCode::InvalidRequest`] [`RequestError`] whose message names the
//! offending field, key or value; shown values are truncated so that an untrusted body cannot make
//! an error message large.

use crate::protocol::harness::{ErrorCode, Message, ModelMetadata};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::fmt;

/// Longest registration, environment, tool or driver name, in bytes (all are ASCII).
pub const MAX_NAME_LEN: usize = 64;

/// Most characters of an untrusted value shown in an error message.
const SHOWN_CHARS: usize = 100;

/// Most characters of any error message built here.
const MAX_MESSAGE_CHARS: usize = 1024;

/// Most unknown keys named in one message.
const MAX_NAMED_KEYS: usize = 5;

const REQUEST_KEYS: [&str; 7] = [
    "agentloop",
    "model",
    "system",
    "tools",
    "environments",
    "transcript",
    "metadata",
];
const SELECTION_KEYS: [&str; 3] = ["name", "configuration", "environments"];
const GRANT_KEYS: [&str; 2] = ["environment", "permissions"];
const TOOL_KEYS: [&str; 4] = ["name", "description", "input_schema", "placements"];
const ENVIRONMENT_KEYS: [&str; 3] = ["name", "driver", "configuration"];

/// The provider of the default model metadata.
pub const DEFAULT_MODEL_PROVIDER: &str = "scripted";

/// The name of the default model metadata.
pub const DEFAULT_MODEL_NAME: &str = "default";

/// A session's choice of harness: a registration name, session configuration and environment
/// grants. Nothing here can choose a command, arguments or code.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selection {
    /// The startup registration that runs the session (1–64 of `[A-Za-z0-9_-]`).
    pub name: String,
    /// The session's configuration, merged over the registration's deployment configuration.
    #[serde(default)]
    pub configuration: Map<String, Value>,
    /// The harness's access to the session's declared environments.
    #[serde(default)]
    pub environments: Vec<Grant>,
}

impl Selection {
    /// The grant for the environment `name`, if the harness has one.
    pub fn grant(&self, name: &str) -> Option<&Grant> {
        self.environments.iter().find(|g| g.environment == name)
    }
}

/// Access the harness has to one declared environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// The environment's name; it must be declared in the request's `environments`.
    pub environment: String,
    /// What the harness may do with it.
    pub permissions: Vec<Permission>,
}

impl Grant {
    /// Whether the grant includes `permission`.
    pub fn allows(&self, permission: Permission) -> bool {
        self.permissions.contains(&permission)
    }
}

/// One permission of a [`Grant`] (PROTOCOL.md §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Permission {
    /// `environments.list` and `environments.get`.
    Read,
    /// `environments.call`.
    Call,
    /// `environments.setup`.
    Setup,
}

impl Permission {
    /// Every permission.
    pub const ALL: [Permission; 3] = [Permission::Read, Permission::Call, Permission::Setup];

    /// The permission's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Permission::Read => "read",
            Permission::Call => "call",
            Permission::Setup => "setup",
        }
    }
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The input schema of a tool declared without one: any JSON object.
pub fn default_input_schema() -> Value {
    serde_json::json!({"type": "object"})
}

/// A tool the session declares, with the names of the environments it runs in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    /// The tool's name (1–64 of `[A-Za-z0-9_.-]`), unique in the session.
    pub name: String,
    /// What the tool does, for the model; default empty.
    #[serde(default)]
    pub description: String,
    /// The JSON Schema of the tool's input: a JSON object; default [`default_input_schema`].
    #[serde(default = "default_input_schema")]
    pub input_schema: Value,
    /// Names of declared environments the tool runs in; the first is the default. Each at most
    /// once.
    #[serde(default)]
    pub placements: Vec<String>,
}

/// An environment the session declares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentDecl {
    /// The environment's name (1–64 of `[A-Za-z0-9_.-]`), unique in the session.
    pub name: String,
    /// The driver that runs it, e.g. `local` (1–64 of `[A-Za-z0-9_.-]`; whether it exists is the
    /// dispatcher's check).
    pub driver: String,
    /// The driver's configuration, interpreted by the driver.
    #[serde(default)]
    pub configuration: Map<String, Value>,
}

/// A request to create a session (PROTOCOL.md §2).
///
/// Build one in code and call [`CreateSession::validate`], or parse untrusted JSON with
/// [`CreateSession::parse`], which validates too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// Which registration runs the session, its configuration and its grants.
    pub agentloop: Selection,
    /// Advisory model metadata, never credentials; absent means
    /// [`CreateSession::model_or_default`]'s default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelMetadata>,
    /// The system prompt, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// The session's tools.
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    /// The session's environments.
    #[serde(default)]
    pub environments: Vec<EnvironmentDecl>,
    /// A transcript to import (only for harnesses declaring `transcript_import`).
    #[serde(default)]
    pub transcript: Vec<Message>,
    /// The caller's own metadata, kept as given.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

impl CreateSession {
    /// Parses an untrusted JSON body strictly, then [validates](CreateSession::validate) it.
    ///
    /// Refused, each as [`ErrorCode::InvalidRequest`] naming the key or field: malformed JSON or a
    /// non-object body; an unknown top-level key; a missing `agentloop`; any key in `agentloop`
    /// other than `name`, `configuration`, `environments` (`command`, `args`, `code`, … — sessions
    /// never choose what runs); an unknown key in a grant, tool or environment; a value of the
    /// wrong type; a permission other than `read`, `call`, `setup`; and everything
    /// [`validate`](CreateSession::validate) refuses. `null` means absent for `model` and `system`
    /// only.
    pub fn parse(json: &[u8]) -> Result<CreateSession, RequestError> {
        let value: Value = serde_json::from_slice(json)
            .map_err(|e| invalid(format!("the request is not valid JSON: {e}")))?;
        let mut top = match value {
            Value::Object(top) => top,
            other => {
                return Err(invalid(format!(
                    "the request must be a JSON object, not {}",
                    kind(&other)
                )));
            }
        };
        check_keys(
            &top,
            "the request",
            &REQUEST_KEYS,
            "only agentloop, model, system, tools, environments, transcript, metadata are accepted",
        )?;
        let agentloop = match top.remove("agentloop") {
            Some(value) => parse_selection(value)?,
            None => {
                return Err(invalid(
                    "the request has no \"agentloop\": it must name the registration that runs \
                     the session, as {\"agentloop\": {\"name\": …}}"
                        .to_owned(),
                ));
            }
        };
        let model = match top.remove("model") {
            None | Some(Value::Null) => None,
            Some(value) => {
                if let Value::Object(model) = &value {
                    check_field::<String>(model, "provider", "model")?;
                    check_field::<String>(model, "name", "model")?;
                    check_field::<Option<u64>>(model, "context_window", "model")?;
                    check_field::<Option<u64>>(model, "max_output_tokens", "model")?;
                }
                Some(typed::<ModelMetadata>(value, "model")?)
            }
        };
        let system = match top.remove("system") {
            None | Some(Value::Null) => None,
            Some(value) => Some(typed::<String>(value, "system")?),
        };
        let tools = match top.remove("tools") {
            None => Vec::new(),
            Some(value) => array(value, "tools", |item, path| {
                let item = object(
                    item,
                    path,
                    &TOOL_KEYS,
                    "only name, description, input_schema, placements are accepted",
                )?;
                check_field::<String>(&item, "name", path)?;
                check_field::<String>(&item, "description", path)?;
                check_field::<Vec<String>>(&item, "placements", path)?;
                typed::<ToolSpec>(Value::Object(item), path)
            })?,
        };
        let environments = match top.remove("environments") {
            None => Vec::new(),
            Some(value) => array(value, "environments", |item, path| {
                let item = object(
                    item,
                    path,
                    &ENVIRONMENT_KEYS,
                    "only name, driver, configuration are accepted",
                )?;
                check_field::<String>(&item, "name", path)?;
                check_field::<String>(&item, "driver", path)?;
                check_field::<Map<String, Value>>(&item, "configuration", path)?;
                typed::<EnvironmentDecl>(Value::Object(item), path)
            })?,
        };
        let transcript = match top.remove("transcript") {
            None => Vec::new(),
            Some(value) => array(value, "transcript", |item, path| {
                typed::<Message>(item, path)
            })?,
        };
        let metadata = match top.remove("metadata") {
            None => Map::new(),
            Some(value) => typed::<Map<String, Value>>(value, "metadata")?,
        };
        let request = CreateSession {
            agentloop,
            model,
            system,
            tools,
            environments,
            transcript,
            metadata,
        };
        request.validate()?;
        Ok(request)
    }

    /// Checks what typing alone cannot, for a request parsed or built in code. Refused, each as
    /// [`ErrorCode::InvalidRequest`] naming the field and value:
    ///
    /// - `agentloop.name` that is not a registration name (1–64 of `[A-Za-z0-9_-]`);
    /// - an environment name, driver or tool name that is not 1–64 of `[A-Za-z0-9_.-]`, or an
    ///   environment named `.` or `..` (each environment's workspace is a directory of that name);
    /// - an environment or tool declared twice;
    /// - a tool whose `input_schema` is not a JSON object;
    /// - a placement naming an undeclared environment, or naming one twice in a tool;
    /// - a grant naming an undeclared environment, or a second grant for one environment;
    /// - model metadata with an empty `provider` or `name`.
    pub fn validate(&self) -> Result<(), RequestError> {
        if !is_registration_name(&self.agentloop.name) {
            return Err(invalid(format!(
                "agentloop.name: {} is not a registration name (1–{MAX_NAME_LEN} ASCII letters, \
                 digits, \"_\" or \"-\")",
                shown(&self.agentloop.name)
            )));
        }

        let mut declared: HashSet<&str> = HashSet::new();
        for (i, environment) in self.environments.iter().enumerate() {
            check_resource_name(&environment.name, &format!("environments[{i}].name"))?;
            if matches!(environment.name.as_str(), "." | "..") {
                // The name is a directory of the session's workspaces.
                return Err(invalid(format!(
                    "environments[{i}].name: {} is not a valid environment name (it names a \
                     directory: use letters or digits)",
                    shown(&environment.name)
                )));
            }
            check_resource_name(&environment.driver, &format!("environments[{i}].driver"))?;
            if !declared.insert(&environment.name) {
                return Err(invalid(format!(
                    "environments[{i}].name: environment {} is declared twice",
                    shown(&environment.name)
                )));
            }
        }

        let mut tools: HashSet<&str> = HashSet::new();
        for (i, tool) in self.tools.iter().enumerate() {
            check_resource_name(&tool.name, &format!("tools[{i}].name"))?;
            if !tools.insert(&tool.name) {
                return Err(invalid(format!(
                    "tools[{i}].name: tool {} is declared twice",
                    shown(&tool.name)
                )));
            }
            if !tool.input_schema.is_object() {
                return Err(invalid(format!(
                    "tools[{i}].input_schema: must be a JSON object (a JSON Schema), not {}",
                    kind(&tool.input_schema)
                )));
            }
            let mut placed: HashSet<&str> = HashSet::new();
            for (j, placement) in tool.placements.iter().enumerate() {
                if !declared.contains(placement.as_str()) {
                    return Err(invalid(format!(
                        "tools[{i}].placements[{j}]: environment {} is not declared in the \
                         request's environments",
                        shown(placement)
                    )));
                }
                if !placed.insert(placement) {
                    return Err(invalid(format!(
                        "tools[{i}].placements[{j}]: environment {} is listed twice",
                        shown(placement)
                    )));
                }
            }
        }

        let mut granted: HashSet<&str> = HashSet::new();
        for (i, grant) in self.agentloop.environments.iter().enumerate() {
            if !declared.contains(grant.environment.as_str()) {
                return Err(invalid(format!(
                    "agentloop.environments[{i}].environment: {} is not declared in the request's \
                     environments",
                    shown(&grant.environment)
                )));
            }
            if !granted.insert(&grant.environment) {
                return Err(invalid(format!(
                    "agentloop.environments[{i}].environment: {} is granted twice",
                    shown(&grant.environment)
                )));
            }
        }

        if let Some(model) = &self.model {
            if model.provider.is_empty() {
                return Err(invalid("model.provider: must not be empty".to_owned()));
            }
            if model.name.is_empty() {
                return Err(invalid("model.name: must not be empty".to_owned()));
            }
        }
        Ok(())
    }

    /// The request's model metadata, or `{"provider":"scripted","name":"default"}` when it has
    /// none.
    pub fn model_or_default(&self) -> ModelMetadata {
        match &self.model {
            Some(model) => model.clone(),
            None => ModelMetadata {
                provider: DEFAULT_MODEL_PROVIDER.to_owned(),
                name: DEFAULT_MODEL_NAME.to_owned(),
                context_window: None,
                max_output_tokens: None,
                extra: Map::new(),
            },
        }
    }
}

/// Why a create-session request (or a later input) was refused: a protocol error code and a
/// bounded message naming the key, field or value.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestError {
    /// The code the API answers with.
    pub code: ErrorCode,
    /// What was wrong, for people; at most about 1 KiB.
    pub message: String,
}

impl RequestError {
    /// An error with `code`; the message is truncated to a bounded length.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> RequestError {
        RequestError {
            code,
            message: bounded(message.into()),
        }
    }
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for RequestError {}

/// Whether `name` is a registration name: 1–64 ASCII letters, digits, `_` or `-`.
pub fn is_registration_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Whether `name` is a tool, environment or driver name: 1–64 ASCII letters, digits, `_`, `.` or
/// `-`.
pub fn is_resource_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

fn check_resource_name(name: &str, path: &str) -> Result<(), RequestError> {
    if is_resource_name(name) {
        Ok(())
    } else {
        Err(invalid(format!(
            "{path}: {} is not a valid name (1–{MAX_NAME_LEN} ASCII letters, digits, \"_\", \".\" \
             or \"-\")",
            shown(name)
        )))
    }
}

fn parse_selection(value: Value) -> Result<Selection, RequestError> {
    let mut selection = object(
        value,
        "agentloop",
        &SELECTION_KEYS,
        "sessions never choose what runs; only name, configuration, environments are accepted",
    )?;
    let name = match selection.remove("name") {
        Some(value) => typed::<String>(value, "agentloop.name")?,
        None => {
            return Err(invalid(
                "agentloop: missing \"name\", the registration that runs the session".to_owned(),
            ));
        }
    };
    let configuration = match selection.remove("configuration") {
        Some(value) => typed::<Map<String, Value>>(value, "agentloop.configuration")?,
        None => Map::new(),
    };
    let environments = match selection.remove("environments") {
        Some(value) => array(value, "agentloop.environments", parse_grant)?,
        None => Vec::new(),
    };
    Ok(Selection {
        name,
        configuration,
        environments,
    })
}

fn parse_grant(value: Value, path: &str) -> Result<Grant, RequestError> {
    let mut grant = object(
        value,
        path,
        &GRANT_KEYS,
        "only environment, permissions are accepted",
    )?;
    let environment = match grant.remove("environment") {
        Some(value) => typed::<String>(value, &format!("{path}.environment"))?,
        None => return Err(invalid(format!("{path}: missing \"environment\""))),
    };
    let permissions = match grant.remove("permissions") {
        Some(value) => array(
            value,
            &format!("{path}.permissions"),
            |item, path| match item {
                Value::String(text) => Permission::ALL
                    .into_iter()
                    .find(|p| p.as_str() == text)
                    .ok_or_else(|| {
                        invalid(format!(
                            "{path}: unknown permission {} (only read, call, setup)",
                            shown(&text)
                        ))
                    }),
                other => Err(invalid(format!(
                    "{path}: a permission must be a string, not {}",
                    kind(&other)
                ))),
            },
        )?,
        None => {
            return Err(invalid(format!(
                "{path}: missing \"permissions\" (a list of read, call, setup)"
            )));
        }
    };
    Ok(Grant {
        environment,
        permissions,
    })
}

/// `value` as an object whose keys are all in `allowed`; otherwise an error naming `path` and the
/// unknown keys, followed by `hint`.
fn object(
    value: Value,
    path: &str,
    allowed: &[&str],
    hint: &str,
) -> Result<Map<String, Value>, RequestError> {
    match value {
        Value::Object(map) => {
            check_keys(&map, path, allowed, hint)?;
            Ok(map)
        }
        other => Err(invalid(format!(
            "{path}: must be a JSON object, not {}",
            kind(&other)
        ))),
    }
}

fn check_keys(
    map: &Map<String, Value>,
    path: &str,
    allowed: &[&str],
    hint: &str,
) -> Result<(), RequestError> {
    let unknown: Vec<&String> = map
        .keys()
        .filter(|key| !allowed.contains(&key.as_str()))
        .collect();
    match unknown.as_slice() {
        [] => Ok(()),
        [key] => Err(invalid(format!(
            "{path}: unknown key {} ({hint})",
            shown(key)
        ))),
        keys => {
            let named: Vec<String> = keys
                .iter()
                .take(MAX_NAMED_KEYS)
                .map(|key| shown(key))
                .collect();
            let more = if keys.len() > MAX_NAMED_KEYS {
                format!(", … ({} in all)", keys.len())
            } else {
                String::new()
            };
            Err(invalid(format!(
                "{path}: unknown keys {}{more} ({hint})",
                named.join(", ")
            )))
        }
    }
}

fn array<T>(
    value: Value,
    path: &str,
    mut each: impl FnMut(Value, &str) -> Result<T, RequestError>,
) -> Result<Vec<T>, RequestError> {
    match value {
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| each(item, &format!("{path}[{i}]")))
            .collect(),
        other => Err(invalid(format!(
            "{path}: must be a JSON array, not {}",
            kind(&other)
        ))),
    }
}

/// Deserializes `object[key]`, when present, only to report a type error naming `path.key`.
fn check_field<T: DeserializeOwned>(
    object: &Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<(), RequestError> {
    match object.get(key) {
        Some(value) => T::deserialize(value)
            .map(drop)
            .map_err(|e| invalid(format!("{path}.{key}: {e}"))),
        None => Ok(()),
    }
}

fn typed<T: DeserializeOwned>(value: Value, path: &str) -> Result<T, RequestError> {
    serde_json::from_value(value).map_err(|e| invalid(format!("{path}: {e}")))
}

fn invalid(message: String) -> RequestError {
    RequestError::new(ErrorCode::InvalidRequest, message)
}

/// The JSON type of `value`, with an article, for messages.
pub(crate) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `text` quoted and escaped for a message, truncated to [`SHOWN_CHARS`] characters.
pub(crate) fn shown(text: &str) -> String {
    let mut chars = text.chars();
    let head: String = chars.by_ref().take(SHOWN_CHARS).collect();
    if chars.next().is_some() {
        format!("{head:?}…")
    } else {
        format!("{head:?}")
    }
}

/// `message` truncated to [`MAX_MESSAGE_CHARS`] characters.
fn bounded(message: String) -> String {
    match message.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((cut, _)) => {
            let mut message = message;
            message.truncate(cut);
            message.push('…');
            message
        }
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::{Block, Role};
    use serde_json::json;

    /// The example of PROTOCOL.md §2, verbatim.
    const PROTOCOL_EXAMPLE: &str = r#"
{"agentloop": {"name": "pi", "configuration": {"thinking": "high"},
               "environments": [{"environment": "workspace", "permissions": ["read", "call"]}]},
 "model": {"provider": "openai", "name": "gpt-5-mini", "context_window": 400000, "max_output_tokens": 32000},
 "system": "You are terse.",
 "tools": [{"name": "bash", "description": "Run a command", "input_schema": {"type": "object"},
            "placements": ["workspace"]}],
 "environments": [{"name": "workspace", "driver": "local",
                   "configuration": {"tools": {"bash": {"command": ["bash", "-c", "…"], "timeout_ms": 30000}}}}],
 "transcript": [],
 "metadata": {}}"#;

    fn parse(value: Value) -> Result<CreateSession, RequestError> {
        CreateSession::parse(value.to_string().as_bytes())
    }

    /// Parses `value`, expects an `invalid_request` refusal, and checks that its message contains
    /// every one of `named`.
    fn refused(value: Value, named: &[&str]) -> RequestError {
        let error = match parse(value.clone()) {
            Ok(request) => panic!("{value} accepted as {request:?}"),
            Err(error) => error,
        };
        assert_eq!(error.code, ErrorCode::InvalidRequest, "{error}");
        for name in named {
            assert!(
                error.message.contains(name),
                "{value}: message {:?} does not name {name:?}",
                error.message
            );
        }
        error
    }

    fn minimal() -> Value {
        json!({"agentloop": {"name": "echo"}})
    }

    /// A valid request with one environment `workspace` to grant and place tools in.
    fn with_workspace() -> Value {
        json!({
            "agentloop": {"name": "pi",
                          "environments": [{"environment": "workspace", "permissions": ["read"]}]},
            "tools": [{"name": "bash", "placements": ["workspace"]}],
            "environments": [{"name": "workspace", "driver": "local"}]
        })
    }

    #[test]
    fn an_environment_named_like_a_directory_step_is_refused() {
        for name in [".", ".."] {
            refused(
                json!({"agentloop": {"name": "echo"},
                       "environments": [{"name": name, "driver": "local"}]}),
                &["environments[0].name", "not a valid environment name"],
            );
        }
    }

    #[test]
    fn the_protocol_example_parses() {
        let request = CreateSession::parse(PROTOCOL_EXAMPLE.as_bytes()).unwrap();
        assert_eq!(request.agentloop.name, "pi");
        assert_eq!(
            Value::Object(request.agentloop.configuration.clone()),
            json!({"thinking": "high"})
        );
        let grant = request.agentloop.grant("workspace").unwrap();
        assert!(grant.allows(Permission::Read) && grant.allows(Permission::Call));
        assert!(!grant.allows(Permission::Setup));
        assert!(request.agentloop.grant("elsewhere").is_none());
        let model = request.model.clone().unwrap();
        assert_eq!(
            (model.provider.as_str(), model.name.as_str()),
            ("openai", "gpt-5-mini")
        );
        assert_eq!(model.context_window, Some(400_000));
        assert_eq!(model.max_output_tokens, Some(32_000));
        assert_eq!(request.model_or_default(), model);
        assert_eq!(request.system.as_deref(), Some("You are terse."));
        assert_eq!(
            request.tools,
            vec![ToolSpec {
                name: "bash".into(),
                description: "Run a command".into(),
                input_schema: json!({"type": "object"}),
                placements: vec!["workspace".into()],
            }]
        );
        assert_eq!(request.environments.len(), 1);
        assert_eq!(request.environments[0].driver, "local");
        assert_eq!(
            request.environments[0].configuration["tools"]["bash"]["timeout_ms"],
            json!(30000)
        );
        assert!(request.transcript.is_empty() && request.metadata.is_empty());

        // What Brain stores parses back to the same request, strictly and through plain serde.
        let stored = serde_json::to_vec(&request).unwrap();
        assert_eq!(CreateSession::parse(&stored).unwrap(), request);
        assert_eq!(
            serde_json::from_slice::<CreateSession>(&stored).unwrap(),
            request
        );
    }

    #[test]
    fn absent_fields_take_their_defaults() {
        let request = parse(minimal()).unwrap();
        assert_eq!(request.agentloop.name, "echo");
        assert!(request.agentloop.configuration.is_empty());
        assert!(request.agentloop.environments.is_empty());
        assert!(request.model.is_none() && request.system.is_none());
        assert!(request.tools.is_empty() && request.environments.is_empty());
        assert!(request.transcript.is_empty() && request.metadata.is_empty());
        let model = request.model_or_default();
        assert_eq!(
            serde_json::to_value(&model).unwrap(),
            json!({"provider": "scripted", "name": "default"})
        );

        let request = parse(
            json!({"agentloop": {"name": "echo"}, "model": null, "system": null,
                                   "tools": [{"name": "t"}]}),
        )
        .unwrap();
        assert!(request.model.is_none() && request.system.is_none());
        assert_eq!(request.tools[0].description, "");
        assert_eq!(request.tools[0].input_schema, default_input_schema());
        assert!(request.tools[0].placements.is_empty());
        assert_eq!(
            serde_json::from_value::<ToolSpec>(json!({"name": "t"})).unwrap(),
            request.tools[0]
        );

        let request = parse(json!({"agentloop": {"name": "echo"},
                                   "environments": [{"name": "e", "driver": "local"}],
                                   "transcript": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                   "metadata": {"owner": "me"}}))
        .unwrap();
        assert!(request.environments[0].configuration.is_empty());
        assert_eq!(request.transcript, vec![Message::text(Role::User, "hi")]);
        assert_eq!(request.metadata["owner"], json!("me"));
    }

    #[test]
    fn malformed_bodies_are_refused() {
        for body in [
            &b""[..],
            b"{",
            b"not json",
            b"{\"agentloop\": }",
            b"\xff\xfe",
        ] {
            let error = CreateSession::parse(body).unwrap_err();
            assert_eq!(error.code, ErrorCode::InvalidRequest);
            assert!(error.message.contains("not valid JSON"), "{error}");
        }
        refused(json!([]), &["JSON object", "an array"]);
        refused(json!("agentloop"), &["JSON object", "a string"]);
        refused(json!(null), &["JSON object", "null"]);
        // Nesting deeper than serde_json's limit is refused, not a stack overflow.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(
            CreateSession::parse(deep.as_bytes()).unwrap_err().code,
            ErrorCode::InvalidRequest
        );
    }

    #[test]
    fn unknown_top_level_keys_are_refused_by_name() {
        let mut request = minimal();
        request["command"] = json!("rm -rf /");
        refused(request, &["unknown key \"command\"", "agentloop, model"]);

        let mut request = minimal();
        request["zeta"] = json!(1);
        request["alpha"] = json!(2);
        refused(request, &["unknown keys", "\"alpha\"", "\"zeta\""]);

        let mut request = minimal();
        for i in 0..20 {
            request[format!("k{i:02}")] = json!(i);
        }
        let error = refused(request, &["\"k00\"", "(20 in all)"]);
        assert!(!error.message.contains("\"k19\""), "{error}");
    }

    #[test]
    fn the_selection_never_chooses_what_runs() {
        for key in [
            "command",
            "args",
            "code",
            "implementation",
            "env",
            "cwd",
            "workers",
            "max_concurrency",
            "Name",
        ] {
            let request = json!({"agentloop": {"name": "echo", key: "x"}});
            let error = refused(
                request,
                &[
                    "agentloop",
                    &format!("unknown key \"{key}\""),
                    "sessions never choose what runs",
                    "only name, configuration, environments",
                ],
            );
            assert_eq!(
                error.to_string(),
                format!("invalid_request: {}", error.message)
            );
        }
        refused(
            json!({"agentloop": {"name": "echo", "command": "sh", "args": ["-c"]}}),
            &["\"args\"", "\"command\"", "sessions never choose what runs"],
        );
        // Plain serde is as strict.
        assert!(
            serde_json::from_value::<CreateSession>(
                json!({"agentloop": {"name": "echo", "command": "sh"}})
            )
            .is_err()
        );
    }

    #[test]
    fn the_selection_must_be_present_and_well_formed() {
        refused(json!({}), &["\"agentloop\""]);
        refused(
            json!({"model": {"provider": "p", "name": "n"}}),
            &["\"agentloop\""],
        );
        refused(json!({"agentloop": "pi"}), &["agentloop", "a string"]);
        refused(json!({"agentloop": null}), &["agentloop", "null"]);
        refused(json!({"agentloop": {}}), &["agentloop", "\"name\""]);
        refused(
            json!({"agentloop": {"name": 7}}),
            &["agentloop.name", "integer"],
        );
        refused(
            json!({"agentloop": {"name": "echo", "configuration": []}}),
            &["agentloop.configuration"],
        );
        refused(
            json!({"agentloop": {"name": "echo", "configuration": null}}),
            &["agentloop.configuration"],
        );
        refused(
            json!({"agentloop": {"name": "echo", "environments": {}}}),
            &["agentloop.environments", "array"],
        );
    }

    #[test]
    fn the_selection_name_follows_the_registration_rule() {
        assert!(parse(json!({"agentloop": {"name": "A-z_09"}})).is_ok());
        assert!(parse(json!({"agentloop": {"name": "x".repeat(64)}})).is_ok());
        for name in ["", "a b", "pi.v2", "../pi", "pi/x", "é", "pi\n"] {
            refused(
                json!({"agentloop": {"name": name}}),
                &["agentloop.name", &format!("{name:?}"), "registration name"],
            );
        }
        refused(
            json!({"agentloop": {"name": "x".repeat(65)}}),
            &["agentloop.name", "registration name"],
        );
    }

    #[test]
    fn grants_are_checked() {
        assert!(parse(with_workspace()).is_ok());

        let mut request = with_workspace();
        request["agentloop"]["environments"][0]["environment"] = json!("elsewhere");
        refused(
            request,
            &[
                "agentloop.environments[0].environment",
                "\"elsewhere\"",
                "not declared",
            ],
        );

        let mut request = with_workspace();
        request["agentloop"]["environments"] = json!([
            {"environment": "workspace", "permissions": ["read"]},
            {"environment": "workspace", "permissions": ["call"]}]);
        refused(
            request,
            &[
                "agentloop.environments[1]",
                "\"workspace\"",
                "granted twice",
            ],
        );

        let mut request = with_workspace();
        request["agentloop"]["environments"][0]["permissions"] = json!(["read", "write"]);
        refused(
            request,
            &[
                "agentloop.environments[0].permissions[1]",
                "\"write\"",
                "read, call, setup",
            ],
        );

        let mut request = with_workspace();
        request["agentloop"]["environments"][0]["permissions"] = json!(["READ"]);
        refused(request, &["\"READ\""]);

        let mut request = with_workspace();
        request["agentloop"]["environments"][0]["permissions"] = json!([1]);
        refused(
            request,
            &["agentloop.environments[0].permissions[0]", "a number"],
        );

        let mut request = with_workspace();
        request["agentloop"]["environments"][0]["permissions"] = json!("read");
        refused(request, &["agentloop.environments[0].permissions", "array"]);

        let mut request = with_workspace();
        request["agentloop"]["environments"][0] = json!({"environment": "workspace"});
        refused(request, &["agentloop.environments[0]", "\"permissions\""]);

        let mut request = with_workspace();
        request["agentloop"]["environments"][0] = json!({"permissions": []});
        refused(request, &["agentloop.environments[0]", "\"environment\""]);

        let mut request = with_workspace();
        request["agentloop"]["environments"][0]["scope"] = json!("all");
        refused(
            request,
            &["agentloop.environments[0]", "unknown key \"scope\""],
        );

        let mut request = with_workspace();
        request["agentloop"]["environments"][0] = json!("workspace");
        refused(request, &["agentloop.environments[0]", "a string"]);

        // Every permission parses; an empty list is a grant of nothing.
        let mut request = with_workspace();
        request["agentloop"]["environments"][0]["permissions"] = json!(["read", "call", "setup"]);
        let parsed = parse(request).unwrap();
        assert_eq!(
            parsed.agentloop.environments[0].permissions,
            Permission::ALL.to_vec()
        );
        let mut request = with_workspace();
        request["agentloop"]["environments"][0]["permissions"] = json!([]);
        assert!(
            parse(request).unwrap().agentloop.environments[0]
                .permissions
                .is_empty()
        );
    }

    #[test]
    fn environments_are_checked() {
        let mut request = with_workspace();
        request["environments"] = json!([
            {"name": "workspace", "driver": "local"},
            {"name": "workspace", "driver": "local"}]);
        refused(
            request,
            &["environments[1].name", "\"workspace\"", "declared twice"],
        );

        for name in ["", "a b", "a/b", "x".repeat(65).as_str()] {
            refused(
                json!({"agentloop": {"name": "pi"},
                       "environments": [{"name": name, "driver": "local"}]}),
                &["environments[0].name", "not a valid name"],
            );
        }
        assert!(
            parse(json!({"agentloop": {"name": "pi"},
                         "environments": [{"name": "ws.v2-a_b", "driver": "local"}]}))
            .is_ok()
        );
        refused(
            json!({"agentloop": {"name": "pi"},
                   "environments": [{"name": "e", "driver": "lo cal"}]}),
            &["environments[0].driver", "\"lo cal\""],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "environments": [{"name": "e"}]}),
            &["environments[0]", "driver"],
        );
        refused(
            json!({"agentloop": {"name": "pi"},
                   "environments": [{"name": "e", "driver": "local", "image": "ubuntu"}]}),
            &["environments[0]", "unknown key \"image\""],
        );
        refused(
            json!({"agentloop": {"name": "pi"},
                   "environments": [{"name": "e", "driver": "local", "configuration": 3}]}),
            &["environments[0].configuration", "integer"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "environments": {"e": {}}}),
            &["environments", "array"],
        );
    }

    #[test]
    fn tools_are_checked() {
        let mut request = with_workspace();
        request["tools"] = json!([{"name": "bash"}, {"name": "bash"}]);
        refused(request, &["tools[1].name", "\"bash\"", "declared twice"]);

        let mut request = with_workspace();
        request["tools"][0]["placements"] = json!(["workspace", "cloud"]);
        refused(
            request,
            &["tools[0].placements[1]", "\"cloud\"", "not declared"],
        );

        let mut request = with_workspace();
        request["tools"][0]["placements"] = json!(["workspace", "workspace"]);
        refused(
            request,
            &["tools[0].placements[1]", "\"workspace\"", "twice"],
        );

        for name in ["", "rm -rf", "x".repeat(65).as_str()] {
            refused(
                json!({"agentloop": {"name": "pi"}, "tools": [{"name": name}]}),
                &["tools[0].name", "not a valid name"],
            );
        }
        refused(
            json!({"agentloop": {"name": "pi"}, "tools": [{"name": "t", "input_schema": true}]}),
            &["tools[0].input_schema", "a boolean"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "tools": [{"name": "t", "handler": "x"}]}),
            &["tools[0]", "unknown key \"handler\""],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "tools": [{"description": "x"}]}),
            &["tools[0]", "name"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "tools": [{"name": "t", "placements": [3]}]}),
            &["tools[0].placements", "integer"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "tools": {"name": "t"}}),
            &["tools", "array"],
        );
    }

    #[test]
    fn other_fields_are_typed() {
        refused(
            json!({"agentloop": {"name": "pi"}, "system": 3}),
            &["system", "integer"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "model": {"name": "m"}}),
            &["model", "provider"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "model": "gpt"}),
            &["model"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "model": {"provider": "", "name": "m"}}),
            &["model.provider", "empty"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "model": {"provider": "p", "name": ""}}),
            &["model.name", "empty"],
        );
        refused(
            json!({"agentloop": {"name": "pi"},
                   "model": {"provider": "p", "name": "m", "context_window": "big"}}),
            &["model.context_window", "big"],
        );
        refused(
            json!({"agentloop": {"name": "pi"},
                   "transcript": [{"role": "user", "content": []}, {"role": "robot", "content": []}]}),
            &["transcript[1]", "robot"],
        );
        refused(
            json!({"agentloop": {"name": "pi"},
                   "transcript": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}),
            &["transcript[0]", "video"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "transcript": {}}),
            &["transcript", "array"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "metadata": []}),
            &["metadata"],
        );

        refused(
            json!({"agentloop": {"name": "pi"}, "model": {"provider": 1, "name": "m"}}),
            &["model.provider", "integer"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "tools": [{"name": ["t"]}]}),
            &["tools[0].name", "sequence"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "tools": [{"name": "t", "description": {}}]}),
            &["tools[0].description", "map"],
        );
        refused(
            json!({"agentloop": {"name": "pi"}, "environments": [{"name": "e", "driver": 2}]}),
            &["environments[0].driver", "integer"],
        );

        // Extra model metadata is kept, as the protocol type says.
        let request = parse(json!({"agentloop": {"name": "pi"},
                                   "model": {"provider": "p", "name": "m", "options": {"t": 1}}}))
        .unwrap();
        assert_eq!(request.model_or_default().extra["options"], json!({"t": 1}));
        let request = parse(json!({"agentloop": {"name": "pi"},
                                   "transcript": [{"role": "user", "content": [
                                       {"type": "image", "url": "https://x/y.png"}]}]}))
        .unwrap();
        assert_eq!(
            request.transcript[0].content[0],
            Block::Image {
                url: "https://x/y.png".into()
            }
        );
    }

    #[test]
    fn messages_stay_bounded_for_hostile_bodies() {
        let long = "k".repeat(100_000);
        let mut request = minimal();
        request[long.as_str()] = json!(1);
        let error = refused(request, &["unknown key", "…"]);
        assert!(error.message.chars().count() < 400, "{}", error.message);

        let error = refused(
            json!({"agentloop": {"name": long.clone()}}),
            &["agentloop.name", "…"],
        );
        assert!(error.message.chars().count() < 400);

        let error = refused(
            json!({"agentloop": {"name": "pi"}, "model": {"provider": "p", "name": "m",
                                                          "context_window": long.clone()}}),
            &["model"],
        );
        assert!(error.message.chars().count() <= MAX_MESSAGE_CHARS + 1);

        let control = "\u{1b}[31m\n".repeat(10);
        let error = refused(json!({"agentloop": {"name": control}}), &["\\u{1b}"]);
        assert!(!error.message.contains('\n'));

        // Truncation never splits a character.
        let wide = "é".repeat(5000);
        let error = refused(json!({"agentloop": {"name": wide}}), &["…"]);
        assert!(error.message.chars().count() < 400);
        assert_eq!(
            RequestError::new(ErrorCode::InvalidRequest, "ü".repeat(5000))
                .message
                .chars()
                .count(),
            MAX_MESSAGE_CHARS + 1
        );
    }

    #[test]
    fn requests_built_in_code_are_validated_the_same_way() {
        let error = CreateSession::default().validate().unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidRequest);
        assert!(error.message.contains("agentloop.name"));

        let mut request = CreateSession {
            agentloop: Selection {
                name: "pi".into(),
                configuration: Map::new(),
                environments: vec![Grant {
                    environment: "workspace".into(),
                    permissions: vec![Permission::Setup],
                }],
            },
            environments: vec![EnvironmentDecl {
                name: "workspace".into(),
                driver: "local".into(),
                configuration: Map::new(),
            }],
            tools: vec![ToolSpec {
                name: "bash".into(),
                description: String::new(),
                input_schema: default_input_schema(),
                placements: vec!["workspace".into()],
            }],
            ..CreateSession::default()
        };
        assert_eq!(request.validate(), Ok(()));
        request.environments.clear();
        let error = request.validate().unwrap_err();
        assert!(error.message.contains("tools[0].placements[0]"), "{error}");
        request.tools.clear();
        let error = request.validate().unwrap_err();
        assert!(
            error
                .message
                .contains("agentloop.environments[0].environment"),
            "{error}"
        );
        request.agentloop.environments.clear();
        assert_eq!(request.validate(), Ok(()));
    }

    #[test]
    fn names_and_permissions_have_stated_forms() {
        assert!(is_registration_name("pi") && !is_registration_name("p.i"));
        assert!(is_resource_name("p.i") && !is_resource_name("p i"));
        for permission in Permission::ALL {
            assert_eq!(
                serde_json::to_value(permission).unwrap(),
                json!(permission.as_str())
            );
            assert_eq!(permission.to_string(), permission.as_str());
        }
    }
}
