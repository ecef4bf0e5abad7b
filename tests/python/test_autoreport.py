"""Zero-code step reports (python/muster_launcher/autoreport.py): scripts that never import muster's helper
get the hang watch and the step metrics from torch's optimizer step hook, which muster's
sitecustomize installs when the script imports torch.

- A plain DDP loop (gloo on CPU) whose rank blocks is caught by --hang-timeout: stacks dumped,
  the blocked rank named, exit 207, within seconds (torch's own gloo timeout is 30 minutes).
- The same loop evaluating on every rank for 3x the limit, with no optimizer step, is not a hang:
  the rank's stack moves, and the reporter says so.
- A step is a step of the first optimizer that steps (a second optimizer is liveness); a script
  that uses the helper is counted once (its own step numbers); the opt-out turns it all off.
- The reporter itself (no agent, no torch): the lead optimizer, stand-down, never raising.
"""

import importlib
import os
import re
import socket
import sys
import time

import pytest

from conftest import LEAVE_WITHOUT_FINALIZATION, REPO, muster_bin, muster_env, wait_until
from test_watch import Agent

HANG_TIMEOUT = 6

WORKER = r'''
import io, os, sys, threading, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
mode = os.environ["MODE"]
steps = int(os.environ.get("STEPS", "30"))


def evaluate(seconds):
    """What an unmodified script does between optimizer steps: forward passes under no_grad,
    data prepared in Python, a save; no optimizer step for `seconds`."""
    end = time.time() + seconds
    batches = 0
    with torch.no_grad():
        while time.time() < end:
            rows = [[float((i * j) % 7) for j in range(16)] for i in range(64)]
            model.module(torch.tensor(rows)).argmax(dim=1).tolist()
            if batches % 50 == 0:
                torch.save(model.module.state_dict(), io.BytesIO())
            batches += 1
    return batches


for step in range(1, steps + 1):
    loss = model(torch.randn(8, 16)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step == 10 and mode == "block" and rank == 1:
        print(f"BLOCKING rank={rank} at={time.time():.3f}", flush=True)
        threading.Event().wait()
    if step == 10 and mode == "eval":
        print(f"EVAL rank={rank} batches={evaluate(float(os.environ['EVAL_S']))}", flush=True)
    time.sleep(0.02)
print(f"DONE rank={rank}", flush=True)
dist.destroy_process_group()
''' + LEAVE_WITHOUT_FINALIZATION

# One rank, no process group: optimizer steps, then it waits (reporting nothing more) until the
# test has read the agent's metrics.
STEPPER = r'''
import os, sys, time
import torch

steps = int(os.environ["STEPS"])
w = torch.nn.Parameter(torch.ones(4))
g = torch.nn.Parameter(torch.ones(4))
lead = torch.optim.SGD([w], lr=0.01)
# A GAN's second optimizer: its steps are liveness, not steps.
second = torch.optim.SGD([g], lr=0.01)
ckpt = None
if os.environ.get("EXPLICIT"):
    import muster_checkpoint
    ckpt = muster_checkpoint.Checkpointer()
    assert ckpt.active
for i in range(steps):
    for opt, p in ((lead, w), (second, g)):
        opt.zero_grad()
        (p * 2).sum().backward()
        opt.step()
    if ckpt is not None:
        ckpt.should_save(1000 + i)
from muster_launcher import autoreport
r = autoreport._reporter
print(f"REPORTER installed={r is not None} reporting={r is not None and not r._off} "
      f"counted={r._step if r is not None else 0}", flush=True)
deadline = time.time() + 120
while not os.path.exists(os.environ["RELEASE"]) and time.time() < deadline:
    time.sleep(0.05)
'''


def ddp(tmp_path, mode, extra_env=None, extra_args=()):
    script = tmp_path / "plain_ddp.py"
    script.write_text(WORKER)
    args = ["--standalone", "--nproc-per-node", "2", "--hang-timeout", str(HANG_TIMEOUT),
            "--max-restarts", "0", "--metrics-addr", "none", "--gpu-release-timeout", "0",
            "--shutdown-timeout", "5", *extra_args, str(script)]
    return Agent([muster_bin(), *args], muster_env({"MODE": mode, **(extra_env or {})}))


