//! The workers' store for one attempt: a fresh `rendezvous::store` server on an ephemeral port,
//! hosted in the agent's process, so a restarted group can never read the dead attempt's keys
//! (torch 2.15 reuses one server across restarts and does). Isolated here so the rest of the
//! launch loop only sees an address and a shutdown.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rendezvous::store::server::{Config, Server, Stats};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A running store; [`HostedStore::shutdown`] stops it.
pub struct HostedStore {
    addr: SocketAddr,
    stats: std::sync::Arc<Stats>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl HostedStore {
    /// Binds `ip` on an ephemeral port and starts serving.
    pub async fn start(ip: IpAddr) -> std::io::Result<HostedStore> {
        let server = Server::bind(SocketAddr::new(ip, 0), Config::default())
            .await
            .map_err(std::io::Error::other)?;
        let addr = server.local_addr();
        let stats = server.stats();
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = server.run(token).await {
                tracing::warn!("workers' store on {addr} stopped: {e}");
            }
        });
        Ok(HostedStore {
            addr,
            stats,
            stop,
            task,
        })
    }

    /// The address workers connect to (MASTER_ADDR:MASTER_PORT).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's counters (exported by the metrics endpoint).
    pub fn stats(&self) -> std::sync::Arc<Stats> {
        self.stats.clone()
    }

    /// Stops serving and closes every connection (bounded: a stuck server is abandoned).
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.task).await;
    }
}
