//! GPU memory freed before a respawn: after an attempt's processes are gone, the driver may
//! still list them (it tears their contexts down asynchronously) or hold their memory, and a
//! restarted rank then fails with out-of-memory or hangs at start (pytorch/pytorch#76287). So a
//! restart first waits, bounded, until NVML lists none of the previous attempt's processes on the
//! local GPUs and their memory is back; if it does not come back the node is unhealthy.
//!
//! "The previous attempt's processes" are its pids (workers and the strays stopped with them),
//! and every listed pid that is not a live process here: after the stop it can only be one that
//! just died, or, in a container whose NVML reports host pids, one this agent cannot see (a
//! device plugin gives a GPU to one container, so that is the job's own). Live processes that
//! are not the attempt's (a sidecar, a profiler, a helper kept by `--keep-strays`) are not
//! waited for, and their memory is excused. "Memory back" means: used memory at most what it was
//! before the attempt started, plus the memory of those excused processes, plus [`SLACK_BYTES`].

use std::time::{Duration, Instant};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

use super::nvml::with_nvml;

/// Memory that may come and go without anyone's fault (driver bookkeeping, other contexts'
/// small allocations).
pub const SLACK_BYTES: u64 = 256 << 20;
/// How often NVML is asked again during the wait.
const POLL: Duration = Duration::from_millis(250);

/// A compute process NVML lists on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    pub pid: u32,
    pub used_bytes: Option<u64>,
}

/// What one GPU is used by, as NVML says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUse {
    pub index: u32,
    pub uuid: Option<String>,
    pub used_bytes: Option<u64>,
    /// `None`: the list could not be read.
    pub processes: Option<Vec<GpuProcess>>,
}

/// A GPU that is not released yet, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    pub index: u32,
    pub uuid: Option<String>,
    /// Listed processes of the previous attempt.
    pub pids: Vec<u32>,
    /// Used memory when it is above what is allowed: (used, allowed).
    pub memory: Option<(u64, u64)>,
}

impl std::fmt::Display for Holding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GPU {}", self.index)?;
        if let Some(uuid) = &self.uuid {
            write!(f, " ({uuid})")?;
        }
        if !self.pids.is_empty() {
            let pids: Vec<String> = self.pids.iter().map(u32::to_string).collect();
            write!(f, " held by pid(s) {}", pids.join(", "))?;
        }
        if let Some((used, allowed)) = self.memory {
            if !self.pids.is_empty() {
                f.write_str(",")?;
            }
            write!(
                f,
                " {} MiB used, at most {} MiB expected",
                used >> 20,
                allowed >> 20
            )?;
        }
        Ok(())
    }
}

/// Reads every GPU's memory use and compute processes.
fn read(nvml: &Nvml) -> Vec<GpuUse> {
    let count = nvml.device_count().unwrap_or(0);
    (0..count)
        .filter_map(|index| {
            let d = nvml.device_by_index(index).ok()?;
            Some(GpuUse {
                index,
                uuid: d.uuid().ok(),
                used_bytes: d.memory_info().ok().map(|m| m.used),
                processes: d.running_compute_processes().ok().map(|ps| {
                    ps.iter()
                        .map(|p| GpuProcess {
                            pid: p.pid,
                            used_bytes: match p.used_gpu_memory {
                                UsedGpuMemory::Used(b) => Some(b),
                                UsedGpuMemory::Unavailable => None,
                            },
                        })
                        .collect()
                }),
            })
        })
        .collect()
}

/// Memory use per GPU before an attempt starts, the reference for "memory back". `None` when
/// this node has no GPU (no driver, or none listed). Blocking: call from `spawn_blocking`.
pub fn baseline(library: Option<&str>) -> Option<Vec<GpuUse>> {
    with_nvml(library, |nvml, _| read(nvml))
        .ok()
        .filter(|gpus| !gpus.is_empty())
}

/// The GPUs in `now` that still hold the previous attempt: a listed process of `attempt` (or not
/// alive here, unless `keep_strays`: then only the attempt's own pids count), or used memory
/// above the `baseline` plus what live, excused processes use plus [`SLACK_BYTES`].
pub fn holding(
    now: &[GpuUse],
    baseline: &[GpuUse],
    attempt: &[u32],
    alive: &dyn Fn(u32) -> bool,
    keep_strays: bool,
) -> Vec<Holding> {
    now.iter()
        .filter_map(|gpu| {
            let listed = gpu.processes.as_deref().unwrap_or_default();
            let ours =
                |p: &&GpuProcess| attempt.contains(&p.pid) || (!keep_strays && !alive(p.pid));
            let pids: Vec<u32> = listed.iter().filter(ours).map(|p| p.pid).collect();
            let excused: u64 = listed
                .iter()
                .filter(|p| !ours(p))
                .filter_map(|p| p.used_bytes)
                .sum();
            let before = baseline
                .iter()
                .find(|b| b.uuid.is_some() && b.uuid == gpu.uuid)
                .or_else(|| baseline.iter().find(|b| b.index == gpu.index))
                .and_then(|b| b.used_bytes);
            let memory = match (gpu.used_bytes, before) {
                (Some(used), Some(before)) => {
                    let allowed = before.saturating_add(excused).saturating_add(SLACK_BYTES);
                    (used > allowed).then_some((used, allowed))
                }
                _ => None,
            };
            (!pids.is_empty() || memory.is_some()).then(|| Holding {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                pids,
                memory,
            })
        })
        .collect()
}

