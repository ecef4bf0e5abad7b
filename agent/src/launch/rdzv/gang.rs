//! Many nodes: plugs muster's gang rendezvous ([`rendezvous::rdzv`]) into the launch loop's
//! seam ([`super::Rendezvous`]).
//!
//! On the first round it works out who this node is (node rank from `--node-rank`, the Job
//! index or the host name's ordinal), resolves and reaches the endpoint ([`crate::discovery`]),
//! and — on node 0 — hosts the rendezvous store on the endpoint's port for the agent's life.
//! Per attempt node 0 also hosts a fresh workers' store whose address goes out with the round.
//! While workers run, a watcher heartbeats and watches the generation; when the gang must
//! re-form, the group is stopped and every node re-joins. After the group: success → exit
//! barrier; failure → bump the generation (a counted restart, or the fatal end everyone shares).
//!
//! When node 0, the store host, is lost, a survivor stops its workers like for any re-form,
//! forgets the old store and reaches the endpoint again (resolving its name anew) until the join
//! timeout, carrying what the gang's store held ([`rdzv::recovery`]); a replacement node 0
//! adopts it and the gang re-forms at the next generation. Only when no node 0 comes back in
//! time does the survivor exit 205.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use rendezvous::rdzv::recovery::{self, GangMemory, HostLossStats, HostWait};
use rendezvous::rdzv::{
    self, identity, BarrierOutcome, BumpKind, Event as WatchEvent, RdzvError, Registration, StoreKv,
};
use rendezvous::store::server::{self, ServerThread};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::discovery;
use crate::events::{Event, Events};
use crate::exit_code;
use crate::launch::gang_cause::{GangCause, PostedFailure};
use crate::launch::{
    AfterGroup, BoxFuture, Config, Failure, GangRestart, GroupOutcome, HostedStore, LaunchError,
    RankAssignment, Round, StopRequest,
};

struct Running {
    assignment: rdzv::Assignment,
    stop: CancellationToken,
    fired: CancellationToken,
    task: JoinHandle<WatchEvent>,
    /// Posts the attempt's first local failure to the failure board; ends with what it posted.
    poster: JoinHandle<Option<PostedFailure>>,
}

/// How long after a local rank's failure that reads like a lost peer (gloo's "Connection reset by
/// peer", a rank aborted or crashed: SIGABRT, SIGSEGV…) the node waits for the gang to re-form for a lost member
/// before it counts the failure as its own. A member whose agent died is lost
/// [`rdzv::decide::CLOSED_GRACE`] after its connection closed, and the survivors' ranks fail
/// within about a second of the death (gloo reads the dead peer's reset at once), so the loss
/// and its symptoms arrive within this window of each other: a failure followed by a loss within
/// it is the loss's consequence, and the re-form uses no restart. Also the delay a genuine
/// failure with such a message pays before its counted restart.
pub const CONSEQUENCE_WINDOW: Duration = Duration::from_secs(2);
/// How often a node in that window reads the generation: node 0's bump for a lost member is
/// seen within this, on every node (the watcher of a node other than 0 reads it only every
/// keep-alive interval).
const CONSEQUENCE_POLL: Duration = Duration::from_millis(50);

/// How long posting this node's failure to the board, or reading the board, may take: the
/// board explains a failure, it never holds up the gang's reaction to it.
const BOARD_TIMEOUT: Duration = Duration::from_secs(5);

/// [`super::Rendezvous`] for many nodes.
pub struct GangRendezvous {
    cfg: rdzv::Config,
    endpoint: discovery::Endpoint,
    local_addr: Option<String>,
    allow_loopback: bool,
    claimed_rank: Option<u32>,
    rank_source: identity::Source,
    /// `JOB_COMPLETION_INDEX` at or beyond `--nnodes MAX`: this pod is one of the gang's spares.
    spare_index: Option<u32>,
    local_world_size: u32,
    /// Set after the first round's discovery.
    rdzv: Option<rdzv::Rendezvous<StoreKv>>,
    advertised: Option<IpAddr>,
    /// Node 0's rendezvous store, kept for the agent's life (dropping it stops it).
    hosted: Option<ServerThread>,
    running: Option<Running>,
    /// The GPU pre-flight verdict to publish with the registration (opaque JSON).
    gpu_verdict: serde_json::Value,
    /// `--max-store-bytes`, for both stores this node may host.
    max_store_bytes: usize,
    /// `--network-check*`: the gang's network pre-flight after each round.
    network: crate::netcheck::Settings,
    /// Where discovery and the hosted store are reported.
    events: Events,
    /// Set while this survivor waits for a replacement store host.
    recovering: Option<Recovery>,
    /// What this node went through losing store hosts; read by metrics.
    host_loss: Arc<HostLossStats>,
    /// The gang's root cause of the last failed attempt (the failure board's verdict).
    cause: Option<GangCause>,
    /// Whether a lost store host can come back: not in a Slurm step, whose tasks Slurm never
    /// restarts, so a survivor waiting for one would only wait out the join timeout.
    host_replaceable: bool,
    /// Node 0's list of the spares, kept across the rendezvous values a lost store host
    /// replaces (metrics hold on to it).
    spare_hosts: rendezvous::rdzv::driver::SpareHosts,
    /// The endpoint resolves to loopback addresses only (the loopback elastic form).
    loopback_endpoint: bool,
    /// Set by the crash-loop guard: this node's failed attempt ends the job for everyone with
    /// this code and message instead of a counted restart.
    give_up: Option<(u8, String)>,
    /// The standby pool's module lists (warm spares, [`super::warm`]); `None` without standbys.
    warm: Option<crate::launch::warm_share::WarmShare>,
}

