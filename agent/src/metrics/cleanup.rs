//! What a finished attempt left behind and how it was cleared away: stray processes stopped,
//! workers the kernel OOM killer took, and the wait for the GPUs before a restart.

use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec};

use super::{Defs, STATIC_DEFINITION, WAIT_BUCKETS_SECONDS};
use crate::launch::Event;

/// The cleanup's counters and the GPU release waits.
pub(super) struct Cleanup {
    /// Leftover processes of finished attempts stopped, by the signal that ended them.
    strays_stopped: IntCounterVec,
    oom_kills: IntCounterVec,
    gpu_release_wait: HistogramVec,
}

impl Cleanup {
    /// Defines the family, every signal and outcome at 0.
    pub(super) fn register(defs: &mut Defs) -> Self {
        let cleanup = Self {
            strays_stopped: defs.counter_vec(
                "muster_stray_processes_stopped_total",
                "Processes a finished attempt's workers left behind, stopped with the attempt, by signal.",
                &["signal"],
            ),
            oom_kills: defs.counter_vec(
                "muster_worker_oom_kills_total",
                "Workers killed by the kernel OOM killer (SIGKILL while the container's memory cgroup counted an OOM kill).",
                &[],
            ),
            gpu_release_wait: defs.register(
                HistogramVec::new(
                    HistogramOpts::new(
                        "muster_gpu_release_wait_seconds",
                        "Waits before a restart for the previous attempt's GPU processes and memory to go, by outcome.",
                    )
                    .buckets(WAIT_BUCKETS_SECONDS.to_vec()),
                    &["outcome"],
                )
                .expect(STATIC_DEFINITION),
            ),
        };
        for signal in ["SIGTERM", "SIGKILL"] {
            cleanup.strays_stopped.with_label_values(&[signal]);
        }
        // Zero from the start, so a rate() sees the first kill.
        cleanup.oom_kills.with_label_values::<&str>(&[]);
        for outcome in ["released", "timeout"] {
            cleanup.gpu_release_wait.with_label_values(&[outcome]);
        }
        cleanup
    }

    /// An attempt's leftover processes were stopped: `count` of them, `killed` with SIGKILL.
    pub(super) fn strays_stopped(&self, count: u32, killed: u32) {
        let killed = killed.min(count);
        let c = &self.strays_stopped;
        c.with_label_values(&["SIGTERM"])
            .inc_by(u64::from(count - killed));
        c.with_label_values(&["SIGKILL"]).inc_by(u64::from(killed));
    }

    /// A worker was killed by the kernel OOM killer.
    pub(super) fn worker_oom_killed(&self) {
        self.oom_kills.with_label_values::<&str>(&[]).inc();
    }

    /// A restart waited `waited` for the GPUs; `released`: false when it gave up (exit 204).
    pub(super) fn gpu_release_waited(&self, waited: Duration, released: bool) {
        let outcome = if released { "released" } else { "timeout" };
        self.gpu_release_wait
            .with_label_values(&[outcome])
            .observe(waited.as_secs_f64());
    }

    /// Records the loop's cleanup events (strays stopped, OOM kill, GPU release wait); others
    /// are not its.
    pub(super) fn observe(&self, event: &Event) {
        match event {
            Event::StraysStopped { count, killed, .. } => self.strays_stopped(*count, *killed),
            Event::WorkerOomKilled { .. } => self.worker_oom_killed(),
            Event::GpuReleaseWaited {
                waited, released, ..
            } => self.gpu_release_waited(*waited, *released),
            _ => {}
        }
    }
}
