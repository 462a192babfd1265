"""Decode and append on an NVIDIA GPU beside FlashInfer and MAX, one run.

Decode at bf16, page size 16, head_dim 128 over the shapes of the GPU issue;
append of a 5000-token and an 8-token ragged batch. Reports microseconds,
TB/s of K/V read, the share of the GPU's peak HBM bandwidth and of a measured
device-to-device copy, and the ratio to each anchor. FlashInfer runs when it
is installed (fa2 backend, tensor cores for GQA); otherwise its rows say so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .decode_bench import DecodeShape, make_case

GPU_SHAPES = (
    DecodeShape(1, 65536, 32, 8),
    DecodeShape(16, 4096, 32, 8),
    DecodeShape(64, 4096, 32, 8),
    DecodeShape(64, 8192, 32, 8),
    DecodeShape(128, 2048, 32, 32),
    DecodeShape(64, 1024, 64, 8),
)

PEAK_TBPS = {"H100": 3.35, "H200": 4.8, "A100": 2.0, "H20": 4.0}
"""HBM peak by device name (SXM parts)."""


@dataclass
class GpuRow:
    label: str
    name: str
    us: float
    tbps: float


def peak_tbps(name: str) -> float | None:
    for key, value in PEAK_TBPS.items():
        if key in name:
            return value
    return None


def time_cuda(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median microseconds of fn() timed with CUDA events (each call timed
    alone, so a host sync inside fn is part of its cost)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(np.median(times))


def copy_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time)."""
    import torch

    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = time_cuda(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() / us / 1e6


def flashinfer_decode(case):
    """FlashInfer's decode wrapper on the same pool, or None if not installed."""
    try:
        import flashinfer
    except ImportError:
        return None
    import torch

    s = case.shape
    dev = case.q.device
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=s.num_qo_heads // s.num_kv_heads >= 4
    )
    w.plan(
        torch.from_numpy(case.kv_indptr).to(dev),
        torch.from_numpy(case.kv_indices).to(dev),
        torch.from_numpy(case.kv_last_page_len).to(dev),
        s.num_qo_heads,
        s.num_kv_heads,
        s.head_dim,
        s.page_size,
        q_data_type=case.q.dtype,
        kv_data_type=case.pool.dtype,
    )
    return lambda: w.run(case.q, case.pool)


def run_gpu_bench(reps: int = 50) -> int:
    import torch

    from .decode_bench import pagedkv_decode

    if not torch.cuda.is_available():
        raise ValueError("--device gpu: no CUDA device is visible")
    name = torch.cuda.get_device_name()
    peak = peak_tbps(name)
    copy = copy_tbps()
    print(f"{name}: peak {peak or '?'} TB/s, measured device-to-device copy {copy:.2f} TB/s")
    rows: list[GpuRow] = []
    for shape in GPU_SHAPES:
        case = make_case(shape, "bfloat16", device="cuda")
        fns = {"pagedkv": pagedkv_decode(case), "flashinfer": flashinfer_decode(case)}
        nbytes = shape.kv_bytes(2)
        for impl, fn in fns.items():
            if fn is None:
                print(f"  {shape.label} {impl}: not installed")
                continue
            us = time_cuda(fn, reps)
            rows.append(GpuRow(shape.label, impl, us, nbytes / us / 1e6))
            print(
                f"  {shape.label:22s} {impl:12s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s",
                flush=True,
            )
        del case
    print()
    print(
        f"{'shape (B, L, Hq, Hkv)':22s} {'pagedkv us':>10s} {'TB/s':>6s} {'%peak':>6s} "
        f"{'%copy':>6s} {'flashinfer us':>13s} {'x fi':>5s}"
    )
    for label in dict.fromkeys(r.label for r in rows):
        ours = next(r for r in rows if r.label == label and r.name == "pagedkv")
        fi = next((r for r in rows if r.label == label and r.name == "flashinfer"), None)
        pct_peak = f"{100 * ours.tbps / peak:5.0f}%" if peak else f"{'?':>6s}"
        print(
            f"{label:22s} {ours.us:10.1f} {ours.tbps:6.2f} {pct_peak} "
            f"{100 * ours.tbps / copy:5.0f}% "
            + (f"{fi.us:13.1f} {fi.us / ours.us:5.2f}" if fi else f"{'-':>13s} {'-':>5s}")
        )
    return 0