/// A survivor between the loss of the store host and its next round.
struct Recovery {
    lost_at: Instant,
    /// What it carries to the replacement (none when it never joined a round).
    memory: Option<GangMemory>,
}

impl GangRendezvous {
    /// Checks the configuration; nothing touches the network yet. `allow_loopback`: the local
    /// dry run may advertise 127.0.0.1.
    pub fn new(config: &Config, allow_loopback: bool) -> Result<Self, LaunchError> {
        let cfg_err = |e: &dyn std::fmt::Display| LaunchError::Config(e.to_string());
        let mut cfg = rdzv::Config::new(&config.run_id, config.nnodes.min, config.nnodes.max);
        cfg.max_restarts = config.max_restarts;
        cfg.node_unit = config.node_unit;
        if !config.scheduler.replaces_lost_nodes {
            // No replacement comes (a Slurm step never restarts a task): a gang below its
            // minimum ends now instead of waiting out the join timeout for one.
            cfg.unreplaceable_loss = Some(exit_code::RENDEZVOUS_TIMEOUT);
        }
        let conf: String = config
            .rdzv_conf
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        cfg.barrier_observe_delay = test_barrier_observe_delay();
        for (key, _) in cfg.apply_conf(&conf).map_err(|e| cfg_err(&e))? {
            // torchrun's c10d keys that have no meaning here are accepted quietly.
            if !matches!(
                key.as_str(),
                "is_host"
                    | "read_timeout"
                    | "store_type"
                    | "keep_alive_max_attempt"
                    | "cas_backoff_max_seconds"
                    | "use_libuv"
            ) {
                warn!("--rdzv-conf {key}: unknown key, ignored");
            }
        }
        let endpoint_text = config.rdzv_endpoint_text();
        let endpoint = discovery::parse_endpoint(&endpoint_text).map_err(|e| cfg_err(&e))?;
        let flag = config.node_rank_given.then(|| config.node_rank.to_string());
        let index = config.scheduler.node_index.clone();
        let (claimed_rank, rank_source) =
            identity::node_rank(flag.as_deref(), index.as_deref(), &crate::host::name())
                .map_err(|e| cfg_err(&e))?;
        let (claimed_rank, spare_index) = match claimed_rank {
            // An Indexed Job (or JobSet) with more completions than nodes: the pods beyond MAX
            // are the gang's spares, by design rather than by mistake.
            Some(index)
                if index >= config.nnodes.max
                    && rank_source == identity::Source::JobCompletionIndex =>
            {
                (None, Some(index))
            }
            Some(rank) if rank >= config.nnodes.max => {
                return Err(LaunchError::Config(format!(
                    "node rank {rank} (from {rank_source}) is outside --nnodes {}:{}",
                    config.nnodes.min, config.nnodes.max
                )));
            }
            claimed => (claimed, None),
        };
        Ok(Self {
            cfg,
            endpoint,
            local_addr: config.local_addr.clone(),
            allow_loopback,
            claimed_rank,
            rank_source,
            spare_index,
            local_world_size: config.nproc_per_node,
            rdzv: None,
            advertised: None,
            hosted: None,
            running: None,
            gpu_verdict: serde_json::Value::Null,
            max_store_bytes: config.max_store_bytes,
            network: config.network_check.clone(),
            events: Events::default(),
            recovering: None,
            host_loss: Arc::default(),
            cause: None,
            host_replaceable: config.scheduler.replaces_lost_nodes,
            spare_hosts: rendezvous::rdzv::driver::SpareHosts::default(),
            loopback_endpoint: false,
            give_up: None,
            warm: None,
        })
    }

    /// Reports DNS lookups, the hosted rendezvous store and the network check to `events`.
    #[must_use]
    pub fn with_events(mut self, events: Events) -> Self {
        self.events = events;
        self
    }

    /// Read-only: how often this node lost the store host, whether it waits for a replacement
    /// now, and how long it has been without a gang (sampled by metrics).
    pub fn host_loss(&self) -> Arc<HostLossStats> {
        Arc::clone(&self.host_loss)
    }

    /// Whether this node knows, before any lookup, that it hosts the rendezvous store (its rank
    /// is 0). A node that learns it from the endpoint's addresses needs DNS first, so it cannot
    /// wait for its own store before it is ready.
    pub fn hosts_store_first(&self) -> bool {
        self.claimed_rank == Some(0)
    }

    /// Publishes this node's GPU pre-flight verdict in its registration (every later round).
    pub fn set_gpu_verdict(&mut self, verdict: serde_json::Value) {
        if let Some(r) = self.rdzv.as_mut() {
            r.registration_mut().gpu = verdict.clone();
        }
        self.gpu_verdict = verdict;
    }

