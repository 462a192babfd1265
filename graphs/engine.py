"""Runs the step graphs over a page manager's pools: prefill and decode steps.

The manager owns the pools and the page tables; the engine turns one step of
a batch into the graphs' inputs (host NumPy: tokens, positions, page table,
work list), executes one graph for the whole layer stack, and returns the
logits of each request's last token. The graphs run where the manager's
pools live: on a GPU the step's small index arrays are copied over and the
logits copied back (greedy sampling happens on the host).
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
from max.driver import CPU, Buffer

from pagedkv import graph_ops
from pagedkv._ops.kernels import accelerator, stream_ordered
from pagedkv._ops.tensors import device_of, to_buffer
from pagedkv.cache.manager import PagedKVCacheManager
from pagedkv.runtime import settle_max_threads_once

from .decoder import DECODE, PREFILL, group_windows, step_input_names
from .model import DecoderConfig
from .step_models import compile_step_graphs

BATCH_INVARIANT_CHUNK = 256
"""Tokens per decode split in batch-invariant mode (rounded up to a whole
number of pages)."""


def page_manager_for(
    config: DecoderConfig, num_pages: int, page_size: int, dtype: object, device: str = "cpu"
) -> PagedKVCacheManager:
    """A page manager that a DecoderEngine of `config` runs over: one pool per
    layer, of num_pages pages of page_size tokens x num_kv_heads x head_dim
    in `dtype`, in the model's layer groups, on `device` ("cpu", or "gpu":
    torch pools on the current GPU)."""
    return PagedKVCacheManager(
        num_pages,
        page_size,
        config.num_kv_heads,
        config.head_dim,
        num_layers=config.num_layers,
        dtype=dtype,
        device="cuda" if device == "gpu" else "cpu",
        layer_groups=config.layer_groups,
    )


class DecoderEngine:
    """The model on a paged cache: prefill() and decode() steps of a batch.

    `quantized` (the packed GGUF matrices by name, see
    `pagedkv.models.gguf_model`) runs the quantized step graphs; otherwise
    the float ones in the manager's dtype. `batch_invariant` fixes decode's
    key splits so that a request's logits do not depend on its batch
    (`decode_chunk`); without it (the default) decode reads a prefix that
    consecutive requests share once for all of them (`share_prefixes`).

    A step that raises once its pages are reserved leaves no prefix key on
    the pages it was to fill (nothing serves them to a later prompt); its
    requests still count its tokens, so the caller releases them."""

    def __init__(
        self,
        config: DecoderConfig,
        weights: Mapping[str, np.ndarray],
        manager: PagedKVCacheManager,
        quantized: dict | None = None,
        batch_invariant: bool = False,
    ) -> None:
        if manager.num_layers != config.num_layers or manager.head_dim != config.head_dim:
            raise ValueError("the manager's pools do not match the model's layers and head_dim")
        if manager.num_kv_heads != config.num_kv_heads:
            raise ValueError("the manager's pools do not match the model's KV heads")
        groups = config.layer_groups or [(tuple(range(config.num_layers)), None)]
        if list(manager.layer_groups) != groups:
            raise ValueError(
                f"the manager's layer groups {manager.layer_groups} are not the model's {groups} "
                "(PagedKVCacheManager(layer_groups=config.layer_groups))"
            )
        self.config = config
        self.manager = manager
        self.device = device_of(manager.pools[0])
        self.models = compile_step_graphs(
            config, weights, manager.page_size, manager.dtype, self.device, quantized
        )
        self.compile_seconds = self.models.seconds
        page = manager.page_size
        chunk = -(-BATCH_INVARIANT_CHUNK // page) * page
        self.batch_invariant = batch_invariant
        self.decode_chunk = chunk if batch_invariant else None
        """Decode splits every request's keys at multiples of this many tokens
        (None: chunks sized to keep every core busy). A fixed chunk makes a
        request's decode logits bitwise the same whatever else is in its
        batch and however many cores run it: every other part of a step
        computes each row on its own, in an order that does not depend on
        the batch."""
        self._pool_buffers: tuple[list, list] | None = None
        self._index_names = {
            kind: step_input_names(kind, config)[: -config.num_layers] for kind in (PREFILL, DECODE)
        }
        """Each step graph's inputs before its pools, in order."""
        self._group_count = len(group_windows(config))
        self.share_prefixes = not batch_invariant
        """Decode reads the pages of a prefix that consecutive requests share
        once for all of them (CPU; in a window group, the part of it their
        windows see): a shared system prompt's keys are scored as one
        matrix product. Off in batch-invariant mode: a request's sums would
        then depend on who shares its prefix."""

    def prefill(
        self,
        request_ids: Sequence[Hashable],
        tokens: Sequence[Sequence[int]],
        every_row: Sequence[bool] | None = None,
    ) -> np.ndarray | tuple[np.ndarray, list[np.ndarray | None]]:
        """Appends each request's new tokens (any number, after what it has
        cached) and returns the logits [B, vocab] after its last one.

        With `every_row` (one flag per request) it returns those logits and,
        for each flagged request, the logits [len(tokens[b]), vocab] after
        each of its new tokens (None for the others): what prompt logprobs
        are read from."""
        counts = [len(t) for t in tokens]
        flags = list(every_row) if every_row is not None else [False] * len(counts)
        if len(flags) != len(counts):
            raise ValueError("every_row needs one flag per request")
        self.manager.reserve(request_ids, counts, tokens=[list(t) for t in tokens])
        try:
            logits = self._prefill(request_ids, tokens, flags)
        except BaseException:
            self._unkey_failed_step(request_ids, counts)
            raise
        if every_row is None:
            return logits
        rows: list[np.ndarray | None] = []
        at = len(counts)
        for b, flag in enumerate(flags):
            rows.append(logits[at : at + counts[b]] if flag else None)
            at += counts[b] if flag else 0
        return logits[: len(counts)], rows

    def _prefill(self, request_ids, tokens, flags: list[bool]) -> np.ndarray:
        """The prefill graph's logits: each request's last row, then every
        row of the flagged requests (their pages already reserved)."""
        md = self.manager.metadata(request_ids, group=0)
        tables = self._group_tables(PREFILL, request_ids, md)
        last = md.append_indptr[1:] - 1
        # Output rows: every request's last row first, then the flagged
        # requests' rows in order.
        extra = [
            np.arange(md.append_indptr[b], md.append_indptr[b + 1], dtype=np.int32)
            for b, flag in enumerate(flags)
            if flag
        ]
        inputs = {
            "tokens": np.concatenate([np.asarray(t, np.int32) for t in tokens]),
            "last_rows": np.concatenate([last.astype(np.int32), *extra]),
            **self._step_inputs(md, tables),
        }
        return self._run(self.models.prefill, PREFILL, inputs)

    def decode(self, request_ids: Sequence[Hashable], tokens: Sequence[int]) -> np.ndarray:
        """Appends one token per request and returns the next logits [B, vocab]."""
        self.manager.reserve(request_ids, 1, tokens=[[int(t)] for t in tokens])
        try:
            return self._decode(request_ids, tokens)
        except BaseException:
            self._unkey_failed_step(request_ids, [1] * len(request_ids))
            raise

    def _decode(self, request_ids, tokens) -> np.ndarray:
        """The decode graph's logits, in the batch's order (pages reserved)."""
        md = self.manager.metadata(request_ids, group=0)
        order = self._prefix_order(md)
        if order is not None:
            request_ids = [request_ids[i] for i in order]
            tokens = [tokens[i] for i in order]
            md = self.manager.metadata(request_ids, group=0)
        tables = self._group_tables(DECODE, request_ids, md)
        inputs = {"tokens": np.asarray(tokens, np.int32), **self._step_inputs(md, tables)}
        logits = self._run(self.models.decode, DECODE, inputs)
        if not self.device.is_gpu:
            # MAX's poller and workers start with the first execute; from
            # then on they take the cores from the step's Python work.
            settle_max_threads_once()
        if order is None:
            return logits
        back = np.empty_like(logits)
        back[order] = logits
        return back

    def _unkey_failed_step(self, request_ids: Sequence[Hashable], counts: Sequence[int]) -> None:
        """After a step whose computation raised past its reserve(): drops
        the prefix keys reserve() gave the pages the step was to fill, which
        may hold anything, so that no prefix hit or partial copy serves
        them (a page the step was to complete included). Keys of pages
        filled before the step stay. The requests still count the step's
        tokens and cache no later page: end them."""
        manager, size = self.manager, self.manager.page_size
        for request_id, count in zip(request_ids, counts, strict=True):
            if request_id in manager:
                start = manager.seq_len(request_id) - count
                manager.forget(request_id, start - start % size)

    def _prefix_order(self, md) -> np.ndarray | None:
        """An order of the batch that puts requests with the same first page
        side by side, where they are not already, so that decode reads their
        shared prefix once (`share_prefixes`: only consecutive requests
        share); None to keep the batch's order."""
        if not self.share_prefixes or len(md.kv_indptr) < 4 or self.device.is_gpu:
            return None
        first_pages = md.kv_indices[md.kv_indptr[:-1]]
        order = np.argsort(first_pages, kind="stable")
        runs = np.count_nonzero(np.diff(first_pages)) + 1
        if runs == np.count_nonzero(np.diff(first_pages[order])) + 1:
            return None  # equal first pages are already side by side
        return order

    def _work(self, kind: str, meta) -> tuple[np.ndarray, np.ndarray]:
        """The work list of a step over one layer group's page table (its
        window_left: a window group's work skips what its window hides)."""
        c = self.config
        shape = (self.manager.page_size, c.num_qo_heads, c.num_kv_heads, c.head_dim)
        table = (meta.kv_indptr, meta.kv_last_page_len)
        gpu = self.device.is_gpu
        if kind == PREFILL:
            # Batch-invariant: tiles on the page grid, where every piece of a
            # prompt starts (prefix hits and recompute resume at page starts).
            align = self.manager.page_size if self.batch_invariant else None
            return graph_ops.prefill_work(
                meta.append_indptr, *table, *shape, window_left=meta.window_left, gpu=gpu,
                align=align,
            )  # fmt: skip
        shares = self.share_prefixes and not gpu and not self.decode_chunk
        return graph_ops.decode_work(
            *table,
            *shape,
            window_left=meta.window_left,
            gpu=gpu,
            fixed_chunk=self.decode_chunk,
            kv_indices=meta.kv_indices if shares else None,
            seq_lens=meta.seq_lens,
        )

    def _group_tables(self, kind: str, request_ids: Sequence[Hashable], md) -> dict:
        """Each layer group's page ids and work list (md: group 0's metadata)."""
        tables = {}
        for g in range(self._group_count):
            meta = md if g == 0 else self.manager.metadata(request_ids, group=g)
            items, request_items = self._work(kind, meta)
            tables |= {
                f"kv_indices.{g}": meta.kv_indices,
                f"work_items.{g}": items,
                f"request_items.{g}": request_items,
            }
        return tables

    def _step_inputs(self, md, tables: dict) -> dict:
        return {
            "positions": md.positions,
            "batch_indices": md.batch_indices,
            "kv_indptr": md.kv_indptr,
            "kv_last_page_len": md.kv_last_page_len,
            **tables,
        }

    def _pools(self) -> list:
        """The manager's pools as MAX buffers, made once: a buffer holds its
        pool's memory, which lives as long as the manager does."""
        pools = self.manager.pools
        cached = self._pool_buffers
        if (
            cached is None
            or len(cached[0]) != len(pools)
            or not all(map(operator.is_, cached[0], pools))
        ):
            cached = self._pool_buffers = (
                list(pools),
                [to_buffer(p, stream_ordered=True) for p in pools],
            )
        return cached[1]

    def _run(self, model, kind: str, inputs: dict) -> np.ndarray:
        names = self._index_names[kind]
        if not self.device.is_gpu:
            # No context manager on the CPU: entering and leaving one costs
            # tens of microseconds once a step has evicted Python's code.
            buffers = [Buffer.from_numpy(inputs[n]) for n in names] + self._pools()
            return model.execute(*buffers)[0].to_numpy()
        gpu = accelerator(self.device)
        buffers = [Buffer.from_numpy(inputs[n]).to(gpu) for n in names] + self._pools()
        with stream_ordered(self.manager.pools, self.device):
            logits = model.execute(*buffers)[0]
        return (logits if logits.is_host else logits.to(CPU())).to_numpy()
