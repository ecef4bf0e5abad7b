//! Cutting a pipe's bytes into segments, each with what ended it. Pure, so it is unit-tested
//! directly.
//!
//! A segment ends at `\n`, `\r\n` (both [`End::Newline`]), a lone `\r` ([`End::Return`]: a
//! progress bar redrawing its line), when it reaches [`super::MAX_LINE_BYTES`] ([`End::Cut`]), or
//! at end of file ([`End::Eof`], so a last line without a newline still shows).

use super::MAX_LINE_BYTES;

/// What ended a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// `\n` or `\r\n`.
    Newline,
    /// A lone `\r`: the writer will draw over this segment.
    Return,
    /// The segment reached the length bound; the rest follows as another segment.
    Cut,
    /// The pipe closed after it.
    Eof,
}

/// The bytes of a pipe that do not form a whole segment yet.
#[derive(Debug, Default)]
pub struct Splitter {
    pending: Vec<u8>,
    /// A `\r` that ended the pending bytes was released as [`End::Return`]; a `\n` right after
    /// it completes that `\r\n` and is not a new, empty line.
    released_return: bool,
}

impl Splitter {
    /// Appends `data` and hands every complete segment to `each`, oldest first; with `eof`, what
    /// is left is a segment too. A `\r` that ends `data` waits for the next read: it may be the
    /// first half of `\r\n`.
    pub fn push(&mut self, data: &[u8], eof: bool, mut each: impl FnMut(&[u8], End)) {
        let data = match data.split_first() {
            Some((b'\n', rest)) if self.released_return => rest,
            _ => data,
        };
        self.released_return = false;
        let owned;
        // Skip the copy when nothing is pending (the common case: a read of whole lines).
        let buf: &[u8] = if self.pending.is_empty() {
            data
        } else {
            self.pending.extend_from_slice(data);
            owned = std::mem::take(&mut self.pending);
            &owned
        };
        let mut start = 0;
        loop {
            let rest = &buf[start..];
            let window = &rest[..rest.len().min(MAX_LINE_BYTES)];
            let Some(at) = window.iter().position(|&b| b == b'\n' || b == b'\r') else {
                if rest.len() >= MAX_LINE_BYTES {
                    each(window, End::Cut);
                    start += window.len();
                    continue;
                }
                if eof && !rest.is_empty() {
                    each(rest, End::Eof);
                    start = buf.len();
                }
                break;
            };
            let (end, consumed) = match (rest[at], rest.get(at + 1)) {
                (b'\n', _) => (End::Newline, at + 1),
                (_, Some(b'\n')) => (End::Newline, at + 2),
                (_, None) if !eof => break,
                _ => (End::Return, at + 1),
            };
            each(&rest[..at], end);
            start += consumed;
        }
        self.pending.clear();
        self.pending.extend_from_slice(&buf[start..]);
    }

    /// Hands over a segment held back only because the `\r` that ends it ended the data so far,
    /// as [`End::Return`]: the pump's timer calls this so that a bar that went quiet still shows
    /// its latest state. Nothing happens when the pending bytes do not end that way.
    pub fn release_return(&mut self, mut each: impl FnMut(&[u8], End)) {
        if self.pending.last() == Some(&b'\r') {
            let len = self.pending.len() - 1;
            each(&self.pending[..len], End::Return);
            self.pending.clear();
            self.released_return = true;
        }
    }

    /// Whether the pending bytes are a segment waiting only to see if its `\r` starts a `\r\n`.
    pub fn holds_return(&self) -> bool {
        self.pending.last() == Some(&b'\r')
    }

    /// Bytes held back, waiting for the rest of their segment.
    #[cfg(test)]
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &mut Splitter, data: &[u8], eof: bool) -> Vec<(String, End)> {
        let mut out = Vec::new();
        s.push(data, eof, |seg, end| {
            out.push((String::from_utf8_lossy(seg).into_owned(), end));
        });
        out
    }

    #[test]
    fn whole_segments_only_until_eof() {
        let mut s = Splitter::default();
        assert_eq!(
            split(&mut s, b"a\nbc\r\nde", false),
            [("a".into(), End::Newline), ("bc".into(), End::Newline)]
        );
        assert_eq!(s.pending_len(), 2);
        assert_eq!(split(&mut s, b"", true), [("de".into(), End::Eof)]);
        assert_eq!(s.pending_len(), 0);
    }

    #[test]
    fn carriage_returns() {
        let mut s = Splitter::default();
        assert_eq!(
            split(&mut s, b"\r 10%\r 20%\r", false),
            [(String::new(), End::Return), (" 10%".into(), End::Return)]
        );
        assert_eq!(s.pending_len(), 5, "a trailing CR waits for a possible LF");
        assert_eq!(
            split(&mut s, b"\n100%\r\ndone\n\n", false),
            [
                (" 20%".into(), End::Newline),
                ("100%".into(), End::Newline),
                ("done".into(), End::Newline),
                (String::new(), End::Newline)
            ]
        );
        assert_eq!(split(&mut s, b"x\r", true), [("x".into(), End::Return)]);
    }

    #[test]
    fn a_crlf_split_across_reads_is_one_newline() {
        let mut s = Splitter::default();
        assert!(split(&mut s, b"abc\r", false).is_empty());
        assert_eq!(
            split(&mut s, b"\nd\n", false)[0],
            ("abc".into(), End::Newline)
        );
    }

    #[test]
    fn a_held_return_can_be_released() {
        let mut s = Splitter::default();
        assert_eq!(
            split(&mut s, b"1%\r2%\r", false),
            [("1%".into(), End::Return)]
        );
        let mut out = Vec::new();
        s.release_return(|seg, end| out.push((seg.to_vec(), end)));
        assert_eq!(out, [(b"2%".to_vec(), End::Return)]);
        // The `\n` of a `\r\n` that was released early is not an empty line.
        assert_eq!(
            split(&mut s, b"\nok\n", false),
            [("ok".into(), End::Newline)]
        );
        s.release_return(|_, _| panic!("nothing held"));
        assert_eq!(split(&mut s, b"\n", false), [(String::new(), End::Newline)]);
    }

    #[test]
    fn long_segments_are_cut_at_the_bound() {
        let mut s = Splitter::default();
        let out = split(&mut s, &vec![b'x'; MAX_LINE_BYTES + 10], false);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].0.len(), out[0].1), (MAX_LINE_BYTES, End::Cut));
        assert_eq!(s.pending_len(), 10);
        let mut data = vec![b'y'; MAX_LINE_BYTES + 3];
        data.push(b'\n');
        let mut s = Splitter::default();
        let out = split(&mut s, &data, false);
        assert_eq!(out.len(), 2);
        assert_eq!((out[1].0.len(), out[1].1), (3, End::Newline));
    }
}
