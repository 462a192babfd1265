"""The `pagedkv` command: demo (the main job), generate, serve, route, bench,
check-gpu and cache.

Bad flags and impossible configurations end with a one-line error naming
the problem and how to fix it, and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..models.catalog import DEFAULT_MODEL, MODELS
from ..models.forms import add_gguf_argument, add_weights_arguments


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are one line and exit with status 2."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_demo(sub)
    _add_generate(sub)
    from ..serve.cli import add_parser as add_serve_parser

    add_serve_parser(sub)
    from ..distributed.route_cli import add_parser as add_route_parser

    add_route_parser(sub)
    _add_bench_and_check_gpu(sub)
    from .disk_cache import add_parser as add_cache_parser

    add_cache_parser(sub)
    return parser


def _add_demo(sub) -> None:
    """`pagedkv demo`'s flags."""
    demo = sub.add_parser(
        "demo", help="serve a real model to a stream of chat requests and check every token"
    )
    demo.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"{' or '.join(MODELS)} (default %(default)s), or random (a small "
        "random-weight model)",
    )
    demo.add_argument("--device", default="cpu", help="cpu (default) or gpu")
    demo.add_argument(
        "--requests", type=int, default=16, help="requests to serve (default %(default)s)"
    )
    demo.add_argument(
        "--layers", type=int, default=None, help="--model random: transformer layers (default 4)"
    )
    add_weights_arguments(demo)
    demo.add_argument(
        "--page-size", type=int, default=16, help="tokens per page (default %(default)s)"
    )
    demo.add_argument(
        "--max-new-tokens",
        type=int,
        default=48,
        help="tokens generated per request (default %(default)s)",
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="seed of weights and prompts (default %(default)s)"
    )
    demo.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="pages in each layer's pool (default: 4096 tokens' worth, more if the largest "
        "request needs more)",
    )
    demo.add_argument("--qo-heads", type=int, default=None, help="--model random: query heads (8)")
    demo.add_argument("--kv-heads", type=int, default=None, help="--model random: KV heads (2)")


def _add_generate(sub) -> None:
    """`pagedkv generate`'s flags."""
    gen = sub.add_parser(
        "generate", help="answer prompts with a real model (continuous batching, streamed)"
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompts, served together")
    gen.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"{' or '.join(MODELS)} (default %(default)s)"
    )
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the model's chat template (default); --no-chat completes raw text",
    )
    gen.add_argument("--system", default=None, help="system prompt (chat; default the model's)")
    gen.add_argument(
        "--max-new-tokens", type=int, default=64, help="per prompt (default %(default)s)"
    )
    gen.add_argument("--device", default="cpu", help="cpu (default) or gpu")
    add_weights_arguments(gen)
    add_gguf_argument(gen)
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default %(default)s)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus (default %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="k most likely tokens (0: all)")
    gen.add_argument("--min-p", type=float, default=0.0, help="min-p (default %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument(
        "--response-format",
        default=None,
        metavar="JSON",
        help="what every answer follows, as the server's response_format: '{\"type\": "
        '"json_object"}\', a json_schema, a regex or a choice',
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt, one per line, in prompt order",
    )


def _add_bench_and_check_gpu(sub) -> None:
    """`pagedkv bench` and `pagedkv check-gpu`'s flags."""
    bench = sub.add_parser("bench", help="decode and append beside their anchors, one run")
    bench.add_argument("--device", default="cpu", help="cpu (default) or gpu")
    bench.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma-separated (default %(default)s)"
    )
    bench.add_argument(
        "--shapes",
        default=None,
        help="comma-separated indices into the CPU shapes (B, L, Hq, Hkv) of "
        "benchmarks/harness/decode_bench.py; default all",
    )
    bench.add_argument(
        "--reps", type=int, default=15, help="timed runs of each (default %(default)s)"
    )
    bench.add_argument("--plot", default=None, help="write GB/s against length to this PNG")
    bench.add_argument(
        "--serve",
        action="store_true",
        help="serve SmolLM2 beside HF transformers instead (benchmarks/serve.py; needs the "
        "test extra)",
    )

    gpu = sub.add_parser("check-gpu", help="compile every GPU path for NVIDIA GPUs")
    gpu.add_argument(
        "archs", nargs="*", default=["sm_90", "sm_80"], help="targets (default sm_90 sm_80)"
    )
    gpu.add_argument(
        "--no-demo", action="store_true", help="leave out the demo's model graphs (minutes)"
    )


def main(argv: list[str] | None = None) -> int:
    """The `pagedkv` command: runs the subcommand `argv` names; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "generate":
            from .generate import run_generate

            return run_generate(args)
        if args.command == "serve":
            from ..serve.cli import run_serve

            return run_serve(args)
        if args.command == "route":
            from ..distributed.route_cli import run_route

            return run_route(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "cache":
            from .disk_cache import run_cache

            return run_cache(args)
        from .._ops.gpu_check import main as check_gpu

        return check_gpu(args.archs + (["--no-demo"] if args.no_demo else []))
    except KeyboardInterrupt:
        print("pagedkv: interrupted", file=sys.stderr)
        return 130


def _demo(args: argparse.Namespace) -> int:
    from ..graphs.demo import DemoError, DemoOptions, run_demo

    options = DemoOptions(
        model=args.model,
        device=args.device,
        requests=args.requests,
        layers=args.layers,
        weights=args.weights,
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        num_pages=args.num_pages,
        qo_heads=args.qo_heads,
        kv_heads=args.kv_heads,
    )
    try:
        return run_demo(options)
    except DemoError as e:
        print(f"pagedkv demo: error: {e}", file=sys.stderr)
        return 2


def benchmarks_dir() -> Path | None:
    """The source checkout's benchmarks/ folder, or None: the benchmarks stay
    out of the installed package, so `pagedkv bench` runs from a checkout
    (an editable install) only."""
    folder = Path(__file__).resolve().parents[3] / "benchmarks"
    return folder if (folder / "harness" / "cli.py").is_file() else None


def _bench(args: argparse.Namespace) -> int:
    folder = benchmarks_dir()
    if folder is None:
        print(
            "pagedkv bench: error: the benchmarks live in the source checkout's benchmarks/ "
            "folder, which this installation does not have: clone the repository and "
            "`pip install -e .` there",
            file=sys.stderr,
        )
        return 2
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    from harness.cli import run_bench

    if args.serve:
        from harness.serve_bench import main as run_serve_bench

        run_serve_bench(args.dtypes.split(","), one_at_a_time=8)
        return 0
    try:
        return run_bench(args.device, args.dtypes.split(","), args.shapes, args.reps, args.plot)
    except ValueError as e:
        print(f"pagedkv bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
