"""Publishes a manager's KV events over ZeroMQ, as vLLM's `ZmqEventPublisher`
does, so that KV-aware routers (Dynamo's indexer and router, vLLM's
tooling) can follow which replica holds which prefix.

The manager calls its subscribers on the scheduler's thread once each
operation has committed; the publisher only appends the event to a queue
there. Its own thread sends whatever has gathered as one batch (the manager
emits a few events per step, so a batch is about a step), numbered from 0
by an 8-byte big-endian sequence number, and keeps the last
``buffer_batches`` for replay: a subscriber that missed batches sends the
first number it lacks (8 bytes, big-endian) to the replay socket and gets
every kept batch from there on as ``(seq, payload)`` frames, then
``(-1, b"")``.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Collection

import zmq

from ..cache.kv_events import KVCacheEvent
from .kv_event_wire import encode_batch

__all__ = ["ZmqKvEventPublisher"]

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class ZmqKvEventPublisher:
    """A manager subscriber that publishes its events on a ZeroMQ PUB socket.

    Parameters
    ----------
    endpoint : str
        The PUB socket's address, e.g. ``"tcp://127.0.0.1:5557"``.
    bind : bool
        Bind the address (the default: routers' subscribers connect to
        their publishers) or connect to a subscriber that binds it.
    replay_endpoint : str, optional
        A ROUTER address (bound) that replays kept batches on request.
    topic : str
        The first frame of every message (subscribers filter on it).
    data_parallel_rank : int
        Written into every batch (vLLM's ``data_parallel_rank``).
    buffer_batches : int
        Batches kept for replay.
    groups : collection of int, optional
        The layer groups whose events go out (events of a manager without
        groups always do). Default: group 0, the model's full-attention
        layers, whose pages are the prefix a later prompt hits. A window
        group gives pages back as its window passes: its removals would
        tell a router the replica lost a prefix it still serves.

    Examples
    --------
    >>> from pagedkv.cache.manager import PagedKVCacheManager
    >>> m = PagedKVCacheManager(8, 4, 1, 8)
    >>> publisher = ZmqKvEventPublisher("tcp://127.0.0.1:0")  # doctest: +SKIP
    >>> unsubscribe = m.subscribe(publisher)  # doctest: +SKIP
    >>> publisher.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        endpoint: str,
        bind: bool = True,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_batches: int = 10_000,
        groups: Collection[int] | None = (0,),
    ) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(
                f"endpoint must be a ZeroMQ address like tcp://host:port, got {endpoint!r}"
            )
        # Its own context, so that close() can wait for the last messages
        # to leave (a context's term() waits out its sockets' linger).
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if bind:
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot open the KV event socket {endpoint!r}: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if bind else endpoint
        """The address subscribers use (a bound port 0 resolved)."""
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._groups = None if groups is None else frozenset(groups)
        self._topic = topic.encode()
        self._rank = int(data_parallel_rank)
        self._events: queue.SimpleQueue[KVCacheEvent | None] = queue.SimpleQueue()
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._numbers = itertools.count()
        self.batches_sent = 0
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    def __call__(self, event: KVCacheEvent) -> None:
        """The subscriber: queues one event (the manager's thread)."""
        if self.wants(event):
            self._events.put(event)

    def wants(self, event: KVCacheEvent) -> bool:
        """Whether the event goes out (its layer group is published)."""
        group = getattr(event, "group_idx", None)
        return group is None or self._groups is None or group in self._groups

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued and waits (up to `timeout` seconds) until it
        has left the process, then closes: events published just before a
        process ends still reach its subscribers."""
        if self._thread.is_alive():
            self._events.put(None)
            self._thread.join(timeout)
        self._close_sockets(linger_ms=int(timeout * 1000))

    def _close_sockets(self, linger_ms: int = 0) -> None:
        if not self._pub.closed:
            self._pub.close(linger_ms)
        if self._replay is not None and not self._replay.closed:
            self._replay.close(0)
        self._context.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                first = self._events.get(timeout=0.05)
            except queue.Empty:
                continue
            batch, done = [], first is None
            if first is not None:
                batch.append(first)
            while True:
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    break
                if event is None:
                    done = True
                else:
                    batch.append(event)
            if batch:
                self._send(batch)
            if done:
                return

    def _send(self, events: list[KVCacheEvent]) -> None:
        seq = next(self._numbers)
        payload = encode_batch(events, self._rank)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._kept.append((seq, payload))
        self.batches_sent += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
