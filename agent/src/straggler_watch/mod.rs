//! The per-attempt straggler watch: while the ranks train, names the rank (and the GPU) that
//! holds the gang back, and under `--straggler-action exclude` makes a node that stays slow leave.
//!
//! # Theory of operation
//! Every `--straggler-interval` each agent reads, for each of its running ranks, the CPU time of
//! the main thread of the rank's process (`/proc/<pid>/task/<pid>/schedstat`: the pid the step
//! reporter gave, else the worker's; why the main thread: [`straggler`]'s doc) and its last
//! reported step (the checkpoint helper's, or the zero-code reporter's optimizer steps: no change
//! to the script). [`straggler::Sampler`] turns two looks into the rank's CPU seconds per step. The agent writes its ranks' figures to one key of the attempt's store and
//! reads every node's key with one multi-get (two store operations per node and interval,
//! whatever the gang's size), then [`straggler::Tracker`] judges its own ranks against the
//! gang's median: the node that hosts a slow rank names it, with its own evidence (its GPU).
//!
//! A GPU the hardware throttles (`hw_slowdown`, thermal, power brake, from the GPU watch's
//! latest look at it) is named on its own after the same number of intervals, and it enriches
//! the finding of the local rank that uses it (local rank `i` on GPU `i`, the order muster's
//! device environment gives).
//!
//! What it tells: a `slow rank: …` / `slow GPU: …` WARN line per finding (`straggler node: …` when a node leaves) (a `… cleared` INFO
//! line when it ends), the [`Board`] that the metrics and `/gangz` read, and with `exclude` a
//! [`Leave`] request (exit [`exit_code::SLOW_NODE_EXCLUDED`]) after
//! [`straggler::EXCLUDE_AFTER`] intervals of one finding, as long as the gang keeps
//! `--nnodes`'s minimum without the node. [`ExcludeHook`] is called at that moment (where a
//! record of bad nodes plugs in).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rendezvous::store::client::{Client, ClientError};
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{debug, error, info, warn};

use crate::checkpoint::local::{ProgressView, RankWatch};
use crate::exit_code;
use crate::gpu::watch::sample::throttle_names;
use crate::gpu::watch::{GpuSample, Watch as GpuWatch};
use crate::launch::leave::{Departure, Leave};
use crate::launch::{BoxFuture, Watchdog, WatchedAttempt, WatchedWorker};
use crate::watch::straggler::{self, Action, Figure, Reading, Sampler, Settings, Tracker};
use crate::watch::Hang;

/// How long one store operation of the exchange may take: a store that slow skips an interval
/// (this node then compares only its own ranks, which names nobody below
/// [`straggler::MIN_RANKS`]).
const STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// A node about to leave the gang as a straggler.
#[derive(Debug, Clone, PartialEq)]
pub struct Excluded {
    pub node_rank: u32,
    pub host: String,
    pub rank: u32,
    pub local_rank: u32,
    /// The finding, as the log says it.
    pub what: String,
}

/// Called once when this node leaves the gang as a straggler, before the workers stop; the
/// watch awaits what it returns (a store write: the record of a bad node) before it asks to leave.
pub type ExcludeHook = Arc<dyn Fn(&Excluded) -> BoxFuture<'static, ()> + Send + Sync>;

/// A rank's slowness ratio in the last interval.
#[derive(Debug, Clone, PartialEq)]
pub struct RankRatio {
    pub node_rank: u32,
    pub local_rank: u32,
    pub rank: u32,
    pub ratio: f64,
}

/// A standing finding, for metrics and `/gangz`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FindingView {
    /// `rank` or `gpu`.
    pub kind: &'static str,
    pub node_rank: u32,
    pub host: String,
    /// The rank named, or the rank on the GPU named (`None`: no rank of this node uses it).
    pub local_rank: Option<u32>,
    pub rank: Option<u32>,
    pub gpu: Option<u32>,
    /// The finding's line (without the `slow rank: ` prefix).
    pub what: String,
}

/// What the watch found, read by the metrics and `/gangz` (read-only for them).
#[derive(Clone, Default)]
pub struct Board {
    state: Arc<Mutex<BoardState>>,
}

#[derive(Default)]
struct BoardState {
    ratios: Vec<RankRatio>,
    findings: Vec<FindingView>,
}

impl Board {
    fn lock(&self) -> std::sync::MutexGuard<'_, BoardState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// This node's ranks' ratios in the last interval.
    pub fn ratios(&self) -> Vec<RankRatio> {
        self.lock().ratios.clone()
    }

    /// The standing findings of this node.
    pub fn findings(&self) -> Vec<FindingView> {
        self.lock().findings.clone()
    }

