"""Append throughput: pagedkv's scatter into pages beside NumPy (or torch on a
GPU) doing the same scatter with a fancy-index assignment, one run, ratios.

Bytes moved = the appended K and V read once and written once (2x payload),
the STREAM convention for a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .anchors import Timing, rows_by_case, time_round_robin


@dataclass(frozen=True)
class AppendShape:
    label: str
    batch: int
    tokens_per_request: int
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16

    @property
    def nnz(self) -> int:
        return self.batch * self.tokens_per_request

    def payload_bytes(self, itemsize: int) -> int:
        return 2 * self.nnz * self.num_kv_heads * self.head_dim * itemsize


APPEND_SHAPES = (
    AppendShape("prefill 5000 tokens", 1, 5000),
    AppendShape("prefill 8x1024 tokens", 8, 1024),
    AppendShape("decode 8 tokens", 8, 1),
    AppendShape("decode 256 tokens", 256, 1),
)


@dataclass
class AppendRow:
    shape: AppendShape
    dtype: str
    name: str
    timing: Timing
    gbps: float


def _case(shape: AppendShape, dtype: str, device: str, seed: int = 0):
    import torch

    rng = np.random.default_rng(seed)
    s = shape
    cached = 2048  # tokens already in each request before the append
    length = cached + s.tokens_per_request
    npg = -(-length // s.page_size)
    num_pages = s.batch * npg + 8
    table = rng.permutation(num_pages)[: s.batch * npg].astype(np.int32).reshape(s.batch, npg)
    indptr = (np.arange(s.batch + 1) * npg).astype(np.int32)
    last = np.full(s.batch, length - (npg - 1) * s.page_size, np.int32)
    b = np.repeat(np.arange(s.batch), s.tokens_per_request).astype(np.int32)
    pos = np.tile(np.arange(cached, length), s.batch).astype(np.int32)
    tdt = getattr(torch, dtype)
    pool = torch.zeros((num_pages, 2, s.page_size, s.num_kv_heads, s.head_dim), dtype=tdt)
    k = torch.randn((s.nnz, s.num_kv_heads, s.head_dim)).to(tdt)
    v = torch.randn((s.nnz, s.num_kv_heads, s.head_dim)).to(tdt)
    page_of = table[b, pos // s.page_size]
    slot = pos % s.page_size
    meta = dict(
        batch_indices=b,
        positions=pos,
        kv_indices=table.reshape(-1).copy(),
        kv_indptr=indptr,
        kv_last_page_len=last,
    )
    if device != "cpu":
        pool, k, v = pool.to(device), k.to(device), v.to(device)
        meta = {n: torch.from_numpy(x).to(device) for n, x in meta.items()}
    return pool, k, v, meta, page_of, slot


def bound_append(append, k, v, pool, meta: dict) -> Callable[[], object]:
    """A call of `append` (pagedkv's or FlashInfer's append_paged_kv_cache:
    the same parameters) writing k and v [nnz, Hkv, D] into pool at the
    tokens and pages that meta (as `_case` makes it) names."""
    return functools.partial(
        append,
        k,
        v,
        meta["batch_indices"],
        meta["positions"],
        pool,
        meta["kv_indices"],
        meta["kv_indptr"],
        meta["kv_last_page_len"],
    )


def append_fns(shape: AppendShape, dtype: str, device: str) -> tuple[dict, int]:
    """The timed callables for one case (pagedkv and the scatters of the
    same data), and the bytes each moves."""
    import torch

    import pagedkv

    pool, k, v, meta, page_of, slot = _case(shape, dtype, device)
    idx_page = torch.from_numpy(page_of.astype(np.int64)).to(pool.device)
    idx_slot = torch.from_numpy(slot.astype(np.int64)).to(pool.device)

    ours = bound_append(pagedkv.append_paged_kv_cache, k, v, pool, meta)

    def torch_scatter() -> None:
        pool[idx_page, 0, idx_slot] = k
        pool[idx_page, 1, idx_slot] = v

    fns = {"pagedkv": ours, "torch_index_put": torch_scatter}
    if dtype == "float32" and device == "cpu":
        np_pool, kn, vn = pool.numpy(), k.numpy(), v.numpy()

        def numpy_scatter() -> None:
            np_pool[page_of, 0, slot] = kn
            np_pool[page_of, 1, slot] = vn

        fns["numpy_fancy_index"] = numpy_scatter
    return fns, 2 * shape.payload_bytes(pool.element_size())


def run_append_bench(
    shapes=APPEND_SHAPES,
    dtypes=("float32", "bfloat16"),
    device: str = "cpu",
    reps: int = 20,
    verbose: bool = True,
) -> list[AppendRow]:
    """Times pagedkv's append and the fancy-index scatters of the same data."""
    rows: list[AppendRow] = []
    for shape in shapes:
        for dtype in dtypes:
            fns, nbytes = append_fns(shape, dtype, device)
            timings = time_round_robin(fns, reps=reps, max_s=2.0, flush=device == "cpu")
            for name, t in timings.items():
                row = AppendRow(shape, dtype, name, t, nbytes / t.median_ms / 1e6)
                rows.append(row)
                if verbose:
                    print(
                        f"  {shape.label:24s} {dtype:8s} {name:18s} {t.median_ms:9.4f} ms "
                        f"{row.gbps:7.1f} GB/s",
                        flush=True,
                    )
    return rows


def format_append_table(rows: list[AppendRow]) -> str:
    """The append table: pagedkv's ms and GB/s per (shape, dtype), beside the
    NumPy and torch scatters as GB/s and ratios."""
    lines = [
        f"{'append':24s} {'dtype':8s} {'pagedkv ms':>10s} {'GB/s':>6s} {'numpy GB/s':>10s} "
        f"{'x numpy':>7s} {'torch GB/s':>10s} {'x torch':>7s}"
    ]
    for (shape, dtype), group in rows_by_case(rows).items():
        ours = group["pagedkv"]
        np_row = group.get("numpy_fancy_index")
        torch_row = group["torch_index_put"]
        np_gbps = f"{np_row.gbps:10.1f}" if np_row else f"{'-':>10s}"
        np_x = f"{ours.gbps / np_row.gbps:7.2f}" if np_row else f"{'-':>7s}"
        lines.append(
            f"{shape.label:24s} {dtype:8s} {ours.timing.median_ms:10.4f} {ours.gbps:6.1f} "
            f"{np_gbps} {np_x} {torch_row.gbps:10.1f} {ours.gbps / torch_row.gbps:7.2f}"
        )
    return "\n".join(lines)
