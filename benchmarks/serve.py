"""Serving a catalogue model: pagedkv beside HF transformers in one run
(see benchmarks/harness/serve_bench.py for what each row does).

    python benchmarks/serve.py [--model gemma3-270m] [--dtypes float32,bfloat16] [--one-at-a-time N]
    python benchmarks/serve.py --device gpu --requests 1,64

Needs transformers and accelerate (`pip install -e ".[test]"`).
"""

from __future__ import annotations

import argparse

from harness.serve_bench import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--one-at-a-time",
        type=int,
        default=8,
        help="prompts transformers serves one at a time (its tokens/s; default 8)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or gpu")
    parser.add_argument(
        "--requests", default="32", help="request counts served at once, comma-separated"
    )
    args = parser.parse_args()
    counts = tuple(int(n) for n in args.requests.split(","))
    main(args.dtypes.split(","), args.one_at_a_time, args.device, counts, args.model)
