//! The built-in `local` environment driver against real processes (`/bin/sh -c` scripts).

use brain::cancel::CancelToken;
use brain::effects::local::{ALLOWED_ENV, validate_configuration};
use brain::effects::{EffectError, EnvironmentDriver, EnvironmentSpec, LocalDriver, ToolCall};
use brain::protocol::harness::{Block, ErrorCode, ToolOutcome, ToolResult};
use brain::session::SessionId;
use serde_json::{Map, Value, json};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long any single wait in a test may take before the test fails.
const WAIT: Duration = Duration::from_secs(20);

/// A fresh, empty directory for one test.
fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "brain-local-{}-{}-{tag}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

/// An environment declaring one tool `t` with this configuration entry.
fn environment(tool: Value) -> EnvironmentSpec {
    EnvironmentSpec {
        name: "host".into(),
        driver: LocalDriver::NAME.into(),
        configuration: object(json!({ "tools": { "t": tool } })),
    }
}

/// A tool entry running `script` with `/bin/sh -c`.
fn sh(script: &str) -> Value {
    json!({ "command": ["/bin/sh", "-c", script] })
}

/// Runs tool `tool` of `environment` with `input`, the session's workspaces in `workspace_dir`.
fn call_in(
    environment: &EnvironmentSpec,
    tool: &str,
    input: &Value,
    workspace_dir: &Path,
    cancel: &CancelToken,
) -> Result<ToolResult, EffectError> {
    let session = SessionId::parse("ses_0123456789ABCDEFGHIJ").expect("a valid id");
    let call = ToolCall {
        session_id: &session,
        sequence: 42,
        environment,
        incarnation: 1,
        tool,
        input,
        workspace_dir,
    };
    LocalDriver::new().call_tool(&call, cancel)
}

/// Runs tool `t` declared as `tool` with `input` in a fresh working directory.
fn call(tool: Value, input: Value) -> Result<ToolResult, EffectError> {
    call_in(
        &environment(tool),
        "t",
        &input,
        &temp_dir("work"),
        &CancelToken::new(),
    )
}

fn texts(result: &ToolResult) -> Vec<&str> {
    result
        .content
        .iter()
        .map(|block| match block {
            Block::Text { text } => text.as_str(),
            other => panic!("not a text block: {other:?}"),
        })
        .collect()
}

