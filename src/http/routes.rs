//! The routes of PRODUCT.md's HTTP API: matching, the checks made before a body is read, and the
//! handlers, each a thin layer over the library API.

use super::auth;
use super::metrics;
use super::request::{Head, query_pairs};
use super::response::Response;
use super::server::Shared;
use super::sse::Follow;
use super::wait::Wait;
use crate::api::{Activation, CreateOptions, SendOptions, Session};
use crate::protocol::harness::{ErrorCode, UserInput};
use crate::session::{CreateSession, IdempotencyKey, SessionId};
use serde_json::{Map, Value, json};

/// Default page size of `GET …/events`.
const DEFAULT_PAGE: usize = 100;

/// Largest page size of `GET …/events` (larger asks are cut to it).
const MAX_PAGE: usize = 1000;

/// A page of `GET …/events` ends early once its records take this many bytes (it always holds at
/// least one record); `next_after` says where to go on.
const MAX_PAGE_BYTES: usize = 8 * 1024 * 1024;

/// What a handler wants done with the connection.
pub(crate) enum Reply {
    /// Answer this.
    Done(Response),
    /// Wait for an admitted activation's outcome on a thread of its own.
    Wait(Wait),
    /// Stream the session's journal on a thread of its own.
    Follow(Follow),
}

impl From<Response> for Reply {
    fn from(response: Response) -> Reply {
        Reply::Done(response)
    }
}

/// The OpenAPI document of this API (docs/openapi.yaml), served at [`OPENAPI_PATH`].
pub const OPENAPI: &str = include_str!("../../docs/openapi.yaml");

/// Where [`OPENAPI`] is served, without authentication: it describes the routes and reveals
/// nothing about the deployment.
pub const OPENAPI_PATH: &str = "/v1/openapi.yaml";

/// What a session route acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Messages,
    Events,
    Activations,
    Cancel,
    Passivate,
    Close,
    Transcript,
}

/// What a route is, before its session id is filled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Live,
    Ready,
    Metrics,
    OpenApi,
    Sessions,
    Session,
    Action(Action),
}

/// The session id's place in a path template.
const SESSION_ID: &str = "{session_id}";

/// The router: every route the server answers, as the OpenAPI document writes its path, with
/// the methods it allows. Nothing else is answered, so `tests/openapi.rs` holds the document to
/// this table (and the server to both).
const TABLE: [(&str, &str, Kind); 13] = [
    ("/health/live", "GET", Kind::Live),
    ("/health/ready", "GET", Kind::Ready),
    ("/metrics", "GET", Kind::Metrics),
    (OPENAPI_PATH, "GET", Kind::OpenApi),
    ("/v1/sessions", "GET, POST", Kind::Sessions),
    ("/v1/sessions/{session_id}", "GET, DELETE", Kind::Session),
    (
        "/v1/sessions/{session_id}/messages",
        "POST",
        Kind::Action(Action::Messages),
    ),
    (
        "/v1/sessions/{session_id}/activations",
        "POST",
        Kind::Action(Action::Activations),
    ),
    (
        "/v1/sessions/{session_id}/events",
        "GET, POST",
        Kind::Action(Action::Events),
    ),
    (
        "/v1/sessions/{session_id}/transcript",
        "GET",
        Kind::Action(Action::Transcript),
    ),
    (
        "/v1/sessions/{session_id}/cancel",
        "POST",
        Kind::Action(Action::Cancel),
    ),
    (
        "/v1/sessions/{session_id}/passivate",
        "POST",
        Kind::Action(Action::Passivate),
    ),
    (
        "/v1/sessions/{session_id}/close",
        "POST",
        Kind::Action(Action::Close),
    ),
];

/// Every route the server answers: its path template and its methods (`"GET, POST"`).
pub fn routes() -> impl Iterator<Item = (&'static str, &'static str)> {
    TABLE.iter().map(|&(template, allow, _)| (template, allow))
}

/// A matched path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Route<'a> {
    kind: Kind,
    /// The session id in the path (empty for routes without one).
    id: &'a str,
    /// The methods the route answers, for `405` and `Allow`.
    allow: &'static str,
}

impl Route<'_> {
    fn allows(self, method: &str) -> bool {
        self.allow.split(", ").any(|m| m == method)
    }
}

