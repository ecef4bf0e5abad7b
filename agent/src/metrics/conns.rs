//! Admission of the metrics endpoint's connections: who gets a slot, and whose slot is taken back.
//!
//! Port 8000 must be reachable from Prometheus and the kubelet, so any pod that can reach it can
//! also open connections and never send a request. A server that serves N connections and leaves
//! the rest in the kernel's backlog is then silenced by N sockets, and a liveness probe that gets
//! no answer kills the training pod (issue #18). So the endpoint accepts every connection at once
//! and keeps a table of them here, with two limits:
//!
//! - **per peer address**: one address holds at most `per_peer` connections. When it opens one
//!   more, its own *oldest idle* connection is closed (idle: waiting for input, not writing a
//!   response). An attacker's sockets therefore only ever displace each other, and a prober on
//!   another address always finds a slot.
//! - **in total**: at most `total` connections. At the limit, the oldest idle connection of the
//!   address holding the most is closed, so many attacking addresses still cannot starve a new
//!   one.
//!
//! Evicting the oldest instead of refusing the newest is what keeps a probe's fresh connection
//! alive: the kubelet opens a new connection per probe, and it is always the newest. Only when
//! every candidate is busy writing a response is the new connection refused (closed at once).
//! Pure bookkeeping, no I/O: the caller closes what this says to close.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use tokio_util::sync::CancellationToken;

/// The two limits of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limits {
    pub total: usize,
    pub per_peer: usize,
}

/// Which limit closed a connection (`limit` label of `muster_http_connections_shed_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shed {
    Peer,
    Total,
}

impl Shed {
    pub(super) const ALL: [Shed; 2] = [Shed::Peer, Shed::Total];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Shed::Peer => "peer",
            Shed::Total => "total",
        }
    }
}

/// What [`Table::admit`] decided for a new connection.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Admission {
    /// Serve it under `id`; `evicted` says which limit made room by closing an older one.
    Admitted { id: u64, evicted: Option<Shed> },
    /// Close it at once: the limit is reached and every candidate is busy.
    Refused(Shed),
}

struct Entry {
    peer: IpAddr,
    /// Writing a response: never evicted.
    busy: bool,
    evict: CancellationToken,
}

/// Every open connection, oldest first (ids grow with acceptance).
#[derive(Default)]
pub(super) struct Table {
    next_id: u64,
    entries: BTreeMap<u64, Entry>,
    per_peer: HashMap<IpAddr, usize>,
}

