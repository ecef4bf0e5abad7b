//! A key-value store that speaks PyTorch's c10d TCPStore wire protocol exactly enough that real
//! `torch.distributed` clients cannot tell it from PyTorch's own (libuv) server.
//!
//! Where torch's two server backends differ, this store follows libuv, torch's default since 2.4;
//! each such choice is written down where it is made (search for "libuv:").

mod busy_poll;
pub mod client;
pub mod protocol;
pub mod server;
pub mod state;
