"""FlashInfer's POD-Attention wrappers (prefill-on-decode): a chunked-prefill
step's prefill and decode attention in one `run()`.

FlashInfer fuses the two into one kernel launch so that they share a GPU's
SMs. pagedkv runs them one after the other with the kernels of its other
wrappers (`single_prefill_with_kv_cache` or the paged prefill wrapper, and
a paged wrapper for the decode side), so the outputs are those of the two
calls made apart; the signatures, defaults and return forms are
FlashInfer 0.7's.
"""

from __future__ import annotations

from ._ops.tensors import Array
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper, single_prefill_with_kv_cache

__all__ = ["BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper"]


def _refuse(**given: object) -> None:
    for name, value in given.items():
        if value not in (None, False):
            raise ValueError(f"{name} is not supported by FlashInfer's POD run(); leave it unset")


class PODWithPagedKVCacheWrapper:
    """One request's prefill over contiguous K/V beside a batch decode over
        pages (FlashInfer's ``PODWithPagedKVCacheWrapper``).

        `plan()` is the decode wrapper's (FlashInfer 0.7's arguments; the data
    types default to those run() is given, where FlashInfer's default to
    float16); `run()`
        takes the prefill's query, keys and values with their own options
        (``*_p``) and the decode queries and pages, and returns ``(out_p,
        out_d)``: ``[qo_len, num_qo_heads, head_dim]`` and ``[batch_size,
        num_qo_heads, head_dim]``. As in FlashInfer, the decode side runs with
        the plan's options and no LSE is returned.

        Examples
        --------
        >>> pod = pagedkv.PODWithPagedKVCacheWrapper(None, "NHD")  # doctest: +SKIP
        >>> pod.plan(kv_indptr, kv_indices, last_page_len, 8, 2, 64, 16)  # doctest: +SKIP
        >>> o_p, o_d = pod.run(q_p, k_p, v_p, q_d, pool, causal_p=True)  # doctest: +SKIP
    """

    def __init__(
        self,
        float_workspace_buffer: Array | None = None,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        paged_kv_indptr_buffer: Array | None = None,
        paged_kv_indices_buffer: Array | None = None,
        paged_kv_last_page_len_buffer: Array | None = None,
        jit_args: object = None,
    ) -> None:
        self._decode = BatchDecodeWithPagedKVCacheWrapper(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            paged_kv_indptr_buffer=paged_kv_indptr_buffer,
            paged_kv_indices_buffer=paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer,
            jit_args=jit_args,
        )

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._decode.is_cuda_graph_enabled

    def plan(
        self,
        indptr: Array,
        indices: Array,
        last_page_len: Array,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        q_data_type: object = None,
        kv_data_type: object = None,
        data_type: object = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
    ) -> None:
        """The decode side's plan: the batch decode wrapper's arguments."""
        self._decode.plan(
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            data_type=data_type,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            non_blocking=non_blocking,
        )

    def run(
        self,
        q_p: Array,
        k_p: Array,
        v_p: Array,
        q_d: Array,
        paged_kv_cache_d: Array | tuple[Array, Array],
        custom_mask_p: Array | None = None,
        packed_custom_mask_p: Array | None = None,
        causal_p: bool = False,
        kv_layout_p: str = "NHD",
        pos_encoding_mode_p: str = "NONE",
        sm_scale_p: float | None = None,
        window_left_p: int = -1,
        rope_scale_p: float | None = None,
        rope_theta_p: float | None = None,
        return_lse_p: bool = False,
        custom_mask_d: Array | None = None,
        packed_custom_mask_d: Array | None = None,
        causal_d: bool = False,
        kv_layout_d: str = "NHD",
        pos_encoding_mode_d: str = "NONE",
        sm_scale_d: float | None = None,
        window_left_d: int = -1,
        rope_scale_d: float | None = None,
        rope_theta_d: float | None = None,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        return_lse_d: bool = False,
        use_fp16_qk_reduction: bool = False,
        enable_pdl: bool | None = None,
    ) -> tuple[Array, Array]:
        """(prefill output, decode output); see the class docstring. The
        decode side's ``*_d`` options are the plan's in FlashInfer and
        ignored here too; a custom mask or causal mask for it is refused."""
        if self._decode._plan is None and self._decode._multi is None:
            raise RuntimeError("run() called before plan()")
        _refuse(custom_mask_d=custom_mask_d, packed_custom_mask_d=packed_custom_mask_d)
        _refuse(causal_d=causal_d)
        out_p = single_prefill_with_kv_cache(
            q_p,
            k_p,
            v_p,
            custom_mask=custom_mask_p,
            packed_custom_mask=packed_custom_mask_p,
            causal=causal_p,
            kv_layout=kv_layout_p,
            pos_encoding_mode=pos_encoding_mode_p,
            use_fp16_qk_reduction=use_fp16_qk_reduction,
            sm_scale=sm_scale_p,
            window_left=window_left_p,
            rope_scale=rope_scale_p,
            rope_theta=rope_theta_p,
        )
        out_d = self._decode.run(
            q_d, paged_kv_cache_d, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale
        )
        return out_p, out_d


