"""Rank 1 fails the way $HOW says (exit3, segv, raise); the other ranks wait to be stopped.

`raise` runs under torch's @record, which writes TORCHELASTIC_ERROR_FILE."""
import os
import signal
import sys
import time

HOW = os.environ["HOW"]
rank = int(os.environ["RANK"])


def main():
    if rank != 1:
        time.sleep(60)
        return
    time.sleep(0.2)
    if HOW == "exit3":
        sys.exit(3)
    if HOW == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if HOW == "raise":
        raise ValueError("rank 1 says boom")


if HOW == "raise":
    from torch.distributed.elastic.multiprocessing.errors import record

    main = record(main)

if __name__ == "__main__":
    main()
