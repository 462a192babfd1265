"""Merging attention states (the cascade helpers) on the CPU beside the same
merge written in torch, and a plain read of the same bytes, in one run.

Bytes moved = the states read once and the merged state written once.
"""

from __future__ import annotations

from dataclasses import dataclass

from .anchors import Timing, rows_by_case, same_bytes_reads, time_round_robin


@dataclass(frozen=True)
class MergeShape:
    """merge_states of v [n, states, heads, head_dim]; merge_state_in_place
    of two [n * states // 2, heads, head_dim] states (the same bytes read)."""

    label: str
    n: int
    states: int
    heads: int = 32
    head_dim: int = 128


MERGE_SHAPES = (
    MergeShape("split-K decode, 64 x 8 splits", 64, 8),
    MergeShape("cascade, 256 x 2 levels", 256, 2),
)


@dataclass
class MergeRow:
    shape: MergeShape
    dtype: str
    op: str
    name: str
    timing: Timing
    gbps: float


def torch_merge_states(v, s):
    """FlashInfer's merge_states in torch: v [N, S, H, D], s [N, S, H] (base-2
    log-sum-exps) -> v [N, H, D], s [N, H]; float32 arithmetic."""
    import torch

    top = s.amax(1, keepdim=True)
    w = torch.exp2(s - top)
    total = w.sum(1)
    merged = (v.float() * w.unsqueeze(-1)).sum(1) / total.unsqueeze(-1)
    return merged.to(v.dtype), top.squeeze(1) + torch.log2(total)


def merge_fns(shape: MergeShape, dtype: str, op: str):
    """(name -> callable, bytes moved) for one op on one shape."""
    import torch

    import pagedkv

    s = shape
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    if op == "merge_states":
        v = torch.randn(s.n, s.states, s.heads, s.head_dim).to(dt)
        lse = torch.randn(s.n, s.states, s.heads)
        fns = {
            "pagedkv": lambda: pagedkv.merge_states(v, lse),
            "torch": lambda: torch_merge_states(v, lse),
        }
        nbytes = v.nbytes + lse.nbytes + (v.nbytes + lse.nbytes) // s.states
    else:
        rows = s.n * s.states // 2
        a = torch.randn(rows, s.heads, s.head_dim).to(dt)
        b = torch.randn(rows, s.heads, s.head_dim).to(dt)
        sa, sb = torch.randn(rows, s.heads), torch.randn(rows, s.heads)
        pair_v, pair_s = torch.stack([a, b], 1), torch.stack([sa, sb], 1)

        def torch_in_place() -> None:
            merged, merged_s = torch_merge_states(pair_v, pair_s)
            a.copy_(merged)
            sa.copy_(merged_s)

        # Merging into a again and again keeps its values finite: the
        # weights sum to 1.
        fns = {
            "pagedkv": lambda: pagedkv.merge_state_in_place(a, sa, b, sb),
            "torch": torch_in_place,
        }
        nbytes = 3 * a.nbytes + 3 * sa.nbytes
    fns.update(same_bytes_reads(nbytes))
    return fns, nbytes


def run_merge_bench(
    shapes=MERGE_SHAPES,
    dtypes=("float32", "bfloat16"),
    ops=("merge_states", "merge_state_in_place"),
    reps: int = 20,
) -> list[MergeRow]:
    """Times pagedkv's merges beside torch's, caches flushed before each run."""
    rows: list[MergeRow] = []
    for shape in shapes:
        for dtype in dtypes:
            for op in ops:
                fns, nbytes = merge_fns(shape, dtype, op)
                for name, t in time_round_robin(fns, reps=reps, max_s=2.0).items():
                    rows.append(MergeRow(shape, dtype, op, name, t, nbytes / t.median_ms / 1e6))
                    print(
                        f"  {shape.label:30s} {dtype:8s} {op:20s} {name:10s} "
                        f"{t.median_ms:8.3f} ms {rows[-1].gbps:6.1f} GB/s",
                        flush=True,
                    )
    return rows


def format_merge_table(rows: list[MergeRow]) -> str:
    """The merge table: pagedkv's ms and GB/s per (shape, dtype, op), beside
    torch's as a ratio, and the share of the faster plain read of the same
    bytes (%read)."""
    lines = [
        f"{'shape':30s} {'dtype':8s} {'op':20s} {'pagedkv ms':>10s} {'GB/s':>6s} "
        f"{'torch ms':>9s} {'x torch':>7s} {'%read':>6s}"
    ]
    for (shape, dtype, op), g in rows_by_case(rows, "op").items():
        ours, torch_row = g["pagedkv"], g["torch"]
        read = max(g["read_numpy"].gbps, g["read_torch"].gbps)
        lines.append(
            f"{shape.label:30s} {dtype:8s} {op:20s} {ours.timing.median_ms:10.3f} "
            f"{ours.gbps:6.1f} {torch_row.timing.median_ms:9.3f} "
            f"{torch_row.timing.median_ms / ours.timing.median_ms:7.2f} "
            f"{100 * ours.gbps / read:5.0f}%"
        )
    return "\n".join(lines)
