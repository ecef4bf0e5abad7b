"""muster where it lives: PID 1 of containers that find each other by headless-Service DNS names.

Each test runs a job of containers on its own internal Docker network (see
tests/containers/dockerjob.py), from an image built offline by docker/test-image/build.sh around
the muster binary under test, with the PyTorch virtualenv mounted read-only.

Scenarios that need muster features still being built are written in full and gated by a probe of
the binary under test (tests/containers/muster_probes.py: a subcommand answers `--help`, `--help`
lists the launch flags, or a short loopback run shows the feature working), so each one switches on
by itself when its feature lands, and the skip message names the missing capability.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import muster_bin, torch_python, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "containers"))
import dockerjob  # noqa: E402
from muster_probes import Capabilities  # noqa: E402
from dockerjob import SCRIPTS_IN_CONTAINER as SCRIPTS  # noqa: E402

pytestmark = pytest.mark.timeout(420)

NNODES = 3
NPROC = 2
RDZV_PORT = 29500
METRICS_PORT = 8000
# muster's default exit code for "preempted, checkpoint committed" (agent/src/exit_code.rs).
PREEMPTED_CHECKPOINTED = 200
CHECKPOINT_ABORTED = 201
# Bounded joins, and a dead node noticed in seconds rather than torchrun's 15 s default.
RDZV_CONF = "join_timeout=180,keep_alive_interval=1,heartbeat_timeout=5"


# --- capability probes of the binary under test (tests/containers/muster_probes.py) -----------------


@pytest.fixture(scope="module")
def caps() -> Capabilities:
    return Capabilities(muster_bin())


# --- docker fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> str:
    why = dockerjob.docker_available()
    if why:
        pytest.skip(why)
    dockerjob.sweep_stale()
    t0 = time.monotonic()
    ref = dockerjob.build_image(muster_bin(), torch_python())
    print(f"test image {ref} ready in {time.monotonic() - t0:.1f}s")
    return ref


@pytest.fixture
def job(image, tmp_path):
    j = dockerjob.Job(image=image, torch_python=torch_python(), shared=tmp_path / "shared")
    try:
        yield j
    finally:
        # Kept next to the test's tmp dir for a post-mortem; pytest prints the path on failure.
        (tmp_path / "containers.log").write_text(j.dump_logs())
        j.cleanup()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def launch_args(job: dockerjob.Job, *script_args: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The container command of a pod: muster (the ENTRYPOINT) + torchrun's flags + the script."""
    return [
        "--nnodes", str(NNODES), "--nproc-per-node", str(NPROC),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{job.fqdn(0)}:{RDZV_PORT}",
        "--rdzv-id", job.name, "--rdzv-conf", RDZV_CONF, *extra,
        f"{SCRIPTS}/train.py", "--shared", dockerjob.SHARED_IN_CONTAINER, *script_args,
    ]


def pod_env(index: int) -> dict:
    """Node identity as Kubernetes provides it: pods 0 and 1 get JOB_COMPLETION_INDEX (Indexed Job,
    JobSet); pod 2 has only its hostname ordinal (`…-worker-2`, StatefulSet style)."""
    return {"JOB_COMPLETION_INDEX": str(index)} if index < 2 else {}


def start_gang(job, script_args, extra=(), order=(0, 1, 2), stop_timeout=10, env=None):
    for i in order:
        job.run(i, launch_args(job, *script_args, extra=extra),
                env={**pod_env(i), **(env or {})}, stop_timeout=stop_timeout)


def check_trained(shared: Path, attempt: int, master_addr: str | None = None) -> list[dict]:
    """All 6 ranks finished the attempt with one consistent model and a correct all-reduce;
    `master_addr`, when given, is what every rank must have as MASTER_ADDR."""
    world = NNODES * NPROC
    done = [read_json(shared / f"done-a{attempt}-r{r}.json") for r in range(world)]
    assert {d["world"] for d in done} == {world}
    assert {d["all_reduce"] for d in done} == {world * (world + 1) / 2}
    checksums = {round(d["checksum"], 4) for d in done}
    assert len(checksums) == 1, f"DDP replicas diverged: {checksums}"
    starts = [read_json(shared / f"start-a{attempt}-r{r}.json") for r in range(world)]
    for s in starts:
        env = s["env"]
        node = int(s["host"].rsplit("-", 1)[-1])
        # Global ranks are contiguous by node rank, and node rank = the pod's index.
        assert int(env["GROUP_RANK"]) == node, s
        assert int(env["RANK"]) == node * NPROC + int(env["LOCAL_RANK"]), s
    # One store for everyone: under muster node 0's advertised address (its pod IP), never a name
    # only that pod can resolve.
    addrs = {s["env"]["MASTER_ADDR"] for s in starts}
    assert len(addrs) == 1 and (master_addr is None or addrs == {master_addr}), addrs
    return done


