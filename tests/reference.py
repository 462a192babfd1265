"""NumPy references, written from FlashInfer's definitions and independent of
pagedkv's kernels (plain loops and float64 where arithmetic is involved)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def seq_lens(kv_indptr: np.ndarray, kv_last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    pages = np.diff(kv_indptr.astype(np.int64))
    return np.where(pages > 0, (pages - 1) * page_size + kv_last_page_len, 0).astype(np.int32)


def batch_indices_positions(
    append_indptr: np.ndarray, lens: np.ndarray, nnz: int
) -> tuple[np.ndarray, np.ndarray]:
    batch_indices = np.zeros(nnz, np.int32)
    positions = np.zeros(nnz, np.int32)
    for b in range(len(lens)):
        lo, hi = int(append_indptr[b]), int(append_indptr[b + 1])
        for j in range(lo, hi):
            batch_indices[j] = b
            positions[j] = lens[b] - (hi - lo) + (j - lo)
    return batch_indices, positions


def slot(
    pos: int, b: int, kv_indptr: np.ndarray, kv_indices: np.ndarray, page_size: int
) -> tuple[int, int]:
    """(page, offset in page) of sequence position pos of request b."""
    return int(kv_indices[kv_indptr[b] + pos // page_size]), pos % page_size


def page_slice(layout: str, kv: int, page: int, t: int) -> tuple:
    """Index of a token's [H, D] in a one-tensor pool."""
    if layout == "NHD":
        return (page, kv, t, slice(None), slice(None))
    return (page, kv, slice(None), t, slice(None))


def append(
    pool: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    batch_indices: np.ndarray,
    positions: np.ndarray,
    kv_indices: np.ndarray,
    kv_indptr: np.ndarray,
    layout: str,
) -> np.ndarray:
    """The one-tensor pool after the append (a new array)."""
    out = pool.copy()
    page_size = pool.shape[2] if layout == "NHD" else pool.shape[3]
    for i in range(len(batch_indices)):
        page, t = slot(int(positions[i]), int(batch_indices[i]), kv_indptr, kv_indices, page_size)
        out[page_slice(layout, 0, page, t)] = key[i]
        out[page_slice(layout, 1, page, t)] = value[i]
    return out


