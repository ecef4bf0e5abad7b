//! Scrape-time metrics: values kept as raw atomics (or behind locks held for a few instructions)
//! by the agent, and turned into metric families only when `/metrics` is gathered.
//!
//! A state set such as `muster_agent_phase{phase}` written as six separate gauges could be seen
//! half-updated by a concurrent scrape (two phases at 1, or none); storing the phase as one atomic
//! and expanding it here makes every scrape consistent. Ages ("seconds since the last step") are
//! computed against the moment of the scrape, so they grow while a rank is silent.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};
use tokio::time::Instant;

use super::{CheckpointPhase, Phase, RoundOutcome, STATIC_DEFINITION};

/// Descriptors of a scrape-time collector's families: `(name, help, label names)` each.
pub(super) fn descs(defs: &[(&str, &str, &[&str])]) -> Vec<Desc> {
    defs.iter()
        .map(|(name, help, labels)| {
            Desc::new(
                (*name).to_owned(),
                (*help).to_owned(),
                labels.iter().map(|l| (*l).to_owned()).collect(),
                HashMap::new(),
            )
            .expect(STATIC_DEFINITION)
        })
        .collect()
}

/// The help text of the family `name` among `descs` (empty for an unknown name).
pub(super) fn help(descs: &[Desc], name: &str) -> String {
    descs
        .iter()
        .find(|d| d.fq_name == name)
        .map(|d| d.help.clone())
        .unwrap_or_default()
}

const PHASE: &str = "muster_agent_phase";
const HEARTBEAT_AGE: &str = "muster_agent_heartbeat_age_seconds";
const LAST_ROUND: &str = "muster_rendezvous_last_round";
const LAST_STEP: &str = "muster_worker_last_step";
const LAST_STEP_AGE: &str = "muster_worker_last_step_age_seconds";
const CHECKPOINT_PHASE: &str = "muster_checkpoint_phase";
const GRACE_REMAINING: &str = "muster_grace_remaining_seconds";

/// The agent-side state behind the scrape-time families.
pub(super) struct Live {
    /// Origin of the monotonic millisecond counters below.
    base: Instant,
    phase: AtomicU8,
    heartbeat_ms: AtomicU64,
    checkpoint_phase: AtomicU8,
    last_round: Mutex<Option<(RoundOutcome, &'static str)>>,
    /// Per local rank: last step and when it was reported.
    steps: Mutex<BTreeMap<u32, (u64, Instant)>>,
    grace: Mutex<Grace>,
}

#[derive(Default)]
struct Grace {
    budget: Duration,
    deadline: Option<Instant>,
}

impl Live {
    pub(super) fn new() -> Self {
        Self {
            base: Instant::now(),
            phase: AtomicU8::new(Phase::Resolving as u8),
            heartbeat_ms: AtomicU64::new(0),
            checkpoint_phase: AtomicU8::new(CheckpointPhase::Idle as u8),
            last_round: Mutex::new(None),
            steps: Mutex::new(BTreeMap::new()),
            grace: Mutex::new(Grace::default()),
        }
    }

    pub(super) fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
    }

    pub(super) fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Relaxed))
    }

    fn millis_since_base(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(super) fn heartbeat(&self) {
        self.heartbeat_ms
            .fetch_max(self.millis_since_base(), Ordering::Relaxed);
    }

    pub(super) fn heartbeat_age(&self) -> Duration {
        let last = self.heartbeat_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.millis_since_base().saturating_sub(last))
    }

    pub(super) fn set_checkpoint_phase(&self, phase: CheckpointPhase) {
        self.checkpoint_phase.store(phase as u8, Ordering::Relaxed);
    }

    pub(super) fn set_last_round(&self, outcome: RoundOutcome, reason: &'static str) {
        *lock(&self.last_round) = Some((outcome, reason));
    }

    pub(super) fn worker_step(&self, local_rank: u32, step: u64) {
        lock(&self.steps).insert(local_rank, (step, Instant::now()));
    }

    pub(super) fn clear_steps(&self) {
        lock(&self.steps).clear();
    }

    pub(super) fn set_grace_period(&self, budget: Duration) {
        lock(&self.grace).budget = budget;
    }

    pub(super) fn set_grace_deadline(&self, deadline: Option<Instant>) {
        lock(&self.grace).deadline = deadline;
    }

    fn grace_remaining(&self, now: Instant) -> Duration {
        let grace = lock(&self.grace);
        match grace.deadline {
            Some(deadline) => deadline.saturating_duration_since(now),
            None => grace.budget,
        }
    }
}

/// Locks held here protect a few plain values; a panic elsewhere cannot leave them inconsistent,
/// so a poisoned lock is simply taken over.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) struct LiveCollector {
    live: std::sync::Arc<Live>,
    descs: Vec<Desc>,
}

