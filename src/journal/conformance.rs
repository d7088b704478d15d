//! The behaviour every [`Journal`] shares, run against [`MemoryJournal`] and [`DiskJournal`]
//! through the trait, so the durable journal is held to the reference semantics.

use super::{
    DiskJournal, DiskJournalOptions, EffectRecord, Journal, JournalError, MemoryJournal, NewRecord,
    SessionStatus, SessionView, apply,
};
use crate::protocol::harness::{Event, EventOrigin, OriginKind, RecordKind};
use crate::session::SessionId;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A directory under the system's temporary directory, removed (with its contents) on drop, or
/// kept and named on stderr when the test is failing.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    /// A new empty directory under the system's temporary directory.
    pub(crate) fn new(tag: &str) -> TempDir {
        TempDir::new_in(&std::env::temp_dir(), tag)
    }

    /// A new empty directory in `base` whose name includes `tag`, the process id and a counter.
    pub(crate) fn new_in(base: &Path, tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let path = base.join(format!(
            "brain-journal-{tag}-{}-{nanos}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept the failed test's directory {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub(crate) fn id(n: usize) -> SessionId {
    SessionId::parse(&format!("ses_{n:020}")).unwrap()
}

pub(crate) fn record(kind: RecordKind, data: Value) -> NewRecord {
    NewRecord {
        kind,
        data,
        origin: None,
    }
}

pub(crate) fn created() -> NewRecord {
    record(RecordKind::SessionCreated, json!({"agentloop": "pi"}))
}

pub(crate) fn emitted(event_type: &str, data: Value, origin: Option<OriginKind>) -> NewRecord {
    NewRecord {
        kind: RecordKind::EventEmitted,
        data: json!({"type": event_type, "data": data}),
        origin: origin.map(|kind| EventOrigin { kind, sequence: 1 }),
    }
}

pub(crate) fn sequences(events: &[Event]) -> Vec<u64> {
    events.iter().map(|e| e.sequence).collect()
}

/// Waits for `on_durable`'s answer (inline or from another thread).
pub(crate) fn durable(
    journal: &dyn Journal,
    session: &SessionId,
    sequence: u64,
) -> Result<(), JournalError> {
    let (sender, receiver) = crossbeam_channel::bounded(1);
    journal.on_durable(
        session,
        sequence,
        Box::new(move |r| sender.send(r).unwrap()),
    );
    receiver.recv().unwrap()
}

fn sequences_start_at_one_without_gaps_per_session(journal: Arc<dyn Journal>) {
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

fn read_returns_records_after_a_sequence_up_to_a_limit(journal: Arc<dyn Journal>) {
    let session = id(0);
    journal.create(&session, created()).unwrap();
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
    assert_eq!(
        sequences(&journal.read(&session, 0, usize::MAX).unwrap()).len(),
        6
    );
}

fn pending_events_exclude_the_harness_own_and_respect_after_and_limit(journal: Arc<dyn Journal>) {
    let session = id(0);
    journal.create(&session, created()).unwrap();
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

    // An event without a string `type` is given as `read` gives it.
    let odd = journal
        .append(
            &session,
            NewRecord {
                kind: RecordKind::EventEmitted,
                data: json!({"no-type": true}),
                origin: None,
            },
        )
        .unwrap();
    let events = journal.pending_events(&session, odd - 1, 10).unwrap();
    assert_eq!(events[0].event_type, "event_emitted");
    assert_eq!(events[0].data, json!({"no-type": true}));
}

fn appends_update_the_view_and_kv_get_finds_a_stored_null(journal: Arc<dyn Journal>) {
    let session = id(0);
    journal.create(&session, created()).unwrap();
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

fn malformed_data_is_stored_without_its_projection(journal: Arc<dyn Journal>) {
    let session = id(0);
    journal.create(&session, created()).unwrap();
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

fn a_replay_through_apply_reproduces_the_view(journal: Arc<dyn Journal>) {
    let session = id(0);
    journal.create(&session, created()).unwrap();
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

fn create_refuses_an_existing_session_and_a_wrong_first_record(journal: Arc<dyn Journal>) {
    let session = id(0);
    journal.create(&session, created()).unwrap();
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

fn every_call_naming_a_deleted_or_unknown_session_fails_unknown_session(journal: Arc<dyn Journal>) {
    let session = id(0);
    journal.create(&session, created()).unwrap();
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
            journal
                .append_durable(&gone, record(RecordKind::KvDelete, json!({"key": "k"})))
                .map(drop),
        );
        unknown(durable(&*journal, &gone, 1));
    }
    assert!(journal.sessions().unwrap().is_empty());

    // The id may be created again; it is a new stream.
    assert_eq!(journal.create(&session, created()).unwrap(), 1);
    assert_eq!(journal.kv_get(&session, "k").unwrap(), None);
    assert_eq!(sequences(&journal.read(&session, 0, 10).unwrap()), [1]);
}

fn append_durable_returns_the_sequence(journal: Arc<dyn Journal>) {
    let session = id(0);
    journal.create(&session, created()).unwrap();
    let kv = record(RecordKind::KvSet, json!({"key": "k", "value": 1}));
    assert_eq!(journal.append_durable(&session, kv).unwrap(), 2);
    let kv = record(RecordKind::KvDelete, json!({"key": "k"}));
    assert_eq!(journal.append_durable(&session, kv).unwrap(), 3);
}

fn effect_records_read_and_project_as_their_new_records(journal: Arc<dyn Journal>) {
    let request = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a \"quoted\" line\nand é"}
    ]}]});
    let result =
        json!({"message": {"role": "assistant", "content": []}, "stop_reason": "end_turn"});
    let started_data = json!({"activation": 1, "ordinal": 0, "request": request});
    let (encoded, plain) = (id(20), id(21));
    for session in [&encoded, &plain] {
        journal.create(session, created()).unwrap();
    }
    let started = EffectRecord::started(RecordKind::ModelCallStarted, &started_data).unwrap();
    let (sender, receiver) = crossbeam_channel::bounded(2);
    let durable_then = move |result| sender.send(result).unwrap();
    // The started record goes in as the dispatcher appends it: never flushed on this thread.
    journal.append_effect_queued(&encoded, started, Box::new(durable_then.clone()));
    let waited = std::time::Duration::from_secs(10);
    assert_eq!(receiver.recv_timeout(waited).unwrap().unwrap(), 2);
    let finished = EffectRecord::finished(
        RecordKind::ModelCallFinished,
        2,
        &json!({"outcome": "ok", "result": result}),
    )
    .unwrap();
    // The finished record goes in as a callback's last record does: done runs with its
    // sequence once it is durable, on whichever thread flushed it.
    journal.append_effect_then(&encoded, finished.clone(), Box::new(durable_then.clone()));
    assert_eq!(receiver.recv_timeout(waited).unwrap().unwrap(), 3);
    assert_eq!(journal.view(&encoded).unwrap().last_sequence, 3);
    // A refused append is reported to done rather than dropped (done is FnOnce: at most once).
    journal.append_effect_then(&id(22), finished, Box::new(durable_then));
    assert!(matches!(
        receiver.recv_timeout(waited).unwrap(),
        Err(JournalError::UnknownSession(_))
    ));
    journal
        .append_durable(&plain, record(RecordKind::ModelCallStarted, started_data))
        .unwrap();
    let finished_data = json!({"outcome": "ok", "result": result, "started": 2});
    journal
        .append_durable(&plain, record(RecordKind::ModelCallFinished, finished_data))
        .unwrap();

    let data = |session| -> Vec<(String, Value)> {
        let events = journal.read(session, 0, 10).unwrap();
        events.into_iter().map(|e| (e.event_type, e.data)).collect()
    };
    assert_eq!(data(&encoded), data(&plain));
    let view = journal.view(&encoded).unwrap();
    assert_eq!(view.model_calls, 1);
    assert!(view.unfinished_effects.is_empty(), "{view:?}");
    assert_eq!(view, journal.view(&plain).unwrap());
}

