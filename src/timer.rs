//! The deadline thread.
//!
//! Deadlines (the initialize deadline, respawn backoff, the shutdown kill, later the cancel grace)
//! are entries in one heap owned by a `brain-timer` thread. When an entry is due the thread sends
//! its event to the dispatcher on a channel of its own, which the dispatcher polls before any
//! worker output, so a deadline is handled promptly even while a harness floods its stdout.
//! Entries are never cancelled: each event carries the generation it was set for, and the
//! dispatcher ignores events whose generation has passed.

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// A handle for scheduling events; cheap to clone. The thread stops when every handle is dropped.
#[derive(Debug)]
pub struct Timer<T> {
    schedule: Sender<(Instant, T)>,
}

impl<T> Clone for Timer<T> {
    fn clone(&self) -> Self {
        Timer {
            schedule: self.schedule.clone(),
        }
    }
}

struct Entry<T> {
    when: Instant,
    order: u64,
    event: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.when, self.order) == (other.when, other.order)
    }
}
impl<T> Eq for Entry<T> {}
impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Entry<T> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.when, self.order).cmp(&(other.when, other.order))
    }
}

impl<T: Send + 'static> Timer<T> {
    /// Starts the timer thread; due events go to `due`.
    pub fn start(due: Sender<T>) -> std::io::Result<Timer<T>> {
        let (schedule, requests) = crossbeam_channel::unbounded();
        std::thread::Builder::new()
            .name("brain-timer".into())
            .spawn(move || run(requests, due))?;
        Ok(Timer { schedule })
    }

    /// Delivers `event` at `when` (at once if `when` has passed). Never blocks. Events with equal
    /// deadlines are delivered in the order they were scheduled.
    pub fn at(&self, when: Instant, event: T) {
        // Fails only when the thread has stopped, i.e. during teardown, when nobody waits any more.
        let _ = self.schedule.send((when, event));
    }
}

fn run<T>(requests: Receiver<(Instant, T)>, due: Sender<T>) {
    let mut heap: BinaryHeap<Reverse<Entry<T>>> = BinaryHeap::new();
    let mut order = 0u64;
    loop {
        let now = Instant::now();
        while heap.peek().is_some_and(|Reverse(entry)| entry.when <= now) {
            if let Some(Reverse(entry)) = heap.pop()
                && due.send(entry.event).is_err()
            {
                return;
            }
        }
        let received = match heap.peek() {
            Some(Reverse(next)) => requests.recv_timeout(next.when.saturating_duration_since(now)),
            None => requests.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match received {
            Ok((when, event)) => {
                order += 1;
                heap.push(Reverse(Entry { when, order, event }));
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn delivers_in_deadline_order() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let timer = Timer::start(tx).unwrap();
        let now = Instant::now();
        timer.at(now + Duration::from_millis(60), 3);
        timer.at(now + Duration::from_millis(20), 1);
        timer.at(now + Duration::from_millis(20), 2);
        timer.at(now, 0);
        let got: Vec<i32> = (0..4)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert_eq!(got, [0, 1, 2, 3]);
        assert!(now.elapsed() >= Duration::from_millis(60));
    }
}
