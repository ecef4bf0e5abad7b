"""A rank that allocates memory until the kernel's OOM killer stops it (run under a container
memory limit, see test_containers.py's OOM test).

    allocate.py SHARED_DIR [--cap-mib N]

Attempt 0 allocates at once. A later attempt first writes `SHARED_DIR/waiting-a<attempt>` and
waits for `SHARED_DIR/release`, so the test can read the agent's /metrics between the two kills,
then allocates too. Every chunk is written to (a repeated byte, not calloc'd zero pages the kernel
never backs), so it is charged to the container's memory cgroup. Past `--cap-mib` without being
killed, the rank exits 3: a limit that did not hold fails the test instead of filling the host.
"""

import argparse
import os
import sys
import time
from pathlib import Path

CHUNK = 16 << 20

parser = argparse.ArgumentParser()
parser.add_argument("shared", type=Path)
parser.add_argument("--cap-mib", type=int, default=2048)
args = parser.parse_args()

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt > 0:
    (args.shared / f"waiting-a{attempt}").touch()
    while not (args.shared / "release").exists():
        time.sleep(0.1)

chunks = []
while len(chunks) * CHUNK < args.cap_mib << 20:
    chunks.append(b"\x01" * CHUNK)
    print(f"attempt {attempt}: {len(chunks) * CHUNK >> 20} MiB allocated", flush=True)
print(f"attempt {attempt}: {args.cap_mib} MiB allocated and not killed", flush=True)
sys.exit(3)