fn route(path: &str) -> Option<Route<'_>> {
    let segments: Vec<&str> = path.strip_prefix('/')?.split('/').collect();
    TABLE.iter().find_map(|&(template, allow, kind)| {
        let pattern = template.strip_prefix('/')?.split('/');
        if pattern.clone().count() != segments.len() {
            return None;
        }
        let mut id = "";
        for (expected, segment) in pattern.zip(&segments) {
            if expected == SESSION_ID {
                id = segment;
            } else if expected != *segment {
                return None;
            }
        }
        Some(Route { kind, id, allow })
    })
}

fn is_v1(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/")
}

/// Whether a `Content-Type` names JSON (`application/json`, parameters allowed).
fn is_json(content_type: &str) -> bool {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    media.eq_ignore_ascii_case("application/json")
}

/// The checks made on the head alone, before any body is read: the token on `/v1`, the route
/// and method, the body's size and type. `Some` is the answer; the body is then left unread.
pub(crate) fn before_body(shared: &Shared, head: &Head) -> Option<Response> {
    if is_v1(&head.path)
        && head.path != OPENAPI_PATH
        && !auth::authorized(head.header("authorization"), &shared.token)
    {
        return Some(
            Response::error(
                401,
                ErrorCode::InvalidRequest.as_str(),
                "missing or wrong bearer token: send Authorization: Bearer <token>",
            )
            .header("www-authenticate", "Bearer"),
        );
    }
    let Some(matched) = route(&head.path) else {
        return Some(Response::error(
            404,
            ErrorCode::InvalidRequest.as_str(),
            format!("no route {}", shown(&head.path)),
        ));
    };
    if !matched.allows(&head.method) {
        return Some(
            Response::error(
                405,
                ErrorCode::InvalidRequest.as_str(),
                format!(
                    "{} is not allowed on {}; allowed: {}",
                    shown(&head.method),
                    shown(&head.path),
                    matched.allow
                ),
            )
            .header("allow", matched.allow),
        );
    }
    let limit = shared.options.max_body_bytes;
    if head.content_length > limit as u64 {
        return Some(
            Response::error(
                413,
                ErrorCode::InputTooLarge.as_str(),
                format!(
                    "the body is {} bytes, over the limit of {limit}",
                    head.content_length
                ),
            )
            .closing(),
        );
    }
    let content_type = head.header("content-type");
    let typed_wrong = content_type.is_some_and(|t| !is_json(t));
    if typed_wrong || (head.content_length > 0 && content_type.is_none()) {
        return Some(Response::error(
            415,
            ErrorCode::InvalidRequest.as_str(),
            format!(
                "request bodies must be application/json, not {}",
                content_type.map_or("an untyped body".to_owned(), shown)
            ),
        ));
    }
    None
}

/// At most 100 characters of an untrusted string, for messages.
fn shown(text: &str) -> String {
    let mut shown: String = text.chars().take(100).collect();
    if shown.len() < text.len() {
        shown.push('…');
    }
    format!("{shown:?}")
}

/// 421 Misdirected Request for an id another named instance made (issue 28): a router sent it
/// to the wrong Brain, which must say so rather than `unknown_session`.
fn misdirected(shared: &Shared, id: &SessionId) -> Option<Response> {
    let ours = shared.brain.instance()?;
    if id.belongs_to(ours) {
        return None;
    }
    let owner = match id.instance_tag() {
        Some(owner) => format!("instance {:?}", owner.as_str()),
        None => "no instance".to_owned(),
    };
    Some(Response::error(
        421,
        "misdirected_request",
        format!(
            "session {id} belongs to {owner}, not to this instance {:?}: the router sent it here",
            ours.as_str()
        ),
    ))
}

