//! The cross-node checkpoint barrier, over the agents' store.
//!
//! Theory of operation. A checkpoint request is one store key, created with COMPARE_SET so the
//! first trigger (SIGTERM on any node, `POST /checkpoint`) wins and later ones join it; every agent
//! watches that key, so a node that was never signalled learns of the request within a store
//! round trip. The request carries the triggering node's deadline; each agent works to the
//! earlier of that and its own.
//!
//! Then, per attempt `a` (an attempt is retried when a worker reports that the request reached it
//! after the target step):
//! 1. every agent SETs its progress (latest local step, smoothed step period) and ADDs one to a
//!    counter; the agent whose ADD completes the count reads every node's progress with one
//!    MULTI_GET and SETs the target step T — no leader, O(1) operations per node;
//! 2. every agent WAITs for T and tells its workers "save at T";
//! 3. when all of its local ranks confirmed, an agent ADDs its local world size to the done
//!    counter; the agent whose ADD reaches the world size writes the verdict "commit T";
//! 4. the verdict key is written with COMPARE_SET from an empty value, so exactly one verdict
//!    stands: "commit", "retry" (a worker missed T), or "abort" (a worker failed, or a deadline
//!    passed) — whichever came first.
//!
//! The decisions (which target, how much margin, what a worker event means) are pure functions
//! below, unit-tested without sockets.

use std::time::Duration;

/// Store keys of one job's checkpoint barrier.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `muster/<run_id>/ckpt/`.
    pub fn new(run_id: &str) -> Self {
        Self {
            prefix: format!("muster/{run_id}/ckpt"),
        }
    }

    /// The request: `<deadline_unix_ms> <node_rank> <reason>`.
    pub fn request(&self) -> Vec<u8> {
        format!("{}/request", self.prefix).into_bytes()
    }

    pub fn progress(&self, attempt: u32, node_rank: u32) -> Vec<u8> {
        format!("{}/{attempt}/progress/{node_rank}", self.prefix).into_bytes()
    }

    pub fn reported(&self, attempt: u32) -> Vec<u8> {
        format!("{}/{attempt}/reported", self.prefix).into_bytes()
    }

    pub fn target(&self, attempt: u32) -> Vec<u8> {
        format!("{}/{attempt}/target", self.prefix).into_bytes()
    }

    pub fn done(&self, attempt: u32) -> Vec<u8> {
        format!("{}/{attempt}/done", self.prefix).into_bytes()
    }

    pub fn verdict(&self, attempt: u32) -> Vec<u8> {
        format!("{}/{attempt}/verdict", self.prefix).into_bytes()
    }
}

/// A checkpoint request as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub deadline_unix_ms: u64,
    pub node_rank: u32,
    pub reason: String,
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{} {} {}",
            self.deadline_unix_ms, self.node_rank, self.reason
        )
        .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Option<Request> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut words = text.splitn(3, ' ');
        Some(Request {
            deadline_unix_ms: words.next()?.parse().ok()?,
            node_rank: words.next()?.parse().ok()?,
            reason: words.next().unwrap_or_default().to_owned(),
        })
    }
}

/// One node's report for the target agreement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeProgress {
    /// The highest step any local rank reported; `None` when no rank reported yet.
    pub max_step: Option<u64>,
    /// The smallest smoothed step period among local ranks.
    pub step_period: Option<Duration>,
}

impl NodeProgress {
    pub fn encode(&self) -> Vec<u8> {
        let step = self
            .max_step
            .map_or_else(|| "-".to_owned(), |s| s.to_string());
        let period = self
            .step_period
            .map_or_else(|| "-".to_owned(), |p| p.as_micros().to_string());
        format!("{step} {period}").into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Option<NodeProgress> {
        let text = std::str::from_utf8(bytes).ok()?;
        let (step, period) = text.split_once(' ')?;
        Some(NodeProgress {
            max_step: step.parse().ok(),
            step_period: period.parse().ok().map(Duration::from_micros),
        })
    }
}

/// The fewest steps between the furthest rank and the target, and the most.
const MIN_MARGIN_STEPS: u64 = 1;
const MAX_MARGIN_STEPS: u64 = 1_000;

/// How many steps ahead of the furthest rank the target must lie so that every rank hears of it
/// before reaching it: the time the agreement and the notification take, in steps, plus one.
/// `attempt` widens the margin after a miss (each retry doubles it).
pub fn margin_steps(step_period: Option<Duration>, notify_latency: Duration, attempt: u32) -> u64 {
    let base = match step_period {
        Some(period) if !period.is_zero() => {
            let steps = notify_latency.as_secs_f64() / period.as_secs_f64();
            (steps.ceil() as u64).saturating_add(1)
        }
        // Steps of unknown length (a single report so far): assume they are fast.
        _ => 2,
    };
    base.saturating_mul(1 << attempt.min(10))
        .clamp(MIN_MARGIN_STEPS, MAX_MARGIN_STEPS)
}

/// The step every rank saves at: past the furthest rank by the margin of the fastest stepper.
pub fn choose_target(nodes: &[NodeProgress], notify_latency: Duration, attempt: u32) -> u64 {
    let furthest = nodes.iter().filter_map(|n| n.max_step).max().unwrap_or(0);
    let fastest = nodes.iter().filter_map(|n| n.step_period).min();
    furthest + margin_steps(fastest, notify_latency, attempt)
}

/// The single outcome of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Commit { step: u64 },
    Retry { reason: String },
    Abort { reason: String },
}

