"""NVFP4 KV caches (pagedkv.nvfp4) against an independent float64 reference of
FlashInfer's format: e2m1 values (even element in the low nibble), e4m3
block scales of 16 values, value = e2m1 * e4m3 * global decode scale."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

import pagedkv
from pagedkv import nvfp4

torch = pytest.importorskip("torch")

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_e4m3(v: float) -> int:
    """float8 e4m3fn byte of v >= 0 (or NaN): nearest even, saturating at 448."""
    if math.isnan(v):
        return 0x7F
    if v >= 448.0:
        return 0x7E
    if v == 0.0:
        return 0
    e = max(math.floor(math.log2(v)), -6)
    quantum = 2.0 ** (e - 3)
    n = v / quantum
    r = math.floor(n)
    if n - r > 0.5 or (n - r == 0.5 and r % 2 == 1):
        r += 1
    value = r * quantum
    if value >= 448.0:
        return 0x7E
    if value < 2.0**-6:
        return int(round(value / 2.0**-9))  # subnormal: mantissa only
    e = math.floor(math.log2(value))
    return ((e + 7) << 3) | int(round((value / 2.0**e - 1) * 8))


def ref_e4m3_value(byte: int) -> float:
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return math.nan
    mag = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if byte & 0x80 else mag


def ref_e2m1(y: float) -> int:
    """e2m1 code: nearest grid magnitude, ties to the even code, saturating."""
    sign = 0x8 if math.copysign(1.0, y) < 0 else 0
    if math.isnan(y):
        return sign
    a = abs(y)
    if math.isinf(a):
        return sign | 7  # saturates to 6
    best = min(range(8), key=lambda i: (abs(a - E2M1_GRID[i]), i % 2))
    return sign | best


def f32(x: float) -> float:
    return float(np.float32(x))


def ref_quantize_row(x: np.ndarray, gs: float) -> tuple[list[int], list[int]]:
    """FlashInfer's append quantization of one row, step by step in float32
    (each operation rounded with np.float32 of the exact float64 result)."""
    packed, scales = [], []
    for b in range(len(x) // 16):
        block = [float(np.float32(v)) for v in x[16 * b : 16 * b + 16]]
        amax = 0.0
        for v in block:
            if not math.isnan(v):
                amax = max(amax, abs(v))
        sf = f32(amax / f32(6.0 * gs)) if amax > 0 else 0.0
        byte = ref_e4m3(sf)
        scales.append(byte)
        sf_r = ref_e4m3_value(byte)
        osc = f32(1.0 / f32(sf_r * gs)) if amax > 0 and sf_r > 0 else 0.0
        codes = []
        for v in block:
            if math.isinf(v) or math.isnan(v):
                y = v * osc if osc else (math.nan if math.isinf(v) else v)
            else:
                y = f32(v * osc)
            if osc == 0 and not math.isnan(v):
                y = math.copysign(0.0, v)
            codes.append(ref_e2m1(y))
        packed += [codes[i] | (codes[i + 1] << 4) for i in range(0, 16, 2)]
    return packed, scales


def ref_dequantize_row(packed: np.ndarray, scales: np.ndarray, gs: float) -> np.ndarray:
    out = []
    for i, byte in enumerate(packed):
        for code in (byte & 0xF, byte >> 4):
            mag = E2M1_GRID[code & 7] * (-1.0 if code & 8 else 1.0)
            out.append(f32(mag * ref_e4m3_value(int(scales[(2 * i) // 16])) * gs))
    return np.array(out, dtype=np.float32)


def test_e4m3_every_float32_neighbourhood() -> None:
    mids = (nvfp4.E4M3_VALUES[:126].astype(np.float64) + nvfp4.E4M3_VALUES[1:127]) / 2
    ups = np.nextafter(mids.astype(np.float32), np.float32(np.inf))
    downs = np.nextafter(mids.astype(np.float32), np.float32(0))
    rng = np.random.default_rng(0)
    probes = np.concatenate(
        [
            mids.astype(np.float32),  # exact ties (all representable in float32)
            ups,
            downs,
            nvfp4.E4M3_VALUES[:127],
            np.float32(2.0**-10) * np.array([0.5, 1, 1.5, 2, 2.5, 3], np.float32),
            np.array([448, 449, 463.9, 464, 480, 1e30, np.inf], np.float32),
            (rng.random(2000) * 500).astype(np.float32),
            (rng.random(2000) * 0.02).astype(np.float32),
        ]
    )
    got = nvfp4.e4m3_from_float(probes)
    want = [ref_e4m3(float(v)) for v in probes]
    np.testing.assert_array_equal(got, want)
    assert nvfp4.e4m3_from_float(np.array([np.nan], np.float32))[0] == 0x7F
    for byte in range(256):
        a, b = nvfp4.E4M3_VALUES[byte], ref_e4m3_value(byte)
        assert (math.isnan(a) and math.isnan(b)) or a == b


def test_e2m1_ties_saturation_and_signs() -> None:
    probes = [0, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6, 7, 1e9]
    ys = np.array(probes + [-v for v in probes] + [np.inf, -np.inf, np.nan, -0.0], np.float32)
    got = nvfp4.e2m1_from_float(ys)
    want = [ref_e2m1(float(y)) for y in ys]
    np.testing.assert_array_equal(got, want)
    assert list(got[: len(probes)][:9]) == [0, 0, 1, 2, 2, 4, 4, 6, 6]


@pytest.mark.parametrize("gs", [1.0, 0.37, 1e-3, 40.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_matches_reference(gs: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=g) * torch.logspace(-4, 3, 6)[:, None]
    x[0, :16] = 0  # an all-zero block
    x[0, 16:32] = -0.0
    x[1, 3] = 6 * 448 * gs * 2  # a block whose scale saturates
    x[2, 16:32] = 1e-6  # a block whose scale is subnormal or zero
    x[3, 0:16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)  # ties
    x = x.to(dtype)
    packed, scales = nvfp4.quantize(x.float().numpy(), gs)
    for r in range(x.shape[0]):
        want_p, want_s = ref_quantize_row(x[r].float().numpy(), gs)
        assert list(packed[r]) == want_p, r
        assert list(scales[r]) == want_s, r


def test_quantize_nan_and_inf() -> None:
    x = np.ones((1, 32), np.float32)
    x[0, 1] = np.nan
    x[0, 2] = -np.nan
    x[0, 17] = np.inf
    packed, scales = nvfp4.quantize(x)
    want_p, want_s = ref_quantize_row(x[0], 1.0)
    assert list(packed[0]) == want_p and list(scales[0]) == want_s
    assert scales[0, 1] == 0x7E  # an infinite amax saturates the scale


def test_dequantize_and_round_trip() -> None:
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, (5, 32), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (5, 4), dtype=np.uint8)
    got = nvfp4.dequantize_float32(packed, scales, 0.75)
    for r in range(5):
        np.testing.assert_array_equal(got[r], ref_dequantize_row(packed[r], scales[r], 0.75))
    x = rng.standard_normal((64, 128)).astype(np.float32)
    p, s = nvfp4.quantize(x, 0.5)
    back = nvfp4.dequantize_float32(p, s, 0.5).reshape(64, 8, 16)
    amax = np.abs(x.reshape(64, 8, 16)).max(-1, keepdims=True)
    # Half an e2m1 step at the top of the grid (1 of 6) plus the scale's rounding.
    assert (np.abs(back - x.reshape(64, 8, 16)) <= amax * (1 / 6) * 1.07 + 1e-7).all()


def make_append_inputs(layout: str, dtype: torch.dtype, stacked: bool = False):
    g = torch.Generator().manual_seed(3)
    nnz, heads, d, page_size, pages = 11, 2, 64, 4, 6
    k = (torch.randn(nnz, heads, d, generator=g) * 3).to(dtype)
    v = torch.randn(nnz, heads, d, generator=g).to(dtype)
    shape = (
        (pages, page_size, heads, d // 2) if layout == "NHD" else (pages, heads, page_size, d // 2)
    )
    sshape = (*shape[:-1], d // 16)
    if stacked:
        cache = torch.full((pages, 2, *shape[1:]), 7, dtype=torch.uint8)
        sf = torch.zeros((pages, 2, *sshape[1:]), dtype=torch.float8_e4m3fn)
    else:
        cache = (torch.full(shape, 7, dtype=torch.uint8), torch.full(shape, 9, dtype=torch.uint8))
        sf = (
            torch.zeros(sshape, dtype=torch.float8_e4m3fn),
            torch.zeros(sshape, dtype=torch.float8_e4m3fn),
        )
    return k, v, cache, sf, page_size


def parts(cache):
    return (cache[:, 0], cache[:, 1]) if torch.is_tensor(cache) else cache


def row_at(x: torch.Tensor, page: int, entry: int, layout: str) -> np.ndarray:
    x = x.view(torch.uint8) if x.dtype != torch.uint8 else x
    return (x[page, entry] if layout == "NHD" else x[page, :, entry]).numpy()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stacked", [False, True])
def test_append_bitwise(layout: str, dtype: torch.dtype, stacked: bool) -> None:
    k, v, cache, sf, page_size = make_append_inputs(layout, dtype, stacked)
    # Two requests: 7 tokens on pages [4, 1], 4 tokens on page [2].
    kv_indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    kv_indices = torch.tensor([4, 1, 2], dtype=torch.int32)
    last = torch.tensor([3, 4], dtype=torch.int32)
    batch = torch.tensor([0] * 7 + [1] * 4, dtype=torch.int32)
    pos = torch.tensor(list(range(7)) + list(range(4)), dtype=torch.int32)
    before = [x.clone() for x in parts(cache)] + [x.clone() for x in parts(sf)]
    pagedkv.nvfp4_quantize_append_paged_kv_cache(
        k, v, batch, pos, cache, sf, kv_indices, kv_indptr, last, 0.5, 2.0, kv_layout=layout
    )
    touched = set()
    for i in range(11):
        b, p = int(batch[i]), int(pos[i])
        page = int(kv_indices[int(kv_indptr[b]) + p // page_size])
        entry = p % page_size
        touched.add((page, entry))
        for x, c, s, gs in (
            (k, parts(cache)[0], parts(sf)[0], 0.5),
            (v, *[parts(cache)[1], parts(sf)[1]], 2.0),
        ):
            for h in range(x.shape[1]):
                want_p, want_s = ref_quantize_row(x[i, h].float().numpy(), gs)
                assert list(row_at(c, page, entry, layout)[h]) == want_p
                assert list(row_at(s, page, entry, layout)[h]) == want_s
    # Nothing else changed.
    for old, new in zip(before, [*parts(cache), *parts(sf)], strict=True):
        for page in range(old.shape[0]):
            for entry in range(page_size):
                if (page, entry) not in touched:
                    np.testing.assert_array_equal(
                        row_at(new, page, entry, layout), row_at(old, page, entry, layout)
                    )


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_slot_mapping_bitwise_and_skips(layout: str) -> None:
    k, v, cache, sf, page_size = make_append_inputs(layout, torch.float16)
    capacity = 6 * page_size
    slots = torch.tensor([5, -1, 0, capacity, 23, capacity + 7, 9], dtype=torch.int64)
    before = [x.clone() for x in (*cache, *sf)]
    pagedkv.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
        k, v, slots, cache, sf, torch.tensor([1.5]), 1.0, kv_layout=layout
    )
    written = {}
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < capacity:
            written[(s // page_size, s % page_size)] = i
    for page in range(6):
        for entry in range(page_size):
            i = written.get((page, entry))
            for j, (x, gs) in enumerate(((k, 1.5), (v, 1.0))):
                got_p, got_s = (
                    row_at(cache[j], page, entry, layout),
                    row_at(sf[j], page, entry, layout),
                )
                if i is None:
                    np.testing.assert_array_equal(got_p, row_at(before[j], page, entry, layout))
                    np.testing.assert_array_equal(got_s, row_at(before[2 + j], page, entry, layout))
                    continue
                for h in range(x.shape[1]):
                    want_p, want_s = ref_quantize_row(x[i, h].float().numpy(), gs)
                    assert list(got_p[h]) == want_p and list(got_s[h]) == want_s


def test_numpy_caches() -> None:
    rng = np.random.default_rng(4)
    k = rng.standard_normal((3, 1, 32)).astype(np.float16)
    cache = (np.zeros((2, 2, 1, 16), np.uint8), np.zeros((2, 2, 1, 16), np.uint8))
    sf = (np.zeros((2, 2, 1, 2), np.uint8), np.zeros((2, 2, 1, 2), np.uint8))
    pagedkv.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
        k, k, np.array([3, 0, 1], np.int32), cache, sf, 1.0, 1.0
    )
    want_p, want_s = ref_quantize_row(k[0, 0].astype(np.float32), 1.0)
    assert list(cache[0][1, 1, 0]) == want_p and list(sf[1][1, 1, 0]) == want_s


def bad_calls():
    """(description, callable) pairs that must raise and write nothing, the
    pools they would write, and the two valid calls each bad one departs from."""
    k, v, cache, sf, _ = make_append_inputs("NHD", torch.float16)
    idx = dict(
        batch_indices=torch.zeros(11, dtype=torch.int32),
        positions=torch.arange(11, dtype=torch.int32),
        kv_indices=torch.tensor([0, 1, 2], dtype=torch.int32),
        kv_indptr=torch.tensor([0, 3], dtype=torch.int32),
        kv_last_page_len=torch.tensor([3], dtype=torch.int32),
    )

    # The arguments both appends take, valid: each bad call changes one or two.
    common = dict(
        append_key=k, append_value=v, paged_kv_cache=cache, kv_cache_sf=sf, k_scale=1.0, v_scale=1.0
    )

    def call(fn, base, over):
        # A misspelled argument would raise TypeError and pass for the wrong reason.
        assert set(over) <= set(inspect.signature(fn).parameters), set(over)
        args = {**base, **over}
        return lambda: fn(**args)

    def append(**over):
        return call(pagedkv.nvfp4_quantize_append_paged_kv_cache, {**common, **idx}, over)

    def slots(**over):
        base = {**common, "slot_mapping": torch.arange(11, dtype=torch.int32)}
        return call(pagedkv.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping, base, over)

    calls = [
        ("zero scale", append(k_scale=0.0)),
        ("nan scale", append(v_scale=math.nan)),
        ("negative tensor scale", slots(v_scale=torch.tensor([-1.0]))),
        ("inf scale", slots(k_scale=math.inf)),
        ("two-element scale", slots(k_scale=torch.ones(2))),
        ("float64 scale", slots(k_scale=torch.ones(1, dtype=torch.float64))),
        ("int8 keys", append(append_key=k.to(torch.int8), append_value=v.to(torch.int8))),
        ("mixed dtypes", append(append_value=v.float())),
        ("wrong head_dim", append(append_key=k[..., :32], append_value=v[..., :32])),
        ("float16 cache", append(paged_kv_cache=tuple(c.half() for c in cache))),
        ("scales of the wrong width", append(kv_cache_sf=tuple(s[..., :2] for s in sf))),
        ("bad layout", append(kv_layout="NDH")),
        (
            "position past the request's pages",
            append(positions=torch.arange(11, dtype=torch.int32) + 2),
        ),
        ("batch index out of range", append(batch_indices=torch.ones(11, dtype=torch.int32))),
        ("page id out of range", append(kv_indices=torch.tensor([0, 1, 6], dtype=torch.int32))),
        ("too few rows", slots(slot_mapping=torch.arange(12, dtype=torch.int32))),
        ("float slots", slots(slot_mapping=torch.arange(11, dtype=torch.float32))),
        (
            "strided scales",
            append(
                kv_cache_sf=tuple(
                    torch.zeros(6, 4, 2, 8, dtype=torch.float8_e4m3fn)[..., ::2] for _ in range(2)
                )
            ),
        ),
    ]
    return calls, cache, sf, (append(), slots())


def test_bad_input_refused_before_writing() -> None:
    calls, cache, sf, valid = bad_calls()
    before = [x.clone().view(torch.uint8) for x in (*cache, *sf)]
    for what, call in calls:
        with pytest.raises((ValueError, TypeError)):
            call()
        for old, new in zip(before, (*cache, *sf), strict=True):
            assert torch.equal(old, new.view(torch.uint8)), what
    # The calls they depart from are valid: each writes the pools.
    for call in valid:
        for pool, old in zip((*cache, *sf), before, strict=True):
            pool.view(torch.uint8).copy_(old)
        call()
        assert any(
            not torch.equal(old, new.view(torch.uint8))
            for old, new in zip(before, (*cache, *sf), strict=True)
        )


def test_empty_append_is_a_no_op() -> None:
    k, v, cache, sf, _ = make_append_inputs("NHD", torch.float16)
    before = [x.clone() for x in cache]
    empty = torch.empty(0, dtype=torch.int32)
    pagedkv.nvfp4_quantize_append_paged_kv_cache(
        k[:0],
        v[:0],
        empty,
        empty,
        cache,
        sf,
        empty,
        torch.zeros(1, dtype=torch.int32),
        empty,
        1.0,
        1.0,
    )
    assert all(torch.equal(a, b) for a, b in zip(before, cache, strict=True))


def test_kv_quantize_and_dequantize() -> None:
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    packed, scales = pagedkv.nvfp4_kv_quantize(x, torch.tensor([1.0]))
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32) and scales.shape == (8, 4)
    for r in range(8):  # with gs = 1 both recipes give the append's bytes
        want_p, want_s = ref_quantize_row(x[r].float().numpy(), 1.0)
        assert packed[r].tolist() == want_p and scales[r].tolist() == want_s
    out = pagedkv.nvfp4_kv_dequantize(packed, scales, torch.tensor([0.5]), torch.float16)
    want = np.stack(
        [ref_dequantize_row(packed[r].numpy(), scales[r].numpy(), 0.5) for r in range(8)]
    )
    np.testing.assert_array_equal(out.numpy(), want.astype(np.float16))
    f = nvfp4.e2m1_and_ufp8sf_scale_to_float(
        packed, scales, torch.tensor([0.5]), is_sf_swizzled_layout=False
    )
    np.testing.assert_array_equal(f.numpy(), want)
    # NumPy arrays in, float16 (the default for them) out.
    got = pagedkv.nvfp4_kv_dequantize(packed.numpy(), scales.numpy(), np.float32([0.5]))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want.astype(np.float16))
    for scale in (torch.tensor([math.nan]), torch.tensor([-1.0]), torch.ones(3)):
        with pytest.raises(ValueError, match="global_scale"):
            pagedkv.nvfp4_kv_dequantize(packed, scales, scale)
    with pytest.raises(TypeError, match="fp4_data must be packed uint8"):
        pagedkv.nvfp4_kv_dequantize(packed.float(), scales, torch.tensor([0.5]))
    with pytest.raises(NotImplementedError, match="linear"):
        nvfp4.e2m1_and_ufp8sf_scale_to_float(packed, scales)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_dequantize_paged(layout: str) -> None:
    rng = np.random.default_rng(5)
    pages, page_size, heads = 5, 3, 2
    k = rng.integers(0, 256, (pages, page_size, heads, 16), dtype=np.uint8)
    v = rng.integers(0, 256, (pages, page_size, heads, 32), dtype=np.uint8)
    ks = rng.integers(1, 120, (pages, page_size, heads, 2), dtype=np.uint8)
    vs = rng.integers(1, 120, (pages, page_size, heads, 4), dtype=np.uint8)
    t = (
        (lambda a: a)
        if layout == "NHD"
        else (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
    )
    cache = (torch.from_numpy(t(k)), torch.from_numpy(t(v)))
    sf = (
        torch.from_numpy(t(ks)).view(torch.float8_e4m3fn),
        torch.from_numpy(t(vs)).view(torch.float8_e4m3fn),
    )
    table = torch.tensor([[2, 4, 1], [3, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([7, 2], dtype=torch.int32)
    out_k = torch.full((2, 8, heads, 32), 123.0, dtype=torch.bfloat16)
    out_v = torch.full((2, 8, heads, 64), 123.0, dtype=torch.bfloat16)
    scales = torch.tensor([0.5]), torch.tensor([0.25])
    pagedkv.nvfp4_kv_dequantize_paged(
        cache, sf, table, lens, *scales, out_k, out_v, kv_layout=layout
    )
    for b in range(2):
        for tok in range(8):
            for out, data, s, gs in ((out_k, k, ks, 0.5), (out_v, v, vs, 0.25)):
                if tok >= int(lens[b]):
                    assert (out[b, tok] == 123).all()
                    continue
                page = int(table[b, tok // page_size])
                for h in range(heads):
                    want = ref_dequantize_row(
                        data[page, tok % page_size, h], s[page, tok % page_size, h], gs
                    )
                    assert torch.equal(out[b, tok, h], torch.from_numpy(want).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="block_tables column count insufficient"):
        pagedkv.nvfp4_kv_dequantize_paged(
            cache, sf, table[:, :1], lens, *scales, out_k, out_v, kv_layout=layout
        )


def nvfp4_pool(pages: int, page_size: int, heads: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(
        0, 256, (pages, 2, page_size, heads, d // 2), generator=g, dtype=torch.uint8
    )
    scales = torch.randint(
        24, 64, (pages, 2, page_size, heads, d // 16), generator=g, dtype=torch.uint8
    )
    return packed, scales.view(torch.float8_e4m3fn)


def dequantized_pool(packed, scales, gs=(1.0, 1.0), dtype=torch.float16):
    parts = []
    for j in range(2):
        flat = nvfp4.dequantize_float32(
            packed[:, j].numpy(), scales[:, j].view(torch.uint8).numpy(), gs[j]
        )
        parts.append(torch.from_numpy(flat).to(dtype))
    return torch.stack(parts, dim=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_over_nvfp4_equals_dequantized(dtype: torch.dtype) -> None:
    packed, scales = nvfp4_pool(6, 4, 2, 64, 6)
    qo_indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
    kv_indices = torch.tensor([5, 1, 0, 3], dtype=torch.int32)
    last = torch.tensor([3, 4], dtype=torch.int32)
    q = torch.randn(5, 4, 64).to(dtype)
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    w.plan(
        qo_indptr,
        kv_indptr,
        kv_indices,
        last,
        4,
        2,
        64,
        4,
        causal=True,
        q_data_type=dtype,
        kv_data_type=torch.uint8,
    )
    got = w.run(q, packed, k_scale=0.5, v_scale=2.0, kv_cache_sf=scales)
    ref = pagedkv.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    ref.plan(qo_indptr, kv_indptr, kv_indices, last, 4, 2, 64, 4, causal=True, q_data_type=dtype)
    want = ref.run(q, dequantized_pool(packed, scales, (0.5, 2.0), torch.float32).to(dtype))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # The global scales folded into k_scale / v_scale give the same as the
    # exact e2m1 * e4m3 values with those scales.
    exact = ref.run(q, dequantized_pool(packed, scales, dtype=dtype), k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(got, exact, rtol=0, atol=0)


def test_decode_and_ragged_over_nvfp4() -> None:
    packed, scales = nvfp4_pool(4, 4, 1, 64, 7)
    kv_indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
    kv_indices = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    last = torch.tensor([2, 4], dtype=torch.int32)
    q = torch.randn(2, 2, 64).half()
    dq = dequantized_pool(packed, scales)
    for tc in (False, True):
        w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD", use_tensor_cores=tc)
        w.plan(
            kv_indptr,
            kv_indices,
            last,
            2,
            1,
            64,
            4,
            q_data_type=torch.float16,
            kv_data_type=torch.uint8,
        )
        got = w.run(q, packed, k_scale=1.0, v_scale=1.0, kv_cache_sf=scales)
        w.plan(kv_indptr, kv_indices, last, 2, 1, 64, 4, q_data_type=torch.float16)
        torch.testing.assert_close(got, w.run(q, dq), rtol=0, atol=0)
    # Ragged: K/V rows [tokens, H, D // 2] with (k_sf, v_sf).
    k, v = packed[:2, 0].reshape(8, 1, 32), packed[:2, 1].reshape(8, 1, 32)
    ks = scales[:2, 0].reshape(8, 1, 4)
    vs = scales[:2, 1].reshape(8, 1, 4)
    qo = torch.tensor([0, 1, 2], dtype=torch.int32)
    kvp = torch.tensor([0, 5, 8], dtype=torch.int32)
    r = pagedkv.BatchPrefillWithRaggedKVCacheWrapper(kv_layout="NHD")
    r.plan(qo, kvp, 2, 1, 64, q_data_type=torch.float16, kv_data_type=torch.uint8)
    got = r.run(q, k, v, kv_cache_sf=(ks, vs))
    r.plan(qo, kvp, 2, 1, 64, q_data_type=torch.float16)
    want = r.run(q, dq[:2, 0].reshape(8, 1, 64), dq[:2, 1].reshape(8, 1, 64))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # single_prefill_with_kv_cache: the same K/V, global scales on top.
    single = pagedkv.single_prefill_with_kv_cache(
        q, k, v, k_scale=0.5, v_scale=2.0, kv_cache_sf=(ks, vs)
    )
    plain = pagedkv.single_prefill_with_kv_cache(
        q, dq[:2, 0].reshape(8, 1, 64), dq[:2, 1].reshape(8, 1, 64), k_scale=0.5, v_scale=2.0
    )
    torch.testing.assert_close(single, plain, rtol=0, atol=0)


def test_attention_refuses_strided_scales() -> None:
    packed, scales = nvfp4_pool(2, 4, 1, 64, 8)
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    w.plan(
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int32),
        1,
        1,
        64,
        4,
        q_data_type=torch.float16,
        kv_data_type=torch.uint8,
    )
    wide = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e4m3fn)[..., ::2]
    with pytest.raises(ValueError, match="innermost stride must be 1"):
        w.run(torch.randn(1, 1, 64).half(), (packed[:, 0], packed[:, 1]), kv_cache_sf=(wide, wide))
