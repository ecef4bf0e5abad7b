//! The errors of the launch itself (not of the workers) and the exit code each maps to.

use std::net::IpAddr;
use std::path::PathBuf;

use super::{config, leave};
use crate::exit_code;

/// Errors of the launch itself (not of the workers).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{0}")]
    Config(String),
    #[error("log directory {}: {source}", path.display())]
    LogDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A [`LaunchError::LogDir`] under the directory `--log-dir` named, reported like every
    /// other bad value: the option, its value, where the value came from.
    #[error("invalid --log-dir `{}` ({origin}): cannot create {}: {source}", dir.display(), path.display())]
    LogDirOption {
        dir: PathBuf,
        origin: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the worker program {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("cannot host the workers' store on {ip}: {source}")]
    Store { ip: IpAddr, source: std::io::Error },
    /// Without `--log-dir`, the per-rank directory for the error files could not be made in
    /// muster's private directory (or `--tmp-dir` is unusable).
    #[error("{}: {source}; {}", path.display(), crate::scratch::FIX)]
    TmpDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Scratch(#[from] crate::scratch::ScratchError),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    /// The rendezvous endpoint could not be resolved or reached before the join deadline.
    #[error("rendezvous timed out: {0}")]
    DiscoveryTimeout(crate::discovery::DiscoveryError),
    /// The gang rendezvous failed: timed out, lost node 0, rejected this node, or ended the job
    /// for everyone with a worker's code.
    #[error(transparent)]
    Rendezvous(rendezvous::rdzv::RdzvError),
    /// Node 0, which hosts the rendezvous store, stopped answering while workers ran.
    #[error("lost the store host (node 0): {0}")]
    StoreHostLost(String),
    /// Before a restart, the previous attempt's GPU processes or memory did not go within
    /// `--gpu-release-timeout`: this node is unhealthy.
    #[error(
        "the GPUs were not released {waited:.1}s after attempt {previous} stopped: {detail}; \
         this node is unhealthy (--gpu-release-timeout {timeout})"
    )]
    GpusNotReleased {
        waited: f64,
        previous: u32,
        detail: String,
        timeout: f64,
    },
    /// The gang's network pre-flight (`--network-check require`) named a slow node or link:
    /// the round ends for this node (the message names the node or link and what was measured).
    #[error("{0}")]
    NetworkCheckFailed(String),
    /// The rendezvous store failed under the network check.
    #[error(transparent)]
    NetworkCheck(crate::netcheck::gang::CheckError),
    /// A state the agent's own logic should never reach.
    #[error("{0}")]
    Internal(&'static str),
    /// A fatal GPU fault while the ranks ran ([`crate::gpu::watch`]): the workers were stopped
    /// and this node leaves the job with the "unhealthy GPU" code, so an elastic gang
    /// (`--nnodes MIN:MAX`) re-forms without it.
    #[error("fatal GPU fault: {0}; this node is unhealthy, its workers were stopped")]
    GpuFault(Box<crate::gpu::watch::GpuEvent>),
    /// A part of the agent asked this node to leave the gang while its workers ran
    /// ([`leave::Leave`], e.g. a node excluded as a straggler): the workers were stopped and the
    /// node ends with the part's code.
    #[error("{}", .0.message)]
    Left(leave::Departure),
}

impl LaunchError {
    /// Whether this is the join deadline passing with nodes missing.
    pub fn is_rendezvous_timeout(&self) -> bool {
        matches!(
            self,
            LaunchError::DiscoveryTimeout(_)
                | LaunchError::Rendezvous(rendezvous::rdzv::RdzvError::Timeout(_))
        )
    }
}

impl exit_code::Coded for LaunchError {
    fn exit_code(&self) -> u8 {
        use rendezvous::rdzv::RdzvError;
        match self {
            LaunchError::Config(_)
            | LaunchError::LogDir { .. }
            | LaunchError::LogDirOption { .. }
            | LaunchError::TmpDir { .. }
            | LaunchError::Scratch(_)
            | LaunchError::Rendezvous(RdzvError::Rejected(_)) => exit_code::CONFIG_ERROR,
            LaunchError::Spawn { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
                ) =>
            {
                exit_code::CONFIG_ERROR
            }
            LaunchError::DiscoveryTimeout(_) | LaunchError::Rendezvous(RdzvError::Timeout(_)) => {
                exit_code::RENDEZVOUS_TIMEOUT
            }
            LaunchError::StoreHostLost(_)
            | LaunchError::Rendezvous(RdzvError::StoreLost(_))
            | LaunchError::NetworkCheck(
                crate::netcheck::gang::CheckError::Store(_)
                | crate::netcheck::gang::CheckError::StoreSlow(_),
            ) => exit_code::STORE_HOST_LOST,
            LaunchError::Rendezvous(RdzvError::Fatal { exit_code, .. }) => *exit_code,
            LaunchError::Rendezvous(RdzvError::FinishedAsSpare) => exit_code::SUCCESS,
            LaunchError::GpusNotReleased { .. } | LaunchError::GpuFault(_) => {
                exit_code::UNHEALTHY_GPU
            }
            LaunchError::NetworkCheckFailed(_) => exit_code::NETWORK_CHECK_FAILED,
            LaunchError::Left(departure) => departure.code,
            LaunchError::Rendezvous(RdzvError::Malformed { .. } | RdzvError::Encode(_))
            | LaunchError::Spawn { .. }
            | LaunchError::Store { .. }
            | LaunchError::Io { .. }
            | LaunchError::NetworkCheck(crate::netcheck::gang::CheckError::Encode(_))
            | LaunchError::Internal(_) => exit_code::INTERNAL_ERROR,
        }
    }
}

