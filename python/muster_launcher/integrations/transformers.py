"""Hugging Face `transformers.Trainer`: `MusterHFCallback`, added to every Trainer the script
builds under muster.

At the agreed step T the callback sets `control.should_save = True`, so the Trainer writes
`<output_dir>/checkpoint-T` (model, optimizer, scheduler, trainer state, and
`rng_state_<rank>.pth` from every rank); the save is confirmed in `on_save`. Resume:
`trainer.train(resume_from_checkpoint=True)`. A save that raises out of `Trainer.train` tells the
agent (`Barrier.fail`). Imports transformers only when the callback's class is first asked for.
"""

import functools
import os

from ..importhook import after_import
from . import barrier

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
    if handler is None or any(barrier.is_muster(cb) for cb in handler.callbacks):
        return
    trainer.add_callback(callback_class()())


def _save_failed(trainer, err):
    handler = getattr(trainer, "callback_handler", None)
    for cb in getattr(handler, "callbacks", ()):
        if barrier.is_muster(cb):
            cb._barrier.fail(err)


def _wrap_train(cls):
    original = cls.train
    if getattr(original, "_muster_wrapped", False):
        return

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except Exception as err:
            # Raised while the gang's checkpoint was being saved: tell the agent why.
            _save_failed(self, err)
            raise

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
