//! The short form of fuzzing, on stable and without cargo-fuzz: every file of every target's
//! corpus (`fuzz/corpus/<target>/`) is replayed through `brain::fuzzing::<target>`, then a
//! deterministic mutation loop (a seeded PRNG: bit flips, byte sets, inserts, deletes,
//! duplications, dictionary tokens and splices of corpus entries) runs each target a fixed number
//! of times. The long, coverage-guided form is `scripts/fuzz` (docs/RELIABILITY.md, "Fuzzing").
//!
//! A failing input is written to `$CARGO_TARGET_TMPDIR/fuzz-failures/<target>-<hash>` and named
//! in the panic message; `cargo fuzz run <target> <file>` (or this test) reproduces it.
//!
//! `cargo test --test fuzz_corpus -- --ignored write_seed_corpus` rewrites the seed files (named
//! `seed-*`) from the real sources: the JSON examples of docs/PROTOCOL.md, examples/agentloops.json,
//! segments written by the real disk journal, and HTTP requests like the ones the tests send.

use brain::fuzzing::{self, Rng};
use brain::journal::{DiskJournal, DiskJournalOptions, Journal, NewRecord};
use brain::protocol::harness::{EventOrigin, OriginKind, RecordKind};
use brain::session::SessionId;
use serde_json::{Value, json};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// Every file of the target's corpus, in name order.
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let data = std::fs::read(&path).expect("reading a corpus file");
            (path, data)
        })
        .collect()
}

/// FNV-1a, to name failure files by content.
fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Runs the target on `data`; on a panic, saves the input and fails naming it.
fn run_one(target: &str, data: &[u8], what: &str) {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        assert!(fuzzing::run(target, data), "unknown target {target}");
    }));
    if outcome.is_err() {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
        std::fs::create_dir_all(&dir).expect("creating the failure directory");
        let file = dir.join(format!("{target}-{:016x}", hash(data)));
        std::fs::write(&file, data).expect("saving the failing input");
        let shown: String = data.escape_ascii().to_string().chars().take(300).collect();
        panic!(
            "{target} failed on {what}; input saved to {} ({} bytes: {shown})",
            file.display(),
            data.len()
        );
    }
}

fn replay(target: &str) {
    let files = corpus(target);
    assert!(!files.is_empty(), "the {target} corpus is empty");
    for (path, data) in &files {
        run_one(target, data, &path.display().to_string());
    }
}

/// Tokens the decoders care about.
const DICTIONARY: &[&[u8]] = &[
    b"\n",
    b"\r\n",
    b"\r\n\r\n",
    b"\"",
    b"\\u0000",
    b"{}",
    b"[]",
    b"null",
    b"true",
    b"-0",
    b"1e999",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"\"jsonrpc\":\"2.0\"",
    b"\"id\":",
    b"\"method\":",
    b"\"params\":",
    b"\"result\":",
    b"\"error\":",
    b"Content-Length: ",
    b"Transfer-Encoding: chunked",
    b"Expect: 100-continue",
    b"Connection: close",
    b"%zz",
    b"\xff\xfe",
    b"\xe2\x80\xa8",
    b"ses_0123456789abcdefABCD",
    b"BRAINJNL",
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff",
];

/// The largest input the loop builds.
const MAX_LEN: usize = 16 * 1024;

/// One mutant of a random corpus entry: one to four edits, or a splice of two entries.
fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut data = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(data.len() + 1);
        match rng.below(8) {
            0 if !data.is_empty() => {
                let at = rng.below(data.len());
                data[at] ^= 1 << rng.below(8);
            }
            1 if !data.is_empty() => {
                let at = rng.below(data.len());
                data[at] = [0, 0xff, b'\n', b'\r', b'"', b'{', b'}', b':', b' ', b'0']
                    [rng.below(10)]
                .wrapping_add(u8::from(rng.below(4) == 0));
            }
            2 => {
                let bytes: Vec<u8> = (0..1 + rng.below(8))
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                data.splice(at..at, bytes);
            }
            3 if !data.is_empty() => {
                let end = (at + 1 + rng.below(32)).min(data.len());
                data.drain(at.min(end)..end);
            }
            4 if !data.is_empty() => {
                let from = rng.below(data.len());
                let end = (from + 1 + rng.below(64)).min(data.len());
                let piece = data[from..end].to_vec();
                data.splice(at..at, piece);
            }
            5 => {
                let token = DICTIONARY[rng.below(DICTIONARY.len())];
                data.splice(at..at, token.iter().copied());
            }
            6 => {
                let other = &seeds[rng.below(seeds.len())];
                let from = rng.below(other.len() + 1);
                data.truncate(at);
                data.extend_from_slice(&other[from..]);
            }
            _ if !data.is_empty() => {
                // Overwrite a byte with a nearby value: lengths, counts, ids.
                let at = rng.below(data.len());
                data[at] = data[at].wrapping_add(1 + rng.below(3) as u8);
            }
            _ => data.push(rng.next_u64() as u8),
        }
    }
    data.truncate(MAX_LEN);
    data
}

