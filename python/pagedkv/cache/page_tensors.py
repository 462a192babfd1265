"""The K/V tensors behind the page ids: one pool per layer, and page copies.

:class:`PageTensors` is the layer of the page manager that touches memory:
it allocates every layer's pool (host pools on 2 MiB pages through
``pagedkv.runtime.huge_page_zeros``, torch tensors on a GPU) and copies
pages in all of them (``pagedkv.copy_pages`` on a GPU, NumPy's gathers on
the host). Which page ids are free, shared or cached is
:class:`pagedkv.cache.page_pool.PagePool`'s business.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.dtype import DType

from .._checks import check_int, layout_code
from .._ops.contract import pool_row_width
from .._ops.tensors import Array, new_like
from .._plan.work import as_dtype
from ..page import copy_pages
from ..runtime.huge_pages import huge_page_zeros

POOL_DTYPES = (DType.float32, DType.float16, DType.bfloat16, DType.float8_e4m3fn, DType.int8)
"""The element types a pool may have (float8 pools are torch tensors: NumPy
has no float8). An int8 pool's rows are head_dim codes and a float32 scale
(`pool_row_width`), written by the rope-append and decoder-layer ops, read
by the CPU attention kernel."""


class PageTensors:
    """The per-layer K/V pools that page ids index, all of one shape.

    Parameters
    ----------
    num_pages, page_size, num_kv_heads, head_dim, num_layers : int
        The pools' geometry (each >= 1).
    dtype : str or dtype
        "float32", "float16", "bfloat16", "float8_e4m3fn" (torch pools) or
        "int8" (CPU only), or a torch / NumPy / MAX dtype.
    kv_layout : str
        "NHD": pools are [num_pages, 2, page_size, num_kv_heads, head_dim];
        "HND": [num_pages, 2, num_kv_heads, page_size, head_dim] (FlashInfer's
        one-tensor form). An int8 pool's last axis is head_dim + 4: each
        page holds its rows' codes, then their float32 scales.
    device : str
        "cpu", or "cuda[:i]" / "gpu[:i]" for torch pools on that GPU.
    use_torch : bool
        Host pools as torch tensors rather than NumPy arrays (bfloat16 pools
        are torch tensors anyway: NumPy has no bfloat16).
    pin_memory : bool
        Host pools as torch tensors in page-locked memory: the host tier of
        GPU pools, which asynchronous copies read and write.

    Notes
    -----
    NOTE: page id p names ``pools[layer][p]`` in every layer, so one page
    table serves the whole model; only :meth:`copy_pages` and the kernels
    the caller runs write the pools, in place (the list and its tensors are
    never replaced).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype: object = "float32",
        kv_layout: str = "NHD",
        device: object = "cpu",
        use_torch: bool = False,
        pin_memory: bool = False,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_layers", num_layers),
        ):
            check_int(name, value, 1)  # page ids and sizes are int32 in the kernels
        pool_dtype = as_dtype(dtype, "dtype")
        if pool_dtype not in POOL_DTYPES:
            raise TypeError(
                "dtype must be float32, float16, bfloat16, float8_e4m3fn or int8, "
                f"got {pool_dtype.name}"
            )
        layout_code(kv_layout)
        kind, _, index = str(device).partition(":")
        if kind not in ("cpu", "cuda", "gpu") or (index and not index.isdigit()):
            raise ValueError(f"device must be 'cpu' or 'cuda[:index]', got {device!r}")
        torch_device = "cpu" if kind == "cpu" else f"cuda:{index or 0}"
        if pool_dtype == DType.int8 and torch_device != "cpu":
            raise ValueError("int8 pools are read on the CPU; use float16 or bfloat16 on a GPU")
        if torch_device != "cpu":
            import torch

            if int(index or 0) >= torch.cuda.device_count():
                raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} GPUs")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.num_layers = int(num_layers)
        self.dtype = pool_dtype
        self.kv_layout = kv_layout
        self.device = torch_device
        """"cpu" or "cuda:i": where the pools are."""
        row = pool_row_width(pool_dtype, self.head_dim)
        page = (
            (self.page_size, self.num_kv_heads, row)
            if kv_layout == "NHD"
            else (self.num_kv_heads, self.page_size, row)
        )
        shape = (self.num_pages, 2, *page)
        if pin_memory and torch_device != "cpu":
            raise ValueError("pin_memory is for host pools (device 'cpu')")
        torch_pools = (
            use_torch
            or pin_memory
            or pool_dtype in (DType.bfloat16, DType.float8_e4m3fn)
            or torch_device != "cpu"
        )
        try:
            self.pools: list[Array] = [
                _zeros(shape, pool_dtype, torch_device if torch_pools else None, pin_memory)
                for _ in range(self.num_layers)
            ]
            """One pool per layer, written in place by the kernels."""
        except (MemoryError, OSError) as e:  # NumPy's and mmap's refusals
            size = int(np.prod(shape)) * pool_dtype.size_in_bytes * self.num_layers
            raise MemoryError(
                f"KV pools of {size} bytes ({self.num_layers} layers of {shape} "
                f"{pool_dtype.name}) cannot be allocated on {torch_device}: {e}"
            ) from None

    @property
    def on_gpu(self) -> bool:
        """Whether the pools are on a GPU."""
        return self.device != "cpu"

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies page src[i] onto page dst[i] in every layer's pool (the
        copy-on-write of a shared page, a partial prefix hit), on the pools'
        device. The page ids are the manager's: in the pools, no destination
        repeated, none also a source."""
        if not self.on_gpu:
            # One gather a layer: a few KB a page, where launching the
            # pagedkv.copy_pages op costs some 100 us a layer.
            _copy_host_pages(self.pools, self.pools, src, dst)
            return
        # The page ids go where the pools are (a GPU's copy reads them there).
        src_ids = new_like(self.pools[0], np.array(src, np.int32))
        dst_ids = new_like(self.pools[0], np.array(dst, np.int32))
        for pool in self.pools:
            copy_pages(pool, src_ids, dst_ids, self.kv_layout)

    def copy_to(self, other: PageTensors, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies page src[i] of every layer's pool onto page dst[i] of the
        same layer in ``other`` (another tier of the same geometry).

        Host to host: one gather per layer. With a GPU on either side: one
        asynchronous copy per page and layer on torch's current stream, to or
        from pinned memory. The stream orders each copy after the kernels that
        wrote its source and before later kernels (MAX's launches are ordered
        against that stream), so no host synchronization is needed as long
        as the host reads host-tier pages only through such copies.

        Examples
        --------
        >>> hot, host = PageTensors(4, 2, 1, 4), PageTensors(2, 2, 1, 4)
        >>> hot.pools[0][3] = 1.0
        >>> hot.copy_to(host, [3], [1]); float(host.pools[0][1].sum())
        16.0
        """
        if not len(src):
            return
        if not self.on_gpu and not other.on_gpu:
            _copy_host_pages(self.pools, other.pools, src, dst)
            return
        for mine, theirs in zip(self.pools, other.pools, strict=True):
            for s, d in zip(src, dst, strict=True):
                theirs[int(d)].copy_(mine[int(s)], non_blocking=True)


