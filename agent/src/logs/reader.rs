//! One task per worker pipe: read whatever arrives, copy it raw to the rank's log file, and cut
//! it into lines for the console. A line is emitted when its newline arrives, when it reaches
//! [`super::MAX_LINE_BYTES`], or at end of file (a last line without a newline still shows).

use std::sync::Arc;
use std::time::SystemTime;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;

use super::{Console, LogSink, MAX_LINE_BYTES};
use crate::launch::config::LogFormat;

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
    pub file: Option<Arc<std::fs::File>>,
}

impl LineTarget {
    fn encode(&self, line: &[u8], out: &mut Vec<u8>) {
        match self.format {
            LogFormat::Text => {
                out.extend_from_slice(self.prefix.as_bytes());
                out.extend_from_slice(line);
                out.push(b'\n');
            }
            LogFormat::Json => {
                let obj = serde_json::json!({
                    "ts": super::utc_timestamp(SystemTime::now()),
                    "host": self.host,
                    "rank": self.rank,
                    "local_rank": self.local_rank,
                    "stream": self.stream,
                    "line": String::from_utf8_lossy(line),
                });
                out.extend_from_slice(obj.to_string().as_bytes());
                out.push(b'\n');
            }
        }
    }
}

/// Splits complete lines off the front of `pending` into `out` (encoded), keeping any partial
/// line; with `eof`, the partial line is emitted too. Pure, so it is unit-tested directly.
///
/// A line ends at `\n`, `\r\n`, or a lone `\r`: progress bars (tqdm) redraw with `\r` and
/// would otherwise show nothing until they finish; in a pod log each redraw becomes a line.
/// Empty segments between carriage returns are dropped.
pub fn take_lines(pending: &mut Vec<u8>, target: &LineTarget, eof: bool, out: &mut Vec<u8>) {
    let mut start = 0;
    loop {
        let rest = &pending[start..];
        let window = &rest[..rest.len().min(MAX_LINE_BYTES)];
        let Some(at) = window.iter().position(|&b| b == b'\n' || b == b'\r') else {
            if rest.len() >= MAX_LINE_BYTES || (eof && !rest.is_empty()) {
                target.encode(window, out);
                start += window.len();
                continue;
            }
            break;
        };
        let consumed = match (rest[at], rest.get(at + 1)) {
            (b'\n', _) => at + 1,
            (_, Some(b'\n')) => at + 2,
            // A `\r` at the very end: a `\n` may follow in the next read.
            (_, None) if !eof => break,
            _ => at + 1,
        };
        let lone_cr = rest[at] == b'\r' && rest.get(at + 1) != Some(&b'\n');
        if !(lone_cr && at == 0) {
            target.encode(&rest[..at], out);
        }
        start += consumed;
    }
    pending.drain(..start);
}

/// Reads `pipe` until end of file, sending lines to the console and raw bytes to the file.
pub async fn pump(mut pipe: pipe::Receiver, config: PumpConfig, sink: LogSink) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    loop {
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => 0,
            Ok(n) => n,
        };
        let eof = n == 0;
        if let Some(file) = &config.file {
            if !eof {
                sink.write_file(file.clone(), buf[..n].to_vec()).await;
            }
        }
        if let Some(target) = &config.console {
            pending.extend_from_slice(&buf[..n]);
            let mut out = Vec::new();
            take_lines(&mut pending, target, eof, &mut out);
            if !out.is_empty() {
                sink.write(target.console, out).await;
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
    fn whole_lines_only_until_eof() {
        let t = target(LogFormat::Text);
        let mut pending = b"a\nbc\r\nde".to_vec();
        let mut out = Vec::new();
        take_lines(&mut pending, &t, false, &mut out);
        assert_eq!(out, b"[h:1] a\n[h:1] bc\n");
        assert_eq!(pending, b"de");
        out.clear();
        take_lines(&mut pending, &t, true, &mut out);
        assert_eq!(out, b"[h:1] de\n");
        assert!(pending.is_empty());
    }

    #[test]
    fn carriage_returns_end_lines() {
        let t = target(LogFormat::Text);
        let mut pending = b"\r 10%\r 20%\r".to_vec();
        let mut out = Vec::new();
        take_lines(&mut pending, &t, false, &mut out);
        assert_eq!(out, b"[h:1]  10%\n");
        assert_eq!(pending, b" 20%\r", "a trailing CR waits for a possible LF");
        pending.extend_from_slice(b"\n100%\r\ndone\n\n");
        out.clear();
        take_lines(&mut pending, &t, false, &mut out);
        assert_eq!(out, b"[h:1]  20%\n[h:1] 100%\n[h:1] done\n[h:1] \n");
        assert!(pending.is_empty());
    }

    #[test]
    fn long_lines_are_cut_at_the_bound() {
        let t = target(LogFormat::Text);
        let mut pending = vec![b'x'; MAX_LINE_BYTES + 10];
        let mut out = Vec::new();
        take_lines(&mut pending, &t, false, &mut out);
        assert_eq!(out.len(), 6 + MAX_LINE_BYTES + 1);
        assert_eq!(pending.len(), 10);
        let mut pending = vec![b'y'; MAX_LINE_BYTES + 3];
        pending.push(b'\n');
        out.clear();
        take_lines(&mut pending, &t, false, &mut out);
        assert_eq!(String::from_utf8_lossy(&out).lines().count(), 2);
        assert!(pending.is_empty());
    }

    #[test]
    fn json_lines() {
        let t = target(LogFormat::Json);
        let mut pending = b"caf\xc3\xa9 \"q\"\n".to_vec();
        let mut out = Vec::new();
        take_lines(&mut pending, &t, false, &mut out);
        let v: serde_json::Value = serde_json::from_slice(&out[..out.len() - 1]).unwrap();
        assert_eq!(v["line"], "café \"q\"");
        assert_eq!(v["rank"], 1);
        assert_eq!(v["stream"], "stdout");
        assert!(v["ts"].as_str().unwrap().ends_with('Z'));
    }
}
