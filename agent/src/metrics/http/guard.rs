//! A connection's socket as hyper sees it: only checked, whole heads ([`Framer`]) and their
//! bodies come through, and the endpoint's deadlines are kept here, where the bytes are seen.
//!
//! hyper's own `header_read_timeout` is one clock from "ready for a head" to "head parsed", so it
//! cannot tell a quiet keep-alive connection (closed without a word after `idle_timeout`) from a
//! head that started and stalled (408 after `request_timeout`), nor hold a new connection to its
//! shorter first deadline. So this wrapper keeps those clocks, and hyper runs without a timer:
//!
//! - a new connection must deliver its first whole request within `first_request_timeout` of the
//!   accept; silence is closed quietly, a partial request gets 408;
//! - every request must arrive whole within `request_timeout` of its first byte (408);
//! - a keep-alive connection with no request under way is closed quietly `idle_timeout` after its
//!   last response;
//! - a response must be written within `request_timeout` (an error ends the connection).
//!
//! A head refused here (bad line ends, version, size, or too slow) is never shown to hyper:
//! a stand-in head takes its place, and the router answers that request with the [`Reject`]'s
//! status and a close, after every response before it (hyper serves one request at a time, so
//! counting requests on both sides says which one stands in).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use super::wire::{Framer, Reject};
use super::{EndpointConfig, Slot};

/// What stands in for a refused head (any head hyper accepts would do: the router recognises it by
/// its position, not its content).
const STAND_IN: &[u8] = b"GET / HTTP/1.1\r\n\r\n";
/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 4096;

/// What the wrapper and the router share about one connection.
#[derive(Debug, Default)]
pub(super) struct Exchange {
    /// Requests the router has been given.
    served: AtomicU64,
    /// The request (counted from 1) that stands in for a refused head, and why it was refused.
    refused: Mutex<Option<(u64, Reject)>>,
}

impl Exchange {
    /// Called by the router once per request: `Some` when this request stands in for a refused
    /// head.
    pub(super) fn next_request(&self) -> Option<Reject> {
        let ordinal = self.served.fetch_add(1, Ordering::Relaxed) + 1;
        match *self.refused.lock().unwrap_or_else(PoisonError::into_inner) {
            Some((at, reject)) if at == ordinal => Some(reject),
            _ => None,
        }
    }

    fn refuse(&self, ordinal: u64, reject: Reject) {
        *self.refused.lock().unwrap_or_else(PoisonError::into_inner) = Some((ordinal, reject));
    }
}

/// How the read side ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Open,
    /// The peer closed its side.
    PeerClosed,
    /// Idle or silent past a deadline: closed without a word.
    Quiet,
    /// A refused head was replaced; nothing more is read.
    Refused,
}

/// The socket of one connection, wrapped for hyper (through `TokioIo`).
pub(super) struct Guarded {
    stream: TcpStream,
    framer: Framer,
    /// Checked bytes hyper has not read yet, from `ready_at` on.
    ready: Vec<u8>,
    ready_at: usize,
    end: End,
    /// Heads handed to hyper, the stand-in included.
    heads: u64,
    exchange: Arc<Exchange>,
    slot: Slot,
    request_timeout: Duration,
    idle_timeout: Duration,
    /// Until the first request is whole: when it must be.
    first_deadline: Option<Instant>,
    /// When the request under way sent its first byte.
    request_started: Option<Instant>,
    /// Since the accept or the last response was written, while no request is under way.
    idle_since: Option<Instant>,
    read_deadline: Option<Instant>,
    read_timer: Pin<Box<Sleep>>,
    /// A response is being written (since this instant); cleared by a completed flush.
    writing_since: Option<Instant>,
    write_timer: Pin<Box<Sleep>>,
}

impl Guarded {
    pub(super) fn new(
        stream: TcpStream,
        config: &EndpointConfig,
        exchange: Arc<Exchange>,
        slot: Slot,
    ) -> Self {
        let now = Instant::now();
        let mut guarded = Self {
            stream,
            framer: Framer::default(),
            ready: Vec::new(),
            ready_at: 0,
            end: End::Open,
            heads: 0,
            exchange,
            slot,
            request_timeout: config.request_timeout,
            idle_timeout: config.idle_timeout,
            first_deadline: Some(now + config.first_request_timeout),
            request_started: None,
            idle_since: Some(now),
            read_deadline: None,
            read_timer: Box::pin(tokio::time::sleep_until(now)),
            writing_since: None,
            write_timer: Box::pin(tokio::time::sleep_until(now)),
        };
        guarded.rearm_read();
        guarded
    }

