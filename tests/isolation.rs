//! Issue 24's attack matrix: hostile tools, chosen by a scripted model and run through the real
//! reference harness under a real `brain serve`, try to reach what a tool must never reach — the
//! operator token (by path, through `/proc/<brain pid>/…`), the journal, other sessions'
//! workspaces and native state, the data directory, the host's `/tmp`, Brain's HTTP listener and
//! other loopback ports — or to outlive, out-fork, out-write or outrun their call. Under the
//! `sandbox` driver (real bubblewrap) every attempt is contained and Brain's state is checked
//! unchanged afterwards; under the plain `local` driver the same matrix records what it does *not*
//! contain (docs/SECURITY.md keeps the table). Sandboxed workers (`"sandbox": true`) are tried the
//! same way. bubblewrap must be installed (scripts/test installs it): without it these tests fail.

mod common;

use common::server::*;
use common::*;
use serde_json::{Value, json};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A provider key in Brain's environment, which no tool may learn.
const PROVIDER_KEY: &str = "sk-isolation-4bd1e0c7f3a2";

/// One model-chosen tool call and how it ended.
struct Attempt {
    outcome: String,
    text: String,
}

/// A running `brain serve` with the reference harness and both tool drivers, and what the
/// attacks aim at.
struct Host {
    served: Served,
    dir: PathBuf,
    data: PathBuf,
    /// A session whose workspace and native state the attacks try to reach.
    victim: String,
    /// Whether `brain serve` runs as root.
    root: bool,
}

/// The uid `brain serve` runs as to be an ordinary user: nobody when the tests run as root (then
/// its data directory is nobody's), else the tests' own user.
fn ordinary_user(dir: &Path) -> Option<u32> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    std::os::unix::fs::chown(dir, Some(65534), Some(65534)).expect("give the test dir to nobody");
    Some(65534)
}

impl Host {
    /// Starts `brain serve` as root when the tests run as root, or (`as_user`) as an ordinary
    /// user.
    fn start(tag: &str, as_user: bool) -> Host {
        let dir = temp_dir(tag);
        let uid = if as_user { ordinary_user(&dir) } else { None };
        let data = dir.join("data");
        let served = Start {
            data: &data,
            registrations: json!({"reference": {"command": REFERENCE_HARNESS}}),
            extra: &[],
            token: None,
            env: &[("OPENAI_API_KEY", PROVIDER_KEY)],
            uid,
            umask: None,
        }
        .run();
        let root = uid.is_none() && unsafe { libc::geteuid() } == 0;
        let mut host = Host {
            root,
            served,
            dir,
            data,
            victim: String::new(),
        };
        // The victim keeps a secret in its workspace; its harness wrote its native state.
        let (victim, attempt) = host.run_tool(
            "sandbox",
            "echo victim-secret > secret; echo kept",
            json!({}),
        );
        assert_eq!(attempt.outcome, "ok", "{}", attempt.text);
        host.victim = victim;
        assert!(host.victim_file().is_file());
        assert!(host.victim_state().join("reference-state.json").is_file());
        host
    }

    fn victim_file(&self) -> PathBuf {
        self.data
            .join("workspaces")
            .join(&self.victim)
            .join("box")
            .join("secret")
    }

    fn victim_state(&self) -> PathBuf {
        self.data
            .join("agentloops")
            .join("reference")
            .join(&self.victim)
    }

    fn token(&self) -> &str {
        &self.served.token
    }

