"""FlashInfer's block-table entry points against a float64 reference that
reads each request's tokens straight out of its block-table row."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from conftest import flashinfer_serves, parameter_names

torch = pytest.importorskip("torch")


def reference(q, cache, layout, table, seq_lens, q_lens, sm_scale, v_scale, causal, window_left):
    """float64 attention: request b's keys are tokens 0..seq_lens[b]-1 of the
    pages table[b] names; its q_lens[b] queries sit at the sequence's end."""
    k_pages, v_pages = cache[:, 0].double(), cache[:, 1].double()
    if layout == "HND":
        k_pages, v_pages = k_pages.transpose(1, 2), v_pages.transpose(1, 2)
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // kv_heads
    out, row = [], 0
    for b, (n, qn) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pages = table[b, : -(-n // page_size)]
        k = k_pages[pages].reshape(-1, kv_heads, k_pages.shape[-1])[:n]
        v = v_pages[pages].reshape(-1, kv_heads, v_pages.shape[-1])[:n]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        qb = q[row : row + qn].double()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale
        q_pos = torch.arange(n - qn, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        allowed = torch.ones(qn, n, dtype=torch.bool)
        if causal:
            allowed &= k_pos <= q_pos
        if window_left >= 0:
            allowed &= q_pos - k_pos <= window_left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v) * v_scale)
        row += qn
    return torch.cat(out)


def make_case(seed, layout, seq_lens, q_lens, page_size=16, kv_heads=2, group=4, dim=64):
    gen = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // page_size) for n in seq_lens]
    width = max(pages_each) + 1
    num_pages = sum(pages_each) + 3
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seq_lens), width), 0, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_each):
        table[b, :n] = order[used : used + n]
        used += n
    shape = (num_pages, 2, page_size, kv_heads, dim) if layout == "NHD" else (
        num_pages, 2, kv_heads, page_size, dim)  # fmt: skip
    cache = torch.randn(shape, generator=gen)
    q = torch.randn(sum(q_lens), kv_heads * group, dim, generator=gen)
    return q, cache, table


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_trtllm_decode_equals_reference(layout, q_len):
    seq_lens = [37, 16, 5, 100]
    q, cache, table = make_case(1, layout, seq_lens, [q_len] * 4)
    sm_scale, v_scale = 0.11, 0.7
    counters = torch.zeros(4 * 8 * 4, dtype=torch.uint8)  # FlashInfer's size: 4 requests x 8 heads
    o, lse = pagedkv.trtllm_batch_decode_with_kv_cache(
        q, cache, None, table, torch.tensor(seq_lens, dtype=torch.int32), 128,
        bmm1_scale=sm_scale, bmm2_scale=v_scale, kv_layout=layout,
        q_len_per_req=q_len, return_lse=True, multi_ctas_kv_counter_buffer=counters,
    )  # fmt: skip
    assert not counters.any()
    want = reference(q, cache, layout, table, seq_lens, [q_len] * 4, sm_scale, v_scale, True, -1)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)
    assert lse.shape == (q.shape[0], q.shape[1])


def test_trtllm_decode_ragged_queries_window_and_scale_log2():
    seq_lens, q_lens = [40, 9, 70], [2, 1, 4]
    q, cache, table = make_case(2, "HND", seq_lens, q_lens)
    sm_scale = 0.125
    o = pagedkv.trtllm_batch_decode_with_kv_cache(
        q, cache, None, table, torch.tensor(seq_lens), 80, bmm2_scale=torch.tensor(1.0),
        window_left=20, max_q_len=4, cum_seq_lens_q=torch.tensor([0, 2, 3, 7]),
        bmm1_scale_log2=torch.tensor(sm_scale * np.log2(np.e)),
    )  # fmt: skip
    want = reference(q, cache, "HND", table, seq_lens, q_lens, sm_scale, 1.0, True, 20)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)


