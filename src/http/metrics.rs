//! `GET /metrics`: Brain's own series ([`Brain::metrics_text`](crate::Brain::metrics_text)) and
//! the HTTP server's, in Prometheus text format.

use super::response::Response;
use super::server::Shared;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The Prometheus text content type.
const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Responses sent, by status. A leaf lock held only to bump or copy.
#[derive(Debug, Default)]
pub(crate) struct HttpCounters {
    responses: Mutex<BTreeMap<u16, u64>>,
}

impl HttpCounters {
    pub(crate) fn responded(&self, status: u16) {
        *self.responses.lock().entry(status).or_insert(0) += 1;
    }
}

/// Renders every series.
pub(crate) fn render(shared: &Shared) -> Response {
    let mut text = shared.brain.metrics_text();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    let responses = shared.counters.responses.lock().clone();
    // Writing to a String cannot fail.
    let _ = writeln!(
        text,
        "# HELP brain_http_responses_total HTTP responses sent, by status.\n\
         # TYPE brain_http_responses_total counter"
    );
    for (status, count) in responses {
        let _ = writeln!(
            text,
            "brain_http_responses_total{{status=\"{status}\"}} {count}"
        );
    }
    for (name, help, limit) in [
        (
            "brain_http_connections",
            "Open HTTP connections, idle ones included.",
            &shared.connections,
        ),
        (
            "brain_http_long_waits",
            "Requests waiting for an activation's outcome.",
            &shared.long_waits,
        ),
        (
            "brain_http_sse_followers",
            "Open SSE streams.",
            &shared.followers,
        ),
    ] {
        let _ = writeln!(
            text,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}\n\
             # HELP {name}_limit The bound of {name}.\n# TYPE {name}_limit gauge\n{name}_limit {}",
            limit.in_use(),
            limit.max()
        );
    }
    Response::text(200, PROMETHEUS, text)
}
