"""The GPU watch during a run (`--gpu-watch-interval`): real PyTorch CPU ranks on gloo, GPUs from
the fake NVML whose fixtures in tests/fixtures/nvml/watch script what happens when (an XID at
t = 2 s, counters that rise). The fixture clock starts when the agent first loads NVML, i.e. when
the watch starts, just before the first ranks.

- a fatal XID (79, fell off the bus) stops the workers and the node with 204, naming GPU and XID;
- a non-fatal XID (94, contained ECC) with rising ECC, remap, NVLink and throttle readings is
  logged and counted in the metrics, and the job finishes with 0;
- a rank that fails after a GPU event gets the event in its summary;
- with --nnodes 1:2 the node whose GPU faulted leaves and the healthy node finishes alone.

Environment: MUSTER_BIN, MUSTER_TORCH_PYTHON (conftest), MUSTER_FAKE_NVML (default
target/release/libfake_nvml.so).
"""

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, free_port, muster_bin, muster_env, wait_until

FIXTURES = REPO / "tests" / "fixtures" / "nvml"
WATCH = FIXTURES / "watch"
HEALTHY = json.loads((FIXTURES / "healthy-hgx-h100-8gpu.json").read_text())
UNHEALTHY_GPU = 204

# Ranks mark that they run (before importing torch, so the mark proves the process was up), then
# train: one all_reduce per step until `finish` appears, or rank FAIL_RANK exits 3 when `fail`
# appears. The step's all_reduce carries whether a rank saw `finish`, so that every rank leaves
# after the same step: a rank that saw it one step before its peer left it mid all_reduce against
# a closed connection (exit 1).
WORKER = r'''
import os, sys, time
from pathlib import Path
ctl = Path(os.environ["CTL"])
rank = os.environ["RANK"]
(ctl / f"started-{rank}").write_text(str(os.getpid()))
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
(ctl / f"training-{rank}-w{dist.get_world_size()}").write_text("")
step = 0
while True:
    finish = torch.tensor([1.0 if (ctl / "finish").exists() else 0.0])
    dist.all_reduce(finish)
    step += 1
    if finish.item() > 0 or (dist.get_world_size() == 1 and step >= 20):
        break
    if (ctl / "fail").exists() and rank == os.environ.get("FAIL_RANK"):
        print(f"rank {rank} gives up at step {step}", flush=True)
        # Not sys.exit: torch's own teardown of a live gloo group while the peer is mid
        # all-reduce sometimes aborts in its C++ destructors ("terminate called without an
        # active exception", SIGABRT) instead of exiting 3; the test is about the summary.
        os._exit(3)
    time.sleep(0.05)
print(f"RESULT rank={rank} world={dist.get_world_size()} steps={step}", flush=True)
dist.destroy_process_group()
'''


def fake_nvml() -> str:
    path = os.environ.get("MUSTER_FAKE_NVML") or str(REPO / "target" / "release" / "libfake_nvml.so")
    if not Path(path).exists():
        pytest.fail(f"fake NVML not found at {path}; build it or set MUSTER_FAKE_NVML", pytrace=False)
    return path


def identity(index):
    dev = HEALTHY["devices"][index]
    return dev["uuid"], dev["pci_bus_id"]


