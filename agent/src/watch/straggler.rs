//! The straggler decision: which rank holds a synchronous gang back, as pure functions of what
//! the agents measured.
//!
//! # What tells a slow rank from a waiting one
//! In synchronous data-parallel training every rank's step period is the same: each waits at the
//! all-reduce for the slowest. Step times alone therefore name nobody. CPU time does: the slow
//! rank computes for most of the period, the others compute less and sit off-CPU, blocked in the
//! collective (gloo's and NCCL's waits block the calling thread). So for every rank and interval
//! the agent takes the CPU time of the rank's *main thread* (`/proc/<pid>/task/<pid>/schedstat`,
//! the scheduler's nanoseconds) divided by the steps it completed: its *compute per step*.
//!
//! Only the main thread, not the process: torch's intra-op threads (OpenMP, one per core unless
//! `OMP_NUM_THREADS` says otherwise, and with one rank per node neither muster nor torchrun sets
//! it) spin-wait for their next parallel region while the main thread blocks in the collective,
//! so a waiting rank's process keeps burning CPU and the process's CPU time blurs the very wait
//! that tells it from the slow rank. The main thread takes part in every parallel region and
//! blocks in the collective, whatever the thread count.
//!
//! Every node publishes its ranks' figures to the attempt's store and reads the others'
//! ([`encode`], [`decode`]): each rank is compared with the median of the whole gang, and its
//! *slowness ratio* (1.0 = typical) is what [`Tracker::judge`] decides on.
//!
//! # No false findings
//! - Warm-up: a rank's first [`WARMUP_STEPS`] steps (compilation, the first data loader fill,
//!   allocator growth) are not measured.
//! - A comparison covers [`WINDOW_STEPS`] steps: intervals with fewer are added up (at most
//!   [`MAX_WINDOW`]; past that the watch says it cannot compare), and each comparison starts from
//!   new steps, so that a few steps the scheduler ruined count once.
//! - [`MIN_RANKS`] ranks with figures in the gang: with two ranks the median is the mean of the
//!   suspect and its peer.
//! - Threshold with hysteresis: a rank is found after [`FIND_AFTER`] consecutive comparisons at
//!   or above the threshold; a finding clears after [`CLEAR_AFTER`] consecutive comparisons below
//!   [`Settings::clear_ratio`] (halfway between 1 and the threshold), so a rank at the edge does
//!   not flap.
//! - Unsure ([`Unsure`]): too few steps, or main threads that use no CPU (the script steps from
//!   another thread): nothing is judged, and the watch says why.
//! - `exclude`: a finding that lasted [`EXCLUDE_AFTER`] comparisons makes the node leave.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// `--straggler-threshold`'s default: a rank computing 1.5x the gang median per step is found.
/// Healthy ranks of a 3-node CPU job on a loaded 2-CPU machine stay within 0.8–1.2x per interval
/// (measured: `scripts/bench.d/47-stragglers`); a real straggler (a throttled GPU, a degraded
/// link, a starved rank) is typically 2x or more.
pub const DEFAULT_THRESHOLD: f64 = 1.5;
/// `--straggler-interval`'s default: long enough that one interval holds many steps of a real
/// job (so the figures are averages, not single steps), short enough that a finding comes
/// within two minutes ([`FIND_AFTER`] intervals).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
/// Consecutive intervals at or above the threshold before a rank is named.
pub const FIND_AFTER: u32 = 3;
/// Consecutive intervals below the clear ratio before a finding clears.
pub const CLEAR_AFTER: u32 = 3;
/// Intervals a finding lasts before `--straggler-action exclude` makes its node leave (5 minutes
/// at the default interval: a slowdown that outlives a checkpoint or an evaluation pause).
pub const EXCLUDE_AFTER: u32 = 10;
/// Steps of a rank that are not measured.
pub const WARMUP_STEPS: u64 = 5;
/// Ranks with figures in the gang before any is compared.
pub const MIN_RANKS: usize = 3;
/// Steps a rank's compared figure covers at least: a figure of a few steps is the scheduler's
/// luck, not the rank's compute (on a loaded host one step may take a rank's thread off the CPU
/// for longer than the step's compute). Intervals with fewer steps are added up.
pub const WINDOW_STEPS: u64 = 10;
/// Intervals one compared figure may add up to reach [`WINDOW_STEPS`]; past that the watch says
/// it has too few steps to compare and names nobody.
pub const MAX_WINDOW: usize = 8;

