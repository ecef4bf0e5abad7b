//! Starting a worker the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)` instead of
//! `fork`.
//!
//! `fork` copies the agent's page tables (a tokio runtime, a metrics registry, the store: tens of
//! MiB mapped) and then both processes take copy-on-write faults until the child execs; a rank's
//! start paid 0.6–0.8 ms for it, about a tenth of a two-rank launch's overhead over starting the
//! ranks directly. A child that shares the agent's memory until `execve` costs neither. std's
//! `Command` does this itself (through `posix_spawn`) only when no `pre_exec` hook is set, and a
//! worker needs three: its own session, `PR_SET_PDEATHSIG`, and CPU affinity.
//!
//! Sharing memory is what makes the child's side delicate. It runs on a stack of its own while
//! the thread that cloned it is suspended until the `execve` (or `_exit`), so:
//! - everything it reads is built by the parent beforehand (argv, envp, every candidate path of
//!   the PATH search, the `/bin/sh` argv of a script without `#!`), and it allocates nothing,
//!   takes no lock and cannot panic;
//! - the parent blocks every signal before the clone, and the child, before unblocking them,
//!   puts every handled signal back to its default: an agent's handler run in the child would
//!   write to the agent's own signal pipe (a SIGTERM the agent never got). Signal *dispositions*
//!   are the child's own (no `CLONE_SIGHAND`), so this leaves the agent's untouched;
//! - it reports a failure by writing the errno into the shared [`ChildArgs`], which the parent
//!   reads once the clone returns.
//!
//! What the worker starts with matches std's `Command`: the signal mask empty, SIGPIPE at its
//! default (std ignores it in the agent), stdin inherited, stdout and stderr piped, the PATH
//! search of `execvp` (the child's PATH, `/bin:/usr/bin` without one, EACCES reported only when no
//! candidate was found, a file without `#!` run by `/bin/sh`), and the same errors.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::process::{ChildStderr, ChildStdout};
use std::ptr;

use nix::unistd::Pid;

/// Stack of the child between clone and exec. It only makes system calls; a guard page below
/// turns an overflow into a SIGSEGV of the child instead of a write into the agent's memory.
const CHILD_STACK: usize = 64 * 1024;

/// The search path `execvp` uses when the environment has no PATH.
const DEFAULT_PATH: &[u8] = b"/bin:/usr/bin";

/// Highest signal number plus one (`_NSIG` on Linux).
const SIGNALS_END: c_int = 65;

/// A worker to start: the program, its arguments and environment, and what isolates it.
#[derive(Debug)]
pub struct WorkerCommand {
    program: OsString,
    args: Vec<OsString>,
    /// Changes to the agent's environment; `None` removes the variable.
    env: BTreeMap<OsString, Option<OsString>>,
    agent: Pid,
    cpus: Option<nix::sched::CpuSet>,
    inherited_fd: Option<RawFd>,
}

/// A started worker: its pid and the read ends of its stdout and stderr.
#[derive(Debug)]
pub struct StartedWorker {
    pub pid: u32,
    pub stdout: ChildStdout,
    pub stderr: ChildStderr,
}

impl WorkerCommand {
    /// A worker of the agent whose pid is `agent` (the calling process): in its own session and
    /// process group (a stop signal reaches the worker's children too, a terminal's Ctrl-C only
    /// the agent), SIGKILLed by the kernel when the thread that starts it dies
    /// (`PR_SET_PDEATHSIG`: see the `sys` module doc).
    pub fn new(program: impl Into<OsString>, agent: Pid) -> WorkerCommand {
        WorkerCommand {
            program: program.into(),
            args: Vec::new(),
            env: BTreeMap::new(),
            agent,
            cpus: None,
            inherited_fd: None,
        }
    }

    pub fn args<I, S>(&mut self, args: I) -> &mut Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets variables on top of the agent's environment; a later value of the same name wins.
    pub fn envs<I, K, V>(&mut self, vars: I) -> &mut Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<OsString>,
        V: Into<OsString>,
    {
        for (k, v) in vars {
            self.env.insert(k.into(), Some(v.into()));
        }
        self
    }

