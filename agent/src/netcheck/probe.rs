//! The measurement listener and client: plain TCP between two agents' advertised addresses.
//!
//! # Wire format
//! The caller opens with a hello: `MNC1` and the listener's 16-byte token (published in the
//! store for this round only). Then any number of pings, `P` + 8 bytes echoed back as sent (up
//! to [`MAX_PINGS`]), and at most one stream: `S`, the byte count (u64 BE) and the time limit in
//! milliseconds (u32 BE), followed by the bytes. The listener counts what arrives until the
//! count or the time limit is reached, answers `R` + bytes (u64 BE) + microseconds from the
//! first byte to the last (u64 BE), then the share of the stream's time its process spent
//! runnable but waiting for a CPU (per mille, u64 BE; `u64::MAX` when the kernel does not say),
//! and closes. The receiver counts, so bytes still sitting in the sender's socket buffer never
//! pass for throughput. A caller reads the first 17 bytes of the answer as before and the wait
//! only if it comes, so an older listener is still understood.
//!
//! # Who may call it, and what strangers cost
//! Only callers that present the token: a gang member reads it from the store next to the port.
//! Anything else (a wrong or late hello, a port scanner, a health checker) is closed after
//! [`Limits::hello_timeout`] at the latest. Callers that have not said hello yet are bounded by
//! [`Limits::max_pending`]; past it the oldest is closed, so a flood of idle connections can
//! delay a gang member's hello by no more than the flood's own rate, never block it. Sessions
//! (after the hello) are bounded by [`Limits::max_sessions`]; each reads at most
//! [`Limits::max_stream_bytes`] and lives at most [`Limits::session_timeout`]. The listener
//! itself lives only while the check runs.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, timeout_at, Instant};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::verdict::Sample;

/// The first bytes of every hello.
pub const MAGIC: &[u8; 4] = b"MNC1";
/// Pings one session may send (a client sends [`PINGS`]).
pub const MAX_PINGS: u32 = 64;
/// Pings per measurement: the shortest of five ignores scheduling hiccups on a loaded host.
pub const PINGS: usize = 5;
/// One write of the stream.
const CHUNK: usize = 64 * 1024;

/// A listener's secret for one round.
pub type Token = [u8; 16];

/// What the listener allows.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A caller that has not sent a valid hello by then is closed.
    pub hello_timeout: Duration,
    /// Connections waiting for their hello; past it the oldest is closed.
    pub max_pending: usize,
    /// Sessions after a valid hello; past it new ones are closed.
    pub max_sessions: usize,
    /// The most one stream may send; a larger request is cut to this.
    pub max_stream_bytes: u64,
    /// The longest one stream may last.
    pub max_stream_time: Duration,
    /// The longest one session may last.
    pub session_timeout: Duration,
}

impl Limits {
    /// The limits for a check with `budget` and streams of `stream_bytes`.
    pub fn for_budget(budget: Duration, stream_bytes: u64) -> Self {
        Self {
            // A gang member sends its hello right after connecting: one round trip.
            hello_timeout: Duration::from_millis(500).min(budget),
            // Each node expects one caller in round 1 and a few in round 2.
            max_pending: 64,
            max_sessions: 16,
            max_stream_bytes: stream_bytes,
            max_stream_time: budget,
            session_timeout: budget * 2,
        }
    }
}

