"""Worker output: every line prefixed and whole (never interleaved mid-line), the template and
JSON formats, torchrun's per-rank files with --log-dir/--redirects/--tee, --local-ranks-filter."""
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port, muster_bin, muster_env, wait_until

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


CHATTY_RANK = r'''
import os, sys, time
rank, go = os.environ["RANK"], sys.argv[1]
for i in range(int(sys.argv[2])):
    print(f"fill-{rank}-{i:05d}-" + rank * 60)
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
# Paced over 2 s: a file that failed is tried again at most once a second.
for i in range(int(sys.argv[3])):
    print(f"after-{rank}-{i:03d}")
    time.sleep(0.05)
'''


def _scrape(port):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _metric(body, name, rank):
    m = re.search(r'^%s\{rank="%d",stream="stdout"\} (\S+)$' % (name, rank), body, re.M)
    return float(m.group(1)) if m else None


def test_a_full_log_volume_warns_counts_keeps_the_console_and_resumes(tmp_path):
    """Issue #33: `--log-dir` on a 1 MiB tmpfs that two chatty ranks fill. Each rank's file warns
    once, naming itself and ENOSPC; the metrics count the lines it misses; the console has every
    line; the job exits 0. When space returns the files are written again, with a marker line
    saying how many lines are missing there."""
    mnt = tmp_path / "logs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs (root and CAP_SYS_ADMIN needed): "
                    f"{mounted.stderr.strip()}")
    proc = None
    try:
        # 128 KiB left: each rank's 225 KB of lines fill it.
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (896 * 1024))
        script = tmp_path / "chatty.py"
        script.write_text(CHATTY_RANK)
        go = tmp_path / "go"
        fill, after, port = 3000, 40, free_port()
        proc = subprocess.Popen(
            [muster_bin(), "--nproc-per-node", "2", "--log-dir", str(mnt), "--tee", "1",
             "--rdzv-id", "full", "--metrics-addr", f"127.0.0.1:{port}",
             str(script), str(go), str(fill), str(after)],
            env=muster_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = [], []
        readers = [threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
                   for s, into in ((proc.stdout, out), (proc.stderr, err))]
        for r in readers:
            r.start()

        def dropping():
            assert proc.poll() is None, "".join(err)
            try:
                body = _scrape(port)
            except OSError:
                return False
            return all((_metric(body, "muster_worker_log_file_lines_dropped_total", r) or 0) > 0
                       for r in (0, 1)) and sum("fill-" in l for l in out) == 2 * fill
        wait_until(dropping, 90, what="both ranks' files to drop lines")
        body = _scrape(port)
        for r in (0, 1):
            assert _metric(body, "muster_worker_log_file_write_failures_total", r) == 1, body
        # Space returns; the ranks' next lines come over a second after the last failed try.
        filler.unlink()
        time.sleep(1.5)
        go.touch()
        assert proc.wait(timeout=90) == 0, "".join(err)
        for r in readers:
            r.join(timeout=10)
        stdout, stderr = "".join(out), "".join(err)

        (run_dir,) = [d for d in mnt.iterdir() if d.name.startswith("full_")]
        for r in (0, 1):
            path = run_dir / "attempt_0" / str(r) / "stdout.log"
            # One warning per file, naming it and the error.
            warned = [l for l in stderr.splitlines() if f"cannot write worker log {path}:" in l]
            assert len(warned) == 1, stderr[-3000:]
            assert "No space left on device" in warned[0], warned
            assert "the console keeps every line" in warned[0], warned
            # The console is complete, in order.
            prefix = f"[{os.uname().nodename.split('.')[0]}:{r}] "
            mine = [l[len(prefix):] for l in stdout.splitlines() if l.startswith(prefix)]
            assert mine == ([f"fill-{r}-{i:05d}-" + str(r) * 60 for i in range(fill)]
                            + [f"after-{r}-{i:03d}" for i in range(after)]), mine[-5:]
            # The file: what fitted, a marker with the count of the rest, then the later lines.
            text = path.read_text()
            m = re.search(r"^\[muster\] (\d+) line\(s\) missing here: No space left on device",
                          text, re.M)
            assert m, text[-500:]
            before, _, rest = text.partition(m.group(0))
            whole = [l for l in before.splitlines() if l == f"fill-{r}-{l[7:12]}-" + str(r) * 60]
            # (A rank whose first write found the volume full has no fill line at all.)
            assert len(whole) + int(m.group(1)) == fill, (len(whole), m.group(1))
            assert rest.splitlines()[1:] == [f"after-{r}-{i:03d}" for i in range(after)]
            assert (f"worker log {path} is written again; {m.group(1)} line(s) are missing"
                    in stderr), stderr[-3000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
