//! Statistics of the TCPStore instances this agent hosts, read at scrape time.
//!
//! The store server counts connections, operations, bytes and waiters in its own atomics; nothing
//! is pushed from its request path into the registry. At scrape time this collector asks each
//! attached store for a [`StoreSnapshot`] and turns it into families labelled `store`
//! (`rendezvous`: the gang's store on node 0; `workers`: the per-attempt store that serves the
//! workers' `init_process_group`). [`StoreStatsSource`] is implemented here for the store
//! server's `Stats`. Because every attempt gets a fresh store whose counters start at
//! zero, the totals of a replaced store are carried over, so the exported counters never go back.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{MetricFamily, MetricType};

use super::live::{counter, descs, family, gauge, help};

const CONNECTIONS: &str = "muster_store_connections";
const OPERATIONS: &str = "muster_store_operations_total";
const RECEIVED: &str = "muster_store_received_bytes_total";
const SENT: &str = "muster_store_sent_bytes_total";
const WAITERS: &str = "muster_store_waiters";
const ACCEPTED: &str = "muster_store_connections_accepted_total";
const REFUSED: &str = "muster_store_connections_refused_total";
const PROTOCOL_ERRORS: &str = "muster_store_protocol_errors_total";
const KEYS: &str = "muster_store_keys";

/// Which store a snapshot belongs to (`store` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreRole {
    /// The gang's rendezvous store (hosted by node 0).
    Rendezvous,
    /// The store of the current attempt that the workers' `init_process_group` uses.
    Workers,
}

impl StoreRole {
    const ALL: [StoreRole; 2] = [StoreRole::Rendezvous, StoreRole::Workers];

    fn as_str(self) -> &'static str {
        match self {
            StoreRole::Rendezvous => "rendezvous",
            StoreRole::Workers => "workers",
        }
    }

    fn index(self) -> usize {
        match self {
            StoreRole::Rendezvous => 0,
            StoreRole::Workers => 1,
        }
    }
}

/// One reading of a store's statistics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreSnapshot {
    /// Client connections open now.
    pub connections: u64,
    /// Connections accepted since the store started.
    pub connections_accepted: u64,
    /// Connections closed at once because the connection limit was reached.
    pub connections_refused: u64,
    /// Connections closed for a protocol violation.
    pub protocol_errors: u64,
    /// Requests handled since the store started, by command (c10d `QueryType` names: a fixed
    /// set, so the label stays bounded).
    pub operations: Vec<(&'static str, u64)>,
    /// Bytes read from clients since the store started.
    pub received_bytes: u64,
    /// Bytes written to clients since the store started.
    pub sent_bytes: u64,
    /// Clients blocked in `WAIT` (or a barrier) now.
    pub waiters: u64,
    /// Keys held now.
    pub keys: u64,
}

/// Something that can report a store's statistics; implemented for the store server's `Stats`.
pub trait StoreStatsSource: Send + Sync {
    fn snapshot(&self) -> StoreSnapshot;
}

/// Counter totals of stores that were replaced or stopped.
#[derive(Default)]
struct Carried {
    operations: BTreeMap<&'static str, u64>,
    connections_accepted: u64,
    connections_refused: u64,
    protocol_errors: u64,
    received_bytes: u64,
    sent_bytes: u64,
}

impl Carried {
    fn absorb(&mut self, snapshot: &StoreSnapshot) {
        for (command, count) in &snapshot.operations {
            *self.operations.entry(command).or_default() += count;
        }
        self.connections_accepted += snapshot.connections_accepted;
        self.connections_refused += snapshot.connections_refused;
        self.protocol_errors += snapshot.protocol_errors;
        self.received_bytes += snapshot.received_bytes;
        self.sent_bytes += snapshot.sent_bytes;
    }

    /// The carried totals as a snapshot of a store with nothing open.
    fn to_snapshot(&self) -> StoreSnapshot {
        StoreSnapshot {
            connections: 0,
            connections_accepted: self.connections_accepted,
            connections_refused: self.connections_refused,
            protocol_errors: self.protocol_errors,
            operations: self.operations.iter().map(|(c, n)| (*c, *n)).collect(),
            received_bytes: self.received_bytes,
            sent_bytes: self.sent_bytes,
            waiters: 0,
            keys: 0,
        }
    }
}

#[derive(Default)]
struct Slot {
    source: Option<Arc<dyn StoreStatsSource>>,
    carried: Carried,
    /// A store of this role existed at some point (before that, no series are exported).
    seen: bool,
}

pub(super) struct StoreCollector {
    slots: Mutex<[Slot; 2]>,
    descs: Vec<Desc>,
}

