//! Brain: a host for agent-loop harnesses.
//!
//! Brain starts pools of harness worker processes, speaks line-delimited JSON-RPC 2.0
//! (brain/harness/v1) with them over their stdin and stdout, and keeps them healthy. It is
//! synchronous and threaded: no async runtime anywhere.

#![deny(missing_docs)]

pub mod config;
pub mod harness;
pub mod protocol;