/// `--straggler-action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Action {
    /// Name the rank (log, metrics, `/gangz`).
    #[default]
    Warn,
    /// Name it, and when it lasts make its node leave the gang (exit 210) so that an elastic gang
    /// (`--nnodes MIN:MAX`) re-forms without it.
    Exclude,
}

impl Action {
    pub fn parse(text: &str) -> Result<Action, String> {
        match text.trim() {
            "warn" => Ok(Action::Warn),
            "exclude" => Ok(Action::Exclude),
            _ => Err("expected warn or exclude".to_owned()),
        }
    }
}

/// `--straggler-threshold`, `--straggler-action`, `--straggler-interval`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// The slowness ratio that names a rank; `None`: detection off (`--straggler-threshold 0`).
    pub threshold: Option<f64>,
    pub action: Action,
    pub interval: Duration,
}

// The threshold is never NaN ([`Settings::parse_threshold`] takes finite ratios above 1 only),
// so equality is total; the launch configuration compares as a whole.
impl Eq for Settings {}

impl Default for Settings {
    fn default() -> Self {
        Self {
            threshold: Some(DEFAULT_THRESHOLD),
            action: Action::Warn,
            interval: DEFAULT_INTERVAL,
        }
    }
}

impl Settings {
    /// Parses `--straggler-threshold`: a ratio above 1, or `0`/`off`.
    pub fn parse_threshold(text: &str) -> Result<Option<f64>, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        match text.parse::<f64>() {
            Ok(0.0) => Ok(None),
            Ok(r) if r.is_finite() && r > 1.0 => Ok(Some(r)),
            _ => Err("expected a ratio above 1 (e.g. 1.5), or 0/off".to_owned()),
        }
    }

    /// Below this a finding starts to clear: halfway between typical (1.0) and the threshold.
    pub fn clear_ratio(threshold: f64) -> f64 {
        1.0 + (threshold - 1.0) / 2.0
    }
}

/// Nanoseconds per `/proc` clock tick: Linux exports `utime`/`stime` in `USER_HZ`, which is 100
/// on every architecture it supports (`sysconf(_SC_CLK_TCK)`).
pub const NANOS_PER_TICK: u64 = 10_000_000;

/// `utime + stime` of one thread (or, from `/proc/<pid>/stat`, of the whole thread group), in
/// nanoseconds, from the text of its `stat`. Fields are counted after the last `)`, as the
/// command name may hold spaces and parentheses.
pub fn stat_cpu_ns(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After `)`: state (3), ppid (4) … utime is field 14, stime 15.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    (utime + stime).checked_mul(NANOS_PER_TICK)
}

/// The time a thread spent on a CPU, in nanoseconds, from the text of its
/// `/proc/<pid>/task/<tid>/schedstat` (`<on cpu ns> <runnable ns> <timeslices>`): the
/// scheduler's own count, finer than `stat`'s 10 ms ticks.
pub fn schedstat_cpu_ns(schedstat: &str) -> Option<u64> {
    schedstat.split_whitespace().next()?.parse().ok()
}

/// One rank at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    pub local_rank: u32,
    pub rank: u32,
    /// CPU time of its main thread, in nanoseconds (see the module's doc); `None`: not
    /// readable.
    pub cpu_ns: Option<u64>,
    /// Its last reported step (the helper's number, or the reporter's count); `None`: none yet.
    pub step: Option<u64>,
}

/// One rank over one interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figure {
    pub node_rank: u32,
    pub local_rank: u32,
    pub rank: u32,
    /// Steps completed in the interval.
    pub steps: u64,
    /// CPU seconds per step.
    pub cpu_per_step: f64,
}

/// Turns successive [`Reading`]s of one node's ranks into [`Figure`]s.
#[derive(Debug, Default)]
pub struct Sampler {
    /// local rank → (its previous reading, the first step seen).
    last: BTreeMap<u32, (Reading, u64)>,
}

impl Sampler {
    /// The figures of the interval that ends with `now`: ranks past warm-up that stepped since
    /// the last look. A rank whose step went back (a restarted script) starts over.
    pub fn figures(&mut self, node_rank: u32, now: &[Reading]) -> Vec<Figure> {
        let mut out = Vec::new();
        for r in now {
            let Some(step) = r.step else { continue };
            let first = match self.last.get(&r.local_rank) {
                Some((prev, first)) if prev.step.is_some_and(|s| s <= step) => {
                    if let (Some(s0), Some(c0), Some(c1)) = (prev.step, prev.cpu_ns, r.cpu_ns) {
                        let warm = s0.saturating_sub(*first) >= WARMUP_STEPS;
                        if warm && step > s0 && c1 >= c0 {
                            let steps = step - s0;
                            out.push(Figure {
                                node_rank,
                                local_rank: r.local_rank,
                                rank: r.rank,
                                steps,
                                cpu_per_step: (c1 - c0) as f64 / 1e9 / steps as f64,
                            });
                        }
                    }
                    *first
                }
                _ => step,
            };
            self.last.insert(r.local_rank, (*r, first));
        }
        out
    }
}

