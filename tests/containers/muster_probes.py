"""Capability probes of the muster binary under test, so that end-to-end scenarios whose
features have not landed yet skip with a precise reason and switch on by themselves when they do.

A flag in `--help` is not proof of a feature (the launch form accepts --grace-period and
--metrics-addr before they do anything), so metrics and preemption are probed by behaviour: a
cheap run of the binary on loopback that shows the feature working.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _help(muster: str, *args: str) -> tuple[int, str]:
    try:
        proc = subprocess.run([muster, *args, "--help"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


class Capabilities:
    """What the muster binary under test can do, and for each missing thing, why we think so.

    A flag in `--help` is not proof of a feature (the launch form accepts --grace-period and
    --metrics-addr before they do anything), so metrics and preemption are probed by behaviour:
    a cheap run of the binary on loopback that shows the feature working."""

    def __init__(self, muster: str) -> None:
        self.muster = muster
        # name -> None (present) or why it is missing; probed on first use, once per module.
        self._known: dict[str, str | None] = {}

    def why_missing(self, name: str) -> str | None:
        if name not in self._known:
            self._known[name] = getattr(self, f"_probe_{name}")()
        return self._known[name]

    @property
    def missing(self) -> dict[str, str]:
        """The capabilities probed so far that are missing."""
        return {k: v for k, v in self._known.items() if v is not None}

    def require(self, *names: str) -> None:
        reasons = [f"{n}: {why}" for n in names if (why := self.why_missing(n)) is not None]
        if reasons:
            pytest.skip("muster under test lacks " + "; ".join(reasons))

    def _probe_store(self) -> str | None:
        rc, text = _help(self.muster, "store")
        if rc != 0 or "--port" not in text:
            return f"`muster store --help` exited {rc} without listing --port"
        return None

    def _probe_launch(self) -> str | None:
        rc, text = _help(self.muster)
        flags = ("--nproc-per-node", "--nnodes", "--rdzv-endpoint")
        if rc != 0 or not all(f in text for f in flags):
            return f"`muster --help` exited {rc} or lacks one of {', '.join(flags)}"
        return None

    def _probe_multinode(self) -> str | None:
        rc, _ = _help(self.muster, "dry-run")
        if rc != 0:
            return f"`muster dry-run --help` exited {rc} (multi-node rendezvous not landed)"
        return None

    def _probe_preemption(self) -> str | None:
        if self.why_missing("launch"):
            return "no launch form"
        return _probe_checkpoint_channel(self.muster)

    def _probe_metrics(self) -> str | None:
        if self.why_missing("launch"):
            return "no launch form"
        return _probe_metrics(self.muster)

    def _probe_node0_recovery(self) -> str | None:
        if self.why_missing("multinode"):
            return "no multi-node rendezvous"
        return _probe_node0_recovery(self.muster)


def _probe_checkpoint_channel(muster: str) -> str | None:
    """The checkpoint barrier is wired into the launch when workers get MUSTER_CHECKPOINT_SOCKET."""
    try:
        proc = subprocess.run(
            [muster, "--standalone", "--nproc-per-node", "1", "--no-python", "/usr/bin/env"],
            capture_output=True, text=True, timeout=60, check=False,
        )
    except subprocess.TimeoutExpired:
        return "`muster --standalone --no-python env` did not finish in 60 s"
    if "MUSTER_CHECKPOINT_SOCKET=" not in proc.stdout + proc.stderr:
        return f"workers get no MUSTER_CHECKPOINT_SOCKET (probe exited {proc.returncode})"
    return None


# A worker that joins its process group as torch would (a connection to the workers' store at
# MASTER_PORT), then works for 4 s, printing a step every 0.2 s as a training loop would (the
# first line after the dry run sees every worker joined starts its fault clock).
_JOINING_WORKER = ("import os, socket, time\n"
                   "s = socket.create_connection((os.environ['MASTER_ADDR'], "
                   "int(os.environ['MASTER_PORT'])))\n"
                   "for step in range(20):\n"
                   "    print('step', step, flush=True)\n"
                   "    time.sleep(0.2)\n")


def _probe_node0_recovery(muster: str) -> str | None:
    """Survivors wait for a replacement node 0 (issue #14): a 2-node dry run (loopback) whose
    node 0 agent is SIGKILLed and replaced a second later finishes with exit 0, where without
    recovery the survivor exits 205 and the replacement waits alone for the join timeout."""
    _, text = _help(muster, "dry-run")
    if "--fault" not in text:
        return "`muster dry-run --help` lists no --fault (no fault rehearsal to probe with)"
    try:
        proc = subprocess.run(
            [muster, "dry-run", "--nnodes", "2", "--nproc-per-node", "1", "--metrics-addr", "none",
             "--max-restarts", "1", "--rdzv-conf",
             "join_timeout=15,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3",
             "--fault", "kill:0@1", "--replace-after", "1",
             "--no-python", sys.executable, "-c", _JOINING_WORKER],
            capture_output=True, text=True, timeout=90, check=False,
        )
    except subprocess.TimeoutExpired:
        return "the node-0 loss probe (a 2-node dry run) did not finish in 90 s"
    out = proc.stdout + proc.stderr
    if "replacement agent started" not in out:
        return f"the node-0 loss probe never replaced node 0 (exit {proc.returncode}):\n{out[-2000:]}"
    if proc.returncode != 0:
        return (f"a dry run whose node 0 is killed and replaced exits {proc.returncode}, not 0 "
                "(the survivors do not wait for a replacement node 0)")
    return None


def _probe_metrics(muster: str) -> str | None:
    """The agent serves /healthz and /metrics on --metrics-addr while it waits for a rendezvous
    that cannot happen (nothing listens on the endpoint; loopback only)."""
    port, nobody = free_port(), free_port()
    proc = subprocess.Popen(
        [muster, "--metrics-addr", f"127.0.0.1:{port}", "--nnodes", "2",
         "--nproc-per-node", "1", "--node-rank", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{nobody}", "--rdzv-conf", "join_timeout=30",
         str(SCRIPTS / "train.py")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    if r.status == 200 and "muster_" in r.read().decode():
                        return None
            except OSError:
                pass
            time.sleep(0.3)
        return (f"no /metrics on --metrics-addr within 10 s of start "
                f"(agent {'exited ' + str(proc.returncode) if proc.poll() is not None else 'running'})")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
