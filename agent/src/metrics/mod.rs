//! Prometheus metrics and the Kubernetes probes of one agent, served on port 8000.
//!
//! # Theory of operation
//! [`Metrics`] is a cheap-to-clone handle (one `Arc` inside) over a private
//! [`prometheus::Registry`]. Nothing in the agent calls into it: the observer of [`agent`],
//! started by the composition root ([`crate::app`]), follows the launch loop's phases and events
//! and the typed events of the parts below it ([`crate::events`]) and records them through small,
//! intention-revealing methods (`rendezvous_round_finished`, `worker_exited`, ...); each one is a
//! handful of atomic operations or a lock held for a few instructions, so recording never slows
//! supervision. The metrics come in families, one file per area ([`job`], [`dns`], [`rdzv`],
//! [`workers`], [`signals`], [`checkpoints`], [`preflight`], [`network`], [`cleanup`], [`restarts`], [`snapshots`],
//! [`traffic`], [`probes`]): each defines its collectors, the methods that record them, and the
//! `observe` that the observer's dispatch hands that area's events to. A new metric is a field
//! of its family, a method that records it, and the arm of the family's `observe` that calls
//! the method for its event; [`Metrics::new`] lists the families.
//! Values that depend on the moment of the scrape (how long ago a rank reported its step, how much
//! of the grace budget is left, the current phase as a state set) are kept as raw atomics and
//! turned into metric families only when `/metrics` is gathered, inside the HTTP task ([`live`]).
//! The store hosted by node 0 is observed the same way, through [`StoreStatsSource`] ([`store`]).
//! The training script's own prometheus_client metrics are read from the ranks' multiprocess
//! files at each scrape and served next to muster's, with `rank` labels ([`script`]).
//!
//! [`Endpoint`] ([`http`]) is a small HTTP/1.1 server on tokio: `GET /metrics`, `GET /healthz`
//! (liveness: the agent loop bumped [`Metrics::heartbeat`] recently), `GET /readyz` (readiness:
//! this agent can play its part for the others, [`Readiness`]; never depends on another pod),
//! `GET /gangz` (the gang has formed and local workers run), `POST /checkpoint` (an operator's
//! checkpoint trigger from loopback or with the bearer token ([`auth`]), forwarded to the consumer
//! registered on the endpoint's [`crate::checkpoint::requests::RequestSlot`]). Connections are admitted by [`conns`].
//!
//! # Conventions
//! Every name starts with `muster_`, uses base units (seconds, bytes), and counters end in
//! `_total`. Label values come from closed sets (enums here, `&'static str` reasons and check names
//! from the code, exit codes clamped to 0–255, signal names) or are bounded by the node's hardware
//! (local ranks, GPUs) or by the job's size (the network check's peers, by node rank, at most
//! [`MAX_NETWORK_PEER_SERIES`]), so a pod exports a few hundred series at most. Run ids and host
//! names appear only in `muster_job_info`.

pub mod agent;
mod attached;
pub mod auth;
mod checkpoints;
mod cleanup;
mod conns;
mod dns;
mod gpu;
mod host_loss;
mod http;
mod job;
mod live;
mod network;
mod output;
mod preflight;
mod probes;
mod rdzv;
mod restarts;
pub mod script;
mod signals;
mod snapshots;
mod stacks;
mod store;
mod straggler;
mod traffic;
mod workers;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::core::Collector;
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

pub use auth::{CheckpointToken, TokenError};
pub use checkpoints::{CheckpointOutcome, CheckpointPhase};
pub use http::{
    serve_in_thread, Endpoint, EndpointConfig, ServeError, Serving, METRICS_CONTENT_TYPE,
};
pub use probes::Readiness;
pub use rdzv::RoundOutcome;
pub use script::ScriptMetrics;
pub use snapshots::SnapshotMeter;
pub use stacks::StacksSource;
pub use store::{StoreRole, StoreSnapshot, StoreStatsSource};
pub use workers::WorkerExit;

use attached::Attached;
use live::Live;

