//! The Python files muster ships inside the binary and writes for the workers.
//!
//! They are the `muster_launcher` package (`python/muster_launcher/`: the channel to the agent,
//! the checkpoint helper, the zero-code step reports, the import hook, the framework
//! integrations), the two old module names scripts import (`muster_checkpoint`,
//! `muster_frameworks`, one-line shims), and muster's start-up hook written as
//! `sitecustomize.py` (python/muster_sitecustomize.py). Two callers write them into a directory
//! they put first on the workers' `PYTHONPATH`: the checkpoint barrier all of them
//! ([`Files::Workers`], into the agent's private directory), the script metrics only the hook
//! and what it imports at every start ([`Files::StartupHook`]) where there is no such directory.
//! Each file is one more inode made and removed at every start: ship only what a rank imports.

use std::io;
use std::path::{Path, PathBuf};

/// One shipped file: where it goes below the directory, and its text.
struct PythonFile {
    path: &'static str,
    text: &'static str,
    /// Imported by `sitecustomize` at every rank's start (the script metrics' hook needs it).
    startup: bool,
}

/// A file of `python/` shipped at the same path below the directory.
macro_rules! same_path {
    ($path:literal, startup: $startup:literal) => {
        PythonFile {
            path: $path,
            text: include_str!(concat!("../../python/", $path)),
            startup: $startup,
        }
    };
}

/// Every shipped file. Each folder is made as its first file is written.
const FILES: &[PythonFile] = &[
    PythonFile {
        path: "sitecustomize.py",
        text: include_str!("../../python/muster_sitecustomize.py"),
        startup: true,
    },
    same_path!("muster_launcher/__init__.py", startup: true),
    same_path!("muster_launcher/channel.py", startup: false),
    same_path!("muster_launcher/importhook.py", startup: true),
    same_path!("muster_launcher/checkpoint.py", startup: false),
    same_path!("muster_launcher/autoreport.py", startup: false),
    same_path!("muster_launcher/integrations/__init__.py", startup: false),
    same_path!("muster_launcher/integrations/barrier.py", startup: false),
    same_path!("muster_launcher/integrations/transformers.py", startup: false),
    same_path!("muster_launcher/integrations/lightning.py", startup: false),
    same_path!("muster_checkpoint.py", startup: false),
    same_path!("muster_frameworks.py", startup: false),
];

/// Which of the shipped files a directory gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Files {
    /// All of them: `import muster_checkpoint` and the framework callbacks work.
    Workers,
    /// `sitecustomize.py` and the package files it imports at start, for the script metrics'
    /// hook alone (no helper: muster's barrier has no directory of its own).
    StartupHook,
}

/// A shipped file that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {}: {source}", path.display())]
pub struct WriteError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Writes `which` of the shipped files below `dir`, making the package's folders; stops at the
/// first that fails.
pub fn write(dir: &Path, which: Files) -> Result<(), WriteError> {
    for file in FILES {
        if which == Files::StartupHook && !file.startup {
            continue;
        }
        let path = dir.join(file.path);
        let parent = path.parent().unwrap_or(dir);
        std::fs::create_dir_all(parent)
            .and_then(|()| std::fs::write(&path, file.text))
            .map_err(|source| WriteError { path, source })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("muster-py-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_startup_hook_gets_sitecustomize_and_the_import_hook_only() {
        let dir = scratch("startup");
        write(&dir, Files::StartupHook).unwrap();
        assert!(dir.join("sitecustomize.py").is_file());
        assert!(dir.join("muster_launcher/importhook.py").is_file());
        assert!(!dir.join("muster_checkpoint.py").exists());
        assert!(!dir.join("muster_launcher/channel.py").exists());
        assert!(!dir.join("muster_launcher/integrations").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_workers_get_the_package_and_the_old_names() {
        let dir = scratch("workers");
        write(&dir, Files::Workers).unwrap();
        for file in FILES {
            assert!(dir.join(file.path).is_file(), "{}", file.path);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