def test_a_plain_ddp_loop_whose_rank_blocks_is_caught_named_and_dumped(tmp_path):
    run = ddp(tmp_path, "block")
    try:
        code = run.finish(timeout=180)
    finally:
        run.kill()
    out = run.text()
    assert code == 207, out
    blocked, detected = run.first(r"BLOCKING rank=1"), run.first(r"hang detected")
    assert blocked is not None and detected is not None, out
    # The limit plus slack for a loaded machine: far below gloo's own 30 minutes.
    assert detected - blocked < HANG_TIMEOUT + 30, out
    assert re.search(r"hang detected on node 0: rank \d \(local rank \d\) made no progress", out), out
    # Every rank's stacks, and rank 1 named: rank 0 waits for it inside DDP's backward.
    assert "stacks of rank 0 (local rank 0" in out and "stacks of rank 1 (local rank 1" in out, out
    assert re.search(r"muster:\s+node: 0 \(\S+\)\s+rank: 1 \(local_rank 1\)", out), out
    assert re.search(r"muster:\s+last step: 10\b", out), out
    assert re.search(r"innermost frame: \S*wait", out), out


def test_a_long_evaluation_without_optimizer_steps_is_not_a_hang(tmp_path):
    run = ddp(tmp_path, "eval", {"EVAL_S": str(3 * HANG_TIMEOUT)})
    try:
        code = run.finish(timeout=240)
    finally:
        run.kill()
    out = run.text()
    assert code == 0, out
    assert "hang detected" not in out, out
    assert len(re.findall(r"EVAL rank=\d batches=\d+", out)) == 2, out
    assert sorted(re.findall(r"DONE rank=(\d)", out)) == ["0", "1"], out


# The plain loop: 20 steps, then a long evaluation whose loop body is one source line (the
# time is spent in one module call: the stack looks the same at every sample), then 20 steps.
# BLOCK=<how> makes rank 1 block at step 20 instead, while rank 0 waits for it in dist.all_reduce.
EVAL_LOOP = r'''
import os, socket, threading, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
# One layer large enough that its matmul is most of a pass: the stack sampler finds the rank in
# the same C call, in frames at the same addresses, at almost every look.
net = torch.nn.Linear(1024, 1024)
model = DDP(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
x = torch.randn(1024, 1024)
mode, block = os.environ.get("MODE", "eval"), os.environ.get("BLOCK", "")


def evaluate(seconds):
    end, passes = time.time() + seconds, 0
    with (torch.inference_mode() if mode == "inference" else torch.no_grad()):
        while time.time() < end: net(x); passes += 1
    return passes


def train(steps):
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


train(20)
if block:
    if rank == 1:
        print(f"BLOCKING rank=1 in={block}", flush=True)
        if block == "lock":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()
        elif block == "read":
            reader, writer = socket.socketpair()
            reader.recv(1)
        elif block == "compute":  # works, never steps: its stack moves
            # Two call sites of one function: the sampler compares the two innermost frames'
            # instructions, and a loop on one line (`sum(genexpr)`) can show the same instruction,
            # in a frame at the same address, at every look on a loaded node.
            def work(n):
                total = 0
                for i in range(n):
                    total += i * i
                return total
            while True:
                work(20000)
                work(20001)
        else:
            raise SystemExit(f"unknown BLOCK={block}")
    else:
        dist.all_reduce(torch.ones(1))
print(f"EVAL rank={rank} passes={evaluate(float(os.environ['EVAL_S']))}", flush=True)
train(20)
print(f"DONE rank={rank}", flush=True)
dist.destroy_process_group()
''' + LEAVE_WITHOUT_FINALIZATION


def eval_loop(tmp_path, env):
    script = tmp_path / "eval_loop.py"
    script.write_text(EVAL_LOOP)
    args = ["--standalone", "--nproc-per-node", "2", "--hang-timeout", str(HANG_TIMEOUT),
            "--max-restarts", "0", "--metrics-addr", "none", "--gpu-release-timeout", "0",
            "--shutdown-timeout", "5", str(script)]
    return Agent([muster_bin(), *args], muster_env(env))


@pytest.mark.parametrize("mode", ["eval", "inference"])
def test_forward_passes_in_one_line_are_progress_on_a_loaded_node(tmp_path, cpu_hogs, mode):
    # The false hang of issue 39: the stack of `while ...: net(x)` looks the same at every
    # sample (one module call dominates), so only the forward passes say the rank works.
    run = eval_loop(tmp_path, {"MODE": mode, "EVAL_S": str(3 * HANG_TIMEOUT)})
    try:
        code = run.finish(timeout=300)
    finally:
        run.kill()
    out = run.text()
    assert code == 0, out
    assert "hang detected" not in out, out
    assert len(re.findall(r"EVAL rank=\d passes=\d+", out)) == 2, out
    assert sorted(re.findall(r"DONE rank=(\d)", out)) == ["0", "1"], out


