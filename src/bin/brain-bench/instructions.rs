//! `brain-bench --instructions`: instructions per operation, counted by valgrind's callgrind for
//! the Brain process alone, against the instructions per call of the JSON-RPC baseline's parent
//! process. Unlike the timed arms these figures do not depend on the host's speed or on the disk.
//!
//! Each workload runs in a child process, `brain-bench __instructions WORKLOAD N DIR`, under
//! `valgrind --tool=callgrind` (children not traced: the harness workers and the JSON-RPC
//! baseline's child run natively and are not counted). It does exactly N operations, one at a
//! time: N callbacks from one session on one bench worker, or N turns from one client on two
//! reference-harness workers (a session replaced every 4 turns, as in the timed arms). Each
//! workload runs at two counts, and the figure is the difference of the two totals divided by
//! the difference of the counts, so that starting and stopping Brain (and valgrind) cancel out.
//! The whole measurement runs twice, and both figures are printed to show how repeatable they are.

use crate::Window;
use crate::arms::{self, Harness, Setup, TurnArm};
use crate::baselines;
use brain::Storage;
use brain::effects::Effects;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Turns per session in the turn workloads (as in the timed arms).
const PER_SESSION: usize = 4;

/// What a workload's figure is held to.
#[derive(Clone, Copy, Debug)]
enum Budget {
    /// The baseline itself.
    None,
    /// At most this many times the JSON-RPC baseline's instructions per call.
    TimesBaseline(f64),
    /// At most this many instructions per operation.
    Fixed(f64),
}

/// One fixed workload.
struct Workload {
    id: &'static str,
    title: &'static str,
    unit: &'static str,
    budget: Budget,
    /// The two counts of operations (full run; quick uses a tenth of each, at least 2 and 4).
    counts: (u64, u64),
}

fn workloads() -> Vec<Workload> {
    vec![
        Workload {
            id: "jsonrpc",
            title: "baseline: JSON-RPC ≈1 KiB, reader+writer threads, 1 in flight (parent process)",
            unit: "call",
            budget: Budget::None,
            counts: (200, 2200),
        },
        Workload {
            id: "kv-get",
            title: "callback kv.get (≈1 KiB answer), ephemeral, 1 session",
            unit: "call",
            budget: Budget::TimesBaseline(1.5),
            counts: (200, 2200),
        },
        Workload {
            id: "model-durable",
            title: "callback model (≈1 KiB, scripted echo), durable, 1 session",
            unit: "call",
            budget: Budget::TimesBaseline(3.0),
            counts: (200, 2200),
        },
        Workload {
            id: "turn-text",
            title: "text turn, reference harness, durable, 1 client (session replaced every 4 turns)",
            unit: "turn",
            budget: Budget::Fixed(TEXT_TURN_BUDGET),
            counts: (40, 440),
        },
        Workload {
            id: "turn-tools",
            title: "tool-loop turn (3 model calls, 8 tool calls), reference harness, durable, 1 client",
            unit: "turn",
            budget: Budget::Fixed(TOOL_TURN_BUDGET),
            counts: (20, 220),
        },
    ]
}

/// Instructions per text turn the Brain process may execute (the bench's client thread included).
pub const TEXT_TURN_BUDGET: f64 = 245_000.0;
/// Instructions per tool-loop turn the Brain process may execute.
pub const TOOL_TURN_BUDGET: f64 = 1_900_000.0;

/// `__instructions WORKLOAD N DIR`: does exactly N operations of WORKLOAD with a data directory
/// in DIR (run under callgrind by [`run`]).
pub fn child_main(args: &[String]) -> Result<(), String> {
    let usage = "usage: __instructions WORKLOAD N DIR";
    let id = args.first().ok_or(usage)?;
    let n: u64 = args.get(1).and_then(|n| n.parse().ok()).ok_or(usage)?;
    let dir = Path::new(args.get(2).ok_or(usage)?);
    let setup = Setup::here(dir.to_path_buf())?;
    match id.as_str() {
        "jsonrpc" => {
            let window = Window {
                warmup: Duration::ZERO,
                measure: Duration::from_secs(24 * 3600),
            };
            let trial = baselines::jsonrpc_calls(1, &window, Some(n))?;
            if trial.count != n {
                return Err(format!("{} JSON-RPC calls made, not {n}", trial.count));
            }
            Ok(())
        }
        "kv-get" => callbacks(&setup, "kv", Storage::Ephemeral, n, dir),
        "model-durable" => callbacks(&setup, "model", Storage::DataDir, n, dir),
        "turn-text" => turns(&setup, None, n, dir),
        "turn-tools" => turns(&setup, Some("bench"), n, dir),
        other => Err(format!("unknown workload {other:?}")),
    }
}

