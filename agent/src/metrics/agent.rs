//! How the launch loop feeds the metrics, without the loop knowing about Prometheus.
//!
//! Three pieces, each plugged in through a seam the launch loop already has:
//! - [`start_endpoint`]: serves `--metrics-addr` from the agent's start (before any rendezvous),
//!   on its own thread ([`super::serve_in_thread`]).
//! - [`instrument`]: starts a task that follows the loop's [`Observer`] (phase `watch`, event `broadcast`)
//!   and records phases, worker starts and exits, restarts and signals. Its one-second tick is the
//!   `/healthz` heartbeat: it runs on the agent's own (single-threaded) runtime, so when that
//!   thread is stuck the heartbeat stops and `/healthz`, answered from the endpoint's thread, says
//!   so.
//! - [`Metered`]: wraps the [`Rendezvous`] of every attempt to time its rounds, record their
//!   outcome, the rank assignment, and attach the statistics of the workers' store.

use std::time::Duration;

use tokio::sync::broadcast::error::RecvError;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::{
    serve_in_thread, EndpointConfig, Metrics, MetricsAddr, Phase, RestartCause, RoundOutcome,
    ServeError, Serving, StoreRole, WorkerExit,
};
use crate::exit_code;
use crate::launch::config::{Config, SignalAction};
use crate::launch::{
    AfterGroup, BoxFuture, Event, ExitStatus, GroupOutcome, Launch, LaunchError, LocalRendezvous,
    Observer, Phase as LaunchPhase, Rendezvous, Round, StopRequest,
};

/// How often the observer proves the agent's runtime is turning.
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// The endpoint of a launch, and what to say about it once the launch is under way.
#[derive(Debug)]
pub struct AgentEndpoint {
    serving: Option<Serving>,
    announcement: Option<Announcement>,
}

/// A line about the endpoint, held back until the launch passed its own setup checks so that a
/// configuration error stays the only line a failed start prints.
#[derive(Debug, Clone)]
enum Announcement {
    Serving(std::net::SocketAddr),
    Unavailable(String),
}

impl Announcement {
    fn log(&self) {
        match self {
            Announcement::Serving(addr) => tracing::info!("metrics on http://{addr}/metrics"),
            Announcement::Unavailable(why) => tracing::warn!("{why}; running without metrics"),
        }
    }
}

impl AgentEndpoint {
    /// The address served, if any.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.serving.as_ref().map(Serving::local_addr)
    }
}

/// Starts the endpoint with `config`'s limits and token. `setting` is `--metrics-addr` as given
/// (`None`: not given).
///
/// An address the operator chose that cannot be bound is an error (the caller exits with the
/// configuration-error code). The *default* port being taken — a model server on 8000, or a
/// second agent in the same network namespace — only costs the metrics: a warning, and the job
/// runs.
pub fn start_endpoint(
    setting: Option<MetricsAddr>,
    metrics: &Metrics,
    config: EndpointConfig,
    shutdown: &CancellationToken,
) -> Result<AgentEndpoint, ServeError> {
    let (addr, chosen) = match setting {
        Some(addr) => (addr, true),
        None => (MetricsAddr::default(), false),
    };
    let Some(addr) = addr.addr() else {
        return Ok(AgentEndpoint {
            serving: None,
            announcement: None,
        });
    };
    match serve_in_thread(addr, metrics.clone(), config, shutdown) {
        Ok(serving) => Ok(AgentEndpoint {
            announcement: Some(Announcement::Serving(serving.local_addr())),
            serving: Some(serving),
        }),
        Err(err) if !chosen => Ok(AgentEndpoint {
            serving: None,
            announcement: Some(Announcement::Unavailable(err.to_string())),
        }),
        Err(err) => Err(err),
    }
}

/// Plugs the metrics into `launch`: records its configuration, follows its observer, and (on one
/// node) meters its rendezvous. A multi-node rendezvous is metered where it is plugged in, with
/// [`metered`].
/// The endpoint's address is printed when the launch first leaves its setup.
pub fn instrument(
    launch: Launch,
    metrics: &Metrics,
    endpoint: &AgentEndpoint,
    shutdown: &CancellationToken,
) -> Launch {
    metrics.install();
    record_config(metrics, launch.config());
    observe(
        metrics.clone(),
        launch.observer(),
        launch.config(),
        endpoint.announcement.clone(),
        shutdown.clone(),
    );
    if crate::node::is_multi_node(launch.config()) {
        return launch;
    }
    let local = Metered::new(Box::new(LocalRendezvous), metrics.clone(), "single_node");
    launch.with_rendezvous(Box::new(local))
}

