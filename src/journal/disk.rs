//! The durable journal: records of every session share append-only segment files under
//! `<data>/journal`, and one writer thread makes batches of them durable with one `fdatasync`
//! each (group commit). The format and the recovery policy are in docs/JOURNAL.md.
//!
//! **Durable** means: the record's frame was written to its segment file and a later
//! `fdatasync` of that file returned success, and the directory entry of that file had been
//! fsynced when the file was created. Nothing is reported durable before that.
//!
//! # Design
//!
//! - **Positions.** Every frame gets its place in the log (segment id, byte offset) when it is
//!   appended, under a short global lock that also hands the frame to the writer, so the writer
//!   receives frames in log order and a record is durable exactly when the flushed position has
//!   passed its end. A durability callback therefore waits on one number, not on a session.
//! - **Locks**, never held across `fsync`: the session map (a read-write lock, held only to find,
//!   insert or remove a session), one mutex per session (its sequence is assigned, its frame
//!   placed and its projections updated under it, so its order on disk is its sequence order),
//!   and the placement lock (a few arithmetic steps and a push onto the queue). Nesting: a session's
//!   mutex, then the map (only `delete`, while it places its tombstone, and `release`, while it
//!   makes the session quiet), then the placement lock;
//!   `create` places its first record under the map's write lock, so a re-created session's
//!   records always follow the tombstone of the deleted one. Nobody waits for a session's mutex
//!   while holding the map. The flusher is only ever tried, never waited for, and while held it
//!   takes the placement lock and the waiter list briefly. The waiter list, the writer's signal,
//!   the descriptor cache and the eviction queue are leaves. Callbacks run with no lock held.
//! - **Flushing** (leader/follower). Placed frames wait in the log's queue, in log order. One
//!   thread at a time holds the flusher (the active segment): it takes the whole queue, writes it
//!   with positioned writes (taking what was queued meanwhile too), calls `sync_data` once, lets
//!   go of the flusher, runs the callbacks it covered, and looks at the queue again. A thread
//!   appending a durable record ([`Journal::append_durable`], an effect record) whose frame is
//!   the only one queued flushes it this way when nobody else is flushing, so at one record in
//!   flight a durable append costs a write and an `fdatasync` on the caller's thread and no
//!   hand-off. When other frames are queued too, it wakes the writer thread (`brain-journal`)
//!   instead and goes back to its work (or waits, in `append_durable`). Frames appended with
//!   [`Journal::append`], `create` and `delete` always wake the writer, which flushes until the
//!   queue is empty; so under load the writer carries the batches, which grow with load (group
//!   commit). Before a new segment is started the old one is flushed, the
//!   new file created and the directory fsynced, so only the last segment can ever have a torn
//!   tail. A failed write or flush is fatal: it is logged, never retried, every waiting callback
//!   and every later append, create, delete and flush fails with `journal_failed`.
//! - **Memory.** Per live session the journal keeps the place of each record (16 bytes a record),
//!   its last timestamp, and the records appended but not yet written (dropped once written). A
//!   quiet session (recovered and not used since, or released by [`Journal::release`]) keeps only
//!   its places, in one list shared by all quiet sessions, and no allocation of its own.
//!   Projections ([`SessionView`]) and the list of pending events are built from disk on first
//!   use and kept for at most [`DiskJournalOptions::max_loaded_sessions`] sessions; beyond that
//!   the least recently loaded are evicted (rebuilt from disk when needed again). `read` never
//!   needs the projections: it reads the records it returns.
//! - **Descriptors.** One write descriptor (the active segment), and a small cache of read-only
//!   descriptors ([`DiskJournalOptions::read_descriptors`], default 4) for reads: never one per
//!   session.
//! - **Read-only.** [`DiskJournal::open_read_only`] scans the directory the same way but writes
//!   nothing and starts no writer: it serves the records that were complete when it opened, even
//!   while another process keeps appending to the directory.

use super::frame::{self, Address, FrameType, SEGMENT_HEADER_LEN};
use super::recover::{self, Tail};
use super::segment::{self, Loc, SegmentTable};
use super::{
    AppendedCallback, DurableCallback, EffectRecord, IdlePlacement, Journal, JournalError,
    NewRecord, Placed, SessionView, apply, apply_transcript_delta,
};
use crate::protocol::harness::{Event, Message, OriginKind, RecordKind};
use crate::session::{SessionId, SessionIdMap};
use parking_lot::{Condvar, Mutex, RwLock};
use serde_json::Value;
use std::collections::{BTreeMap, VecDeque};
use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{SystemTime, UNIX_EPOCH};

/// The default size at which a segment is sealed and the next one started: 64 MiB.
pub const DEFAULT_SEGMENT_SIZE: u64 = 64 << 20;
/// The smallest segment size [`DiskJournalOptions::segment_size`] accepts (smaller is raised).
pub const MIN_SEGMENT_SIZE: u64 = 1024;
/// The largest segment size [`DiskJournalOptions::segment_size`] accepts (larger is lowered).
pub const MAX_SEGMENT_SIZE: u64 = 1 << 30;

/// How far ahead of the frames the active segment is filled with zeros. Overwriting blocks
/// that are already allocated and written lets `fdatasync` flush data alone, without the inode
/// (its size and extents), which makes each flush about a third cheaper on ext4.
const ZERO_AHEAD: u64 = 256 << 10;
/// The zeros are topped up this much at a time, whenever less than `ZERO_AHEAD - ZERO_STEP` is
/// left. The flush after a top-up writes the new zeros back too, and on this project's disk a
/// flush costs about the same up to 64 KiB and then grows with its bytes (a mebibyte ≈ 7 times
/// a 26 KB batch): zeroing a mebibyte at a time made one flush in ≈ 40 that slow, ≈ 14 % of the
/// journal's time in `fdatasync`.
const ZERO_STEP: usize = 64 << 10;
/// What the zeros are written from.
static ZEROS: [u8; ZERO_STEP] = [0; ZERO_STEP];
/// The flusher writes its buffer out whenever it holds this much.
const WRITE_CHUNK: usize = 4 << 20;

/// Tuning of a [`DiskJournal`]. [`Default`] gives the production values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskJournalOptions {
    /// A segment is sealed, and the next started, when a frame would take it past this size
    /// (a single larger frame gets a segment of its own). Default [`DEFAULT_SEGMENT_SIZE`];
    /// clamped to [`MIN_SEGMENT_SIZE`]..=[`MAX_SEGMENT_SIZE`].
    pub segment_size: u64,
    /// The most sessions whose projections are kept in memory at once (at least 1; default
    /// 1024). Others are rebuilt from disk when used.
    pub max_loaded_sessions: usize,
    /// The most read-only segment descriptors kept open (1..=64; default 4).
    pub read_descriptors: usize,
}

impl Default for DiskJournalOptions {
    fn default() -> DiskJournalOptions {
        DiskJournalOptions {
            segment_size: DEFAULT_SEGMENT_SIZE,
            max_loaded_sessions: 1024,
            read_descriptors: 4,
        }
    }
}

impl DiskJournalOptions {
    fn clamped(mut self) -> DiskJournalOptions {
        self.segment_size = self.segment_size.clamp(MIN_SEGMENT_SIZE, MAX_SEGMENT_SIZE);
        self.max_loaded_sessions = self.max_loaded_sessions.max(1);
        self.read_descriptors = self.read_descriptors.clamp(1, 64);
        self
    }
}

/// Counters of a [`DiskJournal`] since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JournalStats {
    /// Frames written (records and deletion tombstones).
    pub records: u64,
    /// `fdatasync` calls on segment files. Under concurrent load this is far below `records`:
    /// that is group commit.
    pub flushes: u64,
    /// Batches the writer took from its queue.
    pub batches: u64,
    /// Directory fsyncs (a segment created, compaction removing one, the directory created).
    pub directory_syncs: u64,
    /// Bytes of frames and segment headers written to segment files (not counting the zeros
    /// written ahead of them).
    pub bytes: u64,
    /// Segment files on disk, as far as the journal knows.
    pub segments: usize,
    /// Sessions whose projections are in memory now.
    pub loaded_sessions: usize,
}

/// What [`DiskJournal::compact`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompactionReport {
    /// Segment files removed.
    pub segments_removed: usize,
    /// Their total size.
    pub bytes_reclaimed: u64,
    /// Segment files left.
    pub segments_kept: usize,
}

/// A [`Journal`] on disk: durable, group-committed, recovered at open. See the module
/// documentation for what "durable" means and how memory and descriptors stay bounded.
///
/// Every [`Journal`] method behaves as [`super::MemoryJournal`]'s does, with these differences:
/// [`Journal::on_durable`] calls back later, once the record is flushed, on the thread that
/// flushed it (the `brain-journal` thread, or one in [`Journal::append_durable`]; inline only if
/// it already is durable, or cannot be); [`Journal::append_durable`] may flush on the calling
/// thread; a session whose records recovery
/// or a later read found damaged is refused by every method with [`JournalError::Corrupt`]
/// naming the file and offset (it is still listed by [`Journal::sessions`] and may be deleted);
/// and after a failed write or flush, `create`, `append` and `delete` fail with
/// [`JournalError::Failed`] (reads keep working, and [`Journal::failure`] says why). A journal
/// opened with [`DiskJournal::open_read_only`] refuses every write. Methods other than
/// [`DiskJournal::open`], [`DiskJournal::sync`], [`DiskJournal::compact`] and
/// [`Journal::append_durable`] never wait for a flush; `read`, `pending_events`, `view` and `kv_get` may read the session's records from disk
/// (holding only that session's lock).
///
/// Dropping the journal lets the writer write and flush everything already appended (running
/// its callbacks) and waits for it.
pub struct DiskJournal {
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
}

/// Everything the callers and the writer share.
struct Shared {
    dir: PathBuf,
    options: DiskJournalOptions,
    /// Opened with [`DiskJournal::open_read_only`]: nothing is ever written.
    read_only: bool,
    sessions: RwLock<Sessions>,
    log: Mutex<Log>,
    /// Held by the one thread flushing; only ever tried (`try_lock`), never waited for.
    flusher: Mutex<Flusher>,
    /// Asks the writer thread to flush, or to stop.
    signal: Mutex<Signal>,
    wake: Condvar,
    /// The position up to which frames are written (readable through the page cache).
    written: AtomicU64,
    /// The position up to which frames are durable.
    durable: AtomicU64,
    waiters: Mutex<Waiters>,
    failed: AtomicBool,
    readers: Mutex<Vec<(u32, Arc<File>)>>,
    loaded: Mutex<VecDeque<Arc<Mutex<Session>>>>,
    loaded_count: AtomicUsize,
    counters: Counters,
}

/// Where the next frame goes, and the segment table.
struct Log {
    segment: u32,
    offset: u64,
    /// The end of the last frame placed.
    last_end: u64,
    table: SegmentTable,
    /// Frames placed and not yet taken by a flusher, in log order.
    queue: Vec<Job>,
    /// Set when the journal is dropped: nothing more is placed.
    closed: bool,
}

/// The flusher's state: the segment being appended to, and buffers kept between batches so
/// that taking one allocates nothing.
struct Flusher {
    current: Option<Current>,
    /// An empty queue, swapped with the log's to take a batch.
    spare: Vec<Job>,
    buffer: Vec<u8>,
}

/// What the writer thread is asked to do.
#[derive(Default)]
struct Signal {
    /// Frames were queued that nobody else will flush.
    flush: bool,
    /// The journal was dropped: flush what is queued and end.
    close: bool,
}

/// A placed frame, waiting for a flusher.
struct Job {
    pos: u64,
    bytes: Vec<u8>,
}

/// Durability callbacks by the position they wait for.
type Due = BTreeMap<u64, Vec<DurableCallback>>;

/// The callbacks waiting for durability, and why nothing will be durable any more.
struct Waiters {
    pending: Due,
    failed: Option<String>,
}

#[derive(Default)]
struct Counters {
    records: AtomicU64,
    flushes: AtomicU64,
    batches: AtomicU64,
    directory_syncs: AtomicU64,
    bytes: AtomicU64,
}

/// Every existing session, live or quiet.
#[derive(Default)]
struct Sessions {
    map: SessionIdMap<SessionId, Entry>,
    /// The record places of the quiet sessions, each a span of it: one allocation for all of
    /// them, so that a quiet session pins no page of the heap.
    quiet_locs: Vec<Loc>,
    /// Places in `quiet_locs` that no quiet session refers to any more.
    garbage: usize,
}

/// A session in the map.
enum Entry {
    /// Its index and cached state, behind its own lock.
    Live(Arc<Mutex<Session>>),
    /// Released with every record written and readable (recovered sessions start so): its
    /// places are `quiet_locs[start..start + len]`. Woken into a [`Session`] on its next use.
    Quiet {
        start: usize,
        len: usize,
        last_stamp: u64,
    },
}

/// Garbage in [`Sessions::quiet_locs`] below which it is never compacted.
const QUIET_GARBAGE_FLOOR: usize = 4096;

impl Sessions {
    /// The session, woken if it is quiet; `None` if it does not exist.
    fn wake(&mut self, id: &SessionId) -> Option<Arc<Mutex<Session>>> {
        let Sessions {
            map,
            quiet_locs,
            garbage,
        } = self;
        let entry = map.get_mut(id)?;
        if let Entry::Quiet {
            start,
            len,
            last_stamp,
        } = *entry
        {
            *garbage += len;
            *entry = Entry::Live(Arc::new(Mutex::new(Session {
                id: id.clone(),
                locs: quiet_locs[start..start + len].to_vec(),
                last_stamp,
                unwritten: VecDeque::new(),
                loaded: None,
                refused: None,
                deleted: false,
            })));
        }
        match entry {
            Entry::Live(arc) => Some(arc.clone()),
            Entry::Quiet { .. } => None,
        }
    }

    /// Makes the session quiet, with `locs` as its places (it must have every record written).
    fn quiet(&mut self, id: &SessionId, locs: &[Loc], last_stamp: u64) {
        self.compact_if_wasteful();
        let start = self.quiet_locs.len();
        self.quiet_locs.extend_from_slice(locs);
        self.map.insert(
            id.clone(),
            Entry::Quiet {
                start,
                len: locs.len(),
                last_stamp,
            },
        );
    }

    /// Rewrites `quiet_locs` without its garbage once that is most of it (amortised: the garbage
    /// was at least as many places as are kept).
    fn compact_if_wasteful(&mut self) {
        if self.garbage < QUIET_GARBAGE_FLOOR || self.garbage * 2 < self.quiet_locs.len() {
            return;
        }
        let mut kept = Vec::with_capacity(self.quiet_locs.len() - self.garbage);
        for entry in self.map.values_mut() {
            if let Entry::Quiet { start, len, .. } = entry {
                let from = *start;
                *start = kept.len();
                kept.extend_from_slice(&self.quiet_locs[from..from + *len]);
            }
        }
        self.quiet_locs = kept;
        self.garbage = 0;
    }
}

