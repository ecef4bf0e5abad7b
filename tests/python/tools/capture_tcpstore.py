#!/usr/bin/env python3
"""Captures real TCPStore exchanges (torch client <-> torch server) as byte-exact fixtures.

A logging proxy sits between a real torch 2.15 client and a real torch server (libuv backend by
default, the one muster follows), both in processes of their own; each exchange is one client
connection to a fresh server and is written to `<out>/<name>.txt`:

    # name: what the exchange does
    C> 00 ce f7 85 3c ...      bytes the client sent, in the order seen (one line per segment,
    S> bd 1b 00 00             wrapped at 32 bytes); S> the server's replies
    S> close                   the server closed the connection while the client was still open

Consecutive lines of one direction belong together (a message may span segments). The replay
test (rendezvous/tests/wire.rs) sends the client bytes to muster's server and expects exactly the
server bytes (LIST_KEYS replies compared as a set of keys: the order is the server's hash order).

Re-capture (needs the PyTorch venv, about 30 s):
    PY=$(scripts/torch-venv.sh); $PY tests/python/tools/capture_tcpstore.py tests/fixtures/tcpstore
"""

import argparse
import datetime
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------------
# torch-client exchanges (run in store_client_worker.py; ctx.port is the proxy)


def _client(ctx, timeout=5.0, world_size=None):
    import torch.distributed as dist

    return dist.TCPStore(
        ctx.host, ctx.port, world_size, False, datetime.timedelta(seconds=timeout),
        wait_for_workers=world_size is not None, use_libuv=True,
    )


def _ms(n):
    return datetime.timedelta(milliseconds=n)


