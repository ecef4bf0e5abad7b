//! The verdict: a pure function of the gang's measurements that names a slow node or link, with
//! the reason, and the action the mode asks for. No I/O here; [`super::gang`] feeds it.
//!
//! # The rule
//! A node's reference is its best measurement (highest throughput, lowest round-trip time) with
//! anyone; the gang's reference is the median of the nodes' references. A measurement is slow
//! when it failed, when its throughput is below `throughput_ratio` of the gang's reference (or
//! below the absolute `min_mbps`), or when its round-trip time is above `rtt_ratio` times the
//! gang's plus `rtt_slack` (or above the absolute `max_rtt_ms`).
//! - A **bad node** is one whose every measurement was slow, at least one of them with a node
//!   that was fast with someone: the slowness follows it, not its partners.
//! - A **bad link** is a pair of nodes, neither of them bad, whose every measurement between
//!   them was slow (round 2 measures every slow pair again, so one hiccup is not a finding).
//!
//! The references come from round 1 alone, where every node carries the same load (one stream
//! out, one in); round 2's lighter load can only make a measurement look better.
//! - A **uniformly slow** network has a slow median, so nothing is far below it: no culprit.
//!   Only the absolute thresholds judge such a network (and a two-node gang).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Mode, Thresholds};

/// One member of the round, as the check names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Position in the round (0 is node 0, the store host).
    pub group_rank: u32,
    pub node_rank: u32,
    pub host: String,
    /// The advertised address (what the peers connect to).
    pub addr: String,
}

impl NodeInfo {
    /// `node rank 2 (worker-2, 10.0.0.3)`.
    pub fn name(&self) -> String {
        format!(
            "node rank {} ({}, {})",
            self.node_rank, self.host, self.addr
        )
    }
}

/// One measurement: `from` connected to `to` and sent the stream to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub from: u32,
    pub to: u32,
    /// 1 or 2.
    pub round: u8,
    /// The shortest round-trip time of the small messages, in microseconds: a scheduling
    /// hiccup lengthens one of them, a slow path all of them.
    pub rtt_us: Option<u64>,
    /// Bytes the receiver counted, over `micros` (first byte to last).
    pub bytes: u64,
    pub micros: u64,
    /// Why the measurement failed (unreachable, refused, out of time), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The larger share of the measurement's time (per mille) that the sender's or the
    /// receiver's agent spent runnable but waiting for a CPU ([`super::probe::CpuWait`]): a
    /// measurement slowed by its own host's load, not by the network. `None`: not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_wait_permille: Option<u32>,
}

impl Sample {
    /// A measurement that could not be made.
    pub fn failed(from: u32, to: u32, round: u8, error: impl Into<String>) -> Self {
        Self {
            from,
            to,
            round,
            rtt_us: None,
            bytes: 0,
            micros: 0,
            error: Some(error.into()),
            cpu_wait_permille: None,
        }
    }

    /// Whether its agents waited for a CPU at least `ratio` of its time, so that a slow result
    /// says nothing of the network (`cpu_wait_ratio`; 0: never).
    pub fn cpu_starved(&self, ratio: f64) -> bool {
        ratio > 0.0
            && self
                .cpu_wait_permille
                .is_some_and(|p| f64::from(p) >= ratio * 1000.0)
    }

    /// Throughput in MB/s (10⁶ bytes per second); 0 for a failed one.
    pub fn mbps(&self) -> f64 {
        if self.error.is_some() || self.micros == 0 {
            return 0.0;
        }
        self.bytes as f64 / self.micros as f64
    }

    pub fn rtt(&self) -> Option<Duration> {
        self.rtt_us.map(Duration::from_micros)
    }

    fn touches(&self, node: u32) -> bool {
        self.from == node || self.to == node
    }

    fn between(&self, a: u32, b: u32) -> bool {
        (self.from == a && self.to == b) || (self.from == b && self.to == a)
    }

