//! Preemption: SIGTERM (or `POST /checkpoint`) on any node becomes a checkpoint that every rank on
//! every node saves at the same step, committed before anyone exits, inside the grace period.
//!
//! - [`local`]: the Unix socket the workers' Python helper (`python/muster_launcher/checkpoint.py`) talks
//!   to: step reports in, "save at T" / "commit" / "abort" out.
//! - [`barrier`]: the store keys and the pure decisions (target step, margin, verdict encoding).
//! - [`requests`]: the channel that brings an operator's request (`POST /checkpoint`) to the
//!   barrier.
//! - this module: the driver that runs one checkpoint across the gang, [`run`], and the
//!   request's trigger and watcher.
//!
//! Failure is always bounded: whatever cannot finish before the deadline becomes an "abort"
//! verdict, the workers are told, and the previous committed checkpoint stays the restart point.

pub mod barrier;
pub mod controller;
pub mod local;
pub mod requests;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rendezvous::store::client::{Client, ClientError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use barrier::{Keys, NodeProgress, Request, Verdict, UNSUPPORTED_PREFIX};
use local::{LocalChannel, WorkerEvent};

/// Read by the framework integrations muster's `sitecustomize` loads
/// (python/muster_launcher/integrations/): `0` keeps them from adding muster's checkpoint
/// callback to Hugging Face and Lightning Trainers (`--framework-callbacks`).
pub const FRAMEWORK_CALLBACKS_ENV: &str = "MUSTER_FRAMEWORK_CALLBACKS";

/// How long agreeing on a target and telling every worker is assumed to take; the target step is
/// placed this far (in steps) ahead of the furthest rank.
pub const DEFAULT_NOTIFY_LATENCY: Duration = Duration::from_millis(200);

/// Attempts before giving up when workers keep hearing of the target too late.
pub const MAX_ATTEMPTS: u32 = 4;

/// Where one node stands in the job, for the barrier.
#[derive(Debug, Clone)]
pub struct Settings {
    pub run_id: String,
    pub node_rank: u32,
    pub nnodes: u32,
    pub local_world_size: u32,
    pub world_size: u32,
    /// The agents' store (node 0's).
    pub store: SocketAddr,
    pub notify_latency: Duration,
}

/// How a checkpoint ended, for this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank of the job saved at `step`; the workers were told to stop.
    Committed { step: u64 },
    /// No commit before the deadline, or a rank could not save; the workers were told.
    Aborted { reason: String },
    /// Some node's workers do not use the helper: the caller forwards the signal instead, on
    /// every node at once.
    Unsupported { reason: String },
}

/// Errors talking to the store during a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint barrier: {0}")]
    Store(#[from] ClientError),
}

fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The tokio instant of a deadline given as Unix milliseconds.
fn instant_of(deadline_unix_ms: u64) -> Instant {
    let now = unix_ms_now();
    Instant::now() + Duration::from_millis(deadline_unix_ms.saturating_sub(now))
}

/// Publishes a checkpoint request unless one stands already; returns the standing request
/// (this one, or the earlier one this trigger joins).
pub async fn trigger(
    store: SocketAddr,
    run_id: &str,
    node_rank: u32,
    budget: Duration,
    reason: &str,
) -> Result<Request, CheckpointError> {
    let keys = Keys::new(run_id);
    let mut client = Client::connect(store, budget.max(Duration::from_millis(100))).await?;
    let ours = Request {
        deadline_unix_ms: unix_ms_now() + budget.as_millis() as u64,
        node_rank,
        reason: reason.replace('\n', " "),
    };
    let standing = client
        .compare_set(&keys.request(), b"", &ours.encode())
        .await?;
    Ok(Request::decode(&standing).unwrap_or(ours))
}