impl LiveCollector {
    pub(super) fn new(live: std::sync::Arc<Live>) -> Self {
        let defs: [(&str, &str, &[&str]); 7] = [
            (
                PHASE,
                "The agent's current phase (1) among all phases (0).",
                &["phase"],
            ),
            (
                HEARTBEAT_AGE,
                "Seconds since the agent loop last proved it is alive (/healthz fails when stale).",
                &[],
            ),
            (
                LAST_ROUND,
                "Outcome and reason of the last rendezvous round (1).",
                &["outcome", "reason"],
            ),
            (
                LAST_STEP,
                "Last training step each local rank reported.",
                &["local_rank"],
            ),
            (
                LAST_STEP_AGE,
                "Seconds since each local rank last reported a step (hang detection).",
                &["local_rank"],
            ),
            (
                CHECKPOINT_PHASE,
                "The checkpoint barrier's current phase (1) among all phases (0).",
                &["phase"],
            ),
            (
                GRACE_REMAINING,
                "Seconds left of the shutdown grace budget (the whole budget while not stopping).",
                &[],
            ),
        ];
        let descs = descs(&defs);
        Self { live, descs }
    }
}

impl Collector for LiveCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let live = &self.live;
        let now = Instant::now();
        let mut families = Vec::with_capacity(self.descs.len());

        let current = live.phase();
        families.push(family(
            PHASE,
            help(&self.descs, PHASE),
            MetricType::GAUGE,
            Phase::ALL
                .iter()
                .map(|p| gauge(&[("phase", p.as_str())], f64::from(u8::from(*p == current))))
                .collect(),
        ));
        families.push(family(
            HEARTBEAT_AGE,
            help(&self.descs, HEARTBEAT_AGE),
            MetricType::GAUGE,
            vec![gauge(&[], live.heartbeat_age().as_secs_f64())],
        ));
        if let Some((outcome, reason)) = *lock(&live.last_round) {
            families.push(family(
                LAST_ROUND,
                help(&self.descs, LAST_ROUND),
                MetricType::GAUGE,
                vec![gauge(
                    &[("outcome", outcome.as_str()), ("reason", reason)],
                    1.0,
                )],
            ));
        }
        {
            let steps = lock(&live.steps);
            let mut last = Vec::with_capacity(steps.len());
            let mut age = Vec::with_capacity(steps.len());
            for (rank, (step, at)) in steps.iter() {
                let rank = rank.to_string();
                last.push(gauge(&[("local_rank", &rank)], *step as f64));
                age.push(gauge(
                    &[("local_rank", &rank)],
                    now.saturating_duration_since(*at).as_secs_f64(),
                ));
            }
            families.push(family(
                LAST_STEP,
                help(&self.descs, LAST_STEP),
                MetricType::GAUGE,
                last,
            ));
            families.push(family(
                LAST_STEP_AGE,
                help(&self.descs, LAST_STEP_AGE),
                MetricType::GAUGE,
                age,
            ));
        }
        let checkpoint = CheckpointPhase::from_u8(live.checkpoint_phase.load(Ordering::Relaxed));
        families.push(family(
            CHECKPOINT_PHASE,
            help(&self.descs, CHECKPOINT_PHASE),
            MetricType::GAUGE,
            CheckpointPhase::ALL
                .iter()
                .map(|p| {
                    gauge(
                        &[("phase", p.as_str())],
                        f64::from(u8::from(*p == checkpoint)),
                    )
                })
                .collect(),
        ));
        families.push(family(
            GRACE_REMAINING,
            help(&self.descs, GRACE_REMAINING),
            MetricType::GAUGE,
            vec![gauge(&[], live.grace_remaining(now).as_secs_f64())],
        ));
        families
    }
}

/// A metric family built by hand (for values computed at scrape time).
pub(super) fn family(
    name: &str,
    help: String,
    kind: MetricType,
    metrics: Vec<Metric>,
) -> MetricFamily {
    let mut family = MetricFamily::default();
    family.set_name(name.to_owned());
    family.set_help(help);
    family.set_field_type(kind);
    family.set_metric(metrics);
    family
}

fn labels(pairs: &[(&str, &str)]) -> Vec<LabelPair> {
    pairs
        .iter()
        .map(|(name, value)| {
            let mut pair = LabelPair::default();
            pair.set_name((*name).to_owned());
            pair.set_value((*value).to_owned());
            pair
        })
        .collect()
}

pub(super) fn gauge(pairs: &[(&str, &str)], value: f64) -> Metric {
    let mut gauge = Gauge::default();
    gauge.set_value(value);
    let mut metric = Metric::from_label(labels(pairs));
    metric.set_gauge(gauge);
    metric
}

pub(super) fn counter(pairs: &[(&str, &str)], value: f64) -> Metric {
    let mut counter = Counter::default();
    counter.set_value(value);
    let mut metric = Metric::from_label(labels(pairs));
    metric.set_counter(counter);
    metric
}
