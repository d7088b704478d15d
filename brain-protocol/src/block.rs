//! How a [`Block`] is read: the tag first when it comes first, buffered only when it does not.
//!
//! serde's derived reading of an internally tagged enum buffers every member of the object into
//! an owned tree before it looks at the tag, and then reads the variant from that tree: about
//! 2,900 instructions for a one-block text message, on every message of every transcript that
//! crosses a pipe (docs/BENCHMARKS.md). Brain, the SDKs and serde all write `type` first, so the
//! reader here takes the tag from the first member and reads the rest straight into the variant.
//! An object whose `type` comes later is buffered, as before. Both ways accept and refuse exactly
//! what the derived reading did: a missing or unknown tag, a member given twice (`type`
//! included), a missing member; unknown members are ignored.

use super::harness::Block;
use serde::de::value::{MapAccessDeserializer, MapDeserializer};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, de::Error as _};
use serde_json::Value;
use std::borrow::Cow;
use std::fmt;

/// The `type` member's values.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Tag {
    Text,
    Image,
    File,
    ToolUse,
    ToolResult,
    Native,
}

/// The other members of each variant. `tag_again` refuses a second `type` member, as the
/// derived reading does.
#[derive(Deserialize)]
struct Text {
    text: String,
    #[serde(rename = "type", default, deserialize_with = "tag_again")]
    _tag_again: (),
}

#[derive(Deserialize)]
struct Image {
    url: String,
    #[serde(rename = "type", default, deserialize_with = "tag_again")]
    _tag_again: (),
}

#[derive(Deserialize)]
struct File {
    media_type: String,
    url: String,
    #[serde(rename = "type", default, deserialize_with = "tag_again")]
    _tag_again: (),
}

#[derive(Deserialize)]
struct ToolUse {
    id: String,
    name: String,
    input: Value,
    #[serde(rename = "type", default, deserialize_with = "tag_again")]
    _tag_again: (),
}

#[derive(Deserialize)]
struct ToolResult {
    tool_use_id: String,
    content: Vec<Block>,
    #[serde(default)]
    is_error: bool,
    #[serde(rename = "type", default, deserialize_with = "tag_again")]
    _tag_again: (),
}

#[derive(Deserialize)]
struct Native {
    format: String,
    data: Value,
    #[serde(rename = "type", default, deserialize_with = "tag_again")]
    _tag_again: (),
}

fn tag_again<'de, D: Deserializer<'de>>(_: D) -> Result<(), D::Error> {
    Err(D::Error::duplicate_field("type"))
}

/// Reads the variant `tag` names from the members after the tag.
fn variant<'de, D: Deserializer<'de>>(tag: Tag, rest: D) -> Result<Block, D::Error> {
    Ok(match tag {
        Tag::Text => {
            let Text { text, .. } = Deserialize::deserialize(rest)?;
            Block::Text { text }
        }
        Tag::Image => {
            let Image { url, .. } = Deserialize::deserialize(rest)?;
            Block::Image { url }
        }
        Tag::File => {
            let File {
                media_type, url, ..
            } = Deserialize::deserialize(rest)?;
            Block::File { media_type, url }
        }
        Tag::ToolUse => {
            let ToolUse {
                id, name, input, ..
            } = Deserialize::deserialize(rest)?;
            Block::ToolUse { id, name, input }
        }
        Tag::ToolResult => {
            let ToolResult {
                tool_use_id,
                content,
                is_error,
                ..
            } = Deserialize::deserialize(rest)?;
            Block::ToolResult {
                tool_use_id,
                content,
                is_error,
            }
        }
        Tag::Native => {
            let Native { format, data, .. } = Deserialize::deserialize(rest)?;
            Block::Native { format, data }
        }
    })
}

impl<'de> Deserialize<'de> for Block {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Block, D::Error> {
        deserializer.deserialize_map(BlockVisitor)
    }
}

struct BlockVisitor;

