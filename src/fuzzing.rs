//! Fuzz entry points: one function per decoder of untrusted bytes, shared by the cargo-fuzz
//! targets in `fuzz/` (coverage-guided, `scripts/fuzz`) and by `tests/fuzz_corpus.rs` (the corpus
//! replayed plus a deterministic mutation loop, in `scripts/test`). Not a stable API.
//!
//! Each function feeds `data` to the real decoder and panics when a property fails: never on
//! input the decoder refuses. The properties beyond "does not panic" are listed on each function
//! and in `docs/RELIABILITY.md` ("Fuzzing"). Nothing here changes what production code does.

use crate::config::Registrations;
use crate::http::request::{self, MAX_HEAD_BYTES, MAX_HEADERS, ReadError};
use crate::http::server::{Conn, Limit};
use crate::journal::crc::Crc32c;
use crate::journal::frame::{self, FRAME_OVERHEAD, MAX_BODY_LEN};
use crate::journal::{DiskJournal, Journal, JournalError, NewRecord};
use crate::protocol::framing::{Frame, LineReader, PREFIX_BYTES};
use crate::protocol::harness::{
    BrainCall, CallErrorData, CallbackInput, CallbackMethod, CallbackResult, ErrorCode, RecordKind,
    method,
};
use crate::protocol::jsonrpc::{self, Message, Request};
use crate::session::{CreateSession, SessionId};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The names of the targets, as the corpus directories and the cargo-fuzz binaries are named.
pub const TARGETS: [&str; 8] = [
    "framing",
    "jsonrpc",
    "callback_input",
    "registrations",
    "create_session",
    "journal_frame",
    "journal_segment",
    "http_request",
];

/// Runs the target called `name` (one of [`TARGETS`]) on `data`; `false` for an unknown name.
pub fn run(name: &str, data: &[u8]) -> bool {
    let target: fn(&[u8]) = match name {
        "framing" => framing,
        "jsonrpc" => jsonrpc,
        "callback_input" => callback_input,
        "registrations" => registrations,
        "create_session" => create_session,
        "journal_frame" => journal_frame,
        "journal_segment" => journal_segment,
        "http_request" => http_request,
        _ => return false,
    };
    target(data);
    true
}

/// The line limits [`framing`] chooses from: tiny, around [`PREFIX_BYTES`], and past one 64 KiB
/// read chunk.
const FRAMING_LIMITS: [usize; 8] = [0, 1, 7, 255, 256, 300, 4096, 70_000];

/// Line framing ([`LineReader`]). `data[0]` picks the limit (low bits) and whether the stream is
/// repeated past 64 KiB (high bit), `data[1]` seeds how the stream is cut into reads (some of
/// which fail with `Interrupted`), the rest is the stream.
///
/// Checks, against a model that splits the whole stream on LF: the same frames come out whether
/// the stream arrives in one read or in random pieces; a line within the limit comes out whole
/// without its one trailing CR; a longer one comes out once as `TooLong` with its exact length
/// and a prefix of it of at most [`PREFIX_BYTES`] (at least `min(limit + 1, PREFIX_BYTES)`); and
/// the line buffer never holds more than `max(limit, 2 * PREFIX_BYTES)` bytes.
pub fn framing(data: &[u8]) {
    let [control, seed, stream @ ..] = data else {
        return;
    };
    let limit = FRAMING_LIMITS[usize::from(control & 0x7f) % FRAMING_LIMITS.len()];
    let mut stream = stream.to_vec();
    if control & 0x80 != 0 && !stream.is_empty() {
        let unit = stream.clone();
        while stream.len() < 70_000 {
            stream.extend_from_slice(&unit);
        }
    }
    let expected: Vec<&[u8]> = {
        let mut lines: Vec<&[u8]> = stream.split(|&b| b == b'\n').collect();
        if lines.last().is_some_and(|last| last.is_empty()) {
            lines.pop();
        }
        lines
    };
    let whole = read_frames(&stream[..], limit);
    let pieces = read_frames(
        Pieces {
            data: &stream,
            rng: Rng(u64::from(*seed) + 1),
        },
        limit,
    );
    for frames in [&whole, &pieces] {
        assert_eq!(frames.len(), expected.len(), "frame count, limit {limit}");
        for (frame, line) in frames.iter().zip(&expected) {
            match frame {
                Ok(got) => {
                    assert!(line.len() <= limit, "a line over the limit came out whole");
                    assert_eq!(got, line.strip_suffix(b"\r").unwrap_or(line));
                }
                Err((prefix, length)) => {
                    assert!(line.len() > limit, "a line within the limit was refused");
                    assert_eq!(*length, line.len() as u64);
                    assert!(prefix.len() <= PREFIX_BYTES);
                    assert!(prefix.len() >= (limit + 1).min(PREFIX_BYTES));
                    assert!(line.starts_with(prefix), "the prefix is not the line's");
                }
            }
        }
    }
}

