//! The rendezvous drivers: thin async loops around the pure decisions in [`super::decide`].
//!
//! - [`Rendezvous::next_round`]: join the current generation; on node 0 also coordinate it.
//! - [`Watcher::run`]: while workers run, heartbeat and watch the generation; on node 0 also
//!   watch the members' heartbeats and newcomers, bumping the generation when needed.
//! - [`Rendezvous::report_failure`]: bump after a local worker failure (counted restart or
//!   fatal end).
//! - [`Rendezvous::exit_barrier`]: leave together after success.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::decide::{
    self, Abort, Arrival, Barrier, Beat, Link, Liveness, Report, RoundDecision, RoundState,
    StoreFault, StoreVerdict,
};
use super::keys::Keys;
use super::kv::{Kv, KvError};
use super::recovery::{self, GangMemory};
use super::{Answer, Assignment, BumpKind, Config, GenRecord, RdzvError, Registration};

/// How often a waiting coordinator repeats its progress line.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

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

/// The result of a completed round for this node.
#[derive(Debug, Clone)]
pub struct Joined {
    pub assignment: Assignment,
    pub record: GenRecord,
}

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

/// One agent's view of the rendezvous.
pub struct Rendezvous<K: Kv> {
    kv: K,
    cfg: Config,
    keys: Keys,
    reg: Registration,
    /// Node hosts, from earlier rounds: named in timeout messages.
    known_hosts: BTreeMap<u32, String>,
    /// The generation of the last completed round, and how many of its slots got an answer
    /// (the coordinator supersedes the others when a new round opens).
    last_round: Option<(u64, u64)>,
    /// Raw bytes of `gen` when the last round completed; a bump is a COMPARE_SET from these.
    gen_raw: Vec<u8>,
    record: GenRecord,
    /// What this node would carry if the store host were lost now: the last round it joined.
    memory: Option<GangMemory>,
    /// Node 0's list of the hosts answered "spare" in the running generation.
    spares: SpareHosts,
    /// Node 0: the running generation's ranks whose member does not hold them as its own
    /// identity (given by arrival, or a spare in a lost member's place).
    held_ranks: Vec<u32>,
}

/// The hosts of the nodes node 0 answered "spare" in the running generation (replaced when a
/// round completes, grown when the watcher answers a newcomer), for `/gangz` and the metrics.
/// A spare that went away since is not noticed: it is forgotten at the next round.
pub type SpareHosts = Arc<std::sync::Mutex<Vec<String>>>;

impl<K: Kv> Rendezvous<K> {
    /// `reg.coordinator` decides whether this agent coordinates (it must be node rank 0).
    pub fn new(kv: K, cfg: Config, reg: Registration) -> Self {
        Self {
            keys: Keys::new(&cfg.run_id),
            kv,
            cfg,
            reg,
            known_hosts: BTreeMap::new(),
            last_round: None,
            gen_raw: Vec::new(),
            record: GenRecord::first(),
            memory: None,
            spares: SpareHosts::default(),
            held_ranks: Vec::new(),
        }
    }

    /// Keeps the spare list in `spares` (shared with the caller, which outlives this value).
    #[must_use]
    pub fn with_spare_hosts(mut self, spares: SpareHosts) -> Self {
        self.spares = spares;
        self
    }

    /// The gang as this node last joined it: what it carries to a replacement store host.
    pub fn memory(&self) -> Option<&GangMemory> {
        self.memory.as_ref()
    }

