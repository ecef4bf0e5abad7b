//! The attempt loop: one rendezvous round, one worker group, one verdict per attempt, until the
//! launch ends; with the crash-loop guard and the checks for a GPU fault or a request to leave.

use nix::sys::signal::Signal;
use tokio::time::Instant;

use super::error::LaunchError;
use super::gpu_wait::{gpu_baseline, wait_for_gpus};
use super::group::{run_group, Attempt, WorkerGroupSpec};
use super::observe::{Event, Phase, RestartCause};
use super::outcome::{Failure, GroupOutcome, Outcome, Round};
use super::rdzv::{AfterGroup, GangRestart, Rendezvous};
use super::signals::StopRequest;
use super::{crash_loop, leave, restart_timeline, summary, Config, StepSource};
use crate::exit_code;

/// Resolves with the watch's fatal GPU fault; never without a watch.
async fn gpu_fault(watch: Option<&crate::gpu::watch::Watch>) -> crate::gpu::watch::GpuEvent {
    match watch {
        Some(watch) => watch.fault().await,
        None => std::future::pending().await,
    }
}

/// Resolves with the first request to leave; never without a handle.
async fn left(leave: Option<&leave::Leave>) -> leave::Departure {
    match leave {
        Some(leave) => leave.requested().await,
        None => std::future::pending().await,
    }
}

/// [`LaunchError::Left`] when a part asked this node to leave.
fn check_leave(leave: Option<&leave::Leave>) -> Result<(), LaunchError> {
    match leave.and_then(leave::Leave::current) {
        Some(departure) => Err(LaunchError::Left(departure)),
        None => Ok(()),
    }
}

/// [`LaunchError::GpuFault`] when the watch has seen a fatal fault.
fn check_gpus(watch: Option<&crate::gpu::watch::Watch>) -> Result<(), LaunchError> {
    match watch.and_then(crate::gpu::watch::Watch::current_fault) {
        Some(fault) => Err(LaunchError::GpuFault(Box::new(fault))),
        None => Ok(()),
    }
}

/// Runs attempts until one ends the launch: a success, a stop, a spent restart budget, a crash
/// loop, or the gang's verdict.
pub(super) async fn attempts(
    spec: &WorkerGroupSpec,
    rendezvous: &mut dyn Rendezvous,
    stop: &StopRequest,
    gpu_watch: Option<&crate::gpu::watch::Watch>,
    leave: Option<&leave::Leave>,
    steps: Option<&StepSource>,
) -> Result<Outcome, LaunchError> {
    let config = &spec.config;
    let mut restarts = Restarts {
        count: 0,
        guard: crash_loop::Guard::new(config.max_no_progress_restarts),
    };
    // The GPU use before the attempt that just ended, and its processes: what the next attempt
    // waits to see released.
    let mut previous: Option<(Vec<crate::gpu::release::GpuUse>, Vec<u32>)> = None;
    // The last attempt's end, its workers down and the restart decided: the start of the next
    // attempt's restart timeline.
    let mut restarting: Option<(Instant, Instant, Instant)> = None;
    loop {
        let restart_count = restarts.count;
        // A node whose GPU faulted starts no attempt (also when the fault came while the
        // previous one was already failing because of it).
        check_gpus(gpu_watch)?;
        if let Some((baseline, pids)) = previous.take() {
            if !stop.is_requested() {
                wait_for_gpus(spec, baseline, pids, restart_count, stop).await?;
            }
        }
        if stop.is_requested() {
            let last = GroupOutcome::Stopped {
                signal: stop.received_signal(),
                all_clean: false,
            };
            return Ok(Outcome {
                exit_code: last.exit_code(),
                last,
                attempts: restart_count,
            });
        }
        let round = match join_round(spec, rendezvous, restart_count, stop).await? {
            Joined::Round(round) => round,
            Joined::Stopped => continue,
            Joined::FinishedAsSpare => {
                return Ok(Outcome {
                    exit_code: exit_code::SUCCESS,
                    last: GroupOutcome::Succeeded,
                    attempts: restart_count,
                })
            }
        };
        let formed = Instant::now();
        spec.publisher.event(Event::AttemptStarted {
            assignment: round.assignment.clone(),
        });
        let attempt_stop = stop.child();
        let baseline = gpu_baseline(config).await;
        let attempt_started = Instant::now();
        let round_restart_count = round.assignment.restart_count;
        let restarted =
            restarting
                .take()
                .map(|(ended, down, decided)| restart_timeline::Restarted {
                    ended,
                    down,
                    decided,
                    formed,
                });
        let attempt = run_attempt(
            spec,
            rendezvous,
            round,
            &attempt_stop,
            gpu_watch,
            leave,
            restarted,
        )
        .await;
        let down = Instant::now();
        let Attempt {
            outcome,
            pids,
            ended: supervision_ended,
        } = attempt?;
        check_gpus(gpu_watch)?;
        check_leave(leave)?;
        previous = baseline.map(|b| (b, pids));
        let progress = crash_loop::AttemptProgress {
            max_step: steps.and_then(|s| s(attempt_started)),
            ran_for: attempt_started.elapsed(),
        };
        let ended = Ended {
            outcome,
            progress,
            round_restart_count,
        };
        if let Some(outcome) = after_attempt(spec, rendezvous, stop, &mut restarts, ended).await? {
            return Ok(outcome);
        }
        restarting = Some((supervision_ended, down, Instant::now()));
    }
}

