"""Spares: a pod beyond `--nnodes MAX` waits as a spare. When the gang finishes without it, the
spare leaves with success (exit 0) by itself, so a Kubernetes Job does not mark its pod Failed;
it does not outlive the job as a store host either (the loopback elastic form)."""

import subprocess

import pytest

from conftest import finish, free_port, muster_bin, muster_env, stop_process

SCRIPT = """\
import os, time
print("RANK=%s WORLD_SIZE=%s" % (os.environ["RANK"], os.environ["WORLD_SIZE"]), flush=True)
time.sleep(2)
"""

FINISHED = "the job finished while this pod waited as a spare"


def agent(script, port):
    return subprocess.Popen(
        [muster_bin(), "--nnodes", "2:2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "spares",
         "--metrics-addr", "none", "--rdzv-conf", "join_timeout=60",
         str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=muster_env())


@pytest.mark.timeout(150)
def test_a_spare_exits_0_when_the_job_finishes_without_it(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = [agent(script, port) for _ in range(3)]
    try:
        # Nobody is stopped: every agent, the spare included, must end by itself well before
        # the join timeout (60 s) that would end a spare with 203/205.
        results = [finish(p, 120) for p in procs]
    finally:
        for p in procs:
            stop_process(p, 5)
    for code, out, err in results:
        assert code == 0, out + err
    spares = [(out, err) for _, out, err in results if "RANK=" not in out]
    assert len(spares) == 1, results
    out, err = spares[0]
    assert FINISHED in err, out + err
    assert "waiting as a spare: the gang is full" in err, err
    worlds = sorted(line.split("] ", 1)[1] for _, out, _ in results for line in out.splitlines()
                    if "RANK=" in line)
    assert worlds == ["RANK=0 WORLD_SIZE=2", "RANK=1 WORLD_SIZE=2"], worlds
