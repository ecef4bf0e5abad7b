//! The pre-flight rules: pure functions from a [`NodeSnapshot`] to per-check, per-GPU verdicts,
//! each with a reason a person on call can act on.
//!
//! Severity follows the policy in `docs/gpu.md`: anything that will make NCCL hang, crash
//! or silently corrupt (lost GPU, reset or reboot asked for by the driver, uncorrectable memory,
//! a pending row remap, a missing NVLink, NVLink errors growing, an untrained fabric, MIG on,
//! a narrowed PCIe link, hardware throttling at idle) fails the node; configuration that only
//! costs speed (persistence off, a capped power limit, someone else's process, mixed VBIOS) warns.
//! A query the driver does not support is skipped, never failed: an older driver or a SKU without
//! the feature is not a broken node.

use std::collections::BTreeSet;

use super::report::{CheckResult, GpuRef, Status};
use super::snapshot::{
    DriverState, FabricState, GpuSnapshot, LinkCounters, NodeSnapshot, ReadError, Reading, Remote,
};

/// Check names as they appear in reports, registrations and metrics labels.
pub mod name {
    pub const DRIVER: &str = "driver";
    pub const DEVICE_COUNT: &str = "device_count";
    pub const GPU_LOST: &str = "gpu_lost";
    pub const RECOVERY_ACTION: &str = "recovery_action";
    pub const ECC_MODE: &str = "ecc_mode";
    pub const ECC_ERRORS: &str = "ecc_errors";
    pub const ROW_REMAP: &str = "row_remap";
    pub const RETIRED_PAGES: &str = "retired_pages";
    pub const THROTTLE: &str = "throttle";
    pub const TEMPERATURE: &str = "temperature";
    pub const POWER_LIMIT: &str = "power_limit";
    pub const PCIE_WIDTH: &str = "pcie_width";
    pub const PERSISTENCE: &str = "persistence";
    pub const MIG: &str = "mig";
    pub const PROCESSES: &str = "processes";
    pub const UNIFORMITY: &str = "uniformity";
    pub const FABRIC: &str = "fabric";
    pub const NVLINK_LINKS: &str = "nvlink_links";
    pub const NVLINK_ERRORS: &str = "nvlink_errors";
    pub const NVLINK_REMOTE: &str = "nvlink_remote";
    pub const P2P: &str = "p2p";
    pub const NUMA: &str = "numa";
    pub const CUDA: &str = "cuda";
    /// The isolated pre-flight itself did not finish (see `gpu::preflight_isolated`).
    pub const PREFLIGHT: &str = "preflight";
}

/// Thresholds and expectations; the defaults follow gpu-health.md §6.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// GPUs this node must have (`--expect-gpus`, the job's GPUs per node). `None` = whatever is
    /// there, and no driver is fine.
    pub expected_gpus: Option<u32>,
    /// Active NVLinks each GPU must have. `None` = as many as the best local GPU has, so one
    /// degraded GPU stands out on any SKU without a table of SKUs.
    pub expected_nvlinks: Option<u32>,
    /// Fail (not warn) when other compute processes already use a GPU.
    pub foreign_processes_fail: bool,
    /// Warn when idle temperature is within this many °C of the slowdown threshold.
    pub temperature_margin_c: u32,
    /// Warn when volatile corrected ECC errors exceed this.
    pub corrected_ecc_warn: u64,
    /// NVLink CRC errors per second that fail a link (DCGM: 100/s).
    pub crc_fail_per_s: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            expected_gpus: None,
            expected_nvlinks: None,
            foreign_processes_fail: false,
            temperature_margin_c: 20,
            corrected_ecc_warn: 10_000,
            crc_fail_per_s: 100,
        }
    }
}

/// HW slowdown, HW thermal slowdown, HW power brake: the GPU is being slowed by hardware while
/// it should be idle (failing PSU, thermal sensor, power brake line).
const THROTTLE_HW_MASK: u64 = 0x8 | 0x40 | 0x80;
/// SW thermal slowdown: the driver is cooling a GPU that has no work.
const THROTTLE_SW_THERMAL: u64 = 0x20;
/// Uncorrectable row remaps at which the GPU is out of spare rows (DCGM's limit).
const MAX_UNCORRECTABLE_REMAPS: u64 = 512;
/// Retired pages at which DCGM fails a pre-Ampere GPU.
const MAX_RETIRED_PAGES: u64 = 63;

