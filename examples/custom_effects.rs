//! Embedding Brain with effects of your own: a model provider and an environment driver.
//!
//! The bundled reference harness runs one tool-calling turn. Its model is `RuleModel`, a tiny
//! rule-based "model" that asks for the `calculate` tool once and then answers with the result;
//! the tool runs in `Calculator`, an in-process environment driver. Nothing is cancelled: a
//! watchdog thread holds a `Canceller` and would cancel the turn only if it took more than 30 s.
//! Run it after `cargo build`:
//!
//! ```sh
//! cargo run --example custom_effects -- target/debug/brain-reference-harness brain-data
//! ```

use brain::cancel::CancelToken;
use brain::effects::{EffectError, Effects, EnvironmentDriver, ModelCall, ModelProvider, ToolCall};
use brain::protocol::harness::{
    Block, ErrorCode, Message, ModelResult, Role, StopReason, ToolOutcome, ToolResult, Usage,
    UserInput,
};
use brain::{Brain, Config, Registration, Registrations, Storage};
use serde_json::json;
use std::error::Error;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

/// A "model" made of two rules. Brain calls it on one of its callback threads, possibly for many
/// sessions at once, so it keeps no state: everything it needs is in the request.
struct RuleModel;

impl ModelProvider for RuleModel {
    fn call(&self, call: &ModelCall<'_>, cancel: &CancelToken) -> Result<ModelResult, EffectError> {
        // Nothing has been sent anywhere yet: a cancelled call definitely did not happen.
        if cancel.is_cancelled() {
            return Err(EffectError::Cancelled { sent: false });
        }
        let messages = &call.request.messages;
        let Some(last) = messages.last() else {
            return Err(EffectError::Failed {
                code: ErrorCode::ModelFailed,
                message: "the request has no messages".to_owned(),
            });
        };
        // Rule 2: the tool has answered. Report its result next to the expression asked for.
        let result = last.content.iter().find_map(|block| match block {
            Block::ToolResult { content, .. } => Some(text_of(content)),
            _ => None,
        });
        if let Some(result) = result {
            let expression = messages
                .iter()
                .rev()
                .flat_map(|message| &message.content)
                .find_map(|block| match block {
                    Block::ToolUse { input, .. } => input["expression"].as_str(),
                    _ => None,
                })
                .unwrap_or("it");
            return Ok(answer(
                Message::text(Role::Assistant, format!("{expression} = {result}")),
                StopReason::EndTurn,
            ));
        }
        // Rule 1: the user asks for some arithmetic. Ask for the tool, once.
        match find_expression(&last.text_content()) {
            Some(expression) => Ok(answer(
                Message {
                    role: Role::Assistant,
                    content: vec![Block::ToolUse {
                        // The started record's sequence names this call for good.
                        id: format!("call_{}", call.sequence),
                        name: "calculate".to_owned(),
                        input: json!({ "expression": expression }),
                    }],
                },
                StopReason::ToolUse,
            )),
            None => Ok(answer(
                Message::text(Role::Assistant, "Ask me something like 6 * 7."),
                StopReason::EndTurn,
            )),
        }
    }
}

/// A model result without usage: counters the model did not report stay absent, never zero.
fn answer(message: Message, stop_reason: StopReason) -> ModelResult {
    ModelResult {
        message,
        stop_reason,
        usage: Usage::default(),
        model: Some("rules-1".to_owned()),
    }
}

