"""Progress bars in worker output: carriage-return updates coalesced per rank to one per
--progress-interval, ordinary lines untouched and in order, the bar's final state kept, the
agent's memory flat under a flood; a real tqdm loop in a 2-rank job; per-rank files treated the
same; the bytes/lines metrics."""
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, muster_bin, muster_env

pytestmark = pytest.mark.timeout(300)

SCRIPTS = Path(__file__).parent / "scripts"
HOST = os.uname().nodename.split(".")[0]


def env_for(extra=None):
    return muster_env({"MUSTER_METRICS_ADDR": "none", **(extra or {})})


def run_sampling_rss(args, env):
    """Runs muster; returns (stdout, stderr, seconds, RSS samples in KiB, VmHWM in KiB)."""
    t0 = time.monotonic()
    p = subprocess.Popen([muster_bin(), *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    rss, hwm = [], 0
    chunks = {1: [], 2: []}

    def drain(stream, key):
        for block in iter(lambda: stream.read1(65536), b""):  # as it arrives
            chunks[key].append(block)

    readers = [threading.Thread(target=drain, args=(p.stdout, 1)),
               threading.Thread(target=drain, args=(p.stderr, 2))]
    for t in readers:
        t.start()
    agent = os.path.realpath(muster_bin())
    while p.poll() is None:
        # Sampled once the agent pumps the worker's output: before exec /proc shows the forked
        # Python child (a few hundred KiB), and before its first line the agent is still
        # setting up, neither of which says anything about the flood.
        if not chunks[1]:
            time.sleep(0.005)
            continue
        try:
            if os.readlink(f"/proc/{p.pid}/exe") == agent:
                status = Path(f"/proc/{p.pid}/status").read_text()
                rss.append(int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)))
                hwm = max(hwm, int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)))
        except (OSError, AttributeError):
            pass
        time.sleep(0.02)
    for t in readers:
        t.join()
    elapsed = time.monotonic() - t0
    out, err = b"".join(chunks[1]).decode(), b"".join(chunks[2]).decode()
    assert p.returncode == 0, err[-3000:]
    return out, err, elapsed, rss, hwm


def body_of(line, rank):
    prefix = f"[{HOST}:{rank}] "
    assert line.startswith(prefix), line[:80]
    return line[len(prefix):]


def test_a_carriage_return_flood_becomes_a_handful_of_lines():
    interval = 1.0
    updates = 800_000  # 9.6 MB of updates: long enough to sample the agent during the flood
    quarter = updates // 4
    out, err, elapsed, rss, hwm = run_sampling_rss(
        ["--standalone", "--nproc-per-node", "1", "--progress-interval", str(interval),
         str(SCRIPTS / "progress_flood.py")],
        env_for({"UPDATES": str(updates)}))
    bodies = [body_of(l, 0) for l in out.splitlines()]
    lines = [b for b in bodies if b.startswith("line-")]
    bars = [b for b in bodies if b.startswith("step ")]
    assert len(bodies) == len(lines) + len(bars), [b for b in bodies if b not in lines + bars]
    assert lines == [f"line-{i:03d}" for i in range(100)]  # all, in order
    # A handful: the first update, one per interval, and the pending one before each of the
    # four ordinary lines written among the updates (and at the end).
    assert 2 <= len(bars) <= elapsed / interval + 6, (len(bars), elapsed)
    assert bars[0] == "step 000000"
    assert bars == sorted(bars)  # never reordered
    # The final bar state shows, before the line that followed it.
    i = bodies.index(f"step {updates - 1:06d}")
    assert bodies[i + 1] == "line-053"
    # Each interleaved line comes right after the bar state it interrupted.
    for k, after in [(1, 50), (2, 51), (3, 52)]:
        step = k * quarter - 1
        assert bodies[bodies.index(f"line-{after:03d}") - 1] == f"step {step:06d}"
    assert len(out) < 10_000, len(out)  # instead of 9.6 MB
    # Memory flat: a small agent whatever the flood (bounded by its 4 MiB output budget).
    print(f"\n{len(bars)} progress lines in {elapsed:.1f}s; agent RSS samples ({len(rss)}) "
          f"min {min(rss, default=0)} max {max(rss, default=0)} KiB, VmHWM {hwm} KiB")
    assert rss, "the run ended before the agent could be sampled during the flood"
    assert hwm < 32 * 1024, hwm
    assert max(rss) - min(rss) < 8 * 1024, (min(rss), max(rss))


