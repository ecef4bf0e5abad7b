//! Runs a helper process with a hard time limit and reads the JSON it prints: the CUDA smoke
//! test and the isolated pre-flight both run this way, because a sick GPU can hang a driver call
//! forever and only a killable process gives a real timeout.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde::de::DeserializeOwned;

/// Starts `cmd`, kills it after `timeout`, and parses its stdout (the whole of it, or else its
/// last line) as `T`. `what` names the work in the timeout message.
pub fn run_json<T: DeserializeOwned>(
    mut cmd: Command,
    timeout: Duration,
    what: &str,
) -> Result<T, String> {
    // Its own process group, so a timeout kills whatever it started too (a helper that keeps
    // our pipes open would otherwise outlive the kill).
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Its own group also keeps it from a terminal's Ctrl-C, so it must die with us instead: a
    // `muster gpu-check` or agent killed mid-check leaves no hung CUDA helper behind. This thread
    // waits for the child below, so it outlives it (PR_SET_PDEATHSIG is per thread).
    crate::sys::die_with_parent(&mut cmd, nix::unistd::getpid());
    let mut child = cmd.spawn().map_err(|e| format!("spawn: {e}"))?;
    // Drain both pipes while the child runs: a report larger than the pipe buffer would
    // otherwise block the child until the timeout.
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let kill = |child: &mut std::process::Child| {
        if let Ok(pid) = i32::try_from(child.id()) {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
    };
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() >= deadline => {
                kill(&mut child);
                break Err(format!(
                    "timed out after {:.0} s ({what})",
                    timeout.as_secs_f64()
                ));
            }
            Ok(None) => thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                kill(&mut child);
                break Err(format!("wait: {e}"));
            }
        }
    };
    // The pipes close when the group is gone; a descendant that escaped the group and still
    // holds them must not hold us, so the readers get a short grace and are then abandoned.
    let stdout = out.recv_timeout(PIPE_GRACE).unwrap_or_default();
    let stderr = err.recv_timeout(PIPE_GRACE).unwrap_or_default();
    let status = status?;
    serde_json::from_str(&stdout)
        .or_else(|_| serde_json::from_str(stdout.lines().last().unwrap_or_default()))
        .map_err(|_| {
            format!(
                "child exited with {status} without a report{}",
                stderr
                    .lines()
                    .last()
                    .map(|l| format!(": {l}"))
                    .unwrap_or_default()
            )
        })
}

/// How long to wait for a pipe to close after the child is gone.
const PIPE_GRACE: Duration = Duration::from_secs(2);

/// Reads `pipe` to the end on its own thread; the text arrives on the returned channel.
fn drain(pipe: Option<Box<dyn Read + Send>>) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_string(&mut text);
        }
        let _ = tx.send(text);
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(script);
        cmd
    }

    #[test]
    fn parses_the_report_even_when_it_is_large() {
        // 200 KB of output: more than a pipe buffer holds.
        let v: Vec<u32> = run_json(
            sh("printf '['; i=0; while [ $i -lt 40000 ]; do printf '1,'; i=$((i+1)); done; printf '1]'"),
            Duration::from_secs(30),
            "test",
        )
        .unwrap();
        assert_eq!(v.len(), 40001);
        let last: u32 = run_json(sh("echo noise; echo 7"), Duration::from_secs(5), "test").unwrap();
        assert_eq!(last, 7);
    }

    #[test]
    fn a_hung_child_is_killed_at_the_deadline() {
        let started = Instant::now();
        let err =
            run_json::<u32>(sh("sleep 30"), Duration::from_millis(300), "hung GPU").unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(err, "timed out after 0 s (hung GPU)");
    }

    #[test]
    fn a_child_without_a_report_says_why() {
        let err =
            run_json::<u32>(sh("echo boom >&2; exit 3"), Duration::from_secs(5), "x").unwrap_err();
        assert!(
            err.contains("exit status: 3") && err.ends_with(": boom"),
            "{err}"
        );
    }
}
