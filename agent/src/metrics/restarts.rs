//! What each restart cost, phase by phase ([`crate::launch::restart_timeline`]): from the end
//! of the failed attempt to every local rank's first step of the next.

use prometheus::{HistogramOpts, HistogramVec};

use super::{Defs, STATIC_DEFINITION};
use crate::launch::restart_timeline::{RestartCost, RestartPhase};

/// A restart's phases range from a few milliseconds (a warm handover) to minutes (a round that
/// waits for a replacement pod, a large checkpoint load).
const PHASE_BUCKETS_SECONDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

pub(super) struct Restarts {
    phase_seconds: HistogramVec,
}

impl Restarts {
    /// Defines the family, every phase at 0.
    pub(super) fn register(defs: &mut Defs) -> Self {
        let restarts = Self {
            phase_seconds: defs.register(
                HistogramVec::new(
                    HistogramOpts::new(
                        "muster_restart_phase_seconds",
                        "Each restart's phases on this node, from the end of the failed attempt to every local rank's first step of the next: stop, decide, rendezvous, spawn (muster's own), startup, init_process_group, first_step (the script's).",
                    )
                    .buckets(PHASE_BUCKETS_SECONDS.to_vec()),
                    &["phase"],
                )
                .expect(STATIC_DEFINITION),
            ),
        };
        for phase in RestartPhase::ALL {
            restarts.phase_seconds.with_label_values(&[phase.as_str()]);
        }
        restarts
    }

    /// Every local rank of a restarted attempt stepped.
    pub(super) fn timed(&self, cost: &RestartCost) {
        for (phase, took) in &cost.phases {
            self.phase_seconds
                .with_label_values(&[phase.as_str()])
                .observe(took.as_secs_f64());
        }
    }
}
