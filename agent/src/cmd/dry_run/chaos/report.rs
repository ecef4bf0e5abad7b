//! The chaos report: per strike, when it hit, how the gang reacted, the time to recovery and the
//! steps lost; the totals; advice where a number is poor; and the dry run's verdict. A pure
//! function of the timeline (times in seconds since the agents started) and the step samples.
//!
//! The figures, as docs/chaos.md defines them:
//! - **time to recovery**: from the strike to the moment every rank of the job has reported a
//!   step of the gang that runs after it (for a frozen rank that the gang waited out: a step
//!   after it was let go). Read from the step samples, so within one sample
//!   ([`crate::cmd::dry_run::fault::SAMPLE_INTERVAL`]) of the agent's own receipt.
//! - **steps lost**: the highest step any rank reached before the gang stopped, plus one, minus
//!   the lowest step the next gang reported first: the steps trained twice. 0 when the gang did
//!   not stop, or resumed right after the step it reached (a committed preemption checkpoint).
//! - **verdict**: recovered within `--chaos-recovery-bound`, not recovered, not injected (its
//!   target was gone at that moment, or the job ended first), or not measured (the job ended
//!   within the bound before every rank reported again).

use std::fmt::Write as _;
use std::time::Duration;

use super::plan::Strike;
use super::steps::Sample;
use super::Kind;
use crate::cmd::dry_run::fault::spec::STOP_HOLD;
use crate::cmd::dry_run::timeline::Entry;

/// A step sample, in seconds since the agents started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    pub t: f64,
    pub node: u32,
    pub local_rank: u32,
    pub step: u64,
}

impl Step {
    pub fn of(sample: &Sample, start: tokio::time::Instant) -> Self {
        Self {
            t: sample.at.saturating_duration_since(start).as_secs_f64(),
            node: sample.node,
            local_rank: sample.local_rank,
            step: sample.step,
        }
    }
}

/// How one strike ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Recovered,
    /// Not recovered within the bound (or never).
    NotRecovered,
    /// Never injected: why.
    NotInjected(String),
    /// The job ended, within the bound, before every rank reported again.
    NotMeasured,
}

impl Verdict {
    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Recovered => "recovered",
            Verdict::NotRecovered => "not_recovered",
            Verdict::NotInjected(_) => "not_injected",
            Verdict::NotMeasured => "not_measured",
        }
    }
}

/// What one strike cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub strike: Strike,
    /// When it hit (seconds since the agents started).
    pub hit: Option<f64>,
    /// How the gang reacted, in words.
    pub reaction: String,
    /// Seconds from the strike to every rank's next step.
    pub recovery: Option<f64>,
    /// The highest step reached before the gang stopped, and the first step the next gang
    /// reported.
    pub reached: Option<u64>,
    pub resumed_at: Option<u64>,
    pub steps_lost: Option<u64>,
    pub verdict: Verdict,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub seed: u64,
    pub bound: Duration,
    pub outcomes: Vec<Outcome>,
    pub job_code: u8,
    /// Whether step reports were seen at all (none: metrics off, or a script without steps).
    pub steps_seen: bool,
    /// The steps the checkpoint barrier committed (preemptions): a resume point right after one
    /// is the barrier's save, not one of the script's own.
    pub committed: Vec<u64>,
    /// When the run ended (seconds since the agents started).
    pub end: f64,
    /// Where the schedule stood when the job ended with strikes still to come (set by the
    /// runner, which knows the clock and the gaps).
    pub unfinished: Option<Unfinished>,
    /// The agents' `--snapshot-every` (set by the runner): a crash should cost at most N + 1.
    pub snapshot_every: Option<u64>,
}

/// What the runner knew of the schedule when the job ended before it was through: enough to say
/// why strikes never came and what would fit them in.
#[derive(Debug, Clone, PartialEq)]
pub struct Unfinished {
    /// When training was under way (the faults' clock started), if it ever was.
    pub training_started: Option<f64>,
    /// The first strike not handed over, and when it was due (`None`: the one before had not
    /// been recovered from yet, so its gap had not begun).
    pub next: usize,
    pub due: Option<f64>,
    /// `--chaos-interval`, and how many strikes the schedule holds.
    pub interval: (Duration, Duration),
    pub count: usize,
}

/// What the inputs of [`build`] are.
pub struct Inputs<'a> {
    pub seed: u64,
    pub bound: Duration,
    pub strikes: &'a [Strike],
    pub entries: &'a [(f64, &'a Entry)],
    pub steps: &'a [Step],
    /// Every rank of the job (nodes × ranks per node).
    pub world: usize,
    pub job_code: u8,
    /// When the run ended.
    pub end: f64,
}

