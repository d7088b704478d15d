//! brain-bench: Brain's benchmark (issue 7). One run measures the baselines — pipe ping-pong,
//! JSON-RPC through reader and writer threads, `fdatasync` on the data directory's filesystem —
//! and the Brain arms — callbacks, activations, turns, memory per session, startup with many
//! sessions, threads — and prints every figure with its ratio to the matching baseline, as the
//! issue's targets phrase them. Timed arms run in rounds (every arm once per round, each Brain arm
//! with a target right after a trial of the baseline it is compared with: see [`rounds`]) and
//! report medians over the rounds; each ratio is the median of the per-round ratios, so a slow
//! moment of the machine hits an arm and its baseline alike. Every trial also records the CPUs the
//! bench used and the share of the machine other processes took meanwhile, which tells a noisy
//! trial from a slow one.
//!
//! Plain `std` timing; no async runtime. Build with `cargo build --release --bins` (the reference
//! harness must sit beside this binary) or run `scripts/bench`.

mod arms;
mod baselines;
mod harness;
mod instructions;
mod machine;
mod probes;
mod report;
mod rounds;
mod stats;

use arms::{Harness, Setup, TurnArm};
use brain::Storage;
use machine::{cpu_counters, describe_machine, machine, spread_runs};
use probes::number;
use report::{print_probes, print_table, print_targets};
use serde_json::{Value, json};
use stats::{Trial, median, round};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

const USAGE: &str = "\
usage: brain-bench [--quick] [--json FILE] [--data-dir DIR] [--rounds N] [--sessions N]
                   [--only ID,ID,...]
       brain-bench --instructions [--quick] [--json FILE] [--data-dir DIR]
  --instructions   instructions per operation under valgrind's callgrind, for the Brain process
                   alone, against the JSON-RPC baseline's parent process (needs valgrind)
  --quick          every arm with tiny counts (a smoke test of a few seconds; no timing claims)
  --json FILE      also write every figure as JSON to FILE
  --data-dir DIR   where data directories and the fdatasync file go (default target/bench-data);
                   it is emptied of what the bench made when the run ends
  --rounds N       rounds of the timed arms (default 5, quick 1)
  --sessions N     sessions for the memory and startup probes (default 10000, quick 200)
  --only IDS       run only these arms (ids as printed; also memory, startup, threads)";

/// When a timed arm counts: after `warmup`, for `measure`.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub warmup: Duration,
    pub measure: Duration,
}

impl Window {
    fn new(warmup_ms: u64, measure_ms: u64) -> Window {
        Window {
            warmup: Duration::from_millis(warmup_ms),
            measure: Duration::from_millis(measure_ms),
        }
    }

    /// The start and the end of the window, counted from now.
    pub fn instants(&self) -> (Instant, Instant) {
        let start = Instant::now() + self.warmup;
        (start, start + self.measure)
    }
}

/// How long and how much.
struct Plan {
    quick: bool,
    rounds: usize,
    baseline: Window,
    callback: Window,
    activation: Window,
    turns: Window,
    sessions: usize,
    /// Turns before a client replaces its session.
    per_session: usize,
}

impl Plan {
    fn full() -> Plan {
        Plan {
            quick: false,
            rounds: 5,
            baseline: Window::new(200, 1500),
            callback: Window::new(400, 2000),
            activation: Window::new(300, 2000),
            turns: Window::new(500, 3000),
            sessions: 10_000,
            per_session: 4,
        }
    }

    fn quick() -> Plan {
        Plan {
            quick: true,
            rounds: 1,
            baseline: Window::new(20, 100),
            callback: Window::new(150, 150),
            activation: Window::new(30, 150),
            turns: Window::new(30, 200),
            sessions: 200,
            per_session: 4,
        }
    }
}

