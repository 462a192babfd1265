"""FlashInfer 0.7's workspace methods, shared by the paged wrappers.

A wrapper's float workspace holds the float32 partial outputs of split-K
work items (``AttentionPlan.float_workspace_bytes``); pagedkv keeps its
integer work lists itself, so no integer workspace is needed.
"""

from __future__ import annotations

from .._checks import check_array, check_writable
from .._ops.tensors import Array


def check_prewarm(variant: str, planned: bool) -> None:
    """FlashInfer's ``prewarm_paged_kv_stride_variant``: it loads a kernel for
    K and V of different strides before graph capture; pagedkv's kernels
    read either as they are, so this only checks the call (a plan first,
    the one variant FlashInfer has)."""
    if variant != "independent":
        raise ValueError(f"variant must be 'independent', got {variant!r}")
    if not planned:
        raise RuntimeError("plan() must complete before prewarming a paged-KV-stride variant")


class WorkspaceMethods:
    """`reset_workspace_buffer`, `workspace_size`, `resolved_backend` and
    `prewarm_paged_kv_stride_variant` for
    a wrapper that keeps its scratch in ``self._workspace``, its backend in
    ``self._backend``, its last plan in ``self._plan`` and makes a plain
    wrapper of its own settings with ``self._plain()``."""

    _workspace: Array | None
    _backend: str

    def reset_workspace_buffer(
        self, float_workspace_buffer: Array, int_workspace_buffer: Array | None = None
    ) -> None:
        """Plans from now on keep their split scratch at the front of
        `float_workspace_buffer` when it is large enough (`workspace_size`
        says how large); `int_workspace_buffer` is accepted for FlashInfer's
        signature and unused. The current plan keeps its scratch.

        Examples
        --------
        >>> w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()  # doctest: +SKIP
        >>> ws = np.empty(1 << 20, np.uint8)  # doctest: +SKIP
        >>> w.reset_workspace_buffer(ws, np.empty(8, np.uint8))  # doctest: +SKIP
        """
        check_array("float_workspace_buffer", float_workspace_buffer)
        check_writable("float_workspace_buffer", float_workspace_buffer)
        if int_workspace_buffer is not None:
            check_array("int_workspace_buffer", int_workspace_buffer)
        self._workspace = float_workspace_buffer

    def workspace_size(self, *args, **kwargs) -> tuple[int, int]:
        """(float, int) workspace bytes that ``plan(*args, **kwargs)`` uses:
        the float32 partial outputs of its split-K items, and 0. Plans a
        plain wrapper of the same settings: this one is unchanged.

        Examples
        --------
        >>> w.workspace_size(indptr, indices, last_page_len, 8, 2, 64, 16)  # doctest: +SKIP
        (65536, 0)
        """
        probe = self._plain()
        probe.plan(*args, **kwargs)
        plan = probe._plan if probe._plan is not None else probe._multi._plan
        return plan.float_workspace_bytes, 0

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """Checks the call, as FlashInfer 0.7's (`check_prewarm`); loads nothing.

        Examples
        --------
        >>> w.prewarm_paged_kv_stride_variant()  # after plan()  # doctest: +SKIP
        """
        planned = getattr(self, "_plan", None) is not None or getattr(self, "_multi", None)
        check_prewarm(variant, bool(planned))

    @property
    def resolved_backend(self) -> str:
        """What the last plan runs: "cpu" for a page table in host memory;
        on a GPU the backend as given ("auto" picks its kernel per GPU and
        batch when it runs). Before any plan: the backend as given."""
        plan = getattr(self, "_plan", None)
        if plan is None and getattr(self, "_multi", None) is not None:
            plan = self._multi._plan
        if plan is not None and not plan.device.is_gpu:
            return "cpu"
        return self._backend
