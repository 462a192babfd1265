"""FlashInfer's MLA block-table entry points on pagedkv's MLA kernel:
``trtllm_batch_decode_with_kv_cache_mla``, ``trtllm_prefill_with_kv_cache_mla``
and ``xqa_batch_decode_with_kv_cache_mla``.

They take DeepSeek's packed forms, a query ``[B, q_len, H, kv_lora_rank +
qk_rope_head_dim]`` (``q_nope || q_pe``; ``[tokens, H, ...]`` with
``cum_seq_lens_q``) and a cache ``[pages, page_size, kv_lora_rank +
qk_rope_head_dim]`` (or ``[pages, 1, page_size, ...]``), with a dense
``block_tables [B, max_pages]`` and ``seq_lens [B]``. The table becomes the
CSR table on the host (`csr_from_block_tables`, as for the other block-table
calls in pagedkv.block_tables) and the call runs on
`BatchMLAPagedAttentionWrapper`, which reads the packed cache where it lies.
A request's queries are its last tokens, causal. With ``sparse_mla_top_k``
(DeepSeek's sparse attention) ``block_tables`` holds each query row's
``top_k`` cache slots instead (``page x page_size + slot``, -1 padding): the
cache is seen as one-token pages, each query row a request of its own over
the front of its slots, as many as its causal position sees keys. The
scales come fused:
``bmm1_scale`` is the softmax scale with q's and k's scales folded in,
``bmm2_scale`` multiplies the output. The output is bfloat16 for bfloat16
and float8 queries, as FlashInfer's (an fp8 query is widened to bfloat16,
a copy of the query, not of the cache); pagedkv also takes float16 and
float32 queries, whose outputs keep their dtype. What only FlashInfer's GPU
kernels do (the no-rope sparse kernel's per-row lengths, context
parallelism, float16 softmax) raises ValueError before anything is written;
skip-softmax sparsity is taken and computed exactly (skipping nothing).
``workspace_buffer`` is neither read nor written: FlashInfer's kernels lay
it out as their own, and the wrapper keeps its scratch apart.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from max.dtype import DType

from ._checks import (
    APPROXIMATIONS,
    check_int,
    check_output,
    check_scale,
    host_int_array,
    narrow_indices,
    refuse_gpu_only,
)
from ._ops.tensors import Array, check_array, device_of, dtype_of, empty, is_contiguous
from ._plan.block_tables import check_multi_ctas_kv_counter_buffer, csr_from_block_tables
from ._plan.io_dtypes import widened_dtype, widened_query
from .mla import BatchMLAPagedAttentionWrapper

MLA_BLOCK_TABLE_BACKENDS = ("auto", "trtllm-gen", "cute-dsl", "xqa")
"""FlashInfer's kernels for these calls; pagedkv's one MLA kernel plays each."""

LSE_BASES = (None, "base2", "basee")


def _refuse_gpu_only(function: str, options: dict[str, Any]) -> None:
    """Raises ValueError for the options only FlashInfer's GPU kernels take,
    or a backend name it does not have."""
    options = {**options, "use_fp16_softmax": bool(options["use_fp16_softmax"])}
    refuse_gpu_only(function, options, APPROXIMATIONS)
    mla_only = {
        "sparse_mla_top_k_lens": options["sparse_mla_top_k_lens"] is not None,
        "enable_dcp": bool(options["enable_dcp"]),
    }
    given = [name for name, on in mla_only.items() if on]
    if given:
        raise ValueError(f"{function}: {', '.join(given)} are not supported by pagedkv")
    if options["backend"] not in MLA_BLOCK_TABLE_BACKENDS:
        raise ValueError(
            f"{function}: backend must be one of {MLA_BLOCK_TABLE_BACKENDS},"
            f" got {options['backend']!r}"
        )


def _page_rows(block_tables: Array) -> np.ndarray:
    """One page row a request: [B, max_pages] as given, or TRT-LLM's
    [B, 2, max_pages] (K's row, V's row) when the two agree, as they must
    here: an MLA cache row is K and V at once."""
    ndim = len(block_tables.shape) if hasattr(block_tables, "shape") else np.ndim(block_tables)
    if ndim == 3:
        table = host_int_array("block_tables", block_tables, 3)
        if table.shape[1] != 2 or not np.array_equal(table[:, 0], table[:, 1]):
            raise ValueError(
                "block_tables [B, 2, max_pages] must give K and V the same pages:"
                " an MLA cache row holds both"
            )
        return table[:, 0]
    return host_int_array("block_tables", block_tables, 2)


def _packed_cache(kv_cache: Array, width: int) -> Array:
    """The packed cache as [pages, page_size, width] (a view of a 4-D one)."""
    check_array("kv_cache", kv_cache)
    if len(kv_cache.shape) == 4 and kv_cache.shape[1] == 1:
        kv_cache = kv_cache[:, 0]
    if len(kv_cache.shape) != 3 or kv_cache.shape[-1] != width:
        raise ValueError(
            f"kv_cache must be [pages, page_size, {width}] or [pages, 1, page_size, {width}]"
            f" (kv_lora_rank + qk_rope_head_dim), got {list(kv_cache.shape)}"
        )
    return kv_cache


def _query_rows(
    query: Array, width: int, batch: int, cum_seq_lens_q: Array | None, max_q_len: int | None
) -> tuple[Array, np.ndarray]:
    """(query as [tokens, H, width] rows, qo_indptr [B + 1]): q_len queries a
    request from [B, q_len, H, width], or ragged ones from [tokens, H,
    width] with cum_seq_lens_q."""
    check_array("query", query)
    if query.shape[-1] != width:
        raise ValueError(
            f"query's last dim must be kv_lora_rank + qk_rope_head_dim = {width},"
            f" got {list(query.shape)}"
        )
    if cum_seq_lens_q is None:
        if max_q_len is not None:
            raise ValueError("max_q_len is only taken with cum_seq_lens_q")
        if len(query.shape) != 4 or query.shape[0] != batch:
            raise ValueError(
                f"query must be [B = {batch}, q_len, num_heads, {width}] (or [tokens,"
                f" num_heads, {width}] with cum_seq_lens_q), got {list(query.shape)}"
            )
        q_len = int(query.shape[1])
        rows = query.reshape(batch * q_len, *query.shape[2:])
        return rows, np.arange(batch + 1, dtype=np.int32) * q_len
    if len(query.shape) != 3:
        raise ValueError("with cum_seq_lens_q, query must be [tokens, num_heads, head_dim_qk]")
    qo = host_int_array("cum_seq_lens_q", cum_seq_lens_q, 1)
    counts = np.diff(qo)
    if len(qo) != batch + 1 or qo[0] != 0 or qo[-1] != query.shape[0] or (counts < 0).any():
        raise ValueError(
            f"cum_seq_lens_q must rise from 0 to the query's {query.shape[0]} tokens in"
            f" {batch + 1} entries (seq_lens has {batch})"
        )
    if max_q_len is not None:
        most = check_int("max_q_len", max_q_len, 1)
        if batch and counts.max() > most:
            raise ValueError(f"a request has more queries than max_q_len = {most}")
    return query, qo.astype(np.int32)


def _checked_lse(lse: Array | None, tokens: int, heads: int, device: Any) -> Array | None:
    """The caller's lse as [tokens, H] rows: FlashInfer takes [tokens, H] or
    [B, q_len, H] float32, contiguous."""
    if lse is None:
        return None
    check_array("lse", lse)
    if int(np.prod(lse.shape)) != tokens * heads or lse.shape[-1] != heads:
        raise ValueError(f"lse must be [{tokens}, {heads}] or [B, q_len, {heads}], got {lse.shape}")
    check_output("lse", lse, tuple(lse.shape), DType.float32, device)
    return lse.reshape(tokens, heads)


def _sparse_table(
    indices: Array, qo_indptr: np.ndarray, seq_lens: np.ndarray, top_k: int
) -> tuple[np.ndarray, ...]:
    """Sparse MLA's page table over one-token pages: query row t is a request
    of its own whose keys are cache slots (page x page_size + slot) from row
    t of indices ([B, q_len, top_k] or [tokens, top_k]). As in FlashInfer's
    kernel, a row takes at most as many entries as its causal position sees
    keys (query i of n in a request of L tokens: L - n + i + 1), from the
    front; negative entries are padding. Returns (qo_indptr, kv_indptr,
    kv_indices, kv_lens) of the one-token-page batch."""
    tokens = int(qo_indptr[-1])
    ndim = len(indices.shape) if hasattr(indices, "shape") else np.ndim(indices)
    table = host_int_array("block_tables", indices, ndim)
    if table.shape[-1] != top_k or table.size != tokens * top_k:
        raise ValueError(
            f"sparse MLA's block_tables are the query rows' {top_k} cache slots"
            f" ([B, q_len, {top_k}] or [tokens, {top_k}]), got {list(table.shape)}"
        )
    counts = np.diff(qo_indptr.astype(np.int64))
    request = np.repeat(np.arange(len(counts)), counts)
    index = np.arange(tokens) - qo_indptr[request]
    sees = seq_lens[request] - counts[request] + index + 1
    used = (table.reshape(tokens, top_k) >= 0) & (np.arange(top_k)[None, :] < sees[:, None])
    kv_lens = used.sum(axis=1)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    rows = np.arange(tokens + 1, dtype=np.int32)
    return (
        rows,
        kv_indptr,
        narrow_indices("block_tables", table.reshape(tokens, top_k)[used]),
        kv_lens.astype(np.int32),
    )


def _token_rows(cache: Array) -> Array:
    """A contiguous packed cache [pages, page_size, D] as one-token pages
    [pages x page_size, 1, D] (a view)."""
    if not is_contiguous(cache):
        raise ValueError("sparse MLA reads the cache as token rows: it must be contiguous")
    return cache.reshape(-1, 1, cache.shape[-1])


def _mla_paged_attention(
    query: Array,
    kv_cache: Array,
    dims: tuple[int, int],
    block_tables: Array,
    seq_lens: Array,
    scales: tuple[float, float],
    cum_seq_lens_q: Array | None = None,
    max_q_len: int | None = None,
    sinks: Any = None,
    out: Array | None = None,
    lse: Array | None = None,
    sparse_top_k: int = 0,
) -> tuple[Array, Array]:
    """One plan and run of the MLA wrapper: (o shaped as query's rows with
    kv_lora_rank lanes, lse [tokens, H] base 2, the caller's when given).
    A request's queries are its last tokens, causal; with sparse_top_k,
    block_tables holds each query row's cache slots instead (`_sparse_table`)."""
    width = sum(dims)
    cache = _packed_cache(kv_cache, width)
    lens = host_int_array("seq_lens", seq_lens, 1)
    rows, qo_indptr = _query_rows(query, width, len(lens), cum_seq_lens_q, max_q_len)
    rows = widened_query(rows)
    tokens, heads = int(rows.shape[0]), int(rows.shape[1])
    if sparse_top_k:
        qo_indptr, kv_indptr, kv_indices, kv_lens = _sparse_table(
            block_tables, qo_indptr, lens, sparse_top_k
        )
        cache, page_size, causal = _token_rows(cache), 1, False
    else:
        page_size, causal = int(cache.shape[1]), True
        table = csr_from_block_tables(_page_rows(block_tables), lens, page_size)
        kv_indptr, kv_indices, kv_lens = table.indptr, table.indices, lens.astype(np.int32)
    device = device_of(query)
    out_rows = None
    if out is not None:
        check_output("out", out, (*query.shape[:-1], dims[0]), dtype_of(rows), device)
        out_rows = out.reshape(tokens, heads, dims[0])
    lse_rows = _checked_lse(lse, tokens, heads, device)
    bmm1, bmm2 = scales
    # FlashInfer's kernels lay the workspace out as their own (tests check
    # that nothing lands past their slab): the wrapper keeps its scratch apart.
    wrapper = BatchMLAPagedAttentionWrapper(empty(query, (0,), DType.uint8))
    # bmm2 multiplies the output: the kernel's ckv scale scales o and both
    # parts of the scores, so the plan's sm_scale is bmm1 / bmm2.
    wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, kv_lens, heads, *dims, page_size, causal,
        bmm1 / bmm2, dtype_of(rows), dtype_of(cache),
    )  # fmt: skip
    o, lse_rows = wrapper.run_scaled(
        (rows[..., : dims[0]], rows[..., dims[0] :]),
        (cache[..., : dims[0]], cache[..., dims[0] :]),
        out_rows,
        lse_rows,
        (bmm1 / bmm2, bmm2, bmm2),
        sinks,
    )
    o = out if out is not None else o.reshape(*query.shape[:-1], dims[0])
    return o, (lse if lse is not None else lse_rows)


