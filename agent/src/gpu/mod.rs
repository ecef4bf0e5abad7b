//! GPU pre-flight: checks every local GPU through NVML (and CUDA in a child process) before any
//! rank starts, so a bad GPU costs seconds and names the node to cordon instead of an hour of
//! the whole gang's time.
//!
//! # Layout
//! - [`snapshot`]: plain structs of what NVML said, with "not supported" distinct from "lost".
//! - [`nvml`]: the nvml-wrapper adapter that fills a snapshot (NVML absent = a "no driver"
//!   outcome, never a crash); `fabric` holds its single raw NVML call.
//! - [`checks`]: pure rules from a snapshot to pass/warn/fail/skip per check per GPU.
//! - [`report`]: the verdict, the `topo -m` matrix, text and JSON output, and the compact
//!   [`Summary`] a node publishes in its rendezvous registration.
//! - [`cuda`]: the cudarc smoke test, run as `muster gpu-check --cuda-smoke-child`.
//! - [`release`]: before a restart, the bounded wait until the previous attempt's compute
//!   processes and memory are gone from the local GPUs (else the node is unhealthy).
//! - [`gate`]: what the launch does with it: `--gpu-check off|warn|require`
//!   ([`gate::for_launch`], called by [`crate::app`] before the first round; its verdict goes into
//!   the gang registration through `GangRendezvous::set_gpu_verdict`), and the gang-wide
//!   fail-fast decision over every node's published [`Summary`] ([`gate::gang_verdict`]).
//! - [`watch`]: while the ranks train, XID events, ECC, row remaps, NVLink errors, throttling and
//!   the DCGM-style readings (utilization, memory, power, temperature) of every GPU; a fatal
//!   fault stops the node (204).
//!
//! # API for launch and metrics
//! - [`preflight`]`(&PreflightOptions) -> Report` (blocking: it samples NVLink counters and may
//!   wait for the fabric; call it from `spawn_blocking`), or [`preflight_isolated`] which runs
//!   the same as `muster gpu-check --json` in a child killed after a timeout (a GPU in a bad
//!   state can hang an NVML call; the launch should prefer this), [`Report::verdict`],
//!   [`Report::summary`] → [`Summary`] (serde) with [`Summary::message`] for the fail-fast error.
//! - [`ordered_devices`]`() -> Result<Vec<GpuInfo>, GpuError>`: GPUs sorted by PCI bus id (the
//!   order for `CUDA_VISIBLE_DEVICES`), each with UUID, NUMA node and NVML's CPU list;
//!   [`binding_cpus`] intersects such a list with the CPUs this process may use.
//! - `muster gpu-check` (in [`crate::cmd`]) prints the report for people (`--json` for machines)
//!   and exits 0 when healthy, [`crate::exit_code::UNHEALTHY_GPU`] otherwise.

pub mod checks;
mod child;
pub mod cuda;
mod fabric;
pub mod gate;
pub mod nvml;
pub mod release;
pub mod report;
pub mod snapshot;
pub mod watch;

use std::time::Duration;

pub use checks::Policy;
pub use report::{CheckResult, GpuInfo, GpuRef, Report, Status, Summary, Topology, Verdict};
pub use snapshot::NodeSnapshot;

/// Why GPU information could not be read at all.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no NVIDIA driver: cannot open {library}: {detail}")]
    NoDriver { library: String, detail: String },
    #[error("NVML did not initialise ({library}): {detail}")]
    Init { library: String, detail: String },
}

impl From<snapshot::DriverState> for GpuError {
    fn from(state: snapshot::DriverState) -> Self {
        match state {
            snapshot::DriverState::Missing { library, detail } => {
                Self::NoDriver { library, detail }
            }
            snapshot::DriverState::InitFailed { library, detail } => Self::Init { library, detail },
            snapshot::DriverState::Loaded { library, .. } => Self::Init {
                library,
                detail: "unexpected state".into(),
            },
        }
    }
}

/// What the pre-flight checks and how long it may take.
#[derive(Debug, Clone)]
pub struct PreflightOptions {
    pub policy: Policy,
    /// NVML library to load instead of the driver's; the default takes `MUSTER_NVML_LIBRARY`.
    pub nvml_library: Option<String>,
    /// Time between the two NVLink error-counter samples.
    pub sample_interval: Duration,
    /// Longest wait for an NVSwitch fabric that is still initialising.
    pub fabric_wait: Duration,
    /// Poll period during that wait.
    pub fabric_poll: Duration,
    /// Run the CUDA smoke test (child process).
    pub cuda: bool,
    pub cuda_timeout: Duration,
}

