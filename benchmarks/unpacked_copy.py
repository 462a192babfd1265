"""What a GGUF's unpacked copy costs: the first read (the GGUF parsed,
dequantized where it must be, packed and written), the copy's size on disk
beside the GGUF's, and a later load (the copy, memory-mapped).

Each model is unpacked into an empty cache directory of its own.

    python benchmarks/unpacked_copy.py [--model NAME ...] [--gguf PATH ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from harness.serve_bench import cpu_model
from pagedkv.models import MODELS, fetch_gguf


def measure(path: Path) -> tuple[float, int, float]:
    """(seconds of the first read, bytes of the copy, seconds of a later load)."""
    from pagedkv.models import unpacked

    with tempfile.TemporaryDirectory() as cache:
        os.environ["PAGEDKV_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        unpacked.read_unpacked(path)
        first = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in Path(cache).rglob("*") if p.is_file())
        t0 = time.perf_counter()
        unpacked.read_unpacked(path)
        return first, size, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--gguf", action="append", default=[], help="a GGUF file of your own")
    args = parser.parse_args()
    models = args.model or ([] if args.gguf else list(MODELS))
    paths = [fetch_gguf(name).resolve() for name in models] + [Path(p) for p in args.gguf]
    print(f"CPU: {cpu_model()}\n")
    print("| GGUF | file MB | first read s | unpacked copy MB | later load ms |")
    print("|---|---|---|---|---|")
    for path in paths:
        first, size, later = measure(path)
        mb = path.stat().st_size / 1e6
        print(f"| {path.name} | {mb:.0f} | {first:.1f} | {size / 1e6:.0f} | {later * 1e3:.0f} |")


if __name__ == "__main__":
    main()
