//! `muster dry-run --nnodes N --nproc-per-node M [muster options] script.py [args]`: the whole
//! multi-node flow on one machine. N agents run as separate processes on loopback (node ranks
//! 0..N-1, node 0 hosting the rendezvous store on a free port, each with its own metrics port),
//! their output is prefixed with `[node i]`, and the exit code is the job's: 0 when every agent
//! succeeded, else node 0's code when it failed, else the first failing node's.

use std::ffi::OsString;
use std::process::Stdio;

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

use crate::cli::{self, Parsed};
use crate::exit_code::{self, Exit};

pub fn run(args: &[OsString]) -> anyhow::Result<u8> {
    // args: muster dry-run [options] script [args]
    let rest: Vec<OsString> = args.iter().skip(2).cloned().collect();
    let config = match cli::parse(&rest) {
        Ok(Parsed::Launch(c)) => *c,
        Ok(Parsed::Help | Parsed::Version) => {
            println!(
                "usage: muster dry-run --nnodes N --nproc-per-node M [muster options] script.py [args]\n\
                 Runs N agents as local processes on loopback: the multi-node flow without a cluster."
            );
            return Ok(exit_code::SUCCESS);
        }
        Err(e) => return Err(Exit::config(e.0).into()),
    };
    let nnodes = config.nnodes.max;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(drive(&rest, nnodes))
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot pick a free port")?;
    Ok(l.local_addr().context("cannot pick a free port")?.port())
}

async fn drive(rest: &[OsString], nnodes: u32) -> anyhow::Result<u8> {
    let me = std::env::current_exe().context("cannot find the muster binary")?;
    let port = free_port()?;
    let run_id = format!("dryrun-{}", std::process::id());
    eprintln!(
        "muster dry-run: {nnodes} agents on 127.0.0.1, rendezvous store on port {port} (run id {run_id})"
    );
    let mut children: Vec<Child> = Vec::new();
    let mut pumps = Vec::new();
    for node in 0..nnodes {
        let mut cmd = Command::new(&me);
        cmd.arg("--node-rank")
            .arg(node.to_string())
            .arg("--rdzv-backend")
            .arg("c10d")
            .arg("--rdzv-endpoint")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--rdzv-id")
            .arg(&run_id)
            .arg("--local-addr")
            .arg("127.0.0.1")
            .arg("--metrics-addr")
            .arg("127.0.0.1:0")
            .args(rest)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().context("cannot start an agent")?;
        let prefix = format!("[node {node}] ");
        if let Some(out) = child.stdout.take() {
            pumps.push(tokio::spawn(pump(out, tokio::io::stdout(), prefix.clone())));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(tokio::spawn(pump(err, tokio::io::stderr(), prefix)));
        }
        children.push(child);
    }
    let mut codes = Vec::with_capacity(children.len());
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot watch SIGTERM")?;
    let pids: Vec<i32> = children
        .iter()
        .filter_map(Child::id)
        .filter_map(|p| i32::try_from(p).ok())
        .collect();
    for child in &mut children {
        let status = loop {
            tokio::select! {
                status = child.wait() => break status.context("cannot wait for an agent")?,
                _ = sigterm.recv() => forward_term(&pids),
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        codes.push(exit_code_of(status));
    }
    for p in pumps {
        let _ = p.await;
    }
    let job = job_code(&codes);
    eprintln!("muster dry-run: agents exited with {codes:?}; job exit code {job}");
    Ok(job)
}

/// The agents share our process group, so a terminal's Ctrl-C already reaches them; a SIGTERM
/// (from a supervisor) is passed on to each agent.
fn forward_term(pids: &[i32]) {
    for &pid in pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
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

/// 0 when all agents succeeded; else node 0's code if it failed, else the first failure.
pub fn job_code(codes: &[u8]) -> u8 {
    match codes.first() {
        Some(&c) if c != 0 => c,
        _ => codes.iter().copied().find(|&c| c != 0).unwrap_or(0),
    }
}

async fn pump<R, W>(from: R, mut to: W, prefix: String)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut lines = BufReader::new(from).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let text = format!("{prefix}{line}\n");
        if to.write_all(text.as_bytes()).await.is_err() {
            break;
        }
        let _ = to.flush().await;
    }
}

#[cfg(test)]
mod tests {
    use super::job_code;

    #[test]
    fn the_job_code_is_node_0s_failure_or_the_first_one() {
        assert_eq!(job_code(&[0, 0, 0]), 0);
        assert_eq!(job_code(&[3, 1, 0]), 3);
        assert_eq!(job_code(&[0, 205, 7]), 205);
        assert_eq!(job_code(&[]), 0);
    }
}
