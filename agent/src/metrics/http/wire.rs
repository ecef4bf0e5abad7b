//! What the endpoint checks in the byte stream before hyper parses it: where each request head
//! ends, that its lines end in CRLF, its HTTP version, and how long its body is.
//!
//! hyper (through httparse) accepts a bare LF as a line end, which RFC 9112 §2.2 allows; but a
//! server that does and a proxy in front of it that does not disagree on where a request ends,
//! which is what request smuggling needs, so a bare LF or CR anywhere in a head is a 400 here.
//! hyper also answers 400 to `HTTP/2.0` or `HTTP/3`, where 505 says what is wrong.
//!
//! [`Framer`] hands on only whole heads that passed these checks, then the body bytes their
//! `Content-Length` announces: hyper never sees part of a head, so a slow or bad one is answered
//! here (the connection task turns a [`Reject`] into a response) and hyper serves one request
//! per head it is given. Pure bookkeeping, no I/O.

use super::{MAX_BODY_BYTES, MAX_HEAD_BYTES};

/// Why a request is answered by the endpoint itself, with an error status and a close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reject {
    BadRequest,
    Timeout,
    HeadTooLarge,
    BadVersion,
}

impl Reject {
    pub(super) fn status(self) -> u16 {
        match self {
            Reject::BadRequest => 400,
            Reject::Timeout => 408,
            Reject::HeadTooLarge => 431,
            Reject::BadVersion => 505,
        }
    }
}

/// Splits the bytes a client sends into checked heads and their bodies.
#[derive(Debug, Default)]
pub(super) struct Framer {
    /// The head being received, not yet complete (at most [`MAX_HEAD_BYTES`]).
    partial: Vec<u8>,
    /// Body bytes still owed by the last head handed on.
    body_left: usize,
    /// The last head announced a body this framer does not follow (chunked, too large, or an
    /// unreadable length): hyper answers that request with an error and a close, so nothing
    /// after it is handed on.
    opaque: bool,
    /// Heads handed on so far.
    heads: u64,
}

impl Framer {
    /// Moves what `input` completes to `out`: whole checked heads and body bytes. An error is the
    /// reason to answer the next head with an error: nothing of that head is handed on, what
    /// precedes it is (and counted in [`Framer::heads`]).
    pub(super) fn push(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), Reject> {
        while !input.is_empty() && !self.opaque {
            if self.body_left > 0 {
                let n = self.body_left.min(input.len());
                out.extend_from_slice(&input[..n]);
                self.body_left -= n;
                input = &input[n..];
                continue;
            }
            // Look at no more than a head's worth, so a flood cannot grow the buffer.
            let room = MAX_HEAD_BYTES + 1 - self.partial.len().min(MAX_HEAD_BYTES);
            let take = room.min(input.len());
            let scanned = self.partial.len();
            self.partial.extend_from_slice(&input[..take]);
            match head_end(&self.partial, scanned.saturating_sub(1))? {
                Some(end) => {
                    let framing = check_head(&self.partial[..end])?;
                    out.extend_from_slice(&self.partial[..end]);
                    self.heads += 1;
                    match framing {
                        Some(len) => self.body_left = len,
                        None => self.opaque = true,
                    }
                    // Bytes after the head go round the loop again (body or the next head).
                    let used = end - scanned;
                    self.partial.clear();
                    input = &input[used..];
                }
                None if self.partial.len() > MAX_HEAD_BYTES => return Err(Reject::HeadTooLarge),
                None => input = &input[take..],
            }
        }
        Ok(())
    }

    /// Heads handed on so far.
    pub(super) fn heads(&self) -> u64 {
        self.heads
    }

    /// Part of a request (a head or a body) has arrived and the rest has not.
    pub(super) fn in_request(&self) -> bool {
        !self.partial.is_empty() || self.body_left > 0
    }

    /// Inside a body, or past a head whose body is not followed.
    pub(super) fn in_body(&self) -> bool {
        self.body_left > 0 || self.opaque
    }
}

