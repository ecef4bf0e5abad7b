//! The TCPStore server: accept loop, admission limit, per-connection tasks and shutdown.
//!
//! One [`State`] sits behind one mutex, the way libuv's single event-loop thread owns its map: a
//! connection task decodes every complete request in its receive buffer and applies them in one
//! short critical section (no `.await` happens while the lock is held, so `std::sync::Mutex` is
//! the right tool). Every byte owed to a client — its own replies and the STOP_WAITING bytes that
//! other clients' writes release — is appended to that client's outbox *under the same lock*,
//! which totally orders them; the client's task then writes the outbox out. That ordering is what
//! keeps WAIT/CANCEL_WAIT race-free.
//!
//! Memory is bounded three ways (docs/store.md § A hostile client): the state refuses to grow
//! past `max_store_bytes`; a connection whose unread replies pass `max_pending_output` is
//! neither decoded nor read from until they drain (and is closed if it stays stuck for
//! `write_stall_timeout`); and one request may not grow a receive buffer past
//! [`MAX_REQUEST_BYTES`].
//!
//! `muster store` runs the server on one current-thread runtime, which busy-polls its sockets
//! for a moment after serving a request; see docs/store.md § Performance. One thread is also
//! what keeps requests in arrival order across connections (epoll reports ready sockets first
//! come, first served, and a current-thread runtime runs woken tasks in that order): a SET, which
//! has no reply, followed by a GET from another connection reads the new value. Several loops,
//! or a multi-thread runtime's LIFO slot, can serve the GET first.
//!
//! Listening follows libuv (`UvTcpServer::makeWithPort`, through [`crate::host::bind_listener`]):
//! dual-stack `[::]` where possible, backlog = `somaxconn`, TCP_NODELAY on every accepted socket.
//! Peers are only ever formatted numerically: no name lookup happens on the accept or request path (reverse DNS there stalls
//! for seconds in pods; see shared/reference/performance.md §2.1).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use socket2::{SockRef, TcpKeepalive};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{futures::Notified, Notify};
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::busy_poll::{busy_poll, Activity};
use super::protocol::{reply, Command, DecodeError, Request, VALIDATION_MAGIC};
use super::state::{ClientId, Limits, State, StateError};

/// Connections accepted at once unless configured otherwise. Far above any real job's agent and
/// worker count per store; the cap exists so a runaway client cannot exhaust file descriptors.
pub const DEFAULT_MAX_CONNECTIONS: usize = 65_536;

/// Bytes the store may hold unless configured otherwise (keys, values, queues and waiters, each
/// with a per-entry overhead; see [`super::state::ENTRY_OVERHEAD`]). A job's stores hold
/// kilobytes (rank assignments, bootstrap addresses) to a few megabytes (a large world's
/// gloo/NCCL exchange); 1 GiB is far above that and far below a training pod's memory limit,
/// so a client that fills it gets its connection closed instead of the agent OOM-killed.
pub const DEFAULT_MAX_STORE_BYTES: usize = 1 << 30;

/// Reply bytes one connection may have queued before the server stops decoding its requests
/// (backpressure); also the longest reply one request may produce. A torch client sends one
/// request and reads its reply before the next, so it never queues more than one reply (at most
/// one 8 MiB value, or a MULTI_GET); only a client that pipelines requests without reading the
/// replies reaches this. 64 MiB is eight of the largest values torch allows: a pipelining client
/// still has plenty in flight, and one that does not read costs the store at most this much
/// (plus the reply being written) instead of one read's worth of GETs of an 8 MiB value
/// (16 KiB of 10-byte GETs asked for 13 GiB).
pub const DEFAULT_MAX_PENDING_OUTPUT: usize = 64 << 20;