/// The text blocks of some content, concatenated.
fn text_of(content: &[Block]) -> String {
    content
        .iter()
        .filter_map(|block| match block {
            Block::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// The first `A op B` in `text` (integers, one of `+ - * /`), as `"A op B"`.
fn find_expression(text: &str) -> Option<String> {
    let words: Vec<&str> = text
        .split_whitespace()
        .map(|word| word.trim_matches(|c: char| !c.is_ascii_alphanumeric() && !"+-*/".contains(c)))
        .collect();
    words.windows(3).find_map(|window| {
        let [a, op, b] = window else { return None };
        let numbers = a.parse::<i64>().is_ok() && b.parse::<i64>().is_ok();
        (numbers && ["+", "-", "*", "/"].contains(op)).then(|| format!("{a} {op} {b}"))
    })
}

/// An environment driver that evaluates `A op B` in-process.
struct Calculator;

impl EnvironmentDriver for Calculator {
    fn call_tool(
        &self,
        call: &ToolCall<'_>,
        cancel: &CancelToken,
    ) -> Result<ToolResult, EffectError> {
        // `Err` means the tool never started: Brain answers the harness `tool_failed`.
        if call.tool != "calculate" {
            return Err(EffectError::Failed {
                code: ErrorCode::ToolFailed,
                message: format!("the calculator has no tool {:?}", call.tool),
            });
        }
        if cancel.is_cancelled() {
            return Err(EffectError::Cancelled { sent: false });
        }
        // From here on the tool has started: however it ends, the answer is a ToolResult.
        let expression = call.input["expression"].as_str().unwrap_or_default();
        Ok(match evaluate(expression) {
            Ok(value) => ToolResult {
                outcome: ToolOutcome::Ok,
                content: vec![Block::text(value.to_string())],
                is_error: false,
            },
            Err(why) => ToolResult {
                outcome: ToolOutcome::Error,
                content: vec![Block::text(why)],
                is_error: true,
            },
        })
    }
}

/// Evaluates `A op B` with checked integer arithmetic.
fn evaluate(expression: &str) -> Result<i64, String> {
    let parts: Vec<&str> = expression.split_whitespace().collect();
    let [a, op, b] = parts.as_slice() else {
        return Err(format!("{expression:?} is not `A op B`"));
    };
    let number = |text: &str| {
        text.parse::<i64>()
            .map_err(|_| format!("{text:?} is not an integer"))
    };
    let (a, b) = (number(a)?, number(b)?);
    let value = match *op {
        "+" => a.checked_add(b),
        "-" => a.checked_sub(b),
        "*" => a.checked_mul(b),
        "/" => a.checked_div(b),
        other => return Err(format!("{other:?} is not one of + - * /")),
    };
    value.ok_or_else(|| format!("{expression} overflows or divides by zero"))
}

/// One tool-calling turn through an embedded Brain with the effects above; returns the answer.
pub fn run(harness: &str, data_dir: &Path) -> Result<String, Box<dyn Error>> {
    let registrations = Registrations::from_vec(vec![Registration::new("reference", harness)])?;
    let mut config = Config::new(registrations);
    // The durable data directory is the default storage; it is locked while Brain runs.
    config.storage = Storage::DataDir;
    config.options.data_dir = data_dir.to_path_buf();
    // Effects are looked up by name: sessions choose `model.provider` and each environment's
    // `driver`. The built-in `scripted` provider and `local` driver stay registered.
    config.effects = Effects::default()
        .with_provider("rules", Arc::new(RuleModel))
        .with_driver("calculator", Arc::new(Calculator));

    // Blocks until every worker answered `initialize` (or failed).
    let brain = Brain::start(config)?;

    // The session picks the provider, declares the tool, and places it in an environment that
    // the calculator driver runs.
    let session = brain.create_session_json(
        br#"{
            "agentloop": {"name": "reference"},
            "model": {"provider": "rules", "name": "rules-1"},
            "tools": [{"name": "calculate", "description": "Evaluates A op B",
                       "input_schema": {"type": "object",
                                        "properties": {"expression": {"type": "string"}}},
                       "placements": ["math"]}],
            "environments": [{"name": "math", "driver": "calculator"}]
        }"#,
    )?;

    // Returns once the activation is admitted (its first record durable).
    let activation = session.send(UserInput {
        content: vec![Block::text("What is 6 * 7?")],
    })?;

    // A watchdog on another thread: a `Canceller` is `Send + Clone`. It cancels the turn only if
    // the turn has not ended within 30 s; dropping `done` tells it the turn has ended.
    let canceller = activation.canceller();
    let (done, ended) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if ended.recv_timeout(Duration::from_secs(30)) == Err(RecvTimeoutError::Timeout) {
            // `activation_not_active` if it ended meanwhile: nothing to do then.
            let _ = canceller.cancel();
        }
    });

    // Blocks until the outcome is recorded, or 60 s pass (a cancel ends it well before that).
    let outcome = activation.wait_timeout(Duration::from_secs(60));
    drop(done);
    let _ = watchdog.join();

    // Lets running activations finish for up to 10 s (none are left here), then stops the
    // workers, giving each 5 s to exit before its process group is killed.
    brain.shutdown_after(Duration::from_secs(10), Duration::from_secs(5));

    let outcome = outcome.ok_or("the activation did not finish within 60 s")?;
    match (outcome.result, outcome.error) {
        (Some(result), _) => Ok(result["text"].as_str().unwrap_or_default().to_owned()),
        (None, Some(error)) => Err(format!("{}: {}", error.code, error.message).into()),
        (None, None) => Ok(String::new()),
    }
}

#[allow(dead_code)] // When the example is compiled into a test, the test calls `run` directly.
fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let harness = args
        .next()
        .unwrap_or_else(|| "target/debug/brain-reference-harness".to_owned());
    let data_dir = args.next().unwrap_or_else(|| "brain-data".to_owned());
    println!("{}", run(&harness, Path::new(&data_dir))?);
    Ok(())
}
