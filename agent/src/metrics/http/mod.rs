//! The metrics endpoint: hyper's HTTP/1.1 server on tokio serving `/metrics`, `/healthz`,
//! `/readyz`, `/gangz` and `POST /checkpoint` ([`routes`]).
//!
//! A server facing the pod network, so every input is bounded: a request head over
//! [`MAX_HEAD_BYTES`] gets 431, a body over [`MAX_BODY_BYTES`] gets 413 (bodies are read through
//! `http_body_util::Limited`), a new connection must deliver its first request within
//! `first_request_timeout` and every later request must arrive whole within `request_timeout` of
//! its first byte (408), an idle keep-alive connection is closed after `idle_timeout`, writes time
//! out, chunked bodies are refused (501), line ends must be CRLF (a bare LF or CR is the leniency
//! request smuggling needs: 400), other HTTP versions get 505, and anything hyper cannot parse
//! gets 400 and a close. hyper parses and frames; what it does not check, or times differently,
//! is kept in front of it by [`guard`] and [`wire`]. Nothing in here panics on input. Peers are
//! logged numerically (no reverse lookups on the request path). HTTP/1.1 only: Prometheus and the
//! kubelet speak nothing else to a plain-text port.
//!
//! Every connection is accepted at once and admitted by [`super::conns`]: at most
//! `max_connections_per_peer` per address and `max_connections` in all, the oldest idle one
//! giving way to a new one, so that no number of hostile sockets from another address can keep
//! the kubelet's probes waiting in the kernel's backlog (issue #18). `POST /checkpoint` is only
//! honoured from loopback, or with the bearer token of `--checkpoint-token-file` ([`super::auth`]).
//!
//! Gathering happens in the connection's task: the agent's state is read through atomics and locks
//! held for a few instructions, so a scrape never waits on supervision, and supervision never
//! waits on a scrape.

mod guard;
mod routes;
mod wire;

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{timeout_at, Instant};
use tokio_util::sync::CancellationToken;

use super::auth::CheckpointToken;
use super::conns::{Admission, Limits, Table};
use super::Metrics;
use crate::checkpoint::requests::RequestSlot;
use guard::{Exchange, Guarded};

/// Largest request line plus headers accepted (Prometheus and the kubelet send a few hundred bytes).
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// Largest request body accepted (`POST /checkpoint` needs none).
pub const MAX_BODY_BYTES: usize = 4 * 1024;
/// The content type of the Prometheus text exposition format this endpoint serves.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot serve metrics on {addr}: {source} (choose another --metrics-addr, or none)")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the metrics endpoint's thread: {0}")]
    Thread(#[source] io::Error),
}

/// Limits and probe thresholds of the endpoint.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// `/healthz` fails when the agent loop has not called [`Metrics::heartbeat`] for this long.
    /// Generous on purpose: a failed liveness probe kills the pod and the training run with it.
    pub stale_after: Duration,
    /// An idle keep-alive connection is closed after this long (Prometheus reconnects).
    pub idle_timeout: Duration,
    /// A request must arrive whole within this long of its first byte; also bounds each write.
    pub request_timeout: Duration,
    /// A new connection must deliver its first complete request within this long of being
    /// accepted (Prometheus and the kubelet send theirs at once); silence is closed, a partial
    /// request gets 408.
    pub first_request_timeout: Duration,
    /// Connections open at once, all peers together.
    pub max_connections: usize,
    /// Connections open at once from one peer address.
    pub max_connections_per_peer: usize,
    /// `--checkpoint-token-file`: lets a non-loopback peer with this bearer token trigger a
    /// checkpoint.
    pub checkpoint_token: Option<CheckpointToken>,
    /// Where `POST /checkpoint` delivers its requests (503 while nobody is registered on it).
    pub checkpoint_requests: RequestSlot,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        Self {
            stale_after: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(90),
            request_timeout: Duration::from_secs(10),
            first_request_timeout: Duration::from_secs(5),
            max_connections: 256,
            max_connections_per_peer: 16,
            checkpoint_token: None,
            checkpoint_requests: RequestSlot::default(),
        }
    }
}

/// A bound, not yet serving, metrics endpoint.
#[derive(Debug)]
pub struct Endpoint {
    listener: TcpListener,
    local_addr: SocketAddr,
    metrics: Metrics,
    config: Arc<EndpointConfig>,
}

