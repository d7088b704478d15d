//! The crash soak and the load test (issue 8, items 2 and 5), against the real `brain serve`
//! binary, real fault-harness workers, real pipes, files and signals.
//!
//! **Crash soak** (`crash_soak`): rounds of load over HTTP — sessions created, messaged
//! synchronously and asynchronously, passivated, closed and deleted by driver threads — while a
//! chaos thread SIGKILLs random workers and cancels random running activations; each round ends
//! with a SIGKILL of Brain itself. Every session's activation calls `kv.put`, a `model` call
//! answered by a counting OpenAI stand-in (a local HTTP server speaking Chat Completions), a `tool`
//! run by the `local` driver as a shell command that appends its session id to a file, and `emit`.
//! After each kill, an independent check:
//!
//! - no process of the round survives Brain (none whose working directory is in the soak's
//!   directory: workers and tools);
//! - Brain restarts on the data directory; sessions the journal shows unfinished are read once
//!   over HTTP (which recovers them), then every journal is read back from disk with the read-only
//!   journal API and held to the invariants of `common::journal::check_session` (activations
//!   finished exactly once, effects finished exactly once, in order) and more: each acknowledged
//!   session, admission, outcome, passivation, close and cancel is present; each acknowledged
//!   deletion stays deleted; the stand-in and the tool's file saw no effect more often than it was
//!   journaled as started (and at least as often as it was journaled `ok`); no activation ran twice
//!   (at most one `activation_started`, one model call, one tool call and one emitted event per
//!   activation); every session the journal shows interrupted is `interrupted` over HTTP and
//!   refuses a message `409 session_interrupted` without a record;
//! - once Brain is quiet again: exactly its workers run in its process groups, it has no zombie
//!   child, and its descriptor count stays within a bound of the first round's.
//!
//! The last round ends with SIGTERM instead: exit 0, then no process left. `BRAIN_SOAK_SECONDS`
//! (default 15) bounds the load; `BRAIN_SOAK_SEED` replays a run (the seed is printed). The
//! kill points and choices come from the seed; thread timing does not, so a replay reproduces the
//! shape of a run, not every interleaving.
//!
//! **Load** (`load`, ignored: `scripts/soak --load SECONDS`): 10,000 open sessions on two workers,
//! 64 activations in flight per worker, for `BRAIN_LOAD_SECONDS`; Brain's resident memory, threads
//! and descriptors are sampled every few seconds and must stay flat after the warm-up; no error but
//! the injected ones (1 session in 50 fails on purpose with code `soak_injected`).

mod common;

use brain::protocol::harness::Event;
use common::http::{Reply, read_reply};
use common::journal::{check_session, read_all};
use common::server::{Api, Served, Start, children_of, harness_alive, signal};
use common::*;
use nix::sys::signal::Signal;
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Workers of the soak's registration.
const WORKERS: usize = 2;

/// How far Brain's descriptor count may rise above the first round's, measured at the same quiet
/// point of every round.
const FD_SLACK: usize = 8;

// ------------------------------------------------------------------------------------------------
// A keep-alive HTTP client: one connection per thread, reopened after an error or a close.

struct Client {
    addr: SocketAddr,
    auth: String,
    conn: Option<BufReader<TcpStream>>,
}

impl Client {
    fn new(served: &Served) -> Client {
        Client {
            addr: served.addr,
            auth: served.bearer(),
            conn: None,
        }
    }

    fn send(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> std::io::Result<Reply> {
        let mut conn = match self.conn.take() {
            Some(conn) => conn,
            None => {
                let stream = TcpStream::connect(self.addr)?;
                stream.set_read_timeout(Some(WAIT))?;
                stream.set_write_timeout(Some(WAIT))?;
                stream.set_nodelay(true)?;
                BufReader::new(stream)
            }
        };
        let body = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nhost: brain\r\nauthorization: {}\r\ncontent-length: {}\r\n",
            self.auth,
            body.len()
        );
        if !body.is_empty() {
            head.push_str("content-type: application/json\r\n");
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let mut raw = head.into_bytes();
        raw.extend_from_slice(&body);
        conn.get_ref().write_all(&raw)?;
        let reply = read_reply(&mut conn)?;
        if !reply
            .header("connection")
            .is_some_and(|c| c.eq_ignore_ascii_case("close"))
        {
            self.conn = Some(conn);
        }
        Ok(reply)
    }
}

// ------------------------------------------------------------------------------------------------
// The counting OpenAI stand-in: counts each complete request by the session's system prompt (a
// nonce the driver chose) before it answers.

struct StandIn {
    addr: SocketAddr,
    counts: Arc<Mutex<HashMap<String, u64>>>,
    total: Arc<AtomicU64>,
}

impl StandIn {
    /// Starts it; each answer waits up to `max_delay_ms` (varying) so that kills land mid-call.
    fn start(max_delay_ms: u64) -> StandIn {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the stand-in");
        let addr = listener.local_addr().expect("its address");
        let counts = Arc::new(Mutex::new(HashMap::new()));
        let total = Arc::new(AtomicU64::new(0));
        let (c, t) = (counts.clone(), total.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (c, t) = (c.clone(), t.clone());
                std::thread::spawn(move || serve_stand_in(stream, &c, &t, max_delay_ms));
            }
        });
        StandIn {
            addr,
            counts,
            total,
        }
    }

    fn count(&self, nonce: &str) -> u64 {
        self.counts.lock().get(nonce).copied().unwrap_or(0)
    }
}

