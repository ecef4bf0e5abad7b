"""The launch form's command line: bad input gives one clear line and exit 202, never a panic;
torchrun's spellings and the PET_/MUSTER_ environment are accepted."""
import os
import subprocess
from pathlib import Path

import pytest

from conftest import muster_bin, muster_env

SCRIPTS = Path(__file__).parent / "scripts"
CONFIG_ERROR = 202


def muster(args, env=None, timeout=30, cwd=None):
    full_env = muster_env(env)
    return subprocess.run([muster_bin(), *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def assert_config_error(p, needle):
    assert p.returncode == CONFIG_ERROR, (p.returncode, p.stderr)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, p.stderr
    assert needle in lines[0], lines[0]
    assert "panicked" not in p.stderr


def test_unknown_flag():
    assert_config_error(muster(["--no-such-flag", "x.py"]), "unknown option `--no-such-flag`")


def test_missing_script(tmp_path):
    assert_config_error(muster([str(tmp_path / "nope.py")]), "training script not found")


def test_gpu_workers_without_gpu():
    if any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev")):
        pytest.skip("this machine has a GPU")
    p = muster(["--nproc-per-node", "gpu", str(SCRIPTS / "envdump.py")])
    assert_config_error(p, "no GPU")


def test_unwritable_log_dir(tmp_path):
    # A regular file where the directory should be: unwritable even for root.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = muster(["--log-dir", str(blocker / "logs"), "--no-python", "/bin/true"])
    assert_config_error(p, "--log-dir")


def test_run_path_is_rejected_with_a_reason():
    p = muster(["--run-path", str(SCRIPTS / "envdump.py")])
    assert_config_error(p, "--run-path is not supported")


def test_bad_env_value_names_the_variable():
    p = muster([str(SCRIPTS / "envdump.py")], env={"PET_NNODES": "two"})
    assert_config_error(p, "PET_NNODES")


def test_missing_program():
    assert_config_error(muster(["--no-python", "/no/such/program"]), "program not found")


def test_help_documents_precedence():
    p = muster(["--help"])
    assert p.returncode == 0
    assert "MUSTER_<NAME>, then PET_<NAME>" in p.stdout
    assert "--nproc-per-node" in p.stdout and "PET_NPROC_PER_NODE" in p.stdout


def test_env_and_underscore_spellings(tmp_path):
    # PET_STANDALONE="" crashes torchrun 2.15; here an empty variable is unset. MUSTER_ beats
    # PET_, the command line beats both.
    env = {"OUT_DIR": str(tmp_path), "PET_STANDALONE": "", "PET_NPROC_PER_NODE": "4",
           "MUSTER_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "2"}
    p = muster([str(SCRIPTS / "envdump.py")], env=env)
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in tmp_path.glob("env_*.json")) == [f"env_{r}.json" for r in range(3)]
    for f in tmp_path.glob("env_*.json"):
        f.unlink()
    p = muster(["--nproc_per_node=2", str(SCRIPTS / "envdump.py")], env=env)
    assert p.returncode == 0, p.stderr
    assert len(list(tmp_path.glob("env_*.json"))) == 2