def gather(
    pool: np.ndarray,
    kv_indices: np.ndarray,
    kv_indptr: np.ndarray,
    kv_last_page_len: np.ndarray,
    layout: str,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per request, its cached K and V as [L, H, D] (NHD order)."""
    page_size = pool.shape[2] if layout == "NHD" else pool.shape[3]
    lens = seq_lens(kv_indptr, kv_last_page_len, page_size)
    out = []
    for b in range(len(lens)):
        ks, vs = [], []
        for pos in range(int(lens[b])):
            page, t = slot(pos, b, kv_indptr, kv_indices, page_size)
            ks.append(pool[page_slice(layout, 0, page, t)])
            vs.append(pool[page_slice(layout, 1, page, t)])
        shape = (0, *pool.shape[-2:]) if layout == "NHD" else (0, pool.shape[2], pool.shape[4])
        out.append(
            (
                np.stack(ks) if ks else np.zeros(shape, pool.dtype),
                np.stack(vs) if vs else np.zeros(shape, pool.dtype),
            )
        )
    return out


@dataclass
class PagedBatch:
    """A batch's page table over a shuffled pool with spare pages.

    Lengths are after the append; the pool holds more pages than the batch
    uses, so untouched pages prove that nothing else was written.
    """

    page_size: int
    num_pages: int
    seq_lens: np.ndarray
    append_lens: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    append_indptr: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def nnz(self) -> int:
        return int(self.append_indptr[-1])


def paged_batch(
    rng: np.random.Generator,
    page_size: int,
    seq_lens_after: list[int],
    append_lens: list[int],
    spare_pages: int = 3,
) -> PagedBatch:
    lens = np.array(seq_lens_after, np.int64)
    pages = -(-lens // page_size)
    num_pages = int(pages.sum()) + spare_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = perm[: kv_indptr[-1]].copy()
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0).astype(np.int32)
    append_indptr = np.concatenate([[0], np.cumsum(append_lens)]).astype(np.int32)
    return PagedBatch(
        page_size,
        num_pages,
        lens.astype(np.int32),
        np.array(append_lens, np.int32),
        kv_indptr,
        kv_indices,
        last,
        append_indptr,
    )


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes (Press et al.), as FlashInfer computes them."""
    n = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    slopes += [2.0 ** (-4.0 * (2 * (h - n) + 1) / n) for h in range(n, num_heads)]
    return np.array(slopes, np.float64)


def rotate(
    x: np.ndarray, positions: np.ndarray, rope_scale: float, rope_theta: float
) -> np.ndarray:
    """Llama rotary embedding (rotate-half) of x [..., n, D] at positions [n]."""
    d = x.shape[-1]
    inv_freq = rope_theta ** (-np.arange(0, d // 2, dtype=np.float64) * 2 / d)
    angle = (positions.astype(np.float64) / rope_scale)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    lo, hi = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_positions: np.ndarray,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window_left: int = -1,
    pos_encoding_mode: str = "NONE",
    rope_scale: float = 1.0,
    rope_theta: float = 1e4,
    qk_scale: float = 1.0,
    v_scale: float = 1.0,
    alibi_from_zero: bool = False,
    mask: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of one request: q [Lq, Hq, D] at q_positions over
    k, v [L, Hkv, D] at positions 0..L-1. Returns o [Lq, Hq, D] and the base-2
    lse [Lq, Hq] (-inf and o = 0 where no key is visible).

    ALiBi biases key j by slope * (j - q_position) (FlashInfer's prefill), or
    with alibi_from_zero by slope * j (FlashInfer's decode kernels): the same
    o, an lse higher by slope * q_position * log2(e). mask [Lq, L] (bool), if
    given, hides the keys where it is False (FlashInfer's custom mask).
    sinks [Hq], if given, are gpt-oss's sink logits: one more term e^sink in
    each row's denominator, with no value (FlashInfer's sink_softmax)."""
    q = q.astype(np.float64)
    k = k.astype(np.float64)
    v = v.astype(np.float64)
    lq, hq, d = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    kv_pos = np.arange(length)
    if pos_encoding_mode == "ROPE_LLAMA":
        q = rotate(q.transpose(1, 0, 2), q_positions, rope_scale, rope_theta).transpose(1, 0, 2)
        k = rotate(k.transpose(1, 0, 2), kv_pos, rope_scale, rope_theta).transpose(1, 0, 2)
    k = np.repeat(k, group, axis=1)  # [L, Hq, D]
    v = np.repeat(v, group, axis=1)
    scale = (1 / np.sqrt(d) if sm_scale is None else sm_scale) * qk_scale
    s = np.einsum("qhd,khd->qhk", q, k) * scale
    if logits_soft_cap:
        s = logits_soft_cap * np.tanh(s / logits_soft_cap)
    if pos_encoding_mode == "ALIBI":
        distance = kv_pos[None, :] - (0 if alibi_from_zero else q_positions[:, None])
        s = s + alibi_slopes(hq)[None, :, None] * distance[:, None, :]
    visible = np.ones((lq, length), bool)
    if causal:
        visible &= kv_pos[None, :] <= q_positions[:, None]
    if window_left >= 0:
        visible &= kv_pos[None, :] >= q_positions[:, None] - window_left
    if mask is not None:
        visible &= mask
    s = np.where(visible[:, None, :], s, -np.inf)
    top = s.max(axis=-1, keepdims=True, initial=-np.inf)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None]
    if sink is not None:
        top = np.maximum(top, sink)
    safe_top = np.where(np.isfinite(top), top, 0)
    p = np.exp(s - safe_top)
    total = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - safe_top)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.einsum("qhk,khd->qhd", np.where(total > 0, p / total, 0), v) * v_scale
        lse = np.where(
            total[..., 0] > 0, (np.log(total[..., 0]) + safe_top[..., 0]) / np.log(2), -np.inf
        )
    return o, lse


def mla_gather(
    cache: np.ndarray, kv_indptr: np.ndarray, kv_indices: np.ndarray, b: int, length: int
) -> np.ndarray:
    """The first `length` token rows [length, dim] of request b in an MLA
    cache [pages, page_size, dim], in float64."""
    pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
    rows = len(pages) * cache.shape[1]  # not -1: a rope part may have 0 dims
    return cache[pages].reshape(rows, cache.shape[-1])[:length].astype(np.float64)


def mla_attention(
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    ckv: np.ndarray,
    kpe: np.ndarray,
    qo_indptr: np.ndarray,
    kv_indptr: np.ndarray,
    kv_indices: np.ndarray,
    kv_lens: np.ndarray,
    *,
    causal: bool,
    sm_scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """float64 absorbed MLA of a batch: every head of query row t of
    request b scores (q_nope . ckv_j + q_pe . kpe_j) * sm_scale for its
    request's cached tokens j (causal: those at or before its position
    L - n + i) and returns (o [rows, H, ckv_dim] = softmax-weighted ckv rows,
    base-2 lse [rows, H]); rows that see no key get o = 0, lse = -inf."""
    rows, heads, ckv_dim = q_nope.shape
    o = np.zeros((rows, heads, ckv_dim))
    lse = np.full((rows, heads), -np.inf)
    for b in range(len(kv_lens)):
        first, end = int(qo_indptr[b]), int(qo_indptr[b + 1])
        n, length = end - first, int(kv_lens[b])
        c = mla_gather(ckv, kv_indptr, kv_indices, b, length)
        k = mla_gather(kpe, kv_indptr, kv_indices, b, length)
        s = (
            np.einsum("thd,jd->thj", q_nope[first:end].astype(np.float64), c)
            + np.einsum("thd,jd->thj", q_pe[first:end].astype(np.float64), k)
        ) * sm_scale
        if causal:
            position = length - n + np.arange(n)
            seen = np.arange(length)[None, :] <= position[:, None]
            s = np.where(seen[:, None, :], s, -np.inf)
        top = s.max(axis=-1, keepdims=True, initial=-np.inf)
        top = np.where(np.isfinite(top), top, 0)
        p = np.exp(s - top)
        total = p.sum(axis=-1)
        live = total > 0
        safe = np.where(live, total, 1)
        o[first:end] = np.einsum("thj,jd->thd", p / safe[..., None], c)
        lse[first:end] = np.where(live, (np.log(safe) + top[..., 0]) / np.log(2), -np.inf)
    return o, lse


def int8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows x [..., D] as int8 codes [..., D] and float32 scales [...]: per
    row, s = max |x| / 127 and codes round(x / s), ties to even (0 for a
    zero row). Written from the format's definition, in float64."""
    x = np.asarray(x, np.float64)
    amax = np.abs(x).max(axis=-1)
    safe = np.where(amax > 0, amax, 1.0)[..., None]
    codes = np.where(amax[..., None] > 0, np.rint(x * (127 / safe)), 0).astype(np.int8)
    return codes, (amax / 127).astype(np.float32)


def int8_roundtrip(x: np.ndarray) -> np.ndarray:
    """What an int8 pool keeps of rows x [..., D], in float64."""
    codes, scales = int8_quantize(x)
    return codes * scales[..., None].astype(np.float64)


def int8_pages(x: np.ndarray) -> np.ndarray:
    """Float pages x [..., A, B, D] (a pool's [P, H, D] or [H, P, D] halves)
    as an int8 pool's [..., A, B, D + 4]: each half's codes in the same order,
    then its rows' float32 scales [A, B]."""
    codes, scales = int8_quantize(x)
    lead, (a, b, d) = x.shape[:-3], x.shape[-3:]
    packed = np.concatenate(
        [codes.reshape(*lead, a * b * d), scales.reshape(*lead, a * b).view(np.int8)], axis=-1
    )
    return packed.reshape(*lead, a, b, d + 4)


def int8_page_values(pages: np.ndarray) -> np.ndarray:
    """The float64 values [..., A, B, D] an int8 pool's pages [..., A, B, D + 4] hold."""
    lead, (a, b, width) = pages.shape[:-3], pages.shape[-3:]
    d = width - 4
    flat = np.ascontiguousarray(pages).reshape(*lead, a * b * width)
    codes = flat[..., : a * b * d].reshape(*lead, a, b, d)
    scales = flat[..., a * b * d :].copy().view(np.float32).reshape(*lead, a, b)
    return codes * scales[..., None].astype(np.float64)
