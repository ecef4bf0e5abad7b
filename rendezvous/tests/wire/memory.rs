//! The store's memory bounds, on the wire: a client that does not read its replies stops being
//! served once they pass `max_pending_output` (and is closed when it stays stuck), a store at
//! `max_store_bytes` refuses growth by closing the writer's connection, and oversized requests
//! and replies close theirs. Every test also checks that other clients are still served.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rendezvous::store::protocol::Command;
use rendezvous::store::server::{Config, MAX_REQUEST_BYTES};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::common::{
    cmd, expect_closed, key, read_n, still_served, validated, TestResult, TestServer, MAGIC,
    READ_TIMEOUT,
};

const VALUE: usize = 256 * 1024;

fn small_caps() -> Config {
    Config {
        max_pending_output: 1 << 20,
        write_stall_timeout: Duration::from_secs(3600),
        ..Config::default()
    }
}

/// A validated connection whose receive buffer is small, so that the kernel does not soak up
/// many replies the client has not read.
async fn slow_reader(
    server: &TestServer,
) -> Result<TcpStream, Box<dyn std::error::Error + Send + Sync>> {
    let socket = TcpSocket::new_v4()?;
    socket.set_recv_buffer_size(64 * 1024)?;
    let mut s = tokio::time::timeout(READ_TIMEOUT, socket.connect(server.addr)).await??;
    s.write_all(&cmd(0, &[&MAGIC.to_le_bytes()])).await?;
    Ok(s)
}

/// Stores a `VALUE`-byte value at `/big`, then has a slow reader ask for it 400 times in one
/// write: 100 MiB of replies asked for. Returns the writer (kept open: it counts among the open
/// connections) and the slow reader, which has read nothing yet.
async fn flood_with_unread_gets(
    server: &TestServer,
) -> Result<(TcpStream, TcpStream), Box<dyn std::error::Error + Send + Sync>> {
    let mut writer = validated(server.addr).await?;
    writer
        .write_all(&cmd(1, &[&key(b"/big"), &key(&vec![b'x'; VALUE])]))
        .await?;
    still_served(server.addr).await?;
    let mut hostile = slow_reader(server).await?;
    let gets: Vec<u8> = (0..400).flat_map(|_| cmd(3, &[&key(b"/big")])).collect();
    hostile.write_all(&gets).await?;
    Ok((writer, hostile))
}

/// Waits until `read` stops changing for a while (the server has done what it will do).
async fn settled(read: impl Fn() -> u64) -> u64 {
    let mut last = read();
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = read();
        if now == last {
            return now;
        }
        last = now;
    }
}

#[tokio::test]
async fn unread_replies_stop_decoding_at_the_cap_and_resume_when_read() -> TestResult {
    let server = TestServer::with_config(small_caps()).await?;
    let (_writer, mut hostile) = flood_with_unread_gets(&server).await?;
    let stats = &server.stats;
    let served = settled(|| stats.requests(Command::Get)).await;
    // 1 MiB queued plus what the two sockets' buffers hold (a few MiB on loopback).
    assert!(
        served < 100,
        "{served} of 400 GETs served to a client that read nothing"
    );
    assert!(stats.backpressured.load(Ordering::Relaxed) >= 1);
    // Everyone else is served meanwhile.
    still_served(server.addr).await?;
    // Reading the replies lets the rest be served, in order, complete.
    let mut reply = vec![0u8; 8 + VALUE];
    for i in 0..400 {
        tokio::time::timeout(READ_TIMEOUT, hostile.read_exact(&mut reply))
            .await
            .map_err(|_| format!("reply {i} did not come"))??;
        assert_eq!(reply[..8], (VALUE as u64).to_le_bytes(), "reply {i}");
        assert!(reply[8..].iter().all(|&b| b == b'x'), "reply {i}");
    }
    assert_eq!(stats.requests(Command::Get), 400);
    server.stop().await
}

#[tokio::test]
async fn a_client_stuck_past_the_cap_is_closed_after_the_deadline() -> TestResult {
    let server = TestServer::with_config(Config {
        write_stall_timeout: Duration::from_millis(500),
        ..small_caps()
    })
    .await?;
    let (_writer, mut hostile) = flood_with_unread_gets(&server).await?;
    let stats = &server.stats;
    // The writer and the hostile client: the hostile one goes once the deadline passes.
    let started = std::time::Instant::now();
    while stats.connections_open.load(Ordering::Relaxed) > 1 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the stuck client was not closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // What it can still read is what the socket buffers held, then the end.
    let mut received = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match tokio::time::timeout(READ_TIMEOUT, hostile.read(&mut buf)).await? {
            Ok(0) | Err(_) => break,
            Ok(n) => received += n,
        }
    }
    assert!(received < 400 * (8 + VALUE), "{received} bytes came");
    still_served(server.addr).await?;
    server.stop().await
}

