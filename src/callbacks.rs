//! Callbacks (`brain/call`): admission on the dispatcher, execution on the executor threads.
//!
//! Admission decides, on the dispatcher and from its own state alone, whether a callback belongs
//! to the activation it names (authority), whether it may start (after `cancel`, after a fatal
//! error, the per-activation limit), and otherwise hands it to the executor. An executor thread
//! runs it — journal appends that wait for durability, model and tool effects that block on
//! providers — and reports back.
//!
//! Model and tool calls do not hold an executor while their records become durable. The
//! dispatcher starts them itself when it admits them: it builds the started record and hands it
//! to the journal without waiting (that work never blocks, and an executor hop for it cost a
//! wake-up per call). Once the record is durable the effect is queued, to be performed by
//! whichever executor takes it. The finished record goes to the journal the same way, and
//! whichever thread makes it durable reports. Under load executors then run jobs instead of
//! sleeping through other threads' flushes.
//!
//! The thread that finishes a callback reports it to the dispatcher and then writes the answer
//! to the harness itself, so that the answer does not wait for the dispatcher to wake up. The
//! report is sent before the answer is written, and the dispatcher takes every report waiting
//! for it before it handles anything a worker said: so whatever the harness does after it reads
//! the answer (answers `run`, reuses the request id, makes another callback after a fatal error)
//! reaches a dispatcher that already counted the callback as answered and recorded its fatal
//! error (a prompt `run` answer never looks like `callbacks_outstanding`). A success while the
//! activation runs on is reported quietly, without waking the dispatcher (see [`Reply::send`]).

use crate::cancel::CancelToken;
use crate::dispatch::{Dispatcher, Internal};
use crate::effects::{
    Effects, EnvironmentDriver, EnvironmentSpec, ModelCall, ModelProvider, ToolCall,
};
use crate::handoff::{Consumer, WorkQueue};
use crate::journal::{EffectRecord, IdlePlacement, Journal, JournalError, NewRecord, Placed};
use crate::metrics::Metrics;
use crate::pool::{Deadline, SlotQueue};
use crate::protocol::harness::{
    BrainCall, CallbackInput, CallbackMethod, EnvironmentInfo, EnvironmentSummary,
    EnvironmentsCallResult, EnvironmentsListResult, ErrorCode, EventOrigin, EventsReadResult,
    KvGetResult, MAX_EVENTS_PAGE, MAX_OUTSTANDING_CALLBACKS, ModelRequest, OriginKind,
    RESERVED_KEY_PREFIX, RecordKind, SequenceResult, ToolCallInput, ToolDefinition, ToolOutcome,
    ToolResult, call_error, method,
};
use crate::protocol::jsonrpc::{self, Request, RequestId, RpcError};
use crate::session::{Permission, SessionId};
use crate::sessions::{Fixed, Phase, SessionSpec};
use crate::worker::WorkerKey;
use crossbeam_channel::Sender;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// One admitted callback, for an executor thread.
pub(crate) struct Job {
    session: SessionId,
    sequence: u64,
    key: WorkerKey,
    id: RequestId,
    spec: Arc<SessionSpec>,
    /// The session's environment incarnations when the callback was admitted.
    incarnations: HashMap<String, u64>,
    cancel: CancelToken,
    metrics: Arc<Metrics>,
    /// The worker slot's outgoing lines: the answer is written there, for `key`'s incarnation.
    answers: SlotQueue,
}

/// A finished callback, reported to the dispatcher just before its answer is written.
pub(crate) struct CallbackDone {
    session: SessionId,
    sequence: u64,
    key: WorkerKey,
    id: RequestId,
    /// Whether the callback succeeded; its error, for the metrics and a fatal error's bookkeeping.
    outcome: Result<(), RpcError>,
    /// A successful `environments.setup`: the environment's new incarnation.
    incarnation: Option<(String, u64)>,
    method: &'static str,
}

/// The pool of threads that run callbacks (`brain-callback-N`).
pub(crate) struct Executor {
    jobs: Arc<WorkQueue<Work>>,
    journal: Arc<dyn Journal>,
    effects: Effects,
    reports: Reports,
}

impl Executor {
    /// Starts `threads` threads. They stop when the executor is dropped.
    pub(crate) fn start(
        threads: usize,
        journal: Arc<dyn Journal>,
        effects: Effects,
        internal: Sender<Internal>,
    ) -> std::io::Result<Executor> {
        // As many executors run at once, without blocking, as there are CPUs to run them; the
        // others are woken only as those block (see `WorkQueue`).
        let runners = std::thread::available_parallelism().map_or(1, usize::from);
        let jobs = Arc::new(WorkQueue::new(runners));
        let reports = Reports {
            internal,
            quiet: Arc::default(),
        };
        for n in 0..threads.max(1) {
            let (queue, journal, effects, reports) = (
                jobs.clone(),
                journal.clone(),
                effects.clone(),
                reports.clone(),
            );
            std::thread::Builder::new()
                .name(format!("brain-callback-{n}"))
                .spawn(move || serve(&queue, &*journal, &effects, &reports))?;
        }
        Ok(Executor {
            jobs,
            journal,
            effects,
            reports,
        })
    }

    /// Takes the quiet reports waiting (see [`Reply::send`]).
    pub(crate) fn take_quiet_reports(&self) -> Vec<CallbackDone> {
        std::mem::take(&mut *self.reports.quiet.lock())
    }

