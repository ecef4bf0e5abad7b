//! The hang decision before a rank's first step (`--startup-timeout`): the step watch
//! ([`super::hang`]) starts at a rank's first step report, so a rank stuck while its process
//! group forms would otherwise wait for torch's store timeout (30 minutes by default).
//!
//! Muster's zero-code reporter says when a rank enters `torch.distributed.init_process_group`
//! (`init`) and when it returns (`initdone`). A rank is hung before its first step when
//! - it has been inside `init_process_group` longer than the limit, or
//! - its group formed (it returned) but it reported no step, while another local rank has been
//!   stepping for longer than the limit and its own stack did not move (`alive`) meanwhile.
//!
//! A rank that never calls `init_process_group` is never watched here (an inference script, a
//! data preparation job): nothing in its silence says that it waits for anyone.
//!
//! Who is the cause: every rank waits inside `init_process_group` for the one that does not
//! arrive. A rank the kernel shows stopped (state `T`, SIGSTOP or a debugger) is named first;
//! then, as for step hangs, a rank not waiting inside `torch.distributed`.

use std::time::Duration;

use tokio::time::Instant;

// The startup watch builds on the hang watch's view of the ranks; the stall phase and the
// default limit live there too, so that the two never import each other.
use super::hang::{pick_culprit, RankView, Stall, Waiting};
pub use super::hang::{Phase, DEFAULT_STARTUP_TIMEOUT as DEFAULT_TIMEOUT};

/// Since when `rank` has been stuck before its first step, and where; `None` when it is not
/// watched (it stepped, exited, or never entered `init_process_group`).
fn stuck_since(rank: &RankView, all: &[RankView]) -> Option<(Phase, Instant)> {
    if rank.exited || rank.steps_seen > 0 {
        return None;
    }
    let entered = rank.init_entered?;
    let Some(returned) = rank.init_returned.filter(|r| *r >= entered) else {
        return Some((Phase::Init, entered));
    };
    let peers_stepping = all
        .iter()
        .filter(|r| r.local_rank != rank.local_rank)
        .filter_map(|r| r.first_step)
        .min()?;
    // Its stack moving (the reporter's `alive`) is work, not a wait: a rank that prepares data
    // at length before its first step is not stuck.
    let since = returned.max(peers_stepping);
    Some((
        Phase::FirstStep,
        rank.last_progress.map_or(since, |p| p.max(since)),
    ))
}

/// The rank stuck longest before its first step, if one passed `limit`.
pub fn decide(limit: Duration, ranks: &[RankView], now: Instant) -> Option<Stall> {
    ranks
        .iter()
        .filter_map(|r| {
            let (phase, since) = stuck_since(r, ranks)?;
            let stalled = now.saturating_duration_since(since);
            (stalled > limit).then(|| stall(r, Some(phase), stalled, limit))
        })
        .max_by_key(|s| s.stalled)
}

fn stall(rank: &RankView, phase: Option<Phase>, stalled: Duration, limit: Duration) -> Stall {
    Stall {
        local_rank: rank.local_rank,
        rank: rank.rank,
        last_step: rank.step,
        stalled,
        limit,
        section: None,
        startup: Some(phase.unwrap_or(Phase::Init)),
        working: false,
    }
}

/// A live local rank without a step, as the culprit search sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub stall: Stall,
    pub waiting: Waiting,
    /// Its process is stopped (state `T` in `/proc/<pid>/stat`).
    pub stopped: bool,
}

/// Every live local rank that has not stepped, stalled since it entered or returned from
/// `init_process_group`, else since the attempt `started` (a rank that has not reached it).
pub fn candidates(
    ranks: &[RankView],
    limit: Duration,
    started: Instant,
    now: Instant,
) -> Vec<Stall> {
    ranks
        .iter()
        .filter(|r| !r.exited && r.steps_seen == 0)
        .map(|r| {
            let (phase, since) =
                stuck_since(r, ranks).map_or((Phase::Init, started), |(p, s)| (p, s));
            stall(r, Some(phase), now.saturating_duration_since(since), limit)
        })
        .collect()
}

/// The cause among the candidates: a stopped rank (the longest stalled), else the one
/// [`pick_culprit`] names (not waiting in `torch.distributed`). `None`: every candidate waits
/// in `torch.distributed`, the cause is on another node.
pub fn pick(candidates: &[Candidate]) -> Option<Stall> {
    if let Some(c) = candidates
        .iter()
        .filter(|c| c.stopped)
        .max_by_key(|c| c.stall.stalled)
    {
        return Some(c.stall.clone());
    }
    let pairs: Vec<(Stall, Waiting)> = candidates
        .iter()
        .map(|c| (c.stall.clone(), c.waiting))
        .collect();
    pick_culprit(&pairs).cloned()
}

