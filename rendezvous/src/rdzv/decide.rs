//! Every rendezvous decision as a pure function of `(now, state, config)` that returns the
//! decision and a human-readable reason (torchft's `quorum_compute` shape). The driver logs the
//! reason; the tests here build states by hand and need no sockets and no sleeps.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use tokio::time::Instant;

use super::{Assignment, BumpKind, Config, GenRecord, Registration};

/// At most this many missing node ranks are listed in one message; the rest are counted.
const MAX_LISTED: usize = 16;

/// One registration the coordinator has read, with the time it first saw it.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub slot: u64,
    pub reg: Registration,
    pub seen_at: Instant,
}

/// What the coordinator knows about an open round.
#[derive(Debug, Clone)]
pub struct RoundState {
    pub gen: u64,
    /// When the round opened (the join deadline counts from here).
    pub started: Instant,
    /// In slot order.
    pub arrivals: Vec<Arrival>,
    /// Node rank → "host (addr)" from earlier rounds, to name who did not come back.
    pub known_hosts: BTreeMap<u32, String>,
    /// A round opened by a failure (a restart, no member lost): the node ranks of the round
    /// before. Once they are all back the round is complete, with no last call: nobody left,
    /// nobody is expected (issue #41: an elastic gang's restart otherwise waited the whole
    /// last call, 30 s by default). `None` for any other round.
    pub restarting: Option<std::collections::BTreeSet<u32>>,
}

/// Who is in, who waits, who is turned away. Indices point into `RoundState::arrivals`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// (node rank, arrival index), sorted by node rank.
    pub members: Vec<(u32, usize)>,
    pub spares: Vec<usize>,
    pub rejected: Vec<(usize, String)>,
}

/// Gives every arrival its node rank, in this order of precedence:
/// 1. ranks claimed as the node's own identity (flag, Job index, host ordinal), the store
///    host's first: a second claim of the same rank is rejected, first come first served;
/// 2. ranks held from an earlier round ([`Registration::held`]), where no one claims them as
///    their own: a node whose held rank was claimed takes a free rank like a newcomer;
/// 3. arrivals without a rank, in arrival order, take the lowest free ranks;
/// 4. pods started beyond `max_nodes` ([`Registration::spare_index`]) last, in arrival order.
///
/// Whoever does not fit under `max_nodes` is a spare. Ranks never come from sorting host names.
pub fn resolve_members(arrivals: &[Arrival], max_nodes: u32) -> Membership {
    let mut out = Membership::default();
    let mut taken: BTreeMap<u32, usize> = BTreeMap::new();
    // The coordinator's claim first: MASTER_ADDR is its address, so it must be node 0.
    let own_claims = arrivals
        .iter()
        .enumerate()
        .filter(|(_, a)| a.reg.coordinator)
        .chain(
            arrivals
                .iter()
                .enumerate()
                .filter(|(_, a)| !a.reg.coordinator && !a.reg.held),
        );
    for (i, a) in own_claims {
        let Some(rank) = a.reg.node_rank else {
            continue;
        };
        if rank >= max_nodes {
            out.rejected.push((
                i,
                format!("node rank {rank} is outside --nnodes (at most {max_nodes} nodes)"),
            ));
        } else if let Some(&first) = taken.get(&rank) {
            let holder = &arrivals[first].reg;
            out.rejected.push((
                i,
                format!(
                    "node rank {rank} is already taken by {} ({}) in this round",
                    holder.host, holder.addr
                ),
            ));
        } else {
            taken.insert(rank, i);
        }
    }
    let mut without_rank = Vec::new();
    for (i, a) in arrivals.iter().enumerate() {
        if a.reg.coordinator || !a.reg.held {
            continue;
        }
        match a.reg.node_rank {
            Some(rank) if rank < max_nodes && !taken.contains_key(&rank) => {
                taken.insert(rank, i);
            }
            _ => without_rank.push(i),
        }
    }
    let anonymous = |spare: bool| {
        arrivals.iter().enumerate().filter(move |(_, a)| {
            a.reg.node_rank.is_none() && !a.reg.held && a.reg.spare_index.is_some() == spare
        })
    };
    without_rank.extend(anonymous(false).map(|(i, _)| i));
    without_rank.extend(anonymous(true).map(|(i, _)| i));
    let mut free = (0..max_nodes)
        .filter(|r| !taken.contains_key(r))
        .collect::<Vec<_>>();
    free.reverse();
    for i in without_rank {
        match free.pop() {
            Some(rank) => {
                taken.insert(rank, i);
            }
            None => out.spares.push(i),
        }
    }
    out.members = taken.into_iter().collect();
    out
}

/// `--node-unit K`: keeps the largest multiple of `unit` members, lowest node ranks first (node 0,
/// the coordinator, always stays); the others become spares for this round.
pub fn trim_to_unit(mut membership: Membership, unit: u32) -> Membership {
    let unit = unit.max(1) as usize;
    let keep = membership.members.len() / unit * unit;
    for (_, i) in membership.members.drain(keep..) {
        membership.spares.push(i);
    }
    membership
}

/// The coordinator's verdict on an open round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoundDecision {
    Wait,
    Complete(Membership),
    /// Fewer than `min_nodes` by the join deadline; the message names the missing ranks.
    Timeout(String),
}

/// A round completes when `max_nodes` are in, or when at least `min_nodes` are in and the
/// last-call window (counted from the moment the `min_nodes`-th member arrived) has passed. It
/// times out when the join deadline passes with fewer than `min_nodes`.
pub fn decide_round(now: Instant, state: &RoundState, cfg: &Config) -> (RoundDecision, String) {
    let membership = trim_to_unit(
        resolve_members(&state.arrivals, cfg.max_nodes),
        cfg.node_unit,
    );
    let n = membership.members.len() as u32;
    // A pod beyond MAX standing in for a node rank that no round had yet: that rank's own pod
    // may only be slow to start, so it gets the last call to claim it. A rank some round had
    // was lost, and a spare takes it at once.
    let stand_ins = membership
        .members
        .iter()
        .filter(|&&(rank, i)| {
            state.arrivals[i].reg.spare_index.is_some()
                && !state.arrivals[i].reg.held
                && !state.known_hosts.contains_key(&rank)
        })
        .count();
    if n >= cfg.max_nodes && stand_ins == 0 {
        let reason = format!("round {} complete: all {n} nodes joined", state.gen);
        return (RoundDecision::Complete(membership), reason);
    }
    if n >= cfg.min_nodes && stand_ins == 0 {
        if let Some(before) = &state.restarting {
            let back: std::collections::BTreeSet<u32> =
                membership.members.iter().map(|&(rank, _)| rank).collect();
            if !before.is_empty() && back == *before {
                let reason = format!(
                    "round {} complete: all {n} nodes of the round before are back (a restart)",
                    state.gen
                );
                return (RoundDecision::Complete(membership), reason);
            }
        }
    }
    if n >= cfg.min_nodes {
        let mut arrived: Vec<Instant> = membership
            .members
            .iter()
            .map(|&(_, i)| state.arrivals[i].seen_at)
            .collect();
        arrived.sort();
        let min_reached = arrived[cfg.min_nodes as usize - 1];
        let last_call_ends = min_reached + cfg.last_call_timeout;
        if now >= last_call_ends {
            let reason = format!(
                "round {} complete: {n} of at most {} nodes joined and the last call ({:.1}s) ended; missing {}",
                state.gen,
                cfg.max_nodes,
                cfg.last_call_timeout.as_secs_f64(),
                describe_missing(&membership, state, cfg)
            );
            return (RoundDecision::Complete(membership), reason);
        }
        let reason = format!(
            "round {}: {n} nodes joined (min {}, max {}); last call ends in {:.1}s",
            state.gen,
            cfg.min_nodes,
            cfg.max_nodes,
            (last_call_ends - now).as_secs_f64()
        );
        return (RoundDecision::Wait, reason);
    }
    let deadline = state.started + cfg.join_timeout;
    if now >= deadline {
        let message = format!(
            "{n} of {} required nodes joined round {} within {:.1}s; never arrived: {}",
            cfg.min_nodes,
            state.gen,
            cfg.join_timeout.as_secs_f64(),
            describe_missing(&membership, state, cfg)
        );
        return (RoundDecision::Timeout(message.clone()), message);
    }
    let reason = format!(
        "round {}: waiting for {} more node(s) ({n} joined, need {}); missing {}; deadline in {:.1}s",
        state.gen,
        cfg.min_nodes - n,
        cfg.min_nodes,
        describe_missing(&membership, state, cfg),
        (deadline - now).as_secs_f64()
    );
    (RoundDecision::Wait, reason)
}

