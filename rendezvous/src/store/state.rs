//! The store's state — keys, counters, queues and waiters — with no I/O and no async.
//!
//! [`State::apply`] carries out one request for one client: it appends that client's reply bytes
//! to a buffer and reports which *other* clients a write released (each of them is owed one
//! STOP_WAITING byte). The server serialises all calls under one lock, so replies and wake-ups of
//! a client are totally ordered; that is what makes CANCEL_WAIT atomic: a wake-up either happened
//! before the cancel (and its `00` precedes the cancel's `01` on the wire) or never happens.
//!
//! Semantics follow torch's libuv backend (TCPStoreLibUvBackend.cpp, torch 2.15). Where the
//! classic backend differs, the choice is marked "libuv:".

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};

use bytes::{BufMut, Bytes, BytesMut};

use super::protocol::{put_bytes, reply, Request};

/// The store's maps. Keys are short and every request hashes at least one, so the hash function
/// is a measurable share of a request's cost (SipHash was ~10% of a pipelined SET); foldhash is
/// several times faster and still seeded per map.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Identifies a connection for the lifetime of the server.
pub type ClientId = u64;

/// What one stored entry costs beyond its key and value bytes, charged against
/// [`Limits::max_bytes`]: the hash-map slot (two `Bytes` handles, 64 bytes) and the allocator's
/// headers of the two owned buffers. Without it a flood of empty keys would be nearly free to
/// store and still cost real memory.
pub const ENTRY_OVERHEAD: usize = 64;

/// What one queued element or one waiter's registration costs beyond its bytes (a `Bytes`
/// handle in a `VecDeque` or a `Vec`, plus the allocation header).
pub const ITEM_OVERHEAD: usize = 48;

/// Bounds on what the store holds and answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of keys, values, queued elements and waiters' registrations (each with its
    /// overhead above) the store may hold. A request that would go past it is refused.
    pub max_bytes: usize,
    /// Longest reply one request may produce: bounds MULTI_GET (up to 131,072 copies of an
    /// 8 MiB value in one request) and LIST_KEYS, the only replies not bounded by the codec.
    pub max_reply: usize,
}

impl Limits {
    /// No bound at all (the store as torch has it).
    pub const UNLIMITED: Limits = Limits {
        max_bytes: usize::MAX,
        max_reply: usize::MAX,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::UNLIMITED
    }
}

/// A request the state refuses; the server closes that client's connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// ADD or BARRIER on a value `std::stoll` cannot parse. Both torch backends close the
    /// connection here (the exception escapes the handler); so do we.
    #[error("ADD on key {key:?} whose value {value:?} is not a decimal integer")]
    NotANumber { key: String, value: String },
    /// VALIDATE is only valid as the first message; the server handles that one.
    #[error("VALIDATE after the handshake")]
    UnexpectedValidate,
    /// The request would take the store past [`Limits::max_bytes`]. There is no reply code
    /// for it in the protocol; the connection is closed, which a torch client reports as a
    /// connection error on this or its next call.
    #[error(
        "store full: it holds {used} bytes of its {max}-byte limit and {command} needs {more} more"
    )]
    StoreFull {
        command: &'static str,
        used: usize,
        more: usize,
        max: usize,
    },
    /// The reply would exceed [`Limits::max_reply`].
    #[error("the reply to {command} would be {len} bytes, over the {max}-byte limit")]
    ReplyTooLarge {
        command: &'static str,
        len: usize,
        max: usize,
    },
}

/// What a client is blocked on.
#[derive(Debug, Default)]
struct WaitState {
    /// Registrations not yet released; the client is woken when this reaches zero.
    remaining: usize,
    /// Every key the client is registered on (in `waiting` or `barriers`), for clean-up.
    keys: Vec<Bytes>,
    /// What these registrations are charged against the limit; given back with the wait.
    charged: usize,
}

/// The store's contents and waiters.
#[derive(Debug, Default)]
pub struct State {
    values: Map<Bytes, Bytes>,
    /// libuv only: queues live in their own map, invisible to GETNUMKEYS and LIST_KEYS.
    queues: Map<Bytes, VecDeque<Bytes>>,
    /// Key → clients waiting for it, one entry per registration (a key listed twice in one WAIT
    /// is registered twice, and one write releases both).
    waiting: Map<Bytes, Vec<ClientId>>,
    /// Key → clients blocked in BARRIER on it. Kept apart from `waiting` because a barrier is
    /// released by its count reaching the world size, not by the key being written.
    barriers: Map<Bytes, Vec<ClientId>>,
    waits: Map<ClientId, WaitState>,
    limits: Limits,
    /// What everything above is charged against `limits.max_bytes`.
    bytes: usize,
}

