"""A decoder layer with GGUF-quantized weights as one CPU op: Llama's block,
Qwen's or Gemma 3's.

x_out = h + down(act(gate(n2)) * up(n2)), h = x + wo(attention(rope(qkv(n1)))),
n1 = RMSNorm(x) and n2 = RMSNorm(h), over a step's token rows: the same
products (quantized/qlinear.mojo), RoPE and append (page_ops/rope_append.mojo)
and attention (attention/cpu/dispatch.mojo) as the separate ops, run as the
phases of one dispatch to the cores (work_queue.mojo). Qwen 2's block adds
a bias to the Q|K|V rows, Qwen 3's an RMSNorm of each query and key head
before RoPE (QK-norm); Gemma 3's adds QK-norm and an RMSNorm of each
product's output before its residual add (sandwich norms: h = x +
RMSNorm(wo(..)), x_out = h + RMSNorm(down(..))), with GELU's tanh form as
act (row_norms.mojo, quantized/activations.mojo):

     0  quantize x after RMSNorm            7  wo product, + x         -> x_out
     1  Q|K|V product(s)         -> qkv        (sandwich: -> proj)
     2  bias; QK-norm of q, k    -> qkv     8  sandwich: x + RMSNorm(proj)
     3  RoPE, append K and V     -> q       9  quantize x_out after RMSNorm
     4  attention work items     -> o      10  gate|up product          -> gu
     5  merge key-split states   -> o      11  quantize act(gate) * up
     6  quantize o                         12  down product, + x_out -> x_out
                                               (sandwich: -> proj)
                                           13  sandwich: x_out + RMSNorm(proj)

A phase the block does not have has no tasks. Q|K|V is one product, or two
side by side where the file stores V in another format than Q and K (as
llama.cpp's Q4_K_M does in half its layers): wqkv then holds Q's and K's
rows and wv V's, and both write their columns of the same qkv rows in the
same phase.

A decode step of a small model is some hundred such steps, each a few to a
few tens of microseconds of work; as separate ops each would pay MAX's
dispatch between ops and a wake-up of the cores, as much again as the work
(docs/performance.md). So one op runs a run of consecutive layers of the
same shapes and formats, all their phases on one dispatch: each layer's
pool is one of the op's variadic operands, each weight holds the run's
layers one after another, and layer l + 1 reads the rows layer l wrote
into x_out. Everything is checked before the first phase, so a bad call
raises before it writes any pool.
"""

import extensibility
from std.memory import stack_allocation
from extensibility import InputTensor, OutputTensor
from extensibility import (
    _MutableInputVariadicTensors as MutableInputVariadicTensors,
)
from max.gpu.host import DeviceContext

from ..attention.cpu.dispatch import AttentionPhases
from ..attention.custom_mask import CustomMask
from ..attention.params import INT_HEADS_PER_TASK, INT_KV_SPLIT
from ..attention.run import kv_element_type, read_params
from ..attention.work import AttentionWork
from ..cache.cache_tensors import cache_from_tensors
from ..cache.paged_kv_cache import KVLayout, PagedKVCache, Ptr
from ..cache.tensor_access import ptr_of
from ..page_ops.append import check_append
from ..page_ops.rope_append import RopeAppendRows, check_rope_append
from ..quantized.activations import (
    GEGLU,
    NO_PROLOGUE,
    RMS_NORM,
    SWIGLU,
    QuantizedRows,
    RowQuantizer,
    ScratchArena,
)
from ..quantized.block_formats import PANEL, panel_bytes
from ..quantized.qlinear import ADD_RESIDUAL, NO_EPILOGUE, QuantizedProduct
from ..simd.widen import F32
from ..work_queue import Phases, parallel_phases
from .row_norms import NormAddRows, QKVRows

comptime SILU = 0
"""The MLP's activation (pagedkv._ops.contract.DECODER_ACTIVATIONS):
SwiGLU."""
comptime GELU_TANH = 1
"""GeGLU with GELU's tanh form (Gemma 3)."""
comptime V_IN_QKV = -1
"""The `v_format` of a layer whose V rows are in wqkv with Q's and K's
(pagedkv._ops.contract.V_IN_QKV)."""


