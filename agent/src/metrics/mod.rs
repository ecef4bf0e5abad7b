//! Prometheus metrics and the Kubernetes probes of one agent, served on port 8000.
//!
//! # Theory of operation
//! [`Metrics`] is a cheap-to-clone handle (one `Arc` inside) over a private
//! [`prometheus::Registry`]. Nothing in the agent calls into it: the observer of [`agent`],
//! started by the composition root ([`crate::app`]), follows the launch loop's phases and events
//! and the typed events of the parts below it ([`crate::events`]) and records them through small,
//! intention-revealing methods (`rendezvous_round_finished`, `worker_exited`, ...); each one is a
//! handful of atomic operations or a lock held for a few instructions, so recording never slows
//! supervision. A new metric is a field defined in [`Metrics::new`], a method that records it,
//! and the line of that observer that calls the method for its event.
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
//! registered with [`Metrics::checkpoint_requests`]). Connections are admitted by [`conns`].
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
mod conns;
mod gpu;
mod host_loss;
mod http;
mod live;
mod output;
pub mod script;
mod stacks;
mod store;
mod straggler;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::core::Collector;
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

pub use auth::{CheckpointToken, TokenError};
pub use http::{
    serve_in_thread, Endpoint, EndpointConfig, ServeError, Serving, METRICS_CONTENT_TYPE,
};
pub use script::ScriptMetrics;
pub use stacks::StacksSource;
pub use store::{StoreRole, StoreSnapshot, StoreStatsSource};

use attached::Attached;
use live::Live;

pub use crate::launch::config::{AddrError, MetricsAddr, DEFAULT_METRICS_ADDR, METRICS_ADDR_ENV};
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
/// Longest `run_id` label value kept; longer ids are cut (the label is informational).
const MAX_RUN_ID_LEN: usize = 128;

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

/// What `/readyz` says: whether this agent can play its part for the others. It only ever moves
/// forward, and it never depends on another pod (issue #23): a pod's readiness gates its DNS
/// record, and the gang needs node 0's record before it can form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Readiness {
    /// Reading the configuration, binding ports, GPU pre-flight.
    Starting = 0,
    /// Node 0: everything else is set up, its rendezvous store is not accepting connections yet.
    HostingStore = 1,
    /// Ready, and stays so until the process exits (restarts, checkpoint barrier, draining).
    Ready = 2,
}

impl Readiness {
    fn from_u8(value: u8) -> Readiness {
        match value {
            0 => Readiness::Starting,
            1 => Readiness::HostingStore,
            _ => Readiness::Ready,
        }
    }
}

pub use crate::events::DnsResult;
pub use crate::launch::RestartCause;
use crate::netcheck::summary::Summary;

const DNS_RESULTS: [DnsResult; 4] = [
    DnsResult::Ok,
    DnsResult::NxDomain,
    DnsResult::Timeout,
    DnsResult::Error,
];

/// The `result` label of a lookup of the rendezvous host.
fn dns_result_label(result: DnsResult) -> &'static str {
    match result {
        DnsResult::Ok => "ok",
        DnsResult::NxDomain => "nxdomain",
        DnsResult::Timeout => "timeout",
        DnsResult::Error => "error",
    }
}

/// The `result` label of `muster_network_checks_total`.
const NETWORK_CHECK_RESULTS: [&str; 4] = ["clean", "finding", "inconclusive", "no_verdict"];
/// The labels of a measurement between this node and a peer; node ranks are bounded by
/// `--nnodes`, and a check exports at most [`MAX_NETWORK_PEER_SERIES`] of them.
const NETWORK_PEER_LABELS: &[&str] = &["peer_node_rank", "direction", "round"];

/// How a rendezvous round ended (`outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundOutcome {
    /// The gang formed.
    Completed,
    /// The join deadline passed with nodes missing.
    Timeout,
    /// The round failed for another reason (store lost, unhealthy peer, protocol error).
    Failed,
    /// The agent was asked to stop while waiting.
    Cancelled,
}

impl RoundOutcome {
    const ALL: [RoundOutcome; 4] = [
        RoundOutcome::Completed,
        RoundOutcome::Timeout,
        RoundOutcome::Failed,
        RoundOutcome::Cancelled,
    ];

    fn as_str(self) -> &'static str {
        match self {
            RoundOutcome::Completed => "completed",
            RoundOutcome::Timeout => "timeout",
            RoundOutcome::Failed => "failed",
            RoundOutcome::Cancelled => "cancelled",
        }
    }
}

const RESTART_CAUSES: [RestartCause; 4] = [
    RestartCause::WorkerFailure,
    RestartCause::PeerFailure,
    RestartCause::MembershipChange,
    RestartCause::Hang,
];

