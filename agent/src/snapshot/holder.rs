//! What the agent holds of its ranks' snapshots, and the rules that keep it safe: the pure half of
//! [`super`], apart from sockets and the store.
//!
//! A *generation* is one step's parts, one per global rank of this node. The holder keeps at most
//! two: the newest committed one (the restart point) and one newer, pending one. A third is
//! refused rather than making room: the pending one may already be committed on the gang's store
//! without this agent knowing, and the committed one is what a restart needs, so neither may go
//! before the next commit is learned.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

/// One rank's part of a snapshot: the sealed memory file its bytes are in.
#[derive(Debug)]
pub struct Part {
    pub memory: OwnedFd,
    pub bytes: u64,
    /// The attempt (TORCHELASTIC_RESTART_COUNT) that handed it over.
    pub attempt: u32,
}

/// Why a part was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Not now (a rank skips this snapshot and tries at the next).
    #[error("step {pending} is not committed yet")]
    Pending { pending: u64 },
    #[error("step {step} is not newer than the committed step {committed}")]
    Stale { step: u64, committed: u64 },
    #[error("the part is from attempt {part} of a gang now in attempt {current}")]
    OtherAttempt { part: u32, current: u32 },
    #[error("rank {rank} does not run on this node in this attempt")]
    NotOurs { rank: u32 },
    /// The gang has not yet agreed which step this attempt restores.
    #[error("the gang has not agreed on its restart point yet")]
    Unsettled,
    /// Never (snapshots stop for the job, said once).
    #[error("{needed} bytes would be held, over the cap of {cap} bytes (--snapshot-memory)")]
    OverCap { needed: u64, cap: u64 },
}

impl Refusal {
    /// Whether the rank should stop taking snapshots for the rest of the job.
    pub fn is_final(&self) -> bool {
        matches!(self, Refusal::OverCap { .. })
    }
}

/// This node's share of the gang in the current attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub attempt: u32,
    pub first_rank: u32,
    pub local_ranks: u32,
    pub world_size: u32,
}

impl Share {
    fn owns(&self, rank: u32) -> bool {
        rank >= self.first_rank && rank - self.first_rank < self.local_ranks
    }

    /// The global ranks this node runs.
    pub fn ranks(&self) -> std::ops::Range<u32> {
        self.first_rank..self.first_rank + self.local_ranks
    }
}

#[derive(Debug, Default)]
struct Generation {
    world_size: u32,
    parts: BTreeMap<u32, Part>,
}

impl Generation {
    fn bytes(&self) -> u64 {
        self.parts.values().map(|p| p.bytes).sum()
    }
}

/// The snapshots of this node's ranks.
#[derive(Debug)]
pub struct Holder {
    cap_bytes: u64,
    share: Option<Share>,
    /// Whether the gang agreed on this attempt's restart point ([`Self::settle`]): until then
    /// nothing is taken, so that nothing the agreement may pick is pushed out.
    settled: bool,
    committed: Option<u64>,
    generations: BTreeMap<u64, Generation>,
}

impl Holder {
    pub fn new(cap_bytes: u64) -> Holder {
        Holder {
            cap_bytes,
            share: None,
            settled: false,
            committed: None,
            generations: BTreeMap::new(),
        }
    }

    /// A new attempt: which ranks this node runs now. What is held stays until [`Self::settle`].
    pub fn begin_attempt(&mut self, share: Share) {
        self.share = Some(share);
        self.settled = false;
    }

    pub fn committed(&self) -> Option<u64> {
        self.committed
    }

    /// The attempt whose ranks run here now.
    pub fn attempt(&self) -> Option<u32> {
        self.share.map(|s| s.attempt)
    }

    pub fn share(&self) -> Option<Share> {
        self.share
    }

    pub fn cap_bytes(&self) -> u64 {
        self.cap_bytes
    }

    /// Takes the parts of `step` fetched from a buddy (this node's own, which a lost pod did
    /// not keep) for the agreement in progress; `false` when they are not every current rank's.
    pub fn adopt(&mut self, step: u64, parts: Vec<(u32, OwnedFd, u64)>) -> bool {
        let Some(share) = self.share else {
            return false;
        };
        let parts: BTreeMap<u32, Part> = parts
            .into_iter()
            .filter(|(rank, _, _)| share.owns(*rank))
            .map(|(rank, memory, bytes)| {
                (
                    rank,
                    Part {
                        memory,
                        bytes,
                        attempt: share.attempt,
                    },
                )
            })
            .collect();
        if parts.len() != share.local_ranks as usize {
            return false;
        }
        self.generations.insert(
            step,
            Generation {
                world_size: share.world_size,
                parts,
            },
        );
        true
    }

