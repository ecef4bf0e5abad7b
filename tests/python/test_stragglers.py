"""The straggler watch (`--straggler-threshold`, `--straggler-action`, docs/stragglers.md) with
real PyTorch CPU ranks on gloo and no muster code in the script: its steps reach the agents
through the zero-code reporter.

- 3 nodes x 1 rank in the dry run, rank 2 doing 3x the compute per step: node 2 names rank 2
  (and nobody else is named) while it trains, and the job ends 0;
- the same job without the slow rank names nobody;
- with torch's default intra-op thread count (`OMP_NUM_THREADS` unset, as for one rank per node:
  2 threads per rank on the 2-CPU machine) the 3x rank is named too, and the healthy job, under
  two CPU-bound neighbour processes, names nobody;
- a GPU the hardware throttles (the fake NVML) is named with its index, clocks and reason;
- `exclude` with `--nnodes 2:3`: the slow node leaves with 210 and the other two finish.

Short intervals (`--straggler-interval 0.5`) keep the suite fast; the defaults suit real jobs.

Environment: MUSTER_BIN, MUSTER_TORCH_PYTHON (conftest), MUSTER_FAKE_NVML (default
target/release/libfake_nvml.so).
"""

import os
import re
import signal
import subprocess
import urllib.request

import pytest

from conftest import REPO, free_port, muster_bin, muster_env
from test_gpu_watch import WATCH, fake_nvml, finish, identity

SCRIPT = str(REPO / "tests" / "python" / "scripts" / "straggler_ddp.py")
CONF = "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3"
FAST = ["--straggler-interval", "0.5", "--gpu-check", "off", "--hang-timeout", "0"]
SLOW_NODE_EXCLUDED = 210


def dry_run(slow_rank, seconds, *extra, nnodes="3", timeout=150, env=None, interval="0.5"):
    fast = ["--straggler-interval", interval, *FAST[2:]]
    cmd = [muster_bin(), "dry-run", "--nnodes", nnodes, "--nproc-per-node", "1",
           "--rdzv-conf", CONF, *fast, *extra, SCRIPT, str(slow_rank), str(seconds)]
    # One stream, so that the order of the agents' lines and the ranks' output is kept.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=muster_env(env or {}), start_new_session=True)
    out, _ = finish(p, timeout)
    return p.returncode, out


def findings(text):
    """(node, rank) of every `slow rank:` line, from the node tag of the dry run's output."""
    return [(int(node), int(rank)) for node, rank in
            re.findall(r"^\[node (\d)\]\s+WARN slow rank: rank (\d+) \(", text, re.M)]


@pytest.mark.timeout(180)
def test_the_slow_rank_is_named_by_its_node_while_it_trains():
    code, text = dry_run(2, 14)
    assert code == 0, text
    found = findings(text)
    assert found and set(found) == {(2, 2)}, text
    line = next(l for l in text.splitlines() if "WARN slow rank: rank 2 (" in l)
    assert re.search(r"slow rank: rank 2 \(node 2, host \S+, local rank 0\) computes "
                     r"\d+\.\dx longer per step than the gang median \(\d+ ms of main-thread CPU "
                     r"per step against \d+ ms, 3 ranks compared over \d+ steps\)", line), line
    ratio = float(re.search(r"computes (\d+\.\d)x", line).group(1))
    assert ratio >= 1.5, line
    # Named while it trained: before the ranks' results.
    assert text.index("WARN slow rank: rank 2") < text.index("RESULT rank=2"), text


@pytest.mark.timeout(180)
def test_a_healthy_gang_names_nobody():
    code, text = dry_run(-1, 14)
    assert code == 0, text
    assert "slow rank:" not in text and "slow GPU:" not in text, text
    assert text.count("RESULT rank=") == 3, text


@pytest.mark.timeout(180)
def test_the_slow_node_leaves_with_210_and_the_gang_finishes_without_it():
    # NODE_NAME (the downward API's node name): the node that leaves is remembered as bad.
    # 30 s: the finding must last 10 comparisons (of 10 steps or more each) before the node leaves.
    code, text = dry_run(2, 30, "--straggler-action", "exclude", nnodes="2:3", timeout=170,
                         env={"NODE_NAME": "gpu-node-7"})
    assert code == SLOW_NODE_EXCLUDED, text
    assert re.search(r"^\[node 2\]\s+INFO node gpu-node-7 recorded as bad in the gang's store",
                     text, re.M), text
    assert re.search(r"^\[node 2\]\s+ERROR straggler node: node 2 \(\S+\) leaves the gang "
                     r"\(exit 210\) so that it re-forms without it: rank 2 ", text, re.M), text
    assert "agent 0 exited 0, agent 1 exited 0, agent 2 exited 210" in text, text
    # The two left trained on together and finished.
    assert re.search(r"RESULT rank=0 world=2 ", text), text
    assert re.search(r"RESULT rank=1 world=2 ", text), text
    assert set(findings(text)) == {(2, 2)}, text


