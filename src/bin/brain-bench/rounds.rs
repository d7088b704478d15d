//! The timed arms, round by round: each arm's trial, and the baseline trial its ratio is taken
//! against.
//!
//! This host's speed drifts by tens of per cent within a minute, so a ratio holds only when its
//! baseline ran moments before the arm. An arm whose target is stated against a baseline that is
//! not the arm just before it in the table (`cb-durable-64`, `turns-text` and `turns-tools` against
//! `jsonrpc-64`) therefore gets a trial of that baseline of its own, run right before it in every
//! round: its *paired* baseline. The baseline's own row keeps its scheduled trials.

use crate::machine::{TICKS_PER_SECOND, cpu_counters};
use crate::stats::Trial;
use crate::{Arm, Plan, Ratio, Setup};
use std::time::Instant;

/// What the rounds measured, by arm index, one entry a round.
pub(crate) struct Rounds {
    /// Each arm's trials; `None` where the trial failed.
    pub trials: Vec<Vec<Option<Trial>>>,
    /// The paired baseline's trials of arms that have one (see the module's docs); empty
    /// otherwise.
    pub paired: Vec<Vec<Option<Trial>>>,
    /// The arms (and paired baselines) that failed, with the reason.
    pub failures: Vec<(String, String)>,
}

impl Rounds {
    /// The trial that arm `index`'s ratio in round `r` takes for baseline `id`: its paired trial
    /// when it has one, else that round's trial of the baseline arm.
    pub(crate) fn baseline(&self, arms: &[Arm], index: usize, id: &str, r: usize) -> Option<Trial> {
        if paired_baseline(arms, index).is_some_and(|base| arms[base].id == id) {
            return self.paired[index].get(r)?.clone();
        }
        let base = arms.iter().position(|arm| arm.id == id)?;
        self.trials[base].get(r)?.clone()
    }
}

/// The index in `arms` of the baseline arm `index`'s target is stated against, when that baseline
/// is in `arms` but is not the arm just before it. Ratios without a target (printed as context)
/// take the round's trial of their baseline.
pub(crate) fn paired_baseline(arms: &[Arm], index: usize) -> Option<usize> {
    let base = match arms[index].ratio {
        Ratio::RateOver(base, Some(_)) | Ratio::P50Over(base, Some(_)) => base,
        _ => return None,
    };
    let position = arms.iter().position(|arm| arm.id == base)?;
    (index == 0 || position != index - 1).then_some(position)
}

/// How an arm's rate followed its baseline's (the trial each round's ratio was taken against:
/// the paired one, or the round's) from round to round (see [`host_speed`]).
#[derive(Debug, PartialEq)]
pub(crate) struct HostSpeed {
    /// The rounds whose baseline ran slower than the median round.
    pub slower: Half,
    /// The rounds whose baseline ran faster than the median round.
    pub faster: Half,
}

/// The mean rates of half of the rounds.
#[derive(Debug, PartialEq)]
pub(crate) struct Half {
    pub baseline: f64,
    pub rate: f64,
}

impl Half {
    /// The arm's rate over the baseline's, of the means.
    pub(crate) fn ratio(&self) -> f64 {
        self.rate / self.baseline
    }
}

/// Splits `pairs` (a round's baseline rate, the arm's rate) at the median of the
/// baseline: the slower half and the faster half of the rounds, the median round left out when
/// their number is odd. A ratio that cancels the host's speed comes out the same in both
/// halves; one whose arm speeds up less than its baseline when the host is fast comes out
/// lower in the faster half. `None` with fewer than 4 pairs, too few to halve.
pub(crate) fn host_speed(pairs: &[(f64, f64)]) -> Option<HostSpeed> {
    if pairs.len() < 4 {
        return None;
    }
    let mut sorted = pairs.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let half = sorted.len() / 2;
    let mean = |rounds: &[(f64, f64)]| Half {
        baseline: rounds.iter().map(|r| r.0).sum::<f64>() / rounds.len() as f64,
        rate: rounds.iter().map(|r| r.1).sum::<f64>() / rounds.len() as f64,
    };
    Some(HostSpeed {
        slower: mean(&sorted[..half]),
        faster: mean(&sorted[sorted.len() - half..]),
    })
}

/// Runs `plan.rounds` rounds of `arms`, in order, each paired baseline right before its arm.
pub(crate) fn run(arms: &[Arm], setup: &Setup, plan: &Plan) -> Rounds {
    let mut rounds = Rounds {
        trials: vec![Vec::new(); arms.len()],
        paired: vec![Vec::new(); arms.len()],
        failures: Vec::new(),
    };
    for r in 0..plan.rounds {
        let round = format!("round {}/{}", r + 1, plan.rounds);
        for (index, arm) in arms.iter().enumerate() {
            if let Some(base) = paired_baseline(arms, index).map(|base| &arms[base]) {
                let name = format!("{}-for-{}-r{r}", base.id, arm.id);
                let label = format!("{} (for {})", base.id, arm.id);
                let trial = timed(base, setup, plan, &name, &round, &label);
                rounds.paired[index].push(record(&mut rounds.failures, &label, trial));
            }
            let trial = timed(
                arm,
                setup,
                plan,
                &format!("{}-r{r}", arm.id),
                &round,
                arm.id,
            );
            rounds.trials[index].push(record(&mut rounds.failures, arm.id, trial));
        }
    }
    rounds
}