    /// `12.3 MB/s, rtt 0.21 ms` or `failed: connection refused`.
    pub fn describe(&self) -> String {
        match &self.error {
            Some(e) => format!("failed: {e}"),
            None => match self.rtt() {
                Some(rtt) => format!("{:.1} MB/s, rtt {:.2} ms", self.mbps(), ms(rtt)),
                None => format!("{:.1} MB/s", self.mbps()),
            },
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The node rank of group rank `g` among `nodes` (`g` itself for a node that published nothing).
pub fn node_rank_of(nodes: &[NodeInfo], g: u32) -> u32 {
    nodes
        .iter()
        .find(|n| n.group_rank == g)
        .map_or(g, |n| n.node_rank)
}

/// The gang's references as node 0 computed them from every measurement: a member judges its
/// own measurements against these, having only its own.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Reference {
    pub mbps: Option<f64>,
    pub rtt_us: Option<u64>,
}

/// The gang's references and the thresholds: tells a slow measurement from a normal one.
#[derive(Debug, Clone, PartialEq)]
pub struct Classifier {
    /// Median over the nodes of each node's best throughput (MB/s).
    pub reference_mbps: Option<f64>,
    /// Median over the nodes of each node's best round-trip time.
    pub reference_rtt: Option<Duration>,
    pub thresholds: Thresholds,
}

impl Classifier {
    /// The references of `n` nodes' measurements, from round 1 alone: there every node sends
    /// one stream and receives one, all at once, so each measurement bears the same load. Round
    /// 2's measurements run with fewer beside them and would raise the bar for round 1's.
    pub fn new(n: u32, samples: &[Sample], thresholds: &Thresholds) -> Self {
        let mut best_mbps = Vec::new();
        let mut best_rtt = Vec::new();
        for node in 0..n {
            let mine = samples.iter().filter(|s| s.round == 1 && s.touches(node));
            if let Some(b) = mine
                .clone()
                .filter(|s| s.error.is_none())
                .map(Sample::mbps)
                .reduce(f64::max)
            {
                best_mbps.push(b);
            }
            if let Some(r) = mine.filter_map(Sample::rtt).min() {
                best_rtt.push(r);
            }
        }
        best_mbps.sort_by(f64::total_cmp);
        best_rtt.sort();
        Self {
            reference_mbps: median_f64(&best_mbps),
            reference_rtt: median_duration(&best_rtt),
            thresholds: thresholds.clone(),
        }
    }

    /// A classifier with references already computed (by node 0, from the whole gang).
    pub fn from_reference(reference: Reference, thresholds: &Thresholds) -> Self {
        Self {
            reference_mbps: reference.mbps,
            reference_rtt: reference.rtt_us.map(Duration::from_micros),
            thresholds: thresholds.clone(),
        }
    }

    /// The references, to publish with the verdict.
    pub fn reference(&self) -> Reference {
        Reference {
            mbps: self.reference_mbps,
            rtt_us: self
                .reference_rtt
                .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
        }
    }

    /// Why `s` is slow, or `None` when it is not.
    pub fn slow(&self, s: &Sample) -> Option<String> {
        if let Some(e) = &s.error {
            return Some(format!("failed: {e}"));
        }
        let th = &self.thresholds;
        let mbps = s.mbps();
        if let Some(reference) = self.reference_mbps {
            if mbps < reference * th.throughput_ratio {
                return Some(format!(
                    "{mbps:.1} MB/s against a gang median of {reference:.1} MB/s (slow below {:.0}%)",
                    th.throughput_ratio * 100.0
                ));
            }
        }
        if let Some(floor) = th.min_mbps.filter(|f| mbps < *f) {
            return Some(format!("{mbps:.1} MB/s, below min_mbps {floor:.1}"));
        }
        let rtt = s.rtt()?;
        if let Some(reference) = self.reference_rtt {
            let limit = reference.mul_f64(th.rtt_ratio) + th.rtt_slack;
            if rtt > limit {
                return Some(format!(
                    "rtt {:.2} ms against a gang median of {:.2} ms (slow above {:.2} ms)",
                    ms(rtt),
                    ms(reference),
                    ms(limit)
                ));
            }
        }
        if let Some(max) = th.max_rtt.filter(|m| rtt > *m) {
            return Some(format!(
                "rtt {:.2} ms, above max_rtt_ms {:.2}",
                ms(rtt),
                ms(max)
            ));
        }
        None
    }

    /// What `s` says of the network: fast, slow (why), or nothing (slow, but its agents were
    /// starved of CPU: [`Sample::cpu_starved`]). A quarter of a stream spent off-CPU makes even
    /// a fast loopback look several times slower (a stream on loopback is all CPU: both ends
    /// copy), while an agent waiting on a slow link sleeps and barely waits at all.
    pub fn evidence(&self, s: &Sample) -> Evidence {
        match self.slow(s) {
            None => Evidence::Fast,
            // A failure is no slow stream: it is evidence whatever the load.
            Some(_) if s.error.is_none() && s.cpu_starved(self.thresholds.cpu_wait_ratio) => {
                Evidence::Unsure
            }
            Some(why) => Evidence::Slow(why),
        }
    }

    /// Whether `samples` are slow: at least one slow and none fast (a measurement whose slowness
    /// its host's load explains is set aside).
    pub fn stays_slow<'a>(&self, samples: impl IntoIterator<Item = &'a Sample>) -> bool {
        let mut slow = false;
        for s in samples {
            match self.evidence(s) {
                Evidence::Fast => return false,
                Evidence::Slow(_) => slow = true,
                Evidence::Unsure => {}
            }
        }
        slow
    }

    /// Nodes whose every measurement was slow (at least one, leaving aside those their hosts'
    /// load explains): the suspects.
    pub fn all_slow(&self, n: u32, samples: &[Sample]) -> BTreeSet<u32> {
        (0..n)
            .filter(|node| self.stays_slow(samples.iter().filter(|s| s.touches(*node))))
            .collect()
    }
}

/// What one measurement says of the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    Fast,
    Slow(String),
    /// Slow, but its agents waited for a CPU for much of it: a loaded host, not the network.
    Unsure,
}