# torch's own thread count (no torch.set_num_threads(1) in the script), and a step of a few large
# products: their parallel regions are long, so that 3 ranks of 2 threads each on 2 CPUs train
# at a steady pace rather than in the scheduler's time slices (a chain of many small products
# there makes every rank wait for its own descheduled thread at each region's end).
DEFAULT_THREADS = {"STRAGGLER_THREADS": "default", "STRAGGLER_WORK": "768,2"}


def threads_of(text):
    return {int(t) for t in re.findall(r"START rank=\d+ threads=(\d+)", text)}


@pytest.mark.timeout(180)
def test_a_slow_rank_with_torchs_default_threads_is_named():
    """Up to 120 s of training, stopped once the finding is there: on a loaded machine the
    comparisons of 10 steps come slowly (a step took up to 1 s here)."""
    cmd = [muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-conf", CONF,
           "--straggler-interval", "2", *FAST[2:], SCRIPT, "2", "120"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=muster_env(DEFAULT_THREADS), start_new_session=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "WARN slow rank:" in line:
                break
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
    text = "".join(lines)
    assert len(threads_of(text)) == 1 and min(threads_of(text)) > 1, text
    assert set(findings(text)) == {(2, 2)}, text
    assert "RESULT rank=" not in text, text


@pytest.mark.timeout(180)
def test_a_healthy_gang_with_torchs_default_threads_under_load_names_nobody():
    neighbours = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2)]
    try:
        code, text = dry_run(-1, 40, interval="2", env=DEFAULT_THREADS)
    finally:
        for n in neighbours:
            n.kill()
            n.wait()
    assert code == 0, text
    assert min(threads_of(text)) > 1, text
    assert "slow rank:" not in text, text
    assert text.count("RESULT rank=") == 3, text


def scrape(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


@pytest.mark.timeout(150)
def test_a_throttled_gpu_is_named_with_its_index_clocks_and_reason(tmp_path):
    """One node, three CPU ranks, local rank 1 doing 3x the compute; the fake NVML's GPU 1 runs
    at 1,110 of 1,980 MHz with HW_SLOWDOWN. The GPU is named once on its own (index, clocks,
    reason), the slow rank's finding carries its GPU's evidence, and /gangz and the metrics
    show both."""
    port = free_port()
    env = muster_env({
        "MUSTER_NVML_LIBRARY": fake_nvml(),
        "MUSTER_FAKE_NVML_FIXTURE": str(WATCH / "throttled-gpu1-hw-slowdown.json"),
    })
    p = subprocess.Popen(
        [muster_bin(), "--gpu-watch-interval", "0.2", "--nproc-per-node", "3",
         "--metrics-addr", f"127.0.0.1:{port}", *FAST, SCRIPT, "1", "90"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    lines = []
    try:
        for line in p.stderr:
            lines.append(line)
            if any("WARN slow GPU:" in l for l in lines) and any("WARN slow rank:" in l for l in lines):
                break
        gangz = scrape(port, "/gangz")
        metrics = scrape(port, "/metrics")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
    text = "".join(lines)
    uuid, bus = identity(1)
    evidence = "GPU 1 clocks 1,110 MHz of 1,980 MHz, throttled: hw_slowdown (97 % busy)"
    gpu = [l for l in lines if "WARN slow GPU:" in l]
    assert len(gpu) == 1, text
    assert f"slow GPU: GPU 1 ({uuid}, {bus}) on node 0 (" in gpu[0], gpu[0]
    assert f"used by local rank 1 (rank 1): {evidence}" in gpu[0], gpu[0]
    rank = [l for l in lines if "WARN slow rank:" in l]
    assert len(rank) == 1, text
    assert re.search(r"slow rank: rank 1 \(node 0, host \S+, local rank 1, GPU 1\) computes "
                     r"\d+\.\dx longer per step than the gang median .*; " + re.escape(evidence),
                     rank[0]), rank[0]
    assert "slow gpu: GPU 1 (" in gangz and "slow rank: rank 1 (" in gangz, gangz
    assert gangz.startswith("gang running\n"), gangz
    info = [l for l in metrics.splitlines() if l.startswith("muster_straggler_finding_info{")]
    assert len(info) == 2, metrics
    assert any('kind="gpu"' in l and 'gpu="1"' in l for l in info), info
    assert any('kind="rank"' in l and 'rank="1"' in l and 'gpu="1"' in l for l in info), info
    assert "muster_straggler_findings 2" in metrics, metrics
    ratio = [l for l in metrics.splitlines()
             if l.startswith("muster_straggler_slowness_ratio{") and 'local_rank="1"' in l]
    assert len(ratio) == 1 and float(ratio[0].rsplit(" ", 1)[1]) > 1.0, metrics