/// "node ranks 1 (worker-1, 10.0.0.2), 3" — the ranks below `max_nodes` nobody holds.
fn describe_missing(membership: &Membership, state: &RoundState, cfg: &Config) -> String {
    let present: BTreeSet<u32> = membership.members.iter().map(|&(r, _)| r).collect();
    let missing: Vec<u32> = (0..cfg.max_nodes)
        .filter(|r| !present.contains(r))
        .collect();
    if missing.is_empty() {
        return "none".into();
    }
    let mut out = String::from(if missing.len() == 1 {
        "node rank "
    } else {
        "node ranks "
    });
    for (i, rank) in missing.iter().take(MAX_LISTED).enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{rank}");
        if let Some(host) = state.known_hosts.get(rank) {
            let _ = write!(out, " ({host})");
        }
    }
    if missing.len() > MAX_LISTED {
        let _ = write!(out, " and {} more", missing.len() - MAX_LISTED);
    }
    out
}

/// Global ranks are contiguous by node rank: member k (sorted by node rank) starts where member
/// k-1's local ranks end.
pub fn assign(
    state: &RoundState,
    membership: &Membership,
    restarts: u32,
    master: (&str, u16),
) -> Vec<(u64, Assignment)> {
    let world_size: u32 = membership
        .members
        .iter()
        .map(|&(_, i)| state.arrivals[i].reg.local_world_size)
        .sum();
    let ranks: Vec<u32> = membership.members.iter().map(|&(r, _)| r).collect();
    let member_ranks = super::recovery::compress_ranks(&ranks);
    let mut base = 0;
    membership
        .members
        .iter()
        .enumerate()
        .map(|(group_rank, &(node_rank, i))| {
            let a = &state.arrivals[i];
            let out = Assignment {
                generation: state.gen,
                node_rank,
                group_rank: group_rank as u32,
                group_world_size: membership.members.len() as u32,
                base_global_rank: base,
                local_world_size: a.reg.local_world_size,
                world_size,
                master_addr: master.0.to_owned(),
                master_port: master.1,
                restart_count: restarts,
                // Only node 0 watches the members; it fills this for itself. Sending the list
                // to everyone would make a round O(n²) in bytes.
                members: Vec::new(),
                member_ranks: member_ranks.clone(),
            };
            base += a.reg.local_world_size;
            (a.slot, out)
        })
        .collect()
}

/// Every member's (node rank, agent id), by group rank: what node 0's watcher follows.
pub fn members(state: &RoundState, membership: &Membership) -> Vec<(u32, String)> {
    membership
        .members
        .iter()
        .map(|&(r, i)| (r, state.arrivals[i].reg.agent_id.clone()))
        .collect()
}

/// The members' node ranks that their node does not hold as its own identity (given by
/// arrival, or a spare's in a lost member's place): node 0's watcher lets a node that claims
/// one of them as its own force a new round to win it back.
pub fn held_ranks(state: &RoundState, membership: &Membership) -> Vec<u32> {
    membership
        .members
        .iter()
        .filter(|&&(rank, i)| {
            let reg = &state.arrivals[i].reg;
            reg.held || reg.node_rank != Some(rank)
        })
        .map(|&(rank, _)| rank)
        .collect()
}

/// A member whose heartbeat connection is open but whose counter has not moved for this many
/// heartbeat timeouts is lost all the same: a hung process (stopped, deadlocked) whose kernel
/// still answers keep-alives. Long, because an open connection is strong evidence of life.
pub const STALL_FACTOR: u32 = 4;

/// How long a member whose heartbeat connection closed may take to beat again on a new one
/// before it is lost (never more than one keep-alive interval). A member that only dropped its
/// connection (a reconnect after a store error) beats within milliseconds of reconnecting: its
/// watcher looks at once when its connection closes. An agent that died does not, and its
/// connection closed the moment its process went: half a second after that evidence the gang
/// re-forms, instead of the 5–10 s a keep-alive tick took.
pub const CLOSED_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// What the coordinator last saw of one member's heartbeat counter.
#[derive(Debug, Clone)]
pub struct Beat {
    pub node_rank: u32,
    pub who: String,
    pub last_value: Vec<u8>,
    /// When `last_value` was first seen (by the coordinator's clock).
    pub changed_at: Instant,
    /// The state of the connection the member heartbeats on, as of this tick.
    pub link: Link,
    /// When node 0 first saw that connection closed (with [`Link::Closed`]).
    pub closed_at: Option<Instant>,
}

/// How long a member may be silent before it is lost, given what is known of its connection:
/// closed → [`CLOSED_GRACE`] (at most one keep-alive interval) from the moment it was seen
/// closed, time to re-beat after a reconnect; unknown → the heartbeat timeout; open →
/// [`STALL_FACTOR`] heartbeat timeouts.
pub fn silence_allowed(link: Link, cfg: &Config) -> std::time::Duration {
    match link {
        Link::Closed => CLOSED_GRACE.min(cfg.keep_alive_interval),
        Link::Unknown => cfg.heartbeat_timeout,
        Link::Open => cfg.heartbeat_timeout * STALL_FACTOR,
    }
}

