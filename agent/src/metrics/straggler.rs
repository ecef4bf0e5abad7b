//! The straggler watch's findings ([`crate::straggler_watch`]), built at scrape time from its
//! [`Board`]: a slowness ratio per local rank (1.0 = the gang's median compute per step) and one
//! info series per standing finding, so an alert can fire on `muster_straggler_findings > 0`
//! and name the node from the labels.

use prometheus::core::Desc;
use prometheus::proto::{MetricFamily, MetricType};

use super::attached::Attached;
use super::live::{family, gauge, help};
use crate::straggler_watch::Board;

const RATIO: &str = "muster_straggler_slowness_ratio";
const FINDING: &str = "muster_straggler_finding_info";
const FINDINGS: &str = "muster_straggler_findings";

/// The collector, empty until the straggler watch is attached.
pub(super) fn collector() -> Attached<Board> {
    let defs: [(&str, &str, &[&str]); 3] = [
        (RATIO, "CPU time per step of this local rank over the gang's median in the last straggler interval (1.0 = typical; a slow rank is above --straggler-threshold).", &["node_rank", "local_rank", "rank"]),
        (FINDING, "1 for each standing straggler finding of this node: a slow rank (kind=rank) or a GPU the hardware throttles (kind=gpu).", &["kind", "node_rank", "host", "local_rank", "rank", "gpu"]),
        (FINDINGS, "Standing straggler findings of this node (0 on a healthy node).", &[]),
    ];
    Attached::new(&defs, families)
}

fn families(board: &Board, descs: &[Desc]) -> Vec<MetricFamily> {
    let ratios: Vec<_> = board
        .ratios()
        .iter()
        .map(|r| {
            gauge(
                &[
                    ("node_rank", &r.node_rank.to_string()),
                    ("local_rank", &r.local_rank.to_string()),
                    ("rank", &r.rank.to_string()),
                ],
                r.ratio,
            )
        })
        .collect();
    let findings = board.findings();
    let opt = |v: Option<u32>| v.map_or_else(String::new, |v| v.to_string());
    let info: Vec<_> = findings
        .iter()
        .map(|f| {
            gauge(
                &[
                    ("kind", f.kind),
                    ("node_rank", &f.node_rank.to_string()),
                    ("host", &f.host),
                    ("local_rank", &opt(f.local_rank)),
                    ("rank", &opt(f.rank)),
                    ("gpu", &opt(f.gpu)),
                ],
                1.0,
            )
        })
        .collect();
    let mut out = Vec::new();
    if !ratios.is_empty() {
        out.push(family(RATIO, help(descs, RATIO), MetricType::GAUGE, ratios));
    }
    if !info.is_empty() {
        out.push(family(
            FINDING,
            help(descs, FINDING),
            MetricType::GAUGE,
            info,
        ));
    }
    out.push(family(
        FINDINGS,
        help(descs, FINDINGS),
        MetricType::GAUGE,
        vec![gauge(&[], findings.len() as f64)],
    ));
    out
}
