"""The training script's own prometheus_client metrics, served by muster (issue 22).

- the issue's snippet (`Gauge("training_loss", ...)`, `start_http_server(<muster's port>)`) on
  two ranks of a real gloo job: both train to the end and exit 0; muster's /metrics holds
  `training_loss` per rank next to `muster_*`; promtool accepts it; a real Prometheus scrapes it;
  a server on another port is the script's own, untouched; a user's sitecustomize still runs;
- a restart in the middle: the merged values are the current attempt's;
- `--metrics-addr none`: the script binds the port itself, with no multiprocess environment;
- a user's own PROMETHEUS_MULTIPROC_DIR is served as prometheus_client would, and left alone.

Needs promtool and prometheus (scripts/system-deps.sh).
"""

import os
import subprocess
import threading
import time

import pytest

from conftest import free_port, muster_bin, torch_python, wait_until
from test_metrics import Prometheus, http_get, need, samples, value

pytestmark = pytest.mark.timeout(300)

SNIPPET = r"""
import os, sys, time
from pathlib import Path
from prometheus_client import Counter, Gauge, start_http_server

ctl = Path(os.environ["CTL"])
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

# The issue's snippet, on muster's port (8000 in a pod; the test's free port here).
loss_gauge = Gauge("training_loss", "Current training loss")
steps = Counter("training_steps", "Optimizer steps taken")
start_http_server(int(os.environ["SCRIPT_PORT"]))
if rank == 0 and os.environ.get("OTHER_PORT"):
    start_http_server(int(os.environ["OTHER_PORT"]))  # any other port is the script's own
(ctl / f"env-{attempt}-{rank}").write_text(
    os.environ.get("PROMETHEUS_MULTIPROC_DIR", "") + "\n" + os.environ.get("MUSTER_METRICS_PORT", ""))

def wait_for(name, limit=180):
    deadline = time.monotonic() + limit
    while not (ctl / name).exists():
        if time.monotonic() > deadline:
            sys.exit(70)
        time.sleep(0.05)

if os.environ.get("NO_TORCH"):
    loss_gauge.set(0.25 + rank)
    steps.inc(3)
    (ctl / f"trained-{attempt}-{rank}").write_text(repr(0.25 + rank))
    wait_for("finish")
    sys.exit(0)

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.manual_seed(rank)
x = torch.randn(64, 4)
y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(64)
w = torch.zeros(4, requires_grad=True)
n_steps = int(os.environ.get("STEPS", "20"))
for step in range(n_steps):
    loss = ((x @ w - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        dist.all_reduce(w.grad)
        w -= 0.05 * w.grad / dist.get_world_size()
        w.grad.zero_()
    # A per-attempt offset, so the test can tell which attempt a value came from.
    loss_gauge.set(loss.item() + 1000 * attempt)
    steps.inc()
final = loss_gauge._value.get()
(ctl / f"trained-{attempt}-{rank}").write_text(repr(final))
if attempt == 0 and rank == 1 and os.environ.get("FAIL_FIRST"):
    wait_for("fail")
    sys.exit(3)
wait_for(f"finish-{attempt}" if os.environ.get("FAIL_FIRST") else "finish")
dist.destroy_process_group()
"""

USER_SITECUSTOMIZE = r"""
import os
from pathlib import Path
if os.environ.get("RANK") is not None and os.environ.get("CTL"):
    (Path(os.environ["CTL"]) / f"user-sitecustomize-{os.environ['RANK']}").touch()
"""


class Launch:
    """`muster --standalone` on a script, its output collected."""

    def __init__(self, tmp, args, env):
        self.ctl = tmp / "ctl"
        self.ctl.mkdir()
        script = tmp / "train.py"
        script.write_text(SNIPPET)
        full_env = dict(os.environ, PYTHON_EXEC=torch_python(), CTL=str(self.ctl))
        for k in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
            full_env.pop(k, None)
        full_env.update(env)
        self.proc = subprocess.Popen(
            [muster_bin(), "--standalone", *args, str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=tmp)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self):
        return "".join(self.lines)

    def wait_files(self, names, timeout=180):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"muster exited {self.proc.returncode}:\n{self.output()}")
            return all((self.ctl / n).exists() for n in names)
        wait_until(ready, timeout, interval=0.1, what=f"{names}")

    def finish(self, name="finish", timeout=60):
        (self.ctl / name).touch()
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=5)
        return code

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def metrics(port):
    status, _, body = http_get(("127.0.0.1", port), "/metrics", timeout=10)
    assert status == 200
    return body