/// The `cause` label of `muster_restarts_total`.
fn restart_cause_label(cause: RestartCause) -> &'static str {
    match cause {
        RestartCause::WorkerFailure => "worker_failure",
        RestartCause::PeerFailure => "peer_failure",
        RestartCause::MembershipChange => "membership_change",
        RestartCause::Hang => "hang",
    }
}

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// It exited with this status (clamped to 0–255 for the label).
    Code(i32),
    /// It was killed by this signal number.
    Signal(i32),
}

impl WorkerExit {
    /// `(code, signal)` label values: the shell's exit code (128+N for a signal, the same number
    /// the agent's own exit code uses) and the signal's name, or `none`.
    fn labels(self) -> (String, String) {
        match self {
            WorkerExit::Code(code) => (code.clamp(0, 255).to_string(), "none".to_owned()),
            WorkerExit::Signal(signal) => (
                crate::exit_code::for_signal(signal).to_string(),
                signal_name(signal),
            ),
        }
    }
}

/// What started a checkpoint request (`trigger` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointTrigger {
    /// SIGTERM (or another signal configured with the checkpoint action) on this node.
    Signal,
    /// `POST /checkpoint` on this agent's endpoint.
    Http,
    /// Another node's request, seen through the store.
    Peer,
}

impl CheckpointTrigger {
    const ALL: [CheckpointTrigger; 3] = [
        CheckpointTrigger::Signal,
        CheckpointTrigger::Http,
        CheckpointTrigger::Peer,
    ];

    fn as_str(self) -> &'static str {
        match self {
            CheckpointTrigger::Signal => "signal",
            CheckpointTrigger::Http => "http",
            CheckpointTrigger::Peer => "peer",
        }
    }
}

/// Where a checkpoint barrier stands, exported as the state set `muster_checkpoint_phase{phase}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CheckpointPhase {
    /// No checkpoint in progress.
    Idle = 0,
    /// The agents are agreeing on the step every rank can still reach.
    Agreeing = 1,
    /// Ranks were told the step and are saving.
    Saving = 2,
    /// Every local rank saved; waiting for the gang-wide commit.
    Committing = 3,
}

impl CheckpointPhase {
    const ALL: [CheckpointPhase; 4] = [
        CheckpointPhase::Idle,
        CheckpointPhase::Agreeing,
        CheckpointPhase::Saving,
        CheckpointPhase::Committing,
    ];

    fn as_str(self) -> &'static str {
        match self {
            CheckpointPhase::Idle => "idle",
            CheckpointPhase::Agreeing => "agreeing",
            CheckpointPhase::Saving => "saving",
            CheckpointPhase::Committing => "committing",
        }
    }

    fn from_u8(value: u8) -> CheckpointPhase {
        CheckpointPhase::ALL
            .get(usize::from(value))
            .copied()
            .unwrap_or(CheckpointPhase::Idle)
    }
}

/// How a checkpoint barrier ended (`outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointOutcome {
    /// Every rank saved and the commit key was written.
    Committed,
    /// The deadline passed or a rank died while saving; the previous checkpoint stays current.
    Aborted,
}

impl CheckpointOutcome {
    const ALL: [CheckpointOutcome; 2] = [CheckpointOutcome::Committed, CheckpointOutcome::Aborted];

    fn as_str(self) -> &'static str {
        match self {
            CheckpointOutcome::Committed => "committed",
            CheckpointOutcome::Aborted => "aborted",
        }
    }
}

/// A checkpoint request delivered to the consumer registered with
/// [`Metrics::checkpoint_requests`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointRequest {
    pub trigger: CheckpointTrigger,
    /// When the request arrived.
    pub received: Instant,
}

/// What an attempt to deliver a checkpoint request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointDelivery {
    /// The consumer has it.
    Delivered,
    /// A request is already queued and not yet taken; duplicates join it.
    AlreadyPending,
    /// Nobody consumes requests (no barrier in this agent, or it went away).
    NoConsumer,
}

/// The receiving end of operator checkpoint requests; owned by the preemption work. Dropping it
/// makes `POST /checkpoint` answer 503 again.
#[derive(Debug)]
pub struct CheckpointRequests {
    rx: mpsc::Receiver<CheckpointRequest>,
}

impl CheckpointRequests {
    /// The next request; `None` only if the registry was dropped.
    pub async fn recv(&mut self) -> Option<CheckpointRequest> {
        self.rx.recv().await
    }

