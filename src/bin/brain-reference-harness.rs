//! brain-reference-harness: a real tool-calling agent loop over brain/harness/v1, and the example
//! harness of [`brain::harness`].
//!
//! Each `run` (PROTOCOL.md §6):
//!
//! 1. parses its params as [`RunParams`] (anything else fails `invalid_input`) and reads the
//!    native state file `<state_dir>/reference-state.json` if it exists (afresh every run; the file
//!    itself stays open between a session's runs until Brain sends `close`);
//! 2. starts from the saved transcript (`input.transcript`), appends the user input (if any) as a
//!    user message and, when `input.events` is not empty, one more user message with a text block
//!    listing them, one `event <type>: <data as JSON>` line each;
//! 3. loops: calls `model` with `{messages: <transcript>, tools: <the session's tools as
//!    definitions>}` (no `system`: Brain applies the session's) and appends the assistant message.
//!    When that message holds `tool_use` blocks and the stop reason is `tool_use`, it calls `tool`
//!    for each, all at once (sent in order, at most 64 in flight), and appends one user message
//!    with their `tool_result` blocks in the blocks' order; a tool call that fails without being
//!    fatal (say an undeclared tool) becomes an error result the model reads. Otherwise the loop
//!    ends. At most 32 model calls (rounds): a 32nd answer that still asks for tools fails the run
//!    `harness_error` ("too many rounds");
//! 4. saves the whole transcript with `transcript.set`, then writes the native state file
//!    (`{"turns": <completed runs>, "last_sequence": <this run's sequence>}`, padded with spaces
//!    to 256 bytes and overwritten in place with `fdatasync`; the first one creates the file and
//!    fsyncs it and its directory), and answers
//!    `{"result": {"text": <the final assistant text>, "rounds": <model calls>}}`.
//!
//! The cancel token is checked before every callback: a cancelled run answers `cancelled` and
//! makes no further callback. A fatal callback error ends the run with its code, and so does a
//! failed `model` call (`outcome_unknown`, `model_failed`, …) or `transcript.set`. Nothing is saved
//! when a run fails: the transcript and the state file stay as the last completed run left them.
//!
//! Declares `transcript_import`: every turn starts from the transcript Brain hands it, so a new
//! session created `from` an interrupted one carries on from its transcript.
//!
//! Speaks brain/harness/v1 on stdin/stdout; logs to stderr (`RUST_LOG`, default `warn`).

