//! The root-cause report: which worker failed first and why, including the message a worker
//! wrapped in torch's `@record` left in its `TORCHELASTIC_ERROR_FILE`.

use std::path::{Path, PathBuf};

use super::gang_cause::GangCause;
use super::reaper::ExitStatus;
use super::Failure;

/// What a worker left in its `TORCHELASTIC_ERROR_FILE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFile {
    pub message: String,
    /// Seconds since the epoch, when the worker recorded the error.
    pub timestamp: Option<u64>,
}

/// Reads a torch error file: `{"message": {"message": "...", "extraInfo": {"timestamp": "..."}}}`
/// (what `@record` writes), or a plain `{"message": "..."}`.
pub fn read_error_file(path: &Path) -> Option<ErrorFile> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let m = v.get("message")?;
    let (message, timestamp) = match m {
        serde_json::Value::String(s) => (s.clone(), None),
        serde_json::Value::Object(o) => {
            let ts = o.get("extraInfo").and_then(|e| e.get("timestamp"));
            let ts = ts.and_then(|t| {
                t.as_u64()
                    .or_else(|| t.as_str().and_then(|s| s.trim().parse().ok()))
            });
            (o.get("message")?.as_str()?.to_owned(), ts)
        }
        _ => return None,
    };
    Some(ErrorFile {
        message: message.trim().to_owned(),
        timestamp,
    })
}

/// The summary lines printed at the end of a failed run.
pub fn render(failure: &Failure, attempts: u32) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if let Some(hang) = &failure.hang {
        return render_hang(failure, hang, attempts);
    }
    let _ = writeln!(
        out,
        "muster: worker group failed after {attempts} attempt(s); root cause (first observed failure):"
    );
    let _ = writeln!(
        out,
        "muster:   time: {}  host: {}  rank: {} (local_rank {})  pid: {}",
        crate::logs::utc_timestamp(failure.at),
        failure.host,
        failure.rank,
        failure.local_rank,
        failure.pid
    );
    let _ = writeln!(out, "muster:   {}", failure.status);
    if let Some(line) = failure.oom_line() {
        let _ = writeln!(out, "muster:   {line}");
    }
    match &failure.message {
        Some(m) => {
            for line in m.lines() {
                let _ = writeln!(out, "muster:   error: {line}");
            }
        }
        None => match &failure.exception_line {
            Some(line) => {
                let _ = writeln!(out, "muster:   error: {line}");
                let _ = writeln!(
                    out,
                    "muster:   (the last exception line of its stderr; no error file: decorate the \
                     worker's main with torch.distributed.elastic.multiprocessing.errors.record \
                     for the whole message)"
                );
            }
            // `@record` cannot help here: the OOM killer's SIGKILL gives the worker no chance
            // to write anything.
            None if failure.oom_killed.is_some() => {
                let _ = writeln!(
                    out,
                    "muster:   error: (no error file: a worker killed by the OOM killer cannot \
                     write one)"
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "muster:   error: (no error file; decorate the worker's main with \
                     torch.distributed.elastic.multiprocessing.errors.record to capture it)"
                );
            }
        },
    }
    out
}

/// The summary when the gang's root cause is on another node ([`GangCause::elsewhere`]): that
/// failure first, then what followed on this node (`local`: this node's own first failure; `None`
/// when its workers were only stopped by the gang).
pub fn render_gang(cause: &GangCause, attempts: u32) -> String {
    use std::fmt::Write as _;
    let root = &cause.root;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "muster: worker group failed after {attempts} attempt(s); root cause (first failure in the gang, on node {}):",
        root.node_rank
    );
    let _ = writeln!(
        out,
        "muster:   time: {}  node: {} ({})  rank: {} (local_rank {})  pid: {}",
        crate::logs::utc_timestamp(cause.root_at()),
        root.node_rank,
        root.host,
        root.rank,
        root.local_rank,
        root.pid
    );
    let _ = writeln!(out, "muster:   {}", root.status);
    match &root.error {
        Some(error) => {
            for line in error.lines() {
                let _ = writeln!(out, "muster:   error: {line}");
            }
        }
        None => {
            let _ = writeln!(
                out,
                "muster:   error: (none recorded; node {}'s log has that rank's output)",
                root.node_rank
            );
        }
    }
    if cause.passed_over > 0 {
        let _ = writeln!(
            out,
            "muster:   ({} failure(s) reached the store earlier, each reading as a lost peer's consequence)",
            cause.passed_over
        );
    }
    match cause.followed() {
        Some(followed) => {
            let _ = writeln!(out, "muster:   what followed: {followed}");
        }
        None => {
            let _ = writeln!(
                out,
                "muster:   what followed: this node's workers were stopped when the gang ended"
            );
        }
    }
    out
}

