//! The agent's own diagnostics (not the workers' output): `tracing` to stderr, filtered by
//! `MUSTER_LOG` (else `RUST_LOG`, else `info`), as text or one JSON record per line (the schema
//! of [`crate::logs::record`]).

use tracing_subscriber::EnvFilter;

/// How the agent writes its own log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Installs the global subscriber; a second call is a no-op (tests start several agents).
pub fn init(format: LogFormat) {
    let filter = std::env::var("MUSTER_LOG")
        .ok()
        .filter(|v| !v.is_empty())
        .or_else(|| std::env::var("RUST_LOG").ok().filter(|v| !v.is_empty()))
        .and_then(|spec| EnvFilter::try_new(spec).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _already_set = match format {
        LogFormat::Text => builder.try_init(),
        // The one JSON log schema of the launch form (`crate::logs::record`).
        LogFormat::Json => builder
            .event_format(crate::logs::record::JsonEvents::new(
                crate::launch::short_hostname(),
            ))
            .try_init(),
    };
}