/// Runs `iterations` mutants of the corpus through the target, stopping early (and saying so)
/// after `budget`; a fixed seed per target makes every run the same.
fn mutation_loop(target: &str, iterations: usize, budget: Duration) {
    let seeds: Vec<Vec<u8>> = corpus(target).into_iter().map(|(_, data)| data).collect();
    assert!(!seeds.is_empty(), "the {target} corpus is empty");
    let mut rng = Rng(hash(target.as_bytes()) | 1);
    let started = Instant::now();
    let mut ran = 0;
    while ran < iterations {
        let data = mutate(&mut rng, &seeds);
        run_one(target, &data, &format!("mutant {ran}"));
        ran += 1;
        if started.elapsed() > budget {
            eprintln!("{target}: stopped at the time budget after {ran} of {iterations} mutants");
            break;
        }
    }
    eprintln!("{target}: {ran} mutants in {:?}", started.elapsed());
}

/// Per target: the corpus replayed, and a mutation loop of `$iterations` mutants within
/// `$budget_ms` milliseconds.
macro_rules! target_tests {
    ($($name:ident: $replay:ident, $mutate:ident, $iterations:expr, $budget_ms:expr;)*) => {
        $(
            #[test]
            fn $replay() {
                replay(stringify!($name));
            }

            #[test]
            fn $mutate() {
                mutation_loop(
                    stringify!($name),
                    $iterations,
                    Duration::from_millis($budget_ms),
                );
            }
        )*

        #[test]
        fn every_target_has_its_tests() {
            let mut tested = vec![$(stringify!($name)),*];
            tested.sort_unstable();
            let mut targets = fuzzing::TARGETS.to_vec();
            targets.sort_unstable();
            assert_eq!(tested, targets);
        }
    };
}

target_tests! {
    framing: replay_framing_corpus, mutate_framing, 1500, 2000;
    jsonrpc: replay_jsonrpc_corpus, mutate_jsonrpc, 20_000, 2000;
    callback_input: replay_callback_input_corpus, mutate_callback_input, 20_000, 2000;
    registrations: replay_registrations_corpus, mutate_registrations, 20_000, 2000;
    create_session: replay_create_session_corpus, mutate_create_session, 10_000, 2000;
    journal_frame: replay_journal_frame_corpus, mutate_journal_frame, 5000, 2000;
    journal_segment: replay_journal_segment_corpus, mutate_journal_segment, 400, 2000;
    http_request: replay_http_request_corpus, mutate_http_request, 3000, 2000;
}

// ---- seeds -------------------------------------------------------------------------------------

/// Writes `data` as `fuzz/corpus/<target>/seed-<hash>`.
fn write_seed(target: &str, data: &[u8]) {
    let dir = corpus_dir(target);
    std::fs::create_dir_all(&dir).expect("creating the corpus directory");
    std::fs::write(dir.join(format!("seed-{:016x}", hash(data))), data).expect("writing a seed");
}

/// The ```` ```json ```` blocks of a markdown document: (tag, text).
fn json_blocks(doc: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let Some(info) = line.trim_start().strip_prefix("```json") else {
            continue;
        };
        let text: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.trim_start().starts_with("```"))
            .collect();
        blocks.push((info.trim().to_owned(), text.join("\n")));
    }
    blocks
}

/// The method whose result a result type is, for the `callback_input` seeds.
fn method_of_result(tag: &str) -> Option<&'static str> {
    Some(match tag {
        "jsonrpc:SequenceResult" => "emit",
        "jsonrpc:KvGetResult" => "kv.get",
        "jsonrpc:ModelCallResult" => "model",
        "jsonrpc:ToolCallResult" => "tool",
        "jsonrpc:EventsReadResult" => "events.read",
        "jsonrpc:EnvironmentsListResult" => "environments.list",
        "jsonrpc:EnvironmentInfo" => "environments.get",
        "jsonrpc:EnvironmentsCallResult" => "environments.call",
        "jsonrpc:Empty" => "telemetry",
        _ => return None,
    })
}

