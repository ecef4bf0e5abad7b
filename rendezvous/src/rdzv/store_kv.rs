//! [`Kv`] over the TCPStore client. A connection that failed (timeout, reset) may hold half a
//! reply, so it is dropped and the next operation reconnects: the heartbeat loop can then tell
//! "the store host is gone" (every reconnect fails for the heartbeat timeout) from one slow read.
//! An operation whose future was dropped half-way (a caller that stopped waiting, see the exit
//! barrier) leaves the connection in the same unknown state, so it is dropped the same way.
//!
//! Failures are sorted by what they say about the store host ([`fault_of`]): a timed-out
//! operation on an open connection is a slow host, a refused, reset or closed connection a gone
//! one. A reconnect is one attempt, never a retry loop, so a refusal surfaces at once.

use std::net::SocketAddr;
use std::time::Duration;

use super::decide::StoreFault;
use super::kv::{Kv, KvError};
use crate::store::client::{Client, ClientError};

/// A reconnecting store connection.
pub struct StoreKv {
    addr: SocketAddr,
    op_timeout: Duration,
    client: Option<Client>,
    /// Set while an operation is on the wire; still set when the next one starts means the
    /// last one was cancelled mid-way and its reply may still come: reconnect instead.
    busy: bool,
}

impl StoreKv {
    /// Connects now (retrying refused connections until `connect_timeout`).
    pub async fn connect(
        addr: SocketAddr,
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> Result<Self, ClientError> {
        let mut client = Client::connect(addr, connect_timeout).await?;
        client.set_timeout(op_timeout);
        Ok(Self {
            addr,
            op_timeout,
            client: Some(client),
            busy: false,
        })
    }

    /// Another connection to the same store.
    pub async fn reconnect(&self) -> Result<Self, ClientError> {
        Self::connect(self.addr, self.op_timeout, self.op_timeout).await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    async fn client(&mut self) -> Result<&mut Client, KvError> {
        if self.busy {
            self.client = None;
            self.busy = false;
        }
        if self.client.is_none() {
            let mut c = Client::connect_once(self.addr, self.op_timeout)
                .await
                .map_err(|e| kv_error(&e))?;
            c.set_timeout(self.op_timeout);
            self.client = Some(c);
        }
        self.busy = true;
        self.client
            .as_mut()
            .ok_or_else(|| KvError::Silent("not connected".into()))
    }

    /// Ends an operation started with [`Self::client`].
    fn finish<T>(&mut self, r: Result<T, ClientError>) -> Result<T, KvError> {
        self.busy = false;
        r.map_err(|e| self.fail(e))
    }

    fn fail(&mut self, e: ClientError) -> KvError {
        match e {
            ClientError::WaitTimeout { .. } => KvError::WaitTimeout,
            other => {
                self.client = None;
                kv_error(&other)
            }
        }
    }
}

/// What a failed client operation says about the store host.
pub fn fault_of(e: &ClientError) -> StoreFault {
    use std::io::ErrorKind;
    match e {
        ClientError::Timeout { .. } | ClientError::WaitTimeout { .. } => StoreFault::Slow,
        ClientError::Closed { .. } => StoreFault::Gone,
        ClientError::Connect { source, .. } | ClientError::Io { source, .. } => {
            match source.kind() {
                ErrorKind::ConnectionRefused
                | ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::BrokenPipe
                | ErrorKind::UnexpectedEof => StoreFault::Gone,
                // No SYN-ACK, no route (a vanished pod's IP): nothing said "no".
                _ => StoreFault::Silent,
            }
        }
        ClientError::Protocol { .. } => StoreFault::Silent,
    }
}

fn kv_error(e: &ClientError) -> KvError {
    let detail = e.to_string();
    match fault_of(e) {
        StoreFault::Slow => KvError::Slow(detail),
        StoreFault::Silent => KvError::Silent(detail),
        StoreFault::Gone => KvError::Gone(detail),
    }
}

fn refs(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

impl Kv for StoreKv {
    async fn get(&mut self, key: &[u8]) -> Result<Vec<u8>, KvError> {
        let r = self.client().await?.get(key).await;
        self.finish(r)
    }

    async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        let r = self.client().await?.set(key, value).await;
        self.finish(r)
    }

    async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, KvError> {
        let r = self.client().await?.add(key, delta).await;
        self.finish(r)
    }

    async fn compare_set(
        &mut self,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, KvError> {
        let r = self
            .client()
            .await?
            .compare_set(key, expected, desired)
            .await;
        self.finish(r)
    }

    async fn multi_get(&mut self, keys: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, KvError> {
        let keys = refs(keys);
        let r = self.client().await?.multi_get(&keys).await;
        self.finish(r)
    }

    async fn multi_set(&mut self, pairs: &[(Vec<u8>, Vec<u8>)]) -> Result<(), KvError> {
        let pairs: Vec<(&[u8], &[u8])> = pairs
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        let r = self.client().await?.multi_set(&pairs).await;
        self.finish(r)
    }

    async fn wait(&mut self, keys: &[Vec<u8>], timeout: Duration) -> Result<(), KvError> {
        let keys = refs(keys);
        let r = self.client().await?.wait(&keys, timeout).await;
        self.finish(r)
    }

    fn local_addr(&self) -> Option<SocketAddr> {
        self.client.as_ref().and_then(Client::local_addr)
    }

    async fn closed(&self) {
        match &self.client {
            // A connection with an operation cut short may hold its late reply: not idle.
            Some(c) if !self.busy => c.closed().await,
            _ => std::future::pending().await,
        }
    }
}

/// The store host's own view of its connections: node 0's watcher asks it whether a member's
/// heartbeat connection is still open.
impl super::Presence for crate::store::server::Stats {
    fn is_open(&self, peer: SocketAddr) -> bool {
        crate::store::server::Stats::is_open(self, peer)
    }

    fn closes(&self) -> Option<&tokio::sync::Notify> {
        Some(crate::store::server::Stats::closes(self))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio_util::sync::CancellationToken;

    use super::super::{Config, Registration};
    use super::*;
    use crate::rdzv::Rendezvous;
    use crate::store::server::{self, Server};

    /// A store server on a free loopback port, serving until `stop`.
    struct Served {
        addr: SocketAddr,
        stats: Arc<server::Stats>,
        shutdown: CancellationToken,
        serving: tokio::task::JoinHandle<Result<(), server::ServerError>>,
    }

    impl Served {
        async fn start() -> Self {
            let server = Server::bind(
                "127.0.0.1:0".parse().expect("addr"),
                server::Config::default(),
            )
            .await
            .expect("bind");
            let addr = server.local_addr();
            let stats = server.stats();
            let shutdown = CancellationToken::new();
            let serving = tokio::spawn(server.run(shutdown.clone()));
            Self {
                addr,
                stats,
                shutdown,
                serving,
            }
        }

        async fn stop(self) {
            self.shutdown.cancel();
            let _ = self.serving.await;
        }
    }

    async fn connect(addr: SocketAddr) -> StoreKv {
        StoreKv::connect(addr, Duration::from_secs(5), Duration::from_secs(5))
            .await
            .expect("connect")
    }

    #[tokio::test]
    async fn three_agents_form_a_gang_over_a_real_store() {
        let served = Served::start().await;
        let addr = served.addr;
        let mut cfg = Config::new("t", 3, 3);
        cfg.join_timeout = Duration::from_secs(10);
        let mut tasks = Vec::new();
        for rank in [2_u32, 0, 1] {
            let cfg = cfg.clone();
            tasks.push(tokio::spawn(async move {
                let kv = connect(addr).await;
                let reg = Registration {
                    agent_id: format!("a{rank}"),
                    node_rank: Some(rank),
                    addr: "127.0.0.1".into(),
                    host: format!("w-{rank}"),
                    local_world_size: 2,
                    coordinator: rank == 0,
                    gpu: serde_json::Value::Null,
                    memory: None,
                    held: false,
                    spare_index: None,
                };
                Rendezvous::new(kv, cfg, reg).next_round(5555).await
            }));
        }
        let mut bases = Vec::new();
        for t in tasks {
            let j = t.await.expect("task").expect("joined");
            assert_eq!(j.assignment.world_size, 6);
            bases.push((j.assignment.node_rank, j.assignment.base_global_rank));
        }
        bases.sort_unstable();
        assert_eq!(bases, vec![(0, 0), (1, 2), (2, 4)]);
        served.stop().await;
    }

    #[tokio::test]
    async fn an_operation_dropped_half_way_does_not_garble_the_next_one() {
        let served = Served::start().await;
        let stats = &served.stats;
        let mut kv = connect(served.addr).await;
        let first = kv.local_addr().expect("connected");
        // The barrier's way of waiting: a long WAIT cut short by another event.
        let cut = tokio::time::timeout(
            Duration::from_millis(100),
            kv.wait(&[b"never".to_vec()], Duration::from_secs(30)),
        )
        .await;
        assert!(cut.is_err(), "the wait was cut short");
        kv.set(b"k", b"v").await.expect("set");
        // The key released the dropped WAIT on the old connection; had it been kept, its
        // STOP_WAITING byte would now be read as GET's reply.
        kv.set(b"never", b"1").await.expect("set");
        assert_eq!(kv.get(b"k").await.expect("get"), b"v");
        assert_ne!(kv.local_addr(), Some(first), "a fresh connection");
        // The store host sees the old connection closed and the new one open (the evidence
        // node 0's watcher uses).
        let second = kv.local_addr().expect("connected");
        assert!(stats.is_open(second));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while stats.is_open(first) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            !stats.is_open(first),
            "the dropped connection is closed on the server"
        );
        served.stop().await;
    }

    #[tokio::test]
    async fn a_stopped_store_is_gone_at_once_and_a_mute_one_is_slow() {
        let served = Served::start().await;
        let addr = served.addr;
        let mut kv = connect(addr).await;
        kv.set(b"k", b"v").await.expect("set");
        served.stop().await;
        // The idle connection tells of the close without a request.
        tokio::time::timeout(Duration::from_secs(5), kv.closed())
            .await
            .expect("closed() resolves when the server goes");
        let started = tokio::time::Instant::now();
        let first = kv.get(b"k").await.expect_err("server gone");
        assert_eq!(first.fault(), Some(StoreFault::Gone), "{first}");
        // The reconnect is one attempt: refused at once, not retried for the op timeout.
        let second = kv.get(b"k").await.expect_err("nothing listens");
        assert_eq!(second.fault(), Some(StoreFault::Gone), "{second}");
        assert!(started.elapsed() < Duration::from_secs(1));

        // A host whose kernel accepts but whose process never answers: slow, not gone.
        let mute = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let err =
            Client::connect_once(mute.local_addr().expect("addr"), Duration::from_millis(200))
                .await
                .err()
                .expect("no handshake");
        assert_eq!(fault_of(&err), StoreFault::Slow, "{err}");
    }
}
