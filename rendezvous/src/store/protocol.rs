//! The c10d TCPStore wire format of torch 2.15, as a pure codec.
//!
//! A request is one command byte followed by fields whose layout depends on the command; there is
//! no outer length prefix and no request id. Integers travel in host byte order, which is
//! little-endian on every platform torch ships for; we write it explicitly. Strings and values are
//! `u64 length` + raw bytes. Responses have no header at all: the client knows what to read
//! because it has exactly one request outstanding (plus the WAIT/CANCEL_WAIT pair).
//!
//! [`Request::decode`] parses from a byte buffer: a partial message is `Ok(None)` ("need more
//! bytes"), never an error, so a value split over many TCP segments and several requests pipelined
//! in one segment both work. Lengths are checked against the libuv backend's limits *before*
//! anything is allocated for them, so an oversized or hostile length costs nothing but the
//! connection.
//!
//! Mirrors `QueryType` in `torch/csrc/distributed/c10d/store/TCPStoreBackend.hpp` (torch 2.15).

use std::ops::Range;

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The magic number a client sends with VALIDATE (`validationMagicNumber` in TCPStore.cpp).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// Longest key accepted. libuv: `MAX_STRING_LEN` in TCPStoreLibUvBackend.cpp (8 KiB).
pub const MAX_KEY_LEN: u64 = 8 * 1024;

/// Longest value accepted. libuv: `MAX_PAYLOAD_LEN` (8 MiB).
pub const MAX_VALUE_LEN: u64 = 8 * 1024 * 1024;

/// Most keys in one CHECK / WAIT / MULTI_GET / MULTI_SET. libuv: `MAX_KEY_COUNT` (128 Ki).
pub const MAX_KEY_COUNT: u64 = 128 * 1024;

/// Command codes, one-for-one with upstream `QueryType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Command {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
    QueuePush = 14,
    QueuePop = 15,
    QueueLen = 16,
    ListKeys = 17,
    Barrier = 18,
}

impl Command {
    /// Every command, indexed by its code.
    pub const ALL: [Command; 19] = [
        Command::Validate,
        Command::Set,
        Command::CompareSet,
        Command::Get,
        Command::Add,
        Command::Check,
        Command::Wait,
        Command::GetNumKeys,
        Command::DeleteKey,
        Command::Append,
        Command::MultiGet,
        Command::MultiSet,
        Command::CancelWait,
        Command::Ping,
        Command::QueuePush,
        Command::QueuePop,
        Command::QueueLen,
        Command::ListKeys,
        Command::Barrier,
    ];

    pub fn from_code(code: u8) -> Option<Command> {
        Command::ALL.get(usize::from(code)).copied()
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    /// Upstream's name, for logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Command::Validate => "VALIDATE",
            Command::Set => "SET",
            Command::CompareSet => "COMPARE_SET",
            Command::Get => "GET",
            Command::Add => "ADD",
            Command::Check => "CHECK",
            Command::Wait => "WAIT",
            Command::GetNumKeys => "GETNUMKEYS",
            Command::DeleteKey => "DELETE_KEY",
            Command::Append => "APPEND",
            Command::MultiGet => "MULTI_GET",
            Command::MultiSet => "MULTI_SET",
            Command::CancelWait => "CANCEL_WAIT",
            Command::Ping => "PING",
            Command::QueuePush => "QUEUE_PUSH",
            Command::QueuePop => "QUEUE_POP",
            Command::QueueLen => "QUEUE_LEN",
            Command::ListKeys => "LIST_KEYS",
            Command::Barrier => "BARRIER",
        }
    }
}

/// Reply codes of CHECK, WAIT and CANCEL_WAIT (`CheckResponseType`, `WaitResponseType`).
pub mod reply {
    /// CHECK: every key exists. Note the inversion: 0 means yes.
    pub const READY: u8 = 0;
    /// CHECK: at least one key is missing.
    pub const NOT_READY: u8 = 1;
    /// WAIT and BARRIER: released.
    pub const STOP_WAITING: u8 = 0;
    /// CANCEL_WAIT: the wait (if any) is gone; always sent.
    pub const WAIT_CANCELED: u8 = 1;
}

