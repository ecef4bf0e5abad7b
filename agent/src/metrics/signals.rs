//! Signals the agent received and the grace budget a terminating one starts:
//! `muster_signals_received_total`; the budget left is exported at scrape time
//! ([`super::live`]).

use std::sync::Arc;
use std::time::Duration;

use prometheus::IntCounterVec;
use tokio::time::Instant;

use super::live::Live;
use super::{signal_name, Defs};
use crate::launch::config::SignalAction;
use crate::launch::Event;

/// Whether a terminating signal already started the grace countdown (only the first one does).
#[derive(Debug, Default)]
pub(super) struct GraceCountdown {
    started: bool,
}

/// The signals' counter and the grace budget.
pub(super) struct Signals {
    received: IntCounterVec,
    live: Arc<Live>,
}

impl Signals {
    /// Defines the family.
    pub(super) fn register(defs: &mut Defs, live: Arc<Live>) -> Self {
        Self {
            received: defs.counter_vec(
                "muster_signals_received_total",
                "Signals the agent received, by name.",
                &["signal"],
            ),
            live,
        }
    }

    /// Counts a signal the agent received.
    pub(super) fn signal_received(&self, signal: i32) {
        self.received
            .with_label_values(&[&signal_name(signal)])
            .inc();
    }

    /// The full grace budget (what `muster_grace_remaining_seconds` shows while no shutdown runs).
    pub(super) fn set_grace_period(&self, budget: Duration) {
        self.live.set_grace_period(budget);
    }

    /// A shutdown started that must finish by `deadline`; the remaining budget counts down.
    pub(super) fn grace_deadline(&self, deadline: Instant) {
        self.live.set_grace_deadline(Some(deadline));
    }

    /// Records a received signal, and starts the countdown of `grace` at the first that stops
    /// the agent; other events are not its.
    pub(super) fn observe(&self, event: &Event, countdown: &mut GraceCountdown, grace: Duration) {
        if let Event::SignalReceived { signal, action } = event {
            self.signal_received(*signal as i32);
            if matches!(action, SignalAction::Terminate | SignalAction::Checkpoint)
                && !countdown.started
            {
                countdown.started = true;
                self.grace_deadline(Instant::now() + grace);
            }
        }
    }
}
