//! The gang's root cause: which failure, among every node's, explains a failed attempt.
//!
//! In a synchronous job one rank's error breaks every rank's collective: its peers on other
//! nodes fail a few milliseconds later with "Connection closed by peer" (gloo) or a remote error
//! (NCCL). Each node only sees its own ranks, so without this every node would name its own
//! symptom — and node 0, the pod people read first, most often names a symptom. So each node
//! posts its attempt's first local failure to the rendezvous store's failure board
//! ([`rendezvous::rdzv::board`]) the moment it sees it, and every node names the gang's first.
//!
//! "First" is the store host's receive order, never the nodes' clocks (pods on different
//! machines may be seconds apart). One refinement: a failure whose error is what a rank says when
//! a *peer* went away ([`PostedFailure::looks_like_consequence`]) yields to a later one that does
//! not, because the rank that raised the real error may take longer to be reaped and posted
//! than its peers take to notice the broken connection. Everything posted for one attempt
//! happened within the attempt's last moments, so no time window is needed.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::reaper::ExitStatus;
use super::Failure;

/// The longest error text a record carries (the first lines of an `@record` traceback are
/// what explains it; the whole one is in the failing node's own log).
const MAX_ERROR_BYTES: usize = 2048;

/// What a rank prints when a *peer* disappeared rather than when it failed on its own
/// (lower-case substrings): gloo's and NCCL's messages for a connection a dead rank left.
const CONSEQUENCE_PATTERNS: &[&str] = &[
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "distnetworkerror",
    "remote process exited",
    "ncclremoteerror",
    "remote process",
    "communicator was aborted",
    "timed out waiting",
    "watchdog caught collective operation timeout",
];

/// One node's first failure of an attempt, as posted to the board (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PostedFailure {
    pub node_rank: u32,
    pub host: String,
    pub rank: u32,
    pub local_rank: u32,
    pub pid: u32,
    /// "exit code 1", "signal SIGSEGV (11)".
    pub status: String,
    /// The worker's own exit code, when it exited.
    #[serde(default)]
    pub worker_exit_code: Option<i32>,
    /// The signal that ended it (`SIGSEGV`), when one did.
    #[serde(default)]
    pub signal: Option<String>,
    /// The agent exit code this failure alone would give.
    pub exit_code: u8,
    /// The error: the error file's message, else the last exception line of stderr, else what
    /// the agent knows (OOM kill, hang).
    #[serde(default)]
    pub error: Option<String>,
    /// When the node saw it, by the node's own clock (printing only: never used to order).
    pub at_unix_ms: u64,
}

impl PostedFailure {
    pub fn from_failure(f: &Failure, node_rank: u32) -> Self {
        let error = match (&f.hang, &f.message, &f.exception_line) {
            (Some(hang), _, _) => Some(format!("hung: {}", hang.describe())),
            (None, Some(m), _) => Some(m.clone()),
            (None, None, Some(line)) => Some(line.clone()),
            (None, None, None) => f.oom_line(),
        };
        Self {
            node_rank,
            host: f.host.clone(),
            rank: f.rank,
            local_rank: f.local_rank,
            pid: f.pid,
            status: f.status.to_string(),
            worker_exit_code: match f.status {
                ExitStatus::Exited(c) => Some(c),
                ExitStatus::Signaled(_) => None,
            },
            signal: match f.status {
                ExitStatus::Exited(_) => None,
                ExitStatus::Signaled(s) => Some(s.as_str().to_owned()),
            },
            exit_code: f.exit_code(),
            error: error.map(|e| truncate(&e, MAX_ERROR_BYTES)),
            at_unix_ms: unix_ms(f.at),
        }
    }

    /// Whether the error reads like a rank that lost a peer rather than one that failed itself.
    pub fn looks_like_consequence(&self) -> bool {
        let Some(error) = &self.error else {
            return false;
        };
        let error = error.to_ascii_lowercase();
        CONSEQUENCE_PATTERNS.iter().any(|p| error.contains(p))
    }

    /// The error's first line, or the status when there is none.
    pub fn headline(&self) -> &str {
        self.error
            .as_deref()
            .and_then(|e| e.lines().find(|l| !l.trim().is_empty()))
            .unwrap_or(&self.status)
    }

