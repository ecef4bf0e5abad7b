//! The GPU watch: while the ranks train, one thread looks at every local GPU through NVML
//! (`--gpu-watch-interval`, default 10 s) and a second one blocks in NVML's event set for XIDs, so
//! a GPU that faults mid-run is named — in the log at once, in the summary of a failed or hung
//! rank, and in DCGM-style Prometheus metrics — and a fatal fault stops the node (exit 204) so
//! that an elastic gang (`--nnodes MIN:MAX`) goes on without it.
//!
//! # Layout
//! - [`xid`]: which XIDs are fatal for the node, and their names (NVIDIA's Xid catalogue).
//! - [`sample`]: what one look gives ([`GpuSample`]), the pure rule from two looks to events
//!   ([`sample::changes`]), and how events read.
//! - `reader`: the NVML side (two threads; off, with a debug line, when there is no driver).
//! - this module: [`Watch`], the shared read-only state the rest of the agent consumes: the
//!   latest [`NodeSample`] and XID counts for metrics ([`Watch::view`]), the recent events for
//!   summaries ([`Watch::recent`]), and the first fatal event ([`Watch::fault`]).
//!
//! Only changes count as events: the watch takes its first look as the baseline, so a GPU that
//! was already lost or throttled when the job started (the pre-flight's business, perhaps
//! accepted with `--gpu-check warn`) does not stop the node.

mod reader;
pub mod sample;
pub mod xid;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

pub use sample::{EventKind, GpuEvent, GpuId, GpuSample, NodeSample, NvLinkErrors};

/// `--gpu-watch-interval`'s default: DCGM's exporter samples every 30 s by default and NVIDIA's
/// device plugin waits 5 s per event poll; 10 s keeps a dashboard current at a cost of a few
/// hundred NVML calls per interval on an 8-GPU node.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// How far back a summary looks for GPU events ("the last minutes").
pub const SUMMARY_WINDOW: Duration = Duration::from_secs(300);
/// Events kept for summaries; a GPU that floods (NVLink CRC every poll) cannot grow memory.
const MAX_EVENTS: usize = 512;

/// How the watch runs.
#[derive(Debug, Clone)]
pub struct Options {
    pub interval: Duration,
    /// NVML library to load instead of the driver's (`MUSTER_NVML_LIBRARY`).
    pub library: Option<String>,
}

/// A cheap-to-clone handle on the watch's state. The reader writes it; everyone else reads.
#[derive(Clone)]
pub struct Watch {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// The first fatal event; `None` while the node is healthy.
    fault: tokio::sync::watch::Sender<Option<GpuEvent>>,
    stop: AtomicBool,
}

#[derive(Default)]
struct State {
    latest: Arc<NodeSample>,
    events: VecDeque<GpuEvent>,
    /// (GPU index, XID) → (the GPU, XIDs seen), for `muster_gpu_xid_errors_total`.
    xids: BTreeMap<(u32, u64), (GpuId, u64)>,
}

/// What the metrics read at scrape time.
#[derive(Debug, Clone, Default)]
pub struct View {
    pub sample: Arc<NodeSample>,
    /// `(gpu, xid, count)` for every XID seen since the watch started.
    pub xids: Vec<(GpuId, u64, u64)>,
}

impl Default for Watch {
    fn default() -> Self {
        Self::new()
    }
}

