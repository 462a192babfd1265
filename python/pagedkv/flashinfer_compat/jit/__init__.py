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


class MissingJITCacheError(Exception):
    """FlashInfer's error for a kernel absent from its AOT cache."""