/// Runs every NVML check. The CUDA smoke test is added by the caller (it needs a child process).
pub fn evaluate(node: &NodeSnapshot, policy: &Policy) -> Vec<CheckResult> {
    let mut out = Vec::new();
    let expected = policy.expected_gpus.filter(|n| *n > 0);
    match &node.driver {
        DriverState::Missing { library, detail } => {
            let reason = format!(
                "no NVIDIA driver in this container: cannot open {library} ({detail}); \
                 GPU pods need the NVIDIA container runtime with NVIDIA_DRIVER_CAPABILITIES \
                 including `utility`"
            );
            out.push(driver_result(expected, &reason, Status::Skip));
            return out;
        }
        DriverState::InitFailed { library, detail } => {
            let reason = format!("{library} loaded but NVML did not initialise: {detail}");
            out.push(driver_result(expected, &reason, Status::Warn));
            return out;
        }
        DriverState::Loaded {
            library,
            driver_version,
            cuda_driver_version,
        } => {
            let version = driver_version.as_deref().unwrap_or("unknown");
            let cuda = cuda_driver_version
                .as_ref()
                .map_or_else(|_| "unknown".to_string(), |v| cuda_version(*v));
            out.push(CheckResult::node(
                name::DRIVER,
                Status::Pass,
                format!("NVIDIA driver {version} (CUDA {cuda}) via {library}"),
            ));
        }
    }

    out.push(device_count(node, expected));

    let expected_links = policy.expected_nvlinks.or_else(|| {
        node.gpus
            .iter()
            .filter_map(GpuSnapshot::active_links)
            .max()
            .filter(|n| *n > 0)
    });
    let interval_s = (node.sample_interval_ms as f64 / 1000.0).max(0.001);

    for gpu in &node.gpus {
        let id = GpuRef::of(gpu);
        if let Some(err) = lost(gpu) {
            out.push(CheckResult::gpu(
                name::GPU_LOST,
                &id,
                Status::Fail,
                format!(
                    "{err}: the GPU needs a reset or the node a power cycle (XID 79 aftermath)"
                ),
            ));
            continue;
        }
        out.push(CheckResult::gpu(
            name::GPU_LOST,
            &id,
            Status::Pass,
            "responds".into(),
        ));
        out.push(recovery_action(gpu, &id));
        out.push(ecc_mode(gpu, &id));
        out.push(ecc_errors(gpu, &id, policy));
        out.push(row_remap(gpu, &id));
        out.push(retired_pages(gpu, &id));
        out.push(throttle(gpu, &id));
        out.push(temperature(gpu, &id, policy));
        out.push(power_limit(gpu, &id));
        out.push(pcie_width(gpu, &id));
        out.push(persistence(gpu, &id));
        out.push(mig(gpu, &id));
        out.push(processes(gpu, &id, policy));
        out.push(fabric(gpu, &id, node));
        out.push(nvlink_links(gpu, &id, expected_links));
        out.push(nvlink_errors(gpu, &id, interval_s, policy));
        out.push(nvlink_remote(gpu, &id));
        out.push(p2p(gpu, &id, node));
        out.push(numa(gpu, &id));
    }
    out.push(uniformity(node));
    out
}

fn driver_result(expected: Option<u32>, reason: &str, otherwise: Status) -> CheckResult {
    match expected {
        Some(n) => CheckResult::node(
            name::DRIVER,
            Status::Fail,
            format!("{n} GPU(s) expected but {reason}"),
        ),
        None => CheckResult::node(
            name::DRIVER,
            otherwise,
            format!("{reason} (no GPUs expected)"),
        ),
    }
}

fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The first lost/reset-required reading, if any: such a GPU gets one failing line instead of
/// a screen of unreadable values.
fn lost(gpu: &GpuSnapshot) -> Option<ReadError> {
    let errors = [
        gpu.handle.as_ref().err(),
        gpu.uuid.as_ref().err(),
        gpu.pci_bus_id.as_ref().err(),
        gpu.ecc_mode.as_ref().err(),
        gpu.temperature_c.as_ref().err(),
        gpu.throttle_reasons.as_ref().err(),
        gpu.pcie_width.as_ref().err(),
        gpu.nvlinks.as_ref().err(),
    ];
    errors
        .into_iter()
        .flatten()
        .find(|e| matches!(e, ReadError::GpuLost | ReadError::ResetRequired))
        .cloned()
        .or_else(|| match &gpu.handle {
            Err(e) => Some(e.clone()),
            Ok(()) => None,
        })
}

fn device_count(node: &NodeSnapshot, expected: Option<u32>) -> CheckResult {
    match (&node.device_count, expected) {
        (Err(e), _) => CheckResult::node(
            name::DEVICE_COUNT,
            Status::Fail,
            format!("cannot count GPUs: {e}"),
        ),
        (Ok(found), Some(want)) if *found != want => CheckResult::node(
            name::DEVICE_COUNT,
            Status::Fail,
            format!(
                "{found} GPU(s) visible, {want} expected: a GPU is missing from the bus or was \
                 not allocated to this pod"
            ),
        ),
        (Ok(found), Some(_)) => CheckResult::node(
            name::DEVICE_COUNT,
            Status::Pass,
            format!("{found} GPU(s) visible, as expected"),
        ),
        (Ok(found), None) => CheckResult::node(
            name::DEVICE_COUNT,
            Status::Pass,
            format!("{found} GPU(s) visible (no expected count given)"),
        ),
    }
}

/// Skip for NotSupported, warn for any other read error: a query failing is suspicious but not
/// proof of a broken GPU.
fn unreadable(check: &'static str, id: &GpuRef, what: &str, err: &ReadError) -> CheckResult {
    match err {
        ReadError::NotSupported => CheckResult::gpu(
            check,
            id,
            Status::Skip,
            format!("{what} not supported by this GPU/driver"),
        ),
        other => CheckResult::gpu(
            check,
            id,
            Status::Warn,
            format!("cannot read {what}: {other}"),
        ),
    }
}

fn recovery_action(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::RECOVERY_ACTION;
    match &gpu.recovery_action {
        Err(e) => unreadable(c, id, "the driver's recovery action", e),
        Ok(0) => CheckResult::gpu(c, id, Status::Pass, "none".into()),
        Ok(action) => {
            let what = match action {
                1 => "a GPU reset",
                2 => "a node reboot",
                3 => "draining P2P traffic (reduced capacity)",
                4 => "draining and a GPU reset",
                _ => "an unknown recovery action",
            };
            CheckResult::gpu(
                c,
                id,
                Status::Fail,
                format!("the driver asks for {what} (recovery action {action})"),
            )
        }
    }
}

fn ecc_mode(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::ECC_MODE;
    match &gpu.ecc_mode {
        Err(e) => unreadable(c, id, "ECC mode", e),
        Ok(m) if m.current && m.pending => CheckResult::gpu(c, id, Status::Pass, "enabled".into()),
        Ok(m) if m.current != m.pending => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!(
                "ECC is {} now but {} after the next reboot",
                on_off(m.current),
                on_off(m.pending)
            ),
        ),
        Ok(_) => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            "ECC is disabled: memory errors go undetected".into(),
        ),
    }
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

