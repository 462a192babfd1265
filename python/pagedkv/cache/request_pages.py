"""One live request's page tables in the page manager: its pages in every
layer group, its prefix-hash chain and its reservations."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .page_pool import ROOT_HASH


class RequestPages:
    """One live request's page tables (one row per layer group) and
    prefix-hash state."""

    __slots__ = (
        "pages",
        "first",
        "num_pages",
        "seq_len",
        "reserved",
        "generation",
        "chain",
        "tail",
        "pending",
        "ahead",
    )

    def __init__(self, num_groups: int = 1) -> None:
        self.pages = np.empty((num_groups, 4), np.int32)
        """pages[g, :num_pages] is the request's page table in layer group g;
        the rest is spare capacity."""
        self.first = [0] * num_groups
        """Per group, the first slot holding a page of the request: a window
        group's earlier slots hold its null page."""
        self.num_pages = 0
        self.seq_len = 0
        self.reserved = 0
        """Tokens reserved by the reserve() call numbered `generation`."""
        self.generation = -1
        self.chain: bytes | None = ROOT_HASH
        """Hash of the last full page; None once some page's tokens are unknown."""
        self.tail = np.empty(0, np.int64)
        """Token ids in the partial last page (meaningful while chain is not None)."""
        self.pending = np.empty(0, np.int64)
        """Prompt ids given to add() that no reserve() has counted yet: the ids
        of the next tokens, used when reserve() is not given them."""
        self.ahead: list[list[int]] = [[] for _ in range(num_groups)]
        """Per group, pages reserve(num_steps=k) took for later steps: owned
        (refcount 1, no hash), not yet in the page table; later reserves use
        them first. Every group sets aside as many."""

    def page_list(self, group: int = 0) -> np.ndarray:
        return self.pages[group, : self.num_pages]

    def live_pages(self, group: int) -> np.ndarray:
        """The pages the request owns in group (its null slots left out)."""
        return self.pages[group, self.first[group] : self.num_pages]

    def push(self, new_pages: Sequence[Sequence[int]]) -> None:
        """Appends new_pages[g] to group g's table (as many in each group)."""
        need = self.num_pages + len(new_pages[0])
        if need > self.pages.shape[1]:
            grown = np.empty((self.pages.shape[0], max(need, 2 * self.pages.shape[1])), np.int32)
            grown[:, : self.num_pages] = self.pages[:, : self.num_pages]
            self.pages = grown
        self.pages[:, self.num_pages : need] = new_pages
        self.num_pages = need

    def copy(self) -> RequestPages:
        other = RequestPages(self.pages.shape[0])
        other.pages = self.pages.copy()
        other.first = list(self.first)
        other.num_pages = self.num_pages
        other.seq_len = self.seq_len
        other.chain = self.chain
        other.tail = self.tail.copy()
        other.pending = self.pending.copy()
        return other
