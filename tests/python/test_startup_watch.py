"""The hang watch before the first step (--startup-timeout): a rank stopped (SIGSTOP) before or
inside `torch.distributed.init_process_group` is found within the limit, its stack dumped, the
stopped rank named, and the gang restarted; a script that never calls init_process_group and
never steps is not watched at all.

The zero-code reporter (python/muster_launcher/autoreport.py) wraps init_process_group and says `init`
and `initdone`; the agent's rule is agent/src/watch/startup.rs.
"""

import re

import pytest

from conftest import muster_bin, muster_env
from test_watch import Agent

STARTUP_TIMEOUT = 5

WORKER = r'''
import os, signal, sys, time
import torch
import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler, rendezvous

rank = int(os.environ["RANK"])
marker = os.environ["MARKER"]
first = not os.path.exists(marker + ".done")
where = os.environ["STOP_WHERE"]
how = os.environ.get("STOP_HOW", "stop")


def stop_here():
    open(marker + ".done", "w").close()
    print("STOPPING rank=%d where=%s how=%s" % (rank, where, how), flush=True)
    if how == "sleep":  # slow, not stopped
        time.sleep(3600)
    elif how == "compute":
        while True:
            sum(i * i for i in range(1000))
    os.kill(os.getpid(), signal.SIGSTOP)  # STOP LINE


def stopping_rendezvous(url, **kwargs):
    # Inside init_process_group: stop, then form the group as env:// does.
    if rank == 1 and first:
        stop_here()
    yield from rendezvous("env://", **kwargs)


register_rendezvous_handler("stopme", stopping_rendezvous)
if where == "before" and rank == 1 and first:
    stop_here()
dist.init_process_group(backend="gloo", init_method="stopme://" if where == "inside" else "env://")
t = torch.ones(1)
dist.all_reduce(t)
print("DONE rank=%d sum=%d" % (rank, int(t.item())), flush=True)
sys.stdout.flush()
os._exit(0)
'''

NEVER_INIT = r'''
import os, sys, time
import torch
time.sleep(float(os.environ["SLEEP_S"]))
print("DONE rank=%s" % os.environ["RANK"], flush=True)
sys.stdout.flush()
os._exit(0)
'''


def launch(tmp_path, source, env, extra_args=()):
    script = tmp_path / "startup_worker.py"
    script.write_text(source)
    args = [muster_bin(), "--standalone", "--nproc-per-node", "2",
            "--startup-timeout", str(STARTUP_TIMEOUT), "--metrics-addr", "none",
            "--gpu-release-timeout", "0", "--shutdown-timeout", "5", *extra_args, str(script)]
    return Agent(args, muster_env(env))


def rank_block(out, rank):
    """The dump lines of one rank: its header up to the next header or log line."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if re.search(rf"stacks of rank {rank} \(local rank {rank}, pid \d+\), read with", line):
            block = [line]
            for rest in lines[i + 1:]:
                if "stacks of rank" in rest or "hung:" in rest:
                    break
                block.append(rest)
            return "\n".join(block)
    return None


@pytest.mark.parametrize("where", ["before", "inside"])
def test_a_rank_stopped_around_init_process_group_is_named_with_its_stack(tmp_path, where):
    run = launch(tmp_path, WORKER, {"MARKER": str(tmp_path / "marker"), "STOP_WHERE": where},
                 ["--max-restarts", "1"])
    try:
        code = run.finish(timeout=180)
    finally:
        run.kill()
    out = run.text()
    assert code == 0, out
    stopped, detected = run.first(r"STOPPING rank=1"), run.first(r"hang detected")
    assert stopped is not None and detected is not None, out
    # The limit plus slack for a loaded machine: far below torch's 30-minute store timeout.
    assert detected - stopped < STARTUP_TIMEOUT + 30, out
    assert re.search(r"hang detected on node 0: rank \d \(local rank \d\) has not formed its "
                     r"process group \(init_process_group\)", out), out
    # Rank 1 is named (it is stopped), not rank 0 that waits for it.
    assert re.search(r"hung: rank 1 \(local rank 1\) on node 0 .* in section "
                     r"\"init_process_group\"", out), out
    block = rank_block(out, 1)
    assert block is not None, out
    assert "startup_worker.py" in block, block
    if where == "inside":
        assert "init_process_group" in block, block
    # The gang restarted and formed.
    assert sorted(re.findall(r"DONE rank=(\d) sum=2", out)) == ["0", "1"], out


def test_a_script_that_never_forms_a_group_is_not_watched_before_its_first_step(tmp_path):
    run = launch(tmp_path, NEVER_INIT, {"SLEEP_S": str(STARTUP_TIMEOUT + 3)},
                 ["--max-restarts", "0"])
    try:
        code = run.finish(timeout=120)
    finally:
        run.kill()
    out = run.text()
    assert code == 0, out
    assert "hang detected" not in out, out
    assert sorted(re.findall(r"DONE rank=(\d)", out)) == ["0", "1"], out



@pytest.mark.parametrize("how", ["stop", "sleep", "compute"])
def test_across_nodes_the_node_hosting_the_rank_not_in_init_names_it(tmp_path, cpu_hogs, how):
    # 2 nodes x 1 rank: rank 1 (node 1) stops, sleeps or computes before init_process_group;
    # only node 0 sees a rank waiting in it. Node 0 tells node 1, which finds its rank outside
    # torch.distributed and names it; the first error line of either node names rank 1.
    from conftest import free_port
    from test_watch import CONF

    script = tmp_path / "startup_worker.py"
    script.write_text(WORKER)
    port = free_port()
    agents = []
    try:
        for node in range(2):
            args = [muster_bin(), "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-id", "startup", "--local-addr", "127.0.0.1", "--rdzv-conf", CONF,
                    "--node-rank", str(node), "--max-restarts", "1",
                    "--startup-timeout", str(STARTUP_TIMEOUT), "--metrics-addr", "none",
                    "--gpu-release-timeout", "0", "--shutdown-timeout", "5", str(script)]
            env = muster_env({"MARKER": str(tmp_path / "marker"), "STOP_WHERE": "before",
                              "STOP_HOW": how})
            agents.append(Agent(args, env))
        codes = [a.finish(timeout=180) for a in agents]
    finally:
        for a in agents:
            a.kill()
    out0, out1 = agents[0].text(), agents[1].text()
    both = out0 + "\n----- node 1 -----\n" + out1
    assert codes == [0, 0], both
    assert re.search(r"hang detected on node 0: rank 0 \(local rank 0\) has not formed", out0), both
    assert re.search(r"hung: rank 1 \(local rank 0\) on node 1 .* in section "
                     r"\"init_process_group\"", out1), both
    assert "startup_worker.py" in (rank_block_any(out1, 1) or ""), both
    assert "DONE rank=0 sum=2" in out0 and "DONE rank=1 sum=2" in out1, both
    assert "the cause is elsewhere" not in out1, both
    errors = [line for line in (out0 + out1).splitlines() if re.search(r"\bERROR\b", line)]
    assert errors and all("rank 0 (local rank 0) on node 0" not in e for e in errors), both


def rank_block_any(out, rank):
    """The dump of global rank `rank`, whatever its local rank."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if re.search(rf"stacks of rank {rank} \(local rank \d+, pid \d+\), read with", line):
            return "\n".join(lines[i:i + 12])
    return None