    /// Discovery, and on node 0 the rendezvous store, until `deadline`.
    async fn start(&mut self, deadline: Instant) -> Result<(), LaunchError> {
        let advertised =
            discovery::advertised_addr(self.local_addr.as_deref(), self.allow_loopback)
                .await
                .map_err(|e| LaunchError::Config(e.to_string()))?;
        // Resolved once and reused below; a node without a rank needs it to know if it hosts.
        let mut endpoint_ips = None;
        let is_host = if let Some(rank) = self.claimed_rank {
            rank == 0
        } else if self.spare_index.is_some() {
            // Index 0 hosts, even on one machine's loopback (the dry run's spares).
            false
        } else {
            let ips = discovery::resolve(&self.endpoint.host, deadline, &self.events)
                .await
                .map_err(LaunchError::DiscoveryTimeout)?;
            // The loopback elastic form (torchrun's `--rdzv-endpoint localhost:PORT` with several
            // agents on one machine and no node ranks): an endpoint on a local address, loopback
            // included, is hosted by the agent that binds its port first, the others join.
            let mine = discovery::interface_addrs();
            let hosts = ips.iter().any(|ip| ip.is_loopback() || mine.contains(ip));
            self.loopback_endpoint = !ips.is_empty() && ips.iter().all(IpAddr::is_loopback);
            endpoint_ips = Some(ips);
            hosts
        };
        if let Some(index) = self.spare_index {
            info!(
                "JOB_COMPLETION_INDEX {index} is beyond --nnodes {}: this pod is a spare; it takes a node rank when one is free (a lost member's, or the gang's first round missing a node) and otherwise waits, already through the GPU pre-flight",
                self.cfg.max_nodes
            );
        }
        info!(
            "node rank {} (from {}), advertising {advertised}; {} the rendezvous store at {}",
            self.claimed_rank
                .map_or_else(|| "?".to_owned(), |r| r.to_string()),
            if self.spare_index.is_some() {
                identity::Source::Arrival
            } else {
                self.rank_source
            },
            if is_host { "hosting" } else { "joining" },
            self.endpoint
        );
        let op_timeout = self.cfg.heartbeat_timeout;
        let hosted = if is_host {
            // Node 0's own store runs in this process: a slow answer there is this host's load
            // (2,048 agents on 2 CPUs), never a lost host, so its operations are bounded by the
            // round's own deadline instead of the heartbeat timeout.
            let own_timeout = self
                .cfg
                .join_timeout
                .max(self.cfg.heartbeat_timeout * rdzv::decide::STALL_FACTOR);
            match self.host_store(advertised, own_timeout).await {
                Ok(kv) => Some(kv),
                // Without a rank the host guess came from addresses; like torchrun, fall back
                // to being a client when another agent already holds the port.
                Err(e) if self.claimed_rank.is_none() => {
                    info!("not hosting the rendezvous store ({e}); joining it instead");
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        let is_host = hosted.is_some();
        let kv = if let Some(kv) = hosted {
            kv
        } else if self.recovering.is_some() {
            // The lost host's addresses are worthless: resolve again, and again.
            discovery::reach(&self.endpoint, deadline, op_timeout, &self.events)
                .await
                .map_err(LaunchError::DiscoveryTimeout)?
        } else {
            let ips = match endpoint_ips {
                Some(ips) => ips,
                None => discovery::resolve(&self.endpoint.host, deadline, &self.events)
                    .await
                    .map_err(LaunchError::DiscoveryTimeout)?,
            };
            discovery::connect(&self.endpoint, &ips, deadline, op_timeout)
                .await
                .map_err(LaunchError::DiscoveryTimeout)?
        };
        let mut kv = kv;
        record_fatal_gpu(&mut kv, &self.cfg.run_id, &self.gpu_verdict).await;
        let reg = Registration {
            agent_id: format!(
                "{}-{}-{:08x}",
                crate::host::name(),
                std::process::id(),
                rand::random::<u32>()
            ),
            node_rank: if is_host { Some(0) } else { self.claimed_rank },
            addr: advertised.to_string(),
            host: crate::host::name(),
            local_world_size: self.local_world_size,
            coordinator: is_host,
            gpu: self.gpu_verdict.clone(),
            memory: None,
            held: false,
            spare_index: self.spare_index,
        };
        self.advertised = Some(advertised);
        let mut rdzv = rdzv::Rendezvous::new(kv, self.cfg.clone(), reg)
            .with_spare_hosts(self.spare_hosts.clone());
        if let Some(memory) = self.recovering.as_ref().and_then(|r| r.memory.clone()) {
            rdzv.carry(memory);
        }
        self.rdzv = Some(rdzv);
        Ok(())
    }

    async fn round(&mut self) -> Result<Round, LaunchError> {
        loop {
            match self.try_round().await {
                Ok(Some(round)) => return Ok(round),
                // The network check sent some nodes away: the rest form a new round.
                Ok(None) => {}
                Err(RoundError::HostLost(why)) => self.host_lost(why)?,
                Err(RoundError::Launch(e)) => return Err(e),
            }
        }
    }

    /// The store host is lost: a survivor forgets the old store and waits for a replacement
    /// (the next round reaches the endpoint again); node 0, or a survivor past the join
    /// timeout since the loss, ends with 205.
    fn host_lost(&mut self, why: String) -> Result<(), LaunchError> {
        let gone = LaunchError::StoreHostLost;
        if self.hosted.is_some() {
            return Err(gone(why));
        }
        if !self.host_replaceable {
            self.host_loss.lost(Instant::now());
            self.host_loss.gave_up();
            return Err(gone(format!(
                "{why}; under Slurm a lost node 0 is not replaced within the step, so this node stops now"
            )));
        }
        let now = Instant::now();
        if let Some(r) = &self.recovering {
            // Lost again while coming back: the clock runs from the first loss.
            let (verdict, reason) =
                recovery::decide_host_wait(r.lost_at, now, &self.endpoint.to_string(), &self.cfg);
            if verdict == HostWait::GiveUp {
                self.host_loss.gave_up();
                return Err(gone(format!("{reason}; last: {why}")));
            }
            warn!("the store host answered and was lost again ({why}); still waiting");
        } else {
            let memory = self.rdzv.as_ref().and_then(|r| r.memory().cloned());
            // Come back as the same node (a rank given by arrival included): its rank is part
            // of what the gang remembers.
            if self.claimed_rank.is_none() {
                self.claimed_rank = self.rdzv.as_ref().and_then(rdzv::Rendezvous::node_rank);
            }
            warn!(
                "lost the store host (node 0) at {}: {why}; workers stopped; waiting up to {:.1}s for a replacement node 0 (generation {}, {} restart(s) used, carried)",
                self.endpoint,
                self.cfg.join_timeout.as_secs_f64(),
                memory.as_ref().map_or_else(|| "none".to_owned(), |m| m.generation.to_string()),
                memory.as_ref().map_or(0, |m| m.restarts)
            );
            self.host_loss.lost(now);
            self.recovering = Some(Recovery {
                lost_at: now,
                memory,
            });
        }
        self.rdzv = None;
        Ok(())
    }

    /// One rendezvous round and its network check: `None` when the check sent some nodes away
    /// and the others must form a new round.
    async fn try_round(&mut self) -> Result<Option<Round>, RoundError> {
        if self.rdzv.is_none() {
            self.start_or_give_up().await?;
        }
        let advertised = self
            .advertised
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        let Some(rdzv) = self.rdzv.as_mut() else {
            return Err(RoundError::Launch(LaunchError::Internal(
                "rendezvous not started",
            )));
        };
        let warm_key = rdzv::keys::Keys::new(&self.cfg.run_id).warm_modules();
        let op_timeout = self.cfg.heartbeat_timeout;
        let store_addr = rdzv.kv().addr();
        let spare_fetch = {
            let share = self.warm.clone();
            let spare = rdzv.waiting_as_spare();
            let key = warm_key.clone();
            let local_ranks = self.local_world_size;
            async move {
                match share {
                    Some(share) => {
                        super::warm::fetch_while_spare(
                            share,
                            spare,
                            store_addr,
                            op_timeout,
                            key,
                            local_ranks,
                        )
                        .await
                    }
                    None => std::future::pending::<std::convert::Infallible>().await,
                }
            }
        };
        let (store, a) = tokio::select! {
            joined = Self::join_round(rdzv, advertised, self.max_store_bytes) => joined?,
            never = spare_fetch => match never {},
        };
        Self::announce_round(&a, self.recovering.take(), &self.host_loss);
        let watch_kv = match rdzv.kv().reconnect().await {
            Ok(kv) => kv,
            Err(e) => {
                if let Some(s) = store {
                    s.shutdown().await;
                }
                return Err(RoundError::HostLost(e.to_string()));
            }
        };
        // The watcher, and with it this node's heartbeats, starts with the round, before the
        // network check: node 0 judges a member by its heartbeats from the moment the round
        // formed, and a member still in a check that runs long on a loaded node is late, not
        // lost (4,096 agents on 2 CPUs: 692 members were declared lost 19.5 s into a check they
        // had not finished, the heartbeats they would have sent not started yet).
        let stop = CancellationToken::new();
        let fired = CancellationToken::new();
        let mut watcher = rdzv.watcher(watch_kv, &a);
        // A bump (another node's failure, a lost member) reaches this node at once; without
        // this connection, at the next keep-alive tick.
        match rdzv.kv().reconnect().await {
            Ok(kv) => watcher = watcher.with_bump_wait(kv),
            Err(e) => debug!("no connection to wait for the generation's end on ({e}); ticks only"),
        }
        if let Some(hosted) = &self.hosted {
            // Node 0 hosts the store: a silent member whose connection is still open is late,
            // not lost; one whose connection closed is lost at once.
            watcher = watcher.with_presence(hosted.stats());
        }
        let task = tokio::spawn(watcher.run(stop.clone(), fired.clone()));
        let check = Self::check_info(&self.cfg, &self.network, &a, advertised);
        // The check talks to the store on the rendezvous connection, idle until the exit barrier.
        let go = network_check(&check, rdzv.kv_mut(), &self.events).await;
        if !matches!(go, Ok(true)) {
            stop.cancel();
            let _ = task.await;
            if let Some(s) = store {
                s.shutdown().await;
            }
            return go.map(|_| None).map_err(RoundError::from);
        }
        let assignment = RankAssignment {
            node_rank: a.group_rank,
            group_world_size: a.group_world_size,
            base_global_rank: a.base_global_rank,
            world_size: a.world_size,
            master_addr: a.master_addr.clone(),
            master_port: a.master_port,
            restart_count: a.restart_count,
            run_id: self.cfg.run_id.clone(),
        };
        if let Some(share) = self
            .warm
            .clone()
            .filter(|_| a.group_rank < super::warm::PUBLISHERS)
        {
            let publish = super::warm::publish(share, store_addr, op_timeout, warm_key);
            let until = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = publish => {}
                    () = until.cancelled() => {}
                }
            });
        }
        let (failure_post, failure) = tokio::sync::oneshot::channel();
        let poster = tokio::spawn(post_failure(
            failure,
            rdzv.failure_board(a.generation),
            rdzv.kv().addr(),
            a.node_rank,
        ));
        self.running = Some(Running {
            assignment: a,
            stop,
            fired,
            task,
            poster,
        });
        Ok(Some(Round {
            assignment,
            store,
            failure_post: Some(failure_post),
        }))
    }

