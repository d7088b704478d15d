//! Counters and histograms, rendered as Prometheus text.
//!
//! The dispatcher and the executor threads update them; `/metrics` renders them. Everything is an
//! atomic or sits behind a small leaf lock held only to bump a counter or copy it out.

use crate::status::{PoolStatus, WorkerState};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Bucket upper bounds, in seconds.
const BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, value: Duration) {
        let seconds = value.as_secs_f64();
        for (bound, bucket) in BUCKETS.iter().zip(&self.buckets) {
            if seconds <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(value.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, bucket) in BUCKETS.iter().zip(&self.buckets) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// A counter with two labels, behind a leaf lock. The counts are nested by label so that an
/// event seen before is found by reference: counting it allocates nothing (the dispatcher counts
/// every callback).
#[derive(Debug, Default)]
struct Labeled(Mutex<BTreeMap<String, BTreeMap<String, u64>>>);

impl Labeled {
    fn add(&self, first: &str, second: &str) {
        let mut counts = self.0.lock();
        if let Some(count) = counts.get_mut(first).and_then(|by| by.get_mut(second)) {
            *count += 1;
            return;
        }
        counts
            .entry(first.to_owned())
            .or_default()
            .insert(second.to_owned(), 1);
    }

    /// Renders the counts, the labels named `names`, in the order of their values.
    fn render(&self, out: &mut String, name: &str, help: &str, names: [&str; 2]) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        let [first_name, second_name] = names;
        for (first, by) in self.0.lock().iter() {
            for (second, value) in by {
                let _ = writeln!(
                    out,
                    "{name}{{{first_name}=\"{}\",{second_name}=\"{}\"}} {value}",
                    escape(first),
                    escape(second)
                );
            }
        }
    }
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Brain's metrics.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    activations: Labeled,
    callbacks: Labeled,
    unknown_outcomes: AtomicU64,
    pub(crate) schedule_to_start: Histogram,
    pub(crate) activation_latency: Histogram,
}

/// What the renderer reads from elsewhere at render time.
pub(crate) struct Gauges<'a> {
    pub(crate) status: &'a PoolStatus,
    /// Per slot: (registration, slot, waiting, running).
    pub(crate) queues: Vec<(String, u32, usize, usize)>,
    /// Journal flushes, records written and sessions loaded, when the journal counts them.
    pub(crate) journal: Option<(u64, u64, usize)>,
}

impl Metrics {
    /// An activation ended with this outcome (and failure code).
    pub(crate) fn activation(&self, outcome: &str, code: Option<&str>) {
        self.activations.add(outcome, code.unwrap_or(""));
    }

    /// A callback was answered with this code (`ok` for success).
    pub(crate) fn callback(&self, method: &str, code: &str) {
        self.callbacks.add(method, code);
    }

    /// An effect's outcome could not be known.
    pub(crate) fn unknown_outcome(&self) {
        self.unknown_outcomes.fetch_add(1, Ordering::Relaxed);
    }