use brain::harness::{Activation, CallError, Handler, HandlerError, PendingCall, serve};
use brain::protocol::harness::{
    Block, Capabilities, Event, Identity, InitializeParams, InitializeResult, Message,
    ModelCallResult, ModelResult, PROTOCOL, Role, RunInput, RunParams, SequenceResult, StopReason,
    ToolCallResult, ToolDefinition,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Mutex;

/// Most model calls in one run.
const MAX_ROUNDS: u64 = 32;

/// The native state file's name inside the session's `state_dir`.
const STATE_FILE: &str = "reference-state.json";

/// The state file's fixed size: a new state overwrites the old one without changing the file's
/// size or its blocks, so that its `fdatasync` has no size or allocation to write (the changed
/// mtime may still cost an inode write, as on ext4 without a journal: docs/BENCHMARKS.md).
const STATE_FILE_SIZE: usize = 256;

/// The reference harness. Holds no state in memory between runs: the transcript comes from Brain
/// and the rest lives in the state directory. It keeps each session's state file open between its
/// runs ([`OpenStateFiles`]), and reads it afresh on every run.
#[derive(Default)]
struct Reference {
    files: OpenStateFiles,
}

impl Handler for Reference {
    fn initialize(&self, params: &InitializeParams) -> Result<InitializeResult, HandlerError> {
        log::info!(
            "initializing worker {} of {}",
            params.worker,
            params.registration
        );
        Ok(InitializeResult {
            protocol: PROTOCOL.to_owned(),
            identity: Identity {
                name: "brain-reference-harness".to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            },
            state_version: "1".to_owned(),
            capabilities: Capabilities {
                transcript_import: true,
                ..Capabilities::default()
            },
            configuration_keys: None,
            required_model_metadata: Vec::new(),
        })
    }

    fn run(&self, activation: &Activation) -> Result<Option<Value>, HandlerError> {
        let mut params: RunParams = activation
            .params_as()
            .map_err(|error| HandlerError::new("invalid_input", format!("run params: {error}")))?;
        if params.state_dir.is_empty() {
            let message = "run params: state_dir is empty";
            return Err(HandlerError::new("invalid_input", message));
        }
        let state_path = Path::new(&params.state_dir).join(STATE_FILE);
        let mut file = match self.files.take(&params.session_id) {
            Some(file) => Some(file),
            None => StateFile::open(&state_path)?,
        };
        let state = match &mut file {
            Some(file) => file.load(&state_path)?,
            None => NativeState::default(),
        };

        let mut transcript = opening_transcript(&mut params.input);
        let tools: Vec<ToolDefinition> = params
            .input
            .tools
            .iter()
            .map(|tool| ToolDefinition {
                name: tool.name.clone(),
                description: tool.description.clone(),
                input_schema: tool.input_schema.clone(),
            })
            .collect();

        let mut rounds = 0;
        loop {
            rounds += 1;
            let result = model(activation, &transcript, &tools)?;
            transcript.push(result.message);
            let uses = transcript.last().map(tool_uses).unwrap_or_default();
            if uses.is_empty() || result.stop_reason != StopReason::ToolUse {
                break;
            }
            if rounds >= MAX_ROUNDS {
                return Err(HandlerError::harness(format!(
                    "too many rounds: the model still asks for tools after {MAX_ROUNDS} calls"
                )));
            }
            let results = tool_round(activation, &uses)?;
            transcript.push(Message {
                role: Role::User,
                content: results,
            });
        }
        // The model's last answer, which ended the loop.
        let final_text = transcript
            .last()
            .map(Message::text_content)
            .unwrap_or_default();

        checkpoint(activation)?;
        activation.call_typed::<_, SequenceResult>(
            "transcript.set",
            &TranscriptSetWire {
                messages: &transcript,
            },
        )?;
        let state = NativeState {
            turns: state.turns.saturating_add(1),
            last_sequence: Some(params.sequence),
        };
        let file = state.store(&state_path, file).map_err(|error| {
            HandlerError::harness(format!("writing {}: {error}", state_path.display()))
        })?;
        self.files.keep(&params.session_id, file);

        Ok(Some(json!({ "text": final_text, "rounds": rounds })))
    }

    fn close(&self, session_id: &str, _reason: &str) {
        self.files.forget(session_id);
    }
}

/// The transcript the first model call sees: the saved one, the user's input, the pending events.
/// Takes the transcript and the input out of `input` rather than copying them.
fn opening_transcript(input: &mut RunInput) -> Vec<Message> {
    let mut transcript = std::mem::take(&mut input.transcript);
    if let Some(user) = input.input.take() {
        transcript.push(Message {
            role: Role::User,
            content: user.content,
        });
    }
    if !input.events.is_empty() {
        transcript.push(Message::text(Role::User, events_summary(&input.events)));
    }
    transcript
}

/// One line per event: `event <type>: <data as JSON>`.
fn events_summary(events: &[Event]) -> String {
    events
        .iter()
        .map(|event| format!("event {}: {}", event.event_type, event.data))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `tool_use` blocks of a message, in order: (id, name, input).
fn tool_uses(message: &Message) -> Vec<(&str, &str, &Value)> {
    message
        .content
        .iter()
        .filter_map(|block| match block {
            Block::ToolUse { id, name, input } => Some((id.as_str(), name.as_str(), input)),
            _ => None,
        })
        .collect()
}

/// Fails `cancelled` when the activation has been cancelled: called before every callback.
fn checkpoint(activation: &Activation) -> Result<(), HandlerError> {
    if activation.is_cancelled() {
        Err(HandlerError::cancelled())
    } else {
        Ok(())
    }
}

/// One `model` call. Every error ends the run with its code.
fn model(
    activation: &Activation,
    transcript: &[Message],
    tools: &[ToolDefinition],
) -> Result<ModelResult, HandlerError> {
    checkpoint(activation)?;
    // No `system`: Brain applies the session's.
    let request = ModelRequestWire {
        messages: transcript,
        tools,
    };
    let answer: ModelCallResult = activation.call_typed("model", &request)?;
    Ok(answer.result)
}

/// The most `tool` calls a round has in flight at once: PROTOCOL.md's limit on an activation's
/// unanswered callbacks (more would fail `overloaded`).
const MAX_TOOLS_IN_FLIGHT: usize = 64;

/// One round's `tool` calls, all in flight at once (the `tool_use` blocks of one answer are
/// independent of each other; past [`MAX_TOOLS_IN_FLIGHT`], in groups of that many), as
/// `tool_result` blocks in the order of the blocks. The cancel token is checked before each call is
/// sent. Every call sent is waited for; then the first of them, in block order, that failed
/// fatally (or found the run cancelled) ends the run with its code, and no later call is sent. Any
/// other error becomes an error result for the model to read.
fn tool_round(
    activation: &Activation,
    uses: &[(&str, &str, &Value)],
) -> Result<Vec<Block>, HandlerError> {
    let mut results = Vec::with_capacity(uses.len());
    for group in uses.chunks(MAX_TOOLS_IN_FLIGHT) {
        // The calls sent, in block order, and why sending stopped early (after all of them).
        let mut sent = Vec::with_capacity(group.len());
        let mut stopped = None;
        for &(_, name, input) in group {
            if let Err(cancelled) = checkpoint(activation) {
                stopped = Some(cancelled);
                break;
            }
            let call = ToolCallWire { name, input };
            match activation.start_call_typed::<_, ToolCallResult>("tool", &call) {
                Err(error) if error.fatal => {
                    stopped = Some(error.into());
                    break;
                }
                started => sent.push(started),
            }
        }
        let mut ended = None;
        for (&(tool_use_id, name, _), call) in group.iter().zip(sent) {
            let (content, is_error) = match call.and_then(PendingCall::wait) {
                Ok(answer) => (answer.result.content, answer.result.is_error),
                Err(error) if error.fatal => {
                    ended.get_or_insert(HandlerError::from(error));
                    continue;
                }
                Err(CallError { code, message, .. }) => {
                    log::info!("tool {name} failed ({code}): {message}");
                    let text = format!("the tool call failed ({code}): {message}");
                    (vec![Block::text(text)], true)
                }
            };
            results.push(Block::ToolResult {
                tool_use_id: tool_use_id.to_owned(),
                content,
                is_error,
            });
        }
        if let Some(error) = ended.or(stopped) {
            return Err(error);
        }
    }
    Ok(results)
}

/// A `model` input (`ModelRequest`'s wire form) that borrows the transcript instead of
/// copying it into a request.
#[derive(Serialize)]
struct ModelRequestWire<'a> {
    messages: &'a [Message],
    tools: &'a [ToolDefinition],
}

/// A `tool` input (`ToolCallInput`'s wire form, no environment), borrowed.
#[derive(Serialize)]
struct ToolCallWire<'a> {
    name: &'a str,
    input: &'a Value,
}

