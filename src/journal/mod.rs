//! The journal: per-session ordered records and their projections.
//!
//! Each session's journal is a logical stream of records with its own sequence counter (1, 2, 3,
//! … without gaps). Transcript, kv, events cursor, activation marker and status are projections of
//! that stream, computed by one function, [`apply`], so that every implementation (and a replay at
//! startup) derives the same [`SessionView`] from the same records (PROTOCOL.md §6, §7.2, §11).
//!
//! [`Journal`] is the seam the dispatcher and the callback executors are written against.
//! Appending is split in two: [`Journal::append`] assigns the sequence and updates the projections
//! at once and never blocks on I/O; [`Journal::on_durable`] reports when the record is durable.
//! Nothing may be acknowledged to anyone, or used as an effect fence, before that report
//! (PROTOCOL.md §7.1, §11). Threads that may block use [`Journal::append_durable`].
//!
//! [`MemoryJournal`] keeps everything in memory: every record is durable the moment it is appended.
//! [`DiskJournal`] keeps records in segment files under `<data>/journal`, makes them durable with
//! group commit and recovers them at open (docs/JOURNAL.md); [`DiskJournal::open_read_only`]
//! reads such a directory without writing to it, even beside the Brain that is writing it.

#[cfg(test)]
mod conformance;
pub(crate) mod crc;
mod disk;
pub(crate) mod frame;
mod memory;
mod projection;
mod recover;
mod segment;

pub use disk::{
    CompactionReport, DEFAULT_SEGMENT_SIZE, DiskJournal, DiskJournalOptions, JournalStats,
    MAX_SEGMENT_SIZE, MIN_SEGMENT_SIZE,
};
pub use memory::MemoryJournal;
pub(crate) use projection::apply_transcript_delta;
pub use projection::{ACTIVATION_MARKER_KEY, EVENTS_CURSOR_KEY, apply};

use crate::protocol::harness::{ErrorCode, Event, EventOrigin, Message, RecordKind};
use crate::session::SessionId;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

/// A record to append: what it is, its payload, and where it came from.
///
/// The journal assigns the sequence and the `recorded_at_ms` stamp; everything else is stored as
/// given. The payload shapes the projections read are listed on [`apply`]; an `event_emitted`
/// record's data is `{"type": String, "data": Value}` (what [`Journal::pending_events`] unwraps).
#[derive(Debug, Clone, PartialEq)]
pub struct NewRecord {
    /// The record's kind.
    pub kind: RecordKind,
    /// The record's payload.
    pub data: Value,
    /// Who caused it, when that matters (an `event_emitted` record's emitter).
    pub origin: Option<EventOrigin>,
}

/// An effect record (`model_call_*`, `tool_call_*`, `environment_*`) whose data is already
/// encoded JSON: what [`Journal::append_effect_then`] takes.
///
/// A callback's effect records carry its largest payloads (a model request, a model's answer).
/// Encoding them straight from the callback's typed values spares building and dropping a
/// `Value` tree of each, and a second escape of every string. The constructors guarantee what
/// the projections read ([`apply`]): a finished record's data holds the `started` it names.
#[derive(Debug, Clone)]
pub struct EffectRecord {
    kind: RecordKind,
    /// The `started` field of a finished record's data.
    started: Option<u64>,
    data: Box<RawValue>,
}

impl EffectRecord {
    /// A `model_call_started`, `tool_call_started` or `environment_started` record whose data is
    /// `data` encoded.
    ///
    /// # Errors
    /// When `kind` is not one of those kinds, or `data` does not encode to a JSON object.
    pub fn started(kind: RecordKind, data: &impl Serialize) -> Result<EffectRecord, JournalError> {
        use RecordKind::{EnvironmentStarted, ModelCallStarted, ToolCallStarted};
        one_of(
            kind,
            &[ModelCallStarted, ToolCallStarted, EnvironmentStarted],
            "started",
        )?;
        Ok(EffectRecord {
            kind,
            started: None,
            data: encode_object(kind, data)?,
        })
    }

