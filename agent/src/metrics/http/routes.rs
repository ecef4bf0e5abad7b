//! What each request gets: the five routes, the probes' verdicts, and the error answers.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Version};
use tokio_util::sync::CancellationToken;

use super::super::auth::{self, Rejected};
use super::super::{Metrics, Readiness};
use super::guard::Exchange;
use super::wire::Reject;
use super::{EndpointConfig, MAX_BODY_BYTES, METRICS_CONTENT_TYPE};
use crate::checkpoint::requests::{CheckpointDelivery, CheckpointTrigger};

/// What every request of one connection is answered with.
pub(super) struct Context {
    pub peer: SocketAddr,
    pub metrics: Metrics,
    pub config: Arc<EndpointConfig>,
    /// Cancelled when the connection is evicted or the endpoint stops: answer, then close.
    pub evict: CancellationToken,
    pub exchange: Arc<Exchange>,
}

/// hyper's service: one request in, one response out. Every request is read whole (its body, at
/// most [`MAX_BODY_BYTES`], is not used by any route) before it is answered, as a client that
/// pipelines expects.
pub(super) async fn respond(
    request: Request<Incoming>,
    context: Arc<Context>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if let Some(reject) = context.exchange.next_request() {
        return Ok(refuse(reject.status(), &context));
    }
    if request.headers().contains_key(header::TRANSFER_ENCODING) {
        return Ok(refuse(501, &context));
    }
    let too_large = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > MAX_BODY_BYTES as u64);
    if too_large {
        return Ok(refuse(413, &context));
    }
    let (parts, body) = request.into_parts();
    if Limited::new(body, MAX_BODY_BYTES).collect().await.is_err() {
        // The request's deadline passed mid-body (or the peer left): see `guard`.
        return Ok(refuse(Reject::Timeout.status(), &context));
    }
    let keep_alive =
        wants_keep_alive(parts.version, &parts.headers) && !context.evict.is_cancelled();
    let Some(path) = origin_path(&parts.uri) else {
        return Ok(refuse(400, &context));
    };
    if path == STACKS_PATH {
        let reply = stacks(&parts.method, context.peer.ip(), &context.metrics).await;
        context
            .metrics
            .traffic()
            .count_http_request("stacks", reply.status);
        return Ok(reply.into_response(keep_alive));
    }
    let reply = route(
        &parts.method,
        path,
        bearer(&parts.headers),
        context.peer.ip(),
        &context.metrics,
        &context.config,
    );
    Ok(reply.into_response(keep_alive))
}

/// An error answer, after which the connection closes.
fn refuse(status: u16, context: &Context) -> Response<Full<Bytes>> {
    tracing::debug!(peer = %context.peer, status, "metrics endpoint: rejected request");
    context
        .metrics
        .traffic()
        .count_http_request("other", status);
    Reply::text(status, format!("{}\n", reason(status))).into_response(false)
}

/// The path of an origin-form (`/metrics?x`) or absolute-form (`http://host/metrics`) target;
/// `None` for the authority and asterisk forms, which no route takes.
fn origin_path(uri: &hyper::Uri) -> Option<&str> {
    let path = uri.path();
    (path.starts_with('/') && (uri.scheme().is_some() || uri.authority().is_none())).then_some(path)
}

/// HTTP/1.1 keeps the connection unless told `close`; HTTP/1.0 only when told `keep-alive`.
fn wants_keep_alive(version: Version, headers: &HeaderMap) -> bool {
    let (mut close, mut keep_alive) = (false, false);
    for value in headers.get_all(header::CONNECTION) {
        for token in value.to_str().unwrap_or_default().split(',').map(str::trim) {
            close |= token.eq_ignore_ascii_case("close");
            keep_alive |= token.eq_ignore_ascii_case("keep-alive");
        }
    }
    match version {
        Version::HTTP_11 => !close,
        _ => keep_alive && !close,
    }
}

/// The credentials of `Authorization: Bearer …`; two Authorization headers are ambiguous and
/// count as none. Never logged.
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return None;
    };
    let value = value.as_bytes();
    let space = value.iter().position(|b| *b == b' ')?;
    value[..space]
        .eq_ignore_ascii_case(b"bearer")
        .then(|| value[space + 1..].trim_ascii())
}

struct Reply {
    status: u16,
    content_type: &'static str,
    body: Bytes,
    /// One more header (`Allow` on a 405, `WWW-Authenticate` on a 401).
    extra: Option<(header::HeaderName, &'static str)>,
}

impl Reply {
    fn text(status: u16, body: String) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: Bytes::from(body),
            extra: None,
        }
    }

    /// hyper leaves the body out of a HEAD response and keeps the Content-Length set here.
    fn into_response(self, keep_alive: bool) -> Response<Full<Bytes>> {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = Response::new(Full::new(Bytes::new()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(self.content_type),
        );
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(self.body.len()));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static(if keep_alive { "keep-alive" } else { "close" }),
        );
        if let Some((name, value)) = self.extra {
            headers.insert(name, HeaderValue::from_static(value));
        }
        *response.body_mut() = Full::new(self.body);
        response
    }
}

