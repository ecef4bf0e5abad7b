//! Ties the checkpoint barrier to a running launch.
//!
//! The controller is one task beside the launch loop. It learns each attempt's ranks and store
//! from the loop's events, watches that store for a checkpoint request from any node, and
//! publishes one when this node is asked for it — by SIGTERM (through the launch's terminate
//! hook) or by an operator (`POST /checkpoint`, through [`Preemption::trigger`]). When a request
//! stands it runs the barrier ([`super::run`]) and then ends the attempt:
//!
//! | verdict | what happens to the workers | agent exit code |
//! |---|---|---|
//! | committed | they stop by themselves (the helper told them); stragglers get SIGTERM at the deadline | `--preempted-exit-code` (200 by default) |
//! | aborted | SIGTERM now, SIGKILL after `--shutdown-timeout` | 201 |
//! | unsupported (no helper) | SIGTERM now, on every node at once | 0 if they all exit cleanly, else 143 |
//! | no attempt running | none run; the launch stops | 201 for `POST /checkpoint`, 128+N for signal N |
//!
//! Whatever goes wrong on the way (no store reachable, no attempt running yet) degrades to the
//! plain stop torchrun would do: the hook must never leave a signalled agent running.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::barrier::Request;
use super::local::{BindError, LocalChannel};
use super::{Outcome, Settings, DEFAULT_NOTIFY_LATENCY};
use crate::events::{CheckpointResult, Event as AgentEvent, Events};
use crate::exit_code;
use crate::launch::{Config, Event, Observer, RankAssignment, StopRequest, TerminateHook};
use crate::python_files::{self, Files, WriteError};
use crate::scratch::ScratchDir;

/// Kept back from the grace period for stopping and reaping after the deadline: the barrier's
/// deadline is `grace − margin`, so the agent exits before Kubernetes' SIGKILL.
const MIN_SAFETY_MARGIN: Duration = Duration::from_secs(1);
const MAX_SAFETY_MARGIN: Duration = Duration::from_secs(5);

/// Where a checkpoint request came from.
#[derive(Debug, Clone)]
pub struct Trigger {
    pub reason: String,
    /// The signal that asked (None: an operator's request).
    pub signal: Option<Signal>,
}

struct Local {
    trigger: Trigger,
    deadline: Instant,
    stop: Option<StopRequest>,
}