    fn set(&self, ratios: Vec<RankRatio>, findings: Vec<FindingView>) {
        let mut s = self.lock();
        s.ratios = ratios;
        s.findings = findings;
    }
}

/// Empties the board when an attempt's watch ends.
struct ClearOnDrop(Board);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.set(Vec::new(), Vec::new());
    }
}

/// The straggler watch around the hang watch: one [`Watchdog`] for the launch loop, whose
/// verdicts are the inner watch's (a straggler is not a hang).
pub struct StragglerWatch {
    parts: Parts,
    inner: Arc<dyn Watchdog>,
}

/// Everything an attempt's watch shares with the others (handles: cheap to clone).
#[derive(Clone)]
struct Parts {
    settings: Settings,
    view: ProgressView,
    gpus: Option<GpuWatch>,
    board: Board,
    leave: Leave,
    /// `--nnodes`'s minimum: the gang must keep it without this node for `exclude` to act.
    min_nodes: u32,
    on_exclude: Option<ExcludeHook>,
}

impl StragglerWatch {
    pub fn new(
        settings: Settings,
        view: ProgressView,
        min_nodes: u32,
        inner: Arc<dyn Watchdog>,
    ) -> Self {
        Self {
            parts: Parts {
                settings,
                view,
                gpus: None,
                board: Board::default(),
                leave: Leave::default(),
                min_nodes,
                on_exclude: None,
            },
            inner,
        }
    }

    /// Takes the GPUs' evidence from `watch`.
    #[must_use]
    pub fn with_gpus(mut self, watch: GpuWatch) -> Self {
        self.parts.gpus = Some(watch);
        self
    }

    /// Calls `hook` when this node leaves as a straggler.
    #[must_use]
    pub fn on_exclude(mut self, hook: ExcludeHook) -> Self {
        self.parts.on_exclude = Some(hook);
        self
    }

    /// What the watch found, for the metrics.
    pub fn board(&self) -> Board {
        self.parts.board.clone()
    }

    /// The request to leave that `exclude` makes, for the launch loop.
    pub fn leave(&self) -> Leave {
        self.parts.leave.clone()
    }
}

impl Watchdog for StragglerWatch {
    fn watch(&self, attempt: WatchedAttempt) -> BoxFuture<'static, Hang> {
        let ctx = Ctx {
            node_rank: attempt.assignment.node_rank,
            nodes: attempt.assignment.group_world_size,
            run_id: attempt.assignment.run_id.clone(),
            store: store_addr(&attempt),
            host: attempt.host.clone(),
            workers: attempt.workers.clone(),
            started: attempt.started,
            exited: attempt.exited.clone(),
        };
        let hang = self.inner.watch(attempt);
        let own = run(self.parts.clone(), ctx);
        Box::pin(async move {
            tokio::pin!(hang);
            tokio::select! {
                hang = &mut hang => return hang,
                () = own => {}
            }
            hang.await
        })
    }
}

/// What the watch needs of one attempt.
struct Ctx {
    node_rank: u32,
    nodes: u32,
    run_id: String,
    store: Option<SocketAddr>,
    host: String,
    workers: Vec<WatchedWorker>,
    started: Instant,
    exited: tokio::sync::watch::Receiver<Vec<u32>>,
}

fn store_addr(attempt: &WatchedAttempt) -> Option<SocketAddr> {
    let a = &attempt.assignment;
    let ip: std::net::IpAddr = a.master_addr.parse().ok()?;
    Some((ip, a.master_port).into())
}

/// `muster/<run_id>/straggler/<node_rank>`.
fn key(run_id: &str, node_rank: u32) -> Vec<u8> {
    format!("muster/{run_id}/straggler/{node_rank}").into_bytes()
}