    /// Creates a session whose model calls tool `attack` once (running `script` with bash in an
    /// environment of `driver`, with `settings` merged into its configuration), sends it one
    /// message, and returns the session and how the call ended.
    fn run_tool(&mut self, driver: &str, script: &str, settings: Value) -> (String, Attempt) {
        let mut configuration = json!({"tools": {"attack": {
            "command": ["/bin/bash", "-c", script], "timeout_ms": 5000}}});
        if let (Some(target), Value::Object(extra)) = (configuration.as_object_mut(), settings) {
            for (key, value) in extra {
                if key == "timeout_ms" {
                    target["tools"]["attack"]["timeout_ms"] = value;
                } else {
                    target.insert(key, value);
                }
            }
        }
        let request = json!({
            "agentloop": {"name": "reference"},
            "model": {"provider": "scripted", "name": "default", "options": {"script": [
                {"message": {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "tu_1", "name": "attack", "input": {}}]},
                 "stop_reason": "tool_use", "usage": {}},
                {"message": {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
                 "stop_reason": "end_turn", "usage": {}}]}},
            "tools": [{"name": "attack", "description": "runs a command",
                       "input_schema": {"type": "object"}, "placements": ["box"]}],
            "environments": [{"name": "box", "driver": driver, "configuration": configuration}],
        });
        let created = self.served.call("POST", "/v1/sessions", Some(request));
        let created = created.expect(201, None).json();
        let id = created["session_id"].as_str().expect("an id").to_owned();
        let message = json!({"content": [{"type": "text", "text": "go"}]});
        let reply = self
            .served
            .call(
                "POST",
                &format!("/v1/sessions/{id}/messages"),
                Some(message),
            )
            .expect(200, None)
            .json();
        assert_eq!(reply["outcome"], "completed", "{reply}");
        let events = self
            .served
            .call("GET", &format!("/v1/sessions/{id}/events?after=0"), None)
            .expect(200, None)
            .json();
        let finished = events["events"]
            .as_array()
            .expect("events")
            .iter()
            .find(|event| event["type"] == "tool_call_finished")
            .unwrap_or_else(|| panic!("no tool_call_finished in {events}"))
            .clone();
        let result = &finished["data"]["result"];
        let text = result["content"]
            .as_array()
            .map(|blocks| {
                blocks
                    .iter()
                    .filter_map(|block| block["text"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default();
        let outcome = finished["data"]["outcome"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        (id, Attempt { outcome, text })
    }

    /// Brain's own files, to check that nothing an attack did changed them.
    fn snapshot(&self) -> Vec<(PathBuf, u64)> {
        let mut files = Vec::new();
        walk(&self.data, &mut files);
        files.retain(|(path, _)| {
            // The journal grows with every record the attacks' own sessions write.
            !path.starts_with(self.data.join("journal"))
                && !path.starts_with(self.data.join("workspaces"))
                && path.parent() != Some(&self.data.join("agentloops").join("reference"))
                && !path
                    .to_string_lossy()
                    .contains("/agentloops/reference/ses_")
        });
        files
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.served.terminate(WAIT);
        if !std::thread::panicking() {
            // Tools ran as nobody: the host's root removes what they wrote.
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("kept {} for inspection", self.dir.display());
        }
    }
}

fn walk(dir: &Path, out: &mut Vec<(PathBuf, u64)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        match entry.metadata() {
            Ok(meta) if meta.is_dir() => walk(&path, out),
            Ok(meta) => out.push((path, meta.len())),
            Err(_) => {}
        }
    }
}

/// The pids whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<u32> {
    all_pids()
        .into_iter()
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmdline).contains(marker) && !not_running(*pid)
        })
        .collect()
}

/// Waits until no live process carries `marker`, within `limit`.
fn gone_within(marker: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if processes_with(marker).is_empty() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
}

/// Whether an attack escaped, from its output and the host's state after it.
type Verdict = Box<dyn Fn(&Host, &Attempt) -> bool>;

/// One attack of the matrix: a script for the tool, and whether it escaped (from its output and
/// the host's state afterwards).
struct Attack {
    name: &'static str,
    script: String,
    settings: Value,
    escaped: Verdict,
}

