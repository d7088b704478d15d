//! The harness SDK and the two harness binaries, over real pipes.
//!
//! The binaries run as real processes (each in its own process group, killed with the group when
//! the test ends, also on panic); the SDK's serve loop runs in-process over OS pipes where a test
//! needs a handler of its own. Every read has a deadline; nothing sleeps to synchronise.

use brain::harness::{Activation, CallError, Connection, Handler, HandlerError, serve_connection};
use brain::protocol::harness::{
    Capabilities, Identity, InitializeParams, InitializeResult, PROTOCOL,
};
use brain::protocol::jsonrpc::{self, Message, RequestId, Violation};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, PipeWriter, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// The longest any single expected event may take.
const DEADLINE: Duration = Duration::from_secs(20);

const REFERENCE: &str = env!("CARGO_BIN_EXE_brain-reference-harness");
const FAULT: &str = env!("CARGO_BIN_EXE_brain-fault-harness");

// ---------------------------------------------------------------------------------------------
// Helpers

/// The lines of a stream, read on a thread. The channel disconnects at end of stream.
struct Lines {
    rx: Receiver<Vec<u8>>,
}

impl Lines {
    /// `capacity: None` is unbounded (stderr, which must never block the child).
    fn spawn(reader: impl Read + Send + 'static, capacity: Option<usize>) -> Lines {
        let (tx, rx) = match capacity {
            Some(capacity) => crossbeam_channel::bounded(capacity),
            None => crossbeam_channel::unbounded(),
        };
        thread::spawn(move || {
            let mut reader = BufReader::new(reader);
            loop {
                let mut line = Vec::new();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        if line.last() == Some(&b'\n') {
                            line.pop();
                        }
                        if tx.send(line).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Lines { rx }
    }

    /// The next line; panics at end of stream or after the deadline.
    fn next(&self) -> Vec<u8> {
        match self.rx.recv_timeout(DEADLINE) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => panic!("no line within {DEADLINE:?}"),
            Err(RecvTimeoutError::Disconnected) => panic!("the stream ended"),
        }
    }

    /// The next line, parsed as JSON.
    fn json(&self) -> Value {
        let line = self.next();
        serde_json::from_slice(&line)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&line)))
    }

    /// The response with `id`, skipping notifications (e.g. `--flood` noise) on the way.
    fn response(&self, id: Value) -> Value {
        let begin = Instant::now();
        loop {
            assert!(
                begin.elapsed() < DEADLINE,
                "no response {id} within {DEADLINE:?}"
            );
            let message = self.json();
            if message.get("method").is_none() && message["id"] == id {
                return message;
            }
            assert!(
                message.get("id").is_none(),
                "unexpected message while waiting for {id}: {message}"
            );
        }
    }

    /// Waits for the end of the stream, returning the lines seen before it.
    fn until_eof(&self) -> Vec<Vec<u8>> {
        let mut lines = Vec::new();
        loop {
            match self.rx.recv_timeout(DEADLINE) {
                Ok(line) => lines.push(line),
                Err(RecvTimeoutError::Disconnected) => return lines,
                Err(RecvTimeoutError::Timeout) => panic!("the stream did not end"),
            }
        }
    }

    /// Waits for a line containing `needle`.
    fn find(&self, needle: &str) -> String {
        loop {
            let line = String::from_utf8_lossy(&self.next()).into_owned();
            if line.contains(needle) {
                return line;
            }
        }
    }
}

/// A harness process in its own process group; the whole group is killed on drop, unless the
/// test reaped the process (its pid, and so its group id, could have been reused since).
struct Proc {
    child: Child,
    reaped: bool,
    stdin: Option<ChildStdin>,
    out: Lines,
    err: Lines,
}

impl Proc {
    fn spawn(program: &str, args: &[&str]) -> Proc {
        Proc::spawn_with_env(program, args, &[])
    }

    fn spawn_with_env(program: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut child = Command::new(program)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("spawn the harness");
        let out = Lines::spawn(child.stdout.take().unwrap(), Some(256));
        let err = Lines::spawn(child.stderr.take().unwrap(), None);
        Proc {
            stdin: child.stdin.take(),
            child,
            reaped: false,
            out,
            err,
        }
    }

    fn send(&mut self, message: &Value) {
        let mut line = serde_json::to_vec(message).unwrap();
        line.push(b'\n');
        let stdin = self.stdin.as_mut().expect("stdin is open");
        stdin.write_all(&line).unwrap();
        stdin.flush().unwrap();
    }

    fn request(&mut self, id: i64, method: &str, params: Value) {
        self.send(&json!({"jsonrpc":"2.0","id":id,"method":method,"params":params}));
    }

    /// Sends `initialize` as id 1 and returns the answer.
    fn initialize(&mut self) -> Value {
        self.request(1, "initialize", initialize_params());
        self.out.response(json!(1))
    }

    /// The next message, which must be a `brain/call` for `method`.
    fn expect_call(&self, method: &str) -> Value {
        let message = self.out.json();
        assert_eq!(
            message["method"], "brain/call",
            "expected a callback: {message}"
        );
        assert_eq!(message["params"]["method"], method, "{message}");
        message
    }

    /// Answers the `brain/call` request `call` with `result`.
    fn answer(&mut self, call: &Value, result: Value) {
        self.send(&json!({"jsonrpc": "2.0", "id": call["id"], "result": result}));
    }

    /// Answers the `brain/call` request `call` with Brain's error `code`.
    fn answer_error(&mut self, call: &Value, code: &str, fatal: bool) {
        self.send(&json!({"jsonrpc": "2.0", "id": call["id"], "error": {
            "code": -32000, "message": code, "data": {"code": code, "fatal": fatal}}}));
    }

