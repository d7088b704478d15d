//! JSON-RPC 2.0 messages as brain/harness/v1 uses them: one object per line, requests with ids in
//! both directions, no batches.
//!
//! [`decode`] turns one line into a [`Message`] or names the [`Violation`] that makes it unusable.
//! It is deliberately strict about the envelope (the `jsonrpc` member, the id's type, exactly one of
//! `result`/`error`) and lenient about everything else: unknown members are ignored.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::fmt;

/// The id of a request: an integer or a string, echoed exactly (with its JSON type) in the response.
///
/// Brain's own ids are integers from 1. A harness may use either form. A JSON `null`, a fraction or an
/// integer outside `i64` is not an id; a message carrying one is a violation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RequestId {
    /// An integer id.
    Int(i64),
    /// A string id.
    Str(String),
}

impl From<i64> for RequestId {
    fn from(id: i64) -> Self {
        RequestId::Int(id)
    }
}

impl From<&str> for RequestId {
    fn from(id: &str) -> Self {
        RequestId::Str(id.to_owned())
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestId::Int(n) => write!(f, "{n}"),
            RequestId::Str(s) => write!(f, "{s:?}"),
        }
    }
}

impl RequestId {
    fn from_value(value: &Value) -> Option<RequestId> {
        match value {
            Value::Number(n) => n.as_i64().map(RequestId::Int),
            Value::String(s) => Some(RequestId::Str(s.clone())),
            _ => None,
        }
    }
}

/// A request: a method, its params (absent means `null`) and an id.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The id the response must echo.
    pub id: RequestId,
    /// The method name.
    pub method: String,
    /// The params; `Value::Null` when the member was absent.
    pub params: Value,
}

/// A notification: a request without an id. brain/harness/v1 defines none; Brain ignores them.
#[derive(Debug, Clone, PartialEq)]
pub struct Notification {
    /// The method name.
    pub method: String,
    /// The params; `Value::Null` when the member was absent.
    pub params: Value,
}

/// A response: the id of the request it answers and either a result or an error.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// The id of the request this answers.
    pub id: RequestId,
    /// `Ok(result)` or `Err(error)`.
    pub outcome: Result<Value, RpcError>,
}

/// A JSON-RPC error object. Brain's errors always carry `data.code` (a string from the protocol's
/// error-code list); a harness's errors may carry anything.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RpcError {
    /// The JSON-RPC error code (-32600, -32601, -32602, -32000, …).
    pub code: i64,
    /// A human-readable message.
    pub message: String,
    /// Structured detail; absent is `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// JSON-RPC error code: the message is not a valid request.
pub const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC error code: the method is unknown.
pub const METHOD_NOT_FOUND: i64 = -32601;
/// JSON-RPC error code: the params are invalid.
pub const INVALID_PARAMS: i64 = -32602;
/// JSON-RPC error code Brain uses for every other error.
pub const SERVER_ERROR: i64 = -32000;

/// One decoded line.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// A request expecting a response.
    Request(Request),
    /// A response to an earlier request.
    Response(Response),
    /// A notification (ignored by Brain).
    Notification(Notification),
}

/// Why a line could not be used. Every violation is logged, counted and never answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Violation {
    /// The line exceeded the line limit; it was discarded up to its newline.
    LineTooLong,
    /// The line is not valid UTF-8.
    InvalidUtf8,
    /// The line is not JSON.
    InvalidJson,
    /// The JSON value is not an object (arrays, i.e. batches, included).
    NotAnObject,
    /// The object is neither a valid request, notification nor response.
    InvalidMessage,
    /// A request reused an id that is still outstanding from the same peer.
    DuplicateId,
    /// A response named an id that was never sent or was already answered.
    UnknownResponseId,
}

impl Violation {
    /// A stable snake_case name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Violation::LineTooLong => "line_too_long",
            Violation::InvalidUtf8 => "invalid_utf8",
            Violation::InvalidJson => "invalid_json",
            Violation::NotAnObject => "not_an_object",
            Violation::InvalidMessage => "invalid_message",
            Violation::DuplicateId => "duplicate_id",
            Violation::UnknownResponseId => "unknown_response_id",
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Decodes one line (without its terminator) into a message.
///
/// Refuses, naming the violation: bytes that are not UTF-8, text that is not JSON, JSON that is not
/// an object, and objects that are not a JSON-RPC 2.0 request, notification or response (wrong or
/// missing `jsonrpc`, an id that is neither an integer nor a string, both or neither of
/// `result`/`error`, an error object without an integer `code` and a string `message`, params that
/// are neither an object nor an array). Unknown members are ignored.
pub fn decode(line: &[u8]) -> Result<Message, Violation> {
    let text = std::str::from_utf8(line).map_err(|_| Violation::InvalidUtf8)?;
    let value: Value = serde_json::from_str(text).map_err(|_| Violation::InvalidJson)?;
    let Value::Object(mut object) = value else {
        return Err(Violation::NotAnObject);
    };
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(Violation::InvalidMessage);
    }
    match object.remove("method") {
        Some(Value::String(method)) => decode_request(method, object),
        Some(_) => Err(Violation::InvalidMessage),
        None => decode_response(object),
    }
}

