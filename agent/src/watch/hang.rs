//! The hang decision: a pure function of what the ranks reported and `now`.
//!
//! A rank is watched from its first step report (with `auto`, from its [`AUTO_MIN_STEPS`]th):
//! a rank whose last progress — a step report, or a section opening or closing — is older than
//! the limit is hung. Inside a section (`with ckpt.section("eval"):`) the section's own limit
//! (`--section-timeout`) replaces the step limit, counted from the section's start. A rank that
//! exited (an early finisher) or never reported a step is never hung.
//!
//! The second question — which rank is the cause, when every rank of a synchronous job stops at
//! once — is [`pick_culprit`]'s: a rank waiting inside `torch.distributed` waits for someone else.

use std::time::Duration;

use tokio::time::Instant;

/// Default `--startup-timeout`: 5 minutes, a sixth of torch's 30-minute default store and
/// process-group timeout. Process groups of thousands of ranks form within a minute or two;
/// a rank stuck longer than this is stuck.
pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(300);

/// Where a rank is stuck before its first step (the startup watch, [`super::startup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Inside `init_process_group`, or (for the culprit) not yet in it while peers wait there.
    Init,
    /// Its group formed, no step reported while its peers step.
    FirstStep,
}

impl Phase {
    pub fn describe(self) -> &'static str {
        match self {
            Phase::Init => "has not formed its process group (init_process_group)",
            Phase::FirstStep => "reported no first step while its peers step",
        }
    }

    /// The place a [`crate::watch::Hang`] names (its `section`).
    pub fn place(self) -> &'static str {
        match self {
            Phase::Init => "init_process_group",
            Phase::FirstStep => "before its first step",
        }
    }
}

/// Steps a rank reports before `auto` watches it: the first steps (compilation, warm-up, the
/// first data loader fill) say nothing about the period.
pub const AUTO_MIN_STEPS: u64 = 5;
/// `auto`'s floor: never less than this without a step.
pub const AUTO_FLOOR: Duration = Duration::from_secs(600);
/// `auto`'s multiple of the slowest step period seen.
pub const AUTO_FACTOR: u32 = 20;
/// Default `--section-timeout`.
pub const DEFAULT_SECTION_TIMEOUT: Duration = Duration::from_secs(3600);

/// `--hang-timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HangTimeout {
    /// `0`: no hang detection.
    Off,
    /// `auto`: max([`AUTO_FLOOR`], [`AUTO_FACTOR`] × the slowest step period seen), once a rank
    /// has reported [`AUTO_MIN_STEPS`] steps.
    #[default]
    Auto,
    /// A fixed limit, from a rank's first step report.
    Fixed(Duration),
}

impl HangTimeout {
    /// Parses `SECS|auto|0`.
    pub fn parse(text: &str) -> Result<HangTimeout, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("auto") {
            return Ok(HangTimeout::Auto);
        }
        match rendezvous::seconds::parse(text) {
            Ok(Duration::ZERO) => Ok(HangTimeout::Off),
            Ok(limit) => Ok(HangTimeout::Fixed(limit)),
            Err(e) => Err(format!("{e}; or `auto`, or 0 for off")),
        }
    }
}

/// The longest interval between two `alive` messages of muster's zero-code reporter
/// (`python/muster_launcher/autoreport.py`), which says one when its rank's stack moved since
/// the last: several chances within any limit, so that one rank briefly waiting at every look is not
/// taken for a stuck one.
pub const MAX_LIVENESS_INTERVAL: Duration = Duration::from_secs(1);
/// The shortest: the reporter samples the stack every 100 ms.
pub const MIN_LIVENESS_INTERVAL: Duration = Duration::from_millis(200);
/// Looks at the stack per limit, at least (a fixed limit of a few seconds).
const LIVENESS_LOOKS_PER_LIMIT: u32 = 5;

/// How often zero-code reporters say `alive` under `timeout`: a fifth of a fixed limit, between
/// [`MIN_LIVENESS_INTERVAL`] and [`MAX_LIVENESS_INTERVAL`]; `None` with the watch off (no one
/// reads it).
pub fn liveness_interval(timeout: HangTimeout) -> Option<Duration> {
    match timeout {
        HangTimeout::Off => None,
        HangTimeout::Auto => Some(MAX_LIVENESS_INTERVAL),
        HangTimeout::Fixed(limit) => Some(
            (limit / LIVENESS_LOOKS_PER_LIMIT).clamp(MIN_LIVENESS_INTERVAL, MAX_LIVENESS_INTERVAL),
        ),
    }
}

