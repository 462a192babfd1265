"""Custom attention masks of prefill, in FlashInfer's packed form.

Request b's mask is a [qo_len_b, kv_len_b] boolean matrix, row-major: query
i may see key j where it is True (and where the window, if any, lets it);
``causal`` is ignored when a mask is given. ``custom_mask`` is all requests'
matrices flattened and concatenated; ``packed_custom_mask`` the same packed
8 to a byte, little-endian, each request's bits from a byte boundary
(:func:`segment_packbits`). plan() turns either into one bit offset per query
row, which is what the kernel reads (mojo_ops/attention/custom_mask.mojo).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._checks import INT32_MAX
from ._ops.contract import MASK_READ_PADDING
from ._ops.tensors import Array, new_like, to_host_numpy


def packbits(x: Array, bitorder: str = "big") -> Array:
    """Packs a boolean array 8 to a byte, as ``numpy.packbits`` (FlashInfer's
    ``packbits``); the result is of x's kind (NumPy or torch, on the CPU).

    Examples
    --------
    >>> import numpy as np
    >>> from pagedkv.custom_mask import packbits
    >>> packbits(np.array([1, 0, 0, 0, 0, 0, 0, 0, 1], bool), bitorder="little").tolist()
    [1, 1]
    """
    packed = np.packbits(_bools("x", x).reshape(-1), bitorder=bitorder)
    return _like(x, packed)


def segment_packbits(x: Array, indptr: Array, bitorder: str = "big") -> tuple[Array, Array]:
    """Packs each segment x[indptr[i]:indptr[i + 1]] from a byte boundary.

    Parameters
    ----------
    x : array of bool, 1-D
    indptr : array of int, [segments + 1], non-decreasing from 0 to len(x).
    bitorder : "big" or "little" (FlashInfer's masks are "little").

    Returns
    -------
    (packed, packed_indptr): the uint8 bytes of all segments and where each
    segment's bytes start, [segments + 1] (int32), of x's kind.

    Examples
    --------
    >>> import numpy as np
    >>> from pagedkv.custom_mask import segment_packbits
    >>> bits = np.array([1, 1, 1, 0, 1], bool)
    >>> packed, indptr = segment_packbits(bits, np.array([0, 3, 5]), bitorder="little")
    >>> packed.tolist(), indptr.tolist()
    ([7, 2], [0, 1, 2])
    """
    bits = _bools("x", x).reshape(-1)
    bounds = _indptr("indptr", indptr, len(bits))
    parts = [
        np.packbits(bits[lo:hi], bitorder=bitorder)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    starts = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=starts[1:])
    packed = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return _like(x, packed), _like(x, starts.astype(np.int32))


@dataclass(frozen=True)
class CustomMaskRows:
    """What the attention op reads of a custom mask.

    bits: uint8, the packed (little-endian) masks then MASK_READ_PADDING zero
        bytes. row_bits: int32 [rows of q], each query row's bit offset of key 0.
    """

    bits: np.ndarray
    row_bits: np.ndarray


NO_MASK = CustomMaskRows(np.zeros(MASK_READ_PADDING, np.uint8), np.zeros(0, np.int32))
"""The operands of a call without a custom mask (an empty row_bits)."""


def custom_mask_rows(
    qo_lens: np.ndarray,
    kv_lens: np.ndarray,
    custom_mask: Array | None = None,
    packed_custom_mask: Array | None = None,
) -> CustomMaskRows:
    """Checks a FlashInfer custom mask against the requests' query and key
    counts and returns the op's operands. Raises ValueError on a mask of the
    wrong size or dtype. Given both forms, the packed one is used, as
    FlashInfer does."""
    qo = np.asarray(qo_lens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    sizes = qo * kv
    if custom_mask is None and packed_custom_mask is None:
        raise ValueError("give custom_mask or packed_custom_mask")
    if packed_custom_mask is None:
        bits = _bools("custom_mask", custom_mask).reshape(-1)
        if len(bits) != sizes.sum():
            raise ValueError(
                f"custom_mask has {len(bits)} elements; the requests' qo_len * kv_len "
                f"sum to {int(sizes.sum())}"
            )
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        packed, _ = segment_packbits(bits, bounds, bitorder="little")
    else:
        packed = np.asarray(to_host_numpy(packed_custom_mask))
        if packed.dtype != np.uint8 or packed.ndim != 1:
            raise ValueError(
                f"packed_custom_mask must be 1-D uint8, got {packed.dtype} {packed.shape}"
            )
        need = int(((sizes + 7) // 8).sum())
        if len(packed) != need:
            raise ValueError(
                f"packed_custom_mask has {len(packed)} bytes; the requests' masks pack "
                f"into {need} (each request's from a byte boundary)"
            )
    byte_starts = np.concatenate([[0], np.cumsum((sizes + 7) // 8)])[:-1]
    if len(packed) * 8 > INT32_MAX:
        raise ValueError(f"a custom mask of {len(packed)} bytes is too large (2^28 at most)")
    row_bits = np.concatenate(
        [start * 8 + np.arange(n) * k for start, n, k in zip(byte_starts, qo, kv, strict=True)]
        or [np.zeros(0, np.int64)]
    )
    padded = np.concatenate([np.asarray(packed, np.uint8), np.zeros(MASK_READ_PADDING, np.uint8)])
    return CustomMaskRows(padded, row_bits.astype(np.int32))


def _bools(name: str, x: Array) -> np.ndarray:
    values = np.asarray(to_host_numpy(x))
    if values.dtype != np.bool_:
        if not np.issubdtype(values.dtype, np.integer) or not np.isin(values, (0, 1)).all():
            raise ValueError(f"{name} must be boolean (or 0/1 integers), got {values.dtype}")
        values = values.astype(bool)
    return values


def _indptr(name: str, indptr: Array, total: int) -> np.ndarray:
    bounds = np.asarray(to_host_numpy(indptr)).astype(np.int64).reshape(-1)
    if len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != total or (np.diff(bounds) < 0).any():
        raise ValueError(f"{name} must run from 0 to {total} without decreasing")
    return bounds


def _like(x: Array, values: np.ndarray) -> Array:
    return values if isinstance(x, np.ndarray) else new_like(x, values)


def multi_item_mask(
    qo_lens: np.ndarray,
    kv_lens: np.ndarray,
    prefix_len: Array,
    token_pos_in_items: Array,
    token_pos_in_items_len: int,
) -> np.ndarray:
    """FlashInfer's multi-item scoring as a custom mask (boolean, the
    requests' [qo_len, kv_len] matrices flattened and concatenated).

    Request b's keys are prefix_len[b] cached prefix tokens, all visible,
    then its qo_len queries' own tokens: items separated by delimiters (the
    tokens whose position in their item, token_pos_in_items[b *
    token_pos_in_items_len + i], is 0). A token sees the earlier tokens of
    its own item, and tokens from the first delimiter on also see the tokens
    before it (the shared prompt); no token sees a delimiter or is seen from
    one. This is the mask FlashInfer's tests check its kernel against.
    """
    qo = np.asarray(qo_lens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    prefix = np.asarray(to_host_numpy(prefix_len)).astype(np.int64).reshape(-1)
    positions = np.asarray(to_host_numpy(token_pos_in_items)).astype(np.int64).reshape(-1)
    stride = int(token_pos_in_items_len)
    if len(prefix) != len(qo):
        raise ValueError(f"prefix_len_ptr has {len(prefix)} entries for {len(qo)} requests")
    if (stride < qo).any() or len(positions) < stride * (len(qo) - 1) + int(qo[-1:].sum()):
        raise ValueError(
            f"token_pos_in_items_ptr holds {len(positions)} positions, token_pos_in_items_len "
            f"{stride} per request: too few for requests of {qo.tolist()} queries"
        )
    if (prefix + qo != kv).any():
        b = int(np.nonzero(prefix + qo != kv)[0][0])
        raise ValueError(
            f"request {b}: prefix_len {prefix[b]} + {qo[b]} queries != its {kv[b]} cached tokens"
        )
    masks = []
    for b, n in enumerate(qo):
        delimiter = positions[b * stride : b * stride + n] == 0
        pos = np.arange(n)
        group = np.cumsum(delimiter)
        own_item = (group[:, None] == group[None, :]) & (pos[None, :] <= pos[:, None])
        first = int(np.argmax(delimiter)) if delimiter.any() else n
        prompt = (pos >= first)[:, None] & (pos < first)[None, :]
        mask = (own_item | prompt) & ~delimiter[None, :] & ~delimiter[:, None]
        masks.append(np.concatenate([np.ones((n, prefix[b]), bool), mask], axis=1).reshape(-1))
    return np.concatenate(masks) if masks else np.zeros(0, bool)
