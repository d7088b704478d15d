//! Responses: the JSON error body, the status of each error code, and writing to the socket.

use crate::api::ApiError;
use crate::protocol::harness::ErrorCode;
use serde::Serialize;
use serde_json::json;
use std::io::Write;
use std::net::TcpStream;

/// The HTTP status for an error code (PRODUCT.md's table): 404 `unknown_session`,
/// `unknown_agentloop`; 409 `session_busy`, `session_interrupted`, `session_closed`,
/// `activation_not_active`; 413 `input_too_large`; 422 `invalid_request` (a body that parsed but
/// failed validation), `invalid_input`, `invalid_configuration`, `missing_model_metadata`,
/// `unsupported_input`, `idempotency_key_reused`; 429 `overloaded`; 503 `agentloop_unavailable`, `shutting_down`,
/// `journal_failed`; 500 anything else. (Malformed JSON, paths and queries are answered 400
/// `invalid_request` before the library is called.)
pub fn status_for(code: ErrorCode) -> u16 {
    match code {
        ErrorCode::UnknownSession | ErrorCode::UnknownAgentloop => 404,
        ErrorCode::SessionBusy
        | ErrorCode::SessionInterrupted
        | ErrorCode::SessionClosed
        | ErrorCode::ActivationNotActive => 409,
        ErrorCode::InputTooLarge => 413,
        ErrorCode::InvalidRequest
        | ErrorCode::InvalidInput
        | ErrorCode::InvalidConfiguration
        | ErrorCode::MissingModelMetadata
        | ErrorCode::UnsupportedInput
        | ErrorCode::IdempotencyKeyReused => 422,
        ErrorCode::Overloaded => 429,
        ErrorCode::AgentloopUnavailable | ErrorCode::ShuttingDown | ErrorCode::JournalFailed => 503,
        _ => 500,
    }
}

/// The reason phrase of a status this server sends.
fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        421 => "Misdirected Request",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// A complete response, written in one go.
#[derive(Debug)]
pub(crate) struct Response {
    pub status: u16,
    pub content_type: Option<&'static str>,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    /// Close the connection after this response.
    pub close: bool,
}

pub(crate) const JSON: &str = "application/json";

impl Response {
    /// A response without a body (e.g. 204).
    pub fn empty(status: u16) -> Response {
        Response {
            status,
            content_type: None,
            headers: Vec::new(),
            body: Vec::new(),
            close: false,
        }
    }

    /// A JSON response.
    pub fn json(status: u16, value: &impl Serialize) -> Response {
        match serde_json::to_vec(value) {
            Ok(body) => Response {
                body,
                content_type: Some(JSON),
                ..Response::empty(status)
            },
            Err(error) => Response::error(
                500,
                "internal_error",
                format!("serializing the response failed: {error}"),
            ),
        }
    }

    /// A text response.
    pub fn text(status: u16, content_type: &'static str, body: String) -> Response {
        Response {
            body: body.into_bytes(),
            content_type: Some(content_type),
            ..Response::empty(status)
        }
    }

    /// `{"error":{"code","message"}}` with this status.
    pub fn error(status: u16, code: &str, message: impl Into<String>) -> Response {
        let message: String = message.into();
        Response::json(
            status,
            &json!({"error": {"code": code, "message": message}}),
        )
    }

    /// `400 invalid_request`: a malformed body, path or query.
    pub fn bad_request(message: impl Into<String>) -> Response {
        Response::error(400, ErrorCode::InvalidRequest.as_str(), message)
    }

    /// `422 invalid_request`: a body that parsed but has a bad field.
    pub fn invalid_field(message: impl Into<String>) -> Response {
        Response::error(422, ErrorCode::InvalidRequest.as_str(), message)
    }

    /// `503 overloaded`: a bound of this server is reached.
    pub fn overloaded(message: impl Into<String>) -> Response {
        Response::error(503, ErrorCode::Overloaded.as_str(), message).header("retry-after", "1")
    }

    /// The library's refusal, with the status of its code.
    pub fn api(error: &ApiError) -> Response {
        Response::error(status_for(error.code), error.code.as_str(), &error.message)
    }

    /// Adds a header.
    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Response {
        self.headers.push((name, value.into()));
        self
    }

    /// Marks the connection to be closed after this response.
    pub fn closing(mut self) -> Response {
        self.close = true;
        self
    }

    /// The bytes on the wire; `keep_alive` decides the `Connection` header.
    pub fn encode(&self, keep_alive: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(160 + self.body.len());
        // Writing to a Vec cannot fail.
        let _ = write!(out, "HTTP/1.1 {} {}\r\n", self.status, reason(self.status));
        if let Some(content_type) = self.content_type {
            let _ = write!(out, "content-type: {content_type}\r\n");
        }
        // 1xx and 204 responses carry no Content-Length (RFC 9110 §8.6).
        if self.status >= 200 && self.status != 204 {
            let _ = write!(out, "content-length: {}\r\n", self.body.len());
        }
        for (name, value) in &self.headers {
            let _ = write!(out, "{name}: {value}\r\n");
        }
        if !keep_alive {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&self.body);
        out
    }

    /// Writes the response (the stream's write timeout bounds each write).
    pub fn write_to(&self, stream: &TcpStream, keep_alive: bool) -> std::io::Result<()> {
        let mut writer = stream;
        writer.write_all(&self.encode(keep_alive))?;
        writer.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_code_of_the_product_table_has_its_status() {
        let table = [
            (404, ["unknown_session", "unknown_agentloop"].as_slice()),
            (
                409,
                &[
                    "session_busy",
                    "session_interrupted",
                    "session_closed",
                    "activation_not_active",
                ],
            ),
            (413, &["input_too_large"]),
            (
                422,
                &[
                    "invalid_request",
                    "invalid_configuration",
                    "missing_model_metadata",
                    "unsupported_input",
                ],
            ),
            (429, &["overloaded"]),
            (
                503,
                &["agentloop_unavailable", "shutting_down", "journal_failed"],
            ),
        ];
        for (status, codes) in table {
            for code in codes {
                let code = ErrorCode::ALL
                    .into_iter()
                    .find(|c| c.as_str() == *code)
                    .unwrap();
                assert_eq!(status_for(code), status, "{code:?}");
            }
        }
    }

    #[test]
    fn a_response_is_encoded_with_its_length_and_connection() {
        let response = Response::json(201, &json!({"a": 1})).header("location", "/x");
        let text = String::from_utf8(response.encode(false)).unwrap();
        assert!(text.starts_with("HTTP/1.1 201 Created\r\n"), "{text}");
        assert!(text.contains("content-length: 7\r\n"), "{text}");
        assert!(text.contains("location: /x\r\n"), "{text}");
        assert!(text.contains("connection: close\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\n{\"a\":1}"), "{text}");
        let empty = String::from_utf8(Response::empty(204).encode(true)).unwrap();
        assert_eq!(empty, "HTTP/1.1 204 No Content\r\n\r\n");
    }
}
