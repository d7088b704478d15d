//! An independent check of a data directory's journals: read back from disk with the read-only
//! journal API (never through the Brain that wrote them), and held to the invariants every
//! journal must keep whatever happened to the processes that wrote it. Shared by the fault matrix,
//! the durability test and the crash soak.

use brain::journal::{DiskJournal, Journal};
use brain::protocol::harness::Event;
use brain::session::SessionId;
use std::collections::BTreeMap;
use std::path::Path;

/// Every session's records, read from `<data_dir>/journal` with the read-only journal API, which
/// takes no lock and can read beside a running Brain.
pub fn read_all(data_dir: &Path) -> BTreeMap<SessionId, Vec<Event>> {
    let journal = DiskJournal::open_read_only(&data_dir.join("journal"))
        .unwrap_or_else(|error| panic!("opening the journal read-only: {error}"));
    let sessions = journal.sessions().expect("the journal's sessions");
    sessions
        .into_iter()
        .map(|id| {
            let records = journal
                .read(&id, 0, usize::MAX)
                .unwrap_or_else(|error| panic!("reading session {id}: {error}"));
            (id, records)
        })
        .collect()
}

/// The effect families: each `<family>_started` has exactly one `<family>_finished`.
pub const EFFECTS: [(&str, &str); 3] = [
    ("model_call_started", "model_call_finished"),
    ("tool_call_started", "tool_call_finished"),
    ("environment_started", "environment_finished"),
];

/// Checks one session's records (`row` names the caller in failure messages): sequences from 1
/// without a gap, `session_created` first; every `activation_queued` started at most once and
/// finished exactly once; every `*_started` effect finished exactly once, after it and before its
/// activation's `activation_finished`.
pub fn check_session(row: &str, id: &str, records: &[Event]) {
    let context = || {
        let kinds: Vec<String> = records
            .iter()
            .map(|r| format!("{}:{}", r.sequence, r.event_type))
            .collect();
        format!("{row}: session {id}: {kinds:?}")
    };
    for (index, record) in records.iter().enumerate() {
        assert_eq!(record.sequence, index as u64 + 1, "{}", context());
    }
    assert_eq!(
        records.first().map(|r| r.event_type.as_str()),
        Some("session_created"),
        "{}",
        context()
    );
    let at = |sequence: u64| &records[sequence as usize - 1];
    // Activations: queued once, started at most once, finished exactly once, in that order.
    let mut queued = BTreeMap::new();
    for record in records {
        match record.event_type.as_str() {
            "activation_queued" => {
                queued.insert(record.sequence, (0, 0, 0));
            }
            "activation_started" | "activation_finished" => {
                let activation = record.data["activation"].as_u64().unwrap_or(0);
                let entry = queued.get_mut(&activation).unwrap_or_else(|| {
                    panic!(
                        "{}: {} names no queued activation",
                        context(),
                        record.sequence
                    )
                });
                if record.event_type == "activation_started" {
                    entry.0 += 1;
                } else {
                    entry.1 += 1;
                    entry.2 = record.sequence;
                }
            }
            _ => {}
        }
    }
    for (activation, (started, finished, _)) in &queued {
        assert!(*started <= 1, "{}: {activation} started twice", context());
        assert_eq!(
            *finished,
            1,
            "{}: activation {activation} finished {finished} times",
            context()
        );
    }
    // Effects: every started one finished exactly once, after it started and before its
    // activation finished.
    for (started_kind, finished_kind) in EFFECTS {
        let mut count: BTreeMap<u64, usize> = records
            .iter()
            .filter(|r| r.event_type == started_kind)
            .map(|r| (r.sequence, 0))
            .collect();
        for record in records.iter().filter(|r| r.event_type == finished_kind) {
            let started = record.data["started"].as_u64().unwrap_or(0);
            let entry = count.get_mut(&started).unwrap_or_else(|| {
                panic!(
                    "{}: {} names no {started_kind} record",
                    context(),
                    record.sequence
                )
            });
            *entry += 1;
            assert!(record.sequence > started, "{}", context());
            let activation = at(started).data["activation"].as_u64().unwrap_or(0);
            if let Some((_, _, activation_finished)) = queued.get(&activation) {
                assert!(
                    record.sequence < *activation_finished,
                    "{}: effect {started} finished after its activation {activation}",
                    context()
                );
            }
        }
        for (started, n) in count {
            assert_eq!(n, 1, "{}: effect {started} finished {n} times", context());
        }
    }
}