/// A `transcript.set` input (`TranscriptSetInput`'s wire form), borrowed.
#[derive(Serialize)]
struct TranscriptSetWire<'a> {
    messages: &'a [Message],
}

/// The harness's own state in the session's `state_dir`: how many runs completed, and the sequence
/// of the last one.
#[derive(Debug, Default, Serialize, Deserialize)]
struct NativeState {
    turns: u64,
    last_sequence: Option<u64>,
}

impl NativeState {
    /// Writes the state durably to `path`, so that it is on disk before `run` is answered (Brain
    /// removes the activation marker only after that answer), and gives back the file open for the
    /// session's next run.
    ///
    /// The file always holds [`STATE_FILE_SIZE`] bytes: the JSON padded with spaces (trailing
    /// whitespace is valid JSON). Once it exists, a new state overwrites it in place with one
    /// write and one `fdatasync`. The first write, or a file of another size, writes the file
    /// where it is (creating it) and syncs it and its directory, so that its name survives a
    /// crash too.
    ///
    /// No write needs a temporary file and a rename: a crash or an error halfway through a write
    /// ends the run unanswered, and only a completed activation clears the session's marker
    /// (PROTOCOL.md, *The marker*), so the session never runs again and no later run reads a
    /// half-written file. A session created `from` it has a state directory of its own. (A
    /// temporary file and a rename would cost a second directory write on every new session.)
    fn store(&self, path: &Path, file: Option<StateFile>) -> io::Result<StateFile> {
        let mut bytes = serde_json::to_vec(self).map_err(io::Error::other)?;
        if bytes.len() >= STATE_FILE_SIZE {
            return Err(io::Error::other(format!(
                "the state is {} bytes; the state file holds at most {}",
                bytes.len(),
                STATE_FILE_SIZE - 1
            )));
        }
        bytes.resize(STATE_FILE_SIZE - 1, b' ');
        bytes.push(b'\n');
        let file = match file {
            Some(file) if file.in_place => {
                file.file.write_all_at(&bytes, 0)?;
                file.file.sync_data()?;
                return Ok(file);
            }
            Some(other_size) => {
                other_size.file.set_len(STATE_FILE_SIZE as u64)?;
                other_size.file
            }
            None => create(path)?,
        };
        file.write_all_at(&bytes, 0)?;
        file.sync_all()?;
        File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()?;
        Ok(StateFile {
            file,
            in_place: true,
        })
    }
}