    pub fn env_remove(&mut self, name: impl Into<OsString>) -> &mut Self {
        self.env.insert(name.into(), None);
        self
    }

    /// Pins the worker (and every thread it ever starts) to `cpus` (`--numa-binding`).
    pub fn cpus(&mut self, cpus: Option<nix::sched::CpuSet>) -> &mut Self {
        self.cpus = cpus;
        self
    }

    /// Lets the worker inherit `fd`, open in the agent with close-on-exec so that no other child
    /// gets it: a warm standby's end of its socket to the agent.
    pub fn inherit_fd(&mut self, fd: RawFd) -> &mut Self {
        self.inherited_fd = Some(fd);
        self
    }

    /// Starts the worker. The error is the child's errno when it could not start the program
    /// (`NotFound` for a program that does not exist, as std's `Command` says it).
    pub fn spawn(&self) -> io::Result<StartedWorker> {
        let prepared = Prepared::new(self)?;
        let (stdout_read, stdout_write) = pipe()?;
        let (stderr_read, stderr_write) = pipe()?;
        let stack = ChildStack::new()?;
        let argv = null_terminated(&prepared.argv);
        let envp = null_terminated(&prepared.envp);
        let candidates: Vec<*const c_char> =
            prepared.candidates.iter().map(|c| c.as_ptr()).collect();
        // `/bin/sh <candidate> ARGS...`; the child fills in the candidate.
        let mut script_argv: Vec<*const c_char> = Vec::with_capacity(argv.len() + 1);
        script_argv.push(c"/bin/sh".as_ptr());
        script_argv.push(ptr::null());
        script_argv.extend(argv.iter().skip(1));
        let mut args = ChildArgs {
            argv: argv.as_ptr(),
            envp: envp.as_ptr(),
            candidates: candidates.as_ptr(),
            candidate_count: candidates.len(),
            script_argv: script_argv.as_mut_ptr(),
            stdout: stdout_write.as_raw_fd(),
            stderr: stderr_write.as_raw_fd(),
            inherited_fd: self.inherited_fd.unwrap_or(-1),
            cpus: self.cpus.as_ref().map_or(ptr::null(), ptr::from_ref),
            agent: self.agent,
            errno: 0,
        };
        let pid = clone_vfork(&stack, &mut args)?;
        drop((stdout_write, stderr_write));
        // The clone returned, so the child has exec'd or exited: `errno` is final.
        if args.errno != 0 {
            // It exited (127); reap it here, under the caller's lock, before anyone else can.
            let _ = nix::sys::wait::waitpid(Pid::from_raw(pid), None);
            return Err(io::Error::from_raw_os_error(args.errno));
        }
        Ok(StartedWorker {
            pid: pid as u32,
            stdout: ChildStdout::from(stdout_read),
            stderr: ChildStderr::from(stderr_read),
        })
    }
}

/// Everything the child reads, as C strings built before the clone.
struct Prepared {
    argv: Vec<CString>,
    envp: Vec<CString>,
    /// The paths to try in order: the program itself when it names a path, else the program in
    /// every directory of the child's PATH.
    candidates: Vec<CString>,
}

impl Prepared {
    fn new(cmd: &WorkerCommand) -> io::Result<Prepared> {
        let mut env: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
        for (name, value) in &cmd.env {
            match value {
                Some(value) => env.insert(name.clone(), value.clone()),
                None => env.remove(name),
            };
        }
        let envp = env
            .iter()
            .map(|(k, v)| {
                let mut pair = Vec::with_capacity(k.len() + v.len() + 1);
                pair.extend_from_slice(k.as_bytes());
                pair.push(b'=');
                pair.extend_from_slice(v.as_bytes());
                c_string(pair)
            })
            .collect::<io::Result<Vec<_>>>()?;
        let argv = std::iter::once(&cmd.program)
            .chain(&cmd.args)
            .map(|a| c_string(a.as_bytes().to_vec()))
            .collect::<io::Result<Vec<_>>>()?;
        let path = env.get(OsStr::new("PATH")).map(|p| p.as_bytes());
        let candidates = search_candidates(cmd.program.as_bytes(), path)
            .into_iter()
            .map(c_string)
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Prepared {
            argv,
            envp,
            candidates,
        })
    }
}

