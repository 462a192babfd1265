"""Can a pagedkv decode step be replayed as a CUDA graph, and what does a
run() cost on the host? Probes, on a GPU, for one planned decode (bf16,
page 16, head_dim 128):

1. torch.cuda.graph capturing run(): MAX runs on its own stream, which the
   events of `stream_ordered` join to torch's capture; replayed with new q
   contents, the output must equal an eager run on the same q.
2. MAX's own Model.capture / replay of the planned op on the same buffers.
3. Host microseconds per call: eager run(), each replay, and the pieces of
   run() (wrapping arrays, stream ordering, MAX's execute).

    python benchmarks/kernel_investigations/cuda_graph_probe.py

Each probe reports its failure and the run goes on.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

# The shared timing code: benchmarks/harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.gpu_bench import host_time_us


def host_us(fn) -> float:
    """Median host µs of fn() over 200 calls, the GPU idle before each call."""
    return host_time_us(fn, reps=200)


def back_to_back_us(fn, reps: int = 500) -> float:
    """Mean host µs per call when calls follow each other (the GPU busy)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    import torch

    from harness.decode_bench import DecodeShape, make_case, pagedkv_decode

    case = make_case(DecodeShape(8, 2048, 32, 8), "bfloat16", device="cuda")
    run = pagedkv_decode(case, "auto")
    w = run.wrapper
    out = torch.empty_like(case.q)
    q = case.q.clone()
    eager = lambda: w.run(q, case.pool, out=out)  # noqa: E731
    eager()
    print(f"eager run(): host {host_us(eager):.1f} us idle, {back_to_back_us(eager):.1f} us "
          "back to back", flush=True)  # fmt: skip

    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            eager()
        q.copy_(torch.randn_like(q))
        graph.replay()
        got = out.clone()
        want = w.run(q, case.pool)
        diff = float((got.float() - want.float()).abs().max())
        print(f"torch.cuda.graph capture of run(): replay max|diff| vs eager {diff:.2e}; host "
              f"{host_us(graph.replay):.1f} us idle, {back_to_back_us(graph.replay):.1f} us back "
              "to back", flush=True)  # fmt: skip
    except Exception:
        print("torch.cuda.graph capture of run() failed:")
        traceback.print_exc()

    try:
        from pagedkv._ops.kernels import to_buffer

        plan = w._plan
        b = plan.buffers
        k_cache, v_cache = case.pool, case.pool
        from pagedkv._checks import cache_geometry

        geometry = cache_geometry("paged_kv_cache", case.pool, "NHD", written=False)
        k_cache, v_cache = geometry.kernel_operands()
        from pagedkv._ops.contract import attention_operands

        arrays = attention_operands(
            output=out, lse=b["lse_scratch"], partial_o=b["partial_o"],
            partial_lse=b["partial_lse"], q=q, k_cache=k_cache, v_cache=v_cache,
            kv_indices=b["indices"], kv_indptr=b["indptr"], kv_last_page_len=b["last"],
            work_items=b["items"], request_items=b["request_items"],
            custom_mask=b["custom_mask"], mask_rows=b["mask_rows"],
            float_params=plan.float_params(None, None, None), int_params=b["int_params"],
        )  # fmt: skip
        buffers = [to_buffer(a) for a in arrays]
        plan.model.capture(1, *buffers)
        q.copy_(torch.randn_like(q))
        torch.cuda.synchronize()
        plan.model.replay(1, *buffers)
        from pagedkv._ops.kernels import accelerator
        from pagedkv._ops.tensors import Device

        accelerator(Device("gpu")).synchronize()
        got = out.clone()
        want = w.run(q, case.pool)
        diff = float((got.float() - want.float()).abs().max())
        replay = lambda: plan.model.replay(1, *buffers)  # noqa: E731
        print(f"MAX Model.capture/replay: max|diff| vs eager {diff:.2e}; host "
              f"{host_us(replay):.1f} us idle, {back_to_back_us(replay):.1f} us back to back",
              flush=True)  # fmt: skip
        execute = lambda: plan.model.execute(*buffers)  # noqa: E731
        print(f"MAX execute of the same buffers: host {host_us(execute):.1f} us idle, "
              f"{back_to_back_us(execute):.1f} us back to back", flush=True)  # fmt: skip
        wrap = lambda: [to_buffer(a, stream_ordered=True) for a in arrays]  # noqa: E731
        print(f"wrapping the {len(arrays)} operands: {back_to_back_us(wrap):.1f} us", flush=True)
    except Exception:
        print("MAX capture/replay probe failed:")
        traceback.print_exc()


if __name__ == "__main__":
    main()
