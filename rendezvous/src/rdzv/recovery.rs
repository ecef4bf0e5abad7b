//! Surviving the loss of node 0, the store host (issue #14): the rules, as pure functions that
//! return a decision and its reason, and the read-only state an observer (metrics) samples.
//!
//! # Theory of operation
//! When node 0 goes, its store goes with it: the generation, the restarts used, who the members
//! were. The survivors still know all of it, each from the last round it joined, so each one
//! carries a [`GangMemory`]. They stop their workers, keep resolving and reconnecting to the
//! rendezvous endpoint until the join timeout (a replacement pod comes back under the same name
//! with a new address), and register in whatever round the replacement's fresh store has open,
//! their memory attached. The replacement node 0 coordinates that round; reading a memory newer
//! than its own store's generation, it **adopts** it ([`decide_memories`]): it moves its store to
//! the generation after the remembered one, with the remembered restart count, and the round
//! starts again there. So
//! - the restart budget is not reset: a node-0 loss is a membership change (free, like any lost
//!   node), and the restarts used before it stay used;
//! - generations only grow, so nothing from before the loss can be mistaken for a new round;
//! - a survivor whose memory is older than the one adopted (it missed a re-form before the loss)
//!   is **stale**: it cannot join, so it cannot hold the gang to an old membership; it is turned
//!   away with the reason and exits with the rejected code, and a fresh start of it (no memory)
//!   joins as any new node does.
//!
//! A survivor that finds the old store still there (it judged a slow host lost) registers with
//! its memory all the same: where the store's generation is past it (and no memory was ever
//! adopted) it is an ordinary returning node; where it is not, the rule adopts it, which re-forms
//! the gang at the next generation with the same restart count — the survivor's workers are
//! stopped already, so the gang must re-form anyway.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{Assignment, BumpKind, Config, GenRecord};

/// What the gang's store held that matters, as one survivor remembers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GangMemory {
    pub run_id: String,
    /// The generation that was running when the store host was lost.
    pub generation: u64,
    /// Failure restarts used by then (`--max-restarts` budget).
    pub restarts: u32,
    /// The last checkpoint step every rank committed, when this agent knows one.
    #[serde(default)]
    pub checkpoint_step: Option<u64>,
    /// The node ranks that were members of that generation.
    pub members: Vec<u32>,
}

impl GangMemory {
    /// What a member of round `a` (whose generation record was `rec`) carries.
    pub fn of_round(
        run_id: &str,
        rec: &GenRecord,
        a: &Assignment,
        checkpoint_step: Option<u64>,
    ) -> Self {
        Self {
            run_id: run_id.to_owned(),
            generation: a.generation,
            restarts: rec.restarts.max(a.restart_count),
            checkpoint_step,
            members: expand_ranges(&a.member_ranks),
        }
    }
}

/// `[(0, 3), (5, 5)]` → `[0, 1, 2, 3, 5]`.
pub fn expand_ranges(ranges: &[(u32, u32)]) -> Vec<u32> {
    ranges.iter().flat_map(|&(lo, hi)| lo..=hi).collect()
}

/// Sorted node ranks as inclusive ranges: 2,048 contiguous ranks are one pair, so every
/// member's answer can carry the membership at O(1) size.
pub fn compress_ranks(ranks: &[u32]) -> Vec<(u32, u32)> {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for r in sorted {
        match out.last_mut() {
            Some((_, hi)) if *hi + 1 == r => *hi = r,
            _ => out.push((r, r)),
        }
    }
    out
}

/// "0–3, 5".
fn describe_ranks(ranks: &[u32]) -> String {
    let mut out = String::new();
    for (i, (lo, hi)) in compress_ranks(ranks).into_iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        if lo == hi {
            let _ = write!(out, "{lo}");
        } else {
            let _ = write!(out, "{lo}–{hi}");
        }
    }
    out
}

/// What node 0 does with the memories carried by one round's registrations.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MemoryDecision {
    /// Move the store to this record (the gang's own generation and budget) and open the round
    /// again there: some survivor remembers a generation this store has not reached.
    pub adopt: Option<GenRecord>,
    /// With `adopt`: the gang's memory as re-established in this store (the newest carriers',
    /// with the highest checkpoint step any of them knows).
    pub memory: Option<GangMemory>,
    /// Registrations (by index into the input) that may not join, with why.
    pub rejected: Vec<(usize, String)>,
}

