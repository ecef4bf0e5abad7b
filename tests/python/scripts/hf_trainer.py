"""An unmodified Hugging Face Trainer script (it imports nothing of muster's unless --explicit):
a 1-layer GPT-2 built from a config, random tokens, DDP on gloo. Prints:
  STEP <rank> <global_step>          after every optimizer step (then sleeps --step-seconds)
  MUSTER_CALLBACKS <rank> <n>        muster callbacks the Trainer holds, after it is built
  FINAL <rank> <global_step>         after trainer.train() returned (post-training code)
  BEGIN <rank> <attempt> <global_step>  when training begins (after any resume)
  WEIGHTS <rank> <sha256>            of the final parameters' bytes (--print-weights), after trainer.train()
"""

import argparse
import atexit
import hashlib
import os
import signal
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=30)
p.add_argument("--step-seconds", type=float, default=0.0)
p.add_argument("--resume", action="store_true")
# The explicit form, on odd global ranks only: both forms meet in one run.
p.add_argument("--explicit", action="store_true")
# An evaluation of this many seconds once, half way: its batches load slowly (the main thread
# sleeps in the data set, a stack that does not move), as a long evaluation looks to the agent.
p.add_argument("--eval-seconds", type=float, default=0.0)
# Rank 1 dies of SIGKILL right after this global step, in the first attempt only.
p.add_argument("--kill-at", type=int, default=0)
# Print WEIGHTS after training; both ranks then meet in a barrier so that they leave together
# (a rank that outlives its peer by the hash's time can abort in gloo's teardown at exit).
p.add_argument("--print-weights", action="store_true")
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.data = torch.randint(0, 64, (4096, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


class SlowEval(torch.utils.data.Dataset):
    ITEMS = 8

    def __len__(self):
        return self.ITEMS

    def __getitem__(self, i):
        time.sleep(args.eval_seconds / self.ITEMS)
        return {"input_ids": torch.zeros(16, dtype=torch.long), "labels": torch.zeros(16, dtype=torch.long)}


class StepPrinter(TrainerCallback):
    def on_train_begin(self, args_, state, control, **kwargs):
        print(f"BEGIN {rank} {attempt} {state.global_step}", flush=True)

    def on_step_end(self, args_, state, control, **kwargs):
        print(f"STEP {rank} {state.global_step}", flush=True)
        if args.kill_at and state.global_step == args.kill_at and rank == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_seconds)


torch.manual_seed(0)
config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
training = TrainingArguments(
    output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=2,
    save_strategy="no", logging_strategy="no", report_to="none", use_cpu=True,
    ddp_find_unused_parameters=False,
    disable_tqdm=True, dataloader_num_workers=0, seed=0,
    **({"eval_strategy": "steps", "eval_steps": max(1, args.max_steps // 2),
        "per_device_eval_batch_size": 1} if args.eval_seconds else {}),
)
callbacks = [StepPrinter()]
if args.explicit and rank % 2 == 1:
    from muster_frameworks import MusterHFCallback

    callbacks.append(MusterHFCallback())
trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=callbacks,
                  eval_dataset=SlowEval() if args.eval_seconds else None)
count = sum(type(cb).__name__ == "MusterHFCallback" for cb in trainer.callback_handler.callbacks)
print(f"MUSTER_CALLBACKS {rank} {count}", flush=True)
trainer.train(resume_from_checkpoint=True if args.resume else None)
print(f"FINAL {rank} {trainer.state.global_step}", flush=True)
if args.print_weights:
    weights = hashlib.sha256()
    for name, tensor in sorted(trainer.model.state_dict().items()):
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
# That made the abort rarer, not impossible (an HF rank 0 died of it once more in a CI run, after its
# last collective; never in 36 runs here under two CPU hogs): what is left is torch's own race at
# interpreter finalization, its C++ threads dropping tensors while Python takes the GIL down
# (pytorch/pytorch#190489, open upstream; it is not the launcher's). So the script leaves as
# Python would, exit handlers included (muster's and torch's), only without that finalization.
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
