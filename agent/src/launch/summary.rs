//! The root-cause report: which worker failed first and why, including the message a worker
//! wrapped in torch's `@record` left in its `TORCHELASTIC_ERROR_FILE`.

use std::path::Path;

use super::Failure;

/// The message of a torch error file: `{"message": {"message": "...", "extraInfo": {...}}}`, or a
/// plain `{"message": "..."}`.
pub fn error_file_message(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let m = v.get("message")?;
    let msg = match m {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => o.get("message")?.as_str()?.to_owned(),
        _ => return None,
    };
    Some(msg.trim().to_owned())
}

/// The summary lines printed at the end of a failed run.
pub fn render(failure: &Failure, attempts: u32) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
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
    match &failure.message {
        Some(m) => {
            for line in m.lines() {
                let _ = writeln!(out, "muster:   error: {line}");
            }
        }
        None => {
            let _ = writeln!(
                out,
                "muster:   error: (no error file; decorate the worker's main with \
                 torch.distributed.elastic.multiprocessing.errors.record to capture it)"
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::reaper::ExitStatus;
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
        assert_eq!(error_file_message(&f).as_deref(), Some("ValueError: boom"));
        std::fs::write(&f, r#"{"message": "plain"}"#).unwrap();
        assert_eq!(error_file_message(&f).as_deref(), Some("plain"));
        std::fs::write(&f, "not json").unwrap();
        assert_eq!(error_file_message(&f), None);
        assert_eq!(error_file_message(&dir.join("missing")), None);
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
        };
        let text = render(&f, 1);
        assert!(
            text.contains("host: node-0  rank: 5 (local_rank 1)"),
            "{text}"
        );
        assert!(text.contains("signal SIGSEGV (11)"), "{text}");
    }
}
