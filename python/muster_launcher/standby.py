"""A warm standby interpreter: a Python that has already imported what a rank imports, waiting to
run the rank's script when the agent restarts the group (`--warm-restart on`, issue #41).

**Recording.** At a rank's first step (`autoreport` or the `Checkpointer`), `record_modules()`
writes the *installed* modules the rank imported, top-level and submodules (standard library and site-packages;
never the script's own modules, nothing under the script's directory or the working directory,
nothing of muster's) as one JSON list to the file the agent names in MUSTER_WARM_MODULES. A file,
not the channel: the agent reads it when it starts the standby, after the step, and the channel's
line protocol stays as it is.

**Waiting.** The agent starts `python -u -c 'import sys; del sys.path[0]; from muster_launcher.standby
import main; main()'` (`COMMAND`; the working directory `-c` puts first on sys.path goes first, so a
file of the user's there never shadows an installed module)
with the rank slot's environment (less what changes per attempt), the socket's descriptor in
MUSTER_STANDBY_FD and the module list's path in MUSTER_STANDBY_MODULES. The standby imports the
listed modules on a helper thread whose nice value is raised (per-thread on Linux: the main
thread, which later runs the script, keeps the priority a cold rank has, which an unprivileged
process could not take back), joins it, says `ready` (one JSON line), and blocks on the socket.
It starts no thread of its own that outlives the imports, makes no CUDA call, opens no store.
A library may start a pool of native threads when it loads (numpy's OpenBLAS does, unless
OMP_NUM_THREADS or OPENBLAS_NUM_THREADS is 1: every one-rank-per-node job): a cold rank has
that pool too, but the standby's would have the import thread's lower priority for good. So a
standby whose imports left native threads at that priority starts itself again (`exec`, same
pid, socket and environment; once), imports the modules that started them first, on the main
thread at the rank's priority, and the rest as before: the pool it then keeps is the one a cold
rank would have.
While it waits its OOM score is 1000 (`/proc/self/oom_score_adj`): under a memory limit the
kernel kills a standby before any rank; the handover puts back the score a cold rank has.

**Handover.** The agent sends one JSON line: `args` (the interpreter's arguments, as a cold start
gets them: `-u script.py ARGS` or `-u -m module ARGS`), `env` (the rank's whole environment) and
`cwd`. The standby refuses (one JSON line with the reason, then exits 0; the agent starts the
rank cold) when a variable read at start or import differs (`IMPORT_TIME_VARIABLES`, every
`PYTHON*`), when the imports left a thread running that a cold rank would not have (a
Python thread, or a native one at another priority than the main thread's) or initialised CUDA, when it cannot put back
its OOM score, or when it cannot parse the arguments.
Otherwise it says `accepted`, closes the socket, and makes the process look like a cold
`python -u`: `os.environ` replaced, `os.chdir`, `sys.argv`, `sys.orig_argv`, `sys.path[0]`,
signal dispositions as Python starts with them, random state fresh (`random` and numpy from
os.urandom; torch's CPU generator as a cold process has it: from fresh entropy where torch
draws one per process (2.x), else its fixed default seed), then the script as
`__main__` through runpy. An uncaught exception prints through `sys.excepthook` without the
standby's frames and exits 1; `SystemExit` behaves as in Python.

Standard library only at module level.
"""

import json
import os
import sys

COMMAND = "import sys; del sys.path[0]; from muster_launcher.standby import main; main()"
"""What the agent runs with `python -u -c`."""
MODULES_ENV = "MUSTER_WARM_MODULES"
"""Where a rank writes its module list at its first step (set by the agent)."""
FD_ENV = "MUSTER_STANDBY_FD"
"""The standby's end of the agent's socket."""
LIST_ENV = "MUSTER_STANDBY_MODULES"
"""The module list the standby imports."""
NICE_ENV = "MUSTER_STANDBY_NICE"
"""How much the import thread lowers its priority (default 10)."""
PRIME_ENV = "MUSTER_STANDBY_PRIME"
"""Set by a standby for its own second start: the modules whose import started native threads,
imported first on the main thread, at the rank's priority."""