/// Members that are lost: silent for longer than their connection's evidence allows
/// ([`silence_allowed`]). Only the observer's clock is used, so clock skew between machines
/// cannot kill anyone.
pub fn find_dead(now: Instant, beats: &[Beat], cfg: &Config) -> (Vec<u32>, String) {
    let dead: Vec<&Beat> = beats
        .iter()
        .filter(|b| now.saturating_duration_since(silent_since(b)) >= silence_allowed(b.link, cfg))
        .collect();
    if dead.is_empty() {
        let late = beats
            .iter()
            .filter(|b| {
                b.link == Link::Open
                    && now.saturating_duration_since(b.changed_at) >= cfg.heartbeat_timeout
            })
            .count();
        let mut reason = format!("all {} watched nodes alive", beats.len());
        if late > 0 {
            let _ = write!(
                reason,
                " ({late} late past the heartbeat timeout, their connections open)"
            );
        }
        return (Vec::new(), reason);
    }
    // The reason goes into the generation record every node reads and logs: the first few
    // name themselves, the rest are counted (4,096 agents on 2 CPUs once lost 692 at a time).
    let mut names: Vec<String> = dead
        .iter()
        .take(MAX_LISTED)
        .map(|b| {
            let silent = now.saturating_duration_since(b.changed_at).as_secs_f64();
            match b.link {
                Link::Closed => format!(
                    "node {} ({}) silent for {silent:.1}s, its connection closed{}",
                    b.node_rank,
                    b.who,
                    b.closed_at.map_or_else(String::new, |at| format!(
                        " {:.1}s ago and not reopened",
                        now.saturating_duration_since(at).as_secs_f64()
                    ))
                ),
                Link::Open => format!(
                    "node {} ({}) silent for {silent:.1}s although its connection is open (stall limit {:.1}s)",
                    b.node_rank,
                    b.who,
                    silence_allowed(Link::Open, cfg).as_secs_f64()
                ),
                Link::Unknown => format!("node {} ({}) silent for {silent:.1}s", b.node_rank, b.who),
            }
        })
        .collect();
    if dead.len() > MAX_LISTED {
        names.push(format!("and {} more", dead.len() - MAX_LISTED));
    }
    (
        dead.iter().map(|b| b.node_rank).collect(),
        format!(
            "{} (heartbeat timeout {:.1}s)",
            names.join(", "),
            cfg.heartbeat_timeout.as_secs_f64()
        ),
    )
}

/// Where a member's allowed silence counts from: its last beat, or for a closed connection the
/// moment it was seen closed if that came later (the grace is for beating again after it).
fn silent_since(b: &Beat) -> Instant {
    match (b.link, b.closed_at) {
        (Link::Closed, Some(at)) => b.changed_at.max(at),
        _ => b.changed_at,
    }
}

/// Node 0's verdict on a running generation in one watcher tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    /// The exit barrier is complete: the outcome is decided and nobody is judged any more.
    /// Members that left after it are not silent peers.
    Completed,
    Alive,
    /// These node ranks are lost; the generation must be aborted (see [`decide_abort`]).
    Lost(Vec<u32>),
}

/// Completion first, then the heartbeats: a member is never judged once the exit barrier of its
/// generation is complete, however late the observer looks.
pub fn decide_liveness(
    now: Instant,
    beats: &[Beat],
    barrier: Barrier,
    cfg: &Config,
) -> (Liveness, String) {
    if barrier == Barrier::Complete {
        return (
            Liveness::Completed,
            "exit barrier complete: the generation succeeded; nodes that left are not judged"
                .into(),
        );
    }
    let (dead, reason) = find_dead(now, beats, cfg);
    if dead.is_empty() {
        (Liveness::Alive, reason)
    } else {
        (Liveness::Lost(dead), reason)
    }
}

/// Whether nodes that registered while a round runs justify a new round: yes when there is room
/// (fewer than `max_nodes` members) or when a newcomer claims, as its own, the rank of a member
/// that holds it as its own too (Kubernetes restarted that pod, so the member we think is
/// running is gone). A newcomer whose own rank a spare took in a lost member's place
/// (`held_ranks`) waits as a spare and gets its rank back at the next round. Otherwise they are
/// spares.
pub fn decide_newcomers(
    members: &[u32],
    held_ranks: &[u32],
    newcomers: &[Registration],
    cfg: &Config,
) -> (bool, String) {
    if newcomers.is_empty() {
        return (false, "no newcomers".into());
    }
    if let Some(reg) = newcomers.iter().find(|r| {
        !r.held
            && r.node_rank
                .is_some_and(|n| members.contains(&n) && !held_ranks.contains(&n))
    }) {
        let rank = reg.node_rank.unwrap_or_default();
        return (
            true,
            format!(
                "node rank {rank} re-joined from {} ({}): its previous agent is gone",
                reg.host, reg.addr
            ),
        );
    }
    let unit = cfg.node_unit.max(1) as usize;
    let reachable = ((members.len() + newcomers.len()) / unit * unit).min(cfg.max_nodes as usize);
    if unit > 1 && (members.len() as u32) < cfg.max_nodes && reachable <= members.len() {
        return (
            false,
            format!(
                "{} node(s) waiting as spares: with them the gang would have {} nodes, not a multiple of --node-unit {unit}",
                newcomers.len(),
                members.len() + newcomers.len()
            ),
        );
    }
    if (members.len() as u32) < cfg.max_nodes {
        let hosts: Vec<&str> = newcomers.iter().map(|r| r.host.as_str()).collect();
        return (
            true,
            format!(
                "{} node(s) waiting ({}) and the gang has {} of at most {}: scaling up",
                newcomers.len(),
                hosts.join(", "),
                members.len(),
                cfg.max_nodes
            ),
        );
    }
    let mut why = format!(
        "{} node(s) waiting as spares: the gang is full ({} nodes)",
        newcomers.len(),
        cfg.max_nodes
    );
    for reg in newcomers.iter().filter(|r| !r.held) {
        if let Some(rank) = reg.node_rank.filter(|n| held_ranks.contains(n)) {
            let _ = write!(
                why,
                "; node rank {rank}'s own pod {} is back while a spare holds the rank in a lost member's place: it takes the rank at the next round",
                reg.host
            );
        }
    }
    (false, why)
}

/// The next generation after a worker failure on `node_rank`: a counted restart while the
/// budget lasts, else the fatal end of the job carrying the root cause's exit code.
pub fn decide_failure(
    current: &GenRecord,
    node_rank: u32,
    exit_code: u8,
    what: &str,
    cfg: &Config,
) -> (GenRecord, String) {
    if current.restarts < cfg.max_restarts {
        let restarts = current.restarts + 1;
        let reason = format!(
            "node {node_rank}: {what}; restarting the gang (restart {restarts} of {})",
            cfg.max_restarts
        );
        let rec = GenRecord {
            gen: current.gen + 1,
            restarts,
            kind: BumpKind::Failure,
            by: Some(node_rank),
            reason: reason.clone(),
            exit_code: None,
            recovered_from: current.recovered_from,
        };
        return (rec, reason);
    }
    let reason = format!(
        "node {node_rank}: {what}; no restarts left ({} used of {})",
        current.restarts, cfg.max_restarts
    );
    let rec = GenRecord {
        gen: current.gen + 1,
        restarts: current.restarts,
        kind: BumpKind::Fatal,
        by: Some(node_rank),
        reason: reason.clone(),
        exit_code: Some(exit_code),
        recovered_from: current.recovered_from,
    };
    (rec, reason)
}

/// The next generation when a node ends the job for everyone after its worker failure, whatever
/// the restart budget says (the agent's crash-loop guard: restarts that make no progress).
pub fn decide_give_up(
    current: &GenRecord,
    node_rank: u32,
    exit_code: u8,
    what: &str,
) -> (GenRecord, String) {
    let reason = format!("node {node_rank}: {what}");
    (
        fatal_bump(current, Some(node_rank), exit_code, reason.clone()),
        reason,
    )
}

/// A registration that ends the job for everyone (its GPU pre-flight failed under `require`):
/// the exit code and the message every agent leaves with, naming the node.
pub fn fatal_registration(reg: &Registration) -> Option<(u8, String)> {
    let fatal = reg.gpu.get("fatal")?;
    let code = fatal
        .get("exit_code")
        .and_then(serde_json::Value::as_u64)
        .and_then(|c| u8::try_from(c).ok())?;
    let message = fatal
        .get("message")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("no reason given");
    let rank = reg
        .node_rank
        .map_or_else(|| "?".to_owned(), |r| r.to_string());
    Some((
        code,
        format!("node rank {rank} ({}, {}): {message}", reg.host, reg.addr),
    ))
}

