//! The agent's end of the local channel to its workers: a Unix stream socket whose address the
//! workers find in `MUSTER_CHECKPOINT_SOCKET`, speaking the newline-delimited words of
//! `python/muster_launcher/checkpoint.py`.
//!
//! The socket lives in Linux's abstract namespace (written `@name`): it is no file, so the agent
//! starts on a read-only root filesystem, and it disappears with the agent. The namespace belongs
//! to the network namespace (the pod), so the name carries the agent's pid and a random part:
//! several agents in one network namespace (`muster dry-run`, tests) never collide.
//!
//! Workers report their step on every training step; the agent keeps only the latest step and
//! when it arrived (for the target-step agreement and for metrics) and forwards the rare
//! checkpoint events (saved, missed, failed) to whoever drives the barrier. Nothing here blocks a
//! worker: the agent reads continuously and pushes at most a few lines per checkpoint.
//!
//! Two kinds of connection, told apart by their first line:
//! - `hello <local_rank> <rank> <pid>`: the helper a script uses (`muster_checkpoint`, now
//!   `muster_launcher.checkpoint`). Its rank takes part in the checkpoint barrier; its steps and
//!   sections feed the hang watch.
//! - `watch <local_rank> <rank> <pid>`: muster's zero-code reporter
//!   (`python/muster_launcher/autoreport.py`, an optimizer step hook loaded by muster's
//!   `sitecustomize`). It only reports — `step <n>`, `alive` (the rank's stack moved: it works
//!   between steps), `faulthandler`, `init` and `initdone` (it entered and returned from `init_process_group`), `exiting` (the script
//!   finished: the interpreter exits, from an `atexit` hook) — and the agent
//!   answers `interval <ms>`, how often to say `alive` (0: never, the hang watch is off). Such a
//!   rank cannot save, so it never counts as taking part in the barrier (a script without the
//!   helper still gets SIGTERM forwarded), and its `alive` counts as progress for the hang watch.
//!   Where a local rank has a helper connection too, the helper's reports are the rank's: the
//!   reporter's are ignored, so no step is counted twice.

mod message;

use std::collections::HashMap;
use std::os::linux::net::SocketAddrExt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::events::{Event, Events};
use message::{Hello, Message, Role};

/// Environment variable naming the socket, read by the Python helper: `@name` for an abstract
/// socket (what the agent exports), else a file path (a helper may be pointed at one by hand).
pub const SOCKET_ENV: &str = "MUSTER_CHECKPOINT_SOCKET";

/// Environment variable of the workers that switches the zero-code reporter on (`1`) or off
/// (`0`): the agent exports its `--auto-step-reports` (itself read from the same name).
pub const AUTO_STEP_REPORTS_ENV: &str = "MUSTER_AUTO_STEP_REPORTS";

/// How [`SOCKET_ENV`] marks an abstract address (the notation of `ss`, systemd and Go): the
/// kernel's leading NUL byte cannot travel in an environment variable.
pub const ABSTRACT_PREFIX: char = '@';

/// A worker line longer than this is a broken or foreign client: its connection is closed.
const MAX_LINE_BYTES: usize = 1024;

/// What a worker told the agent about a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerEvent {
    Saved {
        local_rank: u32,
        generation: u64,
        step: u64,
        checkpoint_id: String,
    },
    /// The save request reached the worker after the step it named.
    Missed {
        local_rank: u32,
        generation: u64,
        step: u64,
    },
    Failed {
        local_rank: u32,
        generation: u64,
        reason: String,
    },
}

/// The latest report of one local rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankProgress {
    pub local_rank: u32,
    pub step: Option<u64>,
    /// When the last step report arrived.
    pub reported_at: Option<Instant>,
    /// Smoothed time between consecutive steps.
    pub step_period: Option<Duration>,
}