impl Watch {
    /// A watch with no reader: nothing happens until someone calls [`Watch::record`] (the reader,
    /// or a test).
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                fault: tokio::sync::watch::Sender::new(None),
                stop: AtomicBool::new(false),
            }),
        }
    }

    /// Starts the reader threads and returns at once. Without a driver (NVML does not load, or
    /// lists no GPU) the reader says so at debug level and ends; the watch then stays empty.
    pub fn start(opts: Options) -> Self {
        let watch = Self::new();
        reader::spawn(opts, watch.clone());
        watch
    }

    /// Asks the reader threads to end (within a second).
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }

    fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Relaxed)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records an event: logs it, keeps it for summaries, counts XIDs, and makes the first fatal
    /// one the node's fault.
    pub fn record(&self, event: GpuEvent) {
        if event.is_fatal() {
            tracing::error!(
                "GPU fault: {event}; this node is unhealthy: stopping its workers (exit 204)"
            );
        } else if event.kind.xid().is_some() {
            tracing::warn!("GPU event: {event} (not fatal for the node)");
        } else {
            tracing::warn!("GPU event: {event}");
        }
        {
            let mut state = self.state();
            if let Some(xid) = event.kind.xid() {
                state
                    .xids
                    .entry((event.gpu.index, xid))
                    .or_insert_with(|| (event.gpu.clone(), 0))
                    .1 += 1;
            }
            if state.events.len() == MAX_EVENTS {
                state.events.pop_front();
            }
            state.events.push_back(event.clone());
        }
        if event.is_fatal() {
            self.shared.fault.send_if_modified(|fault| {
                if fault.is_some() {
                    return false;
                }
                *fault = Some(event);
                true
            });
        }
    }

    /// Replaces the latest look at the GPUs (what the metrics show).
    pub fn publish(&self, sample: NodeSample) {
        self.state().latest = Arc::new(sample);
    }

    /// The latest look and the XID counts, for a scrape.
    pub fn view(&self) -> View {
        let state = self.state();
        View {
            sample: Arc::clone(&state.latest),
            xids: state
                .xids
                .iter()
                .map(|((_, xid), (gpu, count))| (gpu.clone(), *xid, *count))
                .collect(),
        }
    }

    /// Events at or after `since`, oldest first.
    pub fn recent(&self, since: SystemTime) -> Vec<GpuEvent> {
        self.state()
            .events
            .iter()
            .filter(|e| e.at >= since)
            .cloned()
            .collect()
    }

    /// The summary's lines about this node's GPUs around the time `rank` stopped (`stopped`):
    /// every event of the [`SUMMARY_WINDOW`] before it and any since.
    pub fn summary_lines(&self, rank: u32, stopped: SystemTime) -> Vec<String> {
        let since = stopped
            .checked_sub(SUMMARY_WINDOW)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        self.recent(since)
            .iter()
            .map(|e| e.before(rank, stopped))
            .collect()
    }

    /// The node's fault, if a fatal event has happened.
    pub fn current_fault(&self) -> Option<GpuEvent> {
        self.shared.fault.borrow().clone()
    }

    /// Resolves with the first fatal event (at once if there already was one); never resolves
    /// on a healthy node.
    pub async fn fault(&self) -> GpuEvent {
        let mut rx = self.shared.fault.subscribe();
        if let Ok(fault) = rx.wait_for(Option::is_some).await {
            if let Some(event) = fault.as_ref() {
                return event.clone();
            }
        }
        // The sender lives as long as `self`: this is not reached, but pending is the answer.
        std::future::pending().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(index: u32, kind: EventKind, at: SystemTime) -> GpuEvent {
        GpuEvent {
            gpu: GpuId {
                index,
                uuid: Some(format!("GPU-{index}")),
                pci_bus_id: None,
            },
            at,
            kind,
        }
    }

    #[tokio::test]
    async fn the_first_fatal_event_is_the_fault() {
        let watch = Watch::new();
        let now = SystemTime::now();
        watch.record(event(1, EventKind::Xid(13), now));
        assert_eq!(watch.current_fault(), None);
        let waiter = tokio::spawn({
            let watch = watch.clone();
            async move { watch.fault().await }
        });
        watch.record(event(3, EventKind::Xid(79), now));
        watch.record(event(4, EventKind::Xid(48), now));
        let fault = waiter.await.unwrap();
        assert_eq!((fault.gpu.index, fault.kind), (3, EventKind::Xid(79)));
        assert_eq!(
            watch.fault().await.gpu.index,
            3,
            "later faults do not replace it"
        );
    }

    #[test]
    fn xids_are_counted_per_gpu_and_number() {
        let watch = Watch::new();
        let now = SystemTime::now();
        for kind in [EventKind::Xid(13), EventKind::Xid(13), EventKind::Xid(94)] {
            watch.record(event(1, kind, now));
        }
        watch.record(event(2, EventKind::RowRemapPending, now));
        let counts: Vec<(u32, u64, u64)> = watch
            .view()
            .xids
            .iter()
            .map(|(g, x, n)| (g.index, *x, *n))
            .collect();
        assert_eq!(counts, vec![(1, 13, 2), (1, 94, 1)]);
    }

    #[test]
    fn summaries_see_the_last_minutes_only_and_the_ring_is_bounded() {
        let watch = Watch::new();
        let stopped = SystemTime::now();
        watch.record(event(
            0,
            EventKind::Xid(13),
            stopped - Duration::from_secs(3600),
        ));
        watch.record(event(
            3,
            EventKind::Xid(79),
            stopped - Duration::from_secs(4),
        ));
        let lines = watch.summary_lines(27, stopped);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("GPU 3 (GPU-3, bus id unknown): XID 79"));
        assert!(
            lines[0].ends_with("4 s before rank 27 stopped"),
            "{lines:?}"
        );
        for _ in 0..MAX_EVENTS + 10 {
            watch.record(event(
                5,
                EventKind::NvLinkErrors {
                    replay: 0,
                    recovery: 0,
                    crc: 1,
                },
                stopped,
            ));
        }
        assert_eq!(watch.recent(SystemTime::UNIX_EPOCH).len(), MAX_EVENTS);
    }
}
