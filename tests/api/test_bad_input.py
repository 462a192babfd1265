"""Bad calls raise a clear error naming the argument, and leave the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
import reference
from conftest import bits, random_array

PAGE, HEADS, DIM = 4, 2, 8


@pytest.fixture
def setup(rng):
    batch = reference.paged_batch(rng, PAGE, [6, 3], [2, 1], spare_pages=2)
    pool = random_array(rng, (batch.num_pages, 2, PAGE, HEADS, DIM), "float32")
    key = random_array(rng, (batch.nnz, HEADS, DIM), "float32")
    value = random_array(rng, (batch.nnz, HEADS, DIM), "float32")
    bi, pos = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    args = dict(
        append_key=key,
        append_value=value,
        batch_indices=bi,
        positions=pos,
        paged_kv_cache=pool,
        kv_indices=batch.kv_indices,
        kv_indptr=batch.kv_indptr,
        kv_last_page_len=batch.kv_last_page_len,
    )
    return batch, pool, args


def with_(args, **changes):
    out = dict(args)
    out.update(changes)
    return out


def edited(array: np.ndarray, index: int, value) -> np.ndarray:
    """A copy of array with array[index] = value."""
    out = array.copy()
    out[index] = value
    return out


def bad_calls(batch, pool, args):
    """(description, call arguments, exception, message pattern)."""
    indices, indptr, last = batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len
    pos = args["positions"]
    key = args["append_key"]
    yield "heads", with_(args, append_key=key[:, :1]), ValueError, "append_key must be"
    yield "dtype", with_(args, append_value=key.astype(np.float16)), TypeError, "append_value is"
    yield "rows", with_(args, append_value=key[:1]), ValueError, "append_value has 1 rows"
    yield (
        "float indices",
        with_(args, kv_indices=indices.astype(np.float32)),
        TypeError,
        "kv_indices must be int32",
    )
    yield (
        "int64 pos past int32",
        with_(args, positions=pos.astype(np.int64) + 2**32),
        ValueError,
        r"positions\[0\] = \d+ does not fit in int32",
    )
    yield "list", with_(args, kv_indptr=list(indptr)), TypeError, "kv_indptr must be a numpy"
    yield (
        "last 0",
        with_(args, kv_last_page_len=edited(last, 0, 0)),
        ValueError,
        "kv_last_page_len\\[0\\] = 0",
    )
    yield (
        "last big",
        with_(args, kv_last_page_len=edited(last, 1, PAGE + 1)),
        ValueError,
        "kv_last_page_len\\[1\\] = 5",
    )
    outside = edited(indices, -1, batch.num_pages)
    yield "page id", with_(args, kv_indices=outside), ValueError, "outside the pool of"
    negative = edited(indices, 0, -1)
    yield "negative page", with_(args, kv_indices=negative), ValueError, "kv_indices\\[0\\] = -1"
    down = edited(indptr, 1, indptr[2] + 1)
    yield "indptr", with_(args, kv_indptr=down), ValueError, "kv_indptr"
    long = edited(indptr, -1, indptr[-1] + 1)
    yield "indptr end", with_(args, kv_indptr=long), ValueError, "kv_indices holds only"
    past = edited(pos, -1, batch.seq_lens[-1])
    yield "position", with_(args, positions=past), ValueError, "positions\\[2\\] = 3 is outside"
    wrong_b = edited(args["batch_indices"], 0, 2)
    yield "batch index", with_(args, batch_indices=wrong_b), ValueError, "batch_indices\\[0\\] = 2"
    yield "layout", with_(args, kv_layout="NDH"), ValueError, "kv_layout"
    yield "pool rank", with_(args, paged_kv_cache=pool[:, 0]), ValueError, "paged_kv_cache must be"
    strided = np.zeros((batch.num_pages, 2, PAGE, HEADS, 2 * DIM), np.float32)[..., ::2]
    yield "strided", with_(args, paged_kv_cache=strided), ValueError, "contiguous"


def test_bad_append_raises_and_leaves_cache_untouched(setup):
    batch, pool, args = setup
    before = bits(pool)
    names = []
    for name, call, error, pattern in bad_calls(batch, pool, args):
        with pytest.raises(error, match=pattern) as caught:
            pagedkv.append_paged_kv_cache(**call)
        # Checks made inside a kernel reach the caller as one plain line,
        # without MAX's kernel and fusion report around it.
        assert "\n" not in str(caught.value), f"{name}: {caught.value}"
        np.testing.assert_array_equal(bits(pool), before, err_msg=name)
        names.append(name)
    assert len(names) >= 15
    # The same arguments, corrected, do write: the checks above are not vacuous.
    pagedkv.append_paged_kv_cache(**args)
    assert not np.array_equal(bits(pool), before)


def test_a_call_of_neither_append_form_says_which_form_it_was_read_in(setup):
    """A pool that is no cache (0-d here) makes the call read in the
    batch_indices form: the error says so, and what makes the other."""
    batch, pool, args = setup
    table = (batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    key, value = args["append_key"], args["append_value"]
    before = bits(pool)
    form = "'kv_last_page_len', reading the call in the batch_indices / positions form"
    with pytest.raises(TypeError, match=f"{form}.*fourth argument is a cache"):
        pagedkv.append_paged_kv_cache(key, value, batch.append_indptr, np.array(0.0), *table)
    np.testing.assert_array_equal(bits(pool), before)


def test_bad_mla_append_raises(rng):
    batch = reference.paged_batch(rng, PAGE, [5], [5])
    ckv = np.zeros((batch.num_pages, PAGE, 12), np.float32)
    kpe = np.zeros((batch.num_pages, PAGE, 4), np.float32)
    bi, pos = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    rows = np.ones((5, 12), np.float32), np.ones((5, 4), np.float32)
    table = (batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    with pytest.raises(ValueError, match="append_kpe must be"):
        pagedkv.append_paged_mla_kv_cache(
            rows[0], np.ones((5, 5), np.float32), bi, pos, ckv, kpe, *table
        )
    with pytest.raises(ValueError, match="outside the pool"):
        pagedkv.append_paged_mla_kv_cache(
            *rows, bi, pos, ckv, kpe, edited(batch.kv_indices, 0, 99), *table[1:]
        )
    assert not ckv.any() and not kpe.any()


@pytest.mark.parametrize("head_dim", [96, 576, 32])
def test_a_head_dim_the_kernels_do_not_take_is_refused_at_plan(head_dim):
    wrapper = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    indptr = np.array([0, 1], np.int32)
    with pytest.raises(ValueError, match="multiple of 64 up to 512"):
        wrapper.plan(indptr, np.zeros(1, np.int32), np.ones(1, np.int32), 4, 4, head_dim, 16)


def test_head_dim_512_is_refused_in_a_gpu_graph():
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, Graph, TensorType

    from pagedkv import graph_ops

    gpu = DeviceRef.GPU(0)
    types = [
        TensorType(DType.bfloat16, ["batch", 4, 512], gpu),
        BufferType(DType.bfloat16, ["pages", 2, 16, 4, 512], gpu),
    ] + [TensorType(DType.int32, [d], gpu) for d in ("pages_used", "b1", "batch", "items")]
    with Graph("gpu_512", input_types=types) as g:
        q, pool, indices, indptr, last, items = g.inputs
        with pytest.raises(ValueError, match="CPU only"):
            graph_ops.batch_decode(
                q.tensor,
                pool.buffer,
                indices.tensor,
                indptr.tensor,
                last.tensor,
                items.tensor,
                indptr.tensor,
                num_kv_heads=4,
            )


def mla_plan_args(**changes):
    """A valid MLA plan of two decode requests (20 and 5 tokens, pages of 4,
    16 heads), with `changes` applied."""
    args = dict(
        qo_indptr=np.array([0, 1, 2], np.int32),
        kv_indptr=np.array([0, 5, 7], np.int32),
        kv_indices=np.array([6, 0, 1, 2, 3, 4, 5], np.int32),
        kv_len_arr=np.array([20, 5], np.int32),
        num_heads=16,
        head_dim_ckv=512,
        head_dim_kpe=64,
        page_size=4,
        causal=False,
        sm_scale=0.1,
        q_data_type=np.float32,
        kv_data_type=np.float32,
    )
    args.update(changes)
    return args


BAD_MLA_PLANS = [
    ("ckv dim", dict(head_dim_ckv=500), ValueError, "multiples of 16"),
    ("kpe dim", dict(head_dim_kpe=40), ValueError, "multiples of 16"),
    ("q dtype", dict(q_data_type=np.int32), TypeError, "q dtype must be"),
    ("mixed dtypes", dict(kv_data_type=np.float16), TypeError, "q's dtype"),
    ("fp8 with float32 q", dict(kv_data_type="float8_e4m3fn"), TypeError, "16-bit q"),
    ("short page table", dict(kv_len_arr=np.array([21, 5], np.int32)), ValueError, "request 0"),
    ("indptr length", dict(kv_indptr=np.array([0, 7], np.int32)), ValueError, "3 entries"),
    ("qo_indptr order", dict(qo_indptr=np.array([0, 2, 1], np.int32)), ValueError, "never"),
    ("negative length", dict(kv_len_arr=np.array([-1, 5], np.int32)), ValueError, "negative"),
    (
        "negative page",
        dict(kv_indices=np.array([-6, 0, 1, 2, 3, 4, 5], np.int32)),
        ValueError,
        "negative page",
    ),  # fmt: skip
    ("float indices", dict(kv_indices=np.zeros(7, np.float32)), TypeError, "int32"),
    ("sm_scale", dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    ("heads", dict(num_heads=0), ValueError, "num_heads"),
    ("profiler", dict(use_profiler=True), ValueError, "profiler"),
]


@pytest.mark.parametrize(
    "changes,error,pattern", [c[1:] for c in BAD_MLA_PLANS], ids=[c[0] for c in BAD_MLA_PLANS]
)
def test_bad_mla_plan_raises(changes, error, pattern):
    wrapper = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(16, np.uint8))
    with pytest.raises(error, match=pattern):
        wrapper.plan(**mla_plan_args(**changes))


def test_bad_mla_run_raises_before_running(rng):
    """Inputs that do not match the plan raise before the kernel runs (out
    stays as it was)."""
    wrapper = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(16, np.uint8))
    wrapper.plan(**mla_plan_args())
    q_nope = np.ones((2, 16, 512), np.float32)
    q_pe = np.ones((2, 16, 64), np.float32)
    ckv = np.ones((7, 4, 512), np.float32)
    kpe = np.ones((7, 4, 64), np.float32)
    out = np.full((2, 16, 512), 7.0, np.float32)
    bad = [
        (dict(q_nope=q_nope[:1]), ValueError, "q_nope must be"),
        (dict(q_pe=np.ones((2, 16, 32), np.float32)), ValueError, "q_pe must be"),
        (dict(q_pe=q_pe.astype(np.float16)), TypeError, "q_pe is float16"),
        (dict(ckv_cache=np.ones((7, 4, 256), np.float32)), ValueError, "ckv_cache must be"),
        (dict(kpe_cache=np.ones((7, 8, 64), np.float32)), ValueError, "kpe_cache must be"),
        (dict(kpe_cache=kpe[:6]), ValueError, "same number of pages"),
        (dict(ckv_cache=ckv[:6], kpe_cache=kpe[:6]), ValueError, "uses page 6"),
        (dict(ckv_cache=ckv.astype(np.float16)), TypeError, "ckv_cache is float16"),
        (dict(ckv_cache=ckv[:, ::-1]), ValueError, "contiguous"),
        (dict(ckv_scale=0.5), ValueError, "only valid with fp8"),
        (dict(page_table=np.zeros(2, np.int32)), ValueError, "page_table is not supported"),
        (dict(out=np.ones((2, 16, 512), np.float16)), TypeError, "out must be float32"),
    ]
    for changes, error, pattern in bad:
        args = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, out=out)
        args.update(changes)
        with pytest.raises(error, match=pattern):
            wrapper.run(**args)
        assert (out == 7.0).all()
    with pytest.raises(RuntimeError, match="plan"):
        pagedkv.BatchMLAPagedAttentionWrapper(np.empty(16, np.uint8)).run(q_nope, q_pe, ckv, kpe)
    with pytest.raises(ValueError, match="backend"):
        pagedkv.BatchMLAPagedAttentionWrapper(np.empty(16, np.uint8), backend="cutlass")
    with pytest.raises(ValueError, match="use_cuda_graph"):
        pagedkv.BatchMLAPagedAttentionWrapper(np.empty(16, np.uint8), use_cuda_graph=True)


def test_arguments_that_are_not_arrays_or_sizes_are_refused_by_name(rng):
    """run()'s q and out, and the block-table calls' arrays and the lengths
    FlashInfer sizes its kernels by: a TypeError or ValueError naming the
    argument, before anything is read or written."""
    pool = np.zeros((4, 2, 16, 2, 64), np.float32)
    table = np.array([0, 2, 3], np.int32), np.array([3, 1, 0], np.int32), np.array([4, 9], np.int32)
    decode = pagedkv.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    decode.plan(*table, 8, 2, 64, 16)
    prefill = pagedkv.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    prefill.plan(np.array([0, 1, 2], np.int32), *table, 8, 2, 64, 16)
    ragged = pagedkv.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan(np.array([0, 1, 2], np.int32), np.array([0, 4, 9], np.int32), 8, 2, 64)
    q = np.zeros((2, 8, 64), np.float32)
    rows = np.zeros((9, 2, 64), np.float32)
    for run in (
        lambda q, **kw: decode.run(q, pool, **kw),
        lambda q, **kw: prefill.run(q, pool, **kw),
        lambda q, **kw: ragged.run(q, rows, rows, **kw),
    ):
        for bad in (None, q.tolist()):
            with pytest.raises(TypeError, match="q must be a numpy.ndarray or a torch.Tensor"):
                run(bad)
        with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
            run(q, out=q.tolist())

    cache = np.zeros((4, 2, 2, 16, 64), np.float32)  # HND
    blocks, lens = np.array([[0, 1], [2, 0]], np.int32), np.array([20, 5], np.int32)
    call = dict(query=q, kv_cache=cache, workspace_buffer=None, block_tables=blocks)
    call |= dict(seq_lens=lens, max_seq_len=32, bmm1_scale=0.125)
    for name, bad in [("query", None), ("kv_cache", None), ("block_tables", blocks.tolist())]:
        with pytest.raises(TypeError, match=f"{name} must be a numpy"):
            pagedkv.trtllm_batch_decode_with_kv_cache(**{**call, name: bad})
    for bad, error in [(-1, ValueError), (2**63, ValueError), (1.5, TypeError), (None, TypeError)]:
        with pytest.raises(error, match="max_seq_len"):
            pagedkv.trtllm_batch_decode_with_kv_cache(**{**call, "max_seq_len": bad})
    out = pagedkv.trtllm_batch_decode_with_kv_cache(**call)  # the same call, whole, runs
    assert out.shape == q.shape


def test_plans_larger_than_the_host_could_hold_are_refused(monkeypatch):
    """A plan sized by its index arrays' values (a qo_indptr asking for many
    queries, a ragged kv_indptr for many keys) is a ValueError naming the
    array before its work list is built, once it would take more than half
    of the available memory (here made 1 MiB); the same plans fit otherwise."""
    table = np.array([0, 1], np.int32), np.array([0], np.int32), np.array([4], np.int32)
    queries = np.array([0, 2**20], np.int32)
    keys = np.array([0, 2**20], np.int32)

    def plan_both():
        prefill = pagedkv.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
        prefill.plan(queries, *table, 8, 8, 64, 16)
        ragged = pagedkv.BatchPrefillWithRaggedKVCacheWrapper()
        ragged.plan(np.array([0, 1], np.int32), keys, 8, 8, 64)

    plan_both()
    monkeypatch.setattr(pagedkv._checks, "available_memory", lambda: 2**20)
    with pytest.raises(
        ValueError, match=r"the work items of qo_indptr's queries \(16384\) would take"
    ):
        plan_both()
    queries = np.array([0, 1], np.int32)
    with pytest.raises(
        ValueError, match=r"the one-token pages of kv_indptr's keys \(1048576\) would"
    ):
        plan_both()