impl Endpoint {
    /// Binds `addr` (an unspecified address listens dual-stack where IPv6 exists). Must be called
    /// inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        metrics: Metrics,
        config: EndpointConfig,
    ) -> Result<Self, ServeError> {
        let listener = rendezvous::host::bind_listener(addr)
            .and_then(TcpListener::from_std)
            .map_err(|source| ServeError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ServeError::Bind { addr, source })?;
        Ok(Self {
            listener,
            local_addr,
            metrics,
            config: Arc::new(config),
        })
    }

    /// The address actually bound (the port chosen when asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves in a task of its own until `shutdown` is cancelled.
    pub fn spawn(self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        tokio::spawn(self.run(shutdown))
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn run(self, shutdown: CancellationToken) {
        let table = Arc::new(Mutex::new(Table::default()));
        let limits = Limits {
            total: self.config.max_connections,
            per_peer: self.config.max_connections_per_peer,
        };
        // An evicted connection leaves the table at once but its task lives on until it has
        // closed (a response under way, a linger): the table alone bounds the admitted
        // connections, not the tasks and their buffers. Under a flood of new connections that
        // kept thousands of closing tasks alive at a time (the agent's RSS +47 MiB in
        // test_http_endpoint's attack). Past this many live tasks, accepting pauses and new
        // connections wait in the listen backlog until closing ones are gone (milliseconds).
        let live = Arc::new(Semaphore::new(limits.total.max(1) * LIVE_TASKS_PER_SLOT));
        let mut backoff = Duration::from_millis(10);
        loop {
            let permit = tokio::select! {
                () = shutdown.cancelled() => return,
                permit = Arc::clone(&live).acquire_owned() => permit,
            };
            let Ok(permit) = permit else {
                return; // never closed
            };
            let accepted = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = self.listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, peer)) => {
                    backoff = Duration::from_millis(10);
                    let evict = shutdown.child_token();
                    let ip = peer.ip().to_canonical();
                    let admission = lock(&table).admit(ip, evict.clone(), limits);
                    let id = match admission {
                        Admission::Admitted { id, evicted } => {
                            if let Some(limit) = evicted {
                                self.metrics.traffic().count_http_shed(limit);
                            }
                            id
                        }
                        Admission::Refused(limit) => {
                            // Every candidate is busy writing a response: close the new one.
                            self.metrics.traffic().count_http_shed(limit);
                            drop(stream);
                            continue;
                        }
                    };
                    let slot = Slot {
                        table: Arc::clone(&table),
                        id,
                    };
                    let serve = serve_connection(
                        stream,
                        peer,
                        self.metrics.clone(),
                        Arc::clone(&self.config),
                        evict,
                        slot,
                    );
                    tokio::spawn(async move {
                        serve.await;
                        drop(permit);
                    });
                }
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("metrics endpoint: accept failed: {err}");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// Live connection tasks allowed per admitted connection: the admitted ones plus as many
/// evicted ones still closing.
const LIVE_TASKS_PER_SLOT: usize = 2;

/// A connection's entry in the admission table, released when its task ends.
struct Slot {
    table: Arc<Mutex<Table>>,
    id: u64,
}

impl Slot {
    fn set_busy(&self, busy: bool) {
        lock(&self.table).set_busy(self.id, busy);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.table).remove(self.id);
    }
}

