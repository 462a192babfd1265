"""merge_state, merge_state_in_place and merge_states (FlashInfer's cascade
merges) against a float64 reference, on the CPU and on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from conftest import as_f64, cast, to_device


def merge_reference(v: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 merge of v [N, S, H, D], s [N, S, H]: weights 2^s, normalised
    over the states of each row; a row of empty states gives 0, -inf."""
    v64, s64 = np.asarray(v, np.float64), np.asarray(s, np.float64)
    top = s64.max(axis=1, keepdims=True)
    w = np.exp2(s64 - np.where(np.isfinite(top), top, 0))
    total = w.sum(axis=1)
    want_v = (w[..., None] * v64).sum(axis=1) / np.maximum(total, 1e-300)[..., None]
    with np.errstate(divide="ignore"):
        want_s = np.where(total > 0, np.log2(total) + top[:, 0], -np.inf)
    return want_v, want_s


def check_merges(head_dim: int, device: str = "cpu") -> None:
    """merge_states against the float64 reference, and merge_state and
    merge_state_in_place against merge_states, on device ("cpu": NumPy, the
    pairwise inputs as strided views; "cuda": torch tensors)."""
    rng = np.random.default_rng(9)
    v = rng.standard_normal((5, 3, 2, head_dim), dtype=np.float32)
    s = rng.standard_normal((5, 3, 2), dtype=np.float32) * 4
    s[0, :, 0] = -np.inf  # a row with no keys at all
    s[1, 1, :] = -np.inf  # one empty state among others

    def on(x: np.ndarray):
        return x if device == "cpu" else to_device(np.ascontiguousarray(x), device)

    out_v, out_s = pagedkv.merge_states(on(v), on(s))
    out_v, out_s = as_f64(out_v), as_f64(out_s)
    want_v, want_s = merge_reference(v, s)
    np.testing.assert_allclose(out_v, want_v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_s, want_s, rtol=1e-5, atol=1e-5)
    assert out_s[0, 0] == -np.inf and (out_v[0, 0] == 0).all()
    # Pairwise merges agree with the S-way merge.
    a_v, a_s = pagedkv.merge_state(on(v[:, 0]), on(s[:, 0]), on(v[:, 1]), on(s[:, 1]))
    pagedkv.merge_state_in_place(
        a_v, a_s, on(np.ascontiguousarray(v[:, 2])), on(np.ascontiguousarray(s[:, 2]))
    )
    np.testing.assert_allclose(as_f64(a_v), out_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(as_f64(a_s)[1:], out_s[1:], rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 300])  # 300: two slices, the second not whole vectors
def test_merge_states_match_reference(head_dim):
    check_merges(head_dim)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merges_of_many_rows_match_reference(dtype):
    """Enough rows for the CPU to split them into several tasks (blocks of
    rows), in float32 and in bfloat16 (rounded on the way out)."""
    rng = np.random.default_rng(11)
    v32 = rng.standard_normal((64, 4, 8, 128), dtype=np.float32)
    s = rng.standard_normal((64, 4, 8), dtype=np.float32) * 4
    s[3, :, 5] = -np.inf
    v = cast(v32, dtype)
    tol = 1e-5 if dtype == "float32" else 1e-2
    out_v, out_s = pagedkv.merge_states(v, s)
    want_v, want_s = merge_reference(as_f64(v), s)
    np.testing.assert_allclose(as_f64(out_v), want_v, rtol=tol, atol=tol)
    np.testing.assert_allclose(out_s, want_s, rtol=1e-5, atol=1e-5)
    # In place, state 0 absorbs state 1 row by row: [64 * 8] rows of [128].
    a_v, a_s = cast(np.ascontiguousarray(v32[:, 0]), dtype), s[:, 0].copy()
    b_v, b_s = cast(np.ascontiguousarray(v32[:, 1]), dtype), s[:, 1].copy()
    pagedkv.merge_state_in_place(a_v, a_s, b_v, b_s)
    want_v, want_s = merge_reference(as_f64(v)[:, :2], s[:, :2])
    np.testing.assert_allclose(as_f64(a_v), want_v, rtol=tol, atol=tol)
    np.testing.assert_allclose(a_s, want_s, rtol=1e-5, atol=1e-5)


def test_split_decode_equals_merge_of_halves():
    """Cascade use: attention over a prefix and over a suffix, merged, equals
    attention over the whole sequence (FlashInfer's merge_state contract)."""
    rng = np.random.default_rng(21)
    k = rng.standard_normal((500, 2, 128), dtype=np.float32)
    v = rng.standard_normal((500, 2, 128), dtype=np.float32)
    q = rng.standard_normal((8, 128), dtype=np.float32)
    o_all, s_all = pagedkv.single_decode_with_kv_cache(q, k, v, return_lse=True)
    # Half-sequence states: the same q over the first 200 and the last 300 keys
    # (no causal mask in decode: the query sees all of them).
    o_a, s_a = pagedkv.single_decode_with_kv_cache(q, k[:200], v[:200], return_lse=True)
    o_b, s_b = pagedkv.single_decode_with_kv_cache(q, k[200:], v[200:], return_lse=True)
    o, s = pagedkv.merge_state(o_a[None], s_a[None], o_b[None], s_b[None])
    np.testing.assert_allclose(o[0], o_all, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s[0], s_all, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 300])
def test_merges_on_gpu(head_dim):
    check_merges(head_dim, device="cuda")