def _copy_host_pages(
    sources: Sequence[Array], dests: Sequence[Array], src: Sequence[int], dst: Sequence[int]
) -> None:
    """dests[layer][dst[i]] = sources[layer][src[i]] for every layer, host
    pools (NumPy arrays or CPU torch tensors): one gather and scatter a
    layer, the gathered pages copied first."""
    src_ids, dst_ids = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    for source, dest in zip(sources, dests, strict=True):
        if isinstance(dest, np.ndarray) and isinstance(source, np.ndarray):
            dest[dst_ids] = source[src_ids]
        else:
            import torch

            dest, source = torch.as_tensor(dest), torch.as_tensor(source)  # shares memory
            dest[torch.from_numpy(dst_ids)] = source[torch.from_numpy(src_ids)]


def _zeros(
    shape: tuple[int, ...], dtype: DType, torch_device: str | None, pin_memory: bool = False
) -> Array:
    """A NumPy array, or a torch tensor on torch_device when one is named;
    on the host, on 2 MiB pages (see runtime/huge_pages.py), or page-locked
    with pin_memory."""
    if (torch_device is not None and torch_device != "cpu") or pin_memory:
        import torch

        return torch.zeros(
            shape, dtype=getattr(torch, dtype.name), device=torch_device, pin_memory=pin_memory
        )
    return huge_page_zeros(shape, dtype, use_torch=torch_device is not None)
