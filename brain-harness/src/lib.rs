//! brain-harness, the harness SDK: write a brain/harness/v1 harness in Rust with a few blocking
//! calls. It depends on `brain-protocol` for the wire types and on nothing of Brain's host (no
//! HTTP, no TLS, no journal): a harness author compiles only this and the protocol. The host
//! re-exports it as `brain::harness`, so the two names are the same crate.
//!
//! Two levels, both synchronous and threaded (no async runtime):
//!
//! - [`serve`] runs the whole protocol for a [`Handler`]: it answers `initialize`, runs each `run`
//!   on a thread of its own (kept for later activations) with an [`Activation`] (its params,
//!   [`Activation::call`] for `brain/call`, and a [`CancelToken`]), turns `cancel` into a
//!   cancelled token, and answers `close`, `shutdown` and unknown methods. It returns when Brain
//!   closes stdin.
//! - [`Connection`] is the transport underneath: a reader thread and a writer thread on the
//!   process's stdin and stdout (or any reader and writer), Brain's requests on a channel,
//!   [`Connection::respond`] from any thread, and [`Connection::call`], which blocks until Brain
//!   answers and fails at once — never hangs — when the connection closes.
//!
//! `call` takes and returns `serde_json::Value`s. [`Activation::call_typed`] (and
//! [`Connection::call_typed`]) encode the input from any `Serialize` value — a struct that borrows
//! the transcript, say — and type the answer straight from its JSON text
//! (`ModelCallResult`, `SequenceResult`, …): no `Value` tree is built on either side, which is
//! most of what a callback costs a harness. Brain's requests likewise keep their params as JSON
//! text ([`BrainRequest`]), and [`Activation::params_as`] types a `run`'s params — the whole
//! transcript — straight from it.
//!
//! Diagnostics go through the `log` crate; a harness binary should log to stderr (stdout is the
//! protocol).
//!
//! # Example
//!
//! A harness that asks Brain for a kv value and answers with it, stopping early when cancelled:
//!
//! ```no_run
//! use brain_harness::{Activation, Handler, HandlerError, serve};
//! use brain_protocol::harness::{
//!     Capabilities, Identity, InitializeParams, InitializeResult, PROTOCOL,
//! };
//! use serde_json::{Value, json};
//!
//! struct Hello;
//!
//! impl Handler for Hello {
//!     fn initialize(&self, _: &InitializeParams) -> Result<InitializeResult, HandlerError> {
//!         Ok(InitializeResult {
//!             protocol: PROTOCOL.to_owned(),
//!             identity: Identity { name: "hello".into(), version: "1.0.0".into() },
//!             state_version: "1".into(),
//!             capabilities: Capabilities::default(),
//!             configuration_keys: None,
//!             required_model_metadata: Vec::new(),
//!         })
//!     }
//!
//!     fn run(&self, activation: &Activation) -> Result<Option<Value>, HandlerError> {
//!         // Blocks until Brain answers; a fatal error has already cancelled the token.
//!         let plan = activation.call("kv.get", json!({"key": "plan"}))?;
//!         if activation.is_cancelled() {
//!             return Err(HandlerError::cancelled());
//!         }
//!         Ok(Some(json!({"plan": plan})))
//!     }
//! }
//!
//! fn main() -> std::io::Result<()> {
//!     serve(&Hello)
//! }
//! ```

#![deny(missing_docs)]

mod activation;
pub mod cancel;
mod connection;
mod error;
#[doc(hidden)]
pub mod handoff;
mod io;
mod pending;
mod request;
mod runners;
mod serve;

pub use crate::cancel::CancelToken;
pub use activation::Activation;
pub use connection::{Connection, DEFAULT_MAX_LINE_BYTES, PendingCall};
pub use error::{CallError, HandlerError, SendError};
pub use io::IoThreads;
pub use request::BrainRequest;
pub use serve::{Handler, serve, serve_connection};
