//! Seconds, as every flag, variable and `--rdzv-conf`/`--network-check-conf` key of muster
//! takes them: one parser, so that one syntax and one range hold everywhere, and no value can
//! reach `Duration::from_secs_f64` (which panics past `u64::MAX` seconds) or an `Instant`
//! addition (which panics on overflow) unchecked.
//!
//! The syntax: a whole or decimal number, optionally in exponent form (`2`, `0.5`, `1e3`), with
//! an optional unit `ms`, `s` or `m` (`250ms`, `30s`, `5m`); from 0 to [`MAX`]. It lives here,
//! at the bottom of the workspace, because the rendezvous crate's own `--rdzv-conf` keys use it.

use std::time::Duration;

/// The longest duration any setting accepts: a year. Every limit, interval and timeout of a
/// training job is far below it; above it a value is a typo (or a hostile input), and an
/// `Instant` a year ahead is still far from overflowing on every clock.
pub const MAX: Duration = Duration::from_secs(365 * 24 * 3600);

/// One sentence for `--help`, the docs and every error message.
pub const SYNTAX: &str =
    "seconds: a number (2, 0.5, 1e3) with an optional unit (250ms, 30s, 5m), from 0 to 31536000 (a year)";

/// Why a text is not a duration; each message ends with the accepted syntax and range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecondsError {
    #[error("not a number of seconds; expected {SYNTAX}")]
    NotANumber,
    #[error("negative; expected {SYNTAX}")]
    Negative,
    #[error("longer than a year; expected {SYNTAX}")]
    TooLarge,
}

/// Parses `text` (surrounding whitespace ignored) as [the syntax](self).
pub fn parse(text: &str) -> Result<Duration, SecondsError> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let number = number.trim();
    // Rust's float parser also reads `inf`, `infinity` and `nan`: refused here, so an infinite
    // value below can only be a number too large for a float.
    if number.is_empty() || !number.starts_with(|c: char| c.is_ascii_digit() || "+-.".contains(c)) {
        return Err(SecondsError::NotANumber);
    }
    let value: f64 = number.parse().map_err(|_| SecondsError::NotANumber)?;
    if value.is_nan() {
        return Err(SecondsError::NotANumber);
    }
    if value < 0.0 {
        // `-0` is zero, not negative.
        return if value == 0.0 {
            Ok(Duration::ZERO)
        } else {
            Err(SecondsError::Negative)
        };
    }
    let secs = value * scale;
    if secs > MAX.as_secs_f64() {
        return Err(SecondsError::TooLarge);
    }
    Duration::try_from_secs_f64(secs).map_err(|_| SecondsError::TooLarge)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_decimal_exponent_and_units() {
        assert_eq!(parse("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse(" 2.5 "), Ok(Duration::from_millis(2500)));
        assert_eq!(parse("1e3"), Ok(Duration::from_secs(1000)));
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        assert_eq!(parse("-0"), Ok(Duration::ZERO));
        assert_eq!(parse("31536000"), Ok(MAX));
    }

    #[test]
    fn hostile_values_are_errors_never_panics() {
        for text in [
            "1e20",
            "99999999999999999999",
            "18446744073709551616",
            "31536001",
            "1e400",
        ] {
            assert_eq!(parse(text), Err(SecondsError::TooLarge), "{text}");
        }
        assert_eq!(parse("525601m"), Err(SecondsError::TooLarge));
        for text in ["NaN", "nan", "inf", "-inf", "infinity"] {
            assert!(parse(text).is_err(), "{text}");
        }
        assert_eq!(parse("-1"), Err(SecondsError::Negative));
        assert_eq!(parse("-1e400"), Err(SecondsError::Negative));
        for text in ["", " ", "s", "ms", "abc", "1h", "1 2", "0x10", "\u{ff}"] {
            assert_eq!(parse(text), Err(SecondsError::NotANumber), "{text:?}");
        }
        assert_eq!(parse(&"9".repeat(100_000)), Err(SecondsError::TooLarge));
        let message = parse("1e20").unwrap_err().to_string();
        assert!(message.contains("from 0 to 31536000"), "{message}");
    }
}
