"""Continuous batching: requests arrive, prefill, decode and finish at
different steps, and new ones take the freed places.

Every step admits the requests that have arrived while the pool can hold
them at their full length, prefills them in one batch (the prefix cache
serves the pages a shared prompt already filled), then decodes one token for
every running sequence in one batch. A request asking for n > 1 samples is
forked after its prefill: the samples share its prompt pages and copy the
partly filled last one on their first write. A greedy request's sample k
starts from the k-th most likely first token and continues greedily (a
deterministic stand-in for sampling that a reference can replay); a sampled
request's samples draw from their own seeded generators.

A sequence ends at its token limit, after a stop token (EOS), or where the
model's context ends. A request that can never be served (an empty prompt,
a prompt that fills the context, or one larger than the whole pool) ends at
once with an error, and the others are served.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pagedkv.manager import OutOfPagesError

from .engine import LlamaEngine
from .sampling import GREEDY, SamplingParams, sample_token


@dataclass(frozen=True)
class Request:
    """What a client asks for."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    samples: int = 1
    arrival_step: int = 0
    sampling: SamplingParams = GREEDY
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class Sequence:
    """One generated stream: a request's sample."""

    seq_id: str
    request: Request
    sample: int
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    """The logits each token was chosen from (kept for the self-check only
    when the scheduler is asked to keep them)."""
    error: str | None = None
    """Why the request could not be served (then it has no tokens)."""
    rng: np.random.Generator | None = field(default=None, repr=False)

    @property
    def stopped(self) -> bool:
        """Whether the last token is a stop token."""
        return bool(self.tokens) and self.tokens[-1] in self.request.stop_token_ids

    @property
    def done(self) -> bool:
        return (
            self.error is not None
            or self.stopped
            or len(self.tokens) >= self.request.max_new_tokens
        )

    @property
    def finish_reason(self) -> str | None:
        """ "stop" (a stop token), "length" (the token limit), "error", or None
        while running."""
        if self.error is not None:
            return "error"
        if self.stopped:
            return "stop"
        return "length" if self.done else None