    /// Runs `call` in `job`'s context. The call is owned by the executor from here on, so that
    /// its input (a model request carries the whole transcript) is never copied.
    ///
    /// A model or tool call is started on the calling thread (the dispatcher): its started
    /// record is built and handed to the journal, which never blocks here, and once the record
    /// is durable the effect is queued for an executor thread; or, when the journal is idle,
    /// the record is placed and the executor flushes it before it performs the effect. A call
    /// that only appends a record (`kv.put`, `kv.delete`, `transcript.set`, `emit`) runs here
    /// too, and is answered by whichever thread makes its record durable. Every other call is
    /// queued as it is. An executor cost a thread hand-off (and, with the executors parked, a
    /// wake-up) per call for work that never blocks.
    fn submit(&self, job: Job, call: CallbackInput) {
        if matches!(
            call,
            CallbackInput::Model(_)
                | CallbackInput::Tool(_)
                | CallbackInput::KvPut(_)
                | CallbackInput::KvDelete(_)
                | CallbackInput::TranscriptSet(_)
                | CallbackInput::Emit(_)
        ) {
            let method = call.method().as_str();
            let answer = run(&job, call, &*self.journal, &self.effects, &mut None);
            conclude(
                &self.jobs,
                None,
                &*self.journal,
                &self.reports,
                job,
                method,
                answer,
                None,
            );
            return;
        }
        // The queue closes only when the executor is dropped, and then nobody submits.
        let _ = self.jobs.push(Work::Call(job, call));
    }
}

impl Drop for Executor {
    /// Stops the threads once they have run the jobs already queued.
    fn drop(&mut self) {
        self.jobs.close();
    }
}

/// What an executor thread takes off its queue.
enum Work {
    /// A callback the dispatcher admitted.
    Call(Job, CallbackInput),
    /// An effect whose started record (the sequence) is durable: to perform now.
    Perform(Job, Effect, u64),
    /// An effect whose started record is placed and not yet durable: to flush, then perform.
    FlushThenPerform(Job, Effect, Placed),
}

/// An effect between its started record and its call: what the call needs.
enum Effect {
    Model {
        provider: Arc<dyn ModelProvider>,
        request: ModelRequest,
        ordinal: u64,
    },
    Tool {
        driver: Arc<dyn EnvironmentDriver>,
        environment: EnvironmentSpec,
        incarnation: u64,
        input: ToolCallInput,
    },
}

impl Effect {
    fn method(&self) -> &'static str {
        match self {
            Effect::Model { .. } => CallbackMethod::Model.as_str(),
            Effect::Tool { .. } => CallbackMethod::Tool.as_str(),
        }
    }

    /// Whether performing it never blocks (see [`ModelProvider::answers_at_once`]).
    fn answers_at_once(&self) -> bool {
        match self {
            Effect::Model { provider, .. } => provider.answers_at_once(),
            Effect::Tool { driver, .. } => driver.answers_at_once(),
        }
    }
}

fn serve(
    queue: &Arc<WorkQueue<Work>>,
    journal: &dyn Journal,
    effects: &Effects,
    reports: &Reports,
) {
    let mut me = Consumer::default();
    while let Some(work) = PERFORM_NEXT
        .with_borrow_mut(Option::take)
        .or_else(|| queue.pop(&mut me))
    {
        let mut incarnation = None;
        // Before anything that may block, the work queued behind this job gets a thread of
        // its own (see `WorkQueue`): the calls queued here are those that read the journal or
        // run a driver (the rest run on the dispatcher, see `Executor::submit`), and an effect
        // blocks unless its provider or driver answers at once.
        let (job, method, answer) = match work {
            Work::Call(job, call) => {
                queue.hand_off(&mut me);
                let method = call.method().as_str();
                let answer = run(&job, call, journal, effects, &mut incarnation);
                (job, method, answer)
            }
            Work::Perform(job, effect, started) => {
                if !effect.answers_at_once() {
                    queue.hand_off(&mut me);
                }
                let method = effect.method();
                let answer = perform(&job, effect, started);
                (job, method, answer)
            }
            Work::FlushThenPerform(job, effect, placed) => {
                // The flush blocks.
                queue.hand_off(&mut me);
                let method = effect.method();
                let answer = match journal.flush_placed(&placed) {
                    Ok(()) => perform(&job, effect, placed.sequence),
                    Err(error) => Err(journal_failed(error)),
                };
                (job, method, answer)
            }
        };
        // From here to the end of the iteration this thread only hands the job's last record to
        // the journal: an effect its flush makes durable meanwhile is what it does next.
        let _between_jobs = BetweenJobs::enter(queue);
        conclude(
            queue,
            Some(&mut me),
            journal,
            reports,
            job,
            method,
            answer,
            incarnation,
        );
    }
}

