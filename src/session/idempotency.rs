//! Idempotency keys: what a client sends so that a retried create or send is answered with what
//! the first attempt got instead of admitting a second session or activation.
//!
//! A key is recorded with what it admitted (`session_created` for a create, `activation_queued`
//! for a send), together with a digest of the request it came with, so a retry is recognised
//! after a restart too. A retry with the same key and the same request gets the original; the
//! same key with another request is refused (`idempotency_key_reused`). Keys live as long as the
//! session that holds them: a create key until its session is deleted, a send key for the whole
//! life of its session (docs/OPERATIONS.md, "Retrying safely").

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fmt;

/// The longest key accepted, in bytes.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// A client's idempotency key: 1 to [`MAX_IDEMPOTENCY_KEY_LEN`] visible ASCII characters
/// (`!` to `~`), so that it fits an HTTP header unchanged and prints without escaping.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Checks `key`; the error says what is wrong with it.
    pub fn parse(key: &str) -> Result<IdempotencyKey, String> {
        if key.is_empty() {
            return Err("an idempotency key must not be empty".to_owned());
        }
        if key.len() > MAX_IDEMPOTENCY_KEY_LEN {
            return Err(format!(
                "an idempotency key is at most {MAX_IDEMPOTENCY_KEY_LEN} characters, not {}",
                key.len()
            ));
        }
        if let Some(bad) = key.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(format!(
                "an idempotency key is visible ASCII (! to ~) only, not {bad:?}"
            ));
        }
        Ok(IdempotencyKey(key.to_owned()))
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A key with the digest of the request it came with: what the journal records beside the
/// record the request admitted, as `"idempotency": {"key", "digest"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Keyed {
    /// The client's key.
    pub key: String,
    /// [`digest`] of the request, 32 hex digits.
    pub digest: String,
}

impl Keyed {
    /// `key` for the request whose canonical form is `request`.
    pub fn new(key: &IdempotencyKey, request: &Value) -> Keyed {
        Keyed {
            key: key.0.clone(),
            digest: digest(request),
        }
    }

    /// The `idempotency` member of a record's data, if it has a well-formed one.
    pub fn from_record(data: &Value) -> Option<Keyed> {
        Keyed::deserialize(data.get("idempotency")?).ok()
    }
}

/// A digest of a request: FNV-1a (128 bits) over its canonical JSON (object keys sorted, as
/// `serde_json`'s map keeps them, no whitespace), so that two bodies that differ only in spacing
/// or key order are the same request. Computed the same way by every version of Brain that
/// records it; it is no secret and guards only against a client reusing a key by mistake.
pub fn digest(request: &Value) -> String {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;
    // Serializing a Value cannot fail: its keys are strings.
    let canonical = serde_json::to_vec(request).unwrap_or_default();
    let hash = canonical.iter().fold(OFFSET, |hash, &byte| {
        (hash ^ u128::from(byte)).wrapping_mul(PRIME)
    });
    format!("{hash:032x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_visible_ascii_of_bounded_length_and_refusals_say_why() {
        assert_eq!(
            IdempotencyKey::parse("retry-1").unwrap().as_str(),
            "retry-1"
        );
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        let long = IdempotencyKey::parse(&"k".repeat(256)).unwrap_err();
        assert!(long.contains("at most 255"), "{long}");
        assert!(IdempotencyKey::parse("").unwrap_err().contains("empty"));
        let spaced = IdempotencyKey::parse("a b").unwrap_err();
        assert!(spaced.contains("visible ASCII"), "{spaced}");
        assert!(IdempotencyKey::parse("é").is_err());
    }

    #[test]
    fn the_digest_ignores_key_order_and_spacing_and_tells_other_requests_apart() {
        let a: Value = serde_json::from_str(r#"{"b": 1, "a": [1, 2]}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"a":[1,2],"b":1}"#).unwrap();
        assert_eq!(digest(&a), digest(&b));
        assert_ne!(digest(&a), digest(&json!({"a": [2, 1], "b": 1})));
        assert_eq!(digest(&a).len(), 32);
        // Fixed forever: a digest recorded by one version must match in the next.
        // Fixed forever: a digest recorded by one version must match in the next (the known
        // answer is FNV-1a 128 of `{"a":[1,2]}`, computed independently).
        assert_eq!(
            digest(&json!({"a": [1, 2]})),
            "1abf73e1844fd0102550d8ce6aa0dc5f"
        );
    }
}