fn ecc_errors(gpu: &GpuSnapshot, id: &GpuRef, policy: &Policy) -> CheckResult {
    let c = name::ECC_ERRORS;
    match (&gpu.ecc_volatile_uncorrected, &gpu.ecc_volatile_corrected) {
        (Err(e), _) => unreadable(c, id, "ECC error counts", e),
        (Ok(unc), _) if *unc > 0 => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "{unc} uncorrectable ECC error(s) since the driver loaded: memory is corrupt \
                 until the GPU is reset"
            ),
        ),
        (Ok(_), Ok(cor)) if *cor > policy.corrected_ecc_warn => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!(
                "{cor} corrected ECC errors since the driver loaded (warn above {})",
                policy.corrected_ecc_warn
            ),
        ),
        (Ok(_), Ok(cor)) => CheckResult::gpu(
            c,
            id,
            Status::Pass,
            format!("0 uncorrectable, {cor} corrected"),
        ),
        (Ok(_), Err(_)) => CheckResult::gpu(c, id, Status::Pass, "0 uncorrectable".into()),
    }
}

fn row_remap(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::ROW_REMAP;
    match &gpu.remapped_rows {
        Err(e) => unreadable(c, id, "row remapping", e),
        Ok(r) if r.failure => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            "row remapping failed: the GPU has no spare rows left (replace the GPU)".into(),
        ),
        Ok(r) if r.pending => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "a row remap is pending: reset the GPU to apply it ({} uncorrectable, {} \
                 correctable remaps so far)",
                r.uncorrectable, r.correctable
            ),
        ),
        Ok(r) if r.uncorrectable >= MAX_UNCORRECTABLE_REMAPS => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "{} uncorrectable row remaps (limit {MAX_UNCORRECTABLE_REMAPS})",
                r.uncorrectable
            ),
        ),
        Ok(r) => CheckResult::gpu(
            c,
            id,
            Status::Pass,
            format!(
                "nothing pending ({} uncorrectable, {} correctable remaps)",
                r.uncorrectable, r.correctable
            ),
        ),
    }
}

fn retired_pages(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::RETIRED_PAGES;
    match (&gpu.retired_pages_pending, &gpu.retired_pages) {
        (Err(ReadError::NotSupported), _) if gpu.remapped_rows.is_ok() => CheckResult::gpu(
            c,
            id,
            Status::Skip,
            "not used on this GPU (it remaps rows instead)".into(),
        ),
        (Err(e), _) => unreadable(c, id, "page retirement", e),
        (Ok(true), _) => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            "a page retirement is pending: reset the GPU to apply it".into(),
        ),
        (Ok(false), Ok(n)) if *n >= MAX_RETIRED_PAGES => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!("{n} retired pages (limit {MAX_RETIRED_PAGES})"),
        ),
        (Ok(false), Ok(n)) => {
            CheckResult::gpu(c, id, Status::Pass, format!("none pending, {n} retired"))
        }
        (Ok(false), Err(_)) => CheckResult::gpu(c, id, Status::Pass, "none pending".into()),
    }
}

fn throttle_names(bits: u64) -> String {
    const NAMES: [(u64, &str); 9] = [
        (0x1, "gpu_idle"),
        (0x2, "applications_clocks_setting"),
        (0x4, "sw_power_cap"),
        (0x8, "hw_slowdown"),
        (0x10, "sync_boost"),
        (0x20, "sw_thermal_slowdown"),
        (0x40, "hw_thermal_slowdown"),
        (0x80, "hw_power_brake_slowdown"),
        (0x100, "display_clock_setting"),
    ];
    let names: Vec<&str> = NAMES
        .iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| *n)
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

fn throttle(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::THROTTLE;
    match &gpu.throttle_reasons {
        Err(e) => unreadable(c, id, "clock throttle reasons", e),
        Ok(bits) if bits & THROTTLE_HW_MASK != 0 => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "hardware is slowing the clocks of an idle GPU ({}): check PSU, cooling and the \
                 power-brake signal",
                throttle_names(*bits)
            ),
        ),
        Ok(bits) if bits & THROTTLE_SW_THERMAL != 0 => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!(
                "the driver is cooling an idle GPU ({})",
                throttle_names(*bits)
            ),
        ),
        Ok(bits) => CheckResult::gpu(c, id, Status::Pass, throttle_names(*bits)),
    }
}

fn temperature(gpu: &GpuSnapshot, id: &GpuRef, policy: &Policy) -> CheckResult {
    let c = name::TEMPERATURE;
    match (&gpu.temperature_c, &gpu.slowdown_c) {
        (Err(e), _) => unreadable(c, id, "temperature", e),
        (Ok(t), Ok(slow)) if t >= slow => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!("{t} °C at idle, at or above the {slow} °C slowdown threshold"),
        ),
        (Ok(t), Ok(slow)) if t + policy.temperature_margin_c > *slow => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!(
                "{t} °C at idle, within {} °C of the {slow} °C slowdown threshold",
                policy.temperature_margin_c
            ),
        ),
        (Ok(t), Ok(slow)) => CheckResult::gpu(
            c,
            id,
            Status::Pass,
            format!("{t} °C (slowdown at {slow} °C)"),
        ),
        (Ok(t), Err(_)) => CheckResult::gpu(
            c,
            id,
            Status::Pass,
            format!("{t} °C (slowdown threshold unknown)"),
        ),
    }
}

fn power_limit(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::POWER_LIMIT;
    match (&gpu.power_limit_mw, &gpu.power_default_limit_mw) {
        (Err(e), _) | (_, Err(e)) => unreadable(c, id, "power limits", e),
        (Ok(limit), Ok(default)) if limit < default => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!(
                "power capped at {} W, below the {} W default: the GPU will run slower",
                limit / 1000,
                default / 1000
            ),
        ),
        (Ok(limit), Ok(default)) if limit != default => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!(
                "power limit {} W differs from the {} W default",
                limit / 1000,
                default / 1000
            ),
        ),
        (Ok(limit), Ok(_)) => CheckResult::gpu(
            c,
            id,
            Status::Pass,
            format!("{} W (the default)", limit / 1000),
        ),
    }
}

