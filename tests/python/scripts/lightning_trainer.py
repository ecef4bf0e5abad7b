"""An unmodified Lightning script (it imports nothing of muster's unless --explicit): a tiny
LightningModule, random data, DDP on gloo. Prints:
  STEP <rank> <global_step>          after every training batch (then sleeps --step-seconds)
  MUSTER_CALLBACKS <rank> <n>        muster callbacks the Trainer holds, after it is built
  FINAL <rank> <global_step>         after trainer.fit() returned (post-training code)
"""

import argparse
import glob
import os
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
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepPrinter(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"STEP {rank} {trainer.global_step}", flush=True)
        time.sleep(args.step_seconds)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
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
