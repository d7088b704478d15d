//! [`CancelToken`]: one cancellation signal shared by the harness SDK and Brain's effects.
//!
//! The harness SDK hands one to each activation (`brain::harness::CancelToken` is this type);
//! Brain hands one to every model provider and environment driver call (`brain::effects`,
//! where it is `brain::cancel::CancelToken`), so an embedder's effect code and a Rust harness use
//! the same type.

use parking_lot::{Condvar, Mutex};
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

type Hook = Box<dyn FnOnce() + Send + 'static>;

/// A one-way cancellation flag shared by every clone: once cancelled, always cancelled.
///
/// The SDK cancels an activation's token when Brain sends `cancel` for it, when one of its callbacks
/// answers with a fatal error, and when the connection to Brain closes while it runs. A handler
/// either checks [`is_cancelled`](CancelToken::is_cancelled) between steps, blocks in
/// [`wait_timeout`](CancelToken::wait_timeout) instead of sleeping, or registers
/// [`on_cancel`](CancelToken::on_cancel) hooks that interrupt work in flight (kill a child process,
/// close a socket).
///
/// Waiting uses a condition variable: no polling, and a waiter wakes as soon as the token is
/// cancelled.
#[derive(Clone, Default)]
pub struct CancelToken {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    cancelled: bool,
    hooks: Vec<Hook>,
}

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// Cancels the token: wakes every waiter, then runs every registered hook once, in registration
    /// order, on the calling thread (outside any lock, so a hook may use the token). A hook that
    /// panics is logged and the remaining hooks still run.
    ///
    /// Idempotent: returns `true` only for the call that cancelled the token.
    pub fn cancel(&self) -> bool {
        let hooks = {
            let mut state = self.inner.state.lock();
            if state.cancelled {
                return false;
            }
            state.cancelled = true;
            std::mem::take(&mut state.hooks)
        };
        self.inner.changed.notify_all();
        for hook in hooks {
            run_hook(hook);
        }
        true
    }

    /// Whether the token has been cancelled. Never blocks (beyond a short internal lock).
    pub fn is_cancelled(&self) -> bool {
        self.inner.state.lock().cancelled
    }

    /// Blocks until the token is cancelled or `timeout` has passed, whichever comes first, and
    /// returns whether it is cancelled. Returns at once when it already is. Use it instead of
    /// `thread::sleep` so that a cancel ends the wait immediately.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let mut state = self.inner.state.lock();
        self.inner
            .changed
            .wait_while_for(&mut state, |state| !state.cancelled, timeout);
        state.cancelled
    }

    /// Blocks until the token is cancelled, possibly forever.
    pub fn wait(&self) {
        let mut state = self.inner.state.lock();
        self.inner
            .changed
            .wait_while(&mut state, |state| !state.cancelled);
    }

    /// Registers `hook` to run once when the token is cancelled, on the thread that cancels it.
    /// When the token is already cancelled, `hook` runs at once on the calling thread. Hooks should
    /// be short and must not block on the activation they cancel.
    pub fn on_cancel(&self, hook: impl FnOnce() + Send + 'static) {
        {
            let mut state = self.inner.state.lock();
            if !state.cancelled {
                state.hooks.push(Box::new(hook));
                return;
            }
        }
        run_hook(Box::new(hook));
    }
}

fn run_hook(hook: Hook) {
    if catch_unwind(AssertUnwindSafe(hook)).is_err() {
        log::error!("a cancel hook panicked; the remaining hooks still run");
    }
}

impl fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancelToken")
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    #[test]
    fn cancel_is_idempotent_and_runs_hooks_once() {
        let token = CancelToken::new();
        let count = Arc::new(AtomicUsize::new(0));
        let counted = count.clone();
        token.on_cancel(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        assert!(!token.is_cancelled());
        assert!(token.cancel());
        assert!(!token.clone().cancel());
        assert!(token.is_cancelled());
        assert_eq!(count.load(Ordering::SeqCst), 1);

        let late = count.clone();
        token.on_cancel(move || {
            late.fetch_add(10, Ordering::SeqCst);
        });
        assert_eq!(count.load(Ordering::SeqCst), 11);
    }

    #[test]
    fn a_panicking_hook_does_not_stop_the_others() {
        let token = CancelToken::new();
        let ran = Arc::new(AtomicUsize::new(0));
        token.on_cancel(|| panic!("hook failure"));
        let after = ran.clone();
        token.on_cancel(move || {
            after.fetch_add(1, Ordering::SeqCst);
        });
        token.cancel();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn wait_timeout_wakes_on_cancel_from_another_thread() {
        let token = CancelToken::new();
        assert!(!token.wait_timeout(Duration::from_millis(1)));
        let (started_tx, started_rx) = crossbeam_channel::bounded(0);
        let canceller = {
            let token = token.clone();
            std::thread::spawn(move || {
                started_rx.recv().unwrap();
                token.cancel();
            })
        };
        let begin = Instant::now();
        started_tx.send(()).unwrap();
        assert!(token.wait_timeout(Duration::from_secs(60)));
        assert!(begin.elapsed() < Duration::from_secs(30));
        token.wait();
        canceller.join().unwrap();
    }
}
