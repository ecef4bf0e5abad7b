//! Finding the rendezvous endpoint from inside a pod: resolve the worker-0 headless name (which
//! Kubernetes may publish seconds or minutes after this pod starts), connect to it, and pick the
//! address this node advertises.
//!
//! Resolution goes through `hickory-resolver` with the system configuration, so `/etc/resolv.conf`
//! (search domains, ndots) and `/etc/hosts` apply as they do for any program in the pod; A and
//! AAAA are both asked for. NXDOMAIN and empty answers mean "not yet": we retry with jittered
//! backoff until the join deadline, with one progress line every few seconds naming the host and
//! the kind of failure, and with the resolver's cache off so a negative answer is never reused.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::TokioResolver;
use rand::Rng as _;
use rendezvous::rdzv::StoreKv;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::events::{DnsResult, Event, Events};

/// torchrun's default c10d port.
pub const DEFAULT_PORT: u16 = 29400;
/// One progress line per this interval while waiting.
const PROGRESS_EVERY: Duration = Duration::from_secs(3);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// `--rdzv-endpoint`, split: `host`, `host:port`, `[v6]:port`, or a bare IPv6 address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Why discovery gave up.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("--rdzv-endpoint `{0}`: expected HOST[:PORT] or [IPv6]:PORT")]
    BadEndpoint(String),
    #[error("could not resolve the rendezvous host {host} within {waited:.1}s (last: {kind})")]
    Resolve {
        host: String,
        kind: String,
        waited: f64,
    },
    #[error("could not reach the rendezvous store at {endpoint} ({addrs}) within {waited:.1}s (last: {kind})")]
    Connect {
        endpoint: String,
        addrs: String,
        kind: String,
        waited: f64,
    },
    #[error("--local-addr {0}: not an address of this machine's interfaces, and not resolvable")]
    LocalAddr(String),
    #[error("no non-loopback address on this machine's interfaces; pass --local-addr")]
    NoAddress,
}

/// Parses `--rdzv-endpoint`.
pub fn parse_endpoint(text: &str) -> Result<Endpoint, DiscoveryError> {
    let bad = || DiscoveryError::BadEndpoint(text.to_owned());
    let text = text.trim();
    if text.is_empty() {
        return Err(bad());
    }
    if let Some(rest) = text.strip_prefix('[') {
        let (host, tail) = rest.split_once(']').ok_or_else(bad)?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| bad())?,
            None if tail.is_empty() => DEFAULT_PORT,
            None => return Err(bad()),
        };
        return Ok(Endpoint {
            host: host.to_owned(),
            port,
        });
    }
    if text.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok(Endpoint {
            host: text.to_owned(),
            port: DEFAULT_PORT,
        });
    }
    match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => Ok(Endpoint {
            host: host.to_owned(),
            port: port.parse().map_err(|_| bad())?,
        }),
        Some(_) => Err(bad()),
        None => Ok(Endpoint {
            host: text.to_owned(),
            port: DEFAULT_PORT,
        }),
    }
}

/// A jittered exponential backoff (full jitter on the upper half, so retries of many pods spread).
struct Backoff(Duration);

impl Backoff {
    fn next(&mut self) -> Duration {
        let d = self.0;
        self.0 = (self.0 * 2).min(MAX_BACKOFF);
        let half = d / 2;
        half + half.mul_f64(rand::rng().random_range(0.0..1.0))
    }
}

