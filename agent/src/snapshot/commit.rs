//! The gang's side of snapshots, on the attempt's store (node 0's, fresh for every attempt):
//! which step the attempt restores, and when a step is committed.
//!
//! - **Agreement**, once per attempt before any rank may restore: every node puts the steps it
//!   could restore all its ranks from under `offer/<node rank>`, and the attempt restores the
//!   newest step in every offer, or nothing. A step every node holds complete is a step every
//!   rank of the gang handed over, so it counts as committed even where the commit below was
//!   cut short by the fault.
//!   A node also offers what it holds for its buddies (`replicas/<node rank>`: `node:step`
//!   pairs) and where its replica listener is (`replica-addr/<node rank>`), so a step counts
//!   as held for a node when that node or its buddy holds its parts. A node that lacks its own
//!   parts of the agreed step (a replacement pod) fetches them from the buddy's replica; then
//!   every node says whether it holds its parts now (`ready/<node rank>`), and unless every
//!   node does the attempt restores nothing.
//! - **Commit**, for each step all local ranks handed over: `ADD done/<step>`; the node that
//!   brings it to the node count sets `committed/<step>`, which every node waits for before it
//!   lets the older generation go. Each committed step (and the agreed one, at the start of an
//!   attempt) is then copied to the buddy in the background ([`super::replica`]). With one node
//!   there is no store to ask and no buddy.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rendezvous::store::client::{Client, ClientError};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::replica::net::{self as replica_net, Listening};
use super::replica::wire::{Header, Op};
use super::server::{Completed, Settled, Shared};
use crate::watch::cgroup::human_bytes;

/// How long a node waits for every node's offer.
const AGREEMENT_WAIT: Duration = Duration::from_secs(120);
/// How long one store operation may take.
const STORE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one wait for a commit lasts before it is asked again.
const COMMIT_POLL: Duration = Duration::from_secs(30);

/// One attempt, as the commit sees it.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub attempt: u32,
    pub run_id: String,
    pub node_rank: u32,
    pub nnodes: u32,
    /// The attempt's store (`None`: its address is not numeric).
    pub store: Option<SocketAddr>,
    /// The service's own stop (the agent's end): the replica listener lives until it.
    pub service: CancellationToken,
}

impl Attempt {
    fn key(&self, what: &str) -> Vec<u8> {
        format!("muster/{}/snapshot/{}/{what}", self.run_id, self.attempt).into_bytes()
    }
}

/// Agrees on the attempt's restart point, then commits each step `completions` brings, until
/// `stop` (the attempt ended).
pub async fn run(
    shared: Arc<Shared>,
    attempt: Attempt,
    mut completions: mpsc::UnboundedReceiver<Completed>,
    stop: CancellationToken,
) {
    let mut client = None;
    let (agreed, buddy) = tokio::select! {
        () = stop.cancelled() => return,
        agreed = agree(&shared, &attempt, &mut client) => agreed,
    };
    let node_holds = {
        let mut holder = shared.holder();
        holder.settle(agreed);
        shared.replicas().settle(agreed);
        holder.bytes_held()
    };
    super::persist::settle(&shared, attempt.attempt, agreed);
    // The agreed step goes to the buddy too: after a replacement the new buddy holds nothing.
    let (replicate_tx, replicate_rx) = watch::channel(agreed);
    if let Some(buddy) = buddy {
        tokio::spawn(replicate(
            Arc::clone(&shared),
            attempt.clone(),
            buddy,
            replicate_rx,
            stop.clone(),
        ));
    }
    if let Some(meter) = &shared.meter {
        meter.settled(agreed, node_holds);
    }
    shared.settled.send_replace(Some(Settled {
        attempt: attempt.attempt,
        agreed,
    }));
    let mut first = true;
    loop {
        let completed = tokio::select! {
            () = stop.cancelled() => return,
            completed = completions.recv() => match completed {
                Some(c) => c,
                None => return,
            },
        };
        if completed.attempt != attempt.attempt {
            continue;
        }
        let step = completed.step;
        let committed = tokio::select! {
            () = stop.cancelled() => return,
            committed = commit(&attempt, &mut client, step, &stop) => committed,
        };
        match committed {
            Ok(()) => {
                let held = {
                    let mut holder = shared.holder();
                    holder.commit(step);
                    holder.bytes_held()
                };
                if let Some(meter) = &shared.meter {
                    meter.committed(step, held);
                }
                replicate_tx.send_replace(Some(step));
                super::persist::committed(&shared, attempt.attempt, step, false);
                let line = format!(
                    "snapshots: step {step} committed on every node ({} held on this node)",
                    human_bytes(held)
                );
                if first {
                    info!("{line}");
                    first = false;
                } else {
                    debug!("{line}");
                }
            }
            Err(e) => {
                warn!("snapshots: cannot commit step {step} ({e}); the restart point stays where it was");
                client = None;
            }
        }
    }
}

