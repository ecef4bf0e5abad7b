//! The ranks' socket for snapshots (`MUSTER_SNAPSHOT_SOCKET`), read by
//! `python/muster_launcher/snapshot.py`. One packet per message:
//!
//! - rank → agent: `hello <local_rank> <rank> <pid> <attempt>` (first), `hold <step> <bytes>
//!   [<blocked_us>]` with the memory file of its part (`blocked_us`: how long the rank has been
//!   blocked building it, for `muster_snapshot_blocking_seconds`), `restore`.
//! - agent → rank: `held <step>`; `refused <step> <why>` (skip this one); `off <step> <why>`
//!   (no more snapshots for this job); `restore <step> <bytes>` with the memory file, or
//!   `none <why>`.
//!
//! Who may call it: the socket is abstract, so only processes in the pod's network namespace
//! reach it (nothing on the pod network does), and of those only processes of the agent's own
//! user: any other is closed with a WARN. A part must be a memory file the agent can seal
//! against writes, growing and shrinking, so what was committed cannot change after it was held;
//! anything else is refused. A malformed packet closes that connection only.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, SealFlag};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::disk::Disk;
use super::holder::{Holder, Part, Refusal};
use super::packet::{Connection, Listener, Packet};
use super::replica::net::Listening;
use super::replica::{Host, Replicas};
use super::Meter;

/// How long a `restore` waits for the gang to agree on the step.
const RESTORE_WAIT: Duration = Duration::from_secs(180);

/// The gang's agreement at the start of one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub attempt: u32,
    pub agreed: Option<u64>,
}

/// A step every local rank now holds, for the commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completed {
    pub attempt: u32,
    pub step: u64,
}

/// What the writer to the disk ([`super::persist`]) is asked for: the attempt, the step it
/// agreed to restore, and the newest committed step to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    pub attempt: u32,
    pub agreed: Option<u64>,
    pub step: Option<u64>,
}

/// What the socket and the gang's side share.
pub struct Shared {
    holder: Mutex<Holder>,
    /// What this agent holds for its buddies ([`super::replica`]).
    replicas: Mutex<Replicas>,
    /// The replica listener, once the first attempt with peers started it.
    pub listening: tokio::sync::OnceCell<Listening>,
    pub settled: watch::Sender<Option<Settled>>,
    completed: mpsc::UnboundedSender<Completed>,
    said_over_cap: AtomicBool,
    pub meter: Option<Arc<dyn Meter>>,
    /// `--snapshot-persist`: where committed steps are written ([`super::persist`]).
    pub disk: Option<Disk>,
    /// The newest committed step (and its attempt), for the writer to the disk.
    pub to_persist: watch::Sender<Option<Wanted>>,
    /// The newest step the writer found or left whole on the disk.
    pub persisted: watch::Sender<Option<u64>>,
}

impl Shared {
    pub fn new(
        holder: Holder,
        meter: Option<Arc<dyn Meter>>,
        disk: Option<Disk>,
    ) -> (Arc<Shared>, mpsc::UnboundedReceiver<Completed>) {
        let (completed, completions) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            holder: Mutex::new(holder),
            replicas: Mutex::new(Replicas::default()),
            listening: tokio::sync::OnceCell::new(),
            settled: watch::Sender::new(None),
            completed,
            said_over_cap: AtomicBool::new(false),
            meter,
            disk,
            to_persist: watch::Sender::new(None),
            persisted: watch::Sender::new(None),
        });
        (shared, completions)
    }

    pub fn holder(&self) -> MutexGuard<'_, Holder> {
        self.holder.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lock order: the holder before the replicas, when both are held.
    pub fn replicas(&self) -> MutexGuard<'_, Replicas> {
        self.replicas.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Host for Shared {
    fn attempt_and_room(&self) -> (Option<u32>, u64) {
        let holder = self.holder();
        let held = holder.bytes_held() + self.replicas().bytes();
        (holder.attempt(), holder.cap_bytes().saturating_sub(held))
    }

    fn replicas(&self) -> MutexGuard<'_, Replicas> {
        Shared::replicas(self)
    }
}