impl Default for PreflightOptions {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            nvml_library: nvml::library_override(),
            sample_interval: Duration::from_secs(1),
            fabric_wait: Duration::from_secs(60),
            fabric_poll: Duration::from_millis(500),
            cuda: true,
            cuda_timeout: Duration::from_secs(60),
        }
    }
}

impl PreflightOptions {
    /// The part of these options that the NVML snapshot takes.
    pub fn nvml_options(&self) -> nvml::Options {
        nvml::Options {
            library: self.nvml_library.clone(),
            sample_interval: self.sample_interval,
            fabric_wait: self.fabric_wait,
            fabric_poll: self.fabric_poll,
        }
    }
}

/// The text of a panic caught around the GPU libraries (nvml-wrapper and cudarc panic, rather
/// than return an error, on some load failures).
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs every check on this node's GPUs. Never fails: a missing driver, a lost GPU or an
/// unsupported query are all outcomes inside the report.
pub fn preflight(opts: &PreflightOptions) -> Report {
    let node = nvml::snapshot(&opts.nvml_options());
    let results = checks::evaluate(&node, &opts.policy);
    let mut report = Report::new(
        crate::host::name(),
        opts.policy.expected_gpus,
        &node,
        results,
    );
    let driver_loaded = matches!(node.driver, snapshot::DriverState::Loaded { .. });
    let expected = opts.policy.expected_gpus.is_some_and(|n| n > 0);
    if opts.cuda && (driver_loaded || expected) {
        let visible = node.gpus.len();
        let peers: Vec<(usize, usize)> = node
            .pairs
            .iter()
            .filter(|p| matches!(p.p2p_read, Ok(true)) || matches!(p.p2p_nvlink, Ok(true)))
            .map(|p| (p.a as usize, p.b as usize))
            .collect();
        report.push(cuda::smoke(expected, visible, &peers, opts.cuda_timeout));
    }
    report
}

/// [`preflight`] in a child process (`<this binary> gpu-check --json ...`) that is killed after
/// `timeout`, so a driver call that never returns cannot hang the agent. The child applies the
/// default thresholds of [`Policy`] (only the expectations and `foreign_processes_fail` are
/// passed on). A child that does not report in time fails the node with check `preflight`.
pub fn preflight_isolated(opts: &PreflightOptions, timeout: Duration) -> Report {
    let failed = |reason: String| {
        let check = CheckResult::node(checks::name::PREFLIGHT, Status::Fail, reason);
        Report {
            host: crate::host::name(),
            verdict: Verdict::Unhealthy,
            expected_gpus: opts.policy.expected_gpus,
            driver_version: None,
            gpus: Vec::new(),
            checks: vec![check],
            topology: Topology::default(),
        }
    };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return failed(format!("cannot find the muster binary: {e}")),
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("gpu-check").arg("--json");
    if let Some(n) = opts.policy.expected_gpus {
        cmd.arg("--expect-gpus").arg(n.to_string());
    }
    if let Some(n) = opts.policy.expected_nvlinks {
        cmd.arg("--expect-nvlinks").arg(n.to_string());
    }
    if opts.policy.foreign_processes_fail {
        cmd.arg("--fail-on-processes");
    }
    if !opts.cuda {
        cmd.arg("--skip-cuda");
    }
    cmd.arg("--sample-interval-ms")
        .arg(opts.sample_interval.as_millis().to_string())
        .arg("--fabric-wait")
        .arg(opts.fabric_wait.as_secs_f64().to_string())
        .arg("--cuda-timeout")
        .arg(opts.cuda_timeout.as_secs().max(1).to_string());
    match &opts.nvml_library {
        Some(lib) => cmd.env(nvml::LIBRARY_ENV, lib),
        None => cmd.env_remove(nvml::LIBRARY_ENV),
    };
    child::run_json(cmd, timeout, "an NVML or CUDA call did not return")
        .unwrap_or_else(|e| failed(format!("GPU pre-flight did not complete: {e}")))
}

