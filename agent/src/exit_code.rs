//! muster's exit codes.
//!
//! A Kubernetes Job's `podFailurePolicy` matches on container exit codes, so every outcome that
//! belongs to the agent itself (not to a worker) has its own reserved code. The reserved codes
//! live at 200 and above: outside the 128+signal range (129–192) that a worker killed by a signal
//! maps to, and away from the small codes scripts commonly use.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | every worker on every node succeeded |
//! | 1–127 | the root-cause worker's own exit code |
//! | 128+N | the root-cause worker died of signal N, or the agent was stopped by signal N |
//! | 200 | preempted and the checkpoint was committed (`--preempted-exit-code`, 200 by default) |
//! | 201 | preempted but the checkpoint was aborted (deadline, or a worker died while saving) |
//! | 202 | configuration error (bad flag, missing script, unwritable log dir, ...) |
//! | 203 | rendezvous timeout (nodes missing at the join deadline) |
//! | 204 | unhealthy GPU (pre-flight failed on this node or on a peer) |
//! | 205 | the store host (node 0) was lost and no replacement came back within the join timeout |
//! | 206 | internal agent error |
//! | 207 | a rank hung (no progress within `--hang-timeout`) and the restart budget was spent |
//! | 208 | network check failed: a slow node or link, named (`--network-check require`) |
//! | 209 | crash loop: `--max-no-progress-restarts` restarts in a row made no progress |
//! | 210 | this node was found a straggler for a sustained period and left the gang (`--straggler-action exclude`) |
//! | 220 | `muster dry-run --chaos` only: the job finished, but a strike was not recovered within `--chaos-recovery-bound` |
//! | 221 | `muster dry-run --chaos` only: the job finished before every strike of the schedule was injected |

/// Everything succeeded.
pub const SUCCESS: u8 = 0;
/// Preempted, and every rank's checkpoint was committed: the default of `--preempted-exit-code`.
///
/// Not 0: a container that exits 0 makes its pod Succeeded, and every Kubernetes training API
/// counts a succeeded pod as finished work (an Indexed Job completes the index, a PyTorchJob
/// whose Master succeeds is Succeeded). The barrier makes every node exit with this code, so 0
/// would end the whole job as Complete with training unfinished. A non-zero code that the job's
/// failure policy ignores (`podFailurePolicy` `Ignore`, PyTorchJob `restartPolicy: ExitCode`)
/// resumes it without consuming the backoff budget; see `examples/kubernetes/README.md`.
pub const PREEMPTED_CHECKPOINTED: u8 = 200;
/// Preempted, but the checkpoint could not be committed before the deadline.
pub const CHECKPOINT_ABORTED: u8 = 201;
/// Bad command line, environment or file system setup.
pub const CONFIG_ERROR: u8 = 202;
/// The gang did not form before the join deadline.
pub const RENDEZVOUS_TIMEOUT: u8 = 203;
/// GPU pre-flight failed here or on a peer.
pub const UNHEALTHY_GPU: u8 = 204;
/// The node hosting the store went away.
pub const STORE_HOST_LOST: u8 = 205;
/// A bug or an unexpected OS failure in the agent itself.
pub const INTERNAL_ERROR: u8 = 206;
/// A rank hung (no step within `--hang-timeout`, or a section past `--section-timeout`) and the
/// restart budget was spent: a code of its own, so a failure policy can tell a hang (often a bad
/// node or link) from a crash.
pub const HUNG: u8 = 207;
/// The gang's network pre-flight named a slow node or link under `--network-check require`:
/// every node of the round ends with it (or, with `--nnodes MIN:MAX`, the named node leaves
/// with it while the others train on).
pub const NETWORK_CHECK_FAILED: u8 = 208;
/// Crash loop: `--max-no-progress-restarts` restarts in a row whose attempts made no progress
/// (no step beyond the previous attempt's) — a deterministic failure, which more restarts do not
/// cure: a code of its own, so a failure policy can end the Job instead of recreating the pod.
pub const NO_PROGRESS: u8 = 209;
/// A rank of this node held the gang back for a sustained period (the straggler watch,
/// `--straggler-action exclude` with `--nnodes MIN:MAX`): the node stopped its workers and left,
/// so the gang re-forms without it. A failure policy can `Ignore` it (the job goes on without
/// the node) or count it, and the operator cordons the node.
pub const SLOW_NODE_EXCLUDED: u8 = 210;
/// `muster dry-run --chaos` only (an agent never exits with it): the job finished, but a strike
/// was not recovered within `--chaos-recovery-bound`. Set apart from the agents' sequential codes
/// (200 up) so that a new agent outcome never takes it, and above every 128+N a real signal makes.
pub const CHAOS_NOT_RECOVERED: u8 = 220;
/// `muster dry-run --chaos` only: the job finished (and what struck was recovered), but fewer
/// strikes were injected than the schedule holds: the job ended first, or a target was gone. A
/// rehearsal that rehearsed less than it was asked to must not read as a pass (exit 0), nor as
/// a failed recovery (220): the fix is a longer job or a shorter `--chaos-interval`.
pub const CHAOS_NOT_INJECTED: u8 = 221;

/// Exit code for a process that died of `signal` (the shell convention).
pub fn for_signal(signal: i32) -> u8 {
    (128 + signal.clamp(0, 127)) as u8
}

/// An error that knows which exit code it maps to. Error types implement this so that the one
/// mapping function, [`crate::cmd::exit_code_of`], finds the code by walking the error chain.
pub trait Coded {
    fn exit_code(&self) -> u8;
}

/// A classified outcome carried through `anyhow` so the top level can pick the exit code.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Exit {
    pub code: u8,
    pub message: String,
}

impl Exit {
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn config(message: impl Into<String>) -> Self {
        Self::new(CONFIG_ERROR, message)
    }
}

impl Coded for Exit {
    fn exit_code(&self) -> u8 {
        self.code
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_codes_follow_the_shell_convention() {
        assert_eq!(for_signal(15), 143);
        assert_eq!(for_signal(9), 137);
    }

    #[test]
    fn reserved_codes_are_distinct_and_outside_the_signal_range() {
        let reserved = [
            PREEMPTED_CHECKPOINTED,
            CHECKPOINT_ABORTED,
            CONFIG_ERROR,
            RENDEZVOUS_TIMEOUT,
            UNHEALTHY_GPU,
            STORE_HOST_LOST,
            INTERNAL_ERROR,
            HUNG,
            NETWORK_CHECK_FAILED,
            NO_PROGRESS,
            SLOW_NODE_EXCLUDED,
            CHAOS_NOT_RECOVERED,
            CHAOS_NOT_INJECTED,
        ];
        for (i, a) in reserved.iter().enumerate() {
            assert!(*a > 192, "{a} collides with 128+signal");
            for b in &reserved[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
