//! The `brain` binary's commands, run as a user would run them.

mod common;

use common::*;
use std::process::Command;

fn brain(args: &[&str]) -> std::process::Output {
    run_bounded(
        Command::new(BRAIN)
            .args(args)
            .env_remove("BRAIN_AGENTLOOPS"),
    )
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn check_reports_every_worker_and_exits_zero_when_ready() {
    let registrations = serde_json::json!({
        "fault": {"command": FAULT_HARNESS, "workers": 2},
        "reference": {"command": REFERENCE_HARNESS},
    });
    let output = brain(&["check", "--agentloops", &registrations.to_string()]);
    let stdout = text(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout}{}",
        text(&output.stderr)
    );
    assert!(stdout.starts_with("REGISTRATION"), "{stdout}");
    for expected in [
        "fault         0",
        "fault         1",
        "reference     0",
        "brain-fault-harness",
        "brain-reference-harness",
        "healthy",
        "ready: yes",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in\n{stdout}"
        );
    }
}

#[test]
fn check_json_reports_identity_and_latency() {
    let registrations = serde_json::json!({"fault": {"command": FAULT_HARNESS}});
    let output = brain(&[
        "check",
        "--json",
        "--agentloops",
        &registrations.to_string(),
    ]);
    assert_eq!(output.status.code(), Some(0));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON report");
    assert_eq!(report["ready"], true);
    let worker = &report["registrations"][0]["workers"][0];
    assert_eq!(worker["state"], "healthy");
    assert_eq!(
        worker["initialized"]["identity"]["name"],
        "brain-fault-harness"
    );
    assert!(
        worker["init_latency_ms"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0)
    );
}

#[test]
fn check_exits_one_when_no_worker_is_healthy() {
    let registrations = serde_json::json!({
        "silent": {"command": FAULT_HARNESS, "args": ["--never-init"]},
    });
    let output = brain(&[
        "check",
        "--init-deadline",
        "200ms",
        "--agentloops",
        &registrations.to_string(),
    ]);
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("init_timeout"), "{stdout}");
    assert!(stdout.contains("ready: no"), "{stdout}");
}

