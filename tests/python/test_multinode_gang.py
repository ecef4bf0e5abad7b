"""Multi-node gang rendezvous with real PyTorch: several muster agents on loopback, each a
separate process as it would be in its own pod. Short timeouts come in through --rdzv-conf."""

import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest

from conftest import free_port, muster_bin, torch_python, wait_until

CONF = "join_timeout=20,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=1.5"

WORKER = r'''
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"RESULT rank={os.environ['RANK']} group={os.environ['GROUP_RANK']} "
      f"world={dist.get_world_size()} sum={t.item():.0f} "
      f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
mode = os.environ.get("MODE", "")
if mode == "fail_once" and os.environ["RANK"] == "2" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    # Not sys.exit: torch 2.15's teardown of a live gloo group at interpreter exit sometimes
    # aborts (SIGABRT, "terminate called without an active exception") instead of exiting 3, as
    # often under torchrun as under muster (1 of 15 each, loaded); the tests are about the code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)
if mode == "sleep":
    time.sleep(120)
if mode == "node0_slow" and os.environ["GROUP_RANK"] == "0":
    time.sleep(4)
if mode == "sleep_until_flag":
    while not os.path.exists(os.environ["FLAG"]):
        time.sleep(0.1)
dist.destroy_process_group()
'''


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