fn transcript_deltas_read_and_project_as_their_new_records(journal: Arc<dyn Journal>) {
    use crate::protocol::harness::{Message, Role};
    let (typed, plain) = (id(1), id(2));
    let first = [
        Message::text(Role::User, "a"),
        Message::text(Role::Assistant, "b \"q\""),
    ];
    let second = [Message::text(Role::User, "c")];
    for session in [&typed, &plain] {
        journal.create(session, created()).unwrap();
    }
    assert_eq!(
        journal
            .append_transcript_durable(&typed, 0, &first)
            .unwrap(),
        2
    );
    assert_eq!(
        journal
            .append_transcript_durable(&typed, 1, &second)
            .unwrap(),
        3
    );
    for (keep, append) in [(0, &first[..]), (1, &second[..])] {
        let data = json!({"keep": keep, "append": append});
        journal
            .append_durable(&plain, record(RecordKind::TranscriptDelta, data))
            .unwrap();
    }
    let (typed_view, plain_view) = (journal.view(&typed).unwrap(), journal.view(&plain).unwrap());
    assert_eq!(
        typed_view.transcript,
        vec![first[0].clone(), second[0].clone()]
    );
    assert_eq!(typed_view.transcript, plain_view.transcript);
    assert_eq!(typed_view.transcript_through, 3);
    let data = |events: Vec<Event>| events.into_iter().map(|e| e.data).collect::<Vec<_>>();
    assert_eq!(
        data(journal.read(&typed, 1, 10).unwrap()),
        data(journal.read(&plain, 1, 10).unwrap())
    );
    // A replay of what was read projects the same transcript.
    let mut replayed = SessionView::default();
    for (n, event) in journal.read(&typed, 0, 10).unwrap().into_iter().enumerate() {
        let kind = event.event_type.parse().unwrap();
        apply(&mut replayed, n as u64 + 1, &record(kind, event.data)).unwrap();
    }
    assert_eq!(replayed.transcript, typed_view.transcript);
}

