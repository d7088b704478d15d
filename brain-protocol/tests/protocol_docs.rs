//! Checks every JSON example of `docs/PROTOCOL.md` against the types of `brain-protocol/src/harness.rs`.
//!
//! Each ```` ```json ```` block must carry a tag: `json T` (the block is a `T`) or `json jsonrpc:T`
//! (the block is a whole JSON-RPC line whose `params`, `result` or `error.data` is a `T`). The block
//! must parse as that type, and serializing the parsed value again must keep every member of the
//! example — so a misspelt field name, which serde would silently ignore, fails.

use brain_protocol::harness::*;
use brain_protocol::jsonrpc::{self, RpcError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::BTreeSet;

/// One fenced ```` ```json ```` block.
struct JsonBlock {
    /// The 1-based line of the opening fence.
    line: usize,
    /// What follows `json` in the info string, if anything.
    tag: Option<String>,
    /// The block's text.
    text: String,
}

/// What the examples of a document show, for the coverage checks.
#[derive(Default)]
struct Coverage {
    /// `"request:T"`, `"result:T"`, `"error:T"` and bare `"T"` for every checked block.
    shapes: BTreeSet<String>,
    /// The callback methods of the `brain/call` request examples.
    callbacks: BTreeSet<String>,
    /// Whether a `run` answer with a result and one without (`{}`) were shown.
    run_with_result: bool,
    /// See `run_with_result`.
    run_without_result: bool,
    /// Whether a ModelResult with at least one absent usage counter was shown.
    model_result_with_absent_usage: bool,
}

/// Extracts every fenced block whose info string starts with the word `json`.
fn json_blocks(doc: &str) -> Result<Vec<JsonBlock>, String> {
    let mut blocks = Vec::new();
    let mut lines = doc.lines().enumerate();
    while let Some((index, line)) = lines.next() {
        let Some(info) = line.trim_start().strip_prefix("```") else {
            continue;
        };
        let mut words = info.split_whitespace();
        let is_json = words.next().is_some_and(|w| w.eq_ignore_ascii_case("json"));
        let tag = words.next().map(str::to_owned);
        let mut text = String::new();
        let mut closed = false;
        for (_, body) in lines.by_ref() {
            if body.trim_start().starts_with("```") {
                closed = true;
                break;
            }
            text.push_str(body);
            text.push('\n');
        }
        if !closed {
            return Err(format!("line {}: unterminated code block", index + 1));
        }
        if is_json {
            blocks.push(JsonBlock {
                line: index + 1,
                tag,
                text,
            });
        }
    }
    Ok(blocks)
}

/// Checks that everything in `example` survived into `again`: every member of every object
/// (recursively), every array element, and every scalar's value.
fn covered(example: &Value, again: &Value, path: &str) -> Result<(), String> {
    match (example, again) {
        (Value::Object(example), Value::Object(again)) => {
            for (key, value) in example {
                let here = format!("{path}.{key}");
                let Some(kept) = again.get(key) else {
                    return Err(format!(
                        "member {here} was dropped (a misspelt or unknown field?)"
                    ));
                };
                covered(value, kept, &here)?;
            }
            Ok(())
        }
        (Value::Array(example), Value::Array(again)) => {
            if example.len() != again.len() {
                return Err(format!(
                    "{path}: {} elements became {}",
                    example.len(),
                    again.len()
                ));
            }
            for (index, (value, kept)) in example.iter().zip(again).enumerate() {
                covered(value, kept, &format!("{path}[{index}]"))?;
            }
            Ok(())
        }
        _ if example == again => Ok(()),
        _ => Err(format!("{path}: {example} became {again}")),
    }
}

/// Parses `value` as `T` and serializes it again.
fn reserialize<T: DeserializeOwned + Serialize>(value: &Value) -> Result<Value, String> {
    let typed: T = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
    serde_json::to_value(&typed).map_err(|e| e.to_string())
}

/// Types a `brain/call` params object including its input, and serializes both again.
fn reserialize_brain_call(value: &Value, coverage: &mut Coverage) -> Result<Value, String> {
    let params: BrainCallParams =
        serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
    let input = CallbackInput::decode(&params.method, params.input.clone())
        .map_err(|e| format!("input of {}: {} ({:?})", params.method, e.message, e.data))?;
    coverage
        .callbacks
        .insert(input.method().as_str().to_owned());
    let mut again = serde_json::to_value(&params).map_err(|e| e.to_string())?;
    let input = serde_json::to_value(&input).map_err(|e| e.to_string())?;
    if let Some(object) = again.as_object_mut() {
        object.insert("input".to_owned(), input);
    }
    Ok(again)
}

/// Parses `value` as the type named `tag` and serializes it again; the typed check of each tag.
fn check_type(tag: &str, value: &Value, coverage: &mut Coverage) -> Result<Value, String> {
    match tag {
        // Registrations are parsed strictly (unknown keys refused), so a typo fails the parse.
        "Registrations" => brain::Registrations::parse(&value.to_string(), "docs/PROTOCOL.md")
            .map(|_| value.clone())
            .map_err(|e| e.to_string()),
        "CreateSession" => brain::session::CreateSession::parse(value.to_string().as_bytes())
            .map(|_| value.clone())
            .map_err(|e| e.to_string()),
        "InitializeParams" => reserialize::<InitializeParams>(value),
        "InitializeResult" => reserialize::<InitializeResult>(value),
        "RunParams" => reserialize::<RunParams>(value),
        "RunResult" => {
            let result: RunResult =
                serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
            match result.result {
                Some(_) => coverage.run_with_result = true,
                None => coverage.run_without_result = true,
            }
            serde_json::to_value(&result).map_err(|e| e.to_string())
        }
        "HarnessErrorData" => reserialize::<HarnessErrorData>(value),
        "CancelParams" => reserialize::<CancelParams>(value),
        "CloseParams" => reserialize::<CloseParams>(value),
        "ShutdownParams" => reserialize::<ShutdownParams>(value),
        "Empty" => reserialize::<Empty>(value),
        "BrainCallParams" => reserialize_brain_call(value, coverage),
        "CallErrorData" => {
            let data: CallErrorData =
                serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
            let code = data
                .error_code()
                .ok_or_else(|| format!("{:?} is not an error code", data.code))?;
            if data.fatal != code.is_fatal() {
                return Err(format!("{code} has fatal {}", code.is_fatal()));
            }
            serde_json::to_value(&data).map_err(|e| e.to_string())
        }
        "Message" => reserialize::<Message>(value),
        "Block" => reserialize::<Block>(value),
        "UserInput" => reserialize::<UserInput>(value),
        "Event" => reserialize::<Event>(value),
        "ModelMetadata" => reserialize::<ModelMetadata>(value),
        "ModelRequest" => reserialize::<ModelRequest>(value),
        "ModelResult" => {
            let result: ModelResult =
                serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
            let usage = &result.usage;
            if [
                usage.input_tokens,
                usage.output_tokens,
                usage.cache_read_input_tokens,
                usage.cache_creation_input_tokens,
                usage.reasoning_tokens,
            ]
            .contains(&None)
            {
                coverage.model_result_with_absent_usage = true;
            }
            serde_json::to_value(&result).map_err(|e| e.to_string())
        }
        "ModelCallResult" => reserialize::<ModelCallResult>(value),
        "ToolCallInput" => reserialize::<ToolCallInput>(value),
        "ToolResult" => reserialize::<ToolResult>(value),
        "ToolCallResult" => reserialize::<ToolCallResult>(value),
        "EmitInput" => reserialize::<EmitInput>(value),
        "SequenceResult" => reserialize::<SequenceResult>(value),
        "TranscriptSetInput" => reserialize::<TranscriptSetInput>(value),
        "KvKeyInput" => reserialize::<KvKeyInput>(value),
        "KvPutInput" => reserialize::<KvPutInput>(value),
        "KvGetResult" => reserialize::<KvGetResult>(value),
        "EventsReadInput" => reserialize::<EventsReadInput>(value),
        "EventsReadResult" => reserialize::<EventsReadResult>(value),
        "EnvironmentNameInput" => reserialize::<EnvironmentNameInput>(value),
        "EnvironmentsListResult" => reserialize::<EnvironmentsListResult>(value),
        "EnvironmentInfo" => reserialize::<EnvironmentInfo>(value),
        "EnvironmentsCallInput" => reserialize::<EnvironmentsCallInput>(value),
        "EnvironmentsCallResult" => reserialize::<EnvironmentsCallResult>(value),
        _ => Err(format!("unknown tag {tag:?}")),
    }
}

/// The method whose params a type is, for request envelopes.
fn method_of(params_type: &str) -> Option<&'static str> {
    Some(match params_type {
        "InitializeParams" => method::INITIALIZE,
        "RunParams" => method::RUN,
        "CancelParams" => method::CANCEL,
        "CloseParams" => method::CLOSE,
        "ShutdownParams" => method::SHUTDOWN,
        "BrainCallParams" => method::BRAIN_CALL,
        _ => return None,
    })
}

