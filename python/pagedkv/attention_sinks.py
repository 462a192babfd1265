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

from ._ops.tensors import Array, is_torch
from .cascade import merge_state_in_place


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
