//! prometheus_client's multiprocess files, read without Python.
//!
//! In multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before the script imports
//! prometheus_client) every process writes its values into memory-mapped files in that
//! directory, one per metric type (and per gauge mode), named after its pid:
//! `counter_<pid>.db`, `gauge_<mode>_<pid>.db`, `histogram_<pid>.db`, `summary_<pid>.db`.
//!
//! The layout (prometheus_client's `mmap_dict.py`, 0.16 and later):
//! - bytes 0..4: how many bytes of the file are in use (`i32`, native order: little-endian on
//!   every platform muster runs on), then 4 bytes of padding; the file is preallocated (64 KiB)
//!   and grows by doubling, so the rest is zeros;
//! - then entries, each: the key's length (`i32`), the key (UTF-8 JSON
//!   `[metric_name, sample_name, {labels}, help]`), spaces up to the next multiple of 8 counting
//!   the length field (a full 8 when already aligned), the value (`f64`) and a Unix timestamp
//!   (`f64`, used by the `mostrecent` gauge modes, else 0).
//!
//! A writer appends an entry and only then raises the used count, so a reader that trusts the
//! header sees whole entries; a value may be torn only in the sense that it is older or newer.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// prometheus_client's gauge multiprocess modes (`Gauge(..., multiprocess_mode=...)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GaugeMode {
    /// One series per process (a `pid` label).
    All,
    Min,
    Max,
    Sum,
    /// The value set last, by its timestamp.
    MostRecent,
}

/// What a file holds, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Counter,
    /// A gauge mode, and whether it is a `live*` mode (only processes still running count).
    Gauge(GaugeMode, bool),
    Histogram,
    Summary,
}

/// A file name understood: its kind and the pid of the process that writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FileName {
    pub kind: Kind,
    pub pid: u32,
}

impl FileName {
    /// `gauge_livesum_123.db` and the like; `None` for any other file (prometheus_client ignores
    /// them too).
    pub fn parse(name: &str) -> Option<FileName> {
        let stem = name.strip_suffix(".db")?;
        let (prefix, pid) = stem.rsplit_once('_')?;
        let pid = pid.parse().ok()?;
        let kind = match prefix {
            "counter" => Kind::Counter,
            "histogram" => Kind::Histogram,
            "summary" => Kind::Summary,
            gauge => {
                let mode = gauge.strip_prefix("gauge_")?;
                let (live, base) = match mode.strip_prefix("live") {
                    Some(base) => (true, base),
                    None => (false, mode),
                };
                let mode = match base {
                    "all" => GaugeMode::All,
                    "min" => GaugeMode::Min,
                    "max" => GaugeMode::Max,
                    "sum" => GaugeMode::Sum,
                    "mostrecent" => GaugeMode::MostRecent,
                    _ => return None,
                };
                Kind::Gauge(mode, live)
            }
        };
        Some(FileName { kind, pid })
    }
}

/// What an entry's key says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// The metric's (family's) name, e.g. `requests` for a counter.
    pub metric: String,
    /// The sample's name, e.g. `requests_total`, `latency_seconds_bucket`.
    pub sample: String,
    /// The sample's labels, sorted by name.
    pub labels: BTreeMap<String, String>,
    pub help: String,
}

/// One value of a file.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub key: Arc<Key>,
    pub value: f64,
    pub timestamp: f64,
}

/// Keys already decoded, by their JSON bytes: the same few hundred keys come back at every scrape,
/// and decoding them is most of a scrape's work (prometheus_client keeps the same cache).
#[derive(Debug, Default)]
pub struct KeyCache(HashMap<Box<[u8]>, Arc<Key>>);

/// Keys kept at most; past it the cache starts over (a script inventing label values forever
/// must not grow the agent without bound).
const MAX_CACHED_KEYS: usize = 100_000;

