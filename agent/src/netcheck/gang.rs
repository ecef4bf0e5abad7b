//! The check's exchange through the rendezvous store: who listens where, what each node
//! measured, round 2's plan and node 0's verdict. Node 0 decides; the others measure and
//! follow, so every node acts on one verdict.
//!
//! Keys, under the round's own prefix `muster/<run_id>/g<G>/net/` (so nothing of an earlier
//! round is read):
//!
//! | key | value | written by |
//! |---|---|---|
//! | `addr/<g>` | JSON: the node, its listener's port and token (or why it has none) | node of group rank g |
//! | `r1/<g>`, `r2/<g>` | JSON list of [`Sample`]s it measured in round 1, 2 | node g |
//! | `plan2` | JSON list of [`Pair`]s (empty: no round 2) | node 0 |
//! | `verdict/<g>` | JSON [`Report`]: node g's view of the verdict | node 0, in one MULTI_SET, after any generation bump it implies |
//! | `acks` | ADD counter: members that read a verdict ending the round | members |
//!
//! What crosses the store grows with the gang size, never with its square: node 0 reads every
//! address and every result once; a member reads only the addresses of the nodes it measures
//! and its own view of the verdict (its measurements, the findings, the gang's references).
//! At 2,048 nodes every member reading every address and the whole report was 2,048 times
//! half a megabyte through node 0, which took seconds past the budget on a loaded store host.
//!
//! Time, as fractions of the budget B from each node's own start: addresses by 0.25 B; each
//! stream lasts at most 0.2 B; node 0 takes round 1's results until 0.6 B and round 2's until
//! 0.95 B. A member waits longer than that for node 0's answers, so a slow node 0 delays the
//! gang instead of splitting it; a member that still hears nothing goes on without a verdict.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rendezvous::rdzv::{decide as rdzv_decide, keys::Keys, GenRecord, Kv, KvError};
use serde::{Deserialize, Serialize};
use tokio::time::{sleep, Instant};
use tracing::debug;

use super::plan::{self, Pair};
use super::probe::{self, Limits, Listener};
use super::verdict::{
    self, Action, Classifier, Finding, FindingCounts, NodeInfo, Reference, Sample, Verdict,
};

/// The most findings naming other nodes that a member's view carries (besides every one that
/// names it): enough to see what kind of trouble the gang has, while a verdict with hundreds of
/// findings is not copied to every member.
const VIEW_FINDINGS: usize = 8;
use super::Settings;
use crate::exit_code;

/// What a member waits for node 0 beyond node 0's own schedule (its start may lag ours).
const MEMBER_GRACE: Duration = Duration::from_secs(3);
/// How often node 0 looks at the acknowledgement counter.
const ACK_POLL: Duration = Duration::from_millis(10);

/// One node's entry under `addr/<g>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Published {
    node: NodeInfo,
    port: u16,
    token: String,
    /// Why this node has no listener (the peers record their measurement as failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// This node's place in the round being checked.
#[derive(Debug, Clone)]
pub struct RoundInfo {
    pub run_id: String,
    pub generation: u64,
    /// This node (its group rank says whether it is node 0, the decider).
    pub me: NodeInfo,
    /// The advertised address, where the listener binds.
    pub ip: IpAddr,
    pub world: u32,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub settings: Settings,
}

/// Node 0's verdict with what is behind it: on node 0 every node and measurement; on a member
/// its view ([`Report::view_for`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The nodes `samples` and the findings mention (on node 0: all of them).
    pub nodes: Vec<NodeInfo>,
    pub samples: Vec<Sample>,
    pub verdict: Verdict,
    pub action: Action,
    /// The gang's references, from every node's round-1 measurements.
    pub reference: Reference,
    /// How many findings the verdict has (a view lists only some of them).
    pub counts: FindingCounts,
    /// How long the check took on node 0.
    pub millis: u64,
}

impl Report {
    /// Tells slow from normal with the gang's references (a view has too few samples to
    /// compute them).
    pub fn classifier(&self, thresholds: &super::Thresholds) -> Classifier {
        Classifier::from_reference(self.reference, thresholds)
    }

    /// The measurement table (see [`verdict::table`]).
    pub fn table(&self, thresholds: &super::Thresholds) -> String {
        verdict::table(&self.nodes, &self.samples, &self.classifier(thresholds))
    }

