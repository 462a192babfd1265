"""Rotary position embeddings beside attention: FlashInfer's ``flashinfer.rope``.

q [nnz, Hq, D] and k [nnz, Hk, D] (torch tensors) have their first
`rotary_dim` dims rotated by each row's position: pairs (i, i + rotary_dim/2)
(NeoX, Llama; the default) or adjacent pairs (2i, 2i + 1) with
``interleave=True`` (GPT-J), at frequencies
``theta ** (-2i / rotary_dim) / rope_scale``; Llama 3.1's form rescales the
low frequencies (`llama31_frequencies`). Positions come as `pos_ids` [nnz],
or as ragged `indptr` [B + 1] and `offsets` [B] (row j of request b sits at
``offsets[b] + j - indptr[b]``). The angles and products are float32, the
results rounded once to the input's dtype; the ``_inplace`` forms write q and
k, the others return new tensors. Every entry point checks its operands and
raises before it writes.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "mla_rope_quantize_fp8",
    "rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
]
"""FlashInfer's ``flashinfer.rope`` names, which `pagedkv.flashinfer_compat.rope`
serves; `base_frequencies` and `llama31_frequencies` are pagedkv's own."""


def _torch():
    import torch

    return torch


def base_frequencies(rotary_dim: int, rope_scale: float, rope_theta: float) -> Any:
    """The rotary_dim / 2 frequencies, float32 (float64 math)."""
    torch = _torch()
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return (rope_theta ** (-2.0 * i / rotary_dim) / rope_scale).float()


def llama31_frequencies(
    rotary_dim: int,
    rope_scale: float,
    rope_theta: float,
    low_freq_factor: float,
    high_freq_factor: float,
    old_context_len: int,
) -> Any:
    """Llama 3.1's frequencies: wavelengths shorter than old_context_len /
    high_freq_factor keep theirs, longer than old_context_len /
    low_freq_factor are divided by rope_scale, and those between blend."""
    torch = _torch()
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    freq = rope_theta ** (-2.0 * i / rotary_dim)
    if high_freq_factor == low_freq_factor:
        raise ValueError("high_freq_factor must differ from low_freq_factor")
    smooth = (old_context_len * freq / (2 * math.pi) - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smooth = smooth.clamp(0.0, 1.0)
    return ((1 - smooth) * freq / rope_scale + smooth * freq).float()


def _check(q: Any, k: Any, rotary_dim: int | None) -> int:
    torch = _torch()
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError("q and k must be torch tensors")
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must be [nnz, heads, head_dim] with the same nnz and head_dim, got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    return rotary_dim


def _positions_of(indptr: Any, offsets: Any, nnz: int) -> Any:
    torch = _torch()
    indptr = torch.as_tensor(indptr, device="cpu").long()
    offsets = torch.as_tensor(offsets, device="cpu").long()
    if indptr.dim() != 1 or offsets.dim() != 1 or indptr.numel() != offsets.numel() + 1:
        raise ValueError("indptr must be [B + 1] and offsets [B]")
    if indptr[0] != 0 or int(indptr[-1]) != nnz or bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"indptr must rise from 0 to nnz = {nnz}")
    counts = indptr[1:] - indptr[:-1]
    rows = torch.arange(nnz)
    request = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return offsets[request] + rows - indptr[request]


def _check_pos_ids(pos_ids: Any, nnz: int) -> Any:
    torch = _torch()
    pos = torch.as_tensor(pos_ids, device="cpu").long()
    if pos.shape != (nnz,):
        raise ValueError(f"pos_ids must be [{nnz}], got {tuple(pos.shape)}")
    return pos


def _rotate(x: Any, cos: Any, sin: Any, rotary_dim: int, interleave: bool) -> Any:
    """x [nnz, H, D] with its first rotary_dim dims rotated (float32 math);
    cos, sin [nnz, rotary_dim / 2]."""
    torch = _torch()
    out = x.float().clone()
    r = out[..., :rotary_dim]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        a, b = r[..., 0::2].clone(), r[..., 1::2].clone()
        r[..., 0::2] = a * c - b * s
        r[..., 1::2] = b * c + a * s
    else:
        half = rotary_dim // 2
        a, b = r[..., :half].clone(), r[..., half:].clone()
        out[..., :rotary_dim] = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return out.to(x.dtype)