/// The restarts so far: how many, and the crash-loop guard that watches them.
struct Restarts {
    count: u32,
    guard: crash_loop::Guard,
}

/// One attempt as it ended.
struct Ended {
    outcome: GroupOutcome,
    progress: crash_loop::AttemptProgress,
    /// The restart count the round gave the attempt.
    round_restart_count: u32,
}

/// Decides what follows an attempt: the gang's verdict, else the crash-loop guard's, else a
/// restart while the budget lasts. `Some`: the launch ends with it; `None`: a restart was counted.
async fn after_attempt(
    spec: &WorkerGroupSpec,
    rendezvous: &mut dyn Rendezvous,
    stop: &StopRequest,
    restarts: &mut Restarts,
    ended: Ended,
) -> Result<Option<Outcome>, LaunchError> {
    let config = &spec.config;
    let Ended {
        outcome,
        progress,
        round_restart_count,
    } = ended;
    let crash_loop = match &outcome {
        // Judged where a restart would follow; a spent budget ends with the worker's code.
        GroupOutcome::Failed(f)
            if round_restart_count < config.max_restarts && !stop.is_requested() =>
        {
            judge_crash_loop(&restarts.guard, progress, f, config, rendezvous)
        }
        _ => None,
    };
    match rendezvous.after_group(&outcome, stop).await? {
        Some(AfterGroup::Restart(why)) => {
            restarts.count += 1;
            // Every node counts every failure restart of the gang, its own or another
            // node's, so nodes failing in turn are one crash loop; a membership change
            // (and a local failure that was its consequence) only moves the baseline.
            note_crash_loop(&mut restarts.guard, progress, why == GangRestart::Failure);
            spec.publisher.event(Event::Restarting {
                restart_count: restarts.count,
                cause: gang_restart_cause(&outcome, why),
            });
            return Ok(None);
        }
        Some(AfterGroup::Finish(exit_code)) => {
            return Ok(Some(Outcome {
                exit_code,
                last: outcome,
                attempts: restarts.count + 1,
            }))
        }
        None => {}
    }
    if crash_loop.is_some() {
        return Ok(Some(Outcome {
            exit_code: exit_code::NO_PROGRESS,
            last: outcome,
            attempts: restarts.count + 1,
        }));
    }
    match &outcome {
        GroupOutcome::Failed(f) if restarts.count < config.max_restarts && !stop.is_requested() => {
            restarts.count += 1;
            note_crash_loop(&mut restarts.guard, progress, true);
            announce_restart(spec, f, restarts.count);
            Ok(None)
        }
        _ => Ok(Some(Outcome {
            exit_code: outcome.exit_code(),
            last: outcome,
            attempts: restarts.count + 1,
        })),
    }
}

/// What waiting for the next rendezvous round came to.
enum Joined {
    Round(Round),
    /// A stop was requested while waiting.
    Stopped,
    /// The job finished while this node waited as a spare.
    FinishedAsSpare,
}

/// Waits for the round of attempt `restart_count`, or for a stop.
async fn join_round(
    spec: &WorkerGroupSpec,
    rendezvous: &mut dyn Rendezvous,
    restart_count: u32,
    stop: &StopRequest,
) -> Result<Joined, LaunchError> {
    spec.publisher.phase(Phase::Rendezvous { restart_count });
    let round = rendezvous.next_round(&spec.config, restart_count, stop);
    tokio::pin!(round);
    // A spare keeps standbys for the ranks it would run, from the gang's module lists: started
    // here, in the task that later begins the attempt, so they exist before its first rank.
    let share = spec.standby.as_ref().map(|pool| pool.share());
    let mut spare_started = false;
    let mut spare_importing = false;
    let mut spare_lists = std::pin::pin!(async {
        match &share {
            Some(share) => share.gang().await,
            None => std::future::pending().await,
        }
    });
    loop {
        tokio::select! {
            round = &mut round => return match round {
                Ok(round) => Ok(Joined::Round(round)),
                Err(LaunchError::Rendezvous(rendezvous::rdzv::RdzvError::FinishedAsSpare)) => {
                    // Not a failure: under a Kubernetes Job a spare that ended 203/205 here
                    // would mark its pod Failed although the job succeeded.
                    tracing::info!("the job finished while this pod waited as a spare");
                    Ok(Joined::FinishedAsSpare)
                }
                Err(e) => Err(e),
            },
            () = stop.requested() => return Ok(Joined::Stopped),
            lists = &mut spare_lists, if !spare_started => {
                spare_started = true;
                if let (Some(pool), Some(share)) = (&spec.standby, &share) {
                    share.take_gang();
                    pool.start_for_spare(&super::group::spare_plans(spec), &lists);
                    spare_importing = true;
                }
            }
            // Each of the spare's standbys says once what it costs when ready, as a member's do.
            () = tokio::time::sleep(super::standby::POLL), if spare_importing => {
                spare_importing = spec.standby.as_ref().is_some_and(|pool| pool.announce_ready());
            }
        }
    }
}

