"""Continuous batching: requests arrive, prefill, decode and finish at
different steps, and new ones take the freed places.

Every step admits the requests that have arrived while the pool can hold
them at their full length, prefills them in one batch (the prefix cache
serves the pages a shared prompt already filled), then decodes one token for
every running sequence in one batch. A request asking for n > 1 samples is
forked after its prefill: the samples share its prompt pages and copy the
partly filled last one on their first write. Sample k starts from the k-th
most likely first token and continues greedily: a deterministic stand-in for
sampling that a reference can replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedkv.manager import OutOfPagesError

from .engine import LlamaEngine


@dataclass(frozen=True)
class Request:
    """What a client asks for."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    samples: int = 1
    arrival_step: int = 0


@dataclass
class Sequence:
    """One generated stream: a request's sample."""

    seq_id: str
    request: Request
    sample: int
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    """The logits each token was chosen from (kept for the self-check)."""

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.max_new_tokens


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
    """Drives an engine over a stream of requests (see the module docstring)."""

    def __init__(self, engine: LlamaEngine) -> None:
        self.engine = engine
        self.manager = engine.manager

    def footprint(self, r: Request) -> int:
        """Pages a request needs at its full length (each sample its own)."""
        return r.samples * pages_for(len(r.prompt) + r.max_new_tokens, self.manager.page_size)

    def run(
        self,
        requests: list[Request],
        on_step: Callable[[int, int, int], None] | None = None,
    ) -> tuple[list[Sequence], RunStats]:
        """Serves every request to completion; returns the sequences (in
        request order, samples in order) and the run's statistics.

        on_step(step, tokens generated so far, running sequences) is called
        after every step (a progress display).
        """
        for r in requests:
            if self.footprint(r) > self.manager.num_pages:
                raise ValueError(
                    f"request {r.request_id} needs {self.footprint(r)} pages at full "
                    f"length but the pool holds {self.manager.num_pages}"
                )
        waiting = sorted(requests, key=lambda r: r.arrival_step)
        running: list[Sequence] = []
        finished: dict[str, Sequence] = {}
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
                    s.tokens.append(int(np.argmax(row)))
                    s.logits.append(row)
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
            ranked = np.argsort(-row, kind="stable")
            for k in range(r.samples):
                if k > 0:
                    self.manager.fork(seq_id(r, 0), seq_id(r, k))
                s = Sequence(seq_id(r, k), r, k, [int(ranked[k])], [row])
                sequences.append(s)
                stats.generated_tokens += 1
        return sequences


def seq_id(request: Request, sample: int) -> str:
    """The page manager's sequence id of a request's sample: "request/sample"."""
    return f"{request.request_id}/{sample}"