/// Acts on a callback's answer, on whichever thread ran the call (`me` on an executor, `None`
/// on the dispatcher): sends it, or hands its record to the journal with what follows once the
/// record is durable.
#[allow(clippy::too_many_arguments)]
fn conclude(
    queue: &Arc<WorkQueue<Work>>,
    me: Option<&mut Consumer>,
    journal: &dyn Journal,
    reports: &Reports,
    job: Job,
    method: &'static str,
    answer: Result<Answer, RpcError>,
    incarnation: Option<(String, u64)>,
) {
    let session = job.session.clone();
    let reply = Reply {
        method,
        job,
        reports: reports.clone(),
    };
    match answer {
        Ok(Answer::Now(line)) => reply.send(Ok(line), incarnation),
        Ok(Answer::Start { record, effect }) => {
            // With the journal idle, the executor that performs the effect flushes its started
            // record first: one thread woken instead of the writer and then an executor.
            let record = match journal.place_effect_if_idle(&session, record) {
                Ok(IdlePlacement::Placed(placed)) => {
                    let Reply { job, .. } = reply;
                    // Refused only once the executor is dropped, as in `perform_next`.
                    let _ = queue.push(Work::FlushThenPerform(job, effect, placed));
                    return;
                }
                Ok(IdlePlacement::Busy(record)) => record,
                Err(error) => return reply.send(Err(journal_failed(error)), None),
            };
            let queue = queue.clone();
            let then = move |durable: Result<u64, JournalError>| match durable {
                Ok(started) => {
                    let Reply { job, .. } = reply;
                    perform_next(&queue, Work::Perform(job, effect, started));
                }
                Err(error) => reply.send(Err(journal_failed(error)), None),
            };
            journal.append_effect_queued(&session, record, Box::new(then));
        }
        Ok(Answer::WhenDurable { sequence, line }) => journal.on_durable(
            &session,
            sequence,
            Box::new(move |durable| match durable {
                Ok(()) => reply.send(Ok(line), None),
                Err(error) => reply.send(Err(journal_failed(error)), None),
            }),
        ),
        Ok(Answer::OnceDurable { record, answer }) => {
            let then: crate::journal::AppendedCallback = Box::new(move |durable| match durable {
                Ok(_) => reply.send(answer, None),
                Err(error) => reply.send(Err(journal_failed(error)), None),
            });
            // Flushing here blocks this thread: it does so only on an executor with no job
            // queued behind it, which first hands off (stops counting as running).
            match me {
                Some(me) if queue.is_empty() => {
                    queue.hand_off(me);
                    journal.append_effect_then(&session, record, then);
                }
                _ => journal.append_effect_queued(&session, record, then),
            }
        }
        Err(error) => reply.send(Err(error), incarnation),
    }
}

thread_local! {
    /// On an executor thread that has finished a job's work and is handing its record to the
    /// journal: the queue it serves (see [`queue_id`]); 0 elsewhere, and during a job, which may
    /// flush on this thread and then block on a provider or a driver for long.
    static BETWEEN_JOBS_OF: Cell<usize> = const { Cell::new(0) };
    /// On an executor thread: an effect whose started record this thread's own flush made
    /// durable, to perform next. Queueing it instead would wake another executor for it while
    /// this one, awake already, found the queue empty and went to sleep.
    static PERFORM_NEXT: RefCell<Option<Work>> = const { RefCell::new(None) };
}

/// Tells one executor pool's queue from another's (several Brains may share a process).
fn queue_id(queue: &Arc<WorkQueue<Work>>) -> usize {
    Arc::as_ptr(queue) as usize
}

/// Marks this executor thread as between jobs (see `BETWEEN_JOBS_OF`) until dropped.
struct BetweenJobs;

impl BetweenJobs {
    fn enter(queue: &Arc<WorkQueue<Work>>) -> BetweenJobs {
        BETWEEN_JOBS_OF.set(queue_id(queue));
        BetweenJobs
    }
}

impl Drop for BetweenJobs {
    fn drop(&mut self) {
        BETWEEN_JOBS_OF.set(0);
    }
}

/// Keeps `work` for this thread to perform next when this thread is one of `queue`'s executors,
/// between jobs, and keeps nothing yet (one at most: the rest go to the queue, to run in
/// parallel); queues it otherwise.
fn perform_next(queue: &Arc<WorkQueue<Work>>, work: Work) {
    let here = BETWEEN_JOBS_OF.get() == queue_id(queue);
    let work = PERFORM_NEXT.with_borrow_mut(|next| {
        if here && next.is_none() {
            *next = Some(work);
            None
        } else {
            Some(work)
        }
    });
    if let Some(work) = work {
        // Refused only once the executor is dropped: Brain is stopping and nobody waits for the
        // answer; the effect stays unperformed, as after a crash between its started record and
        // its call.
        let _ = queue.push(work);
    }
}

/// A callback's answer, as [`run`] leaves it.
enum Answer {
    /// The response line, to send now.
    Now(Vec<u8>),
    /// An effect's started record, and the effect. The dispatcher appends the record and goes
    /// on; once the record is durable the effect is queued to be performed ([`Work::Perform`]),
    /// so that no executor sleeps through another thread's flush.
    Start {
        record: EffectRecord,
        effect: Effect,
    },
    /// A record appended (not yet durable) and the response line, to send once the record is
    /// durable: for the calls that only append (`kv.put`, `kv.delete`, `transcript.set`,
    /// `emit`), which the dispatcher runs itself (see [`Executor::submit`]).
    WhenDurable { sequence: u64, line: Vec<u8> },
    /// An effect's finished record and the answer (the response line, or the callback's error),
    /// to send once the record is durable. The executor appends it and goes back to its queue:
    /// whoever makes the record durable sends the answer, so that under load no executor waits
    /// for another thread's flush.
    OnceDurable {
        record: EffectRecord,
        answer: Result<Vec<u8>, RpcError>,
    },
}

/// Where callbacks are reported to the dispatcher.
#[derive(Clone)]
struct Reports {
    /// Reports the dispatcher must act on at once (it is woken for them).
    internal: Sender<Internal>,
    /// Reports of callbacks that succeeded while their activation ran on: the dispatcher takes
    /// them whenever it wakes, and always before a worker's message, without being woken for
    /// them (see [`Reply::send`]).
    quiet: Arc<parking_lot::Mutex<Vec<CallbackDone>>>,
}