/// How an arm's figure is compared with its baseline.
#[derive(Clone, Copy, Debug)]
enum Ratio {
    /// No ratio (a baseline).
    None,
    /// Its p50 over `base`'s p50; `limit` is the target's upper bound.
    P50Over(&'static str, Option<f64>),
    /// Its rate over `base`'s rate; `limit` is the target's lower bound.
    RateOver(&'static str, Option<f64>),
    /// Its p50 over (`records` × fdatasync-1's p50 + jsonrpc-1's p50); `limit` as above.
    P50OverDurable(u32, Option<f64>),
    /// Its rate over a fixed rate; the target is reaching it.
    RateOverFixed(f64, bool),
}

impl Ratio {
    fn describe(self) -> String {
        match self {
            Ratio::None => String::new(),
            Ratio::P50Over(base, _) => format!("p50 / {base} p50"),
            Ratio::RateOver(base, _) => format!("rate / {base} rate"),
            Ratio::P50OverDurable(records, _) => {
                format!("p50 / ({records}·fdatasync-1 p50 + jsonrpc-1 p50)")
            }
            Ratio::RateOverFixed(rate, _) => format!("rate / {rate}/s"),
        }
    }

    fn target(self) -> Option<String> {
        match self {
            Ratio::P50Over(_, Some(limit)) | Ratio::P50OverDurable(_, Some(limit)) => {
                Some(format!("≤ {limit}"))
            }
            Ratio::RateOver(_, Some(limit)) => Some(format!("≥ {limit}")),
            Ratio::RateOverFixed(_, true) => Some("≥ 1".to_owned()),
            _ => None,
        }
    }

    fn met(self, value: f64) -> Option<bool> {
        match self {
            Ratio::P50Over(_, Some(limit)) | Ratio::P50OverDurable(_, Some(limit)) => {
                Some(value <= limit)
            }
            Ratio::RateOver(_, Some(limit)) => Some(value >= limit),
            Ratio::RateOverFixed(_, true) => Some(value >= 1.0),
            _ => None,
        }
    }

    /// The ratio for one round, given the trials of that round by arm id.
    fn value(self, trial: &Trial, round: &dyn Fn(&str) -> Option<Trial>) -> Option<f64> {
        match self {
            Ratio::None => None,
            Ratio::P50Over(base, _) => Some(trial.p50_us / round(base)?.p50_us),
            Ratio::RateOver(base, _) => Some(trial.rate / round(base)?.rate),
            Ratio::P50OverDurable(records, _) => {
                let floor =
                    f64::from(records) * round("fdatasync-1")?.p50_us + round("jsonrpc-1")?.p50_us;
                Some(trial.p50_us / floor)
            }
            Ratio::RateOverFixed(rate, _) => Some(trial.rate / rate),
        }
    }
}

type Runner = Box<dyn Fn(&Setup, &Plan, &str) -> Result<Trial, String>>;

struct Arm {
    id: &'static str,
    title: &'static str,
    unit: &'static str,
    ratio: Ratio,
    /// Further ratios printed for context, with no target (the targets of issue 7 that the
    /// host's disk speed moves).
    context: Vec<Ratio>,
    run: Runner,
}

fn arms() -> Vec<Arm> {
    let callbacks = |mode: &'static str, storage: Storage, sessions: usize| -> Runner {
        Box::new(move |setup, plan, id| {
            arms::callbacks(setup, id, mode, storage.clone(), sessions, &plan.callback)
        })
    };
    let turns = |harness: Harness, tools: Option<&'static str>| -> Runner {
        Box::new(move |setup, plan, id| {
            arms::turns(
                setup,
                id,
                TurnArm { harness, tools },
                64,
                plan.per_session,
                &plan.turns,
            )
        })
    };
    vec![
        Arm {
            id: "pipe",
            title: "baseline: line ping-pong over pipes, 1 in flight",
            unit: "round trips",
            ratio: Ratio::None,
            context: Vec::new(),
            run: Box::new(|_, plan, _| baselines::pipe(&plan.baseline)),
        },
        Arm {
            id: "jsonrpc-1",
            title: "baseline: JSON-RPC ≈1 KiB, reader+writer threads, 1 in flight",
            unit: "calls",
            ratio: Ratio::P50Over("pipe", None),
            context: Vec::new(),
            run: Box::new(|_, plan, _| baselines::jsonrpc(1, &plan.baseline)),
        },
        Arm {
            id: "cb-ephemeral-1",
            title: "callback kv.get, ephemeral, 1 in flight",
            unit: "calls",
            ratio: Ratio::P50Over("jsonrpc-1", Some(1.3)),
            context: Vec::new(),
            run: callbacks("kv", Storage::Ephemeral, 1),
        },
        Arm {
            id: "jsonrpc-64",
            title: "baseline: JSON-RPC ≈1 KiB, reader+writer threads, 64 in flight",
            unit: "calls",
            ratio: Ratio::RateOver("jsonrpc-1", None),
            context: Vec::new(),
            run: Box::new(|_, plan, _| baselines::jsonrpc(64, &plan.baseline)),
        },
        Arm {
            id: "cb-ephemeral-64",
            title: "callback kv.get, ephemeral, 64 sessions",
            unit: "calls",
            ratio: Ratio::RateOver("jsonrpc-64", Some(0.7)),
            context: Vec::new(),
            run: callbacks("kv", Storage::Ephemeral, 64),
        },
        Arm {
            id: "fdatasync-1",
            title: "baseline: 256 B append + fdatasync each",
            unit: "records",
            ratio: Ratio::None,
            context: Vec::new(),
            run: Box::new(|setup, plan, _| baselines::fdatasync(&setup.root, 1, &plan.baseline)),
        },
        Arm {
            id: "cb-durable-1",
            title: "callback model (scripted), durable, 1 in flight",
            unit: "calls",
            ratio: Ratio::P50OverDurable(2, Some(1.0)),
            context: Vec::new(),
            run: callbacks("model", Storage::DataDir, 1),
        },
        Arm {
            id: "fdatasync-64",
            title: "baseline: 64 × 256 B appends per fdatasync",
            unit: "records",
            ratio: Ratio::RateOver("fdatasync-1", None),
            context: Vec::new(),
            run: Box::new(|setup, plan, _| baselines::fdatasync(&setup.root, 64, &plan.baseline)),
        },
        Arm {
            id: "cb-durable-64",
            title: "callback model (scripted), durable, 64 sessions",
            unit: "calls",
            ratio: Ratio::RateOver("jsonrpc-64", Some(0.5)),
            context: vec![Ratio::RateOver("fdatasync-1", None)],
            run: callbacks("model", Storage::DataDir, 64),
        },
        Arm {
            id: "activation-1",
            title: "activation (run, no callback), durable, 1 session",
            unit: "activations",
            ratio: Ratio::P50OverDurable(3, None),
            context: Vec::new(),
            run: Box::new(|setup, plan, id| arms::activations(setup, id, 1, &plan.activation)),
        },
        Arm {
            id: "activation-64",
            title: "activation (run, no callback), durable, 64 sessions",
            unit: "activations",
            ratio: Ratio::RateOver("fdatasync-1", None),
            context: Vec::new(),
            run: Box::new(|setup, plan, id| arms::activations(setup, id, 64, &plan.activation)),
        },
        Arm {
            id: "turns-text",
            title: "text turns, reference harness, 64 sessions / 2 workers, durable",
            unit: "turns",
            ratio: Ratio::RateOver("jsonrpc-64", Some(0.08)),
            context: vec![
                Ratio::RateOver("fdatasync-1", None),
                Ratio::RateOverFixed(5000.0, false),
            ],
            run: turns(Harness::Reference, None),
        },
        Arm {
            id: "turns-tools",
            title: "tool-loop turns (2×4 tools, instant driver), reference harness, durable",
            unit: "turns",
            ratio: Ratio::RateOver("jsonrpc-64", Some(0.02)),
            context: vec![
                Ratio::RateOver("fdatasync-1", None),
                Ratio::RateOverFixed(1000.0, false),
            ],
            run: turns(Harness::Reference, Some("bench")),
        },
        Arm {
            id: "turns-tools-local",
            title: "tool-loop turns, built-in local driver (/bin/echo), reference harness",
            unit: "turns",
            ratio: Ratio::RateOver("turns-tools", None),
            context: Vec::new(),
            run: turns(Harness::Reference, Some("local")),
        },
        Arm {
            id: "turns-text-bench",
            title: "text turns, bench harness (no native state file), durable",
            unit: "turns",
            ratio: Ratio::RateOverFixed(5000.0, false),
            context: Vec::new(),
            run: turns(Harness::Bench, None),
        },
        Arm {
            id: "turns-tools-bench",
            title: "tool-loop turns, bench harness (no native state file), durable",
            unit: "turns",
            ratio: Ratio::RateOverFixed(1000.0, false),
            context: Vec::new(),
            run: turns(Harness::Bench, Some("bench")),
        },
    ]
}

