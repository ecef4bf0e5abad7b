//! The composition root of a launch: the one place that builds the parts of `muster [OPTIONS]
//! script.py` and plugs them into each other — the console writer and diagnostics, the metrics
//! endpoint and its observer, the GPU pre-flight, the gang rendezvous, the checkpoint barrier,
//! the workers' environment — then runs the launch loop ([`crate::launch`]) to its end.
//!
//! Nothing below this module knows about the others' consumers: the parts publish typed events
//! ([`crate::events`], [`crate::launch::observe`]) and expose read-only state, and this is where
//! the metrics are attached to them. Every error leaves through `?` with its type; the one
//! mapping to an exit code is [`crate::cmd`]'s.

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::{self, controller::Preemption};
use crate::events::{Event, Events, PreflightResult};
use crate::exit_code::Exit;
use crate::gpu::gate::{self, GpuCheck};
use crate::launch::config::Config;
use crate::launch::rdzv::{self, GangRendezvous, Rendezvous};
use crate::launch::Launch;
use crate::logs;
use crate::metrics::{self, Metrics, Readiness};

/// What the agent shows of its own diagnostics unless `MUSTER_LOG` says otherwise: the workers'
/// store logs every start and stop at info, which is noise in a launch.
pub const LAUNCH_LOG_FILTER: &str = "info,rendezvous=warn,py_spy=warn,remoteprocess=warn";

/// Runs one launch on the agent's runtime; the exit code of the job, or the error that stopped
/// the agent.
pub async fn launch(config: Config) -> anyhow::Result<u8> {
    // Dropped on every way out, which writes what is still queued.
    let writer = start_diagnostics(&config)?;
    let shutdown = CancellationToken::new();
    let metrics = Metrics::new();
    metrics.attach_worker_output(writer.sink().stats());
    // Read once, at start: a Secret that cannot be read is a configuration error, not a job
    // that silently refuses its controller later.
    let checkpoint_token = match config.checkpoint_token_file.as_deref() {
        None => None,
        Some(path) => Some(
            metrics::CheckpointToken::from_file(path).map_err(|e| Exit::config(e.to_string()))?,
        ),
    };
    let checkpoint_requests = checkpoint::requests::RequestSlot::default();
    let endpoint_config = metrics::EndpointConfig {
        checkpoint_token,
        checkpoint_requests: checkpoint_requests.clone(),
        ..metrics::EndpointConfig::default()
    };
    let endpoint =
        metrics::agent::start_endpoint(config.metrics_addr, &metrics, endpoint_config, &shutdown)
            .map_err(|e| Exit::config(e.to_string()))?;
    let (events, parts) = Events::channel();
    let mut launch = Launch::new(config).with_log_sink(writer.sink());
    metrics::agent::observe_launch(&launch, &metrics, &endpoint, parts, &shutdown);

    let multi_node = rdzv::is_multi_node(launch.config());
    // A node this job already found bad fails fast with that finding, before any check runs.
    if multi_node {
        if let Some((node, finding)) = crate::launch::bad_nodes::probe(launch.config()).await {
            return Err(Exit::new(finding.exit_code, finding.refusal(&node)).into());
        }
    }
    let gpu_check = launch.config().gpu_check;
    // In a fixed-size gang an unhealthy node joins anyway, flagged, so that node 0 ends the job
    // for everyone at once (204, naming it); with spare capacity (MIN < MAX) it leaves instead.
    let fixed_gang = multi_node && launch.config().nnodes.min == launch.config().nnodes.max;
    let (gpu, gpu_fatal) = preflight(gpu_check, fixed_gang, &events).await?;

    // Node 0 is ready once its rendezvous store accepts connections (the gang rendezvous says
    // so through its events); every other agent once its setup below is done. Never later: see
    // `metrics::Readiness`.
    let (gang, hosts_rendezvous) = if multi_node {
        let (gang, hosts_rendezvous) =
            gang_rendezvous(launch.config(), gpu.as_ref(), gpu_fatal, &events, &metrics)?;
        (Some(gang), hosts_rendezvous)
    } else {
        (None, false)
    };
    launch = order_and_pin_gpus(launch, gpu_check)?;
    let (launch, preemption) = plug_in_barrier(launch, &shutdown, &events)?;
    let (mut launch, hang_watch) = watch_hangs(launch, &preemption, &metrics);
    launch = hold_foreign_signals(launch, &preemption);
    launch = give_workers_a_tmpdir(launch, &preemption);
    let (held, snapshots) = hold_snapshots(launch, &metrics, &shutdown)?;
    launch = held;
    let python_path = helper_python_path(&launch, &preemption);
    // The helper's directory holds muster's `sitecustomize` (the zero-code step reports, and the
    // script metrics' hook, which patches nothing without MUSTER_METRICS_PORT).
    let script_metrics = metrics::script::attach(
        endpoint.local_addr(),
        &metrics,
        preemption.writable_base(),
        preemption
            .helper_dir()
            .zip(preemption.python_entry())
            .map(|(dir, python_entry)| metrics::script::Hook { dir, python_entry }),
    );
    if let Some(script) = &script_metrics {
        let inherited = python_path
            .or_else(|| std::env::var_os("PYTHONPATH"))
            .unwrap_or_default();
        launch = script.plug_into(launch, &inherited);
    } else if let Some(path) = python_path {
        launch = launch.with_worker_env("PYTHONPATH", path);
    }
    let (launch, gpu_watch) = start_gpu_watch(launch, &metrics);
    let launch = watch_stragglers(
        launch,
        hang_watch,
        &preemption,
        gpu_watch.as_ref(),
        &metrics,
    );
    let launch = metrics::agent::meter_rendezvous(launch, gang, &metrics);
    metrics.advance_readiness(if hosts_rendezvous {
        Readiness::HostingStore
    } else {
        Readiness::Ready
    });
    let run = launch.run(shutdown.clone());
    let result = checkpoint::requests::serve(&checkpoint_requests, run, |reason| {
        preemption.trigger(reason)
    })
    .await;
    if let (Some(snapshots), Ok(outcome)) = (&snapshots, &result) {
        persist_before_exit(snapshots, &preemption, outcome.exit_code).await;
    }
    drop(endpoint);
    if let Some(watch) = &gpu_watch {
        watch.stop();
    }
    if let Some(script) = &script_metrics {
        script.remove_files();
    }
    Ok(preemption.exit_code(result?.exit_code))
}

