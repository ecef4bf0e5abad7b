//! A rank's log file (`--log-dir` with `--redirects`/`--tee`), written by the console writer
//! thread, and what happens when it cannot be written.
//!
//! A full volume (ENOSPC), a quota (EDQUOT) or an I/O error must neither stop the job nor go
//! unnoticed: the first failed write logs one warning naming the file and the error (and whether
//! the console still has the lines), the lines the file misses are counted for the metrics
//! ([`StreamCounters::file_lines_dropped`]), and the job goes on. Writing is tried again at most
//! once per [`RETRY_INTERVAL`] (a dead disk may block each write; a full one fails at once), and
//! when a write succeeds again the file gets one marker line saying how many lines are missing
//! there, the console one line saying that writing resumed. A file that flaps between full and
//! not is warned about at most [`MAX_WARNINGS`] times; the metrics keep counting after that.
//!
//! [`Health`] is the pure core (what to do with a batch, given the time and what happened before);
//! [`LogFile`] is the thin shell that does the write and the logging.

use std::fs::File;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::stats::StreamCounters;

/// While a file fails, how often a write is tried again; the batches between are dropped unseen.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(1);
/// Warnings per file: a volume that keeps filling and emptying must not flood the console.
pub const MAX_WARNINGS: u32 = 3;

/// A rank's log file and the state of its writes.
pub struct LogFile {
    path: PathBuf,
    file: File,
    /// Whether the console shows this stream too (`--tee`, and not left out by
    /// `--local-ranks-filter`): then it keeps what the file misses.
    on_console: bool,
    counters: Arc<StreamCounters>,
    health: Mutex<Health>,
}

