"""Weights of linear layers packed for pagedkv's CPU product op.

A weight w [K, N] (the ``x @ w`` convention) is packed as panels
[ceil(N / LINEAR_PANEL), K, LINEAR_PANEL]: panel p holds columns
[p * LINEAR_PANEL, (p + 1) * LINEAR_PANEL) of every row, zero past N. Each
task of the op then reads its panel as one contiguous stream; a model packs
its weights once, when it loads them, and ``graph_ops.linear`` multiplies by
them in a step graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .contract import LINEAR_PANEL
from .kept_arrays import kept_array


def linear_panels_shape(in_features: int, out_features: int) -> tuple[int, int, int]:
    """The packed shape of a weight [in_features, out_features]."""
    return (-(-out_features // LINEAR_PANEL), in_features, LINEAR_PANEL)


def pack_linear_weight(weight):
    """Packs a weight [K, N] into panels [ceil(N / 64), K, 64].

    Parameters
    ----------
    weight : numpy.ndarray or torch.Tensor
        ``[in_features, out_features]``, any dtype; read, not modified
        (a memory-mapped array is fine).

    Returns
    -------
    numpy.ndarray or torch.Tensor
        The panels, contiguous, of the input's kind and dtype; columns past
        ``out_features`` are zero.

    Examples
    --------
    >>> import numpy as np
    >>> from pagedkv._ops.linear_panels import pack_linear_weight
    >>> w = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> p = pack_linear_weight(w)
    >>> p.shape
    (1, 2, 64)
    >>> p[0, :, :3].tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    if weight.ndim != 2:
        raise ValueError(
            f"a linear weight is [in_features, out_features], got shape {tuple(weight.shape)}"
        )
    k, n = (int(d) for d in weight.shape)
    panels, _, width = linear_panels_shape(k, n)
    full = n // width  # panels without padding: one strided copy
    if isinstance(weight, np.ndarray):
        packed = np.empty((panels, k, width), dtype=weight.dtype)
    else:
        import torch

        packed = torch.empty((panels, k, width), dtype=weight.dtype)
    packed[:full] = weight[:, : full * width].reshape(k, full, width).swapaxes(0, 1)
    if full < panels:
        packed[full] = 0
        packed[full, :, : n - full * width] = weight[:, full * width :]
    return packed


def pack_linear_weight_cached(weight: np.ndarray) -> np.ndarray:
    """pack_linear_weight, kept on disk beside a memory-mapped weight.

    A weight memory-mapped from an .npy file (a model's unpacked copy) is
    packed once into ``<name>.panels.npy`` beside it and memory-mapped from
    there afterwards, so a warm start does not pack again; any other array
    (or a folder that cannot be written) is packed in memory.
    """
    source = getattr(weight, "filename", None)
    if not isinstance(weight, np.memmap) or source is None:
        return pack_linear_weight(weight)
    source = Path(source)
    return kept_array(
        source.with_name(f"{source.stem}.panels.npy"),
        linear_panels_shape(*weight.shape),
        weight.dtype,
        lambda: pack_linear_weight(weight),
    )
