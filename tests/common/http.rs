//! A minimal HTTP/1.1 client side for the tests that talk to Brain's HTTP API: one response type
//! and one reader, a server-sent events reader, and the API calls of [`Api`], shared by
//! tests/http.rs, tests/serve_e2e.rs and the other suites that talk HTTP.

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread::JoinHandle;

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

/// The API calls the HTTP suites share, for any server at an address with a bearer token: a
/// `brain serve` process (`server::Served`) or a library `HttpServer` (tests/http.rs). Every
/// request goes on a fresh connection with `Connection: close`.
pub trait Api {
    /// Where the server listens.
    fn addr(&self) -> SocketAddr;
    /// The operator token it was started with.
    fn token(&self) -> &str;

    fn connect(&self) -> TcpStream {
        connect(self.addr())
    }

    fn bearer(&self) -> String {
        format!("Bearer {}", self.token())
    }

    /// Sends raw bytes on a fresh connection and reads one response.
    fn exchange(&self, raw: &[u8]) -> Reply {
        exchange(self.addr(), raw)
    }

    /// An authorised request with a JSON body (if any).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Reply {
        self.call_with(method, path, &[], body)
    }

    fn call_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> Reply {
        self.exchange(&self.request(method, path, headers, body))
    }

    /// The bytes of an authorised request.
    fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> Vec<u8> {
        authorised(self.token(), method, path, headers, body)
    }

    /// Creates a session of `registration` with this configuration and checks the answer (201,
    /// open, its registration, its `Location`); its id.
    fn create(&self, registration: &str, configuration: Value) -> String {
        let reply = self
            .call(
                "POST",
                "/v1/sessions",
                Some(json!({"agentloop": {"name": registration, "configuration": configuration}})),
            )
            .expect(201, None);
        let view = reply.json();
        let id = view["session_id"]
            .as_str()
            .expect("a session id")
            .to_owned();
        assert_eq!(view["status"], "open", "{view}");
        assert_eq!(view["registration"], registration, "{view}");
        assert_eq!(
            reply.header("location"),
            Some(format!("/v1/sessions/{id}").as_str())
        );
        id
    }

    fn message(&self, id: &str, text: &str, headers: &[(&str, &str)]) -> Reply {
        self.call_with(
            "POST",
            &format!("/v1/sessions/{id}/messages"),
            headers,
            Some(json!({"content": [{"type": "text", "text": text}]})),
        )
    }

    /// Sends a message that waits for its outcome, on a thread of the test.
    fn message_in_background(&self, id: &str, text: &str) -> JoinHandle<std::io::Result<Reply>> {
        let raw = self.request(
            "POST",
            &format!("/v1/sessions/{id}/messages"),
            &[],
            Some(json!({"content": [{"type": "text", "text": text}]})),
        );
        let stream = self.connect();
        std::thread::spawn(move || {
            (&stream).write_all(&raw)?;
            read_reply(&mut BufReader::new(stream))
        })
    }

    fn view(&self, id: &str) -> Value {
        self.call("GET", &format!("/v1/sessions/{id}"), None)
            .expect(200, None)
            .json()
    }

    /// Every record of the session, through the pages of `GET …/events`.
    fn events(&self, id: &str) -> Vec<Value> {
        let mut all = Vec::new();
        let mut after = 0;
        loop {
            let page = self
                .call(
                    "GET",
                    &format!("/v1/sessions/{id}/events?after={after}&limit=50"),
                    None,
                )
                .expect(200, None)
                .json();
            let events = page["events"].as_array().expect("events").clone();
            if events.is_empty() {
                assert_eq!(page["next_after"], after);
                return all;
            }
            after = page["next_after"].as_u64().expect("next_after");
            assert_eq!(events.last().unwrap()["sequence"], after);
            all.extend(events);
        }
    }

    /// Opens an SSE stream of the session's records and checks its head.
    fn open_stream(&self, id: &str, query: &str, headers: &[(&str, &str)]) -> Sse {
        let stream = self.connect();
        let mut all = vec![("accept", "text/event-stream")];
        all.extend_from_slice(headers);
        let raw = self.request(
            "GET",
            &format!("/v1/sessions/{id}/events{query}"),
            &all,
            None,
        );
        (&stream).write_all(&raw).expect("send");
        Sse::open(stream)
    }

    /// Waits (through an SSE stream) until the session's run announces that it executes; the
    /// announcing record.
    fn wait_running(&self, id: &str) -> SseEvent {
        let mut stream = self.open_stream(id, "", &[]);
        stream
            .until(|e| e.event == "event_emitted" && e.data["data"]["type"] == "running")
            .pop()
            .expect("the running event")
    }

    /// Waits (through an SSE stream) for the outcome record of activation `sequence`.
    fn wait_finished(&self, id: &str, sequence: u64) -> SseEvent {
        let mut stream = self.open_stream(id, &format!("?after={sequence}"), &[]);
        stream
            .until(|e| e.event == "activation_finished" && e.data["data"]["activation"] == sequence)
            .pop()
            .expect("the outcome record")
    }
}
