//! The muster agent: a drop-in replacement for `torchrun` that runs as PID 1 of a training pod.
//!
//! # Layout
//! Layers, top to bottom; a module imports only from layers below it (checked by
//! `tests/module_graph.rs`; `docs/architecture.md` says where new code goes).
//!
//! - Commands: [`cmd`]: one module per command (`muster [OPTIONS] script.py`, `store`,
//!   `gpu-check`, `dry-run`), the shared clap-error path, and the one place where an error
//!   becomes an exit code ([`cmd::exit_code_of`]); the dry run's fault rehearsal ([`cmd::dry_run::fault`]) and the
//!   timeline it prints live under it.
//! - Composition root: [`app`] wires one launch: console, metrics and their observers, GPU
//!   pre-flight, rendezvous, checkpoint barrier. The only importer of [`metrics`].
//! - Observers: [`metrics`]: Prometheus metrics and the probes on port 8000; they follow the
//!   launch loop's [`launch::observe`] and the parts' [`events`], and read stores' statistics at
//!   scrape time. Nothing calls into them.
//! - Command line: [`cli`]: the launch form's raw parse (`lowargs`: torchrun's flags and
//!   `MUSTER_*`/`PET_*` env) and validated [`launch::Config`] (`hiargs`).
//! - The launch and its parts: [`launch`] (attempts, rank assignment, worker supervision,
//!   restarts, signals; the [`launch::rdzv`] seam with the single-node and gang rendezvous),
//!   [`checkpoint`] (the preemption checkpoint barrier), [`discovery`] (resolving and reaching the
//!   rendezvous endpoint; the advertised address), [`netcheck`] (the gang's network pre-flight,
//!   `--network-check`: measure, judge, act; the gang rendezvous runs it after each round).
//! - Events: [`events`]: the typed events the parts publish for observers.
//! - Foundations: [`gpu`] (NVML health, NVLink topology, CUDA smoke test; its private `fabric`
//!   module holds one raw NVML call, `unsafe` allowed there alone), [`logs`] (worker output and
//!   the agent's own diagnostics: one console writer, one tracing set-up), [`exit_code`] (the
//!   documented codes), [`scratch`] (where muster's own files go on a possibly read-only root
//!   filesystem), [`python_files`] (the Python package muster writes for the workers: the
//!   checkpoint helper, the step reports, the framework integrations, `sitecustomize`),
//!   [`host`] (the host name), [`sys`] (the only other `unsafe`: process-group and
//!   parent-death setup between fork and exec).
//! - Run-time watch: [`hang_watch`] (a part of the launch, like [`checkpoint`]: the per-attempt
//!   watchdog over the helper's step reports) on top of [`watch`] (a foundation: the pure hang
//!   decisions, reading ranks' Python stacks with py-spy or faulthandler, the gang-wide notice key,
//!   OOM kills from the memory cgroup).
//! - [`straggler_watch`] (a part of the launch, like [`hang_watch`], which it wraps): names the
//!   rank or GPU that holds the gang back (CPU time per step against the gang's median through
//!   the attempt's store, GPU throttling), and under `--straggler-action exclude` makes a node
//!   that stays slow leave (exit 210).
#![deny(unsafe_code)]

pub mod app;
pub mod checkpoint;
pub mod cli;
pub mod cmd;
pub mod discovery;
pub mod events;
pub mod exit_code;
pub mod gpu;
pub mod hang_watch;
pub mod host;
pub mod launch;
pub mod logs;
pub mod metrics;
pub mod netcheck;
pub mod python_files;
pub mod scratch;
pub mod slurm;
pub mod snapshot;
pub mod straggler_watch;
pub mod sys;
pub mod watch;

pub use cmd::main;
