//! The validated configuration of one launch: what [`crate::cli`] produces from torchrun's flags
//! and what the rest of the agent consumes. Nothing here touches the OS; every field already
//! holds a checked, typed value.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use nix::sys::signal::Signal;

pub use crate::gpu::gate::GpuCheck;
pub use crate::logs::LogFormat;

/// Default `--gpu-release-timeout` (NVIDIA's ft_launcher waits up to 50 s for the same thing).
pub const DEFAULT_GPU_RELEASE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default `--shutdown-timeout` (torchrun's).
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `--log-line-prefix-template`: host and global rank, which is what a pod log needs.
pub const DEFAULT_PREFIX_TEMPLATE: &str = "[${hostname}:${rank}] ";
/// torchrun's default `--signals-to-handle`, exported as `TORCHELASTIC_SIGNALS_TO_HANDLE`.
pub const DEFAULT_SIGNALS: &str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

/// Where the metrics endpoint listens unless `--metrics-addr` / `MUSTER_METRICS_ADDR` says
/// otherwise: the port the platform's `prometheus.io/port` annotation names.
pub const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:8000";
/// The environment variable that sets the metrics address (the flag wins).
pub const METRICS_ADDR_ENV: &str = "MUSTER_METRICS_ADDR";

/// `--metrics-addr`: where to serve, or nowhere (`none`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsAddr(Option<SocketAddr>);

impl MetricsAddr {
    /// The address to listen on; `None` when disabled.
    pub fn addr(self) -> Option<SocketAddr> {
        self.0
    }

    /// Serve on `addr`.
    pub fn at(addr: SocketAddr) -> Self {
        Self(Some(addr))
    }

    /// Do not serve.
    pub fn disabled() -> Self {
        Self(None)
    }
}

impl Default for MetricsAddr {
    fn default() -> Self {
        Self(DEFAULT_METRICS_ADDR.parse().ok())
    }
}

impl fmt::Display for MetricsAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(addr) => write!(f, "{addr}"),
            None => f.write_str("none"),
        }
    }
}

/// A `--metrics-addr` value that is neither `IP:PORT`, `:PORT`, `PORT` nor `none`.
#[derive(Debug, thiserror::Error)]
#[error("invalid metrics address {input:?}: expected IP:PORT (e.g. 0.0.0.0:8000 or [::]:8000), :PORT, or none")]
pub struct AddrError {
    input: String,
}

impl FromStr for MetricsAddr {
    type Err = AddrError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let s = input.trim();
        if s.eq_ignore_ascii_case("none") {
            return Ok(Self(None));
        }
        let err = || AddrError {
            input: input.to_owned(),
        };
        let port_only = s.strip_prefix(':').unwrap_or(s);
        if !port_only.is_empty() && port_only.bytes().all(|b| b.is_ascii_digit()) {
            let port: u16 = port_only.parse().map_err(|_| err())?;
            return Ok(Self(Some(SocketAddr::from(([0, 0, 0, 0], port)))));
        }
        s.parse::<SocketAddr>()
            .map(|a| Self(Some(a)))
            .map_err(|_| err())
    }
}

/// `--nnodes`: a fixed count or an elastic range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    pub min: u32,
    pub max: u32,
}

/// The program each worker runs, already resolved (interpreter found, script checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entrypoint {
    /// What is exec'd: the Python interpreter, or the program itself with `--no-python`.
    pub program: OsString,
    /// Its arguments (`-u script.py ARGS...`, `-u -m module ARGS...`, or the program's ARGS).
    pub args: Vec<OsString>,
    /// The user's entry point (script, module or program), for messages.
    pub display: String,
    /// Whether `program` is the Python interpreter running `args` (not `--no-python`, not a
    /// program found on PATH): only then may a warm standby take a rank's start.
    pub python: bool,
}

/// A set of standard streams, torchrun's `Std` bitmask (1 = stdout, 2 = stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streams(pub u8);

impl Streams {
    pub const NONE: Streams = Streams(0);
    pub const STDOUT: Streams = Streams(1);
    pub const STDERR: Streams = Streams(2);

    pub fn contains(self, other: Streams) -> bool {
        self.0 & other.0 == other.0 && other.0 != 0
    }
}

/// `--redirects` / `--tee`: one value for every local rank, or a per-local-rank map.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamSpec {
    pub all: Streams,
    pub per_rank: BTreeMap<u32, Streams>,
}

impl StreamSpec {
    pub fn for_rank(&self, local_rank: u32) -> Streams {
        self.per_rank.get(&local_rank).copied().unwrap_or(self.all)
    }

