//! The GPU pre-flight's verdicts: `muster_gpu_check_healthy` per check and GPU, NVLink links up,
//! the node's verdict and how long the checks took. (The GPU watch while ranks run is
//! [`super::gpu`].)

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use prometheus::{Gauge, IntGauge, IntGaugeVec};

use super::{Defs, MAX_GPUS, MAX_GPU_CHECKS};
use crate::events::{self, PreflightResult};

/// The pre-flight's gauges.
pub(super) struct Preflight {
    check: IntGaugeVec,
    /// The check names seen so far (bounds the `check` label).
    check_names: Mutex<Vec<String>>,
    nvlink_links: IntGaugeVec,
    healthy: IntGauge,
    duration: Gauge,
}

impl Preflight {
    /// Defines the family; the node counts as healthy until a pre-flight says otherwise.
    pub(super) fn register(defs: &mut Defs) -> Self {
        let preflight = Self {
            check: defs.int_gauge_vec(
                "muster_gpu_check_healthy",
                "GPU pre-flight result per check and GPU (1 pass or warn, 0 fail).",
                &["gpu", "UUID", "check"],
            ),
            check_names: Mutex::new(Vec::new()),
            nvlink_links: defs.int_gauge_vec(
                "muster_gpu_nvlink_active_links",
                "NVLink links up per GPU, from NVML.",
                &["gpu", "UUID"],
            ),
            healthy: defs.int_gauge(
                "muster_gpu_preflight_healthy",
                "This node's GPU pre-flight verdict (1 healthy, 0 unhealthy; 1 when not run).",
            ),
            duration: defs.gauge(
                "muster_gpu_preflight_duration_seconds",
                "How long the last GPU pre-flight took.",
            ),
        };
        preflight.healthy.set(1);
        preflight
    }

    /// One pre-flight check's verdict on one GPU, or on the whole node (`gpu` `None`: exported as
    /// `gpu="node"`). `healthy` is false only for a failing check; warnings count as healthy, as
    /// they do for the gang. `check` is one of the pre-flight's fixed check names, and at most
    /// [`MAX_GPU_CHECKS`] distinct names are kept.
    pub(super) fn gpu_check(&self, gpu: Option<u32>, uuid: &str, check: &str, healthy: bool) {
        let gpu = match gpu {
            Some(index) if index >= MAX_GPUS => return,
            Some(index) => index.to_string(),
            None => "node".to_owned(),
        };
        {
            let mut names = self
                .check_names
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !names.iter().any(|n| n == check) {
                if names.len() >= MAX_GPU_CHECKS {
                    return;
                }
                names.push(check.to_owned());
            }
        }
        self.check
            .with_label_values(&[gpu.as_str(), uuid, check])
            .set(i64::from(healthy));
    }

    /// NVLink links up on one GPU.
    pub(super) fn gpu_nvlink_active_links(&self, gpu: u32, uuid: &str, links: u32) {
        if gpu >= MAX_GPUS {
            return;
        }
        self.nvlink_links
            .with_label_values(&[&gpu.to_string(), uuid])
            .set(i64::from(links));
    }

    /// The node's pre-flight verdict and how long the checks took.
    pub(super) fn gpu_preflight_finished(&self, healthy: bool, elapsed: Duration) {
        self.healthy.set(i64::from(healthy));
        self.duration.set(elapsed.as_secs_f64());
    }

    /// Records a finished pre-flight; other events are not its.
    pub(super) fn observe(&self, event: &events::Event) {
        if let events::Event::PreflightFinished { result, elapsed } = event {
            self.record(result, *elapsed);
        }
    }

    /// The GPU pre-flight's checks, per GPU and node-wide, and its verdict. A skipped check (not
    /// applicable here) is not exported.
    fn record(&self, result: &PreflightResult, elapsed: Duration) {
        use crate::gpu::report::{Status, Verdict};
        match result {
            PreflightResult::Checked(report) => {
                for check in report.checks.iter().filter(|c| c.status != Status::Skip) {
                    let healthy = check.status != Status::Fail;
                    match &check.gpu {
                        Some(gpu) => self.gpu_check(
                            Some(gpu.index),
                            gpu.uuid.as_deref().unwrap_or(""),
                            &check.check,
                            healthy,
                        ),
                        None => self.gpu_check(None, "", &check.check, healthy),
                    }
                }
                for gpu in &report.gpus {
                    if let Some(links) = gpu.nvlink_active {
                        self.gpu_nvlink_active_links(
                            gpu.index,
                            gpu.uuid.as_deref().unwrap_or(""),
                            links,
                        );
                    }
                }
                self.gpu_preflight_finished(report.verdict != Verdict::Unhealthy, elapsed);
            }
            PreflightResult::Skipped => {}
            PreflightResult::Failed => self.gpu_preflight_finished(false, elapsed),
        }
    }
}