IMPORT_TIME_VARIABLES = (
    # Thread pools sized when their library loads (libgomp, MKL, OpenBLAS).
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "KMP_AFFINITY",
    # Which GPUs the process sees is fixed once the CUDA libraries load.
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "PYTORCH_CUDA_ALLOC_CONF",
    # The dynamic loader reads these when the process starts.
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    # muster's start-up hook reads these when the interpreter starts.
    "MUSTER_CHECKPOINT_SOCKET",
    "MUSTER_METRICS_PORT",
    "MUSTER_AUTO_STEP_REPORTS",
    "MUSTER_FRAMEWORK_CALLBACKS",
)
"""Variables read when the interpreter or a library starts: a standby started with other values
than the rank's cannot take the rank. Every `PYTHON*` variable counts too."""

NOT_PRELOADED = ("prometheus_client",)
"""Modules the standby leaves to the script: prometheus_client picks its value class from
PROMETHEUS_MULTIPROC_DIR when it is imported, and muster gives each rank and attempt its own."""

_OWN = ("muster_launcher", "muster_checkpoint", "muster_frameworks", "sitecustomize",
        "usercustomize", "muster_sitecustomize", "__main__")


# -- recording, in the rank ----------------------------------------------------------------------


def _prefix(folder):
    """`folder` resolved, with a trailing separator; `None` for no folder."""
    return os.path.join(os.path.realpath(folder), "") if folder else None


def _under(real_path, prefix):
    return prefix is not None and real_path.startswith(prefix)


def _installed_roots():
    """The folders of the standard library and of site-packages."""
    import sysconfig

    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            roots.add(sysconfig.get_paths()[key])
        except KeyError:
            pass
    try:
        import site

        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except Exception:  # a virtualenv's old site module lacks these
        pass
    roots.update(p for p in sys.path if p and os.path.basename(p) in ("site-packages",
                                                                     "dist-packages"))
    return [r for r in roots if r]


def installed_modules(modules=None, script_dir=None, cwd=None, roots=None):
    """The installed modules among `modules` (default sys.modules), in import order: the
    top-level ones and their submodules. Submodules count: a package that loads lazily
    (transformers' models, torch's optional parts) spends more on the submodules the rank went on
    to use than on its own import (transformers 5: ~3 s of each for a tiny GPT-2)."""
    modules = sys.modules if modules is None else modules
    script_dir = script_dir if script_dir is not None else (sys.path[0] if sys.path else "")
    cwd = cwd if cwd is not None else os.getcwd()
    roots = _installed_roots() if roots is None else roots
    # Resolved once: a rank that imported transformers has thousands of modules.
    script_dir, cwd = _prefix(script_dir), _prefix(cwd)
    roots = [_prefix(r) for r in roots]
    found = []
    tops = set()
    real_folders = {}
    for name, module in list(modules.items()):
        top = name.split(".", 1)[0]
        if top in _OWN or module is None:
            continue
        if "." in name and top not in tops:
            continue  # a submodule of something not installed (the script's own package)
        path = getattr(module, "__file__", None)
        if not path:
            paths = list(getattr(module, "__path__", []) or [])
            path = paths[0] if paths else None
        if not path or not os.path.isabs(path):
            continue  # built in, frozen, or namespace without a place: nothing to gain
        if ".zip" + os.sep in path:
            continue  # muster's archive, or a user's: not an installed package
        folder = os.path.dirname(path)
        if folder not in real_folders:
            real_folders[folder] = os.path.realpath(folder)
        path = os.path.join(real_folders[folder], os.path.basename(path))
        if _under(path, script_dir) or _under(path, cwd):
            continue
        if any(_under(path, root) for root in roots):
            found.append(name)
            if "." not in name:
                tops.add(name)
    return found


def record_modules():
    """Writes this rank's installed modules to MUSTER_WARM_MODULES, once; never raises."""
    global _recorded
    if _recorded:
        return
    target = os.environ.get(MODULES_ENV)
    if not target:
        return
    _recorded = True
    try:
        temp = "%s.%d.tmp" % (target, os.getpid())
        with open(temp, "w") as out:
            json.dump(installed_modules(), out)
        os.replace(temp, target)
    except Exception:
        pass


_recorded = False


