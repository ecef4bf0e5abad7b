//! One copy of muster's Python per user, version and machine, shared by every agent that starts
//! there, instead of one per agent.
//!
//! # Why
//! A per-agent copy costs twice. Written as a tree it is ~20 inodes made and removed at every
//! start (at 2,048 agents on one machine, ext4 spent most of an agent's start scanning past
//! recently deleted inodes); written as one zip archive, every rank pays Python's `zipimport`,
//! which compiles each module it finds twice (CPython 3.11's `find_spec` asks `get_filename`,
//! which compiles) and can never cache bytecode: 5–7 ms of every rank's start, more than the
//! rest of muster's launch. A directory that already exists costs the agent a few `stat` calls
//! and the ranks nothing beyond a plain import (and, where `PYTHONDONTWRITEBYTECODE` is unset,
//! Python caches the bytecode beside it for every later start).
//!
//! # The copy
//! `<base>/muster-python-<uid>-<fingerprint>/`, the fingerprint a hash of the shipped files'
//! names, sizes and CRCs: another muster version, or another file set, gets a directory of its
//! own, and a copy is never changed once made. It is made whole under a temporary name and
//! renamed into place, so an agent sees it complete or not at all; two agents making it at once
//! both succeed (the loser's rename fails and it removes its own).
//!
//! # Trust
//! The workers import from it, so it is used only when it is a real directory (not a link)
//! owned by this user and writable by no one else, and every shipped file is there, a regular
//! file of its size. Anything else (another user made the name first, a tmp cleaner removed
//! some files of an old copy) skips that name for the next generation (`<name>.1`, `.2`, …);
//! nothing is ever removed here, so agents never race over a copy another one uses. When no
//! generation will do, the caller writes a private copy as before.

use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::PythonFile;

/// The prefix of every shared copy's name.
pub const PREFIX: &str = "muster-python-";

/// How many names a copy may move through before muster gives up on sharing it.
const GENERATIONS: u32 = 4;

/// Why a name could not be used.
#[derive(Debug, PartialEq, Eq)]
enum Unusable {
    Missing,
    Foreign(String),
}

/// The shared copy of `files` under `base`, made now if there is none; `None` (with the reason
/// at debug level) when there is none this agent may use or make.
pub(super) fn ensure(base: &Path, files: &[&PythonFile]) -> Option<PathBuf> {
    let uid = nix::unistd::geteuid().as_raw();
    let stem = format!("{PREFIX}{uid}-{:016x}", fingerprint(files));
    for generation in 0..GENERATIONS {
        let dir = if generation == 0 {
            base.join(&stem)
        } else {
            base.join(format!("{stem}.{generation}"))
        };
        match check(&dir, uid, files) {
            Ok(()) => return Some(dir),
            Err(Unusable::Foreign(why)) => {
                tracing::debug!("not using {}: {why}", dir.display());
            }
            Err(Unusable::Missing) => {
                if let Err(err) = create(base, &dir, files) {
                    tracing::debug!("cannot make {}: {err}", dir.display());
                    return None;
                }
                match check(&dir, uid, files) {
                    Ok(()) => return Some(dir),
                    Err(why) => tracing::debug!("not using {}: {why:?}", dir.display()),
                }
            }
        }
    }
    None
}

