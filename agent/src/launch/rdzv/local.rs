//! One node, no peers: the rendezvous that needs nobody else.

use std::net::{IpAddr, Ipv4Addr};

use super::{BoxFuture, Rendezvous};
use crate::launch::{Config, HostedStore, LaunchError, RankAssignment, Round, StopRequest};

/// One node, no peers: this agent hosts a fresh store per attempt on its advertised address.
#[derive(Debug, Default)]
pub struct LocalRendezvous;

impl LocalRendezvous {
    /// The address workers reach the store at: `--local-addr` (resolved once, numerically),
    /// else loopback — on one node nothing else needs to reach it.
    pub async fn advertised_ip(config: &Config) -> Result<IpAddr, LaunchError> {
        let Some(addr) = config.local_addr.as_deref().filter(|_| !config.standalone) else {
            return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
        };
        if let Ok(ip) = addr
            .trim_matches(|c| c == '[' || c == ']')
            .parse::<IpAddr>()
        {
            return Ok(ip);
        }
        let mut found = tokio::net::lookup_host((addr, 0))
            .await
            .map_err(|e| LaunchError::Config(format!("--local-addr {addr}: {e}")))?;
        found
            .next()
            .map(|sa| sa.ip())
            .ok_or_else(|| LaunchError::Config(format!("--local-addr {addr}: no address")))
    }
}

impl Rendezvous for LocalRendezvous {
    fn next_round<'a>(
        &'a mut self,
        config: &'a Config,
        restart_count: u32,
        _stop: &'a StopRequest,
    ) -> BoxFuture<'a, Result<Round, LaunchError>> {
        Box::pin(async move {
            let ip = Self::advertised_ip(config).await?;
            let store = HostedStore::start(ip, config.max_store_bytes)
                .await
                .map_err(|source| LaunchError::Store { ip, source })?;
            Ok(Round {
                assignment: RankAssignment {
                    node_rank: 0,
                    group_world_size: 1,
                    base_global_rank: 0,
                    world_size: config.nproc_per_node,
                    master_addr: store.addr().ip().to_string(),
                    master_port: store.addr().port(),
                    restart_count,
                    run_id: config.run_id.clone(),
                },
                store: Some(store),
                failure_post: None,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use tokio_util::sync::CancellationToken;

    use super::*;

    #[tokio::test]
    async fn local_rendezvous_hosts_a_fresh_store_per_round() {
        let config = Config::for_program("/bin/true", vec![], 3);
        let stop = StopRequest::new(&CancellationToken::new());
        let mut rdzv = LocalRendezvous;
        let a = rdzv.next_round(&config, 0, &stop).await.unwrap();
        let b = rdzv.next_round(&config, 1, &stop).await.unwrap();
        assert_eq!(a.assignment.master_addr, "127.0.0.1");
        assert_eq!(a.assignment.world_size, 3);
        assert_eq!(b.assignment.restart_count, 1);
        assert_ne!(a.assignment.master_port, b.assignment.master_port);
        for round in [a, b] {
            let store = round.store.unwrap();
            let addr = store.addr();
            let mut client =
                rendezvous::store::client::Client::connect(addr, std::time::Duration::from_secs(5))
                    .await
                    .unwrap();
            client.set(b"k", b"v").await.unwrap();
            store.shutdown().await;
        }
    }
}
