"""FlashInfer's block-table entry points: attention over a paged cache whose
page table is a dense ``block_tables [B, max_pages]`` with ``seq_lens [B]``.

vLLM's and SGLang's FlashInfer backends call these directly (trtllm-gen and
XQA kernels on NVIDIA GPUs). A block table is a CSR page table with a fixed
row stride: request b's pages are ``block_tables[b, :ceil(seq_lens[b] /
page_size)]``. `csr_from_block_tables` turns one into the other on the host
(the index arrays only; the cache is read where it lies) and the calls run on
pagedkv's decode and prefill wrappers. The attention scale comes fused, as in
FlashInfer: ``bmm1_scale = q_scale * k_scale * sm_scale`` and ``bmm2_scale =
v_scale / o_scale``. Speculative decode (``q_len_per_req > 1``, or
variable query lengths through ``cum_seq_lens_q``) is causal, aligned to the
end of each sequence, or with XQA's full draft ``mask`` not causal among the
draft tokens (`draft_mask_is_causal`); sinks are gpt-oss's
(pagedkv.attention_sinks). An fp8 query is widened to bfloat16 (a copy of
the query, not of the cache) and the output written in ``out_dtype``, else
``out``'s dtype, else the query's, as FlashInfer's. TRT-LLM's separate K and
V page tables are taken where they agree or describe its interleaved pool
(`_shared_page_table`). ``workspace_buffer`` is neither read nor written
(FlashInfer's kernels lay it out as their own). What only the GPU kernels
do (block sparsity, context parallelism, other separate K and V tables,
tree draft masks) raises before anything is written. NVFP4 outputs
(``out_dtype="nvfp4"`` with ``o_sf_scale``) are quantized from a float32
output (pagedkv._plan.nvfp4_output). Skip-softmax sparsity
(``skip_softmax_threshold_scale_factor``) trades accuracy for speed: it is
taken, and the attention computed exactly, skipping nothing (its limit).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._checks import (
    APPROXIMATIONS,
    check_float,
    check_int,
    check_scale,
    host_int_array,
    refuse_gpu_only,
)
from ._ops.tensors import Array, check_array, to_host_numpy
from ._plan.block_tables import check_multi_ctas_kv_counter_buffer, csr_from_block_tables
from ._plan.nvfp4_output import check_nvfp4_request, nvfp4_output, wants_nvfp4
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .nvfp4 import FP4Tensor, trtllm_v_scales_linear
from .prefill import BatchPrefillWithPagedKVCacheWrapper


def _refuse_gpu_only(function: str, options: dict[str, Any], nvfp4_kv: bool = False) -> bool:
    """Raises for what only the GPU kernels do; returns whether the call
    asks for an NVFP4 output (checked, its o_sf options taken). nvfp4_kv:
    the call takes kv_cache_sf (an NVFP4 cache in trtllm-gen's layout)."""
    if nvfp4_kv:
        options = {**options, "kv_cache_sf": None}
    nvfp4 = wants_nvfp4(options.get("out"), options.get("out_dtype"))
    if nvfp4:
        check_nvfp4_request(
            function, options["query"], options["out"], options.get("o_sf_scale"),
            options.get("o_sf_vec_size"),
        )  # fmt: skip
        options = {**options, "o_sf_scale": None, "o_sf_vec_size": None}
    refuse_gpu_only(function, options, APPROXIMATIONS)
    return nvfp4


def _finish(o: Array, lse: Array, nvfp4: bool, options: dict[str, Any], return_lse: bool) -> Any:
    """The call's result: o (as NVFP4 when asked), with lse when asked."""
    if nvfp4:
        o = nvfp4_output(o, options["o_sf_scale"], options["out"])
    return (o, lse) if return_lse else o


def draft_mask_is_causal(mask: Array, q_lens: np.ndarray) -> bool:
    """Reads FlashInfer's packed speculative-decode mask, [B, q_len, words]
    (or [tokens, words] for ragged queries, each request's rows in turn):
    bit j of a request's row i, little-endian in uint16 or uint32 words,
    says its draft token i sees its draft token j (every earlier token is
    seen). True for the causal mask (j <= i), False for the full one,
    ValueError for any other (tree masks are not supported). q_lens [B]:
    each request's draft tokens."""
    words = to_host_numpy(mask)
    if words.ndim not in (2, 3) or words.dtype.kind not in "iu":
        raise ValueError(f"mask must be [B, q_len, words] or [tokens, words], got {words.shape}")
    most = int(q_lens.max()) if len(q_lens) else 0
    if words.ndim == 3:
        fits = words.shape[0] == len(q_lens) and words.shape[1] >= most
        rows = [words[b, :n] for b, n in enumerate(q_lens)]
    else:
        fits = words.shape[0] == int(q_lens.sum())
        starts = np.concatenate([[0], np.cumsum(q_lens)])
        rows = [words[s : s + n] for s, n in zip(starts, q_lens, strict=False)]
    if not fits or words.shape[-1] * words.itemsize * 8 < most:
        raise ValueError(f"mask {words.shape} does not hold rows of {most} draft tokens")
    kinds = set()
    for row in rows:
        n = len(row)
        bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), axis=-1, bitorder="little")
        block = bits[:, :n].astype(bool)
        if n > 1 or not block.all():  # one draft token: causal and full alike
            causal = np.array_equal(block, np.tril(np.ones((n, n), bool)))
            kinds.add("causal" if causal else "full" if block.all() else "other")
    if "other" in kinds or len(kinds) > 1:
        raise ValueError(
            "mask: only the causal or the full draft mask is supported (not tree masks)"
        )
    return kinds != {"full"}


