//! Keeping Brain's own process out of its children's reach (docs/SECURITY.md).
//!
//! [`harden`] is meant for the first lines of `main`, before any thread starts: it makes the
//! process non-dumpable, so that no process Brain starts (running as the same user) can read
//! Brain's memory, environment, descriptors, working directory or root through `/proc/<pid>/`
//! or attach to it with ptrace; and it takes the secrets Brain reads at startup
//! ([`SECRET_VARS`]) out of its environment, keeping them in memory for [`var`].

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::OnceLock;

/// The variables Brain reads once at startup and then keeps only in memory: the API token and
/// the model providers' keys.
pub const SECRET_VARS: [&str; 3] = ["BRAIN_API_TOKEN", "OPENAI_API_KEY", "ANTHROPIC_API_KEY"];

/// Set to `1` to leave the process dumpable, for attaching a debugger as the same user
/// (`gdb -p`, `strace -p`); root can attach either way.
pub const DEBUGGABLE_VAR: &str = "BRAIN_DEBUGGABLE";

static SEALED: OnceLock<HashMap<&'static str, OsString>> = OnceLock::new();

/// Makes the process non-dumpable (unless [`DEBUGGABLE_VAR`] is `1`) and moves
/// [`SECRET_VARS`] from the environment into memory. Returns whether the process is now
/// non-dumpable.
///
/// # Safety
///
/// Must be called while the process has one thread, before anything else reads or writes the
/// environment: it removes variables from it, which races with any other thread's access.
pub unsafe fn harden() -> bool {
    let sealed = SECRET_VARS
        .iter()
        .filter_map(|name| std::env::var_os(name).map(|value| (*name, value)))
        .collect::<HashMap<_, _>>();
    for name in SECRET_VARS {
        // SAFETY: the caller guarantees that no other thread exists yet (see above).
        unsafe { std::env::remove_var(name) };
    }
    let _ = SEALED.set(sealed);
    if std::env::var_os(DEBUGGABLE_VAR).is_some_and(|value| value == "1") {
        return false;
    }
    // SAFETY: prctl(PR_SET_DUMPABLE) takes integer arguments only and touches no memory of ours.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) == 0 }
}

/// A secret variable: the value [`harden`] took out of the environment, else the environment's.
pub fn var(name: &str) -> Option<OsString> {
    SEALED
        .get()
        .and_then(|sealed| sealed.get(name).cloned())
        .or_else(|| std::env::var_os(name))
}
