//! The effectful side of a fault rehearsal: each tick it samples the workers, injects the faults
//! that are due (a signal to an agent or to one worker) and says which killed nodes are to be
//! replaced now; the dry run spawns those agents (it owns their command line and output) and
//! tells it what happened, and at the end it hands over the timeline.

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::time::Instant;

use super::procs::{self, Worker};
use super::schedule::{Due, Schedule};
use super::spec::{Fault, Kind};
use super::Options;
use crate::cmd::dry_run::timeline::{Entry, Timeline};
use crate::launch::config::LogFormat;

/// One dry run's faults and what they did.
#[derive(Debug)]
pub struct Rehearsal {
    schedule: Schedule,
    timeline: Timeline,
    /// Nodes a fault killed for good (no replacement, or none possible).
    lost: Vec<bool>,
    format: LogFormat,
}

impl Rehearsal {
    pub fn new(options: &Options, nnodes: u32, start: Instant, format: LogFormat) -> Self {
        Self {
            schedule: Schedule::new(options.faults.clone(), options.replace_after),
            timeline: Timeline::new(start),
            lost: vec![false; nnodes as usize],
            format,
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
                    if others_left || agents.len() == 1 {
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
        let entry = match fault.kind {
            Kind::Kill | Kind::Term => {
                let signal = if fault.kind == Kind::Kill {
                    Signal::SIGKILL
                } else {
                    Signal::SIGTERM
                };
                let node = fault.target;
                match agents.get(node as usize).copied().flatten() {
                    Some(pid) => match kill(pid, signal) {
                        Ok(()) => {
                            if fault.kind == Kind::Kill && !self.schedule.killed(node, now) {
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
            Kind::KillRank => {
                let Some(worker) = workers.iter().find(|w| w.rank == Some(fault.target)) else {
                    return false;
                };
                match kill(Pid::from_raw(worker.pid), Signal::SIGKILL) {
                    Ok(()) => Entry::FaultHit {
                        fault,
                        what: format!(
                            "SIGKILL to rank {} (pid {}, node {})",
                            fault.target, worker.pid, worker.node
                        ),
                    },
                    // It exited between the sample and the signal: try the next one.
                    Err(_) => return false,
                }
            }
        };
        self.timeline.record(now, entry);
        true
    }

    fn mark_lost(&mut self, node: u32) {
        if let Some(lost) = self.lost.get_mut(node as usize) {
            *lost = true;
        }
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