impl StoreCollector {
    pub(super) fn new() -> Self {
        let defs: [(&str, &str, &[&str]); 9] = [
            (
                CONNECTIONS,
                "Client connections open on a store this agent hosts.",
                &["store"],
            ),
            (
                OPERATIONS,
                "Requests handled by a store this agent hosts, by command.",
                &["store", "command"],
            ),
            (
                RECEIVED,
                "Bytes a hosted store read from clients.",
                &["store"],
            ),
            (SENT, "Bytes a hosted store wrote to clients.", &["store"]),
            (
                WAITERS,
                "Clients blocked in WAIT or a barrier on a store this agent hosts.",
                &["store"],
            ),
            (ACCEPTED, "Connections a hosted store accepted.", &["store"]),
            (
                REFUSED,
                "Connections a hosted store refused at its connection limit.",
                &["store"],
            ),
            (
                PROTOCOL_ERRORS,
                "Connections a hosted store closed for a protocol violation.",
                &["store"],
            ),
            (KEYS, "Keys held by a store this agent hosts.", &["store"]),
        ];
        let descs = descs(&defs);
        Self {
            slots: Mutex::new(Default::default()),
            descs,
        }
    }

    pub(super) fn attach(&self, role: StoreRole, source: Arc<dyn StoreStatsSource>) {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = &mut slots[role.index()];
        if let Some(old) = slot.source.take() {
            slot.carried.absorb(&old.snapshot());
        }
        slot.source = Some(source);
        slot.seen = true;
    }

    pub(super) fn detach(&self, role: StoreRole) {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = &mut slots[role.index()];
        if let Some(old) = slot.source.take() {
            slot.carried.absorb(&old.snapshot());
        }
    }
}

/// A role's store (if running) and the totals carried over from its predecessors.
struct Attached {
    role: StoreRole,
    source: Option<Arc<dyn StoreStatsSource>>,
    carried: StoreSnapshot,
}

/// The registry wants an owned collector; the agent keeps the `Arc` to attach stores.
pub(super) struct SharedStoreCollector(pub(super) Arc<StoreCollector>);

impl Collector for SharedStoreCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.0.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let collector = &self.0;
        // Read the sources outside the lock: a snapshot is a handful of atomic loads, but the
        // lock also guards attach/detach from the agent loop, which must never wait on a scrape.
        let attached: Vec<Attached> = {
            let slots = collector
                .slots
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            StoreRole::ALL
                .iter()
                .filter(|role| slots[role.index()].seen)
                .map(|role| {
                    let slot = &slots[role.index()];
                    Attached {
                        role: *role,
                        source: slot.source.clone(),
                        carried: slot.carried.to_snapshot(),
                    }
                })
                .collect()
        };

        // (name, type, one sample per attached role)
        let mut families: Vec<(&str, MetricType, Vec<prometheus::proto::Metric>)> = [
            (CONNECTIONS, MetricType::GAUGE),
            (ACCEPTED, MetricType::COUNTER),
            (REFUSED, MetricType::COUNTER),
            (PROTOCOL_ERRORS, MetricType::COUNTER),
            (OPERATIONS, MetricType::COUNTER),
            (RECEIVED, MetricType::COUNTER),
            (SENT, MetricType::COUNTER),
            (WAITERS, MetricType::GAUGE),
            (KEYS, MetricType::GAUGE),
        ]
        .into_iter()
        .map(|(name, kind)| (name, kind, Vec::new()))
        .collect();
        for Attached {
            role,
            source,
            carried,
        } in attached
        {
            let store = role.as_str();
            let now = source.map(|s| s.snapshot()).unwrap_or_default();
            let mut ops: BTreeMap<&'static str, u64> = carried.operations.iter().copied().collect();
            for (command, count) in &now.operations {
                *ops.entry(command).or_default() += count;
            }
            let label = [("store", store)];
            let values = [
                now.connections,
                carried.connections_accepted + now.connections_accepted,
                carried.connections_refused + now.connections_refused,
                carried.protocol_errors + now.protocol_errors,
                0, // operations: one sample per command, below
                carried.received_bytes + now.received_bytes,
                carried.sent_bytes + now.sent_bytes,
                now.waiters,
                now.keys,
            ];
            for ((name, kind, samples), value) in families.iter_mut().zip(values) {
                if *name == OPERATIONS {
                    for (command, count) in &ops {
                        samples.push(counter(
                            &[("store", store), ("command", command)],
                            *count as f64,
                        ));
                    }
                } else if *kind == MetricType::COUNTER {
                    samples.push(counter(&label, value as f64));
                } else {
                    samples.push(gauge(&label, value as f64));
                }
            }
        }
        families
            .into_iter()
            .map(|(name, kind, samples)| family(name, help(&collector.descs, name), kind, samples))
            .collect()
    }
}

impl StoreStatsSource for rendezvous::store::server::Stats {
    fn snapshot(&self) -> StoreSnapshot {
        use rendezvous::store::protocol::Command;
        use std::sync::atomic::Ordering::Relaxed;
        StoreSnapshot {
            connections: self.connections_open.load(Relaxed) as u64,
            connections_accepted: self.connections_accepted.load(Relaxed),
            connections_refused: self.connections_refused.load(Relaxed),
            protocol_errors: self.protocol_errors.load(Relaxed),
            operations: Command::ALL
                .iter()
                .map(|command| (command.name(), self.requests(*command)))
                .collect(),
            received_bytes: self.bytes_received.load(Relaxed),
            sent_bytes: self.bytes_sent.load(Relaxed),
            waiters: self.blocked_clients.load(Relaxed) as u64,
            keys: self.keys.load(Relaxed) as u64,
        }
    }
}
