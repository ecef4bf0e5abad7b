"""A hostile client cannot grow `muster store` without bound, and a real torch client is served
throughout (docs/store.md § A hostile client on the pod network).

Two attacks, against one store started with `--max-store-bytes 128MiB` and the default 64 MiB
cap on a connection's unread replies:

1. pipelining 2,048 GETs of an 8 MiB value (16 GiB of replies asked for) and reading none;
2. SETting 8 MiB values under fresh keys until the store refuses.

The store's RSS is read from /proc/PID/status (VmRSS) before and during each; the numbers are
printed (run with -s to see them). A torch client in a process of its own sets, gets, adds and
checks in a loop from before the first attack to after the second, and a second torch client
shows what a torch client sees when its own write does not fit.
"""

import json
import os
import re
import socket
import struct
import subprocess
import time

import pytest

from conftest import StoreProcess, muster_bin, torch_python

MAGIC = 0x3C85F7CE
MiB = 1 << 20
VALUE = 8 * MiB  # torch's largest value
STORE_CAP = 128 * MiB
# The store's RSS may grow this much over its baseline in either attack: the cap on one
# connection's unread replies (64 MiB) plus the reply being written (8 MiB), or the store's cap
# (128 MiB); plus the two socket buffers, the value in the receive buffer and allocator slack.
GETS_SLACK = 110 * MiB
FILL_SLACK = STORE_CAP + 48 * MiB

# The well-behaved client: every operation must succeed, before, during and after both attacks.
# Its writes keep their sizes (an overwrite of the same size needs no room, so it is served even
# while the store is full; ADD's counter only grows by a digit now and then).
STEADY = r"""
import datetime, json, os, sys, time
import torch.distributed as dist
host, port, stop_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=30), use_libuv=True)
ops, worst, n = 0, 0.0, 0
while not os.path.exists(stop_file):
    t = time.monotonic()
    n += 1
    store.set("/steady/value", b"%08d" % (n % 10**8))
    assert store.get("/steady/value") == b"%08d" % (n % 10**8)
    assert store.add("/steady/count", 1) == n
    assert store.check(["/steady/value"])
    worst = max(worst, time.monotonic() - t)
    ops += 4
    time.sleep(0.01)
print(json.dumps({"ops": ops, "worst_s": worst}))
"""

# What a torch client sees when its own write does not fit into a full store, and that a fresh
# client is served and can make room again.
FULL = r"""
import datetime, json, sys
import torch.distributed as dist
host, port = sys.argv[1], int(sys.argv[2])
timeout = datetime.timedelta(seconds=10)
client = lambda: dist.TCPStore(host, port, None, False, timeout, use_libuv=True)
store = client()
out = {}
try:
    store.set("/too-much", b"x" * (8 << 20))
    # SET has no reply: the refusal shows on the next call of this client.
    store.get("/steady/value")
    out["refused"] = None
except Exception as e:  # noqa: BLE001
    out["refused"] = f"{type(e).__name__}: {e}".splitlines()[0]
fresh = client()
# torch prefixes every key with "/": the raw client's "/fill/0" is its "fill/0".
out["read_while_full"] = len(fresh.get("fill/0"))
out["deleted"] = fresh.delete_key("fill/0")
fresh.set("/fits-again", b"y" * (8 << 20))
out["written_after_delete"] = len(fresh.get("/fits-again"))
print(json.dumps(out))
"""


def _rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def _key(k):
    return struct.pack("<Q", len(k)) + k


def _hello():
    return b"\x00" + struct.pack("<I", MAGIC)


def _connect(store, rcvbuf=None):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        # Small, so that the kernel soaks up few of the replies this client does not read.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect((store.host, store.port))
    s.sendall(_hello())
    return s


def _num_keys(s):
    s.sendall(b"\x07")
    buf = b""
    while len(buf) < 8:
        chunk = s.recv(8 - len(buf))
        if not chunk:
            return None
        buf += chunk
    return struct.unpack("<q", buf)[0]


def _watch(pid, seconds):
    """Peak RSS over `seconds`."""
    peak = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, _rss(pid))
        time.sleep(0.05)
    return peak