def _expect_raise(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the exchange is what matters, not the exception type
        return
    raise AssertionError(f"{fn} did not raise")


def ex_handshake(ctx):
    """VALIDATE + PING, nothing else."""
    _client(ctx)


def ex_set(ctx):
    """SET, no reply."""
    c = _client(ctx)
    c.set("k", "v1")
    c.set("k", b"\x00\xff\x01")
    c.set("empty", b"")
    c.num_keys()  # a reply that proves the SETs were processed


def ex_set_large(ctx):
    """SET of a 5000-byte value: the client sends it in several segments."""
    c = _client(ctx)
    c.set("large", bytes(range(250)) * 20)
    assert len(c.get("large")) == 5000


def ex_get(ctx):
    """get() = WAIT [k] then GET k."""
    c = _client(ctx)
    c.set("k", "v1")
    assert c.get("k") == b"v1"


def ex_get_missing_timeout(ctx):
    """get() of a missing key: WAIT, timeout, CANCEL_WAIT answered 01."""
    c = _client(ctx, timeout=0.2)
    _expect_raise(c.get, "missing")
    assert c.add("after", 1) == 1


def ex_add(ctx):
    """ADD with stoll semantics: whitespace, junk, overflow."""
    c = _client(ctx)
    c.add("cnt", 5)
    c.add("cnt", -7)
    c.set("w", "  7")
    c.add("w", 1)
    c.set("j", " 12abc")
    c.add("j", 1)
    c.set("m", str(2**63 - 1))
    c.add("m", 1)
    assert c.get("m") == str(-(2**63)).encode()


def ex_add_non_numeric(ctx):
    """ADD on a non-numeric value: the server closes the connection."""
    c = _client(ctx)
    c.set("nn", "abc")
    _expect_raise(c.add, "nn", 1)


def ex_check(ctx):
    """CHECK answers 0 = ready, 1 = not ready."""
    c = _client(ctx)
    c.check(["k", "missing"])
    c.set("k", "v")
    c.check(["k"])
    c.check(["k", "missing"])


def ex_wait(ctx):
    """WAIT on an existing key (00 at once), then on a missing one with a timeout (CANCEL 01)."""
    c = _client(ctx)
    c.set("k", "v")
    c.wait(["k"])
    c.wait(["k", "k"], _ms(100))
    _expect_raise(c.wait, ["missing"], _ms(100))
    _expect_raise(c.wait, ["k", "missing"], _ms(0))
    c.add("sync", 1)


def ex_num_keys(ctx):
    """GETNUMKEYS counts init/ (sent by a client with a world size)."""
    c = _client(ctx, world_size=1)
    c.num_keys()
    c.set("a", "1")
    c.num_keys()


def ex_compare_set(ctx):
    """COMPARE_SET in all its cases."""
    c = _client(ctx)
    c.compare_set("cs", "", "new")  # missing, empty expected: created
    c.compare_set("cs2", "old", "new")  # missing, non-empty expected: returns expected
    c.compare_set("cs", "new", "newer")  # match: replaced
    c.compare_set("cs", "wrong", "x")  # mismatch: current value
    c.compare_set("cs", "", "y")  # empty expected vs existing value
    c.check(["cs2"])


def ex_multi(ctx):
    """MULTI_SET then multi_get = WAIT ks + MULTI_GET ks."""
    c = _client(ctx)
    c.multi_set(["m1", "m2", "m3"], ["v1", "", "v3"])
    c.multi_get(["m3", "m1", "m2", "m1"])


def ex_delete(ctx):
    """DELETE_KEY answers an i64 count."""
    c = _client(ctx)
    c.set("d", "1")
    c.delete_key("d")
    c.delete_key("d")
    c.num_keys()


def ex_append(ctx):
    """APPEND creates then concatenates."""
    c = _client(ctx)
    c.append("ap", "a")
    c.append("ap", "bc")
    c.get("ap")


def ex_queue(ctx):
    """QUEUE_PUSH / QUEUE_LEN / QUEUE_POP (blocking pop = WAIT + POP; empty non-blocking pop)."""
    c = _client(ctx)
    c.queue_push("q", "a")
    c.queue_push("q", "b")
    c.queue_len("q")
    c.queue_pop("q")
    c.queue_pop("q", False)
    _expect_raise(c.queue_pop, "q", False)
    c.queue_len("q")
    c.check(["q"])
    c.num_keys()


def ex_list_keys(ctx):
    """LIST_KEYS returns raw wire keys including init/ (the client hides it)."""
    c = _client(ctx, world_size=1)
    for k in ("a", "bb", "ccc"):
        c.set(k, "v")
    c.list_keys()


def ex_barrier(ctx):
    """BARRIER: world size 1 passes; world size 2 alone times out (CANCEL), count stays."""
    c = _client(ctx)
    c.barrier("bar", 1)
    _expect_raise(c.barrier, "b2", 2, _ms(100))
    c.get("b2")


def ex_prefix_store(ctx):
    """PrefixStore keys on the wire."""
    import torch.distributed as dist

    c = _client(ctx)
    p = dist.PrefixStore("0/", dist.PrefixStore("default_pg", c))
    p.set("cpu/0", "addr")
    p.get("cpu/0")
    p.add("n", 1)


# ------------------------------------------------------------------------------------------------
# raw-socket exchanges (run here, no torch): what the torch client never sends


def _validate_ping(nonce=0x1BBD):
    return b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x0d" + struct.pack("<I", nonce)


def _key(k):
    return struct.pack("<Q", len(k)) + k


def raw_cancel_without_wait():
    """CANCEL_WAIT with no pending wait is answered 01."""
    return [_validate_ping(), b"\x0c", b"\x07"]


def raw_pipelined():
    """VALIDATE, SET, GET, GETNUMKEYS in one segment: two replies back to back."""
    return [_validate_ping()[:5] + b"\x01" + _key(b"/p") + _key(b"v") + b"\x03" + _key(b"/p")
            + b"\x07"]


def raw_get_missing():
    """A bare GET of a missing key: libuv answers an empty value."""
    return [_validate_ping(), b"\x03" + _key(b"/missing"), b"\x0a" + struct.pack("<Q", 2)
            + _key(b"/missing") + _key(b"/x")]


def raw_unknown_command():
    """An unknown command byte after VALIDATE: connection closed."""
    return [_validate_ping(), b"\x13"]


def raw_wrong_magic():
    """VALIDATE with the wrong magic: no reply; the next message closes the connection."""
    return [b"\x00" + struct.pack("<I", 0xDEADBEEF) + b"\x0d" + struct.pack("<I", 7),
            b"\x0d" + struct.pack("<I", 8)]


def raw_missing_validate():
    """PING without VALIDATE first (libuv holds it back until more bytes arrive)."""
    return [b"\x0d" + struct.pack("<I", 7), b"\x0d" + struct.pack("<I", 8)]


def raw_double_validate():
    """A second VALIDATE: connection closed."""
    return [_validate_ping(), _validate_ping()[:5]]


def raw_oversized_key():
    """A key length over 8 KiB: connection closed (no payload needed)."""
    return [_validate_ping(), b"\x01" + struct.pack("<Q", 8 * 1024 + 1)]


def raw_key_len_max():
    """A key length of u64::MAX: connection closed."""
    return [_validate_ping(), b"\x03" + struct.pack("<Q", 2**64 - 1)]


def raw_oversized_value():
    """A value length over 8 MiB: connection closed."""
    return [_validate_ping(), b"\x01" + _key(b"/v") + struct.pack("<Q", 8 * 1024 * 1024 + 1)]


def raw_too_many_keys():
    """A key count over 131072: connection closed."""
    return [_validate_ping(), b"\x05" + struct.pack("<Q", 128 * 1024 + 1)]


def raw_add_empty_value():
    """ADD on a key holding an empty value: stoll fails, connection closed."""
    return [_validate_ping(), b"\x01" + _key(b"/e") + _key(b""), b"\x04" + _key(b"/e")
            + struct.pack("<q", 1)]


# ------------------------------------------------------------------------------------------------
# the proxy and the driver


class Recording:
    def __init__(self):
        self.lines = []  # (direction, bytes) in arrival order
        self.lock = threading.Lock()
        self.done = threading.Event()

    def add(self, direction, data):
        with self.lock:
            self.lines.append((direction, data))


class Proxy:
    """Accepts client connections and forwards each to the current upstream, recording bytes."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.upstream = None
        self.recordings = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            conn, _ = self.sock.accept()
            rec = Recording()
            self.recordings.append(rec)
            up = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
            for s in (conn, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            state = {"client_closed": False}
            t1 = threading.Thread(target=self._pump, args=(conn, up, rec, "C", state), daemon=True)
            t2 = threading.Thread(target=self._pump, args=(up, conn, rec, "S", state), daemon=True)
            t1.start()
            t2.start()
            threading.Thread(target=self._finish, args=(t1, t2, rec, conn, up), daemon=True).start()

    @staticmethod
    def _pump(src, dst, rec, direction, state):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                if direction == "C":
                    state["client_closed"] = True
                elif not state["client_closed"]:
                    rec.add("S", None)  # the server closed first
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            rec.add(direction, data)
            try:
                dst.sendall(data)
            except OSError:
                pass

    @staticmethod
    def _finish(t1, t2, rec, conn, up):
        t1.join()
        t2.join()
        conn.close()
        up.close()
        rec.done.set()


def fmt(name, doc, rec, version):
    out = [f"# {name}: {doc.strip().splitlines()[0]}",
           f"# captured from torch {version} (libuv server) by tests/python/tools/capture_tcpstore.py"]
    for direction, data in rec.lines:
        if data is None:
            out.append("S> close")
            continue
        for i in range(0, len(data), 32):
            out.append(f"{direction}> " + data[i:i + 32].hex(" "))
    return "\n".join(out) + "\n"


class Line:
    def __init__(self, argv):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  bufsize=1)

    def ask(self, line=None):
        if line is not None:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        return self.p.stdout.readline().strip()


def run_raw(port, chunks):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for chunk in chunks:
        s.sendall(chunk)
        time.sleep(0.1)  # let each reply arrive as its own segment
    s.settimeout(0.5)
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass
    s.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--backend", default="libuv", choices=["libuv", "classic"])
    ap.add_argument("--only", nargs="*", help="capture only these exchanges")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    nodns = str(TOOLS / "nodns.sh")  # keeps c10d's reverse lookups off DNS (see the script)
    host = Line([nodns, py, str(TOOLS / "torch_store_host.py")])
    worker = Line([nodns, py, str(TOOLS / "store_client_worker.py")])
    assert worker.ask() == "ready"
    version = subprocess.run([py, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    proxy = Proxy()
    this = str(Path(__file__).resolve())
    mod = sys.modules[__name__]
    exchanges = [(n, getattr(mod, n)) for n in dir(mod) if n.startswith(("ex_", "raw_"))]
    for name, fn in exchanges:
        if args.only and name.split("_", 1)[1] not in args.only:
            continue
        proxy.upstream = int(host.ask(f"new {args.backend}"))
        before = len(proxy.recordings)
        if name.startswith("ex_"):
            reply = json.loads(worker.ask(json.dumps(
                {"file": this, "func": name, "ctx": {"host": "127.0.0.1", "port": proxy.port}})))
            if not reply["ok"]:
                raise SystemExit(f"{name} failed:\n{reply['error']}")
        else:
            run_raw(proxy.port, fn())
        recs = proxy.recordings[before:]
        if len(recs) != 1 or not recs[0].done.wait(10):
            raise SystemExit(f"{name}: expected one finished connection, got {len(recs)}")
        short = name.split("_", 1)[1]
        (args.out / f"{short}.txt").write_text(fmt(short, fn.__doc__, recs[0], version))
        host.ask(f"close {proxy.upstream}")
        print(f"captured {short}", file=sys.stderr)


if __name__ == "__main__":
    main()