/// FNV-1a over each file's name, size and CRC: stable across builds and platforms.
fn fingerprint(files: &[&PythonFile]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for file in files {
        let fields = [
            file.path.as_bytes(),
            &(file.text.len() as u64).to_le_bytes(),
            &file.crc.to_le_bytes(),
        ];
        for byte in fields.into_iter().flatten() {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// Whether `dir` is a complete copy of `files` that only `uid` can change.
fn check(dir: &Path, uid: u32, files: &[&PythonFile]) -> Result<(), Unusable> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Err(Unusable::Missing),
        Err(err) => return Err(Unusable::Foreign(err.to_string())),
    };
    if !meta.file_type().is_dir() {
        return Err(Unusable::Foreign("not a directory".into()));
    }
    if meta.uid() != uid {
        return Err(Unusable::Foreign(format!("owned by uid {}", meta.uid())));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(Unusable::Foreign(format!(
            "writable by others (mode {:o})",
            meta.mode() & 0o777
        )));
    }
    for file in files {
        let complete = std::fs::symlink_metadata(dir.join(file.path))
            .is_ok_and(|m| m.file_type().is_file() && m.len() == file.text.len() as u64);
        if !complete {
            return Err(Unusable::Foreign(format!(
                "{} is missing or changed",
                file.path
            )));
        }
    }
    Ok(())
}

/// Makes `dir` whole: the files under a temporary name beside it, then one rename. Losing the
/// rename to another agent is success (its copy is as good); only a failure to write is an error.
fn create(base: &Path, dir: &Path, files: &[&PythonFile]) -> io::Result<()> {
    let temp = base.join(crate::scratch::private_name(TEMP_PREFIX));
    // A temporary copy of an agent killed while writing it goes with the next one that writes.
    crate::scratch::sweep_in_background(base, TEMP_PREFIX);
    let written = write_tree(&temp, files);
    let renamed = written.and_then(|()| std::fs::rename(&temp, dir));
    if renamed.is_err() {
        let _ = std::fs::remove_dir_all(&temp);
    }
    match renamed {
        Err(err) if dir.exists() => {
            tracing::debug!("another agent made {} first ({err})", dir.display());
            Ok(())
        }
        other => other,
    }
}

/// The name of a copy being written, before its owner (swept as an agent's private directory).
const TEMP_PREFIX: &str = "muster-python-tmp-";

fn write_tree(root: &Path, files: &[&PythonFile]) -> io::Result<()> {
    // Never writable by others, whatever the umask: the workers import from here.
    let mut dirs = std::fs::DirBuilder::new();
    dirs.mode(0o755).recursive(true);
    dirs.create(root)?;
    for file in files {
        let path = root.join(file.path);
        if let Some(parent) = path.parent() {
            dirs.create(parent)?;
        }
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)?
            .write_all(file.text.as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::python_files::{selected, Files, FILES};

    fn base(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("muster-shared-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn all() -> Vec<&'static PythonFile> {
        selected(Files::Workers)
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn the_first_agent_makes_the_copy_and_the_next_ones_use_it_as_it_is() {
        let base = base("reuse");
        let first = ensure(&base, &all()).unwrap();
        assert!(first
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with(PREFIX));
        for file in FILES {
            assert_eq!(
                std::fs::read_to_string(first.join(file.path)).unwrap(),
                file.text
            );
        }
        let mode = std::fs::metadata(&first).unwrap().permissions().mode();
        assert_eq!(mode & 0o022, 0, "{mode:o}");
        let made = std::fs::metadata(first.join("sitecustomize.py"))
            .unwrap()
            .ino();
        // Bytecode Python caches beside the files does not make the copy another.
        std::fs::create_dir(first.join("__pycache__")).unwrap();
        assert_eq!(ensure(&base, &all()).unwrap(), first);
        assert_eq!(
            std::fs::metadata(first.join("sitecustomize.py"))
                .unwrap()
                .ino(),
            made
        );
        // Nothing else is left in the base: no temporary copy.
        assert_eq!(names(&base), [first.file_name().unwrap().to_str().unwrap()]);
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn another_file_set_gets_a_copy_of_its_own() {
        let base = base("sets");
        let startup = selected(Files::StartupHook);
        let whole = ensure(&base, &all()).unwrap();
        let hook = ensure(&base, &startup).unwrap();
        assert_ne!(whole, hook);
        assert!(!hook.join("muster_checkpoint.py").exists());
        assert!(hook.join("sitecustomize.py").is_file());
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_damaged_or_open_copy_is_left_alone_and_the_next_generation_used() {
        let base = base("damaged");
        let first = ensure(&base, &all()).unwrap();
        // A tmp cleaner took a file an old copy had not used for days.
        std::fs::remove_file(first.join("muster_frameworks.py")).unwrap();
        let second = ensure(&base, &all()).unwrap();
        assert_eq!(second, PathBuf::from(format!("{}.1", first.display())));
        assert!(
            !first.join("muster_frameworks.py").exists(),
            "never repaired in place"
        );
        // A copy others may write to is never imported from.
        std::fs::set_permissions(&second, std::fs::Permissions::from_mode(0o777)).unwrap();
        let third = ensure(&base, &all()).unwrap();
        assert_eq!(third, PathBuf::from(format!("{}.2", first.display())));
        // A file changed in place (same name, other size) is a damaged copy too.
        std::fs::write(third.join("sitecustomize.py"), "import os\n").unwrap();
        let fourth = ensure(&base, &all()).unwrap();
        assert_eq!(fourth, PathBuf::from(format!("{}.3", first.display())));
        // With every generation unusable there is no shared copy: the caller writes its own.
        std::fs::remove_dir_all(&fourth).unwrap();
        std::os::unix::fs::symlink(&base, &fourth).unwrap();
        assert_eq!(ensure(&base, &all()), None);
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn agents_making_the_copy_at_once_all_get_it_whole() {
        let base = base("race");
        let dirs: Vec<PathBuf> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| ensure(&base, &all()).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(dirs.iter().all(|d| *d == dirs[0]), "{dirs:?}");
        for file in FILES {
            assert_eq!(
                std::fs::read_to_string(dirs[0].join(file.path)).unwrap(),
                file.text
            );
        }
        // The losers removed their temporary copies (the sweep thread may still be listing).
        assert_eq!(names(&base).len(), 1, "{:?}", names(&base));
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn an_unwritable_base_is_no_copy() {
        assert_eq!(ensure(Path::new("/proc/self"), &all()), None);
    }
}
