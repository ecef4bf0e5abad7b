"""`scripts/bench --check`: a few minutes of benchmarks that catch the next slowdown.

Each row is a ratio of muster against its peer or its floor measured side by side in the same
run (never an absolute time: this is a shared 2-core machine), repeated ROUNDS times; the row's
value is the median of the rounds. It is compared with the value recorded in
scripts/bench.d/baseline.json, within a noise margin of its own: three times the spread the
baseline's own rounds showed (their median absolute deviation, scaled to a standard deviation),
and never less than MIN_MARGIN of the baseline value. A row worse by more than its margin is
measured again (its group's rounds once more); worse by more than its margin both times, it is a
regression: the table says REGRESSED with both values and the exit code is 1. Worse only once,
the table says so ("ok on a second look") and the exit code stays 0.

Rows (all "lower is better" except where the table says otherwise):
- launch ready / exit: `muster --standalone --nproc-per-node 2` running
  tests/python/scripts/print_rank.py, until both ranks printed / until muster exited, against
  two directly spawned Python processes (scripts/bench.d/20-launch's floor), in pairs run back
  to back (a round is the median of its pairs' ratios);
- agent start: N single-node agents (`--no-python true`) started at once, against N
  `muster --version` started the same way: what each agent pays to start and stop beyond
  loading the binary (the runtime, its files, threads, the rank);
- gang of N: N agents forming one gang on loopback (node 0 hosting the store, one trivial rank
  each; scripts/bench.d/40-scale's setup at a moderate size), against the same N agents started
  single-node: what the rendezvous adds;
- store GET 1 conn: muster's store against torch's libuv TCPStore, request/reply GETs over one
  connection (muster-loadgen, as in scripts/bench.d/10-store); higher is better.

  scripts/bench --check                   # compare with the committed baseline
  scripts/bench --check --record          # measure (more rounds) and write the baseline
  CHECK_ROWS=launch,store scripts/bench --check   # only these groups (launch, scale, store)
  CHECK_ROUNDS=9 CHECK_SCALE_N=512 ...    # more rounds, a larger gang (default 5/7 and 256)
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "scripts" / "bench.d" / "baseline.json"
MUSTER = os.environ.get("MUSTER_BIN", str(REPO / "target" / "release" / "muster"))
LOADGEN = os.environ.get("MUSTER_LOADGEN", str(REPO / "target" / "release" / "muster-loadgen"))
PY = os.environ.get("MUSTER_TORCH_PYTHON", sys.executable)
SCRIPT = str(REPO / "tests" / "python" / "scripts" / "print_rank.py")
RECORD = "--record" in sys.argv[1:]
ROUNDS = int(os.environ.get("CHECK_ROUNDS", "7" if RECORD else "5"))
LAUNCH_REPS = 8
SCALE_N = int(os.environ.get("CHECK_SCALE_N", "256"))
MIN_MARGIN = 0.10

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MUSTER_"))}
ENV["PYTHON_EXEC"] = PY
ENV.pop("JOB_COMPLETION_INDEX", None)


def median_ms(samples):
    return statistics.median(samples) * 1e3


# -- launch -------------------------------------------------------------------------------------

def stamps(text):
    return [int(t) for t in (w.split("t_ns=")[1] for w in text.split() if "t_ns=" in w)]


def timed(cmds, env):
    """Starts `cmds` at once; (time until the last rank printed, until all exited), seconds."""
    t0 = time.time_ns()
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=e) for c, e in zip(cmds, env)]
    out = "".join(p.communicate()[0] for p in procs)
    end = time.time_ns()
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"{cmds[0][:3]} failed: {out}")
    return (max(stamps(out)) - t0) / 1e9, (end - t0) / 1e9


def launch_round():
    """LAUNCH_REPS pairs, each a direct spawn then muster, back to back: the ratio of each pair
    cancels the machine's slower drifts; the round's value is the pairs' median."""
    direct = [[PY, SCRIPT]] * 2
    direct_env = [dict(ENV, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2") for r in range(2)]
    muster = [[MUSTER, "--standalone", "--nproc-per-node", "2", SCRIPT]]
    ready, exit_ = [], []
    for _ in range(LAUNCH_REPS):
        d = timed(direct, direct_env)
        m = timed(muster, [ENV])
        ready.append(m[0] / d[0])
        exit_.append(m[1] / d[1])
    return {"launch ready (× direct spawn)": statistics.median(ready),
            "launch exit (× direct spawn)": statistics.median(exit_)}


# -- agents at scale ------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_all(argvs):
    """Spawns every argv at once (posix_spawn, output discarded); seconds until the last exited."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    env = dict(ENV, MUSTER_NETWORK_CHECK="off")
    t0 = time.monotonic()
    pids = [os.posix_spawn(a[0], a, env, file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 1),
                                                       (os.POSIX_SPAWN_DUP2, devnull, 2)])
            for a in argvs]
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    wall = time.monotonic() - t0
    os.close(devnull)
    if failed:
        raise SystemExit(f"{failed} of {len(argvs)} processes failed ({argvs[0][:4]} ...)")
    return wall


def settle(limit=20.0):
    """Lets the previous round's processes leave the 1-minute load average (bounded)."""
    end = time.time() + limit
    while float(open("/proc/loadavg").read().split()[0]) > os.cpu_count() and time.time() < end:
        time.sleep(1)


def scale_round():
    n = SCALE_N
    settle()
    # The floor runs the same binary (exec, dynamic loading, argument parsing), so the ratio is
    # what a launch adds: the runtime, files, threads, the rank and its reaping.
    plain = start_all([[MUSTER, "--version"]] * n)
    single = start_all([[MUSTER, "--nproc-per-node", "1", "--metrics-addr", "none",
                         "--no-python", "true"]] * n)
    port = free_port()
    base = [MUSTER, "--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"check-{port}",
            "--local-addr", "127.0.0.1", "--rdzv-conf", "join_timeout=120",
            "--metrics-addr", "none"]
    gang = start_all([[*base, "--node-rank", str(i), "--no-python", "true"] for i in range(n)])
    return {f"agent start, {n} at once (× `muster --version`)": single / plain,
            f"gang of {n} agents (× {n} single-node agents)": gang / single}


# -- store ----------------------------------------------------------------------------------------

def store_round(servers):
    rates = {}
    for name, addr in servers.items():
        out = subprocess.run([LOADGEN, "ops", "--addr", addr, "--conns", "1", "--secs", "1"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        rates[name] = json.loads(out.strip().splitlines()[-1])["get_per_s"]
    return {"store GET 1 conn (× torch libuv; higher is better)": rates["muster"] / rates["libuv"]}


class StoreServers:
    """muster's store and torch's libuv TCPStore on loopback, for the rounds' lifetime."""

    def __enter__(self):
        self.muster = subprocess.Popen([MUSTER, "store", "--host", "127.0.0.1", "--port", "0"],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True)
        muster_addr = self.muster.stdout.readline().split()[-1]
        self.torch = subprocess.Popen([PY, str(REPO / "tests/python/tools/torch_store_host.py")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        self.torch.stdin.write("new libuv\n")
        self.torch.stdin.flush()
        libuv_port = self.torch.stdout.readline().strip()
        return {"muster": muster_addr, "libuv": f"127.0.0.1:{libuv_port}"}

    def __exit__(self, *exc):
        self.muster.kill()
        self.torch.stdin.close()
        self.torch.wait(timeout=30)
        self.muster.wait()


# -- comparison -----------------------------------------------------------------------------------

def higher_is_better(row):
    return "higher is better" in row


def spread(values):
    """Median absolute deviation, scaled to a standard deviation's size for normal noise."""
    m = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - m) for v in values)


def wanted(group):
    only = os.environ.get("CHECK_ROWS", "")
    return not only or group in only.split(",")


def measure(groups_wanted=None):
    """Rounds per row for every wanted group (`groups_wanted`: only these, e.g. a second look);
    returns ({row: [values]}, {row: its group})."""
    rounds, group_of = {}, {}
    groups = [("launch", launch_round), ("scale", scale_round)]
    if Path(LOADGEN).exists():
        groups.append(("store", None))
    for group, fn in groups:
        if not wanted(group) or (groups_wanted is not None and group not in groups_wanted):
            continue
        print(f"measuring {group} ({ROUNDS} rounds) ...", file=sys.stderr, flush=True)
        if group == "store":
            with StoreServers() as servers:
                for _ in range(ROUNDS):
                    for row, v in store_round(servers).items():
                        rounds.setdefault(row, []).append(v)
                        group_of[row] = group
            continue
        for _ in range(ROUNDS):
            for row, v in fn().items():
                rounds.setdefault(row, []).append(v)
                group_of[row] = group
    return rounds, group_of


def worse_by(row, base, now):
    return base["value"] - now if higher_is_better(row) else now - base["value"]


def describe():
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "cpus": os.cpu_count(),
            "load_1min": float(open("/proc/loadavg").read().split()[0]),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main():
    rounds, group_of = measure()
    if RECORD:
        rows = {row: {"value": round(statistics.median(vs), 4), "spread": round(spread(vs), 4),
                      "rounds": [round(v, 4) for v in vs]} for row, vs in rounds.items()}
        BASELINE.write_text(json.dumps({"recorded": describe(), "rows": rows}, indent=2) + "\n")
        print(f"baseline written to {BASELINE.relative_to(REPO)}")
        for row, r in rows.items():
            print(f"- {row}: {r['value']:.3f} (spread {r['spread']:.3f})")
        return 0
    baseline = json.loads(BASELINE.read_text())
    now = {row: statistics.median(vs) for row, vs in rounds.items()}

    def margin(row):
        base = baseline["rows"][row]
        return max(3 * base["spread"], MIN_MARGIN * base["value"])

    def beyond(row, value):
        base = baseline["rows"].get(row)
        return base is not None and worse_by(row, base, value) > margin(row)

    # A shared machine has moments that no baseline's spread foresaw (the same binary has read
    # 1.30 and 1.53 on the gang row an hour apart): a row that reads worse is measured again, and
    # only a row worse both times is a regression, as the network check names only a link that
    # stays slow.
    suspects = [row for row in now if beyond(row, now[row])]
    second = {}
    if suspects:
        print(f"measuring again: {', '.join(suspects)}", file=sys.stderr, flush=True)
        again, _ = measure({group_of[row] for row in suspects})
        second = {row: statistics.median(again[row]) for row in suspects if row in again}
    print(f"baseline: {baseline['recorded']}; now: {describe()}\n")
    print("| row | baseline | now | margin | verdict |")
    print("|---|---:|---:|---:|---|")
    regressed = 0
    for row, value in now.items():
        base = baseline["rows"].get(row)
        if base is None:
            print(f"| {row} | – | {value:.3f} | – | no baseline (record one) |")
            continue
        shown = f"{value:.3f}"
        if row in suspects:
            again_value = second.get(row, value)
            shown = f"{value:.3f}, again {again_value:.3f}"
            if beyond(row, again_value):
                verdict = "REGRESSED"
                regressed += 1
            else:
                verdict = "ok on a second look"
        elif worse_by(row, base, value) < -margin(row):
            verdict = "better (record a new baseline)"
        else:
            verdict = "ok"
        print(f"| {row} | {base['value']:.3f} | {shown} | ±{margin(row):.3f} | {verdict} |")
    print(f"\n{regressed} row(s) regressed" if regressed else "\nno row regressed")
    return 1 if regressed else 0


if __name__ == "__main__":
    sys.exit(main())
