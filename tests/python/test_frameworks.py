"""Zero-code preemption for framework scripts: an unmodified Hugging Face Trainer or Lightning
script, 2 agents x 2 ranks on gloo, SIGTERM to one agent -> every rank saves the framework's own
checkpoint at one step T, every agent exits 200, and the framework's own resume continues from T.
Tiny models built from a config, random data, nothing downloaded."""

import os
import random
import re
import signal
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

from conftest import REPO, free_port, torch_python
from test_multinode_gang import Agents

SCRIPTS = REPO / "tests" / "python" / "scripts"
CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=5"
PREEMPTED_OK = 200
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "WANDB_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false"}
# Long enough that the SIGTERM lands mid-run on a loaded machine, short enough to keep it quick.
MAX_STEPS = 200


def launch(tmp_path, script, args, node1_env=None):
    """Two agents of two ranks each. Node 0 serves metrics (muster's sitecustomize beside the
    script-metrics files), node 1 does not (only the copy beside the checkpoint helper): the
    callbacks must come from either."""
    wrapper = tmp_path / "entry.py"
    target = str(SCRIPTS / script)
    wrapper.write_text(
        "import runpy, sys\n"
        f"sys.argv = [{target!r}] + {list(args)!r}\n"
        f"runpy.run_path({target!r}, run_name='__main__')\n")
    agents = Agents(free_port(), "2", str(wrapper), run_id=f"fw{random.randrange(10**6)}")
    metrics = (("--metrics-addr", f"127.0.0.1:{free_port()}"), ("--metrics-addr", "none"))
    for node in range(2):
        env = dict(OFFLINE, **(node1_env or {})) if node == 1 else dict(OFFLINE)
        agents.start(node_rank=node, conf=CONF, env=env,
                     extra=("--grace-period", "90", *metrics[node]))
    return agents


def lines(results, word):
    """{rank: [values]} of `WORD <rank> <value>` lines over every agent's output."""
    found = {}
    for _, out in results:
        for rank, value in re.findall(rf"^.*{word} (\d+) (\d+)$", out, re.M):
            found.setdefault(int(rank), []).append(int(value))
    return found


