//! Signals sent to the agent: each handled signal gets the action `--signals-to-handle` gave it.
//!
//! - `terminate` (torchrun's only behaviour; the default except for SIGTERM): stop the group with
//!   that signal, SIGKILL after `--shutdown-timeout`. A second stop signal while stopping sends
//!   SIGKILL at once (the impatient Ctrl-C), unless it came within
//!   [`REPEAT_WINDOW`] of the first: then it is the same request delivered twice
//!   (coreutils `timeout`, a terminal and a forwarding wrapper all do that) and changes nothing.
//! - `checkpoint` (SIGTERM's default): a [`TerminateHook`] (the preemption checkpoint barrier)
//!   takes over; it decides when to call [`StopRequest::request`]. Without a hook, as `terminate`.
//! - `forward`: pass it to every worker's process group and keep running.
//! - `ignore`: log it.
//!
//! Listeners are installed by [`install`] before the first worker is spawned.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::{SignalAction, SignalPolicy};
use super::observe::{Event, Publisher};
use super::reaper::Reaper;
pub use super::repeat::{Repeat, StopSignals, REPEAT_WINDOW};

/// A request to stop the worker group: which signal to stop it with, and whether to skip the
/// grace period. Cheap to clone; the first request wins.
#[derive(Clone)]
pub struct StopRequest {
    token: CancellationToken,
    kill_now: CancellationToken,
    signal: Arc<Mutex<Option<Signal>>>,
    /// For a [`StopRequest::child`]: the parent's signal, which wins over the child's own.
    parent_signal: Option<Arc<Mutex<Option<Signal>>>>,
}

impl StopRequest {
    /// A stop request that is also triggered when `parent` is cancelled (with SIGTERM).
    pub fn new(parent: &CancellationToken) -> Self {
        Self {
            token: parent.child_token(),
            kill_now: CancellationToken::new(),
            signal: Arc::default(),
            parent_signal: None,
        }
    }

    /// A request for one attempt: requested with this one, or on its own (the multi-node
    /// rendezvous stops the group when the gang must re-form) without touching this one.
    #[must_use]
    pub fn child(&self) -> Self {
        Self {
            token: self.token.child_token(),
            kill_now: self.kill_now.clone(),
            signal: Arc::default(),
            parent_signal: Some(Arc::clone(&self.signal)),
        }
    }

    /// Asks for the group to be stopped with `sig` (the first request's signal is kept).
    pub fn request(&self, sig: Signal) {
        {
            let mut s = self.signal.lock().unwrap_or_else(PoisonError::into_inner);
            if s.is_none() && !self.token.is_cancelled() {
                *s = Some(sig);
            }
        }
        self.token.cancel();
    }

    pub fn is_requested(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves once a stop was requested.
    pub async fn requested(&self) {
        self.token.cancelled().await;
    }

    /// The signal that asked for the stop, if a signal did.
    pub fn received_signal(&self) -> Option<Signal> {
        let parent = self
            .parent_signal
            .as_ref()
            .and_then(|p| *p.lock().unwrap_or_else(PoisonError::into_inner));
        parent.or(*self.signal.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The signal to stop workers with: the one received, else SIGTERM.
    pub fn signal(&self) -> Signal {
        self.received_signal().unwrap_or(Signal::SIGTERM)
    }

    /// Skips what is left of the grace period.
    pub fn kill_now(&self) {
        self.kill_now.cancel();
    }

    pub fn is_killed_now(&self) -> bool {
        self.kill_now.is_cancelled()
    }

    pub async fn killed_now(&self) {
        self.kill_now.cancelled().await;
    }
}

/// Called instead of stopping at once when a `terminate` signal arrives; it must eventually call
/// [`StopRequest::request`] (after a checkpoint barrier, say).
pub type TerminateHook = Arc<
    dyn Fn(Signal, StopRequest) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> + Send + Sync,
>;

/// The listener tasks; dropping this removes nothing (signal dispositions stay installed, which
/// is what PID 1 needs) but stops reacting.
pub struct Listeners(Vec<JoinHandle<()>>);

impl Drop for Listeners {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Installs a listener for every signal of `policy`.
pub fn install(
    policy: &SignalPolicy,
    stop: &StopRequest,
    reaper: &Reaper,
    publisher: &Publisher,
    hook: Option<&TerminateHook>,
) -> std::io::Result<Listeners> {
    let mut tasks = Vec::new();
    // Shared by every listener: a SIGINT and a SIGTERM from one wrapper are one request too.
    let seen = Arc::new(Mutex::new(StopSignals::default()));
    for &(sig, action) in &policy.actions {
        let mut stream = signal(SignalKind::from_raw(sig as i32))?;
        let stop = stop.clone();
        let reaper = reaper.clone();
        let publisher = publisher.clone();
        let hook = hook.cloned();
        let seen = Arc::clone(&seen);
        tasks.push(tokio::spawn(async move {
            while stream.recv().await.is_some() {
                publisher.event(Event::SignalReceived {
                    signal: sig,
                    action,
                });
                let stopping = matches!(action, SignalAction::Terminate | SignalAction::Checkpoint);
                let repeat = stopping.then(|| {
                    seen.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .arrived(Instant::now())
                });
                match action {
                    _ if repeat == Some(Repeat::Duplicate) => {
                        tracing::info!(
                            "{sig} again within {:.0}s of the first stop signal: the same request, \
                             still stopping gracefully",
                            REPEAT_WINDOW.as_secs_f64()
                        );
                    }
                    SignalAction::Terminate | SignalAction::Checkpoint if stop.is_requested() => {
                        tracing::warn!("{sig} again while stopping: killing the workers now");
                        stop.kill_now();
                    }
                    SignalAction::Checkpoint if hook.is_some() => {
                        if let Some(hook) = &hook {
                            tokio::spawn(hook(sig, stop.clone()));
                        }
                    }
                    SignalAction::Terminate | SignalAction::Checkpoint => {
                        tracing::info!("{sig} received: stopping the workers");
                        stop.request(sig);
                    }
                    SignalAction::Forward => {
                        tracing::info!("{sig} received: forwarding it to the workers");
                        reaper.signal_all(sig);
                    }
                    SignalAction::Ignore => tracing::info!("{sig} received: ignored"),
                }
            }
        }));
    }
    Ok(Listeners(tasks))
}