/// What the hang watch reads of one local rank besides its [`RankProgress`]
/// ([`crate::watch`]): the messages `section`, `endsection` and `faulthandler` of the helper, or
/// the zero-code reporter's steps and `alive`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankWatch {
    pub local_rank: u32,
    /// RANK, as the helper said hello (`None`: an old helper).
    pub rank: Option<u32>,
    /// The helper's process (the Python interpreter, also when the worker is a wrapper).
    pub pid: Option<u32>,
    pub connected_at: Instant,
    pub step: Option<u64>,
    /// Distinct steps reported.
    pub steps_seen: u64,
    /// The last step report or section change (from the zero-code reporter: or `alive`).
    pub last_progress: Option<Instant>,
    /// The slowest smoothed step period seen.
    pub slowest_period: Option<Duration>,
    /// The open section and when it opened.
    pub section: Option<(String, Instant)>,
    /// The signal and file the helper registered `faulthandler` on.
    pub faulthandler: Option<(i32, std::path::PathBuf)>,
    /// Reported by muster's zero-code reporter, not by the helper.
    pub zero_code: bool,
    /// When the rank entered `torch.distributed.init_process_group` and returned from it (the
    /// reporter's `init` and `initdone`), and when its first step report arrived: the hang
    /// watch before the first step ([`crate::watch::startup`]).
    pub init_entered: Option<Instant>,
    pub init_returned: Option<Instant>,
    pub first_step: Option<Instant>,
    /// When its last step report arrived (`last_progress` also moves with `alive`): a rank that
    /// works without stepping while its peers wait for it is the cause of their stall.
    pub last_step: Option<Instant>,
    /// Its script finished and the interpreter exits (`exiting`): a teardown slowed by a loaded
    /// node is no hang, and no signal may be sent for its stacks (the interpreter removes its
    /// `faulthandler` handlers as it finalises, and the signal's default action kills it).
    pub exiting: bool,
}

impl RankWatch {
    /// A rank whose helper or reporter just connected: nothing seen of it yet.
    pub fn connected(
        local_rank: u32,
        rank: Option<u32>,
        pid: Option<u32>,
        zero_code: bool,
    ) -> Self {
        Self {
            local_rank,
            rank,
            pid,
            connected_at: Instant::now(),
            step: None,
            steps_seen: 0,
            last_progress: None,
            slowest_period: None,
            section: None,
            faulthandler: None,
            zero_code,
            init_entered: None,
            init_returned: None,
            first_step: None,
            last_step: None,
            exiting: false,
        }
    }
}

struct Link {
    progress: RankProgress,
    watch: RankWatch,
    outbox: mpsc::UnboundedSender<String>,
}

#[derive(Default)]
struct Links {
    /// The helpers' connections: the ranks that take part in the barrier.
    by_rank: HashMap<u32, Link>,
    /// The zero-code reporters' connections, shadowed by a helper's for the same local rank.
    reporters: HashMap<u32, Link>,
    /// Where step reports go (see [`LocalChannel::report_steps`]).
    steps: Events,
    /// What reporters are told to sample at (see [`LocalChannel::set_liveness_interval`]).
    liveness: Option<Duration>,
    /// The last step of every connection that closed since [`LocalChannel::forget_all`] (when it
    /// connected, its last step): a rank that died keeps its step for the crash-loop guard.
    departed: Vec<(Instant, u64)>,
}

impl Links {
    fn of(&mut self, role: Role) -> &mut HashMap<u32, Link> {
        match role {
            Role::Helper => &mut self.by_rank,
            Role::Reporter => &mut self.reporters,
        }
    }
}

/// The listening socket and what the connected workers reported.
pub struct LocalChannel {
    /// `@name`, as exported in [`SOCKET_ENV`].
    address: String,
    links: Arc<Mutex<Links>>,
    events: mpsc::UnboundedReceiver<WorkerEvent>,
    stop: CancellationToken,
}

