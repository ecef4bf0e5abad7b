//! The gang's side of warm spares ([`crate::launch::warm_share`]): node ranks 0 and 1 put their
//! ranks' module lists on the agents' store once recorded; a node answered "spare" reads them
//! while it waits. Both run on a connection of their own and end with the round or the wait they
//! belong to; a store that fails them only costs the spare its warm start.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use rendezvous::rdzv::{Kv, KvError, StoreKv};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::launch::warm_share::{self, WarmShare};

/// How long one WAIT for the gang's lists lasts before it is asked again.
const WAIT: Duration = Duration::from_secs(30);

/// Node ranks that publish: two, so the loss of one still leaves the key on the store (a
/// replacement node 0 starts a new store, and its own lists reach it after its first step).
pub const PUBLISHERS: u32 = 2;

/// Puts this node's lists on the store at `addr` under `key` once its ranks recorded them; the
/// first writer's stay (one value for the whole gang).
pub(super) async fn publish(
    share: WarmShare,
    addr: SocketAddr,
    op_timeout: Duration,
    key: Vec<u8>,
) {
    let lists = share.ours().await;
    let value = warm_share::encode(&lists);
    let result = async {
        let mut kv = StoreKv::connect(addr, op_timeout, op_timeout)
            .await
            .map_err(|e| e.to_string())?;
        kv.compare_set(&key, b"", &value)
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    if let Err(e) = result {
        debug!("cannot put the ranks' module lists on the store ({e}): spares start cold");
    } else {
        debug!("the ranks' module lists are on the store for the gang's spares");
    }
}

/// While this node waits as a spare (`spare` true), reads the gang's lists from the store at
/// `addr` (waiting for a member to publish them) and hands them to `share`; never resolves, so
/// it is raced against the round.
pub(super) async fn fetch_while_spare(
    share: WarmShare,
    mut spare: watch::Receiver<bool>,
    addr: SocketAddr,
    op_timeout: Duration,
    key: Vec<u8>,
    local_ranks: u32,
) -> Infallible {
    if spare.wait_for(|waiting| *waiting).await.is_ok() {
        match fetch(addr, op_timeout, &key).await {
            Ok(value) => match warm_share::decode(&value, local_ranks) {
                Ok(lists) => share.fetched(lists),
                Err(e) => warn!(
                    "waiting as a spare: the gang's module lists on the store are unusable ({e}); this node's ranks will start cold"
                ),
            },
            Err(e) => debug!("waiting as a spare: no module lists from the store ({e})"),
        }
    }
    std::future::pending().await
}

async fn fetch(addr: SocketAddr, op_timeout: Duration, key: &[u8]) -> Result<Vec<u8>, String> {
    let mut kv = StoreKv::connect(addr, op_timeout, op_timeout)
        .await
        .map_err(|e| e.to_string())?;
    let keys = [key.to_vec()];
    loop {
        match kv.wait(&keys, WAIT).await {
            Ok(()) => break,
            // A gang whose ranks have not stepped yet: ask again.
            Err(KvError::WaitTimeout) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    kv.get(key).await.map_err(|e| e.to_string())
}