    fn close_stdin(&mut self) {
        self.stdin = None;
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    /// Waits for the process to exit. Call it only once its stdout has ended.
    fn wait(&mut self) -> ExitStatus {
        let status = self.child.wait().unwrap();
        self.reaped = true;
        status
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = killpg(Pid::from_raw(self.pid()), Signal::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

fn initialize_params() -> Value {
    json!({
        "protocol": PROTOCOL, "brain": {"name": "brain", "version": "0.1.0"},
        "registration": "test", "worker": 0, "configuration": {},
        "state_root": "/tmp/brain-test", "max_concurrency": 8, "max_line_bytes": 16_777_216
    })
}

fn run_params(session_id: &str, sequence: u64, input: Value) -> Value {
    json!({"session_id": session_id, "sequence": sequence, "input": {"input": input}})
}

/// A path in the temp directory that no other test (or run) uses.
fn temp_path(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!(
        "brain-harness-sdk-{}-{nanos}-{name}",
        std::process::id()
    ))
}

/// A handler whose `run` is a closure, for in-process tests.
struct FnHandler<F>(F);

impl<F> Handler for FnHandler<F>
where
    F: Fn(&Activation) -> Result<Option<Value>, HandlerError> + Sync,
{
    fn initialize(&self, _: &InitializeParams) -> Result<InitializeResult, HandlerError> {
        Ok(InitializeResult {
            protocol: PROTOCOL.to_owned(),
            identity: Identity {
                name: "in-process".into(),
                version: "0".into(),
            },
            state_version: "1".into(),
            capabilities: Capabilities::default(),
            configuration_keys: None,
            required_model_metadata: Vec::new(),
        })
    }

    fn run(&self, activation: &Activation) -> Result<Option<Value>, HandlerError> {
        (self.0)(activation)
    }
}

/// The SDK's serve loop on a thread, over two OS pipes; the test plays Brain.
struct InProcess {
    to_harness: Option<PipeWriter>,
    out: Lines,
    served: Receiver<std::io::Result<()>>,
}

impl InProcess {
    fn start<F>(run: F) -> InProcess
    where
        F: Fn(&Activation) -> Result<Option<Value>, HandlerError> + Sync + Send + 'static,
    {
        let (harness_reads, to_harness) = std::io::pipe().unwrap();
        let (from_harness, harness_writes) = std::io::pipe().unwrap();
        let (connection, threads) =
            Connection::new(harness_reads, harness_writes, 1 << 20).unwrap();
        let (served_tx, served) = crossbeam_channel::bounded(1);
        thread::spawn(move || {
            serve_connection(&connection, &FnHandler(run));
            connection.close();
            drop(connection);
            let _ = served_tx.send(threads.join());
        });
        InProcess {
            to_harness: Some(to_harness),
            out: Lines::spawn(from_harness, Some(256)),
            served,
        }
    }

    fn send(&mut self, message: &Value) {
        let mut line = serde_json::to_vec(message).unwrap();
        line.push(b'\n');
        let pipe = self.to_harness.as_mut().expect("input is open");
        pipe.write_all(&line).unwrap();
    }

    fn request(&mut self, id: i64, method: &str, params: Value) {
        self.send(&json!({"jsonrpc":"2.0","id":id,"method":method,"params":params}));
    }

    /// Closes the harness's input and waits for the serve loop to end cleanly.
    fn finish(mut self) -> Vec<Vec<u8>> {
        self.to_harness = None;
        let rest = self.out.until_eof();
        let served = self
            .served
            .recv_timeout(DEADLINE)
            .expect("the serve loop ended");
        served.expect("the reader ended cleanly");
        rest
    }
}

fn error_code(answer: &Value) -> &str {
    answer["error"]["data"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error answer with data.code: {answer}"))
}

// ---------------------------------------------------------------------------------------------
// The reference harness

#[test]
fn reference_harness_answers_initialize() {
    let mut harness = Proc::spawn(REFERENCE, &[]);
    let answer = harness.initialize();
    assert_eq!(answer["jsonrpc"], "2.0");
    let result = &answer["result"];
    assert_eq!(result["protocol"], PROTOCOL);
    assert_eq!(result["identity"]["name"], "brain-reference-harness");
    assert_eq!(result["identity"]["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(result["state_version"], "1");
    assert_eq!(result["capabilities"]["transcript_import"], true);
    let typed: InitializeResult = serde_json::from_value(result.clone()).unwrap();
    assert!(typed.capabilities.transcript_import);
}

/// Full `run` params for the reference harness; `input` holds the RunInput members beyond
/// `runtime`, which is filled in.
fn reference_run(session_id: &str, sequence: u64, state_dir: &Path, input: Value) -> Value {
    let mut input = input;
    input["runtime"] = json!({"logical_time_ms": sequence, "deterministic_seed": "0".repeat(64)});
    json!({
        "session_id": session_id, "sequence": sequence,
        "state_dir": state_dir.to_str().expect("a UTF-8 temp path"),
        "model": {"provider": "scripted", "name": "scripted"},
        "input": input
    })
}

/// A reference harness, initialized and running activation 2 of `session` (the input "go") in
/// `state_dir`, and its first `model` call.
fn reference_going(session: &str, state_dir: &Path) -> (Proc, Value) {
    let mut harness = Proc::spawn(REFERENCE, &[]);
    harness.initialize();
    let input = json!({"input": {"content": [{"type": "text", "text": "go"}]}});
    harness.request(2, "run", reference_run(session, 2, state_dir, input));
    let call = harness.expect_call("model");
    (harness, call)
}

/// Closes the harness's input; it must write nothing more and exit 0.
fn exits_cleanly(mut harness: Proc) {
    harness.close_stdin();
    assert!(harness.out.until_eof().is_empty());
    assert!(harness.wait().success());
}

fn text_message(role: &str, text: &str) -> Value {
    json!({"role": role, "content": [{"type": "text", "text": text}]})
}

/// A `model` callback answer: the call's sequence and a ModelResult.
fn model_answer(sequence: u64, content: Value, stop_reason: &str) -> Value {
    json!({"sequence": sequence, "result": {
        "message": {"role": "assistant", "content": content},
        "stop_reason": stop_reason, "usage": {}
    }})
}

fn read_state(state_dir: &Path) -> Value {
    let bytes = std::fs::read(state_dir.join("reference-state.json")).expect("the state file");
    serde_json::from_slice(&bytes).expect("the state file is JSON")
}

/// The state file's inode number and size.
fn state_file_identity(state_dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let metadata =
        std::fs::metadata(state_dir.join("reference-state.json")).expect("the state file");
    (metadata.ino(), metadata.len())
}

/// Removes a temp directory when the test passes; keeps it, and names it, when the test fails.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept the failed test's directory {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn reference_harness_runs_a_tool_calling_loop_and_keeps_native_state() {
    let root = TempDir(temp_path("reference-state"));
    let state_dir = root.0.join("ses_r");
    let mut harness = Proc::spawn(REFERENCE, &[]);
    harness.initialize();

    let user = text_message("user", "list the files");
    let tools = json!([{"name": "bash", "description": "Run a command",
        "input_schema": {"type": "object"},
        "placements": [{"environment": "workspace", "sequence": 3}]}]);
    let events = json!([
        {"sequence": 4, "type": "ping", "recorded_at_ms": 1, "data": {"n": 1}},
        {"sequence": 5, "type": "note", "recorded_at_ms": 2, "data": "hi"}
    ]);
    let params = reference_run(
        "ses_r",
        7,
        &state_dir,
        json!({"input": {"content": user["content"]}, "transcript": [], "tools": tools,
               "events": events, "system": "be terse", "configuration": {}}),
    );
    harness.request(2, "run", params);

    // Round 1: the model sees the input and the events, and the tools without their placements.
    let call = harness.expect_call("model");
    assert_eq!(call["params"]["session_id"], "ses_r");
    assert_eq!(call["params"]["sequence"], 7);
    let events_text = "event ping: {\"n\":1}\nevent note: \"hi\"";
    let opening = vec![user.clone(), text_message("user", events_text)];
    assert_eq!(
        call["params"]["input"],
        json!({"messages": opening, "tools": [{"name": "bash", "description": "Run a command",
            "input_schema": {"type": "object"}}]}),
        "no system: Brain applies the session's"
    );
    let asks = json!([{"type": "text", "text": "let me look"},
        {"type": "tool_use", "id": "tu1", "name": "bash", "input": {"command": "ls"}}]);
    harness.answer(&call, model_answer(20, asks.clone(), "tool_use"));

    let call = harness.expect_call("tool");
    assert_eq!(
        call["params"]["input"],
        json!({"name": "bash", "input": {"command": "ls"}})
    );
    let listing = json!([{"type": "text", "text": "a.txt"}]);
    harness.answer(
        &call,
        json!({"sequence": 21, "result": {"outcome": "ok", "content": listing, "is_error": false}}),
    );

    // Round 2: the tool's result is one user message; the model ends its turn.
    let mut expected: Vec<Value> = opening.clone();
    expected.push(json!({"role": "assistant", "content": asks}));
    expected.push(json!({"role": "user", "content": [{"type": "tool_result",
        "tool_use_id": "tu1", "content": listing, "is_error": false}]}));
    let call = harness.expect_call("model");
    assert_eq!(call["params"]["input"]["messages"], json!(expected));
    let done = json!([{"type": "text", "text": "one file: "}, {"type": "text", "text": "a.txt"}]);
    harness.answer(&call, model_answer(22, done.clone(), "end_turn"));

    expected.push(json!({"role": "assistant", "content": done}));
    let call = harness.expect_call("transcript.set");
    assert_eq!(call["params"]["input"], json!({"messages": expected}));
    harness.answer(&call, json!({"sequence": 23}));

    let answer = harness.out.json();
    assert_eq!(answer["id"], 2, "the run answer follows: {answer}");
    assert_eq!(
        answer["result"],
        json!({"result": {"text": "one file: a.txt", "rounds": 2}})
    );
    assert_eq!(
        read_state(&state_dir),
        json!({"turns": 1, "last_sequence": 7})
    );
    let first_file = state_file_identity(&state_dir);
    assert_eq!(first_file.1, 256, "the state file is padded to 256 bytes");

    // A second turn continues the saved transcript; the state file counts it.
    let params = reference_run(
        "ses_r",
        9,
        &state_dir,
        json!({"input": {"content": [{"type": "text", "text": "thanks"}]},
               "transcript": expected}),
    );
    harness.request(3, "run", params);
    let call = harness.expect_call("model");
    let mut second = expected.clone();
    second.push(text_message("user", "thanks"));
    assert_eq!(
        call["params"]["input"],
        json!({"messages": second, "tools": []})
    );
    let welcome = json!([{"type": "text", "text": "welcome"}]);
    harness.answer(&call, model_answer(30, welcome.clone(), "end_turn"));
    second.push(json!({"role": "assistant", "content": welcome}));
    let call = harness.expect_call("transcript.set");
    assert_eq!(call["params"]["input"]["messages"], json!(second));
    assert_eq!(call["params"]["sequence"], 9);
    harness.answer(&call, json!({"sequence": 31}));
    assert_eq!(
        harness.out.response(json!(3))["result"],
        json!({"result": {"text": "welcome", "rounds": 1}})
    );
    assert_eq!(
        read_state(&state_dir),
        json!({"turns": 2, "last_sequence": 9})
    );
    assert_eq!(
        state_file_identity(&state_dir),
        first_file,
        "the second state is written in place: same inode, same size"
    );
    let names: Vec<_> = std::fs::read_dir(&state_dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert_eq!(names, ["reference-state.json"], "no temporary file is left");

    exits_cleanly(harness);
}

/// One text turn of the reference harness: `run`, the model's `reply`, `transcript.set`, the answer.
fn reference_text_turn(
    harness: &mut Proc,
    id: i64,
    session: &str,
    sequence: u64,
    state_dir: &Path,
) {
    let params = reference_run(
        session,
        sequence,
        state_dir,
        json!({"input": {"content": [{"type": "text", "text": "hi"}]}}),
    );
    harness.request(id, "run", params);
    let call = harness.expect_call("model");
    let reply = json!([{"type": "text", "text": "hello"}]);
    harness.answer(&call, model_answer(sequence + 1, reply, "end_turn"));
    let call = harness.expect_call("transcript.set");
    harness.answer(&call, json!({"sequence": sequence + 2}));
    let answer = harness.out.response(json!(id));
    assert!(
        answer.get("result").is_some(),
        "the turn completes: {answer}"
    );
}

#[test]
fn reference_harness_reads_its_state_afresh_and_reopens_it_after_close() {
    let root = TempDir(temp_path("reference-reopen"));
    let state_dir = root.0.join("ses_o");
    let mut harness = Proc::spawn(REFERENCE, &[]);
    harness.initialize();
    reference_text_turn(&mut harness, 2, "ses_o", 3, &state_dir);
    assert_eq!(
        read_state(&state_dir),
        json!({"turns": 1, "last_sequence": 3})
    );

    // Overwritten in place between runs, the state the next run reads is the file's.
    let path = state_dir.join("reference-state.json");
    let mut in_place = br#"{"turns":10,"last_sequence":3}"#.to_vec();
    in_place.resize(256, b' ');
    std::fs::write(&path, &in_place).expect("overwrite the state file");
    reference_text_turn(&mut harness, 3, "ses_o", 6, &state_dir);
    assert_eq!(
        read_state(&state_dir),
        json!({"turns": 11, "last_sequence": 6})
    );

    // Replaced by another file (another inode, another size) while the session is closed, the
    // state is read from the new file, and the next write makes it a full-size file again.
    harness.request(
        4,
        "close",
        json!({"session_id": "ses_o", "reason": "passivated"}),
    );
    assert_eq!(harness.out.response(json!(4))["result"], json!({}));
    std::fs::remove_file(&path).expect("remove the state file");
    let mut longer = br#"{"turns":40,"last_sequence":6}"#.to_vec();
    longer.resize(400, b' ');
    std::fs::write(&path, &longer).expect("a new state file");
    let replaced = state_file_identity(&state_dir);
    reference_text_turn(&mut harness, 5, "ses_o", 9, &state_dir);
    assert_eq!(
        read_state(&state_dir),
        json!({"turns": 41, "last_sequence": 9})
    );
    let rewritten = state_file_identity(&state_dir);
    assert_eq!(
        rewritten.1, 256,
        "written back at full size, the rest cut off"
    );
    assert_eq!(rewritten.0, replaced.0, "rewritten where it is");

    exits_cleanly(harness);
}

#[test]
fn reference_harness_has_a_rounds_tool_calls_in_flight_at_once_and_keeps_their_order() {
    let root = TempDir(temp_path("reference-parallel"));
    let (mut harness, call) = reference_going("ses_p", &root.0);
    let asks = json!([
        {"type": "tool_use", "id": "t1", "name": "a", "input": {"n": 1}},
        {"type": "tool_use", "id": "t2", "name": "b", "input": {"n": 2}},
        {"type": "tool_use", "id": "t3", "name": "c", "input": {"n": 3}}
    ]);
    harness.answer(&call, model_answer(10, asks, "tool_use"));

    // All three are sent before any is answered, in the blocks' order.
    let calls: Vec<Value> = (0..3).map(|_| harness.expect_call("tool")).collect();
    let names: Vec<&Value> = calls
        .iter()
        .map(|call| &call["params"]["input"]["name"])
        .collect();
    assert_eq!(names, ["a", "b", "c"]);
    // Answered last first, the middle one with an error that is not fatal.
    let ok = |text: &str| {
        json!({"outcome": "ok", "content": [{"type": "text", "text": text}],
        "is_error": false})
    };
    harness.answer(&calls[2], json!({"sequence": 13, "result": ok("three")}));
    harness.answer_error(&calls[1], "invalid_input", false);
    harness.answer(&calls[0], json!({"sequence": 11, "result": ok("one")}));

    let call = harness.expect_call("model");
    let results = &call["params"]["input"]["messages"][2];
    assert_eq!(results["role"], "user");
    let ids: Vec<&Value> = results["content"]
        .as_array()
        .expect("tool results")
        .iter()
        .map(|block| &block["tool_use_id"])
        .collect();
    assert_eq!(ids, ["t1", "t2", "t3"], "the blocks' order: {results}");
    assert_eq!(results["content"][0]["content"][0]["text"], "one");
    assert_eq!(results["content"][1]["is_error"], true);
    let failed = results["content"][1]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(failed.contains("invalid_input"), "{failed}");
    assert_eq!(results["content"][2]["content"][0]["text"], "three");

    // A fatal error ends the run with its code, once every call of the round is answered.
    let asks = json!([
        {"type": "tool_use", "id": "t4", "name": "a", "input": {}},
        {"type": "tool_use", "id": "t5", "name": "b", "input": {}}
    ]);
    harness.answer(&call, model_answer(20, asks, "tool_use"));
    let first = harness.expect_call("tool");
    let second = harness.expect_call("tool");
    harness.answer_error(&first, "activation_closed", true);
    harness.answer(&second, json!({"sequence": 22, "result": ok("late")}));
    let answer = harness.out.json();
    assert_eq!(answer["id"], 2, "no further callback: {answer}");
    assert_eq!(error_code(&answer), "activation_closed");
    assert!(
        !root.0.join("reference-state.json").exists(),
        "a failed run saves nothing"
    );

    exits_cleanly(harness);
}

#[test]
fn reference_harness_keeps_at_most_64_tool_calls_in_flight() {
    let root = TempDir(temp_path("reference-in-flight"));
    let (mut harness, call) = reference_going("ses_w", &root.0);
    let asks: Vec<Value> = (0..65)
        .map(|n| json!({"type": "tool_use", "id": format!("t{n}"), "name": "a", "input": {"n": n}}))
        .collect();
    harness.answer(&call, model_answer(10, json!(asks), "tool_use"));

    let first: Vec<Value> = (0..64).map(|_| harness.expect_call("tool")).collect();
    // A negative check needs a bound: the 65th waits for the first 64's answers.
    assert_eq!(
        harness.out.rx.recv_timeout(Duration::from_millis(300)),
        Err(RecvTimeoutError::Timeout)
    );
    let ok = json!({"outcome": "ok", "content": [], "is_error": false});
    for call in first.iter().rev() {
        harness.answer(call, json!({"sequence": 11, "result": ok}));
    }
    let last = harness.expect_call("tool");
    assert_eq!(last["params"]["input"]["input"], json!({"n": 64}));
    harness.answer(&last, json!({"sequence": 12, "result": ok}));

    let call = harness.expect_call("model");
    let ids: Vec<String> = call["params"]["input"]["messages"][2]["content"]
        .as_array()
        .expect("tool results")
        .iter()
        .map(|block| block["tool_use_id"].as_str().unwrap().to_owned())
        .collect();
    let expected: Vec<String> = (0..65).map(|n| format!("t{n}")).collect();
    assert_eq!(ids, expected);
    harness.answer(&call, model_answer(13, json!([]), "end_turn"));
    let call = harness.expect_call("transcript.set");
    harness.answer(&call, json!({"sequence": 14}));
    assert!(harness.out.response(json!(2)).get("result").is_some());

    exits_cleanly(harness);
}

#[test]
fn reference_harness_cancel_during_the_loop_answers_cancelled() {
    let root = TempDir(temp_path("reference-cancel"));
    let mut harness = Proc::spawn(REFERENCE, &[]);
    harness.initialize();
    let tools = json!([{"name": "bash", "description": "", "input_schema": {}}]);
    let params = reference_run(
        "ses_k",
        4,
        &root.0,
        json!({"input": {"content": [{"type": "text", "text": "go"}]}, "tools": tools}),
    );
    harness.request(2, "run", params);
    let call = harness.expect_call("model");
    harness.request(3, "cancel", json!({"session_id": "ses_k", "sequence": 4}));
    let asks = json!([{"type": "tool_use", "id": "t", "name": "bash", "input": {}}]);
    harness.answer(&call, model_answer(10, asks, "tool_use"));

    // The harness either sees its token cancelled before the tool call, or makes the call, which
    // Brain fails `cancelled` (fatal) after a cancel. Either way: no further callback, `cancelled`.
    let mut cancel_answered = false;
    let run = loop {
        let message = harness.out.json();
        match (&message["id"], message["method"].as_str()) {
            (_, Some("brain/call")) => {
                assert_eq!(message["params"]["method"], "tool", "{message}");
                harness.answer_error(&message, "cancelled", true);
            }
            (id, None) if *id == json!(3) => {
                assert_eq!(message["result"], json!({}));
                cancel_answered = true;
            }
            (id, None) if *id == json!(2) => break message,
            _ => panic!("unexpected message: {message}"),
        }
    };
    assert_eq!(error_code(&run), "cancelled");
    if !cancel_answered {
        assert_eq!(harness.out.response(json!(3))["result"], json!({}));
    }
    assert!(
        !root.0.join("reference-state.json").exists(),
        "a cancelled run saves nothing"
    );
}

#[test]
fn reference_harness_feeds_tool_errors_back_and_fails_on_model_errors() {
    let root = TempDir(temp_path("reference-errors"));
    let (mut harness, call) = reference_going("ses_e", &root.0);
    let asks = json!([{"type": "tool_use", "id": "t9", "name": "nope", "input": {"a": 1}}]);
    harness.answer(&call, model_answer(10, asks, "tool_use"));

    // An undeclared tool fails `invalid_input` (not fatal): the model reads it as an error result.
    let call = harness.expect_call("tool");
    assert_eq!(call["params"]["input"]["name"], "nope");
    harness.answer_error(&call, "invalid_input", false);
    let call = harness.expect_call("model");
    let last = call["params"]["input"]["messages"][2].clone();
    assert_eq!(last["role"], "user");
    assert_eq!(last["content"][0]["type"], "tool_result");
    assert_eq!(last["content"][0]["tool_use_id"], "t9");
    assert_eq!(last["content"][0]["is_error"], true);
    let text = last["content"][0]["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("invalid_input"), "{text}");

    // A model error that is not fatal still ends the run, with its code and nothing saved.
    harness.answer_error(&call, "outcome_unknown", false);
    let answer = harness.out.json();
    assert_eq!(answer["id"], 2, "no transcript.set: {answer}");
    assert_eq!(error_code(&answer), "outcome_unknown");
    assert!(!root.0.join("reference-state.json").exists());
}

#[test]
fn reference_harness_stops_after_32_rounds() {
    let root = TempDir(temp_path("reference-rounds"));
    let mut harness = Proc::spawn(REFERENCE, &[]);
    harness.initialize();
    let params = reference_run(
        "ses_m",
        1,
        &root.0,
        json!({"input": {"content": [{"type": "text", "text": "loop"}]}}),
    );
    harness.request(2, "run", params);
    let asks = json!([{"type": "tool_use", "id": "t", "name": "bash", "input": {}}]);
    for round in 1..=32 {
        let call = harness.expect_call("model");
        harness.answer(&call, model_answer(round * 2, asks.clone(), "tool_use"));
        if round < 32 {
            let call = harness.expect_call("tool");
            let result = json!({"outcome": "ok", "content": [], "is_error": false});
            harness.answer(&call, json!({"sequence": round * 2 + 1, "result": result}));
        }
    }
    let answer = harness.out.json();
    assert_eq!(
        answer["id"], 2,
        "no 33rd model call, no transcript.set: {answer}"
    );
    assert_eq!(error_code(&answer), "harness_error");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too many rounds")
    );
}

#[test]
fn reference_harness_refuses_malformed_params_and_answers_the_other_methods() {
    let mut harness = Proc::spawn(REFERENCE, &[]);
    harness.initialize();

    // Not RunParams (no state_dir, model or runtime).
    harness.request(2, "run", run_params("ses_a", 3, json!(null)));
    assert_eq!(error_code(&harness.out.response(json!(2))), "invalid_input");

    harness.request(4, "run", json!({"session_id": "ses_c"}));
    let answer = harness.out.response(json!(4));
    assert_eq!(answer["error"]["code"], -32602);
    assert_eq!(error_code(&answer), "invalid_input");

    harness.request(5, "no/such/method", json!({}));
    let answer = harness.out.response(json!(5));
    assert_eq!(answer["error"]["code"], -32601);
    assert_eq!(error_code(&answer), "unknown_method");

    harness.request(6, "cancel", json!({"session_id": "ses_zz", "sequence": 1}));
    assert_eq!(harness.out.response(json!(6))["result"], json!({}));
    harness.request(
        7,
        "close",
        json!({"session_id": "ses_a", "reason": "closed"}),
    );
    assert_eq!(harness.out.response(json!(7))["result"], json!({}));
    harness.request(8, "shutdown", json!({}));
    assert_eq!(harness.out.response(json!(8))["result"], json!({}));

    exits_cleanly(harness);
}

// ---------------------------------------------------------------------------------------------
// The SDK in-process: cancel and brain/call

#[test]
fn cancel_of_a_running_activation_answers_cancelled() {
    let hook_ran = Arc::new(AtomicBool::new(false));
    let hook = hook_ran.clone();
    let mut brain = InProcess::start(move |activation| {
        let hook = hook.clone();
        activation
            .cancel_token()
            .on_cancel(move || hook.store(true, Ordering::SeqCst));
        if activation
            .cancel_token()
            .wait_timeout(Duration::from_secs(120))
        {
            Err(HandlerError::cancelled())
        } else {
            Ok(None)
        }
    });
    brain.request(1, "initialize", initialize_params());
    assert_eq!(brain.out.response(json!(1))["result"]["protocol"], PROTOCOL);

    brain.request(2, "run", run_params("ses_a", 5, json!(null)));
    brain.request(3, "cancel", json!({"session_id": "ses_a", "sequence": 5}));
    let first = brain.out.json();
    let second = brain.out.json();
    let (cancel, run) = if first["id"] == 3 {
        (first, second)
    } else {
        (second, first)
    };
    assert_eq!(cancel["id"], 3);
    assert_eq!(cancel["result"], json!({}));
    assert_eq!(run["id"], 2);
    assert_eq!(run["error"]["code"], -32000);
    assert_eq!(error_code(&run), "cancelled");
    assert!(hook_ran.load(Ordering::SeqCst));

    // Idempotent: the same cancel again, and one for a session nobody runs.
    brain.request(4, "cancel", json!({"session_id": "ses_a", "sequence": 5}));
    assert_eq!(brain.out.response(json!(4))["result"], json!({}));
    brain.request(
        5,
        "cancel",
        json!({"session_id": "ses_nobody", "sequence": 1}),
    );
    assert_eq!(brain.out.response(json!(5))["result"], json!({}));
    assert!(brain.finish().is_empty());
}

#[test]
fn brain_call_blocks_until_brain_answers() {
    let mut brain = InProcess::start(|activation| {
        let value = activation.call("kv.get", json!({"key": "plan"}))?;
        Ok(Some(
            json!({"kv": value, "cancelled": activation.is_cancelled()}),
        ))
    });
    brain.request(7, "run", run_params("ses_x", 12, json!(null)));

    let call = brain.out.json();
    assert_eq!(call["jsonrpc"], "2.0");
    assert_eq!(call["method"], "brain/call");
    assert!(call["id"].is_string(), "the SDK uses string ids: {call}");
    assert_eq!(
        call["params"],
        json!({"session_id": "ses_x", "sequence": 12, "method": "kv.get", "input": {"key": "plan"}})
    );
    // The run's answer depends on this answer, so it cannot have been sent before it.
    brain.send(&json!({"jsonrpc":"2.0","id":call["id"],"result":{"found":true,"value":"step 2"}}));
    let answer = brain.out.json();
    assert_eq!(answer["id"], 7);
    assert_eq!(
        answer["result"],
        json!({"result": {"kv": {"found": true, "value": "step 2"}, "cancelled": false}})
    );
    assert!(brain.finish().is_empty());
}

#[test]
fn a_fatal_call_error_cancels_the_activation_and_a_plain_one_does_not() {
    let mut brain = InProcess::start(|activation| {
        let hook_ran = Arc::new(AtomicBool::new(false));
        let hook = hook_ran.clone();
        activation
            .cancel_token()
            .on_cancel(move || hook.store(true, Ordering::SeqCst));
        let describe = |error: CallError| json!({"code": error.code, "fatal": error.fatal, "cancelled": activation.is_cancelled()});
        let first = activation
            .call("environments.get", json!({"name": "workspace"}))
            .map_err(describe)
            .expect_err("the first call fails");
        // Started and then waited for: the wait cancels the token as `call` does.
        let second = activation
            .start_call_typed::<_, Value>("model", &json!({"messages": []}))
            .and_then(|pending| pending.wait())
            .map_err(describe)
            .expect_err("the second call fails");
        Ok(Some(json!({
            "first": first, "second": second, "hook_ran": hook_ran.load(Ordering::SeqCst)
        })))
    });
    brain.request(2, "run", run_params("ses_f", 1, json!(null)));

    let call = brain.out.json();
    assert_eq!(call["params"]["method"], "environments.get");
    brain.send(&json!({"jsonrpc":"2.0","id":call["id"],"error":{
        "code":-32000,"message":"not granted","data":{"code":"not_granted","fatal":false}}}));
    let call = brain.out.json();
    assert_eq!(call["params"]["method"], "model");
    brain.send(&json!({"jsonrpc":"2.0","id":call["id"],"error":{
        "code":-32000,"message":"cancelled","data":{"code":"cancelled","fatal":true}}}));

    let answer = brain.out.response(json!(2));
    assert_eq!(
        answer["result"]["result"],
        json!({
            "first": {"code": "not_granted", "fatal": false, "cancelled": false},
            "second": {"code": "cancelled", "fatal": true, "cancelled": true},
            "hook_ran": true
        })
    );
    assert!(brain.finish().is_empty());
}

#[test]
fn pending_calls_fail_when_the_connection_closes() {
    let mut brain = InProcess::start(|activation| {
        let error = activation
            .call("kv.get", json!({"key": "k"}))
            .expect_err("the input closes before an answer");
        Ok(Some(json!({
            "code": error.code, "fatal": error.fatal, "cancelled": activation.is_cancelled()
        })))
    });
    brain.request(2, "run", run_params("ses_c", 9, json!(null)));
    let call = brain.out.json();
    assert_eq!(call["method"], "brain/call");

    // Brain goes away without answering: the call fails at once and the run still answers.
    let rest = brain.finish();
    assert_eq!(rest.len(), 1, "only the run answer follows");
    let answer: Value = serde_json::from_slice(&rest[0]).unwrap();
    assert_eq!(answer["id"], 2);
    assert_eq!(
        answer["result"]["result"],
        json!({"code": CallError::CONNECTION_CLOSED, "fatal": true, "cancelled": true})
    );
}

#[test]
fn a_typed_call_encodes_its_input_and_types_the_answer() {
    let (harness_reads, mut to_harness) = std::io::pipe().unwrap();
    let (from_harness, harness_writes) = std::io::pipe().unwrap();
    let (connection, threads) = Connection::new(harness_reads, harness_writes, 1 << 20).unwrap();
    let out = Lines::spawn(from_harness, Some(256));
    #[derive(serde::Serialize)]
    struct Put<'a> {
        key: &'a str,
        value: &'a [u32],
    }
    // Answers `call` with `member` (`"result":…` or `"error":…`).
    let mut answer = |call: &Value, member: &str| {
        let id = call["id"].as_str().expect("a string call id");
        let line = format!(r#"{{"jsonrpc":"2.0","id":"{id}",{member}}}"#);
        to_harness.write_all(line.as_bytes()).unwrap();
        to_harness.write_all(b"\n").unwrap();
    };
    /// Makes `call` on its own thread, as a harness's run thread would.
    fn in_thread<T: Send + 'static>(
        connection: &Connection,
        call: impl FnOnce(&Connection) -> T + Send + 'static,
    ) -> thread::JoinHandle<T> {
        let connection = connection.clone();
        thread::spawn(move || call(&connection))
    }
    type Sequence = brain::protocol::harness::SequenceResult;

    // The input is encoded as given; a well-formed answer is typed.
    let caller = in_thread(&connection, |c| {
        let input = Put {
            key: "k",
            value: &[1, 2],
        };
        c.call_typed::<_, Sequence>("ses_t", 4, "kv.put", &input)
    });
    let call = out.json();
    assert_eq!(
        call["params"],
        json!({"session_id": "ses_t", "sequence": 4, "method": "kv.put",
               "input": {"key": "k", "value": [1, 2]}})
    );
    answer(&call, r#""result":{"sequence":17}"#);
    let typed = caller.join().unwrap().expect("the typed answer");
    assert_eq!(typed.sequence, 17);

    // An answer that is not the type asked for fails `invalid_response`, not fatal.
    let caller = in_thread(&connection, |c| {
        c.call_typed::<_, Sequence>("ses_t", 4, "kv.delete", &json!({"key": "k"}))
    });
    answer(&out.json(), r#""result":{"sequence":"x"}"#);
    let error = caller.join().unwrap().expect_err("a malformed answer");
    assert_eq!(error.code, CallError::INVALID_RESPONSE);
    assert!(!error.fatal);
    assert!(error.message.contains("kv.delete"), "{}", error.message);

    // The untyped call still hands back the result as JSON, errors as errors.
    let get = |c: &Connection| c.call("ses_t", 4, "kv.get", json!({"key": "k"}));
    let caller = in_thread(&connection, get);
    answer(
        &out.json(),
        r#""result":{"found":true,"value":[1.5,"x",null]}"#,
    );
    assert_eq!(
        caller.join().unwrap().unwrap(),
        json!({"found": true, "value": [1.5, "x", null]})
    );
    let caller = in_thread(&connection, get);
    answer(
        &out.json(),
        r#""error":{"code":-32000,"message":"no","data":{"code":"activation_closed","fatal":true}}"#,
    );
    let error = caller.join().unwrap().expect_err("an error answer");
    assert_eq!(error.code, "activation_closed");
    assert!(error.fatal);

    // Calls started on one thread are all sent before any answer; each waits for its own answer,
    // whichever order they come in.
    let caller = in_thread(&connection, |c| {
        let first =
            c.start_call_typed::<_, Sequence>("ses_t", 4, "kv.put", &json!({"key": "a"}))?;
        let second =
            c.start_call_typed::<_, Sequence>("ses_t", 4, "kv.delete", &json!({"key": "b"}))?;
        assert_eq!(first.method(), "kv.put");
        Ok::<_, CallError>((first.wait()?.sequence, second.wait()?.sequence))
    });
    let first = out.json();
    let second = out.json();
    assert_eq!(first["params"]["method"], "kv.put");
    assert_eq!(second["params"]["method"], "kv.delete");
    answer(&second, r#""result":{"sequence":31}"#);
    answer(&first, r#""result":{"sequence":30}"#);
    assert_eq!(caller.join().unwrap().expect("both answers"), (30, 31));

    // An answer that begins as Brain writes one and is not a success response after all fails
    // the call `invalid_response`, naming what is wrong, instead of leaving it waiting.
    let caller = in_thread(&connection, |c| {
        c.call_typed::<_, Sequence>("ses_t", 4, "kv.put", &json!({"key": "k", "value": 2}))
    });
    answer(&out.json(), r#""result":{"sequence":24},"error":null"#);
    let error = caller.join().unwrap().expect_err("not a success response");
    assert_eq!(error.code, CallError::INVALID_RESPONSE);
    assert!(
        error.message.contains("no error or method"),
        "{}",
        error.message
    );

    // An answer laid out otherwise than Brain writes one (members in another order, spaces)
    // is read the general way and typed the same.
    let caller = in_thread(&connection, |c| {
        c.call_typed::<_, Sequence>("ses_t", 4, "kv.put", &json!({"key": "k", "value": 1}))
    });
    let id = out.json()["id"]
        .as_str()
        .expect("a string call id")
        .to_owned();
    let line = format!(r#"{{ "result": {{"sequence": 23}}, "id": "{id}", "jsonrpc": "2.0" }}"#);
    writeln!(to_harness, "{line}").unwrap();
    assert_eq!(
        caller.join().unwrap().expect("the typed answer").sequence,
        23
    );

    drop(to_harness);
    connection.close();
    drop(connection);
    assert!(out.until_eof().is_empty());
    threads.join().unwrap();
}

/// Brain's requests reach `requests()` with their params as the JSON text Brain sent, typed by
/// whoever handles them; a request the typed read refuses (a member given twice) still arrives.
#[test]
fn requests_arrive_with_their_params_as_text() {
    let (harness_reads, mut to_harness) = std::io::pipe().unwrap();
    let (from_harness, harness_writes) = std::io::pipe().unwrap();
    let (connection, threads) = Connection::new(harness_reads, harness_writes, 1024).unwrap();
    let out = Lines::spawn(from_harness, None);

    to_harness
        .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"run\",\"params\":{\"session_id\":\"s\",  \"sequence\":2}}\n")
        .unwrap();
    to_harness
        .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":\"x\",\"method\":\"close\",\"method\":\"cancel\",\"params\":[1]}\n")
        .unwrap();
    to_harness
        .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"shutdown\"}\n")
        .unwrap();

    let run = connection.requests().recv_timeout(DEADLINE).unwrap();
    assert_eq!(
        (run.id.clone(), run.method.as_str()),
        (RequestId::Int(1), "run")
    );
    assert_eq!(run.params.get(), r#"{"session_id":"s",  "sequence":2}"#);
    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Names {
        session_id: String,
        sequence: u64,
    }
    assert_eq!(
        run.params_as::<Names>().unwrap(),
        Names {
            session_id: "s".into(),
            sequence: 2
        }
    );
    assert!(run.params_as::<Vec<u64>>().is_err());

    // The last `method` wins, as JSON text read into a tree has it.
    let twice = connection.requests().recv_timeout(DEADLINE).unwrap();
    assert_eq!(twice.id, RequestId::Str("x".into()));
    assert_eq!(twice.method, "cancel");
    assert_eq!(twice.params_as::<Value>().unwrap(), json!([1]));

    let bare = connection.requests().recv_timeout(DEADLINE).unwrap();
    assert_eq!(bare.method, "shutdown");
    assert_eq!(bare.params.get(), "null");

    drop(to_harness);
    connection.close();
    drop(connection);
    assert!(out.until_eof().is_empty());
    threads.join().unwrap();
}

#[test]
fn the_low_level_connection_skips_bad_lines_and_fails_calls_after_close() {
    let (harness_reads, mut to_harness) = std::io::pipe().unwrap();
    let (from_harness, harness_writes) = std::io::pipe().unwrap();
    let (connection, threads) = Connection::new(harness_reads, harness_writes, 1024).unwrap();
    let out = Lines::spawn(from_harness, Some(256));

    let caller = {
        let connection = connection.clone();
        thread::spawn(move || connection.call("ses_l", 2, "emit", json!({"type": "x"})))
    };
    let call = out.json();
    assert_eq!(call["method"], "brain/call");

    // Garbage, an over-long line, a response nobody waits for: all skipped, never answered.
    to_harness.write_all(b"not json\n[1]\n").unwrap();
    to_harness.write_all(&[b'x'; 4096]).unwrap();
    to_harness
        .write_all(b"\n{\"jsonrpc\":\"2.0\",\"id\":\"c999\",\"result\":{}}\n")
        .unwrap();
    to_harness
        .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"cancel\",\"params\":{}}\n")
        .unwrap();
    let request = connection
        .requests()
        .recv_timeout(DEADLINE)
        .expect("the request after the bad lines arrives");
    assert_eq!(request.id, RequestId::Int(5));
    assert_eq!(request.method, "cancel");
    connection.respond(&request.id, &json!({})).unwrap();
    assert_eq!(out.json(), json!({"jsonrpc":"2.0","id":5,"result":{}}));

    // Brain closes the harness's input with the call still pending.
    drop(to_harness);
    let error = caller.join().unwrap().expect_err("the pending call fails");
    assert_eq!(error.code, CallError::CONNECTION_CLOSED);
    assert!(error.fatal);
    let error = connection
        .call("ses_l", 2, "emit", json!({}))
        .expect_err("a later call fails at once");
    assert_eq!(error.code, CallError::CONNECTION_CLOSED);

    // An answer over the outgoing limit is refused before it reaches the pipe.
    connection.set_max_outgoing_line_bytes(64);
    let big = json!({"padding": "y".repeat(100)});
    assert!(matches!(
        connection.respond(&RequestId::Int(1), &big),
        Err(brain::harness::SendError::TooLong { .. })
    ));

    connection.close();
    drop(connection);
    assert!(out.until_eof().is_empty());
    threads.join().unwrap();
}

#[test]
fn lines_from_many_threads_keep_each_threads_order_and_flush_covers_them() {
    let (harness_reads, to_harness) = std::io::pipe().unwrap();
    let (from_harness, harness_writes) = std::io::pipe().unwrap();
    let (connection, threads) = Connection::new(harness_reads, harness_writes, 1024).unwrap();
    let reader = thread::spawn(move || {
        BufReader::new(from_harness)
            .lines()
            .map(Result::unwrap)
            .collect::<Vec<String>>()
    });
    // Enough lines to fill the pipe several times over: some are written by their sender,
    // others wait for the writer thread while a sender holds the output.
    let (senders, per_sender) = (8usize, 2000usize);
    let sending: Vec<_> = (0..senders)
        .map(|t| {
            let connection = connection.clone();
            thread::spawn(move || {
                for n in 0..per_sender {
                    let line =
                        format!("{{\"t\":{t},\"n\":{n},\"pad\":\"{}\"}}", "p".repeat(n % 97));
                    connection.send_raw_line(line.into_bytes()).unwrap();
                }
                connection.flush().unwrap();
            })
        })
        .collect();
    for sender in sending {
        sender.join().unwrap();
    }
    connection.close();
    drop(connection);
    let lines = reader.join().unwrap();
    drop(to_harness);
    threads.join().unwrap();
    assert_eq!(lines.len(), senders * per_sender);
    let mut next = vec![0u64; senders];
    for line in &lines {
        let value: Value = serde_json::from_str(line).unwrap();
        let t = value["t"].as_u64().unwrap() as usize;
        assert_eq!(
            value["n"].as_u64().unwrap(),
            next[t],
            "thread {t} out of order"
        );
        next[t] += 1;
    }
}

// ---------------------------------------------------------------------------------------------
// The fault harness

#[test]
fn fault_harness_default_is_a_correct_echo_harness() {
    let mut harness = Proc::spawn(FAULT, &[]);
    let answer = harness.initialize();
    assert_eq!(answer["result"]["protocol"], PROTOCOL);
    assert_eq!(answer["result"]["identity"]["name"], "brain-fault-harness");
    assert_eq!(answer["result"]["state_version"], "1");

    let params = run_params("ses_d", 1, json!("hi"));
    harness.request(2, "run", params.clone());
    assert_eq!(
        harness.out.response(json!(2))["result"],
        json!({"result": {"echo": params, "closed": []}})
    );
    for (id, method, params) in [
        (3, "cancel", json!({"session_id": "ses_d", "sequence": 1})),
        (
            4,
            "close",
            json!({"session_id": "ses_d", "reason": "passivated"}),
        ),
        (5, "shutdown", json!({})),
    ] {
        harness.request(id, method, params);
        assert_eq!(harness.out.response(json!(id))["result"], json!({}));
    }
    exits_cleanly(harness);
}

#[test]
fn fault_harness_wrong_protocol() {
    let mut harness = Proc::spawn(FAULT, &["--wrong-protocol"]);
    assert_eq!(
        harness.initialize()["result"]["protocol"],
        "brain/harness/v0"
    );
}

#[test]
fn fault_harness_init_error_and_delay() {
    let mut harness = Proc::spawn(FAULT, &["--init-error"]);
    let answer = harness.initialize();
    assert_eq!(answer["error"]["code"], -32000);
    assert_eq!(error_code(&answer), "harness_error");

    let begin = Instant::now();
    let mut harness = Proc::spawn(FAULT, &["--init-delay-ms", "150"]);
    assert_eq!(harness.initialize()["result"]["protocol"], PROTOCOL);
    assert!(begin.elapsed() >= Duration::from_millis(150));
}

#[test]
fn fault_harness_identity_flags() {
    let mut harness = Proc::spawn_with_env(
        FAULT,
        &[
            "--identity",
            "other",
            "--state-version",
            "v{worker}",
            "--configuration-keys",
            "thinking,compact_at",
            "--required-model-metadata",
            "context_window",
            "--capability",
            "media",
            "--capability",
            "fixed_tool_catalogue",
        ],
        &[("BRAIN_WORKER", "3")],
    );
    let result = &harness.initialize()["result"];
    assert_eq!(result["identity"]["name"], "other");
    assert_eq!(result["state_version"], "v3");
    assert_eq!(
        result["configuration_keys"],
        json!(["thinking", "compact_at"])
    );
    assert_eq!(result["required_model_metadata"], json!(["context_window"]));
    assert_eq!(
        result["capabilities"],
        json!({"media": true, "transcript_import": false, "fixed_tool_catalogue": true})
    );
}

#[test]
fn fault_harness_refuses_unknown_arguments() {
    let mut harness = Proc::spawn(FAULT, &["--no-such-flag"]);
    let usage = harness.err.until_eof();
    assert!(usage.iter().any(|line| line.starts_with(b"usage:")));
    assert!(harness.out.until_eof().is_empty());
    assert_eq!(harness.wait().code(), Some(2));
}

#[test]
fn fault_harness_never_init_answers_nothing_and_exits_at_eof() {
    let mut harness = Proc::spawn(FAULT, &["--never-init"]);
    harness.request(1, "initialize", initialize_params());
    exits_cleanly(harness);
}

#[test]
fn fault_harness_garbage_writes_each_kind_of_bad_line() {
    let mut harness = Proc::spawn(FAULT, &["--garbage", "6"]);
    harness.initialize();
    let lines: Vec<Vec<u8>> = (0..6).map(|_| harness.out.next()).collect();
    let decoded: Vec<_> = lines.iter().map(|line| jsonrpc::decode(line)).collect();
    assert_eq!(decoded[0], Err(Violation::InvalidJson));
    assert_eq!(decoded[1], Err(Violation::NotAnObject));
    assert!(
        serde_json::from_slice::<Value>(&lines[1])
            .unwrap()
            .is_array()
    );
    assert_eq!(decoded[2], Err(Violation::NotAnObject));
    assert!(
        serde_json::from_slice::<Value>(&lines[2])
            .unwrap()
            .is_number()
    );
    assert_eq!(decoded[3], Err(Violation::InvalidMessage));
    assert!(serde_json::from_slice::<Value>(&lines[3]).unwrap()["jsonrpc"].is_null());
    match &decoded[4] {
        Ok(Message::Response(response)) => assert_eq!(response.id, RequestId::Int(999_999)),
        other => panic!("expected a response to 999999, got {other:?}"),
    }
    assert_eq!(decoded[5], Err(Violation::InvalidUtf8));

    harness.request(2, "run", run_params("ses_g", 1, json!(null)));
    assert!(harness.out.json()["result"]["result"]["echo"].is_object());
}

#[test]
fn fault_harness_invalid_utf8_lines() {
    let mut harness = Proc::spawn(FAULT, &["--invalid-utf8", "3"]);
    harness.initialize();
    for _ in 0..3 {
        assert_eq!(
            jsonrpc::decode(&harness.out.next()),
            Err(Violation::InvalidUtf8)
        );
    }
    harness.request(2, "run", run_params("ses_u", 1, json!(null)));
    assert_eq!(harness.out.json()["id"], 2);
}

#[test]
fn fault_harness_overlong_line_then_carries_on() {
    let mut harness = Proc::spawn(FAULT, &["--overlong", "1048576"]);
    harness.initialize();
    let line = harness.out.next();
    assert_eq!(line.len(), 1_048_576);
    assert!(line.iter().all(|&b| b == b'x'));
    harness.request(2, "run", run_params("ses_o", 1, json!("after")));
    let answer = harness.out.json();
    assert_eq!(answer["id"], 2);
    assert_eq!(
        answer["result"]["result"]["echo"]["input"]["input"],
        "after"
    );
}

#[test]
fn fault_harness_flood_still_serves_requests() {
    let mut harness = Proc::spawn(FAULT, &["--flood"]);
    harness.initialize();
    let noise = harness.out.json();
    assert_eq!(noise["method"], "noise");
    assert!(noise.get("id").is_none());
    harness.request(2, "run", run_params("ses_n", 1, json!(null)));
    assert_eq!(
        harness.out.response(json!(2))["result"]["result"]["echo"]["session_id"],
        "ses_n"
    );
}

#[test]
fn fault_harness_grandchild_writes_both_pids() {
    let file = temp_path("pids");
    let mut harness = Proc::spawn(FAULT, &["--grandchild", file.to_str().unwrap()]);
    // The pid file is written before the harness serves, so the initialize answer orders it.
    harness.initialize();
    let text = std::fs::read_to_string(&file).expect("the pid file exists");
    let mut tmp = file.clone().into_os_string();
    tmp.push(".tmp");
    assert!(
        !PathBuf::from(tmp).exists(),
        "written via a renamed temp file"
    );
    let _ = std::fs::remove_file(&file);
    assert!(text.ends_with('\n'));
    let pids: Vec<i32> = text
        .split_whitespace()
        .map(|pid| pid.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "{text:?}");
    assert_eq!(pids[0], harness.pid());
    assert_ne!(pids[1], pids[0]);
    assert!(
        kill(Pid::from_raw(pids[1]), None).is_ok(),
        "the grandchild runs"
    );
    let group = nix::unistd::getpgid(Some(Pid::from_raw(pids[1]))).unwrap();
    assert_eq!(group, Pid::from_raw(harness.pid()), "same process group");
}

#[test]
fn fault_harness_crash_once_crashes_the_first_worker_only() {
    let file = temp_path("crashed");
    let path = file.to_str().unwrap();
    let mut first = Proc::spawn(FAULT, &["--crash-after-ms", "0", "--crash-once", path]);
    first.out.until_eof();
    assert_eq!(first.wait().code(), Some(3));
    assert!(file.exists());

    let mut second = Proc::spawn(FAULT, &["--crash-after-ms", "0", "--crash-once", path]);
    second.err.find("not crashing");
    assert_eq!(second.initialize()["result"]["protocol"], PROTOCOL);
    let _ = std::fs::remove_file(&file);
}

#[test]
fn fault_harness_crash_after_exits_with_status_3() {
    let begin = Instant::now();
    let mut harness = Proc::spawn(FAULT, &["--crash-after-ms", "300"]);
    harness.out.until_eof();
    assert_eq!(harness.wait().code(), Some(3));
    assert!(begin.elapsed() >= Duration::from_millis(300));
}

#[test]
fn fault_harness_ignore_shutdown_outlives_eof_and_signals() {
    let mut harness = Proc::spawn(FAULT, &["--ignore-shutdown"]);
    harness.initialize();
    harness.request(2, "shutdown", json!({}));
    assert_eq!(harness.out.response(json!(2))["result"], json!({}));
    harness.close_stdin();
    harness.err.find("ignoring it");
    kill(Pid::from_raw(harness.pid()), Signal::SIGTERM).unwrap();
    kill(Pid::from_raw(harness.pid()), Signal::SIGINT).unwrap();
    // A negative check needs a bound: the process must not exit (its stdout must stay open).
    assert_eq!(
        harness.out.rx.recv_timeout(Duration::from_millis(500)),
        Err(RecvTimeoutError::Timeout)
    );
    let exited = harness.child.try_wait().unwrap();
    harness.reaped = exited.is_some();
    assert_eq!(exited, None, "the harness must still run");
}

// ---------------------------------------------------------------------------------------------
// The fault harness's per-session faults (configuration key `fault`)

/// `run` params whose merged configuration is `configuration`.
fn fault_run(session_id: &str, sequence: u64, configuration: Value) -> Value {
    json!({"session_id": session_id, "sequence": sequence,
           "input": {"configuration": configuration}})
}

/// Reads `ids.len()` responses (in any order) and returns them in the order of `ids`.
fn responses(harness: &Proc, ids: &[i64]) -> Vec<Value> {
    let mut seen: Vec<Value> = (0..ids.len()).map(|_| harness.out.json()).collect();
    ids.iter()
        .map(|id| {
            let index = seen
                .iter()
                .position(|message| message["id"] == json!(id) && message.get("method").is_none())
                .unwrap_or_else(|| panic!("no response {id} among {seen:?}"));
            seen.swap_remove(index)
        })
        .collect()
}

#[test]
fn fault_hang_answers_only_when_cancelled_while_other_sessions_run() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    harness.request(2, "run", fault_run("ses_h", 1, json!({"fault": "hang"})));
    harness.request(3, "run", fault_run("ses_e", 1, json!({"fault": "echo"})));
    let echo = harness.out.json();
    assert_eq!(echo["id"], 3, "the hanging run does not answer: {echo}");
    assert_eq!(echo["result"]["result"]["echo"]["session_id"], "ses_e");

    harness.request(4, "cancel", json!({"session_id": "ses_h", "sequence": 1}));
    let [cancel, run] = <[Value; 2]>::try_from(responses(&harness, &[4, 2])).unwrap();
    assert_eq!(cancel["result"], json!({}));
    assert_eq!(error_code(&run), "cancelled");
}

#[test]
fn fault_ignore_cancel_never_answers() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    harness.request(
        2,
        "run",
        fault_run("ses_i", 1, json!({"fault": "ignore_cancel"})),
    );
    harness.err.find("will never answer");
    harness.request(3, "cancel", json!({"session_id": "ses_i", "sequence": 1}));
    assert_eq!(
        harness.out.json(),
        json!({"jsonrpc": "2.0", "id": 3, "result": {}})
    );
    harness.request(4, "run", fault_run("ses_j", 1, json!({})));
    assert_eq!(
        harness.out.json()["id"],
        4,
        "the worker still serves others"
    );
    // A negative check needs a bound: no run answer arrives.
    assert_eq!(
        harness.out.rx.recv_timeout(Duration::from_millis(300)),
        Err(RecvTimeoutError::Timeout)
    );
}

#[test]
fn fault_crash_exits_with_status_4() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    harness.request(2, "run", fault_run("ses_c", 1, json!({"fault": "crash"})));
    assert!(
        harness.out.until_eof().is_empty(),
        "the run is never answered"
    );
    assert_eq!(harness.wait().code(), Some(4));
}

#[test]
fn fault_callbacks_outstanding_answers_before_its_callback_is_answered() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    harness.request(
        2,
        "run",
        fault_run("ses_o", 6, json!({"fault": "callbacks_outstanding"})),
    );
    let call = harness.expect_call("kv.get");
    assert_eq!(
        call["params"],
        json!({"session_id": "ses_o", "sequence": 6, "method": "kv.get", "input": {"key": "x"}})
    );
    // Unanswered, and yet the run's answer follows.
    let answer = harness.out.json();
    assert_eq!(answer["id"], 2);
    assert_eq!(answer["result"], json!({"result": {"ok": true}}));
    // A late answer to the callback harms nothing.
    harness.answer(&call, json!({"found": false}));
    harness.request(3, "run", fault_run("ses_p", 1, json!({})));
    assert_eq!(harness.out.json()["id"], 3);
}

#[test]
fn fault_calls_performs_callbacks_until_the_first_error() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    let calls = json!([
        {"method": "kv.put", "input": {"key": "a", "value": 1}},
        {"method": "environments.get", "input": {"name": "workspace"}},
        {"method": "emit", "input": {"type": "never", "data": null}}
    ]);
    harness.request(
        2,
        "run",
        fault_run("ses_l", 3, json!({"fault": "calls", "calls": calls})),
    );
    let call = harness.expect_call("kv.put");
    assert_eq!(call["params"]["session_id"], "ses_l");
    assert_eq!(call["params"]["sequence"], 3);
    assert_eq!(call["params"]["input"], json!({"key": "a", "value": 1}));
    harness.answer(&call, json!({"sequence": 5}));
    let call = harness.expect_call("environments.get");
    harness.answer_error(&call, "not_granted", false);
    let answer = harness.out.json();
    assert_eq!(answer["id"], 2, "the emit is never made: {answer}");
    assert_eq!(
        answer["result"]["result"],
        json!({"answers": [{"sequence": 5}, {"error": {"code": "not_granted", "fatal": false}}],
               "tools": null})
    );
}

#[test]
fn fault_slow_calls_waits_and_a_cancel_ends_the_wait() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    let calls = json!([{"method": "kv.get", "input": {"key": "a"}}]);
    harness.request(
        2,
        "run",
        fault_run(
            "ses_s",
            1,
            json!({"fault": "slow_calls", "delay_ms": 1, "calls": calls}),
        ),
    );
    let call = harness.expect_call("kv.get");
    harness.answer(&call, json!({"found": true, "value": 7}));
    assert_eq!(
        harness.out.response(json!(2))["result"]["result"],
        json!({"answers": [{"found": true, "value": 7}], "tools": null})
    );

    let config = json!({"fault": "slow_calls", "delay_ms": 3_600_000, "calls": calls});
    harness.request(3, "run", fault_run("ses_s", 2, config));
    harness.request(4, "cancel", json!({"session_id": "ses_s", "sequence": 2}));
    let [cancel, run] = <[Value; 2]>::try_from(responses(&harness, &[4, 3])).unwrap();
    assert_eq!(cancel["result"], json!({}));
    assert_eq!(error_code(&run), "cancelled", "no callback was made");
}

#[test]
fn fault_foreign_callback_names_another_activation() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    let config = json!({"fault": "foreign_callback", "target_session": "ses_other",
                        "target_sequence": 99});
    harness.request(2, "run", fault_run("ses_f", 1, config));
    let call = harness.expect_call("kv.put");
    assert_eq!(
        call["params"],
        json!({"session_id": "ses_other", "sequence": 99, "method": "kv.put",
               "input": {"key": "k", "value": 1}})
    );
    harness.answer_error(&call, "activation_not_active", false);
    assert_eq!(
        harness.out.response(json!(2))["result"],
        json!({"result": {"error": "activation_not_active"}})
    );
}

#[test]
fn fault_callback_after_answer_calls_back_after_the_run_answer() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    let config = json!({"fault": "callback_after_answer"});
    harness.request(2, "run", fault_run("ses_a", 8, config));
    assert_eq!(
        harness.out.json(),
        json!({"jsonrpc": "2.0", "id": 2, "result": {}})
    );
    let call = harness.expect_call("kv.get");
    assert_eq!(call["params"]["session_id"], "ses_a");
    assert_eq!(call["params"]["sequence"], 8);
    harness.answer_error(&call, "activation_closed", true);
    harness
        .err
        .find("late callback answered: activation_closed");
}

#[test]
fn fault_fatal_then_succeed_swallows_the_fatal_error() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    harness.request(
        2,
        "run",
        fault_run("ses_t", 1, json!({"fault": "fatal_then_succeed"})),
    );
    let call = harness.expect_call("model");
    assert!(call["params"]["input"]["messages"].is_array());
    harness.answer_error(&call, "journal_failed", true);
    assert_eq!(
        harness.out.response(json!(2))["result"],
        json!({"result": {"ignored": "journal_failed"}})
    );
}

#[test]
fn fault_unknown_mode_fails_the_run() {
    let mut harness = Proc::spawn(FAULT, &[]);
    harness.initialize();
    harness.request(
        2,
        "run",
        fault_run("ses_u", 1, json!({"fault": "nonsense"})),
    );
    assert_eq!(error_code(&harness.out.response(json!(2))), "harness_error");
    harness.request(3, "run", fault_run("ses_u", 2, json!({"fault": 3})));
    assert_eq!(error_code(&harness.out.response(json!(3))), "harness_error");
    harness.request(4, "run", fault_run("ses_u", 3, json!({"fault": "echo"})));
    assert!(harness.out.response(json!(4))["result"]["result"]["echo"].is_object());
}
