//! Rendezvous rounds and the rank assignment they give: `muster_rendezvous_*`, `muster_node_rank`
//! and the world sizes. The last round's outcome and reason are a state set built at scrape time
//! ([`super::live`]).

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Gauge, Histogram, IntCounterVec, IntGauge};

use super::live::Live;
use super::{unix_now, Defs, WAIT_BUCKETS_SECONDS};

/// How a rendezvous round ended (`outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundOutcome {
    /// The gang formed.
    Completed,
    /// The join deadline passed with nodes missing.
    Timeout,
    /// The round failed for another reason (store lost, unhealthy peer, protocol error).
    Failed,
    /// The agent was asked to stop while waiting.
    Cancelled,
}

impl RoundOutcome {
    pub(super) const ALL: [RoundOutcome; 4] = [
        RoundOutcome::Completed,
        RoundOutcome::Timeout,
        RoundOutcome::Failed,
        RoundOutcome::Cancelled,
    ];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            RoundOutcome::Completed => "completed",
            RoundOutcome::Timeout => "timeout",
            RoundOutcome::Failed => "failed",
            RoundOutcome::Cancelled => "cancelled",
        }
    }
}

/// The rounds' counts and timing, their progress and the assignment of the current attempt.
pub(super) struct Rdzv {
    rounds: IntCounterVec,
    duration: Histogram,
    last_timestamp: Gauge,
    nodes_expected: IntGauge,
    nodes_joined: IntGauge,
    nodes_waiting: IntGauge,
    node_rank: IntGauge,
    group_world_size: IntGauge,
    world_size: IntGauge,
    local_world_size: IntGauge,
    live: Arc<Live>,
}

impl Rdzv {
    /// Defines the family, every outcome at 0.
    pub(super) fn register(defs: &mut Defs, live: Arc<Live>) -> Self {
        let rdzv = Self {
            rounds: defs.counter_vec(
                "muster_rendezvous_rounds_total",
                "Rendezvous rounds this agent took part in, by outcome.",
                &["outcome"],
            ),
            duration: defs.histogram(
                "muster_rendezvous_duration_seconds",
                "Time from joining a rendezvous round until it ended.",
                &WAIT_BUCKETS_SECONDS,
            ),
            last_timestamp: defs.gauge(
                "muster_rendezvous_last_round_timestamp_seconds",
                "Unix time the last rendezvous round ended (0: none yet).",
            ),
            nodes_expected: defs.int_gauge(
                "muster_rendezvous_nodes_expected",
                "Nodes the current rendezvous waits for (the maximum of --nnodes).",
            ),
            nodes_joined: defs.int_gauge(
                "muster_rendezvous_nodes_joined",
                "Nodes that joined the current rendezvous round.",
            ),
            nodes_waiting: defs.int_gauge(
                "muster_rendezvous_nodes_waiting",
                "Nodes still missing from the current rendezvous round.",
            ),
            node_rank: defs.int_gauge("muster_node_rank", "This node's rank in the gang."),
            group_world_size: defs
                .int_gauge("muster_group_world_size", "Nodes in the current gang."),
            world_size: defs.int_gauge(
                "muster_world_size",
                "Worker processes (ranks) in the current gang, on all nodes.",
            ),
            local_world_size: defs.int_gauge(
                "muster_local_world_size",
                "Worker processes this node starts per attempt.",
            ),
            live,
        };
        for outcome in RoundOutcome::ALL {
            rdzv.rounds.with_label_values(&[outcome.as_str()]);
        }
        rdzv
    }

    /// Progress of the current round: nodes expected, joined so far, still missing.
    pub(super) fn rendezvous_nodes(&self, expected: u32, joined: u32) {
        self.nodes_expected.set(i64::from(expected));
        self.nodes_joined.set(i64::from(joined));
        self.nodes_waiting
            .set(i64::from(expected.saturating_sub(joined)));
    }

    /// Nodes that joined the current (or last) round.
    pub(super) fn nodes_joined(&self) -> u32 {
        u32::try_from(self.nodes_joined.get()).unwrap_or(0)
    }

    /// A rendezvous round ended. `reason` is a short fixed phrase from the deciding code
    /// (`all_joined`, `min_nodes_after_last_call`, `join_timeout`, ...); being `'static` keeps the
    /// label set bounded.
    pub(super) fn rendezvous_round_finished(
        &self,
        outcome: RoundOutcome,
        reason: &'static str,
        elapsed: Duration,
    ) {
        self.rounds.with_label_values(&[outcome.as_str()]).inc();
        self.duration.observe(elapsed.as_secs_f64());
        self.last_timestamp.set(unix_now());
        self.live.set_last_round(outcome, reason);
    }

    /// The rank assignment of the current attempt.
    pub(super) fn set_assignment(
        &self,
        node_rank: u32,
        group_world_size: u32,
        world_size: u32,
        local_world_size: u32,
    ) {
        self.node_rank.set(i64::from(node_rank));
        self.group_world_size.set(i64::from(group_world_size));
        self.world_size.set(i64::from(world_size));
        self.local_world_size.set(i64::from(local_world_size));
    }
}