fn lock(links: &Mutex<Links>) -> MutexGuard<'_, Links> {
    links.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LocalChannel {
    /// Listens on a fresh abstract address, `@muster-ckpt-<pid>-<random>`, until `shutdown`.
    pub fn bind(shutdown: &CancellationToken) -> Result<LocalChannel, BindError> {
        let name = format!(
            "muster-ckpt-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        Self::bind_abstract(&name, shutdown)
    }

    /// Listens on the abstract address `@name` until `shutdown`.
    pub fn bind_abstract(
        name: &str,
        shutdown: &CancellationToken,
    ) -> Result<LocalChannel, BindError> {
        let address = format!("{ABSTRACT_PREFIX}{name}");
        let listener = listen_abstract(name).map_err(|source| BindError {
            address: address.clone(),
            source,
        })?;
        let links = Arc::new(Mutex::new(Links::default()));
        let (events_tx, events) = mpsc::unbounded_channel();
        let stop = shutdown.child_token();
        tokio::spawn(accept_loop(
            listener,
            Arc::clone(&links),
            events_tx,
            stop.clone(),
        ));
        Ok(LocalChannel {
            address,
            links,
            events,
            stop,
        })
    }

    /// Tells `events` every step a rank reports from now on.
    pub fn report_steps(&self, events: Events) {
        lock(&self.links).steps = events;
    }

    /// How often zero-code reporters that connect from now on say `alive` when their rank works
    /// between steps; `None`: never (the hang watch is off). See [`crate::watch::hang::liveness_interval`].
    pub fn set_liveness_interval(&self, interval: Option<Duration>) {
        lock(&self.links).liveness = interval;
    }

    /// The address to export as [`SOCKET_ENV`]: `@name`.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Local ranks whose helper is connected (zero-code reporters are not: they cannot save).
    pub fn connected_ranks(&self) -> Vec<u32> {
        let mut ranks: Vec<u32> = lock(&self.links).by_rank.keys().copied().collect();
        ranks.sort_unstable();
        ranks
    }

    /// Every helper-connected rank's latest report (the barrier's view: zero-code reporters
    /// are left out).
    pub fn progress(&self) -> Vec<RankProgress> {
        let mut all: Vec<RankProgress> = lock(&self.links)
            .by_rank
            .values()
            .map(|l| l.progress)
            .collect();
        all.sort_by_key(|p| p.local_rank);
        all
    }

    /// A read-only view of the connected ranks' reports, for the hang watch.
    pub fn view(&self) -> ProgressView {
        ProgressView {
            links: Arc::clone(&self.links),
        }
    }

    /// Sends one line to every connected helper.
    pub fn broadcast(&self, line: &str) {
        for link in lock(&self.links).by_rank.values() {
            // A closed outbox means the worker is gone; its exit is the supervisor's business.
            let _ = link.outbox.send(line.to_owned());
        }
    }

    /// The next checkpoint event from any worker.
    pub async fn next_event(&mut self) -> Option<WorkerEvent> {
        self.events.recv().await
    }

    /// Forgets the ranks of a finished attempt (their processes are gone; a new attempt's
    /// workers connect afresh).
    pub fn forget_all(&self) {
        let mut links = lock(&self.links);
        links.by_rank.clear();
        links.reporters.clear();
        links.departed.clear();
    }
}

/// What the workers reported, read-only and cheap to clone (the hang watch holds one).
#[derive(Clone)]
pub struct ProgressView {
    links: Arc<Mutex<Links>>,
}

impl ProgressView {
    /// The highest step reported on any connection that opened at or after `since` (one
    /// attempt's ranks), including connections that closed since: the crash-loop guard reads it
    /// once the attempt's ranks are gone.
    pub fn max_step_since(&self, since: Instant) -> Option<u64> {
        let links = lock(&self.links);
        let live = links
            .by_rank
            .values()
            .chain(links.reporters.values())
            .filter(|l| l.watch.connected_at >= since)
            .filter_map(|l| l.watch.step);
        let gone = links
            .departed
            .iter()
            .filter(|(at, _)| *at >= since)
            .map(|(_, step)| *step);
        live.chain(gone).max()
    }

    /// The `init_process_group` and first-step marks of every rank whose reports began at or
    /// after `since` (one attempt's ranks), by local rank.
    pub fn rank_marks_since(
        &self,
        since: Instant,
    ) -> Vec<crate::launch::restart_timeline::RankMarks> {
        self.ranks()
            .into_iter()
            .filter(|r| r.connected_at >= since)
            .map(|r| crate::launch::restart_timeline::RankMarks {
                init_entered: r.init_entered,
                init_returned: r.init_returned,
                first_step: r.first_step,
            })
            .collect()
    }

    /// Every connected rank's reports, by local rank: the helper's where a rank has one, else
    /// the zero-code reporter's.
    pub fn ranks(&self) -> Vec<RankWatch> {
        let links = lock(&self.links);
        let mut all: Vec<RankWatch> = links
            .by_rank
            .values()
            .chain(
                links
                    .reporters
                    .iter()
                    .filter(|(rank, _)| !links.by_rank.contains_key(rank))
                    .map(|(_, link)| link),
            )
            .map(|l| l.watch.clone())
            .collect();
        all.sort_by_key(|w| w.local_rank);
        all
    }
}

impl Drop for LocalChannel {
    fn drop(&mut self) {
        // Closing the listener frees the abstract name; there is no file to remove.
        self.stop.cancel();
    }
}

/// The checkpoint socket could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on the checkpoint socket {address} (an abstract Unix socket: no file, scoped to the pod's network namespace): {source}")]
pub struct BindError {
    pub address: String,
    #[source]
    pub source: std::io::Error,
}

fn listen_abstract(name: &str) -> std::io::Result<UnixListener> {
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    listener.set_nonblocking(true)?;
    UnixListener::from_std(listener)
}

/// Connects to an address as [`SOCKET_ENV`] gives it (`@name` or a path): the worker's end, for
/// tests and tools written in Rust.
pub async fn connect(address: &str) -> std::io::Result<UnixStream> {
    match address.strip_prefix(ABSTRACT_PREFIX) {
        Some(name) => {
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            let stream = std::os::unix::net::UnixStream::connect_addr(&addr)?;
            stream.set_nonblocking(true)?;
            UnixStream::from_std(stream)
        }
        None => UnixStream::connect(address).await,
    }
}

async fn accept_loop(
    listener: UnixListener,
    links: Arc<Mutex<Links>>,
    events: mpsc::UnboundedSender<WorkerEvent>,
    stop: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    warn!(error = %err, "checkpoint socket: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        tokio::spawn(serve_worker(
            stream,
            Arc::clone(&links),
            events.clone(),
            stop.clone(),
        ));
    }
}

