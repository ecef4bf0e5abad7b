//! The NVML adapter: loads NVML through nvml-wrapper and fills a [`NodeSnapshot`].
//!
//! Loading: `MUSTER_NVML_LIBRARY` names the library to `dlopen` (the fake in CI), otherwise
//! nvml-wrapper's default `libnvidia-ml.so.1`. A missing library is a [`DriverState::Missing`]
//! outcome, never an error: the binary must run on machines with no NVIDIA software.
//!
//! nvml-wrapper resolves every symbol at load time but reports a missing one only when it is
//! called (`FailedToLoadSymbol`); that, and `NotSupported`, become [`ReadError::NotSupported`]
//! so a check is skipped instead of failing a node. Its `Drop` calls `nvmlShutdown` through an
//! `expect`, so the whole session runs inside `catch_unwind`: a library that lacks it yields an
//! "NVML init failed" outcome, not a crashed agent.
//!
//! Timing: NVLink error counters are read twice, `sample_interval` apart (they are cumulative
//! since driver load, so only growth means trouble), and GPUs whose fabric is still initialising
//! are polled until it completes or `fabric_wait` runs out.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::{Duration, Instant};

use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, P2pCapabilitiesIndex, P2pStatus, RetirementCause, TemperatureSensor,
    TemperatureThreshold, TopologyLevel,
};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::FieldValueSample;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};

use super::snapshot::{
    DriverState, EccMode, GpuSnapshot, LinkCounters, LinkSnapshot, MigMode, NodeSnapshot,
    PairSnapshot, PcieLevel, ReadError, Reading, RemappedRows, Remote,
};

/// Environment variable naming the NVML library to load instead of the driver's.
pub const LIBRARY_ENV: &str = "MUSTER_NVML_LIBRARY";
/// What nvml-wrapper opens when no path is given (its `LIB_PATH` on Linux).
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// NVML's `NVML_NVLINK_MAX_LINKS`: 18 on Hopper; links past the GPU's count answer an error.
const MAX_NVLINKS: u32 = 18;
/// Words of CPU mask to ask for: 16 × 64 = 1024 CPUs.
const CPU_MASK_WORDS: usize = 16;
/// `NVML_AFFINITY_SCOPE_NODE`.
const AFFINITY_SCOPE_NODE: u32 = 0;

/// Field IDs (nvml.h): row remapper counters and the driver's recovery action.
const FI_REMAPPED_COR: u32 = 142;
const FI_REMAPPED_UNC: u32 = 143;
const FI_REMAPPED_PENDING: u32 = 144;
const FI_REMAPPED_FAILURE: u32 = 145;
const FI_GET_GPU_RECOVERY_ACTION: u32 = 230;

/// How the snapshot is taken.
#[derive(Debug, Clone)]
pub struct Options {
    /// Library to `dlopen` instead of the driver's (see [`library_override`]).
    pub library: Option<String>,
    pub sample_interval: Duration,
    pub fabric_wait: Duration,
    pub fabric_poll: Duration,
}

/// `MUSTER_NVML_LIBRARY`, when set and not empty.
pub fn library_override() -> Option<String> {
    std::env::var(LIBRARY_ENV).ok().filter(|p| !p.is_empty())
}

/// Device nodes through which NVML reaches a GPU: the NVIDIA kernel driver's control node, or
/// WSL2's paravirtualised GPU. NVML opens one of them in `nvmlInit`, so without either it cannot
/// initialise.
const DRIVER_NODES: [&str; 2] = ["/dev/nvidiactl", "/dev/dxg"];

/// Initialises NVML from `library`, or from the driver's default library.
///
/// The default library is not even looked for on a machine with no GPU device node: a `dlopen`
/// of an absent library walks every directory of the search path with its hardware-capability
/// subdirectories (about a hundred failed opens), on a thread of its own per caller, and with
/// thousands of agents starting on a few CPUs that was 5 % of each agent's start.
fn open(library: Option<&str>) -> Result<Nvml, DriverState> {
    let name = library.unwrap_or(DEFAULT_LIBRARY).to_string();
    if library.is_none() {
        if let Some(detail) = no_driver_node(Path::exists) {
            return Err(DriverState::Missing {
                library: name,
                detail,
            });
        }
    }
    let result = match library {
        Some(path) => Nvml::builder().lib_path(OsStr::new(path)).init(),
        None => Nvml::init(),
    };
    result.map_err(|e| match e {
        NvmlError::LibloadingError(err) => DriverState::Missing {
            library: name,
            detail: err.to_string(),
        },
        other => DriverState::InitFailed {
            library: name,
            detail: other.to_string(),
        },
    })
}