struct Options {
    plan: Plan,
    instructions: bool,
    json: Option<PathBuf>,
    data_dir: PathBuf,
    only: Option<Vec<String>>,
}

fn parse_options(args: &[String]) -> Result<Options, String> {
    let quick = args.iter().any(|a| a == "--quick");
    let mut options = Options {
        plan: if quick { Plan::quick() } else { Plan::full() },
        instructions: false,
        json: None,
        data_dir: PathBuf::from("target/bench-data"),
        only: None,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match arg.as_str() {
            "--quick" => {}
            "--instructions" => options.instructions = true,
            "--json" => options.json = Some(PathBuf::from(value("--json")?)),
            "--data-dir" => options.data_dir = PathBuf::from(value("--data-dir")?),
            "--rounds" => {
                options.plan.rounds = value("--rounds")?
                    .parse()
                    .map_err(|_| "--rounds needs a number")?
            }
            "--sessions" => {
                options.plan.sessions = value("--sessions")?
                    .parse()
                    .map_err(|_| "--sessions needs a number")?
            }
            "--only" => {
                options.only = Some(
                    value("--only")?
                        .split(',')
                        .map(|id| id.trim().to_owned())
                        .collect(),
                )
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(options)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let child = match args.first().map(String::as_str) {
        Some("__echo") => {
            baselines::echo_main();
            return ExitCode::SUCCESS;
        }
        Some("__jsonrpc") => {
            baselines::jsonrpc_child_main();
            return ExitCode::SUCCESS;
        }
        Some("__harness") => return harness::main(),
        Some("__memory") => Some(probes::memory_main as fn(&[String]) -> Result<(), String>),
        Some("__startup") => Some(probes::startup_main as fn(&[String]) -> Result<(), String>),
        Some("__threads") => Some(probes::threads_main as fn(&[String]) -> Result<(), String>),
        Some("__cycles") => Some(probes::cycles_main as fn(&[String]) -> Result<(), String>),
        Some("__instructions") => {
            Some(instructions::child_main as fn(&[String]) -> Result<(), String>)
        }
        _ => None,
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .target(env_logger::Target::Stderr)
        .init();
    if let Some(probe) = child {
        return match probe(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("brain-bench {}: {error}", args[0]);
                ExitCode::FAILURE
            }
        };
    }
    let options = match parse_options(&args) {
        Ok(options) => options,
        Err(error) => {
            if !error.is_empty() {
                eprintln!("brain-bench: {error}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = if options.instructions {
        instructions::run(&options.data_dir, options.plan.quick, options.json.as_ref())
    } else {
        run(&options)
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("brain-bench: {error}");
            ExitCode::FAILURE
        }
    }
}

fn wanted(options: &Options, id: &str) -> bool {
    options
        .only
        .as_ref()
        .is_none_or(|only| only.iter().any(|o| o == id))
}

/// Runs everything; `Ok(false)` when some arm failed.
fn run(options: &Options) -> Result<bool, String> {
    let began = Instant::now();
    let plan = &options.plan;
    std::fs::create_dir_all(&options.data_dir)
        .map_err(|e| format!("{}: {e}", options.data_dir.display()))?;
    let data_dir = options
        .data_dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", options.data_dir.display()))?;
    let spread = spread_runs(&data_dir);
    let root = arms::fresh_dir(&data_dir, &format!("run-{}", std::process::id()))?;
    let setup = Setup::here(root.clone())?;
    let machine = machine(&data_dir);
    let cpu_at_start = cpu_counters();
    println!("brain-bench{}", if plan.quick { " --quick" } else { "" });
    println!("machine: {}", describe_machine(&machine));
    if !spread {
        println!(
            "note: runs in {} share block groups (no ext4 top-directory flag): leave a few minutes after another run's or the tests' cleanup",
            data_dir.display()
        );
    }
    println!(
        "rounds: {}; windows: baselines {:?}, callbacks {:?}, activations {:?}, turns {:?}\n",
        plan.rounds,
        plan.baseline.measure,
        plan.callback.measure,
        plan.activation.measure,
        plan.turns.measure
    );

    let arms: Vec<Arm> = arms()
        .into_iter()
        .filter(|arm| wanted(options, arm.id))
        .collect();
    let mut rounds = rounds::run(&arms, &setup, plan);
    let mut failures = std::mem::take(&mut rounds.failures);
    let trials = &rounds.trials;

    // Medians over rounds, and the median of the per-round ratios.
    let mut rows = Vec::new();
    let mut targets = Vec::new();
    for (index, arm) in arms.iter().enumerate() {
        let done: Vec<&Trial> = trials[index].iter().flatten().collect();
        let medians = Trial {
            rate: median(&done.iter().map(|t| t.rate).collect::<Vec<_>>()),
            p50_us: median(&done.iter().map(|t| t.p50_us).collect::<Vec<_>>()),
            p99_us: median(&done.iter().map(|t| t.p99_us).collect::<Vec<_>>()),
            count: done.iter().map(|t| t.count).sum(),
            wall_s: done.iter().map(|t| t.wall_s).sum(),
            cpus_used: median(&done.iter().map(|t| t.cpus_used).collect::<Vec<_>>()),
            other_share: median(&done.iter().map(|t| t.other_share).collect::<Vec<_>>()),
            sleeps_per_op: median(&done.iter().map(|t| t.sleeps_per_op).collect::<Vec<_>>()),
            records_per_flush: {
                let batching: Vec<f64> = done.iter().filter_map(|t| t.records_per_flush).collect();
                (!batching.is_empty()).then(|| median(&batching))
            },
        };
        let ratios: Vec<f64> = (0..plan.rounds)
            .filter_map(|r| {
                let trial = trials[index].get(r)?.as_ref()?;
                arm.ratio
                    .value(trial, &|id| rounds.baseline(&arms, index, id, r))
            })
            .collect();
        let ratio = (!ratios.is_empty()).then(|| median(&ratios));
        let met = ratio.and_then(|value| arm.ratio.met(value));
        let context: Vec<Value> = arm
            .context
            .iter()
            .filter_map(|extra| {
                let per_round: Vec<f64> = (0..plan.rounds)
                    .filter_map(|r| {
                        let trial = trials[index].get(r)?.as_ref()?;
                        extra.value(trial, &|id| rounds.baseline(&arms, index, id, r))
                    })
                    .collect();
                (!per_round.is_empty()).then(|| {
                    json!({
                        "value": round(median(&per_round), 3),
                        "per_round": per_round.iter().map(|v| round(*v, 3)).collect::<Vec<_>>(),
                        "of": extra.describe(),
                    })
                })
            })
            .collect();
        // For a throughput target against a baseline: how the arm's rate followed that
        // baseline's trial (paired, or the round's) from round to round.
        let host_speed = match arm.ratio {
            Ratio::RateOver(base, Some(_)) => {
                let pairs: Vec<(f64, f64)> = (0..plan.rounds)
                    .filter_map(|r| {
                        let baseline = rounds.baseline(&arms, index, base, r)?;
                        let trial = trials[index].get(r)?.as_ref()?;
                        Some((baseline.rate, trial.rate))
                    })
                    .collect();
                rounds::host_speed(&pairs).map(|speed| {
                    let half = |half: &rounds::Half| {
                        json!({
                            "baseline_rate": round(half.baseline, 1),
                            "rate": round(half.rate, 1),
                            "ratio": round(half.ratio(), 3),
                        })
                    };
                    json!({
                        "baseline": base,
                        "slower_half": half(&speed.slower),
                        "faster_half": half(&speed.faster),
                    })
                })
            }
            _ => None,
        };
        if let (Some(value), Some(target)) = (ratio, arm.ratio.target()) {
            targets.push(json!({
                "target": format!("{}: {} {target}", arm.id, arm.ratio.describe()),
                "measured": round(value, 3),
                "met": met,
            }));
        }
        rows.push(json!({
            "id": arm.id,
            "title": arm.title,
            "unit": arm.unit,
            "trials": trials[index].iter().map(|t| t.as_ref().map(Trial::to_json)).collect::<Vec<_>>(),
            "paired_baseline": rounds::paired_baseline(&arms, index).map(|base| json!({
                "id": arms[base].id,
                "trials": rounds.paired[index].iter().map(|t| t.as_ref().map(Trial::to_json)).collect::<Vec<_>>(),
            })),
            "median": medians.to_json(),
            "ratio": ratio.map(|value| json!({
                "value": round(value, 3),
                "per_round": ratios.iter().map(|v| round(*v, 3)).collect::<Vec<_>>(),
                "of": arm.ratio.describe(),
                "target": arm.ratio.target(),
                "met": met,
            })),
            "context": context,
            "host_speed": host_speed,
        }));
    }
    print_table(&rows);

    // Memory, startup and threads: one-off probes in fresh processes.
    let mut probes = serde_json::Map::new();
    let sessions_dir = root.join("sessions");
    let mut memory_done = false;
    if wanted(options, "memory") || wanted(options, "startup") {
        let count = plan.sessions.to_string();
        let dir = arms::fresh_dir(&root, "sessions")?;
        let dir_text = dir.to_string_lossy().into_owned();
        eprintln!("memory: creating {count} sessions with one activation each …");
        match probes::child_json(&["__memory", &dir_text, &count]) {
            Ok(memory) => {
                targets.extend(probes::memory_targets(
                    "memory", "session", &memory, 8192.0, "8192",
                ));
                probes.insert("memory".into(), memory);
                memory_done = true;
            }
            Err(error) => failures.push(("memory".into(), error)),
        }
    }
    if wanted(options, "startup") && memory_done {
        let empty = arms::fresh_dir(&root, "empty")?;
        let mut runs = Vec::new();
        for _ in 0..if plan.quick { 1 } else { 3 } {
            for (label, dir) in [("empty", &empty), ("sessions", &sessions_dir)] {
                // The empty directory must stay empty of sessions: start it afresh each time.
                if label == "empty" {
                    arms::fresh_dir(&root, "empty")?;
                }
                match probes::startup(dir) {
                    Ok(value) => runs.push((label, value)),
                    Err(error) => failures.push(("startup".into(), error)),
                }
            }
        }
        let pick = |label: &str, key: &str| {
            median(
                &runs
                    .iter()
                    .filter(|(l, _)| *l == label)
                    .filter_map(|(_, v)| v[key].as_f64())
                    .collect::<Vec<_>>(),
            )
        };
        let init = |label: &str| {
            median(
                &runs
                    .iter()
                    .filter(|(l, _)| *l == label)
                    .filter_map(|(_, v)| {
                        v["init_ms"]
                            .as_array()?
                            .iter()
                            .filter_map(Value::as_f64)
                            .reduce(f64::max)
                    })
                    .collect::<Vec<_>>(),
            )
        };
        let sessions = runs
            .iter()
            .filter(|(l, _)| *l == "sessions")
            .filter_map(|(_, v)| v["sessions"].as_u64())
            .max()
            .unwrap_or(0);
        let recovered =
            (pick("sessions", "private") - pick("empty", "private")) / sessions.max(1) as f64;
        let start_ms = pick("sessions", "start_ms");
        let init_ms = init("sessions");
        let beyond = start_ms - init_ms;
        targets.push(json!({
            "target": format!("startup with {sessions} sessions: Brain::start to ready ≤ 1000 ms + the workers' initialize time"),
            "measured": round(beyond, 1),
            "met": beyond <= 1000.0,
        }));
        probes.insert(
            "startup".into(),
            json!({
                "sessions": sessions,
                "start_ms": round(start_ms, 1),
                "exec_to_ready_ms": round(pick("sessions", "exec_ms"), 1),
                "init_ms": round(init_ms, 1),
                "start_beyond_init_ms": round(beyond, 1),
                "empty_start_ms": round(pick("empty", "start_ms"), 1),
                "empty_exec_to_ready_ms": round(pick("empty", "exec_ms"), 1),
                "empty_init_ms": round(init("empty"), 1),
                "private_bytes": pick("sessions", "private"),
                "empty_private_bytes": pick("empty", "private"),
                "recovered_passivated_bytes_per_session": round(recovered, 0),
                "runs": runs.iter().map(|(l, v)| json!({"dir": l, "figures": v})).collect::<Vec<_>>(),
            }),
        );
    }
    if wanted(options, "memory-real") {
        match probes::realistic_memory(&root, plan.sessions) {
            Ok((memory, more)) => {
                probes.insert("memory_realistic".into(), memory);
                targets.extend(more);
            }
            Err(error) => failures.push(("memory-real".into(), error)),
        }
    }
    if wanted(options, "cycles") {
        let (count, warmup) = if plan.quick {
            (100, 20)
        } else {
            (10_000, 1_000)
        };
        match probes::cycles(&root, count, warmup) {
            Ok((cycles, more)) => {
                probes.insert("cycles".into(), cycles);
                targets.extend(more);
            }
            Err(error) => failures.push(("cycles".into(), error)),
        }
    }
    if wanted(options, "threads") {
        let root_text = root.to_string_lossy().into_owned();
        let (sessions, wait_ms) = if plan.quick {
            ("100", "400")
        } else {
            ("1000", "1500")
        };
        match probes::child_json(&["__threads", &root_text, sessions, wait_ms]) {
            Ok(threads) => {
                let at = |workers: u64| {
                    threads["idle"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .find(|e| e["workers"].as_u64() == Some(workers))
                        .and_then(|e| e["threads"].as_f64())
                        .unwrap_or(0.0)
                };
                let per_worker = (at(8) - at(1)) / 7.0;
                let constant = at(1) - per_worker - number(&threads["without_brain"]);
                let load = &threads["two_workers"];
                let growth = number(&load["with_sessions"]) - number(&load["idle"]);
                let running = number(&load["activations_64_running"]) - number(&load["idle"]);
                targets.push(json!({
                    "target": "threads: ≤ 3 per worker",
                    "measured": round(per_worker, 2), "met": per_worker <= 3.0,
                }));
                targets.push(json!({
                    "target": format!("threads: none per session ({} open) or per activation (64 running)", load["sessions"]),
                    "measured": growth.max(running), "met": growth <= 0.0 && running <= 0.0,
                }));
                let mut threads = threads;
                threads["per_worker"] = json!(round(per_worker, 2));
                threads["constant"] = json!(round(constant, 2));
                probes.insert("threads".into(), threads);
            }
            Err(error) => failures.push(("threads".into(), error)),
        }
    }
    print_probes(&probes);
    print_targets(&targets);
    if plan.quick {
        println!("  (--quick: a smoke test; its figures and verdicts mean nothing)");
    }
    for (id, error) in &failures {
        println!("FAILED {id}: {error}");
    }
    let elapsed = began.elapsed().as_secs_f64();
    let other = cpu_counters().other_share_since(&cpu_at_start);
    println!(
        "\nwhole run: {elapsed:.0} s; load average {} before it; other processes used {:.0} % of the CPUs during it{}",
        machine["load_average_at_start"],
        other * 100.0,
        if other > 0.1 {
            " (the figures are provisional: other work ran on the machine)"
        } else {
            ""
        }
    );
    if let Some(path) = &options.json {
        let document = json!({
            "quick": plan.quick,
            "rounds": plan.rounds,
            "machine": machine,
            "other_cpu_share": round(other, 3),
            "arms": rows,
            "probes": probes,
            "targets": targets,
            "failures": failures.iter().map(|(id, e)| json!({"id": id, "error": e})).collect::<Vec<_>>(),
            "elapsed_s": round(elapsed, 1),
        });
        let text = serde_json::to_string_pretty(&document).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        println!("JSON written to {}", path.display());
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(failures.is_empty())
}
