"""NVFP4 KV caches: FlashInfer's e2m1 values with e4m3 block scales.

The format (FlashInfer v0.6.17: include/flashinfer/page.cuh,
csrc/fp4_kv_{quantization,dequantization}.cu), for a row of head_dim values:

- Blocks of 16 consecutive values (head_dim % 16 == 0) share one scale.
- Values: 4-bit e2m1 codes, bit 3 the sign, bits 0-2 the magnitude index into
  (0, 0.5, 1, 1.5, 2, 3, 4, 6). Two per byte: the even element in the low
  nibble, the odd one in the high nibble: packed uint8 [..., head_dim // 2].
- Block scales: one float8 e4m3fn byte per block (bias 7, no infinities,
  0x7F/0xFF NaN, max 448, subnormals down to 2**-9), linear (not swizzled):
  [..., head_dim // 16], torch.float8_e4m3fn or its bytes as uint8.
- A global *decode* scale gs (a positive finite float32, FlashInfer's k_scale
  / v_scale): value = e2m1(code) * e4m3(scale) * gs, computed in float32 in
  that order ((code * scale) is exact, one rounding for * gs), then rounded to
  the output dtype (round to nearest even).
- Caches: K and V each [pages, page_size, heads, head_dim // 2] (NHD) or
  [pages, heads, page_size, head_dim // 2] (HND), as a (k, v) pair or stacked
  [pages, 2, ...]; the scale caches have the same form with head_dim // 16.

Quantization of one block x (as float32), as FlashInfer's appends do it
(page.cuh, nvfp4_append_quantize_block; every step is IEEE float32):

    amax  = max |x_i| (NaNs ignored: fmaxf), from 0
    sf    = amax / (6 * gs) if amax > 0 else 0
    byte  = e4m3(sf): round to nearest even, saturating to 448 (SATFINITE),
            subnormals kept, NaN -> 0x7F
    osc   = 1 / (e4m3_value(byte) * gs) if amax > 0 and that scale > 0 else 0
    code  = e2m1(x_i * osc): nearest of the 8 magnitudes, ties to even
            (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
            5 -> 4), above 5 -> 6 (saturates; +-inf too), NaN -> 0; the sign
            bit is the sign bit of x_i * osc (-0.0 and -NaN give 0x8).

This is bit-exact with FlashInfer's nvfp4_quantize_append_paged_kv_cache*.
`nvfp4_kv_quantize` follows csrc/fp4_kv_quantization.cu instead, which FlashInfer
only runs on SM100+ (Blackwell: cvt.rn.satfinite.e2m1x2.f32):
sf = (1/gs) * (amax * (1/6)) and osc = 1 / (scale * gs) whenever amax != 0
(infinite when the scale underflowed to 0). That kernel's reciprocals are
rcp.approx.ftz; pagedkv uses correctly rounded ones, so a result can differ
from a Blackwell GPU's where the approximate reciprocal is off by an ulp at a
rounding boundary (or for subnormal gs * scale, which ftz flushes).

Everything here runs on the host with NumPy (vectorized); torch tensors,
on the CPU or a GPU, are copied to and from the host. Attention over an NVFP4
cache (the wrappers' run(kv_cache_sf=...)) dequantizes the pages the plan
reads into q's dtype and runs the ordinary kernel on that copy: correct, not
at memory speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._checks import layout_code, narrow_indices
from ._ops.tensors import Array, is_torch

BLOCK = 16
"""Values per e4m3 block scale."""

E2M1_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
"""The float value of each 4-bit e2m1 code."""


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    values = sign * mag
    values[(exp == 15) & (man == 7)] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()
"""The float value of each float8 e4m3fn byte (0x7F and 0xFF are NaN)."""

_E4M3_POSITIVE = E4M3_VALUES[:0x7F].astype(np.float64)  # 0 .. 448, increasing


def e4m3_from_float(x: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes of x (float32): round to nearest even, finite values
    beyond 448 and infinities saturate to +-448, NaN -> 0x7F (CUDA's
    __nv_fp8_e4m3(float), i.e. __NV_SATFINITE)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x.astype(np.float64))
    hi = np.searchsorted(_E4M3_POSITIVE, a, side="left").clip(1, 0x7E)
    lo = hi - 1
    d_lo = a - _E4M3_POSITIVE[lo]
    d_hi = _E4M3_POSITIVE[hi] - a
    # Nearest; on a tie the even byte (an even mantissa).
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    code = np.where(a == 0, 0, code)
    code = np.where(a >= 448, 0x7E, code)  # SATFINITE (infinities included)
    code = code | np.where(np.signbit(x), 0x80, 0)
    code = np.where(np.isnan(x), 0x7F, code)
    return code.astype(np.uint8)


def e2m1_from_float(y: np.ndarray) -> np.ndarray:
    """4-bit e2m1 codes of y (float32): FlashInfer's nvfp4_append_quantize_e2m1
    (nearest, ties to even, saturating at 6, NaN -> 0 with y's sign bit)."""
    mag = np.abs(y)
    with np.errstate(invalid="ignore"):
        code = (
            (mag > 0.25).astype(np.uint8)
            + (mag >= 0.75)
            + (mag > 1.25)
            + (mag >= 1.75)
            + (mag > 2.5)
            + (mag >= 3.5)
            + (mag > 5.0)
        )
    return (code | np.where(np.signbit(y), 0x8, 0)).astype(np.uint8)


def quantize(
    x: np.ndarray, global_scale: float = 1.0, *, recipe: str = "append"
) -> tuple[np.ndarray, np.ndarray]:
    """(packed uint8 [..., D // 2], e4m3 scale bytes uint8 [..., D // 16]) of
    x [..., D] (float16, bfloat16 as float32, or float32; D % 16 == 0).

    recipe "append": FlashInfer's nvfp4_quantize_append_paged_kv_cache*
    rounding (the module docstring); "kv_quant": csrc/fp4_kv_quantization.cu's
    (nvfp4_kv_quantize) with correctly rounded reciprocals.
    """
    x = np.asarray(x)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of {BLOCK}")
    gs = np.float32(_positive_finite("global_scale", global_scale))
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    with np.errstate(all="ignore"):
        amax = np.fmax.reduce(np.abs(blocks), axis=-1, initial=np.float32(0))
        if recipe == "append":
            sf = np.where(amax > 0, amax / (np.float32(6) * gs), np.float32(0))
        elif recipe == "kv_quant":
            sf = (np.float32(1) / gs) * (amax * (np.float32(1) / np.float32(6)))
        else:
            raise ValueError(f"recipe must be 'append' or 'kv_quant', got {recipe!r}")
        sf_bytes = e4m3_from_float(sf.astype(np.float32))
        sf_value = E4M3_VALUES[sf_bytes]
        inv = np.float32(1) / (sf_value * gs)
        if recipe == "append":
            osc = np.where((amax > 0) & (sf_value > 0), inv, np.float32(0))
        else:
            osc = np.where(amax != 0, inv, np.float32(0))
        y = blocks * osc[..., None].astype(np.float32)
    codes = e2m1_from_float(y.astype(np.float32)).reshape(*x.shape[:-1], x.shape[-1])
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), sf_bytes


