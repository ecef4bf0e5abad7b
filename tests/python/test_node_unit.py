"""`--node-unit K`: every gang's node count is a multiple of K. Three agents with `--nnodes 2:4
--node-unit 2` form a gang of two; the third waits as a spare and runs no rank."""

import subprocess

import pytest

from conftest import finish, free_port, muster_bin, muster_env, stop_process

SCRIPT = """\
import os, time
print("RANK=%s WORLD_SIZE=%s" % (os.environ["RANK"], os.environ["WORLD_SIZE"]), flush=True)
time.sleep(6)
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
        # Two agents train and finish; the spare never gets a place and, seeing the job finish,
        # leaves with success by itself (test_spares.py).
        results = [finish(p, 120) for p in procs]
    finally:
        for p in procs:
            stop_process(p, 5)
    for code, out, err in results:
        assert code == 0, out + err
    members = [r for r in results if "RANK=" in r[1]]
    worlds = sorted(line.split("] ", 1)[1] for _, out, _ in members for line in out.splitlines()
                    if "RANK=" in line)
    assert worlds == ["RANK=0 WORLD_SIZE=2", "RANK=1 WORLD_SIZE=2"], worlds
    (_, out, err), = [r for r in results if "RANK=" not in r[1]]
    assert "the job finished while this pod waited as a spare" in err, out + err
    assert "is group rank" not in err, err
