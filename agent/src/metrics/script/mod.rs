//! The training script's own prometheus_client metrics, served on muster's `/metrics`.
//!
//! # Theory of operation
//! A script that calls `prometheus_client.start_http_server(8000)` would collide with muster's
//! endpoint on the same port (and with every other rank of the pod). Instead muster runs the
//! ranks in prometheus_client's multiprocess mode and serves their values itself:
//! - [`ScriptMetrics::rank_env`] gives each rank its own `PROMETHEUS_MULTIPROC_DIR`, empty when
//!   the rank starts: the rank's own directory of the attempt in the agent's private run
//!   directory (`…/<run>/attempt_<N>/<local rank>`, beside its error file; prometheus_client's
//!   files have names of their own), else (`--log-dir`: that directory is the user's)
//!   `<dir>/attempt-<N>/rank-<R>`. The previous attempt's files are removed when a new attempt
//!   starts, so served values are the current attempt's. Sharing the error file's directory saves
//!   a rank's start a directory made and removed (`mkdir` and `rmdir` on the root file system cost
//!   60–120 µs each here, on the path from launch to the last rank);
//! - [`ScriptMetrics::worker_env`] gives `MUSTER_METRICS_PORT` (the port muster serves on) and a
//!   directory holding `sitecustomize.py` (python/muster_sitecustomize.py) to put first on
//!   `PYTHONPATH`: it turns `start_http_server(<that port>)` into a no-op with one log line.
//!   That is the checkpoint helper's directory (the agent's private one), which holds muster's
//!   `sitecustomize` anyway and then holds the ranks' directories too, or where there is none a
//!   directory of muster's own;
//! - at every scrape, [`ScriptMetrics::families`] reads the current attempt's files
//!   ([`file`](mod@file)) and merges them the way prometheus_client's `MultiProcessCollector` does, per rank,
//!   adding `rank` and `local_rank` labels ([`merge`]).
//!
//! If the user set `PROMETHEUS_MULTIPROC_DIR` (or the older `prometheus_multiproc_dir`) for the
//! agent, muster leaves it and the ranks' environment alone and serves that directory as
//! `MultiProcessCollector` would (no rank labels, `pid` labels in gauge mode `all`); it never
//! deletes files there (prometheus_client's docs leave wiping it between runs to the user).
//!
//! A scrape never fails because of a script's files: a file that cannot be read or parsed is
//! skipped, and what was skipped (a file, a name colliding with muster's own, a type conflict) is
//! logged once.

pub mod file;
pub mod merge;

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus::proto::MetricFamily;

use self::file::FileName;
use self::merge::{Skipped, Source};
use super::Metrics;
use crate::launch::Launch;
use crate::python_files::{self, Files};

/// The variable prometheus_client reads to enter multiprocess mode.
pub const MULTIPROC_DIR_ENV: &str = "PROMETHEUS_MULTIPROC_DIR";
/// The name prometheus_client read before 0.10 (still honoured by it).
const LEGACY_MULTIPROC_DIR_ENV: &str = "prometheus_multiproc_dir";
/// The port muster serves `/metrics` on, for the workers' `sitecustomize` hook.
pub const METRICS_PORT_ENV: &str = "MUSTER_METRICS_PORT";

/// Where the ranks' files are.
#[derive(Debug)]
enum Layout {
    /// muster's: one directory per rank and attempt, the rank's own in the run directory or
    /// `<base>/attempt-<N>/rank-<R>`.
    PerRank { base: PathBuf },
    /// The user's own directory, served as a whole and never touched.
    User(PathBuf),
}

#[derive(Debug, Clone)]
struct RankDir {
    rank: u32,
    local_rank: u32,
    path: PathBuf,
    /// The rank's own directory in the run directory, which is not this module's to remove: only
    /// prometheus_client's files in it are.
    borrowed: bool,
}

#[derive(Debug, Default)]
struct Current {
    attempt: Option<u32>,
    /// By local rank.
    ranks: BTreeMap<u32, RankDir>,
    /// `<base>/attempt-<N>`, when this attempt's ranks needed directories of muster's own.
    own_attempt_dir: Option<PathBuf>,
}

/// Where the checkpoint helper put muster's start-up hook.
#[derive(Debug, Clone, Copy)]
pub struct Hook<'a> {
    /// The agent's private directory (the ranks' directories go here too).
    pub dir: &'a Path,
    /// The workers' `PYTHONPATH` entry holding the hook.
    pub python_entry: &'a Path,
}

/// The name of muster's private directory for the scripts' metrics, before its owner.
const HOME_PREFIX: &str = "muster-metrics-";