impl Table {
    /// Admits a connection from `peer`; cancelling `evict` is how it is told to close later.
    /// Cancels the token of the connection it evicts, if any.
    pub(super) fn admit(
        &mut self,
        peer: IpAddr,
        evict: CancellationToken,
        limits: Limits,
    ) -> Admission {
        let per_peer = limits.per_peer.max(1);
        let total = limits.total.max(1);
        let mut evicted = None;
        if self.count(peer) >= per_peer {
            let Some(victim) = self.oldest_idle(|p| p == peer) else {
                return Admission::Refused(Shed::Peer);
            };
            self.evict(victim);
            evicted = Some(Shed::Peer);
        } else if self.entries.len() >= total {
            let crowded = self
                .per_peer
                .iter()
                .max_by_key(|(_, n)| **n)
                .map(|(ip, _)| *ip);
            let victim = crowded
                .and_then(|c| self.oldest_idle(|p| p == c))
                .or_else(|| self.oldest_idle(|_| true));
            let Some(victim) = victim else {
                return Admission::Refused(Shed::Total);
            };
            self.evict(victim);
            evicted = Some(Shed::Total);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(
            id,
            Entry {
                peer,
                busy: false,
                evict,
            },
        );
        *self.per_peer.entry(peer).or_insert(0) += 1;
        Admission::Admitted { id, evicted }
    }

    /// Marks connection `id` as writing a response (`true`) or waiting for input (`false`).
    pub(super) fn set_busy(&mut self, id: u64, busy: bool) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.busy = busy;
        }
    }

    /// Forgets connection `id` (it ended); nothing happens if it was evicted already.
    pub(super) fn remove(&mut self, id: u64) -> Option<CancellationToken> {
        let entry = self.entries.remove(&id)?;
        if let Some(n) = self.per_peer.get_mut(&entry.peer) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&entry.peer);
            }
        }
        Some(entry.evict)
    }

    /// Connections open now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    fn count(&self, peer: IpAddr) -> usize {
        self.per_peer.get(&peer).copied().unwrap_or(0)
    }

    fn oldest_idle(&self, from: impl Fn(IpAddr) -> bool) -> Option<u64> {
        self.entries
            .iter()
            .find(|(_, e)| !e.busy && from(e.peer))
            .map(|(id, _)| *id)
    }

    fn evict(&mut self, id: u64) {
        if let Some(token) = self.remove(id) {
            token.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        total: 4,
        per_peer: 2,
    };

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    fn admit(table: &mut Table, peer: IpAddr) -> (Admission, CancellationToken) {
        let token = CancellationToken::new();
        (table.admit(peer, token.clone(), LIMITS), token)
    }

    #[test]
    fn a_peer_at_its_limit_displaces_its_own_oldest_idle_connection() {
        let mut table = Table::default();
        let (_, first) = admit(&mut table, ip(2));
        let (_, second) = admit(&mut table, ip(2));
        let (third, _) = admit(&mut table, ip(2));
        assert_eq!(
            third,
            Admission::Admitted {
                id: 2,
                evicted: Some(Shed::Peer)
            }
        );
        assert!(first.is_cancelled() && !second.is_cancelled());
        assert_eq!(table.len(), 2);
        // Another address is not affected, and is admitted without evicting anyone.
        let (other, _) = admit(&mut table, ip(1));
        assert_eq!(
            other,
            Admission::Admitted {
                id: 3,
                evicted: None
            }
        );
        assert!(!second.is_cancelled());
    }

    #[test]
    fn busy_connections_are_never_evicted() {
        let mut table = Table::default();
        let (_, a) = admit(&mut table, ip(2));
        let (_, b) = admit(&mut table, ip(2));
        table.set_busy(0, true);
        let (c, _) = admit(&mut table, ip(2));
        assert!(matches!(
            c,
            Admission::Admitted {
                evicted: Some(Shed::Peer),
                ..
            }
        ));
        assert!(!a.is_cancelled() && b.is_cancelled(), "the idle one went");
        table.set_busy(2, true);
        assert_eq!(admit(&mut table, ip(2)).0, Admission::Refused(Shed::Peer));
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn at_the_total_limit_the_most_crowded_address_gives_way() {
        let mut table = Table::default();
        let (_, a1) = admit(&mut table, ip(1));
        let (_, b1) = admit(&mut table, ip(2));
        let (_, b2) = admit(&mut table, ip(2));
        let (_, c1) = admit(&mut table, ip(3));
        assert_eq!(table.len(), 4);
        let (d1, _) = admit(&mut table, ip(4));
        assert_eq!(
            d1,
            Admission::Admitted {
                id: 4,
                evicted: Some(Shed::Total)
            }
        );
        assert!(b1.is_cancelled(), "the oldest of the address holding two");
        assert!(!a1.is_cancelled() && !b2.is_cancelled() && !c1.is_cancelled());
        assert_eq!(table.len(), 4);
    }

    #[test]
    fn removal_frees_the_slot_and_is_idempotent() {
        let mut table = Table::default();
        let (_, t) = admit(&mut table, ip(2));
        assert!(table.remove(0).is_some());
        assert!(table.remove(0).is_none());
        assert!(!t.is_cancelled(), "an ended connection is not cancelled");
        assert_eq!(table.len(), 0);
        assert!(table.per_peer.is_empty());
    }

    proptest::proptest! {
        #[test]
        fn the_limits_always_hold(ops in proptest::collection::vec((0u8..4, 0u8..3), 0..200)) {
            let mut table = Table::default();
            let mut open: Vec<u64> = Vec::new();
            for (peer, op) in ops {
                match op {
                    0 | 1 => {
                        if let Admission::Admitted { id, .. } =
                            table.admit(ip(peer), CancellationToken::new(), LIMITS)
                        {
                            open.push(id);
                        }
                    }
                    _ => {
                        if let Some(id) = open.pop() {
                            table.remove(id);
                        }
                    }
                }
                proptest::prop_assert!(table.len() <= LIMITS.total);
                for n in table.per_peer.values() {
                    proptest::prop_assert!(*n <= LIMITS.per_peer && *n > 0);
                }
                proptest::prop_assert_eq!(table.per_peer.values().sum::<usize>(), table.len());
            }
        }
    }
}
