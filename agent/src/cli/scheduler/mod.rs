//! The scheduler that started this agent, behind one small interface: each one completes the
//! job's shape from what it says (where the flags and `PET_*` variables left it open) and says
//! how it behaves, which the gang and the app act on instead of asking which scheduler it is.
//!
//! - [`kubernetes`]: a pod of an Indexed Job, PyTorchJob or JobSet (and the default: a plain
//!   container or a shell behaves as one).
//! - [`slurm`]: a task of a Slurm step (`srun muster ...`).
//!
//! A third scheduler (LSF, Flux) is one more implementation and one line in [`detect`].

pub mod kubernetes;
pub mod slurm;

use std::ffi::OsString;

use super::lowargs::LowArgs;

pub use crate::launch::config::SchedulerBehaviour as Behaviour;

/// One scheduler muster knows.
pub trait Scheduler {
    /// How it behaves (see [`Behaviour`]).
    fn behaviour(&self) -> Behaviour;

    /// The GPUs it gave this node, when it says: `--nproc-per-node gpu|auto` counts these
    /// rather than the device nodes (which a node shows whatever a step was given).
    fn gpus(&self) -> Option<u32> {
        None
    }
}

/// Why the scheduler's environment cannot be used: a configuration error (exit 202).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SchedulerError(String);

/// The scheduler that started this process, with the job's shape in `low` completed from it:
/// the first that recognises its environment, else Kubernetes (the default).
pub fn detect(
    low: &mut LowArgs,
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<Box<dyn Scheduler>, SchedulerError> {
    if let Some(step) = slurm::apply(low, env, &slurm::Lookup::system())
        .map_err(|e| SchedulerError(e.to_string()))?
    {
        return Ok(Box::new(step));
    }
    Ok(Box::new(kubernetes::Kubernetes::from_env(env)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detected(vars: &[(&str, &str)]) -> Behaviour {
        let env = |k: &str| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| OsString::from(v))
        };
        let mut low = crate::cli::lowargs::parse(&[OsString::from("train.py")], &env).unwrap();
        detect(&mut low, &env).unwrap().behaviour()
    }

    #[test]
    fn a_slurm_task_is_never_replaced_and_gets_signals_with_every_process() {
        // The batch script of a one-node job: no step, nothing to look up.
        let b = detected(&[("SLURM_JOB_ID", "7"), ("SLURM_NODEID", "0")]);
        assert_eq!(b.name, "slurm");
        assert!(!b.replaces_lost_nodes && b.signals_every_process);
        assert!(b.summary.is_some_and(|s| s.contains("Slurm job 7")));
    }

    #[test]
    fn anywhere_else_it_is_a_pod_whose_index_names_its_node() {
        let b = detected(&[("JOB_COMPLETION_INDEX", "2")]);
        assert_eq!(b.name, "kubernetes");
        assert!(b.replaces_lost_nodes && !b.signals_every_process);
        assert_eq!(b.node_index.as_deref(), Some("2"));
        assert_eq!(detected(&[]), Behaviour::default());
    }
}
