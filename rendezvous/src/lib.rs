//! The rendezvous side of muster: everything that travels over PyTorch's c10d TCPStore protocol.
//!
//! # Layout
//! - [`store::protocol`]: a pure codec for the TCPStore wire format (torch 2.15, commands 0–18).
//!   Parsing never does I/O; "not enough bytes yet" is `Ok(None)`, never an error.
//! - [`store::state`]: keys, counters, queues and waiters, with no I/O and no async, so every
//!   semantic edge case is unit-tested directly.
//! - [`store::server`]: the tokio server around them: accept loop, admission limit, shutdown.
//! - [`rdzv`]: muster's own gang rendezvous over the store: join rounds, heartbeats, the
//!   generation counter that restarts every node together, the exit barrier.
//! - [`store::client`]: a client for the same protocol with a timeout on every read (torch's own
//!   client blocks forever on a silent server). The agents use it to rendezvous.
//! - [`seconds`]: the one parser of durations for every flag, variable and conf key (syntax,
//!   range, errors), so that no value reaches a panicking `Duration` or `Instant` operation.
//! - [`host`]: how a server listens (dual-stack) and runs on a thread with its own runtime; shared
//!   by the store and the agent's metrics endpoint.
#![forbid(unsafe_code)]

pub mod host;
pub mod rdzv;
pub mod seconds;
pub mod store;
pub mod words;
