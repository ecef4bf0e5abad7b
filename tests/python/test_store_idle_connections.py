"""10,000 idle connections to `muster store` while other clients keep being served.

The descriptor limit is raised for both sides: the store runs under `ulimit -n` in bash, this
process raises its own soft limit (and the hard one where it may).
"""

import os
import resource
import socket
import struct
import subprocess
import time

import pytest

from conftest import StoreProcess, muster_bin, stop_process

IDLE = 10_000
MAGIC = 0x3C85F7CE


def _raise_nofile(want):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError):
        if hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want} and cannot be raised here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _hello(nonce):
    return b"\x00" + struct.pack("<I", MAGIC) + b"\x0d" + struct.pack("<I", nonce)


def _recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise AssertionError("connection closed")
        buf += chunk
    return buf


def _add(s, key, delta):
    s.sendall(b"\x04" + struct.pack("<Q", len(key)) + key + struct.pack("<q", delta))
    return struct.unpack("<q", _recv_exact(s, 8))[0]


@pytest.mark.timeout(180)
def test_ten_thousand_idle_connections():
    _raise_nofile(IDLE + 2048)
    proc = subprocess.Popen(
        ["bash", "-c", f'ulimit -n {IDLE + 4096} 2>/dev/null || ulimit -n "$(ulimit -Hn)"; '
                       f'exec "$0" store --host 127.0.0.1 --port 0', muster_bin()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    idle = []
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        port = int(line.strip().rsplit(":", 1)[-1])
        active = socket.create_connection(("127.0.0.1", port), timeout=10)
        active.sendall(_hello(1))
        assert _recv_exact(active, 4) == struct.pack("<I", 1)
        t0 = time.monotonic()
        for i in range(IDLE):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                s.sendall(_hello(i))  # half validated, half never said anything
            idle.append(s)
            if i % 1000 == 999:
                # the active client keeps being served while the idle crowd grows
                assert _add(active, b"/progress", 1) == (i + 1) // 1000
        connect_s = time.monotonic() - t0
        for i in range(1, IDLE, 2):
            assert _recv_exact(idle[i], 4) == struct.pack("<I", i)
        t1 = time.monotonic()
        for n in range(1, 1001):
            assert _add(active, b"/busy", 1) == n
        per_op = (time.monotonic() - t1) / 1000
        assert per_op < 0.005, f"{per_op * 1e6:.0f} µs per ADD with {IDLE} idle connections"
        fresh = socket.create_connection(("127.0.0.1", port), timeout=10)
        fresh.sendall(_hello(77))
        assert _recv_exact(fresh, 4) == struct.pack("<I", 77)
        assert _add(fresh, b"/busy", 0) == 1000
        fresh.close()
        assert proc.poll() is None, "muster store died"
        print(f"{IDLE} idle connections in {connect_s:.2f}s; {per_op * 1e6:.0f} µs per ADD")
    finally:
        for s in idle:
            s.close()
        stop_process(proc, 10)


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of stat(5); [0] here is field 3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(60)
def test_busy_poll_costs_nothing_idle_and_a_bounded_amount_per_burst():
    """The default busy poll (100 µs after the last request) must never turn into a spinning
    idle server: no CPU while nobody talks, and for sparse requests at most the window each."""
    store = StoreProcess()
    try:
        s = socket.create_connection(("127.0.0.1", store.port), timeout=10)
        s.sendall(_hello(5))
        assert _recv_exact(s, 4) == struct.pack("<I", 5)
        time.sleep(0.3)
        before = _cpu_seconds(store.proc.pid)
        time.sleep(2)
        idle = _cpu_seconds(store.proc.pid) - before
        assert idle <= 0.03, f"idle store used {idle:.2f} s of CPU in 2 s"

        # 100 lone requests, 20 ms apart: each costs its service time plus at most 100 µs of
        # polling; a poller that never stopped would cost the whole 2 s.
        before = _cpu_seconds(store.proc.pid)
        for n in range(1, 101):
            assert _add(s, b"/sparse", 1) == n
            time.sleep(0.02)
        sparse = _cpu_seconds(store.proc.pid) - before
        assert sparse < 0.3, f"100 sparse requests cost {sparse:.2f} s of CPU"
        print(f"idle: {idle:.2f} s CPU in 2 s; 100 sparse requests: {sparse:.3f} s CPU")
        s.close()
    finally:
        assert store.stop() == 0


@pytest.mark.timeout(60)
def test_busy_poll_flag_is_honoured_and_checked():
    for flags in (["--busy-poll-us", "0"], ["--busy-poll-us", "500"]):
        store = StoreProcess(flags)
        try:
            clients = []
            for i in range(3):
                c = socket.create_connection(("127.0.0.1", store.port), timeout=10)
                c.sendall(_hello(i))
                assert _recv_exact(c, 4) == struct.pack("<I", i)
                clients.append(c)
            for n, c in enumerate(clients, start=1):
                assert _add(c, b"/n", 1) == n, flags
            for c in clients:
                c.close()
        finally:
            assert store.stop() == 0, flags
    bad = subprocess.run([muster_bin(), "store", "--busy-poll-us", "soon"], capture_output=True, text=True, timeout=10)
    assert bad.returncode == 202 and "busy-poll-us" in bad.stderr, (bad.returncode, bad.stderr)


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(l for l in f if l.startswith("VmRSS:")).split()[1])


def _closed_at_once(s, timeout=5):
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.timeout(120)
def test_a_hostile_client_meets_the_request_limits_and_the_connection_cap():
    """The bounds docs/store.md § "A hostile client on the pod network" states: a length over the
    protocol's limits (key 8 KiB, value 8 MiB, 131,072 keys) or a first message that is not
    VALIDATE closes the connection before anything is allocated for it; connections beyond
    --max-connections are closed at once, the ones inside keep being served, and the store
    serves new clients again once the crowd leaves."""
    store = StoreProcess(["--max-connections", "64"])
    pid = store.proc.pid
    addr = ("127.0.0.1", store.port)
    try:
        active = socket.create_connection(addr, timeout=10)
        active.sendall(_hello(1))
        assert _recv_exact(active, 4) == struct.pack("<I", 1)
        before = _rss_kib(pid)
        hostile = [
            b"\x03" + struct.pack("<Q", 1) + b"k",                        # GET before VALIDATE
            _hello(2) + b"\x01" + struct.pack("<Q", 1 << 62),             # SET, key of 2^62 bytes
            _hello(3) + b"\x01" + struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 1 << 40),
            _hello(4) + b"\x01" + struct.pack("<Q", 8 * 1024 + 1),        # key 8 KiB + 1
            _hello(5) + b"\x0a" + struct.pack("<Q", 1 << 40),             # MULTI_GET of 2^40 keys
        ]
        for payload in hostile:
            s = socket.create_connection(addr, timeout=10)
            s.sendall(payload)
            # The VALIDATE+PING reply may come first; then the close.
            s.settimeout(5)
            data = b""
            try:
                while chunk := s.recv(64):
                    data += chunk
            except ConnectionResetError:
                pass
            assert len(data) <= 4, data
            s.close()
        grown = _rss_kib(pid) - before
        assert grown < 8 * 1024, f"the store grew by {grown} KiB on lengths it refused"

        # The connection cap: 63 more fill it (with `active`), the rest are closed at once.
        held = [socket.create_connection(addr, timeout=10) for _ in range(63)]
        time.sleep(0.5)
        extra = [socket.create_connection(addr, timeout=10) for _ in range(16)]
        assert all(_closed_at_once(s) for s in extra), "connections beyond the cap were kept"
        assert _add(active, b"/still", 1) == 1, "a client inside the cap is still served"
        late = socket.create_connection(addr, timeout=10)
        late.sendall(_hello(9))
        assert _closed_at_once(late), "a legitimate client beyond the cap is refused too"
        per_conn = (_rss_kib(pid) - before) / len(held)
        for s in held + extra + [late]:
            s.close()
        time.sleep(0.5)
        fresh = socket.create_connection(addr, timeout=10)
        fresh.sendall(_hello(10))
        assert _recv_exact(fresh, 4) == struct.pack("<I", 10)
        assert _add(fresh, b"/still", 1) == 2
        fresh.close()
        active.close()
        print(f"refused lengths grew the store by {grown} KiB; ~{per_conn:.1f} KiB RSS per idle "
              "connection")
    finally:
        assert store.stop() == 0
