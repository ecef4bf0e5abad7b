//! The torchrun-compatible launch form's command line, `muster [OPTIONS] script.py [ARGS]...`:
//! the raw parse ([`lowargs`]: flags in both spellings plus the `MUSTER_*`/`PET_*` environment)
//! and the validated [`Config`] ([`hiargs`]) that the rest of the agent consumes. Running it is
//! [`crate::cmd::launch`]'s.

pub mod hiargs;
pub mod lowargs;
pub mod scheduler;

use std::ffi::OsString;
use std::path::Path;

use crate::launch::config::{Config, LogFormat};

/// Parses the launch form (`args` without the program name) against the real environment.
pub fn parse(args: &[OsString]) -> Result<Parsed, hiargs::ConfigError> {
    let env = |name: &str| std::env::var_os(name);
    let low = lowargs::parse(args, &env).map_err(|e| hiargs::ConfigError(e.to_string()))?;
    if low.help {
        return Ok(Parsed::Help);
    }
    if low.version {
        return Ok(Parsed::Version);
    }
    let mut low = low;
    let scheduler =
        scheduler::detect(&mut low, &env).map_err(|e| hiargs::ConfigError(e.to_string()))?;
    // `gpu`/`auto` count the GPUs the scheduler gave this node when it says (a Slurm step), not
    // the device nodes (which a node shows whatever the step was given).
    let scheduler_gpus = scheduler.gpus();
    let gpu_count = || scheduler_gpus.unwrap_or_else(crate::gpu::gpu_count);
    let probe = hiargs::Probe {
        gpu_count: &gpu_count,
        cpu_count: &hiargs::cpu_count,
        env: &env,
        is_file: &|p: &Path| p.is_file(),
    };
    let mut config = hiargs::build(&low, &probe)?;
    config.scheduler = scheduler.behaviour();
    Ok(Parsed::Launch(Box::new(config)))
}

/// What the command line asked for.
#[derive(Debug)]
pub enum Parsed {
    Help,
    Version,
    Launch(Box<Config>),
}

/// The log format the launch form asked for, as far as it can be told from `args` (with the
/// program name) and the environment: for the records written when the launch cannot start.
/// When the command line itself does not parse, only the environment can say.
pub fn requested_log_format(args: &[OsString]) -> LogFormat {
    let env = |name: &str| std::env::var_os(name);
    let value = match lowargs::parse(args.get(1..).unwrap_or_default(), &env) {
        Ok(low) => low.values.get("log-format").map(|raw| raw.value.clone()),
        Err(_) => lowargs::FLAGS
            .iter()
            .find(|f| f.name == "log-format")
            .map(lowargs::env_names)
            .unwrap_or_default()
            .iter()
            .find_map(|name| env(name).filter(|v| !v.is_empty()))
            .map(|v| v.to_string_lossy().into_owned()),
    };
    match value.as_deref().map(str::trim) {
        Some("json") => LogFormat::Json,
        _ => LogFormat::Text,
    }
}
