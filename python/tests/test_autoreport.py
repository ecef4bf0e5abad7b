"""The zero-code reporter against a fake agent, with stand-ins for the torch modules it hooks
(no torch): what it sends, that it never raises into the script, that it stands down for the
helper, and that installing it waits for torch's modules."""

import io
import os
import sys

from support import FakeAgent, TestCase

# The three torch modules the reporter hooks, as small as its hooks need them.
FAKE_TORCH = {
    "torch/__init__.py": "",
    "torch/optim/__init__.py": "",
    "torch/optim/optimizer.py": """
        hooks = []
        def register_optimizer_step_post_hook(hook):
            hooks.append(hook)
        class Optimizer:
            def step(self):
                for hook in hooks:
                    hook(self, (), {})
    """,
    "torch/distributed/__init__.py": "",
    "torch/distributed/distributed_c10d.py": """
        calls = []
        def init_process_group(*args, **kwargs):
            calls.append((args, kwargs))
            return "group"
    """,
    "torch/utils/__init__.py": "",
    "torch/utils/data/__init__.py": "",
    "torch/utils/data/dataloader.py": """
        class _BaseDataLoaderIter:
            def __init__(self, items):
                self._items = iter(items)
            def __next__(self):
                return next(self._items)
    """,
}


class Optimizer:
    """Stands in for a torch optimizer: only identity matters to the hook."""


class ReporterTest(TestCase):
    def setUp(self):
        super().setUp()
        self.agent = FakeAgent()
        self.addCleanup(self.agent.close)
        os.environ["MUSTER_CHECKPOINT_SOCKET"] = self.agent.name
        from muster_launcher import autoreport

        self.autoreport = autoreport
        self.addCleanup(lambda: autoreport._reporter is not None and autoreport._reporter.stop())

    def steps(self, lines):
        return [int(w[1]) for w in lines if w[0] == "step"]

    def test_the_lead_optimizers_steps_are_reported_and_the_others_are_liveness(self):
        os.environ.update(LOCAL_RANK="1", RANK="3")
        self.addCleanup(os.environ.pop, "LOCAL_RANK")
        self.addCleanup(os.environ.pop, "RANK")
        reporter = self.autoreport._the_reporter()
        d, g = Optimizer(), Optimizer()
        for opt in (d, g, d, g, d):
            self.assertIsNone(reporter.on_step(opt, (), {}))
        lines = self.agent.lines(until=lambda l: 3 in self.steps(l))
        self.assertEqual(lines[0], ["watch", "1", "3", str(os.getpid())])
        steps = self.steps(lines)
        self.assertEqual((steps[0], steps[-1]), (1, 3))
        self.assertEqual(reporter._other_steps, 2)

    def test_standing_down_for_the_helper_stops_the_reports(self):
        reporter = self.autoreport._the_reporter()
        reporter.on_step(Optimizer(), (), {})
        self.agent.lines(until=lambda l: 1 in self.steps(l))
        self.autoreport.stand_down()
        self.assertTrue(reporter._off)

    def test_no_agent_turns_it_off_with_one_line(self):
        reporter = self.autoreport._Reporter("@muster-pytest-nobody-listens")
        err, sys.stderr = sys.stderr, io.StringIO()
        try:
            for _ in range(3):
                self.assertIsNone(reporter.on_step(Optimizer(), (), {}))
            said = sys.stderr.getvalue()
        finally:
            sys.stderr = err
        self.assertEqual(said.count("muster: zero-code step reports off: cannot reach"), 1, said)

    def test_install_waits_for_torch_then_hooks_steps_init_and_batches(self):
        self.write_modules(FAKE_TORCH)
        self.autoreport.install()
        self.assertNotIn("torch.optim.optimizer", sys.modules)
        from torch.optim.optimizer import Optimizer as TorchOptimizer
        import torch.distributed.distributed_c10d as c10d
        import torch.utils.data.dataloader as dataloader

        self.assertEqual(c10d.init_process_group("nccl"), "group")
        self.assertTrue(c10d.init_process_group._muster_wrapped)
        TorchOptimizer().step()
        self.assertEqual(next(dataloader._BaseDataLoaderIter([7])), 7)
        lines = self.agent.lines(until=lambda l: 1 in self.steps(l))
        self.assertEqual([w[0] for w in lines[:3]], ["watch", "init", "initdone"])
        self.assertEqual(self.autoreport._reporter._batches, 1)

    def test_install_is_a_no_op_when_switched_off(self):
        self.write_modules(FAKE_TORCH)
        os.environ["MUSTER_AUTO_STEP_REPORTS"] = "off"
        self.autoreport.install()
        import torch.optim.optimizer as optimizer

        self.assertEqual(optimizer.hooks, [])

    def test_a_helper_that_connects_stands_the_reporter_down(self):
        from muster_launcher.checkpoint import Checkpointer

        ckpt = Checkpointer()
        self.addCleanup(ckpt._sock.close)
        self.assertTrue(self.autoreport._standing_down)
        self.assertIsNone(self.autoreport._the_reporter())
