"""`pagedkv serve`: loads a model and serves it over HTTP until interrupted.

Load failures and bad flags are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import sys

from ..cache.kv_events import AllBlocksCleared
from ..models.catalog import DEFAULT_MODEL, MODELS
from ..models.forms import add_gguf_argument, add_weights_arguments, load_from_arguments
from .engine import DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_WAITING
from .limits import ServeLimits
from .sigterm import cleanup_before_sigterm


def add_parser(sub) -> None:
    """Adds the `serve` subcommand to the `pagedkv` parser's subparsers."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions)")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"{' or '.join(MODELS)} (default %(default)s)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default %(default)s: local only)"
    )
    p.add_argument("--port", type=int, default=8000, help="default %(default)s")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help="sequences decoded together in one step (default %(default)s)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="prompt tokens prefilled in one step; a longer prompt is prefilled in chunks "
        "while the running streams decode between them (default %(default)s, llama.cpp's "
        "default micro-batch)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="requests that may wait for admission; more get 503 (default %(default)s)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="the waiting queue's order: arrival (default), or each request's "
        "`priority` field, lower first",
    )
    p.add_argument(
        "--kv-memory",
        type=int,
        default=None,
        help="bytes of KV cache over all layers (default 512 MiB)",
    )
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=(),
        metavar="NAME",
        help="the names clients may give the model (vLLM's flag; default: --model's), e.g. "
        "a name an application expects; answers echo the one named",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=(),
        metavar="ORIGIN",
        help="origins whose browser pages may call the server (CORS), e.g. "
        "http://localhost:3000, or * for any (default: none)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long the requests in flight may take to finish before "
        "they are cut (default %(default)s); below your supervisor's grace period",
    )
    add_limit_arguments(p)
    p.add_argument("--device", default="cpu", help="cpu (default) or gpu")
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a request's answer does not depend on what else is in its batch (default off: "
        "requests that share a prompt's prefix read its pages once)",
    )
    add_weights_arguments(p)
    add_gguf_argument(p)
    add_chat_default_arguments(p)
    add_distributed_arguments(p)


def add_limit_arguments(p) -> None:
    """The `ServeLimits` flags: a request over one gets a 4xx."""
    limits = p.add_argument_group("limits (a request over one gets a 4xx; what the server keeps)")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=ServeLimits.max_body_bytes,
        help="request body (default 8 MiB; 413)",
    )
    limits.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="prompt tokens (default: the context)"
    )
    limits.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="max_tokens a request may ask for, and the default of one that names none "
        "(default: the rest of the context)",
    )
    limits.add_argument(
        "--max-streams-per-key",
        type=int,
        default=None,
        help="requests in flight per API key, or per client address (default: no limit; 429)",
    )
    limits.add_argument(
        "--max-stored-responses",
        type=int,
        default=ServeLimits.max_stored_responses,
        help="Responses API responses kept in memory for previous_response_id, the most "
        "recently used (default %(default)s)",
    )


def add_chat_default_arguments(p) -> None:
    """How a chat's answer is read where its request does not say."""
    p.add_argument(
        "--reasoning-format",
        default="auto",
        choices=("auto", "none"),
        help="a reasoning model's <think> block where a request does not say: apart as "
        "reasoning_content (auto, the default) or left in the content (none; llama.cpp's flag)",
    )


def add_distributed_arguments(p) -> None:
    """The flags that reach past one instance (docs/distributed.md)."""
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        default=None,
        help="publish the page cache's KV events in vLLM's ZeroMQ format on this address "
        "(bound), e.g. tcp://127.0.0.1:5557, for KV-aware routers (needs the "
        "`distributed` extra)",
    )
    p.add_argument(
        "--prefix-store",
        metavar="URL",
        default=None,
        help="share cached prompt pages with other instances through this Redis server, "
        "e.g. redis://127.0.0.1:6379/0 (needs the `distributed` extra)",
    )
    p.add_argument(
        "--role",
        choices=("prefill", "decode"),
        default=None,
        help="prefill/decode disaggregation over NIXL: a prefill instance keeps a prompt's "
        "pages for a decode instance, which reads them (vLLM's kv_transfer_params; needs "
        "the `distributed` extra)",
    )
    p.add_argument(
        "--kv-transfer-host",
        metavar="HOST",
        default=None,
        help="the address decode instances reach this prefill instance at (default --host)",
    )
    p.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        help="run nixl's own progress thread, which keeps a core busy (by default a prefill "
        "instance progresses the reads of its pages every 0.5 ms while it keeps any)",
    )
    p.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        default=None,
        help="a ZeroMQ ROUTER address (bound) that replays recent event batches on request",
    )


