//! The replica connection's frames (agent ↔ agent over TCP, little-endian): a fixed request
//! header, then for a `put` each part as its rank, its length and its bytes; the answer is a
//! status byte, then for a found `get` the parts the same way, for a refusal a short reason.
//! Decoding checks every count and length against the limits before anything is allocated.

use std::io::{self, Read, Write};

const MAGIC: &[u8; 8] = b"MUSTREP1";
/// The header's size on the wire.
pub const HEADER_LEN: usize = 8 + 16 + 1 + 4 * 5 + 8;
/// More parts than this is no node's share of a gang.
pub const MAX_PARTS: u32 = 4096;
const MAX_REASON: usize = 512;

/// The caller's proof that it read the job's store: the listener's token published there.
pub type Token = [u8; 16];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The caller hands over its node's parts of `step` (its buddy keeps them).
    Put,
    /// The caller asks for `node`'s parts of `step` (a replacement fetching its own).
    Get,
}

/// A request's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub token: Token,
    pub op: Op,
    /// Whose parts: the sender's node rank (put) or the one asked for (get).
    pub node: u32,
    /// The gang's attempt the caller is in.
    pub attempt: u32,
    pub step: u64,
    pub world_size: u32,
    pub first_rank: u32,
    /// The parts that follow (put); 0 for a get.
    pub parts: u32,
}

/// A frame that is not the protocol's.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("not a muster replica connection (bad magic)")]
    Magic,
    #[error("unknown operation {0}")]
    Op(u8),
    #[error("{0} parts is more than a node holds (at most {MAX_PARTS})")]
    TooManyParts(u32),
    #[error("a part of {bytes} bytes is over the limit of {limit} bytes")]
    TooLarge { bytes: u64, limit: u64 },
    #[error("unknown answer {0}")]
    Status(u8),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(MAGIC);
        put(&self.token);
        put(&[match self.op {
            Op::Put => 1,
            Op::Get => 2,
        }]);
        put(&self.node.to_le_bytes());
        put(&self.attempt.to_le_bytes());
        put(&self.step.to_le_bytes());
        put(&self.world_size.to_le_bytes());
        put(&self.first_rank.to_le_bytes());
        put(&self.parts.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
        if &bytes[..8] != MAGIC {
            return Err(WireError::Magic);
        }
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let mut token = [0u8; 16];
        token.copy_from_slice(&bytes[8..24]);
        let op = match bytes[24] {
            1 => Op::Put,
            2 => Op::Get,
            other => return Err(WireError::Op(other)),
        };
        let mut step = [0u8; 8];
        step.copy_from_slice(&bytes[33..41]);
        let header = Header {
            token,
            op,
            node: u32_at(25),
            attempt: u32_at(29),
            step: u64::from_le_bytes(step),
            world_size: u32_at(41),
            first_rank: u32_at(45),
            parts: u32_at(49),
        };
        if header.parts > MAX_PARTS {
            return Err(WireError::TooManyParts(header.parts));
        }
        Ok(header)
    }

    pub fn read(from: &mut impl Read) -> Result<Header, WireError> {
        let mut bytes = [0u8; HEADER_LEN];
        from.read_exact(&mut bytes)?;
        Header::decode(&bytes)
    }
}

/// One part's frame head: its rank and how many bytes follow.
pub fn write_part_head(to: &mut impl Write, rank: u32, bytes: u64) -> io::Result<()> {
    to.write_all(&rank.to_le_bytes())?;
    to.write_all(&bytes.to_le_bytes())
}

/// Reads a part's head; refuses a length over `limit` before anything is allocated.
pub fn read_part_head(from: &mut impl Read, limit: u64) -> Result<(u32, u64), WireError> {
    let mut rank = [0u8; 4];
    let mut bytes = [0u8; 8];
    from.read_exact(&mut rank)?;
    from.read_exact(&mut bytes)?;
    let bytes = u64::from_le_bytes(bytes);
    if bytes > limit {
        return Err(WireError::TooLarge { bytes, limit });
    }
    Ok((u32::from_le_bytes(rank), bytes))
}

