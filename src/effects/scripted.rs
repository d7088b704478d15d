//! [`ScriptedProvider`]: the built-in, deterministic `scripted` model provider (PROTOCOL.md §7.2).

use super::{EffectError, ModelCall, ModelProvider};
use crate::cancel::CancelToken;
use crate::protocol::harness::{ErrorCode, Message, ModelResult, Role, StopReason, Usage};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The built-in `scripted` model provider: instant, deterministic and stateless.
///
/// A *script* is a JSON list of ModelResults. The answer to a session's model call is the script's
/// entry at [`ModelCall::ordinal`] (the number of model calls the session made before, counted from
/// the journal), so each session walks the script from its start, and the answer depends only on
/// the script and the ordinal: never on timing, other sessions or restarts. Entries pass through
/// untouched (tool_use blocks, usage, `model`).
///
/// Where the script comes from, first match wins:
///
/// 1. the request's `options.script` (`call.request.options["script"]`; the session's
///    `model.options` may have been merged into the request's options by Brain);
/// 2. the session's `model.options.script` (`call.model.extra["options"]["script"]`);
/// 3. the provider's global script ([`with_script`](ScriptedProvider::with_script),
///    [`load`](ScriptedProvider::load) for `brain --script FILE`).
///
/// A `null` script counts as absent. A session script's entries are checked when their call comes
/// (a global script is checked whole when it is made).
///
/// With no script at all it echoes: an assistant message with one text block holding the text
/// blocks of the request's last user message, concatenated (`""` when there is no user message or
/// it has no text), stop reason `end_turn`, every usage counter absent (never zero-filled) and no
/// `model`.
///
/// It refuses, with [`EffectError::Failed`] and [`ErrorCode::ModelFailed`] (nothing happened):
/// a script that is not a list, an entry that is not a ModelResult (the message names its index,
/// counted from 0), and a call beyond the script's end (`script exhausted: N results, call #k`,
/// `k` counted from 0). A call whose token is already cancelled fails
/// [`EffectError::Cancelled`] with `sent: false`.
#[derive(Debug, Clone, Default)]
pub struct ScriptedProvider {
    script: Option<Arc<Vec<ModelResult>>>,
}

/// Where a session's script was found, for error messages.
const REQUEST_SOURCE: &str = "the request's options.script";
const MODEL_SOURCE: &str = "the session's model.options.script";

impl ScriptedProvider {
    /// The name the provider is registered under by default: `scripted`.
    pub const NAME: &'static str = "scripted";

    /// A provider with no global script: sessions without a script of their own get echoes.
    pub fn new() -> ScriptedProvider {
        ScriptedProvider::default()
    }

    /// A provider whose global script is `script`, used by every session without a script of its
    /// own.
    pub fn with_script(script: Vec<ModelResult>) -> ScriptedProvider {
        ScriptedProvider {
            script: Some(Arc::new(script)),
        }
    }

