"""muster under a real Slurm 22.05 (Debian's slurm-wlm and munge): one slurmctld and two
`slurmd -N` on this machine, node names DNS does not know, NodeAddr 127.0.0.1 (see
slurm_cluster.py). What a user moving from torchrun does: `srun muster --nproc-per-node 2
train.py` with no other muster flag forms one gang of the whole step; Slurm's way of stopping a
step (every process of it gets the signal, the ranks included) ends in a checkpoint committed at
one step; a requeued job resumes from it; a lost node-0 agent ends the step's other agents
at once."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port, muster_bin, muster_env, torch_python
import slurm_cluster

# examples/train_ddp.py, with an exit that skips torch's teardown (see the script).
TRAIN_DDP = str(REPO / "tests" / "python" / "scripts" / "train_ddp_exit.py")
TRAIN_CKPT = str(REPO / "examples" / "train_checkpoint.py")
PREEMPTED_OK = 200
STORE_HOST_LOST = 205
RENDEZVOUS_TIMEOUT = 203
# Slurm's KillWait in the test cluster: the step's grace between SIGTERM and SIGKILL.
KILL_WAIT_S = 30


def _install_packages():
    """scripts/system-deps.sh installs slurm-wlm and munge; the reason when it cannot."""
    try:
        out = subprocess.run([str(REPO / "scripts" / "system-deps.sh")], capture_output=True,
                             text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if out.returncode != 0:
        return out.stderr.strip().splitlines()[-1:] or ["system-deps.sh failed"]
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if slurm_cluster.missing_binaries():
        why = _install_packages()
        missing = slurm_cluster.missing_binaries()
        if missing:
            pytest.skip(f"Slurm packages cannot be installed ({why}); missing {missing}")
    root = tmp_path_factory.mktemp("slurm")
    c = slurm_cluster.Cluster(root, kill_wait_s=KILL_WAIT_S)
    try:
        c.start()
    except Exception:
        c.stop()
        raise
    yield c
    c.stop()


def job_env(cluster, tmp_path, extra=None):
    """What srun hands the agents (it exports the caller's environment): a private port for
    the rendezvous and no metrics endpoint (two agents share this machine's port 8000)."""
    env = muster_env({
        "SLURM_CONF": str(cluster.conf),
        "MASTER_PORT": str(free_port()),
        "MUSTER_METRICS_ADDR": "none",
        "CKPT_DIR": str(tmp_path / "ckpt"),
        **(extra or {}),
    })
    for k in list(env):
        if k.startswith("SLURM_") and k != "SLURM_CONF":
            del env[k]
    return env


def outputs(tmp_path):
    return {p.name: p.read_text(errors="replace") for p in sorted(tmp_path.glob("out-*.txt"))}


def srun(cluster, tmp_path, name, args, env):
    return subprocess.Popen(
        ["srun", "-N2", "--ntasks-per-node=1", f"--job-name={name}",
         "-o", str(tmp_path / "out-%t.txt"), muster_bin(), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)


def job_id(cluster, name, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cluster.run(["squeue", "-h", "-n", name, "-o", "%A %T"], check=False).stdout.split()
        if len(out) == 2 and out[1] == "RUNNING":
            return out[0]
        time.sleep(0.2)
    raise AssertionError(f"job {name} did not start\n{cluster.logs()}")


def wait_for(predicate, what, timeout, proc=None, dump=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}\n{dump()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{dump()}")


def steps_seen(text):
    return [int(s) for s in re.findall(r"\] step (\d+) loss", text)]


def committed(text):
    return [int(s) for s in re.findall(r"checkpoint at step (\d+): committed", text)]


def finish(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"srun did not finish in {timeout}s:\n{out}")
    return proc.returncode, out


def test_srun_forms_one_gang_of_the_whole_step(cluster, tmp_path):
    cluster.wait_idle()
    env = job_env(cluster, tmp_path, {"TRAIN_STEPS": "10"})
    proc = srun(cluster, tmp_path, "gang", ["--nproc-per-node", "2", TRAIN_DDP], env)
    rc, out = finish(proc, 240)
    texts = outputs(tmp_path)
    every = out + "\n".join(texts.values())
    assert rc == 0, every
    assert "done: world size 4" in every, every
    # Each agent says where its shape came from, once: Slurm, for every value.
    for task, node in (("out-0.txt", "mnode1"), ("out-1.txt", "mnode2")):
        lines = [l for l in texts[task].splitlines() if "Slurm job" in l]
        assert len(lines) == 1, texts[task]
        assert f"on {node}: --nnodes 2 (Slurm (SLURM_STEP_NUM_NODES))" in lines[0], lines[0]
        assert "NodeAddr in" in lines[0] and "port from MASTER_PORT" in lines[0], lines[0]


def test_more_than_one_task_per_node_is_a_clear_202(cluster, tmp_path):
    cluster.wait_idle()
    proc = subprocess.run(
        ["srun", "-N1", "--ntasks-per-node=2", "-o", str(tmp_path / "out-%t.txt"),
         muster_bin(), "--nproc-per-node", "1", TRAIN_DDP],
        env=job_env(cluster, tmp_path), capture_output=True, text=True, timeout=120)
    texts = "\n".join(outputs(tmp_path).values())
    assert proc.returncode == 202, proc.stdout + proc.stderr + texts
    assert "srun --ntasks-per-node=1" in texts, texts


# SIGTERM: a cancel or a preemption; SIGUSR1: `#SBATCH --signal=USR1@120`, the time-limit
# warning, made a checkpoint with --signals-to-handle USR1:checkpoint.
@pytest.mark.parametrize("sig", ["TERM", "USR1"])
def test_scancel_signal_commits_one_step_on_every_rank(cluster, tmp_path, sig):
    cluster.wait_idle()
    env = job_env(cluster, tmp_path)
    extra = ["--signals-to-handle", "USR1:checkpoint"] if sig == "USR1" else []
    proc = srun(cluster, tmp_path, "cancel",
                ["--nproc-per-node", "2", "--grace-period", str(KILL_WAIT_S), *extra, TRAIN_CKPT,
                 "--steps", "100000", "--step-seconds", "0.05", "--log-every", "5"], env)
    dump = lambda: "\n".join(outputs(tmp_path).values())
    job = job_id(cluster, "cancel")
    wait_for(lambda: len(steps_seen(dump())) >= 2 and max(steps_seen(dump())) >= 10,
             "training", 180, proc, dump)
    cluster.run(["scancel", f"--signal={sig}", job])
    rc, out = finish(proc, 120)
    text = dump()
    saves = committed(text)
    assert len(saves) == 4 and len(set(saves)) == 1, out + text
    # Every rank held Slurm's signal through the barrier instead of dying of it.
    assert text.count(f"holding SIG{sig} from outside the agent") == 4, text
    assert rc == PREEMPTED_OK, out + text
    assert (tmp_path / "ckpt" / "LATEST").read_text().strip() == str(saves[0])


def test_an_unmodified_hf_trainer_holds_slurms_sigterm_and_commits(cluster, tmp_path):
    """The zero-code path: a Hugging Face Trainer script that never imports muster gets the
    framework callback, whose ranks hold Slurm's SIGTERM like the helper's."""
    pytest.importorskip("transformers")
    cluster.wait_idle()
    out_dir = tmp_path / "hf"
    proc = srun(cluster, tmp_path, "hf",
                ["--nproc-per-node", "2", "--grace-period", str(KILL_WAIT_S),
                 str(REPO / "tests" / "python" / "scripts" / "hf_trainer.py"),
                 "--out", str(out_dir), "--max-steps", "400", "--step-seconds", "0.1"],
                job_env(cluster, tmp_path))
    dump = lambda: "\n".join(outputs(tmp_path).values())
    job = job_id(cluster, "hf")
    wait_for(lambda: len(re.findall(r"\] STEP \d+ [2-9]\b", dump())) >= 4, "training", 240,
             proc, dump)
    cluster.run(["scancel", "--signal=TERM", job])
    rc, out = finish(proc, 120)
    text = dump()
    assert text.count("holding SIGTERM from outside the agent") == 4, text
    assert rc == PREEMPTED_OK, out + text
    step = re.search(r"checkpoint at step (\d+) committed on every rank", text)
    assert step, text
    assert (out_dir / f"checkpoint-{step.group(1)}" / "trainer_state.json").is_file(), text


def test_requeue_resumes_from_the_committed_step(cluster, tmp_path):
    cluster.wait_idle()
    log = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"srun --ntasks-per-node=1 {muster_bin()} --nproc-per-node 2 "
        f"--grace-period {KILL_WAIT_S} {TRAIN_CKPT} --steps 120 --step-seconds 0.05 "
        "--log-every 5\n")
    script.chmod(0o755)
    env = job_env(cluster, tmp_path)
    job = cluster.run(["sbatch", "--parsable", "-N2", "--requeue", "--open-mode=append",
                       "-o", str(log), str(script)], env=env).stdout.strip()
    text = lambda: log.read_text(errors="replace") if log.exists() else ""
    dump = lambda: text() + cluster.logs()
    try:
        wait_for(lambda: steps_seen(text()) and max(steps_seen(text())) >= 10,
                 "training", 180, dump=dump)
        cluster.run(["scontrol", "requeue", job])
        wait_for(lambda: len(committed(text())) == 4, "the committed checkpoint", 120, dump=dump)
        # A requeued job waits for a begin time; the test does not need to.
        wait_for(lambda: "PENDING" in cluster.run(["squeue", "-h", "-j", job, "-o", "%T"],
                                                  check=False).stdout, "the requeue", 90,
                 dump=dump)
        cluster.run(["scontrol", "update", f"jobid={job}", "StartTime=now"])
        wait_for(lambda: text().count("finished 120 steps") == 4, "the resumed run", 240,
                 dump=dump)
    finally:
        cluster.run(["scancel", job], check=False)
    saves = committed(text())
    assert len(set(saves)) == 1, text()
    assert text().count(f"resumed from committed step {saves[0]}") == 4, text()
    state = cluster.run(["scontrol", "show", "job", job], check=False).stdout
    assert "Restarts=1" in state, state


HOLDER = """
import os, signal, sys, time
sys.path.insert(0, {python_dir!r})
import muster_checkpoint
assert muster_checkpoint.hold_foreign_signals()
print("ready", flush=True)
for line in sys.stdin:
    print("alive", flush=True)
"""


def test_a_held_rank_survives_a_foreign_signal_and_dies_of_the_agents(tmp_path):
    """The helper's hold on its own (no Slurm needed): a SIGTERM without the agent's stop mark
    is held, and with the mark it does what it did before the hold (death by SIGTERM)."""
    mark = tmp_path / "stop"
    env = dict(os.environ, MUSTER_HOLD_FOREIGN_SIGNALS="15,10", MUSTER_STOP_MARK=str(mark))
    proc = subprocess.Popen(
        [torch_python(), "-c", HOLDER.format(python_dir=str(REPO / "python"))], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM):
            proc.send_signal(sig)
            proc.stdin.write("?\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "alive"
        mark.touch()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        err = proc.stderr.read()
        # Said once per signal, not once per delivery.
        assert err.count("holding SIGTERM from outside the agent") == 1, err
        assert err.count("holding SIGUSR1 from outside the agent") == 1, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def agent_pid(job, node_id):
    """The muster agent of `job` on node `node_id` (read from /proc, our own processes)."""
    binary = os.path.realpath(muster_bin())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.path.realpath(entry / "exe") != binary:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (f"SLURM_JOB_ID={job}".encode() in env
                and f"SLURM_NODEID={node_id}".encode() in env):
            return int(entry.name)
    return None


def kill_an_agent_while_it_trains(cluster, tmp_path, name, node_id, *flags):
    """Trains on 2 nodes, SIGKILLs node `node_id`'s agent, and returns srun's code, its output
    and the other task's output."""
    cluster.wait_idle()
    # A join timeout far beyond the test's own limit: waiting it out would fail the test.
    env = job_env(cluster, tmp_path, {"MUSTER_RDZV_CONF": "join_timeout=900"})
    proc = srun(cluster, tmp_path, name,
                ["--nproc-per-node", "2", *flags, TRAIN_CKPT, "--steps", "100000",
                 "--step-seconds", "0.05", "--log-every", "5"], env)
    dump = lambda: "\n".join(outputs(tmp_path).values())
    job = job_id(cluster, name)
    wait_for(lambda: len(steps_seen(dump())) >= 2 and max(steps_seen(dump())) >= 10,
             "training", 180, proc, dump)
    pid = agent_pid(job, node_id)
    assert pid is not None, dump()
    os.kill(pid, signal.SIGKILL)
    try:
        rc, out = finish(proc, 120)
    except AssertionError as err:
        # srun's own output says little: the tasks' outputs say where the survivor waited.
        raise AssertionError(f"{err}\n{dump()}") from None
    finally:
        cluster.run(["scancel", job], check=False)
    return rc, out, outputs(tmp_path).get(f"out-{1 - node_id}.txt", "")


def test_a_lost_node0_agent_ends_the_step_without_waiting_for_a_replacement(cluster, tmp_path):
    rc, out, survivor = kill_an_agent_while_it_trains(cluster, tmp_path, "lost", 0)
    assert "under Slurm a lost node 0 is not replaced" in survivor, out + survivor
    # srun names each task's end; it returns the largest code, the killed agent's 137.
    assert f"task 1: Exited with exit code {STORE_HOST_LOST}" in out, out + survivor
    assert rc == 128 + signal.SIGKILL, out
    # The survivor's own stop is marked as the agent's: its held ranks end on the SIGTERM, not
    # at the SIGKILL after --shutdown-timeout.
    assert "sending SIGKILL" not in survivor, survivor


def test_a_lost_member_agent_ends_the_step_without_waiting_for_a_replacement(cluster, tmp_path):
    # Node 1 (not the store host) is lost. A gang below its minimum waits for a replacement under
    # Kubernetes; a Slurm step never restarts its tasks, so node 0 ends the job at once (203),
    # restarts left or not: the survivors' failed ranks are consequences, not restarts.
    rc, out, survivor = kill_an_agent_while_it_trains(cluster, tmp_path, "lost1", 1,
                                                      "--max-restarts", "3")
    assert "no replacement comes for a lost node (a Slurm step never restarts its tasks)" \
        in survivor, out + survivor
    assert f"task 0: Exited with exit code {RENDEZVOUS_TIMEOUT}" in out, out + survivor
    assert rc == 128 + signal.SIGKILL, out