/// Whether NVML could find a GPU here: `library` overrides the driver's, or a GPU device node
/// exists. Optional readers (the watch, the release wait) ask before they spend a thread on it.
pub fn may_reach_gpus(library: Option<&str>) -> bool {
    library.is_some() || no_driver_node(Path::exists).is_none()
}

/// Why NVML cannot reach a GPU here, when none of [`DRIVER_NODES`] `exists`.
fn no_driver_node(exists: impl Fn(&Path) -> bool) -> Option<String> {
    if DRIVER_NODES.iter().any(|node| exists(Path::new(node))) {
        return None;
    }
    Some(format!(
        "no {}: no GPU device is given to this container",
        DRIVER_NODES.join(" or ")
    ))
}

/// Maps nvml-wrapper's errors onto what the checks distinguish.
fn read<T>(result: Result<T, NvmlError>) -> Reading<T> {
    result.map_err(|e| classify(&e))
}

fn classify(e: &NvmlError) -> ReadError {
    match e {
        NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_) => ReadError::NotSupported,
        NvmlError::GpuLost => ReadError::GpuLost,
        NvmlError::ResetRequired => ReadError::ResetRequired,
        other => ReadError::Failed(other.to_string()),
    }
}

/// Runs `f` with an initialised NVML, catching panics from nvml-wrapper (its `Drop` `expect`s
/// `nvmlShutdown`). `Err` carries the driver state when NVML is unusable.
pub fn with_nvml<T>(
    library: Option<&str>,
    f: impl FnOnce(&Nvml, &str) -> T,
) -> Result<T, DriverState> {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let nvml = open(library)?;
        Ok(f(&nvml, library.unwrap_or(DEFAULT_LIBRARY)))
    }));
    match outcome {
        Ok(result) => result,
        Err(panic) => {
            let msg = super::panic_message(panic.as_ref());
            Err(DriverState::InitFailed {
                library: library.unwrap_or(DEFAULT_LIBRARY).to_string(),
                detail: format!("nvml-wrapper panicked: {msg}"),
            })
        }
    }
}

/// Takes the whole node snapshot. Never fails: every problem is recorded in the snapshot.
pub fn snapshot(opts: &Options) -> NodeSnapshot {
    let empty = |driver: DriverState| NodeSnapshot {
        driver,
        device_count: Ok(0),
        gpus: Vec::new(),
        pairs: Vec::new(),
        sample_interval_ms: 0,
        fabric_waited_ms: 0,
        fabric_wait_limit_ms: opts.fabric_wait.as_millis() as u64,
    };
    match with_nvml(opts.library.as_deref(), |nvml, library| {
        collect(nvml, library, opts)
    }) {
        Ok(node) => node,
        Err(driver) => empty(driver),
    }
}

