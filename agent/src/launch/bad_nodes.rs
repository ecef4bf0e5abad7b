//! Bad nodes remembered: a Kubernetes node found bad (GPU pre-flight 204, network check 208,
//! slow-node exclusion 210) is recorded in the gang's rendezvous store under its node name, and a
//! later pod of the same job scheduled onto that node fails fast with the original finding instead
//! of paying the checks again.
//!
//! The node name comes from `NODE_NAME`, which the manifests set from the downward API
//! (`spec.nodeName`); without it nothing is recorded or looked up. Records live under
//! `muster/<run_id>/bad_node/<node name>` ([`key`]), so they last as long as the gang's store
//! (node 0's agent) and belong to one job. Who may write them: any client that reaches the
//! rendezvous store, as for every other key there (see docs/store.md); a forged record makes a
//! pod on that node exit with the recorded code, which the job's failure policy then handles.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rendezvous::rdzv::{Kv, KvError};
use serde::{Deserialize, Serialize};

/// The downward-API variable naming the Kubernetes node the pod runs on.
pub const NODE_NAME_ENV: &str = "NODE_NAME";

/// How long a starting agent spends looking for its node's record before it runs its checks
/// anyway: node 0's store may not be up yet (every pod starts at once), and then there is no
/// memory to consult: the checks run as without one.
pub const LOOKUP_BUDGET: Duration = Duration::from_secs(3);

/// The longest finding message stored (the first lines say what was found).
const MAX_MESSAGE_BYTES: usize = 2048;

/// What was found on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// The exit code the finding gave (204, 208, 210).
    pub exit_code: u8,
    /// The original message, naming what was measured.
    pub message: String,
    /// The host (pod) that found it.
    pub found_by: String,
    /// When, by the finder's clock (for people; never compared).
    pub at_unix_ms: u64,
}

