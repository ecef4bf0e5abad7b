//! In-memory snapshots (`--snapshot-every`, [`crate::snapshot`]): the step the gang can restart
//! from, what the node holds for it, and what a snapshot costs the rank that takes it.

use prometheus::{Gauge, Histogram, IntCounterVec, IntGauge, IntGaugeVec};

use super::Defs;
use crate::snapshot::Meter;

/// A snapshot blocks its rank for a copy of its state into memory: from a millisecond (a small
/// model) to seconds (tens of GB per rank).
const BLOCKING_BUCKETS_SECONDS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Why a rank's part was not held (the `why` label).
pub const REFUSALS: [&str; 3] = ["busy", "over_cap", "invalid"];

/// The snapshot family's handles; the snapshot service keeps a clone and updates it.
#[derive(Clone)]
pub struct SnapshotMeter {
    committed_step: IntGauge,
    restored_step: IntGauge,
    held_bytes: IntGauge,
    part_bytes: IntGaugeVec,
    blocking_seconds: Histogram,
    refused: IntCounterVec,
    replicated_step: IntGauge,
    replication_seconds: Gauge,
    persisted_step: IntGauge,
    persist_seconds: Gauge,
}

impl SnapshotMeter {
    pub(super) fn register(defs: &mut Defs) -> Self {
        let meter = Self {
            committed_step: defs.int_gauge(
                "muster_snapshot_committed_step",
                "The newest step every rank of the gang handed over and the gang committed (--snapshot-every): where a restart within the job resumes; 0 before the first commit.",
            ),
            restored_step: defs.int_gauge(
                "muster_snapshot_restored_step",
                "The step the current attempt's ranks restored from the agents' snapshots; 0 when they started from their own checkpoint.",
            ),
            held_bytes: defs.int_gauge(
                "muster_snapshot_held_bytes",
                "The bytes of snapshot parts this node's agent holds (at most two generations: the committed step and one newer), counted against the pod's memory limit.",
            ),
            part_bytes: defs.int_gauge_vec(
                "muster_snapshot_part_bytes",
                "The size of each local rank's newest snapshot part, by global rank.",
                &["rank"],
            ),
            blocking_seconds: defs.histogram(
                "muster_snapshot_blocking_seconds",
                "How long each snapshot blocked the rank that took it: building and copying its state into memory, and handing it to the agent.",
                &BLOCKING_BUCKETS_SECONDS,
            ),
            refused: defs.counter_vec(
                "muster_snapshot_refused_total",
                "Snapshot parts this agent did not hold, by why: busy (the previous step is not committed yet; the rank skips one), over_cap (--snapshot-memory; snapshots are off for the job), invalid (not a sealable memory file of its size).",
                &["why"],
            ),
            replicated_step: defs.int_gauge(
                "muster_snapshot_replicated_step",
                "The newest step of this node's snapshot parts that its buddy node holds (the next node rank, modulo the node count): what a replacement of this pod restores; 0 before the first copy or with one node.",
            ),
            replication_seconds: defs.gauge(
                "muster_snapshot_replication_seconds",
                "How long the last copy of this node's parts to its buddy took, from the commit to the buddy's answer: the replication lag, during which a lost pod would restore the step before.",
            ),
            persisted_step: defs.int_gauge(
                "muster_snapshot_persisted_step",
                "The newest committed step of this node's snapshot parts that is whole on the disk (--snapshot-persist): where a job started again after losing every pod resumes; 0 before the first write or without --snapshot-persist.",
            ),
            persist_seconds: defs.gauge(
                "muster_snapshot_persist_seconds",
                "How long the last write of this node's parts to the disk took (--snapshot-persist), from the commit: during it a job-level loss would resume from the step before.",
            ),
        };
        for why in REFUSALS {
            meter.refused.with_label_values(&[why]);
        }
        meter
    }

    /// `/gangz`'s line; `None` before the first commit.
    pub(super) fn line(&self) -> Option<String> {
        let step = self.committed_step.get();
        (step > 0).then(|| {
            format!(
                "snapshots: step {step} committed on every node, {} MiB held on this node",
                self.held_bytes.get() >> 20
            )
        })
    }
}

impl Meter for SnapshotMeter {
    fn held(&self, rank: u32, bytes: u64, blocked_seconds: f64, node_holds: u64) {
        self.part_bytes
            .with_label_values(&[&rank.to_string()])
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.blocking_seconds.observe(blocked_seconds);
        self.held_bytes
            .set(i64::try_from(node_holds).unwrap_or(i64::MAX));
    }

    fn refused(&self, why: &'static str) {
        self.refused.with_label_values(&[why]).inc();
    }

    fn committed(&self, step: u64, node_holds: u64) {
        self.committed_step
            .set(i64::try_from(step).unwrap_or(i64::MAX));
        self.held_bytes
            .set(i64::try_from(node_holds).unwrap_or(i64::MAX));
    }

    fn replicated(&self, step: u64, seconds: f64) {
        self.replicated_step
            .set(i64::try_from(step).unwrap_or(i64::MAX));
        self.replication_seconds.set(seconds);
    }

    fn persisted(&self, step: u64, seconds: f64) {
        self.persisted_step
            .set(i64::try_from(step).unwrap_or(i64::MAX));
        self.persist_seconds.set(seconds);
    }

    fn settled(&self, restored: Option<u64>, node_holds: u64) {
        self.restored_step
            .set(restored.map_or(0, |s| i64::try_from(s).unwrap_or(i64::MAX)));
        if let Some(step) = restored {
            // A step every node held is committed, even where the commit was cut short.
            if i64::try_from(step).unwrap_or(i64::MAX) > self.committed_step.get() {
                self.committed(step, node_holds);
            }
        }
        self.held_bytes
            .set(i64::try_from(node_holds).unwrap_or(i64::MAX));
    }
}