fn median_f64(sorted: &[f64]) -> Option<f64> {
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[n / 2]),
        n => Some(f64::midpoint(sorted[n / 2 - 1], sorted[n / 2])),
    }
}

fn median_duration(sorted: &[Duration]) -> Option<Duration> {
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[n / 2]),
        n => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2),
    }
}

/// What the check found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// Slow with every partner (group rank).
    Node { rank: u32, reason: String },
    /// Slow between two nodes that are fast elsewhere (group ranks, `a < b`).
    Link { a: u32, b: u32, reason: String },
}

impl Finding {
    /// The group ranks it names.
    pub fn ranks(&self) -> Vec<u32> {
        match self {
            Self::Node { rank, .. } => vec![*rank],
            Self::Link { a, b, .. } => vec![*a, *b],
        }
    }

    /// The log line's text: `slow node: node rank 2 (worker-2, 10.0.0.3): ...`.
    pub fn message(&self, nodes: &[NodeInfo]) -> String {
        let name = |r: u32| {
            nodes
                .iter()
                .find(|n| n.group_rank == r)
                .map_or_else(|| format!("group rank {r}"), NodeInfo::name)
        };
        match self {
            Self::Node { rank, reason } => format!("slow node: {}: {reason}", name(*rank)),
            Self::Link { a, b, reason } => {
                format!("slow link between {} and {}: {reason}", name(*a), name(*b))
            }
        }
    }
}

/// How many findings of each kind a verdict has (a member's view lists only some of them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FindingCounts {
    pub nodes: u32,
    pub links: u32,
}

impl FindingCounts {
    pub fn of(findings: &[Finding]) -> Self {
        let links = findings
            .iter()
            .filter(|f| matches!(f, Finding::Link { .. }))
            .count();
        Self {
            nodes: u32::try_from(findings.len() - links).unwrap_or(u32::MAX),
            links: u32::try_from(links).unwrap_or(u32::MAX),
        }
    }

    pub fn total(self) -> u32 {
        self.nodes.saturating_add(self.links)
    }
}

/// The most findings an action's message (and so the exit message and the generation record
/// every node reads) spells out; node 0's log lists them all.
pub const MESSAGE_FINDINGS: usize = 8;

