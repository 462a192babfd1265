"""A KV-aware router in front of several `pagedkv serve` replicas.

Each replica publishes its KV events (`serve --kv-events`); Dynamo's KV
indexer (`python -m dynamo.indexer`, from ``ai-dynamo-runtime``) follows
them and answers, for a prompt's token ids, how many leading tokens each
replica holds. The router sends each OpenAI request to the replica with
the least work: the pages it would prefill (those of the prompt it does
not hold) plus the pages the requests in flight there added to its pool,
as Dynamo's own router weighs new and active blocks. What the indexer
cannot know yet (a prompt routed a moment ago whose prefill has not
finished) the router remembers itself for a few seconds: the page chains
of the prompts it routed, and where. ``policy="round-robin"``
ignores both, for comparison.

The router forwards the request's body unchanged and streams the answer
back unchanged; it only reads the prompt (chat messages through the
model's chat template, a text prompt, or token ids) to score replicas.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request

from .proxying import add_openai_routes, proxy_error, relay

__all__ = ["PrefixRouter", "Route", "RouterStats", "create_router_app"]

log = logging.getLogger("pagedkv.router")

POLICIES = ("kv", "round-robin")


@dataclass
class Route:
    """Where one request went."""

    replica: int
    held_tokens: int
    """Prompt tokens the replica was expected to hold (indexer or remembered)."""
    pages: int
    """The load it adds there until its prefill is done: the prompt's pages
    the replica did not hold (one page after, while it decodes)."""
    weight: int = field(default=-1, compare=False)
    """What it weighs there now (`pages`, then 1)."""

    def __post_init__(self) -> None:
        if self.weight < 0:
            self.weight = self.pages


@dataclass
class RouterStats:
    """What the router has done since it started."""

    routed: list[int] = field(default_factory=list)
    """Requests sent to each replica."""
    prompt_tokens: int = 0
    matched_tokens: int = 0
    """Prompt tokens the chosen replica was expected to hold (indexer or
    remembered routing)."""
    indexer_errors: int = 0


class PrefixRouter:
    """Chooses a replica for each prompt.

    Parameters
    ----------
    replicas : sequence of str
        The replicas' base URLs; replica i is instance ``i + 1`` in the
        indexer (``--workers 1=...,2=...``).
    page_size : int
        The replicas' page size (the indexer's block size).
    indexer_url : str, optional
        Dynamo's KV indexer (its HTTP port); None routes on remembered
        prompts only.
    policy : str
        "kv" or "round-robin".
    model_name : str
        The indexer's model name for the replicas.
    remembered_pages : int
        Page chains of routed prompts kept (least recently routed dropped).
    remember_seconds : float
        How long a routed prompt counts as held where it went without the
        indexer saying so: long enough for its prefill and events, short
        enough that pages the replica has evicted since stop drawing
        prompts there (the indexer's answer is the truth after that).
    overlap_weight : float
        What a page to prefill costs against a page in flight (Dynamo's
        ``overlap_score_weight``).
    indexer_timeout : float
        Seconds an indexer query may take before the prompt is routed on
        remembered prompts alone (counted in ``stats.indexer_errors``): a
        route waits on it.

    Examples
    --------
    >>> router = PrefixRouter(["http://a", "http://b"], page_size=2, policy="kv")
    >>> first = router.choose([1, 2, 3, 4, 5]); router.done(first)
    >>> router.choose([1, 2, 3, 4, 9]) == Route(first.replica, 4, 1)
    True
    """

    def __init__(
        self,
        replicas: Sequence[str],
        page_size: int,
        indexer_url: str | None = None,
        policy: str = "kv",
        model_name: str = "default",
        remembered_pages: int = 65536,
        remember_seconds: float = 10.0,
        overlap_weight: float = 1.0,
        indexer_timeout: float = 1.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not replicas:
            raise ValueError("give at least one replica")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not indexer_timeout > 0:
            raise ValueError(f"indexer_timeout must be > 0 seconds, got {indexer_timeout}")
        self.replicas = [r.rstrip("/") for r in replicas]
        self.page_size = page_size
        self.indexer_url = indexer_url.rstrip("/") if indexer_url else None
        self.policy = policy
        self.model_name = model_name
        self.overlap_weight = overlap_weight
        self.in_flight = [0] * len(self.replicas)
        self.active_pages = [0] * len(self.replicas)
        """Pages the requests in flight at each replica added to its pool (its load)."""
        self.stats = RouterStats(routed=[0] * len(self.replicas))
        self._turn = itertools.cycle(range(len(self.replicas)))
        self._remembered: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._capacity = remembered_pages
        self.remember_seconds = remember_seconds
        self._indexer = httpx.Client(timeout=indexer_timeout) if self.indexer_url else None

    def _chain(self, token_ids: Sequence[int]) -> list[bytes]:
        size, keys, key = self.page_size, [], b""
        for start in range(0, len(token_ids) - size + 1, size):
            page = ",".join(map(str, token_ids[start : start + size])).encode()
            key = hashlib.blake2b(key + page, digest_size=16).digest()
            keys.append(key)
        return keys

    def indexed(self, token_ids: Sequence[int]) -> dict[int, int]:
        """Leading tokens each replica holds, by Dynamo's indexer ({} when
        there is none or it does not answer)."""
        if self._indexer is None:
            return {}
        try:
            answer = self._indexer.post(
                self.indexer_url + "/query",
                json={"token_ids": list(token_ids), "model_name": self.model_name},
            )
            answer.raise_for_status()
            instances = answer.json().get("instances", {})
            return {
                int(i) - 1: int(v.get("longest_matched", 0))
                for i, v in instances.items()
                if 0 < int(i) <= len(self.replicas)
            }
        except (httpx.HTTPError, ValueError) as e:
            if not self.stats.indexer_errors:
                log.warning("KV indexer %s: %s", self.indexer_url, e)
            self.stats.indexer_errors += 1
            return {}

    def choose(self, token_ids: Sequence[int]) -> Route:
        """The replica for a prompt; it counts in flight there until
        `done(route)`."""
        indexed = self.indexed(token_ids) if self.policy == "kv" else {}
        return self.decide(token_ids, indexed)

    def decide(self, token_ids: Sequence[int], indexed: dict[int, int]) -> Route:
        """`choose` with the indexer's answer given (the app asks it off the
        event loop).

        Under "kv" each replica costs, as Dynamo's router reckons it, the
        pages it would prefill (the prompt's less those it holds) times
        `overlap_weight`, plus the pages of the prompts in flight there;
        the cheapest wins, equals in turn."""
        pages = len(token_ids) // self.page_size + 1
        n = len(self.replicas)
        start = next(self._turn)  # equals in turn, from a start that moves by one
        if self.policy == "round-robin":
            best, held = start, 0
        else:
            chain, now = self._chain(token_ids), time.monotonic()
            held_by = [0] * n
            for replica, tokens in indexed.items():
                held_by[replica] = tokens // self.page_size
            for i, key in enumerate(chain):
                replica, when = self._remembered.get(key, (None, 0.0))
                if replica is None or now - when > self.remember_seconds:
                    break
                held_by[replica] = max(held_by[replica], i + 1)
            order = [(start + k) % n for k in range(n)]
            best = min(
                order,
                key=lambda r: self.overlap_weight * (pages - held_by[r]) + self.active_pages[r],
            )
            held = held_by[best]
            for key in chain:
                self._remembered[key] = (best, now)
                self._remembered.move_to_end(key)
            while len(self._remembered) > self._capacity:
                self._remembered.popitem(last=False)
        # Its load there: the pages it adds (those shared with what the
        # replica holds count once, as they do in its pool).
        added = pages - min(held, pages)
        self.in_flight[best] += 1
        self.active_pages[best] += added
        self.stats.routed[best] += 1
        self.stats.prompt_tokens += len(token_ids)
        self.stats.matched_tokens += min(held * self.page_size, len(token_ids))
        return Route(best, held * self.page_size, added)

    def prefilled(self, route: Route) -> None:
        """The replica has sent the request's first bytes: its prefill is
        done, and it weighs one page from now on."""
        light = min(route.weight, 1)
        self.active_pages[route.replica] -= route.weight - light
        route.weight = light

    def done(self, route: Route) -> None:
        """The request routed there has finished (or failed)."""
        self.in_flight[route.replica] -= 1
        self.active_pages[route.replica] -= route.weight
        route.weight = 0

    def close(self) -> None:
        if self._indexer is not None:
            self._indexer.close()


def prompt_token_ids(body: dict, chat: bool, tokenizer) -> list[int]:
    """The prompt's token ids as a replica will see them (chat template for
    chat; a text prompt encoded; token ids as given; the first prompt of a
    list). Empty when the body has none the router can read."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or tokenizer is None:
            return []
        turns = [
            {"role": m.get("role", "user"), "content": _text(m.get("content"))}
            for m in messages
            if isinstance(m, dict)
        ]
        return tokenizer.prompt_ids(tokenizer.render_chat(turns))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.prompt_ids(prompt) if tokenizer is not None else []
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return []


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def create_router_app(router: PrefixRouter, tokenizer=None):
    """The router's ASGI app: the OpenAI routes forwarded to the chosen
    replica, ``/v1/models`` and ``/health`` from the first that answers, and
    ``/router/stats``."""
    import asyncio
    from contextlib import asynccontextmanager

    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))

    @asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()
        router.close()

    app = FastAPI(title="pagedkv router", docs_url=None, redoc_url=None, lifespan=lifespan)

    async def forward(request: Request, path: str, chat: bool):
        raw = await request.body()
        try:
            body = json.loads(raw)
            ids = prompt_token_ids(body, chat, tokenizer) if isinstance(body, dict) else []
        except Exception:  # the replica answers a malformed body with its own 4xx
            body, ids = {}, []
        indexed = (
            await asyncio.to_thread(router.indexed, ids) if ids and router.policy == "kv" else {}
        )
        route = router.decide(ids, indexed)
        replica = route.replica
        headers = {
            k: v for k, v in request.headers.items() if k in ("authorization", "content-type")
        }
        url = router.replicas[replica] + path
        try:
            upstream = await client.send(
                client.build_request("POST", url, content=raw, headers=headers), stream=True
            )
        except httpx.HTTPError as e:
            router.done(route)
            return proxy_error(
                502, f"replica {router.replicas[replica]} did not answer: {type(e).__name__}"
            )
        stream = isinstance(body, dict) and bool(body.get("stream"))
        return await relay(
            upstream,
            stream,
            {"x-pagedkv-replica": str(replica)},
            on_close=lambda: router.done(route),
            on_first=lambda: router.prefilled(route),
        )

    add_openai_routes(app, forward, client, router.replicas[0])

    @app.get("/health")
    async def health():
        return {"status": "ok", "replicas": len(router.replicas)}

    @app.get("/router/stats")
    async def stats():
        s = router.stats
        return {
            "policy": router.policy,
            "routed": s.routed,
            "in_flight": router.in_flight,
            "prompt_tokens": s.prompt_tokens,
            "matched_tokens": s.matched_tokens,
            "indexer_errors": s.indexer_errors,
        }

    return app
