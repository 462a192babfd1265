"""Prefill attention on the CPU beside torch SDPA, in one run.

Each shape is a prompt prefilled in one step: B requests of L tokens whose
K/V are already in the paged cache, each token a query that attends causally
to the tokens up to it. torch SDPA runs on the same K/V gathered beforehand
to contiguous [B, Hkv, L, D] (not timed), with `is_causal` and `enable_gqa`.
The work is 4 x D floating-point operations per (query head, visible key):
q.k and p.v, a multiply and an add each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .anchors import Timing, rows_by_case, time_round_robin
from .decode_bench import DecodeShape, make_case


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    seq_len: int
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16

    @property
    def label(self) -> str:
        return f"({self.batch}, {self.seq_len}, {self.num_qo_heads}, {self.num_kv_heads})"

    def flops(self) -> float:
        """4 x D per (query head, visible key), causal."""
        pairs = self.batch * self.num_qo_heads * self.seq_len * (self.seq_len + 1) / 2
        return 4 * self.head_dim * pairs


CPU_PREFILL_SHAPES = (PrefillShape(1, 2048), PrefillShape(4, 512))


@dataclass
class PrefillRow:
    shape: PrefillShape
    dtype: str
    name: str
    timing: Timing
    gflops: float
    max_abs_diff: float


def prefill_fns(shape: PrefillShape, dtype: str):
    """(name -> callable) for pagedkv's prefill and torch SDPA on one batch;
    the plan and the gather are done here, outside the timed calls."""
    import torch
    import torch.nn.functional as F

    import pagedkv

    s = shape
    case = make_case(
        DecodeShape(s.batch, s.seq_len, s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size),
        dtype,
    )
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((s.batch * s.seq_len, s.num_qo_heads, s.head_dim), generator=gen)
    q = q.to(case.q.dtype)
    qo_indptr = (np.arange(s.batch + 1) * s.seq_len).astype(np.int32)
    wrapper = pagedkv.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    wrapper.plan(
        qo_indptr,
        case.kv_indptr,
        case.kv_indices,
        case.kv_last_page_len,
        s.num_qo_heads,
        s.num_kv_heads,
        s.head_dim,
        s.page_size,
        causal=True,
        q_data_type=q.dtype,
        kv_data_type=case.pool.dtype,
    )
    k, v = case.gathered()
    q_heads = q.reshape(s.batch, s.seq_len, s.num_qo_heads, s.head_dim).transpose(1, 2)
    q_heads = q_heads.contiguous()

    def sdpa():
        with torch.inference_mode():
            out = F.scaled_dot_product_attention(q_heads, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)

    return {"pagedkv": lambda: wrapper.run(q, case.pool), "torch_sdpa": sdpa}


def run_prefill_bench(
    shapes=CPU_PREFILL_SHAPES, dtypes=("float32", "bfloat16"), reps: int = 8
) -> list[PrefillRow]:
    """Times pagedkv's prefill and torch SDPA interleaved (no cache flush:
    prefill is bound by arithmetic); a row per implementation."""
    import torch

    rows: list[PrefillRow] = []
    for shape in shapes:
        for dtype in dtypes:
            fns = prefill_fns(shape, dtype)
            outs = {n: torch.from_dlpack(fn()).float() for n, fn in fns.items()}
            diff = float((outs["pagedkv"] - outs["torch_sdpa"]).abs().max())
            for name, t in time_round_robin(fns, reps=reps, flush=False).items():
                gflops = shape.flops() / t.median_ms / 1e6
                rows.append(PrefillRow(shape, dtype, name, t, gflops, diff))
            del fns, outs
    return rows


def format_prefill_table(rows: list[PrefillRow]) -> str:
    """pagedkv's and torch's median ms and GFLOP/s, and torch's time over
    pagedkv's (above 1: pagedkv faster), with the largest difference of
    their outputs."""
    lines = [
        f"{'shape (B, L, Hq, Hkv)':22s} {'dtype':8s} {'pagedkv ms':>10s} {'GFLOP/s':>8s} "
        f"{'torch ms':>9s} {'GFLOP/s':>8s} {'xtorch':>6s} {'max|diff|':>9s}"
    ]
    for (shape, dtype), group in rows_by_case(rows).items():
        ours, torch_row = group["pagedkv"], group["torch_sdpa"]
        ratio = torch_row.timing.median_ms / ours.timing.median_ms
        lines.append(
            f"{shape.label:22s} {dtype:8s} {ours.timing.median_ms:10.2f} {ours.gflops:8.1f} "
            f"{torch_row.timing.median_ms:9.2f} {torch_row.gflops:8.1f} {ratio:6.2f} "
            f"{ours.max_abs_diff:9.2e}"
        )
    return "\n".join(lines)