/// Where the answer to one callback goes: reported to the dispatcher as a [`CallbackDone`],
/// then written to the worker.
struct Reply {
    method: &'static str,
    job: Job,
    reports: Reports,
}

impl Reply {
    /// Reports the callback finished and then writes its answer, on this thread: the report
    /// first, so that the dispatcher has it before anything the harness does after reading the
    /// answer (see the module's documentation).
    fn send(self, answer: Result<Vec<u8>, RpcError>, incarnation: Option<(String, u64)>) {
        let Job {
            session,
            sequence,
            key,
            id,
            answers,
            cancel,
            ..
        } = self.job;
        let (line, outcome) = match answer {
            Ok(line) => (line, Ok(())),
            Err(error) => (jsonrpc::encode_error(&id, &error), Err(error)),
        };
        let quiet = outcome.is_ok() && incarnation.is_none();
        let done = CallbackDone {
            method: self.method,
            session,
            sequence,
            key,
            id,
            outcome,
            incarnation,
        };
        // A success changes nothing the dispatcher must act on before its next message from
        // the worker (which it handles only after taking the quiet reports), unless the
        // activation has ended or is being cancelled: then the dispatcher may be waiting for
        // its callbacks to drain. That is read under the mailbox's lock, which the dispatcher
        // takes after it cancels: either it finds this report, or this finds the cancel and
        // wakes it. Not waking it for every success spares a wake-up per batch of answers.
        let wake = if quiet {
            let mut mailbox = self.reports.quiet.lock();
            mailbox.push(done);
            cancel.is_cancelled().then_some(Internal::QuietReports)
        } else {
            Some(Internal::CallbackDone(done))
        };
        if let Some(message) = wake {
            // Fails only once the dispatcher has stopped, and then nobody waits for the answer.
            if self.reports.internal.send(message).is_err() {
                return;
            }
        }
        // Dropped when that incarnation of the worker is gone.
        answers.send_line(key.generation, line);
    }
}

/// The response line answering `job` with `result`. Executors encode it straight from the typed
/// result, in parallel, so the dispatcher only forwards bytes.
fn answer(job: &Job, result: &impl Serialize) -> Result<Answer, RpcError> {
    Ok(Answer::Now(jsonrpc::encode_result(&job.id, result)))
}

fn kv_get_result(value: Option<Value>) -> KvGetResult {
    match value {
        Some(value) => KvGetResult::found(value),
        None => KvGetResult::missing(),
    }
}

fn journal_failed(error: JournalError) -> RpcError {
    call_error(error.code(), error.to_string())
}

fn append(
    journal: &dyn Journal,
    job: &Job,
    kind: RecordKind,
    data: Value,
    origin: Option<EventOrigin>,
) -> Result<u64, RpcError> {
    if data.get("outcome") == Some(&json!("unknown")) {
        job.metrics.unknown_outcome();
    }
    journal
        .append_durable(&job.session, NewRecord { kind, data, origin })
        .map_err(journal_failed)
}

fn sequence_answer(job: &Job, sequence: u64) -> Result<Answer, RpcError> {
    answer(job, &SequenceResult { sequence })
}

/// Appends a record without waiting for it: see [`Answer::WhenDurable`].
fn append_queued(
    journal: &dyn Journal,
    job: &Job,
    kind: RecordKind,
    data: Value,
    origin: Option<EventOrigin>,
) -> Result<u64, RpcError> {
    journal
        .append(&job.session, NewRecord { kind, data, origin })
        .map_err(journal_failed)
}

/// The answer `{"sequence"}` to a call whose record `sequence` was appended, to send once the
/// record is durable.
fn once_durable(job: &Job, sequence: u64) -> Result<Answer, RpcError> {
    Ok(Answer::WhenDurable {
        sequence,
        line: jsonrpc::encode_result(&job.id, &SequenceResult { sequence }),
    })
}

fn reserved(key: &str) -> Result<(), RpcError> {
    if key.starts_with(RESERVED_KEY_PREFIX) {
        return Err(call_error(
            ErrorCode::ReservedKey,
            format!("keys beginning {RESERVED_KEY_PREFIX:?} are Brain's: {key:?}"),
        ));
    }
    Ok(())
}

