//! `--snapshot-persist DIR`: the newest committed snapshot written to storage in the background,
//! so that a loss of the whole job (every pod, a node pool drained, the Job recreated) resumes
//! from it as a restart within the job resumes from the agents' memory ([`super::disk`] has the
//! files).
//!
//! Which step counts: only committed steps are written, and a later job restores a step only
//! when every node finds all its ranks' files of it ([`super::commit`]'s agreement, with these
//! steps in each node's offer), so nothing is restored that every rank did not hand over. Each
//! node keeps its ranks' files of the two newest steps it wrote whole: the gang's nodes write at
//! their own pace, and one a step behind still has one in common with the others.

use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::disk::Disk;
use super::server::{Shared, Wanted};
use crate::watch::cgroup::human_bytes;

/// The one writer of this node's files: per attempt, it first removes the files of the dead
/// timeline ([`Disk::forget_after`] the agreed step), then writes each committed step, newest
/// first: a step committed while a write is under way waits for it, one in between is skipped
/// (only the newest matters). Being the only writer is what keeps a dead timeline's write, still
/// under way when the next attempt settles, from landing after that attempt's removal.
/// What was written whole goes to [`Shared::persisted`].
pub async fn write_committed(shared: Arc<Shared>, disk: Disk, stop: CancellationToken) {
    let mut wanted = shared.to_persist.subscribe();
    let mut settled_attempt: Option<u32> = None;
    let mut tried: Option<(u32, u64)> = None;
    let mut said_ok = false;
    let mut said_failed = false;
    loop {
        let latest = *wanted.borrow_and_update();
        let share = shared.holder().share();
        if let (Some(latest), Some(share)) = (latest, share) {
            if settled_attempt != Some(latest.attempt) && share.attempt == latest.attempt {
                settled_attempt = Some(latest.attempt);
                if let Some(step) = forget_dead_timeline(&disk, share, latest.agreed).await {
                    shared.persisted.send_replace(Some(step));
                    tried = Some((latest.attempt, step));
                }
            }
            let write = latest
                .step
                .map(|step| (latest.attempt, step))
                .filter(|w| settled_attempt == Some(w.0) && tried != Some(*w));
            if let Some((attempt, step)) = write {
                tried = Some((attempt, step));
                let parts = shared.holder().parts_of(step);
                if !parts.is_empty() {
                    let started = Instant::now();
                    let written = write_at_low_priority(disk.clone(), step, share, parts).await;
                    let seconds = started.elapsed().as_secs_f64();
                    match written {
                        Ok(Ok(bytes)) => {
                            let line = format!(
                                "snapshots: step {step} written to {} ({} in {seconds:.2} s)",
                                disk.dir().display(),
                                human_bytes(bytes)
                            );
                            if said_ok {
                                debug!("{line}");
                            } else {
                                info!("{line}");
                                said_ok = true;
                            }
                            if let Some(meter) = &shared.meter {
                                meter.persisted(step, seconds);
                            }
                            shared.persisted.send_replace(Some(step));
                        }
                        Ok(Err(why)) if !said_failed => {
                            said_failed = true;
                            warn!("snapshots: cannot write step {step} to storage ({why}); a loss of the whole job would restore an older step or none");
                        }
                        Ok(Err(why)) => debug!("snapshots: writing step {step} failed: {why}"),
                        Err(e) => warn!("snapshots: the write of step {step} failed: {e}"),
                    }
                    // Asked again while writing: look before waiting.
                    continue;
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            changed = wanted.changed() => if changed.is_err() { return },
        }
    }
}

/// The files of every step after `agreed` (all, without one) are of a timeline that did not
/// survive, and go before the new timeline commits steps of the same numbers (a node that wrote
/// the new one and a node still holding the old one would otherwise both say "step S"). Returns
/// the agreed step when it is whole on the disk already.
async fn forget_dead_timeline(
    disk: &Disk,
    share: super::holder::Share,
    agreed: Option<u64>,
) -> Option<u64> {
    let disk = disk.clone();
    tokio::task::spawn_blocking(move || {
        disk.forget_after(share, agreed);
        agreed.filter(|step| disk.complete_steps(share).contains(step))
    })
    .await
    .ok()
    .flatten()
}

/// Writes on a thread of its own at the lowest CPU priority: the ranks train on the same CPUs,
/// and a write that waits costs nothing but its lag.
async fn write_at_low_priority(
    disk: Disk,
    step: u64,
    share: super::holder::Share,
    parts: Vec<(u32, std::os::fd::OwnedFd, u64)>,
) -> Result<Result<u64, super::disk::PersistError>, String> {
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("muster-snapshot-writer".into())
        .spawn(move || {
            crate::sys::lower_this_threads_priority();
            let _ = done.send(disk.write(step, share, &parts));
        })
        .map_err(|e| format!("cannot start the writer thread: {e}"))?;
    result
        .await
        .map_err(|_| "the writer thread ended without an answer".to_owned())
}

/// The steps this node could restore from the disk for the ranks it runs now.
pub async fn steps_on_disk(shared: &Arc<Shared>) -> Vec<u64> {
    let (Some(disk), Some(share)) = (shared.disk.clone(), shared.holder().share()) else {
        return Vec::new();
    };
    tokio::task::spawn_blocking(move || disk.complete_steps(share))
        .await
        .unwrap_or_default()
}

/// Reads this node's parts of `step` from the disk into the holder, within its memory cap;
/// whether they are held now.
pub async fn load_into_holder(shared: &Arc<Shared>, step: u64) -> bool {
    let (Some(disk), Some(share)) = (shared.disk.clone(), shared.holder().share()) else {
        return false;
    };
    let room = {
        let holder = shared.holder();
        let held = holder.bytes_held() + shared.replicas().bytes();
        holder.cap_bytes().saturating_sub(held)
    };
    let started = Instant::now();
    let dir = disk.dir().to_owned();
    let loaded = tokio::task::spawn_blocking(move || match disk.bytes_of(step, share) {
        Some(bytes) if bytes > room => Err(format!(
            "its {} do not fit in the {} left under --snapshot-memory",
            human_bytes(bytes),
            human_bytes(room)
        )),
        _ => disk.load(step, share).map_err(|e| e.to_string()),
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    match loaded {
        Ok(parts) => {
            let bytes: u64 = parts.iter().map(|(_, _, b)| *b).sum();
            if shared.holder().adopt(step, parts) {
                info!(
                    "snapshots: read this node's parts of step {step} from {} ({} in {:.2} s)",
                    dir.display(),
                    human_bytes(bytes),
                    started.elapsed().as_secs_f64()
                );
                true
            } else {
                warn!("snapshots: the parts of step {step} under {} are not every rank's of this node", dir.display());
                false
            }
        }
        Err(why) => {
            warn!(
                "snapshots: cannot read this node's parts of step {step} from {}: {why}",
                dir.display()
            );
            false
        }
    }
}

/// The gang agreed on `agreed` (or nothing) for `attempt`: the writer removes the dead
/// timeline's files, then writes the agreed step when it is due and not on the disk yet.
pub fn settle(shared: &Shared, attempt: u32, agreed: Option<u64>) {
    let due = |step: &u64| shared.disk.as_ref().is_some_and(|d| d.due(*step));
    shared.to_persist.send_replace(Some(Wanted {
        attempt,
        agreed,
        step: agreed.filter(due),
    }));
}

/// `step` is committed in `attempt`: the writer writes it when it is due (`force`: whatever
/// its number, as before the agent exits).
pub fn committed(shared: &Shared, attempt: u32, step: u64, force: bool) {
    if !shared.disk.as_ref().is_some_and(|d| force || d.due(step)) {
        return;
    }
    shared.to_persist.send_if_modified(|wanted| match wanted {
        Some(w) if w.attempt == attempt && w.step.is_none_or(|s| s < step) => {
            w.step = Some(step);
            true
        }
        _ => false,
    });
}