/// Watches one attempt until it ends (the caller drops this); returns at once when off.
async fn run(parts: Parts, ctx: Ctx) {
    let Some(threshold) = parts.settings.threshold else {
        return;
    };
    let interval = parts.settings.interval;
    let mut ticks = tokio::time::interval_at(Instant::now() + interval, interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut sampler = Sampler::default();
    let mut tracker = Tracker::default();
    let mut exchange = Exchange::new(&ctx);
    let mut gpus = GpuTracker::default();
    let mut told_cannot_leave = false;
    let mut told_unsure = false;
    // An attempt's findings end with it (the next one starts over, with new ranks).
    let _clear = ClearOnDrop(parts.board.clone());
    loop {
        ticks.tick().await;
        let readings = read_ranks(&ctx, &parts.view.ranks()).await;
        let own = sampler.figures(ctx.node_rank, &readings);
        let all = exchange.figures(&own).await;
        let judged = tracker.judge(threshold, ctx.node_rank, &all);
        if let Some(why) = judged.unsure {
            // Once per attempt: the condition is the job's, it lasts.
            if told_unsure {
                debug!("straggler watch: cannot compare the ranks: {why}");
            } else {
                told_unsure = true;
                info!(
                    "straggler watch: cannot compare the ranks: {why}; no rank is named while so"
                );
            }
        }
        if !judged.ratios.is_empty() {
            let ratios: Vec<String> = judged
                .ratios
                .iter()
                .map(|(_, rank, ratio)| format!("rank {rank} {ratio:.2}x"))
                .collect();
            debug!(
                "straggler interval: {} ranks compared; {}",
                all.len(),
                ratios.join(", ")
            );
        }
        let samples: Vec<GpuSample> = parts
            .gpus
            .as_ref()
            .map(|w| w.view().sample.gpus.clone())
            .unwrap_or_default();
        for f in &judged.found {
            let gpu = gpu_evidence(&samples, f.local_rank);
            warn!(
                "slow rank: {}{f}{}",
                rank_name(&ctx, f.local_rank, f.rank, gpu.map(|g| g.gpu.index)),
                gpu.map(|g| format!("; {}", describe_gpu(g)))
                    .unwrap_or_default()
            );
        }
        for (local_rank, rank, ratio) in &judged.cleared {
            info!(
                "slow rank cleared: {}is back to {ratio:.1}x the gang median",
                rank_name(&ctx, *local_rank, *rank, None)
            );
        }
        gpus.look(&ctx, &samples);
        publish(
            &parts.board,
            &ctx,
            &judged.ratios,
            &tracker,
            &gpus,
            &samples,
        );
        if let (Some(finding), Action::Exclude) = (&judged.sustained, parts.settings.action) {
            let what = format!(
                "{}{finding}",
                rank_name(&ctx, finding.local_rank, finding.rank, None)
            );
            if ctx.nodes > parts.min_nodes {
                error!(
                    "straggler node: node {} ({}) leaves the gang (exit {}) so that it re-forms without it: {what}, for {} intervals of {} s",
                    ctx.node_rank,
                    ctx.host,
                    exit_code::SLOW_NODE_EXCLUDED,
                    straggler::EXCLUDE_AFTER,
                    interval.as_secs_f64()
                );
                let excluded = Excluded {
                    node_rank: ctx.node_rank,
                    host: ctx.host.clone(),
                    rank: finding.rank,
                    local_rank: finding.local_rank,
                    what: what.clone(),
                };
                if let Some(hook) = &parts.on_exclude {
                    hook(&excluded).await;
                }
                parts.leave.request(Departure {
                    code: exit_code::SLOW_NODE_EXCLUDED,
                    message: format!(
                        "node {} left the gang as a straggler: {what}",
                        ctx.node_rank
                    ),
                });
            } else if !told_cannot_leave {
                told_cannot_leave = true;
                warn!(
                    "straggler node: node {} ({}) stays: the gang has {} node(s) and --nnodes needs at least {} ({what})",
                    ctx.node_rank, ctx.host, ctx.nodes, parts.min_nodes
                );
            }
        }
    }
}

/// `rank 5 (node 2, host x, local rank 1, GPU 1) ` — the leading part of a finding.
fn rank_name(ctx: &Ctx, local_rank: u32, rank: u32, gpu: Option<u32>) -> String {
    let gpu = gpu.map(|g| format!(", GPU {g}")).unwrap_or_default();
    format!(
        "rank {rank} (node {}, host {}, local rank {local_rank}{gpu}) ",
        ctx.node_rank, ctx.host
    )
}

/// The GPU of `local_rank` when the hardware throttles it.
fn gpu_evidence(samples: &[GpuSample], local_rank: u32) -> Option<&GpuSample> {
    samples
        .iter()
        .find(|g| g.gpu.index == local_rank && throttled(g).is_some())
}

/// The watched throttle reasons set on `g`.
fn throttled(g: &GpuSample) -> Option<u64> {
    let watched = straggler_throttle_mask();
    g.throttle_reasons
        .map(|bits| bits & watched)
        .filter(|b| *b != 0)
}

fn straggler_throttle_mask() -> u64 {
    crate::gpu::watch::sample::WATCHED_THROTTLE
        .iter()
        .fold(0, |m, (bit, _)| m | bit)
}

/// `GPU 1 clocks 1,110 MHz of 1,980 MHz, throttled: hw_slowdown`.
fn describe_gpu(g: &GpuSample) -> String {
    let clocks = match (g.sm_clock_mhz, g.sm_clock_max_mhz) {
        (Some(now), Some(max)) => {
            format!(" clocks {} MHz of {} MHz,", thousands(now), thousands(max))
        }
        (Some(now), None) => format!(" clocks {} MHz,", thousands(now)),
        _ => String::new(),
    };
    let utilization = g
        .utilization_ratio
        .map(|u| format!(" ({:.0} % busy)", u * 100.0))
        .unwrap_or_default();
    format!(
        "GPU {}{clocks} throttled: {}{utilization}",
        g.gpu.index,
        throttle_names(throttled(g).unwrap_or(0)).join(", ")
    )
}

/// `1110` → `1,110`.
fn thousands(n: u32) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// GPUs throttled for [`straggler::FIND_AFTER`] looks in a row are named on their own.
#[derive(Default)]
struct GpuTracker {
    /// GPU index → (consecutive throttled looks, consecutive clear looks, named).
    gpus: BTreeMap<u32, (u32, u32, bool)>,
}

impl GpuTracker {
    fn look(&mut self, ctx: &Ctx, samples: &[GpuSample]) {
        for g in samples {
            let s = self.gpus.entry(g.gpu.index).or_default();
            if throttled(g).is_some() {
                s.0 += 1;
                s.1 = 0;
            } else {
                s.0 = 0;
                s.1 += 1;
            }
            if !s.2 && s.0 >= straggler::FIND_AFTER {
                s.2 = true;
                let user = ctx
                    .workers
                    .iter()
                    .find(|w| w.local_rank == g.gpu.index)
                    .map_or_else(
                        || "no rank of this job uses it".to_owned(),
                        |w| format!("used by local rank {} (rank {})", w.local_rank, w.rank),
                    );
                warn!(
                    "slow GPU: {} on node {} ({}), {user}: {}",
                    g.gpu,
                    ctx.node_rank,
                    ctx.host,
                    describe_gpu(g)
                );
            } else if s.2 && s.1 >= straggler::CLEAR_AFTER {
                s.2 = false;
                info!(
                    "slow GPU cleared: {} on node {} is no longer throttled",
                    g.gpu, ctx.node_rank
                );
            }
        }
    }

    fn named(&self) -> impl Iterator<Item = u32> + '_ {
        self.gpus
            .iter()
            .filter(|(_, s)| s.2)
            .map(|(index, _)| *index)
    }
}