/// Whether `pid` is gone: no /proc entry, or a zombie (dead, waiting for its parent to reap it).
fn is_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// Waits (bounded) for the kernel to finish killing `pid`: SIGKILL is delivered at once but the
/// process still has to be scheduled to die.
fn wait_gone(pid: u32) -> bool {
    let until = Instant::now() + WAIT;
    while Instant::now() < until {
        if is_gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

fn read_pid(path: &Path) -> u32 {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("{} was not written: {error}", path.display()));
    text.trim().parse().expect("a pid")
}

#[test]
fn a_json_answer_on_stdout_is_the_result() {
    let result = call(
        sh(r#"printf '%s' '{"content":[{"type":"text","text":"found 3"}],"is_error":true}'"#),
        json!({}),
    )
    .expect("the tool ran");
    assert_eq!(
        result,
        ToolResult {
            outcome: ToolOutcome::Ok,
            content: vec![Block::text("found 3")],
            is_error: true,
        }
    );
}

#[test]
fn plain_text_on_stdout_is_one_text_block() {
    let result = call(sh("echo hello; echo world"), json!({})).expect("the tool ran");
    assert_eq!(
        result,
        ToolResult {
            outcome: ToolOutcome::Ok,
            content: vec![Block::text("hello\nworld\n")],
            is_error: false,
        }
    );
}

#[test]
fn a_non_zero_exit_is_an_error_with_the_output_and_the_status() {
    let result = call(sh("echo partial; echo noise >&2; exit 3"), json!({})).expect("ran");
    assert_eq!(result.outcome, ToolOutcome::Error);
    assert!(result.is_error);
    assert_eq!(
        texts(&result),
        ["partial\n", "tool \"t\" exited with status 3"]
    );

    let result = call(sh("echo 'no such file' >&2; exit 2"), json!({})).expect("ran");
    assert_eq!(result.outcome, ToolOutcome::Error);
    assert_eq!(
        texts(&result),
        ["no such file\n", "tool \"t\" exited with status 2"]
    );
}

#[test]
fn the_input_arrives_on_stdin_as_json() {
    let input = json!({"pattern": "fn main", "paths": ["src", "tests"]});
    let result = call(json!({"command": ["cat"]}), input.clone()).expect("ran");
    assert_eq!(result.outcome, ToolOutcome::Ok);
    let [text] = texts(&result)[..] else {
        panic!("one block expected: {result:?}");
    };
    let echoed: Value = serde_json::from_str(text).expect("stdin was JSON");
    assert_eq!(echoed, input);
}

#[test]
fn the_tool_runs_in_its_environments_workspace_created_private() {
    let base = temp_dir("cwd");
    let workspace_dir = base.join("workspaces").join("ses_x");
    let result = call_in(
        &environment(json!({"command": ["pwd"]})),
        "t",
        &json!({}),
        &workspace_dir,
        &CancelToken::new(),
    )
    .expect("ran");
    assert_eq!(result.outcome, ToolOutcome::Ok);
    let workspace = workspace_dir.join("host");
    let expected = workspace.canonicalize().expect("it was created");
    assert_eq!(texts(&result), [format!("{}\n", expected.display())]);
    for dir in [base.join("workspaces"), workspace_dir, workspace] {
        let mode = std::fs::metadata(&dir)
            .expect("exists")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "{}", dir.display());
    }
}

#[test]
fn the_tool_sees_only_the_allowed_environment() {
    // Cargo sets variables such as CARGO_MANIFEST_DIR for the test process: they must not pass.
    assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
    let result = call(json!({"command": ["env"]}), json!({})).expect("ran");
    assert_eq!(result.outcome, ToolOutcome::Ok);
    let text = texts(&result).concat();
    let names: Vec<&str> = text
        .lines()
        .map(|line| line.split_once('=').map_or(line, |(name, _)| name))
        .collect();
    assert!(names.contains(&"PATH"), "{text}");
    for name in names {
        assert!(ALLOWED_ENV.contains(&name), "{name} leaked into {text}");
    }
}

#[test]
fn a_tool_past_its_deadline_is_killed_with_its_whole_group() {
    let base = temp_dir("timeout");
    // The tool works in its environment's workspace beneath the session's.
    let dir = base.join("host");
    std::fs::create_dir_all(&dir).expect("the workspace");
    let script = "echo $$ > leader; sleep 60 & echo $! > grandchild; echo begun; sleep 60";
    let begin = Instant::now();
    let result = call_in(
        &environment(json!({"command": ["/bin/sh", "-c", script], "timeout_ms": 200})),
        "t",
        &json!({}),
        &base,
        &CancelToken::new(),
    )
    .expect("the tool started");
    assert!(begin.elapsed() < WAIT, "took {:?}", begin.elapsed());
    assert_eq!(result.outcome, ToolOutcome::Timeout);
    assert!(result.is_error);
    assert_eq!(
        texts(&result),
        [
            "begun\n",
            "tool \"t\" timed out after 200 ms and was killed"
        ]
    );
    let leader = read_pid(&dir.join("leader"));
    let grandchild = read_pid(&dir.join("grandchild"));
    // The driver reaped the leader itself: not even a zombie is left.
    assert!(
        !Path::new(&format!("/proc/{leader}")).exists(),
        "leader {leader} not reaped"
    );
    assert!(wait_gone(grandchild), "grandchild {grandchild} survived");
}

#[test]
fn output_past_the_cap_is_truncated_without_blocking_the_tool() {
    let begin = Instant::now();
    let result = call(
        json!({
            "command": ["/bin/sh", "-c", "head -c 10485760 /dev/zero | tr '\\0' a"],
            "max_output_bytes": 65536,
        }),
        json!({}),
    )
    .expect("ran");
    assert!(begin.elapsed() < WAIT, "took {:?}", begin.elapsed());
    assert_eq!(result.outcome, ToolOutcome::Ok);
    let texts = texts(&result);
    assert_eq!(texts.len(), 2, "{:?}", &texts[1..]);
    assert_eq!(texts[0].len(), 65536);
    assert!(texts[0].bytes().all(|byte| byte == b'a'));
    assert_eq!(texts[1], "[output truncated: 65536 of 10485760 bytes kept]");
}

#[test]
fn a_cancel_from_another_thread_kills_a_running_tool_promptly() {
    let base = temp_dir("cancel");
    // The tool works in its environment's workspace beneath the session's.
    let dir = base.join("host");
    std::fs::create_dir_all(&dir).expect("the workspace");
    let fifo = dir.join("ready");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let cancel = CancelToken::new();
    let (cancelled_tx, cancelled_rx) = crossbeam_channel::bounded(1);
    {
        let cancel = cancel.clone();
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            // Opening a fifo for reading blocks until the tool opens it to write: it is running.
            let said = std::fs::read_to_string(&fifo).expect("read the fifo");
            cancel.cancel();
            let _ = cancelled_tx.send((said, Instant::now()));
        });
    }
    let script = "echo $$ > leader; echo ready > ready; sleep 60";
    let result = call_in(
        &environment(json!({"command": ["/bin/sh", "-c", script], "timeout_ms": 60000})),
        "t",
        &json!({}),
        &base,
        &cancel,
    )
    .expect("the tool started");
    let returned = Instant::now();
    let (said, cancelled_at) = cancelled_rx.recv_timeout(WAIT).expect("cancelled");
    assert_eq!(said, "ready\n");
    assert!(
        returned.duration_since(cancelled_at) < Duration::from_secs(10),
        "took {:?} after the cancel",
        returned.duration_since(cancelled_at)
    );
    assert_eq!(result.outcome, ToolOutcome::Cancelled);
    assert!(result.is_error);
    assert_eq!(texts(&result), ["tool \"t\" was cancelled and killed"]);
    let leader = read_pid(&dir.join("leader"));
    assert!(!Path::new(&format!("/proc/{leader}")).exists());
}