    /// Reads a global script from the JSON file at `path` (a list of ModelResults), for
    /// `brain --script FILE`. Blocks on the file read.
    ///
    /// Refuses an unreadable file, invalid JSON, a document that is not a list, and an entry that
    /// is not a ModelResult; the message names the file, and the JSON error (with its line and
    /// column) or the entry's index (counted from 0).
    pub fn load(path: impl AsRef<Path>) -> Result<ScriptedProvider, String> {
        let path = path.as_ref();
        let shown = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|error| format!("script file {shown:?}: {error}"))?;
        let document: Value = serde_json::from_str(&text)
            .map_err(|error| format!("script file {shown:?}: invalid JSON: {error}"))?;
        let Value::Array(entries) = document else {
            return Err(format!(
                "script file {shown:?}: expected a JSON list of ModelResults, found {}",
                kind(&document)
            ));
        };
        let script = entries
            .iter()
            .enumerate()
            .map(|(index, entry)| {
                ModelResult::deserialize(entry).map_err(|error| {
                    format!("script file {shown:?}: result #{index} is not a ModelResult: {error}")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ScriptedProvider::with_script(script))
    }

    /// The answer to `call`, as documented on [`ScriptedProvider`].
    fn answer(&self, call: &ModelCall<'_>) -> Result<ModelResult, EffectError> {
        let from_request = call
            .request
            .options
            .as_ref()
            .and_then(|options| options.get("script"))
            .filter(|script| !script.is_null());
        let from_model = || {
            call.model
                .extra
                .get("options")
                .and_then(|options| options.get("script"))
                .filter(|script| !script.is_null())
        };
        if let Some(script) = from_request {
            return session_entry(script, REQUEST_SOURCE, call.ordinal);
        }
        if let Some(script) = from_model() {
            return session_entry(script, MODEL_SOURCE, call.ordinal);
        }
        match &self.script {
            Some(script) => index(script.len(), call.ordinal)
                .and_then(|at| script.get(at))
                .cloned()
                .ok_or_else(|| exhausted(script.len(), call.ordinal)),
            None => Ok(echo(call)),
        }
    }
}

impl ModelProvider for ScriptedProvider {
    /// Answers at once (never blocks), as documented on [`ScriptedProvider`].
    fn call(&self, call: &ModelCall<'_>, cancel: &CancelToken) -> Result<ModelResult, EffectError> {
        if cancel.is_cancelled() {
            return Err(EffectError::Cancelled { sent: false });
        }
        self.answer(call)
    }

    /// `true`: a script entry or an echo, computed in memory.
    fn answers_at_once(&self) -> bool {
        true
    }
}

/// The entry at `ordinal` of a session's script (a JSON value from the request or the model).
fn session_entry(script: &Value, source: &str, ordinal: u64) -> Result<ModelResult, EffectError> {
    let Value::Array(entries) = script else {
        return Err(failed(format!(
            "{source} must be a list of ModelResults, found {}",
            kind(script)
        )));
    };
    let at = index(entries.len(), ordinal).ok_or_else(|| exhausted(entries.len(), ordinal))?;
    let entry = entries
        .get(at)
        .ok_or_else(|| exhausted(entries.len(), ordinal))?;
    ModelResult::deserialize(entry).map_err(|error| {
        failed(format!(
            "{source}: result #{at} is not a ModelResult: {error}"
        ))
    })
}

/// `ordinal` as an index into a script of `len` entries, if it is one.
fn index(len: usize, ordinal: u64) -> Option<usize> {
    usize::try_from(ordinal).ok().filter(|&at| at < len)
}

fn exhausted(len: usize, ordinal: u64) -> EffectError {
    let plural = if len == 1 { "result" } else { "results" };
    failed(format!("script exhausted: {len} {plural}, call #{ordinal}"))
}

fn failed(message: String) -> EffectError {
    EffectError::Failed {
        code: ErrorCode::ModelFailed,
        message,
    }
}

/// The echo answer: the last user message's text, as an `end_turn` with no usage.
fn echo(call: &ModelCall<'_>) -> ModelResult {
    let text: String = call
        .request
        .messages
        .iter()
        .rev()
        .find(|message| message.role == Role::User)
        .map(Message::text_content)
        .unwrap_or_default();
    ModelResult {
        message: Message::text(Role::Assistant, text),
        stop_reason: StopReason::EndTurn,
        usage: Usage::default(),
        model: None,
    }
}

/// A JSON value's kind, for error messages.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::{Block, ModelMetadata, ModelRequest};
    use crate::session::SessionId;
    use serde_json::{Map, json};

    fn session() -> SessionId {
        SessionId::parse("ses_0123456789abcdefghij").expect("a valid id")
    }

    fn model(options: Option<Value>) -> ModelMetadata {
        let mut extra = Map::new();
        if let Some(options) = options {
            extra.insert("options".into(), options);
        }
        ModelMetadata {
            provider: "scripted".into(),
            name: "default".into(),
            context_window: None,
            max_output_tokens: None,
            extra,
        }
    }

    fn request(messages: Vec<Message>, options: Option<Value>) -> ModelRequest {
        ModelRequest {
            system: None,
            messages,
            tools: None,
            max_output_tokens: None,
            options: options.map(|options| match options {
                Value::Object(map) => map,
                other => panic!("options must be an object, not {other}"),
            }),
        }
    }

    /// Calls `provider` as call number `ordinal` of a session.
    fn call_at(
        provider: &ScriptedProvider,
        model: &ModelMetadata,
        request: &ModelRequest,
        ordinal: u64,
    ) -> Result<ModelResult, EffectError> {
        let id = session();
        let call = ModelCall {
            session_id: &id,
            sequence: ordinal.wrapping_add(100),
            ordinal,
            model,
            request,
        };
        provider.call(&call, &CancelToken::new())
    }

    fn said(text: &str) -> ModelResult {
        ModelResult {
            message: Message::text(Role::Assistant, text),
            stop_reason: StopReason::EndTurn,
            usage: Usage::default(),
            model: None,
        }
    }

    fn user(text: &str) -> Message {
        Message::text(Role::User, text)
    }

    fn failure(result: Result<ModelResult, EffectError>) -> String {
        match result {
            Err(EffectError::Failed {
                code: ErrorCode::ModelFailed,
                message,
            }) => message,
            other => panic!("expected a model_failed error, got {other:?}"),
        }
    }

    #[test]
    fn answers_follow_the_script_by_ordinal_not_by_call_order() {
        let provider = ScriptedProvider::with_script(vec![said("one"), said("two"), said("three")]);
        let (model, request) = (model(None), request(vec![user("hi")], None));
        // Stateless: asking for #2 first, then #0, then #2 again gives the same answers.
        assert_eq!(call_at(&provider, &model, &request, 2), Ok(said("three")));
        assert_eq!(call_at(&provider, &model, &request, 0), Ok(said("one")));
        assert_eq!(call_at(&provider, &model, &request, 2), Ok(said("three")));
        assert_eq!(call_at(&provider, &model, &request, 1), Ok(said("two")));
    }

    #[test]
    fn a_session_script_wins_over_the_global_one_and_the_request_over_the_model() {
        let provider = ScriptedProvider::with_script(vec![said("global")]);
        let from_model = json!({"script": [said("model"), said("model 2")]});
        let from_request = json!({"script": [said("request")]});
        let plain = request(vec![user("hi")], None);

        let answer = call_at(&provider, &model(Some(from_model.clone())), &plain, 1);
        assert_eq!(answer, Ok(said("model 2")));

        let with_options = request(vec![user("hi")], Some(from_request));
        let answer = call_at(&provider, &model(Some(from_model)), &with_options, 0);
        assert_eq!(answer, Ok(said("request")));

        // A null script counts as absent.
        let null = request(vec![user("hi")], Some(json!({"script": null})));
        assert_eq!(
            call_at(&provider, &model(None), &null, 0),
            Ok(said("global"))
        );
    }

    #[test]
    fn tool_use_results_pass_through_intact() {
        let entry = json!({
            "message": {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "call_1", "name": "read_file",
                 "input": {"path": "a.txt", "nested": {"n": [1, 2.5, null]}}},
                {"type": "native", "format": "x", "data": {"opaque": true}}
            ]},
            "stop_reason": "tool_use",
            "usage": {"output_tokens": 12},
            "model": "scripted-1"
        });
        let options = json!({"script": [entry.clone()]});
        let answer = call_at(
            &ScriptedProvider::new(),
            &model(Some(options)),
            &request(vec![user("read a.txt")], None),
            0,
        )
        .expect("scripted");
        assert_eq!(serde_json::to_value(&answer).expect("serializable"), entry);
        assert_eq!(answer.stop_reason, StopReason::ToolUse);
    }

    #[test]
    fn a_call_beyond_the_end_fails_as_exhausted() {
        let provider = ScriptedProvider::with_script(vec![said("one"), said("two")]);
        let (model, request) = (model(None), request(vec![user("hi")], None));
        assert_eq!(
            failure(call_at(&provider, &model, &request, 2)),
            "script exhausted: 2 results, call #2"
        );
        assert_eq!(
            failure(call_at(&provider, &model, &request, u64::MAX)),
            format!("script exhausted: 2 results, call #{}", u64::MAX)
        );
        let session = request_with_script(json!([said("only")]));
        assert_eq!(
            failure(call_at(&provider, &model, &session, 1)),
            "script exhausted: 1 result, call #1"
        );
        let empty = ScriptedProvider::with_script(Vec::new());
        assert_eq!(
            failure(call_at(&empty, &model, &request, 0)),
            "script exhausted: 0 results, call #0"
        );
    }

    fn request_with_script(script: Value) -> ModelRequest {
        request(vec![user("hi")], Some(json!({ "script": script })))
    }

    #[test]
    fn a_malformed_session_script_names_the_index() {
        let (provider, model) = (ScriptedProvider::new(), model(None));
        let script = json!([said("fine"), {"message": {"role": "assistant", "content": []}}]);
        let request = request_with_script(script);
        assert_eq!(call_at(&provider, &model, &request, 0), Ok(said("fine")));
        let message = failure(call_at(&provider, &model, &request, 1));
        assert!(
            message.contains("result #1 is not a ModelResult"),
            "{message}"
        );
        assert!(message.contains("stop_reason"), "{message}");

        let message = failure(call_at(
            &provider,
            &model,
            &request_with_script(json!({"not": "a list"})),
            0,
        ));
        assert_eq!(
            message,
            "the request's options.script must be a list of ModelResults, found an object"
        );
    }

    #[test]
    fn without_a_script_it_echoes_the_last_user_text() {
        let provider = ScriptedProvider::new();
        let model = model(Some(json!({"temperature": 0})));
        let messages = vec![
            user("first"),
            Message {
                role: Role::User,
                content: vec![
                    Block::text("Hello, "),
                    Block::Image {
                        url: "https://example.com/a.png".into(),
                    },
                    Block::text("world"),
                ],
            },
            Message::text(Role::Assistant, "an earlier answer"),
        ];
        let answer = call_at(&provider, &model, &request(messages, None), 5);
        assert_eq!(answer, Ok(said("Hello, world")));

        // A last user message without text, or no user message at all, echoes "".
        let tool_results = vec![
            user("run it"),
            Message {
                role: Role::User,
                content: vec![Block::ToolResult {
                    tool_use_id: "call_1".into(),
                    content: vec![Block::text("done")],
                    is_error: false,
                }],
            },
        ];
        let answer = call_at(&provider, &model, &request(tool_results, None), 0);
        assert_eq!(answer, Ok(said("")));
        let answer = call_at(&provider, &model, &request(Vec::new(), None), 0);
        assert_eq!(answer, Ok(said("")));
    }

    #[test]
    fn the_echo_reports_no_usage_on_the_wire() {
        let answer = call_at(
            &ScriptedProvider::new(),
            &model(None),
            &request(vec![user("Hello")], None),
            0,
        )
        .expect("echo");
        let wire = serde_json::to_value(&answer).expect("serializable");
        assert_eq!(
            wire,
            json!({
                "message": {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
                "stop_reason": "end_turn",
                "usage": {}
            })
        );
        let object = wire.as_object().expect("an object");
        assert!(!object.contains_key("model"));
        assert_eq!(
            object.get("usage").and_then(Value::as_object).map(Map::len),
            Some(0)
        );
    }

    #[test]
    fn a_cancelled_call_sends_nothing() {
        let provider = ScriptedProvider::new();
        let (id, model, request) = (session(), model(None), request(vec![user("hi")], None));
        let cancel = CancelToken::new();
        cancel.cancel();
        let call = ModelCall {
            session_id: &id,
            sequence: 1,
            ordinal: 0,
            model: &model,
            request: &request,
        };
        assert_eq!(
            provider.call(&call, &cancel),
            Err(EffectError::Cancelled { sent: false })
        );
    }

    #[test]
    fn load_reads_a_script_and_names_the_file_when_it_cannot() {
        let dir = std::env::temp_dir().join(format!(
            "brain-scripted-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).expect("write the script");
            path
        };

        let good = write(
            "good.json",
            &serde_json::to_string(&vec![said("a"), said("b")]).expect("json"),
        );
        let provider = ScriptedProvider::load(&good).expect("loads");
        let (model, request) = (model(None), request(vec![user("hi")], None));
        assert_eq!(call_at(&provider, &model, &request, 1), Ok(said("b")));

        let missing = dir.join("missing.json");
        let error = ScriptedProvider::load(&missing).expect_err("no such file");
        assert!(error.contains("missing.json"), "{error}");

        let bad = write("bad.json", "[\n  {\"message\": ");
        let error = ScriptedProvider::load(&bad).expect_err("invalid JSON");
        assert!(
            error.contains("bad.json") && error.contains("invalid JSON"),
            "{error}"
        );
        assert!(error.contains("line 2"), "{error}");

        let object = write("object.json", "{\"script\": []}");
        let error = ScriptedProvider::load(&object).expect_err("not a list");
        assert!(
            error.contains("object.json") && error.contains("found an object"),
            "{error}"
        );

        let entry = write(
            "entry.json",
            &json!([said("a"), {"message": "nope", "stop_reason": "end_turn"}]).to_string(),
        );
        let error = ScriptedProvider::load(&entry).expect_err("a bad entry");
        assert!(
            error.contains("entry.json") && error.contains("result #1"),
            "{error}"
        );

        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
