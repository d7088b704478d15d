//! Sessions and activations: the dispatcher's state machine for them.
//!
//! Every function here runs on the dispatcher thread and owns what it touches. An activation moves
//!
//! ```text
//! Queued ──taken──> Starting ──activation_started durable──> Running ──run answered / worker lost──> Ended
//!    └───────── cancelled, quarantined, shutting down, input too large ────────────────────────> Ended
//! Ended ──callbacks drained──> activation_finished appended ──durable──> outcome delivered
//! ```
//!
//! The first decisive event fixes the outcome (PROTOCOL.md §6); later ones cannot change it.

use crate::api::{
    Activation, ActivationError, ApiError, Cancelled, Outcome, OutcomeCell, OutcomeKind,
    SessionInfo, SessionStatus,
};
use crate::cancel::CancelToken;
use crate::dispatch::{Dispatcher, Internal};
use crate::dormant::{Dormant, Since};
use crate::journal::{JournalError, NewRecord};
use crate::pool::{Deadline, SessionRequest};
use crate::protocol::harness::{
    CancelParams, CloseParams, CloseReason, ErrorCode, EventOrigin, ModelMetadata, OriginKind,
    RecordKind, RunInputRef, RunParamsRef, RunResult, UserInput, method, run_failure_code,
};
use crate::protocol::jsonrpc::RpcError;
use crate::retries::Repeat;
use crate::session::{
    CreateSession, Keyed, SessionId, ToolSpec, check_against_harness, check_input_media,
    merge_configuration, runtime_envelope, tool_declarations,
};
use crate::status::{FailureReason, WorkerFailure, WorkerState};
use crate::worker::WorkerKey;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dispatch::Reply;

/// The longest failure message kept in `activation_finished`.
const MAX_FAILURE_MESSAGE: usize = 4096;

/// How long after a session is made dormant or deleted the heap is trimmed (crate::heap): long
/// enough to cover a wave of them with one trim, short enough that the memory is back soon.
const TRIM_AFTER: Duration = Duration::from_millis(200);

/// The most pending events one `run` carries.
const MAX_RUN_EVENTS: usize = 1000;

/// A waiting activation, as the capacity queue holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QueueEntry {
    pub(crate) session: SessionId,
    pub(crate) sequence: u64,
}

/// What the dispatcher waits on the journal for.
pub(crate) enum DurableToken {
    /// `session_created` (and an imported transcript): answer the creator.
    Created {
        session: SessionId,
        reply: Reply<SessionInfo>,
    },
    /// `activation_queued`: answer the sender with the activation handle, whatever became of
    /// the activation meanwhile (it may have run and ended: `activation_started`, later in the
    /// log, can be reported durable first when two threads' flushes report at once).
    Queued {
        session: SessionId,
        sequence: u64,
        cell: Arc<OutcomeCell>,
        reply: Reply<Activation>,
    },
    /// `activation_started`: send `run`.
    Started { session: SessionId, sequence: u64 },
    /// `activation_finished`: deliver the outcome.
    Finished { session: SessionId, sequence: u64 },
    /// `session_passivated` or `session_closed`: answer the caller.
    Lifecycle {
        session: SessionId,
        reply: Reply<SessionInfo>,
    },
    /// A client's `event_emitted`: answer with its sequence.
    ClientEvent { sequence: u64, reply: Reply<u64> },
}

/// The immutable part of a session, fixed at creation.
#[derive(Debug)]
pub(crate) struct SessionSpec {
    /// The registration's name (kept even if a restart dropped the registration).
    pub(crate) registration: String,
    pub(crate) request: CreateSession,
    pub(crate) model: ModelMetadata,
    /// Deployment configuration merged with the session's, as compact JSON text: it is only
    /// ever encoded into `run`, and a `Value` tree costs a B-tree node (≈ 640 B) per JSON object.
    pub(crate) configuration: Box<RawValue>,
    pub(crate) state_dir: PathBuf,
    /// `<data>/workspaces/<id>`: the parent of each environment's workspace, where its tools run.
    pub(crate) workspace_dir: PathBuf,
}

/// A session's request as the dispatcher holds it: without `agentloop.configuration`, which only
/// admission reads (the merged [`SessionSpec::configuration`] is what `run` carries, and the
/// `session_created` record keeps the original), so that an open session does not hold the
/// configuration's tree twice.
pub(crate) fn held_request(mut request: CreateSession) -> CreateSession {
    request.agentloop.configuration = Map::new();
    request
}

/// The merged configuration as [`SessionSpec::configuration`] holds it.
pub(crate) fn held_configuration(configuration: &Map<String, Value>) -> Box<RawValue> {
    // A map with string keys always encodes.
    brain_protocol::json::to_raw_value(configuration).expect("a JSON map encodes")
}

/// Stored lifecycle status; `interrupted` is derived from the marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lifecycle {
    Open,
    Passivated,
    Closed,
}

/// One session, as the dispatcher holds it.
pub(crate) struct SessionState {
    pub(crate) registration: usize,
    pub(crate) slot: u32,
    pub(crate) spec: Arc<SessionSpec>,
    pub(crate) lifecycle: Lifecycle,
    pub(crate) marker: Option<u64>,
    /// The sequence that last set each environment up (`session_created` at first): the
    /// incarnation that tool placements and environment calls name.
    pub(crate) incarnations: HashMap<String, u64>,
    /// The tool catalogue recorded with the first activation, for a harness that keeps a fixed
    /// one.
    pub(crate) catalogue: Option<Value>,
    pub(crate) active: Option<Active>,
    /// The latest activation that ran, and on which worker incarnation: callbacks naming it after
    /// its authority closed get `activation_closed` rather than `activation_not_active`.
    pub(crate) last_run: Option<(u64, WorkerKey)>,
}

impl SessionState {
    fn info(&self, id: &SessionId) -> SessionInfo {
        SessionInfo {
            session_id: id.clone(),
            status: self.status(),
            registration: self.spec.registration.clone(),
            worker: self.slot,
            active: self.active.as_ref().map(|a| a.sequence),
            marker: self.marker,
            state_dir: self.spec.state_dir.clone(),
        }
    }

    fn status(&self) -> SessionStatus {
        match self.lifecycle {
            Lifecycle::Closed => SessionStatus::Closed,
            _ if self.marker.is_some() && self.active.is_none() => SessionStatus::Interrupted,
            Lifecycle::Passivated => SessionStatus::Passivated,
            Lifecycle::Open => SessionStatus::Open,
        }
    }

    /// Counts toward placement: open or passivated, not interrupted or closed.
    fn counts_for_placement(&self) -> bool {
        matches!(
            self.status(),
            SessionStatus::Open | SessionStatus::Passivated
        )
    }
}

/// Where an activation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Waiting in its slot's capacity queue.
    Queued,
    /// Taken off the capacity queue; `activation_started` appended, not yet durable.
    Starting { key: WorkerKey },
    /// `run` sent.
    Running { key: WorkerKey },
    /// The outcome is fixed; waiting for admitted callbacks to drain.
    Ended,
    /// `activation_finished` appended, not yet durable.
    Finishing,
}

/// The outcome as soon as it is fixed.
#[derive(Debug, Clone)]
pub(crate) struct Fixed {
    kind: OutcomeKind,
    code: Option<String>,
    message: Option<String>,
    result: Option<Value>,
}

impl Fixed {
    fn completed(result: Option<Value>) -> Fixed {
        Fixed {
            kind: OutcomeKind::Completed,
            code: None,
            message: None,
            result,
        }
    }

