//! A part of the agent asking this node to leave the gang while its workers run: the launch loop
//! stops the attempt and ends with the part's exit code, so that an elastic gang
//! (`--nnodes MIN:MAX`) re-forms without the node, as it does after a fatal GPU fault. The
//! straggler watch uses it to exclude a node found slow for a sustained period
//! ([`crate::exit_code::SLOW_NODE_EXCLUDED`]).

use std::sync::Arc;

/// Why the node leaves, and with which code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departure {
    pub code: u8,
    pub message: String,
}

/// A cheap-to-clone handle: any holder may ask; the first request stands.
#[derive(Clone)]
pub struct Leave {
    tx: Arc<tokio::sync::watch::Sender<Option<Departure>>>,
}

impl Default for Leave {
    fn default() -> Self {
        Self {
            tx: Arc::new(tokio::sync::watch::Sender::new(None)),
        }
    }
}

impl Leave {
    /// Asks the node to leave; a later request does not replace the first.
    pub fn request(&self, departure: Departure) {
        self.tx.send_if_modified(|d| {
            if d.is_some() {
                return false;
            }
            *d = Some(departure);
            true
        });
    }

    /// The standing request, if any.
    pub fn current(&self) -> Option<Departure> {
        self.tx.borrow().clone()
    }

    /// Resolves with the first request (at once when there is one).
    pub async fn requested(&self) -> Departure {
        let mut rx = self.tx.subscribe();
        if let Ok(d) = rx.wait_for(Option::is_some).await {
            if let Some(d) = d.as_ref() {
                return d.clone();
            }
        }
        // The sender lives as long as `self`.
        std::future::pending().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_request_stands() {
        let leave = Leave::default();
        assert_eq!(leave.current(), None);
        let waiter = tokio::spawn({
            let leave = leave.clone();
            async move { leave.requested().await }
        });
        let first = Departure {
            code: 210,
            message: "slow".into(),
        };
        leave.request(first.clone());
        leave.request(Departure {
            code: 1,
            message: "later".into(),
        });
        assert_eq!(waiter.await.unwrap(), first);
        assert_eq!(leave.current(), Some(first));
    }
}
