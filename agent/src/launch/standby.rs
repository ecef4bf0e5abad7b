//! Warm standby interpreters (`--warm-restart on`, issue #41): a restarted rank starts in a
//! Python that already imported what the rank imported, instead of a cold interpreter.
//!
//! # Theory of operation
//! Every rank gets `MUSTER_WARM_MODULES` (its file in the pool's directory); at its first step
//! the rank writes there the installed modules it imported
//! (`python/muster_launcher/standby.py`). While an attempt runs, [`start_after_first_step`]
//! looks for those files and starts one standby per local rank whose file appeared: the
//! interpreter with `-u -c` [`COMMAND`], the rank slot's environment less what changes per
//! attempt ([`PER_ATTEMPT`]), the module list, and one end of a socket pair. It is spawned like a
//! rank (own session and process group, parent-death signal, the rank's CPUs, its exit reported
//! by the [`Reaper`], stdout and stderr piped), so taking it over only sends a message. It
//! imports the modules on a thread of lowered priority (the main thread, which later runs the
//! script, keeps a cold rank's) and says `ready`.
//!
//! At the next attempt [`Pool::take`] asks the pure [`decide`] whether the standby may take the
//! rank's start (same interpreter, same script or module, the script file's size and mtime
//! unchanged, the same module list, the same slot environment, alive, ready, its imports all
//! done); if so, [`Taken::hand_over`] sends the rank's arguments, whole environment and working
//! directory, and the standby, once it checked the variables read at import time, accepts and
//! becomes the rank. Otherwise the rank starts cold. Either way one INFO line says which and why.
//! Standbys not taken are killed; all of them are killed when the pool is dropped (the launch
//! ends).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::fmt;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::sync::mpsc;

use super::config::Entrypoint;
use super::reaper::{ExitReport, ExitStatus, Reaper, Spawned};
use crate::sys::WorkerCommand;

/// What the standby runs with `python -u -c` (`COMMAND` in `standby.py`; a test holds them
/// equal): the working directory that `-c` puts first on `sys.path` goes, so a file of the
/// user's there never shadows an installed module.
pub const COMMAND: &str =
    "import sys; del sys.path[0]; from muster_launcher.standby import main; main()";
/// Where a rank writes its installed modules at its first step.
pub const MODULES_ENV: &str = "MUSTER_WARM_MODULES";
/// The standby's end of its socket to the agent.
const FD_ENV: &str = "MUSTER_STANDBY_FD";
/// The module list the standby imports.
pub const LIST_ENV: &str = "MUSTER_STANDBY_MODULES";
/// Where the agent writes the environment it handed to the standby `pid` (`KEY=VALUE`, each
/// ended by NUL, as `/proc/PID/environ` has it), next to its module list: `/proc` still shows
/// the standby's start environment, and the dry run's fault injection finds a rank by its
/// `RANK` ([`crate::cmd::dry_run::fault::procs`]).
pub fn handed_env_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("rank_env_{pid}"))
}

/// Writes `env` to [`handed_env_path`] whole or not at all.
fn write_handed_env(dir: &Path, pid: u32, env: &[(OsString, OsString)]) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let mut bytes = Vec::new();
    for (k, v) in env {
        bytes.extend_from_slice(k.as_bytes());
        bytes.push(b'=');
        bytes.extend_from_slice(v.as_bytes());
        bytes.push(0);
    }
    let path = handed_env_path(dir, pid);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, &path)
}

/// How long a ready standby may take to accept or refuse a handover (it looks at its threads
/// for up to a second).
const HANDOVER_WAIT: Duration = Duration::from_secs(3);
/// How often a running attempt's module files are looked for.
pub const POLL: Duration = Duration::from_millis(200);

/// The variables that change from one attempt to the next (torchrun's assignment, the attempt's
/// files): a standby starts without them, and they do not count when its environment is
/// compared with the rank's; the handover brings their values.
pub const PER_ATTEMPT: &[&str] = &[
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
];

/// What a rank runs: a script file or a module (`-m`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Script(PathBuf),
    Module(String),
}

impl Target {
    /// The script or module `entrypoint` runs; `None` for a program (`--no-python`).
    pub fn of(entrypoint: &Entrypoint) -> Option<Target> {
        if !entrypoint.python {
            return None;
        }
        let args: Vec<&std::ffi::OsStr> = entrypoint.args.iter().map(OsString::as_os_str).collect();
        match args.as_slice() {
            [u, m, module, ..] if *u == "-u" && *m == "-m" => {
                Some(Target::Module(module.to_string_lossy().into_owned()))
            }
            [u, script, ..] if *u == "-u" => Some(Target::Script(PathBuf::from(script))),
            _ => None,
        }
    }
}

/// What a standby was started for, or what a rank's start needs: compared by [`decide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub program: OsString,
    pub target: Target,
    /// The script file's modification time and size (`None` for a module, or a file that cannot
    /// be read).
    pub script: Option<(SystemTime, u64)>,
    /// The module list, as the rank wrote it.
    pub modules: Vec<u8>,
    /// The rank slot's environment without [`PER_ATTEMPT`].
    pub env: BTreeMap<OsString, OsString>,
}

