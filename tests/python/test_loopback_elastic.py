"""The loopback elastic form, as torchrun has it: several agents on one machine with
`--rdzv-endpoint localhost:PORT` (or 127.0.0.1) and no node ranks. The agent that binds the port
first hosts the rendezvous store (only on loopback: nothing off the machine can reach it), the
others join it, and the gang forms with node ranks by arrival."""

import subprocess

import pytest

from conftest import finish, free_port, muster_bin, muster_env

SCRIPT = """\
import os
print("RANK=%s GROUP_RANK=%s WORLD_SIZE=%s" % (os.environ["RANK"], os.environ["GROUP_RANK"],
      os.environ["WORLD_SIZE"]), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_the_first_agent_to_bind_hosts_and_the_other_joins(tmp_path, host):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = [subprocess.Popen(
        [muster_bin(), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", "loopback", "--metrics-addr", "none",
         "--rdzv-conf", "join_timeout=60", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=muster_env())
        for _ in range(2)]
    results = [finish(p, 100) for p in procs]
    for code, out, err in results:
        assert code == 0, out + err
    text = [out + err for _, out, err in results]
    # One hosts, the other found the port taken and joined.
    hosted = [t for t in text if "round 0: node 0 is group rank 0 of 2" in t]
    joined = [t for t in text if "round 0: node 1 is group rank 1 of 2" in t]
    assert len(hosted) == 1 and len(joined) == 1, text
    assert "joining it instead" in joined[0], joined[0]
    # The store listens on loopback only.
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in joined[0], joined[0]
    ranks = sorted(line for t in text for line in t.splitlines() if "RANK=" in line)
    assert [r.split("] ", 1)[1] for r in ranks] == ["RANK=0 GROUP_RANK=0 WORLD_SIZE=2",
                                                     "RANK=1 GROUP_RANK=1 WORLD_SIZE=2"], ranks
