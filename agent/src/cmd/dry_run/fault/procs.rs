//! The workers of the dry run's agents, as `/proc` shows them: the direct children of each agent
//! (muster execs every worker itself), with the rank, world size and restart count muster put in
//! their environment. One walk costs a few milliseconds.
//!
//! Why `/proc` and not the agents' logs or metrics: it is what actually runs, in either log
//! format, with metrics off, and whatever the agents' messages say; and a worker's environment
//! names its global rank exactly, which is what `kill-rank` needs.

use std::collections::HashSet;

use nix::unistd::Pid;

use crate::launch::standby;
use crate::launch::strays::parse_stat;

/// One running worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub pid: i32,
    /// With the pid, the process's identity (a pid can be reused, a start time cannot).
    pub start_time: u64,
    /// The dry run's node whose agent started it.
    pub node: u32,
    /// `RANK`, `WORLD_SIZE` and `TORCHELASTIC_RESTART_COUNT` from its environment.
    pub rank: Option<u32>,
    pub world_size: Option<u32>,
    pub restart_count: Option<u32>,
    /// Connected to its `MASTER_PORT` (only looked at when asked; else false).
    pub joined: bool,
}

impl Worker {
    /// The process's identity.
    pub fn id(&self) -> (i32, u64) {
        (self.pid, self.start_time)
    }
}

/// What muster put in a worker's environment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Env {
    pub rank: Option<u32>,
    pub world_size: Option<u32>,
    pub restart_count: Option<u32>,
    pub master_port: Option<u16>,
}

/// The inodes of the established TCP connections to one of `ports` in a `/proc/net/tcp` (or
/// `tcp6`) table.
pub fn connections_to(table: &str, ports: &[u16]) -> HashSet<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|row| {
            let cols: Vec<&str> = row.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode; 01 is ESTABLISHED.
            let port = u16::from_str_radix(cols.get(2)?.rsplit_once(':')?.1, 16).ok()?;
            (*cols.get(3)? == "01" && ports.contains(&port)).then(|| cols.get(9)?.parse().ok())?
        })
        .collect()
}

/// The socket inodes among `pid`'s open files.
fn socket_inodes(pid: i32) -> HashSet<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return HashSet::new();
    };
    fds.flatten()
        .filter_map(|fd| {
            let target = std::fs::read_link(fd.path()).ok()?;
            target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// Which of `workers` hold a connection to their `MASTER_PORT`.
fn mark_joined(workers: &mut [Worker], ports: &[(i32, u16)]) {
    let mut wanted: Vec<u16> = ports.iter().map(|(_, p)| *p).collect();
    wanted.sort_unstable();
    wanted.dedup();
    if wanted.is_empty() {
        return;
    }
    let mut established = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            established.extend(connections_to(&text, &wanted));
        }
    }
    for w in workers.iter_mut() {
        w.joined = ports.iter().any(|(pid, _)| *pid == w.pid)
            && !socket_inodes(w.pid).is_disjoint(&established);
    }
}

/// What muster put in a worker's environment, from the NUL-separated bytes of
/// `/proc/PID/environ`: `RANK`, `WORLD_SIZE`, `TORCHELASTIC_RESTART_COUNT` and `MASTER_PORT`.
pub fn parse_environ(environ: &[u8]) -> Env {
    let mut found = Env::default();
    for (key, value) in environ_entries(environ) {
        let (Ok(key), Ok(value)) = (std::str::from_utf8(key), std::str::from_utf8(value)) else {
            continue;
        };
        match key {
            "RANK" => found.rank = value.parse().ok(),
            "WORLD_SIZE" => found.world_size = value.parse().ok(),
            "TORCHELASTIC_RESTART_COUNT" => found.restart_count = value.parse().ok(),
            "MASTER_PORT" => found.master_port = value.parse().ok(),
            _ => {}
        }
    }
    found
}

/// The `KEY=VALUE` entries of NUL-separated environment bytes, split at the first `=`.
fn environ_entries(environ: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    environ.split(|b| *b == 0).filter_map(|entry| {
        let eq = entry.iter().position(|b| *b == b'=')?;
        Some((&entry[..eq], &entry[eq + 1..]))
    })
}

/// The module list's path in a warm standby's environment (`None`: not a standby).
fn standby_list(environ: &[u8]) -> Option<std::ffi::OsString> {
    use std::os::unix::ffi::OsStrExt;
    environ_entries(environ)
        .find(|(key, _)| *key == standby::LIST_ENV.as_bytes())
        .map(|(_, path)| std::ffi::OsStr::from_bytes(path).to_owned())
}