fn collect(nvml: &Nvml, library: &str, opts: &Options) -> NodeSnapshot {
    let driver = DriverState::Loaded {
        library: library.to_string(),
        driver_version: read(nvml.sys_driver_version()),
        cuda_driver_version: read(nvml.sys_cuda_driver_version()),
    };
    let device_count = read(nvml.device_count());
    let count = device_count.as_ref().copied().unwrap_or(0);
    let devices: Vec<Reading<Device<'_>>> =
        (0..count).map(|i| read(nvml.device_by_index(i))).collect();
    let bus_ids: HashMap<String, u32> = devices
        .iter()
        .enumerate()
        .filter_map(|(i, d)| {
            let d = d.as_ref().ok()?;
            Some((normalise_bus_id(&d.pci_info().ok()?.bus_id), i as u32))
        })
        .collect();

    let mut gpus: Vec<GpuSnapshot> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| match d {
            Ok(device) => gpu(nvml, device, i as u32, &bus_ids),
            Err(e) => GpuSnapshot::unreachable(i as u32, e),
        })
        .collect();

    // Second NVLink sample, after the interval, on the links that were active.
    let any_links = gpus.iter().any(|g| g.active_links().unwrap_or(0) > 0);
    let sample_started = Instant::now();
    if any_links {
        std::thread::sleep(opts.sample_interval);
    }
    let sample_interval_ms = if any_links {
        sample_started.elapsed().as_millis() as u64
    } else {
        0
    };
    for (g, d) in gpus.iter_mut().zip(&devices) {
        let (Ok(device), Ok(links)) = (d, g.nvlinks.as_mut()) else {
            continue;
        };
        for l in links.iter_mut().filter(|l| l.active) {
            l.second = counters(device, l.link);
        }
    }

    let fabric_waited_ms = wait_for_fabric(nvml, &devices, &mut gpus, opts);

    let mut pairs = Vec::new();
    for a in 0..devices.len() {
        for b in a + 1..devices.len() {
            if let (Ok(da), Ok(db)) = (&devices[a], &devices[b]) {
                pairs.push(pair(nvml, da, db, a as u32, b as u32));
            }
        }
    }

    NodeSnapshot {
        driver,
        device_count,
        gpus,
        pairs,
        sample_interval_ms,
        fabric_waited_ms,
        fabric_wait_limit_ms: opts.fabric_wait.as_millis() as u64,
    }
}

/// Polls the fabric state of GPUs still initialising until all are done or the wait runs out.
/// Returns how long it waited.
fn wait_for_fabric(
    nvml: &Nvml,
    devices: &[Reading<Device<'_>>],
    gpus: &mut [GpuSnapshot],
    opts: &Options,
) -> u64 {
    let initialising = |gpus: &[GpuSnapshot]| {
        gpus.iter()
            .any(|g| g.fabric.as_ref().is_ok_and(|f| f.state.is_initialising()))
    };
    if !initialising(gpus) {
        return 0;
    }
    let started = Instant::now();
    while initialising(gpus) && started.elapsed() < opts.fabric_wait {
        let left = opts.fabric_wait.saturating_sub(started.elapsed());
        std::thread::sleep(opts.fabric_poll.min(left));
        for (g, d) in gpus.iter_mut().zip(devices) {
            let Ok(device) = d else { continue };
            if g.fabric.as_ref().is_ok_and(|f| f.state.is_initialising()) {
                g.fabric = read(super::fabric::read(nvml, device));
            }
        }
    }
    started.elapsed().as_millis() as u64
}

/// `00000000:18:00.0` and `0000:18:00.0` name the same device; compare in one form.
fn normalise_bus_id(bus_id: &str) -> String {
    let lower = bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) => {
            let domain = u32::from_str_radix(domain, 16).unwrap_or(0);
            format!("{domain:04x}:{rest}")
        }
        None => lower,
    }
}

/// One field value as a number. A driver that predates a field ID answers that field with
/// INVALID_ARGUMENT, which means "not supported here", not a faulty GPU.
pub(crate) fn field_u64(sample: Option<&Result<FieldValueSample, NvmlError>>) -> Reading<u64> {
    let field_error = |e: &NvmlError| match e {
        NvmlError::InvalidArg => ReadError::NotSupported,
        other => classify(other),
    };
    let sample = match sample {
        Some(Ok(s)) => s,
        Some(Err(e)) => return Err(field_error(e)),
        None => return Err(ReadError::NotSupported),
    };
    match &sample.value {
        Ok(SampleValue::U32(v)) => Ok(u64::from(*v)),
        Ok(SampleValue::U64(v)) => Ok(*v),
        Ok(SampleValue::I64(v)) => Ok((*v).max(0) as u64),
        Ok(SampleValue::F64(v)) => Ok(v.max(0.0) as u64),
        Err(e) => Err(field_error(e)),
    }
}

