"""pagedkv's ops inside your own ``max.graph`` graphs.

The cache pool is a graph ``BufferValue`` (FlashInfer's one-tensor form
[num_pages, 2, ...page...]) written in place by `append_paged_kv_cache` and
read by `batch_decode` / `batch_prefill`: all three take the same buffer value,
so MAX orders them and never copies the pool. Batch, token and page counts may
be symbolic dims: one compiled graph serves every step.

The attention ops take their work list as graph inputs, built on the host per
step by `decode_work` / `prefill_work` from the page table (cheap, vectorized
NumPy; the page manager has the page table on the host anyway).

    with Graph("step", input_types=[...],
               custom_extensions=graph_ops.custom_extensions()) as g:
        graph_ops.append_paged_kv_cache(pool, k, v, batch_indices, positions,
                                         kv_indices, kv_indptr, kv_last_page_len)
        o, lse = graph_ops.batch_decode(q, pool, kv_indices, kv_indptr,
                                        kv_last_page_len, work_items, request_items)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from max.dtype import DType
from max.graph import BufferType, BufferValue, DeviceRef, StaticDim, TensorType, TensorValue, ops

from ._checks import layout_code
from ._ops.contract import (
    APPEND_OP,
    ATTENTION_OP,
    DECODER_ACTIVATIONS,
    DECODER_LAYER_OP,
    LINEAR_OP,
    LINEAR_PANEL,
    MLA_OP,
    PACKED_ROWS_OP,
    QLINEAR_EPILOGUES,
    QLINEAR_OP,
    QLINEAR_PROLOGUES,
    QUANT_FORMATS,
    QUANT_PANEL,
    ROPE_APPEND_OP,
    V_IN_QKV,
    attention_operands,
    mla_operands,
    pool_head_dim,
)
from ._plan import work as attention_work
from ._plan.work import AttentionOptions, heads_per_task
from .custom_mask import NO_MASK
from .page import seq_lens_from_page_table

F32 = DType.float32


def custom_extensions() -> list:
    """What to pass as ``Graph(..., custom_extensions=...)`` for these ops:
    pagedkv's compiled kernel package."""
    from ._ops.kernels import kernel_package

    return [kernel_package()]


