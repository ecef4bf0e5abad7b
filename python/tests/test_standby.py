"""The warm standby (muster_launcher/standby.py) against a fake agent: a real standby interpreter
started on one end of a socketpair, no torch, no binary."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import support

STANDBY = "import sys; del sys.path[0]; from muster_launcher.standby import main; main()"


class Standby:
    """A standby interpreter and the agent's end of its socket."""

    def __init__(self, test, modules, env=None, cwd=None):
        self.agent, theirs = socket.socketpair()
        test.addCleanup(self.agent.close)
        listing = os.path.join(test.tmp, "modules.json")
        with open(listing, "w") as f:
            json.dump(modules, f)
        self.env = dict(os.environ, PYTHONPATH=support.PYTHON_DIR,
                        MUSTER_STANDBY_FD=str(theirs.fileno()),
                        MUSTER_STANDBY_MODULES=listing)
        self.env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", STANDBY], env=self.env,
                                     pass_fds=[theirs.fileno()], cwd=cwd or test.tmp,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        theirs.close()
        test.addCleanup(self.kill)
        self.file = self.agent.makefile("rb")
        self.ready = None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()

    def read(self):
        line = self.file.readline()
        return json.loads(line) if line else None

    def wait_ready(self):
        """The standby's `ready` line (read once)."""
        if self.ready is None:
            self.ready = self.read()
        return self.ready

    def hand_over(self, args, env=None, cwd=None):
        ready = self.wait_ready()
        assert ready and ready["ready"], ready
        env = dict(self.env if env is None else env)
        env.pop("MUSTER_STANDBY_FD", None)
        env.pop("MUSTER_STANDBY_MODULES", None)
        message = {"args": args, "env": env, "cwd": cwd}
        self.agent.sendall((json.dumps(message) + "\n").encode())
        return ready, self.read()

    def finish(self, timeout=20):
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out.decode(), err.decode()


REPORT = textwrap.dedent("""
    import json, os, random, signal, sys
    print(json.dumps({
        "argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
        "name": __name__, "env": os.environ.get("ONLY_AT_HANDOVER"),
        "standby_env": os.environ.get("MUSTER_STANDBY_FD"),
        "random": random.random(), "json_loaded": "json" in sys.modules,
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "oom_score_adj": open("/proc/self/oom_score_adj").read().strip(),
    }))
    sys.exit(int(sys.argv[-1]))
""")


# A library that starts a native worker thread when it loads, as OpenBLAS does: a pthread the
# threading module knows nothing of, parked in pause(2).
POOL_AT_IMPORT = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None)
    _tid = ctypes.c_ulong()
    libc.pthread_create(ctypes.byref(_tid), None, ctypes.cast(libc.pause, ctypes.c_void_p), None)
