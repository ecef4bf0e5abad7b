"""An unmodified Lightning script (it imports nothing of muster's unless --explicit): a tiny
LightningModule, random data, DDP on gloo. Prints:
  STEP <rank> <global_step>          after every training batch (then sleeps --step-seconds)
  MUSTER_CALLBACKS <rank> <n>        muster callbacks the Trainer holds, after it is built
  FINAL <rank> <global_step>         after trainer.fit() returned (post-training code)
  BEGIN <rank> <attempt> <global_step>  when training starts (after any resume)
  WEIGHTS <rank> <sha256>            of the final parameters' bytes (--print-weights), after trainer.fit()
"""

import argparse
import atexit
import glob
import hashlib
import os
import signal
import sys
import time

import lightning as L
import torch

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=30)
p.add_argument("--step-seconds", type=float, default=0.0)
p.add_argument("--resume", action="store_true")
# The explicit form, on odd global ranks only: both forms meet in one run.
p.add_argument("--explicit", action="store_true")
# Rank 1 dies of SIGKILL right after this global step, in the first attempt only.
p.add_argument("--kill-at", type=int, default=0)
# Print WEIGHTS after training; both ranks then meet in a barrier so that they leave together
# (a rank that outlives its peer by the hash's time can abort in gloo's teardown at exit).
p.add_argument("--print-weights", action="store_true")
p.add_argument("--samples", type=int, default=4096)
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # Dropout draws from torch's generator: a resume that lost the RNG state trains on
        # different masks.
        hidden = torch.nn.functional.dropout(torch.relu(self.layer(x)), 0.5, self.training)
        return torch.nn.functional.mse_loss(self.head(hidden), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)]


class StepPrinter(L.Callback):
    def on_train_start(self, trainer, pl_module):
        print(f"BEGIN {rank} {attempt} {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"STEP {rank} {trainer.global_step}", flush=True)
        if args.kill_at and trainer.global_step == args.kill_at and rank == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_seconds)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(args.samples, 8), torch.randn(args.samples, 1))
callbacks = [StepPrinter()]
if args.explicit and rank % 2 == 1:
    from muster_frameworks import MusterLightningCallback

    callbacks.append(MusterLightningCallback())
trainer = L.Trainer(
    max_steps=args.max_steps, accelerator="cpu", strategy="ddp",
    devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
    default_root_dir=args.out, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
)
count = sum(type(cb).__name__ == "MusterLightningCallback" for cb in trainer.callbacks)
print(f"MUSTER_CALLBACKS {rank} {count}", flush=True)
ckpt = None
if args.resume:
    ckpt = sorted(glob.glob(os.path.join(args.out, "muster-preempt-step=*.ckpt")))[-1]
trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt)
print(f"FINAL {rank} {trainer.global_step}", flush=True)
if args.print_weights:
    weights = hashlib.sha256()
    for name, tensor in sorted(trainer.lightning_module.state_dict().items()):
        weights.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    print(f"WEIGHTS {rank} {weights.hexdigest()}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
# What PyTorch asks of every script (its docs, "Shutdown"): a process that leaves with its gloo
# group alive can abort in the group's teardown at exit ("terminate called without an active
# exception", SIGABRT) once its peer has gone, under torchrun as under muster: a trained job
# would end 134 now and then. The Trainer does not do it; the script does, as real ones should.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
# And it leaves without the interpreter's finalization, exit handlers included: torch's race there
# (pytorch/pytorch#190489) is not the launcher's; hf_trainer.py says more.
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
