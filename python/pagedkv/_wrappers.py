"""What FlashInfer's paged decode and prefill wrappers (pagedkv.decode,
pagedkv.prefill) do alike: the constructor's checks and settings, run()'s
first steps, re-planning for the deprecated forward(), and FlashInfer's
deprecated names. The wrappers built on them (ragged prefill, POD, cascade)
reach these through the wrappers they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from max.dtype import DType

from ._checks import APPROXIMATIONS, layout_code, refuse_gpu_only
from ._ops.tensors import Array, check_array, dtype_of
from ._plan.io_dtypes import check_out_dtype, widened_query
from ._plan.plan import AttentionPlan
from ._plan.workspace import WorkspaceMethods
from .fixed_buffers import FixedIndexBuffers


def fixed_index_buffers(
    use_cuda_graph: bool, buffers: dict[str, Array | None], exact: tuple[str, ...], what: str
) -> FixedIndexBuffers | None:
    """The constructor's fixed index buffers (pagedkv.fixed_buffers) with
    use_cuda_graph=True: `buffers` by FlashInfer's argument names, those in
    `exact` sized to the batch. None without use_cuda_graph, where giving
    any raises ValueError (`what` names them in the message)."""
    if use_cuda_graph:
        return FixedIndexBuffers(buffers, exact=exact)
    if any(b is not None for b in buffers.values()):
        raise ValueError(f"the {what} arguments go with use_cuda_graph=True")
    return None


def refuse_jit_variants(
    jit_args: object = None, jit_kwargs: object = None, variant_owns_mask: bool = False
) -> None:
    """Raises ValueError for FlashInfer's JIT variant arguments: pagedkv
    compiles no variants (the ragged wrapper reads the attention-sink
    variant's jit_args itself)."""
    if variant_owns_mask:
        raise ValueError("variant_owns_mask belongs to FlashInfer's JIT variants; pagedkv has none")
    if jit_args is not None or jit_kwargs is not None:
        raise ValueError("jit_args drives FlashInfer's JIT; pagedkv has no JIT variants")


class PagedWrapper(WorkspaceMethods):
    """The state and methods the paged decode and prefill wrappers share.

    `_planned` holds the last plan()'s arguments by plan()'s parameter names,
    so that a re-plan is ``self.plan(**{**self._planned, ...})``; `_plan` is
    the AttentionPlan run() launches (None before a plan, and for a decode
    plan of several queries a request, which a prefill wrapper runs);
    `_o_dtype` the output dtype plan() asked for (None: the query's).
    """

    def __init__(
        self,
        float_workspace_buffer: Array | None,
        kv_layout: str,
        backend: str,
        fixed: FixedIndexBuffers | None,
    ) -> None:
        self._fixed = fixed
        self._layout = layout_code(kv_layout)
        self._kv_layout = kv_layout
        self._backend = backend
        self._workspace = float_workspace_buffer
        self._plan: AttentionPlan | None = None
        self._planned: dict | None = None
        self._o_dtype: DType | None = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        """Whether plan() writes into the caller's fixed buffers (use_cuda_graph)."""
        return self._fixed is not None

    def _run_query(self, q: Array, out: Array | None, gpu_only: dict[str, Any]) -> tuple:
        """run()'s first steps: checks that q and `out` (if given) are arrays,
        refuses the GPU-only options among gpu_only
        (run()'s by name; under backend "trtllm-gen" the approximations its
        FlashInfer kernel takes are taken, and computed exactly), checks `out`
        against the output dtype (the planned one, else q's) and widens an
        fp8 q for the kernel. Returns (the kernel's q, the output dtype)."""
        check_array("q", q)
        if out is not None:
            check_array("out", out)
        approximations = APPROXIMATIONS if self._backend == "trtllm-gen" else ()
        refuse_gpu_only("run()", gpu_only, approximations)
        o_dtype = self._o_dtype or dtype_of(q)
        check_out_dtype(out, o_dtype)
        return widened_query(q), o_dtype

    def _replan_with(self, **options: object) -> None:
        """FlashInfer's deprecated forward(): the options it is called with
        (plan()'s names) replace the planned ones, and plan() runs again
        when any differs."""
        if self._planned is None:
            raise RuntimeError("forward() called before begin_forward()")
        if any(self._planned[k] != v for k, v in options.items()):
            self.plan(**{**self._planned, **options})

    def end_forward(self) -> None:
        """FlashInfer's deprecated no-op."""

    def run_return_lse(
        self, q: Array, paged_kv_cache: Array | Sequence[Array], *args: object, **kwargs: object
    ) -> tuple[Array, Array]:
        """run(..., return_lse=True): FlashInfer's deprecated name."""
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def forward_return_lse(self, *args: object, **kwargs: object) -> tuple[Array, Array]:
        """forward(..., return_lse=True): FlashInfer's deprecated name."""
        return self.forward(*args, return_lse=True, **kwargs)
