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
//!
//! Where each piece lives: this file holds [`Launch`] and its run; the attempt loop is in
//! `attempts.rs`, one attempt's workers in `group.rs`, what attempts end with in `outcome.rs`,
//! the launch's own errors in `error.rs`, the wait for released GPUs in `gpu_wait.rs`, and the
//! run directory in `run_dir.rs`.

mod attempts;
pub mod bad_nodes;
pub mod config;
pub mod crash_loop;
pub mod env;
mod error;
pub mod gang_cause;
mod gpu_wait;
mod group;
pub mod leave;
pub mod observe;
mod outcome;
pub mod rdzv;
pub mod reaper;
mod repeat;
pub mod restart_timeline;
mod run_dir;
pub mod signals;
pub mod standby;
pub mod stop_mark;
mod store_host;
pub mod strays;
pub mod summary;
pub mod warm_share;
pub mod watchdog;

use std::ffi::OsString;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use error::LaunchError;
pub use group::{run_group, Attempt, WorkerGroupSpec};
pub use observe::{Event, Observer, Phase, Publisher, RestartCause};
pub use outcome::{Failure, FailurePost, GroupOutcome, Outcome, RankAssignment, Round};
pub use rdzv::{AfterGroup, BoxFuture, GangRestart, LocalRendezvous, Rendezvous};
pub use reaper::{ExitStatus, Reaper};
pub use signals::{StopRequest, TerminateHook};
pub use store_host::HostedStore;
pub use watchdog::{RankWriter, Watchdog, WatchedAttempt, WatchedWorker};

use crate::exit_code;
use crate::logs::{Console, LogSink};
use attempts::attempts;
use run_dir::RunDir;

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
    rank_marks: Option<RankMarksSource>,
}

/// The highest step any local rank reported since the given instant (ranks that connected
/// before it belong to an earlier attempt); `None` when none did. Read by the crash-loop guard.
pub type StepSource = Arc<dyn Fn(tokio::time::Instant) -> Option<u64> + Send + Sync>;

/// The marks of every local rank that reported since the given instant (an attempt's start):
/// the end of a restart's timeline ([`restart_timeline`]).
pub type RankMarksSource =
    Arc<dyn Fn(tokio::time::Instant) -> Vec<restart_timeline::RankMarks> + Send + Sync>;

/// Variables for one rank of one attempt, computed just before it starts:
/// `(restart_count, rank, local_rank, the rank's own directory)` to `(name, value)` pairs, set
/// after every other variable. The directory is the rank's `attempt_<N>/<local rank>` in the
/// agent's private run directory (made just before, holding its error file), when it has one;
/// under `--log-dir` it is the user's and none is passed.
pub type RankEnv =
    Arc<dyn Fn(u32, u32, u32, Option<&std::path::Path>) -> Vec<(String, OsString)> + Send + Sync>;

