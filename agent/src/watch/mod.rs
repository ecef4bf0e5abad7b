//! Watching a running job: hung ranks found, their stacks dumped gang-wide, the gang restarted.
//!
//! - [`hang`]: the pure decisions — is a rank hung (from its step reports, its open section and
//!   `now`), and which stalled rank is the cause (the one not waiting in `torch.distributed`).
//! - [`stacks`]: reading a worker's Python stacks: py-spy on its memory, or `faulthandler`
//!   through the checkpoint helper where memory reads are refused.
//! - [`startup`]: the same before a rank's first step — stuck in `init_process_group`, or no
//!   first step while its peers step (`--startup-timeout`), and the stopped rank named.
//! - [`gang`]: the store key through which the node that detects a hang tells every other
//!   node, which dumps its own ranks' stacks too.
//! - [`straggler`]: the pure straggler decisions — a rank's compute per step against the gang's
//!   median, with warm-up, hysteresis and a minimum duration.
//! - [`flight_recorder`]: torch's NCCL flight-recorder variables for the workers, and the dumps
//!   they left.
//!
//! The per-attempt task that ties them together, plugged into the launch loop as its
//! [`crate::launch::Watchdog`], is [`crate::hang_watch`]: this module is below the launch and
//! imports nothing of the agent's.
//!
//! The step reports come from the checkpoint helper's `should_save(step)` through the local
//! channel ([`crate::checkpoint::local`]); a script that does not use the helper is not watched.

pub mod cgroup;
pub mod flight_recorder;
pub mod gang;
pub mod hang;
pub mod stacks;
pub mod startup;
pub mod straggler;

use std::time::Duration;

/// A hung rank, as the summary names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hang {
    pub node_rank: u32,
    pub host: String,
    pub local_rank: u32,
    pub rank: u32,
    pub last_step: Option<u64>,
    /// Time without progress when the cause was named.
    pub stalled: Duration,
    /// The limit it passed (`--hang-timeout`, or `--section-timeout` in a section).
    pub limit: Duration,
    /// The section it was stuck in.
    pub section: Option<String>,
    /// The innermost frame of its main thread, `function (file:line)`.
    pub frame: Option<String>,
    /// How its stacks were read (`py-spy`, `faulthandler through the helper`), or why not.
    pub stacks: String,
    /// The node that detected the hang first, when it was another one.
    pub reported_by: Option<u32>,
    /// It was not still but working outside `torch.distributed` without a step while its peers
    /// waited for it: `stalled` is the time since its last step.
    pub working: bool,
}

impl Hang {
    /// One line for logs and the restart message.
    pub fn describe(&self) -> String {
        let step = self
            .last_step
            .map_or_else(|| "none".to_owned(), |s| s.to_string());
        let place = match &self.section {
            Some(name) => format!(" in section {name:?}"),
            None => String::new(),
        };
        let frame = self
            .frame
            .as_deref()
            .map_or_else(String::new, |f| format!(", stuck in {f}"));
        let what = if self.working {
            format!(
                "made no step for {:.1} s, working outside torch.distributed while its peers waited for it",
                self.stalled.as_secs_f64()
            )
        } else {
            format!(
                "made no progress{place} for {:.1} s",
                self.stalled.as_secs_f64()
            )
        };
        format!(
            "rank {} (local rank {}) on node {} ({}) {what} (last step {step}; limit {} s){frame}",
            self.rank,
            self.local_rank,
            self.node_rank,
            self.host,
            self.limit.as_secs_f64(),
        )
    }
}
