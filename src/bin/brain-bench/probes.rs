//! Memory, startup and thread counts, each measured in a fresh child process hosting Brain
//! (`__memory`, `__startup`, `__threads`), so that earlier arms leave nothing in its heap.

use crate::arms::{self, Harness, Setup};
use brain::effects::Effects;
use brain::session::SessionId;
use brain::{ApiError, Brain, Session, SessionInfo, Storage};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Private memory of this process, bytes: `Private_Clean + Private_Dirty + Private_Hugetlb` of
/// `/proc/self/smaps_rollup`.
pub fn private_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    text.lines()
        .filter(|line| line.starts_with("Private_"))
        .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}

/// Bytes the allocator has handed out and not had back (glibc's `mallinfo2`: `uordblks`, the
/// arenas' chunks in use, plus `hblkhd`, the chunks mapped on their own): the live heap, which
/// private memory exceeds by what the allocator keeps after frees. `None` off glibc.
pub fn heap_in_use() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments, only reads the allocator's own counters (under
        // its arena locks) and returns a plain struct by value; glibc has it since 2.33.
        let info = unsafe { libc::mallinfo2() };
        Some((info.uordblks + info.hblkhd) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// This process's threads by name, digits replaced by `N` (`brain-callback-N`: 64).
pub fn thread_names() -> Value {
    let mut names = std::collections::BTreeMap::<String, u64>::new();
    for entry in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        let mut name = String::new();
        for c in comm.trim().chars() {
            if c.is_ascii_digit() {
                if !name.ends_with('N') {
                    name.push('N');
                }
            } else {
                name.push(c);
            }
        }
        *names.entry(name).or_default() += 1;
    }
    json!(names)
}

/// Threads of this process: the entries of `/proc/self/task`.
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|entries| entries.count())
        .unwrap_or(0)
}

fn setup_from_env() -> Result<Setup, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    Ok(Setup {
        reference: None,
        root: std::env::temp_dir(),
        exe,
    })
}

/// Runs this binary as `args` and parses the last line of its stdout as JSON.
pub fn child_json(args: &[&str]) -> Result<Value, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let output = Command::new(exe)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running {}: {e}", args[0]))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    if !output.status.success() {
        return Err(format!("{} failed ({}): {last}", args[0], output.status));
    }
    serde_json::from_str(last).map_err(|e| format!("{}: bad output {last:?}: {e}", args[0]))
}

/// The minimal create-session request of the bench harness (mode `none`).
pub fn minimal_request() -> Value {
    json!({"agentloop": {"name": "bench", "configuration": {"bench": "none"}}})
}

