//! The pre-flight's outcome: per-check results, the node verdict, the `nvidia-smi topo -m`-style
//! matrix, a human-readable rendering and a compact summary small enough to publish in a
//! rendezvous registration.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::snapshot::{GpuSnapshot, NodeSnapshot, Remote};

/// Which GPU a result is about, by every name an operator might search for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRef {
    /// NVML index (PCI bus id order).
    pub index: u32,
    pub uuid: Option<String>,
    pub pci_bus_id: Option<String>,
}

impl GpuRef {
    pub fn of(gpu: &GpuSnapshot) -> Self {
        Self {
            index: gpu.index,
            uuid: gpu.uuid.clone().ok(),
            pci_bus_id: gpu.pci_bus_id.clone().ok(),
        }
    }
}

impl std::fmt::Display for GpuRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {} ({}, {})",
            self.index,
            self.uuid.as_deref().unwrap_or("uuid unknown"),
            self.pci_bus_id.as_deref().unwrap_or("bus id unknown")
        )
    }
}

/// One check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    Warn,
    Fail,
    /// Not applicable or not supported here; never counts against the node.
    Skip,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
            Self::Warn => "WARN",
            Self::Fail => "FAIL",
            Self::Skip => "SKIP",
        }
    }
}

/// One check on one GPU (or on the node when `gpu` is `None`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    /// A name from [`super::checks::name`].
    pub check: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuRef>,
    pub status: Status,
    pub reason: String,
}

impl CheckResult {
    pub fn node(check: &str, status: Status, reason: String) -> Self {
        Self {
            check: check.to_string(),
            gpu: None,
            status,
            reason,
        }
    }

    pub fn gpu(check: &str, gpu: &GpuRef, status: Status, reason: String) -> Self {
        Self {
            check: check.to_string(),
            gpu: Some(gpu.clone()),
            status,
            reason,
        }
    }
}

impl std::fmt::Display for CheckResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.gpu {
            Some(g) => write!(f, "{g} {}: {}", self.check, self.reason),
            None => write!(f, "{}: {}", self.check, self.reason),
        }
    }
}

/// The node's overall outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every check passed or was skipped.
    Healthy,
    /// Nothing failed, some checks warned: launch, but say so.
    Warnings,
    /// At least one check failed: do not start ranks on this node.
    Unhealthy,
}

impl Verdict {
    pub fn is_unhealthy(self) -> bool {
        self == Self::Unhealthy
    }

    /// What the GPUs are, after "GPUs ".
    fn in_words(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Warnings => "usable, with warnings",
            Self::Unhealthy => "unhealthy",
        }
    }
}

/// Identity and placement of one GPU, for launch (device order, NUMA binding) and reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: Option<String>,
    pub pci_bus_id: Option<String>,
    pub name: Option<String>,
    pub numa_node: Option<u32>,
    /// CPUs NVML lists as close to this GPU (empty when unknown).
    pub cpu_affinity: Vec<u32>,
    /// NVLinks in the active state (`None` when NVLink state is unknown or not supported).
    #[serde(default)]
    pub nvlink_active: Option<u32>,
}

impl GpuInfo {
    pub fn of(gpu: &GpuSnapshot) -> Self {
        Self {
            index: gpu.index,
            uuid: gpu.uuid.clone().ok(),
            pci_bus_id: gpu.pci_bus_id.clone().ok(),
            name: gpu.name.clone().ok(),
            numa_node: gpu.numa_node,
            cpu_affinity: gpu.cpu_affinity.clone().unwrap_or_default(),
            nvlink_active: gpu
                .nvlinks
                .as_ref()
                .ok()
                .map(|links| links.iter().filter(|l| l.active).count() as u32),
        }
    }
}

/// The GPU-to-GPU matrix `nvidia-smi topo -m` prints.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// Row/column GPU indices.
    pub gpus: Vec<u32>,
    /// `cells[i][j]`: `X`, `NV#`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`, or `?`.
    pub cells: Vec<Vec<String>>,
    /// Per row: CPU list and NUMA node.
    pub cpu_affinity: Vec<String>,
    pub numa_affinity: Vec<String>,
}

