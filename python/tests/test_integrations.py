"""The framework integrations with stand-ins for transformers and Lightning (no framework, no
torch): the registry, the callback added once to every Trainer built, the old module name, and
one gang checkpoint through a fake agent."""

import os
import sys
import threading

from support import FakeAgent, TestCase

FAKE_TRANSFORMERS = {
    "transformers/__init__.py": """
        class TrainerCallback:
            pass
    """,
    "transformers/trainer.py": """
        class _Handler:
            def __init__(self, callbacks):
                self.callbacks = list(callbacks)
        class Trainer:
            def __init__(self, callbacks=()):
                self.callback_handler = _Handler(callbacks)
            def add_callback(self, callback):
                self.callback_handler.callbacks.append(callback)
            def train(self, fail=None):
                if fail:
                    raise fail
                return "trained"
    """,
}

FAKE_LIGHTNING = {
    "lightning/__init__.py": "",
    "lightning/pytorch/__init__.py": "",
    "lightning/pytorch/callbacks.py": """
        class Callback:
            pass
    """,
    "lightning/pytorch/trainer/__init__.py": "",
    "lightning/pytorch/trainer/trainer.py": """
        class Trainer:
            def __init__(self, callbacks=None, default_root_dir="."):
                self.callbacks = list(callbacks or [])
                self.default_root_dir = default_root_dir
                self.global_step = 0
                self.should_stop = False
                self.saved = []
            def save_checkpoint(self, path, weights_only=False):
                self.saved.append(path)
    """,
}


class Step:
    """What a callback reads from HF's `state` and `args` and writes to its `control`."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class IntegrationsTest(TestCase):
    def setUp(self):
        super().setUp()
        self.write_modules(FAKE_TRANSFORMERS)
        self.write_modules(FAKE_LIGHTNING)
        os.environ["MUSTER_CHECKPOINT_SOCKET"] = "@muster-pytest-nobody-listens"
        from muster_launcher import integrations
        from muster_launcher.integrations import barrier

        self.integrations = integrations
        self.addCleanup(self.close_helper, barrier)

    def close_helper(self, barrier):
        ckpt = barrier._shared["checkpointer"]
        if ckpt is not None and ckpt._sock is not None:
            ckpt._sock.close()

    def muster_callbacks(self, callbacks):
        return [cb for cb in callbacks if getattr(cb, "_muster_callback", False)]

    def test_every_registered_integration_has_what_sitecustomize_needs(self):
        self.assertEqual(self.integrations.INTEGRATIONS, ("transformers", "lightning"))
        for module in self.integrations.modules():
            self.assertTrue(module.HOOKED, module)
            self.assertTrue(callable(module.install), module)
        # Importing them imported no framework.
        self.assertNotIn("transformers", sys.modules)
        self.assertNotIn("lightning", sys.modules)

    def test_every_trainer_built_gets_one_callback(self):
        self.integrations.install()
        import lightning.pytorch.trainer.trainer as pl
        import transformers.trainer as hf

        trainer = hf.Trainer()
        self.assertEqual(len(self.muster_callbacks(trainer.callback_handler.callbacks)), 1)
        own = self.integrations.MusterHFCallback()
        trainer = hf.Trainer(callbacks=[own])
        self.assertEqual(self.muster_callbacks(trainer.callback_handler.callbacks), [own])
        self.assertEqual(trainer.train(), "trained")
        self.assertEqual(len(self.muster_callbacks(pl.Trainer().callbacks)), 1)

    def test_switched_off_no_callback_is_added_but_the_explicit_form_works(self):
        os.environ["MUSTER_FRAMEWORK_CALLBACKS"] = "0"
        self.integrations.install()
        import transformers.trainer as hf

        self.assertEqual(hf.Trainer().callback_handler.callbacks, [])
        from muster_frameworks import MusterHFCallback, MusterLightningCallback

        self.assertIs(MusterHFCallback, self.integrations.MusterHFCallback)
        self.assertEqual(MusterLightningCallback.__mro__[1].__module__,
                         "lightning.pytorch.callbacks")

    def test_the_old_module_name_is_the_same_module(self):
        import muster_frameworks

        self.assertIs(muster_frameworks, self.integrations)

    def test_a_lightning_rank_saves_at_the_agreed_step_and_leaves_on_commit(self):
        agent = FakeAgent()
        self.addCleanup(agent.close)
        os.environ["MUSTER_CHECKPOINT_SOCKET"] = agent.name
        self.integrations.install()
        import lightning.pytorch.trainer.trainer as pl

        trainer = pl.Trainer(default_root_dir=self.tmp)
        (callback,) = self.muster_callbacks(trainer.callbacks)
        callback.on_train_start(trainer, None)
        agent.lines(until=lambda l: ["step", "0"] in l)
        agent.send("save 1 2 0")
        threading.Timer(0.3, agent.send, ("commit 1 exit",)).start()
        with self.assertRaises(SystemExit) as left:
            for step in (1, 2, 3):
                trainer.global_step = step
                callback.on_train_batch_end(trainer, None, None, None, step)
        self.assertEqual(left.exception.code, 0)
        path = os.path.join(self.tmp, "muster-preempt-step=2.ckpt")
        self.assertEqual(trainer.saved, [path])
        self.assertTrue(trainer.should_stop)
        lines = agent.lines(until=lambda l: any(w[0] == "saved" for w in l))
        self.assertIn(["saved", "1", "2", "muster-preempt-step=2.ckpt"], lines)

    def test_an_hf_save_that_raises_is_told_to_the_agent(self):
        agent = FakeAgent()
        self.addCleanup(agent.close)
        os.environ["MUSTER_CHECKPOINT_SOCKET"] = agent.name
        self.integrations.install()
        import transformers.trainer as hf

        trainer = hf.Trainer()
        (callback,) = self.muster_callbacks(trainer.callback_handler.callbacks)
        state, control = Step(global_step=0), Step(should_save=False)
        callback.on_train_begin(None, state, control)
        agent.lines(until=lambda l: ["step", "0"] in l)
        agent.send("save 1 1 0")
        deadline = 50
        while not control.should_save and deadline:
            state.global_step = 1
            callback.on_step_end(None, state, control)
            deadline -= 1
            threading.Event().wait(0.02)
        self.assertTrue(control.should_save)
        with self.assertRaises(OSError):
            trainer.train(fail=OSError("disk full"))
        lines = agent.lines(until=lambda l: any(w[0] == "failed" for w in l))
        self.assertIn(["failed", "1", "OSError:", "disk", "full"], lines)