    /// Prometheus text format.
    pub(crate) fn render(&self, gauges: &Gauges<'_>) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP brain_ready Whether Brain is ready.\n# TYPE brain_ready gauge\nbrain_ready {}",
            u8::from(gauges.status.ready())
        );
        let _ = writeln!(
            out,
            "# HELP brain_workers Worker slots by registration and state.\n# TYPE brain_workers gauge"
        );
        let states = [
            (WorkerState::Starting, "starting"),
            (WorkerState::Healthy, "healthy"),
            (WorkerState::Failed, "failed"),
            (WorkerState::Quarantined, "quarantined"),
            (WorkerState::Stopping, "stopping"),
            (WorkerState::Stopped, "stopped"),
        ];
        for registration in &gauges.status.registrations {
            for (state, name) in states {
                let count = registration
                    .workers
                    .iter()
                    .filter(|w| w.state == state)
                    .count();
                let _ = writeln!(
                    out,
                    "brain_workers{{registration=\"{}\",state=\"{name}\"}} {count}",
                    escape(&registration.name)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP brain_worker_restarts_total Respawns per worker slot.\n# TYPE brain_worker_restarts_total counter"
        );
        for registration in &gauges.status.registrations {
            for worker in &registration.workers {
                let _ = writeln!(
                    out,
                    "brain_worker_restarts_total{{registration=\"{}\",worker=\"{}\"}} {}",
                    escape(&registration.name),
                    worker.slot,
                    worker.restarts
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP brain_queue_depth Activations waiting for capacity per worker slot.\n# TYPE brain_queue_depth gauge"
        );
        for (registration, slot, waiting, _) in &gauges.queues {
            let _ = writeln!(
                out,
                "brain_queue_depth{{registration=\"{}\",worker=\"{slot}\"}} {waiting}",
                escape(registration)
            );
        }
        let _ = writeln!(
            out,
            "# HELP brain_slots_in_use Running activations per worker slot.\n# TYPE brain_slots_in_use gauge"
        );
        for (registration, slot, _, running) in &gauges.queues {
            let _ = writeln!(
                out,
                "brain_slots_in_use{{registration=\"{}\",worker=\"{slot}\"}} {running}",
                escape(registration)
            );
        }
        self.activations.render(
            &mut out,
            "brain_activations_total",
            "Activations ended, by outcome and failure code.",
            ["outcome", "code"],
        );
        self.callbacks.render(
            &mut out,
            "brain_callbacks_total",
            "Callbacks answered, by method and code (ok for success).",
            ["method", "code"],
        );
        let _ = writeln!(
            out,
            "# HELP brain_unknown_outcomes_total Effects whose outcome could not be known.\n# TYPE brain_unknown_outcomes_total counter\nbrain_unknown_outcomes_total {}",
            self.unknown_outcomes.load(Ordering::Relaxed)
        );
        self.schedule_to_start.render(
            &mut out,
            "brain_schedule_to_start_seconds",
            "From admission to run sent.",
        );
        self.activation_latency.render(
            &mut out,
            "brain_activation_seconds",
            "From admission to the recorded outcome.",
        );
        if let Some((flushes, records, loaded)) = gauges.journal {
            let _ = writeln!(
                out,
                "# HELP brain_journal_flushes_total Journal fdatasyncs.\n# TYPE brain_journal_flushes_total counter\nbrain_journal_flushes_total {flushes}"
            );
            let _ = writeln!(
                out,
                "# HELP brain_journal_records_total Journal records made durable.\n# TYPE brain_journal_records_total counter\nbrain_journal_records_total {records}"
            );
            let _ = writeln!(
                out,
                "# HELP brain_journal_loaded_sessions Sessions whose projections the journal holds in memory.\n# TYPE brain_journal_loaded_sessions gauge\nbrain_journal_loaded_sessions {loaded}"
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_cumulative_buckets() {
        let metrics = Metrics::default();
        metrics.activation("completed", None);
        metrics.activation("failed", Some("worker_lost"));
        metrics.callback("kv.get", "ok");
        metrics.callback("kv.get", "ok");
        metrics.callback("kv.get", "not_found");
        metrics.schedule_to_start.observe(Duration::from_millis(3));
        metrics.schedule_to_start.observe(Duration::from_secs(2));
        let text = metrics.render(&Gauges {
            status: &PoolStatus::default(),
            queues: vec![("pi".into(), 0, 2, 1)],
            journal: Some((3, 10, 2)),
        });
        assert!(
            text.contains("brain_activations_total{outcome=\"failed\",code=\"worker_lost\"} 1")
        );
        assert!(text.contains("brain_callbacks_total{method=\"kv.get\",code=\"ok\"} 2"));
        assert!(text.contains("brain_callbacks_total{method=\"kv.get\",code=\"not_found\"} 1"));
        assert!(text.contains("brain_schedule_to_start_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("brain_schedule_to_start_seconds_bucket{le=\"2.5\"} 2"));
        assert!(text.contains("brain_schedule_to_start_seconds_count 2"));
        assert!(text.contains("brain_queue_depth{registration=\"pi\",worker=\"0\"} 2"));
        assert!(text.contains("brain_journal_flushes_total 3"));
        assert!(text.contains("brain_journal_loaded_sessions 2"));
    }
}