fn serve_stand_in(
    stream: TcpStream,
    counts: &Mutex<HashMap<String, u64>>,
    total: &AtomicU64,
    max_delay_ms: u64,
) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let mut length = 0usize;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let nonce = request["messages"][0]["content"]
            .as_str()
            .unwrap_or("(none)")
            .to_owned();
        let n = total.fetch_add(1, Ordering::SeqCst);
        *counts.lock().entry(nonce).or_default() += 1;
        if max_delay_ms > 0 {
            let delay = (n.wrapping_mul(2654435761) >> 7) % (max_delay_ms + 1);
            std::thread::sleep(Duration::from_millis(delay));
        }
        let answer = json!({"id": format!("chatcmpl-{n}"), "object": "chat.completion", "model": "stand-in",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
        .to_string();
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if reader.get_ref().write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Processes, from /proc.

/// Pids (other than this process) whose working directory is inside `dir`: the soak's workers
/// (their registration's `cwd`) and tools (the sessions' workspaces).
fn processes_in(dir: &Path) -> Vec<u32> {
    let me = std::process::id();
    all_pids()
        .into_iter()
        .filter(|&pid| pid != me && !not_running(pid))
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(dir))
        })
        .collect()
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn status_field(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Anonymous resident memory (`RssAnon` of /proc/<pid>/status), bytes: the heap, thread stacks
/// and anonymous mappings that are resident. Not `Private_*` of smaps_rollup: every fork of a
/// tool process shares all of Brain's pages with the child until it execs, so the private figure
/// swings by hundreds of MiB from one sample to the next.
fn anon_bytes(pid: u32) -> u64 {
    status_field(pid, "RssAnon:") * 1024
}

/// Waits until `done` holds, polling; `false` if it still does not after `within`.
fn wait_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ------------------------------------------------------------------------------------------------
// The soak's world: directories, the stand-in, Brain's command line, session requests.

struct World {
    dir: PathBuf,
    data: PathBuf,
    tools_log: PathBuf,
    stand_in: StandIn,
    registrations: Value,
    env: Vec<(String, String)>,
}

impl World {
    fn new(tag: &str, max_concurrency: u64, stand_in_delay_ms: u64) -> World {
        let dir = temp_dir(tag);
        let workers_dir = dir.join("workers");
        std::fs::create_dir_all(&workers_dir).expect("workers dir");
        let stand_in = StandIn::start(stand_in_delay_ms);
        let registrations = json!({"soak": {
            "command": FAULT_HARNESS, "workers": WORKERS, "max_concurrency": max_concurrency,
            "cwd": workers_dir}});
        let env = vec![
            ("RUST_LOG".into(), "warn,brain::serve=info".into()),
            ("OPENAI_API_KEY".into(), "soak-key".into()),
            (
                "OPENAI_BASE_URL".into(),
                format!("http://{}/v1", stand_in.addr),
            ),
        ];
        World {
            data: dir.join("data"),
            tools_log: dir.join("tools.log"),
            dir,
            stand_in,
            registrations,
            env,
        }
    }

    fn start(&self) -> Served {
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        Start {
            data: &self.data,
            registrations: self.registrations.clone(),
            extra: &[
                "--restart-budget",
                "1000000",
                "--respawn-backoff",
                "10ms",
                "--respawn-backoff-max",
                "100ms",
                "--init-deadline",
                "10s",
            ],
            token: Some("soak-token"),
            env: &env,
            uid: None,
            umask: None,
        }
        .run()
    }

    /// A session request: `calls` callbacks (optionally slowed), a model on the stand-in, the
    /// counting tool, and the nonce as the system prompt.
    fn session_request(&self, nonce: &str, fault: Value, with_tool: bool) -> Value {
        let mut calls = vec![
            json!({"method": "kv.put", "input": {"key": "k", "value": nonce}}),
            json!({"method": "model", "input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}}),
        ];
        if with_tool {
            calls.push(json!({"method": "tool", "input": {"name": "count", "input": {}}}));
        }
        calls.push(json!({"method": "emit", "input": {"type": "progress", "data": {}}}));
        let mut configuration = fault;
        configuration["calls"] = Value::Array(calls);
        let script = format!(
            // A tool works in `workspaces/<session>/box`: it logs its session.
            "read -r _; d=\"${{PWD%/*}}\"; printf '%s\\n' \"${{d##*/}}\" >> '{}'",
            self.tools_log.display()
        );
        json!({
            "agentloop": {"name": "soak", "configuration": configuration,
                          "environments": [{"environment": "box", "permissions": ["read", "call"]}]},
            "model": {"provider": "openai", "name": "stand-in"},
            "system": nonce,
            "tools": [{"name": "count", "description": "counts its calls", "input_schema": {"type": "object"},
                       "placements": ["box"]}],
            "environments": [{"name": "box", "driver": "local",
                              "configuration": {"tools": {"count": {"command": ["sh", "-c", script]}}}}]
        })
    }

    fn tool_counts(&self) -> HashMap<String, u64> {
        let mut counts = HashMap::new();
        for line in std::fs::read_to_string(&self.tools_log)
            .unwrap_or_default()
            .lines()
        {
            *counts.entry(line.to_owned()).or_default() += 1;
        }
        counts
    }
}

fn message_body(text: &str) -> Value {
    json!({"content": [{"type": "text", "text": text}]})
}

// ------------------------------------------------------------------------------------------------
// What the drivers were told (acknowledged), and figures.

#[derive(Default)]
struct Ledger {
    sessions: HashSet<String>,
    queued: HashSet<(String, u64)>,
    finished: HashMap<(String, u64), String>,
    passivated: HashMap<String, usize>,
    closed: HashSet<String>,
    deleted: HashSet<String>,
    /// Sessions a deletion was sent for, acknowledged or not (Brain may have died after making it
    /// durable).
    delete_sent: HashSet<String>,
    cancelled: HashSet<(String, u64)>,
    /// Sessions checked to refuse execution once interrupted.
    refusing: HashSet<String>,
    outcomes: BTreeMap<String, u64>,
    refusals: BTreeMap<String, u64>,
}

#[derive(Default)]
struct Figures {
    rounds: u64,
    brain_kills: u64,
    worker_kills: u64,
    cancels_sent: u64,
    cancels_running: u64,
    recovered: u64,
    sessions_checked: u64,
    records_checked: u64,
    interrupted_refusals: u64,
    fds: Vec<usize>,
    threads: Vec<u64>,
    survivors_after_kill: u64,
}

/// A session a driver thread owns.
#[derive(Clone)]
struct Owned {
    id: String,
    closed: bool,
    /// Not closed, and not known to be interrupted.
    usable: bool,
    slow: bool,
}

struct Round {
    stop: AtomicBool,
    ledger: Arc<Mutex<Ledger>>,
    /// Sessions with a synchronous message in flight: targets for cancels.
    running: Mutex<HashSet<String>>,
    /// Every usable session, for the drivers of later rounds.
    pool: Mutex<Vec<Owned>>,
    next_nonce: AtomicU64,
}

fn driver(world: &World, round: &Round, mut client: Client, mut rng: Lcg, mut mine: Vec<Owned>) {
    while !round.stop.load(Ordering::SeqCst) {
        let roll = rng.below(100);
        // `want`: 0 usable, 1 not closed, 2 closed.
        let pick = |rng: &mut Lcg, mine: &[Owned], want: u8| -> Option<usize> {
            let candidates: Vec<usize> = (0..mine.len())
                .filter(|&i| match want {
                    0 => mine[i].usable,
                    1 => !mine[i].closed,
                    _ => mine[i].closed,
                })
                .collect();
            (!candidates.is_empty())
                .then(|| candidates[rng.below(candidates.len() as u64) as usize])
        };
        let result = if roll < 8 || !mine.iter().any(|o| o.usable) {
            let n = round.next_nonce.fetch_add(1, Ordering::SeqCst);
            let nonce = format!("soak-{n}");
            let slow = rng.below(3) == 0;
            let fault = if slow {
                json!({"fault": "slow_calls", "delay_ms": 20 + rng.below(40)})
            } else {
                json!({"fault": "calls"})
            };
            let body = world.session_request(&nonce, fault, true);
            client
                .send("POST", "/v1/sessions", Some(&body), &[])
                .map(|reply| {
                    if reply.status == 201 {
                        let id = reply.json()["session_id"]
                            .as_str()
                            .expect("an id")
                            .to_owned();
                        round.ledger.lock().sessions.insert(id.clone());
                        mine.push(Owned {
                            id,
                            closed: false,
                            usable: true,
                            slow,
                        });
                    } else {
                        note_refusal(round, &reply);
                    }
                })
        } else if roll < 78 {
            let Some(i) = pick(&mut rng, &mine, 0) else {
                continue;
            };
            let id = mine[i].id.clone();
            let asynchronous = rng.below(4) == 0;
            let path = format!("/v1/sessions/{id}/messages");
            if asynchronous {
                client
                    .send(
                        "POST",
                        &path,
                        Some(&message_body("go")),
                        &[("prefer", "respond-async")],
                    )
                    .map(|reply| {
                        if reply.status == 202 {
                            let seq = reply.json()["sequence"].as_u64().expect("a sequence");
                            round.ledger.lock().queued.insert((id.clone(), seq));
                        } else {
                            note_refusal(round, &reply);
                        }
                    })
            } else {
                if mine[i].slow {
                    round.running.lock().insert(id.clone());
                }
                let sent = client.send("POST", &path, Some(&message_body("go")), &[]);
                round.running.lock().remove(&id);
                sent.map(|reply| {
                    if reply.status == 409 && reply.code() == "session_interrupted" {
                        // Only closing and deleting are left for it.
                        mine[i].usable = false;
                    }
                    if reply.status == 200 {
                        let outcome = reply.json();
                        let seq = outcome["sequence"].as_u64().expect("a sequence");
                        let kind = outcome["outcome"].as_str().expect("an outcome").to_owned();
                        let mut ledger = round.ledger.lock();
                        let code = outcome["error"]["code"].as_str().unwrap_or("");
                        *ledger.outcomes.entry(format!("{kind}/{code}")).or_default() += 1;
                        ledger.queued.insert((id.clone(), seq));
                        ledger.finished.insert((id.clone(), seq), kind);
                    } else {
                        note_refusal(round, &reply);
                    }
                })
            }
        } else if roll < 86 {
            let Some(i) = pick(&mut rng, &mine, 0) else {
                continue;
            };
            let id = mine[i].id.clone();
            client
                .send("POST", &format!("/v1/sessions/{id}/passivate"), None, &[])
                .map(|reply| {
                    if reply.status == 200 {
                        *round.ledger.lock().passivated.entry(id).or_default() += 1;
                    } else {
                        note_refusal(round, &reply);
                    }
                })
        } else if roll < 93 {
            let Some(i) = pick(&mut rng, &mine, 1) else {
                continue;
            };
            let id = mine[i].id.clone();
            client
                .send("POST", &format!("/v1/sessions/{id}/close"), None, &[])
                .map(|reply| {
                    if reply.status == 200 {
                        round.ledger.lock().closed.insert(id);
                        mine[i].closed = true;
                        mine[i].usable = false;
                    } else {
                        note_refusal(round, &reply);
                    }
                })
        } else {
            let Some(i) = pick(&mut rng, &mine, 2) else {
                continue;
            };
            let id = mine[i].id.clone();
            round.ledger.lock().delete_sent.insert(id.clone());
            client
                .send("DELETE", &format!("/v1/sessions/{id}"), None, &[])
                .map(|reply| {
                    if reply.status == 204 {
                        round.ledger.lock().deleted.insert(id);
                        mine.swap_remove(i);
                    } else {
                        note_refusal(round, &reply);
                    }
                })
        };
        if result.is_err() {
            // Brain was killed (or the connection broke): nothing more to acknowledge this round.
            client.conn = None;
            if round.stop.load(Ordering::SeqCst) {
                break;
            }
        }
    }
    round.pool.lock().extend(mine);
}

fn note_refusal(round: &Round, reply: &Reply) {
    let code = if reply.status >= 400 {
        serde_json::from_slice::<Value>(&reply.body)
            .ok()
            .and_then(|b| b["error"]["code"].as_str().map(str::to_owned))
            .unwrap_or_default()
    } else {
        String::new()
    };
    *round
        .ledger
        .lock()
        .refusals
        .entry(format!("{} {code}", reply.status))
        .or_default() += 1;
}

/// The chaos of one round: worker kills and cancels until `until`; the first action is a worker
/// kill, so every round kills at least one worker.
fn chaos(served: &Served, round: &Round, rng: &mut Lcg, until: Instant, figures: &mut Figures) {
    let mut client = Client::new(served);
    let mut first = true;
    while Instant::now() < until {
        let pause = Duration::from_millis(50 + rng.below(400));
        std::thread::sleep(pause.min(until.saturating_duration_since(Instant::now())));
        if Instant::now() >= until {
            break;
        }
        if first || rng.below(100) < 35 {
            let workers: Vec<u32> = children_of(served.pid)
                .into_iter()
                .filter(|&p| harness_alive(p))
                .collect();
            if workers.is_empty() {
                continue;
            }
            let pid = workers[rng.below(workers.len() as u64) as usize];
            signal(pid, Signal::SIGKILL);
            figures.worker_kills += 1;
            first = false;
        } else {
            let running: Vec<String> = round.running.lock().iter().cloned().collect();
            if running.is_empty() {
                continue;
            }
            let id = &running[rng.below(running.len() as u64) as usize];
            figures.cancels_sent += 1;
            if let Ok(reply) = client.send("POST", &format!("/v1/sessions/{id}/cancel"), None, &[])
                && reply.status == 200
            {
                let body = reply.json();
                if let Some(seq) = body["sequence"].as_u64() {
                    round.ledger.lock().cancelled.insert((id.clone(), seq));
                    if body["was_running"] == true {
                        figures.cancels_running += 1;
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The independent check.

fn of_kind<'a>(records: &'a [Event], kind: &'a str) -> impl Iterator<Item = &'a Event> {
    records.iter().filter(move |r| r.event_type == kind)
}

fn unfinished(records: &[Event]) -> bool {
    let count = |kind: &str| records.iter().filter(|r| r.event_type == kind).count();
    count("activation_queued") != count("activation_finished")
        || count("model_call_started") != count("model_call_finished")
        || count("tool_call_started") != count("tool_call_finished")
        || count("environment_started") != count("environment_finished")
}

/// The session's status as its journal shows it: `closed`, `interrupted` (an activation that
/// wrote its marker ended otherwise than `completed`), `passivated` or `open`.
fn journal_status(records: &[Event]) -> &'static str {
    let mut status = "open";
    let mut started = HashSet::new();
    for record in records {
        match record.event_type.as_str() {
            "activation_started" => {
                started.insert(record.data["activation"].as_u64());
            }
            "activation_finished" => {
                if started.contains(&record.data["activation"].as_u64())
                    && record.data["outcome"] != "completed"
                {
                    status = "interrupted";
                } else if status == "passivated" {
                    status = "open";
                }
            }
            "activation_queued" if status == "passivated" => status = "open",
            "session_passivated" if status == "open" => status = "passivated",
            "session_closed" => status = "closed",
            _ => {}
        }
    }
    status
}

fn check_round(world: &World, served: &Served, ledger: &Mutex<Ledger>, figures: &mut Figures) {
    let mut client = Client::new(served);
    // Recover what the kill left open: a read over HTTP recovers a session.
    let before = read_all(&world.data);
    for (id, records) in &before {
        if unfinished(records) {
            let reply = client
                .send("GET", &format!("/v1/sessions/{id}"), None, &[])
                .expect("a view");
            assert_eq!(reply.status, 200, "{id}: {}", reply.text());
            figures.recovered += 1;
        }
    }
    let journals = read_all(&world.data);
    let tools = world.tool_counts();
    let book = ledger.lock();
    let present: HashSet<String> = journals.keys().map(|id| id.to_string()).collect();
    let state_root = world.data.join("agentloops").join("soak");
    for id in &book.sessions {
        if book.deleted.contains(id) {
            assert!(
                !present.contains(id),
                "deleted session {id} is back in the journal"
            );
            assert!(
                !state_root.join(id).exists(),
                "deleted session {id} still has its state directory"
            );
        } else if !book.delete_sent.contains(id) {
            assert!(
                present.contains(id),
                "acknowledged session {id} is not in the journal"
            );
        }
    }
    // State directories of sessions no longer in the journal (a deletion made durable just before
    // a kill, whose directory Brain had not removed yet) are removed when Brain starts again.
    let orphans = std::fs::read_dir(&state_root)
        .map(|dir| {
            dir.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.starts_with("ses_"))
                })
                .filter(|e| !present.contains(e.file_name().to_str().unwrap_or_default()))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(
        orphans, 0,
        "state directories of sessions the journal does not hold survived a restart"
    );
    let mut newly_interrupted = Vec::new();
    for (id, records) in &journals {
        let id = id.to_string();
        let ctx = format!("soak: session {id}");
        check_session(&ctx, &id, records);
        figures.sessions_checked += 1;
        figures.records_checked += records.len() as u64;
        let of = |kind: &'static str| of_kind(records, kind);
        // Acknowledged records are present.
        for (_, seq) in book.queued.iter().filter(|(s, _)| *s == id) {
            assert_eq!(
                records
                    .get(*seq as usize - 1)
                    .map(|r| r.event_type.as_str()),
                Some("activation_queued"),
                "{ctx}: acknowledged admission {seq} lost"
            );
        }
        for ((_, seq), outcome) in book.finished.iter().filter(|((s, _), _)| *s == id) {
            let recorded: Vec<&str> = of("activation_finished")
                .filter(|r| r.data["activation"] == *seq)
                .map(|r| r.data["outcome"].as_str().unwrap_or_default())
                .collect();
            assert_eq!(
                recorded,
                [outcome.as_str()],
                "{ctx}: acknowledged outcome of {seq}"
            );
        }
        for (_, seq) in book.cancelled.iter().filter(|(s, _)| *s == id) {
            assert_eq!(
                of("activation_finished")
                    .filter(|r| r.data["activation"] == *seq)
                    .count(),
                1,
                "{ctx}: the cancelled activation {seq} has no single outcome"
            );
        }
        // Passivating a passivated session is a no-op that writes nothing: an acknowledged
        // passivation means at least one record.
        if book.passivated.contains_key(&id) {
            assert!(
                of("session_passivated").count() >= 1,
                "{ctx}: acknowledged passivation without a record"
            );
        }
        if book.closed.contains(&id) {
            assert_eq!(of("session_closed").count(), 1, "{ctx}: acknowledged close");
        }
        // No effect sent more often than journaled as started, nor less than journaled `ok`.
        let nonce = records[0].data["system"].as_str().unwrap_or_default();
        for (sent, started, finished, what) in [
            (
                world.stand_in.count(nonce),
                "model_call_started",
                "model_call_finished",
                "model calls",
            ),
            (
                tools.get(&id).copied().unwrap_or(0),
                "tool_call_started",
                "tool_call_finished",
                "tool calls",
            ),
        ] {
            let started = of(started).count() as u64;
            let ok = of(finished).filter(|r| r.data["outcome"] == "ok").count() as u64;
            assert!(
                ok <= sent && sent <= started,
                "{ctx}: {what}: {sent} sent, {started} journaled as started, {ok} finished ok"
            );
        }
        // No activation ran twice: one marker, one model call, one tool call, one emitted event.
        let mut per_activation: HashMap<(u64, &str), usize> = HashMap::new();
        for record in records {
            let activation = match record.event_type.as_str() {
                "activation_started" | "model_call_started" | "tool_call_started" => {
                    record.data["activation"].as_u64()
                }
                "event_emitted" => serde_json::to_value(record.origin).ok().and_then(|o| {
                    (o["kind"] == "agentloop")
                        .then(|| o["sequence"].as_u64())
                        .flatten()
                }),
                _ => None,
            };
            if let Some(activation) = activation {
                let n = per_activation
                    .entry((activation, record.event_type.as_str()))
                    .or_default();
                *n += 1;
                assert_eq!(
                    *n, 1,
                    "{ctx}: activation {activation} has a second {}",
                    record.event_type
                );
            }
        }
        if journal_status(records) == "interrupted" && !book.refusing.contains(&id) {
            newly_interrupted.push((id.clone(), records.len()));
        }
    }
    drop(book);
    // Every newly interrupted session is interrupted over HTTP and refuses execution, writing
    // nothing.
    for (id, _) in &newly_interrupted {
        let view = client
            .send("GET", &format!("/v1/sessions/{id}"), None, &[])
            .expect("a view");
        assert_eq!(
            view.json()["status"],
            "interrupted",
            "{id}: {}",
            view.text()
        );
        client
            .send(
                "POST",
                &format!("/v1/sessions/{id}/messages"),
                Some(&message_body("again")),
                &[],
            )
            .expect("an answer")
            .expect(409, Some("session_interrupted"));
        figures.interrupted_refusals += 1;
    }
    if !newly_interrupted.is_empty() {
        let after = read_all(&world.data);
        let mut ledger = ledger.lock();
        for (id, len) in newly_interrupted {
            let now = after
                .iter()
                .find(|(k, _)| k.as_str() == id)
                .map(|(_, r)| r.len());
            assert_eq!(
                now,
                Some(len),
                "session {id}: a refused message wrote a record"
            );
            ledger.refusing.insert(id);
        }
    }
}

/// Once Brain is quiet: exactly its workers run in the soak's directory, none is a zombie, and
/// every worker's process group holds only the worker. Returns the descriptor count.
fn quiet_point(world: &World, served: &Served) -> usize {
    let settled = wait_until(WAIT, || {
        let children = children_of(served.pid);
        let workers: Vec<u32> = children
            .iter()
            .copied()
            .filter(|&p| harness_alive(p))
            .collect();
        workers.len() == WORKERS
            && children.len() == WORKERS
            && processes_in(&world.dir).len() == WORKERS
    });
    assert!(
        settled,
        "Brain {} did not settle to {WORKERS} workers: children {:?}, in the soak's directory {:?}",
        served.pid,
        children_of(served.pid),
        processes_in(&world.dir)
    );
    fd_count(served.pid)
}

fn seed() -> u64 {
    std::env::var("BRAIN_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                % 1_000_000_007
        })
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn crash_soak() {
    let seed = seed();
    let seconds = env_u64("BRAIN_SOAK_SECONDS", 15);
    let drivers = env_u64("BRAIN_SOAK_DRIVERS", 4);
    println!("crash soak: seed {seed} (BRAIN_SOAK_SEED={seed} replays it), {seconds} s of load");
    let mut rng = Lcg(seed);
    let world = World::new("soak", 8, 15);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut figures = Figures::default();
    let began = Instant::now();
    let end = began + Duration::from_secs(seconds);
    let mut pool: Vec<Owned> = Vec::new();
    let mut next_nonce = 0;
    let mut served = world.start();
    loop {
        figures.rounds += 1;
        let last = Instant::now() + Duration::from_millis(1500) >= end;
        let length = Duration::from_millis(1000 + rng.below(2500));
        let round = Round {
            stop: AtomicBool::new(false),
            ledger: ledger.clone(),
            running: Mutex::new(HashSet::new()),
            pool: Mutex::new(Vec::new()),
            next_nonce: AtomicU64::new(next_nonce),
        };
        // Share the usable sessions among the drivers.
        let mut shares: Vec<Vec<Owned>> = vec![Vec::new(); drivers as usize];
        for (i, owned) in pool.drain(..).enumerate() {
            shares[i % drivers as usize].push(owned);
        }
        let mut seen_workers: HashSet<u32> = HashSet::new();
        std::thread::scope(|scope| {
            for share in shares {
                let rng = rng.fork();
                let client = Client::new(&served);
                let (world, round) = (&world, &round);
                scope.spawn(move || driver(world, round, client, rng, share));
            }
            chaos(
                &served,
                &round,
                &mut rng,
                Instant::now() + length,
                &mut figures,
            );
            seen_workers.extend(children_of(served.pid));
            if last {
                // A clean stop: SIGTERM, exit 0.
                served.signal(Signal::SIGTERM);
                let status = served.wait_exit(WAIT);
                round.stop.store(true, Ordering::SeqCst);
                assert!(
                    status.is_some_and(|s| s.success()),
                    "brain serve exited {status:?} after SIGTERM; its stderr:\n{}",
                    served.stderr()
                );
            } else {
                served.signal(Signal::SIGKILL);
                round.stop.store(true, Ordering::SeqCst);
                assert!(served.wait_exit(WAIT).is_some(), "brain did not die");
                figures.brain_kills += 1;
            }
        });
        next_nonce = round.next_nonce.load(Ordering::SeqCst);
        pool = std::mem::take(&mut *round.pool.lock());
        // No process of this Brain survives it: workers see the end of their stdin and exit;
        // tools end with their call.
        let survivors = processes_in(&world.dir);
        figures.survivors_after_kill += survivors.len() as u64;
        assert!(
            wait_until(WAIT, || processes_in(&world.dir).is_empty()),
            "round {}: processes outlived Brain: {:?}",
            figures.rounds,
            processes_in(&world.dir)
        );
        served = world.start();
        check_round(&world, &served, &ledger, &mut figures);
        let fds = quiet_point(&world, &served);
        figures.fds.push(fds);
        figures.threads.push(status_field(served.pid, "Threads:"));
        assert!(
            fds <= figures.fds[0] + FD_SLACK,
            "round {}: Brain holds {fds} descriptors, the first round {} (+{FD_SLACK} allowed)",
            figures.rounds,
            figures.fds[0]
        );
        if figures.rounds.is_multiple_of(10) || last {
            let ledger = ledger.lock();
            println!(
                "  round {:4} at {:4.0} s: {} Brain kills, {} worker kills; {} sessions, {} outcomes acknowledged; {} session checks; {fds} descriptors",
                figures.rounds,
                began.elapsed().as_secs_f64(),
                figures.brain_kills,
                figures.worker_kills,
                ledger.sessions.len(),
                ledger.finished.len(),
                figures.sessions_checked
            );
        }
        if last {
            break;
        }
    }
    served.terminate(WAIT);
    assert!(
        wait_until(WAIT, || processes_in(&world.dir).is_empty()),
        "processes outlived the final stop: {:?}",
        processes_in(&world.dir)
    );
    let ledger = ledger.lock();
    let completed = ledger
        .outcomes
        .iter()
        .filter(|(k, _)| k.starts_with("completed"))
        .map(|(_, v)| v)
        .sum::<u64>();
    println!(
        "crash soak: seed {seed}, {:.0} s, {} rounds, {} Brain SIGKILLs + 1 SIGTERM, {} worker SIGKILLs, {} cancels sent ({} of running activations)",
        began.elapsed().as_secs_f64(),
        figures.rounds,
        figures.brain_kills,
        figures.worker_kills,
        figures.cancels_sent,
        figures.cancels_running
    );
    println!(
        "  acknowledged: {} sessions, {} admissions, {} outcomes {:?}, {} passivations, {} closes, {} deletions",
        ledger.sessions.len(),
        ledger.queued.len(),
        ledger.finished.len(),
        ledger.outcomes,
        ledger.passivated.values().sum::<usize>(),
        ledger.closed.len(),
        ledger.deleted.len()
    );
    println!("  refusals seen by the drivers: {:?}", ledger.refusals);
    println!(
        "  deletions sent {}, acknowledged {}",
        ledger.delete_sent.len(),
        ledger.deleted.len()
    );
    println!(
        "  effects sent: {} model calls (stand-in), {} tool runs",
        world.stand_in.total.load(Ordering::SeqCst),
        world.tool_counts().values().sum::<u64>()
    );
    println!(
        "  checks: {} session checks over {} records, {} sessions recovered after kills, {} interrupted sessions refused execution",
        figures.sessions_checked,
        figures.records_checked,
        figures.recovered,
        figures.interrupted_refusals
    );
    println!(
        "  leaks: Brain's descriptors at the quiet point {}..{} (first {}), threads {}..{}; {} processes still exiting right after the kills, none left",
        figures.fds.iter().min().unwrap_or(&0),
        figures.fds.iter().max().unwrap_or(&0),
        figures.fds[0],
        figures.threads.iter().min().unwrap_or(&0),
        figures.threads.iter().max().unwrap_or(&0),
        figures.survivors_after_kill
    );
    assert!(figures.brain_kills >= 1, "the soak killed Brain no time");
    assert!(
        figures.worker_kills >= figures.rounds,
        "every round kills a worker"
    );
    assert!(completed > 0, "no activation completed");
    let _ = std::fs::remove_dir_all(&world.dir);
}

// ------------------------------------------------------------------------------------------------
// Load.

/// Activations a load session runs before it is closed, deleted and replaced by a new one.
const LOAD_TURNS: u64 = 25;

/// One session in 50 fails its first activation on purpose (`soak_injected`).
const INJECT_ONE_IN: u64 = 50;

/// How much Brain's anonymous resident memory may grow after the warm-up: the mean of the last quarter of
/// the samples over the mean of the first quarter.
const LOAD_MEMORY_BOUND: u64 = 16 << 20;

struct LoadState {
    stop: AtomicBool,
    /// Requests refused `503 overloaded` before anything was admitted, and retried.
    overloaded: AtomicU64,
    activations: AtomicU64,
    injected: AtomicU64,
    replaced: AtomicU64,
    next_nonce: AtomicU64,
    errors: Mutex<Vec<String>>,
}

impl LoadState {
    fn error(&self, what: String) {
        let mut errors = self.errors.lock();
        if errors.len() < 1000 {
            errors.push(what);
        }
    }
}

/// Sends a request, retrying it after a short pause while the HTTP server refuses it `503
/// overloaded` (its queue of ready requests is full; nothing was admitted), as a client should.
fn send_retrying(
    client: &mut Client,
    state: &LoadState,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> std::io::Result<Reply> {
    let mut pause = 2;
    loop {
        let reply = client.send(method, path, body, &[])?;
        if reply.status != 503 || reply.code() != "overloaded" || pause > 1000 {
            return Ok(reply);
        }
        state.overloaded.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(pause));
        pause *= 2;
    }
}

/// A load session: its id and whether it fails on purpose.
struct LoadSession {
    id: String,
    injected: bool,
    turns: u64,
}

fn create_load_session(
    world: &World,
    client: &mut Client,
    state: &LoadState,
    delay_ms: u64,
) -> Option<LoadSession> {
    let n = state.next_nonce.fetch_add(1, Ordering::SeqCst);
    let injected = n % INJECT_ONE_IN == INJECT_ONE_IN - 1;
    let fault = if injected {
        json!({"fault": "fail", "code": "soak_injected"})
    } else {
        json!({"fault": "slow_calls", "delay_ms": delay_ms})
    };
    let body = world.session_request(&format!("load-{n}"), fault, n.is_multiple_of(8));
    match send_retrying(client, state, "POST", "/v1/sessions", Some(&body)) {
        Ok(reply) if reply.status == 201 => Some(LoadSession {
            id: reply.json()["session_id"].as_str()?.to_owned(),
            injected,
            turns: 0,
        }),
        Ok(reply) => {
            state.error(format!("create: {} {}", reply.status, reply.text()));
            None
        }
        Err(error) => {
            state.error(format!("create: {error}"));
            client.conn = None;
            None
        }
    }
}

/// One client thread: messages its sessions in turn, each waiting for the outcome; replaces a
/// session after [`LOAD_TURNS`] activations or its injected failure.
fn load_client(
    world: &World,
    state: &LoadState,
    mut client: Client,
    mut sessions: Vec<LoadSession>,
    delay_ms: u64,
) {
    let mut next = 0;
    while !state.stop.load(Ordering::SeqCst) && !sessions.is_empty() {
        next = (next + 1) % sessions.len();
        let session = &mut sessions[next];
        let path = format!("/v1/sessions/{}/messages", session.id);
        let outcome =
            match send_retrying(&mut client, state, "POST", &path, Some(&message_body("go"))) {
                Ok(reply) if reply.status == 200 => reply.json(),
                Ok(reply) => {
                    state.error(format!("message: {} {}", reply.status, reply.text()));
                    continue;
                }
                Err(error) => {
                    state.error(format!("message: {error}"));
                    client.conn = None;
                    continue;
                }
            };
        state.activations.fetch_add(1, Ordering::Relaxed);
        session.turns += 1;
        let kind = outcome["outcome"].as_str().unwrap_or_default();
        let code = outcome["error"]["code"].as_str().unwrap_or_default();
        match (session.injected, kind, code) {
            (false, "completed", _) => {}
            (true, "failed", "soak_injected") => {
                state.injected.fetch_add(1, Ordering::Relaxed);
            }
            _ => state.error(format!("outcome: {outcome}")),
        }
        if session.injected || session.turns >= LOAD_TURNS {
            let id = session.id.clone();
            let closed = send_retrying(
                &mut client,
                state,
                "POST",
                &format!("/v1/sessions/{id}/close"),
                None,
            );
            let deleted = send_retrying(
                &mut client,
                state,
                "DELETE",
                &format!("/v1/sessions/{id}"),
                None,
            );
            match (closed, deleted) {
                (Ok(c), Ok(d)) if c.status == 200 && d.status == 204 => {}
                (c, d) => state.error(format!(
                    "replace {id}: close {:?}, delete {:?}",
                    c.map(|r| r.status),
                    d.map(|r| r.status)
                )),
            }
            match create_load_session(world, &mut client, state, delay_ms) {
                Some(new) => sessions[next] = new,
                None => {
                    sessions.swap_remove(next);
                }
            }
            state.replaced.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The sum of a metric's samples (all label sets) from `/metrics`.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at_s: f64,
    anon: u64,
    threads: u64,
    fds: usize,
    slots_in_use: f64,
    activations: u64,
}

#[test]
#[ignore = "the load test runs from scripts/soak --load SECONDS"]
fn load() {
    let seconds = env_u64("BRAIN_LOAD_SECONDS", 300);
    let sessions = env_u64("BRAIN_LOAD_SESSIONS", 10_000) as usize;
    let per_worker = env_u64("BRAIN_LOAD_CONCURRENCY", 64);
    let delay_ms = env_u64("BRAIN_LOAD_DELAY_MS", 50);
    let warmup = Duration::from_secs(env_u64("BRAIN_LOAD_WARMUP_SECONDS", (seconds / 5).max(60)));
    let clients = per_worker as usize * WORKERS;
    println!(
        "load: {sessions} open sessions, {clients} clients ({per_worker} activations in flight per worker), {seconds} s, warm-up {} s",
        warmup.as_secs()
    );
    let world = World::new("load", per_worker, 0);
    let mut served = world.start();
    let state = LoadState {
        stop: AtomicBool::new(false),
        overloaded: AtomicU64::new(0),
        activations: AtomicU64::new(0),
        injected: AtomicU64::new(0),
        replaced: AtomicU64::new(0),
        next_nonce: AtomicU64::new(0),
        errors: Mutex::new(Vec::new()),
    };
    // Open the sessions, sixteen at a time.
    let created_at = Instant::now();
    let opened: Vec<LoadSession> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|t| {
                let mut client = Client::new(&served);
                let (world, state) = (&world, &state);
                scope.spawn(move || {
                    (t..sessions)
                        .step_by(16)
                        .filter_map(|_| create_load_session(world, &mut client, state, delay_ms))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a creator"))
            .collect()
    });
    assert_eq!(opened.len(), sessions, "{:?}", state.errors.lock());
    println!(
        "load: {sessions} sessions opened in {:.1} s",
        created_at.elapsed().as_secs_f64()
    );
    let mut shares: Vec<Vec<LoadSession>> = (0..clients).map(|_| Vec::new()).collect();
    for (i, session) in opened.into_iter().enumerate() {
        shares[i % clients].push(session);
    }
    let began = Instant::now();
    let end = began + Duration::from_secs(seconds);
    let mut samples: Vec<Sample> = Vec::new();
    std::thread::scope(|scope| {
        for share in shares {
            let client = Client::new(&served);
            let (world, state) = (&world, &state);
            scope.spawn(move || load_client(world, state, client, share, delay_ms));
        }
        let mut probe = Client::new(&served);
        println!("      t/s  RssAnon/MiB  threads  fds  slots_in_use  activations");
        loop {
            let metrics = probe
                .send("GET", "/metrics", None, &[])
                .map(|r| r.text())
                .unwrap_or_default();
            let sample = Sample {
                at_s: began.elapsed().as_secs_f64(),
                anon: anon_bytes(served.pid),
                threads: status_field(served.pid, "Threads:"),
                fds: fd_count(served.pid),
                slots_in_use: metric_sum(&metrics, "brain_slots_in_use"),
                activations: state.activations.load(Ordering::Relaxed),
            };
            println!(
                "  {:7.0}  {:11.1}  {:7}  {:3}  {:12.0}  {:11}",
                sample.at_s,
                sample.anon as f64 / 1048576.0,
                sample.threads,
                sample.fds,
                sample.slots_in_use,
                sample.activations
            );
            samples.push(sample);
            if Instant::now() >= end {
                break;
            }
            std::thread::sleep(Duration::from_secs(5).min(end - Instant::now()));
        }
        state.stop.store(true, Ordering::SeqCst);
    });
    let elapsed = began.elapsed().as_secs_f64();
    served.terminate(Duration::from_secs(60));
    assert!(
        wait_until(WAIT, || processes_in(&world.dir).is_empty()),
        "processes outlived Brain: {:?}",
        processes_in(&world.dir)
    );
    // Flat: the mean of the last quarter of the samples after the warm-up exceeds the mean of
    // the first quarter by at most the bound (single samples swing with the threads that model
    // calls and tools run on).
    let after: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at_s >= warmup.as_secs_f64())
        .collect();
    assert!(after.len() >= 4, "too few samples after the warm-up");
    let quarter = after.len() / 4;
    let mean =
        |part: &[&Sample]| part.iter().map(|s| s.anon as f64).sum::<f64>() / part.len() as f64;
    let first_mean = mean(&after[..quarter]);
    let last_mean = mean(&after[after.len() - quarter..]);
    let growth = last_mean - first_mean;
    let peak = after.iter().map(|s| s.anon).max().unwrap_or(0);
    let low = after.iter().map(|s| s.anon).min().unwrap_or(0);
    let activations = state.activations.load(Ordering::SeqCst);
    let mean_slots = samples.iter().map(|s| s.slots_in_use).sum::<f64>() / samples.len() as f64;
    println!(
        "load: {activations} activations in {elapsed:.0} s ({:.0}/s), {} injected failures, {} sessions replaced, mean {mean_slots:.0} activations running",
        activations as f64 / elapsed,
        state.injected.load(Ordering::SeqCst),
        state.replaced.load(Ordering::SeqCst)
    );
    let mib = |b: f64| b / 1048576.0;
    println!(
        "load: anonymous resident memory after the warm-up ({:.0} s): {:.1}..{:.1} MiB; mean of the first quarter {:.1} MiB, of the last {:.1} MiB: growth {:+.1} MiB (bound {} MiB)",
        warmup.as_secs_f64(),
        mib(low as f64),
        mib(peak as f64),
        mib(first_mean),
        mib(last_mean),
        mib(growth),
        LOAD_MEMORY_BOUND >> 20,
    );
    println!(
        "load: threads {}..{}; descriptors {}..{}; {} requests refused 503 overloaded and retried",
        samples.iter().map(|s| s.threads).min().unwrap_or(0),
        samples.iter().map(|s| s.threads).max().unwrap_or(0),
        samples.iter().map(|s| s.fds).min().unwrap_or(0),
        samples.iter().map(|s| s.fds).max().unwrap_or(0),
        state.overloaded.load(Ordering::SeqCst),
    );
    let errors = state.errors.lock();
    assert!(
        errors.is_empty(),
        "{} errors besides the injected ones, the first: {:?}",
        errors.len(),
        &errors[..errors.len().min(10)]
    );
    assert!(
        state.injected.load(Ordering::SeqCst) > 0,
        "nothing injected"
    );
    assert!(
        growth <= LOAD_MEMORY_BOUND as f64,
        "anonymous resident memory grew by {:.1} MiB after the warm-up",
        mib(growth)
    );
    let _ = std::fs::remove_dir_all(&world.dir);
}
