"""In-memory snapshots of a Hugging Face Trainer (`--snapshot-every N`) with no code in the script.

Save: every N global steps the callback hands the Trainer's whole resumable state to the agent
(`snapshot.save`): the model's and the optimizer's state dicts, the LR scheduler's, the grad
scaler's, `TrainerState` (global step, epoch, log history), and this rank's RNG states — what
`Trainer._save_checkpoint` writes into `checkpoint-<step>`, taken at the same point of the step
(right after the optimizer step, before `_maybe_log_save_evaluate`).

Restore: on a restart within the job, `Trainer.train` resumes from the newest committed snapshot
as if `resume_from_checkpoint` named it: the state is written once into a private temporary
directory in the Trainer's own checkpoint layout, and the Trainer's own resume reads it (model,
optimizer, scheduler, scaler, RNG, and the data position: it skips the batches already trained,
as from a checkpoint on storage). A checkpoint the script asks for that is at least as new as the
snapshot wins. Sharded engines (DeepSpeed, FSDP) are not snapshotted: their state dict is not the
model's (one line says so, and training goes on).
"""

import dataclasses
import json
import os

from . import rng, snapshots

# Marks a state this module wrote: a snapshot of something else (the plain-loop helper in the
# same job) is never fed to the Trainer.
FORMAT = "muster-transformers-1"

# The Trainer's checkpoint file names (transformers.trainer's constants, stable since v4).
_WEIGHTS = "pytorch_model.bin"
_OPTIMIZER = "optimizer.pt"
_SCHEDULER = "scheduler.pt"
_SCALER = "scaler.pt"
_STATE = "trainer_state.json"


def sharded(trainer):
    """Why this Trainer's state cannot be snapshotted here, or None."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed holds the model and optimizer state"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP shards the model and optimizer state"
    return None


def _scaler(trainer):
    accelerator = getattr(trainer, "accelerator", None)
    return getattr(accelerator, "scaler", None)


def state_of(trainer, state):
    """The Trainer's resumable state after global step `state.global_step`."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    scaler = _scaler(trainer)
    return {
        "format": FORMAT,
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
        "rng": rng.states(),
    }


def save(trainer, state):
    """Hands the state to the agent when a snapshot is due at this global step."""
    return snapshots.save_if_due(
        int(state.global_step), sharded(trainer), lambda: state_of(trainer, state)
    )


def _explicit_step(trainer, resume):
    """The global step of the checkpoint the script asks for, or None when it asks for none."""
    if resume is None or resume is False:
        return None
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint

        resume = get_last_checkpoint(trainer.args.output_dir)
        if resume is None:
            return None
    try:
        with open(os.path.join(str(resume), _STATE), encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        # Not a checkpoint muster can read: the Trainer says what is wrong with it.
        return float("inf")


def _write(trainer, state, where):
    """`state` in the Trainer's checkpoint layout under `where`."""
    import torch

    torch.save(state["model"], os.path.join(where, _WEIGHTS))
    torch.save(state["optimizer"], os.path.join(where, _OPTIMIZER))
    if state["scheduler"] is not None:
        torch.save(state["scheduler"], os.path.join(where, _SCHEDULER))
    if state["scaler"] is not None:
        torch.save(state["scaler"], os.path.join(where, _SCALER))
    args = trainer.args
    name = "rng_state_%d.pth" % args.process_index if args.world_size > 1 else "rng_state.pth"
    torch.save(state["rng"], os.path.join(where, name))
    with open(os.path.join(where, _STATE), "w", encoding="utf-8") as f:
        f.write(state["trainer_state"])


def resume_point(trainer, resume):
    """What `train(resume_from_checkpoint=...)` gets: `resume` itself, or a directory holding the
    newest committed snapshot when it is newer than what the script asks for. Returns
    `(resume, directory to remove after training or None)`."""
    restored = snapshots.restored(FORMAT) if sharded(trainer) is None else None
    if restored is None:
        return resume, None
    step, state = restored
    explicit = _explicit_step(trainer, resume)
    if snapshots.checkpoint_wins(explicit, "step %s" % explicit, step):
        return resume, None
    where = snapshots.scratch("muster-hf-snapshot", step, lambda d: _write(trainer, state, d))
    return where, where
