"""A real Slurm on this machine for the tests: one munged, one slurmctld and one `slurmd -N <name>`
per node, every one of them with its own socket, port, spool and state directory under a
temporary directory, so it touches nothing of a system Slurm and stops only what it started.

Debian's `slurm-wlm` 22.05 and `munge` (scripts/system-deps.sh installs them). The node names
are ones DNS does not know (`mnode1`, `mnode2`), every node's NodeAddr is 127.0.0.1, and the
plugins are the ones that need no cgroup set-up (proctrack/linuxproc, task/none).

Usable on its own for a hand-run cluster:
    python tests/python/slurm_cluster.py /tmp/slurm   # prints the SLURM_CONF, Ctrl-C stops it
"""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

NODES = ("mnode1", "mnode2")
# Generous: slurmd registration and the first scheduling pass take a few seconds on 2 busy CPUs.
START_TIMEOUT_S = 90


def missing_binaries():
    return [b for b in ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo")
            if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _sbin(name):
    found = shutil.which(name)
    return found or str(Path("/usr/sbin", name))


class Cluster:
    """A started cluster: `env` is what a Slurm client (srun, sbatch, scontrol) needs."""

    def __init__(self, root, nodes=NODES, kill_wait_s=30, cpus=4):
        self.root = Path(root)
        self.nodes = nodes
        self.kill_wait_s = kill_wait_s
        self.cpus = cpus
        self.procs = []
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- set-up -----------------------------------------------------------------------------

    def _write_conf(self):
        host = socket.gethostname().split(".")[0]
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        r = self.root
        for d in ("state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=mustertest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={r}/run/munge.socket",
            "CredType=cred/munge",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/linear",
            "ReturnToService=2",
            # The node definitions below, not the hardware, are the truth (2 CPUs here).
            "SlurmdParameters=config_overrides",
            "PropagateResourceLimits=NONE",
            f"KillWait={self.kill_wait_s}",
            "InactiveLimit=0",
            "MinJobAge=300",
            "MessageTimeout=20",
            "SlurmdTimeout=120",
            "SlurmctldTimeout=120",
            "RebootProgram=/bin/true",
            "JobRequeue=1",
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={host} "
                         f"Port={port} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")

    def _start(self, args, name):
        log = open(self.root / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        log.close()
        self.procs.append((name, proc))
        return proc

    def _start_munge(self):
        r = self.root
        key = r / "run" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        # --force: munged as root, in a directory it does not own; fine for a private test daemon.
        self._start([_sbin("munged"), "--foreground", "--force",
                     f"--socket={r}/run/munge.socket", f"--key-file={key}",
                     f"--pid-file={r}/run/munged.pid", f"--log-file={r}/log/munged.log",
                     f"--seed-file={r}/run/munge.seed"], "munged")
        self._wait(lambda: (r / "run" / "munge.socket").exists(), "munged's socket")

    def start(self):
        self._write_conf()
        self._start_munge()
        self._start([_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(self._ctld_up, "slurmctld to answer")
        for name in self.nodes:
            self._start([_sbin("slurmd"), "-D", "-N", name, "-f", str(self.conf)],
                        f"slurmd-{name}")
        self._wait(self.all_idle, "every node IDLE")
        return self

    def _wait(self, ready, what, timeout=START_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for "
                                       f"{what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}\n{self.logs()}")

    def _ctld_up(self):
        return self.run(["scontrol", "ping"], check=False).returncode == 0

    def node_states(self):
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def all_idle(self):
        states = self.node_states()
        return all(states.get(n, "").rstrip("*~#") == "idle" for n in self.nodes)

    def wait_idle(self, timeout=START_TIMEOUT_S):
        self._wait(self.all_idle, "every node IDLE", timeout)

    # -- use --------------------------------------------------------------------------------

    def run(self, args, check=True, timeout=60, env=None):
        return subprocess.run(args, env=env or self.env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def logs(self):
        out = []
        for f in sorted((self.root / "log").glob("*")):
            try:
                text = f.read_text(errors="replace")
            except OSError:
                continue
            out.append(f"--- {f.name} (last 40 lines)\n" + "\n".join(text.splitlines()[-40:]))
        return "\n".join(out)

    def stop(self):
        # Reverse order: the daemons that use munge go first; only our own processes.
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


if __name__ == "__main__":
    import signal

    # A SIGTERM (`timeout`, a closed terminal) stops the daemons too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/muster-slurm")
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root)
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
