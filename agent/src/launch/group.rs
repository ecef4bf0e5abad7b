//! One attempt: start the local worker group with torchrun's environment, supervise it until it
//! succeeds, fails or is asked to stop, and leave nothing running behind.
//!
//! Any worker failing stops the whole local group (the stop signal to every worker's process
//! group, SIGKILL after `--shutdown-timeout`), as torchrun does; the caller decides whether to
//! restart. Whatever the outcome, the attempt's whole process tree is stopped at the end
//! ([`super::strays`]), so nothing a worker started outlives the attempt; with `--keep-strays`
//! only the workers' process groups are swept.

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::net::unix::pipe;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::config::{Config, Streams};
use super::observe::{Event, GroupResult, Phase, Publisher};
use super::reaper::{ExitReport, ExitStatus, Reaper, Spawned};
use super::signals::StopRequest;
use super::strays::{self, Scope};
use super::{env, summary, Failure, GroupOutcome, LaunchError, RankAssignment};
use crate::logs::{self, Console, LineTarget, LogSink, PumpConfig};

/// After SIGKILL, how long to wait for the kernel to deliver the exits (a process stuck in
/// uninterruptible sleep may never die; the agent must still be able to finish).
const KILL_WAIT: Duration = Duration::from_secs(10);
/// After the workers are gone, how long their output may take to drain (a grandchild that left
/// the worker's process group can hold a pipe open forever).
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// How often leftover process groups are checked while they get their grace period.
const SWEEP_POLL: Duration = Duration::from_millis(20);

/// What every attempt of the local group shares: the configuration and the agent's services.
#[derive(Clone)]
pub struct WorkerGroupSpec {
    pub config: Arc<Config>,
    /// Short host name, for log prefixes and the failure summary.
    pub hostname: String,
    /// `<log_dir>/<run_id>_<random>`: attempts go to `attempt_<n>/<local_rank>/` below it
    /// (torchrun's layout: `stdout.log`, `stderr.log`, `error.json`). Without `--log-dir`, the
    /// same tree in muster's private directory for the error files only; `None`: no writable
    /// place, no files at all.
    pub run_dir: Option<PathBuf>,
    /// Whether per-rank log files may be written (`--log-dir` was given): `--redirects` and
    /// `--tee` without it leave every stream on the console.
    pub files: bool,
    pub reaper: Reaper,
    pub logs: LogSink,
    pub publisher: Publisher,
    /// Extra variables for every worker, set after torchrun's (e.g. the checkpoint socket).
    pub extra_env: Vec<(String, OsString)>,
    /// `--numa-binding`: the CPUs local rank `i` is pinned to (`rank_cpus[i]`); empty: no pinning.
    pub rank_cpus: Vec<Vec<u32>>,
    /// Per-rank variables, set last (see [`super::RankEnv`]).
    pub rank_env: Option<super::RankEnv>,
    /// Watches each attempt for a hang.
    pub watchdog: Option<Arc<dyn super::Watchdog>>,
    /// `--warm-restart on`: the local ranks' standby interpreters.
    pub standby: Option<Arc<super::standby::Pool>>,
    /// The local ranks' own marks of an attempt (`init_process_group`, first step): the end of
    /// a restart's timeline ([`super::restart_timeline`]).
    pub rank_marks: Option<super::RankMarksSource>,
}

/// SIGKILLs the workers' process groups if the attempt is abandoned half-way (its future dropped
/// by an embedding caller): without it they would run on until the agent's thread exits.
struct KillOnDrop {
    /// The workers' process groups (each worker leads its own: its pid).
    pgids: Vec<Pid>,
    /// The attempt's process tree, when it is to be stopped with the attempt.
    tree: Option<Scope>,
    /// Tells the other launches' workers in this process (tests, embedders), which the tree
    /// must leave alone.
    reaper: Reaper,
    armed: bool,
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.armed {
            for pgid in &self.pgids {
                let _ = killpg(*pgid, Signal::SIGKILL);
            }
            if let Some(scope) = &self.tree {
                let own: std::collections::HashSet<i32> =
                    self.pgids.iter().map(|pgid| pgid.as_raw()).collect();
                let foreign = || {
                    let registered = self.reaper.registered().into_iter();
                    registered.filter(|pid| !own.contains(pid)).collect()
                };
                strays::kill_tree_now(scope, &foreign);
            }
        }
    }
}

/// One finished attempt: how it ended, and every process id that belonged to it (the workers
/// and the strays stopped with them), for the GPU release wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub outcome: GroupOutcome,
    pub pids: Vec<u32>,
    /// When its supervision ended (a rank failed or hung, a stop came, or every rank exited):
    /// where a restart's timeline starts.
    pub ended: tokio::time::Instant,
}

struct Worker {
    local_rank: u32,
    rank: u32,
    pid: Pid,
    status: Option<ExitStatus>,
    /// When the agent reaped it.
    seen: Option<SystemTime>,
    error_file: Option<PathBuf>,
    /// The last exception line of its stderr.
    exception: Arc<logs::ExceptionLine>,
}

impl WorkerGroupSpec {
    fn console_target(&self, local_rank: u32, rank: u32, stream: Streams) -> Option<LineTarget> {
        let logs = &self.config.logs;
        let redirected = self.files && logs.redirects.for_rank(local_rank).contains(stream);
        let teed = logs.tee.for_rank(local_rank).contains(stream);
        let shown = logs
            .local_ranks_filter
            .as_ref()
            .is_none_or(|f| f.contains(&local_rank));
        if !shown || (redirected && !teed) {
            return None;
        }
        Some(self.line_target(local_rank, rank, stream))
    }

