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
use std::os::unix::fs::DirBuilderExt;
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
    /// Creates `<base>/<prefix><pid>-<random>` in the first candidate that takes it (see
    /// [`candidates`]). `Ok(None)`: no candidate is writable (the caller does without);
    /// `Err`: the `--tmp-dir` the user named is not usable.
    pub fn create(
        tmp_dir: Option<&Path>,
        prefix: &str,
    ) -> Result<Option<ScratchDir>, ScratchError> {
        let tried = candidates(tmp_dir, std::env::var_os("TMPDIR"));
        for base in &tried {
            let path = base.join(format!(
                "{prefix}{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    return Ok(Some(ScratchDir {
                        path,
                        base: base.clone(),
                    }))
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
