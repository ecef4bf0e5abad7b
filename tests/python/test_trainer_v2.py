"""Kubeflow Trainer v2 (examples/kubernetes/trainer-v2.yaml): muster started the way Trainer's torch
runtime starts its trainer container, with exactly the environment Trainer injects, trains to the
end.

Trainer's torch plugin (kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go, read at
8c0f505) sets in the container `node` of every trainer pod:

  PET_NNODES          spec.trainer.numNodes
  PET_NPROC_PER_NODE  spec.trainer.numProcPerNode, default "auto" (kept when resourcesPerNode has
                      a GPU; Trainer itself replaces it by the CPU count when it has none)
  PET_NODE_RANK       the pod's Job completion index
  PET_MASTER_ADDR     <trainjob>-node-0-0.<trainjob>
  PET_MASTER_PORT     29500 (constants.ContainerTrainerPort)

Two agents play the two pods on loopback. The master's name is answered by the test DNS
responder (through a private resolv.conf with a pod's search path), not by /etc/hosts. The
command and the MUSTER_* settings come from the example's runtime; the script is
examples/train_ddp.py in place of the TrainJob's /workspace/train.py.

`auto` means GPUs if any, else the CPUs the agent may use (torchrun's rule; muster counts the
CPU affinity and cgroup quota, not the machine). To make the world size the same on every
machine, each agent is pinned to one CPU, so `auto` is 1 without a GPU; with GPUs it is their
count, which the test reads the way muster does (/dev/nvidiaN).
"""

import os
import random
import re
import socket
import subprocess

import pytest

from conftest import REPO, WARM_RESTART_IN_TESTS, free_port, muster_bin, torch_python
from dns_responder import DelayedDns
from test_multinode_dns import can_unshare_mount

pytestmark = [
    pytest.mark.skipif(not can_unshare_mount(),
                       reason="needs root and unshare -m for a private resolv.conf"),
    pytest.mark.timeout(300),
]

MANIFEST = REPO / "examples" / "kubernetes" / "trainer-v2.yaml"
# examples/train_ddp.py, leaving with os._exit once it returns: torch 2.15's gloo teardown at
# interpreter exit sometimes aborts (SIGABRT), and that teardown is not what these tests check.
SCRIPT = REPO / "tests" / "python" / "scripts" / "train_ddp_exit.py"
SEARCH = "default.svc.cluster.local svc.cluster.local"
TRAINER_PORT = 29500  # kubeflow/trainer constants.ContainerTrainerPort


def trainjob() -> dict:
    """The TrainJob's name and node count, and the runtime's command and MUSTER_* variables, read
    from the example (regexes: the torch venv has no YAML parser; a layout change fails here)."""
    text = MANIFEST.read_text()
    name = re.search(r"^kind: TrainJob\nmetadata:\n  name: (\S+)$", text, re.M)
    nodes = re.search(r"^  trainer:\n(?:    .*\n)*?    numNodes: (\d+)$", text, re.M)
    command = re.search(r"^ +command: \[\"(\w+)\"\]$", text, re.M)
    env = dict(re.findall(r"- name: (MUSTER_\w+)\n +value: \"([^\"]*)\"", text))
    assert name and nodes and command and env, "trainer-v2.yaml changed shape"
    return {"name": name.group(1), "nodes": int(nodes.group(1)), "command": command.group(1),
            "env": env}


def trainer_env(job: str, nodes: int, index: int, nproc: str = "auto",
                port: int = TRAINER_PORT) -> dict:
    """What Trainer's torch plugin injects into pod `index` of TrainJob `job`."""
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": f"{job}-node-0-0.{job}",
        "PET_MASTER_PORT": str(port),
    }


def test_trainer_env_is_what_trainer_injects():
    assert trainer_env("llm-tj", 3, 2) == {
        "PET_NNODES": "3", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "llm-tj-node-0-0.llm-tj", "PET_MASTER_PORT": "29500"}
    assert trainjob()["name"] == "llm-tj"


def gpu_devices() -> int:
    """GPUs as muster counts them for `auto`: the /dev/nvidiaN character devices."""
    return sum(1 for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n))


def has_pod_ip() -> bool:
    """A non-loopback address, as a pod's IP is (muster advertises it without --local-addr)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent; picks the outgoing interface
            return not s.getsockname()[0].startswith("127.")
    except OSError:
        return False


def test_a_trainjob_environment_trains_to_the_end(tmp_path):
    job = trainjob()
    assert job["command"] == "muster"
    name, nodes = job["name"], 2  # the example's shape, on 2 nodes
    fqdn = f"{name}-node-0-0.{name}.default.svc.cluster.local"
    host = f"127.{random.randint(60, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    # Published a second after start, as a headless Service's record appears once the pod has an IP.
    dns = DelayedDns(host, fqdn, "127.0.0.1", 1.0)
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {host}\nsearch {SEARCH}\noptions ndots:5\n")
    # Trainer's value is 29500; a free port keeps parallel runs apart (test_trainer_env_... pins it).
    port = free_port()
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    try:
        for index in range(nodes):
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("PET_", "MUSTER_")) and k not in (
                       "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
            env.update(job["env"])
            env.update(trainer_env(name, nodes, index, port=port))
            env["PYTHON_EXEC"] = torch_python()  # the image's python
            env.update(WARM_RESTART_IN_TESTS)
            # Each pod has port 8000 to itself; here each agent gets its own metrics port.
            env["MUSTER_METRICS_ADDR"] = f"127.0.0.1:{free_port()}"
            if not has_pod_ip():
                env["MUSTER_LOCAL_ADDR"] = "127.0.0.1"  # stands in for the pod IP
            cpu = cpus[index % len(cpus)]
            procs.append(subprocess.Popen(
                ["unshare", "-m", "sh", "-c", f'mount --bind {resolv} /etc/resolv.conf && exec "$@"',
                 "sh", muster_bin(), str(SCRIPT)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, {cpu})))
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=240)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        dns.stop()
    every = "\n".join(f"--- node {i} (exit {p.returncode}):\n{out}"
                      for i, (p, out) in enumerate(zip(procs, outs)))
    for index, p in enumerate(procs):
        assert p.returncode == 0, f"node {index} exited {p.returncode}:\n{every}"
    nproc = gpu_devices() or 1
    world = nodes * nproc
    text = "".join(outs)
    assert f"done: world size {world}," in text, text
    assert "step 20/20" in text, text
    assert "hosting the rendezvous store" in outs[0], outs[0]
    short = f"{name}-node-0-0.{name}"
    assert f"resolved {short} to 127.0.0.1" in outs[1], outs[1]
    assert (fqdn, 1) in dns.queries, "the pod's search path was applied"
