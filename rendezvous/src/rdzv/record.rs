//! The generation record on the store: reading and bumping it, waking the spares when it ends,
//! and the mapping of store and encoding failures to [`RdzvError`], shared by every phase.

use tracing::debug;

use super::keys::Keys;
use super::kv::{Kv, KvError};
use super::{BumpKind, GenRecord, RdzvError};

/// COMPARE_SET `gen` from `expected_raw` to `next`; returns whatever generation holds after.
pub(super) async fn bump<K: Kv>(
    kv: &mut K,
    keys: &Keys,
    expected_raw: &[u8],
    next: &GenRecord,
) -> Result<GenRecord, RdzvError> {
    let key = keys.gen();
    let body = serde_json::to_vec(next).map_err(internal)?;
    let now = kv
        .compare_set(&key, expected_raw, &body)
        .await
        .map_err(lost)?;
    let now: GenRecord = parse_json(&key, &now)?;
    if &now == next {
        if let Ok(ended) = serde_json::from_slice::<GenRecord>(expected_raw) {
            wake_spares(kv, keys, ended.gen, b"bump").await;
        }
    }
    Ok(now)
}

/// Tells the spares of generation `gen` that it ended (see [`Keys::over`]). Best effort: a spare
/// that misses it reads `gen` at its next keep-alive tick.
pub(super) async fn wake_spares<K: Kv>(kv: &mut K, keys: &Keys, gen: u64, why: &[u8]) {
    if let Err(e) = kv.set(&keys.over(gen), why).await {
        debug!(gen, "could not wake the spares: {e}");
    }
}

/// Ends with the job's fatal error when `rec` is a [`BumpKind::Fatal`] generation.
pub(super) fn check_fatal(rec: &GenRecord) -> Result<(), RdzvError> {
    if rec.kind == BumpKind::Fatal {
        return Err(RdzvError::Fatal {
            exit_code: rec.exit_code.unwrap_or(1),
            reason: rec.reason.clone(),
        });
    }
    Ok(())
}

/// Decodes the JSON value stored at `key`; a value that does not parse is malformed.
pub(super) fn parse_json<T: serde::de::DeserializeOwned>(
    key: &[u8],
    value: &[u8],
) -> Result<T, RdzvError> {
    serde_json::from_slice(value).map_err(|e| RdzvError::Malformed {
        key: String::from_utf8_lossy(key).into_owned(),
        detail: e.to_string(),
    })
}

/// A failed store operation during a rendezvous step: the store host is lost.
pub(super) fn lost(e: KvError) -> RdzvError {
    match e {
        KvError::Slow(detail) | KvError::Silent(detail) | KvError::Gone(detail) => {
            RdzvError::StoreLost(detail)
        }
        KvError::WaitTimeout => RdzvError::StoreLost("a store operation timed out".into()),
    }
}

/// A value of our own that could not be encoded (a bug).
pub(super) fn internal(e: serde_json::Error) -> RdzvError {
    RdzvError::Encode(e)
}