/// The files `execvp` would try for `program`: the program itself when it holds a `/`, else
/// `dir/program` for every directory of `path` (an empty one is the current directory). None for
/// an empty name.
fn search_candidates(program: &[u8], path: Option<&[u8]>) -> Vec<Vec<u8>> {
    if program.is_empty() {
        return Vec::new();
    }
    if program.contains(&b'/') {
        return vec![program.to_vec()];
    }
    path.unwrap_or(DEFAULT_PATH)
        .split(|&b| b == b':')
        .map(|dir| {
            if dir.is_empty() {
                return program.to_vec();
            }
            let mut full = Vec::with_capacity(dir.len() + program.len() + 1);
            full.extend_from_slice(dir);
            if !dir.ends_with(b"/") {
                full.push(b'/');
            }
            full.extend_from_slice(program);
            full
        })
        .collect()
}

fn c_string(bytes: Vec<u8>) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "nul byte found in provided data",
        )
    })
}

fn null_terminated(strings: &[CString]) -> Vec<*const c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(ptr::null()))
        .collect()
}

/// A close-on-exec pipe whose ends are above stdin, stdout and stderr (so the child's `dup2`
/// onto 1 or 2 never finds the source already there, which would keep its close-on-exec flag).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((above_stdio(read)?, above_stdio(write)?))
}

fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    let moved = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3))?;
    // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(moved) })
}

/// The child's stack: an anonymous mapping whose lowest page is a guard.
struct ChildStack {
    base: *mut c_void,
    len: usize,
}

impl ChildStack {
    fn new() -> io::Result<ChildStack> {
        // The kernel's page, not 4 KiB: on a 64 KiB-page kernel (aarch64 GPU nodes) a guard of
        // one 4 KiB "page" would protect the whole first page and leave the child 4 KiB of stack.
        let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .and_then(|p| usize::try_from(p).ok())
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096);
        let len = CHILD_STACK.next_multiple_of(page) + page;
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = ChildStack { base, len };
        // SAFETY: the first page of the mapping made above.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// The initial stack pointer (the stack grows down), 16-byte aligned as the ABI wants.
    fn top(&self) -> *mut c_void {
        let end = self.base as usize + self.len;
        (end & !15) as *mut c_void
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used: the child has exec'd or exited.
        unsafe {
            libc::munmap(self.base, self.len);
        }
    }
}

/// What the child reads (and, on failure, writes): shared with the suspended parent.
#[repr(C)]
struct ChildArgs {
    argv: *const *const c_char,
    envp: *const *const c_char,
    candidates: *const *const c_char,
    candidate_count: usize,
    script_argv: *mut *const c_char,
    stdout: RawFd,
    stderr: RawFd,
    inherited_fd: RawFd,
    cpus: *const nix::sched::CpuSet,
    agent: Pid,
    /// Set by the child when it could not exec: why.
    errno: c_int,
}

/// Clones a child that runs [`child_main`] on `stack`, with every signal blocked across the
/// clone (the child unblocks them once no handler of the agent's is left). Returns when the
/// child has exec'd or exited.
fn clone_vfork(stack: &ChildStack, args: &mut ChildArgs) -> io::Result<i32> {
    let all = nix::sys::signal::SigSet::all();
    let mut before = nix::sys::signal::SigSet::empty();
    nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&all),
        Some(&mut before),
    )?;
    // SAFETY: `child_main` only makes system calls on memory that lives until the clone returns
    // (`args` and what it points to, the stack), and the parent thread is suspended until the
    // child execs or exits (CLONE_VFORK), so nothing it reads changes underneath it.
    let pid = unsafe {
        libc::clone(
            child_main,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            ptr::from_mut(args).cast(),
        )
    };
    let clone_error = io::Error::last_os_error();
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&before),
        None,
    );
    if pid < 0 {
        return Err(clone_error);
    }
    Ok(pid)
}

