//! `muster dry-run --nnodes N --nproc-per-node M [muster options] script.py [args]`: the whole
//! multi-node flow on one machine. N agents run as separate processes on loopback (node ranks
//! 0..N-1, node 0 hosting the rendezvous store on a free port, each with its own metrics port),
//! their output is tagged with the node (a `[node i] ` prefix, or a `node` field of each JSON
//! line with `--log-format json`), and the exit code is the job's: 0 when every agent succeeded,
//! else node 0's code when it failed, else the first failing node's.
//!
//! The dry run stops as one, like an agent stops its ranks:
//! - Each agent runs in its own process group, so a terminal's Ctrl-C reaches only the dry run,
//!   which passes every stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) on to every agent once,
//!   however it was sent (to the group, or to the dry run's pid alone, as an IDE's stop button,
//!   `timeout -s INT` or a supervisor does). Copies of one signal within
//!   [`crate::launch::signals::REPEAT_WINDOW`] are one request; a later one is passed on again (the
//!   agents then SIGKILL their ranks), and agents still running [`KILL_BACKSTOP`] after it are
//!   SIGKILLed.
//! - Each agent dies with the dry run (`PR_SET_PDEATHSIG`), and its ranks die with it, so a
//!   SIGKILLed dry run leaves nothing running.
//! - After a stop signal N the exit code is 128+N, unless every agent still exited 0 (a clean
//!   drain) or an agent reported one of muster's own outcomes (200 and above, e.g. a checkpoint).
//!
//! With `--fault` (see [`crate::cmd::dry_run::fault`]) it rehearses failures: it signals an agent or a worker
//! when due, starts a killed node's replacement after `--replace-after`, and prints a timeline
//! ([`crate::cmd::dry_run::timeline`]) at the end. A node a fault killed for good does not make the job's code.
//!
//! With `--spares N` it also starts N agents the way an Indexed Job's pods beyond `--nnodes MAX`
//! start (`JOB_COMPLETION_INDEX` MAX.., no node rank): they wait as spares and take a lost
//! node's place; their output is tagged with that index.
//!
//! With `--chaos SEED[:COUNT]` (see [`crate::cmd::dry_run::chaos`]) the faults are a seeded
//! schedule, pods come back as a Job would bring them back, and a report of what each strike
//! cost follows the timeline.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio::time::Instant;

pub mod chaos;
pub mod fault;
pub mod kinds;
pub mod timeline;

use crate::cli::{self, Parsed};
use crate::exit_code::{self, Exit};
use crate::launch::config::{Config, LogFormat};
use crate::launch::signals::{Repeat, StopSignals};
use crate::logs::{self, Console, LogSink};
use fault::Rehearsal;

/// How long agents get to end after an insistent second stop signal (they SIGKILL their ranks at
/// once, then exit) before the dry run SIGKILLs them.
pub const KILL_BACKSTOP: Duration = Duration::from_secs(5);

/// The stop signals passed on to the agents: the four every agent handles.
const STOP_SIGNALS: [Signal; 4] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
];

/// What the dry run takes from the agents' command line.
struct Plan {
    nnodes: u32,
    /// `--spares N`: started after the nodes, as an Indexed Job's pods beyond MAX.
    spares: u32,
    nproc_per_node: u32,
    format: LogFormat,
    /// `--metrics-addr none` (or `MUSTER_METRICS_ADDR=none`): no agent serves metrics.
    metrics_off: bool,
    /// `--snapshot-every`: the chaos report's advice knows what a crash should cost.
    snapshot_every: Option<u64>,
}

impl Plan {
    fn of(config: &Config, spares: u32) -> Self {
        Self {
            nnodes: config.nnodes.max,
            spares,
            nproc_per_node: config.nproc_per_node,
            format: config.logs.format,
            metrics_off: config.metrics_addr.is_some_and(|a| a.addr().is_none()),
            snapshot_every: config.snapshot_every,
        }
    }
}

