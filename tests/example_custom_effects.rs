//! The custom-effects embedding example compiles and runs as documented.

mod common;

#[path = "../examples/custom_effects.rs"]
mod custom_effects;

#[test]
fn the_custom_effects_example_runs_a_tool_through_its_own_driver() {
    let harness = env!("CARGO_BIN_EXE_brain-reference-harness");
    let data = common::temp_dir("example-custom-effects").join("data");
    // "42" reaches the answer only through the calculator driver's tool result.
    let answer = custom_effects::run(harness, &data).expect("the example runs");
    assert_eq!(answer, "6 * 7 = 42");
    // The shutdown released the data directory: a second run opens it again.
    let again = custom_effects::run(harness, &data).expect("the example runs again");
    assert_eq!(again, "6 * 7 = 42");
}

/// What docs/EMBEDDING.md promises about threads, checked by the compiler.
#[test]
fn the_handles_can_be_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<brain::Brain>();
    send_sync::<brain::Session>();
    send_sync::<brain::Activation>();
    send_sync::<brain::Canceller>();
    send_sync::<brain::effects::Effects>();
}

/// Every Rust block in docs/EMBEDDING.md is quoted from a compiled example or this test, so the
/// guide cannot drift from code that builds and runs.
#[test]
fn the_embedding_guide_quotes_only_compiled_code() {
    let root = env!("CARGO_MANIFEST_DIR");
    let read = |path: &str| {
        std::fs::read_to_string(format!("{root}/{path}"))
            .unwrap_or_else(|error| panic!("reading {path}: {error}"))
    };
    // Blank lines are skipped and indentation is ignored; the lines must appear in order, together.
    let lines = |text: &str| -> Vec<String> {
        text.lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let sources: Vec<Vec<String>> = [
        "examples/embed.rs",
        "examples/custom_effects.rs",
        "tests/example_custom_effects.rs",
    ]
    .iter()
    .map(|path| lines(&read(path)))
    .collect();
    let guide = read("docs/EMBEDDING.md");
    let mut blocks = 0;
    for block in guide.split("```rust\n").skip(1) {
        let quoted = lines(block.split("```").next().unwrap_or_default());
        assert!(!quoted.is_empty(), "an empty rust block in EMBEDDING.md");
        let found = sources.iter().any(|source| {
            source
                .windows(quoted.len())
                .any(|window| window == quoted.as_slice())
        });
        assert!(
            found,
            "EMBEDDING.md quotes code that is in no compiled example:\n{}",
            quoted.join("\n")
        );
        blocks += 1;
    }
    assert!(blocks > 0, "EMBEDDING.md quotes no code");
}
