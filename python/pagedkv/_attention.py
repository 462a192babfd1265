"""Attention options shared by decode and prefill, and the work split of a batch.

The options have FlashInfer's meaning (see mojo_ops/attention_params.mojo for
the exact formulas); they travel to the kernels as two small host tensors, so
changing them never recompiles anything.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from max.dtype import DType

POS_ENCODING_MODES = {"NONE": 0, "ROPE_LLAMA": 1, "ALIBI": 2}
HEAD_DIMS = (64, 128, 256)


def as_dtype(x: object, name: str) -> DType:
    """A dtype given as a MAX DType, a torch or NumPy dtype, or a string."""
    if isinstance(x, DType):
        return x
    text = str(x).removeprefix("torch.")
    try:
        return DType[text]
    except KeyError:
        pass
    try:
        return DType.from_numpy(np.dtype(x))
    except TypeError as e:
        raise TypeError(f"{name}: {x!r} is not a dtype") from e


@dataclass(frozen=True)
class AttentionOptions:
    """Validated scalar options of one plan()."""

    head_dim: int
    pos_encoding_mode: str = "NONE"
    window_left: int = -1
    logits_soft_cap: float | None = None
    sm_scale: float | None = None
    rope_scale: float | None = None
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.pos_encoding_mode not in POS_ENCODING_MODES:
            raise ValueError(
                f"pos_encoding_mode must be one of {sorted(POS_ENCODING_MODES)}, "
                f"got {self.pos_encoding_mode!r}"
            )
        if int(self.window_left) < -1:
            raise ValueError(f"window_left must be >= -1, got {self.window_left}")
        if self.logits_soft_cap is not None and self.logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be positive, got {self.logits_soft_cap}")
        for name in ("sm_scale", "rope_scale", "rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def float_params(
        self, q_scale: float | None, k_scale: float | None, v_scale: float | None
    ) -> np.ndarray:
        sm_scale = self.sm_scale if self.sm_scale is not None else 1 / math.sqrt(self.head_dim)
        qk_scale = (1.0 if q_scale is None else q_scale) * (1.0 if k_scale is None else k_scale)
        return np.array(
            [
                sm_scale,
                self.logits_soft_cap or 0.0,
                self.rope_scale or 1.0,
                self.rope_theta or 1e4,
                qk_scale,
                1.0 if v_scale is None else v_scale,
                0.0,
                0.0,
            ],
            np.float32,
        )

    def int_params(self, heads_per_task: int = 1) -> np.ndarray:
        """window_left, pos_encoding, KV heads per CPU task (see
        mojo_ops/attention_params.mojo)."""
        return np.array(
            [int(self.window_left), POS_ENCODING_MODES[self.pos_encoding_mode], heads_per_task]
            + [0] * 5,
            np.int32,
        )


MAX_TASK_QO_HEADS = 64
"""Query heads one CPU task scores together (its state lives on the heap)."""


def heads_per_task(num_qo_heads: int, num_kv_heads: int) -> int:
    """KV heads per CPU task: all of them when their query heads fit, so an
    NHD page is read token row by token row, in memory order."""
    group = num_qo_heads // num_kv_heads
    return max(1, min(num_kv_heads, MAX_TASK_QO_HEADS // group))


def parallel_slots(is_gpu: bool) -> int:
    """Independent work items that keep the machine busy: 4 per CPU core, or
    4 per SM of a typical datacenter GPU."""
    if is_gpu:
        return 4 * 132
    return 4 * (os.cpu_count() or 1)


def split_work(
    seq_lens: np.ndarray,
    first_visible: np.ndarray,
    head_blocks: int,
    page_size: int,
    slots: int,
    min_chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """Splits each request's visible tokens [first_visible, seq_len) into chunks.

    Chunks are page-aligned and sized so that (items x head blocks) fills about
    `slots` parallel workers; a short batch of long requests is split
    (flash-decoding), a large batch is not. Returns items [I, 3] (request,
    first, end) and request_items [B + 1] (CSR offsets into items); every
    request has at least one item, so empty ones get o = 0, lse = -inf.
    """
    seq_lens = seq_lens.astype(np.int64)
    first_visible = first_visible.astype(np.int64)
    visible = seq_lens - first_visible
    per_head_slots = max(slots // max(head_blocks, 1), 1)
    chunk = max(min_chunk, -(-int(visible.sum()) // per_head_slots))
    chunk = -(-chunk // page_size) * page_size
    # Chunks start on page boundaries of the sequence, counted from 0.
    start_page = first_visible // page_size
    aligned = start_page * page_size
    counts = np.maximum(-(-(seq_lens - aligned) // chunk), 1)
    request_items = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    request = np.repeat(np.arange(len(seq_lens)), counts)
    k = np.arange(int(request_items[-1])) - request_items[request]
    first = np.maximum(aligned[request] + k * chunk, first_visible[request])
    end = np.minimum(aligned[request] + (k + 1) * chunk, seq_lens[request])
    items = np.stack([request, first, np.maximum(end, first)], axis=1).astype(np.int32)
    return np.ascontiguousarray(items), request_items
