//! brain-protocol: the wire between Brain and its harnesses — JSON-RPC 2.0 message shapes, the
//! brain/harness/v1 payload types ([`harness`]), the error codes ([`harness::ErrorCode`]) and
//! line framing ([`framing`]).
//!
//! Every client and server of the protocol shares these types: Brain itself, the Rust harness
//! SDK (`brain-harness`), and any harness written in Rust. The crate depends on `serde`,
//! `serde_json` and `memchr` (the framing's newline search) only: no I/O of its own beyond the
//! readers and writers it is given, no threads, no host code.
//!
//! ```
//! use brain_protocol::harness::{Block, Message, Role};
//!
//! let message = Message { role: Role::User, content: vec![Block::text("hello")] };
//! let json = serde_json::to_string(&message).unwrap();
//! assert_eq!(json, r#"{"role":"user","content":[{"type":"text","text":"hello"}]}"#);
//! ```

#![deny(missing_docs)]

mod block;
pub mod framing;
pub mod harness;
#[doc(hidden)]
pub mod json;
pub mod jsonrpc;

use serde::Serialize;

/// `value` as JSON bytes, as `serde_json::to_vec` gives them ([`json::write`]), in a buffer of
/// their size and one byte more (the newline a line gets). Encoded in a buffer each thread keeps
/// and copied out: a fresh buffer grew by reallocation, and a tenth of the executors' time on the
/// callback path was spent growing these buffers (docs/BENCHMARKS.md).
#[doc(hidden)]
pub fn to_json_vec(value: &(impl Serialize + ?Sized)) -> Result<Vec<u8>, json::Error> {
    json::encode_with(value, |encoded| {
        let mut out = Vec::with_capacity(encoded.len() + 1);
        out.extend_from_slice(encoded);
        out
    })
}
