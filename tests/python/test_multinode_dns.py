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

    def start(delay):
        host = f"127.{random.randint(60, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
        server = DelayedDns(host, NAME, "127.0.0.1", delay)
        servers.append(server)
        rc = tmp_path / "resolv.conf"
        rc.write_text(f"nameserver {host}\nsearch default.svc.cluster.local svc.cluster.local\n"
                      "options ndots:5\n")
        return server, str(rc)

    yield start
    for s in servers:
        s.stop()


def agent(rc, port, node_rank, script, conf, nnodes="2"):
    args = [muster_bin(), "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{SHORT}:{port}", "--rdzv-id", "dns", "--local-addr",
            "127.0.0.1", "--rdzv-conf", conf, "--node-rank", str(node_rank), script]
    prefix = []
    if rc is not None:
        prefix = ["unshare", "-m", "sh", "-c", f'mount --bind {rc} /etc/resolv.conf && exec "$@"',
                  "sh"]
    env = dict(os.environ, PYTHON_EXEC=torch_python())
    return subprocess.Popen([*prefix, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_agents_wait_for_the_worker_0_record_then_join(dns, worker):  # noqa: F811
    server, rc = dns(delay=3)
    port = free_port()
    host = agent(None, port, 0, worker, CONF)
    joiner = agent(rc, port, 1, worker, CONF)
    try:
        out1, _ = joiner.communicate(timeout=60)
        out0, _ = host.communicate(timeout=30)
    finally:
        for p in (host, joiner):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert joiner.returncode == 0, out1
    assert host.returncode == 0, out0
    assert f"waiting for DNS: {SHORT}: NXDOMAIN" in out1, out1
    assert f"resolved {SHORT} to 127.0.0.1" in out1, out1
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
