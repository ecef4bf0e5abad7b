//! Where muster puts the few files it writes on its own: the checkpoint helper for the workers'
//! `PYTHONPATH` and the workers' `TORCHELASTIC_ERROR_FILE`s.
//!
//! Hardened pods run with a read-only root filesystem, so no fixed path can be assumed writable.
//! `--tmp-dir` (when given) is the only place tried, and a failure there is the user's to fix
//! (exit 202); otherwise `$TMPDIR`, `/tmp` and `/dev/shm` (a tmpfs in every pod) are tried in that
//! order, and when none takes a directory the caller does without the file. Nothing muster needs
//! to *start* depends on a write: the checkpoint socket lives in the abstract namespace.

use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The fixed fallbacks after `$TMPDIR`: the conventional one, then the pod's shared-memory tmpfs.
const FALLBACKS: [&str; 2] = ["/tmp", "/dev/shm"];

/// What to say to fix a missing writable directory, in every message about one.
pub const FIX: &str = "mount a writable emptyDir volume at /tmp, or pass --tmp-dir";

/// `--tmp-dir` could not hold muster's private directory.
#[derive(Debug, thiserror::Error)]
#[error("--tmp-dir {}: cannot create muster's private directory {}: {source}; give a writable directory (e.g. an emptyDir volume)", base.display(), path.display())]
pub struct ScratchError {
    pub base: PathBuf,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// The directories to try, in order: `--tmp-dir` alone when given, else `$TMPDIR`, `/tmp`,
/// `/dev/shm` (without duplicates).
pub fn candidates(tmp_dir: Option<&Path>, tmpdir_env: Option<OsString>) -> Vec<PathBuf> {
    if let Some(dir) = tmp_dir {
        return vec![dir.to_owned()];
    }
    let mut all: Vec<PathBuf> = tmpdir_env
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .collect();
    for fallback in FALLBACKS {
        let fallback = PathBuf::from(fallback);
        if !all.contains(&fallback) {
            all.push(fallback);
        }
    }
    all
}

/// A private directory (mode 0700) created for this agent; removed with everything in it when
/// dropped.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
    /// The candidate it was made in.
    base: PathBuf,
}

impl ScratchDir {
    /// Creates `<base>/<prefix><owner>-<random>` (see [`Owner`]) in the first candidate that
    /// takes it (see [`candidates`]), and removes there, in the background, the directories of
    /// this prefix left by agents that died without removing theirs (SIGKILL, OOM kill; see
    /// [`sweep`]). `Ok(None)`: no candidate is writable (the caller does without); `Err`: the
    /// `--tmp-dir` the user named is not usable.
    pub fn create(
        tmp_dir: Option<&Path>,
        prefix: &str,
    ) -> Result<Option<ScratchDir>, ScratchError> {
        let tried = candidates(tmp_dir, std::env::var_os("TMPDIR"));
        for base in &tried {
            let path = base.join(private_name(prefix));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    sweep_in_background(base, prefix);
                    return Ok(Some(ScratchDir {
                        path,
                        base: base.clone(),
                    }));
                }
                Err(source) if tmp_dir.is_some() => {
                    return Err(ScratchError {
                        base: base.clone(),
                        path,
                        source,
                    })
                }
                Err(err) => {
                    tracing::debug!("{} not writable: {err}", base.display());
                }
            }
        }
        Ok(None)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory this one was made in (`--tmp-dir`, `$TMPDIR`, `/tmp` or `/dev/shm`).
    pub fn base(&self) -> &Path {
        &self.base
    }
}

/// Who made a private directory, as its name records it: `<pid>.<start>.<pidns>`. The pid alone
/// cannot tell a dead agent's directory from a live one's once the pid is reused, and /tmp may be
/// shared with another PID namespace (a volume shared by two pods), where our view of its pids
/// says nothing: the start time (clock ticks since boot, `/proc/<pid>/stat`) tells a reused pid,
/// the namespace (the inode of `/proc/self/ns/pid`) keeps us to directories of our own pids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub pid: u32,
    pub start: u64,
    pub pidns: u64,
}

