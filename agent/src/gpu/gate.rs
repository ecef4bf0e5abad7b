//! How the launch uses the pre-flight: `--gpu-check off|warn|require`, the decision a node makes
//! about its own GPUs before it registers, and the decision every agent makes once it has seen
//! all registrations (one unhealthy node fails the whole gang fast, naming the node, GPU and
//! check).
//!
//! Kept apart from the launch code so the rules are pure and unit-tested here; the launch only
//! calls [`run`] before registering, publishes [`Summary`] in its registration, and calls
//! [`gang_verdict`] on the registrations it read back.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{preflight, preflight_isolated, PreflightOptions, Report, Summary, Verdict};
use crate::exit_code::{self, Exit};

/// `--gpu-check`: what the launch does with the pre-flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuCheck {
    /// No pre-flight (CPU jobs, dry runs): what a job that asks for no GPUs gets (see
    /// [`GpuCheck::default_for`], which the command line applies).
    #[default]
    Off,
    /// Run it and report, but start the ranks whatever it says.
    Warn,
    /// An unhealthy verdict stops this node (and, through the registration, the gang).
    Require,
}

impl GpuCheck {
    /// The default: `require` when the job asks for GPUs (`--nproc-per-node gpu`, or the device
    /// plugin gave the pod GPUs, which it announces in `NVIDIA_VISIBLE_DEVICES`), else `off`.
    pub fn default_for(nproc_is_gpu: bool, nvidia_visible_devices: Option<&str>) -> Self {
        // The container toolkit's own "no GPU" spellings.
        let allocated = nvidia_visible_devices
            .map(str::trim)
            .is_some_and(|v| !v.is_empty() && v != "void" && v != "none");
        if nproc_is_gpu || allocated {
            Self::Require
        } else {
            Self::Off
        }
    }
}

/// Longest the launch waits for the isolated pre-flight: NVLink sampling, the fabric wait, the
/// CUDA smoke test, and a margin for NVML itself.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(180);

/// The launch's pre-flight, before the first round: `--gpu-check` from the configuration, the
/// GPUs the container runtime exposed (`/dev/nvidiaN`) as the expected count, run in a child
/// that is killed after 180 s. `Err` (exit 204) only under `require`.
pub async fn for_launch(mode: GpuCheck) -> Result<Option<Report>, Exit> {
    if mode == GpuCheck::Off {
        return Ok(None);
    }
    let exposed = super::gpu_count();
    let opts = PreflightOptions {
        policy: super::Policy {
            expected_gpus: (exposed > 0).then_some(exposed),
            ..super::Policy::default()
        },
        ..PreflightOptions::default()
    };
    let report = tokio::task::spawn_blocking(move || preflight_isolated(&opts, LAUNCH_TIMEOUT))
        .await
        .map_err(|e| {
            Exit::new(
                exit_code::INTERNAL_ERROR,
                format!("GPU pre-flight task failed: {e}"),
            )
        })?;
    decide(mode, report).map(Some)
}

/// Logs what failed or warned and applies `mode` to the verdict.
fn decide(mode: GpuCheck, report: Report) -> Result<Report, Exit> {
    for check in report
        .checks
        .iter()
        .filter(|c| matches!(c.status, super::Status::Fail | super::Status::Warn))
    {
        tracing::warn!(status = check.status.label(), "gpu pre-flight: {check}");
    }
    if mode == GpuCheck::Require && report.verdict() == Verdict::Unhealthy {
        return Err(Exit::new(
            exit_code::UNHEALTHY_GPU,
            format!("GPU pre-flight failed on {}", report.summary().message()),
        ));
    }
    Ok(report)
}

/// Runs the pre-flight as `mode` says. `Ok(None)` when off; `Ok(Some(report))` when it ran and
/// the node may proceed (the report says whether it warned or, under `warn`, failed);
/// `Err` with the "unhealthy GPU" exit code when `require` found a failing check.
pub fn run(mode: GpuCheck, opts: &PreflightOptions) -> Result<Option<Report>, Exit> {
    if mode == GpuCheck::Off {
        return Ok(None);
    }
    decide(mode, preflight(opts)).map(Some)
}

/// Every node's published summary (keyed by node rank) → the error that stops the gang, naming
/// each unhealthy node with its failing GPUs and checks; `None` when all nodes may start.
/// A node that published no summary (pre-flight off there) counts as healthy.
pub fn gang_verdict(nodes: &[(u32, Option<Summary>)]) -> Option<Exit> {
    let bad: Vec<String> = nodes
        .iter()
        .filter_map(|(rank, summary)| {
            summary
                .as_ref()
                .filter(|s| s.verdict == Verdict::Unhealthy)
                .map(|s| format!("node rank {rank}, {}", s.message()))
        })
        .collect();
    if bad.is_empty() {
        None
    } else {
        Some(Exit::new(
            exit_code::UNHEALTHY_GPU,
            format!("GPU pre-flight failed: {}", bad.join(" | ")),
        ))
    }
}

