//! The torchrun-compatible launch form, `muster [OPTIONS] script.py [ARGS]...`: the raw parse
//! ([`lowargs`]: flags in both spellings plus the `MUSTER_*`/`PET_*` environment), the validated
//! configuration ([`hiargs`]), and the edge that runs [`crate::launch`] and turns its outcome into
//! an exit code.

#[cfg(test)]
mod doc_check;
pub mod hiargs;
pub mod lowargs;

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::Path;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

use crate::checkpoint::{self, controller::Preemption};
use crate::exit_code::Exit;
use crate::launch::config::{Config, LogFormat};
use crate::launch::Launch;
use crate::logs::{self, LogSink, TracingWriter};

/// Parses the launch form (`args` without the program name) against the real environment.
pub fn parse(args: &[OsString]) -> Result<Parsed, hiargs::ConfigError> {
    let env = |name: &str| std::env::var_os(name);
    let low = lowargs::parse(args, &env).map_err(|e| hiargs::ConfigError(e.to_string()))?;
    if low.help {
        return Ok(Parsed::Help);
    }
    if low.version {
        return Ok(Parsed::Version);
    }
    let probe = hiargs::Probe {
        gpu_count: &hiargs::gpu_count,
        cpu_count: &hiargs::cpu_count,
        env: &env,
        is_file: &|p: &Path| p.is_file(),
    };
    hiargs::build(&low, &probe).map(|c| Parsed::Launch(Box::new(c)))
}

/// What the command line asked for.
#[derive(Debug)]
pub enum Parsed {
    Help,
    Version,
    Launch(Box<Config>),
}

/// `muster [OPTIONS] script.py [ARGS]...`; `args` includes the program name.
pub fn run(args: &[OsString]) -> anyhow::Result<u8> {
    let config = match parse(args.get(1..).unwrap_or_default()) {
        Ok(Parsed::Help) => {
            print!("{}", lowargs::help_text());
            return Ok(0);
        }
        Ok(Parsed::Version) => {
            println!("muster {}", env!("CARGO_PKG_VERSION"));
            return Ok(0);
        }
        Ok(Parsed::Launch(config)) => *config,
        Err(e) => return Err(Exit::config(e.0).into()),
    };
    // One thread: the workers' parent thread must live as long as they do (PR_SET_PDEATHSIG is
    // per thread), and an agent that mostly waits needs no more.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(launch(config))
}

async fn launch(config: Config) -> anyhow::Result<u8> {
    let writer = logs::start().context("cannot start the log writer")?;
    init_tracing(config.logs.format, writer.sink());
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    let shutdown = CancellationToken::new();
    let metrics = crate::metrics::Metrics::new();
    metrics.attach_worker_output(writer.sink().stats());
    // Read once, at start: a Secret that cannot be read is a configuration error, not a job
    // that silently refuses its controller later.
    let checkpoint_token = match config.checkpoint_token_file.as_deref() {
        None => None,
        Some(path) => match crate::metrics::CheckpointToken::from_file(path) {
            Ok(token) => Some(token),
            Err(e) => {
                writer.finish();
                return Err(Exit::config(e.to_string()).into());
            }
        },
    };
    let endpoint_config = crate::metrics::EndpointConfig {
        checkpoint_token,
        ..crate::metrics::EndpointConfig::default()
    };
    let endpoint = match crate::metrics::agent::start_endpoint(
        config.metrics_addr,
        &metrics,
        endpoint_config,
        &shutdown,
    ) {
        Ok(endpoint) => endpoint,
        Err(e) => {
            writer.finish();
            return Err(Exit::config(e.to_string()).into());
        }
    };
    let mut launch = Launch::new(config).with_log_sink(writer.sink());
    // In a fixed-size gang an unhealthy node joins anyway, flagged, so that node 0 ends the job
    // for everyone at once (204, naming it); with spare capacity (MIN < MAX) it leaves instead.
    let fixed_gang = crate::node::is_multi_node(launch.config())
        && launch.config().nnodes.min == launch.config().nnodes.max;
    let mut gpu_fatal = false;
    let preflight = async {
        if fixed_gang {
            let (report, fatal) = crate::gpu::gate::for_gang(launch.config()).await?;
            gpu_fatal = fatal;
            Ok(report)
        } else {
            crate::gpu::gate::for_launch(launch.config()).await
        }
    };
    let gpu = match crate::metrics::agent::preflight(&metrics, preflight).await {
        Ok(report) => report,
        Err(exit) => {
            writer.finish();
            return Err(anyhow::Error::new(exit));
        }
    };
    // Node 0 is ready once its rendezvous store accepts connections (node.rs says so); every
    // other agent once its setup below is done. Never later: see `metrics::Readiness`.
    let mut hosts_rendezvous = false;
    if crate::node::is_multi_node(launch.config()) {
        match crate::node::GangRendezvous::new(launch.config(), false) {
            Ok(mut r) => {
                hosts_rendezvous = r.hosts_store_first();
                r.set_gpu_verdict(match gpu.as_ref() {
                    Some(report) if gpu_fatal => {
                        tracing::error!(
                            "GPU pre-flight failed on {}; joining only to stop the gang",
                            report.summary().message()
                        );
                        crate::gpu::gate::fatal_registration_value(report)
                    }
                    other => crate::gpu::gate::registration_value(other),
                });
                launch = launch.with_rendezvous(crate::metrics::agent::metered(r, &metrics));
            }
            Err(e) => {
                writer.finish();
                return Err(anyhow::Error::new(Exit::new(e.exit_code(), e.to_string())));
            }
        }
    }
    let asks_gpus = launch.config().gpu_check != crate::launch::config::GpuCheck::Off;
    for (key, value) in crate::gpu::gate::device_order_env(asks_gpus, &|k| std::env::var_os(k)) {
        launch = launch.with_worker_env(key, value);
    }
    if launch.config().numa_binding {
        match crate::gpu::gate::numa_binding(launch.config().nproc_per_node) {
            Ok(rank_cpus) => launch = launch.with_rank_cpus(rank_cpus),
            Err(e) => {
                writer.finish();
                return Err(Exit::config(format!("--numa-binding: {e}")).into());
            }
        }
    }
    let preemption = match Preemption::start(launch.config(), launch.observer(), shutdown.clone()) {
        Ok(preemption) => preemption,
        Err(e) => {
            // The environment's doing (an unusable --tmp-dir, a socket that cannot be bound).
            writer.finish();
            return Err(Exit::config(format!("cannot set up the checkpoint barrier: {e}")).into());
        }
    };
    launch = launch
        .with_worker_env(checkpoint::local::SOCKET_ENV, preemption.socket())
        .on_terminate(preemption.terminate_hook());
    launch = watch_hangs(launch, &preemption);
    if let Some(dir) = preemption.writable_base().and_then(|base| {
        crate::scratch::workers_tmpdir(
            base,
            std::env::var_os("TMPDIR"),
            &crate::scratch::is_writable,
        )
    }) {
        tracing::info!(
            "/tmp is not writable: the workers get TMPDIR={} (PyTorch needs a temporary directory)",
            dir.display()
        );
        launch = launch.with_worker_env("TMPDIR", dir);
    }
    let python_path = preemption.python_path();
    if python_path.is_none() {
        tracing::warn!(
            "no writable directory for muster's files (tried {}): `import muster_checkpoint` works only where the script ships the helper (without it SIGTERM is forwarded to the workers) and workers get no TORCHELASTIC_ERROR_FILE; {}",
            crate::scratch::describe_candidates(launch.config().tmp_dir.as_deref()),
            crate::scratch::FIX
        );
    }
    let script_metrics =
        crate::metrics::script::attach(endpoint.local_addr(), &metrics, preemption.writable_base());
    if let Some(script) = &script_metrics {
        let inherited = python_path
            .or_else(|| std::env::var_os("PYTHONPATH"))
            .unwrap_or_default();
        launch = script.plug_into(launch, &inherited);
    } else if let Some(path) = python_path {
        launch = launch.with_worker_env("PYTHONPATH", path);
    }
    let launch = crate::metrics::agent::instrument(launch, &metrics, &endpoint, &shutdown);
    metrics.advance_readiness(if hosts_rendezvous {
        crate::metrics::Readiness::HostingStore
    } else {
        crate::metrics::Readiness::Ready
    });
    let run = launch.run(shutdown.clone());
    let result = crate::metrics::agent::serve_checkpoint_requests(&metrics, run, |reason| {
        preemption.trigger(reason)
    })
    .await;
    drop(endpoint);
    if let Some(script) = &script_metrics {
        script.remove_files();
    }
    writer.finish();
    match result {
        Ok(outcome) => Ok(preemption.exit_code(outcome.exit_code)),
        Err(e) => {
            let code = e.exit_code();
            Err(anyhow::Error::new(Exit::new(code, e.to_string())))
        }
    }
}

