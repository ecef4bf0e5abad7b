//! The raw parse of the launch form: torchrun's flags in both spellings, then the `MUSTER_*` and
//! `PET_*` environment, with no interpretation of the values yet (that is [`super::hiargs`]).
//!
//! A small hand-written layer instead of clap because torchrun's contract is argparse's, not
//! clap's: every long flag has an underscore twin (`--nproc_per_node`), the first positional
//! argument ends option parsing (everything after the script belongs to the script, even
//! `--help`), and every flag has an environment twin with an empty value meaning "unset"
//! (torchrun itself crashes on `PET_STANDALONE=""`). The flag table below is also the source of
//! `muster --help`, so the two cannot drift apart.

use std::collections::BTreeMap;
use std::ffi::OsString;

/// Whether a flag takes a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `--standalone`; from the environment `1/0/true/false/yes/no/on/off`.
    Switch,
    /// `--nnodes 2`, `--nnodes=2`, `-r 3`, `-r3`.
    Value,
}

/// One flag of the launch form.
#[derive(Debug)]
pub struct FlagDef {
    /// The long name in its dash spelling, without `--`.
    pub name: &'static str,
    pub short: Option<char>,
    pub kind: Kind,
    /// Placeholder shown in `--help`.
    pub value_name: &'static str,
    pub help: &'static str,
    /// A legacy torch variable read after `MUSTER_*` and `PET_*` (torchrun honours these).
    pub torch_env: Option<&'static str>,
}

const fn value(name: &'static str, value_name: &'static str, help: &'static str) -> FlagDef {
    FlagDef {
        name,
        short: None,
        kind: Kind::Value,
        value_name,
        help,
        torch_env: None,
    }
}

const fn switch(name: &'static str, help: &'static str) -> FlagDef {
    FlagDef {
        name,
        short: None,
        kind: Kind::Switch,
        value_name: "",
        help,
        torch_env: None,
    }
}

