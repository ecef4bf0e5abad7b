//! Broken and hostile input: the offending connection is closed, nothing is allocated for a
//! declared length, and every other client keeps being served.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::common::{
    cmd, connect, expect_closed, key, next, read_n, still_served, validated, Next, TestResult,
    TestServer, MAGIC, QUIET,
};

const MAX_KEY: u64 = 8 * 1024;
const MAX_VALUE: u64 = 8 * 1024 * 1024;
const MAX_KEYS: u64 = 128 * 1024;

#[tokio::test]
async fn a_conversation_sent_one_byte_at_a_time_is_understood() -> TestResult {
    let server = TestServer::start().await?;
    let mut s = connect(server.addr).await?;
    let mut bytes = cmd(0, &[&MAGIC.to_le_bytes()]);
    bytes.extend(cmd(13, &[&7u32.to_le_bytes()]));
    bytes.extend(cmd(1, &[&key(b"/k"), &key(&[0xab; 3000])]));
    bytes.extend(cmd(3, &[&key(b"/k")]));
    bytes.extend(cmd(4, &[&key(b"/n"), &(-3i64).to_le_bytes()]));
    for (i, b) in bytes.iter().enumerate() {
        s.write_all(&[*b]).await?;
        if i % 97 == 0 {
            // a truncated frame waits for its remainder: no reply, no close
            tokio::task::yield_now().await;
        }
    }
    assert_eq!(read_n(&mut s, 4).await?, 7u32.to_le_bytes());
    let mut want = 3000u64.to_le_bytes().to_vec();
    want.extend_from_slice(&[0xab; 3000]);
    assert_eq!(read_n(&mut s, want.len()).await?, want);
    assert_eq!(read_n(&mut s, 8).await?, (-3i64).to_le_bytes());
    assert_eq!(next(&mut s, QUIET).await, Next::Quiet);
    server.stop().await
}

#[tokio::test]
async fn truncated_frames_then_eof_close_only_that_connection() -> TestResult {
    let server = TestServer::start().await?;
    let frames: Vec<Vec<u8>> = vec![
        cmd(0, &[&MAGIC.to_le_bytes()[..2]]),
        cmd(1, &[&key(b"/key")[..6]]),
        cmd(1, &[&key(b"/key"), &100u64.to_le_bytes(), b"partial"]),
        cmd(5, &[&3u64.to_le_bytes(), &key(b"/a")]),
        cmd(4, &[&key(b"/n"), &[1, 0, 0]]),
    ];
    for (i, frame) in frames.iter().enumerate() {
        let mut s = if i == 0 {
            connect(server.addr).await?
        } else {
            validated(server.addr).await?
        };
        s.write_all(frame).await?;
        assert_eq!(
            next(&mut s, QUIET).await,
            Next::Quiet,
            "frame {i} got an answer"
        );
        still_served(server.addr).await?;
        s.shutdown().await?;
        expect_closed(&mut s).await?;
        still_served(server.addr).await?;
    }
    server.stop().await
}

#[tokio::test]
async fn unknown_command_bytes_close_the_connection() -> TestResult {
    let server = TestServer::start().await?;
    for code in 19..=u8::MAX {
        let mut s = validated(server.addr).await?;
        s.write_all(&[code, 0, 0, 0, 0, 0, 0, 0, 0]).await?;
        expect_closed(&mut s)
            .await
            .map_err(|e| format!("code {code:#04x}: {e}"))?;
    }
    still_served(server.addr).await?;
    assert!(server.stats.protocol_errors.load(Ordering::Relaxed) >= 237);
    server.stop().await
}

#[tokio::test]
async fn replies_before_a_bad_request_are_still_sent() -> TestResult {
    let server = TestServer::start().await?;
    let mut s = connect(server.addr).await?;
    let mut bytes = cmd(0, &[&MAGIC.to_le_bytes()]);
    bytes.extend(cmd(13, &[&9u32.to_le_bytes()]));
    bytes.extend(cmd(7, &[]));
    bytes.push(0x63);
    s.write_all(&bytes).await?;
    assert_eq!(read_n(&mut s, 4).await?, 9u32.to_le_bytes());
    assert_eq!(read_n(&mut s, 8).await?, 0i64.to_le_bytes());
    expect_closed(&mut s).await?;
    server.stop().await
}