# --- always: the image itself ------------------------------------------------------------------


def test_muster_is_pid1_and_a_config_error_is_its_documented_code(job):
    """The image's ENTRYPOINT is muster; a bad command line is a clear message naming the culprit
    and exit code 202, as the container runtime reports it (what a podFailurePolicy rule matches)."""
    c = job.run(0, ["--no-such-flag-anywhere"])
    code = c.wait(timeout=60)
    logs = c.logs()
    assert code == 202, f"exit {code}: {logs}"
    assert "--no-such-flag-anywhere" in logs or "muster: error:" in logs, logs
    assert "Traceback" not in logs and "panicked" not in logs, logs
    pid1 = c.inspect()["Config"]["Entrypoint"]
    assert pid1 == ["/usr/local/bin/muster"], pid1


# --- store: the harness's own proof, and muster store in containers ----------------------------


@pytest.mark.parametrize("host", ["muster", "torch-reference"])
def test_store_gang_over_headless_dns_host_started_last(job, caps, host):
    """Peers start before the store host exists: they wait for its headless DNS name, then use it
    as a TCPStore and as the init_process_group(env://) agent store, and all-reduce over gloo
    between containers. `torch-reference` runs PyTorch's own TCPStore server in the same harness.
    Then `docker stop` must stop the host as PID 1 cleanly (SIGTERM handled, no SIGKILL)."""
    if host == "muster":
        caps.require("store")
    peers = [1, 2]
    for r in peers:
        job.run(r, [f"{SCRIPTS}/store_peer.py", "--host", job.fqdn(0), "--port", str(RDZV_PORT),
                    "--rank", str(r - 1), "--world-size", str(len(peers)),
                    "--out", f"{dockerjob.SHARED_IN_CONTAINER}/peer-{r}.json"],
                entrypoint=job.python)
    # The peers are really waiting on DNS (not yet failed, not yet connected).
    wait_until(lambda: all("not resolvable yet" in job.containers[r].logs() for r in peers),
               timeout=60, interval=0.5, what="peers waiting for the host's DNS name")
    assert all(job.containers[r].running() for r in peers)

    if host == "muster":
        hoster = job.run(0, ["store", "--host", "0.0.0.0", "--port", str(RDZV_PORT)])
    else:
        hoster = job.run(0, [f"{SCRIPTS}/store_host_torch.py", "--port", str(RDZV_PORT)],
                         entrypoint=job.python)
    for r in peers:
        code = job.containers[r].wait(timeout=180)
        assert code == 0, f"peer {r} exited {code}:\n{job.dump_logs()}"
    results = [read_json(job.shared / f"peer-{r}.json") for r in peers]
    host_ip = hoster.ip()
    for res in results:
        assert res["resolved"] == host_ip
        assert res["dns_attempts"] > 1, "peers should have found no DNS record at first"
        assert res["all_reduce"] == 3.0
        assert res["peers"] == [job.pod(1), job.pod(2)]
    assert sorted(r["arrivals"] for r in results) == [1, 2]

    assert hoster.running()
    took = hoster.stop(grace=20)
    code = hoster.exit_code()
    assert code == 0, f"store host exited {code} on SIGTERM (137 = ignored as PID 1, then SIGKILL)"
    assert took < 15, f"docker stop took {took:.1f}s"


# --- PID 1 duties -------------------------------------------------------------------------------


def test_pid1_reaps_orphaned_grandchildren_single_pod(job, caps):
    """`muster --standalone` as PID 1; each worker leaves an orphan that PID 1 adopts. While the
    workers still run, no zombie may remain in the container."""
    caps.require("launch")
    c = job.run(0, ["--standalone", "--nproc-per-node", str(NPROC), f"{SCRIPTS}/train.py",
                    "--shared", dockerjob.SHARED_IN_CONTAINER, "--steps", "3", "--orphans",
                    "--hold"])
    wait_until(lambda: all((job.shared / f"orphaned-a0-r{r}").exists() for r in range(NPROC)),
               timeout=120, what="orphans to be created")
    assert_no_lasting_zombies([c])
    (job.shared / "release").touch()
    assert c.wait(timeout=120) == 0, job.dump_logs()