def test_xqa_decode_equals_reference():
    seq_lens = [33, 64]
    q, cache, table = make_case(3, "NHD", seq_lens, [1, 1])
    o = pagedkv.xqa_batch_decode_with_kv_cache(
        q, cache, None, table, torch.tensor(seq_lens), 64, bmm1_scale=0.2
    )
    want = reference(q, cache, "NHD", table, seq_lens, [1, 1], 0.2, 1.0, True, -1)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)


def test_trtllm_interleaved_kv_pool_fp8_query_and_a_given_lse():
    """TRT-LLM's separate K and V tables over its interleaved pool (K page
    2p, V page 2p + 1: the one-tensor cache seen whole); an fp8 query and
    cache, the output in the query's dtype unless out_dtype says otherwise;
    a given lse filled without return_lse (only o returned)."""
    seq_lens = [37, 16, 70]
    q, cache, table = make_case(9, "HND", seq_lens, [1, 1, 1])
    pool = cache.reshape(cache.shape[0] * 2, *cache.shape[2:])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    lse = torch.full((3, q.shape[1]), float("nan"))
    o = pagedkv.trtllm_batch_decode_with_kv_cache(
        q, (pool, pool), None, torch.stack([2 * table, 2 * table + 1], dim=1), lens, 80,
        bmm1_scale=0.1, uses_shared_paged_kv_idx=False, lse=lse,
    )  # fmt: skip
    want = reference(q, cache, "HND", table, seq_lens, [1, 1, 1], 0.1, 1.0, True, -1)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)
    assert torch.isfinite(lse).all()
    q8, cache8 = q.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn)
    want8 = reference(q8.float(), cache8.float(), "HND", table, seq_lens, [1] * 3, 0.1, 1.0,
                      True, -1)  # fmt: skip
    for out_dtype, tol in ((None, 0.1), (torch.bfloat16, 2e-2)):
        o8 = pagedkv.trtllm_batch_decode_with_kv_cache(
            q8, cache8, None, table, lens, 80, bmm1_scale=0.1, out_dtype=out_dtype
        )
        assert o8.dtype == (out_dtype or torch.float8_e4m3fn)
        torch.testing.assert_close(o8.double(), want8, atol=tol, rtol=tol)


