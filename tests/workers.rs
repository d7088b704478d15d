//! Worker supervision against real harness processes over real pipes: the initialize deadline,
//! protocol checks, crashes and respawns, quarantine, violations, process groups, the environment,
//! readiness and shutdown.

mod common;

use brain::status::{FailureReason, WorkerState};
use brain::{Brain, Config, Registrations};
use common::*;
use std::time::{Duration, Instant};

fn healthy(brain: &Brain, registration: &str, slot: u32) -> bool {
    brain
        .status()
        .worker(registration, slot)
        .is_some_and(|w| w.state == WorkerState::Healthy)
}

#[test]
fn a_correct_harness_becomes_healthy_and_reports_its_identity() {
    let brain = start(vec![fault("ok", &[])], fast_options("ok"));
    assert!(brain.ready());
    let status = brain.status();
    let worker = status.worker("ok", 0).expect("slot 0");
    assert_eq!(worker.state, WorkerState::Healthy);
    let init = worker.initialized.as_ref().expect("initialize answer");
    assert_eq!(init.identity.name, "brain-fault-harness");
    assert!(worker.init_latency_ms.is_some_and(|ms| ms > 0.0));
    assert!(worker.pid.is_some());
    assert_eq!(worker.restarts, 0);
}

#[test]
fn a_silent_harness_is_killed_at_the_init_deadline() {
    let mut options = fast_options("silent");
    options.init_deadline = Duration::from_millis(200);
    options.respawn_backoff = Duration::from_secs(60); // keep it down after the first failure
    let began = Instant::now();
    let brain = start(vec![fault("silent", &["--never-init"])], options);
    let elapsed = began.elapsed();
    assert!(
        elapsed >= Duration::from_millis(200),
        "startup waited for the deadline, not less: {elapsed:?}"
    );
    assert!(!brain.ready());
    let status = brain.status();
    let worker = status.worker("silent", 0).unwrap();
    assert_eq!(worker.state, WorkerState::Failed);
    let failure = worker.last_failure.as_ref().expect("a recorded failure");
    assert_eq!(failure.reason, FailureReason::InitTimeout);
    assert_eq!(failure.reason.code().as_str(), "init_timeout");
    let exit = failure.exit.expect("the process was reaped");
    assert!(exit.killed_by_brain, "{exit}");
}

#[test]
fn a_harness_speaking_another_protocol_is_refused() {
    let mut options = fast_options("protocol");
    options.respawn_backoff = Duration::from_secs(60);
    let brain = start(vec![fault("old", &["--wrong-protocol"])], options);
    assert!(!brain.ready());
    let status = brain.status();
    let failure = status
        .worker("old", 0)
        .unwrap()
        .last_failure
        .clone()
        .unwrap();
    assert_eq!(
        failure.reason,
        FailureReason::WrongProtocol("brain/harness/v0".into())
    );
}

#[test]
fn an_initialize_error_is_refused() {
    let mut options = fast_options("init-error");
    options.respawn_backoff = Duration::from_secs(60);
    let brain = start(vec![fault("err", &["--init-error"])], options);
    let status = brain.status();
    let failure = status
        .worker("err", 0)
        .unwrap()
        .last_failure
        .clone()
        .unwrap();
    assert!(
        matches!(failure.reason, FailureReason::InitError(_)),
        "{failure}"
    );
}

