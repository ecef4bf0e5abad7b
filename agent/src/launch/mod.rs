//! The launch pipeline: what `muster [OPTIONS] script.py` does after the command line is parsed.
//!
//! # Theory of operation
//! [`run`] (or [`Launch::run`]) starts the agent's services once — the [`reaper`] (child
//! subreaper; every child is reaped in one place, driven by SIGCHLD), the [`signals`] listeners
//! and the console writer ([`crate::logs`]) — all before the first worker exists. Then, per
//! attempt (`restart_count` = 0, 1, ... up to `--max-restarts`):
//!
//! 1. **Obtain the assignment**: [`Rendezvous::next_round`] returns a [`Round`]: the
//!    [`RankAssignment`] (ranks, world size, where the workers' store is, the run id) and, on the
//!    node that hosts it, the [`HostedStore`]: a fresh store on an ephemeral port for every
//!    attempt, so a restarted group never reads the dead attempt's keys. [`LocalRendezvous`] does
//!    this for one node; the gang rendezvous ([`rdzv::GangRendezvous`]) plugs in here through
//!    [`Launch::with_rendezvous`].
//! 2. **Run the group**: [`run_group`] starts `nproc-per-node` workers with torchrun's
//!    environment ([`env`]), each in its own session and process group with a parent-death
//!    signal ([`crate::sys`]), pumps their output, and waits for exits as events.
//! 3. **Decide**: [`GroupOutcome::Succeeded`] → exit 0; [`GroupOutcome::Failed`] → restart while
//!    the budget lasts, else exit with the root-cause worker's code (or 128+signal) after a
//!    [`summary`]; [`GroupOutcome::Stopped`] (a terminate signal or the caller's token) → exit
//!    128+signal, or 0 when every worker still exited cleanly.
//! 4. **Clean restart**: each attempt ends with its whole process tree stopped ([`strays`]);
//!    before the next one starts, the agent waits (`--gpu-release-timeout`) until NVML shows the
//!    local GPUs free of it ([`crate::gpu::release`]), else exits 204.
//!
//! Observers (metrics, health probes) subscribe with [`Launch::observer`]: a `watch` of the
//! [`Phase`] and a `broadcast` of [`Event`]s. The preemption work hooks SIGTERM with
//! [`Launch::on_terminate`]: the hook runs instead of the immediate stop and calls
//! [`StopRequest::request`] when the checkpoint barrier is done.

pub mod bad_nodes;
pub mod config;
pub mod crash_loop;
pub mod env;
pub mod gang_cause;
mod group;
pub mod leave;
pub mod observe;
pub mod rdzv;
pub mod reaper;
mod repeat;
pub mod signals;
pub mod stop_mark;
mod store_host;
pub mod strays;
pub mod summary;
pub mod watchdog;

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use nix::sys::signal::Signal;
use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use group::{run_group, Attempt, WorkerGroupSpec};
pub use observe::{Event, Observer, Phase, Publisher, RestartCause};
pub use rdzv::{AfterGroup, BoxFuture, GangRestart, LocalRendezvous, Rendezvous};
pub use reaper::{ExitStatus, Reaper};
pub use signals::{StopRequest, TerminateHook};
pub use store_host::HostedStore;
pub use watchdog::{RankWriter, Watchdog, WatchedAttempt, WatchedWorker};

use crate::exit_code;
use crate::logs::{Console, LogSink};

/// Where this node's workers sit in the job, for one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankAssignment {
    /// GROUP_RANK.
    pub node_rank: u32,
    /// GROUP_WORLD_SIZE: nodes in this round.
    pub group_world_size: u32,
    /// RANK of local rank 0.
    pub base_global_rank: u32,
    /// WORLD_SIZE.
    pub world_size: u32,
    /// MASTER_ADDR: the workers' store, numerically.
    pub master_addr: String,
    pub master_port: u16,
    /// TORCHELASTIC_RESTART_COUNT.
    pub restart_count: u32,
    /// TORCHELASTIC_RUN_ID.
    pub run_id: String,
}

/// What one round of the rendezvous hands to the launch loop.
pub struct Round {
    pub assignment: RankAssignment,
    /// The workers' store when this node hosts it; shut down when the attempt ends.
    pub store: Option<HostedStore>,
    /// Where the attempt's first local failure goes the moment it is seen (the gang's failure
    /// board, [`gang_cause`]); `None` on a single node.
    pub failure_post: Option<FailurePost>,
}

/// The sending end of a round's [`Round::failure_post`].
pub type FailurePost = tokio::sync::oneshot::Sender<Failure>;

/// The first failure of an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub host: String,
    pub local_rank: u32,
    pub rank: u32,
    pub pid: u32,
    pub status: ExitStatus,
    /// When the agent saw the exit.
    pub at: SystemTime,
    /// The worker's `TORCHELASTIC_ERROR_FILE`; empty when it had none (nowhere writable).
    pub error_file: PathBuf,
    /// The message of `TORCHELASTIC_ERROR_FILE` (torch's `@record`), if the worker left one.
    pub message: Option<String>,
    /// The last `SomeError: message` line of the worker's stderr (shown when it left no error
    /// file).
    pub exception_line: Option<String>,
    /// It died of SIGKILL while the container's memory cgroup counted an OOM kill: the kernel's
    /// OOM killer; the container's memory limit, if it has one.
    pub oom_killed: Option<Option<u64>>,
    /// The worker did not exit by itself: the hang watch found it hung and the agent stopped it.
    pub hang: Option<Box<crate::watch::Hang>>,
    /// The NCCL flight recorder's dumps the attempt's ranks wrote ([`crate::watch::flight_recorder`]).
    pub flight_recorder: Vec<PathBuf>,
}

impl Failure {
    /// "rank 3 was killed by the kernel OOM killer (container memory limit 8.0 GiB)".
    pub fn oom_line(&self) -> Option<String> {
        let limit = self.oom_killed?;
        let limit = limit.map_or_else(
            || "no container memory limit: the node ran out".to_owned(),
            |b| {
                format!(
                    "container memory limit {}",
                    crate::watch::cgroup::human_bytes(b)
                )
            },
        );
        Some(format!(
            "rank {} was killed by the kernel OOM killer ({limit})",
            self.rank
        ))
    }

