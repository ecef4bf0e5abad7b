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

from . import rng, snapshots

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
    return snapshots.save_if_due(
        int(trainer.global_step),
        sharded(trainer),
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
    restored = snapshots.restored(FORMAT) if sharded(trainer) is None else None
    if restored is None:
        return ckpt_path, None, None
    step, state = restored
    if snapshots.checkpoint_wins(_explicit_step(ckpt_path), ckpt_path, step):
        return ckpt_path, None, None
    import torch

    name = "snapshot-step=%d.ckpt" % step
    where = snapshots.scratch(
        "muster-lightning-snapshot",
        step,
        lambda d: torch.save(state["checkpoint"], os.path.join(d, name)),
    )
    return os.path.join(where, name), where, state["rng"]
