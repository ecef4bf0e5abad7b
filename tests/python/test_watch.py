"""Hang detection with real PyTorch (gloo): a rank that stops progressing is found from its step
reports, every rank's stacks are dumped on every node, and the gang restarts (or exits 207 once
--max-restarts is spent, the summary naming node, rank and frame). Ranks that finished early or
work inside a declared section are not hung."""

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from conftest import free_port, muster_bin, muster_env

CONF = "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3"
HANG_TIMEOUT = 3

WORKER = r'''
import os, time
import torch
import torch.distributed as dist
import muster_checkpoint

dist.init_process_group("gloo")
ckpt = muster_checkpoint.Checkpointer()
rank = dist.get_rank()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
hang_rank = int(os.environ.get("HANG_RANK", "-1"))
hang_attempts = int(os.environ.get("HANG_ATTEMPTS", "1"))


def stuck_in_data_loader():
    print(f"HANGING rank={rank} at={time.time():.3f}", flush=True)
    while True:
        time.sleep(0.05)


for step in range(int(os.environ.get("STEPS", "25"))):
    ckpt.should_save(step)
    if rank == hang_rank and step == 15 and restart < hang_attempts:
        stuck_in_data_loader()
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.02)
print(f"DONE rank={rank} restart={restart}", flush=True)
dist.destroy_process_group()
'''

# No collectives: rank 0 finishes after 3 steps; rank 1 goes on well past the hang limit, part
# of it inside a declared section longer than the limit.
EARLY = r'''
import os, time
import muster_checkpoint

ckpt = muster_checkpoint.Checkpointer()
rank = int(os.environ["RANK"])
if rank == 0:
    for step in range(3):
        ckpt.should_save(step)
        time.sleep(0.05)
else:
    for step in range(120):
        ckpt.should_save(step)
        time.sleep(0.05)
        if step == 10:
            with ckpt.section("eval"):
                time.sleep(2.5 * float(os.environ["HANG_TIMEOUT"]))
print(f"DONE rank={rank}", flush=True)
'''


