//! muster's own gang rendezvous, built on the TCPStore protocol (no pickled state, no CAS loops
//! over one shared blob as in torchrun's c10d backend).
//!
//! # Theory of operation
//! The agent with node rank 0 hosts the store and is the round's **coordinator**: it is the only
//! one that decides when a round is complete, who is dead and which newcomers force a new round.
//! Every other agent does a constant number of store operations per round, so a round of N
//! agents costs O(N) operations in total (torchrun needed a fix from O(N²) to O(N) for that,
//! pytorch/pytorch#124982).
//!
//! - **Generation.** Key `gen` holds a JSON [`GenRecord`]: the generation number, the number of
//!   restarts consumed so far and why the last bump happened. Bumps are COMPARE_SETs from the
//!   exact bytes that were read, so two agents bumping at once produce one new generation.
//!   A worker failure bumps with [`BumpKind::Failure`] (counts against `--max-restarts`), a dead
//!   peer or an admissible newcomer with [`BumpKind::Membership`] (does not count), and a failure
//!   past the budget with [`BumpKind::Fatal`] (everyone exits with the root cause's code).
//! - **Join.** A joining agent reads `gen`, takes a slot with `ADD g<G>/slots 1`, writes its
//!   [`Registration`] to `g<G>/slot/<i>` and waits for `g<G>/assign/<i>`. The coordinator polls
//!   the slot counter, MULTI_GETs only the slots it has not seen, runs [`decide::decide_round`]
//!   and answers every slot with one MULTI_SET (a member's [`Assignment`], "spare", "rejected",
//!   "superseded" or "timeout" with the message naming the missing node ranks).
//! - **Liveness.** Agents SET `hb/<agent id>` to an increasing counter, followed by the local
//!   address of the connection they heartbeat on, every keep-alive interval; the coordinator
//!   MULTI_GETs the members' counters and judges staleness with its own clock
//!   ([`decide::find_dead`]), so clocks of different machines are never compared. Node 0 hosts
//!   the store, so it also sees whether each member's connection is still open ([`Presence`]):
//!   open means alive but late (lost only past a long stall limit), closed or reset means lost
//!   [`decide::CLOSED_GRACE`] after the close unless it beats again (the store wakes node 0's
//!   watcher on every close, so this does not wait for a tick). The others judge node 0 by the store itself: when it stops
//!   answering for the heartbeat timeout they stop their workers and exit with "store host lost".
//! - **Exit barrier.** `ADD g<G>/done 1`; the N-th report completes it and SETs
//!   `g<G>/done_all`; everyone keeps heartbeating while it waits, so an early finisher is never
//!   taken for a dead node. Completion is terminal: whoever wants to end a generation early (a
//!   lost node, a newcomer) first adds [`decide::ABORT`] to the same counter, and only the first
//!   abort made while the barrier was still open may bump the generation
//!   ([`decide::decide_abort`]); after completion nothing can. Node 0 leaves last (it waits for
//!   `g<G>/left`), because its departure takes the store with it.
//!
//! Every key lives under `muster/<run_id>/` ([`keys`]); each generation's keys live under their
//! own `g<G>/` prefix, so nothing a dead round wrote is read by the next one.

pub mod board;
pub mod decide;
pub mod driver;
mod exit;
mod health;
pub mod identity;
mod join;
pub mod keys;
pub mod kv;
mod record;
pub mod recovery;
mod round;
pub mod store_kv;
#[cfg(test)]
mod testkit;
mod watcher;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use board::Board;
pub use driver::{Joined, Rendezvous};
pub use exit::BarrierOutcome;
pub use kv::{Kv, KvError};
pub use store_kv::StoreKv;
pub use watcher::{Event, Presence, Watcher};

/// torchrun's defaults (`dynamic_rendezvous.py`), except the heartbeat: torchrun declares a node
/// dead after 3 × 5 s; we default to the same 15 s.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(600);
pub const DEFAULT_LAST_CALL_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(5);
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(15);
pub const DEFAULT_EXIT_BARRIER_TIMEOUT: Duration = Duration::from_secs(300);
/// How often the coordinator looks at the slot counter while a round is open. One cheap ADD 0.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Everything the rendezvous needs to know about the job. Built by the agent from
/// `--nnodes MIN:MAX`, `--max-restarts`, `--rdzv-id` and `--rdzv-conf`.
#[derive(Debug, Clone)]
pub struct Config {
    pub run_id: String,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub max_restarts: u32,
    pub join_timeout: Duration,
    pub last_call_timeout: Duration,
    pub keep_alive_interval: Duration,
    pub heartbeat_timeout: Duration,
    pub exit_barrier_timeout: Duration,
    pub poll_interval: Duration,
    /// Test hook, never set in production: how long a node waits, after its own report to the
    /// exit barrier, before it looks for the barrier's completion. It stands in for a node that
    /// is slow to observe completion (a loaded store host, a GC pause). The agent sets it only
    /// from `MUSTER_TEST_BARRIER_OBSERVE_DELAY` (seconds); see docs/multinode.md § Test hooks.
    pub barrier_observe_delay: Duration,
    /// `--node-unit K`: every gang's node count is a multiple of this (a model sharded over K
    /// nodes); members beyond the largest multiple wait as spares. 1: any size.
    pub node_unit: u32,
    /// `Some(code)` where a lost node is never replaced (a Slurm step never restarts its tasks):
    /// a loss that leaves fewer than `min_nodes` members ends the job at once with `code` instead
    /// of a new round that would wait out the join timeout for a replacement. `None` where one
    /// comes (Kubernetes re-creates the pod).
    pub unreplaceable_loss: Option<u8>,
}