/// [`render_gang`] as one record of the JSON log schema, event `root_cause`: the fields describe
/// the gang's root cause, `node_rank`/`cause_host` say where it was, `followed_on_this_node` what
/// this node's own ranks did.
pub fn render_gang_json(
    cause: &GangCause,
    attempts: u32,
    agent_exit_code: u8,
    host: &str,
) -> String {
    let root = &cause.root;
    let msg = format!(
        "worker group failed after {attempts} attempt(s); root cause (first failure in the gang): {}",
        root.describe()
    );
    let serde_json::Value::Object(mut extra) = serde_json::json!({
        "event": "root_cause",
        "attempts": attempts,
        "failed_at": crate::logs::utc_timestamp(cause.root_at()),
        "node_rank": root.node_rank,
        "cause_host": root.host,
        "rank": root.rank,
        "local_rank": root.local_rank,
        "pid": root.pid,
        "exit_code": root.worker_exit_code,
        "signal": root.signal,
        "agent_exit_code": agent_exit_code,
        "error": root.error,
    }) else {
        unreachable!("a json! object literal is an object")
    };
    if let (Some(own), Some(after_ms)) = (&cause.this_node, cause.followed_after_ms()) {
        extra.insert(
            "followed_on_this_node".into(),
            serde_json::json!({
                "rank": own.rank,
                "local_rank": own.local_rank,
                "status": own.status,
                "error": own.error,
                "after_ms": after_ms,
            }),
        );
    }
    crate::logs::record::agent_record("ERROR", host, &msg, extra)
}

/// The restart warning's account of the failed rank: the OOM killer's kill named as such, else
/// "rank 3 failed (signal SIGSEGV (11))".
pub fn restart_reason(failure: &Failure) -> String {
    failure
        .oom_line()
        .unwrap_or_else(|| format!("rank {} failed ({})", failure.rank, failure.status))
}

/// The summary of a hung attempt: node, rank, last step, seconds without progress, the
/// innermost frame.
fn render_hang(failure: &Failure, hang: &crate::watch::Hang, attempts: u32) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "muster: worker group hung after {attempts} attempt(s); root cause (the rank that stopped progressing):"
    );
    let _ = writeln!(
        out,
        "muster:   node: {} ({})  rank: {} (local_rank {})  pid: {}",
        hang.node_rank, hang.host, hang.rank, hang.local_rank, failure.pid
    );
    let step = hang
        .last_step
        .map_or_else(|| "none".to_owned(), |s| s.to_string());
    let place = hang
        .section
        .as_ref()
        .map_or_else(String::new, |s| format!(" inside section {s:?}"));
    if hang.working {
        let _ = writeln!(
            out,
            "muster:   last step: {step}  no step for {:.1} s, working outside torch.distributed while its peers waited (limit {} s)",
            hang.stalled.as_secs_f64(),
            hang.limit.as_secs_f64()
        );
    } else {
        let _ = writeln!(
            out,
            "muster:   last step: {step}  no progress{place} for {:.1} s (limit {} s)",
            hang.stalled.as_secs_f64(),
            hang.limit.as_secs_f64()
        );
    }
    let _ = writeln!(
        out,
        "muster:   innermost frame: {}",
        hang.frame.as_deref().unwrap_or("(unknown)")
    );
    let _ = writeln!(
        out,
        "muster:   stacks: {}; every rank's are in the log above",
        hang.stacks
    );
    if let Some(node) = hang.reported_by {
        let _ = writeln!(out, "muster:   detected first by node {node}");
    }
    let _ = writeln!(out, "muster:   stopped by the agent: {}", failure.status);
    out
}