/// Answers a request that passed [`before_body`].
pub(crate) fn handle(shared: &Shared, head: &Head, body: Vec<u8>) -> Reply {
    let Some(matched) = route(&head.path) else {
        return Response::error(404, ErrorCode::InvalidRequest.as_str(), "no such route").into();
    };
    let method = head.method.as_str();
    let (id, action) = match matched.kind {
        Kind::Live => return Response::empty(204).into(),
        Kind::Ready => return ready(shared).into(),
        Kind::Metrics => return metrics::render(shared).into(),
        Kind::OpenApi => {
            return Response::text(200, "application/yaml", OPENAPI.to_owned()).into();
        }
        Kind::Sessions if method == "POST" => return create(shared, head, &body).into(),
        Kind::Sessions => return list(shared).into(),
        Kind::Session => (matched.id, None),
        Kind::Action(action) => (matched.id, Some(action)),
    };
    let id = match SessionId::parse(id) {
        Ok(id) => id,
        Err(message) => return Response::bad_request(message).into(),
    };
    if let Some(misdirected) = misdirected(shared, &id) {
        return misdirected.into();
    }
    let session = shared.brain.session(&id);
    match (method, action) {
        ("GET", None) => api(session.info(), |info| Response::json(200, &info)),
        ("DELETE", None) => api(session.delete(), |()| Response::empty(204)),
        ("POST", Some(Action::Messages)) => match user_input(&body) {
            Ok(input) => activate(shared, head, &session, Some(input)),
            Err(response) => response.into(),
        },
        ("POST", Some(Action::Activations)) => match no_fields(&body) {
            Ok(()) => activate(shared, head, &session, None),
            Err(response) => response.into(),
        },
        ("POST", Some(Action::Events)) => append_event(&session, &body).into(),
        ("GET", Some(Action::Events)) => events(shared, head, session),
        ("POST", Some(Action::Cancel)) => api(session.cancel(), |cancelled| {
            Response::json(
                200,
                &json!({
                    "sequence": cancelled.sequence,
                    "was_running": cancelled.was_running,
                    // A running activation leaves the session interrupted.
                    "interrupted": cancelled.was_running,
                }),
            )
        }),
        ("POST", Some(Action::Passivate)) => {
            api(session.passivate(), |info| Response::json(200, &info))
        }
        ("POST", Some(Action::Close)) => api(session.close(), |info| Response::json(200, &info)),
        ("GET", Some(Action::Transcript)) => api(session.transcript(), |(messages, through)| {
            Response::json(200, &json!({"messages": messages, "through": through}))
        }),
        _ => Response::error(
            405,
            ErrorCode::InvalidRequest.as_str(),
            "method not allowed",
        )
        .header("allow", matched.allow)
        .into(),
    }
}

/// The library's answer as a response: `ok` on success, the error's status otherwise.
fn api<T>(result: Result<T, crate::ApiError>, ok: impl FnOnce(T) -> Response) -> Reply {
    match result {
        Ok(value) => ok(value).into(),
        Err(error) => Response::api(&error).into(),
    }
}

fn ready(shared: &Shared) -> Response {
    let status = shared.brain.status();
    if status.ready() {
        return Response::empty(204);
    }
    let (code, message) = if status.shutting_down {
        (ErrorCode::ShuttingDown, "Brain is shutting down")
    } else if status.journal_failure.is_some() {
        (
            ErrorCode::JournalFailed,
            "the journal can no longer make records durable",
        )
    } else {
        (
            ErrorCode::AgentloopUnavailable,
            "no registration has a healthy worker",
        )
    };
    Response::json(
        503,
        &json!({"error": {"code": code.as_str(), "message": message, "detail": status}}),
    )
}

/// Parses a body that must be a JSON object: `400` when it is not JSON, `422` when it is JSON of
/// another kind.
fn json_object(body: &[u8]) -> Result<Map<String, Value>, Response> {
    if body.is_empty() {
        return Err(Response::bad_request(
            "the body is empty; a JSON object is expected",
        ));
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(object)) => Ok(object),
        Ok(_) => Err(Response::invalid_field("the body must be a JSON object")),
        Err(error) => Err(Response::bad_request(format!(
            "the body is not valid JSON: {error}"
        ))),
    }
}

/// Refuses keys other than `allowed`, naming the first.
fn only_keys(object: &Map<String, Value>, allowed: &[&str]) -> Result<(), Response> {
    match object.keys().find(|key| !allowed.contains(&key.as_str())) {
        Some(key) => Err(Response::invalid_field(format!(
            "unknown key {}; accepted: {}",
            shown(key),
            allowed.join(", ")
        ))),
        None => Ok(()),
    }
}

/// The `Idempotency-Key` header, if any: `400` naming what is wrong with a malformed one.
fn idempotency_key(head: &Head) -> Result<Option<IdempotencyKey>, Response> {
    match head.header("idempotency-key") {
        None => Ok(None),
        Some(key) => IdempotencyKey::parse(key)
            .map(Some)
            .map_err(|why| Response::bad_request(format!("Idempotency-Key: {why}"))),
    }
}

