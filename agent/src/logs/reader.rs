//! One task per worker pipe: read whatever arrives, cut it into segments ([`super::split`]),
//! coalesce progress updates ([`super::progress`]), and write the records to the console
//! (prefixed text or JSON) and to the rank's log file. Counts what the rank wrote.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::progress::{Coalescer, Emit, Kind, Seen};
use super::split::Splitter;
use super::stats::StreamCounters;
use super::LogFormat;
use super::{Console, LogSink};

/// How a pipe's lines reach the console.
#[derive(Debug, Clone)]
pub struct LineTarget {
    pub console: Console,
    pub format: LogFormat,
    /// Rendered `--log-line-prefix-template` (text format).
    pub prefix: String,
    pub host: String,
    pub rank: u32,
    pub local_rank: u32,
    /// `"stdout"` or `"stderr"` (JSON format).
    pub stream: &'static str,
}

/// Where one pipe's bytes go.
pub struct PumpConfig {
    /// `None` when the stream is redirected without tee, or filtered by `--local-ranks-filter`.
    pub console: Option<LineTarget>,
    pub file: Option<Arc<super::LogFile>>,
    /// `--progress-interval`: at most one progress update per interval (zero: every one).
    pub progress_interval: Duration,
    /// Where the bytes, lines and progress updates of this pipe are counted.
    pub counters: Arc<StreamCounters>,
    /// Follows the stream's Python tracebacks (stderr), for the failure summary.
    pub exception: Option<Arc<super::ExceptionLine>>,
}

impl LineTarget {
    /// Whole lines as this pipe's console shows them (the agent's own lines about a rank, such
    /// as its stack dump, in the rank's stream).
    pub fn encode_lines(&self, lines: &[String]) -> Vec<u8> {
        let ts = match self.format {
            LogFormat::Text => String::new(),
            LogFormat::Json => super::utc_timestamp(SystemTime::now()),
        };
        let mut out = Vec::new();
        for line in lines {
            self.encode(Kind::Line, line.as_bytes(), &ts, &mut out);
        }
        out
    }

    /// Appends one record as the console shows it; `ts` is the JSON timestamp.
    fn encode(&self, kind: Kind, text: &[u8], ts: &str, out: &mut Vec<u8>) {
        match self.format {
            LogFormat::Text => {
                out.extend_from_slice(self.prefix.as_bytes());
                out.extend_from_slice(text);
                out.push(b'\n');
            }
            LogFormat::Json => super::record::rank_line(
                ts,
                &self.host,
                self.rank,
                self.local_rank,
                self.stream,
                kind == Kind::Progress,
                text,
                out,
            ),
        }
    }
}

/// The records of one batch (one read, one timer tick), encoded straight into the buffers of
/// the console and the file.
struct Batch<'a> {
    console: Option<&'a LineTarget>,
    exception: Option<&'a super::ExceptionLine>,
    console_out: Vec<u8>,
    file_out: Option<Vec<u8>>,
    /// The JSON timestamp, taken once per batch: every line of one read arrived together.
    ts: Option<String>,
}

impl Emit for Batch<'_> {
    fn record(&mut self, kind: Kind, text: &[u8]) {
        if let (Some(exception), Kind::Line) = (self.exception, kind) {
            exception.observe(text);
        }
        if let Some(target) = self.console {
            let ts = match (&self.ts, target.format) {
                (Some(ts), _) => ts.as_str(),
                (None, LogFormat::Text) => "",
                (None, LogFormat::Json) => self
                    .ts
                    .insert(super::utc_timestamp(SystemTime::now()))
                    .as_str(),
            };
            target.encode(kind, text, ts, &mut self.console_out);
        }
        if let Some(file) = &mut self.file_out {
            file.extend_from_slice(text);
            file.push(b'\n');
        }
    }
}

/// Reads `pipe` until end of file (or until `closed` is cancelled: the workers are gone but
/// something still holds the pipe open), writing its records to the console and the file.
pub async fn pump(
    mut pipe: pipe::Receiver,
    config: PumpConfig,
    sink: LogSink,
    closed: CancellationToken,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut splitter = Splitter::default();
    let mut coalescer = Coalescer::new(config.progress_interval);
    loop {
        let now = Instant::now();
        // A day stands for "no deadline": the branch below is then never taken.
        let deadline = coalescer
            .deadline(now, splitter.holds_return())
            .unwrap_or(now + Duration::from_secs(86_400));
        let mut seen = Seen::default();
        let mut batch = Batch {
            console: config.console.as_ref(),
            exception: config.exception.as_deref(),
            console_out: Vec::new(),
            file_out: config.file.as_ref().map(|_| Vec::new()),
            ts: None,
        };
        let eof = tokio::select! {
            read = pipe.read(&mut buf) => {
                let n = read.unwrap_or(0);
                let now = Instant::now();
                config.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                splitter.push(&buf[..n], n == 0, |seg, end| {
                    coalescer.segment(seg, end, now, &mut batch, &mut seen);
                });
                n == 0
            }
            () = tokio::time::sleep_until(deadline) => {
                let now = Instant::now();
                splitter.release_return(|seg, end| {
                    coalescer.segment(seg, end, now, &mut batch, &mut seen);
                });
                coalescer.tick(now, &mut batch);
                false
            }
            () = closed.cancelled() => {
                splitter.push(&[], true, |seg, end| {
                    coalescer.segment(seg, end, now, &mut batch, &mut seen);
                });
                true
            }
        };
        if eof {
            coalescer.flush(Instant::now(), &mut batch);
        }
        config
            .counters
            .lines
            .fetch_add(seen.lines, Ordering::Relaxed);
        config
            .counters
            .progress
            .fetch_add(seen.progress, Ordering::Relaxed);
        if let (Some(target), false) = (&config.console, batch.console_out.is_empty()) {
            sink.write(target.console, batch.console_out).await;
        }
        if let (Some(file), Some(out)) = (&config.file, batch.file_out) {
            if !out.is_empty() {
                sink.write_file(file.clone(), out).await;
            }
        }
        if eof {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(format: LogFormat) -> LineTarget {
        LineTarget {
            console: Console::Stdout,
            format,
            prefix: "[h:1] ".into(),
            host: "h".into(),
            rank: 1,
            local_rank: 0,
            stream: "stdout",
        }
    }

    #[test]
    fn text_records_are_prefixed_whatever_their_kind() {
        let t = target(LogFormat::Text);
        let mut out = Vec::new();
        t.encode(Kind::Line, b"a", "", &mut out);
        t.encode(Kind::Progress, b" 50%", "", &mut out);
        assert_eq!(out, b"[h:1] a\n[h:1]  50%\n");
    }

    #[test]
    fn json_records_mark_progress() {
        let t = target(LogFormat::Json);
        let mut out = Vec::new();
        t.encode(
            Kind::Progress,
            b"caf\xc3\xa9 \"q\"",
            "2026-11-30T12:38:23.123Z",
            &mut out,
        );
        let v: serde_json::Value = serde_json::from_slice(&out[..out.len() - 1]).unwrap();
        assert_eq!(v["msg"], "café \"q\"");
        assert_eq!(v["rank"], 1);
        assert_eq!(v["stream"], "stdout");
        assert_eq!(v["progress"], true);
        assert_eq!(v["ts"], "2026-11-30T12:38:23.123Z");
    }
}