/// Why the store could not be asked.
#[derive(Debug, thiserror::Error)]
enum StoreError {
    #[error("the attempt's store has no numeric address")]
    NoAddress,
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// The attempt's store, connected on first use; `None` with one node (nothing to ask).
async fn store<'a>(
    attempt: &Attempt,
    client: &'a mut Option<Client>,
) -> Result<Option<&'a mut Client>, StoreError> {
    if attempt.nnodes <= 1 {
        return Ok(None);
    }
    let Some(addr) = attempt.store else {
        return Err(StoreError::NoAddress);
    };
    if client.is_none() {
        *client = Some(Client::connect(addr, STORE_TIMEOUT).await?);
    }
    Ok(client.as_mut())
}

/// The newest step every node can restore (from its own parts or its buddy's replica), or
/// `None`; and the buddy's replica listener, where this node copies its committed parts.
async fn agree(
    shared: &Arc<Shared>,
    attempt: &Attempt,
    client: &mut Option<Client>,
) -> (Option<u64>, Option<Listening>) {
    let mut offer = shared.holder().restorable();
    offer.extend(super::persist::steps_on_disk(shared).await);
    offer.sort_unstable();
    offer.dedup();
    let agreed = match store(attempt, client).await {
        Ok(None) => {
            let step = match offer.last().copied() {
                Some(step) if own_parts(shared, step).await => Some(step),
                _ => None,
            };
            Ok(Agreement {
                step,
                fetched_from: BTreeMap::new(),
                buddy: None,
            })
        }
        Ok(Some(client)) => agree_on_store(shared, client, attempt, &offer)
            .await
            .map_err(StoreError::from),
        Err(e) => Err(e),
    };
    match agreed {
        Ok(Agreement {
            step: Some(step),
            fetched_from,
            buddy,
        }) => {
            if fetched_from.is_empty() {
                info!(
                    "snapshots: attempt {} restores step {step}, held by every node",
                    attempt.attempt
                );
            } else {
                let from: Vec<String> = fetched_from
                    .iter()
                    .map(|(node, buddy)| format!("node {node} from node {buddy}'s replica"))
                    .collect();
                info!(
                    "snapshots: attempt {} restores step {step}, held by every node or its buddy ({})",
                    attempt.attempt,
                    from.join(", ")
                );
            }
            (Some(step), buddy)
        }
        Ok(Agreement {
            step: None, buddy, ..
        }) => {
            if !offer.is_empty() {
                info!(
                    "snapshots: no step is held by every node (this node holds {offer:?}); the ranks start from their own checkpoint"
                );
            }
            (None, buddy)
        }
        Err(e) => {
            warn!("snapshots: the gang could not agree on a step to restore ({e}); the ranks start from their own checkpoint");
            *client = None;
            (None, None)
        }
    }
}

/// What the store round gave.
struct Agreement {
    step: Option<u64>,
    /// node → the node whose replica it restored from.
    fetched_from: BTreeMap<u32, u32>,
    buddy: Option<Listening>,
}

/// This node's replica listener, started on the address it reaches the store from.
async fn listening(shared: &Arc<Shared>, attempt: &Attempt, client: &Client) -> Option<Listening> {
    let ip = client.local_addr()?.ip();
    let started = shared
        .listening
        .get_or_try_init(|| {
            let host: Arc<dyn super::replica::Host> = Arc::clone(shared) as _;
            replica_net::listen(ip, host, attempt.service.clone())
        })
        .await;
    match started {
        Ok(listening) => Some(*listening),
        Err(e) => {
            warn!("snapshots: cannot listen for replicas on {ip} ({e}); this node's parts are not copied to a buddy");
            None
        }
    }
}

