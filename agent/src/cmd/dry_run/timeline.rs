//! What happened in a fault-rehearsing dry run, in order: when each fault hit, when the gang
//! stopped, re-formed and resumed (and from which committed step), when each agent exited, and
//! the job's code. The dry run prints it at the end.
//!
//! Two sources, both observed from outside the agents:
//! - the workers `/proc` shows ([`crate::cmd::dry_run::fault::procs`]), sampled every
//!   [`SAMPLE_INTERVAL`](crate::cmd::dry_run::fault::SAMPLE_INTERVAL): the gang runs when every worker of
//!   one world (as many as their `WORLD_SIZE`, distinct ranks) is alive and has joined the
//!   process group (connected to its store: imports done, training under way), and has stopped
//!   when none of those workers is left. This does not depend on what the agents log.
//! - the agents' own lines (either log format): `round G: ... (restarts used R)` says the gang
//!   formed at generation G; `checkpoint committed at step S on every node` gives the step a
//!   restarted gang resumes from. A change of those messages shows up in the dry-run suite
//!   (`tests/python/test_dry_run_faults.py`), which reads the timeline.
//!
//! - the workers' own lines: the first one written after the gang first ran starts the faults'
//!   clock. Joining the process group is not yet training (DDP set-up, heavy imports and the first
//!   step follow, seconds on a loaded laptop), and a fault meant "10 s into training" must not hit
//!   a script still importing; a script that writes nothing starts it [`CLOCK_FALLBACK`] later.
//!
//! The recorder is pure: it is told the time of every observation.

use std::collections::HashSet;
use std::fmt;

use tokio::time::Instant;

use crate::cmd::dry_run::fault::procs::Worker;
use crate::cmd::dry_run::fault::Fault;
use crate::launch::config::LogFormat;
use crate::launch::restart_timeline;

/// What an agent's line tells the timeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Said {
    /// `round G: node X is group rank Y of N, ... (restarts used R)`; `nodes` is N where the line
    /// says it.
    Formed {
        generation: u64,
        restarts: u32,
        nodes: Option<u32>,
    },
    /// `checkpoint committed at step S on every node`.
    Committed { step: u64 },
    /// `checkpoint aborted: REASON`.
    Aborted { reason: String },
    /// `attempt R: first failure in the gang: WHAT[; then ...]`: the gang's root cause of a
    /// failed attempt (the same on every node, up to what followed on each).
    RootCause { attempt: u32, what: String },
    /// `hung: WHAT`: the hang watch named the rank that stopped progressing (the gang stops).
    Hung { what: String },
    /// `slow rank: WHAT`, `slow GPU: WHAT`, `straggler node: WHAT`: the straggler watch named what
    /// holds the gang back (or a node leaving because of it).
    Slow { what: String },
    /// `restart R (node N): every local rank stepping again ...`: what one restart cost on one
    /// node, phase by phase ([`crate::launch::restart_timeline`]).
    RestartCost { what: String },
}

/// The agent's message in one of its output lines (`None` for a worker's line): the `msg` of a
/// JSON record whose `source` is `agent`, or the text after the level of a text line
/// (` INFO round 0: ...`).
pub fn agent_message(line: &str, format: LogFormat) -> Option<String> {
    match format {
        LogFormat::Json => {
            let record: serde_json::Value = serde_json::from_str(line).ok()?;
            if record.get("source")?.as_str()? != "agent" {
                return None;
            }
            Some(record.get("msg")?.as_str()?.to_owned())
        }
        LogFormat::Text => {
            let trimmed = line.trim_start();
            ["INFO ", "WARN ", "ERROR ", "DEBUG ", "TRACE "]
                .iter()
                .find_map(|level| trimmed.strip_prefix(level))
                .map(|msg| msg.trim_start().to_owned())
        }
    }
}

