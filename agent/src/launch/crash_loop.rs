//! The crash-loop guard (`--max-no-progress-restarts`): a pure decision over what each failed
//! attempt got done.
//!
//! A script with a deterministic bug (a rank that raises at step 3 on every attempt) would
//! otherwise spend the whole `--max-restarts` budget — each restart a full gang restart that
//! re-imports torch on every rank — and long jobs set that budget high. An attempt made
//! **progress** when its ranks reported a step beyond the last step the previous reporting
//! attempt reached (the checkpoint helper's `should_save(step)` or the zero-code reporter's
//! optimizer steps). A restart after an attempt without progress counts; after
//! `--max-no-progress-restarts` of them in a row the job ends with
//! [`crate::exit_code::NO_PROGRESS`] (209), naming the failure that kept repeating. Any
//! progress resets the count.
//!
//! The first attempt has no previous one: any step it reported is progress. An attempt whose
//! ranks reported no step at all made no visible progress and counts — that is the script that
//! fails on import or in its data loader before its first step — unless no attempt of the job
//! ever reported a step and this one ran longer than [`SILENT_JOB_GRACE`]: such a script reports
//! no steps at all (no helper, reporter off), and an hours-long attempt of it is not a loop.
//!
//! In a gang every node records every restart: a failure restart counts on every node, whichever
//! node's rank failed, so nodes failing in turn are one crash loop with one count, and the node
//! whose failure reaches the limit ends the job for all; a membership change (a lost node, and a
//! rank failure that was its consequence) counts nowhere, though its progress starts the count
//! over.
//!
//! A committed checkpoint is progress too; the only checkpoint the agent sees committed is the
//! preemption barrier's, which ends the run instead of restarting it, so steps decide here.

use std::time::Duration;

/// Default `--max-no-progress-restarts`: three restarts in a row that got nowhere. Enough to
/// ride out a flaky node or a transient store error twice over, few enough that a deterministic
/// bug costs three gang restarts, not the whole budget (NVIDIA's ft_launcher uses 3 as well).
pub const DEFAULT_MAX_NO_PROGRESS_RESTARTS: u32 = 3;

/// How long an attempt of a job that never reported a step must run before its failure is no
/// longer taken for a crash loop (see the module's doc).
pub const SILENT_JOB_GRACE: Duration = Duration::from_secs(600);

/// What one failed attempt got done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptProgress {
    /// The highest step any local rank reported during the attempt.
    pub max_step: Option<u64>,
    /// How long the attempt's workers ran.
    pub ran_for: Duration,
}

/// What follows a failed attempt, as far as the guard is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The attempt made progress (or the guard is off): the count starts over.
    Progress,
    /// No progress: the `streak`th restart in a row without any; still under the limit.
    NoProgress { streak: u32 },
    /// The limit is reached: end the job with 209.
    Stop,
}

/// The guard's memory across attempts.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// `--max-no-progress-restarts`; 0 turns the guard off.
    limit: u32,
    streak: u32,
    /// The last step the most recent reporting attempt reached.
    baseline: Option<u64>,
    ever_reported: bool,
}

impl Guard {
    pub fn new(limit: u32) -> Self {
        Self {
            limit,
            ..Self::default()
        }
    }

    fn progressed(&self, attempt: AttemptProgress) -> bool {
        match (attempt.max_step, self.baseline) {
            (Some(step), Some(before)) => step > before,
            (Some(_), None) => true,
            (None, _) => !self.ever_reported && attempt.ran_for >= SILENT_JOB_GRACE,
        }
    }

    /// What counting `attempt` as a failure restart would decide, and why; changes nothing (the
    /// launch asks before the rendezvous says whether the restart counts at all).
    pub fn judge(&self, attempt: AttemptProgress) -> (Verdict, String) {
        let reached = attempt.max_step.map_or_else(
            || "no step reported".to_owned(),
            |s| format!("last step {s}"),
        );
        let before = self
            .baseline
            .map_or_else(|| "none".to_owned(), |s| s.to_string());
        if self.limit == 0 || self.progressed(attempt) {
            return (
                Verdict::Progress,
                format!("the attempt made progress ({reached}; before: {before})"),
            );
        }
        let streak = self.streak + 1;
        let reason = format!(
            "no progress ({reached}; the previous attempt reached {before}): {streak} of {} restarts without progress",
            self.limit
        );
        if streak >= self.limit {
            (Verdict::Stop, reason)
        } else {
            (Verdict::NoProgress { streak }, reason)
        }
    }

    /// Records a restarted attempt: `counts` for a failure restart (this node's or another
    /// node's: every node keeps the gang's one count), not for a membership change. Progress
    /// starts the count over either way, and the attempt's steps become the baseline. Returns
    /// the warning when a restart without progress was counted.
    pub fn record(&mut self, attempt: AttemptProgress, counts: bool) -> Option<String> {
        let (verdict, reason) = self.judge(attempt);
        if let Some(step) = attempt.max_step {
            self.baseline = Some(step);
            self.ever_reported = true;
        }
        match verdict {
            Verdict::Progress => {
                self.streak = 0;
                None
            }
            Verdict::NoProgress { .. } | Verdict::Stop if counts => {
                self.streak += 1;
                Some(reason)
            }
            Verdict::NoProgress { .. } | Verdict::Stop => None,
        }
    }
}

