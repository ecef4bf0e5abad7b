//! The command line's first word decides between muster's own subcommands and the
//! torchrun-compatible launch form; one module per command, and the one place where an outcome
//! becomes an exit code (ripgrep's shape: `main` → `run` → `Result<u8>`).
//!
//! `muster store ...` ([`store`]), `muster gpu-check ...` ([`gpu_check`]), `muster dry-run
//! ...` ([`dry_run`]) and `muster stacks` ([`stacks`]) are subcommands; anything else (`muster
//! --nproc-per-node 4 train.py`,
//! [`launch`]) is the drop-in form of `torchrun`. A training script that happens to be called
//! `store` is still reachable as `./store` or `muster -- store`.
//!
//! What the commands share lives here: [`parse_subcommand`] (clap's help, version and errors,
//! the same way for every subcommand), [`cancel_on_termination`] (SIGTERM/SIGINT for the
//! commands without workers), and [`exit_code_of`] with the error line. Their diagnostics are set
//! up by [`crate::logs::init_tracing`].

#[cfg(test)]
mod doc_check;
pub mod dry_run;
pub mod gpu_check;
pub mod launch;
pub mod stacks;
pub mod store;

use std::ffi::OsString;
use std::process::ExitCode;

use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::exit_code::{self, Coded, Exit};
use crate::launch::signals::{Repeat, StopSignals};
use crate::logs::LogFormat;

/// Entry point used by the binary.
pub fn main(args: &[OsString]) -> ExitCode {
    let code = match run(args) {
        Ok(code) => code,
        Err(err) => {
            let code = exit_code_of(&err);
            // Parsed again only here: a launch that starts pays nothing for its error's format.
            let format = match subcommand(args) {
                "store" | "gpu-check" | "dry-run" | "stacks" => LogFormat::Text,
                _ => crate::cli::requested_log_format(args),
            };
            eprint!("{}", error_record(&err, code, format));
            code
        }
    };
    ExitCode::from(code)
}

fn subcommand(args: &[OsString]) -> &str {
    args.get(1).and_then(|a| a.to_str()).unwrap_or_default()
}

fn run(args: &[OsString]) -> anyhow::Result<u8> {
    match subcommand(args) {
        "store" => store::run(args),
        "gpu-check" => gpu_check::run(args),
        "dry-run" => dry_run::run(args),
        "stacks" => stacks::run(args),
        _ => launch::run(args),
    }
}

/// The exit code of an error: the first error in its chain that knows its code
/// ([`exit_code::Coded`]), else [`exit_code::INTERNAL_ERROR`].
pub fn exit_code_of(err: &anyhow::Error) -> u8 {
    err.chain()
        .find_map(coded)
        .unwrap_or(exit_code::INTERNAL_ERROR)
}