# -- the standby -----------------------------------------------------------------------------------


def _tasks():
    """This process's thread ids; None where /proc does not say."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return None


def _thread_count():
    """How many threads this process has, from the kernel's own counter (`Threads:` in
    /proc/self/status); None where /proc does not say. A listing of /proc/self/task stops early
    at a thread that is leaving (it names that one, and none after it): only this count tells a
    listing taken meanwhile from a whole one."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _nice(tid):
    """Thread `tid`'s nice value (field 19 of its stat; the name, field 2, may hold spaces and
    parentheses); None when it is gone or unreadable."""
    try:
        with open("/proc/self/task/%d/stat" % tid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])
    except (OSError, ValueError, IndexError):
        return None


def stray_threads(wait_s=1.0):
    """The threads a cold rank would not have after the same imports: Python threads besides
    the main one (they run code), and native threads at another priority than the main thread's
    (started on the import thread, whose lower priority they keep). A library's pool at the
    rank's priority (OpenBLAS's, once numpy loaded on the main thread) is what a cold rank has
    too and is not counted. Returns (python, native) thread ids; a joined thread may take a
    moment to leave the kernel's list, so strays are looked at again for up to `wait_s`, and
    "none" is believed only of a listing that holds every thread (`_thread_count`) and no thread
    that was leaving: one that stopped at a leaving thread missed the threads after it."""
    import threading
    import time

    deadline = time.monotonic() + wait_s
    main = os.getpid()
    while True:
        tasks = _tasks()
        if tasks is None:
            return list(range(threading.active_count() - 1)), []
        count = _thread_count()
        python = {t.native_id for t in threading.enumerate()} - {main}
        main_nice = _nice(main)
        nices = {t: _nice(t) for t in tasks if t != main}
        native = [t for t, nice in nices.items()
                  if t not in python and nice not in (None, main_nice)]
        python = [t for t in python if t in tasks]
        whole = (count is None or count == len(tasks)) and None not in nices.values()
        if (whole and not python and not native) or time.monotonic() >= deadline:
            return python, native
        time.sleep(0.005)


def import_all(names, nice=10):
    """Imports `names` on a helper thread at lower priority; returns the top-level names that
    failed (a submodule that fails alone is left to the script, which imports it again if it
    needs it: it only loses its head start) and the names whose import started native threads.
    A module that cannot be imported off the main thread (one that sets a signal handler) is
    tried again on the main thread."""
    import threading

    failed = []
    retry = []
    spawners = []

    def work():
        try:
            if nice and hasattr(os, "setpriority"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError):
            pass
        before = _thread_count() or 0
        for name in names:
            try:
                __import__(name)
            except ValueError:
                retry.append(name)
            except BaseException:  # noqa: BLE001 - an import may raise anything
                if "." not in name:
                    failed.append(name)
            now = _thread_count() or 0
            if now > before:
                spawners.append(name)
            before = now

    thread = threading.Thread(target=work, name="muster-standby-imports")
    thread.start()
    thread.join()
    for name in retry:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001
            if "." not in name:
                failed.append(name)
    return failed, spawners


def prime_imports(names):
    """Imports `names` here, on the main thread at the rank's priority (see `PRIME_ENV`)."""
    for name in names:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - the helper thread tries it again and reports it
            pass


def _start_again(started_env, spawners, oom_score, fd):
    """Replaces this standby by a fresh one (same pid, socket and environment) that imports
    `spawners` first on its main thread: the native threads they start then have the rank's
    priority. Returns only if the exec failed."""
    why = restore_oom_score(oom_score)  # the next one raises it again from the rank's score
    if why is not None:
        return
    env = dict(started_env)
    env[PRIME_ENV] = json.dumps(spawners)
    argv = getattr(sys, "orig_argv", None) or [sys.executable, "-u", "-c", COMMAND]
    try:
        os.set_inheritable(fd, True)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)
    except OSError:
        os.set_inheritable(fd, False)
        raise_oom_score()


