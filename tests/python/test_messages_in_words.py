"""The agent's own lines say values in words (`nodes 1 and 3`, `2.5 s`), never in Rust's `Debug`
form (`[1, 3]`, `Some(3)`, `Foo { a: 1 }`, `2.5s`). Each case drives a path whose message once
held such output, or carries a list, an optional value or a duration: a gang crash loop (restarts,
each agent's exit code), a GPU fail-fast on the fake NVML (the finding, the verdict), a store that
never answers (the client's timeouts and keys), a bad `--rdzv-conf` (durations compared), a
preemption while the ranks start (the nodes without a barrier). Only muster's lines are read: a
rank's own output is the script's."""

import os
import re
import signal
import subprocess
import time

import pytest

from conftest import REPO, finish, free_port, muster_bin, muster_env

FIXTURES = REPO / "tests" / "fixtures" / "nvml"

# What Rust's Debug output looks like in a line: an Option, a list of numbers, a struct, a
# Duration. muster's own lines write seconds as `2.5 s` or, in older messages, `{:.1}s` (one
# decimal), so only the Duration forms no such format makes are caught: two or more decimals
# (`1.999s`, `2.25ms`) and the sub-millisecond units.
DEBUG_OUTPUT = [
    (re.compile(r"\b(Some|None|Ok|Err)\("), "an Option or Result"),
    (re.compile(r"\[\d+(?:, \d+)*\]"), "a list of numbers"),
    (re.compile(r"\b[A-Z]\w* \{ \w+: "), "a struct"),
    (re.compile(r"(?<![\w.:-])\d+(?:\.\d{2,}m?s|(?:\.\d+)?(?:ns|µs))\b"), "a Duration"),
]

# A rank's output carries its prefix (`[rank0]:`, `[default0]:`, `[r0]`...); muster's own lines
# carry a level or the `muster` name.
MUSTER_LINE = re.compile(r"\b(INFO|WARN|ERROR|DEBUG)\b|muster[: ]")
RANK_LINE = re.compile(r"^\s*\[(?:rank|default|r|node)\d")

# Reports through the helper and raises at step 3 on every attempt, on rank 0 or 1 in turn.
CRASH_LOOP = """\
import os, sys, time
import muster_checkpoint
ckpt = muster_checkpoint.Checkpointer()
rank = int(os.environ["RANK"])
failing = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) % 2
for step in range(1000):
    ckpt.should_save(step)
    if step == 3 and rank == failing:
        os._exit(1)
    if step == 3:
        # A peer of a failing rank waits in its next collective, as under DDP: it never runs
        # steps ahead of the failure however late the gang stops it (a loaded machine).
        time.sleep(600)
    time.sleep(0.05)
"""


def debug_output(text):
    """The muster lines in `text` that hold Debug output, with what each looks like."""
    found = []
    for line in text.splitlines():
        if RANK_LINE.search(line) or not MUSTER_LINE.search(line):
            continue
        for pattern, what in DEBUG_OUTPUT:
            if pattern.search(line):
                found.append(f"{what}: {line}")
    return found


def test_the_patterns_catch_debug_output_and_spare_words():
    caught = [
        "2026-12-02T10:00:00Z ERROR muster: attempt 1: process(es) [412, 413] did not die",
        "WARN muster: checkpoint socket: bad line; closing local_rank=Some(3)",
        "ERROR muster: node h: GPUs Report { verdict: Healthy }",
        "ERROR muster: cannot connect to the store at 10.0.0.1:29400 within 1.999s: refused",
        "WARN muster: NVML did not answer within 2.25ms: no GPU release wait",
        "WARN muster: faulthandler wrote nothing within 800µs",
    ]
    for line in caught:
        assert debug_output(line), line
    spared = [
        "ERROR muster: cannot connect to the store at 10.0.0.1:29400 within 2.5 s: refused",
        "INFO GPU watch: 8 GPU(s), a look every 10.0s and XID events as they happen",
        "INFO muster dry-run: agent 0 exited 0, agent 1 exited 209; job exit code 209",
        "ERROR muster: nodes 1 and 3 do not use the checkpoint helper",
        "[rank0]: [1, 2, 3] Some(3) 2.5s",  # the script's own line
        "ERROR muster: node h: GPU 3 (GPU-1, 00000000:5D:00.0) ecc_errors: 2 uncorrectable",
    ]
    for line in spared:
        assert not debug_output(line), line