@dataclass
class RunStats:
    steps: int = 0
    prefill_tokens: int = 0
    """Prompt tokens computed (those the prefix cache did not serve)."""
    generated_tokens: int = 0
    decode_step_seconds: list[float] = field(default_factory=list)
    prefill_step_seconds: list[float] = field(default_factory=list)
    peak_used_pages: int = 0
    seconds: float = 0.0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens: ceil(tokens / page_size)."""
    return -(-tokens // page_size)


class Scheduler:
    """Drives an engine over a stream of requests (see the module docstring).

    keep_logits: keep the logits row behind every token (the self-check
    replays them; a real vocabulary makes them 200 kB a token).
    """

    def __init__(self, engine: LlamaEngine, keep_logits: bool = False) -> None:
        self.engine = engine
        self.manager = engine.manager
        self.keep_logits = keep_logits

    def footprint(self, r: Request) -> int:
        """Pages a request needs at its full length (each sample its own)."""
        return r.samples * pages_for(len(r.prompt) + r.max_new_tokens, self.manager.page_size)

    def capped(self, r: Request) -> Request:
        """The request with its token limit cut where the model's context ends
        (a prompt that fits leaves room for at least one token)."""
        room = self.engine.config.max_positions - len(r.prompt)
        return replace(r, max_new_tokens=max(1, min(r.max_new_tokens, room)))

    def rejection(self, r: Request) -> str | None:
        """Why a request can never be served, or None."""
        context = self.engine.config.max_positions
        if not r.prompt:
            return "the prompt is empty"
        if len(r.prompt) >= context:
            return (
                f"the prompt has {len(r.prompt)} tokens: the model's context holds "
                f"{context}, so at most {context - 1} leave room for an answer"
            )
        if self.footprint(r) > self.manager.num_pages:
            return (
                f"needs {self.footprint(r)} pages at full length but the pool holds "
                f"{self.manager.num_pages}: raise the pool size or lower max_new_tokens"
            )
        return None

    def run(
        self,
        requests: list[Request],
        on_step: Callable[[int, int, int], None] | None = None,
        on_token: Callable[[Sequence, int], None] | None = None,
    ) -> tuple[list[Sequence], RunStats]:
        """Serves every request to completion; returns the sequences (in
        request order, samples in order) and the run's statistics.

        on_step(step, tokens generated so far, running sequences) is called
        after every step (a progress display); on_token(sequence, token)
        after every generated token (streaming).
        """
        finished: dict[str, Sequence] = {}
        servable = []
        requests = [self.capped(r) for r in requests]
        for r in requests:
            why = self.rejection(r)
            if why is None:
                servable.append(r)
                continue
            for k in range(r.samples):
                finished[seq_id(r, k)] = Sequence(seq_id(r, k), r, k, error=why)
        self._on_token = on_token
        waiting = sorted(servable, key=lambda r: r.arrival_step)
        running: list[Sequence] = []
        stats = RunStats()
        t_begin = time.perf_counter()
        step = 0
        while waiting or running:
            admitted = self._admit(waiting, running, step)
            if admitted:
                t0 = time.perf_counter()
                running += self._prefill(admitted, stats)
                stats.prefill_step_seconds.append(time.perf_counter() - t0)
            still = [s for s in running if not s.done]
            if still:
                t0 = time.perf_counter()
                logits = self.engine.decode(
                    [s.seq_id for s in still], [s.tokens[-1] for s in still]
                )
                stats.decode_step_seconds.append(time.perf_counter() - t0)
                stats.generated_tokens += len(still)
                for s, row in zip(still, logits, strict=True):
                    self._emit(s, sample_token(row, s.request.sampling, s.rng), row)
            stats.peak_used_pages = max(stats.peak_used_pages, self.manager.num_used_pages)
            for s in [s for s in running if s.done]:
                self.manager.release(s.seq_id)
                finished[s.seq_id] = s
            running = [s for s in running if not s.done]
            step += 1
            if on_step is not None:
                on_step(step, stats.generated_tokens, len(running))
        stats.steps = step
        stats.seconds = time.perf_counter() - t_begin
        order = [seq_id(r, k) for r in requests for k in range(r.samples)]
        return [finished[i] for i in order], stats

    def _admit(self, waiting: list[Request], running: list[Sequence], step: int) -> list[Request]:
        """Takes the arrived requests, in arrival order, while every running
        and admitted sequence still fits the pool at its full length."""
        budget = self.manager.num_pages - sum(
            pages_for(len(s.request.prompt) + s.request.max_new_tokens, self.manager.page_size)
            for s in running
        )
        admitted = []
        while waiting and waiting[0].arrival_step <= step:
            need = self.footprint(waiting[0])
            if need > budget:
                break
            budget -= need
            admitted.append(waiting.pop(0))
        return admitted

    def _prefill(self, admitted: list[Request], stats: RunStats) -> list[Sequence]:
        """Prefills the admitted requests in one batch and forks their samples;
        returns their sequences, each holding its first generated token."""
        ids, suffixes = [], []
        for r in admitted:
            # The last prompt token is always computed: its logits start the
            # generation, so it is never taken from the prefix cache.
            cached = self.manager.add(seq_id(r, 0), r.prompt[:-1])
            ids.append(seq_id(r, 0))
            suffixes.append(r.prompt[cached:])
        try:
            logits = self.engine.prefill(ids, suffixes)
        except OutOfPagesError:
            for i in ids:
                self.manager.release(i)
            raise
        stats.prefill_tokens += sum(len(s) for s in suffixes)
        sequences = []
        for r, row in zip(admitted, logits, strict=True):
            ranked = np.argsort(-row, kind="stable") if r.sampling.greedy else None
            for k in range(r.samples):
                if k > 0:
                    self.manager.fork(seq_id(r, 0), seq_id(r, k))
                s = Sequence(seq_id(r, k), r, k)
                if ranked is None:
                    seed = None if r.sampling.seed is None else [r.sampling.seed, k]
                    s.rng = np.random.default_rng(seed)
                    self._emit(s, sample_token(row, r.sampling, s.rng), row)
                else:
                    self._emit(s, int(ranked[k]), row)
                sequences.append(s)
                stats.generated_tokens += 1
        return sequences

    def _emit(self, s: Sequence, token: int, row: np.ndarray) -> None:
        s.tokens.append(token)
        if self.keep_logits:
            s.logits.append(row)
        if self._on_token is not None:
            self._on_token(s, token)


def seq_id(request: Request, sample: int) -> str:
    """The page manager's sequence id of a request's sample: "request/sample"."""
    return f"{request.request_id}/{sample}"
