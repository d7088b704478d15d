//! What a harness author compiles: `brain-harness` and `brain-protocol` pull in nothing of the
//! host — no `brain`, no HTTP client or TLS, no journal — read from `cargo metadata`'s resolved
//! graph (normal dependencies only, as a harness binary links them).

use serde_json::Value;
use std::collections::{BTreeSet, HashMap};

/// The resolved graph: each package's name, and the names of its normal dependencies.
fn graph() -> (HashMap<String, String>, HashMap<String, Vec<String>>) {
    let output = std::process::Command::new(env!("CARGO"))
        // This host's packages only, so that nothing needs downloading (Linux, as Brain is).
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args([
            "--filter-platform",
            &format!("{}-unknown-linux-gnu", std::env::consts::ARCH),
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: Value = serde_json::from_slice(&output.stdout).expect("cargo metadata's JSON");
    let names = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            (
                p["id"].as_str().unwrap_or_default().to_owned(),
                p["name"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect::<HashMap<_, _>>();
    let mut edges = HashMap::new();
    for node in metadata["resolve"]["nodes"]
        .as_array()
        .expect("resolve nodes")
    {
        let id = node["id"].as_str().unwrap_or_default().to_owned();
        let normal = node["deps"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|dep| {
                dep["dep_kinds"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|kind| kind["kind"].is_null())
            })
            .filter_map(|dep| dep["pkg"].as_str().map(str::to_owned))
            .collect();
        edges.insert(id, normal);
    }
    (names, edges)
}

/// Every package `root` depends on, directly or not, by name.
fn closure(root: &str) -> BTreeSet<String> {
    let (names, edges) = graph();
    let start = names
        .iter()
        .find(|(_, name)| name.as_str() == root)
        .map(|(id, _)| id.clone())
        .unwrap_or_else(|| panic!("no package {root}"));
    let mut seen = BTreeSet::new();
    let mut stack = vec![start];
    while let Some(id) = stack.pop() {
        for dep in edges.get(&id).into_iter().flatten() {
            if seen.insert(names[dep].clone()) {
                stack.push(dep.clone());
            }
        }
    }
    seen
}

#[test]
fn the_harness_sdk_pulls_in_nothing_of_the_host() {
    let deps = closure("brain-harness");
    assert!(deps.contains("brain-protocol"), "{deps:?}");
    for host in [
        "brain",
        "ureq",
        "rustls",
        "ring",
        "nix",
        "signal-hook",
        "env_logger",
    ] {
        assert!(
            !deps.contains(host),
            "brain-harness depends on {host}: {deps:?}"
        );
    }
}

#[test]
fn the_protocol_crate_depends_on_serde_serde_json_and_memchr_only() {
    let deps = closure("brain-protocol");
    // What serde, serde_json and memchr themselves bring (their derive macro and number
    // formatting); nothing else.
    let allowed = [
        "serde",
        "serde_core",
        "serde_derive",
        "serde_json",
        "memchr",
        "itoa",
        "ryu",
        "zmij",
        "proc-macro2",
        "quote",
        "syn",
        "unicode-ident",
    ];
    let extra: Vec<_> = deps
        .iter()
        .filter(|d| !allowed.contains(&d.as_str()))
        .collect();
    assert!(extra.is_empty(), "brain-protocol depends on {extra:?}");
}