#[test]
fn a_crashed_worker_is_respawned_and_healthy_again() {
    let dir = temp_dir("crash-once");
    let marker = dir.join("crashed");
    let marker_arg = marker.to_string_lossy().into_owned();
    let brain = start(
        vec![fault(
            "crashy",
            &["--crash-after-ms", "300", "--crash-once", &marker_arg],
        )],
        fast_options("crash"),
    );
    let first_pid = brain.status().worker("crashy", 0).unwrap().pid.unwrap();
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("crashy", 0)
                .is_some_and(|w| w.restarts == 1 && w.state == WorkerState::Healthy)
        })
        .expect("respawned and healthy");
    let worker = status.worker("crashy", 0).unwrap();
    assert_ne!(worker.pid, Some(first_pid));
    let failure = worker.last_failure.as_ref().unwrap();
    assert_eq!(failure.reason, FailureReason::Exited);
    let exit = failure.exit.unwrap();
    assert_eq!(exit.reason, brain::worker::process::ExitReason::Code(3));
    assert!(!exit.killed_by_brain);
    assert!(marker.exists());
    // The crashed process was reaped: no zombie of ours remains.
    assert_eq!(proc_state(first_pid), None, "pid {first_pid} still exists");
}

/// This process's threads whose name starts with `prefix` (names are cut to 15 bytes by Linux).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|comm| comm.trim_end().starts_with(prefix))
        })
        .count()
}

#[test]
fn a_worker_costs_three_threads_and_a_respawn_leaves_none_behind() {
    let dir = temp_dir("three-threads");
    let marker = dir.join("crashed");
    let marker_arg = marker.to_string_lossy().into_owned();
    let brain = start(
        vec![
            fault(
                "t",
                &["--crash-after-ms", "300", "--crash-once", &marker_arg],
            )
            .workers(2),
        ],
        fast_options("three-threads"),
    );
    brain
        .wait_for(WAIT, |s| {
            (0..2).all(|slot| {
                s.worker("t", slot)
                    .is_some_and(|w| w.state == WorkerState::Healthy)
            }) && (0..2).any(|slot| s.worker("t", slot).is_some_and(|w| w.restarts == 1))
        })
        .expect("both healthy, one of them respawned after its crash");
    // Reader, writer (and feeder), stderr (and exit watcher): the crashed incarnation's threads
    // end on their own, so wait for the count to settle rather than for a fixed time.
    let deadline = Instant::now() + WAIT;
    let counts = loop {
        let counts = [threads_named("brain-w:t/0-"), threads_named("brain-w:t/1-")];
        if counts == [3, 3] || Instant::now() > deadline {
            break counts;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(counts, [3, 3], "threads per worker slot");
}

#[test]
fn a_slot_failing_past_the_budget_is_quarantined() {
    let mut options = fast_options("quarantine");
    options.restart_budget = 2;
    options.respawn_backoff = Duration::from_millis(10);
    let brain = start(
        vec![
            fault("doomed", &["--crash-after-ms", "30"]),
            fault("fine", &[]),
        ],
        options,
    );
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("doomed", 0)
                .is_some_and(|w| w.state == WorkerState::Quarantined)
        })
        .expect("quarantined");
    let doomed = status.worker("doomed", 0).unwrap();
    // Three failures (more than the budget of two): the first spawn and two respawns.
    assert_eq!(doomed.restarts, 2);
    assert_eq!(doomed.pid, None);
    // Quarantine is final until restart: nothing respawns it.
    assert!(
        brain
            .wait_for(Duration::from_millis(300), |s| {
                s.worker("doomed", 0).is_some_and(|w| w.restarts > 2)
            })
            .is_err()
    );
    // The other registration is unaffected and Brain stays ready.
    assert!(healthy(&brain, "fine", 0));
    assert!(brain.ready());
}

#[test]
fn garbage_lines_are_counted_but_do_not_kill_a_worker_below_the_limit() {
    let brain = start(
        vec![fault("noisy", &["--garbage", "6"])],
        fast_options("garbage"),
    );
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("noisy", 0).is_some_and(|w| w.violations == 6)
        })
        .expect("six violations counted");
    assert_eq!(
        status.worker("noisy", 0).unwrap().state,
        WorkerState::Healthy
    );
}

