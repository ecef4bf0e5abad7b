"""The gang's root cause: every node's summary names the gang's first failure, not its own
symptom. 2 nodes x 2 ranks in the dry run (real torch, gloo): rank 3 (node 1) raises a ValueError at
step 5 while the other ranks wait for it in an all-reduce and then fail with "Connection closed by
peer". Node 0 — the PyTorchJob's Master, the pod people read first — must name rank 3's ValueError,
with its own ranks' connection errors after it as what followed.

Which way node 0 learns of the failure is a race: its ranks notice the broken connection, or the
gang's stop reaches it first. The plain runs land on either side; `--slow-peer` makes node 1 slow to
stop, so node 0's ranks certainly fail first and post their symptom while node 1 is still stopping.
"""

import json
import re
import subprocess

import pytest

from conftest import REPO, finish, muster_bin, muster_env
from test_json_log_schema import check_record

SCRIPT = str(REPO / "tests" / "python" / "scripts" / "bad_shard.py")
CAUSE = "ValueError: the real cause: bad shard 17 on rank 3"
SYMPTOM = "Connection closed by peer"


def dry_run(*script_args, extra=()):
    cmd = [muster_bin(), "dry-run", "--nnodes", "2", "--nproc-per-node", "2", *extra,
           SCRIPT, "3", "5", *script_args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=muster_env())
    code, out, err = finish(p, 240)
    return code, out + err


def summaries(output):
    """Each node's summary lines (text format), without the `muster:` prefix."""
    found = {0: [], 1: []}
    for node, text in re.findall(r"^\[node (\d)\] muster: (.*)$", output, re.M):
        found[int(node)].append(text)
    return found


def check_every_node_names_rank_3(output):
    found = summaries(output)
    node0, node1 = found[0], found[1]
    assert node1 and node0, output
    # Node 1's own rank is the gang's root cause: its summary is the usual one.
    assert node1[0].startswith("worker group failed after 1 attempt(s); root cause"), output
    assert "rank: 3 (local_rank 1)" in node1[1], output
    assert f"  error: {CAUSE}" in node1, output
    # Node 0 names rank 3's error first, then what its own ranks did.
    assert node0[0] == ("worker group failed after 1 attempt(s); root cause (first failure in "
                        "the gang, on node 1):"), output
    assert "node: 1 (" in node0[1] and "rank: 3 (local_rank 1)" in node0[1], output
    assert node0[2] == "  exit code 1", output
    assert node0[3] == f"  error: {CAUSE}", output
    followed = [l for l in node0 if l.startswith("  what followed: ")]
    assert len(followed) == 1, output
    assert not any(SYMPTOM in l for l in node0[:4]), output
    # Every node logged the same root cause line for the attempt.
    for node in (0, 1):
        assert re.search(rf"^\[node {node}\]\s+WARN attempt 0: first failure in the gang: node 1 "
                         rf"\(\S+\) rank 3 \(local rank 1\): exit code 1: {CAUSE}", output, re.M), \
            output
    return followed[0]


@pytest.mark.parametrize("run", range(3))
def test_every_node_names_the_gangs_first_failure(run):
    code, out = dry_run()
    assert code == 1, out
    followed = check_every_node_names_rank_3(out)
    # Either side of the race: node 0's ranks failed of the lost peer, or the gang stopped them.
    assert (re.match(rf"  what followed: rank [01] \(local rank [01]\) on this node failed .* "
                     rf"\(exit code 1\): .*{SYMPTOM}", followed)
            or followed == "  what followed: this node's workers were stopped when the gang ended"), \
        followed


def test_node_0s_own_symptoms_come_after_the_cause():
    code, out = dry_run("--slow-peer", "3")
    assert code == 1, out
    followed = check_every_node_names_rank_3(out)
    assert re.match(rf"  what followed: rank [01] \(local rank [01]\) on this node failed "
                    rf"(\d+ ms|\d+\.\d s) later \(exit code 1\): RuntimeError: .*{SYMPTOM}", followed), followed


def test_the_json_root_cause_record_names_the_gangs_first_failure():
    code, out = dry_run("--slow-peer", "3", extra=["--log-format", "json"])
    assert code == 1, out
    # The dry run tags every record with its node; the agents' records follow the one schema.
    records = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    causes = {r["node"]: check_record(json.dumps(r)) for r in records
              if r.get("event") == "root_cause"}
    assert set(causes) == {0, 1}, out
    for node, r in causes.items():
        assert (r["rank"], r["local_rank"], r["exit_code"], r["signal"]) == (3, 1, 1, None), r
        # Without an error file the local record keeps the exception line apart.
        assert (r["error"] or r["exception_line"]).startswith(CAUSE), r
        assert r["agent_exit_code"] == 1, r
        assert CAUSE in r["msg"], r
    node0 = causes[0]
    assert node0["node_rank"] == 1, node0
    followed = node0["followed_on_this_node"]
    assert followed["rank"] in (0, 1) and SYMPTOM in followed["error"], node0
    assert isinstance(followed["after_ms"], int), node0
