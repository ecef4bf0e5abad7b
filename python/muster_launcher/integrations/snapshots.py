"""The framework-neutral half of the integrations' snapshots (`--snapshot-every`): when to take
one, which restored state is this integration's, whether the script's own checkpoint wins, and
the private temporary place a restored state is written to for the framework's own resume. Each
framework's module (`transformers_snapshot`, `lightning_snapshot`) says what its state is and how
its Trainer reads it back."""

import shutil
import tempfile

from .. import channel, snapshot
from . import barrier


def never_raising(save):
    """Runs a callback's `save()`; an error of muster's turns snapshots off for this process with
    one line instead of raising into the training loop."""
    try:
        save()
    except Exception as err:
        channel.say("snapshots turned off after an error of muster's: %r" % (err,))
        snapshot.turn_off()


def save_if_due(step, sharded_why, build):
    """Hands `build()` to the agent when a snapshot is due at `step`; a sharded engine
    (`sharded_why` says why) turns snapshots off for this process instead."""
    if not snapshot.due(step):
        return False
    if sharded_why is not None:
        channel.say("snapshot of step %d skipped: %s (not supported yet)" % (step, sharded_why))
        snapshot.turn_off()
        return False
    return snapshot.save(step, build)


def restored(fmt):
    """`(step, state)` of the newest committed snapshot when it is a state of format `fmt` (one
    this integration took), else None."""
    if not snapshot.every():
        return None
    got = snapshot.restore()
    if got is None:
        return None
    step, state = got
    if not isinstance(state, dict) or state.get("format") != fmt:
        return None
    return step, state


def resume_point_or_fail(resume_point):
    """`resume_point()`, whose error ends the rank: every other rank of the gang resumes from the
    snapshot, and training on from anywhere else would silently train ranks at different steps."""
    try:
        return resume_point()
    except Exception as err:
        raise RuntimeError(
            "muster cannot resume this Trainer from the snapshot every rank agreed on: %r" % (err,)
        ) from err


def checkpoint_wins(explicit_step, named, step):
    """Whether the checkpoint the script asks for (at `explicit_step`, None: it asks for none;
    `named` is how the line names it) is at least as new as the snapshot of `step`."""
    if explicit_step is None or explicit_step < step:
        return False
    if barrier.rank0():
        channel.say(
            "the checkpoint the script resumes from (%s) is at least as new as the snapshot of "
            "step %d: resuming from the checkpoint" % (named, step)
        )
    return True


def scratch(prefix, step, write):
    """A private temporary directory that `write(directory)` filled with the snapshot of `step`
    (removed again when `write` fails); the caller removes it after training."""
    where = tempfile.mkdtemp(prefix="%s-%d-" % (prefix, step))
    try:
        write(where)
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    if barrier.rank0():
        channel.say("resuming the Trainer from the snapshot of step %d held by muster" % step)
    return where