impl Launch {
    pub fn new(config: Config) -> Self {
        let publisher = Publisher::for_ranks(config.nproc_per_node);
        Self {
            config: Arc::new(config),
            rendezvous: None,
            terminate_hook: None,
            publisher,
            logs: None,
            extra_env: Vec::new(),
            rank_cpus: Vec::new(),
            rank_env: None,
            watchdog: None,
            gpu_watch: None,
            private_dir: None,
            leave: None,
            steps: None,
            rank_marks: None,
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

    /// Where each attempt's local ranks' own marks come from (`init_process_group`, the first
    /// step): a restart's timeline ends with them.
    #[must_use]
    pub fn with_rank_marks(mut self, marks: RankMarksSource) -> Self {
        self.rank_marks = Some(marks);
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
            rank_marks,
        } = self;
        let mut rendezvous = rendezvous_or_local(rendezvous, &config)?;

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
        let (sink, writer) = console(logs)?;
        let run_dir =
            RunDir::create(&config, private_dir).map_err(|e| e.naming_log_dir(&config.logs))?;
        note_log_files(&run_dir, &config);

        let spec = WorkerGroupSpec {
            config: config.clone(),
            hostname: crate::host::short_name(),
            run_dir: run_dir.path.clone(),
            files: config.logs.log_dir.is_some(),
            reaper: reaper.clone(),
            logs: sink.clone(),
            publisher: publisher.clone(),
            extra_env,
            rank_cpus,
            rank_env,
            watchdog,
            standby: standby_pool(&config, &reaper, run_dir.path.as_deref(), &publisher),
            rank_marks,
        };
        if let Some(pool) = &spec.standby {
            rendezvous.share_warm_modules(pool.share());
        }
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
        if let Some(pool) = &spec.standby {
            pool.stop_all();
        }
        if let Ok(outcome) = &result {
            let text = final_summary(
                outcome,
                rendezvous.gang_cause(),
                &spec,
                &run_dir,
                gpu_watch.as_ref(),
            );
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

/// The warm standbys' pool under `--warm-restart on`, for a Python script with a run directory
/// to keep the module lists in; `None` otherwise (every start cold, as before).
fn standby_pool(
    config: &Config,
    reaper: &Reaper,
    run_dir: Option<&std::path::Path>,
    publisher: &Publisher,
) -> Option<Arc<standby::Pool>> {
    if !config.warm_restart {
        return None;
    }
    if !config.can_restart() {
        tracing::debug!("--warm-restart: one node and --max-restarts 0, no restart can come");
        return None;
    }
    if !config.entrypoint.python {
        tracing::info!(
            "--warm-restart: {} is not a Python script, every start is cold",
            config.entrypoint.display
        );
        return None;
    }
    let dir = run_dir?.join("standby");
    match standby::Pool::new(reaper.clone(), dir) {
        Ok(pool) => {
            let pool = pool.with_publisher(publisher.clone());
            tracing::info!(
                "--warm-restart on: one standby interpreter per local rank after each attempt's first step (turn it off with --warm-restart off on a memory-tight pod)"
            );
            Some(Arc::new(pool))
        }
        Err(err) => {
            tracing::warn!(
                "--warm-restart: cannot keep the standbys' files ({err}); every start is cold"
            );
            None
        }
    }
}

/// The caller's rendezvous, else the single-node one; an error when the job needs more nodes.
fn rendezvous_or_local(
    rendezvous: Option<Box<dyn Rendezvous>>,
    config: &Config,
) -> Result<Box<dyn Rendezvous>, LaunchError> {
    match rendezvous {
        Some(r) => Ok(r),
        None if config.nnodes.max > 1 => Err(LaunchError::Config(format!(
            "--nnodes {} needs the multi-node rendezvous, which this build lacks",
            if config.nnodes.min == config.nnodes.max {
                config.nnodes.max.to_string()
            } else {
                format!("{}:{}", config.nnodes.min, config.nnodes.max)
            }
        ))),
        None => Ok(Box::new(LocalRendezvous)),
    }
}

/// The console writer the workers' output goes through: the caller's, else one started here
/// (returned too, for the launch to finish it at the end).
fn console(
    logs: Option<LogSink>,
) -> Result<(LogSink, Option<crate::logs::LogWriter>), LaunchError> {
    if let Some(sink) = logs {
        return Ok((sink, None));
    }
    let writer = crate::logs::start().map_err(|source| LaunchError::Io {
        what: "cannot start the log writer",
        source,
    })?;
    Ok((writer.sink(), Some(writer)))
}

/// Tells where the per-rank log files go, or that `--redirects`/`--tee` write none without
/// `--log-dir`.
fn note_log_files(run_dir: &RunDir, config: &Config) {
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
}

/// The summary printed when a launch ends: the gang's root cause when it is another node's,
/// then this node's own failure; empty when there is nothing to tell.
fn final_summary(
    outcome: &Outcome,
    gang_cause: Option<gang_cause::GangCause>,
    spec: &WorkerGroupSpec,
    run_dir: &RunDir,
    gpu_watch: Option<&crate::gpu::watch::Watch>,
) -> String {
    let format = spec.config.logs.format;
    // The gang's root cause, when it is another node's: named first, on every node.
    let elsewhere = gang_cause.filter(|c| c.elsewhere() && outcome.exit_code != exit_code::SUCCESS);
    let text = match (&elsewhere, format) {
        (Some(cause), config::LogFormat::Text) => summary::render_gang(cause, outcome.attempts),
        (Some(cause), config::LogFormat::Json) => {
            summary::render_gang_json(cause, outcome.attempts, outcome.exit_code, &spec.hostname)
        }
        (None, _) => String::new(),
    };
    // This node's own failure: the root cause, or (after the gang's) its evidence.
    text + &match &outcome.last {
        GroupOutcome::Failed(f) => own_failure_summary(
            f,
            outcome.attempts,
            format,
            elsewhere.is_some(),
            run_dir,
            gpu_watch,
        ),
        _ => String::new(),
    }
}

/// This node's failure in the final summary: all of it, or only its evidence (flight recorder
/// dumps, GPU events) when the gang's root cause, another node's, was `named_elsewhere`.
fn own_failure_summary(
    f: &Failure,
    attempts: u32,
    format: config::LogFormat,
    named_elsewhere: bool,
    run_dir: &RunDir,
    gpu_watch: Option<&crate::gpu::watch::Watch>,
) -> String {
    let gpu_events = gpu_watch
        .map(|w| w.summary_lines(f.rank, f.at))
        .unwrap_or_default();
    // Without --log-dir the run directory is muster's private one, gone at exit.
    let removed = run_dir.path.as_deref().filter(|_| !run_dir.is_kept());
    match (format, named_elsewhere) {
        (config::LogFormat::Text, false) => {
            summary::render(f, attempts)
                + &summary::render_flight_recorder(f, removed)
                + &summary::render_gpu_events(&gpu_events)
        }
        (config::LogFormat::Text, true) => {
            summary::render_flight_recorder(f, removed) + &summary::render_gpu_events(&gpu_events)
        }
        (config::LogFormat::Json, false) => {
            summary::render_json(f, attempts, run_dir.is_kept(), removed)
                + &summary::render_gpu_events_json(&f.host, &gpu_events)
        }
        (config::LogFormat::Json, true) => summary::render_gpu_events_json(&f.host, &gpu_events),
    }
}

/// Runs a launch with the single-node rendezvous and no hooks.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<Outcome, LaunchError> {
    Launch::new(config).run(shutdown).await
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use nix::sys::signal::Signal;

    use super::*;

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