@pytest.mark.timeout(240)
def test_pipelined_gets_and_a_filled_store_leave_memory_bounded(tmp_path):
    store = StoreProcess(["--max-store-bytes", f"{STORE_CAP // MiB}MiB"])
    stop_file = tmp_path / "stop"
    steady = None
    try:
        pid = store.proc.pid
        steady = subprocess.Popen(
            [torch_python(), "-c", STEADY, store.host, str(store.port), str(stop_file)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(3)  # the torch client is up and looping
        assert steady.poll() is None, steady.stderr.read()
        baseline = _rss(pid)

        # Attack 1: 2,048 pipelined GETs of an 8 MiB value, none of the replies read.
        writer = _connect(store)
        writer.sendall(b"\x01" + _key(b"/big") + _key(b"b" * VALUE))
        assert _num_keys(writer) is not None
        with_value = _watch(pid, 1)
        hostile = _connect(store, rcvbuf=64 * 1024)
        hostile.sendall((b"\x03" + _key(b"/big")) * 2048)
        gets_peak = _watch(pid, 8)
        assert steady.poll() is None, steady.stderr.read()
        hostile.close()
        writer.close()
        after_gets = _watch(pid, 2)

        # Attack 2: 8 MiB values under fresh keys until the store refuses.
        filler = _connect(store)
        stored = 0
        for i in range(64):
            try:
                filler.sendall(b"\x01" + _key(b"/fill/%d" % i) + _key(b"f" * VALUE))
                if _num_keys(filler) is None:
                    break
            except OSError:
                break
            stored += 1
        filler.close()
        fill_peak = _watch(pid, 3)
        assert steady.poll() is None, steady.stderr.read()

        # A torch client's own write into the full store, then room made again.
        full = subprocess.run(
            [torch_python(), "-c", FULL, store.host, str(store.port)],
            capture_output=True, text=True, timeout=120,
        )
        assert full.returncode == 0, full.stderr
        seen = json.loads(full.stdout.strip().splitlines()[-1])

        stop_file.touch()
        out, err = steady.communicate(timeout=60)
        assert steady.returncode == 0, f"the well-behaved torch client failed:\n{err}"
        result = json.loads(out.strip().splitlines()[-1])
        assert store.proc.poll() is None, "muster store died"

        print(
            f"\nstore RSS (MiB): baseline {baseline / MiB:.1f}; with one 8 MiB value "
            f"{with_value / MiB:.1f}; pipelined GETs peak {gets_peak / MiB:.1f}, after "
            f"{after_gets / MiB:.1f}; filled ({stored} x 8 MiB stored, cap "
            f"{STORE_CAP // MiB} MiB) peak {fill_peak / MiB:.1f}"
            f"\ntorch client: {result['ops']} ops, worst round {result['worst_s'] * 1e3:.0f} ms"
            f"\ntorch client writing into the full store: {seen['refused']}"
        )
        assert gets_peak - with_value < GETS_SLACK, f"{(gets_peak - with_value) / MiB:.0f} MiB"
        # 128 MiB holds fifteen 8 MiB values with their keys: /big and fourteen more.
        assert stored == 14, stored
        assert fill_peak - baseline < FILL_SLACK, f"{(fill_peak - baseline) / MiB:.0f} MiB"
        assert seen["refused"], "a write past the cap went unnoticed by the torch client"
        assert seen["read_while_full"] == VALUE
        assert seen["deleted"]
        assert seen["written_after_delete"] == VALUE
        assert result["ops"] > 100
    finally:
        stop_file.touch()
        if steady is not None and steady.poll() is None:
            steady.kill()
            steady.wait()
        store.stop()


# A worker filling the agent's own workers' store (MASTER_ADDR:MASTER_PORT) with 1 MiB values.
FILL_WORKER = r"""
import datetime, os
import torch.distributed as dist
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                      datetime.timedelta(seconds=10))
stored = 0
try:
    for i in range(16):
        store.set(f"big/{i}", b"x" * (1 << 20))
        store.num_keys()  # SET has no reply: a refusal shows on the next call
        stored += 1
    print(f"not refused after {stored}", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"refused after {stored}: {type(e).__name__}", flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_agents_store_takes_max_store_bytes(tmp_path, how):
    script = tmp_path / "fill.py"
    script.write_text(FILL_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MUSTER_"))}
    env["PYTHON_EXEC"] = torch_python()
    args = [muster_bin(), "--standalone", "--nproc-per-node", "1", "--metrics-addr", "none"]
    if how == "flag":
        args += ["--max-store-bytes", "4MiB"]
    else:
        env["MUSTER_MAX_STORE_BYTES"] = "4194304"
    p = subprocess.run([*args, str(script)], env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr
    # 4 MiB holds three 1 MiB values with their keys, not four.
    assert "refused after 3: DistNetworkError" in p.stdout, p.stdout + p.stderr
    assert "store full" in p.stderr, p.stderr
