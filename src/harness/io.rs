//! The two I/O threads of a connection: one reads Brain's lines, one writes the harness's.
//!
//! Neither thread answers anything or waits for the other: the reader only decodes and dispatches
//! (requests to a channel, responses to their callers), the writer only drains its channel. So a
//! peer that stops reading can block the writer, never the reader.

use super::pending::Pending;
use crate::protocol::framing::{Frame, LineReader};
use crate::protocol::jsonrpc::{self, Message, Request, RpcError};
use crossbeam_channel::{Receiver, Sender};
use std::io::{self, Read, Write};
use std::sync::Arc;
use std::thread::JoinHandle;

/// How many bytes of a bad line are logged.
const LOG_PREFIX: usize = 128;

/// A message for the writer thread.
pub(crate) enum Outgoing {
    /// One line, without its newline.
    Line(Vec<u8>),
    /// Acknowledge once everything queued before has been written and flushed.
    Flush(Sender<()>),
    /// Stop after everything queued before.
    Close,
}

/// The reader and writer threads of a [`Connection`](super::Connection).
///
/// Dropping it detaches the threads; [`join`](IoThreads::join) waits for them.
#[must_use = "join the I/O threads, or drop them to detach"]
pub struct IoThreads {
    reader: JoinHandle<io::Result<()>>,
    writer: JoinHandle<()>,
}

impl IoThreads {
    /// Waits for both threads and returns the reader's outcome: `Ok` at a clean end of input,
    /// the read error otherwise. A write failure is not an error here (a broken pipe means Brain
    /// went away; the writer logs other failures).
    ///
    /// Blocks until the input reaches its end **and** the writer has stopped: call
    /// [`Connection::close`](super::Connection::close) first, or drop every clone of the
    /// connection, or this waits for as long as a clone lives. A panic in either thread is
    /// re-raised here.
    pub fn join(self) -> io::Result<()> {
        let read = match self.reader.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        if let Err(panic) = self.writer.join() {
            std::panic::resume_unwind(panic);
        }
        read
    }
}

/// Starts both threads. `requests` receives Brain's requests; responses go to `pending`.
pub(crate) fn start<R, W>(
    reader: R,
    writer: W,
    max_line_bytes: usize,
    requests: Sender<Request>,
    outgoing: Receiver<Outgoing>,
    pending: Arc<Pending>,
) -> io::Result<IoThreads>
where
    R: Read + Send + 'static,
    W: Write + Send + 'static,
{
    let writer_pending = pending.clone();
    let writer = std::thread::Builder::new()
        .name("harness-write".into())
        .spawn(move || write_loop(writer, outgoing, &writer_pending))?;
    let reader = std::thread::Builder::new()
        .name("harness-read".into())
        .spawn(move || read_loop(reader, max_line_bytes, requests, &pending))?;
    Ok(IoThreads { reader, writer })
}

fn read_loop<R: Read>(
    reader: R,
    max_line_bytes: usize,
    requests: Sender<Request>,
    pending: &Pending,
) -> io::Result<()> {
    let mut lines = LineReader::new(reader, max_line_bytes);
    let result = loop {
        match lines.next_frame() {
            Ok(None) => break Ok(()),
            Ok(Some(Frame::TooLong { prefix, length })) => log::warn!(
                "ignoring a line of {length} bytes from Brain (limit {max_line_bytes}): {}",
                preview(prefix)
            ),
            Ok(Some(Frame::Line(line))) => dispatch(line, &requests, pending),
            Err(error) => break Err(error),
        }
    };
    let reason = match &result {
        Ok(()) => "Brain closed the harness's stdin".to_owned(),
        Err(error) => format!("reading from Brain failed: {error}"),
    };
    log::debug!("harness reader stops: {reason}");
    pending.close(&reason);
    result
}

fn dispatch(line: &[u8], requests: &Sender<Request>, pending: &Pending) {
    // The common case, an answer to a brain/call, stays JSON text for its caller to type.
    if let Some((id, result)) = jsonrpc::decode_result(line) {
        if !pending.complete(&id, Ok(result)) {
            log::warn!("ignoring a response to id {id} that has no pending call");
        }
        return;
    }
    match jsonrpc::decode(line) {
        Ok(Message::Request(request)) => {
            if requests.send(request).is_err() {
                log::debug!("a request from Brain arrived after the connection was dropped");
            }
        }
        Ok(Message::Response(response)) => {
            let outcome = response.outcome.and_then(|result| {
                serde_json::value::to_raw_value(&result).map_err(|error| RpcError {
                    code: -32603,
                    message: format!("re-encoding the result failed: {error}"),
                    data: None,
                })
            });
            if !pending.complete(&response.id, outcome) {
                log::warn!(
                    "ignoring a response to id {} that has no pending call",
                    response.id
                );
            }
        }
        Ok(Message::Notification(notification)) => {
            log::debug!(
                "ignoring a notification from Brain: {}",
                notification.method
            );
        }
        Err(violation) => log::warn!(
            "ignoring a line from Brain ({violation}): {}",
            preview(line)
        ),
    }
}

fn write_loop<W: Write>(mut writer: W, outgoing: Receiver<Outgoing>, pending: &Pending) {
    for message in outgoing.iter() {
        match message {
            Outgoing::Line(mut line) => {
                line.push(b'\n');
                // One write_all per message: a writer that serialises whole calls (as `Stdout`
                // does) never interleaves another writer's bytes inside a line.
                if let Err(error) = writer.write_all(&line).and_then(|()| writer.flush()) {
                    if error.kind() == io::ErrorKind::BrokenPipe {
                        log::debug!("Brain closed the harness's stdout");
                    } else {
                        log::warn!("writing to Brain failed: {error}");
                    }
                    break;
                }
            }
            Outgoing::Flush(ack) => {
                // Every line is flushed as it is written, so reaching this message is enough.
                let _ = ack.send(());
            }
            Outgoing::Close => break,
        }
    }
    // Messages still queued are dropped with the receiver, so their senders see `Closed`.
    pending.close("the connection's writer stopped");
}

/// A short, printable prefix of a line for the log.
fn preview(bytes: &[u8]) -> String {
    let cut = bytes.len().min(LOG_PREFIX);
    let mut text = String::from_utf8_lossy(&bytes[..cut]).into_owned();
    if bytes.len() > cut {
        text.push('…');
    }
    text
}
