"""muster's gang checkpoint for Hugging Face `Trainer` and Lightning: a callback per framework.

Under muster (MUSTER_CHECKPOINT_SOCKET set) the workers' `sitecustomize` calls `install()`, which
waits for the script to import `transformers.trainer`, `lightning.pytorch.trainer.trainer` or
`pytorch_lightning.trainer.trainer` and then wraps that module's `Trainer.__init__` so every
Trainer the script builds gets one muster callback (none is added when the script passed one
itself). Nothing here imports a framework: the callbacks' classes are built on first use.
`--framework-callbacks off` (MUSTER_FRAMEWORK_CALLBACKS=0) turns the automatic part off; the
explicit form still works:

    from muster_frameworks import MusterHFCallback
    trainer = transformers.Trainer(..., callbacks=[MusterHFCallback()])

    from muster_frameworks import MusterLightningCallback
    trainer = lightning.Trainer(..., callbacks=[MusterLightningCallback()])

What a callback does (the protocol of `muster_checkpoint.Checkpointer`, see docs/preemption.md):
it reports the framework's global step (optimizer steps) after every step; when the gang agreed
on a step T, every rank saves at T through the framework's own checkpoint —

- transformers: `control.should_save = True`, so the Trainer writes `<output_dir>/checkpoint-T`
  (model, optimizer, scheduler, trainer state, and `rng_state_<rank>.pth` from every rank);
  the save is confirmed in `on_save`. Resume: `trainer.train(resume_from_checkpoint=True)`.
- Lightning: `trainer.save_checkpoint(<default_root_dir>/muster-preempt-step=T.ckpt)` on every
  rank (rank 0 writes it). Resume: `trainer.fit(model, ckpt_path=that_path)`.

— then waits for the agents' verdict. Committed: the callback leaves the process (SystemExit(0))
from inside the framework's loop, so the script's post-training code (a "final" save, an
evaluation, a push) does not run for a run that is not finished; `finally` blocks and atexit
handlers still run, and Lightning runs its own interruption path (on_exception hooks, teardown,
loggers finalized). Aborted: training stops and the agent stops the workers (exit 201). A save
that raises tells the agent (`Checkpointer.failed`), which aborts the checkpoint for the gang.

Nothing in a rank may fail because of muster: a hook that hits an error of muster's own prints one
line and turns itself off; outside muster every hook is a no-op.
"""

import functools
import os
import sys

__all__ = ["MusterHFCallback", "MusterLightningCallback", "install", "ENABLE_ENV"]

ENABLE_ENV = "MUSTER_FRAMEWORK_CALLBACKS"
_SOCKET_ENV = "MUSTER_CHECKPOINT_SOCKET"
_OFF = ("0", "false", "no", "off")

# Module whose execution defines a framework's Trainer -> the framework's package.
_TARGETS = {
    "transformers.trainer": "transformers",
    "lightning.pytorch.trainer.trainer": "lightning.pytorch",
    "pytorch_lightning.trainer.trainer": "pytorch_lightning",
}

# Lightning's checkpoint file name; `T` is the global step.
LIGHTNING_FILE = "muster-preempt-step={step}.ckpt"


def _say(message):
    print("muster: " + message, file=sys.stderr, flush=True)


def _rank0():
    return os.environ.get("RANK", "0") == "0"


def enabled():
    """True when muster runs this worker and the automatic callbacks are not turned off."""
    if not os.environ.get(_SOCKET_ENV):
        return False
    return os.environ.get(ENABLE_ENV, "").strip().lower() not in _OFF


# -- the barrier, framework-neutral ----------------------------------------------------------

_shared = {"pid": None, "checkpointer": None}


def _checkpointer():
    """One helper connection per process (the agent keys its workers by local rank: a second
    connection from the same rank would replace the first). Re-made after a fork."""
    if _shared["pid"] != os.getpid():
        import muster_checkpoint

        _shared["checkpointer"] = muster_checkpoint.Checkpointer()
        _shared["pid"] = os.getpid()
    return _shared["checkpointer"]


class _Barrier:
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
            _say("%s callback turned off after an error of muster's: %r" % (self.framework, err))

    def report(self, step):
        """Reports `step`; True when this rank must save at it now."""
        if self._off:
            return False
        try:
            if _checkpointer().should_save(int(step)):
                self.pending = int(step)
                return True
        except Exception as err:  # never raise into the training loop over muster
            self._disable(err)
        return False

    def confirm(self, step, where):
        """Confirms the save of the pending step; returns "committed", "continue" or "aborted"."""
        self.pending = None
        try:
            ckpt = _checkpointer()
            # The file's name, not its path: the agent takes lines of at most 1 KiB.
            stop = ckpt.saved(int(step), os.path.basename(where)[:200])
        except Exception as err:
            self._disable(err)
            return "continue"
        if ckpt.aborted_reason is not None:
            if _rank0():
                _say("checkpoint at step %d aborted (%s); stopping" % (step, ckpt.aborted_reason))
            return "aborted"
        return "committed" if stop else "continue"

    def begin_section(self, name):
        """Marks the framework's evaluation as intended work between steps: the hang watch gives
        it --section-timeout instead of the step limit (a rank that reports its steps through a
        callback is watched by its steps, not by the optimizer hook's liveness)."""
        if self._off or self._section is not None:
            return
        try:
            section = _checkpointer().section(name)
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
            _checkpointer().failed("%s: %s" % (type(err).__name__, err))
        except Exception:
            pass

    def leave(self, step, where, resume):
        """The gang committed: end this process before the script's post-training code."""
        if _rank0():
            _say(
                "checkpoint at step %d committed on every rank (%s); leaving the script here, "
                "resume with %s" % (step, where, resume)
            )
        sys.stdout.flush()
        raise SystemExit(0)