/// Resolves when any node has requested a checkpoint; `None` when `stop` fires first.
pub async fn watch(
    store: SocketAddr,
    run_id: &str,
    stop: CancellationToken,
) -> Result<Option<Request>, CheckpointError> {
    let keys = Keys::new(run_id);
    let key = keys.request();
    let mut client = Client::connect(store, Duration::from_secs(30)).await?;
    // Long waits with a bounded timeout: a vanished store shows up as an error, not a hang.
    let Some(value) = client
        .wait_for_key(&key, Duration::from_secs(30), &stop)
        .await?
    else {
        return Ok(None);
    };
    if let Some(request) = Request::decode(&value) {
        return Ok(Some(request));
    }
    warn!("checkpoint request key holds {value:?}; ignoring it");
    Ok(None)
}

/// Runs one checkpoint on this node until a verdict stands for the whole job.
///
/// `own_deadline` is this node's grace deadline (when it was signalled itself); the earlier of it
/// and the request's is used. `worker_lost` resolves (with a description) when a local worker
/// exits while the checkpoint is in progress; that aborts the checkpoint for everyone.
pub async fn run(
    settings: &Settings,
    local: &mut LocalChannel,
    request: &Request,
    own_deadline: Option<Instant>,
    worker_lost: impl Future<Output = String>,
) -> Result<Outcome, CheckpointError> {
    let deadline = own_deadline.map_or_else(
        || instant_of(request.deadline_unix_ms),
        |own| own.min(instant_of(request.deadline_unix_ms)),
    );
    let keys = Keys::new(&settings.run_id);
    let mut client = Client::connect(settings.store, remaining(deadline)).await?;
    tokio::pin!(worker_lost);
    for attempt in 0..MAX_ATTEMPTS {
        client.set_timeout(remaining(deadline));
        let verdict = run_attempt(
            settings,
            &keys,
            &mut client,
            local,
            attempt,
            deadline,
            &mut worker_lost,
        )
        .await?;
        info!(attempt, "checkpoint verdict: {verdict}");
        match verdict {
            Verdict::Commit { step } => {
                local.broadcast(&format!("commit {attempt} exit"));
                return Ok(Outcome::Committed { step });
            }
            Verdict::Retry { reason } if attempt + 1 < MAX_ATTEMPTS => {
                warn!(attempt, "checkpoint retried: {reason}");
            }
            Verdict::Retry { reason } | Verdict::Abort { reason } => {
                local.broadcast(&format!("abort {attempt} {reason}"));
                if let Some(unsupported) = reason.strip_prefix(UNSUPPORTED_PREFIX) {
                    return Ok(Outcome::Unsupported {
                        reason: unsupported.to_owned(),
                    });
                }
                return Ok(Outcome::Aborted { reason });
            }
        }
    }
    Ok(Outcome::Aborted {
        reason: "too many attempts".to_owned(),
    })
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

async fn run_attempt(
    settings: &Settings,
    keys: &Keys,
    client: &mut Client,
    local: &mut LocalChannel,
    attempt: u32,
    deadline: Instant,
    worker_lost: &mut (impl Future<Output = String> + Unpin),
) -> Result<Verdict, CheckpointError> {
    let node = settings.node_rank;
    // 1. Report progress; the last reporter sets the target for everyone.
    let progress = local.progress();
    let all_connected = progress.len() as u32 >= settings.local_world_size;
    let mine = NodeProgress {
        max_step: if all_connected {
            progress.iter().filter_map(|p| p.step).max()
        } else {
            None
        },
        step_period: progress.iter().filter_map(|p| p.step_period).min(),
    };
    let ready = HelperState::of(all_connected, &local.view().ranks()).word();
    let mut record = mine.encode();
    record.extend_from_slice(format!(" {ready}").as_bytes());
    client.set(&keys.progress(attempt, node), &record).await?;
    if client.add(&keys.reported(attempt), 1).await? == i64::from(settings.nnodes) {
        decide_target(settings, keys, client, attempt).await?;
    }

    // 2. The target (or a verdict that makes it moot).
    let target_key = keys.target(attempt);
    match client.wait(&[&target_key], remaining(deadline)).await {
        Ok(()) => {}
        Err(ClientError::WaitTimeout { .. }) => {
            return settle(
                client,
                keys,
                attempt,
                abort(format!(
                    "deadline passed on node {node} before a target step was agreed"
                )),
            )
            .await;
        }
        Err(err) => return Err(err.into()),
    }
    let target = client.get(&target_key).await?;
    let Some(target) = std::str::from_utf8(&target)
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
    else {
        return read_verdict(client, keys, attempt).await;
    };
    let deadline_unix_s = (unix_ms_now() + remaining(deadline).as_millis() as u64) / 1000;
    local.broadcast(&format!("save {attempt} {target} {deadline_unix_s}"));
    info!(
        attempt,
        target, "checkpoint: every rank saves at step {target}"
    );

    // 3. Local confirmations, while watching for a verdict from elsewhere.
    let verdict_key = keys.verdict(attempt);
    let mut watcher = Client::connect(settings.store, remaining(deadline)).await?;
    let mut saved = BTreeSet::new();
    let watched: [&[u8]; 1] = [&verdict_key];
    let verdict_seen = watcher.wait(&watched, remaining(deadline));
    tokio::pin!(verdict_seen);
    loop {
        tokio::select! {
            waited = &mut verdict_seen => {
                return match waited {
                    Ok(()) => read_verdict(client, keys, attempt).await,
                    Err(ClientError::WaitTimeout { .. }) => {
                        let doing = unsaved_ranks(&local.progress(), &local.view().ranks(), &saved, target, Instant::now());
                        settle(client, keys, attempt, abort(format!("deadline passed on node {node} before every rank saved: {doing}"))).await
                    }
                    Err(err) => Err(err.into()),
                };
            }
            lost = &mut *worker_lost => {
                return settle(client, keys, attempt, abort(format!("node {node}: {lost}"))).await;
            }
            event = local.next_event() => match event {
                Some(WorkerEvent::Saved { local_rank, generation, step, .. }) if generation == u64::from(attempt) => {
                    if step != target {
                        return settle(client, keys, attempt, retry(format!("local rank {local_rank} on node {node} saved step {step} instead of {target}"))).await;
                    }
                    saved.insert(local_rank);
                    if saved.len() as u32 == settings.local_world_size {
                        let done = client.add(&keys.done(attempt), i64::from(settings.local_world_size)).await?;
                        if done == i64::from(settings.world_size) {
                            return settle(client, keys, attempt, Verdict::Commit { step: target }).await;
                        }
                    }
                }
                Some(WorkerEvent::Missed { local_rank, generation, step }) if generation == u64::from(attempt) => {
                    return settle(client, keys, attempt, retry(format!("local rank {local_rank} on node {node} was already at step {step}, past {target}"))).await;
                }
                Some(WorkerEvent::Failed { local_rank, generation, reason }) if generation == u64::from(attempt) => {
                    return settle(client, keys, attempt, abort(format!("local rank {local_rank} on node {node} could not save: {reason}"))).await;
                }
                // Late messages of an earlier attempt.
                Some(_) => {}
                None => return settle(client, keys, attempt, abort(format!("node {node}: the local checkpoint channel closed"))).await,
            },
        }
    }
}

fn abort(reason: String) -> Verdict {
    Verdict::Abort { reason }
}

fn retry(reason: String) -> Verdict {
    Verdict::Retry { reason }
}

/// The last reporter reads every node's progress and sets the target (or the verdict that there
/// is none to set).
async fn decide_target(
    settings: &Settings,
    keys: &Keys,
    client: &mut Client,
    attempt: u32,
) -> Result<(), CheckpointError> {
    let progress_keys: Vec<Vec<u8>> = (0..settings.nnodes)
        .map(|n| keys.progress(attempt, n))
        .collect();
    let refs: Vec<&[u8]> = progress_keys.iter().map(Vec::as_slice).collect();
    let records = client.multi_get(&refs).await?;
    let mut nodes = Vec::with_capacity(records.len());
    let mut starting = Vec::new();
    let mut without_helper = Vec::new();
    for (node, record) in records.iter().enumerate() {
        let text = String::from_utf8_lossy(record);
        let (progress, ready) = text.rsplit_once(' ').unwrap_or((&text, ""));
        match HelperState::parse(ready) {
            HelperState::Ready => {}
            HelperState::Starting => starting.push(node),
            HelperState::Without => without_helper.push(node),
        }
        nodes.extend(NodeProgress::decode(progress.as_bytes()));
    }
    if !starting.is_empty() || !without_helper.is_empty() {
        let reason = format!(
            "{UNSUPPORTED_PREFIX}{}",
            unsupported_reason(&starting, &without_helper)
        );
        client
            .compare_set(&keys.verdict(attempt), b"", &abort(reason).encode())
            .await?;
        client.set(&keys.target(attempt), b"none").await?;
        return Ok(());
    }
    let target = barrier::choose_target(&nodes, settings.notify_latency, attempt);
    client
        .set(&keys.target(attempt), target.to_string().as_bytes())
        .await?;
    Ok(())
}

/// Where a node's ranks stand with the checkpoint helper when a checkpoint is asked for: every
/// rank connected, or not all of them, told apart by whether any rank already reported a step
/// without it. A preemption during start-up (imports, `init_process_group`) finds no helper
/// connected on a node whose script does use it: saying it does not would send the user
/// looking for a bug that is not there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HelperState {
    /// Every local rank's helper is connected.
    Ready,
    /// Not every helper is connected, and no rank of the node reported a step: still starting.
    Starting,
    /// Not every helper is connected, though a rank reported steps (through the zero-code
    /// reporter): the script runs without the helper.
    Without,
}