/// The two limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub timeout: HangTimeout,
    pub section_timeout: Duration,
    /// `--startup-timeout`: `None` is off ([`crate::watch::startup`]).
    pub startup_timeout: Option<Duration>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            timeout: HangTimeout::Auto,
            section_timeout: DEFAULT_SECTION_TIMEOUT,
            startup_timeout: Some(DEFAULT_STARTUP_TIMEOUT),
        }
    }
}

/// A section a rank declared open (`with ckpt.section(name):`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    pub name: String,
    pub since: Instant,
}

/// What the agent knows of one local rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankView {
    pub local_rank: u32,
    pub rank: u32,
    /// The last step reported.
    pub step: Option<u64>,
    /// How many step reports arrived (distinct steps).
    pub steps_seen: u64,
    /// The last step report, or section change.
    pub last_progress: Option<Instant>,
    /// The slowest (smoothed) step period seen so far.
    pub slowest_period: Option<Duration>,
    pub section: Option<Section>,
    /// The rank's process is gone (it exited: an early finisher is not hung).
    pub exited: bool,
    /// When it entered `torch.distributed.init_process_group`, and returned from it (the
    /// zero-code reporter's `init` and `initdone`: [`crate::watch::startup`]).
    pub init_entered: Option<Instant>,
    pub init_returned: Option<Instant>,
    /// When its first step report arrived.
    pub first_step: Option<Instant>,
    /// When its last step report arrived (its `last_progress` also moves with liveness).
    pub last_step: Option<Instant>,
}

impl RankView {
    /// Since when the rank has made no progress: its open section's start, else its last
    /// report; `None` before it reported anything.
    fn idle_since(&self) -> Option<Instant> {
        match &self.section {
            Some(section) => Some(section.since),
            None => self.last_progress,
        }
    }

    fn stall(&self, stalled: Duration, limit: Duration) -> Stall {
        Stall {
            local_rank: self.local_rank,
            rank: self.rank,
            last_step: self.step,
            stalled,
            limit,
            section: self.section.as_ref().map(|s| s.name.clone()),
            startup: None,
            working: false,
        }
    }
}

/// Why a rank counts as hung.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    pub local_rank: u32,
    pub rank: u32,
    pub last_step: Option<u64>,
    /// Time without progress (for a section: since it opened).
    pub stalled: Duration,
    /// The limit it passed.
    pub limit: Duration,
    /// The open section it is stuck in, if any.
    pub section: Option<String>,
    /// Stuck before its first step (`--startup-timeout`), and where.
    pub startup: Option<Phase>,
    /// It was not stalled but working (its stack moved, it ran forward passes) without a step
    /// while its peers waited for it: `stalled` counts from its last step.
    pub working: bool,
}

