"""`pagedkv route`: a KV-aware router in front of `pagedkv serve` replicas,
or (`--prefill URL --decode URL`) the proxy of prefill/decode
disaggregation.

With ``--kv-events`` the router starts Dynamo's KV indexer itself,
subscribed to the replicas' event addresses in order; with ``--indexer``
it asks one that runs already. Bad flags are one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from ..models.catalog import DEFAULT_MODEL, MODELS
from ..serve.sigterm import cleanup_before_sigterm


def add_parser(sub) -> None:
    """Adds the `route` subcommand to the `pagedkv` parser's subparsers."""
    p = sub.add_parser("route", help="a KV-aware router in front of replicas (Dynamo's KV indexer)")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat; in the order of "
        "--kv-events)",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="instead of replicas: a `serve --role prefill` instance (repeat), with --decode",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a `serve --role decode` instance (repeat): the proxy of prefill/decode "
        "disaggregation",
    )
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINTS",
        default=None,
        help="the replicas' --kv-events addresses, comma-separated in --replica order: "
        "starts Dynamo's KV indexer on them",
    )
    p.add_argument("--indexer", metavar="URL", default=None, help="a running KV indexer instead")
    p.add_argument("--indexer-port", type=int, default=8090, help="default %(default)s")
    p.add_argument("--policy", choices=("kv", "round-robin"), default="kv")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"the replicas' model, for its chat template "
        f"({' or '.join(MODELS)}; default %(default)s)",
    )
    p.add_argument("--page-size", type=int, default=16, help="the replicas' (default 16)")
    p.add_argument("--host", default="127.0.0.1", help="default %(default)s")
    p.add_argument("--port", type=int, default=8000, help="default %(default)s")


def indexer_command(endpoints: list[str], page_size: int, port: int) -> list[str]:
    """Dynamo's standalone KV indexer, following replica i + 1 at endpoints[i]."""
    workers = ",".join(f"{i + 1}={e}" for i, e in enumerate(endpoints))
    return [
        sys.executable, "-m", "dynamo.indexer", "--block-size", str(page_size),
        "--port", str(port), "--threads", "1", "--workers", workers,
    ]  # fmt: skip


def wait_for_indexer(url: str, process: subprocess.Popen, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"Dynamo's KV indexer exited with status {process.returncode}")
        try:
            httpx.get(url + "/workers", timeout=1.0).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"Dynamo's KV indexer did not answer on {url}")


def run_route(args: argparse.Namespace) -> int:
    """The `route` subcommand; returns the exit status."""

    def fail(message: str) -> int:
        print(f"pagedkv route: error: {message}", file=sys.stderr, flush=True)
        return 2

    if args.prefill or args.decode:
        if args.replica or not (args.prefill and args.decode):
            return fail("give --prefill and --decode instances, or --replica ones, not both")
        return run_disagg_proxy(args)
    if not args.replica:
        return fail("give --replica URLs (or --prefill and --decode ones)")
    endpoints = args.kv_events.split(",") if args.kv_events else []
    if endpoints and len(endpoints) != len(args.replica):
        return fail("--kv-events names one address per --replica, in the same order")
    if endpoints and args.indexer:
        return fail("give --kv-events (start an indexer) or --indexer (use one), not both")
    try:
        import uvicorn

        from ..models.tokenizer import load_tokenizer
        from .router import PrefixRouter, create_router_app
    except ImportError as e:
        return fail(f"{e.name} is missing: pip install 'pagedkv[serve,distributed]'")
    indexer, url = None, args.indexer
    try:
        tokenizer = load_tokenizer(args.model)
        if endpoints:
            url = f"http://127.0.0.1:{args.indexer_port}"
            indexer = subprocess.Popen(
                indexer_command(endpoints, args.page_size, args.indexer_port)
            )
            wait_for_indexer(url, indexer)
        router = PrefixRouter(args.replica, args.page_size, url, args.policy)
    except (ValueError, RuntimeError) as e:  # ModelError is a RuntimeError
        _stop(indexer)
        return fail(str(e))
    print(
        f"routing ({args.policy}) on http://{args.host}:{args.port}/v1 to "
        f"{', '.join(router.replicas)}" + (f"; KV indexer {url}" if url else ""),
        file=sys.stderr,
        flush=True,
    )
    with cleanup_before_sigterm():
        try:
            uvicorn.run(create_router_app(router, tokenizer), host=args.host, port=args.port)
        finally:
            _stop(indexer)
    return 0


def _stop(process: subprocess.Popen | None) -> None:
    """Terminates `process` (if any, and running) and waits for it."""
    if process is not None and process.poll() is None:
        process.terminate()
        process.wait(10)


def run_disagg_proxy(args: argparse.Namespace) -> int:
    """`pagedkv route --prefill URL --decode URL`: the disaggregation proxy."""
    import uvicorn

    from .disagg_proxy import create_disagg_app

    print(
        f"disaggregation proxy on http://{args.host}:{args.port}/v1: prefill on "
        f"{', '.join(args.prefill)}, decode on {', '.join(args.decode)}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(create_disagg_app(args.prefill, args.decode), host=args.host, port=args.port)
    return 0