impl State {
    /// A store without limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store bounded by `limits`.
    pub fn with_limits(limits: Limits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// Bytes charged against [`Limits::max_bytes`] now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Number of clients currently blocked in WAIT or BARRIER.
    pub fn blocked_clients(&self) -> usize {
        self.waits.len()
    }

    /// Number of regular keys (what GETNUMKEYS answers).
    pub fn num_keys(&self) -> usize {
        self.values.len()
    }

    /// Carries out `request` for `client`, appending its reply (if the command has one) to
    /// `reply` and the ids of other clients it released to `woken`. The store's dispatcher: a
    /// command of more than a line or two has its own function, called straight from the match
    /// (no boxing or allocation on the way).
    pub fn apply(
        &mut self,
        client: ClientId,
        request: Request,
        reply: &mut BytesMut,
        woken: &mut Vec<ClientId>,
    ) -> Result<(), StateError> {
        match request {
            Request::Validate { .. } => return Err(StateError::UnexpectedValidate),
            Request::Set { key, value } => self.set(&key, &value, woken, "SET")?,
            Request::CompareSet {
                key,
                expected,
                desired,
            } => self.compare_set(&key, expected, desired, reply, woken)?,
            Request::Get { key } => self.get(&key, reply),
            Request::Add { key, delta } => {
                let value = self.add(&key, delta, woken)?;
                reply.put_i64_le(value);
            }
            Request::Check { keys } => self.check(&keys, reply),
            Request::Wait { keys } => self.wait(client, keys, reply)?,
            Request::GetNumKeys => reply.put_i64_le(self.values.len() as i64),
            Request::DeleteKey { key } => self.delete_key(&key, reply),
            Request::Append { key, value } => self.append(&key, &value, woken)?,
            Request::MultiGet { keys } => self.multi_get(&keys, reply)?,
            Request::MultiSet { pairs } => {
                // Pairs before one that does not fit stay stored, as a torch client's connection
                // error cannot tell how far the request went either.
                for (key, value) in &pairs {
                    self.set(key, value, woken, "MULTI_SET")?;
                }
            }
            Request::CancelWait => {
                self.cancel_wait(client);
                reply.put_u8(reply::WAIT_CANCELED);
            }
            Request::Ping { nonce } => reply.put_u32_le(nonce),
            Request::QueuePush { key, value } => self.queue_push(&key, &value, woken)?,
            Request::QueuePop { key } => self.queue_pop(&key, reply),
            Request::QueueLen { key } => {
                let len = self.queues.get(&key).map_or(0, VecDeque::len);
                reply.put_i64_le(len as i64);
            }
            Request::ListKeys => self.list_keys(reply)?,
            Request::Barrier { key, world_size } => {
                self.barrier(client, key, world_size, reply, woken)?;
            }
        }
        Ok(())
    }

    /// COMPARE_SET: replaces the value when it matches `expected` and answers the value that
    /// holds after.
    fn compare_set(
        &mut self,
        key: &Bytes,
        expected: Bytes,
        desired: Bytes,
        reply: &mut BytesMut,
        woken: &mut Vec<ClientId>,
    ) -> Result<(), StateError> {
        let current = match self.values.get(key) {
            // The "lie": nothing to compare with, so the expected value is returned and
            // nothing is created.
            None if !expected.is_empty() => expected,
            Some(current) if *current != expected => current.clone(),
            // Missing and expected empty, or present and equal: replaced.
            _ => {
                self.store_value(key, &desired, "COMPARE_SET")?;
                desired
            }
        };
        put_bytes(reply, &current);
        // libuv: every COMPARE_SET wakes the key's waiters, even a failed one (classic
        // wakes none, not even when it creates the key, which strands waiters).
        self.wake(key, woken);
        Ok(())
    }

    /// GET: answers the value of `key`.
    fn get(&self, key: &Bytes, reply: &mut BytesMut) {
        // libuv: a missing key reads as empty (classic closes the connection).
        let value = self.values.get(key).map_or(&[][..], |v| &v[..]);
        put_bytes(reply, value);
    }

    /// CHECK: answers whether every key exists.
    fn check(&self, keys: &[Bytes], reply: &mut BytesMut) {
        let ready = keys.iter().all(|k| self.exists(k));
        reply.put_u8(if ready {
            reply::READY
        } else {
            reply::NOT_READY
        });
    }

    /// DELETE_KEY: removes `key` and answers whether it was there.
    fn delete_key(&mut self, key: &Bytes, reply: &mut BytesMut) {
        // Deleting wakes nobody (both backends).
        let deleted = self.values.remove_entry(key);
        if let Some((key, value)) = &deleted {
            self.bytes -= entry_cost(key, value);
        }
        reply.put_i64_le(i64::from(deleted.is_some()));
    }

    /// APPEND: adds `value` at the end of `key`'s value, creating it when missing.
    fn append(
        &mut self,
        key: &Bytes,
        value: &Bytes,
        woken: &mut Vec<ClientId>,
    ) -> Result<(), StateError> {
        let more = match self.values.get(key) {
            Some(_) => value.len(),
            None => entry_cost(key, value),
        };
        self.charge("APPEND", more)?;
        match self.values.entry(key.clone()) {
            Entry::Occupied(mut e) => {
                let mut joined = BytesMut::with_capacity(e.get().len() + value.len());
                joined.put_slice(e.get());
                joined.put_slice(value);
                e.insert(joined.freeze());
            }
            Entry::Vacant(e) => {
                e.insert(own(value));
            }
        }
        self.wake(key, woken);
        Ok(())
    }

    /// MULTI_GET: answers every key's value in order (a missing one as empty).
    fn multi_get(&self, keys: &[Bytes], reply: &mut BytesMut) -> Result<(), StateError> {
        let len = keys
            .iter()
            .map(|key| 8 + self.values.get(key).map_or(0, Bytes::len))
            .sum();
        self.check_reply("MULTI_GET", len)?;
        for key in keys {
            let value = self.values.get(key).map_or(&[][..], |v| &v[..]);
            put_bytes(reply, value);
        }
        Ok(())
    }

    /// LIST_KEYS: answers the number of regular keys, then each of them.
    fn list_keys(&self, reply: &mut BytesMut) -> Result<(), StateError> {
        let len = 8 + self.values.keys().map(|k| 8 + k.len()).sum::<usize>();
        self.check_reply("LIST_KEYS", len)?;
        reply.put_i64_le(self.values.len() as i64);
        for key in self.values.keys() {
            put_bytes(reply, key);
        }
        Ok(())
    }

    /// QUEUE_PUSH (libuv): appends `value` to `key`'s queue.
    fn queue_push(
        &mut self,
        key: &Bytes,
        value: &Bytes,
        woken: &mut Vec<ClientId>,
    ) -> Result<(), StateError> {
        let more = value.len()
            + ITEM_OVERHEAD
            + if self.queues.contains_key(key) {
                0
            } else {
                key.len() + ENTRY_OVERHEAD
            };
        self.charge("QUEUE_PUSH", more)?;
        self.queues
            .entry(own(key))
            .or_default()
            .push_back(own(value));
        // libuv: a push releases one waiter, since one element serves one popper.
        self.wake_one(key, woken);
        Ok(())
    }

    /// QUEUE_POP (libuv): answers the queue's length before the pop, then its first element.
    fn queue_pop(&mut self, key: &Bytes, reply: &mut BytesMut) {
        let queue = self.queues.get_mut(key);
        let len = queue.as_ref().map_or(0, |q| q.len());
        reply.put_i64_le(len as i64);
        if let Some(value) = queue.and_then(VecDeque::pop_front) {
            put_bytes(reply, &value);
            self.bytes -= value.len() + ITEM_OVERHEAD;
            if len == 1 {
                // An empty queue is the same as none to every command (CHECK, WAIT,
                // QUEUE_LEN, QUEUE_POP); dropping it gives its key's bytes back.
                self.queues.remove(key);
                self.bytes -= key.len() + ENTRY_OVERHEAD;
            }
        }
    }

    /// BARRIER: counts `client` in on `key`; the `world_size`-th arrival releases everyone,
    /// the others block until then.
    fn barrier(
        &mut self,
        client: ClientId,
        key: Bytes,
        world_size: i64,
        reply: &mut BytesMut,
        woken: &mut Vec<ClientId>,
    ) -> Result<(), StateError> {
        let count = self.add(&key, 1, woken)?;
        let registration = key.len() + ITEM_OVERHEAD;
        if count < world_size {
            self.charge("BARRIER", registration)?;
        }
        if count >= world_size {
            reply.put_u8(reply::STOP_WAITING);
            if let Some(blocked) = self.barriers.remove(&key) {
                for id in blocked {
                    self.release(id, woken);
                }
            }
        } else {
            self.barriers.entry(key.clone()).or_default().push(client);
            let wait = self.waits.entry(client).or_default();
            wait.remaining += 1;
            wait.keys.push(key);
            wait.charged += registration;
        }
        Ok(())
    }

    /// Forgets everything `client` was waiting for: on CANCEL_WAIT and on disconnect.
    pub fn cancel_wait(&mut self, client: ClientId) {
        let Some(wait) = self.waits.remove(&client) else {
            return;
        };
        self.bytes -= wait.charged;
        for key in wait.keys {
            for map in [&mut self.waiting, &mut self.barriers] {
                if let Some(list) = map.get_mut(&key) {
                    list.retain(|&id| id != client);
                    if list.is_empty() {
                        map.remove(&key);
                    }
                }
            }
        }
    }

    fn set(
        &mut self,
        key: &Bytes,
        value: &Bytes,
        woken: &mut Vec<ClientId>,
        command: &'static str,
    ) -> Result<(), StateError> {
        self.store_value(key, value, command)?;
        self.wake(key, woken);
        Ok(())
    }

    /// Stores `value` under `key` if the limit allows; wakes nobody.
    fn store_value(
        &mut self,
        key: &Bytes,
        value: &Bytes,
        command: &'static str,
    ) -> Result<(), StateError> {
        // Overwriting an existing key keeps its allocation for the key (the common case in
        // pipelined SET loops and counters).
        if let Some(old) = self.values.get(key).map(Bytes::len) {
            if value.len() > old {
                self.charge(command, value.len() - old)?;
            } else {
                self.bytes -= old - value.len();
            }
            if let Some(slot) = self.values.get_mut(key) {
                *slot = own(value);
            }
        } else {
            self.charge(command, entry_cost(key, value))?;
            self.values.insert(own(key), own(value));
        }
        Ok(())
    }

    /// Adds `more` bytes to what the store holds, or refuses when that would pass the limit.
    /// Requests that shrink the store are never refused: a full store can always be emptied.
    fn charge(&mut self, command: &'static str, more: usize) -> Result<(), StateError> {
        match self.bytes.checked_add(more) {
            Some(total) if total <= self.limits.max_bytes => {
                self.bytes = total;
                Ok(())
            }
            _ => Err(StateError::StoreFull {
                command,
                used: self.bytes,
                more,
                max: self.limits.max_bytes,
            }),
        }
    }

    fn check_reply(&self, command: &'static str, len: usize) -> Result<(), StateError> {
        if len > self.limits.max_reply {
            return Err(StateError::ReplyTooLarge {
                command,
                len,
                max: self.limits.max_reply,
            });
        }
        Ok(())
    }

    fn add(
        &mut self,
        key: &Bytes,
        delta: i64,
        woken: &mut Vec<ClientId>,
    ) -> Result<i64, StateError> {
        let current = match self.values.get(key) {
            None => 0,
            Some(value) => parse_stoll(value).ok_or_else(|| StateError::NotANumber {
                key: String::from_utf8_lossy(key).into_owned(),
                value: String::from_utf8_lossy(value).into_owned(),
            })?,
        };
        // i64 overflow wraps, as the C++ signed addition does in practice.
        let updated = current.wrapping_add(delta);
        self.set(key, &Bytes::from(updated.to_string()), woken, "ADD")?;
        Ok(updated)
    }

    /// libuv: a key exists if it holds a value or names a non-empty queue.
    fn exists(&self, key: &Bytes) -> bool {
        self.values.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn wait(
        &mut self,
        client: ClientId,
        keys: Vec<Bytes>,
        reply: &mut BytesMut,
    ) -> Result<(), StateError> {
        let missing: Vec<Bytes> = keys.into_iter().filter(|k| !self.exists(k)).collect();
        if missing.is_empty() {
            reply.put_u8(reply::STOP_WAITING);
            return Ok(());
        }
        // Registrations cost memory too, and a client may pipeline any number of WAITs.
        let charged = missing.iter().map(|k| k.len() + ITEM_OVERHEAD).sum();
        self.charge("WAIT", charged)?;
        let wait = self.waits.entry(client).or_default();
        wait.charged += charged;
        wait.remaining += missing.len();
        for key in missing {
            let key = own(&key);
            self.waiting.entry(key.clone()).or_default().push(client);
            wait.keys.push(key);
        }
        Ok(())
    }

    /// A write to `key`: every registration on it is released.
    fn wake(&mut self, key: &Bytes, woken: &mut Vec<ClientId>) {
        if self.waiting.is_empty() {
            return;
        }
        if let Some(list) = self.waiting.remove(key) {
            for id in list {
                self.release(id, woken);
            }
        }
    }

    fn wake_one(&mut self, key: &Bytes, woken: &mut Vec<ClientId>) {
        let Some(list) = self.waiting.get_mut(key) else {
            return;
        };
        let id = list.remove(0);
        if list.is_empty() {
            self.waiting.remove(key);
        }
        self.release(id, woken);
    }

    /// One registration of `id` is satisfied; the last one releases the client.
    fn release(&mut self, id: ClientId, woken: &mut Vec<ClientId>) {
        if let Some(wait) = self.waits.get_mut(&id) {
            wait.remaining = wait.remaining.saturating_sub(1);
            if wait.remaining == 0 {
                let charged = wait.charged;
                self.waits.remove(&id);
                self.bytes -= charged;
                woken.push(id);
            }
        }
    }
}

/// What a stored key and value are charged.
fn entry_cost(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + ENTRY_OVERHEAD
}

/// Keys and values arrive as slices of a whole receive buffer; storing such a slice would keep
/// the entire buffer alive for as long as the key exists, so stored bytes get their own
/// allocation.
fn own(bytes: &Bytes) -> Bytes {
    Bytes::copy_from_slice(bytes)
}

/// `std::stoll` as torch applies it to stored counters: leading C whitespace, an optional sign,
/// at least one digit, trailing junk ignored; `None` where stoll throws (no digits, out of range).
pub fn parse_stoll(bytes: &[u8]) -> Option<i64> {
    let mut rest = bytes;
    while let [first, tail @ ..] = rest {
        if matches!(first, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r') {
            rest = tail;
        } else {
            break;
        }
    }
    let negative = match rest.first() {
        Some(b'-') => {
            rest = &rest[1..];
            true
        }
        Some(b'+') => {
            rest = &rest[1..];
            false
        }
        _ => false,
    };
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    // Accumulate negatively so that i64::MIN parses.
    let mut value: i64 = 0;
    for &d in &rest[..digits] {
        value = value.checked_mul(10)?.checked_sub(i64::from(d - b'0'))?;
    }
    if negative {
        Some(value)
    } else {
        value.checked_neg()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Buf;

    use super::*;

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    struct Harness {
        state: State,
        woken: Vec<ClientId>,
    }

    impl Harness {
        fn new() -> Self {
            Self {
                state: State::new(),
                woken: Vec::new(),
            }
        }

        fn run(&mut self, client: ClientId, req: Request) -> BytesMut {
            let mut reply = BytesMut::new();
            self.state
                .apply(client, req, &mut reply, &mut self.woken)
                .unwrap();
            reply
        }

        fn set(&mut self, key: &str, value: &str) {
            let r = self.run(
                0,
                Request::Set {
                    key: b(key),
                    value: b(value),
                },
            );
            assert!(r.is_empty(), "SET has no reply");
        }

        fn get(&mut self, key: &str) -> Vec<u8> {
            let mut r = self.run(0, Request::Get { key: b(key) });
            get_vec(&mut r)
        }

        fn cas(&mut self, key: &str, expected: &str, desired: &str) -> Vec<u8> {
            let mut r = self.run(
                0,
                Request::CompareSet {
                    key: b(key),
                    expected: b(expected),
                    desired: b(desired),
                },
            );
            get_vec(&mut r)
        }

        fn add(&mut self, key: &str, delta: i64) -> i64 {
            self.run(0, Request::Add { key: b(key), delta })
                .get_i64_le()
        }

        fn wait(&mut self, client: ClientId, keys: &[&str]) -> BytesMut {
            self.run(
                client,
                Request::Wait {
                    keys: keys.iter().map(|k| b(k)).collect(),
                },
            )
        }

        fn take_woken(&mut self) -> Vec<ClientId> {
            std::mem::take(&mut self.woken)
        }
    }

    fn get_vec(r: &mut BytesMut) -> Vec<u8> {
        crate::store::protocol::get_bytes(r).unwrap()
    }

    #[test]
    fn compare_set_covers_all_four_cases() {
        let mut h = Harness::new();
        // Missing key, expected non-empty: the expected value comes back, nothing is created.
        assert_eq!(h.cas("/k", "x", "y"), b"x");
        assert_eq!(h.state.num_keys(), 0);
        // Missing key, expected empty: created.
        assert_eq!(h.cas("/k", "", "first"), b"first");
        // Present and equal: replaced.
        assert_eq!(h.cas("/k", "first", "second"), b"second");
        // Present and different: the current value comes back, unchanged.
        assert_eq!(h.cas("/k", "nope", "third"), b"second");
        assert_eq!(h.get("/k"), b"second");
    }

    #[test]
    fn add_parses_like_stoll_and_wraps() {
        let mut h = Harness::new();
        assert_eq!(h.add("/c", 5), 5);
        assert_eq!(h.add("/c", -7), -2);
        h.set("/ws", "  7");
        assert_eq!(h.add("/ws", 1), 8);
        h.set("/junk", " 12abc");
        assert_eq!(h.add("/junk", 1), 13);
        h.set("/max", &i64::MAX.to_string());
        assert_eq!(h.add("/max", 1), i64::MIN);
        assert_eq!(h.get("/max"), i64::MIN.to_string().as_bytes());
    }

    #[test]
    fn add_on_a_non_number_is_refused() {
        let mut h = Harness::new();
        h.set("/s", "hello");
        let err = h
            .state
            .apply(
                0,
                Request::Add {
                    key: b("/s"),
                    delta: 1,
                },
                &mut BytesMut::new(),
                &mut Vec::new(),
            )
            .unwrap_err();
        assert!(matches!(err, StateError::NotANumber { .. }));
        assert_eq!(h.get("/s"), b"hello", "the value is untouched");
    }

    #[test]
    fn stoll_edge_cases() {
        assert_eq!(parse_stoll(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_stoll(b"9223372036854775808"), None);
        assert_eq!(parse_stoll(b"+4"), Some(4));
        assert_eq!(parse_stoll(b"\t\n-3x"), Some(-3));
        assert_eq!(parse_stoll(b""), None);
        assert_eq!(parse_stoll(b"-"), None);
        assert_eq!(parse_stoll(b"x1"), None);
    }

    #[test]
    fn wait_answers_at_once_when_keys_exist_and_later_otherwise() {
        let mut h = Harness::new();
        h.set("/a", "1");
        assert_eq!(&h.wait(1, &["/a"])[..], [reply::STOP_WAITING]);
        assert!(h.wait(1, &["/a", "/b", "/c"]).is_empty());
        h.set("/b", "1");
        assert!(h.take_woken().is_empty(), "still waiting for /c");
        h.add("/c", 1);
        assert_eq!(h.take_woken(), [1]);
        assert_eq!(h.state.blocked_clients(), 0);
    }

    #[test]
    fn one_write_releases_every_waiter_and_duplicate_keys() {
        let mut h = Harness::new();
        h.wait(1, &["/k"]);
        h.wait(2, &["/k", "/k"]);
        h.set("/k", "v");
        let mut woken = h.take_woken();
        woken.sort_unstable();
        assert_eq!(woken, [1, 2]);
    }

    #[test]
    fn cancel_wait_is_final_and_always_answered() {
        let mut h = Harness::new();
        assert_eq!(&h.run(1, Request::CancelWait)[..], [reply::WAIT_CANCELED]);
        h.wait(1, &["/k"]);
        assert_eq!(&h.run(1, Request::CancelWait)[..], [reply::WAIT_CANCELED]);
        h.set("/k", "v");
        assert!(
            h.take_woken().is_empty(),
            "no late STOP_WAITING after a cancel"
        );
        assert!(h.state.waiting.is_empty());
    }

    #[test]
    fn a_disconnected_waiter_leaves_no_trace() {
        let mut h = Harness::new();
        h.wait(1, &["/k", "/j"]);
        h.state.cancel_wait(1);
        h.set("/k", "v");
        h.set("/j", "v");
        assert!(h.take_woken().is_empty());
        assert!(h.state.waiting.is_empty() && h.state.waits.is_empty());
    }

    #[test]
    fn libuv_compare_set_wakes_waiters_even_when_it_fails() {
        let mut h = Harness::new();
        h.wait(1, &["/k"]);
        h.cas("/k", "not-there", "x");
        assert_eq!(h.take_woken(), [1]);
    }

    #[test]
    fn delete_wakes_nobody_and_reports_a_count() {
        let mut h = Harness::new();
        h.set("/k", "v");
        h.wait(1, &["/other"]);
        assert_eq!(
            h.run(0, Request::DeleteKey { key: b("/k") }).get_i64_le(),
            1
        );
        assert_eq!(
            h.run(0, Request::DeleteKey { key: b("/k") }).get_i64_le(),
            0
        );
        assert!(h.take_woken().is_empty());
    }

    #[test]
    fn check_is_inverted_and_sees_non_empty_queues() {
        let mut h = Harness::new();
        let check = |h: &mut Harness, k: &str| h.run(0, Request::Check { keys: vec![b(k)] })[0];
        assert_eq!(check(&mut h, "/q"), reply::NOT_READY);
        h.run(
            0,
            Request::QueuePush {
                key: b("/q"),
                value: b("e"),
            },
        );
        assert_eq!(check(&mut h, "/q"), reply::READY);
    }

    #[test]
    fn queues_pop_in_order_report_length_before_pop_and_wake_one() {
        let mut h = Harness::new();
        h.wait(1, &["/q"]);
        h.wait(2, &["/q"]);
        for v in ["a", "b"] {
            h.run(
                0,
                Request::QueuePush {
                    key: b("/q"),
                    value: b(v),
                },
            );
        }
        assert_eq!(h.take_woken(), [1, 2], "one waiter per push");
        let mut r = h.run(0, Request::QueuePop { key: b("/q") });
        assert_eq!(r.get_i64_le(), 2);
        assert_eq!(get_vec(&mut r), b"a");
        assert_eq!(h.run(0, Request::QueueLen { key: b("/q") }).get_i64_le(), 1);
        h.run(0, Request::QueuePop { key: b("/q") });
        let r = h.run(0, Request::QueuePop { key: b("/q") });
        assert_eq!(&r[..], 0i64.to_le_bytes(), "empty pop is the length alone");
        assert_eq!(h.state.num_keys(), 0, "queues are not keys");
    }

    #[test]
    fn barrier_counts_in_a_visible_key_and_releases_at_world_size() {
        let mut h = Harness::new();
        let barrier = |h: &mut Harness, c: ClientId| {
            h.run(
                c,
                Request::Barrier {
                    key: b("/bar"),
                    world_size: 2,
                },
            )
        };
        assert!(barrier(&mut h, 1).is_empty());
        assert_eq!(h.get("/bar"), b"1");
        assert_eq!(&barrier(&mut h, 2)[..], [reply::STOP_WAITING]);
        assert_eq!(h.take_woken(), [1]);
        assert_eq!(h.get("/bar"), b"2");
    }

    #[test]
    fn a_cancelled_barrier_keeps_its_count() {
        let mut h = Harness::new();
        h.run(
            1,
            Request::Barrier {
                key: b("/bar2"),
                world_size: 2,
            },
        );
        h.run(1, Request::CancelWait);
        assert_eq!(h.get("/bar2"), b"1");
        assert!(h.state.barriers.is_empty());
    }

    #[test]
    fn list_keys_and_num_keys_count_regular_keys_only() {
        let mut h = Harness::new();
        h.set("/a", "1");
        h.add("init/", 1);
        h.run(
            0,
            Request::QueuePush {
                key: b("/q"),
                value: b("e"),
            },
        );
        assert_eq!(h.run(0, Request::GetNumKeys).get_i64_le(), 2);
        let mut r = h.run(0, Request::ListKeys);
        assert_eq!(r.get_i64_le(), 2);
        let mut keys = vec![get_vec(&mut r), get_vec(&mut r)];
        keys.sort();
        assert_eq!(keys, [b"/a".to_vec(), b"init/".to_vec()]);
    }

    #[test]
    fn append_creates_then_concatenates_and_wakes() {
        let mut h = Harness::new();
        h.wait(1, &["/log"]);
        h.run(
            0,
            Request::Append {
                key: b("/log"),
                value: b("ab"),
            },
        );
        h.run(
            0,
            Request::Append {
                key: b("/log"),
                value: b("cd"),
            },
        );
        assert_eq!(h.take_woken(), [1]);
        assert_eq!(h.get("/log"), b"abcd");
    }

    #[test]
    fn every_stored_byte_is_charged_and_given_back() {
        let mut h = Harness::new();
        h.set("/k", "12345");
        assert_eq!(h.state.bytes(), 2 + 5 + ENTRY_OVERHEAD);
        h.set("/k", "1");
        assert_eq!(h.state.bytes(), 2 + 1 + ENTRY_OVERHEAD, "overwrite shrinks");
        h.run(
            0,
            Request::Append {
                key: b("/k"),
                value: b("23"),
            },
        );
        h.add("/n", 7);
        h.cas("/c", "", "v");
        h.run(
            0,
            Request::MultiSet {
                pairs: vec![(b("/m"), b("mm"))],
            },
        );
        for v in ["a", "bb"] {
            h.run(
                0,
                Request::QueuePush {
                    key: b("/q"),
                    value: b(v),
                },
            );
        }
        h.wait(1, &["/w", "/w"]);
        h.wait(2, &["/x"]);
        h.run(
            3,
            Request::Barrier {
                key: b("/b"),
                world_size: 2,
            },
        );
        assert!(h.state.bytes() > 0);
        // Release, cancel and disconnect every waiter; drain and delete everything.
        h.set("/w", "");
        h.run(2, Request::CancelWait);
        h.state.cancel_wait(3);
        for _ in 0..3 {
            h.run(0, Request::QueuePop { key: b("/q") });
        }
        for key in ["/k", "/n", "/c", "/m", "/w", "/b"] {
            h.run(0, Request::DeleteKey { key: b(key) });
        }
        assert_eq!(h.state.num_keys(), 0);
        assert_eq!(h.state.bytes(), 0, "every charge was given back");
    }

    #[test]
    fn a_full_store_refuses_growth_but_not_shrinking() {
        let mut state = State::with_limits(Limits {
            max_bytes: 2 * (3 + 4 + ENTRY_OVERHEAD),
            max_reply: 1024,
        });
        let mut apply = |req: Request| state.apply(0, req, &mut BytesMut::new(), &mut Vec::new());
        let set = |k: &str, v: &str| Request::Set {
            key: b(k),
            value: b(v),
        };
        assert_eq!(apply(set("/k1", "vvvv")), Ok(()));
        assert_eq!(apply(set("/k2", "vvvv")), Ok(()));
        let full = apply(set("/k3", "v"));
        assert!(
            matches!(full, Err(StateError::StoreFull { command: "SET", .. })),
            "{full:?}"
        );
        assert!(matches!(
            apply(Request::Wait {
                keys: vec![b("/never")]
            }),
            Err(StateError::StoreFull {
                command: "WAIT",
                ..
            })
        ));
        assert_eq!(apply(set("/k1", "")), Ok(()), "shrinking is always allowed");
        assert_eq!(apply(set("/k1", "vvvv")), Ok(()), "and frees room again");
        assert_eq!(
            apply(Request::DeleteKey { key: b("/k2") }),
            Ok(()),
            "a full store can be emptied"
        );
        assert_eq!(apply(set("/k3", "v")), Ok(()));
    }

    #[test]
    fn replies_over_the_limit_are_refused_before_they_are_built() {
        let mut state = State::with_limits(Limits {
            max_bytes: usize::MAX,
            max_reply: 100,
        });
        let mut reply = BytesMut::new();
        let mut woken = Vec::new();
        let value = Bytes::from(vec![b'x'; 40]);
        state
            .apply(
                0,
                Request::Set {
                    key: b("/v"),
                    value,
                },
                &mut reply,
                &mut woken,
            )
            .unwrap();
        let multi_get = |n: usize| Request::MultiGet {
            keys: vec![b("/v"); n],
        };
        state
            .apply(0, multi_get(2), &mut reply, &mut woken)
            .unwrap();
        assert_eq!(reply.len(), 2 * 48);
        reply.clear();
        let err = state
            .apply(0, multi_get(3), &mut reply, &mut woken)
            .unwrap_err();
        assert_eq!(
            err,
            StateError::ReplyTooLarge {
                command: "MULTI_GET",
                len: 3 * 48,
                max: 100
            }
        );
        assert!(reply.is_empty(), "nothing was built");
    }

    #[test]
    fn multi_get_answers_empty_for_missing_keys() {
        let mut h = Harness::new();
        h.run(
            0,
            Request::MultiSet {
                pairs: vec![(b("/a"), b("1")), (b("/b"), b("2"))],
            },
        );
        let mut r = h.run(
            0,
            Request::MultiGet {
                keys: vec![b("/a"), b("/missing"), b("/b")],
            },
        );
        assert_eq!(get_vec(&mut r), b"1");
        assert_eq!(get_vec(&mut r), b"");
        assert_eq!(get_vec(&mut r), b"2");
    }
}