/// Runs one callback to its answer. A successful setup reports the new incarnation.
fn run(
    job: &Job,
    call: CallbackInput,
    journal: &dyn Journal,
    effects: &Effects,
    incarnation: &mut Option<(String, u64)>,
) -> Result<Answer, RpcError> {
    match call {
        CallbackInput::KvGet(input) => {
            let value = journal
                .kv_get(&job.session, &input.key)
                .map_err(journal_failed)?;
            answer(job, &kv_get_result(value))
        }
        CallbackInput::KvPut(input) => {
            reserved(&input.key)?;
            let data = json!({"key": input.key, "value": input.value});
            once_durable(
                job,
                append_queued(journal, job, RecordKind::KvSet, data, None)?,
            )
        }
        CallbackInput::KvDelete(input) => {
            reserved(&input.key)?;
            let data = json!({"key": input.key});
            once_durable(
                job,
                append_queued(journal, job, RecordKind::KvDelete, data, None)?,
            )
        }
        CallbackInput::TranscriptSet(input) => {
            let mut keep = 0;
            journal
                .inspect(&job.session, &mut |view| {
                    keep = view
                        .transcript
                        .iter()
                        .zip(&input.messages)
                        .take_while(|(old, new)| old == new)
                        .count();
                })
                .map_err(journal_failed)?;
            let sequence = journal
                .append_transcript(&job.session, keep, &input.messages[keep..])
                .map_err(journal_failed)?;
            once_durable(job, sequence)
        }
        CallbackInput::Emit(input) => {
            if input.event_type.parse::<RecordKind>().is_ok() {
                return Err(call_error(
                    ErrorCode::InvalidInput,
                    format!("{:?} is the type of Brain's own records", input.event_type),
                ));
            }
            let data = json!({"type": input.event_type, "data": input.data});
            let origin = EventOrigin {
                kind: OriginKind::Agentloop,
                sequence: job.sequence,
            };
            let sequence =
                append_queued(journal, job, RecordKind::EventEmitted, data, Some(origin))?;
            once_durable(job, sequence)
        }
        CallbackInput::EventsRead(input) => {
            let limit = input
                .limit
                .map_or(MAX_EVENTS_PAGE, |l| (l as usize).min(MAX_EVENTS_PAGE));
            let events = journal
                .read(&job.session, input.after, limit)
                .map_err(journal_failed)?;
            let next_after = events.last().map_or(input.after, |e| e.sequence);
            answer(job, &EventsReadResult { events, next_after })
        }
        CallbackInput::Telemetry(data) => {
            log::info!(target: "brain::telemetry", "session {} activation {}: {data}", job.session, job.sequence);
            answer(job, &json!({}))
        }
        CallbackInput::Model(request) => model(job, journal, effects, request),
        CallbackInput::Tool(input) => tool(job, effects, input),
        CallbackInput::EnvironmentsList(_) => {
            let environments = job
                .spec
                .request
                .environments
                .iter()
                .filter(|e| granted(job, &e.name, Permission::Read).is_ok())
                .map(|e| {
                    let (spec, driver) = environment(job, effects, &e.name)?;
                    Ok(EnvironmentSummary {
                        name: e.name.clone(),
                        sequence: current_incarnation(job, &e.name),
                        status: driver.status(&spec),
                    })
                })
                .collect::<Result<Vec<_>, RpcError>>()?;
            answer(job, &EnvironmentsListResult { environments })
        }
        CallbackInput::EnvironmentsGet(input) => {
            granted(job, &input.name, Permission::Read)?;
            let (spec, driver) = environment(job, effects, &input.name)?;
            answer(
                job,
                &EnvironmentInfo {
                    name: input.name.clone(),
                    sequence: current_incarnation(job, &input.name),
                    status: driver.status(&spec),
                    driver: spec.driver.clone(),
                },
            )
        }
        CallbackInput::EnvironmentsSetup(input) => {
            granted(job, &input.name, Permission::Setup)?;
            let (spec, driver) = environment(job, effects, &input.name)?;
            let started = append(
                journal,
                job,
                RecordKind::EnvironmentStarted,
                json!({"activation": job.sequence, "name": input.name, "operation": "setup",
                       "incarnation": current_incarnation(job, &input.name)}),
                None,
            )?;
            let outcome = driver.setup(&spec, &job.session, &job.cancel);
            let (data, answer) = match outcome {
                Ok(()) => (
                    json!({"started": started, "name": input.name, "operation": "setup", "outcome": "ok"}),
                    sequence_answer(job, started),
                ),
                Err(error) => environment_failure(started, error),
            };
            append(journal, job, RecordKind::EnvironmentFinished, data, None)?;
            if answer.is_ok() {
                *incarnation = Some((input.name.clone(), started));
            }
            answer
        }
        CallbackInput::EnvironmentsCall(input) => {
            granted(job, &input.name, Permission::Call)?;
            let (spec, driver) = environment(job, effects, &input.name)?;
            let started = append(
                journal,
                job,
                RecordKind::EnvironmentStarted,
                json!({"activation": job.sequence, "name": input.name, "operation": "call",
                       "method": input.method, "input": input.input,
                       "incarnation": current_incarnation(job, &input.name)}),
                None,
            )?;
            let outcome = driver.call(&spec, &input.method, &input.input, &job.cancel);
            let (data, answer) = match outcome {
                Ok(result) => (
                    json!({"started": started, "name": input.name, "operation": "call",
                           "outcome": "ok", "result": result}),
                    answer(
                        job,
                        &EnvironmentsCallResult {
                            sequence: started,
                            result,
                        },
                    ),
                ),
                Err(error) => environment_failure(started, error),
            };
            append(journal, job, RecordKind::EnvironmentFinished, data, None)?;
            answer
        }
    }
}

/// Refuses `not_granted` (no record, no effect) unless the session granted this permission on
/// this environment.
fn granted(job: &Job, name: &str, permission: Permission) -> Result<(), RpcError> {
    match job.spec.request.agentloop.grant(name) {
        Some(grant) if grant.allows(permission) => Ok(()),
        _ => Err(call_error(
            ErrorCode::NotGranted,
            format!(
                "environment {name:?} is not granted the {} permission",
                permission.as_str()
            ),
        )),
    }
}

fn current_incarnation(job: &Job, name: &str) -> u64 {
    job.incarnations.get(name).copied().unwrap_or(1)
}

/// The declared environment and its driver.
fn environment(
    job: &Job,
    effects: &Effects,
    name: &str,
) -> Result<(EnvironmentSpec, Arc<dyn crate::effects::EnvironmentDriver>), RpcError> {
    let declaration = job
        .spec
        .request
        .environments
        .iter()
        .find(|e| e.name == name)
        .ok_or_else(|| call_error(ErrorCode::InvalidInput, format!("no environment {name:?}")))?;
    let driver = effects.driver(&declaration.driver).ok_or_else(|| {
        call_error(
            ErrorCode::InvalidInput,
            format!("no environment driver named {:?}", declaration.driver),
        )
    })?;
    let spec = EnvironmentSpec {
        name: declaration.name.clone(),
        driver: declaration.driver.clone(),
        configuration: declaration.configuration.clone(),
    };
    Ok((spec, driver))
}

