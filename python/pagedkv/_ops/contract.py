"""The codes pagedkv's Python and its Mojo ops share: one home on this side.

Each value here has a twin in mojo_ops/ (named in the comment beside it);
tests/ops/test_op_contract.py parses the Mojo sources and checks that the two
agree, so a code changed on one side only fails the suite.
"""

from __future__ import annotations

from max.dtype import DType

KV_LAYOUTS = {"NHD": 0, "HND": 1}
"""Pool layouts as op parameter `layout` (cache/paged_kv_cache.mojo: KVLayout.NHD, .HND)."""

KV_AS_STORED = 0
"""Op parameter `kv_format` of a 16- or 32-bit pool (attention/run.mojo: KV_AS_STORED)."""

FP8_FORMATS = {DType.float8_e4m3fn: 1, DType.float8_e5m2: 2}
"""`kv_format` of an fp8 pool, passed as uint8 (attention/run.mojo: KV_FP8_E4M3, KV_FP8_E5M2)."""

INT8_ROW_SCALE_BYTES = 4
"""Bytes an int8 pool's page holds per (token, head) row past the rows' codes:
the row's float32 scale, all of a page half's scales after its rows
(cache/paged_kv_cache.mojo: INT8_ROW_SCALE_BYTES, cache/int8_rows.mojo)."""


def pool_row_width(dtype: DType, head_dim: int) -> int:
    """A `dtype` pool's last axis for head_dim: head_dim, or head_dim + 4 for
    int8, whose page [P, H, D + 4] (or [H, P, D + 4]) holds its rows' codes
    and then their scales."""
    return head_dim + (INT8_ROW_SCALE_BYTES if dtype == DType.int8 else 0)


def pool_head_dim(dtype: DType, row_width: int) -> int:
    """head_dim of a `dtype` pool whose last axis is row_width."""
    return row_width - (INT8_ROW_SCALE_BYTES if dtype == DType.int8 else 0)


POS_ENCODING_MODES = {"NONE": 0, "ROPE_LLAMA": 1, "ALIBI": 2}
"""int_params[INT_POS_ENCODING] (attention/params.mojo: POS_NONE, POS_ROPE_LLAMA, POS_ALIBI)."""

GPU_KERNEL_GENERIC = 0
GPU_KERNEL_TMA = 1
GPU_KERNEL_AUTO = 2
GPU_KERNEL_MMA = 3
"""int_params[INT_GPU_KERNEL]: the GPU decode kernel plan() chose (attention/gpu/dispatch.mojo)."""

HEAD_DIMS = (64, 128, 256)
"""Head dims the GPU attention kernels are compiled for (attention/gpu/dispatch.mojo: HEAD_DIMS)."""

MIN_HEAD_DIM = 64
"""The CPU kernel's head_dim granule: one compiled kernel serves every multiple
(attention/cpu/step_sizes.mojo: MIN_HEAD_DIM)."""

CPU_MAX_HEAD_DIM = 512
"""The largest head_dim the CPU kernel is tested at (FlashInfer's largest)."""

CPU_HEAD_DIMS = tuple(range(MIN_HEAD_DIM, CPU_MAX_HEAD_DIM + 1, MIN_HEAD_DIM))
"""Head dims the CPU attention kernel takes."""

ITEM_FIELDS = 6
"""int32 fields of one attention work item (attention/work.mojo: ITEM_FIELDS)."""

# Slots of the attention ops' host parameter tensors (attention/params.mojo).
FLOAT_PARAMS = 8
F_SM_SCALE, F_SOFT_CAP, F_ROPE_SCALE, F_ROPE_THETA, F_QK_SCALE, F_V_SCALE = range(6)
INT_PARAMS = 8
INT_WINDOW_LEFT, INT_POS_ENCODING, INT_HEADS_PER_TASK, INT_CAUSAL, INT_MAX_ROWS = range(5)
INT_GPU_KERNEL = 5
INT_KV_SPLIT = 6

ATTENTION_OPERANDS = (
    "output",
    "lse",
    "partial_o",
    "partial_lse",
    "q",
    "k_cache",
    "v_cache",
    "kv_indices",
    "kv_indptr",
    "kv_last_page_len",
    "work_items",
    "request_items",
    "custom_mask",
    "mask_rows",
    "float_params",
    "int_params",
)
"""The attention op's operands in order (BatchAttention.execute's parameters)."""


def _in_order(op: str, names: tuple[str, ...], values: dict[str, object]) -> list:
    """values, which must name exactly `names`, listed in names' order (the
    order of `op`'s parameters); a missing or extra name is a TypeError."""
    if set(values) != set(names):
        raise TypeError(f"{op} operands {sorted(values)} are not {names}")
    return [values[name] for name in names]


def attention_operands(**values: object) -> list:
    """The values named by ATTENTION_OPERANDS, in the op's order."""
    return _in_order("attention", ATTENTION_OPERANDS, values)


APPEND_OP = "pagedkv_append_paged_kv_cache"
"""Appending K/V rows into a paged pool, after checking every index (page_ops/append.mojo)."""

APPEND_MLA_OP = "pagedkv_append_paged_mla_kv_cache"
"""Appending MLA's latent and rope rows (page_ops/append.mojo)."""

GATHER_OP = "pagedkv_gather_kv"
"""Reading requests' K/V rows out of the pool into contiguous rows (page_ops/gather.mojo)."""

COPY_PAGES_OP = "pagedkv_copy_pages"
"""Copying whole pages within a pool or between tiers (page_ops/copy_pages.mojo)."""