def test_pid1_restart_leaves_only_the_current_attempts_helpers(job, caps):
    """Issue #20 with muster as PID 1: the rank leaves three helpers outside its session
    (`setsid`, `start_new_session=True`, a setsid double fork that PID 1 adopts) and fails; after
    the restart only attempt 1's helpers exist in the container, and muster stops those too
    before it exits (its log names both sweeps)."""
    caps.require("launch")
    token = f"{job.name}x"
    c = job.run(0, ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                    "--shutdown-timeout", "2", f"{SCRIPTS}/spawn_strays.py"],
                env={"OUT_DIR": dockerjob.SHARED_IN_CONTAINER, "TOKEN": token,
                     "STRAY_RANK_WAITS": "1"})
    wait_until(lambda: (job.shared / "ready-1").exists(), timeout=120, what="attempt 1's helpers")
    assert c.processes(f"strays-{token}-a0-") == 0, job.dump_logs()
    assert c.processes(f"strays-{token}-a1-") == 3, job.dump_logs()
    (job.shared / "finish").touch()
    assert c.wait(timeout=120) == 3, job.dump_logs()
    sweeps = [l for l in c.logs().splitlines() if "stray process(es)" in l]
    assert len(sweeps) == 2 and all("stopped 3 stray" in l for l in sweeps), sweeps


def assert_no_lasting_zombies(containers) -> None:
    """A zombie may exist for the instant between exit and reaping; one that is still there a
    second later was not reaped."""
    for c in containers:
        first = {z["pid"] for z in c.zombies()}
        if first:
            time.sleep(1.0)
            lasting = [z for z in c.zombies() if z["pid"] in first]
            assert not lasting, f"zombies in {c.name}: {lasting}"


# --- multi-node -----------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["muster", "torchrun-reference"])
def test_worker0_started_last_gang_trains(job, caps, launcher):
    """Pods 1 and 2 start first and wait for worker-0's DNS record; worker-0 arrives; the gang of
    3 × 2 ranks trains with real gloo DDP; all exit 0. Under muster (PID 1) no zombie remains in any
    pod although every worker orphans a grandchild.

    `torchrun-reference` runs the same pods with torchrun as PID 1 (static rendezvous, node rank
    given explicitly, as the Kubeflow operator does): it validates this harness and the training
    script, and shows the baseline: torchrun never reaps the orphans (counted, not asserted)."""
    script = ["--steps", "10", "--orphans", "--hold"]
    if launcher == "muster":
        caps.require("launch", "multinode")

        def start(i):
            job.run(i, launch_args(job, *script), env=pod_env(i))
    else:
        muster_can = not (caps.why_missing("launch") or caps.why_missing("multinode"))
        if muster_can and not os.environ.get("MUSTER_TEST_REFERENCE"):
            pytest.skip("muster runs this scenario itself, which validates the harness; the torchrun "
                        "reference (about a minute) runs only while it cannot, or with MUSTER_TEST_REFERENCE=1")

        def start(i):
            job.run(i, ["--nnodes", str(NNODES), "--nproc-per-node", str(NPROC),
                        "--rdzv-backend", "static", "--master-addr", job.fqdn(0),
                        "--master-port", str(RDZV_PORT), "--node-rank", str(i),
                        f"{SCRIPTS}/train.py", "--shared", dockerjob.SHARED_IN_CONTAINER, *script],
                    entrypoint=str(Path(job.python).parent / "torchrun"))

    for i in (1, 2):
        start(i)
    time.sleep(5)
    for i in (1, 2):
        assert job.containers[i].running(), f"pod {i} gave up before worker-0 existed:\n{job.dump_logs()}"
        if launcher == "muster":
            # The wait is visible in the pod log, naming the host it waits for.
            assert job.fqdn(0) in job.containers[i].logs(), job.containers[i].logs()
    assert not list(job.shared.glob("start-*")), "workers started before the gang was complete"
    start(0)
    world = NNODES * NPROC
    wait_until(lambda: len(list(job.shared.glob("done-a0-*"))) == world
               and len(list(job.shared.glob("orphaned-a0-*"))) == world,
               timeout=240, interval=0.5, what="all 6 ranks to train")
    check_trained(job.shared, attempt=0,
                  master_addr=job.containers[0].ip() if launcher == "muster" else job.fqdn(0))
    if launcher == "muster":
        assert_no_lasting_zombies(job.containers.values())
    else:
        time.sleep(1.0)
        left = {c.name: len(c.zombies()) for c in job.containers.values()}
        print(f"torchrun as PID 1 left zombies: {left}")
    (job.shared / "release").touch()
    for i, c in job.containers.items():
        assert c.wait(timeout=120) == 0, f"pod {i}:\n{job.dump_logs()}"