async fn serve_worker(
    stream: UnixStream,
    links: Arc<Mutex<Links>>,
    events: mpsc::UnboundedSender<WorkerEvent>,
    stop: CancellationToken,
) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read);
    let (outbox, mut outgoing) = mpsc::unbounded_channel::<String>();
    let mut conn: Option<(u32, Role)> = None;
    let mut line = String::new();
    loop {
        line.clear();
        tokio::select! {
            () = stop.cancelled() => break,
            Some(mut message) = outgoing.recv() => {
                message.push('\n');
                if write.write_all(message.as_bytes()).await.is_err() {
                    break;
                }
            }
            read = read_bounded_line(&mut lines, &mut line) => match read {
                Ok(true) => {
                    if let Err(reason) = handle_line(&line, &mut conn, &links, &outbox, &events) {
                        if let Some((local_rank, _)) = conn {
                            warn!(local_rank, "checkpoint socket: {reason}; closing");
                        } else {
                            warn!("checkpoint socket: {reason}; closing");
                        }
                        break;
                    }
                }
                Ok(false) => break,
                Err(err) => {
                    debug!(error = %err, "checkpoint socket: read failed");
                    break;
                }
            },
        }
    }
    if let Some((rank, role)) = conn {
        let mut all = lock(&links);
        let links = all.of(role);
        // Only forget the rank if a newer connection has not taken its place.
        if links
            .get(&rank)
            .is_some_and(|l| l.outbox.same_channel(&outbox))
        {
            if let Some(gone) = links.remove(&rank) {
                if let Some(step) = gone.watch.step {
                    all.departed.push((gone.watch.connected_at, step));
                }
            }
        }
    }
}

/// Reads one line of at most [`MAX_LINE_BYTES`]; `Ok(false)` at end of stream.
async fn read_bounded_line(
    reader: &mut BufReader<tokio::net::unix::OwnedReadHalf>,
    line: &mut String,
) -> std::io::Result<bool> {
    let mut buf = Vec::new();
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok(false);
        }
        if let Some(pos) = available.iter().position(|&b| b == b'\n') {
            buf.extend_from_slice(&available[..pos]);
            reader.consume(pos + 1);
            break;
        }
        let n = available.len();
        buf.extend_from_slice(available);
        reader.consume(n);
        if buf.len() > MAX_LINE_BYTES {
            break;
        }
    }
    if buf.len() > MAX_LINE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "line too long",
        ));
    }
    *line = String::from_utf8_lossy(&buf).into_owned();
    Ok(true)
}

/// Weight of a new sample in the smoothed step period.
const PERIOD_SMOOTHING: f64 = 0.3;

