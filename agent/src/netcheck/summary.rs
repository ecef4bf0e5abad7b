//! What one node makes of node 0's report, for observers: its own measurements with each peer
//! (round-trip time, throughput, slow or not) and what the verdict says about the gang and about
//! this node. A pure function of the report, so metrics (or anything else that watches the
//! check) need no part of the verdict's logic.

use std::time::Duration;

use super::gang::Report;
use super::verdict::{node_rank_of, Sample};
use super::Thresholds;

/// Which way a measurement between this node and a peer went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// This node pinged the peer and sent it the stream.
    Out,
    /// The peer pinged this node and sent it the stream.
    In,
}

impl Direction {
    /// `out`, `in`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Out => "out",
            Self::In => "in",
        }
    }
}

/// One measurement between this node and a peer.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerMeasurement {
    /// The peer's node rank (stable across rounds, unlike its group rank).
    pub peer_node_rank: u32,
    pub direction: Direction,
    /// 1 or 2.
    pub round: u8,
    /// The shortest round-trip time; `None` when the measurement failed before any came back.
    pub rtt: Option<Duration>,
    /// What the receiver counted, per second (0 for a failed measurement).
    pub bytes_per_second: f64,
    /// Whether the gang's verdict counts it slow (or failed).
    pub slow: bool,
}

/// This node's view of one check.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Every measurement this node made or was the target of.
    pub peers: Vec<PeerMeasurement>,
    /// Slow nodes the verdict named.
    pub node_findings: u32,
    /// Slow links the verdict named.
    pub link_findings: u32,
    /// Whether a finding names this node (as a slow node or one end of a slow link).
    pub named: bool,
    /// Most measurements failed: the verdict names nobody and could not judge.
    pub inconclusive: bool,
}

impl Summary {
    /// `report` seen from the node of group rank `me`, judged with `thresholds` (the same ones
    /// node 0 judged with: every node of a job is started with the same flags).
    pub fn of(report: &Report, me: u32, thresholds: &Thresholds) -> Self {
        let c = report.classifier(thresholds);
        let peers = report
            .samples
            .iter()
            .filter_map(|s: &Sample| {
                let (peer, direction) = if s.from == me {
                    (s.to, Direction::Out)
                } else if s.to == me {
                    (s.from, Direction::In)
                } else {
                    return None;
                };
                Some(PeerMeasurement {
                    peer_node_rank: node_rank_of(&report.nodes, peer),
                    direction,
                    round: s.round,
                    rtt: s.rtt(),
                    // MB/s is 10⁶ bytes per second.
                    bytes_per_second: s.mbps() * 1e6,
                    slow: c.slow(s).is_some(),
                })
            })
            .collect();
        let findings = &report.verdict.findings;
        Self {
            peers,
            node_findings: report.counts.nodes,
            link_findings: report.counts.links,
            named: findings.iter().any(|f| f.ranks().contains(&me)),
            inconclusive: report.verdict.inconclusive,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netcheck::verdict::tests::s as sample;
    use crate::netcheck::verdict::{self, Action, NodeInfo};

    /// Four nodes whose node ranks differ from their group ranks (a re-formed gang); group rank
    /// 2 (node rank 7) is slow, and round 2 measured it again from node 0.
    fn report() -> Report {
        let nodes = [0, 3, 7, 5]
            .iter()
            .enumerate()
            .map(|(g, &r)| NodeInfo {
                group_rank: u32::try_from(g).unwrap(),
                node_rank: r,
                host: format!("worker-{r}"),
                addr: format!("10.0.0.{r}"),
            })
            .collect();
        let mut samples = vec![
            sample(0, 1, 1, 900, 60),
            sample(1, 2, 1, 1, 2_000),
            sample(2, 3, 1, 1, 2_100),
            sample(3, 0, 1, 880, 70),
            sample(0, 2, 2, 1, 1_900),
        ];
        samples.push(Sample::failed(2, 0, 2, "connection refused"));
        let thresholds = Thresholds::default();
        let verdict = verdict::judge(4, &samples, &thresholds);
        Report {
            reference: verdict::Classifier::new(4, &samples, &thresholds).reference(),
            counts: verdict::FindingCounts::of(&verdict.findings),
            nodes,
            samples,
            verdict,
            action: Action::Proceed,
            millis: 420,
        }
    }

    #[test]
    fn a_members_view_holds_everything_its_summary_needs() {
        let r = report();
        for g in 0..4 {
            let view = r.view_for(g);
            assert_eq!(
                Summary::of(&view, g, &Thresholds::default()),
                Summary::of(&r, g, &Thresholds::default()),
                "group rank {g}"
            );
            assert!(view.samples.iter().all(|s| s.from == g || s.to == g));
            assert_eq!(view.verdict, r.verdict);
        }
        // Group rank 1 measured 2 and was measured by 0; the finding names 2: nothing of 3.
        let ranks: Vec<u32> = r.view_for(1).nodes.iter().map(|n| n.group_rank).collect();
        assert_eq!(ranks, vec![0, 1, 2]);
    }

    #[test]
    fn a_node_sees_its_own_measurements_by_peer_node_rank() {
        let r = report();
        let me = Summary::of(&r, 0, &Thresholds::default());
        let view: Vec<(u32, Direction, u8, bool)> = me
            .peers
            .iter()
            .map(|p| (p.peer_node_rank, p.direction, p.round, p.slow))
            .collect();
        assert_eq!(
            view,
            vec![
                (3, Direction::Out, 1, false),
                (5, Direction::In, 1, false),
                (7, Direction::Out, 2, true),
                (7, Direction::In, 2, true),
            ]
        );
        assert_eq!(me.peers[0].rtt, Some(Duration::from_micros(60)));
        assert!((me.peers[0].bytes_per_second - 900e6).abs() < 1.0);
        // The failed measurement: no round-trip time, nothing counted.
        assert_eq!(me.peers[3].rtt, None);
        assert!(me.peers[3].bytes_per_second.abs() < f64::EPSILON);
        assert_eq!((me.node_findings, me.link_findings), (1, 0));
        assert!(!me.named);
    }

    #[test]
    fn the_slow_node_knows_it_was_named() {
        let r = report();
        let slow = Summary::of(&r, 2, &Thresholds::default());
        assert!(slow.named);
        assert_eq!(slow.peers.len(), 4);
        assert!(slow.peers.iter().all(|p| p.slow), "{slow:?}");
    }
}