    /// The agent's exit code for this failure: [`exit_code::HUNG`] for a hung rank, else the
    /// worker's own code (or 128+signal).
    pub fn exit_code(&self) -> u8 {
        if self.hang.is_some() {
            exit_code::HUNG
        } else {
            self.status.exit_code()
        }
    }
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupOutcome {
    /// Every worker exited 0.
    Succeeded,
    /// A worker failed (the first observed failure); the others were stopped.
    Failed(Failure),
    /// A stop was requested: by `signal`, or by the caller's token (`None`). `all_clean`: every
    /// worker still exited 0.
    Stopped {
        signal: Option<Signal>,
        all_clean: bool,
    },
}

impl GroupOutcome {
    /// The agent's exit code for this outcome (see [`crate::exit_code`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            GroupOutcome::Succeeded
            | GroupOutcome::Stopped {
                all_clean: true, ..
            } => exit_code::SUCCESS,
            GroupOutcome::Failed(f) => f.exit_code(),
            GroupOutcome::Stopped { signal, .. } => {
                exit_code::for_signal(signal.unwrap_or(Signal::SIGTERM) as i32)
            }
        }
    }
}

/// The end of a launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub exit_code: u8,
    /// How the last attempt ended.
    pub last: GroupOutcome,
    /// Attempts made (1 + restarts).
    pub attempts: u32,
}

/// Errors of the launch itself (not of the workers).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{0}")]
    Config(String),
    #[error("log directory {}: {source}", path.display())]
    LogDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A [`LaunchError::LogDir`] under the directory `--log-dir` named, reported like every
    /// other bad value: the option, its value, where the value came from.
    #[error("invalid --log-dir `{}` ({origin}): cannot create {}: {source}", dir.display(), path.display())]
    LogDirOption {
        dir: PathBuf,
        origin: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the worker program {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("cannot host the workers' store on {ip}: {source}")]
    Store { ip: IpAddr, source: std::io::Error },
    /// Without `--log-dir`, the per-rank directory for the error files could not be made in
    /// muster's private directory (or `--tmp-dir` is unusable).
    #[error("{}: {source}; {}", path.display(), crate::scratch::FIX)]
    TmpDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Scratch(#[from] crate::scratch::ScratchError),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    /// The rendezvous endpoint could not be resolved or reached before the join deadline.
    #[error("rendezvous timed out: {0}")]
    DiscoveryTimeout(crate::discovery::DiscoveryError),
    /// The gang rendezvous failed: timed out, lost node 0, rejected this node, or ended the job
    /// for everyone with a worker's code.
    #[error(transparent)]
    Rendezvous(rendezvous::rdzv::RdzvError),
    /// Node 0, which hosts the rendezvous store, stopped answering while workers ran.
    #[error("lost the store host (node 0): {0}")]
    StoreHostLost(String),
    /// Before a restart, the previous attempt's GPU processes or memory did not go within
    /// `--gpu-release-timeout`: this node is unhealthy.
    #[error(
        "the GPUs were not released {waited:.1}s after attempt {previous} stopped: {detail}; \
         this node is unhealthy (--gpu-release-timeout {timeout})"
    )]
    GpusNotReleased {
        waited: f64,
        previous: u32,
        detail: String,
        timeout: f64,
    },
    /// The gang's network pre-flight (`--network-check require`) named a slow node or link:
    /// the round ends for this node (the message names the node or link and what was measured).
    #[error("{0}")]
    NetworkCheckFailed(String),
    /// The rendezvous store failed under the network check.
    #[error(transparent)]
    NetworkCheck(crate::netcheck::gang::CheckError),
    /// A state the agent's own logic should never reach.
    #[error("{0}")]
    Internal(&'static str),
    /// A fatal GPU fault while the ranks ran ([`crate::gpu::watch`]): the workers were stopped
    /// and this node leaves the job with the "unhealthy GPU" code, so an elastic gang
    /// (`--nnodes MIN:MAX`) re-forms without it.
    #[error("fatal GPU fault: {0}; this node is unhealthy, its workers were stopped")]
    GpuFault(Box<crate::gpu::watch::GpuEvent>),
    /// A part of the agent asked this node to leave the gang while its workers ran
    /// ([`leave::Leave`], e.g. a node excluded as a straggler): the workers were stopped and the
    /// node ends with the part's code.
    #[error("{}", .0.message)]
    Left(leave::Departure),
}

impl LaunchError {
    /// Whether this is the join deadline passing with nodes missing.
    pub fn is_rendezvous_timeout(&self) -> bool {
        matches!(
            self,
            LaunchError::DiscoveryTimeout(_)
                | LaunchError::Rendezvous(rendezvous::rdzv::RdzvError::Timeout(_))
        )
    }
}

impl exit_code::Coded for LaunchError {
    fn exit_code(&self) -> u8 {
        use rendezvous::rdzv::RdzvError;
        match self {
            LaunchError::Config(_)
            | LaunchError::LogDir { .. }
            | LaunchError::LogDirOption { .. }
            | LaunchError::TmpDir { .. }
            | LaunchError::Scratch(_)
            | LaunchError::Rendezvous(RdzvError::Rejected(_)) => exit_code::CONFIG_ERROR,
            LaunchError::Spawn { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
                ) =>
            {
                exit_code::CONFIG_ERROR
            }
            LaunchError::DiscoveryTimeout(_) | LaunchError::Rendezvous(RdzvError::Timeout(_)) => {
                exit_code::RENDEZVOUS_TIMEOUT
            }
            LaunchError::StoreHostLost(_)
            | LaunchError::Rendezvous(RdzvError::StoreLost(_))
            | LaunchError::NetworkCheck(
                crate::netcheck::gang::CheckError::Store(_)
                | crate::netcheck::gang::CheckError::StoreSlow(_),
            ) => exit_code::STORE_HOST_LOST,
            LaunchError::Rendezvous(RdzvError::Fatal { exit_code, .. }) => *exit_code,
            LaunchError::Rendezvous(RdzvError::FinishedAsSpare) => exit_code::SUCCESS,
            LaunchError::GpusNotReleased { .. } | LaunchError::GpuFault(_) => {
                exit_code::UNHEALTHY_GPU
            }
            LaunchError::NetworkCheckFailed(_) => exit_code::NETWORK_CHECK_FAILED,
            LaunchError::Left(departure) => departure.code,
            LaunchError::Rendezvous(RdzvError::Malformed { .. } | RdzvError::Encode(_))
            | LaunchError::Spawn { .. }
            | LaunchError::Store { .. }
            | LaunchError::Io { .. }
            | LaunchError::NetworkCheck(crate::netcheck::gang::CheckError::Encode(_))
            | LaunchError::Internal(_) => exit_code::INTERNAL_ERROR,
        }
    }
}

