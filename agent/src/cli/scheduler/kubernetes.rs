//! A pod started by Kubernetes: an Indexed Job, a PyTorchJob (whose operator sets torchrun's
//! `PET_*` variables, read with the flags) or a JobSet. A failed pod is recreated by its Job, so
//! a lost node can be replaced; only the agent signals the ranks; an Indexed Job numbers its pods
//! (`JOB_COMPLETION_INDEX`), which can be the node rank.

use std::ffi::OsString;

use super::{Behaviour, Scheduler};

/// The variable an Indexed Job (and a JobSet's) sets in each pod: its index.
pub const COMPLETION_INDEX_ENV: &str = "JOB_COMPLETION_INDEX";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Kubernetes {
    completion_index: Option<String>,
}

impl Kubernetes {
    pub fn from_env(env: &dyn Fn(&str) -> Option<OsString>) -> Self {
        Self {
            completion_index: env(COMPLETION_INDEX_ENV).map(|v| v.to_string_lossy().into_owned()),
        }
    }
}

impl Scheduler for Kubernetes {
    fn behaviour(&self) -> Behaviour {
        Behaviour {
            name: "kubernetes",
            summary: None,
            replaces_lost_nodes: true,
            signals_every_process: false,
            node_index: self.completion_index.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_indexed_jobs_pod_carries_its_index_and_lost_nodes_are_replaced() {
        let env = |k: &str| (k == COMPLETION_INDEX_ENV).then(|| OsString::from("3"));
        let b = Kubernetes::from_env(&env).behaviour();
        assert_eq!(b.node_index.as_deref(), Some("3"));
        assert!(b.replaces_lost_nodes && !b.signals_every_process);
        assert_eq!(Kubernetes::from_env(&|_| None).behaviour().node_index, None);
    }
}
