//! The operator's way in to the checkpoint barrier: `POST /checkpoint` (and the agent's own
//! triggers, for the `trigger` label) hand a [`CheckpointRequest`] to the one consumer registered
//! on a [`RequestSlot`]; until one is registered, or after it is dropped, nobody takes them.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::mpsc;
use tokio::time::Instant;

/// What started a checkpoint request (`trigger` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointTrigger {
    /// SIGTERM (or another signal configured with the checkpoint action) on this node.
    Signal,
    /// `POST /checkpoint` on this agent's endpoint.
    Http,
    /// Another node's request, seen through the store.
    Peer,
}

impl CheckpointTrigger {
    /// Every trigger, for initialising the label set.
    pub const ALL: [CheckpointTrigger; 3] = [
        CheckpointTrigger::Signal,
        CheckpointTrigger::Http,
        CheckpointTrigger::Peer,
    ];

    /// The `trigger` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointTrigger::Signal => "signal",
            CheckpointTrigger::Http => "http",
            CheckpointTrigger::Peer => "peer",
        }
    }
}

/// A checkpoint request delivered to the consumer registered with [`RequestSlot::register`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointRequest {
    pub trigger: CheckpointTrigger,
    /// When the request arrived.
    pub received: Instant,
}

/// What an attempt to deliver a checkpoint request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointDelivery {
    /// The consumer has it.
    Delivered,
    /// A request is already queued and not yet taken; duplicates join it.
    AlreadyPending,
    /// Nobody consumes requests (no barrier in this agent, or it went away).
    NoConsumer,
}

/// The receiving end of operator checkpoint requests; owned by the preemption work. Dropping it
/// makes `POST /checkpoint` answer 503 again.
#[derive(Debug)]
pub struct CheckpointRequests {
    rx: mpsc::Receiver<CheckpointRequest>,
}

impl CheckpointRequests {
    /// The next request; `None` only if the slot was dropped.
    pub async fn recv(&mut self) -> Option<CheckpointRequest> {
        self.rx.recv().await
    }

    /// A request if one is queued, without waiting.
    pub fn try_recv(&mut self) -> Option<CheckpointRequest> {
        self.rx.try_recv().ok()
    }
}

/// Where checkpoint requests are sent: the sending half of the channel to the registered
/// consumer, if any. Clones share the slot (the endpoint delivers, the composition root
/// registers).
#[derive(Debug, Clone, Default)]
pub struct RequestSlot {
    tx: Arc<Mutex<Option<mpsc::Sender<CheckpointRequest>>>>,
}

impl RequestSlot {
    /// Registers the consumer of operator checkpoint requests (the preemption barrier). A later
    /// call replaces the earlier consumer. Until one is registered, or after it is dropped,
    /// `POST /checkpoint` answers 503.
    pub fn register(&self) -> CheckpointRequests {
        // One slot: duplicate requests join the pending one instead of queueing up.
        let (tx, rx) = mpsc::channel(1);
        *self.tx.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        CheckpointRequests { rx }
    }

    /// Delivers a checkpoint request to the registered consumer.
    pub fn deliver(&self, trigger: CheckpointTrigger) -> CheckpointDelivery {
        let slot = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(tx) = slot.as_ref() else {
            return CheckpointDelivery::NoConsumer;
        };
        let request = CheckpointRequest {
            trigger,
            received: Instant::now(),
        };
        match tx.try_send(request) {
            Ok(()) => CheckpointDelivery::Delivered,
            Err(mpsc::error::TrySendError::Full(_)) => CheckpointDelivery::AlreadyPending,
            Err(mpsc::error::TrySendError::Closed(_)) => CheckpointDelivery::NoConsumer,
        }
    }
}

/// Runs `run` (the launch) while handing every request of `slot` to `trigger` (the checkpoint
/// barrier's operator entry; false when it is gone). From here on the endpoint answers 202.
pub async fn serve<F: std::future::Future>(
    slot: &RequestSlot,
    run: F,
    trigger: impl Fn(&str) -> bool,
) -> F::Output {
    let mut requests = slot.register();
    tokio::pin!(run);
    loop {
        tokio::select! {
            output = &mut run => return output,
            Some(request) = requests.recv() => {
                if !trigger("checkpoint requested over HTTP (POST /checkpoint)") {
                    tracing::warn!("POST /checkpoint: the checkpoint barrier is gone");
                }
                tracing::debug!("checkpoint request from {:?}", request.trigger);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_request_waits_for_the_registered_consumer_and_duplicates_join_it() {
        let slot = RequestSlot::default();
        assert_eq!(
            slot.deliver(CheckpointTrigger::Http),
            CheckpointDelivery::NoConsumer
        );
        let mut consumer = slot.clone().register();
        assert_eq!(
            slot.deliver(CheckpointTrigger::Http),
            CheckpointDelivery::Delivered
        );
        assert_eq!(
            slot.deliver(CheckpointTrigger::Signal),
            CheckpointDelivery::AlreadyPending
        );
        let request = consumer.recv().await.unwrap();
        assert_eq!(request.trigger, CheckpointTrigger::Http);
        assert!(consumer.try_recv().is_none());
        drop(consumer);
        assert_eq!(
            slot.deliver(CheckpointTrigger::Http),
            CheckpointDelivery::NoConsumer
        );
    }
}
