//! Latency histograms and the figures of one trial.

use serde_json::{Value, json};
use std::time::{SystemTime, UNIX_EPOCH};

/// Values below this are counted exactly (one bucket per nanosecond).
const LINEAR: u64 = 128;
/// Sub-buckets per power of two above [`LINEAR`]: 64, a resolution of 1.6 %.
const SUB_BITS: u32 = 6;
const BUCKETS: usize = LINEAR as usize + (64 - 7) * (1 << SUB_BITS);

/// A log-linear histogram of nanosecond latencies: exact below 128 ns, within 1.6 % above.
/// Cheap to record into, mergeable, and small on the wire (sparse).
#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
        }
    }
}

fn bucket(value: u64) -> usize {
    if value < LINEAR {
        return value as usize;
    }
    let exponent = 63 - value.leading_zeros();
    let sub = (value >> (exponent - SUB_BITS)) & ((1 << SUB_BITS) - 1);
    LINEAR as usize + ((exponent - 7) as usize) * (1 << SUB_BITS) + sub as usize
}

/// The middle of a bucket's range.
fn bucket_value(index: usize) -> f64 {
    if index < LINEAR as usize {
        return index as f64;
    }
    let above = index - LINEAR as usize;
    let exponent = (above >> SUB_BITS) as u32 + 7;
    let sub = (above & ((1 << SUB_BITS) - 1)) as u64;
    let width = 1u64 << (exponent - SUB_BITS);
    let low = (1u64 << exponent) + sub * width;
    low as f64 + width as f64 / 2.0
}

impl Histogram {
    /// Counts one latency.
    pub fn record(&mut self, nanos: u64) {
        self.counts[bucket(nanos)] += 1;
        self.total += 1;
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine += theirs;
        }
        self.total += other.total;
    }

    /// How many latencies were counted.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The latency at quantile `q` (0..=1), in microseconds; 0 when empty.
    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (index, count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return bucket_value(index) / 1000.0;
            }
        }
        0.0
    }

    /// Sparse JSON: `[[bucket, count], …]`.
    pub fn to_json(&self) -> Value {
        let pairs: Vec<Value> = self
            .counts
            .iter()
            .enumerate()
            .filter(|(_, count)| **count > 0)
            .map(|(index, count)| json!([index, count]))
            .collect();
        Value::Array(pairs)
    }

    /// Reads [`Histogram::to_json`]'s form; malformed entries are skipped.
    pub fn from_json(value: &Value) -> Histogram {
        let mut histogram = Histogram::default();
        for pair in value.as_array().into_iter().flatten() {
            let index = pair.get(0).and_then(Value::as_u64).unwrap_or(u64::MAX) as usize;
            let count = pair.get(1).and_then(Value::as_u64).unwrap_or(0);
            if index < BUCKETS {
                histogram.counts[index] += count;
                histogram.total += count;
            }
        }
        histogram
    }
}

/// Nanoseconds since the Unix epoch: the clock shared by the bench and its child processes.
pub fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos() as u64)
        .unwrap_or(0)
}

/// What one trial of one arm measured.
#[derive(Clone, Debug, Default)]
pub struct Trial {
    /// Operations per second (calls, round trips, records, activations or turns).
    pub rate: f64,
    /// Median latency of one operation, µs.
    pub p50_us: f64,
    /// 99th percentile latency, µs.
    pub p99_us: f64,
    /// Operations counted.
    pub count: u64,
    /// Wall time of the whole trial (setup, window, drain, shutdown), s.
    pub wall_s: f64,
    /// CPU time of the bench process and its reaped children (the harness workers) during it,
    /// in CPUs: 2.0 means both CPUs of a 2-CPU machine were busy with the bench all along.
    pub cpus_used: f64,
    /// Share of the machine's CPU time used by anything else during it.
    pub other_share: f64,
    /// How often a thread of the bench process or of its reaped children blocked (voluntary
    /// context switches) during the trial, per operation, the operations estimated as the rate
    /// times the trial's wall time. Each is a wake-up later, which on a VM costs about as much
    /// as a small callback's own work (docs/BENCHMARKS.md): a count of hand-offs that moves
    /// far less with the host than the rates do.
    pub sleeps_per_op: f64,
    /// Brain's durable arms: the journal's records made durable per `fdatasync` over the whole
    /// trial (warm-up included), from Brain's metrics: how well group commit batched.
    pub records_per_flush: Option<f64>,
}

impl Trial {
    /// A trial from a histogram of latencies and a rate.
    pub fn from_histogram(histogram: &Histogram, rate: f64) -> Trial {
        Trial {
            rate,
            p50_us: histogram.quantile_us(0.5),
            p99_us: histogram.quantile_us(0.99),
            count: histogram.count(),
            ..Trial::default()
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "rate": round(self.rate, 1),
            "p50_us": round(self.p50_us, 2),
            "p99_us": round(self.p99_us, 2),
            "count": self.count,
            "wall_s": round(self.wall_s, 2),
            "cpus_used": round(self.cpus_used, 2),
            "other_share": round(self.other_share, 3),
            "sleeps_per_op": round(self.sleeps_per_op, 2),
            "records_per_flush": self.records_per_flush.map(|r| round(r, 1)),
        })
    }
}

/// The median of `values` (the mean of the middle two for an even count); 0 when empty.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return 0.0;
    }
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[middle]
    } else {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    }
}

/// `value` rounded to `digits` decimals, for JSON.
pub fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_trip_within_their_resolution() {
        for value in [0u64, 1, 127, 128, 129, 1000, 54_321, 1 << 40, u64::MAX / 3] {
            let middle = bucket_value(bucket(value));
            let error = (middle - value as f64).abs() / (value.max(1) as f64);
            assert!(error < 0.02, "{value}: {middle}");
        }
    }

    #[test]
    fn quantiles_merge_and_survive_json() {
        let mut a = Histogram::default();
        for v in 1..=100u64 {
            a.record(v * 1000);
        }
        let b = Histogram::from_json(&a.to_json());
        let mut c = a.clone();
        c.merge(&b);
        assert_eq!(c.count(), 200);
        assert!((c.quantile_us(0.5) - 50.0).abs() < 1.0);
        assert!((c.quantile_us(0.99) - 99.0).abs() < 2.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }
}
