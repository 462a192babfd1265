"""What the decode tests share: the sampled grid of cases, a random batch
over shuffled pages, a planned wrapper, and one case run against the float64
NumPy reference (tests/reference.py) on the CPU or a GPU; which cases the
GPU's TMA and tensor-core kernels serve."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import pagedkv
import reference
from conftest import DECODE_CONFIGS, as_f64, cast, to_device

BATCHES = [1, 7, 33]
GROUPS = [(1, 4), (4, 2), (8, 1)]  # (query heads per KV head, KV heads)
HEAD_DIMS = [64, 128, 256, 512]
PAGE_SIZES = [1, 16, 64]
POS_MODES = ["NONE", "ROPE_LLAMA", "ALIBI"]
WINDOWS = [-1, 0, 17]
SOFT_CAPS = [None, 30.0]
SM_SCALES = [None, 0.05]


@dataclass(frozen=True)
class Case:
    q_dtype: str
    kv_dtype: str
    batch: int
    group: int
    kv_heads: int
    head_dim: int
    page_size: int
    layout: str
    form: str
    pos_mode: str
    window_left: int
    soft_cap: float | None
    sm_scale: float | None
    seed: int

    def __str__(self) -> str:
        return (
            f"{self.q_dtype}-{self.kv_dtype}-B{self.batch}-G{self.group}x{self.kv_heads}-"
            f"D{self.head_dim}-P{self.page_size}-{self.layout}-{self.form}-{self.pos_mode}-"
            f"w{self.window_left}-cap{self.soft_cap}-s{self.sm_scale}"
        )

    @property
    def options(self) -> dict:
        """The attention options plan() and the reference take by the same names."""
        return dict(
            pos_encoding_mode=self.pos_mode,
            window_left=self.window_left,
            logits_soft_cap=self.soft_cap,
            sm_scale=self.sm_scale,
        )


def sampled_grid(count: int = 30) -> list[Case]:
    """A fixed-seed sample in which every value of every axis appears.

    Each axis is cycled through a shuffled order of its values, so all values
    come up within the first len(axis) cases and combine differently after.
    The (dtypes, layout, pool form) of a case is one of DECODE_CONFIGS: the
    graphs the suite compiles once.
    """
    rng = np.random.default_rng(2024)
    axes = [
        DECODE_CONFIGS,
        BATCHES,
        GROUPS,
        HEAD_DIMS,
        PAGE_SIZES,
        POS_MODES,
        WINDOWS,
        SOFT_CAPS,
        SM_SCALES,
    ]
    orders = [rng.permutation(count) % len(axis) for axis in axes]
    cases = []
    for i in range(count):
        v = [axis[int(order[i])] for axis, order in zip(axes, orders, strict=True)]
        (q_dt, kv_dt, layout, form), batch, (group, kv_heads), head_dim, page = v[:5]
        cases.append(
            Case(q_dt, kv_dt, batch, group, kv_heads, head_dim, page, layout, form, *v[5:], seed=i)
        )
    return cases


def lengths_for(case: Case, rng: np.random.Generator) -> list[int]:
    """Ragged lengths from {0, 1, P, P + 1, ~2000}; long ones kept few so the
    pools stay small, and always present in single-request batches (which
    split-K then splits across cores)."""
    p = case.page_size
    short = [0, 1, p, p + 1]
    if case.batch == 1:
        return [int(rng.integers(1900, 2100))]
    lengths = [short[i % 4] for i in range(case.batch)]
    lengths[rng.integers(case.batch)] = int(rng.integers(1900, 2100))
    return list(rng.permutation(lengths))


def build(case: Case):
    rng = np.random.default_rng(case.seed)
    lens = lengths_for(case, rng)
    batch = reference.paged_batch(rng, case.page_size, lens, [0] * len(lens))
    h, d, p = case.kv_heads, case.head_dim, case.page_size
    page = (p, h, d) if case.layout == "NHD" else (h, p, d)
    pool = cast(rng.standard_normal((batch.num_pages, 2, *page), dtype=np.float32), case.kv_dtype)
    cache = (
        pool
        if case.form == "pool"
        else (pool[:, 0].contiguous(), pool[:, 1].contiguous())
        if isinstance(pool, torch.Tensor)
        else (pool[:, 0].copy(), pool[:, 1].copy())
    )
    return batch, pool, cache


def references(case, batch, pool, q, k_scale=1.0, v_scale=1.0):
    per_request = reference.gather(
        as_f64(pool), batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, case.layout
    )
    outs, lses = [], []
    for b, (k, v) in enumerate(per_request):
        o, lse = reference.attention(
            as_f64(q)[b : b + 1],
            k,
            v,
            np.array([len(k) - 1]),
            **case.options,
            qk_scale=k_scale,
            v_scale=v_scale,
            alibi_from_zero=True,  # FlashInfer's decode kernels
        )
        outs.append(o[0])
        lses.append(lse[0])
    return np.stack(outs), np.stack(lses)


def tolerance(case: Case) -> float:
    return 1e-5 if case.q_dtype == "float32" else 1e-2


def planned(
    case: Case, batch: reference.PagedBatch, device: str = "cpu", backend: str = "auto"
) -> pagedkv.BatchDecodeWithPagedKVCacheWrapper:
    """A decode wrapper with `backend`, planned on device ("cpu" or "cuda")
    for batch's page table with every option of case."""
    wrapper = pagedkv.BatchDecodeWithPagedKVCacheWrapper(kv_layout=case.layout, backend=backend)
    wrapper.plan(
        *to_device((batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len), device),
        case.group * case.kv_heads,
        case.kv_heads,
        case.head_dim,
        case.page_size,
        q_data_type=case.q_dtype,
        kv_data_type=case.kv_dtype,
        **case.options,
    )
    return wrapper


