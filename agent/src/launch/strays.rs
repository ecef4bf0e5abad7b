//! An attempt owns its process tree: whatever its ranks started — in their session or not
//! (`setsid`, `Popen(start_new_session=True)`), double-forked or not — is stopped with the attempt
//! (SIGTERM, SIGKILL after the grace), before the next attempt starts and before the agent exits.
//!
//! The mechanism is `/proc`, because it works everywhere (cgroup v1 hosts and containers, where
//! the agent may not create a cgroup). It relies on the agent being the child subreaper (or PID 1):
//! a process of the attempt whose parent dies is re-parented to the nearest subreaper above it,
//! which is the agent unless a process of the attempt made itself one, and that process is then
//! itself in the tree. So at any moment every process of the attempt is either a descendant of a
//! worker or a descendant of an agent child that is not in the agent's session (every worker is
//! a session leader, and no descendant can join the agent's session). One walk of `/proc` by
//! parent pid at stop time therefore finds all of them; the walk is repeated until it comes back
//! empty, so a process forked during the stop is caught by the next walk.
//!
//! Processes are identified by pid *and* start time (`/proc/PID/stat` field 22), and the start
//! time is checked again right before every signal, so a reused pid is never signalled.
//!
//! What it cannot catch: a process that was never a descendant (started through a daemon:
//! `docker run`, `systemd-run`, `ssh localhost`), and an orphan re-parented to the agent whose
//! start time is before the attempt began (the agent cannot tell whose it is: as PID 1 that may
//! be a `kubectl exec` session). Conversely, as PID 1 an orphaned `kubectl exec` process started
//! *during* the attempt looks like the attempt's and is stopped with it. Likewise, with several
//! launches in one process (tests, embedders) another launch's workers and their descendants are
//! left alone, but an orphan of theirs that the agent adopts during this attempt is taken for this
//! attempt's.
//!
//! A cgroup per attempt would add one thing: its membership outlives a SIGKILLed agent, so
//! someone could still stop the tree. It is not used because Docker on cgroup v1 hosts, and pods
//! without cgroup delegation, give the agent no cgroup it may create, and one mechanism that
//! works everywhere is easier to reason about than two.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::signals::StopRequest;

/// How often the tree is walked again while it gets its grace period.
const POLL: Duration = Duration::from_millis(50);
/// After SIGKILL, how long to wait for the kernel to deliver the exits.
const KILL_WAIT: Duration = Duration::from_secs(10);
/// Pids named in the log line; the count covers the rest.
const NAMED_IN_LOG: usize = 12;

/// One process, as `/proc/PID/stat` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    pub comm: String,
    pub ppid: i32,
    pub session: i32,
    /// Clock ticks after boot; with the pid, the process's identity.
    pub start_time: u64,
    pub zombie: bool,
}

/// Parses the text of `/proc/PID/stat` (`comm` may itself contain spaces and parentheses).
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let pid = text.get(..open)?.trim().parse().ok()?;
    let comm = text.get(open + 1..close)?.to_owned();
    let rest: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    // After the comm: state(3) ppid(4) pgrp(5) session(6) ... starttime(22).
    Some(ProcStat {
        pid,
        comm,
        zombie: matches!(*rest.first()?, "Z" | "X"),
        ppid: rest.get(1)?.parse().ok()?,
        session: rest.get(3)?.parse().ok()?,
        start_time: rest.get(19)?.parse().ok()?,
    })
}

