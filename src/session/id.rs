//! Session ids: `ses_` followed by 20 characters of `[0-9A-Za-z]`.

use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;
use std::io::Read;

const PREFIX: &str = "ses_";
const BODY_LEN: usize = 20;
const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// A validated session id. Brain generates them; an id from outside is parsed with
/// [`SessionId::parse`] before it is used anywhere, so it can never name a path outside its
/// directory (it has no `/`, `.` or other separator).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct SessionId(String);

impl SessionId {
    /// A fresh random id from the operating system's random source (`/dev/urandom`).
    pub fn generate() -> std::io::Result<SessionId> {
        let mut file = std::fs::File::open("/dev/urandom")?;
        let mut id = String::with_capacity(PREFIX.len() + BODY_LEN);
        id.push_str(PREFIX);
        let mut byte = [0u8; 1];
        while id.len() < PREFIX.len() + BODY_LEN {
            file.read_exact(&mut byte)?;
            // Rejection sampling keeps every character equally likely: 248 = 4 × 62.
            if byte[0] < 248 {
                id.push(char::from(ALPHABET[usize::from(byte[0] % 62)]));
            }
        }
        Ok(SessionId(id))
    }

    /// Validates an id from outside. Refuses anything but `ses_` and 20 ASCII letters or digits,
    /// naming what was wrong.
    pub fn parse(text: &str) -> Result<SessionId, String> {
        // Built only for a refusal: parsing is on every callback's path.
        let shown = || text.chars().take(40).collect::<String>();
        let Some(body) = text.strip_prefix(PREFIX) else {
            return Err(format!(
                "session id {:?} does not start with {PREFIX:?}",
                shown()
            ));
        };
        if body.len() != BODY_LEN || !body.bytes().all(|b| b.is_ascii_alphanumeric()) {
            let shown = shown();
            return Err(format!(
                "session id {shown:?} must be {PREFIX:?} followed by {BODY_LEN} ASCII letters or digits"
            ));
        }
        Ok(SessionId(text.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for SessionId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<SessionId, D::Error> {
        let text = String::deserialize(deserializer)?;
        SessionId::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_have_the_stated_form_and_differ() {
        let a = SessionId::generate().unwrap();
        let b = SessionId::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(SessionId::parse(a.as_str()), Ok(a.clone()));
        assert_eq!(a.as_str().len(), 24);
    }

    #[test]
    fn ids_from_outside_are_validated() {
        assert!(SessionId::parse("ses_12345678901234567890").is_ok());
        for bad in [
            "",
            "ses_",
            "ses_1234567890123456789",
            "ses_123456789012345678901",
            "ses_../../../../etc/passw",
            "ses_1234567890123456789/",
            "SES_12345678901234567890",
            "ses_1234567890123456789é",
        ] {
            assert!(SessionId::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(serde_json::from_str::<SessionId>("\"ses_../../x\"").is_err());
    }
}