/// Resolves `host` (A and AAAA) until `deadline`, telling `events` about every lookup. An IP
/// literal is returned as is.
pub async fn resolve(
    host: &str,
    deadline: Instant,
    events: &Events,
) -> Result<Vec<IpAddr>, DiscoveryError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![ip]);
    }
    let started = Instant::now();
    events.publish(Event::ResolvingStarted);
    let resolved = |ips: Vec<IpAddr>| {
        events.publish(Event::DnsAttempt(DnsResult::Ok));
        events.publish(Event::ResolvingFinished {
            resolved: true,
            elapsed: started.elapsed(),
        });
        Ok(ips)
    };
    let resolver = match TokioResolver::builder(TokioConnectionProvider::default()) {
        Ok(mut builder) => {
            let opts = builder.options_mut();
            // "Not yet" must never be remembered: the record may appear any second.
            opts.cache_size = 0;
            opts.negative_max_ttl = Some(Duration::ZERO);
            opts.timeout = Duration::from_secs(2);
            opts.attempts = 1;
            opts.ip_strategy = hickory_resolver::config::LookupIpStrategy::Ipv4AndIpv6;
            Some(builder.build())
        }
        Err(e) => {
            warn!("cannot read the system resolver configuration ({e}); using the OS resolver");
            None
        }
    };
    let mut backoff = Backoff(FIRST_BACKOFF);
    let mut last_progress: Option<Instant> = None;
    loop {
        let (result, kind) = match &resolver {
            Some(r) => match r.lookup_ip(host).await {
                Ok(found) => {
                    let ips: Vec<IpAddr> = found.iter().collect();
                    if !ips.is_empty() {
                        info!(
                            "resolved {host} to {} after {:.1}s",
                            join(&ips),
                            started.elapsed().as_secs_f64()
                        );
                        return resolved(ips);
                    }
                    (DnsResult::NxDomain, "no answer".to_owned())
                }
                Err(e) => classify_dns(&e),
            },
            None => match tokio::net::lookup_host((host, 0)).await {
                Ok(found) => {
                    let ips: Vec<IpAddr> = found.map(|sa| sa.ip()).collect();
                    if !ips.is_empty() {
                        return resolved(ips);
                    }
                    (DnsResult::NxDomain, "no answer".to_owned())
                }
                Err(e) => (DnsResult::Error, e.to_string()),
            },
        };
        events.publish(Event::DnsAttempt(result));
        let now = Instant::now();
        if now >= deadline {
            events.publish(Event::ResolvingFinished {
                resolved: false,
                elapsed: started.elapsed(),
            });
            return Err(DiscoveryError::Resolve {
                host: host.to_owned(),
                kind,
                waited: started.elapsed().as_secs_f64(),
            });
        }
        if last_progress.is_none_or(|t| now.duration_since(t) >= PROGRESS_EVERY) {
            info!(
                "waiting for DNS: {host}: {kind} ({:.1}s, giving up in {:.1}s)",
                started.elapsed().as_secs_f64(),
                deadline.saturating_duration_since(now).as_secs_f64()
            );
            last_progress = Some(now);
        }
        tokio::time::sleep(backoff.next().min(deadline.saturating_duration_since(now))).await;
    }
}

/// The typed result of a failed lookup, and how the progress line names it.
fn classify_dns(e: &hickory_resolver::ResolveError) -> (DnsResult, String) {
    if e.is_nx_domain() {
        return (DnsResult::NxDomain, "NXDOMAIN".into());
    }
    if e.is_no_records_found() {
        return (DnsResult::NxDomain, "no answer".into());
    }
    let text = e.to_string();
    let lower = text.to_ascii_lowercase();
    if lower.contains("timed out") || lower.contains("timeout") {
        (DnsResult::Timeout, "timeout".into())
    } else if lower.contains("refused") {
        (DnsResult::Error, "refused".into())
    } else {
        (DnsResult::Error, text)
    }
}