/// One session's index and cached state.
struct Session {
    id: SessionId,
    /// The frame of sequence `s` is at index `s - 1`.
    locs: Vec<Loc>,
    last_stamp: u64,
    /// Records appended but perhaps not yet written, oldest first, contiguous sequences.
    unwritten: VecDeque<(u64, Unwritten)>,
    loaded: Option<Box<Loaded>>,
    refused: Option<JournalError>,
    deleted: bool,
}

/// The projections of a session, built from all of its records.
#[derive(Default)]
struct Loaded {
    view: SessionView,
    /// The `event_emitted` records not emitted by the harness, ascending.
    pending: Vec<u64>,
}

/// A record not yet known to be written: its frame's body (kept as text, which is smaller than
/// the record's `Value` and is all a read needs) and its stamp.
struct Unwritten {
    body: Vec<u8>,
    recorded_at_ms: u64,
}

impl Unwritten {
    fn new(mut body: Vec<u8>, recorded_at_ms: u64) -> Unwritten {
        // Bodies are encoded into a buffer reserved for a typical record, and an idle session
        // keeps its last records until they are pruned: keep only the bytes.
        body.shrink_to_fit();
        Unwritten {
            body,
            recorded_at_ms,
        }
    }
}

/// A record and its stamp.
struct Stored {
    record: NewRecord,
    recorded_at_ms: u64,
}

/// What a placed frame does to the segment table.
enum Placement<'a> {
    Record,
    Tombstone(&'a [Loc]),
}

impl DiskJournal {
    /// Opens (creating it, mode 0700, if missing) the journal directory `dir` — normally
    /// `<data>/journal` — with default options. See [`DiskJournal::open_with`].
    pub fn open(dir: &Path) -> Result<DiskJournal, JournalError> {
        DiskJournal::open_with(dir, DiskJournalOptions::default())
    }

    /// Opens the journal in `dir` and recovers it; blocks for the scan.
    ///
    /// Recovery reads every segment once, in order, checking every frame's checksums but
    /// decoding no record: projections are rebuilt per session when first used. An incomplete
    /// final frame of the last segment is truncated (logged, and the file flushed). A damaged
    /// frame anywhere else makes the sessions it may belong to unreadable
    /// ([`JournalError::Corrupt`] from every call naming them); every other session is
    /// available. Deleted sessions stay deleted.
    ///
    /// Fails with [`JournalError::Failed`] on any I/O error, on a segment of another format
    /// version, or if the writer thread cannot start. Only one process may open a directory at a
    /// time; the caller ensures it (the data directory's lock).
    pub fn open_with(dir: &Path, options: DiskJournalOptions) -> Result<DiskJournal, JournalError> {
        let options = options.clamped();
        let created_dir = prepare_dir(dir)?;
        let ids = recover::list_segments(dir)?;
        let recovered = recover::scan(dir, &ids)?;
        let current = match recovered.tail {
            Tail::Append { segment, end } => {
                let path = segment::path(dir, segment);
                let file = OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|e| io_failure("opening", &path, &e))?;
                // Beyond the last frame the file holds only zeros (recovery checked): the
                // zeros written ahead of the frames before Brain stopped.
                let zeroed = file
                    .metadata()
                    .map_err(|e| io_failure("inspecting", &path, &e))?
                    .len();
                Some(Current {
                    id: segment,
                    file,
                    end: u64::from(end),
                    zeroed,
                })
            }
            Tail::Fresh { .. } => None,
        };
        let shared = Arc::new(Shared::new(dir, options, &ids, recovered, current, false));
        if created_dir {
            shared
                .counters
                .directory_syncs
                .fetch_add(1, Ordering::Relaxed);
        }
        let writer = thread::Builder::new()
            .name("brain-journal".to_owned())
            .spawn({
                let shared = shared.clone();
                move || run_writer(&shared)
            })
            .map_err(|e| JournalError::Failed(format!("starting the journal writer: {e}")))?;
        Ok(DiskJournal {
            shared,
            writer: Some(writer),
        })
    }

    /// Opens the existing journal directory `dir` for reading only, with default options: for
    /// inspecting a journal offline, or beside a running Brain that holds the directory.
    ///
    /// Writes nothing, ever: it creates no directory or file, truncates nothing, starts no
    /// writer thread and flushes nothing. It scans the segments as [`DiskJournal::open`] does,
    /// except that an incomplete frame at the end of the last segment — a crash's torn tail, or
    /// a frame another process is writing right now — is simply where the log ends, not
    /// corruption. It therefore sees what was complete in the files when it read them: every
    /// durable record, and perhaps records a live writer has written but not yet flushed.
    /// Records appended afterwards are not seen (open again to see them). If another process
    /// compacts the directory during the scan, the scan starts over.
    ///
    /// `sessions`, `read`, `pending_events`, `view` and `kv_get` work as on a read-write
    /// journal. `create`, `append`, `delete` and [`DiskJournal::compact`] fail with
    /// [`JournalError::Failed`]`("read-only")`, and so does every [`Journal::on_durable`]
    /// callback (this handle cannot tell whether another process has flushed a record);
    /// [`DiskJournal::sync`] returns at once (nothing was appended through it), and
    /// [`Journal::failure`] is `None`.
    ///
    /// Fails with [`JournalError::Failed`] naming `dir` if it is missing or not a directory, on
    /// any I/O error, and on a segment of another format version. A later read of a record
    /// whose segment another process has removed since (compaction: the session was deleted)
    /// fails with [`JournalError::Failed`].
    pub fn open_read_only(dir: &Path) -> Result<DiskJournal, JournalError> {
        let options = DiskJournalOptions::default().clamped();
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(JournalError::Failed(format!(
                    "the journal {} is not a directory",
                    dir.display()
                )));
            }
            Err(e) => return Err(io_failure("opening the journal", dir, &e)),
        }
        let (ids, recovered) = recover::scan_read_only(dir)?;
        Ok(DiskJournal {
            shared: Arc::new(Shared::new(dir, options, &ids, recovered, None, true)),
            writer: None,
        })
    }

    /// Blocks until every record, creation and deletion appended before the call is durable.
    /// Fails with [`JournalError::Failed`] if the journal failed before that.
    ///
    /// On a journal opened with [`DiskJournal::open_read_only`] it returns `Ok` at once: nothing
    /// can have been appended through it.
    pub fn sync(&self) -> Result<(), JournalError> {
        if self.shared.read_only {
            return Ok(());
        }
        let end = self.shared.log.lock().last_end;
        self.shared.flush_through(end)
    }

    /// Removes the sealed segments (every segment before the one being written) that hold no
    /// record of a live session, oldest first, fsyncing the directory after each removal. A
    /// segment holding a tombstone is kept as long as a segment with the records it deletes
    /// exists, so a deleted session never comes back; a segment recovery could not read is
    /// never removed. A segment that still holds one live record is kept whole (segments are
    /// not rewritten).
    ///
    /// Blocks for the file removals; appends go on meanwhile. An I/O error stops it (what was
    /// not removed is kept and tried again next time) and is returned as
    /// [`JournalError::Failed`]; it does not fail the journal. A journal opened with
    /// [`DiskJournal::open_read_only`] refuses with [`JournalError::Failed`]`("read-only")`.
    pub fn compact(&self) -> Result<CompactionReport, JournalError> {
        let shared = &self.shared;
        if shared.read_only {
            return Err(read_only());
        }
        let sealed_below = position_segment(shared.durable.load(Ordering::Acquire));
        let removable = shared.log.lock().table.take_removable(sealed_below);
        let mut report = CompactionReport::default();
        let mut failure = None;
        let mut kept = Vec::new();
        let mut rest = removable.into_iter();
        for (id, info) in rest.by_ref() {
            let path = segment::path(&shared.dir, id);
            shared.forget_reader(id);
            let removed = match std::fs::remove_file(&path) {
                Ok(()) => true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                Err(e) => {
                    failure = Some(io_failure("removing", &path, &e));
                    kept.push((id, info));
                    break;
                }
            };
            // Before the next removal: a tombstone's segment must never be gone while the
            // segment with the records it deletes is still there.
            if let Err(e) = sync_dir(&shared.dir) {
                failure = Some(io_failure("flushing", &shared.dir, &e));
                kept.push((id, info));
                break;
            }
            shared
                .counters
                .directory_syncs
                .fetch_add(1, Ordering::Relaxed);
            if removed {
                report.segments_removed += 1;
                report.bytes_reclaimed += info.bytes;
                log::info!("journal: compaction removed {}", path.display());
            }
        }
        kept.extend(rest);
        let mut log = shared.log.lock();
        // What was not removed is kept for the next compaction.
        for (id, info) in kept {
            log.table.restore(id, info);
        }
        report.segments_kept = log.table.len();
        drop(log);
        match failure {
            Some(error) => {
                log::error!("journal: compaction stopped: {error}");
                Err(error)
            }
            None => Ok(report),
        }
    }

    /// Counters since open. Never blocks for long.
    pub fn stats(&self) -> JournalStats {
        let counters = &self.shared.counters;
        JournalStats {
            records: counters.records.load(Ordering::Relaxed),
            flushes: counters.flushes.load(Ordering::Relaxed),
            batches: counters.batches.load(Ordering::Relaxed),
            directory_syncs: counters.directory_syncs.load(Ordering::Relaxed),
            bytes: counters.bytes.load(Ordering::Relaxed),
            segments: self.shared.log.lock().table.len(),
            loaded_sessions: self.shared.loaded_count.load(Ordering::Relaxed),
        }
    }

    /// Appends `record` to the session and places its frame, without waking anyone to flush
    /// it; returns its sequence and the frame's end.
    fn place_record(
        &self,
        session: &SessionId,
        record: NewRecord,
    ) -> Result<(u64, u64), JournalError> {
        let body = frame::encode_body(&record).map_err(JournalError::Failed)?;
        self.place_body(session, body, Projected::Record(&record))
    }

    /// Appends the `transcript_delta` record `{"keep", "append"}`, encoded from the messages;
    /// returns its sequence and where its frame ends.
    fn place_transcript(
        &self,
        session: &SessionId,
        keep: usize,
        append: &[Message],
    ) -> Result<(u64, u64), JournalError> {
        /// The record's data, members in the order a `Value` keeps them, so that the frame is
        /// the one `append_durable` would write.
        #[derive(serde::Serialize)]
        struct Delta<'a> {
            append: &'a [Message],
            keep: usize,
        }
        let body = frame::encode_typed_body(RecordKind::TranscriptDelta, &Delta { append, keep })
            .map_err(JournalError::Failed)?;
        self.place_body(session, body, Projected::TranscriptDelta { keep, append })
    }

    /// Appends an effect record from its encoded data; returns its sequence and where its frame
    /// ends.
    fn place_effect(
        &self,
        session: &SessionId,
        record: &EffectRecord,
    ) -> Result<(u64, u64), JournalError> {
        let body =
            frame::encode_typed_body(record.kind(), record.data()).map_err(JournalError::Failed)?;
        self.place_body(session, body, Projected::Record(&record.projected()))
    }

    /// Appends the record whose frame body is `body` and which changes a loaded session's
    /// projections as `projected` says.
    fn place_body(
        &self,
        session: &SessionId,
        body: Vec<u8>,
        projected: Projected<'_>,
    ) -> Result<(u64, u64), JournalError> {
        if let Projected::Record(record) = projected
            && record.kind == RecordKind::SessionCreated
        {
            return Err(JournalError::Failed(format!(
                "session {session}: session_created is only the first record (use create)"
            )));
        }
        let shared = &self.shared;
        shared.check_writable()?;
        shared.with_session(session, |s| {
            let sequence = s.locs.len() as u64 + 1;
            let recorded_at_ms = now_ms().max(s.last_stamp);
            let bytes = frame::encode(
                &Address {
                    frame_type: FrameType::Record,
                    session: session.clone(),
                    sequence,
                    recorded_at_ms,
                },
                &body,
            );
            let loc = shared.place(bytes, Placement::Record)?;
            s.locs.push(loc);
            s.last_stamp = recorded_at_ms;
            if let Some(loaded) = s.loaded.as_deref_mut() {
                match projected {
                    Projected::Record(record) => loaded.apply(session, sequence, record, true),
                    Projected::TranscriptDelta { keep, append } => apply_transcript_delta(
                        &mut loaded.view,
                        sequence,
                        keep,
                        append.iter().cloned(),
                    ),
                }
            }
            s.unwritten
                .push_back((sequence, Unwritten::new(body, recorded_at_ms)));
            Ok((sequence, loc.end()))
        })
    }

    /// Whether the session is quiet (tests).
    #[cfg(test)]
    fn is_quiet(&self, session: &SessionId) -> bool {
        matches!(
            self.shared.sessions.read().map.get(session),
            Some(Entry::Quiet { .. })
        )
    }

    /// Where a record's frame is: the segment file and the frame's offset (tests corrupt it).
    #[cfg(test)]
    fn locate(&self, session: &SessionId, sequence: u64) -> (PathBuf, u64) {
        let arc = self.shared.lookup(session).unwrap();
        let loc = arc.lock().locs[usize::try_from(sequence - 1).unwrap()];
        (segment::path(&self.shared.dir, loc.segment()), loc.offset())
    }
}

impl Drop for DiskJournal {
    fn drop(&mut self) {
        // The writer flushes what is queued, runs its callbacks and ends.
        self.shared.log.lock().closed = true;
        self.shared.signal.lock().close = true;
        self.shared.wake.notify_one();
        if let Some(writer) = self.writer.take() {
            if writer.thread().id() == thread::current().id() {
                // Dropped by a callback running on the writer: it ends on its own.
                return;
            }
            if writer.join().is_err() {
                log::error!("journal: the writer thread panicked");
            }
        }
    }
}