def trtllm_batch_decode_with_kv_cache_mla(
    query: Array, kv_cache: Array, workspace_buffer: Array | None, qk_nope_head_dim: int,
    kv_lora_rank: int, qk_rope_head_dim: int, block_tables: Array, seq_lens: Array | None,
    max_seq_len: int, sparse_mla_top_k: int = 0, out: Array | None = None,
    bmm1_scale: Any = 1.0, bmm2_scale: Any = 1.0, sinks: Any = None,
    skip_softmax_threshold_scale_factor: float | None = None, enable_pdl: bool | None = None,
    backend: str = "auto", is_var_seq: bool = True, uses_shared_paged_kv_idx: bool = True,
    lse: Array | None = None, return_lse: bool = False, cute_dsl_impl: str = "auto",
    kv_scale_format: str = "auto", cum_seq_lens_q: Array | None = None,
    max_q_len: int | None = None, multi_ctas_kv_counter_buffer: Array | None = None,
    sparse_mla_top_k_lens: Array | None = None, enable_dcp: bool = False, cp_world: int = 1,
    cp_rank: int = 0, causal_seqlens_kv_global: Array | None = None,
    use_fp16_softmax: bool | None = None, return_lse_base: str | None = None,
) -> Any:  # fmt: skip
    """MLA decode (absorbed) over a packed latent cache and a block table,
    FlashInfer 0.7.2's signature (module docstring).

    Parameters
    ----------
    query : array [B, q_len, num_heads, kv_lora_rank + qk_rope_head_dim]
        ``q_nope || q_pe``; [tokens, num_heads, ...] with cum_seq_lens_q.
    kv_cache : array [pages, page_size, kv_lora_rank + qk_rope_head_dim]
        ``ckv || kpe`` rows (or [pages, 1, page_size, ...]), read in place.
    workspace_buffer : array or None
        FlashInfer's kernels' scratch: not used (module docstring).
    qk_nope_head_dim, max_seq_len : int
        Not read (FlashInfer marks the first for removal; the second is a
        scheduling hint of its kernels, checked to be an integer >= 0).
    kv_lora_rank, qk_rope_head_dim : int
        The latent and rope widths (multiples of 16; the rope's may be 0).
    block_tables : int array [B, max_pages]
        Request b's pages, the first ceil(seq_lens[b] / page_size) read;
        [B, 2, max_pages] with equal K and V rows is taken too. With
        sparse_mla_top_k: each query row's cache slots, [B, q_len, top_k]
        ([tokens, top_k] with cum_seq_lens_q), negative entries padding.
    seq_lens : int array [B]
        Tokens cached per request, its queries' included.
    bmm1_scale, bmm2_scale : float or one-element tensor
        The softmax scale (q and k scales folded in) and the output's factor.
    out : array, optional
        query's shape with kv_lora_rank lanes; bfloat16 for bfloat16 and fp8
        queries, else q's dtype.
    sinks : [num_heads] array (or a list of one), optional
        gpt-oss's sink logits (pagedkv.attention_sinks).
    lse, return_lse, return_lse_base
        return_lse returns (o, lse [tokens, num_heads] float32); a given lse
        ([tokens, H] or [B, q_len, H]) is filled either way. Base 2 unless
        return_lse_base is "basee".
    cum_seq_lens_q, max_q_len : optional
        Ragged query counts [B + 1]; max_q_len, given, bounds them.
    backend : {"auto", "trtllm-gen", "cute-dsl", "xqa"}
        FlashInfer's kernel names, all pagedkv's one MLA kernel; "xqa" keeps
        XQA's limits (one query a request, no lse, no sinks).
    sparse_mla_top_k : int
        0, or the width of block_tables' sparse rows (module docstring):
        query i of n in a request of L tokens attends the first L - n + i + 1
        entries of its row (negative ones skipped).
    skip_softmax_threshold_scale_factor : float, optional
        Skip-softmax sparsity: taken, nothing skipped (exact attention).
    sparse_mla_top_k_lens, enable_dcp, cp_world, causal_seqlens_kv_global,
    use_fp16_softmax
        GPU-only: refused unless off.
    multi_ctas_kv_counter_buffer : optional
        FlashInfer's trtllm-gen counters: checked as FlashInfer checks them
        (device, contiguous, 16-byte aligned, large enough), left as they are.
    enable_pdl, is_var_seq, uses_shared_paged_kv_idx, cute_dsl_impl,
    kv_scale_format, cp_rank
        Accepted and read no further.

    Returns
    -------
    o, or (o, lse) with return_lse.

    Examples
    --------
    >>> import torch, pagedkv
    >>> cache = torch.randn(4, 16, 512 + 64)             # [pages, page_size, ckv || kpe]
    >>> q = torch.randn(2, 1, 16, 512 + 64)              # [B, q_len, heads, ...]
    >>> o = pagedkv.trtllm_batch_decode_with_kv_cache_mla(
    ...     q, cache, None, 128, 512, 64, torch.tensor([[0, 1], [3, 0]]),
    ...     torch.tensor([20, 9]), 20, bmm1_scale=192 ** -0.5)
    >>> o.shape
    torch.Size([2, 1, 16, 512])
    """
    _check_decode_call(dict(locals()))
    check_multi_ctas_kv_counter_buffer(
        multi_ctas_kv_counter_buffer, len(seq_lens), query.shape[-2], query
    )
    dims = (check_int("kv_lora_rank", kv_lora_rank, 1),
            check_int("qk_rope_head_dim", qk_rope_head_dim, 0))  # fmt: skip
    o, lse = _mla_paged_attention(
        query, kv_cache, dims, block_tables, seq_lens,
        (check_scale("bmm1_scale", bmm1_scale, positive=True),
         check_scale("bmm2_scale", bmm2_scale, positive=True)),
        cum_seq_lens_q, max_q_len, sinks, out, lse,
        check_int("sparse_mla_top_k", sparse_mla_top_k, 0),
    )  # fmt: skip
    if return_lse_base == "basee":
        lse *= float(np.log(2.0))
    return (o, lse) if return_lse else o