def dequantize_float32(
    packed: np.ndarray, scales: np.ndarray, global_scale: float = 1.0
) -> np.ndarray:
    """float32 [..., 2 * packed.shape[-1]]: e2m1 * e4m3 * global_scale, in
    float32 in that order. packed uint8 [..., D // 2], scales the e4m3 bytes
    (uint8) [..., D // 16]."""
    packed = np.asarray(packed, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    d = packed.shape[-1] * 2
    if d % BLOCK or scales.shape != (*packed.shape[:-1], d // BLOCK):
        raise ValueError(
            f"scales must be {[*packed.shape[:-1], d // BLOCK]} for packed "
            f"{list(packed.shape)} (head_dim {d}, a multiple of {BLOCK}), "
            f"got {list(scales.shape)}"
        )
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], d)
    values = E2M1_VALUES[codes].reshape(*packed.shape[:-1], d // BLOCK, BLOCK)
    with np.errstate(all="ignore"):
        out = values * E4M3_VALUES[scales][..., None] * np.float32(global_scale)
    return out.reshape(*packed.shape[:-1], d)


class FP4Tensor:
    """An NVFP4 tensor as FlashInfer's attention outputs one: ``data`` the
    packed e2m1 codes, uint8 [..., D // 2] (the module docstring's packing),
    ``scale`` the e4m3 scales of blocks of 16 along each row of data's
    leading dim (the rest flattened), float8_e4m3fn [R, C] with R a multiple
    of 128, in the 128x4 swizzled layout of NVIDIA's FP4 GEMMs
    (`swizzled_scale_offsets`), ``scale_start_index`` the scale row of
    data's first row, ``original_shape`` the shape before packing."""

    def __init__(
        self,
        data: Any,
        scale: Any,
        scale_start_index: int = 0,
        original_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.data = data
        self.scale = scale
        self.scale_start_index = scale_start_index
        self.original_shape = original_shape


def swizzled_scale_offsets(cols_total: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Offsets into a [R, cols_total] scale tensor in the 128x4 swizzled
    layout (R % 128 == 0, cols_total % 4 == 0) of logical (rows, cols):
    stored as [R // 128][cols_total // 4][row % 32][(row % 128) // 32][col % 4]."""
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    tile = (rows // 128) * (cols_total // 4) + cols // 4
    return ((tile * 32 + rows % 32) * 4 + (rows % 128) // 32) * 4 + cols % 4


# ---------------------------------------------------------------- host views


def _positive_finite(name: str, value: Any) -> float:
    """value (a number or a one-element float32 tensor) as a float, or the
    ValueError FlashInfer raises for a global decode scale."""
    if is_torch(value) or isinstance(value, np.ndarray):
        if int(np.prod(value.shape)) != 1:
            raise ValueError(f"{name} must have exactly one element, got {tuple(value.shape)}")
        if str(value.dtype).removeprefix("torch.") != "float32":
            raise ValueError(f"{name} must be torch.float32, got {value.dtype}")
        value = _host(value).reshape(()).item()
    try:
        scalar = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a positive finite global decode scale") from e
    if not math.isfinite(scalar) or scalar <= 0.0:
        raise ValueError(f"{name} must be a positive finite global decode scale, got {scalar}")
    return scalar


def _dtype_name(x: Array) -> str:
    return str(x.dtype).removeprefix("torch.")


def _host(x: Array) -> np.ndarray:
    """x's values on the host: float16/32 as they are, bfloat16 as float32,
    float8_e4m3fn as its bytes (uint8)."""
    if is_torch(x):
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.float()
        elif x.dtype == torch.float8_e4m3fn:
            x = x.view(torch.uint8)
        return x.cpu().numpy()
    return np.asarray(x)


def _check_innermost(name: str, x: Array) -> None:
    stride = x.stride(-1) if is_torch(x) else x.strides[-1] // x.itemsize
    if x.shape[-1] > 1 and stride != 1:
        raise ValueError(f"{name}: innermost stride must be 1, got {stride}")


def _unpack(name: str, cache: Array | Sequence[Array]) -> tuple[Array, Array]:
    """(k, v) of a (k, v) pair or a stacked [pages, 2, ...] cache."""
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            raise ValueError(f"{name} as a sequence must be a (k, v) pair")
        k, v = cache
    else:
        if len(cache.shape) != 5 or cache.shape[1] != 2:
            raise ValueError(
                f"{name} must be [pages, 2, ...page...] (5-D) or a (k, v) pair, "
                f"got shape {tuple(cache.shape)}"
            )
        k, v = cache[:, 0], cache[:, 1]
    for part, x in (("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} {part} must be 4-D, got shape {tuple(x.shape)}")
    return k, v


def _check_cache_pair(cache: tuple[Array, Array], sf: tuple[Array, Array], *, write: bool) -> None:
    """uint8 packed caches, float8_e4m3fn (or uint8) scale caches of matching
    shapes; innermost stride 1."""
    for part, x, s in (("k", cache[0], sf[0]), ("v", cache[1], sf[1])):
        if _dtype_name(x) != "uint8":
            raise ValueError("NVFP4 paged K/V cache tensors must have dtype torch.uint8")
        if _dtype_name(s) not in ("float8_e4m3fn", "uint8"):
            raise ValueError("NVFP4 scale cache tensors must have dtype torch.float8_e4m3fn")
        want = (*x.shape[:-1], x.shape[-1] * 2 // BLOCK)
        if tuple(s.shape) != want or (x.shape[-1] * 2) % BLOCK:
            raise ValueError(
                f"the {part} scale cache must be {list(want)} for a {part} cache of "
                f"{list(x.shape)} (head_dim // 16 scales a row), got {list(s.shape)}"
            )
        _check_innermost(f"{part} cache", x)
        _check_innermost(f"{part} scale cache", s)
        if write and not is_torch(x) and not (x.flags.writeable and s.flags.writeable):
            raise ValueError(f"the {part} cache and its scales must be writable")


def _write_rows(cache: Array, rows: tuple[np.ndarray, np.ndarray], values: np.ndarray, hnd: bool):
    """cache[page, entry] (NHD) / cache[page, :, entry] (HND) = values [n, H, X]."""
    pages, entries = rows
    if is_torch(cache):
        import torch

        target = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
        src = torch.from_numpy(values).to(cache.device)
        p = torch.from_numpy(pages.astype(np.int64)).to(cache.device)
        e = torch.from_numpy(entries.astype(np.int64)).to(cache.device)
        if hnd:
            target[p, :, e] = src
        else:
            target[p, e] = src
    elif hnd:
        cache[pages, :, entries] = values
    else:
        cache[pages, entries] = values


def _append_rows(
    append_key: Array,
    append_value: Array,
    rows: int,
    pages: np.ndarray,
    entries: np.ndarray,
    keep: np.ndarray,
    cache: tuple[Array, Array],
    sf: tuple[Array, Array],
    scales: tuple[float, float],
    hnd: bool,
) -> None:
    """Quantizes rows `keep` of the first `rows` of append_key/append_value
    and writes them at (pages, entries)."""
    if not keep.any():
        return
    for x, c, s, gs in zip((append_key, append_value), cache, sf, scales, strict=True):
        values = _host(x[:rows])[keep]
        packed, sf_bytes = quantize(values, gs)
        _write_rows(c, (pages[keep], entries[keep]), packed, hnd)
        _write_rows(s, (pages[keep], entries[keep]), sf_bytes, hnd)


def _check_append_inputs(
    append_key: Array, append_value: Array, cache: tuple[Array, Array], kv_layout: str
) -> tuple[int, int, int, int]:
    """(num_pages, page_size, num_heads, head_dim), after checking the appended
    rows against the cache."""
    layout = layout_code(kv_layout)
    if _dtype_name(append_key) not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"append_key must be float16 or bfloat16, got {append_key.dtype}")
    if _dtype_name(append_value) != _dtype_name(append_key):
        raise ValueError(
            f"append_key and append_value must have the same dtype, got "
            f"{append_key.dtype} and {append_value.dtype}"
        )
    k = cache[0]
    num_pages = int(k.shape[0])
    page_size, heads = (int(k.shape[1]), int(k.shape[2]))
    if layout == 1:
        page_size, heads = heads, page_size
    head_dim = int(k.shape[3]) * 2
    if tuple(cache[1].shape) != tuple(k.shape):
        raise ValueError("the K and V caches must have the same shape")
    for name, x in (("append_key", append_key), ("append_value", append_value)):
        if len(x.shape) != 3 or tuple(x.shape[1:]) != (heads, head_dim):
            raise ValueError(
                f"{name} must be [rows, {heads}, {head_dim}] for this cache, got {list(x.shape)}"
            )
    if append_key.shape[0] != append_value.shape[0]:
        raise ValueError("append_key and append_value must have the same number of rows")
    return num_pages, page_size, heads, head_dim


def _reject_capture(scale_names: Sequence[tuple[str, Any]]) -> None:
    """FlashInfer refuses host scalars during CUDA graph capture; pagedkv
    cannot be captured at all."""
    try:
        import torch
    except ImportError:
        return
    capturing = getattr(torch.cuda, "is_current_stream_capturing", None)
    try:
        active = capturing is not None and bool(capturing())
    except RuntimeError:  # a torch without CUDA
        active = False
    if active:
        names = ", ".join(n for n, _ in scale_names)
        raise ValueError(
            f"pagedkv's NVFP4 appends run on the host and cannot be recorded during "
            f"CUDA graph capture ({names})"
        )


# ----------------------------------------------------------------- the API


def nvfp4_quantize_append_paged_kv_cache(
    append_key: Array,
    append_value: Array,
    batch_indices: Array,
    positions: Array,
    paged_kv_cache: Array | Sequence[Array],
    kv_cache_sf: Array | Sequence[Array],
    kv_indices: Array,
    kv_indptr: Array,
    kv_last_page_len: Array,
    k_scale: float,
    v_scale: float,
    kv_layout: str = "NHD",
) -> None:
    """Quantizes K/V rows [nnz, H, D] (float16, bfloat16 or float32) to NVFP4
    and writes them into the packed cache and its scale cache (FlashInfer's
    signature and rounding: the module docstring). k_scale / v_scale are the
    global decode scales. Row i goes to position positions[i] of request
    batch_indices[i] in the CSR page table; every index is checked before
    anything is written (ValueError), and the position must fall in one of
    the request's pages."""
    layout_code(kv_layout)
    cache = _unpack("paged_kv_cache", paged_kv_cache)
    sf = _unpack("kv_cache_sf", kv_cache_sf)
    _check_cache_pair(cache, sf, write=True)
    if _dtype_name(append_key) not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"append_key must be float16 or bfloat16, got {append_key.dtype}")
    scales = []
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        try:
            scales.append(_positive_finite(name, value))
        except ValueError as e:
            raise ValueError(
                f"k_scale and v_scale must be positive finite global decode scales ({e})"
            ) from None
    num_pages, page_size, _, _ = _check_append_inputs(append_key, append_value, cache, kv_layout)
    nnz = int(append_key.shape[0])
    batch = narrow_indices("batch_indices", batch_indices, nnz).astype(np.int64)
    pos = narrow_indices("positions", positions, nnz).astype(np.int64)
    last = narrow_indices("kv_last_page_len", kv_last_page_len).astype(np.int64)
    indptr = narrow_indices("kv_indptr", kv_indptr, len(last) + 1).astype(np.int64)
    indices = narrow_indices("kv_indices", kv_indices).astype(np.int64)
    if nnz == 0:
        return
    if len(indptr) and (indptr[0] != 0 or (np.diff(indptr) < 0).any() or indptr[-1] > len(indices)):
        raise ValueError("kv_indptr must start at 0, never decrease and end within kv_indices")
    if ((batch < 0) | (batch >= len(last))).any():
        raise ValueError(f"batch_indices must be in [0, {len(last)})")
    if (pos < 0).any():
        raise ValueError("positions must be >= 0")
    page_iter = indptr[batch] + pos // page_size
    if (page_iter >= indptr[batch + 1]).any():
        i = int(np.nonzero(page_iter >= indptr[batch + 1])[0][0])
        raise ValueError(
            f"row {i}: position {pos[i]} of request {batch[i]} is beyond its "
            f"{indptr[batch[i] + 1] - indptr[batch[i]]} pages"
        )
    pages = indices[page_iter]
    if ((pages < 0) | (pages >= num_pages)).any():
        raise ValueError(f"kv_indices must be page ids in [0, {num_pages})")
    entries = pos % page_size
    _append_rows(
        append_key,
        append_value,
        nnz,
        pages,
        entries,
        np.ones(nnz, dtype=bool),
        cache,
        sf,
        (scales[0], scales[1]),
        kv_layout == "HND",
    )


def nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
    append_key: Array,
    append_value: Array,
    slot_mapping: Array,
    paged_kv_cache: Array | Sequence[Array],
    kv_cache_sf: Array | Sequence[Array],
    k_scale: float | Array,
    v_scale: float | Array,
    kv_layout: str = "NHD",
) -> None:
    """As nvfp4_quantize_append_paged_kv_cache, row i going to flat slot
    slot_mapping[i] = page * page_size + entry (int32 or int64). As in
    FlashInfer, negative slots (padding) and slots beyond the cache are
    skipped, and append_key/append_value may have more rows than
    slot_mapping (the extra ones are ignored). k_scale / v_scale: numbers or
    one-element float32 tensors."""
    layout_code(kv_layout)
    if _dtype_name(append_key) not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"append_key must be float16 or bfloat16, got {append_key.dtype}")
    if _dtype_name(slot_mapping) not in ("int32", "int64"):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if len(slot_mapping.shape) != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
    rows = int(slot_mapping.shape[0])
    if append_key.shape[0] < rows or append_value.shape[0] < rows:
        raise ValueError(
            "append_key and append_value must have at least slot_mapping.shape[0] rows"
        )
    cache = _unpack("paged_kv_cache", paged_kv_cache)
    sf = _unpack("kv_cache_sf", kv_cache_sf)
    _check_cache_pair(cache, sf, write=True)
    _reject_capture((("k_scale", k_scale), ("v_scale", v_scale)))
    gs = (_positive_finite("k_scale", k_scale), _positive_finite("v_scale", v_scale))
    num_pages, page_size, _, _ = _check_append_inputs(append_key, append_value, cache, kv_layout)
    slots = _host(slot_mapping).astype(np.int64)
    keep = (slots >= 0) & (slots < num_pages * page_size)
    _append_rows(
        append_key,
        append_value,
        rows,
        slots // page_size,
        slots % page_size,
        keep,
        cache,
        sf,
        gs,
        kv_layout == "HND",
    )


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _output_dtype_name(dtype: Any) -> str:
    """A torch or NumPy dtype's name ("float16"); "" for something else."""
    if str(dtype).startswith("torch."):
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return ""


def _from_float32(values: np.ndarray, dtype: Any, like: Array) -> Array:
    """values (float32, host) rounded to dtype (nearest even), as an array of
    like's kind and device."""
    name = _output_dtype_name(dtype)
    if name not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"the output dtype must be float16, bfloat16 or float32, got {dtype}")
    if is_torch(like):
        import torch

        return torch.from_numpy(values).to(dtype=_torch_dtype(name), device=like.device)
    if name == "bfloat16":
        raise TypeError("bfloat16 output needs torch tensors (NumPy has no bfloat16)")
    return values.astype(name)


def nvfp4_kv_quantize(input: Array, global_scale: Array | float) -> tuple[Array, Array]:
    """(packed uint8 [M, K // 2], e4m3 scale bytes uint8 [M, K // 16]) of
    input [M, K] (float16, bfloat16 or float32; K % 16 == 0), FlashInfer's
    nvfp4_kv_quantize (which needs SM100+ there) on the host: the "kv_quant"
    recipe of the module docstring. global_scale: the decode scale."""
    if len(input.shape) != 2:
        raise ValueError(f"input must be 2-D [M, K], got shape {tuple(input.shape)}")
    if input.shape[1] % BLOCK:
        raise ValueError(f"K dimension ({input.shape[1]}) must be divisible by {BLOCK}")
    if _dtype_name(input) not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"input must be float16 or bfloat16, got {input.dtype}")
    packed, scales = quantize(
        _host(input), _positive_finite("global_scale", global_scale), recipe="kv_quant"
    )
    if is_torch(input):
        import torch

        return (
            torch.from_numpy(packed).to(input.device),
            torch.from_numpy(scales).to(input.device),
        )
    return packed, scales


def nvfp4_kv_dequantize(
    fp4_data: Array, block_scales: Array, global_scale: Array | float, output_dtype: Any = None
) -> Array:
    """[M, K] in output_dtype (FlashInfer's default bfloat16 for torch, float16
    for NumPy) of packed [M, K // 2] and scale bytes [M, K // 16]."""
    if output_dtype is None:
        output_dtype = _torch_dtype("bfloat16") if is_torch(fp4_data) else np.float16
    if _dtype_name(fp4_data) != "uint8":
        raise TypeError(f"fp4_data must be packed uint8, got {fp4_data.dtype}")
    if _dtype_name(block_scales) not in ("uint8", "float8_e4m3fn"):
        raise TypeError(f"block_scales must be e4m3 bytes (uint8), got {block_scales.dtype}")
    k = int(fp4_data.shape[-1]) * 2
    if k % BLOCK:
        raise ValueError(f"K dimension ({k}) must be divisible by {BLOCK}")
    gs = _positive_finite("global_scale", global_scale)
    values = dequantize_float32(_host(fp4_data), _host(block_scales), gs)
    return _from_float32(values, output_dtype, fp4_data)


def e2m1_and_ufp8sf_scale_to_float(
    e2m1_tensor: Array,
    ufp8_scale_tensor: Array,
    global_scale_tensor: Array | None = None,
    sf_vec_size: int = 16,
    ufp8_type: int = 1,
    is_sf_swizzled_layout: bool = True,
    is_sf_8x4_layout: bool = False,
) -> Array:
    """float32 [M, K] of packed e2m1 [M, K // 2] and linear scale bytes
    [M, K // sf_vec_size] (ufp8_type 1: e4m3, 0: ue8m0 = 2**(byte - 127)),
    times global_scale_tensor's value: FlashInfer's function (its CPU
    fallback's arithmetic). Only is_sf_swizzled_layout=False is supported."""
    if is_sf_swizzled_layout or is_sf_8x4_layout:
        raise NotImplementedError(
            "e2m1_and_ufp8sf_scale_to_float: only the linear scale layout "
            "(is_sf_swizzled_layout=False) is supported; pagedkv's NVFP4 caches use it"
        )
    packed = _host(e2m1_tensor).astype(np.uint8)
    sf = _host(ufp8_scale_tensor).astype(np.uint8)
    if len(packed.shape) != 2:
        raise ValueError(f"e2m1_tensor must be 2-D [M, K // 2], got {list(packed.shape)}")
    m, k = packed.shape[0], packed.shape[1] * 2
    if sf_vec_size <= 0 or k % sf_vec_size or sf.size != m * (k // sf_vec_size):
        raise ValueError(
            f"ufp8_scale_tensor must hold [{m}, {k} // {sf_vec_size}] scales, got {list(sf.shape)}"
        )
    sf = sf.reshape(m, k // sf_vec_size)
    if ufp8_type == 1:
        scale = E4M3_VALUES[sf]
    elif ufp8_type == 0:
        scale = np.exp2(sf.astype(np.float32) - np.float32(127))
    else:
        raise ValueError(f"ufp8_type must be 0 (ue8m0) or 1 (e4m3), got {ufp8_type}")
    gs = 1.0 if global_scale_tensor is None else float(_host(global_scale_tensor).reshape(-1)[0])
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(m, k)
    with np.errstate(all="ignore"):
        out = E2M1_VALUES[codes] * np.repeat(scale, sf_vec_size, axis=1) * np.float32(gs)
    out = out.astype(np.float32)
    if is_torch(e2m1_tensor):
        import torch

        return torch.from_numpy(out)
    return out


def nvfp4_kv_dequantize_paged(
    paged_kv_cache: Array | Sequence[Array],
    kv_cache_sf: Array | Sequence[Array],
    block_tables: Array,
    seq_lens: Array,
    k_scale: Array,
    v_scale: Array,
    output_k: Array,
    output_v: Array,
    kv_layout: str = "NHD",
) -> None:
    """Dequantizes the paged cache into output_k / output_v [B, max_seq_len,
    H, D] (float16 or bfloat16; float32 too here): token t of request b is
    entry t % page_size of page block_tables[b, t // page_size], for
    t < seq_lens[b]; other outputs are left as they are, as are tokens whose
    page id is outside the cache (as in FlashInfer's kernel). K and V may
    have different head dims."""
    layout = layout_code(kv_layout)
    cache = _unpack("paged_kv_cache", paged_kv_cache)
    sf = _unpack("kv_cache_sf", kv_cache_sf)
    if _dtype_name(seq_lens) != "int32":
        raise ValueError(f"seq_lens must have dtype torch.int32, got {seq_lens.dtype}")
    if _dtype_name(block_tables) not in ("int32", "int64"):
        raise ValueError(
            f"block_tables must have dtype torch.int32 or torch.int64, got {block_tables.dtype}"
        )
    for s in (k_scale, v_scale):
        if _dtype_name(s) != "float32":
            raise ValueError("k_scale and v_scale must have dtype torch.float32")
    if int(np.prod(k_scale.shape)) != 1 or int(np.prod(v_scale.shape)) != 1:
        raise ValueError("k_scale and v_scale must be scalar tensors")
    if _dtype_name(output_k) != _dtype_name(output_v):
        raise ValueError("output_k and output_v must have the same dtype")
    if _dtype_name(output_k) not in ("float16", "bfloat16", "float32"):
        raise ValueError(
            f"output dtype must be torch.float16 or torch.bfloat16, got {output_k.dtype}"
        )
    if len(output_k.shape) != 4 or len(output_v.shape) != 4:
        raise ValueError("output_k and output_v must be 4D tensors")
    if tuple(output_k.shape[:3]) != tuple(output_v.shape[:3]):
        raise ValueError("output_k and output_v must share batch, sequence, and head dims")
    for part, out, c, s in (("k", output_k, cache[0], sf[0]), ("v", output_v, cache[1], sf[1])):
        d = int(out.shape[3])
        if d % BLOCK:
            raise ValueError(f"output_{part} head_dim ({d}) must be divisible by {BLOCK}")
        if int(c.shape[3]) != d // 2 or int(s.shape[3]) != d // BLOCK:
            raise ValueError(
                f"the {part} cache rows hold {int(c.shape[3]) * 2} values "
                f"({int(s.shape[3])} scales); output_{part} has head_dim {d}"
            )
        if _dtype_name(c) != "uint8":
            raise ValueError("NVFP4 paged K/V cache tensors must have dtype torch.uint8")
    batch, max_len, heads = (int(x) for x in output_k.shape[:3])
    num_pages = int(cache[0].shape[0])
    page_size = int(cache[0].shape[1 if layout == 0 else 2])
    if int(cache[0].shape[2 if layout == 0 else 1]) != heads and batch * max_len:
        raise ValueError("the cache's head count differs from the outputs'")
    if batch == 0 or max_len == 0 or heads == 0:
        return
    lens = _host(seq_lens).astype(np.int64).reshape(-1)
    table = _host(block_tables).astype(np.int64)
    if table.ndim != 2 or table.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, pages] and seq_lens [{batch}], "
            f"got {list(table.shape)} and {list(lens.shape)}"
        )
    if (lens < 0).any() or (lens > max_len).any():
        raise ValueError(f"seq_lens must be in [0, {max_len}] (the outputs' max_seq_len)")
    need = int(-(-max_len // page_size))
    if table.shape[1] < need:
        raise RuntimeError(
            f"block_tables column count insufficient: {table.shape[1]} < {need} "
            f"(max_seq_len {max_len}, page_size {page_size})"
        )
    b_idx, t_idx = np.nonzero(np.arange(max_len)[None, :] < lens[:, None])
    pages = table[b_idx, t_idx // page_size]
    ok = (pages >= 0) & (pages < num_pages)
    b_idx, t_idx, pages = b_idx[ok], t_idx[ok], pages[ok]
    entries = t_idx % page_size
    for out, c, s, gs in (
        (output_k, cache[0], sf[0], k_scale),
        (output_v, cache[1], sf[1], v_scale),
    ):
        rows_c, rows_s = (
            _gather_rows(c, pages, entries, layout),
            _gather_rows(s, pages, entries, layout),
        )
        values = dequantize_float32(rows_c, rows_s, float(_host(gs).reshape(-1)[0]))
        _scatter_output(out, b_idx, t_idx, values)


def _gather_rows(x: Array, pages: np.ndarray, entries: np.ndarray, layout: int) -> np.ndarray:
    """[n, H, X] host bytes of x at (pages, entries), reading only those rows."""
    if is_torch(x):
        import torch

        if x.dtype != torch.uint8:
            x = x.view(torch.uint8)
        p = torch.from_numpy(pages).to(x.device)
        e = torch.from_numpy(entries).to(x.device)
        rows = x[p, :, e] if layout == 1 else x[p, e]
        return rows.cpu().numpy()
    return np.asarray(x[pages, :, entries] if layout == 1 else x[pages, entries])


def _scatter_output(out: Array, b_idx: np.ndarray, t_idx: np.ndarray, values: np.ndarray) -> None:
    if is_torch(out):
        import torch

        src = torch.from_numpy(values).to(dtype=out.dtype, device=out.device)
        out[torch.from_numpy(b_idx).to(out.device), torch.from_numpy(t_idx).to(out.device)] = src
    else:
        out[b_idx, t_idx] = values.astype(out.dtype)


# ------------------------------------------------------- attention's hooks


TRTLLM_V_SCALE_ORDER = {"NHD": (0, 1, 4, 3, 5, 2), "HND": (0, 1, 2, 4, 5, 3)}
"""TRT-LLM's V block-scale layout, by cache layout: the linear scales
[pages, P, H, S] (NHD; [pages, H, P, S] for HND) viewed as [pages, P / 4,
4, H, 4, S / 4] (HND: [pages, H, P / 4, 4, 4, S / 4]) and permuted so: groups
of 4 tokens interleaved within each page and head (FlashInfer's
nvfp4_quantize_paged_kv_cache). K's scales stay linear."""


def _trtllm_v_scale_view(shape: tuple[int, ...], kv_layout: str) -> tuple[int, ...]:
    if kv_layout == "NHD":
        pages, page_size, heads, blocks = shape
        return (pages, page_size // 4, 4, heads, 4, blocks // 4)
    pages, heads, page_size, blocks = shape
    return (pages, heads, page_size // 4, 4, 4, blocks // 4)


def _check_trtllm_v_scales(shape: tuple[int, ...], kv_layout: str) -> None:
    if len(shape) != 4 or shape[1 if kv_layout == "NHD" else 2] % 4 or shape[3] % 4:
        raise ValueError(
            "TRT-LLM's V scale layout needs scales [pages, ...] of 4 dims with page_size % 4"
            f" == 0 and head_dim % 64 == 0, got {list(shape)}"
        )


def trtllm_v_scales_linear(v_scales: Array, kv_layout: str) -> Array:
    """V's block scales in TRT-LLM's layout (TRTLLM_V_SCALE_ORDER) back in
    the linear layout pagedkv's NVFP4 caches use (a permuted copy)."""
    layout_code(kv_layout)
    shape = tuple(v_scales.shape)
    _check_trtllm_v_scales(shape, kv_layout)
    order = TRTLLM_V_SCALE_ORDER[kv_layout]
    view = _trtllm_v_scale_view(shape, kv_layout)
    permuted = tuple(view[i] for i in order)
    inverse = tuple(int(i) for i in np.argsort(order))
    if is_torch(v_scales):
        return v_scales.reshape(permuted).permute(inverse).reshape(shape).contiguous()
    linear = np.asarray(v_scales).reshape(permuted).transpose(inverse).reshape(shape)
    return np.ascontiguousarray(linear)


def nvfp4_quantize_paged_kv_cache(
    k_cache: Array,
    v_cache: Array,
    kv_layout: str = "HND",
    k_global_sf: Array | None = None,
    v_global_sf: Array | None = None,
) -> tuple[tuple[Array, Array], tuple[Array, Array], float, float]:
    """FlashInfer's NVFP4 cache for its trtllm-gen kernels, from float caches
    k_cache and v_cache [pages, P, H, D] (NHD; [pages, H, P, D] HND), torch.

    k_global_sf, v_global_sf: the global *encode* scales (float32, one
    element), by default 448 / amax of the cache. Returns ((k, v) packed
    uint8 [..., D // 2], (k, v) block scales float8_e4m3fn [..., D // 16], K's
    linear and V's in TRT-LLM's layout (TRTLLM_V_SCALE_ORDER), 1 /
    k_global_sf, 1 / v_global_sf): the global decode scales, which callers
    fold into bmm1_scale and bmm2_scale. Each block is quantized with the
    "kv_quant" recipe (the module docstring). Needs page_size % 4 == 0 and
    D % 64 == 0.

    Examples
    --------
    >>> import torch, pagedkv
    >>> k, v = torch.randn(2, 2, 2, 16, 64).unbind(0)    # HND
    >>> (kq, vq), (ks, vs), k_dec, v_dec = pagedkv.nvfp4.nvfp4_quantize_paged_kv_cache(k, v)
    >>> kq.shape, vs.shape
    (torch.Size([2, 2, 16, 32]), torch.Size([2, 2, 16, 4]))
    """
    import torch

    layout_code(kv_layout)
    if not (is_torch(k_cache) and is_torch(v_cache)) or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must be torch tensors of one shape")
    if len(k_cache.shape) != 4 or k_cache.shape[-1] % 64:
        raise ValueError(f"caches must be [pages, ...] of 4 dims, head_dim % 64 == 0, got "
                         f"{list(k_cache.shape)}")  # fmt: skip
    scale_shape = (*k_cache.shape[:-1], k_cache.shape[-1] // BLOCK)
    _check_trtllm_v_scales(scale_shape, kv_layout)
    packed, scales, decode_scales = [], [], []
    for cache, given in ((k_cache, k_global_sf), (v_cache, v_global_sf)):
        host = _host(cache).astype(np.float32)
        if given is None:
            amax = float(np.abs(host).max()) if host.size else 0.0
            encode = float(np.float32(448.0) / np.float32(max(amax, 1e-12)))
        else:
            encode = _positive_finite("global_sf", given)
        data, sf = quantize(host, 1.0 / encode, recipe="kv_quant")
        packed.append(torch.from_numpy(data).to(cache.device))
        scales.append(torch.from_numpy(sf).view(torch.float8_e4m3fn).to(cache.device))
        decode_scales.append(1.0 / encode)
    view = _trtllm_v_scale_view(scale_shape, kv_layout)
    scales[1] = (
        scales[1].reshape(view).permute(TRTLLM_V_SCALE_ORDER[kv_layout]).reshape(scale_shape)
    ).contiguous()
    return (packed[0], packed[1]), (scales[0], scales[1]), decode_scales[0], decode_scales[1]


def is_nvfp4_kv_dtype(kv_data_type: object) -> bool:
    """FlashInfer plans attention over an NVFP4 cache with kv_data_type=uint8."""
    if kv_data_type is None:
        return False
    from max.dtype import DType

    from ._plan.work import as_dtype

    try:
        return as_dtype(kv_data_type, "kv_data_type") == DType.uint8
    except TypeError:
        return False


def plan_kv_dtype(kv_data_type: object, q_data_type: object) -> object:
    """The kv_data_type a plan compiles for: q's for an NVFP4 cache (whose
    pages run() dequantizes into q's dtype), else kv_data_type."""
    return q_data_type if is_nvfp4_kv_dtype(kv_data_type) else kv_data_type


def dequantize_for_attention(
    paged_kv_cache: Array | Sequence[Array],
    kv_cache_sf: Array | Sequence[Array],
    kv_layout: str,
    like: Array,
    pages: np.ndarray | None = None,
) -> tuple[Array, Array]:
    """(k, v) in like's dtype and device with the cache's shape and the full
    head_dim; only `pages` (all when None) are filled, the rest are zeros.
    The values are e2m1 * e4m3 (exact in float16 and bfloat16): the global
    scales stay with k_scale / v_scale, which the kernel applies as it does
    for float8 caches (q.k * k_scale, o * v_scale), as FlashInfer's do."""
    layout_code(kv_layout)
    cache = _unpack("paged_kv_cache", paged_kv_cache)
    sf = _unpack("kv_cache_sf", kv_cache_sf)
    _check_cache_pair(cache, sf, write=False)
    out = []
    for c, s in zip(cache, sf, strict=True):
        shape = (*c.shape[:-1], int(c.shape[-1]) * 2)
        host = np.zeros(shape, dtype=np.float32)
        if pages is None:
            host[...] = dequantize_float32(_host(c), _host(s))
        elif len(pages):
            host[pages] = dequantize_float32(_rows_of(c, pages), _rows_of(s, pages))
        out.append(_from_float32(host, like.dtype, like))
    return out[0], out[1]


def attention_cache(
    paged_kv_cache: Array | Sequence[Array],
    kv_cache_sf: Array | Sequence[Array],
    kv_layout: str,
    q: Array,
    table: Any,
) -> tuple[Array, Array]:
    """The (k, v) cache a plan's kernel reads for an NVFP4 cache: the pages
    of `table` (the plan's PageTable) dequantized into q's dtype."""
    pages = np.unique(table.indices[: int(table.indptr[-1])]).astype(np.int64)
    num_pages = int(_unpack("paged_kv_cache", paged_kv_cache)[0].shape[0])
    if len(pages) and int(pages[-1]) >= num_pages:
        raise ValueError(
            f"the page table uses page {int(pages[-1])} but the cache holds {num_pages} pages"
        )
    return dequantize_for_attention(paged_kv_cache, kv_cache_sf, kv_layout, q, pages)


def _rows_of(x: Array, pages: np.ndarray) -> np.ndarray:
    if is_torch(x):
        import torch

        if x.dtype != torch.uint8:
            x = x.view(torch.uint8)
        return x[torch.from_numpy(pages).to(x.device)].cpu().numpy()
    return np.asarray(x)[pages]


def dequantize_ragged_for_attention(
    k: Array, v: Array, kv_cache_sf: Sequence[Array], like: Array
) -> tuple[Array, Array]:
    """Ragged NVFP4 K/V [tokens, H, D // 2] with their scales (k_sf, v_sf)
    [tokens, H, D // 16] as (k, v) [tokens, H, D] in like's dtype."""
    if not isinstance(kv_cache_sf, (tuple, list)) or len(kv_cache_sf) != 2:
        raise ValueError("kv_cache_sf must be a (k_sf, v_sf) pair for ragged K/V")
    out = []
    for name, x, s in (("k", k, kv_cache_sf[0]), ("v", v, kv_cache_sf[1])):
        if _dtype_name(x) != "uint8":
            raise ValueError(f"NVFP4 {name} must have dtype uint8, got {x.dtype}")
        _check_innermost(name, x)
        _check_innermost(f"{name} scales", s)
        out.append(_from_float32(dequantize_float32(_host(x), _host(s)), like.dtype, like))
    return out[0], out[1]
