//! The two I/O threads of a connection: one reads Brain's lines, one writes the harness's.
//!
//! Neither thread answers anything or waits for the other: the reader only decodes and dispatches
//! (requests to a channel, responses to their callers), the writer only drains its channel. So a
//! peer that stops reading can block the writer, never the reader.
//!
//! A line given to [`Output::line`] when no earlier line waits for the writer is written by the
//! calling thread itself: a callback's request then reaches Brain without waking the writer
//! thread (one thread switch fewer per callback, as Brain's dispatcher does for a worker's
//! stdin). Lines still go out in the order they were given.

use super::pending::{Pending, ResultText};
use super::request::BrainRequest;
use brain_protocol::framing::{Frame, LineReader};
use brain_protocol::jsonrpc::{self, Message, RpcError};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use std::io::{self, Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// The harness's side of the output: the writer, the writer thread's queue, and how many lines
/// wait in it.
pub(crate) struct Output {
    queue: Sender<Outgoing>,
    /// Lines handed to the writer thread and not yet written. A caller writes its line itself
    /// only while this is zero, so it never overtakes a queued line.
    queued: AtomicUsize,
    /// Set by [`Output::close`]: no line is written directly any more.
    closing: AtomicBool,
    sink: Mutex<Sink>,
}

/// The writer, and whether it may still be written to.
struct Sink {
    writer: Box<dyn Write + Send>,
    /// The writer thread stopped, or a write failed.
    stopped: bool,
}

impl Sink {
    /// Writes `line` and a newline with one `write_all` (a writer that serialises whole calls,
    /// as `Stdout` does, never interleaves another writer's bytes inside it) and flushes. On a
    /// failure the sink stops and every pending call fails.
    fn write_line(&mut self, mut line: Vec<u8>, pending: &Pending) -> bool {
        line.push(b'\n');
        match self
            .writer
            .write_all(&line)
            .and_then(|()| self.writer.flush())
        {
            Ok(()) => true,
            Err(error) => {
                if error.kind() == io::ErrorKind::BrokenPipe {
                    log::debug!("Brain closed the harness's stdout");
                } else {
                    log::warn!("writing to Brain failed: {error}");
                }
                self.stop(pending);
                false
            }
        }
    }

    fn stop(&mut self, pending: &Pending) {
        self.stopped = true;
        pending.close("the connection's writer stopped");
    }
}

impl Output {
    /// Sends one line (without its newline): written at once on this thread when nothing waits
    /// for the writer thread and nobody is writing, else queued (blocking while the queue is
    /// full). `false` when the output has stopped or is closing.
    pub(crate) fn line(&self, line: Vec<u8>, pending: &Pending) -> bool {
        if self.queued.load(Ordering::Acquire) == 0
            && !self.closing.load(Ordering::Acquire)
            && let Some(mut sink) = self.sink.try_lock()
            // Checked again under the sink: a line queued meanwhile must go first.
            && self.queued.load(Ordering::Acquire) == 0
        {
            return !sink.stopped && sink.write_line(line, pending);
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.queue.send(Outgoing::Line(line)).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Blocks until every line given before has been written and flushed; `false` when the
    /// writer stopped first.
    pub(crate) fn flush(&self) -> bool {
        let (ack_tx, ack_rx) = crossbeam_channel::bounded(1);
        self.queue.send(Outgoing::Flush(ack_tx)).is_ok() && ack_rx.recv().is_ok()
    }

    /// Stops the writer once the lines already given are written.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
        // An error means the writer has already stopped, which is what we want.
        let _ = self.queue.send(Outgoing::Close);
    }
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

/// Starts both threads. `requests` receives Brain's requests; responses go to `pending`. The
/// writer thread's queue holds at most `queue_limit` messages.
pub(crate) fn start<R, W>(
    reader: R,
    writer: W,
    max_line_bytes: usize,
    queue_limit: usize,
    requests: Sender<BrainRequest>,
    pending: Arc<Pending>,
) -> io::Result<(Arc<Output>, IoThreads)>
where
    R: Read + Send + 'static,
    W: Write + Send + 'static,
{
    let (queue, outgoing) = crossbeam_channel::bounded(queue_limit);
    let output = Arc::new(Output {
        queue,
        queued: AtomicUsize::new(0),
        closing: AtomicBool::new(false),
        sink: Mutex::new(Sink {
            writer: Box::new(writer),
            stopped: false,
        }),
    });
    let (writer_output, writer_pending) = (output.clone(), pending.clone());
    let writer = std::thread::Builder::new()
        .name("harness-write".into())
        .spawn(move || write_loop(&writer_output, outgoing, &writer_pending))?;
    let reader = std::thread::Builder::new()
        .name("harness-read".into())
        .spawn(move || read_loop(reader, max_line_bytes, requests, &pending))?;
    Ok((output, IoThreads { reader, writer }))
}

fn read_loop<R: Read>(
    reader: R,
    max_line_bytes: usize,
    requests: Sender<BrainRequest>,
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

fn dispatch(line: &[u8], requests: &Sender<BrainRequest>, pending: &Pending) {
    // The common cases, an answer to a brain/call and a request, stay JSON text for whoever
    // types them. An answer as Brain writes one is handed over by its id alone, unread: its
    // caller reads the whole line once, where the general way scanned it here too.
    if let Some(id) = jsonrpc::result_line_id(line) {
        if !pending.complete(&id, Ok(ResultText::Line(line.to_vec()))) {
            log::warn!("ignoring a response to id {id} that has no pending call");
        }
        return;
    }
    if let Some((id, result)) = jsonrpc::decode_result(line) {
        if !pending.complete(&id, Ok(ResultText::Raw(result))) {
            log::warn!("ignoring a response to id {id} that has no pending call");
        }
        return;
    }
    let request = match jsonrpc::decode_raw_request(line) {
        Some((id, method, params)) => BrainRequest { id, method, params },
        None => match decode_rest(line, pending) {
            Some(request) => request,
            None => return,
        },
    };
    if requests.send(request).is_err() {
        log::debug!("a request from Brain arrived after the connection was dropped");
    }
}

/// A line neither typed read took: an error response is handed to its caller, anything else
/// but a request is logged and skipped. A request gets here only when the typed read refused
/// it (a member given twice, say); its params are re-encoded from the tree `decode` built.
fn decode_rest(line: &[u8], pending: &Pending) -> Option<BrainRequest> {
    match jsonrpc::decode(line) {
        Ok(Message::Request(request)) => match serde_json::value::to_raw_value(&request.params) {
            Ok(params) => {
                return Some(BrainRequest {
                    id: request.id,
                    method: request.method,
                    params,
                });
            }
            Err(error) => log::warn!("ignoring a request from Brain ({error}): {}", preview(line)),
        },
        Ok(Message::Response(response)) => {
            let outcome = response.outcome.and_then(|result| {
                serde_json::value::to_raw_value(&result)
                    .map(ResultText::Raw)
                    .map_err(|error| RpcError {
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
    None
}

fn write_loop(output: &Output, outgoing: Receiver<Outgoing>, pending: &Pending) {
    for message in outgoing.iter() {
        match message {
            Outgoing::Line(line) => {
                let mut sink = output.sink.lock();
                let written = !sink.stopped && sink.write_line(line, pending);
                // Counted down only once written, under the sink: a caller that then finds
                // nothing queued writes after this line, never before it.
                output.queued.fetch_sub(1, Ordering::AcqRel);
                if !written {
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
    output.sink.lock().stop(pending);
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