fn reason(status: u16) -> &'static str {
    StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Unknown")
}

const INDEX: &str = "muster agent\n\
GET  /metrics     Prometheus metrics\n\
GET  /healthz     liveness: the agent loop is alive\n\
GET  /readyz      readiness: this agent can play its part for the others (independent of peers)\n\
GET  /gangz       the gang has formed and this node's workers are running\n\
POST /checkpoint  ask the gang to checkpoint (loopback, or a bearer token)\n\
GET  /debug/stacks every local rank's Python stacks now (loopback only; `muster stacks`)\n";

/// The one route whose answer is awaited (reading stacks takes a moment per rank).
const STACKS_PATH: &str = "/debug/stacks";

/// `GET /debug/stacks`: loopback only — a stack shows the script's code and its arguments'
/// places, which is the pod's business (the operator's way in is `kubectl exec`); no token opens
/// it, unlike `POST /checkpoint`.
async fn stacks(method: &Method, peer: IpAddr, metrics: &Metrics) -> Reply {
    if !(*method == Method::GET || *method == Method::HEAD) {
        return not_allowed("GET, HEAD", "use GET\n");
    }
    if !auth::is_loopback(peer) {
        tracing::debug!(%peer, "GET /debug/stacks refused");
        return Reply::text(
            403,
            "forbidden: GET /debug/stacks is only answered inside the pod \
             (kubectl exec POD -- muster stacks)\n"
                .to_owned(),
        );
    }
    let Some(source) = metrics.stacks_source() else {
        return Reply::text(
            503,
            "no stack source: this agent runs no workers\n".to_owned(),
        );
    };
    match source.dump().await {
        Some(lines) if lines.is_empty() => {
            Reply::text(200, "no local rank is running\n".to_owned())
        }
        Some(lines) => Reply::text(200, lines.join("\n") + "\n"),
        None => Reply::text(503, "no local rank is running now\n".to_owned()),
    }
}

fn route(
    method: &Method,
    path: &str,
    bearer: Option<&[u8]>,
    peer: IpAddr,
    metrics: &Metrics,
    config: &EndpointConfig,
) -> Reply {
    let read_only = *method == Method::GET || *method == Method::HEAD;
    let (handler, reply) = match path {
        "/metrics" if read_only => {
            let mut reply = Reply::text(200, String::new());
            reply.content_type = METRICS_CONTENT_TYPE;
            reply.body = Bytes::from(metrics.encode());
            ("metrics", reply)
        }
        "/healthz" if read_only => ("healthz", healthz(metrics, config)),
        "/readyz" if read_only => ("readyz", readyz(metrics)),
        "/gangz" if read_only => ("gangz", gangz(metrics)),
        "/checkpoint" if *method == Method::POST => {
            ("checkpoint", checkpoint(bearer, peer, metrics, config))
        }
        "/" if read_only => ("other", Reply::text(200, INDEX.to_owned())),
        "/metrics" | "/healthz" | "/readyz" | "/gangz" | "/" => {
            ("other", not_allowed("GET, HEAD", "use GET\n"))
        }
        "/checkpoint" => ("other", not_allowed("POST", "use POST\n")),
        _ => ("other", Reply::text(404, "not found\n".to_owned())),
    };
    metrics.traffic().count_http_request(handler, reply.status);
    reply
}

fn not_allowed(allow: &'static str, body: &str) -> Reply {
    let mut reply = Reply::text(405, body.to_owned());
    reply.extra = Some((header::ALLOW, allow));
    reply
}

fn healthz(metrics: &Metrics, config: &EndpointConfig) -> Reply {
    let age = metrics.heartbeat_age();
    if age <= config.stale_after {
        Reply::text(200, "ok\n".to_owned())
    } else {
        Reply::text(
            503,
            format!(
                "unhealthy: the agent loop has been silent for {:.1}s (limit {}s)\n",
                age.as_secs_f64(),
                config.stale_after.as_secs()
            ),
        )
    }
}

fn readyz(metrics: &Metrics) -> Reply {
    match metrics.readiness() {
        Readiness::Ready => Reply::text(200, "ready\n".to_owned()),
        Readiness::Starting => Reply::text(
            503,
            "not ready: starting (reading the configuration, binding ports)\n".to_owned(),
        ),
        Readiness::HostingStore => Reply::text(
            503,
            "not ready: node 0's rendezvous store is not accepting connections yet\n".to_owned(),
        ),
    }
}

