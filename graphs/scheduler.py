"""Continuous batching: the one scheduler behind `LLM.generate`, `pagedkv
demo` and `pagedkv serve`.

Requests arrive, prefill, decode and finish at different steps, and new ones
take the freed places. Every `step()` (1) preempts the last requests in
queue order while the coming decode step would need more pages than the
pool can give, (2) admits waiting requests, first in queue order, while the
pool, `max_num_seqs` and `max_prefill_tokens` have room, prefilling them in
one batch (the prefix cache serves the pages a shared prompt already
filled; a new request whose first uncached page another request admitted
in the same step computes waits a step, and then finds it cached; the
prefill budget counts the tokens a prefill computes), (3) decodes one
token for every running sequence in one batch,
handing each token to the request's sink as it is chosen.

Prefill is chunked: a step computes at most `max_prefill_tokens` prompt
tokens, so a prompt longer than that is prefilled over several steps, a
chunk a step (the prompts still being prefilled first, then new ones), and
the running streams decode a token between every two chunks. Its first
token comes with its last chunk. A preempted request's recompute is
chunked the same way (it decodes again once all its samples' contexts are
in); a request asking for prompt logprobs is prefilled whole.

The queue order is the policy: "fcfs" serves requests in the order they
were submitted, "priority" by `Request.priority` (lower first, as vLLM's),
then in submission order. Preemption takes the request that comes last in
the same order.

Admission is optimistic: a request is admitted when its prompt (not its full
length) fits, so more requests share the pool than their worst cases allow.
When a decode step would run out, a request is preempted by recompute: its
pages are released (full pages stay in the prefix cache), it goes back to
the waiting queue, and when readmitted its samples are prefilled again from
prompt + tokens generated so far, continuing where they stopped (sampling
generators keep their state). Output already handed out is never taken
back. A request whose full length cannot fit the whole pool is refused at
submission, so the first request in queue order always makes progress.

A new request takes what the prefix cache holds of its prompt: whole pages,
then the first tokens of a cached page that starts like its next page (a
copy: `PagedKVCacheManager.copy_partial_hit`), so requests on one system
prompt compute only their own tokens wherever the prompt ends.

`n` samples of a request are forked after its prefill and share the prompt's
pages (copy-on-write on the last, partial one). A greedy request's sample k
starts from the k-th most likely first token and continues greedily (a
deterministic stand-in for sampling that a reference can replay); sampled
ones draw from generators seeded with (seed, k).

A request with a grammar (`response_format`: pagedkv.graphs.structured)
chooses each sample's tokens among those its parse allows, and a sample
ends where its grammar is complete.

A sample ends at its token limit, on one of the request's stop tokens (the
model's EOS unless `ignore_eos`), on a stop string or at the end of its
grammar; its pages are released at once. The scheduler is not thread-safe:
one thread owns it, its engine and its page manager (`pagedkv.serve.engine`
runs it on one).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

import numpy as np

from pagedkv.cache.manager import OutOfPagesError

from .engine import DecoderEngine
from .kv_connector import KVConnector, KVTransferError
from .sampling import (
    GREEDY,
    NO_ADJUSTMENTS,
    LogitAdjustments,
    SamplingParams,
    TokenLogprob,
    greedy_tokens,
    log_softmax,
    sample_token,
    token_logprob,
)
from .stop_strings import StopMatcher
from .structured import Grammars, GrammarState

log = logging.getLogger("pagedkv.scheduler")

POLICIES = ("fcfs", "priority")
"""Queue orders a `Scheduler` takes."""
MAX_LOGPROBS = 20
"""Most likely tokens a request may ask to see beside each chosen one."""


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting` requests: try again later."""


class RequestError(ValueError):
    """A request that can never be served (its message names the limit)."""


@dataclass(frozen=True)
class Request:
    """What a client asks for.

    prompt: token ids (at least one). max_tokens: generated tokens per
    sample, at most the context left after the prompt. n: samples sharing
    the prompt. stop: strings that end a sample (left out of its text; needs
    a scheduler with a detokenizer). stop_token_ids: tokens that end a
    sample besides the model's EOS; ignore_eos: EOS does not end one.
    min_tokens: tokens a sample generates before a stop token may end it
    (vLLM's: the stop tokens are masked until then; stop strings still end
    it).
    priority: the queue key under the "priority" policy (lower first).
    arrival_step: the step `Scheduler.run` submits it at.
    logprobs: report each chosen token's log-probability with this many of
    the most likely (0 to MAX_LOGPROBS); None reports none.
    prompt_logprobs: the same for every prompt token after the first (a
    `PromptLogprobs` event before the first token); the prompt is then
    computed whole, not read from the prefix cache.
    adjustments: logit bias and penalties applied before choosing a token
    (the repetition penalty counts the prompt's tokens).
    grammar: a grammar the samples' text must follow (`pagedkv.graphs.
    structured`: OpenAI's `response_format`); needs a scheduler with
    `grammars`.
    kv_transfer: vLLM's ``kv_transfer_params`` as the client sent them (a
    prefill instance's pages to pull, or a request to keep them for a
    decode instance); the connectors read them.
    """

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    priority: int = 0
    arrival_step: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    adjustments: LogitAdjustments = NO_ADJUSTMENTS
    grammar: str | None = None
    kv_transfer: dict | None = None


