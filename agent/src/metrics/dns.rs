//! Lookups of the rendezvous endpoint's host: `muster_dns_resolution_*`.

use std::time::Duration;

use prometheus::{Histogram, IntCounterVec};

use super::{Defs, WAIT_BUCKETS_SECONDS};
use crate::events::{self, DnsResult};

const DNS_RESULTS: [DnsResult; 4] = [
    DnsResult::Ok,
    DnsResult::NxDomain,
    DnsResult::Timeout,
    DnsResult::Error,
];

/// The `result` label of a lookup of the rendezvous host.
fn dns_result_label(result: DnsResult) -> &'static str {
    match result {
        DnsResult::Ok => "ok",
        DnsResult::NxDomain => "nxdomain",
        DnsResult::Timeout => "timeout",
        DnsResult::Error => "error",
    }
}

/// The lookups' counts and how long resolving took.
pub(super) struct Dns {
    attempts: IntCounterVec,
    duration: Histogram,
}

impl Dns {
    /// Defines the family, every result at 0.
    pub(super) fn register(defs: &mut Defs) -> Self {
        let dns = Self {
            attempts: defs.counter_vec(
                "muster_dns_resolution_attempts_total",
                "Lookups of the rendezvous endpoint's host, by result.",
                &["result"],
            ),
            duration: defs.histogram(
                "muster_dns_resolution_duration_seconds",
                "Time from the first lookup of the rendezvous host until it resolved or the deadline.",
                &WAIT_BUCKETS_SECONDS,
            ),
        };
        for result in DNS_RESULTS {
            dns.attempts.with_label_values(&[dns_result_label(result)]);
        }
        dns
    }

    /// One lookup of the rendezvous host finished.
    pub(super) fn dns_attempt(&self, result: DnsResult) {
        self.attempts
            .with_label_values(&[dns_result_label(result)])
            .inc();
    }

    /// The rendezvous host resolved (or the deadline passed) `elapsed` after the first lookup.
    pub(super) fn dns_resolution_finished(&self, elapsed: Duration) {
        self.duration.observe(elapsed.as_secs_f64());
    }

    /// Records the discovery's events (`DnsAttempt`, `ResolvingFinished`); others are not its.
    pub(super) fn observe(&self, event: &events::Event) {
        match event {
            events::Event::DnsAttempt(result) => self.dns_attempt(*result),
            events::Event::ResolvingFinished { elapsed, .. } => {
                self.dns_resolution_finished(*elapsed);
            }
            _ => {}
        }
    }
}
