"""What FlashInfer 0.7's MLA wrapper takes beside its kernels: plan metadata
(`MLAPlanMetadata`), the run contract a plan declares, and the structural
query and cache inputs of ``run(query=, kv_cache=)``.

A structural input is one packed tensor whose last dim joins the two parts
(``[..., ckv_dim + kpe_dim]``: FlashInfer's packed cache, DeepSeek's
``q_nope || q_pe``) or a split pair of tensors. The MLA op reads each cache
pool as rows of one stride, ckv the first ckv_dim elements of a row and kpe
the last kpe_dim (mojo_ops/mla/mla_pages.mojo), so a packed cache, the
adjacent halves of one, or two separate caches are all read where they lie:
`cache_operands` finds for each pool the contiguous rows it lies in, a view,
never a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checks import check_int, host_int_array
from ._ops.tensors import Array, check_array, is_contiguous, is_torch
from ._plan.block_tables import csr_from_block_tables

LSE_MODES = ("none", "base2", "basee")
LAYOUTS = ("packed", "split")
SCALE_MODES = ("default", "kv-per-tensor", "bmm-scalar", "bmm-tensor")
OUTPUT_SCALES = ("none", "per-tensor")


@dataclass(frozen=True)
class MLAPlanMetadata:
    """A batch's page table for `BatchMLAPagedAttentionWrapper.plan(metadata=)`.

    FlashInfer 0.7's ``flashinfer.mla.MLAPlanMetadata``: the CSR form
    (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_len_arr``), the dense
    form (``cum_seq_lens_q``, ``block_tables [B, max_pages]``, ``seq_lens``,
    optional ``max_q_len``), or both (`dual`, checked to describe the same
    requests and pages). Build one with `csr`, `dense` or `dual`.

    Examples
    --------
    >>> import numpy as np, pagedkv
    >>> m = pagedkv.MLAPlanMetadata.dense(
    ...     np.array([0, 1, 2]), np.array([[4, 2], [7, 0]]), np.array([20, 3]))
    >>> [a.tolist() for a in m.csr_table(16)]
    [[0, 1, 2], [0, 2, 3], [4, 2, 7], [20, 3]]
    """

    qo_indptr: Any = None
    kv_indptr: Any = None
    kv_indices: Any = None
    kv_len_arr: Any = None
    cum_seq_lens_q: Any = None
    block_tables: Any = None
    seq_lens: Any = None
    max_q_len: int | None = None

    @classmethod
    def csr(cls, qo_indptr: Array, kv_indptr: Array, kv_indices: Array, kv_len_arr: Array):
        """The CSR form: request b's queries are rows qo_indptr[b]:qo_indptr[b + 1],
        its pages kv_indices[kv_indptr[b]:kv_indptr[b + 1]], kv_len_arr[b] tokens."""
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   kv_len_arr=kv_len_arr)  # fmt: skip

    @classmethod
    def dense(
        cls,
        cum_seq_lens_q: Array,
        block_tables: Array,
        seq_lens: Array,
        max_q_len: int | None = None,
    ):
        """The dense form: request b's pages are block_tables[b, :ceil(seq_lens[b] /
        page_size)]; max_q_len, given, bounds every request's query count."""
        return cls(cum_seq_lens_q=cum_seq_lens_q, block_tables=block_tables,
                   seq_lens=seq_lens, max_q_len=max_q_len)  # fmt: skip

    @classmethod
    def dual(
        cls,
        qo_indptr: Array,
        kv_indptr: Array,
        kv_indices: Array,
        kv_len_arr: Array,
        *,
        cum_seq_lens_q: Array,
        block_tables: Array,
        seq_lens: Array,
        max_q_len: int | None = None,
    ):
        """Both forms of one batch (plan checks that they agree)."""
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr, cum_seq_lens_q,
                   block_tables, seq_lens, max_q_len)  # fmt: skip

    @staticmethod
    def of_plan(metadata: Any, flat: MLAPlanMetadata) -> MLAPlanMetadata:
        """The page table a plan() was given: metadata=, or its flat
        arguments (gathered in flat); TypeError or ValueError when it was
        given both, neither, or the flat CSR and dense forms mixed."""
        if metadata is not None:
            if not isinstance(metadata, MLAPlanMetadata):
                raise TypeError(
                    f"metadata must be an MLAPlanMetadata, got {type(metadata).__name__}"
                )
            if flat.has_csr() or flat.has_dense():
                raise ValueError("give metadata= or the flat metadata arguments, not both")
            return metadata
        if flat.has_csr() and flat.has_dense():
            raise ValueError("the flat CSR and dense metadata forms cannot be mixed")
        if not (flat.has_csr() or flat.has_dense()):
            raise TypeError("plan() needs metadata= or the flat metadata arguments")
        return flat

    def has_csr(self) -> bool:
        return any(
            x is not None
            for x in (self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_len_arr)
        )

    def has_dense(self) -> bool:
        dense = (self.cum_seq_lens_q, self.block_tables, self.seq_lens, self.max_q_len)
        return any(x is not None for x in dense)

    def csr_table(self, page_size: int) -> tuple[Any, Any, Any, Any]:
        """(qo_indptr, kv_indptr, kv_indices, kv_len_arr) of the batch: the CSR
        form as given, or the dense form converted on the host
        (`csr_from_block_tables`); with both, ValueError unless they agree.
        The CSR arrays are checked further by the wrapper's plan()."""
        csr = (self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_len_arr)
        if self.has_csr() and any(x is None for x in csr):
            raise ValueError("the CSR metadata needs qo_indptr, kv_indptr, kv_indices, kv_len_arr")
        if not self.has_dense():
            if not self.has_csr():
                raise ValueError("MLAPlanMetadata holds no page table")
            return csr
        dense = self._dense_as_csr(page_size)
        if self.has_csr():
            _check_forms_agree(csr, dense, page_size)
        return csr if self.has_csr() else dense

    def _dense_as_csr(self, page_size: int) -> tuple[np.ndarray, ...]:
        if self.cum_seq_lens_q is None or self.block_tables is None or self.seq_lens is None:
            raise ValueError("the dense metadata needs cum_seq_lens_q, block_tables and seq_lens")
        qo = host_int_array("cum_seq_lens_q", self.cum_seq_lens_q, 1)
        lens = host_int_array("seq_lens", self.seq_lens, 1)
        if len(qo) != len(lens) + 1:
            raise ValueError(
                f"cum_seq_lens_q must have {len(lens) + 1} entries (seq_lens has {len(lens)}),"
                f" got {len(qo)}"
            )
        if self.max_q_len is not None:
            most = check_int("max_q_len", self.max_q_len, 1)
            if len(qo) > 1 and np.diff(qo).max() > most:
                raise ValueError(f"a request has more queries than max_q_len = {most}")
        table = csr_from_block_tables(self.block_tables, lens, page_size)
        return qo.astype(np.int32), table.indptr, table.indices, lens.astype(np.int32)


