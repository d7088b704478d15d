//! Per-worker capacity: a condvar-guarded FIFO of waiting activations and a feeder thread.
//!
//! Each worker slot has one [`CapacityQueue`]. The dispatcher pushes admitted activations, removes
//! cancelled ones, opens the queue while the slot is healthy and closes it while it respawns, and
//! releases a unit of capacity when a run ends. The slot's feeder thread
//! (`brain-w:<reg>/<slot>-feed`) waits on the condvar until the queue is open, a unit of capacity
//! is free and an activation waits, takes the head and hands it to the dispatcher. No thread exists
//! per activation; a waiting activation is an entry in a deque.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;

#[derive(Debug)]
struct State<T> {
    waiting: VecDeque<T>,
    running: usize,
    limit: usize,
    bound: usize,
    /// Whether the slot can take work (healthy).
    open: bool,
    /// Set at teardown: the feeder returns.
    stopped: bool,
}

/// A FIFO of activations waiting for capacity on one worker slot.
///
/// Guarantees: entries leave in the order they were pushed; at most `limit` taken entries are
/// outstanding (taken and not yet released); an entry removed with [`CapacityQueue::remove`] is
/// never taken. The lock is held only for deque operations, never across a blocking call.
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
        drop(state);
        self.changed.notify_all();
        Ok(())
    }

    /// Puts an entry back at the head (it was taken while the slot went down), ignoring the bound.
    pub(crate) fn push_front(&self, item: T) {
        self.state.lock().waiting.push_front(item);
        self.changed.notify_all();
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

    /// Gives back one unit of capacity taken by [`CapacityQueue::take`].
    pub(crate) fn release(&self) {
        let mut state = self.state.lock();
        state.running = state.running.saturating_sub(1);
        drop(state);
        self.changed.notify_all();
    }

    /// Opens (the slot is healthy) or closes (it is not) the queue; entries keep waiting while it
    /// is closed.
    pub(crate) fn set_open(&self, open: bool) {
        self.state.lock().open = open;
        self.changed.notify_all();
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

    /// Stops the feeder: [`CapacityQueue::take`] returns `None` from now on.
    pub(crate) fn stop(&self) {
        self.state.lock().stopped = true;
        self.changed.notify_all();
    }

    /// Blocks until the queue is open, capacity is free and an entry waits; takes it and counts it
    /// as running. Returns `None` once the queue is stopped.
    pub(crate) fn take(&self) -> Option<T> {
        let mut state = self.state.lock();
        loop {
            if state.stopped {
                return None;
            }
            if state.open
                && state.running < state.limit
                && let Some(item) = state.waiting.pop_front()
            {
                state.running += 1;
                return Some(item);
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

    #[test]
    fn takes_in_order_up_to_the_limit_and_waits_for_release() {
        let queue = Arc::new(CapacityQueue::new(2, 100));
        for n in 0..5 {
            queue.push(n).unwrap();
        }
        queue.set_open(true);
        assert_eq!(queue.take(), Some(0));
        assert_eq!(queue.take(), Some(1));
        let (tx, rx) = crossbeam_channel::unbounded();
        let feeder = {
            let queue = queue.clone();
            std::thread::spawn(move || {
                while let Some(n) = queue.take() {
                    tx.send(n).unwrap();
                }
            })
        };
        // At the limit: nothing more is taken until a release.
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        queue.release();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(2));
        assert!(queue.remove(&4));
        queue.release();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(3));
        queue.release();
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        queue.stop();
        feeder.join().unwrap();
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
}