/// Checks a whole JSON-RPC line whose params, result or error data is a `tag`.
fn check_envelope(tag: &str, value: &Value, coverage: &mut Coverage) -> Result<Value, String> {
    let line = serde_json::to_vec(value).map_err(|e| e.to_string())?;
    let message = jsonrpc::decode(&line).map_err(|v| format!("not a JSON-RPC message: {v}"))?;
    let mut again = value.clone();
    let Some(object) = again.as_object_mut() else {
        return Err("not an object".to_owned());
    };
    match message {
        jsonrpc::Message::Request(request) => {
            let expected = method_of(tag).ok_or_else(|| format!("{tag} is not a params type"))?;
            if request.method != expected {
                return Err(format!(
                    "{tag} is the params of {expected:?}, not {:?}",
                    request.method
                ));
            }
            let params = check_type(tag, &request.params, coverage)?;
            object.insert("params".to_owned(), params);
            coverage.shapes.insert(format!("request:{tag}"));
        }
        jsonrpc::Message::Response(response) => match response.outcome {
            Ok(result) => {
                let result = check_type(tag, &result, coverage)?;
                object.insert("result".to_owned(), result);
                coverage.shapes.insert(format!("result:{tag}"));
            }
            Err(error) => {
                let data = error
                    .data
                    .as_ref()
                    .ok_or_else(|| "an error without data".to_owned())?;
                let data = check_type(tag, data, coverage)?;
                if tag == "CallErrorData" {
                    check_call_error(&error)?;
                }
                let error = RpcError {
                    data: Some(data),
                    ..error
                };
                let error = serde_json::to_value(&error).map_err(|e| e.to_string())?;
                object.insert("error".to_owned(), error);
                coverage.shapes.insert(format!("error:{tag}"));
            }
        },
        jsonrpc::Message::Notification(_) => {
            return Err("a notification: brain/harness/v1 defines none".to_owned());
        }
    }
    Ok(again)
}