#[test]
fn ten_violations_within_a_minute_mark_the_worker_faulty() {
    let mut options = fast_options("faulty");
    options.respawn_backoff = Duration::from_secs(60);
    let brain = start(vec![fault("noisy", &["--garbage", "12"])], options);
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("noisy", 0)
                .is_some_and(|w| w.last_failure.is_some() && w.pid.is_none())
        })
        .expect("faulty worker taken down");
    let failure = status
        .worker("noisy", 0)
        .unwrap()
        .last_failure
        .clone()
        .unwrap();
    assert!(
        matches!(failure.reason, FailureReason::Faulty(_)),
        "{failure}"
    );
    assert!(failure.exit.unwrap().killed_by_brain);
}

#[test]
fn invalid_utf8_lines_are_violations() {
    let brain = start(
        vec![fault("binary", &["--invalid-utf8", "3"])],
        fast_options("utf8"),
    );
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("binary", 0).is_some_and(|w| w.violations == 3)
        })
        .expect("three violations counted");
    assert_eq!(
        status.worker("binary", 0).unwrap().state,
        WorkerState::Healthy
    );
}

/// Peak resident memory of this process, from /proc (kB).
fn peak_rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn a_100_mib_line_is_discarded_without_buffering_it() {
    let before = peak_rss_kb();
    let options = fast_options("overlong"); // the default 16 MiB line limit
    let limit_kb = (options.max_line_bytes / 1024) as u64;
    let brain = start(vec![fault("long", &["--overlong", "104857600"])], options);
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("long", 0).is_some_and(|w| w.violations == 1)
        })
        .expect("the over-long line counted once");
    assert_eq!(
        status.worker("long", 0).unwrap().state,
        WorkerState::Healthy
    );
    let grown = peak_rss_kb().saturating_sub(before);
    assert!(
        grown < limit_kb + 16 * 1024,
        "peak memory grew by {grown} kB reading a 100 MiB line with a {limit_kb} kB limit"
    );
}

#[test]
fn deadlines_fire_while_another_worker_floods_stdout() {
    let mut options = fast_options("flood");
    options.init_deadline = Duration::from_millis(300);
    options.respawn_backoff = Duration::from_secs(60);
    let began = Instant::now();
    let brain = start(
        vec![
            fault("flood", &["--flood"]),
            fault("silent", &["--never-init"]),
        ],
        options,
    );
    // Startup returned only after the silent worker's deadline fired, promptly despite the flood.
    let elapsed = began.elapsed();
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    let status = brain.status();
    assert_eq!(
        status
            .worker("silent", 0)
            .unwrap()
            .last_failure
            .as_ref()
            .unwrap()
            .reason,
        FailureReason::InitTimeout
    );
    assert_eq!(
        status.worker("flood", 0).unwrap().state,
        WorkerState::Healthy
    );
}

#[test]
fn a_kill_takes_the_whole_process_group_and_leaves_no_zombie() {
    let dir = temp_dir("group");
    let pidfile = dir.join("pids");
    let pidfile_arg = pidfile.to_string_lossy().into_owned();
    let brain = start(
        vec![fault("family", &["--grandchild", &pidfile_arg])],
        fast_options("group"),
    );
    let pids =
        std::fs::read_to_string(&pidfile).expect("the harness wrote its pids before answering");
    let mut pids = pids.split_whitespace().map(|p| p.parse::<u32>().unwrap());
    let (harness, grandchild) = (pids.next().unwrap(), pids.next().unwrap());
    assert_eq!(
        brain.status().worker("family", 0).unwrap().pid,
        Some(harness)
    );
    assert_eq!(parent_of(grandchild), Some(harness));
    assert!(!not_running(grandchild));
    brain.shutdown(Duration::ZERO);
    // The harness was our child and is reaped; the grandchild was killed with its group and
    // dies as soon as it runs (its new parent reaps it).
    assert_eq!(proc_state(harness), None, "harness {harness} not reaped");
    assert!(
        stops_within(grandchild, WAIT),
        "grandchild {grandchild} survived"
    );
}

