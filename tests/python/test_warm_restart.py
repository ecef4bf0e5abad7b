"""Warm restarts (`--warm-restart on`, the default, issue #41): a restarted rank starts in a
standby that already imported torch, and observes the same start as a cold one; a standby killed
while it waits, or a script changed between attempts, means a cold start and an unharmed job; the
agent times each restart's phases.

1 node x 2 gloo ranks; rank 1 SIGKILLs itself at attempt 0 once the test saw both standbys
waiting with torch loaded (the test then creates the file the rank looks for)."""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import finish, muster_bin, muster_env

SCRIPT = """\
import json, os, random, signal, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["OUT_DIR"]
report = {
    "argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
    "name": __name__, "random": random.random(), "torch_seed": torch.initial_seed(),
    "torch_rand": torch.rand(1).item(), "threads": torch.get_num_threads(), "pid": os.getpid(),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "rank_env": os.environ["RANK"], "standby_env": os.environ.get("MUSTER_STANDBY_FD"),
    "oom_score_adj": open("/proc/self/oom_score_adj").read().strip(), "t": time.time(),
}
with open(os.path.join(out, "report_%d_%d.json" % (attempt, rank)), "w") as f:
    json.dump(report, f)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
kill_file = os.environ["KILL_FILE"]
for step in range(100000):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    t = torch.ones(1)
    dist.all_reduce(t)
    if attempt == 0 and rank == 1 and os.path.exists(kill_file):
        with open(os.path.join(out, "killed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt > 0 and step >= 5:
        break
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
# Not the interpreter's own shutdown: torch 2.15's gloo teardown sometimes aborts there (SIGABRT,
# "terminate called without an active exception"); what a warm rank sees at its start is the test.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def standbys():
    """The pids of the standby interpreters running now, with whether each loaded torch."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"muster_launcher.standby" not in cmdline or b"-c" not in cmdline:
                continue
            with open(f"/proc/{pid}/maps") as f:
                torch_loaded = "libtorch" in f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            threads = len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
        found[int(pid)] = torch_loaded and state == "S" and threads == 1
    return found


def wait_for_waiting_standbys(proc, count=2, limit=120):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.poll() is None, "muster ended before its standbys were ready"
        ready = [pid for pid, waiting in standbys().items() if waiting]
        if len(ready) >= count:
            # Imports done and blocked on the socket; give the ready line a moment.
            time.sleep(1.0)
            return ready
        time.sleep(0.2)
    pytest.fail(f"no {count} waiting standbys within {limit} s: {standbys()}")