async fn agree_on_store(
    shared: &Arc<Shared>,
    client: &mut Client,
    attempt: &Attempt,
    offer: &[u64],
) -> Result<Agreement, ClientError> {
    let me = attempt.node_rank;
    let listening = listening(shared, attempt, client).await;
    let (world_size, first_rank) = shared
        .holder()
        .share()
        .map_or((0, 0), |s| (s.world_size, s.first_rank));
    let replicas = encode_replicas(&shared.replicas().offers(world_size));
    let own = [
        (attempt.key(&format!("offer/{me}")), encode_offer(offer)),
        (attempt.key(&format!("replicas/{me}")), replicas),
        (
            attempt.key(&format!("replica-addr/{me}")),
            listening.map(|l| l.encode()).unwrap_or_default(),
        ),
    ];
    let pairs: Vec<(&[u8], &[u8])> = own
        .iter()
        .map(|(k, v)| (k.as_slice(), v.as_bytes()))
        .collect();
    client.multi_set(&pairs).await?;
    let nodes = attempt.nnodes;
    let keys = |what: &str| -> Vec<Vec<u8>> {
        (0..nodes)
            .map(|node| attempt.key(&format!("{what}/{node}")))
            .collect()
    };
    // Every node's offer, then its replicas, then its listener: one read once the offers (set
    // with the rest in one MULTI_SET) are all there.
    let published: Vec<Vec<u8>> = ["offer", "replicas", "replica-addr"]
        .into_iter()
        .flat_map(keys)
        .collect();
    let published: Vec<&[u8]> = published.iter().map(Vec::as_slice).collect();
    client
        .wait(&published[..nodes as usize], AGREEMENT_WAIT)
        .await?;
    let values = client.multi_get(&published).await?;
    let n = nodes as usize;
    let offers: Vec<BTreeSet<u64>> = values[..n]
        .iter()
        .map(|v| decode_offer(v).unwrap_or_default())
        .collect();
    let replicas: Vec<Vec<(u32, u64)>> = values[n..2 * n]
        .iter()
        .map(|v| decode_replicas(v).unwrap_or_default())
        .collect();
    let addrs: Vec<Option<Listening>> = values[2 * n..]
        .iter()
        .map(|v| Listening::decode(v))
        .collect();
    let buddy = addrs
        .get(((me + 1) % nodes) as usize)
        .copied()
        .flatten()
        .filter(|_| nodes > 1);
    let step = newest_covered(&offers, &replicas);
    let Some(step) = step else {
        return Ok(Agreement {
            step: None,
            fetched_from: BTreeMap::new(),
            buddy,
        });
    };
    // Who restores from a replica: each node that does not hold its own parts of the step.
    let fetched_from: BTreeMap<u32, u32> = (0..nodes)
        .filter(|node| !offers[*node as usize].contains(&step))
        .filter_map(|node| holder_of(&replicas, node, step).map(|j| (node, j)))
        .collect();
    let ready = match fetched_from.get(&me) {
        None => own_parts(shared, step).await,
        Some(from) => {
            let header = Header {
                token: addrs[*from as usize].map_or([0; 16], |l| l.token),
                op: Op::Get,
                node: me,
                attempt: attempt.attempt,
                step,
                world_size,
                first_rank,
                parts: 0,
            };
            fetch_own(shared, addrs[*from as usize], header, *from).await
        }
    };
    client
        .set(
            &attempt.key(&format!("ready/{me}")),
            if ready { b"1" } else { b"0" },
        )
        .await?;
    let ready_keys = keys("ready");
    let ready_refs: Vec<&[u8]> = ready_keys.iter().map(Vec::as_slice).collect();
    client.wait(&ready_refs, AGREEMENT_WAIT).await?;
    let readies = client.multi_get(&ready_refs).await?;
    let not_ready: Vec<u32> = (0..nodes)
        .filter(|node| readies[*node as usize].as_slice() != b"1")
        .collect();
    if !not_ready.is_empty() {
        warn!("snapshots: node(s) {not_ready:?} could not fetch their parts of step {step} from a buddy; the ranks start from their own checkpoint");
        return Ok(Agreement {
            step: None,
            fetched_from: BTreeMap::new(),
            buddy,
        });
    }
    Ok(Agreement {
        step: Some(step),
        fetched_from,
        buddy,
    })
}

/// Whether this node holds its parts of `step` in memory, reading them from the disk
/// (`--snapshot-persist`) when only the disk has them.
async fn own_parts(shared: &Arc<Shared>, step: u64) -> bool {
    if shared.holder().restorable().contains(&step) {
        return true;
    }
    super::persist::load_into_holder(shared, step).await
}

