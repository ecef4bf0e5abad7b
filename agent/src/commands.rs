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

/// Entry point used by the binary.
pub fn main(args: Vec<OsString>) -> ExitCode {
    let code = match run(args) {
        Ok(code) => code,
        Err(err) => {
            let code = exit_code::for_error(&err);
            // `{:#}` prints the whole context chain on one line, which is what a pod log wants.
            eprintln!("muster: error: {err:#}");
            code
        }
    };
    exit_code::to_exit_code(code)
}

fn run(args: Vec<OsString>) -> anyhow::Result<u8> {
    let subcommand = args.get(1).and_then(|a| a.to_str()).unwrap_or_default();
    match subcommand {
        "store" => crate::store_cmd::run(args),
        "gpu-check" => crate::gpu::run_cli(&args),
        "dry-run" => crate::dry_run::run(&args),
        _ => crate::cli::run(&args),
    }
}
