//! What a restart cost, phase by phase (issue #41): from the moment this agent saw the attempt
//! end badly to every local rank's first step of the next attempt.
//!
//! The agent marks its own phases as the restart goes ([`AgentMarks`]: workers down, the gang's
//! verdict, the round formed, every rank started); the ranks' reports mark theirs
//! ([`RankMarks`]: inside `init_process_group`, back from it, the first step — the zero-code
//! reporter's `init`, `initdone` and step reports, or the checkpoint helper's). A phase ends
//! when the last local rank passed its mark: the gang steps again only when every rank does.
//!
//! What it does not cover: the detection itself. A crashed rank is reaped the moment it dies
//! (SIGCHLD), a hang is found after `--hang-timeout`, another node's failure reaches this node
//! through the store's generation; the time before this agent saw the fault is the watches',
//! whose limits say it.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

/// One phase of a restart, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RestartPhase {
    /// The attempt ended (a rank failed or hung, or the gang restarts) → this node's workers
    /// and their leftover processes are down.
    Stop,
    /// → the restart decided: the gang's verdict (its failure board, a lost member's
    /// consequence window) or the local budget.
    Decide,
    /// → the next round formed: the GPUs' release, the rendezvous round.
    Rendezvous,
    /// → every local rank started: a cold spawn, or the handover to its standby.
    Spawn,
    /// → every local rank inside `init_process_group`: the interpreter's start, imports, the
    /// script's own code before it.
    Startup,
    /// → every local rank back from `init_process_group`.
    InitProcessGroup,
    /// → every local rank reported its first step: the script's set-up (model, checkpoint
    /// load), then the step itself.
    FirstStep,
}

impl RestartPhase {
    pub const ALL: [RestartPhase; 7] = [
        RestartPhase::Stop,
        RestartPhase::Decide,
        RestartPhase::Rendezvous,
        RestartPhase::Spawn,
        RestartPhase::Startup,
        RestartPhase::InitProcessGroup,
        RestartPhase::FirstStep,
    ];

    /// The metric label and the name in the log line.
    pub fn as_str(self) -> &'static str {
        match self {
            RestartPhase::Stop => "stop",
            RestartPhase::Decide => "decide",
            RestartPhase::Rendezvous => "rendezvous",
            RestartPhase::Spawn => "spawn",
            RestartPhase::Startup => "startup",
            RestartPhase::InitProcessGroup => "init_process_group",
            RestartPhase::FirstStep => "first_step",
        }
    }

    /// Whether muster's own code runs the phase (the rest is the script's and torch's).
    pub fn is_musters(self) -> bool {
        matches!(
            self,
            RestartPhase::Stop
                | RestartPhase::Decide
                | RestartPhase::Rendezvous
                | RestartPhase::Spawn
        )
    }
}

/// The agent's marks of one restart, taken as it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentMarks {
    /// The attempt's supervision ended: a rank failed or hung, or a stop came from the gang.
    pub ended: Instant,
    /// The attempt's workers and leftovers are down.
    pub down: Instant,
    /// The restart was decided.
    pub decided: Instant,
    /// The next round formed.
    pub formed: Instant,
    /// Every local rank of the next attempt started.
    pub spawned: Instant,
}

/// The agent's marks up to the next round, carried into the next attempt, which adds the spawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restarted {
    pub ended: Instant,
    pub down: Instant,
    pub decided: Instant,
    pub formed: Instant,
}

impl Restarted {
    /// Every local rank started at `at`.
    pub fn spawned(self, at: Instant) -> AgentMarks {
        AgentMarks {
            ended: self.ended,
            down: self.down,
            decided: self.decided,
            formed: self.formed,
            spawned: at,
        }
    }
}

/// One local rank's marks from its reports in the next attempt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankMarks {
    pub init_entered: Option<Instant>,
    pub init_returned: Option<Instant>,
    pub first_step: Option<Instant>,
}

/// The restart's phases, once every one of `ranks` (the attempt's local ranks, `expected` of
/// them) reported a first step; `None` before. A rank that never called `init_process_group`
/// (its reports have no `init`) folds the start-up and the process group into the first step.
pub fn phases(
    agent: &AgentMarks,
    ranks: &[RankMarks],
    expected: usize,
) -> Option<Vec<(RestartPhase, Duration)>> {
    if ranks.len() < expected || expected == 0 {
        return None;
    }
    let last = |mark: fn(&RankMarks) -> Option<Instant>| -> Option<Instant> {
        ranks
            .iter()
            .map(mark)
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max()
    };
    let first_step = last(|r| r.first_step)?;
    let mut marks = vec![
        (RestartPhase::Stop, agent.down),
        (RestartPhase::Decide, agent.decided),
        (RestartPhase::Rendezvous, agent.formed),
        (RestartPhase::Spawn, agent.spawned),
    ];
    if let (Some(entered), Some(returned)) = (last(|r| r.init_entered), last(|r| r.init_returned)) {
        marks.push((RestartPhase::Startup, entered));
        marks.push((RestartPhase::InitProcessGroup, returned));
    }
    marks.push((RestartPhase::FirstStep, first_step));
    let mut from = agent.ended;
    Some(
        marks
            .into_iter()
            .map(|(phase, at)| {
                // Marks of different sources can cross (a rank's report read late); a phase
                // never counts negative, and the next starts where this one ended.
                let took = at.saturating_duration_since(from);
                from = from.max(at);
                (phase, took)
            })
            .collect(),
    )
}