/// How long a connection that went past [`DEFAULT_MAX_PENDING_OUTPUT`] may leave its replies
/// unread (no byte accepted by its socket) before it is closed. Only pipelining clients get
/// there, so the deadline cannot catch a torch client paused in a debugger; it frees a stuck
/// hostile connection's memory and slot instead of holding them until the peer goes away.
pub const DEFAULT_WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest request accepted: the receive buffer of a connection never holds more than this of
/// one request. The codec bounds each field (8 KiB keys, 8 MiB values, 131,072 keys) but not
/// their product: a MULTI_SET could announce 131,072 values of 8 MiB (1 TiB). A torch client's
/// requests are one key and value (at most 8 MiB + 8 KiB) or a list of keys; 64 MiB leaves a
/// MULTI_SET of seven full-size values or ~1 million 50-byte keys.
pub const MAX_REQUEST_BYTES: usize = 64 << 20;

/// Receive buffer of an idle connection. Small, because a job's store holds one connection per
/// agent and per worker, mostly idle: 16k connections × 1 KiB is 16 MiB.
const IDLE_BUFFER: usize = 1024;

/// Receive buffer grown to while requests stream in; libuv reads in 4 KiB chunks, we take a
/// little more so a batch of pipelined requests is usually one read.
const READ_CHUNK: usize = 16 * 1024;

/// How long the accept loop pauses after an accept error (EMFILE, ENFILE, ...) before trying
/// again, so a descriptor shortage does not become a busy loop.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// Server settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Connections beyond this are accepted and closed at once, with a log line.
    pub max_connections: usize,
    /// How long the event loop keeps polling its sockets, instead of sleeping in epoll, after
    /// the last request it served. Zero (the default) never polls. See docs/store.md §
    /// Performance for when it pays off; it only works on a current-thread runtime.
    pub busy_poll: Duration,
    /// TCP keep-alive on every accepted socket: idle time before the first probe, which is also
    /// the interval between probes; after [`KEEPALIVE_PROBES`] unanswered probes the kernel resets
    /// the connection. `None` (the default) leaves the system's setting (usually off). The
    /// rendezvous store sets it so a peer whose host vanished without a FIN shows as closed.
    pub tcp_keepalive: Option<Duration>,
    /// Bytes the store may hold; a request that would pass it closes its connection (there is
    /// no reply code for it in the protocol), and the store keeps serving everyone else.
    pub max_store_bytes: usize,
    /// Reply bytes a connection may have queued before its requests stop being decoded until
    /// the client reads; also the longest single reply.
    pub max_pending_output: usize,
    /// How long a connection past `max_pending_output` may read nothing before it is closed.
    pub write_stall_timeout: Duration,
}

/// Unanswered keep-alive probes before the kernel gives up on a peer.
pub const KEEPALIVE_PROBES: u32 = 2;

impl Default for Config {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            busy_poll: Duration::ZERO,
            tcp_keepalive: None,
            max_store_bytes: DEFAULT_MAX_STORE_BYTES,
            max_pending_output: DEFAULT_MAX_PENDING_OUTPUT,
            write_stall_timeout: DEFAULT_WRITE_STALL_TIMEOUT,
        }
    }
}

/// Why the server could not start or keep running.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the store's thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("the store's thread ended before it was listening")]
    ThreadLost,
}

/// Counters for observability, updated with relaxed atomics (never a lock on the request path).
#[derive(Debug, Default)]
pub struct Stats {
    pub connections_open: AtomicUsize,
    pub connections_accepted: AtomicU64,
    /// Connections closed at once because `max_connections` were open.
    pub connections_refused: AtomicU64,
    /// Connections closed for a protocol violation (bad handshake, oversized length, ...).
    pub protocol_errors: AtomicU64,
    pub bytes_received: AtomicU64,
    pub bytes_sent: AtomicU64,
    /// Clients blocked in WAIT or BARRIER.
    pub blocked_clients: AtomicUsize,
    /// Regular keys in the store.
    pub keys: AtomicUsize,
    /// Bytes the store holds, as charged against `max_store_bytes`.
    pub bytes_stored: AtomicUsize,
    /// Requests refused because the store was full (their connections were closed).
    pub store_full: AtomicU64,
    /// Times a connection's requests stopped being decoded because its unread replies passed
    /// `max_pending_output`.
    pub backpressured: AtomicU64,
    requests: [AtomicU64; Command::ALL.len()],
    /// Peer addresses of the open connections. Touched once per connection open and close, never
    /// per request; read by the rendezvous host to tell a late peer (connection open) from a
    /// gone one.
    open_peers: Mutex<HashSet<SocketAddr>>,
    /// Notified on every close: the rendezvous host judges its members at once (a member whose
    /// agent died is lost at the speed of that evidence, not at its next keep-alive tick).
    closes: tokio::sync::Notify,
}

