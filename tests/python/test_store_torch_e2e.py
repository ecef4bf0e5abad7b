"""End to end: real PyTorch jobs whose only store is `muster store`.

(a) Four plain processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and
    TORCHELASTIC_USE_AGENT_STORE=True run `init_process_group("gloo", "env://")` (every rank is a
    store client) and a checked all-reduce. The same job against torch's own libuv server proves
    the test itself. The worker leaves with `os._exit` after its barrier and result: torch 2.4.1's
    gloo teardown deadlocks now and then (with either server; an upstream flake, diagnosed in
    tools/allreduce_worker.py), and everything that talks to the store has returned before.
(b) Two real `torchrun` agents rendezvous through muster (`--rdzv-backend c10d --rdzv-conf
    is_host=0`) and run a two-worker job that all-reduces.
"""

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import torch_python
from store_harness import NODNS, Server, torch_host  # noqa: F401  (fixture)

WORKER = str(Path(__file__).resolve().parent / "tools" / "allreduce_worker.py")


def _wait_all(procs, timeout):
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = "\n".join(p.communicate()[0] or "" for p in procs)
        done = logs.count("allreduce ok ")
        # Named so nobody blames the store for it: with every result printed, the store's work
        # was done (the worker's os._exit makes this unlikely; see allreduce_worker.py).
        hint = (f" (all {done} results printed: a hang after them is torch's teardown, "
                "not the store's)" if done >= len(procs) else "")
        pytest.fail(f"job did not finish within {timeout}s{hint}:\n{logs[-6000:]}", pytrace=False)
    return outs


def _env(**extra):
    env = dict(os.environ)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["muster", "torch-libuv"])
def test_env_init_four_ranks(torch_host, kind):  # noqa: F811
    server = Server(kind, torch_host)
    try:
        procs = [
            subprocess.Popen(
                [NODNS, torch_python(), WORKER],
                env=_env(
                    RANK=str(r), WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(server.port), TORCHELASTIC_USE_AGENT_STORE="True",
                    # what an agent sets beside it; torch before 2.5 reads it for the prefix
                    TORCHELASTIC_RESTART_COUNT="0",
                ),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for r in range(4)
        ]
        outs = _wait_all(procs, 150)
        for r, (p, out) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-4000:]}"
            assert f"allreduce ok rank={r} world=4 sum=10" in out, out[-4000:]
        assert server.alive()
    finally:
        server.stop()


def _torchrun():
    exe = Path(torch_python()).parent / "torchrun"
    return [str(exe)] if exe.exists() else [torch_python(), "-m", "torch.distributed.run"]


@pytest.mark.timeout(240)
def test_two_torchrun_agents_rendezvous_through_muster(torch_host):  # noqa: F811
    # MUSTER_E2E_RDZV_SERVER=torch-libuv runs the same job against torch's server (proves the test)
    server = Server(os.environ.get("MUSTER_E2E_RDZV_SERVER", "muster"), torch_host)
    run_id = "e2e-" + uuid.uuid4().hex[:8]
    argv = [NODNS] + _torchrun() + [
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{server.port}",
        "--rdzv-conf", "is_host=0", "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1", "--max-restarts", "0",
        WORKER,
    ]
    try:
        procs = [
            subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for _ in range(2)
        ]
        outs = _wait_all(procs, 200)
        for p, out in zip(procs, outs):
            assert p.returncode == 0, f"torchrun exited {p.returncode}:\n{out[-6000:]}"
        joined = "\n".join(outs)
        for r in range(2):
            assert f"allreduce ok rank={r} world=2 sum=3" in joined, joined[-6000:]
        assert server.alive()
    finally:
        server.stop()