pub fn run(args: &[OsString]) -> anyhow::Result<u8> {
    // args: muster dry-run [options] script [args]
    let after: Vec<OsString> = args.iter().skip(2).cloned().collect();
    // `--fault` and `--replace-after` are the dry run's; the rest goes to every agent.
    let (mut faults, rest) = fault::split(&after).map_err(|e| Exit::config(e.to_string()))?;
    let config = match cli::parse(&rest)? {
        Parsed::Launch(c) => *c,
        Parsed::Help | Parsed::Version => {
            println!("{}", help_text());
            return Ok(exit_code::SUCCESS);
        }
    };
    let world = config.nnodes.max.saturating_mul(config.nproc_per_node);
    let chaos = chaos_plan(&mut faults, config.nnodes.max, world)?;
    if let Some((settings, strikes)) = &chaos {
        if settings.plan_only {
            for line in chaos_plan_lines(settings, strikes, config.nnodes.max, world) {
                println!("{line}");
            }
            return Ok(exit_code::SUCCESS);
        }
    }
    faults
        .check(config.nnodes.max.saturating_add(faults.spares), world)
        .map_err(|e| Exit::config(e.to_string()))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    // The agents are spawned from this (the main) thread, which lives as long as they do:
    // PR_SET_PDEATHSIG follows the thread that forked them.
    runtime.block_on(async {
        // Dropped on the way out, which writes what is still queued.
        let writer = logs::start().context("cannot start the log writer")?;
        logs::init_tracing(
            config.logs.format,
            logs::Diagnostics::Console(writer.sink()),
            crate::app::LAUNCH_LOG_FILTER,
        );
        drive(
            &rest,
            &Plan::of(&config, faults.spares),
            &writer.sink(),
            &faults,
            chaos,
        )
        .await
    })
}

/// With `--chaos`: the settings and the schedule, with `--replace-after`'s default and Job-like
/// replacement on; the runner hands the strikes to the rehearsal as they come due.
fn chaos_plan(
    faults: &mut fault::Options,
    nnodes: u32,
    world: u32,
) -> anyhow::Result<Option<(chaos::Settings, Vec<chaos::plan::Strike>)>> {
    let Some(settings) = faults
        .chaos
        .settings()
        .map_err(|e| Exit::config(e.to_string()))?
    else {
        return Ok(None);
    };
    if !faults.faults.is_empty() {
        return Err(Exit::config(chaos::ChaosError::WithFaults.to_string()).into());
    }
    let strikes = chaos::plan::plan(&settings, nnodes, world);
    faults.replace_after = faults.replace_after.or(Some(chaos::DEFAULT_REPLACE_AFTER));
    faults.job_like = true;
    Ok(Some((settings, strikes)))
}

/// The schedule as printed (before a run, and alone with `--chaos-plan`).
fn chaos_plan_lines(
    settings: &chaos::Settings,
    strikes: &[chaos::plan::Strike],
    nnodes: u32,
    world: u32,
) -> Vec<String> {
    let kinds: Vec<&str> = settings.kinds.iter().map(|k| k.name()).collect();
    let mut lines = vec![format!(
        "muster dry-run: chaos schedule of seed {} for {nnodes} node(s), {world} rank(s): {} strike(s) of {}, each {:.1}-{:.1} s after the gang recovered from the one before (the first: after the first worker output; replay: --chaos {}:{})",
        settings.seed,
        strikes.len(),
        kinds.join(","),
        settings.interval.0.as_secs_f64(),
        settings.interval.1.as_secs_f64(),
        settings.seed,
        settings.count
    )];
    lines.extend(strikes.iter().map(|s| format!("muster dry-run: chaos {s}")));
    lines
}

/// `muster dry-run --help`.
fn help_text() -> String {
    let mut text = String::from(
        "Usage: muster dry-run --nnodes N --nproc-per-node M [dry-run options] [muster options] script.py [args]\n\
         Runs N agents as local processes on loopback: the multi-node flow without a cluster.\n\
         SIGINT/SIGTERM stop every agent and rank (a second one, a second or more later: at once);\n\
         a killed dry run takes its agents and ranks with it.\n\nDry-run options:\n",
    );
    for flag in fault::DRY_RUN_FLAGS {
        let value = if flag.value_name.is_empty() {
            String::new()
        } else {
            format!(" {}", flag.value_name)
        };
        let _ = writeln!(text, "  --{}{value}\n      {}", flag.name, flag.help());
    }
    text.push_str(
        "With a fault the dry run prints a timeline at the end (faults, gang stopped, re-formed,\n\
         resumed, from which committed step) and exits with the job's code. Docs: docs/multinode.md",
    );
    text
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot pick a free port")?;
    Ok(l.local_addr().context("cannot pick a free port")?.port())
}

