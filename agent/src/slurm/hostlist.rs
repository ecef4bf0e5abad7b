//! Slurm's hostlist syntax, expanded without shelling out to `scontrol show hostnames`:
//! `gpu[001-004,010]`, `a[1-2],b3`, `n[01-02]-ib`, `rack[1-2]-n[1-2]` (every bracket group of a
//! name multiplies, left to right, as Slurm's own `hostlist_create` does).
//!
//! A range keeps the zero padding of its lower bound (`[08-10]` is `08 09 10`), as Slurm prints
//! them. The expansion is bounded ([`MAX_HOSTS`]) so a typo such as `n[1-99999999]` is an error,
//! not an allocation of gigabytes.

/// More hosts than any Slurm cluster has (Slurm's own `MAX_RANGES`-style guard, rounded up).
pub const MAX_HOSTS: usize = 1 << 20;

/// Why a hostlist does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HostlistError {
    #[error("empty hostlist")]
    Empty,
    #[error("hostlist `{0}`: unbalanced `[` or `]`")]
    Unbalanced(String),
    #[error("hostlist `{list}`: bad range `{range}` (expected N, N-M with N <= M, digits only)")]
    BadRange { list: String, range: String },
    #[error("hostlist `{0}`: an empty host name")]
    EmptyName(String),
    #[error("hostlist `{0}` expands to more than {MAX_HOSTS} hosts")]
    TooMany(String),
}

/// Every host of `list`, in order (duplicates kept, as Slurm keeps them in a node list).
pub fn expand(list: &str) -> Result<Vec<String>, HostlistError> {
    let list = list.trim();
    if list.is_empty() {
        return Err(HostlistError::Empty);
    }
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            return Err(HostlistError::EmptyName(list.to_owned()));
        }
        let expanded = expand_one(item, list)?;
        if hosts.len() + expanded.len() > MAX_HOSTS {
            return Err(HostlistError::TooMany(list.to_owned()));
        }
        hosts.extend(expanded);
    }
    Ok(hosts)
}

/// The first host of `list` without expanding the rest (the rendezvous host of a step).
pub fn first(list: &str) -> Result<String, HostlistError> {
    // The whole list is checked, so a malformed one never yields a plausible first name.
    expand(list)?.into_iter().next().ok_or(HostlistError::Empty)
}

/// Splits on the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, HostlistError> {
    let mut items = Vec::new();
    let mut depth = 0u32;
    let mut start = 0;
    for (at, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            ']' if depth == 1 => depth = 0,
            '[' | ']' => return Err(HostlistError::Unbalanced(list.to_owned())),
            ',' if depth == 0 => {
                items.push(list[start..at].trim());
                start = at + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(HostlistError::Unbalanced(list.to_owned()));
    }
    items.push(list[start..].trim());
    Ok(items)
}

/// One name with any number of bracket groups: the product of the groups, left to right.
fn expand_one(item: &str, list: &str) -> Result<Vec<String>, HostlistError> {
    let mut names = vec![String::new()];
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or_else(|| HostlistError::Unbalanced(list.to_owned()))?;
        let literal = &rest[..open];
        let values = ranges(&rest[open + 1..close], list)?;
        if names.len().saturating_mul(values.len()) > MAX_HOSTS {
            return Err(HostlistError::TooMany(list.to_owned()));
        }
        names = names
            .iter()
            .flat_map(|n| values.iter().map(move |v| format!("{n}{literal}{v}")))
            .collect();
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return Err(HostlistError::Unbalanced(list.to_owned()));
    }
    for n in &mut names {
        n.push_str(rest);
    }
    Ok(names)
}

/// `001-004,010` -> `001 002 003 004 010`.
fn ranges(body: &str, list: &str) -> Result<Vec<String>, HostlistError> {
    let bad = |range: &str| HostlistError::BadRange {
        list: list.to_owned(),
        range: range.to_owned(),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let mut out = Vec::new();
    for range in body.split(',') {
        let range = range.trim();
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        if !digits(lo) || !digits(hi) {
            return Err(bad(range));
        }
        let width = lo.len();
        let (Ok(a), Ok(b)) = (lo.parse::<u64>(), hi.parse::<u64>()) else {
            return Err(bad(range));
        };
        if a > b {
            return Err(bad(range));
        }
        if usize::try_from(b - a)
            .ok()
            .and_then(|n| n.checked_add(out.len()))
            .is_none_or(|n| n >= MAX_HOSTS)
        {
            return Err(HostlistError::TooMany(list.to_owned()));
        }
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn plain_names_and_ranges() {
        assert_eq!(ok("node1"), ["node1"]);
        assert_eq!(
            ok("gpu[001-004,010]"),
            ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]
        );
        assert_eq!(ok("a[1-2],b3"), ["a1", "a2", "b3"]);
        assert_eq!(ok("n[01-02]-ib"), ["n01-ib", "n02-ib"]);
        assert_eq!(ok("mnode[1-2]"), ["mnode1", "mnode2"]);
        assert_eq!(ok("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(ok("n[08-10]"), ["n08", "n09", "n10"]);
        assert_eq!(ok("x[7]"), ["x7"]);
    }

    #[test]
    fn several_groups_multiply_left_to_right() {
        assert_eq!(ok("r[1-2]-n[1-2]"), ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]);
        assert_eq!(ok("c[1-2]n,d"), ["c1n", "c2n", "d"]);
    }

    #[test]
    fn the_first_host() {
        assert_eq!(first("gpu[003-004],gpu001").ok(), Some("gpu003".to_owned()));
        assert_eq!(first(" h1 ").ok(), Some("h1".to_owned()));
    }

    #[test]
    fn bad_input_is_an_error_naming_the_list() {
        for (list, want) in [
            ("", HostlistError::Empty),
            ("n[1-2", HostlistError::Unbalanced("n[1-2".into())),
            ("n1-2]", HostlistError::Unbalanced("n1-2]".into())),
            ("n[[1]]", HostlistError::Unbalanced("n[[1]]".into())),
            ("a,,b", HostlistError::EmptyName("a,,b".into())),
        ] {
            assert_eq!(expand(list).unwrap_err(), want, "{list}");
        }
        for list in ["n[2-1]", "n[a-b]", "n[]", "n[1-]", "n[-3]", "n[1--2]"] {
            assert!(
                matches!(expand(list), Err(HostlistError::BadRange { .. })),
                "{list}"
            );
        }
        assert!(matches!(
            expand("n[1-99999999]"),
            Err(HostlistError::TooMany(_))
        ));
        assert!(matches!(
            expand("a[1-2000]b[1-2000]"),
            Err(HostlistError::TooMany(_))
        ));
        assert!(expand("n[1-2]").is_ok());
    }
}
