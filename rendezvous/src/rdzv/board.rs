//! The gang's failure board: each node posts its round's first worker failure the moment it sees
//! it, and every node reads the board back to name the **gang's** first failure, not its own.
//!
//! Order is the store host's receive order: a post takes a ticket with `ADD g<G>/failures 1` and
//! writes its record under `g<G>/failure/<ticket>`. The nodes' clocks are never compared to
//! order failures (pods on different machines can be seconds apart); the records carry each
//! node's wall-clock time only to print how long after the first failure another followed.
//! The records are opaque bytes here: the agent decides what a failure says.

use super::keys::Keys;
use super::kv::{Kv, KvError};

/// At most this many records are read back: the first failures of a round are what explain
/// it, and a gang of thousands of nodes failing together must not make every node read them all.
pub const READ_AT_MOST: u64 = 32;

/// One round's board.
#[derive(Debug, Clone)]
pub struct Board {
    keys: Keys,
    gen: u64,
}

impl Board {
    pub fn new(keys: Keys, gen: u64) -> Self {
        Self { keys, gen }
    }

    /// Posts `record`; returns its ticket (1 is the first failure the store host received).
    pub async fn post<K: Kv>(&self, kv: &mut K, record: &[u8]) -> Result<u64, KvError> {
        let ticket = kv.add(&self.keys.failures(self.gen), 1).await?;
        let ticket = u64::try_from(ticket).unwrap_or(0);
        kv.set(&self.keys.failure(self.gen, ticket), record).await?;
        Ok(ticket)
    }

    /// The records posted so far, by ticket, at most [`READ_AT_MOST`]. A ticket taken whose
    /// record is not written yet is left out (its node is still writing it).
    pub async fn read<K: Kv>(&self, kv: &mut K) -> Result<Vec<(u64, Vec<u8>)>, KvError> {
        let count = kv.add(&self.keys.failures(self.gen), 0).await?;
        let count = u64::try_from(count).unwrap_or(0).min(READ_AT_MOST);
        if count == 0 {
            return Ok(Vec::new());
        }
        let keys: Vec<Vec<u8>> = (1..=count)
            .map(|ticket| self.keys.failure(self.gen, ticket))
            .collect();
        let values = kv.multi_get(&keys).await?;
        Ok((1..=count)
            .zip(values)
            .filter(|(_, v)| !v.is_empty())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::super::kv::mem::MemKv;
    use super::*;

    #[tokio::test]
    async fn records_come_back_in_the_order_the_store_received_them() {
        let store = MemKv::default();
        let board = Board::new(Keys::new("job"), 3);
        let (mut a, mut b) = (store.connect(), store.connect());
        assert!(board.read(&mut a).await.unwrap().is_empty());
        assert_eq!(board.post(&mut b, b"node 1").await.unwrap(), 1);
        assert_eq!(board.post(&mut a, b"node 0").await.unwrap(), 2);
        let read = board.read(&mut a).await.unwrap();
        assert_eq!(read, vec![(1, b"node 1".to_vec()), (2, b"node 0".to_vec())]);
        // Another round's board is another set of keys.
        let next = Board::new(Keys::new("job"), 4);
        assert!(next.read(&mut a).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_ticket_without_its_record_yet_is_left_out_and_reads_are_bounded() {
        let store = MemKv::default();
        let keys = Keys::new("job");
        let board = Board::new(keys.clone(), 0);
        let mut kv = store.connect();
        // A node took ticket 1 and has not written its record yet.
        kv.add(&keys.failures(0), 1).await.unwrap();
        board.post(&mut kv, b"second").await.unwrap();
        assert_eq!(
            board.read(&mut kv).await.unwrap(),
            vec![(2, b"second".to_vec())]
        );
        for i in 0..READ_AT_MOST + 5 {
            board
                .post(&mut kv, format!("{i}").as_bytes())
                .await
                .unwrap();
        }
        let read = board.read(&mut kv).await.unwrap();
        assert_eq!(read.last().map(|(t, _)| *t), Some(READ_AT_MOST));
    }
}
