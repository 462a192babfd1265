"""KV cache events in vLLM's schema (vllm/distributed/kv_events.py), so that
a KV-aware router can track which instance holds which prefix.

The field names and order follow vLLM's ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared``; block hashes are the manager's 16-byte chained page
keys (vLLM's ``ExternalBlockHash`` allows bytes). ``medium`` is the tier:
``"GPU"`` for a pool on a GPU, ``"CPU"`` for a pool in host memory, and
``"CPU_OFFLOAD"`` for the host tier of a manager whose hot pool is itself in
host memory (a CPU-only machine), so that the two tiers stay apart.
``group_idx`` is vLLM's: the layer group whose pool holds the pages (None for
a manager without layer groups).

NOTE: a manager emits events only for operations that succeeded, in the
order their effects happened, after its state is committed: a subscriber
may call the manager's read-only methods from its callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_CPU_OFFLOAD = "CPU_OFFLOAD"


@dataclass(frozen=True)
class BlockStored:
    """A run of full pages became cached, each chained on the one before.

    block_hashes[0]'s parent is parent_block_hash (None for a prompt's first
    page); token_ids holds len(block_hashes) * block_size ids.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_CPU
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached pages lost their contents (evicted) in the given medium."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM_CPU
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash announced before is held."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
Subscriber = Callable[[KVCacheEvent], None]


@dataclass
class EventHub:
    """The subscribers of one page pool (one manager) and the events of the
    operation under way.

    Events are queued while an operation runs and delivered by flush() once it
    has committed; with no subscriber nothing is queued (no cost).
    """

    subscribers: list[Subscriber] = field(default_factory=list)
    pending: list[KVCacheEvent] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.subscribers)

    def emit(self, event: KVCacheEvent) -> None:
        if self.subscribers:
            self.pending.append(event)

    def flush(self) -> None:
        events, self.pending = self.pending, []
        for event in events:
            for subscriber in list(self.subscribers):
                subscriber(event)