def _check_decode_call(options: dict[str, Any]) -> None:
    """Raises for what trtllm_batch_decode_with_kv_cache_mla's call (its
    arguments by name) asks and pagedkv does not do, before anything runs."""
    _refuse_gpu_only("trtllm_batch_decode_with_kv_cache_mla", options)
    base = options["return_lse_base"]
    if base not in LSE_BASES:
        raise ValueError(f"return_lse_base must be 'basee', 'base2' or None, got {base!r}")
    if options["backend"] == "xqa":
        _check_xqa_limits(
            *(options[k] for k in ("query", "cum_seq_lens_q", "max_q_len", "sinks", "lse")),
            options["return_lse"],
        )
        if options["sparse_mla_top_k"]:
            raise ValueError("XQA MLA does not support sparse_mla_top_k")
    if options["seq_lens"] is None:
        raise ValueError("trtllm_batch_decode_with_kv_cache_mla: seq_lens is required")
    check_array("query", options["query"])
    check_int("max_seq_len", options["max_seq_len"], 0)


def _check_xqa_limits(query, cum_seq_lens_q, max_q_len, sinks, lse, return_lse) -> None:
    """FlashInfer's XQA MLA kernel: one query a request, no ragged queries,
    no sinks, no lse (ValueError, NotImplementedError for the lse, as its)."""
    check_array("query", query)
    if cum_seq_lens_q is not None or max_q_len is not None:
        raise ValueError("XQA MLA does not support cum_seq_lens_q / max_q_len")
    if len(query.shape) != 4 or query.shape[1] != 1:
        raise ValueError(f"XQA MLA only supports q_len_per_request == 1, got {list(query.shape)}")
    if sinks is not None:
        raise ValueError("XQA MLA does not support sinks")
    if return_lse or lse is not None:
        raise NotImplementedError("XQA MLA does not return an lse")