impl Stats {
    /// Whether a connection from `peer` is open now (IPv4-mapped IPv6 peers of a dual-stack
    /// listener match their IPv4 address).
    pub fn is_open(&self, peer: SocketAddr) -> bool {
        self.open_peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&canonical(peer))
    }

    fn peer_opened(&self, peer: SocketAddr) {
        self.open_peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(canonical(peer));
    }

    fn peer_closed(&self, peer: SocketAddr) {
        self.open_peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&canonical(peer));
        // One stored permit: the watcher that is not waiting right now looks at its next wait.
        self.closes.notify_one();
    }

    /// Notified whenever a connection closes (see [`Stats::is_open`]).
    pub fn closes(&self) -> &tokio::sync::Notify {
        &self.closes
    }

    /// Requests served for `command` since start.
    pub fn requests(&self, command: Command) -> u64 {
        self.requests[usize::from(command.code())].load(Ordering::Relaxed)
    }
}

/// What every connection task shares.
struct Shared {
    inner: Mutex<Inner>,
    stats: Arc<Stats>,
    max_pending_output: usize,
    write_stall_timeout: Duration,
}

struct Inner {
    state: State,
    outboxes: HashMap<ClientId, Outbox>,
    next_client: ClientId,
    /// Set once at shutdown; a connection registering after it closes at once.
    closing: bool,
}

/// Bytes owed to one client, and the signal that wakes its task to send them.
struct Outbox {
    pending: BytesMut,
    notify: Arc<Notify>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock would be a bug in `State`; the data is still coherent
        // enough to keep serving other clients, so poisoning is not propagated.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells every connection to close. Shutdown travels through each connection's own
    /// `Notify` rather than a shared token: a connection task polls its wake-up future on every
    /// request, and one future shared by thousands of connections would put one mutex (the
    /// token's waiter list) on every request's path.
    fn close_all(&self) {
        let mut inner = self.lock();
        inner.closing = true;
        for outbox in inner.outboxes.values() {
            outbox.notify.notify_one();
        }
    }

    fn is_closing(&self) -> bool {
        self.lock().closing
    }
}

/// A bound, not yet running, store server.
pub struct Server {
    listener: TcpListener,
    local_addr: SocketAddr,
    config: Config,
    shared: Arc<Shared>,
}

