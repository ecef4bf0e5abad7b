//! What the parts of the agent below the launch loop tell observers: typed [`Event`]s sent
//! through an [`Events`] handle, so that discovery, the rendezvous adapter, the checkpoint
//! barrier and the GPU pre-flight never call into metrics (or logs, or anything else that
//! watches them). The launch loop's own phases and events are [`crate::launch::observe`]'s; the
//! composition root ([`crate::app`]) hands one receiver to the metrics, which follow both.
//!
//! Sending never waits and never fails the sender: with nobody listening (tests, subcommands
//! without metrics) an event is dropped, and a listener that falls [`CAPACITY`] events behind
//! loses the newest ones instead of slowing the agent.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

/// Events that may wait for the listener; beyond this, new ones are dropped. Far more than a
/// listener on the agent's own runtime ever falls behind (step reports, the most frequent
/// event, come a few per second per rank).
pub const CAPACITY: usize = 4096;

/// How one lookup of the rendezvous host ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DnsResult {
    /// At least one address came back.
    Ok,
    /// The name does not exist (yet), or exists without addresses: the usual state before
    /// Kubernetes publishes the record.
    NxDomain,
    /// The resolver did not answer in time.
    Timeout,
    /// Any other failure (refused, malformed answer, I/O).
    Error,
}

/// How this node's part of a checkpoint barrier ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointResult {
    /// Every rank saved at `step` and the commit stands.
    Committed { step: u64 },
    /// The deadline passed or a rank could not save; the previous checkpoint stays current.
    Aborted,
    /// No barrier ran (some node's scripts lack the helper): not a checkpoint.
    Unsupported,
}

/// How the GPU pre-flight ended.
#[derive(Debug, Clone)]
pub enum PreflightResult {
    /// It did not run (`--gpu-check off`).
    Skipped,
    /// It ran; the report says what each check found and the verdict.
    Checked(Arc<crate::gpu::Report>),
    /// `--gpu-check require` found this node unhealthy, or the check itself failed.
    Failed,
}

/// Something that happened below the launch loop.
#[derive(Debug, Clone)]
pub enum Event {
    /// The GPU pre-flight started.
    PreflightStarted,
    /// The GPU pre-flight ended `elapsed` after it started.
    PreflightFinished {
        result: PreflightResult,
        elapsed: Duration,
    },
    /// Looking up the rendezvous host started (the pod may wait here for DNS).
    ResolvingStarted,
    /// One lookup of the rendezvous host ended.
    DnsAttempt(DnsResult),
    /// The rendezvous host resolved (`resolved`) or the deadline passed, `elapsed` after the
    /// first lookup.
    ResolvingFinished { resolved: bool, elapsed: Duration },
    /// This node (node 0) hosts the gang's rendezvous store; `stats` are its live counters.
    RendezvousStoreHosted {
        stats: Arc<rendezvous::store::server::Stats>,
    },
    /// Node 0's rendezvous store accepted this agent's own connection: others can join.
    RendezvousStoreAccepting,
    /// A checkpoint barrier started on this node (`from_peer`: another node asked for it).
    CheckpointStarted { from_peer: bool },
    /// The checkpoint barrier reached its verdict `elapsed` after it started here.
    CheckpointEnded {
        result: CheckpointResult,
        elapsed: Duration,
    },
    /// A local rank reported (through the checkpoint helper) that it reached `step`.
    WorkerStep { local_rank: u32, step: u64 },
}

/// The sending side: cheap to clone, handed to every part that has something to tell.
/// `Events::default()` sends nowhere.
#[derive(Debug, Clone, Default)]
pub struct Events {
    tx: Option<mpsc::Sender<Event>>,
}

/// The receiving side, for the one observer that follows these events.
pub type Receiver = mpsc::Receiver<Event>;

impl Events {
    /// A connected pair.
    pub fn channel() -> (Events, Receiver) {
        let (tx, rx) = mpsc::channel(CAPACITY);
        (Events { tx: Some(tx) }, rx)
    }

    /// Sends `event` if anyone listens and has room for it.
    pub fn publish(&self, event: Event) {
        if let Some(tx) = &self.tx {
            // Full or closed: the listener is behind or gone; the sender goes on.
            let _ = tx.try_send(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_reach_the_listener_and_nowhere_costs_nothing() {
        Events::default().publish(Event::ResolvingStarted);
        let (events, mut rx) = Events::channel();
        events
            .clone()
            .publish(Event::DnsAttempt(DnsResult::NxDomain));
        assert!(matches!(
            rx.try_recv(),
            Ok(Event::DnsAttempt(DnsResult::NxDomain))
        ));
        drop(rx);
        // A listener that went away does not fail the sender.
        events.publish(Event::ResolvingStarted);
    }

    #[test]
    fn a_listener_that_falls_behind_loses_the_newest_events() {
        let (events, mut rx) = Events::channel();
        for step in 0..=CAPACITY as u64 {
            events.publish(Event::WorkerStep {
                local_rank: 0,
                step,
            });
        }
        let mut last = None;
        while let Ok(Event::WorkerStep { step, .. }) = rx.try_recv() {
            last = Some(step);
        }
        assert_eq!(last, Some(CAPACITY as u64 - 1));
    }
}
