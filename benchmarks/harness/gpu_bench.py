"""Decode, MLA and append on an NVIDIA GPU beside FlashInfer and MAX, one run.

Decode at bf16, page size 16, head_dim 128 over the shapes of the GPU issue:
pagedkv's "auto" choice and each of its kernels (generic, Hopper TMA,
tensor cores),
FlashInfer's BatchDecodeWithPagedKVCacheWrapper with and without tensor
cores (its faster form is the bar), and MAX's built-in paged decode
(`flash_attention_ragged`), all on the same pool. MLA decode (DeepSeek's
512 + 64 latent, 128 heads, page 64) beside FlashInfer's
BatchMLAPagedAttentionWrapper. Appends of a 5000-token and an 8-token ragged
batch beside FlashInfer's append_paged_kv_cache and a torch index_put.
Every implementation is timed with CUDA events on torch's stream; reports
microseconds, TB/s of K/V (or latents) read, the share of the GPU's peak HBM
bandwidth and of a measured device-to-device copy, ratios, and the host time
of pagedkv's run(). An anchor that is not installed, or fails, says so in
its row; its failure does not stop the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .append_bench import APPEND_SHAPES, append_fns, bound_append
from .decode_bench import DecodeCase, DecodeShape, make_case, pagedkv_decode, plan_decode
from .mla_bench import CKV, KPE, MLAShape

GPU_SHAPES = (
    DecodeShape(1, 65536, 32, 8),
    DecodeShape(16, 4096, 32, 8),
    DecodeShape(64, 4096, 32, 8),
    DecodeShape(64, 8192, 32, 8),
    DecodeShape(8, 2048, 32, 8),
    DecodeShape(64, 1024, 64, 8),
)
GPU_APPEND_SHAPES = tuple(
    s for s in APPEND_SHAPES if s.label in ("prefill 5000 tokens", "decode 8 tokens")
)

PEAK_TBPS = {"H100": 3.35, "H200": 4.8, "A100": 2.0, "H20": 4.0}
"""HBM peak by device name (SXM parts)."""


@dataclass
class GpuRow:
    label: str
    name: str
    us: float
    tbps: float
    max_abs_diff: float | None = None
    host_us: float | None = None
    """Host time of one call (pagedkv's run()); None for the anchors."""


def peak_tbps(name: str) -> float | None:
    """The HBM peak (TB/s) of the GPU named `name`, or None if not listed."""
    for key, value in PEAK_TBPS.items():
        if key in name:
            return value
    return None


def time_cuda(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median microseconds of fn() between CUDA events on torch's stream."""
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


def host_time_us(fn, reps: int = 50) -> float:
    """Median microseconds the host spends in fn() (the GPU idle before each
    call, so no call waits for queued work): what a step's Python costs."""
    import time

    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return float(np.median(times))


def copy_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time)."""
    import torch

    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = time_cuda(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() / us / 1e6


def flashinfer_decode(case: DecodeCase, tensor_cores: bool):
    """FlashInfer's decode wrapper on the same pool (its CUDA-core kernel, or
    with tensor_cores its prefill-class one), or None if not installed."""
    try:
        import flashinfer
    except ImportError:
        return None
    import torch

    dev = case.q.device
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=tensor_cores
    )
    plan_decode(w, case, lambda x: torch.from_numpy(x).to(dev))
    return lambda: w.run(case.q, case.pool)


def max_builtin_decode(case: DecodeCase):
    """MAX's own paged decode (flash_attention_ragged over MHAKVCacheParams)
    on the same pool, viewed as MAX's [pages, 2, layers=1, P, H, D] blocks."""
    import torch
    from max import tree
    from max._kv_cache_ops import mha_decode_num_partitions
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, ops
    from max.nn.attention import MHAMaskVariant
    from max.nn.kernels import flash_attention_ragged
    from max.nn.kv_cache import MHAKVCacheParams, padded_lut_cols

    from pagedkv._ops.kernels import accelerator
    from pagedkv._ops.tensors import device_of

    s = case.shape
    gpu = DeviceRef.GPU()
    params = MHAKVCacheParams(
        dtype=DType.bfloat16,
        head_dim=s.head_dim,
        num_layers=1,
        devices=[gpu],
        n_kv_heads=s.num_kv_heads,
        page_size=s.page_size,
    )
    kv_types, _ = tree.flatten(params.get_symbolic_inputs())
    q_type = TensorType(DType.bfloat16, ["rows", s.num_qo_heads, s.head_dim], device=gpu)
    offsets_type = TensorType(DType.uint32, ["batch_plus_1"], device=gpu)
    with Graph("max_paged_decode", input_types=[q_type, offsets_type, *kv_types]) as g:
        q, offsets, *kv_inputs = g.inputs
        kv = params.unflatten_kv_inputs(iter(kv_inputs))[0]
        g.output(
            flash_attention_ragged(
                params,
                q.tensor,
                offsets.tensor,
                kv,
                layer_idx=ops.constant(0, DType.uint32, device=DeviceRef.CPU()),
                mask_variant=MHAMaskVariant.CAUSAL_MASK,
                scale=1.0 / math.sqrt(s.head_dim),
            )
        )
    device = accelerator(device_of(case.q))
    model = InferenceSession(devices=[CPU(), device]).load(g)
    npg = case.page_table.shape[1]
    lut = np.zeros((s.batch, padded_lut_cols(npg)), np.uint32)
    lut[:, :npg] = case.page_table
    partitions = mha_decode_num_partitions(s.batch, s.seq_len, s.num_kv_heads, device)
    host_values = [
        None,  # kv_blocks: the pool itself
        np.full(s.batch, s.seq_len - 1, np.uint32),  # cached before this token
        lut,
        np.array([1], np.uint32),  # max_prompt_length
        np.array([s.seq_len], np.uint32),  # max_cache_length
        np.array([-1], np.int64),  # page_stride: packed pages
        np.array([s.batch, 1, partitions, s.seq_len], np.int64),  # dispatch key
    ]
    blocks = Buffer.from_dlpack(case.pool.unsqueeze(2))
    args = [
        Buffer.from_dlpack(case.q),
        Buffer.from_numpy(np.arange(s.batch + 1, dtype=np.uint32)).to(device),
    ]
    for value, t in zip(host_values, kv_types, strict=True):
        if value is None:
            args.append(blocks)
        else:
            buffer = Buffer.from_numpy(value)
            args.append(buffer.to(device) if t.device.is_gpu() else buffer)
    out: dict[str, object] = {}
    stream = torch.cuda.current_stream()

    def run():
        torch.cuda.synchronize()  # MAX's model runs on its own stream
        out["o"] = model.execute(*args)[0]
        device.synchronize()
        stream.synchronize()

    run.result = lambda: torch.from_dlpack(out["o"]).view(s.batch, s.num_qo_heads, s.head_dim)
    return run


