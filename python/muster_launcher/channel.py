"""The worker's channel to the agent, shared by every module that talks to it.

muster (the agent, PID 1 of the pod) listens on a Unix socket it names in
MUSTER_CHECKPOINT_SOCKET: "@name" is a Linux abstract socket (no file: the agent needs no writable
directory for it, so it works on a read-only root filesystem), anything else a path. That variable
is also the on/off switch of everything here: unset (outside muster), every module is a no-op.
Each connection starts with one line that names the rank (`hello` from the helper, `watch` from
the zero-code reporter); the rest of each protocol is in its module (`checkpoint`, `autoreport`).

Also here: the one line an error of muster's prints, and the stacks fallback that both
connections announce (`register_faulthandler`). Importing this module imports nothing beyond
`os` and `sys` (the socket module only to connect).
"""

import os
import sys

SOCKET_ENV = "MUSTER_CHECKPOINT_SOCKET"
STACKS_DIR_ENV = "MUSTER_STACKS_DIR"

# The values that turn a switch off (`MUSTER_AUTO_STEP_REPORTS=0`, `--framework-callbacks off`).
OFF = ("0", "false", "no", "off")


def under_muster():
    """True when muster runs this process (it named its socket)."""
    return bool(os.environ.get(SOCKET_ENV))


def switched_on(variable):
    """True under muster unless `variable` holds one of the `OFF` words (unset: on)."""
    return under_muster() and os.environ.get(variable, "").strip().lower() not in OFF


def address(value):
    """The socket address of a MUSTER_CHECKPOINT_SOCKET value: "@name" is the abstract name
    (the kernel's leading NUL byte cannot travel in an environment variable), else a path."""
    if value.startswith("@"):
        return "\0" + value[1:]
    return value


def connect(value):
    """A non-blocking connection to the agent at `value` (a MUSTER_CHECKPOINT_SOCKET value);
    raises OSError when no agent listens there."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address(value))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def hello(word):
    """A connection's first line, without its newline: `<word> <local_rank> <rank> <pid>`."""
    return "%s %s %s %d" % (
        word,
        os.environ.get("LOCAL_RANK", "0"),
        os.environ.get("RANK", "0"),
        os.getpid(),
    )


def say(message):
    """Prints `muster: <message>` on stderr, the one line an error of muster's gets; never
    raises (a closed stderr must not break the script either)."""
    try:
        print("muster: " + message, file=sys.stderr, flush=True)
    except Exception:
        pass


# This process's faulthandler registration: (pid, the message for the agent, the open file).
_faulthandler = [None, None, None]


def register_faulthandler():
    """Registers `faulthandler` on SIGUSR2 into MUSTER_STACKS_DIR, the agent's fallback for
    reading this process's stacks where py-spy cannot, unless the script handles SIGUSR2 itself;
    once per process (the helper and the zero-code reporter both ask). Returns the message that
    tells the agent ("faulthandler <signum> <path>"), or None."""
    directory = os.environ.get(STACKS_DIR_ENV, "")
    if not directory:
        return None
    if _faulthandler[0] == os.getpid():
        return _faulthandler[1]
    try:
        import faulthandler
        import signal

        signum = signal.SIGUSR2
        if signal.getsignal(signum) not in (signal.SIG_DFL, None):
            return None
        path = os.path.join(directory, "stacks-%d.txt" % os.getpid())
        # Kept open for the process's life: faulthandler writes to its descriptor.
        stacks_file = open(path, "a")
        faulthandler.register(signum, file=stacks_file, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    message = "faulthandler %d %s" % (int(signum), path)
    _faulthandler[:] = [os.getpid(), message, stacks_file]
    return message