    pub fn is_empty(&self) -> bool {
        self.all == Streams::NONE && self.per_rank.values().all(|s| *s == Streams::NONE)
    }
}

/// Everything about worker output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    /// Root of the per-attempt, per-rank files; `None` puts the error files in a private
    /// temporary directory that is removed at exit.
    pub log_dir: Option<PathBuf>,
    pub redirects: StreamSpec,
    pub tee: StreamSpec,
    /// Only these local ranks reach the console; `None` = all.
    pub local_ranks_filter: Option<BTreeSet<u32>>,
    pub prefix_template: String,
    pub format: LogFormat,
    /// Where `log_dir` came from (`command line`, `environment variable MUSTER_LOG_DIR`), so
    /// that an unusable directory is reported like every other bad value.
    pub log_dir_origin: String,
    /// `--progress-interval`: at most one progress-bar update per rank and stream this often
    /// (zero: every update).
    pub progress_interval: Duration,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            log_dir: None,
            redirects: StreamSpec::default(),
            tee: StreamSpec::default(),
            local_ranks_filter: None,
            prefix_template: DEFAULT_PREFIX_TEMPLATE.to_owned(),
            format: LogFormat::Text,
            log_dir_origin: String::new(),
            progress_interval: crate::logs::DEFAULT_PROGRESS_INTERVAL,
        }
    }
}

/// What the agent does when it receives a handled signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalAction {
    /// torchrun's only behaviour: stop the workers with this signal, SIGKILL after
    /// `--shutdown-timeout`, exit 128+N (or 0 if every worker still exited cleanly).
    Terminate,
    /// Pass the signal to every worker's process group and keep running (SLURM's SIGUSR1).
    Forward,
    /// Log it and carry on.
    Ignore,
    /// Ask the whole gang for a checkpoint barrier, then stop (the default for SIGTERM: it is
    /// what Kubernetes sends on preemption and eviction). Without a barrier, as `Terminate`.
    Checkpoint,
}

impl SignalAction {
    /// The action of a handled signal listed without one.
    pub fn default_for(signal: Signal) -> SignalAction {
        if signal == Signal::SIGTERM {
            SignalAction::Checkpoint
        } else {
            SignalAction::Terminate
        }
    }
}

/// `--signals-to-handle`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalPolicy {
    /// The flag's text, for messages. Workers get the names of [`Self::actions`] in torchrun's
    /// format instead (`TORCHELASTIC_SIGNALS_TO_HANDLE`), without muster's actions.
    pub raw: String,
    pub actions: Vec<(Signal, SignalAction)>,
}

impl Default for SignalPolicy {
    fn default() -> Self {
        Self {
            raw: DEFAULT_SIGNALS.to_owned(),
            actions: [
                Signal::SIGTERM,
                Signal::SIGINT,
                Signal::SIGHUP,
                Signal::SIGQUIT,
            ]
            .into_iter()
            .map(|s| (s, SignalAction::default_for(s)))
            .collect(),
        }
    }
}

