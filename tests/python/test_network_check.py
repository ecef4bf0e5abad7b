"""The gang's network pre-flight (--network-check) on a real network: one muster agent per network
namespace, joined by veth pairs to a bridge that lives in a namespace of its own (the host's
bridge netfilter and Docker's FORWARD DROP would otherwise drop bridged traffic). One node's link
is slowed with `tbf` on both ends of its veth (this kernel has no netem). Needs root; names start
with `mnc` and carry the test's pid, so parallel runs do not collide."""

import os
import re
import shutil
import signal
import subprocess
import threading

import pytest

from conftest import WARM_RESTART_IN_TESTS, muster_bin, torch_python

CONF = "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3"
SUBNET = "10.77.0"
PORT = 29500
IFNAME = "mnceth"

WORKER = r'''
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([1.0])
dist.all_reduce(t)
print(f"RESULT group={os.environ['GROUP_RANK']} world={dist.get_world_size()} sum={t.item():.0f}",
      flush=True)
if os.environ.get("MNC_SCRAPE"):
    # The check ended before this worker started: its agent's metrics say what it measured.
    import urllib.request
    body = urllib.request.urlopen(os.environ["MNC_SCRAPE"], timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith("muster_network_"):
            print(f"METRIC {line}", flush=True)
dist.destroy_process_group()
'''
METRICS_PORT = 9477


def sh(*args):
    subprocess.run(args, check=True, capture_output=True, text=True)


def can_make_namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    name = f"mncprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


pytestmark = pytest.mark.skipif(not can_make_namespaces(),
                                reason="needs root, ip, tc and network namespaces")


class Net:
    """N namespaces `mnc<pid>n<i>` with 10.77.0.<i+1> on `mnceth`, bridged in `mnc<pid>br`."""

    def __init__(self, n):
        self.tag = f"mnc{os.getpid() % 100000}"
        self.n = n
        self.bridge_ns = f"{self.tag}br"
        self.created = []

    def ns(self, i):
        return f"{self.tag}n{i}"

    def addr(self, i):
        return f"{SUBNET}.{i + 1}"

    def up(self):
        sh("ip", "netns", "add", self.bridge_ns)
        self.created.append(self.bridge_ns)
        br = ["ip", "-n", self.bridge_ns]
        sh(*br, "link", "add", "br0", "type", "bridge")
        sh(*br, "link", "set", "br0", "up")
        for i in range(self.n):
            ns = self.ns(i)
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            inner, outer = f"{self.tag}a{i}", f"{self.tag}b{i}"
            sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "link", "set", outer, "netns", self.bridge_ns)
            sh("ip", "-n", ns, "link", "set", inner, "name", IFNAME)
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh(*br, "link", "set", outer, "master", "br0")
            sh(*br, "link", "set", outer, "up")

    def slow(self, i, rate="8mbit"):
        """Rate-limits node i's link both ways: tbf on its end and on the bridge's end."""
        tbf = ["root", "tbf", "rate", rate, "burst", "16kb", "latency", "100ms"]
        sh("ip", "netns", "exec", self.ns(i), "tc", "qdisc", "add", "dev", IFNAME, *tbf)
        sh("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "add", "dev",
           f"{self.tag}b{i}", *tbf)

    def down(self):
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def net():
    made = []

    def make(n):
        net = Net(n)
        made.append(net)
        net.up()
        return net

    yield make
    for n in made:
        n.down()


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def run_gang(net, worker, nnodes, mode, timeout=120, scrape=False):
    """Starts one agent per namespace (node rank = namespace index) and waits for all of them.
    `scrape`: each agent serves metrics on its namespace's loopback and its worker prints the
    network check's series (`METRIC ...` lines)."""
    procs, outputs = [], []
    for i in range(net.n):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PET_", "MUSTER_")) and k != "JOB_COMPLETION_INDEX"}
        env.update(PYTHON_EXEC=torch_python(), GLOO_SOCKET_IFNAME=IFNAME, **WARM_RESTART_IN_TESTS)
        metrics_addr = f"127.0.0.1:{METRICS_PORT}" if scrape else "none"
        if scrape:
            env["MNC_SCRAPE"] = f"http://{metrics_addr}/metrics"
        args = ["ip", "netns", "exec", net.ns(i), muster_bin(), "--nnodes", nnodes,
                "--nproc-per-node", "1", "--node-rank", str(i), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{net.addr(0)}:{PORT}", "--rdzv-id", "mnc",
                "--local-addr", net.addr(i), "--rdzv-conf", CONF, "--metrics-addr", metrics_addr,
                "--network-check", mode, worker]
        p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        lines = []
        p.reader = threading.Thread(target=lambda p=p, lines=lines: lines.extend(p.stdout),
                                    daemon=True)
        p.reader.start()
        procs.append(p)
        outputs.append(lines)
    done = []
    for p, lines in zip(procs, outputs):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            p.wait()
        p.reader.join(timeout=10)
        done.append((p.returncode, "".join(lines)))
    return done


