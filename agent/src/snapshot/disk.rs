//! The files of `--snapshot-persist DIR` ([`super::persist`]), apart from the service: one
//! rank's part of one step per file, written whole or not at all, read back checked.
//!
//! Layout: `DIR/step-<step>/rank-<global rank>.part`, one file per rank, each written by the
//! agent that runs the rank. Nodes may share `DIR` (a ReadWriteMany volume) or each have their
//! own (a node-local disk); a node only ever writes, reads and removes its own ranks' files, so
//! both work. A file is written under a temporary name, synced and renamed, so a file under its
//! final name is whole: a crash mid-write leaves a temporary file, never a torn part.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use super::holder::Share;
use super::replica::{copy_memory, memory_from};

/// What a part file starts with, then its header's four little-endian u64s.
const MAGIC: &[u8; 8] = b"MUSTERS1";
const HEADER_BYTES: u64 = 8 + 4 * 8;
/// How many whole steps of its ranks a node keeps.
const KEEP_STEPS: usize = 2;

/// Why a part could not be written or read back.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a part of step {step} for rank {rank} of a world of {world_size}")]
    Mismatch {
        path: PathBuf,
        step: u64,
        rank: u32,
        world_size: u32,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PersistError + '_ {
    move |source| PersistError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One part file's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    step: u64,
    world_size: u32,
    rank: u32,
    bytes: u64,
}

impl Header {
    fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        for value in [
            self.step,
            u64::from(self.world_size),
            u64::from(self.rank),
            self.bytes,
        ] {
            out.extend_from_slice(&value.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8; HEADER_BYTES as usize]) -> Option<Header> {
        if &bytes[..8] != MAGIC {
            return None;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[8 + 8 * i..16 + 8 * i]);
            u64::from_le_bytes(w)
        };
        Some(Header {
            step: word(0),
            world_size: u32::try_from(word(1)).ok()?,
            rank: u32::try_from(word(2)).ok()?,
            bytes: word(3),
        })
    }
}

/// The snapshot directory of a job (`--snapshot-persist`).
#[derive(Debug, Clone)]
pub struct Disk {
    dir: PathBuf,
    /// `--snapshot-persist-every`: the committed steps written are its multiples.
    every: u64,
}