    /// Starts the rendezvous for a round, by the join deadline (the first loss's, while coming
    /// back from a lost store host); a survivor that cannot reach a replacement gives up with 205.
    async fn start_or_give_up(&mut self) -> Result<(), RoundError> {
        let deadline = match &self.recovering {
            Some(r) => r.lost_at + self.cfg.join_timeout,
            None => Instant::now() + self.cfg.join_timeout,
        };
        let Err(e) = self.start(deadline).await else {
            return Ok(());
        };
        if let Some(r) = &self.recovering {
            let (_, reason) = recovery::decide_host_wait(
                r.lost_at,
                Instant::now(),
                &self.endpoint.to_string(),
                &self.cfg,
            );
            self.host_loss.gave_up();
            return Err(RoundError::Launch(LaunchError::StoreHostLost(format!(
                "{reason}; last: {e}"
            ))));
        }
        Err(RoundError::Launch(e))
    }

    /// Joins the next round: on the coordinator, with the workers' store started first (its
    /// port goes into the round), and shut down again when the round is not had.
    async fn join_round(
        rdzv: &mut rdzv::Rendezvous<StoreKv>,
        advertised: IpAddr,
        max_store_bytes: usize,
    ) -> Result<(Option<HostedStore>, rdzv::Assignment), RoundError> {
        let store = if rdzv.is_coordinator() {
            Some(
                HostedStore::start(advertised, max_store_bytes)
                    .await
                    .map_err(|source| LaunchError::Store {
                        ip: advertised,
                        source,
                    })?,
            )
        } else {
            None
        };
        let port = store.as_ref().map_or(0, |s| s.addr().port());
        match rdzv.next_round(port).await {
            Ok(joined) => Ok((store, joined.assignment)),
            Err(e) => {
                if let Some(s) = store {
                    s.shutdown().await;
                }
                Err(match e {
                    RdzvError::StoreLost(why) => RoundError::HostLost(why),
                    e => RoundError::Launch(LaunchError::Rendezvous(e)),
                })
            }
        }
    }

