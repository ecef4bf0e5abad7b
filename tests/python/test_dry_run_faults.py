"""Fault rehearsal in `muster dry-run` (`--fault`, `--replace-after`): real PyTorch (gloo),
examples/train_checkpoint.py, 3 agents x 2 ranks on loopback. A preemption ends with the preempted
code and a committed checkpoint, a killed rank restarts the gang, a killed node 0 is replaced;
each run prints a timeline, which these tests read (so a change of the agents' messages that the
timeline reads shows up here)."""

import json
import re
import subprocess

import pytest

from conftest import REPO, finish, muster_bin, muster_env, torch_python

EXAMPLE = str(REPO / "examples" / "train_checkpoint.py")
PREEMPTED_OK = 200
# Steps of 50 ms; a fault's seconds count from the first worker output (training under way), so
# one 2 s later lands mid-training however long the loaded machine took to import torch.
STEP = ["--step-seconds", "0.05", "--log-every", "1000"]
# Quick liveness so a lost node is noticed in seconds, and a join window a replacement fits in.
CONF = "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3"


def dry_run(tmp_path, faults, script_args, extra=(), timeout=240):
    cmd = [muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "2",
           "--rdzv-conf", CONF, *faults, *extra,
           EXAMPLE, "--ckpt-dir", str(tmp_path / "ckpt"), *STEP, *script_args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=muster_env())
    code, out, err = finish(p, timeout)
    return code, out + err


def timeline(output):
    """The timeline's entries of a text-format dry run: [(seconds, text)]."""
    # A text line ends with the record's fields: ` t_seconds=12.3 kind="fault"`.
    found = re.findall(r"muster dry-run:\s+(-?\d+\.\d) s  (.*?)(?: t_seconds=\S+ kind=\"\w+\")?$",
                       output, re.M)
    assert found, output
    return [(float(t), text) for t, text in found]


def first(entries, pattern):
    for t, text in entries:
        if re.search(pattern, text):
            return t, text
    raise AssertionError(f"no timeline entry matches {pattern!r}:\n" +
                         "\n".join(f"{t:7.1f} {x}" for t, x in entries))


def test_a_term_fault_ends_preempted_with_a_committed_checkpoint(tmp_path):
    code, out = dry_run(tmp_path, ["--fault", "term:1@2"], ["--steps", "100000"])
    assert code == PREEMPTED_OK, out
    latest = int((tmp_path / "ckpt" / "LATEST").read_text())
    assert len(list((tmp_path / "ckpt" / f"step_{latest}").glob("rank_*.pt"))) == 6
    entries = timeline(out)
    running, _ = first(entries, r"^gang running: all 6 workers joined, restart 0$")
    clock, _ = first(entries, r"^first worker output: training under way \(faults count from here\)")
    hit, _ = first(entries, r"^fault term:1@2: SIGTERM to node 1's agent \(pid \d+\)")
    assert running <= clock and hit >= clock + 2 - 0.11, entries
    committed, _ = first(entries, rf"^checkpoint committed at step {latest}$")
    stopped, _ = first(entries, r"^gang stopped: none of its 6 workers is running")
    ended, _ = first(entries, rf"^job exit code {PREEMPTED_OK}$")
    assert hit <= committed <= stopped <= ended, entries
    assert sum(1 for _, x in entries if re.match(r"node \d's agent exited with 200$", x)) == 3


def test_a_killed_rank_restarts_the_gang_and_the_job_finishes(tmp_path):
    # JSON logs: the timeline's records carry their kind and time as fields.
    code, out = dry_run(tmp_path, ["--fault", "kill-rank:3@2"], ["--steps", "80"],
                        extra=["--max-restarts", "1", "--log-format", "json"])
    assert code == 0, out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    entries = [(float(r["fields"]["t_seconds"]), r["fields"]["kind"], r["msg"]) for r in records
               if "kind" in r.get("fields", {})]
    kinds = [k for _, k, _ in entries]
    for kind in ["formed", "running", "clock", "fault", "stopped", "formed", "resumed",
                 "job_ended"]:
        assert kind in kinds, entries
        kinds = kinds[kinds.index(kind) + 1:]
    msgs = [m for _, _, m in entries]
    assert any(re.search(r"fault kill-rank:3@2: SIGKILL to rank 3 \(pid \d+, node 1\)", m)
               for m in msgs), msgs
    assert any("gang re-formed: generation 1 (restarts used 1)" in m for m in msgs), msgs
    assert any(re.search(r"gang resumed: all 6 workers joined again, restart 1, \d+\.\d s "
                         r"without a gang; no checkpoint committed in this run", m)
               for m in msgs), msgs
    times = [t for t, _, _ in entries]
    assert times == sorted(times), entries
    # The second generation trained to the end on every rank.
    finished = [r for r in records if r.get("source") == "rank" and r["msg"] == "finished 80 steps"]
    assert sorted(r["rank"] for r in finished)[-6:] == [0, 1, 2, 3, 4, 5], out


