#!/usr/bin/env python3
"""Runs test scenarios that use the real torch TCPStore client, in a process of its own.

The pytest process never holds a torch client: a client blocked on a misbehaving server cannot be
interrupted (it sits in C++ recv), so pytest kills this worker on a deadline instead and the
failure stays confined to one test. Protocol: one JSON object per line on stdin,
  {"file": "/abs/test_x.py", "func": "scenario_name", "ctx": {...}}
answered by one JSON line on the original stdout: {"ok": true}, {"ok": false, "error": "..."}, or
{"ok": false, "skip": "..."} when the scenario raised an exception carrying `skip_reason` (a call
that this torch version's client does not have: scripts/compat runs older versions).
Everything the scenario prints goes to stderr.
"""

import importlib.util
import json
import os
import sys
import traceback
from types import SimpleNamespace

_modules = {}


def load(path):
    if path not in _modules:
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location(
            "scenarios_" + os.path.basename(path)[:-3], path
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _modules[path] = mod
    return _modules[path]


def main() -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch.distributed  # noqa: F401  (pay the import once, before the first scenario)

    print("ready", file=reply, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            fn = getattr(load(req["file"]), req["func"])
            fn(SimpleNamespace(**req["ctx"]))
            out = {"ok": True}
        except BaseException as e:  # noqa: BLE001 - every failure goes back to pytest
            reason = getattr(e, "skip_reason", None)
            out = ({"ok": False, "skip": reason} if reason
                   else {"ok": False, "error": traceback.format_exc()})
        print(json.dumps(out), file=reply, flush=True)


if __name__ == "__main__":
    main()
