"""The page manager's layer groups: which layers share a page pool and
page tables, each group's sliding window (None: full attention), and its
host tier; the check of a `layer_groups` argument."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from .._checks import check_int
from .batch_metadata import PAD_PAGE
from .eviction import EvictionPolicy
from .kv_events import MEDIUM_CPU, MEDIUM_CPU_OFFLOAD, MEDIUM_GPU, EventHub
from .page_pool import PagePool
from .page_tensors import PageTensors

GroupSpecs = list[tuple[tuple[int, ...], int | None]]
"""(layers, window) of each layer group."""


@dataclass(eq=False, slots=True)
class LayerGroup:
    """One layer group: its layers and window, its page pool and tensors, and
    its host tier (pool and tensors) when the manager offloads."""

    index: int
    layers: tuple[int, ...]
    window: int | None
    pool: PagePool
    tensors: PageTensors
    host: PagePool | None
    host_tensors: PageTensors | None
    null_page: int = field(init=False)
    """A window group's tensors have one page more than its pool: the null
    page, never handed out nor written, in the slots of dropped pages
    (PAD_PAGE for a full-attention group)."""

    def __post_init__(self) -> None:
        self.null_page = self.pool.num_pages if self.window is not None else PAD_PAGE

    def first_slot(self, start: int, page_size: int) -> int:
        """The first slot a query at position ``start`` or later can see:
        the window shows a query at p the keys p - window + 1 .. p."""
        if self.window is None:
            return 0
        return max(0, (start - self.window + 1) // page_size)


def parse_layer_groups(layer_groups: Any, num_layers: int) -> GroupSpecs:
    """layer_groups as (layers, window) pairs that cover every layer once."""
    if layer_groups is None:
        return [(tuple(range(num_layers)), None)]
    if isinstance(layer_groups, (str, bytes)) or not isinstance(layer_groups, Iterable):
        raise TypeError(
            f"layer_groups must be a list of (layers, window) pairs, got {layer_groups!r}"
        )
    groups = []
    seen: set[int] = set()
    for g, entry in enumerate(layer_groups):
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"layer_groups[{g}] must be a (layers, window) pair, got {entry!r}")
        layers, window = entry
        if isinstance(layers, numbers.Integral) or not isinstance(layers, Iterable):
            raise ValueError(
                f"layer_groups[{g}]: layers must be a sequence of ints, got {layers!r}"
            )
        layers = tuple(layers)
        if not layers or not all(
            isinstance(x, numbers.Integral) and 0 <= x < num_layers for x in layers
        ):
            raise ValueError(
                f"layer_groups[{g}]: layers must be a non-empty sequence of layer indices "
                f"in [0, {num_layers}), got {layers!r}"
            )
        twice = seen.intersection(layers) or (len(set(layers)) != len(layers) and layers)
        if twice:
            raise ValueError(f"layer_groups[{g}]: a layer is in two groups or twice: {layers!r}")
        seen.update(layers)
        if window is not None:
            window = check_int(f"layer_groups[{g}]: window", window, 1)
        groups.append((tuple(int(x) for x in layers), window))
    if len(seen) != num_layers:
        missing = sorted(set(range(num_layers)) - seen)
        raise ValueError(f"layer_groups must cover every layer once; no group holds {missing}")
    return groups


def per_group(name: str, value: Any, num_groups: int, low: int) -> list[int]:
    """An int for every group, or one int per group, each >= low (a bool or
    non-integer is a TypeError)."""
    if not isinstance(value, Iterable):
        return [check_int(name, value, low)] * num_groups
    values = list(value)
    if len(values) != num_groups:
        raise ValueError(
            f"{name} must be an integer >= {low} or one per layer group ({num_groups}), "
            f"got {value!r}"
        )
    return [check_int(f"{name}[{g}]", v, low) for g, v in enumerate(values)]


@dataclass(frozen=True)
class PagePoolOptions:
    """What every group's page pool shares: its eviction policy, the cap on
    pinned pages, the manager's event hub, and whether events name groups."""

    eviction: str | EvictionPolicy
    max_pinned_pages: int | None
    events: EventHub
    grouped: bool
    """Whether the manager was given layer groups (events carry group_idx)."""


@dataclass(frozen=True)
class PoolGeometry:
    """What every pool of one manager shares: PageTensors' arguments but the
    page and layer counts (and pin_memory, which only a host tier sets)."""

    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: object
    kv_layout: str
    device: object
    use_torch: bool

    def tensors(self, num_pages: int, num_layers: int, pin_memory: bool = False) -> PageTensors:
        """Zeroed pools of num_pages pages for num_layers layers."""
        return PageTensors(
            num_pages,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
            num_layers,
            self.dtype,
            self.kv_layout,
            self.device,
            self.use_torch,
            pin_memory,
        )


def make_group(
    index: int,
    spec: tuple[tuple[int, ...], int | None],
    pages: int,
    host_pages: int,
    geometry: PoolGeometry,
    options: PagePoolOptions,
) -> LayerGroup:
    """Layer group `index` of (layers, window) `spec`: its page tensors (a
    window group's with one null page more) and page pool of `pages` pages,
    and a host tier of `host_pages` (none when 0): host memory, torch
    tensors in page-locked memory behind GPU pools."""
    layers, window = spec
    tensors = geometry.tensors(pages + (window is not None), len(layers))
    pool = PagePool(
        pages,
        tensors.page_size,
        eviction=options.eviction,
        max_pinned_pages=options.max_pinned_pages,
        medium=MEDIUM_GPU if tensors.on_gpu else MEDIUM_CPU,
        group_idx=index if options.grouped else None,
        events=options.events,
        keep_token_ids=host_pages > 0,
    )
    host = host_tensors = None
    if host_pages:
        host_geometry = replace(
            geometry, device="cpu", use_torch=geometry.use_torch or tensors.on_gpu
        )
        host_tensors = host_geometry.tensors(host_pages, len(layers), pin_memory=tensors.on_gpu)
        host = PagePool(
            host_pages,
            geometry.page_size,
            max_pinned_pages=0,
            medium=MEDIUM_CPU if tensors.on_gpu else MEDIUM_CPU_OFFLOAD,
            group_idx=pool.group_idx,
            events=options.events,
            keep_token_ids=True,
        )
    return LayerGroup(index, layers, window, pool, tensors, host, host_tensors)