/// The verdict and its reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub findings: Vec<Finding>,
    /// One line: the references, and what was found or that nothing was.
    pub reason: String,
    /// Most measurements of a gang of 4 or more failed: nothing can be blamed on a node or a
    /// link (no findings), and the network (or the check's budget) is not fit to start on.
    #[serde(default)]
    pub inconclusive: bool,
}

/// Below this many nodes, one unreachable node fails most of the ring's measurements by itself
/// and is still named.
const INCONCLUSIVE_MIN_NODES: u32 = 4;

/// Judges `samples` of a round of `n` nodes.
pub fn judge(n: u32, samples: &[Sample], thresholds: &Thresholds) -> Verdict {
    let c = Classifier::new(n, samples, thresholds);
    let suspects = c.all_slow(n, samples);
    let mut findings = Vec::new();
    for &node in &suspects {
        let mine: Vec<&Sample> = samples.iter().filter(|s| s.touches(node)).collect();
        // Blame the node only when a partner was fast elsewhere; else the slowness is shared.
        let witnessed = mine.iter().any(|s| {
            let other = if s.from == node { s.to } else { s.from };
            !suspects.contains(&other)
        });
        if !witnessed {
            continue;
        }
        let what: Vec<String> = mine
            .iter()
            .map(|s| {
                let mut why = c.slow(s).unwrap_or_default();
                if c.evidence(s) == Evidence::Unsure {
                    why.push_str(" (set aside: its agents waited for a CPU)");
                }
                if s.from == node {
                    format!("to group rank {}: {why}", s.to)
                } else {
                    format!("from group rank {}: {why}", s.from)
                }
            })
            .collect();
        findings.push(Finding::Node {
            rank: node,
            reason: what.join("; "),
        });
    }
    let blamed: BTreeSet<u32> = findings.iter().flat_map(Finding::ranks).collect();
    let mut pairs: BTreeSet<(u32, u32)> = BTreeSet::new();
    for s in samples {
        let pair = (s.from.min(s.to), s.from.max(s.to));
        if blamed.contains(&pair.0) || blamed.contains(&pair.1) || pairs.contains(&pair) {
            continue;
        }
        let between: Vec<&Sample> = samples
            .iter()
            .filter(|x| x.between(pair.0, pair.1))
            .collect();
        if c.stays_slow(between.iter().copied()) {
            pairs.insert(pair);
            let what: Vec<String> = between
                .iter()
                .map(|x| {
                    format!(
                        "{}→{} round {}: {}",
                        x.from,
                        x.to,
                        x.round,
                        c.slow(x).unwrap_or_default()
                    )
                })
                .collect();
            findings.push(Finding::Link {
                a: pair.0,
                b: pair.1,
                reason: what.join("; "),
            });
        }
    }
    let mut reason = format!(
        "{n} nodes, {} measurements, gang median {}",
        samples.len(),
        c.reference_mbps
            .map_or_else(|| "unknown".to_owned(), |m| format!("{m:.1} MB/s")),
    );
    if let Some(rtt) = c.reference_rtt {
        let _ = write!(reason, ", rtt {:.2} ms", ms(rtt));
    }
    let set_aside = samples
        .iter()
        .filter(|s| c.evidence(s) == Evidence::Unsure)
        .count();
    if set_aside > 0 {
        let _ = write!(
            reason,
            ", {set_aside} slow measurement(s) set aside (their agents waited for a CPU for {:.0}% \
             or more of it: a loaded host, not the network)",
            c.thresholds.cpu_wait_ratio * 100.0
        );
    }
    // Failures count as slow whatever the gang's median, so when most measurements failed
    // (a partitioned network, or hosts too loaded to answer within the budget) the rules would
    // name most of the gang: blaming hundreds of nodes helps nobody.
    let first_round: Vec<&Sample> = samples.iter().filter(|s| s.round == 1).collect();
    let failed = first_round.iter().filter(|s| s.error.is_some()).count();
    let inconclusive = n >= INCONCLUSIVE_MIN_NODES && failed * 2 > first_round.len();
    if inconclusive {
        findings.clear();
        let example = first_round
            .iter()
            .find_map(|s| {
                s.error
                    .as_ref()
                    .map(|e| format!("{}→{}: {e}", s.from, s.to))
            })
            .unwrap_or_default();
        let _ = write!(
            reason,
            ": inconclusive: {failed} of {} round-1 measurements failed (e.g. {example}), too many to blame a node or link: a partitioned network, or hosts too loaded to answer within the check's budget",
            first_round.len()
        );
    } else if findings.is_empty() {
        reason.push_str(": no slow node or link");
    } else {
        let _ = write!(reason, ": {} finding(s)", findings.len());
    }
    Verdict {
        findings,
        reason,
        inconclusive,
    }
}