/// Length of the head including its blank line once it is complete, checking line ends from
/// byte `from` on (what was scanned before passed). A bare LF or a bare CR is a 400 at once; a
/// CR at the very end may still be followed by its LF.
fn head_end(buf: &[u8], from: usize) -> Result<Option<usize>, Reject> {
    for (i, &b) in buf.iter().enumerate().skip(from) {
        match b {
            b'\n' if i == 0 || buf[i - 1] != b'\r' => return Err(Reject::BadRequest),
            b'\r' if buf.get(i + 1).is_some_and(|next| *next != b'\n') => {
                return Err(Reject::BadRequest)
            }
            b'\n' if i >= 3 && &buf[i - 3..=i] == b"\r\n\r\n" => return Ok(Some(i + 1)),
            _ => {}
        }
    }
    Ok(None)
}

/// Checks a complete head (CRLF line ends already checked) and returns the length of the body
/// that follows it, or `None` when the body is not framed by `Content-Length` within
/// [`MAX_BODY_BYTES`] (hyper and the router answer those with an error and a close).
fn check_head(head: &[u8]) -> Result<Option<usize>, Reject> {
    let mut lines = head
        .split(|b| *b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    // httparse skips empty lines before the request line; refusing them keeps "one head handed
    // on, one request served", which the connection task counts on.
    let request_line = lines.next().unwrap_or_default();
    if request_line.is_empty() {
        return Err(Reject::BadRequest);
    }
    let version = request_line
        .rsplit(|b| *b == b' ')
        .next()
        .unwrap_or_default();
    if version.starts_with(b"HTTP/") && version != b"HTTP/1.1" && version != b"HTTP/1.0" {
        return Err(Reject::BadVersion);
    }
    let mut length: Option<usize> = None;
    for line in lines {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue; // hyper refuses it
        };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Ok(None);
        }
        if name.eq_ignore_ascii_case(b"content-length") {
            let parsed = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse::<usize>().ok());
            match parsed {
                Some(n) if n <= MAX_BODY_BYTES && length.is_none_or(|m| m == n) => {
                    length = Some(n);
                }
                _ => return Ok(None),
            }
        }
    }
    Ok(Some(length.unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `chunks` one after the other; returns what was handed on, the heads completed, and
    /// the first rejection.
    fn feed(chunks: &[&[u8]]) -> (Vec<u8>, u64, Option<Reject>, Framer) {
        let mut framer = Framer::default();
        let mut out = Vec::new();
        for chunk in chunks {
            if let Err(reject) = framer.push(chunk, &mut out) {
                return (out, framer.heads(), Some(reject), framer);
            }
        }
        (out, framer.heads(), None, framer)
    }

    #[test]
    fn whole_heads_and_their_bodies_are_handed_on_in_any_split() {
        let stream: &[u8] = b"GET /readyz HTTP/1.1\r\n\r\nPOST /checkpoint HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n";
        for split in 0..stream.len() {
            for step in [1, 3, 7] {
                let mut chunks = vec![&stream[..split]];
                chunks.extend(stream[split..].chunks(step));
                let (out, heads, reject, framer) = feed(&chunks);
                assert_eq!((out.as_slice(), heads, reject), (stream, 3, None));
                assert!(!framer.in_request());
            }
        }
        let (out, heads, _, framer) = feed(&[b"GET / HTTP/1.1\r\nHost: x\r"]);
        assert!(out.is_empty() && heads == 0, "a partial head is held back");
        assert!(framer.in_request() && !framer.in_body());
        let (out, _, _, framer) = feed(&[b"POST / HTTP/1.1\r\ncontent-length:  5 \r\n\r\nab"]);
        assert!(out.ends_with(b"\r\n\r\nab"));
        assert!(framer.in_request() && framer.in_body());
    }

    #[test]
    fn bodies_the_framer_does_not_follow_end_the_stream() {
        for head in [
            &b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: 999999\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        ] {
            let rest = b"5\r\nhello\r\n0\r\n\r\nGET / HTTP/1.1\n\n";
            let (out, heads, reject, framer) = feed(&[head, rest]);
            assert_eq!((out.as_slice(), heads, reject), (head, 1, None));
            assert!(framer.in_body());
        }
    }

    #[test]
    fn bare_line_ends_are_rejected() {
        for input in [
            &b"GET / HTTP/1.1\n\n"[..],
            b"GET / HTTP/1.1\nHost: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\n\n",
            b"\nGET / HTTP/1.1\r\n\r\n",
            b"\r\nGET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\rHost: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n",
            b"GET / HTTP/1.1\n",
        ] {
            let text = String::from_utf8_lossy(input).escape_debug().to_string();
            let (out, _, reject, _) = feed(&[input]);
            assert_eq!(reject, Some(Reject::BadRequest), "{text}");
            assert!(out.is_empty(), "{text}");
            // The same split in two, the bad byte in the second read.
            let (first, second) = input.split_at(input.len() / 2);
            assert_eq!(feed(&[first, second]).2, Some(Reject::BadRequest), "{text}");
        }
        // Only heads must use CRLF: a body may hold anything.
        let ok: &[u8] = b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\na\nb\rGET / HTTP/1.1\r\n\r\n";
        let (out, heads, reject, framer) = feed(&[ok]);
        assert_eq!((out.as_slice(), heads, reject), (ok, 2, None));
        assert!(!framer.in_request());
        // What came before a bad head is still handed on.
        let (out, heads, reject, _) = feed(&[b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\n\n"]);
        assert_eq!(
            (out.as_slice(), heads, reject),
            (&b"GET /a HTTP/1.1\r\n\r\n"[..], 1, Some(Reject::BadRequest))
        );
    }

    #[test]
    fn other_versions_and_oversized_heads_are_named() {
        for version in ["HTTP/2.0", "HTTP/3", "HTTP/1.2", "HTTP/"] {
            let head = format!("GET /metrics {version}\r\n\r\n");
            assert_eq!(
                feed(&[head.as_bytes()]).2,
                Some(Reject::BadVersion),
                "{version}"
            );
        }
        // Not HTTP at all is hyper's to refuse (400).
        assert_eq!(feed(&[b"\x16\x03\x01\x02\x00\r\n\r\n"]).2, None);
        let big = [
            b"GET /".as_slice(),
            &[b'a'; MAX_HEAD_BYTES],
            b" HTTP/1.1\r\n\r\n",
        ]
        .concat();
        assert_eq!(feed(&[&big]).2, Some(Reject::HeadTooLarge));
        let mut endless = b"GET / HTTP/1.1\r\nX: ".to_vec();
        endless.resize(3 * MAX_HEAD_BYTES, b'a');
        let chunks: Vec<&[u8]> = endless.chunks(1000).collect();
        assert_eq!(feed(&chunks).2, Some(Reject::HeadTooLarge));
        let fits = [
            b"GET / HTTP/1.1\r\nX: ".as_slice(),
            &[b'a'; MAX_HEAD_BYTES - 23],
            b"\r\n\r\n",
        ]
        .concat();
        assert_eq!(fits.len(), MAX_HEAD_BYTES);
        assert_eq!(feed(&[&fits]).1, 1);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_nor_grow_the_buffer(
            chunks in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..3000), 0..8),
        ) {
            let mut framer = Framer::default();
            let mut out = Vec::new();
            for chunk in &chunks {
                if framer.push(chunk, &mut out).is_err() {
                    break;
                }
                proptest::prop_assert!(framer.partial.len() <= MAX_HEAD_BYTES);
            }
        }

        #[test]
        fn request_like_text_is_framed_whole(
            method in "[A-Z]{1,8}",
            target in "/[!-~]{0,40}",
            headers in proptest::collection::vec("[A-Za-z-]{1,12}: [ -~]{0,40}", 0..8),
            split in 0usize..400,
        ) {
            let lines = headers.join("\r\n") + if headers.is_empty() { "" } else { "\r\n" };
            let text = format!("{method} {target} HTTP/1.1\r\n{lines}\r\n");
            let bytes = text.as_bytes();
            let at = split.min(bytes.len());
            let (out, heads, reject, _) = feed(&[&bytes[..at], &bytes[at..]]);
            if reject.is_none() {
                proptest::prop_assert_eq!(heads, 1);
                proptest::prop_assert_eq!(out.as_slice(), bytes);
            }
        }
    }
}