/// Records what the configuration fixes before the first attempt.
pub fn record_config(metrics: &Metrics, config: &Config) {
    metrics.set_run_id(&config.run_id);
    metrics.set_restarts_remaining(config.max_restarts);
    metrics.set_grace_period(config.grace_period.unwrap_or(config.shutdown_timeout));
    metrics.heartbeat();
}

/// Follows the launch loop until it finishes or `shutdown` is cancelled.
fn observe(
    metrics: Metrics,
    mut observer: Observer,
    config: &Config,
    mut announcement: Option<Announcement>,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let max_restarts = config.max_restarts;
    let local_world_size = config.nproc_per_node;
    let grace = config.grace_period.unwrap_or(config.shutdown_timeout);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut state = ObserverState::default();
        // The loop may be past Starting before this task first runs.
        let mut on_phase = |phase: &LaunchPhase| {
            if !matches!(phase, LaunchPhase::Starting | LaunchPhase::Finished { .. }) {
                if let Some(announcement) = announcement.take() {
                    announcement.log();
                }
            }
            record_phase(&metrics, phase);
            metrics.heartbeat();
        };
        let first = observer.phase.borrow_and_update().clone();
        on_phase(&first);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => metrics.heartbeat(),
                changed = observer.phase.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let phase = observer.phase.borrow_and_update().clone();
                    on_phase(&phase);
                }
                event = observer.events.recv() => match event {
                    Ok(Event::AttemptStarted { assignment: a }) => metrics.set_assignment(
                        a.node_rank,
                        a.group_world_size,
                        a.world_size,
                        local_world_size,
                    ),
                    Ok(event) => state.record(&metrics, &event, max_restarts, grace),
                    // Events only arrive faster than this task runs if the runtime is starved;
                    // the gauges catch up with the next phase change.
                    Err(RecvError::Lagged(missed)) => {
                        tracing::debug!("metrics observer missed {missed} launch events");
                    }
                    Err(RecvError::Closed) => return,
                },
            }
        }
    })
}

fn record_phase(metrics: &Metrics, phase: &LaunchPhase) {
    match phase {
        LaunchPhase::Starting => metrics.set_phase(Phase::Resolving),
        LaunchPhase::Rendezvous { .. } => metrics.set_phase(Phase::Rendezvous),
        LaunchPhase::Running { .. } => metrics.set_phase(Phase::Running),
        LaunchPhase::Stopping { .. } => metrics.set_phase(Phase::Stopping),
        LaunchPhase::Finished { .. } => {
            metrics.set_phase(Phase::Stopping);
            metrics.workers_stopped();
        }
    }
}

#[derive(Default)]
struct ObserverState {
    /// The attempt whose workers are being counted.
    attempt: Option<u32>,
    /// A terminate signal already started the grace countdown.
    stopping: bool,
    /// Restarts that consumed the `--max-restarts` budget.
    counted_restarts: u32,
}

impl ObserverState {
    fn record(&mut self, metrics: &Metrics, event: &Event, max_restarts: u32, grace: Duration) {
        match event {
            Event::WorkerStarted { restart_count, .. } => {
                if self.attempt == Some(*restart_count) {
                    metrics.worker_started();
                } else {
                    self.attempt = Some(*restart_count);
                    metrics.workers_started(1);
                }
            }
            Event::WorkerExited { status, .. } => metrics.worker_exited(match status {
                ExitStatus::Exited(code) => WorkerExit::Code(*code),
                ExitStatus::Signaled(signal) => WorkerExit::Signal(*signal as i32),
            }),
            Event::GroupEnded { .. } => metrics.workers_stopped(),
            Event::Restarting { .. } => {
                let cause = metrics
                    .take_restart_cause()
                    .unwrap_or(RestartCause::WorkerFailure);
                metrics.restarted(cause);
                if cause != RestartCause::MembershipChange {
                    self.counted_restarts += 1;
                }
                metrics.set_restarts_remaining(max_restarts.saturating_sub(self.counted_restarts));
            }
            // Recorded by the observer loop itself (it knows the local world size).
            Event::AttemptStarted { .. } => {}
            Event::StraysStopped { count, killed, .. } => metrics.strays_stopped(*count, *killed),
            Event::WorkerOomKilled { .. } => metrics.worker_oom_killed(),
            Event::GpuReleaseWaited {
                waited, released, ..
            } => metrics.gpu_release_waited(*waited, *released),
            Event::SignalReceived { signal, action } => {
                metrics.signal_received(*signal as i32);
                if *action == SignalAction::Checkpoint {
                    metrics.checkpoint_requested(super::CheckpointTrigger::Signal);
                }
                if matches!(action, SignalAction::Terminate | SignalAction::Checkpoint)
                    && !self.stopping
                {
                    self.stopping = true;
                    metrics.grace_deadline(Instant::now() + grace);
                }
            }
        }
    }
}