impl LaunchError {
    /// Names `--log-dir` and the source of its value in a [`LaunchError::LogDir`] about a path
    /// below it; any other error is returned as it is.
    #[must_use]
    pub fn naming_log_dir(self, logs: &config::LogConfig) -> Self {
        match (self, &logs.log_dir) {
            (LaunchError::LogDir { path, source }, Some(dir)) if path.starts_with(dir) => {
                LaunchError::LogDirOption {
                    dir: dir.clone(),
                    origin: logs.log_dir_origin.clone(),
                    path,
                    source,
                }
            }
            (other, _) => other,
        }
    }
}

/// A launch being set up: plug in a rendezvous, a terminate hook, observers; then [`Launch::run`].
pub struct Launch {
    config: Arc<Config>,
    rendezvous: Option<Box<dyn Rendezvous>>,
    terminate_hook: Option<TerminateHook>,
    publisher: Publisher,
    logs: Option<LogSink>,
    extra_env: Vec<(String, OsString)>,
    rank_cpus: Vec<Vec<u32>>,
    rank_env: Option<RankEnv>,
    watchdog: Option<Arc<dyn Watchdog>>,
    gpu_watch: Option<crate::gpu::watch::Watch>,
    private_dir: Option<Arc<crate::scratch::ScratchDir>>,
    leave: Option<leave::Leave>,
    steps: Option<StepSource>,
}

/// The highest step any local rank reported since the given instant (ranks that connected
/// before it belong to an earlier attempt); `None` when none did. Read by the crash-loop guard.
pub type StepSource = Arc<dyn Fn(tokio::time::Instant) -> Option<u64> + Send + Sync>;

/// Variables for one rank of one attempt, computed just before it starts:
/// `(restart_count, rank, local_rank)` to `(name, value)` pairs, set after every other variable.
pub type RankEnv = Arc<dyn Fn(u32, u32, u32) -> Vec<(String, OsString)> + Send + Sync>;

impl Launch {
    pub fn new(config: Config) -> Self {
        Self {
            config: Arc::new(config),
            rendezvous: None,
            terminate_hook: None,
            publisher: Publisher::new(),
            logs: None,
            extra_env: Vec::new(),
            rank_cpus: Vec::new(),
            rank_env: None,
            watchdog: None,
            gpu_watch: None,
            private_dir: None,
            leave: None,
            steps: None,
        }
    }

    /// Keeps the workers' error files (without `--log-dir`) in `dir`, the agent's one private
    /// directory, instead of a directory of the launch's own: one directory to make and remove
    /// per agent, not two.
    #[must_use]
    pub fn with_private_dir(mut self, dir: Arc<crate::scratch::ScratchDir>) -> Self {
        self.private_dir = Some(dir);
        self
    }

    /// Stops the workers and ends the launch with [`LaunchError::GpuFault`] when `watch` reports
    /// a fatal GPU fault, and adds the node's recent GPU events to a failed run's summary.
    #[must_use]
    pub fn with_gpu_watch(mut self, watch: crate::gpu::watch::Watch) -> Self {
        self.gpu_watch = Some(watch);
        self
    }

    /// Stops the workers and ends the launch with [`LaunchError::Left`] when a part asks this
    /// node to leave through `leave`.
    #[must_use]
    pub fn with_leave(mut self, leave: leave::Leave) -> Self {
        self.leave = Some(leave);
        self
    }

    /// Watches every attempt for a hang ([`crate::watch`]): a hung attempt fails with the hung
    /// rank named, and restarts like any failure.
    #[must_use]
    pub fn with_watchdog(mut self, watchdog: Arc<dyn Watchdog>) -> Self {
        self.watchdog = Some(watchdog);
        self
    }

    /// Sets `key=value` in every worker's environment (after torchrun's variables), e.g.
    /// `MUSTER_CHECKPOINT_SOCKET`.
    #[must_use]
    pub fn with_worker_env(mut self, key: impl Into<String>, value: impl Into<OsString>) -> Self {
        self.extra_env.push((key.into(), value.into()));
        self
    }

    /// Sets the variables `rank_env` returns in each rank's environment as it starts (e.g. its
    /// own `PROMETHEUS_MULTIPROC_DIR`).
    #[must_use]
    pub fn with_rank_env(mut self, rank_env: RankEnv) -> Self {
        self.rank_env = Some(rank_env);
        self
    }

    /// Pins local rank `i` to `rank_cpus[i]` (`--numa-binding`).
    #[must_use]
    pub fn with_rank_cpus(mut self, rank_cpus: Vec<Vec<u32>>) -> Self {
        self.rank_cpus = rank_cpus;
        self
    }

    /// Where the crash-loop guard ([`crash_loop`]) reads the steps each attempt reached; without
    /// it every attempt counts as one that reported no step.
    #[must_use]
    pub fn with_steps(mut self, steps: StepSource) -> Self {
        self.steps = Some(steps);
        self
    }

    /// Replaces the single-node [`LocalRendezvous`].
    #[must_use]
    pub fn with_rendezvous(mut self, rendezvous: Box<dyn Rendezvous>) -> Self {
        self.rendezvous = Some(rendezvous);
        self
    }

    /// Runs `hook` instead of stopping at once when a `terminate` signal arrives.
    #[must_use]
    pub fn on_terminate(mut self, hook: TerminateHook) -> Self {
        self.terminate_hook = Some(hook);
        self
    }

    /// Writes worker output through an existing console writer (else one is started).
    #[must_use]
    pub fn with_log_sink(mut self, sink: LogSink) -> Self {
        self.logs = Some(sink);
        self
    }

