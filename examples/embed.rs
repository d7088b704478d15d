//! Embedding Brain in a program without an async runtime.
//!
//! Starts one worker of the reference harness, creates a session, sends a message, cancels
//! nothing, waits for the outcome, and shuts down. Run it after `cargo build`:
//!
//! ```sh
//! cargo run --example embed -- target/debug/brain-reference-harness "hello"
//! ```

use brain::protocol::harness::{Block, UserInput};
use brain::session::CreateSession;
use brain::{Brain, Config, Registration, Registrations};
use std::error::Error;
use std::path::Path;
use std::time::Duration;

/// One turn through an embedded Brain; returns the harness's answer text.
pub fn run(harness: &str, data_dir: &Path, message: &str) -> Result<String, Box<dyn Error>> {
    // Registrations are usually read from --agentloops; here they are built in code.
    let registrations = Registrations::from_vec(vec![Registration::new("reference", harness)])?;
    let mut config = Config::new(registrations);
    config.options.data_dir = data_dir.to_path_buf();

    // Blocks until every worker answered `initialize` (or failed).
    let brain = Brain::start(config)?;
    assert!(brain.ready());

    // The model defaults to the scripted provider, which echoes the user's text.
    let request = CreateSession::parse(br#"{"agentloop": {"name": "reference"}}"#)?;
    let session = brain.create_session(request)?;

    // `send` returns as soon as the activation is admitted; `wait` blocks for its outcome.
    // A `Canceller` from `activation.canceller()` could cancel it from any other thread.
    let activation = session.send(UserInput {
        content: vec![Block::text(message)],
    })?;
    let outcome = activation
        .wait_timeout(Duration::from_secs(30))
        .ok_or("the activation did not finish within 30 s")?;

    brain.shutdown(Duration::from_secs(5));
    match (outcome.result, outcome.error) {
        (Some(result), _) => Ok(result["text"].as_str().unwrap_or_default().to_owned()),
        (None, Some(error)) => Err(format!("{}: {}", error.code, error.message).into()),
        (None, None) => Ok(String::new()),
    }
}

#[allow(dead_code)] // When the example is compiled into a test, the test calls `run` directly.
fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let harness = args
        .next()
        .unwrap_or_else(|| "target/debug/brain-reference-harness".to_owned());
    let message = args.next().unwrap_or_else(|| "hello".to_owned());
    let answer = run(&harness, Path::new("brain-data"), &message)?;
    println!("{answer}");
    Ok(())
}