impl Verdict {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Verdict::Commit { step } => format!("commit {step}"),
            Verdict::Retry { reason } => format!("retry {reason}"),
            Verdict::Abort { reason } => format!("abort {reason}"),
        }
        .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Option<Verdict> {
        let text = std::str::from_utf8(bytes).ok()?;
        let (kind, rest) = text.split_once(' ').unwrap_or((text, ""));
        match kind {
            "commit" => Some(Verdict::Commit {
                step: rest.trim().parse().ok()?,
            }),
            "retry" => Some(Verdict::Retry {
                reason: rest.to_owned(),
            }),
            "abort" => Some(Verdict::Abort {
                reason: rest.to_owned(),
            }),
            _ => None,
        }
    }
}

/// Abort reasons with this prefix mean "fall back to forwarding the signal".
pub const UNSUPPORTED_PREFIX: &str = "unsupported: ";

/// Plain words for the log: `commit at step 7`, `abort: <reason>`; an abort because some worker
/// does not use the helper says so instead of the wire's `unsupported: ` prefix.
impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Commit { step } => write!(f, "commit at step {step}"),
            Verdict::Retry { reason } => write!(f, "retry at a later step: {reason}"),
            Verdict::Abort { reason } => match reason.strip_prefix(UNSUPPORTED_PREFIX) {
                Some(why) => write!(f, "no checkpoint barrier: {why}"),
                None => write!(f, "abort: {reason}"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_leaves_room_for_the_notification() {
        let nodes = [
            NodeProgress {
                max_step: Some(100),
                step_period: Some(Duration::from_millis(10)),
            },
            NodeProgress {
                max_step: Some(101),
                step_period: Some(Duration::from_millis(20)),
            },
        ];
        // 50 ms to notify at 10 ms a step: 5 steps, plus one.
        assert_eq!(choose_target(&nodes, Duration::from_millis(50), 0), 107);
        // Each retry doubles the margin.
        assert_eq!(choose_target(&nodes, Duration::from_millis(50), 1), 113);
    }

    #[test]
    fn slow_steps_need_only_one_step_of_margin() {
        assert_eq!(
            margin_steps(Some(Duration::from_secs(2)), Duration::from_millis(50), 0),
            2
        );
        assert_eq!(margin_steps(None, Duration::from_millis(50), 0), 2);
        assert_eq!(
            margin_steps(Some(Duration::from_nanos(1)), Duration::from_secs(10), 0),
            MAX_MARGIN_STEPS
        );
    }

    #[test]
    fn no_progress_anywhere_targets_an_early_step() {
        let nodes = [NodeProgress {
            max_step: None,
            step_period: None,
        }];
        assert_eq!(choose_target(&nodes, Duration::from_millis(50), 0), 2);
    }

    #[test]
    fn records_round_trip() {
        let r = Request {
            deadline_unix_ms: 1_700_000_000_000,
            node_rank: 2,
            reason: "SIGTERM on node 2".into(),
        };
        assert_eq!(Request::decode(&r.encode()), Some(r));
        let p = NodeProgress {
            max_step: Some(7),
            step_period: Some(Duration::from_micros(1500)),
        };
        assert_eq!(NodeProgress::decode(&p.encode()), Some(p));
        let none = NodeProgress {
            max_step: None,
            step_period: None,
        };
        assert_eq!(NodeProgress::decode(&none.encode()), Some(none));
        for v in [
            Verdict::Commit { step: 9 },
            Verdict::Retry {
                reason: "rank 3 missed step 9".into(),
            },
            Verdict::Abort {
                reason: "deadline".into(),
            },
        ] {
            assert_eq!(Verdict::decode(&v.encode()), Some(v));
        }
        assert_eq!(Verdict::decode(b"bogus"), None);
    }

    #[test]
    fn verdicts_read_as_plain_words_in_the_log() {
        let unsupported = Verdict::Abort {
            reason: format!(
                "{UNSUPPORTED_PREFIX}the workers of node 1 do not use the checkpoint helper"
            ),
        };
        assert_eq!(
            unsupported.to_string(),
            "no checkpoint barrier: the workers of node 1 do not use the checkpoint helper"
        );
        let abort = Verdict::Abort {
            reason: "deadline".into(),
        };
        assert_eq!(abort.to_string(), "abort: deadline");
        assert_eq!(Verdict::Commit { step: 9 }.to_string(), "commit at step 9");
    }
}
