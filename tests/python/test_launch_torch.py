"""muster against real PyTorch: gloo all-reduce through the agent's store, the same worker
environment as torchrun, failures (exit code, signal, @record) and restarts with a fresh store."""
import json
import os
import re
import subprocess
from pathlib import Path

from conftest import muster_bin, muster_env, torch_python, torch_version

SCRIPTS = Path(__file__).parent / "scripts"


def run(cmd, env=None, timeout=120):
    full_env = muster_env(env)
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


def test_allreduce_four_workers():
    p = run([muster_bin(), "--standalone", "--nproc-per-node", "4", str(SCRIPTS / "allreduce.py")])
    assert p.returncode == 0, p.stderr
    sums = re.findall(r"^\[[^:\]]+:(\d)\] allreduce rank=(\d) world=4 sum=10 expected=10$",
                      p.stdout, re.M)
    assert sorted(sums) == [(str(r), str(r)) for r in range(4)], p.stdout


def dump_env(launcher, out):
    out.mkdir()
    # Without the caller's PYTHONUNBUFFERED, which muster would pass through untouched.
    env = muster_env({"OUT_DIR": str(out)})
    env.pop("PYTHONUNBUFFERED", None)
    p = subprocess.run([*launcher, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                        str(SCRIPTS / "envdump.py")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return [json.loads((out / f"env_{r}.json").read_text()) for r in range(2)]


# Values that are random by design (run id, port, temp paths) or an intended difference
# (MASTER_ADDR: torchrun publishes socket.getfqdn(), muster the numeric address it bound).
RANDOM = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR"}


def test_same_environment_as_torchrun(tmp_path):
    torchrun = str(Path(torch_python()).parent / "torchrun")
    theirs = dump_env([torchrun], tmp_path / "torchrun")
    ours = dump_env([muster_bin()], tmp_path / "muster")
    for rank in range(2):
        base = dict(os.environ, PYTHON_EXEC=torch_python(), OUT_DIR="")
        base.pop("PYTHONUNBUFFERED", None)
        set_by_torchrun = {k: v for k, v in theirs[rank].items()
                           if k not in base or base[k] != v}
        set_by_torchrun.pop("OUT_DIR", None)
        for key, value in set_by_torchrun.items():
            assert key in ours[rank], f"muster does not set {key} (torchrun: {value})"
            if key == "TORCHELASTIC_USE_AGENT_STORE" and torch_version() < (2, 5):
                # torchrun before 2.5 let rank 0 host the workers' store; muster always serves
                # it from the agent, which those workers' env:// also accepts (docs/launch.md)
                assert (value, ours[rank][key]) == ("False", "True")
            elif key not in RANDOM:
                assert ours[rank][key] == value, (key, ours[rank][key], value)
        for key in ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR"):
            assert key in set_by_torchrun, key
        uuid = r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
        assert re.match(uuid, ours[rank]["TORCHELASTIC_RUN_ID"])
        assert int(ours[rank]["MASTER_PORT"]) > 0
        assert ours[rank]["MASTER_ADDR"] == "127.0.0.1"
        suffix = f"/attempt_0/{rank}/error.json"
        assert theirs[rank]["TORCHELASTIC_ERROR_FILE"].endswith(suffix)
        assert ours[rank]["TORCHELASTIC_ERROR_FILE"].endswith(suffix)
        run_dir = Path(ours[rank]["TORCHELASTIC_ERROR_FILE"]).parents[2].name
        assert run_dir.startswith(ours[rank]["TORCHELASTIC_RUN_ID"] + "_")
        # The documented difference: torchrun runs the script with `python -u` only, muster
        # also exports PYTHONUNBUFFERED (for any other Python on the rank's pipe).
        assert "PYTHONUNBUFFERED" not in theirs[rank]
        assert ours[rank]["PYTHONUNBUFFERED"] == "1"


def fail(how):
    return run([muster_bin(), "--nproc-per-node", "2", "--shutdown-timeout", "5",
                str(SCRIPTS / "fail.py")], env={"HOW": how})


def summary_of(stderr):
    return [l for l in stderr.splitlines() if l.startswith("muster:")]


def test_worker_exit_code_is_the_agent_exit_code():
    p = fail("exit3")
    assert p.returncode == 3, p.stderr
    s = "\n".join(summary_of(p.stderr))
    assert "root cause" in s and "rank: 1 (local_rank 1)" in s and "exit code 3" in s, s


def test_worker_killed_by_sigsegv():
    p = fail("segv")
    assert p.returncode == 128 + 11, p.stderr
    s = "\n".join(summary_of(p.stderr))
    assert "signal SIGSEGV (11)" in s and "rank: 1" in s, s


def test_record_message_in_summary():
    p = fail("raise")
    assert p.returncode == 1, p.stderr
    s = "\n".join(summary_of(p.stderr))
    assert "error: ValueError: rank 1 says boom" in s, s
    assert "rank: 1 (local_rank 1)" in s, s


def test_transient_failure_restarts_with_a_fresh_store(tmp_path):
    p = run([muster_bin(), "--nproc-per-node", "2", "--max-restarts", "2",
             str(SCRIPTS / "transient.py")], env={"OUT_DIR": str(tmp_path)}, timeout=180)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(l) for l in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    by_attempt = {a: [r for r in rows if r["attempt"] == a] for a in (0, 1)}
    assert len(by_attempt[0]) == 2 and len(by_attempt[1]) == 2, rows
    assert {r["sum"] for r in rows} == {2.0}
    assert not any(r["leftover"] for r in by_attempt[1]), rows
    assert by_attempt[0][0]["port"] != by_attempt[1][0]["port"], rows
    assert "restarting the worker group (restart 1 of 2)" in p.stderr