/// A running measurement listener. Dropping it (or [`Listener::close`]) stops it and every
/// session.
pub struct Listener {
    addr: SocketAddr,
    token: Token,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Listener {
    /// Binds `ip` on a free port.
    pub async fn bind(ip: IpAddr, limits: Limits) -> std::io::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let addr = listener.local_addr()?;
        let token: Token = rand::random();
        let stop = CancellationToken::new();
        let task = tokio::spawn(accept_loop(listener, token, limits, stop.clone()));
        Ok(Self {
            addr,
            token,
            stop,
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn token(&self) -> Token {
        self.token
    }

    /// Stops accepting and ends every session.
    pub async fn close(mut self) {
        self.stop.cancel();
        let _ = (&mut self.task).await;
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A connection still owing its hello: closed first when too many wait.
struct Pending {
    cancel: CancellationToken,
    done: Arc<AtomicBool>,
}

async fn accept_loop(listener: TcpListener, token: Token, limits: Limits, stop: CancellationToken) {
    let sessions = Arc::new(Semaphore::new(limits.max_sessions));
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut backoff = Duration::from_millis(1);
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => {
                backoff = Duration::from_millis(1);
                a
            }
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                debug!("network check listener: accept failed: {e}");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_millis(100));
                continue;
            }
        };
        pending.retain(|p| !p.done.load(Ordering::Relaxed));
        if pending.len() >= limits.max_pending {
            if let Some(oldest) = pending.pop_front() {
                oldest.cancel.cancel();
            }
        }
        let cancel = stop.child_token();
        let done = Arc::new(AtomicBool::new(false));
        pending.push_back(Pending {
            cancel: cancel.clone(),
            done: done.clone(),
        });
        let limits = limits.clone();
        let sessions = sessions.clone();
        tokio::spawn(async move {
            let outcome = tokio::select! {
                () = cancel.cancelled() => Err("closed".to_owned()),
                r = serve(stream, &token, &limits, &sessions, &done) => r,
            };
            done.store(true, Ordering::Relaxed);
            if let Err(why) = outcome {
                debug!("network check listener: {peer}: {why}");
            }
        });
    }
}

/// One connection: the hello within the limit, then the session.
async fn serve(
    mut stream: TcpStream,
    token: &Token,
    limits: &Limits,
    sessions: &Semaphore,
    done: &AtomicBool,
) -> Result<(), String> {
    let mut hello = [0u8; 20];
    timeout_at(
        Instant::now() + limits.hello_timeout,
        stream.read_exact(&mut hello),
    )
    .await
    .map_err(|_| "no hello in time".to_owned())?
    .map_err(|e| format!("hello: {e}"))?;
    if &hello[..4] != MAGIC || hello[4..] != token[..] {
        return Err("wrong hello".to_owned());
    }
    // A member: no longer among the connections that may be closed to make room.
    done.store(true, Ordering::Relaxed);
    let _permit = sessions
        .try_acquire()
        .map_err(|_| "too many sessions".to_owned())?;
    let _ = stream.set_nodelay(true);
    timeout_at(
        Instant::now() + limits.session_timeout,
        session(&mut stream, limits),
    )
    .await
    .map_err(|_| "session out of time".to_owned())?
}

async fn session(stream: &mut TcpStream, limits: &Limits) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    let mut pings = 0;
    loop {
        let mut cmd = [0u8; 1];
        if stream.read(&mut cmd).await.map_err(io)? == 0 {
            return Ok(());
        }
        match cmd[0] {
            b'P' if pings < MAX_PINGS => {
                pings += 1;
                let mut msg = [0u8; 9];
                msg[0] = b'P';
                stream.read_exact(&mut msg[1..]).await.map_err(io)?;
                stream.write_all(&msg).await.map_err(io)?;
            }
            b'S' => {
                let mut head = [0u8; 12];
                stream.read_exact(&mut head).await.map_err(io)?;
                let (count, millis) = head.split_at(8);
                let want = u64::from_be_bytes(count.try_into().map_err(|_| "header")?)
                    .min(limits.max_stream_bytes);
                let time = Duration::from_millis(u64::from(u32::from_be_bytes(
                    millis.try_into().map_err(|_| "header")?,
                )))
                .min(limits.max_stream_time);
                let waited = CpuWait::start();
                let (bytes, micros) = receive(stream, want, time).await.map_err(io)?;
                let permille = waited.permille().map_or(u64::MAX, u64::from);
                let mut reply = [0u8; 25];
                reply[0] = b'R';
                reply[1..9].copy_from_slice(&bytes.to_be_bytes());
                reply[9..17].copy_from_slice(&micros.to_be_bytes());
                reply[17..].copy_from_slice(&permille.to_be_bytes());
                stream.write_all(&reply).await.map_err(io)?;
                let _ = stream.shutdown().await;
                return Ok(());
            }
            other => return Err(format!("unexpected command byte {other}")),
        }
    }
}