/// `1 agent`, `2 agents`.
fn agents(n: usize) -> String {
    if n == 1 {
        "1 agent".to_owned()
    } else {
        format!("{n} agents")
    }
}

/// One agent's command line: the node's own flags first, so the user's (later) win.
fn agent_command(
    me: &std::path::Path,
    node: u32,
    port: u16,
    run_id: &str,
    plan: &Plan,
    rest: &[OsString],
) -> tokio::process::Command {
    let mut cmd = std::process::Command::new(me);
    if node < plan.nnodes {
        cmd.arg("--node-rank").arg(node.to_string());
    } else {
        // A spare is what an Indexed Job's pod beyond MAX is: its index, and no rank of its own.
        cmd.env("JOB_COMPLETION_INDEX", node.to_string());
    }
    cmd.arg("--rdzv-backend")
        .arg("c10d")
        .arg("--rdzv-endpoint")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--rdzv-id")
        .arg(run_id)
        .arg("--local-addr")
        .arg("127.0.0.1")
        // N agents cannot share one port: each takes a free one, unless metrics are off.
        .arg("--metrics-addr")
        .arg(if plan.metrics_off {
            "none"
        } else {
            "127.0.0.1:0"
        })
        .args(rest)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    {
        use std::os::unix::process::CommandExt as _;
        // Its own group: a terminal's Ctrl-C reaches the dry run only, which passes it on once.
        cmd.process_group(0);
    }
    crate::sys::die_with_parent(&mut cmd, nix::unistd::getpid());
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    cmd
}

/// What every agent of the run shares: how to start one, where its output and exit go.
struct Spawner<'a> {
    me: std::path::PathBuf,
    port: u16,
    run_id: String,
    plan: &'a Plan,
    rest: &'a [OsString],
    sink: &'a LogSink,
    /// Agent lines for the timeline, stamped when read and tagged with their node (only when
    /// rehearsing faults).
    lines: Option<mpsc::UnboundedSender<(Instant, u32, String)>>,
    /// `(node, incarnation, exit code)`: a replaced node's old agent is a past incarnation.
    exits: mpsc::UnboundedSender<(usize, u32, u8)>,
}

impl Spawner<'_> {
    /// Starts node `node`'s agent (its `incarnation`-th); its output is pumped into `pumps`.
    fn spawn(
        &self,
        node: u32,
        incarnation: u32,
        pumps: &mut tokio::task::JoinSet<()>,
    ) -> std::io::Result<Option<Pid>> {
        let mut child = agent_command(
            &self.me,
            node,
            self.port,
            &self.run_id,
            self.plan,
            self.rest,
        )
        .spawn()?;
        let format = self.plan.format;
        if let Some(out) = child.stdout.take() {
            let lines = self.lines.clone();
            pumps.spawn(pump(
                out,
                self.sink.clone(),
                Console::Stdout,
                node,
                format,
                lines,
            ));
        }
        if let Some(err) = child.stderr.take() {
            let lines = self.lines.clone();
            pumps.spawn(pump(
                err,
                self.sink.clone(),
                Console::Stderr,
                node,
                format,
                lines,
            ));
        }
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .map(Pid::from_raw);
        let tx = self.exits.clone();
        tokio::spawn(async move {
            let code = match child.wait().await {
                Ok(status) => exit_code_of(status),
                Err(_) => exit_code::INTERNAL_ERROR,
            };
            let _ = tx.send((node as usize, incarnation, code));
        });
        Ok(pid)
    }
}

