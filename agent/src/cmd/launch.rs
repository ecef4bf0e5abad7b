//! The torchrun-compatible launch form, `muster [OPTIONS] script.py [ARGS]...`: the command line
//! ([`crate::cli`]), the agent's runtime, and the launch itself ([`crate::app`]).

use std::ffi::OsString;

use anyhow::Context;

use crate::cli::{self, Parsed};

/// `muster [OPTIONS] script.py [ARGS]...`; `args` includes the program name.
pub fn run(args: &[OsString]) -> anyhow::Result<u8> {
    let config = match cli::parse(args.get(1..).unwrap_or_default())? {
        Parsed::Help => {
            print!("{}", cli::lowargs::help_text());
            return Ok(0);
        }
        Parsed::Version => {
            println!("muster {}", env!("CARGO_PKG_VERSION"));
            return Ok(0);
        }
        Parsed::Launch(config) => *config,
    };
    // One thread: the workers' parent thread must live as long as they do (PR_SET_PDEATHSIG is
    // per thread), and an agent that mostly waits needs no more. The metrics endpoint and the
    // stores the agent hosts serve from threads of their own.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(crate::app::launch(config))
}
