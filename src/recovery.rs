//! Recovery after a restart: sessions rebuilt from their journals, nothing replayed.
//!
//! Startup only lists the sessions (reading each one's first record, for placement). Each session
//! is recovered on its first use, before anything is served for it:
//!
//! - every `*_started` effect without a finished record gets one: outcome `unknown`, code
//!   `interrupted` (Brain cannot know whether the effect happened, and never sends it again);
//! - an activation that was running (its `activation_started` written) gets `activation_finished`
//!   `failed` / `interrupted`; its marker stays, so the session refuses execution from now on;
//! - an activation that was only queued gets `activation_finished` `cancelled` / `interrupted`,
//!   without a marker: the session goes on.
//!
//! Every record written here is durable before the session is used.

use crate::config::Registration;
use crate::journal::{Journal, JournalError, NewRecord, SessionStatus as Stored};
use crate::protocol::harness::{ErrorCode, ModelMetadata, RecordKind};
use crate::retries::CreateKeys;
use crate::session::{CreateSession, Keyed, SessionId};
use crate::sessions::{Lifecycle, SessionSpec, SessionState};
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The registration index of a session whose registration (or slot) no longer exists: its
/// activations are refused `agentloop_unavailable`; it can be read, closed and deleted.
pub(crate) const UNAVAILABLE: usize = usize::MAX;

/// What recovering one session did, for the log.
#[derive(Default)]
pub(crate) struct Recovered {
    pub(crate) interrupted_activations: usize,
    pub(crate) cancelled_activations: usize,
    pub(crate) unknown_effects: usize,
}

fn finished_kind(started: &str) -> Option<RecordKind> {
    match started {
        "model_call_started" => Some(RecordKind::ModelCallFinished),
        "tool_call_started" => Some(RecordKind::ToolCallFinished),
        "environment_started" => Some(RecordKind::EnvironmentFinished),
        _ => None,
    }
}

/// A session's registration index (or [`UNAVAILABLE`]) and slot.
pub(crate) type Placement = (usize, u32);

/// Lists the journal's sessions without reading their records beyond the first: each one's
/// registration index and slot, and the idempotency key it was created with, from its
/// `session_created` record. Recovery happens on first use.
pub(crate) fn dormant_sessions(
    journal: &dyn Journal,
    registrations: &[Registration],
) -> Result<(Vec<(SessionId, Placement)>, CreateKeys), JournalError> {
    let mut dormant = Vec::new();
    let mut keys = CreateKeys::default();
    for id in journal.sessions()? {
        let created = match journal.read(&id, 0, 1) {
            Ok(records) => records.into_iter().next(),
            Err(error) => {
                log::error!("session {id}: unreadable: {error}");
                continue;
            }
        };
        let Some(created) = created else { continue };
        let name = created.data.get("registration").and_then(Value::as_str);
        let slot = created
            .data
            .get("worker")
            .and_then(Value::as_u64)
            .and_then(|w| u32::try_from(w).ok());
        let placement = match (name, slot) {
            (Some(name), Some(slot)) => registrations
                .iter()
                .position(|r| r.name == name && slot < r.workers)
                .map_or((UNAVAILABLE, slot), |index| (index, slot)),
            _ => (UNAVAILABLE, 0),
        };
        if let Some(keyed) = Keyed::from_record(&created.data) {
            keys.insert(keyed, id.clone());
        }
        dormant.push((id, placement));
    }
    Ok((dormant, keys))
}

/// Recovers one session (see the module docs) and rebuilds its state.
pub(crate) fn recover_session(
    journal: &dyn Journal,
    id: &SessionId,
    registrations: &[Registration],
    data_dir: &Path,
    recovered: &mut Recovered,
) -> Result<SessionState, JournalError> {
    let view = journal.view(id)?;
    // Effects first: their finished records precede the activation's.
    for started in view.unfinished_effects.clone() {
        let record = journal
            .read(id, started.saturating_sub(1), 1)?
            .into_iter()
            .next()
            .filter(|r| r.sequence == started);
        let Some(kind) = record.and_then(|r| finished_kind(&r.event_type)) else {
            log::warn!("session {id}: unfinished effect {started} has no started record");
            continue;
        };
        journal.append_durable(
            id,
            NewRecord {
                kind,
                data: json!({"started": started, "outcome": "unknown",
                             "code": ErrorCode::Interrupted.as_str(),
                             "message": "Brain stopped before the effect's outcome was recorded"}),
                origin: None,
            },
        )?;
        recovered.unknown_effects += 1;
    }
    let scan = scan(journal, id)?;
    if let Some((activation, started)) = scan.open_activation {
        let data = if started {
            recovered.interrupted_activations += 1;
            json!({"activation": activation, "outcome": "failed",
                   "code": ErrorCode::Interrupted.as_str(),
                   "message": "Brain stopped while the activation was running"})
        } else {
            recovered.cancelled_activations += 1;
            json!({"activation": activation, "outcome": "cancelled",
                   "code": ErrorCode::Interrupted.as_str(),
                   "message": "Brain stopped while the activation was queued"})
        };
        journal.append_durable(
            id,
            NewRecord {
                kind: RecordKind::ActivationFinished,
                data,
                origin: None,
            },
        )?;
        log::warn!(
            "session {id}: activation {activation} {} at recovery",
            if started { "interrupted" } else { "cancelled" }
        );
    }
    let view = journal.view(id)?;
    let mut state = state_from(
        id,
        &view.created,
        view.status,
        view.marker,
        registrations,
        data_dir,
    )
    .map_err(|why| {
        JournalError::Failed(format!("session {id}: its session_created record: {why}"))
    })?;
    state.incarnations.extend(scan.incarnations);
    state.catalogue = scan.catalogue;
    Ok(state)
}