class Agent:
    """One muster process; its output lines with the time each arrived."""

    def __init__(self, args, env):
        self.proc = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def text(self):
        return "".join(line for _, line in self.lines)

    def first(self, pattern):
        for at, line in self.lines:
            if re.search(pattern, line):
                return at
        return None

    def finish(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.reader.join(timeout=10)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def gang(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    started = []

    def start(max_restarts, extra_env=None):
        port = free_port()
        for node in range(2):
            args = [muster_bin(), "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-id", "watch", "--local-addr", "127.0.0.1", "--rdzv-conf", CONF,
                    "--node-rank", str(node), "--max-restarts", str(max_restarts),
                    "--hang-timeout", str(HANG_TIMEOUT), "--metrics-addr", "none",
                    "--gpu-release-timeout", "0", "--shutdown-timeout", "5", str(script)]
            env = muster_env({"HANG_RANK": "3", **(extra_env or {})})
            started.append(Agent(args, env))
        return started

    yield start
    for agent in started:
        agent.kill()


def check_the_hang_was_caught(agents, both):
    """Detection within the limit + 5 s; the hung function in the log; all four ranks' stacks."""
    hanging = agents[1].first(r"HANGING rank=3")
    assert hanging is not None, both
    detected = [a.first(r"hang detected on node") for a in agents]
    detected = min(t for t in detected if t is not None)
    # The proof's bound: the limit plus 5 s for the poll and the report latency.
    assert detected - hanging <= HANG_TIMEOUT + 5, f"detected {detected - hanging:.1f} s later\n{both}"
    assert "stuck_in_data_loader" in agents[1].text(), both
    for rank in range(4):
        assert re.search(rf"muster: stacks of rank {rank} \(local rank \d, pid \d+\), read with py-spy", both), (rank, both)
    # The waiting ranks were caught inside torch.distributed's all_reduce.
    assert re.search(r"\[\S+:0\]\s+all_reduce \(\S*torch/distributed/distributed_c10d\.py:\d+\)", both), both


def test_a_hung_rank_is_named_dumped_and_the_gang_restarts(gang):
    agents = gang(max_restarts=1)
    codes = [a.finish(180) for a in agents]
    both = agents[0].text() + "\n----- node 1 -----\n" + agents[1].text()
    assert codes == [0, 0], both
    check_the_hang_was_caught(agents, both)
    assert re.search(r"rank 3 \(local rank 1\) on node 1 \(\S+\) made no progress for [\d.]+ s "
                     r"\(last step 15; limit 3 s\), stuck in stuck_in_data_loader", both), both
    assert re.search(r"node 1: cause hang: rank 3 .*; restarting the gang \(restart 1 of 1\)",
                     agents[1].text()), both
    for rank in range(4):
        assert f"DONE rank={rank} restart=1" in both, both


def test_a_hang_with_the_budget_spent_exits_207_naming_node_rank_and_frame(gang):
    agents = gang(max_restarts=0)
    codes = [a.finish(180) for a in agents]
    both = agents[0].text() + "\n----- node 1 -----\n" + agents[1].text()
    assert codes == [207, 207], both
    check_the_hang_was_caught(agents, both)
    summary = agents[1].text()
    assert "worker group hung after 1 attempt(s)" in summary, both
    assert re.search(r"node: 1 \(\S+\)  rank: 3 \(local_rank 1\)", summary), both
    assert re.search(r"last step: 15  no progress for [\d.]+ s \(limit 3 s\)", summary), both
    assert re.search(r"innermost frame: stuck_in_data_loader \(\S+worker\.py:\d+\)", summary), both


def test_an_early_finisher_and_a_long_section_are_not_hangs(tmp_path):
    script = tmp_path / "early.py"
    script.write_text(EARLY)
    agent = Agent([muster_bin(), "--nproc-per-node", "2", "--hang-timeout", "2",
                   "--section-timeout", "60", "--metrics-addr", "none", str(script)],
                  muster_env({"HANG_TIMEOUT": "2"}))
    try:
        code = agent.finish(120)
    finally:
        agent.kill()
    text = agent.text()
    assert code == 0, text
    assert "DONE rank=0" in text and "DONE rank=1" in text, text
    assert "hang detected" not in text, text


def test_without_record_the_summary_shows_the_exception_line_of_stderr(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('not an exception: ValueError: in a log line', file=sys.stderr)\n"
        "    def load():\n"
        "        raise ValueError('batch 7 has no labels')\n"
        "    load()\n")
    p = subprocess.run([muster_bin(), "--nproc-per-node", "2", "--metrics-addr", "none", str(script)],
                       env=muster_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "muster:   error: ValueError: batch 7 has no labels\n" in p.stderr, p.stderr


# ---- on-demand stacks: `muster stacks` and GET /debug/stacks -------------------------------

PARKED = r'''
import os, time
import muster_checkpoint

ckpt = muster_checkpoint.Checkpointer()
rank = int(os.environ["RANK"])


def parked_for_an_operator():
    print(f"PARKED rank={rank}", flush=True)
    for step in range(3000):
        ckpt.should_save(step)
        time.sleep(0.05)


parked_for_an_operator()
'''


def global_ipv4():
    """This machine's first non-loopback IPv4 address, used as a request's SOURCE towards
    127.0.0.1 (nothing but loopback is targeted; the agent still sees a non-loopback peer)."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    return match.group(1) if match else None


def get_status(port, path, source=None):
    import socket
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(30)
    try:
        if source:
            sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_muster_stacks_prints_every_local_ranks_stacks_now(tmp_path):
    script = tmp_path / "parked.py"
    script.write_text(PARKED)
    port = free_port()
    agent = Agent([muster_bin(), "--nproc-per-node", "2", "--metrics-addr", f"0.0.0.0:{port}",
                   str(script)], muster_env())
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not all(agent.first(f"PARKED rank={r}") for r in (0, 1)):
            assert agent.proc.poll() is None, agent.text()
            time.sleep(0.1)
        assert all(agent.first(f"PARKED rank={r}") for r in (0, 1)), agent.text()

        # The flag, and the agent's own variable.
        for how, extra in (("flag", ["--metrics-addr", f"0.0.0.0:{port}"]), ("env", [])):
            env = muster_env({"MUSTER_METRICS_ADDR": f":{port}"} if how == "env" else None)
            p = subprocess.run([muster_bin(), "stacks", *extra], env=env, capture_output=True,
                               text=True, timeout=90)
            assert p.returncode == 0, (how, p.stdout, p.stderr)
            for rank in (0, 1):
                assert re.search(rf"muster: stacks of rank {rank} \(local rank {rank}, pid \d+\), "
                                 r"read with py-spy:", p.stdout), (how, p.stdout)
            assert re.search(r"parked_for_an_operator \(\S+parked\.py:\d+\)", p.stdout), p.stdout
            assert "(main), most recent call first:" in p.stdout, p.stdout

        # Loopback only: a peer from another address is refused, and nothing is read.
        source = global_ipv4()
        if source is not None:
            status, body = get_status(port, "/debug/stacks", source=source)
            assert status == 403, body
            assert "only answered inside the pod" in body, body
            assert get_status(port, "/healthz", source=source)[0] == 200
        # The job keeps running through all of it.
        assert agent.proc.poll() is None, agent.text()
        assert "hang detected" not in agent.text(), agent.text()
    finally:
        agent.kill()

    # No agent listening: a message and exit 1, not a traceback.
    p = subprocess.run([muster_bin(), "stacks", "--metrics-addr", f"127.0.0.1:{free_port()}"],
                       env=muster_env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stderr.startswith("muster: error: cannot ask the agent at 127.0.0.1:"), p.stderr


# ---- the faulthandler fallback, end to end -------------------------------------------------


def test_without_py_spy_the_stacks_come_from_faulthandler_through_the_helper(tmp_path):
    """MUSTER_TEST_NO_PYSPY stands in for a rank whose memory cannot be read (a seccomp profile
    without process_vm_readv): the helper's faulthandler registration answers instead."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    agent = Agent([muster_bin(), "--nproc-per-node", "2", "--hang-timeout", str(HANG_TIMEOUT),
                   "--max-restarts", "0", "--metrics-addr", "none", "--shutdown-timeout", "5",
                   str(script)],
                  muster_env({"HANG_RANK": "1", "MUSTER_TEST_NO_PYSPY": "1"}))
    try:
        code = agent.finish(180)
    finally:
        agent.kill()
    text = agent.text()
    assert code == 207, text
    for rank in (0, 1):
        assert re.search(rf"muster: stacks of rank {rank} \(local rank {rank}, pid \d+\), "
                         r"read with faulthandler through the helper:", text), (rank, text)
    assert "read with py-spy" not in text, text
    # faulthandler's frames, as the agent parsed them, with the rank's prefix.
    assert re.search(r"\[\S+:1\]\s+stuck_in_data_loader \(\S+worker\.py:\d+\)", text), text
    assert re.search(r"\[\S+:0\]\s+all_reduce \(\S*torch/distributed/distributed_c10d\.py:\d+\)",
                     text), text
    assert "innermost frame: stuck_in_data_loader" in text, text
    assert "stacks: read with faulthandler through the helper; every rank's are in the log" in text, text
