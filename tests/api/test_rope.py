"""pagedkv.rope (FlashInfer's flashinfer.rope) against float64 NumPy
references written here: NeoX and interleaved pairs, partial rotary dims,
ragged and per-token positions, Llama 3.1's frequencies, vLLM's cos/sin
cache, float8 outputs and the paged append; refusals before any write.
Angles are float32, as FlashInfer's, so positions in the thousands carry
absolute errors near 1e-4 (the tolerance is FlashInfer's 1e-3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedkv import rope


def rotate_ref(x, pos, rotary_dim, interleave, freqs):
    """x [nnz, H, D] float64 rotated at positions pos [nnz]."""
    out = x.astype(np.float64).copy()
    ang = pos[:, None].astype(np.float64) * freqs[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if interleave:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = a * c - b * s
        out[..., 1:rotary_dim:2] = b * c + a * s
    else:
        h = rotary_dim // 2
        a, b = x[..., :h], x[..., h:rotary_dim]
        out[..., :h] = a * c - b * s
        out[..., h:rotary_dim] = b * c + a * s
    return out


def freqs_ref(rotary_dim, scale, theta):
    return theta ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim) / scale


def llama31_ref(rotary_dim, scale, theta, low, high, old):
    out = []
    for f in theta ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim):
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / scale)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / scale + smooth * f)
    return np.array(out)


def qk(nnz=7, hq=4, hk=2, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nnz, hq, d, generator=g).to(dtype), torch.randn(nnz, hk, d, generator=g).to(
        dtype
    )


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("llama31", [False, True])
def test_pos_ids_and_ragged_forms_match_float64(interleave, rotary_dim, llama31):
    q, k = qk()
    pos = np.array([0, 3, 17, 100, 2000, 5, 9000])
    if llama31:
        freqs = llama31_ref(rotary_dim, 8, 5e5, 1, 4, 8192)
        by_ids = rope.apply_llama31_rope_pos_ids(q, k, torch.tensor(pos), rotary_dim, interleave)
    else:
        freqs = freqs_ref(rotary_dim, 2.0, 1e4)
        by_ids = rope.apply_rope_pos_ids(q, k, torch.tensor(pos), rotary_dim, interleave, 2.0)
    for got, x in zip(by_ids, (q, k), strict=True):
        want = rotate_ref(x.double().numpy(), pos, rotary_dim, interleave, freqs)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-3, atol=1e-3)
    # The same rows as two ragged requests: positions offsets[b] + j.
    indptr, offsets = torch.tensor([0, 3, 7]), torch.tensor([0, 100])
    ragged_pos = np.array([0, 1, 2, 100, 101, 102, 103])
    fn = rope.apply_llama31_rope if llama31 else rope.apply_rope
    kwargs = {} if llama31 else {"rope_scale": 2.0}
    q2, k2 = q.clone(), k.clone()
    got_q, _ = fn(q, k, indptr, offsets, rotary_dim, interleave, **kwargs)
    want = rotate_ref(q.double().numpy(), ragged_pos, rotary_dim, interleave, freqs)
    np.testing.assert_allclose(got_q.double().numpy(), want, rtol=1e-3, atol=1e-3)
    inplace = rope.apply_llama31_rope_inplace if llama31 else rope.apply_rope_inplace
    assert inplace(q2, k2, indptr, offsets, rotary_dim, interleave, **kwargs) is None
    assert torch.equal(q2, got_q)


def test_cos_sin_cache_form_is_vllms():
    q, k = qk(nnz=5, d=32)
    rotary_dim, max_pos = 16, 64
    freqs = freqs_ref(rotary_dim, 1.0, 1e4)
    ang = np.arange(max_pos)[:, None] * freqs[None, :]
    cache = torch.tensor(np.concatenate([np.cos(ang), np.sin(ang)], axis=1), dtype=torch.float32)
    pos = np.array([1, 2, 3, 40, 63])
    query, key = q.reshape(5, -1), k.reshape(5, -1)
    for neox in (True, False):
        got_q, got_k = rope.apply_rope_with_cos_sin_cache(
            torch.tensor(pos), query, key, 32, cache, neox
        )
        assert got_q.shape == query.shape
        want = rotate_ref(q.double().numpy(), pos, rotary_dim, not neox, freqs)
        np.testing.assert_allclose(got_q.reshape(5, 4, 32).numpy(), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 64\)"):
        rope.apply_rope_with_cos_sin_cache(torch.tensor([64] * 5), query, key, 32, cache)


def test_quantized_append_writes_fp8_pages_and_skips_padding():
    q, k = qk(nnz=3, hq=2, hk=1, d=16, dtype=torch.bfloat16)
    v = torch.randn(3, 1, 16).to(torch.bfloat16)
    cache = torch.tensor(
        np.concatenate([np.ones((8, 8)), np.zeros((8, 8))], 1), dtype=torch.float32
    )
    k_cache = torch.zeros(4, 4, 1, 16, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q_r, q_n = rope.rope_quantize_fp8_append_paged_kv_cache(
        q[..., :16], k[..., :16], None, None, v, cache, i32(0, 1, 0),
        (k_cache, v_cache), i32(2, 3), i32(0, 1, 2), i32(0, 1, -1), i32(0, 1, 0),
        page_size=4, quant_scale_kv=0.5,
    )  # fmt: skip
    assert q_r.dtype == torch.float8_e4m3fn and q_n.shape == (3, 2, 0)
    # Position 0 of request 0 is page 2 slot 0; of request 1, page 3 slot 1.
    want_k = (k[0, 0].float() * 0.5).to(torch.float8_e4m3fn)
    assert torch.equal(k_cache[2, 0, 0], want_k)
    assert torch.equal(v_cache[3, 1, 0], (v[1, 0].float() * 0.5).to(torch.float8_e4m3fn))
    # The padding row (-1) wrote nothing: only two slots are non-zero.
    assert int((k_cache.float().abs().sum(-1) > 0).sum()) == 2
    before = k_cache.clone()
    with pytest.raises(ValueError, match="past its request's pages"):
        rope.rope_quantize_fp8_append_paged_kv_cache(
            q[..., :16], k[..., :16], None, None, v, cache, i32(0, 1, 0),
            (k_cache, v_cache), i32(2, 3), i32(0, 1, 2), i32(0, 1, 1), i32(0, 4, 0),
            page_size=4,
        )  # fmt: skip
    assert torch.equal(k_cache, before)


def test_bad_page_tables_and_caches_are_refused_before_any_write():
    """A page table or cache the append cannot address raises before the
    queries' outputs or a page are written."""
    q, k = qk(nnz=2, hq=2, hk=1, d=16, dtype=torch.bfloat16)
    v = torch.randn(2, 1, 16).to(torch.bfloat16)
    cache = torch.ones(8, 16, dtype=torch.float32)
    k_cache = torch.zeros(4, 4, 1, 16, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    q_out = torch.zeros(2, 2, 16, dtype=torch.float8_e4m3fn)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731

    table = i32(0, 1, 2)

    def append(kv_indptr=table, page_size=4, caches=(k_cache, v_cache)):
        rope.rope_quantize_fp8_append_paged_kv_cache(
            q[..., :16], k[..., :16], None, None, v, cache, i32(0, 1), caches,
            i32(2, 3), kv_indptr, i32(1, 1), i32(0, 1), page_size=page_size,
            q_rope_out=q_out,
        )  # fmt: skip

    cases = [
        (dict(kv_indptr=i32(-2, 1, 2)), "kv_indptr must start at 0"),
        (dict(kv_indptr=i32(0, 1, 3)), "end within kv_indices"),
        (dict(page_size=16), "page_size is 16"),
        (dict(caches=(k_cache[..., :8], v_cache[..., :8])), "slots are"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            append(**changes)
        assert not q_out.float().any() and not k_cache.float().any(), message
    append()  # the call they depart from writes
    assert q_out.float().any() and k_cache.float().any()


def test_bad_input_is_refused():
    q, k = qk()
    with pytest.raises(ValueError, match="rotary_dim"):
        rope.apply_rope_pos_ids(q, k, torch.arange(7), rotary_dim=65)
    with pytest.raises(ValueError, match=r"pos_ids must be \[7\]"):
        rope.apply_rope_pos_ids(q, k, torch.arange(6))
    with pytest.raises(ValueError, match="indptr must rise"):
        rope.apply_rope(q, k, torch.tensor([0, 8]), torch.tensor([0]))
    with pytest.raises(ValueError, match="float32"):
        rope.rope_quantize_fp8(
            q, k, None, None, torch.zeros(4, 64, dtype=torch.float16), torch.arange(7)
        )
    with pytest.raises(TypeError):
        rope.apply_rope_pos_ids(q.numpy(), k, torch.arange(7))


def test_quantize_checks_every_output_before_writing_one():
    q, k = qk(nnz=2, hq=2, hk=1, d=8, dtype=torch.float16)
    cache = torch.ones(4, 8, dtype=torch.float32)
    q_out = torch.zeros(2, 2, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_rope_out"):
        rope.rope_quantize_fp8(
            q, k, None, None, cache, torch.arange(2), q_rope_out=q_out,
            k_rope_out=torch.zeros(2, 1, 4, dtype=torch.float8_e4m3fn),
        )  # fmt: skip
    assert not q_out.float().any()