/// How long after every worker joined the faults' clock starts when no worker has written a
/// line by then (a silent script): a minute covers DDP set-up on a loaded laptop.
pub const CLOCK_FALLBACK: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether a line that is not the agent's is a worker's: a JSON record from a rank, or any text
/// line (the workers' lines carry the `--log-line-prefix-template` prefix, which can be anything).
fn is_worker_line(line: &str, format: LogFormat) -> bool {
    match format {
        LogFormat::Json => serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|r| r.get("source")?.as_str().map(|s| s == "rank"))
            .unwrap_or(false),
        LogFormat::Text => !line.trim().is_empty(),
    }
}

/// Reads one agent message.
pub fn classify(msg: &str) -> Option<Said> {
    if let Some(rest) = msg.strip_prefix("round ") {
        let (generation, rest) = rest.split_once(':')?;
        let restarts = rest.rsplit_once("(restarts used ")?.1.strip_suffix(')')?;
        let nodes = rest
            .split_once("group rank ")
            .and_then(|(_, r)| r.split_once(" of "))
            .and_then(|(_, r)| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok());
        return Some(Said::Formed {
            generation: generation.trim().parse().ok()?,
            restarts: restarts.trim().parse().ok()?,
            nodes,
        });
    }
    if let Some(rest) = msg.strip_prefix("checkpoint committed at step ") {
        let step = rest.split_whitespace().next()?.parse().ok()?;
        return Some(Said::Committed { step });
    }
    if let Some(rest) = msg.strip_prefix("attempt ") {
        let (attempt, rest) = rest.split_once(": first failure in the gang: ")?;
        let what = rest.split_once("; then ").map_or(rest, |(what, _)| what);
        return Some(Said::RootCause {
            attempt: attempt.trim().parse().ok()?,
            what: what.to_owned(),
        });
    }
    if let Some(what) = msg.strip_prefix("hung: ") {
        return Some(Said::Hung {
            what: what.to_owned(),
        });
    }
    for prefix in ["slow rank: ", "slow GPU: ", "straggler node: "] {
        if let Some(what) = msg.strip_prefix(prefix) {
            return Some(Said::Slow {
                what: what.to_owned(),
            });
        }
    }
    if msg.starts_with(restart_timeline::LINE_PREFIX) && msg.contains(restart_timeline::LINE_MARK) {
        return Some(Said::RestartCost {
            what: msg.to_owned(),
        });
    }
    msg.strip_prefix("checkpoint aborted: ")
        .map(|reason| Said::Aborted {
            reason: reason.to_owned(),
        })
}

/// One line of the timeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A fault was injected; `what` says how (signal, target, pid).
    FaultHit {
        fault: Fault,
        what: String,
    },
    /// A fault could not be injected, or never came due.
    FaultMissed {
        fault: Fault,
        why: String,
    },
    /// A killed node's replacement agent started.
    Replaced {
        node: u32,
        pid: i32,
    },
    /// A killed node was not replaced: no other agent was left to rejoin.
    NotReplaced {
        node: u32,
    },
    /// An agent said the gang formed at this generation.
    Formed {
        generation: u64,
        restarts: u32,
        again: bool,
    },
    /// Every worker of a world is running.
    Running {
        workers: usize,
        restart_count: Option<u32>,
        /// Not the first gang: how long there was none, and the last committed step.
        resumed: Option<Resumed>,
    },
    /// The faults' clock started: at the first worker line after the gang first ran (`output`),
    /// or [`CLOCK_FALLBACK`] after it.
    ClockStarted {
        output: bool,
    },
    /// None of the running gang's workers is left.
    Stopped {
        workers: usize,
    },
    Committed {
        step: u64,
    },
    Aborted {
        reason: String,
    },
    /// The gang's first failure of an attempt (by the store's receive order).
    RootCause {
        attempt: u32,
        what: String,
    },
    /// The hang watch named a hung rank (from the script's step reports or, without the helper,
    /// its optimizer steps and liveness).
    Hung {
        what: String,
    },
    /// The straggler watch named a slow rank or GPU, or a node left because of one.
    Slow {
        what: String,
    },
    /// A node's agent timed a restart: its phases, up to every local rank's first step.
    RestartCost {
        what: String,
    },
    AgentExited {
        node: u32,
        code: u8,
    },
    JobEnded {
        code: u8,
    },
}