/// A disk journal's segments after a realistic history: sessions with every common record kind,
/// an event with an origin, a deleted session (a tombstone), small segments so there are several.
fn journal_segments() -> Vec<Vec<u8>> {
    let dir = std::env::temp_dir().join(format!("brain-fuzz-seed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = DiskJournalOptions {
        segment_size: 1024,
        ..DiskJournalOptions::default()
    };
    {
        let journal = DiskJournal::open_with(&dir, options).expect("opening a journal");
        let record = |kind, data| NewRecord {
            kind,
            data,
            origin: None,
        };
        for n in 0..3 {
            let id = SessionId::parse(&format!("ses_seed{n}seedseedseedsee")).expect("an id");
            journal
                .create(
                    &id,
                    record(
                        RecordKind::SessionCreated,
                        json!({"agentloop": {"name": "reference"}}),
                    ),
                )
                .expect("create");
            journal
                .append(
                    &id,
                    record(
                        RecordKind::ActivationQueued,
                        json!({"input": {"content": [{"type": "text", "text": "hi"}]}}),
                    ),
                )
                .expect("append");
            journal
                .append(
                    &id,
                    NewRecord {
                        kind: RecordKind::EventEmitted,
                        data: json!({"type": "progress", "data": {"step": n}}),
                        origin: Some(EventOrigin {
                            kind: OriginKind::Agentloop,
                            sequence: 2,
                        }),
                    },
                )
                .expect("append");
            journal
                .append(
                    &id,
                    record(
                        RecordKind::KvSet,
                        json!({"key": "k", "value": [1, 2.5, null]}),
                    ),
                )
                .expect("append");
            if n == 1 {
                journal.delete(&id).expect("delete");
            }
        }
        journal.sync().expect("sync");
    }
    let mut segments = Vec::new();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("listing the journal")
        .map(|entry| entry.expect("an entry").path())
        .collect();
    paths.sort();
    for path in paths {
        segments.push(std::fs::read(&path).expect("reading a segment"));
    }
    let _ = std::fs::remove_dir_all(&dir);
    segments
}

/// The frames of a segment (after its 16-byte header).
fn frames(segment: &[u8]) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut at = 16;
    while at + 56 <= segment.len() {
        let len = u32::from_le_bytes(segment[at..at + 4].try_into().expect("4 bytes")) as usize;
        let end = at + 56 + len;
        if end > segment.len() {
            break;
        }
        frames.push(segment[at..end].to_vec());
        at = end;
    }
    frames
}

