"""The agent's HTTP endpoint as other pods on the network see it.

- Issue #18: 1,000 hostile connections from another address (idle, slow, oversized heads,
  open/close churn) do not starve the probes: `/healthz` and `/readyz`, polled every 100 ms from
  127.0.0.1 while the attack runs from 127.0.0.2, answer 200 every time; a Prometheus-format
  scrape succeeds; the agent's memory stays bounded. The latency distribution, quiet and under
  attack, is printed (`-s`).
- Issue #12: `POST /checkpoint` from a non-loopback address is refused (403; with
  `--checkpoint-token-file`, 401 without the right bearer token) and the job keeps training; from
  loopback, or with the token, it triggers the checkpoint barrier.
"""

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port, muster_bin, stop_process, torch_python, wait_until

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).resolve().parent
CKPT_WORKER = str(HERE / "scripts" / "ckpt_worker.py")


def request(addr, method, path, headers=(), source=None, timeout=5.0):
    """(status, body, seconds) of one request on a fresh connection, like a kubelet probe."""
    start = time.perf_counter()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        if source:
            sock.bind((source, 0))
        sock.connect(addr)
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        if method == "POST":
            head += "Content-Length: 0\r\n"
        head += "".join(f"{h}\r\n" for h in headers) + "\r\n"
        sock.sendall(head.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    elapsed = time.perf_counter() - start
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        raise ConnectionError(f"no reply to {method} {path}")
    return int(head.split()[1]), body.decode(), elapsed


class Agent:
    """One `muster` agent serving its endpoint on 0.0.0.0:PORT (every interface, as in a pod)."""

    def __init__(self, args, cwd=None, env=None):
        self.port = free_port()
        full_env = dict(os.environ, PYTHON_EXEC=torch_python())
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [muster_bin(), "--metrics-addr", f"0.0.0.0:{self.port}", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=cwd,
            start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                       daemon=True)
        self.reader.start()
        self.addr = ("127.0.0.1", self.port)
        wait_until(self._serving, 30, what="the agent's endpoint")

    def _serving(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited {self.proc.returncode}: {self.output()}")
        try:
            return request(self.addr, "GET", "/healthz", timeout=2)[0] == 200
        except OSError:
            return False

    def output(self):
        return "".join(self.lines)

    def rss_kib(self):
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))

    def stop(self):
        stop_process(self.proc, 20)
        self.reader.join(timeout=5)
        return self.proc.returncode