def promtool_check(body):
    result = subprocess.run([need("promtool"), "check", "metrics"], input=body,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_snippet_on_two_ranks_is_served_by_muster_with_rank_labels(tmp_path):
    port, other = free_port(), free_port()
    user = tmp_path / "user-site"
    user.mkdir()
    (user / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    launch = Launch(tmp_path, ["--nproc-per-node", "2", "--metrics-addr", f"127.0.0.1:{port}"],
                    {"SCRIPT_PORT": str(port), "OTHER_PORT": str(other),
                     "PYTHONPATH": str(user)})
    prom = None
    try:
        launch.wait_files(["trained-0-0", "trained-0-1"])
        body = metrics(port)
        for rank in (0, 1):
            final = float((launch.ctl / f"trained-0-{rank}").read_text())
            assert value(body, "training_loss", rank=str(rank), local_rank=str(rank)) == final
            assert value(body, "training_steps_total", rank=str(rank)) == 20
        series = [k for k in samples(body) if k[0] == "training_loss"]
        assert len(series) == 2, series  # one per rank, no pid label
        assert value(body, "muster_world_size") == 2
        assert "# TYPE training_loss gauge" in body
        assert "# TYPE training_steps_total counter" in body
        promtool_check(body)

        # Each rank had its own directory, beside its error file in muster's private run
        # directory (torchrun's attempt_<N>/<local rank>), and muster's port.
        dirs = {(launch.ctl / f"env-0-{r}").read_text().split("\n")[0] for r in (0, 1)}
        assert len(dirs) == 2 and all(d.endswith(f"/attempt_0/{r}") for d, r in zip(sorted(dirs), (0, 1))), dirs
        assert (launch.ctl / "env-0-0").read_text().split("\n")[1] == str(port)
        # Another port is the script's own server, serving that process's registry.
        status, _, own = http_get(("127.0.0.1", other), "/metrics", timeout=10)
        assert status == 200 and "training_loss" in own
        # A sitecustomize of the user's own still ran in every rank.
        assert all((launch.ctl / f"user-sitecustomize-{r}").exists() for r in (0, 1))

        prom = Prometheus(tmp_path, ("127.0.0.1", port))
        prom.wait_for("count(training_loss)", 2, timeout=60)
        prom.wait_for('training_steps_total{rank="1",local_rank="1"}', 20, timeout=30)
        assert prom.scalar('up{job="muster"}') == 1

        assert launch.finish() == 0, launch.output()
        out = launch.output()
        assert out.count(f"start_http_server({port}) skipped") == 2, out
        assert "Address already in use" not in out, out
        assert "has the name of one of muster's own" not in out
        # The ranks' files go with the agent.
        assert not any(os.path.exists(d) for d in dirs)
    finally:
        if prom:
            prom.stop()
        launch.stop()


def test_after_a_restart_the_merged_values_are_the_current_attempts(tmp_path):
    port = free_port()
    launch = Launch(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "1",
                               "--metrics-addr", f"127.0.0.1:{port}"],
                    {"SCRIPT_PORT": str(port), "FAIL_FIRST": "1", "STEPS": "30"})
    try:
        launch.wait_files(["trained-0-0", "trained-0-1"])
        body = metrics(port)
        assert value(body, "training_steps_total", rank="0") == 30
        assert value(body, "training_loss", rank="1") < 1000
        (launch.ctl / "fail").touch()
        launch.wait_files(["trained-1-0", "trained-1-1"])
        body = metrics(port)
        promtool_check(body)
        for rank in (0, 1):
            final = float((launch.ctl / f"trained-1-{rank}").read_text())
            assert final >= 1000
            assert value(body, "training_loss", rank=str(rank)) == final
            # Attempt 1's count only, not 30 + 30.
            assert value(body, "training_steps_total", rank=str(rank)) == 30
        assert len([k for k in samples(body) if k[0] == "training_loss"]) == 2
        assert value(body, "muster_restarts_total", cause="worker_failure") == 1
        assert launch.finish("finish-1") == 0, launch.output()
    finally:
        launch.stop()


def test_metrics_addr_none_leaves_the_port_and_the_environment_to_the_script(tmp_path):
    port = free_port()
    launch = Launch(tmp_path, ["--nproc-per-node", "1", "--metrics-addr", "none"],
                    {"SCRIPT_PORT": str(port), "NO_TORCH": "1"})
    try:
        launch.wait_files(["trained-0-0"])
        assert (launch.ctl / "env-0-0").read_text() == "\n"
        status, _, body = http_get(("127.0.0.1", port), "/metrics", timeout=10)
        assert status == 200
        assert value(body, "training_loss") == 0.25
        assert "muster_" not in body
        assert launch.finish() == 0, launch.output()
        assert "skipped" not in launch.output()
    finally:
        launch.stop()


def test_a_users_own_multiproc_dir_is_served_whole_and_kept(tmp_path):
    port = free_port()
    mine = tmp_path / "mine"
    mine.mkdir()
    launch = Launch(tmp_path, ["--nproc-per-node", "2", "--metrics-addr", f"127.0.0.1:{port}"],
                    {"SCRIPT_PORT": str(port), "NO_TORCH": "1",
                     "PROMETHEUS_MULTIPROC_DIR": str(mine)})
    try:
        launch.wait_files(["trained-0-0", "trained-0-1"])
        assert all((launch.ctl / f"env-0-{r}").read_text().split("\n")[0] == str(mine)
                   for r in (0, 1))
        body = metrics(port)
        promtool_check(body)
        # prometheus_client's own rules for one shared directory: counters summed, gauges in mode
        # `all` one series per pid; no rank labels (muster cannot tell the ranks' files apart).
        assert value(body, "training_steps_total") == 6
        losses = sorted(v for (n, _), v in samples(body).items() if n == "training_loss")
        assert losses == [0.25, 1.25]
        assert all(dict(l).keys() == {"pid"} for (n, l) in samples(body) if n == "training_loss")
        assert launch.finish() == 0, launch.output()
        assert len(list(mine.glob("*.db"))) >= 2
    finally:
        launch.stop()
