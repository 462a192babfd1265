"""Compiling every op a program will use in one go.

MAX pays a fixed cost of seconds per graph compile, but compiles a module of
many one-op graphs for little more than one. `precompile` puts every pagedkv
op variant for the given dtypes into one module; later calls then load
nothing. The test suite and `pagedkv check-gpu` use it too.
"""

from __future__ import annotations

from collections.abc import Iterable

from max.dtype import DType

from ._checks import KV_LAYOUTS, ROW_DTYPES_OF_INT8_POOLS
from ._ops.kernels import OpSpec, compile_stats, prepare
from ._ops.tensors import Device
from ._plan.plan import CHECK_PAGE_TABLE
from .cascade import merge_state_spec, merge_states_spec
from .decode import decode_spec
from .mla import check_mla_dtypes, mla_spec
from .page import (
    BATCH_INDICES_POSITIONS,
    COPY_PAGES,
    SEQ_LENS,
    append_spec,
    gather_spec,
    mla_append_spec,
)
from .prefill import prefill_spec

DEFAULT_DTYPES = ("float32", "float16", "bfloat16")


def default_pair(kv_dtype: str) -> tuple[str, str]:
    """The (q, kv) dtypes precompiled for a cache dtype: q in the cache's
    dtype, float32 beside an int8 cache."""
    return ("float32" if kv_dtype == "int8" else kv_dtype, kv_dtype)


def op_specs(
    dtypes: Iterable[str] = DEFAULT_DTYPES,
    decode_dtypes: Iterable[tuple[str, str]] | None = None,
    mla_dtypes: Iterable[tuple[str, str]] | None = None,
) -> list[OpSpec]:
    """Every op variant for these cache dtypes and both layouts (for an
    int8 cache, appends of float32, float16 and bfloat16 rows, and no MLA);
    decode for
    the (q, kv) dtype pairs (default: `default_pair` of each dtype); MLA
    attention for mla_dtypes (default: the decode pairs MLA takes)."""
    dtypes = list(dtypes)
    specs = [SEQ_LENS, BATCH_INDICES_POSITIONS, CHECK_PAGE_TABLE, COPY_PAGES]
    pairs = [default_pair(d) for d in dtypes] if decode_dtypes is None else list(decode_dtypes)
    for name in dtypes:
        dtype = DType[name]
        if dtype == DType.int8:
            # Float rows quantized on append; no MLA cache.
            for layout in KV_LAYOUTS.values():
                specs += [append_spec(dtype, layout, rows) for rows in ROW_DTYPES_OF_INT8_POOLS]
                specs.append(gather_spec(dtype, layout))
            continue
        specs.append(mla_append_spec(dtype))
        for layout in KV_LAYOUTS.values():
            specs.append(append_spec(dtype, layout))
            specs.append(gather_spec(dtype, layout))
    for q_name, kv_name in pairs:
        specs += [merge_state_spec(DType[q_name]), merge_states_spec(DType[q_name])]
        for layout in KV_LAYOUTS.values():
            specs.append(decode_spec(DType[q_name], DType[kv_name], layout))
            specs.append(prefill_spec(DType[q_name], DType[kv_name], layout))
    for q_name, kv_name in pairs if mla_dtypes is None else mla_dtypes:
        try:
            check_mla_dtypes(DType[q_name], DType[kv_name])
        except TypeError:
            if mla_dtypes is not None:
                raise
            continue
        specs.append(mla_spec(DType[q_name], DType[kv_name]))
    return list(dict.fromkeys(specs))


def parse_device(device: str | Device) -> Device:
    """A MAX Device from 'cpu', 'gpu[:index]' or 'cuda[:index]' (a Device passes through)."""
    if isinstance(device, Device):
        return device
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "gpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'gpu[:index]', got {device!r}")
    return Device("cpu") if kind == "cpu" else Device("gpu", int(index or 0))


def precompile(
    device: str | Device = "cpu",
    dtypes: Iterable[str] = DEFAULT_DTYPES,
    decode_dtypes: Iterable[tuple[str, str]] | None = None,
) -> tuple[int, float]:
    """Compiles every op for these dtypes on this device, in one MAX module.

    Returns (graphs compiled or loaded so far, seconds spent compiling so far)
    for this process.
    """
    prepare(op_specs(dtypes, decode_dtypes), parse_device(device))
    return compile_stats.graphs, compile_stats.seconds