@dataclass(frozen=True)
class Delta:
    """New text and tokens of sample `index`; finish_reason is set on its
    last delta ("stop": a stop token or string, "length": max_tokens)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: TokenLogprob | None = None
    """The token's log-probability under the model (when the request asks)."""


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt tokens' log-probabilities (a request with prompt_logprobs):
    None for the first token, then each token's under the model given the
    tokens before it. Sent once, before the request's first Delta."""

    entries: tuple[TokenLogprob | None, ...]


@dataclass(frozen=True)
class Done:
    """The request's last event: token counts for `usage`."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kv_transfer_params: dict | None = None
    """What a connector kept for another instance (vLLM's field)."""


@dataclass(frozen=True)
class Failed:
    """The request ended without an answer (a fault, or the engine stopped)."""

    message: str


Event = Delta | PromptLogprobs | Done | Failed
Sink = Callable[[Event], None]


@dataclass
class Sequence:
    """One generated stream: sample `sample` of `request`."""

    seq_id: str
    request: Request
    sample: int
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    """The logits each token was chosen from (kept only when the scheduler
    is asked to: the self-check replays them; a real vocabulary makes them
    200 kB a token)."""
    error: str | None = None
    """Why the request could not be served or failed."""
    rng: np.random.Generator | None = field(default=None, repr=False)
    finish_reason: str | None = None
    """"stop", "length" or "error"; None while it runs."""
    stops: StopMatcher | None = field(default=None, repr=False)
    text: Callable[[int], str] | None = field(default=None, repr=False)
    """The sample's incremental detokenizer (token -> new text)."""
    grammar: GrammarState | None = field(default=None, repr=False)
    """The sample's parse of its request's grammar."""
    last_time: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Live:
    """A submitted request's state."""

    req: Request
    sink: Sink
    order: int
    arrival: float
    stop_token_ids: frozenset[int]
    samples: list[Sequence] = field(default_factory=list)
    started: bool = False
    cached_tokens: int = 0
    holds_pages: bool = False
    kv_transfer_params: dict | None = None
    pending: dict[str, tuple[Sequence | None, list[int]]] = field(default_factory=dict)
    """What a chunked prefill has still to compute, by sequence id: the
    sample it is for (None: a new request's prompt) and the tokens after
    those the sequence holds; empty once every context is in."""

    def live_samples(self) -> list[Sequence]:
        return [s for s in self.samples if s.finish_reason is None]

    def contexts(self) -> list[tuple[Sequence | None, list[int]]]:
        """What a (re)admission prefills: the prompt once (a new request, its
        samples forked after), or each live sample's prompt + tokens."""
        if not self.started:
            return [(None, list(self.req.prompt))]
        return [(s, list(self.req.prompt) + s.tokens) for s in self.live_samples()]


@dataclass
class SchedulerStats:
    """Counters since the scheduler was made."""

    steps: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    prefill_tokens: int = 0
    """Prompt (and recomputed) tokens computed: those the prefix cache did not serve."""
    generated_tokens: int = 0
    preemptions: int = 0
    step_faults: int = 0
    last_prefill_seconds: float | None = None
    """The last step's prefill time (None: it prefilled nothing)."""
    last_decode_seconds: float | None = None
    """The last step's decode time (None: it decoded nothing)."""


@dataclass
class RunStats:
    """What `Scheduler.run` measured."""

    steps: int = 0
    prefill_tokens: int = 0
    """Prompt tokens computed (those the prefix cache did not serve)."""
    generated_tokens: int = 0
    decode_step_seconds: list[float] = field(default_factory=list)
    prefill_step_seconds: list[float] = field(default_factory=list)
    peak_used_pages: int = 0
    preemptions: int = 0
    seconds: float = 0.0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens: ceil(tokens / page_size)."""
    return -(-tokens // page_size)


def prompt_logprobs(prompt: tuple[int, ...], rows: np.ndarray, top: int) -> PromptLogprobs:
    """The PromptLogprobs of `prompt` from the logits [len(prompt), vocab]
    after each of its tokens (the last row's belong to the first generated
    token, not the prompt)."""
    logprobs = log_softmax(rows[:-1])
    entries = [None] + [
        token_logprob(logprobs[j], prompt[j + 1], top) for j in range(len(prompt) - 1)
    ]
    return PromptLogprobs(tuple(entries))


def seq_id(request: Request, sample: int) -> str:
    """The page manager's sequence id of a request's sample: "request/sample"."""
    return f"{request.request_id}/{sample}"


class Scheduler:
    """Drives an engine over submitted requests (see the module docstring).

    Parameters
    ----------
    engine : DecoderEngine
        The step graphs and the page manager they run over; the scheduler
        becomes their only user.
    eos_token_ids : frozenset of int
        Tokens that end every sample unless its request has `ignore_eos`.
    detokenizer : callable() -> callable(int) -> str, optional
        Makes one sample's incremental decoder (text each new token
        completes); without one, deltas carry no text and stop strings are
        refused.
    max_num_seqs : int
        At most this many sequences (samples) decode in one step.
    max_waiting : int, optional
        At most this many requests wait; `submit` raises `QueueFullError`
        beyond (None: unbounded).
    max_prefill_tokens : int
        Prompt tokens prefilled in one step, so that long prompts, or a
        burst of them, do not stall running streams for long: a longer
        prompt is prefilled in chunks over several steps (the module
        docstring).
    policy : str
        The queue order: "fcfs" or "priority".
    keep_logits : bool
        Keep the logits row behind every token in its `Sequence`.
    observer : object, optional
        Gets `first_token(seconds)`, `token_gap(seconds)`,
        `finished(reason)` and `step(phase, seconds)` calls (metrics; phase
        "prefill" or "decode", the engine call's time).
    grammars : Grammars, optional
        The model's grammar engine (pagedkv.graphs.structured): requests
        with a grammar are refused without one.
    connectors : sequence of KVConnector
        Where pages come from or go to besides the pool (pagedkv.graphs.
        kv_connector): a page store shared with other instances, a prefill
        instance's pages pulled over NIXL; asked in order.

    Examples
    --------
    >>> scheduler = Scheduler(llm.engine, frozenset({2}))  # doctest: +SKIP
    >>> scheduler.submit(Request("r1", (1, 2, 3), 8), print)  # doctest: +SKIP
    >>> while scheduler.has_work:  # doctest: +SKIP
    ...     scheduler.step()
    """

    def __init__(
        self,
        engine: DecoderEngine,
        eos_token_ids: frozenset[int] = frozenset(),
        detokenizer: Callable[[], Callable[[int], str]] | None = None,
        max_num_seqs: int = 64,
        max_waiting: int | None = None,
        max_prefill_tokens: int = 4096,
        policy: str = "fcfs",
        keep_logits: bool = False,
        observer=None,
        connectors: Seq[KVConnector] = (),
        grammars: Grammars | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_prefill_tokens < 1:
            raise ValueError("max_num_seqs and max_prefill_tokens must be >= 1")
        if max_waiting is not None and max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.engine = engine
        self.manager = engine.manager
        self.context = engine.config.max_positions
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenizer = detokenizer
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.policy = policy
        self.keep_logits = keep_logits
        self.observer = observer
        self.connectors = tuple(connectors)
        self.grammars = grammars
        self.stats = SchedulerStats()
        self._order = itertools.count()
        self._waiting: list[_Live] = []
        self._running: dict[str, _Live] = {}

    # -------------------------------------------------------------- queue

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def connectors_busy(self) -> bool:
        """A connector needs poll() calls even with nothing to schedule."""
        return any(c.busy for c in self.connectors)

    def poll_connectors(self) -> None:
        """Lets the connectors act on what arrived (step() does this too)."""
        for connector in self.connectors:
            connector.poll()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_prefilling(self) -> int:
        """Running requests with a context still to prefill (chunked)."""
        return sum(1 for x in self._running.values() if x.pending)

    @property
    def num_running_sequences(self) -> int:
        """Samples that decode in the next step (not those of a request
        still prefilling in chunks)."""
        return sum(len(x.live_samples()) for x in self._running.values() if not x.pending)

    def rejection(self, req: Request) -> str | None:
        """Why `req` can never be served, or None."""
        prompt = len(req.prompt)
        if prompt == 0:
            return "the prompt is empty"
        if req.max_tokens < 1 or req.n < 1:
            return "max_tokens and n must be at least 1"
        if prompt + req.max_tokens > self.context:
            return (
                f"this model's maximum context length is {self.context} tokens; the request "
                f"asks for {prompt + req.max_tokens} ({prompt} in the prompt, "
                f"{req.max_tokens} in the completion): shorten the prompt or lower max_tokens"
            )
        if req.n > self.max_num_seqs:
            return f"n is {req.n} but the scheduler decodes at most {self.max_num_seqs} sequences"
        if req.stop and self.detokenizer is None:
            return "stop strings need a scheduler with a detokenizer"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(req, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                return f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}"
        vocab = self.engine.config.vocab_size
        for token, bias in req.adjustments.logit_bias:
            if not 0 <= token < vocab:
                return f"logit_bias names token {token}, outside the vocabulary [0, {vocab})"
            if not np.isfinite(bias):
                return f"logit_bias of token {token} is not finite"
        penalties = (req.adjustments.presence_penalty, req.adjustments.frequency_penalty)
        if not all(np.isfinite(p) for p in penalties):
            return "presence_penalty and frequency_penalty must be finite"
        repetition = req.adjustments.repetition_penalty
        if not (np.isfinite(repetition) and repetition > 0):
            return f"repetition_penalty must be finite and above 0, got {repetition}"
        if any(not 0 <= token < vocab for token in req.stop_token_ids):
            return f"stop_token_ids must be token ids in [0, {vocab})"
        if not 0 <= req.min_tokens <= req.max_tokens:
            return f"min_tokens must be in [0, max_tokens = {req.max_tokens}], got {req.min_tokens}"
        if req.grammar is not None:
            if self.grammars is None:
                return "structured outputs need a scheduler with the model's grammars"
            error = self.grammars.error(req.grammar)
            if error is not None:
                return f"the response format cannot be followed: {error}"
        need = self.footprint(req)
        if need > self.manager.num_pages:
            return (
                f"the request needs {need} KV pages at its full length ({req.n} x "
                f"{prompt + req.max_tokens} tokens) but the pool holds "
                f"{self.manager.num_pages}: lower max_tokens or n, or give the cache "
                "more memory"
            )
        return None

    def footprint(self, req: Request) -> int:
        """Pages a request needs at its full length (each sample its own)."""
        return req.n * pages_for(len(req.prompt) + req.max_tokens, self.manager.page_size)

    def submit(self, req: Request, sink: Sink, arrival: float | None = None) -> None:
        """Queues `req`; its events go to `sink` (called from `step`).
        Raises RequestError when the request can never be served,
        QueueFullError when `max_waiting` requests wait already.
        `arrival` (a `time.perf_counter()` reading) dates its first token."""
        why = self.rejection(req)
        if why is not None:
            raise RequestError(why)
        if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are waiting already")
        stops = req.stop_token_ids | (frozenset() if req.ignore_eos else self.eos_token_ids)
        live = _Live(
            req, sink, next(self._order), time.perf_counter() if arrival is None else arrival, stops
        )
        bisect.insort(self._waiting, live, key=self._key)

    def cancel(self, request_id: str) -> bool:
        """Ends a request at once, releasing its pages; no event is sent.
        Returns whether it was waiting or running."""
        live = self._running.pop(request_id, None)
        if live is not None:
            self._release(live)
            if self.observer is not None:
                for _ in live.live_samples():
                    self.observer.finished("cancelled")
        before = len(self._waiting)
        self._waiting = [w for w in self._waiting if w.req.request_id != request_id]
        return live is not None or len(self._waiting) < before

    def fail_running(self, message: str) -> None:
        """Fails every running request (after a fault in a step)."""
        for live in list(self._running.values()):
            self._fail(live, message)

    def fail_all(self, message: str) -> None:
        """Fails every waiting and running request (the engine stops)."""
        self.fail_running(message)
        while self._waiting:
            self._fail(self._waiting.pop(0), message)

    def _key(self, live: _Live) -> tuple[int, int]:
        if self.policy == "priority":
            return (live.req.priority, live.order)
        return (0, live.order)

    # --------------------------------------------------------------- step

    def step(self) -> None:
        """One step: preemption, admission and prefill, one decode."""
        self.stats.steps += 1
        self.stats.last_prefill_seconds = self.stats.last_decode_seconds = None
        self.poll_connectors()
        self._preempt_for_decode()
        continuing = [x for x in self._running.values() if x.pending]
        admitted = self._admit(self.max_prefill_tokens - self._chunk_tokens(continuing))
        if admitted or continuing:
            t0 = time.perf_counter()
            self._prefill(admitted, continuing)
            self.stats.last_prefill_seconds = time.perf_counter() - t0
            if self.observer is not None:
                self.observer.step("prefill", self.stats.last_prefill_seconds)
        self._finish_ended()
        while self._running:
            # A request still prefilling a context decodes once all are in.
            batch = [
                (x, s) for x in self._running.values() if not x.pending for s in x.live_samples()
            ]
            if not batch:
                break
            t0 = time.perf_counter()
            try:
                logits = self.engine.decode(
                    [s.seq_id for _, s in batch], [s.tokens[-1] for _, s in batch]
                )
            except OutOfPagesError:
                # reserve() changed nothing: make room the way step (1) does.
                self._preempt_last()
                continue
            except Exception:
                self._publish(False)
                raise
            self._publish(True)
            self.stats.last_decode_seconds = time.perf_counter() - t0
            if self.observer is not None:
                self.observer.step("decode", self.stats.last_decode_seconds)
            # Greedy rows' choices in one pass over the batch's logits.
            best = logits.argmax(axis=1) if any(x.req.sampling.greedy for x, _ in batch) else None
            for k, ((live, s), row) in enumerate(zip(batch, logits, strict=True)):
                argmax = None if best is None else int(best[k])
                self._emit(live, s, self._choose(live, s, row, argmax), row)
            break
        self._finish_ended()

    def _finish_ended(self) -> None:
        """Finishes the running requests whose samples have all ended (not
        one still prefilling its prompt)."""
        for live in [x for x in self._running.values() if not x.live_samples() and not x.pending]:
            self._finish(live)

    def _chunk_tokens(self, continuing: list[_Live]) -> int:
        """Prompt tokens the next chunks of these prefills take this step:
        their pending tokens, in queue order, up to the step's budget."""
        pending = sum(len(tokens) for x in continuing for _, tokens in x.pending.values())
        return min(pending, self.max_prefill_tokens)

    def _publish(self, ran: bool) -> None:
        """Tells the connectors a step has run (or failed)."""
        for connector in self.connectors:
            connector.after_step(ran)

    def _decode_need(self, lives) -> int:
        """Pages the next decode step of these requests' samples takes (the
        manager's count: a page for each sample whose last page is full,
        the copies of shared partial ones); and, for a request whose prefill
        or recompute is still in chunks, the pages its chunks fill and its
        first decode after them (`_first_decode_pages`)."""
        m = self.manager
        need = 0
        decoding = []
        for live in lives:
            if not live.pending:
                decoding += [s.seq_id for s in live.live_samples()]
                continue
            # It decodes once every context is in: its first decode comes
            # after the pages its chunks fill, not at the lengths held now.
            for sid, (_, tokens) in live.pending.items():
                held = m.seq_len(sid)
                need += pages_for(held + len(tokens), m.page_size) - pages_for(held, m.page_size)
            need += self._first_decode_pages(live)
        return need + m.pages_needed(decoding, 1)

    def _first_decode_pages(self, live: _Live) -> int:
        """Pages the first decode after a (re)admission's prefill takes. A new
        request's samples share its prompt's last page: each opens a page
        where the prompt fills its last one, and otherwise all but one copy
        it (reserve's last writer keeps the original). A readmitted sample
        holds its own context and opens a page where that fills its last."""
        size = self.manager.page_size
        prompt = len(live.req.prompt)
        if not live.started:
            return live.req.n - (prompt % size != 0)
        return sum((prompt + len(s.tokens)) % size == 0 for s in live.live_samples())

    def _preempt_for_decode(self) -> None:
        """Preempts the last requests in queue order until the running ones'
        next decode fits."""
        while self._running and self._decode_need(self._running.values()) > (
            self.manager.num_free_pages
        ):
            self._preempt_last()

    def _preempt_last(self) -> None:
        """Releases the running request last in queue order and requeues it
        for recompute; the only running request is failed instead (it
        cannot fit)."""
        last = max(self._running.values(), key=self._key)
        if len(self._running) == 1:
            self._fail(last, "the KV pool cannot hold this request")
            return
        self._running.pop(last.req.request_id)
        self._release(last)
        last.pending = {}  # readmitted, it opens its contexts again
        bisect.insort(self._waiting, last, key=self._key)
        self.stats.preemptions += 1

    def _admit(self, prefill_budget: int) -> list[_Live]:
        """Takes waiting requests, first in queue order, while their prefill
        and the coming decode step fit the pool and the sequence limit, and
        their prompt tokens `prefill_budget` (the first one needs only some
        of it: `_prefill` takes its prompt in chunks). A new request whose
        first uncached page an admitted one, or a chunked prefill, computes
        is passed over this step (`_prefill_cost`)."""
        if not self._waiting:
            return []
        # A request still prefilling in chunks will decode its samples (a
        # new one forks them all).
        seqs = self.num_running_sequences + sum(
            len(x.live_samples()) if x.started else x.req.n
            for x in self._running.values()
            if x.pending
        )
        if seqs >= self.max_num_seqs:  # every waiting request has a sample to run
            return []
        size = self.manager.page_size
        budget = self.manager.num_free_pages - self._decode_need(self._running.values())
        tokens = 0
        admitted = []
        # The first pages that prefills under way compute this step: a
        # chunked prompt's next one (its chunk takes the rest of its prompt
        # whenever any budget is left for admissions).
        computing = {
            tuple(tokens[:size])
            for x in self._running.values()
            for _, tokens in x.pending.values()
            if len(tokens) > size
        }
        i = 0
        while i < len(self._waiting):
            live = self._waiting[i]
            contexts = live.contexts()
            # Its prompt (or recomputed contexts) and the first decode after
            # it; never more than the request's full length.
            need = min(
                sum(pages_for(len(c), size) for _, c in contexts) + self._first_decode_pages(live),
                self.footprint(live.req),
            )
            new_seqs = len(live.live_samples()) if live.started else live.req.n
            if need > budget or seqs + new_seqs > self.max_num_seqs or prefill_budget < 1:
                break
            new_tokens, first_page = self._prefill_cost(live, contexts)
            if admitted and tokens + new_tokens > prefill_budget:
                break
            if first_page is not None and first_page in computing:
                i += 1
                continue
            if first_page is not None:
                computing.add(first_page)
            budget -= need
            seqs += new_seqs
            tokens += new_tokens
            admitted.append(self._waiting.pop(i))
        if not admitted and not self._running and self._waiting:
            # Nothing else holds pages, so it can never fit (submit() refuses
            # such requests; this keeps the loop from spinning on one).
            self._fail(self._waiting.pop(0), "the KV pool cannot hold this request")
        return admitted

    def _prefill_cost(self, live: _Live, contexts) -> tuple[int, tuple[int, ...] | None]:
        """The tokens a request's prefill would compute now, and, for a new
        request, the tokens of the first page of them that the prefix cache
        could serve to others once computed (a full page before the prompt's
        last token), or None. Two requests with that page in common would
        compute it twice in one prefill; the second waits a step instead."""
        if live.started or live.req.prompt_logprobs is not None:
            return sum(len(c) for _, c in contexts), None
        prompt = contexts[0][1]
        size = self.manager.page_size
        # What it computes: less whole pages, and the tokens a partial hit copies.
        copied = self.manager.cached_prefix_length(prompt[:-1], partial=True)
        cached = copied - copied % size  # whole pages: a partial hit is under one
        first = tuple(prompt[cached : cached + size]) if len(prompt) - 1 - cached >= size else None
        return len(prompt) - copied, first

    def _prefill(self, admitted: list[_Live], continuing: list[_Live]) -> None:
        """Prefills in one batch the next chunks of the prompts being
        prefilled (`continuing`), then the admitted requests, within the
        step's budget (`_chunked`); each whose prompt is then in gets its
        next token (a new request's samples are forked first)."""
        for live in admitted:
            self._running[live.req.request_id] = live
        batch = continuing + admitted
        try:
            opened = [
                (x, sample, sid, tokens, False)
                for x in continuing
                for sid, (sample, tokens) in x.pending.items()
            ]
            for live in admitted:
                try:
                    opened += self._open(live)
                except KVTransferError as e:
                    self._fail(live, str(e))
            batch = [live for live in batch if live.req.request_id in self._running]
            opened = self._chunked(opened)
            if not opened:
                return
            entries = [(live, sample, sid) for live, sample, sid, _, _ in opened]
            ids = [sid for _, _, sid, _, _ in opened]
            suffixes = [suffix for _, _, _, suffix, _ in opened]
            flags = [every_row for _, _, _, _, every_row in opened]
            if any(flags):
                logits, prompt_rows = self.engine.prefill(ids, suffixes, every_row=flags)
            else:
                logits, prompt_rows = self.engine.prefill(ids, suffixes), [None] * len(ids)
            self._publish(True)
        except OutOfPagesError:
            self._publish(False)
            # The admission estimate was short: put them back, whole (the
            # next step admits fewer, down to the first alone).
            for live in [x for x in batch if x.req.request_id in self._running]:
                self._running.pop(live.req.request_id)
                self._release(live)
                live.pending = {}
                bisect.insort(self._waiting, live, key=self._key)
            if not self._running:
                self._fail(self._waiting.pop(0), "the KV pool cannot hold this request")
            return
        except Exception as e:
            self._publish(False)
            for live in [x for x in batch if x.req.request_id in self._running]:
                self._fail(live, f"internal error in a prefill: {type(e).__name__}: {e}")
            return
        self.stats.prefill_tokens += sum(len(s) for s in suffixes)
        for (live, sample, sid), row, rows in zip(entries, logits, prompt_rows, strict=True):
            if sid in live.pending:  # a chunk within a context: no token yet
                continue
            if sample is not None:  # a resumed sample continues where it stopped
                self._emit(live, sample, self._choose(live, sample, row), row)
                continue
            live.started = True
            req = live.req
            if rows is not None:
                self._send(live, prompt_logprobs(req.prompt, rows, req.prompt_logprobs))
            # Every sample is forked before any is emitted: a sample whose
            # first token ends it releases its pages at once, and the
            # others fork from sample 0's.
            for k in range(req.n):
                sid = seq_id(req, k)
                if k > 0:
                    self.manager.fork(seq_id(req, 0), sid)
                seed = None if req.sampling.seed is None else [req.sampling.seed, k]
                live.samples.append(
                    Sequence(
                        sid,
                        req,
                        k,
                        rng=None if req.sampling.greedy else np.random.default_rng(seed),
                        stops=StopMatcher(req.stop),
                        text=self.detokenizer() if self.detokenizer is not None else None,
                        grammar=self.grammars.start(req.grammar) if req.grammar else None,
                    )
                )
            first = req.adjustments.apply(row, [], req.prompt) if req.adjustments.active else row
            if req.grammar is not None:  # every sample's parse is at its start
                first = live.samples[0].grammar.mask(first)
            if req.min_tokens > 0:
                first = _held_stops(first, live.stop_token_ids)
            ranked = greedy_tokens(first, req.n) if req.sampling.greedy else None
            for k, s in enumerate(live.samples):
                token = (
                    int(ranked[k])
                    if ranked is not None
                    else sample_token(first, req.sampling, s.rng)
                )
                self._emit(live, s, token, row)

    def _chunked(self, opened: list) -> list:
        """`_open`'s entries cut to the step's prefill budget, in order: a
        context (a new prompt, or a preempted sample's prompt + tokens) is
        taken as far as the budget lasts, in whole pages, the rest kept in
        its request's `pending` for the next steps (all of it where nothing
        is left); a prompt asking for prompt logprobs is taken whole
        (admission made it fit)."""
        left, taken = self.max_prefill_tokens, []
        size = self.manager.page_size
        for live, sample, sid, suffix, every_row in opened:
            if not every_row:
                cut = max(min(len(suffix), left), 0)
                if cut < len(suffix):
                    # Chunks end on page boundaries, so that each fills whole
                    # pages and where a prompt is cut does not depend on its
                    # batch (its first may start mid-page, after a partial
                    # prefix hit); a budget that reaches no boundary is taken
                    # as it is when nothing else uses it.
                    end = self.manager.seq_len(sid) + cut
                    whole = max(cut - end % size, 0)
                    cut = whole if whole or left < self.max_prefill_tokens else cut
                suffix, rest = suffix[:cut], suffix[cut:]
                if rest:
                    live.pending[sid] = (sample, rest)
                else:
                    live.pending.pop(sid, None)
                if not suffix:
                    continue
            left -= len(suffix)
            taken.append((live, sample, sid, suffix, every_row))
        return taken

    def _open(self, live: _Live) -> list[tuple[_Live, Sequence | None, str, list[int], bool]]:
        """Adds the request's sequences to the manager (prefix hits, then
        what the connectors bring): (live, sample, seq id, tokens to
        prefill, every_row) for each. Raises KVTransferError when a
        connector cannot bring what the request names."""
        opened = []
        for sample, context in live.contexts():
            sid = sample.seq_id if sample is not None else seq_id(live.req, 0)
            # The last token is always computed: its logits give the next
            # one; prompt logprobs need every prompt token's.
            every_row = sample is None and live.req.prompt_logprobs is not None
            cached = self.manager.add(sid, [] if every_row else context[:-1])
            live.holds_pages = True
            if not every_row:
                for connector in self.connectors:
                    cached = connector.fetch(sid, context[:-1], cached, live.req)
                # Safe here: every token reserved so far has been appended.
                cached += self.manager.copy_partial_hit(sid)
            if sample is None:
                live.cached_tokens = cached
                self.stats.prompt_tokens += len(context)
                self.stats.prompt_tokens_cached += cached
            opened.append((live, sample, sid, context[cached:], every_row))
        return opened

    @staticmethod
    def _choose(live: _Live, s: Sequence, row: np.ndarray, argmax: int | None = None) -> int:
        """The sample's next token from the model's logits row [vocab];
        argmax: np.argmax(row) where the caller has it."""
        req = live.req
        if req.adjustments.active:
            row, argmax = req.adjustments.apply(row, s.tokens, req.prompt), None
        if s.grammar is not None:
            row, argmax = s.grammar.mask(row), None
        if len(s.tokens) < req.min_tokens:
            row, argmax = _held_stops(row, live.stop_token_ids), None
        if argmax is not None and req.sampling.greedy:
            return argmax
        return sample_token(row, req.sampling, s.rng)

    def _emit(self, live: _Live, s: Sequence, token: int, row: np.ndarray) -> None:
        """Appends a chosen token to a sample and hands out its text; a
        sample that ends releases its pages at once."""
        now = time.perf_counter()
        if self.observer is not None:
            if s.tokens:
                self.observer.token_gap(now - s.last_time)
            elif s.sample == 0:
                self.observer.first_token(now - live.arrival)
        s.last_time = now
        s.tokens.append(token)
        if self.keep_logits:
            s.logits.append(row)
        self.stats.generated_tokens += 1
        text = s.stops.push(s.text(token)) if s.text is not None else ""
        # A grammar ends its sample where its text is complete (or, never
        # from masked logits, where it refuses the token).
        grammar_goes_on = s.grammar is None or (s.grammar.advance(token) and not s.grammar.complete)
        if s.stops.stopped or token in live.stop_token_ids or not grammar_goes_on:
            s.finish_reason = "stop"
        elif len(s.tokens) >= live.req.max_tokens:
            s.finish_reason = "length"
        if s.finish_reason is not None:
            text += s.stops.flush()
            if s.seq_id in self.manager:
                for connector in self.connectors:
                    kept = connector.on_finish(live.req, s.seq_id)
                    live.kv_transfer_params = kept or live.kv_transfer_params
                self.manager.release(s.seq_id)
        logprob = None
        if live.req.logprobs is not None:
            logprob = token_logprob(log_softmax(row), token, live.req.logprobs)
        self._send(live, Delta(s.sample, text, (token,), s.finish_reason, logprob))

    def _finish(self, live: _Live) -> None:
        del self._running[live.req.request_id]
        self._release(live)
        done = Done(
            len(live.req.prompt),
            sum(len(s.tokens) for s in live.samples),
            live.cached_tokens,
            live.kv_transfer_params,
        )
        self._send(live, done)
        if self.observer is not None:
            for s in live.samples:
                self.observer.finished(s.finish_reason or "length")

    def _fail(self, live: _Live, message: str) -> None:
        self._running.pop(live.req.request_id, None)
        self._release(live)
        for s in live.samples:
            if s.finish_reason is None:
                s.finish_reason, s.error = "error", message
        self._send(live, Failed(message))
        if self.observer is not None:
            self.observer.finished("error")

    def _release(self, live: _Live) -> None:
        """Releases every page the request's samples hold."""
        if not live.holds_pages:
            return
        for sid in [seq_id(live.req, k) for k in range(live.req.n)]:
            if sid in self.manager:
                self.manager.release(sid)
        live.holds_pages = False

    @staticmethod
    def _send(live: _Live, event: Event) -> None:
        try:
            live.sink(event)
        except Exception:  # a consumer that went away must not stop the scheduler
            log.debug("dropped an event of %s", live.req.request_id, exc_info=True)

    # ---------------------------------------------------------------- run

    def capped(self, r: Request) -> Request:
        """The request with its token limit cut where the model's context ends
        (a prompt that fits leaves room for at least one token)."""
        room = self.context - len(r.prompt)
        return replace(r, max_tokens=max(1, min(r.max_tokens, room)))

    def run(
        self,
        requests: list[Request],
        on_step: Callable[[int, int, int], None] | None = None,
        on_token: Callable[[Sequence, int], None] | None = None,
    ) -> tuple[list[Sequence], RunStats]:
        """Serves every request to completion, each submitted at its
        `arrival_step` with its token limit capped at the context; returns
        the sequences (in request order, samples in order) and the run's
        statistics. A request that can never be served gets sequences with
        `error` set and no tokens; the others are served.

        on_step(step, tokens generated so far, running sequences) is called
        after every step (a progress display); on_token(sequence, token)
        after every generated token (streaming).
        """
        requests = [self.capped(r) for r in requests]
        results: dict[str, list[Sequence]] = {}
        pending = sorted(requests, key=lambda r: r.arrival_step)
        run = RunStats()
        start = (self.stats.prefill_tokens, self.stats.generated_tokens, self.stats.preemptions)
        t_begin = time.perf_counter()

        errors: list[BaseException] = []

        def submit(r: Request) -> None:
            live_box: list[_Live] = []

            def sink(event: Event) -> None:
                live = live_box[0]
                try:
                    if isinstance(event, Delta) and on_token is not None:
                        on_token(live.samples[event.index], event.token_ids[-1])
                except BaseException as e:  # noqa: BLE001 - raised after the step
                    errors.append(e)
                if isinstance(event, Done):
                    results[r.request_id] = live.samples
                elif isinstance(event, Failed):
                    results[r.request_id] = live.samples or [
                        Sequence(seq_id(r, k), r, k, error=event.message, finish_reason="error")
                        for k in range(r.n)
                    ]

            try:
                self.submit(r, sink)
            except RequestError as e:
                results[r.request_id] = [
                    Sequence(seq_id(r, k), r, k, error=str(e), finish_reason="error")
                    for k in range(r.n)
                ]
                return
            live_box.append(next(x for x in self._waiting if x.req is r))

        step = 0
        while pending or self.has_work:
            while pending and pending[0].arrival_step <= step:
                submit(pending.pop(0))
            if self.has_work:
                self.step()
                if self.stats.last_prefill_seconds is not None:
                    run.prefill_step_seconds.append(self.stats.last_prefill_seconds)
                if self.stats.last_decode_seconds is not None:
                    run.decode_step_seconds.append(self.stats.last_decode_seconds)
            run.peak_used_pages = max(run.peak_used_pages, self.manager.num_used_pages)
            step += 1
            if errors:
                self.fail_all("the run stopped: a callback raised")
                raise errors[0]
            if on_step is not None:
                on_step(step, self.stats.generated_tokens - start[1], self.num_running_sequences)
        run.steps = step
        run.seconds = time.perf_counter() - t_begin
        run.prefill_tokens = self.stats.prefill_tokens - start[0]
        run.generated_tokens = self.stats.generated_tokens - start[1]
        run.preemptions = self.stats.preemptions - start[2]
        return [s for r in requests for s in results[r.request_id]], run


def _held_stops(row: np.ndarray, stops: frozenset[int]) -> np.ndarray:
    """row [vocab] with the stop tokens at -inf (a new array), so that a
    sample under `min_tokens` goes on; row itself where nothing else is
    allowed (a grammar that lets only a stop token come ends the sample)."""
    held = row.copy()
    held[list(stops)] = -np.inf
    return held if np.isfinite(held).any() else row