    /// Registers with `memory` (a survivor of a lost store host) until a round is joined.
    pub fn carry(&mut self, memory: GangMemory) {
        self.reg.memory = Some(memory);
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The store connection, for callers that need a second one (the watcher's).
    pub fn kv(&self) -> &K {
        &self.kv
    }

    /// The store connection itself, for work between joining a round and its exit barrier, when
    /// the rendezvous does not use it (the network pre-flight).
    pub fn kv_mut(&mut self) -> &mut K {
        &mut self.kv
    }

    pub fn registration_mut(&mut self) -> &mut Registration {
        &mut self.reg
    }

    pub fn is_coordinator(&self) -> bool {
        self.reg.coordinator
    }

    /// The failure board of generation `gen` ([`super::board`]).
    pub fn failure_board(&self, gen: u64) -> super::Board {
        super::Board::new(self.keys.clone(), gen)
    }

    /// This node's rank once known (claimed, or given in a round).
    pub fn node_rank(&self) -> Option<u32> {
        self.reg.node_rank
    }

    /// Joins the current generation and returns this node's place in it. On node 0 this also
    /// runs the round: `master_port` is the port of the fresh worker store it serves for this
    /// round (MASTER_PORT); the others ignore it.
    pub async fn next_round(&mut self, master_port: u16) -> Result<Joined, RdzvError> {
        let joined = if self.reg.coordinator {
            self.coordinate(master_port).await?
        } else {
            self.join().await?
        };
        // An agent that got its rank by arrival, or in a lost member's place, keeps it in later
        // rounds, as held: a node claiming that rank as its own identity gets it back.
        let assigned = joined.assignment.node_rank;
        let owns = self.reg.node_rank == Some(assigned) && !self.reg.held;
        self.reg.node_rank = Some(assigned);
        self.reg.held = !owns;
        // Carried to this store: it holds the gang's memory now.
        self.reg.memory = None;
        Ok(joined)
    }

    /// The generation to register in, writing the first record when no agent has yet. Whoever
    /// arrives first writes it: a joiner that kept the empty bytes it read would later find the
    /// stored record different from its own and take that for a new round.
    async fn current_gen(&mut self) -> Result<(Vec<u8>, GenRecord), RdzvError> {
        let (raw, rec) = self.read_gen().await?;
        if !raw.is_empty() {
            return Ok((raw, rec));
        }
        let key = self.keys.gen();
        let first = serde_json::to_vec(&GenRecord::first()).map_err(internal)?;
        let now = self.kv.compare_set(&key, b"", &first).await.map_err(lost)?;
        let rec = parse_json(&key, &now)?;
        Ok((now, rec))
    }

    async fn read_gen(&mut self) -> Result<(Vec<u8>, GenRecord), RdzvError> {
        let key = self.keys.gen();
        let raw = self.kv.get(&key).await.map_err(lost)?;
        if raw.is_empty() {
            return Ok((raw, GenRecord::first()));
        }
        let rec = parse_json(&key, &raw)?;
        Ok((raw, rec))
    }

    /// A non-coordinator's join: 5 store operations when nothing goes wrong
    /// (GET gen, ADD slots, SET slot, WAIT answer, GET answer).
    async fn join(&mut self) -> Result<Joined, RdzvError> {
        // The coordinator's own deadline comes first, so its message (naming the missing ranks)
        // normally wins; this one only fires when node 0 itself is missing or stuck.
        let join_wait = self.cfg.join_timeout + self.cfg.keep_alive_interval * 2;
        let mut deadline = Instant::now() + join_wait;
        'rounds: loop {
            let (raw, rec) = self.current_gen().await?;
            check_fatal(&rec)?;
            let gen = rec.gen;
            let slot = self.kv.add(&self.keys.slots(gen), 1).await.map_err(lost)? as u64;
            let body = serde_json::to_vec(&self.reg).map_err(internal)?;
            self.kv
                .set(&self.keys.slot(gen, slot), &body)
                .await
                .map_err(lost)?;
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

    fn remember_round(
        &mut self,
        gen: u64,
        answered: u64,
        raw: Vec<u8>,
        rec: GenRecord,
        a: &Assignment,
    ) {
        self.last_round = Some((gen, answered));
        self.memory = Some(GangMemory::of_round(&self.cfg.run_id, &rec, a, None));
        self.gen_raw = raw;
        self.record = rec;
        debug!(gen, node_rank = a.node_rank, "joined");
    }

    /// Node 0's side: rounds until one completes. A round opens again at a new generation
    /// when survivors of a lost store host bring a memory this store adopts.
    async fn coordinate(&mut self, master_port: u16) -> Result<Joined, RdzvError> {
        loop {
            if let Some(joined) = self.coordinate_round(master_port).await? {
                return Ok(joined);
            }
        }
    }

    /// One round: open it, read registrations as they come, decide, answer. `None` when the
    /// store moved to the gang's remembered generation instead.
    async fn coordinate_round(&mut self, master_port: u16) -> Result<Option<Joined>, RdzvError> {
        let (raw, rec) = self.current_gen().await?;
        check_fatal(&rec)?;
        let gen = rec.gen;
        if let Some((old, answered)) = self.last_round {
            if old != gen {
                self.supersede(old, answered).await?;
            }
        }
        let slot = self.kv.add(&self.keys.slots(gen), 1).await.map_err(lost)? as u64;
        let body = serde_json::to_vec(&self.reg).map_err(internal)?;
        self.kv
            .set(&self.keys.slot(gen, slot), &body)
            .await
            .map_err(lost)?;

        let mut state = RoundState {
            gen,
            started: Instant::now(),
            arrivals: Vec::new(),
            known_hosts: self.known_hosts.clone(),
        };
        let mut seen: u64 = 0;
        let mut last_reason = String::new();
        let mut last_progress = Instant::now();
        info!(
            gen,
            restarts = rec.restarts,
            "round {gen} open: {}",
            rec.reason
        );
        loop {
            let count = self.kv.add(&self.keys.slots(gen), 0).await.map_err(lost)? as u64;
            if count > seen {
                let keys: Vec<Vec<u8>> =
                    (seen + 1..=count).map(|i| self.keys.slot(gen, i)).collect();
                let values = self.kv.multi_get(&keys).await.map_err(lost)?;
                let now = Instant::now();
                for (key, value) in keys.iter().zip(values) {
                    // Slot taken but not yet written: read it again next tick.
                    if value.is_empty() {
                        break;
                    }
                    seen += 1;
                    match serde_json::from_slice::<Registration>(&value) {
                        Ok(reg) => {
                            // One node that must not run ends the job for all, at once, by name,
                            // instead of leaving the others to wait for the join deadline.
                            if let Some((code, reason)) = decide::fatal_registration(&reg) {
                                let next =
                                    decide::fatal_bump(&rec, self.reg.node_rank, code, reason);
                                let won = bump(&mut self.kv, &self.keys, &raw, &next).await?;
                                if won.kind == BumpKind::Fatal {
                                    // This node hosts the store: keep it up until the waiting
                                    // agents (they re-read the generation every keep-alive
                                    // interval) have seen why, so they exit with this code and
                                    // not with "store host lost".
                                    sleep(
                                        self.cfg.keep_alive_interval * 2 + self.cfg.poll_interval,
                                    )
                                    .await;
                                }
                                check_fatal(&won)?;
                            }
                            state.arrivals.push(Arrival {
                                slot: seen,
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
                if state.arrivals.iter().any(|a| a.reg.memory.is_some())
                    && self.carry_memories(&raw, &rec, &mut state).await?
                {
                    // Every slot of this round is answered "superseded" by the next one.
                    self.last_round = Some((gen, 0));
                    return Ok(None);
                }
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
                    let assignments =
                        decide::assign(&state, &m, rec.restarts, (&self.reg.addr, master_port));
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
                    assignment.members = decide::members(&state, &m);
                    self.held_ranks = m
                        .members
                        .iter()
                        .filter(|&&(rank, i)| {
                            let reg = &state.arrivals[i].reg;
                            reg.held || reg.node_rank != Some(rank)
                        })
                        .map(|&(rank, _)| rank)
                        .collect();
                    self.remember_round(gen, seen, raw, rec.clone(), &assignment);
                    return Ok(Some(Joined {
                        assignment,
                        record: rec,
                    }));
                }
                RoundDecision::Timeout(message) => {
                    warn!("{reason}");
                    let answer = Answer::Timeout {
                        message: message.clone(),
                    };
                    let pairs = state
                        .arrivals
                        .iter()
                        .filter(|a| a.slot != slot)
                        .map(|a| self.answer(gen, a.slot, &answer))
                        .collect::<Result<Vec<_>, _>>()?;
                    let others = pairs.len() as i64;
                    self.kv.multi_set(&pairs).await.map_err(lost)?;
                    self.linger(&self.keys.acks(gen), others, Duration::ZERO)
                        .await;
                    return Err(RdzvError::Timeout(message));
                }
            }
        }
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

    /// Node 0 keeps the store up until `expected` agents counted themselves out on `key`, or
    /// `at_least` (and never less than a couple of keep-alive intervals) passed. After a
    /// completed exit barrier it waits up to the heartbeat timeout: a loaded node may be slow
    /// to observe the completion, and leaving earlier would turn its success into "store lost".
    async fn linger(&mut self, key: &[u8], expected: i64, at_least: Duration) {
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

    /// After a local worker failure: bump the generation (a counted restart, or the fatal end
    /// when the budget is spent). Returns the generation that now holds — ours, or a concurrent
    /// bump by someone else (then ours is not counted: the gang restarts once).
    pub async fn report_failure(
        &mut self,
        exit_code: u8,
        what: &str,
    ) -> Result<GenRecord, RdzvError> {
        let node = self.reg.node_rank.unwrap_or_default();
        let current = self.record.clone();
        let (next, reason) = decide::decide_failure(&current, node, exit_code, what, &self.cfg);
        let won = self.bump(&next).await?;
        if won == next {
            warn!("{reason}");
        }
        Ok(won)
    }

    /// Ends the job for every node with `exit_code` after this node's worker failure, whatever
    /// restarts are left ([`decide::decide_give_up`]); returns the record that won (another
    /// node's bump may have come first).
    pub async fn report_give_up(
        &mut self,
        exit_code: u8,
        what: &str,
    ) -> Result<GenRecord, RdzvError> {
        let node = self.reg.node_rank.unwrap_or_default();
        let current = self.record.clone();
        let (next, reason) = decide::decide_give_up(&current, node, exit_code, what);
        let won = self.bump(&next).await?;
        if won == next {
            warn!("{reason}");
        }
        Ok(won)
    }

    /// The generation record, when it moved on from the one this node's last round formed in
    /// (someone bumped it since); `None` while it has not.
    pub async fn moved_on(&mut self) -> Result<Option<GenRecord>, RdzvError> {
        let key = self.keys.gen();
        let raw = self.kv.get(&key).await.map_err(lost)?;
        if raw == self.gen_raw {
            return Ok(None);
        }
        parse_json(&key, &raw).map(Some)
    }

    async fn bump(&mut self, next: &GenRecord) -> Result<GenRecord, RdzvError> {
        bump(&mut self.kv, &self.keys, &self.gen_raw, next).await
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

    /// After the job's fatal end (a [`BumpKind::Fatal`] generation): members count themselves
    /// out on `g<G>/left`, and node 0 keeps the store up until they have (at most the heartbeat
    /// timeout), so that leaving right after its own ranks failed does not look to members still
    /// stopping theirs like a lost store host — they would wait for a replacement instead of
    /// ending with the job, and could not read the failure board.
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
            spares: self.spares.clone(),
            held_ranks: self.held_ranks.clone(),
        }
    }
}

/// COMPARE_SET `gen` from `expected_raw` to `next`; returns whatever generation holds after.
async fn bump<K: Kv>(
    kv: &mut K,
    keys: &Keys,
    expected_raw: &[u8],
    next: &GenRecord,
) -> Result<GenRecord, RdzvError> {
    let key = keys.gen();
    let body = serde_json::to_vec(next).map_err(internal)?;
    let now = kv
        .compare_set(&key, expected_raw, &body)
        .await
        .map_err(lost)?;
    let now: GenRecord = parse_json(&key, &now)?;
    if &now == next {
        if let Ok(ended) = serde_json::from_slice::<GenRecord>(expected_raw) {
            wake_spares(kv, keys, ended.gen, b"bump").await;
        }
    }
    Ok(now)
}

/// Tells the spares of generation `gen` that it ended (see [`Keys::over`]). Best effort: a spare
/// that misses it reads `gen` at its next keep-alive tick.
async fn wake_spares<K: Kv>(kv: &mut K, keys: &Keys, gen: u64, why: &[u8]) {
    if let Err(e) = kv.set(&keys.over(gen), why).await {
        debug!(gen, "could not wake the spares: {e}");
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
                // A dead store host closes our idle connection: look now, not at the next tick.
                () = self.kv.closed() => debug!("the store connection closed; checking at once"),
                // Node 0: a member's agent that died closed its connection; judge it now.
                () = connection_closed(presence.as_deref()) => {
                    debug!("a connection to the store closed; judging the members at once");
                }
            }
        }
    }

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
                    return Ok(Some(Event::Completed));
                }
                Liveness::Lost(dead) => {
                    let fatal =
                        decide::decide_unreplaceable_loss(dead.len(), self.group_size, &self.cfg);
                    return match fatal {
                        Some((code, why)) => {
                            self.end_generation(format!("lost {reason}; {why}"), Some(code))
                                .await
                        }
                        None => self.end_generation(format!("lost {reason}"), None).await,
                    };
                }
                Liveness::Alive => {}
            }
        } else if barrier == Barrier::Complete {
            return Ok(Some(Event::Completed));
        }
        let count = self.kv.add(&self.keys.slots(self.gen), 0).await? as u64;
        if count > *seen_slots {
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

fn check_fatal(rec: &GenRecord) -> Result<(), RdzvError> {
    if rec.kind == BumpKind::Fatal {
        return Err(RdzvError::Fatal {
            exit_code: rec.exit_code.unwrap_or(1),
            reason: rec.reason.clone(),
        });
    }
    Ok(())
}

fn parse_json<T: serde::de::DeserializeOwned>(key: &[u8], value: &[u8]) -> Result<T, RdzvError> {
    serde_json::from_slice(value).map_err(|e| RdzvError::Malformed {
        key: String::from_utf8_lossy(key).into_owned(),
        detail: e.to_string(),
    })
}

fn lost(e: KvError) -> RdzvError {
    match e {
        KvError::Slow(detail) | KvError::Silent(detail) | KvError::Gone(detail) => {
            RdzvError::StoreLost(detail)
        }
        KvError::WaitTimeout => RdzvError::StoreLost("a store operation timed out".into()),
    }
}

/// How long the store has not answered, and what the last failure said about its host: the
/// input of [`decide::decide_store_fault`], kept across operations by one waiting loop.
struct StoreHealth {
    last_ok: Instant,
    last_fault: Option<StoreFault>,
}

impl StoreHealth {
    fn new() -> Self {
        Self {
            last_ok: Instant::now(),
            last_fault: None,
        }
    }

    fn ok(&mut self) {
        self.last_ok = Instant::now();
        self.last_fault = None;
    }

    /// The verdict on one failed operation, and its reason (naming the failure).
    fn judge(&mut self, e: &KvError, cfg: &Config) -> (StoreVerdict, String) {
        let Some(fault) = e.fault() else {
            // A WAIT that ran out of time got its answer: the store is there.
            self.ok();
            return (StoreVerdict::Retry, "wait timed out".into());
        };
        let silent = Instant::now().saturating_duration_since(self.last_ok);
        let (verdict, reason) = decide::decide_store_fault(fault, self.last_fault, silent, cfg);
        self.last_fault = Some(fault);
        (verdict, format!("{reason} ({e})"))
    }
}

fn internal(e: serde_json::Error) -> RdzvError {
    RdzvError::Encode(e)
}

#[cfg(test)]
mod tests {
    use super::super::kv::mem::MemKv;
    use super::*;

    fn cfg(min: u32, max: u32) -> Config {
        let mut c = Config::new("job", min, max);
        c.join_timeout = Duration::from_secs(30);
        c.last_call_timeout = Duration::from_secs(2);
        c.keep_alive_interval = Duration::from_millis(500);
        c.heartbeat_timeout = Duration::from_secs(2);
        c.max_restarts = 1;
        c
    }

    fn agent(kv: &MemKv, c: &Config, rank: Option<u32>, lws: u32) -> Rendezvous<MemKv> {
        let id = rank.map_or_else(|| "anon".to_owned(), |r| format!("a{r}"));
        Rendezvous::new(
            kv.connect(),
            c.clone(),
            Registration {
                agent_id: id.clone(),
                node_rank: rank,
                addr: format!("10.0.0.{}", rank.unwrap_or(99)),
                host: format!("host-{id}"),
                local_world_size: lws,
                coordinator: rank == Some(0),
                gpu: serde_json::Value::Null,
                memory: None,
                held: false,
                spare_index: None,
            },
        )
    }

    /// `r`'s watcher of round `j`, running in a task until an event or `stop`.
    fn spawn_watcher(
        r: &Rendezvous<MemKv>,
        kv: &MemKv,
        j: &Joined,
        stop: &CancellationToken,
    ) -> tokio::task::JoinHandle<Event> {
        tokio::spawn(
            r.watcher(kv.clone(), &j.assignment)
                .run(stop.clone(), CancellationToken::new()),
        )
    }

    /// Like `spawn_watcher`, but its connection has the local address `addr`, as node 0 sees it.
    fn spawn_watcher_at(
        r: &Rendezvous<MemKv>,
        kv: &MemKv,
        j: &Joined,
        addr: SocketAddr,
        stop: &CancellationToken,
    ) -> tokio::task::JoinHandle<Event> {
        tokio::spawn(
            r.watcher(kv.connect().with_local_addr(addr), &j.assignment)
                .run(stop.clone(), CancellationToken::new()),
        )
    }

    /// Node 0's watcher asking `presence` whether a silent member's connection is open; never
    /// stopped from outside, `fired` as in `Watcher::run`.
    fn spawn_watcher_with_presence(
        r: &Rendezvous<MemKv>,
        kv: &MemKv,
        j: &Joined,
        presence: &Arc<FakePresence>,
        fired: &CancellationToken,
    ) -> tokio::task::JoinHandle<Event> {
        tokio::spawn(
            r.watcher(kv.clone(), &j.assignment)
                .with_presence(presence.clone())
                .run(CancellationToken::new(), fired.clone()),
        )
    }

    async fn form(kv: &MemKv, agents: Vec<Rendezvous<MemKv>>) -> Vec<(Rendezvous<MemKv>, Joined)> {
        let _ = kv;
        let tasks: Vec<_> = agents
            .into_iter()
            .map(|mut a| {
                tokio::spawn(async move {
                    let j = a.next_round(4242).await;
                    (a, j)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            let (a, j) = t.await.expect("task");
            out.push((a, j.expect("joined")));
        }
        out
    }

    /// Nodes `0..n`, one worker each, formed into one round; element `i` is node `i`.
    async fn form_nodes(kv: &MemKv, c: &Config, n: u32) -> Vec<(Rendezvous<MemKv>, Joined)> {
        form(kv, (0..n).map(|r| agent(kv, c, Some(r), 1)).collect()).await
    }

    /// `r`'s exit barrier for round `j`, in a task.
    fn spawn_barrier(
        mut r: Rendezvous<MemKv>,
        j: Joined,
        interrupt: CancellationToken,
    ) -> tokio::task::JoinHandle<Result<BarrierOutcome, RdzvError>> {
        tokio::spawn(async move { r.exit_barrier(&j.assignment, &interrupt).await })
    }

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

    /// The calls a [`Hooked`] connection passes through, with what a hook looks at.
    enum Call<'a> {
        Add { key: &'a [u8], delta: i64 },
        Other,
    }

    /// What a fake store connection does before each call goes through to the store.
    trait Hook: Send {
        fn before(
            &mut self,
            store: &MemKv,
            call: Call<'_>,
        ) -> impl std::future::Future<Output = Result<(), KvError>> + Send;
    }

    /// A store connection that runs its hook, then passes the call through to `inner`.
    struct Hooked<H> {
        inner: MemKv,
        hook: H,
    }

    impl<H> Hooked<H> {
        fn new(kv: &MemKv, hook: H) -> Self {
            Self {
                inner: kv.connect(),
                hook,
            }
        }
    }

    impl<H: Hook> Kv for Hooked<H> {
        async fn get(&mut self, key: &[u8]) -> Result<Vec<u8>, KvError> {
            self.hook.before(&self.inner, Call::Other).await?;
            self.inner.get(key).await
        }
        async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
            self.hook.before(&self.inner, Call::Other).await?;
            self.inner.set(key, value).await
        }
        async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, KvError> {
            self.hook
                .before(&self.inner, Call::Add { key, delta })
                .await?;
            self.inner.add(key, delta).await
        }
        async fn compare_set(
            &mut self,
            key: &[u8],
            expected: &[u8],
            desired: &[u8],
        ) -> Result<Vec<u8>, KvError> {
            self.hook.before(&self.inner, Call::Other).await?;
            self.inner.compare_set(key, expected, desired).await
        }
        async fn multi_get(&mut self, keys: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, KvError> {
            self.hook.before(&self.inner, Call::Other).await?;
            self.inner.multi_get(keys).await
        }
        async fn multi_set(&mut self, pairs: &[(Vec<u8>, Vec<u8>)]) -> Result<(), KvError> {
            self.hook.before(&self.inner, Call::Other).await?;
            self.inner.multi_set(pairs).await
        }
        async fn wait(&mut self, keys: &[Vec<u8>], timeout: Duration) -> Result<(), KvError> {
            self.hook.before(&self.inner, Call::Other).await?;
            self.inner.wait(keys, timeout).await
        }
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

    /// Node 0's view of which connections are open, set by hand.
    #[derive(Default)]
    struct FakePresence(std::sync::Mutex<std::collections::HashSet<SocketAddr>>);

    impl FakePresence {
        fn set(&self, addr: SocketAddr, open: bool) {
            let mut set = self.0.lock().expect("lock");
            if open {
                set.insert(addr);
            } else {
                set.remove(&addr);
            }
        }
    }

    impl Presence for FakePresence {
        fn is_open(&self, peer: SocketAddr) -> bool {
            self.0.lock().expect("lock").contains(&peer)
        }
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

    fn gen_record(kv: &MemKv) -> GenRecord {
        let raw = kv.raw_get(&Keys::new("job").gen()).expect("gen written");
        serde_json::from_slice(&raw).expect("gen record")
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
