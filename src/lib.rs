//! Brain: a host for agent-loop harnesses.
//!
//! Brain starts pools of harness worker processes, speaks line-delimited JSON-RPC 2.0
//! (brain/harness/v1) with them over their stdin and stdout, and keeps them healthy. It is
//! synchronous and threaded: no async runtime anywhere.
//!
//! The shape: each worker pipe has its own reader and writer thread; they feed crossbeam channels
//! into one dispatcher thread (`brain-dispatch`) that owns all worker state; a timer thread
//! (`brain-timer`) enforces deadlines. See `docs/ARCHITECTURE.md`.

#![deny(missing_docs)]

mod api;
mod brain;
mod callbacks;
pub use brain_harness::cancel;
mod capacity;
pub mod config;
pub mod datadir;
mod dispatch;
mod dormant;
pub mod effects;
#[doc(hidden)]
pub mod fuzzing;
use brain_harness::handoff;
pub mod hardening;
pub use brain_harness as harness;
mod heap;
pub mod http;
pub mod journal;
mod metrics;
mod options;
mod pool;
pub use brain_protocol as protocol;
mod recovery;
mod retries;
pub mod sandbox;
pub mod session;
mod sessions;
pub mod status;
mod timer;
mod watch;
pub mod worker;

pub use api::{
    Activation, ActivationError, ApiError, Cancelled, Canceller, CreateOptions, Outcome,
    OutcomeKind, SendOptions, Session, SessionInfo, SessionStatus,
};
pub use brain::{Brain, Config, StartError, Storage};
pub use config::{ConfigError, Registration, Registrations};
pub use options::Options;
pub use status::{PoolStatus, WorkerState};