def trtllm_prefill_with_kv_cache_mla(*args: Any, **kwargs: Any) -> Any:
    """`trtllm_batch_decode_with_kv_cache_mla` under FlashInfer's prefill
    name, with its signature: several queries a request (q_len > 1, or
    cum_seq_lens_q) are an incremental prefill, causal at the end of each
    sequence.

    Examples
    --------
    >>> import torch, pagedkv
    >>> o = pagedkv.trtllm_prefill_with_kv_cache_mla(
    ...     torch.randn(1, 3, 8, 64 + 16), torch.randn(2, 16, 64 + 16), None, 0, 64, 16,
    ...     torch.tensor([[1, 0]]), torch.tensor([19]), 19, bmm1_scale=0.1)
    >>> o.shape
    torch.Size([1, 3, 8, 64])
    """
    return trtllm_batch_decode_with_kv_cache_mla(*args, **kwargs)


trtllm_prefill_with_kv_cache_mla.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    trtllm_batch_decode_with_kv_cache_mla
)


def xqa_batch_decode_with_kv_cache_mla(
    query: Array,
    kv_cache: Array,
    workspace_buffer: Array | None,
    qk_nope_head_dim: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_tables: Array,
    seq_lens: Array,
    max_seq_len: int,
    out: Array | None = None,
    bmm1_scale: Any = 1.0,
    bmm2_scale: Any = 1.0,
    sinks: Any = None,
    enable_pdl: bool | None = None,
) -> Array:
    """`trtllm_batch_decode_with_kv_cache_mla` in XQA's signature: one query a
    request (query [B, 1, H, kv_lora_rank + qk_rope_head_dim]), no sinks.
    Returns o [B, 1, H, kv_lora_rank], or out ([B, H, kv_lora_rank], as
    FlashInfer checks it) when given.

    Examples
    --------
    >>> import torch, pagedkv
    >>> o = pagedkv.xqa_batch_decode_with_kv_cache_mla(
    ...     torch.randn(1, 1, 8, 64 + 16).bfloat16(), torch.randn(2, 32, 80).bfloat16(),
    ...     None, 0, 64, 16, torch.tensor([[1]]), torch.tensor([30]), 30, bmm1_scale=0.1)
    >>> o.shape, o.dtype
    (torch.Size([1, 1, 8, 64]), torch.bfloat16)
    """
    _check_xqa_limits(query, None, None, sinks, None, False)
    dims = (check_int("kv_lora_rank", kv_lora_rank, 1),
            check_int("qk_rope_head_dim", qk_rope_head_dim, 0))  # fmt: skip
    if out is not None:
        check_array("query", query)
        shape = (query.shape[0], query.shape[2], dims[0])
        check_output("out", out, shape, widened_dtype(dtype_of(query)), device_of(query))
    o, _ = _mla_paged_attention(
        query, kv_cache, dims, block_tables, seq_lens,
        (check_scale("bmm1_scale", bmm1_scale, positive=True),
         check_scale("bmm2_scale", bmm2_scale, positive=True)),
        out=None if out is None else out.reshape(query.shape[:-1] + (dims[0],)),
    )  # fmt: skip
    return o if out is None else out