/// The multi-node rendezvous, metered.
pub fn metered(rendezvous: impl Rendezvous + 'static, metrics: &Metrics) -> Box<dyn Rendezvous> {
    Box::new(Metered::new(
        Box::new(rendezvous),
        metrics.clone(),
        "gang_formed",
    ))
}

/// A [`Rendezvous`] that records every round it runs, and why the gang restarts.
pub struct Metered {
    inner: Box<dyn Rendezvous>,
    metrics: Metrics,
    /// The `reason` label of a completed round.
    completed_reason: &'static str,
}

impl Metered {
    /// `completed_reason` names how a round of `inner` completes (`single_node`, `gang_formed`).
    pub fn new(
        inner: Box<dyn Rendezvous>,
        metrics: Metrics,
        completed_reason: &'static str,
    ) -> Self {
        Self {
            inner,
            metrics,
            completed_reason,
        }
    }
}

/// Records a round that was abandoned (its future dropped: the agent is stopping).
struct RoundGuard<'a> {
    metrics: &'a Metrics,
    started: Instant,
    finished: bool,
}

impl Drop for RoundGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.metrics.rendezvous_round_finished(
                RoundOutcome::Cancelled,
                "stopped",
                self.started.elapsed(),
            );
        }
    }
}

impl Rendezvous for Metered {
    fn next_round<'a>(
        &'a mut self,
        config: &'a Config,
        restart_count: u32,
        stop: &'a StopRequest,
    ) -> BoxFuture<'a, Result<Round, LaunchError>> {
        Box::pin(async move {
            // Until the round completes, the nodes of the last round count as joined (the
            // rendezvous does not report its progress to the agent).
            self.metrics
                .rendezvous_nodes(config.nnodes.max, self.metrics.nodes_joined());
            let mut guard = RoundGuard {
                metrics: &self.metrics,
                started: Instant::now(),
                finished: false,
            };
            let result = self.inner.next_round(config, restart_count, stop).await;
            guard.finished = true;
            let elapsed = guard.started.elapsed();
            let metrics = &self.metrics;
            match &result {
                Ok(round) => {
                    let a = &round.assignment;
                    metrics.rendezvous_nodes(a.group_world_size, a.group_world_size);
                    metrics.set_assignment(
                        a.node_rank,
                        a.group_world_size,
                        a.world_size,
                        config.nproc_per_node,
                    );
                    if let Some(store) = &round.store {
                        metrics.attach_store(StoreRole::Workers, store.stats());
                    }
                    metrics.rendezvous_round_finished(
                        RoundOutcome::Completed,
                        self.completed_reason,
                        elapsed,
                    );
                }
                Err(err) if err.exit_code() == exit_code::RENDEZVOUS_TIMEOUT => {
                    metrics.rendezvous_round_finished(
                        RoundOutcome::Timeout,
                        "join_timeout",
                        elapsed,
                    );
                }
                Err(_) => {
                    metrics.rendezvous_round_finished(RoundOutcome::Failed, "error", elapsed);
                }
            }
            result
        })
    }

    fn watch(&mut self) -> BoxFuture<'_, ()> {
        self.inner.watch()
    }

    fn after_group<'a>(
        &'a mut self,
        outcome: &'a GroupOutcome,
        stop: &'a StopRequest,
    ) -> BoxFuture<'a, Result<Option<AfterGroup>, LaunchError>> {
        Box::pin(async move {
            let decision = self.inner.after_group(outcome, stop).await;
            let hung = matches!(outcome, GroupOutcome::Failed(f) if f.hang.is_some());
            if hung && matches!(&decision, Ok(None | Some(AfterGroup::Restart))) {
                // This node's hang watch stopped the attempt (one node: the local policy may
                // restart it; several: the gang restarts from here).
                self.metrics.next_restart_cause(RestartCause::Hang);
            } else if let Ok(Some(AfterGroup::Restart)) = &decision {
                // A local failure restarts the gang from here; otherwise another node's failure
                // (or a membership change, which the inner rendezvous does not tell apart here)
                // made the gang re-form.
                self.metrics
                    .next_restart_cause(if matches!(outcome, GroupOutcome::Failed(_)) {
                        RestartCause::WorkerFailure
                    } else {
                        RestartCause::PeerFailure
                    });
            }
            decision
        })
    }
}