/// One restart's cost, as the agent logs it and the dry run's timeline shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartCost {
    pub restart_count: u32,
    pub node_rank: u32,
    pub phases: Vec<(RestartPhase, Duration)>,
    /// Local ranks started in their standby, of how many.
    pub warm: usize,
    pub ranks: usize,
}

impl RestartCost {
    pub fn total(&self) -> Duration {
        self.phases.iter().map(|(_, d)| *d).sum()
    }

    /// The phases muster's own code runs.
    pub fn musters(&self) -> Duration {
        self.phases
            .iter()
            .filter(|(p, _)| p.is_musters())
            .map(|(_, d)| *d)
            .sum()
    }
}

/// The start of the line: the dry run's timeline recognises it.
pub const LINE_PREFIX: &str = "restart ";
/// What follows `restart R (node N)` in the line.
pub const LINE_MARK: &str = ": every local rank stepping again ";

impl fmt::Display for RestartCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{LINE_PREFIX}{} (node {}){LINE_MARK}{:.2} s after the attempt ended (muster's own share {:.2} s):",
            self.restart_count,
            self.node_rank,
            self.total().as_secs_f64(),
            self.musters().as_secs_f64(),
        )?;
        for (i, (phase, took)) in self.phases.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            write!(f, "{sep}{} {:.2} s", phase.as_str(), took.as_secs_f64())?;
            if *phase == RestartPhase::Spawn {
                write!(f, " ({} of {} warm)", self.warm, self.ranks)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(t0: Instant, n: u64) -> Instant {
        t0 + Duration::from_millis(n)
    }

    fn agent(t0: Instant) -> AgentMarks {
        AgentMarks {
            ended: t0,
            down: ms(t0, 10),
            decided: ms(t0, 30),
            formed: ms(t0, 130),
            spawned: ms(t0, 140),
        }
    }

    fn rank(t0: Instant, entered: u64, returned: u64, step: Option<u64>) -> RankMarks {
        RankMarks {
            init_entered: Some(ms(t0, entered)),
            init_returned: Some(ms(t0, returned)),
            first_step: step.map(|s| ms(t0, s)),
        }
    }

    #[test]
    fn every_phase_ends_with_the_last_local_rank_past_its_mark() {
        let t0 = Instant::now();
        let ranks = [
            rank(t0, 400, 600, Some(900)),
            rank(t0, 500, 650, Some(1000)),
        ];
        let got = phases(&agent(t0), &ranks, 2).unwrap();
        let want: Vec<(RestartPhase, Duration)> = [10, 20, 100, 10, 360, 150, 350]
            .into_iter()
            .zip(RestartPhase::ALL)
            .map(|(n, p)| (p, Duration::from_millis(n)))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn nothing_until_every_rank_stepped() {
        let t0 = Instant::now();
        let ranks = [rank(t0, 400, 600, Some(900)), rank(t0, 500, 650, None)];
        assert_eq!(phases(&agent(t0), &ranks, 2), None);
        // A rank that has not even reported is missing too.
        assert_eq!(phases(&agent(t0), &ranks[..1], 2), None);
        assert_eq!(phases(&agent(t0), &[], 0), None);
    }

    #[test]
    fn a_rank_without_init_process_group_folds_start_up_into_the_first_step() {
        let t0 = Instant::now();
        let ranks = [
            rank(t0, 400, 600, Some(900)),
            RankMarks {
                first_step: Some(ms(t0, 800)),
                ..RankMarks::default()
            },
        ];
        let got = phases(&agent(t0), &ranks, 2).unwrap();
        assert_eq!(got.len(), 5);
        assert_eq!(
            got[4],
            (RestartPhase::FirstStep, Duration::from_millis(760))
        );
    }

    #[test]
    fn crossed_marks_never_count_negative_and_the_total_is_the_span() {
        let t0 = Instant::now();
        // A rank's init mark read as earlier than the spawn mark.
        let ranks = [rank(t0, 100, 600, Some(900))];
        let got = phases(&agent(t0), &ranks, 1).unwrap();
        assert_eq!(got[4], (RestartPhase::Startup, Duration::ZERO));
        assert_eq!(
            got[5],
            (RestartPhase::InitProcessGroup, Duration::from_millis(460))
        );
        let cost = RestartCost {
            restart_count: 1,
            node_rank: 0,
            phases: got,
            warm: 1,
            ranks: 1,
        };
        assert_eq!(cost.total(), Duration::from_millis(900));
        assert_eq!(cost.musters(), Duration::from_millis(140));
    }

    #[test]
    fn the_line_names_every_phase_and_the_warm_starts() {
        let t0 = Instant::now();
        let ranks = [
            rank(t0, 400, 600, Some(900)),
            rank(t0, 500, 650, Some(1000)),
        ];
        let cost = RestartCost {
            restart_count: 2,
            node_rank: 1,
            phases: phases(&agent(t0), &ranks, 2).unwrap(),
            warm: 2,
            ranks: 2,
        };
        let line = cost.to_string();
        assert!(
            line.starts_with("restart 2 (node 1): every local rank stepping again 1.00 s after"),
            "{line}"
        );
        assert!(line.contains("muster's own share 0.14 s"), "{line}");
        assert!(line.contains("spawn 0.01 s (2 of 2 warm)"), "{line}");
        for phase in RestartPhase::ALL {
            assert!(line.contains(phase.as_str()), "{line}");
        }
    }
}
