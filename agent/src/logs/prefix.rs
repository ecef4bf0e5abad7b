//! Line prefixes: torchrun's `--log-line-prefix-template` macros and the UTC timestamps of the
//! JSON format, as pure functions.

use std::time::{SystemTime, UNIX_EPOCH};

/// Expands `${hostname}`, `${rank}`, `${local_rank}` and `${role_name}` (torchrun's macros);
/// anything else is kept as written.
pub fn render_template(
    template: &str,
    hostname: &str,
    rank: u32,
    local_rank: u32,
    role_name: &str,
) -> String {
    template
        .replace("${hostname}", hostname)
        .replace("${rank}", &rank.to_string())
        .replace("${local_rank}", &local_rank.to_string())
        .replace("${role_name}", role_name)
}

/// RFC 3339 UTC with milliseconds, e.g. `2026-11-29T12:31:43.123Z`.
pub fn utc_timestamp(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, day) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Howard Hinnant's days-to-civil conversion (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn torchrun_macros() {
        assert_eq!(
            render_template("[${role_name}${local_rank}]:", "h", 5, 1, "default"),
            "[default1]:"
        );
        assert_eq!(
            render_template("[${hostname}:${rank}] ", "node-0", 5, 1, "r"),
            "[node-0:5] "
        );
    }

    #[test]
    fn timestamps() {
        let t = UNIX_EPOCH + Duration::from_millis(1_796_042_303_123);
        assert_eq!(utc_timestamp(t), "2026-11-30T12:38:23.123Z");
        assert_eq!(utc_timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(&utc_timestamp(leap)[..10], "2000-02-29");
    }
}
