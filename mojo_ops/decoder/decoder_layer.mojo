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
(docs/performance.md). Everything is checked before the first phase, so a
bad call raises before it writes the pool.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext

from ..attention.cpu.dispatch import AttentionPhases
from ..attention.custom_mask import CustomMask
from ..attention.params import INT_HEADS_PER_TASK, INT_KV_SPLIT
from ..attention.run import kv_element_type, read_params
from ..attention.work import AttentionWork
from ..cache.cache_tensors import cache_from_tensors
from ..cache.paged_kv_cache import KVLayout, Ptr
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
    size: Int,
) raises:
    """Raises unless norm holds `size` weights."""
    if norm.dim_size(0) != size:
        raise Error(
            "pagedkv: the decoder layer's ", name, " is not [", size, "]"
        )


def check_weight(
    name: StaticString,
    weight: InputTensor[dtype=DType.uint8, rank=2, ...],
    fmt: Int,
    n_dim: Int,
    k_dim: Int,
) raises:
    """Raises unless weight holds [n_dim, k_dim] in fmt's packed panels."""
    if weight.dim_size(0) != (n_dim + PANEL - 1) // PANEL or weight.dim_size(
        1
    ) != panel_bytes(fmt, k_dim):
        raise Error(
            "pagedkv: the decoder layer's ",
            name,
            " is not a packed [",
            n_dim,
            ", ",
            k_dim,
            "] weight",
        )


