"""`--log-format json`: every line a run writes, on stdout and stderr, is one record of the one
schema documented in docs/launch.md (rank lines, agent messages, the root-cause event, the error
that ends a run, configuration errors), through a whole job with a failure and a restart.
Also: --log-dir errors name the option and where its value came from."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import muster_bin, muster_env

pytestmark = pytest.mark.timeout(240)

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
CORE = {"ts": str, "level": str, "source": str, "host": str, "msg": str}
RANK = {"rank": int, "local_rank": int, "stream": str, "progress": bool}
AGENT_OPTIONAL = {"rank": int, "local_rank": int, "event": str, "fields": dict, "node": int}
NULLABLE = type(None)
EVENTS = {
    "root_cause": ({"attempts": int, "failed_at": str, "pid": int, "exit_code": (int, NULLABLE),
                    "signal": (str, NULLABLE), "agent_exit_code": int, "error": (str, NULLABLE),
                    "rank": int, "local_rank": int},
                   {"error_file": str, "exception_line": str, "hang": dict, "oom_killed": dict,
                    # The gang's root cause on another node (docs/launch.md § Exit codes).
                    "node_rank": int, "cause_host": str, "followed_on_this_node": dict}),
    "error": ({"agent_exit_code": int}, {}),
}

WORKER = r"""
import os, sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    rank = int(os.environ["RANK"])
    print(f"hello from {rank}", flush=True)
    print(f"warning \"quoted\" \u00e9 from {rank}", file=sys.stderr, flush=True)
    for i in range(5):
        sys.stderr.write(f"{i * 25}%\r")
    sys.stderr.write("done\n")
    # Rank 1 fails only once rank 0 has written everything: else the group's stop could cut
    # rank 0 short (a slow torch import under load) and the test would count a missing line.
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    mark = os.path.join(os.environ["SYNC_DIR"], f"rank0-wrote-{attempt}")
    if rank == 0:
        open(mark, "w").close()
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(mark) and time.monotonic() < deadline:
            time.sleep(0.02)
        raise ValueError(f"rank 1 says boom (attempt {os.environ['TORCHELASTIC_RESTART_COUNT']})")