fn decode_request(method: String, mut object: Map<String, Value>) -> Result<Message, Violation> {
    let params = match object.remove("params") {
        None => Value::Null,
        Some(params @ (Value::Object(_) | Value::Array(_))) => params,
        Some(_) => return Err(Violation::InvalidMessage),
    };
    match object.get("id") {
        None => Ok(Message::Notification(Notification { method, params })),
        Some(id) => {
            let id = RequestId::from_value(id).ok_or(Violation::InvalidMessage)?;
            Ok(Message::Request(Request { id, method, params }))
        }
    }
}

fn decode_response(mut object: Map<String, Value>) -> Result<Message, Violation> {
    let id = object
        .get("id")
        .and_then(RequestId::from_value)
        .ok_or(Violation::InvalidMessage)?;
    let outcome = match (object.remove("result"), object.remove("error")) {
        (Some(result), None) => Ok(result),
        (None, Some(error)) => {
            Err(serde_json::from_value::<RpcError>(error).map_err(|_| Violation::InvalidMessage)?)
        }
        _ => return Err(Violation::InvalidMessage),
    };
    Ok(Message::Response(Response { id, outcome }))
}

/// Decodes a line that is a well-formed JSON-RPC 2.0 success response, keeping the result as
/// JSON text (no `Value` tree). `None` for any other line: decode those with [`decode`], which
/// names what is wrong. For every line this accepts, `decode` gives a response with the same id
/// and that result.
pub fn decode_result(line: &[u8]) -> Option<(RequestId, Box<RawValue>)> {
    // A request (a `run` with its transcript, say) would be scanned whole before the typed parse
    // failed, and then parsed again by `decode`. Without these bytes the line is left to
    // `decode`, which reads an escaped member name as this function would.
    // A finder built once, not per line.
    static RESULT: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(br#""result""#));
    RESULT.find(line)?;
    #[derive(Deserialize)]
    struct Wire<'a> {
        jsonrpc: &'a str,
        #[serde(borrow)]
        id: &'a RawValue,
        result: Box<RawValue>,
        #[serde(default, deserialize_with = "present")]
        error: bool,
        #[serde(default, deserialize_with = "present")]
        method: bool,
    }
    let wire: Wire = serde_json::from_slice(line).ok()?;
    if wire.jsonrpc != "2.0" || wire.error || wire.method {
        return None;
    }
    let id = RequestId::from_value(&serde_json::from_str(wire.id.get()).ok()?)?;
    Some((id, wire.result))
}

/// The id of a line that starts as [`encode_result`] starts a success response to a string id
/// without escapes: `{"jsonrpc":"2.0","id":"<id>","result":`. Only that start is read: the whole
/// line is read once, later, by [`decode_result_line`], which refuses it if it is not a success
/// response after all. So a harness's reader can hand an answer to its caller without scanning a
/// result it does not type (half of the SDK's instructions per durable callback went to reading
/// each answer twice, docs/BENCHMARKS.md). `None` for any other line: read those with
/// [`decode_result`] or [`decode`].
pub fn result_line_id(line: &[u8]) -> Option<RequestId> {
    const START: &[u8] = br#"{"jsonrpc":"2.0","id":""#;
    const RESULT: &[u8] = br#"","result":"#;
    let rest = line.strip_prefix(START)?;
    let end = rest
        .iter()
        .position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)?;
    if !rest[end..].starts_with(RESULT) {
        return None;
    }
    let id = std::str::from_utf8(&rest[..end]).ok()?;
    Some(RequestId::Str(id.to_owned()))
}