    /// What the node of group rank `me` needs of this report: the measurements it made or
    /// received, every finding that names it and the first few others, the nodes those name,
    /// the reason, the counts and the action.
    #[must_use]
    pub fn view_for(&self, me: u32) -> Report {
        let samples: Vec<Sample> = self
            .samples
            .iter()
            .filter(|s| s.from == me || s.to == me)
            .cloned()
            .collect();
        let mut others = 0;
        let findings: Vec<Finding> = self
            .verdict
            .findings
            .iter()
            .filter(|f| {
                f.ranks().contains(&me) || {
                    others += 1;
                    others <= VIEW_FINDINGS
                }
            })
            .cloned()
            .collect();
        let mut named: BTreeSet<u32> = samples.iter().flat_map(|s| [s.from, s.to]).collect();
        named.insert(me);
        named.extend(findings.iter().flat_map(Finding::ranks));
        Report {
            nodes: self
                .nodes
                .iter()
                .filter(|n| named.contains(&n.group_rank))
                .cloned()
                .collect(),
            samples,
            verdict: Verdict {
                findings,
                reason: self.verdict.reason.clone(),
                inconclusive: self.verdict.inconclusive,
            },
            action: self.action.clone(),
            reference: self.reference,
            counts: self.counts,
            millis: self.millis,
        }
    }
}

/// How the check ended on this node.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Node 0's report.
    Report(Report),
    /// No verdict reached this node in time (why): the workers start.
    NoVerdict(String),
}

/// The store failed under the check.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("lost the store host (node 0) during the network check: {0}")]
    Store(String),
    /// No answer in time (the connection open, or no refusal): [`run`] ends the check without a
    /// verdict rather than fail with it.
    #[error("the store did not answer during the network check: {0}")]
    StoreSlow(String),
    #[error("could not encode a network check value: {0}")]
    Encode(#[from] serde_json::Error),
}

#[allow(clippy::needless_pass_by_value)] // used as `.map_err(lost)`
fn lost(e: KvError) -> CheckError {
    match e.fault() {
        Some(rdzv_decide::StoreFault::Gone) => CheckError::Store(e.to_string()),
        _ => CheckError::StoreSlow(e.to_string()),
    }
}

struct NetKeys {
    prefix: String,
}

impl NetKeys {
    fn new(run_id: &str, generation: u64) -> Self {
        Self {
            prefix: format!("muster/{run_id}/g{generation}/net/"),
        }
    }

    fn key(&self, what: &str) -> Vec<u8> {
        format!("{}{what}", self.prefix).into_bytes()
    }

    fn per_node(&self, what: &str, world: u32) -> Vec<Vec<u8>> {
        (0..world)
            .map(|g| self.key(&format!("{what}/{g}")))
            .collect()
    }
}

/// Runs the check on this node. `Err` only when the store host is gone (it refused or closed the
/// connection). A store that does not answer in time ends the check without a verdict instead:
/// the check's budget is long spent by then, and whether the host is lost is the watcher's to
/// judge, by the same rules as any other store operation of the round (a slow store is not a
/// lost one). Under load that is the common case, and a member that exited 205 on it left the
/// rest of the gang waiting for it in vain.
pub async fn run<K: Kv>(kv: &mut K, round: &RoundInfo) -> Result<Outcome, CheckError> {
    match check(kv, round).await {
        Err(CheckError::StoreSlow(why)) => Ok(Outcome::NoVerdict(format!(
            "the store did not answer in time ({why})"
        ))),
        other => other,
    }
}