/// The median of `values` (`None` when empty).
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        f64::midpoint(v[mid - 1], v[mid])
    })
}

/// One node's figures as its store value: `<seq>\n` then `<local_rank> <rank> <steps>
/// <cpu_us_per_step>` per rank. `seq` grows with every interval, so a reader can tell a node
/// that stopped publishing (its figures are not compared again).
pub fn encode(seq: u64, figures: &[Figure]) -> Vec<u8> {
    use std::fmt::Write as _;
    let mut text = format!("{seq}\n");
    for f in figures {
        // Writing into a String cannot fail.
        let _ = writeln!(
            text,
            "{} {} {} {}",
            f.local_rank,
            f.rank,
            f.steps,
            (f.cpu_per_step * 1e6).round() as u64
        );
    }
    text.into_bytes()
}

/// Reads [`encode`]'s value of node `node_rank`; `None` when empty or malformed.
pub fn decode(node_rank: u32, raw: &[u8]) -> Option<(u64, Vec<Figure>)> {
    let text = std::str::from_utf8(raw).ok()?;
    let mut lines = text.lines();
    let seq = lines.next()?.trim().parse().ok()?;
    let mut figures = Vec::new();
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let mut w = line.split_whitespace();
        let local_rank = w.next()?.parse().ok()?;
        let rank = w.next()?.parse().ok()?;
        let steps = w.next()?.parse().ok()?;
        let us: u64 = w.next()?.parse().ok()?;
        figures.push(Figure {
            node_rank,
            local_rank,
            rank,
            steps,
            cpu_per_step: us as f64 / 1e6,
        });
    }
    Some((seq, figures))
}

/// A rank named slow.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub local_rank: u32,
    pub rank: u32,
    /// Its ratio in the interval that named it.
    pub ratio: f64,
    pub cpu_per_step: f64,
    pub median: f64,
    /// Ranks in the comparison.
    pub compared: usize,
    /// Steps of the rank its figure covers.
    pub steps: u64,
}

impl fmt::Display for Finding {
    /// `computes 2.9x longer per step than the gang median (412 ms of main-thread CPU per step
    /// against 142 ms, 3 ranks compared over 24 steps)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "computes {:.1}x longer per step than the gang median ({:.0} ms of main-thread CPU per step against {:.0} ms, {} ranks compared over {} steps)",
            self.ratio,
            self.cpu_per_step * 1e3,
            self.median * 1e3,
            self.compared,
            self.steps
        )
    }
}

/// What one interval decided for this node's ranks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Judgement {
    /// (local rank, rank, ratio) of every own rank with a figure this interval.
    pub ratios: Vec<(u32, u32, f64)>,
    /// Ranks named slow in this interval.
    pub found: Vec<Finding>,
    /// Ranks whose finding cleared in this interval: (local rank, rank, ratio).
    pub cleared: Vec<(u32, u32, f64)>,
    /// A finding lasted [`EXCLUDE_AFTER`] comparisons: the rank (under `exclude`, the node
    /// leaves).
    pub sustained: Option<Finding>,
    /// Why the gang's figures could not be compared (nothing was judged).
    pub unsure: Option<Unsure>,
}

/// Why the watch judged nobody although the gang had figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unsure {
    /// [`MAX_WINDOW`] intervals held fewer than [`WINDOW_STEPS`] steps.
    FewSteps { steps: u64, intervals: usize },
    /// The median rank's main thread used no CPU between its steps: the script steps from
    /// another thread, whose compute the watch does not see.
    NoCpu,
}

impl fmt::Display for Unsure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unsure::FewSteps { steps, intervals } => write!(
                f,
                "{steps} steps in the last {intervals} intervals, fewer than the {WINDOW_STEPS} a comparison needs (a longer --straggler-interval holds more)"
            ),
            Unsure::NoCpu => write!(
                f,
                "the ranks' main threads used no CPU between their steps (does the script train on another thread?)"
            ),
        }
    }
}