def percentiles(seconds):
    ms = sorted(s * 1000 for s in seconds)
    return {"n": len(ms), "p50": statistics.median(ms),
            "p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))], "max": ms[-1]}


def probe_for(addr, duration, rss, agent):
    """Polls /healthz and /readyz every 100 ms each for `duration` s; returns the answers."""
    answers = []
    end = time.monotonic() + duration
    next_at = time.monotonic()
    while time.monotonic() < end:
        for path in ("/healthz", "/readyz"):
            try:
                status, _, took = request(addr, "GET", path, timeout=5)
            except OSError as e:
                status, took = f"error: {e}", 5.0
            answers.append((path, status, took))
        rss.append(agent.rss_kib())
        next_at += 0.1
        time.sleep(max(0.0, next_at - time.monotonic()))
    return answers


def can_bind(source):
    with socket.socket() as s:
        try:
            s.bind((source, 0))
            return True
        except OSError:
            return False


@pytest.mark.skipif(not can_bind("127.0.0.2"), reason="127.0.0.2 is not a local address here")
def test_probes_are_answered_while_another_address_holds_a_thousand_hostile_connections(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    agent = Agent(["--nproc-per-node", "1", "--no-python", "sleep", "120"])
    hostile = None
    try:
        wait_until(lambda: request(agent.addr, "GET", "/readyz")[0] == 200, 30, what="/readyz")
        quiet_rss = []
        quiet = probe_for(agent.addr, 5, quiet_rss, agent)
        assert all(status == 200 for _, status, _ in quiet), quiet

        stats_path = tmp_path / "hostile.json"
        hostile = subprocess.Popen(
            [sys.executable, str(HERE / "hostile_clients.py"), f"127.0.0.1:{agent.port}",
             "127.0.0.2", "250", "23", str(stats_path)])
        time.sleep(2)  # let the attack reach its full size
        attack_rss = []
        scrapes = []
        stop_scraping = threading.Event()

        def scraper():
            while not stop_scraping.wait(2):
                status, body, took = request(agent.addr, "GET", "/metrics", timeout=5)
                names = {f.name for f in text_string_to_metric_families(body)}
                scrapes.append((status, "muster_build_info" in names, took))

        scraping = threading.Thread(target=scraper, daemon=True)
        scraping.start()
        attacked = probe_for(agent.addr, 20, attack_rss, agent)
        stop_scraping.set()
        scraping.join(timeout=10)
        assert hostile.wait(timeout=30) == 0
        stats = json.loads(stats_path.read_text())

        quiet_p = percentiles([t for _, _, t in quiet])
        attack_p = percentiles([t for _, _, t in attacked])
        per_path = {p: percentiles([t for q, _, t in attacked if q == p])
                    for p in ("/healthz", "/readyz")}
        body = request(agent.addr, "GET", "/metrics")[1]
        shed = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'muster_http_connections_shed_total\{limit="(\w+)"\} (\S+)', body)}
        print(f"\nprobe latency (ms), fresh connection per probe, /healthz + /readyz every 100 ms:"
              f"\n  quiet:        {quiet_p}"
              f"\n  under attack: {attack_p}"
              f"\n    /healthz:   {per_path['/healthz']}\n    /readyz:    {per_path['/readyz']}"
              f"\nagent RSS (MiB): quiet max {max(quiet_rss) / 1024:.1f}, "
              f"under attack max {max(attack_rss) / 1024:.1f}"
              f"\nscrapes under attack: {[(s, ok, round(t * 1000, 1)) for s, ok, t in scrapes]}"
              f"\nhostile clients: {stats}\nserver shed connections: {shed}")

        # Every probe answered 200, well inside the kubelet's default 1 s probe timeout (the
        # 100 ms p99 target is measured and reported above, not asserted on a shared machine).
        bad = [a for a in attacked if a[1] != 200]
        assert not bad, bad[:10]
        assert attack_p["max"] < 1000, attack_p
        assert len(attacked) >= 300, "the prober did not keep its rate"
        # A Prometheus-format scrape succeeded during the attack.
        assert scrapes and all(s == 200 and ok for s, ok, _ in scrapes), scrapes
        # The attack was real: all four kinds kept their 250 connections coming.
        for kind in ("idle", "slow", "oversized", "churn"):
            assert stats[kind]["opened"] >= 250, stats
        # The server closed them (evicted: the address is over its limit, so each new one
        # displaces its oldest idle one, oversized heads often before they are even read).
        for kind in ("idle", "slow", "oversized"):
            assert stats[kind]["closed_by_server"] > 0, stats
        assert shed.get("peer", 0) > 0, shed
        # Memory stays bounded: the server holds at most 256 connections of bounded buffers.
        assert max(attack_rss) < max(quiet_rss) + 32 * 1024, (max(quiet_rss), max(attack_rss))
        assert agent.proc.poll() is None, "the agent survived the attack"
    finally:
        if hostile and hostile.poll() is None:
            hostile.kill()
            hostile.wait()
        agent.stop()


# ---- who may POST /checkpoint (issue #12) --------------------------------------------------


