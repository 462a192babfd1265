"""Time to the first generated token of `pagedkv demo`, cold and warm.

Cold: each run gets empty caches (MAX's and pagedkv's, through a fresh
XDG_CACHE_HOME) holding only the already fetched GGUF, so the download is
not timed. Warm: the runs after a cold one, with the caches it filled. The
first token is the demo's first progress line ("step    1").

    python benchmarks/cold_start.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.serve_bench import cpu_model
from pagedkv.models import fetch_gguf

MARKS = {
    b"compiling the prefill": "model read",
    b"compile: ": "graphs compiled",
    b"step    1 ": "first token",
}
"""The demo's output that ends each stage."""


def time_demo(env: dict[str, str]) -> tuple[float, float, dict[str, float]]:
    """(seconds to the first token, seconds to the end, seconds to each mark)
    of one demo run."""
    t0 = time.perf_counter()
    demo = [sys.executable, "-m", "pagedkv", "demo"]
    proc = subprocess.Popen(demo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    seen, marks = b"", {}
    while chunk := os.read(proc.stdout.fileno(), 4096):
        seen += chunk
        for text, stage in MARKS.items():
            if stage not in marks and text in seen:
                marks[stage] = time.perf_counter() - t0
    first = marks.get("first token")
    if proc.wait() or first is None:
        raise RuntimeError(seen.decode(errors="replace")[-3000:])
    return first, time.perf_counter() - t0, marks


def stages(marks: dict[str, float]) -> str:
    return ", ".join(f"{stage} at {t:.1f} s" for stage, t in marks.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    gguf = fetch_gguf("smollm2-135m-instruct")
    print(f"CPU: {cpu_model()}")
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as home:
            models = Path(home) / "pagedkv" / "models" / gguf.parent.name
            models.mkdir(parents=True)
            shutil.copy(gguf, models / gguf.name)
            env = {**os.environ, "XDG_CACHE_HOME": home}
            env.pop("PAGEDKV_CACHE_DIR", None)
            first, end, marks = time_demo(env)
            print(f"cold run {run + 1}: first token {first:.1f} s, finished {end:.1f} s")
            print(f"  ({stages(marks)})")
            if run == args.runs - 1:
                for warm in range(args.runs):
                    first, end, _ = time_demo(env)
                    print(f"warm run {warm + 1}: first token {first:.1f} s, finished {end:.1f} s")


if __name__ == "__main__":
    main()