fn pcie_width(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::PCIE_WIDTH;
    match (&gpu.pcie_width, &gpu.pcie_max_width) {
        (Err(e), _) | (_, Err(e)) => unreadable(c, id, "PCIe link width", e),
        (Ok(w), Ok(max)) if w < max => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "PCIe link trained at x{w}, the GPU supports x{max}: reseat or replace (riser, \
                 slot or cable)"
            ),
        ),
        (Ok(w), Ok(_)) => {
            // The generation drops at idle to save power, so it is only shown, never judged.
            let generation = match (&gpu.pcie_gen, &gpu.pcie_max_gen) {
                (Ok(g), Ok(m)) => format!(", gen {g} now (max {m}; idle GPUs downshift)"),
                _ => String::new(),
            };
            CheckResult::gpu(c, id, Status::Pass, format!("x{w}{generation}"))
        }
    }
}

fn persistence(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::PERSISTENCE;
    match &gpu.persistence_mode {
        Err(e) => unreadable(c, id, "persistence mode", e),
        Ok(true) => CheckResult::gpu(c, id, Status::Pass, "enabled".into()),
        Ok(false) => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            "persistence mode is off: every CUDA start re-initialises the GPU (the node's \
             nvidia-persistenced should be running)"
                .into(),
        ),
    }
}

fn mig(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::MIG;
    match &gpu.mig {
        Err(e) => unreadable(c, id, "MIG mode", e),
        Ok(m) if m.current || m.pending => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "MIG mode is {} now and {} after reset: a partitioned GPU cannot run a whole \
                 rank",
                on_off(m.current),
                on_off(m.pending)
            ),
        ),
        Ok(_) => CheckResult::gpu(c, id, Status::Pass, "disabled".into()),
    }
}

fn processes(gpu: &GpuSnapshot, id: &GpuRef, policy: &Policy) -> CheckResult {
    let c = name::PROCESSES;
    match &gpu.processes {
        Err(e) => unreadable(c, id, "running processes", e),
        Ok(pids) if pids.is_empty() => CheckResult::gpu(c, id, Status::Pass, "none".into()),
        Ok(pids) => {
            let list: Vec<String> = pids.iter().map(u32::to_string).collect();
            let status = if policy.foreign_processes_fail {
                Status::Fail
            } else {
                Status::Warn
            };
            CheckResult::gpu(
                c,
                id,
                status,
                format!(
                    "{} compute process(es) already on the GPU (pid {})",
                    pids.len(),
                    list.join(", ")
                ),
            )
        }
    }
}

fn fabric(gpu: &GpuSnapshot, id: &GpuRef, node: &NodeSnapshot) -> CheckResult {
    let c = name::FABRIC;
    let waited = if node.fabric_waited_ms > 0 {
        format!(
            " after waiting {:.1} s",
            node.fabric_waited_ms as f64 / 1000.0
        )
    } else {
        String::new()
    };
    match &gpu.fabric {
        Err(ReadError::NotSupported) => CheckResult::gpu(
            c,
            id,
            Status::Skip,
            "no NVSwitch fabric information (not an NVSwitch system, or an older driver)".into(),
        ),
        Err(e) => unreadable(c, id, "fabric state", e),
        Ok(f) if f.state == FabricState::NotSupported => CheckResult::gpu(
            c,
            id,
            Status::Skip,
            "the GPU is not part of an NVSwitch fabric".into(),
        ),
        Ok(f) if f.state.is_initialising() => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "fabric still {}{waited} (limit {:.0} s): the fabric manager has not finished \
                 training NVSwitch routes; CUDA would fail with 'system not yet initialized'",
                if f.state == FabricState::NotStarted {
                    "not started"
                } else {
                    "initialising"
                },
                node.fabric_wait_limit_ms as f64 / 1000.0
            ),
        ),
        Ok(f) if f.state == FabricState::Completed && f.status == 0 => CheckResult::gpu(
            c,
            id,
            Status::Pass,
            format!("registered (clique {}){waited}", f.clique_id),
        ),
        Ok(f) if f.state == FabricState::Completed => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "fabric registration failed (NVML status {}): check nvidia-fabricmanager on the \
                 node",
                f.status
            ),
        ),
        Ok(f) => CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!("unknown fabric state {}", f.state.raw()),
        ),
    }
}

fn nvlink_links(gpu: &GpuSnapshot, id: &GpuRef, expected: Option<u32>) -> CheckResult {
    let c = name::NVLINK_LINKS;
    let links = match &gpu.nvlinks {
        Err(ReadError::NotSupported) => {
            return CheckResult::gpu(c, id, Status::Skip, "no NVLink on this GPU".into())
        }
        Err(e) => return unreadable(c, id, "NVLink state", e),
        Ok(l) => l,
    };
    let active = links.iter().filter(|l| l.active).count() as u32;
    let down: Vec<String> = links
        .iter()
        .filter(|l| !l.active)
        .map(|l| l.link.to_string())
        .collect();
    match expected {
        Some(want) if active < want => CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "{active} of {want} NVLinks active{}: NCCL would run degraded or hang; reset \
                 the GPU, then check the baseboard",
                if down.is_empty() {
                    String::new()
                } else {
                    format!(" (inactive: {})", down.join(", "))
                }
            ),
        ),
        Some(want) => CheckResult::gpu(c, id, Status::Pass, format!("{active} of {want} active")),
        None if active == 0 => CheckResult::gpu(
            c,
            id,
            Status::Skip,
            "no active NVLink on any GPU of this node (PCIe-only)".into(),
        ),
        None => CheckResult::gpu(c, id, Status::Pass, format!("{active} active")),
    }
}

fn delta(first: Option<u64>, second: Option<u64>) -> u64 {
    match (first, second) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => 0,
    }
}