/// `n` callbacks of `mode` from one session on one bench worker.
fn callbacks(
    setup: &Setup,
    mode: &str,
    storage: Storage,
    n: u64,
    dir: &Path,
) -> Result<(), String> {
    let brain = arms::start_brain(setup, Harness::Bench, 1, storage, dir, Effects::default())?;
    let result = (|| {
        let request = json!({"agentloop": {"name": "bench", "configuration": {"bench": mode}}});
        let session = arms::create(&brain, &request)?;
        let activation = session
            .send(arms::text(json!({ "calls": n }).to_string()))
            .map_err(|e| format!("send: {e}"))?;
        let outcome = activation
            .wait_timeout(Duration::from_secs(600))
            .ok_or("the activation did not finish")?;
        let result = arms::completed(&outcome)?.ok_or("the harness answered no result")?;
        match result["calls"].as_u64() {
            Some(calls) if calls == n => Ok(()),
            calls => Err(format!("the harness made {calls:?} calls, not {n}")),
        }
    })();
    arms::finish(brain);
    result
}

/// `n` turns from one client, replacing its session every [`PER_SESSION`] turns.
fn turns(setup: &Setup, tools: Option<&'static str>, n: u64, dir: &Path) -> Result<(), String> {
    let arm = TurnArm {
        harness: Harness::Reference,
        tools,
    };
    let (brain, request) = arms::turn_brain(setup, dir, arm, PER_SESSION)?;
    let result = (|| {
        let mut session: Option<brain::Session> = None;
        for turn in 0..n as usize {
            if turn % PER_SESSION == 0 {
                if let Some(old) = session.take() {
                    old.close().map_err(|e| format!("close: {e}"))?;
                }
                session = Some(arms::create(&brain, &request)?);
            }
            let current = session.as_ref().ok_or("no session")?;
            let activation = current
                .send(arms::text("hello"))
                .map_err(|e| format!("send: {e}"))?;
            arms::completed(&activation.wait())?;
        }
        if let Some(old) = session.take() {
            old.close().map_err(|e| format!("close: {e}"))?;
        }
        Ok(())
    })();
    arms::finish(brain);
    result
}

/// The total instructions (`Ir`) of a callgrind output file.
fn total_instructions(path: &Path) -> Result<u64, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    text.lines()
        .find_map(|line| {
            line.strip_prefix("summary:")
                .or_else(|| line.strip_prefix("totals:"))
        })
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("{}: no summary line", path.display()))
}