impl HelperState {
    fn of(all_connected: bool, ranks: &[local::RankWatch]) -> Self {
        if all_connected {
            Self::Ready
        } else if ranks.iter().any(|r| r.zero_code && r.first_step.is_some()) {
            Self::Without
        } else {
            Self::Starting
        }
    }

    /// The word in the node's progress record.
    fn word(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Starting => "starting",
            Self::Without => "nohelper",
        }
    }

    fn parse(word: &str) -> Self {
        match word {
            "ready" => Self::Ready,
            "starting" => Self::Starting,
            _ => Self::Without,
        }
    }
}

/// The most ranks [`unsaved_ranks`] spells out; the rest are counted.
const UNSAVED_NAMED: usize = 4;

/// What the ranks that had not saved at `target` were doing when the deadline passed: each
/// one's last step, how long before, and the section it was in (the helper's `ckpt.section`),
/// so that a rank in a long evaluation reads as such and not as a bare "deadline passed".
fn unsaved_ranks(
    progress: &[local::RankProgress],
    ranks: &[local::RankWatch],
    saved: &BTreeSet<u32>,
    target: u64,
    now: Instant,
) -> String {
    let unsaved: Vec<&local::RankProgress> = progress
        .iter()
        .filter(|p| !saved.contains(&p.local_rank))
        .collect();
    let mut each: Vec<String> = unsaved
        .iter()
        .take(UNSAVED_NAMED)
        .map(|p| {
            let at = p.step.map_or_else(
                || "had reported no step".to_owned(),
                |step| format!("was at step {step}"),
            );
            let mut text = format!("local rank {} {at}", p.local_rank);
            if let Some(when) = p.reported_at {
                let _ = write!(
                    text,
                    " (last step {:.1} s before",
                    now.saturating_duration_since(when).as_secs_f64()
                );
                if let Some((name, since)) = ranks
                    .iter()
                    .find(|r| r.local_rank == p.local_rank)
                    .and_then(|r| r.section.as_ref())
                {
                    let _ = write!(
                        text,
                        ", inside section `{name}` for {:.1} s",
                        now.saturating_duration_since(*since).as_secs_f64()
                    );
                }
                text.push(')');
            }
            text
        })
        .collect();
    if unsaved.len() > UNSAVED_NAMED {
        each.push(format!("{} more", unsaved.len() - UNSAVED_NAMED));
    }
    if each.is_empty() {
        return format!("no rank had reached step {target}, the agreed step");
    }
    format!(
        "{}; none of them reached step {target}, the agreed step, in time: they were between \
         steps (an evaluation, a long step) when the grace period ran out",
        each.join(", ")
    )
}