""")

# A pool that comes up only off the main thread (on the main thread its import fails): priming
# cannot give it the rank's priority.
POOL_OFF_MAIN = (
    "import threading\n"
    "if threading.current_thread() is threading.main_thread():\n"
    "    raise ImportError('only off the main thread')\n" + POOL_AT_IMPORT)


def thread_nice(pid, tid):
    with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


class StandbyTest(support.TestCase):
    def write(self, folder, name, text):
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_a_handed_over_script_sees_a_cold_start(self):
        work = os.path.join(self.tmp, "work")
        script = self.write(os.path.join(self.tmp, "code"), "train.py", REPORT)
        standby = Standby(self, ["json", "decimal"])
        env = dict(standby.env, ONLY_AT_HANDOVER="yes")
        os.makedirs(work)
        ready, answer = standby.hand_over(["-u", script, "--x", "3"], env=env, cwd=work)
        self.assertEqual(ready["failed"], [])
        self.assertEqual(answer, {"accepted": True})
        code, out, err = standby.finish()
        self.assertEqual(code, 3, err)
        seen = json.loads(out)
        self.assertEqual(seen["argv"], [script, "--x", "3"])
        self.assertEqual(seen["file"], script)
        self.assertEqual(seen["path0"], os.path.dirname(os.path.realpath(script)))
        self.assertEqual(seen["cwd"], os.path.realpath(work))
        self.assertEqual(seen["name"], "__main__")
        self.assertEqual(seen["env"], "yes")
        self.assertIsNone(seen["standby_env"])
        # The dispositions a cold start of this interpreter has: Python's own (SIGINT raises
        # KeyboardInterrupt, SIGTERM default), unless this test runs with SIGINT ignored (a
        # background job of a non-interactive shell), which Python then keeps, warm or cold.
        cold = subprocess.run([sys.executable, "-u", script, "--x", "3"], cwd=work,
                              capture_output=True, text=True)
        cold_seen = json.loads(cold.stdout)
        for key in ("argv", "file", "path0", "cwd", "name", "oom_score_adj", "sigint",
                    "sigterm"):
            self.assertEqual(seen[key], cold_seen[key], key)
        self.assertNotEqual(seen["random"], cold_seen["random"])

    def test_a_waiting_standby_is_the_first_oom_victim(self):
        standby = Standby(self, ["json"])
        self.assertTrue(standby.read()["ready"])
        with open("/proc/%d/oom_score_adj" % standby.proc.pid) as f:
            self.assertEqual(f.read().strip(), "1000")

    def test_an_oom_score_it_cannot_put_back_is_a_refusal(self):
        from muster_launcher import standby

        score = os.path.join(self.tmp, "oom_score_adj")
        with open(score, "w") as f:
            f.write("-500\n")
        self.assertEqual(standby.raise_oom_score(score), -500)
        with open(score) as f:
            self.assertEqual(f.read(), "1000")
        self.assertIsNone(standby.restore_oom_score(-500, score))
        with open(score) as f:
            self.assertEqual(f.read(), "-500")
        # Nothing to restore where there was no score.
        self.assertIsNone(standby.restore_oom_score(None, score))
        # A write that fails (here: a folder; on Linux, below the privileged minimum) refuses.
        why = standby.restore_oom_score(0, self.tmp)
        self.assertIn("could not restore its OOM score to 0", why)

    def test_random_state_differs_between_standbys(self):
        script = self.write(self.tmp, "r.py", REPORT)
        values = []
        for _ in range(2):
            standby = Standby(self, ["random"])
            standby.hand_over(["-u", script, "0"])
            code, out, err = standby.finish()
            self.assertEqual(code, 0, err)
            values.append(json.loads(out)["random"])
        self.assertNotEqual(values[0], values[1])

    def test_module_form(self):
        pkg = os.path.join(self.tmp, "mods", "demo_pkg")
        self.write(pkg, "__init__.py", "")
        self.write(pkg, "run.py", REPORT)
        standby = Standby(self, [])
        _, answer = standby.hand_over(["-u", "-m", "demo_pkg.run", "5"],
                                      cwd=os.path.join(self.tmp, "mods"))
        self.assertEqual(answer, {"accepted": True})
        code, out, err = standby.finish()
        self.assertEqual(code, 5, err)
        seen = json.loads(out)
        self.assertEqual(seen["argv"], [os.path.join(pkg, "run.py"), "5"])
        self.assertEqual(seen["path0"], os.path.realpath(os.path.join(self.tmp, "mods")))
        self.assertEqual(seen["name"], "__main__")

    def test_an_exception_prints_from_the_script_and_exits_1(self):
        script = self.write(self.tmp, "boom.py", "def f():\n    raise KeyError('x')\nf()\n")
        standby = Standby(self, [])
        standby.hand_over(["-u", script])
        code, _, err = standby.finish()
        self.assertEqual(code, 1)
        self.assertIn("KeyError: 'x'", err)
        self.assertIn('File "%s", line 3, in <module>' % script, err)
        self.assertNotIn("runpy", err)
        self.assertNotIn("standby.py", err)

    def test_a_changed_import_time_variable_is_refused(self):
        script = self.write(self.tmp, "s.py", "print('ran')\n")
        standby = Standby(self, [], env={"OMP_NUM_THREADS": "4"})
        env = dict(standby.env, OMP_NUM_THREADS="8")
        _, answer = standby.hand_over(["-u", script], env=env)
        self.assertEqual(answer, {"refused": "OMP_NUM_THREADS differs from the standby's start"})
        code, out, _ = standby.finish()
        self.assertEqual((code, out), (0, ""))

    def test_an_unknown_interpreter_flag_is_refused(self):
        standby = Standby(self, [])
        _, answer = standby.hand_over(["-O", "-u", "x.py"])
        self.assertIn("refused", answer)

    def test_a_module_that_fails_to_import_is_reported(self):
        standby = Standby(self, ["json", "no_such_module_here"])
        ready = standby.read()
        self.assertEqual(ready["failed"], ["no_such_module_here"])
        self.assertEqual(ready["threads"], 1)

    def test_a_librarys_native_pool_gets_the_ranks_priority_and_the_standby_is_taken(self):
        """numpy's OpenBLAS starts a pool of native threads when it loads (one rank per node, no
        OMP_NUM_THREADS): a cold rank has it too, but loaded on the nice import thread it would
        keep that priority. The standby starts itself again with the spawner imported first on
        its main thread; the pool it keeps then has the main thread's priority."""
        site = os.path.join(self.tmp, "site")
        self.write(site, "pool_at_import.py", POOL_AT_IMPORT)
        standby = Standby(self, ["json", "pool_at_import"],
                          env={"PYTHONPATH": os.pathsep.join([support.PYTHON_DIR, site])})
        pid = standby.proc.pid
        ready = standby.wait_ready()
        self.assertEqual(ready, {"ready": True, "failed": [], "threads": 1})
        # The same process (exec, not a new child), holding the pool, at the rank's priority.
        self.assertEqual(standby.proc.pid, pid)
        tasks = os.listdir("/proc/%d/task" % pid)
        self.assertGreaterEqual(len(tasks), 2, tasks)
        nice = {t: thread_nice(pid, t) for t in tasks}
        self.assertEqual(set(nice.values()), {thread_nice(pid, str(pid))}, nice)
        script = self.write(os.path.join(self.tmp, "code"), "train.py", REPORT)
        env = {k: v for k, v in standby.env.items() if k != "MUSTER_STANDBY_PRIME"}
        _, answer = standby.hand_over(["-u", script, "0"], env=env)
        self.assertEqual(answer, {"accepted": True})
        code, out, err = standby.finish()
        self.assertEqual(code, 0, err)
        self.assertIsNone(json.loads(out)["standby_env"])

    def test_a_pool_the_standby_cannot_give_the_ranks_priority_is_refused(self):
        """Started again once at most: a pool that still comes up on the import thread means
        cold, with the reason."""
        site = os.path.join(self.tmp, "site")
        self.write(site, "pool_off_main.py", POOL_OFF_MAIN)
        standby = Standby(self, ["pool_off_main"],
                          env={"PYTHONPATH": os.pathsep.join([support.PYTHON_DIR, site])})
        ready, answer = standby.hand_over(["-u", "x.py"])
        self.assertEqual(ready["threads"], 2, ready)
        self.assertEqual(answer, {"refused": "its imports left 1 threads running"})

    def test_the_standby_exits_when_the_agent_lets_go(self):
        standby = Standby(self, [])
        standby.read()
        standby.file.close()
        standby.agent.close()
        code, out, _ = standby.finish()
        self.assertEqual((code, out), (0, ""))

    def test_the_working_directory_never_shadows_an_installed_module(self):
        # A `json.py` of the user's in the working directory: the standby imports the real one.
        self.write(self.tmp, "json.py", "raise SystemExit('shadowed')\n")
        standby = Standby(self, ["json"])
        ready = standby.read()
        self.assertEqual(ready["failed"], [])


