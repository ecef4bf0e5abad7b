//! Leaving together: the exit barrier after success, counting out after the job's fatal end,
//! and node 0 keeping the store up until the others have left.

use std::time::Duration;

use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::decide::{self, Barrier, Report, StoreVerdict};
use super::driver::Rendezvous;
use super::health::StoreHealth;
use super::kv::{Kv, KvError};
use super::record::{lost, wake_spares};
use super::{Assignment, RdzvError};

/// How the exit barrier ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarrierOutcome {
    /// Everyone arrived.
    Done,
    /// The exit barrier timeout passed; leaving anyway (success on this node).
    TimedOut,
    /// `interrupt` fired while waiting (the generation moved on).
    Interrupted,
}

impl<K: Kv> Rendezvous<K> {
    /// Node 0 keeps the store up until `expected` agents counted themselves out on `key`, or
    /// `at_least` (and never less than a couple of keep-alive intervals) passed. After a
    /// completed exit barrier it waits up to the heartbeat timeout: a loaded node may be slow
    /// to observe the completion, and leaving earlier would turn its success into "store lost".
    pub(super) async fn linger(&mut self, key: &[u8], expected: i64, at_least: Duration) {
        let until = Instant::now() + at_least.max(self.cfg.keep_alive_interval * 2);
        while Instant::now() < until {
            match self.kv.add(key, 0).await {
                Ok(n) if n >= expected => return,
                Ok(_) => sleep(self.cfg.poll_interval).await,
                Err(_) => return,
            }
        }
        debug!("not every agent confirmed before node 0 leaves");
    }

    /// Waits until every member's workers succeeded. `interrupt` fires when the watcher saw
    /// the generation move on (someone failed after we finished): the caller re-joins. A new
    /// generation only follows an abort made while the barrier was open ([`decide::decide_abort`]),
    /// so once this node's report completed the barrier, or it reads the barrier complete, it
    /// leaves with success whatever its watcher saw.
    pub async fn exit_barrier(
        &mut self,
        a: &Assignment,
        interrupt: &CancellationToken,
    ) -> Result<BarrierOutcome, RdzvError> {
        let gen = a.generation;
        let size = a.group_world_size;
        let after = self.kv.add(&self.keys.done(gen), 1).await.map_err(lost)?;
        let (report, why) = decide::decide_report(after, size);
        debug!("{why}");
        match report {
            Report::TooLate => return Ok(BarrierOutcome::Interrupted),
            Report::Completed => self.wake_barrier(gen).await?,
            Report::Waiting { .. } => {}
        }
        if !self.cfg.barrier_observe_delay.is_zero() {
            // Test hook (see `Config::barrier_observe_delay`): observe completion late.
            sleep(self.cfg.barrier_observe_delay).await;
        }
        let deadline = Instant::now() + self.cfg.exit_barrier_timeout;
        let key = self.keys.done_all(gen);
        let mut health = StoreHealth::new();
        let outcome = loop {
            // One long WAIT per keep-alive interval rather than short polls: thousands of agents
            // waiting here would otherwise keep the store host busy with WAIT/CANCEL pairs just
            // when it is busiest. The watcher's `interrupt` cuts the WAIT short (the store
            // connection drops the cancelled operation and reconnects).
            let waited = tokio::select! {
                r = self.kv.wait(std::slice::from_ref(&key), self.cfg.keep_alive_interval) => r,
                () = interrupt.cancelled() => Err(KvError::WaitTimeout),
            };
            match waited {
                Ok(()) => break BarrierOutcome::Done,
                Err(KvError::WaitTimeout) => {
                    health.ok();
                    if interrupt.is_cancelled() {
                        // The watcher fired. The counter, not the order in which this node
                        // happens to see things, says whether the barrier completed.
                        let value = self.kv.add(&self.keys.done(gen), 0).await.map_err(lost)?;
                        if decide::barrier_state(value, size) == Barrier::Complete {
                            self.wake_barrier(gen).await?;
                            break BarrierOutcome::Done;
                        }
                        return Ok(BarrierOutcome::Interrupted);
                    }
                    if Instant::now() >= deadline {
                        warn!(
                            "exit barrier: not every node finished within {:.1}s; leaving",
                            self.cfg.exit_barrier_timeout.as_secs_f64()
                        );
                        break BarrierOutcome::TimedOut;
                    }
                }
                Err(e) => match health.judge(&e, &self.cfg) {
                    (StoreVerdict::Lost, why) => return Err(RdzvError::StoreLost(why)),
                    (StoreVerdict::RetryNow, why) => debug!("{why}"),
                    (StoreVerdict::Retry, why) => {
                        warn!("exit barrier: {why}");
                        sleep(self.cfg.keep_alive_interval).await;
                    }
                },
            }
        };
        if self.reg.coordinator {
            let others = i64::from(size) - 1;
            self.linger(&self.keys.left(gen), others, self.cfg.heartbeat_timeout)
                .await;
        } else {
            let _ = self.kv.add(&self.keys.left(gen), 1).await;
        }
        Ok(outcome)
    }