def test_metrics_scraped_over_the_network_by_ip(job, caps):
    """Each pod's /metrics answers on its IP from the start (a pod waiting for DNS is visible),
    /healthz is OK, /readyz is ready without waiting for the other pods (issue #23), /gangz only
    after the rendezvous."""
    caps.require("launch", "multinode", "metrics")
    start_gang(job, ["--steps", "5", "--hold"], order=(1, 2))

    def get(c, path):
        try:
            with urllib.request.urlopen(f"http://{c.ip()}:{METRICS_PORT}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return None, ""

    waiting = [job.containers[i] for i in (1, 2)]
    wait_until(lambda: all(get(c, "/metrics")[0] == 200 for c in waiting), timeout=60,
               what="/metrics of the waiting pods")
    for c in waiting:
        assert get(c, "/healthz")[0] == 200
        assert get(c, "/gangz")[0] == 503, "gang running before the rendezvous"
        wait_until(lambda c=c: get(c, "/readyz")[0] == 200, timeout=30,
                   what=f"{c.name} ready while waiting for its peers")
    start_gang(job, ["--steps", "5", "--hold"], order=(0,))
    world = NNODES * NPROC
    wait_until(lambda: len(list(job.shared.glob("done-a0-*"))) == world, timeout=240,
               what="training")
    for c in job.containers.values():
        wait_until(lambda c=c: get(c, "/gangz")[0] == 200, timeout=30,
                   what=f"{c.name} gang running")
        assert get(c, "/readyz")[0] == 200
        status, text = get(c, "/metrics")
        assert status == 200
        sizes = re.findall(r"^muster_world_size(?:\{[^}]*\})? (\S+)$", text, re.M)
        assert sizes and float(sizes[0]) == world, f"{c.name}: muster_world_size {sizes}"
    # Issue #12: this process reaches the pods from the job network's gateway, not from their
    # loopback: POST /checkpoint is refused (403), counted, and the job keeps running to the end.
    target = job.containers[1]
    request = urllib.request.Request(f"http://{target.ip()}:{METRICS_PORT}/checkpoint",
                                     data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            status = r.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert status == 403
    text = get(target, "/metrics")[1]
    assert re.search(r'^muster_checkpoint_requests_rejected_total\{reason="forbidden"\} 1$',
                     text, re.M), text
    assert get(target, "/gangz")[0] == 200, "the job keeps running"
    (job.shared / "release").touch()
    for c in job.containers.values():
        assert c.wait(timeout=120) == 0, job.dump_logs()


def test_docker_stop_one_pod_checkpoints_every_rank_at_one_step(job, caps):
    """`docker stop` of pod 1 only, mid-training, with examples/train_checkpoint.py (which uses the
    muster_checkpoint helper muster puts on the workers' PYTHONPATH): all 6 ranks on the 3 pods
    save at one step T, rank 0 records the commit, every pod exits 200 (the documented default for
    "preempted and checkpointed", which a Job's podFailurePolicy ignores: never 0, which a Job
    would count as a completion) inside the grace period; the job started again resumes from T."""
    caps.require("launch", "multinode", "preemption")
    grace = 30
    script = f"{dockerjob.EXAMPLES_IN_CONTAINER}/train_checkpoint.py"
    ckpt = f"{dockerjob.SHARED_IN_CONTAINER}/ckpt"

    def start(i, steps):
        job.run(i, ["--nnodes", str(NNODES), "--nproc-per-node", str(NPROC),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{job.fqdn(0)}:{RDZV_PORT}",
                    "--rdzv-id", job.name, "--rdzv-conf", RDZV_CONF, "--grace-period", str(grace),
                    script, "--steps", str(steps), "--ckpt-dir", ckpt, "--step-seconds", "0.05"],
                env=pod_env(i), stop_timeout=grace)

    for i in range(NNODES):
        start(i, 100000)
    wait_until(lambda: "step 20 " in job.containers[0].logs(), timeout=240, interval=0.5,
               what="training to reach step 20")
    t0 = time.monotonic()
    took = job.containers[1].stop(grace=grace)
    assert took < grace, f"pod 1 needed the SIGKILL ({took:.1f}s)"
    codes = {i: c.wait(timeout=grace + 30) for i, c in job.containers.items()}
    assert time.monotonic() - t0 < grace + 5
    assert codes == {i: PREEMPTED_CHECKPOINTED for i in range(NNODES)}, f"{codes}\n{job.dump_logs()}"
    latest = job.shared / "ckpt" / "LATEST"
    assert latest.exists(), f"no committed checkpoint:\n{job.dump_logs()}"
    target = int(latest.read_text())
    saved = sorted(p.name for p in (job.shared / "ckpt" / f"step_{target}").glob("rank_*.pt"))
    assert saved == [f"rank_{r}.pt" for r in range(NNODES * NPROC)], saved

    # Kubernetes recreates the pods; the job resumes from the committed step.
    for i in range(NNODES):
        start(i, target + 5)
    for i, c in job.containers.items():
        assert c.wait(timeout=300) == 0, job.dump_logs()
    logs = job.containers[0].logs()
    assert f"resumed from committed step {target}" in logs and f"finished {target + 5} steps" in logs, logs


def test_docker_stop_one_pod_propagates_sigterm_to_every_rank(job, caps):
    """`docker stop` (SIGTERM, SIGKILL after the grace period) of pod 1 only, mid-training, with an
    unmodified script that traps SIGTERM: every rank on every pod receives it (the agents share the
    trigger through the store), and every pod exits inside the grace period with the same
    documented code — not 137 (killed at the end of the grace period)."""
    caps.require("launch", "multinode", "preemption")
    grace = 30
    start_gang(job, ["--steps", "100000", "--step-seconds", "0.05", "--trap-term"],
               extra=("--grace-period", str(grace)), stop_timeout=grace,
               env={"MUSTER_GRACE_PERIOD": str(grace)})
    wait_until(lambda: len(list(job.shared.glob("start-a0-*"))) == NNODES * NPROC, timeout=240,
               what="training to start")
    time.sleep(3)
    t0 = time.monotonic()
    took = job.containers[1].stop(grace=grace)
    assert took < grace, f"pod 1 needed the SIGKILL ({took:.1f}s)"
    codes = {i: c.wait(timeout=grace + 30) for i, c in job.containers.items()}
    elapsed = time.monotonic() - t0
    assert elapsed < grace + 5, f"the gang took {elapsed:.1f}s to stop"
    got = sorted(int(p.stem.split("-r")[1]) for p in job.shared.glob("sigterm-r*.json"))
    assert got == list(range(NNODES * NPROC)), f"SIGTERM reached ranks {got}:\n{job.dump_logs()}"
    assert len(set(codes.values())) == 1, f"pods disagree on the outcome: {codes}\n{job.dump_logs()}"
    # Never 137 (killed at the end of the grace period), never 0 (a Job would count the pod as
    # finished work): with no checkpoint helper in the script nothing was committed.
    assert set(codes.values()) == {CHECKPOINT_ABORTED}, codes


def test_docker_kill_of_a_non_host_pod_restarts_the_gang(job, caps):
    """SIGKILL of pod 2 (no SIGTERM, as when a node dies): pods 0 and 1 notice within the heartbeat
    timeout and stop their workers; a replacement pod with the same name (what Kubernetes does)
    joins; the gang re-forms at full size and finishes."""
    caps.require("launch", "multinode")
    extra = ("--max-restarts", "3", "--shutdown-timeout", "10")
    start_gang(job, ["--steps", "5", "--hold"], extra=extra)
    world = NNODES * NPROC
    wait_until(lambda: len(list(job.shared.glob("done-a0-*"))) == world, timeout=240,
               interval=0.5, what="first attempt to train")
    job.containers[2].kill("KILL")
    assert job.containers[2].wait(timeout=30) == 137
    # Heartbeat timeout (5 s) + the shutdown timeout (10 s) + slack for a loaded machine. Without
    # this the held workers would linger until their own timeout, as torchrun's do.
    try:
        wait_until(lambda: all(job.containers[i].processes("train.py") == 0 for i in (0, 1)),
                   timeout=45, interval=1.0,
                   what="pods 0 and 1 to stop their workers after losing pod 2")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{job.dump_logs()}") from None
    for i in (0, 1):
        assert job.containers[i].running(), f"pod {i} exited instead of waiting for a replacement"
    job.run(2, launch_args(job, "--steps", "5", "--hold", extra=extra), env=pod_env(2))
    wait_until(lambda: len(list(job.shared.glob("done-a1-*"))) == world, timeout=300,
               interval=0.5, what="the gang to re-form and train again")
    check_trained(job.shared, attempt=1, master_addr=job.containers[0].ip())
    (job.shared / "release").touch()
    for i, c in job.containers.items():
        assert c.wait(timeout=120) == 0, f"pod {i}:\n{job.dump_logs()}"


def test_docker_kill_of_worker0_resumes_from_the_last_committed_step(job, caps):
    """Issue #14: the store host's pod dies (SIGKILL of the worker-0 container, as when its node
    dies) and Kubernetes starts a new one under the same name and network alias (a new IP): pods
    1 and 2 wait for it instead of exiting 205, the gang re-forms, and the workers resume from the
    last committed checkpoint (examples/train_checkpoint.py's own resume logic) and finish.

    The committed checkpoint comes from a preemption first (`docker stop` of pod 1: every pod
    exits 200), as a job that was preempted, resumed, and then lost its node 0 would have."""
    caps.require("launch", "multinode", "preemption", "node0_recovery")
    grace = 30
    script = f"{dockerjob.EXAMPLES_IN_CONTAINER}/train_checkpoint.py"
    ckpt = f"{dockerjob.SHARED_IN_CONTAINER}/ckpt"

    def start(i, steps):
        job.run(i, ["--nnodes", str(NNODES), "--nproc-per-node", str(NPROC),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{job.fqdn(0)}:{RDZV_PORT}",
                    "--rdzv-id", job.name, "--rdzv-conf", RDZV_CONF, "--grace-period", str(grace),
                    "--max-restarts", "3", script, "--steps", str(steps), "--ckpt-dir", ckpt,
                    "--step-seconds", "0.05"],
                env=pod_env(i), stop_timeout=grace)

    # A committed checkpoint at step T.
    for i in range(NNODES):
        start(i, 100000)
    wait_until(lambda: "step 20 " in job.containers[0].logs(), timeout=240, interval=0.5,
               what="training to reach step 20")
    job.containers[1].stop(grace=grace)
    codes = {i: c.wait(timeout=grace + 30) for i, c in job.containers.items()}
    assert codes == {i: PREEMPTED_CHECKPOINTED for i in range(NNODES)}, f"{codes}\n{job.dump_logs()}"
    target = int((job.shared / "ckpt" / "LATEST").read_text())

    # The job resumes from T; mid-training, worker-0's container is SIGKILLed and replaced.
    steps = target + 400
    for i in range(NNODES):
        start(i, steps)

    def trained_past_checkpoint():
        logged = [int(s) for s in re.findall(r"step (\d+) loss", job.containers[0].logs())]
        return any(s > target + 30 for s in logged)

    wait_until(trained_past_checkpoint, timeout=240, interval=0.5,
               what="the resumed job to train past its checkpoint")
    old_ip = job.containers[0].ip()
    job.containers[0].kill("KILL")
    assert job.containers[0].wait(timeout=30) == 137
    time.sleep(3)
    for i in (1, 2):
        assert job.containers[i].running(), \
            f"pod {i} exited instead of waiting for a new worker-0:\n{job.dump_logs()}"
    start(0, steps)
    new0 = job.containers[0]
    codes = {i: c.wait(timeout=300) for i, c in job.containers.items()}
    assert codes == {i: 0 for i in range(NNODES)}, f"{codes}\n{job.dump_logs()}"
    print(f"worker-0 came back at {new0.ip()} (was {old_ip})")
    # Pod 1's ranks resumed from T twice (the resumed job, then the re-formed gang), and the new
    # worker-0's ranks once; every rank finished.
    for i, times in ((1, 2), (0, 1)):
        logs = job.containers[i].logs()
        resumed = re.findall(rf"resumed from committed step {target}$", logs, re.M)
        assert len(resumed) == NPROC * times, logs
        assert len(re.findall(rf"finished {steps} steps$", logs, re.M)) == NPROC, logs


# --- hardened pods: read-only root, non-root user, no capabilities (issue #21) ---------------------

# A pod under the "restricted" Pod Security Standard plus readOnlyRootFilesystem, as docker runs it.
HARDENED = ("--read-only", "--user", "65534:65534", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges")
# What the logs say when muster found no writable directory (one line, naming the fix).
NO_WRITABLE = "no writable directory for muster's files"
RECORD = re.compile(r"RECORD (\S+) (\{.*\})$")


def printed_records(logs: str) -> dict:
    """The `RECORD <name> <json>` lines of train.py --shared - (muster prefixes each line)."""
    out = {}
    for line in logs.splitlines():
        m = RECORD.search(line)
        if m:
            out[m.group(1)] = json.loads(m.group(2))
    return out


def test_hardened_pod_without_a_writable_mount_trains(job, caps):
    """`--read-only --user 65534:65534 --cap-drop ALL --security-opt no-new-privileges` and no
    writable mount (every volume read-only): 2 ranks train DDP on gloo and muster exits 0 (before
    #21: 206, "Read-only file system"). The one writable place is Docker's (and every pod's)
    /dev/shm: muster keeps its files there and gives the workers TMPDIR=/dev/shm, without which
    `import torch._dynamo` (DDP) fails on a read-only /tmp."""
    caps.require("launch")
    c = job.run(0, ["--standalone", "--nproc-per-node", str(NPROC), f"{SCRIPTS}/train.py",
                    "--shared", "-", "--steps", "3"], docker_args=HARDENED, shared=False)
    code = c.wait(timeout=180)
    logs = c.logs()
    assert code == 0, f"exit {code}:\n{logs}"
    records = printed_records(logs)
    done = [records.get(f"done-a0-r{r}.json") for r in range(NPROC)]
    assert all(done), f"not every rank finished:\n{logs}"
    assert {d["all_reduce"] for d in done} == {NPROC * (NPROC + 1) / 2}
    assert len({round(d["checksum"], 4) for d in done}) == 1
    starts = [records[f"start-a0-r{r}.json"] for r in range(NPROC)]
    assert {(s["uid"], s["gid"]) for s in starts} == {(65534, 65534)}, starts
    assert {s["tmpdir"] for s in starts} == {"/dev/shm"}, starts
    assert NO_WRITABLE not in logs, logs
    assert "Read-only file system" not in logs and "internal error" not in logs.lower(), logs


# Without torch: with nothing writable at all, PyTorch itself cannot import (see above).
REPORT = ("import os; print('REPORT', os.environ['RANK'], os.getuid(), "
          "os.environ.get('MUSTER_CHECKPOINT_SOCKET'), os.environ.get('TMPDIR'), "
          "os.environ.get('TORCHELASTIC_ERROR_FILE'))")


def test_hardened_pod_with_nothing_writable_starts_and_says_what_it_does_without(job, caps):
    """The same hardening plus `--ipc none` (no /dev/shm either): nowhere to write at all. muster
    still starts its 2 workers (abstract checkpoint socket, no helper, no error file, no TMPDIR)
    and exits 0, with one warning line that names the fix."""
    caps.require("launch")
    c = job.run(0, ["--standalone", "--nproc-per-node", str(NPROC), "--no-python", job.python,
                    "-c", REPORT], docker_args=HARDENED + ("--ipc", "none"), shared=False)
    code = c.wait(timeout=120)
    logs = c.logs()
    assert code == 0, f"exit {code}:\n{logs}"
    reports = sorted(l.split("REPORT ", 1)[1].split() for l in logs.splitlines() if "REPORT " in l)
    assert [r[0] for r in reports] == [str(r) for r in range(NPROC)], logs
    for _rank, uid, sock, tmpdir, errfile in reports:
        assert uid == "65534" and sock.startswith("@muster-ckpt-"), logs
        assert tmpdir == "None" and errfile == "None", logs
    warnings = [line for line in logs.splitlines() if NO_WRITABLE in line]
    assert len(warnings) == 1, logs
    assert "emptyDir" in warnings[0] and "/tmp" in warnings[0], warnings[0]


def test_hardened_pod_with_an_emptydir_at_tmp_checkpoints_on_sigterm(job, caps):
    """The same hardening, `/dev/shm` taken away, and only a tmpfs at /tmp (what an `emptyDir` at
    /tmp gives a pod): muster puts the checkpoint helper there, so examples/train_checkpoint.py
    imports it; `docker stop` becomes a committed checkpoint of both ranks at one step and exit 200
    (`--preempted-exit-code 200`, given explicitly) inside the grace period."""
    caps.require("launch", "preemption")
    grace = 30
    script = f"{dockerjob.EXAMPLES_IN_CONTAINER}/train_checkpoint.py"
    c = job.run(0, ["--standalone", "--nproc-per-node", str(NPROC), "--grace-period", str(grace),
                    "--preempted-exit-code", "200", script, "--steps", "100000",
                    "--ckpt-dir", "/tmp/ckpt", "--step-seconds", "0.05"],
                docker_args=HARDENED + ("--ipc", "none", "--tmpfs", "/tmp:rw,mode=1777"),
                shared=False, stop_timeout=grace)
    try:
        wait_until(lambda: "step 20 " in c.logs() or not c.running(), timeout=240, interval=0.5,
                   what="training to reach step 20")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{c.logs()}") from None
    assert c.running(), f"exited early:\n{c.logs()}"
    took = c.stop(grace=grace)
    assert took < grace, f"needed the SIGKILL ({took:.1f}s):\n{c.logs()}"
    code = c.wait(timeout=30)
    logs = c.logs()
    assert code == 200, f"exit {code}:\n{logs}"
    committed = re.findall(r"checkpoint at step (\d+): committed", logs)
    assert len(committed) == NPROC and len(set(committed)) == 1, logs
    assert NO_WRITABLE not in logs, logs


# --- OOM kills named (issue #15) ------------------------------------------------------------

OOM_LIMIT = ("--memory", "256m", "--memory-swap", "256m")
OOM_LINE = "rank 0 was killed by the kernel OOM killer (container memory limit 256.0 MiB)"


def test_a_rank_past_the_container_memory_limit_is_named_the_oom_killers(job, caps):
    """Issue #15: a container limited to 256 MiB (`--memory-swap` the same, so no swap hides the
    OOM); its one rank allocates past the limit, the kernel's OOM killer SIGKILLs it and muster, as
    PID 1, survives and names it: the restart is counted in muster_worker_oom_kills_total (read
    over the network while attempt 1 waits); attempt 1 is OOM-killed too, and the container exits
    137 with the summary naming the OOM killer and the limit read from the memory cgroup (v1
    here: memory.oom_control, memory.limit_in_bytes)."""
    caps.require("launch", "metrics")
    c = job.run(0, ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                    f"{SCRIPTS}/allocate.py", dockerjob.SHARED_IN_CONTAINER],
                docker_args=OOM_LIMIT)
    try:
        wait_until(lambda: (job.shared / "waiting-a1").exists() or not c.running(), timeout=120,
                   interval=0.2, what="attempt 0 to be OOM-killed and attempt 1 to start")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{c.logs()}") from None
    assert c.running(), f"muster exited after the first kill:\n{c.logs()}"
    with urllib.request.urlopen(f"http://{c.ip()}:{METRICS_PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    kills = re.findall(r"^muster_worker_oom_kills_total (\S+)$", text, re.M)
    assert kills == ["1"], f"muster_worker_oom_kills_total {kills}:\n{c.logs()}"
    (job.shared / "release").touch()
    code = c.wait(timeout=120)
    logs = c.logs()
    assert code == 137, f"exit {code}:\n{logs}"
    assert "not killed" not in logs, logs
    # The restart after the first kill says so too, not just "signal SIGKILL".
    assert f"{OOM_LINE}; restarting the worker group (restart 1 of 1)" in logs, logs
    # PID 1 wrote the summary, so the OOM killer took the rank, not muster.
    head = "worker group failed after 2 attempt(s)"
    assert head in logs, logs
    summary = logs[logs.index(head):]
    assert OOM_LINE in summary, logs
    assert "signal SIGKILL (9)" in summary, summary
