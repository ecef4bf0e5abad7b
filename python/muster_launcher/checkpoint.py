"""muster's checkpoint-on-preemption helper for training scripts.

Standard library only (it never imports torch): muster puts this package on the workers'
PYTHONPATH, or vendor the `muster_launcher` folder. `import muster_checkpoint` (the old name)
still works. Five lines in a training loop:

    from muster_launcher.checkpoint import Checkpointer

    ckpt = Checkpointer()
    for step in range(start_step, total_steps):
        train_one_step()
        if ckpt.should_save(step):                 # the step every rank on every node saves at
            save_checkpoint(step)
            if ckpt.saved(step): break             # True: the gang committed (or gave up): stop

How it works: the agent (muster, PID 1 of the pod) listens on the socket named in
MUSTER_CHECKPOINT_SOCKET (see `channel`). `should_save` reports the step (one small non-blocking send) and reads,
without blocking, whether the agent has pushed a save request. When a pod is preempted, the
agents agree on a target step T that every rank can still reach and push it to every worker;
each rank saves at T and `saved` reports it and waits until the agents have counted every rank
of the job, then returns. Outside muster (or with an old muster) every call is a cheap no-op.

A script that uses the helper reports its own steps: muster's zero-code reporter (`autoreport`,
which reports optimizer steps for scripts without the helper) stops when a Checkpointer connects,
so no step is counted twice.

The step reports also feed muster's hang detection (--hang-timeout): a rank that stops reporting
steps for too long is hung, its stacks are dumped and the gang restarts. Long work between steps
that the script does on purpose (an evaluation pass, its own periodic save) goes inside a section,
which has its own limit (--section-timeout, 1 h by default):

    with ckpt.section("eval"):
        evaluate(model)

Where the agent cannot read a rank's memory to dump its stacks (py-spy), it falls back to
`faulthandler`, which this helper registers on SIGUSR2 when the agent names a directory for it
(MUSTER_STACKS_DIR) and the script has no handler of its own on that signal.

Under Slurm every process of the step receives Slurm's signals (`scancel --signal=TERM`, a
preemption, `#SBATCH --signal=USR1@120`), not only the agent. A rank that takes part in the
barrier must live through it, so when the agent names the signals to hold (MUSTER_HOLD_FOREIGN_SIGNALS,
the ones whose action is `checkpoint`) and its stop mark (MUSTER_STOP_MARK), the helper holds
such a signal unless the agent marked the stop as its own: the agent's barrier, then its stop
(and SIGKILL after --shutdown-timeout), decide when the rank ends. A script's own handler for
the signal still runs for the agent's stop.

Messages are newline-terminated ASCII words:
  worker -> agent: "hello <local_rank> <rank> <pid>", "step <n>", "saved <gen> <step> <id>",
                   "missed <gen> <step>", "failed <gen> <reason>", "section <name>",
                   "endsection", "faulthandler <signum> <path>"
  agent -> worker: "save <gen> <target_step> <deadline_unix_s>",
                   "commit <gen> <exit|continue>", "abort <gen> <reason>"
"""

import contextlib
import os
import sys
import time

from . import channel
# Names of this module since it was muster_checkpoint.py, which scripts may read.
from .channel import SOCKET_ENV, STACKS_DIR_ENV, register_faulthandler

__all__ = ["Checkpointer", "SOCKET_ENV"]

# How long `saved` waits for the agent's verdict when the agent gave no deadline.
_DEFAULT_VERDICT_WAIT_S = 600.0


def _stand_down_autoreport():
    """This process reports its steps through the helper from now on: muster's zero-code
    reporter stops (the agent also prefers the helper). muster's sitecustomize loads the reporter
    only when the script imports torch; a helper that connects before that loads it here, so
    that the reporter knows when it is installed later."""
    if not channel.under_muster():
        return
    try:
        from . import autoreport

        autoreport.stand_down()
    except Exception:
        pass


HOLD_ENV = "MUSTER_HOLD_FOREIGN_SIGNALS"
STOP_MARK_ENV = "MUSTER_STOP_MARK"

# The process that installed the hold (a forked child must not believe it holds).
_held = [None]


def hold_foreign_signals():
    """Holds the signals the agent names in MUSTER_HOLD_FOREIGN_SIGNALS when they do not come
    from the agent (no MUSTER_STOP_MARK file yet); once per process, main thread only. Returns
    whether a hold is in place."""
    if _held[0] == os.getpid():
        return True
    names = os.environ.get(HOLD_ENV, "")
    mark = os.environ.get(STOP_MARK_ENV, "")
    if not names or not mark:
        return False
    try:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return False
        signums = [int(n) for n in names.split(",") if n.strip()]
        for signum in signums:
            signal.signal(signum, _hold_handler(signum, signal.getsignal(signum), mark))
    except (ValueError, OSError, RuntimeError):
        return False
    _held[0] = os.getpid()
    return True


def _hold_handler(signum, previous, mark):
    import signal

    said = [False]

    def handler(received, frame):
        if os.path.exists(mark):
            # The agent's own stop: what the signal did before the hold.
            if callable(previous):
                return previous(received, frame)
            if previous == signal.SIG_IGN:
                return None
            signal.signal(received, signal.SIG_DFL)
            os.kill(os.getpid(), received)
            return None
        if not said[0]:
            said[0] = True
            try:
                sys.stderr.write(
                    "muster_checkpoint: holding %s from outside the agent (Slurm signals every "
                    "rank); the agent's checkpoint barrier decides when this rank stops\n"
                    % signal.Signals(received).name
                )
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        return None

    return handler


