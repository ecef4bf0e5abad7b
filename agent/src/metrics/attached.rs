//! A scrape-time collector whose source is attached after the registry is built: the worker
//! output counters, the GPU watch and the store-host loss record all exist only once the launch
//! has started them, but their families must be registered (and named) from the start.
//!
//! Nothing is exported until a source is attached; then every scrape clones the source out of the
//! lock (an `Arc` or a cheap handle) and builds the families from it, so an attach never waits on
//! a scrape.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;

use super::live::descs;

/// Builds a collector's families from its source; `descs` are its descriptors (for help texts).
pub(super) type Families<S> = fn(&S, &[Desc]) -> Vec<MetricFamily>;

/// One collector, shared: the registry owns one clone, the metrics handle keeps another to attach
/// the source.
pub(super) struct Attached<S> {
    inner: Arc<Inner<S>>,
}

struct Inner<S> {
    source: Mutex<Option<S>>,
    descs: Vec<Desc>,
    families: Families<S>,
}

impl<S> Clone for Attached<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S: Clone> Attached<S> {
    /// A collector of the families `defs` (`(name, help, label names)` each), empty until
    /// [`Attached::attach`].
    pub(super) fn new(defs: &[(&str, &str, &[&str])], families: Families<S>) -> Self {
        Self {
            inner: Arc::new(Inner {
                source: Mutex::new(None),
                descs: descs(defs),
                families,
            }),
        }
    }

    /// The attached source, if any.
    pub(super) fn source(&self) -> Option<S> {
        self.inner
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Gives the collector its source (a later attach replaces it).
    pub(super) fn attach(&self, source: S) {
        *self
            .inner
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(source);
    }
}

impl<S: Clone + Send + 'static> Collector for Attached<S> {
    fn desc(&self) -> Vec<&Desc> {
        self.inner.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(source) = self
            .inner
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        else {
            return Vec::new();
        };
        (self.inner.families)(&source, &self.inner.descs)
    }
}