main()
"""


def check_record(line):
    """Parses `line` as one record of the schema; returns it."""
    assert line and "\n" not in line
    r = json.loads(line)
    assert isinstance(r, dict), line
    for key, kind in CORE.items():
        assert isinstance(r.get(key), kind), (key, line)
    assert TS.match(r["ts"]), line
    assert r["level"] in {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"}, line
    allowed = dict(CORE)
    if r["source"] == "rank":
        for key, kind in RANK.items():
            assert type(r.get(key)) is kind, (key, line)  # bool is not an int here
        assert r["stream"] in {"stdout", "stderr"}
        assert r["level"] == "INFO"
        allowed.update(RANK)
    else:
        assert r["source"] == "agent", line
        allowed.update(AGENT_OPTIONAL)
        for key, kind in AGENT_OPTIONAL.items():
            if key in r:
                assert isinstance(r[key], kind) and not isinstance(r[key], bool), (key, line)
        if "event" in r:
            required, optional = EVENTS[r["event"]]
            for key, kind in required.items():
                assert key in r and isinstance(r[key], kind), (key, line)
            for key, kind in optional.items():
                if key in r:
                    assert isinstance(r[key], kind), (key, line)
            allowed.update(required)
            allowed.update(optional)
    unknown = set(r) - set(allowed)
    assert not unknown, (unknown, line)
    return r


def run(args, env=None, expect=None, cwd=None):
    full_env = muster_env({"MUSTER_METRICS_ADDR": "none", **(env or {})})
    p = subprocess.run([muster_bin(), *args], env=full_env, capture_output=True, text=True,
                       timeout=180, cwd=cwd)
    if expect is not None:
        assert p.returncode == expect, (p.returncode, p.stderr[-3000:])
    return p


def records(p):
    return ([check_record(l) for l in p.stdout.splitlines()],
            [check_record(l) for l in p.stderr.splitlines()])


@pytest.mark.parametrize("keep_files", [False, True])
def test_every_line_of_a_failing_job_is_one_schema(tmp_path, keep_files):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    logs = tmp_path / "logs"
    args = ["--nproc-per-node", "2", "--log-format", "json", "--max-restarts", "1",
            "--progress-interval", "0"]
    if keep_files:
        args += ["--log-dir", str(logs), "--tee", "3"]
    p = run([*args, str(worker)], env={"MUSTER_LOG": "debug", "SYNC_DIR": str(tmp_path)},
            expect=1)
    out, err = records(p)
    every = out + err
    assert len(every) >= 12
    rank_lines = [r for r in every if r["source"] == "rank"]
    # Both attempts of both ranks, each stream.
    for rank in (0, 1):
        assert sum(r["msg"] == f"hello from {rank}" for r in out) == 2
        assert sum(r["msg"] == f'warning "quoted" \u00e9 from {rank}' for r in err) == 2
        bars = [r["msg"] for r in rank_lines if r["rank"] == rank and r["progress"]]
        assert bars == ["0%", "25%", "50%", "75%", "100%"] * 2, bars
    agent = [r for r in err if r["source"] == "agent"]
    assert any(r["level"] == "WARN" and "restarting" in r["msg"] for r in agent), agent
    assert any(r["level"] == "DEBUG" for r in agent)
    (cause,) = [r for r in agent if r.get("event") == "root_cause"]
    assert (cause["rank"], cause["local_rank"], cause["exit_code"], cause["signal"]) == (1, 1, 1,
                                                                                       None)
    assert cause["agent_exit_code"] == 1 and cause["attempts"] == 2
    assert cause["error"].startswith("ValueError: rank 1 says boom (attempt 1)"), cause
    assert "ValueError: rank 1 says boom (attempt 1)" in cause["msg"]
    if keep_files:
        # The field names a file that is still there.
        assert Path(cause["error_file"]).is_file()
        assert cause["error_file"].startswith(str(logs))
    else:
        assert "error_file" not in cause


def test_configuration_errors_are_records_too(tmp_path):
    p = run(["--log-format", "json", "--nnodes", "0", "x.py"], expect=202)
    assert p.stdout == ""
    (r,) = [check_record(l) for l in p.stderr.splitlines()]
    assert (r["event"], r["agent_exit_code"], r["level"]) == ("error", 202, "ERROR")
    assert "--nnodes" in r["msg"]
    # The format from the environment, the command line not parseable.
    p = run(["--no-such-flag", "x.py"], env={"MUSTER_LOG_FORMAT": "json"}, expect=202)
    (r,) = [check_record(l) for l in p.stderr.splitlines()]
    assert "--no-such-flag" in r["msg"]
    # An unusable --log-dir, in JSON.
    afile = tmp_path / "afile"
    afile.write_text("")
    p = run(["--log-format", "json", "--log-dir", str(afile), "--no-python", "/bin/true"],
            expect=202)
    lines = [check_record(l) for l in p.stderr.splitlines()]
    (r,) = [r for r in lines if r.get("event") == "error"]
    assert r["msg"].startswith(f"invalid --log-dir `{afile}` (command line): cannot create "), r
    # Text stays text.
    p = run(["--nnodes", "0", "x.py"], expect=202)
    assert p.stderr.startswith("muster: error: invalid --nnodes")


def test_log_dir_errors_name_the_option_and_its_source(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    p = run(["--log-dir", str(afile), "--no-python", "/bin/true"], expect=202)
    assert f"muster: error: invalid --log-dir `{afile}` (command line): cannot create {afile}/" \
        in p.stderr, p.stderr
    assert "Not a directory" in p.stderr
    p = run(["--no-python", "/bin/true"], env={"MUSTER_LOG_DIR": str(afile)}, expect=202)
    assert f"invalid --log-dir `{afile}` (environment variable MUSTER_LOG_DIR)" in p.stderr, \
        p.stderr