def decode_rows(reps: int, skip: tuple[str, ...] = ()) -> list[GpuRow]:
    """Times decode at GPU_SHAPES (bfloat16) with each implementation that runs
    and `skip` does not name, printing a line each: one row per (shape,
    implementation)."""
    import torch

    rows: list[GpuRow] = []
    for shape in GPU_SHAPES:
        case = make_case(shape, "bfloat16", device="cuda")
        nbytes = shape.kv_bytes(2)
        reference = None
        impls = {
            "pagedkv": lambda c=case: pagedkv_decode(c, "auto"),
            "pagedkv-generic": lambda c=case: pagedkv_decode(c, "generic"),
            "pagedkv-tma": lambda c=case: pagedkv_decode(c, "tma"),
            "pagedkv-mma": lambda c=case: pagedkv_decode(c, "mma"),
            "flashinfer": lambda c=case: flashinfer_decode(c, False),
            "flashinfer-tc": lambda c=case: flashinfer_decode(c, True),
            "max": lambda c=case: max_builtin_decode(c),
        }
        for name, make in impls.items():
            if name in skip:
                continue
            try:
                fn = make()
                if fn is None:
                    print(f"  {shape.label:22s} {name:12s} not installed", flush=True)
                    continue
                result = fn()
                out = fn.result() if hasattr(fn, "result") else result
                us = time_cuda(fn, reps)
                host = host_time_us(fn, reps) if name.startswith("pagedkv") else None
            except Exception as e:  # an anchor's failure is reported, not fatal
                print(f"  {shape.label:22s} {name:12s} failed: {str(e).splitlines()[0][:200]}")
                continue
            if reference is None:
                reference = out.float()
                diff = 0.0
            else:
                diff = float((out.float() - reference).abs().max())
            rows.append(GpuRow(shape.label, name, us, nbytes / us / 1e6, diff, host))
            host_note = f", host {host:.1f} us" if host is not None else ""
            print(
                f"  {shape.label:22s} {name:12s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s "
                f"max|diff| vs first {diff:.2e}{host_note}",
                flush=True,
            )
        del case
        torch.cuda.empty_cache()
    return rows


def flashinfer_append(fns: dict, shape, dtype: str) -> None:
    """Adds FlashInfer's append of the same batch to fns (when installed)."""
    try:
        import flashinfer
    except ImportError:
        return
    from .append_bench import _case

    pool, k, v, meta, _, _ = _case(shape, dtype, "cuda")
    fns["flashinfer"] = bound_append(flashinfer.append_paged_kv_cache, k, v, pool, meta)


