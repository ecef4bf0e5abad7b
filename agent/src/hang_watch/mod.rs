//! The per-attempt hang watch: polls the ranks' reports, and when one is hung (or another node
//! says so) dumps every local rank's stacks into the log, names the cause and hands it to the
//! launch loop, which stops the attempt and restarts the gang with cause `hang`.
//!
//! Which rank is the cause: in a synchronous job every rank stops together — the hung one where
//! it is stuck, the others in their next collective, waiting for it. So the node that detects
//! the stall first tells every node ([`crate::watch::gang`]); each dumps its ranks and looks among
//! its stalled ranks for one that is not inside `torch.distributed` ([`hang::pick_culprit`]).
//! The node that finds one fails its attempt naming it; a node whose stalled ranks all wait in
//! collectives waits for the gang to re-form. When no node finds a culprit (every rank waits in
//! a collective: a deadlock between collectives), the detecting node names its own longest
//! stalled rank after [`SETTLE`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::checkpoint::local::{ProgressView, RankWatch};
use crate::launch::{BoxFuture, Watchdog, WatchedAttempt, WatchedWorker};
use crate::watch::gang::{self, Notice};
use crate::watch::hang::{self, Policy, RankView, Section, Stall, Waiting};
use crate::watch::stacks::{self, Faulthandler, ProcessStacks};
use crate::watch::startup;
use crate::watch::Hang;

/// The longest the watch sleeps before it looks at the reports again.
const POLL: Duration = Duration::from_secs(1);
/// How long a node that detected a hang, but found every stalled rank of its own waiting in a
/// collective, waits for another node to name the cause before it names its own rank.
pub const SETTLE: Duration = Duration::from_secs(10);

/// The hang watch: `--hang-timeout` and `--section-timeout` over the helper's reports.
pub struct HangWatch {
    policy: Policy,
    view: ProgressView,
    live: Arc<Mutex<Live>>,
}

impl HangWatch {
    pub fn new(policy: Policy, view: ProgressView) -> Self {
        Self {
            policy,
            view,
            live: Arc::default(),
        }
    }

    /// The running attempt's ranks, for reading their stacks on demand (`muster stacks`).
    pub fn stacks_source(&self) -> Stacks {
        Stacks {
            view: self.view.clone(),
            live: Arc::clone(&self.live),
        }
    }
}

impl Watchdog for HangWatch {
    fn watch(&self, attempt: WatchedAttempt) -> BoxFuture<'static, Hang> {
        // Every attempt is watched (also with the timeout off) so that its ranks are known to
        // [`Stacks`] while it runs; the registration ends when the attempt drops the watch.
        let registered = Registered::new(&self.live, &attempt);
        let watch = run(self.policy, self.view.clone(), attempt);
        Box::pin(async move {
            let _registered = registered;
            watch.await
        })
    }
}

/// The attempt whose ranks are running now, if any.
#[derive(Default)]
struct Live {
    generation: u64,
    current: Option<Running>,
}

struct Running {
    workers: Vec<WatchedWorker>,
    started: Instant,
    exited: tokio::sync::watch::Receiver<Vec<u32>>,
}

/// Holds an attempt's place in [`Live`] until dropped.
struct Registered {
    live: Arc<Mutex<Live>>,
    generation: u64,
}

