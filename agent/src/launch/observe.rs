//! What the launch loop tells the outside world: the current [`Phase`] (a `watch`, so a late
//! subscriber sees the latest value) and a stream of [`Event`]s (a `broadcast`, so a slow
//! subscriber loses old events instead of slowing the agent). Metrics and health probes subscribe
//! through [`Observer`] without touching the loop.

use nix::sys::signal::Signal;
use tokio::sync::{broadcast, watch};

use super::config::SignalAction;
use super::reaper::ExitStatus;
use super::RankAssignment;

/// Where the agent is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Parsing done, services starting.
    Starting,
    /// Obtaining the rank assignment (and hosting the store) for attempt `restart_count`.
    Rendezvous { restart_count: u32 },
    /// Workers of this attempt are running.
    Running { restart_count: u32 },
    /// Workers are being stopped (failure or stop request).
    Stopping { restart_count: u32 },
    /// The agent is done; this is its exit code.
    Finished { exit_code: u8 },
}

/// How one attempt ended, in short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupResult {
    Succeeded,
    Failed,
    Stopped,
}

/// Why the local worker group is restarted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartCause {
    /// A local worker failed.
    WorkerFailure,
    /// Another node's worker failed or a peer died; the whole gang restarts together.
    PeerFailure,
    /// A node was lost or admitted, or the store host replaced (does not consume the restart
    /// budget); also a local failure that was the consequence of a lost peer.
    MembershipChange,
    /// A local rank hung (`--hang-timeout`): the agent stopped the attempt.
    Hang,
}

/// Something that happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The rendezvous placed this node for attempt `assignment.restart_count`; its workers are
    /// about to start.
    AttemptStarted { assignment: RankAssignment },
    WorkerStarted {
        restart_count: u32,
        local_rank: u32,
        rank: u32,
        pid: u32,
    },
    WorkerExited {
        restart_count: u32,
        local_rank: u32,
        rank: u32,
        status: ExitStatus,
    },
    GroupEnded {
        restart_count: u32,
        result: GroupResult,
    },
    /// The group is being restarted as attempt `restart_count`, because of `cause`.
    Restarting {
        restart_count: u32,
        cause: RestartCause,
    },
    SignalReceived {
        signal: Signal,
        action: SignalAction,
    },
    /// The attempt's leftover processes (helpers the workers started) were stopped: `count` of
    /// them, `killed` of those with SIGKILL after the grace.
    StraysStopped {
        restart_count: u32,
        count: u32,
        killed: u32,
    },
    /// A worker died of SIGKILL while the container's memory cgroup counted an OOM kill.
    WorkerOomKilled {
        restart_count: u32,
        local_rank: u32,
        rank: u32,
    },
    /// Every local rank of a restarted attempt stepped: what the restart cost, phase by phase.
    RestartTimed(super::restart_timeline::RestartCost),
    /// This node's warm standbys changed: how many there are and what they cost.
    Standbys(super::standby::Standbys),
    /// Before attempt `restart_count` started, the agent waited `waited` for the previous
    /// attempt's GPU processes and memory to be released (`released`: false when it gave up).
    GpuReleaseWaited {
        restart_count: u32,
        waited: std::time::Duration,
        released: bool,
    },
}

/// Events the launch loop keeps for a subscriber that has not read them yet: a few per attempt,
/// and a few per rank of each (started, exited, OOM-killed, standby).
const EVENT_SLOTS_BASE: usize = 96;
const EVENT_SLOTS_PER_RANK: usize = 8;

/// A subscription to the launch loop.
pub struct Observer {
    pub phase: watch::Receiver<Phase>,
    pub events: broadcast::Receiver<Event>,
}

/// The sending side, owned by the loop; cheap to clone.
#[derive(Clone)]
pub struct Publisher {
    phase: watch::Sender<Phase>,
    events: broadcast::Sender<Event>,
}

impl Default for Publisher {
    fn default() -> Self {
        Self::new()
    }
}

impl Publisher {
    pub fn new() -> Self {
        Self::for_ranks(1)
    }

    /// A publisher sized for `local_ranks` ranks. Every slot is allocated and written at once: the
    /// fixed 1,024 of before were ~40 pages that every agent touched at start (2,048 agents on one
    /// machine: 2% of their CPU). A subscriber that lags past the slots loses the oldest events
    /// (`Lagged`); they hold several attempts' worth, and the subscribers run on the loop's own
    /// runtime, between two of its awaits.
    pub fn for_ranks(local_ranks: u32) -> Self {
        let slots = EVENT_SLOTS_BASE + EVENT_SLOTS_PER_RANK * local_ranks.max(1) as usize;
        Self {
            phase: watch::Sender::new(Phase::Starting),
            events: broadcast::Sender::new(slots.next_power_of_two()),
        }
    }

    pub fn subscribe(&self) -> Observer {
        Observer {
            phase: self.phase.subscribe(),
            events: self.events.subscribe(),
        }
    }

    pub fn phase(&self, phase: Phase) {
        self.phase.send_replace(phase);
    }

    pub fn event(&self, event: Event) {
        // No subscribers is normal.
        let _ = self.events.send(event);
    }
}
