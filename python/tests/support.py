"""What the python/tests share: the package's folder, a fresh copy of the package per test, tiny
stand-ins for the modules muster hooks (written into a temp dir), and one fake agent.

The tests run with the standard library alone (`python3 -m unittest discover -s python/tests`):
no muster binary, no torch, no framework.
"""

import os
import shutil
import socket
import sys
import tempfile
import textwrap
import threading
import time
import unittest
import uuid

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "muster_launcher"
# The variables muster exports to its workers, which no test may inherit.
MUSTER_ENV = (
    "MUSTER_CHECKPOINT_SOCKET",
    "MUSTER_METRICS_PORT",
    "MUSTER_AUTO_STEP_REPORTS",
    "MUSTER_FRAMEWORK_CALLBACKS",
    "MUSTER_STACKS_DIR",
    "MUSTER_HOLD_FOREIGN_SIGNALS",
    "MUSTER_STOP_MARK",
)

if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)


def forget_package():
    """Drops every module of the package (and the old names, and the fake modules a test
    wrote) from sys.modules, and muster's waiting finders from the meta path, so the next import
    starts from scratch."""
    for name in list(sys.modules):
        if name.split(".")[0] in (PACKAGE, "muster_checkpoint", "muster_frameworks") or \
                name.split(".")[0] in FAKE_PACKAGES:
            del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith(PACKAGE)]


# The top-level names of the stand-ins `write_modules` writes (forgotten between tests).
FAKE_PACKAGES = {"torch", "transformers", "lightning", "pytorch_lightning", "prometheus_client",
                 "hooked_demo"}


class TestCase(unittest.TestCase):
    """A test with muster's variables unset, a fresh package, and a temp dir `self.tmp` that is
    on sys.path (for stand-in modules) and removed afterwards."""

    def setUp(self):
        saved = {k: os.environ.pop(k) for k in MUSTER_ENV if k in os.environ}
        self.addCleanup(os.environ.update, saved)
        for key in MUSTER_ENV:
            self.addCleanup(os.environ.pop, key, None)
        self.tmp = tempfile.mkdtemp(prefix="muster-pytest-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        sys.path.insert(0, self.tmp)
        self.addCleanup(sys.path.remove, self.tmp)
        forget_package()
        self.addCleanup(forget_package)

    def write_modules(self, files, root=None):
        """Writes {"pkg/mod.py": source} below `root` (self.tmp), making packages' folders."""
        root = root or self.tmp
        for relative, source in files.items():
            path = os.path.join(root, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(textwrap.dedent(source))
        return root


def package_dir(root):
    """Lays out the package below `root` as muster ships it: `sitecustomize.py`, the package, and
    the old names (the agent's own list is agent/src/python_files.rs)."""
    shutil.copytree(os.path.join(PYTHON_DIR, PACKAGE), os.path.join(root, PACKAGE),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("muster_checkpoint.py", "muster_frameworks.py"):
        shutil.copy(os.path.join(PYTHON_DIR, name), os.path.join(root, name))
    shutil.copy(os.path.join(PYTHON_DIR, "muster_sitecustomize.py"),
                os.path.join(root, "sitecustomize.py"))
    return root


class FakeAgent:
    """The agent's end of MUSTER_CHECKPOINT_SOCKET, speaking its line protocol
    (agent/src/checkpoint/local.rs): it accepts any number of connections, records every line
    each one sends (`lines(conn)`, as word lists), answers a `watch` connection with `interval
    <ms>`, and sends what a test tells it (`send`). `name` is the variable's value ("@..." an
    abstract socket)."""

    def __init__(self, interval_ms=0):
        self.interval_ms = interval_ms
        self.name = "@muster-pytest-%s" % uuid.uuid4().hex[:12]
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind("\0" + self.name[1:])
        self._server.listen(16)
        self._lock = threading.Condition()
        self.connections = []  # [(socket, [words, ...])]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self):
        self._closed = True
        self._server.close()
        with self._lock:
            for conn, _ in self.connections:
                conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _accept(self):
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            lines = []
            with self._lock:
                self.connections.append((conn, lines))
                self._lock.notify_all()
            threading.Thread(target=self._read, args=(conn, lines), daemon=True).start()

    def _read(self, conn, lines):
        buf = b""
        while True:
            try:
                data = conn.recv(4096)
            except OSError:
                return
            if not data:
                return
            buf += data
            *done, buf = buf.split(b"\n")
            with self._lock:
                for line in done:
                    words = line.decode("ascii", "replace").split()
                    if words and words[0] == "watch":
                        conn.sendall(b"interval %d\n" % self.interval_ms)
                    lines.append(words)
                self._lock.notify_all()

    def wait(self, predicate, timeout=5.0):
        """Waits until `predicate(connections)` is true; returns its value (fails the test after
        `timeout` s)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                value = predicate(self.connections)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("the fake agent waited in vain: %r"
                                         % [lines for _, lines in self.connections])
                self._lock.wait(left)

    def lines(self, index=0, until=None, timeout=5.0):
        """The lines of connection `index` so far, once it exists and `until(lines)` holds."""
        until = until or (lambda lines: True)
        found = self.wait(
            lambda c: len(c) > index and until(c[index][1]) and (list(c[index][1]),), timeout)
        return found[0]

    def send(self, line, index=0):
        self.wait(lambda c: len(c) > index)
        self.connections[index][0].sendall(line.encode("ascii") + b"\n")
