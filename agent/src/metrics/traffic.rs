//! What the endpoint itself served and refused: requests by handler and code, connections shed
//! at its limits, and `POST /checkpoint` requests refused by [`super::auth`].

use prometheus::IntCounterVec;

use super::{auth, conns, Defs};

/// The endpoint's counters.
pub(super) struct Traffic {
    requests: IntCounterVec,
    shed: IntCounterVec,
    checkpoint_rejected: IntCounterVec,
}

impl Traffic {
    /// Defines the family, every shed limit and rejection reason at 0.
    pub(super) fn register(defs: &mut Defs) -> Self {
        let traffic = Self {
            requests: defs.counter_vec(
                "muster_http_requests_total",
                "Requests served by the metrics endpoint, by handler and status code.",
                &["handler", "code"],
            ),
            shed: defs.counter_vec(
                "muster_http_connections_shed_total",
                "Connections the metrics endpoint closed to stay within its limits (the oldest idle one of the address at its limit, or a new one when none was idle), by limit (peer, total).",
                &["limit"],
            ),
            checkpoint_rejected: defs.counter_vec(
                "muster_checkpoint_requests_rejected_total",
                "POST /checkpoint requests refused: forbidden (not loopback, no token configured) or unauthorized (missing or wrong bearer token).",
                &["reason"],
            ),
        };
        for limit in conns::Shed::ALL {
            traffic.shed.with_label_values(&[limit.as_str()]);
        }
        for reason in auth::Rejected::ALL {
            traffic
                .checkpoint_rejected
                .with_label_values(&[reason.as_str()]);
        }
        traffic
    }

    /// A connection was closed to stay within `limit`.
    pub(super) fn count_http_shed(&self, limit: conns::Shed) {
        self.shed.with_label_values(&[limit.as_str()]).inc();
    }

    /// A `POST /checkpoint` was refused for `reason`.
    pub(super) fn checkpoint_rejected(&self, reason: auth::Rejected) {
        self.checkpoint_rejected
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// A request to `handler` was answered with `code`.
    pub(super) fn count_http_request(&self, handler: &'static str, code: u16) {
        self.requests
            .with_label_values(&[handler, &code.to_string()])
            .inc();
    }
}