fn read_stat(pid: i32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The processes a walk of `scope` must look at: every descendant of the agent, found through
/// the kernel's `/proc/PID/task/TID/children` lists, so the cost follows the attempt's tree and
/// not the machine (2,048 agents and their ranks on one host made a full walk 4,000 reads per
/// agent, the largest part of an agent's CPU at that scale). Like a full walk it sees a process
/// forked while it reads only at the next walk, which [`stop_tree`] repeats until empty. Falls
/// back to every process when the kernel has no `children` files (built without
/// `CONFIG_PROC_CHILDREN`); `None` without `/proc`.
fn candidates(scope: &Scope) -> Option<Vec<ProcStat>> {
    // Every process of the attempt is the agent's child or descends from one: an agent with no
    // child at all (the common end of an attempt whose workers were reaped) has nothing to walk.
    if scope.agent == nix::unistd::getpid().as_raw()
        && super::reaper::child_state() == super::reaper::ChildState::None
    {
        return Some(Vec::new());
    }
    descendants(scope.agent).or_else(all_processes)
}

/// Every descendant of `root`; `None` when `root`'s own `children` lists cannot be read.
fn descendants(root: i32) -> Option<Vec<ProcStat>> {
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    let mut queue = vec![root];
    // A process that exits while we walk re-parents its children to the agent (the subreaper)
    // after we may have read the agent's list: read it again until no one vanished, so an orphan
    // of that moment is not missed by a walk that then looks empty.
    let mut rereads = 0;
    loop {
        let mut vanished = false;
        while let Some(pid) = queue.pop() {
            let Some(children) = children_of(pid) else {
                if pid == root {
                    return None;
                }
                vanished = true;
                continue;
            };
            for child in children {
                if seen.insert(child) {
                    if let Some(stat) = read_stat(child) {
                        found.push(stat);
                        queue.push(child);
                    }
                }
            }
        }
        if !vanished || rereads == MAX_REREADS {
            return Some(found);
        }
        rereads += 1;
        queue.push(root);
    }
}

/// Rereads of the agent's children after a process vanished mid-walk; a bound, not a wait.
const MAX_REREADS: u32 = 4;

/// The children of `pid`, from every one of its threads (a child belongs to the thread that
/// forked it, or, re-parented, to some thread of the subreaper).
fn children_of(pid: i32) -> Option<Vec<i32>> {
    let mut out = Vec::new();
    let mut any = false;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let Ok(list) = std::fs::read_to_string(task.path().join("children")) else {
            continue;
        };
        any = true;
        out.extend(
            list.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok()),
        );
    }
    any.then_some(out)
}

/// Every process this agent can see; `None` without `/proc`.
fn all_processes() -> Option<Vec<ProcStat>> {
    let entries = std::fs::read_dir("/proc").ok()?;
    Some(
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter_map(read_stat)
            .collect(),
    )
}

/// Clock ticks since boot now, in the unit of [`ProcStat::start_time`] (`None` without `/proc`).
pub fn ticks_now() -> Option<u64> {
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    let secs: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|hz| *hz > 0)?;
    // Truncation is fine: one tick of slack is subtracted by the caller.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let ticks = (secs * hz as f64) as u64;
    Some(ticks)
}

/// Whose processes a walk collects: this agent's, for one attempt.
#[derive(Debug, Clone)]
pub struct Scope {
    pub agent: i32,
    pub agent_session: i32,
    /// Ticks since boot when the attempt began: an orphan re-parented to the agent belongs to
    /// the attempt only if it started at or after this.
    pub since: u64,
    /// Agent children that are some other launch's workers in this process (tests, embedders).
    pub foreign: HashSet<i32>,
    /// Agent children that belong to the attempt although they started before it: warm
    /// standbys it took its ranks from.
    pub adopted: HashSet<i32>,
}

impl Scope {
    /// The scope of an attempt starting now in this process; `None` without `/proc`.
    pub fn starting_now() -> Option<Scope> {
        Some(Scope {
            agent: nix::unistd::getpid().as_raw(),
            agent_session: nix::unistd::getsid(None).ok()?.as_raw(),
            // Two ticks of slack: `/proc/uptime` and the start times are rounded differently.
            since: ticks_now()?.saturating_sub(2),
            foreign: HashSet::new(),
            adopted: HashSet::new(),
        })
    }
}

/// The live processes of the attempt in `procs`: every descendant of an agent child outside the
/// agent's session that started within the attempt (its workers and the orphans re-parented to
/// the agent), those children included.
pub fn attempt_tree(procs: &[ProcStat], scope: &Scope) -> Vec<ProcStat> {
    let mut children: HashMap<i32, Vec<&ProcStat>> = HashMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(p);
    }
    let mut queue: VecDeque<&ProcStat> = children
        .get(&scope.agent)
        .into_iter()
        .flatten()
        .copied()
        .filter(|p| {
            p.session != scope.agent_session
                && (p.start_time >= scope.since || scope.adopted.contains(&p.pid))
                && !scope.foreign.contains(&p.pid)
        })
        .collect();
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    while let Some(p) = queue.pop_front() {
        if !seen.insert(p.pid) {
            continue;
        }
        queue.extend(children.get(&p.pid).into_iter().flatten().copied());
        if !p.zombie {
            found.push(p.clone());
        }
    }
    found
}