    /// A `model_call_finished`, `tool_call_finished` or `environment_finished` record whose data
    /// is `data`'s fields followed by `"started": started`.
    ///
    /// `data` must not have a `started` field of its own.
    ///
    /// # Errors
    /// When `kind` is not one of those kinds, or `data` does not encode to a JSON object.
    pub fn finished(
        kind: RecordKind,
        started: u64,
        data: &impl Serialize,
    ) -> Result<EffectRecord, JournalError> {
        use RecordKind::{EnvironmentFinished, ModelCallFinished, ToolCallFinished};
        one_of(
            kind,
            &[ModelCallFinished, ToolCallFinished, EnvironmentFinished],
            "finished",
        )?;
        #[derive(Serialize)]
        struct WithStarted<'a, T> {
            #[serde(flatten)]
            data: &'a T,
            started: u64,
        }
        Ok(EffectRecord {
            kind,
            started: Some(started),
            data: encode_object(kind, &WithStarted { data, started })?,
        })
    }

    /// The record's kind.
    pub fn kind(&self) -> RecordKind {
        self.kind
    }

    /// The record's data as JSON text.
    pub fn data(&self) -> &RawValue {
        &self.data
    }

    /// What [`apply`] needs of the record: its kind, and the `started` of a finished one.
    pub(crate) fn projected(&self) -> NewRecord {
        NewRecord {
            kind: self.kind,
            data: match self.started {
                Some(started) => serde_json::json!({ "started": started }),
                None => Value::Null,
            },
            origin: None,
        }
    }

    /// The record as a [`NewRecord`], its data parsed back into a `Value`.
    pub fn to_record(&self) -> NewRecord {
        NewRecord {
            kind: self.kind,
            // Text that serde_json itself produced parses back.
            data: serde_json::from_str(self.data.get()).unwrap_or(Value::Null),
            origin: None,
        }
    }
}

/// Refuses a `kind` that is not one of an effect's `which` (started or finished) records.
fn one_of(kind: RecordKind, kinds: &[RecordKind], which: &str) -> Result<(), JournalError> {
    if kinds.contains(&kind) {
        Ok(())
    } else {
        Err(JournalError::Failed(format!(
            "{kind} is not the {which} record of an effect"
        )))
    }
}

/// `data` as JSON text, which must be an object.
fn encode_object(kind: RecordKind, data: &impl Serialize) -> Result<Box<RawValue>, JournalError> {
    let text = crate::protocol::json::to_raw_value(data)
        .map_err(|e| JournalError::Failed(format!("a {kind} record cannot be encoded: {e}")))?;
    if !text.get().starts_with('{') {
        return Err(JournalError::Failed(format!(
            "a {kind} record's data must be a JSON object, not {}",
            text.get()
        )));
    }
    Ok(text)
}

/// Called once when a record is durable, or with the error that prevented it. See
/// [`Journal::on_durable`].
pub type DurableCallback = Box<dyn FnOnce(Result<(), JournalError>) + Send>;

/// Called once when an appended record is durable, with its sequence, or with the error that
/// prevented it. See [`Journal::append_effect_then`].
pub type AppendedCallback = Box<dyn FnOnce(Result<u64, JournalError>) + Send>;

/// What [`Journal::place_effect_if_idle`] did with an effect record.
pub enum IdlePlacement {
    /// Placed, not yet durable: flush it with [`Journal::flush_placed`].
    Placed(Placed),
    /// The journal was busy: the record, unplaced.
    Busy(EffectRecord),
}

/// An effect record placed by [`Journal::place_effect_if_idle`] and not yet flushed.
#[derive(Debug)]
pub struct Placed {
    /// The record's sequence.
    pub sequence: u64,
    /// Where in the journal's log the record ends: what must be durable.
    pub(crate) end: u64,
}

/// A session's lifecycle as its records project it.
///
/// `interrupted` is not a status here: it is derived elsewhere from [`SessionView::marker`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionStatus {
    /// Created, or reopened by an `activation_queued` record after passivation.
    Open,
    /// A `session_passivated` record was written and no activation has been queued since.
    Passivated,
    /// A `session_closed` record was written. Nothing reopens a closed session.
    Closed,
}