#[tokio::test]
async fn a_full_store_closes_the_writer_and_keeps_serving_the_others() -> TestResult {
    let server = TestServer::with_config(Config {
        max_store_bytes: 1 << 20,
        ..Config::default()
    })
    .await?;
    let stats = &server.stats;
    let mut filler = validated(server.addr).await?;
    let value = vec![b'v'; 100 * 1024];
    let mut closed_after = None;
    for i in 0..20u32 {
        let name = format!("/fill/{i}");
        // SET has no reply; a GETNUMKEYS after it shows whether the connection is still up.
        let mut request = cmd(1, &[&key(name.as_bytes()), &key(&value)]);
        request.extend(cmd(7, &[]));
        if filler.write_all(&request).await.is_err() {
            closed_after = Some(i);
            break;
        }
        let mut count = [0u8; 8];
        if tokio::time::timeout(READ_TIMEOUT, filler.read_exact(&mut count))
            .await?
            .is_err()
        {
            closed_after = Some(i);
            break;
        }
        assert_eq!(i64::from_le_bytes(count), i64::from(i + 1));
    }
    // 1 MiB holds ten values of 100 KiB and their keys; the eleventh does not fit.
    assert_eq!(closed_after, Some(10));
    assert_eq!(stats.store_full.load(Ordering::Relaxed), 1);
    let stored = stats.bytes_stored.load(Ordering::Relaxed);
    assert!(stored <= 1 << 20 && stored > 10 * value.len(), "{stored}");
    // Reads go on; a full store can be emptied and then written again.
    let mut other = validated(server.addr).await?;
    other.write_all(&cmd(3, &[&key(b"/fill/0")])).await?;
    assert_eq!(
        read_n(&mut other, 8).await?,
        (value.len() as u64).to_le_bytes()
    );
    read_n(&mut other, value.len()).await?;
    other.write_all(&cmd(8, &[&key(b"/fill/0")])).await?;
    assert_eq!(read_n(&mut other, 8).await?, 1i64.to_le_bytes());
    still_served(server.addr).await?;
    server.stop().await
}

#[tokio::test]
async fn pipelined_waits_are_charged_and_given_back() -> TestResult {
    let server = TestServer::with_config(Config {
        max_store_bytes: 64 * 1024,
        ..Config::default()
    })
    .await?;
    let stats = &server.stats;
    let mut waiter = validated(server.addr).await?;
    // WAIT has no reply until released, so only the store's limit stops these.
    let long = vec![b'k'; 8 * 1024];
    let wait = cmd(6, &[&1u64.to_le_bytes(), &key(&long)]);
    let waits: Vec<u8> = (0..100).flat_map(|_| wait.clone()).collect();
    let _ = waiter.write_all(&waits).await;
    expect_closed(&mut waiter).await?;
    assert_eq!(stats.store_full.load(Ordering::Relaxed), 1);
    let started = std::time::Instant::now();
    while stats.bytes_stored.load(Ordering::Relaxed) != 0 {
        assert!(started.elapsed() < READ_TIMEOUT, "registrations kept");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stats.blocked_clients.load(Ordering::Relaxed), 0);
    still_served(server.addr).await?;
    server.stop().await
}

#[tokio::test]
async fn a_reply_over_the_cap_closes_its_connection() -> TestResult {
    let server = TestServer::with_config(small_caps()).await?;
    let mut s = validated(server.addr).await?;
    s.write_all(&cmd(1, &[&key(b"/big"), &key(&vec![b'x'; VALUE])]))
        .await?;
    let multi_get = |n: u64| {
        let mut v = cmd(10, &[&n.to_le_bytes()]);
        for _ in 0..n {
            v.extend(key(b"/big"));
        }
        v
    };
    s.write_all(&multi_get(2)).await?;
    read_n(&mut s, 2 * (8 + VALUE)).await?;
    // Eight copies: 2 MiB in one reply, over the 1 MiB cap.
    s.write_all(&multi_get(8)).await?;
    expect_closed(&mut s).await?;
    still_served(server.addr).await?;
    server.stop().await
}

#[tokio::test]
async fn a_request_longer_than_the_limit_is_closed_while_it_streams_in() -> TestResult {
    let server = TestServer::start().await?;
    let mut s = validated(server.addr).await?;
    // MULTI_SET of 100 pairs of 8 MiB values (800 MiB announced, each field within its limit).
    let mut head = cmd(11, &[&100u64.to_le_bytes()]);
    head.extend(key(b"/a"));
    head.extend((8u64 << 20).to_le_bytes());
    s.write_all(&head).await?;
    let chunk = vec![b'z'; 1 << 20];
    let mut sent = 0usize;
    while sent <= 2 * MAX_REQUEST_BYTES {
        if s.write_all(&chunk).await.is_err() {
            break;
        }
        sent += chunk.len();
    }
    assert!(
        sent <= 2 * MAX_REQUEST_BYTES,
        "{sent} bytes of one request were taken"
    );
    expect_closed(&mut s).await?;
    still_served(server.addr).await?;
    server.stop().await
}
