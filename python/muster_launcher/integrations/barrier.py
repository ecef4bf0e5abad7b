"""The framework-neutral half of every integration: their on/off switch (`enabled`), one
callback's side of muster's checkpoint barrier (`Barrier`), the one helper connection per process
they share, and the wrapper that adds a callback to every Trainer a script builds. Imports no
framework."""

import functools
import os
import sys

from .. import channel
from ..checkpoint import Checkpointer

ENABLE_ENV = "MUSTER_FRAMEWORK_CALLBACKS"


def enabled():
    """True when muster runs this worker and the automatic callbacks are not turned off
    (`--framework-callbacks off` exports MUSTER_FRAMEWORK_CALLBACKS=0)."""
    return channel.switched_on(ENABLE_ENV)


def rank0():
    return os.environ.get("RANK", "0") == "0"


_shared = {"pid": None, "checkpointer": None}


def checkpointer():
    """One helper connection per process (the agent keys its workers by local rank: a second
    connection from the same rank would replace the first). Re-made after a fork."""
    if _shared["pid"] != os.getpid():
        _shared["checkpointer"] = Checkpointer()
        _shared["pid"] = os.getpid()
    return _shared["checkpointer"]


class Barrier:
    """One callback's side of the barrier: report, save at the target, confirm."""

    def __init__(self, framework):
        self.framework = framework
        # The target step this rank must save at now (should_save said so), until confirmed.
        self.pending = None
        self._off = False
        # The open section's context (evaluation between two steps), if any.
        self._section = None

    def _disable(self, err):
        if not self._off:
            self._off = True
            channel.say(
                "%s callback turned off after an error of muster's: %r" % (self.framework, err)
            )

    def report(self, step):
        """Reports `step`; True when this rank must save at it now."""
        if self._off:
            return False
        try:
            if checkpointer().should_save(int(step)):
                self.pending = int(step)
                return True
        except Exception as err:  # never raise into the training loop over muster
            self._disable(err)
        return False

    def confirm(self, step, where):
        """Confirms the save of the pending step; returns "committed", "continue" or "aborted"."""
        self.pending = None
        try:
            ckpt = checkpointer()
            # The file's name, not its path: the agent takes lines of at most 1 KiB.
            stop = ckpt.saved(int(step), os.path.basename(where)[:200])
        except Exception as err:
            self._disable(err)
            return "continue"
        if ckpt.aborted_reason is not None:
            if rank0():
                channel.say(
                    "checkpoint at step %d aborted (%s); stopping" % (step, ckpt.aborted_reason)
                )
            return "aborted"
        return "committed" if stop else "continue"

    def begin_section(self, name):
        """Marks the framework's evaluation as intended work between steps: the hang watch gives
        it --section-timeout instead of the step limit (a rank that reports its steps through a
        callback is watched by its steps, not by the optimizer hook's liveness)."""
        if self._off or self._section is not None:
            return
        try:
            section = checkpointer().section(name)
            section.__enter__()
            self._section = section
        except Exception as err:
            self._disable(err)

    def end_section(self):
        section, self._section = self._section, None
        if section is None:
            return
        try:
            section.__exit__(None, None, None)
        except Exception as err:
            self._disable(err)

    def fail(self, err):
        """A save that raised: the gang aborts this checkpoint."""
        if self.pending is None:
            return
        self.pending = None
        try:
            checkpointer().failed("%s: %s" % (type(err).__name__, err))
        except Exception:
            pass

    def leave(self, step, where, resume):
        """The gang committed: end this process before the script's post-training code."""
        if rank0():
            channel.say(
                "checkpoint at step %d committed on every rank (%s); leaving the script here, "
                "resume with %s" % (step, where, resume)
            )
        sys.stdout.flush()
        raise SystemExit(0)


def is_muster(callback):
    return getattr(callback, "_muster_callback", False) is True


def wrap_init(cls, add):
    """Wraps `cls.__init__` (a Trainer class) so that `add(trainer)` runs after it, once."""
    original = cls.__init__
    if getattr(original, "_muster_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            add(self)
        except Exception as err:  # never break the script's Trainer over muster
            channel.say("cannot add muster's callback to %s: %r" % (type(self).__name__, err))

    __init__._muster_wrapped = True
    cls.__init__ = __init__


def patch_failed(module, err):
    """`after_import`'s error path for a Trainer module: one line."""
    channel.say("cannot add muster's callback to %s: %r" % (module.__name__, err))