@extensibility.register("pagedkv_decoder_layer")
struct DecoderLayer:
    """One decoder layer over x [rows, H] float32 with GGUF-quantized
    weights; appends the rows' keys and values into a pool passed as
    k_cache, v_cache (cache/cache_tensors.mojo) and returns x_out [rows, H].

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
        k_cache: MutableInputTensor[rank=5, ...],
        v_cache: MutableInputTensor[dtype=k_cache.dtype, rank=5, ...],
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
        var cache = cache_from_tensors[KVLayout(layout)](
            k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len
        ).bitcast[kv_element_type[k_cache.dtype, kv_format]()]()
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
            or attn_norm.dim_size(0) != hidden
            or mlp_norm.dim_size(0) != hidden
            or norm_eps.dim_size(0) < 1
            or num_qo_heads % kv_heads != 0
        ):
            raise Error(
                "pagedkv: the decoder layer's x, x_out, norms or heads do not"
                " match"
            )
        check_weight("wqkv", wqkv, qkv_format, qkv_width - v_width, hidden)
        comptime if SPLIT_QKV:
            check_weight("wv", wv, v_format, v_width, hidden)
        check_weight("wo", wo, wo_format, hidden, q_width)
        check_weight(
            "w_gate_up", w_gate_up, gate_up_format, 2 * ffn_size, hidden
        )
        check_weight("w_down", w_down, down_format, hidden, ffn_size)
        comptime if qkv_bias != 0:
            check_norm("bqkv", bqkv, qkv_width)
        comptime if qk_norm != 0:
            check_norm("q_norm", q_norm, d)
            check_norm("k_norm", k_norm, d)
        comptime if sandwich_norms != 0:
            check_norm("post_attn_norm", post_attn_norm, hidden)
            check_norm("post_mlp_norm", post_mlp_norm, hidden)
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

            var quantize_x = RowQuantizer[DType.float32, RMS_NORM](
                ptr_of(x), ptr_of(attn_norm), eps, normed, rows
            )
            var qkv_product = QuantizedProduct[qkv_format, NO_EPILOGUE](
                ptr_of(wqkv),
                normed,
                qkv,
                qkv,
                rows,
                qkv_width - v_width,
                qkv_width,
            )
            comptime V_FORMAT = v_format if SPLIT_QKV else qkv_format
            var v_columns = qkv.unsafe_offset(qkv_width - v_width)
            var v_product = QuantizedProduct[V_FORMAT, NO_EPILOGUE](
                ptr_of(wv),
                normed,
                v_columns,
                v_columns,
                rows,
                v_width,
                qkv_width,
            )
            var qk_tasks = qkv_product.tasks()
            var qkv_rows = QKVRows(
                qkv,
                ptr_of(bqkv),
                ptr_of(q_norm),
                ptr_of(k_norm),
                eps,
                rows,
                num_qo_heads,
                kv_heads,
                d,
                qkv_bias != 0,
                qk_norm != 0,
            )
            var rope = RopeAppendRows[DType.float32, cache.dtype, cache.layout](
                cache,
                qkv,
                q,
                ptr_of(rope_cos),
                ptr_of(rope_sin),
                ptr_of(batch_indices),
                ptr_of(positions),
                rows,
                num_qo_heads,
            )
            var work = AttentionWork(
                ptr_of(work_items),
                num_items,
                ptr_of(request_items),
                partial_o,
                partial_lse,
                kv_split,
            )
            var attention = AttentionPhases[
                DType.float32, cache.dtype, cache.layout
            ](
                cache,
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
            var quantize_o = RowQuantizer[DType.float32, NO_PROLOGUE](
                o, ptr_of(attn_norm), 0, attended, rows
            )
            comptime SANDWICH = sandwich_norms != 0
            # Without sandwich norms a product adds its residual itself.
            comptime PRODUCT_EPILOGUE = NO_EPILOGUE if SANDWICH else ADD_RESIDUAL
            var wo_product = QuantizedProduct[wo_format, PRODUCT_EPILOGUE](
                ptr_of(wo),
                attended,
                proj if SANDWICH else out,
                ptr_of(x),
                rows,
                hidden,
                hidden,
            )
            var attn_sandwich = NormAddRows(
                proj,
                ptr_of(post_attn_norm),
                ptr_of(x),
                out,
                eps,
                rows if SANDWICH else 0,
                hidden,
            )
            var quantize_h = RowQuantizer[DType.float32, RMS_NORM](
                out, ptr_of(mlp_norm), eps, normed, rows
            )
            var gate_up_product = QuantizedProduct[gate_up_format, NO_EPILOGUE](
                ptr_of(w_gate_up),
                normed,
                gate_up,
                gate_up,
                rows,
                2 * ffn_size,
                2 * ffn_size,
            )
            comptime GATED = GEGLU if activation == GELU_TANH else SWIGLU
            var quantize_gu = RowQuantizer[DType.float32, GATED](
                gate_up, ptr_of(attn_norm), 0, activated, rows
            )
            var down_product = QuantizedProduct[down_format, PRODUCT_EPILOGUE](
                ptr_of(w_down),
                activated,
                proj if SANDWICH else out,
                out,
                rows,
                hidden,
                hidden,
            )
            var mlp_sandwich = NormAddRows(
                proj,
                ptr_of(post_mlp_norm),
                out,
                out,
                eps,
                rows if SANDWICH else 0,
                hidden,
            )

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
                if p == 0:
                    quantize_x.run(t)
                elif p == 1:
                    if t < qk_tasks:
                        qkv_product.run(t)
                    else:
                        v_product.run(t - qk_tasks)
                elif p == 2:
                    qkv_rows.run(t)
                elif p == 3:
                    rope.run(t)
                elif p == 4:
                    attention.run_item(t)
                elif p == 5:
                    attention.run_merge(t)
                elif p == 6:
                    quantize_o.run(t)
                elif p == 7:
                    wo_product.run(t)
                elif p == 8:
                    attn_sandwich.run(t)
                elif p == 9:
                    quantize_h.run(t)
                elif p == 10:
                    gate_up_product.run(t)
                elif p == 11:
                    quantize_gu.run(t)
                elif p == 12:
                    down_product.run(t)
                else:
                    mlp_sandwich.run(t)

            var phases = Phases()
            _ = phases.add(quantize_x.tasks())
            _ = phases.add(qk_tasks + v_product.tasks())
            _ = phases.add(qkv_rows.tasks())
            _ = phases.add(rope.tasks())
            _ = phases.add(attention.item_tasks())
            _ = phases.add(attention.merge_tasks())
            _ = phases.add(quantize_o.tasks())
            _ = phases.add(wo_product.tasks())
            _ = phases.add(attn_sandwich.tasks())
            _ = phases.add(quantize_h.tasks())
            _ = phases.add(gate_up_product.tasks())
            _ = phases.add(quantize_gu.tasks())
            _ = phases.add(down_product.tasks())
            _ = phases.add(mlp_sandwich.tasks())
            parallel_phases(task, phases)
            scratch^.free()
