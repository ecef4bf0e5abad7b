"""Shared fixtures for the suites that drive real PyTorch against muster.

Environment (set by scripts/test):
  MUSTER_BIN           the muster binary under test
  MUSTER_TORCH_PYTHON  the interpreter of the PyTorch virtualenv (this one, normally)
"""

import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The last lines of a test script that formed a gloo group, after destroy_process_group: it
# leaves as Python would, exit handlers included (muster's `exiting`), but without interpreter
# finalization, where torch 2.15's gloo teardown sometimes aborts (SIGABRT, "terminate called
# without an active exception"; pytorch/pytorch#190489): not a hang and not the launcher's.
LEAVE_WITHOUT_FINALIZATION = """
import atexit, os, sys
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def muster_bin() -> str:
    path = os.environ.get("MUSTER_BIN") or str(REPO / "target" / "release" / "muster")
    if not Path(path).exists():
        pytest.fail(f"muster binary not found at {path}; build it or set MUSTER_BIN", pytrace=False)
    return path


def torch_python() -> str:
    return os.environ.get("MUSTER_TORCH_PYTHON") or sys.executable


@functools.cache
def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch the workers run: scripts/compat runs the suites with older ones."""
    out = subprocess.run(
        [torch_python(), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    major, minor = out.strip().split(".")[:2]
    return int(major), int(minor)


# Warm standbys (on by default, issue #41) are off for the suite unless a test asks for them
# (tests/python/test_warm_restart.py; `{"MUSTER_WARM_RESTART": ""}` gives the default): on this
# 2-CPU machine each standby's torch import competes with the tests' own ranks, and a test of
# something else must not pay for it or time with it. Set here too for the tests that build
# their environment from this one; the containers run the real default.
WARM_RESTART_IN_TESTS = {"MUSTER_WARM_RESTART": "off"}
os.environ.update(WARM_RESTART_IN_TESTS)


def muster_env(extra=None) -> dict[str, str]:
    """The environment for a muster under test: this one without any PET_* or MUSTER_* setting
    (MUSTER_BIN aside, and the suite's warm-restart default), PYTHON_EXEC the torch interpreter,
    then `extra` on top."""
    env = dict(os.environ, PYTHON_EXEC=torch_python())
    for k in list(env):
        if k.startswith(("PET_", "MUSTER_")) and k != "MUSTER_BIN":
            del env[k]
    env.update(WARM_RESTART_IN_TESTS)
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc, timeout):
    """SIGTERM `proc` if it still runs, SIGKILL it if it has not exited after `timeout` seconds;
    returns its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def alive(pid):
    """Running (not gone, not a zombie waiting for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def finish(p, timeout):
    """Waits for `p` to exit, at most `timeout` seconds (then kills it and raises); returns
    (exit status, stdout, stderr)."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise
    return p.returncode, out, err


class StoreProcess:
    """`muster store` on 127.0.0.1, started on port 0; the address is read from its first line."""

    def __init__(self, extra_args=()):
        self.proc = subprocess.Popen(
            [muster_bin(), "store", "--host", "127.0.0.1", "--port", "0", *extra_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()
            raise RuntimeError(f"muster store did not start: {err}")
        # The line ends with the chosen address, e.g. "muster store listening on 127.0.0.1:40123".
        addr = line.strip().rsplit(" ", 1)[-1]
        host, port = addr.rsplit(":", 1)
        self.host = host.strip("[]")
        self.port = int(port)

    def stop(self, timeout=10):
        return stop_process(self.proc, timeout)


@pytest.fixture
def muster_store():
    store = StoreProcess()
    yield store
    store.stop()


def wait_until(predicate, timeout=10.0, interval=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def cpu_hogs():
    """Two CPU-bound neighbour processes for the test's duration: a watch must stay right on a
    loaded node (every core of this machine busy with something else), not only on an idle one."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(2)]
    yield hogs
    for hog in hogs:
        hog.kill()
        hog.wait()
