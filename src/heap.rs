//! The process heap: memory that sessions stop using goes back to the operating system.
//!
//! glibc's malloc keeps what is freed. Pages inside its heaps are returned only by an explicit
//! `malloc_trim`, and the free top of each thread's arena only once it exceeds a trim threshold
//! that glibc raises as large blocks come and go (to 2 MiB and more once a large hash table has
//! been freed). On two CPUs Brain's threads use about fourteen arenas, so after 10,000 sessions
//! were opened and passivated, the heap held ≈ 46 MB of which 3 MB was in use, and the private
//! memory stayed where the open sessions had taken it (docs/BENCHMARKS.md).
//!
//! So Brain caps the arenas at one per CPU ([`few_arenas`], before its threads start), fixes the
//! trim threshold at glibc's initial 128 KiB ([`keep_little`], once started), and trims the heap
//! shortly after sessions are made dormant or deleted ([`give_back`], from the dispatcher). Both act on the whole process: an embedding program shares its allocator with
//! Brain. Off glibc they do nothing.

/// The trim threshold Brain sets: glibc's default before it adjusts it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: libc::c_int = 128 * 1024;

/// Fixes malloc's trim threshold, so that a thread arena's free top beyond 128 KiB is returned
/// when a block is freed, however large the blocks the process freed before. Fixing it also
/// freezes glibc's threshold for serving a block with a mapping of its own where glibc's
/// adjustments have brought it by then, which is why Brain calls this once started: frozen at
/// 128 KiB before recovery, every read buffer of 128 KiB or more would get a mapping of its own.
pub(crate) fn keep_little() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt takes two integers, touches only the allocator's own parameters (under
        // its lock) and may be called at any time, from any thread.
        let set = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) };
        if set != 1 {
            log::debug!("mallopt(M_TRIM_THRESHOLD) refused; freed memory may stay resident");
        }
    }
}

/// Caps malloc's arenas at one per CPU (at least two), glibc's default being eight per CPU.
/// Called before Brain's threads start. Every thread that allocates gets an arena of its own
/// while the cap allows, and what an open session leaves behind when it is passivated (a few
/// hundred bytes) then sits in pages of as many arenas as threads touched it, pinning them: the
/// private memory per passivated session with a realistic request ranged from 345 to 1,315 B
/// between runs with the default and stayed at 345–365 B with two arenas (docs/BENCHMARKS.md).
/// With no more threads running at once than CPUs, arenas beyond one per CPU buy little.
pub(crate) fn few_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let cpus = std::thread::available_parallelism().map_or(2, usize::from);
        let arenas = libc::c_int::try_from(cpus.max(2)).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt takes two integers, touches only the allocator's own parameters (under
        // its lock) and may be called at any time, from any thread.
        let set = unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) };
        if set != 1 {
            log::debug!("mallopt(M_ARENA_MAX) refused; freed memory may stay resident");
        }
    }
}

/// Returns every wholly free page of the heap to the operating system. Takes a few
/// milliseconds for a heap of tens of megabytes, holding each arena's lock in turn.
pub(crate) fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let began = std::time::Instant::now();
        // SAFETY: malloc_trim takes an integer and only walks and releases the allocator's own
        // free chunks, under each arena's lock; it is safe to call at any time, from any thread.
        unsafe { libc::malloc_trim(0) };
        log::debug!("heap: trimmed in {:?}", began.elapsed());
    }
}
