//! Where a node's rank comes from, in order: `--node-rank` / `PET_NODE_RANK`, the Job's
//! completion index (`JOB_COMPLETION_INDEX`, Indexed Jobs and JobSets), a trailing ordinal in
//! the host name (`…-worker-3`, a StatefulSet's `…-3`), and only then arrival order. A rank
//! never comes from sorting host names (torchrun's c10d backend puts worker-10 before worker-2).

use super::ConfigError;

/// Which rule gave the node its rank (for the log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Flag,
    JobCompletionIndex,
    HostnameOrdinal,
    /// No identity: the coordinator assigns the lowest free rank in arrival order.
    Arrival,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Flag => "--node-rank/PET_NODE_RANK",
            Source::JobCompletionIndex => "JOB_COMPLETION_INDEX",
            Source::HostnameOrdinal => "the host name's ordinal",
            Source::Arrival => "arrival order",
        })
    }
}

/// Picks the node rank. `flag` is `--node-rank` or else `PET_NODE_RANK` (empty counts as unset,
/// as the training operator sometimes exports empty `PET_*` values).
pub fn node_rank(
    flag: Option<&str>,
    job_completion_index: Option<&str>,
    hostname: &str,
) -> Result<(Option<u32>, Source), ConfigError> {
    let parse = |what: &str, v: &str| {
        v.trim().parse::<u32>().map_err(|_| {
            ConfigError::Invalid(format!("{what} `{v}` is not a non-negative integer"))
        })
    };
    if let Some(v) = flag.filter(|v| !v.trim().is_empty()) {
        return Ok((Some(parse("--node-rank", v)?), Source::Flag));
    }
    if let Some(v) = job_completion_index.filter(|v| !v.trim().is_empty()) {
        return Ok((
            Some(parse("JOB_COMPLETION_INDEX", v)?),
            Source::JobCompletionIndex,
        ));
    }
    if let Some(n) = hostname_ordinal(hostname) {
        return Ok((Some(n), Source::HostnameOrdinal));
    }
    Ok((None, Source::Arrival))
}

/// The number after the last `-` of the host name's first label: `job-worker-3` → 3,
/// `job-worker-3.svc.ns` → 3. Names without a dash-separated number have none.
pub fn hostname_ordinal(hostname: &str) -> Option<u32> {
    let label = hostname.split('.').next()?;
    let (stem, digits) = label.rsplit_once('-')?;
    if stem.is_empty() || digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_is_flag_then_index_then_ordinal_then_arrival() {
        assert_eq!(
            node_rank(Some("2"), Some("5"), "w-7").ok(),
            Some((Some(2), Source::Flag))
        );
        assert_eq!(
            node_rank(Some(""), Some("5"), "w-7").ok(),
            Some((Some(5), Source::JobCompletionIndex))
        );
        assert_eq!(
            node_rank(None, None, "job-worker-10.svc").ok(),
            Some((Some(10), Source::HostnameOrdinal))
        );
        assert_eq!(
            node_rank(None, None, "laptop").ok(),
            Some((None, Source::Arrival))
        );
        assert!(node_rank(Some("x"), None, "w-1").is_err());
        assert!(node_rank(None, Some("-1"), "w-1").is_err());
    }

    #[test]
    fn ordinals_need_a_dash_and_only_digits() {
        assert_eq!(hostname_ordinal("sts-3"), Some(3));
        assert_eq!(hostname_ordinal("job-worker-2"), Some(2));
        assert_eq!(hostname_ordinal("node3"), None);
        assert_eq!(hostname_ordinal("a-3b"), None);
        assert_eq!(hostname_ordinal("-3"), None);
        assert_eq!(hostname_ordinal("pod-abc12-xyz"), None);
    }
}
