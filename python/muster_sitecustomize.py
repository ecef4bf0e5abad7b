"""muster's start-up hook for worker processes, installed as `sitecustomize.py`.

muster writes this file as `sitecustomize.py` into its shared copy of its Python (one directory
per user and muster version; else its archive muster-python.zip in its private directory) that
it puts first on the workers' PYTHONPATH, so Python's `site` module runs it when every worker
interpreter starts. It
does one thing: a training script's `prometheus_client.start_http_server(PORT)` (also spelled
`start_wsgi_server`) on the port muster itself serves `/metrics` on (MUSTER_METRICS_PORT) becomes
a no-op with one log line, because muster already serves that process's metrics there, merged
from prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR) with `rank` and
`local_rank` labels. Every other port, and every other use of prometheus_client, is untouched.

It costs nothing until the script imports prometheus_client: it installs an import hook
(`muster_launcher.importhook`, the package muster writes next to this file) that patches
`prometheus_client.exposition` right after that module runs (before
`prometheus_client/__init__.py` copies `start_http_server` out of it), and removes itself.

A `sitecustomize` of the user's own (later on sys.path: in site-packages, the distribution's, or
another PYTHONPATH entry) still runs: this file looks it up past its own archive (or directory) and executes
it under the name `sitecustomize`, as if muster's were not there.

Under muster's checkpoint barrier (MUSTER_CHECKPOINT_SOCKET set) it also loads, each when the
script first imports a module it hooks (`_LAZY`), and runs its `install()`:
- muster's zero-code step reports (`muster_launcher.autoreport`): when the script imports torch,
  an optimizer step hook reports the rank's steps and liveness to the agent, for the hang watch
  and the step metrics (see that module);
- each framework integration (`muster_launcher.integrations`): adds muster's checkpoint callback
  to every Hugging Face or Lightning `Trainer` the script builds (docs/frameworks.md;
  MUSTER_FRAMEWORK_CALLBACKS=0 turns them off).
A rank that never imports torch or a trainer never reads them. Every rank pays this file at each
start, so it imports nothing it can avoid (the import hook alone): `_LAZY` and the switch's name
are written here, generated from the package (python/generate_sitecustomize.py), not read from it
at start.

muster's own files are compiled once, not at every start: they live in muster's shared copy
(one per user and muster version, which nothing else writes), so their bytecode is cached there
even where `PYTHONDONTWRITEBYTECODE` is set. That setting keeps Python from writing beside the
script's and the installed packages' files (often a read-only image); it still applies to them,
and to the chained `sitecustomize`. Compiling this file and the import hook cost 2-5 ms of every
rank's start.

Standard library only; outside muster (MUSTER_METRICS_PORT and MUSTER_CHECKPOINT_SOCKET unset)
it only chains.
"""

import os
import sys

_PORT_ENV = "MUSTER_METRICS_PORT"
_TARGET = "prometheus_client.exposition"


def _muster_port():
    try:
        port = int(os.environ.get(_PORT_ENV, ""))
    except ValueError:
        return None
    return port if 0 < port < 65536 else None


class _NoServer:
    """Stands in for the WSGI server start_http_server returns (prometheus_client >= 0.20)."""

    def __init__(self, port, addr):
        self.server_address = (addr, port)

    def shutdown(self):
        pass

    def server_close(self):
        pass


def _patch(module, port):
    original = getattr(module, "start_http_server", None)
    if original is None:
        return
    returns_pair = getattr(original, "__annotations__", {}).get("return") is not None
    logged = []

    def start_http_server(*args, **kwargs):
        requested = args[0] if args else kwargs.get("port")
        try:
            same_port = int(requested) == port
        except (TypeError, ValueError):
            same_port = False
        if not same_port:
            return original(*args, **kwargs)
        if not logged:
            logged.append(True)
            print(
                f"muster: start_http_server({requested}) skipped: muster serves this process's "
                f"metrics on port {port} at /metrics (with rank and local_rank labels)",
                file=sys.stderr,
                flush=True,
            )
        if not returns_pair:
            return None
        import threading

        thread = threading.Thread(target=lambda: None, name="muster-no-metrics-server", daemon=True)
        thread.start()
        addr = args[1] if len(args) > 1 else kwargs.get("addr", "0.0.0.0")
        return _NoServer(port, addr), thread

    start_http_server.__wrapped__ = original
    start_http_server.__doc__ = original.__doc__
    module.start_http_server = start_http_server
    if getattr(module, "start_wsgi_server", None) is original:
        module.start_wsgi_server = start_http_server