    /// The socket, for the close after hyper is done.
    pub(super) fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Whether the server ended the connection with input possibly unread (after a `close`
    /// response or an error), so the close should linger; not after a quiet or peer's close.
    pub(super) fn closed_by_server(&self) -> bool {
        matches!(self.end, End::Open | End::Refused)
    }

    fn rearm_read(&mut self) {
        let own = match self.request_started {
            Some(started) => Some(started + self.request_timeout),
            None => self.idle_since.map(|since| since + self.idle_timeout),
        };
        let deadline = match (own, self.first_deadline) {
            (Some(own), Some(first)) => Some(own.min(first)),
            (own, first) => own.or(first),
        };
        if deadline != self.read_deadline {
            self.read_deadline = deadline;
            if let Some(deadline) = deadline {
                self.read_timer.as_mut().reset(deadline);
            }
        }
    }

    /// Runs freshly read bytes through the framer.
    fn take(&mut self, bytes: &[u8]) {
        let was_in_request = self.framer.in_request();
        let before = self.framer.heads();
        let pushed = self.framer.push(bytes, &mut self.ready);
        let heads = self.framer.heads() - before;
        self.heads += heads;
        match pushed {
            Ok(()) => {
                if heads > 0 {
                    self.slot.set_busy(true);
                }
                let in_body = self.framer.in_body();
                if self.heads > 0 && !in_body {
                    self.first_deadline = None;
                }
                if !self.framer.in_request() {
                    self.request_started = None;
                } else if !was_in_request || (heads > 0 && !(heads == 1 && in_body)) {
                    // A new request began in these bytes (a body keeps its head's clock).
                    self.request_started = Some(Instant::now());
                }
                if self.framer.in_request() {
                    self.idle_since = None;
                }
            }
            Err(reject) => self.refuse(reject),
        }
        self.rearm_read();
    }

    fn refuse(&mut self, reject: Reject) {
        self.ready.extend_from_slice(STAND_IN);
        self.heads += 1;
        self.exchange.refuse(self.heads, reject);
        self.slot.set_busy(true);
        self.end = End::Refused;
        self.first_deadline = None;
        self.request_started = None;
        self.idle_since = None;
    }

    /// A read deadline passed while hyper waits for input.
    fn read_expired(&mut self) -> Poll<io::Result<()>> {
        self.read_deadline = None;
        if self.framer.in_body() {
            // hyper hands the error to the body the router is reading: it answers 408.
            return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
        }
        if self.framer.in_request() {
            self.refuse(Reject::Timeout);
        } else {
            self.end = End::Quiet;
        }
        Poll::Ready(Ok(()))
    }

    fn start_writing(&mut self) {
        if self.writing_since.is_none() {
            let now = Instant::now();
            self.writing_since = Some(now);
            self.write_timer.as_mut().reset(now + self.request_timeout);
        }
    }

    /// `Pending` from the socket becomes an error once the write deadline has passed.
    fn poll_write_timer<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_pending()
            && self.writing_since.is_some()
            && self.write_timer.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
        }
        polled
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.ready_at < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_at);
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                if this.ready_at == this.ready.len() {
                    this.ready.clear();
                    this.ready_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            match this.end {
                End::Open => {}
                End::PeerClosed | End::Quiet => return Poll::Ready(Ok(())),
                // hyper answers the stand-in and closes; it is never given more.
                End::Refused => return Poll::Pending,
            }
            let mut chunk = [0u8; READ_CHUNK];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.stream).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) if read.filled().is_empty() => this.end = End::PeerClosed,
                Poll::Ready(Ok(())) => this.take(read.filled()),
                Poll::Ready(Err(err)) => return Poll::Ready(Err(err)),
                Poll::Pending => {
                    if this.read_deadline.is_some() && this.read_timer.as_mut().poll(cx).is_ready()
                    {
                        if let Poll::Ready(Err(err)) = this.read_expired() {
                            return Poll::Ready(Err(err));
                        }
                        continue;
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.start_writing();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.poll_write_timer(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.start_writing();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.poll_write_timer(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_flush(cx);
        if let Poll::Ready(Ok(())) = polled {
            if this.writing_since.take().is_some() {
                // A response is out: the connection is idle again unless a request is under way.
                this.slot.set_busy(false);
                if !this.framer.in_request() {
                    this.idle_since = Some(Instant::now());
                    this.rearm_read();
                }
            }
        }
        this.poll_write_timer(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
