"""NVFP4 attention outputs: FlashInfer's ``out_dtype="nvfp4"`` (or an
``FP4Tensor`` as ``out``) with ``o_sf_scale``, on the block-table calls.

The attention runs into a float32 output, which is then quantized row by row
(a row: one query token, its heads' values flattened) in blocks of 16 with
FlashInfer's two-level scaling: ``o_sf_scale`` is the global *encode* scale
(a block's e4m3 scale is ``amax * o_sf_scale / 6``), so the values decode as
``e2m1 * e4m3 / o_sf_scale`` (pagedkv.nvfp4's quantization with the global
decode scale ``1 / o_sf_scale``). The block scales go to rows
``scale_start_index ..`` of the output's swizzled scale tensor; its other
rows are left as they are, so two calls may share one tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._checks import check_float
from .._ops.tensors import Array, is_torch
from ..nvfp4 import BLOCK, FP4Tensor, quantize, swizzled_scale_offsets


def wants_nvfp4(out: Any, out_dtype: Any) -> bool:
    """Whether the caller asks for an NVFP4 output, as FlashInfer reads it."""
    return out_dtype == "nvfp4" or (out_dtype is None and isinstance(out, FP4Tensor))


def check_nvfp4_request(
    function: str, query: Array, out: Any, o_sf_scale: Any, o_sf_vec_size: Any
) -> None:
    """Raises ValueError unless an NVFP4 output of a query [T, Hq, D] (a torch
    tensor: NumPy has no float8) can be written as asked: o_sf_scale positive
    and finite, o_sf_vec_size None or 16, D % 16 == 0, and `out` (None, or
    an FP4Tensor) of FlashInfer's shapes and dtypes. Called before the
    attention runs."""
    if not is_torch(query) or len(query.shape) != 3:
        raise ValueError(f"{function}: an NVFP4 output needs a torch query [T, Hq, D]")
    if o_sf_vec_size not in (None, BLOCK):
        raise ValueError(f"{function}: only o_sf_vec_size = {BLOCK} is supported")
    if o_sf_scale is None:
        raise ValueError(f"{function}: an NVFP4 output needs o_sf_scale")
    check_float("o_sf_scale", o_sf_scale, positive=True)
    tokens, heads, head_dim = query.shape
    if head_dim % BLOCK:
        raise ValueError(f"{function}: an NVFP4 output needs head_dim % {BLOCK} == 0")
    if out is None:
        return
    if not isinstance(out, FP4Tensor):
        raise ValueError(f"{function}: out must be an FP4Tensor for an NVFP4 output")
    if tuple(out.data.shape) != (tokens, heads, head_dim // 2) or "uint8" not in str(
        out.data.dtype
    ):
        raise ValueError(
            f"{function}: out.data must be uint8 {[tokens, heads, head_dim // 2]}, "
            f"got {out.data.dtype} {list(out.data.shape)}"
        )
    rows, cols = out.scale.shape
    if (
        "float8_e4m3fn" not in str(out.scale.dtype)
        or rows % 128
        or cols != _scale_cols(heads * head_dim)
    ):
        raise ValueError(
            f"{function}: out.scale must be float8_e4m3fn [R, {_scale_cols(heads * head_dim)}]"
            f" with R a multiple of 128, got {out.scale.dtype} {list(out.scale.shape)}"
        )
    start = out.scale_start_index
    if not 0 <= start <= rows - tokens:
        raise ValueError(
            f"{function}: scale_start_index {start} leaves no room for {tokens} rows in "
            f"out.scale's {rows}"
        )


def nvfp4_output(o: Array, o_sf_scale: float, out: FP4Tensor | None) -> FP4Tensor:
    """o [T, Hq, D] (float32, a torch tensor) quantized to NVFP4, into `out`
    when given (checked by check_nvfp4_request), else into new arrays with
    round_up(T, 128) scale rows, starting at row 0."""
    import torch

    tokens, heads, head_dim = o.shape
    if out is None:
        out = FP4Tensor(
            torch.empty((tokens, heads, head_dim // 2), dtype=torch.uint8, device=o.device),
            torch.zeros(
                (-(-tokens // 128) * 128, _scale_cols(heads * head_dim)),
                dtype=torch.float8_e4m3fn,
                device=o.device,
            ),
            0,
            tuple(o.shape),
        )
    values = o.detach().float().cpu().numpy().reshape(tokens, heads * head_dim)
    packed, scale_bytes = quantize(values, 1.0 / float(o_sf_scale))
    out.data.copy_(torch.from_numpy(packed).reshape(out.data.shape))
    rows = out.scale_start_index + np.arange(tokens)[:, None]
    cols = np.arange(scale_bytes.shape[1])[None, :]
    offsets = swizzled_scale_offsets(out.scale.shape[1], rows, cols)
    flat = out.scale.view(torch.uint8).view(-1)
    flat[torch.from_numpy(offsets.reshape(-1)).to(flat.device)] = torch.from_numpy(
        scale_bytes.reshape(-1)
    ).to(flat.device)
    return out


def _scale_cols(row_values: int) -> int:
    """Scale columns of a row of row_values values: its blocks, rounded up to 4."""
    return -(-(row_values // BLOCK) // 4) * 4