/// Where no lost node is ever replaced ([`Config::unreplaceable_loss`]): the exit code and the
/// reason that end the job when `lost` of the `group_size` members are gone and the rest are
/// fewer than `min_nodes`; `None` when a replacement may come or the rest can go on.
pub fn decide_unreplaceable_loss(
    lost: usize,
    group_size: u32,
    cfg: &Config,
) -> Option<(u8, String)> {
    let code = cfg.unreplaceable_loss?;
    let left = group_size.saturating_sub(u32::try_from(lost).unwrap_or(u32::MAX));
    (left < cfg.min_nodes).then(|| {
        (
            code,
            format!(
                "no replacement comes for a lost node (a Slurm step never restarts its tasks) and {left} node(s) are fewer than the minimum of {}",
                cfg.min_nodes
            ),
        )
    })
}

/// The generation that ends the job for every node with `exit_code`.
pub fn fatal_bump(
    current: &GenRecord,
    by: Option<u32>,
    exit_code: u8,
    reason: String,
) -> GenRecord {
    GenRecord {
        gen: current.gen + 1,
        restarts: current.restarts,
        kind: BumpKind::Fatal,
        by,
        reason,
        exit_code: Some(exit_code),
        recovered_from: current.recovered_from,
    }
}

/// The next generation after a membership change (free).
pub fn membership_bump(current: &GenRecord, by: u32, reason: String) -> GenRecord {
    GenRecord {
        gen: current.gen + 1,
        restarts: current.restarts,
        kind: BumpKind::Membership,
        by: Some(by),
        reason,
        exit_code: None,
        recovered_from: current.recovered_from,
    }
}

/// What `g<G>/done` is raised by when a generation is ended early (a lost node, a worker
/// failure, a newcomer): far above any gang size. Reports add 1, an abort adds this, and both go
/// through one ADD on one key, so the store itself orders them and each side learns from the
/// value its own ADD returns which came first. Completion is then a fact no later observer can
/// undo: the N-th report before any abort.
pub const ABORT: i64 = 1 << 40;

/// The exit barrier of one generation, as one read of `g<G>/done` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Barrier {
    /// `reported` of the members have reported their workers finished; no abort yet.
    Open { reported: u64 },
    /// Every member reported before any abort: the generation succeeded, whatever follows.
    Complete,
    /// An abort reached the key; whether it came before or after completion is told by the
    /// first aborter's own ADD (see [`decide_abort`]), not by a later read.
    Aborted,
}

/// Reads a value of `g<G>/done` for a gang of `group_size`.
pub fn barrier_state(value: i64, group_size: u32) -> Barrier {
    if value >= ABORT {
        Barrier::Aborted
    } else if value >= i64::from(group_size) {
        Barrier::Complete
    } else {
        Barrier::Open {
            reported: u64::try_from(value).unwrap_or(0),
        }
    }
}

/// What a member's own report (`ADD g<G>/done 1`, returning `after`) means for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// Ours was the last report: the barrier is complete; we wake the others.
    Completed,
    /// Others have yet to report: wait for completion (or for an abort's new generation).
    Waiting { reported: u64 },
    /// The generation was aborted before we reported: our report does not count; follow the new
    /// generation.
    TooLate,
}

/// A member's reading of its own report: completer, waiter, or too late to count.
pub fn decide_report(after: i64, group_size: u32) -> (Report, String) {
    let n = i64::from(group_size);
    if after >= ABORT {
        return (
            Report::TooLate,
            "the generation was ended before this node reported; following the next one".into(),
        );
    }
    if after >= n {
        return (
            Report::Completed,
            format!(
                "exit barrier complete: all {group_size} nodes reported their workers finished"
            ),
        );
    }
    let reported = u64::try_from(after).unwrap_or(0);
    (
        Report::Waiting { reported },
        format!("exit barrier: {reported} of {group_size} nodes reported; waiting"),
    )
}

/// What an abort (`ADD g<G>/done ABORT`, returning `after`) means for whoever wants to end the
/// generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abort {
    /// The barrier completed first: the generation succeeded and nothing may follow it — no
    /// lost-node decision, no re-form, no restart. The aborter wakes the barrier in case the
    /// last reporter has not yet.
    Completed,
    /// Ours is the first abort and the barrier was open: the barrier can never complete now
    /// (every later report sees the abort), so bumping the generation is safe.
    Won,
    /// Someone aborted before us; they decide (they bump the generation or wake the barrier).
    Follow,
}

/// An aborter's reading of its own abort: only the first one, made while the barrier was open,
/// may end the generation.
pub fn decide_abort(after: i64, group_size: u32) -> (Abort, String) {
    let before = after - ABORT;
    if before >= ABORT {
        return (
            Abort::Follow,
            "another node already ended this generation".into(),
        );
    }
    if before >= i64::from(group_size) {
        return (
            Abort::Completed,
            format!(
                "the exit barrier had completed (all {group_size} nodes reported): the generation succeeded; nothing follows it"
            ),
        );
    }
    (
        Abort::Won,
        format!(
            "ended the generation with {} of {group_size} nodes reported",
            before.max(0)
        ),
    )
}

/// What node 0 knows about the connection a member heartbeats on (the store runs in node 0's
/// process, so it sees its own sockets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// No evidence either way (no address published, or the store is not ours to look at).
    Unknown,
    /// The member's heartbeat connection is open: the kernel keeps it (TCP keep-alive answers,
    /// pending requests), so the process is alive, only late.
    Open,
    /// Seen open before, gone now: the process closed it, died, or TCP keep-alive reset it.
    Closed,
}

/// What a failed store operation is evidence of, as the agent that sent it sees it. Node 0 is
/// judged by the others through their own store connections only, so this is all they know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFault {
    /// The connection is open (or the host's kernel accepted a new one) but no answer came within
    /// the operation timeout: the store host is alive, its process starved, paused or overloaded.
    Slow,
    /// Nothing answered and nothing refused (no SYN-ACK, host unreachable, a garbled reply):
    /// the host may have vanished without a FIN or RST, or be cut off; only time tells.
    Silent,
    /// Refused, reset or closed: nothing listens at the store's address any more (the store's
    /// process died; its kernel answers for it).
    Gone,
}

/// How long the store may fail to answer before its host is lost, by the evidence of the last
/// failure: gone → at once (after one confirming reconnect); silent → the heartbeat timeout;
/// slow → [`STALL_FACTOR`] heartbeat timeouts, like a member whose connection is open.
pub fn store_silence_allowed(fault: StoreFault, cfg: &Config) -> std::time::Duration {
    match fault {
        StoreFault::Gone => std::time::Duration::ZERO,
        StoreFault::Silent => cfg.heartbeat_timeout,
        StoreFault::Slow => cfg.heartbeat_timeout * STALL_FACTOR,
    }
}

/// What to do after a failed store operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreVerdict {
    /// Try again at the next tick: the host may still answer.
    Retry,
    /// Try again at once (a fresh connection): one refused or closed connection is confirmed
    /// before the host is declared lost, so a connection the host dropped on purpose (over a
    /// limit) does not stop a gang.
    RetryNow,
    /// The store host is lost.
    Lost,
}