fn gpu(nvml: &Nvml, d: &Device<'_>, index: u32, bus_ids: &HashMap<String, u32>) -> GpuSnapshot {
    let fields = d.field_values_for(&[
        FieldId(FI_REMAPPED_COR),
        FieldId(FI_REMAPPED_UNC),
        FieldId(FI_REMAPPED_PENDING),
        FieldId(FI_REMAPPED_FAILURE),
        FieldId(FI_GET_GPU_RECOVERY_ACTION),
    ]);
    let (remapped_rows, recovery_action) = match &fields {
        Ok(values) => {
            let remap = (|| {
                Ok(RemappedRows {
                    correctable: field_u64(values.first())?,
                    uncorrectable: field_u64(values.get(1))?,
                    pending: field_u64(values.get(2))? != 0,
                    failure: field_u64(values.get(3))? != 0,
                })
            })();
            let action = field_u64(values.get(4)).map(|v| v as u32);
            (remap, action)
        }
        Err(e) => (Err(classify(e)), Err(classify(e))),
    };

    let pci = read(d.pci_info());
    GpuSnapshot {
        index,
        handle: Ok(()),
        uuid: read(d.uuid()),
        pci_bus_id: pci.as_ref().map(|p| p.bus_id.clone()).map_err(Clone::clone),
        name: read(d.name()),
        architecture: read(d.architecture()).map(|a| a.to_string()),
        vbios_version: read(d.vbios_version()),
        compute_capability: read(d.cuda_compute_capability()).map(|c| (c.major, c.minor)),
        memory_total_bytes: read(d.memory_info()).map(|m| m.total),
        recovery_action,
        ecc_mode: read(d.is_ecc_enabled()).map(|m| EccMode {
            current: m.currently_enabled,
            pending: m.pending_enabled,
        }),
        ecc_volatile_uncorrected: read(
            d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
        ),
        ecc_volatile_corrected: read(
            d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile),
        ),
        remapped_rows,
        retired_pages_pending: read(d.are_pages_pending_retired()),
        retired_pages: read(d.retired_pages(RetirementCause::MultipleSingleBitEccErrors)).and_then(
            |single| {
                read(d.retired_pages(RetirementCause::DoubleBitEccError))
                    .map(|double| (single.len() + double.len()) as u64)
            },
        ),
        throttle_reasons: read(d.current_throttle_reasons()).map(|r| r.bits()),
        temperature_c: read(d.temperature(TemperatureSensor::Gpu)),
        slowdown_c: read(d.temperature_threshold(TemperatureThreshold::Slowdown)),
        power_limit_mw: read(d.enforced_power_limit()),
        power_default_limit_mw: read(d.power_management_limit_default()),
        pcie_width: read(d.current_pcie_link_width()),
        pcie_max_width: read(d.max_pcie_link_width()),
        pcie_gen: read(d.current_pcie_link_gen()),
        pcie_max_gen: read(d.max_pcie_link_gen()),
        persistence_mode: read(d.is_in_persistent_mode()),
        mig: read(d.mig_mode()).map(|m| MigMode {
            current: m.current != 0,
            pending: m.pending != 0,
        }),
        processes: read(d.running_compute_processes()).map(|ps| ps.iter().map(|p| p.pid).collect()),
        fabric: read(super::fabric::read(nvml, d)),
        nvlinks: links(d, bus_ids),
        numa_node: numa_node(d, pci.as_ref().ok().map(|p| p.bus_id.as_str())),
        cpu_affinity: read(d.cpu_affinity(CPU_MASK_WORDS)).map(|mask| mask_bits(&mask)),
    }
}

/// Bit numbers set in an array of C `unsigned long` words.
fn mask_bits(words: &[std::ffi::c_ulong]) -> Vec<u32> {
    let per = std::ffi::c_ulong::BITS;
    let mut bits = Vec::new();
    for (w, word) in words.iter().enumerate() {
        for b in 0..per {
            if word & (1 << b) != 0 {
                bits.push(w as u32 * per + b);
            }
        }
    }
    bits
}