/// Runs `run` (the launch) while handing every `POST /checkpoint` to `trigger` (the checkpoint
/// barrier's operator entry; false when it is gone). From here on the endpoint answers 202.
pub async fn serve_checkpoint_requests<F: std::future::Future>(
    metrics: &Metrics,
    run: F,
    trigger: impl Fn(&str) -> bool,
) -> F::Output {
    let mut requests = metrics.checkpoint_requests();
    tokio::pin!(run);
    loop {
        tokio::select! {
            output = &mut run => return output,
            Some(request) = requests.recv() => {
                if !trigger("checkpoint requested over HTTP (POST /checkpoint)") {
                    tracing::warn!("POST /checkpoint: the checkpoint barrier is gone");
                }
                tracing::debug!("checkpoint request from {:?}", request.trigger);
            }
        }
    }
}

/// Runs the GPU pre-flight (phase `preflight`) and records its checks, per GPU and node-wide, and
/// its verdict. A skipped check (not applicable here) is not exported.
pub async fn preflight<F, E>(metrics: &Metrics, run: F) -> Result<Option<crate::gpu::Report>, E>
where
    F: std::future::Future<Output = Result<Option<crate::gpu::Report>, E>>,
{
    use crate::gpu::report::{Status, Verdict};
    metrics.set_phase(Phase::Preflight);
    let started = Instant::now();
    let result = run.await;
    let elapsed = started.elapsed();
    match &result {
        Ok(Some(report)) => {
            for check in report.checks.iter().filter(|c| c.status != Status::Skip) {
                let healthy = check.status != Status::Fail;
                match &check.gpu {
                    Some(gpu) => metrics.gpu_check(
                        Some(gpu.index),
                        gpu.uuid.as_deref().unwrap_or(""),
                        &check.check,
                        healthy,
                    ),
                    None => metrics.gpu_check(None, "", &check.check, healthy),
                }
            }
            for gpu in &report.gpus {
                if let Some(links) = gpu.nvlink_active {
                    metrics.gpu_nvlink_active_links(
                        gpu.index,
                        gpu.uuid.as_deref().unwrap_or(""),
                        links,
                    );
                }
            }
            metrics.gpu_preflight_finished(report.verdict != Verdict::Unhealthy, elapsed);
        }
        Ok(None) => {}
        Err(_) => metrics.gpu_preflight_finished(false, elapsed),
    }
    result
}

/// A local rank reported its step through the checkpoint helper.
pub fn worker_step(local_rank: u32, step: u64) {
    if let Some(metrics) = super::installed() {
        metrics.worker_step(local_rank, step);
    }
}

/// The checkpoint barrier started on this node (`from_peer`: another node asked for it).
pub fn checkpoint_started(from_peer: bool) {
    if let Some(metrics) = super::installed() {
        if from_peer {
            metrics.checkpoint_requested(super::CheckpointTrigger::Peer);
        }
        metrics.set_phase(Phase::Checkpointing);
        metrics.set_checkpoint_phase(super::CheckpointPhase::Agreeing);
    }
}

/// The checkpoint barrier reached its verdict `elapsed` after it started here.
pub fn checkpoint_ended(outcome: &crate::checkpoint::Outcome, elapsed: Duration) {
    use crate::checkpoint::Outcome;
    let Some(metrics) = super::installed() else {
        return;
    };
    match outcome {
        Outcome::Committed { step } => {
            metrics.checkpoint_finished(super::CheckpointOutcome::Committed, elapsed, Some(*step));
        }
        Outcome::Aborted { .. } => {
            metrics.checkpoint_finished(super::CheckpointOutcome::Aborted, elapsed, None);
        }
        // No barrier ran (the scripts lack the helper): not a checkpoint.
        Outcome::Unsupported { .. } => metrics.set_checkpoint_phase(super::CheckpointPhase::Idle),
    }
}

/// Node 0 started hosting the gang's rendezvous store.
pub fn rendezvous_store_started(stats: std::sync::Arc<rendezvous::store::server::Stats>) {
    if let Some(metrics) = super::installed() {
        metrics.attach_store(StoreRole::Rendezvous, stats);
    }
}

/// Node 0's rendezvous store accepted this agent's own connection: others can join, so the pod
/// is ready (and its DNS record, where readiness gates it, can be published).
pub fn rendezvous_store_accepting() {
    if let Some(metrics) = super::installed() {
        metrics.advance_readiness(super::Readiness::Ready);
    }
}

