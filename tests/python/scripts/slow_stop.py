"""A worker whose graceful stop takes a while: writes its pid to $OUT_DIR/pid_<RANK>; on SIGINT
or SIGTERM writes stopping_<RANK>, keeps working for $STOP_S seconds (default 1.5), writes
stopped_<RANK> and exits 0. A SIGKILL during that time leaves stopping_ without stopped_."""
import os
import signal
import sys
import time

out = os.environ["OUT_DIR"]
rank = os.environ["RANK"]
stop_s = float(os.environ.get("STOP_S", "1.5"))


def note(name, text=""):
    with open(os.path.join(out, f"{name}_{rank}"), "a") as f:
        f.write(text)


def stop(signum, frame):
    note("stopping", f"{signum} {time.time()}\n")
    # Further stop signals (the agent's, a second one) must not cut the save short either.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(stop_s)
    note("stopped", f"{time.time()}\n")
    sys.exit(0)


signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
tmp = os.path.join(out, f".pid_{rank}")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.rename(tmp, os.path.join(out, f"pid_{rank}"))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.05)