/// One decoded request. Keys and values are slices of the frozen receive buffer: no copy is made
/// while parsing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Validate {
        magic: u32,
    },
    Set {
        key: Bytes,
        value: Bytes,
    },
    CompareSet {
        key: Bytes,
        expected: Bytes,
        desired: Bytes,
    },
    Get {
        key: Bytes,
    },
    Add {
        key: Bytes,
        delta: i64,
    },
    Check {
        keys: Vec<Bytes>,
    },
    Wait {
        keys: Vec<Bytes>,
    },
    GetNumKeys,
    DeleteKey {
        key: Bytes,
    },
    Append {
        key: Bytes,
        value: Bytes,
    },
    MultiGet {
        keys: Vec<Bytes>,
    },
    MultiSet {
        pairs: Vec<(Bytes, Bytes)>,
    },
    CancelWait,
    Ping {
        nonce: u32,
    },
    QueuePush {
        key: Bytes,
        value: Bytes,
    },
    QueuePop {
        key: Bytes,
    },
    QueueLen {
        key: Bytes,
    },
    ListKeys,
    Barrier {
        key: Bytes,
        world_size: i64,
    },
}

/// Why a byte stream is not a valid request. Every variant closes the connection; none of them is
/// "incomplete", which is `Ok(None)`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("unknown command byte {0:#04x}")]
    UnknownCommand(u8),
    #[error("key of {len} bytes exceeds the {max}-byte limit")]
    KeyTooLong { len: u64, max: u64 },
    #[error("value of {len} bytes exceeds the {max}-byte limit")]
    ValueTooLong { len: u64, max: u64 },
    #[error("{count} keys in one request exceed the limit of {max}")]
    TooManyKeys { count: u64, max: u64 },
}

/// The field being read, which decides the length limit.
#[derive(Clone, Copy)]
enum Field {
    Key,
    Value,
}