/// Starts the console writer and the agent's own diagnostics through it, and says what the
/// configuration warned about and how the scheduler was read.
fn start_diagnostics(config: &Config) -> anyhow::Result<logs::LogWriter> {
    let writer = logs::start().context("cannot start the log writer")?;
    logs::init_tracing(
        config.logs.format,
        logs::Diagnostics::Console(writer.sink()),
        LAUNCH_LOG_FILTER,
    );
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    if let Some(summary) = &config.scheduler.summary {
        tracing::info!("{summary}");
    }
    Ok(writer)
}

/// What this node registers with the gang about its GPUs: the pre-flight's report, or the fatal
/// verdict a fixed-size gang joins with only to stop the job.
fn gpu_verdict(gpu: Option<&crate::gpu::Report>, gpu_fatal: bool) -> serde_json::Value {
    match gpu {
        Some(report) if gpu_fatal => {
            tracing::error!(
                "GPU pre-flight failed on {}; joining only to stop the gang",
                report.summary().message()
            );
            gate::fatal_registration_value(report)
        }
        other => gate::registration_value(other),
    }
}

/// The gang rendezvous for a multi-node job, with this node's GPU verdict, telling its events
/// and the loss of its store host; and whether this node hosts the rendezvous store.
fn gang_rendezvous(
    config: &Config,
    gpu: Option<&crate::gpu::Report>,
    gpu_fatal: bool,
    events: &Events,
    metrics: &Metrics,
) -> anyhow::Result<(Box<dyn Rendezvous>, bool)> {
    let mut r = GangRendezvous::new(config, false)?.with_events(events.clone());
    let hosts_rendezvous = r.hosts_store_first();
    r.set_gpu_verdict(gpu_verdict(gpu, gpu_fatal));
    metrics.attach_host_loss(r.host_loss());
    Ok((Box::new(r), hosts_rendezvous))
}

