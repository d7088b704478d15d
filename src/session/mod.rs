//! Sessions: ids, creation requests, and the pure functions that shape an activation.

mod id;

pub use id::SessionId;