def wait_for_training(agents, at_least=2, timeout=300):
    """Until every rank printed a step >= `at_least` (all four are in the training loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = lines([(None, agents.text(i)) for i in range(2)], "STEP")
        if len(steps) == 4 and min(max(v) for v in steps.values()) >= at_least:
            return
        if any(p.poll() is not None for p in agents.procs):
            break
        time.sleep(0.2)
    raise AssertionError("training did not get under way:\n" + agents.text(0) + agents.text(1))


def preempt_then_resume(tmp_path, script, find_checkpoint):
    """Run 1: SIGTERM to node 1 mid-run. Run 2: resumed from the checkpoint, node 1 with the
    automatic callbacks turned off (the explicit one on rank 3 stays). Returns (T, run 1's
    results, the checkpoint)."""
    out = tmp_path / "out"
    run1 = tmp_path / "run1"
    run1.mkdir()
    common = ["--out", str(out), "--max-steps", str(MAX_STEPS), "--explicit"]
    agents = launch(run1, script, [*common, "--step-seconds", "0.3"])
    try:
        wait_for_training(agents)
        agents.procs[1].send_signal(signal.SIGTERM)
        results = agents.finish(timeout=180)
    finally:
        agents.kill_all()
    text = "\n".join(out for _, out in results)
    assert [code for code, _ in results] == [PREEMPTED_OK] * 2, text
    # Automatic on ranks 0 and 2, explicit on 1 and 3, never twice.
    assert lines(results, "MUSTER_CALLBACKS") == {r: [1] for r in range(4)}, text
    step = int(re.search(r"checkpoint at step (\d+) committed on every rank", text).group(1))
    steps = lines(results, "STEP")
    assert {r: max(v) for r, v in steps.items()} == {r: step for r in range(4)}, text
    assert step < MAX_STEPS
    # The process left before the script's post-training code.
    assert not lines(results, "FINAL"), text
    checkpoint = find_checkpoint(out, step)

    run2 = tmp_path / "run2"
    run2.mkdir()
    agents = launch(run2, script, [*common, "--resume"],
                    node1_env={"MUSTER_FRAMEWORK_CALLBACKS": "0"})
    try:
        resumed = agents.finish(timeout=300)
    finally:
        agents.kill_all()
    text = "\n".join(out for _, out in resumed)
    assert [code for code, _ in resumed] == [0, 0], text
    assert lines(resumed, "MUSTER_CALLBACKS") == {0: [1], 1: [1], 2: [0], 3: [1]}, text
    assert {r: min(v) for r, v in lines(resumed, "STEP").items()} == {
        r: step + 1 for r in range(4)}, text
    assert lines(resumed, "FINAL") == {r: [MAX_STEPS] for r in range(4)}, text
    return step, results, checkpoint


def test_hf_trainer_saves_checkpoint_T_on_every_rank_and_resumes(tmp_path):
    pytest.importorskip("transformers")

    def find(out, step):
        dirs = sorted(p.name for p in out.glob("checkpoint-*"))
        assert dirs == [f"checkpoint-{step}"], dirs
        ckpt = out / f"checkpoint-{step}"
        assert sorted(p.name for p in ckpt.glob("rng_state_*.pth")) == [
            f"rng_state_{r}.pth" for r in range(4)]
        assert (ckpt / "optimizer.pt").is_file() and (ckpt / "trainer_state.json").is_file()
        assert f'"global_step": {step},' in (ckpt / "trainer_state.json").read_text()
        return ckpt

    preempt_then_resume(tmp_path, "hf_trainer.py", find)


def test_lightning_trainer_saves_its_ckpt_at_T_and_resumes(tmp_path):
    pytest.importorskip("lightning")

    def find(out, step):
        files = sorted(p.name for p in out.glob("*.ckpt"))
        assert files == [f"muster-preempt-step={step}.ckpt"], files
        path = out / files[0]
        assert torch.load(path, weights_only=False)["global_step"] == step
        return path

    preempt_then_resume(tmp_path, "lightning_trainer.py", find)


class FakeAgent:
    """The agent's end of the helper's socket, scripted: once the rank that said hello reports
    step 2, asks for a save 3 steps ahead (again, further ahead, when the rank says it missed
    it, as the real agents retry); records every line but the step reports."""

    def __init__(self):
        self.name = f"muster-test-{random.randrange(10**9)}"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind("\0" + self.name)
        self.server.listen(8)
        self.lines = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            conn, _ = self.server.accept()
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn):
        buf, asked, hello = b"", False, False
        while True:
            data = conn.recv(4096)
            if not data:
                return
            buf += data
            *done, buf = buf.split(b"\n")
            for line in done:
                words = line.decode().split()
                hello = hello or words[0] == "hello"
                if words[0] != "step":
                    self.lines.append(words)
                if not hello:
                    continue  # another of muster's reporters: not the barrier's client
                if words[0] == "step" and int(words[1]) >= 2 and not asked:
                    asked = True
                    self._ask(conn, 0, int(words[1]) + 3)
                elif words[0] == "missed":
                    self._ask(conn, int(words[1]) + 1, int(words[2]) + 3)

    @staticmethod
    def _ask(conn, generation, step):
        conn.sendall(b"save %d %d %d\n" % (generation, step, time.time() + 120))


# A save that raises, injected below the framework's own checkpoint code.
BREAK_SAVE = {
    "hf_trainer.py": "import transformers.trainer as t\n"
                     "def broken(self, output_dir): raise OSError(28, 'No space left on device')\n"
                     "t.Trainer._save_rng_state = broken\n",
    "lightning_trainer.py": "from lightning.fabric.plugins.io import torch_io\n"
                            "def broken(*a, **k): raise OSError(28, 'No space left on device')\n"
                            "torch_io.TorchCheckpointIO.save_checkpoint = broken\n",
}


@pytest.mark.parametrize("script", ["hf_trainer.py", "lightning_trainer.py"])
def test_a_save_that_raises_is_reported_to_the_agent(tmp_path, script):
    """One rank, a scripted agent: the framework's save at the agreed step raises, and the
    callback tells the agent why (`failed`), which aborts the gang's checkpoint (201)."""
    pytest.importorskip("transformers" if script.startswith("hf") else "lightning")

    python_dir = tmp_path / "python"
    python_dir.mkdir()
    shutil.copytree(REPO / "python" / "muster_launcher", python_dir / "muster_launcher",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("muster_checkpoint.py", "muster_frameworks.py"):
        shutil.copy(REPO / "python" / name, python_dir / name)
    shutil.copy(REPO / "python" / "muster_sitecustomize.py", python_dir / "sitecustomize.py")
    entry = tmp_path / "entry.py"
    target = str(SCRIPTS / script)
    argv = [target, "--out", str(tmp_path / "out"), "--step-seconds", "0.2"]
    entry.write_text(BREAK_SAVE[script] + "import runpy, sys\n"
                     f"sys.argv = {argv!r}\n"
                     f"runpy.run_path({target!r}, run_name='__main__')\n")
    agent = FakeAgent()
    env = dict(os.environ, **OFFLINE, PYTHONPATH=str(python_dir),
               MUSTER_CHECKPOINT_SOCKET="@" + agent.name, RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([torch_python(), "-u", str(entry)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0, p.stdout + p.stderr
    assert ["hello", "0", "0"] in [w[:3] for w in agent.lines], agent.lines
    failed = [w for w in agent.lines if w[0] == "failed"]
    assert failed and " ".join(failed[0][2:]) == "OSError: [Errno 28] No space left on device", (
        agent.lines, p.stderr[-3000:])
    assert not [w for w in agent.lines if w[0] == "saved"], agent.lines


def test_a_long_hf_evaluation_is_a_section_not_a_hang(tmp_path):
    """An unmodified Trainer whose one evaluation takes 3x --hang-timeout: the callback marks it as
    a section (the stepping rank's liveness does not apply once the callback reports its steps),
    so the watch gives it --section-timeout and the run ends 0."""
    from conftest import muster_bin, muster_env
    wrapper = tmp_path / "entry.py"
    target = str(SCRIPTS / "hf_trainer.py")
    wrapper.write_text(
        "import runpy, sys\n"
        f"sys.argv = [{target!r}, '--out', {str(tmp_path / 'out')!r}, '--max-steps', '4', "
        "'--eval-seconds', '15']\n"
        f"runpy.run_path({target!r}, run_name='__main__')\n")
    p = subprocess.run([muster_bin(), "--standalone", "--nproc-per-node", "2",
                        "--hang-timeout", "5", "--max-restarts", "0", str(wrapper)],
                       env=muster_env(OFFLINE), capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "hang detected" not in out, out
    assert out.count("FINAL ") == 2, out