/// The live (not zombie) children of `agents` (`(node, agent pid)`); empty without `/proc`.
/// With `sockets`, also whether each has joined its process group.
pub fn workers(agents: &[(u32, Pid)], sockets: bool) -> Vec<Worker> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut ports: Vec<(i32, u16)> = Vec::new();
    let mut found: Vec<Worker> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?))
        .filter(|stat| !stat.zombie)
        .filter_map(|stat| {
            let node = agents
                .iter()
                .find(|(_, agent)| agent.as_raw() == stat.ppid)
                .map(|(node, _)| *node)?;
            // A worker that exits between the two reads has no environment: skip it.
            let environ = std::fs::read(format!("/proc/{}/environ", stat.pid)).ok()?;
            let env = match standby_list(&environ) {
                // A warm standby: a rank once handed over (its start environment lacks what
                // the rank got), none while it waits.
                Some(list) => {
                    let dir = std::path::Path::new(&list).parent()?;
                    let pid = u32::try_from(stat.pid).ok()?;
                    parse_environ(&std::fs::read(standby::handed_env_path(dir, pid)).ok()?)
                }
                None => parse_environ(&environ),
            };
            Some((
                Worker {
                    pid: stat.pid,
                    start_time: stat.start_time,
                    node,
                    rank: env.rank,
                    world_size: env.world_size,
                    restart_count: env.restart_count,
                    joined: false,
                },
                env.master_port,
            ))
        })
        .map(|(w, port)| {
            if let Some(port) = port.filter(|_| sockets) {
                ports.push((w.pid, port));
            }
            w
        })
        .collect();
    if sockets {
        mark_joined(&mut found, &ports);
    }
    found.sort_by_key(|w| (w.node, w.rank, w.pid));
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_names_rank_world_and_restart() {
        let env =
            b"PATH=/bin\0RANK=3\0WORLD_SIZE=6\0TORCHELASTIC_RESTART_COUNT=1\0MASTER_PORT=29500\0";
        assert_eq!(
            parse_environ(env),
            Env {
                rank: Some(3),
                world_size: Some(6),
                restart_count: Some(1),
                master_port: Some(29500)
            }
        );
        assert_eq!(
            parse_environ(b"RANK=x\0NOEQUALS\0\xff\xfe=1\0"),
            Env::default()
        );
        assert_eq!(parse_environ(b""), Env::default());
    }

    #[test]
    fn established_connections_to_the_port_are_found() {
        // Two rows of a real /proc/net/tcp: a listener on 29500 (0A) and a client connected to it.
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
            0: 0100007F:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0\n\
            1: 0100007F:9C40 0100007F:733C 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0 20 4 30 10 -1\n";
        assert_eq!(connections_to(table, &[29500]), [222].into());
        assert!(connections_to(table, &[29501]).is_empty());
    }

    #[test]
    fn a_child_of_an_agent_is_found_with_its_rank() {
        // This test process plays the agent: its child has RANK in its environment.
        // Its environment is only its own: the test runner's is no part of what is checked.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RANK", "4")
            .env("WORLD_SIZE", "6")
            .spawn()
            .unwrap();
        let me = nix::unistd::getpid();
        let pid = child.id() as i32;
        // Other tests of this process start and end children meanwhile; look a few times
        // before calling the child missing, and say what was seen.
        let mut found = Vec::new();
        for _ in 0..50 {
            found = workers(&[(2, me)], true);
            if found.iter().any(|w| w.pid == pid) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        let w = found
            .iter()
            .find(|w| w.pid == pid)
            .unwrap_or_else(|| panic!("child {pid} not among {found:?}"));
        assert_eq!(
            (w.node, w.rank, w.world_size, w.restart_count, w.joined),
            (2, Some(4), Some(6), None, false)
        );
        assert!(workers(&[(0, Pid::from_raw(i32::MAX))], false).is_empty());
    }

    #[test]
    fn a_standby_counts_only_once_handed_over_and_with_the_rank_it_became() {
        let dir = std::env::temp_dir().join(format!("muster-procs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let list = dir.join("standby_1.json");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env(standby::LIST_ENV, &list)
            .env("LOCAL_RANK", "1")
            .spawn()
            .unwrap();
        let me = nix::unistd::getpid();
        let pid = child.id() as i32;
        let find = || {
            // As above: other tests' children come and go; look a few times.
            let mut found = None;
            for _ in 0..25 {
                found = workers(&[(1, me)], false)
                    .into_iter()
                    .find(|w| w.pid == pid);
                if found.is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            found
        };
        // Waiting: not a worker at all (its environment has no RANK, it belongs to no world).
        assert_eq!(find(), None);
        std::fs::write(
            standby::handed_env_path(&dir, child.id()),
            b"RANK=3\0WORLD_SIZE=4\0TORCHELASTIC_RESTART_COUNT=2\0",
        )
        .unwrap();
        let w = find();
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        let w = w.expect("the handed-over standby is a worker");
        assert_eq!(
            (w.node, w.rank, w.world_size, w.restart_count),
            (1, Some(3), Some(4), Some(2))
        );
    }
}