/// The rule for one round: `current` is the store's generation record, `memories` the
/// registrations' carried memories (index, node rank, memory).
///
/// - Another run's memory is rejected (it cannot be this gang's).
/// - Memories at or past `current.gen` mean this store is younger than the gang (a replacement
///   node 0): adopt the newest of them — generation + 1, its restart count (the highest among
///   the newest, never below the store's own), and remember which generation was adopted
///   (`recovered_from`) so staleness can be judged later.
/// - A memory older than the adopted one (`current.recovered_from`, or the newest one being
///   adopted now) is stale: rejected.
/// - Otherwise (an older memory in a store that adopted none: the old store is still there) the
///   node is an ordinary returning one.
pub fn decide_memories(
    current: &GenRecord,
    memories: &[(usize, Option<u32>, &GangMemory)],
    cfg: &Config,
) -> (MemoryDecision, String) {
    let mut out = MemoryDecision::default();
    let ours: Vec<&(usize, Option<u32>, &GangMemory)> = memories
        .iter()
        .filter(|(i, _, m)| {
            if m.run_id == cfg.run_id {
                return true;
            }
            out.rejected.push((
                *i,
                format!(
                    "it carries the memory of run `{}`, this is run `{}`",
                    m.run_id, cfg.run_id
                ),
            ));
            false
        })
        .collect();
    let newest = ours.iter().map(|(_, _, m)| m.generation).max();
    let adopting = newest.filter(|g| *g >= current.gen);
    let floor = adopting.or(current.recovered_from);
    if let Some(floor) = floor {
        for (i, rank, m) in &ours {
            if m.generation < floor {
                let who = rank.map_or_else(|| "a node".to_owned(), |r| format!("node {r}"));
                out.rejected.push((
                    *i,
                    format!(
                        "{who} is stale: its last generation was {}, the gang's memory is of generation {floor}",
                        m.generation
                    ),
                ));
            }
        }
    }
    let Some(from) = adopting else {
        let reason = if out.rejected.is_empty() {
            "no memory newer than this store".to_owned()
        } else {
            format!("{} registration(s) turned away", out.rejected.len())
        };
        return (out, reason);
    };
    let carriers: Vec<&GangMemory> = ours
        .iter()
        .filter(|(_, _, m)| m.generation == from)
        .map(|(_, _, m)| *m)
        .collect();
    let restarts = carriers
        .iter()
        .map(|m| m.restarts)
        .max()
        .unwrap_or(0)
        .max(current.restarts);
    let members = carriers
        .first()
        .map(|m| describe_ranks(&m.members))
        .unwrap_or_default();
    let carried_by: Vec<u32> = ours
        .iter()
        .filter(|(_, _, m)| m.generation == from)
        .filter_map(|(_, r, _)| *r)
        .collect();
    let reason = format!(
        "node 0 was replaced: generation {from} (members {members}, {restarts} restart(s) used) carried by node(s) {}; the gang re-forms at generation {}",
        describe_ranks(&carried_by),
        from + 1
    );
    out.memory = carriers.first().map(|first| GangMemory {
        run_id: cfg.run_id.clone(),
        generation: from,
        restarts,
        checkpoint_step: carriers.iter().filter_map(|m| m.checkpoint_step).max(),
        members: first.members.clone(),
    });
    out.adopt = Some(GenRecord {
        gen: from + 1,
        restarts,
        kind: BumpKind::Membership,
        by: Some(0),
        reason: reason.clone(),
        exit_code: None,
        recovered_from: Some(from),
    });
    (out, reason)
}

/// A survivor's verdict while it waits for a replacement node 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostWait {
    /// Keep resolving and reconnecting.
    Wait,
    /// The join timeout passed since the loss: exit (205).
    GiveUp,
}

/// Whether a survivor that lost the store host at `lost_at` keeps waiting for a replacement.
pub fn decide_host_wait(
    lost_at: Instant,
    now: Instant,
    endpoint: &str,
    cfg: &Config,
) -> (HostWait, String) {
    let waited = now.saturating_duration_since(lost_at);
    if waited >= cfg.join_timeout {
        return (
            HostWait::GiveUp,
            format!(
                "no node 0 came back at {endpoint} within the join timeout ({:.1}s; waited {:.1}s since the store host was lost)",
                cfg.join_timeout.as_secs_f64(),
                waited.as_secs_f64()
            ),
        );
    }
    (
        HostWait::Wait,
        format!(
            "waiting for a replacement node 0 at {endpoint} ({:.1}s of {:.1}s)",
            waited.as_secs_f64(),
            cfg.join_timeout.as_secs_f64()
        ),
    )
}

