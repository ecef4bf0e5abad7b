//! The last exception line of a rank's stderr: what the failure summary shows when the rank left
//! no error file (its main is not wrapped in torch's `@record`).
//!
//! Python prints an uncaught exception as `Traceback (most recent call last):`, indented frame
//! lines, then one unindented `SomeError: message` line (chained exceptions repeat the block;
//! the last one is the one that ended the process). The tracker follows that shape line by line;
//! nothing is kept but the one line.

use std::sync::{Mutex, PoisonError};

/// The longest exception line kept (a message can be a whole tensor repr).
const MAX_CHARS: usize = 500;

#[derive(Default)]
struct State {
    in_traceback: bool,
    last: Option<String>,
}

/// Follows one stderr stream.
#[derive(Default)]
pub struct ExceptionLine {
    state: Mutex<State>,
}

impl ExceptionLine {
    /// Looks at one line of the stream (without its newline).
    pub fn observe(&self, line: &[u8]) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let text = String::from_utf8_lossy(line);
        // torch prefixes its ranks' lines with `[rankN]:` when it re-raises in a collective.
        let text = strip_rank_tag(text.trim_end());
        if text.starts_with("Traceback (most recent call last):") {
            state.in_traceback = true;
            return;
        }
        if !state.in_traceback {
            return;
        }
        if text.starts_with(char::is_whitespace) || text.is_empty() {
            return;
        }
        state.in_traceback = false;
        if looks_like_exception(text) {
            state.last = Some(text.chars().take(MAX_CHARS).collect());
        }
    }

    /// The last `SomeError: message` line seen.
    pub fn last(&self) -> Option<String> {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last
            .clone()
    }
}

fn strip_rank_tag(text: &str) -> &str {
    if let Some(rest) = text.strip_prefix("[rank") {
        if let Some((tag, after)) = rest.split_once("]:") {
            if tag.chars().all(|c| c.is_ascii_digit()) {
                return after.strip_prefix(' ').unwrap_or(after);
            }
        }
    }
    text
}

/// `module.Name: message` or a bare `Name` (`KeyboardInterrupt`): a dotted identifier first.
fn looks_like_exception(text: &str) -> bool {
    let name = text.split_once(':').map_or(text, |(name, _)| name);
    !name.is_empty()
        && name.split('.').all(|part| {
            part.starts_with(|c: char| c.is_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_alphanumeric() || c == '_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(text: &str) -> Option<String> {
        let t = ExceptionLine::default();
        for line in text.lines() {
            t.observe(line.as_bytes());
        }
        t.last()
    }

    #[test]
    fn the_last_exception_line_of_the_last_traceback() {
        let text = "step 3\nTraceback (most recent call last):\n  File \"t.py\", line 3, in <module>\n    main()\nKeyError: 'x'\n\nDuring handling of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n  File \"t.py\", line 5, in <module>\n    raise ValueError(\"boom\")\nValueError: boom\nlater noise\n";
        assert_eq!(feed(text).as_deref(), Some("ValueError: boom"));
    }

    #[test]
    fn dotted_names_bare_names_and_rank_tags() {
        let dotted = "Traceback (most recent call last):\n  File \"x\"\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n";
        assert_eq!(
            feed(dotted).as_deref(),
            Some("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        );
        assert_eq!(
            feed("Traceback (most recent call last):\n  File \"x\"\nKeyboardInterrupt\n")
                .as_deref(),
            Some("KeyboardInterrupt")
        );
        let tagged = "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x\"\n[rank1]: RuntimeError: bad\n";
        assert_eq!(feed(tagged).as_deref(), Some("RuntimeError: bad"));
    }

    #[test]
    fn lines_outside_a_traceback_are_not_exceptions() {
        assert_eq!(feed("ValueError: logged, not raised\nwarning: x\n"), None);
        assert_eq!(
            feed("Traceback (most recent call last):\n  File \"x\"\nnot an exception line!\n"),
            None
        );
    }
}