pub use crate::checkpoint::requests::CheckpointTrigger;
pub use crate::events::DnsResult;
pub use crate::launch::config::{AddrError, MetricsAddr, DEFAULT_METRICS_ADDR, METRICS_ADDR_ENV};
pub use crate::launch::RestartCause;
/// The wire protocol muster's store speaks, for `muster_build_info`.
pub const STORE_PROTOCOL: &str = "c10d-tcpstore-2.15";

/// Local ranks beyond this are not given their own step series (bounds cardinality; no node runs
/// this many ranks).
pub const MAX_LOCAL_RANKS: u32 = 256;
/// GPUs beyond this index are not exported (an HGX node has 8).
pub const MAX_GPUS: u32 = 64;
/// Distinct GPU check names exported (the pre-flight has about twenty).
pub const MAX_GPU_CHECKS: usize = 64;
/// Measurements between this node and its peers exported per network check (a node makes two
/// in round 1 and a few in round 2).
pub const MAX_NETWORK_PEER_SERIES: usize = 64;

/// What the agent is doing, exported as the state set `muster_agent_phase{phase}`: one series per
/// phase, 1 for the current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Phase {
    /// Resolving the rendezvous endpoint's host name (the pod may wait here for DNS).
    Resolving = 0,
    /// Joining the gang through the store.
    Rendezvous = 1,
    /// GPU health and NVLink checks before ranks start.
    Preflight = 2,
    /// Local workers are running.
    Running = 3,
    /// A checkpoint barrier is in progress (preemption or operator request).
    Checkpointing = 4,
    /// Workers are being stopped (failure, restart, shutdown).
    Stopping = 5,
}

impl Phase {
    /// Every phase, in the order the agent normally moves through them.
    pub const ALL: [Phase; 6] = [
        Phase::Resolving,
        Phase::Rendezvous,
        Phase::Preflight,
        Phase::Running,
        Phase::Checkpointing,
        Phase::Stopping,
    ];

    /// The `phase` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Resolving => "resolving",
            Phase::Rendezvous => "rendezvous",
            Phase::Preflight => "preflight",
            Phase::Running => "running",
            Phase::Checkpointing => "checkpointing",
            Phase::Stopping => "stopping",
        }
    }

    fn from_u8(value: u8) -> Phase {
        Phase::ALL
            .get(usize::from(value))
            .copied()
            .unwrap_or(Phase::Resolving)
    }
}

/// The agent's metrics and probe state. Clone it freely; every clone records into the same
/// registry.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("phase", &self.phase())
            .finish_non_exhaustive()
    }
}

struct Inner {
    registry: Registry,
    /// Every family name defined (see [`Defs`]).
    names: Vec<String>,
    live: Arc<Live>,
    store: Arc<store::StoreCollector>,
    output: Attached<Arc<crate::logs::OutputStats>>,
    gpu: Attached<crate::gpu::watch::Watch>,
    stragglers: Attached<crate::straggler_watch::Board>,
    host_loss: Attached<Arc<rendezvous::rdzv::recovery::HostLossStats>>,
    /// The training script's own metrics, merged into `/metrics` when attached.
    script: OnceLock<Arc<ScriptMetrics>>,
    /// What `GET /debug/stacks` reads, when attached.
    stacks: OnceLock<Arc<dyn StacksSource>>,
    job: job::Job,
    dns: dns::Dns,
    rdzv: rdzv::Rdzv,
    workers: workers::Workers,
    signals: signals::Signals,
    checkpoints: checkpoints::Checkpoints,
    preflight: preflight::Preflight,
    network: network::Network,
    cleanup: cleanup::Cleanup,
    restarts: restarts::Restarts,
    snapshots: snapshots::SnapshotMeter,
    traffic: traffic::Traffic,
    probes: probes::Probes,
}

/// Definitions are compile-time constants; a failure here is a bug that the unit tests catch.
const STATIC_DEFINITION: &str = "static metric definitions are valid";

/// The registry being built, and the name of every family defined in it (a family without
/// samples yet is left out of `gather()`, but a dashboard may still reference it).
struct Defs {
    registry: Registry,
    names: Vec<String>,
}

