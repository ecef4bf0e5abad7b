//! The command line's first word decides between muster's own subcommands and the
//! torchrun-compatible launch form, and this is the one place where an outcome becomes an exit
//! code (ripgrep's shape: `main` → `run` → `Result<u8>`).
//!
//! `muster store ...`, `muster gpu-check ...` and `muster dry-run ...` are subcommands; anything
//! else (`muster --nproc-per-node 4 train.py`) is the drop-in form of `torchrun`. A training script
//! that happens to be called `store` is still reachable as `./store` or `muster -- store`.

use std::ffi::OsString;
use std::process::ExitCode;

use crate::exit_code;
use crate::launch::config::LogFormat;

/// Entry point used by the binary.
pub fn main(args: Vec<OsString>) -> ExitCode {
    let format = match subcommand(&args) {
        "store" | "gpu-check" | "dry-run" => LogFormat::Text,
        _ => crate::cli::requested_log_format(&args),
    };
    let code = match run(args) {
        Ok(code) => code,
        Err(err) => {
            let code = exit_code::for_error(&err);
            eprint!("{}", error_record(&err, code, format));
            code
        }
    };
    exit_code::to_exit_code(code)
}

/// The line that reports a failed run: `muster: error: ...`, or with `--log-format json` a record
/// of the log schema (event `error`) so that a JSON log stays parseable to its last line.
fn error_record(err: &anyhow::Error, code: u8, format: LogFormat) -> String {
    // `{:#}` prints the whole context chain on one line, which is what a pod log wants.
    match format {
        LogFormat::Text => format!("muster: error: {err:#}\n"),
        LogFormat::Json => {
            let mut extra = serde_json::Map::new();
            extra.insert("event".into(), "error".into());
            extra.insert("agent_exit_code".into(), code.into());
            crate::logs::record::agent_record(
                "ERROR",
                &crate::host::short_name(),
                &format!("{err:#}"),
                extra,
            )
        }
    }
}

fn subcommand(args: &[OsString]) -> &str {
    args.get(1).and_then(|a| a.to_str()).unwrap_or_default()
}

fn run(args: Vec<OsString>) -> anyhow::Result<u8> {
    match subcommand(&args) {
        "store" => crate::store_cmd::run(args),
        "gpu-check" => crate::gpu::run_cli(&args),
        "dry-run" => crate::dry_run::run(&args),
        _ => crate::cli::run(&args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_one_line_in_either_format() {
        let err = anyhow::Error::new(exit_code::Exit::config("invalid --nnodes `x`"));
        assert_eq!(
            error_record(&err, 202, LogFormat::Text),
            "muster: error: invalid --nnodes `x`\n"
        );
        let line = error_record(&err, 202, LogFormat::Json);
        assert!(line.ends_with('\n') && line.matches('\n').count() == 1);
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            (v["event"].as_str(), v["level"].as_str()),
            (Some("error"), Some("ERROR"))
        );
        assert_eq!(v["agent_exit_code"], 202);
        assert_eq!(v["msg"], "invalid --nnodes `x`");
    }
}
