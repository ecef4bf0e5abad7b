//! The rendezvous driver: thin async loops around the pure decisions in [`super::decide`]. This
//! file holds one agent's [`Rendezvous`] and the generation bumps; each phase has its own file:
//!
//! - [`Rendezvous::next_round`]: join the current generation (`join.rs`); on node 0 also
//!   coordinate it (`round.rs`).
//! - [`super::Watcher::run`] (`watcher.rs`): while workers run, heartbeat and watch the
//!   generation; on node 0 also watch the members' heartbeats and newcomers, bumping the
//!   generation when needed.
//! - [`Rendezvous::report_failure`]: bump after a local worker failure (counted restart or
//!   fatal end).
//! - [`Rendezvous::exit_barrier`] (`exit.rs`): leave together after success.
//!
//! What they share: the generation record on the store (`record.rs`) and whether the store host
//! is still there (`health.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::{debug, warn};

use super::decide;
use super::keys::Keys;
use super::kv::Kv;
use super::record::{self, internal, lost, parse_json};
use super::recovery::GangMemory;
use super::{Assignment, Config, GenRecord, RdzvError, Registration};

/// The result of a completed round for this node.
#[derive(Debug, Clone)]
pub struct Joined {
    pub assignment: Assignment,
    pub record: GenRecord,
}

/// One agent's view of the rendezvous.
pub struct Rendezvous<K: Kv> {
    pub(super) kv: K,
    pub(super) cfg: Config,
    pub(super) keys: Keys,
    pub(super) reg: Registration,
    /// Node hosts, from earlier rounds: named in timeout messages.
    pub(super) known_hosts: BTreeMap<u32, String>,
    /// The generation of the last completed round, and how many of its slots got an answer
    /// (the coordinator supersedes the others when a new round opens).
    pub(super) last_round: Option<(u64, u64)>,
    /// Node 0: the node ranks of the last round it formed; a restart after a failure whose
    /// members are all back needs no last call ([`super::decide::RoundState::restarting`]).
    pub(super) last_members: std::collections::BTreeSet<u32>,
    /// Raw bytes of `gen` when the last round completed; a bump is a COMPARE_SET from these.
    pub(super) gen_raw: Vec<u8>,
    pub(super) record: GenRecord,
    /// What this node would carry if the store host were lost now: the last round it joined.
    pub(super) memory: Option<GangMemory>,
    /// Node 0's list of the hosts answered "spare" in the running generation.
    pub(super) spares: SpareHosts,
    /// Node 0: the running generation's ranks whose member does not hold them as its own
    /// identity (given by arrival, or a spare in a lost member's place).
    pub(super) held_ranks: Vec<u32>,
    /// True while this node waits as a spare ([`Rendezvous::waiting_as_spare`]).
    pub(super) spare: tokio::sync::watch::Sender<bool>,
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
            last_members: std::collections::BTreeSet::new(),
            gen_raw: Vec::new(),
            record: GenRecord::first(),
            memory: None,
            spares: SpareHosts::default(),
            held_ranks: Vec::new(),
            spare: tokio::sync::watch::Sender::new(false),
        }
    }

    /// True while this node waits as a spare (node 0 answered it "spare"), false once it joined
    /// a round: what a spare's agent prepares for while it waits (warm standbys) starts then.
    pub fn waiting_as_spare(&self) -> tokio::sync::watch::Receiver<bool> {
        self.spare.subscribe()
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
    pub(super) async fn current_gen(&mut self) -> Result<(Vec<u8>, GenRecord), RdzvError> {
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

    /// The generation record as stored now (the first one when none is written yet).
    pub(super) async fn read_gen(&mut self) -> Result<(Vec<u8>, GenRecord), RdzvError> {
        let key = self.keys.gen();
        let raw = self.kv.get(&key).await.map_err(lost)?;
        if raw.is_empty() {
            return Ok((raw, GenRecord::first()));
        }
        let rec = parse_json(&key, &raw)?;
        Ok((raw, rec))
    }

    /// Keeps what this node knows of the round it just joined (for bumps, watchers and memory).
    pub(super) fn remember_round(
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
        record::bump(&mut self.kv, &self.keys, &self.gen_raw, next).await
    }
}