/// How an appended record changes a loaded session's projections.
#[derive(Clone, Copy)]
enum Projected<'a> {
    /// As [`apply`] reads the record.
    Record(&'a NewRecord),
    /// A `transcript_delta`, from its messages as they are (no `Value` tree of them).
    TranscriptDelta { keep: usize, append: &'a [Message] },
}

impl Journal for DiskJournal {
    fn sync(&self) -> Result<(), JournalError> {
        DiskJournal::sync(self)
    }

    fn create(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        if record.kind != RecordKind::SessionCreated {
            return Err(JournalError::Failed(format!(
                "session {session}: the first record must be session_created, not {}",
                record.kind
            )));
        }
        let shared = &self.shared;
        shared.check_writable()?;
        let body = frame::encode_body(&record).map_err(JournalError::Failed)?;
        let arc = {
            let mut sessions = shared.sessions.write();
            if sessions.map.contains_key(session) {
                return Err(JournalError::AlreadyExists(session.clone()));
            }
            let recorded_at_ms = now_ms();
            let bytes = frame::encode(
                &Address {
                    frame_type: FrameType::Record,
                    session: session.clone(),
                    sequence: 1,
                    recorded_at_ms,
                },
                &body,
            );
            let loc = shared.place(bytes, Placement::Record)?;
            let mut loaded = Loaded::default();
            loaded.apply(session, 1, &record, true);
            shared.loaded_count.fetch_add(1, Ordering::Relaxed);
            let arc = Arc::new(Mutex::new(Session {
                id: session.clone(),
                locs: vec![loc],
                last_stamp: recorded_at_ms,
                unwritten: VecDeque::from([(1, Unwritten::new(body, recorded_at_ms))]),
                loaded: Some(Box::new(loaded)),
                refused: None,
                deleted: false,
            }));
            sessions
                .map
                .insert(session.clone(), Entry::Live(arc.clone()));
            arc
        };
        shared.wake_writer();
        shared.note_loaded(arc);
        Ok(1)
    }

    fn append(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        let (sequence, _) = self.place_record(session, record)?;
        self.shared.wake_writer();
        Ok(sequence)
    }

    fn append_durable(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        let (sequence, end) = self.place_record(session, record)?;
        self.shared.flush_through(end)?;
        Ok(sequence)
    }

    fn append_transcript_durable(
        &self,
        session: &SessionId,
        keep: usize,
        append: &[Message],
    ) -> Result<u64, JournalError> {
        let (sequence, end) = self.place_transcript(session, keep, append)?;
        self.shared.flush_through(end)?;
        Ok(sequence)
    }

    fn append_transcript(
        &self,
        session: &SessionId,
        keep: usize,
        append: &[Message],
    ) -> Result<u64, JournalError> {
        let (sequence, _) = self.place_transcript(session, keep, append)?;
        self.shared.wake_writer();
        Ok(sequence)
    }

    fn append_effect_then(
        &self,
        session: &SessionId,
        record: EffectRecord,
        done: AppendedCallback,
    ) {
        match self.place_effect(session, &record) {
            Ok((sequence, end)) => self.shared.flush_then(
                end,
                Box::new(move |durable| done(durable.map(|()| sequence))),
            ),
            Err(error) => done(Err(error)),
        }
    }

    fn append_effect_queued(
        &self,
        session: &SessionId,
        record: EffectRecord,
        done: AppendedCallback,
    ) {
        match self.place_effect(session, &record) {
            Ok((sequence, end)) => {
                self.shared.register(
                    end,
                    Box::new(move |durable| done(durable.map(|()| sequence))),
                );
                self.shared.wake_writer();
            }
            Err(error) => done(Err(error)),
        }
    }

    fn place_effect_if_idle(
        &self,
        session: &SessionId,
        record: EffectRecord,
    ) -> Result<IdlePlacement, JournalError> {
        if !self.shared.is_idle() {
            return Ok(IdlePlacement::Busy(record));
        }
        // The journal may get busy before the frame is placed: then the flush of the placed
        // record hands off to the writer (see `Shared::flush_through`), which is only slower.
        let (sequence, end) = self.place_effect(session, &record)?;
        Ok(IdlePlacement::Placed(Placed { sequence, end }))
    }

    fn flush_placed(&self, placed: &Placed) -> Result<(), JournalError> {
        self.shared.flush_through(placed.end)
    }

    fn on_durable(&self, session: &SessionId, sequence: u64, done: DurableCallback) {
        if self.shared.read_only {
            return run_callback(done, Err(read_only()));
        }
        let end = self.shared.with_session(session, |s| {
            if sequence == 0 {
                return Ok(0);
            }
            usize::try_from(sequence - 1)
                .ok()
                .and_then(|index| s.locs.get(index))
                .map(|loc| loc.end())
                .ok_or_else(|| {
                    JournalError::Failed(format!(
                        "session {session}: record {sequence} was never appended (last is {})",
                        s.locs.len()
                    ))
                })
        });
        match end {
            Ok(end) => self.shared.register(end, done),
            Err(error) => run_callback(done, Err(error)),
        }
    }

    fn read(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, JournalError> {
        let shared = &self.shared;
        // A quiet session is read without waking it: listing sessions at start reads the first
        // record of each, and a passivated session's events may be read at any time.
        if let Some(places) = shared.quiet_places(session, after, limit) {
            let events = places
                .into_iter()
                .map(|(sequence, loc)| {
                    shared
                        .fetch_written(session, sequence, loc)
                        .map(|stored| stored.event(sequence))
                })
                .collect();
            // A damaged frame must make the session unreadable: the live path below records it.
            if !matches!(events, Err(JournalError::Corrupt { .. })) {
                return events;
            }
        }
        shared.with_session(session, |s| {
            let last = s.locs.len() as u64;
            let start = after.min(last);
            let count = (last - start).min(u64::try_from(limit).unwrap_or(u64::MAX));
            (start + 1..=start + count)
                .map(|sequence| {
                    shared
                        .fetch(s, sequence)
                        .map(|stored| stored.event(sequence))
                })
                .collect()
        })
    }

    fn pending_events(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, JournalError> {
        let shared = &self.shared;
        shared.with_session(session, |s| {
            let loaded = shared.ensure_loaded(s)?;
            let start = loaded.pending.partition_point(|&q| q <= after);
            let wanted: Vec<u64> = loaded.pending[start..]
                .iter()
                .take(limit)
                .copied()
                .collect();
            wanted
                .into_iter()
                .map(|sequence| {
                    shared
                        .fetch(s, sequence)
                        .map(|stored| stored.emitted(session, sequence))
                })
                .collect()
        })
    }

    fn view(&self, session: &SessionId) -> Result<SessionView, JournalError> {
        let shared = &self.shared;
        shared.with_session(session, |s| Ok(shared.ensure_loaded(s)?.view.clone()))
    }

    fn inspect(
        &self,
        session: &SessionId,
        inspect: &mut dyn FnMut(&SessionView),
    ) -> Result<(), JournalError> {
        let shared = &self.shared;
        shared.with_session(session, |s| {
            inspect(&shared.ensure_loaded(s)?.view);
            Ok(())
        })
    }

    fn kv_get(&self, session: &SessionId, key: &str) -> Result<Option<Value>, JournalError> {
        let shared = &self.shared;
        shared.with_session(session, |s| {
            Ok(shared.ensure_loaded(s)?.view.kv.get(key).cloned())
        })
    }

    fn kv_get_cached(
        &self,
        session: &SessionId,
        key: &str,
    ) -> Option<Result<Option<Value>, JournalError>> {
        let cached = self.shared.with_session(session, |s| {
            Ok(s.loaded
                .as_deref()
                .map(|loaded| loaded.view.kv.get(key).cloned()))
        });
        match cached {
            Ok(None) => None,
            Ok(Some(value)) => Some(Ok(value)),
            Err(error) => Some(Err(error)),
        }
    }

    /// Drops the projections and the copies of written records and, when every record is
    /// written and nobody else is using the session, makes it quiet: its places move into the
    /// journal's one shared list and it keeps no allocation of its own. Otherwise (records not
    /// yet written, which cannot be read back yet; an unreadable session, which keeps its
    /// refusal) it stays live, trimmed.
    fn release(&self, session: &SessionId) {
        let shared = &self.shared;
        let arc = match shared.sessions.read().map.get(session) {
            Some(Entry::Live(arc)) => arc.clone(),
            Some(Entry::Quiet { .. }) | None => return,
        };
        let mut s = arc.lock();
        if s.deleted {
            return;
        }
        shared.prune(&mut s);
        shared.unload(&mut s);
        if s.refused.is_some() || !s.unwritten.is_empty() {
            s.unwritten.shrink_to_fit();
            s.locs.shrink_to_fit();
            return;
        }
        shared
            .loaded
            .lock()
            .retain(|queued| !Arc::ptr_eq(queued, &arc));
        // The session's lock, then the map's, as `delete` takes them.
        let mut sessions = shared.sessions.write();
        // Only the map and this call hold it: a thread that looked it up and waits for its lock
        // must find it in the map still, or its record would go to a copy nobody reads.
        if Arc::strong_count(&arc) > 2 {
            return;
        }
        debug_assert!(
            matches!(sessions.map.get(session), Some(Entry::Live(a)) if Arc::ptr_eq(a, &arc))
        );
        sessions.quiet(session, &s.locs, s.last_stamp);
    }

    fn delete(&self, session: &SessionId) -> Result<(), JournalError> {
        let shared = &self.shared;
        shared.check_writable()?;
        // The session's lock first (it may be busy reading from disk), then the map's, only for
        // as long as it takes to place the tombstone: a `create` of the same id waits for the
        // map, so its first record lands after the tombstone.
        loop {
            let arc = shared.lookup(session)?;
            let mut s = arc.lock();
            if s.deleted {
                // Deleted meanwhile (and perhaps created again): look again.
                continue;
            }
            let bytes = frame::encode(
                &Address {
                    frame_type: FrameType::Tombstone,
                    session: session.clone(),
                    sequence: s.locs.len() as u64,
                    recorded_at_ms: now_ms().max(s.last_stamp),
                },
                &[],
            );
            {
                let mut sessions = shared.sessions.write();
                shared.place(bytes, Placement::Tombstone(&s.locs))?;
                // Only `delete` removes an entry, and it holds the session's lock to do so: the
                // entry is still this session's.
                debug_assert!(
                    matches!(sessions.map.get(session), Some(Entry::Live(a)) if Arc::ptr_eq(a, &arc))
                );
                sessions.map.remove(session);
            }
            s.deleted = true;
            s.locs = Vec::new();
            s.unwritten = VecDeque::new();
            s.refused = None;
            shared.unload(&mut s);
            drop(s);
            shared.wake_writer();
            return Ok(());
        }
    }

    fn sessions(&self) -> Result<Vec<SessionId>, JournalError> {
        let mut ids: Vec<SessionId> = self.shared.sessions.read().map.keys().cloned().collect();
        ids.sort();
        Ok(ids)
    }

    fn failure(&self) -> Option<String> {
        let shared = &self.shared;
        if !shared.failed.load(Ordering::Acquire) {
            return None;
        }
        // `fail` sets the flag and records the reason under this lock.
        Some(
            shared
                .waiters
                .lock()
                .failed
                .clone()
                .unwrap_or_else(|| "a write or flush failed".to_owned()),
        )
    }
}

impl Shared {
    /// The shared state of a journal in `dir` whose segments `ids` recovery found as
    /// `recovered`, appending to `current`.
    fn new(
        dir: &Path,
        options: DiskJournalOptions,
        ids: &[u32],
        recovered: recover::Recovered,
        current: Option<Current>,
        read_only: bool,
    ) -> Shared {
        let (segment, offset) = match recovered.tail {
            Tail::Append { segment, end } => (segment, u64::from(end)),
            Tail::Fresh { segment } => (segment, SEGMENT_HEADER_LEN),
        };
        let refused = recovered
            .sessions
            .values()
            .filter(|s| s.refused.is_some())
            .count();
        // Every readable session starts quiet: nothing of it is in memory but its places.
        let mut sessions = Sessions::default();
        sessions.quiet_locs.reserve_exact(
            recovered
                .sessions
                .values()
                .filter(|found| found.refused.is_none())
                .map(|found| found.locs.len())
                .sum(),
        );
        for (id, found) in recovered.sessions {
            if found.refused.is_none() {
                sessions.quiet(&id, &found.locs, found.last_stamp);
                continue;
            }
            let session = Session {
                id: id.clone(),
                locs: found.locs,
                last_stamp: found.last_stamp,
                unwritten: VecDeque::new(),
                loaded: None,
                refused: found.refused,
                deleted: false,
            };
            sessions
                .map
                .insert(id, Entry::Live(Arc::new(Mutex::new(session))));
        }
        log::info!(
            "journal: opened {}{} ({} sessions, {refused} of them unreadable, {} segments)",
            dir.display(),
            if read_only { " read-only" } else { "" },
            sessions.map.len(),
            ids.len()
        );
        Shared {
            dir: dir.to_path_buf(),
            options,
            read_only,
            sessions: RwLock::new(sessions),
            log: Mutex::new(Log {
                segment,
                offset,
                last_end: recovered.end,
                table: recovered.table,
                queue: Vec::new(),
                closed: false,
            }),
            flusher: Mutex::new(Flusher {
                current,
                spare: Vec::new(),
                buffer: Vec::new(),
            }),
            signal: Mutex::new(Signal::default()),
            wake: Condvar::new(),
            written: AtomicU64::new(recovered.end),
            durable: AtomicU64::new(recovered.end),
            waiters: Mutex::new(Waiters {
                pending: BTreeMap::new(),
                failed: None,
            }),
            failed: AtomicBool::new(false),
            readers: Mutex::new(Vec::new()),
            loaded: Mutex::new(VecDeque::new()),
            loaded_count: AtomicUsize::new(0),
            counters: Counters::default(),
        }
    }

    /// Refuses a write: on a read-only journal, or once the journal failed.
    fn check_writable(&self) -> Result<(), JournalError> {
        if self.read_only {
            return Err(read_only());
        }
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let why = self.waiters.lock().failed.clone().unwrap_or_default();
        Err(JournalError::Failed(why))
    }

    /// The sequences and places of the records [`Journal::read`] would return, if the session
    /// is quiet (copied under the map's read lock: a quiet session's places never change). The
    /// records are then read without any lock, so a read racing with the session's delete and a
    /// compaction may fail to find a removed segment rather than return the records.
    fn quiet_places(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Option<Vec<(u64, Loc)>> {
        let sessions = self.sessions.read();
        let Some(&Entry::Quiet { start, len, .. }) = sessions.map.get(session) else {
            return None;
        };
        let last = len as u64;
        let first = after.min(last);
        let count = (last - first).min(u64::try_from(limit).unwrap_or(u64::MAX));
        Some(
            (first + 1..=first + count)
                .map(|sequence| (sequence, sessions.quiet_locs[start + sequence as usize - 1]))
                .collect(),
        )
    }

    /// The session's state (woken, under the map's write lock, if it is quiet), or
    /// `UnknownSession`. The map lock is released before returning.
    fn lookup(&self, session: &SessionId) -> Result<Arc<Mutex<Session>>, JournalError> {
        if let Some(Entry::Live(arc)) = self.sessions.read().map.get(session) {
            return Ok(arc.clone());
        }
        self.sessions
            .write()
            .wake(session)
            .ok_or_else(|| JournalError::UnknownSession(session.clone()))
    }

    /// Runs `f` on the session, locked, refusing a deleted or unreadable one. A corruption `f`
    /// finds makes the session unreadable from then on.
    fn with_session<T>(
        &self,
        session: &SessionId,
        f: impl FnOnce(&mut Session) -> Result<T, JournalError>,
    ) -> Result<T, JournalError> {
        let arc = self.lookup(session)?;
        let (result, newly_loaded) = {
            let mut s = arc.lock();
            if s.deleted {
                return Err(JournalError::UnknownSession(session.clone()));
            }
            if let Some(refused) = &s.refused {
                return Err(refused.clone());
            }
            self.prune(&mut s);
            let was_loaded = s.loaded.is_some();
            let result = f(&mut s);
            if let Err(error @ JournalError::Corrupt { .. }) = &result {
                log::error!("journal: session {session} is unreadable from now on: {error}");
                s.refused = Some(error.clone());
                self.unload(&mut s);
            }
            (result, !was_loaded && s.loaded.is_some())
        };
        if newly_loaded {
            self.note_loaded(arc);
        }
        result
    }

    /// Forgets the cached copies of records that are written (they are read from disk now).
    fn prune(&self, s: &mut Session) {
        let written = self.written.load(Ordering::Acquire);
        while let Some(&(sequence, _)) = s.unwritten.front() {
            let is_written = usize::try_from(sequence.saturating_sub(1))
                .ok()
                .and_then(|index| s.locs.get(index))
                .is_some_and(|loc| loc.end() <= written);
            if !is_written {
                break;
            }
            s.unwritten.pop_front();
        }
    }

    /// The record with `sequence` (which exists) of the session, from memory or from disk.
    fn fetch(&self, s: &Session, sequence: u64) -> Result<Stored, JournalError> {
        if let Some(&(first, _)) = s.unwritten.front()
            && sequence >= first
            && let Some((_, unwritten)) = usize::try_from(sequence - first)
                .ok()
                .and_then(|index| s.unwritten.get(index))
        {
            let record = frame::decode_body(&unwritten.body).map_err(|why| {
                JournalError::Failed(format!(
                    "session {}: record {sequence}, not yet written, does not decode: {why}",
                    s.id
                ))
            })?;
            return Ok(Stored {
                record,
                recorded_at_ms: unwritten.recorded_at_ms,
            });
        }
        let loc = usize::try_from(sequence.saturating_sub(1))
            .ok()
            .and_then(|index| s.locs.get(index))
            .copied()
            .ok_or_else(|| {
                JournalError::Failed(format!("session {}: no record {sequence}", s.id))
            })?;
        self.fetch_written(&s.id, sequence, loc)
    }

    /// The record with `sequence` of `session`, written at `loc`, from disk.
    fn fetch_written(
        &self,
        session: &SessionId,
        sequence: u64,
        loc: Loc,
    ) -> Result<Stored, JournalError> {
        let path = segment::path(&self.dir, loc.segment());
        let corrupt = |why: String| JournalError::Corrupt {
            file: path.clone(),
            offset: loc.offset(),
            why: format!("record {sequence} of session {session}: {why}"),
        };
        let bytes = self.read_frame(loc, &path)?;
        let (address, body) = frame::decode(&bytes).map_err(corrupt)?;
        if address.frame_type != FrameType::Record
            || address.session != *session
            || address.sequence != sequence
        {
            return Err(corrupt(format!(
                "the frame holds {:?} {} of session {}",
                address.frame_type, address.sequence, address.session
            )));
        }
        let record = frame::decode_body(body).map_err(corrupt)?;
        Ok(Stored {
            record,
            recorded_at_ms: address.recorded_at_ms,
        })
    }

    /// The bytes of one frame.
    fn read_frame(&self, loc: Loc, path: &Path) -> Result<Vec<u8>, JournalError> {
        let file = self.reader(loc.segment(), path)?;
        let mut bytes = vec![0u8; loc.len as usize];
        file.read_exact_at(&mut bytes, loc.offset()).map_err(|e| {
            JournalError::Failed(format!(
                "reading {} at offset {}: {e}",
                path.display(),
                loc.offset()
            ))
        })?;
        Ok(bytes)
    }

    /// A read-only descriptor of segment `id`, from the cache or newly opened.
    fn reader(&self, id: u32, path: &Path) -> Result<Arc<File>, JournalError> {
        {
            let mut readers = self.readers.lock();
            if let Some(index) = readers.iter().position(|(segment, _)| *segment == id) {
                let entry = readers.remove(index);
                let file = entry.1.clone();
                readers.insert(0, entry);
                return Ok(file);
            }
        }
        let file = Arc::new(File::open(path).map_err(|e| io_failure("opening", path, &e))?);
        let mut readers = self.readers.lock();
        readers.insert(0, (id, file.clone()));
        readers.truncate(self.options.read_descriptors);
        Ok(file)
    }

    fn forget_reader(&self, id: u32) {
        self.readers.lock().retain(|(segment, _)| *segment != id);
    }

    /// The session's projections, built from its records if they are not in memory.
    fn ensure_loaded<'a>(&self, s: &'a mut Session) -> Result<&'a mut Loaded, JournalError> {
        if s.loaded.is_none() {
            let mut loaded = Loaded::default();
            for sequence in 1..=s.locs.len() as u64 {
                let stored = self.fetch(s, sequence)?;
                loaded.apply(&s.id, sequence, &stored.record, false);
            }
            s.loaded = Some(Box::new(loaded));
            self.loaded_count.fetch_add(1, Ordering::Relaxed);
        }
        s.loaded
            .as_deref_mut()
            .ok_or_else(|| JournalError::Failed(format!("session {}: projections vanished", s.id)))
    }

    /// Drops the session's projections, if they are in memory.
    fn unload(&self, s: &mut Session) {
        if s.loaded.take().is_some() {
            self.loaded_count.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Remembers that `arc` was just loaded, and evicts the projections of the least recently
    /// loaded sessions beyond the limit (skipping those in use right now).
    fn note_loaded(&self, arc: Arc<Mutex<Session>>) {
        let mut queue = self.loaded.lock();
        queue.push_back(arc);
        let mut budget = queue.len();
        while queue.len() > self.options.max_loaded_sessions && budget > 0 {
            budget -= 1;
            let Some(oldest) = queue.pop_front() else {
                break;
            };
            // `try_lock` never waits, so holding the queue here cannot deadlock.
            let evicted = match oldest.try_lock() {
                Some(mut s) => {
                    self.unload(&mut s);
                    true
                }
                None => false,
            };
            if !evicted {
                queue.push_back(oldest);
            }
        }
    }

    /// Places a frame in the log and queues it for a flusher; returns where it is. Nobody is
    /// woken: the caller flushes, or wakes the writer.
    fn place(&self, bytes: Vec<u8>, placement: Placement<'_>) -> Result<Loc, JournalError> {
        let len = bytes.len() as u64;
        let len32 = u32::try_from(len)
            .map_err(|_| JournalError::Failed(format!("a frame of {len} bytes")))?;
        let mut log = self.log.lock();
        let (mut segment, mut offset) = (log.segment, log.offset);
        if offset > SEGMENT_HEADER_LEN && offset + len > self.options.segment_size {
            segment = segment.checked_add(1).ok_or_else(|| {
                JournalError::Failed("the journal has used every segment id".to_owned())
            })?;
            offset = SEGMENT_HEADER_LEN;
        }
        // Segments hold at most MAX_SEGMENT_SIZE plus one frame: far below 4 GiB.
        let offset32 = u32::try_from(offset)
            .map_err(|_| JournalError::Failed(format!("a segment offset of {offset}")))?;
        let loc = Loc {
            pos: segment::position(segment, offset32),
            len: len32,
        };
        if log.closed {
            return Err(JournalError::Failed("the journal is closed".to_owned()));
        }
        log.queue.push(Job {
            pos: loc.pos,
            bytes,
        });
        log.segment = segment;
        log.offset = offset + len;
        log.last_end = loc.end();
        match placement {
            Placement::Record => log.table.add_record(loc),
            Placement::Tombstone(victims) => log.table.kill(victims, loc),
        }
        Ok(loc)
    }

    /// Calls `done` once everything up to `end` is durable (inline if it is, or if the journal
    /// failed).
    fn register(&self, end: u64, done: DurableCallback) {
        if end <= self.durable.load(Ordering::Acquire) {
            return run_callback(done, Ok(()));
        }
        let mut waiters = self.waiters.lock();
        let result = if end <= self.durable.load(Ordering::Acquire) {
            Ok(())
        } else if let Some(why) = &waiters.failed {
            Err(JournalError::Failed(why.clone()))
        } else {
            waiters.pending.entry(end).or_default().push(done);
            return;
        };
        drop(waiters);
        run_callback(done, result);
    }

    /// Everything up to `position` is durable: returns the callbacks waiting for it, for the
    /// caller to run once it holds no lock.
    fn made_durable(&self, position: u64) -> Due {
        let mut waiters = self.waiters.lock();
        self.durable.store(position, Ordering::Release);
        let later = waiters.pending.split_off(&position.saturating_add(1));
        std::mem::replace(&mut waiters.pending, later)
    }

    /// Whether no frame waits to be written and nobody is flushing. (A read-only journal counts
    /// as idle: placing refuses it, as every append does.)
    fn is_idle(&self) -> bool {
        self.log.lock().queue.is_empty() && !self.flusher.is_locked()
    }

    /// Asks the writer thread to flush what is queued: for frames whose appender does not flush
    /// them itself.
    fn wake_writer(&self) {
        self.signal.lock().flush = true;
        self.wake.notify_one();
    }

    /// Blocks until everything up to `end` is durable, flushing on this thread if its frame is
    /// alone (see [`Shared::flush_or_hand_off`]).
    fn flush_through(&self, end: u64) -> Result<(), JournalError> {
        self.flush_or_hand_off();
        if end <= self.durable.load(Ordering::Acquire) {
            return Ok(());
        }
        // Another thread is flushing; it looks at the queue again when it is done, or the
        // writer was woken.
        let (promise, expected) = crate::handoff::oneshot();
        self.register(end, Box::new(move |result| promise.deliver(result)));
        expected.wait().unwrap_or_else(|| {
            Err(JournalError::Failed(
                "the journal dropped a durability callback".to_owned(),
            ))
        })
    }

    /// Calls `done` once everything up to `end` is durable, flushing on this thread if its
    /// frame is alone (then `done` runs here), and otherwise leaving it to the writer thread or
    /// to the thread that is flushing: this thread never waits.
    fn flush_then(&self, end: u64, done: DurableCallback) {
        self.register(end, done);
        self.flush_or_hand_off();
    }

    /// Gets the frames queued so far flushed. A frame queued alone is flushed on this thread if
    /// nobody else is flushing: at one record in flight that costs one write and one `fdatasync`
    /// here, with no hand-off to another thread and back. When other frames wait too, the writer
    /// thread is woken to carry the batch and this thread goes back to its own work: under load
    /// one thread flushes batch after batch, while the threads that append keep appending, and
    /// the batches grow with the load (group commit). Letting each appender flush whenever the
    /// flusher was free instead spread the flushes over the callback threads, each of which then
    /// slept in `fdatasync` and ran the batch's callbacks; durable model callbacks at 64
    /// sessions were about 15 % slower that way (docs/BENCHMARKS.md).
    fn flush_or_hand_off(&self) {
        let alone = self.log.lock().queue.len() <= 1;
        if !alone || self.try_flush() {
            self.wake_writer();
        }
    }

    /// Flushes what is queued, unless another thread is flushing; returns whether more frames
    /// were queued meanwhile. Whoever flushes looks at the queue after letting go of the
    /// flusher and, if it is not empty, flushes again (the writer thread) or wakes the writer
    /// (anyone else): every queued frame is flushed by somebody, and nobody waits for the
    /// flusher.
    fn try_flush(&self) -> bool {
        let Some(mut flusher) = self.flusher.try_lock() else {
            return false;
        };
        let flushed = self.flush_batch(&mut flusher);
        drop(flusher);
        match flushed {
            Ok(due) => {
                for done in due.into_values().flatten() {
                    run_callback(done, Ok(()));
                }
            }
            Err(why) => self.fail(why),
        }
        !self.log.lock().queue.is_empty()
    }

    /// Writes every queued frame, in log order, and those queued while it writes, flushing each
    /// segment it finishes; then flushes once for all of them. Returns the callbacks that became
    /// due. Once the journal failed it only drops the queue (its waiters were failed).
    fn flush_batch(&self, flusher: &mut Flusher) -> Result<Due, String> {
        if self.failed.load(Ordering::Acquire) {
            self.log.lock().queue.clear();
            return Ok(Due::new());
        }
        let Flusher {
            current,
            spare,
            buffer,
        } = flusher;
        let mut frames = 0u64;
        loop {
            std::mem::swap(&mut self.log.lock().queue, spare);
            if spare.is_empty() {
                break;
            }
            for job in spare.drain(..) {
                let segment = position_segment(job.pos);
                let offset = job.pos & 0xFFFF_FFFF;
                let target = match current {
                    Some(c) if c.id == segment => c,
                    _ => {
                        if let Some(old) = current.as_mut() {
                            write_out(self, old, buffer)?;
                            seal(self, old)?;
                            flush(self, old)?;
                        }
                        let created = current.insert(create_segment(self, segment)?);
                        buffer.extend_from_slice(&frame::segment_header());
                        created
                    }
                };
                let expected = target.end + buffer.len() as u64;
                if offset != expected {
                    return Err(format!(
                        "internal error: a frame placed at offset {offset} of segment {segment} \
                         where {expected} was next"
                    ));
                }
                buffer.extend_from_slice(&job.bytes);
                frames += 1;
                if buffer.len() >= WRITE_CHUNK {
                    write_out(self, target, buffer)?;
                }
            }
            if let Some(target) = current.as_mut() {
                write_out(self, target, buffer)?;
            }
        }
        let Some(target) = current.as_mut().filter(|_| frames > 0) else {
            return Ok(Due::new());
        };
        self.counters.records.fetch_add(frames, Ordering::Relaxed);
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        let position = flush(self, target)?;
        Ok(self.made_durable(position))
    }

    /// The journal failed: nothing more becomes durable. Fails every waiting callback.
    fn fail(&self, why: String) {
        log::error!(
            "journal failed: {why}; no record will be made durable any more (restart Brain)"
        );
        let (ready, why) = {
            let mut waiters = self.waiters.lock();
            self.failed.store(true, Ordering::Release);
            let why = waiters.failed.get_or_insert(why).clone();
            (std::mem::take(&mut waiters.pending), why)
        };
        for done in ready.into_values().flatten() {
            run_callback(done, Err(JournalError::Failed(why.clone())));
        }
    }
}

impl Loaded {
    /// Applies one record to the projections (logging malformed data when it is new).
    fn apply(&mut self, session: &SessionId, sequence: u64, record: &NewRecord, new: bool) {
        if let Err(why) = apply(&mut self.view, sequence, record) {
            if new {
                log::warn!(
                    "journal: session {session} record {sequence} ({}): projection skipped: {why}",
                    record.kind
                );
            } else {
                log::debug!(
                    "journal: session {session} record {sequence} ({}): projection skipped: {why}",
                    record.kind
                );
            }
        }
        if record.kind == RecordKind::EventEmitted
            && record.origin.map(|o| o.kind) != Some(OriginKind::Agentloop)
        {
            self.pending.push(sequence);
        }
    }
}

impl Stored {
    /// The record as [`Journal::read`] gives it.
    fn event(&self, sequence: u64) -> Event {
        Event {
            sequence,
            event_type: self.record.kind.as_str().to_owned(),
            recorded_at_ms: self.recorded_at_ms,
            data: self.record.data.clone(),
            origin: self.record.origin,
        }
    }

    /// An `event_emitted` record as [`Journal::pending_events`] gives it.
    fn emitted(&self, session: &SessionId, sequence: u64) -> Event {
        match self.record.data.get("type").and_then(Value::as_str) {
            Some(event_type) => Event {
                sequence,
                event_type: event_type.to_owned(),
                recorded_at_ms: self.recorded_at_ms,
                data: self.record.data.get("data").cloned().unwrap_or(Value::Null),
                origin: self.record.origin,
            },
            None => {
                log::warn!(
                    "journal: session {session} record {sequence}: event_emitted data has no string `type`"
                );
                self.event(sequence)
            }
        }
    }
}

/// The segment the writer is appending to.
struct Current {
    id: u32,
    file: File,
    /// Bytes of header and frames written to it so far.
    end: u64,
    /// The file's length: from `end` to here it holds zeros, written ahead of the frames.
    zeroed: u64,
}

/// The `brain-journal` thread: flushes what plain appends queued, until the journal is dropped
/// (then after a last flush).
fn run_writer(shared: &Shared) {
    loop {
        let close = {
            let mut signal = shared.signal.lock();
            while !signal.flush && !signal.close {
                shared.wake.wait(&mut signal);
            }
            signal.flush = false;
            signal.close
        };
        while shared.try_flush() {}
        if close {
            break;
        }
    }
    // Closed: everything queued was flushed. Nobody can be waiting; if someone is, say so.
    let left = std::mem::take(&mut shared.waiters.lock().pending);
    for done in left.into_values().flatten() {
        run_callback(
            done,
            Err(JournalError::Failed(
                "the journal was closed before the record was durable".to_owned(),
            )),
        );
    }
}

/// Writes the buffer at the segment's end; the frames become readable.
fn write_out(shared: &Shared, target: &mut Current, buffer: &mut Vec<u8>) -> Result<(), String> {
    if buffer.is_empty() {
        return Ok(());
    }
    target.file.write_all_at(buffer, target.end).map_err(|e| {
        format!(
            "writing {} at offset {}: {e}",
            segment::path(&shared.dir, target.id).display(),
            target.end
        )
    })?;
    target.end += buffer.len() as u64;
    shared
        .counters
        .bytes
        .fetch_add(buffer.len() as u64, Ordering::Relaxed);
    buffer.clear();
    zero_ahead(shared, target);
    let end = u32::try_from(target.end).map_err(|_| "a segment beyond 4 GiB".to_owned())?;
    shared
        .written
        .store(segment::position(target.id, end), Ordering::Release);
    Ok(())
}

/// Tops up the zeros past the segment's last frame once fewer than `ZERO_AHEAD - ZERO_STEP`
/// bytes of them are left: up to [`ZERO_AHEAD`] bytes past it (never past the segment size),
/// [`ZERO_STEP`] bytes a write. Best effort: if the disk is full the frames still go in where
/// the zeros reached, and only a failed write of a frame fails the journal.
fn zero_ahead(shared: &Shared, target: &mut Current) {
    let size = shared.options.segment_size;
    if target.zeroed >= (target.end + (ZERO_AHEAD - ZERO_STEP as u64)).min(size) {
        return;
    }
    let want = (target.end + ZERO_AHEAD).min(size);
    let mut at = target.zeroed.max(target.end);
    while at < want {
        // At most ZERO_STEP bytes: fits in usize.
        let len = (want - at).min(ZERO_STEP as u64) as usize;
        if let Err(e) = target.file.write_all_at(&ZEROS[..len], at) {
            log::debug!(
                "journal: writing zeros ahead of the frames of {}: {e}",
                segment::path(&shared.dir, target.id).display()
            );
            // Some may have been written: whatever the file holds past its frames is zeros.
            at = target.file.metadata().map_or(at, |m| m.len().max(at));
            break;
        }
        at += len as u64;
    }
    target.zeroed = at;
}

/// Cuts the zeros written ahead off a segment that is full, so that it ends with its last
/// frame: only the last segment may have a zero tail (recovery calls zeros in any other
/// corruption). The flush that follows makes the new length durable.
fn seal(shared: &Shared, target: &mut Current) -> Result<(), String> {
    if target.zeroed > target.end {
        target.file.set_len(target.end).map_err(|e| {
            format!(
                "truncating {} to its last frame: {e}",
                segment::path(&shared.dir, target.id).display()
            )
        })?;
        target.zeroed = target.end;
    }
    Ok(())
}

/// `fdatasync`s the segment; returns the position up to which the log is now durable.
fn flush(shared: &Shared, target: &mut Current) -> Result<u64, String> {
    target.file.sync_data().map_err(|e| {
        format!(
            "flushing {}: {e}",
            segment::path(&shared.dir, target.id).display()
        )
    })?;
    shared.counters.flushes.fetch_add(1, Ordering::Relaxed);
    let end = u32::try_from(target.end).map_err(|_| "a segment beyond 4 GiB".to_owned())?;
    Ok(segment::position(target.id, end))
}

/// Creates segment `id` (it must not exist) and makes its directory entry durable.
fn create_segment(shared: &Shared, id: u32) -> Result<Current, String> {
    let path = segment::path(&shared.dir, id);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("creating {}: {e}", path.display()))?;
    sync_dir(&shared.dir).map_err(|e| format!("flushing {}: {e}", shared.dir.display()))?;
    shared
        .counters
        .directory_syncs
        .fetch_add(1, Ordering::Relaxed);
    Ok(Current {
        id,
        file,
        end: 0,
        zeroed: 0,
    })
}

/// Runs a durability callback; a panic in it is logged, not spread to the writer.
fn run_callback(done: DurableCallback, result: Result<(), JournalError>) {
    if std::panic::catch_unwind(AssertUnwindSafe(move || done(result))).is_err() {
        log::error!("journal: a durability callback panicked");
    }
}

/// The segment of a position.
fn position_segment(position: u64) -> u32 {
    // The high half of a u64 fits in u32.
    (position >> 32) as u32
}

/// Creates the journal directory if it is missing (mode 0700) and makes that durable; returns
/// whether it did.
fn prepare_dir(dir: &Path) -> Result<bool, JournalError> {
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(false),
        Ok(_) => Err(JournalError::Failed(format!(
            "{} is not a directory",
            dir.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| io_failure("creating", dir, &e))?;
            let parent = match dir.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => parent,
                _ => Path::new("."),
            };
            sync_dir(parent).map_err(|e| io_failure("flushing", parent, &e))?;
            Ok(true)
        }
        Err(e) => Err(io_failure("inspecting", dir, &e)),
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The refusal of a write to a journal opened with [`DiskJournal::open_read_only`].
fn read_only() -> JournalError {
    JournalError::Failed("read-only".to_owned())
}

fn io_failure(what: &str, path: &Path, error: &std::io::Error) -> JournalError {
    JournalError::Failed(format!("{what} {}: {error}", path.display()))
}

/// Wall-clock milliseconds since the Unix epoch (0 for a clock set before it).
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::MemoryJournal;
    use crate::journal::conformance::{TempDir, created, durable, emitted, id, record, sequences};
    use crate::protocol::harness::{ErrorCode, Message, Role};
    use serde_json::json;
    use std::io::{BufRead, BufReader};
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    fn open(dir: &TempDir) -> DiskJournal {
        DiskJournal::open(&dir.path().join("journal")).unwrap()
    }

    fn small() -> DiskJournalOptions {
        DiskJournalOptions {
            segment_size: 1024,
            ..DiskJournalOptions::default()
        }
    }

    fn open_small(dir: &TempDir) -> DiskJournal {
        DiskJournal::open_with(&dir.path().join("journal"), small()).unwrap()
    }

    fn segment_files(dir: &TempDir) -> Vec<PathBuf> {
        segment_files_in(&dir.path().join("journal"))
    }

    /// Where a segment's frames end: before the zeros written ahead of them (a valid frame
    /// never ends with a zero byte).
    fn frames_end(path: &Path) -> u64 {
        let bytes = std::fs::read(path).unwrap();
        bytes
            .iter()
            .rposition(|&b| b != 0)
            .map_or(0, |i| i as u64 + 1)
    }

    fn segment_files_in(dir: &Path) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        files
    }

    fn kv(value: Value) -> NewRecord {
        record(RecordKind::KvSet, json!({"key": "v", "value": value}))
    }

    /// Appends `rounds` activations' worth of every kind of record to `session` of each journal.
    fn workload(journals: &[&dyn Journal], session: &SessionId, rounds: u64) {
        let append = |r: NewRecord| {
            let sequences: Vec<u64> = journals
                .iter()
                .map(|j| j.append(session, r.clone()).unwrap())
                .collect();
            assert!(sequences.windows(2).all(|w| w[0] == w[1]));
            sequences[0]
        };
        for round in 0..rounds {
            let queued = append(record(
                RecordKind::ActivationQueued,
                json!({"input": round}),
            ));
            append(record(
                RecordKind::ActivationStarted,
                json!({"activation": queued}),
            ));
            let model = append(record(RecordKind::ModelCallStarted, json!({})));
            append(record(
                RecordKind::ModelCallFinished,
                json!({"started": model, "result": {"text": format!("answer {round}")}}),
            ));
            let message = Message::text(Role::Assistant, format!("message {round}"));
            append(record(
                RecordKind::TranscriptDelta,
                json!({"keep": round.saturating_sub(1), "append": [message]}),
            ));
            append(record(
                RecordKind::KvSet,
                json!({"key": format!("k{}", round % 3), "value": round}),
            ));
            if round % 4 == 3 {
                append(record(RecordKind::KvDelete, json!({"key": "k0"})));
            }
            append(emitted("client", json!(round), Some(OriginKind::Client)));
            append(emitted("own", json!(round), Some(OriginKind::Agentloop)));
            if round % 5 == 2 {
                append(record(RecordKind::ToolCallStarted, json!({})));
            }
            let outcome = if round % 7 == 6 {
                "failed"
            } else {
                "completed"
            };
            append(record(
                RecordKind::ActivationFinished,
                json!({"activation": queued, "outcome": outcome, "events_through": queued}),
            ));
        }
    }

    /// Everything a reader can see of a session.
    fn snapshot(
        journal: &dyn Journal,
        session: &SessionId,
    ) -> (SessionView, Vec<Event>, Vec<Event>) {
        (
            journal.view(session).unwrap(),
            journal.read(session, 0, usize::MAX).unwrap(),
            journal.pending_events(session, 0, usize::MAX).unwrap(),
        )
    }

    fn corrupt_at(result: Result<impl std::fmt::Debug, JournalError>) -> (PathBuf, u64) {
        match result {
            Err(JournalError::Corrupt { file, offset, why }) => {
                assert!(!why.is_empty());
                (file, offset)
            }
            other => panic!("expected a corruption, got {other:?}"),
        }
    }

    fn flip(path: &Path, offset: u64) {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, offset).unwrap();
        file.write_all_at(&[byte[0] ^ 0x20], offset).unwrap();
    }

    #[test]
    fn reopen_gives_identical_views_and_sequences_continue() {
        let dir = TempDir::new("reopen");
        let memory = MemoryJournal::new();
        let sessions: Vec<SessionId> = (0..5).map(id).collect();
        let before: Vec<_> = {
            let journal = open(&dir);
            for (n, session) in sessions.iter().enumerate() {
                journal.create(session, created()).unwrap();
                memory.create(session, created()).unwrap();
                workload(&[&journal, &memory], session, 10 + n as u64);
            }
            journal.sync().unwrap();
            for session in &sessions {
                assert_eq!(
                    journal.view(session).unwrap(),
                    memory.view(session).unwrap()
                );
            }
            sessions.iter().map(|s| snapshot(&journal, s)).collect()
        };
        let journal = open(&dir);
        assert_eq!(journal.sessions().unwrap(), sessions);
        for (session, expected) in sessions.iter().zip(&before) {
            assert_eq!(&snapshot(&journal, session), expected);
            assert_eq!(
                journal.view(session).unwrap(),
                memory.view(session).unwrap()
            );
            // Everything recovered is durable: the callback runs inline.
            let last = expected.0.last_sequence;
            let ran = Arc::new(AtomicBool::new(false));
            let flag = ran.clone();
            journal.on_durable(
                session,
                last,
                Box::new(move |r| {
                    r.unwrap();
                    flag.store(true, Ordering::SeqCst);
                }),
            );
            assert!(ran.load(Ordering::SeqCst));
            // Sequences and timestamps continue.
            let next = journal.append_durable(session, kv(json!("after"))).unwrap();
            assert_eq!(next, last + 1);
            let events = journal.read(session, last - 1, 2).unwrap();
            assert!(events[0].recorded_at_ms <= events[1].recorded_at_ms);
        }
        drop(journal);
        let journal = open(&dir);
        for (session, expected) in sessions.iter().zip(&before) {
            let events = journal.read(session, 0, usize::MAX).unwrap();
            assert_eq!(events[..events.len() - 1], expected.1[..]);
            assert_eq!(events.last().unwrap().data["value"], json!("after"));
        }
    }

    #[test]
    fn a_torn_tail_is_truncated_and_earlier_records_survive() {
        let dir = TempDir::new("torn");
        let session = id(1);
        let (path, tail_offset, whole) = {
            let journal = open(&dir);
            journal.create(&session, created()).unwrap();
            for n in 0..10 {
                journal.append(&session, kv(json!(n))).unwrap();
            }
            journal.sync().unwrap();
            let (path, offset) = journal.locate(&session, 11);
            (path, offset, snapshot(&journal, &session))
        };
        let len = frames_end(&path);
        // Cut the last frame in its body, then (after recovery) in its fixed part.
        for cut in [len - 7, tail_offset + 5] {
            if cut < std::fs::metadata(&path).unwrap().len() {
                let file = OpenOptions::new().write(true).open(&path).unwrap();
                file.set_len(cut).unwrap();
            }
            let journal = open(&dir);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), tail_offset);
            let events = journal.read(&session, 0, usize::MAX).unwrap();
            assert_eq!(events[..], whole.1[..10]);
            assert_eq!(journal.view(&session).unwrap().last_sequence, 10);
        }
        // The journal goes on from there.
        {
            let journal = open(&dir);
            assert_eq!(
                journal
                    .append_durable(&session, kv(json!("again")))
                    .unwrap(),
                11
            );
        }
        let journal = open(&dir);
        let events = journal.read(&session, 0, usize::MAX).unwrap();
        assert_eq!(sequences(&events), (1..=11).collect::<Vec<_>>());
        assert_eq!(events[10].data["value"], json!("again"));
    }

    #[test]
    fn a_zero_tail_is_where_the_log_ends_and_is_written_over() {
        let dir = TempDir::new("zeros");
        let session = id(1);
        let expected = {
            let journal = open(&dir);
            journal.create(&session, created()).unwrap();
            workload(&[&journal], &session, 3);
            journal.sync().unwrap();
            snapshot(&journal, &session)
        };
        let path = segment_files(&dir).pop().unwrap();
        // The writer wrote zeros ahead of its frames; a crash may also have left the file
        // extended with data that never reached it. Either way the log ends at the last frame.
        let len = std::fs::metadata(&path).unwrap().len() + 8192;
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len)
            .unwrap();
        let more = {
            let journal = open(&dir);
            assert_eq!(
                std::fs::metadata(&path).unwrap().len(),
                len,
                "nothing truncated"
            );
            assert_eq!(snapshot(&journal, &session), expected);
            // Appends go where the frames end, over the zeros.
            journal
                .append_durable(&session, kv(json!("after")))
                .unwrap();
            snapshot(&journal, &session)
        };
        assert_eq!(segment_files(&dir), [path]);
        assert_eq!(snapshot(&open(&dir), &session), more);
    }

    #[test]
    fn the_zeros_ahead_are_topped_up_a_step_at_a_time_and_never_fall_behind() {
        let dir = TempDir::new("zero-steps");
        let journal = open(&dir);
        let session = id(1);
        journal.create(&session, created()).unwrap();
        let mut top_ups = 0;
        let mut last_len = 0;
        for _ in 0..400 {
            journal
                .append_durable(&session, kv(json!("x".repeat(2000))))
                .unwrap();
            let segment = segment_files(&dir).pop().unwrap();
            let len = std::fs::metadata(&segment).unwrap().len();
            let ahead = len - frames_end(&segment);
            assert!(
                (ZERO_AHEAD - ZERO_STEP as u64..=ZERO_AHEAD).contains(&ahead),
                "{ahead} bytes of zeros ahead of the frames"
            );
            if len != last_len {
                assert!(last_len == 0 || len - last_len <= ZERO_STEP as u64 + 4096);
                top_ups += 1;
                last_len = len;
            }
        }
        // ≈ 800 KB of frames: a top-up every ≈ 64 KiB of them, not one per append.
        assert!((8..=20).contains(&top_ups), "{top_ups} top-ups");
    }

    #[test]
    fn the_active_segment_is_zeroed_ahead_and_a_sealed_one_ends_with_its_last_frame() {
        let dir = TempDir::new("zero-ahead");
        let journal = DiskJournal::open_with(
            &dir.path().join("journal"),
            DiskJournalOptions {
                segment_size: 64 << 10,
                ..DiskJournalOptions::default()
            },
        )
        .unwrap();
        let session = id(1);
        journal.create(&session, created()).unwrap();
        journal.sync().unwrap();
        let first = segment_files(&dir).pop().unwrap();
        let frames = journal.stats().bytes;
        assert_eq!(std::fs::metadata(&first).unwrap().len(), 64 << 10);
        assert!(frames < 64 << 10);
        // Fill the first segment until the journal starts a second one.
        while segment_files(&dir).len() == 1 {
            journal
                .append_durable(&session, kv(json!("x".repeat(1000))))
                .unwrap();
        }
        let sealed_len = std::fs::metadata(&first).unwrap().len();
        assert!(sealed_len < 64 << 10, "the sealed segment keeps no zeros");
        let mut last = [0u8];
        File::open(&first)
            .unwrap()
            .read_exact_at(&mut last, sealed_len - 1)
            .unwrap();
        assert_ne!(last[0], 0, "the sealed segment ends with a frame");
        let expected = snapshot(&journal, &session);
        drop(journal);
        assert_eq!(snapshot(&open(&dir), &session), expected);
    }

    #[test]
    fn a_header_torn_at_creation_is_rewritten() {
        let dir = TempDir::new("header");
        let session = id(1);
        {
            let journal = open_small(&dir);
            journal.create(&session, created()).unwrap();
            journal.sync().unwrap();
        }
        // A crash right after the next segment was created, before anything was written to it
        // (the writer had cut the zeros off the full one, as it does before starting the next).
        let full = segment::path(&dir.path().join("journal"), 1);
        let file = OpenOptions::new().write(true).open(&full).unwrap();
        file.set_len(frames_end(&full)).unwrap();
        let next = segment::path(&dir.path().join("journal"), 2);
        std::fs::write(&next, [0u8; 5]).unwrap();
        {
            let journal = open_small(&dir);
            assert_eq!(std::fs::metadata(&next).unwrap().len(), SEGMENT_HEADER_LEN);
            workload(&[&journal], &session, 4);
            journal.sync().unwrap();
        }
        let journal = open_small(&dir);
        assert!(journal.view(&session).unwrap().last_sequence > 30);
    }

    #[test]
    fn a_damaged_body_refuses_exactly_its_session_naming_file_and_offset() {
        let dir = TempDir::new("flip");
        let (a, b) = (id(1), id(2));
        let (path, offset, b_before) = {
            let journal = open(&dir);
            journal.create(&a, created()).unwrap();
            journal.create(&b, created()).unwrap();
            for n in 0..20 {
                journal.append(&a, kv(json!(n))).unwrap();
                journal.append(&b, kv(json!(n))).unwrap();
            }
            journal.sync().unwrap();
            let (path, offset) = journal.locate(&a, 5);
            (path, offset, snapshot(&journal, &b))
        };
        // A byte in the middle of the body of record 5 of session a.
        flip(&path, offset + frame::FRAME_OVERHEAD as u64 + 10);
        for _ in 0..2 {
            let journal = open(&dir);
            assert_eq!(journal.sessions().unwrap(), [a.clone(), b.clone()]);
            assert_eq!(corrupt_at(journal.view(&a)), (path.clone(), offset));
            assert_eq!(corrupt_at(journal.read(&a, 0, 10)), (path.clone(), offset));
            assert_eq!(
                corrupt_at(journal.pending_events(&a, 0, 10)),
                (path.clone(), offset)
            );
            assert_eq!(corrupt_at(journal.kv_get(&a, "v")), (path.clone(), offset));
            assert_eq!(
                corrupt_at(journal.append(&a, kv(json!(1)))),
                (path.clone(), offset)
            );
            assert_eq!(corrupt_at(durable(&journal, &a, 1)), (path.clone(), offset));
            let error = journal.view(&a).unwrap_err();
            assert_eq!(error.code(), ErrorCode::JournalFailed);
            assert!(
                error.to_string().contains(&path.display().to_string()),
                "{error}"
            );
            assert!(matches!(
                journal.create(&a, created()),
                Err(JournalError::AlreadyExists(_))
            ));
            // The other session is whole, and goes on.
            assert_eq!(snapshot(&journal, &b).1[..21], b_before.1[..]);
            journal.append_durable(&b, kv(json!("more"))).unwrap();
        }
        // The damaged session can be deleted; then it is gone, also after reopen.
        let journal = open(&dir);
        journal.delete(&a).unwrap();
        drop(journal);
        let journal = open(&dir);
        assert!(matches!(
            journal.view(&a),
            Err(JournalError::UnknownSession(_))
        ));
        assert_eq!(journal.view(&b).unwrap().last_sequence, 23);
    }

    #[test]
    fn a_damaged_address_refuses_the_sessions_that_may_have_lost_records() {
        let dir = TempDir::new("address");
        let (a, b, c, d, e) = (id(1), id(2), id(3), id(4), id(5));
        let (path, offset, c_before, e_before) = {
            let journal = open_small(&dir);
            // d and e write first; then a and b fill several segments; then e and c.
            for s in [&d, &e] {
                journal.create(s, created()).unwrap();
                journal.append(s, kv(json!("early"))).unwrap();
            }
            journal.create(&a, created()).unwrap();
            journal.create(&b, created()).unwrap();
            for n in 0..30 {
                journal.append(&a, kv(json!(n))).unwrap();
                journal.append(&b, kv(json!(n))).unwrap();
            }
            journal.create(&c, created()).unwrap();
            for n in 0..3 {
                journal.append(&c, kv(json!(n))).unwrap();
                journal.append(&e, kv(json!(n))).unwrap();
            }
            journal.sync().unwrap();
            let (path, offset) = journal.locate(&a, 15);
            let segment_of = |s: &SessionId, q: u64| journal.locate(s, q).0;
            // The damaged frame's segment comes after d's and e's early records and before the
            // later ones, and b has records after it in the same segment.
            assert!(segment_of(&e, 2) < path && path < segment_of(&e, 3));
            assert!(path < segment_of(&c, 1));
            assert_eq!(segment_of(&b, 16), path);
            (path, offset, snapshot(&journal, &c), snapshot(&journal, &e))
        };
        flip(&path, offset + 20); // in the sequence field of the address
        let journal = open_small(&dir);
        // a and b had records in the unreadable rest of the segment; d might have (nothing
        // later proves it did not); c and e are proven whole.
        for lost in [&a, &b, &d] {
            assert_eq!(
                corrupt_at(journal.view(lost)),
                (path.clone(), offset),
                "{lost}"
            );
        }
        assert_eq!(snapshot(&journal, &c), c_before);
        assert_eq!(snapshot(&journal, &e), e_before);
        journal.append_durable(&c, kv(json!("more"))).unwrap();
        // The damaged segment is never compacted, nor rewritten.
        assert_eq!(journal.compact().unwrap().segments_removed, 0);
        assert!(path.exists());
    }

    #[test]
    fn a_damaged_sealed_segment_is_corruption_not_a_torn_tail() {
        let dir = TempDir::new("sealed");
        let session = id(1);
        let first = {
            let journal = open_small(&dir);
            journal.create(&session, created()).unwrap();
            for n in 0..40 {
                journal.append(&session, kv(json!(n))).unwrap();
            }
            journal.sync().unwrap();
            segment_files(&dir)[0].clone()
        };
        assert!(segment_files(&dir).len() > 2);
        let len = std::fs::metadata(&first).unwrap().len();
        OpenOptions::new()
            .write(true)
            .open(&first)
            .unwrap()
            .set_len(len - 10)
            .unwrap();
        let journal = open_small(&dir);
        let (file, _) = corrupt_at(journal.view(&session));
        assert_eq!(file, first);
        // Nothing was truncated.
        assert_eq!(std::fs::metadata(&first).unwrap().len(), len - 10);
    }

    #[test]
    fn records_rotate_across_segments_and_read_back() {
        let dir = TempDir::new("rotate");
        let memory = MemoryJournal::new();
        let sessions: Vec<SessionId> = (0..3).map(id).collect();
        let before: Vec<_> = {
            let journal = open_small(&dir);
            for session in &sessions {
                journal.create(session, created()).unwrap();
                memory.create(session, created()).unwrap();
            }
            for session in &sessions {
                workload(&[&journal, &memory], session, 8);
            }
            // A record larger than a segment gets one of its own.
            let big = kv(json!("x".repeat(3000)));
            journal.append(&sessions[0], big.clone()).unwrap();
            memory.append(&sessions[0], big).unwrap();
            journal.sync().unwrap();
            assert!(journal.stats().segments > 10, "{:?}", journal.stats());
            sessions.iter().map(|s| snapshot(&journal, s)).collect()
        };
        let files = segment_files(&dir);
        assert!(files.len() > 10);
        assert!(
            files
                .iter()
                .all(|f| std::fs::metadata(f).unwrap().len() <= 1024 + 3200)
        );
        let journal = open_small(&dir);
        for (session, expected) in sessions.iter().zip(&before) {
            assert_eq!(&snapshot(&journal, session), expected);
            assert_eq!(
                journal.view(session).unwrap(),
                memory.view(session).unwrap()
            );
        }
    }

    #[test]
    fn deleted_sessions_stay_deleted_and_compaction_removes_their_sealed_segments() {
        let dir = TempDir::new("delete");
        let (x, y) = (id(1), id(2));
        let y_before = {
            let journal = open_small(&dir);
            journal.create(&x, created()).unwrap();
            for n in 0..40 {
                journal.append(&x, kv(json!(n))).unwrap();
            }
            journal.create(&y, created()).unwrap();
            for n in 0..10 {
                journal.append(&y, kv(json!(n))).unwrap();
            }
            journal.sync().unwrap();
            let x_segments = journal.locate(&x, 41).0;
            let files = segment_files(&dir);
            journal.delete(&x).unwrap();
            assert!(matches!(
                journal.view(&x),
                Err(JournalError::UnknownSession(_))
            ));
            // Nothing is reclaimed before the tombstone is durable and its segment sealed...
            journal.sync().unwrap();
            let report = journal.compact().unwrap();
            // ...then every segment that held only x's records is removed.
            let only_x = files.iter().filter(|f| **f < x_segments).count();
            assert!(only_x >= 3, "{files:?}");
            assert_eq!(report.segments_removed, only_x, "{report:?}");
            assert!(report.bytes_reclaimed > 40 * 80);
            assert_eq!(segment_files(&dir).len(), files.len() - only_x);
            assert_eq!(report.segments_kept, segment_files(&dir).len());
            snapshot(&journal, &y)
        };
        {
            let journal = open_small(&dir);
            assert_eq!(journal.sessions().unwrap(), std::slice::from_ref(&y));
            assert!(matches!(
                journal.read(&x, 0, 10),
                Err(JournalError::UnknownSession(_))
            ));
            assert_eq!(snapshot(&journal, &y), y_before);
            assert_eq!(journal.compact().unwrap().segments_removed, 0);
            // The id can be used again; the old records never come back.
            assert_eq!(journal.create(&x, created()).unwrap(), 1);
            journal.append(&x, kv(json!("new"))).unwrap();
        }
        let journal = open_small(&dir);
        let events = journal.read(&x, 0, usize::MAX).unwrap();
        assert_eq!(sequences(&events), [1, 2]);
        assert_eq!(events[1].data["value"], json!("new"));
    }

    #[test]
    fn a_delete_and_a_recreation_before_reopen_keep_their_order() {
        let dir = TempDir::new("recreate");
        let x = id(1);
        {
            let journal = open(&dir);
            journal.create(&x, created()).unwrap();
            journal.append(&x, kv(json!("old"))).unwrap();
            journal.delete(&x).unwrap();
            journal.create(&x, created()).unwrap();
            journal.append(&x, kv(json!("new"))).unwrap();
            journal.delete(&x).unwrap();
            journal.create(&x, created()).unwrap();
        }
        let journal = open(&dir);
        assert_eq!(sequences(&journal.read(&x, 0, 10).unwrap()), [1]);
        assert_eq!(journal.kv_get(&x, "v").unwrap(), None);
    }

    #[test]
    fn concurrent_durable_appends_share_flushes_and_survive_reopen() {
        const THREADS: usize = 8;
        const APPENDS: usize = 500;
        const SESSIONS: usize = 16;
        let dir = TempDir::new("group");
        let sessions: Vec<SessionId> = (0..SESSIONS).map(id).collect();
        let stats = {
            let journal = open(&dir);
            for session in &sessions {
                journal.create(session, created()).unwrap();
            }
            let started = Instant::now();
            std::thread::scope(|scope| {
                for thread in 0..THREADS {
                    let (journal, sessions) = (&journal, &sessions);
                    scope.spawn(move || {
                        for n in 0..APPENDS {
                            let session = &sessions[thread * 2 + n % 2];
                            let value = json!({"thread": thread, "n": n});
                            journal.append_durable(session, kv(value)).unwrap();
                        }
                    });
                }
            });
            let elapsed = started.elapsed();
            let stats = journal.stats();
            eprintln!(
                "group commit: {} durable appends from {THREADS} threads in {elapsed:?}: {} \
                 frames written in {} batches with {} fdatasyncs ({:.1} records per flush)",
                THREADS * APPENDS,
                stats.records,
                stats.batches,
                stats.flushes,
                stats.records as f64 / stats.flushes as f64
            );
            stats
        };
        assert_eq!(stats.records, (THREADS * APPENDS + SESSIONS) as u64);
        assert!(stats.flushes < stats.records, "{stats:?}");
        let journal = open(&dir);
        assert_eq!(journal.sessions().unwrap(), sessions);
        for (index, session) in sessions.iter().enumerate() {
            let events = journal.read(session, 0, usize::MAX).unwrap();
            let per_session = APPENDS / 2;
            assert_eq!(
                sequences(&events),
                (1..=per_session as u64 + 1).collect::<Vec<_>>()
            );
            let ns: Vec<u64> = events[1..]
                .iter()
                .map(|e| {
                    assert_eq!(e.data["value"]["thread"], json!(index / 2));
                    e.data["value"]["n"].as_u64().unwrap()
                })
                .collect();
            let expected: Vec<u64> = (0..APPENDS as u64)
                .filter(|n| n % 2 == (index % 2) as u64)
                .collect();
            assert_eq!(ns, expected);
        }
    }

    #[test]
    fn loaded_projections_are_bounded_and_rebuilt_on_demand() {
        let dir = TempDir::new("evict");
        let options = DiskJournalOptions {
            max_loaded_sessions: 2,
            read_descriptors: 1,
            ..small()
        };
        let journal = DiskJournal::open_with(&dir.path().join("journal"), options).unwrap();
        let memory = MemoryJournal::new();
        let sessions: Vec<SessionId> = (0..10).map(id).collect();
        for session in &sessions {
            journal.create(session, created()).unwrap();
            memory.create(session, created()).unwrap();
        }
        for round in 0..3 {
            for session in &sessions {
                workload(&[&journal, &memory], session, 2);
                assert_eq!(
                    journal.view(session).unwrap(),
                    memory.view(session).unwrap()
                );
                assert_eq!(
                    journal.pending_events(session, 0, 100).unwrap().len(),
                    memory.pending_events(session, 0, 100).unwrap().len(),
                    "{round}"
                );
                assert!(
                    journal.stats().loaded_sessions <= 2,
                    "{:?}",
                    journal.stats()
                );
            }
        }
    }

    #[test]
    fn a_released_session_drops_its_projections_and_reads_back_the_same() {
        let dir = TempDir::new("release");
        let journal = open_small(&dir);
        let memory = MemoryJournal::new();
        let session = id(1);
        journal.create(&session, created()).unwrap();
        memory.create(&session, created()).unwrap();
        workload(&[&journal, &memory], &session, 3);
        journal.view(&session).unwrap();
        assert_eq!(journal.stats().loaded_sessions, 1);
        journal.sync().unwrap();
        let before = journal.read(&session, 0, 1000).unwrap();
        journal.release(&session);
        assert_eq!(journal.stats().loaded_sessions, 0);
        assert!(journal.is_quiet(&session));
        assert_eq!(journal.read(&session, 0, 1000).unwrap(), before);
        assert_eq!(journal.read(&session, 2, 3).unwrap(), before[2..5]);
        assert!(journal.is_quiet(&session), "a read leaves it quiet");
        assert_eq!(
            journal.view(&session).unwrap(),
            memory.view(&session).unwrap()
        );
        assert!(!journal.is_quiet(&session), "a view wakes it");
        // Released at once after an append, perhaps before the record is written: it is kept.
        for n in 0..20 {
            journal.append(&session, kv(json!(n))).unwrap();
            memory.append(&session, kv(json!(n))).unwrap();
            journal.release(&session);
        }
        journal.sync().unwrap();
        journal.release(&session);
        assert!(journal.is_quiet(&session));
        assert_eq!(
            journal.view(&session).unwrap(),
            memory.view(&session).unwrap()
        );
        assert_eq!(
            journal.read(&session, 0, 1000).unwrap().len(),
            before.len() + 20
        );
        assert_eq!(journal.kv_get(&session, "v").unwrap(), Some(json!(19)));
        journal.release(&id(2)); // never created: nothing to do
        assert!(!journal.is_quiet(&id(2)));
        // A quiet session can be deleted, and its id created again.
        let deleted = id(3);
        journal.create(&deleted, created()).unwrap();
        journal.sync().unwrap();
        journal.release(&deleted);
        assert!(journal.is_quiet(&deleted));
        journal.delete(&deleted).unwrap();
        assert!(matches!(
            journal.read(&deleted, 0, 10),
            Err(JournalError::UnknownSession(_))
        ));
        journal.create(&deleted, created()).unwrap();
        assert_eq!(journal.read(&deleted, 0, 10).unwrap().len(), 1);
        drop(journal);
        let reopened = open_small(&dir);
        assert!(
            reopened.is_quiet(&session),
            "recovered sessions start quiet"
        );
        assert_eq!(reopened.read(&session, 0, 1).unwrap().len(), 1);
        assert!(reopened.is_quiet(&session));
        assert_eq!(
            reopened.view(&session).unwrap(),
            memory.view(&session).unwrap()
        );
        assert_eq!(reopened.read(&deleted, 0, 10).unwrap().len(), 1);
    }

    #[test]
    fn releases_racing_with_appends_lose_no_record() {
        let dir = TempDir::new("release-race");
        let journal = Arc::new(open_small(&dir));
        let sessions: Vec<SessionId> = (0..4).map(id).collect();
        for session in &sessions {
            journal.create(session, created()).unwrap();
        }
        let appended = 300u64;
        let stop = Arc::new(AtomicBool::new(false));
        let releaser = {
            let (journal, sessions, stop) = (journal.clone(), sessions.clone(), stop.clone());
            thread::spawn(move || {
                let mut quieted = 0u64;
                while !stop.load(Ordering::Acquire) {
                    for session in &sessions {
                        journal.release(session);
                        quieted += u64::from(journal.is_quiet(session));
                    }
                }
                quieted
            })
        };
        let writers: Vec<_> = sessions
            .iter()
            .map(|session| {
                let (journal, session) = (journal.clone(), session.clone());
                thread::spawn(move || {
                    for n in 0..appended {
                        let sequence = if n % 3 == 0 {
                            journal.append_durable(&session, kv(json!(n))).unwrap()
                        } else {
                            journal.append(&session, kv(json!(n))).unwrap()
                        };
                        assert_eq!(sequence, n + 2);
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.join().unwrap();
        }
        stop.store(true, Ordering::Release);
        let quieted = releaser.join().unwrap();
        assert!(quieted > 0, "the race never made a session quiet");
        journal.sync().unwrap();
        for session in &sessions {
            journal.release(session);
            assert!(journal.is_quiet(session));
        }
        let check = |journal: &DiskJournal| {
            for session in &sessions {
                let events = journal.read(session, 0, 1000).unwrap();
                assert_eq!(events.len() as u64, appended + 1);
                for (n, event) in events.iter().skip(1).enumerate() {
                    assert_eq!(event.sequence, n as u64 + 2);
                    assert_eq!(event.data["value"], json!(n));
                }
            }
        };
        check(&journal);
        let journal = Arc::try_unwrap(journal).ok().unwrap();
        drop(journal);
        check(&open_small(&dir));
    }

    #[test]
    fn a_segment_of_another_format_version_refuses_open() {
        let dir = TempDir::new("version");
        let journal_dir = dir.path().join("journal");
        std::fs::create_dir_all(&journal_dir).unwrap();
        let mut header = frame::segment_header();
        header[8..12].copy_from_slice(&2u32.to_le_bytes());
        let crc = super::super::crc::crc32c(&header[..12]);
        header[12..].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(segment::path(&journal_dir, 1), header).unwrap();
        match DiskJournal::open(&journal_dir) {
            Err(JournalError::Failed(why)) => assert!(why.contains("format version 2"), "{why}"),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("opened a journal of another version"),
        }
    }

    #[test]
    fn the_directory_is_created_private() {
        let dir = TempDir::new("mode");
        let journal_dir = dir.path().join("data").join("journal");
        let journal = DiskJournal::open(&journal_dir).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&journal_dir)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        journal.create(&id(1), created()).unwrap();
        journal.sync().unwrap();
        let stats = journal.stats();
        assert_eq!((stats.records, stats.segments), (1, 1));
        assert!(stats.directory_syncs >= 2, "{stats:?}");
    }

    /// Every file in `dir`, sorted by name, with its size and contents.
    fn files_snapshot(dir: &Path) -> Vec<(PathBuf, u64, Vec<u8>)> {
        segment_files_in(dir)
            .into_iter()
            .map(|path| {
                let size = std::fs::metadata(&path).unwrap().len();
                let bytes = std::fs::read(&path).unwrap();
                (path, size, bytes)
            })
            .collect()
    }

    /// Reads everything a reader can read of every session of `journal`, through the trait.
    fn read_everything(journal: &dyn Journal) {
        for session in journal.sessions().unwrap() {
            snapshot(journal, &session);
            journal.kv_get(&session, "v").unwrap();
        }
    }

    fn assert_read_only<T: std::fmt::Debug>(result: Result<T, JournalError>) {
        match result {
            Err(JournalError::Failed(why)) => assert_eq!(why, "read-only"),
            other => panic!("expected a read-only refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_read_only_open_beside_a_live_journal_sees_the_durable_records_and_writes_nothing() {
        let dir = TempDir::new("read-only");
        let journal_dir = dir.path().join("journal");
        let live = DiskJournal::open_with(&journal_dir, small()).unwrap();
        let (a, b) = (id(1), id(2));
        for session in [&a, &b] {
            live.create(session, created()).unwrap();
            workload(&[&live], session, 3);
        }
        live.sync().unwrap();
        let durable_a = live.view(&a).unwrap().last_sequence;
        // More records for `a`, appended but not waited for: the writer is busy with them, and
        // rotating segments, while the read-only open scans.
        for n in 0..400 {
            live.append(&a, kv(json!(n))).unwrap();
        }

        let reader = DiskJournal::open_read_only(&journal_dir).unwrap();
        assert_eq!(reader.sessions().unwrap(), [a.clone(), b.clone()]);
        // `b` is wholly durable: identical. `a`: at least its durable records, and whatever
        // else was complete at open, as a prefix of the live stream.
        assert_eq!(snapshot(&reader, &b), snapshot(&live, &b));
        let seen = reader.read(&a, 0, usize::MAX).unwrap();
        assert!(
            seen.len() as u64 >= durable_a,
            "{} < {durable_a}",
            seen.len()
        );
        assert_eq!(seen, live.read(&a, 0, seen.len()).unwrap());
        assert_eq!(reader.view(&a).unwrap().last_sequence, seen.len() as u64);
        assert_eq!(reader.read(&a, 2, 3).unwrap(), live.read(&a, 2, 3).unwrap());

        // Every write is refused, and nothing is vouched durable.
        assert_read_only(reader.create(&id(3), created()));
        assert_read_only(reader.append(&a, kv(json!("no"))));
        assert_read_only(reader.delete(&b));
        assert_read_only(reader.compact());
        assert_read_only(durable(&reader, &b, 1));
        reader.sync().unwrap();
        assert_eq!(reader.failure(), None);
        assert_eq!(reader.sessions().unwrap(), [a.clone(), b.clone()]);
        let stats = reader.stats();
        assert_eq!(
            (
                stats.records,
                stats.flushes,
                stats.directory_syncs,
                stats.bytes
            ),
            (0, 0, 0, 0)
        );
        drop(reader);

        // The live journal did not notice.
        live.sync().unwrap();
        let total_a = live.view(&a).unwrap().last_sequence;
        assert_eq!(total_a, durable_a + 400);

        // Quiet now. A frame half written at the tail of the last segment, as the live writer
        // leaves it in the middle of a write: the end of the log, not corruption, and not
        // truncated.
        let last = segment_files_in(&journal_dir).pop().unwrap();
        let frame = frame::encode(
            &Address {
                frame_type: FrameType::Record,
                session: a.clone(),
                sequence: total_a + 1,
                recorded_at_ms: now_ms(),
            },
            &frame::encode_body(&kv(json!("half written"))).unwrap(),
        );
        let end = frames_end(&last);
        let file = OpenOptions::new().write(true).open(&last).unwrap();
        file.write_all_at(&frame[..frame.len() / 2], end).unwrap();
        drop(file);
        let before = files_snapshot(&journal_dir);
        let reader = DiskJournal::open_read_only(&journal_dir).unwrap();
        for session in [&a, &b] {
            assert_eq!(snapshot(&reader, session), snapshot(&live, session));
        }
        read_everything(&reader);
        drop(reader);
        assert_eq!(files_snapshot(&journal_dir), before);
        drop(live);

        // A segment just created by a writer that has not written its header yet: empty, or
        // part of the header (the writer had sealed the one before: no zeros after its last
        // frame). Recovery would repair it; a read-only open reads past it.
        let file = OpenOptions::new().write(true).open(&last).unwrap();
        file.set_len(end).unwrap();
        drop(file);
        let id_last = segment::parse_name(&last.file_name().unwrap().to_string_lossy())
            .unwrap()
            .unwrap();
        let next = segment::path(&journal_dir, id_last + 1);
        std::fs::write(&next, &frame::segment_header()[..5]).unwrap();
        let before = files_snapshot(&journal_dir);
        let reader = DiskJournal::open_read_only(&journal_dir).unwrap();
        assert_eq!(
            reader.read(&a, 0, usize::MAX).unwrap().len() as u64,
            total_a
        );
        read_everything(&reader);
        drop(reader);
        assert_eq!(files_snapshot(&journal_dir), before);

        // A read-write open then repairs it, as always, and keeps every record.
        let journal = DiskJournal::open_with(&journal_dir, small()).unwrap();
        assert_eq!(journal.view(&a).unwrap().last_sequence, total_a);
        journal.append_durable(&a, kv(json!("after"))).unwrap();
    }

    #[test]
    fn a_read_only_open_of_a_missing_directory_fails_naming_it_and_creates_nothing() {
        let dir = TempDir::new("read-only-missing");
        let missing = dir.path().join("data").join("journal");
        match DiskJournal::open_read_only(&missing) {
            Err(JournalError::Failed(why)) => {
                assert!(why.contains(&missing.display().to_string()), "{why}");
            }
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("a missing directory opened"),
        }
        assert!(!dir.path().join("data").exists());
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        match DiskJournal::open_read_only(&file) {
            Err(JournalError::Failed(why)) => {
                assert!(why.contains(&file.display().to_string()), "{why}");
            }
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("a file opened as a journal"),
        }
        // An empty directory is an empty journal.
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let reader = DiskJournal::open_read_only(&empty).unwrap();
        assert!(reader.sessions().unwrap().is_empty());
        assert!(matches!(
            reader.read(&id(1), 0, 10),
            Err(JournalError::UnknownSession(_))
        ));
        drop(reader);
        assert!(segment_files_in(&empty).is_empty());
    }

    // ---------------------------------------------------------------------------------------
    // Child processes: the test binary re-executes itself with `--exact` on `child_process`.

    const CHILD_DIR: &str = "BRAIN_JOURNAL_TEST_CHILD_DIR";
    const CHILD_MODE: &str = "BRAIN_JOURNAL_TEST_CHILD_MODE";

    /// Kills and reaps the child if the test fails before it does.
    struct ChildGuard(Child);

    impl Drop for ChildGuard {
        fn drop(&mut self) {
            if let Ok(None) = self.0.try_wait() {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
    }

    fn spawn_child(journal_dir: &Path, mode: &str) -> ChildGuard {
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "journal::disk::tests::child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, journal_dir)
            .env(CHILD_MODE, mode)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        ChildGuard(child)
    }

    /// An acknowledged record: `ack <session> <sequence> <value>`.
    fn parse_ack(line: &str) -> Option<(SessionId, u64, String)> {
        let mut words = line.strip_prefix("ack ")?.split(' ');
        let session = SessionId::parse(words.next()?).ok()?;
        let sequence = words.next()?.parse().ok()?;
        Some((session, sequence, words.next()?.to_owned()))
    }

    /// Asserts that every acknowledged record is in the journal with its value, and that every
    /// session's stream is whole.
    fn assert_acknowledged(journal: &DiskJournal, acks: &[(SessionId, u64, String)]) {
        for (session, sequence, value) in acks {
            let events = journal.read(session, sequence - 1, 1).unwrap();
            assert_eq!(events.len(), 1, "{session} {sequence} is missing");
            assert_eq!(events[0].sequence, *sequence);
            assert_eq!(
                events[0].data["value"],
                json!(value),
                "{session} {sequence}"
            );
        }
        for session in journal.sessions().unwrap() {
            let events = journal.read(&session, 0, usize::MAX).unwrap();
            assert_eq!(
                sequences(&events),
                (1..=events.len() as u64).collect::<Vec<_>>()
            );
        }
    }

    /// Does nothing unless a test below started this process as its child.
    #[test]
    fn child_process() {
        let (Some(dir), Ok(mode)) = (std::env::var_os(CHILD_DIR), std::env::var(CHILD_MODE)) else {
            return;
        };
        let dir = PathBuf::from(dir);
        match mode.as_str() {
            "appender" => child_appender(&dir),
            "fsize" => child_file_size_limit(&dir),
            other => panic!("unknown child mode {other}"),
        }
    }

    /// Appends durably from four threads and prints each acknowledgement, until killed (or a
    /// bound, so a lost parent cannot leave it running).
    fn child_appender(dir: &Path) {
        let journal = DiskJournal::open(dir).unwrap();
        let sessions: Vec<SessionId> = (100..104).map(id).collect();
        for session in &sessions {
            match journal.create(session, created()) {
                Ok(_) | Err(JournalError::AlreadyExists(_)) => {}
                Err(e) => panic!("{e}"),
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        std::thread::scope(|scope| {
            for session in &sessions {
                let journal = &journal;
                scope.spawn(move || {
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        n += 1;
                        let value = format!("{}-{n}", std::process::id());
                        let sequence = journal.append_durable(session, kv(json!(value))).unwrap();
                        println!("ack {session} {sequence} {value}");
                    }
                });
            }
        });
    }

    #[test]
    fn acknowledged_records_survive_kill_9() {
        let dir = TempDir::new("kill");
        let journal_dir = dir.path().join("journal");
        let mut all_acks = Vec::new();
        for kill_after in [1, 40, 150, 17, 400, 90] {
            let mut child = spawn_child(&journal_dir, "appender");
            let stdout = child.0.stdout.take().unwrap();
            let mut acks = Vec::new();
            let mut killed = false;
            for line in BufReader::new(stdout).lines() {
                let line = line.unwrap();
                if let Some(ack) = parse_ack(&line) {
                    acks.push(ack);
                }
                if acks.len() >= kill_after && !killed {
                    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.0.id()).unwrap());
                    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
                    killed = true;
                }
                // Lines already in the pipe were acknowledged too: read them to the end.
            }
            let status = child.0.wait().unwrap();
            assert!(killed && !status.success(), "{status:?}");
            assert!(acks.len() >= kill_after);
            let journal = DiskJournal::open(&journal_dir).unwrap();
            all_acks.extend(acks);
            assert_acknowledged(&journal, &all_acks);
        }
        eprintln!(
            "kill -9: {} acknowledged records all present",
            all_acks.len()
        );
    }

    /// Writes under a 64 KiB file size limit until the journal fails, then checks that it stays
    /// failed.
    fn child_file_size_limit(dir: &Path) {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        // Without a handler SIGXFSZ would kill the process instead of failing the write.
        signal_hook::flag::register(
            signal_hook::consts::SIGXFSZ,
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        let (_, hard) = getrlimit(Resource::RLIMIT_FSIZE).unwrap();
        setrlimit(Resource::RLIMIT_FSIZE, 64 * 1024, hard).unwrap();
        let journal = DiskJournal::open(dir).unwrap();
        let session = id(7);
        journal.create(&session, created()).unwrap();
        assert_eq!(journal.failure(), None);
        let mut n = 0;
        let error = loop {
            n += 1;
            let value = format!("{n}-{}", "x".repeat(900));
            match journal.append_durable(&session, kv(json!(value))) {
                Ok(sequence) => println!("ack {session} {sequence} {value}"),
                Err(error) => break error,
            }
            assert!(n < 1000, "the file size limit never stopped the journal");
        };
        assert_eq!(error.code(), ErrorCode::JournalFailed);
        println!("failed {error}");
        // The health report names the failed write, and is what the callers were told.
        let failure = journal
            .failure()
            .expect("a failed journal reports its failure");
        assert!(failure.contains("segment-"), "{failure}");
        assert!(failure.contains("File too large"), "{failure}");
        assert!(error.to_string().contains(&failure), "{error} / {failure}");
        println!("failure {failure}");
        // Fatal: everything after fails too, and nothing not durable is acknowledged.
        let after = journal.append(&session, kv(json!("after")));
        assert!(matches!(after, Err(JournalError::Failed(_))), "{after:?}");
        assert!(journal.create(&id(8), created()).is_err());
        assert!(journal.sync().is_err());
        let last = journal.view(&session).unwrap().last_sequence;
        assert!(matches!(
            durable(&journal, &session, last),
            Err(JournalError::Failed(_))
        ));
        assert!(durable(&journal, &session, 1).is_ok());
        assert_eq!(journal.failure(), Some(failure));
        println!("checked");
    }

    #[test]
    fn a_failed_write_is_fatal_and_loses_no_acknowledged_record() {
        let dir = TempDir::new("fsize");
        let journal_dir = dir.path().join("journal");
        let mut child = spawn_child(&journal_dir, "fsize");
        let stdout = child.0.stdout.take().unwrap();
        let lines: Vec<String> = BufReader::new(stdout).lines().map(Result::unwrap).collect();
        assert!(child.0.wait().unwrap().success());
        let acks: Vec<_> = lines.iter().filter_map(|l| parse_ack(l)).collect();
        assert!(acks.len() > 10, "{lines:?}");
        assert!(
            lines.iter().any(|l| l.starts_with("failed journal failed")),
            "{lines:?}"
        );
        assert!(lines.iter().any(|l| l == "checked"), "{lines:?}");
        assert!(
            lines.iter().any(|l| l.starts_with("failure writing ")),
            "{lines:?}"
        );
        let journal = DiskJournal::open(&journal_dir).unwrap();
        assert_acknowledged(&journal, &acks);
        assert_eq!(journal.failure(), None);
        journal
            .append_durable(&id(7), kv(json!("after restart")))
            .unwrap();
    }

    /// A journal in a new directory `tag` holding session 0, its creation durable.
    fn one_durable_session(tag: &str) -> (TempDir, DiskJournal, SessionId) {
        let dir = TempDir::new(tag);
        let journal = open(&dir);
        let session = id(0);
        journal.create(&session, created()).unwrap();
        durable(&journal, &session, 1).unwrap();
        (dir, journal, session)
    }

    /// A `model_call_started` record of activation 1.
    fn model_started() -> EffectRecord {
        let started = json!({"activation": 1, "ordinal": 0, "request": {"messages": []}});
        EffectRecord::started(RecordKind::ModelCallStarted, &started).unwrap()
    }

    #[test]
    fn an_effect_appended_queued_is_flushed_by_the_journals_thread_even_when_alone() {
        // What the dispatcher relies on: it starts effects with append_effect_queued and must
        // never sleep in a flush, while append_effect_then flushes a lone record right here.
        let (_dir, journal, session) = one_durable_session("queued");
        let (sender, receiver) = crossbeam_channel::bounded(2);
        let report = move |result: Result<u64, JournalError>| {
            let name = thread::current().name().map(str::to_owned);
            sender
                .send((result.map_err(|e| e.to_string()), name))
                .unwrap();
        };
        journal.append_effect_queued(&session, model_started(), Box::new(report.clone()));
        let (sequence, flushed_by) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(sequence, Ok(2));
        assert_eq!(flushed_by.as_deref(), Some("brain-journal"));
        durable(&journal, &session, 2).unwrap();

        journal.append_effect_then(&session, model_started(), Box::new(report));
        let (sequence, flushed_by) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(sequence, Ok(3));
        assert_eq!(flushed_by, thread::current().name().map(str::to_owned));
    }

    #[test]
    fn an_effect_placed_while_idle_waits_for_its_flusher_and_a_busy_journal_gives_it_back() {
        // What the dispatcher relies on at low load: the started record is placed and nobody
        // is woken; the executor that flushes it makes it durable on its own thread.
        let (dir, journal, session) = one_durable_session("placed");

        let placed = match journal
            .place_effect_if_idle(&session, model_started())
            .unwrap()
        {
            IdlePlacement::Placed(placed) => placed,
            IdlePlacement::Busy(_) => panic!("an idle journal gave the record back"),
        };
        assert_eq!(placed.sequence, 2);
        // Its frame waits for its flusher, so the journal is busy now: a second record comes
        // back unplaced, and the session's next sequence is still 3.
        let busy = match journal
            .place_effect_if_idle(&session, model_started())
            .unwrap()
        {
            IdlePlacement::Busy(record) => record,
            IdlePlacement::Placed(other) => panic!("a busy journal placed {other:?}"),
        };
        journal.flush_placed(&placed).unwrap();
        let (sender, receiver) = crossbeam_channel::bounded(1);
        journal.on_durable(
            &session,
            2,
            Box::new(move |result| {
                let name = thread::current().name().map(str::to_owned);
                sender.send((result.is_ok(), name)).unwrap();
            }),
        );
        // Durable already: the callback ran inline, on this thread.
        let (ok, ran_on) = receiver.try_recv().unwrap();
        assert!(ok);
        assert_eq!(ran_on, thread::current().name().map(str::to_owned));

        let (sender, receiver) = crossbeam_channel::bounded(1);
        journal.append_effect_queued(
            &session,
            busy,
            Box::new(move |result| sender.send(result.map_err(|e| e.to_string())).unwrap()),
        );
        assert_eq!(
            receiver.recv_timeout(Duration::from_secs(10)).unwrap(),
            Ok(3)
        );
        drop(journal);
        let journal = open(&dir);
        let kinds: Vec<String> = journal
            .read(&session, 0, 10)
            .unwrap()
            .into_iter()
            .map(|event| event.event_type)
            .collect();
        assert_eq!(
            kinds,
            [
                "session_created",
                "model_call_started",
                "model_call_started"
            ]
        );
    }

    /// Durable records per second at 1, 8 and 64 concurrent sessions (one thread each, every
    /// append waiting for durability) against the raw fdatasync rate of the same disk. Run with
    /// `BRAIN_JOURNAL_BENCH_DIR=<dir on the disk to measure> cargo test --release --lib
    /// group_commit_throughput -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement: run it by hand (docs/JOURNAL.md)"]
    fn group_commit_throughput() {
        let base = std::env::var_os("BRAIN_JOURNAL_BENCH_DIR")
            .map_or_else(std::env::temp_dir, PathBuf::from);
        let dir = TempDir::new_in(&base, "bench");
        let window = Duration::from_secs(3);

        let raw = {
            let file = File::create(dir.path().join("raw")).unwrap();
            let block = [7u8; 256];
            let started = Instant::now();
            let mut syncs = 0u64;
            while started.elapsed() < window {
                file.write_all_at(&block, syncs * 256).unwrap();
                file.sync_data().unwrap();
                syncs += 1;
            }
            syncs as f64 / started.elapsed().as_secs_f64()
        };
        eprintln!(
            "{:>10} {:>12} {:>10} {:>16}",
            "sessions", "records/s", "per flush", "vs raw fdatasync"
        );
        eprintln!("{:>10} {:>12.0} {:>10} {:>16}", "raw", raw, 1, "1.0x");
        for concurrency in [1usize, 8, 64] {
            let journal =
                DiskJournal::open(&dir.path().join(format!("journal-{concurrency}"))).unwrap();
            let sessions: Vec<SessionId> = (0..concurrency).map(id).collect();
            for session in &sessions {
                journal.create(session, created()).unwrap();
            }
            journal.sync().unwrap();
            let before = journal.stats();
            let started = Instant::now();
            let total = AtomicU64::new(0);
            std::thread::scope(|scope| {
                for session in &sessions {
                    let (journal, total) = (&journal, &total);
                    scope.spawn(move || {
                        let data = json!({"key": "k", "value": "a record of about a hundred bytes, like a small kv write"});
                        while started.elapsed() < window {
                            journal.append_durable(session, record(RecordKind::KvSet, data.clone())).unwrap();
                            total.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
            });
            let rate = total.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
            let after = journal.stats();
            let per_flush =
                (after.records - before.records) as f64 / (after.flushes - before.flushes) as f64;
            eprintln!(
                "{concurrency:>10} {rate:>12.0} {per_flush:>10.1} {:>15.1}x",
                rate / raw
            );
        }

        // Startup: 10,000 sessions of 10 records each, reopened.
        let journal_dir = dir.path().join("journal-startup");
        {
            let journal = DiskJournal::open(&journal_dir).unwrap();
            for n in 0..10_000 {
                let session = id(n);
                journal.create(&session, created()).unwrap();
                for r in 0..9 {
                    journal.append(&session, kv(json!(r))).unwrap();
                }
            }
            journal.sync().unwrap();
        }
        let started = Instant::now();
        let journal = DiskJournal::open(&journal_dir).unwrap();
        let opened = started.elapsed();
        let started = Instant::now();
        journal.view(&id(1234)).unwrap();
        eprintln!(
            "startup with 10,000 sessions of 10 records ({} segments, {} bytes): open {opened:?}, \
             then a first view {:?}",
            journal.stats().segments,
            segment_files_in(&journal_dir)
                .iter()
                .map(|f| std::fs::metadata(f).unwrap().len())
                .sum::<u64>(),
            started.elapsed()
        );
    }
}