/// A line, or the prefix and length of an over-long one.
type Owned = Result<Vec<u8>, (Vec<u8>, u64)>;

fn read_frames(input: impl Read, limit: usize) -> Vec<Owned> {
    let mut reader = LineReader::new(input, limit);
    let mut frames = Vec::new();
    loop {
        let frame = match reader.next_frame() {
            Ok(Some(Frame::Line(line))) => Ok(line.to_vec()),
            Ok(Some(Frame::TooLong { prefix, length })) => Err((prefix.to_vec(), length)),
            Ok(None) => break,
            Err(error) => panic!("reading from memory failed: {error}"),
        };
        frames.push(frame);
        assert!(
            reader.line_capacity() <= limit.max(2 * PREFIX_BYTES),
            "the line buffer holds {} bytes, limit {limit}",
            reader.line_capacity()
        );
    }
    frames
}

/// A reader that hands out `data` in random pieces, sometimes failing with `Interrupted`.
struct Pieces<'a> {
    data: &'a [u8],
    rng: Rng,
}

impl Read for Pieces<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let roll = self.rng.next_u64();
        if roll.is_multiple_of(7) {
            return Err(io::ErrorKind::Interrupted.into());
        }
        let max = if roll.is_multiple_of(3) { 4096 } else { 17 };
        let n = (1 + (roll >> 8) as usize % max)
            .min(buf.len())
            .min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

/// xorshift64*: a small deterministic generator (also the short form's mutator's). The seed must
/// not be zero, or every number is zero.
pub struct Rng(pub u64);

