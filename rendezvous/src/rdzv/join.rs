//! A non-coordinator's side of a round: register in the current generation, wait for node 0's
//! answer, and wait as a spare while the gang is full.

use std::time::Duration;

use tokio::time::{sleep, Instant};
use tracing::{debug, info, warn};

use super::decide::StoreVerdict;
use super::driver::{Joined, Rendezvous};
use super::health::StoreHealth;
use super::kv::{Kv, KvError};
use super::record::{check_fatal, internal, lost, parse_json};
use super::{Answer, RdzvError};

impl<K: Kv> Rendezvous<K> {
    /// Takes the next slot of generation `gen` and writes this node's registration into it
    /// (ADD, SET): how every node, node 0 too, enters a round. Returns the slot.
    pub(super) async fn register(&mut self, gen: u64) -> Result<u64, RdzvError> {
        let slot = self.kv.add(&self.keys.slots(gen), 1).await.map_err(lost)? as u64;
        let body = serde_json::to_vec(&self.reg).map_err(internal)?;
        self.kv
            .set(&self.keys.slot(gen, slot), &body)
            .await
            .map_err(lost)?;
        Ok(slot)
    }

    /// A non-coordinator's join: 5 store operations when nothing goes wrong
    /// (GET gen, ADD slots, SET slot, WAIT answer, GET answer).
    pub(super) async fn join(&mut self) -> Result<Joined, RdzvError> {
        // The coordinator's own deadline comes first, so its message (naming the missing ranks)
        // normally wins; this one only fires when node 0 itself is missing or stuck.
        let join_wait = self.cfg.join_timeout + self.cfg.keep_alive_interval * 2;
        let mut deadline = Instant::now() + join_wait;
        'rounds: loop {
            let (raw, rec) = self.current_gen().await?;
            check_fatal(&rec)?;
            let gen = rec.gen;
            let slot = self.register(gen).await?;
            debug!(gen, slot, "registered");
            let answer_key = self.keys.assign(gen, slot);
            let mut health = StoreHealth::new();
            loop {
                let wait = self.cfg.keep_alive_interval.min(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                );
                match self.kv.wait(std::slice::from_ref(&answer_key), wait).await {
                    Ok(()) => {}
                    Err(KvError::WaitTimeout) => {
                        let (_, now_rec) = self.read_gen().await?;
                        if now_rec.gen != gen {
                            debug!(gen, new = now_rec.gen, "generation moved on while waiting");
                            continue 'rounds;
                        }
                        if Instant::now() >= deadline {
                            return Err(RdzvError::Timeout(format!(
                                "node 0 did not complete round {gen} within {:.1}s (joined as slot {slot})",
                                self.cfg.join_timeout.as_secs_f64()
                            )));
                        }
                        continue;
                    }
                    Err(e) => {
                        match health.judge(&e, &self.cfg) {
                            (StoreVerdict::Lost, why) => return Err(RdzvError::StoreLost(why)),
                            (StoreVerdict::RetryNow, why) => debug!("{why}"),
                            (StoreVerdict::Retry, why) => {
                                warn!("{why}");
                                sleep(self.cfg.keep_alive_interval).await;
                            }
                        }
                        continue;
                    }
                }
                health.ok();
                let value = self.kv.get(&answer_key).await.map_err(lost)?;
                match parse_json::<Answer>(&answer_key, &value)? {
                    Answer::Member(assignment) => {
                        self.spare.send_replace(false);
                        self.remember_round(gen, 0, raw, rec.clone(), &assignment);
                        return Ok(Joined {
                            assignment,
                            record: rec,
                        });
                    }
                    Answer::Superseded => continue 'rounds,
                    Answer::Spare => {
                        // Under the agent's own target: the launch shows this crate's logs
                        // from warn only, and a pod that trains nothing must say why.
                        info!(
                            target: "muster::spare",
                            "waiting as a spare: the gang is full (generation {gen}); this node takes a place at the next round"
                        );
                        self.spare.send_replace(true);
                        self.wait_for_new_generation(gen).await?;
                        // A spare waits as long as the gang runs; the round it is called to
                        // gets the whole join timeout, like a first one.
                        deadline = Instant::now() + join_wait;
                        continue 'rounds;
                    }
                    Answer::Rejected { reason } => return Err(RdzvError::Rejected(reason)),
                    Answer::Timeout { message } => {
                        // Tell node 0 we read it, so it can take the store down.
                        let _ = self.kv.add(&self.keys.acks(gen), 1).await;
                        return Err(RdzvError::Timeout(message));
                    }
                }
            }
        }
    }

    /// A spare's wait: heartbeating, until the generation moves on (a place opens), the job
    /// finishes without it, or the store host is lost. No deadline: a spare of a week-long job
    /// waits a week.
    async fn wait_for_new_generation(&mut self, gen: u64) -> Result<(), RdzvError> {
        let hb = self.keys.heartbeat(&self.reg.agent_id);
        let mut beat: u64 = 0;
        loop {
            beat += 1;
            self.kv
                .set(&hb, beat.to_string().as_bytes())
                .await
                .map_err(lost)?;
            let (_, rec) = self.read_gen().await?;
            if rec.gen != gen {
                return Ok(());
            }
            // Wait for the running generation to end instead of sleeping: a lost member's
            // place is taken at once, and a finished job is seen before node 0 takes the store
            // down (a spare that saw only that would end as if the store host were lost, 205,
            // although the job succeeded).
            let over = self.keys.over(gen);
            match self
                .kv
                .wait(std::slice::from_ref(&over), self.cfg.keep_alive_interval)
                .await
            {
                Ok(()) => {
                    let done = match self.kv.get(&self.keys.done_all(gen)).await {
                        Ok(done) => done,
                        // Node 0 takes the store down only after the job finished (after a new
                        // round it stays up to run it): gone right after the generation ended,
                        // the job finished while this spare was slow to look.
                        Err(e) => {
                            debug!(
                                gen,
                                "the store went right after generation {gen} ended: {e}"
                            );
                            return Err(RdzvError::FinishedAsSpare);
                        }
                    };
                    if !done.is_empty() {
                        return Err(RdzvError::FinishedAsSpare);
                    }
                    let (_, rec) = self.read_gen().await?;
                    if rec.gen != gen {
                        return Ok(());
                    }
                    // `over` without a new generation or a finish: not written by a member
                    // (a stray client); it stays set, so waiting on it again would spin.
                    sleep(self.cfg.keep_alive_interval).await;
                }
                Err(KvError::WaitTimeout) => {}
                Err(e) => return Err(lost(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_util::sync::CancellationToken;

    use super::super::keys::Keys;
    use super::super::kv::mem::MemKv;
    use super::super::kv::Kv;
    use super::super::testkit::*;
    use super::super::{BarrierOutcome, Config, Event, Joined, RdzvError, Rendezvous};

    #[tokio::test(start_paused = true)]
    async fn every_joining_agent_costs_five_store_ops_whatever_the_gang_size() {
        for n in [4_u32, 64] {
            let kv = MemKv::default();
            let c = cfg(n, n);
            let agents: Vec<_> = (0..n).map(|r| agent(&kv, &c, Some(r), 1)).collect();
            let formed = form(&kv, agents).await;
            for (a, _) in &formed[1..] {
                assert_eq!(
                    a.kv.own_ops(),
                    5,
                    "GET gen, ADD slot, SET slot, WAIT, GET answer"
                );
            }
            // The coordinator: per poll one ADD and at most one MULTI_GET, plus a constant.
            let coordinator = formed[0].0.kv.own_ops();
            assert!(
                coordinator < 40,
                "coordinator used {coordinator} ops for {n} agents"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_joiner_that_arrives_before_node_0_opened_a_round_sees_no_new_round() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        // Node 1 runs first, so it reads the generation before node 0 has written any.
        let mut formed = form(
            &kv,
            vec![agent(&kv, &c, Some(1), 1), agent(&kv, &c, Some(0), 1)],
        )
        .await;
        let (r0, j0) = formed.pop().expect("node 0");
        let (r1, j1) = formed.pop().expect("node 1");
        assert_eq!((j0.assignment.generation, j1.assignment.generation), (0, 0));
        let stop = CancellationToken::new();
        let w0 = spawn_watcher(&r0, &kv, &j0, &stop);
        let w1 = spawn_watcher(&r1, &kv, &j1, &stop);
        tokio::time::sleep(c.heartbeat_timeout * 2).await;
        assert!(
            !w1.is_finished() && !w0.is_finished(),
            "the first round must stay the current one"
        );
        stop.cancel();
        assert_eq!(w0.await.expect("task"), Event::Stopped);
        assert_eq!(w1.await.expect("task"), Event::Stopped);
    }

    /// A gang of two and a third node waiting as a spare (answered by node 0's watcher).
    async fn gang_and_spare(
        kv: &MemKv,
        c: &Config,
        stop: &CancellationToken,
    ) -> (
        Vec<(Rendezvous<MemKv>, Joined)>,
        tokio::task::JoinHandle<Result<Joined, RdzvError>>,
    ) {
        let formed = form_nodes(kv, c, 2).await;
        // Both watch (and so heartbeat): node 1 is not lost while the spare waits.
        for (r, j) in &formed {
            let _w = spawn_watcher(r, kv, j, stop);
        }
        let mut spare = agent(kv, c, None, 1);
        let spare = tokio::spawn(async move { spare.next_round(0).await });
        // Long enough for node 0's watcher to read the newcomer and answer it "spare".
        tokio::time::sleep(c.heartbeat_timeout * 2).await;
        assert!(!spare.is_finished(), "the spare must wait");
        (formed, spare)
    }

    #[tokio::test(start_paused = true)]
    async fn a_spare_waits_past_the_join_timeout_and_leaves_with_success_when_the_gang_finishes_without_it(
    ) {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let stop = CancellationToken::new();
        let (mut formed, spare) = gang_and_spare(&kv, &c, &stop).await;
        // A spare waits as long as the gang runs, far past the join timeout.
        tokio::time::sleep(c.join_timeout * 3).await;
        assert!(!spare.is_finished(), "the spare must still wait");
        let (r1, j1) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        let b0 = spawn_barrier(r0, j0, CancellationToken::new());
        let b1 = spawn_barrier(r1, j1, CancellationToken::new());
        assert_eq!(
            b0.await.expect("task").expect("barrier"),
            BarrierOutcome::Done
        );
        assert_eq!(
            b1.await.expect("task").expect("barrier"),
            BarrierOutcome::Done
        );
        let out = spare.await.expect("task");
        assert!(matches!(out, Err(RdzvError::FinishedAsSpare)), "{out:?}");
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_stray_wake_up_key_neither_ends_a_spare_nor_spins_it() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let stop = CancellationToken::new();
        let (_formed, spare) = gang_and_spare(&kv, &c, &stop).await;
        let keys = Keys::new(&c.run_id);
        let mut stray = kv.connect();
        stray.set(&keys.over(0), b"bump").await.expect("set");
        let before = kv.ops();
        tokio::time::sleep(c.keep_alive_interval * 10).await;
        assert!(!spare.is_finished(), "the spare must still wait");
        // A handful of operations per keep-alive interval, not a busy loop.
        assert!(
            kv.ops() - before < 200,
            "{} store operations",
            kv.ops() - before
        );
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_spare_that_loses_the_store_host_without_a_finish_reports_it_lost() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let stop = CancellationToken::new();
        let (_formed, spare) = gang_and_spare(&kv, &c, &stop).await;
        kv.take_down();
        let out = spare.await.expect("task");
        assert!(matches!(out, Err(RdzvError::StoreLost(_))), "{out:?}");
        stop.cancel();
    }
}
