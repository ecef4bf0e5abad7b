//! How a launch feeds the metrics, without the launch or its parts knowing about Prometheus.
//!
//! Three pieces, each plugged in by the composition root ([`crate::app`]):
//! - [`start_endpoint`]: serves `--metrics-addr` from the agent's start (before any rendezvous),
//!   on its own thread ([`super::serve_in_thread`]).
//! - [`observe_launch`]: starts the task that follows the loop's [`Observer`] (phase `watch`,
//!   event `broadcast`) and the typed [`events`] of the parts below it (GPU pre-flight, DNS, the
//!   hosted store, checkpoints, step reports), and records them. It is the one writer of the
//!   agent phase ([`agent_phase`]). Its one-second tick is the `/healthz` heartbeat: it runs on
//!   the agent's own (single-threaded) runtime, so when that thread is stuck the heartbeat stops
//!   and `/healthz`, answered from the endpoint's thread, says so.
//! - [`Metered`]: wraps the [`Rendezvous`] of every attempt to time its rounds, record their
//!   outcome, the rank assignment, and attach the statistics of the workers' store.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast::error::RecvError;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::signals::GraceCountdown;
use super::workers::WorkerTally;
use super::{
    serve_in_thread, EndpointConfig, Metrics, MetricsAddr, Phase, Readiness, RoundOutcome,
    ServeError, Serving, StoreRole,
};
use crate::events;
use crate::launch::config::Config;
use crate::launch::{
    AfterGroup, BoxFuture, Event, GroupOutcome, Launch, LaunchError, LocalRendezvous, Observer,
    Phase as LaunchPhase, Rendezvous, Round, StopRequest,
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

/// Records `launch`'s configuration and starts following it: its [`Observer`] and the parts'
/// `events`. Call it as soon as the launch is built, before the GPU pre-flight, so that every
/// phase is seen. The endpoint's address is printed when the launch first leaves its setup.
pub fn observe_launch(
    launch: &Launch,
    metrics: &Metrics,
    endpoint: &AgentEndpoint,
    events: events::Receiver,
    shutdown: &CancellationToken,
) -> JoinHandle<()> {
    record_config(metrics, launch.config());
    observe(
        metrics.clone(),
        launch.observer(),
        events,
        launch.config(),
        endpoint.announcement.clone(),
        shutdown.clone(),
    )
}

/// Meters `launch`'s rendezvous: the single-node one, or `gang` where one is plugged in.
pub fn meter_rendezvous(
    launch: Launch,
    gang: Option<Box<dyn Rendezvous>>,
    metrics: &Metrics,
) -> Launch {
    let metered = match gang {
        Some(gang) => Metered::new(gang, metrics.clone(), "gang_formed"),
        None => Metered::new(Box::new(LocalRendezvous), metrics.clone(), "single_node"),
    };
    launch.with_rendezvous(Box::new(metered))
}

/// Records what the configuration fixes before the first attempt.
pub fn record_config(metrics: &Metrics, config: &Config) {
    metrics.job().set_run_id(&config.run_id);
    metrics
        .workers()
        .set_restarts_remaining(config.max_restarts);
    metrics
        .signals()
        .set_grace_period(config.grace_period.unwrap_or(config.shutdown_timeout));
    metrics.heartbeat();
}

/// Follows the launch loop and the parts' events until the loop finishes or `shutdown` is
/// cancelled. The one writer of the agent phase.
fn observe(
    metrics: Metrics,
    mut observer: Observer,
    mut events: events::Receiver,
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
        let mut phase = observer.phase.borrow_and_update().clone();
        // The loop may be past Starting before this task first runs.
        state.launch_phase_changed(&metrics, &phase, &mut announcement);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => metrics.heartbeat(),
                changed = observer.phase.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    phase = observer.phase.borrow_and_update().clone();
                    state.launch_phase_changed(&metrics, &phase, &mut announcement);
                }
                event = observer.events.recv() => match event {
                    Ok(Event::AttemptStarted { assignment: a }) => metrics.rdzv().set_assignment(
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
                Some(event) = events.recv() => state.record_part(&metrics, &event, &phase),
            }
        }
    })
}