def append_rows(reps: int) -> list[GpuRow]:
    """Times the appends of GPU_APPEND_SHAPES (bfloat16) beside their anchors,
    printing a line each: one row per (shape, implementation)."""
    rows = []
    for shape in GPU_APPEND_SHAPES:
        fns, nbytes = append_fns(shape, "bfloat16", "cuda")
        flashinfer_append(fns, shape, "bfloat16")
        for name, fn in fns.items():
            us = time_cuda(fn, reps)
            rows.append(GpuRow(shape.label, name, us, nbytes / us / 1e6))
            print(f"  {shape.label:22s} {name:16s} {us:9.1f} us {nbytes / us / 1e3:8.1f} GB/s")
    return rows


MLA_SHAPES = tuple(
    MLAShape(batch, seq_len, 128, page_size=64)
    for batch in (1, 32, 128)
    for seq_len in (1024, 8192)
)
"""MLA decode shapes of the GPU issue: B = 1, 32, 128; L = 1k, 8k; 128 heads."""


def planned_mla(wrapper, case: dict):
    """A callable running `wrapper` (pagedkv's or FlashInfer's
    BatchMLAPagedAttentionWrapper: the same plan and run) on the case, planned
    here, outside timing, into one preallocated output."""
    import torch

    shape = case["shape"]
    wrapper.plan(*case["table"], shape.heads, CKV, KPE, shape.page_size, False, case["scale"],
                 case["q_nope"].dtype, case["ckv"].dtype)  # fmt: skip
    out = torch.empty_like(case["q_nope"])

    def run():
        return wrapper.run(case["q_nope"], case["q_pe"], case["ckv"], case["kpe"], out=out)

    return run


def flashinfer_mla(case: dict):
    """FlashInfer's MLA decode on the same latent pages, or None if not installed."""
    try:
        import flashinfer
    except ImportError:
        return None
    import torch

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=case["q_nope"].device)
    return planned_mla(flashinfer.BatchMLAPagedAttentionWrapper(workspace), case)


def pagedkv_mla(case: dict):
    """pagedkv's MLA decode (plan outside timing)."""
    import torch

    import pagedkv

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=case["q_nope"].device)
    return planned_mla(pagedkv.BatchMLAPagedAttentionWrapper(workspace), case)


