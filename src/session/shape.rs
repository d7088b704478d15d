//! Pure functions that shape an activation's `run` payload (PROTOCOL.md §2, §6): the configuration
//! merge, the runtime envelope and the tool declarations.

use crate::protocol::harness::{EnvironmentRef, Runtime, ToolDeclaration};
use crate::session::SessionId;
use crate::session::request::ToolSpec;
use serde_json::{Map, Value};
use std::collections::HashMap;

/// The text hashed for a deterministic seed starts with this, so that the seed is never the hash of
/// anything else Brain hashes.
pub const SEED_DOMAIN: &str = "brain/harness/v1 deterministic_seed";

/// The activation's configuration: the registration's deployment configuration overridden key by
/// key by the session's.
///
/// Where both sides hold an object under a key, the objects merge recursively by the same rule;
/// otherwise the session's value wins outright (a session scalar or array replaces a deployment
/// object, a session object replaces a deployment scalar). A session `null` is a value like any
/// other: it replaces, it does not delete. Keys keep the map's order.
pub fn merge_configuration(
    deployment: &Map<String, Value>,
    session: &Map<String, Value>,
) -> Map<String, Value> {
    let mut merged = deployment.clone();
    merge_into(&mut merged, session);
    merged
}

fn merge_into(base: &mut Map<String, Value>, over: &Map<String, Value>) {
    for (key, value) in over {
        match (base.get_mut(key), value) {
            (Some(Value::Object(inner)), Value::Object(over_inner)) => {
                merge_into(inner, over_inner)
            }
            _ => {
                base.insert(key.clone(), value.clone());
            }
        }
    }
}

/// The runtime envelope of activation `sequence` of `session`: a pure function of the two, so a
/// replayed position sees the same clock and seed.
///
/// - `logical_time_ms` is the sequence itself. The journal's sequence is the only clock every
///   replay agrees on; it strictly increases within a session, so a harness that orders or
///   timestamps by it stays consistent. It is not wall time and says nothing about real durations.
/// - `deterministic_seed` is the SHA-256 of the UTF-8 text
///   `"brain/harness/v1 deterministic_seed\n{session}\n{sequence}"` (the sequence in decimal),
///   as 64 lowercase hex characters. SHA-256 is fixed by FIPS 180-4, so the seed is the same on
///   every platform and every Rust version, and anyone can recompute it, e.g.
///   `printf 'brain/harness/v1 deterministic_seed\nses_…\n12' | sha256sum`.
pub fn runtime_envelope(session: &SessionId, sequence: u64) -> Runtime {
    use std::io::Write;
    // Built by hand, as `format!` would build it: this runs on the dispatcher for every run.
    let mut text = Vec::with_capacity(SEED_DOMAIN.len() + session.as_str().len() + 22);
    text.extend_from_slice(SEED_DOMAIN.as_bytes());
    text.push(b'\n');
    text.extend_from_slice(session.as_str().as_bytes());
    // Writing into a Vec cannot fail.
    let _ = write!(text, "\n{sequence}");
    Runtime {
        logical_time_ms: sequence,
        deterministic_seed: hex(&sha256(&text)),
    }
}