/// What the gang does about a verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Start the workers (no finding, or `warn`).
    Proceed,
    /// `require`: every node ends with exit 208 and this message.
    End { message: String },
    /// `require` with MIN:MAX: these group ranks leave (exit 208 with the message), the others
    /// form a new round without them.
    Leave { ranks: Vec<u32>, message: String },
}

/// The action for `verdict` under `mode`, in a round of `nodes` with `--nnodes MIN:MAX`.
/// Under `require`, the named nodes leave when the job is elastic, node 0 (the store host,
/// which cannot leave without ending the job) is not among them and at least MIN nodes remain;
/// a bad link between two good nodes costs the one with the higher node rank. Else the round
/// ends for everyone.
pub fn decide(
    mode: Mode,
    verdict: &Verdict,
    nodes: &[NodeInfo],
    min_nodes: u32,
    max_nodes: u32,
) -> Action {
    if mode != Mode::Require {
        return Action::Proceed;
    }
    if verdict.inconclusive {
        return Action::End {
            message: format!("network check failed: {}", verdict.reason),
        };
    }
    if verdict.findings.is_empty() {
        return Action::Proceed;
    }
    let mut lines: Vec<String> = verdict
        .findings
        .iter()
        .take(MESSAGE_FINDINGS)
        .map(|f| f.message(nodes))
        .collect();
    if verdict.findings.len() > MESSAGE_FINDINGS {
        lines.push(format!(
            "and {} more (node 0's log lists them all)",
            verdict.findings.len() - MESSAGE_FINDINGS
        ));
    }
    let message = format!("network check failed: {}", lines.join(" | "));
    let node_rank = |g: u32| node_rank_of(nodes, g);
    let leaving: BTreeSet<u32> = verdict
        .findings
        .iter()
        .map(|f| match f {
            Finding::Node { rank, .. } => *rank,
            Finding::Link { a, b, .. } => {
                if node_rank(*a) > node_rank(*b) {
                    *a
                } else {
                    *b
                }
            }
        })
        .collect();
    let remaining = (nodes.len() as u32).saturating_sub(leaving.len() as u32);
    if min_nodes < max_nodes && !leaving.contains(&0) && remaining >= min_nodes {
        return Action::Leave {
            ranks: leaving.into_iter().collect(),
            message,
        };
    }
    Action::End { message }
}

