//! Wire-level proof of the store: one integration-test binary (link time stays low on 2 cores)
//! with one module per area.
//!
//! - `replay`: byte-exact exchanges captured from real torch 2.15 (client and libuv server, see
//!   `tests/fixtures/tcpstore/README.md`) replayed against our server; its replies must equal
//!   torch's byte for byte.
//! - `malformed`: hostile and broken input (truncated frames, unknown commands, bad handshakes,
//!   huge lengths, vanishing clients, many idle connections): the offending connection is closed,
//!   nothing huge is allocated, and other clients keep being served.
//! - `memory`: the store's memory bounds: unread replies, a full store, oversized requests and
//!   replies; the offender is held back or closed and the others are served.
//! - `codec`: property tests of `rendezvous::store::protocol`.
//! - `shutdown`: the server as `muster store` runs it keeps requests in arrival order across
//!   connections, and its shutdown reaches idle, waiting and stuck connections alike.

#[path = "wire/common.rs"]
mod common;

#[path = "wire/codec.rs"]
mod codec;
#[path = "wire/malformed.rs"]
mod malformed;
#[path = "wire/memory.rs"]
mod memory;
#[path = "wire/replay.rs"]
mod replay;
#[path = "wire/shutdown.rs"]
mod shutdown;
