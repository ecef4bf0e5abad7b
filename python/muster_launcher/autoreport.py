"""muster's zero-code step reports and liveness, for training scripts that do not use the helper.

muster's `sitecustomize` calls `install()` when the script first imports a module in `HOOKED`:
then a global optimizer step hook (`torch.optim.optimizer.register_optimizer_step_post_hook`) is
registered, lazily: nothing here imports torch, and until the first optimizer step nothing else
happens. From then on the rank reports its steps to the agent and says when it is alive, so the
hang watch (--hang-timeout), the step metrics and the dry run cover unmodified scripts: a plain
loop, HF Trainer, Lightning.

**What a step is.** One `step()` of the *lead* optimizer, the first optimizer instance that steps
in the process. Other optimizers' steps (a GAN's second optimizer, parameter groups split over
several optimizers) are liveness, not steps. With gradient accumulation a step is an optimizer
update, as HF's and Lightning's `global_step` count it; a step that AMP's GradScaler skips
(inf/NaN gradients) calls no `step()` and is not counted. Steps are counted in the process from
1: the reporter cannot know which step a resumed script starts from.

**Liveness.** Silence is not a hang: scripts evaluate, save and load data for long stretches
without an optimizer step. Once per interval (the agent sends it, from the hang limit) a daemon
thread sends `alive` when, since the last interval, the thread that steps the lead optimizer
(the *stepping thread*) did any of:
- a forward pass: it called any `torch.nn.Module` (training, `no_grad` evaluation,
  `inference_mode`). A global forward pre-hook (`register_module_forward_pre_hook`) is armed once
  per interval and removes itself at the first module call it sees, so the cost is one hook call
  per interval, not one per module call;
- drew a batch from a `torch.utils.data.DataLoader` (its iterator's `__next__` returned);
- stepped another optimizer than the lead one;
- moved its stack: the innermost two frames or their positions differ between two samples of
  `sys._current_frames()` taken every `_SAMPLE_S` (data preparation and saving in Python).
A rank blocked in a collective, a lock, a sleep, a socket read or a data loader that never
returns does none of these. Not counted: CPU time (a CUDA synchronisation spins while it waits for
a hung NCCL collective), and other threads' work (a thread that evaluates while the stepping thread
is blocked does not hide the block). Caveats: one long C call (a huge `torch.load`, a single long
kernel synchronisation) is not liveness, nor is a loop of bare tensor functions that are not
modules, whose time is spent in one C call on one line (its stack looks still); ranks that wait in a
collective while one peer works alone for longer than the limit are stalled (the hang watch then
names the working rank, as for any hang).

**Not twice.** When the script uses the helper (`checkpoint.Checkpointer`, directly or
through muster's framework callbacks), its step reports are the rank's steps: the Checkpointer
calls `stand_down()` when it connects and this reporter stops for good; the agent also ignores a
reporter's messages for a local rank that has a helper connected.

It has its own connection to MUSTER_CHECKPOINT_SOCKET and says `watch`, not `hello`, so the agent
knows the rank only reports: a rank without the helper cannot save, and the checkpoint barrier
keeps forwarding SIGTERM to such scripts. Messages (newline-terminated ASCII words):
  worker -> agent: "watch <local_rank> <rank> <pid>", "step <n>", "alive",
                   "faulthandler <signum> <path>", "init", "initdone",
                   "exiting" (the script finished: from an atexit hook, before the interpreter
                   removes faulthandler's handlers; the agent then neither takes a slow teardown
                   for a hang nor signals the rank for its stacks)
  agent -> worker: "interval <ms>" (how often to say alive; 0: never, the hang watch is off)

**Before the first step.** `torch.distributed.init_process_group` is wrapped (when
`torch.distributed.distributed_c10d` is imported, before `torch.distributed` re-exports it): the
rank connects when it enters it and says `init`, and `initdone` when it returns or raises, so the
agent's --startup-timeout sees a rank whose process group never forms. The wrapper passes its
arguments through, returns what torch returns and lets torch's exceptions through untouched.
Scripts that never call it are not watched before their first step.

Nothing here may break the script: every hook body is wrapped, and a failure turns the reporter
off with at most one line on stderr. Off switch: MUSTER_AUTO_STEP_REPORTS=0 (what muster exports
for `--auto-step-reports off`). Standard library only.
"""