    /// After the job's fatal end (a [`super::BumpKind::Fatal`] generation): members count
    /// themselves out on `g<G>/left`, and node 0 keeps the store up until they have (at most the
    /// heartbeat timeout), so that leaving right after its own ranks failed does not look to
    /// members still stopping theirs like a lost store host — they would wait for a replacement
    /// instead of ending with the job, and could not read the failure board.
    pub async fn leave_after_fatal(&mut self, a: &Assignment) {
        if self.reg.coordinator {
            let others = i64::from(a.group_world_size) - 1;
            self.linger(
                &self.keys.left(a.generation),
                others,
                self.cfg.heartbeat_timeout,
            )
            .await;
        } else {
            let _ = self.kv.add(&self.keys.left(a.generation), 1).await;
        }
    }

    /// SETs `g<G>/done_all`, which releases every waiter of the barrier (idempotent).
    async fn wake_barrier(&mut self, gen: u64) -> Result<(), RdzvError> {
        self.kv
            .set(&self.keys.done_all(gen), b"1")
            .await
            .map_err(lost)?;
        wake_spares(&mut self.kv, &self.keys, gen, b"done").await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::Instant;
    use tokio_util::sync::CancellationToken;

    use super::super::decide;
    use super::super::keys::Keys;
    use super::super::kv::mem::MemKv;
    use super::super::kv::{Kv, KvError};
    use super::super::testkit::*;
    use super::super::{BarrierOutcome, BumpKind, Event};

    #[tokio::test(start_paused = true)]
    async fn the_exit_barrier_waits_for_the_last_finisher() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let mut formed = form_nodes(&kv, &c, 2).await;
        let (mut r1, j1) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        let mut r0 = r0;
        let early = tokio::spawn(async move {
            let out = r0
                .exit_barrier(&j0.assignment, &CancellationToken::new())
                .await;
            (out, Instant::now())
        });
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!early.is_finished());
        let finished = Instant::now();
        let late = r1
            .exit_barrier(&j1.assignment, &CancellationToken::new())
            .await
            .expect("barrier");
        assert_eq!(late, BarrierOutcome::Done);
        let (out, at) = early.await.expect("task");
        assert_eq!(out.expect("barrier"), BarrierOutcome::Done);
        assert!(at >= finished);
    }

    /// A store connection on which another member's report lands just before this connection's
    /// abort: the interleaving "the watcher fires between the last report and the completion".
    struct ReportBeforeAbort {
        done_key: Vec<u8>,
    }

    impl Hook for ReportBeforeAbort {
        async fn before(&mut self, store: &MemKv, call: Call<'_>) -> Result<(), KvError> {
            if let Call::Add { key, delta } = call {
                if delta == decide::ABORT && key == self.done_key.as_slice() {
                    // The last member's report (its ADD) lands first; it has not woken anyone yet.
                    store.connect().add(key, 1).await?;
                }
            }
            Ok(())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_that_leaves_right_after_completion_is_not_lost_while_node_0_has_not_observed_it(
    ) {
        let kv = MemKv::default();
        let mut c = cfg(3, 3);
        let mut formed = form_nodes(&kv, &c, 3).await;
        let (r2, j2) = formed.pop().expect("node 2");
        let (r1, j1) = formed.pop().expect("node 1");
        let (mut r0, j0) = formed.pop().expect("node 0");
        // Node 0 reports, then looks for completion only much later (past every timeout).
        c.barrier_observe_delay = c.heartbeat_timeout * 10;
        r0.cfg = c.clone();
        let fired0 = CancellationToken::new();
        let presence = Arc::new(FakePresence::default());
        let w0 = spawn_watcher_with_presence(&r0, &kv, &j0, &presence, &fired0);
        let stop1 = CancellationToken::new();
        let stop2 = CancellationToken::new();
        let w1 = spawn_watcher(&r1, &kv, &j1, &stop1);
        let w2 = spawn_watcher(&r2, &kv, &j2, &stop2);
        let b0 = spawn_barrier(r0, j0, fired0.clone());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let b1 = spawn_barrier(r1, j1, CancellationToken::new());
        let b2 = spawn_barrier(r2, j2, CancellationToken::new());
        for (b, stop, w) in [(b1, &stop1, w1), (b2, &stop2, w2)] {
            assert_eq!(
                b.await.expect("task").expect("barrier"),
                BarrierOutcome::Done
            );
            // The node leaves: its watcher stops and its heartbeats with it.
            stop.cancel();
            assert_eq!(w.await.expect("task"), Event::Stopped);
        }
        let ev = w0.await.expect("task");
        assert_eq!(
            ev,
            Event::Completed,
            "node 0's watcher must not judge after completion"
        );
        assert!(!fired0.is_cancelled(), "completion stops nothing");
        assert_eq!(
            b0.await.expect("task").expect("barrier"),
            BarrierOutcome::Done
        );
        assert_eq!(gen_record(&kv).gen, 0, "no re-form after completion");
    }

    #[tokio::test(start_paused = true)]
    async fn the_watcher_firing_between_the_last_report_and_the_completion_changes_nothing() {
        let kv = MemKv::default();
        let c = cfg(3, 3);
        let mut formed = form_nodes(&kv, &c, 3).await;
        let (_r2, j2) = formed.pop().expect("node 2");
        let (r1, j1) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        // Node 2 never heartbeats, so node 0's watcher judges it lost; its report lands between
        // that judgement and node 0's abort.
        let done_key = Keys::new("job").done(j2.assignment.generation);
        let watch_kv = Hooked::new(&kv, ReportBeforeAbort { done_key });
        let fired0 = CancellationToken::new();
        let w0 = tokio::spawn(
            r0.watcher(watch_kv, &j0.assignment)
                .run(CancellationToken::new(), fired0.clone()),
        );
        let stop1 = CancellationToken::new();
        let w1 = spawn_watcher(&r1, &kv, &j1, &stop1);
        let b0 = spawn_barrier(r0, j0, fired0.clone());
        let b1 = spawn_barrier(r1, j1, CancellationToken::new());
        assert_eq!(w0.await.expect("task"), Event::Completed);
        assert!(!fired0.is_cancelled());
        assert_eq!(
            b0.await.expect("task").expect("barrier"),
            BarrierOutcome::Done
        );
        assert_eq!(
            b1.await.expect("task").expect("barrier"),
            BarrierOutcome::Done
        );
        stop1.cancel();
        assert_eq!(w1.await.expect("task"), Event::Stopped);
        assert_eq!(gen_record(&kv).gen, 0, "no re-form after completion");
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_that_reports_finished_and_then_dies_before_completion_is_a_failure() {
        let kv = MemKv::default();
        let c = cfg(3, 3);
        let mut formed = form_nodes(&kv, &c, 3).await;
        let (r2, j2) = formed.pop().expect("node 2");
        let (mut r1, j1) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        let a2 = SocketAddr::from(([127, 0, 0, 2], 4002));
        let presence = Arc::new(FakePresence::default());
        presence.set(a2, true);
        let fired0 = CancellationToken::new();
        let w0 = spawn_watcher_with_presence(&r0, &kv, &j0, &presence, &fired0);
        let stop1 = CancellationToken::new();
        let w1 = spawn_watcher(&r1, &kv, &j1, &stop1);
        let stop2 = CancellationToken::new();
        let w2 = spawn_watcher_at(&r2, &kv, &j2, a2, &stop2);
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Node 2 reports finished, then its process dies before node 1 finishes: the kernel
        // closes its connection.
        let f2 = CancellationToken::new();
        let b2 = spawn_barrier(r2, j2, f2);
        tokio::time::sleep(Duration::from_millis(200)).await;
        b2.abort();
        stop2.cancel();
        let _ = w2.await;
        presence.set(a2, false);
        let died = Instant::now();
        let Event::Generation(rec) = w0.await.expect("task") else {
            panic!("node 0 must end the generation")
        };
        assert!(fired0.is_cancelled());
        assert_eq!((rec.gen, rec.kind), (1, BumpKind::Membership));
        assert!(
            rec.reason.contains("node 2 (a2)") && rec.reason.contains("connection closed"),
            "{}",
            rec.reason
        );
        assert!(
            Instant::now() - died <= c.keep_alive_interval * 3,
            "a closed connection is lost within about a keep-alive interval, not the heartbeat timeout"
        );
        // Node 1 finishes afterwards: its report is too late to complete anything.
        let out = r1
            .exit_barrier(&j1.assignment, &CancellationToken::new())
            .await
            .expect("barrier");
        assert_eq!(out, BarrierOutcome::Interrupted);
        stop1.cancel();
        let _ = w1.await;
    }
}