/// How a gang came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumed {
    /// Seconds from the previous gang's stop to this one running, in tenths (the sampling
    /// resolution; an integer keeps [`Entry`] comparable).
    pub without_gang_ds: u64,
    /// The last step committed in this run, which a resuming script loads.
    pub committed: Option<u64>,
}

impl Entry {
    /// A short stable name, a field of the JSON record.
    pub fn kind(&self) -> &'static str {
        match self {
            Entry::FaultHit { .. } => "fault",
            Entry::FaultMissed { .. } => "fault_missed",
            Entry::Replaced { .. } => "replaced",
            Entry::NotReplaced { .. } => "not_replaced",
            Entry::Formed { .. } => "formed",
            Entry::Running { resumed: None, .. } => "running",
            Entry::Running { .. } => "resumed",
            Entry::ClockStarted { .. } => "clock",
            Entry::Stopped { .. } => "stopped",
            Entry::Committed { .. } => "committed",
            Entry::Aborted { .. } => "aborted",
            Entry::RootCause { .. } => "root_cause",
            Entry::Hung { .. } => "hang",
            Entry::Slow { .. } => "straggler",
            Entry::RestartCost { .. } => "restart_cost",
            Entry::AgentExited { .. } => "agent_exited",
            Entry::JobEnded { .. } => "job_ended",
        }
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::FaultHit { fault, what } => write!(f, "fault {fault}: {what}"),
            Entry::FaultMissed { fault, why } => write!(f, "fault {fault} not injected: {why}"),
            Entry::Replaced { node, pid } => write!(
                f,
                "node {node}'s replacement agent started (pid {pid}, the same flags)"
            ),
            Entry::NotReplaced { node } => write!(
                f,
                "node {node} not replaced: every other agent had exited, nothing to rejoin"
            ),
            Entry::Formed {
                generation,
                restarts,
                again,
            } => write!(
                f,
                "gang {}: generation {generation} (restarts used {restarts})",
                if *again { "re-formed" } else { "formed" }
            ),
            Entry::Running {
                workers,
                restart_count,
                resumed,
            } => {
                let restart = restart_count.map_or_else(String::new, |r| format!(", restart {r}"));
                match resumed {
                    None => write!(f, "gang running: all {workers} workers joined{restart}"),
                    Some(r) => {
                        write!(
                            f,
                            "gang resumed: all {workers} workers joined again{restart}, {}.{} s without a gang; ",
                            r.without_gang_ds / 10,
                            r.without_gang_ds % 10
                        )?;
                        match r.committed {
                            Some(step) => write!(f, "last committed checkpoint: step {step}"),
                            None => write!(f, "no checkpoint committed in this run"),
                        }
                    }
                }
            }
            Entry::ClockStarted { output: true } => {
                write!(
                    f,
                    "first worker output: training under way (faults count from here)"
                )
            }
            Entry::ClockStarted { output: false } => write!(
                f,
                "no worker output {} s after joining (faults count from here)",
                CLOCK_FALLBACK.as_secs()
            ),
            Entry::Stopped { workers } => {
                write!(f, "gang stopped: none of its {workers} workers is running")
            }
            Entry::Committed { step } => write!(f, "checkpoint committed at step {step}"),
            Entry::Aborted { reason } => write!(f, "checkpoint aborted: {reason}"),
            Entry::RootCause { attempt, what } => {
                write!(f, "root cause of attempt {attempt}: {what}")
            }
            Entry::Hung { what } => write!(f, "hang: {what}"),
            Entry::Slow { what } => write!(f, "straggler: {what}"),
            Entry::RestartCost { what } => write!(f, "{what}"),
            Entry::AgentExited { node, code } => {
                write!(f, "node {node}'s agent exited with {code}")
            }
            Entry::JobEnded { code } => write!(f, "job exit code {code}"),
        }
    }
}

/// The gang as last sampled.
#[derive(Debug, Default)]
enum Gang {
    /// No complete world of workers yet.
    #[default]
    NeverRan,
    Running {
        ids: HashSet<(i32, u64)>,
    },
    /// The last gang's workers are gone; `ids` so that a leftover is never taken for a new gang.
    Stopped {
        at: Instant,
        ids: HashSet<(i32, u64)>,
    },
}