/// A realistic create-session request for the bench harness (mode `none`), shaped like the load
/// test's (tests/soak.rs, `session_request`): a configuration with a list of callbacks and a
/// fault plan, an environment grant, a model, a system prompt, a tool and an environment of the
/// `local` driver with its tool's command — about 800 bytes of JSON. `nonce` makes it unique.
pub fn realistic_request(nonce: &str) -> Value {
    let script =
        "read -r _; d=\"${PWD%/*}\"; printf '%s\\n' \"${d##*/}\" >> '/tmp/brain-bench-tools.log'";
    json!({
        "agentloop": {"name": "bench",
                      "configuration": {
                          "bench": "none",
                          "fault": {"kind": "none", "after_calls": 0, "delay_ms": 0},
                          "calls": [
                              {"method": "kv.put", "input": {"key": "k", "value": nonce}},
                              {"method": "model", "input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}},
                              {"method": "tool", "input": {"name": "count", "input": {}}},
                              {"method": "emit", "input": {"type": "progress", "data": {}}},
                          ],
                      },
                      "environments": [{"environment": "box", "permissions": ["read", "call"]}]},
        "model": {"provider": "scripted", "name": "stand-in"},
        "system": nonce,
        "tools": [{"name": "count", "description": "counts its calls", "input_schema": {"type": "object"},
                   "placements": ["box"]}],
        "environments": [{"name": "box", "driver": "local",
                          "configuration": {"tools": {"count": {"command": ["sh", "-c", script]}}}}],
    })
}

/// The request of the memory probes: `realistic` or the minimal one.
fn request_for(kind: &str, n: usize) -> Value {
    if kind == "realistic" {
        realistic_request(&format!("load-{n:08}"))
    } else {
        minimal_request()
    }
}

/// Creates `count` sessions of the bench harness (mode `none`) from `threads` threads with
/// requests of `kind` (`minimal` or `realistic`), runs one activation in each, and returns their
/// ids.
fn open_sessions(
    brain: &Brain,
    count: usize,
    threads: usize,
    kind: &str,
) -> Result<Vec<SessionId>, String> {
    let ids = Mutex::new(Vec::with_capacity(count));
    let failure = Mutex::new(None);
    std::thread::scope(|scope| {
        for t in 0..threads {
            let mine = count / threads + usize::from(t < count % threads);
            let (ids, failure) = (&ids, &failure);
            scope.spawn(move || {
                for i in 0..mine {
                    let request = request_for(kind, t * count + i);
                    let opened = arms::create(brain, &request).and_then(|session| {
                        let activation = session
                            .send(arms::text("{}"))
                            .map_err(|e| format!("send: {e}"))?;
                        arms::completed(&activation.wait())?;
                        Ok(session.id().clone())
                    });
                    match opened {
                        Ok(id) => ids.lock().push(id),
                        Err(error) => {
                            failure.lock().get_or_insert(error);
                            return;
                        }
                    }
                }
            });
        }
    });
    match failure.into_inner() {
        Some(error) => Err(error),
        None => Ok(ids.into_inner()),
    }
}

/// A session's lifecycle call: [`Session::passivate`] or [`Session::close`].
type LifecycleCall = fn(&Session) -> Result<SessionInfo, ApiError>;

/// Makes the lifecycle call `what` (`call`) on every session of `ids` from `threads` threads.
fn every(
    brain: &Brain,
    ids: &[SessionId],
    threads: usize,
    (what, call): (&str, LifecycleCall),
) -> Result<(), String> {
    let each = |id: &SessionId| {
        call(&brain.session(id))
            .map(drop)
            .map_err(|error| format!("{what}: {error}"))
    };
    let failure = Mutex::new(None);
    let chunk = ids.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        for part in ids.chunks(chunk) {
            let (failure, each) = (&failure, &each);
            scope.spawn(move || {
                for id in part {
                    if let Err(error) = each(id) {
                        failure.lock().get_or_insert(error);
                        return;
                    }
                }
            });
        }
    });
    match failure.into_inner() {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

const PASSIVATE: (&str, LifecycleCall) = ("passivate", Session::passivate);
const CLOSE: (&str, LifecycleCall) = ("close", Session::close);

/// Memory needs settling: freed pages are not returned at once, and threads that just ended are
/// still being torn down.
fn settle() {
    std::thread::sleep(Duration::from_millis(300));
}

/// The Brain the memory and startup probes measure: the durable journal in `dir`, two bench
/// workers.
fn probe_brain(setup: &Setup, dir: &Path) -> Result<Brain, String> {
    arms::start_brain(
        setup,
        Harness::Bench,
        2,
        Storage::DataDir,
        dir,
        Effects::default(),
    )
}

/// `__memory DIR COUNT [KIND]`: in a Brain with the durable journal in DIR (two bench workers),
/// the private memory after a warm-up (M0), after COUNT sessions were created with requests of
/// KIND (`minimal`, the default, or `realistic`) and ran one activation each (M1, idle and
/// open), and after they were all passivated (M2); for `realistic`, also after they were all
/// closed (M3: a closed session should cost what a passivated one does). Leaves the sessions in
/// DIR (the minimal ones passivated) for the startup probe. Prints one JSON object.
pub fn memory_main(args: &[String]) -> Result<(), String> {
    let usage = "usage: __memory DIR COUNT [minimal|realistic]";
    let dir = Path::new(args.first().ok_or(usage)?);
    let count: usize = args.get(1).and_then(|n| n.parse().ok()).ok_or(usage)?;
    let kind = args.get(2).map(String::as_str).unwrap_or("minimal");
    if kind != "minimal" && kind != "realistic" {
        return Err(usage.into());
    }
    let threads = 16;
    let setup = setup_from_env()?;
    let brain = probe_brain(&setup, dir)?;
    // The same work on a few sessions first, so that the allocator's arenas, the threads' stacks
    // and the journal's buffers exist before the baseline.
    // They are deleted afterwards, so the directory holds exactly COUNT sessions.
    let warm = open_sessions(&brain, 256.min(count), threads, kind)?;
    every(&brain, &warm, threads, PASSIVATE)?;
    for id in &warm {
        let session = brain.session(id);
        session.close().map_err(|e| format!("close: {e}"))?;
        session.delete().map_err(|e| format!("delete: {e}"))?;
    }
    drop(warm);
    settle();
    let before = private_bytes();
    let heap_before = heap_in_use();
    let began = Instant::now();
    let ids = open_sessions(&brain, count, threads, kind)?;
    let open_seconds = began.elapsed().as_secs_f64();
    settle();
    let open = private_bytes();
    let heap_open = heap_in_use();
    let began = Instant::now();
    every(&brain, &ids, threads, PASSIVATE)?;
    let passivate_seconds = began.elapsed().as_secs_f64();
    settle();
    let passivated = private_bytes();
    let heap_passivated = heap_in_use();
    let closed = if kind == "realistic" {
        every(&brain, &ids, threads, CLOSE)?;
        settle();
        Some((private_bytes(), heap_in_use()))
    } else {
        None
    };
    brain.shutdown(Duration::from_secs(5));
    let per = |after: u64| (after as f64 - before as f64) / count as f64;
    let heap_per = |after: Option<u64>| Some((after? as f64 - heap_before? as f64) / count as f64);
    println!(
        "{}",
        json!({
            "sessions": count,
            "request": kind,
            "request_bytes": request_for(kind, 0).to_string().len(),
            "private_before": before,
            "private_open": open,
            "private_passivated": passivated,
            "open_idle_bytes_per_session": per(open),
            "passivated_bytes_per_session": per(passivated),
            "heap_before": heap_before,
            "heap_open_bytes_per_session": heap_per(heap_open),
            "heap_passivated_bytes_per_session": heap_per(heap_passivated),
            "closed_bytes_per_session": closed.map(|(private, _)| per(private)),
            "heap_closed_bytes_per_session": closed.and_then(|(_, heap)| heap_per(heap)),
            "open_seconds": open_seconds,
            "passivate_seconds": passivate_seconds,
            "bench_bytes_per_session": std::mem::size_of::<SessionId>() + 32,
        })
    );
    Ok(())
}

/// `__startup DIR`: times `Brain::start` (two bench workers, the durable journal in DIR) to ready,
/// prints `ready` the moment it is ready (the parent times exec to that line), then one JSON
/// object: the start time, the workers' initialize latencies, the sessions recovered and the
/// private memory.
pub fn startup_main(args: &[String]) -> Result<(), String> {
    let dir = Path::new(args.first().ok_or("usage: __startup DIR")?);
    let setup = setup_from_env()?;
    let began = Instant::now();
    let brain = probe_brain(&setup, dir)?;
    let start_ms = began.elapsed().as_secs_f64() * 1000.0;
    println!("ready");
    let init_ms: Vec<f64> = brain
        .status()
        .registrations
        .iter()
        .flat_map(|registration| registration.workers.iter())
        .filter_map(|worker| worker.init_latency_ms)
        .collect();
    settle();
    let private = private_bytes();
    let sessions = brain
        .sessions()
        .map_err(|e| format!("sessions: {e}"))?
        .len();
    brain.shutdown(Duration::from_secs(5));
    println!(
        "{}",
        json!({"start_ms": start_ms, "init_ms": init_ms, "sessions": sessions, "private": private})
    );
    Ok(())
}

/// Runs `__startup DIR` and adds the time from exec to its `ready` line.
pub fn startup(dir: &Path) -> Result<Value, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let began = Instant::now();
    let mut child = Command::new(exe)
        .arg("__startup")
        .arg(dir)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running __startup: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut exec_ms = None;
    let mut last = String::new();
    for line in lines.by_ref() {
        let line = line.map_err(|e| e.to_string())?;
        if line == "ready" {
            exec_ms = Some(began.elapsed().as_secs_f64() * 1000.0);
        } else {
            last = line;
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("__startup failed ({status}): {last}"));
    }
    let mut value: Value =
        serde_json::from_str(&last).map_err(|e| format!("__startup: bad output {last:?}: {e}"))?;
    value["exec_ms"] = json!(exec_ms);
    Ok(value)
}

