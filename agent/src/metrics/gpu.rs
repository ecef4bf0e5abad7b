//! DCGM-style per-GPU metrics from the GPU watch ([`crate::gpu::watch`]), built at scrape time
//! from its latest look and XID counts (read-only state: the scrape makes no NVML call, so a GPU
//! that hangs NVML cannot hang `/metrics`).
//!
//! Every series carries `gpu` (the NVML index), `UUID` and `pci_bus_id`, spelled as
//! dcgm-exporter spells them (and as the pre-flight's `muster_gpu_check_healthy` does), so its
//! dashboards' queries and joins work unchanged; units follow the Prometheus conventions (a utilization
//! ratio 0–1, bytes, watts, celsius). A reading the GPU does not support is left out, not 0.

use prometheus::core::Desc;
use prometheus::proto::{Metric, MetricFamily, MetricType};

use super::attached::Attached;
use super::live::{counter, family, gauge, help};
use crate::gpu::watch::sample::WATCHED_THROTTLE;
use crate::gpu::watch::{GpuId, GpuSample, Watch};

const UTILIZATION: &str = "muster_gpu_utilization_ratio";
const MEMORY_USED: &str = "muster_gpu_memory_used_bytes";
const MEMORY_TOTAL: &str = "muster_gpu_memory_total_bytes";
const POWER: &str = "muster_gpu_power_watts";
const TEMPERATURE: &str = "muster_gpu_temperature_celsius";
const ECC: &str = "muster_gpu_ecc_uncorrected_errors_total";
const REMAP_PENDING: &str = "muster_gpu_row_remap_pending";
const THROTTLED: &str = "muster_gpu_throttled";
const LOST: &str = "muster_gpu_lost";
const NVLINK: &str = "muster_gpu_nvlink_errors_total";
const XID: &str = "muster_gpu_xid_errors_total";
const LAST_SAMPLE: &str = "muster_gpu_watch_last_sample_timestamp_seconds";

/// The collector, empty until the GPU watch is attached.
pub(super) fn collector() -> Attached<Watch> {
    let gpu: &[&str] = &["gpu", "UUID", "pci_bus_id"];
    let defs = [
        (UTILIZATION, "Fraction of the last sample period in which a kernel ran on the GPU (NVML utilization), 0-1.", gpu),
        (MEMORY_USED, "GPU memory in use, in bytes.", gpu),
        (MEMORY_TOTAL, "GPU memory, in bytes.", gpu),
        (POWER, "GPU power draw, in watts.", gpu),
        (TEMPERATURE, "GPU core temperature, in degrees Celsius.", gpu),
        (ECC, "Uncorrectable (double-bit) ECC errors since the driver loaded (NVML's volatile count).", gpu),
        (REMAP_PENDING, "1 when a row remap is pending (it applies at the next GPU reset).", gpu),
        (THROTTLED, "1 while the hardware slows the GPU's clocks for this reason (hw_slowdown, hw_thermal_slowdown, hw_power_brake_slowdown).", &["gpu", "UUID", "pci_bus_id", "reason"]),
        (LOST, "1 when the GPU stopped answering NVML (fell off the bus or needs a reset).", gpu),
        (NVLINK, "NVLink errors since the driver loaded, summed over the GPU's active links, by counter (replay, recovery, crc_flit, crc_data).", &["gpu", "UUID", "pci_bus_id", "counter"]),
        (XID, "XID errors NVML delivered while muster watched, by XID.", &["gpu", "UUID", "pci_bus_id", "xid"]),
        (LAST_SAMPLE, "When the GPU watch last looked at the GPUs (Unix seconds).", &[]),
    ];
    Attached::new(&defs, families)
}