/// The dry run once configured: starts every agent, supervises them until they have all
/// exited, and returns the job's exit code (the chaos report's with `--chaos`).
async fn drive(
    rest: &[OsString],
    plan: &Plan,
    sink: &LogSink,
    faults: &fault::Options,
    chaos: Option<(chaos::Settings, Vec<chaos::plan::Strike>)>,
) -> anyhow::Result<u8> {
    let me = std::env::current_exe().context("cannot find the muster binary")?;
    let port = free_port()?;
    let run_id = format!("dryrun-{}", std::process::id());
    // Listeners before the first agent starts: no stop signal can fall between the two.
    let (sig_tx, mut sig_rx) = mpsc::unbounded_channel::<Signal>();
    forward_stop_signals(&sig_tx)?;
    announce(plan, port, &run_id, chaos.as_ref());
    let started = Instant::now();
    let rehearsal = (!faults.is_empty() || chaos.is_some())
        .then(|| Rehearsal::new(faults, plan.nnodes + plan.spares, started, plan.format));
    let chaos = chaos.map(|(settings, strikes)| {
        let world = plan.nnodes.saturating_mul(plan.nproc_per_node) as usize;
        chaos::runner::Runner::new(settings, strikes, world, started)
            .with_snapshots(plan.snapshot_every)
    });
    let (lines_tx, lines) = mpsc::unbounded_channel::<(Instant, u32, String)>();
    let (exit_tx, exits) = mpsc::unbounded_channel::<(usize, u32, u8)>();
    let spawner = Spawner {
        me,
        port,
        run_id,
        plan,
        rest,
        sink,
        lines: rehearsal.is_some().then_some(lines_tx),
        exits: exit_tx,
    };
    let mut pumps = tokio::task::JoinSet::new();
    let agents = Agents::start(&spawner, &mut pumps)?;
    let mut supervisor = Supervisor {
        spawner,
        pumps,
        agents,
        rehearsal,
        chaos,
        lines,
        exits,
    };
    let stopped_by = supervisor.supervise(&mut sig_rx).await;
    Ok(supervisor.finish(stopped_by).await)
}

/// Passes each stop signal the dry run receives into `tx`.
fn forward_stop_signals(tx: &mpsc::UnboundedSender<Signal>) -> anyhow::Result<()> {
    let mut listeners = Vec::new();
    for sig in STOP_SIGNALS {
        let stream = signal(SignalKind::from_raw(sig as i32))
            .with_context(|| format!("cannot watch {sig}"))?;
        listeners.push((sig, stream));
    }
    for (sig, mut stream) in listeners {
        let tx = tx.clone();
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                if tx.send(sig).is_err() {
                    break;
                }
            }
        });
    }
    Ok(())
}

/// The dry run's first lines: the agents it starts, where they meet, and the chaos schedule.
fn announce(
    plan: &Plan,
    port: u16,
    run_id: &str,
    chaos: Option<&(chaos::Settings, Vec<chaos::plan::Strike>)>,
) {
    let spares = match plan.spares {
        0 => String::new(),
        1 => format!(" and 1 spare (node {})", plan.nnodes),
        n => format!(
            " and {n} spares (nodes {} to {})",
            plan.nnodes,
            plan.nnodes + n - 1
        ),
    };
    tracing::info!(
        "muster dry-run: {}{spares} on 127.0.0.1, rendezvous store on port {port} (run id {run_id})",
        agents(plan.nnodes as usize)
    );
    if chaos.is_some() && plan.metrics_off {
        tracing::warn!(
            "muster dry-run: --metrics-addr none: chaos cannot read the ranks' step reports, so \
             recovery and steps lost go unmeasured and each strike waits out \
             --chaos-recovery-bound before the next"
        );
    }
    if let Some((settings, strikes)) = chaos {
        let world = plan.nnodes.saturating_mul(plan.nproc_per_node);
        for line in chaos_plan_lines(settings, strikes, plan.nnodes, world) {
            tracing::info!("{line}");
        }
    }
}

/// The agents, one slot per node (spares after the nodes): the running agent's pid (`None` once
/// reaped), which incarnation of the node's agent it is, and the node's exit code.
struct Agents {
    pids: Vec<Option<Pid>>,
    incarnations: Vec<u32>,
    codes: Vec<Option<u8>>,
}

