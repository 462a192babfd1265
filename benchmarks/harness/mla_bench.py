"""MLA decode on the CPU beside torch on the gathered latents: ms, GFLOP/s,
GB/s and share of the measured read bandwidth, ratios.

Absorbed MLA decode reads each cached token's latent once (ckv_dim + kpe_dim
elements) for all query heads and spends 2 x heads x (2 ckv_dim + kpe_dim)
FLOPs on it: about 280 kFLOP per token per request at 128 heads against
1152 bytes in bfloat16, so on a CPU it is compute-bound, and GFLOP/s says
more than the share of read bandwidth (a GPU goal).

The anchor is torch's scaled_dot_product_attention on latents gathered
beforehand to contiguous [B, 1, L, ckv_dim + kpe_dim] and [B, 1, L, ckv_dim]
(the gather is not timed), the heads folded into the query length of one
KV head, all of torch's threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .anchors import (
    Timing,
    read_bandwidth_gbps,
    rows_by_case,
    same_bytes_reads,
    time_round_robin,
)

CKV, KPE = 512, 64


@dataclass(frozen=True)
class MLAShape:
    batch: int
    seq_len: int
    heads: int
    page_size: int = 64

    @property
    def label(self) -> str:
        return f"{self.batch}, {self.seq_len}, {self.heads}"

    def latent_bytes(self, element_size: int) -> int:
        return self.batch * self.seq_len * (CKV + KPE) * element_size

    def flops(self) -> int:
        return self.batch * self.seq_len * self.heads * 2 * (2 * CKV + KPE)


SHAPES = (
    MLAShape(32, 4096, 128),
    MLAShape(1, 65536, 128),
    MLAShape(32, 4096, 16),
    MLAShape(4, 1024, 128),
)
"""(B, L, heads): the issue's batch 32 x 4k, one request of 64k (split across
the cores), a 16-head shard, a small batch."""


@dataclass
class MLARow:
    shape: MLAShape
    dtype: str
    name: str
    timing: Timing
    gbps: float
    gflops: float
    max_abs_diff: float | None


def mla_case(shape: MLAShape, dtype: str, seed: int = 0):
    """Caches in shuffled pages, decode queries, a planned wrapper; and the
    latents gathered per request for torch."""
    import torch

    import pagedkv

    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    pages = -(-shape.seq_len // shape.page_size)
    num_pages = shape.batch * pages
    ckv = torch.randn(num_pages, shape.page_size, CKV, generator=gen).to(tdtype)
    kpe = torch.randn(num_pages, shape.page_size, KPE, generator=gen).to(tdtype)
    q_nope = torch.randn(shape.batch, shape.heads, CKV, generator=gen).to(tdtype)
    q_pe = torch.randn(shape.batch, shape.heads, KPE, generator=gen).to(tdtype)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    kv_indptr = torch.arange(shape.batch + 1, dtype=torch.int32) * pages
    kv_lens = torch.full((shape.batch,), shape.seq_len, dtype=torch.int32)
    qo_indptr = torch.arange(shape.batch + 1, dtype=torch.int32)
    scale = 1 / math.sqrt(128 + KPE)
    wrapper = pagedkv.BatchMLAPagedAttentionWrapper(torch.empty(64 << 20, dtype=torch.uint8))
    wrapper.plan(qo_indptr, kv_indptr, order, kv_lens, shape.heads, CKV, KPE,
                 shape.page_size, False, scale, tdtype, tdtype)  # fmt: skip
    out = torch.empty_like(q_nope)

    def ours():
        return wrapper.run(q_nope, q_pe, ckv, kpe, out=out)

    rows = order.long().reshape(shape.batch, pages)
    c = ckv[rows].reshape(shape.batch, 1, -1, CKV)[:, :, : shape.seq_len].contiguous()
    k = torch.cat([c, kpe[rows].reshape(shape.batch, 1, -1, KPE)[:, :, : shape.seq_len]], -1)
    q = torch.cat([q_nope, q_pe], -1).reshape(shape.batch, 1, shape.heads, CKV + KPE)

    def anchor():
        return torch.nn.functional.scaled_dot_product_attention(q, k, c, scale=scale)

    return ours, anchor


def run_mla_bench(
    shapes=SHAPES, dtypes=("bfloat16",), reps: int = 7, verbose: bool = True
) -> tuple[float, list[MLARow]]:
    """Times pagedkv's MLA decode, torch SDPA and plain reads of the same
    bytes, interleaved; returns the measured read bandwidth and the rows."""
    import torch

    bandwidth = read_bandwidth_gbps()
    if verbose:
        print(f"read bandwidth: {bandwidth:.1f} GB/s", flush=True)
    rows: list[MLARow] = []
    for shape in shapes:
        for dtype in dtypes:
            ours, anchor = mla_case(shape, dtype)
            want = anchor().float().reshape(shape.batch, shape.heads, CKV)
            diff = float((ours().float() - want).abs().max())
            nbytes = shape.latent_bytes(torch.empty(0, dtype=getattr(torch, dtype)).element_size())
            fns = {"pagedkv": ours, "torch_sdpa": anchor, **same_bytes_reads(nbytes)}
            for name, t in time_round_robin(fns, reps=reps, max_s=8.0).items():
                seconds = t.median_ms / 1e3
                row = MLARow(
                    shape,
                    dtype,
                    name,
                    t,
                    nbytes / seconds / 1e9,
                    shape.flops() / seconds / 1e9 if name in ("pagedkv", "torch_sdpa") else 0.0,
                    diff if name == "pagedkv" else None,
                )
                rows.append(row)
                if verbose:
                    print(
                        f"  {shape.label:16s} {dtype:8s} {name:12s} {t.median_ms:9.2f} ms"
                        f" {row.gflops:7.1f} GFLOP/s {row.gbps:6.1f} GB/s"
                        f" {100 * row.gbps / bandwidth:4.0f}% of read BW",
                        flush=True,
                    )
            del ours, anchor, fns
    return bandwidth, rows


def format_mla_table(cpu: str, bandwidth: float, rows: list[MLARow]) -> str:
    """pagedkv's median ms, GFLOP/s, GB/s of latents and share of the read
    bandwidth; torch's ms and GFLOP/s and the ratio torch ms / pagedkv ms."""
    lines = [
        f"CPU: {cpu}; read bandwidth measured in this run: {bandwidth:.1f} GB/s",
        f"{'shape (B, L, H)':16s} {'dtype':8s} {'pagedkv ms':>10s} {'GFLOP/s':>8s} "
        f"{'GB/s':>6s} {'%BW':>4s} {'torch ms':>9s} {'GFLOP/s':>8s} {'xtorch':>6s} "
        f"{'max|diff|':>9s}",
    ]
    for (shape, dtype), g in rows_by_case(rows).items():
        ours, torch_row = g["pagedkv"], g["torch_sdpa"]
        lines.append(
            f"{shape.label:16s} {dtype:8s} {ours.timing.median_ms:10.2f} {ours.gflops:8.1f} "
            f"{ours.gbps:6.1f} {100 * ours.gbps / bandwidth:4.0f} "
            f"{torch_row.timing.median_ms:9.2f} {torch_row.gflops:8.1f} "
            f"{torch_row.timing.median_ms / ours.timing.median_ms:6.2f} "
            f"{ours.max_abs_diff:9.2g}"
        )
    return "\n".join(lines)
