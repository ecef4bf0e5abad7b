"""Reference store host: PyTorch's own TCPStore server, for comparing with `muster store`.

Runs as PID 1 of its container, so it must handle SIGTERM itself (PID 1 gets no default action).
"""

import argparse
import signal
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
args = parser.parse_args()

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
store = dist.TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
print(f"torch store listening on 0.0.0.0:{args.port}", flush=True)
stop.wait(600)
sys.exit(0)
