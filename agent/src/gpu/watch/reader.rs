//! The NVML side of the watch: one thread polls every GPU each interval and turns changes into
//! events ([`super::sample::changes`]); a second one blocks in `nvmlEventSetWait` for XID and
//! double-bit ECC events, which NVML delivers only to a registered event set, and only for faults
//! after the registration (so the watch sees exactly the faults of this run).
//!
//! Both run inside one NVML session ([`crate::gpu::nvml::with_nvml`], which catches nvml-wrapper's
//! panics), on std threads: NVML calls block, and a GPU in a bad state can make them block for a
//! long time, which must never stall the agent's runtime.

use std::time::{Duration, SystemTime};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};

use super::sample::{changes, EventKind, GpuEvent, GpuId, GpuSample, NodeSample, NvLinkErrors};
use super::{Options, Watch};
use crate::gpu::snapshot::ReadError;

/// `NVML_NVLINK_MAX_LINKS`.
const MAX_NVLINKS: u32 = 18;
/// Field IDs (nvml.h): a row remap pending, and the driver's recovery action.
const FI_REMAPPED_PENDING: u32 = 144;
const FI_GET_GPU_RECOVERY_ACTION: u32 = 230;
/// How long one event wait blocks: the bound on how late the thread notices a stop.
const EVENT_WAIT_MS: u32 = 500;
/// Granularity of the poll thread's sleep, for the same reason.
const SLEEP_STEP: Duration = Duration::from_millis(100);

/// One local GPU and what is read from it each interval.
struct Watched<'nvml> {
    id: GpuId,
    device: Device<'nvml>,
    /// Links that were active at the start; their error counters are summed.
    links: Vec<u32>,
}

