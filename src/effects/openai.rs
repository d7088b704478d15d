//! The `openai` model provider: OpenAI-compatible Chat Completions over synchronous HTTP.
//!
//! [`OpenAiProvider`] sends one `POST {base}/chat/completions` per model call, where `base` is
//! `OPENAI_BASE_URL` (default `https://api.openai.com/v1`), so any server that speaks the Chat
//! Completions wire format works: OpenAI itself, vLLM, llama.cpp's server, Ollama, and proxies.
//!
//! # Mapping
//!
//! | Brain ([`ModelRequest`](crate::protocol::harness::ModelRequest)) | Chat Completions |
//! | --- | --- |
//! | `system` | a leading `{"role":"system"}` message |
//! | a `user` message | a `user` message; text only becomes a string, with images an array of `text` / `image_url` parts |
//! | a `developer` message | a `system` message (understood by every compatible server) |
//! | an `assistant` message | an `assistant` message: its text blocks concatenated into `content`, its `tool_use` blocks into `tool_calls` (`arguments` is the input as a JSON string) |
//! | a `tool_result` block | a `{"role":"tool","tool_call_id"}` message holding the result's text, placed before the rest of its user message (the API wants tool messages right after the assistant's `tool_calls`); images inside a result follow in a user message. The API has no error flag: `is_error` is not sent |
//! | `tools` | `tools` of `{"type":"function","function":{name, description, parameters}}`; an empty list is omitted |
//! | `max_output_tokens` | `max_tokens` (`max_completion_tokens` on `api.openai.com`, whose reasoning models refuse `max_tokens`); absent is omitted |
//! | the model | `model` = `call.model.name` |
//! | `native` blocks of format [`OpenAiProvider::NATIVE_FORMAT`] | their `data` (an object) merged into the message's own fields; other formats are skipped |
//! | `file` blocks | refused before sending: Chat Completions cannot take a file by URL |
//! | `options.openai` (the session's `model.options.openai`, then the request's) | merged into the body, except `model`, `messages` and `stream`; a `max_tokens` or `max_completion_tokens` there replaces the mapped limit |
//!
//! Back: `content` (a string or text parts) becomes a text block, `refusal` a text block with stop
//! reason `refusal`, each of `tool_calls` a `tool_use` block (its `arguments` parsed as JSON; an
//! empty string is `{}`; text that is not JSON is kept as a JSON string, and sent back unchanged).
//! `finish_reason` `stop` → `end_turn`, `tool_calls` → `tool_use`, `length` → `max_tokens`,
//! `content_filter` → `refusal`, anything else → `unknown`. Usage: `prompt_tokens` →
//! `input_tokens` (OpenAI counts cached tokens in it), `completion_tokens` → `output_tokens`,
//! `prompt_tokens_details.cached_tokens` → `cache_read_input_tokens`,
//! `completion_tokens_details.reasoning_tokens` → `reasoning_tokens`; a counter the response does
//! not carry stays absent. `model` is the response's `model`.
//!
//! # Failures, cancel and secrets
//!
//! Shared with [`AnthropicProvider`](super::AnthropicProvider), see the `http` module below:
//! nothing sent (no connection, request not written) is [`EffectError::Failed`] with
//! `model_failed`; an HTTP error status is `Failed` with the provider's error type and message; a
//! request that was sent and then lost its connection, hit the deadline, or got a 2xx body that
//! is not a valid response is [`EffectError::Unknown`]. Nothing is ever retried or redirected. A
//! cancel returns at once with [`EffectError::Cancelled`] (`sent` says whether any byte of the
//! request had left). The API key is sent only in the `Authorization` header and is never part of
//! an error message, a log line, or [`Debug`](fmt::Debug) output.

use super::{EffectError, ModelCall, ModelProvider};
use crate::cancel::CancelToken;
use crate::protocol::harness::{Block, Message, ModelResult, Role, StopReason, Usage};
use serde_json::{Map, Value, json};
use std::ffi::OsString;
use std::fmt;
use std::time::Duration;

/// A [`ModelProvider`] for OpenAI-compatible Chat Completions servers (see the
/// [module documentation](self) for the mapping).
///
/// Register it under [`OpenAiProvider::NAME`] in [`Effects`](super::Effects); sessions whose
/// `model.provider` is `openai` then use it, with `model.name` as the model. Each call runs its
/// HTTP exchange on a helper thread so that a cancel returns at once; the helper ends by itself
/// within the timeout ([`OpenAiProvider::DEFAULT_TIMEOUT`] unless set with
/// [`with_timeout`](OpenAiProvider::with_timeout)).
#[derive(Clone)]
pub struct OpenAiProvider {
    base_url: String,
    api_key: String,
    timeout: Duration,
}

impl OpenAiProvider {
    /// The provider name sessions use: `openai`.
    pub const NAME: &'static str = "openai";
    /// The environment variable holding the API key.
    pub const API_KEY_VAR: &'static str = "OPENAI_API_KEY";
    /// The environment variable holding the base URL.
    pub const BASE_URL_VAR: &'static str = "OPENAI_BASE_URL";
    /// The base URL used when [`BASE_URL_VAR`](Self::BASE_URL_VAR) is unset or empty.
    pub const DEFAULT_BASE_URL: &'static str = "https://api.openai.com/v1";
    /// The `format` of the `native` blocks this provider passes through.
    pub const NATIVE_FORMAT: &'static str = "openai.chat";
    /// How long one call may take, from connecting to the last byte of the answer: 600 s.
    pub const DEFAULT_TIMEOUT: Duration = http::DEFAULT_TIMEOUT;