/// The validated launch configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub nnodes: NodeRange,
    pub nproc_per_node: u32,
    pub node_rank: u32,
    /// Whether `--node-rank`/`PET_NODE_RANK` was given (else the multi-node rendezvous looks for
    /// the Job index or the host name's ordinal).
    pub node_rank_given: bool,
    pub rdzv_backend: String,
    pub rdzv_endpoint: String,
    /// `--rdzv-id`; a random UUID with `--standalone` (torchrun's behaviour), and on one node
    /// without an endpoint when no id was given.
    pub run_id: String,
    pub rdzv_conf: Vec<(String, String)>,
    /// Effective standalone mode: `--standalone`, or torchrun's silent switch (static backend, no
    /// endpoint, no master port, one node).
    pub standalone: bool,
    pub max_restarts: u32,
    /// `--max-no-progress-restarts`: the crash-loop guard's limit (0: off); see
    /// [`super::crash_loop`].
    pub max_no_progress_restarts: u32,
    /// `--node-unit`: every gang's node count is a multiple of it.
    pub node_unit: u32,
    pub monitor_interval: Duration,
    pub role: String,
    pub entrypoint: Entrypoint,
    pub logs: LogConfig,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub local_addr: Option<String>,
    pub shutdown_timeout: Duration,
    pub signals: SignalPolicy,
    /// `--metrics-addr` as given (`None`: not given, serve on the default port if it is free).
    pub metrics_addr: Option<MetricsAddr>,
    pub gpu_check: GpuCheck,
    pub grace_period: Option<Duration>,
    /// Exit code after a committed preemption checkpoint (200 unless `--preempted-exit-code`
    /// says otherwise; 0 would make a Job count the preempted pod as a completion).
    pub preempted_exit_code: u8,
    /// `--numa-binding node`: pin each local rank to its GPU's NUMA-local CPUs.
    pub numa_binding: bool,
    /// `--checkpoint-token-file`: a bearer token that lets a non-loopback peer `POST /checkpoint`.
    pub checkpoint_token_file: Option<PathBuf>,
    /// Settings the command line gave that another one overrides (`--standalone` replacing an
    /// explicit `--rdzv-id`, say); the agent logs each once its logging is up.
    pub warnings: Vec<String>,
    /// `--tmp-dir`: where muster's own files go (checkpoint helper, error files); `None`: the
    /// first writable of `$TMPDIR`, `/tmp`, `/dev/shm` (see [`crate::scratch`]).
    pub tmp_dir: Option<PathBuf>,
    /// `--keep-strays`: let processes the workers started outlive the attempt (only the workers'
    /// process groups are swept).
    pub keep_strays: bool,
    /// `--framework-callbacks`: the workers add muster's checkpoint callback to every Hugging
    /// Face or Lightning Trainer (exported as `MUSTER_FRAMEWORK_CALLBACKS`).
    pub framework_callbacks: bool,
    /// `--gpu-release-timeout`: how long a restart waits for the previous attempt's GPU
    /// processes and memory to go (zero: no wait).
    pub gpu_release_timeout: Duration,
    /// `--gpu-watch-interval`: how often the GPU watch looks at the GPUs while the ranks run
    /// (zero: no watch).
    pub gpu_watch_interval: Duration,
    /// `--max-store-bytes`: what each store the agent hosts may hold.
    pub max_store_bytes: usize,
    /// `--network-check`, `--network-check-budget`, `--network-check-conf`: the gang's network
    /// pre-flight after each rendezvous round.
    pub network_check: crate::netcheck::Settings,
    /// `--hang-timeout` and `--section-timeout`.
    pub hang: crate::watch::hang::Policy,
    /// `--auto-step-reports`: muster's `sitecustomize` reports optimizer steps and liveness of
    /// scripts that do not use the helper (`python/muster_launcher/autoreport.py`).
    pub auto_step_reports: bool,
    /// `--warm-restart`: a restarted rank starts in a standby interpreter that already imported
    /// the rank's installed modules ([`super::standby`]); on by default, for a job that can
    /// restart at all ([`Config::can_restart`]).
    pub warm_restart: bool,
    /// `--snapshot-every`: every this many steps the ranks hand their state to the agent
    /// ([`crate::snapshot`]); `None`: off.
    pub snapshot_every: Option<u64>,
    /// `--snapshot-memory`: the most the snapshots may hold on this node (`None`: from the
    /// pod's memory limit).
    pub snapshot_memory: Option<u64>,
    /// `--snapshot-persist`: where the newest committed snapshot is written in the background,
    /// for a job-level restart ([`crate::snapshot::persist`]).
    pub snapshot_persist: Option<PathBuf>,
    /// `--snapshot-persist-every`: which committed steps are written (`None`: every one).
    pub snapshot_persist_every: Option<u64>,
    /// What the scheduler that started this agent does (`cli::scheduler`): whether a
    /// lost node comes back, whether it signals every process, the node's index.
    pub scheduler: SchedulerBehaviour,
    /// `--straggler-threshold`, `--straggler-action`, `--straggler-interval`.
    pub straggler: crate::watch::straggler::Settings,
}

impl Config {
    /// Whether an attempt of this job can be followed by another: a restart budget, or a gang
    /// that re-forms when a member is lost. A single node with `--max-restarts 0` (torchrun's
    /// default) ends with its first attempt: a standby there would only hold memory.
    pub fn can_restart(&self) -> bool {
        self.max_restarts > 0 || self.nnodes.max > 1
    }

    /// The rendezvous endpoint as given: `--rdzv-endpoint`, else the static form's
    /// `--master-addr`/`--master-port` (torchrun's defaults 127.0.0.1:29500).
    pub fn rdzv_endpoint_text(&self) -> String {
        if self.rdzv_endpoint.trim().is_empty() {
            format!(
                "{}:{}",
                self.master_addr.as_deref().unwrap_or("127.0.0.1"),
                self.master_port.unwrap_or(29500)
            )
        } else {
            self.rdzv_endpoint.clone()
        }
    }

