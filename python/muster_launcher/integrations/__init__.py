"""muster's gang checkpoint for training frameworks: one module per framework, registered in
`INTEGRATIONS`.

Under muster (MUSTER_CHECKPOINT_SOCKET set) the workers' `sitecustomize` waits for the script to
import a module an integration hooks (its `HOOKED`: `transformers.trainer`,
`lightning.pytorch.trainer.trainer` or `pytorch_lightning.trainer.trainer`) and then runs that
integration's `install()`, which wraps that module's `Trainer.__init__` so every Trainer the
script builds gets one muster callback (none is added when the script passed one itself). Nothing
here imports a framework: the callbacks' classes are built on first use. `--framework-callbacks
off` (MUSTER_FRAMEWORK_CALLBACKS=0) turns the automatic part off; the explicit form still works:

    from muster_launcher.integrations import MusterHFCallback
    trainer = transformers.Trainer(..., callbacks=[MusterHFCallback()])

    from muster_launcher.integrations import MusterLightningCallback
    trainer = lightning.Trainer(..., callbacks=[MusterLightningCallback()])

(`from muster_frameworks import ...`, the old name, still works.)

What a callback does (the protocol of `checkpoint.Checkpointer`, see docs/preemption.md): it
reports the framework's global step (optimizer steps) after every step; when the gang agreed on a
step T, every rank saves at T through the framework's own checkpoint (each module says how), then
waits for the agents' verdict. Committed: the callback leaves the process (SystemExit(0)) from
inside the framework's loop, so the script's post-training code (a "final" save, an evaluation, a
push) does not run for a run that is not finished; `finally` blocks and atexit handlers still run,
and Lightning runs its own interruption path (on_exception hooks, teardown, loggers finalized).
Aborted: training stops and the agent stops the workers (exit 201). A save that raises tells the
agent (`Checkpointer.failed`), which aborts the checkpoint for the gang.

Nothing in a rank may fail because of muster: a hook that hits an error of muster's own prints one
line and turns itself off; outside muster every hook is a no-op.

**Adding a framework** is one module here with `HOOKED` (the modules whose import installs it),
`install()` and its callback, one name in `INTEGRATIONS`, and regenerating muster's sitecustomize
(`python3 python/generate_sitecustomize.py`; python/tests check that it is current).
"""

from .barrier import ENABLE_ENV, enabled

__all__ = ["MusterHFCallback", "MusterLightningCallback", "install", "ENABLE_ENV"]

# Every framework integration: its module in this package. muster's sitecustomize is generated
# from this list (python/generate_sitecustomize.py).
INTEGRATIONS = ("transformers", "lightning")


def modules():
    """The integrations' modules, in `INTEGRATIONS` order (importing them imports no framework)."""
    import importlib

    return [importlib.import_module("." + name, __name__) for name in INTEGRATIONS]


def install():
    """Installs every integration at once (muster's sitecustomize installs each one only when the
    script imports a module it hooks); a no-op unless `enabled()`."""
    for module in modules():
        module.install()


def __getattr__(name):
    """The callbacks' classes, built on first use (importing this package imports no framework)."""
    if name == "MusterHFCallback":
        from .transformers import callback_class

        return callback_class()
    if name == "MusterLightningCallback":
        from .lightning import callback_class, installed_package

        return callback_class(installed_package())
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
