"""Metrics and probes of a running agent, checked by the real Prometheus tools.

- `promtool check metrics` accepts what a running agent serves;
- a real Prometheus server (loopback, temporary config and TSDB) scrapes the agent through an
  injected worker failure and a restart; its HTTP API shows the world size, the restart counters
  moving, and the rendezvous duration histogram;
- `/gangz` is 503 while the gang restarts and 200 when workers run; `/readyz` and `/healthz` stay
  200 throughout (readiness never depends on the gang, issue #23);
- every metric the example dashboard uses is defined by the agent;
- overhead: a scrape's median time, and supervision timing with and without 100 scrapes/s.

Needs promtool and prometheus (Debian package `prometheus`, installed by scripts/system-deps.sh).
"""

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, free_port, muster_bin, stop_process, torch_python, wait_until

pytestmark = pytest.mark.timeout(240)

ADDRESS_LINE = re.compile(r"metrics on http://([0-9.]+):(\d+)/metrics")

# Present in the agent's output only after events this suite does not cause (GPU pre-flight, step
# reports from the preemption helper, signals).
CONDITIONAL = {
    "muster_gpu_check_healthy",
    "muster_gpu_nvlink_active_links",
    "muster_worker_last_step",
    "muster_worker_last_step_age_seconds",
    "muster_signals_received_total",
    # Exported only for streams that have a log file (--log-dir with --redirects/--tee).
    "muster_worker_log_file_lines_dropped_total",
    "muster_worker_log_file_write_failures_total",
    # One series per standing finding of the straggler watch: none on a healthy job.
    "muster_straggler_finding_info",
}

WORKER = r"""
import os, signal, sys, time
from pathlib import Path

ctl = Path(os.environ["CTL"])
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
(ctl / f"started-{attempt}-{rank}").touch()

def wait_for(name, limit=120):
    deadline = time.monotonic() + limit
    while not (ctl / name).exists():
        if time.monotonic() > deadline:
            sys.exit(70)
        time.sleep(0.05)

if attempt == 0:
    if rank == 0:
        wait_for("fail")
        sys.exit(3)
    # Rank 1 ignores the agent's SIGTERM, so the gang stays in "stopping" until the SIGKILL
    # after --shutdown-timeout: a window where /gangz must say "not running" (and /readyz "ready").
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wait_for("never")
else:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    assert t.item() == 3.0, t
    (ctl / f"reduced-{rank}").touch()
    wait_for("finish")
    dist.destroy_process_group()
"""


def need(tool):
    path = shutil.which(tool)
    if not path:
        pytest.fail(f"{tool} not found; run scripts/system-deps.sh", pytrace=False)
    return path


class Agent:
    """A `muster` launch with its metrics endpoint on an ephemeral loopback port."""

    def __init__(self, args, env=None, cwd=None):
        full_env = dict(os.environ)
        full_env.setdefault("PYTHON_EXEC", torch_python())
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [muster_bin(), "--metrics-addr", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=cwd,
        )
        self.lines = []
        self.addr = None
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for reader in self._readers:
            reader.start()
        wait_until(lambda: self.addr is not None or self.proc.poll() is not None, 30,
                   what="the agent to print its metrics address")
        if self.addr is None:
            raise AssertionError(f"agent exited {self.proc.returncode}: {self.output()}")

    def _read(self, stream):
        for line in stream:
            self.lines.append(line)
            match = ADDRESS_LINE.search(line)
            if match and self.addr is None:
                self.addr = (match.group(1), int(match.group(2)))

    def output(self):
        return "".join(self.lines)

    def get(self, path, timeout=5):
        return http_get(self.addr, path, timeout)

    def stop(self, timeout=20):
        stop_process(self.proc, timeout)
        for reader in self._readers:
            reader.join(timeout=5)
        return self.proc.returncode


def http_get(addr, path, timeout=5):
    """(status, headers, body) of one GET on a fresh connection."""
    with socket.create_connection(addr, timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    if not data:
        raise ConnectionError(f"no reply to GET {path} from {addr}")
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, v in (l.split(": ", 1) for l in lines[1:])}
    return status, headers, body.decode()