    /// A single-node configuration running `program args...` directly; the starting point for
    /// tests and for other subcommands that launch workers.
    pub fn for_program(program: impl Into<OsString>, args: Vec<OsString>, nproc: u32) -> Self {
        let program = program.into();
        Self {
            nnodes: NodeRange { min: 1, max: 1 },
            nproc_per_node: nproc,
            node_rank: 0,
            node_rank_given: false,
            rdzv_backend: "c10d".to_owned(),
            rdzv_endpoint: String::new(),
            run_id: "none".to_owned(),
            rdzv_conf: Vec::new(),
            standalone: true,
            max_restarts: 0,
            max_no_progress_restarts: super::crash_loop::DEFAULT_MAX_NO_PROGRESS_RESTARTS,
            node_unit: 1,
            monitor_interval: Duration::from_millis(100),
            role: "default".to_owned(),
            entrypoint: Entrypoint {
                display: program.to_string_lossy().into_owned(),
                program,
                args,
                python: false,
            },
            logs: LogConfig::default(),
            master_addr: None,
            master_port: None,
            local_addr: None,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            signals: SignalPolicy::default(),
            metrics_addr: None,
            gpu_check: GpuCheck::default(),
            grace_period: None,
            preempted_exit_code: crate::exit_code::PREEMPTED_CHECKPOINTED,
            numa_binding: false,
            checkpoint_token_file: None,
            warnings: Vec::new(),
            tmp_dir: None,
            keep_strays: false,
            framework_callbacks: true,
            gpu_release_timeout: DEFAULT_GPU_RELEASE_TIMEOUT,
            gpu_watch_interval: crate::gpu::watch::DEFAULT_INTERVAL,
            max_store_bytes: rendezvous::store::server::DEFAULT_MAX_STORE_BYTES,
            network_check: crate::netcheck::Settings::default_for(1),
            hang: crate::watch::hang::Policy::default(),
            auto_step_reports: true,
            warm_restart: true,
            snapshot_every: None,
            snapshot_memory: None,
            snapshot_persist: None,
            snapshot_persist_every: None,
            scheduler: SchedulerBehaviour::default(),
            straggler: crate::watch::straggler::Settings::default(),
        }
    }
}

/// What the scheduler that started the agent does that the agent must know
/// (`cli::scheduler` says which one it is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerBehaviour {
    /// Its name, for messages.
    pub name: &'static str,
    /// One line saying where the job's shape came from, logged at INFO at start.
    pub summary: Option<String>,
    /// Whether a lost node comes back (a Job recreates a failed pod; Slurm never restarts a
    /// task of a running step, so a gang below its minimum ends at once instead of waiting out
    /// the join timeout, and a lost store host is final).
    pub replaces_lost_nodes: bool,
    /// Whether the scheduler signals every process of the node (Slurm's preemption and
    /// `scancel` do), so that the ranks must hold a `checkpoint` signal the agent did not send
    /// ([`crate::slurm::HOLD_ENV`]).
    pub signals_every_process: bool,
    /// The node's index as the scheduler numbers its pods or tasks (Kubernetes'
    /// `JOB_COMPLETION_INDEX`), a source of its node rank.
    pub node_index: Option<String>,
}

/// A pod of a Job, or a process started by hand: lost nodes come back, only the agent signals
/// the ranks, no index (`cli::scheduler::kubernetes` with no `JOB_COMPLETION_INDEX`).
impl Default for SchedulerBehaviour {
    fn default() -> Self {
        Self {
            name: "kubernetes",
            summary: None,
            replaces_lost_nodes: true,
            signals_every_process: false,
            node_index: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_like_the_flag_documents() {
        assert_eq!(
            "none".parse::<MetricsAddr>().ok(),
            Some(MetricsAddr::disabled())
        );
        assert_eq!(
            "NONE".parse::<MetricsAddr>().ok(),
            Some(MetricsAddr::disabled())
        );
        let any = SocketAddr::from(([0, 0, 0, 0], 9100));
        assert_eq!(
            ":9100".parse::<MetricsAddr>().ok(),
            Some(MetricsAddr::at(any))
        );
        assert_eq!(
            "9100".parse::<MetricsAddr>().ok(),
            Some(MetricsAddr::at(any))
        );
        let v6: SocketAddr = "[::1]:8000".parse().unwrap();
        assert_eq!(
            "[::1]:8000".parse::<MetricsAddr>().ok(),
            Some(MetricsAddr::at(v6))
        );
        assert_eq!(MetricsAddr::default().to_string(), "0.0.0.0:8000");
        for bad in [
            "",
            "host:8000",
            "0.0.0.0",
            ":99999",
            "1.2.3.4:x",
            "none please",
        ] {
            let err = bad.parse::<MetricsAddr>().unwrap_err();
            assert!(
                err.to_string().contains("invalid metrics address"),
                "{bad}: {err}"
            );
        }
    }
}