def _check_forms_agree(csr: tuple, dense: tuple, page_size: int) -> None:
    """Raises unless the CSR and dense forms name the same queries, lengths
    and pages (the pages each request's tokens use; trailing ones are not read)."""
    qo, kv_ptr, indices, lens = (host_int_array(n, x, 1) for n, x in zip(
        ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"), csr, strict=True))  # fmt: skip
    d_qo, d_ptr, d_indices, d_lens = dense
    if not (np.array_equal(qo, d_qo) and np.array_equal(lens, d_lens)):
        raise ValueError("the CSR and dense metadata differ in query counts or lengths")
    need = -(-lens // page_size)
    if len(kv_ptr) < len(lens) + 1 or (np.diff(kv_ptr[: len(lens) + 1]) < need).any():
        raise ValueError("kv_indptr gives a request fewer pages than its kv_len_arr needs")
    for b, n in enumerate(need):
        given = indices[kv_ptr[b] : kv_ptr[b] + n]
        if not np.array_equal(given, d_indices[d_ptr[b] : d_ptr[b + 1]]):
            raise ValueError(f"the CSR and dense metadata name other pages for request {b}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


@dataclass(frozen=True)
class MLARunContract:
    """What a plan() declares of its run() calls (FlashInfer 0.7's
    ``MLAInputContract``), checked at each run: the LSE mode (None for a
    legacy flat plan, whose run decides), the accepted query and cache
    layouts, the scale mode and whether sinks come."""

    lse_mode: str | None
    query_layout: str
    kv_cache_layout: str
    scale_mode: str
    use_sinks: bool

    @staticmethod
    def planned(
        *,
        flat: bool,
        flat_csr: bool,
        lse_mode: str,
        query_layout: str | None,
        kv_cache_layout: str | None,
        output_matches_q: bool,
        output_scale: str,
        scale_mode: str,
        fp8_cache: bool,
        skip_softmax: bool,
        enable_pdl: bool | None,
        use_sinks: bool,
    ) -> MLARunContract:
        """The contract of plan()'s options, raising ValueError for one the
        kernels have no form of (as FlashInfer's fa2 backend refuses them at
        plan time): another output dtype than q's, an output scale, BMM
        scales, skip-softmax, programmatic dependent launch.

        flat: the page table came in the flat arguments, whose layouts are
        "split" by default (FlashInfer's older run form); flat_csr: in the
        flat CSR form, whose runs with lse_mode "none" choose their LSE.
        """
        lse_mode = _choice("lse_mode", lse_mode, LSE_MODES)
        default_layout = "split" if flat else "packed"
        query_layout = _choice("query_layout", query_layout or default_layout, LAYOUTS)
        kv_cache_layout = _choice("kv_cache_layout", kv_cache_layout or default_layout, LAYOUTS)
        _choice("output_scale", output_scale, OUTPUT_SCALES)
        scale_mode = _choice("scale_mode", scale_mode, SCALE_MODES)
        if fp8_cache and scale_mode == "default":
            scale_mode = "kv-per-tensor"  # fp8 callers give ckv_scale and kpe_scale at run
        refused = {
            "output_dtype other than q_data_type": not output_matches_q,
            "output_scale='per-tensor'": output_scale != "none",
            f"scale_mode={scale_mode!r}": scale_mode.startswith("bmm"),
            "skip_softmax=True": bool(skip_softmax),
            "enable_pdl=True": enable_pdl is True,
        }
        given = [name for name, on in refused.items() if on]
        if given:
            raise ValueError(f"{', '.join(given)}: not supported by pagedkv's MLA kernel")
        if scale_mode == "kv-per-tensor" and not fp8_cache:
            raise ValueError("scale_mode='kv-per-tensor' needs an fp8 kv_data_type")
        return MLARunContract(
            None if flat_csr and lse_mode == "none" else lse_mode,
            query_layout,
            kv_cache_layout,
            scale_mode,
            bool(use_sinks),
        )

    def lse_wanted(self, return_lse: bool, lse: Any, return_lse_base_on_e: bool) -> str:
        """The run's LSE mode, raising ValueError unless the plan declared it."""
        actual = "none"
        if return_lse or lse is not None or return_lse_base_on_e:
            actual = "basee" if return_lse_base_on_e else "base2"
        if self.lse_mode is not None and actual != self.lse_mode:
            raise ValueError(
                f"run() asks for LSE mode {actual!r} but the plan declared lse_mode="
                f"{self.lse_mode!r}; re-plan with the needed lse_mode"
            )
        return actual

    def check_sinks(self, sinks: Any) -> None:
        if (sinks is not None) != self.use_sinks:
            raise ValueError(
                f"run() {'gives' if sinks is not None else 'lacks'} sinks but the plan declared"
                f" use_sinks={self.use_sinks}"
            )


def structural_input(name: str, value: Any, left: Any, right: Any, left_names: str) -> Any:
    """run()'s query= (or kv_cache=) value, or the legacy pair (left, right)
    as a split value; TypeError when both forms or neither are given."""
    if value is None:
        if (left is None) != (right is None):
            raise ValueError(f"{left_names} must both be given")
        if left is None:
            raise TypeError(f"run() needs {name}= or {left_names}")
        return (left, right)
    if left is not None or right is not None:
        raise TypeError(f"give either {name}= or {left_names}, not both")
    return value


def _parse(name: str, value: Any) -> tuple[Any, tuple[Any, Any] | None]:
    """(packed, split) of a structural value: a tensor, a 2-tuple of tensors,
    or FlashInfer's redundant form, a packed tensor beside a split pair."""
    if not isinstance(value, tuple):
        check_array(name, value)
        return value, None
    if len(value) != 2:
        raise ValueError(f"{name} as a tuple must hold two entries, got {len(value)}")
    left, right = value
    if isinstance(left, tuple) and isinstance(right, tuple):
        raise ValueError(f"{name} has malformed nesting")
    if isinstance(left, tuple) or isinstance(right, tuple):
        packed, split = (right, left) if isinstance(left, tuple) else (left, right)
        return _parse(name, packed)[0], _parse(name, split)[1]
    check_array(name, left)
    check_array(name, right)
    return None, (left, right)


def _halves(name: str, packed: Array, widths: tuple[int, int]) -> tuple[Array, Array]:
    if len(packed.shape) != 3 or packed.shape[-1] != sum(widths):
        raise ValueError(
            f"packed {name} must be 3-D with a last dim of {widths[0]} + {widths[1]},"
            f" got {list(packed.shape)}"
        )
    return packed[..., : widths[0]], packed[..., widths[0] :]


def split_parts(
    name: str, value: Any, widths: tuple[int, int], accepted: str
) -> tuple[Array, Array]:
    """The two parts of a structural value as views, (nope, pe) or (ckv,
    kpe). A plan that accepts "packed" refuses split parts that are not the
    adjacent halves of one tensor's rows (FlashInfer's rule: its packed
    kernels would need a copy)."""
    packed, split = _parse(name, value)
    if packed is not None:
        return _halves(name, packed, widths)
    left, right = split
    if accepted == "packed" and widths[1] and not _adjacent(left, right):
        raise ValueError(
            f"{name} is split into separate tensors but the plan declared the packed"
            f" layout; re-plan with {'query' if name == 'query' else 'kv_cache'}_layout='split'"
        )
    return left, right


def _element_strides(x: Array) -> tuple[int, ...]:
    if is_torch(x):
        return tuple(x.stride())
    return tuple(s // x.itemsize for s in x.strides)


def _address(x: Array) -> int:
    return x.data_ptr() if is_torch(x) else x.__array_interface__["data"][0]


def _adjacent(left: Array, right: Array) -> bool:
    """Whether right's rows continue left's: the halves of one tensor's rows."""
    same_rows = cache_row_view(left, False)
    return (
        same_rows is not None
        and tuple(left.shape[:-1]) == tuple(right.shape[:-1])
        and same_rows.shape[-1] == left.shape[-1] + right.shape[-1]
        and _address(right) == _address(left) + left.shape[-1] * _item_size(left)
        and _element_strides(right)[:-1] == _element_strides(left)[:-1]
    )


def _item_size(x: Array) -> int:
    return x.element_size() if is_torch(x) else x.itemsize


def cache_row_view(x: Array, at_end: bool) -> Array | None:
    """The contiguous [pages, page_size, stride] view whose rows hold x's
    rows [pages, page_size, width] as their first (or, at_end, last) width
    elements; x itself when contiguous. None when x is not rows of one
    stride, or the view would reach outside x's memory."""
    if is_contiguous(x):
        return x
    if len(x.shape) != 3:
        return None
    pages, page_size, width = (int(d) for d in x.shape)
    page_stride, row, lane = _element_strides(x)
    if page_size == 1:
        row = page_stride if pages > 1 else width
    if (width > 1 and lane != 1) or row < width or (pages > 1 and page_stride != page_size * row):
        return None
    shape, strides = (pages, page_size, row), (page_size * row, row, 1)
    back = row - width if at_end else 0
    if is_torch(x):
        start = x.storage_offset() - back
        if (
            start < 0
            or start + pages * page_size * row > x.untyped_storage().nbytes() // _item_size(x)
        ):
            return None
        return x.as_strided(shape, strides, start)
    root = x
    while isinstance(root.base, np.ndarray):
        root = root.base
    offset = _address(x) - _address(root) - back * x.itemsize
    if (
        not root.flags.c_contiguous
        or offset < 0
        or offset + x.itemsize * pages * page_size * row > root.nbytes
    ):
        return None
    return np.ndarray(shape, x.dtype, buffer=root, offset=offset,
                      strides=tuple(s * x.itemsize for s in strides))  # fmt: skip


def cache_operands(ckv: Array, kpe: Array) -> tuple[Array, Array]:
    """The MLA op's ckv_cache and kpe_cache operands for the pools ckv and
    kpe (views): each pool's rows of one stride, ckv first in its rows and
    kpe last (one array for both when the pools are one packed cache).
    ValueError for a pool that is not rows of one stride."""
    ckv_rows, kpe_rows = cache_row_view(ckv, False), cache_row_view(kpe, True)
    for name, rows in (("ckv_cache", ckv_rows), ("kpe_cache", kpe_rows)):
        if rows is None:
            raise ValueError(
                f"{name} must be contiguous, or rows of one stride holding it (a packed"
                " cache's halves): the kernel reads it in place"
            )
    if _address(ckv_rows) == _address(kpe_rows) and tuple(ckv_rows.shape) == tuple(kpe_rows.shape):
        kpe_rows = ckv_rows
    return ckv_rows, kpe_rows
