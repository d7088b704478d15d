//! Recovery at open: one sequential scan of every segment, oldest first, that rebuilds the index
//! (where each live session's records are) without decoding any record body, truncates a torn
//! tail, and names the sessions that corruption makes unreadable.
//!
//! The policy (docs/JOURNAL.md, "Recovery"):
//!
//! - Only the last segment can have a torn tail: the writer flushes a segment before it creates
//!   the next. In the last segment, the first invalid frame is a torn tail when the part of it
//!   that can be trusted reaches past the file's last non-zero byte: the whole frame when its
//!   address checksum holds (its length is then trustworthy), its 56 fixed bytes otherwise. That
//!   covers a frame cut short by the end of the file and a frame the filesystem extended with
//!   zeros but never wrote. A torn tail is truncated, the file flushed, and the place logged.
//! - Any other invalid frame is corruption. Nothing is repaired and nothing is dropped silently:
//!   - a damaged body under an intact address refuses exactly that frame's session, and the scan
//!     goes on after it (the checked length says where the next frame starts);
//!   - a damaged address (or segment header) makes the rest of its segment unreadable: every
//!     session seen so far becomes suspect, and stays refused unless its next record, in a later
//!     segment, carries exactly the sequence that proves nothing of it was lost. The segment is
//!     pinned (never compacted). Sessions whose every record lay in the unreadable part cannot be
//!     named and do not appear.
//!   - a sequence that does not continue its session's stream refuses that session.
//! - I/O errors fail the open; so does a segment of another format version.
//!
//! A read-only scan ([`scan_read_only`]) applies the same rules but writes nothing: a torn tail
//! is simply where the log ends. It may run while another process appends to the directory and
//! compacts it: it reads what the segments hold when it gets to them, and starts over if a
//! segment it listed has been removed meanwhile, so that it never reads a tombstone's victims
//! without the tombstone.

use super::JournalError;
use super::frame::{self, FRAME_OVERHEAD, FrameType, HeaderError, SEGMENT_HEADER_LEN};
use super::segment::{self, Loc, SegmentTable};
use crate::session::SessionId;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// What the scan found.
pub(crate) struct Recovered {
    /// Every session created and not deleted, including refused ones.
    pub(crate) sessions: HashMap<SessionId, RecoveredSession>,
    /// Every segment, for compaction.
    pub(crate) table: SegmentTable,
    /// Where appends go.
    pub(crate) tail: Tail,
    /// The position just after the last byte of the log: everything before it is durable.
    pub(crate) end: u64,
}

/// One session as the scan found it.
pub(crate) struct RecoveredSession {
    /// Its frames in log order. For a session that is not refused, the frame of sequence `s` is
    /// at index `s - 1`.
    pub(crate) locs: Vec<Loc>,
    /// The `recorded_at_ms` of its last record.
    pub(crate) last_stamp: u64,
    /// Why it is unreadable ([`JournalError::Corrupt`]), if it is.
    pub(crate) refused: Option<JournalError>,
}

/// Where the writer continues.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Tail {
    /// Append to this existing segment, whose valid bytes end at `end`.
    Append { segment: u32, end: u32 },
    /// Start this new segment (none exist yet, or the last one must not be appended to).
    Fresh { segment: u32 },
}

/// How a segment's scan ended.
enum SegmentEnd {
    /// Every byte up to this offset was a valid frame (or a damaged body that was skipped),
    /// and after it the file ends, or (in the last segment) holds only zeros.
    Clean(u64),
    /// The last segment has a torn tail from this offset.
    Torn { at: u64, why: String },
    /// The rest of the segment could not be read.
    Unreadable { len: u64 },
    /// The file ended before the length taken when its scan began: the writer sealed it
    /// meanwhile (cut the zeros written ahead of its frames). Only another process's writer can
    /// do that, so only a read-only scan meets it.
    Shrunk,
}

/// A session during the scan.
#[derive(Default)]
struct Scanned {
    locs: Vec<Loc>,
    next: u64,
    last_stamp: u64,
    refused: Option<JournalError>,
    suspect: Option<JournalError>,
}

#[derive(Default)]
struct State {
    sessions: HashMap<SessionId, Scanned>,
    table: SegmentTable,
}

