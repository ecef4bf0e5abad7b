"""The checkpoint helper against a fake agent: the barrier's messages both ways, the no-op
outside muster, and the old module name."""

import os
import time

from support import FakeAgent, TestCase


class CheckpointerTest(TestCase):
    def setUp(self):
        super().setUp()
        self.agent = FakeAgent()
        self.addCleanup(self.agent.close)
        os.environ["MUSTER_CHECKPOINT_SOCKET"] = self.agent.name
        from muster_launcher.checkpoint import Checkpointer

        self.Checkpointer = Checkpointer

    def connected(self):
        ckpt = self.Checkpointer()
        self.assertTrue(ckpt.active)
        self.addCleanup(lambda: ckpt._sock is not None and ckpt._sock.close())
        self.agent.lines(until=len)
        return ckpt

    def test_outside_muster_every_call_is_a_no_op(self):
        del os.environ["MUSTER_CHECKPOINT_SOCKET"]
        ckpt = self.Checkpointer()
        self.assertFalse(ckpt.active)
        self.assertFalse(ckpt.should_save(1))
        self.assertFalse(ckpt.saved(1))
        with ckpt.section("eval"):
            pass
        ckpt.failed("nothing")

    def test_no_agent_listening_is_a_no_op(self):
        self.agent.close()
        os.environ["MUSTER_CHECKPOINT_SOCKET"] = "@muster-pytest-nobody-listens"
        self.assertFalse(self.Checkpointer().active)

    def test_hello_then_each_new_step_once(self):
        ckpt = self.connected()
        for step in (1, 1, 2):
            self.assertFalse(ckpt.should_save(step))
        lines = self.agent.lines(until=lambda l: ["step", "2"] in l)
        self.assertEqual(lines[0][0], "hello")
        self.assertEqual([w for w in lines if w[0] == "step"], [["step", "1"], ["step", "2"]])

    def test_a_save_request_is_answered_at_its_step_and_the_commit_ends_training(self):
        ckpt = self.connected()
        ckpt.should_save(3)
        self.agent.send("save 1 5 %d" % (time.time() + 30))
        self.agent.lines(until=lambda l: ["step", "3"] in l)
        deadline = time.monotonic() + 5
        while ckpt.target_step is None and time.monotonic() < deadline:
            ckpt.should_save(4)
        self.assertEqual(ckpt.target_step, 5)
        self.assertTrue(ckpt.should_save(5))
        self.agent.send("commit 1 exit")
        self.assertTrue(ckpt.saved(5, "ckpt 5"))
        self.assertTrue(ckpt.committed)
        self.agent.lines(until=lambda l: ["saved", "1", "5", "ckpt_5"] in l)

    def test_an_operators_checkpoint_continues_and_an_abort_stops(self):
        ckpt = self.connected()
        self.agent.send("save 1 2 0")
        self._until_requested(ckpt, 2)
        self.agent.send("commit 1 continue")
        self.assertFalse(ckpt.saved(2))
        self.agent.send("save 2 4 0")
        self._until_requested(ckpt, 4)
        self.agent.send("abort 2 node 1 could not save")
        self.assertTrue(ckpt.saved(4))
        self.assertEqual(ckpt.aborted_reason, "node 1 could not save")

    def test_a_request_for_a_step_already_passed_is_reported_missed(self):
        ckpt = self.connected()
        self.agent.send("save 1 2 0")
        time.sleep(0.2)
        self.assertFalse(ckpt.should_save(3))
        self.agent.lines(until=lambda l: ["missed", "1", "3"] in l)
        self.assertIsNone(ckpt.target_step)

    def test_sections_and_failures_are_told(self):
        ckpt = self.connected()
        with ckpt.section("eval\nloop"):
            pass
        self.agent.send("save 1 1 0")
        self._until_requested(ckpt, 1)
        ckpt.failed("disk\nfull")
        lines = self.agent.lines(until=lambda l: any(w[0] == "failed" for w in l))
        self.assertIn(["section", "eval", "loop"], lines)
        self.assertIn(["endsection"], lines)
        self.assertIn(["failed", "1", "disk", "full"], lines)

    def test_the_old_module_name_is_the_same_module(self):
        import muster_checkpoint
        import muster_launcher.checkpoint

        self.assertIs(muster_checkpoint, muster_launcher.checkpoint)
        self.assertIs(muster_checkpoint.Checkpointer, self.Checkpointer)

    def _until_requested(self, ckpt, step):
        deadline = time.monotonic() + 5
        while not ckpt.should_save(step):
            self.assertLess(time.monotonic(), deadline, "no save request arrived")
            time.sleep(0.01)
