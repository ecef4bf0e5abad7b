//! The replica listener (one per agent, on the address it reaches the store from) and the two
//! calls to a peer's: `push` a node's parts of a committed step to its buddy, `fetch` them back.
//! Each connection carries one request; its bytes move on blocking threads (the parts are
//! memory files read and written at explicit offsets), with a timeout on every read and write.

use std::collections::BTreeMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::wire::{read_part_head, write_part_head, Answer, Header, Op, Token, WireError};
use super::{copy_memory, memory_from, Host, Replica};

/// How long one read or write on a replica connection may stall.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once: a gang's buddies need one or two; more are closed at once, so
/// that callers holding connections open cannot take the agent's blocking threads.
const MAX_CONNECTIONS: usize = 8;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A running listener: where it is and the token a caller must show.
#[derive(Debug, Clone, Copy)]
pub struct Listening {
    pub addr: SocketAddr,
    pub token: Token,
}

impl Listening {
    /// How it is published on the store: `ip:port token-hex`.
    pub fn encode(&self) -> String {
        format!("{} {}", self.addr, hex(&self.token))
    }

    pub fn decode(value: &[u8]) -> Option<Listening> {
        let text = std::str::from_utf8(value).ok()?;
        let (addr, token) = text.split_once(' ')?;
        let addr = addr.parse().ok()?;
        let bytes = (0..token.len())
            .step_by(2)
            .map(|i| {
                token
                    .get(i..i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
            })
            .collect::<Option<Vec<u8>>>()?;
        let token = Token::try_from(bytes.as_slice()).ok()?;
        Some(Listening { addr, token })
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

/// Listens on `ip` (a free port) until `stop`.
pub async fn listen(
    ip: IpAddr,
    shared: Arc<dyn Host>,
    stop: CancellationToken,
) -> std::io::Result<Listening> {
    let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
    let listening = Listening {
        addr: listener.local_addr()?,
        token: rand::random(),
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        warn!("snapshots: accepting a replica connection failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                warn!("snapshots: closed a replica connection from {peer}: {MAX_CONNECTIONS} connections are open already");
                continue;
            };
            let shared = Arc::clone(&shared);
            let token = listening.token;
            tokio::task::spawn_blocking(move || {
                let _slot = slot;
                let stream = match blocking(stream) {
                    Ok(s) => s,
                    Err(e) => return debug!("snapshots: replica connection from {peer}: {e}"),
                };
                if let Err(why) = serve(stream, shared.as_ref(), token) {
                    warn!("snapshots: closed a replica connection from {peer}: {why}");
                }
            });
        }
    });
    Ok(listening)
}

fn blocking(stream: tokio::net::TcpStream) -> std::io::Result<TcpStream> {
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

fn serve(stream: TcpStream, shared: &dyn Host, token: Token) -> Result<(), String> {
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = BufWriter::new(stream);
    let header = Header::read(&mut reader).map_err(|e| e.to_string())?;
    if header.token != token {
        return Err(
            "wrong token: only an agent of this job, which read the token from the \
                    job's store, may hand over or fetch snapshot parts"
                .to_owned(),
        );
    }
    let answer = match header.op {
        Op::Put => take(&mut reader, shared, &header),
        Op::Get => return give(&mut writer, shared, &header),
    };
    let refused = match &answer {
        Answer::No(why) => Some(why.clone()),
        Answer::Ok { .. } => None,
    };
    answer.write(&mut writer).map_err(|e| e.to_string())?;
    writer.flush().map_err(|e| e.to_string())?;
    match refused {
        Some(why) => Err(format!(
            "node {}'s step {} refused: {why}",
            header.node, header.step
        )),
        None => Ok(()),
    }
}

/// A buddy's parts: read them all, then keep them (nothing changes before the last byte).
fn take(reader: &mut impl std::io::Read, shared: &dyn Host, header: &Header) -> Answer {
    let (attempt, room) = shared.attempt_and_room();
    if attempt != Some(header.attempt) {
        return Answer::No(format!(
            "the part is from attempt {} and this node is in attempt {attempt:?}",
            header.attempt
        ));
    }
    let mut parts = BTreeMap::new();
    let mut total = 0u64;
    for _ in 0..header.parts {
        let (rank, bytes) = match read_part_head(reader, room.saturating_sub(total)) {
            Ok(head) => head,
            Err(WireError::TooLarge { bytes, .. }) => {
                return Answer::No(format!(
                    "{} bytes would be held, over the cap (--snapshot-memory)",
                    total + bytes
                ))
            }
            Err(e) => return Answer::No(e.to_string()),
        };
        match memory_from(reader, bytes, "muster-replica") {
            Ok(memory) => {
                parts.insert(rank, (memory, bytes));
            }
            Err(e) => return Answer::No(e.to_string()),
        }
        total += bytes;
    }
    let kept = shared.replicas().keep(
        header.node,
        Replica {
            step: header.step,
            attempt: header.attempt,
            world_size: header.world_size,
            first_rank: header.first_rank,
            parts,
        },
    );
    if kept {
        Answer::Ok {
            parts: header.parts,
        }
    } else {
        Answer::No("a newer step of that node is held".to_owned())
    }
}

fn give(
    writer: &mut BufWriter<TcpStream>,
    shared: &dyn Host,
    header: &Header,
) -> Result<(), String> {
    let found: Option<Vec<(u32, OwnedFd, u64)>> = {
        let replicas = shared.replicas();
        replicas
            .get(header.node, header.step)
            .filter(|r| r.world_size == header.world_size && r.first_rank == header.first_rank)
            .map(|r| {
                r.parts
                    .iter()
                    .filter_map(|(rank, (memory, bytes))| {
                        memory.try_clone().ok().map(|m| (*rank, m, *bytes))
                    })
                    .collect()
            })
    };
    let io = |e: std::io::Error| e.to_string();
    let Some(parts) = found else {
        Answer::No(format!(
            "no part of node {} for step {}",
            header.node, header.step
        ))
        .write(writer)
        .map_err(io)?;
        return writer.flush().map_err(io);
    };
    let count = u32::try_from(parts.len()).map_err(|e| e.to_string())?;
    Answer::Ok { parts: count }.write(writer).map_err(io)?;
    for (rank, memory, bytes) in &parts {
        write_part_head(writer, *rank, *bytes).map_err(io)?;
        copy_memory(memory, *bytes, writer).map_err(io)?;
    }
    writer.flush().map_err(io)
}

fn connect(to: &Listening) -> Result<TcpStream, String> {
    let stream = TcpStream::connect_timeout(&to.addr, CONNECT_TIMEOUT)
        .map_err(|e| format!("cannot connect to {}: {e}", to.addr))?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(IO_TIMEOUT)))
        .and_then(|()| stream.set_nodelay(true))
        .map_err(|e| e.to_string())?;
    Ok(stream)
}

