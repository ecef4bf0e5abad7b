//! A Unix `SOCK_SEQPACKET` socket on tokio: one message per packet, each with at most one file
//! descriptor riding along (`SCM_RIGHTS`). Packets keep a descriptor with the words that name it,
//! which a byte stream would not.
//!
//! Unsafe code, each block with its reason: taking ownership of descriptors the kernel just made
//! for us (`accept4`, `SCM_RIGHTS`), and registering them with tokio, which needs a descriptor
//! that stays open while registered (the [`AsyncFd`] owns it, so it does).
#![allow(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag,
    SockType, UnixAddr,
};
use tokio::io::unix::AsyncFd;

/// A message longer than this is no message of the protocol.
pub const MAX_MESSAGE: usize = 1024;

/// A listening socket at an abstract address.
pub struct Listener(AsyncFd<OwnedFd>);

/// One accepted connection.
pub struct Connection(AsyncFd<OwnedFd>);

/// A packet received: its words and the descriptor it carried.
#[derive(Debug)]
pub struct Packet {
    pub text: String,
    pub memory: Option<OwnedFd>,
}

fn io_error(e: nix::Error) -> io::Error {
    io::Error::from(e)
}

fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns the descriptor, so it stays open for as long as it is registered.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

impl Listener {
    /// Listens on the abstract name `name` (no file; scoped to the network namespace).
    pub fn bind_abstract(name: &str) -> io::Result<Listener> {
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(io_error)?;
        let addr = UnixAddr::new_abstract(name.as_bytes()).map_err(io_error)?;
        socket::bind(fd.as_raw_fd(), &addr).map_err(io_error)?;
        socket::listen(&fd, Backlog::new(64).map_err(io_error)?).map_err(io_error)?;
        Ok(Listener(register(fd)?))
    }

    pub async fn accept(&self) -> io::Result<Connection> {
        loop {
            let mut ready = self.0.readable().await?;
            let accepted = ready.try_io(|fd| {
                socket::accept4(
                    fd.get_ref().as_raw_fd(),
                    SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                )
                .map_err(io_error)
            });
            if let Ok(result) = accepted {
                // SAFETY: accept4 returned a fresh descriptor that nothing else owns.
                let fd = unsafe { OwnedFd::from_raw_fd(result?) };
                return Ok(Connection(register(fd)?));
            }
        }
    }
}

impl Connection {
    /// Connects to the abstract name `name` (the worker's end, for tests).
    pub fn connect_abstract(name: &str) -> io::Result<Connection> {
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(io_error)?;
        let addr = UnixAddr::new_abstract(name.as_bytes()).map_err(io_error)?;
        socket::connect(fd.as_raw_fd(), &addr).map_err(io_error)?;
        Ok(Connection(register(fd)?))
    }

    /// The peer's user id (`SO_PEERCRED`).
    pub fn peer_uid(&self) -> io::Result<u32> {
        let credentials = socket::getsockopt(self.0.get_ref(), socket::sockopt::PeerCredentials)
            .map_err(io_error)?;
        Ok(credentials.uid())
    }

    /// The next packet; `None` when the peer closed. A packet cut short (too long, or more
    /// descriptors than one) is an error: its descriptors are closed.
    pub async fn recv(&self) -> io::Result<Option<Packet>> {
        loop {
            let mut ready = self.0.readable().await?;
            if let Ok(result) = ready.try_io(|fd| receive(fd.get_ref().as_raw_fd())) {
                return result;
            }
        }
    }

    /// Sends `text` as one packet, with `memory` riding along.
    pub async fn send(&self, text: &str, memory: Option<BorrowedFd<'_>>) -> io::Result<()> {
        loop {
            let mut ready = self.0.writable().await?;
            if let Ok(result) =
                ready.try_io(|fd| transmit(fd.get_ref().as_fd(), text.as_bytes(), memory))
            {
                return result;
            }
        }
    }
}

fn receive(fd: RawFd) -> io::Result<Option<Packet>> {
    let mut buffer = [0u8; MAX_MESSAGE];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (bytes, flags, fds) = {
        let mut iov = [IoSliceMut::new(&mut buffer)];
        let message =
            socket::recvmsg::<()>(fd, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
                .map_err(io_error)?;
        let mut fds = Vec::new();
        for control in message.cmsgs().map_err(io_error)? {
            if let ControlMessageOwned::ScmRights(received) = control {
                // SAFETY: the kernel installed these descriptors for us; nothing else owns them.
                fds.extend(
                    received
                        .into_iter()
                        .map(|f| unsafe { OwnedFd::from_raw_fd(f) }),
                );
            }
        }
        (message.bytes, message.flags, fds)
    };
    if flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) || fds.len() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a packet over {MAX_MESSAGE} bytes or with more than one descriptor"),
        ));
    }
    if bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    let text = std::str::from_utf8(&buffer[..bytes])
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a packet that is not UTF-8"))?
        .trim_end()
        .to_owned();
    Ok(Some(Packet {
        text,
        memory: fds.into_iter().next(),
    }))
}

fn transmit(fd: BorrowedFd<'_>, data: &[u8], memory: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let iov = [IoSlice::new(data)];
    let fds: Vec<RawFd> = memory.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&fds)];
    let controls: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    socket::sendmsg::<()>(fd.as_raw_fd(), &iov, controls, MsgFlags::MSG_NOSIGNAL, None)
        .map_err(io_error)?;
    Ok(())
}
