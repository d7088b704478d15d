//! The wire: JSON-RPC 2.0 framing and the brain/harness/v1 payload types.

pub mod framing;
pub mod harness;
pub mod jsonrpc;