/// Why the barrier could not be set up: all of them are the environment's doing (exit 202).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot write the checkpoint helper {}: {source}; give --tmp-dir a writable directory (e.g. an emptyDir volume)", path.display())]
    Helper {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Socket(#[from] BindError),
}

impl exit_code::Coded for StartError {
    fn exit_code(&self) -> u8 {
        exit_code::CONFIG_ERROR
    }
}

/// Where the helper is: the agent's private directory and the `PYTHONPATH` entry the workers
/// import it from (see [`python_files::install`]).
struct Helper {
    dir: Arc<ScratchDir>,
    python_entry: PathBuf,
}

/// Handle to the running controller.
pub struct Preemption {
    /// The agent's private directory, holding the helper; `None`: nowhere was writable (or the
    /// helper could not be written there), the workers go without it.
    helper: Option<Helper>,
    socket: String,
    view: super::local::ProgressView,
    triggers: mpsc::UnboundedSender<(Trigger, Option<StopRequest>)>,
    outcome: Arc<Mutex<Option<Outcome>>>,
    preempted_exit_code: u8,
    /// The barrier's budget for the grace period, and when a signal asked for it.
    budget: Duration,
    signalled_at: Arc<Mutex<Option<std::time::Instant>>>,
    task: JoinHandle<()>,
}

/// The barrier's budget for a grace period: what is left after the safety margin.
pub fn budget(grace: Duration) -> Duration {
    let margin = (grace / 10).clamp(MIN_SAFETY_MARGIN, MAX_SAFETY_MARGIN);
    grace.saturating_sub(margin)
}

impl Preemption {
    /// Listens for the workers on an abstract socket (no file), writes the Python helper into
    /// the agent's private directory `private_dir` when there is one (so `import
    /// muster_checkpoint` works in every worker; see [`crate::scratch`]), and starts the
    /// controller. Without a writable directory the barrier still runs for scripts that vendor
    /// the helper; the others get the signal forwarded, as for any script that does not use the
    /// helper.
    ///
    /// `observer` must be taken from the launch before it runs; `shutdown` is the token the
    /// launch runs under (cancelling it stops the workers on nodes that were not signalled).
    /// Checkpoints and the ranks' step reports are told to `events`.
    pub fn start(
        config: &Config,
        private_dir: Option<Arc<ScratchDir>>,
        observer: Observer,
        shutdown: CancellationToken,
        events: Events,
    ) -> Result<Preemption, StartError> {
        let helper = write_helper(private_dir, config.tmp_dir.is_some())?;
        let channel = LocalChannel::bind(&shutdown)?;
        channel.report_steps(events.clone());
        channel.set_liveness_interval(crate::watch::hang::liveness_interval(config.hang.timeout));
        let socket = channel.address().to_owned();
        let view = channel.view();
        let (triggers, trigger_rx) = mpsc::unbounded_channel();
        let outcome = Arc::new(Mutex::new(None));
        let grace = config.grace_period.unwrap_or(config.shutdown_timeout);
        let budget = budget(grace);
        let controller = Controller {
            channel,
            local_world_size: config.nproc_per_node,
            budget,
            outcome: Arc::clone(&outcome),
            shutdown,
            events,
        };
        let task = tokio::spawn(controller.run(observer, trigger_rx));
        Ok(Preemption {
            helper,
            socket,
            view,
            triggers,
            outcome,
            preempted_exit_code: config.preempted_exit_code,
            budget,
            signalled_at: Arc::new(Mutex::new(None)),
            task,
        })
    }

    /// The address to export as `MUSTER_CHECKPOINT_SOCKET` (`@name`, an abstract socket).
    pub fn socket(&self) -> &str {
        &self.socket
    }

    /// What the workers report through the helper, read-only (for the hang watch).
    pub fn progress_view(&self) -> super::local::ProgressView {
        self.view.clone()
    }

    /// The directory holding `muster_checkpoint.py` and muster's `sitecustomize.py`, if one
    /// could be written.
    pub fn helper_dir(&self) -> Option<&Path> {
        self.helper.as_ref().map(|h| h.dir.path())
    }

    /// Where the helper's directory was made (a directory muster found writable).
    pub fn writable_base(&self) -> Option<&Path> {
        self.helper.as_ref().map(|h| h.dir.base())
    }

    /// Where the workers import muster's Python from (`sitecustomize` and the helper), if
    /// anywhere.
    pub fn python_entry(&self) -> Option<&Path> {
        self.helper.as_ref().map(|h| h.python_entry.as_path())
    }

    /// The workers' `PYTHONPATH`: the helper's entry first, then what the agent was given;
    /// `None` when there is no helper directory (the agent's own `PYTHONPATH` passes through).
    pub fn python_path(&self) -> Option<std::ffi::OsString> {
        let mut path = self.python_entry()?.as_os_str().to_owned();
        if let Some(existing) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(existing);
        }
        Some(path)
    }

    /// The launch's terminate hook: SIGTERM becomes a checkpoint request.
    pub fn terminate_hook(&self) -> TerminateHook {
        let triggers = self.triggers.clone();
        let signalled_at = Arc::clone(&self.signalled_at);
        Arc::new(move |signal: Signal, stop: StopRequest| {
            signalled_at
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert_with(std::time::Instant::now);
            let trigger = Trigger {
                reason: format!("{} received", signal.as_str()),
                signal: Some(signal),
            };
            if let Err(mpsc::error::SendError((_, Some(stop)))) =
                triggers.send((trigger, Some(stop)))
            {
                // The controller is gone: behave like torchrun.
                stop.request(signal);
            }
            Box::pin(async {})
        })
    }

    /// An operator's request (`POST /checkpoint`). Returns false when the controller is gone.
    pub fn trigger(&self, reason: &str) -> bool {
        let trigger = Trigger {
            reason: reason.to_owned(),
            signal: None,
        };
        self.triggers.send((trigger, None)).is_ok()
    }

    /// When the grace period a terminating signal began ends, less the margin kept for
    /// stopping and reaping; `None` when no signal came.
    pub fn deadline(&self) -> Option<std::time::Instant> {
        let signalled_at = *self
            .signalled_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        signalled_at.map(|at| at + self.budget)
    }

    /// The checkpoint's outcome on this node, if one ran.
    pub fn outcome(&self) -> Option<Outcome> {
        self.outcome
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The agent's exit code given the launch's: a checkpoint's outcome takes precedence.
    pub fn exit_code(&self, launch_code: u8) -> u8 {
        exit_code_after(
            self.outcome().as_ref(),
            launch_code,
            self.preempted_exit_code,
        )
    }
}

/// A preemption that ends without a committed checkpoint never exits 0: with scripts that do
/// not use the helper the workers get SIGTERM and may well exit 0 from their own handler, and a
/// 0 would make the pod `Succeeded`, which every Kubernetes training API counts as finished
/// work (the job would end Complete with its training unfinished). That case is 201; any other
/// code still says how the workers ended (143: they died of the SIGTERM).
fn exit_code_after(outcome: Option<&Outcome>, launch_code: u8, preempted_exit_code: u8) -> u8 {
    match outcome {
        Some(Outcome::Committed { .. }) => preempted_exit_code,
        Some(Outcome::Aborted { .. }) => exit_code::CHECKPOINT_ABORTED,
        Some(Outcome::Unsupported { .. }) if launch_code == 0 => exit_code::CHECKPOINT_ABORTED,
        Some(Outcome::Unsupported { .. }) | None => launch_code,
    }
}

impl Drop for Preemption {
    fn drop(&mut self) {
        // The helper's directory goes with `helper`.
        self.task.abort();
    }
}

/// Puts the helper where the workers import it from (the shared copy beside the agent's private
/// directory `dir`, else an archive inside it; see [`python_files::install`]), if there is such
/// a directory. `Ok(None)`: no directory, or the helper could not be written; only a failure
/// in a `--tmp-dir` the user `named` is an error.
fn write_helper(dir: Option<Arc<ScratchDir>>, named: bool) -> Result<Option<Helper>, StartError> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    // All of muster's worker-side Python (the helper, the framework callbacks and the step
    // reporter muster's `sitecustomize` loads, and that `sitecustomize`, which the script
    // metrics' hook then shares: it writes no copy of its own beside these).
    match python_files::install(dir.base(), dir.path(), Files::Workers) {
        Ok(python_entry) => Ok(Some(Helper { dir, python_entry })),
        Err(WriteError { path, source }) if named => Err(StartError::Helper { path, source }),
        Err(err) => {
            // A full tmpfs, say: going without the helper beats not starting.
            warn!("{err}");
            Ok(None)
        }
    }
}