#[derive(Debug, Default, Clone)]
struct RankState {
    above: u32,
    below: u32,
    /// The standing finding and the intervals it has lasted.
    finding: Option<(Finding, u32)>,
}

/// The hysteresis state of one node's ranks across intervals.
#[derive(Debug, Default)]
pub struct Tracker {
    ranks: BTreeMap<u32, RankState>,
    /// The figures of the comparison being added up: (node rank, local rank) of every rank of
    /// the gang → (its figure's latest, steps, CPU seconds).
    round: BTreeMap<(u32, u32), (Figure, u64, f64)>,
    /// Intervals with figures in the round.
    round_intervals: usize,
}

/// One rank's figure as compared: its intervals since the last comparison added up.
struct Windowed {
    figure: Figure,
    steps: u64,
    cpu_per_step: f64,
}

impl Tracker {
    /// Judges this node's ranks (`node_rank`) in one interval, against the gang's `figures`
    /// (every node's fresh ones, this node's included). A comparison covers at least
    /// [`WINDOW_STEPS`] steps of the median rank: intervals with fewer are added up first, and
    /// each comparison starts from new steps, so that one interval's luck counts once.
    pub fn judge(&mut self, threshold: f64, node_rank: u32, figures: &[Figure]) -> Judgement {
        let mut out = Judgement::default();
        if figures.is_empty() {
            return out;
        }
        for f in figures {
            let e = self
                .round
                .entry((f.node_rank, f.local_rank))
                .or_insert((*f, 0, 0.0));
            e.0 = *f;
            e.1 += f.steps;
            e.2 += f.cpu_per_step * f.steps as f64;
        }
        self.round_intervals += 1;
        let steps: Vec<f64> = self.round.values().map(|e| e.1 as f64).collect();
        let median_steps = median(&steps).unwrap_or(0.0);
        if median_steps < WINDOW_STEPS as f64 {
            if self.round_intervals >= MAX_WINDOW {
                // A gang too small to compare is not unsure: it is never compared.
                if self.round.len() >= MIN_RANKS {
                    out.unsure = Some(Unsure::FewSteps {
                        steps: median_steps as u64,
                        intervals: self.round_intervals,
                    });
                }
                self.start_round();
            }
            return out;
        }
        // A rank with half a window or less (its node's figures went stale) sits this one out.
        let windowed: Vec<Windowed> = self
            .round
            .values()
            .filter(|e| e.1 * 2 > WINDOW_STEPS)
            .map(|e| Windowed {
                figure: e.0,
                steps: e.1,
                cpu_per_step: e.2 / e.1 as f64,
            })
            .collect();
        self.start_round();
        if windowed.len() < MIN_RANKS {
            return out;
        }
        let values: Vec<f64> = windowed.iter().map(|w| w.cpu_per_step).collect();
        // A median of no CPU is not a yardstick.
        let Some(median) = median(&values).filter(|m| *m > 0.0) else {
            out.unsure = Some(Unsure::NoCpu);
            return out;
        };
        let clear = Settings::clear_ratio(threshold);
        let compared = windowed.len();
        for w in windowed.iter().filter(|w| w.figure.node_rank == node_rank) {
            let f = &w.figure;
            let ratio = w.cpu_per_step / median;
            out.ratios.push((f.local_rank, f.rank, ratio));
            let s = self.ranks.entry(f.local_rank).or_default();
            if ratio >= threshold {
                s.above += 1;
            } else {
                s.above = 0;
            }
            if ratio < clear {
                s.below += 1;
            } else {
                s.below = 0;
            }
            let now = Finding {
                local_rank: f.local_rank,
                rank: f.rank,
                ratio,
                cpu_per_step: w.cpu_per_step,
                median,
                compared,
                steps: w.steps,
            };
            match &mut s.finding {
                None if s.above >= FIND_AFTER => {
                    out.found.push(now.clone());
                    s.finding = Some((now, 1));
                }
                None => {}
                Some(_) if s.below >= CLEAR_AFTER => {
                    out.cleared.push((f.local_rank, f.rank, ratio));
                    s.finding = None;
                }
                Some((_, lasted)) => {
                    *lasted += 1;
                    if *lasted == EXCLUDE_AFTER {
                        out.sustained = Some(now);
                    }
                }
            }
        }
        out
    }

    fn start_round(&mut self) {
        self.round.clear();
        self.round_intervals = 0;
    }