fn gangz(metrics: &Metrics) -> Reply {
    // A straggler is not a stopped gang: the status stays 200, the findings follow the line.
    let findings: String = metrics
        .straggler_findings()
        .iter()
        .flat_map(|f| [f.as_str(), "\n"])
        .collect();
    // What the warm standbys cost the pod, next to what they are for.
    let findings = match metrics.standby_line() {
        Some(line) => format!("{line}\n{findings}"),
        None => findings,
    };
    // Where a restart within the job would resume.
    let findings = match metrics.snapshot_line() {
        Some(line) => format!("{line}\n{findings}"),
        None => findings,
    };
    let spares = metrics.spare_hosts();
    if metrics.is_gang_running() {
        let head = if spares.is_empty() {
            "gang running".to_owned()
        } else {
            format!(
                "gang running; {} spare(s) waiting: {}",
                spares.len(),
                spares.join(", ")
            )
        };
        Reply::text(200, format!("{head}\n{findings}"))
    } else {
        Reply::text(
            503,
            format!(
                "gang not running: phase {}, {} local workers running\n{findings}",
                metrics.phase().as_str(),
                metrics.workers().workers_running()
            ),
        )
    }
}

fn checkpoint(
    bearer: Option<&[u8]>,
    peer: IpAddr,
    metrics: &Metrics,
    config: &EndpointConfig,
) -> Reply {
    if let Err(rejected) = auth::authorize(peer, bearer, config.checkpoint_token.as_ref()) {
        metrics.traffic().checkpoint_rejected(rejected);
        tracing::debug!(%peer, reason = rejected.as_str(), "POST /checkpoint refused");
        return match rejected {
            Rejected::Forbidden => Reply::text(
                403,
                "forbidden: POST /checkpoint is only accepted from inside the pod \
                 (kubectl exec POD -- curl -X POST localhost:8000/checkpoint), \
                 or with the bearer token of --checkpoint-token-file\n"
                    .to_owned(),
            ),
            Rejected::Unauthorized => {
                let mut reply = Reply::text(
                    401,
                    "unauthorized: a valid Authorization: Bearer token is required\n".to_owned(),
                );
                reply.extra = Some((header::WWW_AUTHENTICATE, "Bearer realm=\"muster\""));
                reply
            }
        };
    }
    let delivery = config.checkpoint_requests.deliver(CheckpointTrigger::Http);
    if delivery != CheckpointDelivery::NoConsumer {
        metrics
            .checkpoints()
            .checkpoint_requested(CheckpointTrigger::Http);
    }
    match delivery {
        CheckpointDelivery::Delivered => Reply::text(202, "checkpoint requested\n".to_owned()),
        CheckpointDelivery::AlreadyPending => {
            Reply::text(202, "checkpoint already requested\n".to_owned())
        }
        CheckpointDelivery::NoConsumer => {
            Reply::text(503, "checkpoint barrier not available\n".to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    #[test]
    fn bearer_tokens_are_read_once_and_only_from_the_bearer_scheme() {
        let h = headers(&[("authorization", "Bearer t0k ")]);
        assert_eq!(bearer(&h), Some(&b"t0k"[..]));
        let h = headers(&[("authorization", "bEaReR t0k")]);
        assert_eq!(bearer(&h), Some(&b"t0k"[..]));
        let h = headers(&[("authorization", "Bearer a"), ("authorization", "Bearer a")]);
        assert_eq!(
            bearer(&h),
            None,
            "two Authorization headers: neither counts"
        );
        assert_eq!(bearer(&headers(&[("authorization", "Basic YTpi")])), None);
        assert_eq!(bearer(&headers(&[("authorization", "Bearer")])), None);
        assert_eq!(bearer(&headers(&[])), None);
    }

    #[test]
    fn keep_alive_follows_the_version_and_the_connection_header() {
        let none = headers(&[]);
        assert!(wants_keep_alive(Version::HTTP_11, &none));
        assert!(!wants_keep_alive(Version::HTTP_10, &none));
        let close = headers(&[("connection", "Keep-Alive, Close")]);
        assert!(!wants_keep_alive(Version::HTTP_11, &close));
        assert!(!wants_keep_alive(Version::HTTP_10, &close));
        let keep = headers(&[("connection", "keep-alive")]);
        assert!(wants_keep_alive(Version::HTTP_10, &keep));
    }

    #[test]
    fn only_origin_and_absolute_targets_have_a_path() {
        for (target, want) in [
            ("/metrics?x=1", Some("/metrics")),
            ("http://pod:8000/readyz", Some("/readyz")),
            ("/", Some("/")),
            ("metrics:80", None),
            ("*", None),
        ] {
            let uri: hyper::Uri = target.parse().unwrap();
            assert_eq!(origin_path(&uri), want, "{target}");
        }
    }
}
