"""Page-table checks and FlashInfer's index helpers.

Every op that writes into a pool checks its indices first, on the host, and
raises before it writes anything: a bad page table must never scribble over
another request's pages. The checks read only the small index arrays.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.algorithm import sync_parallelize
from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext

from ..cache.paged_kv_cache import IndexPtr
from ..cache.tensor_access import HostIndices, host_ready, ptr_of


@always_inline
def seq_len_of(
    kv_indptr: IndexPtr, kv_last_page_len: IndexPtr, b: Int, page_size: Int
) -> Int:
    """FlashInfer's sequence length: full pages plus the last page's tokens."""
    var pages = Int(kv_indptr[unsafe_offset=b + 1]) - Int(
        kv_indptr[unsafe_offset=b]
    )
    return max(pages - 1, 0) * page_size + Int(
        kv_last_page_len[unsafe_offset=b]
    )


comptime INT32_MAX = 2**31 - 1
"""The longest request a page table may describe: lengths are int32."""


def check_requests(
    kv_indptr: IndexPtr,
    kv_last_page_len: IndexPtr,
    batch_size: Int,
    page_size: Int,
) raises:
    """Raises unless kv_indptr and kv_last_page_len describe requests as a
    page table must, whatever its page ids.

    Host pointers. Checks: kv_indptr starts at 0 and never decreases, each
    request's kv_last_page_len is in [1, page_size] (0 for a request with no
    pages), and each request's length (`seq_len_of`) fits int32.
    """
    if Int(kv_indptr[unsafe_offset=0]) != 0:
        raise Error(
            "pagedkv: kv_indptr[0] = ",
            kv_indptr[unsafe_offset=0],
            " must be 0",
        )
    for b in range(batch_size):
        var lo = Int(kv_indptr[unsafe_offset=b])
        var hi = Int(kv_indptr[unsafe_offset=b + 1])
        if hi < lo:
            raise Error(
                "pagedkv: kv_indptr must not decrease: kv_indptr[",
                b + 1,
                "] = ",
                hi,
                " < kv_indptr[",
                b,
                "] = ",
                lo,
            )
        var last = Int(kv_last_page_len[unsafe_offset=b])
        if hi == lo and last != 0:
            raise Error(
                "pagedkv: request ",
                b,
                " owns no pages but kv_last_page_len[",
                b,
                "] = ",
                last,
                " (must be 0)",
            )
        if hi > lo and (last < 1 or last > page_size):
            raise Error(
                "pagedkv: kv_last_page_len[",
                b,
                "] = ",
                last,
                " is outside [1, page_size = ",
                page_size,
                "]",
            )
        var length = seq_len_of(kv_indptr, kv_last_page_len, b, page_size)
        if length > INT32_MAX:
            raise Error(
                "pagedkv: request ",
                b,
                " holds ",
                length,
                " tokens, more than an int32 length holds",
            )


def check_page_table(
    kv_indptr: IndexPtr,
    kv_indices: IndexPtr,
    num_indices: Int,
    kv_last_page_len: IndexPtr,
    batch_size: Int,
    page_size: Int,
    num_pages: Int,
) raises:
    """Raises unless the CSR page table addresses only pages of the pool.

    Host pointers. Checks `check_requests`, then that kv_indptr ends within
    kv_indices and that every page id is in [0, num_pages).
    """
    check_requests(kv_indptr, kv_last_page_len, batch_size, page_size)
    var used = Int(kv_indptr[unsafe_offset=batch_size])
    if used > num_indices:
        raise Error(
            "pagedkv: kv_indptr[-1] = ",
            used,
            " but kv_indices holds only ",
            num_indices,
            " pages",
        )
    for i in range(used):
        var page = Int(kv_indices[unsafe_offset=i])
        if page < 0 or page >= num_pages:
            raise Error(
                "pagedkv: kv_indices[",
                i,
                "] = ",
                page,
                " is outside the pool of ",
                num_pages,
                " pages",
            )


def check_append_targets(
    batch_indices: HostIndices,
    positions: HostIndices,
    nnz: Int,
    table: HostPageTable,
    page_size: Int,
) raises:
    """Raises unless every appended token lands inside its request's pages.

    Host copies; the page table must already have passed `check`.
    """
    var batch_size = table.batch_size
    for i in range(nnz):
        var b = batch_indices[i]
        if b < 0 or b >= batch_size:
            raise Error(
                "pagedkv: batch_indices[",
                i,
                "] = ",
                b,
                " is outside the batch of ",
                batch_size,
                " requests",
            )
        var pos = positions[i]
        var length = table.seq_len(b, page_size)
        if pos < 0 or pos >= length:
            raise Error(
                "pagedkv: positions[",
                i,
                "] = ",
                pos,
                " is outside request ",
                b,
                ", whose pages hold ",
                length,
                " tokens",
            )


struct HostPageTable(Movable):
    """An op's CSR page table (kv_indptr, kv_indices, kv_last_page_len),
    readable on the host: views on the CPU, copies for a GPU op enqueued
    beside the op's other index arrays (see `HostIndices`)."""

    var indptr: HostIndices
    var indices: HostIndices
    var last: HostIndices
    var batch_size: Int
    var num_indices: Int

    def __init__(
        out self,
        var indptr: HostIndices,
        var indices: HostIndices,
        var last: HostIndices,
        batch_size: Int,
        num_indices: Int,
    ):
        self.indptr = indptr^
        self.indices = indices^
        self.last = last^
        self.batch_size = batch_size
        self.num_indices = num_indices

    @staticmethod
    def enqueue[
        target: StaticString
    ](
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises -> Self:
        """Checks the arrays' lengths agree, then starts their host copies:
        read them (`check`) after `host_ready`."""
        var batch_size = kv_last_page_len.dim_size(0)
        if kv_indptr.dim_size(0) != batch_size + 1:
            raise Error(
                "pagedkv: kv_indptr has ",
                kv_indptr.dim_size(0),
                " entries; a batch of ",
                batch_size,
                " needs ",
                batch_size + 1,
            )
        return Self(
            HostIndices.enqueue[target](kv_indptr, ctx),
            HostIndices.enqueue[target](kv_indices, ctx),
            HostIndices.enqueue[target](kv_last_page_len, ctx),
            batch_size,
            kv_indices.dim_size(0),
        )

    def seq_len(self, b: Int, page_size: Int) -> Int:
        """`seq_len_of` request b on the host copies."""
        return seq_len_of(self.indptr.ptr, self.last.ptr, b, page_size)

    def check(self, page_size: Int, num_pages: Int) raises:
        """`check_page_table` on the host copies."""
        check_page_table(
            self.indptr.ptr,
            self.indices.ptr,
            self.num_indices,
            self.last.ptr,
            self.batch_size,
            page_size,
            num_pages,
        )


@extensibility.register("pagedkv_get_seq_lens")
struct GetSeqLens:
    """Seq_lens[b] = max(pages(b) - 1, 0) * page_size + kv_last_page_len[b].

    limits (host): [page_size, check]. With check != 0 the op first raises,
    writing nothing, unless the arrays pass `check_requests` (for a GPU op,
    on host copies: one synchronization); a caller whose next op checks the
    whole page table passes 0.
    """

    @staticmethod
    def execute[
        target: StaticString
    ](
        seq_lens: MutableInputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        limits: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        # limits is a host tensor for both targets (as MAX's own ops take
        # their max lengths): no copy, no recompile per page size.
        var p = Int(limits[0])
        var batch_size = seq_lens.dim_size(0)
        if (
            kv_last_page_len.dim_size(0) != batch_size
            or kv_indptr.dim_size(0) != batch_size + 1
        ):
            raise Error(
                "pagedkv: get_seq_lens takes kv_indptr [B + 1] and"
                " kv_last_page_len [B] for seq_lens [B]"
            )
        if Int(limits[1]) != 0:
            var host_indptr = HostIndices.enqueue[target](kv_indptr, ctx)
            var host_last = HostIndices.enqueue[target](kv_last_page_len, ctx)
            host_ready[target](ctx)
            check_requests(host_indptr.ptr, host_last.ptr, batch_size, p)
            # The copies live until here, past the check's reads of their
            # bare pointers (HostIndices.ptr).
            _ = host_indptr^
            _ = host_last^
        var out_ptr = ptr_of(seq_lens)
        var indptr = ptr_of(kv_indptr)
        var last = ptr_of(kv_last_page_len)
        comptime if target == "cpu":
            for b in range(batch_size):
                out_ptr[unsafe_offset=b] = Int32(seq_len_of(indptr, last, b, p))
        else:

            def kernel(
                out_ptr: IndexPtr,
                indptr: IndexPtr,
                last: IndexPtr,
                batch_size: Int64,
                p: Int64,
            ):
                var b = Int(block_idx.x * block_dim.x + thread_idx.x)
                if b < Int(batch_size):
                    out_ptr[unsafe_offset=b] = Int32(
                        seq_len_of(indptr, last, b, Int(p))
                    )

            comptime block = 256
            ctx.enqueue_function[kernel](
                out_ptr,
                indptr,
                last,
                Int64(batch_size),
                Int64(p),
                grid_dim=max((batch_size + block - 1) // block, 1),
                block_dim=block,
            )


@extensibility.register("pagedkv_get_batch_indices_positions")
struct GetBatchIndicesPositions:
    """For each appended token j of request b (append_indptr[b] <= j < append_indptr[b+1]):
    batch_indices[j] = b and positions[j] = seq_lens[b] - append_len(b) + (j - append_indptr[b]).
    Entries from append_indptr[-1] to nnz (padding, as in FlashInfer) get
    batch index -1 and position 0.
    """

    @staticmethod
    def execute[
        target: StaticString
    ](
        batch_indices: MutableInputTensor[dtype=DType.int32, rank=1, ...],
        positions: MutableInputTensor[dtype=DType.int32, rank=1, ...],
        append_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        seq_lens: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var nnz = batch_indices.dim_size(0)
        var batch_size = seq_lens.dim_size(0)
        var indptr_host = HostIndices.enqueue[target](append_indptr, ctx)
        var seq_host = HostIndices.enqueue[target](seq_lens, ctx)
        host_ready[target](ctx)
        check_append_indptr(indptr_host, seq_host, batch_size, nnz)
        var total = indptr_host[batch_size]

        var bi = ptr_of(batch_indices)
        var pos = ptr_of(positions)
        var indptr = ptr_of(append_indptr)
        var lens = ptr_of(seq_lens)
        comptime if target == "cpu":

            def one_request(b: Int) {var bi, var pos, var indptr, var lens}:
                fill_request(bi, pos, indptr, lens, b, 0, 1)

            sync_parallelize(one_request, batch_size)
            fill_padding(bi, pos, total, nnz, 0, 1)
        else:

            def kernel(
                bi: IndexPtr,
                pos: IndexPtr,
                indptr: IndexPtr,
                lens: IndexPtr,
                batch_size: Int32,
                total: Int32,
                nnz: Int32,
            ):
                # Blocks 0 .. B - 1 take a request each; block B the padding.
                var b = Int(block_idx.x)
                if b < Int(batch_size):
                    fill_request(
                        bi,
                        pos,
                        indptr,
                        lens,
                        b,
                        Int(thread_idx.x),
                        Int(block_dim.x),
                    )
                else:
                    fill_padding(
                        bi,
                        pos,
                        Int(total),
                        Int(nnz),
                        Int(thread_idx.x),
                        Int(block_dim.x),
                    )

            if nnz > 0:
                ctx.enqueue_function[kernel](
                    bi,
                    pos,
                    indptr,
                    lens,
                    Int32(batch_size),
                    Int32(total),
                    Int32(nnz),
                    grid_dim=batch_size + 1,
                    block_dim=128,
                )


@always_inline
def fill_request(
    batch_indices: IndexPtr,
    positions: IndexPtr,
    append_indptr: IndexPtr,
    seq_lens: IndexPtr,
    b: Int,
    first: Int,
    step: Int,
):
    """Writes the batch index and position of request b's appended tokens
    first, first + step, ... (a strided share, so GPU threads split a request).
    """
    var lo = Int(append_indptr[unsafe_offset=b])
    var hi = Int(append_indptr[unsafe_offset=b + 1])
    var start = Int(seq_lens[unsafe_offset=b]) - (hi - lo)
    var j = lo + first
    while j < hi:
        batch_indices[unsafe_offset=j] = Int32(b)
        positions[unsafe_offset=j] = Int32(start + j - lo)
        j += step


@always_inline
def fill_padding(
    batch_indices: IndexPtr,
    positions: IndexPtr,
    total: Int,
    nnz: Int,
    first: Int,
    step: Int,
):
    """Marks entries total + first, total + first + step, ... below nnz as
    padding: batch index -1, position 0 (FlashInfer's CUDA-graph padding)."""
    var j = total + first
    while j < nnz:
        batch_indices[unsafe_offset=j] = -1
        positions[unsafe_offset=j] = 0
        j += step


def check_append_indptr(
    append_indptr_host: HostIndices,
    seq_lens_host: HostIndices,
    batch_size: Int,
    nnz: Int,
) raises:
    """Raises unless append_indptr is a CSR offset array of at most nnz
    tokens that fits inside seq_lens (host copies)."""
    var append_indptr = append_indptr_host.ptr
    var seq_lens = seq_lens_host.ptr
    if Int(append_indptr[unsafe_offset=0]) != 0:
        raise Error("pagedkv: append_indptr[0] must be 0")
    for b in range(batch_size):
        var n = Int(append_indptr[unsafe_offset=b + 1]) - Int(
            append_indptr[unsafe_offset=b]
        )
        if n < 0:
            raise Error(
                "pagedkv: append_indptr must not decrease (at ", b + 1, ")"
            )
        if n > Int(seq_lens[unsafe_offset=b]):
            raise Error(
                "pagedkv: request ",
                b,
                " appends ",
                n,
                " tokens but seq_lens[",
                b,
                "] = ",
                seq_lens[unsafe_offset=b],
            )
    var total = Int(append_indptr[unsafe_offset=batch_size])
    if total > nnz:
        raise Error(
            "pagedkv: append_indptr[-1] = ", total, " exceeds nnz = ", nnz
        )


@extensibility.register("pagedkv_check_page_table")
struct CheckPageTable:
    """Raises unless a CSR page table is sound, else summarises it.

    limits (host): [page_size, num_pages]. summary (host, written):
    [largest page id used (-1 if none), tokens cached in the batch].
    """

    @staticmethod
    def execute[
        target: StaticString
    ](
        summary: MutableInputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        limits: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var page_size = Int(limits[0])
        var table = HostPageTable.enqueue[target](
            kv_indptr, kv_indices, kv_last_page_len, ctx
        )
        host_ready[target](ctx)
        table.check(page_size, Int(limits[1]))
        var batch_size = table.batch_size
        var top = -1
        for i in range(table.indptr[batch_size]):
            top = max(top, table.indices[i])
        var tokens = 0
        for b in range(batch_size):
            tokens += table.seq_len(b, page_size)
        summary[0] = Int32(top)
        summary[1] = Int32(tokens)
