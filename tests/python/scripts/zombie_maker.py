"""Orphans short-lived grandchildren (double fork; some leave the worker's session with setsid,
like daemons do). Rank 0 then waits (up to 10 s) until every grandchild has exited and no zombie
is left in this PID namespace, and prints `zombies=N` with what is left at that point: 0 when
PID 1 reaps orphans, N > 0 under a launcher that does not."""
import os
import time


def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None  # gone: reaped


def orphan_grandchild(daemon, w):
    pid = os.fork()
    if pid == 0:
        g = os.fork()
        if g == 0:
            if daemon:
                os.setsid()
            time.sleep(0.1)
            os._exit(0)
        os.write(w, f"{g}\n".encode())
        os._exit(0)
    os.waitpid(pid, 0)


def zombies():
    return [e for e in os.listdir("/proc") if e.isdigit() and state(e) == "Z"]


r, w = os.pipe()
for i in range(4):
    orphan_grandchild(daemon=i % 2 == 1, w=w)
os.close(w)
grandchildren = [int(x) for x in os.read(r, 4096).split()]
if os.environ["RANK"] == "0":
    # The count printed is the one the loop last saw, not a fresh one: rank 1 exits meanwhile and is
    # a zombie for the instant before the agent waits for it, which a second look could catch.
    deadline = time.monotonic() + 10
    while True:
        exited = all(state(g) in (None, "Z") for g in grandchildren)
        left = zombies()
        if (exited and not left) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    print(f"pid1={os.getppid() == 1} grandchildren={len(grandchildren)} zombies={len(left)}",
          flush=True)
else:
    time.sleep(0.5)