/// The value for the registration's `gpu` field: the compact [`Summary`] as JSON
/// (`{"host", "verdict": "healthy"|"warnings"|"unhealthy", "failures": [{check, gpu: {index,
/// uuid, pci_bus_id}, status, reason}]}`), or `null` when the pre-flight did not run. The
/// rendezvous coordinator only needs `verdict == "unhealthy"` to keep a node out of a round.
pub fn registration_value(report: Option<&Report>) -> serde_json::Value {
    report
        .and_then(|r| serde_json::to_value(r.summary()).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// The registration value of a node whose pre-flight failed under `require` in a fixed-size
/// gang: the summary plus `fatal`, which makes node 0 end the round for every node at once
/// with the "unhealthy GPU" code and this node's message (instead of leaving the others to
/// wait for the join deadline).
pub fn fatal_registration_value(report: &Report) -> serde_json::Value {
    let mut value = registration_value(Some(report));
    if let serde_json::Value::Object(map) = &mut value {
        map.insert(
            "fatal".to_owned(),
            serde_json::json!({
                "exit_code": exit_code::UNHEALTHY_GPU,
                "message": format!("GPU pre-flight failed: {}", report.summary().message()),
            }),
        );
    }
    value
}

/// The pre-flight for a fixed-size gang: under `require` an unhealthy node does not exit
/// before joining, since the others would only learn of it at the join deadline; it joins with
/// [`fatal_registration_value`] and the whole gang exits 204 by name. Returns the report and
/// whether it is such a fatal one.
pub async fn for_gang(mode: GpuCheck) -> Result<(Option<Report>, bool), Exit> {
    if mode != GpuCheck::Require {
        return for_launch(mode).await.map(|r| (r, false));
    }
    let report = for_launch(GpuCheck::Warn).await?;
    let fatal = report
        .as_ref()
        .is_some_and(|r| r.verdict() == Verdict::Unhealthy);
    Ok((report, fatal))
}

/// [`gang_verdict`] over the raw `gpu` values read back from every registration. `null` or a
/// value that is not a summary (another muster version) counts as "no verdict".
pub fn gang_verdict_from_values(nodes: &[(u32, &serde_json::Value)]) -> Option<Exit> {
    let parsed: Vec<(u32, Option<Summary>)> = nodes
        .iter()
        .map(|(rank, value)| (*rank, serde_json::from_value((*value).clone()).ok()))
        .collect();
    gang_verdict(&parsed)
}

/// The device order for the ranks of a GPU job: `CUDA_DEVICE_ORDER=PCI_BUS_ID` and
/// `CUDA_VISIBLE_DEVICES` listing the GPUs by PCI bus id (as UUIDs), so that `cuda:LOCAL_RANK`
/// is the LOCAL_RANK-th GPU on the bus on every node — the order NVLink topology and NUMA
/// placement are read in. Nothing when the job does not ask for GPUs, when the user chose
/// `CUDA_VISIBLE_DEVICES` already, or when NVML cannot list the GPUs.
pub fn device_order_env(
    asks_gpus: bool,
    inherited: &dyn Fn(&str) -> Option<std::ffi::OsString>,
) -> Vec<(&'static str, String)> {
    if !asks_gpus || inherited("CUDA_VISIBLE_DEVICES").is_some_and(|v| !v.is_empty()) {
        return Vec::new();
    }
    let Ok(gpus) = super::ordered_devices() else {
        return Vec::new();
    };
    let uuids: Option<Vec<String>> = gpus.iter().map(|g| g.uuid.clone()).collect();
    match uuids {
        Some(uuids) if !uuids.is_empty() => vec![
            ("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_owned()),
            ("CUDA_VISIBLE_DEVICES", uuids.join(",")),
        ],
        _ => Vec::new(),
    }
}

/// `--numa-binding node`: the CPUs each local rank is pinned to — local rank `i` gets GPU `i` in
/// PCI bus order (as `cuda:LOCAL_RANK` sees them, see [`device_order_env`]), and the CPUs of its
/// NUMA node that this process may use. An error when NVML cannot list the GPUs or a rank has
/// no GPU: binding was asked for, so silently running unbound would hide a misconfiguration.
pub fn numa_binding(nproc: u32) -> Result<Vec<Vec<u32>>, String> {
    let gpus = super::ordered_devices().map_err(|e| format!("cannot list the GPUs: {e}"))?;
    if (gpus.len() as u32) < nproc {
        return Err(format!(
            "{nproc} ranks but only {} GPU(s) to bind them to",
            gpus.len()
        ));
    }
    Ok(gpus
        .iter()
        .take(nproc as usize)
        .map(super::binding_cpus)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{CheckResult, GpuRef, Policy, Status};

    #[test]
    fn the_default_follows_the_gpu_request() {
        assert_eq!(GpuCheck::default_for(true, None), GpuCheck::Require);
        assert_eq!(
            GpuCheck::default_for(false, Some("GPU-1,GPU-2")),
            GpuCheck::Require
        );
        assert_eq!(GpuCheck::default_for(false, Some("all")), GpuCheck::Require);
        assert_eq!(GpuCheck::default_for(false, Some("void")), GpuCheck::Off);
        assert_eq!(GpuCheck::default_for(false, Some("")), GpuCheck::Off);
        assert_eq!(GpuCheck::default_for(false, None), GpuCheck::Off);
    }

    fn no_driver(expected: Option<u32>) -> PreflightOptions {
        PreflightOptions {
            policy: Policy {
                expected_gpus: expected,
                ..Policy::default()
            },
            nvml_library: Some("/nonexistent/libnvidia-ml.so.1".into()),
            sample_interval: Duration::ZERO,
            fabric_wait: Duration::ZERO,
            fabric_poll: Duration::ZERO,
            cuda: false,
            cuda_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn require_stops_an_unhealthy_node_warn_does_not() {
        let err = run(GpuCheck::Require, &no_driver(Some(8))).unwrap_err();
        assert_eq!(err.code, exit_code::UNHEALTHY_GPU);
        assert!(
            err.message.contains("driver: 8 GPU(s) expected"),
            "{}",
            err.message
        );
        let report = run(GpuCheck::Warn, &no_driver(Some(8))).unwrap().unwrap();
        assert_eq!(report.verdict(), Verdict::Unhealthy);
        assert!(run(GpuCheck::Off, &no_driver(Some(8))).unwrap().is_none());
        let ok = run(GpuCheck::Require, &no_driver(None)).unwrap().unwrap();
        assert_eq!(ok.verdict(), Verdict::Healthy);
    }

    #[test]
    fn one_bad_node_fails_the_gang_by_name() {
        let healthy = Summary {
            host: "worker-0".into(),
            verdict: Verdict::Healthy,
            failures: vec![],
        };
        let bad = Summary {
            host: "worker-1".into(),
            verdict: Verdict::Unhealthy,
            failures: vec![CheckResult::gpu(
                "nvlink_links",
                &GpuRef {
                    index: 3,
                    uuid: Some("GPU-abc".into()),
                    pci_bus_id: Some("00000000:5D:00.0".into()),
                },
                Status::Fail,
                "16 of 18 NVLinks active".into(),
            )],
        };
        assert!(gang_verdict(&[(0, Some(healthy.clone())), (1, None)]).is_none());
        let err = gang_verdict(&[(0, Some(healthy)), (1, Some(bad))]).unwrap();
        assert_eq!(err.code, exit_code::UNHEALTHY_GPU);
        assert_eq!(
            err.message,
            "GPU pre-flight failed: node rank 1, node worker-1: GPU 3 (GPU-abc, \
             00000000:5D:00.0) nvlink_links: 16 of 18 NVLinks active"
        );
    }

    #[test]
    fn registration_values_carry_the_verdict() {
        assert_eq!(registration_value(None), serde_json::Value::Null);
        let report = run(GpuCheck::Warn, &no_driver(Some(8))).unwrap().unwrap();
        let value = registration_value(Some(&report));
        assert_eq!(value["verdict"], "unhealthy");
        assert_eq!(value["failures"][0]["check"], "driver");
        let healthy = registration_value(run(GpuCheck::Warn, &no_driver(None)).unwrap().as_ref());
        let garbage = serde_json::json!({"something": "else"});
        let null = serde_json::Value::Null;
        assert!(gang_verdict_from_values(&[(0, &healthy), (1, &null), (2, &garbage)]).is_none());
        let err = gang_verdict_from_values(&[(0, &healthy), (3, &value)]).unwrap();
        assert!(
            err.message
                .starts_with("GPU pre-flight failed: node rank 3, node "),
            "{}",
            err.message
        );
    }

    #[test]
    fn summaries_round_trip_through_json() {
        let s = Summary {
            host: "h".into(),
            verdict: Verdict::Warnings,
            failures: vec![],
        };
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(text, r#"{"host":"h","verdict":"warnings","failures":[]}"#);
        assert_eq!(serde_json::from_str::<Summary>(&text).unwrap(), s);
    }
}
