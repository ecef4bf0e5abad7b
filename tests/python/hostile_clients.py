"""Hostile HTTP clients for the probe-starvation test (issue #18), run as their own process so
that their CPU does not run inside the prober's interpreter.

From one source address (bound before connect, so the server sees another peer than the prober)
it keeps PER_KIND connections of each of four kinds open against the target, for SECONDS:

- idle: connects and never sends a byte;
- slow: sends a request head one byte per second;
- oversized: sends a 16 KiB header line (over the server's 8 KiB head limit), then reads what
  comes back;
- churn: connects and closes as fast as it can.

Whenever the server closes one, it is replaced at once, which is what a determined attacker does.
At the end it writes counters (connections opened and closed by the server, per kind) as JSON.

    python hostile_clients.py HOST:PORT SOURCE_IP PER_KIND SECONDS STATS.json
"""

import errno
import json
import resource
import selectors
import socket
import sys
import time

IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
KINDS = ("idle", "slow", "oversized", "churn")
SLOW_HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
OVERSIZED = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"b" * 16384 + b"\r\n\r\n"


def raise_fd_limit(need):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


class Conn:
    __slots__ = ("sock", "kind", "connected", "sent", "opened")

    def __init__(self, sock, kind):
        self.sock, self.kind = sock, kind
        self.connected = False
        self.sent = 0
        self.opened = time.monotonic()


def main():
    target, source, per_kind, seconds, stats_path = sys.argv[1:6]
    host, port = target.rsplit(":", 1)
    addr = (host, int(port))
    per_kind, seconds = int(per_kind), float(seconds)
    raise_fd_limit(4 * per_kind + 256)
    sel = selectors.DefaultSelector()
    stats = {k: {"opened": 0, "closed_by_server": 0, "connect_errors": 0, "bytes_read": 0}
             for k in KINDS}
    stats["statuses"] = {}
    live = {k: set() for k in KINDS}

    def open_one(kind):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        except OSError:
            pass
        try:
            sock.bind((source, 0))
            err = sock.connect_ex(addr)
        except OSError:
            sock.close()
            stats[kind]["connect_errors"] += 1
            return False
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            stats[kind]["connect_errors"] += 1
            return False
        conn = Conn(sock, kind)
        live[kind].add(conn)
        stats[kind]["opened"] += 1
        sel.register(sock, selectors.EVENT_WRITE, conn)
        return True

    def close(conn, by_server):
        try:
            sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        live[conn.kind].discard(conn)
        if by_server:
            stats[conn.kind]["closed_by_server"] += 1

    def on_connected(conn):
        conn.connected = True
        if conn.kind == "churn":
            close(conn, by_server=False)
            return
        if conn.kind == "oversized":
            try:
                conn.sock.send(OVERSIZED)
            except OSError:
                close(conn, by_server=True)
                return
        sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def on_readable(conn):
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            close(conn, by_server=True)
            return
        if not data:
            close(conn, by_server=True)
            return
        stats[conn.kind]["bytes_read"] += len(data)
        if data.startswith(b"HTTP/1.1 "):
            code = data[9:12].decode("ascii", "replace")
            stats["statuses"][code] = stats["statuses"].get(code, 0) + 1

    start = time.monotonic()
    next_trickle = start + 1.0
    while time.monotonic() - start < seconds:
        for kind in KINDS:
            missing = per_kind - len(live[kind])
            for _ in range(missing):
                if not open_one(kind):
                    break
        for key, events in sel.select(timeout=0.01):
            conn = key.data
            if conn not in live[conn.kind]:
                continue
            if not conn.connected:
                err = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    stats[conn.kind]["connect_errors"] += 1
                    close(conn, by_server=False)
                    continue
                on_connected(conn)
            elif events & selectors.EVENT_READ:
                on_readable(conn)
        now = time.monotonic()
        if now >= next_trickle:
            next_trickle = now + 1.0
            for conn in list(live["slow"]):
                if conn.connected and conn.sent < len(SLOW_HEAD):
                    try:
                        conn.sock.send(SLOW_HEAD[conn.sent:conn.sent + 1])
                        conn.sent += 1
                    except OSError:
                        close(conn, by_server=True)
    stats["held_at_end"] = {k: len(v) for k, v in live.items()}
    for kind in KINDS:
        for conn in list(live[kind]):
            close(conn, by_server=False)
    with open(stats_path, "w") as f:
        json.dump(stats, f)


if __name__ == "__main__":
    main()