impl Registered {
    fn new(live: &Arc<Mutex<Live>>, attempt: &WatchedAttempt) -> Self {
        let mut l = live.lock().unwrap_or_else(PoisonError::into_inner);
        l.generation += 1;
        l.current = Some(Running {
            workers: attempt.workers.clone(),
            started: attempt.started,
            exited: attempt.exited.clone(),
        });
        Self {
            live: Arc::clone(live),
            generation: l.generation,
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut l = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        // A later attempt registered already: its ranks stay.
        if l.generation == self.generation {
            l.current = None;
        }
    }
}

/// Read-only: every local rank's stacks now, read the way the hang dump reads them.
#[derive(Clone)]
pub struct Stacks {
    view: ProgressView,
    live: Arc<Mutex<Live>>,
}

impl Stacks {
    /// The dump of every running local rank (a header per rank, then its threads), or `None`
    /// when no attempt is running.
    pub async fn dump(&self) -> Option<Vec<String>> {
        let (workers, started, exited) = {
            let l = self.live.lock().unwrap_or_else(PoisonError::into_inner);
            let running = l.current.as_ref()?;
            let exited = running.exited.borrow().clone();
            (running.workers.clone(), running.started, exited)
        };
        let reports = self.view.ranks();
        let mut lines = Vec::new();
        for w in workers.iter().filter(|w| !exited.contains(&w.local_rank)) {
            let report = report_since(started, &reports, w.local_rank);
            let (pid, read) = read_rank(w, report).await;
            lines.extend(dump_lines(w, pid, &read));
        }
        Some(lines)
    }
}

/// How this node learned of the hang.
enum Trigger {
    Local(Stall),
    Remote(Notice),
}

/// The attempt's reports joined with its workers: reports from before the attempt started
/// belong to an earlier attempt's workers.
fn rank_views(attempt: &WatchedAttempt, reports: &[RankWatch]) -> Vec<RankView> {
    let exited = attempt.exited.borrow().clone();
    attempt
        .workers
        .iter()
        .map(|w| {
            let report = current_report(attempt, reports, w.local_rank);
            RankView {
                local_rank: w.local_rank,
                rank: w.rank,
                step: report.and_then(|r| r.step),
                steps_seen: report.map_or(0, |r| r.steps_seen),
                last_progress: report.and_then(|r| r.last_progress),
                slowest_period: report.and_then(|r| r.slowest_period),
                section: report.and_then(|r| {
                    r.section.as_ref().map(|(name, since)| Section {
                        name: name.clone(),
                        since: *since,
                    })
                }),
                // A rank whose script finished (its interpreter exits) is not hung.
                exited: exited.contains(&w.local_rank) || report.is_some_and(|r| r.exiting),
                init_entered: report.and_then(|r| r.init_entered),
                init_returned: report.and_then(|r| r.init_returned),
                first_step: report.and_then(|r| r.first_step),
                last_step: report.and_then(|r| r.last_step),
            }
        })
        .collect()
}

fn current_report<'a>(
    attempt: &WatchedAttempt,
    reports: &'a [RankWatch],
    local_rank: u32,
) -> Option<&'a RankWatch> {
    report_since(attempt.started, reports, local_rank)
}

fn report_since(started: Instant, reports: &[RankWatch], local_rank: u32) -> Option<&RankWatch> {
    reports
        .iter()
        .find(|r| r.local_rank == local_rank && r.connected_at >= started)
}

fn store_addr(attempt: &WatchedAttempt) -> Option<SocketAddr> {
    let a = &attempt.assignment;
    let ip: std::net::IpAddr = a.master_addr.parse().ok()?;
    Some((ip, a.master_port).into())
}

/// One attempt's watch: waits for a hang on this node or word of one from another, dumps the
/// ranks' stacks and names the cause (or leaves naming it to the node that can).
async fn run(policy: Policy, view: ProgressView, attempt: WatchedAttempt) -> Hang {
    if policy.timeout == hang::HangTimeout::Off && policy.startup_timeout.is_none() {
        return std::future::pending().await;
    }
    let node = attempt.assignment.node_rank;
    let run_id = attempt.assignment.run_id.clone();
    // One node has no one to tell.
    let store = store_addr(&attempt).filter(|_| attempt.assignment.has_peer_nodes());
    let stop_waiting = CancellationToken::new();
    let _stop_on_drop = stop_waiting.clone().drop_guard();
    let notices = gang_notices(store, &run_id, notice_watch_delay(&policy), &stop_waiting);
    let trigger = wait_for_trigger(&policy, &view, &attempt, notices).await;
    let limit = announce(&trigger, node, store, &run_id);

    let reports = view.ranks();
    let dumps = dump_all(&attempt, &reports).await;
    if let Some(hang) = name_cause(&policy, &attempt, &view, &dumps, &reports, &trigger, limit) {
        return hang;
    }
    match trigger {
        Trigger::Remote(_) => {
            info!(
                "no stalled rank on node {node} is outside torch.distributed: the cause is elsewhere; waiting for the gang to re-form"
            );
            std::future::pending().await
        }
        Trigger::Local(stall) => {
            name_own_after_settle(&view, &attempt, stall, limit, &dumps, store.is_some()).await
        }
    }
}