    /// A subscription to phases and events; take it before [`Launch::run`].
    pub fn observer(&self) -> Observer {
        self.publisher.subscribe()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Runs every attempt to the end. Cancelling `shutdown` stops the workers like SIGTERM.
    pub async fn run(self, shutdown: CancellationToken) -> Result<Outcome, LaunchError> {
        let Launch {
            config,
            rendezvous,
            terminate_hook,
            publisher,
            logs,
            extra_env,
            rank_cpus,
            rank_env,
            watchdog,
            gpu_watch,
            private_dir,
            leave,
            steps,
        } = self;
        let mut rendezvous: Box<dyn Rendezvous> = match rendezvous {
            Some(r) => r,
            None if config.nnodes.max > 1 => {
                return Err(LaunchError::Config(format!(
                    "--nnodes {} needs the multi-node rendezvous, which this build lacks",
                    if config.nnodes.min == config.nnodes.max {
                        config.nnodes.max.to_string()
                    } else {
                        format!("{}:{}", config.nnodes.min, config.nnodes.max)
                    }
                )))
            }
            None => Box::new(LocalRendezvous),
        };

        // Services first, so no signal and no child exit can be missed.
        let reaper = Reaper::start().map_err(|source| LaunchError::Io {
            what: "cannot watch child processes",
            source,
        })?;
        let stop = StopRequest::new(&shutdown);
        let _listeners = signals::install(
            &config.signals,
            &stop,
            &reaper,
            &publisher,
            terminate_hook.as_ref(),
        )
        .map_err(|source| LaunchError::Io {
            what: "cannot install signal handlers",
            source,
        })?;
        let (sink, writer) = if let Some(sink) = logs {
            (sink, None)
        } else {
            let writer = crate::logs::start().map_err(|source| LaunchError::Io {
                what: "cannot start the log writer",
                source,
            })?;
            (writer.sink(), Some(writer))
        };
        let run_dir =
            RunDir::create(&config, private_dir).map_err(|e| e.naming_log_dir(&config.logs))?;
        let asks_files = !(config.logs.redirects.is_empty() && config.logs.tee.is_empty());
        match (&run_dir.path, &config.logs.log_dir) {
            (Some(path), Some(_)) if asks_files => {
                tracing::info!("worker log files under {}", path.display());
            }
            (_, None) if asks_files => tracing::warn!(
                "--redirects/--tee write per-rank files only with --log-dir: without it every stream stays on the console"
            ),
            _ => {}
        }

        let spec = WorkerGroupSpec {
            config: config.clone(),
            hostname: crate::host::short_name(),
            run_dir: run_dir.path.clone(),
            files: config.logs.log_dir.is_some(),
            reaper,
            logs: sink.clone(),
            publisher: publisher.clone(),
            extra_env,
            rank_cpus,
            rank_env,
            watchdog,
        };
        let result = attempts(
            &spec,
            rendezvous.as_mut(),
            &stop,
            gpu_watch.as_ref(),
            leave.as_ref(),
            steps.as_ref(),
        )
        .await
        .map_err(|e| e.naming_log_dir(&config.logs));
        if let Ok(outcome) = &result {
            // The gang's root cause, when it is another node's: named first, on every node.
            let elsewhere = rendezvous
                .gang_cause()
                .filter(|c| c.elsewhere() && outcome.exit_code != exit_code::SUCCESS);
            let text = match (&elsewhere, config.logs.format) {
                (Some(cause), config::LogFormat::Text) => {
                    summary::render_gang(cause, outcome.attempts)
                }
                (Some(cause), config::LogFormat::Json) => summary::render_gang_json(
                    cause,
                    outcome.attempts,
                    outcome.exit_code,
                    &spec.hostname,
                ),
                (None, _) => String::new(),
            };
            // This node's own failure: the root cause, or (after the gang's) its evidence.
            let text = text
                + &match &outcome.last {
                    GroupOutcome::Failed(f) => {
                        let gpu_events = gpu_watch
                            .as_ref()
                            .map(|w| w.summary_lines(f.rank, f.at))
                            .unwrap_or_default();
                        // Without --log-dir the run directory is muster's private one, gone at exit.
                        let removed = run_dir.path.as_deref().filter(|_| !run_dir.is_kept());
                        match (config.logs.format, elsewhere.is_some()) {
                            (config::LogFormat::Text, false) => {
                                summary::render(f, outcome.attempts)
                                    + &summary::render_flight_recorder(f, removed)
                                    + &summary::render_gpu_events(&gpu_events)
                            }
                            (config::LogFormat::Text, true) => {
                                summary::render_flight_recorder(f, removed)
                                    + &summary::render_gpu_events(&gpu_events)
                            }
                            (config::LogFormat::Json, false) => {
                                summary::render_json(
                                    f,
                                    outcome.attempts,
                                    run_dir.is_kept(),
                                    removed,
                                ) + &summary::render_gpu_events_json(&f.host, &gpu_events)
                            }
                            (config::LogFormat::Json, true) => {
                                summary::render_gpu_events_json(&f.host, &gpu_events)
                            }
                        }
                    }
                    _ => String::new(),
                };
            if !text.is_empty() {
                sink.agent_line(Console::Stderr, text.into_bytes());
            }
            publisher.phase(Phase::Finished {
                exit_code: outcome.exit_code,
            });
        }
        if let Some(writer) = writer {
            writer.finish();
        }
        drop(run_dir);
        result
    }
}

/// Resolves with the watch's fatal GPU fault; never without a watch.
async fn gpu_fault(watch: Option<&crate::gpu::watch::Watch>) -> crate::gpu::watch::GpuEvent {
    match watch {
        Some(watch) => watch.fault().await,
        None => std::future::pending().await,
    }
}

/// Resolves with the first request to leave; never without a handle.
async fn left(leave: Option<&leave::Leave>) -> leave::Departure {
    match leave {
        Some(leave) => leave.requested().await,
        None => std::future::pending().await,
    }
}

/// [`LaunchError::Left`] when a part asked this node to leave.
fn check_leave(leave: Option<&leave::Leave>) -> Result<(), LaunchError> {
    match leave.and_then(leave::Leave::current) {
        Some(departure) => Err(LaunchError::Left(departure)),
        None => Ok(()),
    }
}

/// [`LaunchError::GpuFault`] when the watch has seen a fatal fault.
fn check_gpus(watch: Option<&crate::gpu::watch::Watch>) -> Result<(), LaunchError> {
    match watch.and_then(crate::gpu::watch::Watch::current_fault) {
        Some(fault) => Err(LaunchError::GpuFault(Box::new(fault))),
        None => Ok(()),
    }
}

async fn attempts(
    spec: &WorkerGroupSpec,
    rendezvous: &mut dyn Rendezvous,
    stop: &StopRequest,
    gpu_watch: Option<&crate::gpu::watch::Watch>,
    leave: Option<&leave::Leave>,
    steps: Option<&StepSource>,
) -> Result<Outcome, LaunchError> {
    let config = &spec.config;
    let mut restart_count = 0;
    let mut guard = crash_loop::Guard::new(config.max_no_progress_restarts);
    // The GPU use before the attempt that just ended, and its processes: what the next attempt
    // waits to see released.
    let mut previous: Option<(Vec<crate::gpu::release::GpuUse>, Vec<u32>)> = None;
    loop {
        // A node whose GPU faulted starts no attempt (also when the fault came while the
        // previous one was already failing because of it).
        check_gpus(gpu_watch)?;
        if let Some((baseline, pids)) = previous.take() {
            if !stop.is_requested() {
                wait_for_gpus(spec, baseline, pids, restart_count, stop).await?;
            }
        }
        if stop.is_requested() {
            let last = GroupOutcome::Stopped {
                signal: stop.received_signal(),
                all_clean: false,
            };
            return Ok(Outcome {
                exit_code: last.exit_code(),
                last,
                attempts: restart_count,
            });
        }
        spec.publisher.phase(Phase::Rendezvous { restart_count });
        let round = tokio::select! {
            round = rendezvous.next_round(config, restart_count, stop) => match round {
                Ok(round) => round,
                Err(LaunchError::Rendezvous(rendezvous::rdzv::RdzvError::FinishedAsSpare)) => {
                    // Not a failure: under a Kubernetes Job a spare that ended 203/205 here
                    // would mark its pod Failed although the job succeeded.
                    tracing::info!("the job finished while this pod waited as a spare");
                    return Ok(Outcome {
                        exit_code: exit_code::SUCCESS,
                        last: GroupOutcome::Succeeded,
                        attempts: restart_count,
                    });
                }
                Err(e) => return Err(e),
            },
            () = stop.requested() => continue,
        };
        spec.publisher.event(Event::AttemptStarted {
            assignment: round.assignment.clone(),
        });
        let attempt_stop = stop.child();
        let baseline = gpu_baseline(config).await;
        let attempt_started = tokio::time::Instant::now();
        let attempt = {
            let group = run_group(spec, &round.assignment, &attempt_stop, round.failure_post);
            tokio::pin!(group);
            tokio::select! {
                outcome = &mut group => outcome,
                () = rendezvous.watch() => {
                    attempt_stop.request(Signal::SIGTERM);
                    group.await
                }
                _fault = gpu_fault(gpu_watch) => {
                    // Reported by `check_gpus` once the workers are down.
                    attempt_stop.request(Signal::SIGTERM);
                    group.await
                }
                _departure = left(leave) => {
                    // Reported by `check_leave` once the workers are down.
                    attempt_stop.request(Signal::SIGTERM);
                    group.await
                }
            }
        };
        if let Some(store) = round.store {
            store.shutdown().await;
        }
        let Attempt { outcome, pids } = attempt?;
        check_gpus(gpu_watch)?;
        check_leave(leave)?;
        previous = baseline.map(|b| (b, pids));
        let progress = crash_loop::AttemptProgress {
            max_step: steps.and_then(|s| s(attempt_started)),
            ran_for: attempt_started.elapsed(),
        };
        let crash_loop = match &outcome {
            // Judged where a restart would follow; a spent budget ends with the worker's code.
            GroupOutcome::Failed(f)
                if round.assignment.restart_count < config.max_restarts && !stop.is_requested() =>
            {
                judge_crash_loop(&guard, progress, f, config, rendezvous)
            }
            _ => None,
        };
        match rendezvous.after_group(&outcome, stop).await? {
            Some(AfterGroup::Restart(why)) => {
                restart_count += 1;
                // Every node counts every failure restart of the gang, its own or another
                // node's, so nodes failing in turn are one crash loop; a membership change
                // (and a local failure that was its consequence) only moves the baseline.
                note_crash_loop(&mut guard, progress, why == GangRestart::Failure);
                let cause = match (&outcome, why) {
                    (_, GangRestart::Membership) => RestartCause::MembershipChange,
                    (GroupOutcome::Failed(f), _) if f.hang.is_some() => RestartCause::Hang,
                    (GroupOutcome::Failed(_), _) => RestartCause::WorkerFailure,
                    _ => RestartCause::PeerFailure,
                };
                spec.publisher.event(Event::Restarting {
                    restart_count,
                    cause,
                });
                continue;
            }
            Some(AfterGroup::Finish(exit_code)) => {
                return Ok(Outcome {
                    exit_code,
                    last: outcome,
                    attempts: restart_count + 1,
                })
            }
            None => {}
        }
        if crash_loop.is_some() {
            return Ok(Outcome {
                exit_code: exit_code::NO_PROGRESS,
                last: outcome,
                attempts: restart_count + 1,
            });
        }
        match &outcome {
            GroupOutcome::Failed(f)
                if restart_count < config.max_restarts && !stop.is_requested() =>
            {
                restart_count += 1;
                note_crash_loop(&mut guard, progress, true);
                if let Some(hang) = &f.hang {
                    tracing::warn!(
                        "{}; restarting the worker group with cause hang (restart {restart_count} of {})",
                        hang.describe(),
                        config.max_restarts
                    );
                } else {
                    tracing::warn!(
                        "{}; restarting the worker group (restart {restart_count} of {})",
                        summary::restart_reason(f),
                        config.max_restarts
                    );
                }
                spec.publisher.event(Event::Restarting {
                    restart_count,
                    cause: if f.hang.is_some() {
                        RestartCause::Hang
                    } else {
                        RestartCause::WorkerFailure
                    },
                });
            }
            _ => {
                return Ok(Outcome {
                    exit_code: outcome.exit_code(),
                    last: outcome,
                    attempts: restart_count + 1,
                })
            }
        }
    }
}

/// The crash-loop guard's verdict on a failed attempt that a restart would follow: `Some` with
/// the message when the job ends with [`exit_code::NO_PROGRESS`] here. In a gang the message
/// goes to the rendezvous, which ends the job for every node ([`Rendezvous::end_on_failure`]);
/// `None` then, and the rendezvous says `Finish` (or restarts after all, when the failure turns
/// out to be the consequence of a lost member).
fn judge_crash_loop(
    guard: &crash_loop::Guard,
    progress: crash_loop::AttemptProgress,
    failure: &Failure,
    config: &Config,
    rendezvous: &mut dyn Rendezvous,
) -> Option<String> {
    let (verdict, reason) = guard.judge(progress);
    match verdict {
        crash_loop::Verdict::Progress | crash_loop::Verdict::NoProgress { .. } => None,
        crash_loop::Verdict::Stop => {
            tracing::warn!("crash-loop guard: {reason}");
            let what = match &failure.hang {
                Some(hang) => format!("cause hang: {}", hang.describe()),
                None => summary::restart_reason(failure),
            };
            let message =
                crash_loop::stop_message(config.max_no_progress_restarts, &what, progress.max_step);
            tracing::error!("{message}");
            (!rendezvous.end_on_failure(exit_code::NO_PROGRESS, message.clone())).then_some(message)
        }
    }
}

/// Records a restarted attempt in the crash-loop guard; `counts`: a failure restart (not a
/// membership change).
fn note_crash_loop(
    guard: &mut crash_loop::Guard,
    progress: crash_loop::AttemptProgress,
    counts: bool,
) {
    if let Some(reason) = guard.record(progress, counts) {
        tracing::warn!("crash-loop guard: {reason}");
    }
}

/// How long one NVML read for the baseline may take before the agent goes on without it (a GPU
/// in a bad state can hang NVML calls; the pre-flight catches that, this must not block).
const GPU_BASELINE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Beyond `--gpu-release-timeout`, how long an NVML call that does not return is given.
const GPU_WAIT_HANG: std::time::Duration = std::time::Duration::from_secs(30);

/// The local GPUs' use before an attempt starts, when a restart may follow and the release wait
/// is on; `None` on a node without GPUs.
async fn gpu_baseline(config: &Config) -> Option<Vec<crate::gpu::release::GpuUse>> {
    let may_restart = config.max_restarts > 0 || config.nnodes.max > 1;
    if config.gpu_release_timeout.is_zero() || !may_restart {
        return None;
    }
    let library = crate::gpu::nvml::library_override();
    if !crate::gpu::nvml::may_reach_gpus(library.as_deref()) {
        return None;
    }
    let read =
        tokio::task::spawn_blocking(move || crate::gpu::release::baseline(library.as_deref()));
    if let Ok(Ok(baseline)) = tokio::time::timeout(GPU_BASELINE_TIMEOUT, read).await {
        baseline
    } else {
        tracing::warn!(
            "NVML did not answer within {}: no GPU release wait",
            rendezvous::words::duration(GPU_BASELINE_TIMEOUT)
        );
        None
    }
}

/// Before attempt `restart_count` starts: waits, within `--gpu-release-timeout`, until the local
/// GPUs are free of the previous attempt (`pids`); a GPU still held makes the node unhealthy
/// (204), so the gang does not spend its restarts on out-of-memory failures.
async fn wait_for_gpus(
    spec: &WorkerGroupSpec,
    baseline: Vec<crate::gpu::release::GpuUse>,
    pids: Vec<u32>,
    restart_count: u32,
    stop: &StopRequest,
) -> Result<(), LaunchError> {
    use crate::gpu::release::{wait_released, Released};
    let config = &spec.config;
    let timeout = config.gpu_release_timeout;
    let keep_strays = config.keep_strays;
    let library = crate::gpu::nvml::library_override();
    let started = tokio::time::Instant::now();
    let wait = tokio::task::spawn_blocking(move || {
        wait_released(library.as_deref(), &baseline, &pids, keep_strays, timeout)
    });
    let result = tokio::select! {
        result = tokio::time::timeout(timeout + GPU_WAIT_HANG, wait) => result,
        // The stop is handled by the loop; the blocking wait ends on its own within the bound.
        () = stop.requested() => return Ok(()),
    };
    let waited = started.elapsed();
    let released = matches!(result, Ok(Ok(Released::Yes | Released::Unreadable(_))));
    spec.publisher.event(Event::GpuReleaseWaited {
        restart_count,
        waited,
        released,
    });
    let previous = restart_count.saturating_sub(1);
    let unhealthy = |detail: String| LaunchError::GpusNotReleased {
        waited: waited.as_secs_f64(),
        previous,
        detail,
        timeout: timeout.as_secs_f64(),
    };
    match result {
        Ok(Ok(Released::Yes)) => {
            tracing::info!(
                "GPUs free of attempt {previous} after {:.1}s; starting attempt {restart_count}",
                waited.as_secs_f64()
            );
            Ok(())
        }
        Ok(Ok(Released::No(held))) => {
            let held: Vec<String> = held.iter().map(ToString::to_string).collect();
            Err(unhealthy(held.join("; ")))
        }
        Ok(Ok(Released::Unreadable(e))) => {
            tracing::warn!("cannot read the GPUs before attempt {restart_count}: {e}; not waiting");
            Ok(())
        }
        Ok(Err(e)) => Err(unhealthy(format!("the NVML reader failed: {e}"))),
        Err(_) => Err(unhealthy("an NVML call did not return".to_owned())),
    }
}

/// `<log_dir>/<run_id>_<random>`, torchrun's per-run directory, for the per-rank log and error
/// files. Without `--log-dir` it holds only the error files and lives in muster's private
/// directory ([`crate::scratch`]: `--tmp-dir`, else `$TMPDIR`, `/tmp`, `/dev/shm`): the agent's,
/// when the caller gave one, else one of the launch's own, removed when this is dropped. Either
/// way the error files' paths keep torchrun's shape (`…/<run_id>_<random>/attempt_N/<rank>/`).
/// With no writable place at all there is none (`path` is `None`) and the workers get no
/// `TORCHELASTIC_ERROR_FILE`.
struct RunDir {
    path: Option<PathBuf>,
    /// Dropped last: removes the private directory when this holds the last reference (also when
    /// the launch future is dropped half-way by an embedding caller).
    scratch: Option<Arc<crate::scratch::ScratchDir>>,
}

impl RunDir {
    fn create(
        config: &Config,
        private_dir: Option<Arc<crate::scratch::ScratchDir>>,
    ) -> Result<RunDir, LaunchError> {
        let suffix: String = (0..8)
            .map(|_| char::from(b'a' + rand::random_range(0..26u8)))
            .collect();
        let run = format!("{}_{suffix}", config.run_id);
        if let Some(dir) = &config.logs.log_dir {
            let path = dir.join(run);
            std::fs::create_dir_all(&path).map_err(|source| LaunchError::LogDir {
                path: path.clone(),
                source,
            })?;
            return Ok(RunDir {
                path: Some(path),
                scratch: None,
            });
        }
        let scratch = match private_dir {
            Some(dir) => Some(dir),
            None => crate::scratch::ScratchDir::create(config.tmp_dir.as_deref(), "muster_")?
                .map(Arc::new),
        };
        let Some(scratch) = scratch else {
            tracing::debug!("no writable directory: the workers get no TORCHELASTIC_ERROR_FILE");
            return Ok(RunDir {
                path: None,
                scratch: None,
            });
        };
        let path = scratch.path().join(run);
        std::fs::create_dir_all(&path).map_err(|source| LaunchError::TmpDir {
            path: path.clone(),
            source,
        })?;
        Ok(RunDir {
            path: Some(path),
            scratch: Some(scratch),
        })
    }