impl Agents {
    /// Starts every node's first agent.
    fn start(spawner: &Spawner<'_>, pumps: &mut tokio::task::JoinSet<()>) -> anyhow::Result<Self> {
        let plan = spawner.plan;
        let mut pids: Vec<Option<Pid>> = Vec::new();
        for node in 0..plan.nnodes + plan.spares {
            match spawner.spawn(node, 0, pumps) {
                Ok(pid) => pids.push(pid),
                Err(e) => {
                    // The ones already started must not run on without the rest of the gang.
                    signal_all(&pids, Signal::SIGKILL);
                    return Err(anyhow::Error::new(e).context("cannot start an agent"));
                }
            }
        }
        Ok(Self {
            incarnations: vec![0; pids.len()],
            codes: vec![None; pids.len()],
            pids,
        })
    }

    /// Records an agent's exit code; `false` when the agent was a replaced incarnation.
    fn exited(&mut self, index: usize, incarnation: u32, code: u8) -> bool {
        // A replaced agent's exit is history, not its node's outcome.
        if self.incarnations.get(index) != Some(&incarnation) {
            return false;
        }
        if let Some(slot) = self.codes.get_mut(index) {
            *slot = Some(code);
        }
        // Reaped: its pid may be reused, so it is never signalled again.
        if let Some(pid) = self.pids.get_mut(index) {
            *pid = None;
        }
        true
    }

    /// A node's replacement agent takes its slot: running again, no exit code yet.
    fn replaced(&mut self, index: usize, pid: Option<Pid>, incarnation: u32) {
        if let (Some(p), Some(c), Some(i)) = (
            self.pids.get_mut(index),
            self.codes.get_mut(index),
            self.incarnations.get_mut(index),
        ) {
            *p = pid;
            *c = None;
            *i = incarnation;
        }
    }
}

/// The dry run while its agents run: how to start one, the agents, the rehearsal and chaos
/// runner (with `--fault` or `--chaos`), and what the agents send back.
struct Supervisor<'a> {
    spawner: Spawner<'a>,
    pumps: tokio::task::JoinSet<()>,
    agents: Agents,
    rehearsal: Option<Rehearsal>,
    chaos: Option<chaos::runner::Runner>,
    lines: mpsc::UnboundedReceiver<(Instant, u32, String)>,
    exits: mpsc::UnboundedReceiver<(usize, u32, u8)>,
}

