//! The baselines Brain is compared with, measured in the same run: a bare line ping-pong over
//! pipes, a JSON-RPC exchange through reader and writer threads, and `fdatasync` on the data
//! directory's filesystem.

use crate::Window;
use crate::stats::{Histogram, Trial};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Bytes of padding in the JSON-RPC baseline's params, making the request and its echoed
/// response about 1 KiB each.
pub const PAD_BYTES: usize = 900;

/// Starts this binary again as `subcommand` with piped stdin and stdout.
fn spawn_child(subcommand: &str) -> Result<(Child, ChildStdin, ChildStdout), String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut child = Command::new(exe)
        .arg(subcommand)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawning {subcommand}: {e}"))?;
    let stdin = child.stdin.take().ok_or("no stdin")?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    Ok((child, stdin, stdout))
}

/// Parent/child line ping-pong over pipes, one line in flight, one thread on each side.
pub fn pipe(window: &Window) -> Result<Trial, String> {
    let (mut child, stdin, stdout) = spawn_child("__echo")?;
    let mut writer = BufWriter::new(stdin);
    let mut reader = BufReader::new(stdout);
    let line = format!("{}\n", "p".repeat(63));
    let mut answer = String::with_capacity(128);
    let mut histogram = Histogram::default();
    let (start, end) = window.instants();
    loop {
        let began = Instant::now();
        if began >= end {
            break;
        }
        writer
            .write_all(line.as_bytes())
            .and_then(|()| writer.flush())
            .map_err(|e| format!("pipe write: {e}"))?;
        answer.clear();
        let read = reader
            .read_line(&mut answer)
            .map_err(|e| format!("pipe read: {e}"))?;
        if read == 0 {
            return Err("the echo child closed its stdout".into());
        }
        if began >= start {
            histogram.record(began.elapsed().as_nanos() as u64);
        }
    }
    drop(writer);
    let _ = child.wait();
    let rate = histogram.count() as f64 / window.measure.as_secs_f64();
    Ok(Trial::from_histogram(&histogram, rate))
}

/// The `__echo` child: writes every line back.
pub fn echo_main() {
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    let mut line = Vec::with_capacity(128);
    let mut input = stdin.lock();
    loop {
        line.clear();
        match input.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if stdout
            .write_all(&line)
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return;
        }
    }
}

/// The ≈1 KiB params of a JSON-RPC baseline request (shaped like a `brain/call`).
pub fn rpc_params() -> Value {
    json!({
        "session_id": "ses_0123456789ABCDEFGHIJ",
        "sequence": 12,
        "method": "kv.get",
        "input": {"key": "bench", "pad": "x".repeat(PAD_BYTES)},
    })
}

type Pending = Arc<Mutex<HashMap<u64, crossbeam_channel::Sender<Value>>>>;

/// JSON-RPC over pipes with serde_json, as Brain and the harness SDK do it: in this process,
/// callers encode requests and hand them to a writer thread, and a reader thread decodes each
/// response and routes it back by id; the child (`__jsonrpc`) decodes each request on its reader
/// thread and hands it to its writer thread, which encodes the response (the params echoed as the
/// result) and writes it.
/// `inflight` caller threads each keep one request in flight.
pub fn jsonrpc(inflight: usize, window: &Window) -> Result<Trial, String> {
    jsonrpc_calls(inflight, window, None)
}