import os
import sys
from time import monotonic as _monotonic

from . import channel

__all__ = ["install", "stand_down", "HOOKED"]

SWITCH_ENV = "MUSTER_AUTO_STEP_REPORTS"
_TARGET = "torch.optim.optimizer"
_C10D = "torch.distributed.distributed_c10d"
_MODULES = "torch.nn.modules.module"
_DATALOADER = "torch.utils.data.dataloader"
# The modules whose import installs the reporter (muster's sitecustomize is generated from it).
HOOKED = (_TARGET, _C10D, _DATALOADER)

# How often the stack is sampled. Frequent enough that a loop whose iterations mostly wait in one
# call (a GPU evaluation waiting in `.item()`) is still seen moving between calls; cheap enough
# (a few microseconds with the GIL per sample) to cost nothing measurable.
_SAMPLE_S = 0.1
# How often `alive` may be sent before the agent says otherwise.
_DEFAULT_INTERVAL_S = 1.0
# Steps closer together than this share one report: a send costs several microseconds (the
# agent is woken for each), a fast loop's every step need not. The sampler sends a step left
# unsent within _SAMPLE_S, so the agent never sees the rank stop short of its last step.
_MIN_REPORT_GAP_S = 0.01
# Unsent bytes past this mean the agent stopped reading: the reporter turns itself off rather
# than buffer without bound.
_MAX_PENDING = 64 * 1024

_reporter = None
_hooked = False
_standing_down = False


def _say_once(message):
    channel.say("zero-code step reports off: %s" % message)