def global_ipv4():
    """This machine's first non-loopback IPv4 address: a peer the agent must treat as remote.
    Requests are sent FROM it (bound source) TO 127.0.0.1, so no traffic targets anything but
    loopback while the agent still sees a non-loopback peer."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    return match.group(1) if match else None


REMOTE = global_ipv4()
needs_remote = pytest.mark.skipif(REMOTE is None, reason="no global IPv4 address on this machine")


def training_agent(tmp_path, extra=()):
    wrapper = tmp_path / "worker_entry.py"
    wrapper.write_text(
        "import runpy, sys\n"
        f"sys.argv = [{CKPT_WORKER!r}, '--ckpt-dir', {str(tmp_path)!r}]\n"
        f"runpy.run_path({CKPT_WORKER!r}, run_name='__main__')\n")
    return Agent(["--standalone", "--nproc-per-node", "2", "--preempted-exit-code", "200",
                  "--grace-period", "30", *extra, str(wrapper)], cwd=tmp_path)


def steps(agent):
    return [int(s) for s in re.findall(r"STEP \d+ (\d+)", agent.output())]


def wait_for_progress(agent, beyond, timeout=60):
    wait_until(lambda: agent.proc.poll() is not None or (steps(agent) and max(steps(agent)) >= beyond),
               timeout, what=f"training past step {beyond}")
    assert agent.proc.poll() is None, agent.output()


def rejected(agent, reason):
    body = request(agent.addr, "GET", "/metrics")[1]
    match = re.search(r'muster_checkpoint_requests_rejected_total\{reason="%s"\} (\S+)' % reason,
                      body)
    return float(match.group(1))


def assert_committed(agent, tmp_path):
    assert agent.proc.wait(timeout=60) == 200, agent.output()
    saved = re.findall(r"SAVED (\d+) (\d+) (\S+)", agent.output())
    assert len(saved) == 2 and all(v == "committed" for _, _, v in saved), agent.output()
    assert (tmp_path / "LATEST").exists()


@needs_remote
def test_a_remote_caller_cannot_stop_the_job_and_loopback_still_can(tmp_path):
    agent = training_agent(tmp_path)
    try:
        wait_for_progress(agent, 10)
        remote = agent.addr  # to loopback, from the non-loopback source: the peer the agent sees
        status, body, _ = request(remote, "POST", "/checkpoint", source=REMOTE)
        assert status == 403, body
        assert "only accepted from inside the pod" in body
        # GET stays open to other addresses (Prometheus, the kubelet).
        assert request(remote, "GET", "/healthz", source=REMOTE)[0] == 200
        assert request(remote, "GET", "/metrics", source=REMOTE)[0] == 200
        assert rejected(agent, "forbidden") == 1
        # The job keeps training.
        wait_for_progress(agent, max(steps(agent)) + 30)
        assert "checkpoint requested" not in agent.output()

        status, body, _ = request(agent.addr, "POST", "/checkpoint")
        assert (status, body) == (202, "checkpoint requested\n")
        assert_committed(agent, tmp_path)
    finally:
        agent.stop()


@needs_remote
def test_a_remote_caller_with_the_token_may_checkpoint(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t-t0ken\n")
    agent = training_agent(tmp_path, extra=("--checkpoint-token-file", str(token_file)))
    try:
        wait_for_progress(agent, 10)
        remote = agent.addr  # to loopback, from the non-loopback source: the peer the agent sees
        status, body, _ = request(remote, "POST", "/checkpoint", source=REMOTE)
        assert status == 401, body
        status, body, _ = request(remote, "POST", "/checkpoint", source=REMOTE,
                                  headers=["Authorization: Bearer s3cr3t-t0keN"])
        assert status == 401, body
        assert rejected(agent, "unauthorized") == 2 and rejected(agent, "forbidden") == 0
        wait_for_progress(agent, max(steps(agent)) + 20)
        assert "s3cr3t" not in agent.output(), "the token is never logged"

        status, body, _ = request(remote, "POST", "/checkpoint", source=REMOTE,
                                  headers=["Authorization: Bearer s3cr3t-t0ken"])
        assert (status, body) == (202, "checkpoint requested\n")
        assert_committed(agent, tmp_path)
    finally:
        agent.stop()


@pytest.mark.parametrize("content", [None, "", "\n", "two words\n"])
def test_an_unusable_token_file_is_a_configuration_error(tmp_path, content):
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content)
    result = subprocess.run(
        [muster_bin(), "--metrics-addr", "127.0.0.1:0", "--checkpoint-token-file",
         str(token_file), "--no-python", "true"],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 202, result.stderr
    assert str(token_file) in result.stderr, result.stderr
    # The same through the environment.
    result = subprocess.run(
        [muster_bin(), "--metrics-addr", "127.0.0.1:0", "--no-python", "true"],
        capture_output=True, text=True, timeout=30,
        env=dict(os.environ, MUSTER_CHECKPOINT_TOKEN_FILE=str(token_file)))
    assert result.returncode == 202, result.stderr
    assert str(token_file) in result.stderr, result.stderr


def test_a_checkpoint_request_before_any_worker_ran_exits_201(tmp_path):
    """Issue #33: `POST /checkpoint` while the agent still waits in the rendezvous (its peer never
    comes) has nothing to save. It is accepted (202), the agent says so in one line and exits 201,
    "preempted without a committed checkpoint" — not 143, which would name a signal nobody sent."""
    ran = tmp_path / "worker-ran"
    agent = Agent(["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                   "--rdzv-id", "lonely", "--local-addr", "127.0.0.1",
                   "--rdzv-conf", "join_timeout=600", "--no-python", "touch", str(ran)])
    try:
        # The rendezvous waits for node 1, which never comes.
        def waiting():
            assert agent.proc.poll() is None, agent.output()
            try:
                body = request(agent.addr, "GET", "/metrics", timeout=30)[1]
            except OSError:
                return False
            return (re.search(r'^muster_agent_phase\{phase="rendezvous"\} 1$', body, re.M)
                    and re.search(r"^muster_rendezvous_nodes_waiting [1-9]", body, re.M))
        wait_until(waiting, 30, what="the agent to wait for its peer")
        assert agent.proc.poll() is None, agent.output()
        status, body, _ = request(agent.addr, "POST", "/checkpoint")
        assert (status, body) == (202, "checkpoint requested\n")
        assert agent.proc.wait(timeout=60) == 201, agent.output()
        agent.reader.join(timeout=10)  # its last lines may still be in the pipe
        out = agent.output()
        assert "no attempt is running" in out and "nothing to save" in out, out
        assert "stopping without a checkpoint (exit 201)" in out, out
        assert not ran.exists(), "no worker may have started"
    finally:
        agent.stop()
