"""An import hook that serves ``flashinfer`` and ``flashinfer.*`` from this package."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

ALIAS = "flashinfer"
TARGET = __package__ or "pagedkv.flashinfer_compat"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # The alias is the same module object: `flashinfer.decode is
        # pagedkv.flashinfer_compat.decode`, so patches by either name agree.
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS) :]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


def install() -> None:
    """Makes ``import flashinfer`` (and its submodules) import this package.

    Raises RuntimeError if a real FlashInfer is already imported: two
    modules under one name would mix silently. Calling it twice is harmless.
    """
    if any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        return
    loaded = sys.modules.get(ALIAS)
    if loaded is not None and loaded.__name__ != TARGET:
        raise RuntimeError("a real flashinfer is already imported; install() must come first")
    sys.meta_path.insert(0, _AliasFinder())
