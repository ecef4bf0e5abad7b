//! What an attempt and a launch end with: the rank assignment a round hands out, the first
//! failure of an attempt, and the outcomes with their exit codes.

use std::path::PathBuf;
use std::time::SystemTime;

use nix::sys::signal::Signal;

use super::reaper::ExitStatus;
use super::store_host::HostedStore;
use crate::exit_code;

/// Where this node's workers sit in the job, for one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankAssignment {
    /// GROUP_RANK.
    pub node_rank: u32,
    /// GROUP_WORLD_SIZE: nodes in this round.
    pub group_world_size: u32,
    /// RANK of local rank 0.
    pub base_global_rank: u32,
    /// WORLD_SIZE.
    pub world_size: u32,
    /// MASTER_ADDR: the workers' store, numerically.
    pub master_addr: String,
    pub master_port: u16,
    /// TORCHELASTIC_RESTART_COUNT.
    pub restart_count: u32,
    /// TORCHELASTIC_RUN_ID.
    pub run_id: String,
}

impl RankAssignment {
    /// Whether other nodes share this attempt: what a node posts to the workers' store is then
    /// for them to read, and theirs for this node to watch. A node alone hears only itself.
    pub fn has_peer_nodes(&self) -> bool {
        self.group_world_size > 1
    }
}

/// What one round of the rendezvous hands to the launch loop.
pub struct Round {
    pub assignment: RankAssignment,
    /// The workers' store when this node hosts it; shut down when the attempt ends.
    pub store: Option<HostedStore>,
    /// Where the attempt's first local failure goes the moment it is seen (the gang's failure
    /// board, [`super::gang_cause`]); `None` on a single node.
    pub failure_post: Option<FailurePost>,
}

/// The sending end of a round's [`Round::failure_post`].
pub type FailurePost = tokio::sync::oneshot::Sender<Failure>;

/// The first failure of an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub host: String,
    pub local_rank: u32,
    pub rank: u32,
    pub pid: u32,
    pub status: ExitStatus,
    /// When the agent saw the exit.
    pub at: SystemTime,
    /// The worker's `TORCHELASTIC_ERROR_FILE`; empty when it had none (nowhere writable).
    pub error_file: PathBuf,
    /// The message of `TORCHELASTIC_ERROR_FILE` (torch's `@record`), if the worker left one.
    pub message: Option<String>,
    /// The last `SomeError: message` line of the worker's stderr (shown when it left no error
    /// file).
    pub exception_line: Option<String>,
    /// It died of SIGKILL while the container's memory cgroup counted an OOM kill: the kernel's
    /// OOM killer; the container's memory limit, if it has one.
    pub oom_killed: Option<Option<u64>>,
    /// The worker did not exit by itself: the hang watch found it hung and the agent stopped it.
    pub hang: Option<Box<crate::watch::Hang>>,
    /// The NCCL flight recorder's dumps the attempt's ranks wrote ([`crate::watch::flight_recorder`]).
    pub flight_recorder: Vec<PathBuf>,
}

impl Failure {
    /// "rank 3 was killed by the kernel OOM killer (container memory limit 8.0 GiB)".
    pub fn oom_line(&self) -> Option<String> {
        let limit = self.oom_killed?;
        let limit = limit.map_or_else(
            || "no container memory limit: the node ran out".to_owned(),
            |b| {
                format!(
                    "container memory limit {}",
                    crate::watch::cgroup::human_bytes(b)
                )
            },
        );
        Some(format!(
            "rank {} was killed by the kernel OOM killer ({limit})",
            self.rank
        ))
    }

    /// The agent's exit code for this failure: [`exit_code::HUNG`] for a hung rank, else the
    /// worker's own code (or 128+signal).
    pub fn exit_code(&self) -> u8 {
        if self.hang.is_some() {
            exit_code::HUNG
        } else {
            self.status.exit_code()
        }
    }
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupOutcome {
    /// Every worker exited 0.
    Succeeded,
    /// A worker failed (the first observed failure); the others were stopped.
    Failed(Failure),
    /// A stop was requested: by `signal`, or by the caller's token (`None`). `all_clean`: every
    /// worker still exited 0.
    Stopped {
        signal: Option<Signal>,
        all_clean: bool,
    },
}

impl GroupOutcome {
    /// The agent's exit code for this outcome (see [`crate::exit_code`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            GroupOutcome::Succeeded
            | GroupOutcome::Stopped {
                all_clean: true, ..
            } => exit_code::SUCCESS,
            GroupOutcome::Failed(f) => f.exit_code(),
            GroupOutcome::Stopped { signal, .. } => {
                exit_code::for_signal(signal.unwrap_or(Signal::SIGTERM) as i32)
            }
        }
    }
}

/// The end of a launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub exit_code: u8,
    /// How the last attempt ended.
    pub last: GroupOutcome,
    /// Attempts made (1 + restarts).
    pub attempts: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(status: ExitStatus) -> Failure {
        Failure {
            host: "h".into(),
            local_rank: 0,
            rank: 0,
            pid: 1,
            status,
            at: SystemTime::UNIX_EPOCH,
            error_file: PathBuf::new(),
            message: None,
            exception_line: None,
            oom_killed: None,
            hang: None,
            flight_recorder: Vec::new(),
        }
    }

    #[test]
    fn exit_codes_of_outcomes() {
        assert_eq!(GroupOutcome::Succeeded.exit_code(), 0);
        assert_eq!(
            GroupOutcome::Failed(failure(ExitStatus::Exited(3))).exit_code(),
            3
        );
        assert_eq!(
            GroupOutcome::Failed(failure(ExitStatus::Signaled(Signal::SIGSEGV))).exit_code(),
            139
        );
        let stopped = |signal, all_clean| GroupOutcome::Stopped { signal, all_clean };
        assert_eq!(stopped(Some(Signal::SIGTERM), false).exit_code(), 143);
        assert_eq!(stopped(Some(Signal::SIGINT), false).exit_code(), 130);
        assert_eq!(stopped(None, false).exit_code(), 143);
        assert_eq!(stopped(Some(Signal::SIGTERM), true).exit_code(), 0);
    }
}