    /// Logs the round this node joined, and its return to the gang when it comes back from a
    /// lost store host (`recovering`).
    fn announce_round(
        a: &rdzv::Assignment,
        recovering: Option<Recovery>,
        host_loss: &HostLossStats,
    ) {
        if let Some(r) = recovering {
            let without = r.lost_at.elapsed();
            info!(
                "rejoined the gang at generation {} after {:.1}s without a gang (restarts used {})",
                a.generation,
                without.as_secs_f64(),
                a.restart_count
            );
            host_loss.rejoined(without);
        }
        info!(
            "round {}: node {} is group rank {} of {}, global {} of {} (restarts used {})",
            a.generation,
            a.node_rank,
            a.group_rank,
            a.group_world_size,
            rank_range(a.base_global_rank, a.local_world_size),
            a.world_size,
            a.restart_count
        );
    }

    /// What the network check of round `a` needs to know of the round and of this node.
    fn check_info(
        cfg: &rdzv::Config,
        network: &crate::netcheck::Settings,
        a: &rdzv::Assignment,
        advertised: IpAddr,
    ) -> crate::netcheck::gang::RoundInfo {
        crate::netcheck::gang::RoundInfo {
            run_id: cfg.run_id.clone(),
            generation: a.generation,
            me: crate::netcheck::verdict::NodeInfo {
                group_rank: a.group_rank,
                node_rank: a.node_rank,
                host: crate::host::name(),
                addr: advertised.to_string(),
            },
            ip: advertised,
            world: a.group_world_size,
            min_nodes: cfg.min_nodes,
            max_nodes: cfg.max_nodes,
            settings: network.clone(),
        }
    }