/// A plain-text table of every measurement (node 0 logs it; `muster dry-run` shows it).
pub fn table(nodes: &[NodeInfo], samples: &[Sample], c: &Classifier) -> String {
    let name = |r: u32| {
        nodes.iter().find(|n| n.group_rank == r).map_or_else(
            || format!("g{r}"),
            |n| format!("{} ({})", n.node_rank, n.host),
        )
    };
    let mut out =
        String::from("round  from -> to                      MB/s      rtt ms  verdict\n");
    for s in samples {
        let pair = format!("{} -> {}", name(s.from), name(s.to));
        let rtt = s
            .rtt()
            .map_or_else(|| "-".to_owned(), |r| format!("{:.2}", ms(r)));
        let verdict = match (&s.error, c.evidence(s)) {
            (Some(e), _) => format!("failed: {e}"),
            (None, Evidence::Slow(_)) => "slow".to_owned(),
            (None, Evidence::Unsure) => format!(
                "slow, set aside (waited for a CPU {}% of it)",
                s.cpu_wait_permille.unwrap_or_default() / 10
            ),
            (None, Evidence::Fast) => "ok".to_owned(),
        };
        let _ = writeln!(
            out,
            "{:<6} {pair:<30} {:>9.1} {rtt:>9}  {verdict}",
            s.round,
            s.mbps()
        );
    }
    out
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A measurement of `mbps` MB/s and `rtt_us` µs, as a recorded stream of one second.
    pub(in crate::netcheck) fn s(from: u32, to: u32, round: u8, mbps: u64, rtt_us: u64) -> Sample {
        Sample {
            from,
            to,
            round,
            rtt_us: Some(rtt_us),
            bytes: mbps * 1_000_000,
            micros: 1_000_000,
            error: None,
            cpu_wait_permille: None,
        }
    }

    fn nodes(n: u32) -> Vec<NodeInfo> {
        (0..n)
            .map(|r| NodeInfo {
                group_rank: r,
                node_rank: r,
                host: format!("worker-{r}"),
                addr: format!("10.0.0.{}", r + 1),
            })
            .collect()
    }

    /// Recorded on the bridge test: 6 nodes, node 3's veth limited to 10 Mbit/s by tbf.
    fn one_bad_node() -> Vec<Sample> {
        vec![
            s(0, 1, 1, 900, 60),
            s(1, 2, 1, 870, 55),
            s(2, 3, 1, 1, 2_100),
            s(3, 4, 1, 1, 1_900),
            s(4, 5, 1, 910, 70),
            s(5, 0, 1, 880, 65),
            // Round 2: node 3 with a node fast elsewhere.
            s(3, 0, 2, 1, 2_000),
        ]
    }

    #[test]
    fn one_bad_node_is_named_with_what_was_measured() {
        let v = judge(6, &one_bad_node(), &Thresholds::default());
        assert_eq!(v.findings.len(), 1, "{v:?}");
        let Finding::Node { rank, reason } = &v.findings[0] else {
            panic!("{v:?}");
        };
        assert_eq!(*rank, 3);
        assert!(
            reason.contains("to group rank 4: 1.0 MB/s against a gang median of"),
            "{reason}"
        );
        assert!(reason.contains("from group rank 2"), "{reason}");
        let msg = v.findings[0].message(&nodes(6));
        assert!(
            msg.starts_with("slow node: node rank 3 (worker-3, 10.0.0.4): "),
            "{msg}"
        );
        assert!(v.reason.ends_with("1 finding(s)"), "{}", v.reason);
    }

    /// `s`, with its agents having waited for a CPU `permille` of its time.
    fn waited(mut sample: Sample, permille: u32) -> Sample {
        sample.cpu_wait_permille = Some(permille);
        sample
    }

    #[test]
    fn a_slow_measurement_of_a_starved_agent_is_set_aside_and_a_slow_link_is_not() {
        // Measured on one loaded host: node 2's agent barely ran during its streams (three
        // loopback nodes beside CPU-bound neighbours: 23.6 MB/s against 1340).
        let starved = vec![
            s(0, 1, 1, 1_340, 20),
            waited(s(1, 2, 1, 24, 20), 870),
            waited(s(2, 0, 1, 29, 20), 910),
            waited(s(1, 2, 2, 43, 20), 640),
            s(2, 1, 2, 1_200, 20),
        ];
        let v = judge(3, &starved, &Thresholds::default());
        assert!(v.findings.is_empty(), "{v:?}");
        assert!(
            v.reason.contains("3 slow measurement(s) set aside")
                && v.reason.ends_with("no slow node or link"),
            "{}",
            v.reason
        );
        // Even with nothing fast beside it: unsure is not slow.
        let all_starved: Vec<Sample> = starved
            .iter()
            .filter(|x| x.cpu_wait_permille.is_some())
            .cloned()
            .collect();
        let c = Classifier::new(3, &starved, &Thresholds::default());
        assert!(!c.stays_slow(&all_starved));
        assert!(c.all_slow(3, &all_starved).is_empty());
        // A slow link whose agents were scheduled (a waiting sender sleeps) is still named, and
        // a little wait (under the quarter) does not excuse it.
        let mut bad = one_bad_node();
        for x in &mut bad {
            x.cpu_wait_permille = Some(if x.mbps() < 10.0 { 200 } else { 900 });
        }
        let v = judge(6, &bad, &Thresholds::default());
        assert_eq!(
            v.findings
                .iter()
                .flat_map(Finding::ranks)
                .collect::<Vec<_>>(),
            [3]
        );
        // A failure is evidence whatever the load.
        let failed = waited(Sample::failed(1, 2, 1, "refused"), 1000);
        assert_eq!(
            c.evidence(&failed),
            Evidence::Slow("failed: refused".into())
        );
    }

    #[test]
    fn one_bad_link_is_a_link_not_a_node() {
        // 2→3 is slow in both rounds; 2 and 3 are fast with everyone else.
        let samples = vec![
            s(0, 1, 1, 900, 60),
            s(1, 2, 1, 870, 55),
            s(2, 3, 1, 3, 80),
            s(3, 4, 1, 890, 60),
            s(4, 0, 1, 910, 70),
            s(2, 3, 2, 4, 75),
        ];
        let v = judge(5, &samples, &Thresholds::default());
        assert_eq!(v.findings.len(), 1, "{v:?}");
        assert!(
            matches!(&v.findings[0], Finding::Link { a: 2, b: 3, reason } if reason.contains("2→3 round 2: 4.0 MB/s")),
            "{v:?}"
        );
    }

    #[test]
    fn a_hiccup_that_round_2_does_not_repeat_is_no_finding() {
        let samples = vec![
            s(0, 1, 1, 900, 60),
            s(1, 2, 1, 3, 55),
            s(2, 3, 1, 890, 60),
            s(3, 0, 1, 910, 70),
            s(1, 2, 2, 850, 60),
        ];
        assert!(judge(4, &samples, &Thresholds::default())
            .findings
            .is_empty());
    }

    #[test]
    fn a_uniformly_slow_network_has_no_culprit() {
        let samples: Vec<Sample> = (0..8)
            .map(|r| s(r, (r + 1) % 8, 1, 2 + u64::from(r % 2), 900))
            .collect();
        let v = judge(8, &samples, &Thresholds::default());
        assert!(v.findings.is_empty(), "{v:?}");
        assert!(v.reason.ends_with("no slow node or link"), "{}", v.reason);
        // Only an absolute floor judges it, and then every link is named (no node stands out).
        let th = Thresholds {
            min_mbps: Some(100.0),
            ..Thresholds::default()
        };
        let v = judge(8, &samples, &th);
        assert_eq!(v.findings.len(), 8);
        assert!(v.findings.iter().all(|f| matches!(f, Finding::Link { .. })));
    }

    #[test]
    fn a_high_round_trip_time_is_slow_and_an_unreachable_node_is_bad() {
        let mut samples = vec![
            s(0, 1, 1, 900, 60),
            s(1, 2, 1, 900, 40_000),
            s(2, 3, 1, 900, 41_000),
            s(3, 0, 1, 900, 70),
        ];
        let v = judge(4, &samples, &Thresholds::default());
        assert!(
            matches!(&v.findings[..], [Finding::Node { rank: 2, reason }] if reason.contains("rtt 40.00 ms")),
            "{v:?}"
        );
        samples[1] = Sample::failed(1, 2, 1, "connection refused");
        samples[2] = Sample::failed(2, 3, 1, "no reply within 0.4 s");
        let v = judge(4, &samples, &Thresholds::default());
        assert!(
            matches!(&v.findings[..], [Finding::Node { rank: 2, reason }] if reason.contains("connection refused")),
            "{v:?}"
        );
    }

    #[test]
    fn require_ends_the_round_or_lets_the_culprit_leave() {
        let v = judge(6, &one_bad_node(), &Thresholds::default());
        let n = nodes(6);
        assert_eq!(decide(Mode::Warn, &v, &n, 6, 6), Action::Proceed);
        let Action::End { message } = decide(Mode::Require, &v, &n, 6, 6) else {
            panic!()
        };
        assert!(
            message.starts_with("network check failed: slow node: node rank 3 (worker-3"),
            "{message}"
        );
        assert!(
            matches!(decide(Mode::Require, &v, &n, 4, 6), Action::Leave { ranks, .. } if ranks == vec![3])
        );
        // Leaving would drop below MIN: everyone ends instead.
        assert!(matches!(
            decide(Mode::Require, &v, &n, 6, 8),
            Action::End { .. }
        ));
        let clean = judge(
            2,
            &[s(0, 1, 1, 900, 60), s(1, 0, 1, 900, 60)],
            &Thresholds::default(),
        );
        assert_eq!(
            decide(Mode::Require, &clean, &nodes(2), 2, 2),
            Action::Proceed
        );
    }

    #[test]
    fn node_0_never_leaves_and_a_bad_link_costs_the_higher_node_rank() {
        let v = Verdict {
            findings: vec![Finding::Link {
                a: 1,
                b: 2,
                reason: String::new(),
            }],
            reason: String::new(),
            inconclusive: false,
        };
        assert!(
            matches!(decide(Mode::Require, &v, &nodes(4), 2, 4), Action::Leave { ranks, .. } if ranks == vec![2])
        );
        let v = Verdict {
            findings: vec![Finding::Node {
                rank: 0,
                reason: String::new(),
            }],
            reason: String::new(),
            inconclusive: false,
        };
        assert!(matches!(
            decide(Mode::Require, &v, &nodes(4), 2, 4),
            Action::End { .. }
        ));
    }

    #[test]
    fn when_most_measurements_failed_nobody_is_blamed_and_require_ends_the_round() {
        // Eight nodes, five of whose ring measurements ran out of time.
        let samples: Vec<Sample> = (0..8)
            .map(|r| {
                if r < 5 {
                    Sample::failed(r, (r + 1) % 8, 1, "out of time")
                } else {
                    s(r, (r + 1) % 8, 1, 900, 60)
                }
            })
            .collect();
        let v = judge(8, &samples, &Thresholds::default());
        assert!(v.inconclusive && v.findings.is_empty(), "{v:?}");
        assert!(
            v.reason.contains(
                "inconclusive: 5 of 8 round-1 measurements failed (e.g. 0→1: out of time)"
            ),
            "{}",
            v.reason
        );
        assert_eq!(decide(Mode::Warn, &v, &nodes(8), 8, 8), Action::Proceed);
        assert!(matches!(
            decide(Mode::Require, &v, &nodes(8), 4, 8),
            Action::End { message } if message.contains("inconclusive")
        ));
        // Half failed, or a small gang with one unreachable node: still judged.
        let half: Vec<Sample> = samples
            .iter()
            .enumerate()
            .map(|(i, x)| {
                if i == 4 {
                    s(4, 5, 1, 900, 60)
                } else {
                    x.clone()
                }
            })
            .collect();
        assert!(!judge(8, &half, &Thresholds::default()).inconclusive);
        let three = [
            s(0, 1, 1, 900, 60),
            Sample::failed(1, 2, 1, "refused"),
            Sample::failed(2, 0, 1, "refused"),
        ];
        let v = judge(3, &three, &Thresholds::default());
        assert!(!v.inconclusive, "{v:?}");
    }

    #[test]
    fn a_failure_message_names_a_few_findings_and_counts_the_rest() {
        let v = Verdict {
            findings: (1..=20)
                .map(|rank| Finding::Node {
                    rank,
                    reason: "slow".to_owned(),
                })
                .collect(),
            reason: String::new(),
            inconclusive: false,
        };
        let Action::End { message } = decide(Mode::Require, &v, &nodes(21), 21, 21) else {
            panic!("a fixed-size gang ends the round");
        };
        assert_eq!(message.matches("slow node:").count(), MESSAGE_FINDINGS);
        assert!(
            message.ends_with("and 12 more (node 0's log lists them all)"),
            "{message}"
        );
        assert_eq!(
            FindingCounts::of(&v.findings),
            FindingCounts {
                nodes: 20,
                links: 0
            }
        );
    }

    #[test]
    fn the_table_lists_every_measurement() {
        let samples = one_bad_node();
        let c = Classifier::new(6, &samples, &Thresholds::default());
        let t = table(&nodes(6), &samples, &c);
        assert_eq!(t.lines().count(), 1 + samples.len());
        assert!(t.contains("3 (worker-3) -> 4 (worker-4)"), "{t}");
        assert_eq!(t.matches(" slow").count(), 3, "{t}");
    }
}