def _patch_failed(module, err):
    print(f"muster: cannot patch start_http_server: {err!r}", file=sys.stderr, flush=True)


def _install():
    port = _muster_port()
    if port is None:
        return
    try:
        from muster_launcher.importhook import after_import
    except ImportError as err:  # never skip the user's sitecustomize over this
        _patch_failed(None, err)
        return
    after_import([_TARGET], lambda module: _patch(module, port), _patch_failed)


# The variable that switches them on (muster_launcher.channel's), and the modules whose `install()`
# runs when the script first imports one of the modules they hook: (module, what the one line an
# error prints calls it, the modules it hooks).
# BEGIN generated by python/generate_sitecustomize.py from muster_launcher.integrations.INTEGRATIONS
_SOCKET_ENV = "MUSTER_CHECKPOINT_SOCKET"
_LAZY = (
    (
        "muster_launcher.integrations.transformers",
        "framework callbacks",
        (
            "transformers.trainer",
        ),
    ),
    (
        "muster_launcher.integrations.lightning",
        "framework callbacks",
        (
            "lightning.pytorch.trainer.trainer",
            "pytorch_lightning.trainer.trainer",
        ),
    ),
    (
        "muster_launcher.autoreport",
        "zero-code step reports",
        (
            "torch.optim.optimizer",
            "torch.distributed.distributed_c10d",
            "torch.utils.data.dataloader",
        ),
    ),
)
# END generated


def _install_lazily():
    """Each `_LAZY` module's `install()`, just before the script first imports a module it hooks,
    under muster's checkpoint barrier only."""
    if not os.environ.get(_SOCKET_ENV):
        return
    try:
        from muster_launcher.importhook import before_first_import
    except ImportError:  # no package beside this file: nothing to install
        return
    for name, what, hooked in _LAZY:
        before_first_import(hooked, _waker(name, what))


def _waker(name, what):
    def wake():
        try:
            __import__(name)
        except ImportError:
            return
        try:
            sys.modules[name].install()
        except Exception as err:  # never break the script's import over this
            print(f"muster: {what} off: {err!r}", file=sys.stderr, flush=True)

    return wake


def _import_machinery():
    """PathFinder and module_from_spec without importing `importlib.util`, which imports
    contextlib and more (several milliseconds of every rank's start): the interpreter's own
    frozen importlib, already loaded, has both."""
    try:
        from _frozen_importlib import module_from_spec
        from _frozen_importlib_external import PathFinder
    except ImportError:  # not CPython
        from importlib.machinery import PathFinder
        from importlib.util import module_from_spec
    return PathFinder, module_from_spec


def _own_bytecode_cached(here):
    """Lets Python cache the bytecode of muster's modules imported while this runs, and writes
    this file's own once (the import that ran it could not: `PYTHONDONTWRITEBYTECODE`); returns
    the script's setting, to put back. Only in muster's own directory: never in an archive, nor
    under a `PYTHONPYCACHEPREFIX` of the user's."""
    dont_write = sys.dont_write_bytecode
    cached = globals().get("__cached__")
    if not dont_write or not cached or not cached.startswith(here + os.sep):
        return dont_write
    sys.dont_write_bytecode = False
    if not os.path.exists(cached):
        try:
            from _frozen_importlib_external import SourceFileLoader

            SourceFileLoader(__name__, __file__).get_code(__name__)
        except Exception:  # noqa: BLE001 - a cache that cannot be written is only slower
            pass
    return dont_write


def _chain(here):
    """Runs the next `sitecustomize` on sys.path, the one this file shadows, if any."""
    path_finder, module_from_spec = _import_machinery()
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = path_finder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_HERE = os.path.dirname(os.path.abspath(__file__))
_SCRIPTS_SETTING = _own_bytecode_cached(_HERE)
try:
    _install()
    _install_lazily()
finally:
    sys.dont_write_bytecode = _SCRIPTS_SETTING
_chain(_HERE)
