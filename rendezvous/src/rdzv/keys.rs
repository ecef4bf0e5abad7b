//! The rendezvous's store key layout. Every key is under `muster/<run_id>/` and every
//! per-round key under `muster/<run_id>/g<generation>/`, so two jobs sharing a store and two
//! rounds of one job never read each other's keys.
//!
//! | key | value | written by |
//! |---|---|---|
//! | `gen` | JSON [`super::GenRecord`] | COMPARE_SET by whoever bumps |
//! | `hb/<agent id>` | ASCII counter | SET by each agent every keep-alive interval |
//! | `g<G>/slots` | ADD counter: number of slots taken | ADD by each joiner |
//! | `g<G>/slot/<i>` | JSON [`super::Registration`] | SET by the joiner of slot i (1-based) |
//! | `g<G>/assign/<i>` | JSON [`super::Answer`] | MULTI_SET by the coordinator |
//! | `g<G>/acks` | ADD counter | joiners that read a terminal answer (timeout), so node 0 can leave |
//! | `g<G>/done`, `g<G>/done_all` | ADD counter (+1 per report, +[`super::decide::ABORT`] per abort); `1` | exit barrier: reports, and aborts that end the generation early; a spare that `g<G>/over` woke reads `done_all` to know the job finished without it |
//! | `g<G>/over` | `bump` or `done` | SET by whoever ends generation G (a won bump of `gen`, or the exit barrier's completion after `done_all`): spares WAIT on it, so one takes a lost member's place at once |
//! | `g<G>/left` | ADD counter | members that passed the exit barrier, so node 0 leaves last |
//! | `memory` | JSON [`super::recovery::GangMemory`] | SET by a replacement node 0 that adopted the survivors' memory |
//! | `g<G>/failures` | ADD counter: failures posted | ADD by a node whose worker failed ([`super::board`]) |
//! | `g<G>/failure/<i>` | opaque JSON (the agent's failure record) | SET by the poster of failure i (1-based, in the store host's receive order) |
//! | `warm_modules` | opaque JSON (the agent's: the ranks' installed modules by local rank) | COMPARE_SET from missing by the first member whose ranks recorded theirs; read by spares |

/// Builds the wire keys of one run.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(run_id: &str) -> Self {
        Self {
            prefix: format!("muster/{run_id}/"),
        }
    }

    /// The installed modules the gang's ranks imported, by local rank (opaque JSON, the agent's):
    /// what a spare's warm standbys import while it waits.
    pub fn warm_modules(&self) -> Vec<u8> {
        format!("{}warm_modules", self.prefix).into_bytes()
    }

    pub fn gen(&self) -> Vec<u8> {
        format!("{}gen", self.prefix).into_bytes()
    }

    pub fn memory(&self) -> Vec<u8> {
        format!("{}memory", self.prefix).into_bytes()
    }

    pub fn heartbeat(&self, agent_id: &str) -> Vec<u8> {
        format!("{}hb/{agent_id}", self.prefix).into_bytes()
    }

    pub fn slots(&self, gen: u64) -> Vec<u8> {
        format!("{}g{gen}/slots", self.prefix).into_bytes()
    }

    pub fn slot(&self, gen: u64, slot: u64) -> Vec<u8> {
        format!("{}g{gen}/slot/{slot}", self.prefix).into_bytes()
    }

    pub fn assign(&self, gen: u64, slot: u64) -> Vec<u8> {
        format!("{}g{gen}/assign/{slot}", self.prefix).into_bytes()
    }

    pub fn acks(&self, gen: u64) -> Vec<u8> {
        format!("{}g{gen}/acks", self.prefix).into_bytes()
    }

    pub fn done(&self, gen: u64) -> Vec<u8> {
        format!("{}g{gen}/done", self.prefix).into_bytes()
    }

    pub fn done_all(&self, gen: u64) -> Vec<u8> {
        format!("{}g{gen}/done_all", self.prefix).into_bytes()
    }

    pub fn over(&self, gen: u64) -> Vec<u8> {
        format!("{}g{gen}/over", self.prefix).into_bytes()
    }

    pub fn left(&self, gen: u64) -> Vec<u8> {
        format!("{}g{gen}/left", self.prefix).into_bytes()
    }

    pub fn failures(&self, gen: u64) -> Vec<u8> {
        format!("{}g{gen}/failures", self.prefix).into_bytes()
    }

    pub fn failure(&self, gen: u64, seq: u64) -> Vec<u8> {
        format!("{}g{gen}/failure/{seq}", self.prefix).into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_and_runs_never_share_keys() {
        let a = Keys::new("job");
        let b = Keys::new("job2");
        assert_eq!(a.slot(3, 7), b"muster/job/g3/slot/7");
        assert_ne!(a.slot(3, 7), a.slot(4, 7));
        assert_ne!(a.gen(), b.gen());
        assert_eq!(a.heartbeat("x1"), b"muster/job/hb/x1");
        assert_ne!(a.warm_modules(), b.warm_modules());
    }
}