fn record(
    failures: &mut Vec<(String, String)>,
    label: &str,
    trial: Result<Trial, String>,
) -> Option<Trial> {
    trial
        .map_err(|error| failures.push((label.to_owned(), error)))
        .ok()
}

/// One trial of `arm` (`name` tells its data directory apart), with the CPUs it used, the share
/// other processes took meanwhile and its sleeps per operation; prints its progress line as
/// `label`.
fn timed(
    arm: &Arm,
    setup: &Setup,
    plan: &Plan,
    name: &str,
    round: &str,
    label: &str,
) -> Result<Trial, String> {
    let began = Instant::now();
    let counters = cpu_counters();
    let result = (arm.run)(setup, plan, name).map(|mut trial| {
        let after = cpu_counters();
        trial.wall_s = began.elapsed().as_secs_f64();
        trial.cpus_used =
            after.own.saturating_sub(counters.own) as f64 / TICKS_PER_SECOND / trial.wall_s;
        trial.other_share = after.other_share_since(&counters);
        let operations = trial.rate * trial.wall_s;
        if operations > 0.0 {
            trial.sleeps_per_op = after.sleeps.saturating_sub(counters.sleeps) as f64 / operations;
        }
        trial
    });
    match &result {
        Ok(trial) => eprintln!(
            "{round} {label:<18} {:>9.0} {}/s  p50 {:>9.1} µs  p99 {:>9.1} µs  ({:.1} s, {:.2} CPUs, {:.2} sleeps/op, others {:.0} %{})",
            trial.rate,
            arm.unit,
            trial.p50_us,
            trial.p99_us,
            trial.wall_s,
            trial.cpus_used,
            trial.sleeps_per_op,
            trial.other_share * 100.0,
            trial
                .records_per_flush
                .map(|r| format!(", {r:.1} records/flush"))
                .unwrap_or_default()
        ),
        Err(error) => eprintln!("{round} {label:<18} FAILED: {error}"),
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(ids: &[&str]) -> Vec<(&'static str, Option<&'static str>)> {
        let arms: Vec<Arm> = crate::arms()
            .into_iter()
            .filter(|arm| ids.contains(&arm.id))
            .collect();
        (0..arms.len())
            .map(|index| {
                let base = paired_baseline(&arms, index).map(|base| arms[base].id);
                (arms[index].id, base)
            })
            .collect()
    }

    /// The rounds are halved by the baseline's rate, not by their order, the median round is
    /// left out, and each half gives the mean of its rates.
    #[test]
    fn host_speed_halves_the_rounds_by_their_baselines_rate() {
        let pairs = [
            (90.0, 9.0),
            (60.0, 6.6),
            (100.0, 9.5),
            (75.0, 100.0), // the median round: in neither half
            (70.0, 7.0),
        ];
        let speed = host_speed(&pairs).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(speed.slower.baseline, 65.0) && close(speed.slower.rate, 6.8));
        assert!(close(speed.faster.baseline, 95.0) && close(speed.faster.rate, 9.25));
        assert!(close(speed.slower.ratio(), 6.8 / 65.0));
        assert!(speed.faster.ratio() < speed.slower.ratio());
        assert_eq!(host_speed(&pairs[..3]), None);
        let even = host_speed(&pairs[..4]).unwrap();
        assert_eq!(even.slower.baseline, 67.5);
        assert_eq!(even.faster.baseline, 95.0);
    }

    #[test]
    fn an_arm_gets_its_own_baseline_trial_unless_the_baseline_ran_just_before_it() {
        let all: Vec<&str> = crate::arms().iter().map(|arm| arm.id).collect();
        let paired: Vec<_> = pairs(&all)
            .into_iter()
            .filter_map(|(id, base)| base.map(|base| (id, base)))
            .collect();
        assert_eq!(
            paired,
            [
                ("cb-durable-64", "jsonrpc-64"),
                ("turns-text", "jsonrpc-64"),
                ("turns-tools", "jsonrpc-64"),
            ]
        );
        // With `--only`, a baseline that now runs just before its arm is not run twice, and an
        // arm whose baseline is left out has none.
        assert_eq!(
            pairs(&["jsonrpc-64", "turns-text", "turns-tools"]),
            [
                ("jsonrpc-64", None),
                ("turns-text", None),
                ("turns-tools", Some("jsonrpc-64")),
            ]
        );
        assert_eq!(pairs(&["turns-text"]), [("turns-text", None)]);
    }
}