class Agents:
    def __init__(self, port, nnodes, script, run_id="t"):
        self.port, self.nnodes, self.script, self.run_id = port, nnodes, script, run_id
        self.procs = []
        self.outputs = []

    def start(self, node_rank=None, env=None, prefix=(), nproc=2, conf=CONF, extra=()):
        args = [muster_bin(), "--nnodes", self.nnodes, "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--rdzv-id", self.run_id, "--local-addr", "127.0.0.1", "--rdzv-conf", conf,
                *extra]
        if node_rank is not None:
            args += ["--node-rank", str(node_rank)]
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("JOB_COMPLETION_INDEX", "PET_NODE_RANK")}
        full_env["PYTHON_EXEC"] = torch_python()
        full_env.update(env or {})
        p = subprocess.Popen([*prefix, *args, self.script], env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
        reader.start()
        p.reader = reader
        self.procs.append(p)
        self.outputs.append(lines)
        return p

    def text(self, i):
        return "".join(self.outputs[i])

    def finish(self, timeout=90):
        out = []
        for i, p in enumerate(self.procs):
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            p.reader.join(timeout=10)
            out.append((p.returncode, self.text(i)))
        return out

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


@pytest.fixture
def agents_factory(worker):
    made = []

    def make(nnodes, run_id="t"):
        a = Agents(free_port(), nnodes, worker, run_id)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill_all()


def results(text):
    return [dict(kv.split("=") for kv in m.group(1).split())
            for m in re.finditer(r"RESULT (.*)", text)]


def can_unshare_uts():
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0


def test_three_nodes_all_reduce_with_ranks_from_flag_job_index_and_hostname(agents_factory):
    if not can_unshare_uts():
        pytest.skip("needs unshare --uts (root) to give an agent the host name worker-2")
    a = agents_factory("3")
    a.start(node_rank=0)
    a.start(env={"JOB_COMPLETION_INDEX": "1"})
    a.start(prefix=["unshare", "--uts", "sh", "-c", 'hostname worker-2 && exec "$@"', "sh"])
    out = a.finish()
    for code, text in out:
        assert code == 0, text
    for node, (_, text) in enumerate(out):
        res = results(text)
        assert len(res) == 2, text
        for r in res:
            assert r["world"] == "6" and r["sum"] == "15", text
            assert r["group"] == str(node), text
            assert int(r["rank"]) in (2 * node, 2 * node + 1), text
    assert "from JOB_COMPLETION_INDEX" in out[1][1]
    assert "from the host name's ordinal" in out[2][1]


def test_a_node_that_never_starts_is_named_by_the_timeout(agents_factory):
    a = agents_factory("2")
    start = time.monotonic()
    a.start(node_rank=0, conf=CONF.replace("join_timeout=20", "join_timeout=2"))
    [(code, text)] = a.finish(timeout=30)
    assert code == 203, text
    assert "never arrived: node rank 1" in text, text
    assert time.monotonic() - start < 15


def test_a_worker_failing_on_one_node_restarts_every_node_together(agents_factory):
    a = agents_factory("2")
    env = {"MODE": "fail_once"}
    a.start(node_rank=0, env=env, extra=("--max-restarts", "1"))
    a.start(node_rank=1, env=env, extra=("--max-restarts", "1"))
    out = a.finish()
    for code, text in out:
        assert code == 0, text
        res = results(text)
        assert sorted(r["restart"] for r in res) == ["0", "0", "1", "1"], text
        assert all(r["sum"] == "6" for r in res), text


def test_a_worker_failing_with_no_restarts_left_ends_every_node_with_its_code(agents_factory):
    a = agents_factory("2")
    env = {"MODE": "fail_once"}
    a.start(node_rank=0, env=env)
    a.start(node_rank=1, env=env)
    out = a.finish()
    assert [c for c, _ in out] == [3, 3], out


def test_two_of_at_most_three_start_after_the_last_call_and_a_third_scales_up_free(
        agents_factory, tmp_path):
    a = agents_factory("2:3")
    flag = tmp_path / "go"
    env = {"MODE": "sleep_until_flag", "FLAG": str(flag)}
    a.start(node_rank=0, env=env)
    a.start(node_rank=1, env=env)
    wait_until(lambda: "world=4" in a.text(0), timeout=30, what="a gang of 2 nodes")
    a.start(node_rank=2, env=env)
    wait_until(lambda: a.text(0).count("world=6") == 2, timeout=30, what="a gang of 3 nodes")
    flag.write_text("1")
    out = a.finish()
    for code, text in out:
        assert code == 0, text
    first = results(out[0][1])
    assert [r["world"] for r in first] == ["4", "4", "6", "6"], out[0][1]
    assert all(r["restart"] == "0" for r in first), "a membership change is not a restart"
    assert "scaling up" in out[0][1], out[0][1]


def test_min_max_proceeds_smaller_when_a_node_dies_and_times_out_below_min(
        agents_factory, tmp_path):
    a = agents_factory("2:3")
    flag = tmp_path / "go"
    env = {"MODE": "sleep_until_flag", "FLAG": str(flag)}
    conf = CONF.replace("join_timeout=20", "join_timeout=6")
    for rank in range(3):
        a.start(node_rank=rank, env=env, conf=conf)
    wait_until(lambda: a.text(0).count("world=6") == 2, timeout=30, what="a gang of 3 nodes")
    os.killpg(a.procs[2].pid, signal.SIGKILL)
    wait_until(lambda: "world=4" in a.text(0), timeout=30, what="the gang re-formed smaller")
    assert "node 2" in a.text(0) and "silent for" in a.text(0)
    os.killpg(a.procs[1].pid, signal.SIGKILL)
    a.procs[0].wait(timeout=40)
    text = a.text(0)
    assert a.procs[0].returncode == 203, text
    assert re.search(r"never arrived: node ranks 1 \([^)]*127\.0\.0\.1\), 2", text), text


def test_losing_node_0_without_a_replacement_ends_the_others_with_205_after_the_join_timeout(
        agents_factory):
    """Issue #14: a survivor waits for a replacement node 0 up to the join timeout (counted from
    the loss), then exits 205 naming the endpoint and how long it waited."""
    a = agents_factory("2")
    env = {"MODE": "sleep"}
    join_timeout = 6
    conf = CONF.replace("join_timeout=20", f"join_timeout={join_timeout}")
    host = a.start(node_rank=0, env=env, conf=conf)
    other = a.start(node_rank=1, env=env, conf=conf)
    wait_until(lambda: a.text(1).count("RESULT") == 2, timeout=60, what="the gang running")
    assert host.poll() is None and other.poll() is None
    os.killpg(host.pid, signal.SIGKILL)
    killed = time.monotonic()
    other.wait(timeout=join_timeout + 30)
    took = time.monotonic() - killed
    other.reader.join(timeout=10)
    text = a.text(1)
    assert other.returncode == 205, text
    assert "waiting up to 6.0s for a replacement node 0" in text, text
    assert re.search(r"no node 0 came back at 127\.0\.0\.1:%d within the join timeout "
                     r"\(6\.0s; waited [0-9.]+s since the store host was lost\)" % a.port, text), text
    assert took < join_timeout + 5, (took, text)


RECOVERY_WORKER = r'''
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
if rank == "2" and restart == "0":
    sys.exit(3)  # one counted restart before node 0 is lost
after_loss = os.path.exists(os.environ["LOST"])
if not after_loss:
    # Train until node 0 is lost (this generation never ends on its own).
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.05)
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"RESULT rank={rank} world={dist.get_world_size()} sum={t.item():.0f} restart={restart}",
      flush=True)
while not os.path.exists(os.environ["FINISH"]):
    time.sleep(0.05)
dist.all_reduce(t)
dist.destroy_process_group()
'''


def scrape(port):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(body, name):
    m = re.search(r"^" + re.escape(name) + r" (\S+)$", body, re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))


