"""A store client in its own container: waits for the host's DNS name, then uses the store directly
(TCPStore client) and through `init_process_group(env://)` with TORCHELASTIC_USE_AGENT_STORE, as a
worker of a muster-launched job does, and runs a gloo all-reduce with the other peers.

Writes its observations as JSON to --out; exits non-zero on any failure.
"""

import argparse
import json
import os
import socket
import time
from datetime import timedelta

parser = argparse.ArgumentParser()
parser.add_argument("--host", required=True)
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--world-size", type=int, required=True)
parser.add_argument("--dns-timeout", type=float, default=120)
parser.add_argument("--out", required=True)
args = parser.parse_args()

# 1. The host's headless name does not exist until its container does: retry until the deadline.
attempts = 0
deadline = time.monotonic() + args.dns_timeout
while True:
    attempts += 1
    try:
        infos = socket.getaddrinfo(args.host, args.port, socket.AF_INET, socket.SOCK_STREAM)
        resolved = infos[0][4][0]
        break
    except socket.gaierror as exc:
        if time.monotonic() > deadline:
            raise SystemExit(f"peer {args.rank}: {args.host} never resolved: {exc}")
        print(f"peer {args.rank}: {args.host} not resolvable yet ({exc.strerror})", flush=True)
        time.sleep(0.5)
print(f"peer {args.rank}: {args.host} -> {resolved} after {attempts} attempts", flush=True)

import torch  # noqa: E402  (after DNS: the import is slow and not what this measures)
import torch.distributed as dist  # noqa: E402

# 2. The store directly, as torch's client speaks it. The server may still be starting: the
# client retries connecting until its timeout.
store = dist.TCPStore(args.host, args.port, is_master=False, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
store.set(f"peer/{args.rank}", socket.gethostname())
arrivals = store.add("arrivals", 1)
store.wait([f"peer/{r}" for r in range(args.world_size)], timedelta(seconds=60))
peers = [store.get(f"peer/{r}").decode() for r in range(args.world_size)]

# 3. The worker path: init_process_group(env://) against the agent's store, then gloo traffic
# between containers.
os.environ.update(
    MASTER_ADDR=args.host,
    MASTER_PORT=str(args.port),
    RANK=str(args.rank),
    WORLD_SIZE=str(args.world_size),
    TORCHELASTIC_USE_AGENT_STORE="True",
)
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
t = torch.tensor([float(args.rank + 1)])
dist.all_reduce(t)
dist.barrier()
dist.destroy_process_group()

with open(args.out, "w") as f:
    json.dump({"rank": args.rank, "resolved": resolved, "dns_attempts": attempts,
               "arrivals": arrivals, "peers": peers, "all_reduce": t.item()}, f)
print(f"peer {args.rank}: all_reduce={t.item()}", flush=True)