class BatchPODWithPagedKVCacheWrapper:
    """Batched prefill beside batched decode, both over pages (FlashInfer's
    ``BatchPODWithPagedKVCacheWrapper``).

    `plan()` takes both sides' page tables (``*_p``, ``*_d``) and the shared
    options; `run(q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, ...)`
    returns ``(out_p, out_d)``, or with ``return_lse`` ``((out_p, out_d),
    (lse_p, lse_d))`` as FlashInfer 0.7's code returns them. The prefill side
    is causal when ``causal_p`` says so (or masked by ``custom_mask_p``);
    the decode side's queries (``qo_indptr_d``: one or more per request)
    see every key of their request.

    Examples
    --------
    >>> pod = pagedkv.BatchPODWithPagedKVCacheWrapper(None, "NHD")  # doctest: +SKIP
    >>> pod.plan(qo_p, kv_indptr_p, kv_indices_p, last_p,  # doctest: +SKIP
    ...          qo_d, kv_indptr_d, kv_indices_d, last_d, 8, 2, 64, 16)
    >>> o_p, o_d = pod.run(q_p, pool, q_d, pool, causal_p=True)  # doctest: +SKIP
    """

    def __init__(self, float_workspace_buffer: Array | None = None, kv_layout: str = "NHD"):
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._decode = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._prefill: dict[bool, BatchPrefillWithPagedKVCacheWrapper] = {}
        self._planned: tuple[tuple, dict] | None = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(
        self,
        qo_indptr_p: Array,
        kv_indptr_p: Array,
        kv_indices_p: Array,
        last_page_len_p: Array,
        qo_indptr_d: Array,
        kv_indptr_d: Array,
        kv_indices_d: Array,
        last_page_len_d: Array,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        q_data_type: object = None,
        kv_data_type: object = None,
        data_type: object = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
    ) -> None:
        """Plans the decode side now and the prefill side's causal form (the
        mask run() chooses) on its first run."""
        shared = dict(
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            q_data_type=data_type or q_data_type,
            kv_data_type=kv_data_type,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        heads = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self._decode.plan(qo_indptr_d, kv_indptr_d, kv_indices_d, last_page_len_d, *heads, **shared)
        table = (qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p)
        self._planned = ((*table, *heads), shared)
        self._prefill = {}

    def _prefill_side(
        self, causal: bool, custom_mask: Array | None, packed_custom_mask: Array | None
    ) -> BatchPrefillWithPagedKVCacheWrapper:
        if self._planned is None:
            raise RuntimeError("run() before plan()")
        args, shared = self._planned
        masked = custom_mask is not None or packed_custom_mask is not None
        if masked or causal not in self._prefill:
            wrapper = BatchPrefillWithPagedKVCacheWrapper(self._workspace, self._kv_layout)
            wrapper.plan(
                *args,
                custom_mask=custom_mask,
                packed_custom_mask=packed_custom_mask,
                causal=causal,
                **shared,
            )
            if masked:
                return wrapper
            self._prefill[causal] = wrapper
        return self._prefill[causal]

    def run(
        self,
        q_p: Array,
        paged_kv_cache_p: Array | tuple[Array, Array],
        q_d: Array,
        paged_kv_cache_d: Array | tuple[Array, Array],
        custom_mask_p: Array | None = None,
        packed_custom_mask_p: Array | None = None,
        causal_p: bool = False,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        return_lse: bool = False,
        use_fp16_qk_reduction: bool = False,
        enable_pdl: bool | None = None,
    ):
        """(out_p, out_d), or ((out_p, out_d), (lse_p, lse_d)) with return_lse."""
        prefill = self._prefill_side(bool(causal_p), custom_mask_p, packed_custom_mask_p)
        p = prefill.run(q_p, paged_kv_cache_p, return_lse=return_lse)
        d = self._decode.run(
            q_d,
            paged_kv_cache_d,
            k_scale=k_scale,
            v_scale=v_scale,
            return_lse=return_lse,
            q_scale=q_scale,
        )
        if return_lse:
            return (p[0], d[0]), (p[1], d[1])
        return p, d
