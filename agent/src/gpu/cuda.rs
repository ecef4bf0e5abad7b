//! CUDA smoke test: on every GPU create a context, allocate, memset, copy host→device→host and
//! compare; then copy between GPU pairs that NVML says can do P2P.
//!
//! It always runs in a child process (`muster gpu-check --cuda-smoke-child`) that the parent
//! kills after a timeout, because: cudarc panics (not errors) when `libcuda.so` is missing; a
//! sick GPU can hang `cuInit` or a copy forever; the primary contexts pin memory until process
//! exit; and CUDA is not fork-safe while the agent later forks the ranks. The child prints one
//! JSON line; the parent turns it into a `cuda` check result.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::Command;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use serde::{Deserialize, Serialize};

use super::checks::name;
use super::report::{CheckResult, Status};

/// The hidden flag that turns `muster gpu-check` into the smoke-test child.
pub const CHILD_FLAG: &str = "--cuda-smoke-child";
/// Bytes copied per GPU: large enough to cross several pages and DMA chunks, small enough to
/// take milliseconds.
const BYTES: usize = 64 << 20;

/// What the child reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum ChildReport {
    /// No `libcuda.so` could be loaded.
    NoDriver { detail: String },
    /// `cuInit`/device enumeration failed (802 = fabric not ready, 100 = no device, ...).
    InitFailed { detail: String },
    /// Per-device and per-pair results.
    Ran {
        devices: Vec<DeviceResult>,
        peers: Vec<PeerResult>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceResult {
    pub ordinal: usize,
    pub ok: bool,
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerResult {
    pub from: usize,
    pub to: usize,
    pub ok: bool,
    pub detail: String,
}

/// Child entry point: runs the test, prints one JSON line, exits 0 (the parent judges).
pub fn child_main(peers: &[(usize, usize)]) -> u8 {
    // The panic cudarc raises for a missing library is an expected outcome here, not a crash
    // worth a backtrace on stderr.
    std::panic::set_hook(Box::new(|_| {}));
    let report = match catch_unwind(AssertUnwindSafe(|| run(peers))) {
        Ok(report) => report,
        Err(panic) => {
            let msg = super::panic_message(panic.as_ref());
            if msg.contains("dynamically load") || msg.contains("libcuda") {
                // cudarc's message goes on to list ~30 candidate file names; the first clause
                // says what happened.
                let short = msg.split(" - searched").next().unwrap_or(&msg);
                ChildReport::NoDriver {
                    detail: format!("{short} (libcuda.so / libcuda.so.1 not on the library path)"),
                }
            } else {
                ChildReport::InitFailed {
                    detail: format!("cudarc panicked: {msg}"),
                }
            }
        }
    };
    match serde_json::to_string(&report) {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(_) => crate::exit_code::INTERNAL_ERROR,
    }
}

fn run(peers: &[(usize, usize)]) -> ChildReport {
    let count = match CudaContext::device_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) => {
            return ChildReport::InitFailed {
                detail: format!("cuInit/cuDeviceGetCount failed: {e}"),
            }
        }
    };
    let pattern: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8).collect();
    let devices = (0..count)
        .map(|ordinal| match device(ordinal, &pattern) {
            Ok(detail) => DeviceResult {
                ordinal,
                ok: true,
                detail,
            },
            Err(detail) => DeviceResult {
                ordinal,
                ok: false,
                detail,
            },
        })
        .collect();
    let peers = peers
        .iter()
        .filter(|(a, b)| *a < count && *b < count)
        .map(|&(from, to)| match peer(from, to, &pattern) {
            Ok(detail) => PeerResult {
                from,
                to,
                ok: true,
                detail,
            },
            Err(detail) => PeerResult {
                from,
                to,
                ok: false,
                detail,
            },
        })
        .collect();
    ChildReport::Ran { devices, peers }
}

fn device(ordinal: usize, pattern: &[u8]) -> Result<String, String> {
    let started = Instant::now();
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("context: {e}"))?;
    let stream = ctx.default_stream();
    let mut zeros = stream
        .alloc_zeros::<u8>(pattern.len())
        .map_err(|e| format!("alloc: {e}"))?;
    stream
        .memset_zeros(&mut zeros)
        .map_err(|e| format!("memset: {e}"))?;
    let back = stream.clone_dtoh(&zeros).map_err(|e| format!("D2H: {e}"))?;
    if back.iter().any(|b| *b != 0) {
        return Err("memset left non-zero bytes".into());
    }
    let dev = stream
        .clone_htod(pattern)
        .map_err(|e| format!("H2D: {e}"))?;
    let back = stream.clone_dtoh(&dev).map_err(|e| format!("D2H: {e}"))?;
    if back != pattern {
        return Err("host→device→host round trip corrupted data".into());
    }
    stream.synchronize().map_err(|e| format!("sync: {e}"))?;
    Ok(format!(
        "context, {} MiB alloc/memset/H2D/D2H OK in {} ms",
        pattern.len() >> 20,
        started.elapsed().as_millis()
    ))
}