class Checkpointer:
    """The worker's side of muster's checkpoint barrier."""

    def __init__(self, socket_path=None):
        self._path = socket_path if socket_path is not None else os.environ.get(SOCKET_ENV, "")
        self._sock = None
        self._inbox = b""
        self._last_step = None
        # The save request in force: (generation, target step, deadline) or None.
        self._request = None
        # Set by the agent's verdict on the last save.
        self.committed = False
        self.aborted_reason = None
        if self._path:
            self._connect()

    @property
    def active(self):
        """True when an agent is listening (the helper is not a no-op)."""
        return self._sock is not None

    @property
    def target_step(self):
        """The step the gang agreed to save at, if a save was requested."""
        return self._request[1] if self._request else None

    def should_save(self, step):
        """Reports `step` and returns True when this rank must save a checkpoint at it now."""
        if self._sock is None:
            return False
        if step != self._last_step:
            if self._last_step is None:
                # The rank's imports are done by its first step: the warm standby's list.
                from . import standby

                standby.record_modules()
            self._last_step = step
            self._send("step %d" % step)
        self._poll()
        if self._request is None:
            return False
        generation, target, _deadline = self._request
        if step == target:
            return True
        if step > target:
            # The request reached us after the step it named: tell the agent, which picks a
            # later target for everyone (a new generation).
            self._send("missed %d %d" % (generation, step))
            self._request = None
        return False

    def saved(self, step, checkpoint_id=""):
        """Confirms the save of `step`; blocks until the agents commit or abort it.

        Returns True when training should stop now (committed for preemption, or aborted);
        False when the gang committed and asked to continue (an operator's checkpoint).
        """
        if self._sock is None or self._request is None:
            return False
        generation, _target, deadline = self._request
        ident = str(checkpoint_id or step).replace(" ", "_").replace("\n", "_")
        self._send("saved %d %d %s" % (generation, step, ident))
        limit = deadline if deadline else time.time() + _DEFAULT_VERDICT_WAIT_S
        while True:
            for words in self._messages():
                if words[0] == "commit" and int(words[1]) == generation:
                    self.committed = True
                    self._request = None
                    return len(words) < 3 or words[2] != "continue"
                if words[0] == "abort" and int(words[1]) == generation:
                    self.aborted_reason = " ".join(words[2:]) or "aborted"
                    self._request = None
                    return True
            remaining = limit - time.time()
            if remaining <= 0:
                self.aborted_reason = "no verdict from the agent before the deadline"
                return True
            if not self._wait_readable(min(remaining, 1.0)):
                continue

    @contextlib.contextmanager
    def section(self, name):
        """Marks long work between steps (evaluation, the script's own save) as intended: the
        hang watch gives it --section-timeout instead of the step limit."""
        text = str(name).replace("\n", " ").strip()[:100] or "section"
        self._send("section %s" % text)
        try:
            yield self
        finally:
            self._send("endsection")

    def failed(self, reason):
        """Tells the agent this rank could not save (the gang aborts this checkpoint)."""
        if self._sock is not None and self._request is not None:
            text = str(reason).replace("\n", " ")[:200]
            self._send("failed %d %s" % (self._request[0], text))
            self._request = None

    # -- plumbing -------------------------------------------------------------------------------

    def _connect(self):
        try:
            self._sock = channel.connect(self._path)
        except OSError:
            # No agent listening: behave as a no-op rather than break training.
            self._sock = None
            return
        self._send(channel.hello("hello"))
        self._register_faulthandler()
        hold_foreign_signals()
        _stand_down_autoreport()

    def _register_faulthandler(self):
        """The agent's fallback for dumping this rank's stacks (see the module's doc)."""
        message = register_faulthandler()
        if message is not None:
            self._send(message)

    def _send(self, line):
        if self._sock is None:
            return
        data = (line + "\n").encode("ascii", "replace")
        try:
            self._sock.setblocking(True)
            self._sock.settimeout(1.0)
            self._sock.sendall(data)
        except OSError:
            self._sock = None
        finally:
            if self._sock is not None:
                self._sock.setblocking(False)

    def _wait_readable(self, timeout):
        import select

        if self._sock is None:
            return False
        readable, _, _ = select.select([self._sock], [], [], timeout)
        return bool(readable)

    def _messages(self):
        """Every complete message received so far, as word lists."""
        if self._sock is None:
            return []
        while True:
            try:
                chunk = self._sock.recv(4096)
            except BlockingIOError:
                break
            except OSError:
                self._sock = None
                break
            if not chunk:
                self._sock = None
                break
            self._inbox += chunk
        lines = self._inbox.split(b"\n")
        self._inbox = lines.pop()
        return [line.decode("ascii", "replace").split() for line in lines if line.strip()]

    def _poll(self):
        for words in self._messages():
            if words[0] == "save" and len(words) >= 3:
                deadline = float(words[3]) if len(words) > 3 else 0.0
                self._request = (int(words[1]), int(words[2]), deadline)
            elif words[0] == "abort" and self._request and int(words[1]) == self._request[0]:
                self.aborted_reason = " ".join(words[2:]) or "aborted"
                self._request = None
