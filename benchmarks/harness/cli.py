"""`pagedkv bench`: decode and append beside their anchors in one run.

On the CPU: the decode shapes of the decode issue against MAX's built-in paged
attention and torch SDPA, and appends against NumPy/torch scatters, as ratio
tables with each kernel's share of the measured read bandwidth. `--plot`
sweeps the sequence length and draws GB/s against it for each implementation.
On a GPU: gpu_bench.py (FlashInfer, MAX's built-in kernel, the GPU's peak).
"""

from __future__ import annotations

from .append_bench import format_append_table, run_append_bench
from .decode_bench import CPU_SHAPES, DecodeShape, format_table, run_cpu_decode_bench
from .threads import pin_max_workers

SWEEP_LENGTHS = (256, 512, 1024, 2048, 4096)


def run_bench(
    device: str, dtypes: list[str], shapes: str | None, reps: int, plot: str | None
) -> int:
    """Runs the benchmarks and prints their tables; returns the exit status."""
    for dtype in dtypes:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtypes takes float32 and bfloat16, got {dtype!r}")
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ValueError("--plot needs matplotlib: pip install 'pagedkv[plot]'") from e
    if device == "gpu":
        from .gpu_bench import run_gpu_bench

        return run_gpu_bench(reps=reps)
    if device != "cpu":
        raise ValueError(f"--device must be cpu or gpu, got {device!r}")
    pin_max_workers()  # before this process first uses MAX
    chosen = CPU_SHAPES
    if shapes:
        try:
            chosen = tuple(CPU_SHAPES[int(i)] for i in shapes.split(","))
        except (ValueError, IndexError) as e:
            raise ValueError(
                f"--shapes takes indices 0-{len(CPU_SHAPES) - 1}, got {shapes!r}"
            ) from e
    machine, rows = run_cpu_decode_bench(chosen, dtypes, reps)
    append_rows = run_append_bench(dtypes=dtypes, reps=reps)
    print()
    print("decode attention, CPU (ratios: anchor time / pagedkv time)")
    print(format_table(machine, rows))
    print()
    print("append, CPU (GB/s moved: the appended K and V read once and written once)")
    print(format_append_table(append_rows))
    if plot is not None:
        sweep = [DecodeShape(16, length, 32, 8) for length in SWEEP_LENGTHS]
        sweep_machine, sweep_rows = run_cpu_decode_bench(sweep, dtypes[:1], reps, verbose=False)
        draw(plot, sweep_machine.read_gbps, sweep_rows)
        print(f"\nwrote {plot}")
    return 0


def draw(path: str, bandwidth: float, rows: list) -> None:
    """GB/s against sequence length, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.name for r in rows):
        mine = [r for r in rows if r.name == name]
        ax.plot([r.shape.seq_len for r in mine], [r.gbps for r in mine], marker="o", label=name)
    ax.axhline(bandwidth, color="gray", linestyle="--", label="measured read bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens per request)")
    ax.set_ylabel("K/V read rate (GB/s)")
    shape = rows[0].shape
    ax.set_title(
        f"decode, B={shape.batch}, Hq={shape.num_qo_heads}, Hkv={shape.num_kv_heads}, "
        f"D={shape.head_dim}, {rows[0].dtype}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
