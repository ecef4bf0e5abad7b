//! Slurm as a source of the job's shape, below the command line, `MUSTER_*` and `PET_*`: in a
//! Slurm step (`srun muster ...`: `SLURM_JOB_ID`, `SLURM_NODEID` and a step id set) the node
//! count, this node's rank, the rendezvous (c10d on the step's first node, `MASTER_PORT` or port
//! 29400) and the run id (`<job>.<step>`) come from Slurm wherever nothing above gave them, so
//! `srun -N2 --ntasks-per-node=1 muster --nproc-per-node 2 train.py` is one gang of four.
//!
//! [`apply`] is a pure function of the raw parse, the environment and two look-ups (DNS and the
//! text of `slurm.conf`), so every rule has a unit test; [`crate::cli`] runs it before
//! validation, and the launch logs its one-line account of where each value came from.
//!
//! One agent per node is the supported form: muster starts the node's ranks itself, so a step
//! with more than one task on a node (`srun --ntasks-per-node=4`) would start that many gangs'
//! worth of agents; that is a configuration error naming `srun --ntasks-per-node=1`.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::cli::lowargs::{LowArgs, RawValue, Source};
use crate::slurm::{conf, hostlist};

use crate::slurm::DEFAULT_PORT;

/// What the rest of the launch needs to know about the Slurm step it runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// One line saying where each value of the job's shape came from (logged at INFO).
    pub summary: String,
    /// GPUs Slurm gave this step on this node (`--nproc-per-node gpu|auto`), and from where.
    pub gpus: Option<(u32, &'static str)>,
}

/// A Slurm step never restarts a lost task, and its preemption and `scancel` signal every
/// process of the step.
impl crate::cli::scheduler::Scheduler for Applied {
    fn behaviour(&self) -> crate::cli::scheduler::Behaviour {
        crate::cli::scheduler::Behaviour {
            name: "slurm",
            summary: Some(self.summary.clone()),
            replaces_lost_nodes: false,
            signals_every_process: true,
            node_index: None,
        }
    }

    fn gpus(&self) -> Option<u32> {
        self.gpus.map(|(n, _)| n)
    }
}

/// Why the Slurm environment cannot be used: a configuration error (exit 202).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlurmError {
    #[error("Slurm started {tasks} tasks on this node ({var}={value}): muster is one agent per node that starts the node's ranks itself; launch it with `srun --ntasks-per-node=1 muster --nproc-per-node N ...`")]
    TasksPerNode {
        tasks: u32,
        var: &'static str,
        value: String,
    },
    #[error("Slurm: {var}=`{value}` is not {what}")]
    Bad {
        var: &'static str,
        value: String,
        what: &'static str,
    },
    #[error("Slurm: {0}")]
    Hostlist(#[from] hostlist::HostlistError),
}

/// The outside world [`apply`] asks: whether DNS knows a name, and the text of a file.
pub struct Lookup<'a> {
    pub resolves: &'a dyn Fn(&str) -> bool,
    pub read: &'a dyn Fn(&std::path::Path) -> Option<String>,
}

impl Lookup<'static> {
    /// The system's resolver (`getaddrinfo`: `/etc/hosts`, DNS, whatever NSS is set up with; one
    /// try, since a node name either is known or is not) and the file system.
    pub fn system() -> Self {
        Self {
            resolves: &system_resolves,
            read: &system_read,
        }
    }
}

fn system_resolves(name: &str) -> bool {
    use std::net::ToSocketAddrs as _;
    (name, 0)
        .to_socket_addrs()
        .is_ok_and(|mut a| a.next().is_some())
}