/// Runs the round's worker group to its end; the rendezvous, a fatal GPU fault or a request to
/// leave stop it early through `attempt_stop`. The store the round hosted is shut down after.
async fn run_attempt(
    spec: &WorkerGroupSpec,
    rendezvous: &mut dyn Rendezvous,
    round: Round,
    attempt_stop: &StopRequest,
    gpu_watch: Option<&crate::gpu::watch::Watch>,
    leave: Option<&leave::Leave>,
    restarted: Option<restart_timeline::Restarted>,
) -> Result<Attempt, LaunchError> {
    let attempt = {
        let group = run_group(
            spec,
            &round.assignment,
            attempt_stop,
            round.failure_post,
            restarted,
        );
        tokio::pin!(group);
        tokio::select! {
            outcome = &mut group => outcome,
            () = rendezvous.watch() => {
                attempt_stop.request(Signal::SIGTERM);
                group.await
            }
            _fault = gpu_fault(gpu_watch) => {
                // Reported by `check_gpus` once the workers are down.
                attempt_stop.request(Signal::SIGTERM);
                group.await
            }
            _departure = left(leave) => {
                // Reported by `check_leave` once the workers are down.
                attempt_stop.request(Signal::SIGTERM);
                group.await
            }
        }
    };
    if let Some(store) = round.store {
        store.shutdown().await;
    }
    attempt
}

/// Why the gang restarts after this node's attempt ended with `outcome`.
fn gang_restart_cause(outcome: &GroupOutcome, why: GangRestart) -> RestartCause {
    match (outcome, why) {
        (_, GangRestart::Membership) => RestartCause::MembershipChange,
        (GroupOutcome::Failed(f), _) if f.hang.is_some() => RestartCause::Hang,
        (GroupOutcome::Failed(_), _) => RestartCause::WorkerFailure,
        _ => RestartCause::PeerFailure,
    }
}

/// Logs and publishes restart `restart_count` of a single node's group after failure `f`.
fn announce_restart(spec: &WorkerGroupSpec, f: &Failure, restart_count: u32) {
    let max_restarts = spec.config.max_restarts;
    if let Some(hang) = &f.hang {
        tracing::warn!(
            "{}; restarting the worker group with cause hang (restart {restart_count} of {max_restarts})",
            hang.describe(),
        );
    } else {
        tracing::warn!(
            "{}; restarting the worker group (restart {restart_count} of {max_restarts})",
            summary::restart_reason(f),
        );
    }
    spec.publisher.event(Event::Restarting {
        restart_count,
        cause: if f.hang.is_some() {
            RestartCause::Hang
        } else {
            RestartCause::WorkerFailure
        },
    });
}

/// The crash-loop guard's verdict on a failed attempt that a restart would follow: `Some` with
/// the message when the job ends with [`exit_code::NO_PROGRESS`] here. In a gang the message
/// goes to the rendezvous, which ends the job for every node ([`Rendezvous::end_on_failure`]);
/// `None` then, and the rendezvous says `Finish` (or restarts after all, when the failure turns
/// out to be the consequence of a lost member).
fn judge_crash_loop(
    guard: &crash_loop::Guard,
    progress: crash_loop::AttemptProgress,
    failure: &Failure,
    config: &Config,
    rendezvous: &mut dyn Rendezvous,
) -> Option<String> {
    let (verdict, reason) = guard.judge(progress);
    match verdict {
        crash_loop::Verdict::Progress | crash_loop::Verdict::NoProgress { .. } => None,
        crash_loop::Verdict::Stop => {
            tracing::warn!("crash-loop guard: {reason}");
            let what = match &failure.hang {
                Some(hang) => format!("cause hang: {}", hang.describe()),
                None => summary::restart_reason(failure),
            };
            let message =
                crash_loop::stop_message(config.max_no_progress_restarts, &what, progress.max_step);
            tracing::error!("{message}");
            (!rendezvous.end_on_failure(exit_code::NO_PROGRESS, message.clone())).then_some(message)
        }
    }
}

/// Records a restarted attempt in the crash-loop guard; `counts`: a failure restart (not a
/// membership change).
fn note_crash_loop(
    guard: &mut crash_loop::Guard,
    progress: crash_loop::AttemptProgress,
    counts: bool,
) {
    if let Some(reason) = guard.record(progress, counts) {
        tracing::warn!("crash-loop guard: {reason}");
    }
}