impl Disk {
    /// Creates `dir` if it is missing; an error when it cannot be, or is not a directory. The
    /// committed steps written are the multiples of `every`.
    pub fn open(dir: &Path, every: u64) -> Result<Disk, PersistError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let probe = dir.join(format!(".muster-probe-{}", std::process::id()));
        File::create(&probe).map_err(io(dir))?;
        let _ = fs::remove_file(&probe);
        Ok(Disk {
            dir: dir.to_owned(),
            every: every.max(1),
        })
    }

    /// Whether committed `step` is one to write. By its number, the same on every node, so
    /// that the nodes write the same steps.
    pub fn due(&self, step: u64) -> bool {
        step % self.every == 0
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn step_dir(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step}"))
    }

    fn part_path(&self, step: u64, rank: u32) -> PathBuf {
        self.step_dir(step).join(format!("rank-{rank}.part"))
    }

    /// Writes this node's `parts` of `step` (a committed step); returns the bytes written.
    /// Older steps of these ranks go once it is whole, but for the step before.
    pub fn write(
        &self,
        step: u64,
        share: Share,
        parts: &[(u32, OwnedFd, u64)],
    ) -> Result<u64, PersistError> {
        let dir = self.step_dir(step);
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let mut written = 0;
        for (rank, memory, bytes) in parts {
            let header = Header {
                step,
                world_size: share.world_size,
                rank: *rank,
                bytes: *bytes,
            };
            let path = self.part_path(step, *rank);
            let temporary = dir.join(format!(".rank-{rank}.part.tmp-{}", std::process::id()));
            let mut file = File::create(&temporary).map_err(io(&temporary))?;
            let wrote = file
                .write_all(&header.encode())
                .and_then(|()| send_memory(memory, *bytes, &mut file))
                .and_then(|()| file.sync_all());
            if let Err(source) = wrote {
                let _ = fs::remove_file(&temporary);
                return Err(PersistError::Io {
                    path: temporary,
                    source,
                });
            }
            fs::rename(&temporary, &path).map_err(io(&path))?;
            written += bytes;
        }
        // The renames are durable once the directory is.
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))?;
        self.prune(share);
        Ok(written)
    }

    /// The steps whose files of every rank of `share` are whole, oldest first.
    pub fn complete_steps(&self, share: Share) -> Vec<u64> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut steps: Vec<u64> = entries
            .filter_map(Result::ok)
            .filter_map(|e| step_of(&e))
            .filter(|step| {
                share
                    .ranks()
                    .all(|rank| self.header_of(*step, rank, share.world_size).is_ok())
            })
            .collect();
        steps.sort_unstable();
        steps
    }

    /// The header of `rank`'s file of `step`, checked against what it must say and its length.
    fn header_of(&self, step: u64, rank: u32, world_size: u32) -> Result<Header, PersistError> {
        let path = self.part_path(step, rank);
        let mismatch = || PersistError::Mismatch {
            path: path.clone(),
            step,
            rank,
            world_size,
        };
        let mut file = File::open(&path).map_err(io(&path))?;
        let length = file.metadata().map_err(io(&path))?.len();
        let mut bytes = [0u8; HEADER_BYTES as usize];
        file.read_exact(&mut bytes).map_err(io(&path))?;
        let header = Header::decode(&bytes).ok_or_else(mismatch)?;
        let expected = Header {
            step,
            world_size,
            rank,
            bytes: header.bytes,
        };
        if header != expected || HEADER_BYTES.checked_add(header.bytes) != Some(length) {
            return Err(mismatch());
        }
        Ok(header)
    }

    /// Reads this node's parts of `step` back into sealed memory files.
    pub fn load(&self, step: u64, share: Share) -> Result<Vec<(u32, OwnedFd, u64)>, PersistError> {
        share
            .ranks()
            .map(|rank| {
                let header = self.header_of(step, rank, share.world_size)?;
                let path = self.part_path(step, rank);
                let mut file = File::open(&path).map_err(io(&path))?;
                let mut skip = [0u8; HEADER_BYTES as usize];
                file.read_exact(&mut skip).map_err(io(&path))?;
                let memory =
                    memory_from(&mut file, header.bytes, "muster-snapshot").map_err(io(&path))?;
                Ok((rank, memory, header.bytes))
            })
            .collect()
    }

    /// The bytes this node's parts of `step` hold (for the memory cap, before a load).
    pub fn bytes_of(&self, step: u64, share: Share) -> Option<u64> {
        share
            .ranks()
            .map(|rank| {
                self.header_of(step, rank, share.world_size)
                    .ok()
                    .map(|h| h.bytes)
            })
            .sum()
    }

    /// Removes this node's files of every step after `agreed` (all of them without one).
    pub fn forget_after(&self, share: Share, agreed: Option<u64>) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let Some(step) = step_of(&entry) else {
                continue;
            };
            if agreed.is_some_and(|a| step <= a) {
                continue;
            }
            for rank in share.ranks() {
                let _ = fs::remove_file(self.part_path(step, rank));
            }
            let _ = fs::remove_dir(entry.path());
        }
    }

    /// Removes this node's files of every step but the [`KEEP_STEPS`] newest whole ones, and
    /// temporary files a killed agent left; a step directory goes once nobody's file is in it.
    fn prune(&self, share: Share) {
        let complete = self.complete_steps(share);
        let keep: Vec<u64> = complete.iter().rev().take(KEEP_STEPS).copied().collect();
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let Some(step) = step_of(&entry) else {
                continue;
            };
            let dir = entry.path();
            for rank in share.ranks() {
                if !keep.contains(&step) {
                    let _ = fs::remove_file(self.part_path(step, rank));
                }
                remove_temporaries(&dir, rank);
            }
            // Fails while another node's files are still in it, which is what it should do.
            let _ = fs::remove_dir(&dir);
        }
    }
}