def start(tmp_path, fixture, *flags, nproc=2, extra_env=None):
    ctl = tmp_path / "ctl"
    ctl.mkdir(exist_ok=True)
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    env = muster_env({
        "MUSTER_NVML_LIBRARY": fake_nvml(),
        "MUSTER_FAKE_NVML_FIXTURE": str(fixture),
        "CTL": str(ctl),
        **(extra_env or {}),
    })
    proc = subprocess.Popen(
        [muster_bin(), "--gpu-check", "off", "--gpu-watch-interval", "0.2",
         "--nproc-per-node", str(nproc), *flags, str(script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    return proc, ctl


def finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"muster did not end within {timeout}s:\n{err}")
    return out, err


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def sample(text, name, **labels):
    """The value of the first series `name` whose labels include `labels`, else None."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


@pytest.mark.timeout(120)
def test_a_fatal_xid_stops_the_workers_and_the_node_naming_gpu_and_xid(tmp_path):
    proc, ctl = start(tmp_path, WATCH / "xid79-gpu3-at-2s.json", "--max-restarts", "3")
    out, err = finish(proc, 90)
    assert proc.returncode == UNHEALTHY_GPU, err
    assert (ctl / "started-0").exists() and (ctl / "started-1").exists(), "the ranks never ran"
    uuid, bus = identity(3)
    fault = f"GPU 3 ({uuid}, {bus}): XID 79 (GPU has fallen off the bus) at "
    assert f"ERROR GPU fault: {fault}" in err, err
    assert f"muster: error: fatal GPU fault: {fault}" in err, err
    # No restart on a GPU that fell off the bus, and no rank finished its training.
    assert "restarting the worker group" not in err, err
    assert "RESULT" not in out, out


@pytest.mark.timeout(120)
def test_a_non_fatal_xid_and_rising_counters_are_logged_counted_and_the_job_finishes(tmp_path):
    port = free_port()
    proc, ctl = start(tmp_path, WATCH / "xid94-ecc-gpu2-at-2s.json",
                      "--metrics-addr", f"127.0.0.1:{port}")
    try:
        wait_until(lambda: (ctl / "training-0-w2").exists() and (ctl / "training-1-w2").exists(),
                   timeout=60, what="both ranks training")
        uuid2, bus2 = identity(2)
        gpu2 = {"gpu": "2", "UUID": uuid2, "pci_bus_id": bus2}

        def seen():
            text = scrape(port)
            return (sample(text, "muster_gpu_xid_errors_total", xid="94", **gpu2) == 1
                    and sample(text, "muster_gpu_throttled", gpu="4", reason="hw_thermal_slowdown") == 1
                    and (sample(text, "muster_gpu_nvlink_errors_total", gpu="5", counter="replay") or 0) > 1200)
        wait_until(seen, timeout=30, what="the scripted GPU events in /metrics")
        text = scrape(port)
        assert sample(text, "muster_gpu_ecc_uncorrected_errors_total", **gpu2) == 1
        assert sample(text, "muster_gpu_ecc_uncorrected_errors_total", gpu="1") == 0
        assert sample(text, "muster_gpu_row_remap_pending", gpu="2") == 1
        assert sample(text, "muster_gpu_lost", gpu="2") == 0
        assert sample(text, "muster_gpu_utilization_ratio", gpu="0") == pytest.approx(0.87)
        assert sample(text, "muster_gpu_memory_used_bytes", gpu="7") == 61203283968
        assert sample(text, "muster_gpu_memory_total_bytes", gpu="7") == 85520809984
        assert sample(text, "muster_gpu_power_watts", gpu="7") == pytest.approx(612.0)
        assert sample(text, "muster_gpu_temperature_celsius", gpu="7") == 58
        assert sum(1 for l in text.splitlines() if l.startswith("muster_gpu_utilization_ratio{")) == 8
        (ctl / "finish").write_text("")
        out, err = finish(proc, 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert "RESULT rank=0 world=2" in out and "RESULT rank=1 world=2" in out, out
    assert (f"WARN GPU event: GPU 2 ({uuid2}, {bus2}): XID 94 (contained ECC error) at "
            in err and "(not fatal for the node)" in err), err
    assert f"GPU 2 ({uuid2}, {bus2}): 1 new uncorrectable ECC error(s)" in err, err
    assert "row remap pending" in err and "clocks throttled: hw_thermal_slowdown" in err, err
    assert "GPU fault" not in err, err


@pytest.mark.timeout(120)
def test_a_failed_rank_s_summary_lists_the_gpu_events_before_it(tmp_path):
    proc, ctl = start(tmp_path, WATCH / "xid94-ecc-gpu2-at-2s.json", extra_env={"FAIL_RANK": "1"})
    try:
        wait_until(lambda: (ctl / "training-1-w2").exists(), timeout=60, what="rank 1 training")
        # Past the XID at 2 s (the clock started before the ranks did).
        time.sleep(2.5)
        (ctl / "fail").write_text("")
        out, err = finish(proc, 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 3, err
    uuid2, bus2 = identity(2)
    summary = err[err.index("muster: worker group failed"):]
    assert "muster:   GPU events on this node in the last 5 minutes:" in summary, summary
    line = next(l for l in summary.splitlines() if "XID 94" in l)
    assert line.startswith(f"muster:     GPU 2 ({uuid2}, {bus2}): XID 94 (contained ECC error) at "), line
    assert line.endswith("before rank 1 stopped"), line


GANG_FLAGS = ["--rdzv-backend", "c10d", "--rdzv-id", "watch", "--local-addr", "127.0.0.1",
              "--max-restarts", "3",
              "--rdzv-conf", "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=1.5"]


@pytest.mark.timeout(180)
def test_with_spare_capacity_the_faulted_node_leaves_and_the_gang_goes_on(tmp_path):
    """--nnodes 1:2: node 1's GPU 3 falls off the bus while both nodes train; node 1 exits 204
    naming GPU and XID, node 0 re-forms alone and finishes."""
    port = free_port()
    procs = []
    for rank, fixture in [(0, FIXTURES / "healthy-hgx-h100-8gpu.json"),
                          (1, WATCH / "xid79-gpu3-at-8s.json")]:
        d = tmp_path / f"node{rank}"
        d.mkdir()
        procs.append(start(d, fixture, "--nnodes", "1:2", "--node-rank", str(rank),
                           "--rdzv-endpoint", f"127.0.0.1:{port}", *GANG_FLAGS, nproc=1))
    try:
        bad_out, bad_err = finish(procs[1][0], 90)
        good_out, good_err = finish(procs[0][0], 90)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    uuid, bus = identity(3)
    assert procs[1][0].returncode == UNHEALTHY_GPU, bad_err
    assert f"fatal GPU fault: GPU 3 ({uuid}, {bus}): XID 79 (GPU has fallen off the bus)" in bad_err
    assert (procs[1][1] / "training-1-w2").exists(), "the fault came before the gang trained together"
    assert procs[0][0].returncode == 0, good_err
    assert "RESULT rank=0 world=1" in good_out, good_out
