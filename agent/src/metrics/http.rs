//! The metrics endpoint: a small HTTP/1.1 server on tokio serving `/metrics`, `/healthz`,
//! `/readyz`, `/gangz` and `POST /checkpoint`.
//!
//! Hand-written rather than hyper to keep the PID-1 binary's compile time and dependency tree
//! small; it only has to serve four fixed routes to Prometheus and the kubelet. It is still a
//! server facing the pod network, so every input is bounded: a request head over
//! [`MAX_HEAD_BYTES`] gets 431, a body over [`MAX_BODY_BYTES`] gets 413, a new connection must
//! deliver its first request head within `first_request_timeout` and every later request must
//! arrive whole within `request_timeout` of its first byte (408), an idle keep-alive connection is
//! closed after `idle_timeout`, writes time out, chunked bodies are refused (501), line ends must
//! be CRLF (a bare LF or CR is the leniency request smuggling needs: 400), and anything that does
//! not parse gets 400 and a close. Nothing in here panics on input. Peers are logged numerically
//! (no reverse lookups on the request path).
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

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout_at, Instant};
use tokio_util::sync::CancellationToken;

use super::auth::{self, CheckpointToken, Rejected};
use super::conns::{Admission, Limits, Table};
use super::{CheckpointDelivery, CheckpointTrigger, Metrics, Readiness};

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
        let std_listener = bind_std(addr).map_err(|source| ServeError::Bind { addr, source })?;
        let listener = TcpListener::from_std(std_listener)
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
        let mut backoff = Duration::from_millis(10);
        loop {
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
                                self.metrics.count_http_shed(limit);
                            }
                            id
                        }
                        Admission::Refused(limit) => {
                            // Every candidate is busy writing a response: close the new one.
                            self.metrics.count_http_shed(limit);
                            drop(stream);
                            continue;
                        }
                    };
                    let metrics = self.metrics.clone();
                    let config = Arc::clone(&self.config);
                    let slot = Slot {
                        table: Arc::clone(&table),
                        id,
                    };
                    tokio::spawn(async move {
                        serve_connection(stream, peer, &metrics, &config, &evict, &slot).await;
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
    let stop = shutdown.child_token();
    let token = stop.clone();
    let (bound_tx, bound_rx) = std::sync::mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("muster-metrics".to_owned())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(err) => {
                    let _ = bound_tx.send(Err(ServeError::Thread(err)));
                    return;
                }
            };
            runtime.block_on(async move {
                match Endpoint::bind(addr, metrics, config) {
                    Ok(endpoint) => {
                        let _ = bound_tx.send(Ok(endpoint.local_addr()));
                        endpoint.run(token).await;
                    }
                    Err(err) => {
                        let _ = bound_tx.send(Err(err));
                    }
                }
            });
        })
        .map_err(ServeError::Thread)?;
    let bound = bound_rx.recv().unwrap_or_else(|_| {
        Err(ServeError::Thread(io::Error::other(
            "the metrics thread ended before binding",
        )))
    });
    match bound {
        Ok(local_addr) => Ok(Serving {
            local_addr,
            stop,
            thread: Some(thread),
        }),
        Err(err) => {
            let _ = thread.join();
            Err(err)
        }
    }
}

fn bind_std(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    if addr.ip().is_unspecified() {
        let v6 = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), addr.port());
        match bind_socket(v6, true) {
            Ok(listener) => return Ok(listener),
            // The port is taken: that is the answer, not a reason to try IPv4 only.
            Err(err) if err.kind() == io::ErrorKind::AddrInUse => return Err(err),
            // No IPv6 in this pod: fall back to what was asked.
            Err(_) => {}
        }
    }
    bind_socket(addr, false)
}

fn bind_socket(addr: SocketAddr, dual_stack: bool) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // A restarted agent must be able to rebind while old connections sit in TIME_WAIT.
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(!dual_stack)?;
    }
    socket.bind(&addr.into())?;
    // Connections are accepted as fast as they come (admission happens after accept), so the
    // backlog only absorbs bursts; a large one keeps a burst from dropping a probe's SYN.
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Get,
    Head,
    Post,
    Other,
}