/// GPUs the container runtime exposed to this node: the NVIDIA character devices
/// `/dev/nvidia0`, `/dev/nvidia1`, ... (`--nproc-per-node gpu`, and the count the launch's
/// pre-flight expects). Device nodes need no driver library, so the count is right even where
/// NVML cannot load.
pub fn gpu_count() -> u32 {
    let Ok(dir) = std::fs::read_dir("/dev") else {
        return 0;
    };
    dir.filter_map(Result::ok)
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| {
                n.strip_prefix("nvidia")
                    .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            })
        })
        .count() as u32
}

/// Local GPUs in PCI bus id order (the order `CUDA_DEVICE_ORDER=PCI_BUS_ID` gives, and the order
/// for `CUDA_VISIBLE_DEVICES`), with NUMA placement for `--numa-binding`.
/// Honours `MUSTER_NVML_LIBRARY` like [`preflight`].
pub fn ordered_devices() -> Result<Vec<GpuInfo>, GpuError> {
    let mut gpus = nvml::devices(nvml::library_override().as_deref())?;
    gpus.sort_by_key(|g| bus_key(g.pci_bus_id.as_deref()));
    Ok(gpus)
}

/// Sort key for a PCI bus id: (domain, bus, device, function) numerically; unknown ids last.
fn bus_key(bus_id: Option<&str>) -> (u8, Vec<u64>) {
    match bus_id {
        None => (1, Vec::new()),
        Some(id) => (
            0,
            id.split([':', '.'])
                .map(|p| u64::from_str_radix(p, 16).unwrap_or(u64::MAX))
                .collect(),
        ),
    }
}

/// The CPUs a rank bound to this GPU should run on: NVML's CPU list for the GPU intersected with
/// the CPUs this process may use (a pod's cpuset). Empty when they do not overlap or the GPU's
/// list is unknown, in which case no binding should be applied.
pub fn binding_cpus(gpu: &GpuInfo) -> Vec<u32> {
    let Ok(allowed) = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) else {
        return Vec::new();
    };
    gpu.cpu_affinity
        .iter()
        .copied()
        .filter(|cpu| allowed.is_set(*cpu as usize).unwrap_or(false))
        .collect()
}

/// Formats CPU numbers as a Linux cpulist ("0-51,104-155").
pub fn cpulist(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulist_compresses_ranges() {
        assert_eq!(cpulist(&[3, 0, 1, 2, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpulist(&[]), "");
    }

    #[test]
    fn bus_ids_sort_numerically() {
        let mut ids = vec![
            Some("00000000:DB:00.0"),
            None,
            Some("00000000:18:00.0"),
            Some("00000001:05:00.0"),
        ];
        ids.sort_by_key(|id| bus_key(*id));
        assert_eq!(
            ids,
            vec![
                Some("00000000:18:00.0"),
                Some("00000000:DB:00.0"),
                Some("00000001:05:00.0"),
                None
            ]
        );
    }

    #[test]
    fn binding_cpus_stay_inside_the_allowed_set() {
        let allowed = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
        let first = (0..1024)
            .find(|c| allowed.is_set(*c).unwrap_or(false))
            .unwrap() as u32;
        let gpu = GpuInfo {
            index: 0,
            uuid: None,
            pci_bus_id: None,
            name: None,
            numa_node: Some(0),
            cpu_affinity: vec![first, 100_000],
            nvlink_active: None,
        };
        assert_eq!(binding_cpus(&gpu), vec![first]);
    }

    #[test]
    fn isolated_preflight_without_a_report_fails_the_node() {
        // Under `cargo test` the current executable is the test harness, which prints no report:
        // the same outcome as a muster child that crashed.
        let opts = PreflightOptions {
            cuda: false,
            sample_interval: Duration::ZERO,
            ..PreflightOptions::default()
        };
        let report = preflight_isolated(&opts, Duration::from_secs(30));
        assert_eq!(report.verdict(), Verdict::Unhealthy);
        assert_eq!(report.checks.len(), 1);
        assert_eq!(report.checks[0].check, "preflight");
        assert!(
            report.checks[0]
                .reason
                .starts_with("GPU pre-flight did not complete: child exited"),
            "{}",
            report.checks[0].reason
        );
    }
}
