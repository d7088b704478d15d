//! The minimal harness of docs/ADAPTERS.md ("The Rust harness SDK"): asks Brain's model once
//! and answers with what it said. Built by `cargo clippy --workspace --all-targets`, so the
//! document's code compiles.

use brain_harness::{Activation, Handler, HandlerError, serve};
use brain_protocol::harness::{
    Capabilities, Identity, InitializeParams, InitializeResult, PROTOCOL,
};
use serde_json::{Value, json};

struct Echo;

impl Handler for Echo {
    fn initialize(&self, _: &InitializeParams) -> Result<InitializeResult, HandlerError> {
        Ok(InitializeResult {
            protocol: PROTOCOL.to_owned(),
            identity: Identity {
                name: "echo".into(),
                version: "1.0.0".into(),
            },
            state_version: "1".into(),
            capabilities: Capabilities::default(),
            configuration_keys: None,
            required_model_metadata: Vec::new(),
        })
    }

    fn run(&self, activation: &Activation) -> Result<Option<Value>, HandlerError> {
        let answer = activation.call(
            "model",
            json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}),
        )?;
        Ok(Some(json!({"answer": answer})))
    }
}

fn main() -> std::io::Result<()> {
    serve(&Echo)
}
