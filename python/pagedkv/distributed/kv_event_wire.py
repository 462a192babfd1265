"""The manager's KV events in vLLM's ZeroMQ wire format.

vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py) sends each batch
as three frames: the topic, an 8-byte big-endian sequence number, and the
batch as MessagePack. The batch is msgspec's encoding of vLLM's structs
(``array_like=True, omit_defaults=True``, tagged events): an array
``[ts, events, data_parallel_rank]``, each event an array of its class name
and then its fields in vLLM's order, trailing fields left at their default
omitted. Dynamo's KV indexer and router decode exactly this (the batch
must be an array), so a pagedkv replica looks like a vLLM one to them.

Block hashes go out as unsigned 64-bit integers: the low 64 bits of the
manager's 16-byte chained page keys (`block_hash_int`). Routers key their
trees by these integers and by hashes they compute from ``token_ids``; two
different prefixes share a 64-bit hash with negligible probability, and a
collision can only mislead a routing choice, never what a replica serves.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgpack

from ..cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["block_hash_int", "decode_batch", "encode_batch", "event_to_wire"]

_MASK64 = (1 << 64) - 1


def block_hash_int(key: bytes) -> int:
    """The wire form of a page key: its low 64 bits, unsigned.

    Examples
    --------
    >>> block_hash_int(bytes(15) + b"\\x05")
    5
    """
    return int.from_bytes(key, "big") & _MASK64


def event_to_wire(event: KVCacheEvent) -> list[Any]:
    """One event as msgspec encodes vLLM's tagged, array-like struct of the
    same name: the class name, then the fields in order, trailing fields
    left at their default omitted."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        wire: list[Any] = [
            "BlockStored",
            [block_hash_int(k) for k in event.block_hashes],
            None if parent is None else block_hash_int(parent),
            [int(t) for t in event.token_ids],
            int(event.block_size),
            event.lora_id,
            event.medium,
            None,  # lora_name
        ]
        if event.group_idx is not None:
            wire += [None, int(event.group_idx)]  # extra_keys, group_idx
        return wire
    if isinstance(event, BlockRemoved):
        wire = ["BlockRemoved", [block_hash_int(k) for k in event.block_hashes], event.medium]
        if event.group_idx is not None:
            wire.append(int(event.group_idx))
        return wire
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(
    events: Iterable[KVCacheEvent], data_parallel_rank: int = 0, ts: float | None = None
) -> bytes:
    """A `KVEventBatch` payload (``[ts, events, data_parallel_rank]``): the
    third frame of a published message.

    Examples
    --------
    >>> payload = encode_batch([AllBlocksCleared()], ts=1.0)
    >>> decode_batch(payload)
    [1.0, [['AllBlocksCleared']], 0]
    """
    batch = [
        time.time() if ts is None else float(ts),
        [event_to_wire(e) for e in events],
        int(data_parallel_rank),
    ]
    return msgpack.packb(batch, use_bin_type=True)


def decode_batch(payload: bytes) -> list[Any]:
    """A payload back as plain lists (what a subscriber reads)."""
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)
