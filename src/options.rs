//! Brain's tunables: deadlines, limits and the restart budget, with the seed's defaults.

use std::path::PathBuf;
use std::time::Duration;

/// Tunables for a [`Brain`](crate::Brain). `Options::default()` holds the protocol's figures; tests
/// shorten the deadlines, operators set them with flags.
#[derive(Debug, Clone)]
pub struct Options {
    /// The data directory. Harness state lives beneath `<data_dir>/agentloops/<registration>/`.
    pub data_dir: PathBuf,
    /// This Brain's name among several behind a router (`--instance`, issue 28): recorded in the
    /// data directory at first start and carried by every session id it makes
    /// ([`SessionId::generate_for`](crate::session::SessionId::generate_for)). Default none.
    pub instance: Option<crate::session::InstanceName>,
    /// How long a worker has from its spawn to answer `initialize` (default 30 s).
    pub init_deadline: Duration,
    /// How long a harness has to end after `cancel` or `shutdown` before its group is killed
    /// (default 5 s).
    pub cancel_grace: Duration,
    /// The longest line Brain writes or accepts (default 16 MiB).
    pub max_line_bytes: usize,
    /// The first respawn delay (default 100 ms); it doubles with each failure in the window.
    pub respawn_backoff: Duration,
    /// The longest respawn delay (default 30 s).
    pub respawn_backoff_max: Duration,
    /// More than this many failures of one slot within `restart_window` quarantine it (default 5).
    pub restart_budget: u32,
    /// The window of the restart budget (default 60 s).
    pub restart_window: Duration,
    /// This many protocol violations within `violation_window` mark a worker faulty (default 10).
    pub violation_limit: usize,
    /// The window for counting violations (default 60 s).
    pub violation_window: Duration,
    /// Activations that may wait for one worker slot's capacity; more are refused `overloaded`
    /// (default 10,000).
    pub queue_bound: usize,
    /// Threads that run callbacks (effects block on providers and the journal), default 64.
    pub callback_threads: usize,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            data_dir: PathBuf::from("brain-data"),
            instance: None,
            init_deadline: Duration::from_secs(30),
            cancel_grace: Duration::from_secs(5),
            max_line_bytes: 16 * 1024 * 1024,
            respawn_backoff: Duration::from_millis(100),
            respawn_backoff_max: Duration::from_secs(30),
            restart_budget: 5,
            restart_window: Duration::from_secs(60),
            violation_limit: 10,
            violation_window: Duration::from_secs(60),
            queue_bound: 10_000,
            callback_threads: 64,
        }
    }
}