    /// How a rank's lines of `stream` look on the console, whether or not they are shown there.
    fn line_target(&self, local_rank: u32, rank: u32, stream: Streams) -> LineTarget {
        let logs = &self.config.logs;
        LineTarget {
            console: if stream == Streams::STDOUT {
                Console::Stdout
            } else {
                Console::Stderr
            },
            format: logs.format,
            prefix: logs::render_template(
                &logs.prefix_template,
                &self.hostname,
                rank,
                local_rank,
                &self.config.role,
            ),
            host: self.hostname.clone(),
            rank,
            local_rank,
            stream: stream_name(stream),
        }
    }

    /// Writes the agent's lines about a rank (its stack dump) as that rank's stderr shows on the
    /// console — also for a rank the console filter hides or that is redirected to files: the
    /// dump is for the pod log.
    fn rank_writer(&self, ranks: Vec<(u32, u32)>) -> super::RankWriter {
        let targets: Vec<(u32, LineTarget)> = ranks
            .into_iter()
            .map(|(local_rank, rank)| {
                (
                    local_rank,
                    self.line_target(local_rank, rank, Streams::STDERR),
                )
            })
            .collect();
        let sink = self.logs.clone();
        Arc::new(move |local_rank: u32, lines: &[String]| {
            if let Some((_, target)) = targets.iter().find(|(l, _)| *l == local_rank) {
                sink.agent_line(target.console, target.encode_lines(lines));
            }
        })
    }

    fn wants_file(&self, local_rank: u32, stream: Streams) -> bool {
        let logs = &self.config.logs;
        self.files
            && (logs.redirects.for_rank(local_rank).contains(stream)
                || logs.tee.for_rank(local_rank).contains(stream))
    }
}

/// The `stream` label of a worker pipe.
fn stream_name(stream: Streams) -> &'static str {
    if stream == Streams::STDOUT {
        "stdout"
    } else {
        "stderr"
    }
}

/// Starts local rank `local_rank`: its log directory `dir` (if any), its environment, its
/// process (in its own session, pinned where asked), or hands its start to its warm standby.
/// Returns the child, the path of its error file (if any), and whether it was a standby.
async fn start_rank(
    spec: &WorkerGroupSpec,
    assignment: &RankAssignment,
    dir: Option<&std::path::Path>,
    local_rank: u32,
    agent: Pid,
    exits_tx: &mpsc::UnboundedSender<ExitReport>,
    flight_recorder: &[(&'static str, OsString)],
) -> Result<(Spawned, Option<PathBuf>, bool), LaunchError> {
    let config = &spec.config;
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir).map_err(|source| {
            let path = dir.to_path_buf();
            if spec.files {
                LaunchError::LogDir { path, source }
            } else {
                LaunchError::TmpDir { path, source }
            }
        })?;
    }
    let error_file = dir.map(|d| d.join("error.json"));
    let overlay = rank_overlay(
        spec,
        assignment,
        local_rank,
        error_file.as_deref(),
        flight_recorder,
    );
    let rank_vars: Vec<(OsString, OsString)> = spec
        .rank_env
        .as_ref()
        .map_or_else(Vec::new, |f| {
            f(
                assignment.restart_count,
                assignment.base_global_rank + local_rank,
                local_rank,
                dir.filter(|_| !spec.files),
            )
        })
        .into_iter()
        .map(|(k, v)| (OsString::from(k), v))
        .collect();
    // A first attempt has no standby, except a spare's that takes a place in it.
    if let Some(pool) = spec
        .standby
        .as_ref()
        .filter(|pool| assignment.restart_count > 0 || pool.holds(local_rank))
    {
        let rank = assignment.base_global_rank + local_rank;
        // Boxed: the handover's future would otherwise grow every attempt's.
        let warm = Box::pin(warm_start(
            spec, pool, local_rank, &overlay, &rank_vars, exits_tx,
        ));
        match warm.await {
            Ok(child) => {
                tracing::info!(
                    "rank {rank} (local rank {local_rank}): warm start in its standby (pid {})",
                    child.pid
                );
                return Ok((child, error_file, true));
            }
            Err(why) => tracing::info!("rank {rank} (local rank {local_rank}): cold start: {why}"),
        }
    }
    let mut cmd = crate::sys::WorkerCommand::new(&config.entrypoint.program, agent);
    cmd.args(&config.entrypoint.args)
        .envs(overlay)
        .envs(rank_vars)
        .cpus(rank_cpus(spec, local_rank));
    let child = spec
        .reaper
        .spawn_worker(&cmd, local_rank as usize, exits_tx.clone())
        .map_err(|source| LaunchError::Spawn {
            program: config.entrypoint.program.to_string_lossy().into_owned(),
            source,
        })?;
    Ok((child, error_file, false))
}

/// The CPUs local rank `local_rank` is pinned to (`--numa-binding`), if any.
fn rank_cpus(spec: &WorkerGroupSpec, local_rank: u32) -> Option<nix::sched::CpuSet> {
    spec.rank_cpus
        .get(local_rank as usize)
        .filter(|cpus| !cpus.is_empty())
        .map(|cpus| cpu_set(cpus))
}

