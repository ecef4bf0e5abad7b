"""In-memory snapshots (`--snapshot-every`, issue #42): real PyTorch ranks hand their state to the
agent through `muster_launcher.snapshot`, a rank is SIGKILLed, and the next attempt restores the
newest step every rank handed over, bit for bit, on every rank alike."""

import re
import subprocess

import pytest

from conftest import REPO, muster_bin, muster_env

# The scripts' check that a restored state is the one handed over: dtype, shape and bytes of every
# tensor, and the same structure and plain values around them.
SAME = """\
def same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
"""

# Each rank's state is a pure function of (rank, step), so the restored one can be checked
# exactly: dtypes torch has and numpy does not (bfloat16), an integer and a bool tensor, an empty
# one, nesting, and plain values. Rank 1 dies of SIGKILL at step 13 of the first attempt.
SCRIPT = """\
import os, signal, sys, time
import torch
import torch.distributed as dist
from muster_launcher import snapshot

def state(rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "h": torch.randn(8, generator=g).bfloat16()},
        "opt": [{"step": torch.tensor(step), "mask": torch.rand(5, generator=g) > 0.5}, (step, "sgd")],
        "empty": torch.empty(0, 3),
        "step": step,
    }

""" + SAME + """
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
start = 0
restored = snapshot.restore()
if restored is not None:
    step, got = restored
    assert same(got, state(rank, step)), "restored state differs at step %d" % step
    print("rank %d attempt %d restored step %d exactly" % (rank, attempt, step), flush=True)
    start = step + 1
for step in range(start, 30):
    dist.all_reduce(torch.ones(1))
    if attempt == 0 and rank == 1 and step == 13:
        os.kill(os.getpid(), signal.SIGKILL)
    snapshot.save(step, lambda: state(rank, step))
    time.sleep(0.02)
print("rank %d attempt %d finished from step %d" % (rank, attempt, start), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_a_killed_rank_restarts_from_the_newest_snapshot_exactly(tmp_path):
    script = tmp_path / "snap.py"
    script.write_text(SCRIPT)
    p = subprocess.run(
        [muster_bin(), "dry-run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
         "--warm-restart", "off", "--snapshot-every", "5", str(script)],
        env=muster_env(), capture_output=True, text=True, timeout=170, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    # Step 10 is the newest snapshot before the kill at 13 (steps lost: 3, at most N + 1).
    assert "snapshots: attempt 1 restores step 10, held by every node" in out, out
    for rank in (0, 1):
        assert f"rank {rank} attempt 1 restored step 10 exactly" in out, out
        assert f"rank {rank} attempt 1 finished from step 11" in out, out
    assert "snapshots: step 5 committed on every node" in out, out
    assert not re.search(r"refused|snapshots are off", out), out


OVER_CAP = """\
import torch
import torch.distributed as dist
from muster_launcher import snapshot

dist.init_process_group("gloo")
held = [snapshot.save(step, {"w": torch.zeros(1 << 20)}) for step in range(1, 11)]
assert held == [False] * 10, held
print("trained on with", sum(held), "snapshots", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_state_over_the_cap_turns_snapshots_off_once_and_the_job_trains_on(tmp_path):
    script = tmp_path / "big.py"
    script.write_text(OVER_CAP)
    p = subprocess.run(
        [muster_bin(), "dry-run", "--nnodes", "1", "--nproc-per-node", "2",
         "--snapshot-every", "5", "--snapshot-memory", "1MiB", str(script)],
        env=muster_env(), capture_output=True, text=True, timeout=110, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert out.count("WARN snapshots are off for this job") == 1, out
    assert out.count("trained on with 0 snapshots") == 2, out


OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "WANDB_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false"}
SCRIPTS = REPO / "tests" / "python" / "scripts"


def trainer_run(tmp_path, script, name, flags=(), script_args=()):
    """An unmodified Trainer script of tests/python/scripts, 30 steps on 2 ranks."""
    out = tmp_path / name
    p = subprocess.run(
        [muster_bin(), "dry-run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
         *flags, str(SCRIPTS / script), "--out", str(out), "--max-steps", "30", "--print-weights",
         *script_args],
        env=muster_env(OFFLINE), capture_output=True, text=True, timeout=400, cwd=tmp_path)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text
    return text


def fields(text, word):
    """The words after `WORD` on each line the script printed it, as tuples."""
    return [tuple(m.split()) for m in re.findall(rf"\b{word} (\d+(?: \w+)+)$", text, re.M)]


def resumes_from_the_snapshot_exactly(tmp_path, script, script_args=()):
    """An uninterrupted run, then one whose rank 1 dies of SIGKILL after global step 23 (the
    script never asks to resume): the second attempt starts at step 20 on both ranks and ends
    with the first run's weights."""
    reference = trainer_run(tmp_path, script, "uninterrupted", (), script_args)
    expected = dict(fields(reference, "WEIGHTS"))
    assert len(expected) == 2 and len(set(expected.values())) == 1, reference

    text = trainer_run(tmp_path, script, "killed", ["--snapshot-every", "5"],
                       ["--kill-at", "23", *script_args])
    assert "snapshots: attempt 1 restores step 20, held by every node" in text, text
    assert "resuming the Trainer from the snapshot of step 20 held by muster" in text, text
    begins = {(rank, int(attempt)): int(step) for rank, attempt, step in fields(text, "BEGIN")}
    assert begins == {("0", 0): 0, ("1", 0): 0, ("0", 1): 20, ("1", 1): 20}, text
    assert dict(fields(text, "FINAL")) == {"0": "30", "1": "30"}, text
    # The same batches, the same optimizer and RNG states: bit-identical final weights.
    assert dict(fields(text, "WEIGHTS")) == expected, text
    # Nothing was written into the output directory: the snapshot never went to storage.
    assert not list((tmp_path / "killed").glob("*"))
    assert not re.search(r"refused|snapshots are off|turned off|skipped", text), text


@pytest.mark.timeout(600)
def test_an_unmodified_hf_trainer_resumes_from_the_snapshot_with_an_uninterrupted_runs_weights(
        tmp_path):
    pytest.importorskip("transformers")
    resumes_from_the_snapshot_exactly(tmp_path, "hf_trainer.py")


@pytest.mark.timeout(600)
def test_an_unmodified_lightning_script_resumes_from_the_snapshot_with_the_same_weights(
        tmp_path):
    pytest.importorskip("lightning")
    # 80 samples, batches of 4 on 2 ranks: 10 steps an epoch, so step 20 ends one (a Lightning
    # data loader that is not stateful starts a broken epoch again, from a checkpoint alike).
    resumes_from_the_snapshot_exactly(tmp_path, "lightning_trainer.py", ["--samples", "80"])