/// Sends `sig` to `p` if the pid still names the same process (same start time).
fn signal(p: &ProcStat, sig: Signal) -> bool {
    let same = read_stat(p.pid).is_some_and(|now| now.start_time == p.start_time && !now.zombie);
    if same {
        let _ = kill(Pid::from_raw(p.pid), sig);
        if sig == Signal::SIGTERM {
            // A stopped (SIGSTOP, ^Z) process would hold the TERM pending until the KILL.
            let _ = kill(Pid::from_raw(p.pid), Signal::SIGCONT);
        }
    }
    same
}

/// What a stop did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stopped {
    /// Every process that was signalled: pid and command name.
    pub processes: Vec<(i32, String)>,
    /// How many of them needed SIGKILL.
    pub killed: usize,
    /// Still there after SIGKILL and [`KILL_WAIT`] (uninterruptible sleep).
    pub survivors: Vec<i32>,
}

impl Stopped {
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.processes
            .iter()
            .filter_map(|(pid, _)| u32::try_from(*pid).ok())
    }

    /// `1234 (python3), 1240 (sleep)`, the first [`NAMED_IN_LOG`] of them.
    pub fn named(&self) -> String {
        let mut text: Vec<String> = self
            .processes
            .iter()
            .take(NAMED_IN_LOG)
            .map(|(pid, comm)| format!("{pid} ({comm})"))
            .collect();
        if self.processes.len() > NAMED_IN_LOG {
            text.push(format!("and {} more", self.processes.len() - NAMED_IN_LOG));
        }
        text.join(", ")
    }
}