/// Carries out one line of a worker: [`message::parse`], then [`apply`]. An error closes the
/// connection; its text is the reason the closing log line names.
fn handle_line(
    line: &str,
    conn: &mut Option<(u32, Role)>,
    links: &Mutex<Links>,
    outbox: &mpsc::UnboundedSender<String>,
    events: &mpsc::UnboundedSender<WorkerEvent>,
) -> Result<(), String> {
    match message::parse(line) {
        Ok(message) => apply(message, conn, links, outbox, events),
        Err(e) => {
            // These messages are refused for a connection that may not send them before their
            // numbers are looked at, so such a connection is closed for that reason.
            if let Some(word @ ("faulthandler" | "saved" | "missed" | "failed")) = e.word {
                connection_of(word, *conn)?;
            }
            Err(e.reason)
        }
    }
}

/// The local rank and role of the connection that sent message `word`, or why that connection
/// may not send it (it did not say hello or watch, or only the helper may).
fn connection_of(word: &str, conn: Option<(u32, Role)>) -> Result<(u32, Role), String> {
    let helper_only = |what: String| match conn {
        Some((rank, Role::Helper)) => Ok((rank, Role::Helper)),
        _ => Err(format!("{what} from a connection that did not say hello")),
    };
    let before = |what: &str| conn.ok_or_else(|| what.to_owned());
    match word {
        "section" | "endsection" => helper_only(word.to_owned()),
        "saved" | "missed" | "failed" => helper_only(format!("checkpoint message {word}")),
        "init" | "initdone" => before("init before watch"),
        "exiting" => before("exiting before watch"),
        "alive" => before("alive before watch"),
        "step" => before("step before hello"),
        _ => before("message before hello"),
    }
}

/// Carries out one parsed message of the connection `conn`.
fn apply(
    message: Message,
    conn: &mut Option<(u32, Role)>,
    links: &Mutex<Links>,
    outbox: &mpsc::UnboundedSender<String>,
    events: &mpsc::UnboundedSender<WorkerEvent>,
) -> Result<(), String> {
    let (rank, role) = match message {
        Message::Hello(hello) => {
            greet(hello, conn, links, outbox);
            return Ok(());
        }
        ref other => connection_of(other.word(), *conn)?,
    };
    match message {
        Message::Hello(_) => {}
        Message::Faulthandler { signal, path } => {
            if let Some(link) = lock(links).of(role).get_mut(&rank) {
                link.watch.faulthandler = Some((signal, path));
            }
        }
        section @ (Message::Section { .. } | Message::EndSection) => {
            let now = Instant::now();
            let mut links = lock(links);
            let Some(link) = links.by_rank.get_mut(&rank) else {
                return Ok(());
            };
            let w = &mut link.watch;
            w.section = match section {
                Message::Section { name } => Some((name, now)),
                _ => None,
            };
            w.last_progress = Some(now);
        }
        init @ (Message::Init | Message::InitDone) => {
            let now = Instant::now();
            if let Some(link) = lock(links).of(role).get_mut(&rank) {
                if init == Message::Init {
                    link.watch.init_entered = Some(now);
                    link.watch.init_returned = None;
                } else {
                    link.watch.init_returned = Some(now);
                }
            }
        }
        Message::Exiting => {
            if let Some(link) = lock(links).of(role).get_mut(&rank) {
                link.watch.exiting = true;
                link.watch.faulthandler = None;
            }
        }
        Message::Alive => {
            let mut links = lock(links);
            // A helper's rank progresses by its steps and sections only, as documented.
            if role == Role::Reporter && !links.by_rank.contains_key(&rank) {
                if let Some(link) = links.reporters.get_mut(&rank) {
                    link.watch.last_progress = Some(Instant::now());
                }
            }
        }
        Message::Step { step } => {
            let mut links = lock(links);
            let links = &mut *links;
            // With the helper connected too, its steps are the rank's: not counted twice.
            if role == Role::Reporter && links.by_rank.contains_key(&rank) {
                return Ok(());
            }
            if let Some(link) = links.of(role).get_mut(&rank) {
                link.record_step(step, Instant::now());
                links.steps.publish(Event::WorkerStep {
                    local_rank: rank,
                    step,
                });
            }
        }
        Message::Saved {
            generation,
            step,
            checkpoint_id,
        } => {
            let _ = events.send(WorkerEvent::Saved {
                local_rank: rank,
                generation,
                step,
                checkpoint_id,
            });
        }
        Message::Missed { generation, step } => {
            let _ = events.send(WorkerEvent::Missed {
                local_rank: rank,
                generation,
                step,
            });
        }
        Message::Failed { generation, reason } => {
            let _ = events.send(WorkerEvent::Failed {
                local_rank: rank,
                generation,
                reason,
            });
        }
    }
    Ok(())
}

