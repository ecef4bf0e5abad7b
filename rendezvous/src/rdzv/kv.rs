//! The few store operations the rendezvous uses, as a trait: the real implementation is the
//! TCPStore client, and the driver's tests use an in-memory store with paused tokio time.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use super::decide::StoreFault;

/// A failed store operation, reduced to what the rendezvous acts on. The three ways the store
/// can fail to answer are told apart because they are different evidence about its host (see
/// [`StoreFault`] and [`super::decide::decide_store_fault`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum KvError {
    /// WAIT ran out of time (not a failure of the store).
    #[error("wait timed out")]
    WaitTimeout,
    /// No answer within the operation timeout on an open connection: alive but slow.
    #[error("{0}")]
    Slow(String),
    /// No answer and no refusal (connect timed out, host unreachable, a garbled reply).
    #[error("{0}")]
    Silent(String),
    /// Refused, reset or closed: nothing listens at the store's address.
    #[error("{0}")]
    Gone(String),
}

impl KvError {
    /// What this failure says about the store host; `None` for a WAIT that ran out of time.
    pub fn fault(&self) -> Option<StoreFault> {
        match self {
            KvError::WaitTimeout => None,
            KvError::Slow(_) => Some(StoreFault::Slow),
            KvError::Silent(_) => Some(StoreFault::Silent),
            KvError::Gone(_) => Some(StoreFault::Gone),
        }
    }
}

/// The store operations of the rendezvous. Keys are raw wire keys.
pub trait Kv: Send {
    fn get(&mut self, key: &[u8]) -> impl Future<Output = Result<Vec<u8>, KvError>> + Send;
    fn set(&mut self, key: &[u8], value: &[u8])
        -> impl Future<Output = Result<(), KvError>> + Send;
    fn add(&mut self, key: &[u8], delta: i64) -> impl Future<Output = Result<i64, KvError>> + Send;
    /// Returns the value after the operation (ours when we won).
    fn compare_set(
        &mut self,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> impl Future<Output = Result<Vec<u8>, KvError>> + Send;
    /// Missing keys come back empty.
    fn multi_get(
        &mut self,
        keys: &[Vec<u8>],
    ) -> impl Future<Output = Result<Vec<Vec<u8>>, KvError>> + Send;
    fn multi_set(
        &mut self,
        pairs: &[(Vec<u8>, Vec<u8>)],
    ) -> impl Future<Output = Result<(), KvError>> + Send;
    /// Until every key exists, or [`KvError::WaitTimeout`].
    fn wait(
        &mut self,
        keys: &[Vec<u8>],
        timeout: Duration,
    ) -> impl Future<Output = Result<(), KvError>> + Send;
    /// The local address of the current connection, as the store host sees it as the peer:
    /// published with the heartbeat so node 0 can tell an open connection from a closed one.
    /// `None` when not connected or not a socket.
    fn local_addr(&self) -> Option<SocketAddr> {
        None
    }
    /// Resolves when the store host closes or resets the current (idle) connection, so a watcher
    /// sleeping between heartbeats learns of a dead store host at once rather than at its next
    /// tick. Never resolves when there is no connection or no way to tell.
    fn closed(&self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }
}

#[cfg(test)]
pub mod mem {
    //! An in-memory [`Kv`] for the driver's tests. Clones share one map; every operation is
    //! counted so tests can check the O(1)-per-agent claim.

    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::sync::Notify;

    use super::{Kv, KvError};

    type Map = HashMap<Vec<u8>, Vec<u8>>;

    #[derive(Default)]
    struct Shared {
        map: Mutex<Map>,
        changed: Notify,
        ops: AtomicU64,
        down: AtomicBool,
    }

    #[derive(Clone, Default)]
    pub struct MemKv {
        shared: Arc<Shared>,
        mine: Arc<AtomicU64>,
        /// What [`Kv::local_addr`] reports: a stand-in for a socket's address.
        addr: Option<std::net::SocketAddr>,
    }

    impl MemKv {
        /// All operations on this store, through any handle.
        pub fn ops(&self) -> u64 {
            self.shared.ops.load(Ordering::Relaxed)
        }

