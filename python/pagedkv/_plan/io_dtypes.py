"""Query and output dtypes the attention kernels do not take themselves.

The kernels multiply a float32, float16 or bfloat16 query and write the
output in the query's dtype. FlashInfer's wrappers and block-table calls also
take an fp8 query (``q_data_type=torch.float8_e4m3fn``) and an output dtype of
the caller's (``o_data_type``, ``out_dtype``, or ``out``'s dtype). pagedkv
widens an fp8 query to bfloat16 before the kernel (a copy of the query, never
of the cache; exact: bfloat16 holds every e4m3 and e5m2 value) and casts the
output after it, once everything that works on the output (sinks, a narrower
value head) is done. Without an output dtype the output takes the query's
dtype as given, fp8 included, as FlashInfer's does.
"""

from __future__ import annotations

from typing import Any

from max.dtype import DType

from .._ops.tensors import Array, dtype_of, is_torch
from .plan import FP8_DTYPES, Q_DTYPES

OUTPUT_DTYPES = (*Q_DTYPES, DType.float64, *FP8_DTYPES)
"""Dtypes an output may be asked in."""


def widened_query(query: Array) -> Array:
    """An fp8 query as bfloat16; any other as it is."""
    if dtype_of(query) not in FP8_DTYPES:
        return query
    import torch

    return query.to(torch.bfloat16)


def widened_dtype(q_dtype: DType) -> DType:
    """The dtype the kernel multiplies a query of q_dtype in: bfloat16 for fp8."""
    return DType.bfloat16 if q_dtype in FP8_DTYPES else q_dtype


def kernel_q_dtype(q_data_type: object, as_dtype: Any) -> DType | None:
    """`widened_dtype` of a plan's q_data_type (None stays None). as_dtype:
    the wrappers' dtype parser."""
    return None if q_data_type is None else widened_dtype(as_dtype(q_data_type, "q_data_type"))


def output_dtype(o_data_type: object, as_dtype: Any) -> DType | None:
    """A plan's o_data_type as a MAX dtype (None: the query's); TypeError for
    one the output cannot take. as_dtype: the wrappers' dtype parser."""
    if o_data_type is None:
        return None
    dtype = as_dtype(o_data_type, "o_data_type")
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(
            f"o_data_type must be one of {', '.join(d.name for d in OUTPUT_DTYPES)}, "
            f"got {dtype.name}"
        )
    return dtype


def check_out_dtype(out: Array | None, dtype: DType) -> None:
    """Raises TypeError unless `out` (if given) has the output's dtype."""
    if out is not None and dtype_of(out) != dtype:
        raise TypeError(f"out must be {dtype.name}, the output's dtype, got {dtype_of(out).name}")


def kernel_out(out: Array | None, query: Array) -> Array | None:
    """`out` where the kernel may write into it (the widened query's dtype),
    else None: the kernel then writes its own array and `output_in` copies."""
    return out if out is not None and dtype_of(out) == dtype_of(query) else None


def output_in(o: Array, dtype: DType, out: Array | None) -> Array:
    """o (the kernel's output) in `dtype`: in `out` when given (o itself when
    the kernel wrote there), else o or a cast copy."""
    if out is not None:
        if o is not out:
            out[...] = _cast(o, dtype)
        return out
    return o if dtype_of(o) == dtype else _cast(o, dtype)


def _cast(x: Array, dtype: DType) -> Array:
    if is_torch(x):
        import torch

        return x.to(getattr(torch, dtype.name))
    return x.astype(dtype.to_numpy())