/// The code of one error of a chain, if its type has one. Every error type that implements
/// [`Coded`] is listed here.
fn coded(err: &(dyn std::error::Error + 'static)) -> Option<u8> {
    fn code<E: Coded + std::error::Error + 'static>(
        err: &(dyn std::error::Error + 'static),
    ) -> Option<u8> {
        err.downcast_ref::<E>().map(Coded::exit_code)
    }
    code::<Exit>(err)
        .or_else(|| code::<crate::launch::LaunchError>(err))
        .or_else(|| code::<crate::checkpoint::controller::StartError>(err))
        .or_else(|| code::<crate::cli::hiargs::ConfigError>(err))
}

/// The whole chain on one line (what a pod log wants), each cause once: the typed errors
/// already name their source in their own message, and it is not repeated.
fn one_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// The line that reports a failed run: `muster: error: ...`, or with `--log-format json` a record
/// of the log schema (event `error`) so that a JSON log stays parseable to its last line.
fn error_record(err: &anyhow::Error, code: u8, format: LogFormat) -> String {
    let message = one_line(err);
    match format {
        LogFormat::Text => format!("muster: error: {message}\n"),
        LogFormat::Json => {
            let mut extra = serde_json::Map::new();
            extra.insert("event".into(), "error".into());
            extra.insert("agent_exit_code".into(), code.into());
            crate::logs::record::agent_record("ERROR", &crate::host::short_name(), &message, extra)
        }
    }
}

/// Parses a clap subcommand (`args[0]` is the binary, `args[1]` the subcommand's name) the way
/// every subcommand does: `--help`/`--version` print and give `None` (exit 0); a mistake is a
/// configuration error carrying clap's message, with its usage line naming `bin_name`, less
/// clap's own `error: ` (the one place that prints errors adds `muster: error: `).
pub fn parse_subcommand<T: clap::Parser>(
    bin_name: &'static str,
    args: &[OsString],
) -> Result<Option<T>, Exit> {
    // argv[1] is the subcommand: clap reads it as the program name, and its usage line says
    // `muster <subcommand>` only when the binary name is set explicitly.
    let parsed = T::command()
        .bin_name(bin_name)
        .try_get_matches_from(args.iter().skip(1))
        .and_then(|matches| T::from_arg_matches(&matches));
    match parsed {
        Ok(parsed) => Ok(Some(parsed)),
        Err(err) if !err.use_stderr() => {
            print!("{err}");
            Ok(None)
        }
        Err(err) => {
            let text = err.to_string();
            let text = text.trim_end();
            Err(Exit::config(text.strip_prefix("error: ").unwrap_or(text)))
        }
    }
}

/// Cancels `token` on the first SIGTERM or SIGINT; an insistent second one (see [`Repeat`]) ends
/// the process at once with 128+N, for a stop that hangs. Handlers are installed before this
/// returns, so no signal can slip through between the call and the first await. For the
/// commands without workers; a launch has its own handling ([`crate::launch::signals`]).
pub fn cancel_on_termination(token: CancellationToken) -> std::io::Result<JoinHandle<()>> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(tokio::spawn(async move {
        let mut seen = StopSignals::default();
        loop {
            let sig = tokio::select! {
                _ = term.recv() => libc::SIGTERM,
                _ = int.recv() => libc::SIGINT,
            };
            match seen.arrived(Instant::now()) {
                Repeat::First => token.cancel(),
                Repeat::Duplicate => {}
                Repeat::Insistent => {
                    tracing::warn!("signal {sig} again while stopping: exiting now");
                    std::process::exit(i32::from(exit_code::for_signal(sig)));
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_one_line_in_either_format() {
        let err = anyhow::Error::new(Exit::config("invalid --nnodes `x`"));
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

    #[test]
    fn the_code_is_found_by_walking_the_chain() {
        let err = anyhow::Error::new(Exit::new(exit_code::RENDEZVOUS_TIMEOUT, "nodes 2 missing"))
            .context("launch failed");
        assert_eq!(exit_code_of(&err), exit_code::RENDEZVOUS_TIMEOUT);
        assert_eq!(
            exit_code_of(&anyhow::anyhow!("boom")),
            exit_code::INTERNAL_ERROR
        );
        // A typed launch error keeps its kind up to here.
        let lost = anyhow::Error::new(crate::launch::LaunchError::StoreHostLost("reset".into()))
            .context("the launch ended");
        assert_eq!(exit_code_of(&lost), exit_code::STORE_HOST_LOST);
        let tmp = anyhow::Error::new(crate::launch::LaunchError::TmpDir {
            path: "/ro/x".into(),
            source: std::io::Error::from(std::io::ErrorKind::ReadOnlyFilesystem),
        });
        assert_eq!(exit_code_of(&tmp), exit_code::CONFIG_ERROR);
    }

    #[test]
    fn a_source_named_in_its_error_is_not_repeated() {
        let err = anyhow::Error::new(crate::launch::LaunchError::Spawn {
            program: "python".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        });
        let line = one_line(&err);
        assert_eq!(line.matches("No such file").count(), 1, "{line}");
        let io = std::io::Error::from_raw_os_error(libc::EMFILE);
        let err = anyhow::Error::new(io).context("cannot start the async runtime");
        assert!(
            one_line(&err).starts_with("cannot start the async runtime: Too many open files"),
            "{}",
            one_line(&err)
        );
    }
}