/// What the parts below the loop said that changes the agent phase.
#[derive(Debug, Default, Clone, Copy)]
struct PhaseInputs {
    /// The GPU pre-flight runs.
    preflight: bool,
    /// The rendezvous host is being looked up.
    resolving: bool,
    /// A checkpoint barrier started during the current run of the workers.
    checkpointing: bool,
}

/// The agent phase: the launch loop's phase, refined by what the parts reported. A pure
/// function of both, so the order in which the two streams are read cannot matter.
fn agent_phase(launch: &LaunchPhase, inputs: PhaseInputs) -> Phase {
    match launch {
        LaunchPhase::Starting if inputs.preflight => Phase::Preflight,
        LaunchPhase::Starting => Phase::Resolving,
        LaunchPhase::Rendezvous { .. } if inputs.resolving => Phase::Resolving,
        LaunchPhase::Rendezvous { .. } => Phase::Rendezvous,
        LaunchPhase::Running { .. } if inputs.checkpointing => Phase::Checkpointing,
        LaunchPhase::Running { .. } => Phase::Running,
        LaunchPhase::Stopping { .. } | LaunchPhase::Finished { .. } => Phase::Stopping,
    }
}

#[derive(Default)]
struct ObserverState {
    /// The worker group's attempt and the restarts counted against the budget.
    workers: WorkerTally,
    /// A terminate signal already started the grace countdown.
    countdown: GraceCountdown,
    inputs: PhaseInputs,
}

impl ObserverState {
    fn launch_phase_changed(
        &mut self,
        metrics: &Metrics,
        phase: &LaunchPhase,
        announcement: &mut Option<Announcement>,
    ) {
        if !matches!(phase, LaunchPhase::Starting | LaunchPhase::Finished { .. }) {
            if let Some(announcement) = announcement.take() {
                announcement.log();
            }
        }
        // A checkpoint belongs to the run of workers it started in.
        if !matches!(phase, LaunchPhase::Running { .. }) {
            self.inputs.checkpointing = false;
        }
        metrics.set_phase(agent_phase(phase, self.inputs));
        if let LaunchPhase::Finished { .. } = phase {
            metrics.workers().workers_stopped();
        }
        metrics.heartbeat();
    }

    /// Hands a launch loop event to the families it moves.
    fn record(&mut self, metrics: &Metrics, event: &Event, max_restarts: u32, grace: Duration) {
        match event {
            Event::WorkerStarted { .. }
            | Event::WorkerExited { .. }
            | Event::GroupEnded { .. }
            | Event::Restarting { .. } => {
                metrics
                    .workers()
                    .observe(event, &mut self.workers, max_restarts);
            }
            // Recorded by the observer loop itself (it knows the local world size).
            Event::AttemptStarted { .. } => {}
            Event::StraysStopped { .. }
            | Event::WorkerOomKilled { .. }
            | Event::GpuReleaseWaited { .. } => metrics.cleanup().observe(event),
            Event::RestartTimed(cost) => metrics.restarts().timed(cost),
            Event::Standbys(now) => metrics.restarts().standbys(now),
            Event::SignalReceived { .. } => {
                metrics.signals().observe(event, &mut self.countdown, grace);
                metrics.checkpoints().observe(event);
            }
        }
    }

    /// An event of the parts below the loop; `phase` is the loop's current phase.
    fn record_part(&mut self, metrics: &Metrics, event: &events::Event, phase: &LaunchPhase) {
        use events::Event as Part;
        let before = self.inputs;
        match event {
            Part::PreflightStarted => self.inputs.preflight = true,
            Part::PreflightFinished { .. } => {
                self.inputs.preflight = false;
                metrics.preflight().observe(event);
            }
            Part::ResolvingStarted => self.inputs.resolving = true,
            Part::DnsAttempt(_) => metrics.dns().observe(event),
            Part::ResolvingFinished { resolved, .. } => {
                if *resolved {
                    self.inputs.resolving = false;
                }
                metrics.dns().observe(event);
            }
            Part::RendezvousStoreHosted { stats } => {
                let stats: Arc<rendezvous::store::server::Stats> = Arc::clone(stats);
                metrics.attach_store(StoreRole::Rendezvous, stats);
            }
            // Others can join: the pod is ready (and its DNS record, where readiness gates it,
            // can be published).
            Part::RendezvousStoreAccepting => metrics.advance_readiness(Readiness::Ready),
            Part::CheckpointStarted { .. } => {
                self.inputs.checkpointing = true;
                metrics.checkpoints().observe_part(event);
            }
            Part::CheckpointEnded { .. } => metrics.checkpoints().observe_part(event),
            Part::WorkerStep { local_rank, step } => {
                metrics.workers().worker_step(*local_rank, *step);
            }
            Part::NetworkChecked { .. } => metrics.network().observe(event),
        }
        if before.preflight != self.inputs.preflight
            || before.resolving != self.inputs.resolving
            || before.checkpointing != self.inputs.checkpointing
        {
            metrics.set_phase(agent_phase(phase, self.inputs));
        }
    }
}