/// `node 1`, `nodes 0 and 2`, `nodes 0, 1 and 2`.
fn nodes_in_words(nodes: &[usize]) -> String {
    match nodes {
        [] => String::new(),
        [one] => format!("node {one}"),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(ToString::to_string).collect();
            format!("nodes {} and {last}", init.join(", "))
        }
    }
}

/// Why there is no barrier, naming the nodes still starting apart from those without the helper.
fn unsupported_reason(starting: &[usize], without_helper: &[usize]) -> String {
    let mut parts = Vec::new();
    if !starting.is_empty() {
        parts.push(format!(
            "the ranks of {} had not connected to the checkpoint helper yet (still starting: no \
             rank there had reported a step)",
            nodes_in_words(starting)
        ));
    }
    if !without_helper.is_empty() {
        parts.push(format!(
            "the workers of {} do not use the checkpoint helper (their ranks report steps \
             without it)",
            nodes_in_words(without_helper)
        ));
    }
    parts.join("; ")
}

/// Proposes `verdict`; whichever verdict was written first stands and is returned.
async fn settle(
    client: &mut Client,
    keys: &Keys,
    attempt: u32,
    verdict: Verdict,
) -> Result<Verdict, CheckpointError> {
    client.set_timeout(Duration::from_secs(5));
    let standing = client
        .compare_set(&keys.verdict(attempt), b"", &verdict.encode())
        .await?;
    Ok(Verdict::decode(&standing).unwrap_or(verdict))
}