/// Serves `listener` until `stop`.
pub async fn serve(listener: Listener, shared: Arc<Shared>, stop: CancellationToken) {
    let uid = nix::unistd::geteuid().as_raw();
    loop {
        let connection = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    warn!("snapshots: accepting a rank's connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        match connection.peer_uid() {
            Ok(peer) if peer == uid => {}
            Ok(peer) => {
                warn!("snapshots: closed a connection from user {peer}: only the agent's user ({uid}) may hand over snapshots");
                continue;
            }
            Err(e) => {
                warn!("snapshots: closed a connection whose peer is unknown: {e}");
                continue;
            }
        }
        let shared = Arc::clone(&shared);
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                result = serve_rank(&connection, &shared) => if let Err(why) = result {
                    debug!("snapshots: a rank's connection closed: {why}");
                },
            }
        });
    }
}

/// Who is on a connection, from its hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hello {
    rank: u32,
    attempt: u32,
}

fn parse_hello(text: &str) -> Result<Hello, String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    match words.as_slice() {
        ["hello", _local_rank, rank, _pid, attempt] => Ok(Hello {
            rank: rank.parse().map_err(|_| format!("bad rank in {text:?}"))?,
            attempt: attempt
                .parse()
                .map_err(|_| format!("bad attempt in {text:?}"))?,
        }),
        _ => Err(format!("expected hello, got {text:?}")),
    }
}

async fn serve_rank(connection: &Connection, shared: &Shared) -> Result<(), String> {
    let first = next(connection).await?.ok_or("closed before its hello")?;
    let hello = parse_hello(&first.text)?;
    loop {
        let Some(packet) = next(connection).await? else {
            return Ok(());
        };
        let words: Vec<&str> = packet.text.split_whitespace().collect();
        match (words.as_slice(), packet.memory) {
            (["hold", step, bytes, blocked @ ..], Some(memory)) if blocked.len() <= 1 => {
                let received = Instant::now();
                let step: u64 = step.parse().map_err(|_| format!("bad step in {words:?}"))?;
                let bytes: u64 = bytes
                    .parse()
                    .map_err(|_| format!("bad size in {words:?}"))?;
                // An older helper does not say; a bad number is only a lost sample.
                let blocked_before = blocked
                    .first()
                    .and_then(|us| us.parse::<u64>().ok())
                    .map_or(Duration::ZERO, Duration::from_micros);
                let reply = hold(shared, hello, step, bytes, memory);
                if let (Some(meter), true) = (&shared.meter, reply.starts_with("held")) {
                    let blocked = blocked_before + received.elapsed();
                    let node_holds = shared.holder().bytes_held();
                    meter.held(hello.rank, bytes, blocked.as_secs_f64(), node_holds);
                }
                send(connection, &reply, None).await?;
            }
            (["restore"], None) => restore(connection, shared, hello).await?,
            _ => return Err(format!("unknown message {:?}", packet.text)),
        }
    }
}

async fn next(connection: &Connection) -> Result<Option<Packet>, String> {
    connection.recv().await.map_err(|e| e.to_string())
}