/// `discovery::resolve` started looking up the rendezvous host.
pub fn dns_started() {
    if let Some(metrics) = super::installed() {
        metrics.set_phase(Phase::Resolving);
    }
}

/// One lookup failed; `kind` as `discovery` describes it.
pub fn dns_failed(kind: &str) {
    if let Some(metrics) = super::installed() {
        metrics.dns_attempt(super::DnsResult::of_failure(kind));
    }
}

/// The host resolved `elapsed` after the first lookup (`ok`), or the deadline passed.
pub fn dns_finished(ok: bool, elapsed: Duration) {
    if let Some(metrics) = super::installed() {
        if ok {
            metrics.dns_attempt(super::DnsResult::Ok);
            metrics.set_phase(Phase::Rendezvous);
        }
        metrics.dns_resolution_finished(elapsed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[tokio::test]
    async fn a_launch_with_a_failure_and_a_restart_is_recorded() {
        let mut config = Config::for_program(
            "/bin/sh",
            vec![
                "-c".into(),
                r#"[ "$RANK" = 1 ] && exit 3; exec sleep 30"#.into(),
            ],
            2,
        );
        config.logs.local_ranks_filter = Some(std::collections::BTreeSet::new());
        config.shutdown_timeout = Duration::from_secs(5);
        config.max_restarts = 1;
        config.run_id = "job-7".to_owned();
        let metrics = Metrics::new();
        let shutdown = CancellationToken::new();
        let endpoint = start_endpoint(
            Some("127.0.0.1:0".parse().unwrap()),
            &metrics,
            EndpointConfig::default(),
            &shutdown,
        )
        .unwrap();
        assert!(endpoint.local_addr().is_some());
        let launch = instrument(Launch::new(config), &metrics, &endpoint, &shutdown);
        let outcome = tokio::time::timeout(Duration::from_secs(20), launch.run(shutdown.clone()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(outcome.exit_code, 3);
        // Let the observer drain the last events.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let text = String::from_utf8(metrics.encode()).unwrap();
        let v = |series: &str| value(&text, series);
        assert_eq!(v("muster_world_size"), Some(2.0));
        assert_eq!(v("muster_local_world_size"), Some(2.0));
        assert_eq!(v("muster_group_world_size"), Some(1.0));
        assert_eq!(v(r#"muster_job_info{run_id="job-7"}"#), Some(1.0));
        assert_eq!(
            v(r#"muster_restarts_total{cause="worker_failure"}"#),
            Some(1.0)
        );
        assert_eq!(v("muster_restarts_remaining"), Some(0.0));
        assert_eq!(
            v(r#"muster_worker_exits_total{code="3",signal="none"}"#),
            Some(2.0)
        );
        assert_eq!(
            v(r#"muster_worker_exits_total{code="143",signal="SIGTERM"}"#),
            Some(2.0)
        );
        assert_eq!(
            v(r#"muster_rendezvous_rounds_total{outcome="completed"}"#),
            Some(2.0)
        );
        assert_eq!(
            v(r#"muster_rendezvous_last_round{outcome="completed",reason="single_node"}"#),
            Some(1.0)
        );
        assert_eq!(v("muster_rendezvous_duration_seconds_count"), Some(2.0));
        assert_eq!(v("muster_local_workers_running"), Some(0.0));
        assert_eq!(v(r#"muster_agent_phase{phase="stopping"}"#), Some(1.0));
        // Two attempts, two fresh workers' stores: the counters add up across them.
        assert!(
            v(r#"muster_store_connections_accepted_total{store="workers"}"#).is_some(),
            "{text}"
        );
        shutdown.cancel();
    }

    #[tokio::test]
    async fn an_explicit_address_in_use_is_an_error_and_the_default_only_a_warning() {
        let metrics = Metrics::new();
        let shutdown = CancellationToken::new();
        let first = start_endpoint(
            Some("127.0.0.1:0".parse().unwrap()),
            &metrics,
            EndpointConfig::default(),
            &shutdown,
        )
        .unwrap();
        let taken = MetricsAddr::at(first.local_addr().unwrap());
        assert!(
            start_endpoint(Some(taken), &metrics, EndpointConfig::default(), &shutdown).is_err()
        );
        let off = start_endpoint(
            Some("none".parse().unwrap()),
            &metrics,
            EndpointConfig::default(),
            &shutdown,
        )
        .unwrap();
        assert!(off.local_addr().is_none() && off.announcement.is_none());
        shutdown.cancel();
    }
}