def test_losing_node_0_costs_one_gang_restart_and_a_replacement_brings_the_gang_back(tmp_path):
    """Issue #14: 3 agents (2, 1 and 2 ranks), one worker failure uses a restart, then node 0's
    agent is SIGKILLed mid-training. The survivors stop their workers and wait; a replacement
    node 0 started a few seconds later with the same flags hosts a fresh store, adopts the gang's
    memory (generation, restarts used), and every rank of the new generation finishes its
    all-reduce; every agent exits 0, and the restart counter goes on from 1 (not reset to 0)."""
    script = tmp_path / "worker.py"
    script.write_text(RECOVERY_WORKER)
    lost, finish = tmp_path / "lost", tmp_path / "finish"
    env = {"LOST": str(lost), "FINISH": str(finish)}
    mport = free_port()
    a = Agents(free_port(), "3", str(script))
    nproc = {0: 2, 1: 1, 2: 2}
    restarts = ("--max-restarts", "1")
    try:
        first = a.start(node_rank=0, env=env, nproc=nproc[0], extra=restarts)
        a.start(node_rank=1, env=env, nproc=nproc[1],
                extra=(*restarts, "--metrics-addr", f"127.0.0.1:{mport}"))
        a.start(node_rank=2, env=env, nproc=nproc[2], extra=restarts)
        wait_until(lambda: all("restarts used 1" in a.text(i) for i in range(3)), timeout=90,
                   what="the gang re-formed after the worker failure")
        time.sleep(2)  # the generation-1 workers train
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        wait_until(lambda: all("lost the store host (node 0)" in a.text(i) for i in (1, 2)),
                   timeout=30, what="both survivors noticing the loss")
        lost.write_text("1")
        time.sleep(3)
        a.start(node_rank=0, env=env, nproc=nproc[0], extra=restarts)  # the replacement
        wait_until(lambda: sum(len(results(a.text(i))) for i in (1, 2, 3)) == 5, timeout=90,
                   what="every rank of the new generation")
        body = scrape(mport)
        assert metric(body, "muster_rendezvous_host_lost_total") == 1, body
        assert metric(body, "muster_rendezvous_host_rejoined_total") == 1, body
        assert metric(body, "muster_rendezvous_host_waiting") == 0, body
        assert metric(body, "muster_rendezvous_seconds_without_gang_total") > 3, body
        finish.write_text("1")
        out = a.finish(timeout=90)
    finally:
        a.kill_all()
    for code, text in out[1:]:
        assert code == 0, text
    ranks = sorted(int(r["rank"]) for _, text in out[1:] for r in results(text))
    assert ranks == [0, 1, 2, 3, 4], out
    for _, text in out[1:]:
        for r in results(text):
            assert r["world"] == "5" and r["sum"] == "10", text
            assert r["restart"] == "1", ("the restart counter goes on", text)
    for i in (1, 2):
        text = out[i][1]
        assert "waiting up to 20.0s for a replacement node 0 (generation 1, 1 restart(s) used" \
            in text, text
        assert "rejoined the gang at generation 2" in text, text
    replacement = out[3][1]
    assert "node 0 was replaced: generation 1" in replacement, replacement
    assert "1 restart(s) used" in replacement, replacement