/// The script metrics of one agent. Created once per launch; shared by the launch (which calls
/// [`ScriptMetrics::rank_env`] before each rank starts) and the endpoint (which calls
/// [`ScriptMetrics::families`] at each scrape).
#[derive(Debug)]
pub struct ScriptMetrics {
    layout: Layout,
    /// muster's own directory for the hook's `python/` and (per-rank layout) the attempts,
    /// removed whole at the end; `None` where both live in the checkpoint helper's directory
    /// (the agent's private one, which goes with the agent): then only the attempts are
    /// removed. Each directory is one more made and removed at every start.
    own_home: Option<PathBuf>,
    /// Where the workers import the hook from, first on their `PYTHONPATH`.
    python: PathBuf,
    port: u16,
    current: Mutex<Current>,
    /// Family names of muster's own, which a script's must not repeat.
    reserved: HashSet<String>,
    /// Decoded file keys, reused from scrape to scrape.
    keys: Mutex<file::KeyCache>,
    /// What has been logged already (each problem once per agent).
    reported: Mutex<HashSet<String>>,
}

impl ScriptMetrics {
    /// Creates muster's private directory under `tmp` (unless `user_dir` is given, the ranks'
    /// files, and the hook) for an endpoint on `port`; with `hook`, where muster's
    /// `sitecustomize.py` and its import hook already are (the checkpoint helper's private
    /// directory, and the `PYTHONPATH` entry the workers import the hook from), none: the
    /// ranks' directories go into that directory. `reserved` are the
    /// names muster itself serves. `user_dir` is the agent's `PROMETHEUS_MULTIPROC_DIR`, if set
    /// (see [`user_multiproc_dir`]).
    pub fn create(
        tmp: &Path,
        port: u16,
        reserved: impl IntoIterator<Item = String>,
        user_dir: Option<PathBuf>,
        hook: Option<Hook<'_>>,
    ) -> io::Result<ScriptMetrics> {
        let (python, base, own_home) = if let Some(hook) = hook {
            (
                hook.python_entry.to_path_buf(),
                hook.dir.to_path_buf(),
                None,
            )
        } else {
            // Named for its owner, so that the next agent removes it when this one is SIGKILLed.
            let home = tmp.join(crate::scratch::private_name(HOME_PREFIX));
            std::fs::create_dir_all(&home)?;
            crate::scratch::sweep_in_background(tmp, HOME_PREFIX);
            let python = write_sitecustomize(tmp, &home)?;
            (python, home.clone(), Some(home))
        };
        let layout = match user_dir {
            Some(dir) => Layout::User(dir),
            None => Layout::PerRank { base },
        };
        // A histogram or summary of muster's also owns its `_bucket`, `_count` and `_sum` samples.
        let reserved = reserved
            .into_iter()
            .flat_map(|n| ["", "_bucket", "_count", "_sum"].map(|s| format!("{n}{s}")))
            .collect();
        Ok(ScriptMetrics {
            layout,
            own_home,
            python,
            port,
            current: Mutex::new(Current::default()),
            reserved,
            keys: Mutex::new(file::KeyCache::default()),
            reported: Mutex::new(HashSet::new()),
        })
    }

    /// Where the workers import muster's `sitecustomize.py` from, first on their `PYTHONPATH`.
    pub fn python_path_entry(&self) -> &Path {
        &self.python
    }

    /// Variables for every worker: the port the hook recognises.
    pub fn worker_env(&self) -> Vec<(String, OsString)> {
        vec![(METRICS_PORT_ENV.to_owned(), self.port.to_string().into())]
    }

    /// The variables of rank `rank` (local rank `local_rank`) of attempt `attempt`, called just
    /// before it starts: its own empty `PROMETHEUS_MULTIPROC_DIR`, which is `own_dir` (the rank's
    /// directory of this attempt in the agent's private run directory) when given. The first rank
    /// of a new attempt removes the previous attempt's files. With the user's own directory:
    /// nothing.
    ///
    /// A directory that cannot be made costs only the script's metrics: a warning, and the rank
    /// starts without multiprocess mode.
    pub fn rank_env(
        &self,
        attempt: u32,
        rank: u32,
        local_rank: u32,
        own_dir: Option<&Path>,
    ) -> Vec<(String, OsString)> {
        let Layout::PerRank { base } = &self.layout else {
            return Vec::new();
        };
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.attempt != Some(attempt) {
            remove_attempt(&mut current);
            current.attempt = Some(attempt);
        }
        // A rank started twice in one attempt starts from nothing too.
        if let Some(earlier) = current.ranks.remove(&local_rank) {
            remove_rank_files(&earlier);
        }
        if let Some(dir) = own_dir {
            current.ranks.insert(
                local_rank,
                RankDir {
                    rank,
                    local_rank,
                    path: dir.to_path_buf(),
                    borrowed: true,
                },
            );
            return vec![(MULTIPROC_DIR_ENV.to_owned(), dir.into())];
        }
        let attempt_dir = attempt_dir(base, attempt);
        let path = attempt_dir.join(format!("rank-{rank}"));
        current.own_attempt_dir = Some(attempt_dir);
        if let Err(err) = std::fs::create_dir_all(&path) {
            tracing::warn!(
                "cannot create {} for rank {rank}'s prometheus_client files ({err}); its metrics \
                 will not be served",
                path.display()
            );
            current.ranks.remove(&local_rank);
            return Vec::new();
        }
        current.ranks.insert(
            local_rank,
            RankDir {
                rank,
                local_rank,
                path: path.clone(),
                borrowed: false,
            },
        );
        vec![(MULTIPROC_DIR_ENV.to_owned(), path.into_os_string())]
    }

