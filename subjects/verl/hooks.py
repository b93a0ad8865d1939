"""A post-import hook: run a patch right after a module's code has executed (or now, if it has).

Shared by ``subjects.verl.cpu_shim`` and ``subjects.verl.recorder``: both are loaded by verl's
``VERL_USE_EXTERNAL_MODULES`` hook from inside ``verl/__init__``, before the engine, trainer or
distributed modules they patch exist, and importing those from there would load them half-way
through ``verl/__init__``. Standard library only, so importing it patches nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading

_after: dict[str, list] = {}  # module name -> patches to run once it has executed
_lock = threading.Lock()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patches):
        self._inner = inner
        self._patches = patches

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        for patch in self._patches:
            patch(module)

    def __getattr__(self, name):  # get_source, get_code, is_package... as the real loader
        return getattr(self._inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        with _lock:
            patches = _after.pop(fullname, None)
        if patches is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, patches)
        return spec


def after_import(name: str, patch) -> None:
    """Run ``patch(module)`` once module ``name`` has been imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return
    with _lock:
        _after.setdefault(name, []).append(patch)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
