"""MLA's paged latent cache as the attention op reads it, and its options.

Two one-head NHD pools share one page table: ckv (the compressed latent,
which is both K's first part and V, ckv_dim wide) and kpe (the rope part of
K, kpe_dim wide). Each pool's token rows lie a row stride apart, which may
exceed its width: in FlashInfer's packed cache [pages, page_size, ckv_dim +
kpe_dim] both pools are the one tensor, ckv the first ckv_dim elements of a
row and kpe the last kpe_dim, both with the packed row as their stride.
Token `tok` of request b lives in page kv_indices[kv_indptr[b] + tok //
page_size] at slot tok % page_size; plan() checked that every page a work
item reads exists.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder

from ..attention.params import LOG2E
from ..cache.paged_kv_cache import IndexPtr, Ptr

# Slots of the MLA op's host parameter tensors, float_params [4] and
# int_params [4] (Python twins in python/pagedkv/_ops/contract.py).
comptime F_MLA_SM_SCALE = 0
comptime F_MLA_CKV_SCALE = 1
"""What a ckv element stands for per unit stored (fp8 caches; 1 otherwise)."""
comptime F_MLA_KPE_SCALE = 2
comptime INT_MLA_CAUSAL = 0
comptime INT_MLA_KV_SPLIT = 1
"""Whether work items split requests' keys (decode) or queries (prefill)."""
comptime INT_MLA_MAX_QUERIES = 2
"""Query tokens in a work item at most."""


struct MLAPages[kv_dtype: DType](DevicePassable, TrivialRegisterPassable):
    var ckv: Ptr[Self.kv_dtype]
    var kpe: Ptr[Self.kv_dtype]
    var indices: IndexPtr
    var indptr: IndexPtr
    var page_size: Int
    var ckv_dim: Int
    var kpe_dim: Int
    var ckv_stride: Int
    """Elements from one token's ckv row to the next (ckv_dim or more)."""
    var kpe_stride: Int
    """Elements from one token's kpe row to the next (kpe_dim or more)."""

    comptime device_type: AnyType = Self

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "MLAPages"

    def __init__(
        out self,
        ckv: Ptr[Self.kv_dtype],
        kpe: Ptr[Self.kv_dtype],
        indices: IndexPtr,
        indptr: IndexPtr,
        page_size: Int,
        ckv_dim: Int,
        kpe_dim: Int,
        ckv_stride: Int,
        kpe_stride: Int,
    ):
        """The pools from their first elements: ckv points at token row 0's
        first latent element, kpe at its first rope element."""
        self.ckv = ckv
        self.kpe = kpe
        self.indices = indices
        self.indptr = indptr
        self.page_size = page_size
        self.ckv_dim = ckv_dim
        self.kpe_dim = kpe_dim
        self.ckv_stride = ckv_stride
        self.kpe_stride = kpe_stride

    @always_inline
    def token_slot(self, b: Int, tok: Int) -> Int:
        """Where token tok of request b lies in the pools, in token rows
        (page id x page_size + slot)."""
        var page = Int(
            self.indices[
                unsafe_offset=Int(self.indptr[unsafe_offset=b])
                + tok // self.page_size
            ]
        )
        return page * self.page_size + tok % self.page_size


struct MLAScales(DevicePassable, TrivialRegisterPassable):
    """The factors the kernels apply: q_nope and q_pe rows are multiplied by
    theirs before the dot products, so scores come out in base 2; the
    normalised output by v_scale."""

    var nope_log2: Float32
    """The product sm_scale * ckv_scale * log2(e)."""
    var pe_log2: Float32
    """The product sm_scale * kpe_scale * log2(e)."""
    var v_scale: Float32
    """The ckv scale again: V is the ckv cache."""
    var causal: Bool

    comptime device_type: AnyType = Self

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "MLAScales"

    def __init__(
        out self,
        sm_scale: Float32,
        ckv_scale: Float32,
        kpe_scale: Float32,
        causal: Bool,
    ):
        self.nope_log2 = sm_scale * ckv_scale * LOG2E
        self.pe_log2 = sm_scale * kpe_scale * LOG2E
        self.v_scale = ckv_scale
        self.causal = causal
