//! The one place where the agent waits for children.
//!
//! Every SIGCHLD wakes one task that waits (`WNOHANG`) for each registered worker and reports its
//! exit through a channel, then reaps the orphans re-parented to the agent (it is a child
//! subreaper, or PID 1), so no zombie survives. Worker exits are events, never polled.
//!
//! Orphans are found in `/proc/self/task/*/children` and recognised by their session: every
//! worker is a session leader, so its descendants are outside the agent's session, while a child
//! that other agent code started (`std::process`, `tokio::process`) is inside it and is left to
//! its owner's `wait`. Without /proc the reaper falls back to `waitpid(-1)`, which would take
//! such children's statuses too; spawn through [`Reaper::spawn_worker`] to get exits as events
//! anyway.
//! The pid table is process-wide, so several launches in one process (tests, an in-process dry
//! run) may each start a reaper: whichever reaps a pid reports it to the launch that spawned it.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};

use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Exited(i32),
    Signaled(Signal),
}

impl ExitStatus {
    pub fn success(self) -> bool {
        self == ExitStatus::Exited(0)
    }

    /// The shell's convention: the code, or 128 + the signal number.
    pub fn exit_code(self) -> u8 {
        match self {
            ExitStatus::Exited(c) => (c & 0xff) as u8,
            ExitStatus::Signaled(s) => crate::exit_code::for_signal(s as i32),
        }
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Exited(c) => write!(f, "exit code {c}"),
            ExitStatus::Signaled(s) => write!(f, "signal {} ({})", s.as_str(), *s as i32),
        }
    }
}

/// A process started by [`Reaper::spawn_worker`]: its pid and its stdout and stderr. There is no
/// `wait`: the exit arrives as an [`ExitReport`].
#[derive(Debug)]
pub struct Spawned {
    pub pid: u32,
    pub stdout: Option<std::process::ChildStdout>,
    pub stderr: Option<std::process::ChildStderr>,
}

/// An exit report: the caller's tag for the process, and how it ended.
pub type ExitReport = (usize, ExitStatus);

struct Entry {
    tag: usize,
    tx: mpsc::UnboundedSender<ExitReport>,
}

/// Every child spawned through a [`Reaper`] that has not been reaped yet.
static CHILDREN: LazyLock<Mutex<HashMap<Pid, Entry>>> = LazyLock::new(Mutex::default);

/// Handle to the reaper; cheap to clone.
#[derive(Clone)]
pub struct Reaper {
    children: &'static Mutex<HashMap<Pid, Entry>>,
}

impl Reaper {
    /// Makes the agent a child subreaper and starts reaping. Must run inside the runtime before
    /// the first spawn, so no SIGCHLD is missed.
    pub fn start() -> std::io::Result<Reaper> {
        // As PID 1 this is implied; elsewhere it makes orphaned grandchildren ours to reap.
        let _ = nix::sys::prctl::set_child_subreaper(true);
        let mut sigchld = signal(SignalKind::child())?;
        let reaper = Reaper {
            children: &CHILDREN,
        };
        let task = reaper.clone();
        tokio::spawn(async move {
            loop {
                task.reap_all();
                if sigchld.recv().await.is_none() {
                    break;
                }
            }
        });
        Ok(reaper)
    }

    fn lock(&self) -> MutexGuard<'static, HashMap<Pid, Entry>> {
        self.children.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn reap_all(&self) {
        // Holding the lock while waiting means a child that exits before
        // [`Reaper::spawn_worker`] has registered it stays a zombie until the next pass instead
        // of being reaped unknown.
        let mut children = self.lock();
        let known: Vec<Pid> = children.keys().copied().collect();
        for pid in known {
            if let Some(status) = try_wait(pid) {
                Self::report(&mut children, pid, status);
            }
        }
        // Most passes (a worker's exit, the first pass) leave no other child to reap: then the
        // walk of /proc below has nothing to find.
        if child_state() != ChildState::SomeEnded {
            return;
        }
        match orphans(&children) {
            Some(orphans) => {
                for pid in orphans {
                    if let Some(status) = try_wait(pid) {
                        tracing::debug!("reaped orphan {pid} ({status})");
                    }
                }
            }
            // No /proc: fall back to reaping whatever is waitable.
            None => loop {
                match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::Exited(pid, code)) => {
                        Self::report(&mut children, pid, ExitStatus::Exited(code));
                    }
                    Ok(WaitStatus::Signaled(pid, sig, _)) => {
                        Self::report(&mut children, pid, ExitStatus::Signaled(sig));
                    }
                    Err(nix::errno::Errno::EINTR) => {}
                    _ => break,
                }
            },
        }
    }

    fn report(children: &mut HashMap<Pid, Entry>, pid: Pid, status: ExitStatus) {
        if let Some(entry) = children.remove(&pid) {
            let _ = entry.tx.send((entry.tag, status));
        } else {
            tracing::debug!("reaped orphan {pid} ({status})");
        }
    }

    /// Starts the worker `cmd` and reports its exit as `(tag, status)` on `exits`. The lock is
    /// held from the start to the registration: a worker that exits at once is reaped only
    /// once it is known.
    pub fn spawn_worker(
        &self,
        cmd: &crate::sys::WorkerCommand,
        tag: usize,
        exits: mpsc::UnboundedSender<ExitReport>,
    ) -> std::io::Result<Spawned> {
        let mut children = self.lock();
        let worker = cmd.spawn()?;
        children.insert(Pid::from_raw(worker.pid as i32), Entry { tag, tx: exits });
        Ok(Spawned {
            pid: worker.pid,
            stdout: Some(worker.stdout),
            stderr: Some(worker.stderr),
        })
    }

    /// Sends the exit of `pid` (spawned here) as `(tag, status)` on `exits` from now on: a warm
    /// standby handed to an attempt becomes one of its workers. False when `pid` was already
    /// reaped (its exit went to the old channel).
    pub fn retag(&self, pid: u32, tag: usize, exits: mpsc::UnboundedSender<ExitReport>) -> bool {
        match self.lock().get_mut(&Pid::from_raw(pid as i32)) {
            Some(entry) => {
                *entry = Entry { tag, tx: exits };
                true
            }
            None => false,
        }
    }

    /// Every child spawned through a reaper of this process and not reaped yet (the workers of
    /// every launch in the process).
    pub fn registered(&self) -> std::collections::HashSet<i32> {
        self.lock().keys().map(|pid| pid.as_raw()).collect()
    }

    /// Sends `sig` to the process group of every live child spawned here.
    pub fn signal_all(&self, sig: Signal) {
        for pid in self.lock().keys() {
            let _ = killpg(*pid, sig);
        }
    }
}