/// The projections of one session's records, as of its last record.
///
/// Built only by [`apply`]; [`SessionView::default`] is the view before any record.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionView {
    /// The session's lifecycle status.
    pub status: SessionStatus,
    /// The data of the `session_created` record, as compact JSON text. Read only when a session
    /// is recovered or listed while dormant; as a `Value` tree every small JSON object of a
    /// realistic request would cost a B-tree node (≈ 640 B), ≈ 20 KiB per open session.
    pub created: String,
    /// The activation marker: the projection of kv [`ACTIVATION_MARKER_KEY`] = `{"sequence": N}`.
    /// While it is set the session is `interrupted`.
    pub marker: Option<u64>,
    /// The projection of kv [`EVENTS_CURSOR_KEY`]: the last event an activation was given (0 when
    /// absent).
    pub events_cursor: u64,
    /// The transcript, as the `transcript_delta` records built it.
    pub transcript: Vec<Message>,
    /// The sequence of the last `transcript_delta` record (0 if none).
    pub transcript_through: u64,
    /// All kv keys, including the reserved `brain.` ones.
    pub kv: Map<String, Value>,
    /// The sequence of the last record (0 before any).
    pub last_sequence: u64,
    /// The number of `model_call_started` records so far.
    pub model_calls: u64,
    /// The sequences of the `model_call_started`, `tool_call_started` and `environment_started`
    /// records that have no finished record yet, oldest first.
    pub unfinished_effects: Vec<u64>,
    /// The idempotency keys of the session's `activation_queued` records: each key's activation
    /// sequence and request digest (crate::session::Keyed).
    pub activation_keys: BTreeMap<String, (u64, String)>,
}

impl Default for SessionView {
    /// The view before any record: open, nothing created, no marker, empty transcript and kv.
    fn default() -> SessionView {
        SessionView {
            status: SessionStatus::Open,
            created: String::new(),
            marker: None,
            events_cursor: 0,
            transcript: Vec::new(),
            transcript_through: 0,
            kv: Map::new(),
            last_sequence: 0,
            model_calls: 0,
            unfinished_effects: Vec::new(),
            activation_keys: BTreeMap::new(),
        }
    }
}

/// Why a journal operation was refused or failed.
#[derive(Debug, Clone)]
pub enum JournalError {
    /// The session was never created, or it was deleted.
    UnknownSession(SessionId),
    /// [`Journal::create`] named a session that exists.
    AlreadyExists(SessionId),
    /// The journal could not do what was asked (an I/O failure, or a request it refuses, such as
    /// a first record that is not `session_created`). The text says what and why.
    Failed(String),
    /// The session's records are damaged on disk: the session cannot be read or appended to.
    /// Other sessions are not affected. Nothing was repaired or dropped.
    Corrupt {
        /// The segment file holding the damage.
        file: PathBuf,
        /// The byte offset in it of the damaged frame (or of the unreadable region).
        offset: u64,
        /// What is wrong, and which session and record it concerns.
        why: String,
    },
}

impl JournalError {
    /// The error code callers report (PROTOCOL.md §10): `unknown_session`, `invalid_request`
    /// (for [`JournalError::AlreadyExists`]) or `journal_failed` (for [`JournalError::Failed`] and
    /// [`JournalError::Corrupt`]).
    pub fn code(&self) -> ErrorCode {
        match self {
            JournalError::UnknownSession(_) => ErrorCode::UnknownSession,
            JournalError::AlreadyExists(_) => ErrorCode::InvalidRequest,
            JournalError::Failed(_) | JournalError::Corrupt { .. } => ErrorCode::JournalFailed,
        }
    }
}

impl fmt::Display for JournalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournalError::UnknownSession(session) => write!(f, "unknown session {session}"),
            JournalError::AlreadyExists(session) => write!(f, "session {session} already exists"),
            JournalError::Failed(why) => write!(f, "journal failed: {why}"),
            JournalError::Corrupt { file, offset, why } => write!(
                f,
                "journal corrupt: {} at offset {offset}: {why}",
                file.display()
            ),
        }
    }
}

impl std::error::Error for JournalError {}

/// The `transcript_delta` record `{"keep": keep, "append": append}`, as the defaults of
/// [`Journal::append_transcript_durable`] and [`Journal::append_transcript`] append it.
fn transcript_delta(keep: usize, append: &[Message]) -> NewRecord {
    NewRecord {
        kind: RecordKind::TranscriptDelta,
        data: serde_json::json!({"keep": keep, "append": append}),
        origin: None,
    }
}