#[test]
fn a_call_cancelled_before_it_starts_runs_nothing() {
    let base = temp_dir("precancel");
    // The tool works in its environment's workspace beneath the session's.
    let dir = base.join("host");
    std::fs::create_dir_all(&dir).expect("the workspace");
    let cancel = CancelToken::new();
    cancel.cancel();
    let result = call_in(
        &environment(sh("touch ran")),
        "t",
        &json!({}),
        &base,
        &cancel,
    );
    assert_eq!(result, Err(EffectError::Cancelled { sent: false }));
    assert!(!dir.join("ran").exists());
}

#[test]
fn a_tool_that_never_started_fails_tool_failed() {
    match call_in(
        &environment(sh("true")),
        "missing",
        &json!({}),
        &temp_dir("unknown"),
        &CancelToken::new(),
    ) {
        Err(EffectError::Failed { code, message }) => {
            assert_eq!(code, ErrorCode::ToolFailed);
            assert!(message.contains("no tool \"missing\""), "{message}");
        }
        other => panic!("expected tool_failed, got {other:?}"),
    }
    match call(json!({"command": ["brain-no-such-program"]}), json!({})) {
        Err(EffectError::Failed { code, message }) => {
            assert_eq!(code, ErrorCode::ToolFailed);
            assert!(message.contains("brain-no-such-program"), "{message}");
        }
        other => panic!("expected tool_failed, got {other:?}"),
    }
}

