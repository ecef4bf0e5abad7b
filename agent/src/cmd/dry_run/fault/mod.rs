//! Fault rehearsal for `muster dry-run`: `--fault KIND:TARGET@SECS` (repeatable) and
//! `--replace-after SECS` inject a preemption, a lost node or a crashed rank into the local
//! N-node run, so the recovery a job relies on is rehearsed on a laptop before GPU hours are
//! spent on it.
//!
//! The parts, each with one job:
//! - [`spec`]: one `--fault` value, parsed and checked against the job's size.
//! - [`args`]: the dry run's own flags, taken out of the command line before the rest goes to
//!   every agent unchanged.
//! - [`schedule`]: which fault or replacement is due, a pure function of the clock.
//! - [`rehearsal`]: the effects: signals to an agent or a worker, which node to replace, what
//!   the timeline records; the dry run asks it once per [`SAMPLE_INTERVAL`] and spawns agents.
//! - [`procs`]: the workers each agent runs, read from `/proc` (their rank from their
//!   environment): how `kill-rank` finds its target and how the timeline sees a gang stop and
//!   resume, whatever the agents log.
//!
//! The dry run ([`crate::cmd::dry_run`]) does the effects (signals, spawning a replacement) and feeds
//! what it observes to [`crate::cmd::dry_run::timeline`].
//!
//! `--chaos` ([`crate::cmd::dry_run::chaos`]) uses the same machinery: its strikes are added as
//! they come due ([`Rehearsal::strike`]), `stop-rank` freezes a worker for [`spec::STOP_HOLD`], and
//! [`Options::job_like`] replaces agents as a Job's `podFailurePolicy` would.

pub mod args;
pub mod procs;
pub mod rehearsal;
pub mod schedule;
pub mod spec;

use std::time::Duration;

/// How often the workers are sampled and due faults injected: the timeline's resolution. A walk
/// of `/proc` costs a few milliseconds, so ten a second stays cheap on a loaded laptop.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(100);

pub use args::{split, DRY_RUN_FLAGS};
pub use rehearsal::Rehearsal;
pub use spec::{Fault, Kind, SpecError};

/// The dry run's fault options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// In command-line order.
    pub faults: Vec<Fault>,
    /// After a `kill` fault, start the node's replacement agent this much later; `None`: the
    /// node stays lost.
    pub replace_after: Option<Duration>,
    /// `--spares N`: agents started as pods beyond `--nnodes MAX` (node indexes MAX..MAX+N).
    pub spares: u32,
    /// The `--chaos` flags as given.
    pub chaos: crate::cmd::dry_run::chaos::Args,
    /// Replace agents as a Job with muster's `podFailurePolicy` would (`--chaos`): also one that
    /// exited preempted (200, 201) or after losing the store host (205), not only a killed one.
    pub job_like: bool,
}

impl Options {
    /// Whether anything is to be injected (and so whether a timeline is kept).
    pub fn is_empty(&self) -> bool {
        self.faults.is_empty()
    }

    /// Checks every fault against a job of `nnodes` nodes and at most `world` workers, and that
    /// `--replace-after` has a killed agent to replace.
    pub fn check(&self, nnodes: u32, world: u32) -> Result<(), SpecError> {
        for fault in &self.faults {
            spec::check(fault, nnodes, world)?;
        }
        if self.replace_after.is_some()
            && !self.job_like
            && !self.faults.iter().any(|f| f.kind == Kind::Kill)
        {
            return Err(SpecError::NothingToReplace);
        }
        Ok(())
    }
}

/// The codes that make the job's: a node a fault killed for good (no replacement) rehearsed a
/// loss, so its own 137 is not the job's outcome; the survivors' codes are. When every node was
/// lost, theirs are all there is.
pub fn counted_codes(codes: &[u8], lost: &[bool]) -> Vec<u8> {
    let kept: Vec<u8> = codes
        .iter()
        .zip(lost.iter().chain(std::iter::repeat(&false)))
        .filter(|(_, lost)| !**lost)
        .map(|(code, _)| *code)
        .collect();
    if kept.is_empty() {
        codes.to_vec()
    } else {
        kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(specs: &[&str], replace_after: Option<u64>) -> Options {
        Options {
            faults: specs.iter().map(|s| spec::parse(s).unwrap()).collect(),
            replace_after: replace_after.map(Duration::from_secs),
            ..Options::default()
        }
    }

    #[test]
    fn replace_after_needs_a_kill() {
        assert_eq!(opts(&["kill:0@1"], Some(3)).check(3, 6), Ok(()));
        assert_eq!(
            opts(&["term:0@1"], Some(3)).check(3, 6),
            Err(SpecError::NothingToReplace)
        );
        assert_eq!(opts(&["term:0@1"], None).check(3, 6), Ok(()));
        assert!(matches!(
            opts(&["term:0@1", "kill:5@2"], None).check(3, 6),
            Err(SpecError::NoSuchNode { node: 5, .. })
        ));
    }

    #[test]
    fn a_node_lost_for_good_does_not_make_the_job_code() {
        assert_eq!(counted_codes(&[137, 0, 0], &[true, false, false]), [0, 0]);
        assert_eq!(
            counted_codes(&[137, 205, 205], &[true, false, false]),
            [205, 205]
        );
        assert_eq!(counted_codes(&[0, 0], &[false, false]), [0, 0]);
        assert_eq!(counted_codes(&[137], &[true]), [137]);
        assert_eq!(counted_codes(&[1, 2], &[]), [1, 2]);
    }
}