/// What one pass over a session's records tells recovery.
struct Scan {
    /// The last `activation_queued` without an `activation_finished`, and whether it had started.
    open_activation: Option<(u64, bool)>,
    /// Environments set up since creation: name → the setup's started sequence.
    incarnations: HashMap<String, u64>,
    /// The tool catalogue recorded with the first activation, if any.
    catalogue: Option<Value>,
}

fn scan(journal: &dyn Journal, id: &SessionId) -> Result<Scan, JournalError> {
    let mut open: Option<(u64, bool)> = None;
    let mut incarnations = HashMap::new();
    let mut catalogue = None;
    let mut after = 0;
    loop {
        let page = journal.read(id, after, 4096)?;
        let Some(last) = page.last() else {
            return Ok(Scan {
                open_activation: open,
                incarnations,
                catalogue,
            });
        };
        after = last.sequence;
        for record in &page {
            let activation = record.data.get("activation").and_then(Value::as_u64);
            match record.event_type.as_str() {
                "activation_queued" => open = Some((record.sequence, false)),
                "activation_started" => {
                    if catalogue.is_none() {
                        catalogue = record.data.get("catalogue").cloned();
                    }
                    if let (Some((queued, started)), Some(a)) = (&mut open, activation)
                        && *queued == a
                    {
                        *started = true;
                    }
                }
                "activation_finished"
                    if open.is_some_and(|(queued, _)| Some(queued) == activation) =>
                {
                    open = None;
                }
                "environment_finished"
                    if record.data.get("operation") == Some(&json!("setup"))
                        && record.data.get("outcome") == Some(&json!("ok")) =>
                {
                    if let (Some(name), Some(started)) = (
                        record.data.get("name").and_then(Value::as_str),
                        record.data.get("started").and_then(Value::as_u64),
                    ) {
                        incarnations.insert(name.to_owned(), started);
                    }
                }
                _ => {}
            }
        }
    }
}

/// Rebuilds the dispatcher's state of a session from its `session_created` record.
pub(crate) fn state_from(
    id: &SessionId,
    created: &str,
    status: Stored,
    marker: Option<u64>,
    registrations: &[Registration],
    data_dir: &Path,
) -> Result<SessionState, String> {
    let created: Value = serde_json::from_str(created).map_err(|e| e.to_string())?;
    let field = |name: &str| created.get(name).cloned().unwrap_or(Value::Null);
    let name = created
        .get("registration")
        .and_then(Value::as_str)
        .ok_or("no registration")?
        .to_owned();
    let slot = created
        .get("worker")
        .and_then(Value::as_u64)
        .and_then(|w| u32::try_from(w).ok())
        .ok_or("no worker")?;
    let mut request = Map::new();
    for key in [
        "agentloop",
        "model",
        "system",
        "tools",
        "environments",
        "metadata",
    ] {
        let value = field(key);
        if !value.is_null() {
            request.insert(key.to_owned(), value);
        }
    }
    let request: CreateSession =
        serde_json::from_value(Value::Object(request)).map_err(|e| e.to_string())?;
    let request = crate::sessions::held_request(request);
    let model: ModelMetadata = serde_json::from_value(field("model")).map_err(|e| e.to_string())?;
    let configuration = crate::sessions::held_configuration(&match field("configuration") {
        Value::Object(map) => map,
        _ => Map::new(),
    });
    let registration = registrations
        .iter()
        .position(|r| r.name == name && slot < r.workers)
        .unwrap_or(UNAVAILABLE);
    let incarnations: HashMap<String, u64> = request
        .environments
        .iter()
        .map(|e| (e.name.clone(), 1))
        .collect();
    let [state_dir, workspace_dir] = crate::datadir::session_dirs(data_dir, &name, id);
    let spec = SessionSpec {
        state_dir,
        workspace_dir,
        registration: name,
        request,
        model,
        configuration,
    };
    Ok(SessionState {
        registration,
        slot,
        spec: Arc::new(spec),
        lifecycle: match status {
            Stored::Open => Lifecycle::Open,
            Stored::Passivated => Lifecycle::Passivated,
            Stored::Closed => Lifecycle::Closed,
        },
        marker,
        incarnations,
        catalogue: None,
        active: None,
        last_run: None,
    })
}
