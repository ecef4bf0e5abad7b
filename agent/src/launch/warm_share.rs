//! Warm spares (issue #41): the module lists a gang's ranks recorded, shared through the agents'
//! store so that a node waiting as a spare keeps standbys for the ranks it would run.
//!
//! A member's [`super::standby::Pool`] hands its ranks' lists here once every local rank
//! recorded one ([`WarmShare::recorded`]); node ranks 0 and 1 put them on the store under
//! `warm_modules` (first writer wins: one key, however large the gang; two writers, so the loss
//! of one node leaves it). A node answered "spare" reads the key while it waits
//! ([`WarmShare::fetched`]), and the launch loop starts its standbys from it; when the spare
//! takes a lost node's place, its ranks start in them like a restarted member's.
//!
//! The value is untrusted bytes from the pod network: a list that does not decode, or names a
//! local rank this node does not have, is ignored (the spare starts cold, as before).

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::watch;

/// The module lists of one node's ranks, by local rank, each as the rank wrote it.
pub type ModuleLists = BTreeMap<u32, Vec<u8>>;

/// The largest value read from the store (a list is a few KiB per rank).
pub const MAX_VALUE_BYTES: usize = 4 << 20;

/// What the standby pool and the gang rendezvous share.
#[derive(Clone)]
pub struct WarmShare {
    inner: Arc<Shared>,
}

struct Shared {
    /// This node's ranks' lists, once every local rank recorded one.
    ours: watch::Sender<Option<ModuleLists>>,
    /// The gang's lists, as a spare read them from the store.
    gang: watch::Sender<Option<ModuleLists>>,
}

impl Default for WarmShare {
    fn default() -> Self {
        Self::new()
    }
}

impl WarmShare {
    pub fn new() -> Self {
        WarmShare {
            inner: Arc::new(Shared {
                ours: watch::Sender::new(None),
                gang: watch::Sender::new(None),
            }),
        }
    }

    /// Every local rank of this node recorded its list.
    pub fn recorded(&self, lists: ModuleLists) {
        self.inner.ours.send_replace(Some(lists));
    }

    /// Waits until this node's ranks recorded their lists ([`WarmShare::recorded`]).
    pub async fn ours(&self) -> ModuleLists {
        once_set(&self.inner.ours).await
    }

    /// A spare read the gang's lists.
    pub fn fetched(&self, lists: ModuleLists) {
        self.inner.gang.send_replace(Some(lists));
    }

    /// Resolves with the gang's lists once a spare read them (at once when it already did).
    pub async fn gang(&self) -> ModuleLists {
        once_set(&self.inner.gang).await
    }

    /// Forgets what a spare read (its lists were used).
    pub fn take_gang(&self) -> Option<ModuleLists> {
        self.inner.gang.send_replace(None)
    }
}

/// The value `lists` holds once it is set (at once when it already is).
async fn once_set(lists: &watch::Sender<Option<ModuleLists>>) -> ModuleLists {
    let mut rx = lists.subscribe();
    if let Ok(set) = rx.wait_for(Option::is_some).await {
        if let Some(lists) = set.clone() {
            return lists;
        }
    }
    // The sender lives in the share the caller holds: never closed.
    std::future::pending().await
}

/// The store value for `lists`: a JSON object from local rank to the list's text.
pub fn encode(lists: &ModuleLists) -> Vec<u8> {
    let texts: BTreeMap<String, String> = lists
        .iter()
        .map(|(rank, bytes)| {
            (
                rank.to_string(),
                String::from_utf8_lossy(bytes).into_owned(),
            )
        })
        .collect();
    serde_json::to_vec(&texts).unwrap_or_default()
}

/// Why a store value is not a set of module lists.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("{0} bytes, more than the {MAX_VALUE_BYTES} a module list may have")]
    TooLarge(usize),
    #[error("not a JSON object of local rank to list: {0}")]
    Malformed(String),
    #[error("local rank {0} is not one of this node's {1}")]
    NoSuchRank(String, u32),
}

/// The lists in `value` for a node of `local_ranks` ranks.
pub fn decode(value: &[u8], local_ranks: u32) -> Result<ModuleLists, DecodeError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(DecodeError::TooLarge(value.len()));
    }
    let texts: BTreeMap<String, String> =
        serde_json::from_slice(value).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    texts
        .into_iter()
        .map(|(rank, text)| match rank.parse::<u32>() {
            Ok(r) if r < local_ranks => Ok((r, text.into_bytes())),
            _ => Err(DecodeError::NoSuchRank(rank, local_ranks)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_survive_the_store_and_bad_values_are_named() {
        let lists: ModuleLists = [(0, b"[\"torch\"]".to_vec()), (1, b"[\"numpy\"]".to_vec())]
            .into_iter()
            .collect();
        assert_eq!(decode(&encode(&lists), 2), Ok(lists.clone()));
        assert!(matches!(
            decode(&encode(&lists), 1),
            Err(DecodeError::NoSuchRank(r, 1)) if r == "1"
        ));
        assert!(matches!(
            decode(b"[1, 2]", 2),
            Err(DecodeError::Malformed(_))
        ));
        assert!(matches!(
            decode(br#"{"-1": "x"}"#, 2),
            Err(DecodeError::NoSuchRank(..))
        ));
        let huge = vec![b' '; MAX_VALUE_BYTES + 1];
        assert_eq!(
            decode(&huge, 2),
            Err(DecodeError::TooLarge(MAX_VALUE_BYTES + 1))
        );
    }

    #[tokio::test]
    async fn what_a_spare_read_waits_for_it_and_is_taken_once() {
        let share = WarmShare::new();
        let waiting = {
            let share = share.clone();
            tokio::spawn(async move { share.gang().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        let lists: ModuleLists = [(0, b"[]".to_vec())].into_iter().collect();
        share.fetched(lists.clone());
        assert_eq!(waiting.await.ok(), Some(lists.clone()));
        assert_eq!(share.take_gang(), Some(lists));
        assert_eq!(share.take_gang(), None);
    }
}
