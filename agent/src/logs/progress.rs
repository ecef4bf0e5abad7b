//! Progress updates coalesced: a `\r`-terminated segment is a progress bar redrawing its line,
//! not a line of its own. Pure (time is passed in), so it is unit-tested directly.
//!
//! Per pipe only the latest update is kept, and it is emitted at most once per interval: the
//! first update at once, later ones when the interval since the last emitted one has passed (on
//! the next update, or by the pump's timer when the bar goes quiet). The update still pending is
//! always emitted before the next ordinary line and at end of file, so the final state of a bar
//! is never lost and nothing is reordered. A blank update (a bar erasing itself, as tqdm does
//! around `tqdm.write`) drops the pending one: the line it would have shown is gone.

use std::time::Duration;

use tokio::time::Instant;

use super::ansi;
use super::split::End;

/// What a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An ordinary line (ended by `\n`, cut at the length bound, or the last bytes of the pipe).
    Line,
    /// The state of a progress bar.
    Progress,
}

/// One record to write: cleaned text without its terminator (what tests collect).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub kind: Kind,
    pub text: Vec<u8>,
}

/// Where the coalescer's records go: the pump encodes them straight into its output buffers, so
/// an ordinary line costs no allocation of its own.
pub trait Emit {
    fn record(&mut self, kind: Kind, text: &[u8]);
}

impl Emit for Vec<Record> {
    fn record(&mut self, kind: Kind, text: &[u8]) {
        self.push(Record {
            kind,
            text: text.to_vec(),
        });
    }
}

/// How many segments of each kind went through, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub lines: u64,
    pub progress: u64,
}

/// The coalescing state of one pipe.
#[derive(Debug)]
pub struct Coalescer {
    interval: Duration,
    /// The update not written yet (valid while `pending`); the buffer is reused.
    latest: Vec<u8>,
    pending: bool,
    last_emitted: Option<Instant>,
    /// Reused for segments that carry escape sequences.
    scratch: Vec<u8>,
}