impl Server {
    /// Binds `addr`. An unspecified address (`0.0.0.0` or `[::]`) listens dual-stack on `[::]`
    /// where the host has IPv6, else on `0.0.0.0`. Port 0 picks a free port.
    // async although nothing is awaited: registering the socket with tokio needs a runtime, and
    // an async signature makes "called outside a runtime" a compile error instead of a panic.
    #[allow(clippy::unused_async)]
    pub async fn bind(addr: SocketAddr, config: Config) -> Result<Server, ServerError> {
        let listener = crate::host::bind_listener(addr)
            .and_then(TcpListener::from_std)
            .map_err(|source| ServerError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ServerError::Bind { addr, source })?;
        Ok(Server {
            listener,
            local_addr,
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    state: State::with_limits(Limits {
                        max_bytes: config.max_store_bytes,
                        max_reply: config.max_pending_output,
                    }),
                    outboxes: HashMap::new(),
                    next_client: 1,
                    closing: false,
                }),
                stats: Arc::new(Stats::default()),
                max_pending_output: config.max_pending_output,
                write_stall_timeout: config.write_stall_timeout,
            }),
            config,
        })
    }

    /// The address actually bound (with the chosen port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Live counters of this server.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.shared.stats)
    }

    /// Serves until `shutdown` is cancelled, then closes every connection.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServerError> {
        let tasks = TaskTracker::new();
        let stats = Arc::clone(&self.shared.stats);
        info!(
            addr = %self.local_addr,
            busy_poll_us = self.config.busy_poll.as_micros(),
            max_store_bytes = self.config.max_store_bytes,
            "store listening"
        );
        let activity = Arc::new(Activity::default());
        if !self.config.busy_poll.is_zero() {
            let activity = Arc::clone(&activity);
            let window = self.config.busy_poll;
            let shutdown = shutdown.clone();
            tasks.spawn(async move { busy_poll(&activity, window, &shutdown).await });
        }
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = self.listener.accept() => accepted,
            };
            let (stream, peer) = match accepted {
                Ok(pair) => pair,
                Err(err) => {
                    warn!(error = %err, "accept failed; pausing before the next accept");
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(ACCEPT_ERROR_BACKOFF) => continue,
                    }
                }
            };
            if stats.connections_open.load(Ordering::Relaxed) >= self.config.max_connections {
                stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                warn!(%peer, limit = self.config.max_connections, "connection limit reached; closing new connection");
                drop(stream);
                continue;
            }
            stats.connections_accepted.fetch_add(1, Ordering::Relaxed);
            stats.connections_open.fetch_add(1, Ordering::Relaxed);
            stats.peer_opened(peer);
            if let Some(idle) = self.config.tcp_keepalive {
                set_keepalive(&stream, idle, peer);
            }
            let shared = Arc::clone(&self.shared);
            let activity = Arc::clone(&activity);
            tasks.spawn(async move {
                serve_connection(stream, peer, &shared, &activity).await;
                shared.stats.peer_closed(peer);
                shared
                    .stats
                    .connections_open
                    .fetch_sub(1, Ordering::Relaxed);
            });
        }
        self.shared.close_all();
        tasks.close();
        tasks.wait().await;
        info!(addr = %self.local_addr, "store stopped");
        Ok(())
    }
}

/// A server on a thread of its own, with its own current-thread runtime: how a process whose
/// main runtime is multi-threaded (the agent) hosts a store. A multi-thread runtime would break
/// the arrival order across connections (its LIFO slot runs the last woken connection first:
/// a GET sent after another connection's SET read the old value in ~30 % of rounds).
///
/// Dropping it stops the server too, without waiting.
pub struct ServerThread {
    local_addr: SocketAddr,
    stats: Arc<Stats>,
    stop: DropGuard,
    stopped: tokio::sync::oneshot::Receiver<()>,
}

impl ServerThread {
    /// Binds `addr` on the new thread and starts serving; returns once it listens.
    pub async fn start(addr: SocketAddr, config: Config) -> Result<ServerThread, ServerError> {
        let (listening_tx, listening) = tokio::sync::oneshot::channel();
        let (stopped_tx, stopped) = tokio::sync::oneshot::channel();
        let stop = CancellationToken::new();
        let token = stop.clone();
        crate::host::spawn_runtime_thread(format!("store-{}", addr.port()), move || async move {
            match Server::bind(addr, config).await {
                Ok(server) => {
                    let _ = listening_tx.send(Ok((server.local_addr(), server.stats())));
                    if let Err(err) = server.run(token).await {
                        warn!(%addr, "store stopped: {err}");
                    }
                }
                Err(err) => drop(listening_tx.send(Err(err))),
            }
            let _ = stopped_tx.send(());
        })
        .map_err(ServerError::Thread)?;
        let (local_addr, stats) = listening.await.map_err(|_| ServerError::ThreadLost)??;
        Ok(ServerThread {
            local_addr,
            stats,
            stop: stop.drop_guard(),
            stopped,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Live counters of this server.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.stats)
    }

    /// Closes every connection and waits up to `patience` for the thread to finish; `false` when
    /// it did not (a stuck server is abandoned, not waited for forever).
    pub async fn shutdown(self, patience: Duration) -> bool {
        drop(self.stop);
        matches!(
            tokio::time::timeout(patience, self.stopped).await,
            Ok(Ok(()))
        )
    }
}

fn canonical(peer: SocketAddr) -> SocketAddr {
    SocketAddr::new(peer.ip().to_canonical(), peer.port())
}

/// Keep-alive probes every `idle` (at least 1 s, the kernel's unit) once the connection is idle
/// that long; a failure only costs the evidence, so it is logged, not fatal.
fn set_keepalive(stream: &TcpStream, idle: Duration, peer: SocketAddr) {
    let idle = idle.max(Duration::from_secs(1));
    let keepalive = TcpKeepalive::new()
        .with_time(idle)
        .with_interval(idle)
        .with_retries(KEEPALIVE_PROBES);
    if let Err(err) = SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        debug!(%peer, error = %err, "cannot set TCP keep-alive");
    }
}