    /// A request if one is queued, without waiting.
    pub fn try_recv(&mut self) -> Option<CheckpointRequest> {
        self.rx.try_recv().ok()
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
    checkpoint_tx: Mutex<Option<mpsc::Sender<CheckpointRequest>>>,
    readiness: AtomicU8,
    /// The training script's own metrics, merged into `/metrics` when attached.
    script: OnceLock<Arc<ScriptMetrics>>,
    /// What `GET /debug/stacks` reads, when attached.
    stacks: OnceLock<Arc<dyn StacksSource>>,

    job_info: IntGaugeVec,
    dns_attempts: IntCounterVec,
    dns_duration: Histogram,
    rdzv_rounds: IntCounterVec,
    rdzv_duration: Histogram,
    rdzv_last_timestamp: Gauge,
    nodes_expected: IntGauge,
    nodes_joined: IntGauge,
    nodes_waiting: IntGauge,
    node_rank: IntGauge,
    group_world_size: IntGauge,
    world_size: IntGauge,
    local_world_size: IntGauge,
    workers_running: IntGauge,
    worker_group_starts: Gauge,
    worker_exits: IntCounterVec,
    restarts: IntCounterVec,
    restarts_remaining: IntGauge,
    gang_root_cause: IntGaugeVec,
    signals: IntCounterVec,
    checkpoint_requests: IntCounterVec,
    checkpoints: IntCounterVec,
    checkpoint_duration: HistogramVec,
    last_checkpoint_step: IntGauge,
    last_checkpoint_timestamp: Gauge,
    gpu_check: IntGaugeVec,
    /// The check names seen so far (bounds the `check` label).
    gpu_check_names: Mutex<Vec<String>>,
    gpu_nvlink_links: IntGaugeVec,
    gpu_preflight_healthy: IntGauge,
    gpu_preflight_duration: Gauge,
    network_checks: IntCounterVec,
    network_check_duration: Gauge,
    network_check_findings: IntGaugeVec,
    network_check_named: IntGauge,
    network_peer_rtt: GaugeVec,
    network_peer_throughput: GaugeVec,
    network_peer_slow: IntGaugeVec,
    /// Leftover processes of finished attempts stopped, by the signal that ended them.
    strays_stopped: IntCounterVec,
    oom_kills: IntCounterVec,
    gpu_release_wait: HistogramVec,
    http_requests: IntCounterVec,
    http_shed: IntCounterVec,
    checkpoint_rejected: IntCounterVec,
    agent_ready: IntGauge,
    gang_running: IntGauge,
    gang_spares: IntGauge,
    /// Node 0's list of the spares' hosts (`muster_gang_spares`, `/gangz`).
    spares: OnceLock<rendezvous::rdzv::driver::SpareHosts>,
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
/// A checkpoint barrier must fit in a grace period (30 s by default on Kubernetes, minutes at most).
const CHECKPOINT_BUCKETS_SECONDS: [f64; 10] =
    [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0];

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

        let build_info = defs.int_gauge_vec(
            "muster_build_info",
            "muster build: version and the store wire protocol it speaks (always 1).",
            &["version", "protocol"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), STORE_PROTOCOL])
            .set(1);
        let start_time = defs.gauge("muster_start_time_seconds", "Unix time the agent started.");
        start_time.set(unix_now());

