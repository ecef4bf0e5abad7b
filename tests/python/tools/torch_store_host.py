#!/usr/bin/env python3
"""Hosts real torch TCPStore servers (masters) for the compatibility suites, in its own process.

torch's client blocks in C++ on a silent server and a server in the test process would share the
GIL with blocked clients, so the servers live here. Protocol on stdin/stdout, one line each:
  new libuv|classic   -> prints the port of a fresh, empty TCPStore master on 127.0.0.1
  close PORT          -> drops that server, prints "closed"
  EOF                 -> exit
The masters pass no world_size, so they add no hidden `init/` key: a fresh server holds no keys.
"""

import datetime
import sys

import torch.distributed as dist


def main() -> None:
    servers = {}
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "new":
            use_libuv = words[1] == "libuv"
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                None,
                True,
                datetime.timedelta(seconds=600),
                wait_for_workers=False,
                use_libuv=use_libuv,
            )
            if store.libuvBackend != use_libuv:
                raise SystemExit(f"asked for libuv={use_libuv}, got {store.libuvBackend}")
            servers[store.port] = store
            print(store.port, flush=True)
        elif words[0] == "close":
            servers.pop(int(words[1]), None)
            print("closed", flush=True)
        else:
            raise SystemExit(f"unknown command {line!r}")


if __name__ == "__main__":
    main()
