//! What the probes answer, as gauges: `muster_agent_ready` (`/readyz`), `muster_gang_running`
//! (`/gangz`) and `muster_gang_spares`; set from the probes' own state at every scrape.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use prometheus::IntGauge;

use super::Defs;

/// What `/readyz` says: whether this agent can play its part for the others. It only ever moves
/// forward, and it never depends on another pod (issue #23): a pod's readiness gates its DNS
/// record, and the gang needs node 0's record before it can form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Readiness {
    /// Reading the configuration, binding ports, GPU pre-flight.
    Starting = 0,
    /// Node 0: everything else is set up, its rendezvous store is not accepting connections yet.
    HostingStore = 1,
    /// Ready, and stays so until the process exits (restarts, checkpoint barrier, draining).
    Ready = 2,
}

impl Readiness {
    fn from_u8(value: u8) -> Readiness {
        match value {
            0 => Readiness::Starting,
            1 => Readiness::HostingStore,
            _ => Readiness::Ready,
        }
    }
}

/// The probes' gauges, readiness, and node 0's spares.
pub(super) struct Probes {
    agent_ready: IntGauge,
    gang_running: IntGauge,
    gang_spares: IntGauge,
    readiness: AtomicU8,
    /// Node 0's list of the spares' hosts (`muster_gang_spares`, `/gangz`).
    spares: OnceLock<rendezvous::rdzv::driver::SpareHosts>,
}

impl Probes {
    /// Defines the family; the agent starts in [`Readiness::Starting`].
    pub(super) fn register(defs: &mut Defs) -> Self {
        Self {
            agent_ready: defs.int_gauge(
                "muster_agent_ready",
                "1 when /readyz answers 200: this agent can play its part for the others (independent of peers).",
            ),
            gang_running: defs.int_gauge(
                "muster_gang_running",
                "1 when /gangz answers 200: the gang has formed and this node's workers are running.",
            ),
            gang_spares: defs.int_gauge(
                "muster_gang_spares",
                "Nodes waiting as spares in the running generation (beyond --nnodes MAX or a --node-unit multiple), as node 0 answered them; 0 on other nodes.",
            ),
            readiness: AtomicU8::new(Readiness::Starting as u8),
            spares: OnceLock::new(),
        }
    }

    /// `/readyz`'s state.
    pub(super) fn readiness(&self) -> Readiness {
        Readiness::from_u8(self.readiness.load(Ordering::Relaxed))
    }

    /// Moves readiness forward to `readiness` (never back: a later, lesser state is ignored).
    pub(super) fn advance_readiness(&self, readiness: Readiness) {
        self.readiness.fetch_max(readiness as u8, Ordering::Relaxed);
    }

    /// Shows the rendezvous's spare list; a second list is ignored.
    pub(super) fn attach_spare_hosts(&self, spares: rendezvous::rdzv::driver::SpareHosts) {
        let _first = self.spares.set(spares);
    }

    /// The hosts node 0 answered "spare" in the running generation (empty elsewhere).
    pub(super) fn spare_hosts(&self) -> Vec<String> {
        self.spares
            .get()
            .and_then(|list| list.lock().ok().map(|l| l.clone()))
            .unwrap_or_default()
    }

    /// Sets the gauges to what the probes answer now (`gang_running`: `/gangz`'s verdict).
    pub(super) fn refresh(&self, gang_running: bool) {
        self.agent_ready
            .set(i64::from(self.readiness() == Readiness::Ready));
        self.gang_running.set(i64::from(gang_running));
        self.gang_spares
            .set(i64::try_from(self.spare_hosts().len()).unwrap_or(i64::MAX));
    }
}
