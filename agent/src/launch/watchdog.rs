//! The seam through which something watches a running attempt for a hang ([`crate::watch`]):
//! the launch loop hands it the attempt's workers and races its verdict against their exits.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;

use super::{BoxFuture, RankAssignment};
use crate::watch::Hang;

/// One worker of the attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchedWorker {
    pub local_rank: u32,
    pub rank: u32,
    pub pid: u32,
}

/// Writes lines (a rank's stack dump) into the log as that local rank's stderr, with its prefix.
pub type RankWriter = Arc<dyn Fn(u32, &[String]) + Send + Sync>;

/// What the watchdog gets of one attempt.
pub struct WatchedAttempt {
    pub assignment: RankAssignment,
    pub host: String,
    pub workers: Vec<WatchedWorker>,
    /// Local ranks that exited so far (an early finisher is not hung).
    pub exited: watch::Receiver<Vec<u32>>,
    /// When the first worker started: reports from before belong to an earlier attempt.
    pub started: Instant,
    /// `<run_dir>/attempt_<n>`, where the workers' files go (flight-recorder dumps).
    pub attempt_dir: Option<PathBuf>,
    pub write: RankWriter,
}

/// Watches attempts for a hang.
pub trait Watchdog: Send + Sync {
    /// Resolves with the hung rank once the attempt is judged hung (its stacks already dumped);
    /// never resolves otherwise. Dropped when the attempt ends first.
    fn watch(&self, attempt: WatchedAttempt) -> BoxFuture<'static, Hang>;
}