    /// "node 1 (trainer-1) rank 3 (local rank 1): exit code 1: ValueError: bad shard".
    pub fn describe(&self) -> String {
        let mut text = format!(
            "node {} ({}) rank {} (local rank {}): {}",
            self.node_rank, self.host, self.rank, self.local_rank, self.status
        );
        if self.error.is_some() {
            text.push_str(": ");
            text.push_str(self.headline());
        }
        text
    }

    pub fn same_rank(&self, other: &PostedFailure) -> bool {
        self.node_rank == other.node_rank && self.rank == other.rank
    }
}

/// The gang's verdict on one failed attempt, as this node read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangCause {
    /// The gang's root cause.
    pub root: PostedFailure,
    /// Its place in the store host's receive order (1 = first received).
    pub ticket: u64,
    /// Earlier failures it was preferred over because they read as consequences.
    pub passed_over: usize,
    /// This node's own first failure, when it had one and it is not the root cause.
    pub this_node: Option<PostedFailure>,
    /// This node's rank.
    pub node_rank: u32,
}

impl GangCause {
    /// Picks the root cause among the board's records (ticket, JSON) for node `node_rank`;
    /// `own`: its first failure, if any. `None` when nothing readable was posted.
    pub fn pick(
        records: &[(u64, Vec<u8>)],
        own: Option<&PostedFailure>,
        node_rank: u32,
    ) -> Option<Self> {
        let mut posted: Vec<(u64, PostedFailure)> = records
            .iter()
            .filter_map(|(t, raw)| Some((*t, serde_json::from_slice(raw).ok()?)))
            .collect();
        posted.sort_by_key(|(t, _)| *t);
        let index = posted
            .iter()
            .position(|(_, p)| !p.looks_like_consequence())
            .or(if posted.is_empty() { None } else { Some(0) })?;
        let (ticket, root) = posted.swap_remove(index);
        let this_node = own.filter(|o| !o.same_rank(&root)).cloned();
        Some(Self {
            root,
            ticket,
            passed_over: index,
            this_node,
            node_rank,
        })
    }

    /// Whether the root cause is on another node than this one.
    pub fn elsewhere(&self) -> bool {
        self.root.node_rank != self.node_rank
    }

    /// When the root cause's node saw it, by that node's clock.
    pub fn root_at(&self) -> SystemTime {
        UNIX_EPOCH + std::time::Duration::from_millis(self.root.at_unix_ms)
    }

    /// Milliseconds from the root cause to this node's own failure, by the nodes' clocks.
    pub fn followed_after_ms(&self) -> Option<i64> {
        let own = self.this_node.as_ref()?;
        let delta = i128::from(own.at_unix_ms) - i128::from(self.root.at_unix_ms);
        Some(i64::try_from(delta).unwrap_or(0))
    }

    /// "rank 1 on this node failed 40 ms later (exit code 1): RuntimeError: ... closed by peer".
    pub fn followed(&self) -> Option<String> {
        let own = self.this_node.as_ref()?;
        let when = match self.followed_after_ms()? {
            0 => "at the same moment".to_owned(),
            d if d > 0 => format!("{} later", human_ms(d.unsigned_abs())),
            d => format!(
                "{} earlier by the nodes' clocks",
                human_ms(d.unsigned_abs())
            ),
        };
        Some(format!(
            "rank {} (local rank {}) on this node failed {when} ({}): {}",
            own.rank,
            own.local_rank,
            own.status,
            own.headline()
        ))
    }

    /// The one line every node logs when it learns the attempt's root cause.
    pub fn log_line(&self, restart_count: u32) -> String {
        let mut line = format!(
            "attempt {restart_count}: first failure in the gang: {}",
            self.root.describe()
        );
        if let Some(followed) = self.followed() {
            line.push_str("; then ");
            line.push_str(&followed);
        }
        line
    }
}

