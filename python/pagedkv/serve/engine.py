"""The serving engine: one scheduler thread owns the page manager and the step
graphs; any thread submits requests and reads their streamed output.

Every step the thread (1) applies cancellations (a cancelled request's pages
are released at once), (2) preempts the newest running requests while the
coming decode step would need more pages than the pool can give, (3) admits
waiting requests, oldest first, while the pool and `max_num_seqs` have room,
prefilling them in one batch, (4) decodes one token for every running
sequence in one batch, streaming each token's text as it is chosen.

Admission is optimistic: a request is admitted when its prompt (not its full
length) fits, so more requests share the pool than their worst cases allow.
When a decode step would run out, the newest running request is preempted by
recompute: its pages are released (full pages stay in the prefix cache), it
goes back to the head of the waiting queue, and when readmitted its samples
are prefilled again from prompt + tokens generated so far, continuing where
they stopped (sampling generators keep their state). Output already streamed
is never taken back. A request whose full length cannot fit the whole pool
is refused at submission, so the oldest request always makes progress.

`n` samples of a request are forked after its prefill and share the
prompt's pages (copy-on-write on the last, partial one). A greedy request's
sample k starts from the k-th most likely first token, as
`pagedkv.graphs.scheduler` does; sampled ones draw from generators seeded
with (seed, k).

The waiting queue is bounded: `submit` raises `QueueFullError` when
`max_waiting` requests wait. A fault in a step fails the requests of that
step (their pages released) and the engine goes on serving.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedkv.graphs.sampling import SamplingParams, sample_token
from pagedkv.graphs.scheduler import pages_for
from pagedkv.manager import OutOfPagesError
from pagedkv.models.tokenizer import TextStream

from .stop_strings import StopMatcher

log = logging.getLogger("pagedkv.serve")


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting` requests: try again later."""


class RequestError(ValueError):
    """A request that can never be served (its message names the limit)."""


@dataclass(frozen=True)
class GenerationRequest:
    """What a client asks the engine for.

    prompt: token ids (at least one). max_tokens: generated tokens per sample,
    at most the context left after the prompt. n: samples sharing the prompt.
    stop: strings that end a sample (left out of its text). ignore_eos: the
    model's EOS does not end a sample (it is generated as any token).
    """

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Delta:
    """New text of sample `index`; finish_reason is set on its last delta
    ("stop": EOS or a stop string, "length": max_tokens)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


@dataclass(frozen=True)
class Done:
    """The request's last event: token counts for `usage`."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Failed:
    """The request ended without an answer (a fault, or the engine stopped)."""

    message: str


Event = Delta | Done | Failed
Sink = Callable[[Event], None]


@dataclass
class EngineStats:
    """A consistent snapshot the engine thread publishes after every step."""

    running: int = 0
    """Running requests (holding pages)."""
    waiting: int = 0
    """Requests waiting for admission (new or preempted)."""
    running_sequences: int = 0
    pages_total: int = 0
    pages_used: int = 0
    pages_free: int = 0
    pages_cached: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    step_faults: int = 0


@dataclass
class _Sample:
    """One sample's state, owned by the engine thread."""

    index: int
    sid: str
    rng: np.random.Generator | None
    stops: StopMatcher
    text: TextStream
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    last_time: float = 0.0


@dataclass
class _Live:
    """A submitted request's state, owned by the engine thread."""

    req: GenerationRequest
    sink: Sink
    order: int
    arrival: float
    stop_token_ids: frozenset[int]
    """Tokens that end a sample: the model's EOS, none with ignore_eos."""
    samples: list[_Sample] = field(default_factory=list)
    started: bool = False
    cached_tokens: int = 0
    holds_pages: bool = False

    def live_samples(self) -> list[_Sample]:
        return [s for s in self.samples if s.finish_reason is None]

    def contexts(self) -> list[tuple[_Sample | None, list[int]]]:
        """What a (re)admission prefills: the prompt once (a new request, its
        samples forked after), or each live sample's prompt + tokens."""
        if not self.started:
            return [(None, list(self.req.prompt))]
        return [(s, list(self.req.prompt) + s.tokens) for s in self.live_samples()]


