//! Idempotent retries (crate::session::Keyed): what the dispatcher answers a create or send that
//! repeats an idempotency key, before it admits anything.
//!
//! A send's keys are in the session's projections (`SessionView::activation_keys`), so the journal
//! finds them after a restart and for a passivated session alike; a create's keys are in
//! [`CreateKeys`], rebuilt at start from each session's `session_created` record.

use crate::api::{Activation, ActivationError, ApiError, Outcome, OutcomeCell, OutcomeKind};
use crate::dispatch::Dispatcher;
use crate::protocol::harness::{ErrorCode, RecordKind};
use crate::session::{Keyed, SessionId};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;

/// How many records are read at a time while looking for a past activation's outcome.
const OUTCOME_PAGE: usize = 256;

/// The create keys of every session the journal holds: key → (session, request digest). Its
/// memory is one entry per session created with a key, freed when the session is deleted.
#[derive(Debug, Default)]
pub(crate) struct CreateKeys {
    keys: HashMap<String, (SessionId, String)>,
}

impl CreateKeys {
    /// Notes that `session` was created with `keyed`.
    pub(crate) fn insert(&mut self, keyed: Keyed, session: SessionId) {
        self.keys.insert(keyed.key, (session, keyed.digest));
    }

    /// The session created with `keyed`'s key, if any; refuses the key when it came with another
    /// request.
    pub(crate) fn find(&self, keyed: &Keyed) -> Result<Option<SessionId>, ApiError> {
        match self.keys.get(&keyed.key) {
            None => Ok(None),
            Some((session, digest)) if *digest == keyed.digest => Ok(Some(session.clone())),
            Some((session, _)) => Err(reused(&keyed.key, &format!("session {session}"))),
        }
    }

    /// Forgets `key`, the create key of `session`, which is being deleted.
    pub(crate) fn forget(&mut self, key: &str, session: &SessionId) {
        if self
            .keys
            .get(key)
            .is_some_and(|(holder, _)| holder == session)
        {
            self.keys.remove(key);
        }
    }
}

fn reused(key: &str, first: &str) -> ApiError {
    ApiError::new(
        ErrorCode::IdempotencyKeyReused,
        format!(
            "idempotency key {key:?} was first sent with another request (it created {first}); \
             send a new key with a new request"
        ),
    )
}

/// What a send that repeats a key gets.
pub(crate) enum Repeat {
    /// The activation it admitted is still queued, running or finishing: the caller waits for it
    /// like the first sender (once its `activation_queued` record is durable).
    Active {
        sequence: u64,
        cell: Arc<OutcomeCell>,
    },
    /// It ended: its recorded outcome.
    Ended(Activation),
}

impl Dispatcher {
    /// The key session `id` was created with, read back from its `session_created` record, for
    /// [`CreateKeys::forget`] once its deletion went through; `None` without reading anything when
    /// no session has one.
    pub(crate) fn create_key_of(&self, id: &SessionId) -> Option<String> {
        if self.create_keys.keys.is_empty() {
            return None;
        }
        let mut keyed = None;
        let inspected = self.journal.inspect(id, &mut |view| {
            keyed = serde_json::from_str::<Value>(&view.created)
                .ok()
                .and_then(|created| Keyed::from_record(&created));
        });
        if let Err(error) = inspected {
            log::warn!("session {id}: its create key could not be read back: {error}");
        }
        keyed.map(|keyed| keyed.key)
    }

    /// The activation an earlier send with `keyed`'s key admitted in session `id`, if any. Refuses
    /// the key when it came with another request.
    pub(crate) fn repeated_send(
        &self,
        id: &SessionId,
        keyed: &Keyed,
    ) -> Result<Option<Repeat>, ApiError> {
        let session = self
            .sessions
            .get(id)
            .ok_or_else(|| ApiError::new(ErrorCode::UnknownSession, format!("no session {id}")))?;
        let mut found = None;
        self.journal
            .inspect(id, &mut |view| {
                found = view.activation_keys.get(&keyed.key).cloned();
            })
            .map_err(|error| ApiError::new(error.code(), error.to_string()))?;
        let Some((sequence, digest)) = found else {
            return Ok(None);
        };
        if digest != keyed.digest {
            return Err(reused(&keyed.key, &format!("activation {sequence}")));
        }
        if let Some(active) = session.active.as_ref().filter(|a| a.sequence == sequence) {
            return Ok(Some(Repeat::Active {
                sequence,
                cell: active.cell.clone(),
            }));
        }
        let cell = Arc::new(OutcomeCell::default());
        cell.complete(self.recorded_outcome(id, sequence)?);
        Ok(Some(Repeat::Ended(Activation {
            session_id: id.clone(),
            sequence,
            cell,
            commands: self.commands.clone(),
        })))
    }

    /// The outcome that the `activation_finished` record of activation `sequence` holds. Every
    /// activation that is no longer active has one: it is durable before the activation leaves
    /// its session, and recovery writes one for each that a stopped Brain left unfinished.
    fn recorded_outcome(&self, id: &SessionId, sequence: u64) -> Result<Outcome, ApiError> {
        let mut after = sequence;
        loop {
            let page = self
                .journal
                .read(id, after, OUTCOME_PAGE)
                .map_err(|error| ApiError::new(error.code(), error.to_string()))?;
            let Some(last) = page.last() else {
                return Err(ApiError::new(
                    ErrorCode::Interrupted,
                    format!("activation {sequence} of session {id} has no recorded outcome"),
                ));
            };
            after = last.sequence;
            let finished = page.into_iter().find(|event| {
                event.event_type == RecordKind::ActivationFinished.as_str()
                    && event.data.get("activation").and_then(Value::as_u64) == Some(sequence)
            });
            if let Some(finished) = finished {
                return Ok(outcome_of(id, sequence, finished.data));
            }
        }
    }
}

/// An `activation_finished` record's data as the outcome it recorded.
fn outcome_of(id: &SessionId, sequence: u64, mut data: Value) -> Outcome {
    let text =
        |data: &Value, field: &str| data.get(field).and_then(Value::as_str).map(str::to_owned);
    let outcome = match data.get("outcome").and_then(Value::as_str) {
        Some("completed") => OutcomeKind::Completed,
        Some("cancelled") => OutcomeKind::Cancelled,
        _ => OutcomeKind::Failed,
    };
    let error = text(&data, "code").map(|code| ActivationError {
        code,
        message: text(&data, "message").unwrap_or_default(),
    });
    Outcome {
        session_id: id.clone(),
        sequence,
        outcome,
        result: data.get_mut("result").map(Value::take),
        error,
    }
}
