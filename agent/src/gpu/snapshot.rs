//! Plain data read from NVML: what the checks look at, with no handle to the driver.
//!
//! Every reading that can fail on some GPU, driver or SKU is a [`Reading`], so "the driver does
//! not support this query" ([`ReadError::NotSupported`], a skipped check) stays distinct from
//! "the GPU is gone" ([`ReadError::GpuLost`], a failed node). The adapter in [`super::nvml`]
//! fills these structs; unit tests build them by hand.

use serde::{Deserialize, Serialize};

/// Why a value could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadError {
    /// The GPU, driver or library does not offer this query (includes a symbol missing from an
    /// older `libnvidia-ml.so`). Checks that need it are skipped, never failed.
    NotSupported,
    /// NVML answered `GPU_IS_LOST`: the GPU fell off the bus (XID 79).
    GpuLost,
    /// NVML answered `RESET_REQUIRED`.
    ResetRequired,
    /// Any other error, as NVML worded it.
    Failed(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotSupported => f.write_str("not supported"),
            Self::GpuLost => f.write_str("GPU is lost (fallen off the bus)"),
            Self::ResetRequired => f.write_str("GPU requires a reset"),
            Self::Failed(msg) => f.write_str(msg),
        }
    }
}

/// One value from NVML, or why it is missing.
pub type Reading<T> = Result<T, ReadError>;

/// Whether NVML could be loaded at all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum DriverState {
    /// `libnvidia-ml.so.1` (or `MUSTER_NVML_LIBRARY`) could not be opened: no NVIDIA driver in
    /// this container.
    Missing { library: String, detail: String },
    /// The library loaded but `nvmlInit` failed (driver not loaded, no permission, ...).
    InitFailed { library: String, detail: String },
    /// NVML is up.
    Loaded {
        library: String,
        driver_version: Reading<String>,
        cuda_driver_version: Reading<i32>,
    },
}

/// Everything the pre-flight read on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSnapshot {
    pub driver: DriverState,
    /// `nvmlDeviceGetCount`; `Ok(0)` when the driver is missing.
    pub device_count: Reading<u32>,
    pub gpus: Vec<GpuSnapshot>,
    /// One entry per unordered pair `a < b` of GPUs whose handles resolved.
    pub pairs: Vec<PairSnapshot>,
    /// Time between the two NVLink error-counter samples.
    pub sample_interval_ms: u64,
    /// How long the fabric wait lasted (0 when no GPU was still initialising).
    pub fabric_waited_ms: u64,
    /// The bound on that wait.
    pub fabric_wait_limit_ms: u64,
}

/// ECC mode now and after the next reboot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EccMode {
    pub current: bool,
    pub pending: bool,
}

/// MIG mode now and after the next reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigMode {
    pub current: bool,
    pub pending: bool,
}

/// Row-remapper state (Ampere and later), from fields 142–145.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemappedRows {
    pub correctable: u64,
    pub uncorrectable: u64,
    pub pending: bool,
    pub failure: bool,
}

/// `nvmlGpuFabricState_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FabricState {
    NotSupported,
    NotStarted,
    InProgress,
    Completed,
    Unknown(u8),
}

impl FabricState {
    pub fn from_raw(raw: u8) -> Self {
        match raw {
            0 => Self::NotSupported,
            1 => Self::NotStarted,
            2 => Self::InProgress,
            3 => Self::Completed,
            other => Self::Unknown(other),
        }
    }

    /// The number NVML gave, for a message about a state muster does not know.
    pub fn raw(self) -> u8 {
        match self {
            Self::NotSupported => 0,
            Self::NotStarted => 1,
            Self::InProgress => 2,
            Self::Completed => 3,
            Self::Unknown(raw) => raw,
        }
    }

    /// Still being trained by the fabric manager: worth waiting for.
    pub fn is_initialising(self) -> bool {
        matches!(self, Self::NotStarted | Self::InProgress)
    }
}

/// NVSwitch fabric registration of one GPU (Hopper and later on NVSwitch systems).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fabric {
    pub state: FabricState,
    /// An `nvmlReturn_t`: 0 when registration succeeded.
    pub status: u32,
    pub clique_id: u32,
}

/// NVLink error counters of one link at one instant; `None` = not supported on this link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkCounters {
    pub replay: Option<u64>,
    pub recovery: Option<u64>,
    pub crc_flit: Option<u64>,
    pub crc_data: Option<u64>,
}

/// What is at the far end of an NVLink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Remote {
    /// Another GPU of this node (direct NVLink, no switch).
    Gpu { index: u32, bus_id: String },
    /// An NVSwitch (HGX baseboards).
    Switch { bus_id: String },
    /// Something else, or a GPU this container cannot see.
    Other { bus_id: String },
}

/// One NVLink of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkSnapshot {
    pub link: u32,
    pub active: bool,
    pub remote: Reading<Remote>,
    /// Counters at the first and the second sample (taken `sample_interval_ms` apart).
    pub first: LinkCounters,
    pub second: LinkCounters,
}