impl Coalescer {
    /// `interval` zero emits every update (the behaviour before coalescing).
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            latest: Vec::new(),
            pending: false,
            last_emitted: None,
            scratch: Vec::new(),
        }
    }

    /// Takes one segment from the splitter; hands what must be written now to `out`.
    pub fn segment(
        &mut self,
        raw: &[u8],
        end: End,
        now: Instant,
        out: &mut impl Emit,
        seen: &mut Seen,
    ) {
        if !ansi::has_escape(raw) {
            self.take(raw, end == End::Return, now, out, seen);
            return;
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let cursor_up = ansi::clean(raw, &mut scratch);
        self.take(&scratch, end == End::Return || cursor_up, now, out, seen);
        self.scratch = scratch;
    }

    fn take(
        &mut self,
        text: &[u8],
        progress: bool,
        now: Instant,
        out: &mut impl Emit,
        seen: &mut Seen,
    ) {
        if !progress {
            seen.lines += 1;
            self.emit(now, out);
            out.record(Kind::Line, text);
            return;
        }
        // Nothing between two carriage returns (tqdm starts every redraw with one) is not an
        // update.
        if text.is_empty() {
            return;
        }
        seen.progress += 1;
        if ansi::is_blank(text) {
            self.pending = false;
            return;
        }
        self.latest.clear();
        self.latest.extend_from_slice(text);
        self.pending = true;
        if self.is_due(now) {
            self.emit(now, out);
        }
    }

    /// When the pending update must be written if nothing else arrives; `None`: nothing pending.
    /// `held`: the splitter holds a segment that a `\r` ended (see
    /// [`super::split::Splitter::release_return`]), an update too.
    pub fn deadline(&self, now: Instant, held: bool) -> Option<Instant> {
        if !self.pending && !held {
            return None;
        }
        Some(self.last_emitted.map_or(now, |t| t + self.interval))
    }

    /// Writes the pending update if its interval has passed.
    pub fn tick(&mut self, now: Instant, out: &mut impl Emit) {
        if self.pending && self.is_due(now) {
            self.emit(now, out);
        }
    }

    /// Writes the pending update whatever the interval (end of file, the group stopping).
    pub fn flush(&mut self, now: Instant, out: &mut impl Emit) {
        self.emit(now, out);
    }

    fn is_due(&self, now: Instant) -> bool {
        self.last_emitted
            .is_none_or(|t| now.saturating_duration_since(t) >= self.interval)
    }

    fn emit(&mut self, now: Instant, out: &mut impl Emit) {
        if self.pending {
            out.record(Kind::Progress, &self.latest);
            self.pending = false;
            self.last_emitted = Some(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logs::split::Splitter;

    struct Pipe {
        split: Splitter,
        coalesce: Coalescer,
        seen: Seen,
    }

    impl Pipe {
        fn new(secs: u64) -> Self {
            Self {
                split: Splitter::default(),
                coalesce: Coalescer::new(Duration::from_secs(secs)),
                seen: Seen::default(),
            }
        }

        fn feed(&mut self, data: &[u8], now: Instant, eof: bool) -> Vec<(Kind, String)> {
            let mut out: Vec<Record> = Vec::new();
            let (c, seen) = (&mut self.coalesce, &mut self.seen);
            self.split.push(data, eof, |seg, end| {
                c.segment(seg, end, now, &mut out, seen);
            });
            if eof {
                self.coalesce.flush(now, &mut out);
            }
            out.into_iter()
                .map(|r| (r.kind, String::from_utf8(r.text).unwrap()))
                .collect()
        }

        /// What the pump does when the coalescer's deadline passes.
        fn tick(&mut self, now: Instant) -> Vec<(Kind, String)> {
            let mut out: Vec<Record> = Vec::new();
            let (c, seen) = (&mut self.coalesce, &mut self.seen);
            self.split.release_return(|seg, end| {
                c.segment(seg, end, now, &mut out, seen);
            });
            self.coalesce.tick(now, &mut out);
            out.into_iter()
                .map(|r| (r.kind, String::from_utf8(r.text).unwrap()))
                .collect()
        }
    }

    fn line(s: &str) -> (Kind, String) {
        (Kind::Line, s.into())
    }

    fn bar(s: &str) -> (Kind, String) {
        (Kind::Progress, s.into())
    }

    #[test]
    fn updates_are_coalesced_to_one_per_interval() {
        let t0 = Instant::now();
        let mut p = Pipe::new(10);
        assert_eq!(p.feed(b"1%\r2%\r3%\r", t0, false), [bar("1%")]);
        assert_eq!(
            p.coalesce.deadline(t0, false),
            Some(t0 + Duration::from_secs(10))
        );
        let mut out: Vec<Record> = Vec::new();
        p.coalesce.tick(t0 + Duration::from_secs(9), &mut out);
        assert!(out.is_empty());
        // The last update waited in the splitter (its `\r` might start a `\r\n`); the timer
        // releases it, so the bar's latest state shows.
        assert_eq!(p.tick(t0 + Duration::from_secs(10)), [bar("3%")]);
        assert_eq!(p.coalesce.deadline(t0, false), None);
        assert_eq!(
            p.coalesce.deadline(t0, true),
            Some(t0 + Duration::from_secs(20))
        );
        let t1 = t0 + Duration::from_secs(21);
        assert_eq!(p.feed(b"4%\r5%\r", t1, false), [bar("4%")]);
        assert_eq!(
            p.seen,
            Seen {
                lines: 0,
                progress: 4
            }
        );
    }

    #[test]
    fn the_pending_update_precedes_the_next_line_and_eof() {
        let t0 = Instant::now();
        let mut p = Pipe::new(10);
        assert_eq!(
            p.feed(b"a\n1%\r2%\r3%\rsaved\n4%\r", t0, false),
            [line("a"), bar("1%"), bar("3%"), line("saved")]
        );
        assert_eq!(p.feed(b"5%\r", t0, true), [bar("5%")]);
    }

    #[test]
    fn tqdm_style_leading_returns_end_in_a_line() {
        let t0 = Instant::now();
        let mut p = Pipe::new(10);
        assert_eq!(
            p.feed(
                b"\r  0%|  | 0/3\r 33%|# | 1/3\r 67%|##| 2/3\r100%|###| 3/3\n",
                t0,
                false
            ),
            [
                bar("  0%|  | 0/3"),
                bar(" 67%|##| 2/3"),
                line("100%|###| 3/3")
            ]
        );
    }

    #[test]
    fn blank_updates_erase_the_pending_one() {
        let t0 = Instant::now();
        let mut p = Pipe::new(10);
        // tqdm.write: the bar is cleared, the message printed, the bar redrawn.
        assert_eq!(
            p.feed(b"\r 1%\r 2%\r    \rmessage\n\r 3%", t0, false),
            [bar(" 1%"), line("message")]
        );
        assert_eq!(p.feed(b"", t0, true), [line(" 3%")]);
    }

    #[test]
    fn interval_zero_emits_every_update() {
        let t0 = Instant::now();
        let mut p = Pipe::new(0);
        assert_eq!(
            p.feed(b"1%\r2%\r3%\n", t0, false),
            [bar("1%"), bar("2%"), line("3%")]
        );
    }

    #[test]
    fn nested_tqdm_bars_redraw_with_cursor_up() {
        let t0 = Instant::now();
        let mut p = Pipe::new(10);
        // The outer bar, then `\n` down to the inner bar, drawn and moved back up: three times.
        let out = p.feed(
            b"\r  0%| | 0/3\n\r  0%| | 0/2\x1b[A\n\r 50%| | 1/2\x1b[A\n\r100%| | 2/2\x1b[A\n\r    \x1b[A\r 33%| | 1/3",
            t0,
            true,
        );
        assert_eq!(
            out,
            [line("  0%| | 0/3"), bar("  0%| | 0/2"), line(" 33%| | 1/3")]
        );
        assert_eq!(
            p.seen,
            Seen {
                lines: 2,
                progress: 4
            }
        );
    }
}