def _is_muster(callback):
    return getattr(callback, "_muster_callback", False) is True


# -- transformers ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hf_class():
    from transformers import TrainerCallback

    class MusterHFCallback(TrainerCallback):
        """Joins muster's gang checkpoint: saves `checkpoint-<T>` on every rank at the agreed step,
        then leaves. A no-op outside muster."""

        _muster_callback = True

        def __init__(self):
            self._barrier = _Barrier("transformers")

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


def _add_hf(trainer):
    handler = getattr(trainer, "callback_handler", None)
    if handler is None or any(_is_muster(cb) for cb in handler.callbacks):
        return
    trainer.add_callback(_hf_class()())


def _hf_save_failed(trainer, err):
    handler = getattr(trainer, "callback_handler", None)
    for cb in getattr(handler, "callbacks", ()):
        if _is_muster(cb):
            cb._barrier.fail(err)


# -- Lightning -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _lightning_class(package):
    callbacks = __import__(package + ".callbacks", fromlist=["Callback"])

    class MusterLightningCallback(callbacks.Callback):
        """Joins muster's gang checkpoint: `trainer.save_checkpoint` on every rank at the agreed
        step (`<default_root_dir>/muster-preempt-step=<T>.ckpt`), then leaves. A no-op outside
        muster."""

        _muster_callback = True

        def __init__(self):
            self._barrier = _Barrier(package)

        def on_train_start(self, trainer, pl_module):
            self._barrier.report(trainer.global_step)

        def on_validation_start(self, trainer, pl_module):
            self._barrier.begin_section("validation")

        def on_validation_end(self, trainer, pl_module):
            self._barrier.end_section()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if not self._barrier.report(step):
                return
            path = os.path.join(trainer.default_root_dir, LIGHTNING_FILE.format(step=step))
            try:
                # Every rank calls it; the strategy picks who writes (rank 0 for DDP).
                trainer.save_checkpoint(path, weights_only=False)
            except Exception as err:
                self._barrier.fail(err)
                raise
            verdict = self._barrier.confirm(step, path)
            if verdict == "continue":
                return
            trainer.should_stop = True
            if verdict == "committed":
                self._barrier.leave(step, path, "trainer.fit(..., ckpt_path=%r)" % path)

    return MusterLightningCallback


def _add_lightning(trainer, package):
    callbacks = getattr(trainer, "callbacks", None)
    if not isinstance(callbacks, list) or any(_is_muster(cb) for cb in callbacks):
        return
    callbacks.append(_lightning_class(package)())


def __getattr__(name):
    """The callbacks' classes, built on first use (importing this module imports no framework)."""
    if name == "MusterHFCallback":
        return _hf_class()
    if name == "MusterLightningCallback":
        try:
            import lightning.pytorch  # noqa: F401

            return _lightning_class("lightning.pytorch")
        except ImportError:
            return _lightning_class("pytorch_lightning")
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


# -- the automatic part: patching each Trainer class once, when its module is imported -------


def _wrap_init(cls, add):
    original = cls.__init__
    if getattr(original, "_muster_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            add(self)
        except Exception as err:  # never break the script's Trainer over muster
            _say("cannot add muster's callback to %s: %r" % (type(self).__name__, err))

    __init__._muster_wrapped = True
    cls.__init__ = __init__


def _wrap_hf_train(cls):
    original = cls.train
    if getattr(original, "_muster_wrapped", False):
        return

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except Exception as err:
            # Raised while the gang's checkpoint was being saved: tell the agent why.
            _hf_save_failed(self, err)
            raise

    train._muster_wrapped = True
    cls.train = train


def _patch(module, package):
    cls = getattr(module, "Trainer", None)
    if not isinstance(cls, type):
        return
    if package == "transformers":
        _wrap_init(cls, _add_hf)
        _wrap_hf_train(cls)
    else:
        _wrap_init(cls, lambda trainer: _add_lightning(trainer, package))


def _patch_named(module):
    _patch(module, _TARGETS[module.__name__])


def _patch_failed(module, err):
    _say("cannot add muster's callback to %s: %r" % (module.__name__, err))


def install():
    """Adds a muster callback to every HF/Lightning Trainer built from now on (see the module's
    doc). Called by muster's sitecustomize; a no-op unless `enabled()`."""
    if not enabled():
        return
    from muster_importhook import after_import

    after_import(_TARGETS, _patch_named, _patch_failed)
