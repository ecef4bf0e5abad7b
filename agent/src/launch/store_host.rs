//! The workers' store for one attempt: a fresh `rendezvous::store` server on an ephemeral port,
//! hosted in the agent's process, so a restarted group can never read the dead attempt's keys
//! (torch 2.15 reuses one server across restarts and does). Isolated here so the rest of the
//! launch loop only sees an address and a shutdown.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rendezvous::store::server::{Config, ServerThread, Stats};

/// A running store; [`HostedStore::shutdown`] stops it.
pub struct HostedStore {
    server: ServerThread,
}

impl HostedStore {
    /// Binds `ip` on an ephemeral port and starts serving, on a thread of its own (see
    /// [`ServerThread`] for why not on the agent's runtime), holding at most `max_store_bytes`.
    pub async fn start(ip: IpAddr, max_store_bytes: usize) -> std::io::Result<HostedStore> {
        let config = Config {
            max_store_bytes,
            ..Config::default()
        };
        let server = ServerThread::start(SocketAddr::new(ip, 0), config)
            .await
            .map_err(std::io::Error::other)?;
        Ok(HostedStore { server })
    }

    /// The address workers connect to (MASTER_ADDR:MASTER_PORT).
    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The server's counters (exported by the metrics endpoint).
    pub fn stats(&self) -> std::sync::Arc<Stats> {
        self.server.stats()
    }

    /// Stops serving and closes every connection (bounded: a stuck server is abandoned).
    pub async fn shutdown(self) {
        self.server.shutdown(Duration::from_secs(2)).await;
    }
}