impl Config {
    /// A config with torchrun's default timeouts.
    pub fn new(run_id: impl Into<String>, min_nodes: u32, max_nodes: u32) -> Self {
        Self {
            run_id: run_id.into(),
            min_nodes,
            max_nodes,
            max_restarts: 0,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            last_call_timeout: DEFAULT_LAST_CALL_TIMEOUT,
            keep_alive_interval: DEFAULT_KEEP_ALIVE_INTERVAL,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
            exit_barrier_timeout: DEFAULT_EXIT_BARRIER_TIMEOUT,
            poll_interval: DEFAULT_POLL_INTERVAL,
            barrier_observe_delay: Duration::ZERO,
            node_unit: 1,
            unreplaceable_loss: None,
        }
    }

    /// Applies `--rdzv-conf k=v,...` keys this rendezvous understands (seconds, fractions
    /// allowed). Unknown keys are returned so the caller can hand them to other consumers (the
    /// discovery step reads `dns_server`, for instance) or warn about them.
    pub fn apply_conf(&mut self, conf: &str) -> Result<Vec<(String, String)>, ConfigError> {
        let mut rest = Vec::new();
        for (key, value) in parse_conf(conf)? {
            let slot = match key.as_str() {
                "join_timeout" | "timeout" => &mut self.join_timeout,
                "last_call_timeout" => &mut self.last_call_timeout,
                "keep_alive_interval" => &mut self.keep_alive_interval,
                "heartbeat_timeout" => &mut self.heartbeat_timeout,
                "exit_barrier_timeout" | "close_timeout" => &mut self.exit_barrier_timeout,
                "poll_interval" => &mut self.poll_interval,
                _ => {
                    rest.push((key, value));
                    continue;
                }
            };
            *slot = parse_seconds(&key, &value)?;
        }
        if self.keep_alive_interval.is_zero() || self.heartbeat_timeout <= self.keep_alive_interval
        {
            return Err(ConfigError::Invalid(format!(
                "heartbeat_timeout ({}) must be longer than keep_alive_interval ({})",
                crate::words::duration(self.heartbeat_timeout),
                crate::words::duration(self.keep_alive_interval)
            )));
        }
        Ok(rest)
    }
}

/// Splits `k=v,k2=v2` (torchrun's `--rdzv-conf` syntax). Empty input is no keys.
pub fn parse_conf(conf: &str) -> Result<Vec<(String, String)>, ConfigError> {
    conf.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| {
                    ConfigError::Invalid(format!("--rdzv-conf item `{item}` is not k=v"))
                })
        })
        .collect()
}

fn parse_seconds(key: &str, value: &str) -> Result<Duration, ConfigError> {
    crate::seconds::parse(value)
        .map_err(|e| ConfigError::Invalid(format!("--rdzv-conf {key}={value}: {e}")))
}

/// Parses `--nnodes`: `N` or `MIN:MAX`, with `0 < MIN <= MAX`.
pub fn parse_nnodes(value: &str) -> Result<(u32, u32), ConfigError> {
    let bad = || ConfigError::Invalid(format!("--nnodes `{value}`: expected N or MIN:MAX"));
    let (min, max) = if let Some((a, b)) = value.split_once(':') {
        (
            a.trim().parse().map_err(|_| bad())?,
            b.trim().parse().map_err(|_| bad())?,
        )
    } else {
        let n = value.trim().parse().map_err(|_| bad())?;
        (n, n)
    };
    if min == 0 || min > max {
        return Err(ConfigError::Invalid(format!(
            "--nnodes `{value}`: need 0 < MIN <= MAX"
        )));
    }
    Ok((min, max))
}

/// A bad `--nnodes` or `--rdzv-conf`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Invalid(String),
}