/// Reads up to `want` bytes for at most `time` after the first one: (bytes, µs first to last).
async fn receive(stream: &mut TcpStream, want: u64, time: Duration) -> std::io::Result<(u64, u64)> {
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0u64;
    // The first byte may take up to `time` too (a slowed link's queue).
    let mut end = Instant::now() + time;
    let mut first: Option<Instant> = None;
    let mut last = Instant::now();
    while got < want {
        let room = usize::try_from(want - got).unwrap_or(CHUNK).min(CHUNK);
        let n = tokio::select! {
            () = sleep_until(end) => break,
            r = stream.read(&mut buf[..room]) => r?,
        };
        if n == 0 {
            break;
        }
        let now = Instant::now();
        if first.is_none() {
            first = Some(now);
            end = now + time;
        }
        last = now;
        got += n as u64;
    }
    let micros = first.map_or(0, |f| {
        u64::try_from(last.duration_since(f).as_micros()).unwrap_or(u64::MAX)
    });
    Ok((got, micros.max(1)))
}

/// The time this process's threads spent runnable but waiting for a CPU, summed over its
/// threads (the second field of each `/proc/self/task/<tid>/schedstat`, in nanoseconds);
/// `None` where the kernel does not say (no schedstats, no /proc).
fn run_queue_wait() -> Option<Duration> {
    let mut total = 0u64;
    let mut any = false;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else {
            // A thread that ended since the listing.
            continue;
        };
        if let Some(ns) = stat
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<u64>().ok())
        {
            total = total.saturating_add(ns);
            any = true;
        }
    }
    any.then(|| Duration::from_nanos(total))
}

/// How much of a stretch of time this process spent waiting for a CPU: on a loaded host a
/// measurement is slow because its agent was not scheduled, which says nothing of the network
/// (the verdict sets such a slow measurement aside). A process that waits on a slow link sleeps
/// in the kernel, which is not a run-queue wait.
#[derive(Debug, Clone, Copy)]
pub struct CpuWait {
    at: Instant,
    waited: Option<Duration>,
}

impl CpuWait {
    pub fn start() -> Self {
        Self {
            at: Instant::now(),
            waited: run_queue_wait(),
        }
    }

    /// The wait since [`CpuWait::start`] per mille of the time passed, at most 1000 (several
    /// threads may wait at once); `None` when unknown.
    pub fn permille(self) -> Option<u32> {
        let wall = self.at.elapsed();
        let waited = run_queue_wait()?.saturating_sub(self.waited?);
        if wall.is_zero() {
            return Some(0);
        }
        let permille = (waited.as_secs_f64() / wall.as_secs_f64() * 1000.0).min(1000.0);
        // Within 0..=1000 by the clamp above.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(permille as u32)
    }
}

/// How one measurement is made.
#[derive(Debug, Clone)]
pub struct Request {
    pub from: u32,
    pub to: u32,
    pub round: u8,
    pub addr: SocketAddr,
    pub token: Token,
    pub stream_bytes: u64,
    pub stream_time: Duration,
    /// Everything (connect, pings, stream, reply) ends by then.
    pub deadline: Instant,
}

/// Measures `req.to` from here: round-trip time, then throughput. Never fails: a measurement
/// that could not be made is a [`Sample`] with its error (which the verdict counts as slow).
pub async fn measure(req: &Request) -> Sample {
    let waited = CpuWait::start();
    let (mut sample, theirs) = match timeout_at(req.deadline, measure_inner(req)).await {
        Ok(Ok(measured)) => measured,
        Ok(Err(e)) => (Sample::failed(req.from, req.to, req.round, e), None),
        Err(_) => (
            Sample::failed(req.from, req.to, req.round, "out of time"),
            None,
        ),
    };
    // Either end's wait slows the stream: the larger one counts.
    sample.cpu_wait_permille = match (waited.permille(), theirs) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    sample
}

