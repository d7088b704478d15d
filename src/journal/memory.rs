//! The in-memory journal: every record is durable the moment it is appended, and gone when the
//! process ends. For tests and for embedders that need no persistence.
//!
//! Locking: a map from session id to that session's stream behind a read-write lock, taken only to
//! find, insert or remove a stream (never while a stream is locked), and one mutex per stream,
//! under which its sequence is assigned, its record stored and its projections updated. Appends to
//! different sessions therefore only share the map's read lock. No lock is held while a
//! [`DurableCallback`] runs.

use super::{DurableCallback, Journal, JournalError, NewRecord, SessionView, apply};
use crate::protocol::harness::{Event, EventOrigin, OriginKind, RecordKind};
use crate::session::SessionId;
use parking_lot::{Mutex, RwLock};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A [`Journal`] kept in memory. Cheap to create; share it behind an `Arc`.
///
/// [`Journal::on_durable`] calls its callback inline, before returning: a record is durable as
/// soon as [`Journal::append`] returns. Nothing survives the process.
#[derive(Default)]
pub struct MemoryJournal {
    streams: RwLock<HashMap<SessionId, Arc<Mutex<Stream>>>>,
}

/// One session's records and projections.
struct Stream {
    /// The records; the record with sequence `s` is at index `s - 1`.
    records: Vec<Stored>,
    /// The projections of `records`.
    view: SessionView,
    /// The sequences of the `event_emitted` records not emitted by the harness, ascending.
    pending: Vec<u64>,
    /// Set when the session is deleted, for callers that found the stream before the delete.
    deleted: bool,
}

/// A stored record; its sequence is its position.
struct Stored {
    kind: RecordKind,
    recorded_at_ms: u64,
    data: Value,
    origin: Option<EventOrigin>,
}

impl MemoryJournal {
    /// An empty journal.
    pub fn new() -> MemoryJournal {
        MemoryJournal::default()
    }

    /// The session's stream, or `UnknownSession`. The map lock is released before returning.
    fn stream(&self, session: &SessionId) -> Result<Arc<Mutex<Stream>>, JournalError> {
        self.streams
            .read()
            .get(session)
            .cloned()
            .ok_or_else(|| JournalError::UnknownSession(session.clone()))
    }

    /// Runs `f` on the session's locked stream, refusing a deleted one.
    fn with_stream<T>(
        &self,
        session: &SessionId,
        f: impl FnOnce(&mut Stream) -> Result<T, JournalError>,
    ) -> Result<T, JournalError> {
        let stream = self.stream(session)?;
        let mut stream = stream.lock();
        if stream.deleted {
            return Err(JournalError::UnknownSession(session.clone()));
        }
        f(&mut stream)
    }
}

impl Stream {
    fn new() -> Stream {
        Stream {
            records: Vec::new(),
            view: SessionView::default(),
            pending: Vec::new(),
            deleted: false,
        }
    }

    /// Stores `record` with the next sequence and applies it; returns the sequence.
    fn push(&mut self, session: &SessionId, record: NewRecord) -> u64 {
        let sequence = self.view.last_sequence + 1;
        if let Err(why) = apply(&mut self.view, sequence, &record) {
            log::warn!(
                "journal: session {session} record {sequence} ({}): projection skipped: {why}",
                record.kind
            );
        }
        if record.kind == RecordKind::EventEmitted
            && record.origin.map(|o| o.kind) != Some(OriginKind::Agentloop)
        {
            self.pending.push(sequence);
        }
        let previous = self.records.last().map_or(0, |r| r.recorded_at_ms);
        self.records.push(Stored {
            kind: record.kind,
            recorded_at_ms: now_ms().max(previous),
            data: record.data,
            origin: record.origin,
        });
        sequence
    }

    /// The stored record with `sequence`, if any.
    fn get(&self, sequence: u64) -> Option<&Stored> {
        let index = usize::try_from(sequence.checked_sub(1)?).ok()?;
        self.records.get(index)
    }

    /// Index of the first record with a sequence above `after`.
    fn index_after(&self, after: u64) -> usize {
        usize::try_from(after)
            .unwrap_or(usize::MAX)
            .min(self.records.len())
    }
}

impl Stored {
    /// The record as [`Journal::read`] gives it.
    fn event(&self, sequence: u64) -> Event {
        Event {
            sequence,
            event_type: self.kind.as_str().to_owned(),
            recorded_at_ms: self.recorded_at_ms,
            data: self.data.clone(),
            origin: self.origin,
        }
    }