class CommandTest(support.TestCase):
    def test_the_agent_runs_the_command_the_tests_run(self):
        from muster_launcher import standby

        self.assertEqual(standby.COMMAND, STANDBY)


class RecordTest(support.TestCase):
    def test_only_installed_modules_outside_the_script_and_cwd(self):
        from muster_launcher import standby

        class M:
            def __init__(self, path):
                self.__file__ = path

        site = os.path.join(self.tmp, "site-packages")
        modules = {
            "torch": M(os.path.join(site, "torch", "__init__.py")),
            "torch.nn": M(os.path.join(site, "torch", "nn", "__init__.py")),
            "mine": M(os.path.join(self.tmp, "script", "mine.py")),
            "local": M(os.path.join(self.tmp, "cwd", "local.py")),
            "muster_launcher": M(os.path.join(site, "muster_launcher", "__init__.py")),
            "zipped": M(os.path.join(self.tmp, "a.zip", "zipped.py")),
            "builtin": M(None),
            "numpy": M(os.path.join(site, "numpy", "__init__.py")),
        }
        found = standby.installed_modules(modules, script_dir=os.path.join(self.tmp, "script"),
                                          cwd=os.path.join(self.tmp, "cwd"), roots=[site])
        self.assertEqual(found, ["torch", "torch.nn", "numpy"])

    def test_a_submodule_counts_only_under_an_installed_package(self):
        from muster_launcher import standby

        class M:
            def __init__(self, path):
                self.__file__ = path

        site = os.path.join(self.tmp, "site-packages")
        script = os.path.join(self.tmp, "script")
        modules = {
            # The script's own package: neither it nor its submodules, wherever they point.
            "pkg": M(os.path.join(script, "pkg", "__init__.py")),
            "pkg.models": M(os.path.join(site, "elsewhere", "models.py")),
            "transformers": M(os.path.join(site, "transformers", "__init__.py")),
            "transformers.models.gpt2": M(os.path.join(site, "transformers", "models", "gpt2",
                                                       "__init__.py")),
            # A submodule whose file lies in the script's folder (a plugin dropped there).
            "transformers.plugin": M(os.path.join(script, "plugin.py")),
            "muster_launcher.standby": M(os.path.join(site, "muster_launcher", "standby.py")),
        }
        found = standby.installed_modules(modules, script_dir=script,
                                          cwd=os.path.join(self.tmp, "cwd"), roots=[site])
        self.assertEqual(found, ["transformers", "transformers.models.gpt2"])

    def test_a_failing_submodule_is_left_to_the_script(self):
        from muster_launcher import standby

        # json.tool imports fine, the other two do not exist: only the top-level one is a
        # failure (the standby is then refused); the submodule only loses its head start.
        failed, spawners = standby.import_all(["json", "json.tool", "json.no_such_part",
                                               "no_such_top_level_module"], nice=0)
        self.assertEqual(failed, ["no_such_top_level_module"])
        self.assertEqual(spawners, [])

    def test_site_packages_under_the_working_directory_are_left_out(self):
        from muster_launcher import standby

        class M:
            __file__ = os.path.join(self.tmp, "venv", "site-packages", "x", "__init__.py")

        found = standby.installed_modules({"x": M()}, script_dir="/nowhere", cwd=self.tmp,
                                          roots=[os.path.join(self.tmp, "venv", "site-packages")])
        self.assertEqual(found, [])

    def test_record_writes_the_file_once(self):
        from muster_launcher import standby

        target = os.path.join(self.tmp, "mods.json")
        os.environ["MUSTER_WARM_MODULES"] = target
        self.addCleanup(os.environ.pop, "MUSTER_WARM_MODULES", None)
        standby.record_modules()
        with open(target) as f:
            names = json.load(f)
        self.assertIn("json", names)
        self.assertNotIn("muster_launcher", names)
        os.remove(target)
        standby.record_modules()
        self.assertFalse(os.path.exists(target))

    def test_nothing_without_the_variable(self):
        from muster_launcher import standby

        standby.record_modules()
        self.assertEqual(os.listdir(tempfile.mkdtemp(dir=self.tmp)), [])


class ParseTest(support.TestCase):
    def test_forms(self):
        from muster_launcher.standby import parse_args

        self.assertEqual(parse_args(["-u", "a.py", "-m"]), ("script", "a.py", ["-m"]))
        self.assertEqual(parse_args(["-u", "-m", "p.q", "x"]), ("module", "p.q", ["x"]))
        self.assertIsNone(parse_args(["a.py"]))
        self.assertIsNone(parse_args(["-u", "-X", "dev", "a.py"]))
        self.assertIsNone(parse_args(["-u"]))
