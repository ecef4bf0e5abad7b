"""`muster dry-run --chaos`: a seeded schedule of strikes on examples/train_checkpoint.py (real
PyTorch, gloo, 3 agents x 1 rank on loopback), pods replaced as a Job would replace them, and the
report at the end. The chaos run checks that every strike is recovered and that the report's
figures (steps lost, time to recovery) match what this test reads independently from the ranks'
own output (each rank prints every step, and where it resumed from); the plan tests check that a
seed is one schedule, printed alike by `--chaos-plan` and by the run."""

import json
import re
import subprocess
from datetime import datetime

import pytest

from conftest import REPO, finish, muster_bin, muster_env

EXAMPLE = str(REPO / "examples" / "train_checkpoint.py")
# Quick liveness so a lost node is noticed in seconds, and a join window a replacement fits in.
CONF = "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3"
# Seed 12, 5 strikes, each 4-6 s after the gang recovered from the one before: a preemption, two
# pods at once, node 0 lost, a crashed rank and a frozen rank (each kind once; `--chaos-plan`
# prints it).
SEED = "12:5"
INTERVAL = "4:6"
# 0.1 s steps: at most 10 steps a second, and the gang trains only between a recovery and the next
# strike (at most 30 s in all), so 500 steps outlast the last strike; a save every 20 steps bounds
# what a crash costs.
SCRIPT = ["--steps", "500", "--step-seconds", "0.1", "--log-every", "1", "--save-every", "20"]
KINDS = {"kill-rank", "kill", "term", "stop-rank", "two-pods"}
# The report samples the agents' step reports every 100 ms (one step); the ranks print theirs.
STEP_TOLERANCE = 3
SECONDS_TOLERANCE = 1.5


def base(*extra):
    return [muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "1",
            "--rdzv-conf", CONF, "--chaos", SEED, "--chaos-interval", INTERVAL, *extra]


def test_a_seed_is_one_schedule_and_chaos_plan_runs_nothing(tmp_path):
    def plan(seed):
        p = subprocess.run([muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "1",
                            "--chaos", seed, "--chaos-interval", INTERVAL, "--chaos-plan",
                            EXAMPLE, "--ckpt-dir", str(tmp_path / "ckpt")],
                           capture_output=True, text=True, timeout=60, env=muster_env())
        assert p.returncode == 0, p.stderr
        return p.stdout.splitlines()

    first, again, other = plan(SEED), plan(SEED), plan("13:5")
    assert first == again
    assert first != other
    assert len(first) == 6, first
    assert first[0].startswith("muster dry-run: chaos schedule of seed 12 for 3 node(s), 3 rank(s)")
    kinds = {re.search(r"\): (\S+?):", line).group(1) for line in first[1:]}
    assert kinds == {"kill-rank", "kill", "term", "stop-rank"}, first
    assert any(re.search(r"two-pods .*: kill:\d \+ kill:\d$", line) for line in first), first
    assert any(re.search(r"\(a lost pod, replaced\): kill:0$", line) for line in first), first
    # Nothing ran: no checkpoint directory, no agent.
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("args, message", [
    (["--chaos", "x"], "--chaos `x`: expected SEED or SEED:COUNT"),
    (["--chaos", "1", "--chaos-kinds", "kill,boom"], "--chaos-kinds `kill,boom`"),
    (["--chaos", "1", "--chaos-interval", "5:2"], "--chaos-interval `5:2`"),
    (["--chaos-plan"], "--chaos-plan without --chaos SEED"),
    (["--chaos", "1", "--fault", "kill:0@1"], "--chaos with --fault"),
])
def test_bad_chaos_options_are_configuration_errors(args, message):
    p = subprocess.run([muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "1", *args,
                        EXAMPLE], capture_output=True, text=True, timeout=60, env=muster_env())
    assert p.returncode == 202, p.stderr
    assert message in p.stderr, p.stderr


def ts(record):
    return datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()


