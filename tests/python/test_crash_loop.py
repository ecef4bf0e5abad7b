"""The crash-loop guard (`--max-no-progress-restarts`): a rank that raises at step 3 on every
attempt stops the job with exit 209 after N restarts without progress, long before
`--max-restarts 10` is spent — on one node, and in a gang, where every node ends with 209 and
nodes failing in turn are one crash loop."""

import re
import subprocess

import pytest

from conftest import finish, muster_bin, muster_env

NO_PROGRESS = 209

# Reports steps through the checkpoint helper (on the workers' PYTHONPATH under muster) and
# raises at step 3, every attempt: a deterministic bug. Its peers wait at step 3 to be stopped.
SCRIPT = """\
import os, sys, time
import muster_checkpoint
ckpt = muster_checkpoint.Checkpointer()
rank = int(os.environ["RANK"])
failing = os.environ.get("FAILING_RANK", "0")
# "turns": rank 0 fails on even attempts, rank 1 on odd ones (nodes failing in turn).
failing = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) % 2 if failing == "turns" else int(failing)
for step in range(1000):
    ckpt.should_save(step)
    if step == 3 and rank == failing:
        sys.stderr.write("Traceback (most recent call last):\\nValueError: bad batch at step 3\\n")
        sys.stderr.flush()
        os._exit(1)
    if step == 3:
        # A peer of a failing rank waits in its next collective, as under DDP: it never runs
        # steps ahead of the failure however late the gang stops it (a loaded machine).
        time.sleep(600)
    time.sleep(0.05)
"""


def restarts(text):
    return len(re.findall(r"restarting the (?:worker group|gang)", text))


@pytest.mark.timeout(180)
def test_a_rank_failing_at_step_3_every_attempt_stops_with_209(tmp_path):
    script = tmp_path / "bug.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen(
        [muster_bin(), "--standalone", "--nproc-per-node", "1", "--max-restarts", "10",
         "--max-no-progress-restarts", "3", "--metrics-addr", "none",
         "--gpu-release-timeout", "0", "--shutdown-timeout", "3", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=muster_env())
    code, out, err = finish(p, 150)
    assert code == NO_PROGRESS, err
    assert ("crash loop: 3 restart(s) in a row made no progress, each attempt failing by step 3; "
            "the repeated failure: rank 0 failed (exit code 1)") in err, err
    assert "(--max-no-progress-restarts 3, exit 209)" in err, err
    # Attempt 0 is progress (step 3 from nothing); then three futile restarts. A step report that
    # the agent read only after judging can make one attempt look like progress, never fewer.
    assert 3 <= restarts(err) < 10, err
    assert "crash-loop guard: no progress (last step 3; the previous attempt reached 3)" in err, err
    # The worker's own failure is still summarised.
    assert "muster: worker group failed" in err, err


@pytest.mark.timeout(240)
def test_in_a_gang_nodes_failing_in_turn_are_one_crash_loop_ended_for_every_node_with_209(
        tmp_path):
    script = tmp_path / "bug.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen(
        [muster_bin(), "dry-run", "--nnodes", "2", "--nproc-per-node", "1",
         "--max-restarts", "10", "--max-no-progress-restarts", "2", "--shutdown-timeout", "3",
         "--rdzv-conf", "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3",
         str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=muster_env({"FAILING_RANK": "turns"}))
    code, out, err = finish(p, 200)
    text = out + err
    assert code == NO_PROGRESS, text
    # Attempt 0 (rank 0 fails) is progress from nothing; attempt 1 (rank 1, on node 1) counts on
    # every node, so attempt 2's failure (rank 0 again) reaches 2: node 0 ends the job. On a
    # loaded machine the failing rank can reach step 3 while its peer is still at step 2 (no
    # collective holds them together here), or the peer's last report is read after the stop:
    # node 0 then saw attempt 1 end at step 2 and takes attempt 2's step 3 for progress, so
    # attempt 3's failure (rank 1) reaches 2 and node 1 ends it. Either way one node ends the job
    # for both, naming its own rank.
    assert "crash loop: 2 restart(s) in a row made no progress" in text, text
    ended = re.search(r"the repeated failure: rank (\d) failed \(exit code 1\)", text)
    assert ended, text
    node = int(ended.group(1))  # one rank per node: rank r runs on node r
    # At most the one extra restart a lagging step report costs.
    used = [int(n) for n in re.findall(r"restarting the gang \(restart (\d+) of", text)]
    assert used and max(used) <= 3, text
    assert "agent 0 exited 209, agent 1 exited 209; job exit code 209" in text, text
    # The other node ends because that node said so, naming it.
    assert (f"[node {1 - node}]  WARN the job failed on another node: node {node}: crash loop:"
            in text), text
    assert f"[node {node}]  WARN crash-loop guard: no progress" in text, text
