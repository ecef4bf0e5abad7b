"""A rank that leaves helpers behind, as data loaders, compile servers and profilers do, each
one escaping the rank's session in its own way; then it fails (or waits for a file, then fails).

Environment: OUT_DIR (where to report), TOKEN (marks the helpers' command lines, so the test can
find them in /proc), TORCHELASTIC_RESTART_COUNT (set by muster), STRAY_RANK_WAITS (attempts that
wait for OUT_DIR/finish before failing, comma-separated).

Each helper is `python -c <sleep> strays-<TOKEN>-a<attempt>-<kind>`:
- setsid:     started through the `setsid` command (new session; `os.setsid` in the child where
              the image has no such command);
- newsession: `Popen(start_new_session=True)`, and it ignores SIGTERM (so it needs SIGKILL);
- daemon:     a classic double fork with setsid in between: its parent exits at once, so it is
              re-parented to muster (the subreaper) before muster could have seen it.
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

out = Path(os.environ["OUT_DIR"])
token = os.environ["TOKEN"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
# Each helper marks itself up (OUT_DIR/up-<its mark>) only once its signal disposition is set: a
# helper still starting Python when the attempt is stopped would die of a SIGTERM it means to
# ignore, and the test would count one SIGKILL too few.
SLEEP = ("import os, signal, sys, time\n"
         "if 'newsession' in sys.argv[1]: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "open(os.path.join(os.environ['OUT_DIR'], 'up-' + sys.argv[1]), 'w').close()\n"
         "time.sleep(1000)")


def helper(kind):
    return [sys.executable, "-c", SLEEP, f"strays-{token}-a{attempt}-{kind}"]


if shutil.which("setsid"):
    subprocess.Popen(["setsid", *helper("setsid")])
else:  # a minimal image without util-linux: what the command does
    subprocess.Popen(helper("setsid"), preexec_fn=os.setsid)
subprocess.Popen(helper("newsession"), start_new_session=True)
middle = os.fork()
if middle == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, helper("daemon"))
    os._exit(0)
os.waitpid(middle, 0)

# Report once every helper runs with its signal disposition set.
def started():
    return sum(1 for f in out.glob(f"up-strays-{token}-a{attempt}-*")) >= 3

deadline = time.monotonic() + 30
while not started() and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"ready-{attempt}").write_text("")
if attempt in os.environ.get("STRAY_RANK_WAITS", "").split(","):
    while not (out / "finish").exists():
        time.sleep(0.05)
sys.exit(3)