/// Runs one workload at `n` operations under callgrind and returns the process's instructions.
fn measure(exe: &Path, root: &Path, id: &str, n: u64, tag: &str) -> Result<u64, String> {
    let dir = arms::fresh_dir(root, &format!("{id}-{n}-{tag}"))?;
    let out = root.join(format!("callgrind.{id}-{n}-{tag}.out"));
    let output = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg("--trace-children=no")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(exe)
        .arg("__instructions")
        .arg(id)
        .arg(n.to_string())
        .arg(&dir)
        .output()
        .map_err(|e| format!("running valgrind (is it installed?): {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(8).collect();
        return Err(format!(
            "{id} × {n} under callgrind failed ({}): {}",
            output.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    let total = total_instructions(&out)?;
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(total)
}

/// Instructions per operation of one workload: the difference between the totals at its two
/// counts over the difference of the counts.
fn per_operation(
    exe: &Path,
    root: &Path,
    workload: &Workload,
    counts: (u64, u64),
    tag: &str,
) -> Result<f64, String> {
    let low = measure(exe, root, workload.id, counts.0, tag)?;
    let high = measure(exe, root, workload.id, counts.1, tag)?;
    Ok((high as f64 - low as f64) / (counts.1 - counts.0) as f64)
}

/// Runs every workload (twice, or once with `quick`) and prints the table; `Ok(false)` when a
/// workload failed. Budgets are reported, not enforced: the exit status says only whether every
/// workload ran.
pub fn run(data_dir: &Path, quick: bool, json_path: Option<&PathBuf>) -> Result<bool, String> {
    let began = Instant::now();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    std::fs::create_dir_all(data_dir).map_err(|e| format!("{}: {e}", data_dir.display()))?;
    let root = arms::fresh_dir(data_dir, &format!("instructions-{}", std::process::id()))?;
    let repeats = if quick { 1 } else { 2 };
    println!(
        "brain-bench --instructions{}: callgrind, the Brain process alone; {repeats} measurement(s) of each workload\n",
        if quick { " --quick" } else { "" }
    );
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let mut baseline: Option<f64> = None;
    for workload in workloads() {
        let counts = if quick {
            (
                (workload.counts.0 / 10).max(2),
                (workload.counts.1 / 10).max(4),
            )
        } else {
            workload.counts
        };
        let mut figures = Vec::new();
        for repeat in 0..repeats {
            match per_operation(&exe, &root, &workload, counts, &format!("r{repeat}")) {
                Ok(figure) => {
                    eprintln!(
                        "instructions {:<14} run {}: {:>10.0} per {} ({} − {} {}s)",
                        workload.id,
                        repeat + 1,
                        figure,
                        workload.unit,
                        counts.1,
                        counts.0,
                        workload.unit
                    );
                    figures.push(figure);
                }
                Err(error) => {
                    eprintln!("instructions {:<14} FAILED: {error}", workload.id);
                    failures.push(json!({"id": workload.id, "error": error}));
                    break;
                }
            }
        }
        if figures.is_empty() {
            continue;
        }
        let mean = figures.iter().sum::<f64>() / figures.len() as f64;
        let spread = figures.iter().cloned().fold(f64::MIN, f64::max)
            - figures.iter().cloned().fold(f64::MAX, f64::min);
        let (ratio, limit, of) = match workload.budget {
            Budget::None => {
                baseline = Some(mean);
                (None, None, String::new())
            }
            Budget::TimesBaseline(times) => (
                baseline.map(|base| mean / base),
                Some(times),
                "per call / jsonrpc per call".to_owned(),
            ),
            Budget::Fixed(budget) => (Some(mean / budget), Some(1.0), format!("/ {budget:.0}")),
        };
        let met = ratio.zip(limit).map(|(ratio, limit)| ratio <= limit);
        rows.push(json!({
            "id": workload.id,
            "title": workload.title,
            "unit": workload.unit,
            "counts": [counts.0, counts.1],
            "per_operation": figures.iter().map(|f| f.round()).collect::<Vec<_>>(),
            "mean": mean.round(),
            "spread": spread.round(),
            "ratio": ratio.map(|r| (r * 1000.0).round() / 1000.0),
            "of": of,
            "limit": limit,
            "met": met,
        }));
    }
    println!(
        "{:<14} {:>12} {:>12} {:>9} {:>7}  {:<28} target",
        "workload", "per op", "run 2", "spread", "ratio", "ratio of"
    );
    for row in &rows {
        let per = row["per_operation"].as_array().cloned().unwrap_or_default();
        let fmt = |v: Option<&Value>| {
            v.and_then(Value::as_f64)
                .map(|v| format!("{v:.0}"))
                .unwrap_or_default()
        };
        let verdict = match row["met"].as_bool() {
            Some(true) => " met",
            Some(false) => " NOT MET",
            None => "",
        };
        println!(
            "{:<14} {:>12} {:>12} {:>9} {:>7}  {:<28} {}{}",
            row["id"].as_str().unwrap_or_default(),
            fmt(per.first()),
            fmt(per.get(1)),
            fmt(Some(&row["spread"])),
            row["ratio"]
                .as_f64()
                .map(|r| format!("{r:.3}"))
                .unwrap_or_default(),
            row["of"].as_str().unwrap_or_default(),
            row["limit"]
                .as_f64()
                .map(|l| format!("≤ {l}"))
                .unwrap_or_default(),
            verdict,
        );
    }
    println!();
    for row in &rows {
        println!(
            "  {:<14} {} (instructions per {})",
            row["id"].as_str().unwrap_or_default(),
            row["title"].as_str().unwrap_or_default(),
            row["unit"].as_str().unwrap_or_default()
        );
    }
    if quick {
        println!("  (--quick: a smoke test; its figures and verdicts mean nothing)");
    }
    for failure in &failures {
        println!("FAILED {}: {}", failure["id"], failure["error"]);
    }
    println!("\nwhole run: {:.0} s", began.elapsed().as_secs_f64());
    if let Some(path) = json_path {
        let document = json!({"quick": quick, "workloads": rows, "failures": failures});
        let text = serde_json::to_string_pretty(&document).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        println!("JSON written to {}", path.display());
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(failures.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_is_read_from_a_callgrind_file() {
        let dir = std::env::temp_dir().join(format!("brain-bench-cg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("callgrind.out");
        std::fs::write(
            &path,
            "# callgrind format\nversion: 1\nevents: Ir\nsummary: 201244929\n\nfn=(1) main\n3 10\ntotals: 201244929\n",
        )
        .unwrap();
        assert_eq!(total_instructions(&path).unwrap(), 201_244_929);
        std::fs::write(&path, "events: Ir\n").unwrap();
        let error = total_instructions(&path).unwrap_err();
        assert!(error.contains("no summary line"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_budget_but_the_baselines_is_stated() {
        let workloads = workloads();
        assert!(matches!(workloads[0].budget, Budget::None));
        for workload in &workloads[1..] {
            assert!(!matches!(workload.budget, Budget::None), "{}", workload.id);
            assert!(workload.counts.1 > workload.counts.0, "{}", workload.id);
        }
    }
}