def findings(text):
    return re.findall(r"network check: (slow (?:node|link).*)", text)


def metrics(text):
    """{(name, frozenset of label pairs): value} from a worker's `METRIC` lines (after the
    agent's `[host:rank] ` prefix)."""
    out = {}
    for m in re.finditer(r"^(?:\[[^\]]*\] )?METRIC (\w+)(?:\{(.*)\})? (\S+)$", text, re.M):
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def peer_series(values, name):
    """{(peer_node_rank, direction, round): value} of one per-peer family."""
    return {(d["peer_node_rank"], d["direction"], d["round"]): v
            for (n, labels), v in values.items() if n == name for d in [dict(labels)]}


def test_a_clean_network_has_no_finding(net, worker):
    n = net(4)
    out = run_gang(n, worker, "4", "warn")
    everything = "\n".join(t for _, t in out)
    assert [c for c, _ in out] == [0] * 4, everything
    assert "network check took" in out[0][1], out[0][1]
    assert "no slow node or link" in out[0][1], out[0][1]
    assert not findings(everything), everything
    assert everything.count("world=4") == 4, everything


def test_warn_names_the_slow_node_and_trains_anyway(net, worker):
    n = net(4)
    n.slow(2)
    out = run_gang(n, worker, "4", "warn", scrape=True)
    everything = "\n".join(t for _, t in out)
    assert [c for c, _ in out] == [0] * 4, everything
    for rank, (_, text) in enumerate(out):
        values = metrics(text)
        def value(name, **labels):
            return values.get((name, frozenset(labels.items())), -1.0)

        assert value("muster_network_checks_total", result="finding") == 1, text
        assert value("muster_network_check_findings", kind="node") == 1, text
        assert value("muster_network_check_named") == (rank == 2), text
        assert value("muster_network_check_duration_seconds") > 0, text
        slow = peer_series(values, "muster_network_peer_slow")
        rtt = peer_series(values, "muster_network_peer_rtt_seconds")
        rate = peer_series(values, "muster_network_peer_throughput_bytes_per_second")
        # Round 1's ring: every node measured the next one and was measured by the one before.
        ring_out = (str((rank + 1) % 4), "out", "1")
        ring_in = (str((rank - 1) % 4), "in", "1")
        assert {ring_out, ring_in} <= set(slow), text
        assert set(rtt) <= set(rate) == set(slow), text
        # Every measurement with node 2 is slow (a passing hiccup may mark another one slow too:
        # round 2 keeps it from being a finding, not from being exported).
        with_2 = [k for k in slow if rank == 2 or k[0] == "2"]
        assert with_2 and all(slow[k] for k in with_2), text
        assert all(v > 0 for v in rtt.values()), text
        fast = [rate[k] for k in rate if not slow[k]]
        assert all(rate[k] < min(fast, default=float("inf")) for k in with_2), text
    for _, text in out:
        found = findings(text)
        assert len(found) == 1, text
        assert found[0].startswith(f"slow node: node rank 2 (") and f"{n.addr(2)})" in found[0], text
        assert "MB/s against a gang median of" in found[0], text
    # Node 0 logs the table of every measurement.
    assert re.search(r"^1\s+1 \(.*\) -> 2 \(.*\)\s+[\d.]+\s+[\d.]+\s+slow", out[0][1], re.M), out[0][1]


def test_require_ends_the_round_for_every_node_with_208(net, worker):
    n = net(4)
    n.slow(2)
    out = run_gang(n, worker, "4", "require")
    for code, text in out:
        assert code == 208, text
        assert "network check failed: slow node: node rank 2 (" in text, text
        assert "RESULT" not in text, text


def test_min_max_trains_without_the_slow_node(net, worker):
    n = net(4)
    n.slow(3)
    out = run_gang(n, worker, "3:4", "require")
    code, text = out[3]
    assert code == 208, text
    assert "slow node: node rank 3 (" in text and "this node leaves the job" in text, text
    for code, text in out[:3]:
        assert code == 0, text
        assert "forming a new round without the named node(s)" in text, text
        assert "world=3 sum=3" in text, text
