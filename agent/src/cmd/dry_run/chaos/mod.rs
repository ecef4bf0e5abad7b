//! `muster dry-run --chaos SEED[:COUNT]`: a day of a cluster's faults, rehearsed in minutes on
//! the user's own script, with a report of what each fault cost.
//!
//! The parts, each with one job:
//! - [`rng`]: the seeded generator (SplitMix64), so one seed is one schedule everywhere.
//! - [`plan`]: the schedule, a pure function of the seed and the job's size.
//! - [`runner`]: hands each strike, once the gang recovered from the one before and its gap is
//!   over, to the dry run's fault rehearsal ([`crate::cmd::dry_run::fault`]), which injects it.
//! - [`steps`]: the ranks' step reports as each agent's metrics endpoint serves them
//!   (`muster_worker_last_step`), sampled with the workers.
//! - [`report`]: per strike, when it hit, how the gang reacted, the time to recovery and the
//!   steps lost; the totals, advice where a number is poor, and the verdict (a pure function of
//!   the timeline and the step samples).
//!
//! Pods that end are replaced as a Kubernetes Job with muster's documented `podFailurePolicy`
//! would (examples/kubernetes/README.md): a killed pod, a preempted one (200, 201) and the
//! followers of a lost store host (205) come back after `--replace-after`; a finished one (0)
//! does not, nor one that failed for a counted reason.

pub mod plan;
pub mod report;
pub mod rng;
pub mod runner;
pub mod steps;

use std::time::Duration;

use crate::exit_code;

/// The default number of strikes when `--chaos SEED` names none.
pub const DEFAULT_COUNT: u32 = 6;
/// Default `--chaos-interval`, the training between the gang's recovery from one strike and the
/// next strike: long enough for some steps (and the script's saves) to happen in between.
pub const DEFAULT_INTERVAL: (Duration, Duration) =
    (Duration::from_secs(20), Duration::from_secs(40));
/// Default `--chaos-recovery-bound`: the time from a strike to every rank reporting a step again
/// past which the strike counts as not recovered. Two minutes is several rendezvous rounds and
/// restarts of a small script on a laptop; a job whose recovery takes longer on one machine will
/// take longer still on a cluster.
pub const DEFAULT_RECOVERY_BOUND: Duration = Duration::from_secs(120);
/// `--replace-after` under chaos when none is given: a replacement pod is scheduled and started
/// after a few seconds on a warm cluster.
pub const DEFAULT_REPLACE_AFTER: Duration = Duration::from_secs(3);

/// The dry run's code when the job finished but a strike was not recovered within the bound. A
/// dry-run-only code (an agent never exits with it): kept apart from the agents' sequential
/// codes (200 up) so a future agent outcome does not collide with it, and from 1-127 and 128+N,
/// which a script or a signal produces.
pub const NOT_RECOVERED: u8 = exit_code::CHAOS_NOT_RECOVERED;
/// The dry run's code when the job finished before every strike was injected: a rehearsal that
/// rehearsed less than asked is not a pass.
pub const NOT_INJECTED: u8 = exit_code::CHAOS_NOT_INJECTED;

/// A kind of strike: a row of the one table of fault kinds.
pub use super::kinds::Kind;

/// The chaos flags as given (validated by [`Args::settings`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Args {
    pub chaos: Option<String>,
    pub kinds: Option<String>,
    pub interval: Option<String>,
    pub recovery_bound: Option<String>,
    pub plan_only: bool,
}

/// What chaos is to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub seed: u64,
    pub count: u32,
    pub kinds: Vec<Kind>,
    pub interval: (Duration, Duration),
    pub recovery_bound: Duration,
    /// `--chaos-plan`: print the schedule and exit.
    pub plan_only: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            seed: 0,
            count: DEFAULT_COUNT,
            kinds: Kind::ALL.to_vec(),
            interval: DEFAULT_INTERVAL,
            recovery_bound: DEFAULT_RECOVERY_BOUND,
            plan_only: false,
        }
    }
}

/// Why a chaos flag was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChaosError {
    #[error("--chaos `{0}`: expected SEED or SEED:COUNT (whole numbers, COUNT 1 or more), e.g. 42 or 42:8")]
    Seed(String),
    #[error(
        "--chaos-kinds `{given}`: expected a comma-separated list of {}",
        kind_list()
    )]
    Kinds { given: String },
    #[error("--chaos-interval `{0}`: expected MIN:MAX seconds, MIN above 0 and not above MAX, e.g. 20:40")]
    Interval(String),
    #[error("--chaos-recovery-bound `{0}`: expected a number of seconds above 0")]
    Bound(String),
    #[error("{0} without --chaos SEED: there is no schedule to shape")]
    WithoutChaos(&'static str),
    #[error(
        "--chaos with --fault: a rehearsal is either the faults you name or a seeded schedule"
    )]
    WithFaults,
}

