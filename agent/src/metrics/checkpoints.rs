//! Checkpoint barriers as this node saw them: requests by trigger, barriers by outcome, their
//! duration and the last committed step. The barrier's phase is a state set built at scrape
//! time ([`super::live`]); the request channel itself is [`crate::checkpoint::requests`].

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Gauge, HistogramOpts, HistogramVec, IntCounterVec, IntGauge};

use super::live::Live;
use super::{unix_now, Defs, STATIC_DEFINITION};
use crate::checkpoint::requests::CheckpointTrigger;
use crate::events::{self, CheckpointResult};
use crate::launch::config::SignalAction;
use crate::launch::Event;

/// A checkpoint barrier must fit in a grace period (30 s by default on Kubernetes, minutes at most).
const CHECKPOINT_BUCKETS_SECONDS: [f64; 10] =
    [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0];

/// Where a checkpoint barrier stands, exported as the state set `muster_checkpoint_phase{phase}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CheckpointPhase {
    /// No checkpoint in progress.
    Idle = 0,
    /// The agents are agreeing on the step every rank can still reach.
    Agreeing = 1,
    /// Ranks were told the step and are saving.
    Saving = 2,
    /// Every local rank saved; waiting for the gang-wide commit.
    Committing = 3,
}

impl CheckpointPhase {
    pub(super) const ALL: [CheckpointPhase; 4] = [
        CheckpointPhase::Idle,
        CheckpointPhase::Agreeing,
        CheckpointPhase::Saving,
        CheckpointPhase::Committing,
    ];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            CheckpointPhase::Idle => "idle",
            CheckpointPhase::Agreeing => "agreeing",
            CheckpointPhase::Saving => "saving",
            CheckpointPhase::Committing => "committing",
        }
    }

    pub(super) fn from_u8(value: u8) -> CheckpointPhase {
        CheckpointPhase::ALL
            .get(usize::from(value))
            .copied()
            .unwrap_or(CheckpointPhase::Idle)
    }
}

/// How a checkpoint barrier ended (`outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointOutcome {
    /// Every rank saved and the commit key was written.
    Committed,
    /// The deadline passed or a rank died while saving; the previous checkpoint stays current.
    Aborted,
}

impl CheckpointOutcome {
    const ALL: [CheckpointOutcome; 2] = [CheckpointOutcome::Committed, CheckpointOutcome::Aborted];

    fn as_str(self) -> &'static str {
        match self {
            CheckpointOutcome::Committed => "committed",
            CheckpointOutcome::Aborted => "aborted",
        }
    }
}

/// The checkpoints' counters, timing and last commit.
pub(super) struct Checkpoints {
    requests: IntCounterVec,
    barriers: IntCounterVec,
    duration: HistogramVec,
    last_step: IntGauge,
    last_timestamp: Gauge,
    live: Arc<Live>,
}

impl Checkpoints {
    /// Defines the family, every trigger and outcome at 0.
    pub(super) fn register(defs: &mut Defs, live: Arc<Live>) -> Self {
        let checkpoints = Self {
            requests: defs.counter_vec(
                "muster_checkpoint_requests_total",
                "Checkpoint requests received, by trigger.",
                &["trigger"],
            ),
            barriers: defs.counter_vec(
                "muster_checkpoints_total",
                "Checkpoint barriers finished, by outcome.",
                &["outcome"],
            ),
            duration: defs.register(
                HistogramVec::new(
                    HistogramOpts::new(
                        "muster_checkpoint_duration_seconds",
                        "Time from a checkpoint request to the commit or abort, by outcome.",
                    )
                    .buckets(CHECKPOINT_BUCKETS_SECONDS.to_vec()),
                    &["outcome"],
                )
                .expect(STATIC_DEFINITION),
            ),
            last_step: defs.int_gauge(
                "muster_last_checkpoint_step",
                "Training step of the last committed checkpoint (0: none).",
            ),
            last_timestamp: defs.gauge(
                "muster_last_checkpoint_timestamp_seconds",
                "Unix time of the last committed checkpoint (0: none).",
            ),
            live,
        };
        for trigger in CheckpointTrigger::ALL {
            checkpoints.requests.with_label_values(&[trigger.as_str()]);
        }
        for outcome in CheckpointOutcome::ALL {
            checkpoints.barriers.with_label_values(&[outcome.as_str()]);
            checkpoints.duration.with_label_values(&[outcome.as_str()]);
        }
        checkpoints
    }

    /// Counts a checkpoint request (delivered over HTTP, a signal, a peer through the store).
    pub(super) fn checkpoint_requested(&self, trigger: CheckpointTrigger) {
        self.requests.with_label_values(&[trigger.as_str()]).inc();
    }

    /// The barrier moved to `phase`.
    pub(super) fn set_checkpoint_phase(&self, phase: CheckpointPhase) {
        self.live.set_checkpoint_phase(phase);
    }

    /// The barrier ended `elapsed` after its request; `step` is the committed step.
    pub(super) fn checkpoint_finished(
        &self,
        outcome: CheckpointOutcome,
        elapsed: Duration,
        step: Option<u64>,
    ) {
        self.barriers.with_label_values(&[outcome.as_str()]).inc();
        self.duration
            .with_label_values(&[outcome.as_str()])
            .observe(elapsed.as_secs_f64());
        if outcome == CheckpointOutcome::Committed {
            if let Some(step) = step {
                self.last_step.set(i64::try_from(step).unwrap_or(i64::MAX));
            }
            self.last_timestamp.set(unix_now());
        }
        self.live.set_checkpoint_phase(CheckpointPhase::Idle);
    }

    /// Counts the request of a signal configured with the checkpoint action; other events are
    /// not its.
    pub(super) fn observe(&self, event: &Event) {
        if let Event::SignalReceived {
            action: SignalAction::Checkpoint,
            ..
        } = event
        {
            self.checkpoint_requested(CheckpointTrigger::Signal);
        }
    }

    /// Records the barrier's events (started, ended); other events are not its.
    pub(super) fn observe_part(&self, event: &events::Event) {
        match event {
            events::Event::CheckpointStarted { from_peer } => {
                if *from_peer {
                    self.checkpoint_requested(CheckpointTrigger::Peer);
                }
                self.set_checkpoint_phase(CheckpointPhase::Agreeing);
            }
            events::Event::CheckpointEnded { result, elapsed } => match result {
                CheckpointResult::Committed { step } => {
                    self.checkpoint_finished(CheckpointOutcome::Committed, *elapsed, Some(*step));
                }
                CheckpointResult::Aborted => {
                    self.checkpoint_finished(CheckpointOutcome::Aborted, *elapsed, None);
                }
                // No barrier ran (the scripts lack the helper): not a checkpoint.
                CheckpointResult::Unsupported => {
                    self.set_checkpoint_phase(CheckpointPhase::Idle);
                }
            },
            _ => {}
        }
    }
}
