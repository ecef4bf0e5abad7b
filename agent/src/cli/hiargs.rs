//! From the raw parse ([`super::lowargs`]) to the validated [`Config`]: every value is checked and
//! typed here, torchrun's derived defaults are applied (standalone mode, the run id, the Python
//! interpreter), and every mistake becomes one line naming the flag and where its value came from.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;

use super::lowargs::{parse_switch_value, LowArgs, RawValue};
use crate::launch::config::{
    Config, Entrypoint, GpuCheck, LogConfig, LogFormat, NodeRange, SignalAction, SignalPolicy,
    StreamSpec, Streams, DEFAULT_PREFIX_TEMPLATE, DEFAULT_SHUTDOWN_TIMEOUT,
};

/// A configuration error: one line for the user, exit code 202.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl crate::exit_code::Coded for ConfigError {
    fn exit_code(&self) -> u8 {
        crate::exit_code::CONFIG_ERROR
    }
}

/// What the machine offers, injected so validation stays a pure function in tests.
pub struct Probe<'a> {
    pub gpu_count: &'a dyn Fn() -> u32,
    pub cpu_count: &'a dyn Fn() -> u32,
    pub env: &'a dyn Fn(&str) -> Option<OsString>,
    pub is_file: &'a dyn Fn(&Path) -> bool,
}

/// CPUs this process may use (affinity and cgroup quota aware, unlike torch's `os.cpu_count()`).
pub fn cpu_count() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
}

/// `1073741824`, `1024MiB`, `1GiB`: a plain number of bytes or a binary-unit suffix (also the
/// agent's `--max-store-bytes`, and `muster store --max-store-bytes`).
pub fn parse_byte_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        other => {
            return Err(format!(
                "unknown unit {other:?} (use a number of bytes or KiB, MiB, GiB, TiB)"
            ))
        }
    };
    let number: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 1073741824 or 1GiB)"))?;
    number
        .checked_mul(1 << shift)
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| format!("{text:?} is zero or too large"))
}

fn bad(raw: &RawValue, flag: &str, why: impl std::fmt::Display) -> ConfigError {
    ConfigError(format!(
        "invalid --{flag} `{}` ({}): {why}",
        raw.value, raw.source
    ))
}

fn get<'a>(low: &'a LowArgs, flag: &str) -> Option<&'a RawValue> {
    low.values.get(flag)
}

fn parse_u32(low: &LowArgs, flag: &str, default: u32) -> Result<u32, ConfigError> {
    match get(low, flag) {
        None => Ok(default),
        Some(raw) => raw
            .value
            .trim()
            .parse()
            .map_err(|_| bad(raw, flag, "expected a non-negative integer")),
    }
}

/// Seconds, in the one syntax of every duration setting ([`rendezvous::seconds`]).
pub fn parse_seconds(text: &str) -> Result<Duration, rendezvous::seconds::SecondsError> {
    rendezvous::seconds::parse(text)
}

/// [`parse_seconds`] as a clap value parser, for the subcommands' duration flags.
pub fn parse_seconds_arg(text: &str) -> Result<Duration, String> {
    parse_seconds(text).map_err(|e| e.to_string())
}

fn parse_duration(low: &LowArgs, flag: &str) -> Result<Option<Duration>, ConfigError> {
    get(low, flag)
        .map(|raw| parse_seconds(&raw.value).map_err(|e| bad(raw, flag, e)))
        .transpose()
}

/// `--nnodes N` or `MIN:MAX`.
pub fn parse_nnodes(text: &str) -> Result<NodeRange, String> {
    let num = |s: &str| {
        s.trim()
            .parse::<u32>()
            .map_err(|_| "expected N or MIN:MAX".to_owned())
    };
    let (min, max) = if let Some((a, b)) = text.split_once(':') {
        (num(a)?, num(b)?)
    } else {
        let n = num(text)?;
        (n, n)
    };
    if min == 0 || min > max {
        return Err("need 0 < MIN <= MAX".to_owned());
    }
    Ok(NodeRange { min, max })
}

/// `--nproc-per-node`: a count, `gpu`, `cpu` or `auto` (GPUs if any, else CPUs). The machine is
/// asked only for a word: a count (the common case) lists no `/dev` and reads no cgroup.
pub fn parse_nproc(
    text: &str,
    gpus: &dyn Fn() -> u32,
    cpus: &dyn Fn() -> u32,
) -> Result<u32, String> {
    let n = match text.trim() {
        "gpu" | "cuda" => {
            let gpus = gpus();
            if gpus == 0 {
                return Err("`gpu` asks for one worker per GPU, but this node has no GPU".into());
            }
            gpus
        }
        "cpu" => cpus(),
        "auto" => match gpus() {
            0 => cpus(),
            gpus => gpus,
        },
        other => other
            .parse::<u32>()
            .map_err(|_| "expected a number, gpu, cpu or auto".to_owned())?,
    };
    if n == 0 {
        return Err("need at least one worker".into());
    }
    Ok(n)
}

/// torchrun's `Std.from_str`: `0..3` for every rank, or `RANK:STD,RANK:STD`.
pub fn parse_stream_spec(text: &str) -> Result<StreamSpec, String> {
    let one = |s: &str| match s.trim() {
        "0" => Ok(Streams::NONE),
        "1" => Ok(Streams::STDOUT),
        "2" => Ok(Streams::STDERR),
        "3" => Ok(Streams(3)),
        _ => Err("expected 0, 1, 2, 3 or LOCAL_RANK:STD,...".to_owned()),
    };
    let t = text.trim();
    if !t.contains(':') {
        return Ok(StreamSpec {
            all: one(t)?,
            per_rank: BTreeMap::new(),
        });
    }
    let mut per_rank = BTreeMap::new();
    for part in t.split(',').filter(|p| !p.trim().is_empty()) {
        let (rank, std) = part
            .split_once(':')
            .ok_or_else(|| "expected LOCAL_RANK:STD,...".to_owned())?;
        let rank = rank
            .trim()
            .parse::<u32>()
            .map_err(|_| "expected LOCAL_RANK:STD,...".to_owned())?;
        per_rank.insert(rank, one(std)?);
    }
    Ok(StreamSpec {
        all: Streams::NONE,
        per_rank,
    })
}

fn parse_rank_list(text: &str) -> Result<BTreeSet<u32>, String> {
    text.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.trim()
                .parse::<u32>()
                .map_err(|_| "expected comma-separated local ranks".to_owned())
        })
        .collect()
}

fn parse_rdzv_conf(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| format!("`{p}` is not KEY=VALUE"))
        })
        .collect()
}