/// The summary's line naming the NCCL flight recorder's dumps of the failed attempt (nothing
/// when there are none). Dumps under `removed` (muster's private run directory, which goes with
/// the agent when there is no `--log-dir`) are only counted.
pub fn render_flight_recorder(failure: &Failure, removed: Option<&Path>) -> String {
    use std::fmt::Write as _;
    let (gone, kept) = split_dumps(failure, removed);
    let mut out = String::new();
    if !kept.is_empty() {
        let names: Vec<String> = kept.iter().map(|p| p.display().to_string()).collect();
        let _ = writeln!(
            out,
            "muster:   NCCL flight recorder dumps (each rank's last collectives): {}",
            names.join(", ")
        );
    }
    if gone > 0 {
        let _ = writeln!(
            out,
            "muster:   {gone} NCCL flight recorder dump(s) were written into muster's private \
             directory, which is removed when the agent exits: pass --log-dir to keep them"
        );
    }
    out
}

/// How many dumps lie under `removed`, and the others.
fn split_dumps<'a>(failure: &'a Failure, removed: Option<&Path>) -> (usize, Vec<&'a Path>) {
    let (gone, kept): (Vec<&Path>, Vec<&Path>) = failure
        .flight_recorder
        .iter()
        .map(PathBuf::as_path)
        .partition(|p| removed.is_some_and(|dir| p.starts_with(dir)));
    (gone.len(), kept)
}

/// The summary's lines about this node's GPUs (from [`crate::gpu::watch::Watch::summary_lines`]);
/// nothing when the watch saw nothing.
pub fn render_gpu_events(lines: &[String]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if lines.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "muster:   GPU events on this node in the last {} minutes:",
        crate::gpu::watch::SUMMARY_WINDOW.as_secs() / 60
    );
    for line in lines {
        let _ = writeln!(out, "muster:     {line}");
    }
    out
}

/// [`render_gpu_events`] as one record of the JSON log schema, event `gpu_events`; nothing when
/// there are none.
pub fn render_gpu_events_json(host: &str, lines: &[String]) -> String {
    if lines.is_empty() {
        return String::new();
    }
    let serde_json::Value::Object(extra) = serde_json::json!({
        "event": "gpu_events",
        "gpu_events": lines,
    }) else {
        unreachable!("a json! object literal is an object")
    };
    let msg = format!(
        "GPU events on this node before the failure: {}",
        lines.join("; ")
    );
    crate::logs::record::agent_record("WARN", host, &msg, extra)
}

