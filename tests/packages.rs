//! Brain's npm packages installed the way their users install them (issue 25): each package of
//! `adapters/` is packed with `npm pack`, the tarballs are installed into a fresh prefix outside
//! the checkout (their pinned dependencies come from the npm registry, or npm's cache), and from a
//! working directory that is not the checkout `brain check` and `brain run` start each adapter by
//! its command, `brain-agentloop-<name>`, found on `PATH`. The typed client and the selection
//! constructors then drive a session of each adapter through a real `brain serve`.

mod common;

use common::server::*;
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The checkout.
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The packages, by directory under `adapters/`, and the adapters among them.
const PACKAGES: [&str; 5] = ["sdk-js", "client", "pi", "codex", "opencode"];
const ADAPTERS: [&str; 3] = ["pi", "codex", "opencode"];

/// npm installs fetch from the registry when the cache lacks something: a longer bound than WAIT.
const NPM_DEADLINE: Duration = Duration::from_secs(300);

fn succeeded(what: &str, output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}):\nstdout: {stdout}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Packs every package into `dir`; the tarballs' paths.
fn pack(dir: &Path) -> Vec<PathBuf> {
    PACKAGES
        .iter()
        .map(|package| {
            let source = Path::new(ROOT).join("adapters").join(package);
            let output = run_within(
                Command::new("npm")
                    .args(["pack", "--json", "--pack-destination"])
                    .arg(dir)
                    .current_dir(&source),
                NPM_DEADLINE,
            );
            let stdout = succeeded(&format!("npm pack in adapters/{package}"), &output);
            let packed: serde_json::Value = serde_json::from_str(&stdout).expect("npm pack's JSON");
            let file = packed[0]["filename"].as_str().expect("a tarball name");
            dir.join(file)
        })
        .collect()
}

struct Installed {
    dir: PathBuf,
    prefix: PathBuf,
    work: PathBuf,
    path: String,
}

