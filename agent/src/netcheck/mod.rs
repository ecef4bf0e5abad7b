//! The gang's network pre-flight (`--network-check off|warn|require`): after each rendezvous
//! round and before any worker starts, the agents measure the network among themselves over
//! plain TCP between their advertised addresses (the path MASTER_ADDR traffic takes) and name a
//! node or link far slower than the rest of the gang, before an NCCL timeout does it an hour in.
//!
//! # Theory of operation
//! - **Round 1** ([`plan::ring`]): every member measures one peer, the next one around the ring
//!   of group ranks, all at once: a few small ping-pongs (round-trip time) and one stream bounded
//!   in bytes and time (throughput, counted by the receiver). Every node sends once and receives
//!   once, so one round costs the same for 3 nodes or 300.
//! - **Round 2** ([`plan::second_round`]): node 0 pairs every suspect (a node whose every
//!   measurement was slow) with a node that had a fast one, and measures again each slow link
//!   between two unsuspected nodes; that tells a bad node (slow with everyone) from a bad link
//!   (slow between two nodes that are fast elsewhere) and from a passing hiccup.
//! - **Verdict** ([`verdict::judge`]): a pure function of the measurements with its reason.
//!   Every node's reference is its best measurement; the gang's reference is the median of
//!   those; a measurement is slow below [`Thresholds::throughput_ratio`] of it (or with a
//!   round-trip time above [`Thresholds::rtt_ratio`] times the median plus a slack). A uniformly
//!   slow network has a slow median and so no culprit.
//! - **Action** ([`verdict::decide`]): `warn` logs each finding; `require` ends the round for
//!   every node with exit code 208 naming the node(s) — or, with `--nnodes MIN:MAX` and enough
//!   nodes left, the named nodes leave and the rest form a new round without them.
//!
//! The exchange ([`gang`]) goes through the rendezvous store under the round's own keys; node 0
//! decides (the plan of round 2, the verdict) and the others follow, so every node acts on the
//! same verdict. The measurement listener ([`probe`]) lives only for the check, answers only
//! callers that present the round's token published in the store, and bounds what strangers can
//! hold. Each node tells observers what it measured and what the verdict said of it
//! ([`summary`]), through the event the gang rendezvous publishes.

pub mod gang;
pub mod plan;
pub mod probe;
pub mod summary;
pub mod verdict;

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `--network-check`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// No check.
    Off,
    /// Measure, log one line per finding, start the workers anyway (the default with >1 node).
    Warn,
    /// A finding ends the round (exit 208), or with MIN:MAX the named nodes leave.
    Require,
}

impl Mode {
    /// `off`, `warn`, `require`.
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "off" => Some(Self::Off),
            "warn" => Some(Self::Warn),
            "require" => Some(Self::Require),
            _ => None,
        }
    }

    /// The default: `warn` when the job may span more than one node, else `off` (one node has
    /// no network to measure).
    pub fn default_for(max_nodes: u32) -> Self {
        if max_nodes > 1 {
            Self::Warn
        } else {
            Self::Off
        }
    }
}

/// `--network-check-budget`'s default: the whole check, both rounds and the exchange.
pub const DEFAULT_BUDGET: Duration = Duration::from_secs(2);

/// When a measurement counts as slow. Set with `--network-check-conf key=value,...`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    /// `throughput_ratio`: slow below this fraction of the gang's reference throughput.
    /// 0.25: a link four times slower than the gang's typical one; the measurement noise of a
    /// loaded host stays well inside a factor of two.
    pub throughput_ratio: f64,
    /// `rtt_ratio`: slow when the round-trip time exceeds this multiple of the gang's median...
    pub rtt_ratio: f64,
    /// `rtt_slack_ms`: ...plus this much. Data-centre round trips are tens of microseconds, where
    /// a ratio alone would name scheduling noise; 5 ms is far above that noise and far below
    /// what makes a collective time out.
    pub rtt_slack: Duration,
    /// `min_mbps`: an absolute floor in MB/s (off by default: the relative rule needs no tuning
    /// per cluster). Needed to judge a two-node gang, which has nothing to compare with.
    pub min_mbps: Option<f64>,
    /// `max_rtt_ms`: an absolute ceiling (off by default).
    pub max_rtt: Option<Duration>,
    /// `cpu_wait_ratio`: a slow measurement during which the sender's or the receiver's agent
    /// spent this fraction of the time or more runnable but waiting for a CPU is set aside (a
    /// loaded host, not the network: [`verdict::Sample::cpu_wait_permille`]); 0 judges every
    /// measurement. 0.25: a stream that a loaded host kept off-CPU a quarter of the time.
    #[serde(default = "default_cpu_wait_ratio")]
    pub cpu_wait_ratio: f64,
}

fn default_cpu_wait_ratio() -> f64 {
    0.25
}