    /// This node's parts of `step`, as copies of their descriptors, for its buddy.
    pub fn parts_of(&self, step: u64) -> Vec<(u32, OwnedFd, u64)> {
        self.generations.get(&step).map_or_else(Vec::new, |g| {
            g.parts
                .iter()
                .filter_map(|(rank, p)| p.memory.try_clone().ok().map(|m| (*rank, m, p.bytes)))
                .collect()
        })
    }

    pub fn bytes_held(&self) -> u64 {
        self.generations.values().map(Generation::bytes).sum()
    }

    /// Takes `part` of `rank` for `step`; `Ok(true)` when it completes the step on this node.
    pub fn hold(&mut self, rank: u32, step: u64, part: Part) -> Result<bool, Refusal> {
        let Some(share) = self.share else {
            return Err(Refusal::NotOurs { rank });
        };
        if part.attempt != share.attempt {
            return Err(Refusal::OtherAttempt {
                part: part.attempt,
                current: share.attempt,
            });
        }
        if !share.owns(rank) {
            return Err(Refusal::NotOurs { rank });
        }
        if let Some(committed) = self.committed.filter(|c| step <= *c) {
            return Err(Refusal::Stale { step, committed });
        }
        if !self.settled {
            return Err(Refusal::Unsettled);
        }
        if let Some(pending) = self.pending_steps().find(|s| *s != step) {
            return Err(Refusal::Pending { pending });
        }
        let replaced = self
            .generations
            .get(&step)
            .and_then(|g| g.parts.get(&rank))
            .map_or(0, |p| p.bytes);
        let needed = self.bytes_held() - replaced + part.bytes;
        if needed > self.cap_bytes {
            return Err(Refusal::OverCap {
                needed,
                cap: self.cap_bytes,
            });
        }
        let generation = self.generations.entry(step).or_default();
        generation.world_size = share.world_size;
        generation.parts.insert(rank, part);
        Ok(self.complete(step))
    }

    /// Whether every rank of this node holds a part of `step` handed over in this attempt.
    pub fn complete(&self, step: u64) -> bool {
        let (Some(share), Some(generation)) = (self.share, self.generations.get(&step)) else {
            return false;
        };
        generation.world_size == share.world_size
            && share.ranks().all(|rank| {
                generation
                    .parts
                    .get(&rank)
                    .is_some_and(|p| p.attempt == share.attempt)
            })
    }

    /// The gang committed `step`: it becomes the restart point and older generations go.
    pub fn commit(&mut self, step: u64) {
        if self.committed.is_some_and(|c| c >= step) {
            return;
        }
        self.committed = Some(step);
        self.generations.retain(|s, _| *s >= step);
    }

    /// Steps this node could restore every one of its current ranks from: held complete for
    /// this attempt's ranks and world size, whichever attempt handed them over.
    pub fn restorable(&self) -> Vec<u64> {
        let Some(share) = self.share else {
            return Vec::new();
        };
        self.generations
            .iter()
            .filter(|(_, g)| {
                g.world_size == share.world_size
                    && share.ranks().all(|rank| g.parts.contains_key(&rank))
            })
            .map(|(s, _)| *s)
            .collect()
    }

    /// The gang agreed to restore `agreed` (or nothing): it is the committed step, and every
    /// other generation an earlier attempt left goes (a timeline that did not survive).
    pub fn settle(&mut self, agreed: Option<u64>) {
        let attempt = self.share.map(|s| s.attempt);
        self.generations.retain(|step, g| {
            Some(*step) == agreed || g.parts.values().all(|p| Some(p.attempt) == attempt)
        });
        self.committed = agreed;
        self.settled = true;
        if let Some(step) = agreed {
            self.generations.retain(|s, _| *s >= step);
        }
    }

    /// The part of `rank` for `step`, to hand back to the rank.
    pub fn part(&self, rank: u32, step: u64) -> Option<&Part> {
        self.generations.get(&step)?.parts.get(&rank)
    }

