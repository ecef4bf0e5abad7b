//! Slurm, the other engine large PyTorch jobs run on: what muster reads from it without shelling
//! out. The job's shape is taken from a step's environment by [`crate::cli`] (its `slurm`
//! module: below the command line, `MUSTER_*` and `PET_*`); this module holds the parts that
//! need no command line: the hostlist syntax ([`hostlist`]), a node's address in `slurm.conf`
//! ([`conf`]), and what the ranks are told (docs/slurm.md).

pub mod conf;
pub mod hostlist;

/// The c10d port when `MASTER_PORT` does not say (torchrun's, and `--rdzv-endpoint`'s default).
pub const DEFAULT_PORT: u16 = crate::discovery::DEFAULT_PORT;

/// Set for the ranks of a Slurm job to the numbers of the signals whose action is `checkpoint`
/// (`15`, or `15,10` with `--signals-to-handle USR1:checkpoint`): muster's Python side (the
/// checkpoint helper and the framework callbacks, which take part in the checkpoint barrier)
/// then holds such a signal when it did not come from the agent, since `slurmstepd` signals
/// every process of the step and the agent's barrier decides when its ranks stop
/// (docs/slurm.md, [`crate::launch::stop_mark`]).
pub const HOLD_ENV: &str = "MUSTER_HOLD_FOREIGN_SIGNALS";
