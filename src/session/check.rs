//! Checks of a session's request and inputs against what its harness declared at `initialize`
//! (PROTOCOL.md §2, §4, §5.1): configuration keys, required model metadata, transcript import and
//! media.

use crate::protocol::harness::{Block, ErrorCode, InitializeResult, ModelMetadata};
use crate::session::request::{CreateSession, RequestError, shown};
use serde_json::{Map, Value};

/// Most characters of a list (accepted keys, missing names) shown in one message.
const MAX_LIST_CHARS: usize = 400;

/// Checks a valid create-session request against the registration's agreed `initialize` answer and
/// its deployment configuration. Called at creation, after [`CreateSession::validate`].
///
/// - When the harness declared `configuration_keys`, a top-level key of
///   `agentloop.configuration` outside them fails [`ErrorCode::InvalidConfiguration`], naming it.
///   The deployment configuration was checked at startup; it is checked again here (same code, the
///   message says "deployment") so that the function is sound on its own.
/// - Each of the harness's `required_model_metadata` names must be present and non-null in
///   [`CreateSession::model_or_default`] (`context_window` and `max_output_tokens` are typed
///   fields, `provider` and `name` must be non-empty, other names are looked up in
///   [`ModelMetadata::extra`]); otherwise [`ErrorCode::MissingModelMetadata`] naming every missing
///   one.
/// - A non-empty `transcript` fails [`ErrorCode::UnsupportedInput`] unless the harness declared
///   `transcript_import`.
/// - Media blocks in the transcript follow [`check_input_media`]'s rules.
pub fn check_against_harness(
    request: &CreateSession,
    declared: &InitializeResult,
    deployment: &Map<String, Value>,
) -> Result<(), RequestError> {
    if let Some(keys) = &declared.configuration_keys {
        check_configuration_keys(
            &request.agentloop.configuration,
            keys,
            "agentloop.configuration",
        )?;
        check_configuration_keys(
            deployment,
            keys,
            "the registration's deployment configuration",
        )?;
    }

    let model = request.model_or_default();
    let mut missing: Vec<&str> = Vec::new();
    for name in &declared.required_model_metadata {
        if !has_metadata(&model, name) && !missing.contains(&name.as_str()) {
            missing.push(name);
        }
    }
    if !missing.is_empty() {
        let names: Vec<String> = missing.iter().map(|name| shown(name)).collect();
        let given = if request.model.is_none() {
            " (no model was given, so the default {\"provider\":\"scripted\",\"name\":\"default\"} \
             applies)"
        } else {
            ""
        };
        return Err(RequestError::new(
            ErrorCode::MissingModelMetadata,
            format!(
                "model: missing metadata the harness requires: {}{given}",
                cut(names.join(", "))
            ),
        ));
    }

    if !request.transcript.is_empty() && !declared.capabilities.transcript_import {
        return Err(RequestError::new(
            ErrorCode::UnsupportedInput,
            format!(
                "transcript: the harness does not import transcripts (it did not declare the \
                 transcript_import capability); {} message(s) given",
                request.transcript.len()
            ),
        ));
    }
    for (i, message) in request.transcript.iter().enumerate() {
        check_media(
            &message.content,
            &format!("transcript[{i}].content"),
            declared,
        )?;
    }
    Ok(())
}

/// Checks the media blocks (`image`, `file`) of a user input, including those nested in
/// `tool_result` blocks, against the harness's declarations: any media block fails
/// [`ErrorCode::UnsupportedInput`] unless the harness declared `media`, and even then only
/// `https://` URLs with a host are accepted (anything else fails `unsupported_input`, naming the
/// URL's scheme).
pub fn check_input_media(
    content: &[Block],
    declared: &InitializeResult,
) -> Result<(), RequestError> {
    check_media(content, "input.content", declared)
}

