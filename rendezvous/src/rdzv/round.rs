//! Node 0's side of a round: open it, read registrations as they come, decide, answer; and
//! carry the memories survivors of a lost store host bring.

use std::time::Duration;

use tokio::time::{sleep, Instant};
use tracing::{info, warn};

use super::decide::{self, Arrival, Membership, RoundDecision, RoundState};
use super::driver::{Joined, Rendezvous};
use super::kv::Kv;
use super::record::{bump, check_fatal, internal, lost};
use super::recovery::{self, GangMemory};
use super::{Answer, BumpKind, GenRecord, RdzvError, Registration};

/// How often a waiting coordinator repeats its progress line.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// The round node 0 opened: the generation record it opened at, as stored and parsed, and node
/// 0's own slot in it.
struct OpenRound {
    raw: Vec<u8>,
    rec: GenRecord,
    slot: u64,
}

impl<K: Kv> Rendezvous<K> {
    /// Node 0's side: rounds until one completes. A round opens again at a new generation
    /// when survivors of a lost store host bring a memory this store adopts.
    pub(super) async fn coordinate(&mut self, master_port: u16) -> Result<Joined, RdzvError> {
        loop {
            if let Some(joined) = self.coordinate_round(master_port).await? {
                return Ok(joined);
            }
        }
    }

    /// One round: open it, read registrations as they come, decide, answer. `None` when the
    /// store moved to the gang's remembered generation instead.
    async fn coordinate_round(&mut self, master_port: u16) -> Result<Option<Joined>, RdzvError> {
        let open = self.open_round().await?;
        let gen = open.rec.gen;
        let mut state = RoundState {
            gen,
            started: Instant::now(),
            arrivals: Vec::new(),
            known_hosts: self.known_hosts.clone(),
            restarting: (open.rec.kind == BumpKind::Failure).then(|| self.last_members.clone()),
        };
        let mut seen: u64 = 0;
        let mut last_reason = String::new();
        let mut last_progress = Instant::now();
        info!(
            gen,
            restarts = open.rec.restarts,
            "round {gen} open: {}",
            open.rec.reason
        );
        loop {
            if self.read_arrivals(&open, &mut state, &mut seen).await? {
                // Every slot of this round is answered "superseded" by the next one.
                self.last_round = Some((gen, 0));
                return Ok(None);
            }
            let now = Instant::now();
            let (decision, reason) = decide::decide_round(now, &state, &self.cfg);
            match decision {
                RoundDecision::Wait => {
                    if reason != last_reason && now.duration_since(last_progress) >= PROGRESS_EVERY
                    {
                        info!("{reason}");
                        last_progress = now;
                    }
                    last_reason = reason;
                    sleep(self.cfg.poll_interval).await;
                }
                RoundDecision::Complete(m) => {
                    info!("{reason}");
                    let joined = self
                        .complete_round(open, &state, &m, seen, master_port)
                        .await?;
                    return Ok(Some(joined));
                }
                RoundDecision::Timeout(message) => {
                    warn!("{reason}");
                    self.answer_timeout(&state, open.slot, &message).await?;
                    return Err(RdzvError::Timeout(message));
                }
            }
        }
    }

    /// Opens a round at the current generation: supersedes the slots of the last one still
    /// waiting, then registers node 0 itself.
    async fn open_round(&mut self) -> Result<OpenRound, RdzvError> {
        let (raw, rec) = self.current_gen().await?;
        check_fatal(&rec)?;
        let gen = rec.gen;
        if let Some((old, answered)) = self.last_round {
            if old != gen {
                self.supersede(old, answered).await?;
            }
        }
        let slot = self.register(gen).await?;
        Ok(OpenRound { raw, rec, slot })
    }

