"""`--node-unit K`: every gang's node count is a multiple of K. Three agents with `--nnodes 2:4
--node-unit 2` form a gang of two; the third waits as a spare and runs no rank."""

import subprocess
import time

import pytest

from conftest import finish, free_port, muster_bin, muster_env, stop_process

SCRIPT = """\
import os, time
print("RANK=%s WORLD_SIZE=%s" % (os.environ["RANK"], os.environ["WORLD_SIZE"]), flush=True)
time.sleep(2)
"""


def agent(script, port):
    return subprocess.Popen(
        [muster_bin(), "--nnodes", "2:4", "--node-unit", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "unit",
         "--metrics-addr", "none", "--rdzv-conf", "join_timeout=60,last_call_timeout=1",
         str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=muster_env())


@pytest.mark.timeout(150)
def test_three_nodes_with_unit_2_form_a_gang_of_two_and_one_spare(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = [agent(script, port) for _ in range(3)]
    try:
        # Two agents train and finish; the spare never gets a place.
        deadline = time.monotonic() + 120
        while sum(p.poll() is not None for p in procs) < 2:
            assert time.monotonic() < deadline, "the gang of two never finished"
            for p in procs:
                try:
                    p.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        done = [p for p in procs if p.poll() is not None]
        spare = next(p for p in procs if p not in done)
        stop_process(spare, 20)
        results = {p: finish(p, 30) for p in procs}
    finally:
        for p in procs:
            stop_process(p, 5)
    members = [results[p] for p in done]
    for code, out, err in members:
        assert code == 0, out + err
    worlds = sorted(line.split("] ", 1)[1] for _, out, _ in members for line in out.splitlines()
                    if "RANK=" in line)
    assert worlds == ["RANK=0 WORLD_SIZE=2", "RANK=1 WORLD_SIZE=2"], worlds
    _, out, err = results[spare]
    assert "RANK=" not in out, out + err
    assert "is group rank" not in err, err