def http_post(addr, path, timeout=5):
    with socket.create_connection(addr, timeout=timeout) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                     "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode(), body.decode()


def samples(text):
    """{(name, frozenset(labels)): value} from the text exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        pairs = frozenset(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(name, pairs)] = float(value)
    return out


def value(text, name, **labels):
    want = set(labels.items())
    for (n, pairs), v in samples(text).items():
        if n == name and want <= pairs:
            return v
    return None


def family_names(text):
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


class Prometheus:
    """A real Prometheus server scraping `target` every 250 ms, on loopback, in `tmp`."""

    def __init__(self, tmp, target):
        self.target = target
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(self._config())
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [
                need("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, 60, what="Prometheus to be ready")

    def _config(self):
        host, port = self.target
        return ("global:\n  scrape_interval: 250ms\n  scrape_timeout: 200ms\n"
                "scrape_configs:\n  - job_name: muster\n    static_configs:\n"
                f"      - targets: ['{host}:{port}']\n        labels: {{pod: agent-0}}\n")

    def _ready(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {Path(self.log.name).read_text()}")
        try:
            return http_get(("127.0.0.1", self.port), "/-/ready", timeout=2)[0] == 200
        except OSError:
            return False

    def query(self, expr):
        """The instant vector of `expr` as a list of (labels, value)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as resp:
            reply = json.load(resp)
        assert reply["status"] == "success", reply
        return [(r["metric"], float(r["value"][1])) for r in reply["data"]["result"]]

    def scalar(self, expr):
        result = self.query(expr)
        return result[0][1] if len(result) == 1 else None

    def wait_for(self, expr, expected, timeout=30):
        wait_until(lambda: self.scalar(expr) == expected, timeout,
                   what=f"Prometheus to see {expr} == {expected} (last: {self.query(expr)})")

    def stop(self):
        stop_process(self.proc, 20)
        self.log.close()


