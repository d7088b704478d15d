//! SSE followers: `GET …/events` with `Accept: text/event-stream` catches up from the journal and
//! then follows it live, on a thread of its own (`brain-http-sse`), holding one of
//! [`HttpOptions::max_sse`](super::HttpOptions::max_sse) permits.
//!
//! Each record is sent as `id: <sequence>`, `event: <type>`, `data: <the record as JSON>`; a
//! client resumes with `Last-Event-ID`. The follower only reads the journal, waking on its condvar
//! when a record lands: a slow reader can never hold up a turn. It is dropped when one write
//! blocks longer than the write timeout. A comment line is sent after each quiet
//! [`HttpOptions::sse_heartbeat`](super::HttpOptions::sse_heartbeat).

use super::server::{CHECK_INTERVAL, Conn, Permit, Shared, spawn_or_run};
use crate::api::Session;
use crate::protocol::harness::Event;
use serde_json::json;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

/// Records read from the journal per page while catching up.
const PAGE: usize = 64;

/// Encoded bytes gathered before they are written (one record may exceed it).
const WRITE_BATCH: usize = 64 * 1024;

/// A session's journal to stream from a sequence on.
pub(crate) struct Follow {
    pub session: Session,
    pub after: u64,
    pub permit: Permit,
}

struct Job {
    shared: Arc<Shared>,
    conn: Conn,
    follow: Follow,
}

/// Hands the connection to an SSE thread.
pub(crate) fn start(shared: Arc<Shared>, conn: Conn, follow: Follow) {
    spawn_or_run(
        "brain-http-sse",
        Job {
            shared,
            conn,
            follow,
        },
        run,
    );
}

/// One record as an SSE event. The type is the emitter's choice: line breaks in it are replaced
/// so that it cannot end the field (the data, JSON, has none).
fn encode(event: &Event, out: &mut Vec<u8>) {
    let event_type: String = event
        .event_type
        .chars()
        .map(|c| if c == '\r' || c == '\n' { ' ' } else { c })
        .collect();
    let data = serde_json::to_string(event).unwrap_or_else(|error| {
        json!({"sequence": event.sequence, "error": error.to_string()}).to_string()
    });
    // Writing to a Vec cannot fail.
    let _ = write!(
        out,
        "id: {}\nevent: {event_type}\ndata: {data}\n\n",
        event.sequence
    );
}

fn run(job: Job) {
    let Job {
        shared,
        conn,
        follow: Follow {
            session,
            mut after,
            permit,
        },
    } = job;
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-store\r\n\
                x-accel-buffering: no\r\nconnection: close\r\n\r\n";
    shared.counters.responded(200);
    let mut writer = &conn.stream;
    if writer.write_all(head.as_bytes()).is_err() {
        return;
    }
    let heartbeat = shared.options.sse_heartbeat;
    let mut last_write = Instant::now();
    let mut out = Vec::new();
    loop {
        if shared.stopping() {
            break;
        }
        // Read the version before the page, so that a record landing in between wakes the wait.
        let seen = session.journal.version();
        let page = match session.events(after, PAGE) {
            Ok(page) => page,
            Err(error) => {
                // Deleted, or the journal failed: say so, and end the stream.
                out.clear();
                let data =
                    json!({"error": {"code": error.code.as_str(), "message": error.message}});
                let _ = write!(out, "event: error\ndata: {data}\n\n");
                let _ = writer.write_all(&out);
                break;
            }
        };
        if !page.is_empty() {
            if let Err(error) = send_page(&conn, &page, &mut out) {
                log::debug!(
                    "session {}: dropping the SSE reader at {}: {error}",
                    session.id(),
                    conn.peer
                );
                break;
            }
            after = page.last().map_or(after, |event| event.sequence);
            last_write = Instant::now();
            if page.len() == PAGE {
                continue;
            }
        }
        let beat_at = last_write + heartbeat;
        let wake_at = beat_at.min(Instant::now() + CHECK_INTERVAL);
        if session.journal.wait_change(seen, wake_at) {
            continue;
        }
        if Instant::now() >= beat_at {
            if writer.write_all(b": heartbeat\n\n").is_err() {
                break;
            }
            last_write = Instant::now();
        }
        if conn.peer_closed() {
            break;
        }
    }
    // The permit goes first: a client that sees its stream end may open another at once.
    drop(permit);
    let _ = conn.stream.shutdown(std::net::Shutdown::Both);
}

/// Writes a page of records, in batches of about [`WRITE_BATCH`] bytes. A write that blocks past
/// the write timeout fails: the reader is too slow and is dropped.
fn send_page(conn: &Conn, page: &[Event], out: &mut Vec<u8>) -> std::io::Result<()> {
    let mut writer = &conn.stream;
    out.clear();
    for event in page {
        encode(event, out);
        if out.len() >= WRITE_BATCH {
            writer.write_all(out)?;
            out.clear();
        }
    }
    if !out.is_empty() {
        writer.write_all(out)?;
    }
    out.clear();
    Ok(())
}
