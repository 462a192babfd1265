"""The forms FlashInfer 0.7's prefill wrappers return the log-sum-exp in.

The kernels write lse [rows, Hq] in base 2 (FlashInfer's kernels fold
log2(e) into the softmax scale). ``run(lse_base="ln")`` asks for natural
logarithms (torch.logsumexp's, what merges written with expf take) and
``lse_layout="HN"`` for [Hq, rows], contiguous. A caller's `lse` buffer is
in the layout asked for; for "HN" the kernel writes a fresh [rows, Hq]
array that is then transposed into it.
"""

from __future__ import annotations

import math

from max.dtype import DType

from ._checks import check_output
from ._ops.tensors import Array, device_of, is_torch

LSE_BASES = ("log2", "ln")
LSE_LAYOUTS = ("NH", "HN")


def staged_lse(
    lse: Array | None, lse_base: str, lse_layout: str, q: Array, return_lse: bool
) -> tuple[Array | None, Array | None]:
    """(the lse the kernel writes, the caller's buffer to finish into).

    Checks lse_base, lse_layout and, for "HN", the caller's buffer (float32
    [Hq, rows], contiguous) before anything runs."""
    if lse_base not in LSE_BASES:
        raise ValueError(f"lse_base must be one of {LSE_BASES}, got {lse_base!r}")
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")
    if not return_lse or lse_layout == "NH":
        return lse, None
    if lse is not None:
        shape = (int(q.shape[1]), int(q.shape[0]))
        check_output('lse (lse_layout="HN")', lse, shape, DType.float32, device_of(q))
    return None, lse


def finished_lse(lse: Array, lse_base: str, lse_layout: str, into: Array | None) -> Array:
    """The kernel's base-2 lse [rows, Hq] in the base and layout asked for,
    in place for "NH", into `into` (or a new array) for "HN"."""
    scale = math.log(2) if lse_base == "ln" else 1.0
    if lse_layout == "NH":
        if scale != 1.0:
            lse *= scale
        return lse
    transposed = lse.t() if is_torch(lse) else lse.T
    if into is None:
        into = transposed.contiguous() if is_torch(lse) else transposed.copy()
    elif is_torch(into):
        into.copy_(transposed)
    else:
        into[...] = transposed
    if scale != 1.0:
        into *= scale
    return into