async fn read_verdict(
    client: &mut Client,
    keys: &Keys,
    attempt: u32,
) -> Result<Verdict, CheckpointError> {
    client.set_timeout(Duration::from_secs(5));
    let value = client.get(&keys.verdict(attempt)).await?;
    Ok(Verdict::decode(&value).unwrap_or_else(|| abort(format!("unreadable verdict {value:?}"))))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use rendezvous::store::server::{Config, Server};
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    use super::*;

    /// How a fake worker behaves when asked to save.
    #[derive(Clone, Copy)]
    enum Behaviour {
        Saves,
        FailsToSave,
        /// Never connects to the helper socket (an unmodified script).
        NoHelper,
    }

    /// A worker that steps every `period` and follows the helper protocol.
    async fn fake_worker(address: String, local_rank: u32, period: Duration, behaviour: Behaviour) {
        if matches!(behaviour, Behaviour::NoHelper) {
            return;
        }
        let stream = local::connect(&address).await.unwrap();
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        write
            .write_all(format!("hello {local_rank} {local_rank} 1\n").as_bytes())
            .await
            .unwrap();
        let mut step = 0u64;
        let mut request: Option<(u64, u64)> = None;
        loop {
            write
                .write_all(format!("step {step}\n").as_bytes())
                .await
                .unwrap();
            if let Some((attempt, target)) = request {
                if step == target {
                    let line = match behaviour {
                        Behaviour::FailsToSave => format!("failed {attempt} disk full\n"),
                        _ => format!("saved {attempt} {step} ckpt-{step}\n"),
                    };
                    write.write_all(line.as_bytes()).await.unwrap();
                    // Wait for the verdict, then stop like a real script.
                    while let Ok(Some(line)) = lines.next_line().await {
                        if line.starts_with("commit") || line.starts_with("abort") {
                            return;
                        }
                    }
                    return;
                }
            }
            tokio::select! {
                line = lines.next_line() => match line {
                    Ok(Some(line)) => {
                        let words: Vec<&str> = line.split_whitespace().collect();
                        if words[0] == "save" {
                            request = Some((words[1].parse().unwrap(), words[2].parse().unwrap()));
                        } else if words[0] == "abort" {
                            return;
                        }
                    }
                    _ => return,
                },
                () = tokio::time::sleep(period) => step += 1,
            }
        }
    }

    struct Node {
        settings: Settings,
        channel: LocalChannel,
    }

    async fn gang(
        nnodes: u32,
        nproc: u32,
        period: Duration,
        behaviour: impl Fn(u32, u32) -> Behaviour,
    ) -> (Vec<Node>, SocketAddr, CancellationToken) {
        let stop = CancellationToken::new();
        let server = Server::bind((Ipv4Addr::LOCALHOST, 0).into(), Config::default())
            .await
            .unwrap();
        let store = server.local_addr();
        tokio::spawn(server.run(stop.clone()));
        let run_id = format!("test-{}", rand::random::<u32>());
        let mut nodes = Vec::new();
        for node in 0..nnodes {
            let channel = LocalChannel::bind(&stop).unwrap();
            for rank in 0..nproc {
                tokio::spawn(fake_worker(
                    channel.address().to_owned(),
                    rank,
                    period,
                    behaviour(node, rank),
                ));
            }
            nodes.push(Node {
                settings: Settings {
                    run_id: run_id.clone(),
                    node_rank: node,
                    nnodes,
                    local_world_size: nproc,
                    world_size: nnodes * nproc,
                    store,
                    notify_latency: DEFAULT_NOTIFY_LATENCY,
                },
                channel,
            });
        }
        // Let the workers connect and report a few steps.
        tokio::time::sleep(Duration::from_millis(100)).await;
        (nodes, store, stop)
    }

    /// Triggers from node `trigger_node` and runs the barrier on every node concurrently.
    async fn checkpoint(
        nodes: Vec<Node>,
        store: SocketAddr,
        trigger_node: u32,
        budget: Duration,
    ) -> Vec<Outcome> {
        let run_id = nodes[0].settings.run_id.clone();
        let mut tasks = Vec::new();
        for mut node in nodes {
            let run_id = run_id.clone();
            tasks.push(tokio::spawn(async move {
                let request = if node.settings.node_rank == trigger_node {
                    trigger(store, &run_id, trigger_node, budget, "SIGTERM")
                        .await
                        .unwrap()
                } else {
                    watch(store, &run_id, CancellationToken::new())
                        .await
                        .unwrap()
                        .unwrap()
                };
                run(
                    &node.settings,
                    &mut node.channel,
                    &request,
                    None,
                    std::future::pending(),
                )
                .await
                .unwrap()
            }));
        }
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.unwrap());
        }
        outcomes
    }

    #[tokio::test]
    async fn every_rank_of_every_node_commits_the_same_step() {
        let (nodes, store, stop) =
            gang(3, 2, Duration::from_millis(5), |_, _| Behaviour::Saves).await;
        let outcomes = checkpoint(nodes, store, 1, Duration::from_secs(10)).await;
        let Outcome::Committed { step } = outcomes[0] else {
            panic!("{outcomes:?}");
        };
        assert!(step > 0);
        assert!(
            outcomes.iter().all(|o| *o == Outcome::Committed { step }),
            "{outcomes:?}"
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn a_rank_that_cannot_save_aborts_the_whole_checkpoint() {
        let (nodes, store, stop) = gang(2, 2, Duration::from_millis(5), |node, rank| {
            if node == 1 && rank == 1 {
                Behaviour::FailsToSave
            } else {
                Behaviour::Saves
            }
        })
        .await;
        let outcomes = checkpoint(nodes, store, 0, Duration::from_secs(10)).await;
        for outcome in &outcomes {
            let Outcome::Aborted { reason } = outcome else {
                panic!("{outcomes:?}");
            };
            assert!(
                reason.contains("local rank 1 on node 1 could not save: disk full"),
                "{reason}"
            );
        }
        stop.cancel();
    }

    #[tokio::test]
    async fn scripts_without_the_helper_fall_back_on_every_node() {
        let (nodes, store, stop) = gang(2, 2, Duration::from_millis(5), |node, rank| {
            if node == 0 && rank == 0 {
                Behaviour::NoHelper
            } else {
                Behaviour::Saves
            }
        })
        .await;
        let outcomes = checkpoint(nodes, store, 1, Duration::from_secs(10)).await;
        for outcome in &outcomes {
            assert!(
                matches!(outcome, Outcome::Unsupported { reason }
                    if reason.contains("the ranks of node 0 had not connected to the checkpoint helper yet")),
                "{outcomes:?}"
            );
        }
        stop.cancel();
    }

    fn rank_watch(
        local_rank: u32,
        zero_code: bool,
        first_step: Option<Instant>,
    ) -> local::RankWatch {
        local::RankWatch {
            first_step,
            ..local::RankWatch::connected(local_rank, Some(local_rank), None, zero_code)
        }
    }

    #[test]
    fn a_node_still_starting_is_told_from_one_without_the_helper_in_words() {
        let now = Instant::now();
        assert_eq!(HelperState::of(true, &[]), HelperState::Ready);
        // Nobody connected yet, or only reporters of ranks still in init_process_group.
        assert_eq!(HelperState::of(false, &[]), HelperState::Starting);
        assert_eq!(
            HelperState::of(false, &[rank_watch(0, true, None)]),
            HelperState::Starting
        );
        // A rank that steps without the helper.
        assert_eq!(
            HelperState::of(
                false,
                &[rank_watch(0, true, Some(now)), rank_watch(1, true, None)]
            ),
            HelperState::Without
        );
        for state in [
            HelperState::Ready,
            HelperState::Starting,
            HelperState::Without,
        ] {
            assert_eq!(HelperState::parse(state.word()), state);
        }
        assert_eq!(nodes_in_words(&[1]), "node 1");
        assert_eq!(nodes_in_words(&[0, 2]), "nodes 0 and 2");
        assert_eq!(nodes_in_words(&[0, 1, 2]), "nodes 0, 1 and 2");
        assert_eq!(
            unsupported_reason(&[0, 1, 2], &[]),
            "the ranks of nodes 0, 1 and 2 had not connected to the checkpoint helper yet (still \
             starting: no rank there had reported a step)"
        );
        let both = unsupported_reason(&[0], &[3]);
        assert!(
            both.ends_with("; the workers of node 3 do not use the checkpoint helper (their ranks report steps without it)"),
            "{both}"
        );
    }

    #[test]
    fn a_deadline_names_what_the_unsaved_ranks_were_doing() {
        let now = Instant::now();
        let progress = |local_rank, ago_ms| local::RankProgress {
            local_rank,
            step: Some(20),
            reported_at: Some(now - Duration::from_millis(ago_ms)),
            step_period: None,
        };
        let mut evaluating = rank_watch(0, false, None);
        evaluating.section = Some(("evaluate".into(), now - Duration::from_secs(11)));
        let text = unsaved_ranks(
            &[progress(0, 12_300), progress(1, 12_100), progress(2, 100)],
            &[evaluating, rank_watch(1, false, None)],
            &BTreeSet::from([2]),
            24,
            now,
        );
        assert_eq!(
            text,
            "local rank 0 was at step 20 (last step 12.3 s before, inside section `evaluate` for \
             11.0 s), local rank 1 was at step 20 (last step 12.1 s before); none of them \
             reached step 24, the agreed step, in time: they were between steps (an evaluation, \
             a long step) when the grace period ran out"
        );
        let many: Vec<local::RankProgress> = (0..6).map(|r| progress(r, 10)).collect();
        assert!(unsaved_ranks(&many, &[], &BTreeSet::new(), 24, now).contains(", 2 more;"));
    }

    #[tokio::test]
    async fn a_deadline_too_short_for_the_save_aborts() {
        // One step a second, 300 ms of budget: nobody reaches the target in time.
        let (nodes, store, stop) =
            gang(2, 1, Duration::from_secs(1), |_, _| Behaviour::Saves).await;
        let started = Instant::now();
        let outcomes = checkpoint(nodes, store, 0, Duration::from_millis(300)).await;
        for outcome in &outcomes {
            assert!(
                matches!(outcome, Outcome::Aborted { reason } if reason.contains("deadline")),
                "{outcomes:?}"
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "bounded by the deadline"
        );
        stop.cancel();
    }
}
