"""Where muster writes its own files (issue #21): `--tmp-dir`/`MUSTER_TMP_DIR`, else `$TMPDIR`,
`/tmp`, `/dev/shm`, else nowhere — and a launch never needs a write to start. The checkpoint
socket is an abstract Unix socket (no file); per-rank log files exist only with `--log-dir`.
The container version (read-only root, non-root user) is in test_containers.py."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import muster_bin, muster_env

CONFIG_ERROR = 202
NO_WRITABLE = "no writable directory for muster's files"

# A worker that reports what muster gave it, checked while muster's files still exist.
REPORT = r"""
import os, sys
# The helper's entry on PYTHONPATH: muster's shared copy of its Python beside the agent's private
# directory (muster-python-<uid>-<hash>/, holding muster_checkpoint.py).
entries = os.environ.get("PYTHONPATH", "").split(":")
with_helper = [e for e in entries if os.path.isfile(os.path.join(e, "muster_checkpoint.py"))]
first = with_helper[0] if with_helper else entries[0]
print("SOCKET", os.environ.get("MUSTER_CHECKPOINT_SOCKET", "unset"))
print("HELPER", bool(with_helper), first)
print("ERRFILE", os.environ.get("TORCHELASTIC_ERROR_FILE", "unset"))
sys.path.insert(0, first)
import muster_checkpoint
print("CONNECTED", muster_checkpoint.Checkpointer().active)
"""


def muster(args, env=None, timeout=60):
    full_env = muster_env(env)
    return subprocess.run([muster_bin(), *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def values(out: str, key: str) -> list[str]:
    return [l.split(key + " ", 1)[1] for l in out.splitlines() if (key + " ") in l]


SHARED = re.compile(r"^muster-python-%d-[0-9a-f]{16}$" % os.geteuid())


def left_behind(scratch: Path) -> list[str]:
    """What a launch left in its base besides muster's shared copy of its Python (kept on purpose:
    every later agent of this user and version imports from it instead of writing its own)."""
    return sorted(p.name for p in scratch.iterdir() if not SHARED.match(p.name))


@pytest.mark.parametrize("how", ["flag", "env"])
def test_tmp_dir_holds_the_helper_and_error_files_and_is_emptied_at_exit(tmp_path, how):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = ["--nproc-per-node", "2", "--no-python", sys.executable, "-c", REPORT]
    if how == "flag":
        p = muster(["--tmp-dir", str(scratch), *args])
    else:
        p = muster(args, env={"MUSTER_TMP_DIR": str(scratch)})
    assert p.returncode == 0, p.stderr
    sockets = values(p.stdout, "SOCKET")
    assert len(sockets) == 2 and len(set(sockets)) == 1, p.stdout
    assert sockets[0].startswith("@muster-ckpt-"), sockets  # abstract: no file anywhere
    helpers = values(p.stdout, "HELPER")
    assert all(h.startswith("True " + str(scratch) + "/") for h in helpers), p.stdout
    # The helper comes from the user's shared copy in the same directory, not owned by others.
    entries = {h.split(" ", 1)[1] for h in helpers}
    assert len(entries) == 1, entries
    shared = Path(entries.pop())
    assert shared.parent == scratch and SHARED.match(shared.name), shared
    assert shared.stat().st_uid == os.geteuid() and shared.stat().st_mode & 0o022 == 0
    errfiles = values(p.stdout, "ERRFILE")
    assert all(e.startswith(str(scratch) + "/") and e.endswith("/error.json") for e in errfiles)
    # One private directory per agent: <dir>/muster-<owner>-<random>/<run_id>_<random>/
    # attempt_0/<rank>/error.json (torchrun's shape below it).
    private = {Path(e).parents[3] for e in errfiles}
    assert len(private) == 1 and private.pop().parent == scratch, errfiles
    # The helper reached the agent through the abstract socket.
    assert values(p.stdout, "CONNECTED") == ["True", "True"], p.stdout
    assert NO_WRITABLE not in p.stderr
    assert left_behind(scratch) == [], "muster left files behind"
    # The next agent imports from the same copy: nothing is written again.
    made = (shared / "sitecustomize.py").stat().st_ino
    again = muster(["--tmp-dir", str(scratch), *args])
    assert again.returncode == 0, again.stderr
    assert values(again.stdout, "HELPER") == ["True " + str(shared)] * 2, again.stdout
    assert (shared / "sitecustomize.py").stat().st_ino == made
    assert left_behind(scratch) == []


def test_tmpdir_is_tried_first_and_an_unwritable_one_is_skipped(tmp_path):
    scratch = tmp_path / "t"
    scratch.mkdir()
    args = ["--nproc-per-node", "1", "--no-python", sys.executable, "-c", REPORT]
    p = muster(args, env={"TMPDIR": str(scratch)})
    assert p.returncode == 0, p.stderr
    assert values(p.stdout, "HELPER")[0].startswith("True " + str(scratch) + "/"), p.stdout
    # A TMPDIR that cannot take a directory (a path below a regular file) falls through to /tmp.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = muster(args, env={"TMPDIR": str(blocker / "sub")})
    assert p.returncode == 0, p.stderr
    helper = values(p.stdout, "HELPER")[0]
    assert helper.startswith("True /tmp/") or helper.startswith("True /dev/shm/"), p.stdout


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_unusable_tmp_dir_is_a_202_naming_it_and_the_fix(tmp_path, how):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = str(blocker / "scratch")
    args = ["--no-python", "/bin/true"]
    if how == "flag":
        p = muster(["--tmp-dir", bad, *args])
    else:
        p = muster(args, env={"MUSTER_TMP_DIR": bad})
    assert p.returncode == CONFIG_ERROR, (p.returncode, p.stderr)
    assert bad in p.stderr and "emptyDir" in p.stderr, p.stderr
    assert "panicked" not in p.stderr and "internal" not in p.stderr


def test_redirects_without_log_dir_write_no_file_and_keep_the_console(tmp_path):
    """torchrun writes --redirects/--tee files into a fresh temp directory; muster writes per-rank
    log files only under --log-dir, so without it the streams stay on the console (one warning)."""
    scratch = tmp_path / "t"
    scratch.mkdir()
    p = muster(["--nproc-per-node", "2", "--redirects", "3", "--tee", "1:1", "--no-python",
                "/bin/sh", "-c", 'echo "out-$RANK"; echo "err-$RANK" >&2'],
               env={"TMPDIR": str(scratch)})
    assert p.returncode == 0, p.stderr
    assert "out-0" in p.stdout and "out-1" in p.stdout, p.stdout
    assert "err-0" in p.stderr and "err-1" in p.stderr, p.stderr
    assert sum("only with --log-dir" in l for l in p.stderr.splitlines()) == 1, p.stderr
    assert left_behind(scratch) == [], "no log tree without --log-dir"


def test_nothing_writable_still_starts_with_one_warning(tmp_path):
    """A private mount namespace where /tmp and /dev/shm are read-only and TMPDIR is unset, as on
    a read-only root: the launch runs, the workers get the abstract socket but no helper and no
    error file, and one warning line names the fix."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    if muster_bin().startswith(("/tmp/", "/dev/shm/")):
        pytest.skip("the binary under test lives in a directory this test hides")
    worker = ('echo "SOCKET $MUSTER_CHECKPOINT_SOCKET"; echo "PP ${PYTHONPATH-unset}"; '
              'echo "ERRFILE ${TORCHELASTIC_ERROR_FILE-unset}"')
    script = ('mount -t tmpfs -o ro tmpfs /tmp && mount -t tmpfs -o ro tmpfs /dev/shm && '
              'exec "$@"')
    env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "PYTHONPATH")
           and not k.startswith(("PET_", "MUSTER_"))}
    errors = []
    for ns in (["--mount"], ["--user", "--map-root-user", "--mount"]):
        p = subprocess.run([unshare, *ns, "/bin/sh", "-c", script, "sh", muster_bin(),
                            "--nproc-per-node", "2", "--no-python", "/bin/sh", "-c", worker],
                           env=env, capture_output=True, text=True, timeout=60)
        if "mount:" not in p.stderr and "unshare:" not in p.stderr:
            break
        errors.append(p.stderr.strip())
    else:
        pytest.skip(f"cannot make a private mount namespace here: {errors}")
    assert p.returncode == 0, p.stderr
    assert all(s.startswith("@muster-ckpt-") for s in values(p.stdout, "SOCKET")), p.stdout
    assert values(p.stdout, "PP") == ["unset", "unset"], p.stdout
    assert values(p.stdout, "ERRFILE") == ["unset", "unset"], p.stdout
    warnings = [l for l in p.stderr.splitlines() if NO_WRITABLE in l]
    assert len(warnings) == 1 and "emptyDir" in warnings[0], p.stderr
