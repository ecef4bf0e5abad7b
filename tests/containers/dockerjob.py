"""Docker plumbing for the container end-to-end tests: a training job as Kubernetes would run it.

A `Job` is a user-defined Docker network plus containers named, hostnamed and aliased like the pods
of a headless Service: container `<job>-worker-<i>` has hostname `<job>-worker-<i>` and answers,
through Docker's embedded DNS, to `<job>-worker-<i>.<job>-headless` — the name muster's
`--rdzv-endpoint` uses in a JobSet or PyTorchJob. A container that does not exist yet has no DNS
record, exactly like a pod Kubernetes has not published yet.

Networks are created `--internal`: nothing a container sends can leave the machine, while the
host still reaches every container by IP on the bridge (that is how `/metrics` is scraped). The
job's "cluster DNS" is a container of its own (`<job>-dns`, scripts/nxdomain_dns.py) that answers
NXDOMAIN to everything: Docker's embedded resolver answers the pods' names and aliases and forwards
the rest there (`--dns`), so a pod that does not exist yet is NXDOMAIN at once, as with CoreDNS,
and no lookup is ever forwarded to the host's upstream servers.

Everything created carries the label `io.muster.test` and an owner label `<host>:<pid>` of the
pytest process. `cleanup()` removes a job's containers and network, and is called from finalizers
so a failing test cleans up too; `sweep_stale()` removes leftovers of runs whose owner process is
dead (a killed pytest), and never touches a concurrent run's objects.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

LABEL = "io.muster.test"
OWNER_LABEL = "io.muster.test.owner"
OWNER = f"{socket.gethostname()}:{os.getpid()}"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPTS = HERE / "scripts"
# Where the test scripts appear inside every container (read-only).
SCRIPTS_IN_CONTAINER = "/muster-tests"
# The repository's examples/ (the training scripts users start from), read-only.
EXAMPLES_IN_CONTAINER = "/muster-examples"
# A per-job host directory shared read-write by all containers of the job (results, markers).
SHARED_IN_CONTAINER = "/shared"


class DockerError(RuntimeError):
    pass


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """Runs the docker CLI, bounded in time; raises DockerError with its stderr on failure."""
    try:
        proc = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise DockerError(f"docker {' '.join(args[:3])} timed out after {timeout}s") from exc
    if check and proc.returncode != 0:
        raise DockerError(f"docker {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def docker_available() -> str | None:
    """None when the engine answers, else why not (for a skip message)."""
    try:
        proc = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True, text=True, timeout=20, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker CLI unusable: {exc}"
    if proc.returncode != 0:
        return f"docker engine not reachable: {proc.stderr.strip()}"
    return None


def _owner_alive(owner: str) -> bool:
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        # Another machine's (or a malformed) owner: not ours to judge, leave it.
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Removes labelled containers and networks whose owning pytest process is gone."""
    removed = []
    for kind, fmt in (("container", "{{.ID}} {{.Label \"%s\"}}"), ("network", "{{.ID}} {{.Label \"%s\"}}")):
        listing = docker(kind, "ls", *(["-a"] if kind == "container" else []),
                         "--filter", f"label={LABEL}", "--format", fmt % OWNER_LABEL, check=False)
        for line in listing.stdout.splitlines():
            ident, _, owner = line.partition(" ")
            if ident and not _owner_alive(owner.strip()):
                rm = ("rm", "-f", ident) if kind == "container" else ("rm", ident)
                if docker(kind, *rm, check=False, timeout=60).returncode == 0:
                    removed.append(f"{kind} {ident}")
    return removed


def build_image(muster_bin: str, torch_python: str) -> str:
    """Builds (or reuses) the offline test image for this binary; returns its reference."""
    proc = subprocess.run(
        [str(REPO / "docker" / "test-image" / "build.sh"), muster_bin, torch_python],
        capture_output=True, text=True, timeout=600, check=False,
    )
    if proc.returncode != 0:
        raise DockerError(f"test image build failed: {proc.stderr.strip()}")
    return proc.stdout.strip().splitlines()[-1]