/// Per-session ordered, durable records and their projections (PROTOCOL.md §11).
///
/// Every method may be called from any thread. Per session, records are totally ordered by their
/// sequence, which is assigned under the session's own lock; different sessions never wait on each
/// other's appends. No method blocks on I/O except where stated: durability is reported through
/// [`Journal::on_durable`]. The journal enforces no lifecycle rules (busy, interrupted, closed):
/// the dispatcher does; it only refuses what would break the stream itself.
pub trait Journal: Send + Sync + 'static {
    /// Creates the session's stream, whose first record (sequence 1) is `record`, and returns 1.
    ///
    /// Refuses with [`JournalError::Failed`] a record whose kind is not `session_created`, and
    /// with [`JournalError::AlreadyExists`] a session that exists. A deleted id may be created
    /// again: it starts a new stream and none of the old records is ever visible again. Like
    /// [`Journal::append`], it does not wait for durability.
    fn create(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError>;

    /// Appends `record`: assigns the session's next sequence (1, 2, 3, … per session, no gaps),
    /// stamps `recorded_at_ms` (wall clock, milliseconds since the Unix epoch, never decreasing
    /// within a session), applies the record to the projections with [`apply`], and queues it for
    /// durability. Returns the sequence at once; the record is visible to reads immediately, but
    /// is not durable until [`Journal::on_durable`] says so.
    ///
    /// Refuses with [`JournalError::UnknownSession`] a session never created or deleted, and with
    /// [`JournalError::Failed`] a `session_created` record (use [`Journal::create`]). Malformed
    /// data is stored anyway (see [`apply`]).
    fn append(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError>;

    /// Calls `done` exactly once: with `Ok` once every record of `session` up to `sequence` is
    /// durable, or with the error that prevented it ([`JournalError::UnknownSession`] for a
    /// session that does not exist, [`JournalError::Failed`] for a sequence never appended or a
    /// write that failed).
    ///
    /// May call `done` inline before returning (the in-memory journal always does), or later on
    /// another thread. Never calls it while holding a lock the caller could need, so `done` may
    /// call the journal. `done` must not block for long: it may run on the journal's own thread.
    fn on_durable(&self, session: &SessionId, sequence: u64, done: DurableCallback);

    /// Appends `record` as [`Journal::append`] does and blocks until it is durable (or failed to
    /// be); returns its sequence.
    ///
    /// For threads that may block, such as callback executors; the dispatcher uses
    /// [`Journal::append`] and [`Journal::on_durable`] instead. If the record was appended but
    /// could not be made durable, the error is returned and the sequence is lost to the caller:
    /// the record must not be acknowledged. The default waits for [`Journal::on_durable`]; a
    /// journal may instead flush on the calling thread (the disk journal does, when no other
    /// thread is flushing, which spares two thread hand-offs per record). A wrapper that
    /// delegates to another journal should delegate this too.
    fn append_durable(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        let sequence = self.append(session, record)?;
        let (promise, expected) = crate::handoff::oneshot();
        self.on_durable(
            session,
            sequence,
            Box::new(move |result| promise.deliver(result)),
        );
        match expected.wait() {
            Some(result) => result.map(|()| sequence),
            None => Err(JournalError::Failed(format!(
                "the journal dropped the durability callback of record {sequence} of session \
                 {session}"
            ))),
        }
    }

    /// Appends the `transcript_delta` record `{"keep": keep, "append": append}` (keep the first
    /// `keep` messages of the transcript, then append `append`) and blocks until it is durable,
    /// as [`Journal::append_durable`] does; returns its sequence. It reads back, and projects,
    /// exactly as that record appended as a [`NewRecord`] would.
    ///
    /// The default appends it as a [`NewRecord`]; a journal that stores JSON text should encode
    /// it from the messages and project them as they are, without a `Value` tree of them in
    /// between. A wrapper that delegates to another journal should delegate this too.
    fn append_transcript_durable(
        &self,
        session: &SessionId,
        keep: usize,
        append: &[Message],
    ) -> Result<u64, JournalError> {
        self.append_durable(session, transcript_delta(keep, append))
    }

    /// Appends the `transcript_delta` record as [`Journal::append_transcript_durable`] does, but
    /// returns its sequence at once, as [`Journal::append`] does: durability is reported through
    /// [`Journal::on_durable`]. For the dispatcher, which must not wait for the disk. The default
    /// appends it as a [`NewRecord`]. A wrapper that delegates to another journal should
    /// delegate this too.
    fn append_transcript(
        &self,
        session: &SessionId,
        keep: usize,
        append: &[Message],
    ) -> Result<u64, JournalError> {
        self.append(session, transcript_delta(keep, append))
    }

    /// Appends an effect record whose data is already encoded, as [`Journal::append`] does, and
    /// calls `done` exactly once: with the record's sequence once it is durable, or with the
    /// error that prevented it (including a refused append). The record reads back, and
    /// projects, exactly as the same record appended as a [`NewRecord`] would.
    ///
    /// For the records a callback would otherwise wait for: the calling thread goes back to its
    /// own work instead of waiting for another thread's flush. The default appends the record
    /// as a [`NewRecord`] (it parses the data back into a `Value`) and passes `done` to
    /// [`Journal::on_durable`]; a journal that stores JSON text should store the text as it is,
    /// and may flush on the calling thread when nobody else is (then `done` has run before this
    /// returns). `done` must not block for long (see [`Journal::on_durable`]). A wrapper that
    /// delegates to another journal should delegate this too.
    fn append_effect_then(
        &self,
        session: &SessionId,
        record: EffectRecord,
        done: AppendedCallback,
    ) {
        self.append_effect_queued(session, record, done);
    }

    /// Appends an effect record and calls `done` as [`Journal::append_effect_then`] does, but
    /// never flushes on the calling thread: `done` runs on whichever thread makes the record
    /// durable (inline only when that is this one without waiting, as in a journal whose
    /// records are durable at once).
    ///
    /// For the dispatcher, which starts model and tool calls itself and must never wait for the
    /// disk. The default is the default of [`Journal::append_effect_then`]. A wrapper that
    /// delegates to another journal should delegate this too.
    fn append_effect_queued(
        &self,
        session: &SessionId,
        record: EffectRecord,
        done: AppendedCallback,
    ) {
        match self.append(session, record.to_record()) {
            Ok(sequence) => {
                self.on_durable(
                    session,
                    sequence,
                    Box::new(move |durable| done(durable.map(|()| sequence))),
                );
            }
            Err(error) => done(Err(error)),
        }
    }

    /// Places an effect record when the journal is idle (no frame waits to be written and
    /// nobody is flushing), without flushing it or waking anyone: the caller hands the returned
    /// [`Placed`] to a thread that may block, which makes it durable with
    /// [`Journal::flush_placed`] before it performs the effect. Gives the record back, unplaced,
    /// when the journal is busy, and always in the default (which has no such path): then use
    /// [`Journal::append_effect_queued`].
    ///
    /// For the dispatcher at low load: the executor that performs the effect flushes its started
    /// record itself, instead of the writer thread flushing it and then waking an executor.
    /// Under load the journal is never idle and batches stay with the writer. A wrapper that
    /// delegates to another journal should delegate this and `flush_placed` too.
    ///
    /// # Errors
    /// As [`Journal::append`].
    fn place_effect_if_idle(
        &self,
        session: &SessionId,
        record: EffectRecord,
    ) -> Result<IdlePlacement, JournalError> {
        let _ = session;
        Ok(IdlePlacement::Busy(record))
    }

    /// Blocks until the record [`Journal::place_effect_if_idle`] placed is durable, flushing on
    /// this thread if nobody else is. The default, whose `place_effect_if_idle` never places,
    /// refuses.
    ///
    /// # Errors
    /// When the record cannot be made durable (the journal failed).
    fn flush_placed(&self, placed: &Placed) -> Result<(), JournalError> {
        let _ = placed;
        Err(JournalError::Failed(
            "this journal does not place records for others to flush".to_owned(),
        ))
    }

    /// The records with sequence greater than `after`, oldest first, at most `limit`: each as an
    /// [`Event`] whose `type` is the record's kind (e.g. `event_emitted`) and whose `data` is the
    /// record's payload as appended. May include records not yet durable.
    fn read(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, JournalError>;

    /// The `event_emitted` records with sequence greater than `after` whose origin kind is not
    /// `agentloop` (a record without origin counts), oldest first, at most `limit`: the events an
    /// activation is given (PROTOCOL.md §6).
    ///
    /// Each comes as the harness sees it: `type` and `data` are the emitter's, taken from the
    /// record's `{"type","data"}` payload (absent `data` is `null`); `sequence`, `recorded_at_ms`
    /// and `origin` are the record's. A record whose payload lacks a string `type` (a bug in whoever
    /// built it) is logged and given as [`Journal::read`] would give it.
    fn pending_events(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, JournalError>;

    /// A copy of the session's projections as of its last appended record.
    fn view(&self, session: &SessionId) -> Result<SessionView, JournalError>;

    /// Runs `inspect` on the session's projections as of its last appended record, without
    /// copying them: for callers that need one field of a large view (a callback reads the model
    /// call count or compares a transcript). `inspect` runs under the session's lock, so it must
    /// not call the journal. The default copies the view with [`Journal::view`].
    fn inspect(
        &self,
        session: &SessionId,
        inspect: &mut dyn FnMut(&SessionView),
    ) -> Result<(), JournalError> {
        inspect(&self.view(session)?);
        Ok(())
    }

    /// A copy of one kv value: `None` for an absent key, `Some(Value::Null)` for a stored `null`.
    /// Reserved `brain.` keys are readable too.
    fn kv_get(&self, session: &SessionId, key: &str) -> Result<Option<Value>, JournalError>;

    /// [`Journal::kv_get`], if it can answer from memory without reading a file (it may wait for
    /// the session's lock); `None` when it would have to read. The dispatcher answers `kv.get`
    /// callbacks itself when this answers, sparing two thread hand-offs, and leaves the others to
    /// the callback executors, which may block. The default is `None`.
    fn kv_get_cached(
        &self,
        session: &SessionId,
        key: &str,
    ) -> Option<Result<Option<Value>, JournalError>> {
        let _ = (session, key);
        None
    }

    /// The session goes quiet for a long while (it was passivated): drops what the journal keeps
    /// in memory only to serve it fast (its projections, its copies of written records, spare
    /// capacity), so that it costs what a recovered session costs. Everything is still on disk
    /// and is read back when the session is next used. Never blocks on I/O; does nothing for a
    /// session that does not exist. The default (for journals that hold nothing spare) does
    /// nothing. A wrapper that delegates to another journal should delegate this too.
    fn release(&self, session: &SessionId) {
        let _ = session;
    }

    /// Makes the session unreadable at once: every later call naming it fails
    /// [`JournalError::UnknownSession`] (an append racing with the delete either lands before it
    /// or fails). Space is reclaimed later. [`JournalError::UnknownSession`] if it does not exist.
    fn delete(&self, session: &SessionId) -> Result<(), JournalError>;

    /// The ids of every existing (created and not deleted) session, in id order.
    fn sessions(&self) -> Result<Vec<SessionId>, JournalError>;

    /// Blocks until everything appended, created or deleted before the call is durable. The
    /// default (for journals that are durable at once, or never) returns at once.
    fn sync(&self) -> Result<(), JournalError> {
        Ok(())
    }

    /// Why this journal can no longer make records durable, once a write or flush failed; `None`
    /// while healthy. Once `Some`, it stays `Some` (a failure is fatal): every later create,
    /// append and delete fails, and so does every durability callback for a record that was not
    /// yet durable; reads may keep working. For readiness checks: never blocks on I/O. The
    /// default (for journals that cannot fail) is `None`. A wrapper that delegates to another
    /// journal should delegate this too, or it hides the failure.
    fn failure(&self) -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_effect_record_refuses_other_kinds_and_data_that_is_not_an_object() {
        let data = json!({"activation": 1});
        for kind in [RecordKind::KvSet, RecordKind::ModelCallFinished] {
            let error = EffectRecord::started(kind, &data).unwrap_err();
            assert!(
                error.to_string().contains("not the started record"),
                "{error}"
            );
        }
        let error = EffectRecord::finished(RecordKind::ToolCallStarted, 2, &data).unwrap_err();
        assert!(
            error.to_string().contains("not the finished record"),
            "{error}"
        );
        let error = EffectRecord::started(RecordKind::ToolCallStarted, &[1, 2]).unwrap_err();
        assert!(
            error.to_string().contains("must be a JSON object"),
            "{error}"
        );
        let error = EffectRecord::finished(RecordKind::ToolCallFinished, 2, &"ok").unwrap_err();
        assert!(error.to_string().contains("cannot be encoded"), "{error}");
    }

    #[test]
    fn a_finished_record_names_its_started_record_in_its_data_and_its_projection() {
        let record = EffectRecord::finished(
            RecordKind::EnvironmentFinished,
            7,
            &json!({"outcome": "ok", "result": {"text": "é \"q\""}}),
        )
        .unwrap();
        let expected = json!({"outcome": "ok", "result": {"text": "é \"q\""}, "started": 7});
        assert_eq!(record.to_record().data, expected);
        assert_eq!(record.projected().data, json!({"started": 7}));
        let started = EffectRecord::started(RecordKind::ModelCallStarted, &json!({})).unwrap();
        assert_eq!(started.projected().data, Value::Null);
    }
}