/// An answer's first frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Put: held. Get: this many parts follow.
    Ok { parts: u32 },
    /// Not taken, or not held: why.
    No(String),
}

impl Answer {
    pub fn write(&self, to: &mut impl Write) -> io::Result<()> {
        match self {
            Answer::Ok { parts } => {
                to.write_all(&[0])?;
                to.write_all(&parts.to_le_bytes())
            }
            Answer::No(why) => {
                let why = &why.as_bytes()[..why.len().min(MAX_REASON)];
                to.write_all(&[1])?;
                to.write_all(&(why.len() as u32).to_le_bytes())?;
                to.write_all(why)
            }
        }
    }

    pub fn read(from: &mut impl Read) -> Result<Answer, WireError> {
        let mut status = [0u8; 1];
        let mut count = [0u8; 4];
        from.read_exact(&mut status)?;
        from.read_exact(&mut count)?;
        let count = u32::from_le_bytes(count);
        match status[0] {
            0 if count > MAX_PARTS => Err(WireError::TooManyParts(count)),
            0 => Ok(Answer::Ok { parts: count }),
            1 => {
                let len = (count as usize).min(MAX_REASON);
                let mut why = vec![0u8; len];
                from.read_exact(&mut why)?;
                Ok(Answer::No(String::from_utf8_lossy(&why).into_owned()))
            }
            other => Err(WireError::Status(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            token: [7; 16],
            op: Op::Put,
            node: 3,
            attempt: 2,
            step: 40,
            world_size: 8,
            first_rank: 6,
            parts: 2,
        }
    }

    #[test]
    fn a_header_round_trips_and_a_bad_one_says_why() {
        let encoded = header().encode();
        assert_eq!(Header::decode(&encoded).unwrap(), header());
        let mut bad = encoded;
        bad[0] = b'X';
        assert!(matches!(Header::decode(&bad), Err(WireError::Magic)));
        let mut bad = encoded;
        bad[24] = 9;
        assert!(matches!(Header::decode(&bad), Err(WireError::Op(9))));
        let many = Header {
            parts: MAX_PARTS + 1,
            ..header()
        };
        assert!(matches!(
            Header::decode(&many.encode()),
            Err(WireError::TooManyParts(_))
        ));
        // A header cut short is an I/O error, never a panic.
        assert!(matches!(
            Header::read(&mut &encoded[..10]),
            Err(WireError::Io(_))
        ));
    }

    #[test]
    fn an_oversized_part_is_refused_before_it_is_read() {
        let mut frame = Vec::new();
        write_part_head(&mut frame, 6, u64::MAX).unwrap();
        assert!(matches!(
            read_part_head(&mut frame.as_slice(), 1 << 20),
            Err(WireError::TooLarge { .. })
        ));
        let mut frame = Vec::new();
        write_part_head(&mut frame, 6, 10).unwrap();
        assert_eq!(read_part_head(&mut frame.as_slice(), 10).unwrap(), (6, 10));
    }

    #[test]
    fn answers_round_trip_and_a_long_reason_is_cut() {
        for answer in [Answer::Ok { parts: 2 }, Answer::No("not held".to_owned())] {
            let mut frame = Vec::new();
            answer.write(&mut frame).unwrap();
            assert_eq!(Answer::read(&mut frame.as_slice()).unwrap(), answer);
        }
        let mut frame = Vec::new();
        Answer::No("x".repeat(10_000)).write(&mut frame).unwrap();
        match Answer::read(&mut frame.as_slice()).unwrap() {
            Answer::No(why) => assert_eq!(why.len(), MAX_REASON),
            other @ Answer::Ok { .. } => panic!("{other:?}"),
        }
        assert!(matches!(
            Answer::read(&mut [5u8, 0, 0, 0, 0].as_slice()),
            Err(WireError::Status(5))
        ));
    }
}
