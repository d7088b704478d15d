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
///
/// Held inline (24 bytes, the size of a `String`'s handle), so that a copy, which every message
/// about a session makes, allocates nothing, and an idle session's entries in Brain's maps hold
/// no heap memory of their own. Ordered as its text is.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId([u8; ID_LEN]);

const ID_LEN: usize = PREFIX.len() + BODY_LEN;

impl SessionId {
    /// A fresh random id from the operating system's random source (`/dev/urandom`).
    pub fn generate() -> std::io::Result<SessionId> {
        let mut file = std::fs::File::open("/dev/urandom")?;
        let mut id = [0u8; ID_LEN];
        id[..PREFIX.len()].copy_from_slice(PREFIX.as_bytes());
        let mut filled = PREFIX.len();
        // One read for the whole id: a read per character cost 20 system calls per session
        // created (≈ 1 % of the CPU of a text-turn benchmark that creates a session every 4 turns).
        // Rejection drops 8 bytes in 256, so 2 × BODY_LEN bytes all but never run out; if they
        // do, the loop reads again.
        let mut bytes = [0u8; 2 * BODY_LEN];
        while filled < ID_LEN {
            file.read_exact(&mut bytes)?;
            for &byte in &bytes {
                // Rejection sampling keeps every character equally likely: 248 = 4 × 62.
                if byte < 248 && filled < ID_LEN {
                    id[filled] = ALPHABET[usize::from(byte % 62)];
                    filled += 1;
                }
            }
        }
        Ok(SessionId(id))
    }

    /// A fresh random id carrying an instance's name at a fixed place, for a Brain running
    /// `--instance NAME`: the body is the name's length (one digit, `1`–`4`), the name, then
    /// random characters. A router matches `ses_<len><NAME>` as a plain prefix (`ses_2b1` for
    /// `b1`); the length digit keeps one name from being a prefix of another. The id stays a
    /// valid id of the current format; its random part is 15–18 characters of 62, at least
    /// 15 × log2(62) ≈ 89 bits (an untagged id has ≈ 119).
    pub fn generate_for(instance: &InstanceName) -> std::io::Result<SessionId> {
        let mut id = SessionId::generate()?;
        let name = instance.as_str().as_bytes();
        let start = PREFIX.len();
        id.0[start] = b'0' + name.len() as u8;
        id.0[start + 1..start + 1 + name.len()].copy_from_slice(name);
        Ok(id)
    }

    /// Whether this id carries `instance`'s tag (see [`SessionId::generate_for`]).
    pub fn belongs_to(&self, instance: &InstanceName) -> bool {
        let body = &self.0[PREFIX.len()..];
        let name = instance.as_str().as_bytes();
        body[0] == b'0' + name.len() as u8 && body[1..].starts_with(name)
    }

    /// The instance name an id would carry if it was made by a Brain run with `--instance`:
    /// meaningful only where every instance is named (an untagged id may look tagged).
    pub fn instance_tag(&self) -> Option<InstanceName> {
        let body = &self.as_str()[PREFIX.len()..];
        let len = usize::from(body.as_bytes()[0].checked_sub(b'0')?);
        if !(1..=InstanceName::MAX_LEN).contains(&len) {
            return None;
        }
        InstanceName::parse(&body[1..1 + len]).ok()
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
        let mut id = [0u8; ID_LEN];
        // Checked above: `ses_` and BODY_LEN ASCII characters, ID_LEN bytes in all.
        id.copy_from_slice(text.as_bytes());
        Ok(SessionId(id))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        // Every constructor writes ASCII only, so this never falls back.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SessionId").field(&self.as_str()).finish()
    }
}

impl Serialize for SessionId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for SessionId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<SessionId, D::Error> {
        let text = String::deserialize(deserializer)?;
        SessionId::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The name of one Brain instance among several behind a router (`brain serve --instance
/// NAME`): 1–4 ASCII letters or digits.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct InstanceName(String);

impl InstanceName {
    /// The longest name allowed.
    pub const MAX_LEN: usize = 4;