/// Checks that a callback error example is exactly what Brain would send for its code.
fn check_call_error(error: &RpcError) -> Result<(), String> {
    let data = CallErrorData::from_rpc_error(error).ok_or("no callback error data")?;
    let code = data.error_code().ok_or("unknown error code")?;
    let built = call_error(code, error.message.clone());
    if &built != error {
        return Err(format!("Brain sends {built:?} for {code}, not {error:?}"));
    }
    Ok(())
}

/// Checks one block; the error names the problem, not the line.
fn check_block(tag: Option<&str>, text: &str, coverage: &mut Coverage) -> Result<(), String> {
    let tag = tag.ok_or("a json block without a type tag")?;
    let example: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let again = match tag.strip_prefix("jsonrpc:") {
        Some(inner) => check_envelope(inner, &example, coverage)?,
        None => {
            let again = check_type(tag, &example, coverage)?;
            coverage.shapes.insert(tag.to_owned());
            again
        }
    };
    covered(&example, &again, "$")
}

/// Checks every json block of a document; errors name the block's line.
fn check_doc(doc: &str) -> Result<Coverage, Vec<String>> {
    let blocks = json_blocks(doc).map_err(|e| vec![e])?;
    let mut coverage = Coverage::default();
    let mut errors = Vec::new();
    for block in &blocks {
        if let Err(error) = check_block(block.tag.as_deref(), &block.text, &mut coverage) {
            let tag = block.tag.as_deref().unwrap_or("(none)");
            errors.push(format!(
                "docs/PROTOCOL.md line {} (json {tag}): {error}",
                block.line
            ));
        }
    }
    if errors.is_empty() {
        Ok(coverage)
    } else {
        Err(errors)
    }
}

fn protocol_doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/PROTOCOL.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

