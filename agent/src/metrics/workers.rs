//! The local worker group and its restarts: `muster_local_workers_running`, worker exits, the
//! restart budget and the gang's root cause of a failed attempt. Steps are kept raw and exported
//! at scrape time ([`super::live`]).

use std::sync::Arc;

use prometheus::{Gauge, IntCounterVec, IntGauge, IntGaugeVec};

use super::live::Live;
use super::{signal_name, truncate, unix_now, Defs, MAX_LOCAL_RANKS};
use crate::launch::{Event, ExitStatus, RestartCause};

const RESTART_CAUSES: [RestartCause; 4] = [
    RestartCause::WorkerFailure,
    RestartCause::PeerFailure,
    RestartCause::MembershipChange,
    RestartCause::Hang,
];

/// The `cause` label of `muster_restarts_total`.
fn restart_cause_label(cause: RestartCause) -> &'static str {
    match cause {
        RestartCause::WorkerFailure => "worker_failure",
        RestartCause::PeerFailure => "peer_failure",
        RestartCause::MembershipChange => "membership_change",
        RestartCause::Hang => "hang",
    }
}

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// It exited with this status (clamped to 0–255 for the label).
    Code(i32),
    /// It was killed by this signal number.
    Signal(i32),
}

impl WorkerExit {
    /// `(code, signal)` label values: the shell's exit code (128+N for a signal, the same number
    /// the agent's own exit code uses) and the signal's name, or `none`.
    pub(super) fn labels(self) -> (String, String) {
        match self {
            WorkerExit::Code(code) => (code.clamp(0, 255).to_string(), "none".to_owned()),
            WorkerExit::Signal(signal) => (
                crate::exit_code::for_signal(signal).to_string(),
                signal_name(signal),
            ),
        }
    }
}

/// What the observer remembers between the loop's worker events.
#[derive(Debug, Default)]
pub(super) struct WorkerTally {
    /// The attempt whose workers are being counted.
    attempt: Option<u32>,
    /// Restarts that consumed the `--max-restarts` budget.
    counted_restarts: u32,
}

/// The worker group's gauges and the restarts' counters.
pub(super) struct Workers {
    running: IntGauge,
    group_starts: Gauge,
    exits: IntCounterVec,
    restarts: IntCounterVec,
    restarts_remaining: IntGauge,
    gang_root_cause: IntGaugeVec,
    live: Arc<Live>,
}

impl Workers {
    /// Defines the family, every restart cause at 0.
    pub(super) fn register(defs: &mut Defs, live: Arc<Live>) -> Self {
        let workers = Self {
            running: defs.int_gauge(
                "muster_local_workers_running",
                "Local worker processes currently alive.",
            ),
            group_starts: defs.gauge(
                "muster_worker_group_start_timestamp_seconds",
                "Unix time the current local worker group was started (0: never).",
            ),
            exits: defs.counter_vec(
                "muster_worker_exits_total",
                "Local worker exits, by exit code (128+N for signal N) and signal name (none).",
                &["code", "signal"],
            ),
            restarts: defs.counter_vec(
                "muster_restarts_total",
                "Restarts of the local worker group, by cause.",
                &["cause"],
            ),
            restarts_remaining: defs.int_gauge(
                "muster_restarts_remaining",
                "Restarts left in the --max-restarts budget.",
            ),
            gang_root_cause: defs.int_gauge_vec(
                "muster_gang_root_cause_info",
                "The gang's first failure of the last failed attempt, on whichever node it was (always 1; one series).",
                &["node_rank", "host", "rank", "local_rank", "exit_code"],
            ),
            live,
        };
        for cause in RESTART_CAUSES {
            workers
                .restarts
                .with_label_values(&[restart_cause_label(cause)]);
        }
        workers
    }

    /// A local worker group of `count` processes started; forgets the previous attempt's steps.
    pub(super) fn workers_started(&self, count: u32) {
        self.running.set(i64::from(count));
        self.group_starts.set(unix_now());
        self.live.clear_steps();
    }

    /// One more local worker of the current group started.
    pub(super) fn worker_started(&self) {
        self.running.inc();
    }

    /// One local worker ended.
    pub(super) fn worker_exited(&self, exit: WorkerExit) {
        let (code, signal) = exit.labels();
        self.exits.with_label_values(&[&code, &signal]).inc();
        // Saturating: an exit reported after `workers_stopped` must not go negative.
        if self.running.get() > 0 {
            self.running.dec();
        }
    }

    /// The whole local group is gone (after a stop), whatever was reported per worker.
    pub(super) fn workers_stopped(&self) {
        self.running.set(0);
    }

    /// Local workers currently alive, as last reported.
    pub(super) fn workers_running(&self) -> u32 {
        u32::try_from(self.running.get()).unwrap_or(0)
    }

    /// The local group is being restarted.
    pub(super) fn restarted(&self, cause: RestartCause) {
        self.restarts
            .with_label_values(&[restart_cause_label(cause)])
            .inc();
    }

    /// The gang's root cause of the last failed attempt: the one series of
    /// `muster_gang_root_cause_info`.
    pub(super) fn set_gang_root_cause(&self, root: &crate::launch::gang_cause::PostedFailure) {
        let family = &self.gang_root_cause;
        family.reset();
        family
            .with_label_values(&[
                root.node_rank.to_string().as_str(),
                truncate(&root.host, 63),
                root.rank.to_string().as_str(),
                root.local_rank.to_string().as_str(),
                root.exit_code.to_string().as_str(),
            ])
            .set(1);
    }

    /// Restarts left in the budget.
    pub(super) fn set_restarts_remaining(&self, remaining: u32) {
        self.restarts_remaining.set(i64::from(remaining));
    }

    /// A local rank reported that it reached `step`.
    pub(super) fn worker_step(&self, local_rank: u32, step: u64) {
        if local_rank < MAX_LOCAL_RANKS {
            self.live.worker_step(local_rank, step);
        }
    }

    /// Records the loop's worker events (started, exited, group ended, restarting); others are
    /// not its. `max_restarts` is the configured budget.
    pub(super) fn observe(&self, event: &Event, tally: &mut WorkerTally, max_restarts: u32) {
        match event {
            Event::WorkerStarted { restart_count, .. } => {
                if tally.attempt == Some(*restart_count) {
                    self.worker_started();
                } else {
                    tally.attempt = Some(*restart_count);
                    self.workers_started(1);
                }
            }
            Event::WorkerExited { status, .. } => self.worker_exited(match status {
                ExitStatus::Exited(code) => WorkerExit::Code(*code),
                ExitStatus::Signaled(signal) => WorkerExit::Signal(*signal as i32),
            }),
            Event::GroupEnded { .. } => self.workers_stopped(),
            Event::Restarting { cause, .. } => {
                self.restarted(*cause);
                if *cause != RestartCause::MembershipChange {
                    tally.counted_restarts += 1;
                }
                self.set_restarts_remaining(max_restarts.saturating_sub(tally.counted_restarts));
            }
            _ => {}
        }
    }
}
