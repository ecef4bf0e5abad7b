//! The agent's own stop, told apart from anyone else's signal. Under Slurm `slurmstepd` signals
//! every process of the step, the ranks included, so a rank that takes part in the checkpoint
//! barrier holds a SIGTERM (or another `checkpoint` signal) that did not come from its agent
//! (`python/muster_launcher/checkpoint.py`). Python's signal handlers do not see the sender, so the agent
//! says "this one is mine" with a file: it creates the file named in [`ENV`] just before it
//! signals the workers to stop, and removes it before each attempt starts. A held rank that sees
//! the file dies of the signal as it would have without the hold.

use std::ffi::OsString;
use std::path::Path;

/// The variable that names the mark for the workers (set by the composition root only when the
/// ranks are told to hold foreign signals, [`crate::slurm::HOLD_ENV`]).
pub const ENV: &str = "MUSTER_STOP_MARK";

fn path(extra_env: &[(String, OsString)]) -> Option<&Path> {
    extra_env
        .iter()
        .find(|(k, _)| k == ENV)
        .map(|(_, v)| Path::new(v))
}

/// Marks the stop that follows as the agent's. Best effort: without the file a held rank lives
/// until the SIGKILL after `--shutdown-timeout`, which is slower but still ends.
pub fn announce(extra_env: &[(String, OsString)]) {
    if let Some(p) = path(extra_env) {
        if let Err(e) = std::fs::write(p, b"") {
            tracing::warn!(
                "cannot write the stop mark {} ({e}): ranks that hold foreign signals stop only at the SIGKILL",
                p.display()
            );
        }
    }
}

/// A new attempt starts unmarked.
pub fn clear(extra_env: &[(String, OsString)]) {
    if let Some(p) = path(extra_env) {
        let _ = std::fs::remove_file(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announce_then_clear() {
        let dir = std::env::temp_dir().join(format!("muster-stop-mark-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let mark = dir.join("stop");
        let env = vec![(ENV.to_owned(), OsString::from(&mark))];
        clear(&env);
        assert!(!mark.exists());
        announce(&env);
        assert!(mark.exists());
        clear(&env);
        assert!(!mark.exists());
        // Nothing named: nothing done.
        announce(&[]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