/// Every flag of the launch form, in `--help` order.
pub const FLAGS: &[FlagDef] = &[
    value(
        "nnodes",
        "N|MIN:MAX",
        "Number of nodes, or an elastic range (default 1)",
    ),
    value(
        "nproc-per-node",
        "N|gpu|cpu|auto",
        "Workers on this node: a number, one per GPU (`gpu`), one per CPU (`cpu`), or GPUs if any else CPUs (`auto`) (default 1)",
    ),
    value("node-rank", "RANK", "Rank of this node (static rendezvous) (default 0)"),
    value("rdzv-backend", "NAME", "Rendezvous backend: static or c10d (default static)"),
    value("rdzv-endpoint", "HOST[:PORT]", "Rendezvous endpoint"),
    value("rdzv-id", "ID", "Job id shared by all nodes (default `none`; random with --standalone, which ignores this flag with a warning, and on one node with no endpoint when not given)"),
    value("rdzv-conf", "K=V,...", "Rendezvous settings (join_timeout, last_call_timeout, ...)"),
    switch("standalone", "Single node with a private store on a free port and a random run id (with --nnodes above 1 or --node-rank other than 0: error 202)"),
    value("max-restarts", "N", "Restarts of the local worker group after a failure (default 0)"),
    value("node-unit", "K", "Every gang's node count is a multiple of K (a model sharded over K nodes); with --nnodes MIN:MAX both must be multiples of K, and nodes beyond the largest multiple wait as spares (default 1)"),
    value("max-no-progress-restarts", "N", "Crash-loop guard: after N restarts in a row whose attempts made no progress (no step beyond the previous attempt's last reported step), stop with exit 209 naming the repeated failure, whatever --max-restarts has left; 0: off (default 3)"),
    value("monitor-interval", "SECS", "Accepted for torchrun compatibility; worker exits are events here"),
    value("start-method", "METHOD", "Accepted for torchrun compatibility; scripts are always exec'd"),
    value("role", "NAME", "Role name of the workers (ROLE_NAME, log prefix) (default `default`)"),
    FlagDef {
        short: Some('m'),
        ..switch("module", "Run the entry point as `python -u -m MODULE`")
    },
    switch("no-python", "Exec the entry point directly instead of through Python"),
    switch("run-path", "Not supported: muster never runs training code in its own process"),
    value("log-dir", "DIR", "Root of the per-attempt, per-rank log files (torchrun's layout)"),
    FlagDef {
        short: Some('r'),
        ..value("redirects", "STD|RANK:STD,...", "Send streams to files instead of the console: 1=stdout 2=stderr 3=both, for all ranks or per local rank")
    },
    FlagDef {
        short: Some('t'),
        ..value("tee", "STD|RANK:STD,...", "Send streams to files and the console (same format as --redirects)")
    },
    value("local-ranks-filter", "R,R,...", "Only these local ranks reach the console (files keep everything)"),
    FlagDef {
        torch_env: Some("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        ..value("log-line-prefix-template", "TEMPLATE", "Prefix of every worker line; macros ${hostname} ${rank} ${local_rank} ${role_name} (default `[${hostname}:${rank}] `)")
    },
    value("master-addr", "ADDR", "Static rendezvous: address of node 0 (default 127.0.0.1)"),
    value("master-port", "PORT", "Static rendezvous: port of node 0 (default 29500)"),
    value("local-addr", "ADDR", "Address this node advertises (MASTER_ADDR when it hosts the store)"),
    FlagDef {
        torch_env: Some("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
        ..value("shutdown-timeout", "SECS", "Grace between the stop signal and SIGKILL (default 30)")
    },
    value("signals-to-handle", "SIG[:ACTION],...", "Signals the agent handles; ACTION is checkpoint (SIGTERM's default: a gang-wide checkpoint barrier, then stop), terminate (the others' default), forward or ignore (default SIGTERM,SIGINT,SIGHUP,SIGQUIT)"),
    value("log-format", "text|json", "Worker lines as prefixed text or one JSON object per line (default text)"),
    value("metrics-addr", "ADDR:PORT", "Metrics and probes endpoint: IP:PORT, :PORT or none (default 0.0.0.0:8000)"),
    value("gpu-check", "off|warn|require", "GPU pre-flight before the workers start (default: require when the job asks for GPUs, by --nproc-per-node gpu or NVIDIA_VISIBLE_DEVICES, else off)"),
    value("grace-period", "SECS", "Preemption budget: the pod's terminationGracePeriodSeconds"),
    value("numa-binding", "node", "Pin each local rank to the CPUs of its GPU's NUMA node (GPUs in PCI bus order)"),
    value("preempted-exit-code", "CODE", "Exit code after a committed preemption checkpoint (default 200). WARNING: with 0 a preempted pod is Succeeded, which a Job, JobSet, PyTorchJob or Volcano Job counts as finished work: the job can end Complete with training unfinished"),
    value("checkpoint-token-file", "PATH", "A file (a mounted Secret) holding a bearer token that lets a non-loopback caller POST /checkpoint; without it only loopback may"),
    value("progress-interval", "SECS", "At most one progress-bar update (a `\\r`-terminated segment) per rank and stream this often; 0 writes every update (default 10)"),
    value("tmp-dir", "DIR", "Where muster writes its own files (checkpoint helper, error files) (default: first writable of $TMPDIR, /tmp, /dev/shm; none: do without)"),
    switch("keep-strays", "Let processes the workers started (in their own session or not) outlive the attempt; by default the attempt's whole process tree is stopped with it"),
    value("gpu-release-timeout", "SECS", "Before a restart, wait this long for the previous attempt's GPU processes and memory to be released, else exit 204 (0: no wait) (default 60)"),
    value("gpu-watch-interval", "SECS", "While the ranks run, look at every GPU this often (utilization, memory, power, temperature, ECC, row remaps, NVLink errors, throttling) and listen for XID events; a fatal XID stops the node with exit 204 (0: no watch; without an NVIDIA driver there is none) (default 10)"),
    value("framework-callbacks", "on|off", "Add muster's checkpoint callback to every Hugging Face or Lightning Trainer the script builds, so a preemption saves the framework's own checkpoint on every rank at one step (docs/frameworks.md); off leaves the Trainers alone (default on)"),
    value("hang-timeout", "SECS|auto|0", "A rank that makes no progress for this long is hung (progress: a step reported through the checkpoint helper's should_save; without the helper, an optimizer step, a forward pass, a DataLoader batch or its stack moving, see --auto-step-reports): every rank's stacks are dumped on every node and the gang restarts (cause hang; after --max-restarts, exit 207). auto: max(600 s, 20 x the slowest step period) once a rank reported 5 steps; 0: off (default auto)"),
    value("warm-restart", "on|off", "Keep one standby Python per local rank, started after an attempt's first step at low priority with the rank's installed modules imported, and hand a restarted rank's start to it instead of a cold interpreter; a standby that died, was started for another script, interpreter or environment falls back to a cold start, as do --no-python programs (default on; standbys are kept only for a job that can restart: --max-restarts above 0 or more than one node)"),
    value("snapshot-every", "STEPS|0", "Every STEPS optimizer steps, each rank that uses the snapshot helper (muster_launcher.snapshot) or runs a Hugging Face or Lightning Trainer (no code) copies its state into memory this agent holds, and a restart within the job restores the newest step every rank of the gang handed over: a crash costs the steps since, not since the last checkpoint (docs/snapshots.md); 0: off (default off)"),
    value("snapshot-persist", "DIR", "With --snapshot-every: each agent writes its ranks' parts of the newest committed snapshot under DIR in the background (the two newest whole steps stay), and a job started again with the same DIR, after every pod was lost, resumes from the newest step every node finds whole; DIR may be shared by the nodes or each node's own (docs/snapshots.md) (default: memory only)"),
    value("snapshot-persist-every", "STEPS", "With --snapshot-persist: write only the committed snapshots of steps that are multiples of STEPS, itself a multiple of --snapshot-every (each write costs storage bandwidth); the newest committed one is written at a preemption or a failed job's end whatever its step (default: every committed snapshot)"),
    value("snapshot-memory", "BYTES", "The most memory snapshots may hold on this node, two generations together, e.g. 8GiB; a state that does not fit turns snapshots off with a WARN and the job trains on (default: half the pod's memory limit, else half the machine's memory)"),
    value("auto-step-reports", "on|off", "For scripts that do not use the checkpoint helper, report each step of the first optimizer that steps (torch's optimizer hook, loaded by muster's sitecustomize) and whether the rank's stack moves between steps, for --hang-timeout and the step metrics (default on)"),
    value("startup-timeout", "SECS", "Before its first step: a rank in torch.distributed.init_process_group this long, or with no first step this long after its peers stepped, is hung (stacks dumped, a stopped rank named, gang restarted; cause hang). Ranks that never call init_process_group are not watched. 0: off (default 300)"),
    value("section-timeout", "SECS", "Limit for long work the script marks between steps (`with ckpt.section(\"eval\"):`) instead of the hang limit (default 3600)"),
    value("network-check", "off|warn|require", "Gang network pre-flight after each rendezvous round: the agents measure round-trip time and throughput among themselves and name a node or link far slower than the gang's median; warn logs it, require ends the round with exit 208 (with --nnodes MIN:MAX the named node leaves instead) (default: warn with more than one node, else off)"),
    value("network-check-budget", "SECS", "Longest the network check may take, both rounds and the exchange (default 2)"),
    value("network-check-conf", "K=V,...", "Network check thresholds: throughput_ratio (0.25), rtt_ratio (4), rtt_slack_ms (5), min_mbps (off), max_rtt_ms (off), cpu_wait_ratio (0.25: a slow measurement while an agent waited that share of it for a CPU is set aside), stream_bytes (16777216)"),
    value("straggler-threshold", "RATIO|0", "While the ranks train, name a rank whose main thread's CPU time per step is this many times the gang's median in 3 comparisons in a row (each of an interval, or of as many as hold 10 steps; a slow rank computes, the others wait off-CPU in the collective), and a GPU the hardware throttles: a WARN line, muster_straggler_* metrics, /gangz (docs/stragglers.md); 0: off (default 1.5)"),
    value("straggler-action", "warn|exclude", "What a straggler finding does: warn names it; exclude also makes its node leave with exit 210 once it lasted 10 intervals, so a gang with --nnodes MIN:MAX re-forms without it while MIN remain (default warn)"),
    value("straggler-interval", "SECS", "How often the straggler watch compares the ranks (default 30)"),
    value("max-store-bytes", "BYTES", "What each store the agent hosts (rendezvous, workers') may hold, e.g. 1GiB; a write past it closes the writer's connection (default 1GiB)"),
];

/// Where a value came from; shown in error messages so a bad `PET_*` is easy to find.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    CommandLine,
    Env(String),
    /// The Slurm step muster runs in, with the variable(s) it read ([`crate::slurm`]).
    Slurm(String),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::CommandLine => f.write_str("command line"),
            Source::Env(var) => write!(f, "environment variable {var}"),
            Source::Slurm(var) => write!(f, "Slurm ({var})"),
        }
    }
}