    /// Validates a name, saying what was wrong.
    pub fn parse(text: &str) -> Result<InstanceName, String> {
        if text.is_empty()
            || text.len() > Self::MAX_LEN
            || !text.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            let shown: String = text.chars().take(40).collect();
            return Err(format!(
                "instance name {shown:?} must be 1 to {} ASCII letters or digits",
                Self::MAX_LEN
            ));
        }
        Ok(InstanceName(text.to_owned()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// What follows `ses_` in every id this instance makes: the name's length, then the name.
    pub fn tag(&self) -> String {
        format!("{}{}", self.0.len(), self.0)
    }
}

impl fmt::Display for InstanceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Hashes session ids for the maps Brain keys by them: [`SessionIdMap`].
///
/// Every id such a map holds was made by [`SessionId::generate`] (an id from outside is only
/// looked up), so its 20 characters are random (but for an instance's tag of at most 5 fixed
/// characters, [`SessionId::generate_for`], which every word's fold still spreads with the 15 or
/// more random ones): folding its words with a multiply spreads them
/// as well as SipHash does, in a few instructions instead of about a hundred and twenty per
/// lookup (SipHash over the ids was ≈5 % of Brain's instructions per turn, docs/BENCHMARKS.md).
/// Not for keys anybody else chooses: nothing here resists colliding keys made on purpose.
#[derive(Default, Clone, Copy)]
pub(crate) struct SessionIdHasher(u64);

impl SessionIdHasher {
    /// The multiplier of rustc's FxHasher: odd, with its bits spread.
    const MIX: u64 = 0x517c_c1b7_2722_0a95;

    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(Self::MIX);
    }
}

impl std::hash::Hasher for SessionIdHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by session ids (or by a session id and more), hashed with [`SessionIdHasher`].
pub(crate) type SessionIdMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<SessionIdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    /// hashbrown picks a bucket with the hash's low bits and tags entries with its top 7 bits:
    /// both must spread generated ids evenly.
    #[test]
    fn the_id_hasher_spreads_generated_ids_in_low_and_high_bits() {
        use std::hash::BuildHasher;
        let build = std::hash::BuildHasherDefault::<SessionIdHasher>::default();
        let mut low = vec![0u32; 1024];
        let mut high = vec![0u32; 128];
        let ids = 20_480;
        for _ in 0..ids {
            let id = SessionId::generate().unwrap();
            let hash = build.hash_one(&id);
            low[(hash & 1023) as usize] += 1;
            high[(hash >> 57) as usize] += 1;
            // A pair hashes differently from the id alone and from the pair's other number.
            assert_ne!(build.hash_one((&id, 1u64)), build.hash_one((&id, 2u64)));
        }
        // 20 per bucket on average; a fair spread stays well under three times that.
        assert!(
            low.iter().all(|&n| n < 60),
            "low bits: {:?}",
            low.iter().max()
        );
        // 160 per tag on average.
        assert!(
            high.iter().all(|&n| (80..=240).contains(&n)),
            "top bits: {high:?}"
        );
    }

    #[test]
    fn generated_ids_have_the_stated_form_and_differ() {
        let a = SessionId::generate().unwrap();
        let b = SessionId::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(SessionId::parse(a.as_str()), Ok(a.clone()));
        assert_eq!(a.as_str().len(), 24);
    }

    /// Generated ids look uniformly random: every character of the alphabet turns up about
    /// equally often, and neighbouring characters are equal about one time in 62, as
    /// independent ones are. A skewed mapping from bytes to characters fails the first; an id
    /// built from too few random bytes (one byte reused) fails the second. Over 2,000 ids each
    /// character is expected ≈ 645 times (σ ≈ 25) and equal neighbours ≈ 613 times (σ ≈ 25);
    /// the bounds are about ten σ wide.
    #[test]
    fn generated_ids_look_uniformly_random() {
        let mut counts = [0usize; 62];
        let mut equal_neighbours = 0;
        for _ in 0..2_000 {
            let id = SessionId::generate().unwrap();
            let body = &id.as_str().as_bytes()[PREFIX.len()..];
            for &byte in body {
                let at = ALPHABET.iter().position(|&c| c == byte).unwrap();
                counts[at] += 1;
            }
            equal_neighbours += body.windows(2).filter(|pair| pair[0] == pair[1]).count();
        }
        for (at, &count) in counts.iter().enumerate() {
            assert!(
                (395..=895).contains(&count),
                "{:?} came {count} times in 40,000",
                char::from(ALPHABET[at])
            );
        }
        assert!(
            (363..=863).contains(&equal_neighbours),
            "{equal_neighbours} equal neighbours in 38,000 pairs"
        );
    }

    #[test]
    fn tagged_ids_carry_their_instance_at_a_fixed_place() {
        for name in ["a", "b1", "xyz", "Z9z9"] {
            let instance = InstanceName::parse(name).unwrap();
            let id = SessionId::generate_for(&instance).unwrap();
            assert_eq!(SessionId::parse(id.as_str()), Ok(id.clone()));
            assert!(
                id.as_str()
                    .starts_with(&format!("ses_{}{name}", name.len()))
            );
            assert!(id.belongs_to(&instance));
            assert_eq!(id.instance_tag(), Some(instance.clone()));
            assert_ne!(id, SessionId::generate_for(&instance).unwrap());
        }
        let a = InstanceName::parse("a").unwrap();
        let a0 = InstanceName::parse("a0").unwrap();
        assert!(!SessionId::generate_for(&a0).unwrap().belongs_to(&a));
        assert!(!SessionId::generate_for(&a).unwrap().belongs_to(&a0));
        for bad in ["", "abcde", "a-b", "é", "a b"] {
            assert!(InstanceName::parse(bad).is_err(), "{bad:?} accepted");
        }
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