async fn check<K: Kv>(kv: &mut K, round: &RoundInfo) -> Result<Outcome, CheckError> {
    let start = Instant::now();
    let budget = round.settings.budget;
    let keys = NetKeys::new(&round.run_id, round.generation);
    let me = round.me.group_rank;
    let limits = Limits::for_budget(budget, round.settings.stream_bytes);
    let listener = Listener::bind(round.ip, limits).await;
    let published = match &listener {
        Ok(l) => Published {
            node: round.me.clone(),
            port: l.addr().port(),
            token: probe::token_hex(&l.token()),
            error: None,
        },
        Err(e) => Published {
            node: round.me.clone(),
            port: 0,
            token: String::new(),
            error: Some(format!("could not listen on {}: {e}", round.ip)),
        },
    };
    kv.set(
        &keys.key(&format!("addr/{me}")),
        &serde_json::to_vec(&published)?,
    )
    .await
    .map_err(lost)?;
    let ring: Vec<Pair> = plan::ring(round.world)
        .into_iter()
        .filter(|p| p.from == me)
        .collect();
    // Node 0 names every node in its report; a member needs only whom it measures.
    let wanted: Vec<u32> = if me == 0 {
        (0..round.world).collect()
    } else {
        ring.iter().map(|p| p.to).collect()
    };
    let mut peers = vec![None; round.world as usize];
    read_addresses(kv, &keys, &wanted, &mut peers, start + budget.mul_f64(0.25)).await?;
    let stream_time = budget.mul_f64(0.2);
    let r1 = measure_all(
        &ring,
        1,
        &peers,
        round,
        stream_time,
        start + budget.mul_f64(0.55),
        1,
    )
    .await;
    kv.set(&keys.key(&format!("r1/{me}")), &serde_json::to_vec(&r1)?)
        .await
        .map_err(lost)?;
    let outcome = if me == 0 {
        let nodes = (0..round.world)
            .map(|g| {
                peers[g as usize].as_ref().map_or_else(
                    || NodeInfo {
                        group_rank: g,
                        node_rank: g,
                        host: "?".to_owned(),
                        addr: "?".to_owned(),
                    },
                    |p: &Published| p.node.clone(),
                )
            })
            .collect();
        coordinate(kv, round, &keys, &peers, nodes, start).await?
    } else {
        follow(kv, round, &keys, &mut peers, start).await?
    };
    if let Ok(l) = listener {
        l.close().await;
    }
    Ok(outcome)
}

/// Node 0: collect round 1, plan and run round 2, judge, publish.
async fn coordinate<K: Kv>(
    kv: &mut K,
    round: &RoundInfo,
    keys: &NetKeys,
    peers: &[Option<Published>],
    nodes: Vec<NodeInfo>,
    start: Instant,
) -> Result<Outcome, CheckError> {
    let budget = round.settings.budget;
    let th = &round.settings.thresholds;
    let r1_keys = keys.per_node("r1", round.world);
    let mut samples: Vec<Sample> =
        wait_and_read::<_, Vec<Sample>>(kv, &r1_keys, start + budget.mul_f64(0.6))
            .await?
            .into_iter()
            .flatten()
            .flatten()
            .collect();
    let c = Classifier::new(round.world, &samples, th);
    let plan2 = plan::second_round(round.world, &samples, &c);
    kv.set(&keys.key("plan2"), &serde_json::to_vec(&plan2)?)
        .await
        .map_err(lost)?;
    if !plan2.is_empty() {
        debug!("network check round 2: {plan2:?}");
        let mine: Vec<Pair> = plan2.iter().copied().filter(|p| p.from == 0).collect();
        let now = Instant::now();
        measure_round_2(kv, keys, &mine, peers, round, now).await?;
        let senders: BTreeSet<u32> = plan2.iter().map(|p| p.from).collect();
        let r2_keys: Vec<Vec<u8>> = senders
            .iter()
            .map(|g| keys.key(&format!("r2/{g}")))
            .collect();
        let deadline = (start + budget.mul_f64(0.95)).max(now + budget.mul_f64(0.35));
        samples.extend(
            wait_and_read::<_, Vec<Sample>>(kv, &r2_keys, deadline)
                .await?
                .into_iter()
                .flatten()
                .flatten(),
        );
    }
    let verdict = verdict::judge(round.world, &samples, th);
    let action = verdict::decide(
        round.settings.mode,
        &verdict,
        &nodes,
        round.min_nodes,
        round.max_nodes,
    );
    let report = Report {
        counts: FindingCounts::of(&verdict.findings),
        nodes,
        samples,
        verdict,
        action,
        reference: c.reference(),
        millis: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
    };
    // The generation moves before the verdict is out, so a member that reads "leave" or "end"
    // finds the new generation already there (and one that missed the verdict still learns it
    // from the generation).
    bump_for(kv, &round.run_id, &report.action).await?;
    let views = (1..round.world)
        .map(|g| {
            Ok((
                keys.key(&format!("verdict/{g}")),
                serde_json::to_vec(&report.view_for(g))?,
            ))
        })
        .collect::<Result<Vec<_>, serde_json::Error>>()?;
    kv.multi_set(&views).await.map_err(lost)?;
    if matches!(report.action, Action::End { .. }) {
        // Node 0's exit takes the store with it: stay until every member read why.
        let until = Instant::now() + budget.max(Duration::from_secs(1));
        let want = i64::from(round.world.saturating_sub(1));
        while Instant::now() < until {
            if kv.add(&keys.key("acks"), 0).await.map_err(lost)? >= want {
                break;
            }
            sleep(ACK_POLL).await;
        }
    }
    Ok(Outcome::Report(report))
}

