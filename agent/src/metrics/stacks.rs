//! `GET /debug/stacks`'s source: every local rank's Python stacks now, read the way the hang
//! watch reads them ([`crate::hang_watch::Stacks`]). Like the store's statistics, it is state the
//! endpoint samples when asked; nothing in the launch knows about the endpoint.

use std::future::Future;
use std::pin::Pin;

/// What `GET /debug/stacks` reads.
pub trait StacksSource: Send + Sync {
    /// The dump as lines (a header per rank, then its threads); `None` when no rank is running.
    fn dump(&self) -> Pin<Box<dyn Future<Output = Option<Vec<String>>> + Send + '_>>;
}

impl StacksSource for crate::hang_watch::Stacks {
    fn dump(&self) -> Pin<Box<dyn Future<Output = Option<Vec<String>>> + Send + '_>> {
        Box::pin(crate::hang_watch::Stacks::dump(self))
    }
}
