"""muster's sitecustomize in a fresh interpreter, laid out as muster ships it (one directory first
on PYTHONPATH), with stand-ins for the modules it hooks: what it loads at start, what it loads
later, the prometheus_client patch, the chaining to the user's own sitecustomize, and that its
generated table is current."""

import ast
import json
import os
import subprocess
import sys

import generate_sitecustomize
from support import FakeAgent, TestCase, package_dir
from test_autoreport import FAKE_TORCH

PROBE = r"""
import json, sys
def loaded():
    return sorted(m for m in sys.modules if m.startswith("muster_"))
out = {"start": loaded()}
for name in sys.argv[1:]:
    __import__(name)
out["after"] = loaded()
out["importlib.util"] = "importlib.util" in sys.modules
print("PROBE " + json.dumps(out))
"""

FAKE_PROMETHEUS = {
    "prometheus_client/__init__.py": "from .exposition import start_http_server\n",
    "prometheus_client/exposition.py": """
        def start_http_server(port, addr="0.0.0.0"):
            return "started %s" % port
        start_wsgi_server = start_http_server
    """,
}


class SitecustomizeTest(TestCase):
    def run_probe(self, *imports, shipped=True, **env):
        if shipped:
            shipped = os.path.join(self.tmp, "shipped")
            if not os.path.isdir(shipped):  # a second rank finds the copy the first one used
                package_dir(shipped)
        else:
            shipped = self.tmp
        full = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        full.update(PYTHONPATH=os.pathsep.join([shipped, os.path.join(self.tmp, "user")]), **env)
        p = subprocess.run([sys.executable, "-c", PROBE, *imports], env=full, capture_output=True,
                           text=True, timeout=30, cwd=self.tmp)
        self.assertEqual(p.returncode, 0, p.stderr)
        line = [l for l in p.stdout.splitlines() if l.startswith("PROBE ")]
        self.assertTrue(line, (p.stdout, p.stderr))
        return json.loads(line[0][len("PROBE "):]), p

    def test_a_rank_loads_only_the_import_hook_at_start(self):
        self.write_modules(FAKE_TORCH, os.path.join(self.tmp, "user"))
        out, p = self.run_probe("torch.optim.optimizer", MUSTER_CHECKPOINT_SOCKET="@none",
                                MUSTER_METRICS_PORT="8000")
        self.assertEqual(out["start"], ["muster_launcher", "muster_launcher.importhook"])
        # torch imported: the reporter is loaded (and hooked), the integrations are not.
        self.assertIn("muster_launcher.autoreport", out["after"])
        self.assertNotIn("muster_launcher.integrations", out["after"])
        self.assertNotIn("muster:", p.stderr)
        # importlib.util costs every rank milliseconds: only the interpreter's own site may load it.
        bare, _ = self.run_probe(shipped=False)
        self.assertEqual(out["importlib.util"], bare["importlib.util"])

    def test_outside_muster_it_loads_nothing_of_muster_and_hooks_nothing(self):
        self.write_modules(FAKE_TORCH, os.path.join(self.tmp, "user"))
        out, _ = self.run_probe("torch.optim.optimizer")
        self.assertEqual(out["start"], [])
        self.assertNotIn("muster_launcher.autoreport", out["after"])

    def test_a_trainer_module_loads_its_integration_only(self):
        self.write_modules({"transformers/__init__.py": "", "transformers/trainer.py": ""},
                           os.path.join(self.tmp, "user"))
        out, p = self.run_probe("transformers.trainer", MUSTER_CHECKPOINT_SOCKET="@none")
        self.assertIn("muster_launcher.integrations.transformers", out["after"])
        self.assertNotIn("muster_launcher.integrations.lightning", out["after"])
        self.assertNotIn("muster_launcher.autoreport", out["after"])
        self.assertNotIn("muster:", p.stderr)

    def test_start_http_server_on_musters_port_is_skipped_and_any_other_runs(self):
        user = os.path.join(self.tmp, "user")
        self.write_modules(FAKE_PROMETHEUS, user)
        self.write_modules({"use_prometheus.py": """
            import prometheus_client
            print("OTHER", prometheus_client.start_http_server(9100))
            print("OURS", prometheus_client.start_http_server(8000))
        """}, user)
        _, p = self.run_probe("use_prometheus", MUSTER_METRICS_PORT="8000")
        self.assertIn("OTHER started 9100", p.stdout)
        self.assertIn("OURS None", p.stdout)
        self.assertEqual(p.stderr.count("muster: start_http_server(8000) skipped"), 1, p.stderr)

    def test_musters_bytecode_is_cached_in_its_copy_and_the_scripts_setting_kept(self):
        """PYTHONDONTWRITEBYTECODE keeps Python from writing beside the script's and packages'
        files; muster's own shared copy caches its bytecode anyway, so that later ranks compile
        nothing of muster's, and the script's setting is back before the script runs."""
        user = os.path.join(self.tmp, "user")
        self.write_modules({"mine.py": "VALUE = 1\n"}, user)
        env = dict(MUSTER_CHECKPOINT_SOCKET="@none", MUSTER_METRICS_PORT="8000",
                   PYTHONDONTWRITEBYTECODE="1")
        out, p = self.run_probe("mine", **env)
        shipped = os.path.join(self.tmp, "shipped")
        cached = sorted(os.listdir(os.path.join(shipped, "__pycache__")))
        self.assertTrue(cached and cached[0].startswith("sitecustomize."), cached)
        hook = sorted(os.listdir(os.path.join(shipped, "muster_launcher", "__pycache__")))
        self.assertTrue(any(n.startswith("importhook.") for n in hook), hook)
        self.assertFalse(os.path.exists(os.path.join(user, "__pycache__")), "the script's setting")
        self.assertNotIn("muster:", p.stderr)
        # The next rank starts from the cache: same modules at start, nothing rewritten.
        stamp = os.stat(os.path.join(shipped, "__pycache__", cached[0])).st_mtime_ns
        again, _ = self.run_probe("mine", **env)
        self.assertEqual(again["start"], out["start"])
        self.assertEqual(os.stat(os.path.join(shipped, "__pycache__", cached[0])).st_mtime_ns, stamp)
        self.assertFalse(os.path.exists(os.path.join(user, "__pycache__")))

    def test_the_users_own_sitecustomize_still_runs(self):
        self.write_modules({"sitecustomize.py": "import sys\nsys.USER_SITE_RAN = True\n"},
                           os.path.join(self.tmp, "user"))
        self.write_modules({"check_user_site.py": "import sys\nprint('USER', sys.USER_SITE_RAN)\n"},
                           os.path.join(self.tmp, "user"))
        _, p = self.run_probe("check_user_site", MUSTER_CHECKPOINT_SOCKET="@none")
        self.assertIn("USER True", p.stdout)

    def test_a_helper_connected_before_torch_stands_the_reporter_down(self):
        user = os.path.join(self.tmp, "user")
        self.write_modules(FAKE_TORCH, user)
        self.write_modules({"connect_first.py": """
            import muster_checkpoint
            assert muster_checkpoint.Checkpointer().active
            import torch.optim.optimizer as optimizer
            from muster_launcher import autoreport
            print("STOOD_DOWN", autoreport._standing_down, optimizer.hooks == [])
        """}, user)
        with FakeAgent() as agent:
            _, p = self.run_probe("connect_first", MUSTER_CHECKPOINT_SOCKET=agent.name)
        self.assertIn("STOOD_DOWN True True", p.stdout)

    def test_the_lazy_table_is_generated_from_the_modules_own_hooked_lists(self):
        self.assertEqual(generate_sitecustomize.main(["--check"]), 0,
                         "run python3 python/generate_sitecustomize.py")
        path = os.path.join(generate_sitecustomize.HERE, "muster_sitecustomize.py")
        with open(path) as f:
            tree = ast.parse(f.read())
        lazy = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "_LAZY" for t in n.targets))
        from muster_launcher import autoreport, integrations

        hooked = {name: set(targets) for name, _, targets in lazy}
        expected = {m.__name__: set(m.HOOKED) for m in integrations.modules()}
        expected[autoreport.__name__] = set(autoreport.HOOKED)
        self.assertEqual(hooked, expected)
