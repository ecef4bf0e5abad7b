//! The chaos schedule: a pure function of the seed and the job's size, so one seed gives one
//! schedule, printed before the run (and alone with `--chaos-plan`) and replayable with the
//! same `--chaos` value.
//!
//! Each strike comes its gap (drawn from `--chaos-interval`) after the gang recovered from the
//! strike before (the first one: after the faults' clock starts, training under way; see
//! [`super::runner`]), so each strike's cost is measured alone; it is of a kind drawn from
//! `--chaos-kinds`, at a target drawn from the job: any node (node 0, the store's host,
//! included), or any global rank. The faults' own times are set when they are injected.

use std::fmt;
use std::time::Duration;

use super::rng::SplitMix64;
use super::{Kind, Settings};
use crate::cmd::dry_run::fault::Fault;
use crate::cmd::dry_run::kinds::Target;

/// One strike of the schedule: one fault, or two at once (`two-pods`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Strike {
    /// Its place in the schedule, from 1.
    pub number: usize,
    pub kind: Kind,
    /// How long after the previous strike's recovery (the first: after training is under way).
    pub gap: Duration,
    /// The faults it injects, at the same time (their `at`: from the faults' clock, set when
    /// injected; zero in the plan).
    pub faults: Vec<Fault>,
}

impl Strike {
    /// What it hits: `node 2`, `nodes 0 and 2`, `rank 3`.
    pub fn target(&self) -> String {
        let what = self.kind.target().noun();
        match self.faults.as_slice() {
            [one] => format!("{what} {}", one.target),
            [a, b] => format!("{what}s {} and {}", a.target, b.target),
            _ => String::new(),
        }
    }
}

impl fmt::Display for Strike {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let specs: Vec<String> = self
            .faults
            .iter()
            .map(|f| format!("{}:{}", f.kind.name(), f.target))
            .collect();
        write!(
            f,
            "#{} +{:.1} s: {} ({}): {}",
            self.number,
            self.gap.as_secs_f64(),
            self.kind.name(),
            self.kind.meaning(),
            specs.join(" + ")
        )
    }
}

/// The schedule of `settings` for a job of `nnodes` nodes and `world` ranks.
pub fn plan(settings: &Settings, nnodes: u32, world: u32) -> Vec<Strike> {
    let mut rng = SplitMix64::new(settings.seed);
    let (lo, hi) = settings.interval;
    let lo_ms = u64::try_from(lo.as_millis()).unwrap_or(u64::MAX);
    let hi_ms = u64::try_from(hi.as_millis()).unwrap_or(u64::MAX);
    let kinds: Vec<Kind> = settings
        .kinds
        .iter()
        .copied()
        .filter(|k| *k != Kind::TwoPods || nnodes >= 2)
        .collect();
    let mut strikes = Vec::new();
    if kinds.is_empty() {
        return strikes;
    }
    for number in 1..=settings.count as usize {
        let gap = Duration::from_millis(rng.millis_between(lo_ms, hi_ms));
        let at = Duration::ZERO;
        let kind = kinds[usize::try_from(rng.below(kinds.len() as u64)).unwrap_or(0)];
        let pick =
            |rng: &mut SplitMix64, n: u32| u32::try_from(rng.below(u64::from(n))).unwrap_or(0);
        let one = |kind: Kind, target: u32| Fault { kind, target, at };
        let faults = match kind {
            Kind::TwoPods => {
                let a = pick(&mut rng, nnodes);
                let b = (a + 1 + pick(&mut rng, nnodes - 1)) % nnodes;
                vec![one(Kind::Kill, a), one(Kind::Kill, b)]
            }
            single => {
                let of = match single.target() {
                    Target::Rank => world,
                    Target::Node => nnodes,
                };
                vec![one(single, pick(&mut rng, of))]
            }
        };
        strikes.push(Strike {
            number,
            kind,
            gap,
            faults,
        });
    }
    strikes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(seed: u64, count: u32, kinds: &[Kind]) -> Settings {
        Settings {
            seed,
            count,
            kinds: kinds.to_vec(),
            interval: (Duration::from_secs(10), Duration::from_secs(20)),
            ..Settings::default()
        }
    }

    #[test]
    fn one_seed_gives_one_schedule_and_another_seed_another() {
        let s = settings(42, 20, Kind::ALL);
        let a = plan(&s, 3, 6);
        assert_eq!(a, plan(&s, 3, 6));
        assert_eq!(a.len(), 20);
        assert_ne!(a, plan(&settings(43, 20, Kind::ALL), 3, 6));
        // The rendering is stable too: a printed schedule names its faults.
        assert!(a[0].to_string().starts_with("#1 +1"), "{}", a[0]);
    }

    #[test]
    fn strikes_are_spaced_by_the_interval_and_hit_real_targets() {
        let s = settings(7, 200, Kind::ALL);
        let strikes = plan(&s, 3, 6);
        let mut seen = std::collections::HashSet::new();
        for strike in &strikes {
            assert!(strike.gap >= Duration::from_secs(10) && strike.gap <= Duration::from_secs(20));
            seen.insert(strike.kind);
            for f in &strike.faults {
                assert!(
                    crate::cmd::dry_run::fault::spec::check(f, 3, 6).is_ok(),
                    "{f}"
                );
            }
            if strike.kind == Kind::TwoPods {
                assert_ne!(strike.faults[0].target, strike.faults[1].target);
            }
        }
        // Every kind comes up in a long schedule, and node 0 is a target like any other.
        assert_eq!(seen.len(), Kind::ALL.len());
        assert!(strikes
            .iter()
            .any(|s| s.kind == Kind::Kill && s.faults[0].target == 0));
    }

    #[test]
    fn a_strike_prints_its_gap_kind_and_targets() {
        let two = Strike {
            number: 2,
            kind: Kind::TwoPods,
            gap: Duration::from_millis(12_500),
            faults: vec![
                Fault {
                    kind: Kind::Kill,
                    target: 2,
                    at: Duration::ZERO,
                },
                Fault {
                    kind: Kind::Kill,
                    target: 0,
                    at: Duration::ZERO,
                },
            ],
        };
        assert_eq!(
            two.to_string(),
            "#2 +12.5 s: two-pods (two pods lost at once, replaced): kill:2 + kill:0"
        );
        assert_eq!(two.target(), "nodes 2 and 0");
    }

    #[test]
    fn only_the_chosen_kinds_and_no_two_pods_on_one_node() {
        let strikes = plan(&settings(1, 30, &[Kind::Term, Kind::TwoPods]), 1, 2);
        assert!(strikes.iter().all(|s| s.kind == Kind::Term));
        assert!(plan(&settings(1, 3, &[Kind::TwoPods]), 1, 2).is_empty());
        let two = plan(&settings(1, 3, &[Kind::TwoPods]), 2, 4);
        assert_eq!(two[0].target(), {
            let t = &two[0].faults;
            format!("nodes {} and {}", t[0].target, t[1].target)
        });
    }
}