impl Defs {
    fn add<C: Collector + 'static>(&mut self, collector: C) {
        self.names
            .extend(collector.desc().iter().map(|desc| desc.fq_name.clone()));
        self.registry
            .register(Box::new(collector))
            .expect(STATIC_DEFINITION);
    }

    fn register<C: Collector + Clone + 'static>(&mut self, collector: C) -> C {
        self.add(collector.clone());
        collector
    }

    fn int_gauge(&mut self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::new(name, help).expect(STATIC_DEFINITION))
    }

    fn gauge(&mut self, name: &str, help: &str) -> Gauge {
        self.register(Gauge::new(name, help).expect(STATIC_DEFINITION))
    }

    fn int_gauge_vec(&mut self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.register(IntGaugeVec::new(Opts::new(name, help), labels).expect(STATIC_DEFINITION))
    }

    fn gauge_vec(&mut self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.register(GaugeVec::new(Opts::new(name, help), labels).expect(STATIC_DEFINITION))
    }

    fn counter_vec(&mut self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.register(IntCounterVec::new(Opts::new(name, help), labels).expect(STATIC_DEFINITION))
    }

    fn histogram(&mut self, name: &str, help: &str, buckets: &[f64]) -> Histogram {
        self.register(
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
                .expect(STATIC_DEFINITION),
        )
    }
}