fn system_read(path: &std::path::Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

type Env<'a> = &'a dyn Fn(&str) -> Option<OsString>;

fn var(env: Env<'_>, name: &str) -> Option<String> {
    env(name)
        .map(|v| v.to_string_lossy().trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// The first of `names` that is set, with its name.
fn first_var(env: Env<'_>, names: &[&'static str]) -> Option<(&'static str, String)> {
    names
        .iter()
        .find_map(|&name| var(env, name).map(|v| (name, v)))
}

fn number(env: Env<'_>, names: &[&'static str]) -> Result<Option<(&'static str, u32)>, SlurmError> {
    first_var(env, names)
        .map(|(var, value)| {
            value
                .parse::<u32>()
                .map(|n| (var, n))
                .map_err(|_| SlurmError::Bad {
                    var,
                    value,
                    what: "a number",
                })
        })
        .transpose()
}

/// The most tasks on any node of `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`, `1(x2)`, `4`).
fn max_tasks_per_node(value: &str) -> Option<u32> {
    value
        .split(',')
        .map(|part| {
            part.split('(')
                .next()
                .unwrap_or_default()
                .trim()
                .parse::<u32>()
        })
        .try_fold(0, |most, n| n.ok().map(|n| most.max(n)))
}

/// GPUs Slurm gave the step on this node: `SLURM_STEP_GPUS` (a list of indices), else
/// `SLURM_GPUS_ON_NODE` (a count), else `SLURM_JOB_GPUS`, else `CUDA_VISIBLE_DEVICES` (which
/// Slurm's GPU plugin sets). `None` when the step asked for no GPUs.
fn gpus(env: Env<'_>) -> Option<(u32, &'static str)> {
    let count = |list: &str| list.split(',').filter(|s| !s.trim().is_empty()).count();
    for name in [
        "SLURM_STEP_GPUS",
        "SLURM_GPUS_ON_NODE",
        "SLURM_JOB_GPUS",
        "CUDA_VISIBLE_DEVICES",
    ] {
        let Some(value) = var(env, name) else {
            continue;
        };
        let n = if name == "SLURM_GPUS_ON_NODE" {
            value.parse::<u32>().ok()
        } else {
            u32::try_from(count(&value)).ok()
        };
        if let Some(n) = n.filter(|&n| n > 0) {
            return Some((n, name));
        }
    }
    None
}

fn slurm_value(value: String, var: &str) -> RawValue {
    RawValue {
        value,
        source: Source::Slurm(var.to_owned()),
    }
}

/// Fills the job's shape from Slurm into `low` wherever nothing above gave it; `None` outside a
/// Slurm step (or with `--standalone`, which keeps its meaning: one private node).
pub fn apply(
    low: &mut LowArgs,
    env: Env<'_>,
    lookup: &Lookup<'_>,
) -> Result<Option<Applied>, SlurmError> {
    let (Some(job), Some(node_id)) = (var(env, "SLURM_JOB_ID"), var(env, "SLURM_NODEID")) else {
        return Ok(None);
    };
    if low.values.get("standalone").is_some_and(|v| v.value == "1") {
        return Ok(Some(Applied {
            summary: format!("Slurm job {job}: --standalone, so this node runs alone and nothing is taken from Slurm"),
            gpus: gpus(env),
        }));
    }
    let Some((_, step)) = first_var(env, &["SLURM_STEP_ID", "SLURM_STEPID"]) else {
        // The batch script itself (no step): only the first node runs it.
        let nodes = number(env, &["SLURM_JOB_NUM_NODES", "SLURM_NNODES"])?.map_or(1, |(_, n)| n);
        let summary = if nodes > 1 {
            format!("Slurm job {job}: muster runs in the batch script, which Slurm starts on the first of the job's {nodes} nodes only: nothing is taken from Slurm; start it with `srun --ntasks-per-node=1 muster ...` to use every node")
        } else {
            format!("Slurm job {job}: in the batch script, one node; nothing is taken from Slurm")
        };
        return Ok(Some(Applied {
            summary,
            gpus: gpus(env),
        }));
    };
    if let Some(value) = var(env, "SLURM_STEP_TASKS_PER_NODE") {
        let tasks = max_tasks_per_node(&value).ok_or_else(|| SlurmError::Bad {
            var: "SLURM_STEP_TASKS_PER_NODE",
            value: value.clone(),
            what: "a tasks-per-node list such as 1(x2)",
        })?;
        if tasks > 1 {
            return Err(SlurmError::TasksPerNode {
                tasks,
                var: "SLURM_STEP_TASKS_PER_NODE",
                value,
            });
        }
    }
    if let Some((var, local)) = number(env, &["SLURM_LOCALID"])?.filter(|&(_, n)| n > 0) {
        return Err(SlurmError::TasksPerNode {
            tasks: local + 1,
            var,
            value: local.to_string(),
        });
    }
    let (nnodes_var, nnodes) = number(
        env,
        &[
            "SLURM_STEP_NUM_NODES",
            "SLURM_JOB_NUM_NODES",
            "SLURM_NNODES",
        ],
    )?
    .unwrap_or(("SLURM_NNODES", 1));
    let node_rank: u32 = node_id.parse().map_err(|_| SlurmError::Bad {
        var: "SLURM_NODEID",
        value: node_id.clone(),
        what: "a number",
    })?;
    let mut fill = |key: &'static str, value: String, var: &str| {
        low.values
            .entry(key)
            .or_insert_with(|| slurm_value(value, var));
    };
    fill("nnodes", nnodes.to_string(), nnodes_var);
    fill("node-rank", node_rank.to_string(), "SLURM_NODEID");
    fill(
        "rdzv-id",
        format!("{job}.{step}"),
        "SLURM_JOB_ID.SLURM_STEP_ID",
    );
    // The rendezvous is taken as a whole or not at all: a user who names any part of it (a
    // backend, an endpoint, a static master) has chosen it.
    let user_rdzv = [
        "rdzv-backend",
        "rdzv-endpoint",
        "master-addr",
        "master-port",
    ]
    .iter()
    .any(|k| low.values.contains_key(k));
    let mut endpoint_note = String::new();
    // One node needs no shared endpoint: it stays standalone on a free port, so one-node jobs
    // that share a machine never fight over 29400.
    if !user_rdzv && nnodes > 1 {
        let (host, note) = rendezvous_host(env, lookup)?;
        let (port, port_from) = match first_var(env, &["MASTER_PORT"]) {
            Some((_, p)) => (
                p.parse::<u16>().map_err(|_| SlurmError::Bad {
                    var: "MASTER_PORT",
                    value: p.clone(),
                    what: "a port number",
                })?,
                "MASTER_PORT",
            ),
            None => (DEFAULT_PORT, "the c10d default"),
        };
        let endpoint = crate::discovery::Endpoint { host, port };
        low.values.insert(
            "rdzv-backend",
            slurm_value("c10d".into(), "a multi-node step"),
        );
        endpoint_note = format!("{note}; port from {port_from}");
        low.values.insert(
            "rdzv-endpoint",
            slurm_value(endpoint.to_string(), "the step's first node"),
        );
    }
    let gpus = gpus(env);
    let mut parts = Vec::new();
    for key in [
        "nnodes",
        "node-rank",
        "rdzv-backend",
        "rdzv-endpoint",
        "rdzv-id",
    ] {
        let Some(raw) = low.values.get(key) else {
            continue;
        };
        let from = match (&raw.source, key) {
            (Source::Slurm(_), "rdzv-endpoint") => endpoint_note.clone(),
            (source, _) => source.to_string(),
        };
        parts.push(format!("--{key} {} ({from})", raw.value));
    }
    if let Some((n, from)) = gpus {
        parts.push(format!("{n} GPU(s) for gpu|auto ({from})"));
    }
    let node = var(env, "SLURMD_NODENAME").unwrap_or_else(|| format!("node {node_rank}"));
    Ok(Some(Applied {
        summary: format!(
            "Slurm job {job} step {step} on {node}: {}",
            parts.join(", ")
        ),
        gpus,
    }))
}

