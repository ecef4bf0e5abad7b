//! The agent's only `unsafe`: starting a worker ([`WorkerCommand`], a `posix_spawn`-style clone
//! whose child runs only system calls until it execs), the code that runs in muster's other
//! freshly forked children between `fork` and `exec`, and [`lower_this_threads_priority`] (one
//! system call on plain integers, which nix does not wrap).
//!
//! A worker runs in its own session and process group (so a stop signal reaches the worker's own
//! children too, and a terminal's Ctrl-C reaches only the agent), and the kernel SIGKILLs it when
//! the agent dies (`PR_SET_PDEATHSIG`), so no worker outlives a SIGKILLed agent.
//! [`die_with_parent`] does the same parent-death half for muster's other children (the dry
//! run's agents, the GPU pre-flight's helper), which std's `Command` forks: there only
//! async-signal-safe system calls run and nothing allocates, since the agent has other threads
//! and one of them may have held the allocator's lock at fork time.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process. The
//! agent therefore spawns workers only from its runtime's long-lived thread (the main thread of a
//! current-thread runtime), never from `spawn_blocking`, whose threads retire when idle.
#![allow(unsafe_code)]

mod spawn;

use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::sys::signal::Signal;
use nix::unistd::Pid;

pub use spawn::{StartedWorker, WorkerCommand};

/// Asks the kernel to SIGKILL the child started by `cmd` when `parent` (the calling process, whose
/// calling *thread* must outlive the child: see the module doc) dies.
pub fn die_with_parent(cmd: &mut Command, parent: Pid) {
    let hook = move || -> std::io::Result<()> {
        nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
        // The parent may have died between fork and prctl; then nobody would ever kill us.
        if nix::unistd::getppid() != parent {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the hook only makes async-signal-safe system calls (prctl, getppid) and does not
    // allocate; the error it may return is built from a raw errno.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// Gives the calling thread the lowest CPU priority (nice 19), for the agent's background work
/// that must not take CPU time from the ranks (a snapshot written to storage). For the thread's
/// whole life: an unprivileged thread cannot raise its priority back, so call it only on a
/// thread of its own.
pub fn lower_this_threads_priority() {
    let tid = nix::unistd::gettid().as_raw();
    // SAFETY: setpriority reads and writes no memory of ours; a failure leaves the priority.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19) };
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt as _;
    use std::process::Command;

    use super::{die_with_parent, lower_this_threads_priority};

    /// The nice value of the calling thread (field 19 of its stat line, after the command's
    /// closing parenthesis).
    fn own_nice() -> i64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("a stat line");
        let after = &stat[stat.rfind(')').expect("a command") + 2..];
        after
            .split(' ')
            .nth(16)
            .expect("19 fields")
            .parse()
            .expect("a number")
    }

    #[test]
    fn a_lowered_thread_runs_at_nice_19_and_the_others_do_not() {
        let before = own_nice();
        let lowered = std::thread::spawn(|| {
            lower_this_threads_priority();
            own_nice()
        })
        .join()
        .expect("the thread ran");
        assert_eq!(lowered, 19);
        assert_eq!(own_nice(), before);
    }

    #[test]
    fn a_child_dies_with_the_thread_that_started_it() {
        // PR_SET_PDEATHSIG follows the forking thread: a thread that exits stands in for a parent
        // that was SIGKILLed, without killing the test.
        let child = std::thread::spawn(|| {
            let mut cmd = Command::new("sleep");
            cmd.arg("60");
            die_with_parent(&mut cmd, nix::unistd::getpid());
            cmd.spawn()
        })
        .join()
        .expect("the spawning thread ran");
        let mut child = child.expect("sleep starts");
        let status = child.wait().expect("wait for sleep");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
    }
}
