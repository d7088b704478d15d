//! The dispatcher thread: the one owner of the pool's state.
//!
//! Three channels feed it, polled in priority order: due deadlines from the timer thread, commands
//! from API callers, and events from the workers' threads. Deadlines come first so that a harness
//! flooding its stdout cannot delay a kill; commands next so that callers are served under load.
//! The dispatcher never blocks on anything but these channels: pipe writes belong to the writer
//! threads and waits for processes to the waiter threads.

use crate::pool::{Deadline, Pool, StartupRefusal};
use crate::worker::{WorkerEvent, WorkerKey};
use crossbeam_channel::{Receiver, Sender, never, select_biased};
use std::time::Duration;

/// Requests from API callers to the dispatcher.
#[derive(Debug)]
pub(crate) enum Command {
    /// Stop every worker (shutdown request, then a kill after `grace`) and end the loop; `done` is
    /// dropped when the dispatcher has stopped.
    Shutdown { grace: Duration, done: Sender<()> },
}

/// The channels the dispatcher reads.
pub(crate) struct Inputs {
    pub(crate) deadlines: Receiver<Deadline>,
    pub(crate) commands: Receiver<Command>,
    pub(crate) events: Receiver<(WorkerKey, WorkerEvent)>,
}

/// Runs the dispatcher until shutdown completes. Sends the startup outcome on `startup` once every
/// worker's first spawn has settled.
pub(crate) fn run(mut pool: Pool, inputs: Inputs, startup: Sender<Result<(), StartupRefusal>>) {
    let Inputs {
        deadlines,
        mut commands,
        events,
    } = inputs;
    let mut startup = Some(startup);
    // Held until the loop ends; dropping them tells the callers shutdown is complete.
    let mut shutdown_waiters: Vec<Sender<()>> = Vec::new();
    pool.spawn_all();
    loop {
        if let Some(reply) = startup.take_if(|_| pool.all_settled()) {
            let outcome = pool.finish_startup();
            pool.publish();
            let _ = reply.send(outcome);
        }
        if pool.stopped() {
            break;
        }
        select_biased! {
            recv(deadlines) -> deadline => match deadline {
                Ok(deadline) => pool.on_deadline(deadline),
                // The timer lives as long as the pool holds its handle; this cannot happen.
                Err(_) => break,
            },
            recv(commands) -> command => match command {
                Ok(Command::Shutdown { grace, done }) => {
                    shutdown_waiters.push(done);
                    pool.begin_shutdown(grace);
                }
                Err(_) => {
                    // Every handle is gone without a shutdown: stop the workers at once.
                    commands = never();
                    pool.begin_shutdown(Duration::ZERO);
                }
            },
            recv(events) -> event => match event {
                Ok((key, event)) => pool.on_worker_event(key, event),
                Err(_) => break,
            },
        }
    }
    drop(shutdown_waiters);
}