/// How long after its attempt starts a node opens the connection that waits for other nodes'
/// hang notices: the smaller of [`NOTICE_WATCH_DELAY_MAX`] and half this node's shortest limit.
/// A notice comes only once some rank has passed a limit, and every limit counts from the
/// rank's own report (its first step, `init_process_group`, a section), so none is lost: one
/// published before the connection opens is read at once then (WAIT answers for a key that
/// exists). What it saves is one connection per node in the burst of a gang's start (node 0
/// accepts them all at once), and all of it for ranks that finish within that second.
fn notice_watch_delay(policy: &Policy) -> Duration {
    let fixed = match policy.timeout {
        hang::HangTimeout::Fixed(limit) => Some(limit),
        hang::HangTimeout::Off | hang::HangTimeout::Auto => None,
    };
    [fixed, policy.startup_timeout, Some(policy.section_timeout)]
        .into_iter()
        .flatten()
        .min()
        .map_or(NOTICE_WATCH_DELAY_MAX, |shortest| {
            (shortest / 2).min(NOTICE_WATCH_DELAY_MAX)
        })
}

/// See [`notice_watch_delay`].
const NOTICE_WATCH_DELAY_MAX: Duration = Duration::from_secs(1);

/// Another node's hang notice, read from the attempt's store from `delay` after now (see
/// [`notice_watch_delay`]); a future that never resolves when there is no store to read (or the
/// watcher ends without a notice).
fn gang_notices(
    store: Option<SocketAddr>,
    run_id: &str,
    delay: Duration,
    stop_waiting: &CancellationToken,
) -> impl Future<Output = Notice> {
    let (notice_tx, notice_rx) = tokio::sync::oneshot::channel::<Notice>();
    if let Some(store) = store {
        let run_id = run_id.to_owned();
        let stop = stop_waiting.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
            match gang::wait(store, &run_id, stop).await {
                Ok(Some(notice)) => {
                    let _ = notice_tx.send(notice);
                }
                Ok(None) => {}
                // The attempt's store goes away with the attempt.
                Err(err) => tracing::debug!("hang notice watcher: {err}"),
            }
        });
    }
    async move {
        match notice_rx.await {
            Ok(notice) => notice,
            Err(_) => std::future::pending().await,
        }
    }
}

/// Looks at the reports until a rank of this node passes its hang or startup limit, or
/// another node's notice comes.
async fn wait_for_trigger(
    policy: &Policy,
    view: &ProgressView,
    attempt: &WatchedAttempt,
    notices: impl Future<Output = Notice>,
) -> Trigger {
    let node = attempt.assignment.node_rank;
    tokio::pin!(notices);
    // A notice of this node's own (published by an earlier agent of this node rank under the same
    // run) tells nothing, and the future that gave it is spent: polling it again would panic.
    let mut notice_spent = false;
    loop {
        let views = rank_views(attempt, &view.ranks());
        let now = Instant::now();
        if let Some(stall) = hang::decide(policy, &views, now) {
            return Trigger::Local(stall);
        }
        if let Some(stall) = policy
            .startup_timeout
            .and_then(|limit| startup::decide(limit, &views, now))
        {
            return Trigger::Local(stall);
        }
        let at = hang::next_check(policy, &views, now, POLL);
        tokio::select! {
            () = tokio::time::sleep_until(at) => {}
            notice = &mut notices, if !notice_spent => {
                if notice.node_rank != node {
                    return Trigger::Remote(notice);
                }
                notice_spent = true;
            }
        }
    }
}

