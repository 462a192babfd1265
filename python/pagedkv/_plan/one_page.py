"""One request's contiguous K/V seen as a paged cache of one page.

FlashInfer's single-request functions (`single_decode_with_kv_cache`,
`single_prefill_with_kv_cache`) take K and V as plain [L, Hkv, D] (NHD) or
[Hkv, L, D] (HND) arrays. Viewed as one page of L tokens, they run through the
batch kernels unchanged and without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from max.dtype import DType

from .._checks import layout_code
from .._ops.tensors import Array, check_array, contiguous, dtype_of, empty, new_like
from .io_dtypes import widened_dtype
from .plan import check_dtypes
from .work import check_heads


@dataclass(frozen=True)
class OnePageKV:
    """K/V of L tokens as a one-page cache, with its page table on q's device."""

    cache: tuple[Array, Array]
    """K and V, each [1, L, Hkv, D] (NHD) or [1, Hkv, L, D] (HND): the pair
    form of a pool, views of the caller's arrays."""
    num_kv_heads: int
    length: int
    indptr: Array
    indices: Array
    last_page_len: Array


def one_page_kv(
    q: Array, k: Array, v: Array, kv_layout: str, q_dims: int, narrow_values: bool = False
) -> OnePageKV:
    """Checks q (q_dims dimensions, head_dim last), k and v (the same [L, Hkv,
    D] or [Hkv, L, D] as kv_layout says; with narrow_values v's rows may be
    shorter than k's) and views k, v as one page."""
    layout_code(kv_layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
    same = tuple(k.shape) == tuple(v.shape) or (
        narrow_values
        and len(v.shape) == 3
        and tuple(k.shape[:-1]) == tuple(v.shape[:-1])
        and 0 < v.shape[-1] <= k.shape[-1]
    )
    if len(q.shape) != q_dims or len(k.shape) != 3 or not same:
        q_form = "[Hq, D]" if q_dims == 2 else "[qo_len, Hq, D]"
        raise ValueError(
            f"q must be {q_form} and k, v the same [L, Hkv, D] (NHD) / [Hkv, L, D] (HND); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads, length = (k.shape[1], k.shape[0]) if kv_layout == "NHD" else k.shape[:2]
    # What plan() and run() check, checked here too: with no keys (L = 0)
    # neither runs.
    num_qo_heads, head_dim = int(q.shape[-2]), int(q.shape[-1])
    if int(k.shape[-1]) != head_dim:
        raise ValueError(f"q's head_dim is {head_dim} but k's is {int(k.shape[-1])}")
    check_heads(num_qo_heads, int(heads))
    if dtype_of(k) != dtype_of(v):
        raise TypeError(f"k and v must have one dtype, got {dtype_of(k).name}, {dtype_of(v).name}")
    check_dtypes(widened_dtype(dtype_of(q)), dtype_of(k))  # an fp8 q is widened
    return OnePageKV(
        (contiguous(k)[None], contiguous(v)[None]),
        int(heads),
        int(length),
        new_like(q, np.array([0, 1], np.int32)),
        new_like(q, np.array([0], np.int32)),
        new_like(q, np.array([length], np.int32)),
    )


def attention_of_nothing(q: Array, return_lse: bool) -> Array | tuple[Array, Array]:
    """What attention over no keys gives, FlashInfer's convention: o = 0 in
    q's shape and dtype, and lse [q.shape[:-1]] = -inf (float32)."""
    o = empty(q, q.shape, dtype_of(q))
    o[...] = 0
    if not return_lse:
        return o
    lse = empty(q, q.shape[:-1], DType.float32)
    lse[...] = -np.inf
    return o, lse