/// Fetches this node's parts from `from`'s replica into the holder; whether they are held now.
async fn fetch_own(shared: &Arc<Shared>, at: Option<Listening>, header: Header, from: u32) -> bool {
    let Some(at) = at else {
        warn!(
            "snapshots: node {from} holds this node's parts of step {} but published no listener",
            header.step
        );
        return false;
    };
    let limit = shared.holder().cap_bytes();
    let started = Instant::now();
    let fetched = tokio::task::spawn_blocking(move || replica_net::fetch(&at, header, limit)).await;
    match fetched {
        Ok(Ok(parts)) => {
            let bytes: u64 = parts.iter().map(|(_, _, b)| *b).sum();
            if shared.holder().adopt(header.step, parts) {
                info!(
                    "snapshots: fetched this node's parts of step {} from node {from}'s replica ({} in {:.2} s)",
                    header.step,
                    human_bytes(bytes),
                    started.elapsed().as_secs_f64()
                );
                true
            } else {
                warn!("snapshots: node {from}'s replica of step {} does not hold every rank of this node", header.step);
                false
            }
        }
        Ok(Err(why)) => {
            warn!(
                "snapshots: cannot fetch this node's parts of step {} from node {from}: {why}",
                header.step
            );
            false
        }
        Err(e) => {
            warn!(
                "snapshots: fetching this node's parts of step {} failed: {e}",
                header.step
            );
            false
        }
    }
}

/// Copies each committed step's parts of this node to `buddy`, newest first: a step committed
/// while a copy is under way waits for it, one in between is skipped.
async fn replicate(
    shared: Arc<Shared>,
    attempt: Attempt,
    buddy: Listening,
    mut latest: watch::Receiver<Option<u64>>,
    stop: CancellationToken,
) {
    let mut copied: Option<u64> = None;
    let mut said_ok = false;
    let mut said_failed = false;
    loop {
        let wanted = *latest.borrow_and_update();
        if let Some(step) = wanted.filter(|s| copied != Some(*s)) {
            let (parts, share) = {
                let holder = shared.holder();
                (holder.parts_of(step), holder.share())
            };
            if let (Some(share), false) = (share, parts.is_empty()) {
                let header = Header {
                    token: buddy.token,
                    op: Op::Put,
                    node: attempt.node_rank,
                    attempt: attempt.attempt,
                    step,
                    world_size: share.world_size,
                    first_rank: share.first_rank,
                    parts: u32::try_from(parts.len()).unwrap_or(u32::MAX),
                };
                let bytes: u64 = parts.iter().map(|(_, _, b)| *b).sum();
                let started = Instant::now();
                let pushed = tokio::select! {
                    () = stop.cancelled() => return,
                    pushed = tokio::task::spawn_blocking(move || replica_net::push(&buddy, header, &parts)) => pushed,
                };
                let seconds = started.elapsed().as_secs_f64();
                match pushed {
                    Ok(Ok(())) => {
                        let buddy_node = (attempt.node_rank + 1) % attempt.nnodes.max(1);
                        let line = format!(
                            "snapshots: step {step} copied to node {buddy_node} ({} in {seconds:.2} s)",
                            human_bytes(bytes)
                        );
                        if said_ok {
                            debug!("{line}");
                        } else {
                            info!("{line}");
                            said_ok = true;
                        }
                        if let Some(meter) = &shared.meter {
                            meter.replicated(step, seconds);
                        }
                    }
                    Ok(Err(why)) if !said_failed => {
                        said_failed = true;
                        warn!("snapshots: cannot copy step {step} to the buddy node at {}: {why}; a loss of this pod would lose its parts", buddy.addr);
                    }
                    Ok(Err(why)) => debug!("snapshots: copy of step {step} failed: {why}"),
                    Err(e) => warn!("snapshots: the copy of step {step} failed: {e}"),
                }
            }
            copied = Some(step);
        }
        tokio::select! {
            () = stop.cancelled() => return,
            changed = latest.changed() => if changed.is_err() { return },
        }
    }
}

async fn commit(
    attempt: &Attempt,
    client: &mut Option<Client>,
    step: u64,
    stop: &CancellationToken,
) -> Result<(), StoreError> {
    let Some(client) = store(attempt, client).await? else {
        return Ok(());
    };
    let committed = attempt.key(&format!("committed/{step}"));
    let count = client.add(&attempt.key(&format!("done/{step}")), 1).await?;
    if count >= i64::from(attempt.nnodes) {
        client.set(&committed, b"1").await?;
    }
    client.wait_for_key(&committed, COMMIT_POLL, stop).await?;
    Ok(())
}

