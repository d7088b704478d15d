//! A journal wrapper that lets readers wait for new records instead of polling.
//!
//! Every successful append bumps a counter under a small lock and wakes the waiters; a reader
//! re-reads what it wants and waits again if it is not there yet. The lock is a leaf: it is never
//! held while the inner journal is called.

use crate::journal::{
    AppendedCallback, DurableCallback, EffectRecord, IdlePlacement, Journal, JournalError,
    NewRecord, Placed, SessionView,
};
use crate::protocol::harness::{Event, Message};
use crate::session::SessionId;
use parking_lot::{Condvar, Mutex};
use serde_json::Value;
use std::sync::Arc;
use std::time::Instant;

/// Wraps a journal; appends wake [`WatchedJournal::wait_change`].
pub(crate) struct WatchedJournal {
    inner: Arc<dyn Journal>,
    version: Mutex<u64>,
    changed: Condvar,
}

impl WatchedJournal {
    pub(crate) fn new(inner: Arc<dyn Journal>) -> WatchedJournal {
        WatchedJournal {
            inner,
            version: Mutex::new(0),
            changed: Condvar::new(),
        }
    }

    /// The current version; pass it to [`WatchedJournal::wait_change`].
    pub(crate) fn version(&self) -> u64 {
        *self.version.lock()
    }

    /// Blocks until some record was appended after `seen` was read, or `deadline` passes.
    /// Returns whether something changed.
    pub(crate) fn wait_change(&self, seen: u64, deadline: Instant) -> bool {
        let mut version = self.version.lock();
        while *version == seen {
            if self.changed.wait_until(&mut version, deadline).timed_out() {
                return *version != seen;
            }
        }
        true
    }

    fn bump(&self) {
        *self.version.lock() += 1;
        self.changed.notify_all();
    }
}

impl Journal for WatchedJournal {
    fn create(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        let sequence = self.inner.create(session, record)?;
        self.bump();
        Ok(sequence)
    }

    fn append(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        let sequence = self.inner.append(session, record)?;
        self.bump();
        Ok(sequence)
    }

    fn on_durable(&self, session: &SessionId, sequence: u64, done: DurableCallback) {
        self.inner.on_durable(session, sequence, done)
    }

    fn append_durable(&self, session: &SessionId, record: NewRecord) -> Result<u64, JournalError> {
        // Bumped even on failure: the record may have been appended (and readable) before its
        // flush failed, and a spurious wake-up only makes a reader look again.
        let appended = self.inner.append_durable(session, record);
        self.bump();
        appended
    }

    fn append_transcript_durable(
        &self,
        session: &SessionId,
        keep: usize,
        append: &[Message],
    ) -> Result<u64, JournalError> {
        // Bumped even on failure, as append_durable is.
        let appended = self.inner.append_transcript_durable(session, keep, append);
        self.bump();
        appended
    }

    fn append_transcript(
        &self,
        session: &SessionId,
        keep: usize,
        append: &[Message],
    ) -> Result<u64, JournalError> {
        let sequence = self.inner.append_transcript(session, keep, append)?;
        self.bump();
        Ok(sequence)
    }

    fn append_effect_then(
        &self,
        session: &SessionId,
        record: EffectRecord,
        done: AppendedCallback,
    ) {
        // Bumped once the record is placed (readable), as append is; `done` may already have run.
        self.inner.append_effect_then(session, record, done);
        self.bump();
    }

    fn append_effect_queued(
        &self,
        session: &SessionId,
        record: EffectRecord,
        done: AppendedCallback,
    ) {
        // Bumped as append_effect_then is.
        self.inner.append_effect_queued(session, record, done);
        self.bump();
    }

    fn place_effect_if_idle(
        &self,
        session: &SessionId,
        record: EffectRecord,
    ) -> Result<IdlePlacement, JournalError> {
        let placement = self.inner.place_effect_if_idle(session, record)?;
        if matches!(placement, IdlePlacement::Placed(_)) {
            // Placed is readable, as after append.
            self.bump();
        }
        Ok(placement)
    }

    fn flush_placed(&self, placed: &Placed) -> Result<(), JournalError> {
        self.inner.flush_placed(placed)
    }

    fn read(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, JournalError> {
        self.inner.read(session, after, limit)
    }

    fn pending_events(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, JournalError> {
        self.inner.pending_events(session, after, limit)
    }

    fn view(&self, session: &SessionId) -> Result<SessionView, JournalError> {
        self.inner.view(session)
    }

    fn inspect(
        &self,
        session: &SessionId,
        inspect: &mut dyn FnMut(&SessionView),
    ) -> Result<(), JournalError> {
        self.inner.inspect(session, inspect)
    }

    fn kv_get(&self, session: &SessionId, key: &str) -> Result<Option<Value>, JournalError> {
        self.inner.kv_get(session, key)
    }

    fn kv_get_cached(
        &self,
        session: &SessionId,
        key: &str,
    ) -> Option<Result<Option<Value>, JournalError>> {
        self.inner.kv_get_cached(session, key)
    }

    fn release(&self, session: &SessionId) {
        self.inner.release(session)
    }

    fn delete(&self, session: &SessionId) -> Result<(), JournalError> {
        self.inner.delete(session)?;
        self.bump();
        Ok(())
    }

    fn sessions(&self) -> Result<Vec<SessionId>, JournalError> {
        self.inner.sessions()
    }

    fn sync(&self) -> Result<(), JournalError> {
        self.inner.sync()
    }

    fn failure(&self) -> Option<String> {
        self.inner.failure()
    }
}
