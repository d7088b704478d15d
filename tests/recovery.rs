//! Recovery after a restart: what a crashed Brain left in its journal is finished, never replayed.
//! (These use a journal shared by two Brains in one process; the durable journal's own crash
//! tests kill real processes.)

mod common;

use brain::journal::{Journal, MemoryJournal, NewRecord};
use brain::protocol::harness::{Block, RecordKind, UserInput};
use brain::{Brain, Config, OutcomeKind, Registrations, SessionStatus, Storage};
use common::*;
use serde_json::json;
use std::sync::Arc;

fn text(text: &str) -> UserInput {
    UserInput {
        content: vec![Block::text(text)],
    }
}

fn start_on(journal: &Arc<MemoryJournal>, tag: &str) -> Brain {
    let mut config = Config::new(Registrations::from_vec(vec![fault("r", &[])]).unwrap());
    config.options = fast_options(tag);
    config.storage = Storage::Journal(journal.clone());
    Brain::start(config).expect("start")
}

fn record(kind: RecordKind, data: serde_json::Value) -> NewRecord {
    NewRecord {
        kind,
        data,
        origin: None,
    }
}

#[test]
fn a_crash_mid_activation_interrupts_the_session_and_finishes_its_effects_unknown() {
    let journal = Arc::new(MemoryJournal::new());
    let first = start_on(&journal, "recovery-1");
    let running = first
        .create_session_json(br#"{"agentloop": {"name": "r"}}"#)
        .unwrap();
    let queued = first
        .create_session_json(br#"{"agentloop": {"name": "r"}}"#)
        .unwrap();
    let completed = first
        .create_session_json(br#"{"agentloop": {"name": "r"}}"#)
        .unwrap();
    let done = completed.send(text("done")).unwrap().wait();
    assert_eq!(done.outcome, OutcomeKind::Completed);
    drop(first);

    // What a Brain killed mid-flight leaves behind: one activation running with a model call in
    // flight, one only queued.
    let id = running.id();
    let queued_at = journal
        .append(id, record(RecordKind::ActivationQueued, json!({})))
        .unwrap();
    journal
        .append(
            id,
            record(
                RecordKind::ActivationStarted,
                json!({"activation": queued_at}),
            ),
        )
        .unwrap();
    let effect = journal
        .append(
            id,
            record(
                RecordKind::ModelCallStarted,
                json!({"activation": queued_at, "ordinal": 0, "request": {"messages": []}}),
            ),
        )
        .unwrap();
    let waiting = journal
        .append(queued.id(), record(RecordKind::ActivationQueued, json!({})))
        .unwrap();

    let second = start_on(&journal, "recovery-2");
    let running = second.session(running.id());
    let events = running.events(0, 100).unwrap();
    let tail: Vec<(&str, &serde_json::Value)> = events[events.len() - 2..]
        .iter()
        .map(|e| (e.event_type.as_str(), &e.data))
        .collect();
    assert_eq!(tail[0].0, "model_call_finished");
    assert_eq!(tail[0].1["started"], effect);
    assert_eq!(tail[0].1["outcome"], "unknown");
    assert_eq!(tail[0].1["code"], "interrupted");
    assert_eq!(tail[1].0, "activation_finished");
    assert_eq!(tail[1].1["outcome"], "failed");
    assert_eq!(tail[1].1["code"], "interrupted");
    // The marker stays: the session refuses execution, also after this restart.
    assert_interrupted(&running, queued_at);
    // The queued one was cancelled without a marker and goes on.
    let queued = second.session(queued.id());
    let last = queued.events(0, 100).unwrap().pop().unwrap();
    assert_eq!(last.event_type, "activation_finished");
    assert_eq!(last.data["activation"], waiting);
    assert_eq!(last.data["outcome"], "cancelled");
    assert_eq!(
        queued.send(text("go")).unwrap().wait().outcome,
        OutcomeKind::Completed
    );
    // A session that had finished cleanly is untouched.
    let completed = second.session(completed.id());
    assert_eq!(completed.info().unwrap().status, SessionStatus::Open);
    assert_eq!(completed.info().unwrap().worker, 0);
    drop(second);

    // Nothing more is written at the next restart: recovery happened once. Startup itself reads
    // nothing but each session's first record; recovery runs on a session's first use.
    let before = journal.read(id, 0, 1000).unwrap().len();
    let third = start_on(&journal, "recovery-3");
    assert_eq!(
        third.session(id).info().unwrap().status,
        SessionStatus::Interrupted
    );
    assert_eq!(journal.read(id, 0, 1000).unwrap().len(), before);
}

#[test]
fn recovery_happens_on_first_use_not_at_startup() {
    let journal = Arc::new(MemoryJournal::new());
    let first = start_on(&journal, "lazy-1");
    let session = first
        .create_session_json(br#"{"agentloop": {"name": "r"}}"#)
        .unwrap();
    drop(first);
    let id = session.id().clone();
    let queued = journal
        .append(&id, record(RecordKind::ActivationQueued, json!({})))
        .unwrap();
    let second = start_on(&journal, "lazy-2");
    // Started: nothing was written yet for the session left with a queued activation.
    assert_eq!(
        journal.read(&id, 0, 100).unwrap().last().unwrap().sequence,
        queued
    );
    // Its first use recovers it before answering.
    let session = second.session(&id);
    let last = session.events(0, 100).unwrap().pop().unwrap();
    assert_eq!(last.event_type, "activation_finished");
    assert_eq!(last.data["outcome"], "cancelled");
}

#[test]
fn a_session_of_a_removed_registration_can_be_read_closed_and_deleted() {
    let journal = Arc::new(MemoryJournal::new());
    let mut config = Config::new(Registrations::from_vec(vec![fault("gone", &[])]).unwrap());
    config.options = fast_options("removed-1");
    config.storage = Storage::Journal(journal.clone());
    let first = Brain::start(config).unwrap();
    let session = first
        .create_session_json(br#"{"agentloop": {"name": "gone"}}"#)
        .unwrap();
    drop(first);
    let second = start_on(&journal, "removed-2");
    let session = second.session(session.id());
    assert_eq!(session.info().unwrap().registration, "gone");
    assert_eq!(
        session.send(text("x")).unwrap_err().code.as_str(),
        "agentloop_unavailable"
    );
    assert!(!session.events(0, 10).unwrap().is_empty());
    session.close().unwrap();
    session.delete().unwrap();
    assert_eq!(session.info().unwrap_err().code.as_str(), "unknown_session");
}
