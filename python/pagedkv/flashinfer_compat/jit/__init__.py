"""``flashinfer.jit``: FlashInfer's CUDA JIT drivers, no-ops here.

pagedkv compiles each MAX op the first time a call needs it and caches it,
so ahead-of-time builds have nothing to do.
"""

from __future__ import annotations

from typing import Any

from .._missing import no_op

build_jit_specs = no_op


class JitSpec:
    """A FlashInfer JIT module description; carries nothing here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = str(kwargs.get("name", ""))


def module_generator(name: str) -> Any:
    """A FlashInfer ``gen_*_module`` named `name`: it returns a `JitSpec` of
    that name, which `build_jit_specs` accepts and ignores."""

    def generate(*args: Any, **kwargs: Any) -> JitSpec:
        return JitSpec(name=name)

    generate.__name__ = generate.__qualname__ = name
    return generate


class MissingJITCacheError(Exception):
    """FlashInfer's error for a kernel absent from its AOT cache."""