/// A raw value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawValue {
    pub value: String,
    pub source: Source,
}

/// The result of the raw parse.
#[derive(Debug, Default)]
pub struct LowArgs {
    /// Keyed by the dash spelling of the flag name. Switches hold `"1"` or `"0"`.
    pub values: BTreeMap<&'static str, RawValue>,
    pub help: bool,
    pub version: bool,
    /// The training script (or module, or program) and its arguments, untouched.
    pub positional: Vec<OsString>,
}

/// A raw parse error: always a usage problem, so it maps to the configuration-error exit code.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LowArgsError {
    #[error("unknown option `{0}` (see `muster --help`)")]
    Unknown(String),
    #[error("option `{0}` needs a value")]
    MissingValue(String),
    #[error("option `--{0}` takes no value")]
    UnexpectedValue(String),
    #[error("option `{0}` is not valid UTF-8")]
    NotUtf8(String),
    #[error("{origin}: `{value}` is not a yes/no value for --{flag} (use 1/0, true/false, yes/no or on/off)")]
    BadSwitch {
        flag: &'static str,
        value: String,
        origin: Source,
    },
}

/// The environment variable names of a flag, in precedence order.
pub fn env_names(def: &FlagDef) -> Vec<String> {
    let upper = def.name.to_ascii_uppercase().replace('-', "_");
    let mut names = vec![format!("MUSTER_{upper}"), format!("PET_{upper}")];
    if let Some(torch) = def.torch_env {
        names.push(torch.to_owned());
    }
    names
}

