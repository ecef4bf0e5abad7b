//! When each fault and each replacement is due: a pure function of the clock and of the moment
//! the gang first ran, so the rules are tested without processes or sleeps.
//!
//! A fault's clock starts at the first worker output after every worker of the first generation
//! joined its process group ([`crate::cmd::dry_run::timeline::Timeline::clock`]): agent and torch start-up
//! then do not move it, however loaded the machine. A fault is done once it was
//! injected or could not be (its agent had exited); a `kill-rank` whose worker is not running at
//! that moment (the gang is between generations) stays due until one is. A `kill` schedules the
//! node's replacement `--replace-after` later.

use std::time::Duration;

use tokio::time::Instant;

use super::spec::Fault;

/// Something due now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Fault number `index` (command-line order) is due.
    Fault { index: usize, fault: Fault },
    /// Node `node`'s replacement agent is to start now.
    Replace { node: u32 },
}

/// The faults still to inject and the replacements still to start.
#[derive(Debug)]
pub struct Schedule {
    faults: Vec<Fault>,
    done: Vec<bool>,
    replace_after: Option<Duration>,
    replacements: Vec<(Instant, u32)>,
    /// The run is stopping: nothing is due any more.
    cancelled: bool,
}

impl Schedule {
    pub fn new(faults: Vec<Fault>, replace_after: Option<Duration>) -> Self {
        let done = vec![false; faults.len()];
        Self {
            faults,
            done,
            replace_after,
            replacements: Vec::new(),
            cancelled: false,
        }
    }

    /// What is due at `now`, the gang having first run at `since` (`None`: not yet, and no
    /// fault is due). Replacements come out once; faults stay due until [`Self::done`].
    pub fn due(&mut self, now: Instant, since: Option<Instant>) -> Vec<Due> {
        let mut due: Vec<Due> = Vec::new();
        if self.cancelled {
            return due;
        }
        if let Some(since) = since {
            due.extend(
                self.faults
                    .iter()
                    .zip(&self.done)
                    .enumerate()
                    .filter(|(_, (f, done))| !**done && since + f.at <= now)
                    .map(|(index, (fault, _))| Due::Fault {
                        index,
                        fault: *fault,
                    }),
            );
        }
        let (ready, later): (Vec<_>, Vec<_>) =
            self.replacements.iter().partition(|(at, _)| *at <= now);
        self.replacements = later;
        due.extend(ready.into_iter().map(|(_, node)| Due::Replace { node }));
        due
    }

    /// One more fault (a chaos strike, whose time is known only when it comes).
    pub fn add(&mut self, fault: Fault) {
        self.faults.push(fault);
        self.done.push(false);
    }

    /// Fault `index` was injected, or cannot be: it is not due again.
    pub fn done(&mut self, index: usize) {
        if let Some(d) = self.done.get_mut(index) {
            *d = true;
        }
    }

    /// Node `node`'s agent was killed at `now`: its replacement is due `--replace-after` later.
    /// Returns whether one will start.
    pub fn killed(&mut self, node: u32, now: Instant) -> bool {
        match self.replace_after {
            Some(after) => {
                self.replacements.push((now + after, node));
                true
            }
            None => false,
        }
    }

    /// A replacement is still to start: the dry run is not over even if every agent exited.
    pub fn replacement_pending(&self) -> bool {
        !self.replacements.is_empty()
    }

    /// The run is stopping: nothing more is injected or started.
    pub fn cancel(&mut self) {
        self.replacements.clear();
        self.cancelled = true;
    }

    /// The faults never injected (the job ended, or was stopped, first).
    pub fn undone(&self) -> Vec<Fault> {
        self.faults
            .iter()
            .zip(&self.done)
            .filter(|(_, done)| !**done)
            .map(|(f, _)| *f)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::parse;
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn faults(specs: &[&str]) -> Vec<Fault> {
        specs.iter().map(|s| parse(s).unwrap()).collect()
    }

    #[test]
    fn nothing_is_due_before_the_gang_first_runs() {
        let t0 = Instant::now();
        let mut s = Schedule::new(faults(&["kill:0@0"]), None);
        assert_eq!(s.due(t0 + secs(100), None), []);
        assert_eq!(s.due(t0, Some(t0)).len(), 1);
    }

    #[test]
    fn faults_fall_due_at_their_time_and_stay_due_until_done() {
        let t0 = Instant::now();
        let f = faults(&["term:1@10", "kill-rank:3@5"]);
        let mut s = Schedule::new(f.clone(), None);
        assert_eq!(s.due(t0 + secs(4), Some(t0)), []);
        assert_eq!(
            s.due(t0 + secs(5), Some(t0)),
            [Due::Fault {
                index: 1,
                fault: f[1]
            }]
        );
        // Its worker was not running: still due.
        assert_eq!(s.due(t0 + secs(6), Some(t0)).len(), 1);
        s.done(1);
        assert_eq!(s.due(t0 + secs(9), Some(t0)), []);
        assert_eq!(
            s.due(t0 + secs(10), Some(t0)),
            [Due::Fault {
                index: 0,
                fault: f[0]
            }]
        );
        s.done(0);
        assert_eq!(s.undone(), []);
    }

    #[test]
    fn a_kill_schedules_its_replacement_once() {
        let t0 = Instant::now();
        let mut s = Schedule::new(faults(&["kill:0@1"]), Some(secs(3)));
        s.done(0);
        assert!(s.killed(0, t0 + secs(1)));
        assert!(s.replacement_pending());
        assert_eq!(s.due(t0 + secs(3), Some(t0)), []);
        assert_eq!(s.due(t0 + secs(4), Some(t0)), [Due::Replace { node: 0 }]);
        assert!(!s.replacement_pending());
        assert_eq!(s.due(t0 + secs(5), Some(t0)), []);

        let mut lost = Schedule::new(faults(&["kill:2@1"]), None);
        assert!(!lost.killed(2, t0));
        assert!(!lost.replacement_pending());
    }

    #[test]
    fn a_stop_cancels_what_is_left() {
        let t0 = Instant::now();
        let mut s = Schedule::new(faults(&["kill:0@1", "term:1@50"]), Some(secs(3)));
        s.done(0);
        s.killed(0, t0);
        assert_eq!(s.undone(), faults(&["term:1@50"]));
        s.cancel();
        assert!(!s.replacement_pending());
        assert_eq!(s.due(t0 + secs(60), Some(t0)), []);
        assert_eq!(s.undone(), faults(&["term:1@50"]));
    }
}
