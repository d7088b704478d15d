//! The printed report: the table of timed arms, the probes and the targets.

use crate::probes::number;
use serde_json::Value;

pub(crate) fn print_table(rows: &[Value]) {
    println!(
        "{:<18} {:>10} {:>10} {:>10} {:>5} {:>7} {:>7}  {:<44} target",
        "arm", "rate /s", "p50 µs", "p99 µs", "CPUs", "sleeps", "ratio", "ratio of"
    );
    for row in rows {
        let median = &row["median"];
        let ratio = &row["ratio"];
        let verdict = match ratio["met"].as_bool() {
            Some(true) => " met",
            Some(false) => " NOT MET",
            None => "",
        };
        println!(
            "{:<18} {:>10.0} {:>10.1} {:>10.1} {:>5.2} {:>7.2} {:>7}  {:<44} {}{}",
            row["id"].as_str().unwrap_or_default(),
            number(&median["rate"]),
            number(&median["p50_us"]),
            number(&median["p99_us"]),
            number(&median["cpus_used"]),
            number(&median["sleeps_per_op"]),
            ratio["value"]
                .as_f64()
                .map(|v| format!("{v:.3}"))
                .unwrap_or_default(),
            ratio["of"].as_str().unwrap_or_default(),
            ratio["target"].as_str().unwrap_or_default(),
            verdict
        );
    }
    for row in rows {
        for extra in row["context"].as_array().into_iter().flatten() {
            println!(
                "  {:<18} {:>7.3}  {} (context)",
                row["id"].as_str().unwrap_or_default(),
                number(&extra["value"]),
                extra["of"].as_str().unwrap_or_default(),
            );
        }
    }
    for row in rows {
        let speed = &row["host_speed"];
        if speed.is_null() {
            continue;
        }
        let (slower, faster) = (&speed["slower_half"], &speed["faster_half"]);
        println!(
            "  {:<18} {:>7.3} | {:.3}  ratio in the rounds whose {} ran slower | faster \
             ({} × {:.2}, the arm × {:.2})",
            row["id"].as_str().unwrap_or_default(),
            number(&slower["ratio"]),
            number(&faster["ratio"]),
            speed["baseline"].as_str().unwrap_or_default(),
            speed["baseline"].as_str().unwrap_or_default(),
            number(&faster["baseline_rate"]) / number(&slower["baseline_rate"]),
            number(&faster["rate"]) / number(&slower["rate"]),
        );
    }
    println!();
    for row in rows {
        println!(
            "  {:<18} {} ({}/s)",
            row["id"].as_str().unwrap_or_default(),
            row["title"].as_str().unwrap_or_default(),
            row["unit"].as_str().unwrap_or_default()
        );
    }
    println!();
}

pub(crate) fn print_probes(probes: &serde_json::Map<String, Value>) {
    if let Some(memory) = probes.get("memory") {
        println!(
            "memory ({} sessions, private bytes of the Brain process): {:.0} B per open idle session, {:.0} B per passivated session (before {} B, open {} B, passivated {} B; opening took {:.1} s)",
            memory["sessions"],
            number(&memory["open_idle_bytes_per_session"]),
            number(&memory["passivated_bytes_per_session"]),
            memory["private_before"],
            memory["private_open"],
            memory["private_passivated"],
            number(&memory["open_seconds"]),
        );
        if let (Some(open), Some(passivated)) = (
            memory["heap_open_bytes_per_session"].as_f64(),
            memory["heap_passivated_bytes_per_session"].as_f64(),
        ) {
            println!(
                "memory (heap in use, glibc mallinfo2): {open:.0} B per open idle session, {passivated:.0} B per passivated session; the rest of the private figure is freed memory the allocator keeps"
            );
        }
    }
    if let Some(memory) = probes.get("memory_realistic") {
        println!(
            "memory-real ({} sessions created with a {} B realistic request): {:.0} B per open idle session, {:.0} B per passivated session, {:.0} B per closed one; heap in use {:.0} B, {:.0} B and {:.0} B",
            memory["sessions"],
            memory["request_bytes"],
            number(&memory["open_idle_bytes_per_session"]),
            number(&memory["passivated_bytes_per_session"]),
            number(&memory["closed_bytes_per_session"]),
            number(&memory["heap_open_bytes_per_session"]),
            number(&memory["heap_passivated_bytes_per_session"]),
            number(&memory["heap_closed_bytes_per_session"]),
        );
    }
    if let Some(cycles) = probes.get("cycles") {
        println!(
            "cycles ({} create → activate → close → delete after {} of warm-up, {:.1} s): private memory grew {} B ({} B in the second half), heap in use {} B ({} B)",
            cycles["cycles"],
            cycles["warmup"],
            number(&cycles["seconds"]),
            cycles["private_growth"],
            cycles["private_growth_second_half"],
            cycles["heap_growth"],
            cycles["heap_growth_second_half"],
        );
    }
    if let Some(startup) = probes.get("startup") {
        println!(
            "startup ({} sessions on disk): Brain::start to ready {} ms (workers' initialize {} ms), exec to ready {} ms; empty data directory: {} ms (initialize {} ms), exec to ready {} ms; private memory after the start {} B more than with the empty directory: {} B per recovered passivated session",
            startup["sessions"],
            startup["start_ms"],
            startup["init_ms"],
            startup["exec_to_ready_ms"],
            startup["empty_start_ms"],
            startup["empty_init_ms"],
            startup["empty_exec_to_ready_ms"],
            number(&startup["private_bytes"]) - number(&startup["empty_private_bytes"]),
            startup["recovered_passivated_bytes_per_session"],
        );
    }
    if let Some(threads) = probes.get("threads") {
        println!(
            "threads: without Brain {}; idle by workers {}; 2 workers idle / {} sessions open / 64 activations running: {} / {} / {}; {} per worker + {} constant",
            threads["without_brain"],
            threads["idle"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| format!("{}→{}", e["workers"], e["threads"]))
                .collect::<Vec<_>>()
                .join(", "),
            threads["two_workers"]["sessions"],
            threads["two_workers"]["idle"],
            threads["two_workers"]["with_sessions"],
            threads["two_workers"]["activations_64_running"],
            threads["per_worker"],
            threads["constant"],
        );
    }
    println!();
}

pub(crate) fn print_targets(targets: &[Value]) {
    println!("targets (issues 7 and 27):");
    for target in targets {
        let verdict = match target["met"].as_bool() {
            Some(true) => "met",
            Some(false) => "NOT MET",
            None => "?",
        };
        println!(
            "  {:<8} {}  — measured {}",
            verdict,
            target["target"].as_str().unwrap_or_default(),
            target["measured"]
        );
    }
}
