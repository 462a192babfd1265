"""The CPU task's scratch memory (see task.mojo)."""

from std.memory.alloc import unsafe_alloc

from ...cache.paged_kv_cache import IndexPtr, Ptr
from ...simd.widen import F32, W
from .key_chunks import CHUNK, RowOffsets


struct TaskState(Movable):
    """Per-task scratch: the q vector, accumulator, softmax state, position,
    ALiBi slope and custom mask row of each query row (a query token's head), the scores of
    one chunk, row offset tables. On the heap: 64 rows of dim 256 would not fit
    a worker thread's stack."""

    var q: Ptr[F32]
    var acc: Ptr[F32]
    var m: Ptr[F32]
    var l: Ptr[F32]
    var alibi_log2: Ptr[F32]
    var row_pos: Ptr[F32]
    var mask_bit: IndexPtr
    """Each row's bit offset of key 0 in the custom mask (set only with one)."""
    var scores: Ptr[F32]
    var inv_freq: Ptr[DType.float64]
    var krot: Ptr[F32]
    """Rotated keys (ROPE_LLAMA), then, for a task of products (see
    products.mojo), V widened."""
    var kt: Ptr[F32]
    """K^T of a chunk, for a task of products."""
    var row_scales: Ptr[F32]
    """One head's K or V row scales over a chunk (int8 pools)."""
    var q_codes: Ptr[DType.int16]
    """The q rows as int16 codes, for products of codes (code_products.mojo)."""
    var q_code_scale: Ptr[F32]
    var p_codes: Ptr[F32]
    """A chunk's probabilities as int16 codes, two to a float32 slot."""
    var p_code_scale: Ptr[F32]
    var rows: RowOffsets
    """Offsets of this chunk's rows, then of the next chunk's, then the
    rotated keys' rows (j * head_dim)."""
    var _storage: Ptr[F32]

    def __init__(out self, rows: Int, head_dim: Int):
        var D = head_dim
        var at = 0

        @always_inline
        def take(mut at: Int, count: Int) -> Int:
            var start = at
            at += (count + W - 1) // W * W
            return start

        var q_at = take(at, rows * D)
        var acc_at = take(at, rows * D)
        var m_at = take(at, rows)
        var l_at = take(at, rows)
        var alibi_at = take(at, rows)
        var pos_at = take(at, rows)
        var mask_at = take(at, rows)  # int32s
        var scores_at = take(at, rows * CHUNK)
        var freq_at = take(at, D)  # D // 2 float64s
        var krot_at = take(at, CHUNK * D)
        var kt_at = take(at, CHUNK * D)
        var row_scales_at = take(at, CHUNK)
        var q_codes_at = take(at, (rows * D + 1) // 2)  # int16 codes
        var q_code_scale_at = take(at, rows)
        var p_codes_at = take(at, rows * CHUNK // 2)  # int16 codes
        var p_code_scale_at = take(at, rows)
        var rows_at = take(at, 2 * 3 * CHUNK)  # int64 rows: two floats each
        self._storage = rebind[Ptr[F32]](
            unsafe_alloc[Float32](at, alignment=64)
        )
        self.q = self._storage.unsafe_offset(q_at)
        self.acc = self._storage.unsafe_offset(acc_at)
        self.m = self._storage.unsafe_offset(m_at)
        self.l = self._storage.unsafe_offset(l_at)
        self.alibi_log2 = self._storage.unsafe_offset(alibi_at)
        self.row_pos = self._storage.unsafe_offset(pos_at)
        self.mask_bit = rebind[IndexPtr](self._storage.unsafe_offset(mask_at))
        self.scores = self._storage.unsafe_offset(scores_at)
        self.inv_freq = rebind[Ptr[DType.float64]](
            self._storage.unsafe_offset(freq_at)
        )
        self.krot = self._storage.unsafe_offset(krot_at)
        self.kt = self._storage.unsafe_offset(kt_at)
        self.row_scales = self._storage.unsafe_offset(row_scales_at)
        self.q_codes = rebind[Ptr[DType.int16]](
            self._storage.unsafe_offset(q_codes_at)
        )
        self.q_code_scale = self._storage.unsafe_offset(q_code_scale_at)
        self.p_codes = self._storage.unsafe_offset(p_codes_at)
        self.p_code_scale = self._storage.unsafe_offset(p_code_scale_at)
        self.rows = rebind[RowOffsets](self._storage.unsafe_offset(rows_at))

    def __deinit__(deinit self):
        self._storage.unsafe_free()