    async fn after(
        &mut self,
        outcome: &GroupOutcome,
        stop: &StopRequest,
    ) -> Result<AfterGroup, LaunchError> {
        self.cause = None;
        // Only for this attempt's own failure; any other way out forgets it.
        let give_up = self.give_up.take();
        let Some(running) = self.running.take() else {
            return Ok(AfterGroup::Finish(outcome.exit_code()));
        };
        let Some(rdzv) = self.rdzv.as_mut() else {
            return Ok(AfterGroup::Finish(outcome.exit_code()));
        };
        if stop.is_requested() && !running.fired.is_cancelled() {
            running.stop.cancel();
            let _ = running.task.await;
            return Ok(AfterGroup::Finish(outcome.exit_code()));
        }
        if !running.fired.is_cancelled() {
            match outcome {
                GroupOutcome::Succeeded => {
                    let barrier = match rdzv.exit_barrier(&running.assignment, &running.fired).await
                    {
                        Ok(b) => b,
                        Err(RdzvError::StoreLost(why)) => {
                            // Not every node reported before the host went: the generation did
                            // not complete, so the gang re-forms (as for a node lost then).
                            running.stop.cancel();
                            let _ = running.task.await;
                            self.host_lost(why)?;
                            return Ok(AfterGroup::Restart(GangRestart::Membership));
                        }
                        Err(e) => return Err(LaunchError::Rendezvous(e)),
                    };
                    if barrier != BarrierOutcome::Interrupted {
                        running.stop.cancel();
                        let _ = running.task.await;
                        info!("every node finished");
                        return Ok(AfterGroup::Finish(exit_code::SUCCESS));
                    }
                }
                GroupOutcome::Failed(f) => {
                    if let Some(rec) = loss_followed(rdzv, f, running.assignment.node_rank).await {
                        warn!(
                            "rank {} (local rank {}) failed ({}) as the gang lost a member: {}; a consequence of the loss, no restart used (generation {}, restarts used {})",
                            f.rank, f.local_rank, f.status, rec.reason, rec.gen, rec.restarts
                        );
                        running.stop.cancel();
                        let _ = running.task.await;
                        return Ok(AfterGroup::Restart(GangRestart::Membership));
                    }
                    running.stop.cancel();
                    let _ = running.task.await;
                    // Posted before the generation moves: whoever sees the bump finds it.
                    let own = posted(running.poster).await;
                    let code = f.exit_code();
                    let what = match &f.hang {
                        Some(hang) => format!("cause hang: {}", hang.describe()),
                        None => format!(
                            "rank {} (local rank {}) failed: {}",
                            f.rank, f.local_rank, f.status
                        ),
                    };
                    let report = match give_up {
                        Some((code, why)) => rdzv.report_give_up(code, &why).await,
                        None => rdzv.report_failure(code, &what).await,
                    };
                    let rec = match report {
                        Ok(rec) => rec,
                        // Most likely the failure *is* the loss: node 0's ranks died with it.
                        Err(RdzvError::StoreLost(why)) => {
                            self.host_lost(format!("{why} (reporting: {what})"))?;
                            return Ok(AfterGroup::Restart(GangRestart::Membership));
                        }
                        Err(e) => return Err(LaunchError::Rendezvous(e)),
                    };
                    self.cause = read_cause(rdzv, &running.assignment, own.as_ref()).await;
                    if rec.kind == BumpKind::Fatal {
                        rdzv.leave_after_fatal(&running.assignment).await;
                        return Ok(AfterGroup::Finish(rec.exit_code.unwrap_or(code)));
                    }
                    return Ok(AfterGroup::Restart(GangRestart::of(rec.kind)));
                }
                GroupOutcome::Stopped { .. } => {
                    running.stop.cancel();
                    let _ = running.task.await;
                    return Ok(AfterGroup::Finish(outcome.exit_code()));
                }
            }
        }
        // The gang re-forms: see why.
        match running.task.await {
            Ok(WatchEvent::Generation(rec)) if rec.kind == BumpKind::Fatal => {
                warn!("the job failed on another node: {}", rec.reason);
                let own = posted(running.poster).await;
                self.cause = read_cause(rdzv, &running.assignment, own.as_ref()).await;
                rdzv.leave_after_fatal(&running.assignment).await;
                Ok(AfterGroup::Finish(rec.exit_code.unwrap_or(1)))
            }
            Ok(WatchEvent::Generation(rec)) => {
                warn!("the gang re-forms (generation {}): {}", rec.gen, rec.reason);
                if rec.kind == BumpKind::Failure {
                    let own = posted(running.poster).await;
                    self.cause = read_cause(rdzv, &running.assignment, own.as_ref()).await;
                }
                Ok(AfterGroup::Restart(GangRestart::of(rec.kind)))
            }
            // The gang is stopping (a preemption shared through the store): node 0 ending with
            // it is part of the stop, not a loss to wait out, and the outcome stays this node's.
            Ok(WatchEvent::StoreLost(_)) if stop.is_requested() => {
                Ok(AfterGroup::Finish(outcome.exit_code()))
            }
            Ok(WatchEvent::StoreLost(why)) => {
                self.host_lost(why)?;
                Ok(AfterGroup::Restart(GangRestart::Membership))
            }
            Ok(WatchEvent::Stopped | WatchEvent::Completed) | Err(_) => {
                Ok(AfterGroup::Finish(outcome.exit_code()))
            }
        }
    }
}