class _Reporter:
    """One process's step reports and liveness, over its own connection to the agent."""

    def __init__(self, path):
        self._path = path
        self._off = False
        self._sock = None
        self._lock = None
        self._pending = b""
        # A weak reference to the lead optimizer (a strong one would keep its state alive).
        self._lead = None
        self._step = 0
        # The last step sent, and when the next may be.
        self._sent = 0
        self._next_report = 0.0
        # Steps of other optimizers: liveness.
        self._other_steps = 0
        # The thread that steps the lead optimizer: the one whose stack is sampled.
        self._thread = None
        self._interval = _DEFAULT_INTERVAL_S
        self._inbox = b""
        # Forward passes and batches drawn on the stepping thread: liveness. The forward hook is
        # registered only while armed (its handle here), see `_arm_forward_hook`.
        self._forwards = 0
        self._batches = 0
        self._armed = None

    # -- the optimizer hook: the only code on the training loop's path -----------------------

    def on_step(self, optimizer, args, kwargs):
        if self._off:
            return
        try:
            lead = self._lead() if self._lead is not None else None
            if lead is not optimizer:
                if lead is not None:
                    self._other_steps += 1
                    return
                import weakref

                self._lead = weakref.ref(optimizer)
                # The stepping thread is the one whose stack says alive (the connection may
                # have been opened by init_process_group on another thread).
                self._thread = _thread_ident()
            self._step += 1
            if self._step == 1:
                # The rank's imports are done by its first step: the warm standby's list.
                from . import standby

                standby.record_modules()
            if self._sock is None and not self._start():
                return
            now = _monotonic()
            if now >= self._next_report:
                self._next_report = now + _MIN_REPORT_GAP_S
                self._report_step()
        except Exception as err:  # never raise into the training loop
            self.stop("%r" % (err,))

    def on_init(self, word):
        """`init` or `initdone`, from the init_process_group wrapper (connecting at `init`)."""
        if self._off:
            return
        try:
            if self._sock is None and not self._start():
                return
            self._send(word)
        except Exception as err:  # never raise into the script's init_process_group
            self.stop("%r" % (err,))

    def on_forward(self, module, args):
        """The armed global forward pre-hook: counts one forward pass of the stepping thread and
        disarms (the sampler arms it again at the next interval)."""
        try:
            if self._off:
                self._disarm()
            elif _thread_ident() == self._thread:
                self._forwards += 1
                self._disarm()
        except Exception as err:  # never raise into the model's forward
            self.stop("forward hook: %r" % (err,))
        return None

    def on_batch(self):
        """A batch drawn from a DataLoader (its iterator's `__next__` returned)."""
        try:
            if not self._off and _thread_ident() == self._thread:
                self._batches += 1
        except Exception as err:  # never raise into the script's data loading
            self.stop("batch count: %r" % (err,))

    def _arm_forward_hook(self):
        """Registers the forward pre-hook unless it is registered. A global module hook makes
        every module call take torch's slower hook path, so it is there only until the first
        module call after arming; from the sampler thread, once per interval."""
        if self._armed is not None or self._off:
            return
        module = sys.modules.get(_MODULES)
        register = getattr(module, "register_module_forward_pre_hook", None)
        if register is None:
            return
        self._armed = register(self.on_forward)

    def _disarm(self):
        handle, self._armed = self._armed, None
        if handle is not None:
            handle.remove()

    # -- plumbing ------------------------------------------------------------------------------

    def _start(self):
        """Connects and starts the sampler, at the first step (worker subprocesses that never
        step an optimizer, such as data loader workers, never connect)."""
        import _thread
        import threading

        self._thread = _thread.get_ident()
        try:
            self._sock = channel.connect(self._path)
        except OSError as err:
            self.stop("cannot reach the agent at %s (%s)" % (self._path, err))
            return False
        self._lock = threading.Lock()
        self._send((channel.hello("watch") + "\n").encode("ascii", "replace"))
        self._register_faulthandler()
        import atexit

        # Registered after torch's own exit handlers (torch is imported by now), so it runs
        # before them: atexit calls the last registered first.
        atexit.register(self._at_exit)
        thread = threading.Thread(target=self._sample, name="muster-liveness", daemon=True)
        thread.start()
        return True

    def _report_step(self):
        """Sends the latest step, unless it was sent: from the hook and from the sampler, under
        the lock, so the agent sees steps in order."""
        with self._lock:
            step = self._step
            if step != self._sent:
                self._sent = step
                self._send_locked(b"step %d\n" % step)

    def _send(self, data):
        with self._lock:
            self._send_locked(data)

    def _send_locked(self, data):
        sock = self._sock
        if sock is None:
            return
        data = self._pending + data if self._pending else data
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            # The agent is gone (it ended, or closed a connection it did not like).
            self._sock = None
            self._off = True
            sock.close()
            return
        self._pending = data[sent:]
        if len(self._pending) > _MAX_PENDING:
            self._sock = None
            self._off = True
            sock.close()

    def stop(self, why=None):
        """Turns the reporter off for good (the hook stays registered and returns at once)."""
        if self._off:
            return
        self._off = True
        if why:
            _say_once(why)
        try:
            self._disarm()
        except Exception:
            pass
        if self._lock is None:
            return
        # Under the lock: a send in flight on another thread must not reach a descriptor number
        # that the script reopened meanwhile.
        with self._lock:
            sock, self._sock = self._sock, None
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def _at_exit(self):
        """The script finished and the interpreter exits: say so, then stop."""
        if self._off:
            return
        try:
            self._send(b"exiting\n")
        except Exception:
            pass
        self.stop()

    def after_fork(self):
        """A forked child shares the parent's connection: it must never write to it. A forward
        hook armed at the fork removes itself at the child's first module call."""
        self._off = True
        self._sock = None

    def _register_faulthandler(self):
        """The agent's fallback for reading stacks where py-spy cannot, shared with the helper."""
        message = channel.register_faulthandler()
        if message is not None:
            self._send((message + "\n").encode("ascii", "replace"))

    def _read_agent(self):
        """The agent's lines so far (only `interval <ms>`)."""
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                chunk = sock.recv(4096)
            except BlockingIOError:
                break
            except OSError:
                self.stop()
                return
            if not chunk:
                self.stop()
                return
            self._inbox += chunk
        lines = self._inbox.split(b"\n")
        self._inbox = lines.pop()[-1024:]
        for line in lines:
            words = line.split()
            if len(words) == 2 and words[0] == b"interval":
                self._interval = int(words[1]) / 1000.0

    def _sample(self):
        """The sampler thread: `alive` when the stepping thread's stack moved."""
        try:
            import select
            import time

            # poll, not select: a training process may hold more than 1024 descriptors.
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            last = None
            moved = False
            others = self._other_steps
            forwards = self._forwards
            batches = self._batches
            step = self._step
            due = time.monotonic() + self._interval
            self._arm_forward_hook()
            while not self._off:
                if self._sock is None:
                    return
                if poller.poll(_SAMPLE_S * 1000.0):
                    self._read_agent()
                if self._sent != self._step:
                    self._report_step()
                elif self._pending:
                    self._send(b"")
                if self._interval <= 0:
                    # The hang watch is off: nothing to say between steps.
                    due = time.monotonic() + _SAMPLE_S
                    continue
                frame = sys._current_frames().get(self._thread)
                if frame is None:
                    # The stepping thread ended: nothing to watch (the agent sees its exit).
                    return
                back = frame.f_back
                here = (
                    id(frame),
                    frame.f_lasti,
                    id(back) if back is not None else 0,
                    back.f_lasti if back is not None else -1,
                )
                # No frame may outlive the sample: it would keep the script's locals alive.
                del frame, back
                if here != last:
                    moved = moved or last is not None
                    last = here
                if (self._other_steps, self._forwards, self._batches) != (others, forwards, batches):
                    others, forwards, batches = self._other_steps, self._forwards, self._batches
                    moved = True
                now = time.monotonic()
                if now < due:
                    continue
                due = now + self._interval
                if moved and self._step == step:
                    self._send(b"alive\n")
                moved = False
                step = self._step
                self._arm_forward_hook()
        except Exception as err:  # the sampler is a helper thread: it must never be noisy
            if not self._off and sys is not None and not sys.is_finalizing():
                self.stop("liveness sampler: %r" % (err,))