def test_a_chaos_run_recovers_every_strike_and_its_report_matches_the_ranks_output(tmp_path):
    cmd = [*base("--max-restarts", "20", "--replace-after", "2", "--log-format", "json"),
           EXAMPLE, "--ckpt-dir", str(tmp_path / "ckpt"), *SCRIPT]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=muster_env())
    code, out, err = finish(p, 420)
    text = out + err
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert code == 0, text[-20000:]

    # The schedule the run printed is the plan's.
    plan = subprocess.run([*base("--chaos-plan"), EXAMPLE], capture_output=True, text=True,
                          timeout=60, env=muster_env()).stdout
    printed = [r["msg"] for r in records
               if re.match(r"muster dry-run: chaos (schedule|#)", r.get("msg", ""))]
    assert printed == plan.splitlines(), (printed, plan)

    strikes = [r for r in records if r.get("fields", {}).get("kind") == "chaos_strike"]
    assert [s["fields"]["verdict"] for s in strikes] == ["recovered"] * 5, strikes
    assert {s["fields"]["fault"] for s in strikes} == KINDS
    verdict = next(r for r in records if r.get("fields", {}).get("kind") == "chaos_verdict")
    assert verdict["fields"]["exit_code"] == 0

    # The wall-clock start the report's seconds count from: the dry run's first line.
    start = ts(next(r for r in records if "rendezvous store on port" in r.get("msg", "")))
    ranks = [r for r in records if r.get("source") == "rank"]
    steps = [(ts(r), r["rank"], int(m.group(1))) for r in ranks
             if (m := re.match(r"step (\d+) loss", r["msg"]))]
    resumes = [(ts(r), int(m.group(1))) for r in ranks
               if (m := re.match(r"resumed from committed step (\d+)", r["msg"]))]
    world = {0, 1, 2}
    for s in strikes:
        f = s["fields"]
        # Seconds are written as strings of the number (as the timeline's t_seconds).
        hit = start + float(f["t_seconds"])
        resume = next(((t, c) for t, c in resumes if t > hit), None)
        if f["fault"] == "stop-rank":
            # The gang waited the frozen rank out: nothing lost, every rank steps after SIGCONT.
            assert f["steps_lost"] == 0, f
            after = hit + 8
        else:
            assert resume is not None, f
            resumed_t, committed = resume
            reached = max(n for t, _, n in steps if hit - 1 <= t < resumed_t)
            mine = reached - committed
            assert abs(f["steps_lost"] - mine) <= STEP_TOLERANCE, (f, reached, committed)
            # A save every 20 steps: no crash costs more.
            assert f["steps_lost"] <= 20 + STEP_TOLERANCE, (f, reached, committed)
            after = resumed_t
        # Time to recovery: every rank's first step line after the resume (or the release).
        firsts = {}
        for t, rank, _ in steps:
            if t >= after and rank not in firsts:
                firsts[rank] = t
        assert set(firsts) == world, (f, firsts)
        mine = max(firsts.values()) - hit
        assert abs(float(f["recovery_seconds"]) - mine) <= SECONDS_TOLERANCE, (f, mine)
    # A preemption commits at the agreed step and resumes right after it.
    term = next(s["fields"] for s in strikes if s["fields"]["fault"] == "term")
    assert term["steps_lost"] <= STEP_TOLERANCE, term
    assert "barrier: checkpoint committed" in term["reaction"], term
    finished = [r for r in ranks if r["msg"] == "finished 500 steps"]
    assert sorted(r["rank"] for r in finished)[-3:] == [0, 1, 2], text[-5000:]


def test_the_readmes_chaos_line_on_a_short_example_does_not_pass_and_says_why():
    """The README's line as written, on the repository's shortest example (20 steps, a few
    seconds of training): the job ends before the first strike is due (gaps of 20-40 s), so the
    rehearsal rehearsed nothing. It must not exit 0 with a passing verdict: 221, the count of
    strikes injected, when the job ended against when the first was due, and what would fit."""
    cmd = [muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "2", "--chaos", "42",
           str(REPO / "examples" / "train_ddp.py")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=muster_env())
    code, out, err = finish(p, 300)
    text = out + err
    assert "done: world size 6" in text, text[-20000:]
    assert code == 221, text[-20000:]
    verdict = re.search(r"verdict: (.*)", text).group(1)
    injected = re.search(r"only (\d) of 6 strikes were injected", verdict)
    assert injected and int(injected.group(1)) < 6, verdict
    assert re.search(r"the job ended [\d.]+ s into training", verdict), verdict
    assert ("was due at" in verdict or "still recovering" in verdict), verdict
    assert ": exit 221" in verdict, verdict
    assert "every strike" not in verdict and "recovered within" not in verdict, verdict
    assert re.search(r"advice: \d strike\(s\) never came: .*--chaos-interval", text), text[-5000:]