/// After `failure` here: the generation record when, within [`CONSEQUENCE_WINDOW`], the gang
/// re-forms for a membership change (a lost member) — the failure is then its consequence;
/// `None` at once for a failure that does not read like a lost peer, and when the window passes
/// or the generation moved on for another reason (another node's failure: counted as usual).
async fn loss_followed(
    rdzv: &mut rdzv::Rendezvous<StoreKv>,
    failure: &Failure,
    node_rank: u32,
) -> Option<rdzv::GenRecord> {
    let symptom = PostedFailure::from_failure(failure, node_rank).looks_like_consequence()
        || matches!(failure.status, crate::launch::ExitStatus::Signaled(s) if !sent_from_outside(s));
    if !symptom {
        return None;
    }
    let deadline = Instant::now() + CONSEQUENCE_WINDOW;
    loop {
        match rdzv.moved_on().await {
            Ok(Some(rec)) if rec.kind == BumpKind::Membership => return Some(rec),
            Ok(Some(_)) | Err(_) => return None,
            Ok(None) => {}
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(CONSEQUENCE_POLL).await;
    }
}

/// Signals that reach a rank from outside it — the kernel's OOM killer, an operator, a chaos
/// tool — never from a peer's loss: a lost peer makes a rank fail on its own (an error, an
/// abort, a crash). Such a death is this node's failure at once, without the consequence
/// window's wait (issue #41: 2 s of every killed rank's restart).
fn sent_from_outside(signal: nix::sys::signal::Signal) -> bool {
    use nix::sys::signal::Signal;
    matches!(
        signal,
        Signal::SIGKILL | Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP
    )
}

/// A fixed-size gang's node whose GPU pre-flight failed joins only to end the job (its
/// registration carries the fatal verdict): it records itself as a bad node first, so a later
/// pod of the job on the same Kubernetes node fails fast ([`crate::launch::bad_nodes`]).
async fn record_fatal_gpu(kv: &mut StoreKv, run_id: &str, verdict: &serde_json::Value) {
    let (Some(node), Some(fatal)) = (crate::launch::bad_nodes::node_name(), verdict.get("fatal"))
    else {
        return;
    };
    let code = fatal
        .get("exit_code")
        .and_then(serde_json::Value::as_u64)
        .and_then(|c| u8::try_from(c).ok())
        .unwrap_or(exit_code::UNHEALTHY_GPU);
    let message = fatal
        .get("message")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("GPU pre-flight failed");
    let finding = crate::launch::bad_nodes::Finding::new(code, message);
    if let Err(e) = crate::launch::bad_nodes::record(kv, run_id, &node, &finding).await {
        warn!("could not record node {node} as bad in the gang's store: {e}");
    }
}

/// Posts this node's first failure of the round, if the attempt has one, to the round's board;
/// returns what it posted (also when the post itself failed: the node still knows its own).
async fn post_failure(
    failure: tokio::sync::oneshot::Receiver<Failure>,
    board: rdzv::Board,
    store: SocketAddr,
    node_rank: u32,
) -> Option<PostedFailure> {
    let failure = failure.await.ok()?;
    let record = PostedFailure::from_failure(&failure, node_rank);
    let post = async {
        let mut kv = StoreKv::connect(store, BOARD_TIMEOUT, BOARD_TIMEOUT)
            .await
            .map_err(|e| e.to_string())?;
        let json = serde_json::to_vec(&record).map_err(|e| e.to_string())?;
        board.post(&mut kv, &json).await.map_err(|e| e.to_string())
    };
    match tokio::time::timeout(BOARD_TIMEOUT * 2, post).await {
        Ok(Ok(ticket)) => tracing::debug!("failure posted to the gang's board as #{ticket}"),
        Ok(Err(e)) => warn!("could not post this node's failure to the gang's board: {e}"),
        Err(_) => warn!("could not post this node's failure to the gang's board: no answer"),
    }
    Some(record)
}

/// What the round's poster posted (waiting for it to finish its post, within its bound).
async fn posted(poster: JoinHandle<Option<PostedFailure>>) -> Option<PostedFailure> {
    poster.await.ok().flatten()
}

/// Reads the round's failure board and names the gang's root cause (logged on every node);
/// `None` when the board cannot be read — then the node's own view is all there is.
async fn read_cause(
    rdzv: &mut rdzv::Rendezvous<StoreKv>,
    a: &rdzv::Assignment,
    own: Option<&PostedFailure>,
) -> Option<GangCause> {
    let board = rdzv.failure_board(a.generation);
    let records = match tokio::time::timeout(BOARD_TIMEOUT, board.read(rdzv.kv_mut())).await {
        Ok(Ok(records)) => records,
        Ok(Err(e)) => {
            warn!("could not read the gang's failure board: {e}");
            return None;
        }
        Err(_) => {
            warn!("could not read the gang's failure board: no answer");
            return None;
        }
    };
    let cause = GangCause::pick(&records, own, a.node_rank)?;
    warn!("{}", cause.log_line(a.restart_count));
    Some(cause)
}

impl GangRendezvous {
    /// Binds the rendezvous store on the endpoint's port (all interfaces, or loopback in the
    /// dry run) and connects to it.
    async fn host_store(
        &mut self,
        advertised: IpAddr,
        op_timeout: Duration,
    ) -> Result<StoreKv, LaunchError> {
        // An endpoint that only names loopback is reachable only from this machine: the store
        // listens there alone, not on the pod network.
        let bind_ip = if advertised.is_loopback() {
            advertised
        } else if self.loopback_endpoint {
            IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
        } else if advertised.is_ipv6() {
            IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
        } else {
            IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
        };
        let addr = SocketAddr::new(bind_ip, self.endpoint.port);
        let config = server::Config {
            // A member whose host vanished without closing its connection shows as closed
            // after about three keep-alive intervals (the idle time, then two probes).
            tcp_keepalive: Some(self.cfg.keep_alive_interval),
            max_store_bytes: self.max_store_bytes,
            ..server::Config::default()
        };
        let server = ServerThread::start(addr, config).await.map_err(|e| {
            LaunchError::Config(format!("cannot host the rendezvous store on {addr}: {e}"))
        })?;
        let local = server.local_addr();
        self.events.publish(Event::RendezvousStoreHosted {
            stats: server.stats(),
        });
        self.hosted = Some(server);
        let ip = if local.ip().is_unspecified() {
            advertised
        } else {
            local.ip()
        };
        let kv = StoreKv::connect(
            SocketAddr::new(ip, local.port()),
            Duration::from_secs(5),
            op_timeout,
        )
        .await
        .map_err(|e| LaunchError::Config(format!("own rendezvous store: {e}")))?;
        self.events.publish(Event::RendezvousStoreAccepting);
        Ok(kv)
    }
}

impl Drop for GangRendezvous {
    fn drop(&mut self) {
        if let Some(r) = &self.running {
            r.stop.cancel();
        }
    }
}

impl super::Rendezvous for GangRendezvous {
    fn next_round<'a>(
        &'a mut self,
        _config: &'a Config,
        _restart_count: u32,
        _stop: &'a StopRequest,
    ) -> BoxFuture<'a, Result<Round, LaunchError>> {
        Box::pin(self.round())
    }

    fn watch(&mut self) -> BoxFuture<'_, ()> {
        let fired = self.running.as_ref().map(|r| r.fired.clone());
        Box::pin(async move {
            match fired {
                Some(f) => f.cancelled().await,
                None => std::future::pending().await,
            }
        })
    }

    fn after_group<'a>(
        &'a mut self,
        outcome: &'a GroupOutcome,
        stop: &'a StopRequest,
    ) -> BoxFuture<'a, Result<Option<AfterGroup>, LaunchError>> {
        Box::pin(async move { self.after(outcome, stop).await.map(Some) })
    }

    fn gang_cause(&self) -> Option<GangCause> {
        self.cause.clone()
    }

    fn spare_hosts(&self) -> Option<rendezvous::rdzv::driver::SpareHosts> {
        Some(self.spare_hosts.clone())
    }

    fn share_warm_modules(&mut self, share: crate::launch::warm_share::WarmShare) {
        self.warm = Some(share);
    }

    fn end_on_failure(&mut self, exit_code: u8, why: String) -> bool {
        self.give_up = Some((exit_code, why));
        true
    }
}

