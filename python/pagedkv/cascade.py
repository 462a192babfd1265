"""Merging attention states: FlashInfer's cascade helpers.

A state is (v, s): attention output over some set of keys and the base-2
log-sum-exp of their scores (what ``run(..., return_lse=True)`` returns).
States over disjoint key sets merge exactly into the state over their union,
so attention over a shared prefix and over each request's suffix can be
computed apart and merged.
"""

from __future__ import annotations

import numpy as np
from max.dtype import DType

from ._checks import check_writable
from ._ops.contract import MERGE_STATE_IN_PLACE_OP, MERGE_STATES_OP
from ._ops.kernels import Operand, OpSpec, run_op
from ._ops.tensors import (
    Array,
    check_array,
    contiguous,
    device_of,
    dtype_of,
    empty,
    is_torch,
    new_like,
    to_host_numpy,
)

V_DTYPES = (DType.float32, DType.float16, DType.bfloat16)
F32 = DType.float32


def _merge_spec(op: str, dtype: DType, v_rank: int) -> OpSpec:
    """The merge ops' operands: the state written, v [N, H, D] (dtype) and s
    [N, H] float32, then the states read, v of v_rank dims and s of one
    fewer (its last axis dropped)."""
    return OpSpec.of(
        op,
        [
            Operand(dtype, 3, mutable=True),
            Operand(F32, 2, mutable=True),
            Operand(dtype, v_rank),
            Operand(F32, v_rank - 1),
        ],
    )


def merge_state_spec(dtype: DType) -> OpSpec:
    """v, s (written in place), v_other, s_other."""
    return _merge_spec(MERGE_STATE_IN_PLACE_OP, dtype, 3)


def merge_states_spec(dtype: DType) -> OpSpec:
    """out_v, out_s (written), v [N, S, H, D], s [N, S, H]."""
    return _merge_spec(MERGE_STATES_OP, dtype, 4)


def _check_state(name_v: str, v: Array, name_s: str, s: Array, v_rank: int) -> None:
    check_array(name_v, v)
    check_array(name_s, s)
    if len(v.shape) != v_rank or tuple(s.shape) != tuple(v.shape[:-1]):
        raise ValueError(
            f"{name_v} must be {v_rank}-D and {name_s} its shape without the last axis; "
            f"got {tuple(v.shape)} and {tuple(s.shape)}"
        )
    if dtype_of(v) not in V_DTYPES:
        raise TypeError(f"{name_v} must be float32, float16 or bfloat16, got {dtype_of(v).name}")
    if dtype_of(s) != F32:
        raise TypeError(f"{name_s} must be float32, got {dtype_of(s).name}")
    if device_of(s) != device_of(v):
        raise ValueError(f"{name_v} and {name_s} are on different devices")


def merge_state_in_place(
    v: Array, s: Array, v_other: Array, s_other: Array, mask: Array | None = None
) -> None:
    """(v, s) <- merge((v, s), (v_other, s_other)), in place.

    v, v_other: [seq_len, num_heads, head_dim]; s, s_other: [seq_len, num_heads]
    float32 (base-2 LSE). v and s must be contiguous. mask: bool [seq_len],
    on the host or v's device: only the rows where it is True are merged;
    the others are left exactly as they were (FlashInfer's mask, for steps
    replayed with some rows idle).
    """
    _check_state("v", v, "s", s, 3)
    _check_state("v_other", v_other, "s_other", s_other, 3)
    if tuple(v.shape) != tuple(v_other.shape) or dtype_of(v) != dtype_of(v_other):
        raise ValueError("v and v_other must have the same shape and dtype")
    if device_of(v) != device_of(v_other):
        raise ValueError("v and v_other are on different devices")
    if contiguous(v) is not v or contiguous(s) is not s:
        raise ValueError("v and s are written in place and must be contiguous")
    rows = None if mask is None else _mask_rows(mask, int(v.shape[0]))
    # Both before either is written: a lost write to one would leave half a state.
    check_writable("v", v)
    check_writable("s", s)
    if rows is None:
        run_op(
            merge_state_spec(dtype_of(v)),
            [v, s, contiguous(v_other), contiguous(s_other)],
            device_of(v),
        )
        return
    if len(rows) == 0:
        return
    index = new_like(v, rows)
    v_rows, s_rows = _contiguous_copy(v[index]), _contiguous_copy(s[index])
    merge_state_in_place(v_rows, s_rows, v_other[index], s_other[index])
    v[index] = v_rows
    s[index] = s_rows


def _mask_rows(mask: Array, seq_len: int) -> np.ndarray:
    """The rows a bool mask [seq_len] selects, as host int64 indices."""
    host = to_host_numpy(mask)
    if host.dtype != np.bool_ or host.shape != (seq_len,):
        raise ValueError(f"mask must be bool [{seq_len}], got {host.dtype} {list(host.shape)}")
    return np.flatnonzero(host)


def merge_state(v_a: Array, s_a: Array, v_b: Array, s_b: Array) -> tuple[Array, Array]:
    """The merge of two states: v [seq_len, num_heads, head_dim], s [seq_len, num_heads]."""
    _check_state("v_a", v_a, "s_a", s_a, 3)
    v, s = _contiguous_copy(v_a), _contiguous_copy(s_a)
    merge_state_in_place(v, s, v_b, s_b)
    return v, s


def _contiguous_copy(x: Array) -> Array:
    if is_torch(x):
        return x.contiguous().clone()
    return np.array(x, order="C", copy=True)


def merge_states(v: Array, s: Array) -> tuple[Array, Array]:
    """The merge of S states per row: v [N, S, H, D], s [N, S, H] ->
    (v [N, H, D], s [N, H]).

    As in FlashInfer, one state (S = 1) comes back unchanged, copied, also
    where its s is -inf (a merge would give v = 0 there). A NaN in a row's
    s or v makes that row's result NaN."""
    _check_state("v", v, "s", s, 4)
    n, states, heads, head_dim = v.shape
    if states == 1:
        return _contiguous_copy(v[:, 0]), _contiguous_copy(s[:, 0])
    out_v = empty(v, (n, heads, head_dim), dtype_of(v))
    out_s = empty(v, (n, heads), F32)
    run_op(
        merge_states_spec(dtype_of(v)),
        [out_v, out_s, contiguous(v), contiguous(s)],
        device_of(v),
    )
    return out_v, out_s
