"""Preemption: SIGTERM on any node becomes a checkpoint that every rank of every node saves at the
same step, committed before the agents exit inside the grace period. Real PyTorch (gloo), three
muster agents as separate processes on loopback, two ranks each."""

import os
import random
import re
import signal
import time

import pytest

from conftest import REPO, free_port
from test_multinode_gang import Agents

WORKER = str(REPO / "tests" / "python" / "scripts" / "ckpt_worker.py")
CONF = "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3"
# muster's default for "preempted, checkpoint committed" (never 0: a Job counts 0 as done).
PREEMPTED_OK = 200
CHECKPOINT_ABORTED = 201


def launch(tmp_path, worker_args, grace=30, nnodes=3, extra=()):
    # muster runs a .py with the interpreter; a wrapper keeps the worker's own arguments.
    wrapper = tmp_path / "worker_entry.py"
    wrapper.write_text(
        "import runpy, sys\n"
        f"sys.argv = [{WORKER!r}] + {['--ckpt-dir', str(tmp_path), *worker_args]!r}\n"
        f"runpy.run_path({WORKER!r}, run_name='__main__')\n")
    agents = Agents(free_port(), str(nnodes), str(wrapper), run_id=f"ckpt{random.randrange(10**6)}")
    for node in range(nnodes):
        agents.start(node_rank=node, conf=CONF, extra=("--grace-period", str(grace), *extra))
    return agents


def wait_for_steps(agents, at_least, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(m.group(1)) for i in range(len(agents.procs))
                 for m in re.finditer(r"STEP \d+ (\d+)", agents.text(i))]
        if len(steps) >= 6 and max(steps) >= at_least:
            return
        if any(p.poll() is not None for p in agents.procs):
            raise AssertionError("an agent exited early:\n" + "\n".join(
                agents.text(i) for i in range(len(agents.procs))))
        time.sleep(0.1)
    raise AssertionError("training did not start:\n" + agents.text(0))


def saved_lines(out):
    return [(int(r), int(s), v) for r, s, v in re.findall(r"SAVED (\d+) (\d+) (\S+)", out)]


def assert_committed_everywhere(results, tmp_path):
    saved = [line for _, out in results for line in saved_lines(out)]
    assert sorted(r for r, _, _ in saved) == list(range(6)), results
    steps = {s for _, s, _ in saved}
    assert len(steps) == 1, f"ranks saved at different steps: {saved}"
    step = steps.pop()
    assert all(v == "committed" for _, _, v in saved), saved
    assert (tmp_path / "LATEST").read_text() == str(step)
    assert len(list((tmp_path / f"step_{step}").glob("rank_*.pt"))) == 6
    for code, out in results:
        assert code == PREEMPTED_OK, out
    return step


@pytest.mark.parametrize("victim", ["non-host", "host", "all"])
def test_sigterm_becomes_a_committed_checkpoint_on_every_node(tmp_path, victim):
    for run in range(2 if victim == "non-host" else 1):
        ckpt = tmp_path / f"run{run}"
        ckpt.mkdir()
        agents = launch(ckpt, [])
        try:
            wait_for_steps(agents, at_least=random.randrange(10, 40))
            signalled_at = time.monotonic()
            if victim == "all":
                for p in agents.procs:
                    p.send_signal(signal.SIGTERM)
                    time.sleep(random.uniform(0.05, 0.3))
            else:
                agents.procs[1 if victim == "non-host" else 0].send_signal(signal.SIGTERM)
            results = agents.finish(timeout=60)
            elapsed = time.monotonic() - signalled_at
        finally:
            agents.kill_all()
        step = assert_committed_everywhere(results, ckpt)
        assert elapsed < 27, f"took {elapsed:.1f}s, past the 30 s grace budget"

        # Started again, the job resumes from the committed step.
        agents = launch(ckpt, ["--steps", str(step + 3)])
        try:
            results = agents.finish(timeout=90)
        finally:
            agents.kill_all()
        resumed = [int(s) for _, out in results for s in re.findall(r"RESUMED \d+ (\d+)", out)]
        assert resumed == [step] * 6, results
        assert all(code == 0 for code, _ in results), results


def test_a_deadline_too_short_aborts_and_keeps_the_previous_checkpoint(tmp_path):
    (tmp_path / "LATEST").write_text("3")  # a previous committed checkpoint
    (tmp_path / "step_3").mkdir()
    # Steps of 1.5 s and a 3 s grace (2 s of budget): no rank can reach the target in time.
    agents = launch(tmp_path, ["--step-seconds", "1.5"], grace=3)
    try:
        wait_for_steps(agents, at_least=4, timeout=120)
        agents.procs[2].send_signal(signal.SIGTERM)
        started = time.monotonic()
        results = agents.finish(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        agents.kill_all()
    for code, out in results:
        assert code == CHECKPOINT_ABORTED, out
    assert (tmp_path / "LATEST").read_text() == "3"
    assert not any(v == "committed" for _, out in results for _, _, v in saved_lines(out))
    assert any("checkpoint aborted" in out and "deadline" in out for _, out in results), results
    assert elapsed < 15, f"{elapsed:.1f}s"


def test_a_worker_dying_during_the_save_aborts_with_a_clear_message(tmp_path):
    agents = launch(tmp_path, ["--die-during-save-rank", "3"])
    try:
        wait_for_steps(agents, at_least=10)
        agents.procs[0].send_signal(signal.SIGTERM)
        results = agents.finish(timeout=60)
    finally:
        agents.kill_all()
    for code, out in results:
        assert code == CHECKPOINT_ABORTED, out
    assert not (tmp_path / "LATEST").exists()
    text = "\n".join(out for _, out in results)
    assert re.search(r"checkpoint aborted: node 1: local rank 1 exited", text), text


def test_unmodified_scripts_get_sigterm_on_every_node(tmp_path):
    agents = launch(tmp_path, ["--no-helper", "--trap-sigterm"])
    try:
        wait_for_steps(agents, at_least=10)
        agents.procs[2].send_signal(signal.SIGTERM)
        results = agents.finish(timeout=60)
    finally:
        agents.kill_all()
    got = sorted(int(r) for _, out in results for r in re.findall(r"GOT_SIGTERM (\d+)", out))
    assert got == list(range(6)), results
    for code, out in results:
        # every worker exited cleanly after its own handler, but nothing was committed: never 0,
        # which a Job would count as finished work
        assert code == CHECKPOINT_ABORTED, out