/// Why a round could not be had.
enum RoundError {
    /// The store host went while joining: a survivor waits for a replacement.
    HostLost(String),
    Launch(LaunchError),
}

impl From<LaunchError> for RoundError {
    fn from(e: LaunchError) -> Self {
        RoundError::Launch(e)
    }
}

/// Runs the network check of one round ([`crate::netcheck`]) and acts on node 0's verdict:
/// `Ok(true)` to start the workers, `Ok(false)` to form a new round without the nodes it sent
/// away, `Err` with exit 208 when it ends the round for this node. What this node measured and
/// the verdict go to `events` either way.
async fn network_check(
    round: &crate::netcheck::gang::RoundInfo,
    kv: &mut rendezvous::rdzv::StoreKv,
    events: &Events,
) -> Result<bool, LaunchError> {
    use crate::events::NetworkCheckResult;
    use crate::netcheck::{gang, summary::Summary, verdict::Action, Mode};
    if round.settings.mode == Mode::Off || round.world < 2 {
        return Ok(true);
    }
    let started = Instant::now();
    let outcome = gang::run(kv, round)
        .await
        .map_err(LaunchError::NetworkCheck)?;
    let report = match outcome {
        gang::Outcome::NoVerdict(why) => {
            events.publish(Event::NetworkChecked {
                result: NetworkCheckResult::NoVerdict,
                elapsed: started.elapsed(),
            });
            warn!("network check: {why}; starting the workers without a verdict");
            return Ok(true);
        }
        gang::Outcome::Report(report) => report,
    };
    if round.me.group_rank == 0 {
        info!(
            "network check took {} ms: {}\n{}",
            report.millis,
            report.verdict.reason,
            report.table(&round.settings.thresholds).trim_end()
        );
    } else if !report.verdict.inconclusive {
        info!("network check: {}", report.verdict.reason);
    }
    if report.verdict.inconclusive {
        warn!("network check: {}", report.verdict.reason);
    }
    for finding in &report.verdict.findings {
        warn!("network check: {}", finding.message(&report.nodes));
    }
    let unlisted = (report.counts.total() as usize).saturating_sub(report.verdict.findings.len());
    if unlisted > 0 {
        warn!("network check: and {unlisted} more finding(s) about other nodes (node 0's log lists them all)");
    }
    events.publish(Event::NetworkChecked {
        result: NetworkCheckResult::Judged(std::sync::Arc::new(Summary::of(
            &report,
            round.me.group_rank,
            &round.settings.thresholds,
        ))),
        elapsed: started.elapsed(),
    });
    match report.action {
        Action::Proceed => Ok(true),
        Action::End { message } => Err(LaunchError::NetworkCheckFailed(message)),
        Action::Leave { ranks, message } if ranks.contains(&round.me.group_rank) => {
            if let Some(node) = crate::launch::bad_nodes::node_name() {
                let finding = crate::launch::bad_nodes::Finding::new(
                    crate::exit_code::NETWORK_CHECK_FAILED,
                    &message,
                );
                if let Err(e) =
                    crate::launch::bad_nodes::record(kv, &round.run_id, &node, &finding).await
                {
                    warn!("could not record node {node} as bad in the gang's store: {e}");
                }
            }
            Err(LaunchError::NetworkCheckFailed(format!(
                "{message}; this node leaves the job"
            )))
        }
        Action::Leave { message, .. } => {
            warn!("{message}; forming a new round without the named node(s)");
            Ok(false)
        }
    }
}

/// Test hook, not a user setting: `MUSTER_TEST_BARRIER_OBSERVE_DELAY=<seconds>` makes this
/// agent look for the exit barrier's completion that long after its own report, standing in for
/// a node that is slow to observe it (docs/multinode.md § Test hooks). Unset, empty or not a
/// non-negative number: no delay.
fn test_barrier_observe_delay() -> Duration {
    std::env::var("MUSTER_TEST_BARRIER_OBSERVE_DELAY")
        .ok()
        .and_then(|v| rendezvous::seconds::parse(&v).ok())
        .unwrap_or(Duration::ZERO)
}

/// `count` global ranks from `first`, read as written: `rank 4`, `ranks 4, 5`, `ranks 4–7`
/// (inclusive; a Rust range `4..8` read as five ranks to users).
pub fn rank_range(first: u32, count: u32) -> String {
    match count {
        0 => "ranks: none".to_owned(),
        1 => format!("rank {first}"),
        2 => format!("ranks {first}, {}", first + 1),
        n => format!("ranks {first}–{}", first + n - 1),
    }
}

#[cfg(test)]
mod tests {
    use super::rank_range;

    #[test]
    fn rank_ranges_are_inclusive() {
        assert_eq!(rank_range(0, 2), "ranks 0, 1");
        assert_eq!(rank_range(4, 1), "rank 4");
        assert_eq!(rank_range(4, 4), "ranks 4–7");
        assert_eq!(rank_range(0, 0), "ranks: none");
    }
}