/// Builds the report.
pub fn build(inputs: &Inputs<'_>) -> Report {
    let hits: Vec<Option<f64>> = inputs
        .strikes
        .iter()
        .map(|s| {
            inputs
                .entries
                .iter()
                .filter(
                    |(_, e)| matches!(e, Entry::FaultHit { fault, .. } if s.faults.contains(fault)),
                )
                .map(|(t, _)| *t)
                .reduce(f64::min)
        })
        .collect();
    let outcomes = inputs
        .strikes
        .iter()
        .enumerate()
        .map(|(i, strike)| {
            let next = hits
                .iter()
                .skip(i + 1)
                .flatten()
                .copied()
                .reduce(f64::min)
                .unwrap_or(f64::INFINITY);
            outcome(inputs, strike, hits.get(i).copied().flatten(), next)
        })
        .collect();
    let mut committed: Vec<u64> = inputs
        .entries
        .iter()
        .filter_map(|(_, e)| match e {
            Entry::Committed { step } => Some(*step),
            _ => None,
        })
        .collect();
    committed.sort_unstable();
    committed.dedup();
    Report {
        seed: inputs.seed,
        bound: inputs.bound,
        outcomes,
        job_code: inputs.job_code,
        steps_seen: !inputs.steps.is_empty(),
        committed,
        end: inputs.end,
        unfinished: None,
        snapshot_every: None,
    }
}

fn outcome(inputs: &Inputs<'_>, strike: &Strike, hit: Option<f64>, next: f64) -> Outcome {
    let Some(hit) = hit else {
        let why = inputs
            .entries
            .iter()
            .find_map(|(_, e)| match e {
                Entry::FaultMissed { fault, why } if strike.faults.contains(fault) => {
                    Some(why.clone())
                }
                _ => None,
            })
            // A strike not yet struck when the run ended.
            .unwrap_or_else(|| "the job ended first".to_owned());
        return Outcome {
            strike: strike.clone(),
            hit: None,
            reaction: String::new(),
            recovery: None,
            reached: None,
            resumed_at: None,
            steps_lost: None,
            verdict: Verdict::NotInjected(why),
        };
    };
    let window: Vec<(f64, &Entry)> = inputs
        .entries
        .iter()
        .filter(|(t, _)| *t >= hit && *t < next)
        .map(|(t, e)| (*t, *e))
        .collect();
    let stopped = window
        .iter()
        .find(|(_, e)| matches!(e, Entry::Stopped { .. }))
        .map(|(t, _)| *t);
    // A frozen rank the gang waited out: every rank stepped after its release, before any stop
    // (the one at the job's end, say), so the gang did not stop for it.
    let stopped = if strike.kind == Kind::StopRank {
        let released = first_steps_after(inputs.steps, hit + STOP_HOLD.as_secs_f64());
        let went_on = (released.len() >= inputs.world && inputs.world > 0)
            .then(|| released.iter().map(|s| s.t).fold(f64::MIN, f64::max));
        stopped.filter(|stop| went_on.is_none_or(|t| t > *stop))
    } else {
        stopped
    };
    // The next gang: the first one running after the stop (also past the next strike: a gang
    // that came back late is still this strike's recovery).
    let resumed = stopped.and_then(|stop| {
        inputs
            .entries
            .iter()
            .find(|(t, e)| *t >= stop && matches!(e, Entry::Running { .. }))
            .map(|(t, _)| *t)
    });
    let reaction = reaction(&window, stopped.is_some());
    // From when a step counts as recovery: the next gang running, or the frozen rank let go.
    // Every other kind stops the gang (a preemption's ranks step on to the agreed step first):
    // no recovery before it stopped and ran again.
    let from = match (stopped, resumed) {
        (Some(_), Some(r)) => Some(r),
        (None, _) if strike.kind == Kind::StopRank => Some(hit + STOP_HOLD.as_secs_f64()),
        _ => None,
    };
    let firsts = from.map(|f| first_steps_after(inputs.steps, f));
    let recovered_at = firsts
        .as_ref()
        .filter(|f| f.len() >= inputs.world && inputs.world > 0)
        .and_then(|f| f.iter().map(|s| s.t).reduce(f64::max));
    let recovery = recovered_at.map(|t| t - hit);
    let (reached, resumed_at, steps_lost) = match (stopped, firsts.as_ref()) {
        (Some(stop), Some(firsts)) if !firsts.is_empty() => {
            let reached = inputs
                .steps
                .iter()
                .filter(|s| s.t < stop)
                .map(|s| s.step)
                .max();
            let resumed_at = firsts.iter().map(|s| s.step).min();
            let lost = match (reached, resumed_at) {
                (Some(r), Some(a)) => Some((r + 1).saturating_sub(a)),
                _ => None,
            };
            (reached, resumed_at, lost)
        }
        // A frozen rank waited out.
        (None, _) if recovery.is_some() => (None, None, Some(0)),
        _ => (None, None, None),
    };
    let bound = inputs.bound.as_secs_f64();
    let verdict = match recovery {
        Some(r) if r <= bound => Verdict::Recovered,
        None if inputs.end - hit <= bound && inputs.job_code == 0 => Verdict::NotMeasured,
        // Too slow, or never.
        _ => Verdict::NotRecovered,
    };
    Outcome {
        strike: strike.clone(),
        hit: Some(hit),
        reaction,
        recovery,
        reached,
        resumed_at,
        steps_lost,
        verdict,
    }
}

