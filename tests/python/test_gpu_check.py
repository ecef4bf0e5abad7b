"""`muster gpu-check` against the fake NVML: every fixture in tests/fixtures/nvml, text and JSON.

The fake (`libfake_nvml.so`, crate tests/fake-nvml) is loaded by muster through nvml-wrapper's
real dlopen path (`MUSTER_NVML_LIBRARY`) and answers from the fixture named by
`MUSTER_FAKE_NVML_FIXTURE`. Each case states the exit code and exactly which checks fail on which
GPU, and the failing GPUs are identified by the UUID and PCI bus id the fixture gave them.

Environment: MUSTER_BIN (conftest), MUSTER_FAKE_NVML (default target/release/libfake_nvml.so).
"""

import ctypes.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, muster_bin

FIXTURES = REPO / "tests" / "fixtures" / "nvml"
HEALTHY = json.loads((FIXTURES / "healthy-hgx-h100-8gpu.json").read_text())
UNHEALTHY_GPU = 204
# Short enough that the whole suite takes seconds; the fake's counters grow per read, not per
# second, so the interval does not change what the checks see.
FAST = ["--sample-interval-ms", "50", "--skip-cuda"]


def fake_nvml() -> str:
    path = os.environ.get("MUSTER_FAKE_NVML") or str(
        REPO / "target" / "release" / "libfake_nvml.so"
    )
    if not Path(path).exists():
        pytest.fail(f"fake NVML not found at {path}; build it or set MUSTER_FAKE_NVML", pytrace=False)
    return path


