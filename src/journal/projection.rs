//! The projection rules: how one record changes a [`SessionView`]. Every journal applies records
//! through [`apply`], on append and on replay, so they always agree.

use super::{NewRecord, SessionStatus, SessionView};
use crate::protocol::harness::{Message, RecordKind};
use crate::session::Keyed;
use serde::Deserialize;
use serde_json::{Value, json};

/// The reserved kv key holding the activation marker, `{"sequence": N}` (PROTOCOL.md §6).
pub const ACTIVATION_MARKER_KEY: &str = "brain.harness.activation";

/// The reserved kv key holding the events cursor, a sequence number (PROTOCOL.md §6).
pub const EVENTS_CURSOR_KEY: &str = "brain.events_cursor";

/// Applies the record with `sequence` to `view`.
///
/// `view.last_sequence` always becomes `sequence`. Then, by kind:
///
/// - `session_created`: status `Open`, `created` = the data.
/// - `activation_queued`: a `Passivated` session becomes `Open` (its next activation reopens it);
///   an `idempotency` `{"key", "digest"}` joins `activation_keys`.
/// - `activation_started` `{"activation": N}`: sets the marker: kv [`ACTIVATION_MARKER_KEY`] =
///   `{"sequence": N}`, `marker` = `Some(N)`.
/// - `activation_finished` `{"outcome", "events_through"?, …}`: only when `outcome` is
///   `"completed"`, removes the marker and, if `events_through` is a number (absent or `null`
///   leaves it), sets kv [`EVENTS_CURSOR_KEY`] and `events_cursor` to it. Other outcomes leave the
///   marker: the session is then interrupted.
/// - `transcript_delta` `{"keep": K, "append": [Message]}`: the transcript becomes its first `K`
///   messages followed by `append`; a `K` beyond the transcript's length keeps it all.
///   `transcript_through` = `sequence`.
/// - `kv_set` `{"key", "value"}`: stores the value (`null` is stored, not removed).
///   `kv_delete` `{"key"}`: removes the key (absent is fine).
/// - `model_call_started`, `tool_call_started`, `environment_started`: `sequence` joins
///   `unfinished_effects`; `model_call_started` also counts in `model_calls`.
///   `model_call_finished`, `tool_call_finished`, `environment_finished` `{"started": S, …}`:
///   `S` leaves `unfinished_effects`.
/// - `session_passivated`: `Passivated`. `session_closed`: `Closed`.
/// - `event_emitted`: nothing beyond `last_sequence`.
///
/// Data that does not fit its kind's shape changes nothing but `last_sequence`; the `Err` says
/// what was wrong, for the caller to log with the session's id. The record itself is still valid
/// to store: the dispatcher builds these records, so malformed data is a bug, never input, and
/// refusing it would only lose the record. `apply` never panics.
pub fn apply(view: &mut SessionView, sequence: u64, record: &NewRecord) -> Result<(), String> {
    view.last_sequence = sequence;
    let data = &record.data;
    match record.kind {
        RecordKind::SessionCreated => {
            view.status = SessionStatus::Open;
            view.created = data.to_string();
        }
        RecordKind::ActivationQueued => {
            if view.status == SessionStatus::Passivated {
                view.status = SessionStatus::Open;
            }
            if let Some(keyed) = Keyed::from_record(data) {
                view.activation_keys
                    .insert(keyed.key, (sequence, keyed.digest));
            }
        }
        RecordKind::ActivationStarted => {
            let activation = number(data, "activation")?;
            view.kv.insert(
                ACTIVATION_MARKER_KEY.to_owned(),
                json!({ "sequence": activation }),
            );
            view.marker = Some(activation);
        }
        RecordKind::ActivationFinished => {
            let outcome = data
                .get("outcome")
                .and_then(Value::as_str)
                .ok_or("`outcome` is not a string")?;
            let events_through = match data.get("events_through") {
                None | Some(Value::Null) => None,
                Some(_) => Some(number(data, "events_through")?),
            };
            if outcome == "completed" {
                view.kv.remove(ACTIVATION_MARKER_KEY);
                view.marker = None;
                if let Some(through) = events_through {
                    view.kv.insert(EVENTS_CURSOR_KEY.to_owned(), json!(through));
                    view.events_cursor = through;
                }
            }
        }
        RecordKind::TranscriptDelta => {
            let keep = number(data, "keep")?;
            let append: Vec<Message> = data
                .get("append")
                .ok_or_else(|| "`append` is missing".to_owned())
                .and_then(|append| {
                    // Read from the tree in place: no copy of the appended messages first.
                    Vec::<Message>::deserialize(append)
                        .map_err(|e| format!("`append` is not a list of messages: {e}"))
                })?;
            // A `keep` that does not fit in usize is certainly beyond the length: keep everything.
            let keep = usize::try_from(keep).unwrap_or(usize::MAX);
            apply_transcript_delta(view, sequence, keep, append);
        }
        RecordKind::KvSet => {
            let key = string(data, "key")?;
            let value = data.get("value").ok_or("`value` is missing")?;
            view.kv.insert(key.to_owned(), value.clone());
        }
        RecordKind::KvDelete => {
            let key = string(data, "key")?;
            view.kv.remove(key);
        }
        RecordKind::ModelCallStarted => {
            view.model_calls += 1;
            view.unfinished_effects.push(sequence);
        }
        RecordKind::ToolCallStarted | RecordKind::EnvironmentStarted => {
            view.unfinished_effects.push(sequence);
        }
        RecordKind::ModelCallFinished
        | RecordKind::ToolCallFinished
        | RecordKind::EnvironmentFinished => {
            let started = number(data, "started")?;
            let position = view
                .unfinished_effects
                .iter()
                .position(|&s| s == started)
                .ok_or_else(|| format!("record {started} is not an unfinished effect"))?;
            view.unfinished_effects.remove(position);
        }
        RecordKind::SessionPassivated => view.status = SessionStatus::Passivated,
        RecordKind::SessionClosed => view.status = SessionStatus::Closed,
        RecordKind::EventEmitted => {}
    }
    Ok(())
}

