//! The muster agent: a drop-in replacement for `torchrun` that runs as PID 1 of a training pod.
//!
//! # Layout
//! - [`commands`]: dispatch between the torchrun-compatible launch form
//!   (`muster [OPTIONS] script.py ...`) and muster's own subcommands (`store`, `gpu-check`,
//!   `dry-run`), and the one place where errors become exit codes.
//! - [`exit_code`]: the documented exit codes, including the reserved ones for the agent's own
//!   outcomes (configuration error, rendezvous timeout, unhealthy GPU, ...).
//! - [`gpu`]: GPU pre-flight (NVML health, NVLink topology, CUDA smoke test), `muster gpu-check`;
//!   its private `fabric` module holds one raw NVML call (`unsafe`, allowed on that module alone).
//! - [`checkpoint`]: the preemption checkpoint barrier (local worker channel + cross-node
//!   protocol over the store).
//! - [`metrics`]: Prometheus metrics and the health/readiness probes on port 8000.
//! - [`store_cmd`]: `muster store`, a standalone TCPStore server.
//! - [`cli`]: the launch form's command line (torchrun's flags, `MUSTER_*`/`PET_*` env).
//! - [`launch`]: attempts, rank assignment, worker supervision, restarts, exit codes.
//! - [`logs`]: worker output: prefixed or JSON lines, per-rank files, one console writer.
//! - [`sys`]: the only `unsafe`: process-group and parent-death setup between fork and exec.
//! - [`discovery`]: resolving and reaching the rendezvous endpoint; the advertised address.
//! - [`node`]: the multi-node driver: muster's gang rendezvous in the launch loop's seam.
//! - [`dry_run`]: `muster dry-run`, N agents as local processes on loopback.
//! - [`logging`]: the agent's own diagnostics (`MUSTER_LOG`), text or JSON.
//! - [`signals`]: when a second stop signal counts as "stop now" (not a copy of the first), and
//!   SIGTERM/SIGINT → cancellation for the simple subcommands.
//! - [`watch`]: watching a running job: hung ranks detected from their step reports, every
//!   rank's Python stacks dumped gang-wide (py-spy, or faulthandler through the helper).
//! - [`scratch`]: where muster's own files go (`--tmp-dir`, `$TMPDIR`, `/tmp`, `/dev/shm`) on a
//!   possibly read-only root filesystem.
#![deny(unsafe_code)]

pub mod checkpoint;
pub mod cli;
pub mod commands;
pub mod discovery;
pub mod dry_run;
pub mod exit_code;
pub mod gpu;
pub mod launch;
pub mod logging;
pub mod logs;
pub mod metrics;
pub mod node;
pub mod scratch;
pub mod signals;
pub mod store_cmd;
pub mod sys;
pub mod watch;

pub use commands::main;
