//! Reading one HTTP/1.1 request from a connection: the head with its limits, then a
//! `Content-Length` body read through `take`, all within one deadline.

use super::server::Conn;
use std::io::{ErrorKind, Read};
use std::time::{Duration, Instant};

/// The largest request head (request line and headers), in bytes.
pub(crate) const MAX_HEAD_BYTES: usize = 16 * 1024;

/// The most header fields in one request.
pub(crate) const MAX_HEADERS: usize = 100;

/// How much is read from the socket at a time.
const READ_CHUNK: usize = 8 * 1024;

/// A parsed request head.
#[derive(Debug)]
pub(crate) struct Head {
    /// The method, as sent (methods are case-sensitive).
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query, without the `?`, if there was one.
    pub query: Option<String>,
    /// Whether the request line said HTTP/1.0.
    pub http10: bool,
    /// The header fields, names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    /// The body's length from `Content-Length` (0 when absent).
    pub content_length: u64,
}

impl Head {
    /// The first value of a header (name in lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every comma-separated token of every field with this name, trimmed.
    pub fn tokens<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n == name)
            .flat_map(|(_, v)| v.split(','))
            .map(str::trim)
            .filter(|t| !t.is_empty())
    }

    /// Whether the client wants the connection kept open after the response.
    pub fn keep_alive(&self) -> bool {
        let has = |token: &str| {
            self.tokens("connection")
                .any(|t| t.eq_ignore_ascii_case(token))
        };
        if self.http10 {
            has("keep-alive")
        } else {
            !has("close")
        }
    }

    /// Whether the client sent `Expect: 100-continue`.
    pub fn expects_continue(&self) -> bool {
        self.tokens("expect")
            .any(|t| t.eq_ignore_ascii_case("100-continue"))
    }
}

/// Why no request could be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The peer closed the connection (or it failed) before sending a byte of a request.
    Closed,
    /// The deadline passed; `started` tells whether part of a request had arrived.
    Timeout {
        /// Whether some bytes of the request had arrived.
        started: bool,
    },
    /// The connection failed mid-request.
    Io(std::io::Error),
    /// The request is malformed or over a limit: answer with this status and message, then close.
    Refused(u16, String),
}

fn refused(status: u16, message: impl Into<String>) -> ReadError {
    ReadError::Refused(status, message.into())
}

/// Reads more bytes into `conn.buf`, waiting at most until `deadline`. Returns how many arrived
/// (0 at end of stream).
fn fill(conn: &mut Conn, deadline: Instant) -> Result<usize, ReadError> {
    let started = !conn.buf.is_empty();
    let remaining = deadline.saturating_duration_since(Instant::now());
    if remaining.is_zero() {
        return Err(ReadError::Timeout { started });
    }
    // A zero timeout means "block forever" to the OS: keep at least a millisecond.
    let timeout = remaining.max(Duration::from_millis(1));
    conn.stream
        .set_read_timeout(Some(timeout))
        .map_err(ReadError::Io)?;
    let mut chunk = [0u8; READ_CHUNK];
    loop {
        match conn.stream.read(&mut chunk) {
            Ok(n) => {
                conn.buf.extend_from_slice(&chunk[..n]);
                return Ok(n);
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(ReadError::Timeout { started });
            }
            Err(error) if !started => {
                log::debug!("connection from {} failed: {error}", conn.peer);
                return Err(ReadError::Closed);
            }
            Err(error) => return Err(ReadError::Io(error)),
        }
    }
}

/// Reads and parses a request head. Bytes after it stay in `conn.buf`.
pub(crate) fn read_head(conn: &mut Conn, deadline: Instant) -> Result<Head, ReadError> {
    let mut searched: usize = 0;
    loop {
        // Empty lines before a request line are ignored (RFC 9112 §2.2).
        let blank = conn
            .buf
            .iter()
            .take_while(|&&b| b == b'\r' || b == b'\n')
            .count();
        if blank > 0 {
            conn.buf.drain(..blank);
            searched = 0;
        }
        let from = searched.saturating_sub(3);
        if let Some(at) = find(&conn.buf[from..], b"\r\n\r\n") {
            let end = from + at + 4;
            if end > MAX_HEAD_BYTES {
                return Err(head_too_large());
            }
            let head = parse_head(&conn.buf[..end - 4])?;
            conn.buf.drain(..end);
            return Ok(head);
        }
        searched = conn.buf.len();
        if conn.buf.len() > MAX_HEAD_BYTES {
            return Err(head_too_large());
        }
        if fill(conn, deadline)? == 0 {
            return Err(if conn.buf.is_empty() {
                ReadError::Closed
            } else {
                ReadError::Io(ErrorKind::UnexpectedEof.into())
            });
        }
    }
}

