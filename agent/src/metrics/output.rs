//! What each rank wrote to its stdout and stderr, read at scrape time from the log pumps'
//! counters ([`crate::logs::OutputStats`]), so an operator can find the noisy rank.
//!
//! The `rank` label is the global rank; a node exports `2 × local ranks` series per family (more
//! only when an elastic re-form gives its workers new ranks).

use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{MetricFamily, MetricType};

use super::live::{counter, descs, family, help};
use crate::logs::OutputStats;

const BYTES: &str = "muster_worker_output_bytes_total";
const LINES: &str = "muster_worker_output_lines_total";
const PROGRESS: &str = "muster_worker_progress_updates_total";

pub(super) struct OutputCollector {
    source: Mutex<Option<Arc<OutputStats>>>,
    descs: Vec<Desc>,
}

impl OutputCollector {
    pub(super) fn new() -> Self {
        let labels: &[&str] = &["rank", "stream"];
        let defs = [
            (
                BYTES,
                "Bytes a worker wrote to its stdout or stderr, by global rank and stream.",
                labels,
            ),
            (
                LINES,
                "Lines a worker wrote (ended by a newline, or cut at 64 KiB), by global rank and stream.",
                labels,
            ),
            (
                PROGRESS,
                "Progress-bar updates (carriage-return segments) a worker wrote, before coalescing.",
                labels,
            ),
        ];
        Self {
            source: Mutex::new(None),
            descs: descs(&defs),
        }
    }

    pub(super) fn attach(&self, stats: Arc<OutputStats>) {
        *self.source.lock().unwrap_or_else(PoisonError::into_inner) = Some(stats);
    }
}

/// The registry owns a collector; the metrics handle keeps the same one to attach the source.
pub(super) struct SharedOutputCollector(pub(super) Arc<OutputCollector>);

impl Collector for SharedOutputCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.0.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(stats) = self
            .0
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        else {
            return Vec::new();
        };
        let snapshot = stats.snapshot();
        if snapshot.is_empty() {
            return Vec::new();
        }
        let series = |value: fn(&crate::logs::stats::StreamSnapshot) -> u64| {
            snapshot
                .iter()
                .map(|s| {
                    let rank = s.rank.to_string();
                    counter(&[("rank", &rank), ("stream", s.stream)], value(s) as f64)
                })
                .collect()
        };
        vec![
            family(
                BYTES,
                help(&self.0.descs, BYTES),
                MetricType::COUNTER,
                series(|s| s.bytes),
            ),
            family(
                LINES,
                help(&self.0.descs, LINES),
                MetricType::COUNTER,
                series(|s| s.lines),
            ),
            family(
                PROGRESS,
                help(&self.0.descs, PROGRESS),
                MetricType::COUNTER,
                series(|s| s.progress),
            ),
        ]
    }
}