def linear(x: TensorValue, weight: TensorValue, out_features: int | None = None) -> TensorValue:
    """``x @ w`` for a linear layer's weight w [K, N].

    On the CPU, ``weight`` is w packed by
    :func:`pagedkv._ops.linear_panels.pack_linear_weight`
    ([ceil(N / 64), K, 64]) and the product is pagedkv's op: float32
    accumulation, one contiguous stream of the weight per core, and a
    fraction of the compile time of MAX's matmul. On a GPU, ``weight`` is w
    itself and the product is MAX's matmul (tensor cores); of 16-bit
    operands, multiplied in float32 and rounded back: MAX 26.7's 16-bit
    matmul on an H100 reads memory it has not written and returns wrong
    sums at some shapes, which differ from one process to the next
    (docs/gpu.md).

    Args:
        x: [M, K] (M symbolic), the weight's dtype.
        weight: the packed panels on the CPU, [K, N] on a GPU.
        out_features: N; needed on the CPU (the panels hold N rounded up
            to 64 columns).

    Returns:
        [M, N], x's dtype.
    """
    if weight.device != DeviceRef.CPU():
        if x.dtype in (DType.bfloat16, DType.float16):
            f32 = DType.float32
            return ops.cast(ops.cast(x, f32) @ ops.cast(weight, f32), x.dtype)
        return x @ weight
    if weight.rank != 3 or int(weight.shape[2]) != LINEAR_PANEL:
        raise ValueError(
            f"a CPU linear weight is packed panels [P, K, {LINEAR_PANEL}], got {weight.shape}"
        )
    panels = int(weight.shape[0])
    if out_features is None or out_features < 1 or -(-out_features // LINEAR_PANEL) != panels:
        raise ValueError(
            f"linear on the CPU needs out_features, N with ceil(N / {LINEAR_PANEL}) = {panels}"
            f" (the panels are padded); got {out_features!r}"
        )
    if x.rank != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(
            f"x {x.shape} {x.dtype} does not match the weight {weight.shape} {weight.dtype}"
        )
    out = TensorType(x.dtype, [x.shape[0], out_features], device=x.device)
    return ops.custom(LINEAR_OP, device=x.device, values=[x, weight], out_types=[out])[0].tensor


def qlinear(
    x: TensorValue,
    weight: TensorValue,
    fmt: str,
    out_features: int,
    *,
    rms_norm: tuple[TensorValue, float] | None = None,
    swiglu: bool = False,
    residual: TensorValue | None = None,
) -> TensorValue:
    """``prologue(x) @ w^T (+ residual)`` for a GGUF-quantized weight w [N, K].

    The activations are quantized per block of 32 inputs to int8 and
    multiplied in byte dot products by the weight's own 4- or 8-bit codes
    (CPU only), after an optional prologue: an RMSNorm of x, or SwiGLU's
    ``silu(x[:, :K]) * x[:, K:]``; an optional epilogue adds a residual.

    Args:
        x: [M, K] (M symbolic; [M, 2K] with ``swiglu``), float32 or bfloat16.
        weight: w packed by
            :func:`pagedkv._ops.quantized_panels.pack_quantized_weight`,
            uint8 [ceil(N / 16), quantized_panel_bytes(fmt, K)].
        fmt: w's packed layout (`QuantizedWeight.format`: "Q4_0", "Q4_1",
            "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K").
        out_features: N.
        rms_norm: (gamma [K] float32, eps): normalize x first.
        swiglu: x holds gate and up side by side.
        residual: [M, N] float32, added to the product.

    Returns:
        [M, N] float32.
    """
    from ._ops.quantized_panels import quantized_panel_bytes

    if fmt not in QUANT_FORMATS:
        raise ValueError(f"qlinear takes {', '.join(QUANT_FORMATS)} weights, not {fmt!r}")
    if rms_norm is not None and swiglu:
        raise ValueError("qlinear takes one prologue: rms_norm or swiglu")
    if x.rank != 2 or not isinstance(x.shape[1], StaticDim):
        raise ValueError(f"qlinear's x is [M, K] with a static K, got {x.shape}")
    k = int(x.shape[1]) // (2 if swiglu else 1)
    shape = (-(-out_features // QUANT_PANEL), quantized_panel_bytes(fmt, k))
    if weight.dtype != DType.uint8 or tuple(int(d) for d in weight.shape) != shape:
        raise ValueError(
            f"a {fmt} weight [{out_features}, {k}] is packed as uint8 {list(shape)}, "
            f"got {weight.dtype} {weight.shape}"
        )
    cpu = x.device
    gamma, eps = rms_norm if rms_norm is not None else (None, 0.0)
    if gamma is None:
        gamma = ops.constant(np.zeros(0, np.float32), F32, device=cpu)
    elif tuple(int(d) for d in gamma.shape) != (k,):
        raise ValueError(f"qlinear's rms_norm weight is [{k}], got {gamma.shape}")
    if residual is None:
        residual = ops.constant(np.zeros((0, 0), np.float32), F32, device=cpu)
    out = TensorType(F32, [x.shape[0], out_features], device=cpu)
    prologue = "rms_norm" if rms_norm is not None else "swiglu" if swiglu else "none"
    epilogue = "add" if residual.shape[0] != 0 else "none"
    return ops.custom(
        QLINEAR_OP,
        device=cpu,
        values=[x, weight, gamma, residual, ops.constant(np.array([eps], np.float32), F32, cpu)],
        out_types=[out],
        parameters={
            "format": QUANT_FORMATS[fmt],
            "prologue": QLINEAR_PROLOGUES[prologue],
            "epilogue": QLINEAR_EPILOGUES[epilogue],
        },
    )[0].tensor


def packed_rows(
    weight: TensorValue, ids: TensorValue, fmt: str, shape: tuple[int, int]
) -> TensorValue:
    """Rows ``ids`` of a GGUF-quantized weight w [N, K], dequantized: an
    embedding lookup from the GGUF's own blocks (CPU only).

    Each element equals the `gguf` package's (and llama.cpp's)
    dequantization of it bit for bit. An id outside [0, N) raises when the
    graph runs, before anything is written.

    Args:
        weight: w packed by
            :func:`pagedkv._ops.quantized_panels.pack_quantized_weight`,
            uint8 [ceil(N / 16), quantized_panel_bytes(fmt, K)].
        ids: [M] int32 (M symbolic).
        fmt: w's packed layout, as `qlinear` takes it.
        shape: (N, K).

    Returns:
        [M, K] float32.
    """
    from ._ops.quantized_panels import quantized_panels_shape

    if fmt not in QUANT_FORMATS:
        raise ValueError(f"packed_rows takes {', '.join(QUANT_FORMATS)} weights, not {fmt!r}")
    n, k = shape
    packed = quantized_panels_shape(fmt, n, k)
    if weight.dtype != DType.uint8 or tuple(int(d) for d in weight.shape) != packed:
        raise ValueError(
            f"a {fmt} weight [{n}, {k}] is packed as uint8 {list(packed)}, "
            f"got {weight.dtype} {weight.shape}"
        )
    if ids.rank != 1 or ids.dtype != DType.int32:
        raise ValueError(f"packed_rows' ids are [M] int32, got {ids.dtype} {ids.shape}")
    cpu = weight.device
    return ops.custom(
        PACKED_ROWS_OP,
        device=cpu,
        values=[weight, ids],
        out_types=[TensorType(F32, [ids.shape[0], k], device=cpu)],
        parameters={"format": QUANT_FORMATS[fmt], "out_features": n},
    )[0].tensor


def append_paged_kv_cache(
    paged_kv_cache: BufferValue,
    append_key: TensorValue,
    append_value: TensorValue,
    batch_indices: TensorValue,
    positions: TensorValue,
    kv_indices: TensorValue,
    kv_indptr: TensorValue,
    kv_last_page_len: TensorValue,
    kv_layout: str = "NHD",
    checked: bool = True,
) -> None:
    """Writes append_key/append_value [nnz, H, D] into the pool, in place.

    paged_kv_cache: [pages, 2, ...page...]; int32 index tensors as in
    `pagedkv.append_paged_kv_cache`. `checked`: the op checks the indices
    and raises before writing anything (on a GPU, after one synchronization
    that brings the index arrays to the host). A graph whose index arrays
    come from its own page manager passes False: the op then only skips any
    token that has no slot in the pool, and nothing waits for the host.
    """
    ops.inplace_custom(
        APPEND_OP,
        device=paged_kv_cache.device,
        values=[
            paged_kv_cache,
            paged_kv_cache,
            append_key,
            append_value,
            batch_indices,
            positions,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
        ],
        parameters={"layout": layout_code(kv_layout), "checked": int(checked)},
    )


@dataclass(frozen=True)
class QuantizedLayerWeights:
    """A decoder layer's weights for `quantized_decoder_layer`: the two
    RMSNorm weights [H] float32 and the four products' packed GGUF weights
    (uint8 panels) with their formats; Qwen 2's block adds the Q|K|V bias
    [(Hq + 2 Hkv) D], Qwen 3's the QK-norm weights [D], Gemma 3's those and
    the sandwich norms' [H] (None in Llama's). Where the file stores V in
    another format than Q and K, `wv` holds V's rows in `v_format` and
    `wqkv` only Q's and K's."""

    attn_norm: TensorValue
    wqkv: TensorValue
    wo: TensorValue
    mlp_norm: TensorValue
    w_gate_up: TensorValue
    w_down: TensorValue
    formats: tuple[str, str, str, str]
    """GGUF types of wqkv, wo, w_gate_up and w_down."""
    q_norm: TensorValue | None = None
    k_norm: TensorValue | None = None
    post_attn_norm: TensorValue | None = None
    post_mlp_norm: TensorValue | None = None
    wv: TensorValue | None = None
    v_format: str | None = None
    bqkv: TensorValue | None = None

    def __post_init__(self) -> None:
        formats = [*self.formats, *([] if self.v_format is None else [self.v_format])]
        if any(fmt not in QUANT_FORMATS for fmt in formats):
            raise ValueError(f"quantized_decoder_layer takes {', '.join(QUANT_FORMATS)} weights")
        qk = (self.q_norm is None, self.k_norm is None)
        sandwich = (self.post_attn_norm is None, self.post_mlp_norm is None)
        v = (self.wv is None, self.v_format is None)
        if qk[0] != qk[1] or sandwich[0] != sandwich[1] or v[0] != v[1]:
            raise ValueError(
                "q_norm and k_norm, the two sandwich norms, and wv and v_format come in pairs"
            )

    def values(self, device: DeviceRef) -> list[TensorValue]:
        """The op's weight operands in its order; a bias or norm the block
        does not have is an empty float32 constant, a wv it does not have an
        empty uint8 one."""
        norms = (self.q_norm, self.k_norm, self.post_attn_norm, self.post_mlp_norm)
        unused = ops.constant(np.zeros(0, np.float32), F32, device=device)
        no_wv = ops.constant(np.zeros((0, 0), np.uint8), DType.uint8, device=device)
        return [
            self.attn_norm,
            self.wqkv,
            no_wv if self.wv is None else self.wv,
            unused if self.bqkv is None else self.bqkv,
            self.wo,
            self.mlp_norm,
            self.w_gate_up,
            self.w_down,
            *(unused if n is None else n for n in norms),
        ]

    def parameters(self) -> dict[str, int]:
        """The op's parameters that the weights decide: the products'
        formats and which of the families' bias and norms the block has."""
        names = ("qkv_format", "wo_format", "gate_up_format", "down_format")
        return {
            **{name: QUANT_FORMATS[f] for name, f in zip(names, self.formats, strict=True)},
            "v_format": V_IN_QKV if self.v_format is None else QUANT_FORMATS[self.v_format],
            "qkv_bias": int(self.bqkv is not None),
            "qk_norm": int(self.q_norm is not None),
            "sandwich_norms": int(self.post_attn_norm is not None),
        }


def _pool_heads(paged_kv_cache: BufferValue, kv_layout: str) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a [pages, 2, ...page...] pool."""
    heads = int(paged_kv_cache.shape[3 if kv_layout == "NHD" else 2])
    return heads, pool_head_dim(paged_kv_cache.dtype, int(paged_kv_cache.shape[4]))


def quantized_decoder_layer(
    x: TensorValue,
    paged_kv_cache: BufferValue | Sequence[BufferValue],
    weights: QuantizedLayerWeights,
    rope_cos: TensorValue,
    rope_sin: TensorValue,
    num_qo_heads: int,
    ffn_size: int,
    rms_eps: float,
    batch_indices: TensorValue,
    positions: TensorValue,
    kv_indices: TensorValue,
    kv_indptr: TensorValue,
    kv_last_page_len: TensorValue,
    work_items: TensorValue,
    request_items: TensorValue,
    decode: bool,
    kv_layout: str = "NHD",
    activation: str = "silu",
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
) -> TensorValue:
    """Decoder layers with GGUF-quantized weights, as one CPU op.

    ``h = x + wo(attention(rope(wqkv(rms_norm(x)))))``, then
    ``h + w_down(act(gate) * up)`` with ``gate|up = w_gate_up(rms_norm(h))``,
    over the step's rows: the products of `qlinear`, the RoPE and append of
    `rope_append_paged_kv_cache` and the attention of `batch_decode` (or
    causal `batch_prefill`) in one op, whose steps share one dispatch to the
    cores (mojo_ops/decoder/decoder_layer.mojo). The families' choices:
    with `weights.bqkv` the Q|K|V rows get their bias (Qwen 2); with
    `q_norm` and `k_norm` each query and key head is RMS-normed before RoPE
    (Qwen 3, Gemma 3); with `post_attn_norm` and `post_mlp_norm` each
    product's output is RMS-normed before its residual add (Gemma 3). The rows' keys and values
    are appended to the pool first; everything is checked before anything
    is written. A run of layers of one shape and formats is one op (one
    start on the cores): their pools in order, their weights stacked.

    Args:
        x: [rows, H] float32 (rows symbolic).
        paged_kv_cache: the pool [pages, 2, ...page...], written in place (a run's: in order).
        weights: the layers' weights, each stacked over the run's layers
            ([layers x panels, bytes] packed matrices, [layers x H] norms).
        rope_cos, rope_sin: [max_positions, D / 2] float32 tables.
        num_qo_heads, ffn_size: Hq and the MLP's width F.
        rms_eps: the RMSNorms' epsilon.
        batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len:
            int32, as for `append_paged_kv_cache`.
        work_items, request_items: from `decode_work` (decode) or
            `prefill_work` (causal) for this step.
        decode: one query row per request (key-split work items).
        activation: the MLP's, "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
        window_left: the layer's sliding window less one (-1: none); the
            work items must be planned with it.
        logits_soft_cap, sm_scale: the attention scores', as for
            `batch_decode` (None: uncapped, 1 / sqrt(D)).

    Returns:
        [rows, H] float32.
    """
    if activation not in DECODER_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(DECODER_ACTIVATIONS)}")
    pools = [paged_kv_cache] if isinstance(paged_kv_cache, BufferValue) else list(paged_kv_cache)
    heads, head_dim = _pool_heads(pools[0], kv_layout)
    options = AttentionOptions(
        head_dim, window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale
    )
    int_params = _layer_int_params(options, num_qo_heads, heads, decode)
    cpu = x.device
    return ops.inplace_custom(
        DECODER_LAYER_OP,
        device=cpu,
        values=[
            *pools,
            x,
            *weights.values(cpu),
            rope_cos,
            rope_sin,
            batch_indices,
            positions,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
            work_items,
            request_items,
            ops.constant(options.float_params(None, None, None), F32, device=cpu),
            ops.constant(int_params, DType.int32, device=cpu),
            ops.constant(np.array([rms_eps], np.float32), F32, device=cpu),
        ],
        out_types=[TensorType(F32, x.shape, device=cpu)],
        parameters={
            "layout": layout_code(kv_layout),
            "kv_format": 0,
            **weights.parameters(),
            "num_qo_heads": num_qo_heads,
            "ffn_size": ffn_size,
            "activation": DECODER_ACTIVATIONS[activation],
        },
    )[0].tensor


def _layer_int_params(
    options: AttentionOptions, num_qo_heads: int, heads: int, decode: bool
) -> np.ndarray:
    """The fused layer's attention parameters: decode's key-split work of
    one query row per request, or causal prefill's query tiles."""
    if decode:
        return options.int_params(
            heads_per_task(num_qo_heads, heads), causal=True, max_queries=1, kv_split=True
        )
    tile = attention_work.prefill_tile(num_qo_heads // heads, False)
    return options.int_params(1, causal=True, max_queries=tile, kv_split=False)


def rope_append_paged_kv_cache(
    paged_kv_cache: BufferValue,
    qkv: TensorValue,
    rope_cos: TensorValue,
    rope_sin: TensorValue,
    num_qo_heads: int,
    batch_indices: TensorValue,
    positions: TensorValue,
    kv_indices: TensorValue,
    kv_indptr: TensorValue,
    kv_last_page_len: TensorValue,
    kv_layout: str = "NHD",
) -> TensorValue:
    """RoPE on a layer's fused projections, keys and values appended: one op.

    qkv [nnz, (Hq + Hkv + Hkv) * D] holds each new token's query, key and
    value heads side by side. Its queries and keys are rotated (rotate-half
    RoPE, in float32) by the token's position, the keys and values written
    into the pool in the pool's dtype as `append_paged_kv_cache` writes
    them, and the rotated queries returned. Checks the page table and the
    positions (each below the tables' rows) before writing anything. CPU
    only.

    Args:
        paged_kv_cache: the pool [pages, 2, ...page...], written in place.
        qkv: [nnz, (num_qo_heads + 2 Hkv) * D], float32 or bfloat16.
        rope_cos, rope_sin: [max_positions, D / 2] float32 tables.
        num_qo_heads: Hq.
        batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len:
            int32, as for `append_paged_kv_cache`.

    Returns:
        q [nnz, Hq, D], qkv's dtype.
    """
    heads, head_dim = _pool_heads(paged_kv_cache, kv_layout)
    if int(qkv.shape[1]) != (num_qo_heads + 2 * heads) * head_dim:
        raise ValueError(f"qkv {qkv.shape} is not [nnz, (num_qo_heads + 2 * {heads}) * {head_dim}]")
    q = TensorType(qkv.dtype, [qkv.shape[0], num_qo_heads, head_dim], device=qkv.device)
    return ops.inplace_custom(
        ROPE_APPEND_OP,
        device=paged_kv_cache.device,
        values=[
            paged_kv_cache,
            paged_kv_cache,
            qkv,
            rope_cos,
            rope_sin,
            batch_indices,
            positions,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
        ],
        out_types=[q],
        parameters={"layout": layout_code(kv_layout)},
    )[0].tensor


def _attention_outputs(q: TensorValue, states: object, device: DeviceRef) -> dict[str, BufferValue]:
    """The attention ops' output buffers for q [rows, H, D], by operand name
    (ATTENTION_OPERANDS and MLA_OPERANDS both start with them): output [rows,
    H, D] in q's dtype, lse [rows, H], and float32 partial states partial_o
    [states, H, D] and partial_lse [states, H] (one a work item that may
    split its keys)."""
    rows, heads, head_dim = q.shape
    return {
        "output": ops.buffer_create(BufferType(q.dtype, [rows, heads, head_dim], device=device)),
        "lse": ops.buffer_create(BufferType(F32, [rows, heads], device=device)),
        "partial_o": ops.buffer_create(BufferType(F32, [states, heads, head_dim], device=device)),
        "partial_lse": ops.buffer_create(BufferType(F32, [states, heads], device=device)),
    }


def _attention_op(
    q: TensorValue,
    paged_kv_cache: BufferValue,
    kv_indices: TensorValue,
    kv_indptr: TensorValue,
    kv_last_page_len: TensorValue,
    work_items: TensorValue,
    request_items: TensorValue,
    kv_layout: str,
    options: AttentionOptions,
    int_params: np.ndarray,
) -> tuple[TensorValue, TensorValue]:
    """ATTENTION_OP over the pool (its K and V caches both), without a custom
    mask or quantization scales: (o, lse)."""
    device = paged_kv_cache.device
    if device != DeviceRef.CPU():
        attention_work.check_gpu_head_dim(options.head_dim)
    outputs = _attention_outputs(q, work_items.shape[0], device)
    host = DeviceRef.CPU()
    operands = attention_operands(
        **outputs,
        q=q,
        k_cache=paged_kv_cache,
        v_cache=paged_kv_cache,
        kv_indices=kv_indices,
        kv_indptr=kv_indptr,
        kv_last_page_len=kv_last_page_len,
        work_items=work_items,
        request_items=request_items,
        # No custom mask in a graph (an empty mask_rows).
        custom_mask=ops.constant(NO_MASK.bits, DType.uint8, device=device),
        mask_rows=ops.constant(NO_MASK.row_bits, DType.int32, device=device),
        float_params=ops.constant(options.float_params(None, None, None), F32, device=host),
        int_params=ops.constant(int_params, DType.int32, device=host),
    )
    parameters = {"layout": layout_code(kv_layout), "kv_format": 0}
    ops.inplace_custom(ATTENTION_OP, device=device, values=operands, parameters=parameters)
    return ops.buffer_load(outputs["output"]), ops.buffer_load(outputs["lse"])


def batch_decode(
    q: TensorValue,
    paged_kv_cache: BufferValue,
    kv_indices: TensorValue,
    kv_indptr: TensorValue,
    kv_last_page_len: TensorValue,
    work_items: TensorValue,
    request_items: TensorValue,
    num_kv_heads: int,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    backend: str = "auto",
) -> tuple[TensorValue, TensorValue]:
    """Decode attention of q [B, Hq, D] over the pool: (o [B, Hq, D], lse [B, Hq]).

    work_items [I, 6], request_items [B + 1] (int32): from `decode_work` for
    this step's page table, with the same window_left. backend: as for
    BatchDecodeWithPagedKVCacheWrapper.
    """
    num_qo_heads, head_dim = int(q.shape[1]), int(q.shape[2])
    options = AttentionOptions(
        head_dim, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta
    )
    page_dim = paged_kv_cache.shape[2 if kv_layout == "NHD" else 3]
    gpu_kernel = attention_work.decode_kernel(
        backend,
        paged_kv_cache.device.is_gpu(),
        kv_layout,
        int(page_dim) if isinstance(page_dim, StaticDim) else None,
        num_qo_heads // num_kv_heads,
        pos_encoding_mode,
    )
    return _attention_op(
        q,
        paged_kv_cache,
        kv_indices,
        kv_indptr,
        kv_last_page_len,
        work_items,
        request_items,
        kv_layout,
        options,
        options.int_params(
            heads_per_task(num_qo_heads, num_kv_heads),
            causal=True,
            max_queries=1,
            kv_split=True,
            gpu_kernel=gpu_kernel,
        ),
    )


def batch_prefill(
    q: TensorValue,
    paged_kv_cache: BufferValue,
    kv_indices: TensorValue,
    kv_indptr: TensorValue,
    kv_last_page_len: TensorValue,
    work_items: TensorValue,
    request_items: TensorValue,
    causal: bool = True,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
) -> tuple[TensorValue, TensorValue]:
    """Prefill attention of q [nnz_qo, Hq, D] (each request's last tokens)
    over the pool: (o [nnz_qo, Hq, D], lse [nnz_qo, Hq]).

    work_items, request_items: from `prefill_work` for this step, with the same
    causal and window_left.
    """
    num_qo_heads, head_dim = int(q.shape[1]), int(q.shape[2])
    options = AttentionOptions(
        head_dim, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta
    )
    group = num_qo_heads // int(paged_kv_cache.shape[3 if kv_layout == "NHD" else 2])
    tile = attention_work.prefill_tile(group, paged_kv_cache.device.is_gpu())
    return _attention_op(
        q,
        paged_kv_cache,
        kv_indices,
        kv_indptr,
        kv_last_page_len,
        work_items,
        request_items,
        kv_layout,
        options,
        # Queries per item are bounded by the tile size, whatever the step.
        options.int_params(1, causal=causal, max_queries=tile, kv_split=False),
    )


@functools.cache
def _decode_options(head_dim: int, window_left: int) -> AttentionOptions:
    """A decode step's options, checked once per (head_dim, window_left): a
    step builds its work list on every call."""
    return AttentionOptions(head_dim, window_left=window_left)


def decode_work(
    kv_indptr: np.ndarray,
    kv_last_page_len: np.ndarray,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window_left: int = -1,
    *,
    gpu: bool,
    fixed_chunk: int | None = None,
    kv_indices: np.ndarray | None = None,
    seq_lens: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The work list of a decode step (host NumPy): (work_items [I, 6] int32,
    request_items [B + 1] int32), for `batch_decode` in a graph on a GPU
    (`gpu`) or on the CPU: the two split keys differently.

    fixed_chunk (tokens, a multiple of page_size): split every request's
    keys at the same positions whatever else is in the batch, so that its
    attention sums in the same order (batch-invariant results); by default
    the chunks grow or shrink to keep every core busy. kv_indices (the page
    ids, CPU): consecutive requests that share a prefix's pages read them
    once (`share_decode_prefixes`; not batch-invariant), under a window the
    part of it each one sees.
    seq_lens [B]: the table's lengths where the caller has them
    (`BatchMetadata.seq_lens`), else computed from it."""
    options = _decode_options(head_dim, window_left)
    if seq_lens is None:
        seq_lens = seq_lens_from_page_table(kv_indptr, kv_last_page_len, page_size)
    elif np.shape(seq_lens) != (len(kv_indptr) - 1,):
        raise ValueError(
            f"seq_lens has shape {np.shape(seq_lens)}; the table's batch needs "
            f"({len(kv_indptr) - 1},)"
        )
    common, prefix = None, None
    if kv_indices is not None:
        if gpu or fixed_chunk is not None:
            raise ValueError("shared prefixes are read once on the CPU, without fixed_chunk")
    if kv_indices is not None and len(kv_indptr) > 2:
        # A lone request has no neighbour to share with: its plain work
        # list is the one the shared-prefix plan would make.
        common = attention_work.common_prefix_pages(np.asarray(kv_indptr), np.asarray(kv_indices))
        prefix = attention_work.shared_prefix_tokens(common, seq_lens, page_size)
    items, request_items = attention_work.decode_work(
        seq_lens,
        page_size,
        num_qo_heads,
        num_kv_heads,
        heads_per_task(num_qo_heads, num_kv_heads),
        options,
        gpu,
        fixed_chunk=fixed_chunk,
        shared_prefix=prefix,
    )
    if common is not None:
        group = num_qo_heads // num_kv_heads
        items = attention_work.share_decode_prefixes(items, request_items, common, page_size, group)
    return items, request_items


def prefill_work(
    qo_indptr: np.ndarray,
    kv_indptr: np.ndarray,
    kv_last_page_len: np.ndarray,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool = True,
    window_left: int = -1,
    *,
    gpu: bool,
    align: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The work list of a prefill step (host NumPy): (work_items [I, 6] int32,
    request_items [B + 1] int32), for `batch_prefill` in a graph on a GPU
    (`gpu`) or on the CPU. It must be the graph's device: the op runs as many
    query tokens per item as that device's tile (`prefill_tile`) and no
    more, so a CPU plan on a GPU would leave query rows unwritten. align:
    query tiles on a grid of positions (`attention_work.prefill_work`), so
    prompts prefilled in pieces that start there get the same sums."""
    options = AttentionOptions(head_dim, window_left=window_left)
    items, request_items, _ = attention_work.prefill_work(
        seq_lens_from_page_table(kv_indptr, kv_last_page_len, page_size),
        np.asarray(qo_indptr, np.int64),
        num_qo_heads // num_kv_heads,
        options,
        causal,
        gpu,
        align,
    )
    return items, request_items


def mla_attention(
    q_nope: TensorValue,
    q_pe: TensorValue,
    ckv_cache: BufferValue,
    kpe_cache: BufferValue,
    kv_indices: TensorValue,
    kv_indptr: TensorValue,
    work_items: TensorValue,
    request_items: TensorValue,
    sm_scale: float,
    causal: bool = True,
    decode: bool = True,
) -> tuple[TensorValue, TensorValue]:
    """MLA attention (absorbed) of q_nope [rows, H, ckv_dim] and q_pe [rows,
    H, kpe_dim] over the latent caches ckv [pages, page_size, ckv_dim] and
    kpe [pages, page_size, kpe_dim]: (o [rows, H, ckv_dim], lse [rows, H]),
    as `pagedkv.BatchMLAPagedAttentionWrapper` computes them.

    work_items, request_items: from `mla_work` for this step, with the same
    decode and causal. The caches are buffer values: an MLA append before
    this op on the same values is ordered first. FlashInfer's packed cache
    [pages, page_size, ckv_dim + kpe_dim] is read in place when passed as
    both: a cache's last dim is its row stride, ckv the first ckv_dim
    elements of a row, kpe the last kpe_dim (mojo_ops/mla/mla_pages.mojo).
    """
    from .mla import check_mla_dims, mla_float_params, mla_int_params

    device = ckv_cache.device
    _, heads, ckv_dim = q_nope.shape
    check_mla_dims(int(ckv_dim), int(q_pe.shape[2]), device.is_gpu())
    # Decode items (one query each) may split keys; prefill items write
    # final rows only, so their partial states are one-row placeholders.
    states = work_items.shape[0] if decode else 1
    outputs = _attention_outputs(q_nope, states, device)
    most = 1 if decode else attention_work.prefill_tile(int(heads), device.is_gpu())
    host = DeviceRef.CPU()
    operands = mla_operands(
        **outputs,
        q_nope=q_nope,
        q_pe=q_pe,
        ckv_cache=ckv_cache,
        kpe_cache=kpe_cache,
        kv_indices=kv_indices,
        kv_indptr=kv_indptr,
        work_items=work_items,
        request_items=request_items,
        float_params=ops.constant(mla_float_params(sm_scale, 1.0, 1.0), F32, device=host),
        int_params=ops.constant(mla_int_params(causal, decode, most), DType.int32, device=host),
    )
    ops.inplace_custom(MLA_OP, device=device, values=operands, parameters={"kv_format": 0})
    return ops.buffer_load(outputs["output"]), ops.buffer_load(outputs["lse"])


def mla_work(
    qo_indptr: np.ndarray,
    kv_len_arr: np.ndarray,
    page_size: int,
    num_heads: int,
    causal: bool = True,
    decode: bool = True,
    gpu: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The work list of an MLA step (host NumPy): (work_items [I, 6] int32,
    request_items [B + 1] int32), for `mla_attention` with the same decode
    (one query per request; raises otherwise) and causal."""
    from .mla import mla_work as plan_work

    items, request_items, _, _ = plan_work(
        np.asarray(qo_indptr), np.asarray(kv_len_arr), page_size, num_heads, causal, gpu, decode
    )
    return items, request_items