    /// Reads the registrations written since the last look (`seen` slots) into `state`. True
    /// when survivors of a lost store host moved the store to their generation, so the round
    /// must open again there.
    async fn read_arrivals(
        &mut self,
        open: &OpenRound,
        state: &mut RoundState,
        seen: &mut u64,
    ) -> Result<bool, RdzvError> {
        let gen = state.gen;
        let count = self.kv.add(&self.keys.slots(gen), 0).await.map_err(lost)? as u64;
        if count <= *seen {
            return Ok(false);
        }
        let keys: Vec<Vec<u8>> = (*seen + 1..=count)
            .map(|i| self.keys.slot(gen, i))
            .collect();
        let values = self.kv.multi_get(&keys).await.map_err(lost)?;
        let now = Instant::now();
        for (key, value) in keys.iter().zip(values) {
            // Slot taken but not yet written: read it again next tick.
            if value.is_empty() {
                break;
            }
            *seen += 1;
            match serde_json::from_slice::<Registration>(&value) {
                Ok(reg) => {
                    self.end_on_fatal_registration(open, &reg).await?;
                    state.arrivals.push(Arrival {
                        slot: *seen,
                        reg,
                        seen_at: now,
                    });
                }
                Err(e) => warn!(
                    key = %String::from_utf8_lossy(key),
                    "ignoring an unreadable registration: {e}"
                ),
            }
        }
        Ok(state.arrivals.iter().any(|a| a.reg.memory.is_some())
            && self.carry_memories(&open.raw, &open.rec, state).await?)
    }

    /// One node that must not run ends the job for all, at once, by name, instead of leaving
    /// the others to wait for the join deadline: the job's fatal error when `reg` is such a node.
    async fn end_on_fatal_registration(
        &mut self,
        open: &OpenRound,
        reg: &Registration,
    ) -> Result<(), RdzvError> {
        let Some((code, reason)) = decide::fatal_registration(reg) else {
            return Ok(());
        };
        let next = decide::fatal_bump(&open.rec, self.reg.node_rank, code, reason);
        let won = bump(&mut self.kv, &self.keys, &open.raw, &next).await?;
        if won.kind == BumpKind::Fatal {
            // This node hosts the store: keep it up until the waiting agents (they re-read the
            // generation every keep-alive interval) have seen why, so they exit with this code
            // and not with "store host lost".
            sleep(self.cfg.keep_alive_interval * 2 + self.cfg.poll_interval).await;
        }
        check_fatal(&won)
    }

    /// A complete round: answers every slot with one MULTI_SET (members, spares, rejected) and
    /// returns node 0's own place in it.
    async fn complete_round(
        &mut self,
        open: OpenRound,
        state: &RoundState,
        m: &Membership,
        seen: u64,
        master_port: u16,
    ) -> Result<Joined, RdzvError> {
        let OpenRound { raw, rec, slot } = open;
        let gen = state.gen;
        let assignments = decide::assign(state, m, rec.restarts, (&self.reg.addr, master_port));
        let mut pairs = Vec::with_capacity(state.arrivals.len());
        let mut mine = None;
        for (slot_no, a) in &assignments {
            if *slot_no == slot {
                mine = Some(a.clone());
            }
            pairs.push(self.answer(gen, *slot_no, &Answer::Member(a.clone()))?);
        }
        if let Ok(mut list) = self.spares.lock() {
            *list = m
                .spares
                .iter()
                .map(|&i| state.arrivals[i].reg.host.clone())
                .collect();
        }
        for &i in &m.spares {
            pairs.push(self.answer(gen, state.arrivals[i].slot, &Answer::Spare)?);
        }
        for (i, why) in &m.rejected {
            let answer = Answer::Rejected {
                reason: why.clone(),
            };
            pairs.push(self.answer(gen, state.arrivals[*i].slot, &answer)?);
        }
        self.kv.multi_set(&pairs).await.map_err(lost)?;
        for &(rank, i) in &m.members {
            let r = &state.arrivals[i].reg;
            self.known_hosts
                .insert(rank, format!("{}, {}", r.host, r.addr));
        }
        self.last_members = m.members.iter().map(|&(rank, _)| rank).collect();
        let Some(mut assignment) = mine else {
            let why = m
                .rejected
                .iter()
                .find(|(i, _)| state.arrivals[*i].slot == slot)
                .map_or_else(
                    || "node 0 is not a member of its own round".into(),
                    |(_, w)| w.clone(),
                );
            return Err(RdzvError::Rejected(why));
        };
        assignment.members = decide::members(state, m);
        self.held_ranks = decide::held_ranks(state, m);
        self.remember_round(gen, seen, raw, rec.clone(), &assignment);
        Ok(Joined {
            assignment,
            record: rec,
        })
    }

