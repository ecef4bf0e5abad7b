"""The import hook alone: patches right after a module runs, wakes before the first of a list is
looked for, never breaks the import, and leaves the meta path when done."""

import sys

from support import TestCase

DEMO = {
    "hooked_demo/__init__.py": "",
    "hooked_demo/target.py": "VALUE = 1\n",
    "hooked_demo/other.py": "VALUE = 2\n",
}


class ImportHookTest(TestCase):
    def setUp(self):
        super().setUp()
        self.write_modules(DEMO)
        from muster_launcher import importhook

        self.hook = importhook
        self.meta_path = list(sys.meta_path)

    def test_a_module_is_patched_right_after_it_runs_once_and_the_hook_leaves(self):
        seen = []

        def patch(module):
            seen.append(module.VALUE)
            module.VALUE = 10

        self.hook.after_import(["hooked_demo.target"], patch, self.fail)
        from hooked_demo.target import VALUE  # what the importer reads is patched already

        self.assertEqual((seen, VALUE), ([1], 10))
        self.assertEqual(sys.meta_path, self.meta_path)

    def test_a_module_already_imported_is_patched_at_once(self):
        import hooked_demo.target

        self.hook.after_import(["hooked_demo.target"], lambda m: setattr(m, "VALUE", 3), self.fail)
        self.assertEqual(hooked_demo.target.VALUE, 3)
        self.assertEqual(sys.meta_path, self.meta_path)

    def test_a_patch_that_raises_is_reported_and_the_import_goes_on(self):
        errors = []

        def patch(module):
            raise RuntimeError("broken")

        self.hook.after_import(["hooked_demo.target"], patch, lambda m, e: errors.append(str(e)))
        import hooked_demo.target

        self.assertEqual(hooked_demo.target.VALUE, 1)
        self.assertEqual(errors, ["broken"])

    def test_the_same_patch_does_not_wait_twice_for_a_name(self):
        calls = []

        def patch(module):
            calls.append(module.__name__)

        self.hook.after_import(["hooked_demo.target"], patch, self.fail)
        self.hook.after_import(["hooked_demo.target", "hooked_demo.other"], patch, self.fail)
        import hooked_demo.other  # noqa: F401
        import hooked_demo.target  # noqa: F401

        self.assertEqual(sorted(calls), ["hooked_demo.other", "hooked_demo.target"])

    def test_wake_runs_once_before_the_first_name_and_its_hooks_see_that_import(self):
        order = []

        def wake():
            order.append("wake")
            self.hook.after_import(["hooked_demo.other"], lambda m: order.append("patched"),
                                   self.fail)

        self.hook.before_first_import(["hooked_demo.target", "hooked_demo.other"], wake)
        self.assertEqual(order, [])
        import hooked_demo.other  # noqa: F401
        import hooked_demo.target  # noqa: F401

        self.assertEqual(order, ["wake", "patched"])
        self.assertEqual(sys.meta_path, self.meta_path)

    def test_wake_runs_at_once_when_a_name_is_already_imported(self):
        import hooked_demo.target  # noqa: F401

        woken = []
        self.hook.before_first_import(["hooked_demo.target"], lambda: woken.append(True))
        self.assertEqual(woken, [True])
