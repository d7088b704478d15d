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
///
/// Wake-ups are chained: a push wakes a consumer only when it makes the queue non-empty, and a
/// consumer that takes an item and leaves others behind wakes the next consumer before it works
/// on its own. A producer that queues a burst (the journal's thread, making a batch of effects
/// durable) thus pays for one wake-up instead of one per item, and the others are paid by the
/// consumers, in parallel; every item still gets a consumer of its own as soon as one is free.
pub struct WorkQueue<T> {
    state: Mutex<QueueState<T>>,
    ready: Condvar,
}

struct QueueState<T> {
    items: VecDeque<T>,
    closed: bool,
    /// Consumers blocked in [`WorkQueue::pop`] (the tests wait for them).
    waiting: usize,
}

impl<T> Default for WorkQueue<T> {
    fn default() -> WorkQueue<T> {
        WorkQueue::new()
    }
}

impl<T> WorkQueue<T> {
    /// An empty, open queue.
    pub fn new() -> WorkQueue<T> {
        WorkQueue {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                closed: false,
                waiting: 0,
            }),
            ready: Condvar::new(),
        }
    }

    /// Queues `item`, waking a waiting consumer if the queue was empty (see the type's docs).
    /// Gives the item back when the queue is closed.
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut state = self.state.lock();
        if state.closed {
            return Err(item);
        }
        let was_empty = state.items.is_empty();
        state.items.push_back(item);
        drop(state);
        if was_empty {
            self.ready.notify_one();
        }
        Ok(())
    }

    /// Takes the oldest item, blocking while the queue is empty and open. `None` once the queue is
    /// closed and empty.
    pub fn pop(&self) -> Option<T> {
        let mut state = self.state.lock();
        loop {
            if let Some(item) = state.items.pop_front() {
                let more = !state.items.is_empty();
                drop(state);
                if more {
                    // The next item's consumer is woken here, not by its producer (see above).
                    self.ready.notify_one();
                }
                return Some(item);
            }
            if state.closed {
                return None;
            }
            state.waiting += 1;
            self.ready.wait(&mut state);
            state.waiting -= 1;
        }
    }

    /// How many consumers are blocked in [`WorkQueue::pop`].
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.state.lock().waiting
    }

    /// Refuses further pushes. Items already queued are still handed out.
    pub fn close(&self) {
        self.state.lock().closed = true;
        self.ready.notify_all();
    }
}

/// How many times [`Expected::wait`] yields before it parks.
const YIELDS_BEFORE_PARKING: usize = 4;

/// Creates a one-shot hand-off: the [`Promise`] delivers one value, the [`Expected`] waits for it.
pub fn oneshot<T>() -> (Promise<T>, Expected<T>) {
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
pub struct Promise<T> {
    shared: Option<Arc<Shared<T>>>,
}

impl<T> Promise<T> {
    /// Delivers `value` and wakes the waiter (if it has gone, the value is dropped).
    pub fn deliver(mut self, value: T) {
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
pub struct Expected<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Expected<T> {
    /// Blocks until the value is delivered; `None` when the promise was dropped undelivered.
    ///
    /// Before parking, the waiter gives up its CPU [`YIELDS_BEFORE_PARKING`] times, looking for
    /// the value after each: an answer usually comes from a thread that is already runnable, and
    /// picking it up that way spares the futex sleep and wake-up. Parking at once halved the
    /// throughput of `kv.get` callbacks at 64 in flight on the host of 2026-12-03 (68,000/s
    /// against 133,000/s with the yields); on that of 2026-12-05 it made no difference either
    /// way (docs/BENCHMARKS.md).
    pub fn wait(self) -> Option<T> {
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

    /// A burst wakes one consumer; the chain must still give every item a consumer of its own.
    /// Each item here is held until all four are held at once, which only four consumers
    /// working in parallel can do.
    #[test]
    fn a_burst_pushed_to_sleeping_consumers_is_worked_on_in_parallel() {
        const CONSUMERS: usize = 4;
        let queue = Arc::new(WorkQueue::new());
        let held = Arc::new((Mutex::new(0usize), Condvar::new()));
        let consumers: Vec<_> = (0..CONSUMERS)
            .map(|_| {
                let (queue, held) = (queue.clone(), held.clone());
                std::thread::spawn(move || {
                    let Some(_item) = queue.pop() else {
                        return false;
                    };
                    let (count, all_held) = &*held;
                    let mut count = count.lock();
                    *count += 1;
                    all_held.notify_all();
                    let deadline = std::time::Instant::now() + Duration::from_secs(10);
                    while *count < CONSUMERS {
                        if all_held.wait_until(&mut count, deadline).timed_out() {
                            return false;
                        }
                    }
                    true
                })
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while queue.waiting() < CONSUMERS {
            assert!(
                std::time::Instant::now() < deadline,
                "the consumers never blocked"
            );
            std::thread::yield_now();
        }
        for n in 0..CONSUMERS as u32 {
            queue.push(n).unwrap();
        }
        for consumer in consumers {
            assert!(
                consumer.join().unwrap(),
                "an item waited for a busy consumer"
            );
        }
    }
}
