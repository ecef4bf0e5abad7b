//! The JSON fixture a fake NVML answers from, and the per-process state that changes between
//! reads (NVLink error counters that grow, fabric training that completes after K reads).
//!
//! A fixture may name a `base` fixture (a path relative to its own folder) and then only say what
//! differs: top-level keys replace the base's, `device_overrides` (`{"3": {...}}`) merge into one
//! device, `drop_devices` removes devices. Every device is `defaults` merged with its own entry, so
//! the healthy 8-GPU node is written once and each fault fixture is a few lines that name the
//! fault.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

/// A whole fake node after `base`/`defaults`/overrides have been applied.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    #[serde(default)]
    pub description: String,
    pub driver_version: String,
    pub nvml_version: String,
    pub cuda_driver_version: i32,
    pub devices: Vec<Device>,
    /// What happens during the run, in time order or not.
    #[serde(default)]
    pub timeline: Vec<Step>,
}

/// One scripted moment: `at_s` seconds after the process first called `nvmlInit_v2`, device
/// `device` raises `xid` (delivered once by `nvmlEventSetWait_v2` to a set it is registered
/// with) and/or takes `set` (deep-merged into its fixture entry, the way `device_overrides`
/// is: counters that rise, a GPU that becomes `lost`, a remap that becomes pending).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    pub at_s: f64,
    pub device: usize,
    #[serde(default)]
    pub xid: Option<u64>,
    #[serde(default)]
    pub set: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Device {
    pub uuid: String,
    pub name: String,
    pub serial: String,
    pub pci_bus_id: String,
    pub pci_device_id: u32,
    pub pci_subsystem_id: u32,
    pub minor_number: u32,
    pub vbios_version: String,
    /// NVML's `nvmlDeviceArchitecture_t` value: 7 Ampere, 9 Hopper, 10 Blackwell.
    pub architecture: u32,
    pub compute_capability: [i32; 2],
    pub memory_total_bytes: u64,
    /// Memory in use besides the listed processes' (a running job's ranks).
    pub memory_used_bytes: u64,
    /// `nvmlDeviceGetUtilizationRates`: percent of time a kernel ran / memory was accessed.
    pub utilization_gpu_percent: u32,
    pub utilization_memory_percent: u32,
    pub numa_node: u32,
    /// Ideal CPUs for this GPU as a Linux cpulist ("0-51,104-155").
    pub cpu_affinity: String,
    /// GPUs with the same value sit behind the same PCIe switch (PIX in `topo -m`).
    pub pcie_switch: u32,
    pub persistence_mode: bool,
    pub mig: Mig,
    pub ecc: Ecc,
    /// Absent = the GPU has no row remapper (pre-Ampere): NOT_SUPPORTED.
    pub remapped_rows: Option<RemappedRows>,
    /// Absent = page retirement not supported (Ampere and later use row remapping).
    pub retired_pages: Option<RetiredPages>,
    /// Field 230; absent = a driver too old to report it.
    pub recovery_action: Option<u32>,
    pub temperature_c: u32,
    pub slowdown_c: u32,
    pub shutdown_c: u32,
    pub power: Power,
    /// Names as in NVML's `NVML_CLOCKS_EVENT_REASON_*` without the prefix, lower case.
    pub throttle_reasons: Vec<String>,
    /// SM clock now and its maximum; absent = `nvmlDeviceGetClockInfo`/`nvmlDeviceGetMaxClockInfo`
    /// are NOT_SUPPORTED.
    pub clocks: Option<Clocks>,
    pub pcie: Pcie,
    /// Absent = `nvmlDeviceGetGpuFabricInfo` is NOT_SUPPORTED (no NVSwitch fabric).
    pub fabric: Option<Fabric>,
    /// Absent = no NVLink at all (every link query NOT_SUPPORTED).
    pub nvlink: Option<NvLink>,
    /// Indices of GPUs this one has no P2P path to.
    pub p2p_not_ok_with: Vec<u32>,
    pub processes: Vec<Process>,
    /// The GPU fell off the bus: its handle still resolves, every query answers GPU_IS_LOST.
    pub lost: bool,
    /// Every query answers RESET_REQUIRED.
    pub reset_required: bool,
    /// Function name → nvmlReturn_t to answer instead (e.g. `{"nvmlDeviceGetPowerUsage": 3}`).
    pub fail: BTreeMap<String, u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Mig {
    pub current: bool,
    pub pending: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Ecc {
    pub current: bool,
    pub pending: bool,
    pub volatile_corrected: u64,
    pub volatile_uncorrected: u64,
    pub aggregate_corrected: u64,
    pub aggregate_uncorrected: u64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemappedRows {
    pub correctable: u64,
    pub uncorrectable: u64,
    pub pending: bool,
    pub failure: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetiredPages {
    pub pending: bool,
    pub single_bit: u32,
    pub double_bit: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Power {
    pub usage_mw: u32,
    pub enforced_limit_mw: u32,
    pub default_limit_mw: u32,
}

/// SM clocks in MHz: a GPU the hardware slows runs well below its maximum.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Clocks {
    pub sm_mhz: u32,
    pub sm_max_mhz: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Pcie {
    pub cur_gen: u32,
    pub max_gen: u32,
    pub cur_width: u32,
    pub max_width: u32,
    pub replay_counter: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fabric {
    /// "not_supported" | "not_started" | "in_progress" | "completed".
    pub state: String,
    /// nvmlReturn_t of the fabric registration (0 = success).
    pub status: u32,
    pub clique_id: u32,
    pub cluster_uuid: String,
    /// When set, the state above is reported for this many reads and then "completed".
    pub completes_after_reads: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvLink {
    pub links: u32,
    pub version: u32,
    /// Links reported inactive.
    pub down: Vec<u32>,
    /// "switch" (HGX: every link goes to an NVSwitch) or "gpu" (direct links, see `peer_gpus`).
    pub remote: String,
    /// PCI bus ids of the NVSwitches; link `l` lands on `switch_bus_ids[l % len]`.
    pub switch_bus_ids: Vec<String>,
    /// For `remote: "gpu"`: link `l` lands on GPU `peer_gpus[l % len]`.
    pub peer_gpus: Vec<u32>,
    pub counters: Vec<Counter>,
}

/// One error counter of one link: it reads `start` the first time and grows by `per_read` on each
/// later read, so a check that samples twice sees the growth.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Counter {
    pub link: u32,
    /// "replay" | "recovery" | "crc_flit" | "crc_data".
    pub counter: String,
    pub start: u64,
    pub per_read: u64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Process {
    pub pid: u32,
    pub used_memory_bytes: u64,
    /// Seconds the process stays listed (and its memory used), counted from the first time
    /// anyone in this process asks for a process list (so a memory reading taken before that
    /// does not start the clock); absent: listed forever.
    pub listed_for_s: Option<f64>,
}

/// Reads a fixture file, resolving `base` chains and overrides, and checks it against [`Node`].
pub fn load(path: &Path) -> Result<Node, String> {
    load_with_devices(path).map(|(node, _)| node)
}

/// [`load`], plus every device's merged JSON entry: the starting point a timeline `set` merges
/// into before the device is read again.
pub fn load_with_devices(path: &Path) -> Result<(Node, Vec<Value>), String> {
    let value = load_value(path, 0)?;
    let value = expand_devices(value)?;
    let raw = value
        .get("devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let node: Node =
        serde_json::from_value(value).map_err(|e| format!("{}: {e}", path.display()))?;
    if let Some(step) = node
        .timeline
        .iter()
        .find(|s| s.device >= node.devices.len())
    {
        return Err(format!(
            "{}: timeline step at {} s names device {}, which does not exist",
            path.display(),
            step.at_s,
            step.device
        ));
    }
    // A `set` must give a device the fixture format accepts.
    for step in &node.timeline {
        if let Some(patch) = &step.set {
            apply(&raw[step.device], patch).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    Ok((node, raw))
}

/// `device` with `patch` deep-merged into it, read as a [`Device`].
pub fn apply(device: &Value, patch: &Value) -> Result<(Value, Device), String> {
    let mut merged = device.clone();
    merge(&mut merged, patch);
    let typed = serde_json::from_value(merged.clone())
        .map_err(|e| format!("timeline `set` {patch}: {e}"))?;
    Ok((merged, typed))
}

fn load_value(path: &Path, depth: u32) -> Result<Value, String> {
    if depth > 8 {
        return Err(format!("{}: `base` chain deeper than 8", path.display()));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut value: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let Some(obj) = value.as_object_mut() else {
        return Err(format!(
            "{}: the fixture must be a JSON object",
            path.display()
        ));
    };
    let Some(base) = obj.remove("base") else {
        return Ok(value);
    };
    let Some(base_name) = base.as_str() else {
        return Err(format!("{}: `base` must be a file name", path.display()));
    };
    let base_path: PathBuf = path.parent().unwrap_or(Path::new(".")).join(base_name);
    let mut merged = load_value(&base_path, depth + 1)?;
    let (Some(target), Some(overlay)) = (merged.as_object_mut(), value.as_object()) else {
        return Err(format!(
            "{}: the base must be a JSON object",
            base_path.display()
        ));
    };
    for (key, v) in overlay {
        if key == "device_overrides" {
            // Overrides accumulate along a base chain instead of replacing each other.
            let slot = target
                .entry(key.clone())
                .or_insert_with(|| Value::Object(serde_json::Map::new()));
            merge(slot, v);
        } else {
            target.insert(key.clone(), v.clone());
        }
    }
    Ok(merged)
}

/// `defaults` + each device entry + `device_overrides`, then `drop_devices`.
fn expand_devices(mut value: Value) -> Result<Value, String> {
    let Some(obj) = value.as_object_mut() else {
        return Err("the fixture must be a JSON object".into());
    };
    let defaults = obj.remove("defaults").unwrap_or(Value::Null);
    let overrides = obj.remove("device_overrides").unwrap_or(Value::Null);
    let drop = obj.remove("drop_devices").unwrap_or(Value::Null);
    let devices = obj
        .get("devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut out = Vec::with_capacity(devices.len());
    for (index, device) in devices.into_iter().enumerate() {
        let mut merged = if defaults.is_null() {
            Value::Object(serde_json::Map::new())
        } else {
            defaults.clone()
        };
        merge(&mut merged, &device);
        if let Some(ov) = overrides.get(index.to_string()) {
            merge(&mut merged, ov);
        }
        let dropped = drop
            .as_array()
            .is_some_and(|d| d.iter().any(|i| i.as_u64() == Some(index as u64)));
        if !dropped {
            out.push(merged);
        }
    }
    obj.insert("devices".into(), Value::Array(out));
    Ok(value)
}

/// Deep merge: objects merge key by key, anything else is replaced.
fn merge(target: &mut Value, overlay: &Value) {
    match (target, overlay) {
        (Value::Object(t), Value::Object(o)) => {
            for (k, v) in o {
                merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (t, o) => *t = o.clone(),
    }
}

/// Parses a Linux cpulist ("0-3,8,10-11") into CPU numbers.
pub fn parse_cpulist(list: &str) -> Result<Vec<u32>, String> {
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let parse = |s: &str| {
            s.parse::<u32>()
                .map_err(|_| format!("bad cpulist element {part:?}"))
        };
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(parse(a)?..=parse(b)?),
            None => cpus.push(parse(part)?),
        }
    }
    Ok(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_replaces_scalars_and_merges_objects() {
        let mut a = serde_json::json!({"x": 1, "o": {"a": 1, "b": 2}});
        merge(&mut a, &serde_json::json!({"x": 2, "o": {"b": 3}}));
        assert_eq!(a, serde_json::json!({"x": 2, "o": {"a": 1, "b": 3}}));
    }

    #[test]
    fn cpulist_ranges() {
        assert_eq!(parse_cpulist("0-2,5").unwrap(), vec![0, 1, 2, 5]);
        assert!(parse_cpulist("a-b").is_err());
    }

    #[test]
    fn every_committed_fixture_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/nvml");
        let mut seen = 0;
        let paths = std::fs::read_dir(&dir)
            .unwrap()
            .chain(std::fs::read_dir(dir.join("watch")).unwrap())
            .map(|e| e.unwrap().path());
        for path in paths {
            if path.extension().and_then(|e| e.to_str()) == Some("json") {
                let node = load(&path).unwrap_or_else(|e| panic!("{e}"));
                assert!(
                    !node.description.is_empty(),
                    "{} has no description",
                    path.display()
                );
                for d in &node.devices {
                    parse_cpulist(&d.cpu_affinity).unwrap();
                }
                seen += 1;
            }
        }
        assert!(seen >= 12, "expected the fixture set, found {seen}");
    }
}
