//! Per-worker capacity, and the worker's outgoing lines: one condvar-guarded state per slot.
//!
//! Each worker slot has one [`CapacityQueue`]. The dispatcher pushes admitted activations, removes
//! cancelled ones, opens the queue while the slot is healthy and closes it while it respawns, and
//! releases a unit of capacity when a run ends; after each of these it takes what may start now
//! ([`CapacityQueue::take`]) itself, so that starting an activation costs no thread hand-off
//! (when the process's writer fed the dispatcher, each activation woke the writer and then the
//! dispatcher again: two of a text turn's ≈17 wake-ups, docs/BENCHMARKS.md). The dispatcher also
//! sends the lines for the slot's current process here: written at once when nothing is queued
//! and the writer is idle, queued otherwise, for the process's writer thread
//! (`brain-w:<reg>/<slot>-write`), which waits on the condvar until it has lines to write.
//! No thread exists per activation or per slot beyond the process's own; a waiting activation is
//! an entry in a deque.

use crate::worker::io::write_now;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::io;
use std::process::ChildStdin;
use std::sync::Arc;

#[derive(Debug)]
struct State<T> {
    waiting: VecDeque<T>,
    running: usize,
    limit: usize,
    bound: usize,
    /// Whether the slot can take work (healthy).
    open: bool,
    /// Set at teardown: the writer returns.
    stopped: bool,
    /// The incarnation whose writer takes lines and feeds; an older writer returns.
    writer: u64,
    /// Lines for that incarnation's stdin, oldest first.
    lines: VecDeque<Vec<u8>>,
    /// The writer took lines and has not finished writing them.
    writing: bool,
    /// That incarnation's stdin, for writing a line at once when the writer is idle; `None`
    /// before it is attached, once stdin is to close, or if the kernel cannot write without
    /// waiting.
    stdin: Option<Arc<ChildStdin>>,
    /// Brain closed that incarnation's stdin: its writer returns once `lines` are written.
    stdin_closed: bool,
}

/// A FIFO of activations waiting for capacity on one worker slot, and the lines waiting for the
/// slot's process.
///
/// Guarantees: entries leave in the order they were pushed, only while the queue is open; at most
/// `limit` taken entries are outstanding (taken and not yet released); an entry removed with
/// [`CapacityQueue::remove`] is never taken; lines are written in the order they were sent, and
/// only to the incarnation they were sent for. The lock is held only for deque operations, never
/// across a blocking call.
#[derive(Debug)]
pub(crate) struct CapacityQueue<T> {
    state: Mutex<State<T>>,
    changed: Condvar,
}

/// The queue is full: the activation is refused (`overloaded`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Full;

impl<T: PartialEq> CapacityQueue<T> {
    /// A closed queue running at most `limit` at once and holding at most `bound` waiting.
    pub(crate) fn new(limit: usize, bound: usize) -> CapacityQueue<T> {
        CapacityQueue {
            state: Mutex::new(State {
                waiting: VecDeque::new(),
                running: 0,
                limit: limit.max(1),
                bound,
                open: false,
                stopped: false,
                writer: 0,
                lines: VecDeque::new(),
                writing: false,
                stdin: None,
                stdin_closed: true,
            }),
            changed: Condvar::new(),
        }
    }

    /// Appends an entry, or refuses when `bound` entries already wait.
    pub(crate) fn push(&self, item: T) -> Result<(), Full> {
        let mut state = self.state.lock();
        if state.waiting.len() >= state.bound {
            return Err(Full);
        }
        state.waiting.push_back(item);
        Ok(())
    }

    /// Puts an entry back at the head (it was taken while the slot went down), ignoring the bound.
    pub(crate) fn push_front(&self, item: T) {
        self.state.lock().waiting.push_front(item);
    }

    /// Takes the oldest waiting entry when the queue is open and a unit of capacity is free,
    /// counting it as running until [`release`](Self::release).
    pub(crate) fn take(&self) -> Option<T> {
        let mut state = self.state.lock();
        if !state.open || state.stopped || state.running >= state.limit {
            return None;
        }
        let item = state.waiting.pop_front()?;
        state.running += 1;
        Some(item)
    }

    /// Removes a waiting entry; `false` when it is not waiting (already taken, or never pushed).
    pub(crate) fn remove(&self, item: &T) -> bool {
        let mut state = self.state.lock();
        let Some(at) = state.waiting.iter().position(|w| w == item) else {
            return false;
        };
        state.waiting.remove(at);
        true
    }

    /// Gives back one unit of capacity taken with [`take`](Self::take).
    pub(crate) fn release(&self) {
        let mut state = self.state.lock();
        state.running = state.running.saturating_sub(1);
    }

    /// Opens (the slot is healthy) or closes (it is not) the queue; entries keep waiting while it
    /// is closed.
    pub(crate) fn set_open(&self, open: bool) {
        self.state.lock().open = open;
    }