SEQ_LENS_OP = "pagedkv_get_seq_lens"
"""Sequence lengths from a page table (page_ops/page_table.mojo)."""

BATCH_INDICES_OP = "pagedkv_get_batch_indices_positions"
"""Each appended row's request and position (page_ops/page_table.mojo)."""

CHECK_PAGE_TABLE_OP = "pagedkv_check_page_table"
"""Validating a page table against its pool (page_ops/page_table.mojo)."""

MERGE_STATE_IN_PLACE_OP = "pagedkv_merge_state_in_place"
"""Merging one attention state into another in place (merge/merge_states.mojo)."""

MERGE_STATES_OP = "pagedkv_merge_states"
"""Merging several attention states (merge/merge_states.mojo)."""

ATTENTION_OP = "pagedkv_batch_attention"
"""The one op of batch decode and prefill (attention/batch_attention.mojo); they differ
by their work items and int_params[INT_KV_SPLIT]."""

LINEAR_OP = "pagedkv_linear"
"""The CPU op of a model's linear layers, y = x @ w (linear/linear.mojo)."""

LINEAR_PANEL = 64
"""Columns of a packed weight panel (linear/linear.mojo: LINEAR_PANEL)."""

DECODER_LAYER_OP = "pagedkv_decoder_layer"
"""A Llama, Qwen or Gemma decoder layer with quantized weights in one CPU op
(decoder/decoder_layer.mojo)."""

DECODER_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""The decoder layer op's `activation` parameter (decoder/decoder_layer.mojo:
SILU, GELU_TANH)."""

V_IN_QKV = -1
"""The decoder layer op's `v_format` where wqkv holds V's rows with Q's and
K's (decoder/decoder_layer.mojo: V_IN_QKV); else wv holds them, in that
format."""

ROPE_APPEND_OP = "pagedkv_rope_append"
"""RoPE on a layer's fused Q|K|V rows with the append of K and V (page_ops/rope_append.mojo)."""

QLINEAR_OP = "pagedkv_qlinear"
"""The CPU op of linear layers with GGUF-quantized weights (quantized/qlinear.mojo)."""

PACKED_ROWS_OP = "pagedkv_packed_rows"
"""Rows of a GGUF-quantized weight packed in panels, dequantized: an
embedding lookup (quantized/packed_rows.mojo)."""

QUANT_PANEL = 16
"""Output columns of a packed quantized panel (quantized/block_formats.mojo: PANEL)."""

QUANT_FORMATS = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}
"""GGUF block formats the quantized product takes, as its `format` parameter:
GGML's type ids (quantized/block_formats.mojo)."""

QLINEAR_PROLOGUES = {"none": 0, "rms_norm": 1, "swiglu": 2, "geglu": 3}
"""The quantized product's `prologue` parameter (quantized/activations.mojo:
NO_PROLOGUE, RMS_NORM, SWIGLU, GEGLU: gelu_tanh(gate) * up)."""

QLINEAR_EPILOGUES = {"none": 0, "add": 1}
"""The quantized product's `epilogue` parameter (quantized/qlinear.mojo:
NO_EPILOGUE, ADD_RESIDUAL)."""

CPU_ISA_OP = "pagedkv_cpu_isa"
"""The probe of what the CPU kernels were compiled for (simd/isa.mojo)."""

CPU_ISA_FIELDS = (
    "x86",
    "avx2",
    "avx512f",
    "vnni",
    "maddubs",
    "sdot",
    "dot_bf16",
    "f32_lanes",
    "vector_registers",
    "amx",
)
"""The probe's int32 output, in order (simd/isa.mojo: CPU_ISA_FIELDS counts them)."""

AMX_ENV = "PAGEDKV_AMX"
"""Set to 0 to keep quantized products off AMX tiles (simd/amx.mojo: AMX_ENV)."""

MASK_READ_PADDING = 8
"""Zero bytes after a packed custom mask (attention/custom_mask.mojo: BIT_READ_PADDING)."""

MLA_OP = "pagedkv_mla_attention"
"""MLA attention over the paged latent cache, decode and prefill (mla/mla_attention.mojo)."""

MLA_OPERANDS = (
    "output",
    "lse",
    "partial_o",
    "partial_lse",
    "q_nope",
    "q_pe",
    "ckv_cache",
    "kpe_cache",
    "kv_indices",
    "kv_indptr",
    "work_items",
    "request_items",
    "float_params",
    "int_params",
)
"""The MLA op's operands in order (MLAAttention.execute's parameters)."""


def mla_operands(**values: object) -> list:
    """The values named by MLA_OPERANDS, in the op's order."""
    return _in_order("MLA", MLA_OPERANDS, values)


MLA_DIM_GRANULE = 16
"""ckv and kpe dims are multiples of it on the CPU, kpe may be 0
(mla/mla_attention.mojo: MLA_DIM_GRANULE)."""
MLA_GPU_DIM_GRANULE = 64
"""ckv and kpe dims are multiples of it on a GPU (mla/mla_attention.mojo)."""

MLA_GPU_MAX_CKV = 512
MLA_GPU_MAX_QK = 640
"""The GPU kernel's bounds on ckv_dim and ckv_dim + kpe_dim (mla/gpu_kernel.mojo)."""

# Slots of the MLA op's host parameter tensors (mla/mla_pages.mojo).
MLA_FLOAT_PARAMS = 4
F_MLA_SM_SCALE, F_MLA_CKV_SCALE, F_MLA_KPE_SCALE = range(3)
MLA_INT_PARAMS = 4
INT_MLA_CAUSAL, INT_MLA_KV_SPLIT, INT_MLA_MAX_QUERIES = range(3)