/// Why a connection ended, for the log.
enum Close {
    PeerClosed,
    Shutdown,
    Io(std::io::Error),
    Protocol(String),
    /// The client went past one of the memory bounds (store full, a reply or request too
    /// large, replies left unread past the deadline).
    Limit(String),
}

async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    activity: &Activity,
) {
    if let Err(err) = stream.set_nodelay(true) {
        debug!(%peer, error = %err, "cannot set TCP_NODELAY");
    }
    let notify = Arc::new(Notify::new());
    let id = {
        let mut inner = shared.lock();
        if inner.closing {
            return;
        }
        let id = inner.next_client;
        inner.next_client += 1;
        inner.outboxes.insert(
            id,
            Outbox {
                pending: BytesMut::new(),
                notify: Arc::clone(&notify),
            },
        );
        id
    };
    let close = connection_loop(&mut stream, id, &notify, shared, activity).await;
    {
        let mut inner = shared.lock();
        inner.state.cancel_wait(id);
        inner.outboxes.remove(&id);
        shared
            .stats
            .blocked_clients
            .store(inner.state.blocked_clients(), Ordering::Relaxed);
        // A disconnected waiter's registrations were given back.
        shared
            .stats
            .bytes_stored
            .store(inner.state.bytes(), Ordering::Relaxed);
    }
    match close {
        Close::PeerClosed | Close::Shutdown => debug!(%peer, "connection closed"),
        Close::Io(err) => debug!(%peer, error = %err, "connection failed"),
        Close::Protocol(reason) => {
            shared.stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
            warn!(%peer, "closing connection: {reason}");
        }
        Close::Limit(reason) => warn!(%peer, "closing connection: {reason}"),
    }
}