/// The sample, and the receiver's CPU wait when its listener reported one.
async fn measure_inner(req: &Request) -> Result<(Sample, Option<u32>), String> {
    let mut stream = TcpStream::connect(req.addr)
        .await
        .map_err(|e| format!("connect to {}: {e}", req.addr))?;
    let _ = stream.set_nodelay(true);
    let io = |e: std::io::Error| e.to_string();
    let mut hello = [0u8; 20];
    hello[..4].copy_from_slice(MAGIC);
    hello[4..].copy_from_slice(&req.token);
    stream.write_all(&hello).await.map_err(io)?;
    let mut rtts = Vec::with_capacity(PINGS);
    for i in 0..PINGS {
        let mut msg = [0u8; 9];
        msg[0] = b'P';
        msg[1..].copy_from_slice(&(i as u64).to_be_bytes());
        let sent = Instant::now();
        stream
            .write_all(&msg)
            .await
            .map_err(|e| format!("ping: {e}"))?;
        let mut echo = [0u8; 9];
        stream
            .read_exact(&mut echo)
            .await
            .map_err(|e| format!("ping: {e}"))?;
        if echo != msg {
            return Err("ping: the echo differs".to_owned());
        }
        rtts.push(sent.elapsed());
    }
    // The shortest: the path's own latency; a hiccup of either scheduler only adds to it.
    let rtt = rtts.into_iter().min().unwrap_or_default();
    let mut head = [0u8; 13];
    head[0] = b'S';
    head[1..9].copy_from_slice(&req.stream_bytes.to_be_bytes());
    let millis = u32::try_from(req.stream_time.as_millis()).unwrap_or(u32::MAX);
    head[9..].copy_from_slice(&millis.to_be_bytes());
    stream.write_all(&head).await.map_err(io)?;
    let (mut rd, mut wr) = stream.into_split();
    let total = req.stream_bytes;
    let writer = async move {
        let chunk = vec![0u8; CHUNK];
        let mut sent = 0u64;
        while sent < total {
            let n = usize::try_from(total - sent).unwrap_or(CHUNK).min(CHUNK);
            match wr.write(&chunk[..n]).await {
                Ok(0) | Err(_) => break,
                Ok(k) => sent += k as u64,
            }
        }
        // Keep the write half open until the reply: closing it would end the session early.
        std::future::pending::<()>().await;
    };
    let mut reply = [0u8; 17];
    tokio::select! {
        r = rd.read_exact(&mut reply) => {
            r.map_err(|e| format!("no throughput reply: {e}"))?;
        }
        () = writer => {}
    };
    if reply[0] != b'R' {
        return Err("malformed throughput reply".to_owned());
    }
    let word = |bytes: &[u8], at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[at..at + 8]);
        u64::from_be_bytes(b)
    };
    // The receiver's wait follows at once from a listener that measures it; an older one
    // closes instead.
    let mut wait = [0u8; 8];
    let theirs = match tokio::time::timeout(REPLY_TAIL_WAIT, rd.read_exact(&mut wait)).await {
        Ok(Ok(_)) => u32::try_from(word(&wait, 0)).ok().filter(|p| *p <= 1000),
        _ => None,
    };
    Ok((
        Sample {
            from: req.from,
            to: req.to,
            round: req.round,
            rtt_us: Some(u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX)),
            bytes: word(&reply, 1),
            micros: word(&reply, 9),
            error: None,
            cpu_wait_permille: None,
        },
        theirs,
    ))
}

/// How long the caller waits for the receiver's CPU wait after the rest of the answer: it is
/// written with it, so any delay is the loaded host's; an older listener closes at once.
const REPLY_TAIL_WAIT: Duration = Duration::from_millis(200);