/// Round 2 on one node (node 0 or a member): measures its `pairs` of the plan from `now` (each
/// stream a fifth of the budget, all within three tenths) and publishes them for node 0.
async fn measure_round_2<K: Kv>(
    kv: &mut K,
    keys: &NetKeys,
    pairs: &[Pair],
    peers: &[Option<Published>],
    round: &RoundInfo,
    now: Instant,
) -> Result<(), CheckError> {
    let budget = round.settings.budget;
    let r2 = measure_all(
        pairs,
        2,
        peers,
        round,
        budget.mul_f64(0.2),
        now + budget.mul_f64(0.3),
        ROUND2_REPEATS,
    )
    .await;
    let me = round.me.group_rank;
    kv.set(&keys.key(&format!("r2/{me}")), &serde_json::to_vec(&r2)?)
        .await
        .map_err(lost)?;
    Ok(())
}

/// A member: wait for round 2's plan, measure its part, wait for the verdict.
async fn follow<K: Kv>(
    kv: &mut K,
    round: &RoundInfo,
    keys: &NetKeys,
    peers: &mut [Option<Published>],
    start: Instant,
) -> Result<Outcome, CheckError> {
    let budget = round.settings.budget;
    let me = round.me.group_rank;
    let plan_key = vec![keys.key("plan2")];
    let Some(plan2) = wait_and_read::<_, Vec<Pair>>(kv, &plan_key, start + budget + MEMBER_GRACE)
        .await?
        .pop()
        .flatten()
    else {
        return Ok(Outcome::NoVerdict(
            "node 0 published no plan in time".to_owned(),
        ));
    };
    let mine: Vec<Pair> = plan2.into_iter().filter(|p| p.from == me).collect();
    if !mine.is_empty() {
        let now = Instant::now();
        // Round 2's partners published their addresses by round 1: a short wait suffices.
        let targets: Vec<u32> = mine.iter().map(|p| p.to).collect();
        read_addresses(kv, keys, &targets, peers, now + budget.mul_f64(0.05)).await?;
        measure_round_2(kv, keys, &mine, peers, round, now).await?;
    }
    let verdict_key = vec![keys.key(&format!("verdict/{me}"))];
    let Some(report) =
        wait_and_read::<_, Report>(kv, &verdict_key, start + budget * 2 + MEMBER_GRACE)
            .await?
            .pop()
            .flatten()
    else {
        return Ok(Outcome::NoVerdict(
            "node 0 published no verdict in time".to_owned(),
        ));
    };
    if matches!(report.action, Action::End { .. }) {
        kv.add(&keys.key("acks"), 1).await.map_err(lost)?;
    }
    Ok(Outcome::Report(report))
}

/// Moves the generation as `action` says: the fatal end (exit 208) or a membership change
/// that the leaving nodes sit out. Nothing for [`Action::Proceed`].
async fn bump_for<K: Kv>(kv: &mut K, run_id: &str, action: &Action) -> Result<(), CheckError> {
    let (fatal, reason) = match action {
        Action::Proceed => return Ok(()),
        Action::End { message } => (true, message.clone()),
        Action::Leave { message, .. } => (
            false,
            format!("{message}; the named node(s) leave and the others form a new round"),
        ),
    };
    let key = Keys::new(run_id).gen();
    let raw = kv.get(&key).await.map_err(lost)?;
    let current: GenRecord = if raw.is_empty() {
        GenRecord::first()
    } else {
        serde_json::from_slice(&raw)?
    };
    let next = if fatal {
        rdzv_decide::fatal_bump(&current, Some(0), exit_code::NETWORK_CHECK_FAILED, reason)
    } else {
        rdzv_decide::membership_bump(&current, 0, reason)
    };
    // A COMPARE_SET from the bytes just read: if someone else bumped meanwhile, theirs stands.
    kv.compare_set(&key, &raw, &serde_json::to_vec(&next)?)
        .await
        .map_err(lost)?;
    Ok(())
}