/// `__threads DIR SESSIONS WAIT_MS`: this process's threads with no Brain, with Brain (durable
/// journal) idle at 1, 2, 4 and 8 bench workers, and at 2 workers with SESSIONS open sessions and
/// with 64 activations running (each waits WAIT_MS in the harness). Prints one JSON object.
pub fn threads_main(args: &[String]) -> Result<(), String> {
    let usage = "usage: __threads DIR SESSIONS WAIT_MS";
    let root = Path::new(args.first().ok_or(usage)?);
    let sessions: usize = args.get(1).and_then(|n| n.parse().ok()).ok_or(usage)?;
    let wait_ms: u64 = args.get(2).and_then(|n| n.parse().ok()).ok_or(usage)?;
    let setup = setup_from_env()?;
    let alone = thread_count();
    let mut by_workers = Vec::new();
    for workers in [1u32, 2, 4, 8] {
        let dir = arms::fresh_dir(root, &format!("threads-{workers}"))?;
        let brain = arms::start_brain(
            &setup,
            Harness::Bench,
            workers,
            Storage::DataDir,
            &dir,
            Effects::default(),
        )?;
        settle();
        let mut entry = json!({"workers": workers, "threads": thread_count()});
        if workers == 1 {
            entry["names"] = thread_names();
        }
        by_workers.push(entry);
        brain.shutdown(Duration::from_secs(5));
        drop(brain);
        let _ = std::fs::remove_dir_all(&dir);
    }
    let dir = arms::fresh_dir(root, "threads-load")?;
    let brain = Arc::new(arms::start_brain(
        &setup,
        Harness::Bench,
        2,
        Storage::DataDir,
        &dir,
        Effects::default(),
    )?);
    settle();
    let idle = thread_count();
    let ids = open_sessions(&brain, sessions, 4, "minimal")?;
    settle();
    let with_sessions = thread_count();
    let waiting = json!({"agentloop": {"name": "bench", "configuration": {"bench": "wait"}}});
    let running: Vec<_> = (0..64)
        .map(|_| {
            let session = arms::create(&brain, &waiting)?;
            session
                .send(arms::text(json!({ "ms": wait_ms }).to_string()))
                .map_err(|e| format!("send: {e}"))
        })
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(wait_ms / 3));
    let with_activations = thread_count();
    for activation in running {
        arms::completed(&activation.wait())?;
    }
    drop(ids);
    brain.shutdown(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{}",
        json!({
            "without_brain": alone,
            "idle": by_workers,
            "two_workers": {
                "idle": idle,
                "sessions": sessions,
                "with_sessions": with_sessions,
                "activations_64_running": with_activations,
            },
        })
    );
    Ok(())
}