    /// The script's metric families now, merged; empty when there are none.
    pub fn families(&self) -> Vec<MetricFamily> {
        let sources = self.sources();
        let (families, skipped) = merge::merge(&sources, &self.reserved, &process_alive);
        for s in skipped {
            match s {
                Skipped::Collision(name) => self.report_once(&format!(
                    "the training script's metric {name} has the name of one of muster's own; \
                     only muster's is served (rename the script's)"
                )),
                Skipped::TypeConflict(name) => self.report_once(&format!(
                    "the training script's metric {name} was written with two different types; \
                     one is served"
                )),
                Skipped::InvalidName(name) => self.report_once(&format!(
                    "the training script's metric {name} has a name or label the exposition \
                     format does not allow; it is not served"
                )),
            }
        }
        families
    }

    fn sources(&self) -> Vec<Source> {
        match &self.layout {
            Layout::User(dir) => vec![Source {
                labels: Vec::new(),
                files: self.read_dir(dir),
            }],
            Layout::PerRank { .. } => {
                let ranks: Vec<RankDir> = self
                    .current
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .ranks
                    .values()
                    .cloned()
                    .collect();
                ranks
                    .into_iter()
                    .map(|r| Source {
                        labels: vec![
                            ("rank".to_owned(), r.rank.to_string()),
                            ("local_rank".to_owned(), r.local_rank.to_string()),
                        ],
                        files: self.read_dir(&r.path),
                    })
                    .collect()
            }
        }
    }

    /// Every prometheus_client file in `dir`, read; sorted by name so merges are deterministic.
    fn read_dir(&self, dir: &Path) -> Vec<(FileName, Vec<file::Entry>)> {
        let Ok(listing) = std::fs::read_dir(dir) else {
            // Not there yet (the rank has not imported prometheus_client) or already replaced.
            return Vec::new();
        };
        let mut names: Vec<(String, FileName)> = listing
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let parsed = FileName::parse(&name)?;
                Some((name, parsed))
            })
            .collect();
        names.sort();
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        names
            .into_iter()
            .filter_map(
                |(name, parsed)| match file::read(&dir.join(&name), &mut keys) {
                    Ok(entries) => Some((parsed, entries)),
                    // Removed between the listing and the read (a new attempt, mark_process_dead).
                    Err(file::FileError::Io(err)) if err.kind() == io::ErrorKind::NotFound => None,
                    Err(err) => {
                        self.report_once(&format!(
                            "skipping the training script's metrics file {}: {err}",
                            dir.join(&name).display()
                        ));
                        None
                    }
                },
            )
            .collect()
    }

    fn report_once(&self, message: &str) {
        let mut reported = self.reported.lock().unwrap_or_else(PoisonError::into_inner);
        if reported.insert(message.to_owned()) {
            tracing::warn!("{message}");
        }
    }
}

impl Drop for ScriptMetrics {
    fn drop(&mut self) {
        self.remove_files();
    }
}

impl ScriptMetrics {
    /// Removes muster's private directory (the hook and the ranks' files, never the user's own
    /// directory), or in the helper's directory the ranks' files; the script's metrics are gone
    /// from `/metrics` from then on. Files in the ranks' own directories of the run directory
    /// are left to it: it goes with the agent.
    pub fn remove_files(&self) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.ranks.clear();
        current.attempt = None;
        if let Some(dir) = current.own_attempt_dir.take() {
            remove_dir(&dir);
        }
        if let Some(home) = &self.own_home {
            remove_dir(home);
        }
    }

    /// Gives `launch`'s workers what they need: `PYTHONPATH` = the hook's directory, then
    /// `python_path` (what the workers would have had otherwise; it may start with the hook's
    /// directory already), the port, and each rank's directory.
    pub fn plug_into(self: &Arc<Self>, launch: Launch, python_path: &OsString) -> Launch {
        let path = if std::env::split_paths(python_path).next().as_deref()
            == Some(self.python.as_path())
        {
            python_path.clone()
        } else {
            let mut path = self.python.clone().into_os_string();
            if !python_path.is_empty() {
                path.push(":");
                path.push(python_path);
            }
            path
        };
        let mut launch = launch.with_worker_env("PYTHONPATH", path);
        for (key, value) in self.worker_env() {
            launch = launch.with_worker_env(key, value);
        }
        let this = Arc::clone(self);
        launch.with_rank_env(Arc::new(move |attempt, rank, local_rank, own_dir| {
            this.rank_env(attempt, rank, local_rank, own_dir)
        }))
    }
}