/// How a wait ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Released {
    /// Every GPU is free of the previous attempt.
    Yes,
    /// Still held when the time ran out.
    No(Vec<Holding>),
    /// NVML could not be opened any more (it could at the baseline).
    Unreadable(String),
}

/// Whether `pid` is a live process here.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !matches!(rest.split_whitespace().next(), Some("Z" | "X")))
    })
}

/// Polls NVML until no GPU holds the previous attempt or `timeout` passes. NVML stays open for
/// the whole wait. Blocking: call from `spawn_blocking`.
pub fn wait_released(
    library: Option<&str>,
    baseline: &[GpuUse],
    attempt: &[u32],
    keep_strays: bool,
    timeout: Duration,
) -> Released {
    let started = Instant::now();
    let result = with_nvml(library, |nvml, _| loop {
        let held = holding(&read(nvml), baseline, attempt, &alive, keep_strays);
        if held.is_empty() {
            return Released::Yes;
        }
        if started.elapsed() >= timeout {
            return Released::No(held);
        }
        std::thread::sleep(POLL.min(timeout.saturating_sub(started.elapsed())));
    });
    result.unwrap_or_else(|state| Released::Unreadable(super::GpuError::from(state).to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, used: u64, processes: &[(u32, u64)]) -> GpuUse {
        GpuUse {
            index,
            uuid: Some(format!("GPU-{index}")),
            used_bytes: Some(used),
            processes: Some(
                processes
                    .iter()
                    .map(|&(pid, b)| GpuProcess {
                        pid,
                        used_bytes: Some(b),
                    })
                    .collect(),
            ),
        }
    }

    #[test]
    fn a_listed_process_of_the_attempt_or_a_dead_one_holds_the_gpu() {
        let baseline = [gpu(0, 0, &[]), gpu(1, 0, &[])];
        let attempt = [100];
        let alive = |pid: u32| pid == 100 || pid == 300;
        let now = [
            gpu(0, 8 * GIB, &[(100, 8 * GIB)]),
            gpu(1, 4 * GIB, &[(200, 4 * GIB)]),
        ];
        let held = holding(&now, &baseline, &attempt, &alive, false);
        assert_eq!(held.len(), 2);
        assert_eq!((held[0].index, held[0].pids.clone()), (0, vec![100]));
        assert_eq!((held[1].index, held[1].pids.clone()), (1, vec![200]));
        assert_eq!(
            held[1].to_string(),
            "GPU 1 (GPU-1) held by pid(s) 200, 4096 MiB used, at most 256 MiB expected"
        );
        // A live process that is not the attempt's is excused, memory included.
        let now = [gpu(0, 4 * GIB, &[(300, 4 * GIB)])];
        assert!(holding(&now, &baseline, &attempt, &alive, false).is_empty());
    }

    #[test]
    fn memory_must_come_back_even_when_no_process_is_listed() {
        let baseline = [gpu(0, GIB, &[])];
        let none: [u32; 0] = [];
        let alive = |_| true;
        let held = holding(&[gpu(0, 9 * GIB, &[])], &baseline, &none, &alive, false);
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].memory, Some((9 * GIB, GIB + SLACK_BYTES)));
        assert_eq!(
            held[0].to_string(),
            "GPU 0 (GPU-0) 9216 MiB used, at most 1280 MiB expected"
        );
        // Within the slack: released.
        let now = [gpu(0, GIB + 100 * (1 << 20), &[])];
        assert!(holding(&now, &baseline, &none, &alive, false).is_empty());
    }

    #[test]
    fn kept_strays_are_not_waited_for() {
        let baseline = [gpu(0, 0, &[])];
        let attempt = [100];
        // pid 500 is not visible here (host pid in a container, or a kept helper): with
        // --keep-strays only the attempt's own pids count, and its memory is excused.
        let now = [gpu(0, 2 * GIB, &[(500, 2 * GIB)])];
        let never = |_| false;
        assert!(holding(&now, &baseline, &attempt, &never, true).is_empty());
        assert_eq!(holding(&now, &baseline, &attempt, &never, false).len(), 1);
    }

    #[test]
    fn unreadable_lists_and_memory_do_not_hold() {
        let now = [GpuUse {
            index: 0,
            uuid: None,
            used_bytes: None,
            processes: None,
        }];
        assert!(holding(&now, &[], &[], &|_| false, false).is_empty());
    }

    #[test]
    fn this_process_is_alive_and_a_free_pid_is_not() {
        assert!(alive(std::process::id()));
        assert!(!alive(u32::MAX - 1));
    }
}
