//! The one place where the agent waits for children.
//!
//! Every SIGCHLD wakes one task that calls `waitpid(-1, WNOHANG)` until nothing is left, maps
//! each pid back to the worker it belongs to and reports the exit through a channel. Pids it does
//! not know are orphans re-parented to the agent (it is a child subreaper, or PID 1) and are
//! simply reaped, so no zombie survives. Worker exits are events, never polled.
//!
//! Because this reaps *every* child, nothing else in the agent process may wait for children of
//! its own (`tokio::process`, `std::process::Child::wait`): spawn through [`Reaper::spawn`]
//! instead and receive the exit status as an event.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

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

/// An exit report: the caller's tag for the process, and how it ended.
pub type ExitReport = (usize, ExitStatus);

struct Entry {
    tag: usize,
    tx: mpsc::UnboundedSender<ExitReport>,
}

/// Handle to the reaper task; cheap to clone.
#[derive(Clone)]
pub struct Reaper {
    children: Arc<Mutex<HashMap<Pid, Entry>>>,
}

impl Reaper {
    /// Makes the agent a child subreaper and starts reaping. Must run inside the runtime before
    /// the first spawn, so no SIGCHLD is missed.
    pub fn start() -> std::io::Result<Reaper> {
        // As PID 1 this is implied; elsewhere it makes orphaned grandchildren ours to reap.
        let _ = nix::sys::prctl::set_child_subreaper(true);
        let mut sigchld = signal(SignalKind::child())?;
        let reaper = Reaper {
            children: Arc::default(),
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Pid, Entry>> {
        self.children.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn reap_all(&self) {
        // Holding the lock while waiting means a child that exits before [`Reaper::spawn`] has
        // registered it stays a zombie until the next pass instead of being reaped unknown.
        let mut children = self.lock();
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => {
                    Self::report(&mut children, pid, ExitStatus::Exited(code));
                }
                Ok(WaitStatus::Signaled(pid, sig, _)) => {
                    Self::report(&mut children, pid, ExitStatus::Signaled(sig));
                }
                Ok(WaitStatus::StillAlive) | Err(nix::errno::Errno::ECHILD) => break,
                Err(nix::errno::Errno::EINTR) | Ok(_) => {}
                Err(e) => {
                    tracing::warn!("waitpid failed: {e}");
                    break;
                }
            }
        }
    }

    fn report(children: &mut HashMap<Pid, Entry>, pid: Pid, status: ExitStatus) {
        if let Some(entry) = children.remove(&pid) {
            let _ = entry.tx.send((entry.tag, status));
        } else {
            tracing::debug!("reaped orphan {pid} ({status})");
        }
    }

    /// Spawns `cmd` and reports its exit as `(tag, status)` on `exits`.
    pub fn spawn(
        &self,
        cmd: &mut std::process::Command,
        tag: usize,
        exits: mpsc::UnboundedSender<ExitReport>,
    ) -> std::io::Result<std::process::Child> {
        let mut children = self.lock();
        let child = cmd.spawn()?;
        let pid = Pid::from_raw(child.id() as i32);
        children.insert(pid, Entry { tag, tx: exits });
        Ok(child)
    }

    /// Sends `sig` to the process group of every live child spawned here.
    pub fn signal_all(&self, sig: Signal) {
        for pid in self.lock().keys() {
            let _ = killpg(*pid, sig);
        }
    }
}