fn find_long(name: &str) -> Option<&'static FlagDef> {
    let dashed = name.replace('_', "-");
    FLAGS.iter().find(|f| f.name == dashed)
}

fn find_short(c: char) -> Option<&'static FlagDef> {
    FLAGS.iter().find(|f| f.short == Some(c))
}

pub fn parse_switch_value(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Parses `args` (without the program name) and fills in unset flags from `env`.
///
/// Precedence: command line, then `MUSTER_<NAME>`, then `PET_<NAME>`, then the legacy torch
/// variable where torchrun has one; an empty variable is unset.
pub fn parse(
    args: &[OsString],
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<LowArgs, LowArgsError> {
    let mut low = LowArgs::default();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let Some(text) = arg.to_str() else {
            if arg.to_string_lossy().starts_with('-') {
                return Err(LowArgsError::NotUtf8(arg.to_string_lossy().into_owned()));
            }
            low.positional = args[i - 1..].to_vec();
            break;
        };
        if text == "--" {
            low.positional = args[i..].to_vec();
            break;
        }
        if let Some(long) = text.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (long, None),
            };
            match name {
                "help" => {
                    low.help = true;
                    continue;
                }
                "version" => {
                    low.version = true;
                    continue;
                }
                _ => {}
            }
            let def = find_long(name).ok_or_else(|| LowArgsError::Unknown(text.to_owned()))?;
            let value = match (def.kind, inline) {
                (Kind::Switch, None) => "1".to_owned(),
                (Kind::Switch, Some(v)) => match parse_switch_value(v) {
                    Some(b) => if b { "1" } else { "0" }.to_owned(),
                    None => return Err(LowArgsError::UnexpectedValue(def.name.to_owned())),
                },
                (Kind::Value, Some(v)) => v.to_owned(),
                (Kind::Value, None) => {
                    let next = args
                        .get(i)
                        .ok_or_else(|| LowArgsError::MissingValue(format!("--{name}")))?;
                    i += 1;
                    next.to_str()
                        .ok_or_else(|| LowArgsError::NotUtf8(format!("--{name}")))?
                        .to_owned()
                }
            };
            low.values.insert(
                def.name,
                RawValue {
                    value,
                    source: Source::CommandLine,
                },
            );
            continue;
        }
        if let Some(shorts) = text.strip_prefix('-').filter(|s| !s.is_empty()) {
            for (at, c) in shorts.char_indices() {
                if c == 'h' {
                    low.help = true;
                    continue;
                }
                let def = find_short(c).ok_or_else(|| LowArgsError::Unknown(format!("-{c}")))?;
                match def.kind {
                    Kind::Switch => {
                        low.values.insert(
                            def.name,
                            RawValue {
                                value: "1".to_owned(),
                                source: Source::CommandLine,
                            },
                        );
                    }
                    Kind::Value => {
                        // `-r3`, `-r=3` or `-r 3`, as argparse accepts.
                        let rest = &shorts[at + c.len_utf8()..];
                        let value = if rest.is_empty() {
                            let next = args
                                .get(i)
                                .ok_or_else(|| LowArgsError::MissingValue(format!("-{c}")))?;
                            i += 1;
                            next.to_str()
                                .ok_or_else(|| LowArgsError::NotUtf8(format!("-{c}")))?
                                .to_owned()
                        } else {
                            rest.strip_prefix('=').unwrap_or(rest).to_owned()
                        };
                        low.values.insert(
                            def.name,
                            RawValue {
                                value,
                                source: Source::CommandLine,
                            },
                        );
                        break;
                    }
                }
            }
            continue;
        }
        // The first positional argument is the entry point; argparse's REMAINDER hands it and
        // everything after it to the script.
        low.positional = args[i - 1..].to_vec();
        break;
    }

    for def in FLAGS {
        if low.values.contains_key(def.name) {
            continue;
        }
        for var in env_names(def) {
            let Some(raw) = env(&var) else { continue };
            let text = raw.to_string_lossy().into_owned();
            if text.trim().is_empty() {
                continue;
            }
            let source = Source::Env(var);
            let value = match def.kind {
                Kind::Value => text,
                Kind::Switch => match parse_switch_value(&text) {
                    Some(b) => if b { "1" } else { "0" }.to_owned(),
                    None => {
                        return Err(LowArgsError::BadSwitch {
                            flag: def.name,
                            value: text,
                            origin: source,
                        })
                    }
                },
            };
            low.values.insert(def.name, RawValue { value, source });
            break;
        }
    }
    Ok(low)
}