impl Topology {
    pub fn of(node: &NodeSnapshot) -> Self {
        let gpus: Vec<&GpuSnapshot> = node.gpus.iter().filter(|g| g.handle.is_ok()).collect();
        let switch_links = |g: &GpuSnapshot| {
            g.nvlinks.as_ref().map_or(0, |links| {
                links
                    .iter()
                    .filter(|l| l.active && matches!(l.remote, Ok(Remote::Switch { .. })))
                    .count()
            })
        };
        let direct_links = |g: &GpuSnapshot, to: u32| {
            g.nvlinks.as_ref().map_or(0, |links| {
                links
                    .iter()
                    .filter(|l| {
                        l.active && matches!(l.remote, Ok(Remote::Gpu { index, .. }) if index == to)
                    })
                    .count()
            })
        };
        let mut cells = Vec::with_capacity(gpus.len());
        for a in &gpus {
            let mut row = Vec::with_capacity(gpus.len());
            for b in &gpus {
                if a.index == b.index {
                    row.push("X".to_string());
                    continue;
                }
                let direct = direct_links(a, b.index);
                let via_switch = switch_links(a).min(switch_links(b));
                let nv = if direct > 0 { direct } else { via_switch };
                if nv > 0 {
                    row.push(format!("NV{nv}"));
                    continue;
                }
                let (lo, hi) = (a.index.min(b.index), a.index.max(b.index));
                let label = node
                    .pairs
                    .iter()
                    .find(|p| p.a == lo && p.b == hi)
                    .and_then(|p| p.pcie.as_ref().ok())
                    .map_or("?", |l| l.label());
                row.push(label.to_string());
            }
            cells.push(row);
        }
        Self {
            gpus: gpus.iter().map(|g| g.index).collect(),
            cells,
            cpu_affinity: gpus
                .iter()
                .map(|g| match &g.cpu_affinity {
                    Ok(c) if !c.is_empty() => super::cpulist(c),
                    _ => "N/A".into(),
                })
                .collect(),
            numa_affinity: gpus
                .iter()
                .map(|g| g.numa_node.map_or("N/A".into(), |n| n.to_string()))
                .collect(),
        }
    }

    fn render(&self, out: &mut String) {
        let width = self
            .cells
            .iter()
            .flatten()
            .map(String::len)
            .chain(std::iter::once(4))
            .max()
            .unwrap_or(4)
            + 2;
        let _ = write!(out, "{:<8}", "");
        for g in &self.gpus {
            let _ = write!(out, "{:<width$}", format!("GPU{g}"));
        }
        let _ = writeln!(out, "{:<16}NUMA Affinity", "CPU Affinity");
        for (i, g) in self.gpus.iter().enumerate() {
            let _ = write!(out, "{:<8}", format!("GPU{g}"));
            for cell in &self.cells[i] {
                let _ = write!(out, "{cell:<width$}");
            }
            let _ = writeln!(out, "{:<16}{}", self.cpu_affinity[i], self.numa_affinity[i]);
        }
        out.push_str(
            "Legend: X = self, NV# = # bonded NVLinks (via NVSwitch or direct), PIX = one PCIe \
             switch, PXB = several PCIe switches, PHB = PCIe host bridge, NODE = host bridges \
             within a NUMA node, SYS = across NUMA nodes\n",
        );
    }
}

/// Everything `muster gpu-check` and the launch pre-flight learn about this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub host: String,
    pub verdict: Verdict,
    pub expected_gpus: Option<u32>,
    pub driver_version: Option<String>,
    pub gpus: Vec<GpuInfo>,
    pub checks: Vec<CheckResult>,
    pub topology: Topology,
}