/// The tool declarations of a `run`: each [`ToolSpec`] in order, with every placement resolved to
/// an [`EnvironmentRef`] carrying that environment's current incarnation from `incarnations`
/// (environment name → sequence of the record that last set it up).
///
/// A placement whose environment has no incarnation in the map is a caller's bug (every declared
/// environment has one from `session_created` on); it is left out and logged, never invented.
pub fn tool_declarations(
    tools: &[ToolSpec],
    incarnations: &HashMap<String, u64>,
) -> Vec<ToolDeclaration> {
    tools
        .iter()
        .map(|tool| ToolDeclaration {
            name: tool.name.clone(),
            description: tool.description.clone(),
            input_schema: tool.input_schema.clone(),
            placements: tool
                .placements
                .iter()
                .filter_map(|environment| match incarnations.get(environment) {
                    Some(&sequence) => Some(EnvironmentRef {
                        environment: environment.clone(),
                        sequence,
                    }),
                    None => {
                        log::error!(
                            "tool {:?}: environment {environment:?} has no incarnation; placement \
                             left out",
                            tool.name
                        );
                        None
                    }
                })
                .collect(),
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for &byte in bytes {
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    text
}

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

/// SHA-256 (FIPS 180-4) of `data`. Small and unoptimised: it hashes a few dozen bytes per
/// activation.
fn sha256(data: &[u8]) -> [u8; 32] {
    let mut state: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut blocks = data.chunks_exact(64);
    for block in &mut blocks {
        compress(&mut state, block);
    }
    // The padding: the rest, a 1 bit, zeros, and the length in bits, in one block or two.
    let rest = blocks.remainder();
    let mut tail = [0u8; 128];
    tail[..rest.len()].copy_from_slice(rest);
    tail[rest.len()] = 0x80;
    let tail_len = if rest.len() < 56 { 64 } else { 128 };
    let bit_len = (data.len() as u64).wrapping_mul(8);
    tail[tail_len - 8..tail_len].copy_from_slice(&bit_len.to_be_bytes());
    for block in tail[..tail_len].chunks_exact(64) {
        compress(&mut state, block);
    }
    let mut digest = [0u8; 32];
    for (bytes, word) in digest.chunks_exact_mut(4).zip(state) {
        bytes.copy_from_slice(&word.to_be_bytes());
    }
    digest
}

/// SHA-256's compression function over one 64-byte block.
fn compress(state: &mut [u32; 8], block: &[u8]) {
    let mut w = [0u32; 64];
    for (word, bytes) in w.iter_mut().zip(block.chunks_exact(4)) {
        *word = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    }
    for t in 16..64 {
        let s0 = w[t - 15].rotate_right(7) ^ w[t - 15].rotate_right(18) ^ (w[t - 15] >> 3);
        let s1 = w[t - 2].rotate_right(17) ^ w[t - 2].rotate_right(19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16]
            .wrapping_add(s0)
            .wrapping_add(w[t - 7])
            .wrapping_add(s1);
    }
    let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = *state;
    for t in 0..64 {
        let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
        let ch = (e & f) ^ (!e & g);
        let t1 = h
            .wrapping_add(s1)
            .wrapping_add(ch)
            .wrapping_add(K[t])
            .wrapping_add(w[t]);
        let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
        let maj = (a & b) ^ (a & c) ^ (b & c);
        let t2 = s0.wrapping_add(maj);
        h = g;
        g = f;
        f = e;
        e = d.wrapping_add(t1);
        d = c;
        c = b;
        b = a;
        a = t1.wrapping_add(t2);
    }
    for (word, add) in state.iter_mut().zip([a, b, c, d, e, f, g, h]) {
        *word = word.wrapping_add(add);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("{other} is not an object"),
        }
    }

    fn merged(deployment: Value, session: Value) -> Value {
        Value::Object(merge_configuration(&map(deployment), &map(session)))
    }

    fn session(text: &str) -> SessionId {
        SessionId::parse(text).unwrap()
    }

    #[test]
    fn session_values_override_deployment_values_key_by_key() {
        assert_eq!(merged(json!({}), json!({})), json!({}));
        assert_eq!(
            merged(json!({"thinking": "low", "kept": 1}), json!({})),
            json!({"thinking": "low", "kept": 1})
        );
        assert_eq!(
            merged(json!({}), json!({"thinking": "high"})),
            json!({"thinking": "high"})
        );
        assert_eq!(
            merged(
                json!({"thinking": "low", "kept": 1}),
                json!({"thinking": "high", "added": [1]})
            ),
            json!({"thinking": "high", "kept": 1, "added": [1]})
        );
    }

    #[test]
    fn nested_objects_merge_recursively() {
        assert_eq!(
            merged(
                json!({"model": {"temperature": 0.2, "limits": {"tokens": 10, "calls": 3}}, "x": 1}),
                json!({"model": {"limits": {"tokens": 20}, "top_p": 0.9}})
            ),
            json!({"model": {"temperature": 0.2, "top_p": 0.9,
                             "limits": {"tokens": 20, "calls": 3}}, "x": 1})
        );
    }

    #[test]
    fn non_object_values_replace_outright() {
        // A session scalar, array or null replaces a deployment object.
        for value in [json!("off"), json!([1, 2]), json!(null), json!(0)] {
            assert_eq!(
                merged(
                    json!({"tools": {"bash": {"timeout_ms": 1}}}),
                    json!({"tools": value})
                ),
                json!({"tools": value})
            );
        }
        // A session object replaces a deployment scalar or array; arrays never merge.
        assert_eq!(
            merged(json!({"tools": "all"}), json!({"tools": {"bash": {}}})),
            json!({"tools": {"bash": {}}})
        );
        assert_eq!(
            merged(json!({"list": [1, 2, 3]}), json!({"list": [4]})),
            json!({"list": [4]})
        );
        // The inputs are untouched.
        let deployment = map(json!({"a": {"b": 1}}));
        let before = deployment.clone();
        let _ = merge_configuration(&deployment, &map(json!({"a": {"b": 2}})));
        assert_eq!(deployment, before);
    }

    #[test]
    fn the_runtime_envelope_is_a_pure_function_of_session_and_sequence() {
        let a = session("ses_12345678901234567890");
        let b = session("ses_12345678901234567891");

        // Known answer, recomputable with
        // printf 'brain/harness/v1 deterministic_seed\nses_12345678901234567890\n12' | sha256sum
        assert_eq!(
            runtime_envelope(&a, 12),
            Runtime {
                logical_time_ms: 12,
                deterministic_seed:
                    "680fa304369b05664e1a0632e6d274b0d12c3d1cf0950918dd2376e544ea586d".into(),
            }
        );
        assert_eq!(
            runtime_envelope(&a, 0).deterministic_seed,
            "357d0739f1182dcb8041bb48c5e079de915af8db8f07ed74bd06f0bb6a66c07a"
        );

        assert_eq!(runtime_envelope(&a, 12), runtime_envelope(&a.clone(), 12));
        assert_ne!(
            runtime_envelope(&a, 12).deterministic_seed,
            runtime_envelope(&a, 13).deterministic_seed
        );
        assert_ne!(
            runtime_envelope(&a, 12).deterministic_seed,
            runtime_envelope(&b, 12).deterministic_seed
        );
        for sequence in [0, 1, 12, (1 << 53) - 1, u64::MAX] {
            let runtime = runtime_envelope(&b, sequence);
            assert_eq!(runtime.logical_time_ms, sequence);
            assert_eq!(runtime.deterministic_seed.len(), 64);
            assert!(
                runtime
                    .deterministic_seed
                    .bytes()
                    .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
            );
        }
    }

    #[test]
    fn sha256_matches_the_standard_vectors() {
        for (input, digest) in [
            (
                &b""[..],
                "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            ),
            (
                b"abc",
                "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            ),
            (
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
                "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
            ),
            // 55 and 64 bytes: the padding edge cases.
            (
                &[b'0'; 55],
                "9f8ef876f51f5313c91cc3f6b8119af09d8bbdd72098fa149b2780eb3591d6be",
            ),
            (
                &[b'0'; 64],
                "60e05bd1b195af2f94112fa7197a5c88289058840ce7c6df9693756bc6250f55",
            ),
            (
                &[b'a'; 1000],
                "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3",
            ),
        ] {
            assert_eq!(hex(&sha256(input)), digest);
        }
    }

    #[test]
    fn tool_declarations_carry_current_incarnations() {
        let tools = vec![
            ToolSpec {
                name: "bash".into(),
                description: "Run a command".into(),
                input_schema: json!({"type": "object", "properties": {"cmd": {"type": "string"}}}),
                placements: vec!["workspace".into(), "sandbox".into()],
            },
            ToolSpec {
                name: "think".into(),
                description: String::new(),
                input_schema: json!({"type": "object"}),
                placements: Vec::new(),
            },
        ];
        let incarnations: HashMap<String, u64> = [
            ("workspace".to_owned(), 3),
            ("sandbox".to_owned(), 17),
            ("other".to_owned(), 9),
        ]
        .into_iter()
        .collect();
        let declarations = tool_declarations(&tools, &incarnations);
        assert_eq!(
            serde_json::to_value(&declarations).unwrap(),
            json!([
                {"name": "bash", "description": "Run a command",
                 "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
                 "placements": [{"environment": "workspace", "sequence": 3},
                                {"environment": "sandbox", "sequence": 17}]},
                {"name": "think", "description": "", "input_schema": {"type": "object"},
                 "placements": []}
            ])
        );

        // A new incarnation shows in the next activation's declarations.
        let mut incarnations = incarnations;
        incarnations.insert("workspace".into(), 40);
        let declarations = tool_declarations(&tools, &incarnations);
        assert_eq!(
            declarations[0].placements[0],
            EnvironmentRef {
                environment: "workspace".into(),
                sequence: 40
            }
        );

        // A placement without an incarnation is left out, never invented.
        incarnations.remove("workspace");
        let declarations = tool_declarations(&tools, &incarnations);
        assert_eq!(
            declarations[0].placements,
            vec![EnvironmentRef {
                environment: "sandbox".into(),
                sequence: 17
            }]
        );
        assert!(tool_declarations(&[], &incarnations).is_empty());
    }
}
