"""Fails on the first attempt, succeeds on the next; proves each attempt gets a fresh store.

Attempt 0: init gloo, rank 0 leaves a key in the store, barrier, then rank 1 exits 1.
Attempt 1: the key must be gone and MASTER_PORT must differ; all-reduce must work.
Each rank appends one JSON line per attempt to $OUT_DIR/attempts.jsonl."""
import json
import os
import sys

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
store = dist.distributed_c10d._get_default_store()
leftover = store.check(["left_by_attempt_0"])
if attempt == 0 and rank == 0:
    store.set("left_by_attempt_0", "stale")
dist.barrier()
t = torch.tensor([1.0])
dist.all_reduce(t)
with open(os.path.join(os.environ["OUT_DIR"], "attempts.jsonl"), "a") as f:
    f.write(json.dumps({"attempt": attempt, "rank": rank, "port": os.environ["MASTER_PORT"],
                        "leftover": leftover, "sum": t.item()}) + "\n")
if attempt == 0 and rank == 1:
    sys.exit(1)
dist.destroy_process_group()