struct Controller {
    channel: LocalChannel,
    local_world_size: u32,
    budget: Duration,
    outcome: Arc<Mutex<Option<Outcome>>>,
    shutdown: CancellationToken,
    events: Events,
}

/// The attempt the controller is watching.
struct Attempt {
    assignment: RankAssignment,
    stop_watching: CancellationToken,
}

impl Controller {
    async fn run(
        mut self,
        mut observer: Observer,
        mut triggers: mpsc::UnboundedReceiver<(Trigger, Option<StopRequest>)>,
    ) {
        let (request_tx, mut requests) = mpsc::unbounded_channel::<(u32, Request)>();
        let mut attempt: Option<Attempt> = None;
        let mut local: Option<Local> = None;
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                event = observer.events.recv() => match event {
                    Ok(Event::AttemptStarted { assignment }) => {
                        if let Some(old) = attempt.take() {
                            old.stop_watching.cancel();
                        }
                        self.channel.forget_all();
                        let stop_watching = self.shutdown.child_token();
                        // One node hears only itself: its own requests come back through
                        // `publish`, and a watcher would be a store connection for nothing.
                        if assignment.has_peer_nodes() {
                            spawn_watcher(&assignment, stop_watching.clone(), request_tx.clone());
                        }
                        // A trigger that arrived while no attempt ran is published now.
                        if let Some(l) = &local {
                            publish(&assignment, &l.trigger, l.deadline, &request_tx);
                        }
                        attempt = Some(Attempt { assignment, stop_watching });
                    }
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                Some((trigger, stop)) = triggers.recv() => {
                    if local.is_some() {
                        info!("{}: a checkpoint is already under way; joining it", trigger.reason);
                        continue;
                    }
                    let deadline = Instant::now() + self.budget;
                    info!(
                        "{}: checkpoint requested; {:.1} s to commit it",
                        trigger.reason,
                        self.budget.as_secs_f64()
                    );
                    if let Some(a) = &attempt {
                        publish(&a.assignment, &trigger, deadline, &request_tx);
                    } else {
                        // No workers' store to agree through: stop as torchrun would.
                        self.stop_between_attempts(&trigger);
                        stop_workers(stop.as_ref(), trigger.signal, &self.shutdown);
                    }
                    local = Some(Local { trigger, deadline, stop });
                }
                Some((restart_count, request)) = requests.recv() => {
                    let Some(current) = attempt.as_ref().filter(|a| a.assignment.restart_count == restart_count) else {
                        continue;
                    };
                    let assignment = current.assignment.clone();
                    let outcome = self.checkpoint(&assignment, &request, local.as_ref(), &mut observer).await;
                    let stop = local.as_ref().and_then(|l| l.stop.clone());
                    let signal = local.as_ref().and_then(|l| l.trigger.signal);
                    let deadline = local.as_ref().map_or_else(
                        || Instant::now() + self.budget,
                        |l| l.deadline,
                    );
                    self.finish(outcome, stop.as_ref(), signal, deadline, &mut observer).await;
                    return;
                }
            }
        }
    }

    async fn checkpoint(
        &mut self,
        assignment: &RankAssignment,
        request: &Request,
        local: Option<&Local>,
        observer: &mut Observer,
    ) -> Outcome {
        let started = Instant::now();
        self.events.publish(AgentEvent::CheckpointStarted {
            from_peer: local.is_none(),
        });
        let settings = Settings {
            run_id: assignment.run_id.clone(),
            node_rank: assignment.node_rank,
            nnodes: assignment.group_world_size,
            local_world_size: self.local_world_size,
            world_size: assignment.world_size,
            store: match store_addr(assignment) {
                Some(addr) => addr,
                None => {
                    return Outcome::Aborted {
                        reason: format!("unusable store address {}", assignment.master_addr),
                    }
                }
            },
            notify_latency: DEFAULT_NOTIFY_LATENCY,
        };
        let events = &mut observer.events;
        let worker_lost = async move {
            loop {
                match events.recv().await {
                    Ok(Event::WorkerExited {
                        local_rank, status, ..
                    }) => {
                        return format!(
                            "local rank {local_rank} exited ({status}) during the checkpoint"
                        )
                    }
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
                }
            }
        };
        let result = super::run(
            &settings,
            &mut self.channel,
            request,
            local.map(|l| l.deadline),
            worker_lost,
        )
        .await;
        let outcome = result.unwrap_or_else(|err| Outcome::Aborted {
            reason: err.to_string(),
        });
        self.events.publish(AgentEvent::CheckpointEnded {
            result: match &outcome {
                Outcome::Committed { step } => CheckpointResult::Committed { step: *step },
                Outcome::Aborted { .. } => CheckpointResult::Aborted,
                Outcome::Unsupported { .. } => CheckpointResult::Unsupported,
            },
            elapsed: started.elapsed(),
        });
        match &outcome {
            Outcome::Committed { step } => {
                info!("checkpoint committed at step {step} on every node");
            }
            Outcome::Aborted { reason } => warn!("checkpoint aborted: {reason}"),
            Outcome::Unsupported { reason } => {
                warn!("no checkpoint barrier ({reason}); forwarding the stop to every worker");
            }
        }
        outcome
    }

    /// A request that came while no attempt runs (the first rendezvous, or between attempts):
    /// nothing can be saved. An operator's request (`POST /checkpoint`) then ends the agent as
    /// a preemption without a committed checkpoint (201): no signal came, so the 143 the launch
    /// reports for its cancelled token would name one that never did. A signal keeps its
    /// 128+N, as when torchrun is stopped by it.
    fn stop_between_attempts(&self, trigger: &Trigger) {
        if trigger.signal.is_some() {
            warn!("no attempt is running; stopping without a checkpoint");
            return;
        }
        warn!(
            "{}: no attempt is running (the agent is still in the rendezvous or between \
             attempts), so there is nothing to save; stopping without a checkpoint (exit {})",
            trigger.reason,
            exit_code::CHECKPOINT_ABORTED
        );
        *self.outcome.lock().unwrap_or_else(PoisonError::into_inner) = Some(Outcome::Aborted {
            reason: "no attempt was running: nothing to save".to_owned(),
        });
    }

    /// Ends the attempt according to the outcome.
    async fn finish(
        &self,
        outcome: Outcome,
        stop: Option<&StopRequest>,
        signal: Option<Signal>,
        deadline: Instant,
        observer: &mut Observer,
    ) {
        *self.outcome.lock().unwrap_or_else(PoisonError::into_inner) = Some(outcome.clone());
        if let Outcome::Committed { .. } = outcome {
            // The workers were told to stop; give them until the deadline to do it.
            let ended = async {
                loop {
                    match observer.events.recv().await {
                        Ok(Event::GroupEnded { .. }) | Err(broadcast::error::RecvError::Closed) => {
                            return
                        }
                        _ => {}
                    }
                }
            };
            if tokio::time::timeout_at(deadline, ended).await.is_ok() {
                return;
            }
            warn!("workers still running at the deadline after the commit; stopping them");
        }
        stop_workers(stop, signal, &self.shutdown);
    }
}

