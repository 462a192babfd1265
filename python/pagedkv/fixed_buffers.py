"""Fixed index buffers: FlashInfer's ``use_cuda_graph=True`` wrappers.

A wrapper constructed with the caller's index buffers (``paged_kv_indptr_buffer``
and the rest) keeps them for its life: each plan() writes the batch's index
arrays into them, and run() reads the page table from them and from nothing
else, so a step captured once (a CUDA graph) replays with the contents the
last plan() wrote. The batch size is the buffers' own (indptr has B + 1
entries, last_page_len B); the page-index buffer is a capacity, filled from
its start. A decode wrapper keeps its work list at fixed addresses too
(_attention_plan.FixedWork), as FlashInfer keeps its in the workspace: the
captured step reads each plan's items. On the CPU the same contract holds,
without the capture.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_index_array, check_writable
from ._ops.tensors import Array, device_of, is_contiguous, write_front


class FixedIndexBuffers:
    """The caller's int32 buffers by name, checked once at construction.

    exact: the names whose length is fixed (a batch's B + 1 or B entries);
    the others are capacities.
    """

    def __init__(self, buffers: dict[str, Array | None], exact: tuple[str, ...]) -> None:
        missing = [name for name, b in buffers.items() if b is None]
        if missing:
            raise ValueError(f"use_cuda_graph=True needs {', '.join(missing)}")
        devices = set()
        for name, b in buffers.items():
            check_index_array(name, b)
            check_writable(name, b)
            if not is_contiguous(b):
                raise ValueError(f"{name} must be contiguous: plan() writes it in place")
            devices.add(device_of(b))
        if len(devices) != 1:
            raise ValueError("the fixed index buffers must be on one device")
        self.buffers: dict[str, Array] = dict(buffers)  # type: ignore[arg-type]
        self.exact = exact

    def write_all(self, *columns: np.ndarray) -> tuple[Array, ...]:
        """Copies each column (int32 values, host) into the front of its
        buffer, in the constructor's order, after checking that every one
        fits (exactly, for a fixed-length buffer): all or nothing. Returns
        those fronts, views of the caller's buffers."""
        named = list(zip(self.buffers, columns, strict=True))
        for name, values in named:
            size = int(self.buffers[name].shape[0])
            if name in self.exact and len(values) != size:
                raise ValueError(
                    f"{name} holds {size} entries (the batch size is fixed by the buffers "
                    f"in use_cuda_graph mode), got {len(values)}"
                )
            if len(values) > size:
                raise ValueError(f"{name} holds {size} entries, fewer than the {len(values)} given")
        return tuple(
            write_front(self.buffers[name], np.asarray(values, np.int32)) for name, values in named
        )