/// `data[field]` as a u64, or why not.
fn number(data: &Value, field: &str) -> Result<u64, String> {
    data.get(field)
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("`{field}` is not a non-negative integer"))
}

/// `data[field]` as a string, or why not.
fn string<'a>(data: &'a Value, field: &str) -> Result<&'a str, String> {
    data.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("`{field}` is not a string"))
}

/// What a `transcript_delta` record `sequence` does to `view`: keeps the first `keep` messages
/// (all of them when there are fewer) and appends `append`.
pub(crate) fn apply_transcript_delta(
    view: &mut SessionView,
    sequence: u64,
    keep: usize,
    append: impl IntoIterator<Item = Message>,
) {
    view.transcript.truncate(keep);
    view.transcript.extend(append);
    view.transcript_through = sequence;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::Role;

    /// Applies `records` in order to a fresh view, starting at sequence 1; panics on malformed data.
    fn project(records: &[(RecordKind, Value)]) -> SessionView {
        let mut view = SessionView::default();
        for (index, (kind, data)) in records.iter().enumerate() {
            let record = NewRecord {
                kind: *kind,
                data: data.clone(),
                origin: None,
            };
            apply(&mut view, index as u64 + 1, &record).unwrap();
        }
        view
    }

    fn created() -> (RecordKind, Value) {
        (RecordKind::SessionCreated, json!({"agentloop": "pi"}))
    }

    fn messages(texts: &[&str]) -> Vec<Message> {
        texts
            .iter()
            .map(|t| Message::text(Role::User, *t))
            .collect()
    }

    #[test]
    fn session_created_opens_and_keeps_its_data() {
        let view = project(&[created()]);
        assert_eq!(view.status, SessionStatus::Open);
        let created: Value = serde_json::from_str(&view.created).unwrap();
        assert_eq!(created, json!({"agentloop": "pi"}));
        assert_eq!(view.last_sequence, 1);
        assert_eq!(view.marker, None);
        assert_eq!(view.events_cursor, 0);
    }

    #[test]
    fn started_sets_the_marker_and_only_a_completed_finish_removes_it() {
        for outcome in ["failed", "cancelled"] {
            let view = project(&[
                created(),
                (RecordKind::ActivationQueued, json!({})),
                (RecordKind::ActivationStarted, json!({"activation": 2})),
                (
                    RecordKind::ActivationFinished,
                    json!({"activation": 2, "outcome": outcome, "code": "worker_lost", "events_through": 9}),
                ),
            ]);
            assert_eq!(view.marker, Some(2), "{outcome}");
            assert_eq!(view.kv[ACTIVATION_MARKER_KEY], json!({"sequence": 2}));
            assert_eq!(
                view.events_cursor, 0,
                "{outcome} must not advance the cursor"
            );
            assert!(!view.kv.contains_key(EVENTS_CURSOR_KEY));
        }

        let view = project(&[
            created(),
            (RecordKind::ActivationQueued, json!({})),
            (RecordKind::ActivationStarted, json!({"activation": 2})),
            (
                RecordKind::ActivationFinished,
                json!({"activation": 2, "outcome": "completed", "result": {}, "events_through": 7}),
            ),
        ]);
        assert_eq!(view.marker, None);
        assert!(!view.kv.contains_key(ACTIVATION_MARKER_KEY));
        assert_eq!(view.events_cursor, 7);
        assert_eq!(view.kv[EVENTS_CURSOR_KEY], json!(7));
    }

    #[test]
    fn a_completed_finish_without_events_through_keeps_the_cursor() {
        let view = project(&[
            created(),
            (RecordKind::ActivationStarted, json!({"activation": 2})),
            (
                RecordKind::ActivationFinished,
                json!({"activation": 2, "outcome": "completed", "events_through": 5}),
            ),
            (RecordKind::ActivationStarted, json!({"activation": 4})),
            (
                RecordKind::ActivationFinished,
                json!({"activation": 4, "outcome": "completed", "events_through": null}),
            ),
        ]);
        assert_eq!(view.marker, None);
        assert_eq!(view.events_cursor, 5);
    }

    #[test]
    fn transcript_deltas_keep_a_prefix_and_append() {
        let view = project(&[
            created(),
            (
                RecordKind::TranscriptDelta,
                json!({"keep": 0, "append": messages(&["a", "b", "c"])}),
            ),
            (
                RecordKind::TranscriptDelta,
                json!({"keep": 2, "append": messages(&["d"])}),
            ),
        ]);
        assert_eq!(view.transcript, messages(&["a", "b", "d"]));
        assert_eq!(view.transcript_through, 3);

        // A `keep` beyond the length keeps everything; `keep: 0` with nothing appended empties it.
        let view = project(&[
            created(),
            (
                RecordKind::TranscriptDelta,
                json!({"keep": 0, "append": messages(&["a"])}),
            ),
            (
                RecordKind::TranscriptDelta,
                json!({"keep": 99, "append": messages(&["b"])}),
            ),
        ]);
        assert_eq!(view.transcript, messages(&["a", "b"]));
        let view = project(&[
            created(),
            (
                RecordKind::TranscriptDelta,
                json!({"keep": 0, "append": messages(&["a"])}),
            ),
            (
                RecordKind::TranscriptDelta,
                json!({"keep": 0, "append": []}),
            ),
        ]);
        assert!(view.transcript.is_empty());
        assert_eq!(view.transcript_through, 3);
    }

    #[test]
    fn kv_set_stores_null_and_kv_delete_removes() {
        let view = project(&[
            created(),
            (RecordKind::KvSet, json!({"key": "plan", "value": "step 2"})),
            (RecordKind::KvSet, json!({"key": "empty", "value": null})),
            (RecordKind::KvSet, json!({"key": "gone", "value": 1})),
            (RecordKind::KvDelete, json!({"key": "gone"})),
            (RecordKind::KvDelete, json!({"key": "never-there"})),
        ]);
        assert_eq!(view.kv.get("plan"), Some(&json!("step 2")));
        assert_eq!(view.kv.get("empty"), Some(&Value::Null));
        assert_eq!(view.kv.get("gone"), None);
        assert_eq!(view.kv.len(), 2);
    }

    #[test]
    fn effects_are_unfinished_until_their_finished_record() {
        let view = project(&[
            created(),
            (RecordKind::ModelCallStarted, json!({})),
            (RecordKind::ToolCallStarted, json!({})),
            (RecordKind::EnvironmentStarted, json!({})),
            (RecordKind::ModelCallStarted, json!({})),
            (
                RecordKind::ToolCallFinished,
                json!({"started": 3, "outcome": "ok"}),
            ),
            (RecordKind::ModelCallFinished, json!({"started": 2})),
        ]);
        assert_eq!(view.model_calls, 2);
        assert_eq!(view.unfinished_effects, vec![4, 5]);
        let view = project(&[
            created(),
            (RecordKind::EnvironmentStarted, json!({})),
            (RecordKind::EnvironmentFinished, json!({"started": 2})),
        ]);
        assert!(view.unfinished_effects.is_empty());
        assert_eq!(view.model_calls, 0);
    }

    #[test]
    fn passivation_is_undone_by_the_next_queued_activation_but_closing_is_final() {
        let view = project(&[created(), (RecordKind::SessionPassivated, json!({}))]);
        assert_eq!(view.status, SessionStatus::Passivated);
        let view = project(&[
            created(),
            (RecordKind::SessionPassivated, json!({})),
            (RecordKind::ActivationQueued, json!({})),
        ]);
        assert_eq!(view.status, SessionStatus::Open);
        let view = project(&[
            created(),
            (RecordKind::SessionClosed, json!({})),
            (RecordKind::ActivationQueued, json!({})),
        ]);
        assert_eq!(view.status, SessionStatus::Closed);
    }

    #[test]
    fn malformed_data_changes_nothing_but_the_last_sequence() {
        let base = project(&[
            created(),
            (
                RecordKind::TranscriptDelta,
                json!({"keep": 0, "append": messages(&["a"])}),
            ),
            (RecordKind::ActivationStarted, json!({"activation": 3})),
            (RecordKind::ModelCallStarted, json!({})),
        ]);
        for (kind, data) in [
            (
                RecordKind::TranscriptDelta,
                json!({"keep": "x", "append": []}),
            ),
            (
                RecordKind::TranscriptDelta,
                json!({"keep": 0, "append": [1]}),
            ),
            (RecordKind::TranscriptDelta, json!({"keep": 0})),
            (RecordKind::TranscriptDelta, json!(null)),
            (RecordKind::ActivationStarted, json!({"activation": -1})),
            (RecordKind::ActivationFinished, json!({"outcome": 3})),
            (
                RecordKind::ActivationFinished,
                json!({"outcome": "completed", "events_through": "7"}),
            ),
            (RecordKind::KvSet, json!({"key": 1, "value": 1})),
            (RecordKind::KvSet, json!({"key": "k"})),
            (RecordKind::KvDelete, json!([])),
            (RecordKind::ModelCallFinished, json!({"started": 99})),
            (RecordKind::ToolCallFinished, json!("started")),
        ] {
            let mut view = base.clone();
            let record = NewRecord {
                kind,
                data: data.clone(),
                origin: None,
            };
            let error = apply(&mut view, 5, &record).unwrap_err();
            assert!(!error.is_empty());
            let mut expected = base.clone();
            expected.last_sequence = 5;
            assert_eq!(view, expected, "{kind} {data}");
        }
    }
}