/// The result of a whole line that is a well-formed JSON-RPC 2.0 success response, as
/// [`decode_result`] accepts one (no `error` or `method` member), typed as `T` in one pass.
///
/// # Errors
/// Names what is wrong when the line is not such a response or its result is not a `T`.
pub fn decode_result_line<T: serde::de::DeserializeOwned>(line: &[u8]) -> Result<T, String> {
    #[derive(Deserialize)]
    struct Wire<'a, T> {
        #[serde(borrow)]
        jsonrpc: &'a str,
        #[allow(dead_code)]
        id: serde::de::IgnoredAny,
        result: T,
        #[serde(default, deserialize_with = "present")]
        error: bool,
        #[serde(default, deserialize_with = "present")]
        method: bool,
    }
    // Checked once as a whole, so that the parse need not check each string (as
    // `BrainCall::decode_request` does).
    let text = std::str::from_utf8(line).map_err(|error| format!("not UTF-8: {error}"))?;
    let wire: Wire<T> = serde_json::from_str(text).map_err(|error| error.to_string())?;
    if wire.jsonrpc != "2.0" {
        return Err(format!("jsonrpc is {:?}, not \"2.0\"", wire.jsonrpc));
    }
    if wire.error || wire.method {
        return Err("a success response has no error or method member".to_owned());
    }
    Ok(wire.result)
}

/// Decodes a line that is a well-formed JSON-RPC 2.0 request, keeping the params as JSON text
/// (no `Value` tree; absent params are `null`). `None` for any other line: decode those with
/// [`decode`], which names what is wrong. For every line this accepts, `decode` gives a request
/// with the same id, method and params.
pub fn decode_raw_request(line: &[u8]) -> Option<(RequestId, String, Box<RawValue>)> {
    #[derive(Deserialize)]
    struct Wire<'a> {
        jsonrpc: &'a str,
        #[serde(borrow)]
        id: &'a RawValue,
        method: String,
        #[serde(default, deserialize_with = "raw_member")]
        params: Option<Box<RawValue>>,
    }
    let wire: Wire = serde_json::from_slice(line).ok()?;
    if wire.jsonrpc != "2.0" {
        return None;
    }
    let params = match wire.params {
        None => RawValue::from_string("null".to_owned()).ok()?,
        // `decode` refuses params that are neither an object nor an array (`null` included).
        Some(params) if params.get().starts_with(['{', '[']) => params,
        Some(_) => return None,
    };
    let id = RequestId::from_value(&serde_json::from_str(wire.id.get()).ok()?)?;
    Some((id, wire.method, params))
}

/// A member that is there, whatever its value (`null` included).
fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<bool, D::Error> {
    serde::de::IgnoredAny::deserialize(deserializer).map(|_| true)
}

/// A member's JSON text, `Some` whenever the member is there (`null` included, unlike `Option`'s
/// own reading).
fn raw_member<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Box<RawValue>>, D::Error> {
    Box::<RawValue>::deserialize(deserializer).map(Some)
}

/// Encodes a request as one line (without the newline).
pub fn encode_request(id: &RequestId, method: &str, params: &impl Serialize) -> Vec<u8> {
    #[derive(Serialize)]
    struct Wire<'a, P> {
        jsonrpc: &'static str,
        id: &'a RequestId,
        method: &'a str,
        params: &'a P,
    }
    to_line(&Wire {
        jsonrpc: "2.0",
        id,
        method,
        params,
    })
}

/// Encodes a successful response as one line (without the newline).
pub fn encode_result(id: &RequestId, result: &impl Serialize) -> Vec<u8> {
    #[derive(Serialize)]
    struct Wire<'a, R> {
        jsonrpc: &'static str,
        id: &'a RequestId,
        result: &'a R,
    }
    to_line(&Wire {
        jsonrpc: "2.0",
        id,
        result,
    })
}

/// Encodes an error response as one line (without the newline).
pub fn encode_error(id: &RequestId, error: &RpcError) -> Vec<u8> {
    #[derive(Serialize)]
    struct Wire<'a> {
        jsonrpc: &'static str,
        id: &'a RequestId,
        error: &'a RpcError,
    }
    to_line(&Wire {
        jsonrpc: "2.0",
        id,
        error,
    })
}