/// Logs how this node learned of the hang and, when it detected it, tells the other nodes;
/// returns the limit the stalled rank passed.
fn announce(trigger: &Trigger, node: u32, store: Option<SocketAddr>, run_id: &str) -> Duration {
    match trigger {
        Trigger::Local(stall) => {
            // A warning, not the error: the rank that passed its limit first is often one that
            // waits for the cause; the `hung:` error below names the cause.
            warn!(
                "hang detected on node {node}: {}; dumping every local rank's stacks to find the cause{}",
                stall.describe(),
                if store.is_some() {
                    " and telling the other nodes"
                } else {
                    ""
                }
            );
            if let Some(store) = store {
                let notice = Notice {
                    node_rank: node,
                    rank: stall.rank,
                    limit: stall.limit,
                    startup: stall.startup.is_some(),
                    what: stall.describe(),
                };
                let run_id = run_id.to_owned();
                tokio::spawn(async move {
                    if let Err(err) = gang::publish(store, &run_id, &notice).await {
                        warn!("cannot tell the other nodes of the hang: {err}");
                    }
                });
            }
            stall.limit
        }
        Trigger::Remote(notice) => {
            warn!(
                "node {} detected a hang ({}); dumping this node's stacks",
                notice.node_rank, notice.what
            );
            notice.limit
        }
    }
}

/// The cause among this node's ranks, logged as the `hung:` error, in order: a stalled rank
/// outside torch.distributed, a rank working outside it without stepping, a rank stuck before
/// its first step (continued if stopped). `None`: this node sees no cause.
fn name_cause(
    policy: &Policy,
    attempt: &WatchedAttempt,
    view: &ProgressView,
    dumps: &[Dump],
    reports: &[RankWatch],
    trigger: &Trigger,
    limit: Duration,
) -> Option<Hang> {
    let views = rank_views(attempt, &view.ranks());
    let now = Instant::now();
    let stalled = with_waiting(hang::stalled_ranks(&views, limit, now), dumps);
    let reported_by = match trigger {
        Trigger::Remote(notice) => Some(notice.node_rank),
        Trigger::Local(_) => None,
    };
    if let Some(culprit) = hang::pick_culprit(&stalled) {
        return Some(logged(named(attempt, culprit, dumps, reported_by)));
    }
    // Every stalled rank here waits in torch.distributed. A rank of this node that works
    // outside it without stepping (an evaluation of its own, a loop that never ends) is the
    // one they wait for; only a rank whose stack was read counts (an unknown stack names nobody).
    let working: Vec<(Stall, Waiting)> =
        with_waiting(hang::working_ranks(&views, limit, now), dumps)
            .into_iter()
            .filter(|(_, w)| *w == Waiting::Elsewhere)
            .collect();
    if let Some(culprit) = hang::pick_culprit(&working) {
        return Some(logged(named(attempt, culprit, dumps, reported_by)));
    }
    let culprit = startup_culprit(policy, attempt, &views, dumps, reports, trigger)?;
    let hang = logged(named(attempt, &culprit, dumps, reported_by));
    continue_stopped(attempt, &culprit, reports);
    Some(hang)
}

/// Each stall with where its rank's dumped stack waits.
fn with_waiting(stalls: Vec<Stall>, dumps: &[Dump]) -> Vec<(Stall, Waiting)> {
    stalls
        .into_iter()
        .map(|s| {
            let waiting = waiting_of(dumps, s.local_rank);
            (s, waiting)
        })
        .collect()
}