impl LaunchError {
    /// Names `--log-dir` and the source of its value in a [`LaunchError::LogDir`] about a path
    /// below it; any other error is returned as it is.
    #[must_use]
    pub fn naming_log_dir(self, logs: &config::LogConfig) -> Self {
        match (self, &logs.log_dir) {
            (LaunchError::LogDir { path, source }, Some(dir)) if path.starts_with(dir) => {
                LaunchError::LogDirOption {
                    dir: dir.clone(),
                    origin: logs.log_dir_origin.clone(),
                    path,
                    source,
                }
            }
            (other, _) => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_errors_map_to_reserved_codes() {
        use exit_code::Coded as _;
        let nf = std::io::Error::from(std::io::ErrorKind::NotFound);
        let spawn = LaunchError::Spawn {
            program: "x".into(),
            source: nf,
        };
        assert_eq!(spawn.exit_code(), exit_code::CONFIG_ERROR);
        assert_eq!(
            LaunchError::Config("x".into()).exit_code(),
            exit_code::CONFIG_ERROR
        );
        // Environment errors (a directory that cannot be made) are the user's to fix: 202.
        let tmp = LaunchError::TmpDir {
            path: "/ro/muster_x".into(),
            source: std::io::Error::from(std::io::ErrorKind::ReadOnlyFilesystem),
        };
        assert_eq!(tmp.exit_code(), exit_code::CONFIG_ERROR);
        assert!(tmp.to_string().contains("/ro/muster_x"));
        assert!(tmp.to_string().contains("emptyDir"));
        let timeout = LaunchError::Rendezvous(rendezvous::rdzv::RdzvError::Timeout("x".into()));
        assert!(timeout.is_rendezvous_timeout());
        assert_eq!(timeout.exit_code(), exit_code::RENDEZVOUS_TIMEOUT);
        assert_eq!(timeout.to_string(), "rendezvous timed out: x");
        let fatal = LaunchError::Rendezvous(rendezvous::rdzv::RdzvError::Fatal {
            exit_code: 7,
            reason: "rank 3 failed".into(),
        });
        assert_eq!(fatal.exit_code(), 7);
        assert!(!fatal.is_rendezvous_timeout());
        let gpus = LaunchError::GpusNotReleased {
            waited: 60.04,
            previous: 0,
            detail: "GPU 0 held".into(),
            timeout: 60.0,
        };
        assert_eq!(gpus.exit_code(), exit_code::UNHEALTHY_GPU);
        assert_eq!(
            gpus.to_string(),
            "the GPUs were not released 60.0s after attempt 0 stopped: GPU 0 held; this node is \
             unhealthy (--gpu-release-timeout 60)"
        );
        // The network check's verdict ends with its own code; its store failing is node 0 lost.
        let slow = LaunchError::NetworkCheckFailed("node 2 (host-2) is slow".into());
        assert_eq!(slow.exit_code(), exit_code::NETWORK_CHECK_FAILED);
        assert_eq!(slow.to_string(), "node 2 (host-2) is slow");
        let lost =
            LaunchError::NetworkCheck(crate::netcheck::gang::CheckError::Store("eof".into()));
        assert_eq!(lost.exit_code(), exit_code::STORE_HOST_LOST);
    }

    #[test]
    fn log_dir_errors_name_the_option_and_its_source() {
        let mut logs = config::LogConfig {
            log_dir: Some(PathBuf::from("afile")),
            log_dir_origin: "environment variable MUSTER_LOG_DIR".into(),
            ..config::LogConfig::default()
        };
        let err = || LaunchError::LogDir {
            path: PathBuf::from("afile/job_abc"),
            source: std::io::Error::from_raw_os_error(libc::ENOTDIR),
        };
        let named = err().naming_log_dir(&logs);
        assert_eq!(exit_code::Coded::exit_code(&named), exit_code::CONFIG_ERROR);
        let text = named.to_string();
        assert!(
            text.starts_with(
                "invalid --log-dir `afile` (environment variable MUSTER_LOG_DIR): cannot create afile/job_abc: "
            ),
            "{text}"
        );
        logs.log_dir = None;
        assert!(matches!(
            err().naming_log_dir(&logs),
            LaunchError::LogDir { .. }
        ));
    }
}