/// `count` create → activate → close → delete cycles of realistic sessions, from `threads`
/// threads.
fn cycle_sessions(brain: &Brain, count: usize, threads: usize, from: usize) -> Result<(), String> {
    let failure = Mutex::new(None);
    std::thread::scope(|scope| {
        for t in 0..threads {
            let mine = count / threads + usize::from(t < count % threads);
            let failure = &failure;
            scope.spawn(move || {
                for i in 0..mine {
                    let request = realistic_request(&format!("cycle-{:08}", from + t * count + i));
                    let cycled = arms::create(brain, &request).and_then(|session| {
                        let activation = session
                            .send(arms::text("{}"))
                            .map_err(|e| format!("send: {e}"))?;
                        arms::completed(&activation.wait())?;
                        session.close().map_err(|e| format!("close: {e}"))?;
                        session.delete().map_err(|e| format!("delete: {e}"))
                    });
                    if let Err(error) = cycled {
                        failure.lock().get_or_insert(error);
                        return;
                    }
                }
            });
        }
    });
    match failure.into_inner() {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// `__cycles DIR COUNT WARMUP`: in a Brain with the durable journal in DIR (two bench workers),
/// WARMUP create → activate → close → delete cycles of realistic sessions (4 threads), then the
/// private memory and the heap in use (M0), COUNT more cycles in two halves with a reading after
/// each (M½, M1). Prints one JSON object: the growth M1 − M0 is what the cycles leave behind.
pub fn cycles_main(args: &[String]) -> Result<(), String> {
    let usage = "usage: __cycles DIR COUNT WARMUP";
    let dir = Path::new(args.first().ok_or(usage)?);
    let count: usize = args.get(1).and_then(|n| n.parse().ok()).ok_or(usage)?;
    let warmup: usize = args.get(2).and_then(|n| n.parse().ok()).ok_or(usage)?;
    let threads = 4;
    let setup = setup_from_env()?;
    let brain = probe_brain(&setup, dir)?;
    cycle_sessions(&brain, warmup, threads, 0)?;
    settle();
    let (private_0, heap_0) = (private_bytes(), heap_in_use());
    let began = Instant::now();
    cycle_sessions(&brain, count / 2, threads, warmup)?;
    settle();
    let (private_half, heap_half) = (private_bytes(), heap_in_use());
    cycle_sessions(&brain, count - count / 2, threads, warmup + count / 2)?;
    let seconds = began.elapsed().as_secs_f64();
    settle();
    let (private_1, heap_1) = (private_bytes(), heap_in_use());
    brain.shutdown(Duration::from_secs(5));
    let growth = |after: Option<u64>, before: Option<u64>| Some(after? as i64 - before? as i64);
    println!(
        "{}",
        json!({
            "cycles": count,
            "warmup": warmup,
            "seconds": seconds,
            "private_before": private_0,
            "private_half": private_half,
            "private_after": private_1,
            "private_growth": private_1 as i64 - private_0 as i64,
            "private_growth_second_half": private_1 as i64 - private_half as i64,
            "heap_before": heap_0,
            "heap_growth": growth(heap_1, heap_0),
            "heap_growth_second_half": growth(heap_1, heap_half),
        })
    );
    Ok(())
}

/// The realistic-session memory probe (`memory-real`): `__memory` with the realistic request in
/// a fresh directory under `root`. Returns the probe's figures and its targets (issue 27: open
/// idle ≤ 8 KiB + the request's JSON, passivated ≤ 1 KiB).
pub fn realistic_memory(root: &Path, sessions: usize) -> Result<(Value, Vec<Value>), String> {
    let dir = arms::fresh_dir(root, "sessions-realistic")?;
    let dir_text = dir.to_string_lossy().into_owned();
    eprintln!("memory-real: creating {sessions} sessions with the realistic request …");
    let memory = child_json(&["__memory", &dir_text, &sessions.to_string(), "realistic"])?;
    let _ = std::fs::remove_dir_all(&dir);
    let request = number(&memory["request_bytes"]);
    let limit = 8192.0 + request;
    let idle_limit = format!("8192 + its request's {request:.0} B = {limit:.0}");
    let targets = memory_targets(
        "memory-real",
        "realistic session",
        &memory,
        limit,
        &idle_limit,
    );
    Ok((memory, targets))
}

/// A memory probe's two targets: at most `idle_limit` private bytes (`idle_limit_text` in the
/// target's wording) per open idle `what`, and at most 1 KiB per passivated one.
pub fn memory_targets(
    probe: &str,
    what: &str,
    memory: &Value,
    idle_limit: f64,
    idle_limit_text: &str,
) -> Vec<Value> {
    let idle = number(&memory["open_idle_bytes_per_session"]);
    let passivated = number(&memory["passivated_bytes_per_session"]);
    vec![
        json!({
            "target": format!("{probe}: private bytes per open idle {what} ≤ {idle_limit_text}"),
            "measured": idle.round(), "met": idle <= idle_limit,
        }),
        json!({
            "target": format!("{probe}: private bytes per passivated {what} ≤ 1024"),
            "measured": passivated.round(), "met": passivated <= 1024.0,
        }),
    ]
}

/// A figure of a probe's JSON; 0 when it is missing.
pub fn number(value: &Value) -> f64 {
    value.as_f64().unwrap_or(0.0)
}

/// The cycles probe (`cycles`): `__cycles` in a fresh directory under `root`. Returns its figures
/// and its target (issue 27: no growth beyond 1 MiB after the warm-up).
pub fn cycles(root: &Path, count: usize, warmup: usize) -> Result<(Value, Vec<Value>), String> {
    let dir = arms::fresh_dir(root, "cycles")?;
    let dir_text = dir.to_string_lossy().into_owned();
    eprintln!("cycles: {warmup} + {count} create → activate → close → delete cycles …");
    let cycles = child_json(&[
        "__cycles",
        &dir_text,
        &count.to_string(),
        &warmup.to_string(),
    ])?;
    let _ = std::fs::remove_dir_all(&dir);
    let growth = number(&cycles["private_growth"]);
    let targets = vec![json!({
        "target": format!("cycles: private memory growth over {count} create → activate → close → delete cycles after {warmup} of warm-up ≤ 1 MiB"),
        "measured": growth, "met": growth <= 1024.0 * 1024.0,
    })];
    Ok((cycles, targets))
}
