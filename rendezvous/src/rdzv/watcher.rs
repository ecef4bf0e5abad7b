//! While workers run: heartbeat and watch the generation; on node 0 also judge the members'
//! heartbeats and answer newcomers, ending the generation when needed.

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::Arc;

use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::decide::{self, Abort, Barrier, Beat, Link, Liveness, StoreVerdict};
use super::driver::{Rendezvous, SpareHosts};
use super::health::StoreHealth;
use super::keys::Keys;
use super::kv::{Kv, KvError};
use super::record::{internal, parse_json, wake_spares};
use super::recovery::{self, GangMemory};
use super::{Answer, Assignment, Config, GenRecord, Registration};

/// What ended a [`Watcher`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The generation moved on (bumped by anyone, including this node's coordinator logic).
    Generation(GenRecord),
    /// The store host (node 0) is lost: its connection refused or closed (at once), or no
    /// answer for as long as the evidence allows ([`decide::decide_store_fault`]).
    StoreLost(String),
    /// Node 0 only: the round's exit barrier completed, so the generation succeeded and there is
    /// nothing left to judge. Not a reason to stop anything (`fired` is not cancelled).
    Completed,
    /// Asked to stop.
    Stopped,
}

/// Whether a store connection, named by the peer address the store host sees, is open now.
/// Node 0 hosts the store, so it can answer this for every member.
pub trait Presence: Send + Sync {
    fn is_open(&self, peer: SocketAddr) -> bool;

    /// Notified whenever a connection closes, so node 0's watcher judges its members at once
    /// instead of at its next keep-alive tick; `None`: only at ticks.
    fn closes(&self) -> Option<&tokio::sync::Notify> {
        None
    }
}

impl<K: Kv> Rendezvous<K> {
    /// A watcher for the round just joined, on its own store connection `kv`.
    pub fn watcher<W: Kv>(&self, kv: W, a: &Assignment) -> Watcher<W> {
        Watcher {
            kv,
            cfg: self.cfg.clone(),
            keys: self.keys.clone(),
            agent_id: self.reg.agent_id.clone(),
            node_rank: a.node_rank,
            coordinator: self.reg.coordinator,
            gen: a.generation,
            gen_raw: self.gen_raw.clone(),
            members: a.members.clone(),
            group_size: a.group_world_size,
            answered: self.last_round.map_or(0, |(_, n)| n),
            presence: None,
            bump: None,
            spares: self.spares.clone(),
            held_ranks: self.held_ranks.clone(),
        }
    }
}

/// How long one WAIT for the generation's end lasts before it is cancelled and sent again (the
/// store cancels a WAIT cleanly; a long one only saves requests).
const BUMP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// A WAIT, on a connection of its own, for the key every bump of the watched generation sets
/// ([`Keys::over`]): the bump reaches this node as soon as it happens, not at its next
/// keep-alive tick (issue #41: with the default 5 s interval a rank killed on one node left the
/// others training into gloo's error for 2.7 s, and the restart waited for them).
struct BumpWait {
    task: tokio::task::JoinHandle<()>,
    ended: Arc<tokio::sync::Notify>,
}

