"""``flashinfer.jit.utils``: the dtype names FlashInfer's JIT module URIs use."""

from __future__ import annotations

from typing import Any


def _names() -> dict[Any, str]:
    import torch

    return {
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.float32: "f32",
        torch.float8_e4m3fn: "e4m3",
        torch.float8_e5m2: "e5m2",
        torch.int8: "i8",
        torch.uint8: "u8",
        torch.int32: "i32",
        torch.uint32: "u32",
        torch.int64: "i64",
        torch.uint64: "u64",
    }


class _LazyDtypeNames(dict):
    """filename_safe_dtype_map, filled on first use (torch is optional)."""

    def __missing__(self, key: Any) -> str:
        if not self:
            self.update(_names())
            if key in self:
                return self[key]
        raise KeyError(key)


filename_safe_dtype_map = _LazyDtypeNames()