/// Reads the addresses of group ranks `wanted` into `peers` (waiting for them until
/// `deadline`); one that is not there stays `None` and its measurement fails with the reason.
async fn read_addresses<K: Kv>(
    kv: &mut K,
    keys: &NetKeys,
    wanted: &[u32],
    peers: &mut [Option<Published>],
    deadline: Instant,
) -> Result<(), CheckError> {
    let wanted: Vec<u32> = wanted
        .iter()
        .copied()
        .filter(|g| peers.get(*g as usize).is_some_and(Option::is_none))
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    let addr_keys: Vec<Vec<u8>> = wanted
        .iter()
        .map(|g| keys.key(&format!("addr/{g}")))
        .collect();
    let read = wait_and_read::<_, Published>(kv, &addr_keys, deadline).await?;
    for (g, published) in wanted.into_iter().zip(read) {
        if let Some(slot) = peers.get_mut(g as usize) {
            *slot = published;
        }
    }
    Ok(())
}

/// Waits until `keys` all exist or `deadline`, then reads them: `None` for a key not written
/// or not readable (a foreign or newer writer).
async fn wait_and_read<K: Kv, T: serde::de::DeserializeOwned>(
    kv: &mut K,
    keys: &[Vec<u8>],
    deadline: Instant,
) -> Result<Vec<Option<T>>, CheckError> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    match kv.wait(keys, left).await {
        Ok(()) | Err(KvError::WaitTimeout) => {}
        Err(e) => return Err(lost(e)),
    }
    let values = kv.multi_get(keys).await.map_err(lost)?;
    Ok(values
        .iter()
        .map(|v| {
            if v.is_empty() {
                None
            } else {
                serde_json::from_slice(v).ok()
            }
        })
        .collect())
}

/// Round 2 measures each of its pairs this many times, one after the other while its window
/// lasts: a link or node is named only when it stays slow in each, so a burst of load on one
/// host (an agent not scheduled for a few hundred milliseconds) is not a finding.
const ROUND2_REPEATS: usize = 2;

/// Measures `pairs` (all with this node as the sender) at once, each up to `repeats` times in a
/// row (a repeat only with at least half of `stream_time` left before `deadline`); the samples
/// in `pairs` order.
async fn measure_all(
    pairs: &[Pair],
    round_no: u8,
    peers: &[Option<Published>],
    round: &RoundInfo,
    stream_time: Duration,
    deadline: Instant,
    repeats: usize,
) -> Vec<Sample> {
    let mut set = tokio::task::JoinSet::new();
    for (i, p) in pairs.iter().copied().enumerate() {
        let peer = peers.get(p.to as usize).cloned().flatten();
        let stream_bytes = round.settings.stream_bytes;
        set.spawn(async move {
            let mut samples = Vec::with_capacity(repeats);
            for k in 0..repeats.max(1) {
                let left = deadline.saturating_duration_since(Instant::now());
                if k > 0 && left < stream_time / 2 {
                    break;
                }
                let time = stream_time.min(left);
                let sample = match request(p, round_no, peer.clone(), stream_bytes, time, deadline)
                {
                    Ok(req) => probe::measure(&req).await,
                    Err(why) => Sample::failed(p.from, p.to, round_no, why),
                };
                // A peer that cannot be reached once will not be on a second try within the
                // check: the repeat is for throughput.
                let failed = sample.error.is_some();
                samples.push(sample);
                if failed {
                    break;
                }
            }
            (i, samples)
        });
    }
    let mut out: Vec<(usize, Vec<Sample>)> = Vec::with_capacity(pairs.len());
    while let Some(joined) = set.join_next().await {
        if let Ok(done) = joined {
            out.push(done);
        }
    }
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().flat_map(|(_, s)| s).collect()
}