/// A cursor over the unconsumed bytes. `None` from a read means "not enough bytes yet".
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// `Ok(None)` short-circuit for the cursor's "need more bytes".
macro_rules! need {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let slice = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(slice)
    }

    fn u32(&mut self) -> Option<u32> {
        let b = self.take(4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Option<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Some(u64::from_le_bytes(a))
    }

    fn i64(&mut self) -> Option<i64> {
        self.u64().map(|v| v as i64)
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// A length-prefixed byte string, checked against its limit before the body is awaited.
    fn bytes(&mut self, field: Field) -> Result<Option<Range<usize>>, DecodeError> {
        let len = need!(self.u64());
        let max = match field {
            Field::Key => MAX_KEY_LEN,
            Field::Value => MAX_VALUE_LEN,
        };
        if len > max {
            return Err(match field {
                Field::Key => DecodeError::KeyTooLong { len, max },
                Field::Value => DecodeError::ValueTooLong { len, max },
            });
        }
        let len = len as usize;
        if self.remaining() < len {
            return Ok(None);
        }
        let start = self.pos;
        self.pos += len;
        Ok(Some(start..self.pos))
    }

    /// A key count, checked against [`MAX_KEY_COUNT`]; and when the buffer cannot even hold the
    /// length prefixes of that many keys, "need more bytes" comes before any allocation.
    fn count(&mut self, bytes_per_item: usize) -> Result<Option<usize>, DecodeError> {
        let count = need!(self.u64());
        if count > MAX_KEY_COUNT {
            return Err(DecodeError::TooManyKeys {
                count,
                max: MAX_KEY_COUNT,
            });
        }
        let count = count as usize;
        if self.remaining() < count * bytes_per_item {
            return Ok(None);
        }
        Ok(Some(count))
    }

    fn keys(&mut self) -> Result<Option<Vec<Range<usize>>>, DecodeError> {
        let count = need!(self.count(8)?);
        let mut keys = Vec::with_capacity(count);
        for _ in 0..count {
            keys.push(need!(self.bytes(Field::Key)?));
        }
        Ok(Some(keys))
    }
}

/// A request as ranges into the buffer, before the buffer is split off and frozen.
enum Parsed {
    Validate(u32),
    One(Command, Range<usize>),
    Two(Command, Range<usize>, Range<usize>),
    CompareSet(Range<usize>, Range<usize>, Range<usize>),
    KeyAndInt(Command, Range<usize>, i64),
    Keys(Command, Vec<Range<usize>>),
    Pairs(Vec<(Range<usize>, Range<usize>)>),
    Bare(Command),
    Ping(u32),
}

impl Request {
    /// Decodes one request from the front of `buf`, consuming its bytes.
    ///
    /// `Ok(None)` means the buffer holds only part of a request; nothing is consumed and the
    /// caller reads more bytes and calls again.
    pub fn decode(buf: &mut BytesMut) -> Result<Option<Request>, DecodeError> {
        let Some((parsed, len)) = parse(buf)? else {
            return Ok(None);
        };
        let frame = buf.split_to(len).freeze();
        let s = |r: Range<usize>| frame.slice(r);
        let request = match parsed {
            Parsed::Validate(magic) => Request::Validate { magic },
            Parsed::Ping(nonce) => Request::Ping { nonce },
            Parsed::Bare(Command::GetNumKeys) => Request::GetNumKeys,
            Parsed::Bare(Command::CancelWait) => Request::CancelWait,
            Parsed::Bare(_) => Request::ListKeys,
            Parsed::One(cmd, k) => match cmd {
                Command::Get => Request::Get { key: s(k) },
                Command::DeleteKey => Request::DeleteKey { key: s(k) },
                Command::QueuePop => Request::QueuePop { key: s(k) },
                _ => Request::QueueLen { key: s(k) },
            },
            Parsed::Two(cmd, k, v) => match cmd {
                Command::Set => Request::Set {
                    key: s(k),
                    value: s(v),
                },
                Command::Append => Request::Append {
                    key: s(k),
                    value: s(v),
                },
                _ => Request::QueuePush {
                    key: s(k),
                    value: s(v),
                },
            },
            Parsed::CompareSet(k, e, d) => Request::CompareSet {
                key: s(k),
                expected: s(e),
                desired: s(d),
            },
            Parsed::KeyAndInt(cmd, k, n) => match cmd {
                Command::Add => Request::Add {
                    key: s(k),
                    delta: n,
                },
                _ => Request::Barrier {
                    key: s(k),
                    world_size: n,
                },
            },
            Parsed::Keys(cmd, ranges) => {
                let keys = ranges.into_iter().map(s).collect();
                match cmd {
                    Command::Check => Request::Check { keys },
                    Command::Wait => Request::Wait { keys },
                    _ => Request::MultiGet { keys },
                }
            }
            Parsed::Pairs(pairs) => Request::MultiSet {
                pairs: pairs.into_iter().map(|(k, v)| (s(k), s(v))).collect(),
            },
        };
        Ok(Some(request))
    }

    /// The command this request carries.
    pub fn command(&self) -> Command {
        match self {
            Request::Validate { .. } => Command::Validate,
            Request::Set { .. } => Command::Set,
            Request::CompareSet { .. } => Command::CompareSet,
            Request::Get { .. } => Command::Get,
            Request::Add { .. } => Command::Add,
            Request::Check { .. } => Command::Check,
            Request::Wait { .. } => Command::Wait,
            Request::GetNumKeys => Command::GetNumKeys,
            Request::DeleteKey { .. } => Command::DeleteKey,
            Request::Append { .. } => Command::Append,
            Request::MultiGet { .. } => Command::MultiGet,
            Request::MultiSet { .. } => Command::MultiSet,
            Request::CancelWait => Command::CancelWait,
            Request::Ping { .. } => Command::Ping,
            Request::QueuePush { .. } => Command::QueuePush,
            Request::QueuePop { .. } => Command::QueuePop,
            Request::QueueLen { .. } => Command::QueueLen,
            Request::ListKeys => Command::ListKeys,
            Request::Barrier { .. } => Command::Barrier,
        }
    }

    /// Encodes the request as a client sends it.
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u8(self.command().code());
        match self {
            Request::Validate { magic } => out.put_u32_le(*magic),
            Request::Ping { nonce } => out.put_u32_le(*nonce),
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_bytes(out, key),
            Request::Set { key, value }
            | Request::Append { key, value }
            | Request::QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Add { key, delta } => {
                put_bytes(out, key);
                out.put_i64_le(*delta);
            }
            Request::Barrier { key, world_size } => {
                put_bytes(out, key);
                out.put_i64_le(*world_size);
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                out.put_u64_le(keys.len() as u64);
                for key in keys {
                    put_bytes(out, key);
                }
            }
            Request::MultiSet { pairs } => {
                out.put_u64_le(pairs.len() as u64);
                for (key, value) in pairs {
                    put_bytes(out, key);
                    put_bytes(out, value);
                }
            }
        }
    }
}