    /// A provider talking to `base_url` (e.g. `http://127.0.0.1:8000/v1`; a trailing `/` is
    /// ignored) with `api_key` as the bearer token. An empty key sends no `Authorization` header,
    /// for local servers that want none.
    pub fn new(base_url: impl Into<String>, api_key: impl Into<String>) -> OpenAiProvider {
        OpenAiProvider {
            base_url: http::trim_base(base_url.into()),
            api_key: api_key.into(),
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    /// A provider configured from Brain's environment: the key from `OPENAI_API_KEY` (required,
    /// non-empty), the base URL from `OPENAI_BASE_URL` (default
    /// [`DEFAULT_BASE_URL`](Self::DEFAULT_BASE_URL)). The error names the variable, never its
    /// value.
    pub fn from_env() -> Result<OpenAiProvider, String> {
        Self::from_vars(crate::hardening::var)
    }

    fn from_vars(lookup: impl Fn(&str) -> Option<OsString>) -> Result<OpenAiProvider, String> {
        let key = http::key_from(&lookup, Self::API_KEY_VAR, Self::NAME)?;
        let base = http::base_from(&lookup, Self::BASE_URL_VAR, Self::DEFAULT_BASE_URL)?;
        Ok(OpenAiProvider::new(base, key))
    }

    /// The same provider with another per-call timeout (connect, send and the whole answer). The
    /// call fails `unknown` once it expires after the request was sent.
    pub fn with_timeout(mut self, timeout: Duration) -> OpenAiProvider {
        self.timeout = timeout;
        self
    }

    /// The base URL, without a trailing `/`.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Where requests go: `{base}/chat/completions`.
    pub fn endpoint(&self) -> String {
        format!("{}/chat/completions", self.base_url)
    }

    /// The body field that carries the output limit: `max_completion_tokens` on OpenAI's own
    /// endpoint (its reasoning models refuse `max_tokens`), `max_tokens` everywhere else.
    fn max_tokens_field(&self) -> &'static str {
        if http::host(&self.base_url).eq_ignore_ascii_case("api.openai.com") {
            "max_completion_tokens"
        } else {
            "max_tokens"
        }
    }

    /// The JSON body for `call`. Fails (nothing sent) on input Chat Completions cannot carry.
    fn request_body(&self, call: &ModelCall<'_>) -> Result<Value, EffectError> {
        let request = call.request;
        let mut messages = Vec::new();
        if let Some(system) = request.system.as_deref().filter(|text| !text.is_empty()) {
            messages.push(json!({"role": "system", "content": system}));
        }
        for message in &request.messages {
            map_message(message, &mut messages)?;
        }
        let mut body = Map::new();
        body.insert("model".into(), Value::String(call.model.name.clone()));
        body.insert("messages".into(), Value::Array(messages));
        if let Some(tools) = request.tools.as_ref().filter(|tools| !tools.is_empty()) {
            let tools = tools
                .iter()
                .map(|tool| {
                    json!({"type": "function", "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    }})
                })
                .collect();
            body.insert("tools".into(), Value::Array(tools));
        }
        let options = http::provider_options(call, Self::NAME);
        let limit_in_options = ["max_tokens", "max_completion_tokens"]
            .iter()
            .any(|key| options.contains_key(*key));
        if let (Some(limit), false) = (request.max_output_tokens, limit_in_options) {
            body.insert(self.max_tokens_field().into(), Value::from(limit));
        }
        http::merge_options(&mut body, options, &["model", "messages", "stream"]);
        Ok(Value::Object(body))
    }
}

impl fmt::Debug for OpenAiProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiProvider")
            .field("base_url", &http::target(&self.base_url))
            .field("api_key", &http::REDACTED)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ModelProvider for OpenAiProvider {
    fn call(&self, call: &ModelCall<'_>, cancel: &CancelToken) -> Result<ModelResult, EffectError> {
        if cancel.is_cancelled() {
            return Err(EffectError::Cancelled { sent: false });
        }
        let body = self.request_body(call)?;
        let mut headers = vec![("content-type", "application/json".to_owned())];
        if !self.api_key.is_empty() {
            headers.push(("authorization", format!("Bearer {}", self.api_key)));
        }
        let exchange = http::Exchange {
            provider: PROVIDER,
            url: self.endpoint(),
            headers,
            body: http::encode(&body)?,
            timeout: self.timeout,
            secret: &self.api_key,
        };
        let reply = http::send(exchange, cancel)?;
        reply.check_status(PROVIDER, &self.api_key)?;
        let value = reply.json(PROVIDER, &self.api_key)?;
        parse_response(&value).map_err(|problem| reply.invalid(PROVIDER, &problem, &self.api_key))
    }
}

/// How messages name this provider.
const PROVIDER: &str = "the OpenAI-compatible server";

/// Appends the Chat Completions messages for one Brain message.
fn map_message(message: &Message, out: &mut Vec<Value>) -> Result<(), EffectError> {
    match message.role {
        Role::Assistant => {
            out.push(assistant_message(message));
            Ok(())
        }
        Role::User => user_message(message, "user", out),
        Role::Developer => user_message(message, "system", out),
    }
}

fn assistant_message(message: &Message) -> Value {
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    let mut native = Map::new();
    for block in &message.content {
        match block {
            Block::Text { text: piece } => text.push_str(piece),
            Block::ToolUse { id, name, input } => tool_calls.push(json!({
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": arguments_text(input)},
            })),
            Block::Native { format, data } => collect_native(format, data, &mut native),
            // Chat Completions has no place for these in an assistant message.
            Block::Image { .. } | Block::File { .. } | Block::ToolResult { .. } => {}
        }
    }
    let mut object = Map::new();
    object.insert("role".into(), Value::from("assistant"));
    let content = if text.is_empty() && !tool_calls.is_empty() {
        Value::Null
    } else {
        Value::String(text)
    };
    object.insert("content".into(), content);
    if !tool_calls.is_empty() {
        object.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    merge_native(&mut object, native);
    Value::Object(object)
}

/// A user (or developer) message: its tool results first, as `tool` messages, then the rest.
fn user_message(message: &Message, role: &str, out: &mut Vec<Value>) -> Result<(), EffectError> {
    let mut parts = Vec::new();
    let mut native = Map::new();
    let mut had_tool_results = false;
    for block in &message.content {
        match block {
            Block::ToolResult {
                tool_use_id,
                content,
                is_error: _,
            } => {
                had_tool_results = true;
                let mut text = String::new();
                for inner in content {
                    match inner {
                        Block::Text { text: piece } => text.push_str(piece),
                        Block::Image { url } => parts.push(image_part(url)),
                        _ => {}
                    }
                }
                out.push(json!({"role": "tool", "tool_call_id": tool_use_id, "content": text}));
            }
            Block::Text { text } => parts.push(json!({"type": "text", "text": text})),
            Block::Image { url } => parts.push(image_part(url)),
            Block::File { media_type, .. } => {
                return Err(http::unsendable(format!(
                    "Chat Completions cannot take a file by URL (a {media_type} file block)"
                )));
            }
            Block::Native { format, data } => collect_native(format, data, &mut native),
            // A tool call in a user message has no equivalent.
            Block::ToolUse { .. } => {}
        }
    }
    if had_tool_results && parts.is_empty() && native.is_empty() {
        return Ok(());
    }
    let all_text = parts
        .iter()
        .all(|part| part.get("type").and_then(Value::as_str) == Some("text"));
    let content = if all_text {
        Value::String(
            parts
                .iter()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect(),
        )
    } else {
        Value::Array(parts)
    };
    let mut object = Map::new();
    object.insert("role".into(), Value::from(role));
    object.insert("content".into(), content);
    merge_native(&mut object, native);
    out.push(Value::Object(object));
    Ok(())
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// Collects the fields of a `native` block of this provider's format; other formats are skipped.
fn collect_native(format: &str, data: &Value, into: &mut Map<String, Value>) {
    if format != OpenAiProvider::NATIVE_FORMAT {
        return;
    }
    match data {
        Value::Object(fields) => into.extend(
            fields
                .iter()
                .map(|(key, value)| (key.clone(), value.clone())),
        ),
        _ => log::debug!("skipping a {format} native block whose data is not an object"),
    }
}

/// Merges native fields into a message, never over its role, content or tool calls.
fn merge_native(object: &mut Map<String, Value>, native: Map<String, Value>) {
    for (key, value) in native {
        if !matches!(key.as_str(), "role" | "content" | "tool_calls") {
            object.insert(key, value);
        }
    }
}

/// A tool call's input as the `arguments` string: a string input (arguments that were not JSON
/// when the model produced them) goes back unchanged.
fn arguments_text(input: &Value) -> String {
    match input {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// A tool call's `arguments` as an input: parsed JSON, `{}` for an empty string, the raw text as
/// a JSON string when it is not JSON.
fn arguments_value(arguments: Option<&Value>) -> Value {
    match arguments {
        Some(Value::String(text)) if text.trim().is_empty() => Value::Object(Map::new()),
        Some(Value::String(text)) => {
            serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone()))
        }
        Some(Value::Null) | None => Value::Object(Map::new()),
        Some(other) => other.clone(),
    }
}

/// Maps a `finish_reason`.
fn stop_reason(finish_reason: Option<&str>) -> StopReason {
    match finish_reason {
        Some("stop") => StopReason::EndTurn,
        Some("tool_calls") => StopReason::ToolUse,
        Some("length") => StopReason::MaxTokens,
        Some("content_filter") => StopReason::Refusal,
        _ => StopReason::Unknown,
    }
}

/// Maps `usage`: only the counters it carries.
fn usage(value: Option<&Value>) -> Usage {
    let Some(usage) = value.filter(|usage| usage.is_object()) else {
        return Usage::default();
    };
    Usage {
        input_tokens: http::counter(usage.get("prompt_tokens")),
        output_tokens: http::counter(usage.get("completion_tokens")),
        cache_read_input_tokens: http::counter(
            usage
                .get("prompt_tokens_details")
                .and_then(|details| details.get("cached_tokens")),
        ),
        cache_creation_input_tokens: None,
        reasoning_tokens: http::counter(
            usage
                .get("completion_tokens_details")
                .and_then(|details| details.get("reasoning_tokens")),
        ),
    }
}

/// Maps a 2xx Chat Completions body, or says why it is not one.
fn parse_response(value: &Value) -> Result<ModelResult, String> {
    let choice = value
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|choices| choices.first())
        .ok_or("it has no choices")?;
    let message = choice
        .get("message")
        .filter(|message| message.is_object())
        .ok_or("its first choice has no message")?;
    let mut content = Vec::new();
    match message.get("content") {
        Some(Value::String(text)) if !text.is_empty() => content.push(Block::text(text.as_str())),
        Some(Value::Array(parts)) => {
            for part in parts {
                if let Some(text) = part.get("text").and_then(Value::as_str) {
                    content.push(Block::text(text));
                }
            }
        }
        _ => {}
    }
    let refusal = message
        .get("refusal")
        .and_then(Value::as_str)
        .filter(|text| !text.is_empty());
    if let Some(refusal) = refusal {
        content.push(Block::text(refusal));
    }
    if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
        for call in calls {
            let function = call.get("function");
            let name = function
                .and_then(|function| function.get("name"))
                .and_then(Value::as_str)
                .ok_or("a tool call has no function name")?;
            content.push(Block::ToolUse {
                id: call
                    .get("id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                name: name.to_owned(),
                input: arguments_value(function.and_then(|function| function.get("arguments"))),
            });
        }
    }
    let stop_reason = if refusal.is_some() {
        StopReason::Refusal
    } else {
        stop_reason(choice.get("finish_reason").and_then(Value::as_str))
    };
    Ok(ModelResult {
        message: Message {
            role: Role::Assistant,
            content,
        },
        stop_reason,
        usage: usage(value.get("usage")),
        model: value
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

/// The synchronous HTTP exchange both providers share: one request, never retried, run on a
/// helper thread so that a cancel returns at once, and classified into definitely-failed and
/// unknown by whether any byte of the request left this process.
///
/// It lives in this file because the providers are the only HTTP clients Brain has;
/// [`AnthropicProvider`](super::AnthropicProvider) uses it as `super::openai::http`.
///
/// HTTP is [`ureq`] (synchronous, no async runtime) with its rustls TLS and the webpki roots.
/// Every call gets its own agent, so nothing is pooled between calls and a cancel can shut the
/// call's connection down ([`ureq::Agent::shutdown`]). A connector at the end of ureq's chain
/// wraps the connection and is told of every write: that is what "sent" means here, decided under
/// a lock against a cancel, so a cancel either sees the request sent or stops it from being sent.
/// Redirects are not followed (a redirect would send the request again, elsewhere); proxies from
/// the usual environment variables are honoured (`HTTPS_PROXY`, `NO_PROXY`, …).
pub(super) mod http {
    use super::super::EffectError;
    use crate::cancel::CancelToken;
    use crate::effects::ModelCall;
    use crate::protocol::harness::ErrorCode;
    use parking_lot::Mutex;
    use serde_json::{Map, Value};
    use std::ffi::OsString;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::Arc;
    use std::time::Duration;
    use ureq::unversioned::resolver::DefaultResolver;
    use ureq::unversioned::transport::{
        Buffers, ConnectionDetails, Connector, DefaultConnector, NextTimeout, Transport,
    };

    /// How long one call may take by default: 600 s.
    pub(in crate::effects) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

    /// The most of a response body that is read: 64 MiB.
    const BODY_LIMIT: u64 = 64 * 1024 * 1024;

    /// The most characters of a provider's error text kept in a message.
    const MESSAGE_LIMIT: usize = 2000;

    /// What stands in for a secret.
    pub(in crate::effects) const REDACTED: &str = "[redacted]";

    /// How long past its own timeout the caller waits for the helper thread before giving up on
    /// it (it should never take that long: ureq enforces the timeout itself).
    const BACKSTOP: Duration = Duration::from_secs(60);

    /// One HTTP POST.
    pub(in crate::effects) struct Exchange<'a> {
        /// How messages name the other side, e.g. "the Anthropic API".
        pub provider: &'static str,
        /// Where to send it.
        pub url: String,
        /// Header names (lower case) and values; secrets among them never reach a message.
        pub headers: Vec<(&'static str, String)>,
        /// The JSON body.
        pub body: Vec<u8>,
        /// The whole exchange's deadline.
        pub timeout: Duration,
        /// The API key, removed from every message this module makes.
        pub secret: &'a str,
    }

    /// An HTTP answer: its status and its body, or why the body could not be read.
    pub(in crate::effects) struct Reply {
        status: u16,
        body: Result<Vec<u8>, String>,
    }

    impl Reply {
        /// `Ok` for a 2xx status; otherwise the definite failure the status means, with the
        /// provider's error type and message from the body when it has them.
        pub fn check_status(&self, provider: &str, secret: &str) -> Result<(), EffectError> {
            if (200..300).contains(&self.status) {
                return Ok(());
            }
            let detail = match &self.body {
                Ok(body) => error_detail(body),
                Err(_) => None,
            };
            let message = match detail {
                Some(detail) => format!("{provider} answered HTTP {}: {detail}", self.status),
                None => format!("{provider} answered HTTP {}", self.status),
            };
            Err(EffectError::Failed {
                code: ErrorCode::ModelFailed,
                message: redact(&message, secret),
            })
        }

        /// The 2xx body as JSON; a body that could not be read or is not JSON is `unknown` (the
        /// model may have run).
        pub fn json(&self, provider: &str, secret: &str) -> Result<Value, EffectError> {
            let body = self.body.as_ref().map_err(|error| EffectError::Unknown {
                message: redact(
                    &format!(
                        "{provider} answered HTTP {}, then reading the answer failed: {error}",
                        self.status
                    ),
                    secret,
                ),
            })?;
            serde_json::from_slice(body).map_err(|error| {
                self.invalid(provider, &format!("it is not JSON ({error})"), secret)
            })
        }

        /// The `unknown` outcome of a 2xx body that is not a usable response.
        pub fn invalid(&self, provider: &str, problem: &str, secret: &str) -> EffectError {
            let detail = match &self.body {
                Ok(body) => error_detail(body)
                    .map(|detail| format!(" (it says: {detail})"))
                    .unwrap_or_default(),
                Err(_) => String::new(),
            };
            EffectError::Unknown {
                message: redact(
                    &format!(
                        "{provider} answered HTTP {} with a body that is not a valid response: \
                         {problem}{detail}",
                        self.status
                    ),
                    secret,
                ),
            }
        }
    }

    /// Whether the request has left, and whether the caller gave up: decided under one lock so
    /// that a cancel either sees the request sent or keeps it from being sent.
    #[derive(Debug, Default)]
    struct Gate {
        cancelled: bool,
        sent: bool,
    }

    /// The last connector of the chain: wraps the finished connection (TCP, TLS, through any
    /// proxy) in a [`GatedTransport`].
    #[derive(Debug)]
    struct GateConnector {
        gate: Arc<Mutex<Gate>>,
    }

    impl Connector<Box<dyn Transport>> for GateConnector {
        type Out = GatedTransport;

        fn connect(
            &self,
            _details: &ConnectionDetails,
            chained: Option<Box<dyn Transport>>,
        ) -> Result<Option<GatedTransport>, ureq::Error> {
            if self.gate.lock().cancelled {
                return Err(cancelled_io());
            }
            Ok(chained.map(|inner| GatedTransport {
                inner,
                gate: self.gate.clone(),
            }))
        }
    }

    /// A connection that marks the request sent before its first byte is written, and writes
    /// nothing once the call was cancelled.
    #[derive(Debug)]
    struct GatedTransport {
        inner: Box<dyn Transport>,
        gate: Arc<Mutex<Gate>>,
    }

    impl Transport for GatedTransport {
        fn buffers(&mut self) -> &mut dyn Buffers {
            self.inner.buffers()
        }

        fn transmit_output(
            &mut self,
            amount: usize,
            timeout: NextTimeout,
        ) -> Result<(), ureq::Error> {
            if amount > 0 {
                let mut gate = self.gate.lock();
                if gate.cancelled {
                    return Err(cancelled_io());
                }
                gate.sent = true;
            }
            self.inner.transmit_output(amount, timeout)
        }

        fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
            self.inner.await_input(timeout)
        }

        fn is_open(&mut self) -> bool {
            self.inner.is_open()
        }

        fn is_tls(&self) -> bool {
            self.inner.is_tls()
        }
    }

    fn cancelled_io() -> ureq::Error {
        ureq::Error::Io(std::io::Error::new(
            std::io::ErrorKind::Interrupted,
            "the call was cancelled",
        ))
    }

    /// What the waiting caller hears: the helper's result, or the cancel.
    enum Event {
        Done(Result<Reply, String>),
        Cancelled,
    }

    /// Sends `exchange` once and returns the answer, whatever its status.
    ///
    /// `Err` is [`EffectError::Failed`] when no byte of the request left (no connection, a
    /// cancel before sending), [`EffectError::Unknown`] when it was sent and then the connection,
    /// the answer, or the deadline broke, and [`EffectError::Cancelled`] when `cancel` fired
    /// first (`sent` as above). The helper thread of a cancelled call is abandoned: its
    /// connection is shut down and it ends by itself.
    pub(in crate::effects) fn send(
        exchange: Exchange<'_>,
        cancel: &CancelToken,
    ) -> Result<Reply, EffectError> {
        let Exchange {
            provider,
            url,
            headers,
            body,
            timeout,
            secret,
        } = exchange;
        let where_to = target(&url);
        let gate = Arc::new(Mutex::new(Gate::default()));
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .max_redirects_will_error(false)
            .timeout_global(Some(timeout))
            .user_agent(concat!("brain/", env!("CARGO_PKG_VERSION")))
            .build();
        let connector = DefaultConnector::new().chain(GateConnector { gate: gate.clone() });
        let agent = ureq::Agent::with_parts(config, connector, DefaultResolver::default());

        // Room for both events, so neither sender ever blocks.
        let (events, heard) = crossbeam_channel::bounded::<Event>(2);
        {
            let events = events.clone();
            cancel.on_cancel(move || {
                let _ = events.try_send(Event::Cancelled);
            });
        }
        let helper_agent = agent.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("brain-http-{}", short(provider)))
            .spawn(move || {
                let outcome = catch_unwind(AssertUnwindSafe(|| {
                    post(&helper_agent, &url, &headers, body)
                }))
                .unwrap_or_else(|_| Err("the HTTP client panicked".to_owned()));
                let _ = events.try_send(Event::Done(outcome));
            });
        if let Err(error) = spawned {
            return Err(EffectError::Failed {
                code: ErrorCode::ModelFailed,
                message: format!("could not start a thread to call {provider}: {error}"),
            });
        }

        let event = heard.recv_timeout(timeout.saturating_add(BACKSTOP));
        let sent = |gate: &Mutex<Gate>| {
            let mut gate = gate.lock();
            gate.cancelled = true;
            gate.sent
        };
        match event {
            Ok(Event::Done(Ok(reply))) => Ok(reply),
            Ok(Event::Done(Err(error))) => {
                let error = redact(&error, secret);
                if sent(&gate) {
                    Err(EffectError::Unknown {
                        message: format!(
                            "the request to {provider} at {where_to} was sent, then: {error}"
                        ),
                    })
                } else {
                    Err(EffectError::Failed {
                        code: ErrorCode::ModelFailed,
                        message: format!(
                            "could not send the request to {provider} at {where_to}: {error}"
                        ),
                    })
                }
            }
            Ok(Event::Cancelled) => {
                let sent = sent(&gate);
                agent.shutdown();
                Err(EffectError::Cancelled { sent })
            }
            Err(_) => {
                let was_sent = sent(&gate);
                agent.shutdown();
                let message = format!(
                    "{provider} at {where_to} did not finish within {} s",
                    timeout.saturating_add(BACKSTOP).as_secs()
                );
                if was_sent {
                    Err(EffectError::Unknown { message })
                } else {
                    Err(EffectError::Failed {
                        code: ErrorCode::ModelFailed,
                        message,
                    })
                }
            }
        }
    }

    /// The exchange itself, on the helper thread. Errors are ureq's descriptions, which never
    /// hold header values.
    fn post(
        agent: &ureq::Agent,
        url: &str,
        headers: &[(&'static str, String)],
        body: Vec<u8>,
    ) -> Result<Reply, String> {
        let mut request = agent.post(url);
        for (name, value) in headers {
            request = request.header(*name, value.as_str());
        }
        let mut response = request.send(&body[..]).map_err(|error| describe(&error))?;
        let status = response.status().as_u16();
        let body = response
            .body_mut()
            .with_config()
            .limit(BODY_LIMIT)
            .read_to_vec()
            .map_err(|error| describe(&error));
        Ok(Reply { status, body })
    }

    fn describe(error: &ureq::Error) -> String {
        match error {
            ureq::Error::Timeout(_) => format!("{error} (the call's deadline)"),
            _ => error.to_string(),
        }
    }

    /// The first word of a provider description, for thread names.
    fn short(provider: &str) -> &str {
        provider
            .split_whitespace()
            .find(|word| !matches!(*word, "the" | "The"))
            .unwrap_or("model")
    }

    /// The provider's own account of an error body: `type` / `code` and `message` from the
    /// `{"error": {...}}` shape both APIs use (plus Anthropic's `request_id`), or a bare
    /// `error` / `message` / `detail` string, or the body itself when it is short text.
    fn error_detail(body: &[u8]) -> Option<String> {
        let Ok(value) = serde_json::from_slice::<Value>(body) else {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            return (!text.is_empty()).then(|| bounded(text));
        };
        let error = value.get("error");
        let described = match error {
            Some(Value::Object(error)) => {
                let kind = ["type", "code"]
                    .iter()
                    .filter_map(|key| error.get(*key))
                    .filter_map(scalar_text)
                    .collect::<Vec<_>>();
                let message = error.get("message").and_then(scalar_text);
                match (kind.is_empty(), message) {
                    (false, Some(message)) => Some(format!("{}: {message}", kind.join("/"))),
                    (false, None) => Some(kind.join("/")),
                    (true, Some(message)) => Some(message),
                    (true, None) => None,
                }
            }
            Some(other) => scalar_text(other),
            None => None,
        }
        .or_else(|| value.get("message").and_then(scalar_text))
        .or_else(|| value.get("detail").map(detail_text));
        let request_id = value.get("request_id").and_then(Value::as_str);
        described.map(|text| match request_id {
            Some(id) => bounded(&format!("{text} (request {id})")),
            None => bounded(&text),
        })
    }

    fn scalar_text(value: &Value) -> Option<String> {
        match value {
            Value::String(text) if !text.is_empty() => Some(text.clone()),
            Value::Number(number) => Some(number.to_string()),
            _ => None,
        }
    }

    fn detail_text(value: &Value) -> String {
        match value {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        }
    }

    /// `text` cut to [`MESSAGE_LIMIT`] characters.
    fn bounded(text: &str) -> String {
        match text.char_indices().nth(MESSAGE_LIMIT) {
            Some((at, _)) => format!("{}…", &text[..at]),
            None => text.to_owned(),
        }
    }

    /// `text` with `secret` removed, and with every word that looks like a masked or partial copy
    /// of it (providers echo keys as `sk-abc1****wxyz`) replaced too.
    pub(in crate::effects) fn redact(text: &str, secret: &str) -> String {
        if secret.is_empty() {
            return text.to_owned();
        }
        let whole = text.replace(secret, REDACTED);
        let mut out = String::with_capacity(whole.len());
        let mut rest = whole.as_str();
        while !rest.is_empty() {
            let start = rest
                .find(|c: char| !c.is_whitespace())
                .unwrap_or(rest.len());
            out.push_str(&rest[..start]);
            rest = &rest[start..];
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            let word = &rest[..end];
            let core = word.trim_matches(is_punctuation);
            if looks_like(core, secret) {
                // Keep the punctuation around the word: `key.` stays `[redacted].`.
                let at = word.find(core).unwrap_or(0);
                out.push_str(&word[..at]);
                out.push_str(REDACTED);
                out.push_str(&word[at + core.len()..]);
            } else {
                out.push_str(word);
            }
            rest = &rest[end..];
        }
        out
    }

    /// Whether `word` carries a fragment of `secret`: masked (`***`), or sharing a run of at
    /// least 6 characters with it.
    fn looks_like(word: &str, secret: &str) -> bool {
        if word.contains("***") {
            return true;
        }
        const RUN: usize = 6;
        let chars: Vec<char> = word.chars().collect();
        if chars.len() < RUN || secret.chars().count() < RUN {
            return false;
        }
        chars.windows(RUN).any(|window| {
            let piece: String = window.iter().collect();
            secret.contains(piece.as_str())
        })
    }

    fn is_punctuation(c: char) -> bool {
        matches!(
            c,
            '.' | ',' | ';' | ':' | '"' | '\'' | '(' | ')' | '[' | ']'
        )
    }

    /// A URL as it may appear in messages: scheme, host and port, without any user info, path or
    /// query.
    pub(in crate::effects) fn target(url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let authority = authority.rsplit('@').next().unwrap_or_default();
        if scheme.is_empty() {
            authority.to_owned()
        } else {
            format!("{scheme}://{authority}")
        }
    }

    /// The host of a URL, without port.
    pub(in crate::effects) fn host(url: &str) -> String {
        let authority = target(url);
        let authority = authority
            .split_once("://")
            .map_or(authority.as_str(), |(_, rest)| rest);
        if let Some(bracketed) = authority.strip_prefix('[') {
            return bracketed.split(']').next().unwrap_or_default().to_owned();
        }
        authority.split(':').next().unwrap_or_default().to_owned()
    }

    /// A base URL without its trailing slashes.
    pub(in crate::effects) fn trim_base(base: String) -> String {
        base.trim_end_matches('/').to_owned()
    }

    /// A required, non-empty API key from the variable `name`; the error names the variable
    /// only.
    pub(in crate::effects) fn key_from(
        lookup: &impl Fn(&str) -> Option<OsString>,
        name: &str,
        provider: &str,
    ) -> Result<String, String> {
        match lookup(name) {
            None => Err(format!(
                "{name} is not set: the {provider} provider needs an API key"
            )),
            Some(value) => match value.into_string() {
                Ok(key) if key.is_empty() => Err(format!(
                    "{name} is empty: the {provider} provider needs an API key"
                )),
                Ok(key) => Ok(key),
                Err(_) => Err(format!("{name} is not valid UTF-8")),
            },
        }
    }

    /// A base URL from the variable `name`, `default` when it is unset or empty.
    pub(in crate::effects) fn base_from(
        lookup: &impl Fn(&str) -> Option<OsString>,
        name: &str,
        default: &str,
    ) -> Result<String, String> {
        let base = match lookup(name) {
            None => return Ok(default.to_owned()),
            Some(value) => value
                .into_string()
                .map_err(|_| format!("{name} is not valid UTF-8"))?,
        };
        if base.is_empty() {
            return Ok(default.to_owned());
        }
        let lower = base.to_ascii_lowercase();
        if !(lower.starts_with("http://") || lower.starts_with("https://")) {
            return Err(format!(
                "{name} must be an http:// or https:// URL, not {:?}",
                target(&base)
            ));
        }
        Ok(base)
    }

    /// A usage counter: a non-negative integer, or absent.
    pub(in crate::effects) fn counter(value: Option<&Value>) -> Option<u64> {
        value.and_then(Value::as_u64)
    }

    /// The definite failure of a request that cannot be expressed for this provider.
    pub(in crate::effects) fn unsendable(message: String) -> EffectError {
        EffectError::Failed {
            code: ErrorCode::ModelFailed,
            message,
        }
    }

    /// The body as bytes.
    pub(in crate::effects) fn encode(body: &Value) -> Result<Vec<u8>, EffectError> {
        serde_json::to_vec(body)
            .map_err(|error| unsendable(format!("could not encode the request: {error}")))
    }

    /// The provider-specific options of a call: the session's `model.options.<provider>` with the
    /// request's `options.<provider>` over it (both objects; anything else is ignored).
    pub(in crate::effects) fn provider_options(
        call: &ModelCall<'_>,
        provider: &str,
    ) -> Map<String, Value> {
        let mut options = Map::new();
        let from_model = call
            .model
            .extra
            .get("options")
            .and_then(|options| options.get(provider));
        let from_request = call
            .request
            .options
            .as_ref()
            .and_then(|options| options.get(provider));
        for source in [from_model, from_request].into_iter().flatten() {
            if let Value::Object(fields) = source {
                options.extend(
                    fields
                        .iter()
                        .map(|(key, value)| (key.clone(), value.clone())),
                );
            }
        }
        options
    }

    /// Merges `options` into `body`, skipping the `reserved` keys the mapping owns.
    pub(in crate::effects) fn merge_options(
        body: &mut Map<String, Value>,
        options: Map<String, Value>,
        reserved: &[&str],
    ) {
        for (key, value) in options {
            if reserved.contains(&key.as_str()) {
                log::debug!("ignoring the reserved option {key:?}");
            } else {
                body.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::{ModelMetadata, ModelRequest, ToolDefinition};
    use crate::session::SessionId;

    fn model(name: &str, options: Option<Value>) -> ModelMetadata {
        let mut extra = Map::new();
        if let Some(options) = options {
            extra.insert("options".into(), options);
        }
        ModelMetadata {
            provider: "openai".into(),
            name: name.into(),
            context_window: None,
            max_output_tokens: Some(999),
            extra,
        }
    }

    fn body_for(provider: &OpenAiProvider, model: &ModelMetadata, request: &ModelRequest) -> Value {
        let id = SessionId::parse("ses_0123456789ABCDEFGHIJ").expect("a valid id");
        let call = ModelCall {
            session_id: &id,
            sequence: 7,
            ordinal: 0,
            model,
            request,
        };
        provider.request_body(&call).expect("mappable")
    }

    fn request(messages: Vec<Message>) -> ModelRequest {
        ModelRequest {
            system: None,
            messages,
            tools: None,
            max_output_tokens: None,
            options: None,
        }
    }

    #[test]
    fn from_env_names_the_variable_never_the_value() {
        let none = |_: &str| None;
        let error = OpenAiProvider::from_vars(none).expect_err("no key");
        assert!(error.contains("OPENAI_API_KEY"), "{error}");

        let empty = |name: &str| (name == "OPENAI_API_KEY").then(OsString::new);
        let error = OpenAiProvider::from_vars(empty).expect_err("empty key");
        assert!(error.contains("OPENAI_API_KEY is empty"), "{error}");

        let secret = "sk-from-the-environment-123";
        let bad_base = |name: &str| match name {
            "OPENAI_API_KEY" => Some(OsString::from(secret)),
            "OPENAI_BASE_URL" => Some(OsString::from("ftp://example.com")),
            _ => None,
        };
        let error = OpenAiProvider::from_vars(bad_base).expect_err("bad base");
        assert!(
            error.contains("OPENAI_BASE_URL") && !error.contains(secret),
            "{error}"
        );

        let good = |name: &str| match name {
            "OPENAI_API_KEY" => Some(OsString::from(secret)),
            _ => None,
        };
        let provider = OpenAiProvider::from_vars(good).expect("configured");
        assert_eq!(provider.base_url(), "https://api.openai.com/v1");
        assert_eq!(
            provider.endpoint(),
            "https://api.openai.com/v1/chat/completions"
        );
        assert_eq!(provider.timeout(), Duration::from_secs(600));
        let debug = format!("{provider:?}");
        assert!(
            !debug.contains(secret) && debug.contains("[redacted]"),
            "{debug}"
        );

        let local = |name: &str| match name {
            "OPENAI_API_KEY" => Some(OsString::from("x")),
            "OPENAI_BASE_URL" => Some(OsString::from("http://127.0.0.1:11434/v1/")),
            _ => None,
        };
        let provider = OpenAiProvider::from_vars(local).expect("configured");
        assert_eq!(
            provider.endpoint(),
            "http://127.0.0.1:11434/v1/chat/completions"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_key_that_is_not_utf8_is_refused_by_name() {
        use std::os::unix::ffi::OsStringExt;
        let lookup = |name: &str| {
            (name == "OPENAI_API_KEY").then(|| OsString::from_vec(vec![b's', b'k', 0xff]))
        };
        let error = OpenAiProvider::from_vars(lookup).expect_err("not UTF-8");
        assert_eq!(error, "OPENAI_API_KEY is not valid UTF-8");
    }

    #[test]
    fn the_output_limit_field_depends_on_the_endpoint() {
        let mut limited = request(vec![Message::text(Role::User, "hi")]);
        limited.max_output_tokens = Some(100);
        let official = OpenAiProvider::new("https://api.openai.com/v1", "k");
        let body = body_for(&official, &model("gpt-5-mini", None), &limited);
        assert_eq!(body["max_completion_tokens"], 100);
        assert!(body.get("max_tokens").is_none());
        let local = OpenAiProvider::new("http://localhost:8000/v1", "k");
        let body = body_for(&local, &model("llama", None), &limited);
        assert_eq!(body["max_tokens"], 100);
        // The model's metadata limit is advisory: only the request's limit is sent.
        let body = body_for(&local, &model("llama", None), &request(vec![]));
        assert!(body.get("max_tokens").is_none(), "{body}");
    }

    #[test]
    fn options_under_the_provider_name_reach_the_body() {
        let provider = OpenAiProvider::new("http://localhost/v1", "k");
        let session = json!({"openai": {"temperature": 0.5, "seed": 1}, "script": []});
        let mut limited = request(vec![Message::text(Role::User, "hi")]);
        limited.max_output_tokens = Some(10);
        limited.options = Some(
            json!({"openai": {"seed": 2, "model": "other", "stream": true,
                              "max_completion_tokens": 20}})
            .as_object()
            .cloned()
            .expect("an object"),
        );
        let body = body_for(&provider, &model("m", Some(session)), &limited);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["seed"], 2);
        assert_eq!(body["model"], "m");
        assert_eq!(body["max_completion_tokens"], 20);
        assert!(body.get("max_tokens").is_none());
        assert!(body.get("stream").is_none());
        assert!(body.get("script").is_none());
    }

    #[test]
    fn developer_messages_native_blocks_and_images_map() {
        let provider = OpenAiProvider::new("http://localhost/v1", "k");
        let messages = vec![
            Message::text(Role::Developer, "Be brief."),
            Message {
                role: Role::User,
                content: vec![
                    Block::text("Look: "),
                    Block::Image {
                        url: "https://example.com/a.png".into(),
                    },
                    Block::Native {
                        format: "anthropic.messages".into(),
                        data: json!({"type": "thinking"}),
                    },
                ],
            },
            Message {
                role: Role::Assistant,
                content: vec![
                    Block::Native {
                        format: OpenAiProvider::NATIVE_FORMAT.into(),
                        data: json!({"reasoning_content": "hmm", "role": "user"}),
                    },
                    Block::ToolUse {
                        id: "c1".into(),
                        name: "f".into(),
                        input: Value::String("{not json".into()),
                    },
                ],
            },
        ];
        let mut with_tools = request(messages);
        with_tools.tools = Some(vec![]);
        let body = body_for(&provider, &model("m", None), &with_tools);
        assert!(body.get("tools").is_none(), "an empty tool list is omitted");
        assert_eq!(
            body["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
                {"role": "assistant", "content": null, "reasoning_content": "hmm",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "f", "arguments": "{not json"}}]}
            ])
        );
    }

    #[test]
    fn a_file_block_is_refused_before_sending() {
        let provider = OpenAiProvider::new("http://localhost/v1", "k");
        let id = SessionId::parse("ses_0123456789ABCDEFGHIJ").expect("a valid id");
        let model = model("m", None);
        let request = request(vec![Message {
            role: Role::User,
            content: vec![Block::File {
                media_type: "application/pdf".into(),
                url: "https://example.com/a.pdf".into(),
            }],
        }]);
        let call = ModelCall {
            session_id: &id,
            sequence: 1,
            ordinal: 0,
            model: &model,
            request: &request,
        };
        match provider.call(&call, &CancelToken::new()) {
            Err(EffectError::Failed { message, .. }) => {
                assert!(message.contains("file"), "{message}")
            }
            other => panic!("expected a definite failure, got {other:?}"),
        }
    }

    #[test]
    fn finish_reasons_and_arguments_map() {
        assert_eq!(stop_reason(Some("stop")), StopReason::EndTurn);
        assert_eq!(stop_reason(Some("tool_calls")), StopReason::ToolUse);
        assert_eq!(stop_reason(Some("length")), StopReason::MaxTokens);
        assert_eq!(stop_reason(Some("content_filter")), StopReason::Refusal);
        assert_eq!(stop_reason(Some("function_call")), StopReason::Unknown);
        assert_eq!(stop_reason(None), StopReason::Unknown);
        assert_eq!(arguments_value(Some(&json!(""))), json!({}));
        assert_eq!(arguments_value(Some(&json!("{\"a\":1}"))), json!({"a": 1}));
        assert_eq!(arguments_value(Some(&json!("{oops"))), json!("{oops"));
        assert_eq!(arguments_value(Some(&json!({"b": 2}))), json!({"b": 2}));
        assert_eq!(arguments_text(&json!("{oops")), "{oops");
        assert_eq!(arguments_text(&json!({"a": 1})), "{\"a\":1}");
    }

    #[test]
    fn responses_map_refusals_text_parts_and_full_usage() {
        let refused = parse_response(&json!({
            "model": "gpt-x",
            "choices": [{"message": {"role": "assistant", "content": null,
                                     "refusal": "I can't help with that."},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10,
                      "prompt_tokens_details": {"cached_tokens": 4},
                      "completion_tokens_details": {"reasoning_tokens": null}}
        }))
        .expect("valid");
        assert_eq!(refused.stop_reason, StopReason::Refusal);
        assert_eq!(refused.message.text_content(), "I can't help with that.");
        assert_eq!(
            refused.usage,
            Usage {
                input_tokens: Some(10),
                output_tokens: Some(0),
                cache_read_input_tokens: Some(4),
                cache_creation_input_tokens: None,
                reasoning_tokens: None,
            }
        );
        let parts = parse_response(&json!({
            "choices": [{"message": {"content": [{"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]},
                         "finish_reason": "length"}]
        }))
        .expect("valid");
        assert_eq!(
            parts.message.content,
            vec![Block::text("a"), Block::text("b")]
        );
        assert_eq!(parts.stop_reason, StopReason::MaxTokens);
        assert_eq!(parts.usage, Usage::default());
        assert_eq!(parts.model, None);
        assert!(parse_response(&json!({"choices": []})).is_err());
        assert!(parse_response(&json!({"object": "list"})).is_err());
    }

    #[test]
    fn redaction_removes_the_key_and_masked_copies() {
        let key = "sk-proj-abcdef0123456789wxyz";
        let text = format!(
            "Incorrect API key provided: sk-proj-********************wxyz. Also {key}, \
             and sk-proj-abcdef01... is yours"
        );
        let redacted = http::redact(&text, key);
        assert!(!redacted.contains(key), "{redacted}");
        assert!(!redacted.contains("abcdef"), "{redacted}");
        assert!(!redacted.contains("****"), "{redacted}");
        assert_eq!(
            redacted,
            "Incorrect API key provided: [redacted]. Also [redacted], and [redacted]... is yours"
        );
        assert_eq!(http::redact("plain words stay", key), "plain words stay");
        assert_eq!(http::redact("anything", ""), "anything");
    }

    #[test]
    fn targets_hide_user_info_and_paths() {
        assert_eq!(
            http::target("https://user:pw@api.example.com:8443/v1/chat?x=1"),
            "https://api.example.com:8443"
        );
        assert_eq!(http::host("https://api.openai.com/v1"), "api.openai.com");
        assert_eq!(http::host("http://[::1]:8080/v1"), "::1");
        assert_eq!(http::host("http://127.0.0.1:8080"), "127.0.0.1");
    }

    #[test]
    fn tools_map_to_functions() {
        let provider = OpenAiProvider::new("http://localhost/v1", "k");
        let mut with_tools = request(vec![Message::text(Role::User, "hi")]);
        with_tools.tools = Some(vec![ToolDefinition {
            name: "bash".into(),
            description: "Run a command".into(),
            input_schema: json!({"type": "object"}),
        }]);
        let body = body_for(&provider, &model("m", None), &with_tools);
        assert_eq!(
            body["tools"],
            json!([{"type": "function", "function": {"name": "bash",
                    "description": "Run a command", "parameters": {"type": "object"}}}])
        );
        assert_eq!(body["messages"], json!([{"role": "user", "content": "hi"}]));
    }
}