fn parse_signal_name(name: &str) -> Result<Signal, String> {
    let upper = name.trim().to_ascii_uppercase();
    let full = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    let sig: Signal = full
        .parse()
        .map_err(|_| format!("`{name}` is not a signal name"))?;
    match sig {
        Signal::SIGKILL | Signal::SIGSTOP => Err(format!("{sig} cannot be handled")),
        Signal::SIGCHLD => Err("SIGCHLD is how the agent sees workers exit".into()),
        Signal::SIGSEGV
        | Signal::SIGBUS
        | Signal::SIGFPE
        | Signal::SIGILL
        | Signal::SIGTRAP
        | Signal::SIGSYS => Err(format!(
            "{sig} is a fault of the agent itself, not a request"
        )),
        s => Ok(s),
    }
}

/// `--signals-to-handle SIGTERM,SIGUSR1:forward,...`. The four stop signals are always handled
/// (as `terminate` unless given another action), so listing only SIGUSR1 cannot make SIGTERM
/// kill the agent without stopping its workers.
pub fn parse_signals(text: &str) -> Result<SignalPolicy, String> {
    let mut policy = SignalPolicy {
        raw: text.trim().to_owned(),
        ..SignalPolicy::default()
    };
    for part in text.split(',').filter(|p| !p.trim().is_empty()) {
        let (name, action) = match part.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (part, None),
        };
        let sig = parse_signal_name(name)?;
        let action = match action.map(|a| a.trim().to_ascii_lowercase()) {
            None => SignalAction::default_for(sig),
            Some(a) => match a.as_str() {
                "terminate" => SignalAction::Terminate,
                "forward" => SignalAction::Forward,
                "ignore" => SignalAction::Ignore,
                "checkpoint" => SignalAction::Checkpoint,
                _ => {
                    return Err(format!(
                        "`{a}` is not terminate, checkpoint, forward or ignore"
                    ))
                }
            },
        };
        // In place when already listed, so the order (exported to workers) stays torchrun's.
        match policy.actions.iter_mut().find(|(s, _)| *s == sig) {
            Some(entry) => entry.1 = action,
            None => policy.actions.push((sig, action)),
        }
    }
    Ok(policy)
}