class ServingEngine:
    """Runs an `LLM`'s engine on a scheduler thread (see the module docstring).

    Parameters
    ----------
    llm : pagedkv.models.LLM
        The model; the engine thread becomes the only user of its manager
        and step graphs.
    max_num_seqs : int
        At most this many sequences (samples) decode in one step.
    max_waiting : int
        At most this many requests wait for admission; more are refused.
    max_prefill_tokens : int
        Prompt tokens prefilled in one step (beyond one request), so that a
        burst of long prompts does not stall the running streams for long.
    observer : object, optional
        Gets `first_token(seconds)`, `token_gap(seconds)` and
        `finished(reason)` calls from the engine thread (metrics).

    Examples
    --------
    >>> engine = ServingEngine(pagedkv.models.load())  # doctest: +SKIP
    >>> engine.start()  # doctest: +SKIP
    >>> engine.submit(GenerationRequest("r1", (1, 2, 3), 8), print)  # doctest: +SKIP
    """

    def __init__(
        self,
        llm,
        max_num_seqs: int = 64,
        max_waiting: int = 256,
        max_prefill_tokens: int = 4096,
        observer=None,
    ) -> None:
        if max_num_seqs < 1 or max_waiting < 1 or max_prefill_tokens < 1:
            raise ValueError("max_num_seqs, max_waiting and max_prefill_tokens must be >= 1")
        self.llm = llm
        self.engine = llm.engine
        self.manager = llm.manager
        self.tokenizer = llm.tokenizer
        self.context = llm.config.max_positions
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.observer = observer
        self.stop_token_ids = frozenset({self.tokenizer.eos_token_id})
        self.stats = EngineStats(pages_total=self.manager.num_pages)
        self._lock = threading.Condition()
        self._inbox: list[_Live] = []
        self._cancels: set[str] = set()
        self._stopping = False
        self._waiting_count = 0
        self._order = itertools.count()
        # Owned by the engine thread.
        self._waiting: list[_Live] = []
        self._running: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self.cancels_received = 0
        """cancel() calls so far (tests wait on it)."""
        self.fatal: str | None = None
        """Why the engine thread ended, if it did (the server is then unhealthy)."""

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        """Starts the scheduler thread."""
        self._thread = threading.Thread(target=self._main, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fails what is waiting or running, releases its pages and ends the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    def rejection(self, req: GenerationRequest) -> str | None:
        """Why `req` can never be served, or None."""
        prompt = len(req.prompt)
        if prompt == 0:
            return "the prompt is empty"
        if prompt + req.max_tokens > self.context:
            return (
                f"this model's maximum context length is {self.context} tokens; the request "
                f"asks for {prompt + req.max_tokens} ({prompt} in the prompt, "
                f"{req.max_tokens} in the completion): shorten the prompt or lower max_tokens"
            )
        if req.n > self.max_num_seqs:
            return f"n is {req.n} but the server decodes at most {self.max_num_seqs} sequences"
        need = req.n * pages_for(prompt + req.max_tokens, self.manager.page_size)
        if need > self.manager.num_pages:
            return (
                f"the request needs {need} KV pages at its full length ({req.n} x "
                f"{prompt + req.max_tokens} tokens) but the pool holds "
                f"{self.manager.num_pages}: lower max_tokens or n, or start the server "
                "with more --kv-memory"
            )
        return None

    def submit(self, req: GenerationRequest, sink: Sink) -> None:
        """Queues `req`; its events go to `sink` (called from the engine
        thread: it must not block). Raises RequestError when the request can
        never be served, QueueFullError when the waiting queue is full,
        RuntimeError when the engine is not running."""
        why = self.rejection(req)
        if why is not None:
            raise RequestError(why)
        with self._lock:
            if self._stopping or not self.alive:
                raise RuntimeError(f"the engine is not running: {self.fatal or 'stopped'}")
            if len(self._inbox) + self._waiting_count >= self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests are waiting already")
            stops = frozenset() if req.ignore_eos else self.stop_token_ids
            self._inbox.append(_Live(req, sink, next(self._order), time.perf_counter(), stops))
            self._idle.clear()
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        """Ends a request (its client went away): its pages are released at
        the start of the next step. Unknown or finished ids are ignored."""
        with self._lock:
            self._cancels.add(request_id)
            self.cancels_received += 1
            self._lock.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until nothing is queued, waiting or running; True if so."""
        return self._idle.wait(timeout)

    # --------------------------------------------------------- engine thread

    def _main(self) -> None:
        try:
            while True:
                with self._lock:
                    while (
                        not (self._stopping or self._inbox or self._cancels or self._waiting)
                        and not self._running
                    ):
                        self._publish()
                        self._idle.set()
                        self._lock.wait()
                    if self._stopping:
                        break
                    for live in self._inbox:
                        bisect.insort(self._waiting, live, key=lambda x: x.order)
                    self._inbox.clear()
                    cancels, self._cancels = self._cancels, set()
                self._cancel(cancels)
                try:
                    self._step()
                except Exception as e:  # a fault fails the step's requests, not the server
                    log.exception("step failed")
                    self.stats.step_faults += 1
                    for live in list(self._running.values()):
                        self._fail(live, f"internal error in a step: {type(e).__name__}: {e}")
                with self._lock:
                    self._publish()
        except BaseException as e:  # noqa: BLE001 - recorded for /health
            self.fatal = f"{type(e).__name__}: {e}"
            log.exception("engine thread died")
        finally:
            with self._lock:
                self._stopping = True
                pending = self._inbox + self._waiting + list(self._running.values())
                self._inbox, self._waiting = [], []
            for live in pending:
                self._fail(live, "the server is shutting down")
            with self._lock:
                self._publish()
            self._idle.set()

    def _publish(self) -> None:
        """Copies the manager's figures into `stats` (under the lock)."""
        m, s = self.manager, self.stats
        s.running = len(self._running)
        s.waiting = len(self._waiting) + len(self._inbox)
        self._waiting_count = len(self._waiting)
        s.running_sequences = sum(len(x.live_samples()) for x in self._running.values())
        s.pages_used, s.pages_free, s.pages_cached = (
            m.num_used_pages,
            m.num_free_pages - m.num_cached_pages,
            m.num_cached_pages,
        )
        s.prefix_hits, s.prefix_misses = m.stats.prefix_hits, m.stats.prefix_misses

    def _cancel(self, ids: set[str]) -> None:
        for rid in ids:
            live = self._running.pop(rid, None)
            if live is not None:
                self._release(live)
            self._waiting = [w for w in self._waiting if w.req.request_id != rid]
            if live is not None and self.observer is not None:
                for _ in live.live_samples():
                    self.observer.finished("cancelled")

    def _step(self) -> None:
        self.stats.steps += 1
        self._preempt_for_decode()
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        for live in [x for x in self._running.values() if not x.live_samples()]:
            self._finish(live)
        while self._running:
            batch = [(x, s) for x in self._running.values() for s in x.live_samples()]
            try:
                logits = self.engine.decode(
                    [s.sid for _, s in batch], [s.tokens[-1] for _, s in batch]
                )
            except OutOfPagesError:
                # reserve() changed nothing: make room the way step (2) does.
                self._preempt_newest()
                continue
            for (live, s), row in zip(batch, logits, strict=True):
                self._emit(live, s, sample_token(row, live.req.sampling, s.rng), row)
            break
        for live in [x for x in self._running.values() if not x.live_samples()]:
            self._finish(live)

    def _decode_need(self, lives) -> int:
        """Pages the next decode step of these requests' samples may take:
        one per sample whose last page is full or shared (copy-on-write)."""
        m, refcounts = self.manager, self.manager.refcounts()
        need = 0
        for live in lives:
            for s in live.live_samples():
                n = m.seq_len(s.sid)
                if n % m.page_size == 0 or refcounts[m.pages(s.sid)[-1]] > 1:
                    need += 1
        return need

    def _preempt_for_decode(self) -> None:
        """Preempts the newest requests until the running ones' next decode fits."""
        while self._running and self._decode_need(self._running.values()) > (
            self.manager.num_free_pages
        ):
            self._preempt_newest()

    def _preempt_newest(self) -> None:
        """Releases the newest running request's pages and requeues it for
        recompute; the only running request is failed instead (it cannot fit)."""
        newest = max(self._running.values(), key=lambda x: x.order)
        if len(self._running) == 1:
            self._fail(newest, "the KV pool cannot hold this request")
            return
        self._running.pop(newest.req.request_id)
        self._release(newest)
        bisect.insort(self._waiting, newest, key=lambda x: x.order)
        self.stats.preemptions += 1

    def _admit(self) -> list[_Live]:
        """Takes waiting requests, oldest first, while their prefill and the
        coming decode step fit the pool and the sequence limit."""
        size = self.manager.page_size
        budget = self.manager.num_free_pages - self._decode_need(self._running.values())
        seqs = sum(len(x.live_samples()) for x in self._running.values())
        tokens = 0
        admitted = []
        while self._waiting:
            live = self._waiting[0]
            contexts = live.contexts()
            # Each sample's first decode may open a page or copy the shared
            # one; never more than the request's full length.
            need = min(
                sum(pages_for(len(c), size) for _, c in contexts) + live.req.n,
                live.req.n * pages_for(len(live.req.prompt) + live.req.max_tokens, size),
            )
            new_seqs = len(live.live_samples()) if live.started else live.req.n
            new_tokens = sum(len(c) for _, c in contexts)
            if need > budget or seqs + new_seqs > self.max_num_seqs:
                break
            if admitted and tokens + new_tokens > self.max_prefill_tokens:
                break
            budget -= need
            seqs += new_seqs
            tokens += new_tokens
            admitted.append(self._waiting.pop(0))
        if not admitted and not self._running and self._waiting:
            # Nothing else holds pages, so it can never fit (submit() refuses
            # such requests; this keeps the loop from spinning on one).
            self._fail(self._waiting.pop(0), "the KV pool cannot hold this request")
        return admitted

    def _prefill(self, admitted: list[_Live]) -> None:
        """Prefills the admitted requests in one batch; each gets its next
        token (a new request's samples are forked first)."""
        entries = []  # (live, the resumed sample or None for a new request)
        ids, suffixes = [], []
        for live in admitted:
            self._running[live.req.request_id] = live
        try:
            for live in admitted:
                for sample, context in live.contexts():
                    sid = sample.sid if sample is not None else f"{live.req.request_id}/0"
                    # The last token is always computed: its logits give the next one.
                    cached = self.manager.add(sid, context[:-1])
                    live.holds_pages = True
                    if sample is None:
                        live.cached_tokens = cached
                        self.stats.prompt_tokens += len(context)
                        self.stats.prompt_tokens_cached += cached
                    entries.append((live, sample))
                    ids.append(sid)
                    suffixes.append(context[cached:])
            logits = self.engine.prefill(ids, suffixes)
        except OutOfPagesError:
            # The admission estimate was short: put them back, whole (the
            # next step admits fewer, down to the oldest alone).
            for live in admitted:
                self._running.pop(live.req.request_id)
                self._release(live)
                bisect.insort(self._waiting, live, key=lambda x: x.order)
            if not self._running:
                self._fail(self._waiting.pop(0), "the KV pool cannot hold this request")
            return
        except Exception as e:
            for live in admitted:
                self._fail(live, f"internal error in a prefill: {type(e).__name__}: {e}")
            return
        for (live, sample), row in zip(entries, logits, strict=True):
            if sample is not None:  # a resumed sample continues where it stopped
                self._emit(live, sample, sample_token(row, live.req.sampling, sample.rng), row)
                continue
            live.started = True
            req = live.req
            ranked = np.argsort(-row, kind="stable") if req.sampling.greedy else None
            for k in range(req.n):
                sid = f"{req.request_id}/{k}"
                if k > 0:
                    self.manager.fork(f"{req.request_id}/0", sid)
                seed = None if req.sampling.seed is None else [req.sampling.seed, k]
                s = _Sample(
                    k,
                    sid,
                    None if ranked is not None else np.random.default_rng(seed),
                    StopMatcher(req.stop),
                    TextStream(self.tokenizer),
                )
                live.samples.append(s)
                token = (
                    int(ranked[k]) if ranked is not None else sample_token(row, req.sampling, s.rng)
                )
                self._emit(live, s, token, row)

    def _emit(self, live: _Live, s: _Sample, token: int, row: np.ndarray) -> None:
        """Appends a chosen token to a sample and streams its text; a sample
        that ends releases its pages at once."""
        now = time.perf_counter()
        if self.observer is not None:
            if s.tokens:
                self.observer.token_gap(now - s.last_time)
            elif s.index == 0:
                self.observer.first_token(now - live.arrival)
        s.last_time = now
        s.tokens.append(token)
        self.stats.generated_tokens += 1
        text = s.stops.push(s.text.push(token))
        if s.stops.stopped or token in live.stop_token_ids:
            s.finish_reason = "stop"
        elif len(s.tokens) >= live.req.max_tokens:
            s.finish_reason = "length"
        if s.finish_reason is not None:
            text += s.stops.flush()
            if s.sid in self.manager:
                self.manager.release(s.sid)
        if text or s.finish_reason is not None:
            self._send(live, Delta(s.index, text, (token,), s.finish_reason))

    def _finish(self, live: _Live) -> None:
        del self._running[live.req.request_id]
        self._release(live)
        done = Done(
            len(live.req.prompt), sum(len(s.tokens) for s in live.samples), live.cached_tokens
        )
        self._send(live, done)
        if self.observer is not None:
            for s in live.samples:
                self.observer.finished(s.finish_reason or "length")

    def _fail(self, live: _Live, message: str) -> None:
        self._running.pop(live.req.request_id, None)
        self._release(live)
        self._send(live, Failed(message))
        if self.observer is not None:
            self.observer.finished("error")

    def _release(self, live: _Live) -> None:
        """Releases every page the request's samples hold."""
        if not live.holds_pages:
            return
        rid = live.req.request_id
        for sid in [f"{rid}/{k}" for k in range(live.req.n)]:
            if sid in self.manager:
                self.manager.release(sid)
        live.holds_pages = False

    @staticmethod
    def _send(live: _Live, event: Event) -> None:
        try:
            live.sink(event)
        except Exception:  # a consumer that went away must not stop the engine
            log.debug("dropped an event of %s", live.req.request_id, exc_info=True)
