//! In-memory snapshots (`--snapshot-every N`): every N optimizer steps each rank copies its
//! training state into a memory file and hands the file to its node's agent, so a crashed rank
//! loses only the steps since; a restart within the job restores the newest step every rank of
//! the gang handed over. docs/snapshots.md tells the user's side.
//!
//! - [`holder`]: what the agent holds, at most two generations, and the rules that keep it safe.
//! - [`packet`] and [`server`]: the ranks' socket (`MUSTER_SNAPSHOT_SOCKET`): a rank's part comes
//!   in as a sealed memfd (`SCM_RIGHTS`), never through a pipe of bytes: the rank's copy of its
//!   tensors into the file is the only copy, and the agent keeping the descriptor is what keeps
//!   the memory when the rank dies. A memfd counts against the pod's memory limit like the rank's
//!   own memory, and, unlike a file in `/dev/shm`, not against the 64 MiB `/dev/shm` a
//!   Kubernetes pod or a Docker container gets by default.
//! - [`commit`]: on the attempt's store, which step an attempt restores and when a step is
//!   committed.
//! - [`replica`]: each node's parts of a committed step copied to its buddy node, and fetched
//!   back by a replacement pod.
//!
//! The Python side is `python/muster_launcher/snapshot.py`.

pub mod commit;
pub mod holder;
pub mod packet;
pub mod replica;
pub mod server;

use std::sync::Arc;

use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::launch::{Config, Event, Observer};
use crate::watch::cgroup::{human_bytes, MemoryCgroup};
use holder::{Holder, Share};
use packet::Listener;
use server::{Completed, Shared};

/// The workers' variable naming the socket (`@name`: abstract).
pub const SOCKET_ENV: &str = "MUSTER_SNAPSHOT_SOCKET";
/// The workers' variable with `--snapshot-every`.
pub const EVERY_ENV: &str = "MUSTER_SNAPSHOT_EVERY";

/// The share of the pod's memory limit (else of the machine's memory) that snapshots may hold
/// when `--snapshot-memory` does not say: two generations of a state as large as a quarter of
/// the pod, next to the ranks' own copy of it.
const DEFAULT_CAP_SHARE: u64 = 2;

/// What the service reports as it works, for the agent's metrics (wired by the composition
/// root, so that this module does not depend on them).
pub trait Meter: Send + Sync {
    /// A rank's part of a step is held; `blocked_seconds` is what it cost the rank.
    fn held(&self, rank: u32, bytes: u64, blocked_seconds: f64, node_holds: u64);
    /// A part was not held: `busy`, `over_cap` or `invalid`.
    fn refused(&self, why: &'static str);
    /// The gang committed `step`; the node now holds `node_holds` bytes.
    fn committed(&self, step: u64, node_holds: u64);
    /// The attempt's agreement: the step its ranks restore, if any.
    fn settled(&self, restored: Option<u64>, node_holds: u64);
    /// This node's parts of `step` are held by its buddy; the copy took `seconds` (from the
    /// commit, or the agreement, to the buddy's answer).
    fn replicated(&self, step: u64, seconds: f64);
}

/// The snapshot service of one agent.
pub struct Snapshots {
    socket: String,
    every: u64,
}

/// The socket could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on the snapshot socket {address} (an abstract Unix socket): {source}")]
pub struct BindError {
    pub address: String,
    #[source]
    pub source: std::io::Error,
}

impl Snapshots {
    /// Starts the service when `--snapshot-every` asks for it.
    pub fn start(
        config: &Config,
        observer: Observer,
        meter: Option<Arc<dyn Meter>>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Snapshots>, BindError> {
        let Some(every) = config.snapshot_every else {
            return Ok(None);
        };
        let name = format!(
            "muster-snap-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let address = format!("@{name}");
        let listener = Listener::bind_abstract(&name).map_err(|source| BindError {
            address: address.clone(),
            source,
        })?;
        let cap = config.snapshot_memory.unwrap_or_else(default_cap);
        info!(
            "--snapshot-every {every}: each rank's state is held in this agent's memory every {every} steps, at most {} on this node (--snapshot-memory)",
            human_bytes(cap)
        );
        let (shared, completions) = Shared::new(Holder::new(cap), meter);
        let stop = shutdown.child_token();
        tokio::spawn(server::serve(listener, Arc::clone(&shared), stop.clone()));
        tokio::spawn(follow_attempts(
            shared,
            observer,
            completions,
            config.nproc_per_node,
            stop,
        ));
        Ok(Some(Snapshots {
            socket: address,
            every,
        }))
    }

    /// What the workers' environment gains.
    pub fn worker_env(&self) -> [(&'static str, String); 2] {
        [
            (SOCKET_ENV, self.socket.clone()),
            (EVERY_ENV, self.every.to_string()),
        ]
    }
}

/// Half of the pod's memory limit, else of the machine's memory.
fn default_cap() -> u64 {
    let limit = MemoryCgroup::find()
        .and_then(|cgroup| cgroup.limit())
        .or_else(machine_memory)
        .unwrap_or(u64::MAX);
    limit / DEFAULT_CAP_SHARE
}

fn machine_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// For each attempt, tells the holder whose ranks run here and runs the attempt's agreement and
/// commits; forwards the steps the server completes to the current attempt.
async fn follow_attempts(
    shared: Arc<Shared>,
    mut observer: Observer,
    mut completions: mpsc::UnboundedReceiver<Completed>,
    local_ranks: u32,
    stop: CancellationToken,
) {
    let mut current: Option<(u32, mpsc::UnboundedSender<Completed>, CancellationToken)> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            event = observer.events.recv() => match event {
                Ok(Event::AttemptStarted { assignment }) => {
                    if let Some((_, _, ended)) = current.take() {
                        ended.cancel();
                    }
                    shared.holder().begin_attempt(Share {
                        attempt: assignment.restart_count,
                        first_rank: assignment.base_global_rank,
                        local_ranks,
                        world_size: assignment.world_size,
                    });
                    let nnodes = assignment.group_world_size;
                    let store = assignment
                        .master_addr
                        .parse::<std::net::IpAddr>()
                        .ok()
                        .map(|ip| std::net::SocketAddr::from((ip, assignment.master_port)));
                    let attempt = commit::Attempt {
                        attempt: assignment.restart_count,
                        run_id: assignment.run_id.clone(),
                        node_rank: assignment.node_rank,
                        nnodes,
                        store,
                        service: stop.clone(),
                    };
                    let (forward, forwarded) = mpsc::unbounded_channel();
                    let ended = stop.child_token();
                    tokio::spawn(commit::run(Arc::clone(&shared), attempt, forwarded, ended.clone()));
                    current = Some((assignment.restart_count, forward, ended));
                }
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return,
            },
            Some(completed) = completions.recv() => {
                if let Some((attempt, forward, _)) = &current {
                    if completed.attempt == *attempt {
                        // The attempt's task may have ended with it; the next one starts anew.
                        let _ = forward.send(completed);
                    }
                }
            }
        }
    }
}
