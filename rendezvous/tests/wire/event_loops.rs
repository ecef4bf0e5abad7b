//! The server as `muster store` runs it: connections spread over several current-thread
//! runtimes, each busy-polling its own I/O driver; and shutdown, which must reach every kind of
//! connection.

use std::time::Duration;

use rendezvous::store::event_loops::EventLoops;
use rendezvous::store::server::Config;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::common::{
    cmd, expect_closed, key, next, read_n, validated, Next, TestResult, TestServer, QUIET,
};

fn polling() -> Config {
    Config {
        busy_poll: Duration::from_micros(100),
        ..Config::default()
    }
}

async fn add(
    s: &mut TcpStream,
    k: &[u8],
    delta: i64,
) -> Result<i64, Box<dyn std::error::Error + Send + Sync>> {
    s.write_all(&cmd(4, &[&key(k), &delta.to_le_bytes()]))
        .await?;
    Ok(i64::from_le_bytes(
        read_n(s, 8).await?.as_slice().try_into()?,
    ))
}

#[tokio::test]
async fn clients_on_different_loops_share_one_store() -> TestResult {
    let loops = EventLoops::start(2)?;
    let server = TestServer::with_event_loops(polling(), loops.handles()).await?;
    // Round-robin placement: six waiters land on all three loops, twice each.
    let mut waiters = Vec::new();
    for _ in 0..6 {
        let mut w = validated(server.addr).await?;
        w.write_all(&cmd(6, &[&1u64.to_le_bytes(), &key(b"/go")]))
            .await?;
        waiters.push(w);
    }
    for w in &mut waiters {
        assert_eq!(next(w, QUIET).await, Next::Quiet);
    }
    let mut setter = validated(server.addr).await?;
    setter
        .write_all(&cmd(1, &[&key(b"/go"), &key(b"1")]))
        .await?;
    for w in &mut waiters {
        assert_eq!(
            read_n(w, 1).await?,
            [0],
            "a waiter on another loop was not released"
        );
        assert_eq!(next(w, Duration::from_millis(20)).await, Next::Quiet);
    }
    // Every loop's clients increment one counter at once; no update is lost or reordered.
    let mut clients = Vec::new();
    for w in waiters {
        clients.push(tokio::spawn(async move {
            let mut w = w;
            let mut last = 0;
            for _ in 0..200 {
                let v = add(&mut w, b"/shared", 1).await?;
                assert!(v > last, "counter went from {last} to {v}");
                last = v;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(w)
        }));
    }
    for c in clients {
        c.await??;
    }
    assert_eq!(add(&mut setter, b"/shared", 0).await?, 6 * 200);
    server.stop().await?;
    drop(loops);
    Ok(())
}

#[tokio::test]
async fn shutdown_reaches_idle_waiting_and_stuck_connections() -> TestResult {
    let loops = EventLoops::start(1)?;
    let server = TestServer::with_event_loops(polling(), loops.handles()).await?;
    let mut idle = validated(server.addr).await?;
    let mut waiting = validated(server.addr).await?;
    waiting
        .write_all(&cmd(6, &[&1u64.to_le_bytes(), &key(b"/never")]))
        .await?;
    // A client that asks for 64 MiB and reads none of it: the server's write to it blocks once
    // both socket buffers are full.
    let mut stuck = validated(server.addr).await?;
    let big = vec![b'x'; 1 << 20];
    stuck
        .write_all(&cmd(1, &[&key(b"/big"), &key(&big)]))
        .await?;
    for _ in 0..64 {
        stuck.write_all(&cmd(3, &[&key(b"/big")])).await?;
    }
    assert_eq!(next(&mut waiting, QUIET).await, Next::Quiet);
    let started = std::time::Instant::now();
    server.stop().await?;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "shutdown took {:?}",
        started.elapsed()
    );
    expect_closed(&mut idle).await?;
    expect_closed(&mut waiting).await?;
    drop(stuck);
    drop(loops);
    Ok(())
}