/// What a joining agent tells the coordinator. Written once per round to its slot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// Unique per agent process (random); names its heartbeat key.
    pub agent_id: String,
    /// The node rank this agent claims (flag, Job index, hostname ordinal), or `None` when it
    /// has no identity and takes the lowest free rank in arrival order.
    pub node_rank: Option<u32>,
    /// `node_rank` was given by an earlier round (by arrival, or in a lost member's place), not
    /// the node's own identity: a node that claims the same rank as its own wins it at the next
    /// round, and its arrival is not taken for the member's pod restarting.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
    /// The Job index of a pod started beyond `--nnodes MAX` (an Indexed Job with more
    /// completions than nodes): it has no rank of its own and takes a free one only after every
    /// other arrival, so it waits as a spare while the gang is full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spare_index: Option<u32>,
    /// The address the agent advertises (its pod IP); node 0's becomes MASTER_ADDR.
    pub addr: String,
    /// The host name, only for messages.
    pub host: String,
    pub local_world_size: u32,
    /// Set by node 0, the store host: its claim of rank 0 wins over any other.
    #[serde(default)]
    pub coordinator: bool,
    /// The GPU pre-flight verdict (opaque JSON the GPU work fills; `null` when absent). One
    /// field is read here: `fatal: {"exit_code", "message"}`, set by a node whose pre-flight
    /// failed under `--gpu-check require`; node 0 then ends the round for the whole gang with
    /// that code (see [`decide::fatal_registration`]).
    #[serde(default)]
    pub gpu: serde_json::Value,
    /// Set by a survivor of a lost store host until it joins a round of the new store: what the
    /// gang's old store held ([`recovery::decide_memories`] says what node 0 does with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<recovery::GangMemory>,
}

/// One member's place in a completed round: what the launch step needs to start workers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub generation: u64,
    /// The node's identity (flag, index, ordinal, or assigned by arrival).
    pub node_rank: u32,
    /// Position among this round's members, by node rank (torchrun's GROUP_RANK).
    pub group_rank: u32,
    pub group_world_size: u32,
    pub base_global_rank: u32,
    pub local_world_size: u32,
    pub world_size: u32,
    pub master_addr: String,
    pub master_port: u16,
    /// Failure restarts consumed so far (TORCHELASTIC_RESTART_COUNT).
    pub restart_count: u32,
    /// Every member's (node rank, agent id), by group rank: filled on node 0 only (its watcher
    /// follows their heartbeats); empty, and not sent, for the others.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<(u32, String)>,
    /// Every member's node rank, as inclusive ranges (one pair for a contiguous gang): what a
    /// survivor of a lost store host remembers of the membership.
    #[serde(default)]
    pub member_ranks: Vec<(u32, u32)>,
}

/// The coordinator's answer to one slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Answer {
    Member(Assignment),
    /// The round is full; wait for the next generation.
    Spare,
    /// This registration cannot take part (e.g. a node rank already taken).
    Rejected {
        reason: String,
    },
    /// A newer generation started before this round completed; join that one.
    Superseded,
    /// The join deadline passed; the message names who is missing.
    Timeout {
        message: String,
    },
}

/// Why the generation was bumped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BumpKind {
    /// The first generation.
    Start,
    /// A worker failed; consumes one restart.
    Failure,
    /// A node died or a newcomer was admitted; free.
    Membership,
    /// A worker failed with no restarts left: the job is over.
    Fatal,
}

/// The value of the `gen` key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenRecord {
    pub gen: u64,
    pub restarts: u32,
    pub kind: BumpKind,
    /// The node rank that bumped.
    pub by: Option<u32>,
    pub reason: String,
    /// For [`BumpKind::Fatal`]: the exit code every agent leaves with.
    #[serde(default)]
    pub exit_code: Option<u8>,
    /// Set once this store adopted a lost store's memory: the generation that was adopted.
    /// Carried by every later bump, so a survivor remembering an older one is known stale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered_from: Option<u64>,
}

impl GenRecord {
    pub fn first() -> Self {
        Self {
            gen: 0,
            restarts: 0,
            kind: BumpKind::Start,
            by: None,
            reason: "first round".into(),
            exit_code: None,
            recovered_from: None,
        }
    }
}

/// Why a rendezvous step could not go on. The agent maps each to an exit code.
#[derive(Debug, thiserror::Error)]
pub enum RdzvError {
    /// The join deadline passed (exit 203). The message names the missing node ranks.
    #[error("rendezvous timed out: {0}")]
    Timeout(String),
    /// The store host stopped answering (exit 205).
    #[error("lost the store host (node 0): {0}")]
    StoreLost(String),
    /// The gang's exit barrier completed (`g<G>/done_all`) while this node waited as a spare:
    /// the job succeeded without it, so it leaves with success rather than outliving the store.
    #[error("the job finished while this pod waited as a spare")]
    FinishedAsSpare,
    /// This node cannot join (exit 202): duplicate node rank and the like.
    #[error("rejected by the rendezvous: {0}")]
    Rejected(String),
    /// A worker failed with no restarts left, possibly on another node (exit = its code).
    #[error("{reason}")]
    Fatal { exit_code: u8, reason: String },
    /// Could not encode our own value (a bug).
    #[error("could not encode a rendezvous value: {0}")]
    Encode(#[from] serde_json::Error),
    /// A store value we could not make sense of (a foreign writer, a version mismatch).
    #[error("malformed rendezvous value at `{key}`: {detail}")]
    Malformed { key: String, detail: String },
}