        let inner = Inner {
            job_info: defs.int_gauge_vec(
                "muster_job_info",
                "The job this agent belongs to (always 1; run_id lives only here).",
                &["run_id"],
            ),
            dns_attempts: defs.counter_vec(
                "muster_dns_resolution_attempts_total",
                "Lookups of the rendezvous endpoint's host, by result.",
                &["result"],
            ),
            dns_duration: defs.histogram(
                "muster_dns_resolution_duration_seconds",
                "Time from the first lookup of the rendezvous host until it resolved or the deadline.",
                &WAIT_BUCKETS_SECONDS,
            ),
            rdzv_rounds: defs.counter_vec(
                "muster_rendezvous_rounds_total",
                "Rendezvous rounds this agent took part in, by outcome.",
                &["outcome"],
            ),
            rdzv_duration: defs.histogram(
                "muster_rendezvous_duration_seconds",
                "Time from joining a rendezvous round until it ended.",
                &WAIT_BUCKETS_SECONDS,
            ),
            rdzv_last_timestamp: defs.gauge(
                "muster_rendezvous_last_round_timestamp_seconds",
                "Unix time the last rendezvous round ended (0: none yet).",
            ),
            nodes_expected: defs.int_gauge(
                "muster_rendezvous_nodes_expected",
                "Nodes the current rendezvous waits for (the maximum of --nnodes).",
            ),
            nodes_joined: defs.int_gauge(
                "muster_rendezvous_nodes_joined",
                "Nodes that joined the current rendezvous round.",
            ),
            nodes_waiting: defs.int_gauge(
                "muster_rendezvous_nodes_waiting",
                "Nodes still missing from the current rendezvous round.",
            ),
            node_rank: defs.int_gauge( "muster_node_rank", "This node's rank in the gang."),
            group_world_size: defs.int_gauge(
                "muster_group_world_size",
                "Nodes in the current gang.",
            ),
            world_size: defs.int_gauge(
                "muster_world_size",
                "Worker processes (ranks) in the current gang, on all nodes.",
            ),
            local_world_size: defs.int_gauge(
                "muster_local_world_size",
                "Worker processes this node starts per attempt.",
            ),
            workers_running: defs.int_gauge(
                "muster_local_workers_running",
                "Local worker processes currently alive.",
            ),
            worker_group_starts: defs.gauge(
                "muster_worker_group_start_timestamp_seconds",
                "Unix time the current local worker group was started (0: never).",
            ),
            worker_exits: defs.counter_vec(
                "muster_worker_exits_total",
                "Local worker exits, by exit code (128+N for signal N) and signal name (none).",
                &["code", "signal"],
            ),
            restarts: defs.counter_vec(
                "muster_restarts_total",
                "Restarts of the local worker group, by cause.",
                &["cause"],
            ),
            restarts_remaining: defs.int_gauge(
                "muster_restarts_remaining",
                "Restarts left in the --max-restarts budget.",
            ),
            gang_root_cause: defs.int_gauge_vec(
                "muster_gang_root_cause_info",
                "The gang's first failure of the last failed attempt, on whichever node it was (always 1; one series).",
                &["node_rank", "host", "rank", "local_rank", "exit_code"],
            ),
            signals: defs.counter_vec(
                "muster_signals_received_total",
                "Signals the agent received, by name.",
                &["signal"],
            ),
            checkpoint_requests: defs.counter_vec(
                "muster_checkpoint_requests_total",
                "Checkpoint requests received, by trigger.",
                &["trigger"],
            ),
            checkpoints: defs.counter_vec(
                "muster_checkpoints_total",
                "Checkpoint barriers finished, by outcome.",
                &["outcome"],
            ),
            checkpoint_duration: defs.register(
                HistogramVec::new(
                    HistogramOpts::new(
                        "muster_checkpoint_duration_seconds",
                        "Time from a checkpoint request to the commit or abort, by outcome.",
                    )
                    .buckets(CHECKPOINT_BUCKETS_SECONDS.to_vec()),
                    &["outcome"],
                )
                .expect(STATIC_DEFINITION),
            ),
            last_checkpoint_step: defs.int_gauge(
                "muster_last_checkpoint_step",
                "Training step of the last committed checkpoint (0: none).",
            ),
            last_checkpoint_timestamp: defs.gauge(
                "muster_last_checkpoint_timestamp_seconds",
                "Unix time of the last committed checkpoint (0: none).",
            ),
            gpu_check: defs.int_gauge_vec(
                "muster_gpu_check_healthy",
                "GPU pre-flight result per check and GPU (1 pass or warn, 0 fail).",
                &["gpu", "UUID", "check"],
            ),
            gpu_check_names: Mutex::new(Vec::new()),
            gpu_nvlink_links: defs.int_gauge_vec(
                "muster_gpu_nvlink_active_links",
                "NVLink links up per GPU, from NVML.",
                &["gpu", "UUID"],
            ),
            gpu_preflight_healthy: defs.int_gauge(
                "muster_gpu_preflight_healthy",
                "This node's GPU pre-flight verdict (1 healthy, 0 unhealthy; 1 when not run).",
            ),
            gpu_preflight_duration: defs.gauge(
                "muster_gpu_preflight_duration_seconds",
                "How long the last GPU pre-flight took.",
            ),
            network_checks: defs.counter_vec(
                "muster_network_checks_total",
                "Gang network checks (--network-check) ended on this node, by result (clean, finding, inconclusive, no_verdict).",
                &["result"],
            ),
            network_check_duration: defs.gauge(
                "muster_network_check_duration_seconds",
                "How long the last gang network check took on this node.",
            ),
            network_check_findings: defs.int_gauge_vec(
                "muster_network_check_findings",
                "Slow nodes and links the last gang network check named, by kind (node, link).",
                &["kind"],
            ),
            network_check_named: defs.int_gauge(
                "muster_network_check_named",
                "1 when the last gang network check named this node (a slow node, or one end of a slow link).",
            ),
            network_peer_rtt: defs.gauge_vec(
                "muster_network_peer_rtt_seconds",
                "Shortest round-trip time of the last network check's measurement with a peer, by peer node rank, direction (out: this node measured; in: the peer did) and round.",
                NETWORK_PEER_LABELS,
            ),
            network_peer_throughput: defs.gauge_vec(
                "muster_network_peer_throughput_bytes_per_second",
                "Throughput of the last network check's stream with a peer (0: failed), by peer node rank, direction and round.",
                NETWORK_PEER_LABELS,
            ),
            network_peer_slow: defs.int_gauge_vec(
                "muster_network_peer_slow",
                "The last network check's verdict on a measurement with a peer (1 slow or failed, 0 ok), by peer node rank, direction and round.",
                NETWORK_PEER_LABELS,
            ),
            strays_stopped: defs.counter_vec(
                "muster_stray_processes_stopped_total",
                "Processes a finished attempt's workers left behind, stopped with the attempt, by signal.",
                &["signal"],
            ),
            oom_kills: defs.counter_vec(
                "muster_worker_oom_kills_total",
                "Workers killed by the kernel OOM killer (SIGKILL while the container's memory cgroup counted an OOM kill).",
                &[],
            ),
            gpu_release_wait: defs.register(
                HistogramVec::new(
                    HistogramOpts::new(
                        "muster_gpu_release_wait_seconds",
                        "Waits before a restart for the previous attempt's GPU processes and memory to go, by outcome.",
                    )
                    .buckets(WAIT_BUCKETS_SECONDS.to_vec()),
                    &["outcome"],
                )
                .expect(STATIC_DEFINITION),
            ),
            http_requests: defs.counter_vec(
                "muster_http_requests_total",
                "Requests served by the metrics endpoint, by handler and status code.",
                &["handler", "code"],
            ),
            http_shed: defs.counter_vec(
                "muster_http_connections_shed_total",
                "Connections the metrics endpoint closed to stay within its limits (the oldest idle one of the address at its limit, or a new one when none was idle), by limit (peer, total).",
                &["limit"],
            ),
            checkpoint_rejected: defs.counter_vec(
                "muster_checkpoint_requests_rejected_total",
                "POST /checkpoint requests refused: forbidden (not loopback, no token configured) or unauthorized (missing or wrong bearer token).",
                &["reason"],
            ),
            agent_ready: defs.int_gauge(
                "muster_agent_ready",
                "1 when /readyz answers 200: this agent can play its part for the others (independent of peers).",
            ),
            gang_running: defs.int_gauge(
                "muster_gang_running",
                "1 when /gangz answers 200: the gang has formed and this node's workers are running.",
            ),
            gang_spares: defs.int_gauge(
                "muster_gang_spares",
                "Nodes waiting as spares in the running generation (beyond --nnodes MAX or a --node-unit multiple), as node 0 answered them; 0 on other nodes.",
            ),
            spares: OnceLock::new(),
            live,
            store,
            output,
            gpu,
            stragglers,
            host_loss,
            checkpoint_tx: Mutex::new(None),
            readiness: AtomicU8::new(Readiness::Starting as u8),
            script: OnceLock::new(),
            stacks: OnceLock::new(),
            registry: defs.registry,
            names: defs.names,
        };
        for result in DNS_RESULTS {
            inner
                .dns_attempts
                .with_label_values(&[dns_result_label(result)]);
        }
        for outcome in RoundOutcome::ALL {
            inner.rdzv_rounds.with_label_values(&[outcome.as_str()]);
        }
        for cause in RESTART_CAUSES {
            inner
                .restarts
                .with_label_values(&[restart_cause_label(cause)]);
        }
        for trigger in CheckpointTrigger::ALL {
            inner
                .checkpoint_requests
                .with_label_values(&[trigger.as_str()]);
        }
        for limit in conns::Shed::ALL {
            inner.http_shed.with_label_values(&[limit.as_str()]);
        }
        for reason in auth::Rejected::ALL {
            inner
                .checkpoint_rejected
                .with_label_values(&[reason.as_str()]);
        }
        for outcome in CheckpointOutcome::ALL {
            inner.checkpoints.with_label_values(&[outcome.as_str()]);
            inner
                .checkpoint_duration
                .with_label_values(&[outcome.as_str()]);
        }
        for result in NETWORK_CHECK_RESULTS {
            inner.network_checks.with_label_values(&[result]);
        }
        for kind in ["node", "link"] {
            inner.network_check_findings.with_label_values(&[kind]);
        }
        for signal in ["SIGTERM", "SIGKILL"] {
            inner.strays_stopped.with_label_values(&[signal]);
        }
        // Zero from the start, so a rate() sees the first kill.
        inner.oom_kills.with_label_values::<&str>(&[]);
        for outcome in ["released", "timeout"] {
            inner.gpu_release_wait.with_label_values(&[outcome]);
        }
        inner.gpu_preflight_healthy.set(1);
        Self {
            inner: Arc::new(inner),
        }
    }

    // ---- agent loop -------------------------------------------------------------------------

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
            && self.inner.workers_running.get() > 0
    }

    /// `/readyz`'s state.
    pub fn readiness(&self) -> Readiness {
        Readiness::from_u8(self.inner.readiness.load(Ordering::Relaxed))
    }

    /// Moves readiness forward to `readiness` (never back: a later, lesser state is ignored).
    pub fn advance_readiness(&self, readiness: Readiness) {
        self.inner
            .readiness
            .fetch_max(readiness as u8, Ordering::Relaxed);
    }

    /// Records the job's run id (kept out of every other series).
    pub fn set_run_id(&self, run_id: &str) {
        let run_id = truncate(run_id, MAX_RUN_ID_LEN);
        self.inner.job_info.reset();
        self.inner.job_info.with_label_values(&[run_id]).set(1);
    }

    /// Counts a signal the agent received.
    pub fn signal_received(&self, signal: i32) {
        self.inner
            .signals
            .with_label_values(&[&signal_name(signal)])
            .inc();
    }

    // ---- discovery and rendezvous -------------------------------------------------------------

    /// One lookup of the rendezvous host finished.
    pub fn dns_attempt(&self, result: DnsResult) {
        self.inner
            .dns_attempts
            .with_label_values(&[dns_result_label(result)])
            .inc();
    }

    /// The rendezvous host resolved (or the deadline passed) `elapsed` after the first lookup.
    pub fn dns_resolution_finished(&self, elapsed: Duration) {
        self.inner.dns_duration.observe(elapsed.as_secs_f64());
    }

    /// Progress of the current round: nodes expected, joined so far, still missing.
    pub fn rendezvous_nodes(&self, expected: u32, joined: u32) {
        self.inner.nodes_expected.set(i64::from(expected));
        self.inner.nodes_joined.set(i64::from(joined));
        self.inner
            .nodes_waiting
            .set(i64::from(expected.saturating_sub(joined)));
    }

    /// Nodes that joined the current (or last) round.
    pub fn nodes_joined(&self) -> u32 {
        u32::try_from(self.inner.nodes_joined.get()).unwrap_or(0)
    }

    /// A rendezvous round ended. `reason` is a short fixed phrase from the deciding code
    /// (`all_joined`, `min_nodes_after_last_call`, `join_timeout`, ...); being `'static` keeps the
    /// label set bounded.
    pub fn rendezvous_round_finished(
        &self,
        outcome: RoundOutcome,
        reason: &'static str,
        elapsed: Duration,
    ) {
        self.inner
            .rdzv_rounds
            .with_label_values(&[outcome.as_str()])
            .inc();
        self.inner.rdzv_duration.observe(elapsed.as_secs_f64());
        self.inner.rdzv_last_timestamp.set(unix_now());
        self.inner.live.set_last_round(outcome, reason);
    }

    /// The rank assignment of the current attempt.
    pub fn set_assignment(
        &self,
        node_rank: u32,
        group_world_size: u32,
        world_size: u32,
        local_world_size: u32,
    ) {
        self.inner.node_rank.set(i64::from(node_rank));
        self.inner.group_world_size.set(i64::from(group_world_size));
        self.inner.world_size.set(i64::from(world_size));
        self.inner.local_world_size.set(i64::from(local_world_size));
    }

    // ---- GPU pre-flight -----------------------------------------------------------------------

    /// One pre-flight check's verdict on one GPU, or on the whole node (`gpu` `None`: exported as
    /// `gpu="node"`). `healthy` is false only for a failing check; warnings count as healthy, as
    /// they do for the gang. `check` is one of the pre-flight's fixed check names, and at most
    /// [`MAX_GPU_CHECKS`] distinct names are kept.
    pub fn gpu_check(&self, gpu: Option<u32>, uuid: &str, check: &str, healthy: bool) {
        let gpu = match gpu {
            Some(index) if index >= MAX_GPUS => return,
            Some(index) => index.to_string(),
            None => "node".to_owned(),
        };
        {
            let mut names = self
                .inner
                .gpu_check_names
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !names.iter().any(|n| n == check) {
                if names.len() >= MAX_GPU_CHECKS {
                    return;
                }
                names.push(check.to_owned());
            }
        }
        self.inner
            .gpu_check
            .with_label_values(&[gpu.as_str(), uuid, check])
            .set(i64::from(healthy));
    }

    /// NVLink links up on one GPU.
    pub fn gpu_nvlink_active_links(&self, gpu: u32, uuid: &str, links: u32) {
        if gpu >= MAX_GPUS {
            return;
        }
        self.inner
            .gpu_nvlink_links
            .with_label_values(&[&gpu.to_string(), uuid])
            .set(i64::from(links));
    }

    /// The node's pre-flight verdict and how long the checks took.
    pub fn gpu_preflight_finished(&self, healthy: bool, elapsed: Duration) {
        self.inner.gpu_preflight_healthy.set(i64::from(healthy));
        self.inner.gpu_preflight_duration.set(elapsed.as_secs_f64());
    }

    // ---- gang network check -----------------------------------------------------------------

    /// The gang's network check ended with node 0's verdict: this node's measurements with its
    /// peers (replacing the previous check's, whose peers may have left), what the verdict named
    /// and how long the check took here. At most [`MAX_NETWORK_PEER_SERIES`] measurements.
    pub fn network_check_judged(&self, summary: &Summary, elapsed: Duration) {
        let inner = &self.inner;
        let findings = summary.node_findings + summary.link_findings;
        inner
            .network_checks
            .with_label_values(&[match (summary.inconclusive, findings) {
                (true, _) => "inconclusive",
                (false, 0) => "clean",
                (false, _) => "finding",
            }])
            .inc();
        inner.network_check_duration.set(elapsed.as_secs_f64());
        inner
            .network_check_findings
            .with_label_values(&["node"])
            .set(i64::from(summary.node_findings));
        inner
            .network_check_findings
            .with_label_values(&["link"])
            .set(i64::from(summary.link_findings));
        inner.network_check_named.set(i64::from(summary.named));
        self.clear_network_peers();
        for peer in summary.peers.iter().take(MAX_NETWORK_PEER_SERIES) {
            let rank = peer.peer_node_rank.to_string();
            let round = peer.round.to_string();
            let labels = [rank.as_str(), peer.direction.as_str(), round.as_str()];
            if let Some(rtt) = peer.rtt {
                inner
                    .network_peer_rtt
                    .with_label_values(&labels)
                    .set(rtt.as_secs_f64());
            }
            inner
                .network_peer_throughput
                .with_label_values(&labels)
                .set(peer.bytes_per_second);
            inner
                .network_peer_slow
                .with_label_values(&labels)
                .set(i64::from(peer.slow));
        }
    }

    /// The gang's network check ended on this node without a verdict (node 0 did not answer in
    /// time): counted, timed; the previous check's measurements are no longer this round's.
    pub fn network_check_without_verdict(&self, elapsed: Duration) {
        let inner = &self.inner;
        inner
            .network_checks
            .with_label_values(&["no_verdict"])
            .inc();
        inner.network_check_duration.set(elapsed.as_secs_f64());
        inner.network_check_named.set(0);
        for kind in ["node", "link"] {
            inner
                .network_check_findings
                .with_label_values(&[kind])
                .set(0);
        }
        self.clear_network_peers();
    }

    /// Drops the previous network check's per-peer series (its peers may have left the gang).
    fn clear_network_peers(&self) {
        self.inner.network_peer_rtt.reset();
        self.inner.network_peer_throughput.reset();
        self.inner.network_peer_slow.reset();
    }

    /// An attempt's leftover processes were stopped: `count` of them, `killed` with SIGKILL.
    pub fn strays_stopped(&self, count: u32, killed: u32) {
        let killed = killed.min(count);
        let c = &self.inner.strays_stopped;
        c.with_label_values(&["SIGTERM"])
            .inc_by(u64::from(count - killed));
        c.with_label_values(&["SIGKILL"]).inc_by(u64::from(killed));
    }

    /// A worker was killed by the kernel OOM killer.
    pub fn worker_oom_killed(&self) {
        self.inner.oom_kills.with_label_values::<&str>(&[]).inc();
    }

    /// A restart waited `waited` for the GPUs; `released`: false when it gave up (exit 204).
    pub fn gpu_release_waited(&self, waited: Duration, released: bool) {
        let outcome = if released { "released" } else { "timeout" };
        self.inner
            .gpu_release_wait
            .with_label_values(&[outcome])
            .observe(waited.as_secs_f64());
    }

    // ---- workers ------------------------------------------------------------------------------

    /// A local worker group of `count` processes started; forgets the previous attempt's steps.
    pub fn workers_started(&self, count: u32) {
        self.inner.workers_running.set(i64::from(count));
        self.inner.worker_group_starts.set(unix_now());
        self.inner.live.clear_steps();
    }

    /// One more local worker of the current group started.
    pub fn worker_started(&self) {
        self.inner.workers_running.inc();
    }

    /// One local worker ended.
    pub fn worker_exited(&self, exit: WorkerExit) {
        let (code, signal) = exit.labels();
        self.inner
            .worker_exits
            .with_label_values(&[&code, &signal])
            .inc();
        let running = &self.inner.workers_running;
        // Saturating: an exit reported after `workers_stopped` must not go negative.
        if running.get() > 0 {
            running.dec();
        }
    }

    /// The whole local group is gone (after a stop), whatever was reported per worker.
    pub fn workers_stopped(&self) {
        self.inner.workers_running.set(0);
    }

    /// Local workers currently alive, as last reported.
    pub fn workers_running(&self) -> u32 {
        u32::try_from(self.inner.workers_running.get()).unwrap_or(0)
    }

    /// The local group is being restarted.
    pub fn restarted(&self, cause: RestartCause) {
        self.inner
            .restarts
            .with_label_values(&[restart_cause_label(cause)])
            .inc();
    }

    /// The gang's root cause of the last failed attempt: the one series of
    /// `muster_gang_root_cause_info`.
    pub fn set_gang_root_cause(&self, root: &crate::launch::gang_cause::PostedFailure) {
        let family = &self.inner.gang_root_cause;
        family.reset();
        family
            .with_label_values(&[
                root.node_rank.to_string().as_str(),
                truncate(&root.host, 63),
                root.rank.to_string().as_str(),
                root.local_rank.to_string().as_str(),
                root.exit_code.to_string().as_str(),
            ])
            .set(1);
    }

    /// Restarts left in the budget.
    pub fn set_restarts_remaining(&self, remaining: u32) {
        self.inner.restarts_remaining.set(i64::from(remaining));
    }

    /// A local rank reported that it reached `step`.
    pub fn worker_step(&self, local_rank: u32, step: u64) {
        if local_rank < MAX_LOCAL_RANKS {
            self.inner.live.worker_step(local_rank, step);
        }
    }

    // ---- checkpoints and shutdown -------------------------------------------------------------

    /// Registers the consumer of operator checkpoint requests (the preemption barrier). A later
    /// call replaces the earlier consumer. Until one is registered, or after it is dropped,
    /// `POST /checkpoint` answers 503.
    pub fn checkpoint_requests(&self) -> CheckpointRequests {
        // One slot: duplicate requests join the pending one instead of queueing up.
        let (tx, rx) = mpsc::channel(1);
        *self
            .inner
            .checkpoint_tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(tx);
        CheckpointRequests { rx }
    }

    /// Delivers a checkpoint request to the registered consumer and counts it.
    pub fn request_checkpoint(&self, trigger: CheckpointTrigger) -> CheckpointDelivery {
        let slot = self
            .inner
            .checkpoint_tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(tx) = slot.as_ref() else {
            return CheckpointDelivery::NoConsumer;
        };
        let request = CheckpointRequest {
            trigger,
            received: Instant::now(),
        };
        let delivery = match tx.try_send(request) {
            Ok(()) => CheckpointDelivery::Delivered,
            Err(mpsc::error::TrySendError::Full(_)) => CheckpointDelivery::AlreadyPending,
            Err(mpsc::error::TrySendError::Closed(_)) => return CheckpointDelivery::NoConsumer,
        };
        drop(slot);
        self.checkpoint_requested(trigger);
        delivery
    }

    /// Counts a checkpoint request received by other means (a signal, a peer through the store).
    pub fn checkpoint_requested(&self, trigger: CheckpointTrigger) {
        self.inner
            .checkpoint_requests
            .with_label_values(&[trigger.as_str()])
            .inc();
    }

    /// The barrier moved to `phase`.
    pub fn set_checkpoint_phase(&self, phase: CheckpointPhase) {
        self.inner.live.set_checkpoint_phase(phase);
    }

    /// The barrier ended `elapsed` after its request; `step` is the committed step.
    pub fn checkpoint_finished(
        &self,
        outcome: CheckpointOutcome,
        elapsed: Duration,
        step: Option<u64>,
    ) {
        self.inner
            .checkpoints
            .with_label_values(&[outcome.as_str()])
            .inc();
        self.inner
            .checkpoint_duration
            .with_label_values(&[outcome.as_str()])
            .observe(elapsed.as_secs_f64());
        if outcome == CheckpointOutcome::Committed {
            if let Some(step) = step {
                self.inner
                    .last_checkpoint_step
                    .set(i64::try_from(step).unwrap_or(i64::MAX));
            }
            self.inner.last_checkpoint_timestamp.set(unix_now());
        }
        self.inner.live.set_checkpoint_phase(CheckpointPhase::Idle);
    }

    /// The full grace budget (what `muster_grace_remaining_seconds` shows while no shutdown runs).
    pub fn set_grace_period(&self, budget: Duration) {
        self.inner.live.set_grace_period(budget);
    }

    /// A shutdown started that must finish by `deadline`; the remaining budget counts down.
    pub fn grace_deadline(&self, deadline: Instant) {
        self.inner.live.set_grace_deadline(Some(deadline));
    }

    // ---- worker output ------------------------------------------------------------------------

    /// Exports what each rank wrote (`muster_worker_output_*`), read from the log pumps'
    /// counters at every scrape.
    pub fn attach_worker_output(&self, stats: Arc<crate::logs::OutputStats>) {
        self.inner.output.attach(stats);
    }

    // ---- GPU watch ----------------------------------------------------------------------------

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
        self.inner
            .agent_ready
            .set(i64::from(self.readiness() == Readiness::Ready));
        self.inner
            .gang_running
            .set(i64::from(self.is_gang_running()));
        self.inner
            .gang_spares
            .set(i64::try_from(self.spare_hosts().len()).unwrap_or(i64::MAX));
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
    /// Shows the rendezvous's spare list (node 0 fills it) on `/gangz` and `muster_gang_spares`.
    pub fn attach_spare_hosts(&self, spares: rendezvous::rdzv::driver::SpareHosts) {
        let _first = self.inner.spares.set(spares);
    }

    /// The hosts node 0 answered "spare" in the running generation (empty elsewhere).
    pub fn spare_hosts(&self) -> Vec<String> {
        self.inner
            .spares
            .get()
            .and_then(|list| list.lock().ok().map(|l| l.clone()))
            .unwrap_or_default()
    }

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

    fn count_http_shed(&self, limit: conns::Shed) {
        self.inner
            .http_shed
            .with_label_values(&[limit.as_str()])
            .inc();
    }

    pub(super) fn checkpoint_rejected(&self, reason: auth::Rejected) {
        self.inner
            .checkpoint_rejected
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    pub(crate) fn count_http_request(&self, handler: &'static str, code: u16) {
        self.inner
            .http_requests
            .with_label_values(&[handler, &code.to_string()])
            .inc();
    }
}

/// Seconds since the Unix epoch, as Prometheus timestamps are.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

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