@pytest.mark.parametrize("how", ["lock", "read", "compute"])
def test_a_rank_blocked_in_a_lock_or_a_read_is_still_found_while_its_peer_waits_in_all_reduce(
        tmp_path, cpu_hogs, how):
    # `compute`: rank 1 works outside torch.distributed and never steps again; its stack moves
    # (progress), but rank 0 waits for it in all_reduce, so rank 1 is the cause.
    run = eval_loop(tmp_path, {"BLOCK": how, "EVAL_S": "1"})
    try:
        code = run.finish(timeout=180)
    finally:
        run.kill()
    out = run.text()
    assert code == 207, out
    blocked, detected = run.first(r"BLOCKING rank=1"), run.first(r"hang detected")
    assert blocked is not None and detected is not None, out
    # The limit plus the last step's report delay and the watch's poll; slack for a loaded node.
    assert detected - blocked < HANG_TIMEOUT + 15, out
    # Rank 1 is named, not rank 0 that waits for it in dist.all_reduce, in the first error line.
    errors = [line for line in out.splitlines() if re.search(r"\bERROR\b", line)]
    assert errors and re.search(r"hung: rank 1 \(local rank 1\)", errors[0]), out
    if how == "compute":
        assert "working outside torch.distributed while its peers waited" in errors[0], out
    assert re.search(r"muster:\s+node: 0 \(\S+\)\s+rank: 1 \(local_rank 1\)", out), out


def scrape_steps(tmp_path, args, env, steps=12):
    """Runs STEPPER on one rank; its muster_worker_last_step once it stepped, and the line it
    printed about the reporter."""
    script = tmp_path / "stepper.py"
    script.write_text(STEPPER)
    release = tmp_path / "release"
    run = Agent([muster_bin(), "--standalone", "--nproc-per-node", "1", "--metrics-addr",
                 "127.0.0.1:0", "--gpu-release-timeout", "0", *args, str(script)],
                muster_env({"STEPS": str(steps), "RELEASE": str(release), **env}))
    try:
        wait_until(lambda: run.first(r"REPORTER installed") or run.proc.poll() is not None,
                   timeout=120, what="the script's steps")
        out = run.text()
        reporter = re.search(r"REPORTER installed=(\w+) reporting=(\w+) counted=(\d+)", out)
        addr = re.search(r"metrics on http://([0-9.]+):(\d+)/metrics", out)
        assert reporter and addr, out
        # A step report reaches the agent before the script's line reaches the test, except on
        # a loaded machine: read until the metric holds still.
        last = None
        for _ in range(20):
            metrics = http_get((addr.group(1), int(addr.group(2))), "/metrics")
            found = re.search(r'^muster_worker_last_step\{[^}]*local_rank="0"[^}]*\} (\S+)$',
                              metrics, re.M)
            value = float(found.group(1)) if found else None
            if value == last and value is not None:
                break
            last = value
            time.sleep(0.25)
        release.write_text("")
        assert run.finish(timeout=60) == 0, run.text()
    finally:
        run.kill()
    return last, (reporter.group(1) == "True", reporter.group(2) == "True",
                  int(reporter.group(3)))