/// Starts serving the training script's metrics on `metrics`' endpoint, if it serves anything
/// (`--metrics-addr none`, or a default port someone else holds: nothing, and the script keeps
/// the port and its environment, as under torchrun). The private directory goes under
/// `writable_base`, the first writable place muster found ([`crate::scratch`]; a read-only root
/// has none at `/tmp`); one that cannot be made costs only the script's metrics: a warning.
/// `hook`: where the checkpoint helper put the hook already.
pub fn attach(
    served: Option<std::net::SocketAddr>,
    metrics: &Metrics,
    writable_base: Option<&std::path::Path>,
    hook: Option<Hook<'_>>,
) -> Option<Arc<ScriptMetrics>> {
    let addr = served?;
    let user_dir = user_multiproc_dir(&|k| std::env::var_os(k));
    let tmp = writable_base.map_or_else(std::env::temp_dir, std::path::Path::to_path_buf);
    match ScriptMetrics::create(&tmp, addr.port(), metrics.metric_names(), user_dir, hook) {
        Ok(script) => {
            let script = Arc::new(script);
            metrics.attach_script_metrics(Arc::clone(&script));
            Some(script)
        }
        Err(err) => {
            tracing::warn!(
                "cannot set up serving the training script's prometheus_client metrics: {err}"
            );
            None
        }
    }
}

/// Puts the workers' start-up hook (`sitecustomize.py` with the package files it imports at
/// start) where they import it from (shared under `tmp`, else in `dir`), where there is no
/// helper holding them; returns the `PYTHONPATH` entry.
fn write_sitecustomize(tmp: &Path, dir: &Path) -> io::Result<PathBuf> {
    python_files::install(tmp, dir, Files::StartupHook)
        .map_err(|err| io::Error::new(err.source.kind(), err))
}

/// The agent's own `PROMETHEUS_MULTIPROC_DIR` (or the legacy lower-case name), if set and not
/// empty: the user's choice, which muster then serves and leaves alone.
pub fn user_multiproc_dir(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    [MULTIPROC_DIR_ENV, LEGACY_MULTIPROC_DIR_ENV]
        .iter()
        .find_map(|k| env(k).filter(|v| !v.is_empty()))
        .map(PathBuf::from)
}

fn attempt_dir(base: &Path, attempt: u32) -> PathBuf {
    base.join(format!("attempt-{attempt}"))
}

/// Removes what the ranks of the attempt that ends wrote: muster's own attempt directory, or
/// prometheus_client's files in the ranks' own directories (their error files stay, as under
/// torchrun).
fn remove_attempt(current: &mut Current) {
    for (_, rank) in std::mem::take(&mut current.ranks) {
        if rank.borrowed {
            remove_rank_files(&rank);
        }
    }
    if let Some(dir) = current.own_attempt_dir.take() {
        remove_dir(&dir);
    }
}

/// Empties a rank's directory of prometheus_client's files (all of it, when it is muster's own).
fn remove_rank_files(rank: &RankDir) {
    if !rank.borrowed {
        remove_dir(&rank.path);
        return;
    }
    let Ok(listing) = std::fs::read_dir(&rank.path) else {
        return;
    };
    for entry in listing.filter_map(Result::ok) {
        let name = entry.file_name();
        if name.to_str().and_then(FileName::parse).is_some() {
            if let Err(err) = std::fs::remove_file(entry.path()) {
                tracing::debug!("cannot remove {}: {err}", entry.path().display());
            }
        }
    }
}

fn remove_dir(path: &Path) {
    match std::fs::remove_dir_all(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => tracing::debug!("cannot remove {}: {err}", path.display()),
    }
}

/// Whether `pid` is a running process (a `live*` gauge's file counts only then). A pid that
/// exists but is not ours to signal (EPERM) is running.
fn process_alive(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if raw <= 0 {
        return false;
    }
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None) {
        Ok(()) => true,
        Err(errno) => errno != nix::errno::Errno::ESRCH,
    }
}

#[cfg(test)]
mod tests;