/// Stops the attempt's whole tree: SIGTERM to every process, SIGKILL to those left after
/// `grace` (at once when kill-now is asked), walking `/proc` again every [`POLL`] so processes
/// forked meanwhile are caught. Returns at once when the tree is already empty.
///
/// `foreign` gives the agent children that are other launches' workers in this process; it is
/// asked after each read of `/proc`, so a worker another launch spawned meanwhile (spawn and
/// registration happen under one lock) is already known when it is seen.
pub async fn stop_tree(
    scope: &Scope,
    grace: Duration,
    stop: &StopRequest,
    foreign: &(dyn Fn() -> Vec<i32> + Sync),
) -> Stopped {
    let mut scope = scope.clone();
    let mut out = Stopped::default();
    let mut signalled: HashSet<(i32, u64)> = HashSet::new();
    let mut killed: HashSet<(i32, u64)> = HashSet::new();
    let term_until = tokio::time::Instant::now() + grace;
    let kill_until = term_until + KILL_WAIT;
    loop {
        let Some(procs) = candidates(&scope) else {
            return out;
        };
        scope.foreign = foreign().into_iter().collect();
        let tree = attempt_tree(&procs, &scope);
        if tree.is_empty() {
            return out;
        }
        let now = tokio::time::Instant::now();
        let escalate = now >= term_until || stop.is_killed_now();
        if escalate && now >= kill_until {
            out.survivors = tree.iter().map(|p| p.pid).collect();
            return out;
        }
        for p in &tree {
            let id = (p.pid, p.start_time);
            let sig = if escalate {
                Signal::SIGKILL
            } else {
                Signal::SIGTERM
            };
            if sig == Signal::SIGTERM && signalled.contains(&id) {
                continue;
            }
            if signal(p, sig) {
                if signalled.insert(id) {
                    out.processes.push((p.pid, p.comm.clone()));
                }
                if sig == Signal::SIGKILL && killed.insert(id) {
                    out.killed += 1;
                }
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// SIGKILLs the attempt's tree once, synchronously: for an attempt abandoned half-way.
/// `foreign` gives the agent children that are other launches' workers, as for [`stop_tree`]:
/// without it, a launch abandoned beside others killed their workers started since its own.
pub fn kill_tree_now(scope: &Scope, foreign: &dyn Fn() -> Vec<i32>) {
    let mut scope = scope.clone();
    if let Some(procs) = candidates(&scope) {
        scope.foreign = foreign().into_iter().collect();
        for p in attempt_tree(&procs, &scope) {
            signal(&p, Signal::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: i32, ppid: i32, session: i32, start_time: u64) -> ProcStat {
        ProcStat {
            pid,
            comm: format!("p{pid}"),
            ppid,
            session,
            start_time,
            zombie: false,
        }
    }

    #[test]
    fn stat_lines_parse_with_odd_command_names() {
        let line = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    98765 1000 10 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 3 0 0";
        let s = parse_stat(line).unwrap();
        assert_eq!(s.pid, 4242);
        assert_eq!(s.comm, "a (weird) name");
        assert_eq!((s.ppid, s.session, s.start_time), (1, 4242, 98765));
        assert!(!s.zombie);
        assert!(
            parse_stat("12 (x) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 7")
                .unwrap()
                .zombie
        );
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("12 (x) S 1"), None);
    }

    #[test]
    fn the_tree_covers_workers_descendants_and_orphans_of_the_attempt() {
        let agent = 100;
        let scope = Scope {
            agent,
            agent_session: 100,
            since: 500,
            foreign: HashSet::from([300]),
            // A warm standby the attempt took a rank from, started before it.
            adopted: HashSet::from([240]),
        };
        let procs = vec![
            p(1, 0, 1, 0),
            p(agent, 1, 100, 10),
            // A worker (own session) and its child, and a setsid helper of that child.
            p(200, agent, 200, 600),
            p(201, 200, 200, 601),
            p(202, 201, 202, 602),
            // An orphan of the attempt re-parented to the agent, with a child of its own.
            p(210, agent, 210, 650),
            p(211, 210, 210, 651),
            // The agent's own helper (its session): not the attempt's.
            p(220, agent, 100, 700),
            // An orphan from before the attempt (a `kubectl exec` under PID 1).
            p(230, agent, 230, 400),
            // The adopted standby, now a rank, and its child.
            p(240, agent, 240, 450),
            p(241, 240, 240, 460),
            // Another launch's worker in this process.
            p(300, agent, 300, 700),
            p(301, 300, 300, 701),
            // Unrelated.
            p(400, 1, 400, 800),
        ];
        let mut pids: Vec<i32> = attempt_tree(&procs, &scope).iter().map(|p| p.pid).collect();
        pids.sort_unstable();
        assert_eq!(pids, vec![200, 201, 202, 210, 211, 240, 241]);
    }

    #[test]
    fn zombies_are_not_targets_but_their_children_are() {
        let scope = Scope {
            agent: 100,
            agent_session: 100,
            since: 0,
            foreign: HashSet::new(),
            adopted: HashSet::new(),
        };
        let mut zombie = p(200, 100, 200, 10);
        zombie.zombie = true;
        let procs = vec![zombie, p(201, 200, 200, 11)];
        let pids: Vec<i32> = attempt_tree(&procs, &scope).iter().map(|p| p.pid).collect();
        assert_eq!(pids, vec![201]);
    }

    #[test]
    fn named_lists_a_bounded_number() {
        let stopped = Stopped {
            processes: (0..20).map(|i| (i, "sleep".to_owned())).collect(),
            ..Stopped::default()
        };
        let text = stopped.named();
        assert!(text.starts_with("0 (sleep), 1 (sleep)"), "{text}");
        assert!(text.ends_with("and 8 more"), "{text}");
    }

    #[test]
    fn the_descendant_walk_finds_children_and_grandchildren_without_a_full_scan() {
        let me = nix::unistd::getpid().as_raw();
        let Some(before) = descendants(me) else {
            // A kernel without `children` files: the full walk is used instead.
            return;
        };
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30; wait"])
            .spawn()
            .expect("spawn sh");
        let sh = i32::try_from(child.id()).expect("pid");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut grandchildren = 0;
        while grandchildren < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            let now = descendants(me).expect("walk");
            grandchildren = now.iter().filter(|p| p.ppid == sh).count();
        }
        let now = descendants(me).expect("walk");
        for p in now.iter().filter(|p| p.ppid == sh) {
            let _ = kill(Pid::from_raw(p.pid), Signal::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(now.iter().any(|p| p.pid == sh && p.ppid == me));
        assert_eq!(grandchildren, 2, "both sleeps, children of sh");
        assert!(
            !before.iter().any(|p| p.pid == sh),
            "the walk sees the live tree"
        );
    }
}