async fn send(
    connection: &Connection,
    text: &str,
    memory: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<(), String> {
    connection
        .send(text, memory)
        .await
        .map_err(|e| e.to_string())
}

/// Seals `memory` and takes it as `hello`'s part of `step`; the reply line.
fn hold(shared: &Shared, hello: Hello, step: u64, bytes: u64, memory: OwnedFd) -> String {
    if let Err(why) = seal(&memory, bytes) {
        count_refusal(shared, "invalid");
        return format!("refused {step} {why}");
    }
    let part = Part {
        memory,
        bytes,
        attempt: hello.attempt,
    };
    let held = shared.holder().hold(hello.rank, step, part);
    match held {
        Ok(complete) => {
            if complete {
                // The receiver goes only with the agent.
                let _ = shared.completed.send(Completed {
                    attempt: hello.attempt,
                    step,
                });
            }
            format!("held {step}")
        }
        Err(refusal) if refusal.is_final() => {
            count_refusal(shared, "over_cap");
            if !shared.said_over_cap.swap(true, Ordering::Relaxed) {
                warn!("snapshots are off for this job: rank {}'s part of step {step}: {refusal}; the job trains on (what is committed stays the restart point)", hello.rank);
            }
            format!("off {step} {refusal}")
        }
        Err(refusal) => {
            let busy = matches!(refusal, Refusal::Pending { .. } | Refusal::Unsettled);
            count_refusal(shared, if busy { "busy" } else { "invalid" });
            if matches!(refusal, Refusal::Pending { .. }) {
                debug!(
                    "snapshots: rank {} skips step {step}: {refusal}",
                    hello.rank
                );
            } else {
                warn!(
                    "snapshots: rank {}'s part of step {step} refused: {refusal}",
                    hello.rank
                );
            }
            format!("refused {step} {refusal}")
        }
    }
}

fn count_refusal(shared: &Shared, why: &'static str) {
    if let Some(meter) = &shared.meter {
        meter.refused(why);
    }
}

/// Seals a part against any change; refuses what is no memory file of at least `bytes`.
fn seal(memory: &OwnedFd, bytes: u64) -> Result<(), String> {
    let file = std::fs::File::from(memory.try_clone().map_err(|e| e.to_string())?);
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    if size < bytes {
        return Err(format!("its memory file holds {size} bytes, not {bytes}"));
    }
    let seals = SealFlag::F_SEAL_SHRINK
        | SealFlag::F_SEAL_GROW
        | SealFlag::F_SEAL_WRITE
        | SealFlag::F_SEAL_SEAL;
    nix::fcntl::fcntl(memory.as_fd(), FcntlArg::F_ADD_SEALS(seals))
        .map(|_| ())
        .map_err(|e| format!("its memory file cannot be sealed ({e}): a memfd created with MFD_ALLOW_SEALING and no writable mapping left is expected"))
}

async fn restore(connection: &Connection, shared: &Shared, hello: Hello) -> Result<(), String> {
    let mut settled = shared.settled.subscribe();
    let agreed = tokio::time::timeout(
        RESTORE_WAIT,
        settled.wait_for(|s| s.is_some_and(|s| s.attempt >= hello.attempt)),
    )
    .await
    .map(|waited| waited.map(|s| *s));
    let agreement = match agreed {
        Ok(Ok(s)) => s,
        Ok(Err(_)) => None,
        Err(_) => {
            return send(
                connection,
                "none the gang did not agree on a step in time",
                None,
            )
            .await
        }
    };
    let Some(Settled {
        attempt,
        agreed: Some(step),
    }) = agreement
    else {
        return send(connection, "none no snapshot committed on every node", None).await;
    };
    if attempt != hello.attempt {
        return send(
            connection,
            "none this rank is from an attempt that ended",
            None,
        )
        .await;
    }
    let part = shared.holder().part(hello.rank, step).map(|p| {
        p.memory
            .try_clone()
            .map(|memory| (memory, p.bytes))
            .map_err(|e| e.to_string())
    });
    match part {
        Some(Ok((memory, bytes))) => {
            send(
                connection,
                &format!("restore {step} {bytes}"),
                Some(memory.as_fd()),
            )
            .await
        }
        Some(Err(e)) => send(connection, &format!("none {e}"), None).await,
        None => {
            send(
                connection,
                "none this node holds no part for the rank",
                None,
            )
            .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_parse_or_say_why_not() {
        assert_eq!(
            parse_hello("hello 1 3 4242 2"),
            Ok(Hello {
                rank: 3,
                attempt: 2
            })
        );
        assert!(parse_hello("hello 1 x 4242 2")
            .unwrap_err()
            .contains("bad rank"));
        assert!(parse_hello("hold 5 10")
            .unwrap_err()
            .contains("expected hello"));
    }
}