def http_get(addr, path):
    with socket.create_connection(addr, timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.partition(b"\r\n\r\n")[2].decode()


def test_a_step_is_a_step_of_the_first_optimizer_that_steps(tmp_path):
    last, reporter = scrape_steps(tmp_path, [], {}, steps=12)
    assert reporter == (True, True, 12)
    assert last == 12.0


def test_a_script_using_the_helper_is_counted_once(tmp_path):
    # The helper's own numbers (1000 + i), never the reporter's count from 1 interleaved.
    last, reporter = scrape_steps(tmp_path, [], {"EXPLICIT": "1"}, steps=12)
    # Installed with torch, stood down when the Checkpointer connected, before its first step.
    assert reporter == (True, False, 0)
    assert last == 1011.0


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_opt_out_turns_the_reporter_off(tmp_path, how):
    args, env = (["--auto-step-reports", "off"], {}) if how == "flag" else \
        ([], {"MUSTER_AUTO_STEP_REPORTS": "false"})
    last, reporter = scrape_steps(tmp_path, args, env, steps=5)
    assert reporter == (False, False, 0)
    assert last is None, "no step metric without the reporter"


# -- the reporter alone: a fake agent socket, fake optimizers, no torch ---------------------------

def load_reporter():
    """A fresh copy of the reporter (its module state is per process)."""
    for name in [m for m in sys.modules if m.split(".")[0] == "muster_launcher"]:
        del sys.modules[name]
    if str(REPO / "python") not in sys.path:
        sys.path.insert(0, str(REPO / "python"))
    return importlib.import_module("muster_launcher.autoreport")


class FakeAgent:
    def __init__(self, tmp_path, interval_ms=0):
        self.interval_ms = interval_ms
        self.path = str(tmp_path / "agent.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(4)
        self.server.settimeout(10)
        self.conn = None
        self.data = b""

    def lines(self, until, timeout=10):
        if self.conn is None:
            self.conn, _ = self.server.accept()
            self.conn.sendall(b"interval %d\n" % self.interval_ms)
            self.conn.settimeout(0.1)
        deadline = time.monotonic() + timeout
        while not until(self.data.decode().splitlines()) and time.monotonic() < deadline:
            try:
                chunk = self.conn.recv(4096)
            except socket.timeout:
                continue
            except ConnectionResetError:
                # The reporter closed with our `interval` line unread.
                break
            if not chunk:
                break
            self.data += chunk
        return self.data.decode().splitlines()


class Optimizer:
    """Stands in for a torch optimizer: only identity matters to the hook."""


def test_the_reporter_counts_the_lead_optimizer_and_stands_down(tmp_path, monkeypatch):
    agent = FakeAgent(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    module = load_reporter()
    reporter = module._Reporter(agent.path)
    d, g = Optimizer(), Optimizer()
    for opt in (d, g, d, g, d):
        assert reporter.on_step(opt, (), {}) is None
    lines = agent.lines(lambda l: "step 3" in l)
    assert lines[0] == f"watch 1 3 {os.getpid()}"
    # Steps 10 ms apart or closer share a report; the last one is always sent.
    steps = [int(l.split()[1]) for l in lines if l.startswith("step")]
    assert steps[0] == 1 and steps[-1] == 3 and steps == sorted(set(steps)), lines
    assert reporter._other_steps == 2
    # The lead optimizer is gone (the script built a new one): the next one to step leads.
    del d, opt
    reporter.on_step(g, (), {})
    assert agent.lines(lambda l: "step 4" in l)[-1] == "step 4"
    # A Checkpointer connected: not one more report.
    module._reporter = reporter
    module.stand_down()
    reporter.on_step(g, (), {})
    assert agent.lines(lambda l: False, timeout=0.5)[-1] == "step 4"


def test_the_reporter_never_raises_into_the_script(tmp_path, capfd):
    module = load_reporter()
    reporter = module._Reporter(str(tmp_path / "no-agent.sock"))
    for _ in range(3):
        assert reporter.on_step(Optimizer(), (), {}) is None
    err = capfd.readouterr().err
    assert err.count("muster: zero-code step reports off") == 1, err


def test_forward_passes_and_batches_are_liveness_and_the_forward_hook_disarms(tmp_path):
    import threading

    import torch
    import torch.nn.modules.module as modules
    from torch.utils.data import DataLoader

    agent = FakeAgent(tmp_path, interval_ms=200)
    module = load_reporter()
    module._wrap_batches(sys.modules["torch.utils.data.dataloader"])
    hooks_before = len(modules._global_forward_pre_hooks)
    module._reporter = reporter = module._Reporter(agent.path)
    try:
        reporter.on_step(Optimizer(), (), {})
        agent.lines(lambda l: "step 1" in l)
        alive_at = []

        def collect():
            while True:
                try:
                    chunk = agent.conn.recv(4096)
                except socket.timeout:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                alive_at.extend([time.monotonic()] * chunk.count(b"alive\n"))

        threading.Thread(target=collect, daemon=True).start()

        def alive_during(work, seconds):
            """`alive`s sent while `work` ran in a loop for `seconds`, after the first
            intervals (which may still report the change from what came before)."""
            start = time.monotonic()
            work()
            while time.monotonic() < start + seconds:
                work()
            end = time.monotonic()
            time.sleep(0.3)
            return len([t for t in alive_at if start + 0.8 < t < end])

        net, x = torch.nn.Linear(64, 64), torch.randn(8, 64)
        # One module call on one line: the stack looks the same at every sample.
        with torch.no_grad():
            assert alive_during(lambda: net(x), 1.5) >= 2
        assert reporter._forwards >= 2
        # Armed at most once: one hook call per interval, never one per module call.
        assert len(modules._global_forward_pre_hooks) - hooks_before <= 1
        batches = iter(DataLoader(list(range(10**6)), batch_size=4))
        assert alive_during(lambda: next(batches), 1.5) >= 2
        assert reporter._batches > 0
        # Blocked (one sleep): nothing moves, nothing is said.
        assert alive_during(lambda: time.sleep(2.0), 0) == 0
        # Another thread's forward passes are not this thread's progress.
        worker = threading.Thread(target=lambda: [net(x) for _ in range(3000)])
        worker.start()
        assert alive_during(lambda: time.sleep(2.0), 0) == 0
        worker.join()
    finally:
        reporter.stop()
        module._reporter = None
    assert len(modules._global_forward_pre_hooks) == hooks_before, "stop() disarms"