// Every number here is validated finite and non-negative ([`Settings::apply_conf`]), so
// equality is total (the launch configuration compares configurations).
impl Eq for Thresholds {}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            throughput_ratio: 0.25,
            rtt_ratio: 4.0,
            rtt_slack: Duration::from_millis(5),
            min_mbps: None,
            max_rtt: None,
            cpu_wait_ratio: default_cpu_wait_ratio(),
        }
    }
}

/// Everything the check needs from the command line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub mode: Mode,
    /// The longest the check may take, both rounds and the exchange (`--network-check-budget`).
    pub budget: Duration,
    pub thresholds: Thresholds,
    /// `stream_bytes`: the most one throughput stream sends. 16 MiB fills a 100 Gb/s link for
    /// about 1.3 ms and a slowed one for at most its share of the budget.
    pub stream_bytes: u64,
}

impl Eq for Settings {}

/// The default of `stream_bytes`.
pub const DEFAULT_STREAM_BYTES: u64 = 16 << 20;

impl Settings {
    /// The defaults for a job of at most `max_nodes` nodes.
    pub fn default_for(max_nodes: u32) -> Self {
        Self {
            mode: Mode::default_for(max_nodes),
            budget: DEFAULT_BUDGET,
            thresholds: Thresholds::default(),
            stream_bytes: DEFAULT_STREAM_BYTES,
        }
    }

    /// Applies `--network-check-conf k=v,...` (the `--rdzv-conf` syntax).
    pub fn apply_conf(&mut self, conf: &str) -> Result<(), String> {
        let pairs = rendezvous::rdzv::parse_conf(conf)
            .map_err(|e| e.to_string().replace("--rdzv-conf", "--network-check-conf"))?;
        for (key, value) in pairs {
            let number = || {
                value
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .ok_or_else(|| {
                        format!(
                            "--network-check-conf {key}={value}: expected a non-negative number"
                        )
                    })
            };
            // Milliseconds, through the one duration parser (range and syntax).
            let millis = || {
                rendezvous::seconds::parse(&format!("{value}ms"))
                    .map_err(|e| format!("--network-check-conf {key}={value}: milliseconds, {e}"))
            };
            let th = &mut self.thresholds;
            match key.as_str() {
                "throughput_ratio" => th.throughput_ratio = number()?,
                "rtt_ratio" => th.rtt_ratio = number()?,
                "rtt_slack_ms" => th.rtt_slack = millis()?,
                "min_mbps" => th.min_mbps = Some(number()?).filter(|v| *v > 0.0),
                "cpu_wait_ratio" => th.cpu_wait_ratio = number()?,
                "max_rtt_ms" => {
                    th.max_rtt = Some(millis()?).filter(|d| !d.is_zero());
                }
                "stream_bytes" => {
                    self.stream_bytes = value.parse::<u64>().ok().filter(|b| *b > 0).ok_or_else(
                        || format!("--network-check-conf {key}={value}: expected a positive byte count"),
                    )?;
                }
                _ => {
                    return Err(format!(
                        "--network-check-conf {key}: unknown key (throughput_ratio, rtt_ratio, rtt_slack_ms, min_mbps, max_rtt_ms, cpu_wait_ratio, stream_bytes)"
                    ))
                }
            }
        }
        if self.thresholds.throughput_ratio > 1.0 {
            return Err("--network-check-conf throughput_ratio must be at most 1".to_owned());
        }
        if self.thresholds.cpu_wait_ratio > 1.0 {
            return Err("--network-check-conf cpu_wait_ratio must be at most 1".to_owned());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_mode_follows_the_node_count() {
        assert_eq!(Mode::default_for(1), Mode::Off);
        assert_eq!(Mode::default_for(2), Mode::Warn);
        assert_eq!(Mode::parse(" require"), Some(Mode::Require));
        assert_eq!(Mode::parse("on"), None);
    }

    #[test]
    fn conf_keys_set_thresholds_and_bad_ones_are_named() {
        let mut s = Settings::default_for(4);
        s.apply_conf("throughput_ratio=0.5, rtt_slack_ms=1, min_mbps=100, stream_bytes=1024")
            .unwrap();
        assert!((s.thresholds.throughput_ratio - 0.5).abs() < f64::EPSILON);
        assert_eq!(s.thresholds.rtt_slack, Duration::from_millis(1));
        assert_eq!(s.thresholds.min_mbps, Some(100.0));
        assert_eq!(s.stream_bytes, 1024);
        let err = s.apply_conf("speed=3").unwrap_err();
        assert!(err.contains("speed: unknown key"), "{err}");
        let err = s.apply_conf("rtt_ratio=-1").unwrap_err();
        assert!(err.contains("rtt_ratio=-1"), "{err}");
        assert!(s.apply_conf("throughput_ratio=2").is_err());
        let mut s = Settings::default_for(4);
        assert!((s.thresholds.cpu_wait_ratio - 0.25).abs() < f64::EPSILON);
        s.apply_conf("cpu_wait_ratio=0").unwrap();
        assert!(s.thresholds.cpu_wait_ratio.abs() < f64::EPSILON);
        assert!(s.apply_conf("cpu_wait_ratio=1.5").is_err());
    }
}