struct Request {
    method: Method,
    path: String,
    keep_alive: bool,
    /// The credentials of `Authorization: Bearer …`; never logged (see the `Debug` below).
    bearer: Option<Vec<u8>>,
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("method", &self.method)
            .field("path", &self.path)
            .field("keep_alive", &self.keep_alive)
            .field("bearer", &self.bearer.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Why a request could not be read; each maps to a status and a close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reject {
    BadRequest,
    Timeout,
    BodyTooLarge,
    HeadTooLarge,
    ChunkedBody,
    BadVersion,
}

impl Reject {
    fn status(self) -> u16 {
        match self {
            Reject::BadRequest => 400,
            Reject::Timeout => 408,
            Reject::BodyTooLarge => 413,
            Reject::HeadTooLarge => 431,
            Reject::ChunkedBody => 501,
            Reject::BadVersion => 505,
        }
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    metrics: &Metrics,
    config: &EndpointConfig,
    evict: &CancellationToken,
    slot: &Slot,
) {
    // Responses are written in one piece, so Nagle would only add latency.
    let _ = stream.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::with_capacity(1024);
    // The first request must be complete this soon after the accept; later ones only have the
    // keep-alive idle timeout and `request_timeout`.
    let mut first_deadline = Some(Instant::now() + config.first_request_timeout);
    loop {
        let read = read_request(&mut stream, &mut buf, config, first_deadline, evict).await;
        first_deadline = None;
        slot.set_busy(true);
        let (response, keep_alive) = match read {
            Ok(None) => return,
            Ok(Some(request)) => {
                let response = route(&request, peer, metrics, config);
                let keep = request.keep_alive && !evict.is_cancelled();
                (response.finish(request.method == Method::Head, keep), keep)
            }
            Err(reject) => {
                tracing::debug!(%peer, status = reject.status(), "metrics endpoint: rejected request");
                metrics.count_http_request("other", reject.status());
                let response =
                    Response::text(reject.status(), format!("{}\n", reason(reject.status())));
                (response.finish(false, false), false)
            }
        };
        let deadline = Instant::now() + config.request_timeout;
        let written = timeout_at(deadline, stream.write_all(&response)).await;
        slot.set_busy(false);
        match written {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::debug!(%peer, "metrics endpoint: write failed: {err}");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "metrics endpoint: write timed out");
                return;
            }
        }
        if !keep_alive {
            tokio::select! {
                () = evict.cancelled() => {}
                () = linger(&mut stream, deadline.min(Instant::now() + LINGER)) => {}
            }
            return;
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

/// Reads one request into `buf` (which keeps any pipelined bytes that follow it). `Ok(None)`: the
/// peer closed, the connection idled out, or it was evicted or the endpoint is shutting down.
/// `first_deadline`: the whole request must be in by then (a new connection's first request).
async fn read_request(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    config: &EndpointConfig,
    first_deadline: Option<Instant>,
    evict: &CancellationToken,
) -> Result<Option<Request>, Reject> {
    let mut request_deadline = (!buf.is_empty()).then(|| Instant::now() + config.request_timeout);
    let idle_deadline = Instant::now() + config.idle_timeout;
    let deadline = |request_deadline: Option<Instant>| {
        let own = request_deadline.unwrap_or(idle_deadline);
        first_deadline.map_or(own, |first| own.min(first))
    };
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(head_len) = head_end(buf)? {
            let head = parse_head(&buf[..head_len])?;
            let total = head_len + head.content_length;
            if head.expect_continue && buf.len() < total {
                // curl waits a second for this before sending a body it announced.
                if !matches!(
                    timeout_at(
                        deadline(request_deadline),
                        stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                    )
                    .await,
                    Ok(Ok(()))
                ) {
                    return Ok(None);
                }
            }
            while buf.len() < total {
                match read_some(stream, &mut chunk, deadline(request_deadline), evict).await {
                    ReadOutcome::Data(n) => buf.extend_from_slice(&chunk[..n]),
                    ReadOutcome::Closed | ReadOutcome::Shutdown => return Ok(None),
                    ReadOutcome::TimedOut => return Err(Reject::Timeout),
                }
            }
            // The body is not used by any route; drop it with the head.
            buf.drain(..total);
            return Ok(Some(head.request));
        }
        if buf.len() >= MAX_HEAD_BYTES {
            return Err(Reject::HeadTooLarge);
        }
        match read_some(stream, &mut chunk, deadline(request_deadline), evict).await {
            ReadOutcome::Data(n) => {
                buf.extend_from_slice(&chunk[..n]);
                request_deadline.get_or_insert_with(|| Instant::now() + config.request_timeout);
            }
            ReadOutcome::Closed | ReadOutcome::Shutdown => return Ok(None),
            ReadOutcome::TimedOut if buf.is_empty() => return Ok(None),
            ReadOutcome::TimedOut => return Err(Reject::Timeout),
        }
    }
}

enum ReadOutcome {
    Data(usize),
    Closed,
    TimedOut,
    Shutdown,
}

async fn read_some(
    stream: &mut TcpStream,
    chunk: &mut [u8],
    deadline: Instant,
    shutdown: &CancellationToken,
) -> ReadOutcome {
    tokio::select! {
        () = shutdown.cancelled() => ReadOutcome::Shutdown,
        read = timeout_at(deadline, stream.read(chunk)) => match read {
            Err(_) => ReadOutcome::TimedOut,
            Ok(Ok(0) | Err(_)) => ReadOutcome::Closed,
            Ok(Ok(n)) => ReadOutcome::Data(n),
        },
    }
}

/// Length of the request head including its blank line, if it is complete. Line ends must be
/// CRLF: a bare LF or a bare CR anywhere in the head is a 400 at once (RFC 9112 §2.2 allows a
/// server to accept a bare LF, but a server that does and a proxy that does not disagree on where
/// a request ends, which is what request smuggling needs).
fn head_end(buf: &[u8]) -> Result<Option<usize>, Reject> {
    for (i, &b) in buf.iter().enumerate() {
        match b {
            b'\n' if i == 0 || buf[i - 1] != b'\r' => return Err(Reject::BadRequest),
            b'\r' if buf.get(i + 1).is_some_and(|next| *next != b'\n') => {
                return Err(Reject::BadRequest)
            }
            b'\n' if i >= 3 && &buf[i - 3..=i] == b"\r\n\r\n" => return Ok(Some(i + 1)),
            _ => {}
        }
    }
    Ok(None)
}

struct Head {
    request: Request,
    content_length: usize,
    /// `Expect: 100-continue`: the client waits for a go-ahead before sending the body.
    expect_continue: bool,
}

fn parse_head(head: &[u8]) -> Result<Head, Reject> {
    if head.len() > MAX_HEAD_BYTES {
        return Err(Reject::HeadTooLarge);
    }
    let text = std::str::from_utf8(head).map_err(|_| Reject::BadRequest)?;
    if text.bytes().enumerate().any(|(i, b)| {
        (b == b'\n' && (i == 0 || head[i - 1] != b'\r'))
            || (b == b'\r' && head.get(i + 1) != Some(&b'\n'))
    }) {
        return Err(Reject::BadRequest);
    }
    let mut lines = text.split("\r\n");
    let request_line = lines.next().ok_or(Reject::BadRequest)?;
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Reject::BadRequest);
    };
    if method.is_empty() || !method.bytes().all(is_token_byte) {
        return Err(Reject::BadRequest);
    }
    let http11 = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        v if v.starts_with("HTTP/") => return Err(Reject::BadVersion),
        _ => return Err(Reject::BadRequest),
    };
    let path = request_path(target).ok_or(Reject::BadRequest)?;