def _fresh_signals():
    """The dispositions this interpreter started with (Python's own: SIGINT raises
    KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored, the rest default)."""
    import signal

    saved = {}
    for sig in signal.valid_signals():
        try:
            saved[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            pass
    return saved


def _restore_signals(saved):
    import signal

    for sig, handler in saved.items():
        if handler is None:
            continue
        try:
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        except (OSError, ValueError, TypeError):
            pass


def parse_args(args):
    """`-u script.py ARGS` or `-u -m module ARGS` to ("script"|"module", target, rest); None for
    any other form (the standby then refuses)."""
    args = list(args)
    saw_unbuffered = False
    while args and args[0].startswith("-") and args[0] != "-":
        flag = args.pop(0)
        if flag == "-u":
            saw_unbuffered = True
        elif flag == "-m" and args:
            return ("module", args[0], args[1:]) if saw_unbuffered else None
        else:
            return None
    if not saw_unbuffered or not args:
        return None
    return ("script", args[0], args[1:])


def refusal(started_env, handover, threads, cuda_initialized=False):
    """`threads`: 1 (the main thread) plus the threads a cold rank would not have
    (`stray_threads`)."""
    # Why this standby cannot take the handover, or None when it can.
    env = handover.get("env")
    if not isinstance(env, dict):
        return "the handover has no environment"
    if parse_args(handover.get("args") or []) is None:
        return "cannot run %s like python does" % " ".join(handover.get("args") or [])
    names = set(IMPORT_TIME_VARIABLES)
    names.update(k for k in list(started_env) + list(env) if k.startswith("PYTHON"))
    differ = sorted(k for k in names if started_env.get(k) != env.get(k))
    if differ:
        return "%s differ%s from the standby's start" % (
            ", ".join(differ), "s" if len(differ) == 1 else "")
    if threads > 1:
        return "its imports left %d threads running" % (threads - 1)
    if cuda_initialized:
        # A CUDA context made before the handover is one the rank did not choose (its device,
        # its memory on the GPU while the attempt before it still trains).
        return "its imports initialised CUDA"
    return None


OOM_SCORE_ADJ = "/proc/self/oom_score_adj"
WAITING_OOM_SCORE_ADJ = 1000
"""A waiting standby is the kernel's first OOM victim: under a pod's or a Slurm step's memory
limit the kernel kills it (the rank then starts cold) before any rank that trains."""


def raise_oom_score(path=OOM_SCORE_ADJ):
    """Raises this process's OOM score to WAITING_OOM_SCORE_ADJ; returns the score it had (what
    a cold rank, started by the same agent, has), None where there is none or it could not be
    read. Raising needs no privilege."""
    try:
        with open(path) as f:
            original = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if original < WAITING_OOM_SCORE_ADJ:
        try:
            with open(path, "w") as f:
                f.write(str(WAITING_OOM_SCORE_ADJ))
        except OSError:
            pass  # still the original: nothing to restore, no worse than a cold rank
    return original


def restore_oom_score(original, path=OOM_SCORE_ADJ):
    """Back to `original` before the script runs: None when done, else why not (lowering it
    below the least value a privileged process set needs CAP_SYS_RESOURCE; the standby then
    refuses rather than run a rank that the OOM killer would pick first)."""
    if original is None:
        return None
    try:
        with open(path) as f:
            if int(f.read().strip()) == original:
                return None
        with open(path, "w") as f:
            f.write(str(original))
        with open(path) as f:
            now = int(f.read().strip())
    except (OSError, ValueError) as err:
        return "could not restore its OOM score to %d (%s)" % (original, err)
    if now != original:
        return "could not restore its OOM score to %d (it reads %d)" % (original, now)
    return None


def _reseed():
    """Random state as fresh as a cold process's: Python's and numpy's global generators from
    os.urandom, as each seeds itself at import; torch's CPU generator from fresh entropy where a
    cold process draws its seed (torch 2.x), else back to torch's fixed default seed."""
    import random

    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        try:
            numpy_random.seed()
        except Exception:
            pass
    torch = sys.modules.get("torch")
    state = _torch_state
    if torch is not None and state is not None:
        try:
            if torch.initial_seed() == _TORCH_FIXED_SEED:
                # Older torch: every cold process starts from the same fixed seed.
                torch.default_generator.set_state(state)
            else:
                # torch 2.x seeds a cold process's CPU generator from fresh entropy.
                torch.default_generator.seed()
        except Exception:
            pass


_torch_state = None
# c10's default_rng_seed_val: a cold process's seed in torch versions that do not draw one.
_TORCH_FIXED_SEED = 67280421310721


def _become(handover, started_signals):
    """Makes this process what `python -u <args>` would be at its first line, and runs it."""
    kind, target, rest = parse_args(handover["args"])
    env = handover["env"]
    os.environ.clear()
    os.environ.update(env)
    cwd = handover.get("cwd")
    if cwd:
        os.chdir(cwd)
    _restore_signals(started_signals)
    _reseed()
    for name in (LIST_ENV, FD_ENV):
        os.environ.pop(name, None)
    interpreter = sys.executable
    sys.orig_argv = [interpreter] + list(handover["args"])
    import runpy

    if kind == "module":
        sys.argv = ["-m"] + rest  # runpy sets argv[0] to the module's file
        sys.path[0] = os.getcwd()
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
        script = None
    else:
        script = os.path.abspath(target)
        sys.argv = [target] + rest
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
    try:
        run()
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - as the interpreter reports any exception
        tb = _user_frames(err.__traceback__, script)
        sys.excepthook(type(err), err.with_traceback(tb), tb)
        raise SystemExit(1)


def _user_frames(tb, script):
    """The traceback from the script's first frame on (runpy's and the standby's dropped)."""
    here = os.path.abspath(__file__) if "__file__" in globals() else None
    first = tb
    while tb is not None:
        code = tb.tb_frame.f_code
        if script is not None and os.path.abspath(code.co_filename) == script:
            return tb
        if script is None and tb.tb_frame.f_globals.get("__name__") == "__main__" and \
                code.co_filename != here and "runpy" not in code.co_filename:
            return tb
        tb = tb.tb_next
    return first


def _send(sock, message):
    sock.sendall((json.dumps(message) + "\n").encode())


def _read_line(sock):
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None
        data += chunk
    return data


def main():
    """The standby's entry point (run with `-c`)."""
    global _torch_state
    import socket

    started_env = dict(os.environ)
    started_signals = _fresh_signals()
    oom_score = raise_oom_score()
    fd = int(os.environ[FD_ENV])
    os.set_inheritable(fd, False)  # never to a process the imports or the script start
    sock = socket.socket(fileno=fd)
    try:
        with open(os.environ.get(LIST_ENV, "")) as f:
            names = [n for n in json.load(f)
                     if isinstance(n, str) and n.split(".", 1)[0] not in NOT_PRELOADED]
    except (OSError, ValueError):
        names = []
    try:
        nice = int(os.environ.get(NICE_ENV, "10"))
    except ValueError:
        nice = 10
    try:
        primed = json.loads(os.environ[PRIME_ENV])
    except (KeyError, ValueError):
        primed = None
    prime_imports(primed if isinstance(primed, list) else [])
    failed, spawners = import_all(names, nice)
    python, native = stray_threads()
    if native and not python and spawners and primed is None:
        started_env.pop(PRIME_ENV, None)
        _start_again(started_env, spawners, oom_score, fd)
    sys.path.insert(0, "")  # the place of sys.path[0], set at the handover
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            _torch_state = torch.default_generator.get_state()
        except Exception:
            _torch_state = None
    python, native = stray_threads()
    _send(sock, {"ready": True, "failed": failed, "threads": 1 + len(python) + len(native)})
    line = _read_line(sock)
    if line is None:
        os._exit(0)  # the agent let go of us
    try:
        handover = json.loads(line)
    except ValueError:
        handover = {}
    cuda = sys.modules.get("torch.cuda")
    try:
        cuda_initialized = bool(cuda is not None and cuda.is_initialized())
    except Exception:
        cuda_initialized = False
    python, native = stray_threads()
    why = refusal(started_env, handover, 1 + len(python) + len(native), cuda_initialized)
    if why is None:
        why = restore_oom_score(oom_score)
    if why is not None:
        _send(sock, {"refused": why})
        sock.close()
        os._exit(0)
    _send(sock, {"accepted": True})
    sock.close()
    _become(handover, started_signals)
