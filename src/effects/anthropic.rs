//! The `anthropic` model provider: Anthropic's Messages API over synchronous HTTP.
//!
//! [`AnthropicProvider`] sends one `POST {base}/v1/messages` per model call, where `base` is
//! `ANTHROPIC_BASE_URL` (default `https://api.anthropic.com`), with the key in `x-api-key` and
//! `anthropic-version: 2023-06-01`.
//!
//! # Mapping
//!
//! | Brain ([`ModelRequest`](crate::protocol::harness::ModelRequest)) | Messages API |
//! | --- | --- |
//! | `system` | `system` (omitted when absent or empty) |
//! | `user` / `assistant` messages | `user` / `assistant` messages with content blocks |
//! | a `developer` message | a `user` message (the API has only two roles; `system` is the session's) |
//! | `text` | `text` (an empty text block is skipped: the API refuses them) |
//! | `image` / `file` | `image` / `document` with a `{"type":"url"}` source |
//! | `tool_use` | `tool_use` (`id`, `name`, `input`) |
//! | `tool_result` | `tool_result` (`tool_use_id`, its text and image content, `is_error`) |
//! | `native` blocks of format [`AnthropicProvider::NATIVE_FORMAT`] | their `data`, verbatim, as a content block (thinking, redacted thinking, server tool blocks come back this way); other formats are skipped |
//! | a message left with no content | skipped (the API refuses empty messages) |
//! | `tools` | `tools` of `{name, description, input_schema}`; an empty list is omitted |
//! | `max_output_tokens` | `max_tokens`, which the API requires: the request's, else the model metadata's `max_output_tokens`, else [`AnthropicProvider::DEFAULT_MAX_TOKENS`] (4096) |
//! | the model | `model` = `call.model.name` |
//! | `options.anthropic` (the session's `model.options.anthropic`, then the request's) | merged into the body (e.g. `temperature`, `thinking`, `metadata`), except `model`, `messages`, `system` and `stream` |
//!
//! Back: `text` blocks become text blocks, `tool_use` blocks `tool_use` blocks, every other block
//! (`thinking`, `redacted_thinking`, `server_tool_use`, …) a `native` block of format
//! [`AnthropicProvider::NATIVE_FORMAT`] holding it unchanged, so that it goes back as it came.
//! `stop_reason` `end_turn`, `tool_use`, `max_tokens`, `stop_sequence` and `refusal` keep their
//! names; anything else (`pause_turn`, …) is `unknown`. Usage: `input_tokens`, `output_tokens`,
//! `cache_read_input_tokens` and `cache_creation_input_tokens` as reported (Anthropic's
//! `input_tokens` excludes cached tokens); a counter the response does not carry stays absent,
//! and a reported zero stays zero. `model` is the response's `model`.
//!
//! Failures, cancel and secrets are handled as for [`OpenAiProvider`](super::OpenAiProvider):
//! nothing sent is [`EffectError::Failed`], an HTTP error status is `Failed` with the API's error
//! type, message and request id, a request sent and then lost (or answered with an invalid 2xx
//! body) is [`EffectError::Unknown`], a cancel returns [`EffectError::Cancelled`] at once; the key
//! appears in no message, log line or [`Debug`](fmt::Debug) output.

use super::openai::http;
use super::{EffectError, ModelCall, ModelProvider};
use crate::cancel::CancelToken;
use crate::protocol::harness::{Block, Message, ModelResult, Role, StopReason, Usage};
use serde_json::{Map, Value, json};
use std::ffi::OsString;
use std::fmt;
use std::time::Duration;

/// A [`ModelProvider`] for Anthropic's Messages API (see the [module documentation](self) for
/// the mapping).
///
/// Register it under [`AnthropicProvider::NAME`] in [`Effects`](super::Effects); sessions whose
/// `model.provider` is `anthropic` then use it, with `model.name` as the model. Each call runs its
/// HTTP exchange on a helper thread so that a cancel returns at once; the helper ends by itself
/// within the timeout ([`AnthropicProvider::DEFAULT_TIMEOUT`] unless set with
/// [`with_timeout`](AnthropicProvider::with_timeout)).
#[derive(Clone)]
pub struct AnthropicProvider {
    base_url: String,
    api_key: String,
    timeout: Duration,
}