def _thread_ident():
    import _thread

    return _thread.get_ident()


def _the_reporter():
    """This process's reporter, made at the first need; None when standing down."""
    global _reporter
    if _reporter is None and not _standing_down:
        path = os.environ.get(channel.SOCKET_ENV, "")
        if not path:
            return None
        _reporter = _Reporter(path)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_reporter.after_fork)
    return _reporter


def _hook(module):
    """Registers the step hook on torch.optim.optimizer, once it is imported."""
    global _hooked
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is None or _hooked or _standing_down:
        return
    reporter = _the_reporter()
    if reporter is None:
        return
    register(reporter.on_step)
    _hooked = True


def _wrap_init(module):
    """Wraps init_process_group in torch.distributed.distributed_c10d (and in
    torch.distributed, when that already took the original)."""
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_muster_wrapped", False):
        return
    import functools

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        reporter = _the_reporter()
        if reporter is not None:
            reporter.on_init(b"init\n")
        try:
            return original(*args, **kwargs)
        finally:
            if reporter is not None:
                reporter.on_init(b"initdone\n")

    init_process_group._muster_wrapped = True
    module.init_process_group = init_process_group
    package = sys.modules.get("torch.distributed")
    if package is not None and getattr(package, "init_process_group", None) is original:
        package.init_process_group = init_process_group


def _wrap_batches(module):
    """Counts the batches a DataLoader iterator returns (every iterator class inherits
    `_BaseDataLoaderIter.__next__`)."""
    base = getattr(module, "_BaseDataLoaderIter", None)
    original = getattr(base, "__next__", None)
    if original is None or getattr(original, "_muster_wrapped", False):
        return
    import functools

    @functools.wraps(original)
    def __next__(self):
        batch = original(self)
        reporter = _reporter
        if reporter is not None:
            reporter.on_batch()
        return batch

    __next__._muster_wrapped = True
    base.__next__ = __next__


def _batches_failed(module, err):
    _say_once("cannot count DataLoader batches: %r" % (err,))


def _wrap_failed(module, err):
    _say_once("cannot wrap init_process_group: %r" % (err,))


def _hook_failed(module, err):
    _say_once("cannot register the optimizer hook: %r" % (err,))


def install():
    """Called by muster's sitecustomize: hooks torch's optimizer steps when torch is imported.
    A no-op outside muster (no MUSTER_CHECKPOINT_SOCKET) and when switched off."""
    if not channel.switched_on(SWITCH_ENV):
        return
    from .importhook import after_import

    after_import([_TARGET], _hook, _hook_failed)
    after_import([_C10D], _wrap_init, _wrap_failed)
    after_import([_DATALOADER], _wrap_batches, _batches_failed)


def stand_down():
    """Called by `checkpoint.Checkpointer` when it connects: the script reports its own
    steps, so this reporter stops (or never starts)."""
    global _standing_down
    _standing_down = True
    if _reporter is not None:
        _reporter.stop()