fn create(shared: &Shared, head: &Head, body: &[u8]) -> Response {
    let idempotency_key = match idempotency_key(head) {
        Ok(key) => key,
        Err(response) => return response,
    };
    let mut object = match json_object(body) {
        Ok(object) => object,
        Err(response) => return response,
    };
    let from = match object.remove("from") {
        None => None,
        Some(Value::String(from)) => match SessionId::parse(&from) {
            Ok(from) => Some(from),
            Err(message) => return Response::invalid_field(format!("from: {message}")),
        },
        Some(_) => return Response::invalid_field("from: must be a session id string"),
    };
    // The body parsed as JSON, so whatever CreateSession refuses is a field: 422.
    let request = match serde_json::to_vec(&Value::Object(object))
        .map_err(|error| error.to_string())
        .and_then(|bytes| CreateSession::parse(&bytes).map_err(|error| error.message))
    {
        Ok(request) => request,
        Err(message) => return Response::invalid_field(message),
    };
    let options = CreateOptions {
        from,
        idempotency_key,
    };
    let session = match shared.brain.create_session_with(request, options) {
        Ok(session) => session,
        Err(error) => return Response::api(&error),
    };
    let location = format!("/v1/sessions/{}", session.id());
    let response = match session.info() {
        Ok(info) => Response::json(201, &info),
        // Created, but the view is not available (Brain is stopping): the id is what matters.
        Err(_) => Response::json(201, &json!({"session_id": session.id()})),
    };
    response.header("location", location)
}

fn list(shared: &Shared) -> Response {
    match shared.brain.sessions() {
        Ok(sessions) => Response::json(200, &json!({"sessions": sessions})),
        Err(error) => Response::api(&error),
    }
}

fn user_input(body: &[u8]) -> Result<UserInput, Response> {
    let object = json_object(body)?;
    only_keys(&object, &["content"])?;
    serde_json::from_value(Value::Object(object))
        .map_err(|error| Response::invalid_field(format!("the user input is refused: {error}")))
}

/// An event-only activation takes no body, an empty one, or `{}`.
fn no_fields(body: &[u8]) -> Result<(), Response> {
    if body.is_empty() {
        return Ok(());
    }
    only_keys(&json_object(body)?, &[])
}

fn prefers_async(head: &Head) -> bool {
    head.tokens("prefer").any(|preference| {
        let name = preference.split(';').next().unwrap_or_default().trim();
        name.eq_ignore_ascii_case("respond-async")
    })
}

/// `{"session_id","sequence"}`: the activation was admitted; its outcome comes later.
pub(crate) fn accepted(activation: &Activation) -> Response {
    Response::json(
        202,
        &json!({"session_id": activation.session_id(), "sequence": activation.sequence()}),
    )
}

/// Starts an activation and answers `202` at once under `Prefer: respond-async`, else hands the
/// connection to a long wait. The long wait's permit is taken first: a request refused for want
/// of one is not admitted.
fn activate(shared: &Shared, head: &Head, session: &Session, input: Option<UserInput>) -> Reply {
    let options = match idempotency_key(head) {
        Ok(idempotency_key) => SendOptions {
            deadline: None,
            idempotency_key,
        },
        Err(response) => return response.into(),
    };
    let respond_async = prefers_async(head);
    let permit = if respond_async {
        None
    } else {
        match shared.long_waits.try_acquire() {
            Some(permit) => Some(permit),
            None => {
                return Response::overloaded(format!(
                    "{} requests already wait for their outcome, the limit; retry, or send \
                     Prefer: respond-async and follow the events",
                    shared.long_waits.max()
                ))
                .into();
            }
        }
    };
    let started = match input {
        Some(input) => session.send_with(input, options),
        None => session.deliver_events_with(options),
    };
    let activation = match started {
        Ok(activation) => activation,
        Err(error) => return Response::api(&error).into(),
    };
    match permit {
        Some(permit) => Reply::Wait(Wait { activation, permit }),
        None => accepted(&activation)
            .header("preference-applied", "respond-async")
            .into(),
    }
}

fn append_event(session: &Session, body: &[u8]) -> Response {
    let mut object = match json_object(body) {
        Ok(object) => object,
        Err(response) => return response,
    };
    if let Err(response) = only_keys(&object, &["type", "data"]) {
        return response;
    }
    let event_type = match object.remove("type") {
        Some(Value::String(event_type)) => event_type,
        Some(_) => return Response::invalid_field("type: must be a string"),
        None => return Response::invalid_field("type: missing; an event is {\"type\",\"data\"}"),
    };
    let data = object.remove("data").unwrap_or(Value::Null);
    match session.append_event(&event_type, data) {
        Ok(sequence) => Response::json(201, &json!({"sequence": sequence})),
        Err(error) => Response::api(&error),
    }
}