impl Owner {
    /// This process; `None` where `/proc` does not say (then nothing is swept either). Read once:
    /// every private directory of an agent records the same owner.
    pub fn of_self() -> Option<Owner> {
        static SELF: std::sync::OnceLock<Option<Owner>> = std::sync::OnceLock::new();
        *SELF.get_or_init(Owner::read_self)
    }

    fn read_self() -> Option<Owner> {
        let pid = std::process::id();
        let pidns = std::fs::read_link("/proc/self/ns/pid")
            .ok()?
            .to_str()?
            .strip_prefix("pid:[")?
            .strip_suffix(']')?
            .parse()
            .ok()?;
        Some(Owner {
            pid,
            start: start_time(pid)?,
            pidns,
        })
    }

    /// `4242.123456.4026531836`: what goes into the directory's name.
    pub fn tag(self) -> String {
        format!("{}.{}.{}", self.pid, self.start, self.pidns)
    }

    /// The owner a directory name of `prefix` records; `None` for any other name (another
    /// program's, an older muster's `<prefix><pid>-<random>`: left alone).
    pub fn parse(name: &str, prefix: &str) -> Option<Owner> {
        let (tag, random) = name.strip_prefix(prefix)?.rsplit_once('-')?;
        if random.len() != 8 || !random.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut parts = tag.split('.');
        let owner = Owner {
            pid: parts.next()?.parse().ok()?,
            start: parts.next()?.parse().ok()?,
            pidns: parts.next()?.parse().ok()?,
        };
        parts.next().is_none().then_some(owner)
    }

    /// Whether the process this records is still running (same pid, same start time). Anything
    /// unsure (an unreadable stat other than "no such process") counts as alive.
    pub fn alive(self) -> bool {
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
            Ok(stat) => parse_start_time(&stat).is_none_or(|start| start == self.start),
            Err(e) => e.kind() != io::ErrorKind::NotFound,
        }
    }
}

