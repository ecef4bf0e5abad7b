"""What muster's `sitecustomize` costs every rank at start, and that the lazy loading keeps what
the modules it loads do (python/muster_sitecustomize.py, python/muster_launcher/importhook.py).

Every rank of every launch runs muster's sitecustomize, so it loads the zero-code reporter
(muster_launcher.autoreport) and the framework integrations (muster_launcher.integrations) only
when the script imports a module they hook: a rank that imports neither torch nor a trainer never
reads them. These
tests check, in a bare interpreter with the files laid out as muster ships them (one directory
first on PYTHONPATH):
- nothing but the import hook (and its package) is loaded at start, and `importlib.util` is not
  imported;
- `import torch` loads the reporter, which hooks the optimizer step and wraps
  init_process_group exactly as when it was installed at start;
- a Checkpointer that connects before torch is imported still stands the reporter down;
- sitecustomize's list of the modules each one hooks agrees with the modules' own (it is
  generated from them: python/generate_sitecustomize.py).
Timing is the launch bench's (scripts/bench.d/20-launch), not asserted here.
"""

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
import zipfile

from conftest import REPO, torch_python

PYTHON = REPO / "python"
# What muster writes besides `sitecustomize.py` (agent/src/python_files.rs).
SHIPPED = ["muster_launcher", "muster_checkpoint.py", "muster_frameworks.py"]
START = ["muster_launcher", "muster_launcher.importhook"]

PROBE = r'''
import json, os, sys
def loaded():
    return sorted(m for m in sys.modules if m.startswith("muster_") or m == "importlib.util")
out = {"start": loaded()}
if os.environ.get("CONNECT_FIRST"):
    import muster_checkpoint
    out["active"] = muster_checkpoint.Checkpointer().active
    out["after_connect"] = loaded()
if os.environ.get("IMPORT_TORCH"):
    import torch
    import torch.distributed as dist
    from muster_launcher import autoreport
    out["after_torch"] = loaded()
    out["hooked"] = autoreport._hooked
    out["standing_down"] = autoreport._standing_down
    out["init_wrapped"] = bool(getattr(dist.init_process_group, "_muster_wrapped", False))
print("PROBE " + json.dumps(out), flush=True)
'''


def shipped_archive(tmp_path):
    """The helper's archive as muster writes it (muster-python.zip, stored entries): the modules
    and `sitecustomize.py`, imported through zipimport."""
    archive = tmp_path / "muster-python.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name in SHIPPED:
            if (PYTHON / name).is_dir():
                for path in sorted((PYTHON / name).rglob("*.py")):
                    z.write(path, path.relative_to(PYTHON).as_posix())
            else:
                z.write(PYTHON / name, name)
        z.write(PYTHON / "muster_sitecustomize.py", "sitecustomize.py")
    return archive


def probe(tmp_path, socket_name, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MUSTER_", "PYTHON"))}
    full.update(PYTHONPATH=str(shipped_archive(tmp_path)), MUSTER_CHECKPOINT_SOCKET=socket_name,
                MUSTER_METRICS_PORT="8000", RANK="0", LOCAL_RANK="0", **env)
    p = subprocess.run([torch_python(), "-c", PROBE], env=full, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    line = [l for l in p.stdout.splitlines() if l.startswith("PROBE ")]
    assert line, (p.stdout, p.stderr)
    return json.loads(line[0][len("PROBE "):]), p.stderr


def test_a_rank_without_torch_loads_only_the_hook(tmp_path):
    out, err = probe(tmp_path, "@muster-test-none")
    assert out["start"] == START, out
    assert "muster:" not in err, err


def test_importing_torch_loads_the_reporter_and_hooks_as_at_start(tmp_path):
    out, err = probe(tmp_path, "@muster-test-none", IMPORT_TORCH="1")
    assert out["start"] == START, out
    assert "muster_launcher.autoreport" in out["after_torch"], out
    # No trainer imported: the framework callbacks stay unread.
    assert "muster_launcher.integrations" not in out["after_torch"], out
    assert out["hooked"] is True and out["init_wrapped"] is True, out
    assert out["standing_down"] is False, out
    assert "muster:" not in err, err


def test_a_helper_connected_before_torch_still_stands_the_reporter_down(tmp_path):
    name = f"muster-test-{uuid.uuid4().hex[:12]}"
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.bind("\0" + name)
    agent.listen(4)
    try:
        out, err = probe(tmp_path, "@" + name, CONNECT_FIRST="1", IMPORT_TORCH="1")
    finally:
        agent.close()
    assert out["active"] is True, out
    assert out["standing_down"] is True, out
    assert out["hooked"] is False, out
    assert "muster:" not in err, err


def test_the_lazy_list_names_every_module_each_one_hooks():
    tree = ast.parse((PYTHON / "muster_sitecustomize.py").read_text())
    lazy = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "_LAZY" for t in n.targets))
    hooked = {name: set(targets) for name, _, targets in lazy}
    check = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
             "from muster_launcher import autoreport, integrations; "
             "table = {m.__name__: list(m.HOOKED) for m in integrations.modules()}; "
             "table[autoreport.__name__] = list(autoreport.HOOKED); print(json.dumps(table))")
    p = subprocess.run([sys.executable, "-c", check, str(PYTHON)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert hooked == {name: set(targets) for name, targets in json.loads(p.stdout).items()}