fn events(shared: &Shared, head: &Head, session: Session) -> Reply {
    let Some(pairs) = query_pairs(head.query.as_deref()) else {
        return Response::bad_request("the query is malformed").into();
    };
    let mut after = 0u64;
    let mut limit = DEFAULT_PAGE;
    for (name, value) in pairs {
        match name.as_str() {
            "after" => match value.parse() {
                Ok(value) => after = value,
                Err(_) => {
                    return Response::bad_request(format!(
                        "after: {} is not a sequence number",
                        shown(&value)
                    ))
                    .into();
                }
            },
            "limit" => match value.parse::<usize>() {
                Ok(value) if value > 0 => limit = value.min(MAX_PAGE),
                _ => {
                    return Response::bad_request(format!(
                        "limit: {} is not a count from 1 to {MAX_PAGE}",
                        shown(&value)
                    ))
                    .into();
                }
            },
            _ => {}
        }
    }
    let last_event_id = match head
        .header("last-event-id")
        .map(|last| (last, last.trim().parse()))
    {
        None => None,
        Some((_, Ok(last))) => Some(last),
        Some((last, Err(_))) => {
            return Response::bad_request(format!(
                "Last-Event-ID: {} is not a sequence number",
                shown(last)
            ))
            .into();
        }
    };
    let streams = head
        .tokens("accept")
        .any(|t| t.split(';').next().unwrap_or_default().trim() == "text/event-stream");
    if !streams {
        return api(session.events(after, limit), |events| page(after, events));
    }
    if let Some(last) = last_event_id {
        after = last;
    }
    // Refuse an unknown session here, with its status, rather than in the stream.
    if let Err(error) = session.events(after, 1) {
        return Response::api(&error).into();
    }
    match shared.followers.try_acquire() {
        Some(permit) => Reply::Follow(Follow {
            session,
            after,
            permit,
        }),
        None => Response::overloaded(format!(
            "{} SSE streams are open, the limit; retry later",
            shared.followers.max()
        ))
        .into(),
    }
}

/// `{"events":[…],"next_after":N}`, cut at [`MAX_PAGE_BYTES`].
fn page(after: u64, events: Vec<crate::protocol::harness::Event>) -> Response {
    let mut body = b"{\"events\":[".to_vec();
    let mut next_after = after;
    for (index, event) in events.iter().enumerate() {
        if index > 0 {
            if body.len() > MAX_PAGE_BYTES {
                break;
            }
            body.push(b',');
        }
        if let Err(error) = serde_json::to_writer(&mut body, event) {
            return Response::error(
                500,
                "internal_error",
                format!("serializing a record: {error}"),
            );
        }
        next_after = event.sequence;
    }
    body.extend_from_slice(format!("],\"next_after\":{next_after}}}").as_bytes());
    Response {
        body,
        content_type: Some(super::response::JSON),
        ..Response::empty(200)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_match_their_routes_and_nothing_else() {
        let kind = |path| route(path).map(|r| (r.kind, r.id));
        assert_eq!(kind("/health/live"), Some((Kind::Live, "")));
        assert_eq!(kind("/v1/openapi.yaml"), Some((Kind::OpenApi, "")));
        assert_eq!(kind("/v1/sessions"), Some((Kind::Sessions, "")));
        assert_eq!(kind("/v1/sessions/x"), Some((Kind::Session, "x")));
        assert_eq!(
            kind("/v1/sessions/x/cancel"),
            Some((Kind::Action(Action::Cancel), "x"))
        );
        assert_eq!(kind("/v1/sessions/"), Some((Kind::Session, "")));
        assert_eq!(kind("/v1/sessions/x/other"), None);
        assert_eq!(kind("/v1/sessions/x/events/1"), None);
        assert_eq!(kind("/v1"), None);
        assert_eq!(kind("health/live"), None);
        let allows = |path, method| route(path).is_some_and(|r| r.allows(method));
        assert!(allows("/v1/sessions/x", "DELETE"));
        assert!(!allows("/v1/sessions/x", "POST"));
        assert!(allows("/v1/sessions/x/events", "POST"));
        // Each template matches itself, with its own entry, and no two templates are the same.
        for (template, allow, kind) in TABLE {
            let matched = route(template).expect("a template matches itself");
            assert_eq!((matched.kind, matched.allow), (kind, allow), "{template}");
        }
    }

    #[test]
    fn json_content_types_are_recognised() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/jsonx"));
    }
}