/// Each rank's first step sample at or after `from`.
fn first_steps_after(steps: &[Step], from: f64) -> Vec<Step> {
    let mut firsts: Vec<Step> = Vec::new();
    for s in steps.iter().filter(|s| s.t >= from) {
        if !firsts
            .iter()
            .any(|f| f.node == s.node && f.local_rank == s.local_rank)
        {
            firsts.push(*s);
        }
    }
    firsts
}

/// How the gang reacted, from the timeline entries after the strike.
fn reaction(window: &[(f64, &Entry)], stopped: bool) -> String {
    let mut parts: Vec<String> = Vec::new();
    for (_, e) in window {
        let part = match e {
            Entry::Committed { step } => format!("barrier: checkpoint committed at step {step}"),
            Entry::Aborted { reason } => format!("barrier: checkpoint aborted ({reason})"),
            Entry::Hung { what } => {
                let rank = what.split(" made no ").next().unwrap_or(what);
                format!("hang watch: {rank}")
            }
            Entry::Replaced { node, .. } => format!("node {node} replaced"),
            Entry::Formed { again: true, .. } => "gang re-formed".to_owned(),
            Entry::Running {
                resumed: Some(_), ..
            } => "gang restarted".to_owned(),
            _ => continue,
        };
        if !parts.contains(&part) {
            parts.push(part);
        }
    }
    if parts.is_empty() {
        if stopped {
            "gang stopped".to_owned()
        } else {
            "none: the gang waited and went on".to_owned()
        }
    } else {
        parts.join(", ")
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 0 {
        f64::midpoint(values[mid - 1], values[mid])
    } else {
        values[mid]
    })
}

impl Report {
    /// The strikes injected.
    pub fn injected(&self) -> usize {
        self.outcomes.iter().filter(|o| o.hit.is_some()).count()
    }