def packed_draft_mask(rows: np.ndarray) -> torch.Tensor:
    """FlashInfer's packed draft mask of bool rows [B, q, q]: bit j of row i
    in little-endian uint32 words, handed over as uint16 (its tests' form)."""
    batch, q_len, _ = rows.shape
    padded = np.zeros((batch, q_len, -(-q_len // 32) * 32), bool)
    padded[..., :q_len] = rows
    return torch.from_numpy(np.packbits(padded, axis=-1, bitorder="little").view(np.uint16))


@pytest.mark.parametrize("kind", ["causal", "full"])
def test_xqa_draft_mask_causal_or_full_and_any_o_scale(kind):
    """XQA's speculative-decode mask: causal draft rows, or full ones (every
    draft sees every draft); o_scale leaves the stored output bmm2 x attention."""
    seq_lens, q_len = [40, 70], 3
    q, cache, table = make_case(8, "NHD", seq_lens, [q_len, q_len])
    rows = (
        np.tril(np.ones((q_len, q_len), bool))
        if kind == "causal"
        else np.ones((q_len, q_len), bool)
    )
    o = pagedkv.xqa_batch_decode_with_kv_cache(
        q, cache, None, table, torch.tensor(seq_lens), 70, bmm1_scale=0.1, bmm2_scale=0.5,
        q_len_per_req=q_len, o_scale=0.7, mask=packed_draft_mask(np.stack([rows, rows])),
    )  # fmt: skip
    want = reference(q, cache, "NHD", table, seq_lens, [q_len] * 2, 0.1, 0.5, kind == "causal", -1)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)
    ragged = [2, 1]  # q_cu_seq_lens: a [tokens, words] mask, each request's rows in turn
    q_ragged = q[: sum(ragged)]
    flat = np.zeros((1, sum(ragged), q_len), bool)
    flat[0, :2, :2], flat[0, 2, :1] = rows[:2, :2], True
    o = pagedkv.xqa_batch_decode_with_kv_cache(
        q_ragged, cache, None, table, torch.tensor(seq_lens), 70, bmm1_scale=0.1,
        q_len_per_req=2, mask=packed_draft_mask(flat)[0],
        q_cu_seq_lens=torch.tensor([0, 2, 3], dtype=torch.int32),
    )  # fmt: skip
    want = reference(
        q_ragged, cache, "NHD", table, seq_lens, ragged, 0.1, 1.0, kind == "causal", -1
    )
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)
    tree = np.stack([rows, np.eye(q_len, dtype=bool)])
    with pytest.raises(ValueError, match="tree masks"):
        pagedkv.xqa_batch_decode_with_kv_cache(
            q, cache, None, table, torch.tensor(seq_lens), 70, q_len_per_req=q_len,
            mask=packed_draft_mask(tree),
        )  # fmt: skip


@pytest.mark.parametrize("causal", [True, False])
def test_trtllm_context_equals_reference(causal):
    seq_lens, q_lens = [50, 17, 8], [50, 5, 8]
    q, cache, table = make_case(4, "HND", seq_lens, q_lens)
    o = pagedkv.trtllm_batch_context_with_kv_cache(
        q, cache, None, table, torch.tensor(seq_lens), 50, 50, 0.1, 0.5, 3,
        torch.tensor([0, 50, 55, 63]), torch.tensor([0, 50, 67, 75]), causal=causal,
        out_dtype=torch.float64,
    )  # fmt: skip
    want = reference(q, cache, "HND", table, seq_lens, q_lens, 0.1, 0.5, causal, -1)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, want, atol=2e-5, rtol=2e-5)


def test_csr_from_block_tables_reads_only_the_used_columns():
    t = pagedkv.csr_from_block_tables(
        np.array([[7, 8, 9], [4, 5, 6], [1, 2, 3]]), np.array([33, 0, 16]), 16
    )
    assert t.indptr.tolist() == [0, 3, 3, 4]
    assert t.indices.tolist() == [7, 8, 9, 1]
    assert t.last_page_len.tolist() == [1, 0, 16]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_lens": torch.tensor([40, 200])}, "past the block table"),
        ({"seq_lens": torch.tensor([40, -1])}, "negative"),
        ({"sinks": [torch.zeros(4)]}, "sinks"),
        ({"uses_shared_paged_kv_idx": False}, "separate K and V"),
        ({"out_dtype": "nvfp4"}, "NVFP4"),
        ({"out_dtype": "nvfp4", "o_sf_scale": 300.0}, "FP4Tensor"),
        ({"o_sf_scale": 300.0}, "o_sf_scale"),
        ({"bmm1_scale": float("nan")}, "finite"),
        ({"kv_layout": "NCHW"}, "kv_layout"),
        ({"block_tables": torch.zeros(2, 3)}, "integer"),
        ({"multi_ctas_kv_counter_buffer": torch.zeros(8, dtype=torch.uint8)}, "too small"),
        ({"multi_ctas_kv_counter_buffer": torch.zeros(128, 2)[:, 0]}, "contiguous"),
    ],
)
def test_bad_block_table_calls_raise_before_writing(change, message):
    q, cache, table = make_case(5, "HND", [40, 20], [1, 1])
    out = torch.full_like(q, 7.0)
    args = {"seq_lens": torch.tensor([40, 20]), "block_tables": table, "out": out} | change
    with pytest.raises(ValueError, match=message):
        pagedkv.trtllm_batch_decode_with_kv_cache(q, cache, None, max_seq_len=64, **args)
    assert bool((out == 7.0).all())


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


