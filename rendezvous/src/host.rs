//! How muster's two servers are hosted: the listening socket both bind the same way, and the
//! thread with its own current-thread runtime that each can run on.
//!
//! The store (`muster store`, and node 0's store inside an agent) and the agent's metrics endpoint
//! share these so that `0.0.0.0`, `[::]` and a taken port mean the same thing for both.

use std::future::Future;
use std::io;
use std::net::{Ipv6Addr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};

/// Listen backlog when `/proc/sys/net/core/somaxconn` cannot be read (the kernel's default).
const FALLBACK_BACKLOG: i32 = 4096;

/// Binds a listening TCP socket on `addr`, non-blocking, ready for `TcpListener::from_std`.
///
/// - An unspecified address (`0.0.0.0` or `[::]`) listens dual-stack on `[::]` where the host has
///   IPv6 (IPv4 peers then appear as `::ffff:a.b.c.d`), as libuv's `UvTcpServer` does. Without
///   IPv6, `0.0.0.0` falls back to IPv4 only; `[::]` was an explicit request for IPv6 and fails.
///   A taken port fails at once: that is the answer, not a reason to try IPv4 alone.
/// - Any other IPv6 address listens on IPv6 only.
/// - `SO_REUSEADDR`: a restarted agent or store takes its port back while old connections sit in
///   TIME_WAIT.
/// - Backlog `somaxconn`, the most the kernel allows: both servers accept as fast as connections
///   come and decide admission after the accept, so the backlog only absorbs bursts, and a large
///   one keeps a burst from dropping a kubelet probe's SYN.
pub fn bind_listener(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    if addr.ip().is_unspecified() {
        let v6 = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), addr.port());
        match listen(v6, true) {
            Ok(listener) => return Ok(listener),
            Err(err) if addr.is_ipv6() || err.kind() == io::ErrorKind::AddrInUse => {
                return Err(err)
            }
            Err(_) => {}
        }
    }
    listen(addr, false)
}

fn listen(addr: SocketAddr, dual_stack: bool) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(!dual_stack)?;
    }
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(somaxconn())?;
    Ok(socket.into())
}

fn somaxconn() -> i32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(FALLBACK_BACKLOG)
}

/// Runs the future that `serve` makes on a new thread named `name`, on a current-thread runtime
/// of its own, and returns the thread's handle (whose result is the future's output).
///
/// A server hosted this way never competes with the caller's runtime: a scrape does not take time
/// from supervision, and `/healthz` still answers when the agent's own thread is stuck. For the
/// store, one thread is also what keeps requests in arrival order across connections (see
/// [`crate::store::server`]). The runtime is built on the calling thread, so failing to build it
/// is reported here rather than lost on the new thread. `serve` is called on the new thread, so
/// what it makes need not be `Send`.
pub fn spawn_runtime_thread<F, Fut>(
    name: String,
    serve: F,
) -> io::Result<std::thread::JoinHandle<Fut::Output>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future,
    Fut::Output: Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(name)
        .spawn(move || runtime.block_on(serve()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unspecified_address_is_reachable_over_ipv4_loopback() {
        let listener = bind_listener(SocketAddr::from(([0, 0, 0, 0], 0))).unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(false).unwrap();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (_, peer) = listener.accept().unwrap();
        assert_eq!(peer.ip().to_canonical(), client.local_addr().unwrap().ip());
    }

    #[test]
    fn a_taken_port_is_refused_and_a_freed_one_rebound() {
        let first = bind_listener(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let addr = first.local_addr().unwrap();
        let err = bind_listener(addr).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        let any = SocketAddr::from(([0, 0, 0, 0], addr.port()));
        assert_eq!(
            bind_listener(any).unwrap_err().kind(),
            io::ErrorKind::AddrInUse,
            "the dual-stack socket's AddrInUse is the answer, not a reason to try IPv4 alone"
        );
        drop(first);
        bind_listener(addr).expect("the port is free again");
    }

    #[test]
    fn a_runtime_thread_runs_its_future_and_returns_its_output() {
        let handle = spawn_runtime_thread("host-test".to_owned(), || async {
            tokio::task::yield_now().await;
            std::thread::current().name().map(str::to_owned)
        })
        .unwrap();
        assert_eq!(handle.join().unwrap().as_deref(), Some("host-test"));
    }
}