    /// Removes and returns every waiting entry, in order.
    pub(crate) fn drain(&self) -> Vec<T> {
        self.state.lock().waiting.drain(..).collect()
    }

    /// How many taken entries are outstanding (running).
    pub(crate) fn running(&self) -> usize {
        self.state.lock().running
    }

    /// How many entries wait.
    pub(crate) fn waiting(&self) -> usize {
        self.state.lock().waiting.len()
    }

    /// Stops every writer: [`CapacityQueue::next_for_writer`] returns `None` from now on.
    pub(crate) fn stop(&self) {
        let mut state = self.state.lock();
        state.stopped = true;
        state.stdin = None;
        drop(state);
        self.changed.notify_all();
    }

    /// Makes `generation` the slot's current incarnation, with an open stdin and no lines; the
    /// writer of an older one returns.
    pub(crate) fn attach_writer(&self, generation: u64) {
        let mut state = self.state.lock();
        state.writer = generation;
        state.lines.clear();
        state.writing = false;
        state.stdin = None;
        state.stdin_closed = false;
        drop(state);
        self.changed.notify_all();
    }

    /// Gives the queue incarnation `generation`'s stdin, so that [`CapacityQueue::send_line`]
    /// can write lines itself while the writer is idle. Ignored if that incarnation is no longer
    /// current or its stdin is to close.
    pub(crate) fn attach_stdin(&self, generation: u64, stdin: Arc<ChildStdin>) {
        let mut state = self.state.lock();
        if state.writer == generation && !state.stdin_closed && !state.stopped {
            state.stdin = Some(stdin);
        }
    }

    /// Sends a line to incarnation `generation`; dropped when that incarnation is gone or its
    /// stdin was closed (its exit event fails whatever the line asked).
    ///
    /// When nothing is queued and the writer is idle, the line is written here and now, as far
    /// as the pipe takes it without waiting (under the lock, so the writer cannot start in
    /// between and order holds); what the pipe does not take is queued for the writer, which
    /// is woken only then.
    pub(crate) fn send_line(&self, generation: u64, line: Vec<u8>) {
        let mut state = self.state.lock();
        if state.writer != generation || state.stdin_closed || state.stopped {
            return;
        }
        let rest = match state.stdin.as_deref() {
            Some(stdin) if state.lines.is_empty() && !state.writing => {
                match write_now(stdin, &line) {
                    Ok(written) if written > line.len() => return,
                    Ok(written) => line[written..].to_vec(),
                    Err(error) => {
                        if !matches!(error.kind(), io::ErrorKind::WouldBlock) {
                            // Unsupported, or the pipe broke: the writer thread deals with it
                            // from here on (a broken pipe ends it; the exit event follows).
                            state.stdin = None;
                        }
                        line
                    }
                }
            }
            _ => line,
        };
        state.lines.push_back(rest);
        drop(state);
        self.changed.notify_all();
    }

    /// Closes incarnation `generation`'s stdin once the lines already queued are written.
    pub(crate) fn close_stdin(&self, generation: u64) {
        let mut state = self.state.lock();
        if state.writer == generation {
            state.stdin_closed = true;
            // The writer's handle is then the last: stdin closes when it returns.
            state.stdin = None;
        }
        drop(state);
        self.changed.notify_all();
    }