/// The timeline of one dry run.
#[derive(Debug)]
pub struct Timeline {
    start: Instant,
    entries: Vec<(Instant, Entry)>,
    gang: Gang,
    /// When every worker of the first gang had joined its process group.
    first_running: Option<Instant>,
    /// When the faults' clock started: the first worker line after `first_running`.
    clock: Option<Instant>,
    generation: Option<u64>,
    /// The generation whose round lines are being counted, and how many nodes said it so far.
    forming: Option<(u64, u32)>,
    committed: Option<u64>,
}

impl Timeline {
    /// A timeline whose times count from `start` (the agents' start).
    pub fn new(start: Instant) -> Self {
        Self {
            start,
            entries: Vec::new(),
            gang: Gang::default(),
            first_running: None,
            clock: None,
            generation: None,
            forming: None,
            committed: None,
        }
    }

    pub fn record(&mut self, at: Instant, entry: Entry) {
        self.entries.push((at, entry));
    }

    /// Whether a sample must say which workers joined their process group: while no gang runs.
    pub fn watching_joins(&self) -> bool {
        !matches!(self.gang, Gang::Running { .. })
    }

    /// When every worker of the first gang was first seen running (joined).
    pub fn first_running(&self) -> Option<Instant> {
        self.first_running
    }

    /// When the faults' clock started (see [`CLOCK_FALLBACK`]); `now` starts it by the fallback.
    pub fn clock(&mut self, now: Instant) -> Option<Instant> {
        if self.clock.is_none() {
            let joined = self.first_running?;
            if now >= joined + CLOCK_FALLBACK {
                let at = joined + CLOCK_FALLBACK;
                self.clock = Some(at);
                self.record(at, Entry::ClockStarted { output: false });
            }
        }
        self.clock
    }

    /// One sample of the workers.
    pub fn observe_workers(&mut self, at: Instant, workers: &[Worker]) {
        let alive: HashSet<(i32, u64)> = workers.iter().map(Worker::id).collect();
        if let Gang::Running { ids } = &self.gang {
            if ids.is_disjoint(&alive) {
                let ids = ids.clone();
                let workers = ids.len();
                self.gang = Gang::Stopped { at, ids };
                self.record(at, Entry::Stopped { workers });
            }
        }
        let Some(world) = complete_world(workers) else {
            return;
        };
        let resumed = match &self.gang {
            Gang::Running { .. } => return,
            Gang::Stopped { at: stopped, ids } => {
                if !ids.is_disjoint(&alive) {
                    return;
                }
                let ds = at.saturating_duration_since(*stopped).as_millis() / 100;
                Some(Resumed {
                    without_gang_ds: u64::try_from(ds).unwrap_or(u64::MAX),
                    committed: self.committed,
                })
            }
            Gang::NeverRan => None,
        };
        if self.first_running.is_none() {
            self.first_running = Some(at);
        }
        self.gang = Gang::Running { ids: alive.clone() };
        self.record(
            at,
            Entry::Running {
                workers: world,
                restart_count: workers.iter().filter_map(|w| w.restart_count).max(),
                resumed,
            },
        );
    }