    let mut content_length: Option<usize> = None;
    let mut connection_close = false;
    let mut connection_keep_alive = false;
    let mut expect_continue = false;
    let mut bearer = None;
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let (name, value) = line.split_once(':').ok_or(Reject::BadRequest)?;
        if name.is_empty() || !name.bytes().all(is_token_byte) {
            return Err(Reject::BadRequest);
        }
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let n: usize = value.parse().map_err(|_| Reject::BadRequest)?;
            if content_length.is_some_and(|m| m != n) {
                return Err(Reject::BadRequest);
            }
            if n > MAX_BODY_BYTES {
                return Err(Reject::BodyTooLarge);
            }
            content_length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Reject::ChunkedBody);
        } else if name.eq_ignore_ascii_case("expect") {
            expect_continue = value.eq_ignore_ascii_case("100-continue");
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(',').map(str::trim) {
                connection_close |= token.eq_ignore_ascii_case("close");
                connection_keep_alive |= token.eq_ignore_ascii_case("keep-alive");
            }
        } else if name.eq_ignore_ascii_case("authorization") {
            // Two Authorization headers are ambiguous: honour neither.
            let credentials = match value.split_once(' ') {
                Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => {
                    Some(rest.trim().as_bytes().to_vec())
                }
                _ => None,
            };
            bearer = if bearer.is_none() {
                Some(credentials)
            } else {
                Some(None)
            };
        }
    }
    let method = match method {
        "GET" => Method::Get,
        "HEAD" => Method::Head,
        "POST" => Method::Post,
        _ => Method::Other,
    };
    let keep_alive = if http11 {
        !connection_close
    } else {
        connection_keep_alive && !connection_close
    };
    Ok(Head {
        request: Request {
            method,
            path,
            keep_alive,
            bearer: bearer.flatten(),
        },
        content_length: content_length.unwrap_or(0),
        expect_continue,
    })
}