def check_decode_case(case: Case, device: str = "cpu", backend: str = "auto") -> None:
    """Plans and runs `case` on device ("cpu" or "cuda") with `backend`, twice
    with new queries, against the float64 reference."""
    batch, pool, cache = build(case)
    cache = to_device(cache, device)
    wrapper = planned(case, batch, device, backend)
    rng = np.random.default_rng(case.seed + 1000)
    hq = case.group * case.kv_heads
    fp8 = case.kv_dtype.startswith("float8")
    # One plan, several runs: new queries (and, for fp8, new scales) each time.
    for run in range(2):
        q = cast(
            rng.standard_normal((batch.batch_size, hq, case.head_dim), dtype=np.float32),
            case.q_dtype,
        )
        k_scale, v_scale = (0.5 + run, 2.0 - run) if fp8 else (None, None)
        o, lse = wrapper.run(
            to_device(q, device), cache, k_scale=k_scale, v_scale=v_scale, return_lse=True
        )
        want_o, want_lse = references(case, batch, pool, q, k_scale or 1.0, v_scale or 1.0)
        tol = tolerance(case)
        np.testing.assert_allclose(as_f64(o), want_o, rtol=tol, atol=tol)
        finite = np.isfinite(want_lse)
        np.testing.assert_array_equal(np.isfinite(as_f64(lse)), finite)
        np.testing.assert_allclose(as_f64(lse)[finite], want_lse[finite], rtol=tol, atol=tol)
        assert (as_f64(lse)[~finite] == -np.inf).all()
    plain = wrapper.run(to_device(q, device), cache, k_scale=k_scale, v_scale=v_scale)
    np.testing.assert_array_equal(as_f64(plain), as_f64(o))


def fits_gpu_kernel(case: Case, max_group: int) -> bool:
    """What the TMA and tensor-core kernels both need: NHD pages of a
    multiple of 16 tokens, at most max_group query heads per KV head, no RoPE."""
    return (
        case.layout == "NHD"
        and case.page_size % 16 == 0
        and case.group <= max_group
        and case.pos_mode != "ROPE_LLAMA"
    )


def tma_applies(case: Case) -> bool:
    return fits_gpu_kernel(case, 8) and not (
        case.kv_dtype.startswith("float8") and case.head_dim == 64
    )


def mma_applies(case: Case) -> bool:
    return (
        fits_gpu_kernel(case, 16)
        and case.q_dtype == case.kv_dtype
        and case.q_dtype in ("float16", "bfloat16")
        and case.head_dim in (64, 128)
    )