impl Stall {
    /// One line: "rank 3 (local rank 1) made no progress for 612.0 s (last step 15; limit 600 s)".
    pub fn describe(&self) -> String {
        let step = self
            .last_step
            .map_or_else(|| "none".to_owned(), |s| s.to_string());
        if let Some(phase) = self.startup {
            return format!(
                "rank {} (local rank {}) {} for {:.1} s (--startup-timeout {})",
                self.rank,
                self.local_rank,
                phase.describe(),
                self.stalled.as_secs_f64(),
                secs(self.limit)
            );
        }
        if self.working {
            return format!(
                "rank {} (local rank {}) worked outside torch.distributed without a step for {:.1} s while its peers waited for it (last step {step}; limit {})",
                self.rank,
                self.local_rank,
                self.stalled.as_secs_f64(),
                secs(self.limit)
            );
        }
        match &self.section {
            Some(name) => format!(
                "rank {} (local rank {}) has been in section {name:?} for {:.1} s (last step {step}; --section-timeout {})",
                self.rank,
                self.local_rank,
                self.stalled.as_secs_f64(),
                secs(self.limit)
            ),
            None => format!(
                "rank {} (local rank {}) made no progress for {:.1} s (last step {step}; limit {})",
                self.rank,
                self.local_rank,
                self.stalled.as_secs_f64(),
                secs(self.limit)
            ),
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// The step limit in force for `rank`: `None` while it is not watched.
pub fn step_limit(policy: &Policy, rank: &RankView, all: &[RankView]) -> Option<Duration> {
    match policy.timeout {
        HangTimeout::Off => None,
        HangTimeout::Fixed(limit) => (rank.steps_seen >= 1).then_some(limit),
        HangTimeout::Auto => {
            if rank.steps_seen < AUTO_MIN_STEPS {
                return None;
            }
            let slowest = all.iter().filter_map(|r| r.slowest_period).max();
            Some(slowest.map_or(AUTO_FLOOR, |p| (p * AUTO_FACTOR).max(AUTO_FLOOR)))
        }
    }
}

/// The limit and the time without progress that counts against it, for one rank; `None` when
/// the rank is not watched.
fn exposure(
    policy: &Policy,
    rank: &RankView,
    all: &[RankView],
    now: Instant,
) -> Option<(Duration, Duration)> {
    if rank.exited || policy.timeout == HangTimeout::Off {
        return None;
    }
    let limit = if rank.section.is_some() {
        policy.section_timeout
    } else {
        step_limit(policy, rank, all)?
    };
    Some((limit, now.saturating_duration_since(rank.idle_since()?)))
}

/// The hung rank that has gone longest without progress, if any rank passed its limit.
pub fn decide(policy: &Policy, ranks: &[RankView], now: Instant) -> Option<Stall> {
    ranks
        .iter()
        .filter_map(|r| {
            let (limit, stalled) = exposure(policy, r, ranks, now)?;
            (stalled > limit).then(|| r.stall(stalled, limit))
        })
        .max_by_key(|s| s.stalled)
}

/// When the next call of [`decide`] can change its answer: the earliest moment a watched rank
/// passes its limit (never later than `now + max_wait`, so new reports are looked at).
pub fn next_check(
    policy: &Policy,
    ranks: &[RankView],
    now: Instant,
    max_wait: Duration,
) -> Instant {
    ranks
        .iter()
        .filter_map(|r| {
            let (limit, stalled) = exposure(policy, r, ranks, now)?;
            Some(now + limit.saturating_sub(stalled))
        })
        .min()
        .map_or(now + max_wait, |at| at.min(now + max_wait))
        // A few milliseconds past the limit: `decide` wants "more than".
        + Duration::from_millis(5)
}

/// The ranks that stalled as well, at the moment a hang is known somewhere in the gang:
/// those without progress for at least half of `limit` (the detecting node's limit; clocks and
/// report latencies differ a little between nodes).
pub fn stalled_ranks(ranks: &[RankView], limit: Duration, now: Instant) -> Vec<Stall> {
    ranks
        .iter()
        .filter(|r| !r.exited)
        .filter_map(|r| {
            let stalled = now.saturating_duration_since(r.idle_since()?);
            (stalled >= limit / 2).then(|| r.stall(stalled, limit))
        })
        .collect()
}

/// The live ranks that are not stalled but made no step for at least half of `limit`: working
/// (their stacks move) without stepping. When the stalled ranks all wait in collectives, such a
/// rank outside `torch.distributed` is the one they wait for ([`pick_culprit`] over these).
pub fn working_ranks(ranks: &[RankView], limit: Duration, now: Instant) -> Vec<Stall> {
    ranks
        .iter()
        .filter(|r| !r.exited && r.section.is_none())
        .filter(|r| {
            r.idle_since()
                .is_none_or(|since| now.saturating_duration_since(since) < limit / 2)
        })
        .filter_map(|r| {
            let without_step = now.saturating_duration_since(r.last_step?);
            (without_step >= limit / 2).then(|| Stall {
                working: true,
                ..r.stall(without_step, limit)
            })
        })
        .collect()
}

/// Where a stalled rank's main thread is, from its stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// Inside a `torch.distributed` call: it waits for another rank.
    InCollective,
    /// Somewhere else: a data loader, a lock, the script's own code.
    Elsewhere,
    /// No stack could be read.
    Unknown,
}

/// The culprit among stalled ranks: the longest-stalled rank that is not waiting in a
/// collective (one whose stack is unknown only when no rank is known to be elsewhere). `None`
/// when every stalled rank waits in a collective: the cause is on another node.
pub fn pick_culprit(stalls: &[(Stall, Waiting)]) -> Option<&Stall> {
    let longest = |wanted: Waiting| {
        stalls
            .iter()
            .filter(|(_, w)| *w == wanted)
            .max_by_key(|(s, _)| s.stalled)
            .map(|(s, _)| s)
    };
    longest(Waiting::Elsewhere).or_else(|| longest(Waiting::Unknown))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(local_rank: u32, steps: u64, last: Instant, period_ms: u64) -> RankView {
        RankView {
            local_rank,
            rank: local_rank + 10,
            step: (steps > 0).then_some(steps),
            steps_seen: steps,
            last_progress: (steps > 0).then_some(last),
            slowest_period: (steps > 1).then(|| Duration::from_millis(period_ms)),
            section: None,
            exited: false,
            init_entered: None,
            init_returned: None,
            first_step: None,
            last_step: (steps > 0).then_some(last),
        }
    }

    fn fixed(secs: u64) -> Policy {
        Policy {
            timeout: HangTimeout::Fixed(Duration::from_secs(secs)),
            section_timeout: Duration::from_secs(100),
            startup_timeout: None,
        }
    }

    #[test]
    fn parses_the_flag() {
        assert_eq!(HangTimeout::parse("auto"), Ok(HangTimeout::Auto));
        assert_eq!(HangTimeout::parse(" AUTO "), Ok(HangTimeout::Auto));
        assert_eq!(HangTimeout::parse("0"), Ok(HangTimeout::Off));
        assert_eq!(
            HangTimeout::parse("2.5"),
            Ok(HangTimeout::Fixed(Duration::from_millis(2500)))
        );
        assert!(HangTimeout::parse("-1").is_err());
        assert!(HangTimeout::parse("soon").is_err());
    }

    #[test]
    fn the_liveness_interval_follows_the_limit() {
        assert_eq!(liveness_interval(HangTimeout::Off), None);
        assert_eq!(
            liveness_interval(HangTimeout::Auto),
            Some(MAX_LIVENESS_INTERVAL)
        );
        let fixed =
            |secs: f64| liveness_interval(HangTimeout::Fixed(Duration::from_secs_f64(secs)));
        assert_eq!(fixed(3.0), Some(Duration::from_millis(600)));
        assert_eq!(fixed(0.5), Some(MIN_LIVENESS_INTERVAL));
        assert_eq!(fixed(600.0), Some(MAX_LIVENESS_INTERVAL));
    }

    #[test]
    fn a_fixed_limit_names_the_rank_silent_longest() {
        let t0 = Instant::now();
        let ranks = [
            rank(0, 15, t0 + Duration::from_secs(2), 20),
            rank(1, 15, t0, 20),
            rank(2, 16, t0 + Duration::from_secs(9), 20),
        ];
        let policy = fixed(5);
        assert_eq!(decide(&policy, &ranks, t0 + Duration::from_secs(5)), None);
        let stall = decide(&policy, &ranks, t0 + Duration::from_secs(8)).unwrap();
        assert_eq!((stall.local_rank, stall.rank), (1, 11));
        assert_eq!(stall.last_step, Some(15));
        assert_eq!(stall.stalled, Duration::from_secs(8));
        assert_eq!(stall.limit, Duration::from_secs(5));
        assert!(
            stall.describe().starts_with(
                "rank 11 (local rank 1) made no progress for 8.0 s (last step 15; limit 5 s)"
            ),
            "{}",
            stall.describe()
        );
    }

    #[test]
    fn ranks_that_never_reported_or_exited_are_not_hung() {
        let t0 = Instant::now();
        let mut early = rank(1, 3, t0, 20);
        early.exited = true;
        let ranks = [rank(0, 0, t0, 0), early];
        assert_eq!(
            decide(&fixed(1), &ranks, t0 + Duration::from_secs(60)),
            None
        );
        let off = Policy {
            timeout: HangTimeout::Off,
            ..fixed(1)
        };
        let ranks = [rank(0, 9, t0, 20)];
        assert_eq!(decide(&off, &ranks, t0 + Duration::from_secs(3600)), None);
    }

    #[test]
    fn auto_waits_for_a_few_steps_then_takes_twenty_slowest_periods_with_a_floor() {
        let t0 = Instant::now();
        let policy = Policy::default();
        let few = [rank(0, AUTO_MIN_STEPS - 1, t0, 20)];
        assert_eq!(step_limit(&policy, &few[0], &few), None);
        // Fast steps: the floor.
        let fast = [rank(0, AUTO_MIN_STEPS, t0, 20)];
        assert_eq!(step_limit(&policy, &fast[0], &fast), Some(AUTO_FLOOR));
        // Slow steps on another rank raise everyone's limit: 20 × 60 s.
        let slow = [rank(0, 50, t0, 20), rank(1, 50, t0, 60_000)];
        assert_eq!(
            step_limit(&policy, &slow[0], &slow),
            Some(Duration::from_secs(1200))
        );
        assert_eq!(decide(&policy, &slow, t0 + Duration::from_secs(1199)), None);
        assert!(decide(&policy, &slow, t0 + Duration::from_secs(1201)).is_some());
    }

    #[test]
    fn a_section_has_its_own_limit_from_its_start() {
        let t0 = Instant::now();
        let mut evaluating = rank(0, 20, t0, 20);
        evaluating.section = Some(Section {
            name: "eval".into(),
            since: t0 + Duration::from_secs(1),
        });
        let ranks = [evaluating];
        // Long past the 5 s step limit, well within the 100 s section limit.
        assert_eq!(
            decide(&fixed(5), &ranks, t0 + Duration::from_secs(60)),
            None
        );
        let stall = decide(&fixed(5), &ranks, t0 + Duration::from_secs(102)).unwrap();
        assert_eq!(stall.section.as_deref(), Some("eval"));
        assert_eq!(stall.limit, Duration::from_secs(100));
        assert!(stall.describe().contains("in section \"eval\" for 101.0 s"));
    }

    #[test]
    fn the_next_check_is_when_the_first_limit_passes() {
        let t0 = Instant::now();
        let ranks = [
            rank(0, 3, t0, 20),
            rank(1, 3, t0 + Duration::from_secs(2), 20),
        ];
        let at = next_check(
            &fixed(5),
            &ranks,
            t0 + Duration::from_secs(1),
            Duration::from_secs(60),
        );
        assert_eq!(at, t0 + Duration::from_secs(5) + Duration::from_millis(5));
        // Nothing watched: the longest wait.
        let at = next_check(&fixed(5), &[], t0, Duration::from_secs(1));
        assert_eq!(at, t0 + Duration::from_secs(1) + Duration::from_millis(5));
    }

    #[test]
    fn stalled_ranks_are_those_silent_half_the_limit() {
        let t0 = Instant::now();
        let ranks = [
            rank(0, 15, t0, 20),
            rank(1, 15, t0 + Duration::from_secs(4), 20),
            rank(2, 0, t0, 20),
        ];
        let now = t0 + Duration::from_secs(6);
        let stalled = stalled_ranks(&ranks, Duration::from_secs(10), now);
        let locals: Vec<u32> = stalled.iter().map(|s| s.local_rank).collect();
        assert_eq!(locals, [0]);
    }

    #[test]
    fn a_rank_that_works_without_stepping_while_its_peer_stalls_is_working_not_stalled() {
        let t0 = Instant::now();
        let limit = Duration::from_secs(10);
        // Both stepped last at t0; rank 1 then kept its stack moving (alive at 7 s).
        let mut ranks = [rank(0, 20, t0, 100), rank(1, 20, t0, 100)];
        ranks[1].last_progress = Some(t0 + Duration::from_secs(7));
        let now = t0 + Duration::from_secs(11);
        let stalled = stalled_ranks(&ranks, limit, now);
        assert_eq!(
            stalled.iter().map(|s| s.local_rank).collect::<Vec<_>>(),
            [0]
        );
        let working = working_ranks(&ranks, limit, now);
        assert_eq!(working.len(), 1);
        let w = &working[0];
        assert_eq!(
            (w.local_rank, w.stalled, w.working),
            (1, Duration::from_secs(11), true)
        );
        assert!(
            w.describe().starts_with(
                "rank 11 (local rank 1) worked outside torch.distributed without a step for 11.0 s while its peers waited"
            ),
            "{}",
            w.describe()
        );
        // A rank that stepped recently, or sits in a section of its own, is not named so.
        ranks[1].last_step = Some(t0 + Duration::from_secs(8));
        assert!(working_ranks(&ranks, limit, now).is_empty());
        ranks[1].last_step = Some(t0);
        ranks[1].section = Some(Section {
            name: "eval".into(),
            since: t0 + Duration::from_secs(1),
        });
        assert!(working_ranks(&ranks, limit, now).is_empty());
    }

    #[test]
    fn the_culprit_is_the_rank_not_waiting_in_a_collective() {
        let stall = |local_rank, secs| Stall {
            local_rank,
            rank: local_rank,
            last_step: Some(15),
            stalled: Duration::from_secs(secs),
            limit: Duration::from_secs(3),
            section: None,
            startup: None,
            working: false,
        };
        let all_waiting = [
            (stall(0, 9), Waiting::InCollective),
            (stall(1, 8), Waiting::InCollective),
        ];
        assert_eq!(pick_culprit(&all_waiting), None);
        let one_elsewhere = [
            (stall(0, 9), Waiting::InCollective),
            (stall(1, 8), Waiting::Elsewhere),
            (stall(2, 9), Waiting::Unknown),
        ];
        assert_eq!(pick_culprit(&one_elsewhere).map(|s| s.local_rank), Some(1));
        let unknown = [
            (stall(0, 9), Waiting::InCollective),
            (stall(2, 7), Waiting::Unknown),
        ];
        assert_eq!(pick_culprit(&unknown).map(|s| s.local_rank), Some(2));
    }
}
