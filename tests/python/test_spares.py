"""Spares: a pod beyond `--nnodes MAX` waits as a spare. When the gang finishes without it, the
spare leaves with success (exit 0) by itself, so a Kubernetes Job does not mark its pod Failed;
it does not outlive the job as a store host either (the loopback elastic form)."""

import subprocess
import time

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


def indexed_agent(script, port, index, script_args=()):
    """An agent as a pod of an Indexed Job with completions beyond MAX: its node rank comes
    from JOB_COMPLETION_INDEX."""
    return subprocess.Popen(
        [muster_bin(), "--nnodes", "2:2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "indexed",
         "--metrics-addr", "none", "--rdzv-conf", "join_timeout=60", str(script), *script_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=muster_env({"JOB_COMPLETION_INDEX": str(index)}))


@pytest.mark.timeout(150)
def test_an_indexed_job_index_beyond_max_is_a_spare_not_a_config_error(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = [indexed_agent(script, port, i) for i in range(3)]
    try:
        results = [finish(p, 120) for p in procs]
    finally:
        for p in procs:
            stop_process(p, 5)
    for code, out, err in results:
        assert code == 0, out + err
    _, out, err = results[2]
    assert "RANK=" not in out, out + err
    assert "beyond --nnodes 2:2: this node waits as a spare" in err, err
    assert FINISHED in err, err


KILLABLE = """\
import os, pathlib, sys, time
d = pathlib.Path(sys.argv[1])
print("RANK=%s WORLD_SIZE=%s" % (os.environ["RANK"], os.environ["WORLD_SIZE"]), flush=True)
(d / ("rank%s.%d" % (os.environ["RANK"], os.getpid()))).touch()
# Until the test has killed node 1, keep the gang running; after, finish quickly.
deadline = time.monotonic() + 60
while not (d / "killed").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
time.sleep(1)
os._exit(0)
"""


@pytest.mark.timeout(180)
def test_a_spare_takes_a_killed_members_place_and_the_job_finishes(tmp_path):
    script = tmp_path / "killable.py"
    script.write_text(KILLABLE)
    port = free_port()
    procs = [indexed_agent(script, port, i, [str(tmp_path)]) for i in range(3)]
    try:
        deadline = time.monotonic() + 90
        while not list(tmp_path.glob("rank1.*")):
            assert time.monotonic() < deadline, "node 1 never started its rank"
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
            time.sleep(0.1)
        (tmp_path / "killed").touch()
        procs[1].kill()
        results = [finish(p, 120) for p in procs]
    finally:
        for p in procs:
            stop_process(p, 5)
    (code0, out0, err0), _, (code2, out2, err2) = results
    assert code0 == 0, out0 + err0
    assert code2 == 0, out2 + err2
    # The spare ran node 1's ranks in the re-formed gang of two.
    assert "RANK=1 WORLD_SIZE=2" in out2, out2 + err2
    assert FINISHED not in err2, err2