fn nvlink_errors(gpu: &GpuSnapshot, id: &GpuRef, interval_s: f64, policy: &Policy) -> CheckResult {
    let c = name::NVLINK_ERRORS;
    let links = match &gpu.nvlinks {
        Err(ReadError::NotSupported) => {
            return CheckResult::gpu(c, id, Status::Skip, "no NVLink on this GPU".into())
        }
        Err(e) => return unreadable(c, id, "NVLink error counters", e),
        Ok(l) => l,
    };
    let mut fails = Vec::new();
    let mut warns = Vec::new();
    let mut supported = false;
    for l in links.iter().filter(|l| l.active) {
        let LinkCounters {
            replay,
            recovery,
            crc_flit,
            crc_data,
        } = l.first;
        supported |= replay.is_some() || recovery.is_some() || crc_flit.is_some();
        let replay_d = delta(replay, l.second.replay);
        let recovery_d = delta(recovery, l.second.recovery);
        let crc_d = delta(crc_flit, l.second.crc_flit) + delta(crc_data, l.second.crc_data);
        if replay_d > 0 {
            fails.push(format!("link {} replay errors +{replay_d}", l.link));
        }
        if recovery_d > 0 {
            fails.push(format!("link {} recovery errors +{recovery_d}", l.link));
        }
        if crc_d > 0 {
            let rate = crc_d as f64 / interval_s;
            let text = format!("link {} CRC errors +{crc_d} ({rate:.0}/s)", l.link);
            if rate >= policy.crc_fail_per_s as f64 {
                fails.push(text);
            } else {
                warns.push(text);
            }
        }
    }
    let window = format!("{interval_s:.1} s");
    if !fails.is_empty() {
        fails.extend(warns);
        CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "NVLink errors growing within {window}: {}; the link is flapping (reset the GPU, \
                 then suspect the baseboard)",
                fails.join("; ")
            ),
        )
    } else if !warns.is_empty() {
        CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!("NVLink CRC errors within {window}: {}", warns.join("; ")),
        )
    } else if !supported {
        CheckResult::gpu(
            c,
            id,
            Status::Skip,
            "NVLink error counters not supported by this GPU/driver".into(),
        )
    } else {
        CheckResult::gpu(
            c,
            id,
            Status::Pass,
            format!("no counter grew within {window}"),
        )
    }
}

fn nvlink_remote(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::NVLINK_REMOTE;
    let links = match &gpu.nvlinks {
        Err(ReadError::NotSupported) => {
            return CheckResult::gpu(c, id, Status::Skip, "no NVLink on this GPU".into())
        }
        Err(e) => return unreadable(c, id, "NVLink remote endpoints", e),
        Ok(l) => l,
    };
    let mut switches = BTreeSet::new();
    let mut gpus = BTreeSet::new();
    let mut other = 0;
    let mut unknown = 0;
    for l in links.iter().filter(|l| l.active) {
        match &l.remote {
            Ok(Remote::Switch { bus_id }) => {
                switches.insert(bus_id.clone());
            }
            Ok(Remote::Gpu { index, .. }) => {
                gpus.insert(*index);
            }
            Ok(Remote::Other { .. }) => other += 1,
            Err(_) => unknown += 1,
        }
    }
    let mut parts = Vec::new();
    if !switches.is_empty() {
        parts.push(format!("{} NVSwitch(es)", switches.len()));
    }
    if !gpus.is_empty() {
        let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
        parts.push(format!("GPU {}", list.join(", ")));
    }
    if other > 0 {
        parts.push(format!(
            "{other} link(s) to a device this container cannot see"
        ));
    }
    if unknown > 0 {
        parts.push(format!("{unknown} link(s) with an unreadable endpoint"));
    }
    if parts.is_empty() {
        return CheckResult::gpu(c, id, Status::Skip, "no active NVLink".into());
    }
    // Links to both switches and GPUs mean the baseboard is wired in a way NCCL does not expect.
    let status = if !switches.is_empty() && (!gpus.is_empty() || other > 0) {
        Status::Warn
    } else {
        Status::Pass
    };
    CheckResult::gpu(c, id, status, format!("links to {}", parts.join(" and ")))
}

fn p2p(gpu: &GpuSnapshot, id: &GpuRef, node: &NodeSnapshot) -> CheckResult {
    let c = name::P2P;
    let has_nvlink = |i: u32| {
        node.gpus
            .iter()
            .find(|g| g.index == i)
            .and_then(GpuSnapshot::active_links)
            .is_some_and(|n| n > 0)
    };
    let mut no_nvlink = Vec::new();
    let mut no_p2p = Vec::new();
    let mut peers = 0;
    for pair in node
        .pairs
        .iter()
        .filter(|p| p.a == gpu.index || p.b == gpu.index)
    {
        let other = if pair.a == gpu.index { pair.b } else { pair.a };
        // A lost peer already has its own failing line; it says nothing about this GPU.
        if node
            .gpus
            .iter()
            .find(|g| g.index == other)
            .is_some_and(|g| lost(g).is_some())
        {
            continue;
        }
        peers += 1;
        if has_nvlink(gpu.index) && has_nvlink(other) {
            if !matches!(pair.p2p_nvlink, Ok(true)) {
                no_nvlink.push(other.to_string());
            }
        } else if !matches!(pair.p2p_read, Ok(true)) {
            no_p2p.push(other.to_string());
        }
    }
    if peers == 0 {
        return CheckResult::gpu(c, id, Status::Skip, "no other GPU on this node".into());
    }
    if !no_nvlink.is_empty() {
        CheckResult::gpu(
            c,
            id,
            Status::Fail,
            format!(
                "no NVLink P2P to GPU {} although both ends have active NVLinks",
                no_nvlink.join(", ")
            ),
        )
    } else if !no_p2p.is_empty() {
        CheckResult::gpu(
            c,
            id,
            Status::Warn,
            format!(
                "no PCIe P2P to GPU {}: NCCL falls back to host memory",
                no_p2p.join(", ")
            ),
        )
    } else {
        CheckResult::gpu(c, id, Status::Pass, format!("OK with all {peers} peer(s)"))
    }
}

