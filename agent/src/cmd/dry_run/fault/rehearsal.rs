//! The effectful side of a fault rehearsal: each tick it samples the workers, injects the faults
//! that are due (a signal to an agent or to one worker) and says which killed nodes are to be
//! replaced now; the dry run spawns those agents (it owns their command line and output) and
//! tells it what happened, and at the end it hands over the timeline.

use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::time::Instant;

use super::procs::{self, Worker};
use super::schedule::{Due, Schedule};
use super::spec::{Fault, STOP_HOLD};
use super::Options;
use crate::cmd::dry_run::kinds::Target;
use crate::cmd::dry_run::timeline::{Entry, Timeline};
use crate::exit_code;
use crate::launch::config::LogFormat;

/// One dry run's faults and what they did.
#[derive(Debug)]
pub struct Rehearsal {
    schedule: Schedule,
    timeline: Timeline,
    /// Nodes a fault killed for good (no replacement, or none possible).
    lost: Vec<bool>,
    format: LogFormat,
    /// Replace as a Job would (see [`Options::job_like`]).
    job_like: bool,
    /// Workers a `stop-rank` stopped, by identity, and when each is to get SIGCONT.
    stopped: Vec<(Instant, (i32, u64))>,
}

impl Rehearsal {
    pub fn new(options: &Options, nnodes: u32, start: Instant, format: LogFormat) -> Self {
        Self {
            schedule: Schedule::new(options.faults.clone(), options.replace_after),
            timeline: Timeline::new(start),
            lost: vec![false; nnodes as usize],
            format,
            job_like: options.job_like,
            stopped: Vec::new(),
        }
    }

    /// Samples the workers of `agents` (by node; `None`: exited), injects every fault that is
    /// due, and returns the nodes whose replacement agent is to start now.
    pub fn tick(&mut self, now: Instant, agents: &[Option<Pid>]) -> Vec<u32> {
        let running: Vec<(u32, Pid)> = agents
            .iter()
            .enumerate()
            .filter_map(|(node, pid)| Some((u32::try_from(node).ok()?, (*pid)?)))
            .collect();
        let workers = procs::workers(&running, self.timeline.watching_joins());
        self.timeline.observe_workers(now, &workers);
        self.release_stopped(now, &workers);
        let mut replace = Vec::new();
        let clock = self.timeline.clock(now);
        for due in self.schedule.due(now, clock) {
            match due {
                Due::Fault { index, fault } => {
                    if self.inject(now, &fault, agents, &workers) {
                        self.schedule.done(index);
                    }
                }
                Due::Replace { node } => {
                    let others_left = agents
                        .iter()
                        .enumerate()
                        .any(|(n, pid)| n != node as usize && pid.is_some());
                    // A Job recreates every pod it lost, even all of them (a preemption ends every
                    // node with 200).
                    if others_left || agents.len() == 1 || self.job_like {
                        replace.push(node);
                    } else {
                        self.mark_lost(node);
                        self.timeline.record(now, Entry::NotReplaced { node });
                    }
                }
            }
        }
        replace
    }

    /// Injects `fault`; false when it is to be tried again (its worker is not running now).
    fn inject(
        &mut self,
        now: Instant,
        fault: &Fault,
        agents: &[Option<Pid>],
        workers: &[Worker],
    ) -> bool {
        let fault = *fault;
        let signal = fault.kind.def().signal;
        let entry = match fault.kind.target() {
            Target::Node => {
                let node = fault.target;
                match agents.get(node as usize).copied().flatten() {
                    Some(pid) => match kill(pid, signal) {
                        Ok(()) => {
                            if signal == Signal::SIGKILL && !self.schedule.killed(node, now) {
                                self.mark_lost(node);
                            }
                            Entry::FaultHit {
                                fault,
                                what: format!("{signal} to node {node}'s agent (pid {pid})"),
                            }
                        }
                        Err(e) => Entry::FaultMissed {
                            fault,
                            why: format!("{signal} to node {node}'s agent (pid {pid}): {e}"),
                        },
                    },
                    None => Entry::FaultMissed {
                        fault,
                        why: format!("node {node}'s agent had already exited"),
                    },
                }
            }
            Target::Rank => {
                let Some(worker) = workers.iter().find(|w| w.rank == Some(fault.target)) else {
                    return false;
                };
                match kill(Pid::from_raw(worker.pid), signal) {
                    Ok(()) => {
                        let hold = if signal == Signal::SIGSTOP {
                            self.stopped.push((now + STOP_HOLD, worker.id()));
                            format!(", SIGCONT in {} s", STOP_HOLD.as_secs())
                        } else {
                            String::new()
                        };
                        Entry::FaultHit {
                            fault,
                            what: format!(
                                "{signal} to rank {} (pid {}, node {}){hold}",
                                fault.target, worker.pid, worker.node
                            ),
                        }
                    }
                    // It exited between the sample and the signal: try the next one.
                    Err(_) => return false,
                }
            }
        };
        self.timeline.record(now, entry);
        true
    }