/// Stops this node's workers: through the signal's stop request when this node was signalled,
/// else through the launch's token (which stops them with SIGTERM).
fn stop_workers(stop: Option<&StopRequest>, signal: Option<Signal>, shutdown: &CancellationToken) {
    match stop {
        Some(stop) => stop.request(signal.unwrap_or(Signal::SIGTERM)),
        None => shutdown.cancel(),
    }
}

fn store_addr(assignment: &RankAssignment) -> Option<std::net::SocketAddr> {
    let ip: std::net::IpAddr = assignment.master_addr.parse().ok()?;
    Some((ip, assignment.master_port).into())
}

/// Publishes this node's request on the attempt's store, in the background.
/// On a one-node gang, the standing request goes straight to `requests` (no watcher runs there).
fn publish(
    assignment: &RankAssignment,
    trigger: &Trigger,
    deadline: Instant,
    requests: &mpsc::UnboundedSender<(u32, Request)>,
) {
    let Some(store) = store_addr(assignment) else {
        return;
    };
    let run_id = assignment.run_id.clone();
    let node = assignment.node_rank;
    let reason = format!("{} on node {node}", trigger.reason);
    let budget = deadline.saturating_duration_since(Instant::now());
    let alone =
        (!assignment.has_peer_nodes()).then(|| (requests.clone(), assignment.restart_count));
    tokio::spawn(async move {
        match super::trigger(store, &run_id, node, budget, &reason).await {
            Ok(standing) => {
                if let Some((requests, restart_count)) = alone {
                    let _ = requests.send((restart_count, standing));
                }
            }
            Err(err) => warn!("cannot publish the checkpoint request: {err}"),
        }
    });
}

