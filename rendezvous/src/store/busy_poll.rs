//! The busy poll that keeps the store's event loop from sleeping while requests flow; why, and
//! what it costs, is in docs/store.md § Performance.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How connection tasks tell the busy poller that requests are flowing.
#[derive(Default)]
pub(super) struct Activity {
    /// Request batches served; the poller keeps polling while this moves.
    batches: AtomicU64,
    /// Set while the poller sleeps, so that only the first request after a quiet spell pays for
    /// waking it.
    poller_asleep: AtomicBool,
    wake_poller: Notify,
}

impl Activity {
    pub(super) fn served_batch(&self) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        if self.poller_asleep.load(Ordering::Relaxed) {
            self.wake_poller.notify_one();
        }
    }
}

/// Keeps the event loop from sleeping while requests are flowing: after a request, for up to
/// `window` without another one, this task yields instead of letting the runtime block in
/// epoll. A yielded task makes tokio's scheduler poll the I/O driver with a zero timeout, so a
/// request that arrives meanwhile is read at once, without the wake-up of a sleeping thread.
///
/// Why: a closed-loop client (one connection doing request, reply, request, ...) pays two
/// thread wake-ups per round trip, one on each side. On virtual machines a wake-up of an idle
/// CPU costs tens of microseconds (an IPI through the hypervisor), several times the work of
/// the request itself; not sleeping removes the server's half of it. The price is at most
/// `window` of one CPU after each burst of requests; a busy server never spins, since it
/// always has a ready socket, and an idle one never does, since the poller sleeps.
///
/// The zero-timeout poll only reaches the I/O driver on a current-thread runtime (a
/// multi-thread runtime leaves the driver to whichever worker is parked in it), which is what
/// `muster store` runs.
pub(super) async fn busy_poll(activity: &Activity, window: Duration, shutdown: &CancellationToken) {
    loop {
        activity.poller_asleep.store(true, Ordering::Relaxed);
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = activity.wake_poller.notified() => {}
        }
        activity.poller_asleep.store(false, Ordering::Relaxed);
        let mut seen = activity.batches.load(Ordering::Relaxed);
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < window {
            tokio::task::yield_now().await;
            let batches = activity.batches.load(Ordering::Relaxed);
            if batches != seen {
                seen = batches;
                quiet_since = Instant::now();
            }
        }
    }
}