    pub fn recovered(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| o.verdict == Verdict::Recovered)
            .count()
    }

    /// The dry run's exit code: the job's when it did not finish, else [`super::NOT_RECOVERED`]
    /// when a strike was not recovered within the bound, else [`super::NOT_INJECTED`] when
    /// fewer strikes were injected than the schedule holds (what was not injected was not
    /// rehearsed), else 0.
    pub fn exit_code(&self) -> u8 {
        if self.job_code != 0 {
            self.job_code
        } else if self.not_recovered() > 0 {
            super::NOT_RECOVERED
        } else if self.injected() < self.outcomes.len() {
            super::NOT_INJECTED
        } else {
            0
        }
    }

    fn not_recovered(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| o.verdict == Verdict::NotRecovered)
            .count()
    }

    /// Why strikes were not injected, in words: when the job ended against when the next one
    /// was due, and each strike whose target was gone.
    fn why_not_injected(&self) -> String {
        let mut parts = Vec::new();
        if let Some(cut) = self.ended_first() {
            parts.push(cut);
        }
        for o in &self.outcomes {
            if let Verdict::NotInjected(why) = &o.verdict {
                if !why.contains("ended first") {
                    parts.push(format!(
                        "#{} {}: {why}",
                        o.strike.number,
                        o.strike.kind.name()
                    ));
                }
            }
        }
        parts.join("; ")
    }

    /// How many strikes never came because the job ended first.
    fn never_came(&self) -> usize {
        self.outcomes
            .iter()
            .filter(
                |o| matches!(&o.verdict, Verdict::NotInjected(why) if why.contains("ended first")),
            )
            .count()
    }

    /// "the job ended 11.2 s into training, before strike #1 was due at 31.6 s" (when strikes
    /// never came).
    fn ended_first(&self) -> Option<String> {
        let left = self.never_came();
        if left == 0 {
            return None;
        }
        let Some(u) = &self.unfinished else {
            return Some(format!("the job ended before {left} strike(s) came"));
        };
        let when = match u.training_started {
            Some(t) => format!(
                "the job ended {:.1} s into training, {:.1} s after the agents started",
                self.end - t,
                self.end
            ),
            None => format!(
                "the job ended {:.1} s after the agents started, before training was under way \
                 (the faults' clock never started)",
                self.end
            ),
        };
        Some(match u.due {
            Some(due) => format!("{when}, before strike #{} was due at {due:.1} s", u.next),
            None => format!(
                "{when}, while the gang was still recovering from strike #{}",
                u.next.saturating_sub(1)
            ),
        })
    }

    /// The median and worst time to recovery.
    pub fn recovery(&self) -> (Option<f64>, Option<f64>) {
        let mut times: Vec<f64> = self.outcomes.iter().filter_map(|o| o.recovery).collect();
        let worst = times.iter().copied().reduce(f64::max);
        (median(&mut times), worst)
    }

    /// Per kind that struck: (kind, strikes measured, steps lost in all).
    pub fn lost_per_kind(&self) -> Vec<(Kind, usize, u64)> {
        Kind::ALL
            .iter()
            .filter_map(|k| {
                let lost: Vec<u64> = self
                    .outcomes
                    .iter()
                    .filter(|o| o.strike.kind == *k)
                    .filter_map(|o| o.steps_lost)
                    .collect();
                (!lost.is_empty()).then(|| (*k, lost.len(), lost.iter().sum()))
            })
            .collect()
    }

    /// Plain-language advice where a number is poor.
    pub fn advice(&self) -> Vec<String> {
        let mut advice = Vec::new();
        if !self.steps_seen {
            advice.push(
                "no step reports were seen (metrics off, or a script that reports no steps): \
                 recovery and steps lost cannot be measured; use the checkpoint helper or keep \
                 --auto-step-reports on, and leave --metrics-addr on"
                    .to_owned(),
            );
            return advice;
        }
        let crashes: Vec<u64> = self
            .outcomes
            .iter()
            .filter(|o| o.strike.kind != Kind::Term)
            .filter_map(|o| o.steps_lost)
            .filter(|l| *l > 0)
            .collect();
        if !crashes.is_empty() {
            let mut as_f64: Vec<f64> = crashes.iter().map(|l| *l as f64).collect();
            let m = median(&mut as_f64).unwrap_or_default();
            match self.snapshot_every {
                // What snapshots promise: nothing to say.
                Some(n) if crashes.iter().all(|l| *l <= n + 1) => {}
                Some(n) => advice.push(format!(
                    "each crash cost a median of {m:.0} steps (worst {}) though the agents take \
                     snapshots every {n} steps: a crash should cost at most {}; the script may \
                     not hand its state to the snapshot helper (muster_launcher.snapshot, \
                     docs/snapshots.md), or a pod was lost together with its buddy",
                    crashes.iter().max().copied().unwrap_or_default(),
                    n + 1
                )),
                None => advice.push(format!(
                    "each crash cost a median of {m:.0} steps: the script resumes from its last \
                     checkpoint; {}; save more often, or take in-memory snapshots \
                     (--snapshot-every N: a crash then costs at most N + 1 steps for a copy of \
                     the state into memory, docs/snapshots.md), and also save when muster asks \
                     (the checkpoint helper) so that a preemption costs nothing",
                    self.save_cadence()
                )),
            }
        }
        if self
            .outcomes
            .iter()
            .any(|o| o.strike.kind == Kind::Term && o.steps_lost.is_some_and(|l| l > 0))
        {
            advice.push(
                "a preemption lost steps: with the checkpoint helper every rank saves at the step \
                 the agents agreed on and nothing is lost; is ckpt.should_save(step) called every \
                 step, and does the script resume from the step after the committed one?"
                    .to_owned(),
            );
        }
        let (_, worst) = self.recovery();
        let bound = self.bound.as_secs_f64();
        if let Some(w) = worst.filter(|w| *w > bound / 2.0) {
            advice.push(format!(
                "the slowest recovery took {w:.1} s, more than half the bound ({bound:.0} s): \
                 look at its reaction; a shorter --rdzv-conf join_timeout or last_call_timeout \
                 re-forms sooner, a replacement pod's start-up (image pull, imports) adds to it"
            ));
        }
        if self.never_came() > 0 {
            advice.push(self.fit_advice());
        }
        advice
    }

    /// What would fit the schedule into the job: how long the schedule needs, and an interval
    /// this job's training would have held.
    fn fit_advice(&self) -> String {
        let mut text = format!(
            "{} strike(s) never came: {}; ",
            self.never_came(),
            self.ended_first().unwrap_or_default()
        );
        let Some(u) = &self.unfinished else {
            text.push_str("give the job more steps, or a shorter --chaos-interval");
            return text;
        };
        let (lo, hi) = (u.interval.0.as_secs_f64(), u.interval.1.as_secs_f64());
        let needed = f64::midpoint(lo, hi) * u.count as f64;
        let _ = write!(
            text,
            "the schedule needs the job to train through all {} strikes: about {needed:.0} s of \
             training at --chaos-interval {lo}:{hi}, plus each recovery; give the job more steps",
            u.count
        );
        if let Some(trained) = u.training_started.map(|t| self.end - t) {
            // A gap per strike and one more before the job's end, halved for the recoveries.
            #[allow(clippy::cast_precision_loss)]
            let fit_hi = (trained / (u.count as f64 + 1.0) / 2.0 * 10.0).floor() / 10.0;
            if fit_hi >= 0.2 {
                let fit_lo = (fit_hi / 2.0 * 10.0).floor().max(1.0) / 10.0;
                let _ = write!(
                    text,
                    ", or fit the schedule to this job's {trained:.1} s of training with \
                     --chaos-interval {fit_lo}:{fit_hi}"
                );
            } else {
                let _ = write!(
                    text,
                    " (it trained {trained:.1} s: too short for {} strikes at any interval)",
                    u.count
                );
            }
        }
        text
    }

    /// What the resume points say of the script's own saves: "your script seems to save every
    /// 20 steps (it resumed after steps 100, 120, 160)". The steps it resumed after a crash are
    /// its saves; a preemption's resume point is the barrier's save (any step the agents agreed
    /// on), so it is left out, and so is any resume point right after a step the barrier
    /// committed. The greatest common divisor of two or more saves is the script's period when
    /// it saves at multiples of one.
    fn save_cadence(&self) -> String {
        let mut saves: Vec<u64> = self
            .outcomes
            .iter()
            .filter(|o| o.strike.kind != Kind::Term)
            .filter_map(|o| o.resumed_at)
            .filter_map(|a| a.checked_sub(1))
            .filter(|s| *s > 0 && !self.committed.contains(s))
            .collect();
        saves.sort_unstable();
        saves.dedup();
        let list: Vec<String> = saves.iter().map(ToString::to_string).collect();
        let period = saves.iter().copied().reduce(gcd).unwrap_or(0);
        match saves.len() {
            0 => {
                "it resumed from the start every time: no save was found to resume from".to_owned()
            }
            1 => format!("it resumed after step {}", list.join("")),
            _ if period >= 2 => format!(
                "your script seems to save every {period} steps (it resumed after steps {})",
                list.join(", ")
            ),
            _ => format!("it resumed after steps {}", list.join(", ")),
        }
    }

    /// The one-line summary of the totals.
    pub fn totals(&self) -> String {
        let (median, worst) = self.recovery();
        let secs = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1} s"));
        let mut text = format!(
            "{} of {} strikes injected, {} recovered within {} s; recovery median {}, worst {}",
            self.injected(),
            self.outcomes.len(),
            self.recovered(),
            self.bound.as_secs_f64(),
            secs(median),
            secs(worst)
        );
        let per_kind = self.lost_per_kind();
        if !per_kind.is_empty() {
            text.push_str("; steps lost:");
            for (i, (kind, n, lost)) in per_kind.iter().enumerate() {
                let sep = if i == 0 { " " } else { ", " };
                let _ = write!(text, "{sep}{} {lost} ({n} strike(s))", kind.name());
            }
        }
        text
    }

    /// The closing verdict line.
    pub fn verdict(&self) -> String {
        let bound = self.bound.as_secs_f64();
        match self.exit_code() {
            0 if self.recovered() == self.outcomes.len() => format!(
                "verdict: the job finished and all {} strike(s) were injected and recovered \
                 within {bound} s",
                self.outcomes.len()
            ),
            0 => format!(
                "verdict: the job finished; all {} strike(s) were injected, {} recovered within \
                 {bound} s, {} not measured (the job ended, within the bound, before every rank \
                 reported again)",
                self.outcomes.len(),
                self.recovered(),
                self.outcomes.len() - self.recovered()
            ),
            super::NOT_RECOVERED => format!(
                "verdict: the job finished, but {} strike(s) were not recovered within {bound} s \
                 (--chaos-recovery-bound): exit {}",
                self.not_recovered(),
                super::NOT_RECOVERED
            ),
            super::NOT_INJECTED => format!(
                "verdict: the job finished, but only {} of {} strikes were injected ({}): the \
                 rest of the schedule was not rehearsed: exit {}",
                self.injected(),
                self.outcomes.len(),
                self.why_not_injected(),
                super::NOT_INJECTED
            ),
            code => format!("verdict: the job did not finish: exit {code}"),
        }
    }
}