/// The `hung:` error line for a named cause.
fn logged(hang: Hang) -> Hang {
    error!("hung: {}", hang.describe());
    hang
}

/// The detecting node's last resort when every stalled rank waits in torch.distributed: it
/// gives the other nodes [`SETTLE`] to name the cause, then names its own stalled rank.
async fn name_own_after_settle(
    view: &ProgressView,
    attempt: &WatchedAttempt,
    stall: Stall,
    limit: Duration,
    dumps: &[Dump],
    has_other_nodes: bool,
) -> Hang {
    let node = attempt.assignment.node_rank;
    if has_other_nodes {
        info!(
            "every stalled rank on node {node} waits in torch.distributed; giving the other nodes {} s to name the cause",
            SETTLE.as_secs()
        );
        tokio::time::sleep(SETTLE).await;
    }
    let views = rank_views(attempt, &view.ranks());
    let now = Instant::now();
    let stall = hang::stalled_ranks(&views, limit, now)
        .into_iter()
        .find(|s| s.local_rank == stall.local_rank)
        .unwrap_or(stall);
    let hang = named(attempt, &stall, dumps, None);
    error!(
        "hung: {} (every stalled rank waits in torch.distributed)",
        hang.describe()
    );
    hang
}

type Dump = (u32, Result<ProcessStacks, stacks::ReadError>);

/// Where `local_rank`'s main thread was when its stacks were read.
fn waiting_of(dumps: &[Dump], local_rank: u32) -> Waiting {
    dumps
        .iter()
        .find(|(l, _)| *l == local_rank)
        .and_then(|(_, d)| d.as_ref().ok())
        .map_or(Waiting::Unknown, ProcessStacks::waiting)
}

/// The cause of a hang before the first step among this node's ranks that have not stepped:
/// with the startup watch on, when this node detected a startup stall, or another node's
/// notice came and one of them is stopped (the node hosting a stopped rank names it; its
/// peers elsewhere only see ranks waiting in `init_process_group`).
fn startup_culprit(
    policy: &Policy,
    attempt: &WatchedAttempt,
    views: &[RankView],
    dumps: &[Dump],
    reports: &[RankWatch],
    trigger: &Trigger,
) -> Option<Stall> {
    let limit = policy.startup_timeout?;
    // Before the first step, a rank that has not stepped and is not inside torch.distributed
    // (sleeping, computing, importing) is the cause, on the node that detected the stall as on
    // a node another one told; for a stall after the first step only a stopped one is.
    let local_startup = match trigger {
        Trigger::Local(s) => s.startup.is_some(),
        Trigger::Remote(notice) => notice.startup,
    };
    let candidates: Vec<startup::Candidate> =
        startup::candidates(views, limit, attempt.started, Instant::now())
            .into_iter()
            .map(|stall| {
                let waiting = waiting_of(dumps, stall.local_rank);
                let stopped = !stopped_pids(attempt, reports, stall.local_rank).is_empty();
                startup::Candidate {
                    stall,
                    waiting,
                    stopped,
                }
            })
            .filter(|c| local_startup || c.stopped)
            .collect();
    startup::pick(&candidates)
}

/// The stopped processes of a local rank: its worker, or the Python process its reporter
/// named (under a wrapper).
fn stopped_pids(attempt: &WatchedAttempt, reports: &[RankWatch], local_rank: u32) -> Vec<u32> {
    let Some(w) = attempt.workers.iter().find(|w| w.local_rank == local_rank) else {
        return Vec::new();
    };
    let reported = current_report(attempt, reports, local_rank).and_then(|r| r.pid);
    let mut pids = vec![w.pid];
    pids.extend(reported.filter(|p| *p != w.pid));
    pids.into_iter()
        .filter(|p| startup::is_stopped(*p))
        .collect()
}

