"""Clean restarts (issue #20): an attempt owns its process tree, and a restart waits for the GPUs.

- Helpers a rank starts outside its session (`setsid`, `Popen(start_new_session=True)`, a double
  fork with setsid in between) are stopped with the attempt: after a restart only the current
  attempt's helpers exist, after muster exits none does; `--keep-strays` keeps them.
- Before a restart the agent waits until NVML (the fake, scripted by `listed_for_s`) lists none
  of the previous attempt's processes: released after 2 s → the next attempt starts after ~2 s;
  never released → 204 naming the GPU and the pids, within the bound.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import REPO, free_port, muster_bin, muster_env, wait_until

# Shared with the container e2e (tests/python/test_containers.py), which mounts this folder.
SCRIPTS = REPO / "tests" / "containers" / "scripts"
FIXTURES = REPO / "tests" / "fixtures" / "nvml"
UNHEALTHY_GPU = 204


def clean_env(**extra):
    return muster_env({"PYTHON_EXEC": sys.executable, **extra})


def helpers(token):
    """{pid: 'a<attempt>-<kind>'} of the live helpers marked with `token`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        for arg in cmdline:
            if arg.startswith(f"strays-{token}-".encode()):
                found[int(entry)] = arg.decode().split(f"strays-{token}-", 1)[1]
    return found