/// The rendezvous host: `MASTER_ADDR` when the user exported one (the habit of torchrun sbatch
/// scripts), else the step's first node: its name where DNS knows it, else Slurm's own address
/// for it (`slurm.conf`). Returns the host and a note on where it came from.
fn rendezvous_host(env: Env<'_>, lookup: &Lookup<'_>) -> Result<(String, String), SlurmError> {
    if let Some(addr) = var(env, "MASTER_ADDR") {
        return Ok((addr, "host from MASTER_ADDR".to_owned()));
    }
    let (list_var, list) = first_var(
        env,
        &[
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ],
    )
    .ok_or_else(|| SlurmError::Bad {
        var: "SLURM_JOB_NODELIST",
        value: String::new(),
        what: "set (the step's nodes)",
    })?;
    let first = hostlist::first(&list)?;
    if (lookup.resolves)(&first) {
        return Ok((
            first.clone(),
            format!("{first}, the first node of {list_var}, by DNS"),
        ));
    }
    let conf_path =
        var(env, "SLURM_CONF").map_or_else(|| PathBuf::from(conf::DEFAULT_PATH), PathBuf::from);
    match (lookup.read)(&conf_path).and_then(|text| conf::node_addr(&text, &first)) {
        Some(addr) => Ok((
            addr,
            format!(
                "{first}, the first node of {list_var}, which DNS does not know: its NodeAddr in {}",
                conf_path.display()
            ),
        )),
        // Discovery will keep trying the name until the join timeout, and say so.
        None => Ok((
            first.clone(),
            format!(
                "{first}, the first node of {list_var}; DNS does not know it and {} gives no NodeAddr for it: export MASTER_ADDR",
                conf_path.display()
            ),
        )),
    }
}

#[cfg(test)]
mod tests;