    fn pending_steps(&self) -> impl Iterator<Item = u64> + '_ {
        let committed = self.committed;
        self.generations
            .keys()
            .copied()
            .filter(move |s| committed.is_none_or(|c| *s > c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory() -> OwnedFd {
        let file = std::fs::File::open("/dev/null").expect("/dev/null opens");
        OwnedFd::from(file)
    }

    fn part(bytes: u64, attempt: u32) -> Part {
        Part {
            memory: memory(),
            bytes,
            attempt,
        }
    }

    fn node(attempt: u32, first_rank: u32) -> Holder {
        let mut holder = Holder::new(1000);
        holder.begin_attempt(Share {
            attempt,
            first_rank,
            local_ranks: 2,
            world_size: 4,
        });
        holder.settle(None);
        holder
    }

    #[test]
    fn a_step_is_complete_when_every_local_rank_holds_its_part() {
        let mut holder = node(0, 2);
        assert_eq!(holder.hold(2, 5, part(10, 0)), Ok(false));
        assert_eq!(holder.hold(3, 5, part(10, 0)), Ok(true));
        assert_eq!(holder.restorable(), vec![5]);
        assert_eq!(holder.bytes_held(), 20);
        assert_eq!(
            holder.hold(0, 5, part(10, 0)),
            Err(Refusal::NotOurs { rank: 0 })
        );
    }

    #[test]
    fn a_third_generation_waits_for_the_pending_one_to_commit() {
        let mut holder = node(0, 0);
        holder.hold(0, 5, part(10, 0)).unwrap();
        holder.hold(1, 5, part(10, 0)).unwrap();
        holder.commit(5);
        holder.hold(0, 10, part(10, 0)).unwrap();
        holder.hold(1, 10, part(10, 0)).unwrap();
        // 10 may be committed elsewhere already, and 5 is the restart point: neither goes.
        assert_eq!(
            holder.hold(0, 15, part(10, 0)),
            Err(Refusal::Pending { pending: 10 })
        );
        holder.commit(10);
        assert_eq!(holder.restorable(), vec![10]);
        assert_eq!(holder.hold(0, 15, part(10, 0)), Ok(false));
        assert_eq!(
            holder.hold(0, 10, part(10, 0)),
            Err(Refusal::Stale {
                step: 10,
                committed: 10
            })
        );
    }

    #[test]
    fn over_the_cap_is_final_and_a_replaced_part_is_not_counted_twice() {
        let mut holder = node(0, 0);
        holder.hold(0, 5, part(400, 0)).unwrap();
        holder.hold(0, 5, part(450, 0)).unwrap();
        let refused = holder.hold(1, 5, part(600, 0)).unwrap_err();
        assert_eq!(
            refused,
            Refusal::OverCap {
                needed: 1050,
                cap: 1000
            }
        );
        assert!(refused.is_final());
    }

    #[test]
    fn a_restart_keeps_the_agreed_step_and_drops_the_dead_timeline() {
        let mut holder = node(0, 0);
        for step in [5, 10] {
            holder.hold(0, step, part(10, 0)).unwrap();
            holder.hold(1, step, part(10, 0)).unwrap();
            if step == 5 {
                holder.commit(5);
            }
        }
        // Step 10 never committed on the gang; the next attempt restores 5.
        holder.begin_attempt(Share {
            attempt: 1,
            first_rank: 0,
            local_ranks: 2,
            world_size: 4,
        });
        assert_eq!(holder.restorable(), vec![5, 10]);
        assert_eq!(
            holder.hold(0, 15, part(10, 0)),
            Err(Refusal::OtherAttempt {
                part: 0,
                current: 1
            })
        );
        holder.settle(Some(5));
        assert_eq!(holder.restorable(), vec![5]);
        assert!(holder.part(1, 5).is_some());
        // The new attempt re-trains 6..10 and snapshots 10 again.
        assert_eq!(holder.hold(0, 10, part(10, 1)), Ok(false));
        assert_eq!(holder.hold(1, 10, part(10, 1)), Ok(true));
    }

    #[test]
    fn a_pending_step_the_attempt_before_left_gives_way() {
        let mut holder = node(0, 0);
        holder.hold(0, 10, part(10, 0)).unwrap();
        holder.begin_attempt(Share {
            attempt: 1,
            first_rank: 0,
            local_ranks: 2,
            world_size: 4,
        });
        holder.settle(None);
        assert_eq!(holder.bytes_held(), 0);
        assert_eq!(holder.hold(0, 15, part(10, 1)), Ok(false));
    }

    #[test]
    fn nothing_is_taken_before_the_gang_agrees() {
        let mut holder = node(0, 0);
        holder.begin_attempt(Share {
            attempt: 1,
            first_rank: 0,
            local_ranks: 2,
            world_size: 4,
        });
        assert_eq!(holder.hold(0, 5, part(10, 1)), Err(Refusal::Unsettled));
    }

    #[test]
    fn another_world_size_is_nothing_to_restore() {
        let mut holder = node(0, 0);
        holder.hold(0, 5, part(10, 0)).unwrap();
        holder.hold(1, 5, part(10, 0)).unwrap();
        holder.begin_attempt(Share {
            attempt: 1,
            first_rank: 0,
            local_ranks: 2,
            world_size: 2,
        });
        assert!(holder.restorable().is_empty());
    }
}