/// Rendezvous and DNS waits range from instant (single node) to the 600 s join timeout.
const WAIT_BUCKETS_SECONDS: [f64; 13] = [
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0,
];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every muster metric defined, the known label sets initialised to 0
    /// (so `rate()` and dashboards see them before the first event), and process metrics.
    pub fn new() -> Self {
        let mut defs = Defs {
            registry: Registry::new(),
            names: Vec::new(),
        };
        let live = Arc::new(Live::new());
        defs.add(live::LiveCollector::new(Arc::clone(&live)));
        let store = Arc::new(store::StoreCollector::new());
        defs.add(store::SharedStoreCollector(Arc::clone(&store)));
        let output = defs.register(output::collector());
        let gpu = defs.register(gpu::collector());
        let stragglers = defs.register(straggler::collector());
        let host_loss = defs.register(host_loss::collector());
        #[cfg(target_os = "linux")]
        defs.add(prometheus::process_collector::ProcessCollector::for_self());
        let inner = Inner {
            job: job::Job::register(&mut defs),
            dns: dns::Dns::register(&mut defs),
            rdzv: rdzv::Rdzv::register(&mut defs, Arc::clone(&live)),
            workers: workers::Workers::register(&mut defs, Arc::clone(&live)),
            signals: signals::Signals::register(&mut defs, Arc::clone(&live)),
            checkpoints: checkpoints::Checkpoints::register(&mut defs, Arc::clone(&live)),
            preflight: preflight::Preflight::register(&mut defs),
            network: network::Network::register(&mut defs),
            cleanup: cleanup::Cleanup::register(&mut defs),
            restarts: restarts::Restarts::register(&mut defs),
            snapshots: snapshots::SnapshotMeter::register(&mut defs),
            traffic: traffic::Traffic::register(&mut defs),
            probes: probes::Probes::register(&mut defs),
            live,
            store,
            output,
            gpu,
            stragglers,
            host_loss,
            script: OnceLock::new(),
            stacks: OnceLock::new(),
            registry: defs.registry,
            names: defs.names,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    // ---- families -----------------------------------------------------------------------------

    /// The job's identity series ([`job`]).
    fn job(&self) -> &job::Job {
        &self.inner.job
    }

    /// Lookups of the rendezvous host ([`dns`]).
    fn dns(&self) -> &dns::Dns {
        &self.inner.dns
    }

    /// Rendezvous rounds and the rank assignment ([`rdzv`]).
    fn rdzv(&self) -> &rdzv::Rdzv {
        &self.inner.rdzv
    }

    /// The local worker group and its restarts ([`workers`]).
    fn workers(&self) -> &workers::Workers {
        &self.inner.workers
    }

    /// Signals received and the grace budget ([`signals`]).
    fn signals(&self) -> &signals::Signals {
        &self.inner.signals
    }

    /// Checkpoint requests and barriers ([`checkpoints`]).
    fn checkpoints(&self) -> &checkpoints::Checkpoints {
        &self.inner.checkpoints
    }

    /// The GPU pre-flight's verdicts ([`preflight`]).
    fn preflight(&self) -> &preflight::Preflight {
        &self.inner.preflight
    }

    /// The gang's network check ([`network`]).
    fn network(&self) -> &network::Network {
        &self.inner.network
    }

    /// What finished attempts left behind ([`cleanup`]).
    fn cleanup(&self) -> &cleanup::Cleanup {
        &self.inner.cleanup
    }

    /// What each restart cost ([`restarts`]).
    fn restarts(&self) -> &restarts::Restarts {
        &self.inner.restarts
    }

    /// The endpoint's own requests and refusals ([`traffic`]).
    fn traffic(&self) -> &traffic::Traffic {
        &self.inner.traffic
    }

    // ---- agent loop and probes ----------------------------------------------------------------

    /// Enters `phase`; `muster_agent_phase{phase}` shows it from the next scrape on. Private:
    /// the observer in [`agent`] is the one writer of the phase.
    fn set_phase(&self, phase: Phase) {
        self.inner.live.set_phase(phase);
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.inner.live.phase()
    }

    /// Proves the agent loop is alive; `/healthz` fails when this is not called for longer than
    /// the endpoint's `stale_after`. Call it on every turn of the supervision loop (at least every
    /// few seconds, also while waiting).
    pub fn heartbeat(&self) {
        self.inner.live.heartbeat();
    }

    /// Time since the last [`heartbeat`](Self::heartbeat) (or since creation).
    pub fn heartbeat_age(&self) -> Duration {
        self.inner.live.heartbeat_age()
    }

    /// `/gangz`: the gang has formed and this node's workers are running (also while they save a
    /// checkpoint).
    pub fn is_gang_running(&self) -> bool {
        matches!(self.phase(), Phase::Running | Phase::Checkpointing)
            && self.workers().workers_running() > 0
    }

    /// `/readyz`'s state.
    pub fn readiness(&self) -> Readiness {
        self.inner.probes.readiness()
    }

    /// Moves readiness forward to `readiness` (never back: a later, lesser state is ignored).
    pub fn advance_readiness(&self, readiness: Readiness) {
        self.inner.probes.advance_readiness(readiness);
    }

    /// Shows the rendezvous's spare list (node 0 fills it) on `/gangz` and `muster_gang_spares`.
    pub fn attach_spare_hosts(&self, spares: rendezvous::rdzv::driver::SpareHosts) {
        self.inner.probes.attach_spare_hosts(spares);
    }

    /// The hosts node 0 answered "spare" in the running generation (empty elsewhere).
    pub fn spare_hosts(&self) -> Vec<String> {
        self.inner.probes.spare_hosts()
    }

    /// `/gangz`'s line about this node's warm standbys, if it has any.
    pub fn standby_line(&self) -> Option<String> {
        self.inner.restarts.standby_line()
    }

    // ---- snapshots ----------------------------------------------------------------------------

    /// The handles the snapshot service updates (`muster_snapshot_*`, [`snapshots`]).
    pub fn snapshot_meter(&self) -> SnapshotMeter {
        self.inner.snapshots.clone()
    }

    /// `/gangz`'s line about the committed snapshot; `None` before the first commit.
    pub fn snapshot_line(&self) -> Option<String> {
        self.inner.snapshots.line()
    }

    // ---- worker output ------------------------------------------------------------------------

    /// Exports what each rank wrote (`muster_worker_output_*`), read from the log pumps'
    /// counters at every scrape.
    pub fn attach_worker_output(&self, stats: Arc<crate::logs::OutputStats>) {
        self.inner.output.attach(stats);
    }

    // ---- GPU and straggler watches ------------------------------------------------------------

    /// Exports the GPU watch's per-GPU readings, NVLink error counters and XID counts
    /// (`muster_gpu_*`), built from its latest look at every scrape.
    pub fn attach_gpu_watch(&self, watch: crate::gpu::watch::Watch) {
        self.inner.gpu.attach(watch);
    }

    /// Exports the straggler watch's ratios and findings (`muster_straggler_*`) and shows its
    /// findings on `/gangz`.
    pub fn attach_stragglers(&self, board: crate::straggler_watch::Board) {
        self.inner.stragglers.attach(board);
    }

    /// The straggler findings standing now, one line each (`/gangz`).
    pub fn straggler_findings(&self) -> Vec<String> {
        self.inner
            .stragglers
            .source()
            .map(|b| {
                b.findings()
                    .iter()
                    .map(|f| format!("slow {}: {}", f.kind, f.what))
                    .collect()
            })
            .unwrap_or_default()
    }

    // ---- stacks -------------------------------------------------------------------------------

    /// Serves the local ranks' stacks on `GET /debug/stacks` (loopback only) from `source`.
    pub fn attach_stacks(&self, source: Arc<dyn StacksSource>) {
        let _ = self.inner.stacks.set(source);
    }

    /// The source of `GET /debug/stacks`, if one is attached.
    pub(crate) fn stacks_source(&self) -> Option<Arc<dyn StacksSource>> {
        self.inner.stacks.get().cloned()
    }

    // ---- store --------------------------------------------------------------------------------

    /// Samples the multi-node rendezvous's record of store-host losses from now on.
    pub fn attach_host_loss(&self, stats: Arc<rendezvous::rdzv::recovery::HostLossStats>) {
        self.inner.host_loss.attach(stats);
    }

    /// Exports the statistics of a store this agent hosts. Replacing the store of a role (a fresh
    /// store per attempt) keeps its counters monotonic.
    pub fn attach_store(&self, role: StoreRole, source: Arc<dyn StoreStatsSource>) {
        self.inner.store.attach(role, source);
    }

    /// The store of `role` stopped; its counters keep their totals, its gauges drop to 0.
    pub fn detach_store(&self, role: StoreRole) {
        self.inner.store.detach(role);
    }

    // ---- exposition ---------------------------------------------------------------------------

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> Vec<u8> {
        self.inner.probes.refresh(self.is_gang_running());
        let mut families = self.inner.registry.gather();
        if let Some(script) = self.inner.script.get() {
            families.extend(script.families());
        }
        let mut out = Vec::with_capacity(16 * 1024);
        // Writing into a Vec cannot fail; the encoder only errors on I/O or invalid families,
        // which gather() does not produce.
        if let Err(err) = TextEncoder::new().encode(&families, &mut out) {
            tracing::warn!("encoding metrics failed: {err}");
        }
        out
    }

    /// Serves the training script's own metrics (see [`script`]) next to muster's from now on;
    /// a second call is ignored.
    pub fn attach_script_metrics(&self, script: Arc<ScriptMetrics>) {
        let _first = self.inner.script.set(script);
    }

    /// Every metric name this registry defines, whether or not it has a sample yet (for checking
    /// dashboards against the code).
    pub fn metric_names(&self) -> Vec<String> {
        let mut names = self.inner.names.clone();
        names.sort();
        names.dedup();
        names
    }
}

/// Seconds since the Unix epoch, as Prometheus timestamps are.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `s` cut to at most `max` bytes, on a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `SIGKILL`-style names; numbers outside the known set become `SIG<n>` (real-time signals), and
/// anything out of range `unknown`, so the label set stays bounded.
pub(crate) fn signal_name(signal: i32) -> String {
    match nix::sys::signal::Signal::try_from(signal) {
        Ok(sig) => sig.as_str().to_owned(),
        Err(_) if (1..=64).contains(&signal) => format!("SIG{signal}"),
        Err(_) => "unknown".to_owned(),
    }
}

#[cfg(test)]
mod tests;
