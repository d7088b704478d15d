//! Sessions: ids, creation requests, and the pure functions that shape an activation.

mod check;
mod id;
mod idempotency;
mod request;
mod shape;

pub use check::{check_against_harness, check_input_media};
pub(crate) use id::SessionIdMap;
pub use id::{InstanceName, SessionId};
pub use idempotency::{IdempotencyKey, Keyed, MAX_IDEMPOTENCY_KEY_LEN, digest};
pub use request::{
    CreateSession, DEFAULT_MODEL_NAME, DEFAULT_MODEL_PROVIDER, EnvironmentDecl, Grant,
    MAX_NAME_LEN, Permission, RequestError, Selection, ToolSpec, default_input_schema,
    is_registration_name, is_resource_name,
};
pub use shape::{SEED_DOMAIN, merge_configuration, runtime_envelope, tool_declarations};
