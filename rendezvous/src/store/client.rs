//! A client for the TCPStore protocol, used by the agents to rendezvous.
//!
//! Unlike torch's client, every read has a deadline: torch blocks forever on a server that
//! accepted the connection and went silent (tcpstore-protocol.md §1.2), which in a pod means a
//! GPU held until someone notices. Keys are sent as given (torch's client prefixes user keys with
//! `/`; callers that want to share keys with torch clients add it themselves).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout_at, Instant};

use super::protocol::{reply, Request, MAX_KEY_COUNT, MAX_VALUE_LEN, VALIDATION_MAGIC};
use crate::words;

/// Read deadline of a new client unless [`Client::set_timeout`] changes it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// First pause between connection attempts; doubled up to [`MAX_CONNECT_BACKOFF`].
const INITIAL_CONNECT_BACKOFF: Duration = Duration::from_millis(10);
const MAX_CONNECT_BACKOFF: Duration = Duration::from_secs(1);

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to the store at {addr} within {}: {source}", words::duration(*timeout))]
    Connect {
        addr: SocketAddr,
        timeout: Duration,
        #[source]
        source: std::io::Error,
    },
    #[error("the store at {addr} did not answer {op} within {}", words::duration(*timeout))]
    Timeout {
        addr: SocketAddr,
        op: &'static str,
        timeout: Duration,
    },
    #[error("wait for {} timed out after {}", words::counted("key", keys), words::duration(*timeout))]
    WaitTimeout {
        keys: Vec<String>,
        timeout: Duration,
    },
    #[error("the store at {addr} closed the connection during {op}")]
    Closed { addr: SocketAddr, op: &'static str },
    #[error("i/o error talking to the store at {addr} during {op}: {source}")]
    Io {
        addr: SocketAddr,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the store at {addr} answered {op} with {detail}")]
    Protocol {
        addr: SocketAddr,
        op: &'static str,
        detail: String,
    },
}

impl ClientError {
    /// True when the server is gone (as opposed to slow or misbehaving).
    pub fn is_disconnect(&self) -> bool {
        matches!(self, ClientError::Closed { .. } | ClientError::Io { .. })
    }
}

/// A connection to a TCPStore server.
pub struct Client {
    stream: TcpStream,
    addr: SocketAddr,
    timeout: Duration,
    out: BytesMut,
}

impl Client {
    /// Connects, retrying refused connections with backoff until `timeout`, then performs the
    /// handshake (VALIDATE + PING) within the same deadline.
    pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<Client, ClientError> {
        let deadline = Instant::now() + timeout;
        let mut backoff = INITIAL_CONNECT_BACKOFF;
        let stream = loop {
            let err = match timeout_at(deadline, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => break stream,
                Ok(Err(err)) => err,
                Err(_) => std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
            };
            if Instant::now() + backoff >= deadline {
                return Err(ClientError::Connect {
                    addr,
                    timeout,
                    source: err,
                });
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_CONNECT_BACKOFF);
        };
        Self::handshake(stream, addr, deadline).await
    }

    /// One connection attempt, no retry: a refused connection fails at once. For a client that
    /// had a connection and must tell "the server is gone" from "the server is slow" quickly.
    pub async fn connect_once(addr: SocketAddr, timeout: Duration) -> Result<Client, ClientError> {
        let deadline = Instant::now() + timeout;
        let stream = match timeout_at(deadline, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(source)) => {
                return Err(ClientError::Connect {
                    addr,
                    timeout,
                    source,
                })
            }
            Err(_) => {
                return Err(ClientError::Connect {
                    addr,
                    timeout,
                    source: std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
                })
            }
        };
        Self::handshake(stream, addr, deadline).await
    }

    /// VALIDATE + PING on a fresh stream, within `deadline`.
    async fn handshake(
        stream: TcpStream,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<Client, ClientError> {
        // Store traffic is small request/reply messages: Nagle only adds latency.
        stream.set_nodelay(true).map_err(|source| ClientError::Io {
            addr,
            op: "connect",
            source,
        })?;
        let mut client = Client {
            stream,
            addr,
            timeout: deadline.saturating_duration_since(Instant::now()),
            out: BytesMut::with_capacity(256),
        };
        client.push(&Request::Validate {
            magic: VALIDATION_MAGIC,
        });
        client.ping_with("handshake").await?;
        client.timeout = DEFAULT_TIMEOUT;
        Ok(client)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// This end's address: what the server sees as the peer.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.stream.local_addr().ok()
    }

    /// Resolves when the server closed or reset this connection. Meant for an idle connection,
    /// between requests: then the only thing that can make it readable is EOF or an error.
    /// Bytes nobody asked for (a reply to a request that was given up on) are not a close: the
    /// next request finds them; this then never resolves.
    pub async fn closed(&self) {
        let mut byte = [0u8; 1];
        match self.stream.peek(&mut byte).await {
            Ok(0) | Err(_) => {}
            Ok(_) => std::future::pending().await,
        }
    }

    /// Bounds every later read.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    pub async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.push(&Request::Set {
            key: key.to_vec().into(),
            value: value.to_vec().into(),
        });
        self.send("SET").await
    }

    /// A raw GET: a missing key reads as empty (the server does not wait for it).
    pub async fn get(&mut self, key: &[u8]) -> Result<Vec<u8>, ClientError> {
        self.push(&Request::Get {
            key: key.to_vec().into(),
        });
        self.send("GET").await?;
        self.read_bytes("GET").await
    }

    /// Blocks until every key exists, or fails with [`ClientError::WaitTimeout`] after
    /// cancelling the wait on the server (the connection stays usable).
    pub async fn wait(&mut self, keys: &[&[u8]], timeout: Duration) -> Result<(), ClientError> {
        self.push(&Request::Wait {
            keys: keys.iter().map(|k| k.to_vec().into()).collect(),
        });
        self.send("WAIT").await?;
        self.await_release("WAIT", keys, timeout).await
    }

    /// Waits until `key` exists and returns its value, or `None` once `stop` is cancelled. The
    /// wait is re-armed every `poll`, so a store that went away shows up as an error rather than
    /// as silence.
    pub async fn wait_for_key(
        &mut self,
        key: &[u8],
        poll: Duration,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Result<Option<Vec<u8>>, ClientError> {
        let watched: [&[u8]; 1] = [key];
        loop {
            let waited = tokio::select! {
                () = stop.cancelled() => return Ok(None),
                waited = self.wait(&watched, poll) => waited,
            };
            match waited {
                Ok(()) => return self.get(key).await.map(Some),
                Err(ClientError::WaitTimeout { .. }) => {}
                Err(err) => return Err(err),
            }
        }
    }

    pub async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, ClientError> {
        self.push(&Request::Add {
            key: key.to_vec().into(),
            delta,
        });
        self.send("ADD").await?;
        self.read_i64("ADD").await
    }

    /// Returns the value stored after the operation (see the protocol notes for a missing key
    /// with a non-empty `expected`: the server answers `expected` and creates nothing).
    pub async fn compare_set(
        &mut self,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, ClientError> {
        self.push(&Request::CompareSet {
            key: key.to_vec().into(),
            expected: expected.to_vec().into(),
            desired: desired.to_vec().into(),
        });
        self.send("COMPARE_SET").await?;
        self.read_bytes("COMPARE_SET").await
    }

    /// True when every key exists.
    pub async fn check(&mut self, keys: &[&[u8]]) -> Result<bool, ClientError> {
        self.push(&Request::Check {
            keys: keys.iter().map(|k| k.to_vec().into()).collect(),
        });
        self.send("CHECK").await?;
        match self.read_u8("CHECK").await? {
            reply::READY => Ok(true),
            reply::NOT_READY => Ok(false),
            other => Err(self.protocol("CHECK", format!("unknown code {other}"))),
        }
    }

    /// Values in the order of `keys`; a missing key reads as empty.
    pub async fn multi_get(&mut self, keys: &[&[u8]]) -> Result<Vec<Vec<u8>>, ClientError> {
        if keys.len() as u64 > MAX_KEY_COUNT {
            return Err(self.protocol("MULTI_GET", format!("{} keys exceed the limit", keys.len())));
        }
        self.push(&Request::MultiGet {
            keys: keys.iter().map(|k| k.to_vec().into()).collect(),
        });
        self.send("MULTI_GET").await?;
        let mut values = Vec::with_capacity(keys.len());
        for _ in keys {
            values.push(self.read_bytes("MULTI_GET").await?);
        }
        Ok(values)
    }

    pub async fn multi_set(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), ClientError> {
        self.push(&Request::MultiSet {
            pairs: pairs
                .iter()
                .map(|(k, v)| (k.to_vec().into(), v.to_vec().into()))
                .collect(),
        });
        self.send("MULTI_SET").await
    }

    /// True when the key existed.
    pub async fn delete_key(&mut self, key: &[u8]) -> Result<bool, ClientError> {
        self.push(&Request::DeleteKey {
            key: key.to_vec().into(),
        });
        self.send("DELETE_KEY").await?;
        Ok(self.read_i64("DELETE_KEY").await? > 0)
    }

    pub async fn num_keys(&mut self) -> Result<i64, ClientError> {
        self.push(&Request::GetNumKeys);
        self.send("GETNUMKEYS").await?;
        self.read_i64("GETNUMKEYS").await
    }

    pub async fn append(&mut self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.push(&Request::Append {
            key: key.to_vec().into(),
            value: value.to_vec().into(),
        });
        self.send("APPEND").await
    }

    /// Every regular key, raw (torch's own client hides keys without a leading `/`).
    pub async fn list_keys(&mut self) -> Result<Vec<Vec<u8>>, ClientError> {
        self.push(&Request::ListKeys);
        self.send("LIST_KEYS").await?;
        let count = self.read_count("LIST_KEYS").await?;
        let mut keys = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            keys.push(self.read_bytes("LIST_KEYS").await?);
        }
        Ok(keys)
    }

    /// A round trip that proves the server is alive.
    pub async fn ping(&mut self) -> Result<(), ClientError> {
        self.ping_with("PING").await
    }

    /// Adds one to the counter under `key` and blocks until it reaches `world_size`.
    pub async fn barrier(
        &mut self,
        key: &[u8],
        world_size: i64,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        self.push(&Request::Barrier {
            key: key.to_vec().into(),
            world_size,
        });
        self.send("BARRIER").await?;
        self.await_release("BARRIER", &[key], timeout).await
    }

    pub async fn queue_push(&mut self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.push(&Request::QueuePush {
            key: key.to_vec().into(),
            value: value.to_vec().into(),
        });
        self.send("QUEUE_PUSH").await
    }

    /// Pops the oldest element, or `None` when the queue is empty (never blocks).
    pub async fn queue_pop(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        self.push(&Request::QueuePop {
            key: key.to_vec().into(),
        });
        self.send("QUEUE_POP").await?;
        if self.read_i64("QUEUE_POP").await? > 0 {
            Ok(Some(self.read_bytes("QUEUE_POP").await?))
        } else {
            Ok(None)
        }
    }

    pub async fn queue_len(&mut self, key: &[u8]) -> Result<i64, ClientError> {
        self.push(&Request::QueueLen {
            key: key.to_vec().into(),
        });
        self.send("QUEUE_LEN").await?;
        self.read_i64("QUEUE_LEN").await
    }

    async fn ping_with(&mut self, op: &'static str) -> Result<(), ClientError> {
        let nonce = std::process::id();
        self.push(&Request::Ping { nonce });
        self.send(op).await?;
        let mut echo = [0u8; 4];
        self.read_exact(op, &mut echo).await?;
        if u32::from_le_bytes(echo) == nonce {
            Ok(())
        } else {
            Err(self.protocol(
                op,
                format!("ping nonce {} instead of {nonce}", u32::from_le_bytes(echo)),
            ))
        }
    }

    /// The STOP_WAITING of a WAIT or BARRIER, or a timeout followed by a clean cancel.
    async fn await_release(
        &mut self,
        op: &'static str,
        keys: &[&[u8]],
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let mut byte = [0u8; 1];
        match tokio::time::timeout(timeout, self.stream.read_exact(&mut byte)).await {
            Ok(Ok(_)) => return self.expect_code(op, byte[0], reply::STOP_WAITING),
            Ok(Err(err)) => return Err(self.io_error(op, err)),
            Err(_) => {}
        }
        self.push(&Request::CancelWait);
        self.send("CANCEL_WAIT").await?;
        // The release may have crossed our cancel on the wire: then its 00 comes first.
        let mut code = self.read_u8("CANCEL_WAIT").await?;
        if code == reply::STOP_WAITING {
            code = self.read_u8("CANCEL_WAIT").await?;
        }
        self.expect_code("CANCEL_WAIT", code, reply::WAIT_CANCELED)?;
        Err(ClientError::WaitTimeout {
            keys: keys
                .iter()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect(),
            timeout,
        })
    }

    fn expect_code(&self, op: &'static str, got: u8, want: u8) -> Result<(), ClientError> {
        if got == want {
            Ok(())
        } else {
            Err(self.protocol(op, format!("code {got} instead of {want}")))
        }
    }

    fn push(&mut self, request: &Request) {
        request.encode(&mut self.out);
    }

    async fn send(&mut self, op: &'static str) -> Result<(), ClientError> {
        let out = self.out.split();
        let deadline = Instant::now() + self.timeout;
        match timeout_at(deadline, self.stream.write_all(&out)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(self.io_error(op, err)),
            Err(_) => Err(self.timed_out(op)),
        }
    }

    async fn read_exact(&mut self, op: &'static str, buf: &mut [u8]) -> Result<(), ClientError> {
        let deadline = Instant::now() + self.timeout;
        match timeout_at(deadline, self.stream.read_exact(buf)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(err)) => Err(self.io_error(op, err)),
            Err(_) => Err(self.timed_out(op)),
        }
    }

    async fn read_u8(&mut self, op: &'static str) -> Result<u8, ClientError> {
        let mut b = [0u8; 1];
        self.read_exact(op, &mut b).await?;
        Ok(b[0])
    }

    async fn read_i64(&mut self, op: &'static str) -> Result<i64, ClientError> {
        let mut b = [0u8; 8];
        self.read_exact(op, &mut b).await?;
        Ok(i64::from_le_bytes(b))
    }

    async fn read_count(&mut self, op: &'static str) -> Result<usize, ClientError> {
        let count = self.read_i64(op).await?;
        usize::try_from(count).map_err(|_| self.protocol(op, format!("negative count {count}")))
    }

    async fn read_bytes(&mut self, op: &'static str) -> Result<Vec<u8>, ClientError> {
        let mut len = [0u8; 8];
        self.read_exact(op, &mut len).await?;
        let len = (&len[..]).get_u64_le();
        // Never allocate what a broken or hostile server claims beyond the protocol's limit.
        if len > MAX_VALUE_LEN {
            return Err(self.protocol(op, format!("a value of {len} bytes")));
        }
        let mut value = vec![0u8; len as usize];
        self.read_exact(op, &mut value).await?;
        Ok(value)
    }

    fn io_error(&self, op: &'static str, err: std::io::Error) -> ClientError {
        if err.kind() == std::io::ErrorKind::UnexpectedEof {
            ClientError::Closed {
                addr: self.addr,
                op,
            }
        } else {
            ClientError::Io {
                addr: self.addr,
                op,
                source: err,
            }
        }
    }

    fn timed_out(&self, op: &'static str) -> ClientError {
        ClientError::Timeout {
            addr: self.addr,
            op,
            timeout: self.timeout,
        }
    }

    fn protocol(&self, op: &'static str, detail: String) -> ClientError {
        ClientError::Protocol {
            addr: self.addr,
            op,
            detail,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr};

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::store::server::{Config, Server};

    async fn start() -> (SocketAddr, CancellationToken) {
        let server = Server::bind((Ipv4Addr::LOCALHOST, 0).into(), Config::default())
            .await
            .unwrap();
        let addr = server.local_addr();
        let stop = CancellationToken::new();
        tokio::spawn(server.run(stop.clone()));
        (addr, stop)
    }

    #[tokio::test]
    async fn every_operation_against_the_server() {
        let (addr, stop) = start().await;
        let mut c = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
        c.set(b"/k", b"v").await.unwrap();
        assert_eq!(c.get(b"/k").await.unwrap(), b"v");
        assert_eq!(c.get(b"/missing").await.unwrap(), b"");
        assert_eq!(c.add(b"/n", 3).await.unwrap(), 3);
        assert_eq!(c.compare_set(b"/k", b"v", b"w").await.unwrap(), b"w");
        assert!(c.check(&[b"/k", b"/n"]).await.unwrap());
        assert!(!c.check(&[b"/nope"]).await.unwrap());
        c.multi_set(&[(b"/a", b"1"), (b"/b", b"2")]).await.unwrap();
        assert_eq!(
            c.multi_get(&[b"/a", b"/b"]).await.unwrap(),
            [b"1".to_vec(), b"2".to_vec()]
        );
        c.append(b"/a", b"x").await.unwrap();
        assert_eq!(c.get(b"/a").await.unwrap(), b"1x");
        assert!(c.delete_key(b"/b").await.unwrap());
        assert_eq!(c.num_keys().await.unwrap(), 3);
        assert_eq!(c.list_keys().await.unwrap().len(), 3);
        c.queue_push(b"/q", b"e").await.unwrap();
        assert_eq!(c.queue_len(b"/q").await.unwrap(), 1);
        assert_eq!(c.queue_pop(b"/q").await.unwrap(), Some(b"e".to_vec()));
        assert_eq!(c.queue_pop(b"/q").await.unwrap(), None);
        c.barrier(b"/bar", 1, Duration::from_secs(1)).await.unwrap();
        c.ping().await.unwrap();
        stop.cancel();
    }

    #[tokio::test]
    async fn a_wait_times_out_cleanly_and_a_later_one_is_released() {
        let (addr, stop) = start().await;
        let mut waiter = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
        let err = waiter
            .wait(&[b"/late"], Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::WaitTimeout { .. }), "{err}");
        // The connection is still in sync after the cancel.
        waiter.ping().await.unwrap();

        let mut writer = Client::connect(addr, Duration::from_secs(5)).await.unwrap();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            writer.set(b"/late", b"1").await.unwrap();
        });
        waiter
            .wait(&[b"/late"], Duration::from_secs(5))
            .await
            .unwrap();
        release.await.unwrap();
        stop.cancel();
    }

    #[tokio::test]
    async fn connect_gives_up_at_its_deadline() {
        // Bind then drop, so the port is (very likely) closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let started = Instant::now();
        let err = Client::connect(
            (Ipv4Addr::LOCALHOST, port).into(),
            Duration::from_millis(300),
        )
        .await
        .err()
        .unwrap();
        assert!(matches!(err, ClientError::Connect { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_silent_server_is_a_timeout_not_a_hang() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hold = tokio::spawn(async move {
            let (_socket, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(10)).await;
        });
        let err = Client::connect(addr, Duration::from_millis(200))
            .await
            .err()
            .unwrap();
        assert!(matches!(err, ClientError::Timeout { .. }), "{err}");
        hold.abort();
    }
}
