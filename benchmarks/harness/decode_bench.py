"""Decode attention: pagedkv beside its anchors, one run, ratios.

Each shape is one decode step: B requests of L cached tokens, Hq query heads
over Hkv KV heads of dim D, pages of P tokens in random order. Every
implementation reads the same K/V; K and V bytes / time is the effective
bandwidth, reported as a share of the machine's measured read bandwidth.
On the CPU the pool, and torch's pre-gathered K/V, lie on 2 MiB pages, as
pagedkv's page manager allocates pools and as NumPy allocates the arrays
whose reads measure the bandwidth (see runtime/huge_pages.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedkv._ops.tensors import dtype_of
from pagedkv.runtime.huge_pages import huge_page_zeros

from .anchors import (
    Timing,
    burst_speedup,
    cpu_times,
    max_builtin_decode,
    read_bandwidth_gbps,
    rows_by_case,
    same_bytes_reads,
    steal_share,
    time_round_robin,
    torch_sdpa_decode,
)
from .threads import poller_demoted, workers_pinned


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    seq_len: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int = 128
    page_size: int = 16

    @property
    def label(self) -> str:
        return f"({self.batch}, {self.seq_len}, {self.num_qo_heads}, {self.num_kv_heads})"

    def kv_bytes(self, itemsize: int, row_width: int | None = None) -> int:
        """K/V bytes of the batch, rows row_width elements wide (head_dim
        unless given: an int8 pool's rows also hold their scales)."""
        row = row_width or self.head_dim
        return 2 * self.batch * self.seq_len * self.num_kv_heads * row * itemsize


CPU_SHAPES = (
    DecodeShape(1, 4096, 32, 8),
    DecodeShape(16, 1024, 32, 8),
    DecodeShape(64, 512, 32, 32),
    DecodeShape(32, 2048, 32, 8),
)


@dataclass
class DecodeCase:
    """One step's data as torch tensors, plus the page table."""

    shape: DecodeShape
    q: object
    pool: object  # [num_pages + 1, 2, P, Hkv, D]; the last page is MAX's null page
    page_table: np.ndarray  # [B, pages per request]
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray

    @property
    def num_pages(self) -> int:
        return int(self.page_table.size)

    def gathered(self) -> tuple[object, object]:
        """Contiguous K, V [B, Hkv, L, D] (for torch SDPA; not timed)."""
        import torch

        s = self.shape
        table = torch.from_numpy(self.page_table.astype(np.int64))
        k = self.pool[table, 0].reshape(s.batch, -1, s.num_kv_heads, s.head_dim)[:, : s.seq_len]
        v = self.pool[table, 1].reshape(s.batch, -1, s.num_kv_heads, s.head_dim)[:, : s.seq_len]
        return tuple(_like_pool(x.transpose(1, 2), self.pool) for x in (k, v))


def make_case(
    shape: DecodeShape, dtype: str, seed: int = 0, device: str = "cpu", q_dtype: str | None = None
) -> DecodeCase:
    """A decode batch of `shape` in dtype: random q [B, Hq, D] (in q_dtype if
    given) and an NHD pool [pages + 1, 2, P, Hkv, D] (the last page zero)
    whose pages each request owns in a random order, with its page table, on
    device."""
    import torch

    rng = np.random.default_rng(seed)
    s = shape
    npg = -(-s.seq_len // s.page_size)
    num_pages = s.batch * npg
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((num_pages + 1, 2, s.page_size, s.num_kv_heads, s.head_dim), generator=gen)
    pool = _int8_pool(pool) if dtype == "int8" else pool.to(getattr(torch, dtype))
    pool[num_pages] = 0
    q = torch.randn((s.batch, s.num_qo_heads, s.head_dim), generator=gen)
    q = q.to(getattr(torch, q_dtype) if q_dtype else pool.dtype)
    table = rng.permutation(num_pages).astype(np.int32).reshape(s.batch, npg)
    indptr = (np.arange(s.batch + 1) * npg).astype(np.int32)
    last = np.full(s.batch, s.seq_len - (npg - 1) * s.page_size, np.int32)
    if device != "cpu":
        pool, q = pool.to(device), q.to(device)
    pool = _like_pool(pool, pool)
    return DecodeCase(s, q, pool, table, indptr, table.reshape(-1).copy(), last)


def _int8_pool(pool):
    """The float pool [pages, 2, P, H, D] (NHD) as an int8 pool [pages, 2,
    P, H, D + 4], quantized by pagedkv's own append: one request owning
    every page in order."""
    import torch

    import pagedkv

    pages, _, page_size, heads, head_dim = pool.shape
    out = torch.zeros((pages, 2, page_size, heads, head_dim + 4), dtype=torch.int8)
    tokens = pages * page_size
    keys = pool[:, 0].reshape(tokens, heads, head_dim).contiguous()
    values = pool[:, 1].reshape(tokens, heads, head_dim).contiguous()
    pagedkv.append_paged_kv_cache(
        keys,
        values,
        torch.zeros(tokens, dtype=torch.int32),
        torch.arange(tokens, dtype=torch.int32),
        out,
        torch.arange(pages, dtype=torch.int32),
        torch.tensor([0, pages], dtype=torch.int32),
        torch.tensor([page_size], dtype=torch.int32),
    )
    return out


def _like_pool(x, pool):
    """A contiguous copy of tensor x in memory of the pool's kind: on a GPU,
    x itself made contiguous; on the host, on 2 MiB pages."""
    if pool.is_cuda:
        return x.contiguous()
    out = huge_page_zeros(tuple(x.shape), dtype_of(x), use_torch=True)
    out.copy_(x)
    return out


def plan_decode(
    wrapper, case: DecodeCase, to_device: Callable[[np.ndarray], object], **options
) -> None:
    """Plans `wrapper` (pagedkv's or FlashInfer's
    BatchDecodeWithPagedKVCacheWrapper: the same plan) for the case's batch,
    its page table moved by to_device where the wrapper reads it; options go
    to plan() as they are (fixed_split_size, disable_split_kv)."""
    s = case.shape
    wrapper.plan(
        to_device(case.kv_indptr),
        to_device(case.kv_indices),
        to_device(case.kv_last_page_len),
        s.num_qo_heads,
        s.num_kv_heads,
        s.head_dim,
        s.page_size,
        q_data_type=case.q.dtype,
        kv_data_type=case.pool.dtype,
        **options,
    )


def pagedkv_decode(case: DecodeCase, backend: str = "auto", **options):
    """A callable running pagedkv's decode on the case (plan outside timing,
    `options` passed to plan()); its `wrapper` attribute is the planned
    BatchDecodeWithPagedKVCacheWrapper."""
    import pagedkv
    from pagedkv._ops.tensors import new_like

    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD", backend=backend)
    plan_decode(w, case, lambda x: new_like(case.q, x), **options)

    def run():
        return w.run(case.q, case.pool)

    run.wrapper = w
    return run


BURST_MS = (1.0, 5.0, 20.0)
"""Burst lengths whose parallel speedup the bench reports: a decode call at
the issue's shapes takes 2-50 ms."""

BURST_IDLE_S = 0.01
"""Idle time before each burst: longer than a thread pool spins, as the
benchmark's cache flush before each timed call is."""


@dataclass
class MachineSpeed:
    """What the machine could do in this run: read bandwidth (GB/s, long
    reductions) and the speedup of all threads over one on bursts of
    compute after BURST_IDLE_S idle (burst ms -> speedup; ideal: the thread
    count)."""

    read_gbps: float
    threads: int
    burst_speedup: dict[float, float]
    workers_pinned: bool = False
    """Whether MAX's worker threads ran pinned one per core (threads.py)."""
    poller_demoted: bool = False
    """Whether MAX's runtime poller ran under SCHED_IDLE (threads.py)."""


@dataclass
class Row:
    shape: DecodeShape
    dtype: str
    name: str
    timing: Timing
    gbps: float
    max_abs_diff: float | None
    """Against torch SDPA (fold); None for the plain reads."""


def run_cpu_decode_bench(
    shapes=CPU_SHAPES, dtypes=("float32", "bfloat16"), reps: int = 15, verbose: bool = True
) -> tuple[MachineSpeed, list[Row]]:
    """Times pagedkv, MAX's built-in kernel, torch SDPA and plain reads of
    the same bytes, interleaved; returns what the machine could do in this
    run and a row per implementation."""
    import torch

    torch.set_num_threads(torch.get_num_threads())
    if verbose:
        print("measuring read bandwidth (1 GiB) ...", flush=True)
    counters = cpu_times()
    bandwidth = read_bandwidth_gbps()
    if verbose:
        steal = steal_share(counters, cpu_times())
        stolen = f" (steal {100 * steal:.1f}%)" if steal is not None else ""
        print(f"  {bandwidth:.1f} GB/s{stolen}", flush=True)
    threads = os.cpu_count() or 1
    speedups = {ms: burst_speedup(ms, threads, BURST_IDLE_S) for ms in BURST_MS}
    machine = MachineSpeed(bandwidth, threads, speedups, workers_pinned())
    if verbose:
        print(f"  {burst_line(machine)}", flush=True)
    rows: list[Row] = []
    for shape in shapes:
        for dtype in dtypes:
            case = make_case(shape, dtype)
            k, v = case.gathered()
            nbytes = shape.kv_bytes(case.pool.element_size())
            attention = {
                "pagedkv": pagedkv_decode(case),
                "max_builtin": max_builtin_decode(
                    case.q, case.pool, case.page_table, shape.seq_len, case.num_pages
                ),
                "torch_sdpa_gqa": torch_sdpa_decode(case.q, k, v, fold=False),
                "torch_sdpa_fold": torch_sdpa_decode(case.q, k, v, fold=True),
            }
            reference = attention["torch_sdpa_fold"]().float().reshape(case.q.shape)
            diffs = {}
            for name, fn in attention.items():
                out = fn()
                out = torch.from_dlpack(out) if not isinstance(out, torch.Tensor) else out
                diffs[name] = float((out.float().reshape(case.q.shape) - reference).abs().max())
            fns = {**attention, **same_bytes_reads(nbytes)}
            timings = time_round_robin(fns, reps=reps)
            for name, t in timings.items():
                row = Row(shape, dtype, name, t, nbytes / t.median_ms / 1e6, diffs.get(name))
                rows.append(row)
                if verbose:
                    print(
                        f"  {shape.label:22s} {dtype:8s} {name:16s} {t.median_ms:9.3f} ms "
                        f"{row.gbps:7.1f} GB/s  {100 * row.gbps / bandwidth:4.0f}% of read BW"
                        f"  (median of {t.runs})",
                        flush=True,
                    )
            del case, k, v, attention, fns
    machine.poller_demoted = poller_demoted()
    return machine, rows


KV_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "float32")


@dataclass
class KVDtypeRow:
    shape: DecodeShape
    kv_dtype: str
    timing: Timing
    gbps: float


def run_kv_dtype_bench(
    shapes=(CPU_SHAPES[1], CPU_SHAPES[3]), dtypes=KV_DTYPES, reps: int = 20
) -> list[KVDtypeRow]:
    """Times pagedkv's CPU decode of each shape with K/V in each of dtypes (q
    in bfloat16, float32 for float32 K/V), interleaved: a row per dtype."""
    rows: list[KVDtypeRow] = []
    for shape in shapes:
        cases = {
            kv: make_case(shape, kv, q_dtype="float32" if kv == "float32" else "bfloat16")
            for kv in dtypes
        }
        timings = time_round_robin({kv: pagedkv_decode(c) for kv, c in cases.items()}, reps=reps)
        for kv, t in timings.items():
            pool = cases[kv].pool
            nbytes = shape.kv_bytes(pool.element_size(), pool.shape[-1])
            rows.append(KVDtypeRow(shape, kv, t, nbytes / t.median_ms / 1e6))
        del cases
    return rows


def format_kv_dtype_table(rows: list[KVDtypeRow]) -> str:
    """pagedkv's median ms and GB/s per KV dtype, and its time as a multiple
    of bfloat16 K/V's at the same shape (when timed with it)."""
    lines = [
        f"{'shape (B, L, Hq, Hkv)':22s} {'K/V dtype':14s} {'ms':>8s} {'GB/s':>6s} {'x bf16':>6s}"
    ]
    bf16 = {r.shape: r.timing.median_ms for r in rows if r.kv_dtype == "bfloat16"}
    for r in rows:
        ratio = f"{r.timing.median_ms / bf16[r.shape]:6.2f}" if r.shape in bf16 else "     -"
        lines.append(
            f"{r.shape.label:22s} {r.kv_dtype:14s} {r.timing.median_ms:8.3f} {r.gbps:6.1f} {ratio}"
        )
    return "\n".join(lines)


def burst_line(machine: MachineSpeed) -> str:
    """The machine's burst speedups as one line of the table's header."""
    speedups = ", ".join(f"{x:.2f}x at {ms:g} ms" for ms, x in machine.burst_speedup.items())
    pinned = "pinned" if machine.workers_pinned else "not pinned"
    poller = "demoted" if machine.poller_demoted else "not demoted"
    return (
        f"{machine.threads}-thread speedup of bursts after {BURST_IDLE_S * 1e3:g} ms idle "
        f"(ideal {machine.threads:.2f}x): {speedups}; MAX workers {pinned}, poller {poller}"
    )


def format_table(machine: MachineSpeed, rows: list[Row]) -> str:
    """The table of the issue: pagedkv's ms, GB/s, share of read bandwidth and
    speedup over each anchor (anchor time / pagedkv time), all from medians;
    then the share at pagedkv's fastest run, pagedkv's GB/s as a share of
    the faster plain read of the same bytes timed in the same rounds
    (%read: the same flush, burst length and moments of the machine; 100%
    means as fast as memory gave that burst), and the CPU time stolen by
    the hypervisor while the row was timed. The header gives the machine's
    read bandwidth and burst speedups (a short call on a machine slow to
    start its idle cores reads slow)."""
    bandwidth = machine.read_gbps
    lines = [
        f"read bandwidth measured in this run: {bandwidth:.1f} GB/s",
        burst_line(machine),
        f"{'shape (B, L, Hq, Hkv)':22s} {'dtype':8s} {'pagedkv ms':>10s} {'GB/s':>6s} "
        f"{'%BW':>5s} {'MAX ms':>8s} {'xMAX':>5s} {'gqa ms':>8s} {'xgqa':>5s} "
        f"{'fold ms':>8s} {'xfold':>5s} {'%BWbest':>7s} {'%read':>5s} {'steal':>5s}",
    ]
    for (shape, dtype), group in rows_by_case(rows).items():
        ours = group["pagedkv"]
        max_ms, gqa_ms, fold_ms = (
            group[name].timing.median_ms
            for name in ("max_builtin", "torch_sdpa_gqa", "torch_sdpa_fold")
        )
        x_max, x_gqa, x_fold = (t / ours.timing.median_ms for t in (max_ms, gqa_ms, fold_ms))
        best = 100 * ours.gbps * ours.timing.median_ms / ours.timing.min_ms / bandwidth
        read = 100 * ours.gbps / max(group[n].gbps for n in ("read_numpy", "read_torch"))
        steal = ours.timing.steal
        lines.append(
            f"{shape.label:22s} {dtype:8s} {ours.timing.median_ms:10.3f} {ours.gbps:6.1f} "
            f"{100 * ours.gbps / bandwidth:4.0f}% {max_ms:8.3f} {x_max:5.2f} "
            f"{gqa_ms:8.3f} {x_gqa:5.2f} {fold_ms:8.3f} {x_fold:5.2f} {best:6.0f}% "
            f"{read:4.0f}% " + (f"{100 * steal:4.1f}%" if steal is not None else "    -")
        )
    return "\n".join(lines)