def run_check(fixture, *args, library=None, timeout=60):
    env = dict(os.environ)
    env["MUSTER_NVML_LIBRARY"] = library if library is not None else fake_nvml()
    if fixture is not None:
        env["MUSTER_FAKE_NVML_FIXTURE"] = str(FIXTURES / fixture)
    return subprocess.run(
        [muster_bin(), "gpu-check", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def identity(index):
    dev = HEALTHY["devices"][index]
    return dev["uuid"], dev["pci_bus_id"]


# fixture, extra args, exit code, {(check, gpu index or None)} that must fail — and nothing else.
CASES = [
    ("healthy-hgx-h100-8gpu.json", [], 0, set()),
    ("nvlink-gpu3-two-links-down.json", [], UNHEALTHY_GPU, {("nvlink_links", 3)}),
    ("nvlink-gpu5-replay-errors-growing.json", [], UNHEALTHY_GPU, {("nvlink_errors", 5)}),
    ("ecc-gpu2-volatile-uncorrectable.json", [], UNHEALTHY_GPU, {("ecc_errors", 2)}),
    ("row-remap-gpu6-pending.json", [], UNHEALTHY_GPU, {("row_remap", 6)}),
    ("recovery-action-gpu1-reset.json", [], UNHEALTHY_GPU, {("recovery_action", 1)}),
    ("fabric-initialising-then-complete.json", ["--fabric-wait", "10"], 0, set()),
    ("fabric-failed.json", [], UNHEALTHY_GPU, {("fabric", 4)}),
    ("gpu-lost-gpu7.json", [], UNHEALTHY_GPU, {("gpu_lost", 7)}),
    ("only-7-of-8-gpus.json", [], UNHEALTHY_GPU, {("device_count", None)}),
    ("mig-enabled-gpu0.json", [], UNHEALTHY_GPU, {("mig", 0)}),
    ("throttle-gpu4-hw-slowdown.json", [], UNHEALTHY_GPU, {("throttle", 4)}),
    ("not-supported-queries.json", [], 0, set()),
]


def test_every_fixture_has_a_case():
    on_disk = {p.name for p in FIXTURES.glob("*.json")}
    assert on_disk == {c[0] for c in CASES}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fixture,args,code,failing", CASES, ids=[c[0] for c in CASES])
def test_fixture_json(fixture, args, code, failing):
    proc = run_check(fixture, "--expect-gpus", "8", "--json", *FAST, *args)
    assert proc.returncode == code, proc.stderr
    report = json.loads(proc.stdout)
    assert report["verdict"] == ("unhealthy" if code else "healthy"), report["verdict"]
    fails = [c for c in report["checks"] if c["status"] == "fail"]
    got = {(c["check"], c["gpu"]["index"] if "gpu" in c else None) for c in fails}
    assert got == failing
    for c in fails:
        if "gpu" in c:
            uuid, bus = identity(c["gpu"]["index"])
            assert (c["gpu"]["uuid"], c["gpu"]["pci_bus_id"]) == (uuid, bus)
            assert c["reason"], c
    if fixture != "only-7-of-8-gpus.json":
        assert len(report["gpus"]) == 8
        assert [g["pci_bus_id"] for g in report["gpus"]] == [d["pci_bus_id"] for d in HEALTHY["devices"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fixture,args,code,failing", CASES, ids=[c[0] for c in CASES])
def test_fixture_text(fixture, args, code, failing):
    proc = run_check(fixture, "--expect-gpus", "8", *FAST, *args)
    assert proc.returncode == code, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("muster gpu-check on ")
    assert ("UNHEALTHY" in lines[0]) == bool(code)
    fail_lines = [l for l in lines if l.startswith("FAIL  ")]
    assert len(fail_lines) == len(failing), fail_lines
    for check, gpu in failing:
        who = f"GPU{gpu}" if gpu is not None else "node"
        assert any(l.split()[1:3] == [who, check] for l in fail_lines), (check, gpu, fail_lines)
        if gpu is not None:
            uuid, bus = identity(gpu)
            # The closing "Failing checks" section names the GPU by index, UUID and bus id.
            assert f"GPU {gpu} ({uuid}, {bus}) {check}:" in proc.stdout
    # One line per check per GPU for every reachable GPU, then the topology matrix.
    assert "Topology:" in proc.stdout
    if not failing:
        assert "GPU0    X     NV18" in proc.stdout


def test_link_down_shows_in_the_matrix():
    proc = run_check("nvlink-gpu3-two-links-down.json", "--expect-gpus", "8", *FAST)
    matrix = proc.stdout.split("Topology:\n", 1)[1].splitlines()
    rows = {l.split()[0]: l.split()[1:] for l in matrix[1:9]}
    assert rows["GPU3"][:8] == ["NV16"] * 3 + ["X"] + ["NV16"] * 4
    assert rows["GPU0"][:8] == ["X", "NV18", "NV18", "NV16", "NV18", "NV18", "NV18", "NV18"]
    # CPU affinity and NUMA node columns.
    assert rows["GPU3"][8:] == ["0-51,104-155", "0"]
    assert rows["GPU4"][8:] == ["52-103,156-207", "1"]
    assert "16 of 18 NVLinks active (inactive: 5, 11)" in proc.stdout


def test_fabric_wait_is_bounded():
    # The fabric completes on the 3rd/4th read; a 0.2 s wait allows one poll, so every GPU is
    # still initialising when the wait ends.
    proc = run_check(
        "fabric-initialising-then-complete.json", "--expect-gpus", "8", "--json", "--fabric-wait", "0.2", *FAST
    )
    assert proc.returncode == UNHEALTHY_GPU, proc.stderr
    report = json.loads(proc.stdout)
    fabric = [c for c in report["checks"] if c["check"] == "fabric"]
    assert [c["status"] for c in fabric] == ["fail"] * 8
    assert "not started" in fabric[6]["reason"] and "initialising" in fabric[0]["reason"]


def test_fabric_wait_reports_how_long_it_waited():
    proc = run_check("fabric-initialising-then-complete.json", "--json", "--fabric-wait", "10", *FAST)
    assert proc.returncode == 0, proc.stderr
    fabric = [c for c in json.loads(proc.stdout)["checks"] if c["check"] == "fabric"]
    assert all(c["status"] == "pass" and "after waiting" in c["reason"] for c in fabric)


def test_unsupported_queries_are_skipped_not_failed():
    proc = run_check("not-supported-queries.json", "--expect-gpus", "8", "--json", *FAST)
    assert proc.returncode == 0, proc.stderr
    by = {(c["check"], c.get("gpu", {}).get("index")): c["status"] for c in json.loads(proc.stdout)["checks"]}
    for check in ["recovery_action", "fabric", "mig", "power_limit"]:
        assert by[(check, 0)] == "skip", check


def test_count_check_needs_an_expectation():
    proc = run_check("only-7-of-8-gpus.json", "--json", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "healthy"


@pytest.mark.parametrize("library", ["/nonexistent/libnvidia-ml.so.1", ""])
def test_no_nvml_library_is_a_clear_outcome(library):
    # "" = no override: the driver's own libnvidia-ml.so.1, absent on CI machines.
    if library == "" and ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVIDIA driver")
    proc = run_check(None, "--json", "--skip-cuda", library=library)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["verdict"] == "healthy" and report["gpus"] == []
    assert report["checks"][0]["check"] == "driver"
    assert report["checks"][0]["status"] == "skip"
    assert "no NVIDIA driver" in report["checks"][0]["reason"]

    proc = run_check(None, "--expect-gpus", "8", "--skip-cuda", library=library)
    assert proc.returncode == UNHEALTHY_GPU
    assert "FAIL  node   driver           8 GPU(s) expected but no NVIDIA driver" in proc.stdout
    assert "panicked" not in proc.stderr


def test_missing_cuda_driver_fails_only_when_gpus_are_expected():
    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has libcuda")
    # The CUDA smoke test runs in a child process; cudarc panics there without libcuda and the
    # parent reports it as one clear line.
    proc = run_check("healthy-hgx-h100-8gpu.json", "--expect-gpus", "8", "--json", "--sample-interval-ms", "50")
    assert proc.returncode == UNHEALTHY_GPU, proc.stderr
    cuda = [c for c in json.loads(proc.stdout)["checks"] if c["check"] == "cuda"]
    assert len(cuda) == 1 and cuda[0]["status"] == "fail"
    assert cuda[0]["reason"].startswith("CUDA driver not found")
    assert len(cuda[0]["reason"]) < 400

    proc = run_check(None, "--json", library="/nonexistent/libnvidia-ml.so.1")
    assert proc.returncode == 0
    assert [c["check"] for c in json.loads(proc.stdout)["checks"]] == ["driver"]


def test_bad_flag_is_a_config_error():
    proc = run_check(None, "--expect-gpus", "eight", library="/nonexistent")
    assert proc.returncode == 202
    assert proc.stderr.startswith("muster: error:")


def dump_snapshot(fixture_path):
    env = dict(os.environ, MUSTER_NVML_LIBRARY=fake_nvml(), MUSTER_FAKE_NVML_FIXTURE=str(fixture_path))
    proc = subprocess.run(
        [muster_bin(), "gpu-check", "--dump-snapshot", "--sample-interval-ms", "10", "--fabric-wait", "10"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    for timing in ("sample_interval_ms", "fabric_waited_ms", "fabric_wait_limit_ms"):
        snap.pop(timing)
    return snap


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fixture", [c[0] for c in CASES])
def test_snapshot_replays_as_a_fixture(fixture, tmp_path):
    """A snapshot recorded on hardware (scripts/gpu-device-check.sh) converts into a fixture the
    fake replays with the same answers; here the "hardware" is the fake itself."""
    first = dump_snapshot(FIXTURES / fixture)
    (tmp_path / "snap.json").write_text(json.dumps(first))
    conv = subprocess.run(
        [sys.executable, str(FIXTURES / "snapshot_to_fixture.py"), str(tmp_path / "snap.json"), "replayed"],
        capture_output=True, text=True, timeout=60,
    )
    assert conv.returncode == 0, conv.stderr
    (tmp_path / "replayed.json").write_text(conv.stdout)
    assert dump_snapshot(tmp_path / "replayed.json") == first


# --- the pre-flight inside a launch (`muster [--gpu-check MODE] script.py`) ---------------------


def launch(tmp_path, fixture, *flags, timeout=120):
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    env = dict(os.environ, MUSTER_NVML_LIBRARY=fake_nvml(), MUSTER_FAKE_NVML_FIXTURE=str(FIXTURES / fixture))
    env["PYTHON_EXEC"] = sys.executable
    proc = subprocess.run(
        [muster_bin(), *flags, "--nproc-per-node", "1", str(script)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    return proc, marker.exists()


@pytest.mark.timeout(120)
def test_launch_require_refuses_a_bad_node_before_any_rank_starts(tmp_path):
    proc, ran = launch(tmp_path, "nvlink-gpu3-two-links-down.json", "--gpu-check", "require")
    assert proc.returncode == UNHEALTHY_GPU, proc.stderr
    assert not ran, "a rank started on an unhealthy node"
    uuid, bus = identity(3)
    assert f"GPU pre-flight failed on node " in proc.stderr
    assert f"GPU 3 ({uuid}, {bus}) nvlink_links: 16 of 18 NVLinks active" in proc.stderr


@pytest.mark.timeout(120)
def test_launch_warn_reports_and_still_runs(tmp_path):
    proc, ran = launch(tmp_path, "ecc-gpu2-volatile-uncorrectable.json", "--gpu-check", "warn")
    assert proc.returncode == 0, proc.stderr
    assert ran
    uuid, _ = identity(2)
    assert f"gpu pre-flight: GPU 2 ({uuid}" in proc.stderr and "ecc_errors" in proc.stderr


@pytest.mark.timeout(120)
def test_launch_require_lets_a_healthy_node_run(tmp_path):
    proc, ran = launch(tmp_path, "healthy-hgx-h100-8gpu.json", "--gpu-check", "require")
    assert proc.returncode == 0, proc.stderr
    assert ran


@pytest.mark.timeout(120)
def test_launch_off_does_not_look(tmp_path):
    # `lost` makes every health query fail; with the check off nobody asks.
    proc, ran = launch(tmp_path, "gpu-lost-gpu7.json", "--gpu-check", "off")
    assert proc.returncode == 0, proc.stderr
    assert ran and "gpu pre-flight" not in proc.stderr


GANG_WORKER = r'''
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"RESULT world={dist.get_world_size()} sum={t.item():.0f}", flush=True)
dist.destroy_process_group()
'''


@pytest.mark.timeout(150)
def test_with_spare_capacity_the_bad_node_leaves_and_the_healthy_one_proceeds(tmp_path):
    """--nnodes 1:2: the node with a bad GPU stops itself (204, naming the GPU) before joining,
    and the healthy node starts the job alone after the last call."""
    from conftest import free_port, torch_python

    script = tmp_path / "worker.py"
    script.write_text(GANG_WORKER)
    port = free_port()
    procs = []
    for rank, fixture in [(0, "healthy-hgx-h100-8gpu.json"), (1, "gpu-lost-gpu7.json")]:
        env = dict(os.environ, MUSTER_NVML_LIBRARY=fake_nvml(),
                   MUSTER_FAKE_NVML_FIXTURE=str(FIXTURES / fixture), PYTHON_EXEC=torch_python())
        env.pop("JOB_COMPLETION_INDEX", None)
        env.pop("PET_NODE_RANK", None)
        procs.append(subprocess.Popen(
            [muster_bin(), "--gpu-check", "require", "--nnodes", "1:2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gpu",
             "--local-addr", "127.0.0.1", "--node-rank", str(rank),
             "--rdzv-conf", "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=1.5",
             str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        bad_out, _ = procs[1].communicate(timeout=60)
        good_out, _ = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    uuid, bus = identity(7)
    assert procs[1].returncode == UNHEALTHY_GPU, bad_out
    assert f"GPU 7 ({uuid}, {bus}) gpu_lost" in bad_out
    assert procs[0].returncode == 0, good_out
    assert "RESULT world=1 sum=1" in good_out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("bad_rank", [1, 0])
def test_in_a_fixed_gang_one_bad_node_fails_every_node_fast_by_name(tmp_path, bad_rank):
    """--nnodes 2 (no spare capacity): the node with a bad GPU joins only to stop the gang; every
    agent exits 204 within seconds (not at the 60 s join deadline), naming node, GPU and check.
    Parametrised over the bad node being a joiner and being node 0 (the store host)."""
    from conftest import free_port

    script = tmp_path / "worker.py"
    script.write_text("raise SystemExit('a rank started on a gang with a bad GPU')\n")
    port = free_port()
    procs = []
    started = time.monotonic()
    for rank in (0, 1):
        fixture = "nvlink-gpu3-two-links-down.json" if rank == bad_rank else "healthy-hgx-h100-8gpu.json"
        env = dict(os.environ, MUSTER_NVML_LIBRARY=fake_nvml(),
                   MUSTER_FAKE_NVML_FIXTURE=str(FIXTURES / fixture), PYTHON_EXEC=sys.executable)
        env.pop("JOB_COMPLETION_INDEX", None)
        env.pop("PET_NODE_RANK", None)
        procs.append(subprocess.Popen(
            [muster_bin(), "--gpu-check", "require", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gpu",
             "--local-addr", "127.0.0.1", "--node-rank", str(rank),
             "--rdzv-conf", "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.5,heartbeat_timeout=3",
             str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=50)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    elapsed = time.monotonic() - started
    uuid, bus = identity(3)
    for p, out in zip(procs, outs):
        assert p.returncode == UNHEALTHY_GPU, out
        assert f"node rank {bad_rank} (" in out, out
        assert f"GPU 3 ({uuid}, {bus}) nvlink_links: 16 of 18 NVLinks active" in out, out
        assert "a rank started" not in out
    assert elapsed < 40, f"took {elapsed:.1f}s: the gang waited instead of failing fast"


@pytest.mark.timeout(120)
def test_ranks_see_the_gpus_in_pci_bus_order(tmp_path):
    """NVML may enumerate GPUs in another order than the bus; ranks get CUDA_DEVICE_ORDER and a
    CUDA_VISIBLE_DEVICES listing UUIDs by bus id, so cuda:LOCAL_RANK is the same GPU on every
    node. A CUDA_VISIBLE_DEVICES the user set is left alone."""
    fixture = json.loads((FIXTURES / "healthy-hgx-h100-8gpu.json").read_text())
    fixture["devices"] = fixture["devices"][::-1]  # enumeration order: highest bus first
    (tmp_path / "shuffled.json").write_text(json.dumps(fixture))
    by_bus = [d["uuid"] for d in sorted(fixture["devices"], key=lambda d: d["pci_bus_id"])]
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('DEVICES', os.environ.get('CUDA_DEVICE_ORDER'), "
                      "os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n")

    def run(**extra):
        env = dict(os.environ, MUSTER_NVML_LIBRARY=fake_nvml(),
                   MUSTER_FAKE_NVML_FIXTURE=str(tmp_path / "shuffled.json"),
                   PYTHON_EXEC=sys.executable, **extra)
        proc = subprocess.run([muster_bin(), "--gpu-check", "warn", "--nproc-per-node", "2",
                               str(script)], env=env, capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, proc.stderr
        return [line.split(" ", 1)[1].split("DEVICES ", 1)[1] for line in proc.stdout.splitlines()
                if "DEVICES " in line]

    assert run() == [f"PCI_BUS_ID {','.join(by_bus)}"] * 2
    assert run(CUDA_VISIBLE_DEVICES="3,1") == ["None 3,1"] * 2


@pytest.mark.timeout(120)
def test_numa_binding_pins_each_rank_to_its_gpus_cpus(tmp_path):
    """--numa-binding node: local rank i runs on the CPUs NVML lists for the i-th GPU by bus id
    (intersected with the CPUs the agent may use). The fixture gives each GPU one CPU."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 usable CPUs, this process may use {allowed}")
    fixture = json.loads((FIXTURES / "healthy-hgx-h100-8gpu.json").read_text())
    fixture["devices"] = fixture["devices"][:2]
    fixture["devices"][0]["cpu_affinity"] = str(allowed[0])
    fixture["devices"][1]["cpu_affinity"] = str(allowed[1])
    (tmp_path / "two.json").write_text(json.dumps(fixture))
    script = tmp_path / "affinity.py"
    script.write_text("import os\nprint('CPUS', os.environ['LOCAL_RANK'], "
                      "sorted(os.sched_getaffinity(0)), flush=True)\n")
    env = dict(os.environ, MUSTER_NVML_LIBRARY=fake_nvml(),
               MUSTER_FAKE_NVML_FIXTURE=str(tmp_path / "two.json"), PYTHON_EXEC=sys.executable)
    proc = subprocess.run([muster_bin(), "--gpu-check", "off", "--numa-binding", "node",
                           "--nproc-per-node", "2", str(script)],
                          env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    got = sorted(line.split("CPUS ", 1)[1] for line in proc.stdout.splitlines() if "CPUS " in line)
    assert got == [f"0 [{allowed[0]}]", f"1 [{allowed[1]}]"], proc.stdout

    # More ranks than GPUs: a clear configuration error, not an unbound run.
    proc = subprocess.run([muster_bin(), "--gpu-check", "off", "--numa-binding", "node",
                           "--nproc-per-node", "3", str(script)],
                          env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 202, proc.stderr
    assert "--numa-binding: 3 ranks but only 2 GPU(s)" in proc.stderr