/// A rank's variables on top of the agent's, in the order they are set (later wins): torchrun's,
/// the flight recorder's, muster's for every worker, the warm standby's module file. The
/// per-rank `rank_env` comes after these.
fn rank_overlay(
    spec: &WorkerGroupSpec,
    assignment: &RankAssignment,
    local_rank: u32,
    error_file: Option<&std::path::Path>,
    flight_recorder: &[(&'static str, OsString)],
) -> Vec<(OsString, OsString)> {
    let worker_env = env::worker_env(&spec.config, assignment, local_rank, error_file, &|k| {
        std::env::var_os(k)
    });
    let mut overlay: Vec<(OsString, OsString)> = worker_env
        .into_iter()
        .map(|(k, v)| (OsString::from(k), v))
        .chain(
            flight_recorder
                .iter()
                .map(|(k, v)| (OsString::from(k), v.clone())),
        )
        .chain(
            spec.extra_env
                .iter()
                .map(|(k, v)| (OsString::from(k), v.clone())),
        )
        .collect();
    if let Some(pool) = &spec.standby {
        overlay.push((
            super::standby::MODULES_ENV.into(),
            pool.modules_file(local_rank).into_os_string(),
        ));
    }
    overlay
}

/// Hands local rank `local_rank`'s start to its standby, when the pool's decision allows.
async fn warm_start(
    spec: &WorkerGroupSpec,
    pool: &super::standby::Pool,
    local_rank: u32,
    overlay: &[(OsString, OsString)],
    rank_vars: &[(OsString, OsString)],
    exits_tx: &mpsc::UnboundedSender<ExitReport>,
) -> Result<Spawned, super::standby::Cold> {
    let entrypoint = &spec.config.entrypoint;
    // The slot's environment (what the standby was started with) and the rank's, which adds the
    // per-rank variables: the agent's environment read once for both.
    let slot_env: Vec<(OsString, OsString)> =
        std::env::vars_os().chain(overlay.iter().cloned()).collect();
    let wanted = super::standby::Slot::new(
        entrypoint,
        slot_env.iter().cloned(),
        pool.recorded(local_rank),
    );
    let taken = pool.take(local_rank, wanted.as_ref())?;
    let env: Vec<(OsString, OsString)> = slot_env
        .into_iter()
        .chain(rank_vars.iter().cloned())
        .collect();
    let cwd = std::env::current_dir().ok();
    pool.hand_over(
        taken,
        &entrypoint.args,
        &env,
        cwd.as_deref(),
        local_rank as usize,
        exits_tx,
    )
    .await
}

/// Starts each local rank's standby once the rank has recorded its modules (the attempt's first
/// step); the returned task is aborted when the attempt ends.
fn start_standbys(
    spec: &WorkerGroupSpec,
    assignment: &RankAssignment,
    flight_recorder: &[(&'static str, OsString)],
) -> Option<tokio::task::JoinHandle<()>> {
    let pool = spec.standby.as_ref()?;
    let plans = standby_plans(spec, assignment, flight_recorder);
    Some(tokio::spawn(super::standby::start_after_first_step(
        Arc::clone(pool),
        plans,
    )))
}

/// The standbys of a node waiting as a spare: the rank slots it would run, with an assignment
/// of its own making. Only what differs per attempt depends on the assignment ([`PER_ATTEMPT`]:
/// none of it is in a standby's environment; the handover brings the real values), and the
/// flight recorder's file is per attempt too.
///
/// [`PER_ATTEMPT`]: super::standby::PER_ATTEMPT
pub(super) fn spare_plans(spec: &WorkerGroupSpec) -> Vec<super::standby::Plan> {
    let unassigned = RankAssignment {
        node_rank: 0,
        group_world_size: 1,
        base_global_rank: 0,
        world_size: spec.config.nproc_per_node,
        master_addr: String::new(),
        master_port: 0,
        restart_count: 0,
        run_id: String::new(),
    };
    let attempt_dir = spec.run_dir.as_ref().map(|d| d.join("attempt_0"));
    let flight_recorder =
        crate::watch::flight_recorder::decide(attempt_dir.as_deref(), &|k| std::env::var_os(k));
    standby_plans(spec, &unassigned, &flight_recorder.env)
}

/// One standby plan per local rank of `assignment`.
fn standby_plans(
    spec: &WorkerGroupSpec,
    assignment: &RankAssignment,
    flight_recorder: &[(&'static str, OsString)],
) -> Vec<super::standby::Plan> {
    (0..spec.config.nproc_per_node)
        .map(|local_rank| super::standby::Plan {
            local_rank,
            entrypoint: spec.config.entrypoint.clone(),
            overlay: rank_overlay(spec, assignment, local_rank, None, flight_recorder),
            cpus: rank_cpus(spec, local_rank),
        })
        .collect()
}

/// Runs one attempt of the local worker group to its end.
pub async fn run_group(
    spec: &WorkerGroupSpec,
    assignment: &RankAssignment,
    stop: &StopRequest,
    mut failure_post: Option<super::FailurePost>,
    restarted: Option<super::restart_timeline::Restarted>,
) -> Result<Attempt, LaunchError> {
    let config = &spec.config;
    let restart_count = assignment.restart_count;
    // Taken before the first worker exists: every process of the attempt starts after it.
    let tree = Scope::starting_now().filter(|_| !config.keep_strays);
    super::stop_mark::clear(&spec.extra_env);
    let attempt_dir = spec
        .run_dir
        .as_ref()
        .map(|d| d.join(format!("attempt_{restart_count}")));
    let attempt_started = tokio::time::Instant::now();
    let attempt_started_at = SystemTime::now();
    // Each rank's collective trace, dumped into the attempt's directory on an NCCL timeout.
    let flight_recorder =
        crate::watch::flight_recorder::decide(attempt_dir.as_deref(), &|k| std::env::var_os(k));
    let oom = OomCount::now();
    let mut tree = tree;
    if let Some(pool) = &spec.standby {
        pool.begin_attempt(config.nproc_per_node);
    }
    let mut group = Group::start(
        spec,
        assignment,
        attempt_dir.as_deref(),
        &flight_recorder.env,
        tree.as_ref(),
        stop,
    )
    .await?;
    if let Some(scope) = tree.as_mut() {
        // Warm ranks started before the attempt: their process trees are the attempt's too.
        scope.adopted.extend(group.adopted.iter().copied());
        group.guard.tree = Some(scope.clone());
    }
    let standbys = start_standbys(spec, assignment, &flight_recorder.env);
    let timeline = restarted
        .and_then(|restarted| time_restart(spec, assignment, restarted, &group, attempt_started));
    let (exited_tx, hang_watch) = watch_for_hangs(
        spec,
        assignment,
        &group.workers,
        attempt_started,
        attempt_dir.clone(),
    );
    tokio::pin!(hang_watch);
    let ended = supervise(
        spec,
        &mut group,
        stop,
        &mut failure_post,
        &exited_tx,
        hang_watch.as_mut(),
        &oom,
    )
    .await;
    let ended_at = tokio::time::Instant::now();
    if let Some(task) = standbys {
        task.abort();
    }
    if let Some(task) = timeline {
        task.abort();
    }
    stop_remaining(spec, &mut group, &ended, stop).await;
    let pids = sweep_attempt(spec, &group, tree.as_ref(), stop).await;
    group.guard.armed = false;
    drain(&mut group.pumps, &group.pipes_closed).await;
    let failure = ended_failure(spec, &group, ended.failure, ended.hung, &mut failure_post);
    let outcome = judge(
        spec,
        &group,
        failure.map(|mut f| {
            f.flight_recorder = flight_recorder.dumps(attempt_started_at);
            f
        }),
        ended.stopped,
        stop,
    );
    Ok(Attempt {
        outcome,
        pids,
        ended: ended_at,
    })
}

/// How often a restarted attempt's rank marks are read until every local rank stepped.
const MARKS_POLL: Duration = Duration::from_millis(50);

/// Watches a restarted attempt until every local rank reported its first step, then logs the
/// restart's phases and publishes them ([`Event::RestartTimed`]); `None` without rank marks.
fn time_restart(
    spec: &WorkerGroupSpec,
    assignment: &RankAssignment,
    restarted: super::restart_timeline::Restarted,
    group: &Group,
    attempt_started: tokio::time::Instant,
) -> Option<tokio::task::JoinHandle<()>> {
    let marks = spec.rank_marks.clone()?;
    let agent = restarted.spawned(tokio::time::Instant::now());
    let ranks = group.workers.len();
    let warm = group.adopted.len();
    let publisher = spec.publisher.clone();
    let restart_count = assignment.restart_count;
    let node_rank = assignment.node_rank;
    Some(tokio::spawn(async move {
        loop {
            let seen = marks(attempt_started);
            if let Some(phases) = super::restart_timeline::phases(&agent, &seen, ranks) {
                let cost = super::restart_timeline::RestartCost {
                    restart_count,
                    node_rank,
                    phases,
                    warm,
                    ranks,
                };
                tracing::info!("{cost}");
                publisher.event(Event::RestartTimed(cost));
                return;
            }
            tokio::time::sleep(MARKS_POLL).await;
        }
    }))
}

/// The attempt's workers while it runs: their exits, their output pumps, and the guard that
/// kills them when the attempt is dropped half-way.
struct Group {
    // Fields drop in this order: the guard kills before the pumps and the exits go.
    guard: KillOnDrop,
    /// Cancelled when the pumps must give up on pipes that outlive the workers (see `drain`).
    pipes_closed: CancellationToken,
    pumps: JoinSet<()>,
    workers: Vec<Worker>,
    exits: mpsc::UnboundedReceiver<ExitReport>,
    restart_count: u32,
    /// The pids of the ranks started in a warm standby.
    adopted: Vec<i32>,
}

impl Group {
    /// Starts every local rank of the attempt with its output pumps, all or nothing: when one
    /// cannot start, the ranks already started (and what they started) are killed.
    async fn start(
        spec: &WorkerGroupSpec,
        assignment: &RankAssignment,
        attempt_dir: Option<&std::path::Path>,
        flight_recorder: &[(&'static str, OsString)],
        tree: Option<&Scope>,
        stop: &StopRequest,
    ) -> Result<Group, LaunchError> {
        let restart_count = assignment.restart_count;
        let (exits_tx, exits) = mpsc::unbounded_channel::<ExitReport>();
        let mut group = Group {
            guard: KillOnDrop {
                pgids: Vec::new(),
                tree: tree.cloned(),
                reaper: spec.reaper.clone(),
                armed: true,
            },
            pipes_closed: CancellationToken::new(),
            pumps: JoinSet::new(),
            workers: Vec::new(),
            exits,
            restart_count,
            adopted: Vec::new(),
        };
        let agent = nix::unistd::getpid();
        for local_rank in 0..spec.config.nproc_per_node {
            let rank = assignment.base_global_rank + local_rank;
            let dir = attempt_dir.map(|d| d.join(local_rank.to_string()));
            // All or nothing: when this rank or one of its log pumps cannot start, the ranks
            // already started must not run without it.
            let started = start_rank(
                spec,
                assignment,
                dir.as_deref(),
                local_rank,
                agent,
                &exits_tx,
                flight_recorder,
            )
            .await
            .and_then(|(child, error_file, warm)| {
                if warm {
                    group.adopted.push(child.pid as i32);
                }
                group.adopt(spec, child, error_file, (local_rank, rank), dir.as_deref())
            });
            if let Err(err) = started {
                stop_workers(
                    &mut group.workers,
                    &mut group.exits,
                    Signal::SIGKILL,
                    Duration::ZERO,
                    stop,
                )
                .await;
                if let Some(scope) = tree {
                    stop_strays(
                        spec,
                        scope,
                        &group.workers,
                        restart_count,
                        Duration::ZERO,
                        stop,
                    )
                    .await;
                }
                return Err(err);
            }
        }
        drop(exits_tx);
        spec.publisher.phase(Phase::Running { restart_count });
        tracing::debug!(
            "started {} worker(s), attempt {restart_count}",
            group.workers.len()
        );
        Ok(group)
    }

    /// Takes a just-started rank into the group: its process group under the guard, its output
    /// pumps (`dir`: its log directory), the event that it started.
    fn adopt(
        &mut self,
        spec: &WorkerGroupSpec,
        mut child: Spawned,
        error_file: Option<PathBuf>,
        (local_rank, rank): (u32, u32),
        dir: Option<&std::path::Path>,
    ) -> Result<(), LaunchError> {
        let pid = child.pid;
        self.guard.pgids.push(Pid::from_raw(pid as i32));
        let exception = Arc::new(logs::ExceptionLine::default());
        self.workers.push(Worker {
            local_rank,
            rank,
            pid: Pid::from_raw(pid as i32),
            status: None,
            seen: None,
            error_file,
            exception: Arc::clone(&exception),
        });
        let streams = [
            (
                Streams::STDOUT,
                child.stdout.take().map(OwnedFd::from),
                "stdout.log",
            ),
            (
                Streams::STDERR,
                child.stderr.take().map(OwnedFd::from),
                "stderr.log",
            ),
        ];
        for (stream, fd, file_name) in streams {
            let Some(fd) = fd else { continue };
            let follow = (stream == Streams::STDERR).then(|| Arc::clone(&exception));
            let pump = start_pump(
                spec,
                (local_rank, rank),
                stream,
                fd,
                dir.map(|d| d.join(file_name)),
                &self.pipes_closed,
                follow,
            )?;
            self.pumps.spawn(pump);
        }
        spec.publisher.event(Event::WorkerStarted {
            restart_count: self.restart_count,
            local_rank,
            rank,
            pid,
        });
        Ok(())
    }
}

/// The memory cgroup's OOM kills before the attempt: a SIGKILLed rank is the OOM killer's when
/// the count rose.
struct OomCount {
    memory: Option<crate::watch::cgroup::MemoryCgroup>,
    before: Option<u64>,
}

impl OomCount {
    /// The OOM kills so far.
    fn now() -> Self {
        let memory = crate::watch::cgroup::MemoryCgroup::find();
        let before = memory
            .as_ref()
            .and_then(crate::watch::cgroup::MemoryCgroup::oom_kills);
        Self { memory, before }
    }
}

/// Hands the started workers to the hang watch, if there is one: the sender of the local ranks
/// that exited so far, and the watch's verdict (never, without a watch).
fn watch_for_hangs(
    spec: &WorkerGroupSpec,
    assignment: &RankAssignment,
    workers: &[Worker],
    started: tokio::time::Instant,
    attempt_dir: Option<PathBuf>,
) -> (
    tokio::sync::watch::Sender<Vec<u32>>,
    impl std::future::Future<Output = crate::watch::Hang>,
) {
    let (exited_tx, exited) = tokio::sync::watch::channel(Vec::<u32>::new());
    let hang_watch = spec.watchdog.as_ref().map(|watchdog| {
        watchdog.watch(super::WatchedAttempt {
            assignment: assignment.clone(),
            host: spec.hostname.clone(),
            workers: workers
                .iter()
                .map(|w| super::WatchedWorker {
                    local_rank: w.local_rank,
                    rank: w.rank,
                    pid: w.pid.as_raw() as u32,
                })
                .collect(),
            exited,
            started,
            attempt_dir,
            write: spec.rank_writer(workers.iter().map(|w| (w.local_rank, w.rank)).collect()),
        })
    });
    let hang_watch = async move {
        match hang_watch {
            Some(watch) => watch.await,
            None => std::future::pending().await,
        }
    };
    (exited_tx, hang_watch)
}

/// How the supervision of a running attempt ended.
struct Supervised {
    /// The root cause, when a worker failed.
    failure: Option<Failure>,
    /// A stop was requested.
    stopped: bool,
    /// The hang watch found a rank hung.
    hung: Option<crate::watch::Hang>,
}

/// Waits until every worker exited, one failed, a stop was requested or the hang watch found a
/// hung rank. A failure goes to `failure_post` at once.
async fn supervise(
    spec: &WorkerGroupSpec,
    group: &mut Group,
    stop: &StopRequest,
    failure_post: &mut Option<super::FailurePost>,
    exited_tx: &tokio::sync::watch::Sender<Vec<u32>>,
    mut hang_watch: std::pin::Pin<&mut impl std::future::Future<Output = crate::watch::Hang>>,
    oom: &OomCount,
) -> Supervised {
    let restart_count = group.restart_count;
    let workers = &mut group.workers;
    let exits = &mut group.exits;
    let mut ended = Supervised {
        failure: None,
        stopped: false,
        hung: None,
    };
    while workers.iter().any(|w| w.status.is_none()) {
        tokio::select! {
            biased;
            report = exits.recv() => {
                let Some((local_rank, status)) = report else { break };
                record_exit(workers, local_rank, status, restart_count, &spec.publisher);
                exited_tx.send_modify(|exited| exited.push(local_rank as u32));
                if !status.success() {
                    // Exits already reaped together with this one are candidates too: the root
                    // cause is the earliest by the workers' own error-file timestamps.
                    while let Ok((local_rank, status)) = exits.try_recv() {
                        record_exit(workers, local_rank, status, restart_count, &spec.publisher);
                    }
                    ended.failure = root_cause(workers, &spec.hostname);
                    if let Some(f) = ended.failure.as_mut() {
                        name_oom_kill(f, oom.memory.as_ref(), oom.before, restart_count, &spec.publisher);
                        // Before stopping the others: the gang orders failures by when they reach
                        // the store, and this node's peers are failing too by now.
                        if let Some(post) = failure_post.take() {
                            let _ = post.send(f.clone());
                        }
                    }
                    break;
                }
            }
            () = stop.requested() => {
                ended.stopped = true;
                break;
            }
            hang = &mut hang_watch => {
                ended.hung = Some(hang);
                break;
            }
        }
    }
    ended
}

/// Stops the workers still running once supervision ended: with the requested stop signal, else
/// SIGTERM; SIGKILL after `--shutdown-timeout`.
async fn stop_remaining(
    spec: &WorkerGroupSpec,
    group: &mut Group,
    ended: &Supervised,
    stop: &StopRequest,
) {
    if group.workers.iter().all(|w| w.status.is_some()) {
        return;
    }
    let restart_count = group.restart_count;
    spec.publisher.phase(Phase::Stopping { restart_count });
    let sig = if ended.stopped {
        stop.signal()
    } else {
        Signal::SIGTERM
    };
    if let Some(f) = &ended.failure {
        tracing::info!(
            "rank {} failed ({}): stopping the other workers with {sig}",
            f.rank,
            f.status
        );
    }
    if let Some(hang) = &ended.hung {
        tracing::info!("rank {} hung: stopping every worker with {sig}", hang.rank);
    }
    super::stop_mark::announce(&spec.extra_env);
    let mut pending = PendingExits {
        exits: &mut group.exits,
        publisher: &spec.publisher,
        restart_count,
    };
    pending
        .stop(&mut group.workers, sig, spec.config.shutdown_timeout, stop)
        .await;
}

/// Stops what is left of the attempt once its workers are gone: its process tree (`tree`),
/// else the workers' process groups. Returns every process id that belonged to the attempt.
async fn sweep_attempt(
    spec: &WorkerGroupSpec,
    group: &Group,
    tree: Option<&Scope>,
    stop: &StopRequest,
) -> Vec<u32> {
    let grace = spec.config.shutdown_timeout;
    let mut pids: Vec<u32> = group
        .workers
        .iter()
        .filter_map(|w| u32::try_from(w.pid.as_raw()).ok())
        .collect();
    match tree {
        Some(scope) => {
            let stopped = stop_strays(
                spec,
                scope,
                &group.workers,
                group.restart_count,
                grace,
                stop,
            )
            .await;
            pids.extend(stopped.pids());
        }
        None => sweep_groups(&group.workers, grace, stop).await,
    }
    pids
}

/// The attempt's failure once its workers are down: the hung rank's when the hang watch ended
/// it (posted to `failure_post` now), else the failed worker's, if any.
fn ended_failure(
    spec: &WorkerGroupSpec,
    group: &Group,
    failure: Option<Failure>,
    hung: Option<crate::watch::Hang>,
    failure_post: &mut Option<super::FailurePost>,
) -> Option<Failure> {
    let Some(hang) = hung else { return failure };
    let f = hung_failure(&group.workers, &spec.hostname, hang);
    if let Some(post) = failure_post.take() {
        let _ = post.send(f.clone());
    }
    Some(f)
}

/// How the attempt ended, published as [`Event::GroupEnded`].
fn judge(
    spec: &WorkerGroupSpec,
    group: &Group,
    failure: Option<Failure>,
    stopped: bool,
    stop: &StopRequest,
) -> GroupOutcome {
    let outcome = if let Some(f) = failure {
        GroupOutcome::Failed(f)
    } else if stopped {
        GroupOutcome::Stopped {
            signal: stop.received_signal(),
            all_clean: group
                .workers
                .iter()
                .all(|w| w.status == Some(ExitStatus::Exited(0))),
        }
    } else {
        GroupOutcome::Succeeded
    };
    spec.publisher.event(Event::GroupEnded {
        restart_count: group.restart_count,
        result: match outcome {
            GroupOutcome::Succeeded => GroupResult::Succeeded,
            GroupOutcome::Failed(_) => GroupResult::Failed,
            GroupOutcome::Stopped { .. } => GroupResult::Stopped,
        },
    });
    outcome
}

/// Stops whatever is left of the attempt's process tree once its workers are gone (their
/// helpers, in the workers' sessions or not), logs and publishes what it stopped.
async fn stop_strays(
    spec: &WorkerGroupSpec,
    scope: &Scope,
    workers: &[Worker],
    restart_count: u32,
    grace: Duration,
    stop: &StopRequest,
) -> strays::Stopped {
    let own: std::collections::HashSet<i32> = workers.iter().map(|w| w.pid.as_raw()).collect();
    let foreign = || {
        let registered = spec.reaper.registered().into_iter();
        registered.filter(|pid| !own.contains(pid)).collect()
    };
    let stopped = strays::stop_tree(scope, grace, stop, &foreign).await;
    let rank_pids: std::collections::HashSet<u32> =
        own.iter().filter_map(|p| u32::try_from(*p).ok()).collect();
    let strays = stopped
        .pids()
        .filter(|pid| !rank_pids.contains(pid))
        .count();
    if !stopped.processes.is_empty() {
        tracing::info!(
            "attempt {restart_count}: stopped {} stray process(es) the workers left behind ({} with SIGKILL): {}",
            stopped.processes.len(),
            stopped.killed,
            stopped.named()
        );
        spec.publisher.event(Event::StraysStopped {
            restart_count,
            count: u32::try_from(strays).unwrap_or(u32::MAX),
            killed: u32::try_from(stopped.killed).unwrap_or(u32::MAX),
        });
    }
    if !stopped.survivors.is_empty() {
        tracing::error!(
            "attempt {restart_count}: {} did not die after SIGKILL",
            rendezvous::words::counted("process", &stopped.survivors)
        );
    }
    stopped
}

/// Watches one of a worker's pipes: the console target and, when asked for, the log file.
fn start_pump(
    spec: &WorkerGroupSpec,
    (local_rank, rank): (u32, u32),
    stream: Streams,
    fd: OwnedFd,
    file_path: Option<PathBuf>,
    closed: &CancellationToken,
    exception: Option<Arc<logs::ExceptionLine>>,
) -> Result<impl std::future::Future<Output = ()> + Send + 'static, LaunchError> {
    let receiver = pipe::Receiver::from_owned_fd(fd).map_err(|source| LaunchError::Io {
        what: "cannot watch a worker's output pipe",
        source,
    })?;
    let console = spec.console_target(local_rank, rank, stream);
    let counters = spec.logs.stats().stream(rank, stream_name(stream));
    // `wants_file` implies `--log-dir`, hence a run directory and a path.
    let file = match file_path.filter(|_| spec.wants_file(local_rank, stream)) {
        Some(path) => Some(Arc::new(
            logs::LogFile::create(path.clone(), console.is_some(), Arc::clone(&counters))
                .map_err(|source| LaunchError::LogDir { path, source })?,
        )),
        None => None,
    };
    let config = PumpConfig {
        console,
        file,
        progress_interval: spec.config.logs.progress_interval,
        counters,
        exception,
    };
    Ok(logs::pump(
        receiver,
        config,
        spec.logs.clone(),
        closed.clone(),
    ))
}

fn record_exit(
    workers: &mut [Worker],
    local_rank: usize,
    status: ExitStatus,
    restart_count: u32,
    publisher: &Publisher,
) {
    let Some(w) = workers
        .iter_mut()
        .find(|w| w.local_rank as usize == local_rank)
    else {
        return;
    };
    w.status = Some(status);
    w.seen = w.seen.or_else(|| Some(SystemTime::now()));
    publisher.event(Event::WorkerExited {
        restart_count,
        local_rank: w.local_rank,
        rank: w.rank,
        status,
    });
}

/// The first failure among the workers that have failed so far: by the timestamp the worker
/// wrote into its error file (torch's `@record`), else by when the agent saw the exit, as torchrun
/// orders them.
fn root_cause(workers: &[Worker], host: &str) -> Option<Failure> {
    let mut candidates: Vec<(u64, usize, Failure)> = workers
        .iter()
        .enumerate()
        .filter_map(|(order, w)| {
            let status = w.status.filter(|s| !s.success())?;
            let at = w.seen.unwrap_or_else(SystemTime::now);
            let file = w.error_file.as_deref().and_then(summary::read_error_file);
            let seen_secs = at
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let key = file.as_ref().and_then(|f| f.timestamp).unwrap_or(seen_secs);
            Some((
                key,
                order,
                Failure {
                    host: host.to_owned(),
                    local_rank: w.local_rank,
                    rank: w.rank,
                    pid: w.pid.as_raw() as u32,
                    status,
                    at,
                    // Empty: the worker had no error file (no writable place).
                    error_file: w.error_file.clone().unwrap_or_default(),
                    message: file.map(|f| f.message),
                    exception_line: w.exception.last(),
                    oom_killed: None,
                    hang: None,
                    flight_recorder: Vec::new(),
                },
            ))
        })
        .collect();
    candidates.sort_by_key(|(key, order, f)| (*key, f.at, *order));
    candidates.into_iter().next().map(|(_, _, f)| f)
}

/// Marks `failure` as the OOM killer's when the worker died of SIGKILL and the memory cgroup's
/// OOM-kill count rose during the attempt.
fn name_oom_kill(
    failure: &mut Failure,
    memory: Option<&crate::watch::cgroup::MemoryCgroup>,
    before: Option<u64>,
    restart_count: u32,
    publisher: &Publisher,
) {
    if failure.status != ExitStatus::Signaled(Signal::SIGKILL) {
        return;
    }
    let Some(memory) = memory else { return };
    let after = memory.oom_kills();
    if after.unwrap_or(0) <= before.unwrap_or(0) {
        return;
    }
    failure.oom_killed = Some(memory.limit());
    publisher.event(Event::WorkerOomKilled {
        restart_count,
        local_rank: failure.local_rank,
        rank: failure.rank,
    });
}

/// The failure of an attempt the hang watch ended: the hung rank, however it exited once
/// stopped.
fn hung_failure(workers: &[Worker], host: &str, hang: crate::watch::Hang) -> Failure {
    let worker = workers.iter().find(|w| w.local_rank == hang.local_rank);
    Failure {
        host: host.to_owned(),
        local_rank: hang.local_rank,
        rank: hang.rank,
        pid: worker.map_or(0, |w| w.pid.as_raw() as u32),
        status: worker
            .and_then(|w| w.status)
            .unwrap_or(ExitStatus::Signaled(Signal::SIGKILL)),
        at: worker.and_then(|w| w.seen).unwrap_or_else(SystemTime::now),
        error_file: worker
            .and_then(|w| w.error_file.clone())
            .unwrap_or_default(),
        message: None,
        exception_line: None,
        oom_killed: None,
        hang: Some(Box::new(hang)),
        flight_recorder: Vec::new(),
    }
}

struct PendingExits<'a> {
    exits: &'a mut mpsc::UnboundedReceiver<ExitReport>,
    publisher: &'a Publisher,
    restart_count: u32,
}

impl PendingExits<'_> {
    /// Records exits until every worker is gone or `deadline` passes (or kill-now is asked).
    async fn wait(
        &mut self,
        workers: &mut [Worker],
        deadline: Duration,
        stop: &StopRequest,
        honour_kill_now: bool,
    ) {
        let sleep = tokio::time::sleep(deadline);
        tokio::pin!(sleep);
        while workers.iter().any(|w| w.status.is_none()) {
            tokio::select! {
                report = self.exits.recv() => {
                    let Some((local_rank, status)) = report else { return };
                    record_exit(workers, local_rank, status, self.restart_count, self.publisher);
                }
                () = &mut sleep => return,
                () = stop.killed_now(), if honour_kill_now => return,
            }
        }
    }

    /// Sends `sig` to every live worker's process group, SIGKILL after `grace`.
    async fn stop(
        &mut self,
        workers: &mut [Worker],
        sig: Signal,
        grace: Duration,
        stop: &StopRequest,
    ) {
        for w in workers.iter().filter(|w| w.status.is_none()) {
            let _ = killpg(w.pid, sig);
        }
        let sent = tokio::time::Instant::now();
        self.wait(workers, grace, stop, true).await;
        let stubborn: Vec<String> = workers
            .iter()
            .filter(|w| w.status.is_none())
            .map(|w| w.rank.to_string())
            .collect();
        if stubborn.is_empty() {
            return;
        }
        if sig != Signal::SIGKILL {
            // The time that really passed: a second stop signal cuts the grace period short.
            let why = if stop.is_killed_now() {
                "; a second stop signal asked for it"
            } else {
                ""
            };
            tracing::warn!(
                "rank(s) {} still running {:.1}s after {sig}: sending SIGKILL{why}",
                stubborn.join(","),
                sent.elapsed().as_secs_f64()
            );
        }
        for w in workers.iter().filter(|w| w.status.is_none()) {
            let _ = killpg(w.pid, Signal::SIGKILL);
        }
        self.wait(workers, KILL_WAIT, stop, false).await;
        for w in workers.iter().filter(|w| w.status.is_none()) {
            tracing::error!("rank {} (pid {}) did not die after SIGKILL", w.rank, w.pid);
        }
    }
}

async fn stop_workers(
    workers: &mut [Worker],
    exits: &mut mpsc::UnboundedReceiver<ExitReport>,
    sig: Signal,
    grace: Duration,
    stop: &StopRequest,
) {
    let publisher = Publisher::new();
    let mut pending = PendingExits {
        exits,
        publisher: &publisher,
        restart_count: 0,
    };
    pending.stop(workers, sig, grace, stop).await;
}

/// Stops what is left in the workers' process groups (their own children): SIGTERM, then SIGKILL
/// after `grace`. Costs nothing when the groups are already empty.
async fn sweep_groups(workers: &[Worker], grace: Duration, stop: &StopRequest) {
    let mut left: Vec<Pid> = workers
        .iter()
        .filter(|w| killpg(w.pid, Signal::SIGTERM).is_ok())
        .map(|w| w.pid)
        .collect();
    if left.is_empty() {
        return;
    }
    let deadline = tokio::time::Instant::now() + grace;
    while !left.is_empty() && tokio::time::Instant::now() < deadline && !stop.is_killed_now() {
        tokio::time::sleep(SWEEP_POLL).await;
        left.retain(|pgid| killpg(*pgid, None).is_ok());
    }
    for pgid in left {
        let _ = killpg(pgid, Signal::SIGKILL);
    }
}

/// Waits for the output pumps to reach end of file, within [`DRAIN_WAIT`]; then tells them to
/// stop reading, so each still writes what it holds (a bar's last state), and waits a little more.
async fn drain(pumps: &mut JoinSet<()>, closed: &CancellationToken) {
    if tokio::time::timeout(DRAIN_WAIT, join_all(pumps))
        .await
        .is_err()
    {
        tracing::debug!("worker output still open after the workers exited; not waiting");
        closed.cancel();
        if tokio::time::timeout(DRAIN_WAIT, join_all(pumps))
            .await
            .is_err()
        {
            pumps.abort_all();
        }
    }
}

async fn join_all(pumps: &mut JoinSet<()>) {
    while pumps.join_next().await.is_some() {}
}

/// A CPU set from a list of CPU numbers (those beyond what the set can hold are ignored).
fn cpu_set(cpus: &[u32]) -> nix::sched::CpuSet {
    let mut set = nix::sched::CpuSet::new();
    for &cpu in cpus {
        let _ = set.set(cpu as usize);
    }
    set
}
