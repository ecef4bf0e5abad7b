"""Orphans short-lived grandchildren (double fork; some leave the worker's session with setsid,
like daemons do), then, as rank 0, counts zombies in this PID namespace once the grandchildren
are long dead, and prints `zombies=N`."""
import os
import time


def orphan_grandchild(daemon):
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            if daemon:
                os.setsid()
            time.sleep(0.1)
            os._exit(0)
        os._exit(0)
    os.waitpid(pid, 0)


def zombies():
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            found.append(entry)
    return found


for i in range(4):
    orphan_grandchild(daemon=i % 2 == 1)
time.sleep(0.8)
if os.environ["RANK"] == "0":
    print(f"pid1={os.getppid() == 1} zombies={len(zombies())}", flush=True)
