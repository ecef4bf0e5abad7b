//! Test helpers shared by the rendezvous phases' tests: a config with short timeouts, agents
//! on an in-memory store, watchers and barriers in tasks, and fake store connections.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::keys::Keys;
use super::kv::mem::MemKv;
use super::kv::{Kv, KvError};
use super::{
    BarrierOutcome, Config, Event, GenRecord, Joined, Presence, RdzvError, Registration, Rendezvous,
};

pub(super) fn cfg(min: u32, max: u32) -> Config {
    let mut c = Config::new("job", min, max);
    c.join_timeout = Duration::from_secs(30);
    c.last_call_timeout = Duration::from_secs(2);
    c.keep_alive_interval = Duration::from_millis(500);
    c.heartbeat_timeout = Duration::from_secs(2);
    c.max_restarts = 1;
    c
}

pub(super) fn agent(kv: &MemKv, c: &Config, rank: Option<u32>, lws: u32) -> Rendezvous<MemKv> {
    let id = rank.map_or_else(|| "anon".to_owned(), |r| format!("a{r}"));
    Rendezvous::new(
        kv.connect(),
        c.clone(),
        Registration {
            agent_id: id.clone(),
            node_rank: rank,
            addr: format!("10.0.0.{}", rank.unwrap_or(99)),
            host: format!("host-{id}"),
            local_world_size: lws,
            coordinator: rank == Some(0),
            gpu: serde_json::Value::Null,
            memory: None,
            held: false,
            spare_index: None,
        },
    )
}

/// `r`'s watcher of round `j`, running in a task until an event or `stop`.
pub(super) fn spawn_watcher(
    r: &Rendezvous<MemKv>,
    kv: &MemKv,
    j: &Joined,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<Event> {
    tokio::spawn(
        r.watcher(kv.clone(), &j.assignment)
            .run(stop.clone(), CancellationToken::new()),
    )
}

/// Like `spawn_watcher`, but its connection has the local address `addr`, as node 0 sees it.
pub(super) fn spawn_watcher_at(
    r: &Rendezvous<MemKv>,
    kv: &MemKv,
    j: &Joined,
    addr: SocketAddr,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<Event> {
    tokio::spawn(
        r.watcher(kv.connect().with_local_addr(addr), &j.assignment)
            .run(stop.clone(), CancellationToken::new()),
    )
}

/// Node 0's watcher asking `presence` whether a silent member's connection is open; never
/// stopped from outside, `fired` as in `Watcher::run`.
pub(super) fn spawn_watcher_with_presence(
    r: &Rendezvous<MemKv>,
    kv: &MemKv,
    j: &Joined,
    presence: &Arc<FakePresence>,
    fired: &CancellationToken,
) -> tokio::task::JoinHandle<Event> {
    tokio::spawn(
        r.watcher(kv.clone(), &j.assignment)
            .with_presence(presence.clone())
            .run(CancellationToken::new(), fired.clone()),
    )
}

pub(super) async fn form(
    kv: &MemKv,
    agents: Vec<Rendezvous<MemKv>>,
) -> Vec<(Rendezvous<MemKv>, Joined)> {
    let _ = kv;
    let tasks: Vec<_> = agents
        .into_iter()
        .map(|mut a| {
            tokio::spawn(async move {
                let j = a.next_round(4242).await;
                (a, j)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        let (a, j) = t.await.expect("task");
        out.push((a, j.expect("joined")));
    }
    out
}

/// Nodes `0..n`, one worker each, formed into one round; element `i` is node `i`.
pub(super) async fn form_nodes(kv: &MemKv, c: &Config, n: u32) -> Vec<(Rendezvous<MemKv>, Joined)> {
    form(kv, (0..n).map(|r| agent(kv, c, Some(r), 1)).collect()).await
}

/// `r`'s exit barrier for round `j`, in a task.
pub(super) fn spawn_barrier(
    mut r: Rendezvous<MemKv>,
    j: Joined,
    interrupt: CancellationToken,
) -> tokio::task::JoinHandle<Result<BarrierOutcome, RdzvError>> {
    tokio::spawn(async move { r.exit_barrier(&j.assignment, &interrupt).await })
}

/// The calls a [`Hooked`] connection passes through, with what a hook looks at.
pub(super) enum Call<'a> {
    Add { key: &'a [u8], delta: i64 },
    Other,
}

/// What a fake store connection does before each call goes through to the store.
pub(super) trait Hook: Send {
    fn before(
        &mut self,
        store: &MemKv,
        call: Call<'_>,
    ) -> impl std::future::Future<Output = Result<(), KvError>> + Send;
}

/// A store connection that runs its hook, then passes the call through to `inner`.
pub(super) struct Hooked<H> {
    inner: MemKv,
    hook: H,
}

impl<H> Hooked<H> {
    pub(super) fn new(kv: &MemKv, hook: H) -> Self {
        Self {
            inner: kv.connect(),
            hook,
        }
    }
}

impl<H: Hook> Kv for Hooked<H> {
    async fn get(&mut self, key: &[u8]) -> Result<Vec<u8>, KvError> {
        self.hook.before(&self.inner, Call::Other).await?;
        self.inner.get(key).await
    }
    async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        self.hook.before(&self.inner, Call::Other).await?;
        self.inner.set(key, value).await
    }
    async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, KvError> {
        self.hook
            .before(&self.inner, Call::Add { key, delta })
            .await?;
        self.inner.add(key, delta).await
    }
    async fn compare_set(
        &mut self,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, KvError> {
        self.hook.before(&self.inner, Call::Other).await?;
        self.inner.compare_set(key, expected, desired).await
    }
    async fn multi_get(&mut self, keys: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, KvError> {
        self.hook.before(&self.inner, Call::Other).await?;
        self.inner.multi_get(keys).await
    }
    async fn multi_set(&mut self, pairs: &[(Vec<u8>, Vec<u8>)]) -> Result<(), KvError> {
        self.hook.before(&self.inner, Call::Other).await?;
        self.inner.multi_set(pairs).await
    }
    async fn wait(&mut self, keys: &[Vec<u8>], timeout: Duration) -> Result<(), KvError> {
        self.hook.before(&self.inner, Call::Other).await?;
        self.inner.wait(keys, timeout).await
    }
}

/// Node 0's view of which connections are open, set by hand.
#[derive(Default)]
pub(super) struct FakePresence(std::sync::Mutex<std::collections::HashSet<SocketAddr>>);

impl FakePresence {
    pub(super) fn set(&self, addr: SocketAddr, open: bool) {
        let mut set = self.0.lock().expect("lock");
        if open {
            set.insert(addr);
        } else {
            set.remove(&addr);
        }
    }
}

impl Presence for FakePresence {
    fn is_open(&self, peer: SocketAddr) -> bool {
        self.0.lock().expect("lock").contains(&peer)
    }
}

pub(super) fn gen_record(kv: &MemKv) -> GenRecord {
    let raw = kv.raw_get(&Keys::new("job").gen()).expect("gen written");
    serde_json::from_slice(&raw).expect("gen record")
}
