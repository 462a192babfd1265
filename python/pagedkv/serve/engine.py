"""The serving engine: the scheduler (`pagedkv.graphs.scheduler`) on a thread
of its own; any thread submits requests and reads their streamed output.

The engine thread owns the scheduler, and through it the page manager and
the step graphs. Every turn it moves submitted requests and cancellations
into the scheduler and runs one `Scheduler.step()`; after each step it
publishes `stats`, a consistent snapshot other threads read (the metrics
endpoint, health). A cancelled request's pages are released before the next
step. The waiting queue is bounded: `submit` raises `QueueFullError` when
`max_waiting` requests wait. A fault in a step fails the requests of that
step (their pages released) and the engine goes on serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.graphs.scheduler import (
    Delta,
    Done,
    Event,
    Failed,
    QueueFullError,
    RequestError,
    Scheduler,
    Sink,
)
from pagedkv.graphs.scheduler import Request as GenerationRequest
from pagedkv.models.tokenizer import TextStream
from pagedkv.runtime import name_os_thread

log = logging.getLogger("pagedkv.serve")

CONNECTOR_POLL_SECONDS = 0.02
"""How often an idle engine lets busy connectors act (pages held for a puller)."""
DEFAULT_MAX_NUM_SEQS = 64
"""`ServingEngine`'s max_num_seqs (and `pagedkv serve`'s)."""
DEFAULT_MAX_WAITING = 256
"""`ServingEngine`'s max_waiting (and `pagedkv serve`'s)."""
DEFAULT_MAX_PREFILL_TOKENS = 512
"""`ServingEngine`'s max_prefill_tokens (and `pagedkv serve`'s)."""

__all__ = [
    "Delta",
    "Done",
    "EngineStats",
    "Event",
    "Failed",
    "GenerationRequest",
    "QueueFullError",
    "RequestError",
    "ServingEngine",
]


@dataclass
class EngineStats:
    """A consistent snapshot the engine thread publishes after every step."""

    running: int = 0
    """Running requests (holding pages)."""
    prefilling: int = 0
    """Running requests with a prompt (or a recompute) prefilled in chunks."""
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


class ServingEngine:
    """Runs an `LLM`'s scheduler on a thread (see the module docstring).

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
        Prompt tokens prefilled in one step, so that long prompts, or a
        burst of them, do not stall the running streams for long: a longer
        prompt is prefilled in chunks over several steps. The default, 512
        (llama.cpp's default micro-batch), keeps a stream's longest gap
        under a second on 2 cores at no cost in throughput
        (docs/serving.md, "Chunked prefill"); `LLM.generate`'s scheduler
        takes 4096.
    policy : str
        The scheduler's queue order: "fcfs" or "priority".
    observer : object, optional
        Gets `first_token(seconds)`, `token_gap(seconds)`,
        `finished(reason)` and `step(phase, seconds)` calls from the engine
        thread (metrics).
    connectors : sequence of pagedkv.graphs.kv_connector.KVConnector
        Where pages come from or go to besides the pool (a shared page
        store, a prefill instance over NIXL; see the scheduler).

    Examples
    --------
    >>> engine = ServingEngine(pagedkv.models.load())  # doctest: +SKIP
    >>> engine.start()  # doctest: +SKIP
    >>> engine.submit(GenerationRequest("r1", (1, 2, 3), 8), print)  # doctest: +SKIP
    """

    def __init__(
        self,
        llm,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_waiting: int = DEFAULT_MAX_WAITING,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        policy: str = "fcfs",
        observer=None,
        connectors=(),
    ) -> None:
        if max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        self.llm = llm
        self.manager = llm.manager
        self.tokenizer = llm.tokenizer
        self.context = llm.config.max_positions
        self.max_waiting = max_waiting
        self.scheduler = Scheduler(
            llm.engine,
            eos_token_ids=self.tokenizer.stop_ids,
            detokenizer=lambda: TextStream(self.tokenizer).push,
            max_num_seqs=max_num_seqs,
            max_prefill_tokens=max_prefill_tokens,
            policy=policy,
            observer=observer,
            connectors=connectors,
            grammars=llm.grammars,
        )
        self.max_num_seqs = max_num_seqs
        self.kv_transfer = next((c for c in connectors if c.transfer_role), None)
        """The connector that moves pages between instances (None: none)."""
        self.stats = EngineStats(pages_total=self.manager.num_pages)
        self._lock = threading.Condition()
        self._inbox: list[tuple[GenerationRequest, Sink, float]] = []
        self._cancels: set[str] = set()
        self._between: list[tuple[Callable[[], object], list, threading.Event]] = []
        self._stopping = False
        self._waiting_count = 0
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self.cancels_received = 0
        """cancel() calls so far (tests wait on it)."""
        self.fatal: str | None = None
        """Why the engine thread ended, if it did (the server is then unhealthy)."""

    @property
    def engine(self):
        """The step graphs the scheduler drives (tests wrap them)."""
        return self.scheduler.engine

    @engine.setter
    def engine(self, value) -> None:
        self.scheduler.engine = value

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        """Starts the engine thread."""
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
        return self.scheduler.rejection(req)

    def submit(self, req: GenerationRequest, sink: Sink) -> None:
        """Queues `req`; its events go to `sink` (called from the engine
        thread: it must not block). Raises RequestError when the request can
        never be served, QueueFullError when the waiting queue is full,
        RuntimeError when the engine is not running."""
        why = self.rejection(req)
        if why is not None:
            raise RequestError(why)

        def forward(event: Event) -> None:
            # A delta of no text that ends nothing and carries no logprob
            # tells a client nothing.
            if (
                isinstance(event, Delta)
                and not event.text
                and event.finish_reason is None
                and event.logprobs is None
            ):
                return
            sink(event)

        with self._lock:
            if self._stopping or not self.alive:
                raise RuntimeError(f"the engine is not running: {self.fatal or 'stopped'}")
            if len(self._inbox) + self._waiting_count >= self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests are waiting already")
            self._inbox.append((req, forward, time.perf_counter()))
            self._idle.clear()
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        """Ends a request (its client went away): its pages are released at
        the start of the next step, and no more events are sent."""
        with self._lock:
            self.cancels_received += 1
            self._cancels.add(request_id)
            self._lock.notify_all()

    def between_steps(self, fn: Callable[[], object], timeout: float = 60.0) -> object:
        """Runs fn() on the engine thread between two steps (where the page
        manager may be read: its validator, its counts) and returns its
        result; raises what fn raised, or TimeoutError."""
        box: list = []
        done = threading.Event()
        with self._lock:
            if self._stopping or not self.alive:
                raise RuntimeError(f"the engine is not running: {self.fatal or 'stopped'}")
            self._between.append((fn, box, done))
            self._lock.notify_all()
        if not done.wait(timeout):
            raise TimeoutError("the engine thread did not reach a step boundary")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until nothing is waiting or running; returns whether it is so."""
        return self._idle.wait(timeout)

    # --------------------------------------------------------- engine thread

    def _main(self) -> None:
        name_os_thread(threading.current_thread().name)
        scheduler = self.scheduler
        try:
            while True:
                with self._lock:
                    while not (
                        self._stopping
                        or self._inbox
                        or self._cancels
                        or self._between
                        or scheduler.has_work
                    ):
                        self._publish()
                        self._idle.set()
                        if scheduler.connectors_busy:
                            self._lock.wait(CONNECTOR_POLL_SECONDS)
                            break
                        self._lock.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, set()
                    between, self._between = self._between, []
                for fn, box, done in between:
                    try:
                        box.append((True, fn()))
                    except Exception as e:  # handed back to the caller
                        box.append((False, e))
                    done.set()
                for req, sink, arrival in inbox:
                    try:
                        scheduler.submit(req, sink, arrival)
                    except (RequestError, QueueFullError) as e:
                        sink(Failed(str(e)))
                for rid in cancels:
                    scheduler.cancel(rid)
                if not scheduler.has_work and scheduler.connectors_busy:
                    scheduler.poll_connectors()
                if scheduler.has_work:
                    try:
                        scheduler.step()
                    except Exception as e:  # a fault fails the step's requests, not the server
                        log.exception("step failed")
                        scheduler.stats.step_faults += 1
                        scheduler.fail_running(f"internal error in a step: {type(e).__name__}: {e}")
                with self._lock:
                    self._publish()
        except BaseException as e:  # noqa: BLE001 - recorded for /health
            self.fatal = f"{type(e).__name__}: {e}"
            log.exception("engine thread died")
        finally:
            with self._lock:
                self._stopping = True
                pending, self._inbox = self._inbox, []
                between, self._between = self._between, []
            for _, box, done in between:
                box.append((False, RuntimeError("the engine stopped")))
                done.set()
            for _, sink, _ in pending:
                sink(Failed("the server is shutting down"))
            scheduler.fail_all("the server is shutting down")
            with self._lock:
                self._publish()
            self._idle.set()

    def _publish(self) -> None:
        """Copies the scheduler's and manager's figures into `stats` (under the lock)."""
        m, s, c = self.manager, self.stats, self.scheduler
        s.running, s.prefilling = c.num_running, c.num_prefilling
        s.waiting = c.num_waiting + len(self._inbox)
        self._waiting_count = c.num_waiting
        s.running_sequences = c.num_running_sequences
        s.pages_used, s.pages_free, s.pages_cached = (
            m.num_used_pages,
            m.num_free_pages - m.num_cached_pages,
            m.num_cached_pages,
        )
        s.prefix_hits, s.prefix_misses = m.stats.prefix_hits, m.stats.prefix_misses
        s.prompt_tokens = c.stats.prompt_tokens
        s.prompt_tokens_cached = c.stats.prompt_tokens_cached
        s.generated_tokens, s.preemptions = c.stats.generated_tokens, c.stats.preemptions
        s.steps, s.step_faults = c.stats.steps, c.stats.step_faults