/// Creates the state file at `path` (or opens the one there), for reading and writing. Brain
/// creates the state directory with the session, so the directory is made only when it is missing.
fn create(path: &Path) -> io::Result<File> {
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
    };
    match open() {
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
            open()
        }
        opened => opened,
    }
}

/// A session's state file, open for reading and writing.
struct StateFile {
    file: File,
    /// The file holds [`STATE_FILE_SIZE`] bytes, so a new state overwrites it in place.
    in_place: bool,
}

impl StateFile {
    /// Opens the state file at `path`; `None` when there is none yet. A file that cannot be opened
    /// fails the run rather than silently starting over.
    fn open(path: &Path) -> Result<Option<StateFile>, HandlerError> {
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .and_then(|file| {
                let in_place = file.metadata()?.len() == STATE_FILE_SIZE as u64;
                Ok(StateFile { file, in_place })
            });
        match opened {
            Ok(file) => Ok(Some(file)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(HandlerError::harness(format!(
                "opening {}: {error}",
                path.display()
            ))),
        }
    }

    /// Reads the state the file holds now (`path` names it in errors). A file that cannot be read
    /// or parsed fails the run.
    fn load(&mut self, path: &Path) -> Result<NativeState, HandlerError> {
        let read_error = |error: io::Error| {
            HandlerError::harness(format!("reading {}: {error}", path.display()))
        };
        let bytes = if self.in_place {
            let mut bytes = [0; STATE_FILE_SIZE];
            self.file.read_exact_at(&mut bytes, 0).map_err(read_error)?;
            bytes.to_vec()
        } else {
            let mut bytes = Vec::new();
            self.file.read_to_end(&mut bytes).map_err(read_error)?;
            bytes
        };
        serde_json::from_slice(&bytes).map_err(|error| {
            HandlerError::harness(format!("{} is malformed: {error}", path.display()))
        })
    }
}

/// The most state files kept open between runs; the sessions beyond them open theirs on every
/// run. Far below the usual soft limit of 1,024 descriptors.
const MAX_OPEN_STATE_FILES: usize = 256;

/// The state files of this worker's sessions between their runs, by session id, so that a turn
/// does not open (and look up the path of) its state file twice. A run takes its session's file
/// (Brain runs one activation of a session at a time), a completed run gives it back, and `close`
/// drops it: a session keeps its worker for life, and a passivated or deleted one is closed first.
/// A run that fails gives nothing back, so the next one opens the file afresh.
#[derive(Default)]
struct OpenStateFiles {
    files: Mutex<HashMap<String, StateFile>>,
}

impl OpenStateFiles {
    fn take(&self, session_id: &str) -> Option<StateFile> {
        self.lock().remove(session_id)
    }

    fn keep(&self, session_id: &str, file: StateFile) {
        let mut files = self.lock();
        if files.len() < MAX_OPEN_STATE_FILES {
            files.insert(session_id.to_owned(), file);
        }
    }

    fn forget(&self, session_id: &str) {
        self.lock().remove(session_id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, StateFile>> {
        // The map stays whole if a holder panicked: every operation on it is a single call.
        self.files
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .target(env_logger::Target::Stderr)
        .init();
    match serve(&Reference::default()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            log::error!("reading from Brain failed: {error}");
            ExitCode::FAILURE
        }
    }
}