def kill_all(token):
    for pid in helpers(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def kill_if_running(p):
    if p.poll() is None:
        p.kill()
        p.communicate()


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(body, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
    m = re.search(r"^" + pattern + r"$", body, re.M)
    assert m, f"{name} {labels} not in metrics"
    return float(m.group(1))


KINDS = {"setsid", "newsession", "daemon"}


@pytest.mark.timeout(180)
def test_a_restart_leaves_only_the_current_attempts_helpers(tmp_path):
    token = uuid.uuid4().hex[:12]
    port = free_port()
    env = clean_env(OUT_DIR=str(tmp_path), TOKEN=token, STRAY_RANK_WAITS="1")
    p = subprocess.Popen(
        [muster_bin(), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
         "--shutdown-timeout", "2", "--metrics-addr", f"127.0.0.1:{port}",
         str(SCRIPTS / "spawn_strays.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (tmp_path / "ready-1").exists(), timeout=90, what="attempt 1's helpers")
        now = helpers(token)
        assert sorted(now.values()) == sorted(f"a1-{k}" for k in KINDS), now
        body = scrape(port)
        # Attempt 0 left three helpers; the one that ignores SIGTERM needed SIGKILL.
        assert metric(body, "muster_stray_processes_stopped_total", signal="SIGTERM") == 2
        assert metric(body, "muster_stray_processes_stopped_total", signal="SIGKILL") == 1
        (tmp_path / "finish").write_text("")
        out, err = p.communicate(timeout=60)
        assert p.returncode == 3, err
        assert helpers(token) == {}, "helpers outlived muster"
        lines = [l for l in err.splitlines() if "stray process(es)" in l]
        assert len(lines) == 2, err
        assert "stopped 3 stray process(es)" in lines[0] and "(1 with SIGKILL)" in lines[0], lines
        assert "python" in lines[0], lines
    finally:
        kill_if_running(p)
        kill_all(token)


@pytest.mark.timeout(120)
def test_helpers_go_with_a_successful_run_and_a_stop_signal(tmp_path):
    """Not only failures: a rank that exits 0 and a muster stopped by SIGTERM take their helpers
    along too."""
    token = uuid.uuid4().hex[:12]
    env = clean_env(OUT_DIR=str(tmp_path), TOKEN=token, STRAY_RANK_WAITS="0")
    p = subprocess.Popen(
        [muster_bin(), "--standalone", "--nproc-per-node", "1", "--shutdown-timeout", "2",
         "--signals-to-handle", "SIGTERM:terminate", str(SCRIPTS / "spawn_strays.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (tmp_path / "ready-0").exists(), timeout=60, what="the helpers")
        assert len(helpers(token)) == 3
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 143, err
        assert helpers(token) == {}, "helpers outlived a stopped muster"
    finally:
        kill_if_running(p)
        kill_all(token)


@pytest.mark.timeout(120)
def test_keep_strays_lets_helpers_outlive_the_attempt(tmp_path):
    token = uuid.uuid4().hex[:12]
    env = clean_env(OUT_DIR=str(tmp_path), TOKEN=token, MUSTER_KEEP_STRAYS="1")
    try:
        proc = subprocess.run(
            [muster_bin(), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
             "--shutdown-timeout", "2", str(SCRIPTS / "spawn_strays.py")],
            env=env, capture_output=True, text=True, timeout=90)
        assert proc.returncode == 3, proc.stderr
        left = sorted(helpers(token).values())
        assert left == sorted(f"a{a}-{k}" for a in (0, 1) for k in KINDS), left
        assert "stray process(es)" not in proc.stderr
    finally:
        kill_all(token)


def test_the_flags_are_documented():
    help_text = subprocess.run([muster_bin(), "--help"], capture_output=True, text=True).stdout
    docs = (REPO / "docs" / "launch.md").read_text()
    for flag in ("--keep-strays", "--gpu-release-timeout"):
        assert flag in help_text
        assert flag in docs


# ---- the GPU release wait, against the fake NVML -------------------------------------------------

def fake_nvml():
    path = os.environ.get("MUSTER_FAKE_NVML") or str(REPO / "target" / "release" / "libfake_nvml.so")
    if not Path(path).exists():
        pytest.fail(f"fake NVML not found at {path}; build it or set MUSTER_FAKE_NVML", pytrace=False)
    return path


# Above the kernel's PID_MAX_LIMIT (2^22): no process can have them, as for a process that died.
GONE = [4194400, 4194401]


def held_fixture(tmp_path, listed_for_s):
    """The healthy node, with the previous attempt's processes still listed on GPUs 0 and 3."""
    fixture = json.loads((FIXTURES / "healthy-hgx-h100-8gpu.json").read_text())
    for gpu, pid in zip((0, 3), GONE):
        proc = {"pid": pid, "used_memory_bytes": 8 << 30}
        if listed_for_s is not None:
            proc["listed_for_s"] = listed_for_s
        fixture["devices"][gpu]["processes"] = [proc]
    path = tmp_path / "held.json"
    path.write_text(json.dumps(fixture))
    return path, fixture


RANK = """import os, sys, time
from pathlib import Path
out = Path(os.environ["OUT_DIR"])
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
(out / f"started-{attempt}").write_text(repr(time.time()))
if attempt == "0":
    sys.exit(1)
while not (out / "finish").exists():
    time.sleep(0.05)
"""


def gpu_launch(tmp_path, listed_for_s, *args):
    fixture_path, fixture = held_fixture(tmp_path, listed_for_s)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    env = clean_env(OUT_DIR=str(tmp_path), MUSTER_NVML_LIBRARY=fake_nvml(),
                    MUSTER_FAKE_NVML_FIXTURE=str(fixture_path))
    p = subprocess.Popen(
        [muster_bin(), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
         "--gpu-check", "off", "--metrics-addr", f"127.0.0.1:{port}", *args, str(script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, port, fixture


@pytest.mark.timeout(120)
def test_a_restart_waits_until_the_gpus_are_released(tmp_path):
    p, port, _ = gpu_launch(tmp_path, 2.0)
    try:
        wait_until(lambda: (tmp_path / "started-1").exists(), timeout=60, what="attempt 1")
        # The fake's clock starts at the first process-list read, when the wait begins; attempt
        # 0's exit comes just before. So attempt 1 starts 2 s (and a little) after attempt 0.
        gap = float((tmp_path / "started-1").read_text()) - float((tmp_path / "started-0").read_text())
        assert 2.0 <= gap < 30, gap
        body = scrape(port)
        assert metric(body, "muster_gpu_release_wait_seconds_count", outcome="released") == 1
        assert metric(body, "muster_gpu_release_wait_seconds_sum", outcome="released") >= 1.9
        (tmp_path / "finish").write_text("")
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        waited = re.search(r"GPUs free of attempt 0 after ([0-9.]+)s", err)
        assert waited and 1.9 <= float(waited.group(1)) < 30, err
    finally:
        kill_if_running(p)


@pytest.mark.timeout(120)
def test_gpus_never_released_make_the_node_unhealthy(tmp_path):
    started = time.monotonic()
    p, _, fixture = gpu_launch(tmp_path, None, "--gpu-release-timeout", "3")
    try:
        out, err = p.communicate(timeout=90)
    finally:
        kill_if_running(p)
    elapsed = time.monotonic() - started
    assert p.returncode == UNHEALTHY_GPU, err
    assert not (tmp_path / "started-1").exists(), "attempt 1 started on held GPUs"
    for gpu, pid in zip((0, 3), GONE):
        uuid_ = fixture["devices"][gpu]["uuid"]
        assert f"GPU {gpu} ({uuid_}) held by pid(s) {pid}" in err, err
    waited = re.search(r"not released ([0-9.]+)s after attempt 0", err)
    assert waited and 3.0 <= float(waited.group(1)) < 10, err
    assert elapsed < 60, elapsed


@pytest.mark.timeout(120)
def test_a_zero_timeout_does_not_wait(tmp_path):
    p, _, _ = gpu_launch(tmp_path, None, "--gpu-release-timeout", "0")
    try:
        wait_until(lambda: (tmp_path / "started-1").exists(), timeout=60, what="attempt 1")
        (tmp_path / "finish").write_text("")
        out, err = p.communicate(timeout=60)
    finally:
        kill_if_running(p)
    assert p.returncode == 0, err
    assert "GPUs free" not in err