def mla_gpu_case(shape: MLAShape, dtype: str = "bfloat16", seed: int = 0) -> dict:
    """Latent pages in shuffled order and decode queries, on the GPU."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    pages = -(-shape.seq_len // shape.page_size)
    num_pages = shape.batch * pages

    def rand(*dims):
        return torch.randn(*dims, generator=gen).to(tdtype).cuda()

    table = (
        torch.arange(shape.batch + 1, dtype=torch.int32),  # qo_indptr: one query each
        torch.arange(shape.batch + 1, dtype=torch.int32) * pages,
        torch.randperm(num_pages, generator=gen).to(torch.int32),
        torch.full((shape.batch,), shape.seq_len, dtype=torch.int32),
    )
    return {
        "shape": shape,
        "ckv": rand(num_pages, shape.page_size, CKV),
        "kpe": rand(num_pages, shape.page_size, KPE),
        "q_nope": rand(shape.batch, shape.heads, CKV),
        "q_pe": rand(shape.batch, shape.heads, KPE),
        "table": tuple(x.cuda() for x in table),
        "scale": 1 / math.sqrt(128 + KPE),
    }


def mla_rows(reps: int) -> list[GpuRow]:
    """Times MLA decode at MLA_SHAPES (bfloat16), a row per (shape, implementation)."""
    import torch

    rows: list[GpuRow] = []
    for shape in MLA_SHAPES:
        case = mla_gpu_case(shape)
        nbytes = shape.latent_bytes(2)
        reference = None
        for name, make in (("pagedkv", pagedkv_mla), ("flashinfer", flashinfer_mla)):
            try:
                fn = make(case)
                if fn is None:
                    print(f"  {shape.label:16s} {name:12s} not installed", flush=True)
                    continue
                out = fn().float()
                us = time_cuda(fn, reps)
                host = host_time_us(fn, reps) if name == "pagedkv" else None
            except Exception as e:  # an anchor's failure is reported, not fatal
                print(f"  {shape.label:16s} {name:12s} failed: {str(e).splitlines()[0][:200]}")
                continue
            diff = 0.0 if reference is None else float((out - reference).abs().max())
            reference = out if reference is None else reference
            rows.append(GpuRow(shape.label, name, us, nbytes / us / 1e6, diff, host))
            print(
                f"  {shape.label:16s} {name:12s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s "
                f"{shape.flops() / us / 1e6:7.1f} TFLOP/s max|diff| vs first {diff:.2e}",
                flush=True,
            )
        del case
        torch.cuda.empty_cache()
    return rows


def format_rows(
    title: str, rows: list[GpuRow], peak: float | None, copy: float, ours_name: str
) -> str:
    """A table of rows grouped by shape: us, TB/s, share of peak and of the
    measured copy, the row's time over ours_name's, host us."""
    lines = [
        title,
        f"{'shape':22s} {'impl':16s} {'us':>9s} {'TB/s':>6s} {'%peak':>6s} "
        f"{'%copy':>6s} {'x ours':>6s} {'host us':>8s}",
    ]
    for label in dict.fromkeys(r.label for r in rows):
        mine = {r.name: r for r in rows if r.label == label}
        ours = mine.get(ours_name)
        for row in mine.values():
            pct = f"{100 * row.tbps / peak:5.0f}%" if peak else f"{'?':>6s}"
            ratio = row.us / ours.us if ours else float("nan")
            host = f"{row.host_us:8.1f}" if row.host_us is not None else f"{'-':>8s}"
            lines.append(
                f"{label:22s} {row.name:16s} {row.us:9.1f} {row.tbps:6.2f} {pct} "
                f"{100 * row.tbps / copy:5.0f}% {ratio:6.2f} {host}"
            )
    return "\n".join(lines)


def summary(
    rows: list[GpuRow], anchors: dict[str, tuple[str, ...]], ours_name: str = "pagedkv"
) -> str:
    """Per shape: each anchor's best time over ours_name's ("x MAX 1.10"
    means it takes 1/1.10 of MAX's time)."""
    lines = []
    for label in dict.fromkeys(r.label for r in rows):
        mine = {r.name: r for r in rows if r.label == label}
        ours = mine.get(ours_name)
        if ours is None:
            continue
        parts = []
        for anchor, names in anchors.items():
            times = [mine[n].us for n in names if n in mine]
            if times:
                parts.append(f"x {anchor} {min(times) / ours.us:.2f}")
        lines.append(f"  {label:22s} " + ", ".join(parts))
    return "\n".join(lines)


def run_gpu_bench(
    reps: int = 50,
    parts: tuple[str, ...] = ("decode", "mla", "append"),
    skip: tuple[str, ...] = (),
) -> int:
    """Runs the decode, MLA and append timings (those in `parts`) on the CUDA
    device, decode without the implementations `skip` names, and prints
    their tables; raises ValueError without a visible CUDA device. Returns
    0."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--device gpu: no CUDA device is visible")
    name = torch.cuda.get_device_name()
    peak = peak_tbps(name)
    copy = copy_tbps()
    print(f"{name}: peak {peak or '?'} TB/s, measured device-to-device copy {copy:.2f} TB/s")
    tables = []
    if "decode" in parts:
        decode = decode_rows(reps, skip)
        tables.append(
            format_rows(
                "decode, bf16, page 16, head_dim 128 (x ours: the row's time / pagedkv's)",
                decode,
                peak,
                copy,
                "pagedkv",
            )  # fmt: skip
        )
        anchors = {"MAX": ("max",), "FlashInfer": ("flashinfer", "flashinfer-tc")}
        for ours in ("pagedkv", "pagedkv-mma"):
            tables.append(f"decode: anchor time / {ours} time\n" + summary(decode, anchors, ours))
    if "mla" in parts:
        mla = mla_rows(reps)
        tables.append(
            format_rows(
                "MLA decode, bf16, 512 + 64 latent, page 64 (shape: B, L, heads)",
                mla,
                peak,
                copy,
                "pagedkv",
            )  # fmt: skip
        )
        tables.append(
            "MLA: anchor time / pagedkv time\n" + summary(mla, {"FlashInfer": ("flashinfer",)})
        )
    for table in tables:
        print()
        print(table)
    if "append" in parts:
        appends = append_rows(reps)
        print()
        print("append, bf16 (GB/s moved: the appended K and V read once and written once)")
        for label in dict.fromkeys(r.label for r in appends):
            mine = {r.name: r for r in appends if r.label == label}
            ours = mine["pagedkv"]
            for row in mine.values():
                print(
                    f"{label:22s} {row.name:16s} {row.us:9.1f} us {row.tbps * 1e3:8.1f} GB/s "
                    f"x{row.us / ours.us:5.2f}"
                )
    return 0