impl Finding {
    pub fn new(exit_code: u8, message: &str) -> Self {
        let mut message = message.to_owned();
        if message.len() > MAX_MESSAGE_BYTES {
            let mut cut = MAX_MESSAGE_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Self {
            exit_code,
            message,
            found_by: crate::host::name(),
            at_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }
    }

    /// The line a pod on a recorded node exits with.
    pub fn refusal(&self, node_name: &str) -> String {
        format!(
            "node {node_name} was found bad earlier in this job (by {}, exit {}): {}; not running the checks again: taint the node (docs/multinode.md#bad-nodes-remembered)",
            self.found_by, self.exit_code, self.message
        )
    }
}

/// This pod's Kubernetes node name, from [`NODE_NAME_ENV`]; `None` when unset or empty.
pub fn node_name() -> Option<String> {
    std::env::var(NODE_NAME_ENV)
        .ok()
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
}

/// The store key of `node_name`'s record.
pub fn key(run_id: &str, node_name: &str) -> Vec<u8> {
    format!("muster/{run_id}/bad_node/{node_name}").into_bytes()
}

/// Records `finding` for `node_name` in the gang's store (the last finding wins). Callers: the
/// GPU pre-flight's fatal verdict, the network check's leave verdict, and the slow-node
/// exclusion.
pub async fn record<K: Kv>(
    kv: &mut K,
    run_id: &str,
    node_name: &str,
    finding: &Finding,
) -> Result<(), KvError> {
    let value = serde_json::to_vec(finding).unwrap_or_default();
    kv.set(&key(run_id, node_name), &value).await
}

/// The record of `node_name`, if one was made. MULTI_GET, not GET: a missing key reads as empty
/// instead of blocking until someone sets it.
pub async fn lookup<K: Kv>(
    kv: &mut K,
    run_id: &str,
    node_name: &str,
) -> Result<Option<Finding>, KvError> {
    let values = kv.multi_get(&[key(run_id, node_name)]).await?;
    Ok(values
        .first()
        .filter(|v| !v.is_empty())
        .and_then(|v| serde_json::from_slice(v).ok()))
}

/// Before any check runs: this pod's node's record in the gang's store, if `NODE_NAME` is set
/// and one was made. One bounded look ([`LOOKUP_BUDGET`]): `None` when the endpoint cannot be
/// reached yet (node 0's store is not up, or this is node 0) or nothing is recorded, and the
/// checks run as usual.
pub async fn probe(config: &super::Config) -> Option<(String, Finding)> {
    let node = node_name()?;
    let look = async {
        let mut kv = connect(config).await?;
        match lookup(&mut kv, &config.run_id, &node).await {
            Ok(found) => found,
            Err(e) => {
                tracing::debug!("bad-node lookup: {e}");
                None
            }
        }
    };
    let found = tokio::time::timeout(LOOKUP_BUDGET, look)
        .await
        .ok()
        .flatten()?;
    Some((node, found))
}

/// Records `finding` for this pod's node (`NODE_NAME`) in the gang's store, from a part of the
/// agent that holds no rendezvous connection (the slow-node exclusion). Bounded by
/// [`LOOKUP_BUDGET`]; a failure is logged, never fatal: the node leaves either way.
pub async fn remember(config: &super::Config, finding: &Finding) {
    let Some(node) = node_name() else {
        return;
    };
    let write = async {
        let Some(mut kv) = connect(config).await else {
            return Err("the rendezvous store cannot be reached".to_owned());
        };
        record(&mut kv, &config.run_id, &node, finding)
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(LOOKUP_BUDGET, write).await {
        Ok(Ok(())) => tracing::info!("node {node} recorded as bad in the gang's store"),
        Ok(Err(e)) => tracing::warn!("could not record node {node} as bad: {e}"),
        Err(_) => tracing::warn!(
            "could not record node {node} as bad: no answer within {} s",
            LOOKUP_BUDGET.as_secs()
        ),
    }
}

/// A connection to the gang's rendezvous store (`--rdzv-endpoint`, else `--master-addr`/`-port`),
/// the first address of the endpoint that answers; `None` when none does.
async fn connect(config: &super::Config) -> Option<rendezvous::rdzv::StoreKv> {
    let text = config.rdzv_endpoint_text();
    let endpoint = crate::discovery::parse_endpoint(&text).ok()?;
    tracing::debug!("bad-node memory: connecting to the gang's store at {text}");
    let addrs = tokio::net::lookup_host((endpoint.host.as_str(), endpoint.port))
        .await
        .ok()?;
    for addr in addrs {
        match rendezvous::rdzv::StoreKv::connect(addr, LOOKUP_BUDGET, LOOKUP_BUDGET).await {
            Ok(kv) => return Some(kv),
            Err(e) => tracing::debug!("bad-node memory: cannot reach {addr}: {e}"),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use rendezvous::rdzv::StoreKv;
    use rendezvous::store::server::{Config, ServerThread};

    use super::*;

    #[tokio::test]
    async fn a_recorded_node_is_found_and_others_are_not() {
        let store = ServerThread::start("127.0.0.1:0".parse().unwrap(), Config::default())
            .await
            .unwrap();
        let second = Duration::from_secs(5);
        let mut kv = StoreKv::connect(store.local_addr(), second, second)
            .await
            .unwrap();
        assert_eq!(lookup(&mut kv, "job", "gpu-node-7").await.unwrap(), None);
        let finding = Finding::new(204, "GPU 3 (GPU-abc): XID 79");
        record(&mut kv, "job", "gpu-node-7", &finding)
            .await
            .unwrap();
        // Another pod, later: its own connection.
        let mut later = StoreKv::connect(store.local_addr(), second, second)
            .await
            .unwrap();
        let found = lookup(&mut later, "job", "gpu-node-7")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(found, finding);
        // Another node, another job: nothing.
        assert_eq!(lookup(&mut later, "job", "gpu-node-8").await.unwrap(), None);
        assert_eq!(
            lookup(&mut later, "other", "gpu-node-7").await.unwrap(),
            None
        );
        let text = found.refusal("gpu-node-7");
        assert!(
            text.starts_with("node gpu-node-7 was found bad earlier in this job (by "),
            "{text}"
        );
        assert!(text.contains("exit 204): GPU 3 (GPU-abc): XID 79; not running the checks again"));
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let f = Finding::new(208, &"é".repeat(MAX_MESSAGE_BYTES));
        assert!(f.message.len() <= MAX_MESSAGE_BYTES);
    }
}
