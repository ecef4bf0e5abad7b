//! Benchmark driver for `scripts/bench.d/30-rendezvous`: N simulated agents (each a real
//! [`Rendezvous`] over its own TCP connection, all in this process) form one gang through a
//! store at `--store HOST:PORT`. Prints one line per size: `N wall_ms connect_ms ops_per_joiner
//! coordinator_ops`.
//!
//! Usage: `rdzv_bench --store 127.0.0.1:29400 64 256 1024`

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rendezvous::rdzv::{Config, Kv, KvError, Registration, Rendezvous, StoreKv};
use tokio::time::Instant;

/// Counts every store operation of one agent.
struct Counted {
    inner: StoreKv,
    ops: Arc<AtomicU64>,
}

impl Counted {
    fn tick(&self) {
        self.ops.fetch_add(1, Ordering::Relaxed);
    }
}

impl Kv for Counted {
    async fn get(&mut self, key: &[u8]) -> Result<Vec<u8>, KvError> {
        self.tick();
        self.inner.get(key).await
    }
    async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        self.tick();
        self.inner.set(key, value).await
    }
    async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, KvError> {
        self.tick();
        self.inner.add(key, delta).await
    }
    async fn compare_set(&mut self, k: &[u8], e: &[u8], d: &[u8]) -> Result<Vec<u8>, KvError> {
        self.tick();
        self.inner.compare_set(k, e, d).await
    }
    async fn multi_get(&mut self, keys: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, KvError> {
        self.tick();
        self.inner.multi_get(keys).await
    }
    async fn multi_set(&mut self, pairs: &[(Vec<u8>, Vec<u8>)]) -> Result<(), KvError> {
        self.tick();
        self.inner.multi_set(pairs).await
    }
    async fn wait(&mut self, keys: &[Vec<u8>], timeout: Duration) -> Result<(), KvError> {
        self.tick();
        self.inner.wait(keys, timeout).await
    }
}

async fn one(
    store: SocketAddr,
    n: u32,
    run: &str,
) -> Result<(Duration, Duration, f64, u64), String> {
    let t0 = Instant::now();
    let mut agents = Vec::with_capacity(n as usize);
    let mut counters = Vec::with_capacity(n as usize);
    let mut cfg = Config::new(run, n, n);
    cfg.join_timeout = Duration::from_secs(60);
    cfg.poll_interval = Duration::from_millis(5);
    for rank in 0..n {
        let inner = StoreKv::connect(store, Duration::from_secs(30), Duration::from_secs(60))
            .await
            .map_err(|e| e.to_string())?;
        let ops = Arc::new(AtomicU64::new(0));
        counters.push(Arc::clone(&ops));
        let reg = Registration {
            agent_id: format!("{run}-{rank}"),
            node_rank: Some(rank),
            addr: "127.0.0.1".into(),
            host: format!("bench-{rank}"),
            local_world_size: 8,
            coordinator: rank == 0,
            gpu: serde_json::Value::Null,
            memory: None,
            held: false,
            spare_index: None,
        };
        agents.push(Rendezvous::new(Counted { inner, ops }, cfg.clone(), reg));
    }
    let connected = t0.elapsed();
    let start = Instant::now();
    let tasks: Vec<_> = agents
        .into_iter()
        .map(|mut a| tokio::spawn(async move { a.next_round(29500).await }))
        .collect();
    for t in tasks {
        let joined = t
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        if joined.assignment.world_size != 8 * n {
            return Err(format!("wrong world size {}", joined.assignment.world_size));
        }
    }
    let wall = start.elapsed();
    let joiner_ops: u64 = counters[1..]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum();
    let per_joiner = joiner_ops as f64 / f64::from(n - 1).max(1.0);
    Ok((
        wall,
        connected,
        per_joiner,
        counters[0].load(Ordering::Relaxed),
    ))
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(flag), Some(store)) = (args.first(), args.get(1)) else {
        eprintln!("usage: rdzv_bench --store HOST:PORT N...");
        return std::process::ExitCode::from(2);
    };
    let Some(store) = (flag == "--store")
        .then(|| store.parse::<SocketAddr>().ok())
        .flatten()
    else {
        eprintln!("rdzv_bench: --store needs HOST:PORT");
        return std::process::ExitCode::from(2);
    };
    let sizes: Vec<u32> = args[2..].iter().filter_map(|s| s.parse().ok()).collect();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rdzv_bench: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    for (i, n) in sizes.into_iter().enumerate() {
        match runtime.block_on(one(store, n, &format!("bench{i}"))) {
            Ok((wall, connect, per, coord)) => println!(
                "{n} {:.1} {:.1} {per:.2} {coord}",
                wall.as_secs_f64() * 1e3,
                connect.as_secs_f64() * 1e3
            ),
            Err(e) => {
                eprintln!("rdzv_bench: {n} agents: {e}");
                return std::process::ExitCode::from(1);
            }
        }
    }
    std::process::ExitCode::SUCCESS
}