/// Waits for any node's request on this attempt's store.
fn spawn_watcher(
    assignment: &RankAssignment,
    stop: CancellationToken,
    requests: mpsc::UnboundedSender<(u32, Request)>,
) {
    let Some(store) = store_addr(assignment) else {
        return;
    };
    let run_id = assignment.run_id.clone();
    let restart_count = assignment.restart_count;
    tokio::spawn(async move {
        match super::watch(store, &run_id, stop).await {
            Ok(Some(request)) => {
                let _ = requests.send((restart_count, request));
            }
            Ok(None) => {}
            // The attempt's store goes away with the attempt; nothing to report.
            Err(err) => tracing::debug!("checkpoint watcher: {err}"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_keeps_a_bounded_margin() {
        assert_eq!(budget(Duration::from_secs(30)), Duration::from_secs(27));
        assert_eq!(budget(Duration::from_secs(5)), Duration::from_secs(4));
        assert_eq!(budget(Duration::from_secs(600)), Duration::from_secs(595));
        assert_eq!(budget(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_preemption_without_a_committed_checkpoint_is_never_success() {
        let unsupported = Outcome::Unsupported {
            reason: "node 1 [0] does not use the helper".into(),
        };
        assert_eq!(
            exit_code_after(Some(&unsupported), 0, 200),
            exit_code::CHECKPOINT_ABORTED
        );
        assert_eq!(exit_code_after(Some(&unsupported), 143, 200), 143);
        let aborted = Outcome::Aborted {
            reason: "deadline".into(),
        };
        assert_eq!(
            exit_code_after(Some(&aborted), 0, 0),
            exit_code::CHECKPOINT_ABORTED
        );
        let committed = Outcome::Committed { step: 7 };
        assert_eq!(exit_code_after(Some(&committed), 0, 200), 200);
        assert_eq!(exit_code_after(None, 0, 200), 0);
        assert_eq!(exit_code_after(None, 3, 200), 3);
    }
}
