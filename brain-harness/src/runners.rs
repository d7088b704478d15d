//! The threads that run activations, kept for the next one.
//!
//! A thread per activation cost the reference harness a `clone3`, a stack mapping and unmapping,
//! and a fresh allocator cache on every turn: ≈3.5 % of all samples in the turn benchmark on two
//! CPUs (docs/BENCHMARKS.md). A thread that finishes an activation therefore waits for the next
//! one; a new thread is started only when none is waiting, so activations never queue behind
//! each other. A thread that waits [`IDLE_LIMIT`] with nothing to do ends, so a burst of
//! concurrent activations does not pin its threads for the life of the harness.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::Scope;
use std::time::Duration;

/// How long a thread with nothing to run waits for an activation before it ends.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_secs(10);

/// An activation to run: everything it borrows outlives the serve loop's scope.
pub(crate) type Job<'env> = Box<dyn FnOnce() + Send + 'env>;

/// The activation threads of one serve loop, shared by the loop and the threads. [`Runners::close`]
/// lets the waiting threads end so that the loop's scope can join them.
pub(crate) struct Runners<'env> {
    state: Mutex<State<'env>>,
    ready: Condvar,
    idle_limit: Duration,
}

struct State<'env> {
    /// Activations handed over to waiting threads but not yet taken by one.
    jobs: VecDeque<Job<'env>>,
    /// Threads waiting for a job. A job is queued only when one of them is free to take it.
    waiting: usize,
    closed: bool,
}

impl<'env> Runners<'env> {
    pub(crate) fn new() -> Runners<'env> {
        Runners::with_idle_limit(IDLE_LIMIT)
    }

    /// Threads that end after waiting `idle_limit` for a job.
    fn with_idle_limit(idle_limit: Duration) -> Runners<'env> {
        Runners {
            idle_limit,
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                waiting: 0,
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Runs `job` at once on a waiting thread, or on a new thread (named `harness-run`) when every
    /// thread is busy. When a thread cannot be started, `job` is dropped unrun and the error says
    /// why.
    pub(crate) fn run<'scope>(
        self: &Arc<Self>,
        scope: &'scope Scope<'scope, 'env>,
        job: Job<'env>,
    ) -> std::io::Result<()> {
        {
            let mut state = self.state.lock();
            if state.waiting > state.jobs.len() {
                state.jobs.push_back(job);
                drop(state);
                self.ready.notify_one();
                return Ok(());
            }
        }
        let runners = self.clone();
        std::thread::Builder::new()
            .name("harness-run".to_owned())
            .spawn_scoped(scope, move || {
                job();
                runners.serve();
            })
            .map(drop)
    }

    /// A thread's life after its first job: take the next job, or end after the idle limit with
    /// none, or once closed.
    fn serve(&self) {
        let mut state = self.state.lock();
        loop {
            if let Some(job) = state.jobs.pop_front() {
                drop(state);
                job();
                state = self.state.lock();
                continue;
            }
            if state.closed {
                return;
            }
            state.waiting += 1;
            let timed_out = self.ready.wait_for(&mut state, self.idle_limit).timed_out();
            state.waiting -= 1;
            if timed_out && state.jobs.is_empty() {
                return;
            }
        }
    }

    /// Lets every waiting thread end once the jobs handed to them have run.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
        self.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::ThreadId;
    use std::time::Instant;

    const DEADLINE: Duration = Duration::from_secs(10);

    impl Runners<'_> {
        /// Blocks until `count` threads wait for a job; panics after [`DEADLINE`].
        fn wait_until_waiting(&self, count: usize) {
            let start = Instant::now();
            while self.state.lock().waiting != count {
                assert!(start.elapsed() < DEADLINE, "never {count} waiting threads");
                std::thread::yield_now();
            }
        }
    }

    fn ran_on(sender: &crossbeam_channel::Sender<ThreadId>) -> Job<'_> {
        Box::new(move || sender.send(std::thread::current().id()).unwrap())
    }

    #[test]
    fn a_thread_that_finished_an_activation_runs_the_next() {
        let (sender, ran) = crossbeam_channel::unbounded();
        let runners = Arc::new(Runners::new());
        std::thread::scope(|scope| {
            runners.run(scope, ran_on(&sender)).unwrap();
            let first = ran.recv_timeout(DEADLINE).unwrap();
            runners.wait_until_waiting(1);
            runners.run(scope, ran_on(&sender)).unwrap();
            let second = ran.recv_timeout(DEADLINE).unwrap();
            assert_eq!(
                first, second,
                "the second activation started a thread of its own"
            );
            runners.close();
        });
    }

    #[test]
    fn activations_never_wait_for_a_busy_thread() {
        // Each job waits for the other to start: run one after the other, the first would give up
        // waiting and report that it ran alone.
        let arrived = (Mutex::new(0), Condvar::new());
        let (sender, ran) = crossbeam_channel::unbounded();
        let runners = Arc::new(Runners::new());
        std::thread::scope(|scope| {
            for _ in 0..2 {
                let (arrived, sender) = (&arrived, sender.clone());
                let job: Job<'_> = Box::new(move || {
                    let (count, changed) = arrived;
                    let mut count = count.lock();
                    *count += 1;
                    changed.notify_all();
                    let deadline = Instant::now() + DEADLINE;
                    while *count < 2 && !changed.wait_until(&mut count, deadline).timed_out() {}
                    sender.send((std::thread::current().id(), *count)).unwrap();
                });
                runners.run(scope, job).unwrap();
            }
            let (first, seen_by_first) = ran.recv_timeout(DEADLINE).unwrap();
            let (second, _) = ran.recv_timeout(DEADLINE).unwrap();
            assert_eq!(
                seen_by_first, 2,
                "the activations did not run at the same time"
            );
            assert_ne!(first, second);
            runners.close();
        });
    }

    #[test]
    fn a_thread_ends_after_the_idle_limit_without_a_close() {
        let (sender, ran) = crossbeam_channel::unbounded();
        let runners = Arc::new(Runners::with_idle_limit(Duration::from_millis(20)));
        std::thread::scope(|scope| {
            runners.run(scope, ran_on(&sender)).unwrap();
            ran.recv_timeout(DEADLINE).unwrap();
            runners.wait_until_waiting(1);
            runners.wait_until_waiting(0);
            // No close: the scope's join returns only because the thread ended on its own.
        });
    }

    #[test]
    fn close_ends_waiting_threads_after_the_jobs_handed_to_them() {
        let (sender, ran) = crossbeam_channel::unbounded();
        let runners = Arc::new(Runners::new());
        std::thread::scope(|scope| {
            runners.run(scope, ran_on(&sender)).unwrap();
            ran.recv_timeout(DEADLINE).unwrap();
            runners.wait_until_waiting(1);
            runners.run(scope, ran_on(&sender)).unwrap();
            runners.close();
        });
        assert_eq!(
            ran.try_iter().count(),
            1,
            "the job handed over before close did not run"
        );
    }
}
