"""Lightning (`lightning.pytorch` and the older `pytorch_lightning`): `MusterLightningCallback`,
added to every Trainer the script builds under muster.

At the agreed step T every rank calls
`trainer.save_checkpoint(<default_root_dir>/muster-preempt-step=T.ckpt)` (the strategy picks who
writes: rank 0 for DDP). Resume: `trainer.fit(model, ckpt_path=that_path)`. A save that raises
tells the agent (`Barrier.fail`) and raises on. Imports Lightning only when the callback's class is
first asked for. With `--snapshot-every N` the callback also hands the Trainer's state to the agent
every N steps, and a restart within the job resumes from it without the script asking
(`lightning_snapshot`).
"""

import functools
import os
import shutil

from ..importhook import after_import
from . import barrier, lightning_snapshot, rng, snapshots

# The module whose execution defines each package's Trainer -> that package.
_PACKAGES = {
    "lightning.pytorch.trainer.trainer": "lightning.pytorch",
    "pytorch_lightning.trainer.trainer": "pytorch_lightning",
}
# The modules whose import installs this integration (muster's sitecustomize is generated from it).
HOOKED = tuple(_PACKAGES)

# Lightning's checkpoint file name; `T` is the global step.
LIGHTNING_FILE = "muster-preempt-step={step}.ckpt"


def installed_package():
    """`lightning.pytorch` where it imports, else `pytorch_lightning`."""
    try:
        import lightning.pytorch  # noqa: F401

        return "lightning.pytorch"
    except ImportError:
        return "pytorch_lightning"


@functools.lru_cache(maxsize=None)
def callback_class(package):
    callbacks = __import__(package + ".callbacks", fromlist=["Callback"])

    class MusterLightningCallback(callbacks.Callback):
        """Joins muster's gang checkpoint: `trainer.save_checkpoint` on every rank at the agreed
        step (`<default_root_dir>/muster-preempt-step=<T>.ckpt`), then leaves. A no-op outside
        muster."""

        _muster_callback = True

        def __init__(self):
            self._barrier = barrier.Barrier(package)

        def on_fit_start(self, trainer, pl_module):
            # Resumed from a snapshot: the RNG states it took, which Lightning's checkpoint
            # does not restore. Set before the fit loop makes its data loader's iterator,
            # which draws its base seed from torch's generator, as the run that was not
            # interrupted drew it after the snapshot's step.
            taken = trainer.__dict__.pop("_muster_snapshot_rng", None)
            if taken is not None:
                rng.set_states(taken)

        def on_train_start(self, trainer, pl_module):
            self._barrier.report(trainer.global_step)

        def on_validation_start(self, trainer, pl_module):
            self._barrier.begin_section("validation")

        def on_validation_end(self, trainer, pl_module):
            self._barrier.end_section()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.never_raising(lambda: lightning_snapshot.save(trainer))
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


def _add(trainer, package):
    callbacks = getattr(trainer, "callbacks", None)
    if not isinstance(callbacks, list) or any(barrier.is_muster(cb) for cb in callbacks):
        return
    callbacks.append(callback_class(package)())


# `Trainer.fit`'s positional parameters before `ckpt_path` (model, train_dataloaders,
# val_dataloaders, datamodule).
_CKPT_PATH_AT = 4


def _wrap_fit(cls):
    """`fit` resumes from muster's newest committed snapshot on a restart within the job."""
    original = getattr(cls, "fit", None)
    if not callable(original) or getattr(original, "_muster_wrapped", False):
        return

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        positional = len(args) > _CKPT_PATH_AT
        ckpt_path = args[_CKPT_PATH_AT] if positional else kwargs.get("ckpt_path")
        resume, snapshot_dir, taken = snapshots.resume_point_or_fail(
            lambda: lightning_snapshot.resume_point(self, ckpt_path)
        )
        if snapshot_dir is not None:
            self._muster_snapshot_rng = taken
            if positional:
                args = args[:_CKPT_PATH_AT] + (resume,) + args[_CKPT_PATH_AT + 1 :]
            else:
                kwargs = dict(kwargs, ckpt_path=resume)
        try:
            return original(self, *args, **kwargs)
        finally:
            if snapshot_dir is not None:
                shutil.rmtree(snapshot_dir, ignore_errors=True)

    fit._muster_wrapped = True
    cls.fit = fit


def _patch(module):
    cls = getattr(module, "Trainer", None)
    if not isinstance(cls, type):
        return
    package = _PACKAGES[module.__name__]
    barrier.wrap_init(cls, lambda trainer: _add(trainer, package))
    _wrap_fit(cls)


def install():
    """Adds the callback to every Trainer built once either package's Trainer module is imported;
    a no-op unless the integrations are on (`barrier.enabled()`)."""
    if barrier.enabled():
        after_import(HOOKED, _patch, barrier.patch_failed)