impl<'de> Visitor<'de> for BlockVisitor {
    type Value = Block;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a content block: an object with a `type`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Block, A::Error> {
        let Some(first) = map.next_key::<Cow<'de, str>>()? else {
            return Err(A::Error::missing_field("type"));
        };
        if first == "type" {
            let tag = map.next_value()?;
            return variant(tag, MapAccessDeserializer::new(map));
        }
        // The tag comes later: keep the members (in order, so that one given twice is still
        // refused by the variant's reading) until it is found.
        let mut members = vec![(first.into_owned(), map.next_value::<Value>()?)];
        let mut tag = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == "type" {
                if tag.is_some() {
                    return Err(A::Error::duplicate_field("type"));
                }
                tag = Some(map.next_value::<Tag>()?);
            } else {
                members.push((key.into_owned(), map.next_value()?));
            }
        }
        let tag = tag.ok_or_else(|| A::Error::missing_field("type"))?;
        variant(tag, MapDeserializer::new(members.into_iter())).map_err(A::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The derived reading the hand-written one replaces, kept here as the reference.
    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    enum Derived {
        Text {
            text: String,
        },
        Image {
            url: String,
        },
        File {
            media_type: String,
            url: String,
        },
        ToolUse {
            id: String,
            name: String,
            input: Value,
        },
        ToolResult {
            tool_use_id: String,
            content: Vec<Block>,
            #[serde(default)]
            is_error: bool,
        },
        Native {
            format: String,
            data: Value,
        },
    }

    fn same(text: &str) {
        let ours = serde_json::from_str::<Block>(text);
        let derived = serde_json::from_str::<Derived>(text);
        assert_eq!(
            ours.is_ok(),
            derived.is_ok(),
            "{text}: {ours:?} vs {derived:?}"
        );
        if let (Ok(ours), Ok(_)) = (&ours, &derived) {
            // The tree reading (from_value) agrees with the text reading.
            let tree: Value = serde_json::from_str(text).unwrap();
            assert_eq!(
                &serde_json::from_value::<Block>(tree).unwrap(),
                ours,
                "{text}"
            );
            // And the block written back reads as the derived enum reads the original.
            let again = serde_json::to_string(ours).unwrap();
            assert_eq!(
                serde_json::from_str::<Derived>(&again).unwrap(),
                derived.unwrap(),
                "{text}"
            );
        }
    }

    #[test]
    fn reads_every_block_as_the_derived_reading_does() {
        for text in [
            r#"{"type":"text","text":"hi"}"#,
            r#"{"text":"hi","type":"text"}"#,
            r#"{"type":"text","text":"hi","extra":[1,{"a":2}]}"#,
            r#"{"type":"image","url":"https://x/y.png"}"#,
            r#"{"url":"https://x","media_type":"application/pdf","type":"file"}"#,
            r#"{"type":"tool_use","id":"t1","name":"sh","input":{"cmd":"ls"}}"#,
            r#"{"type":"tool_use","id":"t1","name":"sh","input":null}"#,
            r#"{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"ok"}]}"#,
            r#"{"tool_use_id":"t1","is_error":true,"type":"tool_result","content":[{"text":"x","type":"text"}]}"#,
            r#"{"type":"native","format":"f","data":[1,2]}"#,
        ] {
            assert!(serde_json::from_str::<Block>(text).is_ok(), "{text}");
            same(text);
        }
    }

    #[test]
    fn refuses_what_the_derived_reading_refuses() {
        for text in [
            r#"{}"#,
            r#"{"text":"hi"}"#,
            r#"{"type":"txt","text":"hi"}"#,
            r#"{"type":7,"text":"hi"}"#,
            r#"{"type":"text"}"#,
            r#"{"type":"text","text":5}"#,
            r#"{"type":"text","text":"a","text":"b"}"#,
            r#"{"text":"a","type":"text","text":"b"}"#,
            r#"{"type":"text","text":"a","type":"text"}"#,
            r#"{"text":"a","type":"text","type":"text"}"#,
            r#"{"type":"tool_use","id":"t1","name":"sh"}"#,
            r#"{"type":"tool_result","tool_use_id":"t1","content":[{"type":"bad"}]}"#,
            r#""text""#,
            r#"null"#,
        ] {
            assert!(serde_json::from_str::<Block>(text).is_err(), "{text}");
            same(text);
        }
        assert_eq!(
            serde_json::from_value::<Block>(json!({"type": "text"}))
                .unwrap_err()
                .to_string(),
            "missing field `text`"
        );
    }
}