/// The table is only touched for a few instructions at a time; a poisoned lock is taken over.
fn lock(table: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An endpoint serving on a thread of its own (see [`serve_in_thread`]); stops when dropped.
#[derive(Debug)]
pub struct Serving {
    local_addr: SocketAddr,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Serving {
    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops serving and waits for the thread (bounded by the endpoint's own timeouts).
    pub fn stop(mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Binds `addr` and serves on a dedicated thread with its own single-threaded runtime, until
/// `shutdown` is cancelled or the returned [`Serving`] is dropped.
///
/// The agent supervises its workers on one thread; serving from another one means a scrape
/// (gather + encode) never takes time from supervision, and `/healthz` still answers — with 503
/// — when the agent's own thread is stuck, instead of timing out.
pub fn serve_in_thread(
    addr: SocketAddr,
    metrics: Metrics,
    config: EndpointConfig,
    shutdown: &CancellationToken,
) -> Result<Serving, ServeError> {
    // Bound here, on the caller's thread: a port someone else holds is the caller's error at
    // once, and the launch never waits for the thread and its runtime to start (that wait was
    // ~1 ms of every agent's start).
    let listener = rendezvous::host::bind_listener(addr)
        .map_err(|source| ServeError::Bind { addr, source })?;
    let local_addr = listener
        .local_addr()
        .map_err(|source| ServeError::Bind { addr, source })?;
    let stop = shutdown.child_token();
    let token = stop.clone();
    let thread =
        rendezvous::host::spawn_runtime_thread("muster-metrics".to_owned(), move || async move {
            match TcpListener::from_std(listener) {
                Ok(listener) => {
                    let endpoint = Endpoint {
                        listener,
                        local_addr,
                        metrics,
                        config: Arc::new(config),
                    };
                    endpoint.run(token).await;
                }
                Err(err) => tracing::warn!("metrics endpoint on {local_addr} stopped: {err}"),
            }
        })
        .map_err(ServeError::Thread)?;
    Ok(Serving {
        local_addr,
        stop,
        thread: Some(thread),
    })
}

/// hyper's read buffer: a whole head (checked by [`wire`] first) and a body fit, with room for
/// the next pipelined head's start.
const HYPER_BUF_BYTES: usize = 2 * (MAX_HEAD_BYTES + MAX_BODY_BYTES);

async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    metrics: Metrics,
    config: Arc<EndpointConfig>,
    evict: CancellationToken,
    slot: Slot,
) {
    // Responses are written in one piece, so Nagle would only add latency.
    let _ = stream.set_nodelay(true);
    let exchange = Arc::new(Exchange::default());
    let io = Guarded::new(stream, &config, Arc::clone(&exchange), slot);
    let context = Arc::new(routes::Context {
        peer,
        metrics: metrics.clone(),
        config,
        evict: evict.clone(),
        exchange,
    });
    let service =
        service_fn(move |request| Box::pin(routes::respond(request, Arc::clone(&context))));
    let mut connection = http1::Builder::new()
        // The wire looks as it did before hyper: `Content-Length`, not `content-length`.
        .title_case_headers(true)
        .max_buf_size(HYPER_BUF_BYTES)
        // `guard` keeps the deadlines (see there why hyper's single one does not fit).
        .header_read_timeout(None)
        .serve_connection(TokioIo::new(io), service);
    let mut draining = false;
    let served = loop {
        tokio::select! {
            served = std::future::poll_fn(|cx| connection.poll_without_shutdown(cx)) => break served,
            // Evicted, or the endpoint stops: finish the response under way, then close.
            () = evict.cancelled(), if !draining => {
                draining = true;
                std::pin::Pin::new(&mut connection).graceful_shutdown();
            }
        }
    };
    if let Err(err) = served {
        if err.is_parse() {
            // hyper answered it itself (400, or 431 if its buffer filled).
            let status = if err.is_parse_too_large() { 431 } else { 400 };
            metrics.traffic().count_http_request("other", status);
        }
        tracing::debug!(%peer, "metrics endpoint: connection ended: {err}");
    }
    let mut io = connection.into_parts().io.into_inner();
    if io.closed_by_server() {
        tokio::select! {
            () = evict.cancelled() => {}
            () = linger(io.stream(), Instant::now() + LINGER) => {}
        }
    }
}

/// How long a closing connection keeps reading what the peer still sends.
const LINGER: Duration = Duration::from_millis(500);
/// How much a closing connection reads and discards at most.
const LINGER_BYTES: usize = 64 * 1024;

/// Closes our side, then reads and discards what the peer is still sending for a moment: closing
/// a socket with unread input makes the kernel send a reset, which can destroy the error response
/// before the peer reads it (RFC 9112 §9.6).
async fn linger(stream: &mut TcpStream, deadline: Instant) {
    if timeout_at(deadline, stream.shutdown()).await.is_err() {
        return;
    }
    let mut chunk = [0u8; 4096];
    let mut discarded = 0;
    while discarded < LINGER_BYTES {
        match timeout_at(deadline, stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => discarded += n,
            _ => return,
        }
    }
}