def _apply(q, k, pos, freqs, rotary_dim, interleave):
    angles = pos.to(q.device).float()[:, None] * freqs.to(q.device)[None, :]
    cos, sin = angles.cos(), angles.sin()
    return _rotate(q, cos, sin, rotary_dim, interleave), _rotate(
        k, cos, sin, rotary_dim, interleave
    )


def apply_rope_pos_ids(
    q: Any,
    k: Any,
    pos_ids: Any,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> tuple[Any, Any]:
    """(q, k) rotated at positions pos_ids [nnz] (see the module docstring).

    Examples
    --------
    >>> import torch, pagedkv.rope
    >>> q = k = torch.tensor([[[1.0, 0.0]]])
    >>> pagedkv.rope.apply_rope_pos_ids(q, k, torch.tensor([0]))[0]
    tensor([[[1., 0.]]])
    """
    rotary_dim = _check(q, k, rotary_dim)
    pos = _check_pos_ids(pos_ids, q.shape[0])
    freqs = base_frequencies(rotary_dim, rope_scale, rope_theta)
    return _apply(q, k, pos, freqs, rotary_dim, interleave)


def apply_rope(
    q: Any,
    k: Any,
    indptr: Any,
    offsets: Any,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> tuple[Any, Any]:
    """(q, k) rotated at ragged positions: row j of request b at
    ``offsets[b] + j - indptr[b]``.

    Examples
    --------
    >>> import torch, pagedkv.rope
    >>> q = k = torch.tensor([[[1.0, 0.0]]])
    >>> pagedkv.rope.apply_rope(q, k, torch.tensor([0, 1]), torch.tensor([0]))[1]
    tensor([[[1., 0.]]])
    """
    rotary_dim = _check(q, k, rotary_dim)
    pos = _positions_of(indptr, offsets, q.shape[0])
    freqs = base_frequencies(rotary_dim, rope_scale, rope_theta)
    return _apply(q, k, pos, freqs, rotary_dim, interleave)


def apply_llama31_rope(
    q: Any,
    k: Any,
    indptr: Any,
    offsets: Any,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> tuple[Any, Any]:
    """`apply_rope` at Llama 3.1's frequencies (`llama31_frequencies`).

    Examples
    --------
    >>> import torch, pagedkv.rope
    >>> q = k = torch.tensor([[[1.0, 0.0]]])
    >>> pagedkv.rope.apply_llama31_rope(q, k, torch.tensor([0, 1]), torch.tensor([0]))[0]
    tensor([[[1., 0.]]])
    """
    rotary_dim = _check(q, k, rotary_dim)
    pos = _positions_of(indptr, offsets, q.shape[0])
    freqs = llama31_frequencies(
        rotary_dim, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len
    )
    return _apply(q, k, pos, freqs, rotary_dim, interleave)


def apply_llama31_rope_pos_ids(
    q: Any,
    k: Any,
    pos_ids: Any,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> tuple[Any, Any]:
    """`apply_rope_pos_ids` at Llama 3.1's frequencies.

    Examples
    --------
    >>> import torch, pagedkv.rope
    >>> q = k = torch.tensor([[[1.0, 0.0]]])
    >>> pagedkv.rope.apply_llama31_rope_pos_ids(q, k, torch.tensor([0]))[0]
    tensor([[[1., 0.]]])
    """
    rotary_dim = _check(q, k, rotary_dim)
    pos = _check_pos_ids(pos_ids, q.shape[0])
    freqs = llama31_frequencies(
        rotary_dim, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len
    )
    return _apply(q, k, pos, freqs, rotary_dim, interleave)


def _cos_sin_inputs(positions, query, key, head_size, cos_sin_cache):
    torch = _torch()
    if not all(isinstance(t, torch.Tensor) for t in (query, key, cos_sin_cache)):
        raise TypeError("query, key and cos_sin_cache must be torch tensors")
    nnz = query.shape[0]
    if query.numel() % (nnz * head_size) or key.numel() % (max(nnz, 1) * head_size):
        raise ValueError(f"query and key rows must hold whole heads of {head_size}")
    q = query.reshape(nnz, -1, head_size)
    k = key.reshape(key.shape[0], -1, head_size)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2:
        raise ValueError("cos_sin_cache must be [max_position, rotary_dim] (cos half, sin half)")
    rotary_dim = cos_sin_cache.shape[1]
    _check(q, k, rotary_dim)
    pos = _check_pos_ids(positions, nnz)
    if bool((pos < 0).any()) or bool((pos >= cos_sin_cache.shape[0]).any()):
        raise ValueError(f"positions must be in [0, {cos_sin_cache.shape[0]})")
    rows = cos_sin_cache.float()[pos.to(cos_sin_cache.device)]
    half = rotary_dim // 2
    return q, k, rows[:, :half], rows[:, half:], rotary_dim


def apply_rope_with_cos_sin_cache(
    positions: Any,
    query: Any,
    key: Any,
    head_size: int,
    cos_sin_cache: Any,
    is_neox: bool = True,
) -> tuple[Any, Any]:
    """vLLM's form: query [nnz, Hq * head_size] and key [nnz, Hk *
    head_size] rotated by the rows of cos_sin_cache [max_position,
    rotary_dim] (cos in its first half, sin in its second) at `positions`;
    NeoX pairs by default, adjacent pairs with ``is_neox=False``.

    Examples
    --------
    >>> import torch, pagedkv.rope
    >>> cache = torch.tensor([[1.0, 0.0]])
    >>> pagedkv.rope.apply_rope_with_cos_sin_cache(
    ...     torch.tensor([0]), torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]]), 2, cache)[0]
    tensor([[1., 2.]])
    """
    q, k, cos, sin, rotary_dim = _cos_sin_inputs(positions, query, key, head_size, cos_sin_cache)
    q_out = _rotate(q, cos, sin, rotary_dim, not is_neox).reshape(query.shape)
    k_out = _rotate(k, cos, sin, rotary_dim, not is_neox).reshape(key.shape)
    return q_out, k_out


def _writing_in_place(rotate: Callable, first: str, second: str) -> Callable:
    """The ``_inplace`` form of `rotate`: its signature and checks, the two
    tensors it returns copied into its arguments `first` and `second`."""
    signature = inspect.signature(rotate)

    def in_place(*args: Any, **kwargs: Any) -> None:
        arguments = signature.bind(*args, **kwargs).arguments
        first_out, second_out = rotate(*args, **kwargs)
        arguments[first].copy_(first_out)
        arguments[second].copy_(second_out)

    in_place.__name__ = in_place.__qualname__ = f"{rotate.__name__}_inplace"
    in_place.__doc__ = f"`{rotate.__name__}` writing {first} and {second} in place (returns None)."
    in_place.__signature__ = signature.replace(return_annotation=None)
    return in_place


apply_rope_inplace = _writing_in_place(apply_rope, "q", "k")
apply_rope_pos_ids_inplace = _writing_in_place(apply_rope_pos_ids, "q", "k")
apply_llama31_rope_inplace = _writing_in_place(apply_llama31_rope, "q", "k")
apply_llama31_rope_pos_ids_inplace = _writing_in_place(apply_llama31_rope_pos_ids, "q", "k")
apply_rope_with_cos_sin_cache_inplace = _writing_in_place(
    apply_rope_with_cos_sin_cache, "query", "key"
)


def _fp8_dtype(quantize_dtype: Any, outs: tuple) -> Any:
    torch = _torch()
    if quantize_dtype is None:
        quantize_dtype = next((o.dtype for o in outs if o is not None), torch.float8_e4m3fn)
    if quantize_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"quantize_dtype must be float8_e4m3fn or float8_e5m2, got {quantize_dtype}"
        )
    return quantize_dtype


def _quantized(x: Any, scale: float, dtype: Any) -> Any:
    """x * scale saturated to dtype's range, a new tensor."""
    torch = _torch()
    finfo = torch.finfo(dtype)
    return torch.clamp(x.float() * scale, finfo.min, finfo.max).to(dtype)


def _into(values: list, outs: list, names: list, dtype: Any) -> tuple:
    """values written into the outs given (None: returned as they are),
    every out checked before the first is written."""
    for value, out, name in zip(values, outs, names, strict=True):
        if out is not None and (out.shape != value.shape or out.dtype != dtype):
            raise ValueError(f"{name} must be {dtype} of shape {tuple(value.shape)}")
    for value, out in zip(values, outs, strict=True):
        if out is not None:
            out.copy_(value)
    return tuple(v if o is None else o for v, o in zip(values, outs, strict=True))


def rope_quantize_fp8(
    q_rope: Any,
    k_rope: Any,
    q_nope: Any,
    k_nope: Any,
    cos_sin_cache: Any,
    pos_ids: Any,
    is_neox: bool = True,
    quantize_dtype: Any = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Any = None,
    k_rope_out: Any = None,
    q_nope_out: Any = None,
    k_nope_out: Any = None,
    enable_pdl: bool = False,
) -> tuple[Any, Any, Any, Any]:
    """RoPE on the rotary parts, then every part times its scale in float8:
    q_rope [nnz, Hq, rope_dim] and k_rope [nnz, Hk, rope_dim] (or MLA's
    [nnz, rope_dim]) rotated by cos_sin_cache [max_position, rope_dim]
    (float32: cos half, sin half) at pos_ids [nnz]; q_nope and k_nope (or
    None: empty) only quantized. Outputs are written where given (any
    strides), else allocated; returns (q_rope, k_rope, q_nope, k_nope).

    Examples
    --------
    >>> import torch, pagedkv.rope
    >>> q = torch.ones(1, 1, 2, dtype=torch.float16)
    >>> out = pagedkv.rope.rope_quantize_fp8(
    ...     q, q[:, 0], None, None, torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    >>> out[0].float()
    tensor([[[1., 1.]]])
    """
    torch = _torch()
    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    mla = k_rope.dim() == 2
    dtype = _fp8_dtype(quantize_dtype, (q_rope_out, k_rope_out, q_nope_out, k_nope_out))
    k3 = k_rope[:, None, :] if mla else k_rope
    heads = q_rope.shape[1]
    q_rot, k_rot = apply_rope_with_cos_sin_cache(
        pos_ids,
        q_rope.reshape(q_rope.shape[0], -1),
        k3.reshape(k3.shape[0], -1),
        q_rope.shape[-1],
        cos_sin_cache,
        is_neox,
    )
    q_rot = q_rot.reshape(q_rope.shape[0], heads, -1)
    k_rot = k_rot.reshape(k_rope.shape)
    if q_nope is None:
        q_nope = q_rope.new_empty(*q_rope.shape[:-1], 0)
    if k_nope is None:
        k_nope = k_rope.new_empty(*k_rope.shape[:-1], 0)
    return _into(
        [
            _quantized(q_rot, quant_scale_q, dtype),
            _quantized(k_rot, quant_scale_kv, dtype),
            _quantized(q_nope, quant_scale_q, dtype),
            _quantized(k_nope, quant_scale_kv, dtype),
        ],
        [q_rope_out, k_rope_out, q_nope_out, k_nope_out],
        ["q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"],
        dtype,
    )


def mla_rope_quantize_fp8(
    q_rope: Any,
    k_rope: Any,
    q_nope: Any,
    k_nope: Any,
    cos_sin_cache: Any,
    pos_ids: Any,
    is_neox: bool = True,
    quantize_dtype: Any = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Any = None,
    k_rope_out: Any = None,
    q_nope_out: Any = None,
    k_nope_out: Any = None,
    enable_pdl: bool = False,
) -> tuple[Any, Any, Any, Any]:
    """`rope_quantize_fp8` with MLA's 2-D k_rope [nnz, rope_dim] and
    k_nope [nnz, no_rope_dim].

    Examples
    --------
    >>> import torch, pagedkv.rope
    >>> q = torch.ones(1, 1, 2, dtype=torch.float16)
    >>> out = pagedkv.rope.mla_rope_quantize_fp8(
    ...     q, q[:, 0], q, q[:, 0], torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    >>> out[1].float()
    tensor([[1., 1.]])
    """
    if k_rope.dim() != 2:
        raise ValueError(
            f"mla_rope_quantize_fp8's k_rope is [nnz, rope_dim], got {tuple(k_rope.shape)}"
        )
    return rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype,
        quant_scale_q, quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out,
    )  # fmt: skip


def rope_quantize_fp8_append_paged_kv_cache(
    q_rope: Any,
    k_rope: Any,
    q_nope: Any,
    k_nope: Any,
    v: Any,
    cos_sin_cache: Any,
    pos_ids: Any,
    paged_kv_cache: tuple[Any, Any],
    kv_indices: Any,
    kv_indptr: Any,
    batch_indices: Any,
    positions: Any,
    is_neox: bool = True,
    quantize_dtype: Any = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    page_size: int = 16,
    kv_layout: str = "NHD",
    q_rope_out: Any = None,
    q_nope_out: Any = None,
    enable_pdl: bool = False,
) -> tuple[Any, Any]:
    """`rope_quantize_fp8`, then the float8 keys (and values) appended to a
    paged cache; returns the quantized (q_rope, q_nope).

    GQA/MHA: k_rope [nnz, Hk, rope_dim], k_nope [nnz, Hk, no_rope_dim] and
    v [nnz, Hk, rope_dim + no_rope_dim] go to paged_kv_cache = (k_cache,
    v_cache), each [pages, page_size, Hk, D] (NHD) or [pages, Hk, page_size,
    D] (HND), keys as rope then no-rope dims. MLA (k_rope [nnz, rope_dim],
    v None): paged_kv_cache = (ckv_cache [pages, page_size, no_rope_dim],
    kpe_cache [pages, page_size, rope_dim]). Row i goes to request
    batch_indices[i]'s page kv_indices[kv_indptr[b] + positions[i] //
    page_size], slot positions[i] % page_size; a row whose batch_indices is
    -1 (padding) is quantized but not appended. Every index is checked
    before anything is written.

    Examples
    --------
    >>> import torch, pagedkv.rope
    >>> q = torch.ones(1, 1, 2, dtype=torch.float16)
    >>> k_cache = torch.zeros(1, 16, 1, 2, dtype=torch.float8_e4m3fn)
    >>> v_cache = torch.zeros_like(k_cache)
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> _ = pagedkv.rope.rope_quantize_fp8_append_paged_kv_cache(
    ...     q, q, None, None, q, torch.tensor([[1.0, 0.0]]), i32(0), (k_cache, v_cache),
    ...     i32(0), i32(0, 1), i32(0), i32(0))
    >>> k_cache[0, 0].float()
    tensor([[1., 1.]])
    """
    torch = _torch()
    mla = k_rope.dim() == 2
    if mla and v is not None:
        raise ValueError("MLA (2-D k_rope) takes no v: its no-rope keys are the latent cache")
    if not mla and v is None:
        raise ValueError("GQA/MHA (3-D k_rope) needs v")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be NHD or HND, got {kv_layout!r}")
    first, second = paged_kv_cache
    dtype = _fp8_dtype(quantize_dtype, (first, q_rope_out, q_nope_out))
    if first.dtype != dtype or second.dtype != dtype:
        raise ValueError(f"the paged cache must be {dtype}")
    # MLA: [pages, page_size, width]; GQA: NHD [pages, page_size, Hk, D],
    # HND [pages, Hk, page_size, D].
    cache_page_size = first.shape[2 if not mla and kv_layout == "HND" else 1]
    if page_size != cache_page_size:
        raise ValueError(f"page_size is {page_size} but the cache's pages hold {cache_page_size}")
    _check_slot_shapes(first, second, k_rope, k_nope, v, mla, kv_layout)
    real, pages, slots = _append_slots(
        q_rope.shape[0], batch_indices, positions, kv_indptr, kv_indices, page_size,
        first.shape[0],
    )  # fmt: skip
    k_nope_shape = (*k_rope.shape[:-1], 0)
    q_r, k_r, q_n, k_n = rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope if k_nope is not None else k_rope.new_empty(k_nope_shape),
        cos_sin_cache, pos_ids, is_neox, dtype, quant_scale_q, quant_scale_kv,
        q_rope_out, None, q_nope_out, None,
    )  # fmt: skip
    pages, slots = pages.to(first.device), slots.to(first.device)
    rows = real.to(k_r.device)
    if mla:
        first[pages, slots] = k_n[rows]
        second[pages, slots] = k_r[rows]
        return q_r, q_n
    keys = torch.cat([k_r, k_n], dim=-1)[rows]
    values = _quantized(v, quant_scale_kv, dtype)[rows]
    if kv_layout == "NHD":
        first[pages, slots] = keys
        second[pages, slots] = values
    else:
        first[pages, :, slots] = keys
        second[pages, :, slots] = values
    return q_r, q_n


def _check_slot_shapes(first, second, k_rope, k_nope, v, mla, kv_layout) -> None:
    """Raises unless a token's rows fit a slot of each cache (checked before
    anything is written: the queries' outputs come first)."""
    nope = tuple(k_nope.shape[1:]) if k_nope is not None else (*k_rope.shape[1:-1], 0)
    if mla:
        want = ((nope[-1],), tuple(k_rope.shape[1:]))
        got = (tuple(first.shape[2:]), tuple(second.shape[2:]))
    else:
        key = (*k_rope.shape[1:-1], k_rope.shape[-1] + nope[-1])
        want = (key, tuple(v.shape[1:]))
        # A token's slot of [pages, page_size, Hk, D] (NHD), [pages, Hk, page_size, D] (HND).
        at = (1, 3) if kv_layout == "HND" else (2, 3)
        got = tuple((c.shape[at[0]], *c.shape[at[1] :]) for c in (first, second))
    if got != want:
        raise ValueError(
            f"the caches' slots are {got[0]} and {got[1]}, the rows {want[0]} and {want[1]}"
        )


def _append_slots(nnz, batch_indices, positions, kv_indptr, kv_indices, page_size, num_pages):
    """(real rows [nnz] bool, their pages, their slots) of a paged append,
    every index checked; batch_indices -1 marks a padding row (from
    get_batch_indices_positions past the last real token, or a captured
    step's spare rows), which is not written."""
    torch = _torch()
    batch = torch.as_tensor(batch_indices, device="cpu").long()
    pos = torch.as_tensor(positions, device="cpu").long()
    indptr = torch.as_tensor(kv_indptr, device="cpu").long()
    indices = torch.as_tensor(kv_indices, device="cpu").long()
    if batch.shape != (nnz,) or pos.shape != (nnz,):
        raise ValueError(f"batch_indices and positions must be [{nnz}]")
    if (
        indptr.dim() != 1
        or indptr.numel() == 0
        or int(indptr[0]) != 0
        or bool((indptr[1:] < indptr[:-1]).any())
        or int(indptr[-1]) > indices.numel()
    ):
        raise ValueError(
            "kv_indptr must start at 0, never decrease and end within kv_indices"
            f" ({indices.numel()} pages)"
        )
    real = batch >= 0
    b, p = batch[real], pos[real]
    if bool((batch < -1).any()) or bool((b >= indptr.numel() - 1).any()):
        raise ValueError("batch_indices must name requests of kv_indptr (or be -1: padding)")
    slot_in_table = indptr[b] + p // page_size
    if bool((p < 0).any()) or bool((slot_in_table >= indptr[b + 1]).any()):
        raise ValueError("a position lies past its request's pages in kv_indptr")
    pages = indices[slot_in_table]
    if bool((pages < 0).any()) or bool((pages >= num_pages).any()):
        raise ValueError(f"kv_indices must name pages of the cache [0, {num_pages})")
    return real, pages, p % page_size
