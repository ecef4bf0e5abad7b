"""Snapshots on storage (issue #42, `--snapshot-persist DIR`): a job whose every pod is lost
(SIGKILL to the whole dry run: agents and ranks) or preempted (SIGTERM to every agent) is started
again with the same DIR, and every rank restores the newest committed step, bit for bit, from
the files its agent wrote in the background. A job of another shape finds nothing to restore."""

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from conftest import muster_bin, muster_env
from test_snapshot_replicas import RAW_GET
from test_snapshots import SAME

EVERY = 5

# Each rank's state is a pure function of (rank, step), so the restored one is checked exactly.
# In the first job (JOB=1) the ranks take snapshots up to step LAST only, and at step LAST wait
# until both ranks' files of step 20 are on the disk and step NEWEST is committed on the job's
# store: the newest committed step is then NEWEST, whatever the machine's speed.
SCRIPT = """\
import os, sys, time
import torch
import torch.distributed as dist
from muster_launcher import snapshot

def state(rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(512, 64, generator=g), "opt": [torch.tensor(step), (step, "adam")]}

""" + SAME + RAW_GET + """
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
first_job = os.environ["JOB"] == "1"
last, newest = int(os.environ["LAST"]), int(os.environ["NEWEST"])
start = 0
restored = snapshot.restore()
if restored is not None:
    step, got = restored
    assert same(got, state(rank, step)), "restored state differs at step %d" % step
    print("RESTORED %d %d" % (rank, step), flush=True)
    start = step + 1
print("START %d %d" % (rank, start), flush=True)
steps = 1000 if first_job else 40
for step in range(start, steps):
    dist.all_reduce(torch.ones(1))
    if not first_job or step <= last:
        held = snapshot.save(step, lambda: state(rank, step))
        if held and first_job:
            # The next snapshot is taken only once this one is committed (else the agent would
            # refuse it as a third generation, on a machine too loaded to commit in 5 steps).
            raw_get("muster/%s/snapshot/0/committed/%d" % (os.environ["TORCHELASTIC_RUN_ID"], step))
    if first_job and step == last:
        files = [os.path.join(sys.argv[1], "step-20", "rank-%d.part" % r) for r in range(world)]
        while not all(os.path.exists(f) for f in files):
            time.sleep(0.05)
        raw_get("muster/%s/snapshot/0/committed/%d" % (os.environ["TORCHELASTIC_RUN_ID"], newest))
        print("WRITTEN %d" % rank, flush=True)
    time.sleep(0.05)
print("DONE %d" % rank, flush=True)
dist.destroy_process_group()
"""


def dry_run(tmp_path, persist, job, nnodes=2, persist_every=EVERY, newest=20, **popen):
    script = tmp_path / "persist.py"
    script.write_text(SCRIPT)
    args = [muster_bin(), "dry-run", "--nnodes", str(nnodes), "--nproc-per-node", "1",
            "--max-restarts", "0", "--snapshot-every", str(EVERY),
            "--snapshot-persist", str(persist), "--snapshot-persist-every", str(persist_every),
            str(script), str(persist)]
    env = muster_env({"JOB": str(job), "OMP_NUM_THREADS": "1", "NEWEST": str(newest),
                      "LAST": str(newest + 3)})
    if popen:
        return subprocess.Popen(args, env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, **popen)
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    return p.returncode, p.stdout + p.stderr


def first_job_until_written(tmp_path, persist, end, persist_every, newest):
    """Runs the first job until both ranks saw step 20 on the disk and `newest` committed, then
    ends it with `end`."""
    job = dry_run(tmp_path, persist, 1, persist_every=persist_every, newest=newest,
                  start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 150
    while sum(bool(re.search(r"WRITTEN \d$", l)) for l in list(lines)) < 2:
        assert job.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    if end == "sigkill":
        # Every pod lost at once: the dry run, its agents and their ranks.
        os.killpg(job.pid, signal.SIGKILL)
    else:
        # Every pod preempted: the dry run passes SIGTERM to each agent.
        job.send_signal(signal.SIGTERM)
    job.wait(timeout=60)
    reader.join(timeout=30)
    return "".join(lines)


# How the first job ends, which committed steps are written as they commit, the newest committed
# step when it ends. With --snapshot-persist-every 10, step 25 is written only by the preemption.
CASES = {
    "sigkill": ("sigkill", EVERY, 20),
    "sigterm": ("sigterm", EVERY, 20),
    "sigterm-between-writes": ("sigterm", 10, 25),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_a_job_started_again_restores_the_newest_committed_step_from_storage(tmp_path, case):
    end, persist_every, newest = CASES[case]
    persist = tmp_path / "snapshots"
    first = first_job_until_written(tmp_path, persist, end, persist_every, newest)
    if end == "sigterm":
        for node in (0, 1):
            assert re.search(
                rf"\[node {node}\]  INFO snapshots: this node's parts of step {newest}, the "
                r"newest committed snapshot, are whole on the disk", first), first
    code, out = dry_run(tmp_path, persist, 2)
    assert code == 0, first + out
    for node in (0, 1):
        assert re.search(rf"\[node {node}\]  INFO snapshots: read this node's parts of step "
                         rf"{newest} from {re.escape(str(persist))}", out), out
    assert sorted(re.findall(r"RESTORED (\d) (\d+)$", out, re.M)) == [
        ("0", str(newest)), ("1", str(newest))], out
    assert sorted(re.findall(r"DONE (\d)$", out, re.M)) == ["0", "1"], out
    # The second job wrote its own steps, and the first job's older ones went (the two newest
    # whole steps stay; one more may be under way when the job ends).
    kept = os.listdir(persist)
    assert not {"step-5", "step-10", "step-15"} & set(kept) and len(kept) <= 3, kept
    assert re.search(r"START 0 0$", out, re.M) is None, out
    if case == "sigkill":
        # A job of another shape (one rank) restores nothing from the directory.
        code, out = dry_run(tmp_path, persist, 2, nnodes=1)
        assert code == 0, out
        assert "RESTORED" not in out and re.search(r"START 0 0$", out, re.M), out


def test_snapshot_persist_without_snapshots_is_a_clear_error(tmp_path):
    p = subprocess.run([muster_bin(), "dry-run", "--nnodes", "1", "--nproc-per-node", "1",
                        "--snapshot-persist", str(tmp_path), "x.py"],
                       env=muster_env({}), capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.returncode == 202, p.stdout + p.stderr
    assert "--snapshot-persist" in p.stderr and "--snapshot-every" in p.stderr, p.stderr