fn head_too_large() -> ReadError {
    refused(
        431,
        format!("the request head is larger than {MAX_HEAD_BYTES} bytes"),
    )
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

pub(crate) fn parse_head(bytes: &[u8]) -> Result<Head, ReadError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| refused(400, "the request head is not valid UTF-8"))?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(refused(400, "malformed request line"));
    };
    if method.is_empty() || !method.bytes().all(is_token_byte) {
        return Err(refused(400, "malformed method"));
    }
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ if version.starts_with("HTTP/") => {
            return Err(refused(505, "only HTTP/1.1 and HTTP/1.0 are served"));
        }
        _ => return Err(refused(400, "malformed request line")),
    };
    if !target.starts_with('/') || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(refused(
            400,
            "the request target must be a path starting with /",
        ));
    }
    let (path, query) = match target.split_once('?') {
        Some((path, query)) => (path.to_owned(), Some(query.to_owned())),
        None => (target.to_owned(), None),
    };
    let mut headers = Vec::new();
    for line in lines {
        if headers.len() == MAX_HEADERS {
            return Err(refused(
                431,
                format!("more than {MAX_HEADERS} header fields"),
            ));
        }
        if line.starts_with([' ', '\t']) {
            return Err(refused(400, "folded header lines are not accepted"));
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(refused(400, "malformed header line"));
        };
        if name.is_empty() || !name.bytes().all(is_token_byte) {
            return Err(refused(400, "malformed header name"));
        }
        let value = value.trim_matches([' ', '\t']);
        if value.bytes().any(|b| b == 0 || b == b'\r' || b == b'\n') {
            return Err(refused(400, "malformed header value"));
        }
        headers.push((name.to_ascii_lowercase(), value.to_owned()));
    }
    let mut head = Head {
        method: method.to_owned(),
        path,
        query,
        http10,
        headers,
        content_length: 0,
    };
    if head.header("transfer-encoding").is_some() {
        return Err(refused(
            411,
            "Transfer-Encoding request bodies are not accepted; send Content-Length",
        ));
    }
    let mut length: Option<u64> = None;
    for value in head.tokens("content-length") {
        let parsed = value
            .parse::<u64>()
            .ok()
            .filter(|_| value.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| refused(400, "malformed Content-Length"))?;
        if length.is_some_and(|l| l != parsed) {
            return Err(refused(400, "conflicting Content-Length values"));
        }
        length = Some(parsed);
    }
    head.content_length = length.unwrap_or(0);
    Ok(head)
}

/// Reads a body of `length` bytes (already checked against the limit): what is buffered first,
/// then the socket through `take`, all before `deadline`.
pub(crate) fn read_body(
    conn: &mut Conn,
    length: u64,
    deadline: Instant,
) -> Result<Vec<u8>, ReadError> {
    let length = usize::try_from(length).map_err(|_| refused(413, "the body is too large"))?;
    let buffered = length.min(conn.buf.len());
    let mut body: Vec<u8> = conn.buf.drain(..buffered).collect();
    let mut chunk = [0u8; READ_CHUNK];
    while body.len() < length {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(ReadError::Timeout { started: true });
        }
        conn.stream
            .set_read_timeout(Some(remaining.max(Duration::from_millis(1))))
            .map_err(ReadError::Io)?;
        let want = (length - body.len()).min(READ_CHUNK) as u64;
        match (&conn.stream).take(want).read(&mut chunk) {
            Ok(0) => return Err(ReadError::Io(ErrorKind::UnexpectedEof.into())),
            Ok(n) => body.extend_from_slice(&chunk[..n]),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(ReadError::Timeout { started: true });
            }
            Err(error) => return Err(ReadError::Io(error)),
        }
    }
    Ok(body)
}