#[test]
fn check_refuses_bad_registrations_with_78_naming_registration_and_field() {
    for (registrations, expected) in [
        (r#"{"pi": {"command": "x", "workers": 0}}"#, "\"workers\""),
        (
            r#"{"pi": {"command": "x", "max_concurrency": -1}}"#,
            "\"max_concurrency\"",
        ),
        (r#"{"pi": {"args": []}}"#, "\"command\""),
        (r#"{"pi": {"command": "x", "shell": true}}"#, "\"shell\""),
        (r#"{"bad name": {"command": "x"}}"#, "bad name"),
        (r#"{}"#, "no registrations"),
        (r#"{"pi": "#, "line"),
        (r#"{"pi": {"command": "./no/such/harness"}}"#, "\"command\""),
    ] {
        let output = brain(&["check", "--agentloops", registrations]);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(78), "{registrations}: {stderr}");
        assert!(stderr.contains(expected), "{registrations}: {stderr}");
        if registrations.contains("\"pi\"") && !registrations.ends_with(": ") {
            assert!(stderr.contains("\"pi\""), "{registrations}: {stderr}");
        }
    }
}

#[test]
fn check_reads_registrations_from_a_file_and_from_the_environment() {
    let dir = temp_dir("cli-file");
    let file = dir.join("agentloops.json");
    std::fs::write(
        &file,
        serde_json::json!({"filed": {"command": FAULT_HARNESS}}).to_string(),
    )
    .unwrap();
    let output = brain(&["check", "--agentloops", &file.to_string_lossy()]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    assert!(text(&output.stdout).contains("filed"));

    let output = run_bounded(Command::new(BRAIN).args(["check"]).env(
        "BRAIN_AGENTLOOPS",
        serde_json::json!({"from_env": {"command": FAULT_HARNESS}}).to_string(),
    ));
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    assert!(text(&output.stdout).contains("from_env"));
}

#[test]
fn check_refuses_disagreeing_workers_with_78() {
    let registrations = serde_json::json!({
        "split": {"command": FAULT_HARNESS, "args": ["--state-version", "v{worker}"], "workers": 2},
    });
    let output = brain(&["check", "--agentloops", &registrations.to_string()]);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("split") && stderr.contains("state version"),
        "{stderr}"
    );
}

#[test]
fn usage_errors_exit_two() {
    assert_eq!(brain(&[]).status.code(), Some(2));
    assert_eq!(brain(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(brain(&["check", "--bogus"]).status.code(), Some(2));
    assert_eq!(
        brain(&["check", "--init-deadline", "soon"]).status.code(),
        Some(2)
    );
}

#[test]
fn the_embedded_default_runs_the_reference_harness_beside_the_binary() {
    let output = brain(&["check"]);
    let stdout = text(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout}{}",
        text(&output.stderr)
    );
    assert!(stdout.contains("reference") && stdout.contains("brain-reference-harness"));
}

#[test]
fn run_answers_hello_with_the_embedded_default() {
    let dir = temp_dir("cli-run");
    let data = dir.join("data");
    let output = brain(&["run", "--data-dir", &data.to_string_lossy(), "hello"]);
    let stdout = text(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout}{}",
        text(&output.stderr)
    );
    // The scripted provider echoes the user's text; the reference harness answers with it.
    assert_eq!(stdout.trim(), "hello");
}

#[test]
fn run_json_reports_the_outcome_and_a_script_drives_the_model() {
    let dir = temp_dir("cli-run-json");
    let script = dir.join("script.json");
    std::fs::write(
        &script,
        serde_json::json!([{
            "message": {"role": "assistant", "content": [{"type": "text", "text": "scripted answer"}]},
            "stop_reason": "end_turn"
        }])
        .to_string(),
    )
    .unwrap();
    let output = brain(&[
        "run",
        "--json",
        "--data-dir",
        &dir.join("data").to_string_lossy(),
        "--script",
        &script.to_string_lossy(),
        "ignored",
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(report["outcome"], "completed");
    assert_eq!(report["result"]["text"], "scripted answer");
    assert_eq!(report["result"]["rounds"], 1);
    assert!(report["session_id"].as_str().unwrap().starts_with("ses_"));
    assert!(report["sequence"].as_u64().is_some());
}

#[test]
fn run_fails_with_exit_one_and_the_error_code() {
    let registrations = serde_json::json!({
        "failing": {"command": FAULT_HARNESS, "configuration": {"fault": "fail", "code": "model_refused"}},
    });
    let data = temp_dir("cli-run-fail").join("data");
    let data = data.to_string_lossy();
    let output = brain(&[
        "run",
        "--data-dir",
        &data,
        "--agentloops",
        &registrations.to_string(),
        "x",
    ]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output.stderr).contains("model_refused"),
        "{}",
        text(&output.stderr)
    );
    // A session that is not in the data directory is refused.
    let output = brain(&[
        "run",
        "--data-dir",
        &data,
        "--session",
        "ses_00000000000000000000",
        "x",
    ]);
    assert_eq!(output.status.code(), Some(1));
    assert!(text(&output.stderr).contains("unknown_session"));
    assert_eq!(brain(&["run"]).status.code(), Some(2));
    assert_eq!(
        brain(&["run", "--session", "../etc", "x"]).status.code(),
        Some(2)
    );
}

fn run_in(data: &str, extra: &[&str], message: &str) -> std::process::Output {
    let mut args = vec!["run", "--data-dir", data];
    args.extend_from_slice(extra);
    args.push(message);
    brain(&args)
}

#[test]
fn run_continues_a_session_across_processes_in_one_data_directory() {
    let data = temp_dir("cli-continue").join("data");
    let data = data.to_string_lossy();
    let first = run_in(&data, &["--json"], "one");
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    let first: serde_json::Value = serde_json::from_slice(&first.stdout).unwrap();
    let id = first["session_id"].as_str().unwrap();
    let second = run_in(&data, &["--json", "--session", id], "two");
    assert_eq!(second.status.code(), Some(0), "{}", text(&second.stderr));
    let second: serde_json::Value = serde_json::from_slice(&second.stdout).unwrap();
    assert_eq!(second["session_id"], id);
    assert!(second["sequence"].as_u64() > first["sequence"].as_u64());
    assert_eq!(second["result"]["text"], "two");
}

#[test]
fn a_locked_data_directory_refuses_a_second_brain_with_78() {
    let dir = temp_dir("cli-lock").join("data");
    let mut config =
        brain::Config::new(brain::Registrations::from_vec(vec![fault("f", &[])]).unwrap());
    config.options = fast_options("cli-lock");
    config.options.data_dir = dir.clone();
    let holder = brain::Brain::start(config).expect("the first Brain");
    let output = run_in(&dir.to_string_lossy(), &[], "x");
    assert_eq!(output.status.code(), Some(78), "{}", text(&output.stderr));
    assert!(
        text(&output.stderr).contains("in use"),
        "{}",
        text(&output.stderr)
    );
    drop(holder);
    let output = run_in(&dir.to_string_lossy(), &[], "x");
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
}

#[test]
fn another_state_version_or_format_refuses_startup_with_78() {
    let data = temp_dir("cli-identity").join("data");
    let data = data.to_string_lossy().into_owned();
    let registrations = |version: &str| {
        serde_json::json!({"f": {"command": FAULT_HARNESS, "args": ["--state-version", version]}})
            .to_string()
    };
    let output = run_in(&data, &["--agentloops", &registrations("1")], "x");
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let output = run_in(&data, &["--agentloops", &registrations("2")], "x");
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("\"1\"") && stderr.contains("\"2\""),
        "{stderr}"
    );
    std::fs::write(format!("{data}/FORMAT"), "brain-data 0\n").unwrap();
    let output = run_in(&data, &["--agentloops", &registrations("1")], "x");
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("new data directory"), "{stderr}");
}

/// Spawns `brain serve` on an ephemeral port with `extra` arguments; returns the child (killed
/// and reaped if dropped armed) and its stderr lines.
fn spawn_serve(data: &str, extra: &[&str]) -> (KillOnDrop, crossbeam_channel::Receiver<String>) {
    use std::io::BufRead;
    let mut child = Command::new(BRAIN)
        .args(["serve", "--data-dir", data, "--listen", "127.0.0.1:0"])
        .args(extra)
        .env_remove("BRAIN_AGENTLOOPS")
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn brain serve");
    let stderr = child.stderr.take();
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        let Some(stderr) = stderr else { return };
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    (KillOnDrop(Some(child)), rx)
}

/// Waits (bounded by WAIT) for a log line containing `needle`; returns it.
fn wait_for_line(lines: &crossbeam_channel::Receiver<String>, needle: &str) -> String {
    loop {
        let line = lines
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("brain serve never logged {needle:?}"));
        if line.contains(needle) {
            return line;
        }
    }
}

/// Starts `brain serve` on an ephemeral port; returns the child and its address.
fn serve(data: &str, extra: &[&str]) -> (KillOnDrop, String) {
    let (child, lines) = spawn_serve(data, extra);
    let line = wait_for_line(&lines, "serving on http://");
    let address = line
        .split("serving on http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("an address")
        .to_owned();
    (child, address)
}

/// Kills and reaps the child when dropped (a failed assertion must not leave a server running),
/// unless it was disarmed.
struct KillOnDrop(Option<std::process::Child>);

impl KillOnDrop {
    fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, std::process::Child::id)
    }

    fn disarm(mut self) -> std::process::Child {
        self.0.take().expect("armed")
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits (bounded by WAIT) for the child to exit; returns its exit code.
fn wait_exit(mut child: std::process::Child) -> Option<i32> {
    let pid = child.id();
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let _ = tx.send(child.wait().map(|status| status.code()));
    });
    match rx.recv_timeout(WAIT) {
        Ok(status) => status.expect("wait for brain serve"),
        Err(_) => {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("brain serve did not exit within {WAIT:?}");
        }
    }
}

#[test]
fn serve_answers_probes_and_clients_and_stops_cleanly_on_sigterm() {
    let data = temp_dir("cli-serve").join("data");
    let data_arg = data.to_string_lossy().into_owned();
    let (child, address) = serve(&data_arg, &[]);
    assert_eq!(
        brain(&["ready", "--listen", &address]).status.code(),
        Some(0)
    );
    let list = brain(&[
        "sessions",
        "--listen",
        &address,
        "--data-dir",
        &data_arg,
        "list",
    ]);
    assert_eq!(list.status.code(), Some(0), "{}", text(&list.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(listed, serde_json::json!({"sessions": []}));
    let token = std::fs::read_to_string(data.join("operator.token")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(data.join("operator.token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(!token.trim().is_empty());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(wait_exit(child.disarm()), Some(0));
    // The lock was released: another Brain can use the directory.
    let output = run_in(&data_arg, &[], "after");
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    // And the probe now fails.
    assert_eq!(
        brain(&["ready", "--listen", &address]).status.code(),
        Some(1)
    );
}

#[test]
fn journal_prints_a_session_offline_beside_a_running_brain() {
    let dir = temp_dir("cli-journal").join("data");
    let mut config =
        brain::Config::new(brain::Registrations::from_vec(vec![fault("f", &[])]).unwrap());
    config.options = fast_options("cli-journal");
    config.options.data_dir = dir.clone();
    let running = brain::Brain::start(config).expect("a running Brain holds the directory");
    let session = running
        .create_session_json(br#"{"agentloop": {"name": "f"}}"#)
        .unwrap();
    let outcome = session
        .send(brain::protocol::harness::UserInput {
            content: vec![brain::protocol::harness::Block::text("x")],
        })
        .unwrap()
        .wait();
    assert_eq!(outcome.outcome, brain::OutcomeKind::Completed);
    let data = dir.to_string_lossy();
    let output = brain(&["journal", &data, session.id().as_str(), "--json"]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let kinds: Vec<String> = text(&output.stdout)
        .lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).expect("one JSON record");
            record["type"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(kinds.first().map(String::as_str), Some("session_created"));
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("activation_finished")
    );
    let human = brain(&["journal", &data, session.id().as_str()]);
    assert!(text(&human.stdout).contains("activation_started"));
    let unknown = brain(&["journal", &data, "ses_00000000000000000000"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(text(&unknown.stderr).contains("ses_00000000000000000000"));
    assert_eq!(
        brain(&["journal", &data, "../../etc"]).status.code(),
        Some(2)
    );
    // The running Brain was not disturbed.
    assert!(running.ready());
}

#[test]
fn a_signal_during_startup_aborts_it() {
    let data = temp_dir("cli-abort").join("data");
    let registrations = serde_json::json!({
        "slow": {"command": FAULT_HARNESS, "args": ["--never-init"]},
    });
    let (child, rx) = spawn_serve(
        &data.to_string_lossy(),
        &[
            "--init-deadline",
            "60s",
            "--agentloops",
            &registrations.to_string(),
        ],
    );
    // Startup is under way once the worker was started: it will never answer initialize.
    wait_for_line(&rx, "worker slow/0: started pid");
    let began = std::time::Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(wait_exit(child.disarm()), Some(0));
    assert!(
        began.elapsed() < std::time::Duration::from_secs(10),
        "startup was not aborted: {:?}",
        began.elapsed()
    );
    // The process has exited, so its stderr closes and the reader thread ends.
    let mut logged = Vec::new();
    while let Ok(line) = rx.recv_timeout(WAIT) {
        logged.push(line);
    }
    assert!(
        logged.iter().any(|l| l.contains("startup aborted")),
        "{logged:?}"
    );
}
