//! Scrape-time families for the loss of the store host (node 0): sampled from the multi-node
//! rendezvous's read-only [`HostLossStats`], attached once the rendezvous exists; nothing is
//! exported before (a single-node launch has no store host to lose).

use std::sync::Arc;

use prometheus::core::Desc;
use prometheus::proto::{MetricFamily, MetricType};
use rendezvous::rdzv::recovery::HostLossStats;
use tokio::time::Instant;

use super::attached::Attached;
use super::live::{counter, family, gauge, help};

const LOST: &str = "muster_rendezvous_host_lost_total";
const WAITING: &str = "muster_rendezvous_host_waiting";
const REJOINED: &str = "muster_rendezvous_host_rejoined_total";
const WITHOUT_GANG: &str = "muster_rendezvous_seconds_without_gang_total";

/// The collector, empty until the rendezvous attaches its record (a single-node launch never does).
pub(super) fn collector() -> Attached<Arc<HostLossStats>> {
    let defs: [(&str, &str, &[&str]); 4] = [
        (
            LOST,
            "Times this agent lost the store host (node 0) and began waiting for a replacement.",
            &[],
        ),
        (
            WAITING,
            "1 while this agent waits for a replacement store host, else 0.",
            &[],
        ),
        (
            REJOINED,
            "Times this agent rejoined the gang on a replacement store host.",
            &[],
        ),
        (
            WITHOUT_GANG,
            "Seconds this agent spent without a gang after losing the store host, the wait in progress included.",
            &[],
        ),
    ];
    Attached::new(&defs, families)
}

fn families(stats: &Arc<HostLossStats>, descs: &[Desc]) -> Vec<MetricFamily> {
    #[allow(clippy::cast_precision_loss)] // counts far below 2^52
    let (lost, rejoined) = (stats.lost_total() as f64, stats.rejoined_total() as f64);
    let metric = |name: &str, kind: MetricType, value: f64| {
        let sample = if kind == MetricType::COUNTER {
            counter(&[], value)
        } else {
            gauge(&[], value)
        };
        family(name, help(descs, name), kind, vec![sample])
    };
    vec![
        metric(LOST, MetricType::COUNTER, lost),
        metric(
            WAITING,
            MetricType::GAUGE,
            f64::from(u8::from(stats.waiting())),
        ),
        metric(REJOINED, MetricType::COUNTER, rejoined),
        metric(
            WITHOUT_GANG,
            MetricType::COUNTER,
            stats.seconds_without_gang(Instant::now()),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus::core::Collector;

    use super::*;

    fn value(families: &[MetricFamily], name: &str) -> f64 {
        let f = families
            .iter()
            .find(|f| f.name() == name)
            .unwrap_or_else(|| panic!("{name} missing"));
        let m = &f.get_metric()[0];
        if f.get_field_type() == MetricType::COUNTER {
            m.get_counter().get_value()
        } else {
            m.get_gauge().get_value()
        }
    }

    #[test]
    fn nothing_before_a_rendezvous_attaches_then_what_it_went_through() {
        let collector = collector();
        assert!(
            collector.collect().is_empty(),
            "single node: no store host to lose"
        );
        let stats = Arc::new(HostLossStats::default());
        collector.attach(Arc::clone(&stats));
        stats.lost(Instant::now());
        let families = collector.collect();
        assert!((value(&families, LOST) - 1.0).abs() < 1e-9);
        assert!((value(&families, WAITING) - 1.0).abs() < 1e-9);
        assert!((value(&families, REJOINED) - 0.0).abs() < 1e-9);
        stats.rejoined(Duration::from_secs(4));
        let families = collector.collect();
        assert!((value(&families, WAITING) - 0.0).abs() < 1e-9);
        assert!((value(&families, REJOINED) - 1.0).abs() < 1e-9);
        assert!((value(&families, WITHOUT_GANG) - 4.0).abs() < 1e-6);
    }
}
