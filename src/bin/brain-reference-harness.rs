//! brain-reference-harness: the harness SDK's example harness.
//!
//! For now each `run` echoes its user input: `{"result":{"echo": <params.input.input or null>}}`,
//! or fails `cancelled` when the activation was cancelled first. It will grow into a tool-calling
//! agent loop; it stays a small, readable example of [`brain::harness`].
//!
//! Speaks brain/harness/v1 on stdin/stdout; logs to stderr (`RUST_LOG`, default `warn`).

use brain::harness::{Activation, Handler, HandlerError, serve};
use brain::protocol::harness::{
    Capabilities, Identity, InitializeParams, InitializeResult, PROTOCOL,
};
use serde_json::{Value, json};
use std::process::ExitCode;

/// The reference harness. Stateless so far: every activation stands alone.
struct Reference;

impl Handler for Reference {
    fn initialize(&self, params: &InitializeParams) -> Result<InitializeResult, HandlerError> {
        log::info!(
            "initializing worker {} of {}",
            params.worker,
            params.registration
        );
        Ok(InitializeResult {
            protocol: PROTOCOL.to_owned(),
            identity: Identity {
                name: "brain-reference-harness".to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            },
            state_version: "1".to_owned(),
            capabilities: Capabilities {
                transcript_import: true,
                ..Capabilities::default()
            },
            configuration_keys: None,
            required_model_metadata: Vec::new(),
        })
    }

    fn run(&self, activation: &Activation) -> Result<Option<Value>, HandlerError> {
        if activation.is_cancelled() {
            return Err(HandlerError::cancelled());
        }
        let input = activation
            .params()
            .pointer("/input/input")
            .cloned()
            .unwrap_or(Value::Null);
        Ok(Some(json!({ "echo": input })))
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .target(env_logger::Target::Stderr)
        .init();
    match serve(&Reference) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            log::error!("reading from Brain failed: {error}");
            ExitCode::FAILURE
        }
    }
}