#[test]
fn bad_configurations_are_refused_naming_the_field() {
    let cases = [
        (json!({}), "tools: missing"),
        (json!({"tools": []}), "tools: must be an object"),
        (json!({"tools": {}, "extra": 1}), "extra: unknown key"),
        (json!({"tools": {"t": "ls"}}), "tools.t: must be an object"),
        (json!({"tools": {"t": {}}}), "tools.t.command: missing"),
        (
            json!({"tools": {"t": {"command": []}}}),
            "tools.t.command: must be a non-empty array",
        ),
        (
            json!({"tools": {"t": {"command": ["ls", 1]}}}),
            "tools.t.command: every element must be a string",
        ),
        (
            json!({"tools": {"t": {"command": [""]}}}),
            "tools.t.command: the program",
        ),
        (
            json!({"tools": {"t": {"command": ["ls"], "timeout_ms": 0}}}),
            "tools.t.timeout_ms: must be a positive integer",
        ),
        (
            json!({"tools": {"t": {"command": ["ls"], "max_output_bytes": "1k"}}}),
            "tools.t.max_output_bytes: must be a positive integer",
        ),
        (
            json!({"tools": {"t": {"command": ["ls"], "env": {}}}}),
            "tools.t.env: unknown key",
        ),
    ];
    for (configuration, expected) in cases {
        let error = validate_configuration(&object(configuration.clone()))
            .expect_err(&configuration.to_string());
        assert!(error.starts_with(expected), "{configuration}: {error}");
    }
    validate_configuration(&object(json!({
        "tools": {
            "grep": {"command": ["rg", "--json"], "timeout_ms": 10000, "max_output_bytes": 65536},
            "ls": {"command": ["ls"]},
        }
    })))
    .expect("a valid configuration");
}

#[test]
fn a_configured_workspace_must_lie_inside_a_root_the_deployment_allows() {
    let root = temp_dir("roots");
    let allowed = root.join("projects");
    std::fs::create_dir_all(allowed.join("repo")).expect("the allowed root");
    let driver = LocalDriver::with_workspace_roots(vec![allowed.clone()]);
    let config = |workspace: &str| {
        object(json!({"tools": {"t": {"command": ["pwd"]}}, "workspace": workspace}))
    };
    let inside = allowed.join("repo").display().to_string();
    assert_eq!(driver.validate(&config(&inside)), Ok(()));
    for (bad, expected) in [
        ("/etc".to_owned(), "is not inside a workspace root"),
        (format!("{inside}/../../.."), "must not contain"),
        ("relative/dir".to_owned(), "must be an absolute path"),
    ] {
        let error = driver.validate(&config(&bad)).expect_err("refused");
        assert!(error.contains(expected), "{bad}: {error}");
    }
    // Without roots, no workspace can be named at all.
    let error = LocalDriver::new()
        .validate(&config(&inside))
        .expect_err("refused");
    assert!(error.contains("allows no workspace roots"), "{error}");

    // A call runs in the configured workspace...
    let session = SessionId::parse("ses_0123456789ABCDEFGHIJ").expect("a valid id");
    let run = |workspace: &str| {
        let environment = EnvironmentSpec {
            name: "host".into(),
            driver: LocalDriver::NAME.into(),
            configuration: config(workspace),
        };
        let call = ToolCall {
            session_id: &session,
            sequence: 1,
            environment: &environment,
            incarnation: 1,
            tool: "t",
            input: &json!({}),
            workspace_dir: &root.join("workspaces"),
        };
        driver.call_tool(&call, &CancelToken::new())
    };
    let result = run(&inside).expect("ran");
    let real = allowed.join("repo").canonicalize().expect("exists");
    assert_eq!(texts(&result), [format!("{}\n", real.display())]);
    // ...but a symbolic link planted inside a root cannot lead outside it.
    std::os::unix::fs::symlink("/etc", allowed.join("escape")).expect("plant a link");
    let linked = allowed.join("escape").display().to_string();
    match run(&linked) {
        Err(EffectError::Failed { code, message }) => {
            assert_eq!(code, ErrorCode::ToolFailed);
            assert!(message.contains("outside every allowed root"), "{message}");
        }
        other => panic!("a link out of the root was followed: {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&root);
}
