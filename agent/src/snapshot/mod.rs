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
//! - [`persist`] and [`disk`]: `--snapshot-persist DIR`, each committed step written to storage
//!   in the background, read back by a job started again after every pod was lost.
//!
//! The Python side is `python/muster_launcher/snapshot.py`.

pub mod commit;
pub mod disk;
pub mod holder;
pub mod packet;
pub mod persist;
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
    /// This node's parts of `step` are whole on the disk (`--snapshot-persist`); the write
    /// took `seconds`.
    fn persisted(&self, step: u64, seconds: f64);
}

/// The snapshot service of one agent.
pub struct Snapshots {
    socket: String,
    every: u64,
    shared: Arc<Shared>,
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on the snapshot socket {address} (an abstract Unix socket): {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("--snapshot-persist: {0}")]
    Persist(#[from] disk::PersistError),
}

impl Snapshots {
    /// Starts the service when `--snapshot-every` asks for it.
    pub fn start(
        config: &Config,
        observer: Observer,
        meter: Option<Arc<dyn Meter>>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Snapshots>, StartError> {
        let Some(every) = config.snapshot_every else {
            return Ok(None);
        };
        let name = format!(
            "muster-snap-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let address = format!("@{name}");
        let disk = config
            .snapshot_persist
            .as_deref()
            .map(|dir| disk::Disk::open(dir, config.snapshot_persist_every.unwrap_or(every)))
            .transpose()?;
        let listener = Listener::bind_abstract(&name).map_err(|source| StartError::Bind {
            address: address.clone(),
            source,
        })?;
        let cap = config.snapshot_memory.unwrap_or_else(default_cap);
        info!(
            "--snapshot-every {every}: each rank's state is held in this agent's memory every {every} steps, at most {} on this node (--snapshot-memory)",
            human_bytes(cap)
        );
        if let Some(disk) = &disk {
            info!(
                "--snapshot-persist: each committed snapshot of this node's ranks is written under {} in the background",
                disk.dir().display()
            );
        }
        let (shared, completions) = Shared::new(Holder::new(cap), meter, disk.clone());
        let stop = shutdown.child_token();
        if let Some(disk) = disk {
            tokio::spawn(persist::write_committed(
                Arc::clone(&shared),
                disk,
                stop.clone(),
            ));
        }
        tokio::spawn(server::serve(listener, Arc::clone(&shared), stop.clone()));
        tokio::spawn(follow_attempts(
            Arc::clone(&shared),
            observer,
            completions,
            config.nproc_per_node,
            stop,
        ));
        Ok(Some(Snapshots {
            socket: address,
            every,
            shared,
        }))
    }

    /// Waits, at most `within`, until the newest committed step is whole on the disk
    /// (`--snapshot-persist`): what a preemption does before the agent exits, so that the next
    /// job resumes from it. The step on the disk then, if any.
    pub async fn flush(&self, within: std::time::Duration) -> Option<u64> {
        self.shared.disk.as_ref()?;
        let (committed, attempt) = {
            let holder = self.shared.holder();
            (holder.committed(), holder.attempt())
        };
        let mut persisted = self.shared.persisted.subscribe();
        // The newest committed step, due by --snapshot-persist-every or not: it is the one the
        // next job resumes from.
        if let (Some(step), Some(attempt)) = (committed, attempt) {
            if persisted.borrow().is_none_or(|p| p < step) {
                persist::committed(&self.shared, attempt, step, true);
            }
        }
        let caught_up = |p: &Option<u64>| committed.is_none_or(|c| p.is_some_and(|p| p >= c));
        let _ = tokio::time::timeout(within, persisted.wait_for(caught_up)).await;
        let on_disk = *persisted.borrow();
        on_disk
    }

    /// The newest step the gang committed (or this attempt restored).
    pub fn committed(&self) -> Option<u64> {
        self.shared.holder().committed()
    }

    /// Whether committed steps are written to storage.
    pub fn persists(&self) -> bool {
        self.shared.disk.is_some()
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