/// A connection's first line: remembers who is on it, tells a reporter how often to say
/// `alive`, and gives a helper what the reporter of its rank saw of the group's forming.
fn greet(
    hello: Hello,
    conn: &mut Option<(u32, Role)>,
    links: &Mutex<Links>,
    outbox: &mpsc::UnboundedSender<String>,
) {
    let Hello {
        role,
        local_rank: rank,
        rank: global_rank,
        pid,
    } = hello;
    *conn = Some((rank, role));
    let mut links = lock(links);
    if role == Role::Reporter {
        // How often to say `alive`; 0: never.
        let ms = links.liveness.map_or(0, |d| d.as_millis().max(1));
        let _ = outbox.send(format!("interval {ms}"));
    }
    links.of(role).insert(
        rank,
        Link {
            progress: RankProgress {
                local_rank: rank,
                step: None,
                reported_at: None,
                step_period: None,
            },
            watch: RankWatch::connected(rank, global_rank, pid, role == Role::Reporter),
            outbox: outbox.clone(),
        },
    );
    // The reporter said when the group formed; the helper connects after that.
    if role == Role::Helper {
        let init = links
            .reporters
            .get(&rank)
            .map(|l| (l.watch.init_entered, l.watch.init_returned));
        if let (Some((entered, returned)), Some(link)) = (init, links.by_rank.get_mut(&rank)) {
            link.watch.init_entered = entered;
            link.watch.init_returned = returned;
        }
    }
}

