//! Values said in words in the lines people read: `1, 2 and 3`, `2.5 s`. A `Debug` rendering
//! (`[1, 3]`, `Some(3)`, `2.5s`) is for programmers, and a log line is read by an operator.

use std::fmt::Display;
use std::time::Duration;

/// `3`, `1 and 3`, `0, 1 and 2`; empty for no items.
pub fn and_list<T: Display>(items: &[T]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(ToString::to_string).collect();
            format!("{} and {last}", init.join(", "))
        }
    }
}

/// `GPU 3`, `GPUs 1 and 3`: a noun, plural past one item, then [`and_list`].
pub fn counted<T: Display>(noun: &str, items: &[T]) -> String {
    let s = if items.len() == 1 { "" } else { "s" };
    format!("{noun}{s} {}", and_list(items))
}

/// A duration as an operator writes one: `250 ms` below a second, else seconds with at most
/// three decimals and no trailing zeros (`2 s`, `2.5 s`).
pub fn duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        return format!("{} ms", d.as_millis());
    }
    let secs = format!("{:.3}", d.as_secs_f64());
    let secs = secs.trim_end_matches('0').trim_end_matches('.');
    format!("{secs} s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_read_as_english() {
        assert_eq!(and_list::<u32>(&[]), "");
        assert_eq!(and_list(&[3]), "3");
        assert_eq!(and_list(&[1, 3]), "1 and 3");
        assert_eq!(and_list(&[0, 1, 2]), "0, 1 and 2");
        assert_eq!(counted("GPU", &[3]), "GPU 3");
        assert_eq!(counted("node", &[1, 3]), "nodes 1 and 3");
    }

    #[test]
    fn durations_read_with_a_unit_and_a_space() {
        assert_eq!(duration(Duration::from_millis(250)), "250 ms");
        assert_eq!(duration(Duration::ZERO), "0 ms");
        assert_eq!(duration(Duration::from_secs(2)), "2 s");
        assert_eq!(duration(Duration::from_millis(2500)), "2.5 s");
        assert_eq!(duration(Duration::from_secs(31_536_000)), "31536000 s");
    }
}
