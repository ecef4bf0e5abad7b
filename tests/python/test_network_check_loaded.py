"""The network check on a loaded host: a healthy 3-node dry run (every agent on loopback) beside two
CPU-bound neighbour processes. On loopback a stream is all CPU, so an agent kept off-CPU by the
neighbours measured a healthy loopback several times slower than the rest of the gang and was
named (`slow link between node rank 0 ...`; 208 under `require`). Such a measurement is set aside
(its agent waited for a CPU) and a slow one is measured again before anything is named: no
finding, exit 0, every time. A throttled link is still named: test_network_check.py (root)."""

import re
import subprocess
import sys

import pytest

from conftest import muster_bin, muster_env

RUNS = 4


@pytest.fixture
def neighbours():
    """Two busy loops, as many as this machine's test runs are asked to bear."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.parametrize("mode", ["warn", "require"])
def test_a_healthy_gang_beside_busy_neighbours_has_no_finding(tmp_path, neighbours, mode):
    script = tmp_path / "noop.py"
    script.write_text('print("TRAINED", flush=True)\n')
    for run in range(RUNS):
        p = subprocess.run([muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "1",
                            "--network-check", mode, str(script)],
                           capture_output=True, text=True, timeout=120, env=muster_env())
        text = p.stdout + p.stderr
        assert "network check took" in text, text
        assert not re.search(r"network check: slow (node|link)", text), f"run {run}:\n{text}"
        assert "inconclusive" not in text, f"run {run}:\n{text}"
        assert p.returncode == 0, f"run {run}:\n{text}"
        assert text.count("TRAINED") == 3, text