/// Whether the store host is lost, given the fault of this failure, the fault of the failure
/// before it (`None` when the last operation succeeded) and how long the store has not answered
/// (since the last success, by this agent's clock).
pub fn decide_store_fault(
    fault: StoreFault,
    previous: Option<StoreFault>,
    silent_for: std::time::Duration,
    cfg: &Config,
) -> (StoreVerdict, String) {
    let silent = silent_for.as_secs_f64();
    if fault == StoreFault::Gone {
        if previous == Some(StoreFault::Gone) {
            return (
                StoreVerdict::Lost,
                format!(
                    "the store host refused or closed the connection, and again on a fresh one (no answer for {silent:.1}s): its process is gone"
                ),
            );
        }
        return (
            StoreVerdict::RetryNow,
            "the store host closed or refused the connection; reconnecting at once to confirm"
                .into(),
        );
    }
    let allowed = store_silence_allowed(fault, cfg);
    let what = match fault {
        StoreFault::Slow => "open but slow (operations time out)",
        _ => "silent (no answer, no refusal)",
    };
    if silent_for >= allowed {
        return (
            StoreVerdict::Lost,
            format!(
                "no answer for {silent:.1}s, the store host {what}; limit {:.1}s",
                allowed.as_secs_f64()
            ),
        );
    }
    (
        StoreVerdict::Retry,
        format!(
            "store did not answer for {silent:.1}s, the host {what}; lost after {:.1}s",
            allowed.as_secs_f64()
        ),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn cfg(min: u32, max: u32) -> Config {
        let mut c = Config::new("t", min, max);
        c.join_timeout = Duration::from_secs(60);
        c.last_call_timeout = Duration::from_secs(5);
        c.heartbeat_timeout = Duration::from_secs(3);
        c.keep_alive_interval = Duration::from_secs(1);
        c.max_restarts = 1;
        c
    }

    fn reg(rank: Option<u32>, host: &str) -> Registration {
        Registration {
            agent_id: format!("id-{host}"),
            node_rank: rank,
            addr: format!("10.0.0.{}", host.len()),
            host: host.into(),
            local_world_size: 2,
            coordinator: false,
            gpu: serde_json::Value::Null,
            memory: None,
            held: false,
            spare_index: None,
        }
    }

    fn state(t0: Instant, regs: &[(Option<u32>, &str, u64)]) -> RoundState {
        RoundState {
            restarting: None,
            gen: 4,
            started: t0,
            arrivals: regs
                .iter()
                .enumerate()
                .map(|(i, &(rank, host, at))| Arrival {
                    slot: i as u64 + 1,
                    reg: reg(rank, host),
                    seen_at: t0 + Duration::from_secs(at),
                })
                .collect(),
            known_hosts: BTreeMap::new(),
        }
    }

    #[test]
    fn claimed_ranks_win_and_anonymous_nodes_fill_the_gaps_in_arrival_order() {
        let t0 = Instant::now();
        let s = state(
            t0,
            &[
                (None, "a", 0),
                (Some(0), "w0", 0),
                (None, "b", 0),
                (Some(2), "w2", 0),
            ],
        );
        let m = resolve_members(&s.arrivals, 4);
        assert_eq!(m.members, vec![(0, 1), (1, 0), (2, 3), (3, 2)]);
        assert!(m.spares.is_empty() && m.rejected.is_empty());
    }

    #[test]
    fn held_ranks_are_those_given_by_arrival_or_held_from_an_earlier_round() {
        let t0 = Instant::now();
        let mut s = state(
            t0,
            &[
                (Some(0), "w0", 0),
                (None, "anon", 0),
                (Some(2), "keeps-2", 0),
                (Some(3), "w3", 0),
            ],
        );
        // keeps-2 got rank 2 at an earlier round (by arrival): it holds it, it does not own it.
        s.arrivals[2].reg.held = true;
        let m = resolve_members(&s.arrivals, 4);
        assert_eq!(m.members, vec![(0, 0), (1, 1), (2, 2), (3, 3)]);
        assert_eq!(held_ranks(&s, &m), vec![1, 2]);
        assert!(held_ranks(&s, &Membership::default()).is_empty());
    }

    #[test]
    fn own_ranks_win_over_held_ones_and_pods_beyond_max_come_last() {
        let t0 = Instant::now();
        let mut s = state(
            t0,
            &[
                (Some(0), "w0", 0),
                (None, "w3", 0),
                (Some(1), "spare-in-1", 0),
                (Some(1), "w1", 0),
                (None, "anon", 0),
            ],
        );
        // w3 is Job index 3 of a 3-node gang; spare-in-1 holds rank 1 since w1 was lost, and
        // w1's own pod is back.
        s.arrivals[1].reg.spare_index = Some(3);
        s.arrivals[2].reg.held = true;
        let m = resolve_members(&s.arrivals, 3);
        // w1 takes its own rank; the displaced holder is first in line for a free one, ahead of
        // the anonymous node; the pod beyond MAX waits.
        assert_eq!(m.members, vec![(0, 0), (1, 3), (2, 2)]);
        assert_eq!(m.spares, vec![4, 1]);
        assert!(m.rejected.is_empty(), "{:?}", m.rejected);
        // A free rank goes to the pod beyond MAX when nobody else wants it.
        let mut s = state(
            t0,
            &[(Some(0), "w0", 0), (None, "w3", 0), (Some(1), "w1", 0)],
        );
        s.arrivals[1].reg.spare_index = Some(3);
        let m = resolve_members(&s.arrivals, 3);
        assert_eq!(m.members, vec![(0, 0), (1, 2), (2, 1)]);
        assert!(m.spares.is_empty());
    }

    #[test]
    fn a_spare_stands_in_for_a_rank_never_seen_only_after_the_last_call() {
        let t0 = Instant::now();
        let c = cfg(2, 2);
        let mut s = state(t0, &[(Some(0), "w0", 0), (None, "w2", 0)]);
        s.arrivals[1].reg.spare_index = Some(2);
        // Index 1 may only be slow to start: its rank waits for it through the last call.
        let (d, why) = decide_round(t0, &s, &c);
        assert_eq!(d, RoundDecision::Wait, "{why}");
        let (d, why) = decide_round(t0 + c.last_call_timeout, &s, &c);
        assert!(matches!(d, RoundDecision::Complete(_)), "{why}");
        // Index 1 in time: it takes its own rank, the spare waits.
        let mut s = state(
            t0,
            &[(Some(0), "w0", 0), (None, "w2", 0), (Some(1), "w1", 0)],
        );
        s.arrivals[1].reg.spare_index = Some(2);
        let RoundDecision::Complete(m) = decide_round(t0, &s, &c).0 else {
            panic!("both owners are in")
        };
        assert_eq!((m.members, m.spares), (vec![(0, 0), (1, 2)], vec![1]));
        // Rank 1 was in an earlier round, so its holder was lost: the spare takes it at once.
        let mut s = state(t0, &[(Some(0), "w0", 0), (None, "w2", 0)]);
        s.arrivals[1].reg.spare_index = Some(2);
        s.known_hosts.insert(1, "w1, 10.0.0.2".into());
        assert!(matches!(
            decide_round(t0, &s, &c).0,
            RoundDecision::Complete(_)
        ));
    }

    #[test]
    fn a_pod_back_for_a_rank_a_spare_holds_waits_instead_of_restarting_the_gang() {
        let c = cfg(3, 3);
        let w1 = reg(Some(1), "w1");
        let (bump, why) = decide_newcomers(&[0, 1, 2], &[1], std::slice::from_ref(&w1), &c);
        assert!(!bump, "{why}");
        assert!(
            why.contains("node rank 1's own pod w1 is back while a spare holds the rank"),
            "{why}"
        );
        // Held claims never mean "that member's pod restarted".
        let mut old = reg(Some(2), "moved");
        old.held = true;
        assert!(!decide_newcomers(&[0, 1, 2], &[], &[old], &c).0);
        // The member holding its own rank is gone when its pod comes back.
        assert!(decide_newcomers(&[0, 1, 2], &[], &[w1], &c).0);
    }

    #[test]
    fn ranks_follow_the_ordinal_not_the_host_name_order() {
        let t0 = Instant::now();
        let s = state(
            t0,
            &[(Some(10), "job-worker-10", 0), (Some(2), "job-worker-2", 0)],
        );
        let m = resolve_members(&s.arrivals, 11);
        assert_eq!(m.members, vec![(2, 1), (10, 0)]);
        let a = assign(&s, &m, 0, ("10.0.0.1", 1234));
        assert_eq!(a[0].1.node_rank, 2);
        assert_eq!(a[0].1.base_global_rank, 0);
        assert_eq!(a[1].1.node_rank, 10);
        assert_eq!(a[1].1.group_rank, 1);
        assert_eq!(a[1].1.base_global_rank, 2);
    }

    #[test]
    fn a_second_claim_of_a_rank_is_rejected_and_extra_anonymous_nodes_are_spares() {
        let t0 = Instant::now();
        let s = state(
            t0,
            &[
                (Some(1), "x", 0),
                (Some(1), "y", 0),
                (None, "p", 0),
                (None, "q", 0),
                (Some(7), "z", 0),
            ],
        );
        let m = resolve_members(&s.arrivals, 2);
        assert_eq!(m.members, vec![(0, 2), (1, 0)]);
        assert_eq!(m.spares, vec![3]);
        assert_eq!(m.rejected.len(), 2);
        assert!(
            m.rejected[0].1.contains("already taken by x"),
            "{:?}",
            m.rejected
        );
        assert!(
            m.rejected[1].1.contains("outside --nnodes"),
            "{:?}",
            m.rejected
        );
    }

    #[test]
    fn a_full_round_completes_at_once() {
        let t0 = Instant::now();
        let s = state(t0, &[(Some(0), "a", 0), (Some(1), "b", 1)]);
        let (d, why) = decide_round(t0 + Duration::from_secs(1), &s, &cfg(2, 2));
        assert!(matches!(d, RoundDecision::Complete(ref m) if m.members.len() == 2));
        assert!(why.contains("all 2 nodes joined"), "{why}");
    }

    #[test]
    fn min_nodes_wait_for_the_last_call_counted_from_the_min_th_arrival() {
        let t0 = Instant::now();
        let s = state(t0, &[(Some(0), "a", 0), (Some(1), "b", 10)]);
        let c = cfg(2, 3);
        let (d, why) = decide_round(t0 + Duration::from_secs(14), &s, &c);
        assert_eq!(d, RoundDecision::Wait);
        assert!(why.contains("last call ends in 1.0s"), "{why}");
        let (d, why) = decide_round(t0 + Duration::from_secs(15), &s, &c);
        assert!(matches!(d, RoundDecision::Complete(ref m) if m.members.len() == 2));
        assert!(
            why.contains("last call") && why.contains("missing node rank 2"),
            "{why}"
        );
    }

    #[test]
    fn a_restart_whose_members_are_all_back_needs_no_last_call() {
        let t0 = Instant::now();
        let c = cfg(2, 3);
        let mut s = state(t0, &[(Some(0), "a", 0), (Some(1), "b", 10)]);
        s.restarting = Some([0, 1].into());
        let (d, why) = decide_round(t0 + Duration::from_millis(20), &s, &c);
        assert!(matches!(d, RoundDecision::Complete(ref m) if m.members.len() == 2));
        assert!(
            why.contains("all 2 nodes of the round before are back"),
            "{why}"
        );
        // One member of the round before is not back yet: wait for it as for any round.
        s.restarting = Some([0, 1, 2].into());
        let (d, _) = decide_round(t0 + Duration::from_millis(20), &s, &c);
        assert_eq!(d, RoundDecision::Wait);
        // A newcomer with them: the membership changes, the last call stands.
        let mut s = state(
            t0,
            &[(Some(0), "a", 0), (Some(1), "b", 5), (None, "new", 10)],
        );
        s.restarting = Some([0, 1].into());
        let c4 = cfg(2, 4);
        let (d, why) = decide_round(t0 + Duration::from_millis(20), &s, &c4);
        assert_eq!(d, RoundDecision::Wait, "{why}");
    }

    #[test]
    fn the_timeout_names_the_missing_ranks_and_their_last_known_hosts() {
        let t0 = Instant::now();
        let mut s = state(t0, &[(Some(0), "a", 0), (Some(2), "c", 0)]);
        s.known_hosts.insert(1, "worker-1 (10.0.0.9)".into());
        let c = cfg(4, 4);
        let (d, why) = decide_round(t0 + Duration::from_secs(59), &s, &c);
        assert_eq!(d, RoundDecision::Wait);
        assert!(why.contains("waiting for 2 more"), "{why}");
        let (d, _) = decide_round(t0 + Duration::from_secs(60), &s, &c);
        let RoundDecision::Timeout(msg) = d else {
            panic!("expected a timeout")
        };
        assert!(
            msg.contains("never arrived: node ranks 1 (worker-1 (10.0.0.9)), 3"),
            "{msg}"
        );
        assert!(msg.starts_with("2 of 4 required nodes"), "{msg}");
    }

    #[test]
    fn long_missing_lists_are_cut() {
        let t0 = Instant::now();
        let s = state(t0, &[]);
        let (d, _) = decide_round(t0 + Duration::from_secs(61), &s, &cfg(40, 40));
        let RoundDecision::Timeout(msg) = d else {
            panic!("expected a timeout")
        };
        assert!(
            msg.contains("0, 1, 2") && msg.ends_with("and 24 more"),
            "{msg}"
        );
    }

    #[test]
    fn silence_for_the_heartbeat_timeout_is_death_by_the_observers_clock() {
        let t0 = Instant::now();
        let beats = vec![
            Beat {
                node_rank: 1,
                who: "w1".into(),
                last_value: b"5".to_vec(),
                changed_at: t0,
                link: Link::Unknown,
                closed_at: None,
            },
            Beat {
                node_rank: 2,
                who: "w2".into(),
                last_value: b"9".to_vec(),
                changed_at: t0 + Duration::from_secs(2),
                link: Link::Unknown,
                closed_at: None,
            },
        ];
        let c = cfg(1, 3);
        let (dead, _) = find_dead(t0 + Duration::from_millis(2999), &beats, &c);
        assert!(dead.is_empty());
        let (dead, why) = find_dead(t0 + Duration::from_secs(3), &beats, &c);
        assert_eq!(dead, vec![1]);
        assert!(why.contains("node 1 (w1) silent for 3.0s"), "{why}");
    }

    #[test]
    fn newcomers_restart_the_gang_when_there_is_room_or_they_replace_a_member() {
        let c = cfg(2, 3);
        let (bump, why) = decide_newcomers(&[0, 1], &[], &[reg(None, "n")], &c);
        assert!(bump && why.contains("scaling up"), "{why}");
        let (bump, why) = decide_newcomers(&[0, 1, 2], &[], &[reg(None, "n")], &c);
        assert!(!bump && why.contains("spares"), "{why}");
        let (bump, why) = decide_newcomers(&[0, 1, 2], &[], &[reg(Some(1), "w1b")], &c);
        assert!(bump && why.contains("node rank 1 re-joined"), "{why}");
        assert!(!decide_newcomers(&[0], &[], &[], &c).0);
    }

    #[test]
    fn failures_consume_restarts_until_the_budget_is_spent() {
        let c = cfg(1, 1);
        let (next, why) = decide_failure(&GenRecord::first(), 2, 3, "rank 5 exited with 3", &c);
        assert_eq!(
            (next.gen, next.restarts, next.kind),
            (1, 1, BumpKind::Failure)
        );
        assert!(why.contains("restart 1 of 1"), "{why}");
        let (last, why) = decide_failure(&next, 0, 3, "rank 0 exited with 3", &c);
        assert_eq!(
            (last.gen, last.kind, last.exit_code),
            (2, BumpKind::Fatal, Some(3))
        );
        assert!(why.contains("no restarts left"), "{why}");
        let m = membership_bump(&next, 0, "scale".into());
        assert_eq!((m.gen, m.restarts, m.kind), (2, 1, BumpKind::Membership));
    }

    #[test]
    fn a_node_unit_keeps_a_multiple_and_the_rest_wait_as_spares() {
        let t0 = Instant::now();
        let mut c = cfg(2, 6);
        c.node_unit = 2;
        // Five arrive: four form the gang (node ranks 0-3), the fifth is a spare.
        let s = state(
            t0,
            &[
                (Some(0), "a", 0),
                (Some(1), "b", 0),
                (Some(2), "c", 0),
                (Some(3), "d", 0),
                (Some(4), "e", 0),
            ],
        );
        let (d, why) = decide_round(t0 + c.last_call_timeout, &s, &c);
        let RoundDecision::Complete(m) = d else {
            panic!("{why}")
        };
        let ranks: Vec<u32> = m.members.iter().map(|&(r, _)| r).collect();
        assert_eq!(ranks, [0, 1, 2, 3], "{why}");
        assert_eq!(m.spares, [4]);
        // Three nodes are never a gang: two, and one spare.
        let s = state(
            t0,
            &[(Some(0), "a", 0), (Some(1), "b", 0), (Some(2), "c", 0)],
        );
        let RoundDecision::Complete(m) = decide_round(t0 + c.last_call_timeout, &s, &c).0 else {
            panic!("three nodes with unit 2 and min 2 form a gang of two")
        };
        assert_eq!((m.members.len(), m.spares.len()), (2, 1));
        // One newcomer to a gang of 4 waits; a second one makes 6: scale up.
        let (bump, why) = decide_newcomers(&[0, 1, 2, 3], &[], &[reg(None, "n")], &c);
        assert!(
            !bump && why.contains("not a multiple of --node-unit 2"),
            "{why}"
        );
        let (bump, why) =
            decide_newcomers(&[0, 1, 2, 3], &[], &[reg(None, "n"), reg(None, "m")], &c);
        assert!(bump && why.contains("scaling up"), "{why}");
    }

    #[test]
    fn giving_up_ends_the_job_with_restarts_left() {
        // Whatever the budget: the record keeps the restarts used and ends the job.
        let (next, why) = decide_give_up(&GenRecord::first(), 1, 209, "crash loop: rank 1");
        assert_eq!(
            (next.gen, next.restarts, next.kind, next.exit_code, next.by),
            (1, 0, BumpKind::Fatal, Some(209), Some(1))
        );
        assert_eq!(why, "node 1: crash loop: rank 1");
    }

    #[test]
    fn a_registration_with_a_fatal_gpu_verdict_ends_the_job_by_name() {
        let mut bad = reg(Some(2), "worker-2");
        bad.gpu = serde_json::json!({
            "verdict": "unhealthy",
            "fatal": {"exit_code": 204, "message": "GPU 3 (GPU-abc, 0000:3b:00.0): nvlink_links: 16 of 18 links active"}
        });
        let (code, reason) = fatal_registration(&bad).unwrap();
        assert_eq!(code, 204);
        assert!(reason.starts_with("node rank 2 (worker-2, "), "{reason}");
        assert!(reason.contains("GPU 3 (GPU-abc, 0000:3b:00.0)"), "{reason}");
        let next = fatal_bump(&GenRecord::first(), Some(0), code, reason);
        assert_eq!(
            (next.gen, next.kind, next.exit_code),
            (1, BumpKind::Fatal, Some(204))
        );

        // A warning-only verdict (no `fatal`) keeps the node in the round.
        let mut warned = reg(Some(1), "worker-1");
        warned.gpu = serde_json::json!({"verdict": "unhealthy"});
        assert_eq!(fatal_registration(&warned), None);
        assert_eq!(fatal_registration(&reg(Some(0), "worker-0")), None);
    }

    fn beat(rank: u32, changed_at: Instant, link: Link) -> Beat {
        Beat {
            node_rank: rank,
            who: format!("w{rank}"),
            last_value: b"1".to_vec(),
            changed_at,
            link,
            closed_at: (link == Link::Closed).then_some(changed_at),
        }
    }

    #[test]
    fn the_nth_report_before_any_abort_completes_the_barrier_and_an_abort_after_it_changes_nothing()
    {
        // Reports 1..=3 of 3, then node 0's watcher (late) wants to end the generation.
        assert!(matches!(
            decide_report(1, 3).0,
            Report::Waiting { reported: 1 }
        ));
        assert!(matches!(
            decide_report(2, 3).0,
            Report::Waiting { reported: 2 }
        ));
        let (r, why) = decide_report(3, 3);
        assert_eq!(r, Report::Completed, "{why}");
        let (a, why) = decide_abort(3 + ABORT, 3);
        assert_eq!(a, Abort::Completed, "{why}");
        assert!(why.contains("nothing follows"), "{why}");
        // A second aborter only follows the first one's decision.
        assert_eq!(decide_abort(3 + 2 * ABORT, 3).0, Abort::Follow);
    }

    #[test]
    fn an_abort_before_the_last_report_wins_and_the_late_report_does_not_count() {
        let (a, why) = decide_abort(2 + ABORT, 3);
        assert_eq!(a, Abort::Won, "{why}");
        assert!(why.contains("2 of 3"), "{why}");
        assert_eq!(decide_report(3 + ABORT, 3).0, Report::TooLate);
        assert_eq!(barrier_state(3 + ABORT, 3), Barrier::Aborted);
    }

    #[test]
    fn a_node_that_left_right_after_completion_is_not_judged_while_node_0_has_not_observed_it() {
        // Node 7 saw the barrier complete and left (its connection closed); node 0 looks much
        // later, past every timeout.
        let t0 = Instant::now();
        let c = cfg(1, 8);
        let beats = vec![beat(7, t0, Link::Closed), beat(3, t0, Link::Unknown)];
        let now = t0 + c.heartbeat_timeout * 10;
        let (v, why) = decide_liveness(now, &beats, barrier_state(8, 8), &c);
        assert_eq!(v, Liveness::Completed, "{why}");
        // The same silence before completion is a loss.
        let (v, _) = decide_liveness(now, &beats, barrier_state(7, 8), &c);
        assert_eq!(v, Liveness::Lost(vec![7, 3]));
    }

    #[test]
    fn the_watcher_firing_between_the_last_report_and_the_wake_up_finds_the_barrier_complete() {
        // The last reporter's ADD made the count 4 of 4 but it has not yet SET done_all; node 0's
        // watcher judged a member lost from an earlier read and now tries to end the generation.
        assert_eq!(barrier_state(4, 4), Barrier::Complete);
        assert_eq!(decide_abort(4 + ABORT, 4).0, Abort::Completed);
        // And a waiter woken by its own watcher in that window reads the counter: complete.
        assert_eq!(barrier_state(4, 4), Barrier::Complete);
    }

    #[test]
    fn a_node_that_reported_and_then_died_before_completion_is_a_failure() {
        let t0 = Instant::now();
        let c = cfg(1, 3);
        // Node 2 reported (2 of 3 in), then its process died: the kernel closed its connection.
        let beats = vec![
            beat(1, t0 + c.keep_alive_interval, Link::Open),
            beat(2, t0, Link::Closed),
        ];
        let now = t0 + c.keep_alive_interval;
        let (v, why) = decide_liveness(now, &beats, Barrier::Open { reported: 2 }, &c);
        assert_eq!(v, Liveness::Lost(vec![2]), "{why}");
        assert!(
            why.contains("node 2 (w2) silent for") && why.contains("connection closed"),
            "{why}"
        );
        // Node 0 aborts from 2 of 3: the abort wins, the gang re-forms.
        assert_eq!(decide_abort(2 + ABORT, 3).0, Abort::Won);
    }

    #[test]
    fn an_open_connection_keeps_a_late_node_alive_until_the_stall_limit_and_a_closed_one_is_lost_at_once(
    ) {
        let t0 = Instant::now();
        let c = cfg(1, 3);
        let open = [beat(1, t0, Link::Open)];
        let (dead, why) = find_dead(t0 + c.heartbeat_timeout * 2, &open, &c);
        assert!(dead.is_empty(), "{why}");
        assert!(why.contains("1 late past the heartbeat timeout"), "{why}");
        let (dead, why) = find_dead(t0 + c.heartbeat_timeout * STALL_FACTOR, &open, &c);
        assert_eq!(dead, vec![1], "{why}");
        assert!(why.contains("although its connection is open"), "{why}");
        let closed = [beat(1, t0, Link::Closed)];
        assert!(find_dead(t0 + CLOSED_GRACE / 2, &closed, &c).0.is_empty());
        assert_eq!(find_dead(t0 + CLOSED_GRACE, &closed, &c).0, vec![1]);
        // The grace runs from when the close was seen, not from the last beat.
        let mut seen_late = beat(1, t0, Link::Closed);
        seen_late.closed_at = Some(t0 + c.keep_alive_interval);
        let late = [seen_late];
        let at = t0 + c.keep_alive_interval + CLOSED_GRACE / 2;
        assert!(find_dead(at, &late, &c).0.is_empty());
        assert_eq!(find_dead(at + CLOSED_GRACE, &late, &c).0, vec![1]);
        let unknown = [beat(1, t0, Link::Unknown)];
        assert!(find_dead(t0 + c.keep_alive_interval, &unknown, &c)
            .0
            .is_empty());
        assert_eq!(find_dead(t0 + c.heartbeat_timeout, &unknown, &c).0, vec![1]);
    }

    #[test]
    fn many_lost_nodes_are_all_returned_and_the_reason_names_the_first_few() {
        let t0 = Instant::now();
        let c = cfg(1, 700);
        let beats: Vec<Beat> = (1..=700).map(|n| beat(n, t0, Link::Unknown)).collect();
        let (dead, why) = find_dead(t0 + c.heartbeat_timeout, &beats, &c);
        assert_eq!(dead, (1..=700).collect::<Vec<u32>>());
        assert_eq!(why.matches("silent for").count(), MAX_LISTED, "{why}");
        assert!(why.starts_with("node 1 ("), "{why}");
        assert!(
            why.contains(&format!("and {} more (heartbeat timeout", 700 - MAX_LISTED)),
            "{why}"
        );
    }

    #[test]
    fn a_slow_store_host_gets_the_stall_limit_a_silent_one_the_heartbeat_timeout() {
        let c = cfg(1, 3);
        let hb = c.heartbeat_timeout;
        // One operation timed out on an open connection (the 2,048-agent case): not lost.
        let (v, why) = decide_store_fault(StoreFault::Slow, None, hb, &c);
        assert_eq!(v, StoreVerdict::Retry, "{why}");
        assert!(why.contains("open but slow"), "{why}");
        let (v, why) = decide_store_fault(
            StoreFault::Slow,
            Some(StoreFault::Slow),
            hb * (STALL_FACTOR * 100 - 1) / 100,
            &c,
        );
        assert_eq!(v, StoreVerdict::Retry, "{why}");
        let (v, why) = decide_store_fault(
            StoreFault::Slow,
            Some(StoreFault::Slow),
            hb * STALL_FACTOR,
            &c,
        );
        assert_eq!(v, StoreVerdict::Lost, "{why}");
        assert!(why.contains("limit 12.0s"), "{why}");
        // Nothing answers and nothing refuses: the heartbeat timeout, as before.
        let (v, _) = decide_store_fault(StoreFault::Silent, None, hb / 2, &c);
        assert_eq!(v, StoreVerdict::Retry);
        let (v, why) = decide_store_fault(StoreFault::Silent, Some(StoreFault::Slow), hb, &c);
        assert_eq!(v, StoreVerdict::Lost, "{why}");
        assert!(why.contains("silent"), "{why}");
    }

    #[test]
    fn a_refused_or_closed_store_is_lost_at_once_after_one_confirming_reconnect() {
        let c = cfg(1, 3);
        let (v, why) = decide_store_fault(StoreFault::Gone, None, Duration::ZERO, &c);
        assert_eq!(v, StoreVerdict::RetryNow, "{why}");
        // Slow before, gone now: still confirmed once (the host may have dropped a stuck
        // connection on purpose).
        let (v, _) = decide_store_fault(
            StoreFault::Gone,
            Some(StoreFault::Slow),
            c.heartbeat_timeout,
            &c,
        );
        assert_eq!(v, StoreVerdict::RetryNow);
        let (v, why) = decide_store_fault(
            StoreFault::Gone,
            Some(StoreFault::Gone),
            Duration::from_millis(3),
            &c,
        );
        assert_eq!(v, StoreVerdict::Lost, "{why}");
        assert!(why.contains("its process is gone"), "{why}");
        assert_eq!(store_silence_allowed(StoreFault::Gone, &c), Duration::ZERO);
    }

    #[test]
    fn a_loss_ends_the_job_at_once_only_where_no_replacement_comes_and_too_few_remain() {
        let mut cfg = Config::new("job", 2, 3);
        assert_eq!(
            decide_unreplaceable_loss(1, 2, &cfg),
            None,
            "a replacement may come"
        );
        cfg.unreplaceable_loss = Some(203);
        let (code, why) = decide_unreplaceable_loss(1, 2, &cfg).unwrap();
        assert_eq!(code, 203);
        assert!(
            why.contains("1 node(s) are fewer than the minimum of 2"),
            "{why}"
        );
        assert_eq!(
            decide_unreplaceable_loss(1, 3, &cfg),
            None,
            "two remain: MIN is kept"
        );
    }
}