fn matrix(host: &Host, listener_port: u16, unique: &str) -> Vec<Attack> {
    let data = host.data.display().to_string();
    let pid = host.served.pid;
    let token = host.token().to_owned();
    let victim = host.victim.clone();
    let has =
        |needle: String| -> Verdict { Box::new(move |_, attempt| attempt.text.contains(&needle)) };
    let outside = host.dir.join(format!("outside-{unique}"));
    let host_tmp = std::env::temp_dir().join(format!("brain-isolation-{unique}"));
    // The sleeps' own command lines are `sleep\0<marker>`: the marker is the number.
    let marker = format!("3{unique}");
    let daemon = format!("sleep {marker}");
    vec![
        Attack {
            name: "read operator.token by path",
            script: format!("cat {data}/operator.token; cat ../../../operator.token"),
            settings: json!({}),
            escaped: has(token.clone()),
        },
        Attack {
            name: "read operator.token through /proc/<brain>/cwd and /root",
            script: format!(
                "cat /proc/{pid}/root{data}/operator.token; ls /proc/{pid}/cwd/ && echo CWD-LISTED"
            ),
            settings: json!({}),
            escaped: Box::new({
                let token = token.clone();
                move |_, attempt| {
                    attempt.text.contains(&token) || attempt.text.contains("CWD-LISTED")
                }
            }),
        },
        Attack {
            name: "read Brain's environment through /proc/<brain>/environ",
            script: format!("tr '\\0' '\\n' < /proc/{pid}/environ"),
            settings: json!({}),
            escaped: has(PROVIDER_KEY.to_owned()),
        },
        Attack {
            name: "read Brain's descriptors through /proc/<brain>/fd",
            // Escaped if any descriptor's target was read: `ls` itself fails when one of
            // Brain's descriptors closes between its listing and its reading of the link.
            script: format!("ls -l /proc/{pid}/fd/ | grep -q -- ' -> ' && echo FDS-LISTED"),
            settings: json!({}),
            escaped: has("FDS-LISTED".to_owned()),
        },
        Attack {
            name: "read a journal segment",
            script: format!(
                "ls {data}/journal && echo JOURNAL-LISTED; cat {data}/journal/* | head -c 1000 | grep -a -c session"
            ),
            settings: json!({}),
            escaped: has("JOURNAL-LISTED".to_owned()),
        },
        Attack {
            name: "read and write another session's workspace",
            script: format!(
                "cat {data}/workspaces/{victim}/box/secret; echo pwned > {data}/workspaces/{victim}/box/secret; ls {data}/workspaces"
            ),
            settings: json!({}),
            escaped: Box::new(|host, attempt| {
                attempt.text.contains("victim-secret")
                    || std::fs::read_to_string(host.victim_file()).unwrap_or_default()
                        != "victim-secret\n"
            }),
        },
        Attack {
            name: "read and write another session's native state",
            script: format!(
                "cat {data}/agentloops/reference/{victim}/reference-state.json && echo STATE-READ; touch {data}/agentloops/reference/{victim}/planted"
            ),
            settings: json!({}),
            escaped: Box::new(|host, attempt| {
                attempt.text.contains("STATE-READ") || host.victim_state().join("planted").exists()
            }),
        },
        Attack {
            name: "write outside its workspace (data directory, host /tmp)",
            script: format!(
                "touch {data}/planted; touch {}; touch {}; echo tried",
                outside.display(),
                host_tmp.display()
            ),
            settings: json!({}),
            escaped: Box::new(move |host, _| {
                let escaped =
                    host.data.join("planted").exists() || outside.exists() || host_tmp.exists();
                let _ = std::fs::remove_file(host.data.join("planted"));
                let _ = std::fs::remove_file(&outside);
                let _ = std::fs::remove_file(&host_tmp);
                escaped
            }),
        },
        Attack {
            name: "connect to Brain's HTTP listener",
            script: format!(
                "exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET /v1/sessions HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer {token}\\r\\nConnection: close\\r\\n\\r\\n' >&3 && head -c 12 <&3 && echo CONNECTED",
                port = host.served.addr.port()
            ),
            settings: json!({}),
            escaped: has("CONNECTED".to_owned()),
        },
        Attack {
            name: "connect to another loopback port",
            script: format!("exec 3<>/dev/tcp/127.0.0.1/{listener_port} && echo CONNECTED"),
            settings: json!({}),
            escaped: has("CONNECTED".to_owned()),
        },
        Attack {
            name: "leave a daemon behind (setsid and a double fork)",
            script: format!(
                // The tool ends only once the setsid daemon is in a session of its own.
                "mkfifo up; setsid sh -c 'echo up > up; exec {daemon}' </dev/null >/dev/null 2>&1 & \
                 read -r _ < up; ( ( {daemon} </dev/null >/dev/null 2>&1 & ) & ); echo forked"
            ),
            settings: json!({}),
            escaped: Box::new(move |_, _| {
                let survived = !gone_within(&marker, Duration::from_secs(3));
                for pid in processes_with(&marker) {
                    signal(pid, nix::sys::signal::Signal::SIGKILL);
                }
                survived
            }),
        },
    ]
}

/// The attacks only the sandbox faces: without its limits they would harm the host running the
/// tests (a fork bomb) or only restate that `local` limits nothing.
fn limit_matrix(unique: &str) -> Vec<Attack> {
    let marker = format!("bomb{}", &unique[..unique.len().min(6)]);
    vec![
        Attack {
            name: "fork bomb",
            script: format!(
                "{marker}() {{ {marker} | {marker} & }}; {marker}; sleep 1; echo survived"
            ),
            settings: json!({"limits": {"processes": 48}, "timeout_ms": 4000}),
            escaped: Box::new(move |_, attempt| {
                // Every process it made is gone once the call ended, and the call did end.
                !gone_within(&marker, Duration::from_secs(5))
                    || !matches!(attempt.outcome.as_str(), "ok" | "error" | "timeout")
            }),
        },
        Attack {
            name: "fill the disk past the file-size limit",
            script: "head -c 8388608 /dev/zero > big".to_owned(),
            settings: json!({"limits": {"file_size_bytes": 1048576}}),
            escaped: Box::new(|host, attempt| {
                let session = host
                    .data
                    .join("workspaces")
                    .read_dir()
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|entry| entry.path().join("box").join("big"))
                    .filter_map(|path| std::fs::metadata(path).ok())
                    .map(|meta| meta.len())
                    .max()
                    .unwrap_or(0);
                session > 1_048_576 || attempt.outcome == "ok"
            }),
        },
        Attack {
            name: "run past its deadline",
            script: "exec sleep 60".to_owned(),
            settings: json!({"timeout_ms": 1000}),
            escaped: Box::new(|_, attempt| attempt.outcome != "timeout"),
        },
    ]
}

