"""FlashInfer's MLA block-table entry points (trtllm_batch_decode_with_kv_cache_mla,
trtllm_prefill_with_kv_cache_mla, xqa_batch_decode_with_kv_cache_mla) against
a float64 reference that reads each request's tokens straight out of its
block-table row of the packed [ckv || kpe] cache."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pagedkv
from conftest import flashinfer_serves, parameter_names

torch = pytest.importorskip("torch")

CKV, KPE, HEADS, PAGE = 64, 16, 8, 16


def reference(q_rows, cache, table, seq_lens, q_lens, bmm1, bmm2, sinks=None):
    """float64 absorbed MLA: request b's keys are tokens 0..seq_lens[b]-1 of
    the pages table[b] names, every head scoring q . (ckv || kpe) * bmm1
    and averaging the ckv parts; its q_lens[b] queries are its last tokens,
    causal. A head's sink logit joins the softmax's denominator. Returns
    (o * bmm2 [tokens, H, CKV], base-2 lse [tokens, H])."""
    page_size, width = cache.shape[1], cache.shape[2]
    outs, lses, row = [], [], 0
    for b, (n, qn) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pages = table[b, : -(-n // page_size)]
        kv = cache[pages].reshape(-1, width)[:n].double()
        s = torch.einsum("qhd,kd->hqk", q_rows[row : row + qn].double(), kv) * bmm1
        seen = torch.arange(n)[None, :] <= torch.arange(n - qn, n)[:, None]
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink = torch.as_tensor(sinks, dtype=torch.float64)[:, None, None].expand(-1, qn, 1)
            s = torch.cat([s, sink], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None])[..., :n]
        outs.append(torch.einsum("hqk,kd->qhd", p, kv[:, :CKV]) * bmm2)
        lses.append((lse / math.log(2)).T)
        row += qn
    return torch.cat(outs), torch.cat(lses)


def make_case(seed, seq_lens, q_len, dtype=torch.float32, spare=3):
    """Shuffled pages of a packed cache, a block table one column wider than
    needed (unread entries point past the pool), and q [B, q_len, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seq_lens), max(need) + 1), num_pages + 7, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used : used + n]
        used += n
    cache = torch.randn(num_pages, PAGE, CKV + KPE, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), q_len, HEADS, CKV + KPE, generator=gen).to(dtype)
    return q, cache, table


