"""Prints, as JSON, every zombie (state Z) visible in this PID namespace: pid, ppid, name."""

import json
import os

zombies = []
for entry in os.listdir("/proc"):
    if not entry.isdigit():
        continue
    try:
        with open(f"/proc/{entry}/stat") as f:
            stat = f.read()
    except OSError:
        continue  # exited (and was reaped) while we looked
    # The name is in parentheses and may contain spaces; the fields after it are fixed.
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
    if state == "Z":
        zombies.append({"pid": int(entry), "ppid": int(ppid), "name": name})
print(json.dumps(zombies))