/// The path of an origin-form (`/metrics?x`) or absolute-form (`http://host/metrics`) target.
fn request_path(target: &str) -> Option<String> {
    let target = match target.split_once("://") {
        Some((_scheme, rest)) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => target,
    };
    if !target.starts_with('/') {
        return None;
    }
    let path = target.split(['?', '#']).next().unwrap_or(target);
    Some(path.to_owned())
}

/// RFC 9110 `tchar`.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

struct Response {
    status: u16,
    content_type: &'static str,
    body: Vec<u8>,
    /// One more header (`Allow` on a 405, `WWW-Authenticate` on a 401).
    extra: Option<(&'static str, &'static str)>,
}

impl Response {
    fn text(status: u16, body: String) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into_bytes(),
            extra: None,
        }
    }

    /// Status line, headers and (unless HEAD) body in one buffer, written with one call.
    fn finish(self, head_only: bool, keep_alive: bool) -> Vec<u8> {
        use std::fmt::Write as _;
        let mut head = String::with_capacity(192);
        let _ = write!(
            head,
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: {}\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len(),
            if keep_alive { "keep-alive" } else { "close" },
        );
        if let Some((name, value)) = self.extra {
            let _ = write!(head, "{name}: {value}\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        if !head_only {
            out.extend_from_slice(&self.body);
        }
        out
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

const INDEX: &str = "muster agent\n\
GET  /metrics     Prometheus metrics\n\
GET  /healthz     liveness: the agent loop is alive\n\
GET  /readyz      readiness: this agent can play its part for the others (independent of peers)\n\
GET  /gangz       the gang has formed and this node's workers are running\n\
POST /checkpoint  ask the gang to checkpoint (loopback, or a bearer token)\n";

fn route(
    request: &Request,
    peer: SocketAddr,
    metrics: &Metrics,
    config: &EndpointConfig,
) -> Response {
    let read_only = matches!(request.method, Method::Get | Method::Head);
    let (handler, response) = match request.path.as_str() {
        "/metrics" if read_only => {
            let mut response = Response::text(200, String::new());
            response.content_type = METRICS_CONTENT_TYPE;
            response.body = metrics.encode();
            ("metrics", response)
        }
        "/healthz" if read_only => ("healthz", healthz(metrics, config)),
        "/readyz" if read_only => ("readyz", readyz(metrics)),
        "/gangz" if read_only => ("gangz", gangz(metrics)),
        "/checkpoint" if request.method == Method::Post => (
            "checkpoint",
            checkpoint(request, peer.ip(), metrics, config),
        ),
        "/" if read_only => ("other", Response::text(200, INDEX.to_owned())),
        "/metrics" | "/healthz" | "/readyz" | "/gangz" | "/" => {
            ("other", not_allowed("GET, HEAD", "use GET\n"))
        }
        "/checkpoint" => ("other", not_allowed("POST", "use POST\n")),
        _ => ("other", Response::text(404, "not found\n".to_owned())),
    };
    metrics.count_http_request(handler, response.status);
    response
}

fn not_allowed(allow: &'static str, body: &str) -> Response {
    let mut response = Response::text(405, body.to_owned());
    response.extra = Some(("Allow", allow));
    response
}

fn healthz(metrics: &Metrics, config: &EndpointConfig) -> Response {
    let age = metrics.heartbeat_age();
    if age <= config.stale_after {
        Response::text(200, "ok\n".to_owned())
    } else {
        Response::text(
            503,
            format!(
                "unhealthy: the agent loop has been silent for {:.1}s (limit {}s)\n",
                age.as_secs_f64(),
                config.stale_after.as_secs()
            ),
        )
    }
}

fn readyz(metrics: &Metrics) -> Response {
    match metrics.readiness() {
        Readiness::Ready => Response::text(200, "ready\n".to_owned()),
        Readiness::Starting => Response::text(
            503,
            "not ready: starting (reading the configuration, binding ports)\n".to_owned(),
        ),
        Readiness::HostingStore => Response::text(
            503,
            "not ready: node 0's rendezvous store is not accepting connections yet\n".to_owned(),
        ),
    }
}

fn gangz(metrics: &Metrics) -> Response {
    if metrics.is_gang_running() {
        Response::text(200, "gang running\n".to_owned())
    } else {
        Response::text(
            503,
            format!(
                "gang not running: phase {}, {} local workers running\n",
                metrics.phase().as_str(),
                metrics.workers_running()
            ),
        )
    }
}

fn checkpoint(
    request: &Request,
    peer: IpAddr,
    metrics: &Metrics,
    config: &EndpointConfig,
) -> Response {
    match auth::authorize(
        peer,
        request.bearer.as_deref(),
        config.checkpoint_token.as_ref(),
    ) {
        Ok(()) => {}
        Err(rejected) => {
            metrics.checkpoint_rejected(rejected);
            tracing::debug!(%peer, reason = rejected.as_str(), "POST /checkpoint refused");
            return match rejected {
                Rejected::Forbidden => Response::text(
                    403,
                    "forbidden: POST /checkpoint is only accepted from inside the pod \
                     (kubectl exec POD -- curl -X POST localhost:8000/checkpoint), \
                     or with the bearer token of --checkpoint-token-file\n"
                        .to_owned(),
                ),
                Rejected::Unauthorized => {
                    let mut response = Response::text(
                        401,
                        "unauthorized: a valid Authorization: Bearer token is required\n"
                            .to_owned(),
                    );
                    response.extra = Some(("WWW-Authenticate", "Bearer realm=\"muster\""));
                    response
                }
            };
        }
    }
    match metrics.request_checkpoint(CheckpointTrigger::Http) {
        CheckpointDelivery::Delivered => Response::text(202, "checkpoint requested\n".to_owned()),
        CheckpointDelivery::AlreadyPending => {
            Response::text(202, "checkpoint already requested\n".to_owned())
        }
        CheckpointDelivery::NoConsumer => {
            Response::text(503, "checkpoint barrier not available\n".to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_parse_and_garbage_is_rejected() {
        let head = parse_head(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert_eq!(head.request.path, "/metrics");
        assert_eq!(head.request.method, Method::Get);
        assert!(head.request.keep_alive);
        let head = parse_head(b"GET http://pod:8000/readyz HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!(head.request.path, "/readyz");
        assert!(!head.request.keep_alive);
        let head = parse_head(
            b"POST /checkpoint HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\nAuthorization: Bearer t0k\r\n\r\n",
        )
        .unwrap();
        assert_eq!(head.content_length, 3);
        assert!(!head.request.keep_alive);
        assert_eq!(head.request.bearer.as_deref(), Some(&b"t0k"[..]));
        assert!(
            !format!("{:?}", head.request).contains("t0k"),
            "the token is never logged"
        );
        let head = parse_head(
            b"POST / HTTP/1.1\r\nAuthorization: Bearer a\r\nAuthorization: Bearer a\r\n\r\n",
        )
        .unwrap();
        assert_eq!(
            head.request.bearer, None,
            "two Authorization headers: neither counts"
        );
        let head = parse_head(b"POST / HTTP/1.1\r\nAuthorization: Basic YTpi\r\n\r\n").unwrap();
        assert_eq!(head.request.bearer, None);

        let cases: [(&[u8], Reject); 8] = [
            (b"\r\n\r\n", Reject::BadRequest),
            (b"GET\r\n\r\n", Reject::BadRequest),
            (b"GET /  HTTP/1.1\r\n\r\n", Reject::BadRequest),
            (b"GET metrics HTTP/1.1\r\n\r\n", Reject::BadRequest),
            (b"GET / HTTP/2.0\r\n\r\n", Reject::BadVersion),
            (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", Reject::BadRequest),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                Reject::ChunkedBody,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 999999\r\n\r\n",
                Reject::BodyTooLarge,
            ),
        ];
        for (input, want) in cases {
            assert_eq!(
                parse_head(input).err(),
                Some(want),
                "{}",
                String::from_utf8_lossy(input)
            );
        }
        assert_eq!(
            parse_head(b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n").err(),
            Some(Reject::BadRequest)
        );
        assert_eq!(
            parse_head(b"GET /\xff HTTP/1.1\r\n\r\n").err(),
            Some(Reject::BadRequest)
        );
    }

    proptest::proptest! {
        #[test]
        fn parsing_arbitrary_bytes_never_panics(input in proptest::collection::vec(proptest::num::u8::ANY, 0..2048)) {
            let _ = head_end(&input);
            let _ = parse_head(&input);
        }

        #[test]
        fn parsing_request_like_text_never_panics(
            method in "[A-Z]{0,8}",
            target in "[ -~]{0,40}",
            headers in proptest::collection::vec("[ -~]{0,60}", 0..8),
        ) {
            let text = format!("{method} {target} HTTP/1.1\r\n{}\r\n\r\n", headers.join("\r\n"));
            if let Ok(head) = parse_head(text.as_bytes()) {
                proptest::prop_assert!(head.request.path.starts_with('/'));
                proptest::prop_assert!(head.content_length <= MAX_BODY_BYTES);
            }
        }
    }

    #[test]
    fn head_end_finds_the_first_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\nrest"), Ok(Some(18)));
        assert_eq!(
            head_end(b"GET / HTTP/1.1\r\n\r\nbody\nwith\rbare ends"),
            Ok(Some(18)),
            "only the head must use CRLF"
        );
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), Ok(None));
        assert_eq!(
            head_end(b"GET / HTTP/1.1\r\nHost: x\r"),
            Ok(None),
            "a CR may end a read"
        );
    }

    #[test]
    fn bare_line_ends_are_rejected() {
        for input in [
            &b"GET / HTTP/1.1\n\n"[..],
            b"GET / HTTP/1.1\nHost: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\n\n",
            b"\nGET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\rHost: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n",
            b"GET / HTTP/1.1\n",
        ] {
            assert_eq!(
                head_end(input),
                Err(Reject::BadRequest),
                "{}",
                String::from_utf8_lossy(input).escape_debug()
            );
            assert_eq!(
                parse_head(input).err(),
                Some(Reject::BadRequest),
                "{}",
                String::from_utf8_lossy(input).escape_debug()
            );
        }
    }
}