/// A random version-4 UUID, torchrun's standalone run id.
pub fn random_run_id() -> String {
    use std::fmt::Write as _;
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let mut h = String::with_capacity(32);
    for x in b {
        let _ = write!(h, "{x:02x}");
    }
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn find_on_path(name: &str, probe: &Probe<'_>) -> Option<PathBuf> {
    let path = (probe.env)("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| (probe.is_file)(p))
}

/// The interpreter for Python entry points: `$PYTHON_EXEC`, else `python3`, else `python`.
fn python(probe: &Probe<'_>) -> Result<OsString, ConfigError> {
    if let Some(exec) = (probe.env)("PYTHON_EXEC").filter(|v| !v.is_empty()) {
        return Ok(exec);
    }
    ["python3", "python"]
        .into_iter()
        .find_map(|n| find_on_path(n, probe))
        .map(PathBuf::into_os_string)
        .ok_or_else(|| {
            ConfigError(
                "no Python interpreter: set PYTHON_EXEC or put python3 on PATH (or use --no-python)"
                    .into(),
            )
        })
}

fn entrypoint(
    positional: &[OsString],
    module: bool,
    no_python: bool,
    probe: &Probe<'_>,
) -> Result<Entrypoint, ConfigError> {
    let Some((first, rest)) = positional.split_first() else {
        return Err(ConfigError(
            "missing the training script (usage: muster [OPTIONS] script.py [ARGS]...)".into(),
        ));
    };
    let display = first.to_string_lossy().into_owned();
    if module && no_python {
        return Err(ConfigError(
            "--module and --no-python cannot be combined".into(),
        ));
    }
    if no_python {
        let has_slash = display.contains('/');
        if has_slash && !(probe.is_file)(Path::new(first)) {
            return Err(ConfigError(format!("program not found: {display}")));
        }
        if !has_slash && find_on_path(&display, probe).is_none() {
            return Err(ConfigError(format!("program not found on PATH: {display}")));
        }
        return Ok(Entrypoint {
            program: first.clone(),
            args: rest.to_vec(),
            display,
            python: false,
        });
    }
    let mut args: Vec<OsString> = vec!["-u".into()];
    if module {
        args.push("-m".into());
    } else if !(probe.is_file)(Path::new(first)) {
        if Path::new(first).extension().is_none_or(|e| e != "py") {
            // Not a script file: a program on PATH runs directly (torchrun would hand it to
            // Python and fail).
            if let Some(found) = (!display.contains('/'))
                .then(|| find_on_path(&display, probe))
                .flatten()
            {
                return Ok(Entrypoint {
                    program: found.into_os_string(),
                    args: rest.to_vec(),
                    display,
                    python: false,
                });
            }
        }
        return Err(ConfigError(format!("training script not found: {display}")));
    }
    args.push(first.clone());
    args.extend(rest.iter().cloned());
    Ok(Entrypoint {
        program: python(probe)?,
        args,
        display,
        python: true,
    })
}

/// Validates the raw parse into a [`Config`], one section after another: the order of the
/// sections is the order in which flags are checked, so it decides which of two bad flags an
/// error names.
pub fn build(low: &LowArgs, probe: &Probe<'_>) -> Result<Config, ConfigError> {
    refuse_run_path(low)?;
    let shape = job_shape(low, probe)?;
    let rdzv = rendezvous(low, shape.nnodes)?;
    let mut warnings = rdzv.warnings;
    let supervision = supervision(low)?;
    let gpu = gpu_handling(low)?;
    let preempted_exit_code = preempted_exit_code(low)?;
    let hang = hang_policy(low)?;
    let straggler = straggler(low, shape.nnodes, &mut warnings)?;
    let framework_callbacks = on_off(low, "framework-callbacks")?;
    let auto_step_reports = on_off(low, "auto-step-reports")?;
    let warm_restart = on_off_default(low, "warm-restart", true)?;
    let snapshot_every = parsed(low, "snapshot-every", |text| {
        text.trim()
            .parse::<u64>()
            .map_err(|_| "expected a number of steps (0: off)")
    })?
    .filter(|&every| every > 0);
    let snapshot_memory = parsed(low, "snapshot-memory", parse_byte_size)?.map(|b| b as u64);
    let snapshot_persist = path_flag(low, "snapshot-persist");
    let snapshot_persist_every =
        snapshot_persist_every(low, snapshot_every, snapshot_persist.is_some())?;
    if let (Some(raw), None) = (get(low, "snapshot-persist"), snapshot_every) {
        if snapshot_persist.is_some() {
            return Err(bad(
                raw,
                "snapshot-persist",
                "persists the agents' snapshots, which need --snapshot-every N",
            ));
        }
    }
    let role = get(low, "role").map_or_else(|| "default".to_owned(), |r| r.value.clone());
    let logs = log_config(low)?;
    let signals = parsed(low, "signals-to-handle", parse_signals)?.unwrap_or_default();
    let metrics_addr = parsed(low, "metrics-addr", str::parse)?;
    let gpu_check = gpu_check(low, probe)?;
    let network_check = network_check(low, shape.nnodes.max)?;
    let entrypoint = entrypoint(
        &low.positional,
        switch(low, "module"),
        switch(low, "no-python"),
        probe,
    )?;
    let max_store_bytes = parsed(low, "max-store-bytes", parse_byte_size)?
        .unwrap_or(rendezvous::store::server::DEFAULT_MAX_STORE_BYTES);

    Ok(Config {
        nnodes: shape.nnodes,
        nproc_per_node: shape.nproc_per_node,
        node_rank: shape.node_rank,
        node_rank_given: shape.node_rank_given,
        rdzv_backend: rdzv.backend,
        rdzv_endpoint: rdzv.endpoint,
        run_id: rdzv.run_id,
        rdzv_conf: rdzv.conf,
        standalone: rdzv.standalone,
        max_restarts: shape.max_restarts,
        max_no_progress_restarts: shape.max_no_progress_restarts,
        node_unit: shape.node_unit,
        monitor_interval: supervision.monitor_interval,
        role,
        entrypoint,
        logs,
        master_addr: rdzv.master_addr,
        master_port: rdzv.master_port,
        local_addr: rdzv.local_addr,
        shutdown_timeout: supervision.shutdown_timeout,
        signals,
        metrics_addr,
        gpu_check,
        grace_period: supervision.grace_period,
        preempted_exit_code,
        numa_binding: gpu.numa_binding,
        checkpoint_token_file: path_flag(low, "checkpoint-token-file"),
        warnings,
        tmp_dir: path_flag(low, "tmp-dir"),
        keep_strays: switch(low, "keep-strays"),
        framework_callbacks,
        gpu_release_timeout: gpu.release_timeout,
        gpu_watch_interval: gpu.watch_interval,
        max_store_bytes,
        network_check,
        hang,
        auto_step_reports,
        warm_restart,
        snapshot_every,
        snapshot_memory,
        snapshot_persist,
        snapshot_persist_every,
        scheduler: crate::cli::scheduler::Behaviour::default(),
        straggler,
    })
}

/// A switch given on the command line or in its variable (`1` is how the raw parse spells on).
fn switch(low: &LowArgs, flag: &str) -> bool {
    low.values.get(flag).is_some_and(|v| v.value == "1")
}

/// A flag's value through `parse`, an error naming the flag when it does not parse.
/// `--snapshot-persist-every STEPS`: a multiple of `--snapshot-every` (only committed snapshots
/// are written), with `--snapshot-persist`.
fn snapshot_persist_every(
    low: &LowArgs,
    every: Option<u64>,
    persists: bool,
) -> Result<Option<u64>, ConfigError> {
    let Some(raw) = get(low, "snapshot-persist-every") else {
        return Ok(None);
    };
    let steps: u64 = raw
        .value
        .trim()
        .parse()
        .map_err(|_| bad(raw, "snapshot-persist-every", "expected a number of steps"))?;
    match every {
        _ if !persists => Err(bad(
            raw,
            "snapshot-persist-every",
            "says how often --snapshot-persist DIR writes, and no --snapshot-persist is given",
        )),
        Some(every) if steps > 0 && steps % every == 0 => Ok(Some(steps)),
        Some(every) => Err(bad(
            raw,
            "snapshot-persist-every",
            format!("must be a positive multiple of --snapshot-every {every}: only committed snapshots are written"),
        )),
        None => Err(bad(raw, "snapshot-persist-every", "needs --snapshot-every N")),
    }
}

fn parsed<T, E: std::fmt::Display>(
    low: &LowArgs,
    flag: &str,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> Result<Option<T>, ConfigError> {
    get(low, flag)
        .map(|raw| parse(&raw.value).map_err(|e| bad(raw, flag, e)))
        .transpose()
}

/// A path flag; an empty value counts as not given.
fn path_flag(low: &LowArgs, flag: &str) -> Option<PathBuf> {
    get(low, flag)
        .map(|r| PathBuf::from(r.value.trim()))
        .filter(|p| !p.as_os_str().is_empty())
}

/// A switch that is on unless `--FLAG off` (or its variable) turns it off.
fn on_off(low: &LowArgs, flag: &str) -> Result<bool, ConfigError> {
    on_off_default(low, flag, true)
}

/// An `on|off` flag that is `default` when unset.
fn on_off_default(low: &LowArgs, flag: &str, default: bool) -> Result<bool, ConfigError> {
    match get(low, flag) {
        None => Ok(default),
        Some(raw) => parse_switch_value(&raw.value)
            .ok_or_else(|| bad(raw, flag, "expected on or off (or 1/0, true/false, yes/no)")),
    }
}

/// torchrun's `--run-path` runs the script inside the launcher, which muster never does.
fn refuse_run_path(low: &LowArgs) -> Result<(), ConfigError> {
    if switch(low, "run-path") {
        return Err(ConfigError(
            "--run-path is not supported: muster never runs training code inside the agent; \
             drop the flag (the script then runs as `python -u script.py`)"
                .into(),
        ));
    }
    Ok(())
}

/// The gang's shape and how often it may restart.
struct JobShape {
    nnodes: NodeRange,
    nproc_per_node: u32,
    node_rank: u32,
    node_rank_given: bool,
    max_restarts: u32,
    max_no_progress_restarts: u32,
    node_unit: u32,
}

/// `--nnodes`, `--nproc-per-node`, `--node-rank`, `--max-restarts`, `--node-unit` and
/// `--max-no-progress-restarts`.
fn job_shape(low: &LowArgs, probe: &Probe<'_>) -> Result<JobShape, ConfigError> {
    let nnodes = parsed(low, "nnodes", parse_nnodes)?.unwrap_or(NodeRange { min: 1, max: 1 });
    let nproc_per_node = parsed(low, "nproc-per-node", |text| {
        parse_nproc(text, probe.gpu_count, probe.cpu_count)
    })?
    .unwrap_or(1);
    let node_rank = parse_u32(low, "node-rank", 0)?;
    let max_restarts = parse_u32(low, "max-restarts", 0)?;
    let node_unit = parse_u32(low, "node-unit", 1)?;
    if node_unit == 0 || nnodes.min % node_unit != 0 || nnodes.max % node_unit != 0 {
        if let Some(raw) = get(low, "node-unit") {
            return Err(bad(
                raw,
                "node-unit",
                format!(
                    "--nnodes {}:{} must be multiples of it (and it at least 1)",
                    nnodes.min, nnodes.max
                ),
            ));
        }
    }
    let max_no_progress_restarts = parse_u32(
        low,
        "max-no-progress-restarts",
        crate::launch::crash_loop::DEFAULT_MAX_NO_PROGRESS_RESTARTS,
    )?;
    Ok(JobShape {
        nnodes,
        nproc_per_node,
        node_rank,
        node_rank_given: get(low, "node-rank").is_some_and(|r| !r.value.trim().is_empty()),
        max_restarts,
        max_no_progress_restarts,
        node_unit,
    })
}

/// Where and how the gang meets, after torchrun's standalone rule.
struct RendezvousSection {
    backend: String,
    endpoint: String,
    run_id: String,
    conf: Vec<(String, String)>,
    standalone: bool,
    master_addr: Option<String>,
    master_port: Option<u16>,
    local_addr: Option<String>,
    /// What `--standalone` overrode, said out loud at start.
    warnings: Vec<String>,
}

/// `--master-port`, `--rdzv-backend`, `--rdzv-endpoint`, `--rdzv-conf`, `--standalone`,
/// `--rdzv-id`, `--master-addr` and `--local-addr`.
fn rendezvous(low: &LowArgs, nnodes: NodeRange) -> Result<RendezvousSection, ConfigError> {
    let master_port = parsed(low, "master-port", |text| {
        text.trim()
            .parse::<u16>()
            .map_err(|_| "expected a port number")
    })?;
    let rdzv_backend = get(low, "rdzv-backend").map_or("static", |r| r.value.trim());
    if !matches!(rdzv_backend, "static" | "c10d") {
        let raw = get(low, "rdzv-backend").ok_or_else(|| ConfigError("rdzv-backend".into()))?;
        return Err(bad(raw, "rdzv-backend", "muster supports static and c10d"));
    }
    let rdzv_endpoint = get(low, "rdzv-endpoint").map_or("", |r| r.value.trim());
    let conf = parsed(low, "rdzv-conf", parse_rdzv_conf)?.unwrap_or_default();
    // torchrun: --standalone, or the static default with nothing pointing elsewhere on one node.
    let explicit_standalone = switch(low, "standalone");
    let standalone = explicit_standalone
        || (rdzv_backend == "static"
            && rdzv_endpoint.is_empty()
            && master_port.is_none()
            && nnodes.max == 1);
    let warnings = if explicit_standalone {
        standalone_conflicts(low, nnodes)?
    } else {
        Vec::new()
    };
    let given_id = get(low, "rdzv-id")
        .map(|r| r.value.trim().to_owned())
        .filter(|id| !id.is_empty());
    let (backend, endpoint, run_id) = if standalone {
        // `--standalone` always draws a fresh id (torchrun's rule, and what `--help` says); a
        // single node that is standalone only because nothing points elsewhere keeps the id the
        // user gave.
        let run_id = match given_id {
            Some(id) if !explicit_standalone => id,
            _ => random_run_id(),
        };
        ("c10d".to_owned(), "localhost:0".to_owned(), run_id)
    } else {
        (
            rdzv_backend.to_owned(),
            rdzv_endpoint.to_owned(),
            given_id.unwrap_or_else(|| "none".to_owned()),
        )
    };
    Ok(RendezvousSection {
        backend,
        endpoint,
        run_id,
        conf,
        standalone,
        master_addr: get(low, "master-addr").map(|r| r.value.trim().to_owned()),
        master_port,
        local_addr: get(low, "local-addr").map(|r| r.value.trim().to_owned()),
        warnings,
    })
}

/// How the agent watches and stops its ranks.
struct Supervision {
    monitor_interval: Duration,
    shutdown_timeout: Duration,
    grace_period: Option<Duration>,
}

/// `--monitor-interval`, `--shutdown-timeout` and `--grace-period`.
fn supervision(low: &LowArgs) -> Result<Supervision, ConfigError> {
    Ok(Supervision {
        monitor_interval: parse_duration(low, "monitor-interval")?
            .unwrap_or(Duration::from_millis(100)),
        shutdown_timeout: parse_duration(low, "shutdown-timeout")?
            .unwrap_or(DEFAULT_SHUTDOWN_TIMEOUT),
        grace_period: parse_duration(low, "grace-period")?,
    })
}

/// How the agent waits for, watches and places on the GPUs.
struct GpuHandling {
    release_timeout: Duration,
    watch_interval: Duration,
    numa_binding: bool,
}

/// `--gpu-release-timeout`, `--gpu-watch-interval` and `--numa-binding`.
fn gpu_handling(low: &LowArgs) -> Result<GpuHandling, ConfigError> {
    let release_timeout = parse_duration(low, "gpu-release-timeout")?
        .unwrap_or(crate::launch::config::DEFAULT_GPU_RELEASE_TIMEOUT);
    let watch_interval =
        parse_duration(low, "gpu-watch-interval")?.unwrap_or(crate::gpu::watch::DEFAULT_INTERVAL);
    let numa_binding = match get(low, "numa-binding").map(|r| (r, r.value.trim())) {
        None => false,
        Some((_, "node")) => true,
        Some((raw, _)) => {
            return Err(bad(
                raw,
                "numa-binding",
                "only `node` is supported (torchrun's socket/exclusive/core-complex are not)",
            ))
        }
    };
    Ok(GpuHandling {
        release_timeout,
        watch_interval,
        numa_binding,
    })
}

/// `--preempted-exit-code`.
fn preempted_exit_code(low: &LowArgs) -> Result<u8, ConfigError> {
    // 200, not 0: in a Job a pod that exits 0 is Succeeded and completes its index, so a
    // preempted gang would end the Job as Complete with training unfinished.
    Ok(parsed(low, "preempted-exit-code", |text| {
        text.trim()
            .parse::<u8>()
            .map_err(|_| "expected an exit code 0-255")
    })?
    .unwrap_or(crate::exit_code::PREEMPTED_CHECKPOINTED))
}

/// `--hang-timeout`, `--section-timeout` and `--startup-timeout` (0 turns the startup watch off).
fn hang_policy(low: &LowArgs) -> Result<crate::watch::hang::Policy, ConfigError> {
    use crate::watch::hang::{HangTimeout, Policy, DEFAULT_SECTION_TIMEOUT};
    Ok(Policy {
        timeout: parsed(low, "hang-timeout", HangTimeout::parse)?.unwrap_or(HangTimeout::Auto),
        section_timeout: parse_duration(low, "section-timeout")?.unwrap_or(DEFAULT_SECTION_TIMEOUT),
        startup_timeout: match parse_duration(low, "startup-timeout")? {
            None => Some(crate::watch::startup::DEFAULT_TIMEOUT),
            Some(limit) => (!limit.is_zero()).then_some(limit),
        },
    })
}

/// `--redirects`, `--tee`, `--local-ranks-filter`, `--log-format`,
/// `--log-line-prefix-template`, `--log-dir` and `--progress-interval`.
fn log_config(low: &LowArgs) -> Result<LogConfig, ConfigError> {
    let redirects = parsed(low, "redirects", parse_stream_spec)?.unwrap_or_default();
    let tee = parsed(low, "tee", parse_stream_spec)?.unwrap_or_default();
    let local_ranks_filter = parsed(low, "local-ranks-filter", parse_rank_list)?;
    let format = match get(low, "log-format").map(|r| (r, r.value.trim())) {
        None | Some((_, "text")) => LogFormat::Text,
        Some((_, "json")) => LogFormat::Json,
        Some((raw, _)) => return Err(bad(raw, "log-format", "expected text or json")),
    };
    let prefix_template = get(low, "log-line-prefix-template")
        .map_or_else(|| DEFAULT_PREFIX_TEMPLATE.to_owned(), |r| r.value.clone());
    let log_dir = get(low, "log-dir").map(|r| PathBuf::from(r.value.trim()));
    let log_dir_origin = get(low, "log-dir").map_or_else(String::new, |r| r.source.to_string());
    let progress_interval =
        parse_duration(low, "progress-interval")?.unwrap_or(crate::logs::DEFAULT_PROGRESS_INTERVAL);
    Ok(LogConfig {
        log_dir,
        redirects,
        tee,
        local_ranks_filter,
        prefix_template,
        format,
        log_dir_origin,
        progress_interval,
    })
}

/// `--gpu-check`.
fn gpu_check(low: &LowArgs, probe: &Probe<'_>) -> Result<GpuCheck, ConfigError> {
    Ok(match get(low, "gpu-check").map(|r| (r, r.value.trim())) {
        // The default: require when the job asks for GPUs (`--nproc-per-node gpu`, or
        // the device plugin gave the pod some, announced in NVIDIA_VISIBLE_DEVICES), else off.
        None => {
            let asks_gpu = get(low, "nproc-per-node").is_some_and(|r| r.value.trim() == "gpu");
            let visible = (probe.env)("NVIDIA_VISIBLE_DEVICES").and_then(|v| v.into_string().ok());
            GpuCheck::default_for(asks_gpu, visible.as_deref())
        }
        Some((_, "warn")) => GpuCheck::Warn,
        Some((_, "off")) => GpuCheck::Off,
        Some((_, "require")) => GpuCheck::Require,
        Some((raw, _)) => return Err(bad(raw, "gpu-check", "expected off, warn or require")),
    })
}

/// `--straggler-threshold`, `--straggler-action`, `--straggler-interval`. `exclude` in a
/// fixed-size gang has nowhere to go (the gang cannot re-form without the node): it names the
/// rank as `warn` does, and says so at start.
fn straggler(
    low: &LowArgs,
    nnodes: NodeRange,
    warnings: &mut Vec<String>,
) -> Result<crate::watch::straggler::Settings, ConfigError> {
    use crate::watch::straggler::{Action, Settings};
    let mut settings = Settings::default();
    if let Some(raw) = get(low, "straggler-threshold") {
        settings.threshold = Settings::parse_threshold(&raw.value)
            .map_err(|why| bad(raw, "straggler-threshold", why))?;
    }
    if let Some(raw) = get(low, "straggler-action") {
        settings.action =
            Action::parse(&raw.value).map_err(|why| bad(raw, "straggler-action", why))?;
    }
    if let Some(interval) = parse_duration(low, "straggler-interval")? {
        if interval.is_zero() {
            let raw = get(low, "straggler-interval");
            return Err(match raw {
                Some(raw) => bad(
                    raw,
                    "straggler-interval",
                    "expected seconds above 0 (--straggler-threshold 0 turns the watch off)",
                ),
                None => ConfigError("--straggler-interval must be above 0".to_owned()),
            });
        }
        settings.interval = interval;
    }
    if settings.action == Action::Exclude
        && settings.threshold.is_some()
        && nnodes.min == nnodes.max
    {
        warnings.push(format!(
            "--straggler-action exclude needs --nnodes MIN:MAX (a gang that can re-form without a node); with --nnodes {} a slow node is named, not excluded",
            nnodes.max
        ));
    }
    Ok(settings)
}

/// `--network-check`, `--network-check-budget` and `--network-check-conf` (default: `warn`
/// when the job may span more than one node).
fn network_check(low: &LowArgs, max_nodes: u32) -> Result<crate::netcheck::Settings, ConfigError> {
    let mut settings = crate::netcheck::Settings::default_for(max_nodes);
    if let Some(raw) = get(low, "network-check") {
        settings.mode = crate::netcheck::Mode::parse(&raw.value)
            .ok_or_else(|| bad(raw, "network-check", "expected off, warn or require"))?;
    }
    if let Some(budget) = parse_duration(low, "network-check-budget")? {
        if budget.is_zero() {
            return Err(ConfigError(
                "invalid --network-check-budget `0`: the check needs some time (use --network-check off to skip it)"
                    .to_owned(),
            ));
        }
        settings.budget = budget;
    }
    if let Some(raw) = get(low, "network-check-conf") {
        settings
            .apply_conf(&raw.value)
            .map_err(|why| bad(raw, "network-check-conf", why))?;
    }
    Ok(settings)
}

/// What `--standalone` overrides. A multi-node `--nnodes` or a node rank other than 0 cannot
/// have been meant with a single private node (each pod would train alone, silently): a
/// configuration error. The rendezvous settings it replaces (`--rdzv-id`, `--rdzv-endpoint`, a
/// non-c10d `--rdzv-backend`, `--master-addr`, `--master-port`) are often injected for every
/// container (Kubeflow's `PET_*`), so those are warnings: torchrun's rule holds, out loud.
fn standalone_conflicts(low: &LowArgs, nnodes: NodeRange) -> Result<Vec<String>, ConfigError> {
    if nnodes.max > 1 {
        let raw = get(low, "nnodes").ok_or_else(|| ConfigError("--nnodes".into()))?;
        return Err(bad(
            raw,
            "nnodes",
            "--standalone runs a single node; drop --standalone for a multi-node job",
        ));
    }
    if let Some(raw) = get(low, "node-rank").filter(|r| r.value.trim() != "0") {
        return Err(bad(
            raw,
            "node-rank",
            "--standalone runs a single node, rank 0; drop --standalone for a multi-node job",
        ));
    }
    let replaced = |flag: &str, by: &str| {
        get(low, flag).map(|raw| {
            format!(
                "--standalone {by}: --{flag} `{}` ({}) is ignored",
                raw.value.trim(),
                raw.source
            )
        })
    };
    let backend = get(low, "rdzv-backend")
        .filter(|r| r.value.trim() != "c10d")
        .and(replaced("rdzv-backend", "uses the c10d backend"));
    Ok([
        replaced("rdzv-id", "draws a random run id"),
        replaced("rdzv-endpoint", "hosts a private store on a free port"),
        backend,
        replaced("master-addr", "hosts a private store on a free port"),
        replaced("master-port", "hosts a private store on a free port"),
    ]
    .into_iter()
    .flatten()
    .collect())
}

#[cfg(test)]
mod tests {
    use super::super::lowargs;
    use super::*;

    fn build_with(args: &[&str], env: &[(&str, &str)], gpus: u32) -> Result<Config, ConfigError> {
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let lookup = move |name: &str| -> Option<OsString> {
            env.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| OsString::from(v))
        };
        let low = lowargs::parse(&args, &lookup).map_err(|e| ConfigError(e.to_string()))?;
        let gpu = move || gpus;
        let probe = Probe {
            gpu_count: &gpu,
            cpu_count: &|| 6,
            env: &lookup,
            is_file: &|p: &Path| {
                ["train.py", "/usr/bin/python3", "/bin/true"].contains(&p.to_str().unwrap_or(""))
            },
        };
        build(&low, &probe)
    }

    const PATH: (&str, &str) = ("PATH", "/usr/bin:/bin");

    #[test]
    fn startup_timeout_defaults_to_five_minutes_and_zero_turns_it_off() {
        let limit = |args: &[&str]| {
            let mut all = args.to_vec();
            all.push("train.py");
            build_with(&all, &[PATH], 0).unwrap().hang.startup_timeout
        };
        assert_eq!(limit(&[]), Some(Duration::from_secs(300)));
        assert_eq!(limit(&["--startup-timeout", "0"]), None);
        assert_eq!(
            limit(&["--startup-timeout", "7"]),
            Some(Duration::from_secs(7))
        );
        assert!(build_with(&["--startup-timeout", "soon", "train.py"], &[PATH], 0).is_err());
    }

    #[test]
    fn standalone_defaults_like_torchrun() {
        let c = build_with(&["--nproc-per-node", "4", "train.py", "--x"], &[PATH], 0).unwrap();
        assert!(c.standalone);
        assert_eq!(c.run_id.len(), 36);
        assert_eq!(c.nproc_per_node, 4);
        assert_eq!(c.entrypoint.program, OsString::from("/usr/bin/python3"));
        assert_eq!(
            c.entrypoint.args,
            ["-u", "train.py", "--x"].map(OsString::from).to_vec()
        );
        let c = build_with(
            &["--master-port", "29500", "--rdzv-id", "job", "train.py"],
            &[PATH],
            0,
        )
        .unwrap();
        assert!(!c.standalone);
        assert_eq!(c.run_id, "job");
    }

    #[test]
    fn rdzv_id_survives_on_one_node_without_an_endpoint() {
        let c = build_with(&["--rdzv-id", "myjob", "train.py"], &[PATH], 0).unwrap();
        assert!(c.standalone);
        assert_eq!(c.run_id, "myjob");
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let c = build_with(&["train.py"], &[PATH, ("PET_RDZV_ID", "envjob")], 0).unwrap();
        assert_eq!(c.run_id, "envjob");
        // --standalone draws a fresh one, and says that it ignores the given id.
        let c = build_with(
            &["--standalone", "--rdzv-id", "myjob", "train.py"],
            &[PATH],
            0,
        )
        .unwrap();
        assert_eq!(c.run_id.len(), 36);
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        assert!(
            c.warnings[0].contains("--rdzv-id `myjob` (command line) is ignored"),
            "{:?}",
            c.warnings
        );
    }

    #[test]
    fn standalone_conflicts_are_errors_or_warnings() {
        let err =
            build_with(&["--standalone", "--nnodes", "2", "train.py"], &[PATH], 0).unwrap_err();
        assert!(
            err.0.contains("--nnodes `2` (command line)") && err.0.contains("--standalone"),
            "{err}"
        );
        let err = build_with(
            &["--standalone", "--node-rank", "1", "train.py"],
            &[PATH],
            0,
        )
        .unwrap_err();
        assert!(err.0.contains("--node-rank `1`"), "{err}");
        let err = build_with(
            &["--standalone", "train.py"],
            &[PATH, ("PET_NNODES", "2")],
            0,
        )
        .unwrap_err();
        assert!(err.0.contains("environment variable PET_NNODES"), "{err}");
        // Rank 0 of one node, and rendezvous settings it replaces: it runs, with one warning each.
        let c = build_with(
            &[
                "--standalone",
                "--node-rank",
                "0",
                "--nnodes",
                "1",
                "--rdzv-endpoint",
                "10.0.0.1:29400",
                "--rdzv-backend",
                "c10d",
                "--master-port",
                "29500",
                "train.py",
            ],
            &[PATH],
            0,
        )
        .unwrap();
        assert_eq!(c.rdzv_endpoint, "localhost:0");
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(c.warnings[0].contains("--rdzv-endpoint `10.0.0.1:29400`"));
        assert!(c.warnings[1].contains("--master-port `29500`"));
        let c = build_with(&["--standalone", "train.py"], &[PATH], 0).unwrap();
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn python_exec_module_and_no_python() {
        let c = build_with(
            &["-m", "pkg.train"],
            &[PATH, ("PYTHON_EXEC", "/venv/py")],
            0,
        )
        .unwrap();
        assert_eq!(c.entrypoint.program, OsString::from("/venv/py"));
        assert_eq!(
            c.entrypoint.args,
            ["-u", "-m", "pkg.train"].map(OsString::from).to_vec()
        );
        let c = build_with(&["--no-python", "true", "a"], &[PATH], 0).unwrap();
        assert_eq!(c.entrypoint.program, OsString::from("true"));
        assert_eq!(c.entrypoint.args, vec![OsString::from("a")]);
    }

    #[test]
    fn nproc_variants() {
        let (no_gpu, two_gpus, six_cpus) = (&|| 0, &|| 2, &|| 6);
        assert_eq!(parse_nproc("auto", no_gpu, six_cpus), Ok(6));
        assert_eq!(parse_nproc("auto", two_gpus, six_cpus), Ok(2));
        assert_eq!(parse_nproc("cpu", two_gpus, six_cpus), Ok(6));
        assert!(parse_nproc("gpu", no_gpu, six_cpus)
            .unwrap_err()
            .contains("no GPU"));
        assert!(parse_nproc("0", no_gpu, six_cpus).is_err());
        // A count asks the machine nothing.
        let unasked = &|| -> u32 { panic!("a count needs no probe") };
        assert_eq!(parse_nproc(" 4 ", unasked, unasked), Ok(4));
        let err = build_with(&["--nproc-per-node", "gpu", "train.py"], &[PATH], 0).unwrap_err();
        assert!(
            err.0.contains("--nproc-per-node `gpu` (command line)"),
            "{err}"
        );
        assert_eq!(
            build_with(&["--nproc_per_node=gpu", "train.py"], &[PATH], 3)
                .unwrap()
                .nproc_per_node,
            3
        );
    }

    #[test]
    fn node_unit_must_divide_both_ends_of_nnodes() {
        let c = build_with(
            &["--nnodes", "2:4", "--node-unit", "2", "train.py"],
            &[PATH],
            0,
        )
        .unwrap();
        assert_eq!(c.node_unit, 2);
        let err = build_with(
            &["--nnodes", "2:5", "--node-unit", "2", "train.py"],
            &[PATH],
            0,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with(
                "invalid --node-unit `2` (command line): --nnodes 2:5 must be multiples of it"
            ),
            "{err}"
        );
        assert_eq!(build_with(&["train.py"], &[PATH], 0).unwrap().node_unit, 1);
    }

    #[test]
    fn bad_input_is_one_clear_line() {
        let err = build_with(&["missing.py"], &[PATH], 0).unwrap_err();
        assert_eq!(err.0, "training script not found: missing.py");
        let err = build_with(&["--run-path", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("--run-path is not supported"));
        let err = build_with(&["train.py"], &[PATH, ("PET_NNODES", "x")], 0).unwrap_err();
        assert!(err.0.contains("environment variable PET_NNODES"), "{err}");
        let err = build_with(&[], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("missing the training script"));
        let err = build_with(&["--log-format", "xml", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("--log-format"));
    }

    #[test]
    fn progress_interval_and_log_dir_origin() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.logs.progress_interval, Duration::from_secs(10));
        assert_eq!(c.logs.log_dir, None);
        let c = build_with(
            &["--progress-interval", "0", "--log-dir", "/l", "train.py"],
            &[PATH],
            0,
        )
        .unwrap();
        assert_eq!(c.logs.progress_interval, Duration::ZERO);
        assert_eq!(c.logs.log_dir_origin, "command line");
        let c = build_with(
            &["train.py"],
            &[
                PATH,
                ("MUSTER_PROGRESS_INTERVAL", "2.5"),
                ("MUSTER_LOG_DIR", "/l"),
            ],
            0,
        )
        .unwrap();
        assert_eq!(c.logs.progress_interval, Duration::from_millis(2500));
        assert_eq!(c.logs.log_dir_origin, "environment variable MUSTER_LOG_DIR");
        let err = build_with(&["--progress_interval=-1", "train.py"], &[PATH], 0).unwrap_err();
        assert!(
            err.0
                .contains("invalid --progress-interval `-1` (command line)"),
            "{err}"
        );
    }

    #[test]
    fn stream_specs_and_ranges() {
        assert_eq!(parse_stream_spec("3").unwrap().for_rank(5), Streams(3));
        let s = parse_stream_spec("0:1,1:2").unwrap();
        assert_eq!(s.for_rank(0), Streams::STDOUT);
        assert_eq!(s.for_rank(1), Streams::STDERR);
        assert_eq!(s.for_rank(2), Streams::NONE);
        assert!(parse_stream_spec("4").is_err());
        assert_eq!(parse_nnodes("2:4"), Ok(NodeRange { min: 2, max: 4 }));
        assert!(parse_nnodes("3:2").is_err());
        assert!(parse_nnodes("0").is_err());
    }

    #[test]
    fn signals_policy() {
        let p = parse_signals("SIGTERM,USR1:forward,SIGUSR2:ignore").unwrap();
        assert!(p
            .actions
            .contains(&(Signal::SIGUSR1, SignalAction::Forward)));
        assert!(p.actions.contains(&(Signal::SIGUSR2, SignalAction::Ignore)));
        assert!(p
            .actions
            .contains(&(Signal::SIGINT, SignalAction::Terminate)));
        assert_eq!(p.raw, "SIGTERM,USR1:forward,SIGUSR2:ignore");
        assert!(parse_signals("SIGKILL").is_err());
        assert!(parse_signals("SIGTERM:explode").is_err());
    }

    #[test]
    fn a_preempted_pod_exits_200_unless_asked_for_0() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert_eq!(
            c.preempted_exit_code,
            crate::exit_code::PREEMPTED_CHECKPOINTED
        );
        let c = build_with(
            &["train.py"],
            &[PATH, ("MUSTER_PREEMPTED_EXIT_CODE", "0")],
            0,
        )
        .unwrap();
        assert_eq!(c.preempted_exit_code, 0);
        let c = build_with(&["--preempted-exit-code", "7", "train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.preempted_exit_code, 7);
        assert!(build_with(&["--preempted-exit-code", "256", "train.py"], &[PATH], 0).is_err());
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(parse_seconds("3s"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_seconds("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_seconds("-1").is_err());
    }

    #[test]
    fn tmp_dir_from_the_flag_or_muster_tmp_dir() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.tmp_dir, None);
        let c = build_with(&["--tmp-dir", "/scratch", "train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.tmp_dir, Some(PathBuf::from("/scratch")));
        let c = build_with(&["train.py"], &[PATH, ("MUSTER_TMP_DIR", "/e")], 0).unwrap();
        assert_eq!(c.tmp_dir, Some(PathBuf::from("/e")));
    }

    #[test]
    fn uuid_shape() {
        let id = random_run_id();
        assert_eq!(id.as_bytes()[14], b'4');
        assert_ne!(id, random_run_id());
    }

    #[test]
    fn checkpoint_token_file_from_flag_or_env() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.checkpoint_token_file, None);
        let c = build_with(
            &["--checkpoint-token-file", "/secrets/token", "train.py"],
            &[PATH],
            0,
        )
        .unwrap();
        assert_eq!(
            c.checkpoint_token_file,
            Some(PathBuf::from("/secrets/token"))
        );
        let c = build_with(
            &["train.py"],
            &[PATH, ("MUSTER_CHECKPOINT_TOKEN_FILE", "/s/t")],
            0,
        )
        .unwrap();
        assert_eq!(c.checkpoint_token_file, Some(PathBuf::from("/s/t")));
    }

    #[test]
    fn framework_callbacks_default_on_and_turn_off_from_flag_or_env() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert!(c.framework_callbacks);
        let c = build_with(&["--framework-callbacks", "off", "train.py"], &[PATH], 0).unwrap();
        assert!(!c.framework_callbacks);
        let c = build_with(
            &["train.py"],
            &[PATH, ("MUSTER_FRAMEWORK_CALLBACKS", "0")],
            0,
        )
        .unwrap();
        assert!(!c.framework_callbacks);
        let err = build_with(&["--framework-callbacks", "maybe", "train.py"], &[PATH], 0);
        assert!(err.is_err());
    }

    #[test]
    fn keep_strays_and_the_gpu_release_timeout() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert!(!c.keep_strays);
        assert_eq!(c.gpu_release_timeout, Duration::from_secs(60));
        let c = build_with(
            &["--keep-strays", "--gpu-release-timeout", "2.5", "train.py"],
            &[PATH],
            0,
        )
        .unwrap();
        assert!(c.keep_strays);
        assert_eq!(c.gpu_release_timeout, Duration::from_millis(2500));
        let c = build_with(
            &["train.py"],
            &[
                PATH,
                ("MUSTER_KEEP_STRAYS", "yes"),
                ("MUSTER_GPU_RELEASE_TIMEOUT", "0"),
            ],
            0,
        )
        .unwrap();
        assert!(c.keep_strays);
        assert!(c.gpu_release_timeout.is_zero());
        let err =
            build_with(&["--gpu-release-timeout", "soon", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("--gpu-release-timeout"), "{err}");
    }

    #[test]
    fn the_straggler_flags() {
        use crate::watch::straggler::{Action, DEFAULT_INTERVAL, DEFAULT_THRESHOLD};
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.straggler.threshold, Some(DEFAULT_THRESHOLD));
        assert_eq!(c.straggler.action, Action::Warn);
        assert_eq!(c.straggler.interval, DEFAULT_INTERVAL);
        let c = build_with(
            &[
                "--nnodes",
                "2:3",
                "--straggler-threshold",
                "2",
                "--straggler-action",
                "exclude",
                "train.py",
            ],
            &[PATH, ("MUSTER_STRAGGLER_INTERVAL", "0.5")],
            0,
        )
        .unwrap();
        assert_eq!(c.straggler.threshold, Some(2.0));
        assert_eq!(c.straggler.action, Action::Exclude);
        assert_eq!(c.straggler.interval, Duration::from_millis(500));
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        // A fixed gang cannot re-form without the node: named, not excluded, and said so.
        let c = build_with(
            &["--nnodes", "3", "--straggler-action", "exclude", "train.py"],
            &[PATH],
            0,
        )
        .unwrap();
        assert!(
            c.warnings[0].contains("--straggler-action exclude needs --nnodes MIN:MAX"),
            "{:?}",
            c.warnings
        );
        let c = build_with(&["--straggler-threshold", "0", "train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.straggler.threshold, None);
        for bad in [
            &["--straggler-threshold", "0.9", "train.py"][..],
            &["--straggler-action", "kill", "train.py"][..],
            &["--straggler-interval", "0", "train.py"][..],
        ] {
            let err = build_with(bad, &[PATH], 0).unwrap_err();
            assert!(err.0.contains(bad[0]), "{err}");
        }
    }

    #[test]
    fn snapshots_are_off_unless_a_step_count_is_given() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert_eq!((c.snapshot_every, c.snapshot_memory), (None, None));
        let c = build_with(&["--snapshot-every", "0", "train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.snapshot_every, None);
        let c = build_with(
            &[
                "--snapshot-every",
                "5",
                "--snapshot-memory",
                "2GiB",
                "train.py",
            ],
            &[PATH],
            0,
        )
        .unwrap();
        assert_eq!(
            (c.snapshot_every, c.snapshot_memory),
            (Some(5), Some(2 << 30))
        );
        let err = build_with(&["--snapshot-every", "-1", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("--snapshot-every"), "{err}");
        let err = build_with(&["--snapshot-memory", "lots", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("--snapshot-memory"), "{err}");
        let c = build_with(
            &[
                "--snapshot-every",
                "5",
                "--snapshot-persist",
                "/ckpt/snap",
                "train.py",
            ],
            &[PATH],
            0,
        )
        .unwrap();
        assert_eq!(c.snapshot_persist, Some(PathBuf::from("/ckpt/snap")));
        assert_eq!(c.snapshot_persist_every, None);
        let with = |extra: &[&str]| {
            let mut args = vec!["--snapshot-every", "5", "--snapshot-persist", "/ckpt/snap"];
            args.extend_from_slice(extra);
            args.push("train.py");
            build_with(&args, &[PATH], 0)
        };
        assert_eq!(
            with(&["--snapshot-persist-every", "50"])
                .unwrap()
                .snapshot_persist_every,
            Some(50)
        );
        for wrong in ["7", "0", "x"] {
            let err = with(&["--snapshot-persist-every", wrong]).unwrap_err();
            assert!(err.0.contains("--snapshot-persist-every"), "{err}");
        }
        let err = build_with(
            &["--snapshot-persist", "/ckpt/snap", "train.py"],
            &[PATH],
            0,
        )
        .unwrap_err();
        assert!(err.0.contains("--snapshot-every"), "{err}");
    }

    #[test]
    fn warm_restart_is_on_unless_switched_off() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert!(c.warm_restart);
        let c = build_with(&["--warm-restart", "off", "train.py"], &[PATH], 0).unwrap();
        assert!(!c.warm_restart);
        let c = build_with(&["train.py"], &[PATH, ("MUSTER_WARM_RESTART", "0")], 0).unwrap();
        assert!(!c.warm_restart);
        let c = build_with(&["train.py"], &[PATH, ("PET_WARM_RESTART", "off")], 0).unwrap();
        assert!(!c.warm_restart);
        let err = build_with(&["--warm-restart", "maybe", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("--warm-restart"), "{err}");
    }

    #[test]
    fn auto_step_reports_are_on_unless_switched_off() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert!(c.auto_step_reports);
        let c = build_with(&["--auto-step-reports", "off", "train.py"], &[PATH], 0).unwrap();
        assert!(!c.auto_step_reports);
        let c = build_with(
            &["train.py"],
            &[PATH, ("MUSTER_AUTO_STEP_REPORTS", "false")],
            0,
        )
        .unwrap();
        assert!(!c.auto_step_reports);
        let c = build_with(
            &["--auto-step-reports=on", "train.py"],
            &[PATH, ("MUSTER_AUTO_STEP_REPORTS", "0")],
            0,
        )
        .unwrap();
        assert!(c.auto_step_reports, "the command line wins");
        let err =
            build_with(&["--auto-step-reports", "maybe", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("--auto-step-reports"), "{err}");
    }

    #[test]
    fn the_gpu_watch_interval() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.gpu_watch_interval, Duration::from_secs(10));
        let c = build_with(&["--gpu-watch-interval", "0.5", "train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.gpu_watch_interval, Duration::from_millis(500));
        let c = build_with(
            &["train.py"],
            &[PATH, ("MUSTER_GPU_WATCH_INTERVAL", "0")],
            0,
        )
        .unwrap();
        assert!(c.gpu_watch_interval.is_zero());
        let err =
            build_with(&["--gpu-watch-interval", "often", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.0.contains("--gpu-watch-interval"), "{err}");
    }

    #[test]
    fn max_store_bytes_from_flag_or_env_with_units() {
        let c = build_with(&["train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.max_store_bytes, 1 << 30);
        let c = build_with(&["--max-store-bytes", "256MiB", "train.py"], &[PATH], 0).unwrap();
        assert_eq!(c.max_store_bytes, 256 << 20);
        let c = build_with(
            &["train.py"],
            &[PATH, ("MUSTER_MAX_STORE_BYTES", "4096")],
            0,
        )
        .unwrap();
        assert_eq!(c.max_store_bytes, 4096);
        let err = build_with(&["--max-store-bytes", "1GB", "train.py"], &[PATH], 0).unwrap_err();
        assert!(err.to_string().contains("--max-store-bytes"), "{err}");
    }
}