fn human_ms(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn posted(node: u32, rank: u32, error: &str, at: u64) -> PostedFailure {
        PostedFailure {
            node_rank: node,
            host: format!("host-{node}"),
            rank,
            local_rank: rank % 2,
            pid: 100 + rank,
            status: "exit code 1".into(),
            worker_exit_code: Some(1),
            signal: None,
            exit_code: 1,
            error: Some(error.into()),
            at_unix_ms: at,
        }
    }

    fn board(records: &[&PostedFailure]) -> Vec<(u64, Vec<u8>)> {
        records
            .iter()
            .zip(1..)
            .map(|(p, t)| (t, serde_json::to_vec(p).unwrap()))
            .collect()
    }

    const CLOSED: &str = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer [127.0.0.1]:4242";

    #[test]
    fn the_first_received_failure_is_the_root_cause_whatever_the_clocks_say() {
        // Node 1's clock runs 5 s behind node 0's: only the receive order counts.
        let a = posted(1, 3, "ValueError: bad shard 17", 10_000);
        let b = posted(0, 1, "KeyError: 'x'", 6_000);
        let cause = GangCause::pick(&board(&[&a, &b]), Some(&b), 0).unwrap();
        assert_eq!(cause.root, a);
        assert_eq!(cause.ticket, 1);
        assert!(cause.elsewhere());
        assert!(!GangCause::pick(&board(&[&a, &b]), None, 1)
            .unwrap()
            .elsewhere());
        let followed = cause.followed().unwrap();
        assert!(
            followed.contains("4.0 s earlier by the nodes' clocks"),
            "{followed}"
        );
    }

    #[test]
    fn a_peer_loss_symptom_yields_to_the_error_that_caused_it() {
        let symptom = posted(0, 1, CLOSED, 1_000);
        let cause_ = posted(
            1,
            3,
            "ValueError: the real cause: bad shard 17 on rank 3",
            960,
        );
        let cause = GangCause::pick(&board(&[&symptom, &cause_]), Some(&symptom), 0).unwrap();
        assert_eq!(cause.root, cause_);
        assert_eq!((cause.ticket, cause.passed_over), (2, 1));
        assert_eq!(
            cause.followed().unwrap(),
            format!(
                "rank 1 (local rank 1) on this node failed 40 ms later (exit code 1): {CLOSED}"
            )
        );
        let line = cause.log_line(0);
        assert!(
            line.starts_with("attempt 0: first failure in the gang: node 1 (host-1) rank 3 (local rank 1): exit code 1: ValueError: the real cause"),
            "{line}"
        );
    }

    #[test]
    fn when_every_failure_is_a_symptom_the_first_received_stands() {
        let a = posted(0, 1, CLOSED, 1_000);
        let b = posted(1, 2, "RuntimeError: Connection reset by peer", 990);
        let cause = GangCause::pick(&board(&[&a, &b]), None, 0).unwrap();
        assert_eq!((cause.root.node_rank, cause.passed_over), (0, 0));
        assert_eq!(cause.followed(), None);
    }

    #[test]
    fn this_nodes_own_root_cause_is_not_listed_as_what_followed() {
        let a = posted(0, 1, "ValueError: x", 1_000);
        let cause = GangCause::pick(&board(&[&a]), Some(&a), 0).unwrap();
        assert_eq!(cause.this_node, None);
        assert_eq!(cause.log_line(2), "attempt 2: first failure in the gang: node 0 (host-0) rank 1 (local rank 1): exit code 1: ValueError: x");
    }

    #[test]
    fn unreadable_records_are_skipped_and_an_empty_board_names_nobody() {
        assert_eq!(GangCause::pick(&[], None, 0), None);
        let a = posted(2, 5, "OSError: disk", 5);
        let mut records = vec![(1, b"{not json".to_vec())];
        records.extend(board(&[&a]).into_iter().map(|(_, v)| (2, v)));
        let cause = GangCause::pick(&records, None, 0).unwrap();
        assert_eq!((cause.root.rank, cause.ticket), (5, 2));
    }

    #[test]
    fn long_errors_are_cut_on_a_character_boundary() {
        let text = "é".repeat(MAX_ERROR_BYTES);
        let cut = truncate(&text, MAX_ERROR_BYTES + 1);
        assert!(cut.len() <= MAX_ERROR_BYTES + 4);
        assert!(cut.ends_with('…'));
    }
}