/// The GPU's NUMA node: NVML's memory affinity first, else the kernel's view in sysfs (what
/// `torch.numa` reads), where `-1` means "no NUMA information".
fn numa_node(d: &Device<'_>, bus_id: Option<&str>) -> Option<u32> {
    if let Ok(mask) = d.memory_affinity(1, AFFINITY_SCOPE_NODE) {
        if let Some(node) = mask_bits(&mask).first() {
            return Some(*node);
        }
    }
    let bus = normalise_bus_id(bus_id?);
    let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{bus}/numa_node")).ok()?;
    text.trim()
        .parse::<i64>()
        .ok()
        .filter(|n| *n >= 0)
        .map(|n| n as u32)
}

fn counters(d: &Device<'_>, link: u32) -> LinkCounters {
    let l = d.link_wrapper_for(link);
    LinkCounters {
        replay: l.error_counter(ErrorCounter::DlReplay).ok(),
        recovery: l.error_counter(ErrorCounter::DlRecovery).ok(),
        crc_flit: l.error_counter(ErrorCounter::DlCrcFlit).ok(),
        crc_data: l.error_counter(ErrorCounter::DlCrcData).ok(),
    }
}

fn links(d: &Device<'_>, bus_ids: &HashMap<String, u32>) -> Reading<Vec<LinkSnapshot>> {
    let mut out = Vec::new();
    for link in 0..MAX_NVLINKS {
        let wrapper = d.link_wrapper_for(link);
        match read(wrapper.is_active()) {
            Ok(active) => {
                let remote = if active {
                    read(wrapper.remote_pci_info()).map(|pci| classify_remote(&pci, bus_ids))
                } else {
                    Err(ReadError::NotSupported)
                };
                let sample = if active {
                    counters(d, link)
                } else {
                    LinkCounters::default()
                };
                out.push(LinkSnapshot {
                    link,
                    active,
                    remote,
                    first: sample,
                    second: sample,
                });
            }
            // A lost GPU is reported as such, not as "no NVLink".
            Err(e @ (ReadError::GpuLost | ReadError::ResetRequired)) => return Err(e),
            // Links past the GPU's count answer INVALID_ARGUMENT, links a SKU lacks answer
            // NOT_SUPPORTED; either way the link does not exist for the checks.
            Err(_) => {}
        }
    }
    if out.is_empty() {
        Err(ReadError::NotSupported)
    } else {
        Ok(out)
    }
}

/// What is at the far end of a link. nvml-wrapper 0.13's `remote_device_type` always answers
/// `Unknown` (it passes a temporary to NVML and returns its own initial value), so the type is
/// inferred from the remote PCI function: a local GPU's bus id means a direct GPU link, any other
/// NVIDIA function (vendor 0x10de) on an NVLink is an NVSwitch.
fn classify_remote(
    pci: &nvml_wrapper::struct_wrappers::device::PciInfo,
    bus_ids: &HashMap<String, u32>,
) -> Remote {
    let bus_id = pci.bus_id.clone();
    if let Some(index) = bus_ids.get(&normalise_bus_id(&bus_id)) {
        return Remote::Gpu {
            index: *index,
            bus_id,
        };
    }
    if pci.pci_device_id & 0xffff == 0x10de {
        Remote::Switch { bus_id }
    } else {
        Remote::Other { bus_id }
    }
}

fn pair(nvml: &Nvml, a: &Device<'_>, b: &Device<'_>, ia: u32, ib: u32) -> PairSnapshot {
    let ok = |s: P2pStatus| s == P2pStatus::Ok;
    let pcie = read(nvml.device_by_index(ib))
        .and_then(|other| read(a.topology_common_ancestor(other)))
        .map(|level| match level {
            TopologyLevel::Internal => PcieLevel::Internal,
            TopologyLevel::Single => PcieLevel::Single,
            TopologyLevel::Multiple => PcieLevel::Multiple,
            TopologyLevel::HostBridge => PcieLevel::HostBridge,
            TopologyLevel::Node => PcieLevel::Node,
            TopologyLevel::System => PcieLevel::System,
        });
    PairSnapshot {
        a: ia,
        b: ib,
        p2p_nvlink: read(a.p2p_status(b, P2pCapabilitiesIndex::NvLink)).map(ok),
        p2p_read: read(a.p2p_status(b, P2pCapabilitiesIndex::Read)).map(ok),
        pcie,
    }
}