/// [`jsonrpc`], each caller stopping after `calls` calls when given (whatever the window), so
/// that the instruction counts have a fixed workload.
pub fn jsonrpc_calls(
    inflight: usize,
    window: &Window,
    calls: Option<u64>,
) -> Result<Trial, String> {
    let (mut child, stdin, stdout) = spawn_child("__jsonrpc")?;
    let pending: Pending = Arc::default();
    let (lines_tx, lines_rx) = crossbeam_channel::unbounded::<Vec<u8>>();
    let writer = std::thread::Builder::new()
        .name("rpc-write".into())
        .spawn(move || write_lines(lines_rx, stdin))
        .map_err(|e| e.to_string())?;
    let reader = {
        let pending = pending.clone();
        std::thread::Builder::new()
            .name("rpc-read".into())
            .spawn(move || {
                let mut reader = BufReader::new(stdout);
                let mut line = Vec::with_capacity(2048);
                loop {
                    line.clear();
                    match reader.read_until(b'\n', &mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    let Ok(mut message) = serde_json::from_slice::<Value>(&line) else {
                        continue;
                    };
                    let Some(id) = message.get("id").and_then(Value::as_u64) else {
                        continue;
                    };
                    let result = message
                        .get_mut("result")
                        .map(Value::take)
                        .unwrap_or(Value::Null);
                    if let Some(waiter) = pending.lock().remove(&id) {
                        let _ = waiter.send(result);
                    }
                }
            })
            .map_err(|e| e.to_string())?
    };
    let next_id = Arc::new(AtomicU64::new(1));
    let params = rpc_params();
    let (start, end) = window.instants();
    let callers: Vec<_> = (0..inflight)
        .map(|_| {
            let (pending, lines_tx, next_id, params) = (
                pending.clone(),
                lines_tx.clone(),
                next_id.clone(),
                params.clone(),
            );
            std::thread::spawn(move || -> Result<Histogram, String> {
                let mut histogram = Histogram::default();
                let mut made = 0u64;
                loop {
                    let began = Instant::now();
                    let done = match calls {
                        Some(calls) => made >= calls,
                        None => began >= end,
                    };
                    if done {
                        return Ok(histogram);
                    }
                    made += 1;
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    let (answer_tx, answer_rx) = crossbeam_channel::bounded(1);
                    pending.lock().insert(id, answer_tx);
                    let request = json!({
                        "jsonrpc": "2.0", "id": id, "method": "brain/call", "params": params.clone(),
                    });
                    let mut line = serde_json::to_vec(&request).map_err(|e| e.to_string())?;
                    line.push(b'\n');
                    lines_tx.send(line).map_err(|_| "the writer stopped")?;
                    let answer = answer_rx.recv().map_err(|_| "the reader stopped")?;
                    if answer.get("input").is_none() {
                        return Err("the JSON-RPC child answered something else".into());
                    }
                    if began >= start {
                        histogram.record(began.elapsed().as_nanos() as u64);
                    }
                }
            })
        })
        .collect();
    drop(lines_tx);
    let mut histogram = Histogram::default();
    let mut failure = None;
    for caller in callers {
        match caller.join() {
            Ok(Ok(mine)) => histogram.merge(&mine),
            Ok(Err(error)) => failure = Some(error),
            Err(_) => failure = Some("a caller panicked".into()),
        }
    }
    let _ = writer.join();
    let _ = child.wait();
    let _ = reader.join();
    if let Some(error) = failure {
        return Err(error);
    }
    let rate = histogram.count() as f64 / window.measure.as_secs_f64();
    Ok(Trial::from_histogram(&histogram, rate))
}

/// Writes queued lines, flushing whenever the queue is empty (as Brain's writer threads do).
fn write_lines(lines: crossbeam_channel::Receiver<Vec<u8>>, out: impl Write) {
    let mut out = BufWriter::with_capacity(64 * 1024, out);
    while let Ok(line) = lines.recv() {
        if out.write_all(&line).is_err() {
            return;
        }
        if lines.is_empty() && out.flush().is_err() {
            return;
        }
    }
    let _ = out.flush();
}

/// The `__jsonrpc` child: a reader thread decodes requests, a writer thread encodes the answers
/// (`result` = the request's params) and writes them.
pub fn jsonrpc_child_main() {
    let (requests_tx, requests_rx) = crossbeam_channel::unbounded::<Value>();
    let writer = std::thread::spawn(move || {
        let mut out = BufWriter::with_capacity(64 * 1024, std::io::stdout());
        for mut request in requests_rx.iter() {
            let id = request
                .get_mut("id")
                .map(Value::take)
                .unwrap_or(Value::Null);
            let params = request
                .get_mut("params")
                .map(Value::take)
                .unwrap_or(Value::Null);
            let answer = json!({"jsonrpc": "2.0", "id": id, "result": params});
            let Ok(mut line) = serde_json::to_vec(&answer) else {
                continue;
            };
            line.push(b'\n');
            if out.write_all(&line).is_err() {
                return;
            }
            if requests_rx.is_empty() && out.flush().is_err() {
                return;
            }
        }
        let _ = out.flush();
    });
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut line = Vec::with_capacity(2048);
    loop {
        line.clear();
        match input.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if let Ok(request) = serde_json::from_slice::<Value>(&line)
            && requests_tx.send(request).is_err()
        {
            break;
        }
    }
    drop(requests_tx);
    let _ = writer.join();
}

/// 256-byte appends to a file in `dir`, `batch` of them per `fdatasync`. The rate is in records
/// per second; the latency is one batch's writes and its `fdatasync`.
pub fn fdatasync(dir: &Path, batch: usize, window: &Window) -> Result<Trial, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("fdatasync-{batch}.bin"));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut record = vec![b'r'; 255];
    record.push(b'\n');
    let mut histogram = Histogram::default();
    let mut records = 0u64;
    let (start, end) = window.instants();
    loop {
        let began = Instant::now();
        if began >= end {
            break;
        }
        for _ in 0..batch {
            file.write_all(&record)
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
        file.sync_data()
            .map_err(|e| format!("fdatasync {}: {e}", path.display()))?;
        if began >= start {
            histogram.record(began.elapsed().as_nanos() as u64);
            records += batch as u64;
        }
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
    let mut trial = Trial::from_histogram(&histogram, 0.0);
    trial.rate = records as f64 / window.measure.as_secs_f64();
    trial.count = records;
    Ok(trial)
}