/// The workers' GPU order (`CUDA_DEVICE_ORDER` where the pre-flight runs) and, with
/// `--numa-binding`, each rank's CPUs.
fn order_and_pin_gpus(mut launch: Launch, gpu_check: GpuCheck) -> Result<Launch, Exit> {
    for (key, value) in gate::device_order_env(gpu_check != GpuCheck::Off, &|k| std::env::var_os(k))
    {
        launch = launch.with_worker_env(key, value);
    }
    if launch.config().numa_binding {
        let rank_cpus = gate::numa_binding(launch.config().nproc_per_node)
            .map_err(|e| Exit::config(format!("--numa-binding: {e}")))?;
        launch = launch.with_rank_cpus(rank_cpus);
    }
    Ok(launch)
}

/// Starts the checkpoint barrier in the agent's private directory and plugs it into `launch`:
/// its socket and switches in the workers' environment, its hook on SIGTERM.
fn plug_in_barrier(
    mut launch: Launch,
    shutdown: &CancellationToken,
    events: &Events,
) -> Result<(Launch, Preemption), Exit> {
    // One private directory per agent (mode 0700, removed at exit) for the helper, the workers'
    // error files and the stack dumps; `None` where nothing is writable.
    let private_dir =
        crate::scratch::ScratchDir::create(launch.config().tmp_dir.as_deref(), "muster-")
            .map_err(|e| Exit::config(e.to_string()))?
            .map(std::sync::Arc::new);
    if let Some(dir) = &private_dir {
        launch = launch.with_private_dir(dir.clone());
    }
    let preemption = Preemption::start(
        launch.config(),
        private_dir,
        launch.observer(),
        shutdown.clone(),
        events.clone(),
    )
    // The environment's doing (an unusable --tmp-dir, a socket that cannot be bound).
    .map_err(|e| Exit::config(format!("cannot set up the checkpoint barrier: {e}")))?;
    let on_off = |on: bool| if on { "1" } else { "0" };
    let framework_callbacks = on_off(launch.config().framework_callbacks);
    let auto_step_reports = on_off(launch.config().auto_step_reports);
    let launch = launch
        .with_worker_env(checkpoint::local::SOCKET_ENV, preemption.socket())
        .with_worker_env(checkpoint::FRAMEWORK_CALLBACKS_ENV, framework_callbacks)
        .with_worker_env(checkpoint::local::AUTO_STEP_REPORTS_ENV, auto_step_reports)
        .on_terminate(preemption.terminate_hook());
    Ok((launch, preemption))
}