def test_prometheus_follows_an_agent_through_a_failure_and_a_restart(tmp_path):
    need("promtool")
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    agent = Agent(
        ["--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "3", str(script)],
        env={"CTL": str(ctl)},
        cwd=tmp_path,
    )
    prom = None
    try:
        # Served from the start; the gang signal once the first attempt's workers run.
        assert agent.get("/healthz")[0] == 200
        wait_until(lambda: agent.get("/gangz")[0] == 200, 30, what="/gangz (attempt 0)")
        assert agent.get("/readyz")[0] == 200
        status, headers, body = agent.get("/metrics")
        assert status == 200
        assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert value(body, "muster_world_size") == 2
        assert value(body, "muster_restarts_total", cause="worker_failure") == 0

        prom = Prometheus(tmp_path, agent.addr)
        prom.wait_for('up{job="muster"}', 1)
        prom.wait_for('muster_restarts_total{cause="worker_failure"}', 0)
        prom.wait_for("muster_local_workers_running", 2)

        # Inject the failure: rank 0 exits 3; rank 1 holds the gang in "stopping" for ~3 s.
        (ctl / "fail").touch()
        wait_until(lambda: agent.get("/gangz")[0] == 503, 10, interval=0.02,
                   what="/gangz not running while the gang restarts")
        status, _, reason = agent.get("/gangz")
        assert status == 503 and reason.startswith("gang not running: phase "), reason
        assert agent.get("/healthz")[0] == 200, "a restart is not a liveness failure"
        assert agent.get("/readyz")[0] == 200, "a restart is not a readiness failure"

        wait_until(lambda: all((ctl / f"reduced-{r}").exists() for r in (0, 1)), 120,
                   what="attempt 1 to all-reduce")
        assert agent.get("/gangz")[0] == 200

        status, _, body = agent.get("/metrics")
        promtool = subprocess.run([need("promtool"), "check", "metrics"], input=body,
                                  capture_output=True, text=True, timeout=30)
        assert promtool.returncode == 0, promtool.stdout + promtool.stderr
        assert value(body, "muster_worker_exits_total", code="3", signal="none") == 1
        assert value(body, "muster_worker_exits_total", code="137", signal="SIGKILL") == 1
        assert value(body, "muster_store_operations_total", store="workers", command="SET") > 0

        # The dashboard and the alerts only use what a running agent serves.
        served = family_names(body)
        for example in ("examples/grafana/muster-dashboard.json",
                        "examples/prometheus/muster-alerts.yml"):
            text = (REPO / example).read_text()
            for name in set(re.findall(r"\b(muster_\w+)", text)):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert base in served or name in served or base in CONDITIONAL, \
                    f"{example} uses {name}, which the agent does not serve"
        json.loads((REPO / "examples/grafana/muster-dashboard.json").read_text())

        # What Prometheus saw.
        prom.wait_for('muster_restarts_total{cause="worker_failure"}', 1)
        assert prom.scalar('changes(muster_restarts_total{cause="worker_failure"}[5m])') >= 1
        assert prom.scalar("muster_restarts_remaining") == 0
        assert prom.scalar("muster_world_size") == 2
        assert prom.scalar("muster_group_world_size") == 1
        prom.wait_for("muster_rendezvous_duration_seconds_count", 2)
        assert prom.scalar('muster_rendezvous_duration_seconds_bucket{le="+Inf"}') == 2
        assert prom.scalar('muster_rendezvous_rounds_total{outcome="completed"}') == 2
        assert prom.scalar('muster_worker_exits_total{code="3"}') == 1
        assert prom.scalar('muster_agent_phase{phase="running"}') == 1
        # The workers' own store operations (init_process_group, the all-reduce's keys), by the
        # next scrape after they happened: a one-node agent keeps no watcher on that store.
        workers_ops = 'sum(muster_store_operations_total{store="workers"})'
        wait_until(lambda: (prom.scalar(workers_ops) or 0) > 0, 30,
                   what=f"Prometheus to see {workers_ops} > 0")
        median = prom.scalar('quantile_over_time(0.5, scrape_duration_seconds{job="muster"}[5m])')
        longest = prom.scalar('max_over_time(scrape_duration_seconds{job="muster"}[5m])')
        print(f"\nPrometheus' scrapes of the agent: median {median * 1000:.2f} ms, "
              f"longest {longest * 1000:.2f} ms")

        (ctl / "finish").touch()
        assert agent.proc.wait(timeout=60) == 0, agent.output()
    finally:
        if prom:
            prom.stop()
        agent.stop()


def test_promtool_accepts_the_metrics_of_a_fresh_agent(tmp_path):
    promtool = need("promtool")
    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(60)\n")
    agent = Agent(["--nproc-per-node", "1", str(script)])
    try:
        wait_until(lambda: agent.get("/gangz")[0] == 200, 30, what="/gangz")
        body = agent.get("/metrics")[2]
        result = subprocess.run([promtool, "check", "metrics"], input=body,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        assert value(body, "muster_build_info", protocol="c10d-tcpstore-2.15") == 1
        assert value(body, "muster_agent_phase", phase="running") == 1
        # An operator's checkpoint request reaches the barrier; this script has no helper, so the
        # barrier falls back to stopping the workers, and the agent ends.
        status, _, reply = http_post(agent.addr, "/checkpoint")
        assert (status, reply) == (202, "checkpoint requested\n")
        agent.proc.wait(timeout=60)
        assert "checkpoint" in agent.output(), agent.output()
    finally:
        assert agent.stop() is not None


def scrape_times(addr, count):
    """Seconds per scrape over one keep-alive connection (request sent to body received)."""
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    times = []
    with socket.create_connection(addr, timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(request)
            while b"\r\n\r\n" not in buf:
                buf += sock.recv(65536)
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            while len(buf) < length:
                buf += sock.recv(65536)
            buf = buf[length:]
            times.append(time.perf_counter() - start)
    return times


def test_a_scrape_takes_under_a_millisecond(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(60)\n")
    agent = Agent(["--nproc-per-node", "2", str(script)])
    try:
        wait_until(lambda: agent.get("/gangz")[0] == 200, 30, what="/gangz")
        scrape_times(agent.addr, 20)  # warm up
        times = scrape_times(agent.addr, 200)
        median = statistics.median(times)
        p90 = sorted(times)[int(len(times) * 0.9)]
        print(f"\nscrape over keep-alive: median {median * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us")
        assert median < 0.001, f"median scrape {median * 1e3:.3f} ms"
    finally:
        agent.stop()


def run_group_once(tmp_path, scrape_rate):
    """Wall time of a 4-worker group of `sleep 1` from launch to exit, while `scrape_rate`
    scrapes per second hit the agent."""
    start = time.perf_counter()
    agent = Agent(["--nproc-per-node", "4", "--no-python", "sleep", "1"])
    stop = threading.Event()
    done = []

    def scraper():
        while not stop.is_set():
            try:
                http_get(agent.addr, "/metrics", timeout=2)
                done.append(1)
            except OSError:
                return
            stop.wait(1 / scrape_rate)

    thread = threading.Thread(target=scraper, daemon=True) if scrape_rate else None
    if thread:
        thread.start()
    try:
        assert agent.proc.wait(timeout=60) == 0, agent.output()
    finally:
        stop.set()
        if thread:
            thread.join(timeout=5)
        agent.stop()
    return time.perf_counter() - start, len(done)


def test_scraping_at_100_per_second_does_not_slow_supervision(tmp_path):
    quiet, busy, scrapes = [], [], 0
    for _ in range(3):
        quiet.append(run_group_once(tmp_path, 0)[0])
        elapsed, n = run_group_once(tmp_path, 100)
        busy.append(elapsed)
        scrapes += n
    q, b = statistics.median(quiet), statistics.median(busy)
    print(f"\n4 workers of `sleep 1`, launch to exit: quiet {q:.3f} s, "
          f"with ~100 scrapes/s {b:.3f} s ({scrapes} scrapes)")
    assert scrapes >= 150, "the scraper did not keep up its rate"
    assert b < q * 1.2 + 0.1, (quiet, busy)


# ---- two nodes -------------------------------------------------------------------------------

# Short rendezvous timings for loopback (the multinode suite uses the same).
RDZV_CONF = "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.5,heartbeat_timeout=5"

GANG_WORKER = r"""
import os, sys, time
from pathlib import Path

ctl = Path(os.environ["CTL"])
rank = int(os.environ["RANK"])

def wait_for(name, limit=120):
    deadline = time.monotonic() + limit
    while not (ctl / name).exists():
        if time.monotonic() > deadline:
            sys.exit(70)
        time.sleep(0.05)

# Until the injected failure happened, rank 0 waits for the order to fail and the others idle
# (they are stopped when the gang restarts). Driven by files, not by the attempt number, so an
# extra gang restart on a loaded machine does not change the story.
if not (ctl / "failed").exists():
    (ctl / f"up-{rank}").touch()
    if rank == 0:
        wait_for("fail")
        (ctl / "failed").touch()
        sys.exit(3)
    wait_for("never")
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size(), t
(ctl / f"reduced-{rank}").touch()
wait_for("finish")
dist.destroy_process_group()
"""


class DryRun:
    """`muster dry-run`: N agents on loopback, each printing its own metrics address."""

    LINE = re.compile(r"\[node (\d+)\].*metrics on http://([0-9.]+):(\d+)/metrics")

    def __init__(self, nnodes, args, env):
        full_env = dict(os.environ, PYTHON_EXEC=torch_python(), **env)
        self.proc = subprocess.Popen(
            [muster_bin(), "dry-run", "--nnodes", str(nnodes), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
        )
        self.lines, self.addrs = [], {}
        self._readers = [threading.Thread(target=self._read, args=(s,), daemon=True)
                         for s in (self.proc.stdout, self.proc.stderr)]
        for reader in self._readers:
            reader.start()
        wait_until(lambda: len(self.addrs) == nnodes or self.proc.poll() is not None, 60,
                   what="every agent's metrics address")
        assert len(self.addrs) == nnodes, self.output()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line)
            if match := self.LINE.search(line):
                self.addrs[int(match.group(1))] = (match.group(2), int(match.group(3)))

    def output(self):
        return "".join(self.lines)

    def stop(self):
        stop_process(self.proc, 30)
        for reader in self._readers:
            reader.join(timeout=5)


class MultiTargetPrometheus(Prometheus):
    def __init__(self, tmp, targets):
        self.targets = targets
        super().__init__(tmp, None)

    def _config(self):
        lines = ["global:", "  scrape_interval: 250ms", "  scrape_timeout: 200ms",
                 "scrape_configs:", "  - job_name: muster", "    static_configs:"]
        for node, (host, port) in sorted(self.targets.items()):
            lines += [f"      - targets: ['{host}:{port}']", f"        labels: {{pod: node-{node}}}"]
        return "\n".join(lines) + "\n"


def test_prometheus_scrapes_a_two_node_dry_run_through_a_gang_restart(tmp_path):
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(GANG_WORKER)
    job = DryRun(2, ["--nproc-per-node", "2", "--max-restarts", "3", "--shutdown-timeout", "3",
                     "--rdzv-conf", RDZV_CONF, str(script)], env={"CTL": str(ctl)})
    prom = None
    try:
        for addr in job.addrs.values():
            wait_until(lambda: http_get(addr, "/gangz")[0] == 200, 60, what="/gangz")
        prom = MultiTargetPrometheus(tmp_path, job.addrs)
        prom.wait_for('count(up{job="muster"} == 1)', 2)
        prom.wait_for('sum(muster_local_workers_running)', 4)
        assert prom.scalar("max(muster_world_size)") == 4
        assert prom.scalar("min(muster_world_size)") == 4
        assert prom.scalar("max(muster_group_world_size)") == 2
        assert prom.scalar('muster_node_rank{pod="node-1"}') == 1
        assert prom.scalar('sum(muster_store_connections{store="rendezvous"})') >= 1
        # Baselines: a loaded machine may already have re-formed the gang once.
        node0_failures = prom.scalar('muster_restarts_total{pod="node-0", cause="worker_failure"}')
        node1_peer = prom.scalar('muster_restarts_total{pod="node-1", cause="peer_failure"}')
        rounds = prom.scalar("min(muster_rendezvous_duration_seconds_count)")
        assert rounds >= 1

        (ctl / "fail").touch()
        wait_until(lambda: all((ctl / f"reduced-{r}").exists() for r in range(4)), 120,
                   what="the restarted gang to all-reduce")
        prom.wait_for('muster_restarts_total{pod="node-0", cause="worker_failure"}',
                      node0_failures + 1)
        wait_until(lambda: prom.scalar(
            'muster_restarts_total{pod="node-1", cause="peer_failure"}') >= node1_peer + 1, 30,
            what="node 1's restart after node 0's failure")
        assert prom.scalar('sum(changes(muster_restarts_total[5m]))') >= 2
        assert prom.scalar("max(muster_restarts_remaining)") <= 2
        wait_until(lambda: prom.scalar("min(muster_rendezvous_duration_seconds_count)")
                   >= rounds + 1, 30, what="the second round in the histogram")
        assert prom.scalar('min(muster_rendezvous_duration_seconds_bucket{le="+Inf"})') >= 2
        assert prom.scalar('sum(muster_worker_exits_total{code="3"})') == 1
        assert prom.scalar("max(muster_world_size)") == 4
        # The workers' own store operations (init_process_group, the all-reduce's keys), by the
        # next scrape after they happened: a one-node agent keeps no watcher on that store.
        workers_ops = 'sum(muster_store_operations_total{store="workers"})'
        wait_until(lambda: (prom.scalar(workers_ops) or 0) > 0, 30,
                   what=f"Prometheus to see {workers_ops} > 0")

        (ctl / "finish").touch()
        assert job.proc.wait(timeout=60) == 0, job.output()
    finally:
        if prom:
            prom.stop()
        job.stop()


def test_gangz_waits_for_the_missing_node_and_readyz_does_not(tmp_path):
    port = free_port()
    script = tmp_path / "wait.py"
    script.write_text("import os, time\n"
                      "while not os.path.exists(os.environ['FINISH']): time.sleep(0.05)\n")
    finish = tmp_path / "finish"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gangz",
              "--local-addr", "127.0.0.1", "--rdzv-conf", RDZV_CONF, str(script)]
    env = {"FINISH": str(finish)}
    late = Agent(["--node-rank", "1", *common], env=env)
    first = None
    try:
        # Node 1 is up, node 0 (the store host) is not: waiting, no gang, but alive and ready
        # (its readiness must not wait for another pod).
        time.sleep(1)
        status, _, reason = late.get("/gangz")
        assert status == 503 and reason.startswith("gang not running: phase "), reason
        assert late.get("/healthz")[0] == 200
        assert late.get("/readyz")[0:3:2] == (200, "ready\n")
        body = late.get("/metrics")[2]
        assert value(body, "muster_agent_ready") == 1
        assert value(body, "muster_gang_running") == 0
        body = late.get("/metrics")[2]
        assert value(body, "muster_agent_phase", phase="running") == 0
        assert value(body, "muster_rendezvous_nodes_waiting") > 0

        first = Agent(["--node-rank", "0", *common], env=env)
        wait_until(lambda: first.get("/readyz")[0] == 200, 60, what="node 0 /readyz")
        for agent in (first, late):
            wait_until(lambda: agent.get("/gangz")[0] == 200, 60, what="/gangz after the gang formed")
            body = agent.get("/metrics")[2]
            assert value(body, "muster_world_size") == 2
            assert value(body, "muster_rendezvous_nodes_waiting") == 0
            assert value(body, "muster_rendezvous_last_round", outcome="completed") == 1
        finish.touch()
        assert first.proc.wait(timeout=60) == 0, first.output()
        assert late.proc.wait(timeout=60) == 0, late.output()
    finally:
        finish.touch()
        for agent in (first, late):
            if agent:
                agent.stop()


def test_gpu_preflight_results_are_exported(tmp_path):
    """The launch's pre-flight against the fake NVML (`--gpu-check warn`: a node with two NVLink
    links down on GPU 3 still runs): per-check, per-GPU health and the node verdict."""
    fake = os.environ.get("MUSTER_FAKE_NVML") or str(REPO / "target/release/libfake_nvml.so")
    if not Path(fake).exists():
        pytest.fail(f"fake NVML not found at {fake}; build it or set MUSTER_FAKE_NVML",
                    pytrace=False)
    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(60)\n")
    agent = Agent(
        ["--gpu-check", "warn", "--nproc-per-node", "1", str(script)],
        env={
            "MUSTER_NVML_LIBRARY": fake,
            "MUSTER_FAKE_NVML_FIXTURE": str(REPO / "tests/fixtures/nvml/nvlink-gpu3-two-links-down.json"),
        },
    )
    try:
        wait_until(lambda: agent.get("/gangz")[0] == 200, 60, what="/gangz")
        body = agent.get("/metrics")[2]
        result = subprocess.run([need("promtool"), "check", "metrics"], input=body,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        assert value(body, "muster_gpu_preflight_healthy") == 0
        assert value(body, "muster_gpu_preflight_duration_seconds") > 0
        assert value(body, "muster_gpu_check_healthy", gpu="3", check="nvlink_links") == 0
        assert value(body, "muster_gpu_check_healthy", gpu="2", check="nvlink_links") == 1
        # The fixture's GPU 3 has links 5 and 11 down: 16 of 18 active; the others all 18.
        assert value(body, "muster_gpu_nvlink_active_links", gpu="3") == 16
        assert value(body, "muster_gpu_nvlink_active_links", gpu="2") == 18
        uuids = {dict(labels).get("UUID") for (name, labels) in samples(body)
                 if name == "muster_gpu_check_healthy" and dict(labels)["gpu"] != "node"}
        assert len(uuids) == 8 and "" not in uuids, uuids
        assert value(body, "muster_agent_phase", phase="running") == 1
    finally:
        agent.stop()