def python_mounts(torch_python: str) -> tuple[str, list[str]]:
    """The venv's interpreter path and the directories to bind-mount read-only for it to run."""
    out = subprocess.run(
        [torch_python, "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()
    venv, base = out[0], out[1]
    return str(Path(venv) / "bin" / "python"), sorted({venv, base})


@dataclass
class Container:
    name: str
    job: "Job"

    def inspect(self) -> dict:
        return json.loads(docker("inspect", self.name).stdout)[0]

    def ip(self) -> str:
        nets = self.inspect()["NetworkSettings"]["Networks"]
        return nets[self.job.network]["IPAddress"]

    def running(self) -> bool:
        return bool(self.inspect()["State"]["Running"])

    def exit_code(self) -> int:
        return int(self.inspect()["State"]["ExitCode"])

    def wait(self, timeout: float) -> int:
        """Waits for the container to exit; returns its exit code (PID 1's)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                return self.exit_code()
            time.sleep(0.2)
        raise AssertionError(
            f"{self.name} still running after {timeout}s; its log ends:\n{self.logs()[-3000:]}"
        )

    def logs(self) -> str:
        proc = docker("logs", self.name, check=False, timeout=30)
        return proc.stdout + proc.stderr

    def exec(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return docker("exec", self.name, *cmd, timeout=timeout, check=False)

    def stop(self, grace: int) -> float:
        """`docker stop -t grace`: SIGTERM to PID 1, SIGKILL when the grace period ends."""
        t0 = time.monotonic()
        docker("stop", "-t", str(grace), self.name, timeout=grace + 60)
        return time.monotonic() - t0

    def kill(self, signal: str = "KILL") -> None:
        docker("kill", "--signal", signal, self.name)

    def remove(self) -> None:
        docker("rm", "-f", self.name, check=False)

    def processes(self, needle: str) -> int:
        """How many live (non-zombie) worker processes in the container have `needle` in their
        cmdline. The agent itself is not counted: its own command line names the script too."""
        code = (
            "import os\n"
            "n = 0\n"
            "me = str(os.getpid())\n"  # this scan's own cmdline contains the needle
            "for p in filter(str.isdigit, os.listdir('/proc')):\n"
            "    if p == me:\n"
            "        continue\n"
            "    try:\n"
            "        cmd = open(f'/proc/{p}/cmdline', 'rb').read()\n"
            "        state = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0]\n"
            "    except OSError:\n"
            "        continue\n"
            "    if cmd.split(b'\\0')[0].endswith(b'muster'):\n"
            "        continue\n"
            f"    n += state != 'Z' and {needle.encode()!r} in cmd\n"
            "print(n)\n"
        )
        proc = self.exec(self.job.python, "-c", code, timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"process scan failed in {self.name}: {proc.stderr}")
        return int(proc.stdout)

    def zombies(self) -> list[dict]:
        """Processes in state Z inside the container's PID namespace (read with the mounted python)."""
        proc = self.exec(self.job.python, f"{SCRIPTS_IN_CONTAINER}/zombies.py", timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"zombie scan failed in {self.name}: {proc.stderr}")
        return json.loads(proc.stdout)


@dataclass
class Job:
    """One training job: a network and its `<job>-worker-<i>` containers."""

    image: str
    torch_python: str
    shared: Path
    name: str = field(default_factory=lambda: f"mj{secrets.token_hex(3)}")
    containers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.network = f"{self.name}-net"
        self.python, self.python_dirs = python_mounts(self.torch_python)
        self.shared.mkdir(parents=True, exist_ok=True)
        docker("network", "create", "--internal", "--label", LABEL,
               "--label", f"{OWNER_LABEL}={OWNER}", self.network)
        try:
            dns = f"{self.name}-dns"
            docker("run", "-d", "--name", dns, "--network", self.network, *self._labels(),
                   *self._python_volumes(), "--entrypoint", self.python, self.image,
                   f"{SCRIPTS_IN_CONTAINER}/nxdomain_dns.py")
            self.dns_ip = Container(dns, self).ip()
        except BaseException:
            self.cleanup()  # the fixture never got the job, so it cannot clean up
            raise

    def _labels(self) -> list[str]:
        return ["--label", LABEL, "--label", f"{OWNER_LABEL}={OWNER}",
                "--label", f"io.muster.test.job={self.name}"]

    def _python_volumes(self) -> list[str]:
        vols = ["-v", f"{SCRIPTS}:{SCRIPTS_IN_CONTAINER}:ro"]
        for d in self.python_dirs:
            vols += ["-v", f"{d}:{d}:ro"]
        return vols

    def pod(self, index: int) -> str:
        return f"{self.name}-worker-{index}"

    def fqdn(self, index: int) -> str:
        return f"{self.pod(index)}.{self.name}-headless"

    def run(self, index: int, args: list[str], *, entrypoint: str | None = None,
            env: dict | None = None, stop_timeout: int = 10, docker_args: tuple = (),
            shared: bool = True) -> Container:
        """Starts pod `index` detached. `args` follow the image's ENTRYPOINT (muster) unless
        `entrypoint` replaces it. A container of the same name is replaced, as Kubernetes replaces
        a pod (same name, same DNS record, new IP possibly). `docker_args` are extra `docker run`
        options (a pod's securityContext and volumes: `--read-only`, `--user`, `--tmpfs`, ...);
        `shared=False` leaves out the writable job directory (every mount is then read-only)."""
        name = self.pod(index)
        docker("rm", "-f", name, check=False)
        full_env = {
            "PATH": f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        cmd = [
            "run", "-d", "--name", name, "--hostname", name,
            "--network", self.network, "--network-alias", self.fqdn(index),
            "--dns", self.dns_ip, *self._labels(),
            "--stop-timeout", str(stop_timeout),
            *self._python_volumes(),
            "-v", f"{REPO / 'examples'}:{EXAMPLES_IN_CONTAINER}:ro",
            *(["-v", f"{self.shared}:{SHARED_IN_CONTAINER}"] if shared else []),
            *docker_args,
        ]
        for key, value in full_env.items():
            cmd += ["-e", f"{key}={value}"]
        if entrypoint:
            cmd += ["--entrypoint", entrypoint]
        cmd += [self.image, *args]
        docker(*cmd)
        container = Container(name, self)
        self.containers[index] = container
        return container

    def cleanup(self) -> None:
        listing = docker("ps", "-aq", "--filter", f"label=io.muster.test.job={self.name}", check=False)
        ids = listing.stdout.split()
        if ids:
            docker("rm", "-f", *ids, check=False, timeout=120)
        docker("network", "rm", self.network, check=False)

    def dump_logs(self) -> str:
        return "\n".join(f"--- {c.name} ---\n{c.logs()[-4000:]}" for c in self.containers.values())
