//! Replication of snapshots to a buddy node, so that the loss of one pod (node 0 included) still
//! leaves every part of a committed step somewhere: after each commit a node copies its ranks'
//! parts to the next node of the ring (node rank + 1, modulo the node count); at the start of an
//! attempt a node that lost its own parts (a replacement pod) fetches them from the node that
//! holds them before its ranks restore.
//!
//! - [`Replicas`]: what one agent holds for other nodes (pure).
//! - [`wire`]: the frames of the agent-to-agent connection.
//! - [`net`]: its listener, and the push and fetch over it.
//!
//! Who may call the listener: an agent of this job — one that read the listener's token from
//! the attempt's store (`replica-addr/<node>`); the store is the job's trust boundary, as it is
//! for the rendezvous and for torch's own bootstrap. A connection with any other token, a
//! malformed frame or an oversized length is closed with a WARN and changes nothing held.

pub mod net;
pub mod wire;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};

use nix::fcntl::{FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};

/// What the listener needs of the agent's snapshot service.
pub trait Host: Send + Sync + 'static {
    /// The attempt this node is in, and the bytes it may still take under its cap.
    fn attempt_and_room(&self) -> (Option<u32>, u64);
    fn replicas(&self) -> std::sync::MutexGuard<'_, Replicas>;
}

/// One node's parts of one step, held for it.
#[derive(Debug)]
pub struct Replica {
    pub step: u64,
    pub attempt: u32,
    pub world_size: u32,
    pub first_rank: u32,
    /// rank → (sealed memory file, bytes).
    pub parts: BTreeMap<u32, (OwnedFd, u64)>,
}

impl Replica {
    pub fn bytes(&self) -> u64 {
        self.parts.values().map(|(_, b)| *b).sum()
    }
}

/// What this agent holds for other nodes: the newest step each buddy handed over.
#[derive(Debug, Default)]
pub struct Replicas {
    by_node: BTreeMap<u32, Replica>,
}

impl Replicas {
    /// Keeps `replica` for `node` unless what is held for it is newer.
    pub fn keep(&mut self, node: u32, replica: Replica) -> bool {
        if self
            .by_node
            .get(&node)
            .is_some_and(|held| held.step > replica.step && held.attempt >= replica.attempt)
        {
            return false;
        }
        self.by_node.insert(node, replica);
        true
    }

    pub fn bytes(&self) -> u64 {
        self.by_node.values().map(Replica::bytes).sum()
    }

    /// `(node, step)` for everything held, for the attempt's agreement.
    pub fn offers(&self, world_size: u32) -> Vec<(u32, u64)> {
        self.by_node
            .iter()
            .filter(|(_, r)| r.world_size == world_size)
            .map(|(node, r)| (*node, r.step))
            .collect()
    }

    pub fn get(&self, node: u32, step: u64) -> Option<&Replica> {
        self.by_node.get(&node).filter(|r| r.step == step)
    }

    /// The gang agreed on `agreed` (or nothing): a replica of any other step is of a timeline
    /// that did not survive, or older than the restart point.
    pub fn settle(&mut self, agreed: Option<u64>) {
        self.by_node.retain(|_, r| Some(r.step) == agreed);
    }
}

/// A sealed memory file holding the next `bytes` bytes of `from`.
pub fn memory_from(from: &mut impl Read, bytes: u64, name: &str) -> std::io::Result<OwnedFd> {
    let memory = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .map_err(std::io::Error::from)?;
    let mut file = std::fs::File::from(memory.try_clone()?);
    let copied = std::io::copy(&mut from.take(bytes), &mut file)?;
    if copied != bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the connection ended after {copied} of {bytes} bytes"),
        ));
    }
    file.flush()?;
    let seals = SealFlag::F_SEAL_SHRINK
        | SealFlag::F_SEAL_GROW
        | SealFlag::F_SEAL_WRITE
        | SealFlag::F_SEAL_SEAL;
    nix::fcntl::fcntl(memory.as_fd(), FcntlArg::F_ADD_SEALS(seals))
        .map_err(std::io::Error::from)?;
    Ok(memory)
}

/// Writes the first `bytes` bytes of `memory` to `to`, reading at explicit offsets (the
/// descriptor's own offset is shared with every copy of it, the rank's restore included).
pub fn copy_memory(memory: &OwnedFd, bytes: u64, to: &mut impl Write) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::from(memory.try_clone()?);
    let mut buffer = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < bytes {
        let want = usize::try_from((bytes - at).min(buffer.len() as u64)).unwrap_or(buffer.len());
        let got = file.read_at(&mut buffer[..want], at)?;
        if got == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("the memory file ended at {at} of {bytes} bytes"),
            ));
        }
        to.write_all(&buffer[..got])?;
        at += got as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(step: u64, attempt: u32) -> Replica {
        let memory = memory_from(&mut &b"abc"[..], 3, "test").expect("a memfd");
        Replica {
            step,
            attempt,
            world_size: 2,
            first_rank: 1,
            parts: BTreeMap::from([(1, (memory, 3))]),
        }
    }

    #[test]
    fn the_newest_step_is_kept_and_settling_drops_the_rest() {
        let mut replicas = Replicas::default();
        assert!(replicas.keep(1, replica(10, 0)));
        assert!(!replicas.keep(1, replica(5, 0)));
        assert!(replicas.keep(1, replica(15, 0)));
        // A later attempt re-trained the same steps: its copy replaces the dead timeline's.
        assert!(replicas.keep(1, replica(10, 1)));
        assert_eq!(replicas.offers(2), vec![(1, 10)]);
        assert!(replicas.offers(4).is_empty());
        assert!(replicas.get(1, 10).is_some() && replicas.get(1, 15).is_none());
        replicas.settle(Some(5));
        assert_eq!(replicas.bytes(), 0);
    }

    #[test]
    fn a_memory_file_round_trips_sealed_and_a_short_stream_is_an_error() {
        let memory = memory_from(&mut &b"hello world"[..], 11, "test").unwrap();
        let mut out = Vec::new();
        copy_memory(&memory, 11, &mut out).unwrap();
        assert_eq!(out, b"hello world");
        let file = std::fs::File::from(memory.try_clone().unwrap());
        assert!(
            std::io::Write::write_all(&mut &file, b"x").is_err(),
            "sealed against writes"
        );
        assert!(memory_from(&mut &b"short"[..], 11, "test").is_err());
    }
}
