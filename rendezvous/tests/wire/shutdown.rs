//! The server as `muster store` runs it (one current-thread runtime with the busy poll on) and as
//! the agent hosts it (`ServerThread`): requests keep their arrival order across connections, and
//! shutdown reaches every kind of connection.

use std::net::SocketAddr;
use std::time::Duration;

use rendezvous::store::server::{Config, ServerThread};
use tokio::io::AsyncWriteExt;

use crate::common::{
    cmd, expect_closed, key, next, read_n, validated, Next, TestResult, TestServer, QUIET,
};

fn polling() -> Config {
    Config {
        busy_poll: Duration::from_micros(100),
        ..Config::default()
    }
}

/// SET has no reply, so a client that SETs on one connection and GETs on another relies on the
/// server reading requests in the order they arrived. torch's compat scenario `set_get` does
/// exactly this; it failed when connections were spread over several event loops, and on a
/// multi-thread runtime ~30 % of these rounds read the old value.
async fn set_then_get_across_connections(addr: SocketAddr) -> TestResult {
    let mut writer = validated(addr).await?;
    let mut reader = validated(addr).await?;
    for i in 0..300u32 {
        let value = i.to_string();
        writer
            .write_all(&cmd(1, &[&key(b"/k"), &key(value.as_bytes())]))
            .await?;
        reader.write_all(&cmd(3, &[&key(b"/k")])).await?;
        let len = read_n(&mut reader, 8).await?;
        let len = u64::from_le_bytes(len.as_slice().try_into()?);
        let got = read_n(&mut reader, usize::try_from(len)?).await?;
        assert_eq!(
            got,
            value.as_bytes(),
            "round {i}: GET overtook the SET before it"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_set_is_seen_by_the_next_get_on_another_connection() -> TestResult {
    let server = TestServer::with_config(polling()).await?;
    set_then_get_across_connections(server.addr).await?;
    server.stop().await
}

/// The agent's case: its runtime is multi-threaded, so it hosts stores on a `ServerThread`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_thread_keeps_the_order_under_a_multi_thread_runtime() -> TestResult {
    let server =
        ServerThread::start(SocketAddr::from(([127, 0, 0, 1], 0)), Config::default()).await?;
    set_then_get_across_connections(server.local_addr()).await?;
    assert!(
        server.shutdown(Duration::from_secs(5)).await,
        "store thread did not stop"
    );
    Ok(())
}

#[tokio::test]
async fn shutdown_reaches_idle_waiting_and_stuck_connections() -> TestResult {
    let server = TestServer::with_config(polling()).await?;
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
    Ok(())
}