/// A stopped process takes no SIGTERM until continued: the gang's stop would wait out the
/// whole shutdown timeout for it. Its stacks are read; it may run on into the stop.
fn continue_stopped(attempt: &WatchedAttempt, culprit: &Stall, reports: &[RankWatch]) {
    for pid in stopped_pids(attempt, reports, culprit.local_rank) {
        if let Ok(pid) = i32::try_from(pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
    }
}

/// Reads and logs every live local rank's stacks.
async fn dump_all(attempt: &WatchedAttempt, reports: &[RankWatch]) -> Vec<Dump> {
    let exited = attempt.exited.borrow().clone();
    let mut dumps = Vec::new();
    for w in attempt
        .workers
        .iter()
        .filter(|w| !exited.contains(&w.local_rank))
    {
        let report = current_report(attempt, reports, w.local_rank);
        let (pid, read) = read_rank(w, report).await;
        (attempt.write)(w.local_rank, &dump_lines(w, pid, &read));
        dumps.push((w.local_rank, read));
    }
    dumps
}

/// Reads one rank's stacks: the pid its helper reported (the Python process under a wrapper),
/// else the worker's; py-spy, else the helper's `faulthandler`. Returns the pid read.
async fn read_rank(
    w: &WatchedWorker,
    report: Option<&RankWatch>,
) -> (u32, Result<ProcessStacks, stacks::ReadError>) {
    let pid = report.and_then(|r| r.pid).unwrap_or(w.pid);
    let faulthandler = report.and_then(|r| {
        r.faulthandler.as_ref().map(|(signal, file)| Faulthandler {
            signal: *signal,
            file: file.clone(),
        })
    });
    (pid, stacks::read(pid, faulthandler.as_ref()).await)
}

/// A rank's dump as log lines: a header naming the rank and how it was read, then its threads.
fn dump_lines(
    w: &WatchedWorker,
    pid: u32,
    read: &Result<ProcessStacks, stacks::ReadError>,
) -> Vec<String> {
    match read {
        Ok(stacks) => {
            let mut lines = vec![format!(
                "muster: stacks of rank {} (local rank {}, pid {pid}), read with {}:",
                w.rank,
                w.local_rank,
                stacks.via.as_str()
            )];
            lines.extend(stacks.lines());
            lines
        }
        Err(err) => vec![format!(
            "muster: cannot read the stacks of rank {} (local rank {}, pid {pid}): {err}",
            w.rank, w.local_rank
        )],
    }
}

fn named(
    attempt: &WatchedAttempt,
    stall: &Stall,
    dumps: &[Dump],
    reported_by: Option<u32>,
) -> Hang {
    let dump = dumps
        .iter()
        .find(|(local_rank, _)| *local_rank == stall.local_rank)
        .map(|(_, d)| d);
    let (frame, stacks) = match dump {
        Some(Ok(s)) => (
            s.innermost().map(ToString::to_string),
            format!("read with {}", s.via.as_str()),
        ),
        Some(Err(e)) => (None, format!("not readable: {e}")),
        None => (None, "not read (the rank had exited)".to_owned()),
    };
    Hang {
        node_rank: attempt.assignment.node_rank,
        host: attempt.host.clone(),
        local_rank: stall.local_rank,
        rank: stall.rank,
        last_step: stall.last_step,
        stalled: stall.stalled,
        limit: stall.limit,
        section: stall
            .section
            .clone()
            .or_else(|| stall.startup.map(|p| p.place().to_owned())),
        frame,
        stacks,
        reported_by,
        working: stall.working,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::local::LocalChannel;
    use crate::launch::RankAssignment;
    use crate::watch::hang::HangTimeout;

    #[tokio::test(start_paused = true)]
    async fn a_notice_of_this_nodes_own_is_ignored_and_never_polled_again() {
        let shutdown = CancellationToken::new();
        let channel = LocalChannel::bind(&shutdown).expect("a local channel");
        let (_exited_tx, exited) = tokio::sync::watch::channel(Vec::new());
        let attempt = WatchedAttempt {
            assignment: RankAssignment {
                node_rank: 1,
                group_world_size: 2,
                base_global_rank: 1,
                world_size: 2,
                master_addr: "127.0.0.1".to_owned(),
                master_port: 1,
                restart_count: 0,
                run_id: "run".to_owned(),
            },
            host: "vm".to_owned(),
            workers: Vec::new(),
            exited,
            started: Instant::now(),
            attempt_dir: None,
            write: Arc::new(|_, _| {}),
        };
        let policy = Policy {
            timeout: HangTimeout::Off,
            section_timeout: Duration::from_secs(60),
            startup_timeout: None,
        };
        let own = async {
            Notice {
                node_rank: 1,
                rank: 1,
                limit: Duration::from_secs(6),
                startup: false,
                what: "an earlier agent's".to_owned(),
            }
        };
        // Nothing to detect and nothing to hear: it waits (several looks), it does not panic.
        let waited = tokio::time::timeout(
            POLL * 5,
            wait_for_trigger(&policy, &channel.view(), &attempt, own),
        )
        .await;
        assert!(waited.is_err(), "an own notice ended the wait");
        shutdown.cancel();
    }

    #[test]
    fn the_notice_watch_opens_within_half_the_shortest_limit_and_a_second() {
        let policy = |timeout, startup_timeout| Policy {
            timeout,
            section_timeout: Duration::from_secs(3600),
            startup_timeout,
        };
        let default = Policy::default();
        assert_eq!(notice_watch_delay(&default), NOTICE_WATCH_DELAY_MAX);
        let fixed = policy(HangTimeout::Fixed(Duration::from_millis(500)), None);
        assert_eq!(notice_watch_delay(&fixed), Duration::from_millis(250));
        let startup = policy(HangTimeout::Auto, Some(Duration::from_secs(1)));
        assert_eq!(notice_watch_delay(&startup), Duration::from_millis(500));
        let off = policy(HangTimeout::Off, None);
        assert_eq!(notice_watch_delay(&off), NOTICE_WATCH_DELAY_MAX);
    }

    /// A notice published while the watch waits to connect is read as soon as it connects, and a
    /// watch stopped while it waits never connects.
    #[tokio::test]
    async fn a_notice_published_before_the_watch_connects_is_not_lost() {
        use rendezvous::store::server::{Config, Server};

        let server = Server::bind("127.0.0.1:0".parse().unwrap(), Config::default())
            .await
            .unwrap();
        let store = server.local_addr();
        let stats = server.stats();
        let shutdown = CancellationToken::new();
        let serving = tokio::spawn(server.run(shutdown.clone()));

        let stopped = CancellationToken::new();
        let never = gang_notices(Some(store), "run", Duration::from_millis(300), &stopped);
        stopped.cancel();
        let waited = tokio::time::timeout(Duration::from_millis(600), never).await;
        assert!(waited.is_err(), "a stopped watch reported a notice");
        assert_eq!(
            stats
                .connections_accepted
                .load(std::sync::atomic::Ordering::Relaxed),
            0,
            "a stopped watch connected"
        );

        let stop = CancellationToken::new();
        let started = Instant::now();
        let notices = gang_notices(Some(store), "run", Duration::from_millis(300), &stop);
        let notice = Notice {
            node_rank: 2,
            rank: 5,
            limit: Duration::from_secs(1),
            startup: false,
            what: "rank 5 made no progress".to_owned(),
        };
        gang::publish(store, "run", &notice).await.unwrap();
        let heard = tokio::time::timeout(Duration::from_secs(10), notices)
            .await
            .expect("the notice was read once the watch connected");
        assert_eq!((heard.node_rank, heard.rank), (2, 5));
        assert!(started.elapsed() >= Duration::from_millis(300));
        stop.cancel();
        shutdown.cancel();
        let _ = serving.await;
    }
}