    /// Whether the directory outlives the agent (else its error files go with it).
    fn is_kept(&self) -> bool {
        self.path.is_some() && self.scratch.is_none()
    }
}

/// Runs a launch with the single-node rendezvous and no hooks.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<Outcome, LaunchError> {
    Launch::new(config).run(shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(status: ExitStatus) -> Failure {
        Failure {
            host: "h".into(),
            local_rank: 0,
            rank: 0,
            pid: 1,
            status,
            at: SystemTime::UNIX_EPOCH,
            error_file: PathBuf::new(),
            message: None,
            exception_line: None,
            oom_killed: None,
            hang: None,
            flight_recorder: Vec::new(),
        }
    }

    #[test]
    fn exit_codes_of_outcomes() {
        assert_eq!(GroupOutcome::Succeeded.exit_code(), 0);
        assert_eq!(
            GroupOutcome::Failed(failure(ExitStatus::Exited(3))).exit_code(),
            3
        );
        assert_eq!(
            GroupOutcome::Failed(failure(ExitStatus::Signaled(Signal::SIGSEGV))).exit_code(),
            139
        );
        let stopped = |signal, all_clean| GroupOutcome::Stopped { signal, all_clean };
        assert_eq!(stopped(Some(Signal::SIGTERM), false).exit_code(), 143);
        assert_eq!(stopped(Some(Signal::SIGINT), false).exit_code(), 130);
        assert_eq!(stopped(None, false).exit_code(), 143);
        assert_eq!(stopped(Some(Signal::SIGTERM), true).exit_code(), 0);
    }

    #[test]
    fn launch_errors_map_to_reserved_codes() {
        use exit_code::Coded as _;
        let nf = std::io::Error::from(std::io::ErrorKind::NotFound);
        let spawn = LaunchError::Spawn {
            program: "x".into(),
            source: nf,
        };
        assert_eq!(spawn.exit_code(), exit_code::CONFIG_ERROR);
        assert_eq!(
            LaunchError::Config("x".into()).exit_code(),
            exit_code::CONFIG_ERROR
        );
        // Environment errors (a directory that cannot be made) are the user's to fix: 202.
        let tmp = LaunchError::TmpDir {
            path: "/ro/muster_x".into(),
            source: std::io::Error::from(std::io::ErrorKind::ReadOnlyFilesystem),
        };
        assert_eq!(tmp.exit_code(), exit_code::CONFIG_ERROR);
        assert!(tmp.to_string().contains("/ro/muster_x"));
        assert!(tmp.to_string().contains("emptyDir"));
        let timeout = LaunchError::Rendezvous(rendezvous::rdzv::RdzvError::Timeout("x".into()));
        assert!(timeout.is_rendezvous_timeout());
        assert_eq!(timeout.exit_code(), exit_code::RENDEZVOUS_TIMEOUT);
        assert_eq!(timeout.to_string(), "rendezvous timed out: x");
        let fatal = LaunchError::Rendezvous(rendezvous::rdzv::RdzvError::Fatal {
            exit_code: 7,
            reason: "rank 3 failed".into(),
        });
        assert_eq!(fatal.exit_code(), 7);
        assert!(!fatal.is_rendezvous_timeout());
        let gpus = LaunchError::GpusNotReleased {
            waited: 60.04,
            previous: 0,
            detail: "GPU 0 held".into(),
            timeout: 60.0,
        };
        assert_eq!(gpus.exit_code(), exit_code::UNHEALTHY_GPU);
        assert_eq!(
            gpus.to_string(),
            "the GPUs were not released 60.0s after attempt 0 stopped: GPU 0 held; this node is \
             unhealthy (--gpu-release-timeout 60)"
        );
        // The network check's verdict ends with its own code; its store failing is node 0 lost.
        let slow = LaunchError::NetworkCheckFailed("node 2 (host-2) is slow".into());
        assert_eq!(slow.exit_code(), exit_code::NETWORK_CHECK_FAILED);
        assert_eq!(slow.to_string(), "node 2 (host-2) is slow");
        let lost =
            LaunchError::NetworkCheck(crate::netcheck::gang::CheckError::Store("eof".into()));
        assert_eq!(lost.exit_code(), exit_code::STORE_HOST_LOST);
    }

    #[test]
    fn log_dir_errors_name_the_option_and_its_source() {
        let mut logs = config::LogConfig {
            log_dir: Some(PathBuf::from("afile")),
            log_dir_origin: "environment variable MUSTER_LOG_DIR".into(),
            ..config::LogConfig::default()
        };
        let err = || LaunchError::LogDir {
            path: PathBuf::from("afile/job_abc"),
            source: std::io::Error::from_raw_os_error(libc::ENOTDIR),
        };
        let named = err().naming_log_dir(&logs);
        assert_eq!(exit_code::Coded::exit_code(&named), exit_code::CONFIG_ERROR);
        let text = named.to_string();
        assert!(
            text.starts_with(
                "invalid --log-dir `afile` (environment variable MUSTER_LOG_DIR): cannot create afile/job_abc: "
            ),
            "{text}"
        );
        logs.log_dir = None;
        assert!(matches!(
            err().naming_log_dir(&logs),
            LaunchError::LogDir { .. }
        ));
    }

    fn sh(script: &str, nproc: u32) -> Config {
        let mut c = Config::for_program("/bin/sh", vec!["-c".into(), script.into()], nproc);
        // Keep the test output clean: no worker reaches the console.
        c.logs.local_ranks_filter = Some(std::collections::BTreeSet::new());
        c.shutdown_timeout = std::time::Duration::from_secs(5);
        c
    }

    #[tokio::test]
    async fn a_failure_stops_the_group_and_restarts_it() {
        let mut config = sh(r#"[ "$RANK" = 1 ] && exit 3; exec sleep 30"#, 3);
        config.max_restarts = 1;
        let launch = Launch::new(config);
        let mut observer = launch.observer();
        let started = tokio::time::Instant::now();
        let outcome = launch.run(CancellationToken::new()).await.unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(outcome.exit_code, 3);
        assert_eq!(outcome.attempts, 2);
        let GroupOutcome::Failed(f) = &outcome.last else {
            panic!("{outcome:?}")
        };
        assert_eq!((f.rank, f.status), (1, ExitStatus::Exited(3)));
        assert_eq!(
            *observer.phase.borrow_and_update(),
            Phase::Finished { exit_code: 3 }
        );
        let mut events = Vec::new();
        while let Ok(e) = observer.events.try_recv() {
            events.push(e);
        }
        let started = |n| {
            events
                .iter()
                .filter(|e| matches!(e, Event::WorkerStarted { restart_count, .. } if *restart_count == n))
                .count()
        };
        assert_eq!((started(0), started(1)), (3, 3));
        assert!(events.contains(&Event::Restarting {
            restart_count: 1,
            cause: RestartCause::WorkerFailure
        }));
        // The two healthy ranks were stopped with SIGTERM.
        let terminated = events
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    Event::WorkerExited {
                        status: ExitStatus::Signaled(Signal::SIGTERM),
                        ..
                    }
                )
            })
            .count();
        assert_eq!(terminated, 4);
    }

    fn gpu_event(kind: crate::gpu::watch::EventKind) -> crate::gpu::watch::GpuEvent {
        crate::gpu::watch::GpuEvent {
            gpu: crate::gpu::watch::GpuId {
                index: 3,
                uuid: Some("GPU-3".into()),
                pci_bus_id: Some("00000000:1B:00.0".into()),
            },
            at: SystemTime::now(),
            kind,
        }
    }

    #[tokio::test]
    async fn a_fatal_gpu_fault_stops_the_workers_and_the_node() {
        let mut config = sh("exec sleep 30", 2);
        // A restart budget does not help a node whose GPU fell off the bus.
        config.max_restarts = 3;
        let watch = crate::gpu::watch::Watch::new();
        let launch = Launch::new(config).with_gpu_watch(watch.clone());
        let mut observer = launch.observer();
        let run = tokio::spawn(launch.run(CancellationToken::new()));
        let mut started = 0;
        while started < 2 {
            if let Ok(Event::WorkerStarted { .. }) = observer.events.recv().await {
                started += 1;
            }
        }
        // A non-fatal XID changes nothing.
        watch.record(gpu_event(crate::gpu::watch::EventKind::Xid(13)));
        watch.record(gpu_event(crate::gpu::watch::EventKind::Xid(79)));
        let err = tokio::time::timeout(std::time::Duration::from_secs(20), run)
            .await
            .expect("the launch ends")
            .unwrap()
            .unwrap_err();
        assert_eq!(exit_code::Coded::exit_code(&err), exit_code::UNHEALTHY_GPU);
        let text = err.to_string();
        assert!(
            text.starts_with(
                "fatal GPU fault: GPU 3 (GPU-3, 00000000:1B:00.0): XID 79 (GPU has fallen off the bus) at "
            ),
            "{text}"
        );
        let mut exits = 0;
        let mut restarts = 0;
        while let Ok(e) = observer.events.try_recv() {
            match e {
                Event::WorkerExited {
                    status: ExitStatus::Signaled(Signal::SIGTERM),
                    ..
                } => exits += 1,
                Event::Restarting { .. } => restarts += 1,
                _ => {}
            }
        }
        assert_eq!((exits, restarts), (2, 0));
    }

    #[tokio::test]
    async fn a_node_that_faulted_before_the_first_attempt_starts_none() {
        let watch = crate::gpu::watch::Watch::new();
        watch.record(gpu_event(crate::gpu::watch::EventKind::Lost));
        let err = Launch::new(sh("exit 0", 1))
            .with_gpu_watch(watch)
            .run(CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(exit_code::Coded::exit_code(&err), exit_code::UNHEALTHY_GPU);
        assert!(err.to_string().contains("GPU lost"), "{err}");
    }

    #[tokio::test]
    async fn cancelling_the_token_stops_the_workers() {
        let shutdown = CancellationToken::new();
        let launch = Launch::new(sh(r#"[ "$EXTRA" = yes ] && exec sleep 30"#, 2))
            .with_worker_env("EXTRA", "yes");
        let mut observer = launch.observer();
        let run = tokio::spawn(launch.run(shutdown.clone()));
        observer
            .phase
            .wait_for(|p| matches!(p, Phase::Running { .. }))
            .await
            .unwrap();
        shutdown.cancel();
        let outcome = run.await.unwrap().unwrap();
        assert_eq!(
            outcome.last,
            GroupOutcome::Stopped {
                signal: None,
                all_clean: false
            }
        );
        assert_eq!(outcome.exit_code, 143);
    }

    #[tokio::test]
    async fn an_abandoned_launch_kills_its_workers() {
        let launch = Launch::new(sh("exec sleep 30", 2));
        let mut observer = launch.observer();
        let run = tokio::spawn(launch.run(CancellationToken::new()));
        let mut pids = Vec::new();
        while pids.len() < 2 {
            if let Ok(Event::WorkerStarted { pid, .. }) = observer.events.recv().await {
                pids.push(pid);
            }
        }
        run.abort();
        let _ = run.await;
        let alive = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit(')')
                        .next()
                        .map(|r| !r.trim_start().starts_with('Z'))
                })
                .unwrap_or(false)
        };
        for _ in 0..100 {
            if !pids.iter().any(|p| alive(*p)) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("workers {pids:?} outlived the abandoned launch");
    }

    #[tokio::test]
    async fn a_helper_in_its_own_session_goes_with_its_attempt() {
        let dir = std::env::temp_dir().join(format!("muster-strays-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Each attempt's rank leaves `setsid sleep` behind (a new session: no process-group
        // signal reaches it), checks that it runs (else 9), and fails.
        let script = format!(
            "setsid sleep 300 & echo $! > {}/helper_$TORCHELASTIC_RESTART_COUNT; \
             sleep 0.3; kill -0 $! || exit 9; exit 3",
            dir.display()
        );
        let mut config = sh(&script, 1);
        config.max_restarts = 1;
        let outcome = Launch::new(config)
            .run(CancellationToken::new())
            .await
            .unwrap();
        assert_eq!((outcome.exit_code, outcome.attempts), (3, 2));
        for attempt in 0..2 {
            let text = std::fs::read_to_string(dir.join(format!("helper_{attempt}"))).unwrap();
            let pid: u32 = text.trim().parse().unwrap();
            assert!(
                !crate::gpu::release::alive(pid),
                "attempt {attempt}'s helper {pid} outlived the launch"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