#[test]
#[ignore = "rewrites the seed corpus; run by hand"]
fn write_seed_corpus() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let protocol = std::fs::read_to_string(root.join("docs/PROTOCOL.md")).expect("PROTOCOL.md");
    let mut lines = Vec::new();
    for (tag, text) in json_blocks(&protocol) {
        let Ok(value) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        let compact = serde_json::to_vec(&value).expect("serializing");
        if tag.starts_with("jsonrpc:") {
            write_seed("jsonrpc", &compact);
            lines.push(compact.clone());
        }
        if tag == "jsonrpc:BrainCallParams"
            && let (Some(method), Some(input)) = (
                value["params"]["method"].as_str(),
                value["params"].get("input"),
            )
        {
            let mut seed = format!("{method}\n").into_bytes();
            seed.extend(serde_json::to_vec(input).expect("serializing"));
            write_seed("callback_input", &seed);
        }
        if let (Some(method), Some(result)) = (method_of_result(&tag), value.get("result")) {
            let mut seed = format!("{method}\n").into_bytes();
            seed.extend(serde_json::to_vec(result).expect("serializing"));
            write_seed("callback_input", &seed);
        }
        if tag == "ModelRequest" {
            write_seed(
                "callback_input",
                &[b"model\n".as_slice(), &compact].concat(),
            );
        }
        if tag == "Registrations" {
            write_seed("registrations", text.as_bytes());
        }
        if tag == "CreateSession" {
            write_seed("create_session", text.as_bytes());
        }
    }
    // Framing: the protocol's lines as one stream, under a few limits and read patterns.
    let stream: Vec<u8> = lines
        .iter()
        .flat_map(|l| [l.as_slice(), b"\n"].concat())
        .collect();
    for (control, seed) in [(4u8, 1u8), (7, 2), (3, 3), (0x86, 4)] {
        write_seed(
            "framing",
            &[&[control, seed], &stream[..stream.len().min(2000)]].concat(),
        );
    }
    write_seed("framing", b"\x06\x05a\r\n\r\nb\rc\n\n\xff\xfe\nlast");

    write_seed(
        "registrations",
        &std::fs::read(root.join("examples/agentloops.json")).expect("agentloops.json"),
    );
    write_seed(
        "registrations",
        br#"{"a": {"command": "/bin/sh", "args": ["-c", "x"], "workers": 3, "max_concurrency": 2,
             "env": {"K": "v"}, "cwd": "/tmp", "configuration": {"n": [1, {"x": null}]}},
             "b-2": {"command": "b"}}"#,
    );
    write_seed("create_session", br#"{"agentloop": {"name": "reference"}}"#);
    write_seed(
        "create_session",
        br#"{"agentloop": {"name": "pi", "configuration": {"t": 1},
              "environments": [{"name": "ws", "permissions": ["read", "call", "setup"]}]},
             "model": {"provider": "scripted", "name": "m", "context_window": 1000},
             "system": "s", "metadata": {"k": "v"},
             "tools": [{"name": "t.x", "description": "d", "input_schema": {"type": "object"},
                        "placements": ["ws"]}],
             "environments": [{"name": "ws", "driver": "local", "configuration": {}}],
             "transcript": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}"#,
    );

    for (index, segment) in journal_segments().iter().enumerate() {
        // Flags 0 (as written), 1 (checksums fixed after mutation), 2 (not the last segment).
        for flags in [0u8, 1, 2] {
            write_seed("journal_segment", &[&[flags], segment.as_slice()].concat());
        }
        let mut torn = segment.clone();
        torn.truncate(segment.len() - 7);
        write_seed("journal_segment", &[&[0u8], torn.as_slice()].concat());
        if index == 0 {
            for frame in frames(segment) {
                write_seed("journal_frame", &frame);
            }
        }
    }

    let token = "0123456789abcdef0123456789abcdef";
    for request in [
        "GET /v1/healthz HTTP/1.1\r\nHost: 127.0.0.1:7777\r\n\r\n".to_owned(),
        format!(
            "POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nContent-Length: 36\r\n\r\n\
             {{\"agentloop\": {{\"name\": \"reference\"}}}}"
        ),
        format!(
            "GET /v1/sessions/ses_0123456789abcdefABCD/events?after=3&limit=10&follow=true \
             HTTP/1.1\r\nAuthorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
        ),
        "POST /v1/sessions/ses_0123456789abcdefABCD/messages HTTP/1.0\r\n\
         Connection: keep-alive\r\nExpect: 100-continue\r\nPrefer: respond-async\r\n\
         Content-Length: 2\r\n\r\n{}GET / HTTP/1.1\r\n\r\n"
            .to_owned(),
        "\r\n\r\nDELETE /v1/sessions/x?a=%20b+c HTTP/1.1\r\nContent-Length: 0, 0\r\n\r\n"
            .to_owned(),
        "GET /metrics HTTP/2.0\r\n\r\n".to_owned(),
    ] {
        write_seed("http_request", request.as_bytes());
    }
}

/// Found by the `jsonrpc` target: without serde_json's `float_roundtrip`, parsing is not
/// correctly rounded, so a number Brain stores or forwards changed in its last bit each time it
/// was written and read back (a journaled record, a kv value, a forwarded result).
#[test]
fn numbers_survive_a_json_round_trip_exactly() {
    for text in [
        "81222222222222222222222222222222222222222222222222",
        "8.122222222222222e49",
        "2.2250738585072011e-308",
        "0.30000000000000004",
        "-1.7976931348623157e308",
    ] {
        let value: Value = serde_json::from_str(text).expect("a number");
        let again: Value = serde_json::from_str(&value.to_string()).expect("re-encoded");
        assert_eq!(again, value, "{text}");
        assert_eq!(
            again.as_f64().map(f64::to_bits),
            value.as_f64().map(f64::to_bits)
        );
    }
}
