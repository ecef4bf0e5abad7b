//! The wait between attempts until the local GPUs are free of the previous one: the baseline
//! read before an attempt starts, and the wait for its release before the next one.

use super::error::LaunchError;
use super::group::WorkerGroupSpec;
use super::observe::Event;
use super::signals::StopRequest;
use super::Config;

/// How long one NVML read for the baseline may take before the agent goes on without it (a GPU
/// in a bad state can hang NVML calls; the pre-flight catches that, this must not block).
const GPU_BASELINE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Beyond `--gpu-release-timeout`, how long an NVML call that does not return is given.
const GPU_WAIT_HANG: std::time::Duration = std::time::Duration::from_secs(30);

/// The local GPUs' use before an attempt starts, when a restart may follow and the release wait
/// is on; `None` on a node without GPUs.
pub(super) async fn gpu_baseline(config: &Config) -> Option<Vec<crate::gpu::release::GpuUse>> {
    let may_restart = config.max_restarts > 0 || config.nnodes.max > 1;
    if config.gpu_release_timeout.is_zero() || !may_restart {
        return None;
    }
    let library = crate::gpu::nvml::library_override();
    if !crate::gpu::nvml::may_reach_gpus(library.as_deref()) {
        return None;
    }
    let read =
        tokio::task::spawn_blocking(move || crate::gpu::release::baseline(library.as_deref()));
    if let Ok(Ok(baseline)) = tokio::time::timeout(GPU_BASELINE_TIMEOUT, read).await {
        baseline
    } else {
        tracing::warn!(
            "NVML did not answer within {}: no GPU release wait",
            rendezvous::words::duration(GPU_BASELINE_TIMEOUT)
        );
        None
    }
}

/// Before attempt `restart_count` starts: waits, within `--gpu-release-timeout`, until the local
/// GPUs are free of the previous attempt (`pids`); a GPU still held makes the node unhealthy
/// (204), so the gang does not spend its restarts on out-of-memory failures.
pub(super) async fn wait_for_gpus(
    spec: &WorkerGroupSpec,
    baseline: Vec<crate::gpu::release::GpuUse>,
    pids: Vec<u32>,
    restart_count: u32,
    stop: &StopRequest,
) -> Result<(), LaunchError> {
    use crate::gpu::release::{wait_released, Released};
    let config = &spec.config;
    let timeout = config.gpu_release_timeout;
    let keep_strays = config.keep_strays;
    let library = crate::gpu::nvml::library_override();
    let started = tokio::time::Instant::now();
    let wait = tokio::task::spawn_blocking(move || {
        wait_released(library.as_deref(), &baseline, &pids, keep_strays, timeout)
    });
    let result = tokio::select! {
        result = tokio::time::timeout(timeout + GPU_WAIT_HANG, wait) => result,
        // The stop is handled by the loop; the blocking wait ends on its own within the bound.
        () = stop.requested() => return Ok(()),
    };
    let waited = started.elapsed();
    let released = matches!(result, Ok(Ok(Released::Yes | Released::Unreadable(_))));
    spec.publisher.event(Event::GpuReleaseWaited {
        restart_count,
        waited,
        released,
    });
    let previous = restart_count.saturating_sub(1);
    let unhealthy = |detail: String| LaunchError::GpusNotReleased {
        waited: waited.as_secs_f64(),
        previous,
        detail,
        timeout: timeout.as_secs_f64(),
    };
    match result {
        Ok(Ok(Released::Yes)) => {
            tracing::info!(
                "GPUs free of attempt {previous} after {:.1}s; starting attempt {restart_count}",
                waited.as_secs_f64()
            );
            Ok(())
        }
        Ok(Ok(Released::No(held))) => {
            let held: Vec<String> = held.iter().map(ToString::to_string).collect();
            Err(unhealthy(held.join("; ")))
        }
        Ok(Ok(Released::Unreadable(e))) => {
            tracing::warn!("cannot read the GPUs before attempt {restart_count}: {e}; not waiting");
            Ok(())
        }
        Ok(Err(e)) => Err(unhealthy(format!("the NVML reader failed: {e}"))),
        Err(_) => Err(unhealthy("an NVML call did not return".to_owned())),
    }
}
