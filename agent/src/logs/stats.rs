//! How much each rank wrote, counted by the pumps in plain atomics and read by the metrics at
//! scrape time (nothing here knows about Prometheus), so an operator can find the noisy rank.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The counters of one rank's stream.
#[derive(Debug, Default)]
pub struct StreamCounters {
    /// Bytes read from the pipe.
    pub bytes: AtomicU64,
    /// Ordinary lines (ended by `\n`, cut at the length bound, or the pipe's last bytes).
    pub lines: AtomicU64,
    /// Progress updates (`\r`-terminated segments), before coalescing.
    pub progress: AtomicU64,
    /// Whether the stream has had a log file (`--log-dir` with `--redirects`/`--tee`).
    pub has_file: AtomicBool,
    /// Lines the log file misses because writing it failed (see [`super::file`]).
    pub file_lines_dropped: AtomicU64,
    /// Times writing the log file began to fail.
    pub file_failures: AtomicU64,
}

/// One reading of a rank's stream counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamSnapshot {
    pub rank: u32,
    pub stream: &'static str,
    pub bytes: u64,
    pub lines: u64,
    pub progress: u64,
    /// `None` without a log file: (lines dropped, failures) of the file.
    pub file: Option<(u64, u64)>,
}

/// Every rank's counters since the agent started (a restarted rank keeps counting).
#[derive(Debug, Default)]
pub struct OutputStats {
    streams: Mutex<BTreeMap<(u32, &'static str), Arc<StreamCounters>>>,
}

impl OutputStats {
    /// The counters of global rank `rank`'s `stream` (`stdout` or `stderr`).
    pub fn stream(&self, rank: u32, stream: &'static str) -> Arc<StreamCounters> {
        let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(streams.entry((rank, stream)).or_default())
    }

    /// Every stream's counters, ordered by rank and stream.
    pub fn snapshot(&self) -> Vec<StreamSnapshot> {
        let streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        streams
            .iter()
            .map(|((rank, stream), c)| StreamSnapshot {
                rank: *rank,
                stream,
                bytes: c.bytes.load(Ordering::Relaxed),
                lines: c.lines.load(Ordering::Relaxed),
                progress: c.progress.load(Ordering::Relaxed),
                file: c.has_file.load(Ordering::Relaxed).then(|| {
                    (
                        c.file_lines_dropped.load(Ordering::Relaxed),
                        c.file_failures.load(Ordering::Relaxed),
                    )
                }),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_shared_per_rank_and_stream() {
        let stats = OutputStats::default();
        stats
            .stream(1, "stdout")
            .bytes
            .fetch_add(5, Ordering::Relaxed);
        stats
            .stream(1, "stdout")
            .lines
            .fetch_add(1, Ordering::Relaxed);
        stats
            .stream(0, "stderr")
            .progress
            .fetch_add(2, Ordering::Relaxed);
        assert_eq!(
            stats.snapshot(),
            [
                StreamSnapshot {
                    rank: 0,
                    stream: "stderr",
                    bytes: 0,
                    lines: 0,
                    progress: 2,
                    file: None,
                },
                StreamSnapshot {
                    rank: 1,
                    stream: "stdout",
                    bytes: 5,
                    lines: 1,
                    progress: 0,
                    file: None,
                },
            ]
        );
    }
}
