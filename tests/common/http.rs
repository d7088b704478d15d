//! A minimal HTTP/1.1 client side for the tests that talk to Brain's HTTP API: one response type
//! and one reader, and a server-sent events reader, shared by tests/http.rs, tests/serve_e2e.rs
//! and tests/security.rs.

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|error| {
            panic!(
                "status {}: the body is not JSON ({error}): {}",
                self.status,
                self.text()
            )
        })
    }

    /// The error code of an error body.
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_else(|| panic!("no error code in {}", self.json()))
            .to_owned()
    }

    /// Asserts the status and, for errors, the JSON error's code (and that it has a message).
    pub fn expect(self, status: u16, code: Option<&str>) -> Reply {
        assert_eq!(self.status, status, "{}", self.text());
        if let Some(code) = code {
            let body = self.json();
            assert_eq!(body["error"]["code"], code, "{body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "{body}"
            );
        }
        self
    }
}

/// Reads one response (skipping interim 1xx ones); the stream's read timeout bounds every read.
pub fn read_reply(reader: &mut BufReader<TcpStream>) -> std::io::Result<Reply> {
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let status: u16 = line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("malformed status line {line:?}")))?;
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line
                .split_once(':')
                .ok_or_else(|| std::io::Error::other(format!("malformed header {line:?}")))?;
            headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
        }
        if status < 200 {
            continue;
        }
        let length = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok());
        let mut body = Vec::new();
        match length {
            Some(length) => {
                body.resize(length, 0);
                reader.read_exact(&mut body)?;
            }
            None if status == 204 || status == 304 => {}
            None => {
                reader.read_to_end(&mut body)?;
            }
        }
        return Ok(Reply {
            status,
            headers,
            body,
        });
    }
}

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub id: u64,
    pub event: String,
    pub data: Value,
}

/// An open SSE stream whose response head was read.
pub struct Sse(pub BufReader<TcpStream>);

impl Sse {
    /// Reads the response head from `stream` (a request for an event stream was sent on it):
    /// asserts status 200 and `Content-Type: text/event-stream`.
    pub fn open(stream: TcpStream) -> Sse {
        let mut reader = BufReader::new(stream);
        let mut status = String::new();
        reader.read_line(&mut status).expect("a status line");
        assert!(status.starts_with("HTTP/1.1 200 "), "{status}");
        let mut content_type = None;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).expect("a header");
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-type")
            {
                content_type = Some(value.trim().to_owned());
            }
        }
        assert_eq!(content_type.as_deref(), Some("text/event-stream"));
        Sse(reader)
    }

    /// The next event (comments skipped); the read timeout bounds the wait.
    pub fn next(&mut self) -> SseEvent {
        let (mut id, mut event, mut data) = (None, String::new(), String::new());
        loop {
            let mut line = String::new();
            let read = self.0.read_line(&mut line).expect("an SSE line in time");
            assert!(read > 0, "the stream ended");
            let line = line.trim_end_matches('\n').trim_end_matches('\r');
            if line.is_empty() {
                if let Some(id) = id {
                    return SseEvent {
                        id,
                        event,
                        data: serde_json::from_str(&data).expect("JSON data"),
                    };
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = line.split_once(':').expect("a field");
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "id" => id = Some(value.parse().expect("a numeric id")),
                "event" => event = value.to_owned(),
                "data" => data.push_str(value),
                other => panic!("unexpected SSE field {other}"),
            }
        }
    }

    /// Events up to and including the first that `done` accepts.
    pub fn until(&mut self, done: impl Fn(&SseEvent) -> bool) -> Vec<SseEvent> {
        let mut seen = Vec::new();
        loop {
            let event = self.next();
            let stop = done(&event);
            seen.push(event);
            if stop {
                return seen;
            }
        }
    }
}

/// A connection with read and write timeouts of `WAIT`.
pub fn connect(address: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect_timeout(&address, super::WAIT).expect("connect");
    stream
        .set_read_timeout(Some(super::WAIT))
        .expect("read timeout");
    stream
        .set_write_timeout(Some(super::WAIT))
        .expect("write timeout");
    stream
}

/// Sends raw bytes on a fresh connection and reads one response.
pub fn exchange(address: SocketAddr, raw: &[u8]) -> Reply {
    let stream = connect(address);
    (&stream).write_all(raw).expect("send the request");
    read_reply(&mut BufReader::new(stream)).expect("a response")
}

/// The bytes of a request with `token` as its bearer token and `Connection: close`; a body is
/// sent as JSON. `headers` come after those.
pub fn authorised(
    token: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> Vec<u8> {
    let auth = format!("Bearer {token}");
    let mut all = vec![("authorization", auth.as_str()), ("connection", "close")];
    let body = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
    if !body.is_empty() {
        all.push(("content-type", "application/json"));
    }
    all.extend_from_slice(headers);
    encode(method, path, &all, &body)
}

/// Encodes a request; `headers` come after Host and before Content-Length.
pub fn encode(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nhost: test\r\n");
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}