impl LogFile {
    /// Creates (truncates) the file at `path`. `on_console`: the stream is teed, not only
    /// redirected. `counters`: the stream's, which count the lines the file misses.
    pub fn create(
        path: PathBuf,
        on_console: bool,
        counters: Arc<StreamCounters>,
    ) -> std::io::Result<Self> {
        let file = File::create(&path)?;
        counters.has_file.store(true, Ordering::Relaxed);
        Ok(Self {
            path,
            file,
            on_console,
            counters,
            health: Mutex::default(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `bytes` (whole lines), or counts them as missing; never fails.
    pub fn write(&self, bytes: &[u8]) {
        let mut health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        let before = (health.dropped_total, health.failures);
        let notice = health.write(Instant::now(), bytes, &mut &self.file);
        // The counters are the rank's over all attempts (each attempt has a file of its own).
        self.counters
            .file_lines_dropped
            .fetch_add(health.dropped_total - before.0, Ordering::Relaxed);
        self.counters
            .file_failures
            .fetch_add(u64::from(health.failures - before.1), Ordering::Relaxed);
        drop(health);
        if let Some(notice) = notice {
            self.log(&notice);
        }
    }

    fn log(&self, notice: &Notice) {
        let path = self.path.display();
        match notice {
            Notice::Failed { error, last } => {
                let consequence = if self.on_console {
                    "the console keeps every line, this file misses lines from here on"
                } else {
                    "this stream is not on the console (redirected without --tee, or left out \
                     by --local-ranks-filter), so its lines are lost from here on"
                };
                let tail = if *last {
                    "; further failures of this file are only counted \
                     (muster_worker_log_file_lines_dropped_total)"
                } else {
                    ""
                };
                tracing::warn!("cannot write worker log {path}: {error}; {consequence}{tail}");
            }
            Notice::Resumed { missing, error } => tracing::info!(
                "worker log {path} is written again; {missing} line(s) are missing from it ({error})"
            ),
        }
    }
}

impl Drop for LogFile {
    fn drop(&mut self) {
        let health = self
            .health
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(failing) = &health.failing {
            tracing::info!(
                "worker log {} ends {} line(s) short ({})",
                self.path.display(),
                failing.missing,
                failing.error
            );
        }
    }
}

/// What the shell logs after a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The file stopped taking writes. `last`: no more warnings for this file.
    Failed { error: String, last: bool },
    /// A write succeeded after `missing` lines were dropped; `error` is what had failed.
    Resumed { missing: u64, error: String },
}

/// The write state of one file: the pure core of [`LogFile`].
#[derive(Debug, Default)]
pub struct Health {
    failing: Option<Failing>,
    /// Warnings logged so far.
    warnings: u32,
    /// Times the file went from taking writes to failing.
    failures: u32,
    /// Lines dropped over the file's life, for the metrics.
    dropped_total: u64,
}

#[derive(Debug)]
struct Failing {
    error: String,
    /// Lines missing since the failure (a line cut half-way counts as missing).
    missing: u64,
    /// The last bytes written end inside a line, so the marker must start on a fresh one.
    cut_line: bool,
    last_try: Instant,
}

impl Health {
    /// Writes `bytes` (whole lines) to `out`, or drops them, as the state says; returns what to
    /// log.
    pub fn write(&mut self, now: Instant, bytes: &[u8], out: &mut impl Write) -> Option<Notice> {
        if let Some(failing) = &mut self.failing {
            if now.saturating_duration_since(failing.last_try) < RETRY_INTERVAL {
                let lines = count_lines(bytes);
                failing.missing += lines;
                self.dropped_total += lines;
                return None;
            }
            failing.last_try = now;
            // The marker and the batch in one write: a file that takes the marker but not the
            // batch would claim a count that is already wrong.
            let mut resumed = Vec::with_capacity(bytes.len() + 96);
            if failing.cut_line {
                resumed.push(b'\n');
            }
            resumed.extend_from_slice(
                format!(
                    "[muster] {} line(s) missing here: {}\n",
                    failing.missing, failing.error
                )
                .as_bytes(),
            );
            let marker_len = resumed.len();
            resumed.extend_from_slice(bytes);
            return match write_counted(out, &resumed) {
                Ok(()) => {
                    let failing = self.failing.take()?;
                    Some(Notice::Resumed {
                        missing: failing.missing,
                        error: failing.error,
                    })
                }
                Err((written, _)) => {
                    // Still failing: what reached the file is a fragment of the marker or of the
                    // batch; the lines not written in full are missing.
                    let lines = count_lines(&resumed[written.max(marker_len)..]);
                    failing.missing += lines;
                    self.dropped_total += lines;
                    if written > 0 {
                        failing.cut_line = resumed[written - 1] != b'\n';
                    }
                    None
                }
            };
        }
        match write_counted(out, bytes) {
            Ok(()) => None,
            Err((written, err)) => {
                let missing = count_lines(&bytes[written..]);
                self.dropped_total += missing;
                self.failures += 1;
                self.failing = Some(Failing {
                    error: err.to_string(),
                    missing,
                    cut_line: written > 0 && bytes[written - 1] != b'\n',
                    last_try: now,
                });
                (self.warnings < MAX_WARNINGS).then(|| {
                    self.warnings += 1;
                    Notice::Failed {
                        error: err.to_string(),
                        last: self.warnings == MAX_WARNINGS,
                    }
                })
            }
        }
    }
}

/// `write_all` that says how many bytes made it when it fails.
fn write_counted(out: &mut impl Write, bytes: &[u8]) -> Result<(), (usize, std::io::Error)> {
    let mut written = 0;
    while written < bytes.len() {
        match out.write(&bytes[written..]) {
            Ok(0) => return Err((written, ErrorKind::WriteZero.into())),
            Ok(n) => written += n,
            Err(err) if err.kind() == ErrorKind::Interrupted => {}
            Err(err) => return Err((written, err)),
        }
    }
    Ok(())
}

/// Lines in a batch: every record the pump writes to a file ends with `\n`.
// Only batches that could not be written are counted, so no crate is pulled in for speed.
#[allow(clippy::naive_bytecount)]
fn count_lines(bytes: &[u8]) -> u64 {
    bytes.iter().filter(|&&b| b == b'\n').count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A volume with `room` bytes left; `room` can be raised to free space.
    struct Volume {
        data: Vec<u8>,
        room: usize,
    }

    impl Write for Volume {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                // ENOSPC, as the kernel reports it.
                return Err(std::io::Error::from_raw_os_error(28));
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            self.data.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_full_volume_warns_once_counts_the_lines_and_resumes_with_a_marker() {
        let t0 = Instant::now();
        let mut vol = Volume {
            data: Vec::new(),
            room: 10,
        };
        let mut h = Health::default();
        assert_eq!(h.write(t0, b"line-1\n", &mut vol), None);
        // 3 bytes fit: "lin" of line-2, cut half-way, and line-3 is not written at all.
        let Some(Notice::Failed { error, last }) = h.write(t0, b"line-2\nline-3\n", &mut vol)
        else {
            panic!("a failed write must warn")
        };
        assert!(error.contains("No space left on device"), "{error}");
        assert!(!last);
        assert_eq!(h.dropped_total, 2);
        // Within the retry interval: dropped without a try, no second warning.
        assert_eq!(h.write(t0, b"line-4\n", &mut vol), None);
        // Tried again, still full: still no warning.
        assert_eq!(h.write(t0 + RETRY_INTERVAL, b"line-5\n", &mut vol), None);
        assert_eq!(h.dropped_total, 4);
        assert_eq!(vol.data, b"line-1\nlin");
        // Space returns: the marker starts on a fresh line, then the batch.
        vol.room = 1000;
        assert_eq!(
            h.write(t0 + 2 * RETRY_INTERVAL, b"line-6\n", &mut vol),
            Some(Notice::Resumed {
                missing: 4,
                error: error.clone()
            })
        );
        let text = String::from_utf8(vol.data.clone()).unwrap();
        assert_eq!(
            text,
            format!("line-1\nlin\n[muster] 4 line(s) missing here: {error}\nline-6\n")
        );
        assert_eq!(
            h.write(t0 + 2 * RETRY_INTERVAL, b"line-7\n", &mut vol),
            None
        );
        assert!(vol.data.ends_with(b"line-6\nline-7\n"));
        assert_eq!((h.failures, h.dropped_total), (1, 4));
    }

    #[test]
    fn a_flapping_volume_is_warned_about_at_most_max_warnings_times() {
        let mut t = Instant::now();
        let mut vol = Volume {
            data: Vec::new(),
            room: 0,
        };
        let mut h = Health::default();
        let mut warnings = Vec::new();
        for _ in 0..MAX_WARNINGS + 2 {
            vol.room = 0;
            if let Some(Notice::Failed { last, .. }) = h.write(t, b"x\n", &mut vol) {
                warnings.push(last);
            }
            t += RETRY_INTERVAL;
            vol.room = 1000;
            assert!(matches!(
                h.write(t, b"y\n", &mut vol),
                Some(Notice::Resumed { missing: 1, .. })
            ));
        }
        assert_eq!(warnings.len(), MAX_WARNINGS as usize);
        assert_eq!(warnings.last(), Some(&true));
        assert_eq!(h.failures, MAX_WARNINGS + 2);
        assert_eq!(h.dropped_total, u64::from(MAX_WARNINGS + 2));
    }
}
