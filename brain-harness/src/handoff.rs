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
/// Wake-ups are handed on, not broadcast. A push wakes a consumer only when it makes the queue
/// non-empty. A consumer that takes an item and leaves others behind wakes the next one only
/// while fewer than the queue's `runners` consumers are running (taken an item and not blocked
/// since); otherwise it works on and comes back for the next itself. A consumer about to block
/// calls [`hand_off`](Self::hand_off) first, which stops counting it as running and wakes the
/// next consumer for what is left. A burst of work that never blocks (the journal's thread
/// making a batch of instant effects durable) thus wakes as many consumers as can run at once
/// (one per CPU) instead of one per item, while a burst of blocking work still gets a consumer
/// per item, each woken by the one before it as that one blocks.
///
/// The rule consumers must keep: call `hand_off` before anything that may block (I/O, a wait on
/// another thread, a provider's call), or items queued behind the item in hand wait for it.
pub struct WorkQueue<T> {
    state: Mutex<QueueState<T>>,
    ready: Condvar,
    /// How many consumers may run at once before a consumer stops waking others for the queue.
    runners: usize,
}

struct QueueState<T> {
    items: VecDeque<T>,
    closed: bool,
    /// Consumers blocked in [`WorkQueue::pop`] (the tests wait for them).
    waiting: usize,
    /// Consumers that took an item and have neither come back nor handed off since.
    running: usize,
    /// Consumers woken that have not taken the lock again yet: on their way to an item.
    woken: usize,
}

impl<T> QueueState<T> {
    /// Whether a parked consumer should be woken: items are queued that no woken consumer is on
    /// its way to, fewer than `runners` consumers run or are on their way, and one is parked
    /// that was not woken already. If so it is counted as woken, and the caller notifies once
    /// it has let go of the lock.
    fn wake_one(&mut self, runners: usize) -> bool {
        let wake = self.items.len() > self.woken
            && self.running + self.woken < runners
            && self.waiting > self.woken;
        if wake {
            self.woken += 1;
        }
        wake
    }
}

/// One consumer's standing in its [`WorkQueue`]: whether it is counted as running. Each
/// consumer thread keeps its own and passes it to every [`WorkQueue::pop`] and
/// [`WorkQueue::hand_off`].
#[derive(Debug, Default)]
pub struct Consumer {
    running: bool,
}

impl<T> Default for WorkQueue<T> {
    fn default() -> WorkQueue<T> {
        WorkQueue::new(1)
    }
}