/// Whether a scan may write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The journal is about to be written: a torn tail is truncated (a torn header rewritten).
    Repair,
    /// Nothing is written: a torn tail is where the log ends, and a segment that vanished since
    /// the listing (another process compacted it) or got shorter while it was read (another
    /// process sealed it) is reported rather than an error.
    ReadOnly,
}

/// How many times [`scan_read_only`] starts over because a listed segment was removed or sealed.
const READ_ONLY_ATTEMPTS: usize = 100;

/// Scans the segments `ids` (ascending) of `dir` and truncates a torn tail of the last one.
pub(crate) fn scan(dir: &Path, ids: &[u32]) -> Result<Recovered, JournalError> {
    scan_in(dir, ids, Mode::Repair)?.ok_or_else(|| {
        JournalError::Failed(format!(
            "a segment of {} vanished during recovery",
            dir.display()
        ))
    })
}

/// Lists and scans the segments of `dir` without writing anything, and returns their ids and
/// what the scan found. A torn tail of the last segment (for instance a frame another process
/// is writing right now) is where the log ends: it is neither truncated nor corruption. If a
/// listed segment is removed before it is opened (another process compacting), or the last one
/// gets shorter while it is read (another process sealing it: cutting the zeros past its frames
/// once it is full), the listing and the scan start over.
pub(crate) fn scan_read_only(dir: &Path) -> Result<(Vec<u32>, Recovered), JournalError> {
    for _ in 0..READ_ONLY_ATTEMPTS {
        let ids = list_segments(dir)?;
        if let Some(recovered) = scan_in(dir, &ids, Mode::ReadOnly)? {
            return Ok((ids, recovered));
        }
        log::debug!(
            "journal: a segment of {} was removed while it was read; reading it again",
            dir.display()
        );
    }
    Err(JournalError::Failed(format!(
        "the segments of {} kept being removed while they were read ({READ_ONLY_ATTEMPTS} \
         attempts)",
        dir.display()
    )))
}

/// Scans the segments `ids` of `dir`: `Ok(None)` when a read-only scan found one of them gone.
fn scan_in(dir: &Path, ids: &[u32], mode: Mode) -> Result<Option<Recovered>, JournalError> {
    let mut state = State::default();
    let mut tail = Tail::Fresh { segment: 1 };
    let mut end = 0;
    for (index, &id) in ids.iter().enumerate() {
        let path = segment::path(dir, id);
        let is_last = index + 1 == ids.len();
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if mode == Mode::ReadOnly && e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(None);
            }
            Err(e) => return Err(io_error(&path, "opening", e)),
        };
        let outcome = scan_segment(&file, &path, id, is_last, &mut state)?;
        let next_segment = || {
            id.checked_add(1)
                .ok_or_else(|| JournalError::Failed("no segment id is left".to_owned()))
        };
        let valid_end = match outcome {
            SegmentEnd::Clean(len) => {
                tail = Tail::Append {
                    segment: id,
                    end: offset32(&path, len)?,
                };
                len
            }
            SegmentEnd::Torn { at, why } if mode == Mode::ReadOnly => {
                log::debug!(
                    "journal: reading {} up to offset {at} only ({why}: an incomplete tail)",
                    path.display()
                );
                tail = Tail::Append {
                    segment: id,
                    end: offset32(&path, at)?,
                };
                at
            }
            SegmentEnd::Torn { at, why } => {
                let len = truncate(&path, at, &why)?;
                tail = Tail::Append {
                    segment: id,
                    end: offset32(&path, len)?,
                };
                len
            }
            SegmentEnd::Unreadable { len } => {
                tail = Tail::Fresh {
                    segment: next_segment()?,
                };
                len
            }
            SegmentEnd::Shrunk if mode == Mode::ReadOnly => return Ok(None),
            SegmentEnd::Shrunk => {
                return Err(JournalError::Failed(format!(
                    "{} got shorter while it was read, with no other writer",
                    path.display()
                )));
            }
        };
        state.table.entry(id).bytes = valid_end;
        end = segment::position(id, offset32(&path, valid_end)?);
    }
    let sessions = state
        .sessions
        .into_iter()
        .map(|(id, scanned)| {
            let session = RecoveredSession {
                locs: scanned.locs,
                last_stamp: scanned.last_stamp,
                refused: scanned.refused.or(scanned.suspect),
            };
            if let Some(why) = &session.refused {
                log::error!("journal: session {id} is unreadable: {why}");
            }
            (id, session)
        })
        .collect();
    Ok(Some(Recovered {
        sessions,
        table: state.table,
        tail,
        end,
    }))
}