impl Link {
    /// A step report: the latest step, the smoothed period, progress.
    fn record_step(&mut self, step: u64, now: Instant) {
        let p = &mut self.progress;
        if let (Some(prev_step), Some(prev_at)) = (p.step, p.reported_at) {
            if step > prev_step {
                let sample = now.duration_since(prev_at).as_secs_f64() / (step - prev_step) as f64;
                let smoothed = match p.step_period {
                    Some(old) => old
                        .as_secs_f64()
                        .mul_add(1.0 - PERIOD_SMOOTHING, sample * PERIOD_SMOOTHING),
                    None => sample,
                };
                p.step_period = Some(Duration::from_secs_f64(smoothed));
            }
        }
        if p.step != Some(step) {
            self.watch.steps_seen += 1;
        }
        p.step = Some(step);
        p.reported_at = Some(now);
        let w = &mut self.watch;
        w.first_step.get_or_insert(now);
        w.step = Some(step);
        w.last_progress = Some(now);
        w.last_step = Some(now);
        w.slowest_period = match (w.slowest_period, p.step_period) {
            (Some(old), Some(new)) => Some(old.max(new)),
            (old, new) => old.or(new),
        };
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    use super::*;

    type Ends = (
        BufReader<tokio::net::unix::OwnedReadHalf>,
        tokio::net::unix::OwnedWriteHalf,
    );

    /// A connection that opened with `first <rank> <rank> <pid>` (`hello` or `watch`).
    async fn connected(address: &str, first: &str, rank: u32, pid: u32) -> Ends {
        let stream = connect(address).await.unwrap();
        let (r, mut w) = stream.into_split();
        w.write_all(format!("{first} {rank} {rank} {pid}\n").as_bytes())
            .await
            .unwrap();
        (BufReader::new(r), w)
    }

    /// The helper of local rank `rank`.
    async fn worker(address: &str, rank: u32) -> Ends {
        connected(address, "hello", rank, 1).await
    }

    async fn settle<F: Fn() -> bool>(cond: F) {
        for _ in 0..200 {
            if cond() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("condition not reached");
    }

    #[tokio::test]
    async fn steps_are_tracked_and_events_forwarded() {
        let stop = CancellationToken::new();
        let mut channel = LocalChannel::bind(&stop).unwrap();
        assert!(channel.address().starts_with("@muster-ckpt-"));
        let (mut r0, mut w0) = worker(channel.address(), 0).await;
        let (_r1, mut w1) = worker(channel.address(), 1).await;
        w0.write_all(b"step 4\nstep 5\n").await.unwrap();
        w1.write_all(b"step 5\n").await.unwrap();
        settle(|| {
            channel.progress().iter().all(|p| p.step == Some(5)) && channel.progress().len() == 2
        })
        .await;
        assert_eq!(channel.connected_ranks(), [0, 1]);
        assert!(channel.progress()[0].step_period.is_some());

        channel.broadcast("save 1 7 0");
        let mut line = String::new();
        r0.read_line(&mut line).await.unwrap();
        assert_eq!(line, "save 1 7 0\n");

        w0.write_all(b"saved 1 7 ckpt-7\n").await.unwrap();
        w1.write_all(b"failed 1 disk full\n").await.unwrap();
        let mut got = [
            channel.next_event().await.unwrap(),
            channel.next_event().await.unwrap(),
        ];
        got.sort_by_key(|e| matches!(e, WorkerEvent::Failed { .. }));
        assert_eq!(
            got[0],
            WorkerEvent::Saved {
                local_rank: 0,
                generation: 1,
                step: 7,
                checkpoint_id: "ckpt-7".into()
            }
        );
        assert_eq!(
            got[1],
            WorkerEvent::Failed {
                local_rank: 1,
                generation: 1,
                reason: "disk full".into()
            }
        );
        stop.cancel();
    }

    /// The zero-code reporter of local rank `rank`.
    async fn reporter(address: &str, rank: u32) -> Ends {
        connected(address, "watch", rank, 2).await
    }

    #[tokio::test]
    async fn a_reporter_feeds_the_hang_watch_and_metrics_but_not_the_barrier() {
        let stop = CancellationToken::new();
        let channel = LocalChannel::bind(&stop).unwrap();
        channel.set_liveness_interval(Some(Duration::from_millis(600)));
        let (events, mut parts) = Events::channel();
        channel.report_steps(events);
        let view = channel.view();
        let (mut r0, mut w0) = reporter(channel.address(), 0).await;
        let mut line = String::new();
        r0.read_line(&mut line).await.unwrap();
        assert_eq!(line, "interval 600\n");
        w0.write_all(b"step 1\nstep 2\n").await.unwrap();
        settle(|| view.ranks().first().is_some_and(|w| w.steps_seen == 2)).await;
        let watched = view.ranks();
        assert!(watched[0].zero_code);
        assert_eq!((watched[0].step, watched[0].pid), (Some(2), Some(2)));
        // A reporter cannot save: the barrier does not count it, nor tells it to save.
        assert!(channel.progress().is_empty());
        assert!(channel.connected_ranks().is_empty());
        let mut got = Vec::new();
        while let Ok(Event::WorkerStep { step, .. }) = parts.try_recv() {
            got.push(step);
        }
        assert_eq!(got, [1, 2]);

        // `alive` is progress.
        let before = watched[0].last_progress.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        w0.write_all(b"alive\n").await.unwrap();
        settle(|| {
            view.ranks()
                .first()
                .is_some_and(|w| w.last_progress > Some(before))
        })
        .await;
        assert_eq!(view.ranks()[0].steps_seen, 2, "alive is not a step");
        assert_eq!(view.ranks()[0].last_step, watched[0].last_step);

        // The script finished: exiting, and its faulthandler is not to be signalled any more.
        w0.write_all(b"faulthandler 12 /tmp/x\n").await.unwrap();
        settle(|| {
            view.ranks()
                .first()
                .is_some_and(|w| w.faulthandler.is_some())
        })
        .await;
        w0.write_all(b"exiting\n").await.unwrap();
        settle(|| view.ranks().first().is_some_and(|w| w.exiting)).await;
        assert_eq!(view.ranks()[0].faulthandler, None);

        // Reporter messages only: a save confirmation closes the connection.
        w0.write_all(b"saved 0 2 x\n").await.unwrap();
        settle(|| view.ranks().is_empty()).await;
        stop.cancel();
    }

    #[tokio::test]
    async fn a_closed_connection_keeps_its_last_step_for_the_attempt() {
        let stop = CancellationToken::new();
        let channel = LocalChannel::bind(&stop).unwrap();
        let view = channel.view();
        let before = Instant::now();
        let (r, mut w) = worker(channel.address(), 0).await;
        w.write_all(b"step 2\nstep 3\n").await.unwrap();
        settle(|| view.ranks().first().is_some_and(|w| w.step == Some(3))).await;
        // The rank dies: its connection goes, its step stays for the attempt.
        drop((r, w));
        settle(|| view.ranks().is_empty()).await;
        assert_eq!(view.max_step_since(before), Some(3));
        // A later attempt's connections only.
        assert_eq!(view.max_step_since(Instant::now()), None);
        channel.forget_all();
        assert_eq!(view.max_step_since(before), None);
        stop.cancel();
    }

    #[tokio::test]
    async fn with_the_helper_connected_the_reporters_steps_and_alive_are_ignored() {
        let stop = CancellationToken::new();
        let channel = LocalChannel::bind(&stop).unwrap();
        let (events, mut parts) = Events::channel();
        channel.report_steps(events);
        let view = channel.view();
        let (_r, mut auto) = reporter(channel.address(), 0).await;
        auto.write_all(b"step 1\n").await.unwrap();
        settle(|| view.ranks().first().is_some_and(|w| w.step == Some(1))).await;
        let (_h, mut helper) = worker(channel.address(), 0).await;
        helper.write_all(b"step 1000\n").await.unwrap();
        settle(|| view.ranks().first().is_some_and(|w| w.step == Some(1000))).await;
        let progress = view.ranks()[0].last_progress;
        // An unknown line after them closes the reporter's connection once they were handled.
        auto.write_all(b"step 2\nalive\nbogus\n").await.unwrap();
        settle(|| lock(&channel.links).reporters.is_empty()).await;
        helper.write_all(b"step 1001\n").await.unwrap();
        settle(|| view.ranks().first().is_some_and(|w| w.step == Some(1001))).await;
        let w = &view.ranks()[0];
        assert!(!w.zero_code);
        assert_eq!(w.steps_seen, 2);
        assert_eq!(channel.progress()[0].step, Some(1001));
        let mut got = Vec::new();
        while let Ok(Event::WorkerStep { step, .. }) = parts.try_recv() {
            got.push(step);
        }
        assert_eq!(
            got,
            [1, 1000, 1001],
            "the reporter's step 2 was not counted"
        );
        assert!(w.last_progress > progress);
        // The reporter's `alive` did not move the helper's rank: only its step 1001 did.
        assert_eq!(
            w.last_progress,
            channel.progress()[0].reported_at,
            "progress is the helper's last step"
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn garbage_closes_only_that_connection() {
        let stop = CancellationToken::new();
        let channel = LocalChannel::bind(&stop).unwrap();
        let (_r, mut w) = worker(channel.address(), 0).await;
        let mut bad = connect(channel.address()).await.unwrap();
        bad.write_all(&[b'x'; 4096]).await.unwrap();
        bad.write_all(b"\n").await.unwrap();
        w.write_all(b"step 1\n").await.unwrap();
        settle(|| {
            channel
                .progress()
                .first()
                .is_some_and(|p| p.step == Some(1))
        })
        .await;
        let mut sink = Vec::new();
        let closed = tokio::time::timeout(
            Duration::from_secs(2),
            tokio::io::AsyncReadExt::read_to_end(&mut bad, &mut sink),
        )
        .await;
        assert!(closed.is_ok(), "the oversized client was disconnected");
        stop.cancel();
    }

    #[tokio::test]
    async fn agents_in_one_network_namespace_get_distinct_names_and_a_taken_one_is_named() {
        let stop = CancellationToken::new();
        let a = LocalChannel::bind(&stop).unwrap();
        let b = LocalChannel::bind(&stop).unwrap();
        assert_ne!(a.address(), b.address());
        let name = a.address().trim_start_matches(ABSTRACT_PREFIX).to_owned();
        let err = LocalChannel::bind_abstract(&name, &stop)
            .err()
            .expect("the name is taken");
        assert_eq!(err.source.kind(), std::io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains(a.address()), "{err}");
        // Dropping the channel frees the name (no file is left behind to clean up).
        drop(a);
        let mut again = None;
        for _ in 0..200 {
            match LocalChannel::bind_abstract(&name, &stop) {
                Ok(channel) => {
                    again = Some(channel);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
        assert!(again.is_some(), "the name was not freed");
        stop.cancel();
    }
}
