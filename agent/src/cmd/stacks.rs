//! `muster stacks`: every local rank's Python stacks now, from the agent running in this pod
//! (`kubectl exec POD -- muster stacks`). It asks the agent's endpoint (`GET /debug/stacks`,
//! loopback only), which reads them the way the hang watch does: py-spy on each rank's memory,
//! else `faulthandler` through the checkpoint helper.

use std::ffi::OsString;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;

use crate::exit_code::{self, Exit};
use crate::launch::config::{MetricsAddr, DEFAULT_METRICS_ADDR, METRICS_ADDR_ENV};

/// `muster stacks`: print every local rank's stacks now.
#[derive(Debug, Parser)]
#[command(
    name = "muster stacks",
    about = "Print every local rank's Python stacks now (py-spy, else faulthandler through the helper)",
    after_help = "Asks the agent of this pod over loopback (GET /debug/stacks): run it inside the pod, \
                  e.g. kubectl exec POD -- muster stacks.\n\
                  Exit status: 0 printed, 1 no stacks (the agent is not reachable, refused, or runs \
                  no rank; the message says which), 202 bad usage."
)]
struct Args {
    /// The agent's metrics endpoint, as given to its --metrics-addr (IP:PORT, :PORT or PORT); an
    /// unspecified IP (0.0.0.0, ::) is reached over loopback.
    #[arg(long, value_name = "ADDR:PORT", env = METRICS_ADDR_ENV, default_value = DEFAULT_METRICS_ADDR)]
    metrics_addr: String,
    /// How long to wait for the answer, in seconds (reading each rank takes a moment).
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = crate::cli::hiargs::parse_seconds_arg)]
    timeout: Duration,
}

/// `muster stacks ...` (`args[0]` is the binary, `args[1]` is `stacks`).
pub fn run(args: &[OsString]) -> anyhow::Result<u8> {
    let Some(args) = super::parse_subcommand::<Args>("muster stacks", args)? else {
        return Ok(exit_code::SUCCESS);
    };
    let addr = target(&args.metrics_addr)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (status, body) = runtime
        .block_on(async { tokio::time::timeout(args.timeout, get(addr)).await })
        .map_err(|_| {
            Exit::new(
                1,
                format!(
                    "the agent at {addr} did not answer within {} s",
                    args.timeout.as_secs_f64()
                ),
            )
        })?
        .map_err(|e| Exit::new(1, format!("cannot ask the agent at {addr}: {e:#}")))?;
    if status != 200 {
        return Err(Exit::new(
            1,
            format!("the agent at {addr} answered {status}: {}", body.trim_end()),
        )
        .into());
    }
    let mut out = std::io::stdout().lock();
    out.write_all(body.as_bytes())
        .and_then(|()| out.flush())
        .context("cannot write to stdout")?;
    Ok(exit_code::SUCCESS)
}

/// Where to connect for `--metrics-addr`: its address, with an unspecified IP replaced by the
/// loopback of its family (the endpoint answers `/debug/stacks` only to loopback peers).
fn target(setting: &str) -> Result<SocketAddr, Exit> {
    let parsed: MetricsAddr = setting
        .parse()
        .map_err(|e: crate::launch::config::AddrError| Exit::config(e.to_string()))?;
    let Some(mut addr) = parsed.addr() else {
        return Err(Exit::config(
            "--metrics-addr none: the agent serves no endpoint to ask; give the address it listens on",
        ));
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    Ok(addr)
}

/// `GET /debug/stacks` on one connection: the status and the body.
async fn get(addr: SocketAddr) -> anyhow::Result<(u16, String)> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let driver = tokio::spawn(connection);
    let request = hyper::Request::get("/debug/stacks")
        .header(hyper::header::HOST, addr.to_string())
        .header(hyper::header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    driver.abort();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unspecified_address_is_reached_over_loopback() {
        assert_eq!(
            target("0.0.0.0:8000").unwrap(),
            "127.0.0.1:8000".parse().unwrap()
        );
        assert_eq!(target(":9100").unwrap(), "127.0.0.1:9100".parse().unwrap());
        assert_eq!(target("[::]:8000").unwrap(), "[::1]:8000".parse().unwrap());
        assert_eq!(
            target("10.1.2.3:8000").unwrap(),
            "10.1.2.3:8000".parse().unwrap()
        );
        assert!(target("none").is_err());
        assert!(target("nowhere").is_err());
    }
}