    /// A round past its join deadline: answers every other slot "timeout" with `message` and
    /// keeps the store up until they read it.
    async fn answer_timeout(
        &mut self,
        state: &RoundState,
        slot: u64,
        message: &str,
    ) -> Result<(), RdzvError> {
        let answer = Answer::Timeout {
            message: message.to_owned(),
        };
        let pairs = state
            .arrivals
            .iter()
            .filter(|a| a.slot != slot)
            .map(|a| self.answer(state.gen, a.slot, &answer))
            .collect::<Result<Vec<_>, _>>()?;
        let others = pairs.len() as i64;
        self.kv.multi_set(&pairs).await.map_err(lost)?;
        self.linger(&self.keys.acks(state.gen), others, Duration::ZERO)
            .await;
        Ok(())
    }

    fn answer(
        &self,
        gen: u64,
        slot: u64,
        answer: &Answer,
    ) -> Result<(Vec<u8>, Vec<u8>), RdzvError> {
        Ok((
            self.keys.assign(gen, slot),
            serde_json::to_vec(answer).map_err(internal)?,
        ))
    }

    /// Node 0: what the survivors of a lost store host brought ([`recovery::decide_memories`]).
    /// Stale ones are turned away and leave the round; returns true when the store moved to
    /// the gang's own generation, so the round must open again there.
    async fn carry_memories(
        &mut self,
        raw: &[u8],
        rec: &GenRecord,
        state: &mut RoundState,
    ) -> Result<bool, RdzvError> {
        let memories: Vec<(usize, Option<u32>, &GangMemory)> = state
            .arrivals
            .iter()
            .enumerate()
            .filter_map(|(i, a)| a.reg.memory.as_ref().map(|m| (i, a.reg.node_rank, m)))
            .collect();
        let (decision, reason) = recovery::decide_memories(rec, &memories, &self.cfg);
        if !decision.rejected.is_empty() {
            let mut pairs = Vec::with_capacity(decision.rejected.len());
            for (i, why) in &decision.rejected {
                warn!("turning away {}: {why}", state.arrivals[*i].reg.host);
                let answer = Answer::Rejected {
                    reason: why.clone(),
                };
                pairs.push(self.answer(state.gen, state.arrivals[*i].slot, &answer)?);
            }
            self.kv.multi_set(&pairs).await.map_err(lost)?;
            let turned_away: Vec<usize> = decision.rejected.iter().map(|(i, _)| *i).collect();
            let mut index = 0;
            state.arrivals.retain(|_| {
                let keep = !turned_away.contains(&index);
                index += 1;
                keep
            });
        }
        let Some(next) = decision.adopt else {
            return Ok(false);
        };
        let won = bump(&mut self.kv, &self.keys, raw, &next).await?;
        if won == next {
            warn!("{reason}");
            if let Some(memory) = &decision.memory {
                let body = serde_json::to_vec(memory).map_err(internal)?;
                self.kv
                    .set(&self.keys.memory(), &body)
                    .await
                    .map_err(lost)?;
            }
        }
        Ok(true)
    }