async fn connection_loop(
    stream: &mut TcpStream,
    id: ClientId,
    notify: &Notify,
    shared: &Shared,
    activity: &Activity,
) -> Close {
    let stats = &shared.stats;
    let mut inbuf = BytesMut::with_capacity(IDLE_BUFFER);
    let mut validated = false;
    // Kept across iterations so that it is registered with the `Notify` once, not once per
    // request; replaced only after it fires.
    let mut woken = pin!(notify.notified());
    // Complete requests were left in `inbuf` because the replies before them passed
    // `max_pending_output`: they are served once those replies are written, and nothing more is
    // read from the client until then (its own TCP window then stops it sending).
    let mut held_back = false;
    loop {
        let batch = if held_back {
            activity.served_batch();
            process(&mut inbuf, id, &mut validated, shared)
        } else {
            tokio::select! {
                read = stream.read_buf(&mut inbuf) => match read {
                    Ok(0) => return Close::PeerClosed,
                    Ok(n) => {
                        stats.bytes_received.fetch_add(n as u64, Ordering::Relaxed);
                        let batch = process(&mut inbuf, id, &mut validated, shared);
                        activity.served_batch();
                        if batch.result.is_ok() && !batch.held_back {
                            if inbuf.is_empty() && inbuf.capacity() > READ_CHUNK {
                                // Give back what a large value needed once.
                                inbuf = BytesMut::with_capacity(IDLE_BUFFER);
                            } else if inbuf.capacity() - inbuf.len() < IDLE_BUFFER {
                                // read_buf needs spare capacity (with none it would read 0
                                // bytes, which looks like end of stream); grow in chunks while
                                // data streams in.
                                inbuf.reserve(if n >= IDLE_BUFFER { READ_CHUNK } else { IDLE_BUFFER });
                            }
                        }
                        batch
                    }
                    Err(err) => return Close::Io(err),
                },
                // Another client's write released us (send the STOP_WAITING byte(s) queued for
                // us), or the server is shutting down.
                () = woken.as_mut() => {
                    woken.set(notify.notified());
                    match take_pending(id, shared) {
                        Some(reply) => Batch { reply, result: Ok(()), held_back: false },
                        None => return Close::Shutdown,
                    }
                }
            }
        };
        let Batch {
            reply,
            mut result,
            held_back: cut,
        } = batch;
        held_back = cut;
        if result.is_ok() && !held_back && inbuf.len() > MAX_REQUEST_BYTES {
            // What is left is one incomplete request, already longer than any accepted.
            result = Err(Close::Limit(format!(
                "request longer than {MAX_REQUEST_BYTES} bytes ({} received so far)",
                inbuf.len()
            )));
        }
        if let Err(close) = result {
            // Replies to the requests before the bad one are still owed.
            let _ = write(stream, &reply, notify, &mut woken, shared, None).await;
            return close;
        }
        // Only a connection that went past the cap has a deadline for reading its replies.
        let stall = held_back.then_some(shared.write_stall_timeout);
        let mut pending = reply;
        loop {
            match write(stream, &pending, notify, &mut woken, shared, stall).await {
                Ok(Written::All) => break,
                Ok(Written::AllAndWoken) => match take_pending(id, shared) {
                    Some(more) => pending = more,
                    None => return Close::Shutdown,
                },
                Err(close) => return close,
            }
        }
    }
}

/// What one pass over a connection's receive buffer produced.
struct Batch {
    /// Bytes now owed to the client.
    reply: BytesMut,
    /// Whether the connection may go on.
    result: Result<(), Close>,
    /// Complete requests were left undecoded because `reply` passed `max_pending_output`.
    held_back: bool,
}

/// Decodes and applies every complete request in `inbuf`, under one lock, until the reply
/// passes `max_pending_output`. The reply includes whatever was queued for this client before
/// (taken under the same lock, so nothing queued for it can be reordered).
fn process(inbuf: &mut BytesMut, id: ClientId, validated: &mut bool, shared: &Shared) -> Batch {
    let stats = &shared.stats;
    let mut guard = shared.lock();
    let inner = &mut *guard;
    let mut reply = inner
        .outboxes
        .get_mut(&id)
        .map(|o| std::mem::take(&mut o.pending))
        .unwrap_or_default();
    let mut woken = Vec::new();
    let mut result = Ok(());
    let mut held_back = false;
    loop {
        if reply.len() >= shared.max_pending_output && !inbuf.is_empty() {
            stats.backpressured.fetch_add(1, Ordering::Relaxed);
            held_back = true;
            break;
        }
        let request = match Request::decode(inbuf) {
            Ok(Some(request)) => request,
            Ok(None) => break,
            Err(err) => {
                result = Err(Close::Protocol(decode_reason(&err)));
                break;
            }
        };
        let command = request.command();
        stats.requests[usize::from(command.code())].fetch_add(1, Ordering::Relaxed);
        if !*validated {
            // Classic closes a connection whose first message is not a valid VALIDATE; libuv
            // half-accepts some such streams (see tcpstore-protocol.md §1.2). Closing is the
            // clear behaviour, and no real client is affected.
            match request {
                Request::Validate { magic } if magic == VALIDATION_MAGIC => {
                    *validated = true;
                    continue;
                }
                Request::Validate { magic } => {
                    result = Err(Close::Protocol(format!(
                        "bad VALIDATE magic {magic:#010x} (expected {VALIDATION_MAGIC:#010x}); \
                         is the client a pre-2.1 PyTorch?"
                    )));
                }
                _ => {
                    result = Err(Close::Protocol(format!(
                        "first message was {} instead of VALIDATE",
                        command.name()
                    )));
                }
            }
            break;
        }
        if let Err(err) = inner.state.apply(id, request, &mut reply, &mut woken) {
            result = Err(match err {
                StateError::UnexpectedValidate => Close::Protocol("VALIDATE sent twice".to_owned()),
                other @ StateError::NotANumber { .. } => Close::Protocol(other.to_string()),
                other @ StateError::StoreFull { .. } => {
                    stats.store_full.fetch_add(1, Ordering::Relaxed);
                    Close::Limit(other.to_string())
                }
                other @ StateError::ReplyTooLarge { .. } => Close::Limit(other.to_string()),
            });
            break;
        }
    }
    for other in woken {
        if other == id {
            // A pipelined write released our own wait: its byte follows our earlier replies.
            reply.put_u8(reply::STOP_WAITING);
        } else if let Some(outbox) = inner.outboxes.get_mut(&other) {
            outbox.pending.put_u8(reply::STOP_WAITING);
            outbox.notify.notify_one();
        }
    }
    stats
        .blocked_clients
        .store(inner.state.blocked_clients(), Ordering::Relaxed);
    stats.keys.store(inner.state.num_keys(), Ordering::Relaxed);
    stats
        .bytes_stored
        .store(inner.state.bytes(), Ordering::Relaxed);
    Batch {
        reply,
        result,
        held_back,
    }
}

