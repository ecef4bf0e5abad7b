//! What each rank wrote to its stdout and stderr, read at scrape time from the log pumps'
//! counters ([`crate::logs::OutputStats`]), so an operator can find the noisy rank.
//!
//! The `rank` label is the global rank; a node exports `2 × local ranks` series per family (more
//! only when an elastic re-form gives its workers new ranks).

use std::sync::Arc;

use prometheus::core::Desc;
use prometheus::proto::{MetricFamily, MetricType};

use super::attached::Attached;
use super::live::{counter, family, help};
use crate::logs::OutputStats;

const BYTES: &str = "muster_worker_output_bytes_total";
const LINES: &str = "muster_worker_output_lines_total";
const PROGRESS: &str = "muster_worker_progress_updates_total";

/// The collector, empty until the log pumps' counters are attached.
pub(super) fn collector() -> Attached<Arc<OutputStats>> {
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
    Attached::new(&defs, families)
}

fn families(stats: &Arc<OutputStats>, descs: &[Desc]) -> Vec<MetricFamily> {
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
            help(descs, BYTES),
            MetricType::COUNTER,
            series(|s| s.bytes),
        ),
        family(
            LINES,
            help(descs, LINES),
            MetricType::COUNTER,
            series(|s| s.lines),
        ),
        family(
            PROGRESS,
            help(descs, PROGRESS),
            MetricType::COUNTER,
            series(|s| s.progress),
        ),
    ]
}