/// What a node publishes in its rendezvous registration: the verdict and only the failing
/// checks, each naming the GPU by index, UUID and PCI bus id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub host: String,
    pub verdict: Verdict,
    pub failures: Vec<CheckResult>,
}

impl Summary {
    /// One line for the gang's fail-fast error: "node H: GPU 3 (GPU-…, 00000000:5D:00.0)
    /// nvlink_links: 16 of 18 NVLinks active …; …".
    pub fn message(&self) -> String {
        let parts: Vec<String> = self.failures.iter().map(ToString::to_string).collect();
        if parts.is_empty() {
            format!("node {}: GPUs {}", self.host, self.verdict.in_words())
        } else {
            format!("node {}: {}", self.host, parts.join("; "))
        }
    }
}

impl Report {
    pub fn new(
        host: String,
        expected_gpus: Option<u32>,
        node: &NodeSnapshot,
        checks: Vec<CheckResult>,
    ) -> Self {
        let driver_version = match &node.driver {
            super::snapshot::DriverState::Loaded { driver_version, .. } => {
                driver_version.clone().ok()
            }
            _ => None,
        };
        Self {
            host,
            verdict: Self::verdict_of(&checks),
            expected_gpus,
            driver_version,
            gpus: node.gpus.iter().map(GpuInfo::of).collect(),
            checks,
            topology: Topology::of(node),
        }
    }

    /// Appends a result computed outside the NVML checks (the CUDA smoke test) and updates the
    /// verdict.
    pub fn push(&mut self, result: CheckResult) {
        self.checks.push(result);
        self.verdict = Self::verdict_of(&self.checks);
    }

    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    pub fn verdict_of(checks: &[CheckResult]) -> Verdict {
        if checks.iter().any(|c| c.status == Status::Fail) {
            Verdict::Unhealthy
        } else if checks.iter().any(|c| c.status == Status::Warn) {
            Verdict::Warnings
        } else {
            Verdict::Healthy
        }
    }

    pub fn failures(&self) -> impl Iterator<Item = &CheckResult> {
        self.checks.iter().filter(|c| c.status == Status::Fail)
    }

    pub fn summary(&self) -> Summary {
        Summary {
            host: self.host.clone(),
            verdict: self.verdict,
            failures: self.failures().cloned().collect(),
        }
    }

    /// The readable report: GPUs, one line per check per GPU, the topology matrix, and the
    /// failures again at the end where a log tail shows them.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let count = |s: Status| self.checks.iter().filter(|c| c.status == s).count();
        let _ = writeln!(
            out,
            "muster gpu-check on {}: {} ({} failed, {} warned, {} passed, {} skipped)",
            self.host,
            match self.verdict {
                Verdict::Healthy => "HEALTHY",
                Verdict::Warnings => "HEALTHY WITH WARNINGS",
                Verdict::Unhealthy => "UNHEALTHY",
            },
            count(Status::Fail),
            count(Status::Warn),
            count(Status::Pass),
            count(Status::Skip),
        );
        for g in &self.gpus {
            let _ = writeln!(
                out,
                "GPU{:<3} {:<18} {:<42} {}",
                g.index,
                g.pci_bus_id.as_deref().unwrap_or("?"),
                g.uuid.as_deref().unwrap_or("?"),
                g.name.as_deref().unwrap_or("?"),
            );
        }
        out.push('\n');
        for c in &self.checks {
            let who = c
                .gpu
                .as_ref()
                .map_or_else(|| "node".to_string(), |g| format!("GPU{}", g.index));
            let _ = writeln!(
                out,
                "{}  {:<6} {:<16} {}",
                c.status.label(),
                who,
                c.check,
                c.reason
            );
        }
        if !self.topology.gpus.is_empty() {
            out.push_str("\nTopology:\n");
            self.topology.render(&mut out);
        }
        let failures: Vec<&CheckResult> = self.failures().collect();
        if !failures.is_empty() {
            out.push_str("\nFailing checks:\n");
            for f in failures {
                let _ = writeln!(out, "  {f}");
            }
        }
        out
    }
}
