//! What one look at the GPUs gave ([`GpuSample`]), the events a change between two looks means
//! ([`changes`]), and how an event reads in a log line or a summary. Pure: no NVML here, so the
//! rules are unit-tested on hand-made samples.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::xid;

/// `NVML_CLOCKS_EVENT_REASON_HW_SLOWDOWN`: the hardware slowed the clocks (power brake, thermal,
/// or an external signal).
pub const THROTTLE_HW_SLOWDOWN: u64 = 0x8;
/// `NVML_CLOCKS_EVENT_REASON_HW_THERMAL_SLOWDOWN`: the GPU or its memory is too hot.
pub const THROTTLE_HW_THERMAL: u64 = 0x40;
/// `NVML_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN`: the power brake (an external signal from
/// the chassis) was asserted.
pub const THROTTLE_HW_POWER_BRAKE: u64 = 0x80;
/// The throttle reasons the watch reports: the ones that mean the hardware is in trouble (a
/// power cap or an idle GPU is normal operation).
pub const WATCHED_THROTTLE: [(u64, &str); 3] = [
    (THROTTLE_HW_SLOWDOWN, "hw_slowdown"),
    (THROTTLE_HW_THERMAL, "hw_thermal_slowdown"),
    (THROTTLE_HW_POWER_BRAKE, "hw_power_brake_slowdown"),
];

/// The names of the watched throttle reasons set in `bits` (`hw_slowdown`, ...).
pub fn throttle_names(bits: u64) -> Vec<&'static str> {
    WATCHED_THROTTLE
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, name)| *name)
        .collect()
}

/// Which GPU: the NVML index and the two names that outlive a renumbering.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuId {
    pub index: u32,
    pub uuid: Option<String>,
    pub pci_bus_id: Option<String>,
}

impl fmt::Display for GpuId {
    /// `GPU 3 (GPU-…, 00000000:1B:00.0)`, as the pre-flight names GPUs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GPU {} ({}, {})",
            self.index,
            self.uuid.as_deref().unwrap_or("uuid unknown"),
            self.pci_bus_id.as_deref().unwrap_or("bus id unknown")
        )
    }
}

/// Cumulative NVLink error counters of one GPU, summed over its active links (NVML counts them
/// since the driver loaded, so only growth means something happened).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NvLinkErrors {
    pub replay: u64,
    pub recovery: u64,
    pub crc_flit: u64,
    pub crc_data: u64,
}

/// One GPU at one moment. `None`: the query is not supported there (or failed), which is not an
/// event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuSample {
    pub gpu: GpuId,
    /// NVML answered GPU_IS_LOST (or "reset required") to the health queries.
    pub lost: bool,
    /// Fraction of the last sample period in which a kernel ran, 0–1.
    pub utilization_ratio: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub power_watts: Option<f64>,
    pub temperature_celsius: Option<u32>,
    /// `NVML_CLOCKS_EVENT_REASON_*` bits.
    pub throttle_reasons: Option<u64>,
    /// SM clock now and its maximum, in MHz: how much a throttle reason costs.
    pub sm_clock_mhz: Option<u32>,
    pub sm_clock_max_mhz: Option<u32>,
    /// Volatile (since the driver loaded) uncorrectable ECC errors: double-bit errors.
    pub ecc_volatile_uncorrected: Option<u64>,
    pub row_remap_pending: Option<bool>,
    /// Field 230 `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`: 0 none, else what the driver says the GPU
    /// needs (1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset).
    pub recovery_action: Option<u32>,
    pub nvlink: Option<NvLinkErrors>,
}

/// Every GPU of the node at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeSample {
    pub at: Option<SystemTime>,
    pub gpus: Vec<GpuSample>,
}

/// What happened to a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// An XID the driver delivered through NVML's event set.
    Xid(u64),
    /// An XID event whose number NVML did not give.
    XidUnknown,
    /// NVML's double-bit ECC event.
    DoubleBitEcc,
    /// The volatile uncorrectable ECC count rose by `new` to `total`.
    EccUncorrected { new: u64, total: u64 },
    /// A row remap became pending (it applies at the next GPU reset).
    RowRemapPending,
    /// NVLink error counters rose by these amounts since the last look.
    NvLinkErrors {
        replay: u64,
        recovery: u64,
        crc: u64,
    },
    /// Watched throttle reasons (bits of [`WATCHED_THROTTLE`]) newly set.
    Throttled(u64),
    /// The driver's recovery action went from none to this value.
    RecoveryAction(u32),
    /// The GPU stopped answering (fell off the bus, or needs a reset).
    Lost,
}

impl EventKind {
    /// Whether this makes the node unhealthy: a fatal XID ([`xid::FATAL`]), a GPU lost during
    /// the run, or a recovery action that asks for a reset or reboot.
    pub fn is_fatal(&self) -> bool {
        match self {
            EventKind::Xid(n) => xid::is_fatal(*n),
            EventKind::Lost | EventKind::RecoveryAction(_) => true,
            _ => false,
        }
    }

