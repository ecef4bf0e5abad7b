"""Snapshots replicated to a buddy node (issue #42): 2 nodes x 1 rank, one pod lost (its agent
and its rank SIGKILLed, a fresh agent for its node rank 2 s later, node 0 included); the fresh
agent fetches its parts from its buddy's replica and every rank restores the same step, bit for
bit, within N + 1 steps of the last step reached. And the replica listener's callers: only an
agent of the job (one that read the listener's token from the job's store) is served; a stranger,
a wrong token, an oversized part or a step nobody holds changes nothing held."""

import re
import subprocess

import pytest

from conftest import muster_bin, muster_env
from test_snapshots import SAME

EVERY = 5

# Reads a key of the agents' own on the job's store, as any rank can.
RAW_GET = """\
import os, socket, struct

def raw_get(key):
    # torch's client puts "/" before every key; the agents' keys have none: VALIDATE, WAIT, GET.
    with socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                                  timeout=30) as s:
        k = key.encode()
        s.sendall(b"\\x00" + struct.pack("<I", 0x3C85F7CE)
                  + b"\\x06" + struct.pack("<QQ", 1, len(k)) + k
                  + b"\\x03" + struct.pack("<Q", len(k)) + k)
        data = b""
        while len(data) < 9 or len(data) < 9 + struct.unpack("<Q", data[1:9])[0]:
            chunk = s.recv(4096)
            assert chunk, "the store closed the connection"
            data += chunk
        return data[9:9 + struct.unpack("<Q", data[1:9])[0]]
"""

# Each rank's state is a pure function of (rank, step): the restored one is checked exactly.
# With HOSTILE=1, rank 0 calls both replica listeners at step 8 the ways a stranger would.
SCRIPT = """\
import os, socket, struct, time
import torch
import torch.distributed as dist
from muster_launcher import snapshot

def state(rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(256, 64, generator=g), "opt": [torch.tensor(step), (step, "adam")]}

""" + SAME + """
def header(token, op, node, attempt, step, parts):
    return (b"MUSTREP1" + token + bytes([op])
            + struct.pack("<IIQIII", node, attempt, step, 2, node, parts))

def answer(sock):
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk

""" + RAW_GET + """
def hostile(attempt):
    prefix = "muster/%s/snapshot/%d/" % (os.environ["TORCHELASTIC_RUN_ID"], attempt)
    for node in (0, 1):
        addr, token = raw_get(prefix + "replica-addr/%d" % node).decode().split()
        host, port = addr.rsplit(":", 1)
        token = bytes.fromhex(token)
        def call(frame):
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
                return answer(s)
        # A stranger: not the protocol at all.
        assert call(b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n" + b"x" * 40) == b""
        # Someone who did not read the store: the wrong token.
        assert call(header(b"\\0" * 16, 1, 1 - node, attempt, 999, 1)) == b""
        # An oversized part from a caller with the token: refused before it is read.
        got = call(header(token, 1, 1 - node, attempt, 999, 1) + struct.pack("<IQ", 1 - node, 1 << 62))
        assert got[:1] == b"\\x01" and b"over the cap" in got, got
        # A step nobody holds.
        got = call(header(token, 2, 1 - node, attempt, 999, 0))
        assert got[:1] == b"\\x01" and b"no part" in got, got
    print("HOSTILE done", flush=True)

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
start = 0
restored = snapshot.restore()
if restored is not None:
    step, got = restored
    assert same(got, state(rank, step)), "restored state differs at step %d" % step
    print("RESTORED %d %d" % (rank, step), flush=True)
    start = step + 1
print("START %d %d" % (rank, start), flush=True)
for step in range(start, 300):
    dist.all_reduce(torch.ones(1))
    print("REACHED %d %d" % (rank, step), flush=True)
    snapshot.save(step, lambda: state(rank, step))
    if step == 8 and rank == 0 and os.environ.get("HOSTILE") == "1" and start == 0:
        hostile(attempt)
    time.sleep(0.05)
print("DONE %d" % rank, flush=True)
dist.destroy_process_group()
"""


def lost_pod(tmp_path, node, hostile):
    script = tmp_path / "replicas.py"
    script.write_text(SCRIPT)
    p = subprocess.run(
        [muster_bin(), "dry-run", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2",
         "--snapshot-every", str(EVERY), "--fault", f"kill:{node}@10", "--replace-after", "2",
         str(script)],
        env=muster_env({"HOSTILE": "1" if hostile else "0", "OMP_NUM_THREADS": "1"}),
        capture_output=True, text=True, timeout=280, cwd=tmp_path)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("node", [1, 0])
def test_a_lost_pod_restores_its_parts_from_its_buddy_within_n_plus_1_steps(tmp_path, node):
    code, out = lost_pod(tmp_path, node, hostile=node == 1)
    assert code == 0, out
    buddy = 1 - node
    fetched = re.search(
        rf"\[node {node}\]  INFO snapshots: fetched this node's parts of step (\d+) from node "
        rf"{buddy}'s replica", out)
    assert fetched, out
    step = int(fetched.group(1))
    assert f"snapshots: attempt 0 restores step {step}, held by every node or its buddy (node {node} from node {buddy}'s replica)" in out, out
    # Both ranks restored that step exactly (the script asserts it) and trained to the end.
    assert sorted(re.findall(r"RESTORED (\d) (\d+)$", out, re.M)) == [
        ("0", str(step)), ("1", str(step))], out
    assert sorted(re.findall(r"DONE (\d)$", out, re.M)) == ["0", "1"], out
    # The survivor's rank printed every step it reached before the loss; the restored step is
    # within N + 1 of the last (steps lost: reached - restored).
    starts = [m.start() for m in re.finditer(rf"START {buddy} \d+$", out, re.M)]
    assert len(starts) == 2, out
    reached = max(int(s) for s in re.findall(rf"REACHED {buddy} (\d+)$", out[:starts[1]], re.M))
    assert 0 <= reached - step <= EVERY + 1, (reached, step, out)
    if node == 1:
        assert out.count("HOSTILE done") == 1, out
        for listener in (0, 1):
            warned = re.findall(rf"\[node {listener}\]  WARN snapshots: closed a replica connection from 127\.0\.0\.1:\d+: (.*)$", out, re.M)
            assert any("bad magic" in w for w in warned), out
            assert any("wrong token" in w for w in warned), out
            assert any("refused" in w and "over the cap" in w for w in warned), out