/// With `--snapshot-every`, starts the agent's side of snapshots and names its socket to the
/// workers.
fn hold_snapshots(
    mut launch: Launch,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<(Launch, Option<crate::snapshot::Snapshots>), Exit> {
    let snapshots = crate::snapshot::Snapshots::start(
        launch.config(),
        launch.observer(),
        Some(std::sync::Arc::new(metrics.snapshot_meter())),
        shutdown,
    )
    .map_err(|e| Exit::config(format!("cannot set up snapshots: {e}")))?;
    if let Some(snapshots) = &snapshots {
        for (name, value) in snapshots.worker_env() {
            launch = launch.with_worker_env(name, value);
        }
    }
    Ok((launch, snapshots))
}

/// How long an agent whose job failed (no signal) waits for its newest committed snapshot to
/// be whole on the disk before it exits: the job started again resumes from it.
const PERSIST_AT_FAILURE: std::time::Duration = std::time::Duration::from_secs(30);

/// With `--snapshot-persist`, before the agent exits after a terminating signal or a failed
/// job: the newest committed snapshot is given what is left of the grace period (else
/// [`PERSIST_AT_FAILURE`]) to be whole on the disk, so that the job started again resumes from
/// it; the line says which step that is, and whether the checkpoint barrier saved a newer one.
/// A job that succeeded has nothing to resume.
async fn persist_before_exit(
    snapshots: &crate::snapshot::Snapshots,
    preemption: &Preemption,
    exit_code: u8,
) {
    if !snapshots.persists() {
        return;
    }
    let left = match preemption.deadline() {
        Some(deadline) => deadline.saturating_duration_since(std::time::Instant::now()),
        None if exit_code != 0 => PERSIST_AT_FAILURE,
        None => return,
    };
    let on_disk = snapshots.flush(left).await;
    let saved = match preemption.outcome() {
        Some(checkpoint::Outcome::Committed { step }) => Some(step),
        _ => None,
    };
    match (on_disk, saved) {
        (Some(step), Some(saved)) if saved >= step => tracing::info!(
            "snapshots: step {step} is on the disk too; the checkpoint barrier's step {saved} is newer"
        ),
        (Some(step), _) => tracing::info!(
            "snapshots: this node's parts of step {step}, the newest committed snapshot, are whole on the disk: a job started again with the same --snapshot-persist resumes from it"
        ),
        (None, _) if snapshots.committed().is_some() => tracing::warn!(
            "snapshots: the newest committed snapshot of this node is not whole on the disk before the agent exits; a job started again resumes from an older one or from the script's checkpoint"
        ),
        (None, _) => {}
    }
}

/// Where `/tmp` is not writable, gives the workers a `TMPDIR` under muster's writable place.
fn give_workers_a_tmpdir(launch: Launch, preemption: &Preemption) -> Launch {
    let Some(dir) = preemption.writable_base().and_then(|base| {
        crate::scratch::workers_tmpdir(
            base,
            std::env::var_os("TMPDIR"),
            &crate::scratch::is_writable,
        )
    }) else {
        return launch;
    };
    tracing::info!(
        "/tmp is not writable: the workers get TMPDIR={} (PyTorch needs a temporary directory)",
        dir.display()
    );
    launch.with_worker_env("TMPDIR", dir)
}

/// The workers' `PYTHONPATH` with the checkpoint helper's directory; `None`, said once, where
/// muster has no writable directory for it.
fn helper_python_path(launch: &Launch, preemption: &Preemption) -> Option<std::ffi::OsString> {
    let python_path = preemption.python_path();
    if python_path.is_none() {
        tracing::warn!(
            "no writable directory for muster's files (tried {}): `import muster_checkpoint` works only where the script ships the helper (without it SIGTERM is forwarded to the workers) and workers get no TORCHELASTIC_ERROR_FILE; {}",
            crate::scratch::describe_candidates(launch.config().tmp_dir.as_deref()),
            crate::scratch::FIX
        );
    }
    python_path
}

/// Starts the GPU watch unless its interval is zero, on the metrics and in `launch`.
fn start_gpu_watch(
    mut launch: Launch,
    metrics: &Metrics,
) -> (Launch, Option<crate::gpu::watch::Watch>) {
    // The GPU watch runs whatever `--gpu-check` says: without a GPU device or a driver it ends at
    // once, and a GPU that was already bad at the start is not a fault of the run.
    let gpu_watch = (!launch.config().gpu_watch_interval.is_zero()).then(|| {
        crate::gpu::watch::Watch::start(crate::gpu::watch::Options {
            interval: launch.config().gpu_watch_interval,
            library: crate::gpu::nvml::library_override(),
        })
    });
    if let Some(watch) = &gpu_watch {
        metrics.attach_gpu_watch(watch.clone());
        launch = launch.with_gpu_watch(watch.clone());
    }
    (launch, gpu_watch)
}

/// The GPU pre-flight as `--gpu-check` says, told to `events`: the report (`None` when off) and
/// whether it is a fatal one that a fixed-size gang joins with (see
/// [`gate::fatal_registration_value`]).
async fn preflight(
    mode: GpuCheck,
    fixed_gang: bool,
    events: &Events,
) -> Result<(Option<crate::gpu::Report>, bool), Exit> {
    events.publish(Event::PreflightStarted);
    let started = tokio::time::Instant::now();
    let result = if fixed_gang {
        gate::for_gang(mode).await
    } else {
        gate::for_launch(mode).await.map(|report| (report, false))
    };
    events.publish(Event::PreflightFinished {
        result: match &result {
            Ok((Some(report), _)) => PreflightResult::Checked(std::sync::Arc::new(report.clone())),
            Ok((None, _)) => PreflightResult::Skipped,
            Err(_) => PreflightResult::Failed,
        },
        elapsed: started.elapsed(),
    });
    result
}

/// Plugs the hang watch and the crash-loop guard into `launch`: the helper's step reports, and
/// the directory where the helper's `faulthandler` fallback writes (the helper's own private
/// directory). Its view of the running ranks is what `GET /debug/stacks` reads. Returns the
/// watch too, for the straggler watch to wrap.
fn watch_hangs(
    launch: Launch,
    preemption: &Preemption,
    metrics: &Metrics,
) -> (Launch, std::sync::Arc<dyn crate::launch::Watchdog>) {
    let policy = launch.config().hang;
    let watch = crate::hang_watch::HangWatch::new(policy, preemption.progress_view());
    metrics.attach_stacks(std::sync::Arc::new(watch.stacks_source()));
    let watch: std::sync::Arc<dyn crate::launch::Watchdog> = std::sync::Arc::new(watch);
    // The same reports tell the crash-loop guard how far each attempt got.
    let view = preemption.progress_view();
    let marks = preemption.progress_view();
    let mut launch = launch
        .with_watchdog(watch.clone())
        .with_steps(std::sync::Arc::new(move |since| view.max_step_since(since)))
        // And where a restart's timeline ends: each rank's init_process_group and first step.
        .with_rank_marks(std::sync::Arc::new(move |since| {
            marks.rank_marks_since(since)
        }));
    if let Some(dir) = preemption.helper_dir() {
        launch = launch.with_worker_env(crate::watch::stacks::STACKS_DIR_ENV, dir);
    }
    (launch, watch)
}

/// Plugs the straggler watch around the hang watch: the same step reports, the GPU watch's
/// evidence, its findings on the metrics and `/gangz`, and its request to leave (`exclude`).
fn watch_stragglers(
    launch: Launch,
    hang_watch: std::sync::Arc<dyn crate::launch::Watchdog>,
    preemption: &Preemption,
    gpu_watch: Option<&crate::gpu::watch::Watch>,
    metrics: &Metrics,
) -> Launch {
    let config = launch.config();
    let mut watch = crate::straggler_watch::StragglerWatch::new(
        config.straggler,
        preemption.progress_view(),
        config.nnodes.min,
        hang_watch,
    );
    if let Some(gpus) = gpu_watch {
        watch = watch.with_gpus(gpus.clone());
    }
    metrics.attach_stragglers(watch.board());
    // A node that leaves as a straggler is remembered, as one the GPU pre-flight or the network
    // check found bad: a later pod of the job on the same Kubernetes node fails fast.
    let remember_in = std::sync::Arc::new(config.clone());
    watch = watch.on_exclude(std::sync::Arc::new(move |excluded| {
        let config = remember_in.clone();
        let finding = crate::launch::bad_nodes::Finding::new(
            crate::exit_code::SLOW_NODE_EXCLUDED,
            &format!("straggler: {}", excluded.what),
        );
        Box::pin(async move { crate::launch::bad_nodes::remember(&config, &finding).await })
    }));
    let leave = watch.leave();
    launch
        .with_watchdog(std::sync::Arc::new(watch))
        .with_leave(leave)
}

/// Where the scheduler signals every process (a Slurm step), the ranks that take part in the
/// checkpoint barrier are told to hold the `checkpoint` signals unless the agent marked the stop
/// as its own ([`crate::launch::stop_mark`]); without a private directory for the mark, nothing
/// is held (today's behaviour, said once).
fn hold_foreign_signals(launch: Launch, preemption: &Preemption) -> Launch {
    if !launch.config().scheduler.signals_every_process {
        return launch;
    }
    let held: Vec<String> = launch
        .config()
        .signals
        .actions
        .iter()
        .filter(|(_, action)| *action == crate::launch::config::SignalAction::Checkpoint)
        .map(|(sig, _)| (*sig as i32).to_string())
        .collect();
    if held.is_empty() {
        return launch;
    }
    let Some(dir) = preemption.helper_dir() else {
        tracing::warn!(
            "no private directory for the stop mark: ranks are not told to hold Slurm's signals, so a signal Slurm sends every rank ends them during the checkpoint"
        );
        return launch;
    };
    launch
        .with_worker_env(crate::slurm::HOLD_ENV, held.join(","))
        .with_worker_env(crate::launch::stop_mark::ENV, dir.join("stop"))
}
