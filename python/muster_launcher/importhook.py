"""muster's lazy import hook, shared by the worker-side modules that patch another module.

`after_import(names, patch, on_error)` calls `patch(module)` right after each module in `names`
runs for the first time (before whatever imported it reads from it), once per module:
muster's `sitecustomize` patches `prometheus_client.exposition`, `autoreport` hooks
`torch.optim.optimizer`, each of `integrations` its framework's Trainer module. It imports
none of them: a meta-path finder waits for the names, answers each once (through the finders
after it, with a loader that runs the real one and then `patch`), and removes itself once it has
answered for all of them.

`before_first_import(names, wake)` calls `wake()` once, just before the first module in `names`
is looked for: muster's `sitecustomize` loads `autoreport` and each integration only then, so a
rank that imports none of the modules they hook never reads (compiles) them.

muster's `sitecustomize` imports this module in every rank at start: it imports nothing but `sys`.
Standard library only.
"""

import sys

__all__ = ["after_import", "before_first_import"]


def after_import(names, patch, on_error):
    """Calls `patch(module)` once for each module named in `names` when it is imported.

    A module already imported is patched at once, here (an error raises to the caller). A later
    one is patched right after it runs; an error there calls `on_error(module, err)`, which
    should print one line, and never reaches the import. A name a waiting hook with the same
    `patch` already waits for is not waited for twice."""
    waiting = []
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        elif name not in waiting:
            waiting.append(name)
    for finder in sys.meta_path:
        if isinstance(finder, _Finder) and finder.patch is patch:
            waiting = [name for name in waiting if name not in finder.waiting]
    if waiting:
        sys.meta_path.insert(0, _Finder(waiting, patch, on_error))


def before_first_import(names, wake):
    """Calls `wake()` once, just before the first module in `names` is looked for (before any of
    them runs), and then no longer waits; at once, here, when one of them is already imported.
    `wake` must not raise. It may install `after_import` hooks for these names: the import that
    woke it is answered by the meta path as `wake` left it, so those hooks see it too."""
    if any(name in sys.modules for name in names):
        wake()
        return
    sys.meta_path.insert(0, _Waker(names, wake))


class _Waker:
    """A meta-path finder that answers no import itself: it calls `wake` at the first of its
    names and leaves the meta path."""

    def __init__(self, names, wake):
        self._names = frozenset(names)
        self._wake = wake

    def find_spec(self, name, path, target=None):
        if name not in self._names:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            # Already woken (another thread, or a re-entrant look-up): nothing more to do.
            return None
        self._wake()
        # Asked in the middle of the interpreter's walk over the meta path, which `wake` may have
        # changed: every other finder is asked here, so the walk's result is right either way.
        return _spec_from_others(self, name, path, target)


def _spec_from_others(me, name, path, target):
    """The spec the meta path's other finders give `name`, as the interpreter's walk would."""
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if finder is me or find_spec is None:
            continue
        spec = find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


class _PatchingLoader:
    """Runs the real loader, then the patch; everything else goes to the real loader."""

    def __init__(self, loader, patch, on_error):
        self._loader = loader
        self._patch = patch
        self._on_error = on_error

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self._patch(module)
        except Exception as err:  # never break the user's import over this hook
            try:
                self._on_error(module, err)
            except Exception:
                pass

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """A meta-path finder that answers only for the modules it waits for, each once."""

    def __init__(self, names, patch, on_error):
        self.waiting = set(names)
        self.patch = patch
        self._on_error = on_error

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        self.waiting.discard(name)
        if not self.waiting:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        spec = _spec_from_others(self, name, path, target)
        if spec is None:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, self.patch, self._on_error)
        return spec
