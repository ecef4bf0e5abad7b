//! The "obtain the assignment" step of every attempt: the [`Rendezvous`] seam of the launch
//! loop and its two implementations, side by side: [`local`] for one node (this agent hosts a
//! fresh store per attempt) and [`gang`] for many (muster's gang rendezvous over node 0's
//! store, with discovery of the endpoint).

pub mod gang;
mod local;
mod warm;

use std::future::Future;
use std::pin::Pin;

pub use gang::GangRendezvous;
pub use local::LocalRendezvous;

use super::{Config, GroupOutcome, LaunchError, Round, StopRequest};

/// Whether this launch needs the multi-node rendezvous.
pub fn is_multi_node(config: &Config) -> bool {
    !config.standalone && config.nnodes.max > 1
}

/// A boxed future, for the object-safe [`Rendezvous`] trait.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The "obtain assignment" step of every attempt.
pub trait Rendezvous: Send {
    /// Joins round `restart_count` and returns the assignment. Should give up promptly when
    /// `stop` is requested.
    fn next_round<'a>(
        &'a mut self,
        config: &'a Config,
        restart_count: u32,
        stop: &'a StopRequest,
    ) -> BoxFuture<'a, Result<Round, LaunchError>>;

    /// Where the standby pool and the rendezvous meet (warm spares, [`super::warm_share`]): the
    /// gang rendezvous publishes this node's module lists and, while it waits as a spare,
    /// fetches the gang's; one node's has no spares.
    fn share_warm_modules(&mut self, _share: super::warm_share::WarmShare) {}

    /// Node 0's list of the nodes waiting as spares (the gang rendezvous only).
    fn spare_hosts(&self) -> Option<rendezvous::rdzv::driver::SpareHosts> {
        None
    }

    /// Resolves when the group must stop because the gang re-forms (another node failed, died
    /// or joined). Must be cancel-safe: it is dropped when the group ends first.
    fn watch(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::pending())
    }

    /// Decides what follows an attempt; `None` keeps the local policy (restart while
    /// `--max-restarts` lasts). The multi-node rendezvous restarts every node together here.
    fn after_group<'a>(
        &'a mut self,
        _outcome: &'a GroupOutcome,
        _stop: &'a StopRequest,
    ) -> BoxFuture<'a, Result<Option<AfterGroup>, LaunchError>> {
        Box::pin(async { Ok(None) })
    }

    /// The gang's root cause of the last failed attempt, as read from the failure board
    /// ([`super::gang_cause`]); `None` on a single node, or when nothing could be read.
    fn gang_cause(&self) -> Option<super::gang_cause::GangCause> {
        None
    }

    /// Asks that this node's failed attempt, handed to [`Rendezvous::after_group`] next, end the
    /// job for every node with `exit_code` and `why` instead of a restart (the crash-loop
    /// guard). `false`: this rendezvous has no gang to tell; the caller ends by itself.
    fn end_on_failure(&mut self, _exit_code: u8, _why: String) -> bool {
        false
    }
}

/// What the rendezvous decided after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterGroup {
    /// Start another attempt (the rendezvous counts restarts itself), for this reason.
    Restart(GangRestart),
    /// End the launch with this exit code.
    Finish(u8),
}

/// Why the gang starts another attempt: what the restart budget and the crash-loop guard count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GangRestart {
    /// A worker failed, here or on another node: one restart of `--max-restarts`.
    Failure,
    /// The membership changed (a node lost or admitted, the store host replaced); a local
    /// failure that followed a loss is its consequence. Uses no restart.
    Membership,
}

impl GangRestart {
    /// The restart the generation record `kind` stands for.
    pub fn of(kind: rendezvous::rdzv::BumpKind) -> Self {
        if kind == rendezvous::rdzv::BumpKind::Failure {
            Self::Failure
        } else {
            Self::Membership
        }
    }
}