/// Identity and placement of every GPU, without the health checks (fast: no sampling, no wait).
pub fn devices(library: Option<&str>) -> Result<Vec<super::GpuInfo>, DriverState> {
    with_nvml(library, |nvml, _| {
        let count = nvml.device_count().unwrap_or(0);
        (0..count)
            .filter_map(|i| {
                let d = nvml.device_by_index(i).ok()?;
                let bus_id = d.pci_info().ok().map(|p| p.bus_id);
                Some(super::GpuInfo {
                    index: i,
                    uuid: d.uuid().ok(),
                    name: d.name().ok(),
                    numa_node: numa_node(&d, bus_id.as_deref()),
                    cpu_affinity: d
                        .cpu_affinity(CPU_MASK_WORDS)
                        .map(|m| mask_bits(&m))
                        .unwrap_or_default(),
                    pci_bus_id: bus_id,
                    // Identity only: the health checks count links (`GpuInfo::of`).
                    nvlink_active: None,
                })
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_library_is_looked_for_only_where_a_gpu_device_node_is() {
        let detail = no_driver_node(|_| false).expect("no node: no driver");
        assert_eq!(
            detail,
            "no /dev/nvidiactl or /dev/dxg: no GPU device is given to this container"
        );
        assert_eq!(no_driver_node(|p| p == Path::new("/dev/nvidiactl")), None);
        assert_eq!(no_driver_node(|p| p == Path::new("/dev/dxg")), None, "WSL2");
    }

    #[test]
    fn a_missing_library_is_a_no_driver_outcome() {
        let node = snapshot(&Options {
            library: Some("/nonexistent/libnvidia-ml.so.1".into()),
            sample_interval: Duration::ZERO,
            fabric_wait: Duration::ZERO,
            fabric_poll: Duration::ZERO,
        });
        match &node.driver {
            DriverState::Missing { library, detail } => {
                assert_eq!(library, "/nonexistent/libnvidia-ml.so.1");
                assert!(
                    detail.contains("cannot open shared object file"),
                    "{detail}"
                );
            }
            other => panic!("expected Missing, got {other:?}"),
        }
        assert_eq!((node.device_count, node.gpus.len()), (Ok(0), 0));
        assert!(matches!(
            devices(Some("/nonexistent/x.so")),
            Err(DriverState::Missing { .. })
        ));
    }

    #[test]
    fn a_library_that_is_not_nvml_does_not_crash() {
        // libc has none of NVML's symbols: nvml-wrapper loads it, then finds no nvmlInit_v2.
        let node = snapshot(&Options {
            library: Some("libc.so.6".into()),
            sample_interval: Duration::ZERO,
            fabric_wait: Duration::ZERO,
            fabric_poll: Duration::ZERO,
        });
        assert!(
            matches!(node.driver, DriverState::InitFailed { .. }),
            "{:?}",
            node.driver
        );
    }

    #[test]
    fn bus_ids_compare_in_one_form() {
        assert_eq!(normalise_bus_id("00000000:1A:00.0"), "0000:1a:00.0");
        assert_eq!(normalise_bus_id("0000:1a:00.0"), "0000:1a:00.0");
    }

    #[test]
    fn mask_bits_spans_words() {
        let per = std::ffi::c_ulong::BITS;
        assert_eq!(mask_bits(&[0b101, 1]), vec![0, 2, per]);
    }

    #[test]
    fn error_mapping_keeps_what_checks_need() {
        assert_eq!(
            read::<()>(Err(NvmlError::NotSupported)),
            Err(ReadError::NotSupported)
        );
        assert_eq!(
            read::<()>(Err(NvmlError::FailedToLoadSymbol("x".into()))),
            Err(ReadError::NotSupported)
        );
        assert_eq!(read::<()>(Err(NvmlError::GpuLost)), Err(ReadError::GpuLost));
        assert!(matches!(
            read::<()>(Err(NvmlError::Unknown)),
            Err(ReadError::Failed(_))
        ));
    }
}