fn numa(gpu: &GpuSnapshot, id: &GpuRef) -> CheckResult {
    let c = name::NUMA;
    let cpus = gpu
        .cpu_affinity
        .as_ref()
        .map(|c| super::cpulist(c))
        .unwrap_or_default();
    match (gpu.numa_node, cpus.is_empty()) {
        (Some(n), false) => CheckResult::gpu(c, id, Status::Pass, format!("node {n}, CPUs {cpus}")),
        (Some(n), true) => CheckResult::gpu(c, id, Status::Pass, format!("node {n}")),
        (None, false) => {
            CheckResult::gpu(c, id, Status::Pass, format!("node unknown, CPUs {cpus}"))
        }
        (None, true) => CheckResult::gpu(
            c,
            id,
            Status::Skip,
            "NUMA placement unknown (NUMA binding will not be applied)".into(),
        ),
    }
}

fn uniformity(node: &NodeSnapshot) -> CheckResult {
    let c = name::UNIFORMITY;
    let reachable: Vec<&GpuSnapshot> = node.gpus.iter().filter(|g| lost(g).is_none()).collect();
    if reachable.len() < 2 {
        return CheckResult::node(c, Status::Skip, "fewer than 2 GPUs to compare".into());
    }
    let mut differ = Vec::new();
    let mut compare = |what: &str, values: Vec<String>| {
        let set: BTreeSet<&String> = values.iter().collect();
        if set.len() > 1 {
            let list: Vec<&str> = set.iter().map(|s| s.as_str()).collect();
            differ.push(format!("{what} ({})", list.join(" / ")));
        }
    };
    let text = |r: &Reading<String>| r.clone().unwrap_or_else(|e| format!("<{e}>"));
    compare("model", reachable.iter().map(|g| text(&g.name)).collect());
    compare(
        "VBIOS",
        reachable.iter().map(|g| text(&g.vbios_version)).collect(),
    );
    compare(
        "compute capability",
        reachable
            .iter()
            .map(|g| match g.compute_capability {
                Ok((a, b)) => format!("{a}.{b}"),
                Err(ref e) => format!("<{e}>"),
            })
            .collect(),
    );
    compare(
        "memory size",
        reachable
            .iter()
            .map(|g| match g.memory_total_bytes {
                Ok(b) => format!("{} MiB", b >> 20),
                Err(ref e) => format!("<{e}>"),
            })
            .collect(),
    );
    if differ.is_empty() {
        let model = reachable
            .first()
            .map_or_else(String::new, |g| text(&g.name));
        CheckResult::node(
            c,
            Status::Pass,
            format!("{} × {model}, same VBIOS", reachable.len()),
        )
    } else {
        CheckResult::node(
            c,
            Status::Warn,
            format!("local GPUs differ in {}", differ.join(", ")),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::report::{Report, Verdict};
    use super::super::snapshot::{
        EccMode, Fabric, LinkSnapshot, MigMode, PairSnapshot, PcieLevel, RemappedRows,
    };
    use super::*;

    fn healthy_gpu(index: u32) -> GpuSnapshot {
        let links = (0..18)
            .map(|l| LinkSnapshot {
                link: l,
                active: true,
                remote: Ok(Remote::Switch {
                    bus_id: format!("00000000:0{}:00.0", 5 + l % 4),
                }),
                first: LinkCounters {
                    replay: Some(0),
                    recovery: Some(0),
                    crc_flit: Some(0),
                    crc_data: Some(0),
                },
                second: LinkCounters {
                    replay: Some(0),
                    recovery: Some(0),
                    crc_flit: Some(0),
                    crc_data: Some(0),
                },
            })
            .collect();
        GpuSnapshot {
            index,
            handle: Ok(()),
            uuid: Ok(format!("GPU-{index}")),
            pci_bus_id: Ok(format!("00000000:{:02X}:00.0", 0x18 + index)),
            name: Ok("NVIDIA H100 80GB HBM3".into()),
            architecture: Ok("Hopper".into()),
            vbios_version: Ok("96.00.89.00.01".into()),
            compute_capability: Ok((9, 0)),
            memory_total_bytes: Ok(85_520_809_984),
            recovery_action: Ok(0),
            ecc_mode: Ok(EccMode {
                current: true,
                pending: true,
            }),
            ecc_volatile_uncorrected: Ok(0),
            ecc_volatile_corrected: Ok(0),
            remapped_rows: Ok(RemappedRows {
                correctable: 0,
                uncorrectable: 0,
                pending: false,
                failure: false,
            }),
            retired_pages_pending: Err(ReadError::NotSupported),
            retired_pages: Err(ReadError::NotSupported),
            throttle_reasons: Ok(0x1),
            temperature_c: Ok(31),
            slowdown_c: Ok(89),
            power_limit_mw: Ok(700_000),
            power_default_limit_mw: Ok(700_000),
            pcie_width: Ok(16),
            pcie_max_width: Ok(16),
            pcie_gen: Ok(1),
            pcie_max_gen: Ok(5),
            persistence_mode: Ok(true),
            mig: Ok(MigMode {
                current: false,
                pending: false,
            }),
            processes: Ok(vec![]),
            fabric: Ok(Fabric {
                state: FabricState::Completed,
                status: 0,
                clique_id: 1,
            }),
            nvlinks: Ok(links),
            numa_node: Some(index / 4),
            cpu_affinity: Ok(vec![0, 1, 2, 3]),
        }
    }

    fn node(gpus: Vec<GpuSnapshot>) -> NodeSnapshot {
        let mut pairs = Vec::new();
        for a in 0..gpus.len() as u32 {
            for b in a + 1..gpus.len() as u32 {
                pairs.push(PairSnapshot {
                    a,
                    b,
                    p2p_nvlink: Ok(true),
                    p2p_read: Ok(true),
                    pcie: Ok(PcieLevel::System),
                });
            }
        }
        NodeSnapshot {
            driver: DriverState::Loaded {
                library: "libnvidia-ml.so.1".into(),
                driver_version: Ok("550.90.07".into()),
                cuda_driver_version: Ok(12040),
            },
            device_count: Ok(gpus.len() as u32),
            gpus,
            pairs,
            sample_interval_ms: 1000,
            fabric_waited_ms: 0,
            fabric_wait_limit_ms: 60_000,
        }
    }

    fn eight() -> Vec<GpuSnapshot> {
        (0..8).map(healthy_gpu).collect()
    }

    fn policy(expected: u32) -> Policy {
        Policy {
            expected_gpus: Some(expected),
            ..Policy::default()
        }
    }

    /// The failing (check, gpu index) pairs.
    fn failures(results: &[CheckResult]) -> Vec<(String, Option<u32>)> {
        results
            .iter()
            .filter(|r| r.status == Status::Fail)
            .map(|r| (r.check.clone(), r.gpu.as_ref().map(|g| g.index)))
            .collect()
    }

    fn find<'a>(results: &'a [CheckResult], check: &str, gpu: u32) -> &'a CheckResult {
        results
            .iter()
            .find(|r| r.check == check && r.gpu.as_ref().map(|g| g.index) == Some(gpu))
            .unwrap_or_else(|| panic!("no {check} result for GPU {gpu}"))
    }

    #[test]
    fn healthy_node_passes_everything() {
        let results = evaluate(&node(eight()), &policy(8));
        assert_eq!(failures(&results), vec![]);
        assert!(
            results.iter().all(|r| r.status != Status::Warn),
            "{results:#?}"
        );
        // 2 node-level checks first, one block of 19 per GPU, uniformity last.
        assert_eq!(results.len(), 2 + 8 * 19 + 1);
        assert_eq!(Report::verdict_of(&results), Verdict::Healthy);
    }

    #[test]
    fn reports_round_trip_through_json() {
        // `preflight_isolated` reads the child's `gpu-check --json` back into a Report.
        let mut gpus = eight();
        gpus[3].mig = Ok(MigMode {
            current: true,
            pending: false,
        });
        let n = node(gpus);
        let report = Report::new("h".into(), Some(8), &n, evaluate(&n, &policy(8)));
        let text = serde_json::to_string_pretty(&report).unwrap();
        let back: Report = serde_json::from_str(&text).unwrap();
        assert_eq!(back, report);
        assert_eq!(back.verdict(), Verdict::Unhealthy);
        assert_eq!(back.topology.cells[0][1], "NV18");
    }

    #[test]
    fn missing_driver_fails_only_when_gpus_are_expected() {
        let mut n = node(vec![]);
        n.driver = DriverState::Missing {
            library: "libnvidia-ml.so.1".into(),
            detail: "cannot open shared object file".into(),
        };
        n.device_count = Ok(0);
        let expected = evaluate(&n, &policy(2));
        assert_eq!(failures(&expected), vec![("driver".into(), None)]);
        assert!(expected[0].reason.contains("2 GPU(s) expected"));
        let none = evaluate(&n, &Policy::default());
        assert_eq!(none.len(), 1);
        assert_eq!(none[0].status, Status::Skip);
        assert!(none[0].reason.contains("no NVIDIA driver"));
    }

    #[test]
    fn count_mismatch_fails() {
        let results = evaluate(&node((0..7).map(healthy_gpu).collect()), &policy(8));
        assert_eq!(failures(&results), vec![("device_count".into(), None)]);
        assert!(results[1].reason.contains("7 GPU(s) visible, 8 expected"));
    }

    #[test]
    fn lost_gpu_gets_one_line() {
        let mut gpus = eight();
        gpus[7] = GpuSnapshot::unreachable(7, &ReadError::GpuLost);
        gpus[7].handle = Ok(());
        let results = evaluate(&node(gpus), &policy(8));
        assert_eq!(failures(&results), vec![("gpu_lost".into(), Some(7))]);
        assert_eq!(
            results
                .iter()
                .filter(|r| r.gpu.as_ref().is_some_and(|g| g.index == 7))
                .count(),
            1
        );
    }

    #[test]
    fn hardware_faults_fail_the_right_gpu() {
        let mut gpus = eight();
        gpus[1].recovery_action = Ok(1);
        gpus[2].ecc_volatile_uncorrected = Ok(2);
        gpus[3].remapped_rows = Ok(RemappedRows {
            correctable: 0,
            uncorrectable: 1,
            pending: true,
            failure: false,
        });
        gpus[4].throttle_reasons = Ok(0x1 | 0x8);
        gpus[5].mig = Ok(MigMode {
            current: true,
            pending: true,
        });
        gpus[6].pcie_width = Ok(8);
        gpus[0].temperature_c = Ok(90);
        let results = evaluate(&node(gpus), &policy(8));
        let mut f = failures(&results);
        f.sort();
        assert_eq!(
            f,
            vec![
                ("ecc_errors".into(), Some(2)),
                ("mig".into(), Some(5)),
                ("pcie_width".into(), Some(6)),
                ("recovery_action".into(), Some(1)),
                ("row_remap".into(), Some(3)),
                ("temperature".into(), Some(0)),
                ("throttle".into(), Some(4)),
            ]
        );
        assert!(find(&results, "recovery_action", 1)
            .reason
            .contains("GPU reset"));
        assert!(find(&results, "throttle", 4).reason.contains("hw_slowdown"));
        assert!(find(&results, "pcie_width", 6).reason.contains("x8"));
    }

    #[test]
    fn links_down_fail_against_the_best_local_gpu() {
        let mut gpus = eight();
        if let Ok(links) = gpus[3].nvlinks.as_mut() {
            links[5].active = false;
            links[11].active = false;
        }
        let results = evaluate(&node(gpus), &policy(8));
        assert_eq!(failures(&results), vec![("nvlink_links".into(), Some(3))]);
        let r = find(&results, "nvlink_links", 3);
        assert!(
            r.reason.contains("16 of 18") && r.reason.contains("inactive: 5, 11"),
            "{r:?}"
        );
    }

    #[test]
    fn explicit_link_expectation_catches_a_uniformly_degraded_node() {
        let mut gpus = eight();
        for g in &mut gpus {
            if let Ok(links) = g.nvlinks.as_mut() {
                links[0].active = false;
            }
        }
        let p = Policy {
            expected_nvlinks: Some(18),
            ..policy(8)
        };
        assert_eq!(
            failures(&evaluate(&node(gpus.clone()), &p)).len(),
            8,
            "every GPU has 17 of 18"
        );
        assert!(failures(&evaluate(&node(gpus), &policy(8))).is_empty());
    }

    #[test]
    fn growing_replay_counter_fails_static_counts_pass() {
        let mut gpus = eight();
        if let Ok(links) = gpus[5].nvlinks.as_mut() {
            links[7].first.replay = Some(1200);
            links[7].second.replay = Some(1240);
        }
        if let Ok(links) = gpus[2].nvlinks.as_mut() {
            links[0].first.crc_flit = Some(17);
            links[0].second.crc_flit = Some(17);
        }
        if let Ok(links) = gpus[1].nvlinks.as_mut() {
            links[0].first.crc_flit = Some(17);
            links[0].second.crc_flit = Some(20);
        }
        let results = evaluate(&node(gpus), &policy(8));
        assert_eq!(failures(&results), vec![("nvlink_errors".into(), Some(5))]);
        assert!(find(&results, "nvlink_errors", 5)
            .reason
            .contains("link 7 replay errors +40"));
        assert_eq!(find(&results, "nvlink_errors", 1).status, Status::Warn);
        assert_eq!(find(&results, "nvlink_errors", 2).status, Status::Pass);
    }

    #[test]
    fn fabric_states() {
        let mut gpus = eight();
        gpus[0].fabric = Ok(Fabric {
            state: FabricState::InProgress,
            status: 0,
            clique_id: 0,
        });
        gpus[1].fabric = Ok(Fabric {
            state: FabricState::Completed,
            status: 999,
            clique_id: 0,
        });
        gpus[2].fabric = Err(ReadError::NotSupported);
        let mut n = node(gpus);
        n.fabric_waited_ms = 2000;
        let results = evaluate(&n, &policy(8));
        let mut f = failures(&results);
        f.sort();
        assert_eq!(
            f,
            vec![("fabric".into(), Some(0)), ("fabric".into(), Some(1))]
        );
        assert!(find(&results, "fabric", 0)
            .reason
            .contains("after waiting 2.0 s"));
        assert_eq!(find(&results, "fabric", 2).status, Status::Skip);
    }

    #[test]
    fn unsupported_queries_skip_and_never_fail() {
        let mut gpus = eight();
        for g in &mut gpus {
            g.recovery_action = Err(ReadError::NotSupported);
            g.fabric = Err(ReadError::NotSupported);
            g.power_default_limit_mw = Err(ReadError::NotSupported);
            g.mig = Err(ReadError::NotSupported);
            g.remapped_rows = Err(ReadError::NotSupported);
            g.ecc_mode = Err(ReadError::NotSupported);
            g.ecc_volatile_uncorrected = Err(ReadError::NotSupported);
            g.nvlinks = Err(ReadError::NotSupported);
            g.processes = Err(ReadError::Failed("Function not found".into()));
        }
        let results = evaluate(&node(gpus), &policy(8));
        assert_eq!(failures(&results), vec![]);
        assert_eq!(find(&results, "recovery_action", 0).status, Status::Skip);
        assert_eq!(find(&results, "processes", 0).status, Status::Warn);
        assert_ne!(Report::verdict_of(&results), Verdict::Unhealthy);
    }

    #[test]
    fn configuration_drift_warns() {
        let mut gpus = eight();
        gpus[0].persistence_mode = Ok(false);
        gpus[1].power_limit_mw = Ok(500_000);
        gpus[2].processes = Ok(vec![4242]);
        gpus[3].vbios_version = Ok("96.00.61.00.01".into());
        gpus[4].temperature_c = Ok(75);
        let results = evaluate(&node(gpus), &policy(8));
        assert_eq!(failures(&results), vec![]);
        assert_eq!(find(&results, "persistence", 0).status, Status::Warn);
        assert!(find(&results, "power_limit", 1).reason.contains("500 W"));
        assert!(find(&results, "processes", 2).reason.contains("4242"));
        assert_eq!(find(&results, "temperature", 4).status, Status::Warn);
        let uni = results.last().unwrap();
        assert_eq!(
            (uni.check.as_str(), uni.status),
            ("uniformity", Status::Warn)
        );
        assert!(uni.reason.contains("VBIOS"));
        assert_eq!(Report::verdict_of(&results), Verdict::Warnings);
        let strict = Policy {
            foreign_processes_fail: true,
            ..policy(8)
        };
        assert_eq!(
            failures(&evaluate(&node(eight_with_process()), &strict)),
            vec![("processes".into(), Some(2))]
        );
    }

    fn eight_with_process() -> Vec<GpuSnapshot> {
        let mut gpus = eight();
        gpus[2].processes = Ok(vec![4242]);
        gpus
    }

    #[test]
    fn p2p_missing_between_nvlink_gpus_fails() {
        let mut n = node(eight());
        for p in &mut n.pairs {
            if (p.a, p.b) == (0, 1) {
                p.p2p_nvlink = Ok(false);
            }
        }
        let mut f = failures(&evaluate(&n, &policy(8)));
        f.sort();
        assert_eq!(f, vec![("p2p".into(), Some(0)), ("p2p".into(), Some(1))]);
    }
}