    /// One line of an agent's output: the agent's own (what it says), or a worker's (the first
    /// one after the gang first ran starts the faults' clock).
    pub fn observe_line(&mut self, at: Instant, line: &str, format: LogFormat) {
        let Some(msg) = agent_message(line, format) else {
            let joined = self.first_running.is_some_and(|j| j <= at);
            if self.clock.is_none() && joined && is_worker_line(line, format) {
                self.clock = Some(at);
                self.record(at, Entry::ClockStarted { output: true });
            }
            return;
        };
        let Some(said) = classify(&msg) else {
            return;
        };
        match said {
            Said::Formed {
                generation,
                restarts,
                nodes,
            } => {
                // Every node of the round says it; the last to say it dates the gang (the first
                // says it while other nodes may still be stopping the previous gang's workers).
                if self.generation.is_some_and(|g| g >= generation) {
                    return;
                }
                let said = match self.forming {
                    Some((g, n)) if g == generation => n + 1,
                    _ => 1,
                };
                self.forming = Some((generation, said));
                if nodes.is_some_and(|n| said < n) {
                    return;
                }
                // Every node has left the previous gang to join this round: it stopped, however
                // late the sampling of the workers notices.
                if let Gang::Running { ids } = &self.gang {
                    let ids = ids.clone();
                    let workers = ids.len();
                    self.gang = Gang::Stopped { at, ids };
                    self.record(at, Entry::Stopped { workers });
                }
                let again = self.generation.is_some() || generation > 0;
                self.generation = Some(generation);
                self.record(
                    at,
                    Entry::Formed {
                        generation,
                        restarts,
                        again,
                    },
                );
            }
            Said::Committed { step } => {
                if self.committed == Some(step) {
                    return;
                }
                self.committed = Some(step);
                self.record(at, Entry::Committed { step });
            }
            Said::Aborted { reason } => {
                let seen = self
                    .entries
                    .iter()
                    .any(|(_, e)| matches!(e, Entry::Aborted { reason: r } if *r == reason));
                if !seen {
                    self.record(at, Entry::Aborted { reason });
                }
            }
            Said::RootCause { attempt, what } => {
                let seen = self.entries.iter().any(
                    |(_, e)| matches!(e, Entry::RootCause { attempt: a, .. } if *a == attempt),
                );
                if !seen {
                    self.record(at, Entry::RootCause { attempt, what });
                }
            }
            Said::Hung { what } => self.record(at, Entry::Hung { what }),
            Said::Slow { what } => self.record(at, Entry::Slow { what }),
            Said::RestartCost { what } => self.record(at, Entry::RestartCost { what }),
        }
    }

    /// The entries in time order, each with its seconds since the start.
    pub fn entries(&self) -> Vec<(f64, &Entry)> {
        let mut sorted: Vec<&(Instant, Entry)> = self.entries.iter().collect();
        // Stable: entries of one instant keep the order they were recorded in.
        sorted.sort_by_key(|(at, _)| *at);
        sorted
            .into_iter()
            .map(|(at, e)| (at.saturating_duration_since(self.start).as_secs_f64(), e))
            .collect()
    }
}

/// The size of the world `workers` make up when it is complete and running: as many workers as
/// their (common) `WORLD_SIZE`, with distinct ranks, every one joined to the process group.
fn complete_world(workers: &[Worker]) -> Option<usize> {
    let world = workers.first()?.world_size?;
    if workers
        .iter()
        .any(|w| w.world_size != Some(world) || !w.joined)
    {
        return None;
    }
    let ranks: HashSet<u32> = workers.iter().filter_map(|w| w.rank).collect();
    (ranks.len() == workers.len() && workers.len() == world as usize).then_some(workers.len())
}