/// `kill-rank, kill, term, stop-rank, two-pods`: every kind in the order chaos draws from.
pub fn kind_list() -> String {
    let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
    names.join(", ")
}

fn seconds(text: &str) -> Option<Duration> {
    crate::cmd::dry_run::fault::spec::parse_seconds(text).filter(|d| !d.is_zero())
}

impl Args {
    /// The validated settings; `None` without `--chaos`.
    pub fn settings(&self) -> Result<Option<Settings>, ChaosError> {
        let Some(chaos) = &self.chaos else {
            let stray = [
                (self.kinds.is_some(), "--chaos-kinds"),
                (self.interval.is_some(), "--chaos-interval"),
                (self.recovery_bound.is_some(), "--chaos-recovery-bound"),
                (self.plan_only, "--chaos-plan"),
            ];
            return match stray.iter().find(|(given, _)| *given) {
                Some((_, flag)) => Err(ChaosError::WithoutChaos(flag)),
                None => Ok(None),
            };
        };
        let bad_seed = || ChaosError::Seed(chaos.clone());
        let (seed, count) = match chaos.split_once(':') {
            Some((s, c)) => (s, Some(c)),
            None => (chaos.as_str(), None),
        };
        let seed: u64 = seed.trim().parse().map_err(|_| bad_seed())?;
        let count = match count {
            Some(c) => c
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|c| *c > 0)
                .ok_or_else(bad_seed)?,
            None => DEFAULT_COUNT,
        };
        let kinds = match &self.kinds {
            None => Kind::ALL.to_vec(),
            Some(text) => {
                let mut kinds = Vec::new();
                for name in text.split(',') {
                    let kind = Kind::parse(name).ok_or_else(|| ChaosError::Kinds {
                        given: text.clone(),
                    })?;
                    if !kinds.contains(&kind) {
                        kinds.push(kind);
                    }
                }
                kinds
            }
        };
        let interval = match &self.interval {
            None => DEFAULT_INTERVAL,
            Some(text) => text
                .split_once(':')
                .and_then(|(lo, hi)| Some((seconds(lo)?, seconds(hi)?)))
                .filter(|(lo, hi)| lo <= hi)
                .ok_or_else(|| ChaosError::Interval(text.clone()))?,
        };
        let recovery_bound = match &self.recovery_bound {
            None => DEFAULT_RECOVERY_BOUND,
            Some(text) => seconds(text).ok_or_else(|| ChaosError::Bound(text.clone()))?,
        };
        Ok(Some(Settings {
            seed,
            count,
            kinds,
            interval,
            recovery_bound,
            plan_only: self.plan_only,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(chaos: Option<&str>) -> Args {
        Args {
            chaos: chaos.map(str::to_owned),
            ..Args::default()
        }
    }

    #[test]
    fn the_seed_and_count_parse_with_defaults() {
        let s = args(Some("42")).settings().unwrap().unwrap();
        assert_eq!((s.seed, s.count), (42, DEFAULT_COUNT));
        assert_eq!(s.kinds, Kind::ALL);
        assert_eq!(s.interval, DEFAULT_INTERVAL);
        let s = args(Some("7:3")).settings().unwrap().unwrap();
        assert_eq!((s.seed, s.count), (7, 3));
        for bad in ["", "x", "7:0", "7:", "-1", "7:x"] {
            assert_eq!(
                args(Some(bad)).settings(),
                Err(ChaosError::Seed(bad.into())),
                "{bad}"
            );
        }
        assert_eq!(args(None).settings(), Ok(None));
    }

    #[test]
    fn kinds_interval_and_bound_parse_and_need_chaos() {
        let mut a = args(Some("1"));
        a.kinds = Some("term, kill-rank,term".into());
        a.interval = Some("2.5:4".into());
        a.recovery_bound = Some("30".into());
        let s = a.settings().unwrap().unwrap();
        assert_eq!(s.kinds, [Kind::Term, Kind::KillRank]);
        assert_eq!(
            s.interval,
            (Duration::from_millis(2500), Duration::from_secs(4))
        );
        assert_eq!(s.recovery_bound, Duration::from_secs(30));
        for (kinds, interval, bound) in [
            (Some("kill,nope"), None, None),
            (None, Some("4:2"), None),
            (None, Some("0:2"), None),
            (None, Some("3"), None),
            (None, None, Some("0")),
        ] {
            let a = Args {
                chaos: Some("1".into()),
                kinds: kinds.map(str::to_owned),
                interval: interval.map(str::to_owned),
                recovery_bound: bound.map(str::to_owned),
                plan_only: false,
            };
            assert!(a.settings().is_err(), "{a:?}");
        }
        let stray = Args {
            plan_only: true,
            ..Args::default()
        };
        assert_eq!(
            stray.settings().unwrap_err().to_string(),
            "--chaos-plan without --chaos SEED: there is no schedule to shape"
        );
    }
}
