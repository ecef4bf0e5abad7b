//! `muster store`: a standalone TCPStore server — the rendezvous endpoint a team would otherwise
//! run etcd for, and the server real `torch.distributed` clients are tested against.

use std::ffi::OsString;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use rendezvous::store::server::{Config, Server, DEFAULT_MAX_CONNECTIONS};
use tokio_util::sync::CancellationToken;

use crate::exit_code::{self, Exit};

/// Run a standalone store speaking PyTorch's c10d TCPStore protocol (torch 2.15).
#[derive(Debug, Parser)]
#[command(name = "muster store")]
struct StoreArgs {
    /// Address to listen on. `0.0.0.0` and `::` listen dual-stack where the host has IPv6.
    #[arg(long, default_value = "0.0.0.0", env = "MUSTER_STORE_HOST")]
    host: IpAddr,
    /// Port to listen on; 0 picks a free one. The chosen address is printed on the first line
    /// of stdout.
    #[arg(long, default_value_t = 29400, env = "MUSTER_STORE_PORT")]
    port: u16,
    /// Connections beyond this many are closed at once.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, env = "MUSTER_STORE_MAX_CONNECTIONS")]
    max_connections: usize,
    /// Microseconds the store keeps polling its sockets instead of sleeping after the last
    /// request it served (0 = never, at most 10000). Saves a thread wake-up per request for
    /// clients that send one request at a time; costs at most this much of one CPU after each
    /// burst.
    #[arg(long, default_value_t = DEFAULT_BUSY_POLL_US, env = "MUSTER_STORE_BUSY_POLL_US", value_name = "MICROSECONDS", value_parser = parse_busy_poll)]
    busy_poll_us: u64,
    /// Bytes of keys, values, queues and waiters the store may hold (each entry also charged
    /// 64 bytes of overhead); a request that would pass it closes its client's connection.
    /// A number of bytes, or with a KiB, MiB or GiB suffix.
    #[arg(long, default_value = "1GiB", value_parser = crate::cli::hiargs::parse_byte_size, env = "MUSTER_STORE_MAX_STORE_BYTES", value_name = "BYTES")]
    max_store_bytes: usize,
}

/// The longest busy poll accepted: 10 ms, 100 times the default. A wake-up costs tens of
/// microseconds, so a longer window saves nothing more and only burns a CPU after every burst
/// (`--busy-poll-us 10000000` would spin 10 s after each request).
pub const MAX_BUSY_POLL_US: u64 = 10_000;

fn parse_busy_poll(text: &str) -> Result<u64, String> {
    let us: u64 = text
        .trim()
        .parse()
        .map_err(|_| "expected a whole number of microseconds".to_owned())?;
    if us > MAX_BUSY_POLL_US {
        return Err(format!(
            "at most {MAX_BUSY_POLL_US} µs (10 ms): a longer busy poll saves nothing and keeps a \
             CPU spinning after every request"
        ));
    }
    Ok(us)
}

/// Long enough to cover a client's turn-around on a VM (reading the reply, sending the next
/// request; measured in docs/store.md § Performance), short enough to be noise in CPU accounting
/// (100 µs per burst is 0.01 % of a core at 1 burst/s).
const DEFAULT_BUSY_POLL_US: u64 = 100;

/// `muster store ...` (`args[0]` is the binary, `args[1]` is `store`).
pub fn run(args: &[OsString]) -> anyhow::Result<u8> {
    let Some(args) = super::parse_subcommand::<StoreArgs>("muster store", args)? else {
        return Ok(exit_code::SUCCESS);
    };
    crate::logs::init_tracing(
        crate::logs::LogFormat::Text,
        crate::logs::Diagnostics::Stderr,
        "info",
    );
    // One thread, like libuv's event loop: requests are served in arrival order across
    // connections, and the busy poll needs the thread that owns the I/O driver.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: StoreArgs) -> anyhow::Result<u8> {
    let addr = SocketAddr::new(args.host, args.port);
    let server = Server::bind(
        addr,
        Config {
            max_connections: args.max_connections,
            busy_poll: Duration::from_micros(args.busy_poll_us),
            max_store_bytes: args.max_store_bytes,
            ..Config::default()
        },
    )
    .await
    .map_err(|err| Exit::config(err.to_string()))?;
    let shutdown = CancellationToken::new();
    let signals =
        super::cancel_on_termination(shutdown.clone()).context("cannot install signal handlers")?;
    // One line, flushed at once: scripts and tests read the chosen port from it.
    println!("muster store listening on {}", server.local_addr());
    std::io::stdout()
        .flush()
        .context("cannot write to stdout")?;
    server.run(shutdown).await?;
    signals.abort();
    Ok(exit_code::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;
    use crate::cli::hiargs::parse_byte_size;

    fn parse(args: &[&str]) -> Result<StoreArgs, String> {
        let argv: Vec<OsString> = ["muster", "store"]
            .iter()
            .chain(args)
            .map(OsString::from)
            .collect();
        match crate::cmd::parse_subcommand::<StoreArgs>("muster store", &argv) {
            Ok(Some(args)) => Ok(args),
            Ok(None) => Err("help".to_owned()),
            Err(e) => Err(e.message),
        }
    }

    #[test]
    fn the_busy_poll_is_bounded() {
        assert_eq!(
            parse(&["--busy-poll-us", "10000"]).unwrap().busy_poll_us,
            10_000
        );
        assert_eq!(parse(&["--busy-poll-us", "0"]).unwrap().busy_poll_us, 0);
        let err = parse(&["--busy-poll-us", "10000000"]).unwrap_err();
        assert!(
            err.contains("--busy-poll-us") && err.contains("at most 10000"),
            "{err}"
        );
    }

    #[test]
    fn errors_and_usage_name_muster_store_once() {
        let err = parse(&["--bogus"]).unwrap_err();
        assert!(!err.starts_with("error:"), "{err}");
        assert!(err.contains("Usage: muster store [OPTIONS]"), "{err}");
        let help = StoreArgs::command()
            .bin_name("muster store")
            .render_help()
            .to_string();
        assert!(help.contains("Usage: muster store [OPTIONS]"), "{help}");
    }

    #[test]
    fn byte_sizes_take_plain_numbers_and_binary_units() {
        assert_eq!(parse_byte_size("4096"), Ok(4096));
        assert_eq!(parse_byte_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_byte_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_byte_size("1GiB"), Ok(1 << 30));
        for bad in [
            "",
            "0",
            "1GB",
            "-1",
            "1.5GiB",
            "GiB",
            "99999999999999999999",
        ] {
            assert!(parse_byte_size(bad).is_err(), "{bad:?} was accepted");
        }
        assert_eq!(
            rendezvous::store::server::DEFAULT_MAX_STORE_BYTES,
            parse_byte_size("1GiB").unwrap_or_default(),
            "the flag's default matches the library's"
        );
    }
}