def linear_scales(swizzled, rows, blocks):
    """The [rows, blocks] block scales of a 128x4-swizzled [R, C] scale
    tensor, unswizzled with reshapes (as FlashInfer's tests read them)."""
    full_rows, cols = swizzled.shape
    tiles = swizzled.reshape(full_rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(full_rows, cols)[rows, :blocks].float()


@pytest.mark.parametrize("start", [None, 37])
def test_trtllm_nvfp4_output_decodes_to_the_attention(start):
    """out_dtype="nvfp4": each block of 16 values of a token's row has the
    e4m3 scale of amax * o_sf_scale / 6 (to within e4m3's rounding), and
    e2m1 * scale / o_sf_scale is the float32 output to within half the
    widest e2m1 step (1) of that scale; an FP4Tensor given as out is written
    from its scale_start_index, its other scale rows left as they were."""
    q, cache, table = make_case(6, "HND", [40, 20, 33], [1, 1, 1])
    args = (q, cache, None, table, torch.tensor([40, 20, 33]), 64)
    exact = pagedkv.trtllm_batch_decode_with_kv_cache(*args, bmm1_scale=0.125)
    out = None
    if start is not None:
        scale = torch.full((256, 32), 0.5).to(torch.float8_e4m3fn)
        out = pagedkv.nvfp4.FP4Tensor(torch.zeros(3, 8, 32, dtype=torch.uint8), scale, start)
    o = pagedkv.trtllm_batch_decode_with_kv_cache(
        *args, bmm1_scale=0.125, out=out, out_dtype="nvfp4", o_sf_scale=300.0
    )
    first = o.scale_start_index
    assert first == (start or 0) and (out is None or o is out)
    scales = linear_scales(o.scale, slice(first, first + 3), 32)
    blocks = exact.reshape(3, 32, 16)
    want_scales = blocks.abs().amax(-1) * 300.0 / 6
    torch.testing.assert_close(scales, want_scales, rtol=1 / 8, atol=2**-9)
    codes = torch.stack([o.data & 0xF, o.data >> 4], -1).reshape(3, 32, 16).long()
    decoded = E2M1[codes] * scales[..., None] / 300.0
    assert bool(((decoded - blocks).abs() <= scales[..., None] / 300.0 + 1e-6).all())
    if out is not None:
        rest = torch.ones(256, dtype=torch.bool)
        rest[first : first + 3] = False
        untouched = linear_scales(o.scale, rest, 32)
        assert bool((untouched == 0.5).all())


def decode_fp4(packed, scales):
    """e2m1 codes [..., D // 2] times their block scales (float8 [..., D // 16])."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    values = E2M1[codes.long()].reshape(*scales.shape, 16)
    return (values * scales.float()[..., None]).reshape(codes.shape)


def unswizzle_v_scales(stored, layout):
    """TRT-LLM's V scales as FlashInfer documents them: in each page's and
    head's [P, S] tile, linear [t, s] sits at (t // 4) * 4 * S + s * 4 + t % 4."""
    tiles = stored if layout == "HND" else stored.transpose(1, 2)
    pages, heads, page_size, blocks = tiles.shape
    t = torch.arange(page_size)[:, None]
    s = torch.arange(blocks)[None, :]
    where = (t // 4) * 4 * blocks + s * 4 + t % 4
    linear = tiles.reshape(pages, heads, -1)[:, :, where.reshape(-1)].reshape(tiles.shape)
    return linear if layout == "HND" else linear.transpose(1, 2)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_trtllm_decode_over_flashinfers_nvfp4_cache(layout):
    """nvfp4_quantize_paged_kv_cache's cache (V's scales in TRT-LLM's
    layout), its global decode scales folded into bmm1 and bmm2 as
    FlashInfer's callers do: the float64 attention of the cache it decodes to."""
    seq_lens = [40, 20, 33]
    q, cache, table = make_case(7, layout, seq_lens, [1, 1, 1])
    (k, v), (k_sf, v_sf), k_dec, v_dec = pagedkv.nvfp4_quantize_paged_kv_cache(
        cache[:, 0], cache[:, 1], kv_layout=layout
    )
    k_float = decode_fp4(k, k_sf) * k_dec
    v_float = decode_fp4(v, unswizzle_v_scales(v_sf, layout)) * v_dec
    assert (k_float - cache[:, 0]).abs().max() < 0.5  # a coarse check of the decode itself
    o = pagedkv.trtllm_batch_decode_with_kv_cache(
        q, (k, v), None, table, torch.tensor(seq_lens), 64, bmm1_scale=0.125 * k_dec,
        bmm2_scale=v_dec, kv_layout=layout, kv_cache_sf=(k_sf, v_sf),
    )  # fmt: skip
    decoded = torch.stack([k_float, v_float], 1)
    want = reference(q, decoded, layout, table, seq_lens, [1, 1, 1], 0.125, 1.0, True, -1)
    torch.testing.assert_close(o, want.float(), atol=2e-5, rtol=2e-5)
    # TRT-LLM's interleaved pool (K page 2p, V page 2p + 1), scales alike.
    pool = torch.stack([k, v], 1).flatten(0, 1)
    sf_pool = torch.stack([k_sf, v_sf], 1).flatten(0, 1)
    o_pool = pagedkv.trtllm_batch_decode_with_kv_cache(
        q, (pool, pool), None, torch.stack([2 * table, 2 * table + 1], 1),
        torch.tensor(seq_lens), 64, bmm1_scale=0.125 * k_dec, bmm2_scale=v_dec,
        kv_layout=layout, kv_cache_sf=(sf_pool, sf_pool), uses_shared_paged_kv_idx=False,
    )  # fmt: skip
    torch.testing.assert_close(o_pool, want.float(), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="one pool"):
        pagedkv.trtllm_batch_decode_with_kv_cache(
            q, (pool, pool), None, torch.stack([2 * table, 2 * table + 1], 1),
            torch.tensor(seq_lens), 64, kv_layout=layout,
            kv_cache_sf=(sf_pool, sf_pool.clone()), uses_shared_paged_kv_idx=False,
        )  # fmt: skip


FLASHINFER_0_7_PARAMETERS = {
    "trtllm_batch_decode_with_kv_cache": (
        "query kv_cache workspace_buffer block_tables seq_lens max_seq_len bmm1_scale "
        "bmm2_scale window_left out out_dtype o_sf_scale o_sf_vec_size sinks kv_layout "
        "enable_pdl backend q_len_per_req o_scale mask max_q_len cum_seq_lens_q "
        "skip_softmax_threshold_scale_factor kv_cache_sf uses_shared_paged_kv_idx lse "
        "return_lse bmm1_scale_log2 multi_ctas_kv_counter_buffer enable_block_sparse_attention "
        "cp_world cp_rank causal_seqlens_kv_global bf16q_fp8kv_transform_mode request_order "
        "request_order_plan"
    ),
    "xqa_batch_decode_with_kv_cache": (
        "query kv_cache workspace_buffer block_tables seq_lens max_seq_len bmm1_scale "
        "bmm2_scale window_left out sinks kv_layout enable_pdl q_len_per_req o_scale mask "
        "kv_cache_sf q_cu_seq_lens"
    ),
    "trtllm_batch_context_with_kv_cache": (
        "query kv_cache workspace_buffer block_tables seq_lens max_q_len max_kv_len bmm1_scale "
        "bmm2_scale batch_size cum_seq_lens_q cum_seq_lens_kv window_left out out_dtype "
        "o_sf_scale o_sf_vec_size kv_layout enable_pdl sinks kv_cache_sf "
        "skip_softmax_threshold_scale_factor uses_shared_paged_kv_idx causal lse return_lse "
        "multi_ctas_kv_counter_buffer use_fp16_softmax uses_spcompress backend"
    ),
}
"""The parameters of FlashInfer 0.7.2's functions (flashinfer/decode.py and
prefill.py of its wheel), in order, so positional calls land where they do there."""


@pytest.mark.parametrize("name", sorted(FLASHINFER_0_7_PARAMETERS))
def test_block_table_functions_take_flashinfers_positional_order(name):
    assert parameter_names(getattr(pagedkv, name)) == FLASHINFER_0_7_PARAMETERS[name].split()


def test_import_flashinfer_serves_the_block_table_functions():
    for module, name in [
        ("flashinfer.decode", "trtllm_batch_decode_with_kv_cache"),
        ("flashinfer.decode", "xqa_batch_decode_with_kv_cache"),
        ("flashinfer.prefill", "trtllm_batch_context_with_kv_cache"),
    ]:
        assert flashinfer_serves(module, name), f"{module}.{name}"


def test_trtllm_ragged_attention_deepseek_equals_reference():
    """DeepSeek's non-absorbed prefill (query and key 192 wide, value 128):
    causal queries at each request's end, sinks, bmm2 on the output, the lse
    base 2 in the caller's buffer; seq_lens must be cum_seq_lens_kv's counts."""
    import reference

    rng = np.random.default_rng(10)
    q_lens, kv_lens = [3, 5], [9, 5]
    q = torch.from_numpy(rng.standard_normal((8, 4, 192), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((14, 2, 192), dtype=np.float32))
    v = torch.from_numpy(rng.standard_normal((14, 2, 128), dtype=np.float32))
    sinks = torch.from_numpy((rng.random(4) * 3).astype(np.float32))
    lse = torch.full((8, 4), float("nan"))
    args = (q, k, v, None, torch.tensor(kv_lens).view(2, 1, 1, 1), 5, 9, 0.07, 0.5, -1, 2, -1,
            torch.tensor([0, 3, 8]), torch.tensor([0, 9, 14]), None, True, True)  # fmt: skip
    o, got_lse = pagedkv.trtllm_ragged_attention_deepseek(*args, attention_sinks=sinks, lse=lse)
    assert got_lse is lse
    for b, (qs, ks) in enumerate([(slice(0, 3), slice(0, 9)), (slice(3, 8), slice(9, 14))]):
        positions = np.arange(kv_lens[b] - q_lens[b], kv_lens[b])
        want_o, want_lse = reference.attention(
            q[qs].numpy(), k[ks].numpy(), v[ks].numpy(), positions, sm_scale=0.07, v_scale=0.5,
            sinks=sinks.numpy(),
        )  # fmt: skip
        np.testing.assert_allclose(o[qs].numpy(), want_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[qs].numpy(), want_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="agree with seq_lens"):
        pagedkv.trtllm_ragged_attention_deepseek(*args[:4], torch.tensor([9, 4]), *args[5:])
    with pytest.raises(ValueError, match="NVFP4"):
        pagedkv.trtllm_ragged_attention_deepseek(*args[:9], 300.0, *args[10:])


def test_block_table_page_ids_are_refused_not_wrapped():
    """A page id int32 cannot hold, or a negative one, in the columns a
    request uses raises (a wrap to another page would read it silently);
    the columns past a request's pages may hold anything."""
    lens = np.array([5, 2])
    table = np.array([[3, 1, -1], [2, -7, 2**40]], np.int64)
    t = pagedkv.csr_from_block_tables(table, lens, 4)
    assert t.indices.tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match="does not fit in int32"):
        pagedkv.csr_from_block_tables(np.array([[2**32 + 1]]), np.array([3]), 4)
    with pytest.raises(ValueError, match="page ids are >= 0"):
        pagedkv.csr_from_block_tables(np.array([[-1]]), np.array([3]), 4)
    with pytest.raises(TypeError, match="page_size must be an integer"):
        pagedkv.csr_from_block_tables(np.array([[1]]), np.array([3]), 2.5)
