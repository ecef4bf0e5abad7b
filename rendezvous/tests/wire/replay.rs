//! Replays every fixture of `tests/fixtures/tcpstore/` (real torch 2.15 client ⇄ libuv server
//! exchanges) against our server and requires the same reply bytes.
//!
//! Fixture lines: `C> hex…` client bytes, `S> hex…` server bytes, `S> close` the server closed the
//! connection; consecutive lines of one direction form one step. A LIST_KEYS reply is compared as
//! a set of keys (its order is the server's hash order). At the end of an exchange that torch left
//! open, the server must send nothing more and keep the connection open.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tokio::io::AsyncWriteExt;

use super::common::{connect, next, read_n, Next, TestResult, TestServer, QUIET, READ_TIMEOUT};

/// Where muster deliberately differs from libuv; the replay checks muster's documented behaviour
/// instead of torch's bytes for these (and nothing else).
const DIVERGENCES: &[(&str, &str)] = &[(
    "missing_validate",
    "a first message other than VALIDATE closes the connection (classic's behaviour; libuv holds \
     it back until more bytes arrive and then answers; no real client sends this)",
)];

#[derive(Debug)]
enum Step {
    Send(Vec<u8>),
    Expect(Vec<u8>),
    Close,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tcpstore")
}

fn parse(text: &str) -> Result<Vec<Step>, String> {
    let mut steps: Vec<Step> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (dir, rest) = line
            .split_once("> ")
            .ok_or_else(|| format!("line {}: no direction", n + 1))?;
        if dir == "S" && rest == "close" {
            steps.push(Step::Close);
            continue;
        }
        let bytes = rest
            .split_whitespace()
            .map(|h| u8::from_str_radix(h, 16).map_err(|e| format!("line {}: {e}", n + 1)))
            .collect::<Result<Vec<u8>, String>>()?;
        match (dir, steps.last_mut()) {
            ("C", Some(Step::Send(prev))) | ("S", Some(Step::Expect(prev))) => {
                prev.extend_from_slice(&bytes);
            }
            ("C", _) => steps.push(Step::Send(bytes)),
            ("S", _) => steps.push(Step::Expect(bytes)),
            _ => return Err(format!("line {}: unknown direction {dir:?}", n + 1)),
        }
    }
    Ok(steps)
}

/// A LIST_KEYS reply as a multiset of keys, if `bytes` is exactly one.
fn key_list(bytes: &[u8]) -> Option<BTreeMap<Vec<u8>, usize>> {
    let count = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let mut rest = &bytes[8..];
    let mut keys = BTreeMap::new();
    for _ in 0..count {
        let len = usize::try_from(u64::from_le_bytes(rest.get(..8)?.try_into().ok()?)).ok()?;
        let key = rest.get(8..8 + len)?.to_vec();
        rest = &rest[8 + len..];
        *keys.entry(key).or_insert(0) += 1;
    }
    rest.is_empty().then_some(keys)
}

async fn replay(server: &TestServer, name: &str, steps: &[Step]) -> Result<(), String> {
    let mut s = connect(server.addr).await.map_err(|e| e.to_string())?;
    let mut last_sent: u8 = 0xff;
    let mut write_failed = false;
    for (i, step) in steps.iter().enumerate() {
        match step {
            Step::Send(bytes) => {
                // A server that already closed (as torch did, in some fixtures) may reset the
                // write; the next step must then be the close.
                write_failed = s.write_all(bytes).await.is_err();
                last_sent = *bytes.last().unwrap_or(&0xff);
            }
            Step::Expect(want) => {
                let got = read_n(&mut s, want.len())
                    .await
                    .map_err(|e| format!("step {i}: reading {} bytes: {e}", want.len()))?;
                let same = got == *want
                    || (last_sent == 17
                        && key_list(&got).is_some()
                        && key_list(&got) == key_list(want));
                if !same {
                    return Err(format!(
                        "{name} step {i}: reply differs\n  torch:  {want:02x?}\n  muster: {got:02x?}"
                    ));
                }
            }
            Step::Close => match next(&mut s, READ_TIMEOUT).await {
                Next::Closed => return Ok(()),
                other => {
                    return Err(format!(
                        "{name} step {i}: torch closed here, muster: {other:?}"
                    ))
                }
            },
        }
    }
    if write_failed {
        return Err(format!(
            "{name}: a write failed but torch kept the connection"
        ));
    }
    match next(&mut s, QUIET).await {
        Next::Quiet => Ok(()),
        other => Err(format!(
            "{name}: after the exchange torch stayed quiet and open, muster: {other:?}"
        )),
    }
}

/// muster's documented behaviour for a divergent fixture: its client bytes get the connection
/// closed without any reply.
async fn closes_without_reply(server: &TestServer, steps: &[Step]) -> Result<(), String> {
    let mut s = connect(server.addr).await.map_err(|e| e.to_string())?;
    for step in steps {
        if let Step::Send(bytes) = step {
            let _ = s.write_all(bytes).await;
        }
    }
    match next(&mut s, READ_TIMEOUT).await {
        Next::Closed => Ok(()),
        other => Err(format!(
            "expected the connection closed without a reply, got {other:?}"
        )),
    }
}

#[tokio::test]
async fn fixtures_replay_byte_exact() -> TestResult {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    paths.sort();
    // The capture tool writes 31 exchanges; a lost directory must not pass as "nothing failed".
    assert!(
        paths.len() >= 30,
        "only {} fixtures in {}",
        paths.len(),
        fixtures_dir().display()
    );
    let mut failures = Vec::new();
    for path in &paths {
        // every exchange was captured on a fresh server (GETNUMKEYS and LIST_KEYS see it all)
        let server = TestServer::start().await?;
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .to_owned();
        let steps = parse(&std::fs::read_to_string(path)?)?;
        let result = if DIVERGENCES.iter().any(|(n, _)| *n == name) {
            closes_without_reply(&server, &steps).await
        } else {
            replay(&server, &name, &steps).await
        };
        if let Err(e) = result {
            failures.push(e);
        }
        server.stop().await?;
    }
    assert!(
        failures.is_empty(),
        "{} of {} fixtures differ:\n{}",
        failures.len(),
        paths.len(),
        failures.join("\n")
    );
    Ok(())
}

#[test]
fn key_list_compares_as_a_set() {
    let mut a = 2u64.to_le_bytes().to_vec();
    for k in [&b"/a"[..], b"/bb"] {
        a.extend_from_slice(&(k.len() as u64).to_le_bytes());
        a.extend_from_slice(k);
    }
    let mut b = 2u64.to_le_bytes().to_vec();
    for k in [&b"/bb"[..], b"/a"] {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k);
    }
    assert_ne!(a, b);
    assert_eq!(key_list(&a), key_list(&b));
    assert_eq!(key_list(&a[..a.len() - 1]), None);
}
