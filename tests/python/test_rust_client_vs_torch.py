"""muster's Rust client (`rendezvous::store::client::Client`) against real torch TCPStore servers
(libuv and classic backends) and against servers that misbehave.

The client is driven by `rendezvous/examples/client_probe.rs`. `scripts/test` builds the workspace
without examples, so this suite builds the probe itself (`cargo build --release -p rendezvous
--example client_probe`, quick once the release build of the workspace exists); set
MUSTER_CLIENT_PROBE to use a prebuilt one.
"""

import os
import socket
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from conftest import REPO, torch_version
from store_harness import ClientWorker, Server, client_worker, torch_host  # noqa: F401


@pytest.fixture(scope="session")
def probe():
    given = os.environ.get("MUSTER_CLIENT_PROBE")
    if given:
        return given
    build = subprocess.run(
        ["cargo", "build", "--release", "-p", "rendezvous", "--example", "client_probe"],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return str(REPO / "target" / "release" / "examples" / "client_probe")


def _probe(probe, addr, *args, timeout=60):
    out = subprocess.run([probe, addr, *args], capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def scenario_torch_reads_what_rust_wrote(ctx):
    import datetime

    import torch.distributed as dist

    c = dist.TCPStore(ctx.host, ctx.port, None, False, datetime.timedelta(seconds=5),
                      wait_for_workers=False, use_libuv=True)
    assert c.get("from-rust") == b"hello torch"
    assert c.get("rust/n") == b"0"
    assert c.get("rust/cs") == b"newer"
    assert c.multi_get(["rust/m2", "rust/m3"]) == [b"", b"c"]
    assert "rust/k" in c.list_keys()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("backend", ["torch-libuv", "torch-classic"])
def test_rust_client_against_torch_server(probe, torch_host, client_worker, backend):  # noqa: F811
    if torch_version() < (2, 5):
        # muster's agents only ever talk to muster's own store; this checks the client against a
        # second server implementation, which before 2.5 lacks the PING of the handshake.
        pytest.skip("torch servers before 2.5 do not know the handshake's PING (PR #129261)")
    server = Server(backend, torch_host)
    try:
        extra = [] if backend == "torch-libuv" else ["--no-queues"]  # classic has no queues
        rc, out = _probe(probe, f"127.0.0.1:{server.port}", "all", *extra)
        assert rc == 0 and "ok all" in out, out
        client_worker.run(scenario_torch_reads_what_rust_wrote, host="127.0.0.1",
                          port=server.port)
    finally:
        server.stop()


class SilentServer:
    """Accepts connections and never answers; with `answer_ping`, echoes the handshake's PING
    and then goes mute."""

    def __init__(self, answer_ping):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.answer_ping = answer_ping
        self.conns = []
        self.hellos = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.answer_ping:
                hello = b""
                while len(hello) < 10:
                    chunk = conn.recv(10 - len(hello))
                    if not chunk:
                        break
                    hello += chunk
                self.hellos.append(hello)
                if len(hello) == 10 and hello[0] == 0 and hello[5] == 13:
                    conn.sendall(hello[6:10])

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["silent", "mute-after-ping"])
def test_rust_client_read_timeouts(probe, mode):
    server = SilentServer(answer_ping=mode == "mute-after-ping")
    try:
        rc, out = _probe(probe, f"127.0.0.1:{server.port}", mode, timeout=30)
        assert rc == 0, out
        assert "FAIL" not in out, out
        if mode == "mute-after-ping":
            # torch's handshake: VALIDATE(magic) + PING(nonce), 10 bytes in one go
            assert server.hellos and all(
                h[:5] == b"\x00" + struct.pack("<I", 0x3C85F7CE) and h[5] == 13
                for h in server.hellos
            ), server.hellos
    finally:
        server.close()

