//! Telling every node of a hang: one key on the attempt's store (the workers' store, fresh for
//! every attempt), written once by the first node that detects one and waited on by the others,
//! as the checkpoint request is ([`crate::checkpoint::trigger`]).

use std::net::SocketAddr;
use std::time::Duration;

use rendezvous::store::client::{Client, ClientError};
use tokio_util::sync::CancellationToken;

/// A hang some node detected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub node_rank: u32,
    pub rank: u32,
    /// The limit the detecting node applied.
    pub limit: Duration,
    /// The stall was before the rank's first step (`--startup-timeout`): its peers wait for a
    /// rank that has not stepped yet, so every node looks among its ranks that have not stepped.
    pub startup: bool,
    /// Its description of the stall.
    pub what: String,
}

impl Notice {
    /// `<node_rank> <rank> <limit_ms> startup|step <what>`.
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{} {} {} {} {}",
            self.node_rank,
            self.rank,
            self.limit.as_millis(),
            if self.startup { "startup" } else { "step" },
            self.what.replace('\n', " ")
        )
        .into_bytes()
    }

    pub fn decode(raw: &[u8]) -> Option<Notice> {
        let text = std::str::from_utf8(raw).ok()?;
        let mut words = text.splitn(5, ' ');
        let node_rank = words.next()?.parse().ok()?;
        let rank = words.next()?.parse().ok()?;
        let limit = Duration::from_millis(words.next()?.parse().ok()?);
        let startup = match words.next()? {
            "startup" => true,
            "step" => false,
            _ => return None,
        };
        Some(Notice {
            node_rank,
            rank,
            limit,
            startup,
            what: words.next().unwrap_or_default().to_owned(),
        })
    }
}

/// `muster/<run_id>/watch/hang`.
pub fn key(run_id: &str) -> Vec<u8> {
    format!("muster/{run_id}/watch/hang").into_bytes()
}

/// Publishes `notice` unless one stands already; returns the standing one.
pub async fn publish(
    store: SocketAddr,
    run_id: &str,
    notice: &Notice,
) -> Result<Notice, ClientError> {
    let mut client = Client::connect(store, Duration::from_secs(10)).await?;
    let standing = client
        .compare_set(&key(run_id), b"", &notice.encode())
        .await?;
    Ok(Notice::decode(&standing).unwrap_or_else(|| notice.clone()))
}

/// Resolves with the first notice any node publishes; `None` when `stop` fires first.
pub async fn wait(
    store: SocketAddr,
    run_id: &str,
    stop: CancellationToken,
) -> Result<Option<Notice>, ClientError> {
    let key = key(run_id);
    let mut client = Client::connect(store, Duration::from_secs(30)).await?;
    let value = client
        .wait_for_key(&key, Duration::from_secs(30), &stop)
        .await?;
    Ok(value.and_then(|v| Notice::decode(&v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip() {
        let n = Notice {
            node_rank: 1,
            rank: 3,
            limit: Duration::from_millis(2500),
            startup: false,
            what: "rank 3 (local rank 1) made no progress\nfor 3 s".into(),
        };
        let back = Notice::decode(&n.encode()).unwrap();
        assert_eq!(back.what, "rank 3 (local rank 1) made no progress for 3 s");
        assert_eq!((back.node_rank, back.rank, back.limit), (1, 3, n.limit));
        assert!(!back.startup);
        let startup = Notice { startup: true, ..n };
        assert!(Notice::decode(&startup.encode()).unwrap().startup);
        assert_eq!(Notice::decode(b"x y"), None);
        assert_eq!(Notice::decode(b"1 3 2500 sometimes what"), None);
    }

    #[tokio::test]
    async fn the_first_notice_stands_and_wakes_the_waiters() {
        let store = rendezvous::store::server::ServerThread::start(
            "127.0.0.1:0".parse().unwrap(),
            rendezvous::store::server::Config::default(),
        )
        .await
        .unwrap();
        let addr = store.local_addr();
        let waiter = tokio::spawn(async move { wait(addr, "job", CancellationToken::new()).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let first = Notice {
            node_rank: 1,
            rank: 3,
            limit: Duration::from_secs(3),
            startup: false,
            what: "first".into(),
        };
        let second = Notice {
            node_rank: 0,
            what: "second".into(),
            ..first.clone()
        };
        assert_eq!(publish(addr, "job", &first).await.unwrap(), first);
        assert_eq!(publish(addr, "job", &second).await.unwrap(), first);
        assert_eq!(waiter.await.unwrap().unwrap(), Some(first));
        let stop = CancellationToken::new();
        stop.cancel();
        assert_eq!(wait(addr, "other", stop).await.unwrap(), None);
    }
}