/// Parses one request's layout without consuming; returns it with its length in bytes.
fn parse(buf: &[u8]) -> Result<Option<(Parsed, usize)>, DecodeError> {
    let Some(&code) = buf.first() else {
        return Ok(None);
    };
    let cmd = Command::from_code(code).ok_or(DecodeError::UnknownCommand(code))?;
    let mut c = Cursor::new(buf);
    c.pos = 1;
    let parsed = match cmd {
        Command::Validate => Parsed::Validate(need!(c.u32())),
        Command::Ping => Parsed::Ping(need!(c.u32())),
        Command::GetNumKeys | Command::CancelWait | Command::ListKeys => Parsed::Bare(cmd),
        Command::Get | Command::DeleteKey | Command::QueuePop | Command::QueueLen => {
            Parsed::One(cmd, need!(c.bytes(Field::Key)?))
        }
        Command::Set | Command::Append | Command::QueuePush => {
            let key = need!(c.bytes(Field::Key)?);
            Parsed::Two(cmd, key, need!(c.bytes(Field::Value)?))
        }
        Command::CompareSet => {
            let key = need!(c.bytes(Field::Key)?);
            let expected = need!(c.bytes(Field::Value)?);
            Parsed::CompareSet(key, expected, need!(c.bytes(Field::Value)?))
        }
        Command::Add | Command::Barrier => {
            let key = need!(c.bytes(Field::Key)?);
            Parsed::KeyAndInt(cmd, key, need!(c.i64()))
        }
        Command::Check | Command::Wait | Command::MultiGet => Parsed::Keys(cmd, need!(c.keys()?)),
        Command::MultiSet => {
            // The client writes the count as i64; the libuv server reads it as u64. A negative
            // count is therefore an enormous one, and rejected by the limit.
            let count = need!(c.count(16)?);
            let mut pairs = Vec::with_capacity(count);
            for _ in 0..count {
                let key = need!(c.bytes(Field::Key)?);
                pairs.push((key, need!(c.bytes(Field::Value)?)));
            }
            Parsed::Pairs(pairs)
        }
    };
    Ok(Some((parsed, c.pos)))
}

/// Appends a length-prefixed byte string (the wire's "string" and "vector").
pub fn put_bytes(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u64_le(bytes.len() as u64);
    out.put_slice(bytes);
}

