//! What each restart cost, phase by phase ([`crate::launch::restart_timeline`]): from the end
//! of the failed attempt to every local rank's first step of the next; and what the warm
//! standbys that make a restart fast cost while they wait ([`crate::launch::standby`]).

use std::sync::{Mutex, PoisonError};

use prometheus::{Gauge, HistogramOpts, HistogramVec, IntGauge, IntGaugeVec};

use super::{Defs, STATIC_DEFINITION};
use crate::launch::restart_timeline::{RestartCost, RestartPhase};
use crate::launch::standby::Standbys;

/// A restart's phases range from a few milliseconds (a warm handover) to minutes (a round that
/// waits for a replacement pod, a large checkpoint load).
const PHASE_BUCKETS_SECONDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

pub(super) struct Restarts {
    phase_seconds: HistogramVec,
    standbys: IntGaugeVec,
    standby_resident: IntGauge,
    standby_cpu: Gauge,
    /// The last summary, for `/gangz`.
    last: Mutex<Standbys>,
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
            standbys: defs.int_gauge_vec(
                "muster_standbys",
                "This node's warm standby interpreters (--warm-restart), by state: importing (started after the attempt's first step, imports running at low priority) or ready (waiting for a restart).",
                &["state"],
            ),
            standby_resident: defs.int_gauge(
                "muster_standby_resident_bytes",
                "The resident memory of this node's ready standbys, as measured when each said ready: what --warm-restart costs the pod's memory limit.",
            ),
            standby_cpu: defs.gauge(
                "muster_standby_cpu_seconds",
                "The CPU this node's standbys spent starting and importing, every standby that became ready since the agent started.",
            ),
            last: Mutex::new(Standbys::default()),
        };
        for phase in RestartPhase::ALL {
            restarts.phase_seconds.with_label_values(&[phase.as_str()]);
        }
        for state in ["importing", "ready"] {
            restarts.standbys.with_label_values(&[state]);
        }
        restarts
    }

    /// The standbys changed.
    pub(super) fn standbys(&self, now: &Standbys) {
        self.standbys
            .with_label_values(&["importing"])
            .set(i64::from(now.importing));
        self.standbys
            .with_label_values(&["ready"])
            .set(i64::from(now.ready));
        self.standby_resident
            .set(i64::try_from(now.resident_bytes).unwrap_or(i64::MAX));
        self.standby_cpu.set(now.cpu.as_secs_f64());
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = *now;
    }

    /// `/gangz`'s line about the standbys; `None` when there are none.
    pub(super) fn standby_line(&self) -> Option<String> {
        let now = *self.last.lock().unwrap_or_else(PoisonError::into_inner);
        (now.ready + now.importing > 0).then(|| {
            format!(
                "{} warm standby(s) ready ({} MiB resident), {} importing",
                now.ready,
                now.resident_bytes >> 20,
                now.importing
            )
        })
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