impl Supervisor<'_> {
    /// Runs until every agent has exited and no replacement is due, passing stop signals on to
    /// the agents; returns the stop signal that stopped the run, if one did.
    async fn supervise(&mut self, signals: &mut mpsc::UnboundedReceiver<Signal>) -> Option<Signal> {
        let mut seen = StopSignals::default();
        let mut stopped_by: Option<Signal> = None;
        // Armed by an insistent second signal; until then it never fires.
        let backstop = tokio::time::sleep(KILL_BACKSTOP);
        tokio::pin!(backstop);
        let mut backstop_armed = false;
        let mut ticks = tokio::time::interval(fault::SAMPLE_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while self.agents.codes.iter().any(Option::is_none)
            || self
                .rehearsal
                .as_ref()
                .is_some_and(Rehearsal::replacement_pending)
        {
            tokio::select! {
                exit = self.exits.recv() => {
                    let Some((index, incarnation, code)) = exit else { break };
                    self.agent_exited(index, incarnation, code);
                }
                Some((at, node, line)) = self.lines.recv(), if self.rehearsal.is_some() => {
                    self.agent_line(at, node, &line);
                }
                _ = ticks.tick(), if self.rehearsal.is_some() => self.rehearsal_tick(),
                Some(sig) = signals.recv() => {
                    let insistent = self.stop_signal(sig, seen.arrived(Instant::now()), &mut stopped_by);
                    if insistent && !backstop_armed {
                        backstop.as_mut().reset(Instant::now() + KILL_BACKSTOP);
                        backstop_armed = true;
                    }
                }
                () = &mut backstop, if backstop_armed => {
                    tracing::warn!("muster dry-run: agents still running; sending SIGKILL");
                    signal_all(&self.agents.pids, Signal::SIGKILL);
                    backstop_armed = false;
                }
            }
        }
        stopped_by
    }

    /// An agent exited: its node's code, and the rehearsal's record of it.
    fn agent_exited(&mut self, index: usize, incarnation: u32, code: u8) {
        if !self.agents.exited(index, incarnation, code) {
            return;
        }
        if let (Some(r), Ok(node)) = (self.rehearsal.as_mut(), u32::try_from(index)) {
            r.agent_exited(Instant::now(), node, code);
        }
    }

    /// An agent's output line, for the rehearsal's timeline and the chaos runner.
    fn agent_line(&mut self, at: Instant, node: u32, line: &str) {
        if let Some(r) = self.rehearsal.as_mut() {
            r.line(at, line);
        }
        if let Some(c) = self.chaos.as_mut() {
            if let Some(msg) = timeline::agent_message(line, self.spawner.plan.format) {
                c.agent_message(node, &msg);
            }
        }
    }

    /// The rehearsal's clock: due chaos strikes and faults, then the replacement agents due.
    fn rehearsal_tick(&mut self) {
        let Some(r) = self.rehearsal.as_mut() else {
            return;
        };
        if let Some(c) = self.chaos.as_mut() {
            c.tick(Instant::now(), r);
        }
        for node in r.tick(Instant::now(), &self.agents.pids) {
            let index = node as usize;
            let incarnation = self.agents.incarnations.get(index).map_or(0, |i| i + 1);
            match self.spawner.spawn(node, incarnation, &mut self.pumps) {
                Ok(pid) => {
                    self.agents.replaced(index, pid, incarnation);
                    tracing::info!("muster dry-run: started node {node}'s replacement agent");
                    r.replaced(Instant::now(), node, pid);
                }
                Err(e) => tracing::error!(
                    "muster dry-run: cannot start node {node}'s replacement agent: {e}"
                ),
            }
        }
    }

    /// Passes a stop signal on to every agent, once per request; `true` when it was an
    /// insistent repeat (the agents' last chance before the backstop).
    fn stop_signal(
        &mut self,
        sig: Signal,
        repeat: Repeat,
        stopped_by: &mut Option<Signal>,
    ) -> bool {
        match repeat {
            Repeat::First => {
                tracing::info!("muster dry-run: {sig} received: stopping every agent");
                *stopped_by = Some(sig);
                if let Some(r) = self.rehearsal.as_mut() {
                    r.stop();
                }
                signal_all(&self.agents.pids, sig);
                false
            }
            Repeat::Duplicate => false,
            Repeat::Insistent => {
                tracing::warn!(
                    "muster dry-run: {sig} again: the agents kill their ranks now \
                     (SIGKILL to agents still running in {:.0} s)",
                    KILL_BACKSTOP.as_secs_f64()
                );
                signal_all(&self.agents.pids, sig);
                true
            }
        }
    }

    /// After the agents: drains their output, logs the job's exit code, prints the timeline and
    /// the chaos report; returns the dry run's exit code.
    async fn finish(self, stopped_by: Option<Signal>) -> u8 {
        let Self {
            spawner,
            mut pumps,
            agents,
            rehearsal,
            chaos,
            mut lines,
            exits: _,
        } = self;
        // The pipes close when the agents (and their ranks) are gone.
        drop(spawner);
        while pumps.join_next().await.is_some() {}
        let codes: Vec<u8> = agents
            .codes
            .into_iter()
            .map(|c| c.unwrap_or(exit_code::INTERNAL_ERROR))
            .collect();
        let counted = rehearsal
            .as_ref()
            .map_or_else(|| codes.clone(), |r| r.counted_codes(&codes));
        let job = stopped_code(job_code(&counted), stopped_by);
        tracing::info!(
            "muster dry-run: {}; job exit code {job}",
            exit_codes_in_words(&codes)
        );
        if let Some(mut r) = rehearsal {
            // The agents' last lines (a commit, an abort) are in the channel still.
            while let Ok((at, _, line)) = lines.try_recv() {
                r.line(at, &line);
            }
            let ended = Instant::now();
            let timeline = r.finish(ended, job);
            print_timeline(&timeline);
            if let Some(c) = chaos {
                let report = c.report(&timeline.entries(), job, ended);
                print_chaos_report(&report);
                return report.exit_code();
            }
        }
        job
    }
}