#[test]
fn with_one_registration_broken_readiness_holds_and_the_broken_one_is_reported() {
    let mut options = fast_options("two-regs");
    options.respawn_backoff = Duration::from_secs(60);
    let brain = start(
        vec![
            fault("good", &[]).workers(2),
            fault("broken", &["--wrong-protocol"]),
        ],
        options,
    );
    assert!(brain.ready());
    let status = brain.status();
    assert!(status.registration("good").unwrap().available());
    let broken = status.registration("broken").unwrap();
    assert!(!broken.available());
    assert!(broken.workers[0].last_failure.is_some());
}

#[test]
fn the_harness_environment_holds_only_the_allow_list() {
    let brain = start(
        vec![fault("env", &[]).env("HARNESS_SETTING", "on")],
        fast_options("env"),
    );
    let pid = brain.status().worker("env", 0).unwrap().pid.unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let names: Vec<String> = environ
        .split(|&b| b == 0)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let entry = String::from_utf8_lossy(entry);
            entry
                .split_once('=')
                .map_or(entry.to_string(), |(k, _)| k.to_owned())
        })
        .collect();
    let allowed = [
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "TZ",
        "TMPDIR",
        "HARNESS_SETTING",
        "BRAIN_HARNESS_PROTOCOL",
        "BRAIN_REGISTRATION",
        "BRAIN_WORKER",
    ];
    for name in &names {
        assert!(allowed.contains(&name.as_str()), "harness inherited {name}");
    }
    for required in [
        "HARNESS_SETTING",
        "BRAIN_HARNESS_PROTOCOL",
        "BRAIN_REGISTRATION",
        "BRAIN_WORKER",
    ] {
        assert!(names.iter().any(|n| n == required), "{required} missing");
    }
    // This test process certainly has variables the harness must not see (cargo sets these).
    let ours: Vec<String> = std::env::vars().map(|(k, _)| k).collect();
    assert!(ours.iter().any(|k| !allowed.contains(&k.as_str())));
}

#[test]
fn workers_that_disagree_on_their_declarations_refuse_startup() {
    let registrations = Registrations::from_vec(vec![
        fault("split", &["--state-version", "v{worker}"]).workers(2),
    ])
    .unwrap();
    let mut config = Config::new(registrations);
    config.options = fast_options("disagree");
    let error = Brain::start(config).expect_err("disagreeing workers refuse startup");
    assert!(error.is_configuration());
    assert_eq!(error.registration(), Some("split"));
    let message = error.to_string();
    assert!(message.contains("state version"), "{message}");
    assert!(
        message.contains("v0") && message.contains("v1"),
        "{message}"
    );
}

#[test]
fn an_undeclared_deployment_configuration_key_refuses_startup() {
    let mut configuration = serde_json::Map::new();
    configuration.insert("speed".into(), serde_json::json!(3));
    let registrations = Registrations::from_vec(vec![
        fault("strict", &["--configuration-keys", "thinking"]).configuration(configuration),
    ])
    .unwrap();
    let mut config = Config::new(registrations);
    config.options = fast_options("undeclared");
    let error = Brain::start(config).expect_err("an undeclared key refuses startup");
    assert!(error.is_configuration());
    assert!(error.to_string().contains("\"speed\""), "{error}");
}

#[test]
fn shutdown_stops_healthy_workers_without_counting_failures() {
    let brain = start(
        vec![fault("calm", &[]).workers(2)],
        fast_options("shutdown"),
    );
    let pids: Vec<u32> = brain.status().registrations[0]
        .workers
        .iter()
        .map(|w| w.pid.unwrap())
        .collect();
    let began = Instant::now();
    brain.shutdown(Duration::from_secs(10));
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "a cooperative harness exits at once"
    );
    let status = brain.status();
    assert!(!status.ready());
    for worker in &status.registrations[0].workers {
        assert_eq!(worker.state, WorkerState::Stopped);
        assert_eq!(worker.restarts, 0);
        assert!(worker.last_failure.is_none());
    }
    for pid in pids {
        assert_eq!(proc_state(pid), None, "pid {pid} not reaped");
    }
}