/// What a survivor has been through, for an observer to sample (metrics); written only by the
/// agent's rendezvous.
#[derive(Debug, Default)]
pub struct HostLossStats {
    lost: AtomicU64,
    rejoined: AtomicU64,
    /// Nanoseconds without a gang, summed over the completed recoveries.
    without_gang_ns: AtomicU64,
    /// When the current wait began; `None` when not waiting.
    waiting_since: Mutex<Option<Instant>>,
}

impl HostLossStats {
    /// The store host was lost at `at`; waiting for a replacement starts.
    pub fn lost(&self, at: Instant) {
        self.lost.fetch_add(1, Ordering::Relaxed);
        *self.lock() = Some(at);
    }

    /// Back in a gang after `without`.
    pub fn rejoined(&self, without: Duration) {
        self.rejoined.fetch_add(1, Ordering::Relaxed);
        self.without_gang_ns.fetch_add(
            u64::try_from(without.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        *self.lock() = None;
    }

    /// The wait ended without a gang (the agent gives up).
    pub fn gave_up(&self) {
        *self.lock() = None;
    }

    pub fn lost_total(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    pub fn rejoined_total(&self) -> u64 {
        self.rejoined.load(Ordering::Relaxed)
    }

    /// Whether a replacement is being waited for now.
    pub fn waiting(&self) -> bool {
        self.lock().is_some()
    }

    /// Seconds without a gang: the completed recoveries plus the wait in progress.
    pub fn seconds_without_gang(&self, now: Instant) -> f64 {
        let done = Duration::from_nanos(self.without_gang_ns.load(Ordering::Relaxed));
        let current = self
            .lock()
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
        (done + current).as_secs_f64()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.waiting_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        let mut c = Config::new("job", 3, 3);
        c.join_timeout = Duration::from_secs(20);
        c
    }

    fn memory(generation: u64, restarts: u32) -> GangMemory {
        GangMemory {
            run_id: "job".into(),
            generation,
            restarts,
            checkpoint_step: None,
            members: vec![0, 1, 2],
        }
    }

    fn record(gen: u64, restarts: u32, recovered_from: Option<u64>) -> GenRecord {
        GenRecord {
            gen,
            restarts,
            recovered_from,
            ..GenRecord::first()
        }
    }

    #[test]
    fn a_fresh_store_adopts_the_survivors_generation_and_budget() {
        let m1 = memory(3, 1);
        let m2 = memory(3, 1);
        let (d, why) = decide_memories(
            &GenRecord::first(),
            &[(1, Some(1), &m1), (2, Some(2), &m2)],
            &cfg(),
        );
        let rec = d.adopt.expect("adopt");
        assert_eq!(
            (rec.gen, rec.restarts, rec.kind, rec.recovered_from),
            (4, 1, BumpKind::Membership, Some(3))
        );
        assert!(d.rejected.is_empty());
        let kept = d.memory.expect("memory");
        assert_eq!(
            (kept.generation, kept.restarts, kept.members),
            (3, 1, vec![0, 1, 2])
        );
        assert!(
            why.contains("generation 3 (members 0–2, 1 restart(s) used) carried by node(s) 1–2")
                && why.contains("re-forms at generation 4"),
            "{why}"
        );
    }

    #[test]
    fn the_highest_committed_checkpoint_any_survivor_knows_is_kept() {
        let mut a = memory(2, 0);
        a.checkpoint_step = Some(100);
        let mut b = memory(2, 0);
        b.checkpoint_step = Some(200);
        let c = memory(2, 0);
        let (d, _) = decide_memories(
            &GenRecord::first(),
            &[(0, Some(1), &a), (1, Some(2), &b), (2, Some(3), &c)],
            &cfg(),
        );
        assert_eq!(d.memory.and_then(|m| m.checkpoint_step), Some(200));
    }

    #[test]
    fn node_0_lost_in_the_first_generation_still_moves_the_gang_on() {
        let m = memory(0, 0);
        let (d, _) = decide_memories(&GenRecord::first(), &[(1, Some(1), &m)], &cfg());
        assert_eq!(
            d.adopt.map(|r| (r.gen, r.recovered_from)),
            Some((1, Some(0)))
        );
    }

    #[test]
    fn the_newest_memory_wins_and_an_older_one_is_stale() {
        let fresh = memory(5, 2);
        let stale = memory(2, 0);
        let (d, why) = decide_memories(
            &GenRecord::first(),
            &[(1, Some(1), &stale), (2, Some(2), &fresh)],
            &cfg(),
        );
        let rec = d.adopt.expect("adopt");
        assert_eq!((rec.gen, rec.restarts), (6, 2), "{why}");
        assert_eq!(d.rejected.len(), 1);
        assert_eq!(d.rejected[0].0, 1);
        assert!(
            d.rejected[0].1.contains(
                "node 1 is stale: its last generation was 2, the gang's memory is of generation 5"
            ),
            "{:?}",
            d.rejected
        );
    }

    #[test]
    fn after_adoption_survivors_of_that_generation_join_and_older_ones_do_not() {
        let adopted = record(4, 1, Some(3));
        let same = memory(3, 1);
        let older = memory(1, 0);
        let (d, _) = decide_memories(
            &adopted,
            &[(0, Some(1), &same), (1, Some(2), &older)],
            &cfg(),
        );
        assert_eq!(d.adopt, None, "nothing newer than the store");
        assert_eq!(d.rejected.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn the_budget_is_never_lowered_and_another_runs_memory_is_refused() {
        // The replacement already counted a restart of its own before the survivors came.
        let current = record(1, 2, None);
        let m = memory(3, 1);
        let mut other = memory(9, 0);
        other.run_id = "other".into();
        let (d, _) = decide_memories(&current, &[(0, Some(1), &m), (1, Some(2), &other)], &cfg());
        let rec = d.adopt.expect("adopt");
        assert_eq!(
            (rec.gen, rec.restarts),
            (4, 2),
            "the newest memory of this run"
        );
        assert_eq!(d.rejected.len(), 1);
        assert!(d.rejected[0].1.contains("run `other`"), "{:?}", d.rejected);
    }

    #[test]
    fn an_older_memory_in_a_store_that_adopted_none_is_an_ordinary_returning_node() {
        // The old store is still there (a slow host judged lost): it has moved on.
        let current = record(7, 1, None);
        let m = memory(5, 1);
        let (d, why) = decide_memories(&current, &[(0, Some(1), &m)], &cfg());
        assert_eq!(d, MemoryDecision::default(), "{why}");
    }

    #[test]
    fn survivors_wait_for_a_replacement_up_to_the_join_timeout() {
        let c = cfg();
        let t0 = Instant::now();
        let (v, why) = decide_host_wait(t0, t0 + Duration::from_secs(5), "w-0:29400", &c);
        assert_eq!(v, HostWait::Wait);
        assert!(why.contains("w-0:29400 (5.0s of 20.0s)"), "{why}");
        let (v, why) = decide_host_wait(t0, t0 + c.join_timeout, "w-0:29400", &c);
        assert_eq!(v, HostWait::GiveUp);
        assert!(
            why.contains(
                "no node 0 came back at w-0:29400 within the join timeout (20.0s; waited 20.0s"
            ),
            "{why}"
        );
    }

    #[test]
    fn ranks_compress_to_ranges_and_back() {
        let ranks = [5, 0, 1, 2, 3, 9, 10];
        let ranges = compress_ranks(&ranks);
        assert_eq!(ranges, vec![(0, 3), (5, 5), (9, 10)]);
        assert_eq!(expand_ranges(&ranges), vec![0, 1, 2, 3, 5, 9, 10]);
        assert_eq!(describe_ranks(&ranks), "0–3, 5, 9–10");
        assert_eq!(
            compress_ranks(&(0..2048).collect::<Vec<_>>()),
            vec![(0, 2047)]
        );
    }

    #[test]
    fn the_time_without_a_gang_adds_up_across_recoveries() {
        let s = HostLossStats::default();
        let t0 = Instant::now();
        s.lost(t0);
        assert!(s.waiting());
        let during = s.seconds_without_gang(t0 + Duration::from_secs(2));
        assert!((during - 2.0).abs() < 1e-6, "{during}");
        s.rejoined(Duration::from_secs(3));
        assert!(!s.waiting());
        assert_eq!((s.lost_total(), s.rejoined_total()), (1, 1));
        let after = s.seconds_without_gang(t0 + Duration::from_secs(100));
        assert!((after - 3.0).abs() < 1e-6, "{after}");
    }
}