def _cache_geometry(kv_cache: Any, kv_layout: str) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, head_dim) of FlashInfer's paged cache: one
    tensor [pages, 2, P, H, D] (NHD; [pages, 2, H, P, D] for HND) or a K, V pair."""
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if isinstance(kv_cache, (tuple, list)):
        shape = tuple(kv_cache[0].shape)
        if len(kv_cache) != 2 or len(shape) != 4 or tuple(kv_cache[1].shape) != shape:
            raise ValueError("kv_cache must be one tensor or a pair of equal 4-D K and V tensors")
    else:
        full = tuple(kv_cache.shape)
        if len(full) != 5 or full[1] != 2:
            raise ValueError(f"kv_cache must be [num_pages, 2, ...] (5-D), got {full}")
        shape = (full[0], *full[2:])
    _, a, b, head_dim = shape
    return (a, b, head_dim) if kv_layout == "NHD" else (b, a, head_dim)


def _shared_page_table(
    kv_cache: Any, block_tables: Array, seq_lens: Array, page_size: int, shared: bool
) -> tuple[Any, Any]:
    """(cache, [B, max_pages] table) for pagedkv's one page table of K and V.
    TRT-LLM's separate tables [B, 2, max_pages] (K's row, V's row) are taken
    when the rows agree, or in its interleaved pool: one tensor [2N, ...]
    whose K page p is row 2p and V page p row 2p + 1, a (pool, pool) pair
    read as the one-tensor cache [N, 2, ...] (a view) with table K // 2."""
    if len(block_tables.shape) != (2 if shared else 3):
        raise ValueError(
            "separate K and V page tables (uses_shared_paged_kv_idx=False) come as"
            " block_tables [B, 2, max_pages], a shared one as [B, max_pages]"
        )
    if shared:
        return kv_cache, block_tables
    table = host_int_array("block_tables", block_tables, 3)
    lens = host_int_array("seq_lens", seq_lens, 1)
    if table.shape[1] != 2 or table.shape[0] != lens.shape[0]:
        raise ValueError(
            f"block_tables must be [B, max_pages] or [B, 2, max_pages], got {table.shape}"
        )
    used = np.arange(table.shape[2])[None, :] < -(-lens[:, None] // page_size)
    k_rows, v_rows = table[:, 0], table[:, 1]
    if np.array_equal(k_rows[used], v_rows[used]):
        return kv_cache, k_rows
    pool = kv_cache[0] if isinstance(kv_cache, (tuple, list)) else None
    interleaved = (
        pool is not None
        and kv_cache[1] is pool
        and pool.shape[0] % 2 == 0
        and (k_rows[used] % 2 == 0).all()
        and np.array_equal(v_rows[used], k_rows[used] + 1)
    )
    if not interleaved:
        raise ValueError(
            "separate K and V page tables are taken when their rows agree, or as TRT-LLM's"
            " interleaved pool (one tensor, K page 2p, V page 2p + 1)"
        )
    try:
        cache = pool.view(pool.shape[0] // 2, 2, *pool.shape[1:])
    except RuntimeError:
        raise ValueError("the interleaved K/V pool must be contiguous across pages") from None
    return cache, np.where(used, k_rows // 2, 0)


def _check_call(query: Any, kv_cache: Any, block_tables: Any, out: Any, **bounds: Any) -> None:
    """Raises TypeError unless query, kv_cache (a pool or a (K, V) pair),
    block_tables and `out` (if given: an array, or FlashInfer's NVFP4
    output) are what they must be, before any is read, or ValueError unless
    each of `bounds` (the lengths FlashInfer sizes its kernels by; pagedkv
    reads the lengths themselves) is an integer >= 0."""
    check_array("query", query)
    for part in kv_cache if isinstance(kv_cache, (tuple, list)) else (kv_cache,):
        check_array("kv_cache", part)
    check_array("block_tables", block_tables)
    if out is not None and not isinstance(out, FP4Tensor):
        check_array("out", out)
    for name, value in bounds.items():
        check_int(name, value, 0)


def _paged_attention(
    function: str,
    query: Array,
    kv_cache: Any,
    block_tables: Array,
    seq_lens: Array,
    qo_indptr: np.ndarray | None,
    q_len_per_req: int,
    scales: tuple[float, float],
    causal: bool,
    window_left: int,
    kv_layout: str,
    outputs: tuple[Array | None, Any, Array | None],
    sinks: Any,
    shared: bool,
    kv_cache_sf: Any = None,
) -> tuple[Array, Array]:
    """One plan and run: the decode wrapper for uniform query lengths, the
    prefill wrapper for ragged ones (qo_indptr), on an fp8 query widened to
    bfloat16. outputs: (out, out_dtype, lse) as the caller gave them; the
    output comes back in out_dtype (else out's, else the query's), in out
    when given, beside the lse (the caller's, filled, when given).
    kv_cache_sf: an NVFP4 cache's (K, V) block scales in trtllm-gen's
    layout (V's interleaved: pagedkv.nvfp4.TRTLLM_V_SCALE_ORDER); the global
    decode scales come folded into the bmm scales."""
    page_size = _cache_geometry(kv_cache, kv_layout)[0]
    pool = kv_cache
    kv_cache, block_tables = _shared_page_table(kv_cache, block_tables, seq_lens, page_size, shared)
    if kv_cache_sf is not None:
        if not isinstance(kv_cache_sf, (tuple, list)) or len(kv_cache_sf) != 2:
            raise ValueError(f"{function}: kv_cache_sf must be a (K, V) pair of block scales")
        if kv_cache is not pool:  # TRT-LLM's interleaved pool: its scales interleave alike
            if kv_cache_sf[0] is not kv_cache_sf[1]:
                raise ValueError(
                    f"{function}: an interleaved K/V pool takes its scales as one pool too"
                )
            sf_pool = kv_cache_sf[0]
            pairs = sf_pool.view(sf_pool.shape[0] // 2, 2, *sf_pool.shape[1:])
            kv_cache_sf = (pairs[:, 0], pairs[:, 1])
        kv_cache_sf = (kv_cache_sf[0], trtllm_v_scales_linear(kv_cache_sf[1], kv_layout))
    page_size, num_kv_heads, head_dim = _cache_geometry(kv_cache, kv_layout)
    if kv_cache_sf is not None:
        head_dim *= 2  # two e2m1 codes a byte
    table = csr_from_block_tables(block_tables, seq_lens, page_size)
    if len(query.shape) != 3:
        raise ValueError(f"{function}: query must be [tokens, num_qo_heads, head_dim]")
    out, out_dtype, lse = outputs
    want = out_dtype if out_dtype is not None else out.dtype if out is not None else query.dtype
    kv_dtype = (kv_cache[0] if isinstance(kv_cache, (tuple, list)) else kv_cache).dtype
    geometry = (query.shape[1], num_kv_heads, head_dim, page_size)
    sm_scale, v_scale = scales
    # FlashInfer's kernels lay the workspace out as their own: the wrappers
    # keep their scratch apart (no workspace).
    if qo_indptr is None:
        wrapper = BatchDecodeWithPagedKVCacheWrapper(
            None, kv_layout, use_tensor_cores=q_len_per_req > 1
        )
        wrapper.plan(
            table.indptr, table.indices, table.last_page_len, *geometry,
            window_left=window_left, sm_scale=sm_scale, q_data_type=query.dtype,
            kv_data_type=kv_dtype, o_data_type=want, q_len_per_req=q_len_per_req,
        )  # fmt: skip
    else:
        wrapper = BatchPrefillWithPagedKVCacheWrapper(None, kv_layout)
        wrapper.plan(
            qo_indptr, table.indptr, table.indices, table.last_page_len, *geometry,
            causal=causal, sm_scale=sm_scale, window_left=window_left,
            q_data_type=query.dtype, kv_data_type=kv_dtype, o_data_type=want,
        )  # fmt: skip
    return wrapper.run(
        query, kv_cache, v_scale=v_scale, return_lse=True, out=out, lse=lse, sinks=sinks,
        kv_cache_sf=kv_cache_sf,
    )  # fmt: skip


def trtllm_batch_decode_with_kv_cache(
    query: Array,
    kv_cache: Any,
    workspace_buffer: Array,
    block_tables: Array,
    seq_lens: Array,
    max_seq_len: int,
    bmm1_scale: Any = 1.0,
    bmm2_scale: Any = 1.0,
    window_left: int = -1,
    out: Array | None = None,
    out_dtype: Any = None,
    o_sf_scale: float | None = None,
    o_sf_vec_size: int | None = None,
    sinks: Any = None,
    kv_layout: str = "HND",
    enable_pdl: bool | None = None,
    backend: str = "auto",
    q_len_per_req: int | None = 1,
    o_scale: float | None = 1.0,
    mask: Array | None = None,
    max_q_len: int | None = None,
    cum_seq_lens_q: Array | None = None,
    skip_softmax_threshold_scale_factor: float | None = None,
    kv_cache_sf: Any = None,
    uses_shared_paged_kv_idx: bool = True,
    lse: Array | None = None,
    return_lse: bool = False,
    bmm1_scale_log2: Array | None = None,
    multi_ctas_kv_counter_buffer: Array | None = None,
    enable_block_sparse_attention: bool = False,
    cp_world: int = 1,
    cp_rank: int = 0,
    causal_seqlens_kv_global: Array | None = None,
    bf16q_fp8kv_transform_mode: str | None = None,
    request_order: Array | None = None,
    request_order_plan: Any = None,
) -> Any:
    """Decode attention of query [B * q_len_per_req, Hq, D] over the pages
    block_tables [B, max_pages] names, seq_lens [B] tokens each, FlashInfer
    0.7's signature (module docstring).

    q_len_per_req > 1, or cum_seq_lens_q [B + 1] with max_q_len for ragged
    query counts, is speculative decode: each request's queries are its
    last tokens, causal; mask [B, q_len, words], FlashInfer's packed draft
    mask, may say causal or full (no mask among the drafts), nothing else.
    bmm1_scale_log2, given, replaces bmm1_scale (``bmm1_scale * log2(e)``).
    o_scale (positive) is checked and read no further: FlashInfer's kernels
    split the output's factor between it and bmm2_scale, whose product with
    1 / o_scale they store, the same number. max_seq_len (an integer >= 0),
    enable_pdl, backend and cp_rank are accepted and read no further.
    multi_ctas_kv_counter_buffer is checked as FlashInfer checks it and left
    as it is (pagedkv's kernels count nothing). Returns the output (out when
    given), and its lse [tokens, Hq] with return_lse; a given lse is filled
    either way.

    Examples
    --------
    >>> import torch, pagedkv
    >>> cache = torch.randn(4, 2, 2, 16, 64)       # HND: [pages, 2, Hkv, P, D]
    >>> q = torch.randn(2, 8, 64)
    >>> o = pagedkv.trtllm_batch_decode_with_kv_cache(
    ...     q, cache, None, torch.tensor([[0, 1], [2, 0]]), torch.tensor([20, 5]), 32,
    ...     bmm1_scale=64 ** -0.5)
    >>> o.shape
    torch.Size([2, 8, 64])
    """
    options = dict(locals())
    nvfp4 = _refuse_gpu_only("trtllm_batch_decode_with_kv_cache", options, nvfp4_kv=True)
    _check_call(query, kv_cache, block_tables, out, max_seq_len=max_seq_len)
    check_multi_ctas_kv_counter_buffer(
        multi_ctas_kv_counter_buffer, len(seq_lens), query.shape[1], query
    )
    if o_scale is not None:
        check_float("o_scale", o_scale, positive=True)
    sm_scale = (
        check_scale("bmm1_scale", bmm1_scale)
        if bmm1_scale_log2 is None
        else check_scale("bmm1_scale_log2", bmm1_scale_log2) / math.log2(math.e)
    )
    if (cum_seq_lens_q is None) != (max_q_len is None):
        raise ValueError("cum_seq_lens_q and max_q_len come together")
    qo_indptr = (
        None if cum_seq_lens_q is None else host_int_array("cum_seq_lens_q", cum_seq_lens_q, 1)
    )
    q_len = q_len_per_req or 1
    causal = True
    if mask is not None:
        batch = len(seq_lens)
        q_lens = np.full(batch, q_len) if qo_indptr is None else np.diff(qo_indptr)
        causal = draft_mask_is_causal(mask, q_lens)
        if not causal and qo_indptr is None:
            qo_indptr = np.arange(batch + 1) * q_len  # the prefill kernel's non-causal form
    outputs = (None, "float32", lse) if nvfp4 else (out, out_dtype, lse)
    o, lse = _paged_attention(
        "trtllm_batch_decode_with_kv_cache", query, kv_cache, block_tables, seq_lens,
        qo_indptr, q_len, (sm_scale, check_scale("bmm2_scale", bmm2_scale)), causal,
        window_left, kv_layout, outputs, sinks, uses_shared_paged_kv_idx, kv_cache_sf,
    )  # fmt: skip
    return _finish(o, lse, nvfp4, options, return_lse)


def xqa_batch_decode_with_kv_cache(
    query: Array,
    kv_cache: Any,
    workspace_buffer: Array,
    block_tables: Array,
    seq_lens: Array,
    max_seq_len: int,
    bmm1_scale: Any = 1.0,
    bmm2_scale: Any = 1.0,
    window_left: int = -1,
    out: Array | None = None,
    sinks: Any = None,
    kv_layout: str = "NHD",
    enable_pdl: bool | None = None,
    q_len_per_req: int | None = 1,
    o_scale: float | None = 1.0,
    mask: Array | None = None,
    kv_cache_sf: Any = None,
    q_cu_seq_lens: Array | None = None,
) -> Array:
    """`trtllm_batch_decode_with_kv_cache` in XQA's signature (NHD by
    default; q_cu_seq_lens [B + 1] for ragged speculative queries).

    Examples
    --------
    >>> import torch, pagedkv
    >>> cache = torch.randn(4, 2, 16, 2, 64)       # NHD: [pages, 2, P, Hkv, D]
    >>> o = pagedkv.xqa_batch_decode_with_kv_cache(
    ...     torch.randn(1, 8, 64), cache, None, torch.tensor([[3]]), torch.tensor([9]), 16)
    >>> o.shape
    torch.Size([1, 8, 64])
    """
    _refuse_gpu_only("xqa_batch_decode_with_kv_cache", dict(locals()))
    ragged = q_cu_seq_lens is not None
    return trtllm_batch_decode_with_kv_cache(
        query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len,
        bmm1_scale, bmm2_scale, window_left, out, sinks=sinks, kv_layout=kv_layout,
        q_len_per_req=q_len_per_req, o_scale=o_scale, mask=mask, cum_seq_lens_q=q_cu_seq_lens,
        max_q_len=max_seq_len if ragged else None,
    )  # fmt: skip


def trtllm_batch_context_with_kv_cache(
    query: Array,
    kv_cache: Any,
    workspace_buffer: Array,
    block_tables: Array,
    seq_lens: Array,
    max_q_len: int,
    max_kv_len: int,
    bmm1_scale: Any,
    bmm2_scale: Any,
    batch_size: int,
    cum_seq_lens_q: Array,
    cum_seq_lens_kv: Array,
    window_left: int = -1,
    out: Array | None = None,
    out_dtype: Any = None,
    o_sf_scale: float | None = None,
    o_sf_vec_size: int | None = None,
    kv_layout: str = "HND",
    enable_pdl: bool | None = None,
    sinks: Any = None,
    kv_cache_sf: Any = None,
    skip_softmax_threshold_scale_factor: float | None = None,
    uses_shared_paged_kv_idx: bool = True,
    causal: bool = True,
    lse: Array | None = None,
    return_lse: bool = False,
    multi_ctas_kv_counter_buffer: Array | None = None,
    use_fp16_softmax: bool = False,
    uses_spcompress: bool = False,
    backend: str = "trtllm-gen",
) -> Any:
    """Prefill attention of query [cum_seq_lens_q[-1], Hq, D] over the pages
    block_tables [B, max_pages] names, seq_lens [B] tokens each (the
    queries' own included), FlashInfer 0.7's signature (module docstring).

    causal aligns each request's queries to the end of its sequence.
    batch_size must be B and cum_seq_lens_kv have B + 1 entries, not read
    further: the pages and lengths come from block_tables and seq_lens, as
    FlashInfer's kernel reads them (its own tests pass page counts there).
    max_q_len, max_kv_len (integers >= 0), enable_pdl and backend are
    accepted and read no further.

    Examples
    --------
    >>> import torch, pagedkv
    >>> cache = torch.randn(4, 2, 2, 16, 64)       # HND: [pages, 2, Hkv, P, D]
    >>> o = pagedkv.trtllm_batch_context_with_kv_cache(
    ...     torch.randn(7, 8, 64), cache, None, torch.tensor([[0, 1], [2, 3]]),
    ...     torch.tensor([20, 3]), 4, 20, 0.125, 1.0, 2, torch.tensor([0, 4, 7]),
    ...     torch.tensor([0, 20, 23]))
    >>> o.shape
    torch.Size([7, 8, 64])
    """
    options = dict(locals())
    nvfp4 = _refuse_gpu_only("trtllm_batch_context_with_kv_cache", options, nvfp4_kv=True)
    _check_call(query, kv_cache, block_tables, out, max_q_len=max_q_len, max_kv_len=max_kv_len)
    lens = host_int_array("seq_lens", seq_lens, 1)
    kv_indptr = host_int_array("cum_seq_lens_kv", cum_seq_lens_kv, 1)
    if batch_size != lens.shape[0] or kv_indptr.shape[0] != batch_size + 1:
        raise ValueError("batch_size and cum_seq_lens_kv [B + 1] must agree with seq_lens [B]")
    check_multi_ctas_kv_counter_buffer(
        multi_ctas_kv_counter_buffer, batch_size, query.shape[1], query
    )
    o, lse = _paged_attention(
        "trtllm_batch_context_with_kv_cache", query, kv_cache, block_tables, lens,
        host_int_array("cum_seq_lens_q", cum_seq_lens_q, 1), 1,
        (check_scale("bmm1_scale", bmm1_scale), check_scale("bmm2_scale", bmm2_scale)), causal,
        window_left, kv_layout, (None, "float32", lse) if nvfp4 else (out, out_dtype, lse),
        sinks, uses_shared_paged_kv_idx, kv_cache_sf,
    )  # fmt: skip
    return _finish(o, lse, nvfp4, options, return_lse)