fn io_error(path: &Path, what: &str, error: std::io::Error) -> JournalError {
    JournalError::Failed(format!("{what} {}: {error}", path.display()))
}

fn offset32(path: &Path, offset: u64) -> Result<u32, JournalError> {
    u32::try_from(offset).map_err(|_| {
        JournalError::Failed(format!(
            "{} is larger than the 4 GiB a segment may hold",
            path.display()
        ))
    })
}

fn corrupt(path: &Path, offset: u64, why: String) -> JournalError {
    JournalError::Corrupt {
        file: path.to_path_buf(),
        offset,
        why,
    }
}

/// The offset where the file's trailing run of zero bytes starts (its length if it ends with a
/// non-zero byte).
fn zero_tail_start(file: &File, len: u64) -> std::io::Result<u64> {
    let mut buffer = vec![0u8; 64 * 1024];
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(buffer.len() as u64);
        // At most 64 KiB: fits in usize.
        let chunk = &mut buffer[..(end - start) as usize];
        file.read_exact_at(chunk, start)?;
        if let Some(last) = chunk.iter().rposition(|&b| b != 0) {
            return Ok(start + last as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// Why a segment's scan stopped short of an answer.
enum ScanError {
    /// A read found the file shorter than the length taken at the start.
    Shrunk,
    Failed(JournalError),
}

impl From<JournalError> for ScanError {
    fn from(error: JournalError) -> ScanError {
        ScanError::Failed(error)
    }
}

/// A failed read of `path` as a [`ScanError`]: the end of the file met before the length the
/// scan took is [`ScanError::Shrunk`].
fn read_error(path: &Path, error: std::io::Error) -> ScanError {
    if error.kind() == std::io::ErrorKind::UnexpectedEof {
        ScanError::Shrunk
    } else {
        ScanError::Failed(io_error(path, "reading", error))
    }
}

fn scan_segment(
    file: &File,
    path: &Path,
    id: u32,
    is_last: bool,
    state: &mut State,
) -> Result<SegmentEnd, JournalError> {
    // Read no further than this length, taken once: another process may be appending.
    let len = file
        .metadata()
        .map_err(|e| io_error(path, "inspecting", e))?
        .len();
    match scan_segment_up_to(file, path, id, len, is_last, state) {
        Ok(end) => Ok(end),
        Err(ScanError::Shrunk) => Ok(SegmentEnd::Shrunk),
        Err(ScanError::Failed(error)) => Err(error),
    }
}

/// Scans the first `len` bytes of segment `id` (its length when the scan began).
fn scan_segment_up_to(
    file: &File,
    path: &Path,
    id: u32,
    len: u64,
    is_last: bool,
    state: &mut State,
) -> Result<SegmentEnd, ScanError> {
    offset32(path, len)?;
    state.table.entry(id).bytes = len;
    let zero_from = if is_last {
        zero_tail_start(file, len).map_err(|e| read_error(path, e))?
    } else {
        len
    };
    // Whether an invalid frame whose trustworthy part ends at `extent` is a torn tail.
    let torn = |extent: u64| is_last && extent > zero_from;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut read = |buffer: &mut [u8]| reader.read_exact(buffer).map_err(|e| read_error(path, e));

    if len < SEGMENT_HEADER_LEN {
        let why = format!("a segment of {len} bytes has no complete header");
        if torn(SEGMENT_HEADER_LEN) {
            return Ok(SegmentEnd::Torn { at: 0, why });
        }
        state.unreadable(path, id, 0, why);
        return Ok(SegmentEnd::Unreadable { len });
    }
    let mut header = [0u8; 16];
    read(&mut header)?;
    match frame::check_segment_header(&header) {
        Ok(()) => {}
        Err(HeaderError::OtherVersion(version)) => {
            return Err(JournalError::Failed(format!(
                "{} has journal format version {version}; this Brain reads version {}: start \
                 with a new data directory",
                path.display(),
                frame::FORMAT_VERSION
            ))
            .into());
        }
        Err(HeaderError::Invalid(why)) => {
            if torn(SEGMENT_HEADER_LEN) {
                return Ok(SegmentEnd::Torn { at: 0, why });
            }
            state.unreadable(path, id, 0, why);
            return Ok(SegmentEnd::Unreadable { len });
        }
    }

    let mut offset = SEGMENT_HEADER_LEN;
    let mut fixed = [0u8; FRAME_OVERHEAD];
    let mut body = Vec::new();
    loop {
        // Zeros after a frame (only in the last segment) are what the writer writes ahead of
        // its frames: the log ends there, cleanly. A valid frame never ends with a zero byte.
        if offset >= zero_from {
            return Ok(SegmentEnd::Clean(offset));
        }
        let fixed_end = offset + FRAME_OVERHEAD as u64;
        if fixed_end > len {
            let why = "an incomplete frame header".to_owned();
            if torn(fixed_end) {
                return Ok(SegmentEnd::Torn { at: offset, why });
            }
            state.unreadable(path, id, offset, why);
            return Ok(SegmentEnd::Unreadable { len });
        }
        read(&mut fixed)?;
        let mut head = [0u8; 12];
        head.copy_from_slice(&fixed[..12]);
        let head = frame::Head::parse(&head);
        let address_bytes = &fixed[12..];
        let address = match head.check_address(address_bytes) {
            Ok(address) => address,
            Err(why) => {
                if torn(fixed_end) {
                    return Ok(SegmentEnd::Torn { at: offset, why });
                }
                state.unreadable(path, id, offset, why);
                return Ok(SegmentEnd::Unreadable { len });
            }
        };
        let end = offset + head.frame_len();
        if end > len {
            let why = format!(
                "a frame of {} bytes runs past the end of the segment",
                head.frame_len()
            );
            if torn(end) {
                return Ok(SegmentEnd::Torn { at: offset, why });
            }
            state.unreadable(path, id, offset, why);
            return Ok(SegmentEnd::Unreadable { len });
        }
        // The length was checked against MAX_BODY_LEN by `check_address`, and fits the file.
        body.resize(head.body_len as usize, 0);
        read(&mut body)?;
        let loc = Loc {
            pos: segment::position(id, offset32(path, offset)?),
            len: offset32(path, head.frame_len())?,
        };
        match head.check_body(address_bytes, &body) {
            Ok(()) => state.frame(path, &address, loc),
            Err(why) => {
                if torn(end) {
                    return Ok(SegmentEnd::Torn { at: offset, why });
                }
                state.damaged(path, &address, loc, why);
            }
        }
        offset = end;
    }
}

impl State {
    /// A valid frame.
    fn frame(&mut self, path: &Path, address: &frame::Address, loc: Loc) {
        match address.frame_type {
            FrameType::Record => {
                let scanned = self.sessions.entry(address.session.clone()).or_default();
                if scanned.next == 0 {
                    scanned.next = 1;
                }
                if address.sequence != scanned.next && scanned.refused.is_none() {
                    scanned.refused = Some(scanned.suspect.take().unwrap_or_else(|| {
                        corrupt(
                            path,
                            loc.offset(),
                            format!(
                                "record {} of session {} where record {} was expected",
                                address.sequence, address.session, scanned.next
                            ),
                        )
                    }));
                }
                // The expected record: nothing of this session was lost in an unreadable region.
                scanned.suspect = None;
                scanned.next = address.sequence.saturating_add(1);
                scanned.last_stamp = address.recorded_at_ms;
                scanned.locs.push(loc);
                self.table.add_record(loc);
            }
            FrameType::Tombstone => {
                let victims = self
                    .sessions
                    .remove(&address.session)
                    .map(|s| s.locs)
                    .unwrap_or_default();
                self.table.kill(&victims, loc);
            }
        }
    }

    /// A frame whose address is intact but whose body is damaged: its session is refused.
    fn damaged(&mut self, path: &Path, address: &frame::Address, loc: Loc, why: String) {
        let scanned = self.sessions.entry(address.session.clone()).or_default();
        let error = corrupt(
            path,
            loc.offset(),
            format!(
                "{why} in record {} of session {}",
                address.sequence, address.session
            ),
        );
        log::error!("journal: {error}");
        scanned.refused.get_or_insert(error);
        scanned.next = address.sequence.saturating_add(1);
        scanned.locs.push(loc);
        self.table.add_record(loc);
    }

    /// The rest of segment `id` from `offset` cannot be read.
    fn unreadable(&mut self, path: &Path, id: u32, offset: u64, why: String) {
        log::error!(
            "journal: {} is unreadable from offset {offset} ({why}); every session with records \
             before it is refused unless a later record proves it lost nothing",
            path.display()
        );
        self.table.entry(id).pinned = true;
        for (session, scanned) in &mut self.sessions {
            if scanned.refused.is_none() && scanned.suspect.is_none() {
                scanned.suspect = Some(corrupt(
                    path,
                    offset,
                    format!(
                        "{why}: the unreadable rest of the segment may hold records of session {session}"
                    ),
                ));
            }
        }
    }
}

/// Truncates the torn tail of `path` at `at`, rewriting the header if it was torn, and flushes
/// the file. Returns the new length.
fn truncate(path: &Path, at: u64, why: &str) -> Result<u64, JournalError> {
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| io_error(path, "opening", e))?;
    let old = file
        .metadata()
        .map_err(|e| io_error(path, "inspecting", e))?
        .len();
    let new_len = if at < SEGMENT_HEADER_LEN {
        file.set_len(0)
            .and_then(|()| file.write_all_at(&frame::segment_header(), 0))
            .map_err(|e| io_error(path, "rewriting the header of", e))?;
        SEGMENT_HEADER_LEN
    } else {
        file.set_len(at)
            .map_err(|e| io_error(path, "truncating", e))?;
        at
    };
    file.sync_all().map_err(|e| io_error(path, "flushing", e))?;
    log::warn!(
        "journal: truncated the torn tail of {} at offset {at} ({why}; {} bytes dropped)",
        path.display(),
        old.saturating_sub(at)
    );
    Ok(new_len)
}

/// The segment ids in `dir`, ascending. Files of other names are logged and left alone.
pub(crate) fn list_segments(dir: &Path) -> Result<Vec<u32>, JournalError> {
    let entries = std::fs::read_dir(dir).map_err(|e| io_error(dir, "listing", e))?;
    let mut ids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_error(dir, "listing", e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        match segment::parse_name(&name) {
            Ok(Some(id)) => ids.push(id),
            Ok(None) => log::warn!(
                "journal: ignoring {} (not a segment)",
                PathBuf::from(dir).join(&*name).display()
            ),
            Err(why) => return Err(JournalError::Failed(why)),
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::conformance::{TempDir, created, id};
    use crate::journal::{DiskJournal, Journal};

    /// A scan that finds the last segment shorter than the length it took (the live writer
    /// sealed it meanwhile, cutting its zeros) says so instead of failing; the length it took,
    /// when it is still there, scans clean. (A segment listed before the last one is sealed
    /// already.)
    #[test]
    fn a_segment_shorter_than_the_length_taken_is_reported_as_shrunk() {
        let dir = TempDir::new("recover-shrunk");
        let journal_dir = dir.path().join("journal");
        let journal = DiskJournal::open(&journal_dir).unwrap();
        journal.create(&id(1), created()).unwrap();
        journal.sync().unwrap();
        drop(journal);
        let ids = list_segments(&journal_dir).unwrap();
        let last = *ids.last().unwrap();
        let path = segment::path(&journal_dir, last);
        let file = File::open(&path).unwrap();
        let len = file.metadata().unwrap().len();
        let mut state = State::default();
        let scanned = scan_segment_up_to(&file, &path, last, len + 4096, true, &mut state);
        assert!(matches!(scanned, Err(ScanError::Shrunk)));
        let mut state = State::default();
        let scanned = scan_segment_up_to(&file, &path, last, len, true, &mut state);
        assert!(matches!(scanned, Ok(SegmentEnd::Clean(_))));
        // A read-only scan that met it would start over: here nothing shrinks, and it reads.
        let (listed, recovered) = scan_read_only(&journal_dir).unwrap();
        assert_eq!(listed, ids);
        assert!(recovered.sessions.contains_key(&id(1)));
    }
}