/// An offer on the store: the steps, comma-separated (`""`: none).
pub fn encode_offer(steps: &[u64]) -> String {
    steps
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// An offer read back; `None` for bytes that are no offer (read as offering nothing).
pub fn decode_offer(value: &[u8]) -> Option<BTreeSet<u64>> {
    let text = std::str::from_utf8(value).ok()?;
    if text.is_empty() {
        return Some(BTreeSet::new());
    }
    text.split(',').map(|s| s.parse().ok()).collect()
}

/// What a node holds for its buddies on the store: `node:step` pairs, comma-separated.
pub fn encode_replicas(held: &[(u32, u64)]) -> String {
    held.iter()
        .map(|(node, step)| format!("{node}:{step}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Replica offers read back; `None` for bytes that are none (read as holding nothing).
pub fn decode_replicas(value: &[u8]) -> Option<Vec<(u32, u64)>> {
    let text = std::str::from_utf8(value).ok()?;
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(',')
        .map(|pair| {
            let (node, step) = pair.split_once(':')?;
            Some((node.parse().ok()?, step.parse().ok()?))
        })
        .collect()
}

/// The node holding a replica of `node`'s parts of `step`, if any.
fn holder_of(replicas: &[Vec<(u32, u64)>], node: u32, step: u64) -> Option<u32> {
    replicas
        .iter()
        .enumerate()
        .find(|(holder, held)| *holder as u32 != node && held.contains(&(node, step)))
        .map(|(holder, _)| holder as u32)
}

/// The newest step every node can restore: from its own offer, or a replica another node holds.
pub fn newest_covered(offers: &[BTreeSet<u64>], replicas: &[Vec<(u32, u64)>]) -> Option<u64> {
    let covered = (0..offers.len()).map(|node| {
        let mut steps = offers[node].clone();
        for (holder, held) in replicas.iter().enumerate() {
            if holder != node {
                steps.extend(
                    held.iter()
                        .filter(|(n, _)| *n as usize == node)
                        .map(|(_, s)| *s),
                );
            }
        }
        steps
    });
    newest_common(covered)
}

/// The newest step in every offer.
pub fn newest_common(offers: impl IntoIterator<Item = BTreeSet<u64>>) -> Option<u64> {
    let mut offers = offers.into_iter();
    let first = offers.next()?;
    offers
        .fold(first, |common, offer| {
            common.intersection(&offer).copied().collect()
        })
        .last()
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_step_in_every_offer_is_restored() {
        let offers = ["5,10", "5,10,15", "10"]
            .iter()
            .map(|o| decode_offer(o.as_bytes()).unwrap());
        assert_eq!(newest_common(offers), Some(10));
        let offers = ["5", ""]
            .iter()
            .map(|o| decode_offer(o.as_bytes()).unwrap());
        assert_eq!(newest_common(offers), None);
        assert_eq!(encode_offer(&[5, 10]), "5,10");
        assert_eq!(decode_offer(b"5,x"), None);
        assert_eq!(decode_offer(&[0xff]), None);
    }

    #[test]
    fn a_lost_node_is_covered_by_its_buddys_replica() {
        // Node 1 is a replacement (holds nothing); node 2 holds node 1's parts of 10.
        let offers: Vec<BTreeSet<u64>> = ["5,10", "", "10"]
            .iter()
            .map(|o| decode_offer(o.as_bytes()).unwrap())
            .collect();
        let replicas: Vec<Vec<(u32, u64)>> = ["2:10", "", "1:10"]
            .iter()
            .map(|r| decode_replicas(r.as_bytes()).unwrap())
            .collect();
        assert_eq!(newest_covered(&offers, &replicas), Some(10));
        assert_eq!(holder_of(&replicas, 1, 10), Some(2));
        // A node's own replica of itself does not count, nor a step nobody else holds.
        let replicas: Vec<Vec<(u32, u64)>> = vec![vec![], vec![(1, 10)], vec![]];
        assert_eq!(newest_covered(&offers, &replicas), None);
        assert_eq!(encode_replicas(&[(1, 10), (2, 5)]), "1:10,2:5");
        assert_eq!(decode_replicas(b"1:x"), None);
        assert_eq!(decode_replicas(b"110"), None);
    }
}