/// The `--help` text, generated from [`FLAGS`].
pub fn help_text() -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    out.push_str(
        "muster: a drop-in replacement for torchrun (supervises the workers like PID 1 should)\n\n\
         Usage: muster [OPTIONS] <script.py | -m module | --no-python program> [ARGS]...\n\
         \x20      muster dry-run --nnodes N [OPTIONS] script.py [ARGS]...   N agents on loopback\n\
         \x20      muster store [OPTIONS]       a standalone TCPStore server\n\
         \x20      muster gpu-check [OPTIONS]   the GPU pre-flight alone\n\
         \x20      muster stacks [OPTIONS]      every local rank's Python stacks now (ask the agent)\n\n\
         Options (each also as --name_with_underscores):\n",
    );
    for def in FLAGS {
        let short = def.short.map(|c| format!("-{c}, ")).unwrap_or_default();
        let long = if def.kind == Kind::Value {
            format!("--{} <{}>", def.name, def.value_name)
        } else {
            format!("--{}", def.name)
        };
        let _ = writeln!(out, "  {short}{long}");
        let _ = writeln!(out, "        {}", def.help);
        let _ = writeln!(out, "        env: {}", env_names(def).join(", "));
    }
    out.push_str(
        "  -h, --help\n        Print this help\n  --version\n        Print the version\n\n\
         Precedence: the command line wins, then MUSTER_<NAME>, then PET_<NAME> (what Kubeflow\n\
         injects), then the legacy torch variable where torchrun reads one, then, in a Slurm\n\
         step (srun), Slurm: node count, node rank, rendezvous on the step's first node, run id\n\
         <job>.<step>, and the GPUs for gpu|auto (docs/slurm.md); then the default.\n\
         An empty variable counts as unset. Switches read 1/0, true/false, yes/no, on/off.\n\
         SECS (every flag, variable and --rdzv-conf/--network-check-conf key that takes a time):\n\
         a number (2, 0.5, 1e3) with an optional unit (250ms, 30s, 5m), from 0 to 31536000 (a\n\
         year); anything else is a configuration error (202) naming the flag.\n\n\
         A script ending in .py runs as `$PYTHON_EXEC -u script.py` (else python3, else python on\n\
         PATH); -m runs `python -u -m module`; --no-python execs the program directly.\n\n\
         Exit codes: 0 all workers succeeded; 1-127 the root-cause worker's code; 128+N the\n\
         root-cause worker died of signal N, or the agent was stopped by signal N (after SIGINT 0\n\
         if every worker still exited cleanly, after SIGTERM 201); 200 preempted, checkpoint committed (--preempted-exit-code);\n\
         201 preempted, no checkpoint committed (also POST /checkpoint before any worker ran);\n\
         202 configuration error; 203 rendezvous timeout;\n\
         204 unhealthy GPU (pre-flight, or a fatal GPU fault while the ranks ran); 205 store host\n\
         lost; 206 internal error; 207 a rank hung and the restarts were spent; 208 network check\n\
         failed; 209 crash loop (--max-no-progress-restarts restarts without progress);\n\
         210 a straggler node left the gang (--straggler-action exclude);\n\
         220 (muster dry-run --chaos only) a strike not recovered within the bound;\n\
         221 (muster dry-run --chaos only) the job finished before every strike was injected.\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    fn no_env(_: &str) -> Option<OsString> {
        None
    }

    #[test]
    fn both_spellings_and_inline_values() {
        let low = parse(
            &os(&[
                "--nproc_per_node=4",
                "--max-restarts",
                "2",
                "--standalone",
                "t.py",
                "--lr",
                "1",
            ]),
            &no_env,
        )
        .unwrap();
        assert_eq!(low.values["nproc-per-node"].value, "4");
        assert_eq!(low.values["max-restarts"].value, "2");
        assert_eq!(low.values["standalone"].value, "1");
        assert_eq!(low.positional, os(&["t.py", "--lr", "1"]));
    }

    #[test]
    fn options_after_the_script_belong_to_the_script() {
        let low = parse(&os(&["t.py", "--help", "--nnodes", "3"]), &no_env).unwrap();
        assert!(!low.help);
        assert!(!low.values.contains_key("nnodes"));
        assert_eq!(low.positional.len(), 4);
    }

    #[test]
    fn short_flags() {
        let low = parse(&os(&["-r3", "-t", "1", "-m", "pkg.train"]), &no_env).unwrap();
        assert_eq!(low.values["redirects"].value, "3");
        assert_eq!(low.values["tee"].value, "1");
        assert_eq!(low.values["module"].value, "1");
        assert_eq!(low.positional, os(&["pkg.train"]));
    }

    #[test]
    fn unknown_and_missing() {
        assert_eq!(
            parse(&os(&["--bogus", "t.py"]), &no_env).unwrap_err(),
            LowArgsError::Unknown("--bogus".into())
        );
        assert_eq!(
            parse(&os(&["--nnodes"]), &no_env).unwrap_err(),
            LowArgsError::MissingValue("--nnodes".into())
        );
        assert_eq!(
            parse(&os(&["-x"]), &no_env).unwrap_err(),
            LowArgsError::Unknown("-x".into())
        );
    }

    #[test]
    fn env_precedence_and_empty_means_unset() {
        let env = |name: &str| -> Option<OsString> {
            match name {
                "PET_NNODES" => Some("3".into()),
                "MUSTER_NNODES" => Some("2".into()),
                "PET_STANDALONE" => Some(String::new().into()),
                "PET_MAX_RESTARTS" => Some("5".into()),
                "MUSTER_MAX_RESTARTS" => Some(" ".into()),
                "PET_NPROC_PER_NODE" => Some("8".into()),
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" => Some("7".into()),
                _ => None,
            }
        };
        let low = parse(&os(&["--nproc-per-node", "2", "t.py"]), &env).unwrap();
        assert_eq!(low.values["nnodes"].value, "2");
        assert_eq!(
            low.values["nnodes"].source,
            Source::Env("MUSTER_NNODES".into())
        );
        assert!(!low.values.contains_key("standalone"));
        assert_eq!(low.values["max-restarts"].value, "5");
        assert_eq!(low.values["nproc-per-node"].value, "2");
        assert_eq!(low.values["shutdown-timeout"].value, "7");
    }

    #[test]
    fn env_switches_are_lenient_but_not_silent() {
        let env = |name: &str| (name == "PET_STANDALONE").then(|| OsString::from("true"));
        assert_eq!(parse(&[], &env).unwrap().values["standalone"].value, "1");
        let env = |name: &str| (name == "PET_STANDALONE").then(|| OsString::from("maybe"));
        let err = parse(&[], &env).unwrap_err();
        assert!(matches!(err, LowArgsError::BadSwitch { .. }));
        // The message lists every spelling that is accepted.
        let text = err.to_string();
        for accepted in ["1/0", "true/false", "yes/no", "on/off"] {
            assert!(text.contains(accepted), "{text}");
            let (yes, no) = accepted.split_once('/').unwrap();
            for v in [yes, no] {
                let env = |name: &str| (name == "PET_STANDALONE").then(|| OsString::from(v));
                assert!(parse(&[], &env).is_ok(), "{v}");
            }
        }
    }

    #[test]
    fn help_names_every_subcommand() {
        let help = help_text();
        let usage = help.split("Options").next().unwrap_or_default();
        for sub in [
            "muster dry-run",
            "muster store",
            "muster gpu-check",
            "muster stacks",
        ] {
            assert!(
                usage.contains(sub),
                "{sub} missing from the usage:\n{usage}"
            );
        }
    }

    #[test]
    fn help_lists_every_flag_and_the_precedence() {
        let help = help_text();
        for def in FLAGS {
            assert!(help.contains(&format!("--{}", def.name)), "{}", def.name);
        }
        assert!(help.contains("MUSTER_<NAME>, then PET_<NAME>"));
        assert!(help.contains("in a Slurm\nstep (srun), Slurm"), "{help}");
    }
}