impl KeyCache {
    fn get(&mut self, raw: &[u8]) -> Result<Arc<Key>, serde_json::Error> {
        if let Some(key) = self.0.get(raw) {
            return Ok(Arc::clone(key));
        }
        let (metric, sample, labels, help): (String, String, BTreeMap<String, String>, String) =
            serde_json::from_slice(raw)?;
        let key = Arc::new(Key {
            metric,
            sample,
            labels,
            help,
        });
        if self.0.len() >= MAX_CACHED_KEYS {
            self.0.clear();
        }
        self.0.insert(raw.into(), Arc::clone(&key));
        Ok(key)
    }
}

/// A file that cannot be read, or whose contents are not prometheus_client's format.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read: {0}")]
    Io(#[from] std::io::Error),
    #[error("too short for the header ({0} bytes)")]
    NoHeader(usize),
    #[error("entry at byte {at} runs past the used size {used}")]
    Truncated { at: usize, used: usize },
    #[error("entry at byte {at}: key is not [metric, sample, labels, help] JSON: {source}")]
    Key {
        at: usize,
        #[source]
        source: serde_json::Error,
    },
}

/// Largest file read (prometheus_client doubles from 64 KiB; a script with a million series would
/// reach this, and muster would rather skip it than hold it in memory at every scrape).
pub const MAX_FILE_BYTES: usize = 256 * 1024 * 1024;

/// Reads the used part of `path`: the header first, then only what it says is in use (the rest
/// of a preallocated file is zeros).
pub fn read(path: &Path, keys: &mut KeyCache) -> Result<Vec<Entry>, FileError> {
    let mut file = std::fs::File::open(path)?;
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < head.len() {
        match file.read(&mut head[got..])? {
            0 => return Err(FileError::NoHeader(got)),
            n => got += n,
        }
    }
    let used = used_bytes(&head).min(MAX_FILE_BYTES);
    let mut data = Vec::with_capacity(used);
    data.extend_from_slice(&head);
    file.take(used.saturating_sub(head.len()) as u64)
        .read_to_end(&mut data)?;
    parse(&data, keys)
}

fn used_bytes(data: &[u8]) -> usize {
    let raw = i32_at(data, 0).unwrap_or(0);
    usize::try_from(raw).unwrap_or(0)
}

fn i32_at(data: &[u8], at: usize) -> Option<i32> {
    let bytes = data.get(at..at.checked_add(4)?)?;
    Some(i32::from_le_bytes(bytes.try_into().ok()?))
}

fn f64_at(data: &[u8], at: usize) -> Option<f64> {
    let bytes = data.get(at..at.checked_add(8)?)?;
    Some(f64::from_le_bytes(bytes.try_into().ok()?))
}

/// The entries of a file's bytes (at least the used part of it).
pub fn parse(data: &[u8], keys: &mut KeyCache) -> Result<Vec<Entry>, FileError> {
    if data.len() < 8 {
        return Err(FileError::NoHeader(data.len()));
    }
    // A file cut short (a fixture, or one being extended) holds what it holds.
    let used = used_bytes(data).min(data.len());
    let mut entries = Vec::new();
    let mut pos = 8;
    while pos < used {
        let truncated = FileError::Truncated { at: pos, used };
        let Some(len) = i32_at(data, pos).and_then(|l| usize::try_from(l).ok()) else {
            return Err(truncated);
        };
        let key_start = pos + 4;
        let padded = len + (8 - (len + 4) % 8);
        let value_at = key_start + padded;
        if value_at + 16 > used {
            return Err(truncated);
        }
        let Some(key) = data.get(key_start..key_start + len) else {
            return Err(truncated);
        };
        let key = keys
            .get(key)
            .map_err(|source| FileError::Key { at: pos, source })?;
        let (Some(value), Some(timestamp)) = (f64_at(data, value_at), f64_at(data, value_at + 8))
        else {
            return Err(truncated);
        };
        entries.push(Entry {
            key,
            value,
            timestamp,
        });
        pos = value_at + 16;
    }
    Ok(entries)
}
