"""Decode, MLA decode and append on an NVIDIA GPU beside FlashInfer and MAX's
built-in decode, in one run: µs, TB/s, share of peak and of a measured copy,
ratios, pagedkv's host time per run(). `pagedkv bench --device gpu` runs all
three parts.

    python benchmarks/decode_gpu.py [--reps 50] [--parts decode,mla,append]
        [--skip pagedkv-generic,...]
"""

from __future__ import annotations

import argparse

from harness.gpu_bench import run_gpu_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--parts", default="decode,mla,append")
    parser.add_argument(
        "--skip",
        default="",
        help="decode implementations to leave out, e.g. pagedkv-generic (3-7x the others' time)",
    )
    args = parser.parse_args()
    skip = tuple(name for name in args.skip.split(",") if name)
    raise SystemExit(run_gpu_bench(args.reps, tuple(args.parts.split(",")), skip))


if __name__ == "__main__":
    main()
