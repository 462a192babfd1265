"""The host tier's side of an allocation that evicts keyed pages."""

from __future__ import annotations


class OffloadPlan:
    """The host-tier side of a claim that evicts keyed pages: which evicted
    pages are copied where, and which host pages only get fresher."""

    __slots__ = ("pages", "keys", "origins", "dests", "keep")

    def __init__(self) -> None:
        self.pages: list[int] = []
        """Evicted device pages whose keys the host tier lacks: copied."""
        self.keys: list[bytes] = []
        self.origins: list[tuple] = []
        self.dests: list[int] = []
        """The host pages they go to (what host.peek_except(n, keep) names)."""
        self.keep: list[int] = []
        """Host pages the operation reads or refreshes: never victims."""
