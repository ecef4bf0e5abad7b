"""In-memory snapshots of a Lightning Trainer (`--snapshot-every N`) with no code in the script.

Save: every N global steps the callback hands to the agent what `trainer.save_checkpoint` would
write (`dump_checkpoint(weights_only=False)`: the module's state dict, the optimizers', the LR
schedulers', the precision plugin's, the loops' progress, the callbacks' and the data module's
state) together with this rank's RNG states, which Lightning's own checkpoint leaves out.

Restore: on a restart within the job, `Trainer.fit` resumes from the newest committed snapshot as
if `ckpt_path` named it: the checkpoint is written once into a private temporary file and
Lightning's own resume reads it; the RNG states are set when training starts again. A
`ckpt_path` file the script passes that is at least as new as the snapshot wins. Lightning's own
limits of a mid-epoch resume apply as to its checkpoints: a data loader that is not stateful
starts its epoch again (Lightning warns); a snapshot at the end of an epoch resumes exactly.
Sharded strategies (FSDP, DeepSpeed) are not snapshotted (one line says so).
"""

import os
import shutil
import tempfile

from .. import channel, snapshot
from . import rng

# Marks a state this module wrote.
FORMAT = "muster-lightning-1"


def sharded(trainer):
    """Why this Trainer's state cannot be snapshotted here, or None."""
    name = type(getattr(trainer, "strategy", None)).__name__.lower()
    for engine in ("fsdp", "deepspeed"):
        if engine in name:
            return "the %s strategy shards the model and optimizer state" % type(trainer.strategy).__name__
    return None


def save(trainer):
    """Hands the Trainer's state to the agent when a snapshot is due at this global step."""
    step = int(trainer.global_step)
    if not snapshot.due(step):
        return False
    why = sharded(trainer)
    if why is not None:
        channel.say("snapshot of step %d skipped: %s (not supported yet)" % (step, why))
        snapshot.turn_off()
        return False
    return snapshot.save(
        step,
        lambda: {
            "format": FORMAT,
            "checkpoint": trainer._checkpoint_connector.dump_checkpoint(weights_only=False),
            "rng": rng.states(),
        },
    )


def _explicit_step(ckpt_path):
    """The global step of the checkpoint file the script passes, or None when it passes none
    (or `"last"`, which asks for the newest: the snapshot, when it is newer than every file,
    is that)."""
    if ckpt_path is None or ckpt_path == "last":
        return None
    if not os.path.isfile(str(ckpt_path)):
        # "best", "hpc", a registry name or a remote path: what the script asks for wins.
        return float("inf")
    import torch

    try:
        checkpoint = torch.load(str(ckpt_path), map_location="cpu", mmap=True, weights_only=False)
        return int(checkpoint["global_step"])
    except Exception:
        return float("inf")


def resume_point(trainer, ckpt_path):
    """What `fit(ckpt_path=...)` gets: `ckpt_path` itself, or a file holding the newest committed
    snapshot when it is newer. Returns `(ckpt_path, directory to remove after fit or None, RNG
    states to set when training starts or None)`."""
    if not snapshot.every() or sharded(trainer) is not None:
        return ckpt_path, None, None
    restored = snapshot.restore()
    if restored is None:
        return ckpt_path, None, None
    step, state = restored
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return ckpt_path, None, None
    explicit = _explicit_step(ckpt_path)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if explicit is not None and explicit >= step:
        if rank0:
            channel.say(
                "the checkpoint the script resumes from (%s) is at least as new as the snapshot "
                "of step %d: resuming from the checkpoint" % (ckpt_path, step)
            )
        return ckpt_path, None, None
    import torch

    where = tempfile.mkdtemp(prefix="muster-lightning-snapshot-%d-" % step)
    path = os.path.join(where, "snapshot-step=%d.ckpt" % step)
    try:
        torch.save(state["checkpoint"], path)
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    if rank0:
        channel.say("resuming the Trainer from the snapshot of step %d held by muster" % step)
    return path, where, state["rng"]
