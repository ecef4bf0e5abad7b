//! The gang's side of snapshots, on the attempt's store (node 0's, fresh for every attempt):
//! which step the attempt restores, and when a step is committed.
//!
//! - **Agreement**, once per attempt before any rank may restore: every node puts the steps it
//!   could restore all its ranks from under `offer/<node rank>`, and the attempt restores the
//!   newest step in every offer, or nothing. A step every node holds complete is a step every
//!   rank of the gang handed over, so it counts as committed even where the commit below was
//!   cut short by the fault.
//! - **Commit**, for each step all local ranks handed over: `ADD done/<step>`; the node that
//!   brings it to the node count sets `committed/<step>`, which every node waits for before it
//!   lets the older generation go. With one node there is no store to ask.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rendezvous::store::client::{Client, ClientError};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

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
    let agreed = tokio::select! {
        () = stop.cancelled() => return,
        agreed = agree(&shared, &attempt, &mut client) => agreed,
    };
    let node_holds = {
        let mut holder = shared.holder();
        holder.settle(agreed);
        holder.bytes_held()
    };
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

/// The newest step every node can restore, or `None`.
async fn agree(shared: &Shared, attempt: &Attempt, client: &mut Option<Client>) -> Option<u64> {
    let offer = shared.holder().restorable();
    let agreed = match store(attempt, client).await {
        Ok(None) => Ok(offer.last().copied()),
        Ok(Some(client)) => agree_on_store(client, attempt, &offer)
            .await
            .map_err(StoreError::from),
        Err(e) => Err(e),
    };
    match agreed {
        Ok(Some(step)) => {
            info!(
                "snapshots: attempt {} restores step {step}, held by every node",
                attempt.attempt
            );
            Some(step)
        }
        Ok(None) => {
            if !offer.is_empty() {
                info!(
                    "snapshots: no step is held by every node (this node holds {offer:?}); the ranks start from their own checkpoint"
                );
            }
            None
        }
        Err(e) => {
            warn!("snapshots: the gang could not agree on a step to restore ({e}); the ranks start from their own checkpoint");
            *client = None;
            None
        }
    }
}

async fn agree_on_store(
    client: &mut Client,
    attempt: &Attempt,
    offer: &[u64],
) -> Result<Option<u64>, ClientError> {
    client
        .set(
            &attempt.key(&format!("offer/{}", attempt.node_rank)),
            encode_offer(offer).as_bytes(),
        )
        .await?;
    let keys: Vec<Vec<u8>> = (0..attempt.nnodes)
        .map(|node| attempt.key(&format!("offer/{node}")))
        .collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    client.wait(&refs, AGREEMENT_WAIT).await?;
    let offers = client.multi_get(&refs).await?;
    Ok(newest_common(
        offers
            .iter()
            .map(|value| decode_offer(value).unwrap_or_default()),
    ))
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
}