def run_serve(args: argparse.Namespace) -> int:
    """The `serve` subcommand; returns the exit status."""
    from ..models import ModelError

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        from .server import serve
    except ImportError as e:
        say(f"pagedkv serve: error: {e.name} is missing: pip install 'pagedkv[serve]'")
        return 2
    positive = (
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-prefill-tokens", args.max_prefill_tokens),
        ("--max-waiting", args.max_waiting),
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--max-tokens-limit", args.max_tokens_limit),
        ("--max-streams-per-key", args.max_streams_per_key),
        ("--max-stored-responses", args.max_stored_responses),
    )
    for flag, value in positive:
        if value is not None and value < 1:
            say(f"pagedkv serve: error: {flag} must be at least 1")
            return 2
    if not 0 <= args.shutdown_timeout < math.inf:
        say("pagedkv serve: error: --shutdown-timeout must be a number of seconds, at least 0")
        return 2
    if not 0 <= args.port < 65536:
        say("pagedkv serve: error: --port must be in [0, 65535]")
        return 2
    try:
        publisher, store = open_distributed(args)
    except FlagError as e:
        say(f"pagedkv serve: error: {e}")
        return 2
    try:
        llm = load_from_arguments(
            args,
            say,
            kv_memory=args.kv_memory,
            batch_invariant=args.batch_invariant,
            reasoning_format=args.reasoning_format,
        )
    except ModelError as e:
        say(f"pagedkv serve: error: {e}")
        if publisher is not None:
            publisher.close()
        return 2
    try:
        connectors = attach_distributed(llm, publisher, store, args, say)
    except ValueError as e:  # a model the page transfer cannot move
        say(f"pagedkv serve: error: --role: {e}")
        if publisher is not None:
            publisher.close()
        return 2
    say(
        f"serving {', '.join(args.served_model_name) or llm.name} on "
        f"http://{args.host}:{args.port}/v1 "
        f"({llm.manager.num_pages} KV pages of {llm.manager.page_size} tokens)"
    )
    with cleanup_before_sigterm():
        try:
            serve(
                llm,
                host=args.host,
                port=args.port,
                api_key=args.api_key,
                allowed_origins=args.allowed_origins,
                served_model_names=args.served_model_name,
                shutdown_timeout=args.shutdown_timeout,
                max_num_seqs=args.max_num_seqs,
                max_prefill_tokens=args.max_prefill_tokens,
                max_waiting=args.max_waiting,
                policy=args.scheduling_policy,
                connectors=connectors,
                limits=ServeLimits(
                    max_body_bytes=args.max_body_bytes,
                    max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens=args.max_tokens_limit,
                    max_streams_per_key=args.max_streams_per_key,
                    max_stored_responses=args.max_stored_responses,
                ),
            )
        finally:
            if publisher is not None:
                # The replica's cache ends with the process: routers that
                # follow its events forget what it held.
                publisher(AllBlocksCleared())
                publisher.close()
    return 0


class FlagError(Exception):
    """A flag `serve` refuses; the message is the line it prints."""


def open_distributed(args: argparse.Namespace):
    """(KV event publisher, prefix store) as the flags ask (None where not),
    opened before the model loads so that a bad address fails at once."""
    publisher = store = None
    try:
        if args.kv_events is not None:
            from ..distributed.kv_event_publisher import ZmqKvEventPublisher

            try:
                publisher = ZmqKvEventPublisher(
                    args.kv_events, replay_endpoint=args.kv_events_replay
                )
            except ValueError as e:
                raise FlagError(f"--kv-events: {e}") from e
        if args.prefix_store is not None:
            from ..distributed.prefix_store import RedisPageStore

            try:
                store = RedisPageStore(args.prefix_store)
            except ValueError as e:
                raise FlagError(f"--prefix-store: {e}") from e
        if args.role is not None:
            import nixl  # noqa: F401 - fail before the model loads
    except ImportError as e:
        raise FlagError(f"{e.name} is missing: pip install 'pagedkv[distributed]'") from e
    except FlagError:
        if publisher is not None:
            publisher.close()
        raise
    return publisher, store


def attach_distributed(llm, publisher, store, args, say) -> list:
    """Subscribes the publisher to the model's manager and binds the store
    and the NIXL page transfer to it; returns the scheduler's connectors."""
    connectors = []
    if publisher is not None:
        llm.manager.subscribe(publisher)
        say(f"KV events on {publisher.endpoint}")
    if store is not None:
        from ..distributed.prefix_store import SharedPrefixCache

        try:
            store.client.ping()
            say(f"sharing prompt pages through {store.url}")
        except Exception as e:  # a store that is down is a miss until it answers
            say(f"prefix store {store.url} does not answer yet ({type(e).__name__})")
        connectors.append(SharedPrefixCache(llm.manager, store, llm.model_id))
    if args.role is not None:
        from ..distributed.nixl_transfer import NixlPageTransfer

        host = args.kv_transfer_host or args.host
        connectors.append(
            NixlPageTransfer(
                llm.manager,
                args.role,
                llm.model_id,
                host=host,
                port=args.port,
                progress_thread=args.nixl_progress_thread,
            )
        )
        say(f"{args.role} instance: KV pages move over NIXL (metadata at {host}:{args.port})")
    return connectors