def decode(q, cache, table, seq_lens, **kwargs):
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return pagedkv.trtllm_batch_decode_with_kv_cache_mla(
        q, cache, None, 0, CKV, KPE, table, lens, max(seq_lens), **kwargs
    )


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("four_d", [False, True])
def test_trtllm_mla_decode_equals_reference(q_len, four_d):
    """A long request whose keys split, an exact page and short ones; the
    4-D cache form; bmm2 scales the output; lse in base 2; a multi-CTA
    counter buffer taken and left zero."""
    seq_lens = [300, 16, 5, 40]
    q, cache, table = make_case(1, seq_lens, q_len)
    bmm1, bmm2 = 0.09, 0.6
    counters = torch.zeros(4 * HEADS * 4, dtype=torch.uint8)  # FlashInfer's size for 4 x 8
    o, lse = decode(
        q, cache.unsqueeze(1) if four_d else cache, table, seq_lens,
        bmm1_scale=bmm1, bmm2_scale=torch.tensor([bmm2]), return_lse=True,
        multi_ctas_kv_counter_buffer=counters,
    )  # fmt: skip
    assert not counters.any()
    want_o, want_lse = reference(
        q.reshape(-1, HEADS, CKV + KPE), cache, table, seq_lens, [q_len] * 4, bmm1, bmm2
    )
    assert o.shape == (4, q_len, HEADS, CKV) and o.dtype == torch.float32
    torch.testing.assert_close(o.reshape(-1, HEADS, CKV).double(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)


def test_ragged_queries_sinks_natural_lse_and_given_buffers():
    """cum_seq_lens_q with a max_q_len above the longest; sinks as a list of
    one tensor (trtllm-gen's form); out and a [tokens, H] lse filled in place;
    skip-softmax taken and nothing skipped (exact attention)."""
    seq_lens, q_lens = [50, 9, 33], [2, 1, 4]
    q, cache, table = make_case(2, seq_lens, 1)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(sum(q_lens), HEADS, CKV + KPE, generator=gen)
    sinks = torch.rand(HEADS, generator=gen) * 4
    out = torch.full((sum(q_lens), HEADS, CKV), float("nan"))
    lse = torch.full((sum(q_lens), HEADS), float("nan"))
    o, lse_out = decode(
        rows, cache, table, seq_lens, out=out, lse=lse, return_lse=True, bmm1_scale=0.1,
        sinks=[sinks], cum_seq_lens_q=torch.tensor([0, 2, 3, 7], dtype=torch.int32),
        max_q_len=5, return_lse_base="basee", skip_softmax_threshold_scale_factor=0.5,
    )  # fmt: skip
    assert o is out and lse_out is lse
    want_o, want_lse = reference(rows, cache, table, seq_lens, q_lens, 0.1, 1.0, sinks)
    torch.testing.assert_close(out.double(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse * math.log(2), atol=1e-4, rtol=1e-4)


def test_fp8_query_and_cache_give_bfloat16():
    """float8_e4m3fn query and cache (FlashInfer's fp8 MLA): the query is
    widened to bfloat16, the cache read as fp8; the output is bfloat16."""
    seq_lens = [70, 20]
    q, cache, table = make_case(4, seq_lens, 1)
    q8, cache8 = q.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn)
    o = decode(q8, cache8, table, seq_lens, bmm1_scale=0.1)
    assert o.dtype == torch.bfloat16
    want, _ = reference(q8.float().reshape(-1, HEADS, CKV + KPE), cache8.float(), table,
                        seq_lens, [1, 1], 0.1, 1.0)  # fmt: skip
    torch.testing.assert_close(o.reshape(-1, HEADS, CKV).double(), want, atol=2e-2, rtol=2e-2)


def test_bfloat16_and_separate_k_v_rows_that_agree():
    """bfloat16 end to end, and TRT-LLM's [B, 2, max_pages] table whose K and
    V rows agree (an MLA row is both); the prefill name is the same call."""
    seq_lens = [45, 17]
    q, cache, table = make_case(5, seq_lens, 2, torch.bfloat16)
    both = torch.stack([table, table], dim=1)
    o = decode(q, cache, both, seq_lens, bmm1_scale=0.1, uses_shared_paged_kv_idx=False)
    lens = torch.tensor(seq_lens)
    again = pagedkv.trtllm_prefill_with_kv_cache_mla(
        q, cache, None, 0, CKV, KPE, table, lens, 45, bmm1_scale=0.1
    )
    want, _ = reference(q.reshape(-1, HEADS, CKV + KPE), cache, table, seq_lens, [2, 2], 0.1, 1)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.reshape(-1, HEADS, CKV).double(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(o, again)


def test_sparse_mla_attends_the_front_of_each_rows_slots():
    """sparse_mla_top_k: block_tables holds each query row's cache slots
    (-1 padding); query i of n in a request of L tokens takes the first
    L - n + i + 1 entries, as FlashInfer's kernel does."""
    gen = torch.Generator().manual_seed(8)
    top_k, seq_lens = 8, [7, 30]
    cache = torch.randn(5, PAGE, CKV + KPE, generator=gen)
    q = torch.randn(2, 2, HEADS, CKV + KPE, generator=gen)
    slots = torch.randint(0, 5 * PAGE, (2, 2, top_k), generator=gen, dtype=torch.int32)
    slots[1, 0, 5:] = -1
    o, lse = decode(q, cache, slots, seq_lens, sparse_mla_top_k=top_k, bmm1_scale=0.1,
                    bmm2_scale=0.5, return_lse=True)  # fmt: skip
    flat = cache.reshape(-1, CKV + KPE).double()
    for b, j in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        sees = seq_lens[b] - 2 + j + 1
        keep = [int(x) for x in slots[b, j, :sees] if x >= 0]
        kv = flat[keep]
        s = torch.einsum("hd,kd->hk", q[b, j].double(), kv) * 0.1
        want = torch.softmax(s, -1) @ kv[:, :CKV] * 0.5
        torch.testing.assert_close(o[b, j].double(), want, atol=2e-5, rtol=2e-5)
        want_lse = torch.logsumexp(s, -1) / math.log(2)
        torch.testing.assert_close(lse[2 * b + j].double(), want_lse, atol=1e-4, rtol=1e-4)


def test_xqa_mla_fills_out_of_its_own_shape():
    """XQA's signature: out [B, H, kv_lora_rank] filled and returned."""
    seq_lens = [31, 64]
    q, cache, table = make_case(6, seq_lens, 1, torch.bfloat16)
    out = torch.zeros(2, HEADS, CKV, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = pagedkv.xqa_batch_decode_with_kv_cache_mla(
        q, cache.unsqueeze(1), None, 0, CKV, KPE, table, lens, 64, out=out, bmm1_scale=0.2
    )
    assert got is out
    want, _ = reference(q.reshape(-1, HEADS, CKV + KPE), cache, table, seq_lens, [1, 1], 0.2, 1)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="q_len_per_request"):
        pagedkv.xqa_batch_decode_with_kv_cache_mla(
            q.expand(2, 2, HEADS, CKV + KPE), cache, None, 0, CKV, KPE, table, lens, 64
        )


REFUSED = [
    (dict(sparse_mla_top_k=64), ValueError, "sparse MLA's block_tables"),
    (dict(sparse_mla_top_k_lens=torch.ones(2, dtype=torch.int32)), ValueError, "top_k_lens"),
    (dict(enable_dcp=True), ValueError, "enable_dcp"),
    (dict(cp_world=2), ValueError, "cp_world"),
    (dict(skip_softmax_threshold_scale_factor=-1.0), ValueError, "skip_softmax"),
    (dict(use_fp16_softmax=True), ValueError, "use_fp16_softmax"),
    (dict(multi_ctas_kv_counter_buffer=torch.zeros(4, dtype=torch.uint8)), ValueError, "small"),
    (dict(backend="cake"), ValueError, "backend"),
    (dict(bmm1_scale=0.0), ValueError, "bmm1_scale"),
    (dict(bmm2_scale=torch.tensor([1.0, 2.0])), ValueError, "bmm2_scale"),
    (dict(max_q_len=2), ValueError, "max_q_len"),
    (dict(max_seq_len=-1), ValueError, "max_seq_len"),
    (dict(max_seq_len=None), TypeError, "max_seq_len must be an integer"),
    (dict(cum_seq_lens_q=torch.tensor([0, 1, 3])), ValueError, "cum_seq_lens_q"),
    (dict(return_lse_base="log10"), ValueError, "return_lse_base"),
    (dict(backend="xqa", return_lse=True), NotImplementedError, "lse"),
    (dict(seq_lens=None), ValueError, "seq_lens"),
    (dict(seq_lens=[40, 999]), ValueError, "past the block table"),
    (dict(block_tables="other rows"), ValueError, "same pages"),
    (dict(kv_cache="wide"), ValueError, "kv_cache"),
    (dict(out="float16"), TypeError, "out"),
]


@pytest.mark.parametrize("change,error,message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_bad_calls_raise_before_writing(change, error, message):
    seq_lens = [40, 21]
    q, cache, table = make_case(7, seq_lens, 1)
    args = dict(
        query=q, kv_cache=cache, workspace_buffer=None, qk_nope_head_dim=0, kv_lora_rank=CKV,
        qk_rope_head_dim=KPE, block_tables=table, seq_lens=torch.tensor(seq_lens),
        max_seq_len=40, out=torch.full((2, 1, HEADS, CKV), 7.0),
    )  # fmt: skip
    change = dict(change)
    if change.get("block_tables") == "other rows":
        change["block_tables"] = torch.stack([table, table.flip(0)], dim=1)
    if change.get("kv_cache") == "wide":
        change["kv_cache"] = torch.zeros(cache.shape[0], PAGE, CKV + KPE + 16)
    if change.get("out") == "float16":
        change["out"] = args["out"].half()
    if isinstance(change.get("seq_lens"), list):
        change["seq_lens"] = torch.tensor(change["seq_lens"])
    args.update(change)
    before = args["out"].clone()
    with pytest.raises(error, match=message):
        pagedkv.trtllm_batch_decode_with_kv_cache_mla(**args)
    assert torch.equal(args["out"], before)


FLASHINFER_0_7_MLA_PARAMETERS = {
    "trtllm_batch_decode_with_kv_cache_mla": (
        "query kv_cache workspace_buffer qk_nope_head_dim kv_lora_rank qk_rope_head_dim "
        "block_tables seq_lens max_seq_len sparse_mla_top_k out bmm1_scale bmm2_scale sinks "
        "skip_softmax_threshold_scale_factor enable_pdl backend is_var_seq "
        "uses_shared_paged_kv_idx lse return_lse cute_dsl_impl kv_scale_format cum_seq_lens_q "
        "max_q_len multi_ctas_kv_counter_buffer sparse_mla_top_k_lens enable_dcp cp_world "
        "cp_rank causal_seqlens_kv_global use_fp16_softmax return_lse_base"
    ),
    "xqa_batch_decode_with_kv_cache_mla": (
        "query kv_cache workspace_buffer qk_nope_head_dim kv_lora_rank qk_rope_head_dim "
        "block_tables seq_lens max_seq_len out bmm1_scale bmm2_scale sinks enable_pdl"
    ),
}
"""The parameters of FlashInfer 0.7.2's functions (flashinfer/mla/_core.py of
its wheel), in order; trtllm_prefill_with_kv_cache_mla has the decode one's."""
FLASHINFER_0_7_MLA_PARAMETERS["trtllm_prefill_with_kv_cache_mla"] = FLASHINFER_0_7_MLA_PARAMETERS[
    "trtllm_batch_decode_with_kv_cache_mla"
]


@pytest.mark.parametrize("name", sorted(FLASHINFER_0_7_MLA_PARAMETERS))
def test_mla_block_table_functions_take_flashinfers_order(name):
    assert parameter_names(getattr(pagedkv, name)) == FLASHINFER_0_7_MLA_PARAMETERS[name].split()


def test_import_flashinfer_serves_them_where_flashinfer_does():
    served = {
        "trtllm_batch_decode_with_kv_cache_mla": ("decode", "mla"),
        "xqa_batch_decode_with_kv_cache_mla": ("decode", "mla"),
        "trtllm_prefill_with_kv_cache_mla": ("prefill", "mla"),
        "MLAPlanMetadata": ("mla",),
    }
    for name, modules in served.items():
        for module in modules:
            assert flashinfer_serves(f"flashinfer.{module}", name), f"flashinfer.{module}.{name}"
    import flashinfer.mla

    assert np.isclose(flashinfer.mla.deepseek_mla_dimensions.kv_lora_rank, 512)
