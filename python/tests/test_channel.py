"""The channel to the agent: the socket's address, the on/off switch, the hello line, the one
error line, and the stacks fallback both connections announce."""

import io
import os
import sys

from support import FakeAgent, TestCase


class ChannelTest(TestCase):
    def setUp(self):
        super().setUp()
        from muster_launcher import channel

        self.channel = channel

    def test_an_at_name_is_an_abstract_socket_and_anything_else_a_path(self):
        self.assertEqual(self.channel.address("@muster-ckpt-1"), "\0muster-ckpt-1")
        self.assertEqual(self.channel.address("/run/agent.sock"), "/run/agent.sock")

    def test_everything_is_off_outside_muster_and_each_switch_turns_its_part_off(self):
        self.assertFalse(self.channel.under_muster())
        self.assertFalse(self.channel.switched_on("MUSTER_AUTO_STEP_REPORTS"))
        os.environ["MUSTER_CHECKPOINT_SOCKET"] = "@x"
        self.assertTrue(self.channel.switched_on("MUSTER_AUTO_STEP_REPORTS"))
        for off in ("0", "false", " Off ", "NO"):
            os.environ["MUSTER_AUTO_STEP_REPORTS"] = off
            self.assertFalse(self.channel.switched_on("MUSTER_AUTO_STEP_REPORTS"), off)
        os.environ["MUSTER_AUTO_STEP_REPORTS"] = "1"
        self.assertTrue(self.channel.switched_on("MUSTER_AUTO_STEP_REPORTS"))

    def test_a_connection_reaches_the_agent_and_names_its_rank(self):
        os.environ.update(LOCAL_RANK="2", RANK="5")
        self.addCleanup(os.environ.pop, "LOCAL_RANK")
        self.addCleanup(os.environ.pop, "RANK")
        with FakeAgent() as agent:
            sock = self.channel.connect(agent.name)
            self.addCleanup(sock.close)
            self.assertFalse(sock.getblocking())
            sock.setblocking(True)
            sock.sendall((self.channel.hello("hello") + "\n").encode())
            self.assertEqual(agent.lines(until=len)[0], ["hello", "2", "5", str(os.getpid())])

    def test_no_agent_is_an_oserror(self):
        with self.assertRaises(OSError):
            self.channel.connect("@muster-pytest-nobody-listens")

    def test_the_error_line_never_raises(self):
        err, sys.stderr = sys.stderr, io.StringIO()
        try:
            self.channel.say("x off")
            self.assertEqual(sys.stderr.getvalue(), "muster: x off\n")
            sys.stderr.close()
            self.channel.say("into a closed stderr")
        finally:
            sys.stderr = err

    def test_the_stacks_fallback_is_registered_once_per_process(self):
        import faulthandler
        import signal

        self.assertIsNone(self.channel.register_faulthandler())
        os.environ["MUSTER_STACKS_DIR"] = self.tmp
        try:
            first = self.channel.register_faulthandler()
            self.assertEqual(first, "faulthandler %d %s" % (
                signal.SIGUSR2, os.path.join(self.tmp, "stacks-%d.txt" % os.getpid())))
            self.assertEqual(self.channel.register_faulthandler(), first)
        finally:
            faulthandler.unregister(signal.SIGUSR2)
            if self.channel._faulthandler[2] is not None:
                self.channel._faulthandler[2].close()