impl Rng {
    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// JSON-RPC decoding ([`jsonrpc::decode`]) of one line.
///
/// Checks that a decoded message re-encodes (with Brain's encoders; a notification as the object
/// it was) to one line without a newline that decodes to the same message. A request whose
/// params were absent re-encodes with `{}`: `encode_request` always writes params, and `null`
/// params are refused. And that the worker reader's typed `brain/call` path
/// ([`BrainCall::decode_request`]) takes only lines the general path decodes as `brain/call`
/// requests, with the same id, activation and input result; and that the SDK reader's result path
/// ([`jsonrpc::decode_result`]) takes only success responses, with the same id and result.
pub fn jsonrpc(data: &[u8]) {
    let typed = BrainCall::decode_request(data);
    let result = jsonrpc::decode_result(data);
    let Ok(message) = jsonrpc::decode(data) else {
        assert!(
            typed.is_none(),
            "the typed path took a line the general one refuses"
        );
        assert!(
            result.is_none(),
            "the result path took a line the general one refuses"
        );
        return;
    };
    if let Some((id, result)) = result {
        let Message::Response(response) = &message else {
            panic!("the result path took a line that is not a response: {message:?}");
        };
        let value: Value = serde_json::from_str(result.get()).expect("the result is JSON");
        assert_eq!((&response.id, &response.outcome), (&id, &Ok(value)));
    }
    if let Some((id, call)) = typed {
        let Message::Request(request) = &message else {
            panic!("the typed path took a line that is not a request: {message:?}");
        };
        assert_eq!(request.id, id);
        assert_eq!(request.method, method::BRAIN_CALL);
        assert_eq!(BrainCall::from_params(request.params.clone()), Ok(call));
    }
    let (line, expected) = match &message {
        Message::Request(request) => {
            let params = match &request.params {
                Value::Null => Value::Object(Map::new()),
                params => params.clone(),
            };
            let line = jsonrpc::encode_request(&request.id, &request.method, &params);
            let expected = Message::Request(Request {
                params,
                ..request.clone()
            });
            (line, expected)
        }
        Message::Notification(notification) => {
            let mut object = json!({"jsonrpc": "2.0", "method": notification.method});
            if !notification.params.is_null() {
                object["params"] = notification.params.clone();
            }
            (to_vec(&object), message.clone())
        }
        Message::Response(response) => {
            let line = match &response.outcome {
                Ok(result) => jsonrpc::encode_result(&response.id, result),
                Err(error) => jsonrpc::encode_error(&response.id, error),
            };
            (line, message.clone())
        }
    };
    assert!(!line.contains(&b'\n'), "an encoded line holds a newline");
    assert_eq!(jsonrpc::decode(&line), Ok(expected), "re-decoding {line:?}");
}

fn to_vec(value: &impl serde::Serialize) -> Vec<u8> {
    serde_json::to_vec(value).expect("serializing to memory cannot fail")
}

/// The `brain/call` input decoder ([`CallbackInput::decode`]) and the SDK's result decoder
/// ([`CallbackResult::decode`]). The method name is the first line of `data`, the input (and
/// result) the JSON after it.
///
/// Checks: an error is `unknown_method` (-32601) exactly when the method is not one of
/// [`CallbackMethod::ALL`], `invalid_input` (-32602) otherwise, and has a non-empty message; a
/// decoded input belongs to the method and serializes to an input that decodes to the same
/// value; a decoded result likewise.
pub fn callback_input(data: &[u8]) {
    let Some(newline) = data.iter().position(|&b| b == b'\n') else {
        return;
    };
    let Ok(method) = std::str::from_utf8(&data[..newline]) else {
        return;
    };
    let Ok(input) = serde_json::from_slice::<Value>(&data[newline + 1..]) else {
        return;
    };
    let known = method.parse::<CallbackMethod>().ok();
    let raw: Box<RawValue> =
        serde_json::from_slice(&data[newline + 1..]).expect("it parsed as a Value");
    assert_eq!(
        CallbackInput::decode_json(method, &raw),
        CallbackInput::decode(method, input.clone()),
        "typing {method} from text and from a Value disagree"
    );
    match CallbackInput::decode(method, input.clone()) {
        Err(error) => {
            let code = match known {
                None => ErrorCode::UnknownMethod,
                Some(_) => ErrorCode::InvalidInput,
            };
            assert_eq!(error.code, code.rpc_code());
            let data = CallErrorData::from_rpc_error(&error).expect("the error has its data");
            assert_eq!(data.error_code(), Some(code));
            assert!(!error.message.is_empty());
        }
        Ok(decoded) => {
            let known = known.expect("a known method decoded");
            assert_eq!(decoded.method(), known);
            let again = serde_json::to_value(&decoded).expect("an input serializes");
            assert_eq!(
                CallbackInput::decode(method, again).as_ref(),
                Ok(&decoded),
                "{method} input round trip"
            );
        }
    }
    if let Some(known) = known
        && let Ok(result) = CallbackResult::decode(known, input)
    {
        let again = serde_json::to_value(&result).expect("a result serializes");
        let decoded = CallbackResult::decode(known, again).expect("a re-encoded result decodes");
        assert_eq!(decoded, result, "{method} result round trip");
    }
}

/// The origin [`registrations`] passes; every error message starts with it.
const ORIGIN: &str = "--agentloops";

/// Registration parsing ([`Registrations::parse`]) of `data` as text (lossy UTF-8).
///
/// Checks: an error message starts with the origin, says something after it and stays under
/// 4 KiB whatever the input; an error naming a registration names a key of the top-level object;
/// a parsed set passes [`Registrations::from_vec`]'s validation again, with names unique and in
/// order.
pub fn registrations(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match Registrations::parse(&text, ORIGIN) {
        Err(error) => {
            let message = error.to_string();
            assert_eq!(error.origin(), Some(ORIGIN));
            let rest = message
                .strip_prefix(&format!("{ORIGIN}: "))
                .expect("the message starts with its origin");
            assert!(!rest.trim().is_empty(), "an empty error message");
            assert!(message.len() <= 4096, "a {}-byte message", message.len());
            if let Some(name) = error.registration()
                && let Ok(top) = serde_json::from_str::<Map<String, Value>>(&text)
            {
                assert!(top.contains_key(name), "the error names {name:?}");
            }
        }
        Ok(parsed) => {
            let names: Vec<&str> = parsed.iter().map(|reg| reg.name.as_str()).collect();
            assert!(!names.is_empty());
            assert!(names.windows(2).all(|pair| pair[0] < pair[1]), "{names:?}");
            let again = Registrations::from_vec(parsed.iter().cloned().collect())
                .expect("a parsed registration is valid");
            assert_eq!(again.len(), parsed.len());
            for name in names {
                assert_eq!(again.get(name), parsed.get(name));
            }
        }
    }
}

/// Create-session request parsing ([`CreateSession::parse`]).
///
/// Checks: an error is `invalid_request` with a non-empty message of at most about 1 KiB
/// (1024 characters and an ellipsis); a parsed request validates, and serializes to a body that
/// parses to the same request.
pub fn create_session(data: &[u8]) {
    match CreateSession::parse(data) {
        Err(error) => {
            assert_eq!(error.code, ErrorCode::InvalidRequest);
            assert!(!error.message.trim().is_empty(), "an empty error message");
            assert!(error.message.chars().count() <= 1025);
        }
        Ok(request) => {
            assert_eq!(request.validate(), Ok(()));
            let body = to_vec(&request);
            assert_eq!(CreateSession::parse(&body), Ok(request), "round trip");
        }
    }
}

/// Journal frame and record-body decoding ([`frame::decode`], [`frame::decode_body`]).
///
/// `data` is tried three ways: as a whole frame; as a frame whose length and checksums are set
/// right first (so the fuzzer gets past them to the address and body); and as a record body.
/// Checks: a frame that decodes re-encodes to the same bytes and decodes to the same address and
/// body; a frame with correct checksums decodes exactly when its type and session id are valid and
/// its reserved bytes are zero; a body that decodes re-encodes to a body that decodes to the same
/// record.
pub fn journal_frame(data: &[u8]) {
    frame_round_trip(data);
    if data.len() >= FRAME_OVERHEAD && data.len() - FRAME_OVERHEAD <= MAX_BODY_LEN as usize {
        let mut fixed = data.to_vec();
        fix_frame(&mut fixed);
        let valid_address = matches!(fixed[12], 1 | 2)
            && fixed[13..16] == [0, 0, 0]
            && std::str::from_utf8(&fixed[32..56]).is_ok_and(|id| SessionId::parse(id).is_ok());
        assert_eq!(
            frame_round_trip(&fixed),
            valid_address,
            "checksums set right"
        );
        body_round_trip(&fixed[FRAME_OVERHEAD..]);
    }
    body_round_trip(data);
}

/// Decodes `bytes` as a frame and checks the round trip; whether it decoded.
fn frame_round_trip(bytes: &[u8]) -> bool {
    let Ok((address, body)) = frame::decode(bytes) else {
        return false;
    };
    let encoded = frame::encode(&address, body);
    assert_eq!(encoded, bytes, "a frame re-encodes to its bytes");
    assert_eq!(frame::decode(&encoded), Ok((address, body)));
    true
}

fn body_round_trip(body: &[u8]) {
    let Ok(record) = frame::decode_body(body) else {
        return;
    };
    let encoded = frame::encode_body(&record).expect("a decoded record encodes");
    assert_eq!(frame::decode_body(&encoded), Ok(record));
}

/// Sets a frame's declared length to what it holds and its two checksums to the right values.
fn fix_frame(frame: &mut [u8]) {
    let body_len = u32::try_from(frame.len() - FRAME_OVERHEAD).unwrap_or(u32::MAX);
    frame[..4].copy_from_slice(&body_len.to_le_bytes());
    let prefix = Crc32c::new()
        .update(&frame[..4])
        .update(&frame[12..FRAME_OVERHEAD]);
    let address_crc = prefix.finish();
    let frame_crc = prefix.update(&frame[FRAME_OVERHEAD..]).finish();
    frame[4..8].copy_from_slice(&frame_crc.to_le_bytes());
    frame[8..12].copy_from_slice(&address_crc.to_le_bytes());
}

/// Sets the checksums of every frame of a segment whose declared length fits in it, from offset
/// 16 (after the header) on, so that the fuzzer reaches recovery's sequence and tombstone rules.
fn fix_segment(segment: &mut [u8]) {
    let mut at = 16usize;
    while at + FRAME_OVERHEAD <= segment.len() {
        let mut len = [0u8; 4];
        len.copy_from_slice(&segment[at..at + 4]);
        let body_len = u32::from_le_bytes(len) as usize;
        let Some(end) = (at + FRAME_OVERHEAD)
            .checked_add(body_len)
            .filter(|&end| end <= segment.len())
        else {
            return;
        };
        fix_frame(&mut segment[at..end]);
        at = end;
    }
}

/// Journal recovery of one segment of arbitrary bytes, through [`DiskJournal`]. `data[0]` holds
/// flags: bit 0 sets every frame's checksums right first ([`fix_segment`]), bit 1 adds an empty
/// second segment so that the first is not the last (where no torn tail is allowed). The rest is
/// written as segment 1 of a fresh directory (under `/dev/shm` when it exists, so fsync is cheap).
///
/// Checks: opening never panics and fails only with [`JournalError::Failed`]; a read-only open
/// and a repairing open (which truncates a torn tail) see the same sessions and the same records,
/// and each session reads either completely or fails [`JournalError::Corrupt`]; after the
/// repairing open, a new session can be created and made durable, and a second open still sees
/// every record the first saw plus the new one.
pub fn journal_segment(data: &[u8]) {
    let [flags, segment @ ..] = data else {
        return;
    };
    let mut segment = segment.to_vec();
    if flags & 1 != 0 {
        fix_segment(&mut segment);
    }
    let dir = TempDir::new();
    std::fs::write(dir.0.join("segment-0000000000000001.log"), &segment)
        .expect("writing the segment");
    if flags & 2 != 0 {
        std::fs::write(
            dir.0.join("segment-0000000000000002.log"),
            frame::segment_header(),
        )
        .expect("writing the second segment");
    }

    let read_only = match DiskJournal::open_read_only(&dir.0) {
        Ok(journal) => contents(&journal),
        Err(error) => {
            assert!(matches!(error, JournalError::Failed(_)), "{error:?}");
            return;
        }
    };
    let journal = match DiskJournal::open(&dir.0) {
        Ok(journal) => journal,
        Err(error) => panic!("the read-only open succeeded, the repairing one failed: {error}"),
    };
    let repaired = contents(&journal);
    assert_eq!(
        read_only, repaired,
        "read-only and repairing recovery differ"
    );

    let session = SessionId::parse("ses_fuzzfuzzfuzzfuzzfuzz").expect("a valid id");
    let record = NewRecord {
        kind: RecordKind::SessionCreated,
        data: json!({"fuzz": true}),
        origin: None,
    };
    let created = journal.create(&session, record);
    if repaired.contains_key(session.as_str()) {
        assert!(created.is_err(), "created a session that exists");
        return;
    }
    assert!(matches!(created, Ok(1)), "{created:?}");
    journal.sync().expect("syncing");
    drop(journal);
    let reopened = DiskJournal::open(&dir.0).expect("reopening after an append");
    let mut after = contents(&reopened);
    let new = after.remove(session.as_str()).expect("the new session");
    assert!(matches!(&new, Ok(records) if records.len() == 1), "{new:?}");
    assert_eq!(after, repaired, "recovery lost or changed records");
}

/// Each session's records, or `Err` with the text of why it is unreadable.
type Contents = BTreeMap<String, Result<Vec<Value>, String>>;

fn contents(journal: &DiskJournal) -> Contents {
    let sessions = journal.sessions().expect("listing sessions");
    sessions
        .iter()
        .map(|session| {
            let records = match journal.read(session, 0, usize::MAX) {
                Ok(events) => {
                    for (index, event) in events.iter().enumerate() {
                        assert_eq!(event.sequence, index as u64 + 1, "a gap in {session}");
                    }
                    Ok(events.iter().map(to_value).collect())
                }
                Err(JournalError::Corrupt { why, .. }) => Err(why),
                Err(error) => panic!("reading {session}: {error}"),
            };
            (session.as_str().to_owned(), records)
        })
        .collect()
}

fn to_value(value: &impl serde::Serialize) -> Value {
    serde_json::to_value(value).expect("serializing to memory cannot fail")
}

/// A fresh directory, removed on drop, or kept and named on stderr when the thread panics.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let path = base.join(format!(
            "brain-fuzz-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        // A directory left by a crashed run of an earlier process with the same pid.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir(&path).expect("creating a temporary directory");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept the failed test's directory {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The most bytes [`http_request`] sends (more than a head may hold).
const HTTP_MAX_INPUT: usize = 64 * 1024;

/// HTTP request reading ([`request::read_head`], [`request::read_body`]) over a real loopback
/// connection: the client writes `data` (at most 64 KiB) and shuts its side down; the server side
/// reads one request as the server does.
///
/// Checks, against a model that skips leading blank lines and looks for the first CRLF CRLF:
/// the outcome is the parse of exactly that head (`parse_head`), or 431 when it is over
/// [`MAX_HEAD_BYTES`], or the end of the stream when there is none; refusals use 400, 411, 431 or
/// 505; a parsed head has a token method, a path starting with `/` without controls or spaces,
/// at most [`MAX_HEADERS`] fields with lower-case token names and values without CR, LF or NUL;
/// the body read is exactly the `Content-Length` bytes that follow the head, or end of stream
/// when fewer were sent.
pub fn http_request(data: &[u8]) {
    let data = &data[..data.len().min(HTTP_MAX_INPUT)];
    let mut conn = loopback(data);
    let deadline = Instant::now() + Duration::from_secs(30);
    let result = request::read_head(&mut conn, deadline);

    let blank = data
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count();
    let stream = &data[blank..];
    let end = stream.windows(4).position(|w| w == b"\r\n\r\n");
    let head = match (end, result) {
        (Some(at), Ok(head)) if at + 4 <= MAX_HEAD_BYTES => {
            let model = request::parse_head(&stream[..at]);
            assert!(model.is_ok(), "read_head accepted what parse_head refuses");
            check_head(&head);
            (head, &stream[at + 4..])
        }
        (Some(at), Err(ReadError::Refused(status, message))) if at + 4 <= MAX_HEAD_BYTES => {
            assert!(matches!(status, 400 | 411 | 431 | 505), "status {status}");
            assert!(!message.is_empty());
            match request::parse_head(&stream[..at]) {
                Err(ReadError::Refused(model, _)) => assert_eq!(status, model),
                other => panic!("read_head refused ({status}), parse_head gave {other:?}"),
            }
            return;
        }
        (Some(_), Err(ReadError::Refused(431, _))) => return,
        (None, Err(ReadError::Refused(431, _))) if stream.len() > MAX_HEAD_BYTES => return,
        (None, Err(ReadError::Closed)) if stream.is_empty() => return,
        (None, Err(ReadError::Io(error)))
            if !stream.is_empty()
                && stream.len() <= MAX_HEAD_BYTES
                && error.kind() == io::ErrorKind::UnexpectedEof =>
        {
            return;
        }
        (end, other) => panic!("head at {end:?} of {} bytes: {other:?}", stream.len()),
    };
    let (head, rest) = head;
    if head.content_length > HTTP_MAX_INPUT as u64 {
        return;
    }
    let length = head.content_length as usize;
    match request::read_body(&mut conn, head.content_length, deadline) {
        Ok(body) => {
            assert!(
                rest.len() >= length,
                "a body read past the end of the stream"
            );
            assert_eq!(body, &rest[..length]);
        }
        Err(ReadError::Io(error)) if error.kind() == io::ErrorKind::UnexpectedEof => {
            assert!(rest.len() < length, "a complete body was not read");
        }
        Err(other) => panic!("reading a body of {length} bytes: {other:?}"),
    }
}

fn check_head(head: &request::Head) {
    let token = |text: &str| {
        !text.is_empty()
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    };
    assert!(token(&head.method), "method {:?}", head.method);
    assert!(head.path.starts_with('/'), "path {:?}", head.path);
    let controls = |text: &str| text.bytes().any(|b| b <= b' ' || b == 0x7f);
    assert!(!controls(&head.path) && !head.path.contains('?'));
    assert!(!head.query.as_deref().is_some_and(controls));
    assert!(head.headers.len() <= MAX_HEADERS);
    for (name, value) in &head.headers {
        assert!(
            token(name) && *name == name.to_ascii_lowercase(),
            "{name:?}"
        );
        assert!(!value.bytes().any(|b| matches!(b, 0 | b'\r' | b'\n')));
        assert_eq!(value.trim_matches([' ', '\t']), value);
    }
    assert!(head.header("transfer-encoding").is_none());
    let _ = head.keep_alive();
    let _ = head.expects_continue();
    let _ = request::query_pairs(head.query.as_deref());
}

/// A server-side connection over loopback holding `data`, followed by the end of the stream.
fn loopback(data: &[u8]) -> Conn {
    static LISTENER: OnceLock<TcpListener> = OnceLock::new();
    let listener = LISTENER
        .get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("binding a loopback listener"));
    let address = listener.local_addr().expect("the listener's address");
    let mut client = TcpStream::connect(address).expect("connecting over loopback");
    // 64 KiB fits in the socket buffers before anyone reads.
    client.write_all(data).expect("writing the request");
    client.shutdown(Shutdown::Write).expect("shutting down");
    let (stream, peer) = listener.accept().expect("accepting");
    let limit = Limit::new(1);
    let permit = limit.try_acquire().expect("a permit of a fresh limit");
    Conn::new(stream, peer, permit)
}
