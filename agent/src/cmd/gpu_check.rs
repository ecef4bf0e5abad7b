//! `muster gpu-check`: check this node's GPUs and print the report (exit 0 healthy, 204
//! unhealthy); also the child the launch's isolated pre-flight runs (`--json`) and the CUDA
//! smoke test's child (`--cuda-smoke-child`).

use std::ffi::OsString;
use std::time::Duration;

use clap::Parser;

use crate::exit_code::{self, Exit};
use crate::gpu::{preflight, Policy, PreflightOptions};

/// `muster gpu-check`: check this node's GPUs and print the report.
#[derive(Debug, Parser)]
#[command(
    name = "muster gpu-check",
    about = "Check this node's GPUs (NVML health, NVLink topology, CUDA smoke test)",
    after_help = "Exit status: 0 healthy (warnings allowed), 204 unhealthy GPU, 202 bad usage.\n\
                  MUSTER_NVML_LIBRARY=<path> loads another libnvidia-ml.so (e.g. the test fake)."
)]
struct Args {
    /// GPUs this node must have; without it any count passes and a missing driver is fine.
    #[arg(long, value_name = "N")]
    expect_gpus: Option<u32>,
    /// Active NVLinks every GPU must have (default: as many as the best local GPU has).
    #[arg(long, value_name = "N")]
    expect_nvlinks: Option<u32>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Longest wait for an NVSwitch fabric that is still initialising, in seconds.
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = crate::cli::hiargs::parse_seconds_arg)]
    fabric_wait: Duration,
    /// Time between the two NVLink error-counter samples, in milliseconds (1 to 600000).
    #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    sample_interval_ms: u64,
    /// Do not run the CUDA smoke test.
    #[arg(long)]
    skip_cuda: bool,
    /// Time limit for the CUDA smoke test, in seconds.
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = crate::cli::hiargs::parse_seconds_arg)]
    cuda_timeout: Duration,
    /// Fail (instead of warn) when other compute processes already use a GPU.
    #[arg(long)]
    fail_on_processes: bool,
    /// Print the raw NVML snapshot (what every check looked at) as JSON instead of the report;
    /// used to record fixtures on real hardware.
    #[arg(long)]
    dump_snapshot: bool,
    /// Internal: run the CUDA smoke test in this process and print its JSON result.
    #[arg(long = "cuda-smoke-child", hide = true)]
    cuda_smoke_child: bool,
    /// Internal: GPU pairs for the child's peer copies ("0-1,2-3").
    #[arg(long, hide = true, value_name = "PAIRS")]
    peers: Option<String>,
}

/// `muster gpu-check ...` (`args[0]` is the binary, `args[1]` is `gpu-check`).
pub fn run(args: &[OsString]) -> anyhow::Result<u8> {
    let Some(args) = super::parse_subcommand::<Args>("muster gpu-check", args)? else {
        return Ok(exit_code::SUCCESS);
    };
    if args.cuda_smoke_child {
        let peers = crate::gpu::cuda::parse_peers(args.peers.as_deref().unwrap_or_default())
            .map_err(Exit::config)?;
        return Ok(crate::gpu::cuda::child_main(&peers));
    }
    let opts = PreflightOptions {
        nvml_library: crate::gpu::nvml::library_override(),
        policy: Policy {
            expected_gpus: args.expect_gpus,
            expected_nvlinks: args.expect_nvlinks,
            foreign_processes_fail: args.fail_on_processes,
            ..Policy::default()
        },
        sample_interval: Duration::from_millis(args.sample_interval_ms),
        fabric_wait: args.fabric_wait,
        fabric_poll: Duration::from_millis(200).min(args.fabric_wait),
        cuda: !args.skip_cuda,
        cuda_timeout: args.cuda_timeout,
    };
    if args.dump_snapshot {
        let node = crate::gpu::nvml::snapshot(&opts.nvml_options());
        println!("{}", serde_json::to_string_pretty(&node)?);
        return Ok(exit_code::SUCCESS);
    }
    let report = preflight(&opts);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render_text());
    }
    Ok(if report.verdict().is_unhealthy() {
        exit_code::UNHEALTHY_GPU
    } else {
        exit_code::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_rejects_bad_flags_with_a_config_error() {
        let args: Vec<OsString> = ["muster", "gpu-check", "--expect-gpus", "eight"]
            .iter()
            .map(OsString::from)
            .collect();
        let err = run(&args).unwrap_err();
        assert_eq!(super::super::exit_code_of(&err), exit_code::CONFIG_ERROR);
    }
}