/// A [`Rendezvous`] that records every round it runs.
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
        if let Some(spares) = inner.spare_hosts() {
            metrics.attach_spare_hosts(spares);
        }
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
            self.metrics.rdzv().rendezvous_round_finished(
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
            let rdzv = self.metrics.rdzv();
            rdzv.rendezvous_nodes(config.nnodes.max, rdzv.nodes_joined());
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
                    rdzv.rendezvous_nodes(a.group_world_size, a.group_world_size);
                    rdzv.set_assignment(
                        a.node_rank,
                        a.group_world_size,
                        a.world_size,
                        config.nproc_per_node,
                    );
                    if let Some(store) = &round.store {
                        metrics.attach_store(StoreRole::Workers, store.stats());
                    }
                    rdzv.rendezvous_round_finished(
                        RoundOutcome::Completed,
                        self.completed_reason,
                        elapsed,
                    );
                }
                Err(err) if err.is_rendezvous_timeout() => {
                    rdzv.rendezvous_round_finished(RoundOutcome::Timeout, "join_timeout", elapsed);
                }
                Err(_) => {
                    rdzv.rendezvous_round_finished(RoundOutcome::Failed, "error", elapsed);
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
            let after = self.inner.after_group(outcome, stop).await;
            if let Some(cause) = self.inner.gang_cause() {
                self.metrics.workers().set_gang_root_cause(&cause.root);
            }
            after
        })
    }

    fn gang_cause(&self) -> Option<crate::launch::gang_cause::GangCause> {
        self.inner.gang_cause()
    }

    fn spare_hosts(&self) -> Option<rendezvous::rdzv::driver::SpareHosts> {
        self.inner.spare_hosts()
    }

    fn share_warm_modules(&mut self, share: crate::launch::warm_share::WarmShare) {
        self.inner.share_warm_modules(share);
    }

    fn end_on_failure(&mut self, exit_code: u8, why: String) -> bool {
        self.inner.end_on_failure(exit_code, why)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    /// An observer following a launch that never runs (no endpoint served), fed the parts' events
    /// through `events`; the launch and the endpoint are kept so that it goes on watching (bind
    /// them by name: `..` would drop them at once and end the observer).
    struct Observed {
        metrics: Metrics,
        events: events::Events,
        shutdown: CancellationToken,
        _launch: Launch,
        _endpoint: AgentEndpoint,
    }

    fn observed() -> Observed {
        let metrics = Metrics::new();
        let shutdown = CancellationToken::new();
        let endpoint = start_endpoint(
            Some("none".parse().unwrap()),
            &metrics,
            EndpointConfig::default(),
            &shutdown,
        )
        .unwrap();
        let mut config = Config::for_program("/bin/true", vec![], 1);
        config.logs.local_ranks_filter = Some(std::collections::BTreeSet::new());
        let launch = Launch::new(config);
        let (events, parts) = events::Events::channel();
        observe_launch(&launch, &metrics, &endpoint, parts, &shutdown);
        Observed {
            metrics,
            events,
            shutdown,
            _launch: launch,
            _endpoint: endpoint,
        }
    }

    /// The exposition once the observer (its own task) has drained what was published.
    async fn scraped(metrics: &Metrics) -> String {
        tokio::time::sleep(Duration::from_millis(100)).await;
        String::from_utf8(metrics.encode()).unwrap()
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
        let launch = Launch::new(config);
        let (_events, parts) = events::Events::channel();
        observe_launch(&launch, &metrics, &endpoint, parts, &shutdown);
        let launch = meter_rendezvous(launch, None, &metrics);
        let outcome = tokio::time::timeout(Duration::from_secs(20), launch.run(shutdown.clone()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(outcome.exit_code, 3);
        let text = scraped(&metrics).await;
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

    #[test]
    fn the_phase_follows_the_loop_and_what_the_parts_said() {
        let none = PhaseInputs::default();
        let starting = LaunchPhase::Starting;
        let rdzv = LaunchPhase::Rendezvous { restart_count: 0 };
        let running = LaunchPhase::Running { restart_count: 0 };
        let stopping = LaunchPhase::Stopping { restart_count: 0 };
        assert_eq!(agent_phase(&starting, none), Phase::Resolving);
        let preflight = PhaseInputs {
            preflight: true,
            ..none
        };
        assert_eq!(agent_phase(&starting, preflight), Phase::Preflight);
        let resolving = PhaseInputs {
            resolving: true,
            ..none
        };
        assert_eq!(agent_phase(&rdzv, none), Phase::Rendezvous);
        assert_eq!(agent_phase(&rdzv, resolving), Phase::Resolving);
        let checkpointing = PhaseInputs {
            checkpointing: true,
            ..none
        };
        assert_eq!(agent_phase(&running, none), Phase::Running);
        assert_eq!(agent_phase(&running, checkpointing), Phase::Checkpointing);
        // Stopping wins over whatever the parts still say.
        assert_eq!(agent_phase(&stopping, checkpointing), Phase::Stopping);
        assert_eq!(
            agent_phase(&LaunchPhase::Finished { exit_code: 0 }, resolving),
            Phase::Stopping
        );
    }

    #[tokio::test]
    async fn the_parts_events_are_recorded_without_calling_into_the_metrics() {
        let Observed {
            metrics,
            events,
            shutdown,
            _launch,
            _endpoint,
        } = observed();
        events.publish(events::Event::ResolvingStarted);
        events.publish(events::Event::DnsAttempt(events::DnsResult::NxDomain));
        events.publish(events::Event::DnsAttempt(events::DnsResult::Ok));
        events.publish(events::Event::ResolvingFinished {
            resolved: true,
            elapsed: Duration::from_millis(1500),
        });
        events.publish(events::Event::WorkerStep {
            local_rank: 1,
            step: 42,
        });
        events.publish(events::Event::CheckpointStarted { from_peer: true });
        events.publish(events::Event::CheckpointEnded {
            result: events::CheckpointResult::Committed { step: 40 },
            elapsed: Duration::from_secs(2),
        });
        events.publish(events::Event::RendezvousStoreAccepting);
        let text = scraped(&metrics).await;
        let v = |series: &str| value(&text, series);
        assert_eq!(
            v(r#"muster_dns_resolution_attempts_total{result="nxdomain"}"#),
            Some(1.0)
        );
        assert_eq!(
            v(r#"muster_dns_resolution_attempts_total{result="ok"}"#),
            Some(1.0)
        );
        assert_eq!(v("muster_dns_resolution_duration_seconds_sum"), Some(1.5));
        assert_eq!(v(r#"muster_worker_last_step{local_rank="1"}"#), Some(42.0));
        assert_eq!(
            v(r#"muster_checkpoint_requests_total{trigger="peer"}"#),
            Some(1.0)
        );
        assert_eq!(
            v(r#"muster_checkpoints_total{outcome="committed"}"#),
            Some(1.0)
        );
        assert_eq!(v("muster_last_checkpoint_step"), Some(40.0));
        assert_eq!(metrics.readiness(), Readiness::Ready);
        shutdown.cancel();
    }

    #[tokio::test]
    async fn the_network_check_is_recorded_per_peer_and_replaced_by_the_next() {
        use crate::netcheck::summary::{Direction, PeerMeasurement, Summary};
        let Observed {
            metrics,
            events,
            shutdown,
            _launch,
            _endpoint,
        } = observed();
        let peer =
            |rank, direction, round, rtt_us: Option<u64>, bytes_per_second, slow| PeerMeasurement {
                peer_node_rank: rank,
                direction,
                round,
                rtt: rtt_us.map(Duration::from_micros),
                bytes_per_second,
                slow,
            };
        let judged = |summary: Summary, millis| events::Event::NetworkChecked {
            result: events::NetworkCheckResult::Judged(std::sync::Arc::new(summary)),
            elapsed: Duration::from_millis(millis),
        };
        events.publish(judged(
            Summary {
                peers: vec![
                    peer(3, Direction::Out, 1, Some(250), 1.25e9, false),
                    peer(7, Direction::In, 1, Some(2_000), 1e6, true),
                    peer(7, Direction::Out, 2, None, 0.0, true),
                ],
                node_findings: 1,
                link_findings: 0,
                named: false,
                inconclusive: false,
            },
            750,
        ));
        let text = scraped(&metrics).await;
        let v = |series: &str| value(&text, series);
        assert_eq!(
            v(r#"muster_network_checks_total{result="finding"}"#),
            Some(1.0)
        );
        assert_eq!(
            v(r#"muster_network_checks_total{result="clean"}"#),
            Some(0.0)
        );
        assert_eq!(v("muster_network_check_duration_seconds"), Some(0.75));
        assert_eq!(
            v(r#"muster_network_check_findings{kind="node"}"#),
            Some(1.0)
        );
        assert_eq!(v("muster_network_check_named"), Some(0.0));
        let out3 = r#"{direction="out",peer_node_rank="3",round="1"}"#;
        let in7 = r#"{direction="in",peer_node_rank="7",round="1"}"#;
        let out7 = r#"{direction="out",peer_node_rank="7",round="2"}"#;
        assert_eq!(
            v(&format!("muster_network_peer_rtt_seconds{out3}")),
            Some(0.00025)
        );
        assert_eq!(
            v(&format!(
                "muster_network_peer_throughput_bytes_per_second{out3}"
            )),
            Some(1.25e9)
        );
        assert_eq!(v(&format!("muster_network_peer_slow{out3}")), Some(0.0));
        assert_eq!(v(&format!("muster_network_peer_slow{in7}")), Some(1.0));
        // A failed measurement has no round-trip time and counted nothing.
        assert_eq!(v(&format!("muster_network_peer_rtt_seconds{out7}")), None);
        assert_eq!(
            v(&format!(
                "muster_network_peer_throughput_bytes_per_second{out7}"
            )),
            Some(0.0)
        );

        // The next round's check (node rank 7 gone) replaces the peers; then one without a
        // verdict clears them.
        events.publish(judged(
            Summary {
                peers: vec![peer(3, Direction::Out, 1, Some(300), 1e9, false)],
                node_findings: 0,
                link_findings: 0,
                named: false,
                inconclusive: false,
            },
            500,
        ));
        let text = scraped(&metrics).await;
        let v = |series: &str| value(&text, series);
        assert_eq!(
            v(r#"muster_network_checks_total{result="clean"}"#),
            Some(1.0)
        );
        assert_eq!(
            v(r#"muster_network_checks_total{result="inconclusive"}"#),
            Some(0.0)
        );
        assert_eq!(v(&format!("muster_network_peer_slow{in7}")), None);
        assert_eq!(
            v(&format!("muster_network_peer_rtt_seconds{out3}")),
            Some(0.0003)
        );
        // Most measurements failed: counted apart from a clean check, whatever the findings.
        events.publish(judged(
            Summary {
                peers: vec![peer(3, Direction::Out, 1, None, 0.0, true)],
                node_findings: 0,
                link_findings: 0,
                named: false,
                inconclusive: true,
            },
            2_100,
        ));
        let text = scraped(&metrics).await;
        let v = |series: &str| value(&text, series);
        assert_eq!(
            v(r#"muster_network_checks_total{result="inconclusive"}"#),
            Some(1.0)
        );
        assert_eq!(
            v(r#"muster_network_checks_total{result="clean"}"#),
            Some(1.0)
        );
        events.publish(events::Event::NetworkChecked {
            result: events::NetworkCheckResult::NoVerdict,
            elapsed: Duration::from_secs(5),
        });
        let text = scraped(&metrics).await;
        let v = |series: &str| value(&text, series);
        assert_eq!(
            v(r#"muster_network_checks_total{result="no_verdict"}"#),
            Some(1.0)
        );
        assert_eq!(v("muster_network_check_duration_seconds"), Some(5.0));
        assert_eq!(v(&format!("muster_network_peer_rtt_seconds{out3}")), None);
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
