//! The run directory of a launch: torchrun's per-run directory for the per-rank files.

use std::path::PathBuf;
use std::sync::Arc;

use super::error::LaunchError;
use super::Config;

/// `<log_dir>/<run_id>_<random>`, torchrun's per-run directory, for the per-rank log and error
/// files. Without `--log-dir` it holds only the error files and lives in muster's private
/// directory ([`crate::scratch`]: `--tmp-dir`, else `$TMPDIR`, `/tmp`, `/dev/shm`): the agent's,
/// when the caller gave one, else one of the launch's own, removed when this is dropped. Either
/// way the error files' paths keep torchrun's shape (`…/<run_id>_<random>/attempt_N/<rank>/`).
/// With no writable place at all there is none (`path` is `None`) and the workers get no
/// `TORCHELASTIC_ERROR_FILE`.
pub(super) struct RunDir {
    pub(super) path: Option<PathBuf>,
    /// Dropped last: removes the private directory when this holds the last reference (also when
    /// the launch future is dropped half-way by an embedding caller).
    scratch: Option<Arc<crate::scratch::ScratchDir>>,
}

impl RunDir {
    pub(super) fn create(
        config: &Config,
        private_dir: Option<Arc<crate::scratch::ScratchDir>>,
    ) -> Result<RunDir, LaunchError> {
        let suffix: String = (0..8)
            .map(|_| char::from(b'a' + rand::random_range(0..26u8)))
            .collect();
        let run = format!("{}_{suffix}", config.run_id);
        if let Some(dir) = &config.logs.log_dir {
            let path = dir.join(run);
            std::fs::create_dir_all(&path).map_err(|source| LaunchError::LogDir {
                path: path.clone(),
                source,
            })?;
            return Ok(RunDir {
                path: Some(path),
                scratch: None,
            });
        }
        let scratch = match private_dir {
            Some(dir) => Some(dir),
            None => crate::scratch::ScratchDir::create(config.tmp_dir.as_deref(), "muster_")?
                .map(Arc::new),
        };
        let Some(scratch) = scratch else {
            tracing::debug!("no writable directory: the workers get no TORCHELASTIC_ERROR_FILE");
            return Ok(RunDir {
                path: None,
                scratch: None,
            });
        };
        let path = scratch.path().join(run);
        std::fs::create_dir_all(&path).map_err(|source| LaunchError::TmpDir {
            path: path.clone(),
            source,
        })?;
        Ok(RunDir {
            path: Some(path),
            scratch: Some(scratch),
        })
    }

    /// Whether the directory outlives the agent (else its error files go with it).
    pub(super) fn is_kept(&self) -> bool {
        self.path.is_some() && self.scratch.is_none()
    }
}