/// Splits a query into decoded `(name, value)` pairs; `None` when it is malformed.
pub(crate) fn query_pairs(query: Option<&str>) -> Option<Vec<(String, String)>> {
    let Some(query) = query else {
        return Some(Vec::new());
    };
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            Some((percent_decode(name)?, percent_decode(value)?))
        })
        .collect()
}

/// Decodes `%XX` escapes and `+` (a space in a query); `None` for a bad escape or non-UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        match bytes[index] {
            b'%' => {
                // Two hex digits exactly: `from_str_radix` alone would take a sign (`%+1`).
                let high = (*bytes.get(index + 1)? as char).to_digit(16)?;
                let low = (*bytes.get(index + 2)? as char).to_digit(16)?;
                out.push(u8::try_from(high * 16 + low).ok()?);
                index += 3;
            }
            b'+' => {
                out.push(b' ');
                index += 1;
            }
            other => {
                out.push(other);
                index += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Head, ReadError> {
        parse_head(text.as_bytes())
    }

    fn status(result: Result<Head, ReadError>) -> u16 {
        match result {
            Err(ReadError::Refused(status, _)) => status,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_request_head_is_parsed() {
        let head = parse(
            "POST /v1/sessions?after=3&x=a%20b HTTP/1.1\r\nHost: h\r\nContent-Length: 12\r\nConnection: keep-alive, Upgrade",
        )
        .unwrap();
        assert_eq!(head.method, "POST");
        assert_eq!(head.path, "/v1/sessions");
        assert_eq!(head.query.as_deref(), Some("after=3&x=a%20b"));
        assert_eq!(head.content_length, 12);
        assert_eq!(head.header("host"), Some("h"));
        assert!(head.keep_alive());
        let pairs = query_pairs(head.query.as_deref()).unwrap();
        assert_eq!(pairs[1], ("x".to_owned(), "a b".to_owned()));
    }

    #[test]
    fn malformed_heads_are_refused_with_their_status() {
        assert_eq!(status(parse("GET /\r\nHost: h")), 400);
        assert_eq!(status(parse("GET / HTTP/2.0")), 505);
        assert_eq!(status(parse("GET http://x/ HTTP/1.1")), 400);
        assert_eq!(status(parse("GET / HTTP/1.1\r\n folded")), 400);
        assert_eq!(status(parse("GET / HTTP/1.1\r\nbad name: x")), 400);
        assert_eq!(
            status(parse("POST / HTTP/1.1\r\nTransfer-Encoding: chunked")),
            411
        );
        assert_eq!(status(parse("POST / HTTP/1.1\r\nContent-Length: -1")), 400);
        assert_eq!(status(parse("POST / HTTP/1.1\r\nContent-Length: +1")), 400);
        assert_eq!(
            status(parse(
                "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2"
            )),
            400
        );
        let many = format!("GET / HTTP/1.1{}", "\r\nx: y".repeat(MAX_HEADERS + 1));
        assert_eq!(status(parse(&many)), 431);
    }

    #[test]
    fn http10_keeps_alive_only_when_asked() {
        assert!(!parse("GET / HTTP/1.0").unwrap().keep_alive());
        assert!(
            parse("GET / HTTP/1.0\r\nConnection: Keep-Alive")
                .unwrap()
                .keep_alive()
        );
        assert!(
            !parse("GET / HTTP/1.1\r\nConnection: close")
                .unwrap()
                .keep_alive()
        );
    }

    #[test]
    fn bad_query_escapes_are_refused() {
        assert!(query_pairs(Some("a=%zz")).is_none());
        assert!(query_pairs(Some("a=%4")).is_none());
        // Two hex digits exactly, not a signed number.
        for bad in ["a=%+1", "a=%-1", "a=% 1", "%FF=1"] {
            assert_eq!(query_pairs(Some(bad)), None, "{bad}");
        }
        assert_eq!(query_pairs(Some("a")).unwrap(), [("a".into(), "".into())]);
    }
}