impl Slot {
    /// The slot of `entrypoint` with `env` (the rank's whole environment) and `modules`; `None`
    /// for a program.
    pub fn new(
        entrypoint: &Entrypoint,
        env: impl IntoIterator<Item = (OsString, OsString)>,
        modules: Vec<u8>,
    ) -> Option<Slot> {
        let target = Target::of(entrypoint)?;
        let script = match &target {
            Target::Script(path) => std::fs::metadata(path)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len()))),
            Target::Module(_) => None,
        };
        Some(Slot {
            program: entrypoint.program.clone(),
            target,
            script,
            modules,
            env: slot_env(env),
        })
    }
}

/// `env` without the per-attempt variables.
pub fn slot_env(
    env: impl IntoIterator<Item = (OsString, OsString)>,
) -> BTreeMap<OsString, OsString> {
    env.into_iter()
        .filter(|(k, _)| !PER_ATTEMPT.iter().any(|p| k == p))
        .collect()
}

/// What a standby said once its imports were done.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Deserialize)]
pub struct Ready {
    #[serde(default)]
    pub failed: Vec<String>,
    /// The main thread plus every thread a cold rank would not have after the same imports (a
    /// Python thread, or a native one at another priority than the main thread's: a library's
    /// pool at the rank's priority does not count).
    #[serde(default)]
    pub threads: u32,
}

/// A standby as [`decide`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub made_for: &'a Slot,
    pub exited: Option<ExitStatus>,
    pub ready: Option<&'a Ready>,
}

/// Why a rank starts cold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cold {
    /// `--no-python`, or a program found on PATH.
    NotPython,
    /// No standby: the rank never reached its first step, or none could start.
    NoStandby,
    Died(ExitStatus),
    StillImporting,
    ImportsFailed(Vec<String>),
    ThreadsLeft(u32),
    Interpreter,
    Target,
    ScriptChanged,
    Modules,
    Environment(Vec<String>),
    /// The standby refused (a variable read at import time differs, ...).
    Refused(String),
    /// The handover itself failed.
    Handover(String),
}

impl fmt::Display for Cold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cold::NotPython => f.write_str("not a Python script"),
            Cold::NoStandby => f.write_str("no standby (the rank had not reached its first step)"),
            Cold::Died(status) => write!(f, "its standby died ({status})"),
            Cold::StillImporting => f.write_str("its standby was still importing"),
            Cold::ImportsFailed(names) => write!(
                f,
                "its standby could not import {}",
                rendezvous::words::and_list(names)
            ),
            Cold::ThreadsLeft(n) => write!(f, "its standby's imports left {n} thread(s) running"),
            Cold::Interpreter => f.write_str("the standby runs another interpreter"),
            Cold::Target => f.write_str("the standby was started for another script or module"),
            Cold::ScriptChanged => f.write_str("the script file changed since the standby started"),
            Cold::Modules => f.write_str("the rank's recorded modules changed"),
            Cold::Environment(names) => write!(
                f,
                "the environment changed since the standby started ({})",
                rendezvous::words::and_list(names)
            ),
            Cold::Refused(why) => write!(f, "its standby refused: {why}"),
            Cold::Handover(why) => write!(f, "the handover failed: {why}"),
        }
    }
}

/// May `standby` take the start of a rank that needs `wanted` (`None`: not a Python script)?
pub fn decide(standby: Option<Seen<'_>>, wanted: Option<&Slot>) -> Result<(), Cold> {
    let wanted = wanted.ok_or(Cold::NotPython)?;
    let standby = standby.ok_or(Cold::NoStandby)?;
    if let Some(status) = standby.exited {
        return Err(Cold::Died(status));
    }
    let made = standby.made_for;
    if made.program != wanted.program {
        return Err(Cold::Interpreter);
    }
    if made.target != wanted.target {
        return Err(Cold::Target);
    }
    if made.script != wanted.script {
        return Err(Cold::ScriptChanged);
    }
    if made.modules != wanted.modules {
        return Err(Cold::Modules);
    }
    let mut differ: Vec<String> = made
        .env
        .iter()
        .filter(|(k, v)| wanted.env.get(*k) != Some(*v))
        .map(|(k, _)| k)
        .chain(wanted.env.keys().filter(|k| !made.env.contains_key(*k)))
        .map(|k| k.to_string_lossy().into_owned())
        .collect();
    if !differ.is_empty() {
        differ.sort();
        return Err(Cold::Environment(differ));
    }
    let ready = standby.ready.ok_or(Cold::StillImporting)?;
    if !ready.failed.is_empty() {
        return Err(Cold::ImportsFailed(ready.failed.clone()));
    }
    if ready.threads > 1 {
        return Err(Cold::ThreadsLeft(ready.threads - 1));
    }
    Ok(())
}

/// What this node's standbys cost now, for metrics and `/gangz`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Standbys {
    /// Started, imports not done yet.
    pub importing: u32,
    /// Imports done, waiting for a restart.
    pub ready: u32,
    /// The ready ones' resident memory, as measured when each said ready.
    pub resident_bytes: u64,
    /// The CPU every standby that became ready since the agent started spent on its start and
    /// imports.
    pub cpu: Duration,
}

/// One standby interpreter.
struct Standby {
    spawned: Spawned,
    /// Its exit's tag on the pool's channel (see `Inner::next_tag`).
    tag: usize,
    socket: UnixStream,
    made_for: Slot,
    /// What it sent so far (the ready line).
    inbox: Vec<u8>,
    ready: Option<Ready>,
    exited: Option<ExitStatus>,
    /// Its cost was logged once it said ready ([`Pool::announce_ready`]).
    announced: bool,
    /// Its resident bytes when it said ready (0: `/proc` could not tell).
    resident_bytes: u64,
}

