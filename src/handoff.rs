//! Blocking hand-offs that do not spin while they wait.
//!
//! crossbeam's blocking `recv` first spins and then calls `sched_yield` several times before it
//! parks. With Brain's many mostly idle threads on a machine with few CPUs, those yields are paid
//! on every wait that does not succeed at once: a profile of the turns benchmark on two CPUs
//! showed ≈10 % of all samples in `sched_yield`, most from idle callback executors waiting for
//! jobs (docs/BENCHMARKS.md). The waits here are a mutex and a condition variable.
//!
//! The one exception is deliberate: a one-shot answer is usually moments away, so its waiter
//! yields a few times before it parks (see [`Expected::wait`]). An idle queue consumer, whose
//! wait may be long, parks at once.
//!
//! Use them where a thread blocks on exactly one source. The dispatcher's `select` over several
//! channels stays on crossbeam.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;

/// A multi-producer, multi-consumer FIFO of work items with a blocking [`pop`](Self::pop).
///
/// Unbounded: producers never block. [`close`](Self::close) makes later pushes fail and wakes every
/// waiting consumer once the queue is drained.
pub(crate) struct WorkQueue<T> {
    state: Mutex<QueueState<T>>,
    ready: Condvar,
}

struct QueueState<T> {
    items: VecDeque<T>,
    closed: bool,
}

impl<T> WorkQueue<T> {
    /// An empty, open queue.
    pub(crate) fn new() -> WorkQueue<T> {
        WorkQueue {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Queues `item` and wakes one waiting consumer. Gives the item back when the queue is closed.
    pub(crate) fn push(&self, item: T) -> Result<(), T> {
        let mut state = self.state.lock();
        if state.closed {
            return Err(item);
        }
        state.items.push_back(item);
        drop(state);
        self.ready.notify_one();
        Ok(())
    }

    /// Takes the oldest item, blocking while the queue is empty and open. `None` once the queue is
    /// closed and empty.
    pub(crate) fn pop(&self) -> Option<T> {
        let mut state = self.state.lock();
        loop {
            if let Some(item) = state.items.pop_front() {
                return Some(item);
            }
            if state.closed {
                return None;
            }
            self.ready.wait(&mut state);
        }
    }

    /// Refuses further pushes. Items already queued are still handed out.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
        self.ready.notify_all();
    }
}

/// How many times [`Expected::wait`] yields before it parks.
const YIELDS_BEFORE_PARKING: usize = 4;

/// Creates a one-shot hand-off: the [`Promise`] delivers one value, the [`Expected`] waits for it.
pub(crate) fn oneshot<T>() -> (Promise<T>, Expected<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(Slot::Waiting),
        filled: Condvar::new(),
    });
    (
        Promise {
            shared: Some(shared.clone()),
        },
        Expected { shared },
    )
}

struct Shared<T> {
    state: Mutex<Slot<T>>,
    filled: Condvar,
}

enum Slot<T> {
    Waiting,
    Delivered(T),
    /// The promise was dropped without delivering.
    Broken,
    Taken,
}

/// The sending half of [`oneshot`]. Dropping it undelivered wakes the waiter with `None`.
pub(crate) struct Promise<T> {
    shared: Option<Arc<Shared<T>>>,
}

impl<T> Promise<T> {
    /// Delivers `value` and wakes the waiter (if it has gone, the value is dropped).
    pub(crate) fn deliver(mut self, value: T) {
        if let Some(shared) = self.shared.take() {
            *shared.state.lock() = Slot::Delivered(value);
            shared.filled.notify_one();
        }
    }
}

impl<T> std::fmt::Debug for Promise<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Promise")
    }
}

impl<T> Drop for Promise<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            *shared.state.lock() = Slot::Broken;
            shared.filled.notify_one();
        }
    }
}

/// The receiving half of [`oneshot`].
pub(crate) struct Expected<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Expected<T> {
    /// Blocks until the value is delivered; `None` when the promise was dropped undelivered.
    ///
    /// Before parking, the waiter gives up its CPU [`YIELDS_BEFORE_PARKING`] times, looking for
    /// the value after each: an answer usually comes from a thread that is already runnable, and
    /// picking it up that way spares the futex sleep and wake-up. Parking at once halved the
    /// throughput of `kv.get` callbacks at 64 in flight (68,000/s against 133,000/s with the
    /// yields; docs/BENCHMARKS.md).
    pub(crate) fn wait(self) -> Option<T> {
        for _ in 0..YIELDS_BEFORE_PARKING {
            if !matches!(*self.shared.state.lock(), Slot::Waiting) {
                break;
            }
            std::thread::yield_now();
        }
        let mut state = self.shared.state.lock();
        loop {
            match std::mem::replace(&mut *state, Slot::Taken) {
                Slot::Delivered(value) => return Some(value),
                Slot::Broken | Slot::Taken => return None,
                Slot::Waiting => {
                    *state = Slot::Waiting;
                    self.shared.filled.wait(&mut state);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_delivered_value_reaches_a_waiter_on_another_thread() {
        let (promise, expected) = oneshot();
        let waiter = std::thread::spawn(move || expected.wait());
        promise.deliver(7u32);
        assert_eq!(waiter.join().unwrap(), Some(7));
    }

    #[test]
    fn a_dropped_promise_wakes_the_waiter_with_none() {
        let (promise, expected) = oneshot::<u32>();
        let waiter = std::thread::spawn(move || expected.wait());
        drop(promise);
        assert_eq!(waiter.join().unwrap(), None);
    }

    #[test]
    fn the_queue_hands_out_in_order_then_ends_after_close() {
        let queue = Arc::new(WorkQueue::new());
        for n in 0..100u32 {
            queue.push(n).unwrap();
        }
        queue.close();
        assert_eq!(queue.push(100), Err(100));
        let taken: Vec<u32> = std::iter::from_fn(|| queue.pop()).collect();
        assert_eq!(taken, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn each_item_goes_to_exactly_one_of_several_consumers() {
        let queue = Arc::new(WorkQueue::new());
        let consumers: Vec<_> = (0..4)
            .map(|_| {
                let queue = queue.clone();
                std::thread::spawn(move || std::iter::from_fn(|| queue.pop()).collect::<Vec<u32>>())
            })
            .collect();
        for n in 0..10_000u32 {
            queue.push(n).unwrap();
        }
        queue.close();
        let mut all: Vec<u32> = consumers
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..10_000).collect::<Vec<_>>());
    }

    #[test]
    fn close_wakes_a_consumer_blocked_on_an_empty_queue() {
        let queue = Arc::new(WorkQueue::<u32>::new());
        let (started_tx, started) = crossbeam_channel::bounded(1);
        let consumer = {
            let queue = queue.clone();
            std::thread::spawn(move || {
                started_tx.send(()).unwrap();
                queue.pop()
            })
        };
        started.recv_timeout(Duration::from_secs(10)).unwrap();
        queue.close();
        assert_eq!(consumer.join().unwrap(), None);
    }
}