/// Connects to the first of `ips` that answers on `port`, retrying until `deadline`.
pub async fn connect(
    endpoint: &Endpoint,
    ips: &[IpAddr],
    deadline: Instant,
    op_timeout: Duration,
) -> Result<StoreKv, DiscoveryError> {
    let started = Instant::now();
    let mut backoff = Backoff(FIRST_BACKOFF);
    let mut last_progress: Option<Instant> = None;
    loop {
        let mut kind = String::from("no address");
        for ip in ips {
            let addr = SocketAddr::new(*ip, endpoint.port);
            match StoreKv::connect(addr, Duration::from_secs(2), op_timeout).await {
                Ok(kv) => {
                    info!("connected to the rendezvous store at {addr}");
                    return Ok(kv);
                }
                Err(e) => kind = classify_connect(&e.to_string()),
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(DiscoveryError::Connect {
                endpoint: endpoint.to_string(),
                addrs: join(ips),
                kind,
                waited: started.elapsed().as_secs_f64(),
            });
        }
        if last_progress.is_none_or(|t| now.duration_since(t) >= PROGRESS_EVERY) {
            info!(
                "waiting for the rendezvous store at {endpoint} ({}): {kind} ({:.1}s)",
                join(ips),
                started.elapsed().as_secs_f64()
            );
            last_progress = Some(now);
        }
        tokio::time::sleep(backoff.next().min(deadline.saturating_duration_since(now))).await;
    }
}

/// How long one set of resolved addresses is tried before the name is resolved again.
const RESOLVE_AGAIN_EVERY: Duration = Duration::from_secs(3);

/// Resolves `endpoint` and connects, resolving again every [`RESOLVE_AGAIN_EVERY`] until
/// `deadline`: a replacement store host (node 0's new pod) comes back under the same name with
/// a new address, so the addresses of the lost one must not be held on to.
pub async fn reach(
    endpoint: &Endpoint,
    deadline: Instant,
    op_timeout: Duration,
    events: &Events,
) -> Result<StoreKv, DiscoveryError> {
    loop {
        let ips = resolve(&endpoint.host, deadline, events).await?;
        let until = (Instant::now() + RESOLVE_AGAIN_EVERY).min(deadline);
        match connect(endpoint, &ips, until, op_timeout).await {
            Ok(kv) => return Ok(kv),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {}
        }
    }
}

fn classify_connect(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    for (needle, kind) in [
        ("refused", "refused"),
        ("timed out", "timeout"),
        ("unreachable", "unreachable"),
        ("reset", "reset"),
    ] {
        if lower.contains(needle) {
            return kind.into();
        }
    }
    text.to_owned()
}

fn join(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every address on this machine's interfaces.
pub fn interface_addrs() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addrs
        .filter_map(|ifa| {
            let a = ifa.address?;
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })
        .collect()
}

/// The address this node advertises: `--local-addr` (an IP, or a name resolved once here), else
/// the first global address of the interfaces (IPv4 first), else loopback when `allow_loopback`
/// (the local dry run). Never a name: MASTER_ADDR must work from every pod.
pub async fn advertised_addr(
    local_addr: Option<&str>,
    allow_loopback: bool,
) -> Result<IpAddr, DiscoveryError> {
    if let Some(text) = local_addr.map(str::trim).filter(|t| !t.is_empty()) {
        let bare = text.trim_matches(|c| c == '[' || c == ']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Ok(ip);
        }
        let mut found = tokio::net::lookup_host((bare, 0))
            .await
            .map_err(|_| DiscoveryError::LocalAddr(text.to_owned()))?;
        return found
            .next()
            .map(|sa| sa.ip())
            .ok_or_else(|| DiscoveryError::LocalAddr(text.to_owned()));
    }
    pick_global(&interface_addrs())
        .or_else(|| allow_loopback.then_some(IpAddr::V4(Ipv4Addr::LOCALHOST)))
        .ok_or(DiscoveryError::NoAddress)
}

/// First non-loopback, non-link-local, non-unspecified address; IPv4 before IPv6.
pub fn pick_global(addrs: &[IpAddr]) -> Option<IpAddr> {
    let usable = |ip: &&IpAddr| match ip {
        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local() && !v4.is_unspecified(),
        IpAddr::V6(v6) => {
            !v6.is_loopback() && !v6.is_unspecified() && (v6.segments()[0] & 0xffc0) != 0xfe80
        }
    };
    addrs
        .iter()
        .filter(usable)
        .find(|ip| ip.is_ipv4())
        .or_else(|| addrs.iter().find(usable))
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_with_and_without_ports_and_brackets() {
        let e = |h: &str, p| Endpoint {
            host: h.into(),
            port: p,
        };
        assert_eq!(
            parse_endpoint("w-0.svc:29500").ok(),
            Some(e("w-0.svc", 29500))
        );
        assert_eq!(
            parse_endpoint("w-0.svc").ok(),
            Some(e("w-0.svc", DEFAULT_PORT))
        );
        assert_eq!(parse_endpoint("[::1]:7").ok(), Some(e("::1", 7)));
        assert_eq!(
            parse_endpoint("fd00::1").ok(),
            Some(e("fd00::1", DEFAULT_PORT))
        );
        assert_eq!(e("::1", 7).to_string(), "[::1]:7");
        for bad in ["", ":5", "h:x", "[::1", "[::1]x"] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_advertised_address_is_global_and_prefers_ipv4() {
        let ips: Vec<IpAddr> = ["127.0.0.1", "fe80::1", "fd00::5", "169.254.1.1", "10.1.2.3"]
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        assert_eq!(pick_global(&ips), "10.1.2.3".parse().ok());
        assert_eq!(pick_global(&ips[..3]), "fd00::5".parse().ok());
        assert_eq!(pick_global(&ips[..2]), None);
    }

    #[tokio::test]
    async fn an_ip_literal_needs_no_dns_and_a_bad_local_addr_is_an_error() {
        let ips = resolve("127.0.0.1", Instant::now(), &Events::default())
            .await
            .ok();
        assert_eq!(ips, Some(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]));
        let ip = advertised_addr(Some("[::1]"), false).await.ok();
        assert_eq!(ip, "::1".parse().ok());
        assert!(advertised_addr(Some("no such host.invalid."), false)
            .await
            .is_err());
    }

    #[tokio::test]
    async fn a_refused_endpoint_fails_at_the_deadline_naming_it() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let ep = Endpoint {
            host: "127.0.0.1".into(),
            port,
        };
        let deadline = Instant::now() + Duration::from_millis(300);
        let ips = [IpAddr::V4(Ipv4Addr::LOCALHOST)];
        let Err(err) = connect(&ep, &ips, deadline, Duration::from_secs(1)).await else {
            panic!("nothing listens there");
        };
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("refused"),
            "{msg}"
        );
    }
}