    /// Wakes agents still waiting on an old round's slots: their round will never complete.
    async fn supersede(&mut self, old: u64, answered: u64) -> Result<(), RdzvError> {
        let count = self.kv.add(&self.keys.slots(old), 0).await.map_err(lost)? as u64;
        if count <= answered {
            return Ok(());
        }
        let pairs = (answered + 1..=count)
            .map(|slot| self.answer(old, slot, &Answer::Superseded))
            .collect::<Result<Vec<_>, _>>()?;
        self.kv.multi_set(&pairs).await.map_err(lost)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;
    use tokio_util::sync::CancellationToken;

    use super::super::keys::Keys;
    use super::super::kv::mem::MemKv;
    use super::super::recovery::GangMemory;
    use super::super::testkit::*;
    use super::super::{BumpKind, Config, Event, RdzvError};

    #[tokio::test(start_paused = true)]
    async fn a_round_assigns_contiguous_ranks_by_node_rank() {
        let kv = MemKv::default();
        let c = cfg(3, 3);
        let formed = form(
            &kv,
            vec![
                agent(&kv, &c, Some(2), 4),
                agent(&kv, &c, Some(0), 2),
                agent(&kv, &c, None, 1),
            ],
        )
        .await;
        let [(_, j2), (_, j0), (r_anon, j_anon)] = &formed[..] else {
            panic!("three agents")
        };
        assert_eq!(
            (j0.assignment.node_rank, j0.assignment.base_global_rank),
            (0, 0)
        );
        let anon = &j_anon.assignment;
        assert_eq!(
            (anon.node_rank, anon.group_rank, anon.base_global_rank),
            (1, 1, 2)
        );
        assert_eq!(
            r_anon.reg.node_rank,
            Some(1),
            "an arrival-order rank sticks"
        );
        let a = &j2.assignment;
        assert_eq!((a.node_rank, a.base_global_rank, a.world_size), (2, 3, 7));
        assert_eq!((a.master_addr.as_str(), a.master_port), ("10.0.0.0", 4242));
        assert_eq!(a.group_world_size, 3);
        assert!(a.members.is_empty(), "only node 0 gets the member list");
        assert_eq!(j0.assignment.members.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn the_join_timeout_names_the_ranks_that_never_arrived() {
        let kv = MemKv::default();
        let mut c = cfg(3, 3);
        c.join_timeout = Duration::from_secs(5);
        let mut a0 = agent(&kv, &c, Some(0), 1);
        let mut a1 = agent(&kv, &c, Some(1), 1);
        let t0 = tokio::spawn(async move { a0.next_round(1).await });
        let t1 = tokio::spawn(async move { a1.next_round(1).await });
        let started = Instant::now();
        let e0 = t0.await.expect("task").expect_err("timeout");
        let e1 = t1.await.expect("task").expect_err("timeout");
        assert!(Instant::now() - started >= Duration::from_secs(5));
        for e in [e0, e1] {
            let RdzvError::Timeout(msg) = e else {
                panic!("{e:?}")
            };
            assert!(msg.contains("never arrived: node rank 2"), "{msg}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn min_nodes_start_after_the_last_call_and_a_late_node_scales_up_for_free() {
        let kv = MemKv::default();
        let c = cfg(2, 3);
        let started = Instant::now();
        let mut formed = form_nodes(&kv, &c, 2).await;
        assert!(Instant::now() - started >= c.last_call_timeout);
        assert_eq!(formed[0].1.assignment.world_size, 2);
        let (r1, j1) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        let stop = CancellationToken::new();
        let w0 = spawn_watcher(&r0, &kv, &j0, &stop);
        let w1 = spawn_watcher(&r1, &kv, &j1, &stop);
        let mut late = agent(&kv, &c, Some(2), 1);
        let late_task = tokio::spawn(async move {
            let j = late.next_round(0).await;
            (late, j)
        });
        let Event::Generation(rec) = w0.await.expect("task") else {
            panic!("expected a bump")
        };
        assert_eq!(
            (rec.gen, rec.kind, rec.restarts),
            (1, BumpKind::Membership, 0)
        );
        assert!(rec.reason.contains("scaling up"), "{}", rec.reason);
        assert!(matches!(w1.await.expect("task"), Event::Generation(_)));
        let (r0, r1) = (r0, r1);
        let mut formed = form(&kv, vec![r0, r1]).await;
        let (_, late_joined) = late_task.await.expect("task");
        let late_joined = late_joined.expect("late node joins");
        assert_eq!(late_joined.assignment.world_size, 3);
        assert_eq!(late_joined.assignment.base_global_rank, 2);
        assert_eq!(formed.remove(0).1.assignment.restart_count, 0);
    }

    /// Nodes 0..3 form, a worker failure uses a restart (generation 1), then node 0 and its
    /// store are gone: the survivors, each with what it remembers.
    async fn survivors_of_a_lost_store(c: &Config) -> Vec<(u32, GangMemory)> {
        let old = MemKv::default();
        let formed = form_nodes(&old, c, 3).await;
        let mut agents: Vec<_> = formed.into_iter().map(|(a, _)| a).collect();
        agents[1]
            .report_failure(3, "local rank 0 exited with 3")
            .await
            .expect("bump");
        let formed = form(&old, agents).await;
        formed
            .into_iter()
            .skip(1)
            .map(|(a, j)| {
                assert_eq!(
                    (j.assignment.generation, j.assignment.restart_count),
                    (1, 1)
                );
                let m = a.memory().cloned().expect("a member remembers");
                (j.assignment.node_rank, m)
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_replacement_node_0_adopts_the_survivors_generation_and_restart_count() {
        let c = cfg(3, 3);
        let survivors = survivors_of_a_lost_store(&c).await;
        assert_eq!(survivors[0].1.members, vec![0, 1, 2]);
        // The replacement's store is empty; it starts with the same flags as the first node 0.
        let fresh = MemKv::default();
        let mut agents = vec![agent(&fresh, &c, Some(0), 1)];
        for (rank, memory) in survivors {
            let mut a = agent(&fresh, &c, Some(rank), 1);
            a.carry(memory);
            agents.push(a);
        }
        let formed = form(&fresh, agents).await;
        for (a, j) in &formed {
            assert_eq!(
                (j.assignment.generation, j.assignment.restart_count),
                (2, 1),
                "the generation moves on and the restart budget is not reset"
            );
            assert_eq!(j.assignment.world_size, 3);
            assert!(
                a.reg.memory.is_none(),
                "carried: the new store holds it now"
            );
        }
        let rec = gen_record(&fresh);
        assert_eq!(
            (rec.gen, rec.kind, rec.recovered_from),
            (2, BumpKind::Membership, Some(1))
        );
        assert!(rec.reason.contains("node 0 was replaced"), "{}", rec.reason);
        let kept: GangMemory = serde_json::from_slice(
            &fresh
                .raw_get(&Keys::new("job").memory())
                .expect("memory key"),
        )
        .expect("memory");
        assert_eq!((kept.generation, kept.restarts), (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_survivor_remembering_an_older_generation_cannot_join_the_recovered_gang() {
        let mut c = cfg(2, 3);
        c.last_call_timeout = Duration::from_secs(1);
        let mut survivors = survivors_of_a_lost_store(&c).await;
        let (rank2, _) = survivors.pop().expect("node 2");
        let (rank1, memory1) = survivors.pop().expect("node 1");
        let mut stale = memory1.clone();
        stale.generation = 0;
        stale.restarts = 0;
        let fresh = MemKv::default();
        let mut n1 = agent(&fresh, &c, Some(rank1), 1);
        n1.carry(memory1);
        let mut formed = form(&fresh, vec![agent(&fresh, &c, Some(0), 1), n1]).await;
        assert!(formed.iter().all(|(_, j)| j.assignment.generation == 2));
        let (r1, j1) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        let stop = CancellationToken::new();
        let w0 = spawn_watcher(&r0, &fresh, &j0, &stop);
        let w1 = spawn_watcher(&r1, &fresh, &j1, &stop);
        let mut n2 = agent(&fresh, &c, Some(rank2), 1);
        n2.carry(stale);
        let err = n2.next_round(0).await.expect_err("stale");
        let RdzvError::Rejected(why) = err else {
            panic!("{err:?}")
        };
        assert!(
            why.contains(
                "node 2 is stale: its last generation was 0, the gang's memory is of generation 1"
            ),
            "{why}"
        );
        tokio::time::sleep(c.heartbeat_timeout).await;
        assert!(
            !w0.is_finished() && !w1.is_finished(),
            "turning a stale survivor away costs the running gang nothing"
        );
        assert_eq!(gen_record(&fresh).gen, 2);
        stop.cancel();
        let _ = (w0.await, w1.await);
    }
}
