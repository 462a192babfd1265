"""Two versions of the CPU attention kernel timed in turns in one process:
`mojo_ops/` at a git revision (A) and in the working tree (B).

    python benchmarks/kernel_investigations/decode_cpu_ab.py BASE \
        [--rounds 12] [--cases bfloat16:4,float32:4]

On a shared VM the same binary runs up to 1.5x faster or slower from one
minute to the next, so two versions timed in separate runs, or even one after
the other, differ by more than most changes do. Here both are built into one
binary (their packages renamed `mojo_ops_a` and `mojo_ops_b`) and each round
times A and B back to back, in alternating order, with the measurements of
`decode_cpu_chunk.mojo`: one head's chunk loop hot in L1 (`chunk_times`) and
a whole task with its pool in cache (`task_ns`, 512 tokens: 2 MiB of
bfloat16 K/V, in L3), each compared by the best run of all rounds, as noise
only adds time; and the batch from memory on all cores (`memory_gbps`), by
the median of the rounds' B/A ratios. Prints all three for each case (KV
dtype : GQA group, 8 KV heads a task).

The hot chunk loop is the sharpest of the three: a null run (the working
tree's kernel compiled the same as BASE's, 8 rounds) gave B/A 0.99 and 1.01
there, against 1.07 and 1.01 for the task in cache and 1.07 and 0.84 from
memory. It is where a change to the inner loops' arithmetic shows first:
multiplies kept apart from their adds (inline `vmulps`, so that the adds
run on Zen 3's separate FADD pipes) took 2.26x (bfloat16) and 1.99x
(float32) the time of FMAs; summing each K block's two halves into one
product before the accumulator's add (a chain of one add per block instead
of two FMAs) 1.45x and 1.17x (6 rounds each, 2-core Zen 3 VM).

Its noise, on a 2-core Zen 3 VM: five null runs (BASE = HEAD on a clean tree,
6-12 rounds, two of them with an earlier version of this script) gave B/A
0.87-1.15 for the task in cache and 0.91-1.05 from memory, so there it
resolves only changes of more than about 15% and 10%. What it showed there:
broadcasting the V pass's probabilities once a block where a pass keeps one
slice (not in `mojo_ops/`), which made that pass alone 6-17% faster on hot
rows (groups 2 and 8, 40 alternations), moved the whole task at group 8 by B/A
1.07 (bfloat16) and 1.11 (float32, slower) and from memory by 0.94 and 1.02 (6
rounds, the earlier version): within the noise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHUNK_BENCH = Path(__file__).resolve().parent / "decode_cpu_chunk.mojo"
TASK_TOKENS = 512


def package_copy(revision: str | None, dest: Path) -> None:
    """mojo_ops/ at revision (None: the working tree) as the package dest."""
    if revision is None:
        shutil.copytree(ROOT / "mojo_ops", dest)
        return
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "mojo_ops"],
        check=True,
        capture_output=True,
    ).stdout
    unpacked = dest.parent / f"{dest.name}_tar"
    unpacked.mkdir()
    subprocess.run(["tar", "-x", "-C", str(unpacked)], input=archive, check=True)
    (unpacked / "mojo_ops").rename(dest)
    unpacked.rmdir()


def bench_module(package: str) -> str:
    """decode_cpu_chunk.mojo without its main, importing from package."""
    text = CHUNK_BENCH.read_text()
    text = text[: text.index("def main() raises:")]
    return re.sub(r"\bmojo_ops\.", f"{package}.", text)


def timed_calls(side: str, dtype: str, group: int) -> list[str]:
    """One round's task and memory measurements of side (a or b) for a case,
    as lines of the generated main."""
    tag = f"{dtype}_{group}"
    pad = " " * 12
    return [
        f"{pad}chunk_{side}_{tag}.append(chunk_{side}[DType.{dtype}, {group}](3)[0])",
        f"{pad}task_{side}_{tag}.append(task_{side}[DType.{dtype}, {group}, {TASK_TOKENS}](3))",
        f"{pad}memory_{side}_{tag}.append(memory_{side}[DType.{dtype}, {group}](False, 3)[0])",
    ]


def main_module(cases: list[tuple[str, int]], rounds: int) -> str:
    """The generated main: rounds of A and B in alternating order, then for
    each case the best chunk and task times and the median of the memory
    rounds' B/A."""
    lines = [
        "from chunk_a import median, chunk_times as chunk_a, task_ns as task_a,"
        " memory_gbps as memory_a",
        "from chunk_b import chunk_times as chunk_b, task_ns as task_b, memory_gbps as memory_b",
        "",
        "",
        "def report(name: String, var a: List[Float64], var b: List[Float64], best: Bool):",
        "    if best:",
        "        sort(a)",
        "        sort(b)",
        "        print(name, 'best A', a[0], 'best B', b[0], 'B/A', b[0] / a[0])",
        "    else:",
        "        var ratios = List[Float64]()",
        "        for i in range(len(a)):",
        "            ratios.append(b[i] / a[i])",
        "        print(name, 'median A', median(a), 'median B', median(b),",
        "              'B/A (median of rounds)', median(ratios))",
        "",
        "",
        "def main() raises:",
    ]
    for dtype, group in cases:
        tag = f"{dtype}_{group}"
        lines += [
            f"    var {m}_{side}_{tag} = List[Float64]()"
            for m in ("chunk", "task", "memory")
            for side in "ab"
        ]
        a, b = timed_calls("a", dtype, group), timed_calls("b", dtype, group)
        lines += [f"    for r in range({rounds}):", "        if r % 2 == 0:"]
        lines += a + b + ["        else:"] + b + a
        lines += [
            f"    report('{dtype} group {group}, chunk loop hot in L1, ns per (token, KV head):',"
            f" chunk_a_{tag}^, chunk_b_{tag}^, True)",
            f"    report('{dtype} group {group}, task in cache, ns per (token, KV head):',"
            f" task_a_{tag}^, task_b_{tag}^, True)",
            f"    report('{dtype} group {group}, from memory, GB/s:',"
            f" memory_a_{tag}^, memory_b_{tag}^, False)",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("base", help="git revision of A (B: the working tree)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--cases", default="bfloat16:4,float32:4")
    args = parser.parse_args()
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        package_copy(args.base, work / "mojo_ops_a")
        package_copy(None, work / "mojo_ops_b")
        for side in "ab":
            (work / f"chunk_{side}.mojo").write_text(bench_module(f"mojo_ops_{side}"))
        (work / "ab.mojo").write_text(main_module(cases, args.rounds))
        print(f"building A ({args.base}) and B (working tree) ...", flush=True)
        subprocess.run(
            ["mojo", "build", "-I", str(work), "-o", str(work / "ab"), str(work / "ab.mojo")],
            check=True,
        )
        subprocess.run([str(work / "ab")], check=True)


if __name__ == "__main__":
    main()