/// The token as published in the store (hex).
pub fn token_hex(token: &Token) -> String {
    use std::fmt::Write as _;
    token.iter().fold(String::with_capacity(32), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

/// The token from its hex form.
pub fn token_from_hex(text: &str) -> Option<Token> {
    let bytes = text.as_bytes();
    if bytes.len() != 32 {
        return None;
    }
    let mut token = [0u8; 16];
    for (i, pair) in bytes.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        token[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(token)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    fn request(listener: &Listener, token: Token) -> Request {
        Request {
            from: 0,
            to: 1,
            round: 1,
            addr: listener.addr(),
            token,
            stream_bytes: 4 << 20,
            stream_time: Duration::from_secs(2),
            deadline: Instant::now() + Duration::from_secs(10),
        }
    }

    #[tokio::test]
    async fn a_member_measures_round_trip_and_throughput() {
        let listener = Listener::bind(
            LOOPBACK,
            Limits::for_budget(Duration::from_secs(2), 4 << 20),
        )
        .await
        .unwrap();
        let s = measure(&request(&listener, listener.token())).await;
        assert_eq!(s.error, None);
        assert_eq!(s.bytes, 4 << 20, "the receiver counted the whole stream");
        assert!(s.micros > 0 && s.rtt_us.is_some(), "{s:?}");
        if run_queue_wait().is_some() {
            assert!(s.cpu_wait_permille.is_some_and(|p| p <= 1000), "{s:?}");
        }
        listener.close().await;
    }

    #[tokio::test]
    async fn an_older_listener_without_the_cpu_wait_is_still_understood() {
        let old = TcpListener::bind((LOOPBACK, 0)).await.unwrap();
        let addr = old.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut c, _) = old.accept().await.unwrap();
            let mut hello = [0u8; 20];
            c.read_exact(&mut hello).await.unwrap();
            for _ in 0..PINGS {
                let mut ping = [0u8; 9];
                c.read_exact(&mut ping).await.unwrap();
                c.write_all(&ping).await.unwrap();
            }
            let mut head = [0u8; 13];
            c.read_exact(&mut head).await.unwrap();
            let mut body = vec![0u8; 1 << 16];
            c.read_exact(&mut body).await.unwrap();
            // The answer as before the CPU wait: R, bytes, microseconds, and close.
            let mut reply = [0u8; 17];
            reply[0] = b'R';
            reply[1..9].copy_from_slice(&(1u64 << 16).to_be_bytes());
            reply[9..].copy_from_slice(&1000u64.to_be_bytes());
            c.write_all(&reply).await.unwrap();
        });
        let req = Request {
            addr,
            stream_bytes: 1 << 16,
            ..request_to(addr)
        };
        let s = measure(&req).await;
        assert_eq!(
            (s.error.as_deref(), s.bytes, s.micros),
            (None, 1 << 16, 1000)
        );
        server.await.unwrap();
    }

    fn request_to(addr: SocketAddr) -> Request {
        Request {
            from: 0,
            to: 1,
            round: 1,
            addr,
            token: [0; 16],
            stream_bytes: 4 << 20,
            stream_time: Duration::from_secs(2),
            deadline: Instant::now() + Duration::from_secs(10),
        }
    }

    #[tokio::test]
    async fn a_caller_without_the_token_is_closed() {
        let listener = Listener::bind(
            LOOPBACK,
            Limits::for_budget(Duration::from_secs(2), 1 << 20),
        )
        .await
        .unwrap();
        let mut wrong = listener.token();
        wrong[0] ^= 1;
        let s = measure(&request(&listener, wrong)).await;
        assert!(
            s.error.as_deref().is_some_and(|e| e.starts_with("ping")),
            "{s:?}"
        );
    }

    #[tokio::test]
    async fn a_thousand_idle_connections_do_not_keep_a_member_out() {
        let limits = Limits {
            hello_timeout: Duration::from_secs(30),
            ..Limits::for_budget(Duration::from_secs(2), 1 << 20)
        };
        let max_pending = limits.max_pending;
        let listener = Listener::bind(LOOPBACK, limits).await.unwrap();
        let mut idle = Vec::new();
        for _ in 0..1000 {
            idle.push(TcpStream::connect(listener.addr()).await.unwrap());
        }
        let s = measure(&request(&listener, listener.token())).await;
        assert_eq!(s.error, None, "{s:?}");
        // All but the newest `max_pending` idle callers were closed by the listener.
        let mut open = 0;
        for mut c in idle {
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_millis(20), c.read(&mut b)).await {
                Ok(Ok(0) | Err(_)) => {}
                _ => open += 1,
            }
        }
        assert!(open <= max_pending, "{open} idle connections still open");
    }

    #[tokio::test]
    async fn a_silent_caller_is_closed_after_the_hello_timeout() {
        let limits = Limits {
            hello_timeout: Duration::from_millis(50),
            ..Limits::for_budget(Duration::from_secs(2), 1 << 20)
        };
        let listener = Listener::bind(LOOPBACK, limits).await.unwrap();
        let mut c = TcpStream::connect(listener.addr()).await.unwrap();
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut b)).await;
        assert!(matches!(n, Ok(Ok(0) | Err(_))), "{n:?}");
    }

    #[tokio::test]
    async fn a_closed_port_is_a_failed_sample() {
        let listener = Listener::bind(
            LOOPBACK,
            Limits::for_budget(Duration::from_secs(2), 1 << 20),
        )
        .await
        .unwrap();
        let req = request(&listener, listener.token());
        listener.close().await;
        let s = measure(&req).await;
        assert!(
            s.error.as_deref().is_some_and(|e| e.contains("connect")),
            "{s:?}"
        );
        assert!((s.mbps() - 0.0).abs() < f64::EPSILON);
    }

    #[test]
    fn tokens_round_trip_through_hex() {
        let t: Token = [0xab; 16];
        assert_eq!(token_from_hex(&token_hex(&t)), Some(t));
        assert_eq!(token_from_hex("zz"), None);
    }
}