fn check_configuration_keys(
    configuration: &Map<String, Value>,
    accepted: &[String],
    what: &str,
) -> Result<(), RequestError> {
    match configuration
        .keys()
        .find(|key| !accepted.iter().any(|a| a == *key))
    {
        None => Ok(()),
        Some(key) => {
            let list: Vec<String> = accepted.iter().map(|a| shown(a)).collect();
            let list = if list.is_empty() {
                "none".to_owned()
            } else {
                cut(list.join(", "))
            };
            Err(RequestError::new(
                ErrorCode::InvalidConfiguration,
                format!(
                    "{what}: unknown key {} (the harness accepts only: {list})",
                    shown(key)
                ),
            ))
        }
    }
}

fn has_metadata(model: &ModelMetadata, name: &str) -> bool {
    match name {
        "provider" => !model.provider.is_empty(),
        "name" => !model.name.is_empty(),
        "context_window" => model.context_window.is_some(),
        "max_output_tokens" => model.max_output_tokens.is_some(),
        other => model.extra.get(other).is_some_and(|value| !value.is_null()),
    }
}

/// Walks `blocks` and every nested `tool_result` content without recursion, checking each media
/// block. `path` names `blocks` in messages.
fn check_media(
    blocks: &[Block],
    path: &str,
    declared: &InitializeResult,
) -> Result<(), RequestError> {
    let mut pending: Vec<(String, &[Block])> = vec![(path.to_owned(), blocks)];
    while let Some((path, blocks)) = pending.pop() {
        for (i, block) in blocks.iter().enumerate() {
            match block {
                Block::Image { url } => {
                    check_media_url("image", url, &format!("{path}[{i}]"), declared)?
                }
                Block::File { url, .. } => {
                    check_media_url("file", url, &format!("{path}[{i}]"), declared)?
                }
                Block::ToolResult { content, .. } => {
                    pending.push((format!("{path}[{i}].content"), content));
                }
                Block::Text { .. } | Block::ToolUse { .. } | Block::Native { .. } => {}
            }
        }
    }
    Ok(())
}

fn check_media_url(
    what: &str,
    url: &str,
    path: &str,
    declared: &InitializeResult,
) -> Result<(), RequestError> {
    let refuse = |message: String| Err(RequestError::new(ErrorCode::UnsupportedInput, message));
    if !declared.capabilities.media {
        return refuse(format!(
            "{path}: {what} blocks are not accepted: the harness did not declare the media \
             capability"
        ));
    }
    let Some((scheme, rest)) = url.split_once(':').filter(|(scheme, _)| is_scheme(scheme)) else {
        return refuse(format!(
            "{path}: {what} URL {} has no scheme (only https: URLs are accepted)",
            shown(url)
        ));
    };
    if !scheme.eq_ignore_ascii_case("https") {
        return refuse(format!(
            "{path}: {what} URL scheme {} is not accepted (only https: URLs are accepted)",
            shown(scheme)
        ));
    }
    let host_present = rest
        .strip_prefix("//")
        .is_some_and(|rest| !rest.is_empty() && !rest.starts_with(['/', '?', '#']));
    if !host_present {
        return refuse(format!(
            "{path}: {what} URL {} is not an https:// URL with a host",
            shown(url)
        ));
    }
    Ok(())
}

/// RFC 3986: `ALPHA *( ALPHA / DIGIT / "+" / "-" / "." )`.
fn is_scheme(text: &str) -> bool {
    let mut bytes = text.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphabetic())
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
}