    /// The standing findings.
    pub fn findings(&self) -> Vec<Finding> {
        self.ranks
            .values()
            .filter_map(|s| s.finding.as_ref().map(|(f, _)| f.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One interval of `WINDOW_STEPS` steps: compared on its own.
    fn fig(node_rank: u32, cpu: f64) -> Figure {
        fig_of(node_rank, WINDOW_STEPS, cpu)
    }

    fn fig_of(node_rank: u32, steps: u64, cpu: f64) -> Figure {
        Figure {
            node_rank,
            local_rank: 0,
            rank: node_rank,
            steps,
            cpu_per_step: cpu,
        }
    }

    #[test]
    fn the_median_of_odd_and_even_sets() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[f64::NAN, 1.0]), Some(1.0));
    }

    #[test]
    fn thresholds_parse_and_zero_is_off() {
        assert_eq!(Settings::parse_threshold("1.5"), Ok(Some(1.5)));
        assert_eq!(Settings::parse_threshold("0"), Ok(None));
        assert_eq!(Settings::parse_threshold("off"), Ok(None));
        assert!(Settings::parse_threshold("1").is_err());
        assert!(Settings::parse_threshold("fast").is_err());
        assert_eq!(Action::parse("exclude"), Ok(Action::Exclude));
        assert!(Action::parse("kill").is_err());
        assert!((Settings::clear_ratio(1.5) - 1.25).abs() < 1e-9);
    }

    #[test]
    fn cpu_time_reads_past_a_command_with_spaces() {
        let stat =
            "4242 (py thon (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 17 0 0 20 0 3 0 100 0 0";
        assert_eq!(stat_cpu_ns(stat), Some(2_670_000_000));
        assert_eq!(schedstat_cpu_ns("156311 717207 2\n"), Some(156_311));
        assert_eq!(stat_cpu_ns("garbage"), None);
    }

