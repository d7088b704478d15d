//! [`BrainRequest`]: a request from Brain, its params still JSON text.

use brain_protocol::jsonrpc::RequestId;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;

/// A request Brain sent the harness: `initialize`, `run`, `cancel`, `close`, `shutdown`, or a
/// method this SDK does not know.
///
/// The params stay the JSON text Brain sent until whoever handles the request types them. A
/// `run`'s params carry the session's whole transcript; building a `Value` tree of it, and then
/// cloning and typing that tree, was the largest part of what an activation cost the reference
/// harness (docs/BENCHMARKS.md).
#[derive(Debug, Clone)]
pub struct BrainRequest {
    /// The id the answer must echo.
    pub id: RequestId,
    /// The method name.
    pub method: String,
    /// An object or an array; `null` when Brain sent no params.
    pub params: Box<RawValue>,
}

impl BrainRequest {
    /// The params typed as `T`, straight from their JSON text (`Value` for a tree of them).
    ///
    /// # Errors
    /// When the params are not a `T`.
    pub fn params_as<T: DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_str(self.params.get())
    }
}