    /// An `event_emitted` record as [`Journal::pending_events`] gives it.
    fn emitted(&self, session: &SessionId, sequence: u64) -> Event {
        match self.data.get("type").and_then(Value::as_str) {
            Some(event_type) => Event {
                sequence,
                event_type: event_type.to_owned(),
                recorded_at_ms: self.recorded_at_ms,
                data: self.data.get("data").cloned().unwrap_or(Value::Null),
                origin: self.origin,
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

/// Wall-clock milliseconds since the Unix epoch (0 for a clock set before it).
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Journal for MemoryJournal {
    fn create(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        if record.kind != RecordKind::SessionCreated {
            return Err(JournalError::Failed(format!(
                "session {session}: the first record must be session_created, not {}",
                record.kind
            )));
        }
        let mut stream = Stream::new();
        let sequence = stream.push(session, record);
        let mut streams = self.streams.write();
        if streams.contains_key(session) {
            return Err(JournalError::AlreadyExists(session.clone()));
        }
        streams.insert(session.clone(), Arc::new(Mutex::new(stream)));
        Ok(sequence)
    }

    fn append(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        if record.kind == RecordKind::SessionCreated {
            return Err(JournalError::Failed(format!(
                "session {session}: session_created is only the first record (use create)"
            )));
        }
        self.with_stream(session, |stream| Ok(stream.push(session, record)))
    }

    fn on_durable(&self, session: &SessionId, sequence: u64, done: DurableCallback) {
        let result = self.with_stream(session, |stream| {
            if sequence > stream.view.last_sequence {
                Err(JournalError::Failed(format!(
                    "session {session}: record {sequence} was never appended (last is {})",
                    stream.view.last_sequence
                )))
            } else {
                Ok(())
            }
        });
        // `with_stream` has released every lock.
        done(result);
    }

    fn read(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, JournalError> {
        self.with_stream(session, |stream| {
            Ok(stream
                .records
                .iter()
                .enumerate()
                .skip(stream.index_after(after))
                .take(limit)
                // The record at index `i` has sequence `i + 1` (usize fits in u64).
                .map(|(index, record)| record.event(index as u64 + 1))
                .collect())
        })
    }

    fn pending_events(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, JournalError> {
        self.with_stream(session, |stream| {
            let start = stream.pending.partition_point(|&s| s <= after);
            Ok(stream.pending[start..]
                .iter()
                .take(limit)
                .filter_map(|&sequence| {
                    let record = stream.get(sequence);
                    debug_assert!(record.is_some(), "pending record {sequence} is stored");
                    record.map(|r| r.emitted(session, sequence))
                })
                .collect())
        })
    }

    fn view(&self, session: &SessionId) -> Result<SessionView, JournalError> {
        self.with_stream(session, |stream| Ok(stream.view.clone()))
    }

    fn inspect(
        &self,
        session: &SessionId,
        inspect: &mut dyn FnMut(&SessionView),
    ) -> Result<(), JournalError> {
        self.with_stream(session, |stream| {
            inspect(&stream.view);
            Ok(())
        })
    }

    fn kv_get(&self, session: &SessionId, key: &str) -> Result<Option<Value>, JournalError> {
        self.with_stream(session, |stream| Ok(stream.view.kv.get(key).cloned()))
    }

    fn kv_get_cached(
        &self,
        session: &SessionId,
        key: &str,
    ) -> Option<Result<Option<Value>, JournalError>> {
        Some(self.kv_get(session, key))
    }

    fn delete(&self, session: &SessionId) -> Result<(), JournalError> {
        let removed = self.streams.write().remove(session);
        let stream = removed.ok_or_else(|| JournalError::UnknownSession(session.clone()))?;
        // Callers that found the stream before the removal see the flag; the memory goes when the
        // last of them lets go of it.
        let mut stream = stream.lock();
        stream.deleted = true;
        stream.records = Vec::new();
        stream.pending = Vec::new();
        stream.view = SessionView::default();
        Ok(())
    }

    fn sessions(&self) -> Result<Vec<SessionId>, JournalError> {
        let mut ids: Vec<SessionId> = self.streams.read().keys().cloned().collect();
        ids.sort();
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    //! The behaviour every journal shares is tested once, through the trait, in
    //! `conformance.rs` (against this journal and the durable one); here only what is particular
    //! to the in-memory journal: it reports durability inline.
    use super::*;
    use crate::journal::conformance::{created, id, record};
    use serde_json::json;

    #[test]
    fn on_durable_reports_inline_and_refuses_a_sequence_never_appended() {
        let journal = MemoryJournal::new();
        let session = id(3);
        journal.create(&session, created()).unwrap();
        let sequence = journal
            .append(
                &session,
                record(RecordKind::KvSet, json!({"key": "k", "value": 1})),
            )
            .unwrap();
        let (sender, receiver) = crossbeam_channel::bounded(3);
        for asked in [sequence, 0, sequence + 1] {
            let sender = sender.clone();
            journal.on_durable(&session, asked, Box::new(move |r| sender.send(r).unwrap()));
        }
        // Every answer is there before on_durable returned: nothing to wait for in memory.
        assert!(receiver.try_recv().unwrap().is_ok());
        assert!(
            receiver.try_recv().unwrap().is_ok(),
            "sequence 0 is trivially durable"
        );
        assert!(matches!(
            receiver.try_recv().unwrap(),
            Err(JournalError::Failed(_))
        ));
        assert!(receiver.try_recv().is_err());
    }
}
