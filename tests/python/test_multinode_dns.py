"""Discovery of the rendezvous host through DNS: the worker-0 name is answered only after a
delay (or never) by a DNS server the test starts on a loopback address. The joining agent runs
in its own mount namespace with a resolv.conf pointing at that server (search domain and ndots
as in a pod), which is the real mechanism hickory-resolver reads."""

import os
import random
import shutil
import subprocess
import time

import pytest

from conftest import free_port, muster_bin, torch_python
from test_metrics import http_get
from dns_responder import DelayedDns
from test_multinode_gang import CONF, worker  # noqa: F401  (fixture)

NAME = "job-worker-0.job.default.svc.cluster.local"
SHORT = "job-worker-0.job"


def can_unshare_mount():
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not can_unshare_mount(),
                                reason="needs root and unshare -m for a private resolv.conf")


@pytest.fixture
def dns(tmp_path):
    servers = []

    def start(delay, gate=None):
        host = f"127.{random.randint(60, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
        server = DelayedDns(host, NAME, "127.0.0.1", delay, gate)
        servers.append(server)
        rc = tmp_path / "resolv.conf"
        rc.write_text(f"nameserver {host}\nsearch default.svc.cluster.local svc.cluster.local\n"
                      "options ndots:5\n")
        return server, str(rc)

    yield start
    for s in servers:
        s.stop()


def agent(rc, port, node_rank, script, conf, nnodes="2", nproc="1", extra=()):
    args = [muster_bin(), "--nnodes", nnodes, "--nproc-per-node", nproc, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{SHORT}:{port}", "--rdzv-id", "dns", "--local-addr",
            "127.0.0.1", "--rdzv-conf", conf, "--node-rank", str(node_rank), *extra, script]
    prefix = []
    if rc is not None:
        prefix = ["unshare", "-m", "sh", "-c", f'mount --bind {rc} /etc/resolv.conf && exec "$@"',
                  "sh"]
    env = dict(os.environ, PYTHON_EXEC=torch_python())
    return subprocess.Popen([*prefix, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def kill_running(*procs):
    """Kills the agents among `procs` that still run (None: one never started)."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def assert_joined_after_waiting(joiner, out1, host, out0):
    """Both agents exited 0, and the joiner's log says the name did not resolve at first, then
    did."""
    assert joiner.returncode == 0, out1
    assert host.returncode == 0, out0
    assert f"waiting for DNS: {SHORT}: NXDOMAIN" in out1, out1
    assert f"resolved {SHORT} to 127.0.0.1" in out1, out1


def test_agents_wait_for_the_worker_0_record_then_join(dns, worker):  # noqa: F811
    server, rc = dns(delay=3)
    port = free_port()
    host = agent(None, port, 0, worker, CONF)
    joiner = agent(rc, port, 1, worker, CONF)
    try:
        out1, _ = joiner.communicate(timeout=60)
        out0, _ = host.communicate(timeout=30)
    finally:
        kill_running(host, joiner)
    assert_joined_after_waiting(joiner, out1, host, out0)
    assert "Traceback" not in out1 and "IPv6" not in out1
    assert (NAME, 1) in server.queries, "the search domain was applied"
    assert "sum=1" in out0 + out1


def test_a_record_that_never_appears_times_out_naming_the_host(dns, worker):  # noqa: F811
    _, rc = dns(delay=None)
    start = time.monotonic()
    joiner = agent(rc, free_port(), 1, worker, CONF.replace("join_timeout=20", "join_timeout=3"))
    out, _ = joiner.communicate(timeout=60)
    assert joiner.returncode == 203, out
    assert f"could not resolve the rendezvous host {SHORT}" in out, out
    assert "NXDOMAIN" in out
    assert time.monotonic() - start < 20


def test_worker_0_published_only_while_node_0_is_ready_still_forms_the_gang(dns, worker):  # noqa: F811
    """Issue #23: a Service without publishNotReadyAddresses (the Kubeflow PyTorchJob's) has
    worker-0's record only while node 0 is Ready. Node 0's /readyz must therefore not wait for
    the gang: the joiner starts first and sees NXDOMAIN, node 0 turns ready once its store
    accepts connections, the record appears, the gang forms and trains."""
    port, metrics_port = free_port(), free_port()
    node0 = ("127.0.0.1", metrics_port)
    readiness = []

    def node0_ready():
        status = http_get(node0, "/readyz", timeout=0.5)[0]
        readiness.append(status)
        return status == 200

    server, rc = dns(delay=None, gate=node0_ready)
    joiner = agent(rc, port, 1, worker, CONF, nproc="2",
                   extra=("--metrics-addr", "127.0.0.1:0"))
    host = None
    try:
        time.sleep(1.5)  # the joiner looks the name up while node 0 does not even run
        assert joiner.poll() is None
        host = agent(rc, port, 0, worker, CONF, nproc="2",
                     extra=("--metrics-addr", f"127.0.0.1:{metrics_port}"))
        out1, _ = joiner.communicate(timeout=90)
        out0, _ = host.communicate(timeout=30)
    finally:
        kill_running(host, joiner)
    assert_joined_after_waiting(joiner, out1, host, out0)
    assert server.answered >= 1 and 200 in readiness, readiness
    # 4 ranks: the all-reduce of the ranks 0..3 is 6, printed by every rank.
    assert (out0 + out1).count("sum=6") == 4, out0 + out1