/// Writes the chaos report as the dry run's own log lines; with `--log-format json` each is a
/// record whose fields carry the figures.
fn print_chaos_report(report: &chaos::report::Report) {
    tracing::info!(
        "muster dry-run: chaos report (seed {}; recovery: strike -> every rank's next step; steps lost: steps trained twice):",
        report.seed
    );
    for o in &report.outcomes {
        let round = |v: f64| (v * 10.0).round() / 10.0;
        tracing::info!(
            kind = "chaos_strike",
            strike = o.strike.number,
            fault = o.strike.kind.name(),
            target = o.strike.target().as_str(),
            t_seconds = o.hit.map(round),
            reaction = o.reaction.as_str(),
            recovery_seconds = o.recovery.map(round),
            steps_lost = o.steps_lost,
            reached_step = o.reached,
            resumed_step = o.resumed_at,
            verdict = o.verdict.name(),
            "muster dry-run: {}",
            o.line()
        );
    }
    let (median, worst) = report.recovery();
    tracing::info!(
        kind = "chaos_totals",
        injected = report.injected(),
        recovered = report.recovered(),
        recovery_median_seconds = median,
        recovery_worst_seconds = worst,
        "muster dry-run: totals: {}",
        report.totals()
    );
    for advice in report.advice() {
        tracing::warn!(kind = "chaos_advice", "muster dry-run: advice: {advice}");
    }
    tracing::info!(
        kind = "chaos_verdict",
        exit_code = report.exit_code(),
        "muster dry-run: {}",
        report.verdict()
    );
}

/// Writes the timeline as the dry run's own log lines (text, or JSON records with the entry's
/// `kind` and time as fields).
fn print_timeline(timeline: &crate::cmd::dry_run::timeline::Timeline) {
    tracing::info!("muster dry-run: timeline (seconds since the agents started):");
    for (seconds, entry) in timeline.entries() {
        tracing::info!(
            t_seconds = (seconds * 10.0).round() / 10.0,
            kind = entry.kind(),
            "muster dry-run: {}",
            crate::cmd::dry_run::timeline::render(seconds, entry)
        );
    }
}

/// Sends `sig` to every agent still running.
fn signal_all(pids: &[Option<Pid>], sig: Signal) {
    for pid in pids.iter().flatten() {
        let _ = kill(*pid, sig);
    }
}

fn exit_code_of(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(exit_code::INTERNAL_ERROR),
        (None, Some(s)) => exit_code::for_signal(s),
        _ => exit_code::INTERNAL_ERROR,
    }
}

/// `agent 0 exited 0, agent 1 exited 209`: each agent's code by its index (its pod's
/// `JOB_COMPLETION_INDEX`: a spare's comes after the nodes').
fn exit_codes_in_words(codes: &[u8]) -> String {
    let each: Vec<String> = codes
        .iter()
        .enumerate()
        .map(|(index, code)| format!("agent {index} exited {code}"))
        .collect();
    each.join(", ")
}

/// 0 when all agents succeeded; else node 0's code if it failed, else the first failure.
pub fn job_code(codes: &[u8]) -> u8 {
    match codes.first() {
        Some(&c) if c != 0 => c,
        _ => codes.iter().copied().find(|&c| c != 0).unwrap_or(0),
    }
}

/// The job's code after the dry run was stopped by `signal`: 128+N says which signal, unless the
/// agents still all succeeded (a clean drain) or one reported one of muster's own outcomes.
pub fn stopped_code(job: u8, signal: Option<Signal>) -> u8 {
    match signal {
        Some(sig) if job != exit_code::SUCCESS && job < exit_code::PREEMPTED_CHECKPOINTED => {
            exit_code::for_signal(sig as i32)
        }
        _ => job,
    }
}