def test_interval_zero_writes_every_update():
    out, _, _, _, _ = run_sampling_rss(
        ["--standalone", "--progress-interval", "0", str(SCRIPTS / "progress_flood.py")],
        env_for({"UPDATES": "1000"}))
    bodies = [body_of(l, 0) for l in out.splitlines()]
    assert [b for b in bodies if b.startswith("step ")] == [f"step {i:06d}" for i in range(1000)]
    assert [b for b in bodies if b.startswith("line-")] == [f"line-{i:03d}" for i in range(100)]


def test_a_real_tqdm_loop_in_a_two_rank_job(tmp_path):
    steps = 30000
    out, err, elapsed, rss, hwm = run_sampling_rss(
        ["--standalone", "--nproc-per-node", "2", "--log-format", "json",
         "--progress-interval", "1", "--log-dir", str(tmp_path), "--tee", "2",
         str(SCRIPTS / "tqdm_loop.py")],
        env_for({"STEPS": str(steps)}))
    records = [json.loads(l) for l in err.splitlines()]
    for rank in (0, 1):
        mine = [r for r in records if r["source"] == "rank" and r["rank"] == rank]
        assert all(r["stream"] == "stderr" for r in mine)
        lines = [r["msg"] for r in mine if not r["progress"]]
        bars = [r["msg"] for r in mine if r["progress"]]
        assert lines[:5] == [f"before-{i}" for i in range(5)]
        assert lines[-5:] == [f"after-{i}" for i in range(5)]
        # tqdm ends its bar with a newline: the final state is an ordinary line.
        assert len(lines) == 11 and lines[5].startswith("100%") and f"{steps}/{steps}" in lines[5]
        assert 1 <= len(bars) <= elapsed + 4, (len(bars), elapsed)
        assert all("%|" in b and "\x1b" not in b for b in bars)
        # The per-rank file holds the same records, unprefixed.
        (run_dir,) = tmp_path.iterdir()
        text = (run_dir / "attempt_0" / str(rank) / "stderr.log").read_text()
        assert text.splitlines() == [r["msg"] for r in mine]
    print(f"\ntqdm: {steps} iterations per rank in {elapsed:.1f}s -> "
          f"{len(records)} records; agent VmHWM {hwm} KiB")
    assert hwm < 32 * 1024, hwm


def test_bytes_and_lines_metrics_per_rank():
    port = free_port()
    script = ("import os, sys, time\n"
              "r = int(os.environ['RANK'])\n"
              "sys.stdout.write('x' * 9)\n"
              "for i in range(10 * (r + 1)): print(f'line {i}')\n"
              "for i in range(7): sys.stderr.write(f'{i}%\\r')\n"
              "sys.stderr.write('done\\n')\n"
              "sys.stdout.flush(); sys.stderr.flush()\n"
              "time.sleep(float(os.environ['HOLD']))\n")
    worker = Path(os.environ.get("TMPDIR", "/tmp")) / f"muster-metrics-worker-{os.getpid()}.py"
    worker.write_text(script)
    env = env_for({"HOLD": "30", "MUSTER_METRICS_ADDR": f"127.0.0.1:{port}"})
    p = subprocess.Popen([muster_bin(), "--standalone", "--nproc-per-node", "2", str(worker)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        want = {
            ('muster_worker_output_lines_total', '0', 'stdout'): 10,
            ('muster_worker_output_lines_total', '1', 'stdout'): 20,
            ('muster_worker_output_lines_total', '1', 'stderr'): 1,
            ('muster_worker_progress_updates_total', '0', 'stderr'): 7,
            ('muster_worker_output_bytes_total', '0', 'stderr'): len("".join(
                f"{i}%\r" for i in range(7))) + len("done\n"),
            # `xxxxxxxxx` joins the first line; 10 lines `line N\n`.
            ('muster_worker_output_bytes_total', '0', 'stdout'): 9 + sum(
                len(f"line {i}\n") for i in range(10)),
        }
        deadline = time.monotonic() + 60
        seen = {}
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                              timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
                continue
            seen = {(m[0], m[1], m[2]): float(m[3]) for m in re.findall(
                r'^(muster_worker_\w+)\{rank="(\d+)",stream="(\w+)"\} (\S+)$', text, re.M)}
            if all(seen.get(k) == v for k, v in want.items()):
                break
            time.sleep(0.2)
        assert all(seen.get(k) == v for k, v in want.items()), (want, seen)
    finally:
        p.terminate()
        p.wait(timeout=60)
        worker.unlink()