/// Field 22 of `/proc/<pid>/stat`: when the process started, in clock ticks since boot.
fn start_time(pid: u32) -> Option<u64> {
    parse_start_time(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The start time of a `/proc/<pid>/stat` line; the command name (field 2) may hold spaces and
/// parentheses, so the fields are counted from its last `)`.
fn parse_start_time(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    // Field 3 (state) is the first after the name: field 22 is the 20th.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The name of a new private directory of `prefix`: `<prefix><owner>-<random>`, the owner as
/// [`Owner::tag`] writes it (only the pid where `/proc` does not say: never swept then).
pub fn private_name(prefix: &str) -> String {
    format!(
        "{prefix}{}-{:08x}",
        Owner::of_self().map_or_else(|| std::process::id().to_string(), Owner::tag),
        rand::random::<u32>()
    )
}

/// [`sweep`] of `base` for `prefix` on a thread of its own: listing /tmp is no business of the
/// launch's start-up. A start that the base's link count already excuses (see
/// [`sweeps_this_time`]) starts no thread: with thousands of agents on one /tmp, most.
pub fn sweep_in_background(base: &Path, prefix: &str) {
    let Some(me) = Owner::of_self() else {
        return;
    };
    let draw = rand::random::<f64>();
    if excused(base, draw) {
        return;
    }
    let (base, prefix) = (base.to_owned(), prefix.to_owned());
    let _ = std::thread::Builder::new()
        .name("muster-sweep".into())
        .spawn(move || sweep_listed(&base, &prefix, me, &Owner::alive, draw));
}

/// Removes from `base` the private directories of `prefix` whose owner is gone: made by an agent
/// of our PID namespace (`me.pidns`), owned by our user, whose recorded process is not running
/// (`alive` says; it is never asked about ourselves). Returns how many it removed.
///
/// Safe beside live agents: a live agent's directory records a running pid and start time, and
/// one being created right now belongs to a running process too. Two agents sweeping at once
/// race only to remove the same dead directory: whatever one finds already gone is skipped.
///
/// Where more than [`SWEEP_ALWAYS_UP_TO`] such directories exist (many agents sharing one
/// machine's /tmp, as in a scale test), only some starts sweep ([`sweeps_this_time`]).
pub fn sweep(base: &Path, prefix: &str, me: Owner, alive: &dyn Fn(Owner) -> bool) -> usize {
    let draw = rand::random::<f64>();
    if excused(base, draw) {
        return 0;
    }
    sweep_listed(base, prefix, me, alive, draw)
}

/// Whether a start whose draw is `draw` may skip even listing `base`: most starts beside
/// thousands of directories, whose count the base's link count bounds for free.
fn excused(base: &Path, draw: f64) -> bool {
    subdirectories(base).is_some_and(|n| !sweeps_this_time(n, draw))
}

/// [`sweep`] past the link-count check, with its draw made: the same draw decides again once the
/// listing has counted the candidates.
fn sweep_listed(
    base: &Path,
    prefix: &str,
    me: Owner,
    alive: &dyn Fn(Owner) -> bool,
    draw: f64,
) -> usize {
    let Ok(entries) = std::fs::read_dir(base) else {
        return 0;
    };
    let candidates: Vec<(PathBuf, Owner)> = entries
        .flatten()
        .filter_map(|entry| {
            let owner = Owner::parse(entry.file_name().to_str()?, prefix)?;
            (owner.pidns == me.pidns && owner.pid != me.pid).then(|| (entry.path(), owner))
        })
        .collect();
    if !sweeps_this_time(candidates.len(), draw) {
        return 0;
    }
    let uid = nix::unistd::geteuid().as_raw();
    let mut removed = 0;
    for (path, owner) in candidates {
        if alive(owner) {
            continue;
        }
        // Not through a link, and only our own user's (a shared /tmp holds others').
        let ours = std::fs::symlink_metadata(&path)
            .is_ok_and(|m| m.file_type().is_dir() && m.uid() == uid);
        if !ours {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {
                removed += 1;
                tracing::debug!(
                    "removed {}: its agent (pid {}) is gone",
                    path.display(),
                    owner.pid
                );
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::debug!("cannot remove {}: {e}", path.display()),
        }
    }
    removed
}

/// Up to this many directories of other agents, every start sweeps them all.
pub const SWEEP_ALWAYS_UP_TO: usize = 64;

/// Past [`SWEEP_ALWAYS_UP_TO`], how many owners a start asks about on average.
pub const SWEEP_READS_PER_START: usize = 16;

/// Whether a start that finds `candidates` other agents' directories sweeps them, `draw` being
/// uniform in [0, 1): always up to [`SWEEP_ALWAYS_UP_TO`], else with a chance of
/// [`SWEEP_READS_PER_START`] in `candidates`. Asking whether an owner is alive reads its
/// `/proc/<pid>/stat`; with N agents starting at once beside each other's directories, sweeping
/// at every start was N² reads (2,048 agents: 4 million, most of their start-up's CPU; at 64 per
/// start still a seventh of it at 768). So the reads a start pays stay about
/// [`SWEEP_READS_PER_START`] on average, and a dead agent's directory is still removed, by one of
/// the next starts in N / 16 on average.
pub fn sweeps_this_time(candidates: usize, draw: f64) -> bool {
    candidates <= SWEEP_ALWAYS_UP_TO || draw * (candidates as f64) < SWEEP_READS_PER_START as f64
}

/// How many subdirectories `base` has, from its link count (2 + that many on ext4, xfs, btrfs
/// and tmpfs); `None` where the count says nothing (a file system that reports 1).
fn subdirectories(base: &Path) -> Option<usize> {
    let links = std::fs::metadata(base).ok()?.nlink();
    (links >= 2).then(|| (links - 2) as usize)
}

/// The `TMPDIR` to give the workers, if they need one: `Some(base)` when neither the agent's
/// `$TMPDIR` nor `/tmp` is writable (Python's `tempfile` tries only those and the working
/// directory, and `import torch._dynamo` — any DDP script — needs it), `base` being a directory
/// muster could write in. `writable` probes a directory.
pub fn workers_tmpdir(
    base: &Path,
    tmpdir_env: Option<OsString>,
    writable: &dyn Fn(&Path) -> bool,
) -> Option<PathBuf> {
    let own = tmpdir_env.filter(|v| !v.is_empty()).map(PathBuf::from);
    let usable = |dir: &Path| dir == base || writable(dir);
    if own.as_deref().is_some_and(usable) || usable(Path::new(FALLBACKS[0])) {
        return None;
    }
    Some(base.to_owned())
}

/// Whether a directory takes a new entry (by making and removing one: permission bits do not tell
/// about read-only mounts).
pub fn is_writable(dir: &Path) -> bool {
    let probe = dir.join(format!(
        ".muster-probe-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let made = std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&probe)
        .is_ok();
    if made {
        let _ = std::fs::remove_dir(&probe);
    }
    made
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The candidates as a message lists them: "$TMPDIR (/x), /tmp, /dev/shm".
pub fn describe_candidates(tmp_dir: Option<&Path>) -> String {
    let tmpdir_env = std::env::var_os("TMPDIR");
    let named = tmpdir_env.as_ref().map(PathBuf::from);
    candidates(tmp_dir, tmpdir_env)
        .iter()
        .map(|p| {
            if tmp_dir.is_none() && named.as_ref() == Some(p) {
                format!("$TMPDIR ({})", p.display())
            } else {
                p.display().to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn tmp_dir_alone_else_tmpdir_then_the_fixed_fallbacks() {
        assert_eq!(
            candidates(Some(Path::new("/scratch")), Some("/x".into())),
            [PathBuf::from("/scratch")]
        );
        assert_eq!(
            candidates(None, Some("/x".into())),
            ["/x", "/tmp", "/dev/shm"].map(PathBuf::from)
        );
        assert_eq!(
            candidates(None, Some("/tmp".into())),
            ["/tmp", "/dev/shm"].map(PathBuf::from)
        );
        // An empty TMPDIR counts as unset.
        assert_eq!(
            candidates(None, Some(OsString::new())),
            ["/tmp", "/dev/shm"].map(PathBuf::from)
        );
        assert_eq!(
            candidates(None, None),
            ["/tmp", "/dev/shm"].map(PathBuf::from)
        );
    }

    #[test]
    fn workers_get_tmpdir_only_when_neither_theirs_nor_tmp_is_writable() {
        let shm = Path::new("/dev/shm");
        let none = |_: &Path| false;
        let only_tmp = |p: &Path| p == Path::new("/tmp");
        // A read-only root where muster fell back to /dev/shm.
        assert_eq!(workers_tmpdir(shm, None, &none), Some(shm.to_owned()));
        assert_eq!(
            workers_tmpdir(shm, Some("/ro".into()), &none),
            Some(shm.to_owned())
        );
        // /tmp works: Python finds it by itself.
        assert_eq!(workers_tmpdir(shm, None, &only_tmp), None);
        // The agent's TMPDIR is what muster used: the workers inherit it.
        assert_eq!(
            workers_tmpdir(Path::new("/x"), Some("/x".into()), &none),
            None
        );
        assert_eq!(workers_tmpdir(Path::new("/tmp"), None, &none), None);
        // --tmp-dir on a read-only root.
        let scratch = Path::new("/scratch");
        assert_eq!(
            workers_tmpdir(scratch, None, &none),
            Some(scratch.to_owned())
        );
    }

    #[test]
    fn an_explicit_dir_is_private_and_removed_on_drop() {
        let base = std::env::temp_dir().join(format!("muster-scratch-test-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let dir = ScratchDir::create(Some(&base), "t-").unwrap().unwrap();
        let path = dir.path().to_owned();
        assert!(path.starts_with(&base));
        assert_eq!(dir.base(), base);
        assert!(is_writable(&base));
        assert!(!is_writable(&base.join("missing")));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(path.join("f"), b"x").unwrap();
        drop(dir);
        assert!(!path.exists());
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn an_owner_is_read_back_from_its_name_and_other_names_are_left_alone() {
        let me = Owner::of_self().expect("/proc tells this process's start time");
        assert!(me.alive());
        let name = format!("muster-{}-0badcafe", me.tag());
        assert_eq!(Owner::parse(&name, "muster-"), Some(me));
        for other in [
            "muster-4242-0badcafe",
            "muster-1.2.3-0badcaf",
            "muster-1.2.3-0badcafz",
            "muster-1.2.3.4-0badcafe",
            "muster-slurm",
            "muster-metrics-1.2.3-0badcafe",
            "other-1.2.3-0badcafe",
        ] {
            assert_eq!(Owner::parse(other, "muster-"), None, "{other}");
        }
        assert!(Owner::parse("muster-metrics-1.2.3-0badcafe", "muster-metrics-").is_some());
        // A name of spaces and parentheses does not move the fields.
        let stat = "42 (a) b (c)) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 777 1 1";
        assert_eq!(parse_start_time(stat), Some(777));
        // The same pid started at another time is another process.
        assert!(!Owner {
            start: me.start + 1,
            ..me
        }
        .alive());
    }

    #[test]
    fn a_few_directories_are_always_swept_many_only_at_some_starts() {
        for draw in [0.0, 0.5, 0.999] {
            assert!(sweeps_this_time(0, draw));
            assert!(sweeps_this_time(SWEEP_ALWAYS_UP_TO, draw));
        }
        // 2,048 directories: one start in 128 sweeps.
        assert!(sweeps_this_time(2048, 0.0));
        assert!(sweeps_this_time(2048, 0.0078));
        assert!(!sweeps_this_time(2048, 0.0079));
        assert!(!sweeps_this_time(2048, 0.999));
        let sweeping = (0..1000)
            .filter(|i| sweeps_this_time(640, f64::from(*i) / 1000.0))
            .count();
        assert_eq!(sweeping, 25);
        // The link count of a directory counts its subdirectories.
        let base = std::env::temp_dir().join(format!("muster-links-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("a")).unwrap();
        std::fs::create_dir(base.join("b")).unwrap();
        std::fs::write(base.join("f"), "").unwrap();
        assert!(matches!(subdirectories(&base), Some(2) | None));
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_dead_agents_directory_is_swept_and_nothing_else() {
        let base = std::env::temp_dir().join(format!("muster-sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let me = Owner::of_self().unwrap();
        let dead = Owner {
            pid: 1_000_001,
            ..me
        };
        let live = Owner {
            pid: 1_000_002,
            ..me
        };
        let elsewhere = Owner {
            pid: 1_000_003,
            pidns: me.pidns + 1,
            ..me
        };
        let dir = |o: Owner| base.join(format!("t-{}-0badcafe", o.tag()));
        for o in [me, dead, live, elsewhere] {
            std::fs::create_dir(dir(o)).unwrap();
            std::fs::write(dir(o).join("f"), b"x").unwrap();
        }
        // An older muster's name and another program's file, with no owner to tell.
        std::fs::create_dir(base.join("t-1000001-0badcafe")).unwrap();
        std::fs::write(base.join("t-notes"), b"x").unwrap();
        let alive = |o: Owner| o == live || o == me;
        assert_eq!(sweep(&base, "t-", me, &alive), 1);
        assert!(!dir(dead).exists());
        for kept in [
            dir(me),
            dir(live),
            dir(elsewhere),
            base.join("t-1000001-0badcafe"),
        ] {
            assert!(kept.exists(), "{}", kept.display());
        }
        assert!(base.join("t-notes").exists());
        // A second sweep, or one racing the first, finds nothing left to do.
        assert_eq!(sweep(&base, "t-", me, &alive), 0);
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn an_unusable_explicit_dir_is_an_error_naming_it() {
        let missing = Path::new("/proc/definitely/not/writable");
        let err = ScratchDir::create(Some(missing), "t-").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("--tmp-dir /proc/definitely/not/writable"),
            "{text}"
        );
        assert!(text.contains("emptyDir"), "{text}");
    }
}