/// The measurement of `p` against what the peer published, or why it cannot be made.
fn request(
    p: Pair,
    round: u8,
    peer: Option<Published>,
    stream_bytes: u64,
    stream_time: Duration,
    deadline: Instant,
) -> Result<probe::Request, String> {
    let peer = peer.ok_or("published no address in time")?;
    if let Some(e) = peer.error {
        return Err(e);
    }
    let ip = peer
        .node
        .addr
        .parse::<IpAddr>()
        .map_err(|_| format!("published an unreadable address `{}`", peer.node.addr))?;
    let token = probe::token_from_hex(&peer.token).ok_or("published an unreadable token")?;
    Ok(probe::Request {
        from: p.from,
        to: p.to,
        round,
        addr: SocketAddr::new(ip, peer.port),
        token,
        stream_bytes,
        stream_time,
        deadline,
    })
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use rendezvous::rdzv::{BumpKind, StoreKv};
    use rendezvous::store::server::{self, ServerThread};

    use super::*;
    use crate::netcheck::Mode;

    async fn store() -> ServerThread {
        ServerThread::start(
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            server::Config::default(),
        )
        .await
        .unwrap()
    }

    /// Runs the check on `n` agents on loopback, each with its own store connection.
    async fn check(n: u32, settings: &Settings, min_nodes: u32) -> (Vec<Outcome>, StoreKv) {
        let server = store().await;
        let addr = server.local_addr();
        let mut tasks = Vec::new();
        for g in 0..n {
            let round = RoundInfo {
                run_id: "job".to_owned(),
                generation: 0,
                me: NodeInfo {
                    group_rank: g,
                    node_rank: g,
                    host: format!("worker-{g}"),
                    addr: "127.0.0.1".to_owned(),
                },
                ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
                world: n,
                min_nodes,
                max_nodes: n,
                settings: settings.clone(),
            };
            tasks.push(tokio::spawn(async move {
                let mut kv = StoreKv::connect(addr, Duration::from_secs(5), Duration::from_secs(5))
                    .await
                    .unwrap();
                run(&mut kv, &round).await.unwrap()
            }));
        }
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.unwrap());
        }
        let kv = StoreKv::connect(addr, Duration::from_secs(5), Duration::from_secs(5))
            .await
            .unwrap();
        // Keep the server up while the caller reads it.
        std::mem::forget(server);
        (outcomes, kv)
    }

    /// A store whose every operation fails with one kind of fault.
    struct Failing(fn(String) -> KvError);

    impl Failing {
        fn fail<T>(&self) -> Result<T, KvError> {
            Err((self.0)("no answer to the operation".to_owned()))
        }
    }

    impl Kv for Failing {
        async fn get(&mut self, _: &[u8]) -> Result<Vec<u8>, KvError> {
            self.fail()
        }
        async fn set(&mut self, _: &[u8], _: &[u8]) -> Result<(), KvError> {
            self.fail()
        }
        async fn add(&mut self, _: &[u8], _: i64) -> Result<i64, KvError> {
            self.fail()
        }
        async fn compare_set(&mut self, _: &[u8], _: &[u8], _: &[u8]) -> Result<Vec<u8>, KvError> {
            self.fail()
        }
        async fn multi_get(&mut self, _: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, KvError> {
            self.fail()
        }
        async fn multi_set(&mut self, _: &[(Vec<u8>, Vec<u8>)]) -> Result<(), KvError> {
            self.fail()
        }
        async fn wait(&mut self, _: &[Vec<u8>], _: Duration) -> Result<(), KvError> {
            self.fail()
        }
    }

    #[tokio::test]
    async fn a_store_that_does_not_answer_ends_the_check_without_a_verdict_and_a_gone_one_fails_it()
    {
        let round = RoundInfo {
            run_id: "job".to_owned(),
            generation: 0,
            me: NodeInfo {
                group_rank: 1,
                node_rank: 1,
                host: "worker-1".to_owned(),
                addr: "127.0.0.1".to_owned(),
            },
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            world: 4,
            min_nodes: 4,
            max_nodes: 4,
            settings: Settings::default_for(4),
        };
        for slow in [KvError::Slow as fn(String) -> KvError, KvError::Silent] {
            match run(&mut Failing(slow), &round).await {
                Ok(Outcome::NoVerdict(why)) => assert!(
                    why.contains("the store did not answer in time (no answer to the operation)"),
                    "{why}"
                ),
                other => panic!("{other:?}"),
            }
        }
        let gone = run(&mut Failing(KvError::Gone), &round).await;
        assert!(matches!(gone, Err(CheckError::Store(_))), "{gone:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_clean_gang_measures_the_ring_and_every_node_gets_one_verdict() {
        let settings = Settings::default_for(4);
        let (outcomes, _) = check(4, &settings, 4).await;
        let Outcome::Report(first) = &outcomes[0] else {
            panic!("{outcomes:?}");
        };
        // Every member gets its own view of node 0's one verdict: its measurements, nobody
        // else's.
        for (g, o) in outcomes.iter().enumerate().skip(1) {
            let g = u32::try_from(g).unwrap();
            assert_eq!(o, &Outcome::Report(first.view_for(g)), "group rank {g}");
        }
        // Round 1 is the ring; a loaded test machine may make one stream look slow, which round
        // 2 then measures again.
        let ring: Vec<&Sample> = first.samples.iter().filter(|s| s.round == 1).collect();
        assert_eq!(ring.len(), 4, "{first:?}");
        assert!(
            ring.iter().all(|s| s.error.is_none() && s.bytes > 0),
            "{first:?}"
        );
        assert_eq!(first.action, Action::Proceed);
        assert_eq!(first.nodes[2].host, "worker-2");
        // Whether a finding shows is for the network tests (tests/python/test_network_check.py):
        // four agents sharing two threads here measure the scheduler as much as the network.
        assert!(first.verdict.reason.starts_with("4 nodes, "), "{first:?}");
    }

    #[test]
    fn a_view_carries_the_findings_naming_the_node_and_only_a_few_others() {
        let nodes: Vec<NodeInfo> = (0..40)
            .map(|g| NodeInfo {
                group_rank: g,
                node_rank: g,
                host: format!("worker-{g}"),
                addr: format!("10.0.0.{g}"),
            })
            .collect();
        let findings: Vec<Finding> = (1..40)
            .map(|rank| Finding::Node {
                rank,
                reason: "slow".to_owned(),
            })
            .collect();
        let report = Report {
            counts: FindingCounts::of(&findings),
            nodes,
            samples: vec![Sample::failed(30, 31, 1, "refused")],
            verdict: Verdict {
                findings,
                reason: "40 nodes".to_owned(),
                inconclusive: false,
            },
            action: Action::Proceed,
            reference: Reference {
                mbps: Some(900.0),
                rtt_us: Some(60),
            },
            millis: 1,
        };
        let view = report.view_for(30);
        let ranks: Vec<u32> = view
            .verdict
            .findings
            .iter()
            .flat_map(Finding::ranks)
            .collect();
        assert_eq!(ranks, vec![1, 2, 3, 4, 5, 6, 7, 8, 30]);
        assert_eq!(view.counts.total(), 39);
        let named: Vec<u32> = view.nodes.iter().map(|n| n.group_rank).collect();
        assert_eq!(named, vec![1, 2, 3, 4, 5, 6, 7, 8, 30, 31]);
        assert_eq!(view.samples.len(), 1);
        // A member reads its view back from JSON: the references arrive bit for bit (this value
        // came back one ulp off without serde_json's float_roundtrip).
        let mut exact = view.clone();
        exact.reference.mbps = Some(965.824_665_960_160_4);
        let read: Report = serde_json::from_slice(&serde_json::to_vec(&exact).unwrap()).unwrap();
        assert_eq!(read, exact);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn require_ends_the_round_through_the_generation() {
        let mut settings = Settings::default_for(3);
        settings.mode = Mode::Require;
        settings.stream_bytes = 1 << 20;
        // Nothing on loopback reaches a petabyte per second: every link is below the floor,
        // however loaded the machine running the test (nothing set aside for its load).
        settings.thresholds.min_mbps = Some(1e9);
        settings.thresholds.cpu_wait_ratio = 0.0;
        let (outcomes, mut kv) = check(3, &settings, 3).await;
        for o in &outcomes {
            let Outcome::Report(r) = o else {
                panic!("{o:?}")
            };
            assert!(
                matches!(&r.action, Action::End { message } if message.contains("below min_mbps")),
                "{r:?}"
            );
        }
        let raw = kv.get(&Keys::new("job").gen()).await.unwrap();
        let rec: GenRecord = serde_json::from_slice(&raw).unwrap();
        assert_eq!(rec.kind, BumpKind::Fatal);
        assert_eq!(rec.exit_code, Some(exit_code::NETWORK_CHECK_FAILED));
        assert!(
            rec.reason
                .starts_with("network check failed: slow link between node rank 0"),
            "{}",
            rec.reason
        );
    }
}