fn publish(
    board: &Board,
    ctx: &Ctx,
    ratios: &[(u32, u32, f64)],
    tracker: &Tracker,
    gpus: &GpuTracker,
    samples: &[GpuSample],
) {
    let ratios = ratios
        .iter()
        .map(|(local_rank, rank, ratio)| RankRatio {
            node_rank: ctx.node_rank,
            local_rank: *local_rank,
            rank: *rank,
            ratio: *ratio,
        })
        .collect();
    let mut findings: Vec<FindingView> = tracker
        .findings()
        .into_iter()
        .map(|f| {
            let gpu = gpu_evidence(samples, f.local_rank);
            FindingView {
                kind: "rank",
                node_rank: ctx.node_rank,
                host: ctx.host.clone(),
                local_rank: Some(f.local_rank),
                rank: Some(f.rank),
                gpu: gpu.map(|g| g.gpu.index),
                what: format!(
                    "{}{f}{}",
                    rank_name(ctx, f.local_rank, f.rank, gpu.map(|g| g.gpu.index)),
                    gpu.map(|g| format!("; {}", describe_gpu(g)))
                        .unwrap_or_default()
                ),
            }
        })
        .collect();
    for index in gpus.named() {
        let Some(g) = samples.iter().find(|g| g.gpu.index == index) else {
            continue;
        };
        let worker = ctx.workers.iter().find(|w| w.local_rank == index);
        findings.push(FindingView {
            kind: "gpu",
            node_rank: ctx.node_rank,
            host: ctx.host.clone(),
            local_rank: worker.map(|w| w.local_rank),
            rank: worker.map(|w| w.rank),
            gpu: Some(index),
            what: format!(
                "{} on node {} ({}): {}",
                g.gpu,
                ctx.node_rank,
                ctx.host,
                describe_gpu(g)
            ),
        });
    }
    board.set(ratios, findings);
}