def assert_in_words(text):
    found = debug_output(text)
    assert not found, "\n".join(found) + "\n\n" + text[-8000:]


@pytest.mark.timeout(240)
def test_a_gang_crash_loop_says_restarts_and_exit_codes_in_words(tmp_path):
    script = tmp_path / "bug.py"
    script.write_text(CRASH_LOOP)
    p = subprocess.Popen(
        [muster_bin(), "dry-run", "--nnodes", "2", "--nproc-per-node", "1",
         "--max-restarts", "10", "--max-no-progress-restarts", "2", "--shutdown-timeout", "3",
         "--rdzv-conf",
         "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.2,heartbeat_timeout=3",
         str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=muster_env())
    code, out, err = finish(p, 200)
    text = out + err
    assert code == 209, text[-8000:]
    assert "agent 0 exited 209, agent 1 exited 209" in text, text[-8000:]
    assert_in_words(text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fixture", ["ecc-gpu2-volatile-uncorrectable.json",
                                     "healthy-hgx-h100-8gpu.json"])
def test_the_gpu_pre_flight_says_its_findings_in_words(tmp_path, fixture):
    library = os.environ.get("MUSTER_FAKE_NVML") or str(
        REPO / "target" / "release" / "libfake_nvml.so")
    if not os.path.exists(library):
        pytest.fail(f"fake NVML not found at {library}", pytrace=False)
    env = muster_env({"MUSTER_NVML_LIBRARY": library,
                      "MUSTER_FAKE_NVML_FIXTURE": str(FIXTURES / fixture)})
    check = subprocess.run([muster_bin(), "gpu-check", "--expect-gpus", "8"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode in (0, 204), check.stderr
    assert_in_words(check.stdout + check.stderr)
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    p = subprocess.Popen(
        [muster_bin(), "--standalone", "--nproc-per-node", "1", "--gpu-check", "require",
         "--metrics-addr", "none", "--gpu-release-timeout", "0", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    code, out, err = finish(p, 90)
    assert code in (0, 204), err
    assert_in_words(out + err)


@pytest.mark.timeout(60)
def test_a_store_that_never_answers_is_said_in_words():
    # A listening socket that accepts and never answers: the client's read deadline runs out.
    import socket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    try:
        for endpoint in (f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"):
            p = subprocess.Popen(
                [muster_bin(), "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--metrics-addr", "none",
                 "--rdzv-conf", "join_timeout=2", "--", "python3", "-c", "pass"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=muster_env())
            code, out, err = finish(p, 40)
            assert code != 0, err
            assert err.strip(), "no message at all"
            assert_in_words(out + err)
    finally:
        silent.close()


def test_a_bad_rdzv_conf_compares_durations_in_words():
    p = subprocess.run(
        [muster_bin(), "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1",
         "--rdzv-conf", "keep_alive_interval=2.5,heartbeat_timeout=2", "--", "python3", "-c",
         "pass"],
        capture_output=True, text=True, timeout=30, env=muster_env())
    assert p.returncode == 202, p.stderr
    assert "heartbeat_timeout (2 s) must be longer than keep_alive_interval (2.5 s)" in p.stderr, \
        p.stderr
    assert_in_words(p.stdout + p.stderr)


@pytest.mark.timeout(120)
def test_a_preemption_while_the_ranks_start_names_nodes_in_words(tmp_path):
    script = tmp_path / "slow_start.py"
    script.write_text("import time\ntime.sleep(30)\n")
    p = subprocess.Popen(
        [muster_bin(), "dry-run", "--nnodes", "3", "--nproc-per-node", "1",
         "--shutdown-timeout", "2", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=muster_env(),
        start_new_session=True)
    time.sleep(6)
    os.killpg(p.pid, signal.SIGTERM)
    code, out, err = finish(p, 90)
    text = out + err
    assert code != 0, text[-8000:]
    assert_in_words(text)