/// Plugs the hang watch into `launch`: the helper's step reports, and the directory where the
/// helper's `faulthandler` fallback writes (the helper's own private directory).
fn watch_hangs(launch: Launch, preemption: &Preemption) -> Launch {
    let policy = launch.config().hang;
    let mut launch = launch.with_watchdog(std::sync::Arc::new(crate::watch::HangWatch::new(
        policy,
        preemption.progress_view(),
    )));
    if let Some(dir) = preemption.helper_dir() {
        launch = launch.with_worker_env(crate::watch::stacks::STACKS_DIR_ENV, dir);
    }
    launch
}

/// The agent's own messages go through the console writer, so they never split a worker line.
/// `muster dry-run` writes its own messages the same way.
pub(crate) fn init_tracing(format: LogFormat, sink: LogSink) {
    let filter = ["MUSTER_LOG", "RUST_LOG"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .and_then(|spec| EnvFilter::try_new(spec).ok())
        // The workers' store logs every start and stop at info; that is noise in a launch.
        // py-spy (stack dumps) narrates every read at info.
        .unwrap_or_else(|| EnvFilter::new("info,rendezvous=warn,py_spy=warn,remoteprocess=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(TracingWriter::new(sink))
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    let _already_set = match format {
        LogFormat::Text => builder.without_time().try_init(),
        LogFormat::Json => builder
            .event_format(logs::record::JsonEvents::new(
                crate::launch::short_hostname(),
            ))
            .try_init(),
    };
}

/// The log format the launch form asked for, as far as it can be told from `args` (with the
/// program name) and the environment: for the records written when the launch cannot start.
/// When the command line itself does not parse, only the environment can say.
pub fn requested_log_format(args: &[OsString]) -> LogFormat {
    let env = |name: &str| std::env::var_os(name);
    let value = match lowargs::parse(args.get(1..).unwrap_or_default(), &env) {
        Ok(low) => low.values.get("log-format").map(|raw| raw.value.clone()),
        Err(_) => lowargs::FLAGS
            .iter()
            .find(|f| f.name == "log-format")
            .map(lowargs::env_names)
            .unwrap_or_default()
            .iter()
            .find_map(|name| env(name).filter(|v| !v.is_empty()))
            .map(|v| v.to_string_lossy().into_owned()),
    };
    match value.as_deref().map(str::trim) {
        Some("json") => LogFormat::Json,
        _ => LogFormat::Text,
    }
}