    /// The value of the `xid` label this event counts under, if it is an XID.
    pub fn xid(&self) -> Option<u64> {
        match self {
            EventKind::Xid(n) => Some(*n),
            _ => None,
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventKind::Xid(n) => match xid::describe(*n) {
                Some(what) => write!(f, "XID {n} ({what})"),
                None => write!(f, "XID {n}"),
            },
            EventKind::XidUnknown => write!(f, "XID (number not reported)"),
            EventKind::DoubleBitEcc => write!(f, "double-bit ECC error event"),
            EventKind::EccUncorrected { new, total } => write!(
                f,
                "{new} new uncorrectable ECC error(s) ({total} since the driver loaded)"
            ),
            EventKind::RowRemapPending => {
                write!(f, "row remap pending (applies at the next GPU reset)")
            }
            EventKind::NvLinkErrors {
                replay,
                recovery,
                crc,
            } => write!(
                f,
                "NVLink errors: +{replay} replay, +{recovery} recovery, +{crc} CRC"
            ),
            EventKind::Throttled(bits) => {
                write!(f, "clocks throttled: {}", throttle_names(*bits).join(", "))
            }
            EventKind::RecoveryAction(action) => write!(
                f,
                "driver recovery action {action} ({})",
                recovery_action_name(*action)
            ),
            EventKind::Lost => write!(f, "GPU lost (NVML: GPU is lost or needs a reset)"),
        }
    }
}

/// `nvmlDeviceGpuRecoveryAction_t` names.
fn recovery_action_name(action: u32) -> &'static str {
    match action {
        0 => "none",
        1 => "GPU reset",
        2 => "node reboot",
        3 => "drain P2P",
        4 => "drain and reset",
        _ => "unknown",
    }
}

/// One event on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuEvent {
    pub gpu: GpuId,
    pub at: SystemTime,
    pub kind: EventKind,
}

impl GpuEvent {
    pub fn is_fatal(&self) -> bool {
        self.kind.is_fatal()
    }

    /// The summary's line for this event, relative to when a rank stopped: "GPU 3 (uuid, bus
    /// id): XID 79 (GPU has fallen off the bus) at 12:03:11 UTC, 4 s before rank 27 stopped".
    pub fn before(&self, rank: u32, stopped: SystemTime) -> String {
        let relation = match stopped.duration_since(self.at) {
            Ok(d) => format!("{} before rank {rank} stopped", seconds(d)),
            Err(e) => format!("{} after rank {rank} stopped", seconds(e.duration())),
        };
        format!("{self}, {relation}")
    }
}

impl fmt::Display for GpuEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} at {}", self.gpu, self.kind, clock_utc(self.at))
    }
}

/// "4 s", "0.3 s", "2 min 5 s".
fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{s:.1} s")
    } else if s < 120.0 {
        format!("{} s", s.round() as u64)
    } else {
        let whole = s.round() as u64;
        format!("{} min {} s", whole / 60, whole % 60)
    }
}

/// `12:03:11 UTC`.
pub fn clock_utc(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    )
}