#[tokio::test]
async fn bad_handshakes_close_the_connection() -> TestResult {
    let server = TestServer::start().await?;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("wrong magic", cmd(0, &[&0xDEAD_BEEF_u32.to_le_bytes()])),
        ("pre-2.1 magic-less SET first", cmd(0, &[&key(b"/k")])),
        ("PING first", cmd(13, &[&1u32.to_le_bytes()])),
        ("GETNUMKEYS first", cmd(7, &[])),
        ("SET first", cmd(1, &[&key(b"/k"), &key(b"v")])),
    ];
    for (what, bytes) in cases {
        let mut s = connect(server.addr).await?;
        s.write_all(&bytes).await?;
        // a real client follows VALIDATE with PING at once
        let _ = s.write_all(&cmd(13, &[&1u32.to_le_bytes()])).await;
        match next(&mut s, Duration::from_secs(5)).await {
            Next::Closed => {}
            other => return Err(format!("{what}: {other:?}").into()),
        }
    }
    // VALIDATE twice
    let mut s = validated(server.addr).await?;
    s.write_all(&cmd(0, &[&MAGIC.to_le_bytes()])).await?;
    expect_closed(&mut s).await?;
    still_served(server.addr).await?;
    server.stop().await
}

/// Every oversized length closes the connection at once, without waiting for (or allocating) the
/// body it announces.
#[tokio::test]
async fn oversized_lengths_close_at_once() -> TestResult {
    let server = TestServer::start().await?;
    let big = |n: u64| n.to_le_bytes().to_vec();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("GET key u64::MAX", cmd(3, &[&big(u64::MAX)])),
        ("GET key 8 KiB + 1", cmd(3, &[&big(MAX_KEY + 1)])),
        ("SET key 2^63", cmd(1, &[&big(1 << 63)])),
        ("SET value u64::MAX", cmd(1, &[&key(b"/k"), &big(u64::MAX)])),
        (
            "SET value 8 MiB + 1",
            cmd(1, &[&key(b"/k"), &big(MAX_VALUE + 1)]),
        ),
        (
            "APPEND value 8 MiB + 1",
            cmd(9, &[&key(b"/k"), &big(MAX_VALUE + 1)]),
        ),
        (
            "QUEUE_PUSH value huge",
            cmd(14, &[&key(b"/q"), &big(u64::MAX - 7)]),
        ),
        (
            "COMPARE_SET expected huge",
            cmd(2, &[&key(b"/k"), &big(u64::MAX)]),
        ),
        (
            "COMPARE_SET desired huge",
            cmd(2, &[&key(b"/k"), &key(b""), &big(MAX_VALUE + 1)]),
        ),
        ("ADD key huge", cmd(4, &[&big(u64::MAX / 2)])),
        ("BARRIER key huge", cmd(18, &[&big(MAX_KEY + 1)])),
        ("CHECK count 131073", cmd(5, &[&big(MAX_KEYS + 1)])),
        ("WAIT count u64::MAX", cmd(6, &[&big(u64::MAX)])),
        ("MULTI_GET count 2^40", cmd(10, &[&big(1 << 40)])),
        ("MULTI_SET count -1", cmd(11, &[&(-1i64).to_le_bytes()])),
        ("MULTI_SET count 131073", cmd(11, &[&big(MAX_KEYS + 1)])),
        (
            "MULTI_SET second value huge",
            cmd(
                11,
                &[
                    &big(2),
                    &key(b"/a"),
                    &key(b"1"),
                    &key(b"/b"),
                    &big(u64::MAX),
                ],
            ),
        ),
        (
            "WAIT second key huge",
            cmd(6, &[&big(2), &key(b"/a"), &big(u64::MAX)]),
        ),
    ];
    for (what, bytes) in cases {
        let mut s = validated(server.addr).await?;
        s.write_all(&bytes).await?;
        expect_closed(&mut s)
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        still_served(server.addr).await?;
    }
    server.stop().await
}

/// Virtual size of this process (the server runs in it): a reservation shows here even while its
/// pages are untouched, unlike RSS.
fn vm_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .next()
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// Lengths within the limits but never followed by their bodies: 510 connections announce an
/// 8 MiB value, 131,072 keys to wait for, or 131,072 pairs to set (about 2.5 GiB if the server
/// reserved them); memory must not follow the announcements.
#[tokio::test]
async fn announced_lengths_are_not_allocated() -> TestResult {
    let server = TestServer::start().await?;
    let before = vm_bytes();
    let mut conns: Vec<TcpStream> = Vec::new();
    for i in 0..510u32 {
        let mut s = validated(server.addr).await?;
        let bytes = match i % 3 {
            0 => cmd(1, &[&key(b"/v"), &MAX_VALUE.to_le_bytes(), b"start"]),
            1 => cmd(6, &[&MAX_KEYS.to_le_bytes(), &key(b"/a")]),
            _ => cmd(11, &[&MAX_KEYS.to_le_bytes()]),
        };
        s.write_all(&bytes).await?;
        conns.push(s);
    }
    still_served(server.addr).await?;
    let grown = vm_bytes().saturating_sub(before);
    assert!(
        grown < 512 * 1024 * 1024,
        "virtual size grew by {} MiB",
        grown >> 20
    );
    for s in &mut conns {
        assert_eq!(next(s, Duration::from_millis(1)).await, Next::Quiet);
    }
    drop(conns);
    server.stop().await
}