pub(super) fn spawn(opts: Options, watch: Watch) {
    if !crate::gpu::nvml::may_reach_gpus(opts.library.as_deref()) {
        tracing::debug!("GPU watch off: no GPU device in this container");
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gpu-watch".into())
        .spawn(move || run(&opts, &watch));
    if let Err(e) = spawned {
        tracing::warn!("GPU watch: cannot start its thread: {e}; GPUs are not watched");
    }
}

fn run(opts: &Options, watch: &Watch) {
    let session = crate::gpu::nvml::with_nvml(opts.library.as_deref(), |nvml, _| {
        session(nvml, opts, watch);
    });
    if let Err(driver) = session {
        tracing::debug!("GPU watch off: NVML unavailable ({driver:?})");
    }
}

fn session(nvml: &Nvml, opts: &Options, watch: &Watch) {
    let count = match nvml.device_count() {
        Ok(0) => {
            tracing::debug!("GPU watch off: NVML lists no GPU");
            return;
        }
        Ok(n) => n,
        Err(e) => {
            tracing::warn!("GPU watch off: NVML cannot count the GPUs: {e}");
            return;
        }
    };
    let devices: Vec<Watched<'_>> = (0..count)
        .filter_map(|i| {
            let device = nvml.device_by_index(i).ok()?;
            let links = (0..MAX_NVLINKS)
                .filter(|l| matches!(device.link_wrapper_for(*l).is_active(), Ok(true)))
                .collect();
            Some(Watched {
                id: GpuId {
                    index: i,
                    uuid: device.uuid().ok(),
                    pci_bus_id: device.pci_info().ok().map(|p| p.bus_id),
                },
                device,
                links,
            })
        })
        .collect();
    tracing::info!(
        "GPU watch: {} GPU(s), a look every {:.1}s and XID events as they happen",
        devices.len(),
        opts.interval.as_secs_f64()
    );
    std::thread::scope(|scope| {
        let listener = std::thread::Builder::new()
            .name("gpu-events".into())
            .spawn_scoped(scope, || listen(nvml, &devices, watch));
        if let Err(e) = listener {
            tracing::warn!("GPU watch: cannot start the XID event thread: {e}; polling only");
        }
        poll(&devices, opts.interval, watch);
    });
}

/// Looks at every GPU each `interval` until the watch stops.
fn poll(devices: &[Watched<'_>], interval: Duration, watch: &Watch) {
    let mut prev: Vec<GpuSample> = devices.iter().map(sample).collect();
    watch.publish(NodeSample {
        at: Some(SystemTime::now()),
        gpus: prev.clone(),
    });
    loop {
        if !sleep_unless_stopped(interval, watch) {
            return;
        }
        let next: Vec<GpuSample> = devices.iter().map(sample).collect();
        let at = SystemTime::now();
        for (a, b) in prev.iter().zip(&next) {
            for kind in changes(a, b) {
                watch.record(GpuEvent {
                    gpu: b.gpu.clone(),
                    at,
                    kind,
                });
            }
        }
        watch.publish(NodeSample {
            at: Some(at),
            gpus: next.clone(),
        });
        prev = next;
    }
}

/// Sleeps `d` in short steps; `false` when the watch was stopped meanwhile.
fn sleep_unless_stopped(d: Duration, watch: &Watch) -> bool {
    let mut left = d;
    while !left.is_zero() {
        if watch.stopping() {
            return false;
        }
        let step = left.min(SLEEP_STEP);
        std::thread::sleep(step);
        left -= step;
    }
    !watch.stopping()
}

/// Reads that remember whether any answered "GPU lost".
#[derive(Default)]
struct Reads {
    lost: bool,
}

impl Reads {
    fn get<T>(&mut self, result: Result<T, NvmlError>) -> Option<T> {
        match result {
            Ok(v) => Some(v),
            Err(NvmlError::GpuLost | NvmlError::ResetRequired) => {
                self.lost = true;
                None
            }
            Err(_) => None,
        }
    }

    fn field(&mut self, reading: &Result<u64, ReadError>) -> Option<u64> {
        match reading {
            Ok(v) => Some(*v),
            Err(ReadError::GpuLost | ReadError::ResetRequired) => {
                self.lost = true;
                None
            }
            Err(_) => None,
        }
    }
}

/// One look at one GPU.
fn sample(w: &Watched<'_>) -> GpuSample {
    let d = &w.device;
    let mut reads = Reads::default();
    let memory = reads.get(d.memory_info());
    let (row_remap_pending, recovery_action) = match reads.get(d.field_values_for(&[
        FieldId(FI_REMAPPED_PENDING),
        FieldId(FI_GET_GPU_RECOVERY_ACTION),
    ])) {
        Some(values) => (
            reads
                .field(&crate::gpu::nvml::field_u64(values.first()))
                .map(|v| v != 0),
            reads
                .field(&crate::gpu::nvml::field_u64(values.get(1)))
                .map(|v| v as u32),
        ),
        None => (None, None),
    };
    let mut nvlink = (!w.links.is_empty()).then(NvLinkErrors::default);
    for link in &w.links {
        let l = d.link_wrapper_for(*link);
        let mut read = |counter| reads.get(l.error_counter(counter)).unwrap_or(0);
        let add = NvLinkErrors {
            replay: read(ErrorCounter::DlReplay),
            recovery: read(ErrorCounter::DlRecovery),
            crc_flit: read(ErrorCounter::DlCrcFlit),
            crc_data: read(ErrorCounter::DlCrcData),
        };
        if let Some(total) = nvlink.as_mut() {
            total.replay += add.replay;
            total.recovery += add.recovery;
            total.crc_flit += add.crc_flit;
            total.crc_data += add.crc_data;
        }
    }
    let mut s = GpuSample {
        gpu: w.id.clone(),
        lost: false,
        utilization_ratio: reads
            .get(d.utilization_rates())
            .map(|u| f64::from(u.gpu.min(100)) / 100.0),
        memory_used_bytes: memory.as_ref().map(|m| m.used),
        memory_total_bytes: memory.as_ref().map(|m| m.total),
        power_watts: reads.get(d.power_usage()).map(|mw| f64::from(mw) / 1000.0),
        temperature_celsius: reads.get(d.temperature(TemperatureSensor::Gpu)),
        throttle_reasons: reads.get(d.current_throttle_reasons()).map(|r| r.bits()),
        sm_clock_mhz: reads.get(d.clock_info(Clock::SM)),
        sm_clock_max_mhz: reads.get(d.max_clock_info(Clock::SM)),
        ecc_volatile_uncorrected: reads
            .get(d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)),
        row_remap_pending,
        recovery_action,
        nvlink,
    };
    s.lost = reads.lost;
    s
}

/// Waits for XID and double-bit ECC events until the watch stops. A GPU that does not support
/// them is skipped; if registration itself fails, XIDs are not watched and polling goes on.
fn listen(nvml: &Nvml, devices: &[Watched<'_>], watch: &Watch) {
    let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
    let mut set = match nvml.create_event_set() {
        Ok(set) => set,
        Err(e) => {
            tracing::warn!("GPU watch: no XID events (cannot create an NVML event set: {e})");
            return;
        }
    };
    let mut registered = 0;
    for w in devices {
        let types = match w.device.supported_event_types() {
            Ok(types) => types & wanted,
            Err(_) => continue,
        };
        if types.is_empty() {
            continue;
        }
        // nvml-wrapper hands the set back on success and frees it on failure.
        match w.device.register_events(types, set) {
            Ok(again) => {
                set = again;
                registered += 1;
            }
            Err(e) => {
                tracing::warn!(
                    "GPU watch: no XID events ({} refused the registration: {e}); polling only",
                    w.id
                );
                return;
            }
        }
    }
    if registered == 0 {
        tracing::info!("GPU watch: no GPU delivers XID events; polling only");
        return;
    }
    while !watch.stopping() {
        match set.wait(EVENT_WAIT_MS) {
            Ok(data) => {
                let kind = if data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    match data.event_data {
                        Some(XidError::Value(n)) => EventKind::Xid(n),
                        _ => EventKind::XidUnknown,
                    }
                } else if data.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                    EventKind::DoubleBitEcc
                } else {
                    continue;
                };
                let index = data.device.index().ok();
                let gpu = devices
                    .iter()
                    .find(|w| Some(w.id.index) == index)
                    .map_or_else(
                        || GpuId {
                            index: index.unwrap_or(u32::MAX),
                            ..GpuId::default()
                        },
                        |w| w.id.clone(),
                    );
                watch.record(GpuEvent {
                    gpu,
                    at: SystemTime::now(),
                    kind,
                });
            }
            Err(NvmlError::Timeout) => {}
            // A GPU fell off the bus: the poll names it; do not spin on the error meanwhile.
            Err(NvmlError::GpuLost) => {
                if !sleep_unless_stopped(Duration::from_secs(1), watch) {
                    return;
                }
            }
            Err(e) => {
                tracing::warn!("GPU watch: waiting for XID events failed: {e}; polling only");
                return;
            }
        }
    }
}