fn families(watch: &Watch, descs: &[Desc]) -> Vec<MetricFamily> {
    let view = watch.view();
    let Some(at) = view.sample.at else {
        return Vec::new();
    };
    let gpus: Vec<&GpuSample> = view
        .sample
        .gpus
        .iter()
        .filter(|g| g.gpu.index < super::MAX_GPUS)
        .collect();
    let mut out = Vec::with_capacity(descs.len());
    let mut push = |name: &str, kind: MetricType, metrics: Vec<Metric>| {
        if !metrics.is_empty() {
            out.push(family(name, help(descs, name), kind, metrics));
        }
    };
    let per_gpu = |value: &dyn Fn(&GpuSample) -> Option<f64>,
                   make: fn(&[(&str, &str)], f64) -> Metric| {
        gpus.iter()
            .filter_map(|g| value(g).map(|v| with_gpu(&g.gpu, &[], v, make)))
            .collect::<Vec<_>>()
    };
    push(
        UTILIZATION,
        MetricType::GAUGE,
        per_gpu(&|g| g.utilization_ratio, gauge),
    );
    push(
        MEMORY_USED,
        MetricType::GAUGE,
        per_gpu(&|g| g.memory_used_bytes.map(|v| v as f64), gauge),
    );
    push(
        MEMORY_TOTAL,
        MetricType::GAUGE,
        per_gpu(&|g| g.memory_total_bytes.map(|v| v as f64), gauge),
    );
    push(POWER, MetricType::GAUGE, per_gpu(&|g| g.power_watts, gauge));
    push(
        TEMPERATURE,
        MetricType::GAUGE,
        per_gpu(&|g| g.temperature_celsius.map(f64::from), gauge),
    );
    push(
        ECC,
        MetricType::COUNTER,
        per_gpu(&|g| g.ecc_volatile_uncorrected.map(|v| v as f64), counter),
    );
    push(
        REMAP_PENDING,
        MetricType::GAUGE,
        per_gpu(
            &|g| g.row_remap_pending.map(|p| f64::from(u8::from(p))),
            gauge,
        ),
    );
    push(
        LOST,
        MetricType::GAUGE,
        per_gpu(&|g| Some(f64::from(u8::from(g.lost))), gauge),
    );
    let throttled = gpus
        .iter()
        .filter_map(|g| g.throttle_reasons.map(|bits| (g, bits)))
        .flat_map(|(g, bits)| {
            WATCHED_THROTTLE.iter().map(move |(bit, name)| {
                with_gpu(
                    &g.gpu,
                    &[("reason", name)],
                    f64::from(u8::from(bits & bit != 0)),
                    gauge,
                )
            })
        })
        .collect();
    push(THROTTLED, MetricType::GAUGE, throttled);
    let nvlink = gpus
        .iter()
        .filter_map(|g| g.nvlink.map(|n| (g, n)))
        .flat_map(|(g, n)| {
            [
                ("replay", n.replay),
                ("recovery", n.recovery),
                ("crc_flit", n.crc_flit),
                ("crc_data", n.crc_data),
            ]
            .into_iter()
            .map(move |(name, v)| with_gpu(&g.gpu, &[("counter", name)], v as f64, counter))
        })
        .collect();
    push(NVLINK, MetricType::COUNTER, nvlink);
    let xids = view
        .xids
        .iter()
        .map(|(gpu, xid, count)| {
            let xid = xid.to_string();
            with_gpu(gpu, &[("xid", &xid)], *count as f64, counter)
        })
        .collect();
    push(XID, MetricType::COUNTER, xids);
    let seconds = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    push(LAST_SAMPLE, MetricType::GAUGE, vec![gauge(&[], seconds)]);
    out
}

/// A series labelled with the GPU's identity, then `extra`.
fn with_gpu(
    gpu: &GpuId,
    extra: &[(&str, &str)],
    value: f64,
    make: fn(&[(&str, &str)], f64) -> Metric,
) -> Metric {
    let index = gpu.index.to_string();
    let mut labels = vec![
        ("gpu", index.as_str()),
        ("UUID", gpu.uuid.as_deref().unwrap_or("")),
        ("pci_bus_id", gpu.pci_bus_id.as_deref().unwrap_or("")),
    ];
    labels.extend_from_slice(extra);
    make(&labels, value)
}
