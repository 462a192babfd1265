"""Attention sinks (gpt-oss): one learned logit a query head that joins the
denominator of every row's softmax and adds no value.

With scores s_j already scaled by sm_scale and a head's sink logit z,
``o = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^z)``. That is the attention
state over the keys, (o, lse), merged with a state over no keys whose value
is 0 and whose base-2 log-sum-exp is ``z * log2(e)``: the run's output and
lse are merged with it in place by the cascade merge (`pagedkv.cascade`),
which is exact, so every attention entry point takes sinks the same way.
The lse returned then counts the sink's term, as the merged state's does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._checks import check_float
from ._ops.tensors import Array, is_torch
from .cascade import merge_state_in_place

SINK_VARIANT = "AttentionSink"
"""The name of FlashInfer's attention-sink JIT variant (its
``jit.attention.variants.attention_sink_decl``)."""


def sink_log2_lse(sinks: Any, num_qo_heads: int) -> np.ndarray:
    """The sinks as base-2 log-sum-exps, float32 [num_qo_heads] on the host.

    sinks: float [num_qo_heads] (a tensor or array), or FlashInfer's
    trtllm-gen form, a list holding one such tensor. Checked before any
    attention runs: a wrong shape or a non-finite logit raises ValueError.
    """
    if isinstance(sinks, (list, tuple)):
        if len(sinks) != 1:
            raise ValueError("sinks as a list must hold one tensor [num_qo_heads]")
        sinks = sinks[0]
    values = np.asarray(sinks.detach().cpu() if is_torch(sinks) else sinks, dtype=np.float64)
    if values.shape != (num_qo_heads,):
        raise ValueError(f"sinks must be [num_qo_heads] = [{num_qo_heads}], got {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("sinks must be finite")
    return (values * math.log2(math.e)).astype(np.float32)


def merge_sinks(o: Array, lse: Array, sink_lse: np.ndarray) -> None:
    """(o, lse) <- their merge with each head's sink state, in place.

    o [rows, H, D] (contiguous), lse [rows, H] float32 base 2, sink_lse [H]
    from `sink_log2_lse`. A row that saw no key (lse -inf) stays 0.
    """
    rows, heads = int(lse.shape[0]), int(lse.shape[1])
    s_other = np.broadcast_to(sink_lse, (rows, heads)).copy()
    if is_torch(o):
        import torch

        s_other = torch.from_numpy(s_other).to(lse.device)
        v_other = torch.zeros_like(o)
    else:
        v_other = np.zeros_like(o)
    merge_state_in_place(o, lse, v_other, s_other)


def sink_variant(jit_args: Any, jit_kwargs: Any) -> bool:
    """Whether a wrapper's jit_args name FlashInfer's attention-sink variant:
    its extra run() arguments are the tensor ``sink`` and the scalar
    ``sm_scale`` (FlashInfer's gpt-oss tests build it so), which pagedkv runs
    as ``sinks=`` and the softmax scale. False for no jit_args; ValueError
    for any other JIT variant, or jit_kwargs other than use_sliding_window
    (the window comes from plan()'s window_left).

    Examples
    --------
    >>> sink_variant(None, None)
    False
    """
    if jit_args is None:
        if jit_kwargs is not None:
            raise ValueError("jit_kwargs come with jit_args")
        return False
    names = list(jit_args) if isinstance(jit_args, (list, tuple)) else []
    if (
        len(names) < 12
        or list(names[7]) != ["sink"]
        or list(names[9]) != ["sm_scale"]
        or names[11] != SINK_VARIANT
    ):
        raise ValueError(
            "jit_args drives FlashInfer's JIT; pagedkv runs only its attention-sink variant"
            f" ({SINK_VARIANT}: tensor 'sink', scalar 'sm_scale')"
        )
    if jit_kwargs is not None and set(jit_kwargs) - {"use_sliding_window"}:
        raise ValueError(f"jit_kwargs {sorted(jit_kwargs)}: only use_sliding_window is taken")
    return True


def q_scale_for(sm_scale: Any, planned_scale: float) -> float:
    """The q_scale that makes a run's scores scaled by sm_scale: the kernel
    multiplies q.k by the plan's scale and by q_scale, so their product is
    sm_scale (the sink wrappers take sm_scale with each run)."""
    return check_float("sm_scale", sm_scale, positive=True) / planned_scale
