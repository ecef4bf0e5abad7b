"""Pytest-side harness shared by the TCPStore suites: torch servers and torch clients, each kept in
processes of their own so that no torch client ever blocks the pytest process.

- `TorchServerHost` talks to tools/torch_store_host.py, which creates real torch TCPStore masters
  (libuv or classic backend) on demand.
- `ClientWorker` talks to tools/store_client_worker.py, which runs one scenario function (a plain
  module-level function of a test file taking a `ctx`) with the real torch client and reports
  success or the traceback. A scenario that overruns its deadline gets the worker killed and
  restarted, and the test fails with "hung".
"""

import json
import os
import select
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import StoreProcess, torch_python

TOOLS = Path(__file__).resolve().parent / "tools"
# torch's dual-stack servers reverse-resolve ::ffff:127.0.0.1 per connection; tools/nodns.sh
# keeps that lookup off DNS (see the script) so that a slow resolver cannot stall the suite.
NODNS = str(TOOLS / "nodns.sh")


class _LineProcess:
    def __init__(self, argv, what):
        self.what = what
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, bufsize=1
        )

    def readline(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.what} exited (rc={self.proc.poll()})")
                return line

    def request(self, line, timeout):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.readline(timeout)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class TorchServerHost:
    """One helper process holding any number of torch TCPStore masters."""

    def __init__(self):
        self._p = _LineProcess(
            [NODNS, torch_python(), str(TOOLS / "torch_store_host.py")], "torch store host"
        )

    def new(self, backend):
        line = self._p.request(f"new {backend}", 60)
        if line is None:
            raise RuntimeError("torch store host did not answer")
        return int(line)

    def drop(self, port):
        self._p.request(f"close {port}", 30)

    def close(self):
        self._p.close()


class ClientWorker:
    """Runs scenarios with the real torch client in a separate process, under a deadline."""

    def __init__(self):
        self._p = None

    def _start(self):
        self._p = _LineProcess(
            [NODNS, torch_python(), str(TOOLS / "store_client_worker.py")], "torch client worker"
        )
        if self._p.readline(120) is None:
            raise RuntimeError("torch client worker did not start")

    def run(self, fn, timeout=30.0, **ctx):
        if self._p is None or self._p.proc.poll() is not None:
            self._start()
        req = {"file": os.path.abspath(fn.__code__.co_filename), "func": fn.__name__, "ctx": ctx}
        line = self._p.request(json.dumps(req), timeout)
        if line is None:
            self._p.proc.kill()
            self._p.proc.wait()
            self._p = None
            pytest.fail(f"scenario {fn.__name__} hung for more than {timeout}s", pytrace=False)
        out = json.loads(line)
        if out.get("skip"):
            pytest.skip(out["skip"])
        if not out["ok"]:
            pytest.fail(f"scenario {fn.__name__} failed in the torch client:\n{out['error']}",
                        pytrace=False)

    def close(self):
        if self._p is not None:
            self._p.close()


class Server:
    """A store under test on 127.0.0.1: `muster store`, or a torch master of either backend."""

    def __init__(self, kind, torch_host):
        self.kind = kind
        self.host = "127.0.0.1"
        self._muster = None
        self._torch_host = torch_host
        self.log = []
        if kind == "muster":
            self._muster = StoreProcess()
            self.port = self._muster.port
            # drain its logs: a full stderr pipe would stall the store, and a death is reported
            # with them
            proc = self._muster.proc
            threading.Thread(target=lambda: self.log.extend(proc.stderr), daemon=True).start()
        else:
            self.port = torch_host.new(kind.removeprefix("torch-"))

    def alive(self):
        return self._muster is None or self._muster.proc.poll() is None

    def death_note(self):
        rc = self._muster.proc.poll() if self._muster else None
        return f"{self.kind} exited with {rc}; its log:\n{''.join(self.log)[-4000:]}"

    def stop(self):
        if self._muster is not None:
            self._muster.stop()
        else:
            self._torch_host.drop(self.port)


@pytest.fixture(scope="session")
def torch_host():
    host = TorchServerHost()
    yield host
    host.close()


@pytest.fixture(scope="session")
def client_worker():
    worker = ClientWorker()
    yield worker
    worker.close()