impl Outcome {
    /// One line of the report.
    pub fn line(&self) -> String {
        let when = self
            .hit
            .map_or_else(|| "never".to_owned(), |t| format!("{t:.1} s"));
        let head = format!(
            "#{} {} {} at {when}",
            self.strike.number,
            self.strike.kind.name(),
            self.strike.target()
        );
        if let Verdict::NotInjected(why) = &self.verdict {
            return format!("{head}: not injected ({why})");
        }
        let recovery = self.recovery.map_or_else(
            || "no recovery seen".to_owned(),
            |r| format!("recovered in {r:.1} s"),
        );
        let lost = match (self.steps_lost, self.reached, self.resumed_at) {
            (Some(l), Some(r), Some(a)) => {
                format!("{l} steps lost (reached {r}, resumed at {a})")
            }
            (Some(l), _, _) => format!("{l} steps lost"),
            _ => "steps lost unknown".to_owned(),
        };
        format!(
            "{head}: {}; {recovery}; {lost}; {}",
            self.reaction,
            self.verdict.name().replace('_', " ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::dry_run::fault::spec::parse;
    use crate::cmd::dry_run::timeline::Resumed;

    fn strike(number: usize, kind: Kind, specs: &[&str]) -> Strike {
        Strike {
            number,
            kind,
            gap: Duration::from_secs(5),
            faults: specs.iter().map(|s| parse(s).unwrap()).collect(),
        }
    }

    fn step(t: f64, node: u32, local_rank: u32, step: u64) -> Step {
        Step {
            t,
            node,
            local_rank,
            step,
        }
    }

    fn hit(spec: &str) -> Entry {
        Entry::FaultHit {
            fault: parse(spec).unwrap(),
            what: String::new(),
        }
    }

    fn resumed() -> Entry {
        Entry::Running {
            workers: 2,
            restart_count: Some(1),
            resumed: Some(Resumed {
                without_gang_ds: 10,
                committed: None,
            }),
        }
    }

    #[test]
    fn a_crash_is_measured_from_the_strike_to_every_ranks_next_step() {
        let s = [strike(1, Kind::KillRank, &["kill-rank:1@5"])];
        let e = [
            hit("kill-rank:1@5"),
            Entry::Stopped { workers: 2 },
            Entry::Formed {
                generation: 1,
                restarts: 1,
                again: true,
            },
            resumed(),
        ];
        let entries: Vec<(f64, &Entry)> = [10.0, 10.5, 11.0, 12.0].into_iter().zip(&e).collect();
        let steps = [
            step(9.0, 0, 0, 100),
            step(9.0, 0, 1, 100),
            step(9.9, 0, 0, 120),
            step(9.9, 0, 1, 120),
            // The next gang resumes from the checkpoint at step 80.
            step(13.0, 0, 1, 81),
            step(13.5, 0, 0, 83),
        ];
        let r = build(&Inputs {
            seed: 1,
            bound: Duration::from_secs(60),
            strikes: &s,
            entries: &entries,
            steps: &steps,
            world: 2,
            job_code: 0,
            end: 30.0,
        });
        let o = &r.outcomes[0];
        assert_eq!(o.verdict, Verdict::Recovered);
        assert!((o.recovery.unwrap() - 3.5).abs() < 1e-9);
        assert_eq!(
            (o.reached, o.resumed_at, o.steps_lost),
            (Some(120), Some(81), Some(40))
        );
        assert_eq!(o.reaction, "gang re-formed, gang restarted");
        assert_eq!(r.exit_code(), 0);
        assert!(
            o.line()
                .contains("40 steps lost (reached 120, resumed at 81)"),
            "{}",
            o.line()
        );
        assert!(
            r.advice()[0].starts_with(
                "each crash cost a median of 40 steps: the script resumes from its last \
                 checkpoint; it resumed after step 80;"
            ),
            "{:?}",
            r.advice()
        );
        let mut more = r.clone();
        for (resumed_at, lost) in [(101, 12), (161, 7)] {
            let mut o = more.outcomes[0].clone();
            o.resumed_at = Some(resumed_at);
            o.steps_lost = Some(lost);
            more.outcomes.push(o);
        }
        assert!(
            more.advice()[0].contains(
                "your script seems to save every 20 steps (it resumed after steps 80, 100, 160)"
            ),
            "{:?}",
            more.advice()
        );
        assert!(
            r.totals().contains("kill-rank 40 (1 strike(s))"),
            "{}",
            r.totals()
        );
        // With snapshots every 50 steps, 40 is what they promise (at most 51): nothing to say;
        // every 5, 40 is far over 6, and the advice says why it may be.
        let snapshots = |every| Report {
            snapshot_every: Some(every),
            ..r.clone()
        };
        assert!(
            snapshots(50).advice().is_empty(),
            "{:?}",
            snapshots(50).advice()
        );
        let advice = snapshots(5).advice();
        assert!(
            advice[0].contains(
                "though the agents take snapshots every 5 steps: a crash should cost at most 6"
            ),
            "{advice:?}"
        );
    }

    #[test]
    fn a_slow_or_missing_recovery_fails_the_run_and_a_missed_strike_says_why() {
        let s = [
            strike(1, Kind::Kill, &["kill:1@5"]),
            strike(2, Kind::Term, &["term:0@9"]),
        ];
        let e = [
            hit("kill:1@5"),
            Entry::Stopped { workers: 2 },
            Entry::FaultMissed {
                fault: parse("term:0@9").unwrap(),
                why: "the job ended first".into(),
            },
        ];
        let entries: Vec<(f64, &Entry)> = [10.0, 10.5, 300.0].into_iter().zip(&e).collect();
        let steps = [step(9.0, 0, 0, 10), step(9.0, 1, 0, 10)];
        let r = build(&Inputs {
            seed: 1,
            bound: Duration::from_secs(60),
            strikes: &s,
            entries: &entries,
            steps: &steps,
            world: 2,
            job_code: 0,
            end: 300.0,
        });
        assert_eq!(r.outcomes[0].verdict, Verdict::NotRecovered);
        assert_eq!(
            r.outcomes[1].verdict,
            Verdict::NotInjected("the job ended first".into())
        );
        assert_eq!(r.exit_code(), super::super::NOT_RECOVERED);
        assert!(r
            .verdict()
            .contains("1 strike(s) were not recovered within 60 s"));
        assert_eq!(r.injected(), 1);
    }

    #[test]
    fn a_preemption_is_not_recovered_while_its_ranks_step_on_to_the_agreed_step() {
        let s = [strike(1, Kind::Term, &["term:2@5"])];
        let e = [
            hit("term:2@5"),
            Entry::Committed { step: 60 },
            Entry::Stopped { workers: 2 },
            resumed(),
        ];
        let steps = [
            step(9.9, 0, 0, 57),
            step(9.9, 1, 0, 57),
            step(10.2, 0, 0, 60),
            step(10.2, 1, 0, 60),
            step(20.0, 0, 0, 61),
            step(20.1, 1, 0, 61),
        ];
        let inputs = |entries: &[(f64, &Entry)]| {
            build(&Inputs {
                seed: 1,
                bound: Duration::from_secs(60),
                strikes: &s,
                entries,
                steps: &steps[..4],
                world: 2,
                job_code: 0,
                end: f64::INFINITY,
            })
        };
        // Seen while it runs: the commit, no stop yet.
        let so_far: Vec<(f64, &Entry)> = [10.0, 10.3].into_iter().zip(&e).collect();
        assert_eq!(inputs(&so_far).outcomes[0].recovery, None);
        let all: Vec<(f64, &Entry)> = [10.0, 10.3, 12.0, 19.0].into_iter().zip(&e).collect();
        let r = build(&Inputs {
            seed: 1,
            bound: Duration::from_secs(60),
            strikes: &s,
            entries: &all,
            steps: &steps,
            world: 2,
            job_code: 0,
            end: 30.0,
        });
        let o = &r.outcomes[0];
        assert!((o.recovery.unwrap() - 10.1).abs() < 1e-9);
        assert_eq!(
            (o.reached, o.resumed_at, o.steps_lost),
            (Some(60), Some(61), Some(0))
        );
    }

    #[test]
    fn a_frozen_rank_waited_out_loses_nothing_and_counts_from_its_release() {
        let s = [strike(1, Kind::StopRank, &["stop-rank:0@5"])];
        // The gang stops only at the job's end.
        let e = [hit("stop-rank:0@5"), Entry::Stopped { workers: 2 }];
        let entries: Vec<(f64, &Entry)> = vec![(10.0, &e[0]), (39.0, &e[1])];
        let hold = STOP_HOLD.as_secs_f64();
        let steps = [
            step(9.9, 0, 0, 50),
            step(9.9, 0, 1, 50),
            // The peer takes one more step before it blocks: not a recovery.
            step(10.1, 0, 1, 51),
            step(10.0 + hold + 0.2, 0, 0, 51),
            step(10.0 + hold + 0.3, 0, 1, 52),
        ];
        let r = build(&Inputs {
            seed: 1,
            bound: Duration::from_secs(60),
            strikes: &s,
            entries: &entries,
            steps: &steps,
            world: 2,
            job_code: 0,
            end: 40.0,
        });
        let o = &r.outcomes[0];
        assert_eq!(o.steps_lost, Some(0));
        assert!((o.recovery.unwrap() - (hold + 0.3)).abs() < 1e-9);
        assert_eq!(o.reaction, "none: the gang waited and went on");
        // A job that did not finish is the dry run's code whatever the strikes did.
        let failed = Report {
            job_code: 1,
            ..r.clone()
        };
        assert_eq!(failed.exit_code(), 1);
        assert!(failed.verdict().contains("did not finish: exit 1"));
    }

    #[test]
    fn a_run_that_injected_fewer_strikes_than_asked_is_not_a_pass() {
        let s = [
            strike(1, Kind::Kill, &["kill:1@5"]),
            strike(2, Kind::Term, &["term:0@9"]),
        ];
        // The job trained 11.2 s (from 20.4 s) and ended before the first strike was due.
        let mut r = build(&Inputs {
            seed: 42,
            bound: Duration::from_secs(120),
            strikes: &s,
            entries: &[],
            steps: &[step(21.0, 0, 0, 1), step(21.0, 1, 0, 1)],
            world: 2,
            job_code: 0,
            end: 31.6,
        });
        r.unfinished = Some(Unfinished {
            training_started: Some(20.4),
            next: 1,
            due: Some(52.0),
            interval: (Duration::from_secs(20), Duration::from_secs(40)),
            count: 2,
        });
        assert_eq!(r.injected(), 0);
        assert_eq!(r.exit_code(), super::super::NOT_INJECTED);
        let verdict = r.verdict();
        assert!(
            verdict
                .contains("only 0 of 2 strikes were injected (the job ended 11.2 s into training")
                && verdict.contains("before strike #1 was due at 52.0 s")
                && verdict.ends_with("exit 221"),
            "{verdict}"
        );
        assert!(!verdict.contains("every strike"), "{verdict}");
        let advice = r.advice().join("\n");
        assert!(
            advice.contains("2 strike(s) never came")
                && advice.contains("about 60 s of training at --chaos-interval 20:40")
                && advice.contains("--chaos-interval 0.9:1.8"),
            "{advice}"
        );
        // A target that was gone counts too, and is named.
        let missed = [Entry::FaultMissed {
            fault: parse("term:0@9").unwrap(),
            why: "node 0's agent was not running".into(),
        }];
        let entries: Vec<(f64, &Entry)> = vec![(30.0, &missed[0])];
        let r = build(&Inputs {
            seed: 42,
            bound: Duration::from_secs(120),
            strikes: &s[1..],
            entries: &entries,
            steps: &[],
            world: 2,
            job_code: 0,
            end: 40.0,
        });
        assert_eq!(r.exit_code(), super::super::NOT_INJECTED);
        assert!(
            r.verdict()
                .contains("#2 term: node 0's agent was not running"),
            "{}",
            r.verdict()
        );
        // A failed job keeps its own code.
        let failed = Report { job_code: 1, ..r };
        assert_eq!(failed.exit_code(), 1);
    }

    #[test]
    fn the_save_period_reads_the_scripts_saves_not_the_barriers() {
        let kill = strike(1, Kind::KillRank, &["kill-rank:1@5"]);
        let term = strike(2, Kind::Term, &["term:0@9"]);
        let outcome = |strike: &Strike, resumed_at: u64| Outcome {
            strike: strike.clone(),
            hit: Some(10.0),
            reaction: String::new(),
            recovery: Some(3.0),
            reached: Some(resumed_at + 30),
            resumed_at: Some(resumed_at),
            steps_lost: Some(30),
            verdict: Verdict::Recovered,
        };
        // The script saves every 100 steps; a preemption committed step 258 (resumed at 259),
        // and a crash after a later barrier commit resumed right after it.
        let r = Report {
            seed: 1,
            bound: Duration::from_secs(120),
            outcomes: vec![
                outcome(&kill, 101),
                outcome(&term, 259),
                outcome(&kill, 301),
                outcome(&kill, 413),
            ],
            job_code: 0,
            steps_seen: true,
            committed: vec![258, 412],
            end: 100.0,
            unfinished: None,
            snapshot_every: None,
        };
        assert_eq!(
            r.save_cadence(),
            "your script seems to save every 100 steps (it resumed after steps 100, 300)"
        );
    }
}