/// What this process's children (of any of its threads, of any kind: `__WALL`) are, as one
/// `waitid(WNOHANG | WNOWAIT)` tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ChildState {
    None,
    AllRunning,
    /// At least one has ended and waits to be reaped; also the answer when the kernel cannot say.
    SomeEnded,
}

/// One look at this process's children, reaping none.
pub(super) fn child_state() -> ChildState {
    use nix::sys::wait::{waitid, Id};
    let flags =
        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT | WaitPidFlag::__WALL;
    loop {
        return match waitid(Id::All, flags) {
            Err(nix::errno::Errno::ECHILD) => ChildState::None,
            Ok(WaitStatus::StillAlive) => ChildState::AllRunning,
            Err(nix::errno::Errno::EINTR) => continue,
            _ => ChildState::SomeEnded,
        };
    }
}

/// `waitpid(pid, WNOHANG)`: the status if `pid` has ended (and is now reaped).
fn try_wait(pid: Pid) -> Option<ExitStatus> {
    loop {
        return match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => Some(ExitStatus::Exited(code)),
            Ok(WaitStatus::Signaled(_, sig, _)) => Some(ExitStatus::Signaled(sig)),
            Err(nix::errno::Errno::EINTR) => continue,
            _ => None,
        };
    }
}

/// Children of this process that are not registered and are not in the agent's own session:
/// descendants of workers (each worker is a session leader) re-parented to the agent, or, as
/// PID 1, any process of the namespace that was orphaned. A child in the agent's session was
/// started by other code in the agent and is left to whoever waits for it. `None` when /proc
/// cannot tell.
fn orphans(known: &HashMap<Pid, Entry>) -> Option<Vec<Pid>> {
    let own_session = nix::unistd::getsid(None).ok()?;
    let mut found = Vec::new();
    // Orphans are re-parented to some thread of the subreaper, so look at every thread.
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(list) = std::fs::read_to_string(task.path().join("children")) else {
            continue;
        };
        for pid in list
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            let pid = Pid::from_raw(pid);
            if known.contains_key(&pid) {
                continue;
            }
            if nix::unistd::getsid(Some(pid)).is_ok_and(|sid| sid != own_session) {
                found.push(pid);
            }
        }
    }
    Some(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn other_code_keeps_its_own_children() {
        let reaper = Reaper::start().unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut ours = crate::sys::WorkerCommand::new("/bin/sh", nix::unistd::getpid());
        ours.args(["-c", "exit 7"]);
        let worker = reaper.spawn_worker(&ours, 5, tx).unwrap();
        assert!(worker.pid > 0);
        let mut foreign = std::process::Command::new("/bin/sh")
            .args(["-c", "exit 4"])
            .spawn()
            .unwrap();
        assert_eq!(
            rx.recv().await,
            Some((5, ExitStatus::Exited(7))),
            "the worker's exit is an event"
        );
        // Let the reaper see the foreign child's SIGCHLD too; it must leave the status alone.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(foreign.wait().unwrap().code(), Some(4));
    }

    #[tokio::test]
    async fn an_orphaned_grandchild_is_reaped_when_it_ends() {
        use std::io::Read as _;
        let reaper = Reaper::start().unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        // The worker leaves a child behind, which is re-parented to this process (a subreaper)
        // and ends after the worker's own exit was reported.
        let mut worker = crate::sys::WorkerCommand::new("/bin/sh", nix::unistd::getpid());
        worker.args(["-c", "sleep 0.3 & echo $!"]);
        let spawned = reaper.spawn_worker(&worker, 9, tx).unwrap();
        assert_eq!(rx.recv().await, Some((9, ExitStatus::Exited(0))));
        let mut out = String::new();
        spawned.stdout.unwrap().read_to_string(&mut out).unwrap();
        let orphan: i32 = out.trim().parse().expect("the orphan's pid");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // A zombie keeps its /proc entry until someone reaps it.
        while std::path::Path::new(&format!("/proc/{orphan}")).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "orphan {orphan} not reaped"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}