/// Everything read about one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSnapshot {
    /// NVML index (NVML orders by PCI bus id).
    pub index: u32,
    /// `nvmlDeviceGetHandleByIndex`; when it failed every other reading holds the same error.
    pub handle: Reading<()>,
    pub uuid: Reading<String>,
    pub pci_bus_id: Reading<String>,
    pub name: Reading<String>,
    pub architecture: Reading<String>,
    pub vbios_version: Reading<String>,
    pub compute_capability: Reading<(i32, i32)>,
    pub memory_total_bytes: Reading<u64>,
    /// Field 230: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset.
    pub recovery_action: Reading<u32>,
    pub ecc_mode: Reading<EccMode>,
    pub ecc_volatile_uncorrected: Reading<u64>,
    pub ecc_volatile_corrected: Reading<u64>,
    pub remapped_rows: Reading<RemappedRows>,
    pub retired_pages_pending: Reading<bool>,
    pub retired_pages: Reading<u64>,
    /// `NVML_CLOCKS_EVENT_REASON_*` bits.
    pub throttle_reasons: Reading<u64>,
    pub temperature_c: Reading<u32>,
    pub slowdown_c: Reading<u32>,
    pub power_limit_mw: Reading<u32>,
    pub power_default_limit_mw: Reading<u32>,
    pub pcie_width: Reading<u32>,
    pub pcie_max_width: Reading<u32>,
    pub pcie_gen: Reading<u32>,
    pub pcie_max_gen: Reading<u32>,
    pub persistence_mode: Reading<bool>,
    pub mig: Reading<MigMode>,
    /// PIDs of compute processes already on the GPU.
    pub processes: Reading<Vec<u32>>,
    pub fabric: Reading<Fabric>,
    /// Links whose state NVML reports; `Err(NotSupported)` = no NVLink on this GPU.
    pub nvlinks: Reading<Vec<LinkSnapshot>>,
    pub numa_node: Option<u32>,
    /// CPUs NVML calls ideal for this GPU (`nvmlDeviceGetCpuAffinity`).
    pub cpu_affinity: Reading<Vec<u32>>,
}

impl GpuSnapshot {
    /// A snapshot whose every reading is `err`, for a GPU whose handle could not be obtained.
    pub fn unreachable(index: u32, err: &ReadError) -> Self {
        fn e<T>(err: &ReadError) -> Reading<T> {
            Err(err.clone())
        }
        Self {
            index,
            handle: e(err),
            uuid: e(err),
            pci_bus_id: e(err),
            name: e(err),
            architecture: e(err),
            vbios_version: e(err),
            compute_capability: e(err),
            memory_total_bytes: e(err),
            recovery_action: e(err),
            ecc_mode: e(err),
            ecc_volatile_uncorrected: e(err),
            ecc_volatile_corrected: e(err),
            remapped_rows: e(err),
            retired_pages_pending: e(err),
            retired_pages: e(err),
            throttle_reasons: e(err),
            temperature_c: e(err),
            slowdown_c: e(err),
            power_limit_mw: e(err),
            power_default_limit_mw: e(err),
            pcie_width: e(err),
            pcie_max_width: e(err),
            pcie_gen: e(err),
            pcie_max_gen: e(err),
            persistence_mode: e(err),
            mig: e(err),
            processes: e(err),
            fabric: e(err),
            nvlinks: e(err),
            numa_node: None,
            cpu_affinity: e(err),
        }
    }

    /// Active NVLink count, or `None` when the GPU has no NVLink or it could not be read.
    pub fn active_links(&self) -> Option<u32> {
        self.nvlinks
            .as_ref()
            .ok()
            .map(|links| links.iter().filter(|l| l.active).count() as u32)
    }
}

/// PCIe distance between two GPUs, as `nvmlDeviceGetTopologyCommonAncestor` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PcieLevel {
    /// Same board (e.g. dual-GPU cards).
    Internal,
    /// One PCIe switch: `PIX`.
    Single,
    /// Several switches, no host bridge: `PXB`.
    Multiple,
    /// Through the CPU's host bridge: `PHB`.
    HostBridge,
    /// Across host bridges of one NUMA node: `NODE`.
    Node,
    /// Across the inter-socket link: `SYS`.
    System,
}

impl PcieLevel {
    /// The label `nvidia-smi topo -m` prints.
    pub fn label(self) -> &'static str {
        match self {
            Self::Internal => "INT",
            Self::Single => "PIX",
            Self::Multiple => "PXB",
            Self::HostBridge => "PHB",
            Self::Node => "NODE",
            Self::System => "SYS",
        }
    }
}

/// What NVML says about one pair of GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairSnapshot {
    pub a: u32,
    pub b: u32,
    /// `nvmlDeviceGetP2PStatus(.., NVLINK)` == OK.
    pub p2p_nvlink: Reading<bool>,
    /// `nvmlDeviceGetP2PStatus(.., READ)` == OK (any transport).
    pub p2p_read: Reading<bool>,
    pub pcie: Reading<PcieLevel>,
}
