//! Whether the store host is still there: how long it has not answered and what its last
//! failure said, judged by [`decide::decide_store_fault`].

use tokio::time::Instant;

use super::decide::{self, StoreFault, StoreVerdict};
use super::kv::KvError;
use super::Config;

/// How long the store has not answered, and what the last failure said about its host: the
/// input of [`decide::decide_store_fault`], kept across operations by one waiting loop.
pub(super) struct StoreHealth {
    last_ok: Instant,
    last_fault: Option<StoreFault>,
}

impl StoreHealth {
    pub(super) fn new() -> Self {
        Self {
            last_ok: Instant::now(),
            last_fault: None,
        }
    }

    pub(super) fn ok(&mut self) {
        self.last_ok = Instant::now();
        self.last_fault = None;
    }

    /// The verdict on one failed operation, and its reason (naming the failure).
    pub(super) fn judge(&mut self, e: &KvError, cfg: &Config) -> (StoreVerdict, String) {
        let Some(fault) = e.fault() else {
            // A WAIT that ran out of time got its answer: the store is there.
            self.ok();
            return (StoreVerdict::Retry, "wait timed out".into());
        };
        let silent = Instant::now().saturating_duration_since(self.last_ok);
        let (verdict, reason) = decide::decide_store_fault(fault, self.last_fault, silent, cfg);
        self.last_fault = Some(fault);
        (verdict, format!("{reason} ({e})"))
    }
}