/// The state letter of `/proc/<pid>/stat` (after the parenthesised command, which may hold
/// spaces and parentheses itself).
pub fn parse_state(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether `pid` is stopped (by a signal, or traced): it runs no code until continued.
pub fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| parse_state(&s))
        .is_some_and(|c| c == 'T' || c == 't')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(local_rank: u32, t0: Instant) -> RankView {
        RankView {
            local_rank,
            rank: local_rank + 10,
            step: None,
            steps_seen: 0,
            last_progress: None,
            slowest_period: None,
            section: None,
            exited: false,
            init_entered: Some(t0),
            init_returned: None,
            first_step: None,
            last_step: None,
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_rank_inside_init_past_the_limit_is_hung() {
        let t0 = Instant::now();
        let ranks = [rank(0, t0), rank(1, t0 + secs(2))];
        assert_eq!(decide(secs(5), &ranks, t0 + secs(5)), None);
        let stall = decide(secs(5), &ranks, t0 + secs(6)).unwrap();
        assert_eq!((stall.local_rank, stall.stalled), (0, secs(6)));
        assert_eq!(stall.startup, Some(Phase::Init));
        assert!(
            stall
                .describe()
                .starts_with("rank 10 (local rank 0) has not formed its process group"),
            "{}",
            stall.describe()
        );
    }

    #[test]
    fn ranks_that_never_enter_init_or_stepped_or_exited_are_not_watched() {
        let t0 = Instant::now();
        let mut never = rank(0, t0);
        never.init_entered = None;
        let mut stepped = rank(1, t0);
        stepped.steps_seen = 1;
        stepped.first_step = Some(t0);
        let mut exited = rank(2, t0);
        exited.exited = true;
        let ranks = [never, stepped, exited];
        assert_eq!(decide(secs(5), &ranks, t0 + secs(3600)), None);
    }

    #[test]
    fn no_first_step_counts_from_the_later_of_its_return_and_the_peers_first_step() {
        let t0 = Instant::now();
        let mut slow = rank(0, t0);
        slow.init_returned = Some(t0 + secs(1));
        // Alone (no peer stepping): not watched.
        assert_eq!(decide(secs(5), &[slow.clone()], t0 + secs(600)), None);
        let mut peer = rank(1, t0);
        peer.init_returned = Some(t0 + secs(1));
        peer.steps_seen = 3;
        peer.first_step = Some(t0 + secs(10));
        let ranks = [slow, peer];
        assert_eq!(decide(secs(5), &ranks, t0 + secs(15)), None);
        let stall = decide(secs(5), &ranks, t0 + secs(16)).unwrap();
        assert_eq!((stall.local_rank, stall.stalled), (0, secs(6)));
        assert_eq!(stall.startup, Some(Phase::FirstStep));
        // Its stack moved at 14 s: working, not stuck, until 19 s.
        let mut ranks = ranks;
        ranks[0].last_progress = Some(t0 + secs(14));
        assert_eq!(decide(secs(5), &ranks, t0 + secs(19)), None);
        assert!(decide(secs(5), &ranks, t0 + secs(20)).is_some());
    }

    #[test]
    fn a_stopped_rank_is_the_cause_even_before_it_reached_init() {
        let t0 = Instant::now();
        let mut stopped = rank(1, t0);
        stopped.init_entered = None;
        let ranks = [rank(0, t0 + secs(1)), stopped];
        let found = candidates(&ranks, secs(5), t0, t0 + secs(7));
        assert_eq!(found.len(), 2);
        let cands = [
            Candidate {
                stall: found[0].clone(),
                waiting: Waiting::InCollective,
                stopped: false,
            },
            Candidate {
                stall: found[1].clone(),
                waiting: Waiting::Elsewhere,
                stopped: true,
            },
        ];
        let culprit = pick(&cands).unwrap();
        assert_eq!((culprit.local_rank, culprit.stalled), (1, secs(7)));
        // Not stopped, but not waiting in torch.distributed either: still the cause.
        let mut running = cands.clone();
        running[1].stopped = false;
        assert_eq!(pick(&running).map(|s| s.local_rank), Some(1));
        // Every rank waits in init: the cause is on another node.
        let mut waiting = cands;
        waiting[1].stopped = false;
        waiting[1].waiting = Waiting::InCollective;
        assert_eq!(pick(&waiting), None);
    }

    #[test]
    fn reads_the_state_after_an_odd_command_name() {
        assert_eq!(parse_state("42 (py (x) y) T 1 42 42"), Some('T'));
        assert_eq!(parse_state("42 (python) S 1"), Some('S'));
        assert_eq!(parse_state("garbage"), None);
        assert!(!is_stopped(std::process::id()));
    }
}
