"""What an agent says when a preemption cannot be checkpointed, and what a killed agent leaves
behind: plain-Python ranks (the checkpoint helper needs no torch) under one `muster` agent.

- A SIGTERM while every rank is still starting (before it connected to the helper) says the ranks
  had not connected yet, with the node in words, not that the script does not use the helper.
- A SIGTERM during a long evaluation, with a grace period too short to reach the agreed step,
  ends 201 and says what each rank was doing: its last step, how long before, its section.
- An agent killed with SIGKILL cannot remove its private directory; the next agent to start
  there removes it, and leaves a live agent's alone."""

import os
import re
import signal
import subprocess
import threading
import time

from conftest import muster_bin, muster_env, wait_until

# Starts like a real script (imports, init_process_group) for longer than the test waits, and only
# then connects to the helper.
STARTING = """
import sys, time
print("STARTING", flush=True)
time.sleep(60)
import muster_checkpoint
muster_checkpoint.Checkpointer()
"""

# Twenty quick steps, then an evaluation far longer than the grace period.
EVALUATING = """
import time, muster_checkpoint
ckpt = muster_checkpoint.Checkpointer()
assert ckpt.active
for step in range(20):
    time.sleep(0.05)
    if ckpt.should_save(step):
        ckpt.saved(step)
        raise SystemExit(0)
with ckpt.section("evaluate"):
    print("EVALUATING", flush=True)
    time.sleep(60)
"""

SLEEPER = """
import sys, time
print("RUNNING", flush=True)
time.sleep(float(sys.argv[1]))
"""


class Agent:
    """One `muster` agent (its own process group) whose output is collected as it comes."""

    count = 0

    def __init__(self, tmp_path, script, *args, flags=(), env=None):
        Agent.count += 1
        path = tmp_path / f"script_{Agent.count}.py"
        path.write_text(script)
        cmd = [muster_bin(), "--nproc-per-node", "2", *flags, str(path), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=muster_env(env), start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                       daemon=True)
        self.reader.start()

    def text(self):
        return "".join(self.lines)

    def wait_for(self, marker, count=1, timeout=60):
        wait_until(lambda: self.text().count(marker) >= count or self.proc.poll() is not None,
                   timeout=timeout, what=marker)
        assert self.text().count(marker) >= count, self.text()

    def finish(self, timeout=60):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError("the agent did not exit:\n" + self.text())
        self.reader.join(timeout=10)
        return self.proc.returncode, self.text()


def test_a_preemption_while_the_ranks_start_says_they_had_not_connected_yet(tmp_path):
    agent = Agent(tmp_path, STARTING, flags=("--grace-period", "6"))
    agent.wait_for("STARTING", count=2)
    agent.proc.send_signal(signal.SIGTERM)
    code, text = agent.finish()
    assert "no checkpoint barrier" in text, text
    assert ("the ranks of node 0 had not connected to the checkpoint helper yet (still "
            "starting") in text, text
    assert "do not use the checkpoint helper" not in text, text
    assert "[0]" not in text and "node(s)" not in text, text
    assert code != 0, text


def test_a_deadline_during_an_evaluation_says_what_the_ranks_were_doing(tmp_path):
    # A 3 s grace: a 2 s budget for the barrier, and the ranks evaluate for a minute.
    agent = Agent(tmp_path, EVALUATING, flags=("--grace-period", "3"))
    agent.wait_for("EVALUATING", count=2)
    time.sleep(0.5)
    agent.proc.send_signal(signal.SIGTERM)
    code, text = agent.finish()
    assert code == 201, text
    line = next((l for l in text.splitlines() if "checkpoint aborted" in l), "")
    assert "deadline passed on node 0 before every rank saved" in line, text
    for local_rank in (0, 1):
        assert re.search(rf"local rank {local_rank} was at step 19 \(last step [\d.]+ s before, "
                         r"inside section `evaluate` for [\d.]+ s\)", line), line
    assert re.search(r"none of them reached step \d+, the agreed step, in time", line), line


def private_dirs(base):
    """The agents' private directories (not the user's shared copy of muster's Python, which
    outlives every agent on purpose: python_files/shared.rs)."""
    return sorted(p.name for p in base.iterdir()
                  if p.name.startswith("muster-") and not p.name.startswith("muster-python-"))


def test_the_next_agent_removes_a_killed_agents_private_directory_and_no_live_ones(tmp_path):
    base = tmp_path / "tmp"
    base.mkdir()
    env = {"TMPDIR": str(base)}
    killed = Agent(tmp_path, SLEEPER, "60", env=env)
    killed.wait_for("RUNNING", count=2)
    # Its private directory (the scripts' metrics hook lives in it too).
    left = private_dirs(base)
    pid = killed.proc.pid
    assert [re.sub(r"\d+\.\d+\.\d+-[0-9a-f]{8}$", "X", d) for d in left] == [
        "muster-X"], left
    assert all(f"-{pid}." in d for d in left), left
    os.killpg(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait()
    assert private_dirs(base) == left, "a SIGKILLed agent cannot remove its directories"

    live = Agent(tmp_path, SLEEPER, "60", env=env)
    live.wait_for("RUNNING", count=2)
    # The live agent swept the dead one's at its start, and has its own.
    wait_until(lambda: not set(left) & set(private_dirs(base)), timeout=10, what="the sweep")
    mine = private_dirs(base)
    assert len(mine) == 1 and all(f"-{live.proc.pid}." in d for d in mine), mine

    # Another agent starting beside the live one leaves the live one's directory alone.
    code, text = Agent(tmp_path, SLEEPER, "1", env=env).finish()
    assert code == 0, text
    assert private_dirs(base) == mine, text
    live.proc.send_signal(signal.SIGTERM)
    live.finish()
    assert private_dirs(base) == [], "an agent that exits removes its own"
    # The shared copy of muster's Python is never swept: one, made by the first agent.
    assert len([p for p in base.iterdir() if p.name.startswith("muster-python-")]) == 1