def start(tmp_path, warm, name="job", module=False):
    """`warm` True or False: `--warm-restart on|off`; None: muster's default (no flag, no
    variable)."""
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "train.py"
    if not script.exists():
        script.write_text(SCRIPT)
    env = muster_env({"OUT_DIR": str(out), "KILL_FILE": str(out / "kill"),
                      "MUSTER_WARM_RESTART": ""})
    target = ["-m", "train"] if module else [str(script)]
    switch = [] if warm is None else ["--warm-restart", "on" if warm else "off"]
    proc = subprocess.Popen(
        [muster_bin(), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         *switch, "--metrics-addr", "none",
         "--gpu-release-timeout", "0", "--shutdown-timeout", "3", *target, "--flag", "x"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    return proc, out, script


def reports(out):
    return {(int(m.group(1)), int(m.group(2))): json.loads(p.read_text())
            for p in out.iterdir() if (m := re.match(r"report_(\d)_(\d)\.json", p.name))}


def recovery(out):
    """Seconds from rank 1's SIGKILL to the last rank of attempt 1 past init_process_group."""
    killed = float((out / "killed_at").read_text())
    got = reports(out)
    return max(got[(1, r)]["t"] for r in (0, 1)) - killed


# The agent's line once every local rank of the restarted attempt stepped: each phase timed.
PHASES = ("stop", "decide", "rendezvous", "spawn", "startup", "init_process_group", "first_step")


def restart_cost(err, warm_of_two):
    line = re.search(r"restart 1 \(node 0\): every local rank stepping again ([\d.]+) s after the "
                     r"attempt ended \(muster's own share ([\d.]+) s\): (.*)", err)
    assert line, err
    total, own, phases = float(line.group(1)), float(line.group(2)), line.group(3)
    took = dict(re.findall(r"(\w+) ([\d.]+) s", phases))
    assert tuple(took) == PHASES, phases
    assert f"spawn {took['spawn']} s ({warm_of_two} of 2 warm)" in phases, phases
    assert abs(sum(float(v) for v in took.values()) - total) < 0.05, phases
    assert own <= total, phases
    return total, own


def run_to_end(proc, out, warm, before_kill=None):
    if warm or warm is None:
        wait_for_waiting_standbys(proc)
        if before_kill:
            before_kill()
    else:
        deadline = time.monotonic() + 120
        while len(reports(out)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
    (out / "kill").touch()
    return finish(proc, 150)


@pytest.mark.timeout(400)
def test_warm_ranks_start_as_cold_ones(tmp_path):
    proc, out, script = start(tmp_path, warm=True, name="warm")
    code, _, err = run_to_end(proc, out, warm=True)
    assert code == 0, err
    for rank in (0, 1):
        assert re.search(rf"rank {rank} \(local rank {rank}\): warm start in its standby", err), err
        # What each standby costs, said once it is ready.
        assert re.search(rf"local rank {rank}: standby ready \(pid \d+\): \d+ MiB resident, "
                         r"[\d.]+ s of CPU for its start and imports", err), err
    warm = reports(out)
    assert sorted(warm) == [(0, 0), (0, 1), (1, 0), (1, 1)], warm
    warm_cost = restart_cost(err, 2)
    proc, cold_out, _ = start(tmp_path, warm=False, name="cold")
    code, _, cold_err = run_to_end(proc, cold_out, warm=False)
    assert code == 0, cold_err
    assert "warm start" not in cold_err and "cold start" not in cold_err, cold_err
    cold_cost = restart_cost(cold_err, 0)
    cold = reports(cold_out)
    print(f"kill -> every rank past init_process_group: warm {recovery(out):.2f} s, "
          f"cold {recovery(cold_out):.2f} s; restart lines (total, muster's own): warm "
          f"{warm_cost}, cold {cold_cost}")
    for rank in (0, 1):
        w, c = warm[(1, rank)], cold[(1, rank)]
        for key in ("argv", "file", "path0", "cwd", "name", "threads",
                    "sigterm_default", "rank_env", "standby_env", "oom_score_adj"):
            assert w[key] == c[key], (key, w[key], c[key])
        assert w["argv"] == [str(script), "--flag", "x"]
        # The warm rank is the standby: started before the attempt.
        assert w["pid"] != warm[(0, rank)]["pid"]
    # Fresh random state: never shared between ranks or attempts.
    values = [r["random"] for r in warm.values()]
    assert len(set(values)) == len(values), values
    # torch's CPU generator as in a cold process: drawn per process where torch draws it (2.x),
    # else its fixed default seed.
    if cold[(1, 0)]["torch_seed"] != cold[(1, 1)]["torch_seed"]:
        seeds = [r["torch_seed"] for r in warm.values()]
        assert len(set(seeds)) == len(seeds), seeds
    else:
        assert warm[(1, 0)]["torch_seed"] == cold[(1, 0)]["torch_seed"]


@pytest.mark.timeout(240)
def test_a_standby_killed_while_it_waits_means_a_cold_start(tmp_path):
    proc, out, _ = start(tmp_path, warm=True)

    def kill_standbys():
        for pid in standbys():
            os.kill(pid, signal.SIGKILL)

    code, _, err = run_to_end(proc, out, warm=True, before_kill=kill_standbys)
    assert code == 0, err
    for rank in (0, 1):
        assert re.search(rf"rank {rank} \(local rank {rank}\): cold start: its standby died "
                         r"\(signal SIGKILL \(9\)\)", err), err
    assert (1, 1) in reports(out)


@pytest.mark.timeout(240)
def test_a_script_changed_between_attempts_means_a_cold_start(tmp_path):
    proc, out, script = start(tmp_path, warm=True)

    def change_script():
        with open(script, "a") as f:
            f.write("# changed\n")

    code, _, err = run_to_end(proc, out, warm=True, before_kill=change_script)
    assert code == 0, err
    assert "cold start: the script file changed since the standby started" in err, err
    assert "warm start" not in err, err


@pytest.mark.timeout(240)
def test_the_module_form_starts_warm_by_default(tmp_path):
    # No --warm-restart and no variable: the default is on for a job that can restart.
    proc, out, script = start(tmp_path, warm=None, module=True)
    code, _, err = run_to_end(proc, out, warm=True)
    assert code == 0, err
    assert re.search(r"rank 1 \(local rank 1\): warm start in its standby", err), err
    got = reports(out)
    for rank in (0, 1):
        cold, warm = got[(0, rank)], got[(1, rank)]
        for key in ("argv", "file", "path0", "cwd", "name"):
            assert warm[key] == cold[key], (key, warm[key], cold[key])
    assert got[(1, 0)]["argv"] == [str(script), "--flag", "x"]


# One rank per node, as a one-GPU pod runs it: neither torchrun nor muster sets OMP_NUM_THREADS,
# so numpy's OpenBLAS starts its pool of native threads when it loads (1 on 2 CPUs).
ONE_RANK = """\
import json, os, signal, sys, time
import numpy
import torch
import torch.distributed as dist

def nice_of(tid):
    with open("/proc/self/task/%s/stat" % tid) as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])

dist.init_process_group("gloo")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["OUT_DIR"]
tasks = os.listdir("/proc/self/task")
with open(os.path.join(out, "threads_%d.json" % attempt), "w") as f:
    json.dump({"nice": {t: nice_of(t) for t in tasks}, "main": str(os.getpid()),
               "blas": numpy.ones((64, 64)).dot(numpy.ones((64, 64)))[0, 0]}, f)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(100000):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    if attempt == 0 and os.path.exists(os.environ["KILL_FILE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt > 0 and step >= 5:
        break
    time.sleep(0.05)
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.timeout(300)
def test_one_rank_per_node_with_numpys_thread_pool_restarts_warm(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "one.py").write_text(ONE_RANK)
    env = muster_env({"OUT_DIR": str(out), "KILL_FILE": str(out / "kill"),
                      "MUSTER_WARM_RESTART": ""})
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [muster_bin(), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
         "--warm-restart", "on", "--metrics-addr", "none", "--shutdown-timeout", "3",
         str(tmp_path / "one.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    # The standby is waiting once its imports are done: torch loaded, asleep on its socket, and
    # every thread it keeps (the main one and OpenBLAS's pool) at the main thread's priority.
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        assert proc.poll() is None, "muster ended before its standby was ready"
        ready = [pid for pid in standbys_with_pools() if pid]
        if ready and (out / "threads_0.json").exists():
            time.sleep(1.0)
            break
        time.sleep(0.2)
    else:
        pytest.fail("no standby waiting with torch loaded within 150 s")
    (out / "kill").touch()
    code, _, err = finish(proc, 150)
    assert code == 0, err
    assert re.search(r"rank 0 \(local rank 0\): warm start in its standby", err), err
    assert "cold start" not in err, err
    cold, warm = (json.loads((out / f"threads_{a}.json").read_text()) for a in (0, 1))
    # The pool is there in both, and in the warm rank at the main thread's priority.
    assert len(cold["nice"]) >= 2 and len(warm["nice"]) >= 2, (cold, warm)
    assert set(warm["nice"].values()) == {warm["nice"][warm["main"]]} == {0}, warm
    assert warm["blas"] == cold["blas"] == 64.0


def standbys_with_pools():
    """The standby interpreters now waiting with torch loaded, every thread at one priority."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"muster_launcher.standby" not in f.read():
                    continue
            with open(f"/proc/{pid}/maps") as f:
                if "libtorch" not in f.read():
                    continue
            nice = set()
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                nice.add(int(fields[16]))
                if tid == pid and fields[0] != "S":
                    nice.add(None)
        except OSError:
            continue
        if len(nice) == 1:
            found.append(int(pid))
    return found