/// What a ready standby costs: its resident memory and the CPU its start and imports took, from
/// `/proc/PID/status` and `/proc/PID/stat`; `None` where `/proc` cannot tell.
pub fn standby_cost(pid: u32) -> Option<(u64, Duration)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let cpu = crate::watch::straggler::stat_cpu_ns(&stat)?;
    Some((rss_kib.checked_mul(1024)?, Duration::from_nanos(cpu)))
}

impl Standby {
    fn pid(&self) -> Pid {
        Pid::from_raw(self.spawned.pid as i32)
    }

    /// Reads what the standby sent without waiting; parses the ready line once it is whole.
    fn poll_ready(&mut self) {
        use std::io::Read;
        if self.ready.is_some() {
            return;
        }
        let mut buf = [0u8; 4096];
        loop {
            match self.socket.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => self.inbox.extend_from_slice(&buf[..n]),
            }
        }
        if let Some(end) = self.inbox.iter().position(|b| *b == b'\n') {
            self.ready = serde_json::from_slice(&self.inbox[..end]).ok();
            self.inbox.drain(..=end);
        }
    }

    fn kill(&self) {
        if self.exited.is_none() {
            let _ = killpg(self.pid(), Signal::SIGKILL);
        }
    }
}

/// The standbys of one agent's local ranks.
pub struct Pool {
    reaper: Reaper,
    /// Where the ranks' module files and the standbys' lists go.
    dir: PathBuf,
    inner: Mutex<Inner>,
    /// The ranks' lists for the gang's spares, and the gang's for this node as a spare.
    share: super::warm_share::WarmShare,
    /// Where what the standbys cost goes ([`Standbys`]).
    publisher: Option<super::Publisher>,
}

struct Inner {
    standbys: HashMap<u32, Standby>,
    /// The module lists of the previous attempt, by local rank ([`Pool::begin_attempt`]).
    recorded: HashMap<u32, Vec<u8>>,
    /// Exits of standbys being handed over (no longer in `standbys`), by their tag.
    late: HashMap<usize, ExitStatus>,
    /// The tags of the standbys being handed over now: only their exits are kept in `late`.
    handing: std::collections::HashSet<usize>,
    /// The reaper's tag of the next standby. Each standby has its own, never its local rank:
    /// a standby killed when refused reports its exit after the next one for the same rank
    /// started, and that exit must not read as the new one's death.
    next_tag: usize,
    exits_tx: mpsc::UnboundedSender<ExitReport>,
    exits: mpsc::UnboundedReceiver<ExitReport>,
    /// The CPU of every standby that said ready so far.
    cpu_spent: Duration,
    /// What was last published ([`Pool::publish`]).
    published: Standbys,
}

impl Inner {
    fn summary(&self) -> Standbys {
        let mut summary = Standbys {
            cpu: self.cpu_spent,
            ..Standbys::default()
        };
        for s in self.standbys.values().filter(|s| s.exited.is_none()) {
            if s.announced {
                summary.ready += 1;
                summary.resident_bytes += s.resident_bytes;
            } else {
                summary.importing += 1;
            }
        }
        summary
    }

    /// Marks the standbys whose exits the reaper reported.
    fn collect_exits(&mut self) {
        while let Ok((tag, status)) = self.exits.try_recv() {
            if let Some(s) = self.standbys.values_mut().find(|s| s.tag == tag) {
                s.exited.get_or_insert(status);
            } else if self.handing.contains(&tag) {
                self.late.insert(tag, status);
            }
            // Else a standby killed when it was not taken: nobody waits for its exit.
        }
    }
}

impl Pool {
    /// Logs each standby that said ready since the last call, once, with what it costs (issue
    /// #41: an operator who pays for the pod's memory sees it); false once none is left
    /// importing.
    pub fn announce_ready(&self) -> bool {
        let mut guard = self.lock();
        let inner = &mut *guard;
        inner.collect_exits();
        let mut importing = false;
        let cpu_spent = &mut inner.cpu_spent;
        for (local_rank, standby) in &mut inner.standbys {
            if standby.announced || standby.exited.is_some() {
                continue;
            }
            standby.poll_ready();
            if standby.ready.is_none() {
                importing = true;
                continue;
            }
            standby.announced = true;
            let pid = standby.spawned.pid;
            if let Some((rss, cpu)) = standby_cost(pid) {
                standby.resident_bytes = rss;
                *cpu_spent += cpu;
                tracing::info!(
                    "local rank {local_rank}: standby ready (pid {pid}): {} MiB resident, {:.1} s of CPU for its start and imports; a restart of this rank starts in it",
                    rss >> 20,
                    cpu.as_secs_f64()
                );
            } else {
                tracing::info!(
                    "local rank {local_rank}: standby ready (pid {pid}); a restart of this rank starts in it"
                );
            }
        }
        self.publish(inner);
        importing
    }

    /// Tells the metrics what the standbys cost now, when it changed.
    fn publish(&self, inner: &mut Inner) {
        let now = inner.summary();
        if now != inner.published {
            inner.published = now;
            if let Some(publisher) = &self.publisher {
                publisher.event(super::Event::Standbys(now));
            }
        }
    }
}