/// Runs `attacks` under `driver`; the name and whether it escaped, for each.
fn run_matrix(host: &mut Host, driver: &str, attacks: Vec<Attack>) -> Vec<(&'static str, bool)> {
    let before = host.snapshot();
    let mut results = Vec::new();
    for attack in attacks {
        let started = Instant::now();
        let (_, attempt) = host.run_tool(driver, &attack.script, attack.settings.clone());
        let escaped = (attack.escaped)(host, &attempt);
        eprintln!(
            "{driver}: {:<60} {} ({} in {} ms): {}",
            attack.name,
            if escaped { "ESCAPED" } else { "contained" },
            attempt.outcome,
            started.elapsed().as_millis(),
            attempt
                .text
                .chars()
                .take(200)
                .collect::<String>()
                .replace('\n', " | ")
        );
        results.push((attack.name, escaped));
    }
    if driver == "sandbox" {
        assert_eq!(
            host.snapshot(),
            before,
            "Brain's files changed under the attacks"
        );
        assert_eq!(
            std::fs::read_to_string(host.victim_file()).expect("the victim's secret"),
            "victim-secret\n"
        );
    }
    results
}

/// Digits no other process's command line carries.
fn unique() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{}{nanos}", std::process::id())
}

/// The whole matrix under the sandbox driver: every attack contained.
fn sandbox_contains_every_attack(as_user: bool) {
    let mut host = Host::start("iso-sandbox", as_user);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("address").port();
    let unique = unique();
    let mut attacks = matrix(&host, port, &unique);
    attacks.extend(limit_matrix(&unique));
    let tried = attacks.len();
    let results = run_matrix(&mut host, "sandbox", attacks);
    let escapes: Vec<_> = results.iter().filter(|(_, escaped)| *escaped).collect();
    eprintln!(
        "sandbox (brain as {}): attacks tried {tried}, escapes {}",
        if host.root {
            "root"
        } else {
            "an ordinary user"
        },
        escapes.len()
    );
    assert!(escapes.is_empty(), "escaped the sandbox: {escapes:?}");
    assert!(
        listener.accept().is_err(),
        "a sandboxed tool reached the test's loopback listener"
    );
}

/// The matrix under the local driver: everything escapes but Brain's own /proc entries, which
/// only a tool running as root reads (Brain is non-dumpable).
fn local_contains_only_brains_proc_entries(as_user: bool) {
    let mut host = Host::start("iso-local", as_user);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let port = listener.local_addr().expect("address").port();
    let unique = unique();
    let attacks = matrix(&host, port, &unique);
    let results = run_matrix(&mut host, "local", attacks);
    for (name, escaped) in results {
        let expected = if name.contains("/proc/<brain>") {
            host.root
        } else {
            true
        };
        assert_eq!(
            escaped, expected,
            "local driver, {name}: docs/SECURITY.md's table says {expected}"
        );
    }
}

#[test]
fn every_attack_is_contained_by_the_sandbox_driver() {
    sandbox_contains_every_attack(false);
}

#[test]
fn every_attack_is_contained_by_the_sandbox_driver_with_brain_as_an_ordinary_user() {
    sandbox_contains_every_attack(true);
}

#[test]
fn the_local_driver_contains_none_of_it_as_docs_security_says() {
    local_contains_only_brains_proc_entries(false);
}

#[test]
fn the_local_driver_with_brain_as_an_ordinary_user_keeps_only_brains_proc_entries() {
    local_contains_only_brains_proc_entries(true);
}