fn peer(from: usize, to: usize, pattern: &[u8]) -> Result<String, String> {
    let a = CudaContext::new(from).map_err(|e| format!("context {from}: {e}"))?;
    let b = CudaContext::new(to).map_err(|e| format!("context {to}: {e}"))?;
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let src = sa.clone_htod(pattern).map_err(|e| format!("H2D: {e}"))?;
    let dst = sb.clone_dtod(&src).map_err(|e| format!("peer copy: {e}"))?;
    let back = sb.clone_dtoh(&dst).map_err(|e| format!("D2H: {e}"))?;
    if back != pattern {
        return Err("peer copy corrupted data".into());
    }
    Ok("peer copy OK".into())
}

/// Runs the child with `timeout` and turns its report into one `cuda` check result.
/// `gpus_expected`: whether a missing CUDA driver is a failure (GPUs were expected) or a skip.
pub fn smoke(
    gpus_expected: bool,
    visible_gpus: usize,
    peers: &[(usize, usize)],
    timeout: Duration,
) -> CheckResult {
    let absent = |detail: String| {
        let status = if gpus_expected {
            Status::Fail
        } else {
            Status::Skip
        };
        CheckResult::node(
            name::CUDA,
            status,
            format!("CUDA driver not found (libcuda.so): {detail}"),
        )
    };
    match spawn(peers, timeout) {
        Err(e) => CheckResult::node(
            name::CUDA,
            Status::Fail,
            format!("CUDA smoke test could not run: {e}"),
        ),
        Ok(ChildReport::NoDriver { detail }) => absent(detail),
        Ok(ChildReport::InitFailed { detail }) => {
            let status = if gpus_expected || visible_gpus > 0 {
                Status::Fail
            } else {
                Status::Skip
            };
            CheckResult::node(name::CUDA, status, format!("CUDA did not start: {detail}"))
        }
        Ok(ChildReport::Ran { devices, peers }) => judge(&devices, &peers, visible_gpus),
    }
}

fn judge(devices: &[DeviceResult], peers: &[PeerResult], visible_gpus: usize) -> CheckResult {
    let mut bad: Vec<String> = devices
        .iter()
        .filter(|d| !d.ok)
        .map(|d| format!("GPU {}: {}", d.ordinal, d.detail))
        .collect();
    bad.extend(
        peers
            .iter()
            .filter(|p| !p.ok)
            .map(|p| format!("GPU {}→{}: {}", p.from, p.to, p.detail)),
    );
    if devices.len() < visible_gpus {
        bad.push(format!(
            "CUDA sees {} GPU(s), NVML {visible_gpus}",
            devices.len()
        ));
    }
    if bad.is_empty() {
        CheckResult::node(
            name::CUDA,
            Status::Pass,
            format!(
                "{} GPU(s): context, alloc, memset, H2D/D2H OK; {} peer copies OK",
                devices.len(),
                peers.len()
            ),
        )
    } else {
        CheckResult::node(name::CUDA, Status::Fail, bad.join("; "))
    }
}

/// Starts `current_exe gpu-check --cuda-smoke-child` with a hard time limit.
fn spawn(peers: &[(usize, usize)], timeout: Duration) -> Result<ChildReport, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own binary: {e}"))?;
    let peer_arg: Vec<String> = peers.iter().map(|(a, b)| format!("{a}-{b}")).collect();
    let mut cmd = Command::new(exe);
    cmd.arg("gpu-check").arg(CHILD_FLAG);
    if !peer_arg.is_empty() {
        cmd.arg("--peers").arg(peer_arg.join(","));
    }
    // CUDA's default order is "fastest first"; PCI order makes ordinal i the NVML index i.
    cmd.env("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    super::child::run_json(cmd, timeout, "a GPU hung in cuInit or a copy")
}

/// Parses `--peers 0-1,2-3`.
pub fn parse_peers(text: &str) -> Result<Vec<(usize, usize)>, String> {
    text.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (a, b) = p
                .split_once('-')
                .ok_or_else(|| format!("bad peer pair {p:?} (want A-B)"))?;
            let a = a.parse().map_err(|_| format!("bad GPU ordinal {a:?}"))?;
            let b = b.parse().map_err(|_| format!("bad GPU ordinal {b:?}"))?;
            Ok((a, b))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse() {
        assert_eq!(parse_peers("0-1,2-3").unwrap(), vec![(0, 1), (2, 3)]);
        assert!(parse_peers("0+1").is_err());
    }

    #[test]
    fn judge_names_the_failing_gpu() {
        let devices = vec![
            DeviceResult {
                ordinal: 0,
                ok: true,
                detail: String::new(),
            },
            DeviceResult {
                ordinal: 1,
                ok: false,
                detail: "alloc: CUDA_ERROR_ECC_UNCORRECTABLE".into(),
            },
        ];
        let r = judge(&devices, &[], 2);
        assert_eq!(r.status, Status::Fail);
        assert!(r.reason.contains("GPU 1: alloc"));
        let r = judge(&devices[..1], &[], 2);
        assert!(r.reason.contains("CUDA sees 1 GPU(s), NVML 2"));
    }
}
