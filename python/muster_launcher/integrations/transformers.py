"""Hugging Face `transformers.Trainer`: `MusterHFCallback`, added to every Trainer the script
builds under muster.

At the agreed step T the callback sets `control.should_save = True`, so the Trainer writes
`<output_dir>/checkpoint-T` (model, optimizer, scheduler, trainer state, and
`rng_state_<rank>.pth` from every rank); the save is confirmed in `on_save`. Resume:
`trainer.train(resume_from_checkpoint=True)`. A save that raises out of `Trainer.train` tells the
agent (`Barrier.fail`). With `--snapshot-every N` the callback also hands the Trainer's state to
the agent every N steps, and a restart within the job resumes from it without the script asking
(`transformers_snapshot`). Imports transformers only when the callback's class is first asked for.
"""

import functools
import os
import shutil
import weakref

from ..importhook import after_import
from . import barrier, snapshots, transformers_snapshot

# The modules whose import installs this integration (muster's sitecustomize is generated from it).
HOOKED = ("transformers.trainer",)


@functools.lru_cache(maxsize=None)
def callback_class():
    from transformers import TrainerCallback

    class MusterHFCallback(TrainerCallback):
        """Joins muster's gang checkpoint: saves `checkpoint-<T>` on every rank at the agreed step,
        then leaves. A no-op outside muster."""

        _muster_callback = True

        def __init__(self):
            self._barrier = barrier.Barrier("transformers")
            # The Trainer it belongs to (set when muster adds or finds it): what a snapshot
            # (--snapshot-every) takes.
            self._trainer = lambda: None

        def on_train_begin(self, args, state, control, **kwargs):
            self._barrier.report(state.global_step)

        def on_step_begin(self, args, state, control, **kwargs):
            self._barrier.end_section()

        def on_prediction_step(self, args, state, control, **kwargs):
            self._barrier.begin_section("evaluate")

        def on_evaluate(self, args, state, control, **kwargs):
            self._barrier.end_section()

        def on_train_end(self, args, state, control, **kwargs):
            self._barrier.end_section()

        def on_step_end(self, args, state, control, **kwargs):
            trainer = self._trainer()
            if trainer is not None:
                snapshots.never_raising(lambda: transformers_snapshot.save(trainer, state))
            if self._barrier.report(state.global_step):
                # The Trainer saves right after this hook (`_maybe_log_save_evaluate`).
                control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            step = state.global_step
            if self._barrier.pending != step:
                return
            where = os.path.join(args.output_dir, "checkpoint-%d" % step)
            verdict = self._barrier.confirm(step, where)
            if verdict == "continue":
                return
            control.should_training_stop = True
            if verdict == "committed":
                self._barrier.leave(step, where, "trainer.train(resume_from_checkpoint=True)")

    return MusterHFCallback


def _add(trainer):
    handler = getattr(trainer, "callback_handler", None)
    if handler is None:
        return
    ours = [cb for cb in handler.callbacks if barrier.is_muster(cb)]
    if not ours:
        ours = [callback_class()()]
        trainer.add_callback(ours[0])
    ours[0]._trainer = weakref.ref(trainer)


def _save_failed(trainer, err):
    handler = getattr(trainer, "callback_handler", None)
    for cb in getattr(handler, "callbacks", ()):
        if barrier.is_muster(cb):
            cb._barrier.fail(err)


def _resume_from_snapshot(trainer, args, kwargs):
    """`train`'s arguments with `resume_from_checkpoint` pointing at muster's newest committed
    snapshot when it is newer than what the script asks for (a restart within the job)."""
    positional = len(args) > 0
    resume = args[0] if positional else kwargs.get("resume_from_checkpoint")
    resume, snapshot_dir = snapshots.resume_point_or_fail(
        lambda: transformers_snapshot.resume_point(trainer, resume)
    )
    if snapshot_dir is None:
        return args, kwargs, None
    if positional:
        args = (resume,) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, resume_from_checkpoint=resume)
    return args, kwargs, snapshot_dir


def _wrap_train(cls):
    original = cls.train
    if getattr(original, "_muster_wrapped", False):
        return

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        args, kwargs, snapshot_dir = _resume_from_snapshot(self, args, kwargs)
        try:
            return original(self, *args, **kwargs)
        except Exception as err:
            # Raised while the gang's checkpoint was being saved: tell the agent why.
            _save_failed(self, err)
            raise
        finally:
            if snapshot_dir is not None:
                shutil.rmtree(snapshot_dir, ignore_errors=True)

    train._muster_wrapped = True
    cls.train = train


def _patch(module):
    cls = getattr(module, "Trainer", None)
    if not isinstance(cls, type):
        return
    barrier.wrap_init(cls, _add)
    _wrap_train(cls)


def install():
    """Adds the callback to every Trainer built once `transformers.trainer` is imported; a no-op
    unless the integrations are on (`barrier.enabled()`)."""
    if barrier.enabled():
        after_import(HOOKED, _patch, barrier.patch_failed)
