"""Writes its pid to $OUT_DIR/pid_<RANK>, then waits. $MODE: `plain` (default SIGTERM
behaviour), `graceful` (on SIGTERM write term_<RANK> with the time, exit 0), `ignore` (ignore
SIGTERM), `forward` (count SIGUSR1 in usr1_<RANK>, exit 0 on SIGTERM)."""
import os
import signal
import sys
import time

out = os.environ["OUT_DIR"]
rank = os.environ["RANK"]
mode = os.environ.get("MODE", "plain")


def note(name, text=""):
    with open(os.path.join(out, f"{name}_{rank}"), "a") as f:
        f.write(text)


def graceful(signum, frame):
    note("term", f"{time.time()}\n")
    sys.exit(0)


if mode in ("graceful", "forward"):
    signal.signal(signal.SIGTERM, graceful)
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "forward":
    signal.signal(signal.SIGUSR1, lambda s, f: note("usr1", "x"))
tmp = os.path.join(out, f".pid_{rank}")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.rename(tmp, os.path.join(out, f"pid_{rank}"))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