/// Hands `parts` (rank, memory, bytes) of `header.step` to the buddy at `to`. Blocking.
pub fn push(to: &Listening, header: Header, parts: &[(u32, OwnedFd, u64)]) -> Result<(), String> {
    let stream = connect(to)?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = BufWriter::with_capacity(1 << 20, stream);
    let io = |e: std::io::Error| e.to_string();
    writer.write_all(&header.encode()).map_err(io)?;
    for (rank, memory, bytes) in parts {
        write_part_head(&mut writer, *rank, *bytes).map_err(io)?;
        copy_memory(memory, *bytes, &mut writer).map_err(io)?;
    }
    writer.flush().map_err(io)?;
    match Answer::read(&mut reader).map_err(|e| e.to_string())? {
        Answer::Ok { .. } => Ok(()),
        Answer::No(why) => Err(why),
    }
}

/// Fetches the parts `header` names from the node at `to`, each at most `limit` bytes.
/// Blocking.
pub fn fetch(
    to: &Listening,
    header: Header,
    limit: u64,
) -> Result<Vec<(u32, OwnedFd, u64)>, String> {
    let stream = connect(to)?;
    let mut reader =
        BufReader::with_capacity(1 << 20, stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = stream;
    writer
        .write_all(&header.encode())
        .map_err(|e| e.to_string())?;
    let count = match Answer::read(&mut reader).map_err(|e| e.to_string())? {
        Answer::Ok { parts } => parts,
        Answer::No(why) => return Err(why),
    };
    let mut parts = Vec::new();
    for _ in 0..count {
        let (rank, bytes) = read_part_head(&mut reader, limit).map_err(|e| e.to_string())?;
        let memory =
            memory_from(&mut reader, bytes, "muster-snapshot").map_err(|e| e.to_string())?;
        parts.push((rank, memory, bytes));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_listener_round_trips_and_garbage_is_none() {
        let listening = Listening {
            addr: "10.0.0.7:41234".parse().unwrap(),
            token: [0xab; 16],
        };
        assert_eq!(
            Listening::decode(listening.encode().as_bytes()).map(|l| (l.addr, l.token)),
            Some((listening.addr, listening.token))
        );
        for bad in [
            "",
            "10.0.0.7:1",
            "nonsense abab",
            "10.0.0.7:1 zz",
            "10.0.0.7:1 abab",
        ] {
            assert!(Listening::decode(bad.as_bytes()).is_none(), "{bad}");
        }
    }
}