/// One line of the printed timeline: the time since the agents started, then the entry.
pub fn render(seconds: f64, entry: &Entry) -> String {
    format!("{seconds:>7.1} s  {entry}")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::cmd::dry_run::fault::spec::parse;

    fn worker(pid: i32, node: u32, rank: u32, world: u32, restart: u32) -> Worker {
        Worker {
            pid,
            start_time: 1000 + pid as u64,
            node,
            rank: Some(rank),
            world_size: Some(world),
            restart_count: Some(restart),
            joined: true,
        }
    }

    fn gang(first_pid: i32, world: u32, restart: u32) -> Vec<Worker> {
        (0..world)
            .map(|r| worker(first_pid + r as i32, r / 2, r, world, restart))
            .collect()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_round_formed_by_every_node_means_the_previous_gang_stopped() {
        let t0 = Instant::now();
        let mut tl = Timeline::new(t0);
        tl.observe_workers(t0 + ms(100), &gang(10, 2, 0));
        for node in 0..2 {
            tl.observe_line(
                t0 + ms(200 + 100 * node),
                &format!(" INFO round 1: node {node} is group rank {node} of 2, global rank {node} of 2 (restarts used 1)"),
                LogFormat::Text,
            );
        }
        // The workers' sampling had not yet noticed the stop.
        tl.observe_workers(t0 + ms(400), &[]);
        let kinds: Vec<&str> = tl.entries().iter().map(|(_, e)| e.kind()).collect();
        assert_eq!(kinds, ["running", "stopped", "formed"]);
        assert!((tl.entries()[1].0 - 0.3).abs() < 1e-9);
    }

    #[test]
    fn agent_messages_are_read_in_both_formats() {
        let text =
            " INFO round 2: node 1 is group rank 1 of 3, global ranks 2-3 of 6 (restarts used 1)";
        assert_eq!(
            agent_message(text, LogFormat::Text)
                .as_deref()
                .and_then(classify),
            Some(Said::Formed {
                generation: 2,
                restarts: 1,
                nodes: Some(3),
            })
        );
        let json = r#"{"ts":"t","level":"INFO","source":"agent","host":"h","msg":"checkpoint committed at step 41 on every node"}"#;
        assert_eq!(
            agent_message(json, LogFormat::Json)
                .as_deref()
                .and_then(classify),
            Some(Said::Committed { step: 41 })
        );
        let warn = " WARN checkpoint aborted: the deadline passed";
        assert_eq!(
            agent_message(warn, LogFormat::Text)
                .as_deref()
                .and_then(classify),
            Some(Said::Aborted {
                reason: "the deadline passed".into()
            })
        );
        // A worker's line is not the agent's, even when it says the same words.
        let rank = r#"{"source":"rank","msg":"round 9: x (restarts used 9)"}"#;
        assert_eq!(agent_message(rank, LogFormat::Json), None);
        assert_eq!(
            agent_message("[vm:0] round 9: (restarts used 9)", LogFormat::Text),
            None
        );
        assert_eq!(classify("round x: (restarts used 1)"), None);
        assert_eq!(classify("every node finished"), None);
        // The hang watch naming the cause: the dry run says why the gang stopped.
        let hung = "ERROR hung: rank 1 (local rank 0) on node 1 (vm) made no progress for 5.0 s (last step 10; limit 5 s), stuck in wait (/x.py:3)";
        let said = agent_message(hung, LogFormat::Text)
            .as_deref()
            .and_then(classify);
        assert!(
            matches!(&said, Some(Said::Hung { what }) if what.starts_with("rank 1 (local rank 0) on node 1")),
            "{said:?}"
        );
        let t0 = Instant::now();
        let mut tl = Timeline::new(t0);
        tl.observe_line(t0 + ms(100), hung, LogFormat::Text);
        let entries = tl.entries();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].1.kind(), "hang");
        assert!(entries[0]
            .1
            .to_string()
            .starts_with("hang: rank 1 (local rank 0) on node 1"));
    }

    #[test]
    fn a_gang_runs_stops_and_resumes_with_its_gap_and_step() {
        let t0 = Instant::now();
        let mut tl = Timeline::new(t0);
        // Half a world is not a gang, nor a world still importing torch.
        tl.observe_workers(t0 + ms(100), &gang(10, 4, 0)[..2]);
        let mut starting = gang(10, 4, 0);
        starting[3].joined = false;
        tl.observe_workers(t0 + ms(150), &starting);
        assert_eq!(tl.first_running(), None);
        assert!(tl.watching_joins());
        tl.observe_workers(t0 + ms(200), &gang(10, 4, 0));
        assert_eq!(tl.first_running(), Some(t0 + ms(200)));
        assert!(!tl.watching_joins());
        tl.observe_line(
            t0 + ms(300),
            " INFO checkpoint committed at step 40 on every node",
            LogFormat::Text,
        );
        // One worker gone: still the same gang; then all gone.
        tl.observe_workers(t0 + ms(400), &gang(10, 4, 0)[1..]);
        tl.observe_workers(t0 + ms(500), &[]);
        tl.observe_line(
            t0 + ms(600),
            " INFO round 1: node 0 is group rank 0 of 2, global ranks 0-1 of 4 (restarts used 1)",
            LogFormat::Text,
        );
        // The round is formed when its last node says so.
        tl.observe_line(
            t0 + ms(700),
            " INFO round 1: node 1 is group rank 1 of 2, global ranks 2-3 of 4 (restarts used 1)",
            LogFormat::Text,
        );
        tl.observe_workers(t0 + ms(1800), &gang(20, 4, 1));
        let kinds: Vec<&str> = tl.entries().iter().map(|(_, e)| e.kind()).collect();
        assert_eq!(
            kinds,
            ["running", "committed", "stopped", "formed", "resumed"]
        );
        let (at, last) = tl.entries()[4];
        assert!((at - 1.8).abs() < 1e-9);
        assert_eq!(
            last.to_string(),
            "gang resumed: all 4 workers joined again, restart 1, 1.3 s without a gang; \
             last committed checkpoint: step 40"
        );
        assert!((tl.entries()[3].0 - 0.7).abs() < 1e-9);
        assert_eq!(
            tl.entries()[3].1.to_string(),
            "gang re-formed: generation 1 (restarts used 1)"
        );
    }

    #[test]
    fn a_restart_faster_than_a_sample_is_still_a_stop_and_a_resume() {
        let t0 = Instant::now();
        let mut tl = Timeline::new(t0);
        tl.observe_workers(t0, &gang(10, 2, 0));
        tl.observe_workers(t0 + ms(100), &gang(20, 2, 1));
        let kinds: Vec<&str> = tl.entries().iter().map(|(_, e)| e.kind()).collect();
        assert_eq!(kinds, ["running", "stopped", "resumed"]);
        assert!(tl.entries()[2]
            .1
            .to_string()
            .ends_with("no checkpoint committed in this run"));
    }

    #[test]
    fn the_clock_starts_at_the_first_worker_line_after_joining_or_a_minute_later() {
        let t0 = Instant::now();
        let mut tl = Timeline::new(t0);
        // A line before the gang ran (an import warning) does not start it.
        tl.observe_line(t0, "[vm:0] UserWarning: ...", LogFormat::Text);
        tl.observe_workers(t0 + ms(100), &gang(10, 2, 0));
        assert_eq!(tl.clock(t0 + ms(200)), None);
        tl.observe_line(
            t0 + ms(300),
            " INFO round 0: x (restarts used 0)",
            LogFormat::Text,
        );
        assert_eq!(tl.clock(t0 + ms(300)), None);
        tl.observe_line(t0 + ms(400), "[vm:1] step 0 loss 0.3", LogFormat::Text);
        assert_eq!(tl.clock(t0 + ms(500)), Some(t0 + ms(400)));
        tl.observe_line(t0 + ms(600), "[vm:1] step 1 loss 0.3", LogFormat::Text);
        assert_eq!(tl.clock(t0 + ms(700)), Some(t0 + ms(400)));
        assert!(tl.entries().iter().any(|(_, e)| e.kind() == "clock"));

        let mut json = Timeline::new(t0);
        json.observe_workers(t0, &gang(10, 2, 0));
        json.observe_line(
            t0 + ms(10),
            r#"{"source":"agent","msg":"x"}"#,
            LogFormat::Json,
        );
        assert_eq!(json.clock(t0 + ms(20)), None);
        json.observe_line(
            t0 + ms(30),
            r#"{"source":"rank","rank":0,"msg":"x"}"#,
            LogFormat::Json,
        );
        assert_eq!(json.clock(t0 + ms(40)), Some(t0 + ms(30)));

        let mut silent = Timeline::new(t0);
        silent.observe_workers(t0, &gang(10, 2, 0));
        assert_eq!(silent.clock(t0 + CLOCK_FALLBACK - ms(1)), None);
        assert_eq!(
            silent.clock(t0 + CLOCK_FALLBACK + ms(50)),
            Some(t0 + CLOCK_FALLBACK)
        );
        assert!(silent.entries()[1]
            .1
            .to_string()
            .starts_with("no worker output 60 s after joining"));
    }

    #[test]
    fn every_node_saying_a_generation_is_one_entry() {
        let t0 = Instant::now();
        let mut tl = Timeline::new(t0);
        for node in 0..3 {
            let line = format!(
                r#"{{"source":"agent","msg":"round 0: node {node} is group rank {node} of 3, global rank {node} of 3 (restarts used 0)"}}"#
            );
            tl.observe_line(t0 + ms(node * 10), &line, LogFormat::Json);
        }
        let entries = tl.entries();
        assert_eq!(entries.len(), 1);
        assert_eq!(
            entries[0].1.to_string(),
            "gang formed: generation 0 (restarts used 0)"
        );
    }

    #[test]
    fn the_gangs_root_cause_is_one_entry_per_attempt_whichever_node_says_it() {
        let start = Instant::now();
        let mut t = Timeline::new(start);
        let cause = "node 1 (vm) rank 3 (local rank 1): exit code 1: ValueError: bad shard";
        t.observe_line(
            start + ms(10),
            &format!(" WARN attempt 0: first failure in the gang: {cause}"),
            LogFormat::Text,
        );
        t.observe_line(
            start + ms(20),
            &format!(" WARN attempt 0: first failure in the gang: {cause}; then rank 1 (local rank 1) on this node failed 40 ms later (exit code 1): RuntimeError: closed"),
            LogFormat::Text,
        );
        let entries = t.entries();
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert_eq!(
            entries[0].1,
            &Entry::RootCause {
                attempt: 0,
                what: cause.to_owned()
            }
        );
        assert!(render(entries[0].0, entries[0].1)
            .ends_with(&format!(" s  root cause of attempt 0: {cause}")));
    }

    #[test]
    fn a_restarts_cost_is_an_entry_and_a_round_line_is_not_one() {
        let msg = "restart 1 (node 0): every local rank stepping again 0.42 s after the attempt ended (muster's own share 0.12 s): stop 0.01 s, decide 0.00 s, rendezvous 0.10 s, spawn 0.01 s (2 of 2 warm), startup 0.05 s, init_process_group 0.10 s, first_step 0.15 s";
        assert_eq!(classify(msg), Some(Said::RestartCost { what: msg.into() }));
        // Other agent lines that start the same way are not a restart's cost.
        assert_eq!(classify("restart budget spent: 3 of 3"), None);
        let mut t = Timeline::new(Instant::now());
        t.observe_line(Instant::now(), &format!(" INFO {msg}"), LogFormat::Text);
        let entries = t.entries();
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert_eq!(entries[0].1.kind(), "restart_cost");
        assert_eq!(entries[0].1.to_string(), msg);
    }

    #[test]
    fn a_straggler_finding_is_an_entry() {
        let msg = "slow rank: rank 2 (node 2, host h, local rank 0) computes 2.9x longer per step than the gang median";
        assert_eq!(
            classify(msg),
            Some(Said::Slow {
                what: "rank 2 (node 2, host h, local rank 0) computes 2.9x longer per step than the gang median".into()
            })
        );
        let mut t = Timeline::new(Instant::now());
        t.observe_line(Instant::now(), &format!(" WARN {msg}"), LogFormat::Text);
        let entries = t.entries();
        assert_eq!(entries[0].1.kind(), "straggler");
        assert!(entries[0]
            .1
            .to_string()
            .starts_with("straggler: rank 2 (node 2"));
    }

    #[test]
    fn entries_print_in_time_order() {
        let t0 = Instant::now();
        let mut tl = Timeline::new(t0);
        let fault = parse("kill:0@1").unwrap();
        tl.record(t0 + ms(2000), Entry::JobEnded { code: 0 });
        tl.record(
            t0 + ms(1000),
            Entry::FaultHit {
                fault,
                what: "SIGKILL to node 0's agent (pid 7)".into(),
            },
        );
        let lines: Vec<String> = tl.entries().iter().map(|(s, e)| render(*s, e)).collect();
        assert_eq!(
            lines,
            [
                "    1.0 s  fault kill:0@1: SIGKILL to node 0's agent (pid 7)",
                "    2.0 s  job exit code 0"
            ]
        );
    }
}