#[test]
fn a_harness_ignoring_shutdown_is_killed_after_the_grace() {
    let brain = start(
        vec![fault("stubborn", &["--ignore-shutdown"])],
        fast_options("stubborn"),
    );
    let pid = brain.status().worker("stubborn", 0).unwrap().pid.unwrap();
    let began = Instant::now();
    brain.shutdown(Duration::from_millis(300));
    let elapsed = began.elapsed();
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    assert_eq!(proc_state(pid), None, "pid {pid} not reaped");
}

#[test]
fn dropping_brain_kills_every_worker() {
    let brain = start(
        vec![fault("dropped", &["--ignore-shutdown"])],
        fast_options("drop"),
    );
    let pid = brain.status().worker("dropped", 0).unwrap().pid.unwrap();
    drop(brain);
    assert_eq!(proc_state(pid), None, "pid {pid} not reaped");
}

fn kill_externally(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the worker");
}

#[test]
fn a_worker_killed_from_outside_is_reported_with_its_signal_and_respawned() {
    let brain = start(vec![fault("victim", &[])], fast_options("external-kill"));
    let pid = brain.status().worker("victim", 0).unwrap().pid.unwrap();
    kill_externally(pid);
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("victim", 0)
                .is_some_and(|w| w.restarts == 1 && w.state == WorkerState::Healthy)
        })
        .expect("respawned");
    let failure = status
        .worker("victim", 0)
        .unwrap()
        .last_failure
        .clone()
        .unwrap();
    let exit = failure.exit.unwrap();
    assert_eq!(exit.reason, brain::worker::process::ExitReason::Signal(9));
    assert!(!exit.killed_by_brain);
    assert!(failure.to_string().contains("SIGKILL"), "{failure}");
}

#[test]
fn a_crash_during_initialize_reports_the_exit_status_and_stderr_tail() {
    let mut options = fast_options("init-crash");
    options.respawn_backoff = Duration::from_secs(60);
    let brain = start(
        vec![fault(
            "fragile",
            &["--init-delay-ms", "5000", "--crash-after-ms", "50"],
        )],
        options,
    );
    let status = brain.status();
    let failure = status
        .worker("fragile", 0)
        .unwrap()
        .last_failure
        .clone()
        .unwrap();
    assert_eq!(failure.reason, FailureReason::Exited);
    assert_eq!(failure.reason.code().as_str(), "worker_lost");
    assert_eq!(
        failure.exit.unwrap().reason,
        brain::worker::process::ExitReason::Code(3)
    );
    assert!(
        failure.stderr_tail.contains("crashing with status 3"),
        "stderr tail: {:?}",
        failure.stderr_tail
    );
}

#[test]
fn a_respawned_worker_with_another_identity_is_quarantined_at_once() {
    let dir = temp_dir("identity-change");
    let version_file = dir.join("state-version");
    std::fs::write(&version_file, "1").unwrap();
    let version_arg = version_file.to_string_lossy().into_owned();
    let brain = start(
        vec![fault("shifty", &["--state-version-file", &version_arg])],
        fast_options("identity-change"),
    );
    let pid = brain.status().worker("shifty", 0).unwrap().pid.unwrap();
    std::fs::write(&version_file, "2").unwrap();
    kill_externally(pid);
    let status = brain
        .wait_for(WAIT, |s| {
            s.worker("shifty", 0)
                .is_some_and(|w| w.state == WorkerState::Quarantined)
        })
        .expect("quarantined");
    let worker = status.worker("shifty", 0).unwrap();
    assert_eq!(worker.restarts, 1, "quarantined at the first mismatch");
    let failure = worker.last_failure.as_ref().unwrap();
    assert!(
        matches!(&failure.reason, FailureReason::IdentityMismatch(why) if why.contains("\"1\"") && why.contains("\"2\"")),
        "{failure}"
    );
    assert_eq!(failure.reason.code().as_str(), "identity_mismatch");
}