/// Reads a length-prefixed byte string from a complete reply buffer, for clients.
pub fn get_bytes(buf: &mut impl Buf) -> Option<Vec<u8>> {
    if buf.remaining() < 8 {
        return None;
    }
    let len = usize::try_from(buf.get_u64_le()).ok()?;
    if buf.remaining() < len {
        return None;
    }
    let mut v = vec![0; len];
    buf.copy_to_slice(&mut v);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    fn roundtrip(req: &Request) {
        let mut buf = BytesMut::new();
        req.encode(&mut buf);
        let len = buf.len();
        // Every strict prefix is "need more bytes" and consumes nothing.
        for cut in 0..len {
            let mut partial = BytesMut::from(&buf[..cut]);
            assert_eq!(
                Request::decode(&mut partial),
                Ok(None),
                "{req:?} cut at {cut}"
            );
            assert_eq!(partial.len(), cut);
        }
        let decoded = Request::decode(&mut buf).unwrap().unwrap();
        assert_eq!(&decoded, req);
        assert!(buf.is_empty());
    }

    #[test]
    fn every_command_round_trips_and_partial_input_is_not_an_error() {
        let requests = [
            Request::Validate {
                magic: VALIDATION_MAGIC,
            },
            Request::Set {
                key: b("/k"),
                value: b("v1"),
            },
            Request::CompareSet {
                key: b("/k"),
                expected: b(""),
                desired: b("x"),
            },
            Request::Get { key: b("/k") },
            Request::Add {
                key: b("/cnt"),
                delta: -2,
            },
            Request::Check {
                keys: vec![b("/a"), b("/b")],
            },
            Request::Wait { keys: vec![] },
            Request::GetNumKeys,
            Request::DeleteKey { key: b("/k") },
            Request::Append {
                key: b("/k"),
                value: b("tail"),
            },
            Request::MultiGet {
                keys: vec![b("/a")],
            },
            Request::MultiSet {
                pairs: vec![(b("/a"), b("1")), (b("/b"), b(""))],
            },
            Request::CancelWait,
            Request::Ping { nonce: 7101 },
            Request::QueuePush {
                key: b("/q"),
                value: b("e"),
            },
            Request::QueuePop { key: b("/q") },
            Request::QueueLen { key: b("/q") },
            Request::ListKeys,
            Request::Barrier {
                key: b("/bar"),
                world_size: 2,
            },
        ];
        for req in &requests {
            roundtrip(req);
        }
    }

    #[test]
    fn the_captured_handshake_decodes_as_validate_then_ping() {
        // Bytes of a real torch 2.15 client's first segment (nonce = its pid 7101).
        let mut buf = BytesMut::from(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 0xbd, 0x1b, 0, 0][..]);
        assert_eq!(
            Request::decode(&mut buf),
            Ok(Some(Request::Validate {
                magic: VALIDATION_MAGIC
            }))
        );
        assert_eq!(
            Request::decode(&mut buf),
            Ok(Some(Request::Ping { nonce: 7101 }))
        );
        assert_eq!(Request::decode(&mut buf), Ok(None));
        // BARRIER, the last code of torch 2.15
        assert_eq!(Command::from_code(18), Some(Command::Barrier));
    }

    #[test]
    fn oversized_lengths_are_rejected_before_their_bytes_arrive() {
        let mut buf = BytesMut::new();
        buf.put_u8(Command::Get.code());
        buf.put_u64_le(u64::MAX);
        assert_eq!(
            Request::decode(&mut buf),
            Err(DecodeError::KeyTooLong {
                len: u64::MAX,
                max: MAX_KEY_LEN
            })
        );

        let mut buf = BytesMut::new();
        buf.put_u8(Command::Set.code());
        put_bytes(&mut buf, b"/k");
        buf.put_u64_le(MAX_VALUE_LEN + 1);
        assert!(matches!(
            Request::decode(&mut buf),
            Err(DecodeError::ValueTooLong { .. })
        ));

        let mut buf = BytesMut::new();
        buf.put_u8(Command::Wait.code());
        buf.put_u64_le(MAX_KEY_COUNT + 1);
        assert!(matches!(
            Request::decode(&mut buf),
            Err(DecodeError::TooManyKeys { .. })
        ));

        // MULTI_SET's count is written as i64 by the client: -1 is 2^64-1 keys.
        let mut buf = BytesMut::new();
        buf.put_u8(Command::MultiSet.code());
        buf.put_i64_le(-1);
        assert!(matches!(
            Request::decode(&mut buf),
            Err(DecodeError::TooManyKeys { .. })
        ));
    }

    #[test]
    fn limits_are_inclusive() {
        let key = vec![b'k'; MAX_KEY_LEN as usize];
        roundtrip(&Request::Get {
            key: Bytes::from(key),
        });
    }

    #[test]
    fn unknown_command_bytes_are_errors() {
        for code in [19u8, 0x63, 0xff] {
            let mut buf = BytesMut::from(&[code][..]);
            assert_eq!(
                Request::decode(&mut buf),
                Err(DecodeError::UnknownCommand(code))
            );
        }
    }

    #[test]
    fn pipelined_requests_decode_one_after_another() {
        let mut buf = BytesMut::new();
        Request::Set {
            key: b("/a"),
            value: b("1"),
        }
        .encode(&mut buf);
        Request::Get { key: b("/a") }.encode(&mut buf);
        Request::GetNumKeys.encode(&mut buf);
        let mut seen = Vec::new();
        while let Some(req) = Request::decode(&mut buf).unwrap() {
            seen.push(req.command());
        }
        assert_eq!(seen, [Command::Set, Command::Get, Command::GetNumKeys]);
    }
}
