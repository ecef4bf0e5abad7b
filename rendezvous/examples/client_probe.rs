//! Drives `rendezvous::store::client::Client` against a store given on the command line, so a
//! Python test can point muster's client at a **real torch TCPStore server** (libuv and classic)
//! and at servers that misbehave. Built by that test itself
//! (`cargo build --release -p rendezvous --example client_probe`; `scripts/test` builds the
//! workspace without examples, and clippy checks this file with `--all-targets`).
//!
//! ```text
//! client_probe ADDR all [--no-queues]   every operation, with its expected result (exit 0 = all ok)
//! client_probe ADDR silent              the server accepts and never answers: connect must fail
//!                                       with a timeout within its deadline
//! client_probe ADDR mute-after-ping     the server answers the handshake, then nothing: reads
//!                                       must time out
//! ```
//! Every check prints one `ok …` line; the first failure prints `FAIL …` and exits 1.
//! Keys are raw wire keys, so values meant for torch clients carry torch's `/` prefix.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rendezvous::store::client::{Client, ClientError};

type Res = Result<(), String>;

fn check(what: &str, ok: bool, detail: impl std::fmt::Debug) -> Res {
    if ok {
        println!("ok {what}");
        Ok(())
    } else {
        Err(format!("{what}: {detail:?}"))
    }
}

/// Client errors as the probe's one-line failure text.
trait Msg<T> {
    fn msg(self) -> Result<T, String>;
}

impl<T> Msg<T> for Result<T, ClientError> {
    fn msg(self) -> Result<T, String> {
        self.map_err(|err| err.to_string())
    }
}

async fn all(addr: SocketAddr, queues: bool) -> Res {
    let mut client = Client::connect(addr, Duration::from_secs(10)).await.msg()?;
    client.set_timeout(Duration::from_secs(10));
    println!("ok connect");
    client.ping().await.msg()?;
    println!("ok ping");

    client.set(b"/rust/k", b"v1").await.msg()?;
    let value = client.get(b"/rust/k").await.msg()?;
    check("set/get", value == b"v1", &value)?;
    client.set(b"/rust/bin", &[0, 0xff, 1]).await.msg()?;
    let value = client.get(b"/rust/bin").await.msg()?;
    check("binary value", value == [0, 0xff, 1], &value)?;
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    client.set(b"/rust/big", &big).await.msg()?;
    let value = client.get(b"/rust/big").await.msg()?;
    check("200 kB value", value == big, value.len())?;

    let num = client.add(b"/rust/n", 5).await.msg()?;
    check("add creates", num == 5, num)?;
    let num = client.add(b"/rust/n", -7).await.msg()?;
    check("add negative", num == -2, num)?;
    client.set(b"/rust/ws", b"  7x").await.msg()?;
    let num = client.add(b"/rust/ws", 1).await.msg()?;
    check("add stoll whitespace/junk", num == 8, num)?;

    let value = client.compare_set(b"/rust/cs", b"", b"new").await.msg()?;
    check("compare_set create", value == b"new", &value)?;
    let value = client
        .compare_set(b"/rust/cs2", b"old", b"new")
        .await
        .msg()?;
    check(
        "compare_set missing returns expected",
        value == b"old",
        &value,
    )?;
    let exists = client.check(&[b"/rust/cs2"]).await.msg()?;
    check("compare_set missing does not create", !exists, exists)?;
    let value = client
        .compare_set(b"/rust/cs", b"new", b"newer")
        .await
        .msg()?;
    check("compare_set match", value == b"newer", &value)?;
    let value = client
        .compare_set(b"/rust/cs", b"wrong", b"x")
        .await
        .msg()?;
    check(
        "compare_set mismatch returns current",
        value == b"newer",
        &value,
    )?;

    let ready = client.check(&[b"/rust/k", b"/rust/n"]).await.msg()?;
    check("check all present", ready, ready)?;
    let ready = client.check(&[b"/rust/k", b"/rust/absent"]).await.msg()?;
    check("check one missing", !ready, ready)?;

    client
        .wait(&[b"/rust/k"], Duration::from_secs(5))
        .await
        .msg()?;
    println!("ok wait present");
    let start = Instant::now();
    let result = client
        .wait(&[b"/rust/absent"], Duration::from_millis(300))
        .await;
    check(
        "wait timeout",
        matches!(result, Err(ClientError::WaitTimeout { .. }))
            && start.elapsed() < Duration::from_secs(3),
        (&result.err(), start.elapsed()),
    )?;
    // the cancel that followed left the connection in sync
    let num = client.add(b"/rust/n", 2).await.msg()?;
    check("in sync after wait timeout", num == 0, num)?;

    client
        .multi_set(&[(b"/rust/m1", b"a"), (b"/rust/m2", b""), (b"/rust/m3", b"c")])
        .await
        .msg()?;
    let value = client
        .multi_get(&[b"/rust/m3", b"/rust/m1", b"/rust/m2"])
        .await
        .msg()?;
    check(
        "multi_set/multi_get",
        value == [b"c".to_vec(), b"a".to_vec(), vec![]],
        &value,
    )?;

    client.append(b"/rust/ap", b"ab").await.msg()?;
    client.append(b"/rust/ap", b"c").await.msg()?;
    let value = client.get(b"/rust/ap").await.msg()?;
    check("append", value == b"abc", &value)?;

    let deleted = client.delete_key(b"/rust/m1").await.msg()?;
    check("delete existing", deleted, deleted)?;
    let deleted = client.delete_key(b"/rust/m1").await.msg()?;
    check("delete missing", !deleted, deleted)?;

    let keys = client.list_keys().await.msg()?;
    let num = client.num_keys().await.msg()?;
    let mut names: Vec<String> = keys
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    names.sort();
    let want = [
        "/rust/ap",
        "/rust/big",
        "/rust/bin",
        "/rust/cs",
        "/rust/k",
        "/rust/m2",
        "/rust/m3",
        "/rust/n",
        "/rust/ws",
    ];
    check("list_keys", names == want, &names)?;
    check("num_keys", num == want.len() as i64, num)?;

    client
        .barrier(b"/rust/bar", 1, Duration::from_secs(5))
        .await
        .msg()?;
    println!("ok barrier of one");
    let result = client
        .barrier(b"/rust/bar2", 2, Duration::from_millis(300))
        .await;
    check(
        "barrier timeout",
        matches!(result, Err(ClientError::WaitTimeout { .. })),
        result.err(),
    )?;
    let value = client.get(b"/rust/bar2").await.msg()?;
    check("barrier count kept after timeout", value == b"1", &value)?;

    if queues {
        queue_ops(&mut client).await?;
    }

    // left for the Python side to read with torch's client (as key "from-rust")
    client.set(b"/from-rust", b"hello torch").await.msg()?;
    client.ping().await.msg()?;
    println!("ok all");
    Ok(())
}