    /// Sends SIGCONT to every stopped worker whose hold is over and that still runs (a gang
    /// restart may have ended it already).
    fn release_stopped(&mut self, now: Instant, workers: &[Worker]) {
        let (due, later): (Vec<_>, Vec<_>) = self.stopped.iter().partition(|(at, _)| *at <= now);
        self.stopped = later;
        for (_, id) in due {
            if let Some(w) = workers.iter().find(|w| w.id() == id) {
                let _ = kill(Pid::from_raw(w.pid), Signal::SIGCONT);
                tracing::info!(
                    "muster dry-run: SIGCONT to rank {} (pid {}, node {}) after {} s stopped",
                    w.rank.map_or_else(|| "?".to_owned(), |r| r.to_string()),
                    w.pid,
                    w.node,
                    STOP_HOLD.as_secs()
                );
            }
        }
    }

    fn mark_lost(&mut self, node: u32) {
        if let Some(lost) = self.lost.get_mut(node as usize) {
            *lost = true;
        }
    }

    /// When the faults' clock started (training under way), if it has.
    pub fn clock(&mut self, now: Instant) -> Option<Instant> {
        self.timeline.clock(now)
    }

    /// Adds `faults` to be injected at once (their clock having started): returns them with
    /// their time, which is now.
    pub fn strike(&mut self, now: Instant, faults: &[Fault]) -> Vec<Fault> {
        let Some(clock) = self.timeline.clock(now) else {
            return Vec::new();
        };
        // Whole milliseconds: the spec printed in the timeline replays it.
        let since = now.saturating_duration_since(clock);
        let at = Duration::from_millis(u64::try_from(since.as_millis()).unwrap_or(u64::MAX));
        faults
            .iter()
            .map(|f| {
                let fault = Fault { at, ..*f };
                self.schedule.add(fault);
                fault
            })
            .collect()
    }

    /// The timeline so far.
    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    /// One line of an agent's output.
    pub fn line(&mut self, at: Instant, line: &str) {
        self.timeline.observe_line(at, line, self.format);
    }

    /// Node `node`'s replacement agent started as `pid`.
    pub fn replaced(&mut self, at: Instant, node: u32, pid: Option<Pid>) {
        self.timeline.record(
            at,
            Entry::Replaced {
                node,
                pid: pid.map_or(0, Pid::as_raw),
            },
        );
    }

    pub fn agent_exited(&mut self, at: Instant, node: u32, code: u8) {
        self.timeline.record(at, Entry::AgentExited { node, code });
        // The podFailurePolicy of examples/kubernetes: Ignore (the pod is recreated) for a
        // preemption and for the followers of a lost store host; a killed agent's replacement
        // is already due; 0 completes the pod; anything else counts against the Job and is not
        // replaced here.
        if self.job_like
            && matches!(
                code,
                exit_code::PREEMPTED_CHECKPOINTED
                    | exit_code::CHECKPOINT_ABORTED
                    | exit_code::STORE_HOST_LOST
            )
        {
            self.schedule.killed(node, at);
        }
    }

    /// The run is being stopped (a stop signal): nothing more is injected or replaced.
    pub fn stop(&mut self) {
        self.schedule.cancel();
    }

    /// A replacement is still to start, so the run is not over.
    pub fn replacement_pending(&self) -> bool {
        self.schedule.replacement_pending()
    }

    /// The codes that make the job's (see [`super::counted_codes`]).
    pub fn counted_codes(&self, codes: &[u8]) -> Vec<u8> {
        super::counted_codes(codes, &self.lost)
    }

    /// The run is over with `job` as its code: the timeline, with the faults that never came due.
    pub fn finish(mut self, at: Instant, job: u8) -> Timeline {
        // The agents are gone, and so are their workers.
        self.timeline.observe_workers(at, &[]);
        for fault in self.schedule.undone() {
            let why = if self.timeline.first_running().is_none() {
                "the workers never all joined their process group (a connection to MASTER_PORT)"
                    .to_owned()
            } else {
                "the job ended first".to_owned()
            };
            self.timeline.record(at, Entry::FaultMissed { fault, why });
        }
        self.timeline.record(at, Entry::JobEnded { code: job });
        self.timeline
    }
}
