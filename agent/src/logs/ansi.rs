//! Terminal escape sequences in worker output, reduced to what a log can show.
//!
//! Progress-bar libraries draw for a terminal: tqdm moves the cursor up (`ESC[A`) to redraw the
//! bars of a nested loop, rich and others erase lines (`ESC[K`, `ESC[2K`) and hide the cursor
//! (`ESC[?25l`). In a log these are noise at best. What is understood:
//! - colours and text attributes (SGR, `ESC[...m`) are kept as written;
//! - every other CSI sequence (cursor movement, erase, scroll, cursor visibility) is removed;
//! - a cursor-up (`ESC[nA`, `ESC[nF`, or the reverse index `ESC M`) marks the segment as part of
//!   a redraw, so it is treated as a progress update even when a `\n` ends it (that `\n` only
//!   moves the cursor back down);
//! - OSC strings (`ESC]...BEL`, window titles, hyperlinks' wrappers) and other two-byte escapes
//!   (`ESC 7`, `ESC 8`) are removed.
//!
//! Not understood: absolute cursor positioning (a full-screen UI), cursor-right used to
//! overwrite part of a line, and backspaces; their text is kept in the order it was written.

/// The escape byte.
const ESC: u8 = 0x1b;
/// Ends an OSC string.
const BEL: u8 = 0x07;

/// Whether `segment` holds an escape sequence at all (most lines do not).
pub fn has_escape(segment: &[u8]) -> bool {
    segment.contains(&ESC)
}

/// Appends `segment` to `out` without its cursor controls; returns whether it moved the cursor up.
pub fn clean(segment: &[u8], out: &mut Vec<u8>) -> bool {
    if !has_escape(segment) {
        out.extend_from_slice(segment);
        return false;
    }
    let mut cursor_up = false;
    let mut i = 0;
    while i < segment.len() {
        let Some(at) = segment[i..].iter().position(|&b| b == ESC) else {
            out.extend_from_slice(&segment[i..]);
            break;
        };
        out.extend_from_slice(&segment[i..i + at]);
        let start = i + at;
        match segment.get(start + 1) {
            Some(b'[') => {
                // CSI: parameter bytes 0x30-0x3F, intermediate bytes 0x20-0x2F, one final byte.
                let body = &segment[start + 2..];
                let params = body
                    .iter()
                    .take_while(|b| (0x20..=0x3f).contains(*b))
                    .count();
                match body.get(params) {
                    Some(&fin) if (0x40..=0x7e).contains(&fin) => {
                        let end = start + 2 + params + 1;
                        if fin == b'm' {
                            out.extend_from_slice(&segment[start..end]);
                        }
                        cursor_up |= fin == b'A' || fin == b'F';
                        i = end;
                    }
                    // Cut off (or malformed): nothing after it can be shown sensibly.
                    _ => break,
                }
            }
            Some(b']') => {
                // OSC: up to BEL or ST (`ESC \`).
                let body = &segment[start + 2..];
                let mut end = segment.len();
                for (k, &b) in body.iter().enumerate() {
                    if b == BEL {
                        end = start + 2 + k + 1;
                        break;
                    }
                    if b == ESC && body.get(k + 1) == Some(&b'\\') {
                        end = start + 2 + k + 2;
                        break;
                    }
                }
                i = end;
            }
            Some(&b) => {
                cursor_up |= b == b'M';
                i = start + 2;
            }
            None => break,
        }
    }
    cursor_up
}

/// Whether a cleaned segment shows nothing (a bar erased with spaces).
pub fn is_blank(text: &[u8]) -> bool {
    text.iter().all(u8::is_ascii_whitespace)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cleaned(s: &[u8]) -> (String, bool) {
        let mut out = Vec::new();
        let up = clean(s, &mut out);
        (String::from_utf8(out).unwrap(), up)
    }

    #[test]
    fn plain_text_is_copied() {
        assert_eq!(
            cleaned(b"epoch 1 loss 0.5"),
            ("epoch 1 loss 0.5".into(), false)
        );
    }

    #[test]
    fn colours_stay_cursor_controls_go() {
        assert_eq!(
            cleaned(b"\x1b[31mred\x1b[0m\x1b[K \x1b[2Kx\x1b[?25l"),
            ("\x1b[31mred\x1b[0m x".into(), false)
        );
    }

    #[test]
    fn cursor_up_is_reported() {
        // What tqdm writes for the inner bar of a nested loop.
        assert_eq!(
            cleaned(b" 50%|##   | 1/2 [00:00<00:00]\x1b[A"),
            (" 50%|##   | 1/2 [00:00<00:00]".into(), true)
        );
        assert!(cleaned(b"\x1b[3Fx").1);
        assert!(cleaned(b"\x1bMx").1);
    }

    #[test]
    fn osc_and_truncated_sequences() {
        assert_eq!(cleaned(b"a\x1b]0;title\x07b"), ("ab".into(), false));
        assert_eq!(cleaned(b"a\x1b]8;;u\x1b\\b"), ("ab".into(), false));
        assert_eq!(cleaned(b"a\x1b[12"), ("a".into(), false));
        assert_eq!(cleaned(b"a\x1b"), ("a".into(), false));
        assert_eq!(cleaned(b"a\x1b7b\x1b8"), ("ab".into(), false));
    }

    #[test]
    fn blank() {
        assert!(is_blank(b"   \t"));
        assert!(is_blank(b""));
        assert!(!is_blank(b" 1%"));
    }
}