        /// Operations through this handle (and its clones) only.
        pub fn own_ops(&self) -> u64 {
            self.mine.load(Ordering::Relaxed)
        }

        /// Another connection to the same store, with its own operation counter.
        #[must_use]
        pub fn connect(&self) -> Self {
            Self {
                shared: Arc::clone(&self.shared),
                mine: Arc::default(),
                addr: None,
            }
        }

        /// This handle, reporting `addr` as its connection's local address.
        #[must_use]
        pub fn with_local_addr(mut self, addr: std::net::SocketAddr) -> Self {
            self.addr = Some(addr);
            self
        }

        /// Simulates the store host dying: every later operation fails.
        pub fn take_down(&self) {
            self.shared.down.store(true, Ordering::Relaxed);
            self.shared.changed.notify_waiters();
        }

        fn enter(&self) -> Result<std::sync::MutexGuard<'_, Map>, KvError> {
            self.shared.ops.fetch_add(1, Ordering::Relaxed);
            self.mine.fetch_add(1, Ordering::Relaxed);
            if self.shared.down.load(Ordering::Relaxed) {
                return Err(KvError::Gone("connection refused".into()));
            }
            Ok(self
                .shared
                .map
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner))
        }

        pub fn raw_get(&self, key: &[u8]) -> Option<Vec<u8>> {
            self.shared
                .map
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(key)
                .cloned()
        }
    }

    impl Kv for MemKv {
        async fn get(&mut self, key: &[u8]) -> Result<Vec<u8>, KvError> {
            Ok(self.enter()?.get(key).cloned().unwrap_or_default())
        }

        async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
            self.enter()?.insert(key.to_vec(), value.to_vec());
            self.shared.changed.notify_waiters();
            Ok(())
        }

        async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, KvError> {
            let value = {
                let mut map = self.enter()?;
                let old: i64 = map
                    .get(key)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                    .unwrap_or(0);
                map.insert(key.to_vec(), (old + delta).to_string().into_bytes());
                old + delta
            };
            self.shared.changed.notify_waiters();
            Ok(value)
        }

        async fn compare_set(
            &mut self,
            key: &[u8],
            expected: &[u8],
            desired: &[u8],
        ) -> Result<Vec<u8>, KvError> {
            let out = {
                let mut map = self.enter()?;
                match map.get(key) {
                    None if expected.is_empty() => {
                        map.insert(key.to_vec(), desired.to_vec());
                        desired.to_vec()
                    }
                    None => expected.to_vec(),
                    Some(cur) if cur == expected => {
                        map.insert(key.to_vec(), desired.to_vec());
                        desired.to_vec()
                    }
                    Some(cur) => cur.clone(),
                }
            };
            self.shared.changed.notify_waiters();
            Ok(out)
        }

        async fn multi_get(&mut self, keys: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, KvError> {
            let map = self.enter()?;
            Ok(keys
                .iter()
                .map(|k| map.get(k).cloned().unwrap_or_default())
                .collect())
        }

        async fn multi_set(&mut self, pairs: &[(Vec<u8>, Vec<u8>)]) -> Result<(), KvError> {
            {
                let mut map = self.enter()?;
                for (k, v) in pairs {
                    map.insert(k.clone(), v.clone());
                }
            }
            self.shared.changed.notify_waiters();
            Ok(())
        }

        fn local_addr(&self) -> Option<std::net::SocketAddr> {
            self.addr
        }

        async fn closed(&self) {
            loop {
                let notified = self.shared.changed.notified();
                if self.shared.down.load(Ordering::Relaxed) {
                    return;
                }
                notified.await;
            }
        }

        async fn wait(&mut self, keys: &[Vec<u8>], timeout: Duration) -> Result<(), KvError> {
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let notified = self.shared.changed.notified();
                if keys.iter().all(|k| self.raw_get(k).is_some()) {
                    drop(self.enter()?);
                    return Ok(());
                }
                if self.shared.down.load(Ordering::Relaxed) {
                    return Err(KvError::Gone("connection reset".into()));
                }
                if tokio::time::timeout_at(deadline, notified).await.is_err() {
                    drop(self.enter()?);
                    return Err(KvError::WaitTimeout);
                }
            }
        }
    }
}