#[test]
fn every_example_in_the_protocol_doc_parses_as_its_type_and_loses_nothing() {
    let coverage = match check_doc(&protocol_doc()) {
        Ok(coverage) => coverage,
        Err(errors) => panic!("{}", errors.join("\n")),
    };
    let required = [
        "request:InitializeParams",
        "result:InitializeResult",
        "request:RunParams",
        "result:RunResult",
        "error:HarnessErrorData",
        "request:CancelParams",
        "request:CloseParams",
        "request:ShutdownParams",
        "result:Empty",
        "request:BrainCallParams",
        "error:CallErrorData",
        "result:ModelCallResult",
        "result:ToolCallResult",
        "result:SequenceResult",
        "result:KvGetResult",
        "result:EventsReadResult",
        "result:EnvironmentsListResult",
        "result:EnvironmentInfo",
        "result:EnvironmentsCallResult",
        "Message",
        "UserInput",
        "ModelRequest",
        "ModelResult",
        "ToolResult",
        "Event",
    ];
    for shape in required {
        assert!(
            coverage.shapes.contains(shape),
            "docs/PROTOCOL.md has no example of {shape}"
        );
    }
    for method in CallbackMethod::ALL {
        assert!(
            coverage.callbacks.contains(method.as_str()),
            "docs/PROTOCOL.md has no brain/call example for {method}"
        );
    }
    assert!(coverage.run_with_result, "no run answer with a result");
    assert!(coverage.run_without_result, "no run answer `{{}}`");
    assert!(
        coverage.model_result_with_absent_usage,
        "no ModelResult with an absent usage counter"
    );
}

#[test]
fn the_protocol_doc_names_every_code_method_and_record_kind() {
    let doc = protocol_doc();
    let names = ErrorCode::ALL
        .iter()
        .map(|c| c.as_str())
        .chain(CallbackMethod::ALL.iter().map(|m| m.as_str()))
        .chain(RecordKind::ALL.iter().map(|k| k.as_str()));
    for name in names {
        assert!(
            doc.contains(&format!("`{name}`")),
            "docs/PROTOCOL.md does not mention `{name}`"
        );
    }
}

/// The checker itself: these documents must fail, each for the stated reason.
#[test]
fn the_checker_refuses_typos_missing_tags_and_unknown_tags() {
    let fails = |doc: &str, expected: &str| match check_doc(doc) {
        Ok(_) => panic!("accepted:\n{doc}"),
        Err(errors) => assert!(
            errors.iter().any(|e| e.contains(expected)),
            "{errors:?} lacks {expected:?}"
        ),
    };
    // A misspelt optional field is ignored by serde; the coverage check catches it.
    fails(
        "x\n```json ModelResult\n{\"message\":{\"role\":\"assistant\",\"content\":[]},\
         \"stop_reason\":\"end_turn\",\"usage\":{\"input_tokns\":3}}\n```\n",
        "line 2 (json ModelResult): member $.usage.input_tokns was dropped",
    );
    fails(
        "```json jsonrpc:RunParams\n{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"cancel\",\
         \"params\":{\"session_id\":\"s\",\"sequence\":1}}\n```\n",
        "not \"cancel\"",
    );
    fails(
        "```json Event\n{\"sequence\":1,\"type\":\"t\",\"recorded_at_ms\":1,\"data\":{},\
         \"origin\":{\"kind\":\"agentloop\",\"sequense\":1}}\n```\n",
        "missing field `sequence`",
    );
    fails(
        "```json jsonrpc:BrainCallParams\n{\"jsonrpc\":\"2.0\",\"id\":\"c\",\"method\":\"brain/call\",\
         \"params\":{\"session_id\":\"s\",\"sequence\":1,\"method\":\"tool\",\
         \"input\":{\"name\":\"bash\",\"input\":{},\"enviroment\":\"w\"}}}\n```\n",
        "$.params.input.enviroment was dropped",
    );
    fails(
        "```json jsonrpc:CallErrorData\n{\"jsonrpc\":\"2.0\",\"id\":\"c\",\"error\":{\"code\":-32000,\
         \"message\":\"m\",\"data\":{\"code\":\"cancelled\",\"fatal\":false}}}\n```\n",
        "cancelled has fatal true",
    );
    fails("text\n\n```json\n{}\n```\n", "line 3 (json (none))");
    fails("```json Nonsense\n{}\n```\n", "unknown tag \"Nonsense\"");
    fails("```json Empty\n{\"a\":\n```\n", "not JSON");
    fails("```json Empty\n{}\n", "unterminated");

    // Other code blocks are not examples; a tagged block that is right passes.
    let coverage = check_doc(
        "```text\nnot json\n```\n\n```json KvGetResult\n{\"found\":true,\"value\":null}\n```\n",
    )
    .unwrap_or_else(|e| panic!("{e:?}"));
    assert!(coverage.shapes.contains("KvGetResult"));
}