/// Every running rank's CPU time and last step.
async fn read_ranks(ctx: &Ctx, reports: &[RankWatch]) -> Vec<Reading> {
    let exited = ctx.exited.borrow().clone();
    let mut out = Vec::with_capacity(ctx.workers.len());
    for w in ctx
        .workers
        .iter()
        .filter(|w| !exited.contains(&w.local_rank))
    {
        let report = reports
            .iter()
            .find(|r| r.local_rank == w.local_rank && r.connected_at >= ctx.started);
        let pid = report.and_then(|r| r.pid).unwrap_or(w.pid);
        out.push(Reading {
            local_rank: w.local_rank,
            rank: w.rank,
            cpu_ns: main_thread_cpu_ns(pid).await,
            step: report.and_then(|r| r.step),
        });
    }
    out
}

/// The CPU time of `pid`'s main thread (its thread id is the pid): the scheduler's count, else
/// the thread's `stat` ticks.
async fn main_thread_cpu_ns(pid: u32) -> Option<u64> {
    let task = format!("/proc/{pid}/task/{pid}");
    if let Some(ns) = tokio::fs::read_to_string(format!("{task}/schedstat"))
        .await
        .ok()
        .and_then(|text| straggler::schedstat_cpu_ns(&text))
    {
        return Some(ns);
    }
    tokio::fs::read_to_string(format!("{task}/stat"))
        .await
        .ok()
        .and_then(|stat| straggler::stat_cpu_ns(&stat))
}

/// The store side: this node's figures out, every node's in.
struct Exchange {
    store: Option<SocketAddr>,
    run_id: String,
    node_rank: u32,
    nodes: u32,
    client: Option<Client>,
    seq: u64,
    /// The last `seq` read of each other node: an unchanged one is stale.
    seen: HashMap<u32, u64>,
}

impl Exchange {
    fn new(ctx: &Ctx) -> Self {
        Self {
            // One node has no one to compare with but itself.
            store: ctx.store.filter(|_| ctx.nodes > 1),
            run_id: ctx.run_id.clone(),
            node_rank: ctx.node_rank,
            nodes: ctx.nodes,
            client: None,
            seq: 0,
            seen: HashMap::new(),
        }
    }

    /// This node's `own` figures and every other node's fresh ones.
    async fn figures(&mut self, own: &[Figure]) -> Vec<Figure> {
        self.seq += 1;
        let mut all = own.to_vec();
        if self.store.is_none() {
            return all;
        }
        match self.swap(own).await {
            Ok(values) => {
                for (node, raw) in (0..self.nodes).zip(values) {
                    if node == self.node_rank {
                        continue;
                    }
                    let Some((seq, figures)) = straggler::decode(node, &raw) else {
                        continue;
                    };
                    if self.seen.insert(node, seq) != Some(seq) {
                        all.extend(figures);
                    }
                }
            }
            Err(err) => {
                // The attempt's store goes away with the attempt; a later interval reconnects.
                debug!("straggler watch: store exchange failed: {err}");
                self.client = None;
            }
        }
        all
    }

    async fn swap(&mut self, own: &[Figure]) -> Result<Vec<Vec<u8>>, ClientError> {
        let Some(addr) = self.store else {
            return Ok(Vec::new());
        };
        if self.client.is_none() {
            let mut c = Client::connect(addr, STORE_TIMEOUT).await?;
            c.set_timeout(STORE_TIMEOUT);
            self.client = Some(c);
        }
        let Some(client) = self.client.as_mut() else {
            return Ok(Vec::new());
        };
        client
            .set(
                &key(&self.run_id, self.node_rank),
                &straggler::encode(self.seq, own),
            )
            .await?;
        let keys: Vec<Vec<u8>> = (0..self.nodes).map(|n| key(&self.run_id, n)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        client.multi_get(&refs).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_read_with_thousands_separators() {
        assert_eq!(thousands(1110), "1,110");
        assert_eq!(thousands(980), "980");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn a_throttled_gpu_is_described_with_its_clocks_and_reasons() {
        let g = GpuSample {
            gpu: crate::gpu::watch::GpuId {
                index: 1,
                ..Default::default()
            },
            throttle_reasons: Some(0x8 | 0x1),
            sm_clock_mhz: Some(1110),
            sm_clock_max_mhz: Some(1980),
            utilization_ratio: Some(0.97),
            ..GpuSample::default()
        };
        assert_eq!(
            describe_gpu(&g),
            "GPU 1 clocks 1,110 MHz of 1,980 MHz, throttled: hw_slowdown (97 % busy)"
        );
        assert!(gpu_evidence(std::slice::from_ref(&g), 1).is_some());
        let idle_only = GpuSample {
            throttle_reasons: Some(0x1),
            ..g
        };
        assert!(
            gpu_evidence(&[idle_only], 1).is_none(),
            "gpu_idle is not watched"
        );
    }
}