    pub(crate) fn failed(code: &str, message: impl Into<String>) -> Fixed {
        let kind = if code == ErrorCode::Cancelled.as_str() {
            OutcomeKind::Cancelled
        } else {
            OutcomeKind::Failed
        };
        let mut message = message.into();
        truncate(&mut message, MAX_FAILURE_MESSAGE);
        Fixed {
            kind,
            code: Some(code.to_owned()),
            message: Some(message),
            result: None,
        }
    }

    fn cancelled(code: ErrorCode, message: impl Into<String>) -> Fixed {
        Fixed {
            kind: OutcomeKind::Cancelled,
            ..Fixed::failed(code.as_str(), message)
        }
    }
}

fn truncate(text: &mut String, limit: usize) {
    if text.len() > limit {
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// An activation queued or running.
pub(crate) struct Active {
    pub(crate) sequence: u64,
    pub(crate) input: Option<UserInput>,
    pub(crate) phase: Phase,
    pub(crate) cancel_requested: bool,
    pub(crate) cancel_sent: bool,
    pub(crate) fixed: Option<Fixed>,
    /// Admitted callbacks not yet answered.
    pub(crate) outstanding: usize,
    /// Whether new callbacks are admitted.
    pub(crate) authority_open: bool,
    /// Whether `activation_started` was appended (the marker is set).
    pub(crate) started: bool,
    /// Whether it holds a unit of its slot's capacity.
    pub(crate) holds_capacity: bool,
    /// Cancelled when the activation is cancelled or its worker lost: effects in flight stop.
    pub(crate) effects_cancel: CancelToken,
    pub(crate) cell: Arc<OutcomeCell>,
    /// The last pending event given to the harness, for the events cursor.
    pub(crate) events_through: Option<u64>,
    /// When it was admitted, for the latency metrics.
    admitted_at: Instant,
    session_id: SessionId,
}

impl Active {
    /// Fixes the outcome unless an earlier event already did.
    pub(crate) fn fix(&mut self, fixed: Fixed) {
        if self.fixed.is_none() {
            self.fixed = Some(fixed);
        }
    }

    pub(crate) fn is_running_on(&self, key: WorkerKey) -> bool {
        self.phase == Phase::Running { key }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        // Brain is stopping before the outcome was recorded: waiters learn so instead of hanging.
        self.cell.complete(Outcome {
            session_id: self.session_id.clone(),
            sequence: self.sequence,
            outcome: OutcomeKind::Failed,
            result: None,
            error: Some(ActivationError {
                code: ErrorCode::Interrupted.as_str().to_owned(),
                message: "Brain stopped before the activation's outcome was recorded".to_owned(),
            }),
        });
    }
}

fn api(code: ErrorCode, message: impl Into<String>) -> ApiError {
    ApiError::new(code, message)
}

fn journal_error(error: JournalError) -> ApiError {
    api(error.code(), error.to_string())
}

impl Dispatcher {
    // ----- lookups -----

    fn session(&self, id: &SessionId) -> Result<&SessionState, ApiError> {
        self.sessions
            .get(id)
            .ok_or_else(|| api(ErrorCode::UnknownSession, format!("no session {id}")))
    }

    pub(crate) fn active_mut(&mut self, id: &SessionId, sequence: u64) -> Option<&mut Active> {
        self.sessions
            .get_mut(id)?
            .active
            .as_mut()
            .filter(|active| active.sequence == sequence)
    }

    pub(crate) fn info(&self, id: &SessionId) -> Result<SessionInfo, ApiError> {
        Ok(self.session(id)?.info(id))
    }

    /// A session's info, for a client asking for it. A session passivated or closed since the
    /// start is described from the journal as [`list`](Self::list) describes it, without being
    /// loaded: a client that polls its status does not bring back the memory it let go of. A
    /// session found at start is loaded (recovered) first, as any command loads it, so that what
    /// recovery appends is in its journal before anything is said of it; so is one the journal
    /// cannot describe.
    pub(crate) fn info_of(&mut self, id: &SessionId) -> Result<SessionInfo, ApiError> {
        match self.dormant.get(id).map(|dormant| dormant.since) {
            None => {}
            Some(Since::Start) => self.ensure_loaded(id),
            Some(Since::Passivated | Since::Closed) => match self.dormant_info(id) {
                Ok(info) => return Ok(info),
                Err(why) => {
                    log::warn!("session {id}: cannot be described dormant: {why}");
                    self.ensure_loaded(id);
                }
            },
        }
        self.info(id)
    }

    /// Every session, in id order. A dormant session is described from its journal projections,
    /// which the journal lets go of again at once, so that listing does not undo what passivation
    /// saved. Its status is what recovery will make of it: recovery appends only finished
    /// records, which change neither the lifecycle nor the marker.
    pub(crate) fn list(&self) -> Vec<SessionInfo> {
        let mut all: Vec<SessionInfo> = self
            .sessions
            .iter()
            .map(|(id, state)| state.info(id))
            .collect();
        for id in self.dormant.ids() {
            match self.dormant_info(id) {
                Ok(info) => all.push(info),
                Err(why) => log::error!("session {id}: cannot be listed: {why}"),
            }
        }
        all.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        all
    }

    fn dormant_info(&self, id: &SessionId) -> Result<SessionInfo, String> {
        let mut state = None;
        let inspected = self.journal.inspect(id, &mut |view| {
            state = Some(crate::recovery::state_from(
                id,
                &view.created,
                view.status.clone(),
                view.marker,
                &self.registrations,
                &self.data_dir,
            ));
        });
        self.journal.release(id);
        inspected.map_err(|error| error.to_string())?;
        let state = state.ok_or("the journal did not show its projections")??;
        Ok(state.info(id))
    }

    /// Whether no activation is queued, running or finishing.
    pub(crate) fn nothing_running(&self) -> bool {
        self.sessions.values().all(|s| s.active.is_none())
    }

    /// The capacity queue of a slot; `None` for a session whose registration or slot no longer
    /// exists (after a restart with other registrations).
    fn queue(
        &self,
        registration: usize,
        slot: u32,
    ) -> Option<Arc<crate::capacity::CapacityQueue<QueueEntry>>> {
        self.queues.get(registration)?.get(slot as usize).cloned()
    }

    /// Takes what may start now off `registration`/`slot`'s capacity queue, for
    /// [`Dispatcher::settle`] to start in order. Called after every change that can let an
    /// activation start: a push, a release, the queue opening.
    fn feed(&mut self, registration: usize, slot: u32) {
        let Some(queue) = self.queue(registration, slot) else {
            return;
        };
        while let Some(entry) = queue.take() {
            self.feeding.push_back((registration, slot, entry));
        }
    }

    /// Appends a record and asks for `token` once it is durable.
    fn append(
        &mut self,
        session: &SessionId,
        kind: RecordKind,
        data: Value,
        token: DurableToken,
    ) -> Result<u64, JournalError> {
        let sequence = self.record(session, kind, data)?;
        self.when_durable(session, sequence, token);
        Ok(sequence)
    }

    /// Appends a record that nobody waits on yet.
    fn record(
        &self,
        session: &SessionId,
        kind: RecordKind,
        data: Value,
    ) -> Result<u64, JournalError> {
        self.journal.append(
            session,
            NewRecord {
                kind,
                data,
                origin: None,
            },
        )
    }

    fn when_durable(&self, session: &SessionId, sequence: u64, token: DurableToken) {
        let internal = self.internal.clone();
        self.journal.on_durable(
            session,
            sequence,
            Box::new(move |result| {
                let _ = internal.send(Internal::Durable { token, result });
            }),
        );
    }

    // ----- creation -----

    pub(crate) fn create_session(
        &mut self,
        id: SessionId,
        request: CreateSession,
        dirs: [PathBuf; 2],
        key: Option<Keyed>,
        reply: Reply<SessionInfo>,
    ) {
        if let Some(keyed) = &key {
            match self.create_keys.find(keyed) {
                Err(error) => return reply.deliver(Err(error)),
                // The first create's records (its imported transcript too) may not be durable
                // yet: answer once every record the session has so far is.
                Ok(Some(created)) => {
                    self.ensure_loaded(&created);
                    let mut last = 0;
                    let _ = self
                        .journal
                        .inspect(&created, &mut |view| last = view.last_sequence);
                    let token = DurableToken::Created {
                        session: created.clone(),
                        reply,
                    };
                    return self.when_durable(&created, last.max(1), token);
                }
                Ok(None) => {}
            }
        }
        match self.admit_session(id, request, dirs, key) {
            Ok((id, last)) => self.when_durable(
                &id.clone(),
                last,
                DurableToken::Created { session: id, reply },
            ),
            Err(error) => {
                reply.deliver(Err(error));
            }
        }
    }

    fn admit_session(
        &mut self,
        id: SessionId,
        request: CreateSession,
        [state_dir, workspace_dir]: [PathBuf; 2],
        key: Option<Keyed>,
    ) -> Result<(SessionId, u64), ApiError> {
        if self.stopping.is_some() {
            return Err(ApiError::shutting_down());
        }
        let name = &request.agentloop.name;
        let registration = self.pool.registration_index(name).ok_or_else(|| {
            api(
                ErrorCode::UnknownAgentloop,
                format!("no agentloop registration named {name:?}"),
            )
        })?;
        let declared = self.pool.agreed(registration).cloned().ok_or_else(|| {
            api(
                ErrorCode::AgentloopUnavailable,
                format!("agentloop {name:?} has no healthy worker"),
            )
        })?;
        let deployment = self.pool.registration(registration).configuration.clone();
        check_against_harness(&request, &declared, &deployment)
            .map_err(|error| api(error.code, error.message))?;
        let model = request.model_or_default();
        if self.effects.provider(&model.provider).is_none() {
            return Err(api(
                ErrorCode::InvalidRequest,
                format!(
                    "model.provider: no model provider named {:?}",
                    model.provider
                ),
            ));
        }
        for environment in &request.environments {
            let Some(driver) = self.effects.driver(&environment.driver) else {
                return Err(api(
                    ErrorCode::InvalidRequest,
                    format!(
                        "environments: {:?}: no environment driver named {:?}",
                        environment.name, environment.driver
                    ),
                ));
            };
            driver.validate(&environment.configuration).map_err(|why| {
                api(
                    ErrorCode::InvalidRequest,
                    format!("environments: {:?}: configuration: {why}", environment.name),
                )
            })?;
        }
        let slot = self.place(registration).ok_or_else(|| {
            api(
                ErrorCode::AgentloopUnavailable,
                format!("agentloop {name:?} has no healthy worker"),
            )
        })?;
        let configuration = merge_configuration(&deployment, &request.agentloop.configuration);
        let mut created = json!({
            "session_id": id,
            "registration": name,
            "worker": slot,
            "agentloop": request.agentloop,
            "model": model,
            "system": request.system,
            "tools": request.tools,
            "environments": request.environments,
            "metadata": request.metadata,
            "configuration": configuration,
        });
        if let Some(keyed) = &key {
            created["idempotency"] = json!(keyed);
        }
        let first = self
            .journal
            .create(
                &id,
                NewRecord {
                    kind: RecordKind::SessionCreated,
                    data: created,
                    origin: None,
                },
            )
            .map_err(journal_error)?;
        if let Some(keyed) = key {
            self.create_keys.insert(keyed, id.clone());
        }
        let mut last = first;
        if !request.transcript.is_empty() {
            last = self
                .journal
                .append(
                    &id,
                    NewRecord {
                        kind: RecordKind::TranscriptDelta,
                        data: json!({"keep": 0, "append": request.transcript}),
                        origin: None,
                    },
                )
                .map_err(journal_error)?;
        }
        let incarnations = request
            .environments
            .iter()
            .map(|e| (e.name.clone(), first))
            .collect();
        let spec = SessionSpec {
            registration: name.clone(),
            model,
            configuration: held_configuration(&configuration),
            state_dir,
            workspace_dir,
            request: held_request(request),
        };
        log::info!(
            "session {id}: created on {}/{slot}",
            self.pool.registration(registration).name
        );
        self.sessions.insert(
            id.clone(),
            SessionState {
                registration,
                slot,
                spec: Arc::new(spec),
                lifecycle: Lifecycle::Open,
                marker: None,
                incarnations,
                catalogue: None,
                active: None,
                last_run: None,
            },
        );
        Ok((id, last))
    }

    /// The healthy slot with the fewest sessions that count for placement (open or passivated,
    /// see [`SessionState::counts_for_placement`] and [`crate::dormant::Dormant::counts`]); ties:
    /// fewest running, then lowest index. Walks the loaded sessions only: a passivated or closed
    /// session leaves them, and the dormant ones are counted as they come and go.
    fn place(&self, registration: usize) -> Option<u32> {
        let slots = self.queues[registration].len() as u32;
        let mut open = vec![0usize; slots as usize];
        let mut running = vec![0usize; slots as usize];
        for session in self.sessions.values() {
            if session.registration != registration {
                continue;
            }
            if session.counts_for_placement() {
                open[session.slot as usize] += 1;
            }
            if session
                .active
                .as_ref()
                .is_some_and(|a| matches!(a.phase, Phase::Running { .. } | Phase::Starting { .. }))
            {
                running[session.slot as usize] += 1;
            }
        }
        (0..slots)
            .filter(|&slot| self.pool.healthy_key(registration, slot).is_some())
            .min_by_key(|&slot| {
                let open = open[slot as usize] + self.dormant.load(registration, slot);
                (open, running[slot as usize], slot)
            })
    }

    // ----- admission -----

    pub(crate) fn send(
        &mut self,
        id: &SessionId,
        input: Option<UserInput>,
        deadline: Option<Duration>,
        key: Option<Keyed>,
        reply: Reply<Activation>,
    ) {
        if let Some(keyed) = &key {
            match self.repeated_send(id, keyed) {
                Err(error) => return reply.deliver(Err(error)),
                Ok(Some(Repeat::Ended(activation))) => return reply.deliver(Ok(activation)),
                Ok(Some(Repeat::Active { sequence, cell })) => {
                    let token = DurableToken::Queued {
                        session: id.clone(),
                        sequence,
                        cell,
                        reply,
                    };
                    return self.when_durable(id, sequence, token);
                }
                Ok(None) => {}
            }
        }
        match self.admit_activation(id, input, deadline, key) {
            Ok((sequence, cell)) => self.when_durable(
                id,
                sequence,
                DurableToken::Queued {
                    session: id.clone(),
                    sequence,
                    cell,
                    reply,
                },
            ),
            Err(error) => reply.deliver(Err(error)),
        }
    }

    fn admit_activation(
        &mut self,
        id: &SessionId,
        input: Option<UserInput>,
        deadline: Option<Duration>,
        key: Option<Keyed>,
    ) -> Result<(u64, Arc<OutcomeCell>), ApiError> {
        if self.stopping.is_some() {
            return Err(ApiError::shutting_down());
        }
        let session = self.session(id)?;
        match session.status() {
            SessionStatus::Closed => {
                return Err(api(
                    ErrorCode::SessionClosed,
                    format!("session {id} is closed"),
                ));
            }
            SessionStatus::Interrupted => {
                return Err(api(
                    ErrorCode::SessionInterrupted,
                    format!(
                        "session {id} was interrupted during activation {}; create a new session to go on",
                        session.marker.unwrap_or_default()
                    ),
                ));
            }
            SessionStatus::Open | SessionStatus::Passivated => {}
        }
        if let Some(active) = &session.active {
            return Err(api(
                ErrorCode::SessionBusy,
                format!(
                    "session {id} has activation {} queued or running",
                    active.sequence
                ),
            ));
        }
        let (registration, slot) = (session.registration, session.slot);
        let worker = format!("{}/{slot}", session.spec.registration);
        match self.pool.slot_state(registration, slot) {
            Some(WorkerState::Quarantined) => {
                return Err(api(
                    ErrorCode::AgentloopUnavailable,
                    format!("the worker of session {id} ({worker}) is quarantined"),
                ));
            }
            None => {
                return Err(api(
                    ErrorCode::AgentloopUnavailable,
                    format!("the worker of session {id} ({worker}) is not configured any more"),
                ));
            }
            Some(_) => {}
        }
        if let (Some(input), Some(declared)) = (&input, self.pool.agreed(registration)) {
            check_input_media(&input.content, declared)
                .map_err(|error| api(error.code, error.message))?;
        }
        let unavailable = || {
            api(
                ErrorCode::AgentloopUnavailable,
                format!("session {id}'s worker no longer exists"),
            )
        };
        let queue = self.queue(registration, slot).ok_or_else(unavailable)?;
        if queue.waiting() >= self.options.queue_bound {
            return Err(api(
                ErrorCode::Overloaded,
                format!(
                    "{} activations already wait for worker {worker}",
                    self.options.queue_bound
                ),
            ));
        }
        let mut data = json!({});
        if let Some(input) = &input {
            data["input"] = json!(input);
        }
        if let Some(deadline) = deadline {
            data["deadline_ms"] = json!(deadline.as_millis() as u64);
        }
        if let Some(keyed) = &key {
            data["idempotency"] = json!(keyed);
        }
        let sequence = self
            .journal
            .append(
                id,
                NewRecord {
                    kind: RecordKind::ActivationQueued,
                    data,
                    origin: None,
                },
            )
            .map_err(journal_error)?;
        let entry = QueueEntry {
            session: id.clone(),
            sequence,
        };
        // The bound was checked above and only the dispatcher pushes: this cannot be full.
        let _ = queue.push(entry);
        self.feed(registration, slot);
        let session = self
            .sessions
            .get_mut(id)
            .ok_or_else(|| api(ErrorCode::UnknownSession, format!("no session {id}")))?;
        if session.lifecycle == Lifecycle::Passivated {
            session.lifecycle = Lifecycle::Open;
        }
        let cell = Arc::new(OutcomeCell::default());
        session.active = Some(Active {
            sequence,
            input,
            phase: Phase::Queued,
            cancel_requested: false,
            cancel_sent: false,
            fixed: None,
            outstanding: 0,
            authority_open: false,
            started: false,
            holds_capacity: false,
            effects_cancel: CancelToken::new(),
            cell: cell.clone(),
            events_through: None,
            admitted_at: Instant::now(),
            session_id: id.clone(),
        });
        if let Some(deadline) = deadline {
            self.timer.at(
                Instant::now() + deadline,
                Deadline::Wall {
                    session: id.clone(),
                    sequence,
                },
            );
        }
        Ok((sequence, cell))
    }

    // ----- durability -----

    pub(crate) fn on_durable(&mut self, token: DurableToken, result: Result<(), JournalError>) {
        if let Err(error) = &result {
            log::error!("journal: a record did not become durable: {error}");
        }
        match token {
            DurableToken::Created { session, reply } => {
                let answer = result
                    .map_err(journal_error)
                    .and_then(|()| self.info(&session));
                reply.deliver(answer);
            }
            DurableToken::Lifecycle { session, reply } => {
                let answer = result
                    .map_err(journal_error)
                    .and_then(|()| self.info(&session));
                let durable = answer.is_ok();
                reply.deliver(answer);
                if durable {
                    // A passivated or closed session that nothing reopened meanwhile.
                    self.make_dormant(&session);
                }
            }
            DurableToken::ClientEvent { sequence, reply } => {
                reply.deliver(result.map_err(journal_error).map(|()| sequence));
            }
            DurableToken::Queued {
                session,
                sequence,
                cell,
                reply,
            } => {
                let answer = result.map_err(journal_error).map(|()| Activation {
                    session_id: session,
                    sequence,
                    cell,
                    commands: self.commands.clone(),
                });
                reply.deliver(answer);
            }
            DurableToken::Started { session, sequence } => {
                self.on_started_durable(&session, sequence, result)
            }
            DurableToken::Finished { session, sequence } => {
                self.on_finished_durable(&session, sequence, result)
            }
        }
    }

    // ----- starting -----

    pub(crate) fn on_fed(&mut self, registration: usize, slot: u32, entry: QueueEntry) {
        let Some(queue) = self.queue(registration, slot) else {
            return;
        };
        let QueueEntry { session, sequence } = entry;
        let healthy = self.pool.healthy_key(registration, slot);
        let quarantined =
            self.pool.slot_state(registration, slot) == Some(WorkerState::Quarantined);
        let Some(active) = self.active_mut(&session, sequence) else {
            // Ended between its take and now.
            queue.release();
            self.feed(registration, slot);
            return;
        };
        active.holds_capacity = true;
        if active.phase != Phase::Queued || active.fixed.is_some() || active.cancel_requested {
            active.fix(Fixed::cancelled(
                ErrorCode::Cancelled,
                "cancelled while queued",
            ));
            self.end(&session, sequence);
            return;
        }
        let Some(key) = healthy else {
            if quarantined {
                // Taken just before the quarantine drained the queue.
                active.fix(Fixed::failed(
                    ErrorCode::AgentloopUnavailable.as_str(),
                    "the session's worker was quarantined",
                ));
                self.end(&session, sequence);
                return;
            }
            // The worker went down between the take and now: wait for its respawn.
            active.holds_capacity = false;
            queue.release();
            queue.push_front(QueueEntry { session, sequence });
            return;
        };
        let prepared = self
            .check_catalogue(&session, registration)
            .and_then(|catalogue| Ok((catalogue, self.prepare_run(&session, sequence, key)?)));
        let (catalogue, line) = match prepared {
            Ok(prepared) => prepared,
            Err(fixed) => {
                if let Some(active) = self.active_mut(&session, sequence) {
                    active.fix(fixed);
                }
                self.end(&session, sequence);
                return;
            }
        };
        let mut data = json!({"activation": sequence, "worker": slot});
        if let Some(catalogue) = catalogue {
            data["catalogue"] = catalogue;
        }
        let started = self.journal.append(
            &session,
            NewRecord {
                kind: RecordKind::ActivationStarted,
                data,
                origin: None,
            },
        );
        match started {
            Ok(started) => {
                if let Some(active) = self.active_mut(&session, sequence) {
                    active.started = true;
                    active.phase = Phase::Starting { key };
                }
                if let Some(state) = self.sessions.get_mut(&session) {
                    state.marker = Some(sequence);
                    state.last_run = Some((sequence, key));
                }
                self.pending_runs.insert((session.clone(), sequence), line);
                self.when_durable(
                    &session,
                    started,
                    DurableToken::Started {
                        session: session.clone(),
                        sequence,
                    },
                );
            }
            Err(error) => {
                self.pool.forget_request(
                    key,
                    &SessionRequest::Run {
                        session: session.clone(),
                        sequence,
                    },
                );
                if let Some(active) = self.active_mut(&session, sequence) {
                    active.fix(Fixed::failed(
                        ErrorCode::JournalFailed.as_str(),
                        error.to_string(),
                    ));
                }
                self.end(&session, sequence);
            }
        }
    }

    /// For a harness that keeps a fixed tool catalogue: the catalogue to record with the first
    /// activation (`Some`), or the refusal when it differs from the first one. `Ok(None)` when the
    /// harness declares no fixed catalogue or the session already recorded its own.
    fn check_catalogue(
        &mut self,
        session: &SessionId,
        registration: usize,
    ) -> Result<Option<Value>, Fixed> {
        let fixed = self
            .pool
            .agreed(registration)
            .is_some_and(|declared| declared.capabilities.fixed_tool_catalogue);
        let Some(state) = self.sessions.get_mut(session).filter(|_| fixed) else {
            return Ok(None);
        };
        let current = tool_catalogue(&state.spec.request.tools);
        match &state.catalogue {
            None => {
                state.catalogue = Some(current.clone());
                Ok(Some(current))
            }
            Some(first) => match catalogue_change(first, &current) {
                None => Ok(None),
                Some(change) => Err(Fixed::failed(
                    ErrorCode::UnsupportedInput.as_str(),
                    format!("the harness keeps a fixed tool catalogue, and it changed: {change}"),
                )),
            },
        }
    }

    /// Builds and encodes the `run` request (registered as pending on the worker), or the failure
    /// that ends the activation before its marker is written.
    fn prepare_run(
        &mut self,
        session: &SessionId,
        sequence: u64,
        key: WorkerKey,
    ) -> Result<Vec<u8>, Fixed> {
        let journal_failed =
            |error: JournalError| Fixed::failed(error.code().as_str(), error.to_string());
        let mut cursor = 0;
        self.journal
            .inspect(session, &mut |view| cursor = view.events_cursor)
            .map_err(journal_failed)?;
        let events = self
            .journal
            .pending_events(session, cursor, MAX_RUN_EVENTS)
            .map_err(journal_failed)?;
        let state = self.sessions.get(session).ok_or_else(|| {
            Fixed::failed(
                ErrorCode::UnknownSession.as_str(),
                "the session disappeared",
            )
        })?;
        let spec = &state.spec;
        let events_through = events.last().map(|e| e.sequence);
        let tools = tool_declarations(&spec.request.tools, &state.incarnations);
        let runtime = runtime_envelope(session, sequence);
        let state_dir = spec.state_dir.to_string_lossy();
        let request = SessionRequest::Run {
            session: session.clone(),
            sequence,
        };
        // Encoded straight from the journal's view of the session, under its lock: the
        // transcript and kv are not copied first.
        let pool = &mut self.pool;
        let mut line = None;
        self.journal
            .inspect(session, &mut |view| {
                let params = RunParamsRef {
                    session_id: session.as_str(),
                    sequence,
                    state_dir: &state_dir,
                    model: &spec.model,
                    input: RunInputRef {
                        input: state.active.as_ref().and_then(|a| a.input.as_ref()),
                        transcript: &view.transcript,
                        kv: &view.kv,
                        events: &events,
                        tools: &tools,
                        system: spec.request.system.as_deref(),
                        configuration: &spec.configuration,
                        runtime: &runtime,
                    },
                };
                line = pool.prepare_request(key, method::RUN, &params, request.clone());
            })
            .map_err(journal_failed)?;
        let line = line
            .ok_or_else(|| Fixed::failed(ErrorCode::WorkerLost.as_str(), "the worker went away"))?;
        if line.len() > self.options.max_line_bytes {
            self.pool.forget_request(key, &request);
            return Err(Fixed::failed(
                ErrorCode::InputTooLarge.as_str(),
                format!(
                    "the run request is {} bytes, over the line limit of {}",
                    line.len(),
                    self.options.max_line_bytes
                ),
            ));
        }
        if let Some(active) = self.active_mut(session, sequence) {
            active.events_through = events_through;
        }
        Ok(line)
    }

    fn on_started_durable(
        &mut self,
        session: &SessionId,
        sequence: u64,
        result: Result<(), JournalError>,
    ) {
        let line = self.pending_runs.remove(&(session.clone(), sequence));
        let live = match self.active_mut(session, sequence).map(|a| a.phase) {
            Some(Phase::Starting { key }) => self.pool.is_live(key),
            _ => false,
        };
        let Some(active) = self.active_mut(session, sequence) else {
            return;
        };
        let Phase::Starting { key } = active.phase else {
            return; // ended meanwhile (worker lost); the finished record follows the started one
        };
        let run = SessionRequest::Run {
            session: session.clone(),
            sequence,
        };
        if let Err(error) = result {
            active.fix(Fixed::failed(
                ErrorCode::JournalFailed.as_str(),
                error.to_string(),
            ));
            self.pool.forget_request(key, &run);
            self.end(session, sequence);
            return;
        }
        if active.cancel_requested || active.fixed.is_some() {
            // Cancelled between the take and now: the marker is written, `run` is never sent.
            active.fix(Fixed::cancelled(
                ErrorCode::Cancelled,
                "cancelled before run was sent",
            ));
            self.pool.forget_request(key, &run);
            self.end(session, sequence);
            return;
        }
        let (Some(line), true) = (line, live) else {
            active.fix(Fixed::failed(
                ErrorCode::WorkerLost.as_str(),
                "the worker was lost before run was sent",
            ));
            self.pool.forget_request(key, &run);
            self.end(session, sequence);
            return;
        };
        active.phase = Phase::Running { key };
        active.authority_open = true;
        let waited = active.admitted_at.elapsed();
        self.metrics.schedule_to_start.observe(waited);
        self.pool.send_line(key, line);
        log::debug!("session {session}: activation {sequence} running on {key:?}");
    }

    // ----- answers, losses -----

    pub(crate) fn on_answer(
        &mut self,
        key: WorkerKey,
        request: SessionRequest,
        outcome: Result<Value, RpcError>,
    ) {
        match request {
            SessionRequest::Run { session, sequence } => {
                self.on_run_answer(key, &session, sequence, outcome)
            }
            SessionRequest::Cancel { session, sequence } => {
                if let Err(error) = outcome {
                    log::warn!(
                        "session {session}: cancel of activation {sequence} answered with an error: {}",
                        error.message
                    );
                }
            }
            SessionRequest::Close { session } => {
                if let Err(error) = outcome {
                    log::warn!(
                        "session {session}: close answered with an error: {}",
                        error.message
                    );
                }
            }
        }
    }

    fn on_run_answer(
        &mut self,
        key: WorkerKey,
        session: &SessionId,
        sequence: u64,
        outcome: Result<Value, RpcError>,
    ) {
        let Some(active) = self.active_mut(session, sequence) else {
            return;
        };
        if !active.is_running_on(key) {
            return;
        }
        active.authority_open = false;
        if active.outstanding > 0 {
            active.fix(Fixed::failed(
                ErrorCode::CallbacksOutstanding.as_str(),
                format!(
                    "the harness answered run with {} callbacks unanswered",
                    active.outstanding
                ),
            ));
        }
        let answered = match outcome {
            Ok(value) => match serde_json::from_value::<RunResult>(value) {
                Ok(result) => Fixed::completed(result.result),
                Err(error) => Fixed::failed(
                    ErrorCode::InvalidResponse.as_str(),
                    format!("the run answer is not {{\"result\": …}}: {error}"),
                ),
            },
            Err(error) => {
                let code = run_failure_code(&error);
                if code == ErrorCode::Cancelled.as_str() && active.cancel_sent {
                    Fixed::cancelled(ErrorCode::Cancelled, error.message)
                } else if code == ErrorCode::Cancelled.as_str() {
                    // A harness cannot cancel on its own: without Brain's cancel it is a failure.
                    Fixed {
                        kind: OutcomeKind::Failed,
                        ..Fixed::failed(&code, error.message)
                    }
                } else {
                    Fixed::failed(&code, error.message)
                }
            }
        };
        active.fix(answered);
        self.end(session, sequence);
    }

    pub(crate) fn on_worker_lost(
        &mut self,
        key: WorkerKey,
        failure: &WorkerFailure,
        unanswered: Vec<SessionRequest>,
    ) {
        for request in unanswered {
            let SessionRequest::Run { session, sequence } = request else {
                continue;
            };
            let Some(active) = self.active_mut(&session, sequence) else {
                continue;
            };
            if !matches!(active.phase, Phase::Running { key: k } | Phase::Starting { key: k } if k == key)
            {
                continue;
            }
            active.authority_open = false;
            active.fix(Fixed::failed(
                ErrorCode::WorkerLost.as_str(),
                format!("the worker was lost: {failure}"),
            ));
            self.end(&session, sequence);
        }
    }

    pub(crate) fn on_slot_state(&mut self, registration: usize, slot: u32, state: WorkerState) {
        let Some(queue) = self
            .queues
            .get(registration)
            .and_then(|q| q.get(slot as usize))
        else {
            return;
        };
        let queue = queue.clone();
        let open = state == WorkerState::Healthy && self.stopping.is_none();
        queue.set_open(open);
        if open {
            self.feed(registration, slot);
        }
        if state == WorkerState::Quarantined {
            for QueueEntry { session, sequence } in queue.drain() {
                if let Some(active) = self.active_mut(&session, sequence) {
                    active.fix(Fixed::failed(
                        ErrorCode::AgentloopUnavailable.as_str(),
                        "the session's worker was quarantined",
                    ));
                }
                self.end(&session, sequence);
            }
        }
    }

    // ----- ending -----

    /// The outcome is fixed: stop admitting callbacks, stop effects, release capacity, and finish
    /// once admitted callbacks have drained.
    pub(crate) fn end(&mut self, session: &SessionId, sequence: u64) {
        let Some(state) = self.sessions.get_mut(session) else {
            return;
        };
        let (registration, slot) = (state.registration, state.slot);
        let Some(active) = state.active.as_mut().filter(|a| a.sequence == sequence) else {
            return;
        };
        if matches!(active.phase, Phase::Finishing) {
            return;
        }
        if let Phase::Running { key } | Phase::Starting { key } = active.phase {
            self.pool.forget_request(
                key,
                &SessionRequest::Run {
                    session: session.clone(),
                    sequence,
                },
            );
        }
        active.phase = Phase::Ended;
        active.authority_open = false;
        active.effects_cancel.cancel();
        if active.holds_capacity {
            active.holds_capacity = false;
            self.queues[registration][slot as usize].release();
            self.feed(registration, slot);
        }
        self.try_finish(session, sequence);
    }

    /// Appends `activation_finished` once the activation ended and its callbacks drained.
    pub(crate) fn try_finish(&mut self, session: &SessionId, sequence: u64) {
        let Some(active) = self.active_mut(session, sequence) else {
            return;
        };
        if active.phase != Phase::Ended || active.outstanding > 0 {
            return;
        }
        let fixed = active
            .fixed
            .clone()
            .unwrap_or_else(|| Fixed::failed(ErrorCode::HarnessError.as_str(), "no outcome"));
        let mut data = json!({"activation": sequence, "outcome": fixed.kind.as_str()});
        if let Some(code) = &fixed.code {
            data["code"] = json!(code);
        }
        if let Some(message) = &fixed.message {
            data["message"] = json!(message);
        }
        if let Some(result) = &fixed.result {
            data["result"] = result.clone();
        }
        if fixed.kind == OutcomeKind::Completed
            && let Some(through) = active.events_through
        {
            data["events_through"] = json!(through);
        }
        active.phase = Phase::Finishing;
        let token = DurableToken::Finished {
            session: session.clone(),
            sequence,
        };
        if let Err(error) = self.append(session, RecordKind::ActivationFinished, data, token) {
            log::error!(
                "session {session}: recording activation {sequence}'s outcome failed: {error}"
            );
            self.deliver(
                session,
                sequence,
                Fixed::failed(ErrorCode::JournalFailed.as_str(), error.to_string()),
            );
        }
    }

    fn on_finished_durable(
        &mut self,
        session: &SessionId,
        sequence: u64,
        result: Result<(), JournalError>,
    ) {
        let Some(fixed) = self
            .active_mut(session, sequence)
            .and_then(|a| a.fixed.clone())
        else {
            return;
        };
        let fixed = match result {
            Ok(()) => fixed,
            Err(error) => Fixed::failed(ErrorCode::JournalFailed.as_str(), error.to_string()),
        };
        self.deliver(session, sequence, fixed);
    }

    /// Delivers the outcome to waiters and frees the session for its next activation.
    fn deliver(&mut self, session: &SessionId, sequence: u64, fixed: Fixed) {
        let Some(state) = self.sessions.get_mut(session) else {
            return;
        };
        let Some(active) = state.active.take_if(|a| a.sequence == sequence) else {
            return;
        };
        if active.started && fixed.kind == OutcomeKind::Completed {
            state.marker = None;
        }
        self.metrics
            .activation(fixed.kind.as_str(), fixed.code.as_deref());
        self.metrics
            .activation_latency
            .observe(active.admitted_at.elapsed());
        log::info!(
            "session {session}: activation {sequence} {}{}",
            fixed.kind.as_str(),
            fixed
                .code
                .as_deref()
                .map(|c| format!(" ({c})"))
                .unwrap_or_default()
        );
        active.cell.complete(Outcome {
            session_id: session.clone(),
            sequence,
            outcome: fixed.kind,
            result: fixed.result,
            error: fixed.code.map(|code| ActivationError {
                code,
                message: fixed.message.unwrap_or_default(),
            }),
        });
    }

    // ----- cancellation and deadlines -----

    pub(crate) fn cancel(
        &mut self,
        session: &SessionId,
        sequence: Option<u64>,
    ) -> Result<Cancelled, ApiError> {
        let state = self.session(session)?;
        let Some(active) = state
            .active
            .as_ref()
            .filter(|a| sequence.is_none_or(|s| s == a.sequence))
        else {
            return Err(api(
                ErrorCode::ActivationNotActive,
                format!("session {session} has no such activation queued or running"),
            ));
        };
        let sequence = active.sequence;
        self.cancel_activation(
            session,
            sequence,
            Fixed::cancelled(ErrorCode::Cancelled, "cancelled"),
        )
    }

    /// Cancels an activation; `fixed` is the outcome recorded if nothing fixed one earlier and
    /// the activation does not complete anyway.
    fn cancel_activation(
        &mut self,
        session: &SessionId,
        sequence: u64,
        fixed: Fixed,
    ) -> Result<Cancelled, ApiError> {
        let (registration, slot) = match self.sessions.get(session) {
            Some(state) => (state.registration, state.slot),
            None => {
                return Err(api(
                    ErrorCode::UnknownSession,
                    format!("no session {session}"),
                ));
            }
        };
        let Some(queue) = self.queue(registration, slot) else {
            return Err(api(
                ErrorCode::ActivationNotActive,
                "the session's worker no longer exists",
            ));
        };
        let cancel_grace = self.options.cancel_grace;
        let Some(active) = self.active_mut(session, sequence) else {
            return Err(api(
                ErrorCode::ActivationNotActive,
                "the activation already ended",
            ));
        };
        match active.phase {
            Phase::Queued => {
                let removed = queue.remove(&QueueEntry {
                    session: session.clone(),
                    sequence,
                });
                active.cancel_requested = true;
                if !fixed_is_cancel(&fixed) || removed {
                    active.fix(fixed);
                }
                if removed {
                    self.end(session, sequence);
                }
                Ok(Cancelled {
                    sequence,
                    was_running: false,
                })
            }
            Phase::Starting { .. } => {
                active.cancel_requested = true;
                if !fixed_is_cancel(&fixed) {
                    active.fix(fixed);
                }
                Ok(Cancelled {
                    sequence,
                    was_running: true,
                })
            }
            Phase::Running { key } => {
                active.cancel_requested = true;
                active.effects_cancel.cancel();
                if !fixed_is_cancel(&fixed) {
                    active.fix(fixed);
                }
                if !active.cancel_sent {
                    active.cancel_sent = true;
                    let params = CancelParams {
                        session_id: session.as_str().to_owned(),
                        sequence,
                    };
                    self.pool.request(
                        key,
                        method::CANCEL,
                        &params,
                        SessionRequest::Cancel {
                            session: session.clone(),
                            sequence,
                        },
                    );
                    self.timer.at(
                        Instant::now() + cancel_grace,
                        Deadline::CancelGrace {
                            session: session.clone(),
                            sequence,
                        },
                    );
                }
                Ok(Cancelled {
                    sequence,
                    was_running: true,
                })
            }
            Phase::Ended | Phase::Finishing => Err(api(
                ErrorCode::ActivationNotActive,
                "the activation already ended",
            )),
        }
    }

    pub(crate) fn on_grace_expired(&mut self, session: &SessionId, sequence: u64, why: &str) {
        let Some(active) = self.active_mut(session, sequence) else {
            return;
        };
        let Phase::Running { key } = active.phase else {
            return;
        };
        active.fix(Fixed::cancelled(
            ErrorCode::Cancelled,
            format!("run was not answered within the grace after {why}; the worker was killed"),
        ));
        self.pool.kill(
            key,
            FailureReason::Killed(format!(
                "run of activation {sequence} of session {session} unanswered one grace after {why}"
            )),
        );
    }

    pub(crate) fn on_wall_deadline(&mut self, session: &SessionId, sequence: u64) {
        if self.active_mut(session, sequence).is_none() {
            return;
        }
        let fixed = Fixed::failed(
            ErrorCode::DeadlineExceeded.as_str(),
            "the activation's wall deadline expired",
        );
        let _ = self.cancel_activation(session, sequence, fixed);
    }

    pub(crate) fn end_queued_for_shutdown(&mut self) {
        for queue in self.queues.iter().flatten() {
            queue.set_open(false);
        }
        let queued: Vec<(SessionId, u64)> = self
            .sessions
            .iter()
            .filter_map(|(id, s)| {
                s.active
                    .as_ref()
                    .filter(|a| a.phase == Phase::Queued)
                    .map(|a| (id.clone(), a.sequence))
            })
            .collect();
        for (session, sequence) in queued {
            let _ = self.cancel_activation(
                &session,
                sequence,
                Fixed::cancelled(ErrorCode::ShuttingDown, "Brain is shutting down"),
            );
        }
    }

    pub(crate) fn cancel_all_running(&mut self) {
        let running: Vec<(SessionId, u64)> = self
            .sessions
            .iter()
            .filter_map(|(id, s)| s.active.as_ref().map(|a| (id.clone(), a.sequence)))
            .collect();
        for (session, sequence) in running {
            let _ = self.cancel_activation(
                &session,
                sequence,
                Fixed::cancelled(ErrorCode::Cancelled, "cancelled: Brain is shutting down"),
            );
        }
    }

    // ----- client events -----

    pub(crate) fn client_event(
        &mut self,
        id: &SessionId,
        event_type: String,
        data: Value,
        reply: Reply<u64>,
    ) {
        let refusal = match self.session(id) {
            Err(error) => Some(error),
            Ok(session) if session.lifecycle == Lifecycle::Closed => Some(api(
                ErrorCode::SessionClosed,
                format!("session {id} is closed"),
            )),
            Ok(_) if event_type.is_empty() || event_type.parse::<RecordKind>().is_ok() => {
                Some(api(
                    ErrorCode::InvalidRequest,
                    format!("type: {event_type:?} is empty or the type of Brain's own records"),
                ))
            }
            Ok(_) => None,
        };
        if let Some(error) = refusal {
            reply.deliver(Err(error));
            return;
        }
        let record = NewRecord {
            kind: RecordKind::EventEmitted,
            data: json!({"type": event_type, "data": data}),
            origin: Some(EventOrigin {
                kind: OriginKind::Client,
                sequence: 0,
            }),
        };
        match self.journal.append(id, record) {
            Ok(sequence) => {
                self.when_durable(id, sequence, DurableToken::ClientEvent { sequence, reply })
            }
            Err(error) => {
                reply.deliver(Err(journal_error(error)));
            }
        }
    }

    // ----- lifecycle -----

    fn send_close(&mut self, session: &SessionId, reason: CloseReason) {
        let Some(state) = self.sessions.get(session) else {
            return;
        };
        let Some(key) = self.pool.healthy_key(state.registration, state.slot) else {
            return; // no live harness holds its memory
        };
        let params = CloseParams {
            session_id: session.as_str().to_owned(),
            reason,
        };
        self.pool.request(
            key,
            method::CLOSE,
            &params,
            SessionRequest::Close {
                session: session.clone(),
            },
        );
    }

    pub(crate) fn passivate(&mut self, id: &SessionId, reply: Reply<SessionInfo>) {
        let refusal = match self.session(id) {
            Err(error) => Some(error),
            Ok(session) if session.active.is_some() => Some(api(
                ErrorCode::SessionBusy,
                format!("session {id} has an activation queued or running"),
            )),
            Ok(session) => match session.status() {
                SessionStatus::Closed => Some(api(
                    ErrorCode::SessionClosed,
                    format!("session {id} is closed"),
                )),
                SessionStatus::Interrupted => Some(api(
                    ErrorCode::SessionInterrupted,
                    format!("session {id} is interrupted and cannot be passivated"),
                )),
                SessionStatus::Passivated => {
                    reply.deliver(self.info(id));
                    return;
                }
                SessionStatus::Open => None,
            },
        };
        if let Some(error) = refusal {
            reply.deliver(Err(error));
            return;
        }
        if self.append_lifecycle(id, RecordKind::SessionPassivated, reply) {
            if let Some(state) = self.sessions.get_mut(id) {
                state.lifecycle = Lifecycle::Passivated;
            }
            self.send_close(id, CloseReason::Passivated);
        }
    }

    /// Appends a lifecycle record (passivated, closed) whose durability answers `reply`. False,
    /// with `reply` answered with the failure, when the journal refused it.
    fn append_lifecycle(
        &mut self,
        id: &SessionId,
        kind: RecordKind,
        reply: Reply<SessionInfo>,
    ) -> bool {
        match self.record(id, kind, json!({})) {
            Ok(sequence) => {
                let token = DurableToken::Lifecycle {
                    session: id.clone(),
                    reply,
                };
                self.when_durable(id, sequence, token);
                true
            }
            Err(error) => {
                reply.deliver(Err(journal_error(error)));
                false
            }
        }
    }

    /// Forgets a passivated or closed session's in-memory state, keeping only its placement, as a
    /// restart would, and has the journal drop its cached projections and records: it is
    /// recovered from the journal when a command next names it. Such a session's memory is then
    /// what a recovered one costs, not an open one's, and a Brain whose users close their
    /// sessions without deleting them does not grow with them.
    fn make_dormant(&mut self, id: &SessionId) {
        let status = self
            .sessions
            .get(id)
            .filter(|state| state.active.is_none())
            .map(SessionState::status);
        let since = match status {
            Some(SessionStatus::Passivated) => Since::Passivated,
            Some(SessionStatus::Closed) => Since::Closed,
            // Reopened meanwhile (a send arrived before the record was durable), or gone.
            _ => return,
        };
        if let Some(state) = self.sessions.remove(id) {
            self.journal.release(id);
            let dormant = Dormant {
                registration: state.registration,
                slot: state.slot,
                since,
            };
            self.dormant.insert(id.clone(), dormant);
            self.let_go_of_memory();
        }
    }

    /// After a session's state left the table (made dormant, or deleted): gives back what the
    /// table and the heap no longer need.
    fn let_go_of_memory(&mut self) {
        // The table keeps its capacity, hundreds of bytes a slot: give it back after a mass
        // passivation or deletion (at most once per halving, so the cost is amortised).
        if self.sessions.len() * 4 < self.sessions.capacity() {
            self.sessions.shrink_to(self.sessions.len() * 2);
        }
        // Sessions are let go of in waves; one trim a moment after the first covers the wave.
        if !self.trim_due {
            self.trim_due = true;
            self.timer
                .at(Instant::now() + TRIM_AFTER, Deadline::TrimHeap);
        }
    }

    pub(crate) fn close(&mut self, id: &SessionId, reply: Reply<SessionInfo>) {
        // A retried close of a session closed and made dormant answers it as it is, without
        // bringing back the memory its first close let go of.
        if self.dormant.closed(id).is_some() {
            reply.deliver(self.info_of(id));
            return;
        }
        self.ensure_loaded(id);
        let refusal = match self.session(id) {
            Err(error) => Some(error),
            Ok(session) if session.active.is_some() => Some(api(
                ErrorCode::SessionBusy,
                format!("session {id} has an activation queued or running"),
            )),
            Ok(session) if session.lifecycle == Lifecycle::Closed => {
                reply.deliver(self.info(id));
                return;
            }
            Ok(_) => None,
        };
        if let Some(error) = refusal {
            reply.deliver(Err(error));
            return;
        }
        let holds_memory = self
            .sessions
            .get(id)
            .is_some_and(|s| s.lifecycle != Lifecycle::Passivated);
        if self.append_lifecycle(id, RecordKind::SessionClosed, reply) {
            if let Some(state) = self.sessions.get_mut(id) {
                state.lifecycle = Lifecycle::Closed;
            }
            if holds_memory {
                self.send_close(id, CloseReason::Closed);
            }
        }
    }

    /// Deletes a closed or interrupted session. A session closed and then made dormant is
    /// deleted as it is, without being loaded: none of its state is needed, and its directories
    /// follow from its id and registration. Any other is loaded (recovered) first.
    pub(crate) fn delete(&mut self, id: &SessionId) -> Result<[PathBuf; 2], ApiError> {
        let closed_dormant = self
            .dormant
            .closed(id)
            .and_then(|dormant| self.registrations.get(dormant.registration));
        let (interrupted, dirs) = match closed_dormant {
            Some(registration) => (
                false,
                crate::datadir::session_dirs(&self.data_dir, &registration.name, id),
            ),
            None => {
                self.ensure_loaded(id);
                let session = self.session(id)?;
                if session.active.is_some() {
                    return Err(api(
                        ErrorCode::SessionBusy,
                        format!("session {id} has an activation queued or running"),
                    ));
                }
                let status = session.status();
                if !matches!(status, SessionStatus::Closed | SessionStatus::Interrupted) {
                    return Err(api(
                        ErrorCode::InvalidRequest,
                        format!("session {id} is {status:?}; close it before deleting it"),
                    ));
                }
                let dirs = [
                    session.spec.state_dir.clone(),
                    session.spec.workspace_dir.clone(),
                ];
                (status == SessionStatus::Interrupted, dirs)
            }
        };
        let create_key = self.create_key_of(id);
        self.journal.delete(id).map_err(journal_error)?;
        if let Some(key) = create_key {
            self.create_keys.forget(&key, id);
        }
        if interrupted {
            self.send_close(id, CloseReason::Deleted);
        }
        self.sessions.remove(id);
        self.dormant.remove(id);
        self.let_go_of_memory();
        log::info!("session {id}: deleted");
        Ok(dirs)
    }
}

/// A session's tool catalogue as a fixed-catalogue harness keeps it: declarations and placement
/// environment names, never incarnation sequences.
pub(crate) fn tool_catalogue(tools: &[ToolSpec]) -> Value {
    json!(
        tools
            .iter()
            .map(|t| json!({"name": t.name, "description": t.description,
                        "input_schema": t.input_schema, "placements": t.placements}))
            .collect::<Vec<_>>()
    )
}

/// What changed between two catalogues, named for the refusal; `None` when they are equal.
pub(crate) fn catalogue_change(first: &Value, current: &Value) -> Option<String> {
    if first == current {
        return None;
    }
    let names = |catalogue: &Value| -> Vec<(String, Value)> {
        catalogue
            .as_array()
            .map(|tools| {
                tools
                    .iter()
                    .map(|t| (t["name"].as_str().unwrap_or_default().to_owned(), t.clone()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (before, after) = (names(first), names(current));
    let mut changes = Vec::new();
    for (name, tool) in &after {
        match before.iter().find(|(n, _)| n == name) {
            None => changes.push(format!("tool {name:?} added")),
            Some((_, old)) if old != tool => changes.push(format!("tool {name:?} changed")),
            Some(_) => {}
        }
    }
    for (name, _) in &before {
        if !after.iter().any(|(n, _)| n == name) {
            changes.push(format!("tool {name:?} removed"));
        }
    }
    if changes.is_empty() {
        changes.push("the tools were reordered".to_owned());
    }
    Some(changes.join(", "))
}

fn fixed_is_cancel(fixed: &Fixed) -> bool {
    fixed.kind == OutcomeKind::Cancelled && fixed.code.as_deref() == Some("cancelled")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(json: Value) -> Vec<ToolSpec> {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_catalogue_is_declarations_and_placement_names_and_its_changes_are_named() {
        let first = tool_catalogue(&tools(json!([
            {"name": "bash", "description": "run", "placements": ["box"]},
            {"name": "read", "placements": ["box"]}
        ])));
        assert_eq!(first[0]["placements"], json!(["box"]));
        assert_eq!(catalogue_change(&first, &first.clone()), None);
        let changed = tool_catalogue(&tools(json!([
            {"name": "bash", "description": "run", "placements": ["other"]},
            {"name": "write", "placements": ["box"]}
        ])));
        assert_eq!(
            catalogue_change(&first, &changed).unwrap(),
            "tool \"bash\" changed, tool \"write\" added, tool \"read\" removed"
        );
        let reordered = json!([first[1].clone(), first[0].clone()]);
        assert_eq!(
            catalogue_change(&first, &reordered).unwrap(),
            "the tools were reordered"
        );
    }
}
