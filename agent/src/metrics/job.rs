//! The job and the build this agent runs: `muster_build_info`, `muster_start_time_seconds`,
//! `muster_job_info` (the one series that carries the run id).

use prometheus::IntGaugeVec;

use super::{truncate, unix_now, Defs, STORE_PROTOCOL};

/// Longest `run_id` label value kept; longer ids are cut (the label is informational).
const MAX_RUN_ID_LEN: usize = 128;

/// The job's identity series.
pub(super) struct Job {
    info: IntGaugeVec,
}

impl Job {
    /// Defines the family; the build and the start time are set once, here.
    pub(super) fn register(defs: &mut Defs) -> Self {
        let build_info = defs.int_gauge_vec(
            "muster_build_info",
            "muster build: version and the store wire protocol it speaks (always 1).",
            &["version", "protocol"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), STORE_PROTOCOL])
            .set(1);
        let start_time = defs.gauge("muster_start_time_seconds", "Unix time the agent started.");
        start_time.set(unix_now());
        Self {
            info: defs.int_gauge_vec(
                "muster_job_info",
                "The job this agent belongs to (always 1; run_id lives only here).",
                &["run_id"],
            ),
        }
    }

    /// Records the job's run id (kept out of every other series).
    pub(super) fn set_run_id(&self, run_id: &str) {
        let run_id = truncate(run_id, MAX_RUN_ID_LEN);
        self.info.reset();
        self.info.with_label_values(&[run_id]).set(1);
    }
}