#[tokio::test]
async fn client_vanishing_mid_wait_then_set() -> TestResult {
    let server = TestServer::start().await?;
    for _ in 0..20 {
        let mut w = validated(server.addr).await?;
        w.write_all(&cmd(
            6,
            &[&2u64.to_le_bytes(), &key(b"/gone"), &key(b"/gone2")],
        ))
        .await?;
        assert_eq!(next(&mut w, Duration::from_millis(20)).await, Next::Quiet);
        drop(w);
    }
    let mut b = validated(server.addr).await?;
    // a live waiter on the same key must still be released exactly once
    let mut live = validated(server.addr).await?;
    live.write_all(&cmd(6, &[&1u64.to_le_bytes(), &key(b"/gone")]))
        .await?;
    assert_eq!(next(&mut live, QUIET).await, Next::Quiet);
    b.write_all(&cmd(1, &[&key(b"/gone"), &key(b"x")])).await?;
    b.write_all(&cmd(1, &[&key(b"/gone2"), &key(b"y")])).await?;
    b.write_all(&cmd(7, &[])).await?;
    assert_eq!(read_n(&mut b, 8).await?, 2i64.to_le_bytes());
    assert_eq!(read_n(&mut live, 1).await?, [0]);
    assert_eq!(next(&mut live, QUIET).await, Next::Quiet);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.stats.blocked_clients.load(Ordering::Relaxed), 0);
    still_served(server.addr).await?;
    server.stop().await
}

#[tokio::test]
async fn cancel_wait_races_never_leave_a_stray_byte() -> TestResult {
    let server = TestServer::start().await?;
    let mut writer = validated(server.addr).await?;
    let mut waiter = validated(server.addr).await?;
    for i in 0..200u32 {
        let k = format!("/race{i}");
        waiter
            .write_all(&cmd(6, &[&1u64.to_le_bytes(), &key(k.as_bytes())]))
            .await?;
        // the write and the cancel race; the waiter reads 00 01 or just 01, then nothing else
        writer
            .write_all(&cmd(1, &[&key(k.as_bytes()), &key(b"v")]))
            .await?;
        waiter.write_all(&[12]).await?;
        let first = read_n(&mut waiter, 1).await?;
        if first == [0] {
            assert_eq!(read_n(&mut waiter, 1).await?, [1], "round {i}");
        } else {
            assert_eq!(first, [1], "round {i}");
        }
        waiter.write_all(&cmd(7, &[])).await?;
        let n = read_n(&mut waiter, 8).await?;
        assert_eq!(
            n,
            (i64::from(i) + 1).to_le_bytes(),
            "round {i}: out of sync"
        );
    }
    server.stop().await
}

/// Many idle connections (1,000 here; the 10k case runs against `muster store` from Python with a
/// raised descriptor limit) do not slow down or starve active clients.
#[tokio::test]
async fn idle_connections_do_not_starve_active_ones() -> TestResult {
    let server = TestServer::start().await?;
    let mut idle = Vec::new();
    for i in 0..1000 {
        let s = if i % 2 == 0 {
            connect(server.addr).await?
        } else {
            validated(server.addr).await?
        };
        idle.push(s);
    }
    let mut s = validated(server.addr).await?;
    let started = std::time::Instant::now();
    for i in 1..=1000i64 {
        s.write_all(&cmd(4, &[&key(b"/busy"), &1i64.to_le_bytes()]))
            .await?;
        assert_eq!(read_n(&mut s, 8).await?, i.to_le_bytes());
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "1000 ADDs took {:?}",
        started.elapsed()
    );
    assert!(server.stats.connections_open.load(Ordering::Relaxed) >= 1001);
    drop(idle);
    server.stop().await
}

#[tokio::test]
async fn connection_cap_refuses_extra_connections_only() -> TestResult {
    let config = rendezvous::store::server::Config {
        max_connections: 4,
        ..Default::default()
    };
    let server = TestServer::with_config(config).await?;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(validated(server.addr).await?);
    }
    let mut extra = connect(server.addr).await?;
    expect_closed(&mut extra).await?;
    for s in &mut held {
        s.write_all(&cmd(7, &[])).await?;
        assert_eq!(read_n(s, 8).await?, 0i64.to_le_bytes());
    }
    drop(held);
    tokio::time::sleep(Duration::from_millis(100)).await;
    still_served(server.addr).await?;
    server.stop().await
}