/// The events the change from `prev` to `next` (the same GPU, one poll apart) means. Only
/// changes count: a GPU that was already lost, throttled or short of a remap when the watch
/// started is the pre-flight's business, not a fault that happened during the run.
pub fn changes(prev: &GpuSample, next: &GpuSample) -> Vec<EventKind> {
    let mut out = Vec::new();
    if next.lost {
        if !prev.lost {
            out.push(EventKind::Lost);
        }
        // A lost GPU's other readings are absent, not zero: nothing else to compare.
        return out;
    }
    if let (Some(a), Some(b)) = (prev.ecc_volatile_uncorrected, next.ecc_volatile_uncorrected) {
        if b > a {
            out.push(EventKind::EccUncorrected {
                new: b - a,
                total: b,
            });
        }
    }
    if prev.row_remap_pending == Some(false) && next.row_remap_pending == Some(true) {
        out.push(EventKind::RowRemapPending);
    }
    if let (Some(0), Some(action)) = (prev.recovery_action, next.recovery_action) {
        if action != 0 {
            out.push(EventKind::RecoveryAction(action));
        }
    }
    if let (Some(a), Some(b)) = (prev.nvlink, next.nvlink) {
        let replay = b.replay.saturating_sub(a.replay);
        let recovery = b.recovery.saturating_sub(a.recovery);
        let crc = b.crc_flit.saturating_sub(a.crc_flit) + b.crc_data.saturating_sub(a.crc_data);
        // DCGM's rule: any replay or recovery is a fault of the link; CRC errors alone are
        // routine at low rates (they are in the metrics, not in the log every interval).
        if replay + recovery > 0 {
            out.push(EventKind::NvLinkErrors {
                replay,
                recovery,
                crc,
            });
        }
    }
    if let (Some(a), Some(b)) = (prev.throttle_reasons, next.throttle_reasons) {
        let watched = WATCHED_THROTTLE.iter().fold(0, |m, (bit, _)| m | bit);
        let newly = b & !a & watched;
        if newly != 0 {
            out.push(EventKind::Throttled(newly));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32) -> GpuSample {
        GpuSample {
            gpu: GpuId {
                index,
                uuid: Some(format!("GPU-{index}")),
                pci_bus_id: Some("00000000:1B:00.0".into()),
            },
            ecc_volatile_uncorrected: Some(0),
            row_remap_pending: Some(false),
            recovery_action: Some(0),
            throttle_reasons: Some(0x1),
            nvlink: Some(NvLinkErrors::default()),
            ..GpuSample::default()
        }
    }

    #[test]
    fn an_unchanged_gpu_has_no_events() {
        assert!(changes(&gpu(0), &gpu(0)).is_empty());
    }

    #[test]
    fn rising_counters_and_new_states_are_events() {
        let before = gpu(2);
        let mut after = gpu(2);
        after.ecc_volatile_uncorrected = Some(3);
        after.row_remap_pending = Some(true);
        after.throttle_reasons = Some(0x1 | THROTTLE_HW_THERMAL | 0x4);
        after.nvlink = Some(NvLinkErrors {
            replay: 40,
            recovery: 0,
            crc_flit: 2,
            crc_data: 1,
        });
        let events = changes(&before, &after);
        assert_eq!(
            events,
            vec![
                EventKind::EccUncorrected { new: 3, total: 3 },
                EventKind::RowRemapPending,
                EventKind::NvLinkErrors {
                    replay: 40,
                    recovery: 0,
                    crc: 3
                },
                EventKind::Throttled(THROTTLE_HW_THERMAL),
            ]
        );
        assert!(events.iter().all(|e| !e.is_fatal()));
        assert_eq!(
            events[3].to_string(),
            "clocks throttled: hw_thermal_slowdown"
        );
    }

    #[test]
    fn a_state_present_at_the_start_is_not_an_event() {
        let mut before = gpu(1);
        before.lost = true;
        let mut after = before.clone();
        after.ecc_volatile_uncorrected = Some(9);
        assert!(changes(&before, &after).is_empty());
        let mut throttled = gpu(1);
        throttled.throttle_reasons = Some(THROTTLE_HW_SLOWDOWN);
        assert!(changes(&throttled, &throttled.clone()).is_empty());
        // A reading that was unavailable is no baseline.
        let mut unknown = gpu(1);
        unknown.ecc_volatile_uncorrected = None;
        unknown.row_remap_pending = None;
        let mut later = gpu(1);
        later.ecc_volatile_uncorrected = Some(5);
        later.row_remap_pending = Some(true);
        assert!(changes(&unknown, &later).is_empty());
    }

    #[test]
    fn nvlink_crc_errors_alone_are_no_event() {
        let mut after = gpu(0);
        after.nvlink = Some(NvLinkErrors {
            crc_flit: 7,
            ..NvLinkErrors::default()
        });
        assert!(changes(&gpu(0), &after).is_empty());
    }

    #[test]
    fn losing_a_gpu_or_a_recovery_action_is_fatal() {
        let mut lost = gpu(3);
        lost.lost = true;
        assert_eq!(changes(&gpu(3), &lost), vec![EventKind::Lost]);
        assert!(EventKind::Lost.is_fatal());
        let mut reset = gpu(3);
        reset.recovery_action = Some(1);
        let events = changes(&gpu(3), &reset);
        assert_eq!(events, vec![EventKind::RecoveryAction(1)]);
        assert!(events[0].is_fatal());
        assert_eq!(
            events[0].to_string(),
            "driver recovery action 1 (GPU reset)"
        );
    }

    #[test]
    fn events_read_as_the_summary_wants() {
        let at = UNIX_EPOCH + Duration::from_secs(12 * 3600 + 3 * 60 + 11);
        let event = GpuEvent {
            gpu: gpu(3).gpu,
            at,
            kind: EventKind::Xid(79),
        };
        assert!(event.is_fatal());
        assert_eq!(
            event.before(27, at + Duration::from_secs(4)),
            "GPU 3 (GPU-3, 00000000:1B:00.0): XID 79 (GPU has fallen off the bus) at 12:03:11 UTC, 4 s before rank 27 stopped"
        );
        assert!(event
            .before(1, at - Duration::from_millis(300))
            .ends_with("0.3 s after rank 1 stopped"));
        assert_eq!(seconds(Duration::from_secs(185)), "3 min 5 s");
        let unnamed = GpuEvent {
            kind: EventKind::Xid(12_345),
            ..event
        };
        assert!(unnamed.to_string().contains(": XID 12345 at "));
    }
}