fn decode_reason(err: &DecodeError) -> String {
    format!("malformed request: {err}")
}

/// Takes whatever other clients' writes queued for this client; `None` once the server is
/// shutting down.
fn take_pending(id: ClientId, shared: &Shared) -> Option<BytesMut> {
    let mut inner = shared.lock();
    if inner.closing {
        return None;
    }
    Some(
        inner
            .outboxes
            .get_mut(&id)
            .map(|outbox| outbox.pending.split())
            .unwrap_or_default(),
    )
}

/// How a write ended.
enum Written {
    All,
    /// A wake-up arrived while the socket was full; the caller owes it a look.
    AllAndWoken,
}

/// Writes bytes owed to the client: at once when the socket takes them (the common case: a
/// reply is a few bytes), else waiting for room while still hearing shutdown, so a client that
/// stops reading cannot hold its task past shutdown. With a `stall` deadline, a client whose
/// socket takes no byte for that long is closed.
async fn write<'n>(
    stream: &mut TcpStream,
    mut pending: &[u8],
    notify: &'n Notify,
    woken: &mut Pin<&mut Notified<'n>>,
    shared: &Shared,
    stall: Option<Duration>,
) -> Result<Written, Close> {
    let total = pending.len();
    let mut was_woken = false;
    let deadline = |stall: Duration| tokio::time::Instant::now() + stall;
    let mut stalled_at = stall.map(deadline);
    while !pending.is_empty() {
        match stream.try_write(pending) {
            // A socket that takes nothing would spin this loop forever (write_all's WriteZero).
            Ok(0) => return Err(Close::Io(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => {
                pending = &pending[n..];
                stalled_at = stall.map(deadline);
            }
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                let give_up = async {
                    match stalled_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    ready = stream.writable() => ready.map_err(Close::Io)?,
                    () = give_up => {
                        return Err(Close::Limit(format!(
                            "it read none of its replies for {} s with {} bytes of them unsent \
                             (past the {}-byte backlog limit)",
                            stall.unwrap_or_default().as_secs(),
                            pending.len(),
                            shared.max_pending_output,
                        )));
                    }
                    () = woken.as_mut() => {
                        woken.set(notify.notified());
                        if shared.is_closing() {
                            return Err(Close::Shutdown);
                        }
                        was_woken = true;
                    }
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return Err(Close::Io(err)),
        }
    }
    shared
        .stats
        .bytes_sent
        .fetch_add(total as u64, Ordering::Relaxed);
    Ok(if was_woken {
        Written::AllAndWoken
    } else {
        Written::All
    })
}
