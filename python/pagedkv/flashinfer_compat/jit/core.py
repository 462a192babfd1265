"""``flashinfer.jit.core``: FlashInfer's CUDA JIT module builder. pagedkv
compiles MAX ops instead, so a request for a CUDA module is refused."""

from __future__ import annotations

from typing import Any


def gen_jit_spec(name: str, sources: Any = (), *args: Any, **kwargs: Any) -> Any:
    """Refuses: FlashInfer's CUDA JIT modules are not compiled with CUDA here."""
    raise RuntimeError(
        f"flashinfer.jit.core.gen_jit_spec({name!r}): pagedkv is not compiled with CUDA "
        "JIT modules; its ops are MAX graphs"
    )
