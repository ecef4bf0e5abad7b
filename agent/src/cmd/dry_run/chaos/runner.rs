//! The chaos run as it goes: each sample it reads the step reports and, when the strike before
//! was recovered (or its bound passed) and the next one's gap is over, hands the next strike's
//! faults to the rehearsal, which injects them. At the end it gives the strikes as they were
//! injected to the report.
//!
//! Recovery is decided the way the report measures it ([`super::report`]), on what was observed
//! so far, so a strike never lands on a gang still recovering from the one before: each figure
//! is one strike's alone.

use tokio::time::Instant;

use super::plan::Strike;
use super::report::{self, Step, Verdict};
use super::steps::Steps;
use super::Settings;
use crate::cmd::dry_run::fault::Rehearsal;

/// One chaos run.
#[derive(Debug)]
pub struct Runner {
    pub settings: Settings,
    /// The plan; a struck one's faults carry the time they were injected.
    strikes: Vec<Strike>,
    /// Every rank of the job.
    world: usize,
    steps: Steps,
    /// When the agents started: the report's seconds count from here.
    started: Instant,
    /// How many strikes were handed to the rehearsal, and when the last one was.
    struck: usize,
    last_struck_at: Option<Instant>,
    /// When training was first under way (the faults' clock), and when the next strike is due
    /// (its gap begun): the report says what the job ended before.
    training_started: Option<Instant>,
    next_due: Option<Instant>,
    /// The agents' `--snapshot-every`: what a crash should cost.
    snapshot_every: Option<u64>,
}

impl Runner {
    pub fn new(settings: Settings, strikes: Vec<Strike>, world: usize, started: Instant) -> Self {
        Self {
            settings,
            strikes,
            world,
            steps: Steps::default(),
            started,
            struck: 0,
            last_struck_at: None,
            training_started: None,
            next_due: None,
            snapshot_every: None,
        }
    }

    /// The agents take in-memory snapshots every `every` steps.
    #[must_use]
    pub fn with_snapshots(mut self, every: Option<u64>) -> Self {
        self.snapshot_every = every;
        self
    }

    /// An agent message of node `node` (its metrics address).
    pub fn agent_message(&mut self, node: u32, msg: &str) {
        self.steps.learn(node, msg);
    }

    /// One sample: the step reports, then the next strike if it is due.
    pub fn tick(&mut self, now: Instant, rehearsal: &mut Rehearsal) {
        self.steps.sample(now);
        let Some(next) = self.strikes.get(self.struck) else {
            return;
        };
        let clock = rehearsal.clock(now);
        self.training_started = self.training_started.or(clock);
        let since = match self.last_struck_at {
            None => clock,
            Some(at) => self.settled(now, at, rehearsal),
        };
        self.next_due = since.map(|since| since + next.gap);
        if since.is_some_and(|since| now >= since + next.gap) {
            let faults = next.faults.clone();
            let struck = rehearsal.strike(now, &faults);
            if let Some(strike) = self.strikes.get_mut(self.struck) {
                strike.faults = struck;
            }
            self.struck += 1;
            self.last_struck_at = Some(now);
            self.next_due = None;
        }
    }

    /// When the last strike (handed over at `struck_at`) was recovered from, or its bound
    /// passed, or it could not be injected; `None` while none of that happened.
    fn settled(&self, now: Instant, struck_at: Instant, rehearsal: &Rehearsal) -> Option<Instant> {
        let bound_over = struck_at + self.settings.recovery_bound;
        let last = self.struck.checked_sub(1)?;
        let strike = self.strikes.get(last)?;
        let entries = rehearsal.timeline().entries();
        let steps = self.step_list();
        let built = report::build(&report::Inputs {
            seed: self.settings.seed,
            bound: self.settings.recovery_bound,
            strikes: std::slice::from_ref(strike),
            entries: &entries,
            steps: &steps,
            world: self.world,
            job_code: 0,
            end: f64::INFINITY,
        });
        let outcome = built.outcomes.first()?;
        match (&outcome.verdict, outcome.hit, outcome.recovery) {
            (Verdict::Recovered, Some(hit), Some(recovery)) => {
                Some(self.started + std::time::Duration::from_secs_f64(hit + recovery))
            }
            // Missed (its target was gone): the next gap counts from the attempt.
            (_, None, _)
                if entries.iter().any(|(_, e)| {
                    matches!(e, crate::cmd::dry_run::timeline::Entry::FaultMissed { fault, .. }
                    if strike.faults.contains(fault))
                }) =>
            {
                Some(struck_at)
            }
            _ => (now >= bound_over).then_some(bound_over),
        }
    }

    fn step_list(&self) -> Vec<Step> {
        self.steps
            .samples()
            .iter()
            .map(|s| Step::of(s, self.started))
            .collect()
    }

    /// The report, once the run is over.
    pub fn report(
        &self,
        entries: &[(f64, &crate::cmd::dry_run::timeline::Entry)],
        job_code: u8,
        ended: Instant,
    ) -> report::Report {
        let steps = self.step_list();
        let secs = |at: Instant| at.saturating_duration_since(self.started).as_secs_f64();
        let mut report = report::build(&report::Inputs {
            seed: self.settings.seed,
            bound: self.settings.recovery_bound,
            strikes: &self.strikes,
            entries,
            steps: &steps,
            world: self.world,
            job_code,
            end: secs(ended),
        });
        report.snapshot_every = self.snapshot_every;
        if self.struck < self.strikes.len() {
            report.unfinished = Some(report::Unfinished {
                training_started: self.training_started.map(secs),
                next: self.struck + 1,
                due: self.next_due.map(secs),
                interval: self.settings.interval,
                count: self.strikes.len(),
            });
        }
        report
    }
}
