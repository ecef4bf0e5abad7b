//! Stop signals: what counts as a *second* one (for the launch's handlers, the dry run's and the
//! subcommands').
//!
//! A second stop signal means "stop now" (the impatient Ctrl-C) only when it arrives
//! [`REPEAT_WINDOW`] or more after the first. One request often reaches a process twice within
//! milliseconds: coreutils `timeout` signals its child and then its own process group, a terminal's
//! Ctrl-C reaches every process of the foreground group, and wrappers that forward signals add
//! another copy. Those copies are the same request, and must not skip the graceful stop.

use std::time::Duration;

use tokio::time::Instant;

/// How long after the first stop signal a later one still counts as the same request. One second
/// is far longer than any relay takes (a few milliseconds, even on a loaded machine), and shorter
/// than a person takes to decide the first Ctrl-C is not enough and press it again.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// What a stop signal means, given the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeat {
    /// The first stop signal: stop gracefully.
    First,
    /// A copy of the first (within [`REPEAT_WINDOW`] of it): nothing new to do.
    Duplicate,
    /// A later one: stop now.
    Insistent,
}

/// Remembers when the first stop signal came; a pure function of the arrival times.
#[derive(Debug, Default, Clone, Copy)]
pub struct StopSignals {
    first: Option<Instant>,
}

impl StopSignals {
    /// Classifies a stop signal that arrived at `now`.
    pub fn arrived(&mut self, now: Instant) -> Repeat {
        match self.first {
            None => {
                self.first = Some(now);
                Repeat::First
            }
            Some(first) if now.saturating_duration_since(first) < REPEAT_WINDOW => {
                Repeat::Duplicate
            }
            Some(_) => Repeat::Insistent,
        }
    }

    /// Whether a stop signal already arrived within [`REPEAT_WINDOW`] before `now`.
    pub fn is_recent(&self, now: Instant) -> bool {
        self.first
            .is_some_and(|first| now.saturating_duration_since(first) < REPEAT_WINDOW)
    }

    /// When the first stop signal arrived, if one did.
    pub fn first(&self) -> Option<Instant> {
        self.first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_within_the_window_are_one_request() {
        let t0 = Instant::now();
        let mut s = StopSignals::default();
        assert!(!s.is_recent(t0));
        assert_eq!(s.arrived(t0), Repeat::First);
        assert_eq!(s.arrived(t0 + Duration::from_millis(3)), Repeat::Duplicate);
        assert!(s.is_recent(t0 + Duration::from_millis(999)));
        assert_eq!(
            s.arrived(t0 + Duration::from_millis(999)),
            Repeat::Duplicate
        );
        assert_eq!(s.first(), Some(t0));
    }

    #[test]
    fn a_later_one_is_insistent_measured_from_the_first() {
        let t0 = Instant::now();
        let mut s = StopSignals::default();
        s.arrived(t0);
        // A stream of copies every half second does not push the window forward.
        assert_eq!(
            s.arrived(t0 + Duration::from_millis(500)),
            Repeat::Duplicate
        );
        assert_eq!(s.arrived(t0 + REPEAT_WINDOW), Repeat::Insistent);
        assert!(!s.is_recent(t0 + REPEAT_WINDOW));
    }
}