/// The child, from clone to exec. Only system calls: see the module doc.
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `ChildArgs` the suspended parent passed to clone.
    let args = unsafe { &mut *arg.cast::<ChildArgs>() };
    // SAFETY: system calls on the descriptors, signal numbers and C strings in `args`.
    let errno = unsafe { prepare_and_exec(args) };
    args.errno = errno;
    // SAFETY: leaves without running the agent's exit handlers or flushing its buffers.
    unsafe { libc::_exit(127) }
}

/// Returns only on failure, with the errno.
unsafe fn prepare_and_exec(args: &mut ChildArgs) -> c_int {
    // Any handler of the agent's is back to the default before a signal can arrive.
    for signal in 1..SIGNALS_END {
        let mut current: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(signal, ptr::null(), &raw mut current) == 0
            && current.sa_sigaction != libc::SIG_DFL
            && current.sa_sigaction != libc::SIG_IGN
        {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(signal, &raw const default, ptr::null_mut());
        }
    }
    // std ignores SIGPIPE in the agent; a worker writing to a closed pipe should die of it.
    if libc::signal(libc::SIGPIPE, libc::SIG_DFL) == libc::SIG_ERR {
        return errno();
    }
    if libc::dup2(args.stdout, libc::STDOUT_FILENO) < 0
        || libc::dup2(args.stderr, libc::STDERR_FILENO) < 0
    {
        return errno();
    }
    if args.inherited_fd >= 0 {
        let flags = libc::fcntl(args.inherited_fd, libc::F_GETFD);
        if flags < 0 || libc::fcntl(args.inherited_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0
        {
            return errno();
        }
    }
    if libc::setsid() < 0 {
        return errno();
    }
    if let Some(cpus) = args.cpus.as_ref() {
        if nix::sched::sched_setaffinity(Pid::from_raw(0), cpus).is_err() {
            return errno();
        }
    }
    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) < 0 {
        return errno();
    }
    // The agent may have died between clone and prctl; then nobody would ever kill us.
    if libc::getppid() != args.agent.as_raw() {
        return libc::ESRCH;
    }
    let mut none = std::mem::zeroed::<libc::sigset_t>();
    libc::sigemptyset(&raw mut none);
    if libc::pthread_sigmask(libc::SIG_SETMASK, &raw const none, ptr::null_mut()) != 0 {
        return errno();
    }
    exec_first_found(args)
}

/// `execvp`'s loop over the candidates: a file that is missing (or on a stale mount) moves on to
/// the next; EACCES moves on too but is the answer if nothing else is found; any other error
/// ends the search. A file the kernel will not execute as is (`ENOEXEC`: no `#!`) runs under
/// `/bin/sh`.
unsafe fn exec_first_found(args: &mut ChildArgs) -> c_int {
    let mut denied = false;
    let mut last = libc::ENOENT;
    for i in 0..args.candidate_count {
        let candidate = *args.candidates.add(i);
        libc::execve(candidate, args.argv, args.envp);
        let mut failed = errno();
        if failed == libc::ENOEXEC {
            *args.script_argv.add(1) = candidate;
            libc::execve(*args.script_argv, args.script_argv.cast_const(), args.envp);
            failed = errno();
        }
        match failed {
            libc::EACCES => denied = true,
            libc::ENOENT | libc::ESTALE | libc::ENOTDIR | libc::ENODEV | libc::ETIMEDOUT => {}
            other => return other,
        }
        last = failed;
    }
    if denied {
        libc::EACCES
    } else {
        last
    }
}

fn errno() -> c_int {
    nix::errno::Errno::last_raw()
}

#[cfg(test)]
mod tests;
