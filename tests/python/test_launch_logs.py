"""Worker output: every line prefixed and whole (never interleaved mid-line), the template and
JSON formats, torchrun's per-rank files with --log-dir/--redirects/--tee, --local-ranks-filter."""
import json
import os
import subprocess
from pathlib import Path

from conftest import muster_bin, muster_env

SCRIPTS = Path(__file__).parent / "scripts"


def muster(args, env=None, timeout=60):
    full_env = muster_env(env)
    p = subprocess.run([muster_bin(), *args], env=full_env, capture_output=True, timeout=timeout)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return p.stdout.decode(), p.stderr.decode()


def test_lines_are_prefixed_and_never_interleaved():
    lines, width = 300, 3000
    out, err = muster(["--nproc-per-node", "3", str(SCRIPTS / "chatter.py")],
                      env={"LINES": str(lines), "WIDTH": str(width)})
    host = os.uname().nodename.split(".")[0]
    seen = {r: [] for r in range(3)}
    for line in out.splitlines():
        prefix = line[: line.index("] ") + 2]
        body = line[len(prefix):]
        rank = int(prefix[len(host) + 2: -2])
        assert prefix == f"[{host}:{rank}] ", line[:80]
        seen[rank].append(body)
    for r in range(3):
        body = seen[r]
        assert body[-1] == f"tail-{r}"  # the last line had no newline and still shows
        assert len(body) == lines + 1
        for i, b in enumerate(body[:-1]):
            # Whole line, from one rank, in order.
            assert b == f"r{r}-{i:05d}-".ljust(width, str(r)), (r, i, b[:40])
    for r in range(3):
        assert f"[{host}:{r}] stderr of {r}" in err.splitlines()


def test_prefix_template_with_torchrun_macros():
    out, _ = muster(["--nproc-per-node", "2", "--role", "trainer",
                     "--log-line-prefix-template", "<${role_name}/${rank}/${local_rank}> ",
                     str(SCRIPTS / "chatter.py")], env={"LINES": "1", "WIDTH": "10"})
    assert "<trainer/0/0> r0-00000-0" in out.splitlines()
    assert "<trainer/1/1> r1-00000-1" in out.splitlines()


def test_json_lines():
    out, err = muster(["--nproc-per-node", "2", "--log-format", "json",
                       str(SCRIPTS / "chatter.py")], env={"LINES": "3", "WIDTH": "20"})
    rows = [json.loads(l) for l in out.splitlines()]
    assert {(r["rank"], r["local_rank"]) for r in rows} == {(0, 0), (1, 1)}
    assert all(r["stream"] == "stdout" and r["ts"].endswith("Z") and r["host"] for r in rows)
    assert {"msg": "tail-1", "rank": 1, "progress": False, "source": "rank"}.items() <= next(
        r for r in rows if r["msg"] == "tail-1").items()
    errs = [json.loads(l) for l in err.splitlines() if '"stream"' in l]
    assert {r["msg"] for r in errs} == {"stderr of 0", "stderr of 1"}
    assert all(r["stream"] == "stderr" for r in errs)


def test_log_dir_redirects_tee_and_filter(tmp_path):
    # Rank 0: stdout to file only; rank 1: stdout to file and console; stderr to console only.
    out, err = muster(["--nproc-per-node", "3", "--log-dir", str(tmp_path), "--redirects", "0:1",
                       "--tee", "1:1", "--local-ranks-filter", "0,1",
                       "--rdzv-id", "job7", "--master-port", "29999",
                       str(SCRIPTS / "chatter.py")], env={"LINES": "2", "WIDTH": "20"})
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("job7_")
    attempt = run_dir / "attempt_0"
    f0 = (attempt / "0" / "stdout.log").read_text()
    f1 = (attempt / "1" / "stdout.log").read_text()
    # Unprefixed lines; the last one, which had no newline, ends with one like the others.
    assert f0.startswith("r0-00000-") and f0.endswith("\ntail-0\n")
    assert f1.startswith("r1-00000-") and f1.endswith("\ntail-1\n")
    assert not (attempt / "2" / "stdout.log").exists()
    assert not (attempt / "0" / "stderr.log").exists()
    assert "r0-" not in out  # redirected without tee
    assert "tail-1" in out  # teed
    assert "r2-" not in out and "stderr of 2" not in err  # filtered
    assert "stderr of 0" in err and "stderr of 1" in err


def test_json_root_cause_summary():
    env = dict(os.environ)
    p = subprocess.run([muster_bin(), "--nproc-per-node", "2", "--log-format", "json",
                        "--no-python", "/bin/sh", "-c", '[ "$RANK" = 1 ] && exit 3; exec sleep 30'],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    events = [json.loads(l) for l in p.stderr.splitlines() if l.startswith("{")]
    (cause,) = [e for e in events if e.get("event") == "root_cause"]
    assert (cause["rank"], cause["local_rank"], cause["exit_code"], cause["signal"]) == (1, 1, 3, None)
    assert cause["agent_exit_code"] == 3 and cause["attempts"] == 1
