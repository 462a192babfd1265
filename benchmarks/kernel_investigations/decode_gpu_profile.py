"""Where a GPU decode call's time goes: each kernel's device time (torch's
profiler, through CUPTI) beside the call's time between CUDA events, for
pagedkv's decode kernels ("auto" and each kernel it picks from), MAX's
built-in decode and, where installed, FlashInfer's two decode kernels, at the
GPU bench's shapes (bf16, page 16, head_dim 128).

    python benchmarks/kernel_investigations/decode_gpu_profile.py [--shapes 0 2] [--reps 20]
        [--skip pagedkv-generic] [--split-sweep]

A call whose kernels take much less than its event time spends the rest
launching (graph execution, stream ordering) rather than reading memory.
--split-sweep also times the kernels "auto" chooses between with the keys
of each request cut into fixed chunks (plan()'s fixed_split_size: the
longest request's pages over 1, 2, 4, .. chunks), to set beside plan()'s
own choice, which the "auto" line names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The shared timing code: benchmarks/harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.decode_bench import DecodeShape, make_case, pagedkv_decode  # noqa: E402
from harness.gpu_bench import (  # noqa: E402
    GPU_SHAPES,
    flashinfer_decode,
    max_builtin_decode,
    time_cuda,
)


def kernel_times(fn, reps: int) -> list[tuple[str, float, float]]:
    """(kernel name, launches per call, device µs per call) of fn(), from
    `reps` profiled calls after one warm-up."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA:
            continue
        rows.append((event.key, event.count / reps, event.device_time_total / reps))
    return sorted(rows, key=lambda r: -r[2])


def host_breakdown(reps: int = 300) -> None:
    """Host µs per run() of a tiny decode (the GPU keeps up, so the host's
    time is the call's), and how much of it goes to wrapping arrays as MAX
    buffers and to MAX's execute; the rest is checks and stream ordering."""
    import time

    import torch

    import pagedkv._ops.kernels as kernels

    case = make_case(DecodeShape(1, 16, 32, 8), "bfloat16", device="cuda")
    fn = pagedkv_decode(case, "auto")
    spent = {"to_buffer": 0.0, "execute": 0.0}

    def timed(name, f):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    class TimedModel:
        def __init__(self, model):
            self.execute = timed("execute", model.execute)

    plain_to_buffer = kernels.to_buffer
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / reps * 1e6
    plan = fn.wrapper._plan
    plan.model = TimedModel(plan.model)
    kernels.to_buffer = timed("to_buffer", plain_to_buffer)
    try:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    finally:
        kernels.to_buffer = plain_to_buffer
    per_call = {k: v / reps * 1e6 for k, v in spent.items()}
    print(
        f"host per run() of (1, 16, 32, 8): {total:.1f} us; to_buffer {per_call['to_buffer']:.1f}"
        f" us, execute {per_call['execute']:.1f} us",
        flush=True,
    )

    # The pieces alone, and a bare capsule in place of torch's __dlpack__.
    from max.driver import Buffer
    from torch.utils.dlpack import to_dlpack

    from pagedkv._ops.tensors import Device

    class CudaCapsule:
        def __init__(self, capsule):
            self.capsule = capsule

        def __dlpack__(self, **_):
            return self.capsule

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA, device 0

    def each(f) -> float:
        start = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps * 1e6

    device = Device("gpu")

    def ordered():
        with kernels.stream_ordered([case.q, case.pool], device):
            pass

    print(
        f"  Buffer.from_dlpack(q) {each(lambda: Buffer.from_dlpack(case.q)):.1f} us, "
        f"bare capsule {each(lambda: Buffer._from_dlpack(CudaCapsule(to_dlpack(case.q)))):.1f}"
        f" us, stream_ordered {each(ordered):.1f} us, torch.empty_like(q) "
        f"{each(lambda: torch.empty_like(case.q)):.1f} us",
        flush=True,
    )


def report(label: str, name: str, fn, reps: int, nbytes: int) -> None:
    """Prints fn's time between events and its kernels' device time."""
    wall = time_cuda(fn, reps)
    kernels = kernel_times(fn, reps)
    busy = sum(us for _, _, us in kernels)
    print(
        f"{label:22s} {name:16s} events {wall:8.1f} us, kernels {busy:8.1f} us "
        f"({nbytes / busy / 1e6:5.2f} TB/s while they run)",
        flush=True,
    )
    for kernel, count, us in kernels[:4]:
        print(f"    {us:8.1f} us  x{count:4.1f}  {kernel[:100]}")


def split_sweep(shape, case, reps: int) -> None:
    """The kernels "auto" chooses between at the shape's group (tensor
    cores alone from 8 query heads per KV head, where the TMA kernel's
    CUDA-core arithmetic falls behind; both below) with fixed chunks of the
    longest request's pages over 1, 2, 4, .. (at least 8 pages a chunk)."""
    pages = -(-shape.seq_len // shape.page_size)
    chunks = [pages // n for n in (1, 2, 4, 8, 16, 32) if pages // n >= 8]
    group = shape.num_qo_heads // shape.num_kv_heads
    for backend in ("mma",) if group >= 8 else ("tma", "mma"):
        for chunk in chunks:
            name = f"{backend} split {pages // chunk}"
            try:
                fn = pagedkv_decode(case, backend, fixed_split_size=chunk)
                report(shape.label, name, fn, reps, shape.kv_bytes(2))
            except Exception as e:
                print(f"{shape.label:22s} {name:16s} failed: {str(e).splitlines()[0][:200]}")
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--shapes",
        type=int,
        nargs="*",
        default=list(range(len(GPU_SHAPES))),
        help="indices into GPU_SHAPES (default: all)",
    )
    parser.add_argument("--reps", type=int, default=20, help="calls profiled (default %(default)s)")
    parser.add_argument("--skip", nargs="*", default=[], help="implementations left out")
    parser.add_argument("--split-sweep", action="store_true", help="time fixed key splits too")
    args = parser.parse_args()
    host_breakdown()
    for index in args.shapes:
        shape = GPU_SHAPES[index]
        case = make_case(shape, "bfloat16", device="cuda")
        impls = {
            "pagedkv-auto": lambda c=case: pagedkv_decode(c, "auto"),
            "pagedkv-generic": lambda c=case: pagedkv_decode(c, "generic"),
            "pagedkv-tma": lambda c=case: pagedkv_decode(c, "tma"),
            "pagedkv-mma": lambda c=case: pagedkv_decode(c, "mma"),
            "max": lambda c=case: max_builtin_decode(c),
            "flashinfer": lambda c=case: flashinfer_decode(c, False),
            "flashinfer-tc": lambda c=case: flashinfer_decode(c, True),
        }
        for name, make in impls.items():
            if name in args.skip:
                continue
            try:
                fn = make()
                if fn is None:
                    print(f"{shape.label:22s} {name:16s} not installed", flush=True)
                    continue
                if name == "pagedkv-auto":
                    # The split scratch holds a float32 [H, D] state per work item.
                    plan = fn.wrapper._plan
                    row = 4 * shape.num_qo_heads * shape.head_dim
                    items = plan.float_workspace_bytes // row
                    print(f"{shape.label:22s} plan(): {items / shape.batch:g} items a request")
                report(shape.label, name, fn, args.reps, shape.kv_bytes(2))
            except Exception as e:  # one kernel's failure does not end the run
                print(f"{shape.label:22s} {name:16s} failed: {str(e).splitlines()[0][:200]}")
        if args.split_sweep:
            split_sweep(shape, case, args.reps)


if __name__ == "__main__":
    main()