/// How a standby is started for one local rank.
pub struct Plan {
    pub local_rank: u32,
    pub entrypoint: Entrypoint,
    /// The rank's variables on top of the agent's (torchrun's, muster's), without `rank_env`.
    pub overlay: Vec<(OsString, OsString)>,
    pub cpus: Option<nix::sched::CpuSet>,
}

impl Pool {
    /// A pool keeping its files in `dir` (made here).
    pub fn new(reaper: Reaper, dir: PathBuf) -> std::io::Result<Pool> {
        std::fs::create_dir_all(&dir)?;
        let (exits_tx, exits) = mpsc::unbounded_channel();
        Ok(Pool {
            reaper,
            dir,
            share: super::warm_share::WarmShare::new(),
            publisher: None,
            inner: Mutex::new(Inner {
                standbys: HashMap::new(),
                late: HashMap::new(),
                handing: std::collections::HashSet::new(),
                next_tag: 0,
                recorded: HashMap::new(),
                exits_tx,
                exits,
                cpu_spent: Duration::ZERO,
                published: Standbys::default(),
            }),
        })
    }

    /// Reports what the standbys cost to `publisher` ([`super::Event::Standbys`]).
    #[must_use]
    pub fn with_publisher(mut self, publisher: super::Publisher) -> Pool {
        self.publisher = Some(publisher);
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What this pool shares with the gang rendezvous ([`super::warm_share`]).
    pub fn share(&self) -> super::warm_share::WarmShare {
        self.share.clone()
    }

    /// Whether local rank `local_rank` has a standby (a spare's, before its first attempt).
    pub fn holds(&self, local_rank: u32) -> bool {
        self.lock().standbys.contains_key(&local_rank)
    }

    /// A spare's standbys, from the gang's `lists` (what its members' ranks recorded): each is
    /// also written as the rank's module file, so that the attempt the spare joins records it
    /// as the previous attempt's ([`Pool::begin_attempt`]) and [`decide`] finds them equal.
    /// Local ranks that have a standby keep it.
    pub fn start_for_spare(&self, plans: &[Plan], lists: &super::warm_share::ModuleLists) {
        let agent = nix::unistd::getpid();
        let mut started = 0;
        for plan in plans {
            let Some(modules) = lists.get(&plan.local_rank) else {
                continue;
            };
            if modules.is_empty() || self.holds(plan.local_rank) {
                continue;
            }
            let result = std::fs::write(self.modules_file(plan.local_rank), modules)
                .and_then(|()| self.start(plan, modules.clone(), agent));
            match result {
                Ok(()) => started += 1,
                Err(err) => tracing::warn!(
                    "local rank {}: cannot start a warm standby while waiting as a spare ({err}); its start will be cold",
                    plan.local_rank
                ),
            }
        }
        if started > 0 {
            tracing::info!(
                "waiting as a spare: {started} standby interpreter(s) importing what the gang's ranks imported, so that taking a lost node's place starts its ranks warm"
            );
        }
    }

    /// The file local rank `local_rank` writes its modules to (its `MUSTER_WARM_MODULES`).
    pub fn modules_file(&self, local_rank: u32) -> PathBuf {
        self.dir.join(format!("modules_{local_rank}.json"))
    }

    /// What the rank wrote so far in the running attempt (empty: nothing yet).
    fn written(&self, local_rank: u32) -> Vec<u8> {
        std::fs::read(self.modules_file(local_rank)).unwrap_or_default()
    }

    /// At the start of an attempt, before its first rank: keeps what the previous attempt's
    /// ranks recorded (for [`Pool::recorded`]) and removes the files, so this attempt's ranks
    /// record their own.
    pub fn begin_attempt(&self, local_ranks: u32) {
        let mut inner = self.lock();
        inner.recorded.clear();
        for local_rank in 0..local_ranks {
            let file = self.modules_file(local_rank);
            if let Ok(bytes) = std::fs::read(&file) {
                inner.recorded.insert(local_rank, bytes);
            }
            let _ = std::fs::remove_file(file);
        }
    }

    /// The module list local rank `local_rank` recorded in the previous attempt.
    pub fn recorded(&self, local_rank: u32) -> Vec<u8> {
        self.lock()
            .recorded
            .get(&local_rank)
            .cloned()
            .unwrap_or_default()
    }

    /// Takes local rank `local_rank`'s standby for a start that needs `wanted`, when [`decide`]
    /// allows; a standby not taken is killed.
    pub fn take(&self, local_rank: u32, wanted: Option<&Slot>) -> Result<Taken, Cold> {
        let mut inner = self.lock();
        inner.collect_exits();
        let mut standby = inner.standbys.remove(&local_rank);
        if let Some(s) = standby.as_mut() {
            s.poll_ready();
        }
        let seen = standby.as_ref().map(|s| Seen {
            made_for: &s.made_for,
            exited: s.exited,
            ready: s.ready.as_ref(),
        });
        let taken = match decide(seen, wanted) {
            Ok(()) => match standby {
                Some(standby) => {
                    inner.handing.insert(standby.tag);
                    Ok(Taken {
                        standby,
                        local_rank,
                    })
                }
                None => Err(Cold::NoStandby),
            },
            Err(why) => {
                if let Some(s) = standby {
                    s.kill();
                }
                Err(why)
            }
        };
        self.publish(&mut inner);
        taken
    }

    /// Starts the standby of `plan`'s rank from the modules it recorded (`modules`).
    fn start(&self, plan: &Plan, modules: Vec<u8>, agent: Pid) -> std::io::Result<()> {
        let env: Vec<(OsString, OsString)> = std::env::vars_os()
            .chain(plan.overlay.iter().cloned())
            .collect();
        let Some(made_for) = Slot::new(&plan.entrypoint, env, modules) else {
            return Ok(());
        };
        let list = self.dir.join(format!("standby_{}.json", plan.local_rank));
        std::fs::write(&list, &made_for.modules)?;
        let (ours, theirs) = UnixStream::pair()?;
        let mut cmd = WorkerCommand::new(&plan.entrypoint.program, agent);
        cmd.args(["-u", "-c", COMMAND])
            .envs(plan.overlay.iter().cloned())
            .envs([
                (
                    OsString::from(FD_ENV),
                    OsString::from(theirs.as_raw_fd().to_string()),
                ),
                (OsString::from(LIST_ENV), list.clone().into_os_string()),
            ])
            .cpus(plan.cpus)
            .inherit_fd(theirs.as_raw_fd());
        for name in PER_ATTEMPT {
            cmd.env_remove(name);
        }
        let mut inner = self.lock();
        let tag = inner.next_tag;
        inner.next_tag += 1;
        let spawned = self
            .reaper
            .spawn_worker(&cmd, tag, inner.exits_tx.clone())?;
        drop(theirs);
        // A rank that once had this pid left its file: this standby has handed nothing yet.
        let _ = std::fs::remove_file(handed_env_path(&self.dir, spawned.pid));
        ours.set_nonblocking(true)?;
        tracing::debug!(
            "local rank {}: standby started (pid {})",
            plan.local_rank,
            spawned.pid
        );
        let old = inner.standbys.insert(
            plan.local_rank,
            Standby {
                spawned,
                tag,
                socket: ours,
                made_for,
                inbox: Vec::new(),
                ready: None,
                exited: None,
                announced: false,
                resident_bytes: 0,
            },
        );
        if let Some(old) = old {
            old.kill();
        }
        self.publish(&mut inner);
        Ok(())
    }

    /// Waits until local rank `local_rank`'s standby said ready (or `limit` passed).
    #[cfg(test)]
    async fn wait_ready(&self, local_rank: u32, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            if let Some(s) = self.lock().standbys.get_mut(&local_rank) {
                s.poll_ready();
                if s.ready.is_some() {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Kills every standby.
    pub fn stop_all(&self) {
        let mut inner = self.lock();
        for (_, s) in inner.standbys.drain() {
            s.kill();
        }
        self.publish(&mut inner);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Starts each rank's standby once the rank recorded its modules (its first step), at most one
/// per rank, until every plan has one, then logs each one's cost as it becomes ready; the
/// caller aborts it when the attempt ends.
pub async fn start_after_first_step(pool: std::sync::Arc<Pool>, mut plans: Vec<Plan>) {
    let agent = nix::unistd::getpid();
    let mut recorded = super::warm_share::ModuleLists::new();
    let mut shared = false;
    while !plans.is_empty() || pool.announce_ready() {
        tokio::time::sleep(POLL).await;
        plans.retain(|plan| {
            let modules = pool.written(plan.local_rank);
            if modules.is_empty() {
                return true;
            }
            recorded.insert(plan.local_rank, modules.clone());
            if let Err(err) = pool.start(plan, modules, agent) {
                tracing::warn!(
                    "local rank {}: cannot start a warm standby ({err}); a restart starts it cold",
                    plan.local_rank
                );
            }
            false
        });
        if plans.is_empty() && !shared {
            shared = true;
            pool.share.recorded(std::mem::take(&mut recorded));
        }
    }
}

/// A standby taken for a rank's start.
pub struct Taken {
    standby: Standby,
    local_rank: u32,
}

/// `s` as text, which the handover's JSON needs.
fn text(s: &std::ffi::OsStr) -> Result<&str, Cold> {
    s.to_str()
        .ok_or_else(|| Cold::Handover(format!("{} is not UTF-8", s.to_string_lossy())))
}

#[derive(serde::Serialize)]
struct Handover<'a> {
    args: Vec<&'a str>,
    env: BTreeMap<&'a str, &'a str>,
    cwd: Option<&'a str>,
}

#[derive(serde::Deserialize)]
struct Answer {
    #[serde(default)]
    accepted: bool,
    refused: Option<String>,
}

impl Taken {
    /// The standby's pid.
    pub fn pid(&self) -> u32 {
        self.standby.spawned.pid
    }
}

impl Pool {
    /// Hands the rank's start to `taken`: `args` (the interpreter's), the rank's whole `env`,
    /// the working directory `cwd`. On success the standby is the rank, its exit reported as
    /// `tag` on `exits`; on failure it is killed.
    pub async fn hand_over(
        &self,
        taken: Taken,
        args: &[OsString],
        env: &[(OsString, OsString)],
        cwd: Option<&Path>,
        tag: usize,
        exits: &mpsc::UnboundedSender<ExitReport>,
    ) -> Result<Spawned, Cold> {
        let Taken {
            standby,
            local_rank,
        } = taken;
        if let Err(why) = Taken::exchange(&standby, args, env, cwd).await {
            standby.kill();
            self.lock().handing.remove(&standby.tag);
            return Err(why);
        }
        if let Err(err) = write_handed_env(&self.dir, standby.spawned.pid, env) {
            tracing::debug!(
                "local rank {local_rank}: cannot record the environment handed to its standby: {err}"
            );
        }
        let retagged = self.reaper.retag(standby.spawned.pid, tag, exits.clone());
        let mut inner = self.lock();
        if !retagged {
            // It ended already (a script that returned at once): its exit went to the pool.
            inner.collect_exits();
            if let Some(status) = inner.late.remove(&standby.tag) {
                let _ = exits.send((tag, status));
            }
        }
        inner.handing.remove(&standby.tag);
        drop(inner);
        Ok(standby.spawned)
    }
}

impl Taken {
    async fn exchange(
        standby: &Standby,
        args: &[OsString],
        env: &[(OsString, OsString)],
        cwd: Option<&Path>,
    ) -> Result<(), Cold> {
        let mut message = Handover {
            args: Vec::new(),
            env: BTreeMap::new(),
            cwd: cwd.map(|c| text(c.as_os_str())).transpose()?,
        };
        for a in args {
            message.args.push(text(a)?);
        }
        for (k, v) in env {
            message.env.insert(text(k)?, text(v)?);
        }
        let mut line = serde_json::to_vec(&message).map_err(|e| Cold::Handover(e.to_string()))?;
        line.push(b'\n');
        let socket = standby
            .socket
            .try_clone()
            .and_then(|s| {
                s.set_nonblocking(true)?;
                tokio::net::UnixStream::from_std(s)
            })
            .map_err(|e| Cold::Handover(e.to_string()))?;
        let answer = tokio::time::timeout(HANDOVER_WAIT, async {
            let mut written = 0;
            while written < line.len() {
                socket.writable().await?;
                match socket.try_write(&line[written..]) {
                    Ok(n) => written += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.contains(&b'\n') {
                socket.readable().await?;
                match socket.try_read(&mut buf) {
                    Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(got)
        })
        .await
        .map_err(|_| {
            Cold::Handover(format!(
                "no answer within {}",
                rendezvous::words::duration(HANDOVER_WAIT)
            ))
        })?
        .map_err(|e| Cold::Handover(e.to_string()))?;
        let end = answer
            .iter()
            .position(|b| *b == b'\n')
            .unwrap_or(answer.len());
        let answer: Answer = serde_json::from_slice(&answer[..end])
            .map_err(|e| Cold::Handover(format!("unreadable answer ({e})")))?;
        match (answer.accepted, answer.refused) {
            (true, _) => Ok(()),
            (false, Some(why)) => Err(Cold::Refused(why)),
            (false, None) => Err(Cold::Handover("neither accepted nor refused".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(args: &[&str], python: bool) -> Entrypoint {
        Entrypoint {
            program: "/usr/bin/python3".into(),
            args: args.iter().map(OsString::from).collect(),
            display: String::new(),
            python,
        }
    }

    fn slot() -> Slot {
        Slot {
            program: "/usr/bin/python3".into(),
            target: Target::Script("train.py".into()),
            script: Some((SystemTime::UNIX_EPOCH, 10)),
            modules: b"[\"torch\"]".to_vec(),
            env: slot_env([
                ("PATH".into(), "/bin".into()),
                ("RANK".into(), "3".into()),
                ("OMP_NUM_THREADS".into(), "1".into()),
            ]),
        }
    }

    fn ready() -> Ready {
        Ready {
            failed: Vec::new(),
            threads: 1,
        }
    }

    fn seen<'a>(made_for: &'a Slot, ready: Option<&'a Ready>) -> Seen<'a> {
        Seen {
            made_for,
            exited: None,
            ready,
        }
    }

    #[test]
    fn a_standbys_cost_is_its_resident_memory_and_cpu_time() {
        let (rss, cpu) = standby_cost(std::process::id()).expect("this process in /proc");
        assert!(rss > 1 << 20, "{rss}");
        assert!(cpu < Duration::from_secs(24 * 3600), "{cpu:?}");
        assert_eq!(standby_cost(u32::MAX), None);
    }

    #[test]
    fn the_target_of_a_script_a_module_and_a_program() {
        assert_eq!(
            Target::of(&entry(&["-u", "t.py", "-m"], true)),
            Some(Target::Script("t.py".into()))
        );
        assert_eq!(
            Target::of(&entry(&["-u", "-m", "pkg.train", "x"], true)),
            Some(Target::Module("pkg.train".into()))
        );
        assert_eq!(Target::of(&entry(&["-u", "t.py"], false)), None);
    }

    #[test]
    fn a_ready_standby_for_the_same_slot_is_taken() {
        let made = slot();
        let r = ready();
        let mut wanted = slot();
        // Per-attempt variables never count.
        wanted.env = slot_env([
            ("PATH".into(), "/bin".into()),
            ("RANK".into(), "5".into()),
            ("OMP_NUM_THREADS".into(), "1".into()),
        ]);
        assert_eq!(decide(Some(seen(&made, Some(&r))), Some(&wanted)), Ok(()));
    }

    #[test]
    fn every_reason_to_start_cold() {
        let made = slot();
        let r = ready();
        let wanted = slot();
        assert_eq!(
            decide(Some(seen(&made, Some(&r))), None),
            Err(Cold::NotPython)
        );
        assert_eq!(decide(None, Some(&wanted)), Err(Cold::NoStandby));
        let dead = Seen {
            exited: Some(ExitStatus::Signaled(Signal::SIGKILL)),
            ..seen(&made, Some(&r))
        };
        assert_eq!(
            decide(Some(dead), Some(&wanted)),
            Err(Cold::Died(ExitStatus::Signaled(Signal::SIGKILL)))
        );
        assert_eq!(
            decide(Some(seen(&made, None)), Some(&wanted)),
            Err(Cold::StillImporting)
        );
        let changed = |f: &dyn Fn(&mut Slot)| {
            let mut w = slot();
            f(&mut w);
            decide(Some(seen(&made, Some(&r))), Some(&w)).unwrap_err()
        };
        assert_eq!(
            changed(&|w| w.program = "/opt/py".into()),
            Cold::Interpreter
        );
        assert_eq!(
            changed(&|w| w.target = Target::Module("m".into())),
            Cold::Target
        );
        assert_eq!(
            changed(&|w| w.script = Some((SystemTime::UNIX_EPOCH, 11))),
            Cold::ScriptChanged
        );
        assert_eq!(changed(&|w| w.modules = b"[]".to_vec()), Cold::Modules);
        assert_eq!(
            changed(&|w| {
                w.env.insert("OMP_NUM_THREADS".into(), "4".into());
                w.env.insert("NEW".into(), "1".into());
            }),
            Cold::Environment(vec!["NEW".into(), "OMP_NUM_THREADS".into()])
        );
        let failed = Ready {
            failed: vec!["transformers".into()],
            threads: 1,
        };
        assert_eq!(
            decide(Some(seen(&made, Some(&failed))), Some(&wanted)),
            Err(Cold::ImportsFailed(vec!["transformers".into()]))
        );
        let threads = Ready {
            failed: Vec::new(),
            threads: 3,
        };
        assert_eq!(
            decide(Some(seen(&made, Some(&threads))), Some(&wanted)),
            Err(Cold::ThreadsLeft(2))
        );
    }

    #[test]
    fn reasons_read_in_words() {
        assert_eq!(
            Cold::Environment(vec!["A".into(), "B".into()]).to_string(),
            "the environment changed since the standby started (A and B)"
        );
        assert_eq!(
            Cold::Died(ExitStatus::Signaled(Signal::SIGKILL)).to_string(),
            "its standby died (signal SIGKILL (9))"
        );
    }

    /// The plan of a `python3 -u <script> 7` rank whose `RANK` is `rank`.
    fn plan(pool: &Pool, script: &Path, rank: &str) -> Plan {
        let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python");
        Plan {
            local_rank: 0,
            entrypoint: Entrypoint {
                program: "python3".into(),
                args: vec!["-u".into(), script.into(), "7".into()],
                display: String::new(),
                python: true,
            },
            overlay: vec![
                ("PYTHONPATH".into(), python.into_os_string()),
                (MODULES_ENV.into(), pool.modules_file(0).into_os_string()),
                ("RANK".into(), rank.into()),
            ],
            cpus: None,
        }
    }

    /// A pool with a ready standby of `python3` for `script` (having imported `json` and
    /// `decimal`) and the plan of the next attempt's rank.
    async fn pool_with_standby(name: &str, script: &str) -> (std::sync::Arc<Pool>, Plan, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("muster-standby-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let pool =
            std::sync::Arc::new(Pool::new(Reaper::start().unwrap(), dir.join("pool")).unwrap());
        let path = dir.join("s.py");
        std::fs::write(&path, script).unwrap();
        std::fs::write(pool.modules_file(0), b"[\"json\", \"decimal\"]").unwrap();
        let first = vec![plan(&pool, &path, "0")];
        // It returns once the standby is started and said ready (its cost logged).
        tokio::time::timeout(
            Duration::from_secs(60),
            start_after_first_step(std::sync::Arc::clone(&pool), first),
        )
        .await
        .unwrap();
        assert!(pool.wait_ready(0, Duration::from_secs(20)).await);
        pool.begin_attempt(1);
        let next = plan(&pool, &path, "5");
        (pool, next, dir)
    }

    fn full_env(plan: &Plan) -> Vec<(OsString, OsString)> {
        std::env::vars_os()
            .chain(plan.overlay.iter().cloned())
            .collect()
    }

    #[tokio::test]
    async fn a_standby_takes_the_start_and_its_exit_is_the_rank_s() {
        let script = "import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\nsys.exit(int(sys.argv[1]))\n";
        let (pool, plan, dir) = pool_with_standby("takes", script).await;
        let env = full_env(&plan);
        let wanted = Slot::new(&plan.entrypoint, env.clone(), pool.recorded(0));
        let taken = pool.take(0, wanted.as_ref()).unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut child = pool
            .hand_over(taken, &plan.entrypoint.args, &env, Some(&dir), 3, &tx)
            .await
            .unwrap();
        let report = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .unwrap();
        assert_eq!(report, Some((3, ExitStatus::Exited(7))));
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
        assert_eq!(out, "rank 5 ['7']\n");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Takes local rank 0's standby for `plan` and hands it an environment it must refuse: a
    /// variable read at import time that only the handover brings (as `rank_env` would).
    /// Returns what the start wanted, and the refusal.
    async fn refused_handover(pool: &Pool, plan: &Plan) -> (Option<Slot>, Cold) {
        let env = full_env(plan);
        let wanted = Slot::new(&plan.entrypoint, env.clone(), pool.recorded(0));
        let mut changed = env;
        changed.push(("OMP_NUM_THREADS".into(), "9".into()));
        let taken = pool.take(0, wanted.as_ref()).unwrap();
        let (tx, _rx) = mpsc::unbounded_channel();
        let refused = pool
            .hand_over(taken, &plan.entrypoint.args, &changed, None, 0, &tx)
            .await
            .unwrap_err();
        (wanted, refused)
    }

    #[tokio::test]
    async fn a_killed_standby_or_a_refusal_means_cold() {
        let (pool, plan, dir) = pool_with_standby("killed", "print('ran')\n").await;
        let (wanted, refused) = refused_handover(&pool, &plan).await;
        assert_eq!(
            refused,
            Cold::Refused("OMP_NUM_THREADS differs from the standby's start".into())
        );
        // The next attempt: its standby is gone (taken and refused), so cold.
        assert_eq!(pool.take(0, wanted.as_ref()).err(), Some(Cold::NoStandby));
        let _ = std::fs::remove_dir_all(&dir);

        let (pool, plan, dir) = pool_with_standby("killed2", "print('ran')\n").await;
        let env = full_env(&plan);
        let wanted = Slot::new(&plan.entrypoint, env, pool.recorded(0));
        let pid = pool.lock().standbys[&0].pid();
        killpg(pid, Signal::SIGKILL).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            pool.take(0, wanted.as_ref()).err(),
            Some(Cold::Died(ExitStatus::Signaled(Signal::SIGKILL)))
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_refused_standbys_exit_is_never_taken_for_the_next_ones() {
        let (pool, slot_plan, dir) = pool_with_standby("stale", "print('ran')\n").await;
        let (_, refused) = refused_handover(&pool, &slot_plan).await;
        assert!(matches!(refused, Cold::Refused(_)), "{refused:?}");
        // The refused standby is killed; the next attempt's standby for the same local rank
        // starts before that SIGKILL's exit is read.
        std::fs::write(pool.modules_file(0), b"[\"json\"]").unwrap();
        let script = dir.join("s.py");
        tokio::time::timeout(
            Duration::from_secs(60),
            start_after_first_step(
                std::sync::Arc::clone(&pool),
                vec![plan(&pool, &script, "5")],
            ),
        )
        .await
        .unwrap();
        assert!(pool.wait_ready(0, Duration::from_secs(20)).await);
        tokio::time::sleep(Duration::from_millis(300)).await;
        pool.begin_attempt(1);
        let next = plan(&pool, &script, "5");
        let wanted = Slot::new(&next.entrypoint, full_env(&next), pool.recorded(0));
        // Was: "its standby died (signal SIGKILL)", the refused one's death read as this one's.
        assert!(pool.take(0, wanted.as_ref()).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_spares_standby_comes_from_the_gangs_list_and_takes_its_first_start() {
        let dir = std::env::temp_dir().join(format!("muster-standby-spare-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let publisher = super::super::Publisher::new();
        let mut events = publisher.subscribe().events;
        let pool = Pool::new(Reaper::start().unwrap(), dir.join("pool"))
            .unwrap()
            .with_publisher(publisher);
        let script = dir.join("s.py");
        std::fs::write(&script, "print('ran')\n").unwrap();
        let lists: super::super::warm_share::ModuleLists =
            [(0, b"[\"json\"]".to_vec()), (7, b"[\"decimal\"]".to_vec())]
                .into_iter()
                .collect();
        let waiting = plan(&pool, &script, "0");
        // Local rank 7 is not this node's: only rank 0's plan exists, only it is started.
        pool.start_for_spare(std::slice::from_ref(&waiting), &lists);
        assert!(pool.holds(0));
        assert!(pool.wait_ready(0, Duration::from_secs(20)).await);
        while pool.announce_ready() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut last = None;
        while let Ok(super::super::Event::Standbys(now)) = events.try_recv() {
            last = Some(now);
        }
        let last = last.expect("the standbys' cost published");
        assert_eq!((last.ready, last.importing), (1, 0), "{last:?}");
        assert!(last.resident_bytes > 0, "{last:?}");
        // The attempt the spare joins records the gang's list as its own previous one.
        pool.begin_attempt(1);
        assert_eq!(pool.recorded(0), b"[\"json\"]");
        let next = plan(&pool, &script, "3");
        let wanted = Slot::new(&next.entrypoint, full_env(&next), pool.recorded(0));
        assert!(pool.take(0, wanted.as_ref()).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_command_is_the_one_standby_py_names() {
        let text = include_str!("../../../python/muster_launcher/standby.py");
        assert!(
            text.contains(&format!("COMMAND = \"{COMMAND}\"")),
            "standby.py's COMMAND differs"
        );
        assert!(text.contains(&format!("MODULES_ENV = \"{MODULES_ENV}\"")));
        assert!(text.contains(&format!("FD_ENV = \"{FD_ENV}\"")));
        assert!(text.contains(&format!("LIST_ENV = \"{LIST_ENV}\"")));
    }
}
