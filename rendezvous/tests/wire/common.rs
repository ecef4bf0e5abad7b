//! Helpers shared by the wire tests: a server on 127.0.0.1:0 and raw-socket conversations.

use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rendezvous::store::server::{Config, Server, Stats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

/// Bound on every read in these tests: a hang becomes a failure, not a stuck CI.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// How long "no reply" is watched for.
pub const QUIET: Duration = Duration::from_millis(150);

pub const MAGIC: u32 = 0x3C85_F7CE;

/// A running server; cancelled and joined on drop.
pub struct TestServer {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl TestServer {
    pub async fn start() -> Result<TestServer, Box<dyn Error + Send + Sync>> {
        Self::with_config(Config::default()).await
    }

    pub async fn with_config(config: Config) -> Result<TestServer, Box<dyn Error + Send + Sync>> {
        let server = Server::bind(SocketAddr::from(([127, 0, 0, 1], 0)), config).await?;
        let addr = server.local_addr();
        let stats = server.stats();
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let task = tokio::spawn(async move {
            if let Err(err) = server.run(token).await {
                panic!("server failed: {err}");
            }
        });
        Ok(TestServer {
            addr,
            stats,
            shutdown,
            task: Some(task),
        })
    }

    pub async fn stop(mut self) -> TestResult {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task).await??;
        }
        Ok(())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub async fn connect(addr: SocketAddr) -> Result<TcpStream, Box<dyn Error + Send + Sync>> {
    let stream = tokio::time::timeout(READ_TIMEOUT, TcpStream::connect(addr)).await??;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// A connection that has done VALIDATE + PING.
pub async fn validated(addr: SocketAddr) -> Result<TcpStream, Box<dyn Error + Send + Sync>> {
    let mut s = connect(addr).await?;
    let mut hello = vec![0u8];
    hello.extend_from_slice(&MAGIC.to_le_bytes());
    hello.push(13);
    hello.extend_from_slice(&0x1234_5678_u32.to_le_bytes());
    s.write_all(&hello).await?;
    let echo = read_n(&mut s, 4).await?;
    if echo != 0x1234_5678_u32.to_le_bytes() {
        return Err(format!("PING echo {echo:02x?}").into());
    }
    Ok(s)
}

pub async fn read_n(s: &mut TcpStream, n: usize) -> Result<Vec<u8>, Box<dyn Error + Send + Sync>> {
    let mut buf = vec![0u8; n];
    tokio::time::timeout(READ_TIMEOUT, s.read_exact(&mut buf)).await??;
    Ok(buf)
}

/// What the server does next on a connection, watched for `wait`.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Bytes arrived.
    Bytes(Vec<u8>),
    /// The server closed (EOF or reset).
    Closed,
    /// Nothing within the time.
    Quiet,
}

pub async fn next(s: &mut TcpStream, wait: Duration) -> Next {
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(wait, s.read(&mut buf)).await {
        Err(_) => Next::Quiet,
        Ok(Ok(0) | Err(_)) => Next::Closed,
        Ok(Ok(n)) => {
            buf.truncate(n);
            Next::Bytes(buf)
        }
    }
}

/// Expects the server to close the connection (reading at most a little data first).
pub async fn expect_closed(s: &mut TcpStream) -> TestResult {
    match next(s, READ_TIMEOUT).await {
        Next::Closed => Ok(()),
        other => Err(format!("connection not closed: {other:?}").into()),
    }
}

/// Wire encodings for hand-made requests.
pub fn key(k: &[u8]) -> Vec<u8> {
    let mut v = (k.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(k);
    v
}

pub fn cmd(code: u8, parts: &[&[u8]]) -> Vec<u8> {
    let mut v = vec![code];
    for p in parts {
        v.extend_from_slice(p);
    }
    v
}

/// SET + GETNUMKEYS round trip on a fresh validated connection: proves the server still serves.
pub async fn still_served(addr: SocketAddr) -> TestResult {
    let mut s = validated(addr).await?;
    s.write_all(&cmd(4, &[&key(b"/alive"), &1i64.to_le_bytes()]))
        .await?;
    let n = read_n(&mut s, 8).await?;
    if i64::from_le_bytes(n.as_slice().try_into()?) < 1 {
        return Err("ADD /alive answered < 1".into());
    }
    Ok(())
}
