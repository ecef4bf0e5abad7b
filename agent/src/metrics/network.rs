//! The gang's network check (`--network-check`) as this node saw it: `muster_network_check*`
//! and the per-peer measurements `muster_network_peer_*`.

use std::time::Duration;

use prometheus::{Gauge, GaugeVec, IntCounterVec, IntGauge, IntGaugeVec};

use super::{Defs, MAX_NETWORK_PEER_SERIES};
use crate::events::{self, NetworkCheckResult};
use crate::netcheck::summary::Summary;

/// The `result` label of `muster_network_checks_total`.
const NETWORK_CHECK_RESULTS: [&str; 4] = ["clean", "finding", "inconclusive", "no_verdict"];
/// The labels of a measurement between this node and a peer; node ranks are bounded by
/// `--nnodes`, and a check exports at most [`MAX_NETWORK_PEER_SERIES`] of them.
const NETWORK_PEER_LABELS: &[&str] = &["peer_node_rank", "direction", "round"];

/// The network check's counters and the last check's gauges.
pub(super) struct Network {
    checks: IntCounterVec,
    duration: Gauge,
    findings: IntGaugeVec,
    named: IntGauge,
    peer_rtt: GaugeVec,
    peer_throughput: GaugeVec,
    peer_slow: IntGaugeVec,
}

impl Network {
    /// Defines the family, every result and finding kind at 0.
    pub(super) fn register(defs: &mut Defs) -> Self {
        let network = Self {
            checks: defs.counter_vec(
                "muster_network_checks_total",
                "Gang network checks (--network-check) ended on this node, by result (clean, finding, inconclusive, no_verdict).",
                &["result"],
            ),
            duration: defs.gauge(
                "muster_network_check_duration_seconds",
                "How long the last gang network check took on this node.",
            ),
            findings: defs.int_gauge_vec(
                "muster_network_check_findings",
                "Slow nodes and links the last gang network check named, by kind (node, link).",
                &["kind"],
            ),
            named: defs.int_gauge(
                "muster_network_check_named",
                "1 when the last gang network check named this node (a slow node, or one end of a slow link).",
            ),
            peer_rtt: defs.gauge_vec(
                "muster_network_peer_rtt_seconds",
                "Shortest round-trip time of the last network check's measurement with a peer, by peer node rank, direction (out: this node measured; in: the peer did) and round.",
                NETWORK_PEER_LABELS,
            ),
            peer_throughput: defs.gauge_vec(
                "muster_network_peer_throughput_bytes_per_second",
                "Throughput of the last network check's stream with a peer (0: failed), by peer node rank, direction and round.",
                NETWORK_PEER_LABELS,
            ),
            peer_slow: defs.int_gauge_vec(
                "muster_network_peer_slow",
                "The last network check's verdict on a measurement with a peer (1 slow or failed, 0 ok), by peer node rank, direction and round.",
                NETWORK_PEER_LABELS,
            ),
        };
        for result in NETWORK_CHECK_RESULTS {
            network.checks.with_label_values(&[result]);
        }
        for kind in ["node", "link"] {
            network.findings.with_label_values(&[kind]);
        }
        network
    }

    /// The gang's network check ended with node 0's verdict: this node's measurements with its
    /// peers (replacing the previous check's, whose peers may have left), what the verdict named
    /// and how long the check took here. At most [`MAX_NETWORK_PEER_SERIES`] measurements.
    pub(super) fn network_check_judged(&self, summary: &Summary, elapsed: Duration) {
        let findings = summary.node_findings + summary.link_findings;
        self.checks
            .with_label_values(&[match (summary.inconclusive, findings) {
                (true, _) => "inconclusive",
                (false, 0) => "clean",
                (false, _) => "finding",
            }])
            .inc();
        self.duration.set(elapsed.as_secs_f64());
        self.findings
            .with_label_values(&["node"])
            .set(i64::from(summary.node_findings));
        self.findings
            .with_label_values(&["link"])
            .set(i64::from(summary.link_findings));
        self.named.set(i64::from(summary.named));
        self.clear_network_peers();
        for peer in summary.peers.iter().take(MAX_NETWORK_PEER_SERIES) {
            let rank = peer.peer_node_rank.to_string();
            let round = peer.round.to_string();
            let labels = [rank.as_str(), peer.direction.as_str(), round.as_str()];
            if let Some(rtt) = peer.rtt {
                self.peer_rtt
                    .with_label_values(&labels)
                    .set(rtt.as_secs_f64());
            }
            self.peer_throughput
                .with_label_values(&labels)
                .set(peer.bytes_per_second);
            self.peer_slow
                .with_label_values(&labels)
                .set(i64::from(peer.slow));
        }
    }

    /// The gang's network check ended on this node without a verdict (node 0 did not answer in
    /// time): counted, timed; the previous check's measurements are no longer this round's.
    pub(super) fn network_check_without_verdict(&self, elapsed: Duration) {
        self.checks.with_label_values(&["no_verdict"]).inc();
        self.duration.set(elapsed.as_secs_f64());
        self.named.set(0);
        for kind in ["node", "link"] {
            self.findings.with_label_values(&[kind]).set(0);
        }
        self.clear_network_peers();
    }

    /// Drops the previous network check's per-peer series (its peers may have left the gang).
    fn clear_network_peers(&self) {
        self.peer_rtt.reset();
        self.peer_throughput.reset();
        self.peer_slow.reset();
    }

    /// Records a finished network check; other events are not its.
    pub(super) fn observe(&self, event: &events::Event) {
        if let events::Event::NetworkChecked { result, elapsed } = event {
            match result {
                NetworkCheckResult::Judged(summary) => {
                    self.network_check_judged(summary, *elapsed);
                }
                NetworkCheckResult::NoVerdict => self.network_check_without_verdict(*elapsed),
            }
        }
    }
}