fn on_durable_calls_back_once_without_holding_locks(journal: Arc<dyn Journal>) {
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
    let (sender, receiver) = crossbeam_channel::bounded(1);
    journal.on_durable(
        &session,
        sequence,
        Box::new(move |result| {
            result.unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
            // The journal's locks are free, the flusher's too: the callback may use it, even
            // to wait for durability (this would deadlock otherwise).
            inner
                .append_durable(&id, record(RecordKind::KvDelete, json!({"key": "k"})))
                .unwrap();
            inner.view(&id).unwrap();
            sender.send(()).unwrap();
        }),
    );
    receiver.recv().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(journal.view(&session).unwrap().last_sequence, 3);

    // Sequence 0 (nothing) is durable; a sequence never appended is an error.
    assert!(durable(&*journal, &session, 0).is_ok());
    assert!(matches!(
        durable(&*journal, &session, 4),
        Err(JournalError::Failed(_))
    ));
    assert!(durable(&*journal, &session, 3).is_ok());
}

fn concurrent_appends_produce_gapless_ordered_sequences(journal: Arc<dyn Journal>) {
    const THREADS: usize = 8;
    const RECORDS: u64 = 300;
    const SESSIONS: usize = 4;
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
                        journal.append_durable(session, record(RecordKind::KvSet, data))
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

/// Runs each named behaviour against a fresh journal of each implementation: the memory journal,
/// the disk journal, and the disk journal with tiny segments and room for one loaded session (so
/// rotation and eviction happen under every behaviour).
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod memory_journal {
            $(
                #[test]
                fn $name() {
                    super::$name(std::sync::Arc::new(super::MemoryJournal::new()));
                }
            )*
        }
        mod disk_journal {
            $(
                #[test]
                fn $name() {
                    let dir = super::TempDir::new(stringify!($name));
                    let journal = super::DiskJournal::open(&dir.path().join("journal")).unwrap();
                    super::$name(std::sync::Arc::new(journal));
                }
            )*
        }
        mod disk_journal_small {
            $(
                #[test]
                fn $name() {
                    let dir = super::TempDir::new(stringify!($name));
                    let options = super::DiskJournalOptions {
                        segment_size: 1024,
                        max_loaded_sessions: 1,
                        read_descriptors: 1,
                    };
                    let journal =
                        super::DiskJournal::open_with(&dir.path().join("journal"), options).unwrap();
                    super::$name(std::sync::Arc::new(journal));
                }
            )*
        }
    };
}

conformance!(
    sequences_start_at_one_without_gaps_per_session,
    read_returns_records_after_a_sequence_up_to_a_limit,
    pending_events_exclude_the_harness_own_and_respect_after_and_limit,
    appends_update_the_view_and_kv_get_finds_a_stored_null,
    malformed_data_is_stored_without_its_projection,
    a_replay_through_apply_reproduces_the_view,
    create_refuses_an_existing_session_and_a_wrong_first_record,
    every_call_naming_a_deleted_or_unknown_session_fails_unknown_session,
    append_durable_returns_the_sequence,
    effect_records_read_and_project_as_their_new_records,
    transcript_deltas_read_and_project_as_their_new_records,
    on_durable_calls_back_once_without_holding_locks,
    concurrent_appends_produce_gapless_ordered_sequences,
);