    #[test]
    fn warm_up_steps_and_idle_intervals_give_no_figure() {
        let mut s = Sampler::default();
        let r = |step: Option<u64>, ticks: u64| Reading {
            local_rank: 0,
            rank: 4,
            cpu_ns: Some(ticks * NANOS_PER_TICK),
            step,
        };
        assert!(s.figures(1, &[r(None, 10)]).is_empty());
        assert!(s.figures(1, &[r(Some(1), 20)]).is_empty(), "first look");
        assert!(s.figures(1, &[r(Some(4), 50)]).is_empty(), "warm-up");
        assert!(
            s.figures(1, &[r(Some(6), 70)]).is_empty(),
            "from step 4: warm-up"
        );
        let f = s.figures(1, &[r(Some(10), 110)]);
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].node_rank, f[0].rank, f[0].steps), (1, 4, 4));
        assert!((f[0].cpu_per_step - 0.1).abs() < 1e-9);
        assert!(s.figures(1, &[r(Some(10), 150)]).is_empty(), "no step");
        assert!(
            s.figures(1, &[r(Some(2), 160)]).is_empty(),
            "step went back"
        );
    }

    #[test]
    fn figures_round_trip_through_the_store_value() {
        let figures = vec![fig(2, 0.4125), fig(2, 0.1)];
        let (seq, back) = decode(2, &encode(7, &figures)).unwrap();
        assert_eq!(seq, 7);
        assert_eq!(back, figures);
        assert_eq!(decode(0, b""), None);
        assert_eq!(decode(0, b"1\nx y"), None);
    }

    #[test]
    fn a_rank_is_named_after_consecutive_intervals_and_clears_with_hysteresis() {
        let mut t = Tracker::default();
        let gang = |slow: f64| vec![fig(0, 0.1), fig(1, 0.11), fig(2, slow)];
        // Two intervals above, one below: the count starts over.
        for slow in [0.3, 0.3, 0.12] {
            assert!(t.judge(1.5, 2, &gang(slow)).found.is_empty());
        }
        assert!(t.judge(1.5, 2, &gang(0.3)).found.is_empty());
        assert!(t.judge(1.5, 2, &gang(0.3)).found.is_empty());
        let j = t.judge(1.5, 2, &gang(0.29));
        assert_eq!(j.found.len(), 1, "{j:?}");
        let finding = &j.found[0];
        assert_eq!(finding.rank, 2);
        assert!((finding.ratio - 2.9 / 1.1).abs() < 1e-6);
        assert!(finding
            .to_string()
            .starts_with("computes 2.6x longer per step than the gang median (290 ms of main-thread CPU per step against 110 ms"));
        // Other nodes' ranks are theirs to name.
        assert!(t.judge(1.5, 0, &gang(0.3)).found.is_empty());
        // Between the clear ratio (1.25) and the threshold it stands; below it clears after three.
        for slow in [0.14, 0.12, 0.12] {
            assert!(t.judge(1.5, 2, &gang(slow)).cleared.is_empty());
        }
        let j = t.judge(1.5, 2, &gang(0.12));
        assert_eq!(j.cleared.len(), 1);
        assert!(t.findings().is_empty());
    }

    #[test]
    fn a_healthy_gang_and_a_small_one_name_nobody() {
        let mut t = Tracker::default();
        for i in 0..50 {
            let jitter = f64::from(i % 5) * 0.02;
            let gang = [
                fig(0, 0.1 + jitter),
                fig(1, 0.12 - jitter / 2.0),
                fig(2, 0.11),
            ];
            for node in 0..3 {
                let j = t.judge(1.5, node, &gang);
                assert!(j.found.is_empty(), "{j:?}");
            }
        }
        for _ in 0..10 {
            assert!(t
                .judge(1.5, 1, &[fig(0, 0.1), fig(1, 0.5)])
                .ratios
                .is_empty());
        }
    }

    #[test]
    fn intervals_of_few_steps_add_up_before_they_are_compared() {
        let mut t = Tracker::default();
        // 4 steps an interval: the third interval holds 12, the first comparable figure.
        let gang = |slow: f64| [fig_of(0, 4, 0.1), fig_of(1, 4, 0.1), fig_of(2, 4, slow)];
        for _ in 0..2 {
            let j = t.judge(1.5, 2, &gang(0.3));
            assert!(j.ratios.is_empty() && j.unsure.is_none(), "{j:?}");
        }
        let j = t.judge(1.5, 2, &gang(0.3));
        assert_eq!(j.ratios.len(), 1, "{j:?}");
        assert!((j.ratios[0].2 - 3.0).abs() < 1e-9);
        // One outlying interval counts in one comparison only: a rank whose thread the
        // scheduler held on the CPU for a few steps is not named for it.
        let mut t = Tracker::default();
        let mut named = Vec::new();
        for i in 0..24 {
            let burst = if i % 12 == 4 { 0.35 } else { 0.1 };
            named.extend(t.judge(1.5, 2, &gang(burst)).found);
        }
        assert!(named.is_empty(), "{named:?}");
        // A rank slow in every interval is named, with the steps its figure covers.
        let mut t = Tracker::default();
        let found: Vec<Finding> = (0..9)
            .flat_map(|_| t.judge(1.5, 2, &gang(0.3)).found)
            .collect();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].steps, 12);
        assert!(found[0]
            .to_string()
            .ends_with("3 ranks compared over 12 steps)"));
    }

    #[test]
    fn a_watch_that_cannot_compare_says_so_and_names_nobody() {
        let mut t = Tracker::default();
        // One step an interval: ten intervals never hold WINDOW_STEPS.
        let slow_steps = [fig_of(0, 1, 0.1), fig_of(1, 1, 0.1), fig_of(2, 1, 0.9)];
        let judged: Vec<Judgement> = (0..MAX_WINDOW + 3)
            .map(|_| t.judge(1.5, 2, &slow_steps))
            .collect();
        assert!(judged
            .iter()
            .all(|j| j.found.is_empty() && j.ratios.is_empty()));
        assert!(judged[..MAX_WINDOW - 1].iter().all(|j| j.unsure.is_none()));
        assert_eq!(
            judged[MAX_WINDOW - 1].unsure,
            Some(Unsure::FewSteps {
                steps: 8,
                intervals: MAX_WINDOW
            })
        );
        // Main threads without CPU: the script trains elsewhere.
        let mut t = Tracker::default();
        let j = t.judge(1.5, 2, &[fig(0, 0.0), fig(1, 0.0), fig(2, 0.2)]);
        assert_eq!(j.unsure, Some(Unsure::NoCpu));
        assert!(j.found.is_empty() && j.ratios.is_empty());
        assert!(j.unsure.unwrap().to_string().contains("another thread"));
    }

    #[test]
    fn a_lasting_finding_is_sustained_once() {
        let mut t = Tracker::default();
        let gang = [fig(0, 0.1), fig(1, 0.1), fig(2, 0.3)];
        let sustained: Vec<u32> = (1..=30)
            .filter(|_| t.judge(1.5, 2, &gang).sustained.is_some())
            .collect();
        assert_eq!(sustained, vec![FIND_AFTER + EXCLUDE_AFTER - 1]);
    }
}
