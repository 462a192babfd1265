"""The scheduler's one hook for KV pages that come from, or go to, outside
its own pool: a page store shared by instances, a prefill instance's pages
pulled over NIXL (pagedkv.distributed implements both).

The scheduler calls, on its own thread:

- ``fetch(request_id, tokens, cached_tokens, request)`` right after
  ``manager.add(request_id, tokens)`` returned ``cached_tokens``: the
  connector may extend the request by pages it brings (reserved through the
  manager and written before it returns) and returns the request's cached
  tokens; the scheduler prefills only the rest. It raises
  :class:`KVTransferError` when the request cannot go on (it fails alone).
- ``after_step(ran)`` after every prefill or decode step: ``ran`` is False
  when the step failed (the pages it cached may hold nothing valid).
- ``on_finish(request, seq_id)`` when a sample ends, before its pages are
  released: the connector may keep them (``manager.fork``) and returns what
  the response should carry (vLLM's ``kv_transfer_params``), or None.
- ``poll()`` at the start of every step, and while ``busy`` is True even
  when there is nothing to schedule (held pages wait for their puller).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class KVTransferError(RuntimeError):
    """A request's pages could not be brought in; that request fails, with
    this message, and nothing else does."""


class KVConnector:
    """A connector that does nothing: the base of every connector."""

    busy: bool = False
    """Whether poll() has work while nothing else runs."""
    transfer_role: str | None = None
    """"prefill" or "decode" for a connector that moves a request's pages
    between instances (the server then accepts kv_transfer_params)."""

    def fetch(
        self, request_id: Hashable, tokens: Sequence[int], cached_tokens: int, request=None
    ) -> int:
        return cached_tokens

    def after_step(self, ran: bool) -> None:
        return None

    def on_finish(self, request, seq_id: Hashable) -> dict | None:
        return None

    def poll(self) -> None:
        return None