impl Drop for BumpWait {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Resolves once `bump` saw the generation end; never without one (or after its connection
/// failed: the ticks still read the generation).
async fn generation_ended(bump: Option<&BumpWait>) {
    match bump {
        Some(b) => b.ended.notified().await,
        None => std::future::pending().await,
    }
}

/// Watches one running round; see [`Watcher::run`].
pub struct Watcher<K: Kv> {
    kv: K,
    cfg: Config,
    keys: Keys,
    agent_id: String,
    node_rank: u32,
    coordinator: bool,
    gen: u64,
    gen_raw: Vec<u8>,
    members: Vec<(u32, String)>,
    group_size: u32,
    answered: u64,
    /// Node 0's view of the members' connections (it hosts the store); `None` elsewhere.
    presence: Option<Arc<dyn Presence>>,
    bump: Option<BumpWait>,
    spares: SpareHosts,
    held_ranks: Vec<u32>,
}

/// What node 0 knows of the connection one member heartbeats on.
#[derive(Debug, Clone, Default)]
struct Conn {
    /// The address the member published with its last heartbeat.
    addr: Option<SocketAddr>,
    /// Whether that address was ever seen open: only then does "not open" mean "closed".
    seen_open: bool,
    /// When it was first seen closed.
    closed_at: Option<Instant>,
}

/// Resolves when `presence` says a store connection closed; never without one.
async fn connection_closed(presence: Option<&dyn Presence>) {
    match presence.and_then(Presence::closes) {
        Some(closes) => closes.notified().await,
        None => std::future::pending().await,
    }
}

/// A heartbeat value: the counter, then the address of the connection it was sent on.
fn heartbeat_value(seq: u64, addr: Option<SocketAddr>) -> Vec<u8> {
    match addr {
        Some(addr) => format!("{seq} {addr}").into_bytes(),
        None => seq.to_string().into_bytes(),
    }
}

fn heartbeat_addr(value: &[u8]) -> Option<SocketAddr> {
    let text = std::str::from_utf8(value).ok()?;
    text.split_once(' ')?.1.parse().ok()
}

impl<K: Kv> Watcher<K> {
    /// Lets node 0's watcher ask the store whether a silent member's connection is open.
    #[must_use]
    pub fn with_presence(mut self, presence: Arc<dyn Presence>) -> Self {
        self.presence = Some(presence);
        self
    }

    /// Learns of a bump of the watched generation at once, through a WAIT on `kv`, a store
    /// connection of its own (a WAIT holds its connection until the key appears).
    #[must_use]
    pub fn with_bump_wait<W: Kv + 'static>(mut self, mut kv: W) -> Self {
        let over = self.keys.over(self.gen);
        let ended = Arc::new(tokio::sync::Notify::new());
        let notify = Arc::clone(&ended);
        let task = tokio::spawn(async move {
            loop {
                match kv.wait(std::slice::from_ref(&over), BUMP_WAIT).await {
                    Ok(()) => {
                        // A permit, should the watcher be between two selects.
                        notify.notify_one();
                        return;
                    }
                    Err(KvError::WaitTimeout) => {}
                    Err(e) => {
                        debug!("the wait for the generation's end failed ({e}); ticks only");
                        return;
                    }
                }
            }
        });
        self.bump = Some(BumpWait { task, ended });
        self
    }

    /// Every keep-alive interval: heartbeat, read the generation; on node 0 also judge the
    /// members' heartbeats and look for newcomers. Returns at the first event; `stop` is only
    /// looked at between ticks, so a store operation is never cut in half. `fired` is cancelled
    /// just before an event is returned, so the caller can stop its workers at once.
    pub async fn run(mut self, stop: CancellationToken, fired: CancellationToken) -> Event {
        let event = self.watch(&stop).await;
        if !matches!(event, Event::Stopped | Event::Completed) {
            fired.cancel();
        }
        event
    }

    async fn watch(&mut self, stop: &CancellationToken) -> Event {
        let hb_key = self.keys.heartbeat(&self.agent_id);
        let gen_key = self.keys.gen();
        let started = Instant::now();
        let mut beats: Vec<Beat> = self
            .members
            .iter()
            .filter(|(r, _)| *r != self.node_rank)
            .map(|(r, id)| Beat {
                node_rank: *r,
                who: id.clone(),
                last_value: Vec::new(),
                changed_at: started,
                link: Link::Unknown,
                closed_at: None,
            })
            .collect();
        let mut conns = vec![Conn::default(); beats.len()];
        let mut health = StoreHealth::new();
        let mut seq: u64 = 0;
        let mut seen_slots = self.answered;
        loop {
            let tick: Result<Option<Event>, KvError> = async {
                seq += 1;
                if !self.coordinator {
                    let value = heartbeat_value(seq, self.kv.local_addr());
                    self.kv.set(&hb_key, &value).await?;
                }
                let raw = self.kv.get(&gen_key).await?;
                if raw != self.gen_raw {
                    return Ok(Some(match parse_json::<GenRecord>(&gen_key, &raw) {
                        Ok(rec) => Event::Generation(rec),
                        Err(e) => Event::StoreLost(e.to_string()),
                    }));
                }
                if self.coordinator {
                    return self
                        .coordinate_tick(&mut beats, &mut conns, &mut seen_slots)
                        .await;
                }
                Ok(None)
            }
            .await;
            match tick {
                Ok(Some(event)) => return event,
                Ok(None) => health.ok(),
                Err(e) => match health.judge(&e, &self.cfg) {
                    (StoreVerdict::Lost, why) => return Event::StoreLost(why),
                    (StoreVerdict::RetryNow, why) => {
                        debug!("{why}");
                        continue;
                    }
                    (StoreVerdict::Retry, why) => warn!("{why}"),
                },
            }
            // A member seen closed is judged again when its grace is up, not a tick later.
            let next = if conns.iter().any(|c| c.closed_at.is_some()) {
                decide::silence_allowed(Link::Closed, &self.cfg)
            } else {
                self.cfg.keep_alive_interval
            };
            let presence = self.presence.clone();
            tokio::select! {
                () = stop.cancelled() => return Event::Stopped,
                () = sleep(next) => {}
                () = generation_ended(self.bump.as_ref()) => {
                    debug!("the generation ended; reading it at once");
                }
                // A dead store host closes our idle connection: look now, not at the next tick.
                () = self.kv.closed() => debug!("the store connection closed; checking at once"),
                // Node 0: a member's agent that died closed its connection; judge it now.
                () = connection_closed(presence.as_deref()) => {
                    debug!("a connection to the store closed; judging the members at once");
                }
            }
        }
    }

    /// Node 0's part of a tick: the exit barrier first, then the members' liveness, then the
    /// registrations of newcomers.
    async fn coordinate_tick(
        &mut self,
        beats: &mut [Beat],
        conns: &mut [Conn],
        seen_slots: &mut u64,
    ) -> Result<Option<Event>, KvError> {
        // Completion first: once every member reported, nobody is judged, however late this
        // tick comes.
        let done = self.kv.add(&self.keys.done(self.gen), 0).await?;
        let barrier = decide::barrier_state(done, self.group_size);
        if barrier == Barrier::Aborted {
            // Someone ended this generation; its new record is on its way.
            return Ok(None);
        }
        if !beats.is_empty() {
            if let ControlFlow::Break(event) = self.judge_members(beats, conns, barrier).await? {
                return Ok(event);
            }
        } else if barrier == Barrier::Complete {
            return Ok(Some(Event::Completed));
        }
        self.answer_newcomers(seen_slots).await
    }

    /// Node 0: reads the members' heartbeats and judges them. `Break` ends the tick with its
    /// event (the barrier completed, or a lost member ended the generation); `Continue`: all
    /// alive.
    async fn judge_members(
        &mut self,
        beats: &mut [Beat],
        conns: &mut [Conn],
        barrier: Barrier,
    ) -> Result<ControlFlow<Option<Event>>, KvError> {
        let keys: Vec<Vec<u8>> = beats.iter().map(|b| self.keys.heartbeat(&b.who)).collect();
        let values = self.kv.multi_get(&keys).await?;
        let now = Instant::now();
        for ((beat, conn), value) in beats.iter_mut().zip(conns.iter_mut()).zip(values) {
            if value != beat.last_value {
                let addr = heartbeat_addr(&value);
                if addr != conn.addr {
                    *conn = Conn {
                        addr,
                        seen_open: false,
                        closed_at: None,
                    };
                }
                beat.last_value = value;
                beat.changed_at = now;
            }
            beat.link = self.link(conn, now);
            beat.closed_at = conn.closed_at;
        }
        let (verdict, reason) = decide::decide_liveness(now, beats, barrier, &self.cfg);
        match verdict {
            Liveness::Completed => {
                debug!("{reason}");
                Ok(ControlFlow::Break(Some(Event::Completed)))
            }
            Liveness::Lost(dead) => {
                let fatal =
                    decide::decide_unreplaceable_loss(dead.len(), self.group_size, &self.cfg);
                let event = match fatal {
                    Some((code, why)) => {
                        self.end_generation(format!("lost {reason}; {why}"), Some(code))
                            .await?
                    }
                    None => self.end_generation(format!("lost {reason}"), None).await?,
                };
                Ok(ControlFlow::Break(event))
            }
            Liveness::Alive => Ok(ControlFlow::Continue(())),
        }
    }

    /// Node 0: reads the registrations that arrived since `seen_slots` during the generation:
    /// survivors of a lost store host are adopted (a new round) or turned away, an admissible
    /// newcomer ends the generation, the others are answered "spare".
    async fn answer_newcomers(&mut self, seen_slots: &mut u64) -> Result<Option<Event>, KvError> {
        let count = self.kv.add(&self.keys.slots(self.gen), 0).await? as u64;
        if count <= *seen_slots {
            return Ok(None);
        }
        let keys: Vec<Vec<u8>> = (*seen_slots + 1..=count)
            .map(|i| self.keys.slot(self.gen, i))
            .collect();
        let values = self.kv.multi_get(&keys).await?;
        let readable = values.iter().take_while(|v| !v.is_empty()).count() as u64;
        let first = *seen_slots + 1;
        let registered: Vec<(u64, Registration)> = (first..)
            .zip(values.iter().take_while(|v| !v.is_empty()))
            .filter_map(|(slot, v)| Some((slot, serde_json::from_slice(v).ok()?)))
            .collect();
        // Survivors of a lost store host first: a stale one is turned away without costing
        // the running gang a re-form; one remembering a newer generation than this store's
        // means the gang must re-form here to adopt it.
        let mut turned_away: Vec<(u64, String)> = Vec::new();
        if registered.iter().any(|(_, r)| r.memory.is_some()) {
            let current: GenRecord =
                serde_json::from_slice(&self.gen_raw).unwrap_or_else(|_| GenRecord::first());
            let memories: Vec<(usize, Option<u32>, &GangMemory)> = registered
                .iter()
                .enumerate()
                .filter_map(|(i, (_, r))| r.memory.as_ref().map(|m| (i, r.node_rank, m)))
                .collect();
            let (decision, why) = recovery::decide_memories(&current, &memories, &self.cfg);
            if decision.adopt.is_some() {
                return self.end_generation(why, None).await;
            }
            turned_away = decision
                .rejected
                .into_iter()
                .map(|(i, reason)| (registered[i].0, reason))
                .collect();
        }
        let newcomers: Vec<Registration> = registered
            .into_iter()
            .filter(|(slot, _)| !turned_away.iter().any(|(t, _)| t == slot))
            .map(|(_, r)| r)
            .collect();
        let members: Vec<u32> = self.members.iter().map(|(r, _)| *r).collect();
        let (restart, reason) =
            decide::decide_newcomers(&members, &self.held_ranks, &newcomers, &self.cfg);
        if restart {
            return self.end_generation(reason, None).await;
        }
        // Spares stay registered; tell them once and stop re-reading them.
        if readable > 0 {
            // Under the agent's target, like the spare's own line: node 0 says who waits.
            info!(target: "muster::spare", "{reason}");
            if let Ok(mut list) = self.spares.lock() {
                list.extend(newcomers.iter().map(|r| r.host.clone()));
            }
            let spare = serde_json::to_vec(&Answer::Spare).unwrap_or_default();
            let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
            for slot in first..first + readable {
                let body = match turned_away.iter().find(|(t, _)| *t == slot) {
                    Some((_, why)) => {
                        warn!("turning away slot {slot}: {why}");
                        serde_json::to_vec(&Answer::Rejected {
                            reason: why.clone(),
                        })
                        .unwrap_or_default()
                    }
                    None => spare.clone(),
                };
                pairs.push((self.keys.assign(self.gen, slot), body));
            }
            self.kv.multi_set(&pairs).await?;
            *seen_slots += readable;
        }
        Ok(None)
    }

    /// What node 0 knows of one member's connection now.
    fn link(&self, conn: &mut Conn, now: Instant) -> Link {
        let (Some(presence), Some(addr)) = (&self.presence, conn.addr) else {
            return Link::Unknown;
        };
        if presence.is_open(addr) {
            conn.seen_open = true;
            conn.closed_at = None;
            Link::Open
        } else if conn.seen_open {
            conn.closed_at.get_or_insert(now);
            Link::Closed
        } else {
            Link::Unknown
        }
    }

    /// Ends the running generation early, unless its exit barrier completed first: the abort
    /// and the reports meet on one counter ([`decide::decide_abort`]).
    /// Aborts the running generation for `reason`; the next one is a membership change, or with
    /// `fatal` the job's end for every node with that code.
    async fn end_generation(
        &mut self,
        reason: String,
        fatal: Option<u8>,
    ) -> Result<Option<Event>, KvError> {
        let after = self
            .kv
            .add(&self.keys.done(self.gen), decide::ABORT)
            .await?;
        let (abort, why) = decide::decide_abort(after, self.group_size);
        match abort {
            Abort::Won => self.bump(reason, fatal).await,
            Abort::Completed => {
                info!("not acting on \"{reason}\": {why}");
                // The last reporter may not have woken the barrier yet.
                self.kv.set(&self.keys.done_all(self.gen), b"1").await?;
                wake_spares(&mut self.kv, &self.keys, self.gen, b"done").await;
                Ok(Some(Event::Completed))
            }
            Abort::Follow => {
                debug!("{why}");
                Ok(None)
            }
        }
    }

    async fn bump(&mut self, reason: String, fatal: Option<u8>) -> Result<Option<Event>, KvError> {
        let current: GenRecord = match serde_json::from_slice(&self.gen_raw) {
            Ok(rec) => rec,
            Err(e) => {
                return Ok(Some(Event::StoreLost(format!(
                    "unreadable generation: {e}"
                ))))
            }
        };
        let next = match fatal {
            Some(code) => decide::fatal_bump(&current, Some(self.node_rank), code, reason.clone()),
            None => decide::membership_bump(&current, self.node_rank, reason.clone()),
        };
        let key = self.keys.gen();
        let body = match serde_json::to_vec(&next) {
            Ok(body) => body,
            Err(e) => return Ok(Some(Event::StoreLost(internal(e).to_string()))),
        };
        // Store failures go back to the tick, which judges them like any other.
        let now = self.kv.compare_set(&key, &self.gen_raw, &body).await?;
        match parse_json::<GenRecord>(&key, &now) {
            Ok(rec) => {
                if rec == next {
                    warn!("{reason}; starting round {}", next.gen);
                    wake_spares(&mut self.kv, &self.keys, current.gen, b"bump").await;
                }
                Ok(Some(Event::Generation(rec)))
            }
            Err(e) => Ok(Some(Event::StoreLost(e.to_string()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::{sleep, Instant};
    use tokio_util::sync::CancellationToken;

    use super::super::decide;
    use super::super::kv::mem::MemKv;
    use super::super::kv::KvError;
    use super::super::testkit::*;
    use super::super::{BumpKind, Event, RdzvError};

    #[tokio::test(start_paused = true)]
    async fn a_silent_member_is_dead_after_the_heartbeat_timeout_and_it_costs_no_restart() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let mut formed = form_nodes(&kv, &c, 2).await;
        let (r0, j0) = formed.remove(0);
        // Node 1 never starts its watcher: it is dead.
        let w = r0.watcher(kv.clone(), &j0.assignment);
        let fired = CancellationToken::new();
        let started = Instant::now();
        let ev = w.run(CancellationToken::new(), fired.clone()).await;
        let took = Instant::now() - started;
        assert!(fired.is_cancelled());
        let Event::Generation(rec) = ev else {
            panic!("{ev:?}")
        };
        assert_eq!(
            (rec.gen, rec.kind, rec.restarts),
            (1, BumpKind::Membership, 0)
        );
        assert!(rec.reason.contains("node 1 (a1) silent"), "{}", rec.reason);
        assert!(
            took >= c.heartbeat_timeout && took <= c.heartbeat_timeout + c.keep_alive_interval * 2,
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_live_member_keeps_the_round_and_a_failure_restarts_everyone_until_the_budget_ends() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let mut formed = form_nodes(&kv, &c, 2).await;
        let (mut r1, j1) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        let stop = CancellationToken::new();
        let w0 = spawn_watcher(&r0, &kv, &j0, &stop);
        let w1 = spawn_watcher(&r1, &kv, &j1, &stop);
        tokio::time::sleep(c.heartbeat_timeout * 3).await;
        assert!(
            !w0.is_finished() && !w1.is_finished(),
            "healthy members must not be declared dead"
        );
        let rec = r1
            .report_failure(3, "local rank 0 exited with 3")
            .await
            .expect("bump");
        assert_eq!((rec.gen, rec.kind, rec.restarts), (1, BumpKind::Failure, 1));
        let ev0 = w0.await.expect("task");
        assert_eq!(ev0, Event::Generation(rec.clone()));
        stop.cancel();
        let _ = w1.await;
        let formed = form(&kv, vec![r0, r1]).await;
        assert!(formed
            .iter()
            .all(|(_, j)| j.assignment.restart_count == 1 && j.assignment.generation == 1));
        let mut agents: Vec<_> = formed.into_iter().map(|(a, _)| a).collect();
        let rec = agents[0]
            .report_failure(3, "local rank 1 exited with 3")
            .await
            .expect("bump");
        assert_eq!((rec.kind, rec.exit_code), (BumpKind::Fatal, Some(3)));
        let err = agents[1].next_round(0).await.expect_err("fatal");
        assert!(
            matches!(err, RdzvError::Fatal { exit_code: 3, .. }),
            "{err:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_bump_reaches_a_watcher_with_the_bump_wait_at_once_and_one_without_at_its_tick() {
        let kv = MemKv::default();
        let mut c = cfg(3, 3);
        // Long ticks (the production default is 5 s): only the WAIT can be this quick.
        c.keep_alive_interval = Duration::from_secs(5);
        c.heartbeat_timeout = Duration::from_secs(60);
        let mut formed = form_nodes(&kv, &c, 3).await;
        let (r2, j2) = formed.pop().expect("node 2");
        // Node 1 fails; it runs no watcher (node 0 would judge its silence only after 60 s).
        let (mut r1, _) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        let stop = CancellationToken::new();
        let with = tokio::spawn(
            r2.watcher(kv.connect(), &j2.assignment)
                .with_bump_wait(kv.connect())
                .run(stop.clone(), CancellationToken::new()),
        );
        let without = spawn_watcher(&r0, &kv, &j0, &stop);
        // Past the first ticks: both watchers sleep until their next one.
        sleep(Duration::from_millis(1200)).await;
        let bumped_at = Instant::now();
        let rec = r1
            .report_failure(1, "local rank 0 failed")
            .await
            .expect("bump");
        let ev = with.await.expect("task");
        let with_took = Instant::now() - bumped_at;
        assert_eq!(ev, Event::Generation(rec.clone()));
        assert!(with_took < Duration::from_millis(100), "{with_took:?}");
        let ev = without.await.expect("task");
        let without_took = Instant::now() - bumped_at;
        assert_eq!(ev, Event::Generation(rec));
        assert!(without_took >= Duration::from_secs(3), "{without_took:?}");
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn losing_the_store_host_is_reported_at_once_when_its_connection_closes() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let mut formed = form_nodes(&kv, &c, 2).await;
        let (r1, j1) = formed.pop().expect("node 1");
        let w = spawn_watcher(&r1, &kv, &j1, &CancellationToken::new());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let lost_at = Instant::now();
        kv.take_down();
        let ev = w.await.expect("task");
        let Event::StoreLost(why) = ev else {
            panic!("{ev:?}")
        };
        assert!(why.contains("its process is gone"), "{why}");
        assert!(
            Instant::now() - lost_at <= Duration::from_secs(1),
            "a closed store connection is a lost host at once, not at the next tick"
        );
    }

    /// A store host that is alive but starved: every operation hangs for the operation timeout
    /// and fails as slow until `until`, then the store answers again.
    struct Starved {
        until: Instant,
        op_timeout: Duration,
    }

    impl Hook for Starved {
        async fn before(&mut self, _: &MemKv, _: Call<'_>) -> Result<(), KvError> {
            if Instant::now() < self.until {
                sleep(self.op_timeout).await;
                return Err(KvError::Slow(
                    "the store did not answer within the timeout".into(),
                ));
            }
            Ok(())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_store_host_is_not_lost_at_the_heartbeat_timeout_but_at_the_stall_limit() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let mut formed = form_nodes(&kv, &c, 2).await;
        let (r1, j1) = formed.pop().expect("node 1");
        // Starved for three heartbeat timeouts (the 2,048-agent case), then answering again.
        let starved = Hooked::new(
            &kv,
            Starved {
                until: Instant::now() + c.heartbeat_timeout * 3,
                op_timeout: c.heartbeat_timeout,
            },
        );
        let stop = CancellationToken::new();
        let w = tokio::spawn(
            r1.watcher(starved, &j1.assignment)
                .run(stop.clone(), CancellationToken::new()),
        );
        tokio::time::sleep(c.heartbeat_timeout * 3 + c.keep_alive_interval * 4).await;
        assert!(!w.is_finished(), "slow is not lost: {:?}", w.await);
        stop.cancel();
        assert_eq!(w.await.expect("task"), Event::Stopped);
        // Starved for good: lost at the stall limit, and the reason says why.
        let starved = Hooked::new(
            &kv,
            Starved {
                until: Instant::now() + Duration::from_secs(3600),
                op_timeout: c.heartbeat_timeout,
            },
        );
        let started = Instant::now();
        let w = tokio::spawn(
            r1.watcher(starved, &j1.assignment)
                .run(CancellationToken::new(), CancellationToken::new()),
        );
        let Event::StoreLost(why) = w.await.expect("task") else {
            panic!("a store host slow past the stall limit is lost")
        };
        let took = Instant::now() - started;
        let limit = c.heartbeat_timeout * decide::STALL_FACTOR;
        assert!(why.contains("open but slow"), "{why}");
        assert!(
            took >= limit && took <= limit + c.heartbeat_timeout + c.keep_alive_interval,
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_member_whose_connection_is_open_is_not_lost_until_the_stall_limit() {
        let kv = MemKv::default();
        let c = cfg(2, 2);
        let mut formed = form_nodes(&kv, &c, 2).await;
        let (r1, j1) = formed.pop().expect("node 1");
        let (r0, j0) = formed.pop().expect("node 0");
        let a1 = SocketAddr::from(([127, 0, 0, 1], 4001));
        let presence = Arc::new(FakePresence::default());
        presence.set(a1, true);
        let stop1 = CancellationToken::new();
        let w1 = spawn_watcher_at(&r1, &kv, &j1, a1, &stop1);
        let w0 = spawn_watcher_with_presence(&r0, &kv, &j0, &presence, &CancellationToken::new());
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Node 1 is starved: no heartbeat gets out, but its connection stays open.
        stop1.cancel();
        let _ = w1.await;
        let starved = Instant::now();
        tokio::time::sleep(c.heartbeat_timeout * 3).await;
        assert!(!w0.is_finished(), "late but connected is not lost");
        let Event::Generation(rec) = w0.await.expect("task") else {
            panic!("a stalled member is lost at the stall limit")
        };
        let took = Instant::now() - starved;
        assert!(
            rec.reason.contains("although its connection is open"),
            "{}",
            rec.reason
        );
        let limit = c.heartbeat_timeout * decide::STALL_FACTOR;
        assert!(
            took + c.keep_alive_interval * 2 >= limit && took <= limit + c.keep_alive_interval * 2,
            "{took:?}"
        );
    }
}