/// A model call across the effect barrier: started (durable) → call once → finished (durable).
/// This is the first step: the request completed from the session and the started record.
fn model(
    job: &Job,
    journal: &dyn Journal,
    effects: &Effects,
    mut request: ModelRequest,
) -> Result<Answer, RpcError> {
    let spec = &job.spec;
    let provider = effects.provider(&spec.model.provider).ok_or_else(|| {
        call_error(
            ErrorCode::ModelFailed,
            format!("no model provider named {:?}", spec.model.provider),
        )
    })?;
    if request.system.is_none() {
        request.system = spec.request.system.clone();
    }
    if request.tools.is_none() {
        request.tools = Some(
            spec.request
                .tools
                .iter()
                .map(|t| ToolDefinition {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    input_schema: t.input_schema.clone(),
                })
                .collect(),
        );
    }
    let mut ordinal = 0;
    journal
        .inspect(&job.session, &mut |view| ordinal = view.model_calls)
        .map_err(journal_failed)?;
    #[derive(Serialize)]
    struct Started<'a> {
        activation: u64,
        ordinal: u64,
        request: &'a ModelRequest,
    }
    let data = Started {
        activation: job.sequence,
        ordinal,
        request: &request,
    };
    let record =
        EffectRecord::started(RecordKind::ModelCallStarted, &data).map_err(journal_failed)?;
    Ok(Answer::Start {
        record,
        effect: Effect::Model {
            provider,
            request,
            ordinal,
        },
    })
}

/// Performs an effect whose started record, `started`, is durable, and finishes it.
fn perform(job: &Job, effect: Effect, started: u64) -> Result<Answer, RpcError> {
    match effect {
        Effect::Model {
            provider,
            request,
            ordinal,
        } => perform_model(job, &*provider, &request, ordinal, started),
        Effect::Tool {
            driver,
            environment,
            incarnation,
            input,
        } => perform_tool(job, &*driver, &environment, incarnation, input, started),
    }
}

/// Calls the provider of a started model call, and finishes it.
fn perform_model(
    job: &Job,
    provider: &dyn ModelProvider,
    request: &ModelRequest,
    ordinal: u64,
    started: u64,
) -> Result<Answer, RpcError> {
    let call = ModelCall {
        session_id: &job.session,
        sequence: started,
        ordinal,
        model: &job.spec.model,
        request,
    };
    match provider.call(&call, &job.cancel) {
        Ok(result) => finish_effect(job, RecordKind::ModelCallFinished, started, "ok", &result),
        Err(error) => {
            let (data, error) = effect_failure(error);
            finish_failed(job, RecordKind::ModelCallFinished, started, &data, error)
        }
    }
}

/// An effect's finished record, `{"outcome", "result", "started"}`, and the answer to the
/// callback, `{"sequence": started, "result"}` (a `ModelCallResult` or a `ToolCallResult`), to
/// send once the record is durable. The result is encoded once, for both. An `unknown` outcome is
/// counted, as [`append`] counts it.
fn finish_effect(
    job: &Job,
    kind: RecordKind,
    started: u64,
    outcome: &str,
    result: &impl Serialize,
) -> Result<Answer, RpcError> {
    if outcome == "unknown" {
        job.metrics.unknown_outcome();
    }
    let result = crate::protocol::json::to_raw_value(result).map_err(|error| {
        call_error(
            ErrorCode::JournalFailed,
            format!("the {kind} record's result cannot be encoded: {error}"),
        )
    })?;
    #[derive(Serialize)]
    struct Finished<'a> {
        outcome: &'a str,
        result: &'a RawValue,
    }
    let data = Finished {
        outcome,
        result: &result,
    };
    let record = EffectRecord::finished(kind, started, &data).map_err(journal_failed)?;
    #[derive(Serialize)]
    struct CallResult<'a> {
        sequence: u64,
        result: &'a RawValue,
    }
    let line = jsonrpc::encode_result(
        &job.id,
        &CallResult {
            sequence: started,
            result: &result,
        },
    );
    Ok(Answer::OnceDurable {
        record,
        answer: Ok(line),
    })
}

/// The finished record's data (without `started`) and the callback's error for an effect that
/// did not succeed.
fn effect_failure(error: crate::effects::EffectError) -> (Value, RpcError) {
    use crate::effects::EffectError;
    match error {
        EffectError::Failed { code, message } => (
            json!({"outcome": "error", "code": code, "message": message}),
            call_error(code, message),
        ),
        EffectError::Unknown { message } => (
            json!({"outcome": "unknown", "code": "outcome_unknown", "message": message}),
            call_error(ErrorCode::OutcomeUnknown, message),
        ),
        EffectError::Cancelled { sent } => {
            let outcome = if sent { "unknown" } else { "cancelled" };
            (
                json!({"outcome": outcome, "code": "cancelled"}),
                call_error(ErrorCode::Cancelled, "cancelled"),
            )
        }
    }
}