def test_a_killed_node_0_is_replaced_and_the_job_finishes(tmp_path):
    code, out = dry_run(tmp_path, ["--fault", "kill:0@2", "--replace-after", "1"],
                        ["--steps", "80"], extra=["--max-restarts", "1"], timeout=180)
    entries = timeline(out)
    hit, _ = first(entries, r"^fault kill:0@2: SIGKILL to node 0's agent \(pid \d+\)")
    replaced, _ = first(entries, r"^node 0's replacement agent started \(pid \d+, the same flags\)")
    assert replaced >= hit + 1, entries
    first(entries, r"^gang stopped: none of its 6 workers is running")
    assert code == 0, out
    resumed, _ = first(entries, r"^gang resumed: all 6 workers joined again")
    assert resumed > replaced, entries
    first(entries, r"^job exit code 0$")


def test_the_fault_clock_starts_for_a_python_that_prints_once_without_u(tmp_path):
    # A worker Python that muster does not start itself (here --no-python; in life a wrapper
    # script or the script's own subprocess) has no `-u`: its rare lines would sit in the pipe's
    # buffer, the clock would wait its 60 s fallback. PYTHONUNBUFFERED covers it.
    env = muster_env()
    env.pop("PYTHONUNBUFFERED", None)
    quiet = ("import time, torch.distributed as dist; dist.init_process_group('gloo')\n"
             "for i in range(40): print('tick', i); time.sleep(3)")
    cmd = [muster_bin(), "dry-run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-conf", CONF, "--fault", "term:1@1", "--shutdown-timeout", "5",
           "--no-python", torch_python(), "-c", quiet]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _, out, err = finish(p, 200)
    entries = timeline(out + err)
    clock, _ = first(entries, r"^first worker output: training under way")
    hit, _ = first(entries, r"^fault term:1@1: SIGTERM to node 1's agent")
    assert hit >= clock + 1 - 0.11, entries


def test_a_fault_after_the_end_is_reported_not_injected(tmp_path):
    code, out = dry_run(tmp_path, ["--fault", "term:0@600"], ["--steps", "20"])
    assert code == 0, out
    entries = timeline(out)
    first(entries, r"^fault term:0@600 not injected: the job ended first$")
    first(entries, r"^job exit code 0$")


@pytest.mark.parametrize("args, message", [
    (["--fault", "kill:3@1"], "--fault `kill:3@1`: there is no node 3 in a dry run of 3 node(s)"),
    (["--fault", "kill-rank:6@1"], "there is no rank 6 in a job of at most 6 worker(s)"),
    (["--fault", "stop:0@1"], "unknown kind `stop` (expected kill, term, kill-rank or stop-rank)"),
    (["--fault", "kill:0"], "expected KIND:TARGET@SECS"),
    (["--fault", "term:0@1", "--replace-after", "3"], "--replace-after without a kill:NODE@SECS"),
    (["--replace-after", "-1"], "--replace-after `-1`: expected a number of seconds"),
])
def test_bad_fault_options_are_configuration_errors(args, message):
    p = subprocess.run([muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "2", *args,
                        EXAMPLE], capture_output=True, text=True, timeout=60, env=muster_env())
    assert p.returncode == 202, p.stderr
    assert message in p.stderr, p.stderr


def test_dry_run_help_lists_the_fault_options():
    p = subprocess.run([muster_bin(), "dry-run", "--help"], capture_output=True, text=True,
                       timeout=60, env=muster_env())
    assert p.returncode == 0, p.stderr
    assert "--fault KIND:TARGET@SECS" in p.stdout and "--replace-after SECS" in p.stdout