impl Drop for Installed {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept {} for inspection", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Packs and installs every package into a fresh global prefix; a working directory beside it.
fn install() -> Installed {
    let dir = temp_dir("packages");
    let tarballs = dir.join("tarballs");
    let prefix = dir.join("prefix");
    let work = dir.join("work");
    for made in [&tarballs, &prefix, &work] {
        std::fs::create_dir_all(made).expect("a scratch directory");
    }
    let packed = pack(&tarballs);
    let output = run_within(
        Command::new("npm")
            .args([
                "install",
                "--global",
                "--no-audit",
                "--no-fund",
                "--ignore-scripts",
            ])
            .args(["--prefer-offline", "--prefix"])
            .arg(&prefix)
            .args(&packed)
            .current_dir(&work),
        NPM_DEADLINE,
    );
    succeeded("npm install of the tarballs", &output);
    let path = format!(
        "{}:{}",
        prefix.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Installed {
        dir,
        prefix,
        work,
        path,
    }
}

fn registrations() -> String {
    json!({
        "pi": {"command": "brain-agentloop-pi"},
        "codex": {"command": "brain-agentloop-codex"},
        "opencode": {"command": "brain-agentloop-opencode"},
    })
    .to_string()
}

#[test]
fn packed_adapters_install_and_run_by_their_commands_from_anywhere() {
    let installed = install();
    for adapter in ADAPTERS {
        let bin = installed
            .prefix
            .join("bin")
            .join(format!("brain-agentloop-{adapter}"));
        assert!(bin.exists(), "{} was not installed", bin.display());
    }
    // `brain check` starts every worker by its command on PATH, from outside the checkout.
    let output = run_within(
        Command::new(BRAIN)
            .args(["check", "--json", "--agentloops", &registrations()])
            .env("PATH", &installed.path)
            .current_dir(&installed.work),
        Duration::from_secs(60),
    );
    let report = succeeded("brain check", &output);
    for adapter in ADAPTERS {
        assert!(
            report.contains(&format!("agentloop-{adapter}")),
            "no {adapter} identity in {report}"
        );
    }
    // One message each, with the scripted provider, which echoes it.
    for adapter in ADAPTERS {
        let output = run_within(
            Command::new(BRAIN)
                .args([
                    "run",
                    "--agentloops",
                    &registrations(),
                    "--agentloop",
                    adapter,
                ])
                .args(["--data-dir", "data"])
                .arg(format!("hello from the packed {adapter}"))
                .env("PATH", &installed.path)
                .current_dir(&installed.work),
            Duration::from_secs(60),
        );
        let printed = succeeded(&format!("brain run --agentloop {adapter}"), &output);
        assert_eq!(printed.trim(), format!("hello from the packed {adapter}"));
    }
}

#[test]
fn the_typed_client_drives_each_installed_adapter_from_its_selection() {
    let installed = install();
    let data = installed.dir.join("served");
    let served = Start {
        data: &data,
        registrations: serde_json::from_str(&registrations()).expect("JSON"),
        extra: &[],
        token: None,
        env: &[("PATH", &installed.path)],
        uid: None,
        umask: None,
    }
    .run();
    let modules = installed
        .prefix
        .join("lib")
        .join("node_modules")
        .join("@brain");
    let script = format!(
        r#"
import {{ BrainClient }} from "{modules}/client/index.mjs";
import {{ pi }} from "{modules}/agentloop-pi/index.mjs";
import {{ codex }} from "{modules}/agentloop-codex/index.mjs";
import {{ opencode }} from "{modules}/agentloop-opencode/index.mjs";
const brain = new BrainClient({{ url: "http://{addr}", token: "{token}" }});
const model = {{ provider: "scripted", name: "default", context_window: 200000, max_output_tokens: 8192 }};
for (const selection of [pi({{ configuration: {{ compaction: false }} }}), codex(), opencode()]) {{
  const key = {{ idempotencyKey: `create-${{selection.name}}` }};
  const session = await brain.createSession(selection, {{ model }}, key);
  const again = await brain.createSession(selection, {{ model }}, key);
  const said = {{ idempotencyKey: `hi-${{selection.name}}` }};
  const answer = await brain.send(session.session_id, `hi ${{selection.name}}`, said);
  const retried = await brain.send(session.session_id, `hi ${{selection.name}}`, said);
  const seen = [];
  for await (const event of brain.events(session.session_id)) {{
    seen.push(event.type);
    if (event.type === "activation_finished") break;
  }}
  const retry = {{ session: again.session_id === session.session_id, answer: JSON.stringify(retried) === JSON.stringify(answer) }};
  console.log(JSON.stringify({{ name: selection.name, outcome: answer.outcome, text: answer.result?.text, seen, retry }}));
}}
"#,
        modules = modules.display(),
        addr = served.addr,
        token = served.token
    );
    let output = run_within(
        Command::new("node")
            .args(["--input-type=module", "-e", &script])
            .current_dir(&installed.work),
        Duration::from_secs(60),
    );
    let printed = succeeded("the client script", &output);
    let lines: Vec<serde_json::Value> = printed
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON line per adapter"))
        .collect();
    assert_eq!(lines.len(), ADAPTERS.len(), "{printed}");
    for (line, adapter) in lines.iter().zip(ADAPTERS) {
        assert_eq!(line["name"], adapter);
        assert_eq!(line["outcome"], "completed", "{line}");
        assert_eq!(line["text"], format!("hi {adapter}"), "{line}");
        let seen = line["seen"].as_array().expect("event types");
        assert!(seen.iter().any(|t| t == "session_created"), "{line}");
        assert!(seen.iter().any(|t| t == "activation_finished"), "{line}");
        // Retried with their idempotency keys, the create and the send got the first answers.
        assert_eq!(
            line["retry"],
            json!({"session": true, "answer": true}),
            "{line}"
        );
    }
}