def test_sigkill_of_a_non_host_agent_then_a_replacement_rejoins_and_the_gang_finishes(
        agents_factory, tmp_path):
    a = agents_factory("2")
    flag = tmp_path / "go"
    env = {"MODE": "sleep_until_flag", "FLAG": str(flag)}
    host = a.start(node_rank=0, env=env)
    victim = a.start(node_rank=1, env=env)
    time.sleep(6)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    time.sleep(3)  # > heartbeat timeout: node 0 has stopped its workers and re-opened the round
    flag.write_text("1")
    a.start(node_rank=1, env=env)
    out = a.finish()
    code, text = out[0]
    assert code == 0, text
    assert "silent for" in text, text
    assert out[2][0] == 0, out[2][1]


def test_nodes_without_identity_get_ranks_by_arrival(agents_factory):
    if not can_unshare_uts():
        pytest.skip("needs unshare --uts (root) for a host name without an ordinal")
    a = agents_factory("2")
    anonymous = ["unshare", "--uts", "sh", "-c", 'hostname laptop && exec "$@"', "sh"]
    a.start(prefix=anonymous)
    time.sleep(0.5)
    a.start(prefix=anonymous)
    out = a.finish()
    for code, text in out:
        assert code == 0, text
    groups = sorted(r["group"] for _, text in out for r in results(text))
    assert groups == ["0", "0", "1", "1"], out
    assert all("from arrival order" in text for _, text in out), out


def test_an_early_finisher_waits_in_the_exit_barrier_and_is_not_taken_for_dead(agents_factory):
    a = agents_factory("2")
    env = {"MODE": "node0_slow"}
    a.start(node_rank=0, env=env)
    a.start(node_rank=1, env=env)
    out = a.finish()
    for code, text in out:
        assert code == 0, text
        assert "silent for" not in text and "re-forms" not in text, text
    assert all(len(results(text)) == 2 for _, text in out)


def test_completion_is_terminal_when_node_0_observes_it_late_at_64_agents():
    """64 real agents with trivial ranks. Node 0 reports its workers finished, then (test hook)
    looks for the exit barrier's completion only after several heartbeat timeouts, while every
    other agent sees it and leaves. A completed barrier decides the generation: node 0 must not
    take the departed nodes for lost and re-form the gang; every agent exits 0 (issue #17)."""
    n = 64
    conf = "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=1"
    a = Agents(free_port(), str(n), "true")
    try:
        for i in range(n):
            env = {"MUSTER_TEST_BARRIER_OBSERVE_DELAY": "3"} if i == 0 else {}
            a.start(node_rank=i, env=env, nproc=1, conf=conf,
                    extra=("--metrics-addr", "none", "--no-python"))
        out = a.finish(timeout=120)
    finally:
        a.kill_all()
    failed = [(i, code, text) for i, (code, text) in enumerate(out) if code != 0]
    assert not failed, failed[:3]
    node0 = out[0][1]
    assert "every node finished" in node0, node0
    for word in ("lost node", "re-forms", "starting round 1", "silent for"):
        assert word not in node0, node0
    assert all("every node finished" in text for _, text in out), [t for _, t in out][:3]