/// The same report as one record of the JSON log schema ([`crate::logs::record`]), event
/// `root_cause`. `error_file` names the worker's error file only when `files_kept` (the run
/// directory outlives the agent: `--log-dir`) and the worker wrote one; otherwise the field is
/// left out, since the agent removes its private run directory when it exits.
/// `removed`: muster's private run directory when it goes with the agent (flight-recorder dumps
/// under it are only counted, as in [`render_flight_recorder`]).
pub fn render_json(
    failure: &Failure,
    attempts: u32,
    files_kept: bool,
    removed: Option<&Path>,
) -> String {
    let (exit_code, signal) = match failure.status {
        ExitStatus::Exited(c) => (Some(c), None),
        ExitStatus::Signaled(s) => (None, Some(s.as_str())),
    };
    let mut msg = match &failure.hang {
        Some(hang) => format!(
            "worker group hung after {attempts} attempt(s); root cause: {}",
            hang.describe()
        ),
        None => format!(
            "worker group failed after {attempts} attempt(s); root cause: rank {} (local_rank {}, pid {}) {}",
            failure.rank, failure.local_rank, failure.pid, failure.status
        ),
    };
    let first_line = failure
        .message
        .as_deref()
        .and_then(|m| m.lines().next())
        .or(failure.exception_line.as_deref());
    if let Some(oom) = failure.oom_line() {
        msg.push_str(": ");
        msg.push_str(&oom);
    }
    if let Some(first) = first_line {
        msg.push_str(": ");
        msg.push_str(first);
    }
    let serde_json::Value::Object(mut extra) = serde_json::json!({
        "event": "root_cause",
        "attempts": attempts,
        "failed_at": crate::logs::utc_timestamp(failure.at),
        "rank": failure.rank,
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exit_code": exit_code,
        "signal": signal,
        "agent_exit_code": failure.exit_code(),
        "error": failure.message,
    }) else {
        unreachable!("a json! object literal is an object")
    };
    if let Some(line) = &failure.exception_line {
        extra.insert("exception_line".into(), line.clone().into());
    }
    if let Some(limit) = failure.oom_killed {
        extra.insert(
            "oom_killed".into(),
            serde_json::json!({ "memory_limit_bytes": limit }),
        );
    }
    if let Some(hang) = &failure.hang {
        extra.insert(
            "hang".into(),
            serde_json::json!({
                "node_rank": hang.node_rank,
                "last_step": hang.last_step,
                "seconds_without_progress": hang.stalled.as_secs_f64(),
                "limit_seconds": hang.limit.as_secs_f64(),
                "section": hang.section,
                "innermost_frame": hang.frame,
                "stacks": hang.stacks,
                "reported_by": hang.reported_by,
            }),
        );
    }
    let (gone, kept) = split_dumps(failure, removed);
    if !kept.is_empty() {
        let names: Vec<String> = kept
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        extra.insert("flight_recorder_dumps".into(), names.into());
    }
    if gone > 0 {
        extra.insert("flight_recorder_dumps_removed".into(), gone.into());
    }
    if files_kept && failure.error_file.is_file() {
        extra.insert(
            "error_file".into(),
            failure.error_file.to_string_lossy().into(),
        );
    }
    crate::logs::record::agent_record("ERROR", &failure.host, &msg, extra)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn reads_record_error_files() {
        let dir = std::env::temp_dir().join(format!("muster-summary-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("error.json");
        std::fs::write(
            &f,
            r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "...", "timestamp": "1"}}}"#,
        )
        .unwrap();
        assert_eq!(
            read_error_file(&f),
            Some(ErrorFile {
                message: "ValueError: boom".into(),
                timestamp: Some(1)
            })
        );
        std::fs::write(&f, r#"{"message": "plain"}"#).unwrap();
        assert_eq!(
            read_error_file(&f).map(|e| e.message).as_deref(),
            Some("plain")
        );
        std::fs::write(&f, "not json").unwrap();
        assert_eq!(read_error_file(&f), None);
        assert_eq!(read_error_file(&dir.join("missing")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn summary_names_the_worker_and_the_signal() {
        let f = Failure {
            host: "node-0".into(),
            local_rank: 1,
            rank: 5,
            pid: 42,
            status: ExitStatus::Signaled(nix::sys::signal::Signal::SIGSEGV),
            at: UNIX_EPOCH,
            error_file: "e".into(),
            message: None,
            exception_line: None,
            oom_killed: None,
            hang: None,
            flight_recorder: Vec::new(),
        };
        let text = render(&f, 1);
        assert!(
            text.contains("host: node-0  rank: 5 (local_rank 1)"),
            "{text}"
        );
        assert!(text.contains("signal SIGSEGV (11)"), "{text}");
    }

    #[test]
    fn flight_recorder_dumps_are_named_unless_they_go_with_the_agent() {
        let mut f = Failure {
            host: "node-0".into(),
            local_rank: 0,
            rank: 2,
            pid: 42,
            status: ExitStatus::Signaled(nix::sys::signal::Signal::SIGABRT),
            at: UNIX_EPOCH,
            error_file: PathBuf::new(),
            message: None,
            exception_line: None,
            oom_killed: None,
            hang: None,
            flight_recorder: Vec::new(),
        };
        assert_eq!(render_flight_recorder(&f, None), "");
        f.flight_recorder = vec![
            PathBuf::from("/logs/job_x/attempt_0/nccl_trace_rank_2"),
            PathBuf::from("/logs/job_x/attempt_0/nccl_trace_rank_3"),
        ];
        assert_eq!(
            render_flight_recorder(&f, None),
            "muster:   NCCL flight recorder dumps (each rank's last collectives): \
             /logs/job_x/attempt_0/nccl_trace_rank_2, /logs/job_x/attempt_0/nccl_trace_rank_3\n"
        );
        let v: serde_json::Value = serde_json::from_str(&render_json(&f, 1, true, None)).unwrap();
        assert_eq!(
            v["flight_recorder_dumps"][1],
            "/logs/job_x/attempt_0/nccl_trace_rank_3"
        );
        let private = Path::new("/logs/job_x");
        let text = render_flight_recorder(&f, Some(private));
        assert!(
            text.starts_with("muster:   2 NCCL flight recorder dump(s)"),
            "{text}"
        );
        assert!(text.contains("pass --log-dir"), "{text}");
        let v: serde_json::Value =
            serde_json::from_str(&render_json(&f, 1, false, Some(private))).unwrap();
        assert_eq!(v["flight_recorder_dumps_removed"], 2);
        assert!(v.get("flight_recorder_dumps").is_none());
    }

    #[test]
    fn without_an_error_file_the_last_exception_line_of_stderr_is_shown() {
        let f = Failure {
            host: "node-0".into(),
            local_rank: 0,
            rank: 2,
            pid: 42,
            status: ExitStatus::Exited(1),
            at: UNIX_EPOCH,
            error_file: "e".into(),
            message: None,
            exception_line: Some("ValueError: bad batch".into()),
            oom_killed: None,
            hang: None,
            flight_recorder: Vec::new(),
        };
        let text = render(&f, 1);
        assert!(
            text.contains("muster:   error: ValueError: bad batch\n"),
            "{text}"
        );
        assert!(
            text.contains("the last exception line of its stderr"),
            "{text}"
        );
        let v: serde_json::Value = serde_json::from_str(&render_json(&f, 1, false, None)).unwrap();
        assert!(
            v["msg"]
                .as_str()
                .unwrap()
                .ends_with("exit code 1: ValueError: bad batch"),
            "{v}"
        );
        assert_eq!(v["exception_line"], "ValueError: bad batch");
    }

    #[test]
    fn an_oom_kill_is_named_and_keeps_137() {
        let mut f = Failure {
            host: "node-0".into(),
            local_rank: 3,
            rank: 3,
            pid: 42,
            status: ExitStatus::Signaled(nix::sys::signal::Signal::SIGKILL),
            at: UNIX_EPOCH,
            error_file: "e".into(),
            message: None,
            exception_line: None,
            oom_killed: Some(Some(8 << 30)),
            hang: None,
            flight_recorder: Vec::new(),
        };
        assert_eq!(f.exit_code(), 137);
        let text = render(&f, 1);
        assert!(
            text.contains(
                "muster:   rank 3 was killed by the kernel OOM killer (container memory limit 8.0 GiB)\n"
            ),
            "{text}"
        );
        // No advice to add `@record`, which a SIGKILLed worker never reaches.
        assert!(
            text.contains("killed by the OOM killer cannot write one"),
            "{text}"
        );
        assert!(!text.contains("errors.record"), "{text}");
        assert_eq!(
            restart_reason(&f),
            "rank 3 was killed by the kernel OOM killer (container memory limit 8.0 GiB)"
        );
        let v: serde_json::Value = serde_json::from_str(&render_json(&f, 1, false, None)).unwrap();
        assert_eq!(v["oom_killed"]["memory_limit_bytes"], 8u64 << 30);
        f.oom_killed = Some(None);
        assert!(render(&f, 1).contains("no container memory limit"));
        // A SIGKILL the cgroup did not count is some other sender's: the signal, and the advice.
        f.oom_killed = None;
        assert_eq!(restart_reason(&f), "rank 3 failed (signal SIGKILL (9))");
        assert!(render(&f, 1).contains("errors.record"));
    }

    #[test]
    fn a_hang_summary_names_node_rank_step_seconds_and_frame() {
        let hang = crate::watch::Hang {
            node_rank: 1,
            host: "node-1".into(),
            local_rank: 1,
            rank: 3,
            last_step: Some(15),
            stalled: std::time::Duration::from_millis(4200),
            limit: std::time::Duration::from_secs(3),
            section: None,
            frame: Some("stuck_in_loader (/app/train.py:42)".into()),
            stacks: "read with py-spy".into(),
            reported_by: Some(0),
            working: false,
        };
        let f = Failure {
            host: "node-1".into(),
            local_rank: 1,
            rank: 3,
            pid: 42,
            status: ExitStatus::Signaled(nix::sys::signal::Signal::SIGTERM),
            at: UNIX_EPOCH,
            error_file: "e".into(),
            message: None,
            exception_line: None,
            oom_killed: None,
            hang: Some(Box::new(hang)),
            flight_recorder: Vec::new(),
        };
        assert_eq!(f.exit_code(), crate::exit_code::HUNG);
        let text = render(&f, 2);
        assert!(
            text.contains("worker group hung after 2 attempt(s)"),
            "{text}"
        );
        assert!(
            text.contains("node: 1 (node-1)  rank: 3 (local_rank 1)"),
            "{text}"
        );
        assert!(
            text.contains("last step: 15  no progress for 4.2 s (limit 3 s)"),
            "{text}"
        );
        assert!(
            text.contains("innermost frame: stuck_in_loader (/app/train.py:42)"),
            "{text}"
        );
        assert!(text.contains("detected first by node 0"), "{text}");
        let v: serde_json::Value = serde_json::from_str(&render_json(&f, 2, false, None)).unwrap();
        assert_eq!(v["agent_exit_code"], 207);
        assert_eq!(v["hang"]["last_step"], 15);
        assert_eq!(
            v["hang"]["innermost_frame"],
            "stuck_in_loader (/app/train.py:42)"
        );
    }

    #[test]
    fn gpu_events_follow_the_summary_only_when_there_are_some() {
        assert_eq!(render_gpu_events(&[]), "");
        assert_eq!(render_gpu_events_json("h", &[]), "");
        let lines = vec!["GPU 3 (u, b): XID 79 (GPU has fallen off the bus) at 12:03:11 UTC, 4 s before rank 27 stopped".to_owned()];
        let text = render_gpu_events(&lines);
        assert_eq!(
            text,
            format!(
                "muster:   GPU events on this node in the last 5 minutes:\nmuster:     {}\n",
                lines[0]
            )
        );
        let v: serde_json::Value =
            serde_json::from_str(&render_gpu_events_json("node-0", &lines)).unwrap();
        assert_eq!(v["event"], "gpu_events");
        assert_eq!(v["gpu_events"][0], lines[0].as_str());
        assert!(v["msg"].as_str().unwrap().contains("XID 79"));
    }

    #[test]
    fn json_summary_names_only_an_error_file_that_stays() {
        let dir = std::env::temp_dir().join(format!("muster-summary-json-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let error_file = dir.join("error.json");
        std::fs::write(&error_file, "{}").unwrap();
        let f = Failure {
            host: "node-0".into(),
            local_rank: 1,
            rank: 5,
            pid: 42,
            status: ExitStatus::Exited(3),
            at: UNIX_EPOCH,
            error_file: error_file.clone(),
            message: Some("ValueError: boom\nmore".into()),
            exception_line: None,
            oom_killed: None,
            hang: None,
            flight_recorder: Vec::new(),
        };
        let parse = |kept| -> serde_json::Value {
            serde_json::from_str(&render_json(&f, 2, kept, None)).unwrap()
        };
        let v = parse(false);
        assert_eq!(v["event"], "root_cause");
        assert_eq!(
            (v["source"].as_str(), v["level"].as_str()),
            (Some("agent"), Some("ERROR"))
        );
        assert_eq!(
            (v["rank"].as_u64(), v["exit_code"].as_i64()),
            (Some(5), Some(3))
        );
        assert_eq!(v["error"], "ValueError: boom\nmore");
        assert!(
            v["msg"]
                .as_str()
                .unwrap()
                .ends_with("exit code 3: ValueError: boom"),
            "{v}"
        );
        assert!(
            v.get("error_file").is_none(),
            "the private run directory is removed at exit"
        );
        assert_eq!(
            parse(true)["error_file"],
            error_file.to_string_lossy().as_ref()
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(parse(true).get("error_file").is_none(), "no file, no field");
    }
}