/// `text` truncated to [`MAX_LIST_CHARS`] characters.
fn cut(text: String) -> String {
    match text.char_indices().nth(MAX_LIST_CHARS) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::{Capabilities, Identity, Message, PROTOCOL, Role};
    use serde_json::json;

    fn declared() -> InitializeResult {
        InitializeResult {
            protocol: PROTOCOL.to_owned(),
            identity: Identity {
                name: "test".into(),
                version: "1".into(),
            },
            state_version: "1".into(),
            capabilities: Capabilities::default(),
            configuration_keys: None,
            required_model_metadata: Vec::new(),
        }
    }

    fn request(value: Value) -> CreateSession {
        CreateSession::parse(value.to_string().as_bytes()).unwrap()
    }

    fn map(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("{other} is not an object"),
        }
    }

    fn assert_refused(result: Result<(), RequestError>, code: ErrorCode, named: &[&str]) {
        let error = result.expect_err("accepted");
        assert_eq!(error.code, code, "{error}");
        for name in named {
            assert!(
                error.message.contains(name),
                "{error} does not name {name:?}"
            );
        }
    }

    fn image(url: &str) -> Block {
        Block::Image { url: url.into() }
    }

    #[test]
    fn configuration_keys_are_checked_when_declared() {
        let session = request(json!({"agentloop": {"name": "pi",
                                     "configuration": {"thinking": "high", "temperature": 0.2}}}));
        let deployment = map(json!({"thinking": "low", "model_options": {}}));
        // No declaration accepts every key.
        assert_eq!(
            check_against_harness(&session, &declared(), &deployment),
            Ok(())
        );

        let mut harness = declared();
        harness.configuration_keys = Some(vec!["thinking".into(), "model_options".into()]);
        assert_refused(
            check_against_harness(&session, &harness, &deployment),
            ErrorCode::InvalidConfiguration,
            &["agentloop.configuration", "\"temperature\"", "\"thinking\""],
        );

        let ok =
            request(json!({"agentloop": {"name": "pi", "configuration": {"thinking": "high"}}}));
        assert_eq!(check_against_harness(&ok, &harness, &deployment), Ok(()));

        // Only top-level keys are checked.
        let nested = request(json!({"agentloop": {"name": "pi",
                                    "configuration": {"model_options": {"anything": 1}}}}));
        assert_eq!(
            check_against_harness(&nested, &harness, &deployment),
            Ok(())
        );

        // An empty declaration accepts no key.
        harness.configuration_keys = Some(Vec::new());
        assert_refused(
            check_against_harness(&ok, &harness, &Map::new()),
            ErrorCode::InvalidConfiguration,
            &["\"thinking\"", "none"],
        );

        // The deployment value is held to the same rule.
        harness.configuration_keys = Some(vec!["thinking".into()]);
        assert_refused(
            check_against_harness(&ok, &harness, &deployment),
            ErrorCode::InvalidConfiguration,
            &["deployment", "\"model_options\""],
        );
    }

    #[test]
    fn required_model_metadata_must_be_present() {
        let mut harness = declared();
        harness.required_model_metadata = vec![
            "context_window".into(),
            "max_output_tokens".into(),
            "region".into(),
        ];

        let full = request(json!({"agentloop": {"name": "pi"},
            "model": {"provider": "p", "name": "m", "context_window": 1000,
                      "max_output_tokens": 100, "region": "eu"}}));
        assert_eq!(check_against_harness(&full, &harness, &Map::new()), Ok(()));

        let partial = request(json!({"agentloop": {"name": "pi"},
            "model": {"provider": "p", "name": "m", "context_window": 1000, "region": null}}));
        let error = check_against_harness(&partial, &harness, &Map::new()).unwrap_err();
        assert_eq!(error.code, ErrorCode::MissingModelMetadata);
        assert!(error.message.contains("\"max_output_tokens\""), "{error}");
        assert!(error.message.contains("\"region\""), "{error}");
        assert!(!error.message.contains("\"context_window\""), "{error}");

        let absent = request(json!({"agentloop": {"name": "pi"}}));
        assert_refused(
            check_against_harness(&absent, &harness, &Map::new()),
            ErrorCode::MissingModelMetadata,
            &[
                "\"context_window\"",
                "\"max_output_tokens\"",
                "\"region\"",
                "default",
            ],
        );

        // provider and name are always there.
        harness.required_model_metadata = vec!["provider".into(), "name".into()];
        assert_eq!(
            check_against_harness(&absent, &harness, &Map::new()),
            Ok(())
        );

        // A name required twice is named once.
        harness.required_model_metadata = vec!["region".into(), "region".into()];
        let error = check_against_harness(&absent, &harness, &Map::new()).unwrap_err();
        assert_eq!(error.message.matches("\"region\"").count(), 1, "{error}");
    }

    #[test]
    fn a_transcript_needs_transcript_import() {
        let with_transcript = request(json!({"agentloop": {"name": "pi"},
            "transcript": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}));
        let mut harness = declared();
        assert_refused(
            check_against_harness(&with_transcript, &harness, &Map::new()),
            ErrorCode::UnsupportedInput,
            &["transcript", "transcript_import"],
        );
        // An empty transcript is no import.
        let without = request(json!({"agentloop": {"name": "pi"}, "transcript": []}));
        assert_eq!(
            check_against_harness(&without, &harness, &Map::new()),
            Ok(())
        );

        harness.capabilities.transcript_import = true;
        assert_eq!(
            check_against_harness(&with_transcript, &harness, &Map::new()),
            Ok(())
        );
    }

    #[test]
    fn media_in_a_transcript_needs_media_and_https() {
        let mut harness = declared();
        harness.capabilities.transcript_import = true;
        let mut session = request(json!({"agentloop": {"name": "pi"}}));
        session.transcript = vec![
            Message::text(Role::User, "look"),
            Message {
                role: Role::User,
                content: vec![Block::text("this"), image("https://example.com/a.png")],
            },
        ];
        assert_refused(
            check_against_harness(&session, &harness, &Map::new()),
            ErrorCode::UnsupportedInput,
            &["transcript[1].content[1]", "image", "media"],
        );
        harness.capabilities.media = true;
        assert_eq!(
            check_against_harness(&session, &harness, &Map::new()),
            Ok(())
        );

        session.transcript[1].content[1] = Block::File {
            media_type: "application/pdf".into(),
            url: "file:///etc/passwd".into(),
        };
        assert_refused(
            check_against_harness(&session, &harness, &Map::new()),
            ErrorCode::UnsupportedInput,
            &["transcript[1].content[1]", "file URL scheme \"file\""],
        );
    }

    #[test]
    fn input_media_needs_media_and_https() {
        let mut harness = declared();
        assert_eq!(check_input_media(&[Block::text("hello")], &harness), Ok(()));
        assert_refused(
            check_input_media(&[image("https://example.com/a.png")], &harness),
            ErrorCode::UnsupportedInput,
            &["input.content[0]", "media"],
        );

        harness.capabilities.media = true;
        for url in [
            "https://example.com/a.png",
            "HTTPS://example.com/a.png",
            "https://example.com",
        ] {
            assert_eq!(check_input_media(&[image(url)], &harness), Ok(()), "{url}");
        }
        for (url, named) in [
            ("http://example.com/a.png", "scheme \"http\""),
            ("data:image/png;base64,AAAA", "scheme \"data\""),
            ("file:///etc/passwd", "scheme \"file\""),
            ("javascript:alert(1)", "scheme \"javascript\""),
            ("ftp://example.com/a", "scheme \"ftp\""),
            ("/etc/passwd", "has no scheme"),
            ("example.com/a.png", "has no scheme"),
            ("", "has no scheme"),
            ("1https://x", "has no scheme"),
            ("https:example.com", "with a host"),
            ("https:///path", "with a host"),
            ("https://", "with a host"),
        ] {
            assert_refused(
                check_input_media(&[Block::text("x"), image(url)], &harness),
                ErrorCode::UnsupportedInput,
                &["input.content[1]", named],
            );
        }

        // Nested in a tool result, and bounded when hostile.
        let nested = Block::ToolResult {
            tool_use_id: "t1".into(),
            content: vec![
                Block::text("ok"),
                Block::ToolResult {
                    tool_use_id: "t2".into(),
                    content: vec![image("http://inner")],
                    is_error: false,
                },
            ],
            is_error: false,
        };
        assert_refused(
            check_input_media(&[nested], &harness),
            ErrorCode::UnsupportedInput,
            &["input.content[0].content[1].content[0]", "\"http\""],
        );
        let long = format!("{}:x", "z".repeat(100_000));
        let error = check_input_media(&[image(&long)], &harness).unwrap_err();
        assert!(error.message.chars().count() < 400, "{}", error.message);
    }
}
