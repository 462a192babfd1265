"""Whole-page copies inside a pool: copy-on-write for forked requests.

The pool is seen as bytes, [num_pages, page_bytes] (a one-tensor pool's page
holds its K and V, so one copy moves both; a (K, V) pair is copied pool by
pool), so one compiled op serves every dtype and layout. Page src[i] is
copied onto page dst[i]. The indices are checked on the host first: all in
the pool, no page written twice, no page both read and written.
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext

from ..cache.paged_kv_cache import IndexPtr, Ptr
from ..cache.tensor_access import (
    GPU_VECTOR_BYTES,
    VECTOR_BYTES,
    HostIndices,
    host_ready,
    ptr_of,
)
from ..cache.token_rows import copy_run_aligned
from ..work_queue import parallel_row_blocks

comptime TASK_BYTES = 1 << 20
"""Bytes one CPU task copies, whole pages (at least one)."""


def check_page_id(name: StaticString, i: Int, page: Int, num_pages: Int) raises:
    if page < 0 or page >= num_pages:
        raise Error(
            "pagedkv: ",
            name,
            "[",
            i,
            "] = ",
            page,
            " is outside the pool of ",
            num_pages,
            " pages",
        )


def check_page_copies(
    src_host: HostIndices, dst_host: HostIndices, count: Int, num_pages: Int
) raises:
    """Raises unless every page id is in the pool, no destination repeats and
    no page is both a source and a destination (host copies). A source may
    repeat: one parent page copied to several children."""
    var src = src_host.ptr
    var dst = dst_host.ptr
    comptime READ: Int8 = 1
    comptime WRITTEN: Int8 = 2
    var seen = List[Int8](length=num_pages, fill=0)
    for i in range(count):
        var s = Int(src[unsafe_offset=i])
        var d = Int(dst[unsafe_offset=i])
        check_page_id("src_pages", i, s, num_pages)
        check_page_id("dst_pages", i, d, num_pages)
        if seen[d] == WRITTEN:
            raise Error("pagedkv: page ", d, " is a destination twice")
        if seen[d] == READ or s == d:
            raise Error("pagedkv: page ", d, " is both copied from and onto")
        if seen[s] == WRITTEN:
            raise Error("pagedkv: page ", s, " is both copied onto and from")
        seen[s] = READ
        seen[d] = WRITTEN


@extensibility.register("pagedkv_copy_pages")
struct CopyPages:
    """Copies pool[src[i], :] to pool[dst[i], :] for pool [num_pages,
    page_bytes] (uint8)."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        pool: MutableInputTensor[dtype=DType.uint8, rank=2, ...],
        src_pages: InputTensor[dtype=DType.int32, rank=1, ...],
        dst_pages: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var count = src_pages.dim_size(0)
        if dst_pages.dim_size(0) != count:
            raise Error("pagedkv: src_pages and dst_pages differ in length")
        var num_pages = pool.dim_size(0)
        var page_bytes = pool.dim_size(1)
        var host_src = HostIndices.enqueue[target](src_pages, ctx)
        var host_dst = HostIndices.enqueue[target](dst_pages, ctx)
        host_ready[target](ctx)
        check_page_copies(host_src, host_dst, count, num_pages)
        if count == 0:
            return
        var base = ptr_of(pool)
        var src = ptr_of(src_pages)
        var dst = ptr_of(dst_pages)
        comptime if target == "cpu":

            def pages(
                first: Int, end: Int
            ) {var base, var src, var dst, var page_bytes}:
                for i in range(first, end):
                    copy_run_aligned[DType.uint8, VECTOR_BYTES](
                        base.unsafe_offset(
                            Int(dst[unsafe_offset=i]) * page_bytes
                        ),
                        base.unsafe_offset(
                            Int(src[unsafe_offset=i]) * page_bytes
                        ),
                        page_bytes,
                        0,
                        1,
                    )

            # Tasks of about TASK_BYTES: a page of a small page size is a
            # few KiB, less than a runtime task costs to dispatch.
            parallel_row_blocks(pages, count, TASK_BYTES // max(page_bytes, 1))
        else:

            def kernel(
                base: Ptr[DType.uint8],
                src: IndexPtr,
                dst: IndexPtr,
                page_bytes: Int64,
            ):
                var i = Int(block_idx.x)
                var n = Int(page_bytes)
                copy_run_aligned[DType.uint8, GPU_VECTOR_BYTES](
                    base.unsafe_offset(Int(dst[unsafe_offset=i]) * n),
                    base.unsafe_offset(Int(src[unsafe_offset=i]) * n),
                    n,
                    Int(thread_idx.x),
                    Int(block_dim.x),
                )

            ctx.enqueue_function[kernel](
                base,
                src,
                dst,
                Int64(page_bytes),
                grid_dim=count,
                block_dim=256,
            )