/// A model or tool call's finished record for a failure, `data` followed by `"started"`, and
/// the callback's error, to send once the record is durable (as [`finish_effect`] does for a
/// result). An `unknown` outcome is counted, as [`append`] counts it.
fn finish_failed(
    job: &Job,
    kind: RecordKind,
    started: u64,
    data: &Value,
    error: RpcError,
) -> Result<Answer, RpcError> {
    if data.get("outcome") == Some(&json!("unknown")) {
        job.metrics.unknown_outcome();
    }
    let record = EffectRecord::finished(kind, started, data).map_err(journal_failed)?;
    Ok(Answer::OnceDurable {
        record,
        answer: Err(error),
    })
}

/// An environment operation's finished record and answer for a failure: the effect's failure
/// with `started` in the data (environment records are appended as `NewRecord`s).
fn environment_failure(
    started: u64,
    error: crate::effects::EffectError,
) -> (Value, Result<Answer, RpcError>) {
    let (mut data, error) = effect_failure(error);
    data["started"] = json!(started);
    (data, Err(error))
}

/// A tool call across the effect barrier. Once started, the answer is a ToolResult whose outcome
/// says how it ended; `tool_failed` only when it never started.
fn tool(job: &Job, effects: &Effects, input: ToolCallInput) -> Result<Answer, RpcError> {
    let spec = &job.spec;
    let name = input.name.as_str();
    let environment = input.environment.as_deref();
    let declared = spec
        .request
        .tools
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| {
            call_error(
                ErrorCode::InvalidInput,
                format!("no tool named {name:?} is declared"),
            )
        })?;
    let placement = match environment {
        Some(wanted) => declared
            .placements
            .iter()
            .find(|p| p.as_str() == wanted)
            .ok_or_else(|| {
                call_error(
                    ErrorCode::InvalidInput,
                    format!("tool {name:?} is not placed in environment {wanted:?}"),
                )
            })?,
        None => declared.placements.first().ok_or_else(|| {
            call_error(
                ErrorCode::InvalidInput,
                format!("tool {name:?} has no placement"),
            )
        })?,
    };
    let declaration = spec
        .request
        .environments
        .iter()
        .find(|e| &e.name == placement)
        .ok_or_else(|| {
            call_error(
                ErrorCode::InvalidInput,
                format!("no environment {placement:?}"),
            )
        })?;
    let driver = effects.driver(&declaration.driver).ok_or_else(|| {
        call_error(
            ErrorCode::ToolFailed,
            format!("no environment driver named {:?}", declaration.driver),
        )
    })?;
    let incarnation = current_incarnation(job, placement);
    let environment = EnvironmentSpec {
        name: declaration.name.clone(),
        driver: declaration.driver.clone(),
        configuration: declaration.configuration.clone(),
    };
    #[derive(Serialize)]
    struct Started<'a> {
        activation: u64,
        environment: &'a str,
        incarnation: u64,
        input: &'a Value,
        name: &'a str,
    }
    let data = Started {
        activation: job.sequence,
        environment: placement,
        incarnation,
        input: &input.input,
        name,
    };
    let record =
        EffectRecord::started(RecordKind::ToolCallStarted, &data).map_err(journal_failed)?;
    Ok(Answer::Start {
        record,
        effect: Effect::Tool {
            driver,
            environment,
            incarnation,
            input,
        },
    })
}

/// Calls the tool of a started tool call, and finishes it.
fn perform_tool(
    job: &Job,
    driver: &dyn EnvironmentDriver,
    environment: &EnvironmentSpec,
    incarnation: u64,
    input: ToolCallInput,
    started: u64,
) -> Result<Answer, RpcError> {
    let call = ToolCall {
        session_id: &job.session,
        sequence: started,
        environment,
        incarnation,
        tool: &input.name,
        input: &input.input,
        workspace_dir: &job.spec.workspace_dir,
    };
    let result = match driver.call_tool(&call, &job.cancel) {
        Ok(result) => result,
        Err(error) => {
            use crate::effects::EffectError;
            let (outcome, message) = match error {
                EffectError::Failed { message, .. } => {
                    // It never started: the finished record says so, and the callback fails.
                    let data =
                        json!({"outcome": "error", "code": "tool_failed", "message": message});
                    let error = call_error(ErrorCode::ToolFailed, message);
                    return finish_failed(job, RecordKind::ToolCallFinished, started, &data, error);
                }
                EffectError::Unknown { message } => (ToolOutcome::Unknown, message),
                EffectError::Cancelled { sent: true } => (
                    ToolOutcome::Unknown,
                    "cancelled after it started".to_owned(),
                ),
                EffectError::Cancelled { sent: false } => {
                    (ToolOutcome::Cancelled, "cancelled".to_owned())
                }
            };
            ToolResult {
                outcome,
                content: vec![crate::protocol::harness::Block::text(message)],
                is_error: true,
            }
        }
    };
    finish_effect(
        job,
        RecordKind::ToolCallFinished,
        started,
        result.outcome.as_str(),
        &result,
    )
}

/// The `data.code` of an error Brain built.
fn error_code(error: &RpcError) -> Option<ErrorCode> {
    error
        .data
        .as_ref()
        .and_then(|d| d.get("code"))
        .and_then(Value::as_str)
        .and_then(|c| c.parse().ok())
}

fn is_effect(call: &CallbackInput) -> bool {
    matches!(
        call,
        CallbackInput::Model(_)
            | CallbackInput::Tool(_)
            | CallbackInput::EnvironmentsSetup(_)
            | CallbackInput::EnvironmentsCall(_)
    )
}