/// Appends the first `bytes` bytes of `memory` to `file` in the kernel (`sendfile`: one copy,
/// from the memory file's pages to the file's, none through the agent), reading at explicit
/// offsets (the descriptor's own offset is shared with every copy of it); through a buffer where
/// the file system does not take it.
fn send_memory(memory: &OwnedFd, bytes: u64, file: &mut File) -> std::io::Result<()> {
    let mut at: i64 = 0;
    let end = i64::try_from(bytes).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    while at < end {
        let count = usize::try_from((end - at).min(1 << 30)).unwrap_or(1 << 30);
        match nix::sys::sendfile::sendfile64(&*file, memory, Some(&mut at), count) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the memory file ended at {at} of {bytes} bytes"),
                ))
            }
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOSYS) if at == 0 => {
                return copy_memory(memory, bytes, file);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The step a `step-<n>` directory entry is of.
fn step_of(entry: &fs::DirEntry) -> Option<u64> {
    entry
        .file_name()
        .to_str()?
        .strip_prefix("step-")?
        .parse()
        .ok()
}

/// Temporary files of `rank` in `dir` (only this agent writes its ranks' files, so any left is
/// a killed writer's).
fn remove_temporaries(dir: &Path, rank: u32) {
    let prefix = format!(".rank-{rank}.part.tmp-");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix))
        {
            let _ = fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of its own per test, removed at the end.
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(name: &str) -> TestDir {
            let path =
                std::env::temp_dir().join(format!("muster-persist-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            TestDir(path)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn share(first_rank: u32) -> Share {
        Share {
            attempt: 0,
            first_rank,
            local_ranks: 2,
            world_size: 4,
        }
    }

    fn parts(first_rank: u32, text: &str) -> Vec<(u32, OwnedFd, u64)> {
        (first_rank..first_rank + 2)
            .map(|rank| {
                let body = format!("{text} of rank {rank}");
                let memory = memory_from(&mut body.as_bytes(), body.len() as u64, "test").unwrap();
                (rank, memory, body.len() as u64)
            })
            .collect()
    }

    fn read(parts: &[(u32, OwnedFd, u64)]) -> Vec<String> {
        parts
            .iter()
            .map(|(_, memory, bytes)| {
                let mut out = Vec::new();
                copy_memory(memory, *bytes, &mut out).unwrap();
                String::from_utf8(out).unwrap()
            })
            .collect()
    }

    #[test]
    fn a_written_step_reads_back_and_only_two_steps_stay() {
        let dir = TestDir::new("two-stay");
        let disk = Disk::open(&dir.path().join("snapshots"), 5).unwrap();
        for step in [5, 10, 15] {
            disk.write(step, share(2), &parts(2, &format!("step {step}")))
                .unwrap();
        }
        assert_eq!(disk.complete_steps(share(2)), vec![10, 15]);
        assert!(!dir.path().join("snapshots/step-5").exists());
        let loaded = disk.load(15, share(2)).unwrap();
        assert_eq!(read(&loaded), ["step 15 of rank 2", "step 15 of rank 3"]);
        assert_eq!(disk.bytes_of(15, share(2)), Some(34));
        assert!(disk.due(15) && !disk.due(12));
        // Another node's ranks, another world size: nothing of theirs here.
        assert!(disk.complete_steps(share(0)).is_empty());
        let other_world = Share {
            world_size: 2,
            ..share(2)
        };
        assert!(disk.complete_steps(other_world).is_empty());
    }

    #[test]
    fn nodes_sharing_a_directory_keep_each_others_files() {
        let dir = TestDir::new("shared");
        let disk = Disk::open(dir.path(), 5).unwrap();
        disk.write(5, share(0), &parts(0, "a")).unwrap();
        for step in [5, 10, 15] {
            disk.write(step, share(2), &parts(2, "b")).unwrap();
        }
        // Node 1 pruned its own files of step 5, not node 0's.
        assert_eq!(disk.complete_steps(share(0)), vec![5]);
        assert_eq!(disk.complete_steps(share(2)), vec![10, 15]);
    }

    #[test]
    fn a_dead_timeline_goes_and_other_nodes_files_stay() {
        let dir = TestDir::new("dead");
        let disk = Disk::open(dir.path(), 5).unwrap();
        disk.write(10, share(0), &parts(0, "other node")).unwrap();
        for step in [5, 10] {
            disk.write(step, share(2), &parts(2, "b")).unwrap();
        }
        disk.forget_after(share(2), Some(5));
        assert_eq!(disk.complete_steps(share(2)), vec![5]);
        disk.forget_after(share(2), None);
        assert!(disk.complete_steps(share(2)).is_empty());
        assert_eq!(disk.complete_steps(share(0)), vec![10]);
    }

    #[test]
    fn a_torn_or_foreign_file_is_no_step() {
        let dir = TestDir::new("torn");
        let disk = Disk::open(dir.path(), 5).unwrap();
        disk.write(5, share(0), &parts(0, "whole")).unwrap();
        disk.write(10, share(0), &parts(0, "torn")).unwrap();
        let torn = disk.part_path(10, 1);
        let length = fs::metadata(&torn).unwrap().len();
        File::options()
            .write(true)
            .open(&torn)
            .unwrap()
            .set_len(length - 1)
            .unwrap();
        assert_eq!(disk.complete_steps(share(0)), vec![5]);
        assert!(disk.load(10, share(0)).is_err());
        // A file renamed to another step's name says its own step.
        fs::create_dir_all(disk.step_dir(20)).unwrap();
        fs::copy(disk.part_path(5, 0), disk.part_path(20, 0)).unwrap();
        fs::copy(disk.part_path(5, 1), disk.part_path(20, 1)).unwrap();
        assert_eq!(disk.complete_steps(share(0)), vec![5]);
        fs::write(dir.path().join("step-x"), b"not a step").unwrap();
        assert_eq!(disk.complete_steps(share(0)), vec![5]);
    }
}
