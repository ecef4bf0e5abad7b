//! Was a rank killed by the kernel's OOM killer? The container's memory cgroup counts its OOM
//! kills: cgroup v2 `memory.events` (`oom_kill N`), cgroup v1 `memory.oom_control` (`oom_kill N`,
//! kernels 4.13 and later). A rank that died of SIGKILL while that count rose was the OOM
//! killer's; the limit (`memory.max`, `memory.limit_in_bytes`) goes into the summary.
//!
//! Parsers are pure (tested on captured files); [`MemoryCgroup::find`] locates the files of the
//! agent's own cgroup (the container's) from `/proc/self/cgroup`.

use std::path::{Path, PathBuf};

/// Above this a v1 limit means "no limit" (the kernel reports `PAGE_COUNTER_MAX` pages).
const V1_UNLIMITED: u64 = 1 << 62;

/// The `oom_kill` count of a v2 `memory.events` or a v1 `memory.oom_control` file.
pub fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(char::is_whitespace)?;
        (key == "oom_kill").then(|| value.trim().parse().ok())?
    })
}

/// A memory limit file: v2 `memory.max` (`max` is none) or v1 `memory.limit_in_bytes`.
pub fn parse_limit(text: &str) -> Option<u64> {
    let text = text.trim();
    if text == "max" {
        return None;
    }
    text.parse::<u64>().ok().filter(|&b| b < V1_UNLIMITED)
}

/// The memory cgroup paths in `/proc/self/cgroup`: `(v2 path, v1 memory path)`.
pub fn parse_proc_cgroup(text: &str) -> (Option<String>, Option<String>) {
    let mut v2 = None;
    let mut v1 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path.to_owned());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_owned());
        }
    }
    (v2, v1)
}

/// "8.0 GiB".
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The files of the agent's memory cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    events: PathBuf,
    limit: PathBuf,
}

impl MemoryCgroup {
    /// The agent's own memory cgroup under `/sys/fs/cgroup`, if one can be read.
    pub fn find() -> Option<MemoryCgroup> {
        let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        Self::find_in(Path::new("/sys/fs/cgroup"), &text)
    }

    /// Looks under `root` for the cgroup `proc_cgroup` names. In a container the cgroup
    /// filesystem is usually mounted at the container's own cgroup (the path in
    /// `/proc/self/cgroup` is the host's), so the root's files are the fallback.
    pub fn find_in(root: &Path, proc_cgroup: &str) -> Option<MemoryCgroup> {
        let (v2, v1) = parse_proc_cgroup(proc_cgroup);
        let candidates = |base: PathBuf, path: Option<String>| {
            let mut dirs = Vec::new();
            if let Some(path) = path {
                dirs.push(base.join(path.trim_start_matches('/')));
            }
            dirs.push(base);
            dirs
        };
        for dir in candidates(root.join("memory"), v1) {
            if dir.join("memory.oom_control").is_file() {
                return Some(MemoryCgroup {
                    events: dir.join("memory.oom_control"),
                    limit: dir.join("memory.limit_in_bytes"),
                });
            }
        }
        for dir in candidates(root.to_path_buf(), v2) {
            if dir.join("memory.events").is_file() {
                return Some(MemoryCgroup {
                    events: dir.join("memory.events"),
                    limit: dir.join("memory.max"),
                });
            }
        }
        None
    }

    /// OOM kills in this cgroup so far.
    pub fn oom_kills(&self) -> Option<u64> {
        parse_oom_kills(&std::fs::read_to_string(&self.events).ok()?)
    }

    /// The memory limit, if there is one.
    pub fn limit(&self) -> Option<u64> {
        parse_limit(&std::fs::read_to_string(&self.limit).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Captured from a cgroup v2 container after one OOM kill (kernel 6.1).
    const V2_EVENTS: &str = "low 0\nhigh 0\nmax 27\noom 1\noom_kill 1\noom_group_kill 0\n";
    // Captured from a cgroup v1 container (docker run --memory 256m) after two OOM kills.
    const V1_OOM_CONTROL: &str = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n";

    #[test]
    fn oom_kill_counts_of_both_versions() {
        assert_eq!(parse_oom_kills(V2_EVENTS), Some(1));
        assert_eq!(parse_oom_kills(V1_OOM_CONTROL), Some(2));
        // A kernel before 4.13 has no oom_kill line in v1.
        assert_eq!(parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n"), None);
    }

    #[test]
    fn limits_of_both_versions() {
        assert_eq!(parse_limit("8589934592\n"), Some(8 << 30));
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(human_bytes(8 << 30), "8.0 GiB");
        assert_eq!(human_bytes(256 << 20), "256.0 MiB");
        assert_eq!(human_bytes(512), "512 B");
    }

    #[test]
    fn the_memory_cgroup_of_proc_self_cgroup() {
        let v1 = "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n";
        assert_eq!(parse_proc_cgroup(v1), (None, Some("/docker/abc".into())));
        assert_eq!(parse_proc_cgroup("0::/\n"), (Some("/".into()), None));
    }

    #[test]
    fn files_are_found_in_the_container_or_at_the_mount_root() {
        let root = std::env::temp_dir().join(format!("muster-cgroup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // v2 with a namespaced path that exists.
        let dir = root.join("v2/kubepods/pod1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.events"), V2_EVENTS).unwrap();
        std::fs::write(dir.join("memory.max"), "8589934592\n").unwrap();
        let cg = MemoryCgroup::find_in(&root.join("v2"), "0::/kubepods/pod1\n").unwrap();
        assert_eq!((cg.oom_kills(), cg.limit()), (Some(1), Some(8 << 30)));
        // v1 whose host path is not visible: the mount root is the container's cgroup.
        let dir = root.join("v1/memory");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.oom_control"), V1_OOM_CONTROL).unwrap();
        std::fs::write(dir.join("memory.limit_in_bytes"), "268435456\n").unwrap();
        let cg = MemoryCgroup::find_in(&root.join("v1"), "4:memory:/docker/abc\n").unwrap();
        assert_eq!((cg.oom_kills(), cg.limit()), (Some(2), Some(256 << 20)));
        assert_eq!(MemoryCgroup::find_in(&root.join("none"), "0::/\n"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