#[test]
fn workspaces_are_per_session_and_go_with_the_sessions_deletion() {
    let mut host = Host::start("iso-delete", false);
    let (id, attempt) = host.run_tool("sandbox", "pwd; ls -A; echo mine > file", json!({}));
    assert_eq!(attempt.outcome, "ok", "{}", attempt.text);
    // Its own workspace, at the fixed path, holding nothing of the victim's.
    assert_eq!(attempt.text.trim(), "/workspace");
    let workspace = host.data.join("workspaces").join(&id);
    let state = host.data.join("agentloops").join("reference").join(&id);
    assert!(workspace.join("box").join("file").is_file());
    assert!(state.is_dir());
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&workspace)
        .expect("workspace")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    host.served
        .call("POST", &format!("/v1/sessions/{id}/close"), None)
        .expect(200, None);
    host.served
        .call("DELETE", &format!("/v1/sessions/{id}"), None)
        .expect(204, None);
    assert!(!workspace.exists(), "the workspace outlived the deletion");
    assert!(!state.exists(), "the native state outlived the deletion");
    assert!(
        host.victim_file().is_file(),
        "another session's workspace went too"
    );
}

#[test]
fn a_sandboxed_worker_sees_its_state_root_and_nothing_else_of_the_data_directory() {
    let dir = temp_dir("iso-worker");
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    let state_root = data.join("agentloops").join("boxed");
    // The worker looks around before becoming the reference harness.
    let probe = format!(
        "cd /; {{ cat {d}/operator.token && echo TOKEN-READ; ls {d}/journal && echo JOURNAL-LISTED; \
         ls {d}/workspaces && echo WORKSPACES-LISTED; grep -l {key} /proc/*/environ && echo ENV-FOUND; \
         touch {d}/planted && echo PLANTED; echo alive; }} > {s}/probe.txt 2>&1; exec {h}",
        d = data.display(),
        s = state_root.display(),
        key = PROVIDER_KEY,
        h = REFERENCE_HARNESS
    );
    let mut served = Start {
        data: &data,
        registrations: json!({"boxed": {"command": "/bin/sh", "args": ["-c", probe], "sandbox": true}}),
        extra: &[],
        token: None,
        env: &[("OPENAI_API_KEY", PROVIDER_KEY)],
        uid: None,
        umask: None,
    }
    .run();
    let seen = std::fs::read_to_string(state_root.join("probe.txt")).expect("the probe's report");
    assert!(seen.contains("alive"), "{seen}");
    for leak in [
        "TOKEN-READ",
        "JOURNAL-LISTED",
        "WORKSPACES-LISTED",
        "ENV-FOUND",
        "PLANTED",
    ] {
        assert!(
            !seen.contains(leak),
            "the sandboxed worker got {leak}: {seen}"
        );
    }
    assert!(!served.token.is_empty());
    assert!(!data.join("planted").exists());
    // And it still serves sessions, writing their native state.
    let created = served
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "boxed"}})),
        )
        .expect(201, None)
        .json();
    let id = created["session_id"].as_str().expect("an id").to_owned();
    let reply = served
        .call(
            "POST",
            &format!("/v1/sessions/{id}/messages"),
            Some(json!({"content": [{"type": "text", "text": "hello"}]})),
        )
        .expect(200, None)
        .json();
    assert_eq!(reply["outcome"], "completed", "{reply}");
    assert_eq!(reply["result"]["text"], "hello");
    assert!(state_root.join(&id).join("reference-state.json").is_file());
    served.terminate(WAIT);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn where_bubblewrap_cannot_sandbox_brain_refuses_to_start_rather_than_run_tools_unconfined() {
    let dir = temp_dir("iso-refuse");
    // A host whose bubblewrap cannot create namespaces (as in some containers): the first
    // `bwrap` on PATH fails the way bubblewrap does there.
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let fake = bin.join("bwrap");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n",
    )
    .expect("write the stand-in");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!("{}:/usr/local/bin:/usr/bin:/bin", bin.display());
    let serve = |extra: &[&str]| {
        let mut command = std::process::Command::new(BRAIN);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir.join("data"))
            .args([
                "--agentloops",
                &json!({"r": {"command": REFERENCE_HARNESS}}).to_string(),
            ])
            .args(extra)
            .env("PATH", &path);
        command
    };
    let refused = run_bounded(&mut serve(&[]));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("the sandbox driver cannot run here")
            && stderr.contains("No permissions to create new namespace")
            && stderr.contains("--no-sandbox"),
        "{stderr}"
    );
    // A sandboxed registration is refused the same way, even with --no-sandbox.
    let boxed = json!({"r": {"command": REFERENCE_HARNESS, "sandbox": true}}).to_string();
    let mut command = serve(&["--no-sandbox"]);
    command.args(["--agentloops", &boxed]);
    let refused = run_bounded(&mut command);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("runs its workers sandboxed"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
