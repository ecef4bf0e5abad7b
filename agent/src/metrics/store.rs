//! Statistics of the TCPStore instances this agent hosts, read at scrape time.
//!
//! The store server counts connections, operations, bytes and waiters in its own atomics; nothing
//! is pushed from its request path into the registry. At scrape time this collector asks each
//! attached store for a [`StoreSnapshot`] and turns it into families labelled `store`
//! (`rendezvous`: the gang's store on node 0; `workers`: the per-attempt store that serves the
//! workers' `init_process_group`). Because every attempt gets a fresh store whose counters start at
//! zero, the totals of a replaced store are carried over, so the exported counters never go back.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{MetricFamily, MetricType};

use super::live::{counter, family, gauge};
use super::STATIC_DEFINITION;

const CONNECTIONS: &str = "muster_store_connections";
const OPERATIONS: &str = "muster_store_operations_total";
const RECEIVED: &str = "muster_store_received_bytes_total";
const SENT: &str = "muster_store_sent_bytes_total";
const WAITERS: &str = "muster_store_waiters";

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
    /// Requests handled since the store started, by command (c10d `QueryType` names, lower case:
    /// a fixed set, so the label stays bounded).
    pub operations: Vec<(&'static str, u64)>,
    /// Bytes read from clients since the store started.
    pub received_bytes: u64,
    /// Bytes written to clients since the store started.
    pub sent_bytes: u64,
    /// Clients blocked in `WAIT` now.
    pub waiters: u64,
}

/// Something that can report a store's statistics; implemented for the store server's `Stats`.
pub trait StoreStatsSource: Send + Sync {
    fn snapshot(&self) -> StoreSnapshot;
}

/// Counter totals of stores that were replaced or stopped.
#[derive(Default)]
struct Carried {
    operations: BTreeMap<&'static str, u64>,
    received_bytes: u64,
    sent_bytes: u64,
}

impl Carried {
    fn absorb(&mut self, snapshot: &StoreSnapshot) {
        for (command, count) in &snapshot.operations {
            *self.operations.entry(command).or_default() += count;
        }
        self.received_bytes += snapshot.received_bytes;
        self.sent_bytes += snapshot.sent_bytes;
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
        let defs: [(&str, &str, &[&str]); 5] = [
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
                "Clients blocked in WAIT on a store this agent hosts.",
                &["store"],
            ),
        ];
        let descs = defs
            .iter()
            .map(|(name, help, labels)| {
                Desc::new(
                    (*name).to_owned(),
                    (*help).to_owned(),
                    labels.iter().map(|l| (*l).to_owned()).collect(),
                    HashMap::new(),
                )
                .expect(STATIC_DEFINITION)
            })
            .collect();
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

    fn help(&self, name: &str) -> String {
        self.descs
            .iter()
            .find(|d| d.fq_name == name)
            .map(|d| d.help.clone())
            .unwrap_or_default()
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
                        carried: StoreSnapshot {
                            connections: 0,
                            operations: slot
                                .carried
                                .operations
                                .iter()
                                .map(|(c, n)| (*c, *n))
                                .collect(),
                            received_bytes: slot.carried.received_bytes,
                            sent_bytes: slot.carried.sent_bytes,
                            waiters: 0,
                        },
                    }
                })
                .collect()
        };

        let mut connections = Vec::new();
        let mut operations = Vec::new();
        let mut received = Vec::new();
        let mut sent = Vec::new();
        let mut waiters = Vec::new();
        for Attached {
            role,
            source,
            carried,
        } in attached
        {
            let store = role.as_str();
            let current = source.map(|s| s.snapshot()).unwrap_or_default();
            let mut ops: BTreeMap<&'static str, u64> = carried.operations.into_iter().collect();
            for (command, count) in &current.operations {
                *ops.entry(command).or_default() += count;
            }
            connections.push(gauge(&[("store", store)], current.connections as f64));
            waiters.push(gauge(&[("store", store)], current.waiters as f64));
            received.push(counter(
                &[("store", store)],
                (carried.received_bytes + current.received_bytes) as f64,
            ));
            sent.push(counter(
                &[("store", store)],
                (carried.sent_bytes + current.sent_bytes) as f64,
            ));
            for (command, count) in ops {
                operations.push(counter(
                    &[("store", store), ("command", command)],
                    count as f64,
                ));
            }
        }
        vec![
            family(
                CONNECTIONS,
                collector.help(CONNECTIONS),
                MetricType::GAUGE,
                connections,
            ),
            family(
                OPERATIONS,
                collector.help(OPERATIONS),
                MetricType::COUNTER,
                operations,
            ),
            family(
                RECEIVED,
                collector.help(RECEIVED),
                MetricType::COUNTER,
                received,
            ),
            family(SENT, collector.help(SENT), MetricType::COUNTER, sent),
            family(WAITERS, collector.help(WAITERS), MetricType::GAUGE, waiters),
        ]
    }
}