/// The queue operations (torch 2.4 and later), which some servers under test lack.
async fn queue_ops(client: &mut Client) -> Res {
    client.queue_push(b"/rust/q", b"one").await.msg()?;
    client.queue_push(b"/rust/q", b"two").await.msg()?;
    let num = client.queue_len(b"/rust/q").await.msg()?;
    check("queue_len", num == 2, num)?;
    let value = client.queue_pop(b"/rust/q").await.msg()?;
    check(
        "queue_pop first",
        value.as_deref() == Some(&b"one"[..]),
        &value,
    )?;
    let value = client.queue_pop(b"/rust/q").await.msg()?;
    check(
        "queue_pop second",
        value.as_deref() == Some(&b"two"[..]),
        &value,
    )?;
    let value = client.queue_pop(b"/rust/q").await.msg()?;
    check("queue_pop empty", value.is_none(), &value)?;
    Ok(())
}

async fn silent(addr: SocketAddr) -> Res {
    let start = Instant::now();
    let result = Client::connect(addr, Duration::from_millis(800)).await;
    let took = start.elapsed();
    check(
        "connect to a silent server fails in time",
        result.is_err() && took < Duration::from_secs(3),
        (result.err().map(|err| err.to_string()), took),
    )
}

async fn mute_after_ping(addr: SocketAddr) -> Res {
    let mut client = Client::connect(addr, Duration::from_secs(5)).await.msg()?;
    println!("ok connect");
    client.set_timeout(Duration::from_millis(500));
    for op in ["add", "get", "num_keys", "ping"] {
        let start = Instant::now();
        let result = match op {
            "add" => client.add(b"/x", 1).await.map(drop),
            "get" => client.get(b"/x").await.map(drop),
            "num_keys" => client.num_keys().await.map(drop),
            _ => client.ping().await,
        };
        let took = start.elapsed();
        check(
            &format!("{op} on a mute server times out"),
            matches!(result, Err(ClientError::Timeout { .. })) && took < Duration::from_secs(3),
            (result.err().map(|err| err.to_string()), took),
        )?;
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(addr), Some(mode)) = (args.first(), args.get(1)) else {
        eprintln!("usage: client_probe ADDR all|silent|mute-after-ping [--no-queues]");
        return ExitCode::from(2);
    };
    let addr: SocketAddr = match addr.parse() {
        Ok(a) => a,
        Err(err) => {
            eprintln!("bad address {addr:?}: {err}");
            return ExitCode::from(2);
        }
    };
    let queues = !args.iter().any(|a| a == "--no-queues");
    let result = match mode.as_str() {
        "all" => all(addr, queues).await,
        "silent" => silent(addr).await,
        "mute-after-ping" => mute_after_ping(addr).await,
        other => Err(format!("unknown mode {other}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            println!("FAIL {msg}");
            ExitCode::from(1)
        }
    }
}
