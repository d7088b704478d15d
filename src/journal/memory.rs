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

    fn kv_get(&self, session: &SessionId, key: &str) -> Result<Option<Value>, JournalError> {
        self.with_stream(session, |stream| Ok(stream.view.kv.get(key).cloned()))
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
    use super::*;
    use crate::journal::{SessionStatus, append_durable};
    use serde_json::json;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn id(n: usize) -> SessionId {
        SessionId::parse(&format!("ses_{n:020}")).unwrap()
    }

    fn record(kind: RecordKind, data: Value) -> NewRecord {
        NewRecord {
            kind,
            data,
            origin: None,
        }
    }

    fn created() -> NewRecord {
        record(RecordKind::SessionCreated, json!({"agentloop": "pi"}))
    }

    fn emitted(event_type: &str, data: Value, origin: Option<OriginKind>) -> NewRecord {
        NewRecord {
            kind: RecordKind::EventEmitted,
            data: json!({"type": event_type, "data": data}),
            origin: origin.map(|kind| EventOrigin { kind, sequence: 1 }),
        }
    }

    /// A journal holding session `id(0)`, created.
    fn journal() -> (MemoryJournal, SessionId) {
        let journal = MemoryJournal::new();
        let session = id(0);
        assert_eq!(journal.create(&session, created()).unwrap(), 1);
        (journal, session)
    }

    fn sequences(events: &[Event]) -> Vec<u64> {
        events.iter().map(|e| e.sequence).collect()
    }

    #[test]
    fn sequences_start_at_one_without_gaps_per_session() {
        let journal = MemoryJournal::new();
        let (a, b) = (id(1), id(2));
        assert_eq!(journal.create(&a, created()).unwrap(), 1);
        assert_eq!(journal.create(&b, created()).unwrap(), 1);
        for expected in 2..=5 {
            let kv = json!({"key": "k", "value": expected});
            assert_eq!(
                journal.append(&a, record(RecordKind::KvSet, kv)).unwrap(),
                expected
            );
        }
        assert_eq!(
            journal
                .append(&b, record(RecordKind::KvDelete, json!({"key": "k"})))
                .unwrap(),
            2
        );
        assert_eq!(journal.view(&a).unwrap().last_sequence, 5);
        assert_eq!(journal.view(&b).unwrap().last_sequence, 2);
        assert_eq!(journal.sessions().unwrap(), vec![a, b]);
    }

    #[test]
    fn read_returns_records_after_a_sequence_up_to_a_limit() {
        let (journal, session) = journal();
        for n in 0..5 {
            journal
                .append(
                    &session,
                    record(RecordKind::KvSet, json!({"key": "n", "value": n})),
                )
                .unwrap();
        }
        let all = journal.read(&session, 0, 100).unwrap();
        assert_eq!(sequences(&all), [1, 2, 3, 4, 5, 6]);
        assert_eq!(all[0].event_type, "session_created");
        assert_eq!(all[0].data, json!({"agentloop": "pi"}));
        assert_eq!(all[1].event_type, "kv_set");
        assert_eq!(all[1].data, json!({"key": "n", "value": 0}));
        assert!(
            all.windows(2)
                .all(|w| w[0].recorded_at_ms <= w[1].recorded_at_ms)
        );
        assert!(all[0].recorded_at_ms > 0);
        assert_eq!(sequences(&journal.read(&session, 2, 2).unwrap()), [3, 4]);
        assert_eq!(sequences(&journal.read(&session, 4, 100).unwrap()), [5, 6]);
        assert!(journal.read(&session, 6, 100).unwrap().is_empty());
        assert!(journal.read(&session, u64::MAX, 100).unwrap().is_empty());
        assert!(journal.read(&session, 0, 0).unwrap().is_empty());
    }

    #[test]
    fn pending_events_exclude_the_harness_own_and_respect_after_and_limit() {
        let (journal, session) = journal();
        let appended = [
            emitted("mine", json!(1), Some(OriginKind::Agentloop)),
            emitted("from-client", json!({"a": 1}), Some(OriginKind::Client)),
            record(RecordKind::KvSet, json!({"key": "k", "value": 1})),
            emitted("from-tool", json!(2), Some(OriginKind::Tool)),
            emitted("unknown-origin", json!(3), None),
            emitted("mine-again", json!(4), Some(OriginKind::Agentloop)),
        ]
        .into_iter()
        .map(|r| journal.append(&session, r).unwrap())
        .collect::<Vec<_>>();
        assert_eq!(appended, [2, 3, 4, 5, 6, 7]);

        let events = journal.pending_events(&session, 0, 100).unwrap();
        assert_eq!(sequences(&events), [3, 5, 6]);
        assert_eq!(events[0].event_type, "from-client");
        assert_eq!(events[0].data, json!({"a": 1}));
        assert_eq!(
            events[0].origin,
            Some(EventOrigin {
                kind: OriginKind::Client,
                sequence: 1
            })
        );
        assert_eq!(events[2].origin, None);
        assert_eq!(
            sequences(&journal.pending_events(&session, 3, 100).unwrap()),
            [5, 6]
        );
        assert_eq!(
            sequences(&journal.pending_events(&session, 0, 2).unwrap()),
            [3, 5]
        );
        assert_eq!(
            sequences(&journal.pending_events(&session, 4, 1).unwrap()),
            [5]
        );
        assert!(journal.pending_events(&session, 6, 100).unwrap().is_empty());
        assert!(journal.pending_events(&session, 0, 0).unwrap().is_empty());

        // `read` gives the raw records, the harness's own included.
        let raw = journal.read(&session, 1, 1).unwrap();
        assert_eq!(raw[0].event_type, "event_emitted");
        assert_eq!(raw[0].data, json!({"type": "mine", "data": 1}));
    }

    #[test]
    fn appends_update_the_view_and_kv_get_finds_a_stored_null() {
        let (journal, session) = journal();
        let append = |kind, data| journal.append(&session, record(kind, data)).unwrap();
        append(RecordKind::ActivationQueued, json!({}));
        append(RecordKind::ActivationStarted, json!({"activation": 2}));
        append(RecordKind::KvSet, json!({"key": "nothing", "value": null}));
        append(RecordKind::KvSet, json!({"key": "gone", "value": 1}));
        append(RecordKind::KvDelete, json!({"key": "gone"}));
        assert_eq!(
            journal.kv_get(&session, "nothing").unwrap(),
            Some(Value::Null)
        );
        assert_eq!(journal.kv_get(&session, "gone").unwrap(), None);
        assert_eq!(
            journal
                .kv_get(&session, "brain.harness.activation")
                .unwrap(),
            Some(json!({"sequence": 2}))
        );
        assert_eq!(journal.view(&session).unwrap().marker, Some(2));

        append(
            RecordKind::ActivationFinished,
            json!({"activation": 2, "outcome": "completed", "events_through": 4}),
        );
        let view = journal.view(&session).unwrap();
        assert_eq!(view.marker, None);
        assert_eq!(view.events_cursor, 4);
        assert_eq!(
            journal.kv_get(&session, "brain.events_cursor").unwrap(),
            Some(json!(4))
        );
        assert_eq!(view.last_sequence, 7);

        append(RecordKind::SessionPassivated, json!({}));
        assert_eq!(
            journal.view(&session).unwrap().status,
            SessionStatus::Passivated
        );
        append(RecordKind::ActivationQueued, json!({}));
        assert_eq!(journal.view(&session).unwrap().status, SessionStatus::Open);
        append(RecordKind::SessionClosed, json!({}));
        assert_eq!(
            journal.view(&session).unwrap().status,
            SessionStatus::Closed
        );
    }

    #[test]
    fn malformed_data_is_stored_without_its_projection() {
        let (journal, session) = journal();
        let sequence = journal
            .append(
                &session,
                record(RecordKind::TranscriptDelta, json!({"keep": "x"})),
            )
            .unwrap();
        assert_eq!(sequence, 2);
        let view = journal.view(&session).unwrap();
        assert_eq!(view.last_sequence, 2);
        assert_eq!(view.transcript_through, 0);
        assert_eq!(
            journal.read(&session, 1, 10).unwrap()[0].data,
            json!({"keep": "x"})
        );
    }

    #[test]
    fn a_replay_through_apply_reproduces_the_view() {
        let (journal, session) = journal();
        let records = [
            record(RecordKind::ActivationQueued, json!({})),
            record(RecordKind::ActivationStarted, json!({"activation": 2})),
            record(RecordKind::ModelCallStarted, json!({})),
            record(RecordKind::ModelCallFinished, json!({"started": 4})),
            record(RecordKind::ToolCallStarted, json!({})),
            record(
                RecordKind::TranscriptDelta,
                json!({"keep": 0, "append": [{"role": "user", "content": []}]}),
            ),
            emitted("x", json!(null), Some(OriginKind::Client)),
            record(RecordKind::KvSet, json!({"key": "k", "value": [1]})),
        ];
        for r in records {
            journal.append(&session, r).unwrap();
        }
        let mut replayed = SessionView::default();
        for event in journal.read(&session, 0, 100).unwrap() {
            let kind = event.event_type.parse().unwrap();
            let r = NewRecord {
                kind,
                data: event.data,
                origin: event.origin,
            };
            apply(&mut replayed, event.sequence, &r).unwrap();
        }
        assert_eq!(replayed, journal.view(&session).unwrap());
        assert_eq!(replayed.unfinished_effects, [6]);
        assert_eq!(replayed.model_calls, 1);
    }

    #[test]
    fn create_refuses_an_existing_session_and_a_wrong_first_record() {
        let (journal, session) = journal();
        assert!(matches!(
            journal.create(&session, created()),
            Err(JournalError::AlreadyExists(s)) if s == session
        ));
        let other = id(9);
        let error = journal
            .create(
                &other,
                record(RecordKind::KvSet, json!({"key": "k", "value": 1})),
            )
            .unwrap_err();
        assert!(matches!(error, JournalError::Failed(_)));
        assert!(matches!(
            journal.view(&other),
            Err(JournalError::UnknownSession(_))
        ));
        // A second session_created cannot be appended either.
        assert!(matches!(
            journal.append(&session, created()),
            Err(JournalError::Failed(_))
        ));
        assert_eq!(journal.view(&session).unwrap().last_sequence, 1);
    }

    #[test]
    fn every_call_naming_a_deleted_or_unknown_session_fails_unknown_session() {
        let (journal, session) = journal();
        journal
            .append(
                &session,
                record(RecordKind::KvSet, json!({"key": "k", "value": 1})),
            )
            .unwrap();
        journal.delete(&session).unwrap();
        for gone in [session.clone(), id(7)] {
            let unknown = |result: Result<(), JournalError>| {
                assert!(
                    matches!(&result, Err(JournalError::UnknownSession(s)) if *s == gone),
                    "{result:?}"
                );
            };
            let kv = record(RecordKind::KvSet, json!({"key": "k", "value": 2}));
            unknown(journal.append(&gone, kv).map(drop));
            unknown(journal.read(&gone, 0, 10).map(drop));
            unknown(journal.pending_events(&gone, 0, 10).map(drop));
            unknown(journal.view(&gone).map(drop));
            unknown(journal.kv_get(&gone, "k").map(drop));
            unknown(journal.delete(&gone));
            unknown(
                append_durable(
                    &journal,
                    &gone,
                    record(RecordKind::KvDelete, json!({"key": "k"})),
                )
                .map(drop),
            );
            let (sender, receiver) = crossbeam_channel::bounded(1);
            journal.on_durable(&gone, 1, Box::new(move |r| sender.send(r).unwrap()));
            unknown(receiver.try_recv().unwrap());
        }
        assert!(journal.sessions().unwrap().is_empty());

        // The id may be created again; it is a new stream.
        assert_eq!(journal.create(&session, created()).unwrap(), 1);
        assert_eq!(journal.kv_get(&session, "k").unwrap(), None);
    }

    #[test]
    fn append_durable_returns_the_sequence() {
        let (journal, session) = journal();
        let kv = record(RecordKind::KvSet, json!({"key": "k", "value": 1}));
        assert_eq!(append_durable(&journal, &session, kv).unwrap(), 2);
        let kv = record(RecordKind::KvDelete, json!({"key": "k"}));
        assert_eq!(append_durable(&journal, &session, kv).unwrap(), 3);
    }

    #[test]
    fn on_durable_calls_back_once_inline_without_holding_locks() {
        let journal = Arc::new(MemoryJournal::new());
        let session = id(3);
        journal.create(&session, created()).unwrap();
        let sequence = journal
            .append(
                &session,
                record(RecordKind::KvSet, json!({"key": "k", "value": 1})),
            )
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let (inner, counter, id) = (journal.clone(), calls.clone(), session.clone());
        journal.on_durable(
            &session,
            sequence,
            Box::new(move |result| {
                result.unwrap();
                counter.fetch_add(1, Ordering::SeqCst);
                // The journal's locks are free: the callback may use it (this would deadlock
                // otherwise).
                inner
                    .append(&id, record(RecordKind::KvDelete, json!({"key": "k"})))
                    .unwrap();
                inner.view(&id).unwrap();
            }),
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(journal.view(&session).unwrap().last_sequence, 3);

        // Sequence 0 (nothing) is durable; a sequence never appended is an error.
        let (sender, receiver) = crossbeam_channel::bounded(2);
        let again = sender.clone();
        journal.on_durable(&session, 0, Box::new(move |r| sender.send(r).unwrap()));
        journal.on_durable(&session, 4, Box::new(move |r| again.send(r).unwrap()));
        assert!(receiver.try_recv().unwrap().is_ok());
        assert!(matches!(
            receiver.try_recv().unwrap(),
            Err(JournalError::Failed(_))
        ));
        assert!(receiver.try_recv().is_err());
    }

    #[test]
    fn concurrent_appends_produce_gapless_ordered_sequences() {
        const THREADS: usize = 8;
        const RECORDS: u64 = 1000;
        const SESSIONS: usize = 4;
        let journal = MemoryJournal::new();
        let sessions: Vec<SessionId> = (0..SESSIONS).map(id).collect();
        for session in &sessions {
            journal.create(session, created()).unwrap();
        }
        std::thread::scope(|scope| {
            for thread in 0..THREADS {
                let (journal, session) = (&journal, &sessions[thread % SESSIONS]);
                scope.spawn(move || {
                    let mut last = 0;
                    for i in 0..RECORDS {
                        let data = json!({"key": format!("t{thread}"), "value": i});
                        let sequence = if i % 2 == 0 {
                            journal.append(session, record(RecordKind::KvSet, data))
                        } else {
                            append_durable(journal, session, record(RecordKind::KvSet, data))
                        }
                        .unwrap();
                        assert!(sequence > last);
                        last = sequence;
                    }
                });
            }
        });
        let per_session = (THREADS / SESSIONS) as u64 * RECORDS + 1;
        for session in &sessions {
            let events = journal.read(session, 0, usize::MAX).unwrap();
            assert_eq!(sequences(&events), (1..=per_session).collect::<Vec<_>>());
            // Each thread's records appear in the order it appended them.
            let mut next: HashMap<String, u64> = HashMap::new();
            for event in &events[1..] {
                let key = event.data["key"].as_str().unwrap().to_owned();
                let expected = next.entry(key).or_insert(0);
                assert_eq!(event.data["value"], json!(*expected));
                *expected += 1;
            }
            assert_eq!(next.len(), THREADS / SESSIONS);
            assert!(next.values().all(|&n| n == RECORDS));
            assert_eq!(journal.view(session).unwrap().last_sequence, per_session);
        }
    }
}
