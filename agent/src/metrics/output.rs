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
const FILE_DROPPED: &str = "muster_worker_log_file_lines_dropped_total";
const FILE_FAILURES: &str = "muster_worker_log_file_write_failures_total";

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
        (
            FILE_DROPPED,
            "Lines a rank's --log-dir file misses because writing it failed (no space, quota, I/O \
             error), by global rank and stream; only streams with a log file.",
            labels,
        ),
        (
            FILE_FAILURES,
            "Times writing a rank's --log-dir file began to fail, by global rank and stream; only \
             streams with a log file.",
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
    let file_series = |value: fn((u64, u64)) -> u64| {
        snapshot
            .iter()
            .filter_map(|s| {
                let rank = s.rank.to_string();
                let file = s.file?;
                Some(counter(
                    &[("rank", &rank), ("stream", s.stream)],
                    value(file) as f64,
                ))
            })
            .collect::<Vec<_>>()
    };
    let mut families = vec![
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
    ];
    // Without --log-dir files the two families are left out rather than empty.
    let dropped = file_series(|(dropped, _)| dropped);
    if !dropped.is_empty() {
        families.push(family(
            FILE_DROPPED,
            help(descs, FILE_DROPPED),
            MetricType::COUNTER,
            dropped,
        ));
        families.push(family(
            FILE_FAILURES,
            help(descs, FILE_FAILURES),
            MetricType::COUNTER,
            file_series(|(_, failures)| failures),
        ));
    }
    families
}
