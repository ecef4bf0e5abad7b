"""Supervision like PID 1 should: no worker outlives a SIGKILLed agent, no zombie survives when
the agent is PID 1, stop signals reach every worker at once with SIGKILL after the timeout, and
the exit code says how the stop went."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import alive, finish, muster_bin, muster_env, torch_python, wait_until

SCRIPTS = Path(__file__).parent / "scripts"


def start(args, out, mode="plain", nproc=2):
    # TMPDIR: a SIGKILLed agent cannot remove its private run directory; keep it in the test's.
    env = muster_env({"OUT_DIR": str(out), "MODE": mode, "TMPDIR": str(out)})
    return subprocess.Popen([muster_bin(), "--nproc-per-node", str(nproc), *args,
                             str(SCRIPTS / "sleeper.py")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_pids(out, n=2, timeout=20):
    wait_until(lambda: all((out / f"pid_{r}").exists() for r in range(n)), timeout=timeout,
               what="workers to start")
    return [int((out / f"pid_{r}").read_text()) for r in range(n)]


def test_agent_sigkill_leaves_no_worker(tmp_path):
    p = start([], tmp_path)
    try:
        pids = worker_pids(tmp_path)
        assert all(alive(x) for x in pids)
        p.kill()
        p.wait(timeout=10)
        wait_until(lambda: not any(alive(x) for x in pids), timeout=10,
                   what="workers to die with the agent")
    finally:
        p.kill()
        p.communicate()


def test_sigterm_reaches_workers_and_a_clean_drain_exits_201(tmp_path):
    p = start(["--shutdown-timeout", "20"], tmp_path, mode="graceful")
    pids = worker_pids(tmp_path)
    sent = time.time()
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p, timeout=30)
    # Every worker trapped SIGTERM and exited 0, but SIGTERM is a preemption and nothing was
    # committed: 201, never 0 (a Job would count the pod as finished work), nor 143.
    assert rc == 201, err
    for r in range(2):
        got = float((tmp_path / f"term_{r}").read_text())
        assert got - sent < 2.0, f"rank {r} got SIGTERM {got - sent:.2f}s after the agent"
    assert not any(alive(x) for x in pids)


def test_sigterm_to_default_workers_exits_143(tmp_path):
    p = start([], tmp_path)
    worker_pids(tmp_path)
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p, timeout=30)
    assert rc == 143, err


def test_workers_ignoring_sigterm_get_sigkill_after_the_timeout(tmp_path):
    p = start(["--shutdown-timeout", "1"], tmp_path, mode="ignore")
    pids = worker_pids(tmp_path)
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p, timeout=30)
    took = time.monotonic() - sent
    assert rc == 143, err
    assert 0.9 <= took < 5, took
    assert "sending SIGKILL" in err
    assert not any(alive(x) for x in pids)


def test_forwarded_signal_keeps_workers_running(tmp_path):
    p = start(["--signals-to-handle", "SIGTERM,SIGUSR1:forward"], tmp_path, mode="forward")
    try:
        pids = worker_pids(tmp_path)
        p.send_signal(signal.SIGUSR1)
        wait_until(lambda: all((tmp_path / f"usr1_{r}").exists() for r in range(2)),
                   what="SIGUSR1 at every worker")
        assert all(alive(x) for x in pids) and p.poll() is None
        p.send_signal(signal.SIGTERM)
        rc, _, err = finish(p, timeout=30)
        assert rc == 201, err  # the workers' clean drain after a preemption signal
    finally:
        p.kill()
        p.communicate()


def test_pid1_reaps_orphaned_grandchildren():
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    # As root a PID namespace is enough; otherwise a user namespace makes us root inside it.
    errors = []
    for ns in (["--pid"], ["--user", "--map-root-user", "--pid"]):
        probe = subprocess.run([unshare, *ns, "--fork", "--mount-proc", "true"],
                               capture_output=True, text=True, timeout=10)
        if probe.returncode == 0:
            break
        errors.append(probe.stderr.strip())
    else:
        raise AssertionError(f"unshare cannot create a PID namespace: {errors}")
    env = dict(os.environ, PYTHON_EXEC=torch_python())
    p = subprocess.run([unshare, *ns, "--fork", "--mount-proc", muster_bin(),
                        "--nproc-per-node", "2", str(SCRIPTS / "zombie_maker.py")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    # The agent is PID 1 and the grandchildren were re-parented to it and reaped.
    assert "pid1=True grandchildren=4 zombies=0" in p.stdout, p.stdout + p.stderr