fn to_line(message: &impl Serialize) -> Vec<u8> {
    // Serializing our own derive-based types into memory cannot fail: every map key is a string and
    // no type has a fallible Serialize impl. `Value` params keep that property.
    super::to_json_vec(message).unwrap_or_else(|_| Vec::from(&b"{}"[..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn decode_str(line: &str) -> Result<Message, Violation> {
        decode(line.as_bytes())
    }

    #[test]
    fn decodes_requests_with_integer_and_string_ids() {
        let Message::Request(request) =
            decode_str(r#"{"jsonrpc":"2.0","id":7,"method":"run","params":{"a":1}}"#).unwrap()
        else {
            panic!("not a request")
        };
        assert_eq!(request.id, RequestId::Int(7));
        assert_eq!(request.method, "run");
        assert_eq!(request.params, json!({"a":1}));

        let Message::Request(request) =
            decode_str(r#"{"jsonrpc":"2.0","id":"c1","method":"brain/call"}"#).unwrap()
        else {
            panic!("not a request")
        };
        assert_eq!(request.id, RequestId::Str("c1".into()));
        assert_eq!(request.params, Value::Null);
    }

    /// The SDK reader's result path takes exactly the success responses, as `decode` reads them.
    #[test]
    fn the_result_path_takes_only_success_responses() {
        for line in [
            r#"{"jsonrpc":"2.0","id":"c1","result":{"sequence":3}}"#,
            r#"{"result":[1,2.5,"x",null],"id":-4,"jsonrpc":"2.0","extra":{}}"#,
            r#"{"jsonrpc":"2.0","id":7,"result":null}"#,
        ] {
            let (id, result) = decode_result(line.as_bytes()).expect(line);
            let value: Value = serde_json::from_str(result.get()).unwrap();
            assert_eq!(
                decode_str(line),
                Ok(Message::Response(Response {
                    id,
                    outcome: Ok(value)
                })),
                "{line}"
            );
        }
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"result":{},"error":null}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{},"method":"x"}"#,
            r#"{"jsonrpc":"2.0","id":1.5,"result":{}}"#,
            r#"{"jsonrpc":"1.0","id":1,"result":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":1,"message":"m"}}"#,
            r#"{"jsonrpc":"2.0","result":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{},"result":{}}"#,
            "[1]",
        ] {
            assert!(decode_result(line.as_bytes()).is_none(), "{line}");
        }
    }

    /// The id-only path takes the start `encode_result` writes for a string id, and reading the
    /// whole line gives what the general path gives.
    #[test]
    fn an_answer_as_brain_writes_it_is_known_by_its_start_and_read_whole_once() {
        for (id, result) in [
            (
                "c1",
                json!({"sequence": 3, "result": {"text": "a \"quoted\" é\n"}}),
            ),
            ("c18446744073709551615", json!(null)),
            ("", json!([1, 2.5, "x"])),
        ] {
            let id = RequestId::Str(id.to_owned());
            let line = encode_result(&id, &result);
            assert_eq!(result_line_id(&line), Some(id.clone()));
            assert_eq!(decode_result_line::<Value>(&line), Ok(result.clone()));
            let (general_id, raw) = decode_result(&line).unwrap();
            assert_eq!(general_id, id);
            assert_eq!(serde_json::from_str::<Value>(raw.get()).unwrap(), result);
        }
        // Other starts are left to the general path.
        for line in [
            r#"{"jsonrpc":"2.0","id":7,"result":{}}"#,
            r#"{"jsonrpc":"2.0","id":"c\u0031","result":{}}"#,
            r#"{"jsonrpc":"2.0", "id":"c1","result":{}}"#,
            r#"{"id":"c1","jsonrpc":"2.0","result":{}}"#,
            r#"{"jsonrpc":"2.0","id":"c1","error":{"code":1,"message":"m"}}"#,
            r#"{"jsonrpc":"2.0","id":"c1","method":"run","params":{}}"#,
            r#"{"jsonrpc":"2.0","id":"c1"#,
        ] {
            assert_eq!(result_line_id(line.as_bytes()), None, "{line}");
        }
        // A line that starts well and is not a success response after all is refused whole, with
        // what is wrong.
        for (line, wrong) in [
            (
                r#"{"jsonrpc":"2.0","id":"c1","result":{},"error":null}"#,
                "no error",
            ),
            (
                r#"{"jsonrpc":"2.0","id":"c1","result":{},"method":"x"}"#,
                "no error or method",
            ),
            (
                r#"{"jsonrpc":"2.0","id":"c1","result":{},"id":"c2"}"#,
                "duplicate field `id`",
            ),
            (r#"{"jsonrpc":"2.0","id":"c1","result":{"#, "EOF"),
            (r#"{"jsonrpc":"2.0","id":"c1","result":1} x"#, "trailing"),
        ] {
            assert!(result_line_id(line.as_bytes()).is_some(), "{line}");
            let error = decode_result_line::<Value>(line.as_bytes()).unwrap_err();
            assert!(error.contains(wrong), "{line}: {error}");
        }
        let error = decode_result_line::<u64>(br#"{"jsonrpc":"2.0","id":"c1","result":"a"}"#);
        assert!(error.unwrap_err().contains("invalid type"));
        let mut not_utf8 = br#"{"jsonrpc":"2.0","id":"c1","result":""#.to_vec();
        not_utf8.extend_from_slice(b"\xff\"}");
        assert!(
            decode_result_line::<Value>(&not_utf8)
                .unwrap_err()
                .contains("UTF-8")
        );
    }

    /// The SDK reader's request path takes exactly the requests, as `decode` reads them.
    #[test]
    fn the_raw_request_path_takes_only_requests() {
        for line in [
            r#"{"jsonrpc":"2.0","id":7,"method":"run","params":{"a":[1,{"b":null}]}}"#,
            r#"{"params":[1, "x"],"method":"cancel","id":"r1","jsonrpc":"2.0","extra":{}}"#,
            r#"{"jsonrpc":"2.0","id":-2,"method":"shutdown"}"#,
            r#"{"jsonrpc":"2.0","id":3,"method":"run","params": {"result":1} }"#,
            // `decode` reads an object with a method as a request, whatever else it holds.
            r#"{"jsonrpc":"2.0","id":4,"method":"run","result":{},"error":null}"#,
        ] {
            let (id, method, params) = decode_raw_request(line.as_bytes()).expect(line);
            let params: Value = serde_json::from_str(params.get()).unwrap();
            assert_eq!(
                decode_str(line),
                Ok(Message::Request(Request { id, method, params })),
                "{line}"
            );
        }
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"method":"run","params":null}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"run","params":5}"#,
            r#"{"jsonrpc":"2.0","id":1.5,"method":"run"}"#,
            r#"{"jsonrpc":"2.0","id":null,"method":"run"}"#,
            r#"{"jsonrpc":"2.0","method":"run","params":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":7}"#,
            r#"{"jsonrpc":"1.0","id":1,"method":"run"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"run","method":"run"}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
            "[1]",
        ] {
            assert!(decode_raw_request(line.as_bytes()).is_none(), "{line}");
        }
    }

    #[test]
    fn decodes_responses_and_errors() {
        let Message::Response(response) =
            decode_str(r#"{"jsonrpc":"2.0","id":1,"result":{"x":true},"extra":1}"#).unwrap()
        else {
            panic!("not a response")
        };
        assert_eq!(response.outcome, Ok(json!({"x":true})));

        let Message::Response(response) = decode_str(
            r#"{"jsonrpc":"2.0","id":"a","error":{"code":-32000,"message":"no","data":{"code":"x"}}}"#,
        )
        .unwrap() else {
            panic!("not a response")
        };
        let error = response.outcome.unwrap_err();
        assert_eq!(error.code, -32000);
        assert_eq!(error.data, Some(json!({"code":"x"})));
    }

    #[test]
    fn notifications_have_no_id() {
        assert!(matches!(
            decode_str(r#"{"jsonrpc":"2.0","method":"progress","params":[1]}"#),
            Ok(Message::Notification(_))
        ));
    }

    #[test]
    fn names_each_violation() {
        assert_eq!(decode(b"\xff\xfe"), Err(Violation::InvalidUtf8));
        assert_eq!(decode_str("not json"), Err(Violation::InvalidJson));
        assert_eq!(decode_str("[1,2]"), Err(Violation::NotAnObject));
        assert_eq!(decode_str("42"), Err(Violation::NotAnObject));
        for bad in [
            r#"{"id":1,"method":"run"}"#,
            r#"{"jsonrpc":"1.0","id":1,"method":"run"}"#,
            r#"{"jsonrpc":"2.0","id":null,"method":"run"}"#,
            r#"{"jsonrpc":"2.0","id":1.5,"result":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":5}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"run","params":3}"#,
            r#"{"jsonrpc":"2.0","id":1}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{},"error":{"code":1,"message":"m"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"error":{"message":"m"}}"#,
            r#"{"jsonrpc":"2.0","result":{}}"#,
        ] {
            assert_eq!(decode_str(bad), Err(Violation::InvalidMessage), "{bad}");
        }
    }

    #[test]
    fn encodes_round_trip_with_exact_id_types() {
        let line = encode_request(&RequestId::Int(3), "cancel", &json!({"sequence": 1}));
        assert_eq!(
            decode(&line).unwrap(),
            Message::Request(Request {
                id: RequestId::Int(3),
                method: "cancel".into(),
                params: json!({"sequence": 1})
            })
        );
        let line = encode_result(&RequestId::Str("7".into()), &json!({}));
        assert_eq!(
            std::str::from_utf8(&line).unwrap(),
            r#"{"jsonrpc":"2.0","id":"7","result":{}}"#
        );
        let error = RpcError {
            code: SERVER_ERROR,
            message: "m".into(),
            data: Some(json!({"code":"cancelled","fatal":true})),
        };
        let line = encode_error(&RequestId::Int(9), &error);
        let Message::Response(response) = decode(&line).unwrap() else {
            panic!()
        };
        assert_eq!(response.outcome, Err(error));
    }
}