impl Dispatcher {
    /// A request from a harness: `brain/call` is admitted or refused; anything else is unknown.
    pub(crate) fn on_harness_request(&mut self, key: WorkerKey, request: Request) {
        let Request {
            id,
            method: name,
            params,
        } = request;
        let call = if name == method::BRAIN_CALL {
            BrainCall::from_params(params)
        } else {
            let shown: String = name.chars().take(64).collect();
            Err(call_error(
                ErrorCode::UnknownMethod,
                format!("unknown method {shown:?}"),
            ))
        };
        self.on_brain_call(key, id, call);
    }

    /// A `brain/call` (or why the request is not one): admitted, or refused with its answer.
    pub(crate) fn on_brain_call(
        &mut self,
        key: WorkerKey,
        id: RequestId,
        call: Result<BrainCall, RpcError>,
    ) {
        if let Err(error) = call.and_then(|call| self.admit_callback(key, &id, call)) {
            let code = error_code(&error).map_or("error", ErrorCode::as_str);
            self.metrics.callback("refused", code);
            self.pool
                .answer(key, &id, jsonrpc::encode_error(&id, &error));
        }
    }

    fn admit_callback(
        &mut self,
        key: WorkerKey,
        id: &RequestId,
        params: BrainCall,
    ) -> Result<(), RpcError> {
        let not_active = || {
            call_error(
                ErrorCode::ActivationNotActive,
                "no activation with that session and sequence runs on this worker",
            )
        };
        let session = SessionId::parse(&params.session_id).map_err(|_| not_active())?;
        let state = self.sessions.get(&session).ok_or_else(not_active)?;
        if state.registration != key.registration || state.slot != key.slot {
            return Err(not_active());
        }
        let spec = state.spec.clone();
        let incarnations = state.incarnations.clone();
        let closed = state.last_run == Some((params.sequence, key));
        let Some(active) = state
            .active
            .as_ref()
            .filter(|a| a.sequence == params.sequence && a.is_running_on(key))
            .filter(|a| a.authority_open)
        else {
            if closed {
                return Err(call_error(
                    ErrorCode::ActivationClosed,
                    format!("activation {} no longer accepts callbacks", params.sequence),
                ));
            }
            return Err(not_active());
        };
        let call = params.input?;
        if active.cancel_requested && is_effect(&call) {
            let error = call_error(
                ErrorCode::Cancelled,
                "the activation was cancelled; no new effect starts",
            );
            self.record_fatal(
                &session,
                params.sequence,
                ErrorCode::Cancelled,
                &error.message,
            );
            return Err(error);
        }
        if active.outstanding >= MAX_OUTSTANDING_CALLBACKS {
            return Err(call_error(
                ErrorCode::Overloaded,
                format!("{MAX_OUTSTANDING_CALLBACKS} callbacks of this activation are unanswered"),
            ));
        }
        if let CallbackInput::KvGet(input) = &call
            && let Some(Ok(value)) = self.journal.kv_get_cached(&session, &input.key)
        {
            // Answered from memory here: no executor round trip. Anything else (a read that
            // needs the disk, an error to classify) goes the executor's way.
            self.metrics.callback(call.method().as_str(), "ok");
            let line = jsonrpc::encode_result(id, &kv_get_result(value));
            self.pool.answer(key, id, line);
            return Ok(());
        }
        let cancel = active.effects_cancel.clone();
        let answers = self.queues[key.registration][key.slot as usize].clone();
        if let Some(active) = self.active_mut(&session, params.sequence) {
            active.outstanding += 1;
        }
        self.executor.submit(
            Job {
                session,
                sequence: params.sequence,
                key,
                id: id.clone(),
                spec,
                incarnations,
                cancel,
                metrics: self.metrics.clone(),
                answers,
            },
            call,
        );
        Ok(())
    }

    /// A fatal callback error: it fixes the outcome (unless something did earlier); other than
    /// `cancelled`, it closes the activation's authority and starts the fatal grace.
    fn record_fatal(&mut self, session: &SessionId, sequence: u64, code: ErrorCode, message: &str) {
        let grace = self.options.cancel_grace;
        let Some(active) = self.active_mut(session, sequence) else {
            return;
        };
        active.fix(Fixed::failed(code.as_str(), message));
        if code == ErrorCode::Cancelled {
            return;
        }
        active.authority_open = false;
        if matches!(active.phase, Phase::Running { .. }) {
            self.timer.at(
                Instant::now() + grace,
                Deadline::FatalGrace {
                    session: session.clone(),
                    sequence,
                },
            );
        }
    }

    pub(crate) fn on_callback_done(&mut self, done: CallbackDone) {
        let CallbackDone {
            session,
            sequence,
            key,
            id,
            outcome,
            incarnation,
            method,
        } = done;
        let code = match &outcome {
            Ok(_) => "ok",
            Err(error) => error_code(error).map_or("error", ErrorCode::as_str),
        };
        self.metrics.callback(method, code);
        if let (Some((name, started)), Some(state)) = (incarnation, self.sessions.get_mut(&session))
        {
            state.incarnations.insert(name, started);
        }
        if let Some(active) = self.active_mut(&session, sequence) {
            active.outstanding = active.outstanding.saturating_sub(1);
        }
        if let Err(error) = outcome {
            let fatal = error
                .data
                .as_ref()
                .and_then(|d| d.get("code"))
                .and_then(Value::as_str)
                .and_then(|c| c.parse::<ErrorCode>().ok())
                .filter(|c| c.is_fatal());
            if let Some(code) = fatal {
                self.record_fatal(&session, sequence, code, &error.message);
            }
        }
        // The executor writes the answer once this report is sent.
        self.pool.answered(key, &id);
        self.try_finish(&session, sequence);
    }
}