def check_norm(
    name: StaticString,
    norm: InputTensor[dtype=DType.float32, rank=1, ...],
    layers: Int,
    size: Int,
) raises:
    """Raises unless norm holds `size` weights for each of `layers` layers."""
    if norm.dim_size(0) != layers * size:
        raise Error(
            "pagedkv: the decoder layers' ",
            name,
            " is not [",
            layers,
            " x ",
            size,
            "]",
        )


def check_weight(
    name: StaticString,
    weight: InputTensor[dtype=DType.uint8, rank=2, ...],
    fmt: Int,
    layers: Int,
    n_dim: Int,
    k_dim: Int,
) raises:
    """Raises unless weight holds `layers` [n_dim, k_dim] matrices in fmt's
    packed panels, one after another."""
    if weight.dim_size(0) != layers * (
        (n_dim + PANEL - 1) // PANEL
    ) or weight.dim_size(1) != panel_bytes(fmt, k_dim):
        raise Error(
            "pagedkv: the decoder layers' ",
            name,
            " is not ",
            layers,
            " packed [",
            n_dim,
            ", ",
            k_dim,
            "] weight",
        )


comptime LAYER_PHASES = 14
"""Phases of one layer (the table above)."""


@always_inline
def layer_panels(
    weight: InputTensor[dtype=DType.uint8, rank=2, ...], layers: Int, l: Int
) -> Ptr[DType.uint8]:
    """Layer l's packed panels in a weight of `layers` stacked matrices."""
    return ptr_of(weight).unsafe_offset(
        l * (weight.dim_size(0) // layers) * weight.dim_size(1)
    )


@always_inline
def layer_row(
    stacked: InputTensor[dtype=DType.float32, rank=1, ...], l: Int, size: Int
) -> Ptr[F32]:
    """Layer l's `size` weights in a norm or bias of stacked layers (an
    empty one, which a layer without it never reads, gives its start)."""
    return ptr_of(stacked).unsafe_offset(
        l * size if stacked.dim_size(0) > 0 else 0
    )


@extensibility.register("pagedkv_decoder_layer")
struct DecoderLayer:
    """A run of decoder layers over x [rows, H] float32 with GGUF-quantized
    weights; appends the rows' keys and values into each layer's pool (the
    variadic `pools`, [pages, 2, ...page...] each, in the run's order) and
    returns x_out [rows, H]. Each weight, norm and bias holds the run's
    layers one after another along its first axis.

    Parameters: the pool's `layout` and `kv_format` (as the attention op's),
    the four products' GGUF formats, `v_format` (V_IN_QKV, or the format
    of wv where wqkv holds only Q's and K's rows), `num_qo_heads`,
    `ffn_size`, and the families' choices: `qkv_bias` (bqkv [(Hq + 2 Hkv)
    D]), `qk_norm` (q_norm, k_norm [D]), `sandwich_norms` (post_attn_norm,
    post_mlp_norm [H]) and `activation` (SILU or GELU_TANH); a bias or
    norms a layer does not use may be empty. `float_params` and
    `int_params` are the attention op's (attention/params.mojo: the
    layer's window among them), `norm_eps` [1] the RMSNorms' epsilon; the
    row indices, page table and work lists as for append and attention.
    """

    @staticmethod
    def execute[
        target: StaticString,
        layout: Int,
        kv_format: Int,
        qkv_format: Int,
        v_format: Int,
        wo_format: Int,
        gate_up_format: Int,
        down_format: Int,
        num_qo_heads: Int,
        ffn_size: Int,
        qkv_bias: Int,
        qk_norm: Int,
        sandwich_norms: Int,
        activation: Int,
    ](
        x_out: OutputTensor[dtype=DType.float32, rank=2, ...],
        pools: MutableInputVariadicTensors[rank=5, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        attn_norm: InputTensor[dtype=DType.float32, rank=1, ...],
        wqkv: InputTensor[dtype=DType.uint8, rank=2, ...],
        wv: InputTensor[dtype=DType.uint8, rank=2, ...],
        bqkv: InputTensor[dtype=DType.float32, rank=1, ...],
        wo: InputTensor[dtype=DType.uint8, rank=2, ...],
        mlp_norm: InputTensor[dtype=DType.float32, rank=1, ...],
        w_gate_up: InputTensor[dtype=DType.uint8, rank=2, ...],
        w_down: InputTensor[dtype=DType.uint8, rank=2, ...],
        q_norm: InputTensor[dtype=DType.float32, rank=1, ...],
        k_norm: InputTensor[dtype=DType.float32, rank=1, ...],
        post_attn_norm: InputTensor[dtype=DType.float32, rank=1, ...],
        post_mlp_norm: InputTensor[dtype=DType.float32, rank=1, ...],
        rope_cos: InputTensor[dtype=DType.float32, rank=2, ...],
        rope_sin: InputTensor[dtype=DType.float32, rank=2, ...],
        batch_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        positions: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        work_items: InputTensor[dtype=DType.int32, rank=2, ...],
        request_items: InputTensor[dtype=DType.int32, rank=1, ...],
        float_params: InputTensor[dtype=DType.float32, rank=1, ...],
        int_params: InputTensor[dtype=DType.int32, rank=1, ...],
        norm_eps: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pagedkv: pagedkv_decoder_layer runs on the CPU")
        comptime LAYERS = pools.size
        comptime KV_LAYOUT = KVLayout(layout)
        comptime KV_ELEMENT = kv_element_type[pools.dtype, kv_format]()
        comptime Cache = PagedKVCache[KV_ELEMENT, KV_LAYOUT]
        # Each layer's pool viewed through the step's page table. The pools
        # are the op's one variadic operand, which only compile-time indices
        # reach: the views are gathered here, the layers then run as a
        # runtime loop over them.
        var caches = stack_allocation[LAYERS, Cache]()
        comptime for l in range(LAYERS):
            caches[l] = cache_from_tensors[KV_LAYOUT](
                pools[l], pools[l], kv_indices, kv_indptr, kv_last_page_len
            ).bitcast[KV_ELEMENT]()
        var cache = caches[0]
        var rows = x.dim_size(0)
        var hidden = x.dim_size(1)
        var d = cache.head_dim()
        var kv_heads = cache.num_kv_heads()
        var q_width = num_qo_heads * d
        var qkv_width = (num_qo_heads + 2 * kv_heads) * d
        comptime SPLIT_QKV = v_format != V_IN_QKV
        # Columns of qkv that wv writes (none where wqkv holds them all).
        var v_width = kv_heads * d if SPLIT_QKV else 0
        if (
            x_out.dim_size(0) != rows
            or x_out.dim_size(1) != hidden
            or attn_norm.dim_size(0) != LAYERS * hidden
            or mlp_norm.dim_size(0) != LAYERS * hidden
            or norm_eps.dim_size(0) < 1
            or num_qo_heads % kv_heads != 0
        ):
            raise Error(
                "pagedkv: the decoder layers' x, x_out, norms or heads do not"
                " match"
            )
        # Pools of one shape: the page table and the rows' slots, checked
        # once against the first, hold for every layer's.
        for l in range(1, LAYERS):
            if (
                caches[l].head_dim() != d
                or caches[l].num_kv_heads() != kv_heads
                or caches[l].page_size() != cache.page_size()
                or caches[l].num_pages != cache.num_pages
            ):
                raise Error("pagedkv: the decoder layers' pools differ")
        check_weight(
            "wqkv", wqkv, qkv_format, LAYERS, qkv_width - v_width, hidden
        )
        comptime if SPLIT_QKV:
            check_weight("wv", wv, v_format, LAYERS, v_width, hidden)
        check_weight("wo", wo, wo_format, LAYERS, hidden, q_width)
        check_weight(
            "w_gate_up",
            w_gate_up,
            gate_up_format,
            LAYERS,
            2 * ffn_size,
            hidden,
        )
        check_weight("w_down", w_down, down_format, LAYERS, hidden, ffn_size)
        comptime if qkv_bias != 0:
            check_norm("bqkv", bqkv, LAYERS, qkv_width)
        comptime if qk_norm != 0:
            check_norm("q_norm", q_norm, LAYERS, d)
            check_norm("k_norm", k_norm, LAYERS, d)
        comptime if sandwich_norms != 0:
            check_norm("post_attn_norm", post_attn_norm, LAYERS, hidden)
            check_norm("post_mlp_norm", post_mlp_norm, LAYERS, hidden)
        if rope_sin.dim_size(0) != rope_cos.dim_size(0) or rope_sin.dim_size(
            1
        ) != rope_cos.dim_size(1):
            raise Error("pagedkv: the decoder layer's cos and sin differ")
        check_append[target](
            cache,
            batch_indices,
            positions,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
            ctx,
        )
        check_rope_append(
            cache,
            rows,
            num_qo_heads,
            d,
            rows,
            qkv_width,
            rope_cos.dim_size(0),
            rope_cos.dim_size(1),
            ptr_of(positions),
            rows,
        )
        if rows == 0:
            return
        comptime if target == "cpu":
            var num_items = work_items.dim_size(0)
            var batch_size = request_items.dim_size(0) - 1
            var eps = ptr_of(norm_eps)[unsafe_offset=0]
            var kv_split = Int(int_params[INT_KV_SPLIT]) != 0
            # Scratch: float32 rows, then the quantized activations.
            var floats = rows * (
                qkv_width + 2 * q_width + num_qo_heads + 2 * ffn_size + hidden
            ) + num_items * num_qo_heads * (d + 1)
            var norm_bytes = QuantizedRows.bytes(rows, hidden)
            var o_bytes = QuantizedRows.bytes(rows, q_width)
            var ffn_bytes = QuantizedRows.bytes(rows, ffn_size)
            var scratch = ScratchArena(
                4 * floats + norm_bytes + o_bytes + ffn_bytes + 64 * 10
            )

            @always_inline
            def take_f32(mut arena: ScratchArena, count: Int) -> Ptr[F32]:
                return rebind[Ptr[F32]](arena.take(4 * count))

            var qkv = take_f32(scratch, rows * qkv_width)
            var q = take_f32(scratch, rows * q_width)
            var o = take_f32(scratch, rows * q_width)
            var lse = take_f32(scratch, rows * num_qo_heads)
            var gate_up = take_f32(scratch, rows * 2 * ffn_size)
            var partial_o = take_f32(scratch, num_items * num_qo_heads * d)
            # A product's output before its sandwich norm (Gemma 3).
            var proj = take_f32(scratch, rows * hidden)
            var partial_lse = take_f32(scratch, num_items * num_qo_heads)
            var normed = QuantizedRows(scratch.take(norm_bytes), rows, hidden)
            var attended = QuantizedRows(scratch.take(o_bytes), rows, q_width)
            var activated = QuantizedRows(
                scratch.take(ffn_bytes), rows, ffn_size
            )
            var out = ptr_of(x_out)

            comptime V_FORMAT = v_format if SPLIT_QKV else qkv_format
            comptime SANDWICH = sandwich_norms != 0
            # Without sandwich norms a product adds its residual itself.
            comptime PRODUCT_EPILOGUE = NO_EPILOGUE if SANDWICH else ADD_RESIDUAL
            comptime GATED = GEGLU if activation == GELU_TANH else SWIGLU
            comptime Product[fmt: Int, epilogue: Int] = QuantizedProduct[
                fmt, epilogue
            ]
            comptime Quantizer[prologue: Int] = RowQuantizer[
                DType.float32, prologue
            ]
            var quantize_x = stack_allocation[LAYERS, Quantizer[RMS_NORM]]()
            var qkv_product = stack_allocation[
                LAYERS, Product[qkv_format, NO_EPILOGUE]
            ]()
            var v_product = stack_allocation[
                LAYERS, Product[V_FORMAT, NO_EPILOGUE]
            ]()
            var qkv_rows = stack_allocation[LAYERS, QKVRows]()
            var rope = stack_allocation[
                LAYERS, RopeAppendRows[DType.float32, KV_ELEMENT, KV_LAYOUT]
            ]()
            var attention = stack_allocation[
                LAYERS, AttentionPhases[DType.float32, KV_ELEMENT, KV_LAYOUT]
            ]()
            var wo_product = stack_allocation[
                LAYERS, Product[wo_format, PRODUCT_EPILOGUE]
            ]()
            var attn_sandwich = stack_allocation[LAYERS, NormAddRows]()
            var quantize_h = stack_allocation[LAYERS, Quantizer[RMS_NORM]]()
            var gate_up_product = stack_allocation[
                LAYERS, Product[gate_up_format, NO_EPILOGUE]
            ]()
            var down_product = stack_allocation[
                LAYERS, Product[down_format, PRODUCT_EPILOGUE]
            ]()
            var mlp_sandwich = stack_allocation[LAYERS, NormAddRows]()
            # Layer-independent: quantize o, quantize act(gate) * up.
            var quantize_o = Quantizer[NO_PROLOGUE](
                o, ptr_of(attn_norm), 0, attended, rows
            )
            var quantize_gu = Quantizer[GATED](
                gate_up, ptr_of(attn_norm), 0, activated, rows
            )
            var work = AttentionWork(
                ptr_of(work_items),
                num_items,
                ptr_of(request_items),
                partial_o,
                partial_lse,
                kv_split,
            )
            var v_columns = qkv.unsafe_offset(qkv_width - v_width)
            for l in range(LAYERS):
                # Layer l reads the rows layer l - 1 wrote into x_out (each
                # row phase and product epilogue reads an element before it
                # writes it), layer 0 reads x.
                var x_l = ptr_of(x) if l == 0 else out
                quantize_x[l] = Quantizer[RMS_NORM](
                    x_l, layer_row(attn_norm, l, hidden), eps, normed, rows
                )
                qkv_product[l] = Product[qkv_format, NO_EPILOGUE](
                    layer_panels(wqkv, LAYERS, l),
                    normed,
                    qkv,
                    qkv,
                    rows,
                    qkv_width - v_width,
                    qkv_width,
                )
                v_product[l] = Product[V_FORMAT, NO_EPILOGUE](
                    layer_panels(wv, LAYERS, l),
                    normed,
                    v_columns,
                    v_columns,
                    rows,
                    v_width,
                    qkv_width,
                )
                qkv_rows[l] = QKVRows(
                    qkv,
                    layer_row(bqkv, l, qkv_width),
                    layer_row(q_norm, l, d),
                    layer_row(k_norm, l, d),
                    eps,
                    rows,
                    num_qo_heads,
                    kv_heads,
                    d,
                    qkv_bias != 0,
                    qk_norm != 0,
                )
                rope[l] = RopeAppendRows[DType.float32, KV_ELEMENT, KV_LAYOUT](
                    caches[l],
                    qkv,
                    q,
                    ptr_of(rope_cos),
                    ptr_of(rope_sin),
                    ptr_of(batch_indices),
                    ptr_of(positions),
                    rows,
                    num_qo_heads,
                )
                attention[l] = AttentionPhases[
                    DType.float32, KV_ELEMENT, KV_LAYOUT
                ](
                    caches[l],
                    q,
                    o,
                    lse,
                    work,
                    read_params(float_params, int_params),
                    # No mask: its pointers are never read.
                    CustomMask(
                        rebind[Ptr[DType.uint8]](ptr_of(work_items)),
                        ptr_of(work_items),
                        False,
                    ),
                    num_qo_heads,
                    max(Int(int_params[INT_HEADS_PER_TASK]), 1),
                    batch_size,
                    kv_split and num_items > batch_size,
                )
                wo_product[l] = Product[wo_format, PRODUCT_EPILOGUE](
                    layer_panels(wo, LAYERS, l),
                    attended,
                    proj if SANDWICH else out,
                    x_l,
                    rows,
                    hidden,
                    hidden,
                )
                attn_sandwich[l] = NormAddRows(
                    proj,
                    layer_row(post_attn_norm, l, hidden),
                    x_l,
                    out,
                    eps,
                    rows if SANDWICH else 0,
                    hidden,
                )
                quantize_h[l] = Quantizer[RMS_NORM](
                    out, layer_row(mlp_norm, l, hidden), eps, normed, rows
                )
                gate_up_product[l] = Product[gate_up_format, NO_EPILOGUE](
                    layer_panels(w_gate_up, LAYERS, l),
                    normed,
                    gate_up,
                    gate_up,
                    rows,
                    2 * ffn_size,
                    2 * ffn_size,
                )
                down_product[l] = Product[down_format, PRODUCT_EPILOGUE](
                    layer_panels(w_down, LAYERS, l),
                    activated,
                    proj if SANDWICH else out,
                    out,
                    rows,
                    hidden,
                    hidden,
                )
                mlp_sandwich[l] = NormAddRows(
                    proj,
                    layer_row(post_mlp_norm, l, hidden),
                    out,
                    out,
                    eps,
                    rows if SANDWICH else 0,
                    hidden,
                )
            var qk_tasks = qkv_product[0].tasks()

            def task(
                p: Int, t: Int
            ) {
                var quantize_x,
                var qkv_product,
                var v_product,
                var qk_tasks,
                var qkv_rows,
                var rope,
                var attention,
                var quantize_o,
                var wo_product,
                var attn_sandwich,
                var quantize_h,
                var gate_up_product,
                var quantize_gu,
                var down_product,
                var mlp_sandwich,
            }:
                var l = p // LAYER_PHASES
                var phase = p % LAYER_PHASES
                if phase == 0:
                    quantize_x[l].run(t)
                elif phase == 1:
                    if t < qk_tasks:
                        qkv_product[l].run(t)
                    else:
                        v_product[l].run(t - qk_tasks)
                elif phase == 2:
                    qkv_rows[l].run(t)
                elif phase == 3:
                    rope[l].run(t)
                elif phase == 4:
                    attention[l].run_item(t)
                elif phase == 5:
                    attention[l].run_merge(t)
                elif phase == 6:
                    quantize_o.run(t)
                elif phase == 7:
                    wo_product[l].run(t)
                elif phase == 8:
                    attn_sandwich[l].run(t)
                elif phase == 9:
                    quantize_h[l].run(t)
                elif phase == 10:
                    gate_up_product[l].run(t)
                elif phase == 11:
                    quantize_gu.run(t)
                elif phase == 12:
                    down_product[l].run(t)
                else:
                    mlp_sandwich[l].run(t)

            # Every layer's phases have the same task counts (the same
            # shapes, rows and work list): layer 0's stand for all.
            var phases = Phases()
            _ = phases.add(quantize_x[0].tasks())
            _ = phases.add(qk_tasks + v_product[0].tasks())
            _ = phases.add(qkv_rows[0].tasks())
            _ = phases.add(rope[0].tasks())
            _ = phases.add(attention[0].item_tasks())
            _ = phases.add(attention[0].merge_tasks())
            _ = phases.add(quantize_o.tasks())
            _ = phases.add(wo_product[0].tasks())
            _ = phases.add(attn_sandwich[0].tasks())
            _ = phases.add(quantize_h[0].tasks())
            _ = phases.add(gate_up_product[0].tasks())
            _ = phases.add(quantize_gu.tasks())
            _ = phases.add(down_product[0].tasks())
            _ = phases.add(mlp_sandwich[0].tasks())
            parallel_phases(task, phases, LAYERS)
            scratch^.free()