impl<T> WorkQueue<T> {
    /// An empty, open queue whose consumers wake each other up to `runners` running at once (at
    /// least one).
    pub fn new(runners: usize) -> WorkQueue<T> {
        WorkQueue {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                closed: false,
                waiting: 0,
                running: 0,
                woken: 0,
            }),
            ready: Condvar::new(),
            runners: runners.max(1),
        }
    }

    /// Queues `item`, waking a waiting consumer if the queue was empty (see the type's docs).
    /// Gives the item back when the queue is closed.
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut state = self.state.lock();
        if state.closed {
            return Err(item);
        }
        state.items.push_back(item);
        let wake = state.wake_one(self.runners);
        drop(state);
        if wake {
            self.ready.notify_one();
        }
        Ok(())
    }

    /// Takes the oldest item for `me`, blocking while the queue is empty and open, and wakes the
    /// next consumer if items are left and fewer than `runners` consumers run (see the type's
    /// docs). `None` once the queue is closed and empty.
    pub fn pop(&self, me: &mut Consumer) -> Option<T> {
        let mut state = self.state.lock();
        if std::mem::take(&mut me.running) {
            state.running -= 1;
        }
        loop {
            if let Some(item) = state.items.pop_front() {
                state.running += 1;
                me.running = true;
                let wake = state.wake_one(self.runners);
                drop(state);
                if wake {
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
            state.woken = state.woken.saturating_sub(1);
        }
    }

    /// Stops counting `me` as running and wakes a consumer blocked in [`WorkQueue::pop`] if
    /// items are queued: for a consumer that is about to block, so that what is queued behind
    /// its item does not wait for it (see the type's docs).
    pub fn hand_off(&self, me: &mut Consumer) {
        let mut state = self.state.lock();
        if std::mem::take(&mut me.running) {
            state.running -= 1;
        }
        if state.wake_one(self.runners) {
            drop(state);
            self.ready.notify_one();
        }
    }

    /// Whether no item is queued.
    pub fn is_empty(&self) -> bool {
        self.state.lock().items.is_empty()
    }

    /// Queues `items` under one lock, waking a consumer if the queue was empty: a burst that is
    /// all queued before the woken consumer runs (which a producer's pushes one by one only
    /// usually are).
    #[cfg(test)]
    fn push_burst(&self, items: impl IntoIterator<Item = T>) {
        let mut state = self.state.lock();
        state.items.extend(items);
        let wake = state.wake_one(self.runners);
        drop(state);
        if wake {
            self.ready.notify_one();
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
        let queue = Arc::new(WorkQueue::new(4));
        for n in 0..100u32 {
            queue.push(n).unwrap();
        }
        queue.close();
        assert_eq!(queue.push(100), Err(100));
        let mut me = Consumer::default();
        let taken: Vec<u32> = std::iter::from_fn(|| queue.pop(&mut me)).collect();
        assert_eq!(taken, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn each_item_goes_to_exactly_one_of_several_consumers() {
        let queue = Arc::new(WorkQueue::new(4));
        let consumers: Vec<_> = (0..4)
            .map(|_| {
                let queue = queue.clone();
                std::thread::spawn(move || {
                    let mut me = Consumer::default();
                    std::iter::from_fn(|| queue.pop(&mut me)).collect::<Vec<u32>>()
                })
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
        let queue = Arc::new(WorkQueue::<u32>::new(1));
        let (started_tx, started) = crossbeam_channel::bounded(1);
        let consumer = {
            let queue = queue.clone();
            std::thread::spawn(move || {
                started_tx.send(()).unwrap();
                queue.pop(&mut Consumer::default())
            })
        };
        started.recv_timeout(Duration::from_secs(10)).unwrap();
        queue.close();
        assert_eq!(consumer.join().unwrap(), None);
    }

    /// Blocks until `queue` has `consumers` consumers parked in `pop`.
    fn wait_parked<T>(queue: &WorkQueue<T>, consumers: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while queue.waiting() < consumers {
            assert!(
                std::time::Instant::now() < deadline,
                "the consumers never blocked"
            );
            std::thread::yield_now();
        }
    }

    /// A burst wakes no more consumers than may run at once (one here), and a consumer that does
    /// not block wakes nobody: it takes the whole burst itself while the others stay parked.
    #[test]
    fn a_burst_of_work_that_never_blocks_wakes_no_more_consumers_than_may_run() {
        const CONSUMERS: usize = 3;
        let queue = Arc::new(WorkQueue::new(1));
        let consumers: Vec<_> = (0..CONSUMERS)
            .map(|_| {
                let queue = queue.clone();
                std::thread::spawn(move || {
                    let (mut taken, mut me) = (Vec::new(), Consumer::default());
                    while let Some(item) = queue.pop(&mut me) {
                        // Every other consumer is still parked while this one works.
                        let others_parked = queue.waiting() == CONSUMERS - 1;
                        taken.push((item, others_parked));
                    }
                    taken
                })
            })
            .collect();
        wait_parked(&queue, CONSUMERS);
        queue.push_burst(0..5u32);
        // Once the burst is taken the consumer parks again: close only then, so that the close's
        // wake-ups are not mistaken for the burst's.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !queue.is_empty() || queue.waiting() < CONSUMERS {
            assert!(
                std::time::Instant::now() < deadline,
                "the burst was not taken"
            );
            std::thread::yield_now();
        }
        queue.close();
        let taken: Vec<Vec<(u32, bool)>> =
            consumers.into_iter().map(|c| c.join().unwrap()).collect();
        let busy: Vec<_> = taken.iter().filter(|t| !t.is_empty()).collect();
        assert_eq!(busy.len(), 1, "{taken:?}");
        assert_eq!(*busy[0], (0..5).map(|n| (n, true)).collect::<Vec<_>>());
    }

    /// Consumers that hand off before they block must give every item of a burst a consumer of
    /// its own, however few may run at once (one here). Each item is held (a block) until all
    /// four are held at once, which only four consumers working in parallel can do.
    #[test]
    fn a_burst_of_blocking_work_is_worked_on_in_parallel() {
        const CONSUMERS: usize = 4;
        let queue = Arc::new(WorkQueue::new(1));
        let held = Arc::new((Mutex::new(0usize), Condvar::new()));
        let consumers: Vec<_> = (0..CONSUMERS)
            .map(|_| {
                let (queue, held) = (queue.clone(), held.clone());
                std::thread::spawn(move || {
                    let mut me = Consumer::default();
                    let Some(_item) = queue.pop(&mut me) else {
                        return false;
                    };
                    queue.hand_off(&mut me);
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
        wait_parked(&queue, CONSUMERS);
        queue.push_burst(0..CONSUMERS as u32);
        for consumer in consumers {
            assert!(
                consumer.join().unwrap(),
                "an item waited for a busy consumer"
            );
        }
    }
}
