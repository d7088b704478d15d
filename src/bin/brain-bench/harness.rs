//! `brain-bench __harness`: the harness the Brain arms run, written with Brain's harness SDK.
//!
//! Each `run` reads its mode from the session configuration's `bench` key and its plan (a JSON
//! object) from the text of the user input:
//!
//! - `none` (or absent): answers `{}` at once — an activation with no callback;
//! - `wait`: answers `{}` after `plan.ms` milliseconds (at once when cancelled);
//! - `kv`: stores a ≈1 KiB value with `kv.put`, then calls `kv.get` of it in a loop;
//! - `model`: calls `model` with a ≈1 KiB user message in a loop;
//! - `turn`: the reference harness's loop without its native state file: `model` with the
//!   transcript and the session's tools, a round's `tool_use` blocks through `tool` all at once,
//!   until the model stops asking; then `transcript.set` and the answer `{"text", "rounds"}`.
//!
//! The loops run until `plan.end_ns` (Unix nanoseconds, the clock shared with the bench) and count
//! the callbacks that started at or after `plan.start_ns`: the answer is
//! `{"calls", "hist"}` (a sparse latency histogram, see `stats.rs`). With `plan.calls` instead
//! they make exactly that many calls, whatever the time (the instruction counts need a fixed
//! workload).

use crate::baselines::PAD_BYTES;
use crate::stats::{Histogram, unix_nanos};
use brain::harness::{Activation, CallError, Handler, HandlerError, serve};
use brain::protocol::harness::{
    Block, Capabilities, Identity, InitializeParams, InitializeResult, KvGetResult, KvKeyInput,
    Message, ModelCallResult, ModelRequest, PROTOCOL, Role, RunParams, SequenceResult, StopReason,
    ToolCallInput, ToolCallResult, ToolDefinition, TranscriptSetInput,
};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

struct BenchHarness;

impl Handler for BenchHarness {
    fn initialize(&self, _: &InitializeParams) -> Result<InitializeResult, HandlerError> {
        Ok(InitializeResult {
            protocol: PROTOCOL.to_owned(),
            identity: Identity {
                name: "brain-bench-harness".to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            },
            state_version: "1".to_owned(),
            capabilities: Capabilities::default(),
            configuration_keys: None,
            required_model_metadata: Vec::new(),
        })
    }

    fn run(&self, activation: &Activation) -> Result<Option<Value>, HandlerError> {
        let params: RunParams = activation
            .params_as()
            .map_err(|error| HandlerError::new("invalid_input", format!("run params: {error}")))?;
        let mode = params
            .input
            .configuration
            .get("bench")
            .and_then(Value::as_str)
            .unwrap_or("none");
        let plan: Value = match params.input.input.as_ref().and_then(|i| i.content.first()) {
            Some(Block::Text { text }) => serde_json::from_str(text).unwrap_or(Value::Null),
            _ => Value::Null,
        };
        match mode {
            "none" => Ok(None),
            "wait" => {
                let ms = plan.get("ms").and_then(Value::as_u64).unwrap_or(0);
                activation
                    .cancel_token()
                    .wait_timeout(Duration::from_millis(ms));
                Ok(None)
            }
            "kv" => {
                let value = "v".repeat(PAD_BYTES);
                activation.call("kv.put", json!({"key": "bench", "value": value}))?;
                let input = KvKeyInput {
                    key: "bench".to_owned(),
                };
                call_loop(&plan, || {
                    activation.call_typed::<_, KvGetResult>("kv.get", &input)
                })
            }
            "model" => {
                let request = ModelRequest {
                    system: None,
                    messages: vec![Message::text(Role::User, "m".repeat(PAD_BYTES))],
                    tools: Some(Vec::new()),
                    max_output_tokens: None,
                    options: None,
                };
                call_loop(&plan, || {
                    activation.call_typed::<_, ModelCallResult>("model", &request)
                })
            }
            "turn" => turn(activation, &params),
            other => Err(HandlerError::harness(format!("unknown bench mode {other}"))),
        }
    }
}