/// One agent output line, tagged with its node: a `node` field first in a JSON object line (with
/// `--log-format json`, unless the object already has one), else a `[node N] ` prefix.
pub fn tag_line(line: &str, node: u32, format: LogFormat) -> String {
    if format == LogFormat::Json {
        if let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(line) {
            if fields.contains_key("node") {
                return line.to_owned();
            }
            // Splice the field in rather than re-serialising: the agent's field order and number
            // formatting stay exactly as written.
            let body = line.trim_start().strip_prefix('{').unwrap_or_default();
            return if fields.is_empty() {
                format!("{{\"node\":{node}}}")
            } else {
                format!("{{\"node\":{node},{body}")
            };
        }
    }
    format!("[node {node}] {line}")
}

async fn pump<R>(
    from: R,
    sink: LogSink,
    console: Console,
    node: u32,
    format: LogFormat,
    timeline: Option<mpsc::UnboundedSender<(Instant, u32, String)>>,
) where
    R: AsyncRead + Unpin,
{
    let mut reader = BufReader::new(from);
    let mut raw = Vec::new();
    loop {
        raw.clear();
        match reader.read_until(b'\n', &mut raw).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&raw);
        let line = text.trim_end_matches(['\n', '\r']);
        if let Some(tx) = &timeline {
            let _ = tx.send((Instant::now(), node, line.to_owned()));
        }
        let mut out = tag_line(line, node, format);
        out.push('\n');
        sink.write(console, out.into_bytes()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_code_is_node_0s_failure_or_the_first_one() {
        assert_eq!(job_code(&[0, 0, 0]), 0);
        assert_eq!(job_code(&[3, 1, 0]), 3);
        assert_eq!(job_code(&[0, 205, 7]), 205);
        assert_eq!(job_code(&[]), 0);
    }

    #[test]
    fn a_stop_signal_sets_the_code_unless_the_drain_was_clean() {
        assert_eq!(stopped_code(130, Some(Signal::SIGINT)), 130);
        assert_eq!(stopped_code(137, Some(Signal::SIGINT)), 130);
        assert_eq!(stopped_code(1, Some(Signal::SIGTERM)), 143);
        assert_eq!(stopped_code(0, Some(Signal::SIGTERM)), 0);
        assert_eq!(stopped_code(201, Some(Signal::SIGTERM)), 201);
        assert_eq!(stopped_code(3, None), 3);
    }

    #[test]
    fn json_lines_get_a_node_field_and_other_lines_a_prefix() {
        assert_eq!(
            tag_line(r#"{"ts":"t","line":"x"}"#, 1, LogFormat::Json),
            r#"{"node":1,"ts":"t","line":"x"}"#
        );
        let tagged: serde_json::Value =
            serde_json::from_str(&tag_line(r#" { "a" : [1, 2] }"#, 0, LogFormat::Json)).unwrap();
        assert_eq!(tagged["node"], 0);
        assert_eq!(tagged["a"][1], 2);
        assert_eq!(tag_line("{}", 2, LogFormat::Json), r#"{"node":2}"#);
        assert_eq!(
            tag_line(r#"{"node":5}"#, 2, LogFormat::Json),
            r#"{"node":5}"#
        );
        assert_eq!(
            tag_line("Traceback (most recent call last):", 1, LogFormat::Json),
            "[node 1] Traceback (most recent call last):"
        );
        assert_eq!(tag_line("[1]", 1, LogFormat::Json), "[node 1] [1]");
        assert_eq!(
            tag_line(r#"{"ts":"t"}"#, 0, LogFormat::Text),
            r#"[node 0] {"ts":"t"}"#
        );
    }

    #[test]
    fn the_help_names_every_dry_run_flag() {
        let help = help_text();
        for flag in fault::DRY_RUN_FLAGS {
            assert!(
                help.contains(format!("--{} {}", flag.name, flag.value_name).trim_end()),
                "{help}"
            );
        }
    }

    #[test]
    fn agent_counts_read_right() {
        assert_eq!(agents(1), "1 agent");
        assert_eq!(agents(3), "3 agents");
    }
}
