//! `muster store`: a standalone TCPStore server. (in progress)

use std::ffi::OsString;

pub fn run(_args: Vec<OsString>) -> anyhow::Result<u8> {
    anyhow::bail!("not yet")
}