/// Calls `call` until `plan.end_ns`, timing those that start at or after `plan.start_ns`.
fn call_loop<T>(
    plan: &Value,
    mut call: impl FnMut() -> Result<T, CallError>,
) -> Result<Option<Value>, HandlerError> {
    let start = plan.get("start_ns").and_then(Value::as_u64).unwrap_or(0);
    let end = plan.get("end_ns").and_then(Value::as_u64).unwrap_or(0);
    let fixed = plan.get("calls").and_then(Value::as_u64);
    let mut histogram = Histogram::default();
    let mut first = None;
    loop {
        let now = unix_nanos();
        match fixed {
            Some(calls) if histogram.count() >= calls => break,
            None if now >= end => break,
            _ => {}
        }
        let began = Instant::now();
        call()?;
        if now >= start {
            histogram.record(began.elapsed().as_nanos() as u64);
            first.get_or_insert(now);
        }
    }
    Ok(Some(json!({
        "calls": histogram.count(),
        "hist": histogram.to_json(),
        "late_ms": first.map(|first| first.saturating_sub(start) / 1_000_000),
    })))
}

/// One turn of the reference harness's loop, without reading or writing a native state file.
fn turn(activation: &Activation, params: &RunParams) -> Result<Option<Value>, HandlerError> {
    let mut transcript = params.input.transcript.clone();
    if let Some(user) = &params.input.input {
        transcript.push(Message {
            role: Role::User,
            content: user.content.clone(),
        });
    }
    let tools: Vec<ToolDefinition> = params
        .input
        .tools
        .iter()
        .map(|tool| ToolDefinition {
            name: tool.name.clone(),
            description: tool.description.clone(),
            input_schema: tool.input_schema.clone(),
        })
        .collect();
    let mut rounds = 0u64;
    let last = loop {
        rounds += 1;
        let request = ModelRequest {
            system: None,
            messages: transcript.clone(),
            tools: Some(tools.clone()),
            max_output_tokens: None,
            options: None,
        };
        let answer: ModelCallResult = activation.call_typed("model", &request)?;
        let message = answer.result.message;
        transcript.push(message.clone());
        let uses: Vec<(String, String, Value)> = message
            .content
            .iter()
            .filter_map(|block| match block {
                Block::ToolUse { id, name, input } => {
                    Some((id.clone(), name.clone(), input.clone()))
                }
                _ => None,
            })
            .collect();
        if uses.is_empty() || answer.result.stop_reason != StopReason::ToolUse || rounds >= 32 {
            break message;
        }
        // All of a round's calls in flight at once, as the reference harness has them.
        let mut calls = Vec::with_capacity(uses.len());
        for (id, name, input) in uses {
            let call = ToolCallInput {
                name,
                input,
                environment: None,
            };
            calls.push((
                id,
                activation.start_call_typed::<_, ToolCallResult>("tool", &call),
            ));
        }
        // Every call is waited for before an error ends the run.
        let answers: Vec<_> = calls
            .into_iter()
            .map(|(id, call)| (id, call.and_then(|pending| pending.wait())))
            .collect();
        let mut results = Vec::with_capacity(answers.len());
        for (id, answer) in answers {
            let answer = answer?;
            results.push(Block::ToolResult {
                tool_use_id: id,
                content: answer.result.content,
                is_error: answer.result.is_error,
            });
        }
        transcript.push(Message {
            role: Role::User,
            content: results,
        });
    };
    let saved = TranscriptSetInput {
        messages: transcript,
    };
    activation.call_typed::<_, SequenceResult>("transcript.set", &saved)?;
    Ok(Some(json!({"text": last.text_content(), "rounds": rounds})))
}

/// The `__harness` subcommand.
pub fn main() -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .target(env_logger::Target::Stderr)
        .init();
    match serve(&BenchHarness) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            log::error!("reading from Brain failed: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}