impl AnthropicProvider {
    /// The provider name sessions use: `anthropic`.
    pub const NAME: &'static str = "anthropic";
    /// The environment variable holding the API key.
    pub const API_KEY_VAR: &'static str = "ANTHROPIC_API_KEY";
    /// The environment variable holding the base URL.
    pub const BASE_URL_VAR: &'static str = "ANTHROPIC_BASE_URL";
    /// The base URL used when [`BASE_URL_VAR`](Self::BASE_URL_VAR) is unset or empty.
    pub const DEFAULT_BASE_URL: &'static str = "https://api.anthropic.com";
    /// The `anthropic-version` header sent with every request.
    pub const API_VERSION: &'static str = "2023-06-01";
    /// `max_tokens` when neither the request nor the model metadata gives an output limit.
    pub const DEFAULT_MAX_TOKENS: u64 = 4096;
    /// The `format` of the `native` blocks this provider produces and passes through.
    pub const NATIVE_FORMAT: &'static str = "anthropic.messages";
    /// How long one call may take, from connecting to the last byte of the answer: 600 s.
    pub const DEFAULT_TIMEOUT: Duration = http::DEFAULT_TIMEOUT;

    /// A provider talking to `base_url` (e.g. `https://api.anthropic.com`; a trailing `/` is
    /// ignored) with `api_key` in the `x-api-key` header.
    pub fn new(base_url: impl Into<String>, api_key: impl Into<String>) -> AnthropicProvider {
        AnthropicProvider {
            base_url: http::trim_base(base_url.into()),
            api_key: api_key.into(),
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    /// A provider configured from Brain's environment: the key from `ANTHROPIC_API_KEY`
    /// (required, non-empty), the base URL from `ANTHROPIC_BASE_URL` (default
    /// [`DEFAULT_BASE_URL`](Self::DEFAULT_BASE_URL)). The error names the variable, never its
    /// value.
    pub fn from_env() -> Result<AnthropicProvider, String> {
        Self::from_vars(crate::hardening::var)
    }

    fn from_vars(lookup: impl Fn(&str) -> Option<OsString>) -> Result<AnthropicProvider, String> {
        let key = http::key_from(&lookup, Self::API_KEY_VAR, Self::NAME)?;
        let base = http::base_from(&lookup, Self::BASE_URL_VAR, Self::DEFAULT_BASE_URL)?;
        Ok(AnthropicProvider::new(base, key))
    }

    /// The same provider with another per-call timeout (connect, send and the whole answer). The
    /// call fails `unknown` once it expires after the request was sent.
    pub fn with_timeout(mut self, timeout: Duration) -> AnthropicProvider {
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

    /// Where requests go: `{base}/v1/messages`.
    pub fn endpoint(&self) -> String {
        format!("{}/v1/messages", self.base_url)
    }

    /// The JSON body for `call`.
    fn request_body(call: &ModelCall<'_>) -> Value {
        let request = call.request;
        let mut body = Map::new();
        body.insert("model".into(), Value::String(call.model.name.clone()));
        let max_tokens = request
            .max_output_tokens
            .or(call.model.max_output_tokens)
            .unwrap_or(Self::DEFAULT_MAX_TOKENS);
        body.insert("max_tokens".into(), Value::from(max_tokens));
        if let Some(system) = request.system.as_deref().filter(|text| !text.is_empty()) {
            body.insert("system".into(), Value::from(system));
        }
        let messages = request
            .messages
            .iter()
            .filter_map(|message| {
                let role = match message.role {
                    Role::Assistant => "assistant",
                    Role::User | Role::Developer => "user",
                };
                let content: Vec<Value> = message.content.iter().filter_map(block).collect();
                (!content.is_empty()).then(|| json!({"role": role, "content": content}))
            })
            .collect();
        body.insert("messages".into(), Value::Array(messages));
        if let Some(tools) = request.tools.as_ref().filter(|tools| !tools.is_empty()) {
            let tools = tools
                .iter()
                .map(|tool| {
                    json!({
                        "name": tool.name,
                        "description": tool.description,
                        "input_schema": tool.input_schema,
                    })
                })
                .collect();
            body.insert("tools".into(), Value::Array(tools));
        }
        let options = http::provider_options(call, Self::NAME);
        http::merge_options(
            &mut body,
            options,
            &["model", "messages", "system", "stream"],
        );
        Value::Object(body)
    }
}

impl fmt::Debug for AnthropicProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnthropicProvider")
            .field("base_url", &http::target(&self.base_url))
            .field("api_key", &http::REDACTED)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ModelProvider for AnthropicProvider {
    fn call(&self, call: &ModelCall<'_>, cancel: &CancelToken) -> Result<ModelResult, EffectError> {
        if cancel.is_cancelled() {
            return Err(EffectError::Cancelled { sent: false });
        }
        let body = Self::request_body(call);
        let exchange = http::Exchange {
            provider: PROVIDER,
            url: self.endpoint(),
            headers: vec![
                ("content-type", "application/json".to_owned()),
                ("anthropic-version", Self::API_VERSION.to_owned()),
                ("x-api-key", self.api_key.clone()),
            ],
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
const PROVIDER: &str = "the Anthropic API";

/// One content block on the wire, or `None` for a block with no equivalent.
fn block(block: &Block) -> Option<Value> {
    match block {
        Block::Text { text } if text.is_empty() => None,
        Block::Text { text } => Some(json!({"type": "text", "text": text})),
        Block::Image { url } => {
            Some(json!({"type": "image", "source": {"type": "url", "url": url}}))
        }
        Block::File { url, .. } => {
            Some(json!({"type": "document", "source": {"type": "url", "url": url}}))
        }
        Block::ToolUse { id, name, input } => {
            Some(json!({"type": "tool_use", "id": id, "name": name, "input": input}))
        }
        Block::ToolResult {
            tool_use_id,
            content,
            is_error,
        } => {
            let content: Vec<Value> = content
                .iter()
                .filter(|inner| matches!(inner, Block::Text { .. } | Block::Image { .. }))
                .filter_map(self::block)
                .collect();
            Some(json!({
                "type": "tool_result",
                "tool_use_id": tool_use_id,
                "content": content,
                "is_error": is_error,
            }))
        }
        Block::Native { format, data } if format == AnthropicProvider::NATIVE_FORMAT => {
            Some(data.clone())
        }
        Block::Native { .. } => None,
    }
}

/// Maps a `stop_reason`.
fn stop_reason(reason: Option<&str>) -> StopReason {
    match reason {
        Some("end_turn") => StopReason::EndTurn,
        Some("tool_use") => StopReason::ToolUse,
        Some("max_tokens") => StopReason::MaxTokens,
        Some("stop_sequence") => StopReason::StopSequence,
        Some("refusal") => StopReason::Refusal,
        _ => StopReason::Unknown,
    }
}

/// Maps `usage`: only the counters it carries.
fn usage(value: Option<&Value>) -> Usage {
    let Some(usage) = value.filter(|usage| usage.is_object()) else {
        return Usage::default();
    };
    Usage {
        input_tokens: http::counter(usage.get("input_tokens")),
        output_tokens: http::counter(usage.get("output_tokens")),
        cache_read_input_tokens: http::counter(usage.get("cache_read_input_tokens")),
        cache_creation_input_tokens: http::counter(usage.get("cache_creation_input_tokens")),
        reasoning_tokens: None,
    }
}

/// Maps a 2xx Messages body, or says why it is not one.
fn parse_response(value: &Value) -> Result<ModelResult, String> {
    let blocks = value
        .get("content")
        .and_then(Value::as_array)
        .ok_or("it has no content list")?;
    let mut content = Vec::with_capacity(blocks.len());
    for wire in blocks {
        let kind = wire
            .get("type")
            .and_then(Value::as_str)
            .ok_or("a content block has no type")?;
        let mapped = match kind {
            "text" => Block::text(
                wire.get("text")
                    .and_then(Value::as_str)
                    .ok_or("a text block has no text")?,
            ),
            "tool_use" => Block::ToolUse {
                id: wire
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or("a tool_use block has no id")?
                    .to_owned(),
                name: wire
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or("a tool_use block has no name")?
                    .to_owned(),
                input: wire
                    .get("input")
                    .cloned()
                    .unwrap_or_else(|| Value::Object(Map::new())),
            },
            _ => Block::Native {
                format: AnthropicProvider::NATIVE_FORMAT.to_owned(),
                data: wire.clone(),
            },
        };
        content.push(mapped);
    }
    Ok(ModelResult {
        message: Message {
            role: Role::Assistant,
            content,
        },
        stop_reason: stop_reason(value.get("stop_reason").and_then(Value::as_str)),
        usage: usage(value.get("usage")),
        model: value
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::{ModelMetadata, ModelRequest};
    use crate::session::SessionId;

    fn body_for(model: &ModelMetadata, request: &ModelRequest) -> Value {
        let id = SessionId::parse("ses_0123456789ABCDEFGHIJ").expect("a valid id");
        let call = ModelCall {
            session_id: &id,
            sequence: 7,
            ordinal: 0,
            model,
            request,
        };
        AnthropicProvider::request_body(&call)
    }

    fn model(max_output_tokens: Option<u64>) -> ModelMetadata {
        ModelMetadata {
            provider: "anthropic".into(),
            name: "claude-test".into(),
            context_window: None,
            max_output_tokens,
            extra: Map::new(),
        }
    }

    fn request(messages: Vec<Message>, max_output_tokens: Option<u64>) -> ModelRequest {
        ModelRequest {
            system: None,
            messages,
            tools: None,
            max_output_tokens,
            options: None,
        }
    }

    #[test]
    fn from_env_names_the_variable_never_the_value() {
        let error = AnthropicProvider::from_vars(|_| None).expect_err("no key");
        assert!(error.contains("ANTHROPIC_API_KEY"), "{error}");
        let secret = "sk-ant-secret-value-42";
        let lookup = |name: &str| match name {
            "ANTHROPIC_API_KEY" => Some(OsString::from(secret)),
            "ANTHROPIC_BASE_URL" => Some(OsString::from("http://127.0.0.1:9/")),
            _ => None,
        };
        let provider = AnthropicProvider::from_vars(lookup).expect("configured");
        assert_eq!(provider.endpoint(), "http://127.0.0.1:9/v1/messages");
        let debug = format!("{provider:?}");
        assert!(
            !debug.contains(secret) && debug.contains("[redacted]"),
            "{debug}"
        );
        let defaults = |name: &str| (name == "ANTHROPIC_API_KEY").then(|| OsString::from("k"));
        let provider = AnthropicProvider::from_vars(defaults).expect("configured");
        assert_eq!(provider.endpoint(), "https://api.anthropic.com/v1/messages");
    }

    #[test]
    fn max_tokens_comes_from_the_request_then_the_model_then_the_default() {
        let hi = || vec![Message::text(Role::User, "hi")];
        assert_eq!(
            body_for(&model(Some(2000)), &request(hi(), Some(300)))["max_tokens"],
            300
        );
        assert_eq!(
            body_for(&model(Some(2000)), &request(hi(), None))["max_tokens"],
            2000
        );
        assert_eq!(
            body_for(&model(None), &request(hi(), None))["max_tokens"],
            4096
        );
    }

    #[test]
    fn developer_messages_media_native_and_empty_blocks_map() {
        let messages = vec![
            Message::text(Role::Developer, "Prefer short answers."),
            Message {
                role: Role::User,
                content: vec![
                    Block::text(""),
                    Block::Image {
                        url: "https://example.com/a.png".into(),
                    },
                    Block::File {
                        media_type: "application/pdf".into(),
                        url: "https://example.com/a.pdf".into(),
                    },
                ],
            },
            Message {
                role: Role::Assistant,
                content: vec![
                    Block::Native {
                        format: AnthropicProvider::NATIVE_FORMAT.into(),
                        data: json!({"type": "thinking", "thinking": "hmm", "signature": "s"}),
                    },
                    Block::Native {
                        format: "openai.chat".into(),
                        data: json!({"reasoning_content": "x"}),
                    },
                    Block::text("ok"),
                ],
            },
            Message {
                role: Role::User,
                content: vec![Block::Native {
                    format: "other".into(),
                    data: json!({}),
                }],
            },
        ];
        let mut with_options = request(messages, None);
        with_options.options = Some(
            json!({"anthropic": {"temperature": 0, "system": "no", "stream": true},
                   "openai": {"seed": 1}})
            .as_object()
            .cloned()
            .expect("an object"),
        );
        let body = body_for(&model(None), &with_options);
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "Prefer short answers."}]},
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                    {"type": "document",
                     "source": {"type": "url", "url": "https://example.com/a.pdf"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "ok"}]}
            ])
        );
        assert_eq!(body["temperature"], 0);
        assert!(body.get("system").is_none());
        assert!(body.get("stream").is_none());
        assert!(body.get("seed").is_none());
    }

    #[test]
    fn stop_reasons_map() {
        for (wire, mapped) in [
            ("end_turn", StopReason::EndTurn),
            ("tool_use", StopReason::ToolUse),
            ("max_tokens", StopReason::MaxTokens),
            ("stop_sequence", StopReason::StopSequence),
            ("refusal", StopReason::Refusal),
            ("pause_turn", StopReason::Unknown),
        ] {
            assert_eq!(stop_reason(Some(wire)), mapped, "{wire}");
        }
        assert_eq!(stop_reason(None), StopReason::Unknown);
    }

    #[test]
    fn responses_keep_unknown_blocks_native_and_zero_counters() {
        let thinking = json!({"type": "redacted_thinking", "data": "opaque"});
        let result = parse_response(&json!({
            "type": "message", "role": "assistant", "model": "claude-x",
            "content": [thinking.clone(), {"type": "text", "text": "Hi"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": null}
        }))
        .expect("valid");
        assert_eq!(
            result.message.content,
            vec![
                Block::Native {
                    format: "anthropic.messages".into(),
                    data: thinking
                },
                Block::text("Hi")
            ]
        );
        assert_eq!(
            result.usage,
            Usage {
                input_tokens: Some(5),
                output_tokens: Some(2),
                cache_read_input_tokens: Some(0),
                cache_creation_input_tokens: None,
                reasoning_tokens: None,
            }
        );
        assert_eq!(result.model.as_deref(), Some("claude-x"));
        assert!(parse_response(&json!({"type": "message"})).is_err());
        assert!(parse_response(&json!({"content": [{"text": "no type"}]})).is_err());
    }
}