/// The message a crash loop ends the job with: the limit and the failure that kept repeating.
pub fn stop_message(limit: u32, failure: &str, last_step: Option<u64>) -> String {
    let step = last_step.map_or_else(
        || "before reporting any step".to_owned(),
        |s| format!("by step {s}"),
    );
    format!(
        "crash loop: {limit} restart(s) in a row made no progress, each attempt failing {step}; the repeated failure: {failure}; stopping (--max-no-progress-restarts {limit}, exit 209)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Judges a failure restart of `attempt`, then records it.
    fn fail(g: &mut Guard, attempt: AttemptProgress) -> (Verdict, String) {
        let out = g.judge(attempt);
        g.record(attempt, true);
        out
    }

    fn at(step: Option<u64>) -> AttemptProgress {
        AttemptProgress {
            max_step: step,
            ran_for: Duration::from_secs(20),
        }
    }

    #[test]
    fn a_rank_failing_at_the_same_step_stops_after_the_limit() {
        let mut g = Guard::new(3);
        // Attempt 0 reached step 3 from nothing: progress.
        assert_eq!(fail(&mut g, at(Some(3))).0, Verdict::Progress);
        assert_eq!(
            fail(&mut g, at(Some(3))).0,
            Verdict::NoProgress { streak: 1 }
        );
        assert_eq!(
            fail(&mut g, at(Some(2))).0,
            Verdict::NoProgress { streak: 2 }
        );
        // Measured against the previous attempt, not the best one.
        let (verdict, reason) = fail(&mut g, at(Some(2)));
        assert_eq!(verdict, Verdict::Stop);
        assert!(
            reason.contains("last step 2; the previous attempt reached 2): 3 of 3"),
            "{reason}"
        );
    }

    #[test]
    fn progress_starts_the_count_over() {
        let mut g = Guard::new(2);
        fail(&mut g, at(Some(10)));
        assert_eq!(
            fail(&mut g, at(Some(10))).0,
            Verdict::NoProgress { streak: 1 }
        );
        assert_eq!(fail(&mut g, at(Some(11))).0, Verdict::Progress);
        assert_eq!(
            fail(&mut g, at(Some(11))).0,
            Verdict::NoProgress { streak: 1 }
        );
        assert_eq!(fail(&mut g, at(Some(5))).0, Verdict::Stop);
    }

    #[test]
    fn an_attempt_without_steps_counts_once_the_job_is_known_to_report() {
        let mut g = Guard::new(2);
        fail(&mut g, at(Some(4)));
        // Dies on import now: nothing reported, no progress.
        assert_eq!(fail(&mut g, at(None)).0, Verdict::NoProgress { streak: 1 });
        // The baseline stays the last reported step.
        assert_eq!(fail(&mut g, at(Some(4))).0, Verdict::Stop);
    }

    #[test]
    fn a_job_that_never_reports_counts_only_short_attempts() {
        let mut g = Guard::new(2);
        assert_eq!(fail(&mut g, at(None)).0, Verdict::NoProgress { streak: 1 });
        let long = AttemptProgress {
            max_step: None,
            ran_for: SILENT_JOB_GRACE,
        };
        assert_eq!(fail(&mut g, long).0, Verdict::Progress);
        assert_eq!(fail(&mut g, at(None)).0, Verdict::NoProgress { streak: 1 });
        assert_eq!(fail(&mut g, at(None)).0, Verdict::Stop);
    }

    #[test]
    fn a_membership_change_moves_the_baseline_without_counting() {
        let mut g = Guard::new(2);
        fail(&mut g, at(Some(3)));
        assert_eq!(
            fail(&mut g, at(Some(3))).0,
            Verdict::NoProgress { streak: 1 }
        );
        // The gang lost a member this time, at step 3 again: no count, no reset.
        g.record(at(Some(3)), false);
        assert_eq!(fail(&mut g, at(Some(3))).0, Verdict::Stop);
        let mut g = Guard::new(2);
        fail(&mut g, at(Some(3)));
        fail(&mut g, at(Some(3)));
        // Progress seen through a membership change starts over.
        g.record(at(Some(9)), false);
        assert_eq!(
            fail(&mut g, at(Some(9))).0,
            Verdict::NoProgress { streak: 1 }
        );
    }

    #[test]
    fn zero_turns_the_guard_off() {
        let mut g = Guard::new(0);
        for _ in 0..10 {
            assert_eq!(fail(&mut g, at(Some(1))).0, Verdict::Progress);
        }
    }

    #[test]
    fn the_stop_message_names_the_failure() {
        let text = stop_message(3, "rank 1 failed (exit code 1)", Some(3));
        assert!(text.starts_with("crash loop: 3 restart(s) in a row made no progress, each attempt failing by step 3; the repeated failure: rank 1 failed (exit code 1);"), "{text}");
    }
}