    /// For the writer of incarnation `generation`: blocks until it has lines to write (returned,
    /// oldest first) or must stop (`None`: stopped, stdin closed and written out, or a newer
    /// incarnation took over).
    pub(crate) fn next_for_writer(&self, generation: u64) -> Option<Vec<Vec<u8>>> {
        let mut state = self.state.lock();
        if state.writer == generation {
            // Back here, the writer has written and flushed what it took.
            state.writing = false;
        }
        loop {
            if state.stopped || state.writer != generation {
                return None;
            }
            if !state.lines.is_empty() {
                state.writing = true;
                return Some(state.lines.drain(..).collect());
            }
            if state.stdin_closed {
                return None;
            }
            self.changed.wait(&mut state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    /// A writer thread for incarnation `generation`: written batches go to the returned channel;
    /// it ends when `next_for_writer` says so.
    fn writer(
        queue: &Arc<CapacityQueue<i32>>,
        generation: u64,
    ) -> (
        crossbeam_channel::Receiver<Vec<Vec<u8>>>,
        std::thread::JoinHandle<()>,
    ) {
        let (lines_tx, lines) = crossbeam_channel::unbounded();
        let queue = queue.clone();
        let handle = std::thread::spawn(move || {
            while let Some(batch) = queue.next_for_writer(generation) {
                lines_tx.send(batch).unwrap();
            }
        });
        (lines, handle)
    }

    #[test]
    fn takes_in_order_up_to_the_limit_and_waits_for_release() {
        let queue = CapacityQueue::new(2, 100);
        for n in 0..5 {
            queue.push(n).unwrap();
        }
        // Closed: nothing is taken.
        assert_eq!(queue.take(), None);
        queue.set_open(true);
        assert_eq!(queue.take(), Some(0));
        assert_eq!(queue.take(), Some(1));
        // At the limit: nothing more is taken until a release.
        assert_eq!(queue.take(), None);
        assert_eq!(queue.running(), 2);
        queue.release();
        assert_eq!(queue.take(), Some(2));
        assert!(queue.remove(&4));
        queue.release();
        assert_eq!(queue.take(), Some(3));
        queue.release();
        // Nothing waits any more; closed again, a new entry waits even with capacity free.
        assert_eq!(queue.take(), None);
        queue.set_open(false);
        queue.push(5).unwrap();
        assert_eq!(queue.take(), None);
        queue.set_open(true);
        queue.stop();
        assert_eq!(queue.take(), None, "a stopped queue hands out nothing");
    }

    #[test]
    fn lines_reach_only_their_incarnation_and_closing_stdin_ends_the_writer() {
        let queue = Arc::new(CapacityQueue::<i32>::new(1, 10));
        queue.attach_writer(1);
        let (lines, old) = writer(&queue, 1);
        queue.send_line(1, b"a".to_vec());
        queue.send_line(1, b"b".to_vec());
        let mut written = Vec::new();
        while written.len() < 2 {
            written.extend(lines.recv_timeout(Duration::from_secs(5)).unwrap());
        }
        assert_eq!(written, vec![b"a".to_vec(), b"b".to_vec()]);
        // A new incarnation: the old writer returns, and lines for it are dropped.
        queue.attach_writer(2);
        old.join().unwrap();
        queue.send_line(1, b"stale".to_vec());
        let (lines, new) = writer(&queue, 2);
        queue.send_line(2, b"c".to_vec());
        queue.close_stdin(2);
        queue.send_line(2, b"after close".to_vec());
        new.join().unwrap();
        let rest: Vec<Vec<u8>> = lines.try_iter().flatten().collect();
        assert_eq!(rest, vec![b"c".to_vec()]);
    }

    #[test]
    fn a_closed_queue_holds_entries_and_the_bound_refuses() {
        let queue = CapacityQueue::new(1, 2);
        queue.push("a").unwrap();
        queue.push("b").unwrap();
        assert_eq!(queue.push("c"), Err(Full));
        assert_eq!(queue.waiting(), 2);
        assert!(!queue.remove(&"z"));
        assert_eq!(queue.drain(), vec!["a", "b"]);
    }

    /// A child with piped stdin (and stdout): `cat` echoes what it reads, `sleep` reads nothing.
    fn child(program: &str, args: &[&str]) -> std::process::Child {
        std::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }

    #[test]
    fn an_idle_writer_lets_lines_go_at_once_and_closing_stdin_lets_go_of_the_pipe() {
        use std::io::{BufRead, BufReader, Read};
        let mut cat = child("cat", &[]);
        let queue = CapacityQueue::<i32>::new(1, 10);
        queue.attach_writer(1);
        queue.attach_stdin(1, Arc::new(cat.stdin.take().unwrap()));
        // No writer thread runs: the lines reach `cat` only if `send_line` writes them itself.
        queue.send_line(1, b"one".to_vec());
        queue.send_line(1, b"two".to_vec());
        let mut out = BufReader::new(cat.stdout.take().unwrap());
        let mut echoed = String::new();
        out.read_line(&mut echoed).unwrap();
        out.read_line(&mut echoed).unwrap();
        assert_eq!(echoed, "one\ntwo\n");
        assert_eq!(queue.state.lock().lines.len(), 0);
        // Closing stdin drops the queue's handle, the last one: `cat` sees the end and exits.
        queue.close_stdin(1);
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "");
        assert!(cat.wait().unwrap().success());
    }

    #[test]
    fn what_a_full_pipe_does_not_take_waits_for_the_writer_in_order() {
        let mut sleeper = child("sleep", &["30"]);
        let queue = CapacityQueue::<i32>::new(1, 10);
        queue.attach_writer(1);
        queue.attach_stdin(1, Arc::new(sleeper.stdin.take().unwrap()));
        // Far more than a pipe holds (64 KiB by default, at most 1 MiB unprivileged).
        let big: Vec<u8> = (0..4 << 20).map(|i| b'a' + (i % 26) as u8).collect();
        queue.send_line(1, big.clone());
        queue.send_line(1, b"after".to_vec());
        let batch = queue.next_for_writer(1).unwrap();
        assert_eq!(batch.len(), 2);
        let rest = &batch[0];
        assert!(!rest.is_empty() && rest.len() < big.len(), "{}", rest.len());
        assert!(
            big.ends_with(rest),
            "the rest of the line, from where the pipe stopped"
        );
        assert_eq!(batch[1], b"after");
        // While the writer writes, lines queue behind it rather than cutting in.
        queue.send_line(1, b"later".to_vec());
        assert_eq!(queue.state.lock().lines.len(), 1);
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
    }
}
