"""What pagedkv is measured against, timed in the same run on the same data.

- MAX's built-in paged attention (``max.nn.kernels.flash_attention_ragged`` on
  a ``PagedCacheValues`` collection, causal mask, one query token per request),
  reading the very pool pagedkv reads: a FlashInfer NHD pool
  [pages, 2, P, H, D] is MAX's [pages, 2, 1, P, H, D] with one layer.
- torch ``scaled_dot_product_attention`` on K/V gathered beforehand to
  contiguous [B, Hkv, L, D] (the gather is not timed), GQA both ways: with
  ``enable_gqa`` and with the group folded into the query length.
- The machine's read bandwidth: the best of NumPy and torch reductions over a
  1 GiB array, one thread and all threads (STREAM's convention: best of N).
- A plain read of the same bytes as a kernel (`same_bytes_reads`), timed in
  the kernel's own rounds: what memory gives a burst of that length, after
  the same cache flush, at the same moments of a noisy machine.
- How well the machine runs short parallel bursts after idling (a decode
  call is one): the speedup of all threads over one.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .threads import demote_poller_for_timing

_FLUSH: np.ndarray | None = None


def flush_caches() -> None:
    """Evicts the caches by reading 256 MiB, so every timed run reads K/V from
    memory as a real decode step does (each layer reads different K/V)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = np.ones((256 << 20) // 4, np.float32)
    np.maximum.reduce(_FLUSH)


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    runs: int
    steal: float | None = None
    """Share of CPU time the hypervisor took from this VM while these runs
    were timed (None where /proc/stat has no steal counter): a run that lost
    its cores to a neighbour reads slow for no fault of its own."""


def rows_by_case(rows: list[Any], *more: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """A run's rows (each with shape, dtype and name) grouped by (shape,
    dtype, then the attributes named in `more`), in order, each group keyed
    by implementation name: a table's lines."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        case = (r.shape, r.dtype, *(getattr(r, attribute) for attribute in more))
        groups.setdefault(case, {})[r.name] = r
    return groups


def cpu_times() -> list[int] | None:
    """The machine-wide CPU time counters of /proc/stat (Linux), else None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in fields[1:]] if fields and fields[0] == "cpu" else None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Stolen share of the CPU time between two cpu_times() readings."""
    if before is None or after is None or len(before) < 8:
        return None
    spent = [b - a for a, b in zip(before, after, strict=True)]
    return spent[7] / max(sum(spent), 1)


def time_round_robin(
    fns: dict[str, Callable[[], Any]],
    reps: int = 15,
    max_s: float = 4.0,
    flush: bool = True,
    min_reps: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Times the functions interleaved (one run of each per round, rotating the
    order), so drifts in the machine's speed hit all of them alike.

    Each function gets `reps` runs, or fewer (but at least `min_reps`) once it
    has spent `max_s` seconds: a slow anchor (seconds per call) stops early
    without cutting the fast ones' count short. After the warm-up calls,
    MAX's runtime poller is demoted (threads.py), for all of them alike.
    `clock` (seconds) is what runs are timed by; tests pass a simulated one.
    """
    names = list(fns)
    for name in names:
        fns[name]()  # warm-up: compile caches, page faults
    demote_poller_for_timing()
    times: dict[str, list[float]] = {n: [] for n in names}

    def active(name: str) -> bool:
        runs = times[name]
        return len(runs) < reps and (len(runs) < min_reps or sum(runs) < max_s)

    counters = cpu_times()
    r = 0
    while any(active(n) for n in names):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if not active(name):
                continue
            if flush:
                flush_caches()
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
        r += 1
    steal = steal_share(counters, cpu_times())
    return {
        n: Timing(statistics.median(t) * 1e3, min(t) * 1e3, len(t), steal) for n, t in times.items()
    }


def _parallel(fn: Callable[[int, int], Any], parts: int) -> Callable[[], None]:
    def run() -> None:
        threads = [threading.Thread(target=fn, args=(i, parts)) for i in range(parts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return run


def read_bandwidth_gbps(gib: float = 1.0, reps: int = 8) -> float:
    """Best-of-N read bandwidth of a 1 GiB float32 array over NumPy and torch
    reductions on one and on all threads (NumPy's loops release the GIL)."""
    import torch

    n = int(gib * (1 << 30)) // 4
    a = np.ones(n, np.float32)
    cores = os.cpu_count() or 1

    def part(i: int, p: int) -> None:
        np.maximum.reduce(a[i * n // p : (i + 1) * n // p])

    tests = [lambda: np.maximum.reduce(a), _parallel(part, cores)]
    at = torch.from_numpy(a)
    saved = torch.get_num_threads()
    best = 0.0
    try:
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            tests.append(lambda: at.sum())
            for fn in tests:
                fn()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
            tests.pop()
    finally:
        torch.set_num_threads(saved)
    return best


def same_bytes_reads(nbytes: int) -> dict[str, Callable[[], Any]]:
    """Reductions over a float32 array of nbytes, torch on all threads and
    NumPy on one: a reference for a kernel that reads nbytes, to be timed in
    the same rounds (`time_round_robin`) as the kernel, after it.

    The best-of-N bandwidth above is the machine's peak; a burst of a few
    milliseconds right after a flush, on a machine whose neighbours load
    its memory, gets less, and these show how much less.

    NumPy's read comes last: in the rotating rounds the first function (the
    kernel under test) mostly runs right after the last one, and torch's
    OpenMP workers spin on for about 10 ms after a torch call, past the
    cache flush, so a kernel timed right after torch's read shared a core
    with them (at (1, 4096) float32 the copy of pagedkv placed there ran
    about 10% slower than three identical copies placed elsewhere; with
    OMP_WAIT_POLICY=PASSIVE, 3%).
    """
    import torch

    a = np.ones(nbytes // 4, np.float32)
    at = torch.from_numpy(a)
    return {"read_torch": lambda: at.sum(), "read_numpy": lambda: np.maximum.reduce(a)}


def burst_speedup(
    burst_ms: float,
    threads: int | None = None,
    idle_s: float = 0.01,
    reps: int = 9,
    work: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """How many times more work `threads` threads get done in a short burst
    than one thread, right after the machine idled for `idle_s`: the median
    over `reps` of threads x (one thread's time for one burst) / (the time
    for `threads` bursts run at once). Ideal: `threads`.

    A decode call is such a burst (milliseconds). A hypervisor that leaves an
    idle vCPU parked, or wakes it onto its neighbour's core, shows here as a
    speedup short of ideal for short bursts, though neither the steal counter
    nor a long bandwidth run sees it. work(i) runs burst i (thread i); by
    default a NumPy loop (GIL released) of about burst_ms on one thread.
    `clock` reads seconds (tests pass a simulated one).
    """
    threads = threads or os.cpu_count() or 1
    if work is None:
        work = _numpy_burst(burst_ms, threads)

    # Both timings start their bursts on new threads, so thread start-up
    # costs them alike.
    alone = _parallel(lambda i, _parts: work(i), 1)
    all_at_once = _parallel(lambda i, _parts: work(i), threads)
    ratios = []
    for _ in range(reps):
        time.sleep(idle_s)
        t0 = clock()
        alone()
        one = clock() - t0
        time.sleep(idle_s)
        t0 = clock()
        all_at_once()
        ratios.append(threads * one / (clock() - t0))
    return statistics.median(ratios)


def _numpy_burst(burst_ms: float, threads: int) -> Callable[[int], None]:
    """work(i): np.exp over thread i's own L2-sized array, repeated to last
    about burst_ms."""
    arrays = [np.linspace(0.0, 1.0, 1 << 16) for _ in range(threads)]
    outs = [np.empty_like(a) for a in arrays]
    t0 = time.perf_counter()
    for _ in range(20):
        np.exp(arrays[0], out=outs[0])
    calls = max(1, round(burst_ms / 1e3 / ((time.perf_counter() - t0) / 20)))

    def work(i: int) -> None:
        for _ in range(calls):
            np.exp(arrays[i], out=outs[i])

    return work


# --------------------------------------------------------------------------- #
# MAX's built-in paged attention
# --------------------------------------------------------------------------- #

_MAX_MODELS: dict[tuple, Any] = {}


def _max_decode_graph(dtype: Any, hq: int, hkv: int, d: int, p: int) -> Any:
    from max import tree
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops
    from max.nn.attention import MHAMaskVariant
    from max.nn.kernels import flash_attention_ragged
    from max.nn.kv_cache import MHAKVCacheParams

    cpu = DeviceRef.CPU()
    params = MHAKVCacheParams(
        dtype=dtype, head_dim=d, num_layers=1, devices=[cpu], n_kv_heads=hkv, page_size=p
    )
    kv_types, _ = tree.flatten(params.get_symbolic_inputs())
    q_type = TensorType(dtype, ["total_tokens", hq, d], device=cpu)
    offsets = TensorType(DType.uint32, ["batch_plus_1"], device=cpu)
    with Graph(
        f"max_paged_decode_{dtype}_{hq}_{hkv}_{d}_{p}", input_types=[q_type, offsets, *kv_types]
    ) as g:
        q, ro, *kv_in = g.inputs
        kv = params.unflatten_kv_inputs(iter(kv_in))[0]
        o = flash_attention_ragged(
            params,
            q.tensor,
            ro.tensor,
            kv,
            layer_idx=ops.constant(0, DType.uint32, device=cpu),
            mask_variant=MHAMaskVariant.CAUSAL_MASK,
            scale=1.0 / math.sqrt(d),
        )
        g.output(o)
    return g


def max_builtin_decode(
    q: Any, pool: Any, page_table: np.ndarray, seq_len: int, num_pages: int
) -> Callable[[], Any]:
    """A callable running MAX's paged decode on (q [B, Hq, D], pool).

    pool: [num_pages + 1, 2, P, Hkv, D] whose last page is all zeros (MAX pads
    its lookup table with it); page_table: [B, pages per request].
    """
    from max.driver import CPU, Buffer
    from max.engine import InferenceSession
    from max.nn.kv_cache import padded_lut_cols

    from pagedkv._ops.tensors import dtype_of, to_buffer

    b, hq, d = q.shape
    _, _, p, hkv, _ = pool.shape
    key = (dtype_of(q), hq, hkv, d, p)
    if key not in _MAX_MODELS:
        _MAX_MODELS[key] = InferenceSession(devices=[CPU()]).load(_max_decode_graph(*key))
    model = _MAX_MODELS[key]
    npg = page_table.shape[1]
    lut = np.full((b, padded_lut_cols(npg)), num_pages, np.uint32)
    lut[:, :npg] = page_table
    pool6 = pool.reshape(pool.shape[0], 2, 1, *pool.shape[2:])

    def u32(*v: int) -> Buffer:
        return Buffer.from_numpy(np.array(v, np.uint32))

    args = [
        to_buffer(q),
        Buffer.from_numpy(np.arange(b + 1, dtype=np.uint32)),
        to_buffer(pool6),
        Buffer.from_numpy(np.full(b, seq_len - 1, np.uint32)),  # cached before this step
        Buffer.from_numpy(lut),
        u32(1),  # max_prompt_length
        u32(seq_len),  # max_cache_length
        Buffer.from_numpy(np.array([-1], np.int64)),  # packed pages
        Buffer.from_numpy(np.array([b, 1, 1, seq_len], np.int64)),  # dispatch metadata
    ]
    return lambda: model.execute(*args)[0]


# --------------------------------------------------------------------------- #
# torch SDPA on pre-gathered K/V
# --------------------------------------------------------------------------- #


def torch_sdpa_decode(q: Any, k: Any, v: Any, fold: bool) -> Callable[[], Any]:
    """A callable running torch SDPA; k, v: contiguous [B, Hkv, L, D] tensors.

    fold=False uses enable_gqa; fold=True views q as [B, Hkv, G, D] so that one
    SDPA call reads each K/V row once for the whole group.
    """
    import torch
    import torch.nn.functional as F

    b, hq, d = q.shape
    hkv = k.shape[1]
    qv = q.reshape(b, hkv, hq // hkv, d) if fold else q.reshape(b, hq, 1, d)

    def run() -> Any:
        with torch.inference_mode():
            return F.scaled_dot_product_attention(qv, k, v, enable_gqa=not fold)

    return run
