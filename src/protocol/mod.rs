//! The wire: JSON-RPC 2.0 framing and the brain/harness/v1 payload types.

mod block;
pub mod framing;
pub mod harness;
pub(crate) mod json;
pub mod jsonrpc;

use serde::Serialize;

/// What [`to_json_vec`] reserves: a typical callback message or journal record fits, so that
/// encoding one grows its buffer once at most instead of doubling it from empty.
const TYPICAL_ENCODED_LEN: usize = 1024;

/// `value` as JSON bytes, as `serde_json::to_vec` gives them ([`json::write`]), in a buffer
/// reserved for a typical message: the profile of the callback path showed a tenth of the
/// executors' time in growing these buffers. For buffers that are dropped once written, not kept.
pub(crate) fn to_json_vec(value: &(impl Serialize + ?Sized)) -> Result<Vec<u8>, json::Error> {
    let mut out = Vec::with_capacity(TYPICAL_ENCODED_LEN);
    json::write(&mut out, value)?;
    Ok(out)
}
