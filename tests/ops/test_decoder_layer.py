"""graph_ops.quantized_decoder_layer (one op: a Llama layer with GGUF weights)
and graph_ops.rope_append_paged_kv_cache against float64 NumPy.

The layer's reference is a plain Llama layer written here: RMSNorms, rotate-
half RoPE, causal attention over the request's cached and new keys
(reference.attention), SwiGLU; weights dequantized by the `gguf` package,
activations quantized before each product as the op documents (the NumPy
model's `quantize_activations`). The op keeps its intermediate rows in
float32 and quantizes them again before the next product, where a value a
rounding away from a code boundary may land one code apart from the
reference's: the tolerance allows a few such steps, far below what any
wrong index, layout or formula gives. Decode (one token per request, keys
split across work items) and prefill (ragged, causal) both run, over a
shuffled pool whose other pages must stay as they were. The prefill graph's
layer stores V in another format than Q and K (two Q|K|V products) and adds
a bias to the Q|K|V rows (Qwen 2's block).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Module, TensorType

import reference
from pagedkv import graph_ops
from pagedkv._ops.contract import pool_row_width
from pagedkv._ops.kernels import prepare
from pagedkv._ops.quantized_panels import pack_quantized_weight, quantized_panels_shape
from pagedkv._ops.tensors import CPU
from pagedkv.graphs.model import DecoderConfig, rope_tables
from pagedkv.graphs.numpy_reference import quantize_activations
from suite_graphs import ops_graph, suite_graph, suite_model

P = 16
CONFIG = DecoderConfig(
    vocab_size=64,
    hidden_size=128,
    num_layers=1,
    num_qo_heads=4,
    num_kv_heads=2,
    head_dim=64,
    ffn_size=96,
    max_positions=512,
)
FORMATS = ("Q4_1", "Q8_0", "Q4_0", "Q4_1")
"""wqkv, wo, w_gate_up, w_down: every format the product takes."""
SHAPES = {
    "wqkv": (CONFIG.qkv_size, CONFIG.hidden_size),
    "wo": (CONFIG.hidden_size, CONFIG.num_qo_heads * CONFIG.head_dim),
    "w_gate_up": (2 * CONFIG.ffn_size, CONFIG.hidden_size),
    "w_down": (CONFIG.hidden_size, CONFIG.ffn_size),
}
SPLIT_V_FORMAT = "Q8_0"
"""V's format where the Q|K|V product is two (Q and K in FORMATS[0])."""
EPS = 1e-5


def weight_shapes(split: bool) -> dict[str, tuple[int, int]]:
    """[N, K] of each packed weight in the op's order: Q|K|V as one, or as
    Q|K ("wqk") and V ("wv")."""
    if not split:
        return SHAPES
    c = CONFIG
    nqk = (c.num_qo_heads + c.num_kv_heads) * c.head_dim
    qkv = {"wqk": (nqk, c.hidden_size), "wv": (c.num_kv_heads * c.head_dim, c.hidden_size)}
    return qkv | {name: shape for name, shape in SHAPES.items() if name != "wqkv"}


def weight_formats(split: bool) -> tuple[str, ...]:
    return (FORMATS[0], SPLIT_V_FORMAT, *FORMATS[1:]) if split else FORMATS


def graph_inputs(pool_dtype: DType = DType.float32, split: bool = False) -> list:
    """The graph's inputs; with `split` a Q|K|V bias after the norms."""
    cpu = DeviceRef.CPU()
    c = CONFIG
    row = pool_row_width(pool_dtype, c.head_dim)

    def index(name):
        return TensorType(DType.int32, [name], device=cpu)

    weights = [
        TensorType(DType.uint8, quantized_panels_shape(fmt, *shape), cpu)
        for fmt, shape in zip(weight_formats(split), weight_shapes(split).values(), strict=True)
    ]
    return [
        BufferType(pool_dtype, ["pages", 2, P, c.num_kv_heads, row], cpu),
        TensorType(DType.float32, ["rows", c.hidden_size], cpu),
        TensorType(DType.float32, [c.hidden_size], cpu),
        TensorType(DType.float32, [c.hidden_size], cpu),
        *([TensorType(DType.float32, [c.qkv_size], cpu)] if split else []),
        *weights,
        TensorType(DType.float32, [c.max_positions, c.head_dim // 2], cpu),
        TensorType(DType.float32, [c.max_positions, c.head_dim // 2], cpu),
        index("rows"),
        index("rows"),
        index("used_pages"),
        index("batch_plus_1"),
        index("batch"),
        TensorType(DType.int32, ["items", 6], cpu),
        index("batch_plus_1"),
    ]


def stacked_inputs(types: list, layers: int) -> list:
    """`graph_inputs` for a run of `layers` layers: a pool each, and each
    norm and packed weight of the unsplit layer stacked along its first
    axis."""
    stacked = [types[0]] * layers + [types[1]]
    for t in types[2:8]:
        shape = [layers * int(t.shape[0]), *(int(d) for d in t.shape[1:])]
        stacked.append(TensorType(t.dtype, shape, DeviceRef.CPU()))
    return stacked + types[8:]


def build(
    module: Module,
    name: str,
    decode: bool,
    pool_dtype: DType = DType.float32,
    split: bool = False,
    layers: int = 1,
) -> None:
    """The op's graph; with `layers` > 1 (unsplit only) a run of that many."""
    c = CONFIG
    types = graph_inputs(pool_dtype, split)
    with ops_graph(module, name, types if layers == 1 else stacked_inputs(types, layers)) as g:
        pools = [p.buffer for p in g.inputs[:layers]]
        x, attn_norm, mlp_norm, *rest = g.inputs[layers:]
        bqkv = rest.pop(0).tensor if split else None
        n = len(weight_shapes(split))
        packed, (cos, sin, *index) = [v.tensor for v in rest[:n]], rest[n:]
        wv = packed.pop(1) if split else None
        weights = graph_ops.QuantizedLayerWeights(
            attn_norm.tensor,
            packed[0],
            packed[1],
            mlp_norm.tensor,
            packed[2],
            packed[3],
            FORMATS,
            wv=wv,
            v_format=SPLIT_V_FORMAT if split else None,
            bqkv=bqkv,
        )
        g.output(
            graph_ops.quantized_decoder_layer(
                x.tensor,
                pools,
                weights,
                cos.tensor,
                sin.tensor,
                c.num_qo_heads,
                c.ffn_size,
                EPS,
                *(v.tensor for v in index),
                decode=decode,
            )
        )


@suite_graph("decoder_layer_decode")
def decoder_layer_decode(module: Module) -> None:
    build(module, "decoder_layer_decode", decode=True)


@suite_graph("decoder_layer_prefill_split_qkv")
def decoder_layer_prefill_split_qkv(module: Module) -> None:
    build(module, "decoder_layer_prefill_split_qkv", decode=False, split=True)


RUN = 3
"""Layers in the run of `decoder_layer_run`."""


@suite_graph("decoder_layer_run")
def decoder_layer_run(module: Module) -> None:
    """RUN decode layers as one op: RUN pools, each weight stacked."""
    build(module, "decoder_layer_run", decode=True, layers=RUN)


def rope_append_graph(module: Module, name: str, pool_dtype: DType = DType.float32) -> None:
    c = CONFIG
    cpu = DeviceRef.CPU()
    types = graph_inputs(pool_dtype)
    types[1] = TensorType(DType.float32, ["rows", c.qkv_size], cpu)
    with ops_graph(module, name, [types[0], types[1], *types[8:15]]) as g:
        pool, qkv, cos, sin, *index = g.inputs
        g.output(
            graph_ops.rope_append_paged_kv_cache(
                pool.buffer,
                qkv.tensor,
                cos.tensor,
                sin.tensor,
                c.num_qo_heads,
                *(v.tensor for v in index),
            )
        )


@suite_graph("rope_append")
def rope_append_float32(module: Module) -> None:
    rope_append_graph(module, "rope_append")


@suite_graph("rope_append_int8")
def rope_append_int8(module: Module) -> None:
    rope_append_graph(module, "rope_append_int8", DType.int8)


class Layer:
    """Random quantized weights and their float64 reference layer."""

    def __init__(self, rng: np.random.Generator, split: bool = False) -> None:
        """split: Q|K|V as two packed weights in different formats, and a
        bias on its rows."""
        c = CONFIG
        self.attn_norm = (1 + 0.2 * rng.standard_normal(c.hidden_size)).astype(np.float32)
        self.mlp_norm = (1 + 0.2 * rng.standard_normal(c.hidden_size)).astype(np.float32)
        self.bqkv = rng.standard_normal(c.qkv_size).astype(np.float32) if split else None
        self.dense, self.panels = {}, {}
        shapes = weight_shapes(split)
        for fmt, (name, (n, k)) in zip(weight_formats(split), shapes.items(), strict=True):
            w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
            raw = quants.quantize(w, GGMLQuantizationType[fmt])
            self.dense[name] = quants.dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float64)
            self.panels[name] = pack_quantized_weight(raw, fmt, n, k).panels
        if split:
            self.dense["wqkv"] = np.concatenate([self.dense.pop("wqk"), self.dense.pop("wv")])
        self.cos, self.sin = rope_tables(CONFIG)

    def product(self, rows: np.ndarray, name: str) -> np.ndarray:
        return quantize_activations(rows) @ self.dense[name].T

    @staticmethod
    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight

    def rotate(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate-half RoPE of x [T, H, D] with the float32 tables."""
        half = x.shape[-1] // 2
        c = self.cos[positions][:, None, :].astype(np.float64)
        s = self.sin[positions][:, None, :].astype(np.float64)
        lo, hi = x[..., :half], x[..., half:]
        return np.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)

    def qkv(self, x: np.ndarray) -> np.ndarray:
        qkv = self.product(self.norm(x, self.attn_norm), "wqkv")
        return qkv if self.bqkv is None else qkv + self.bqkv

    def forward(self, x, positions, cached_k, cached_v, stored=lambda rows: rows):
        """The layer on one request's new rows x [T, H] at positions [T],
        after keys and values cached [L, Hkv, D], attending to its new keys
        and values as `stored` keeps them; returns (out, k, v)."""
        c = CONFIG
        t, d = x.shape[0], c.head_dim
        nq, nk = c.num_qo_heads * d, c.num_kv_heads * d
        qkv = self.qkv(x)
        q = self.rotate(qkv[:, :nq].reshape(t, c.num_qo_heads, d), positions)
        k = self.rotate(qkv[:, nq : nq + nk].reshape(t, c.num_kv_heads, d), positions)
        v = qkv[:, nq + nk :].reshape(t, c.num_kv_heads, d)
        keys = np.concatenate([cached_k, stored(k)])
        values = np.concatenate([cached_v, stored(v)])
        o, _ = reference.attention(q, keys, values, positions)
        h = x + self.product(o.reshape(t, nq), "wo")
        gu = self.product(self.norm(h, self.mlp_norm), "w_gate_up")
        gate, up = gu[:, : c.ffn_size], gu[:, c.ffn_size :]
        act = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
        return h + self.product(act, "w_down"), k, v


def step(rng, cached: list[int], new: list[int], decode: bool):
    """A batch's inputs: page table, random cached K/V in the pool, new rows."""
    c = CONFIG
    after = [a + b for a, b in zip(cached, new, strict=True)]
    batch = reference.paged_batch(rng, P, after, new)
    pool = rng.standard_normal((batch.num_pages, 2, P, c.num_kv_heads, c.head_dim))
    pool = pool.astype(np.float32)
    bi, pos = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    shape = (P, c.num_qo_heads, c.num_kv_heads, c.head_dim)
    table = (batch.kv_indptr, batch.kv_last_page_len)
    work = (
        graph_ops.decode_work(*table, *shape, gpu=False)
        if decode
        else graph_ops.prefill_work(batch.append_indptr, *table, *shape, gpu=False)
    )
    x = rng.standard_normal((batch.nnz, c.hidden_size)).astype(np.float32)
    return batch, pool, x, bi.astype(np.int32), pos.astype(np.int32), work


def cached_kv(pool: np.ndarray, batch, b: int, length: int):
    """Request b's first `length` tokens' K and V [length, Hkv, D] in the pool."""
    pages = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
    k = pool[pages, 0].reshape(-1, *pool.shape[3:])[:length]
    v = pool[pages, 1].reshape(-1, *pool.shape[3:])[:length]
    return k.astype(np.float64), v.astype(np.float64)


def run_layer(model, layer: Layer, pool, x, batch, bi, pos, work):
    args = [
        pool,
        x,
        layer.attn_norm,
        layer.mlp_norm,
        *([] if layer.bqkv is None else [layer.bqkv]),
        *layer.panels.values(),
        layer.cos,
        layer.sin,
        bi,
        pos,
        batch.kv_indices,
        batch.kv_indptr,
        batch.kv_last_page_len,
        *work,
    ]
    return model.execute(*(Buffer.from_numpy(np.ascontiguousarray(a)) for a in args))[0].to_numpy()


CASES = [
    # (cached tokens before the step, new tokens): long enough that decode
    # splits keys into several items, a request starting empty, a page edge.
    pytest.param([300, 17, 0], [1, 1, 1], True, id="decode"),
    pytest.param([5], [1], True, id="decode-one"),
    pytest.param([0, 20, 31], [9, 3, 1], False, id="prefill"),
    pytest.param([0], [40], False, id="prefill-one"),
]


@pytest.mark.parametrize("cached,new,decode", CASES)
def test_decoder_layer_matches_float64(cached, new, decode):
    rng = np.random.default_rng(sum(cached) + len(new))
    layer = Layer(rng, split=not decode)
    batch, pool, x, bi, pos, work = step(rng, cached, new, decode)
    if decode:
        assert len(work[0]) > len(cached) or len(cached) == 1  # keys split
    before = pool.copy()
    model = suite_model("decoder_layer_decode" if decode else "decoder_layer_prefill_split_qkv")
    got = run_layer(model, layer, pool, x, batch, bi, pos, work)
    c = CONFIG
    touched = np.zeros(pool.shape[0], bool)
    for b in range(batch.batch_size):
        rows = slice(batch.append_indptr[b], batch.append_indptr[b + 1])
        k0, v0 = cached_kv(before, batch, b, cached[b])
        want, k, v = layer.forward(x[rows], pos[rows], k0, v0)
        scale = np.sqrt(np.mean(want**2))
        err = np.abs(got[rows] - want)
        assert (err <= 5e-3 * scale + 1e-3 * np.abs(want)).all(), f"request {b}: {err.max()}"
        k_new, v_new = cached_kv(pool, batch, b, cached[b] + new[b])
        np.testing.assert_array_equal(k_new[: cached[b]], k0)
        np.testing.assert_allclose(k_new[cached[b] :], k, rtol=0, atol=2e-3 * np.abs(k).max())
        np.testing.assert_allclose(v_new[cached[b] :], v, rtol=0, atol=2e-3 * np.abs(v).max())
        touched[batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]] = True
    assert pool[~touched].tobytes() == before[~touched].tobytes()
    assert got.shape == (batch.nnz, c.hidden_size)


@pytest.mark.slow
def test_decoder_layer_decodes_over_an_int8_pool():
    """Cached rows of magnitudes 0.05-20x apart, so that a scale read from
    another row, or none, is far off; the new keys and values stored as int8
    rows with their scales (within a code of the reference's) and attended
    as stored, keys split across items; other pages untouched. Slow: a
    decoder layer of its own to compile (the default suite covers the
    int8 rope-append here and int8 attention in tests/api/test_int8_cache.py)."""
    cached, new = [300, 17, 0], [1, 1, 1]
    rng = np.random.default_rng(7 + sum(cached))
    layer = Layer(rng)
    batch, pool, x, bi, pos, work = step(rng, cached, new, True)
    pool *= rng.uniform(0.05, 20, (*pool.shape[:-1], 1)).astype(np.float32)
    before = reference.int8_pages(pool)
    pool8 = before.copy()
    models = prepare(
        [],
        CPU,
        graphs=lambda m: build(m, "decoder_layer_int8", decode=True, pool_dtype=DType.int8),
        key=("tests.decoder_layer_int8", hashlib.sha256(Path(__file__).read_bytes()).hexdigest()),
    )
    got = run_layer(models["decoder_layer_int8"], layer, pool8, x, batch, bi, pos, work)
    cached_values = reference.int8_page_values(before)
    values = reference.int8_page_values(pool8)
    touched = np.zeros(pool.shape[0], bool)
    for b in range(batch.batch_size):
        rows = slice(batch.append_indptr[b], batch.append_indptr[b + 1])
        k0, v0 = cached_kv(cached_values, batch, b, cached[b])
        want, k, v = layer.forward(x[rows], pos[rows], k0, v0, reference.int8_roundtrip)
        err = np.abs(got[rows] - want)
        bound = 5e-3 * np.sqrt(np.mean(want**2)) + 1e-3 * np.abs(want)
        assert (err <= bound).all(), f"request {b}: {err.max()}"
        k_all, v_all = cached_kv(values, batch, b, cached[b] + new[b])
        np.testing.assert_array_equal(k_all[: cached[b]], k0)
        for got_rows, want_rows in ((k_all[cached[b] :], k), (v_all[cached[b] :], v)):
            code = np.abs(want_rows).max(axis=-1, keepdims=True) / 127
            bound = 0.5 * code + 2e-3 * np.abs(want_rows).max()
            assert (np.abs(got_rows - want_rows) <= bound).all()
        touched[batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]] = True
    assert pool8[~touched].tobytes() == before[~touched].tobytes()


def test_rope_append_rotates_and_appends():
    """Queries and keys rotated as the reference rotates them (float32 on
    both sides: within an ulp or two); values copied bit for bit."""
    rng = np.random.default_rng(5)
    c = CONFIG
    layer = Layer(rng)
    batch, pool, _, bi, pos, _ = step(rng, [3, 40], [5, 2], False)
    qkv = rng.standard_normal((batch.nnz, c.qkv_size)).astype(np.float32)
    before = pool.copy()
    args = [pool, qkv, layer.cos, layer.sin, bi, pos, batch.kv_indices, batch.kv_indptr]
    args.append(batch.kv_last_page_len)
    q = suite_model("rope_append").execute(*(Buffer.from_numpy(a) for a in args))[0].to_numpy()
    d, nq, nk = c.head_dim, c.num_qo_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want_q = layer.rotate(qkv[:, :nq].reshape(-1, c.num_qo_heads, d).astype(np.float64), pos)
    np.testing.assert_allclose(q, want_q, rtol=1e-6, atol=1e-6)
    want_k = layer.rotate(qkv[:, nq : nq + nk].reshape(-1, c.num_kv_heads, d), pos)
    for b, start in enumerate((3, 40)):
        rows = slice(batch.append_indptr[b], batch.append_indptr[b + 1])
        k_all, v_all = cached_kv(pool, batch, b, start + batch.append_lens[b])
        np.testing.assert_allclose(k_all[start:], want_k[rows], rtol=1e-6, atol=1e-6)
        values = qkv[rows, nq + nk :].reshape(-1, c.num_kv_heads, d)
        assert v_all[start:].astype(np.float32).tobytes() == values.tobytes()
        k0, v0 = cached_kv(before, batch, b, start)
        assert k_all[:start].tobytes() == k0.tobytes() and v_all[:start].tobytes() == v0.tobytes()


def test_rope_append_quantizes_into_an_int8_pool():
    """Rotated keys and the values stored as int8 rows with their scales
    (within half a code of the float64 rotation), queries as float32
    rotations; the pool's other rows untouched."""
    rng = np.random.default_rng(11)
    c = CONFIG
    layer = Layer(rng)
    batch, pool, _, bi, pos, _ = step(rng, [3, 40], [5, 2], False)
    before = reference.int8_pages(pool)
    pool8 = before.copy()
    qkv = rng.standard_normal((batch.nnz, c.qkv_size)).astype(np.float32)
    qkv *= rng.uniform(0.05, 20, (batch.nnz, 1)).astype(np.float32)
    args = [pool8, qkv, layer.cos, layer.sin, bi, pos, batch.kv_indices, batch.kv_indptr]
    args.append(batch.kv_last_page_len)
    model = suite_model("rope_append_int8")
    q = model.execute(*(Buffer.from_numpy(a) for a in args))[0].to_numpy()
    d, nq, nk = c.head_dim, c.num_qo_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want_q = layer.rotate(qkv[:, :nq].reshape(-1, c.num_qo_heads, d).astype(np.float64), pos)
    np.testing.assert_allclose(q, want_q, rtol=1e-5, atol=1e-5 * np.abs(want_q).max())
    want_k = layer.rotate(qkv[:, nq : nq + nk].reshape(-1, c.num_kv_heads, d), pos)
    want_v = qkv[:, nq + nk :].reshape(-1, c.num_kv_heads, d).astype(np.float64)
    values = reference.int8_page_values(pool8)
    touched = np.zeros(pool8.shape[0], bool)
    for b, start in enumerate((3, 40)):
        rows = slice(batch.append_indptr[b], batch.append_indptr[b + 1])
        k_all, v_all = cached_kv(values, batch, b, start + batch.append_lens[b])
        for got, want in ((k_all[start:], want_k[rows]), (v_all[start:], want_v[rows])):
            code = np.abs(want).max(axis=-1, keepdims=True) / 127
            assert (np.abs(got - want) <= 0.5 * code * (1 + 1e-4)).all()
        touched[batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]] = True
    assert pool8[~touched].tobytes() == before[~touched].tobytes()


def test_positions_past_the_tables_write_nothing():
    rng = np.random.default_rng(9)
    c = CONFIG
    layer = Layer(rng)
    batch, pool, x, bi, pos, work = step(rng, [c.max_positions], [1], True)
    assert pos[-1] == c.max_positions
    before = pool.copy()
    with pytest.raises(ValueError, match="past the RoPE tables"):
        run_layer(suite_model("decoder_layer_decode"), layer, pool, x, batch, bi, pos, work)
    assert pool.tobytes() == before.tobytes()


def test_bad_layer_weights_are_refused():
    """A format the product does not take, or one of a pair of norms without
    the other, raises before any graph is built."""
    stub = object()
    six = (stub,) * 6
    with pytest.raises(ValueError, match="takes Q4_0"):
        graph_ops.QuantizedLayerWeights(*six, formats=("Q4_1", "Q8_0", "Q2_K", "Q4_1"))
    with pytest.raises(ValueError, match="come in pairs"):
        graph_ops.QuantizedLayerWeights(*six, formats=FORMATS, q_norm=stub)
    with pytest.raises(ValueError, match="come in pairs"):
        graph_ops.QuantizedLayerWeights(*six, formats=FORMATS, post_mlp_norm=stub)
    with pytest.raises(ValueError, match="come in pairs"):
        graph_ops.QuantizedLayerWeights(*six, formats=FORMATS, wv=stub)
    with pytest.raises(ValueError, match="takes Q4_0"):
        graph_ops.QuantizedLayerWeights(*six, formats=FORMATS, wv=stub, v_format="Q2_K")
    with pytest.raises(ValueError, match="activation"):
        graph_ops.quantized_decoder_layer(
            *(stub,) * 2,
            graph_ops.QuantizedLayerWeights(*six, formats=FORMATS),
            *(stub,) * 2,
            4,
            8,
            EPS,
            *(stub,) * 7,
            decode=True,
            activation="relu",
        )


def test_a_run_of_layers_is_its_layers_one_op_each():
    """Three decode layers as one op (their pools in order, their weights
    stacked) write the same bits, in x_out and in each pool, as the three
    layers run one op each: the same products, in the same order, read
    each layer's own weights and pool."""
    rng = np.random.default_rng(13)
    layers = [Layer(rng) for _ in range(RUN)]
    batch, pool, x, bi, pos, work = step(rng, [300, 17, 0], [1, 1, 1], True)
    pools = [pool * (1 + i) for i in range(RUN)]
    single = [p.copy() for p in pools]
    want = x
    for layer, p in zip(layers, single, strict=True):
        want = run_layer(suite_model("decoder_layer_decode"), layer, p, want, batch, bi, pos, work)
    stacked = [
        np.concatenate([getattr(layer, name) for layer in layers])
        for name in ("attn_norm", "mlp_norm")
    ] + [np.concatenate([layer.panels[name] for layer in layers]) for name in SHAPES]
    index = [bi, pos, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, *work]
    args = [*pools, x, *stacked, layers[0].cos, layers[0].sin, *index]
    model = suite_model("decoder_layer_run")
    got = model.execute(*(Buffer.from_numpy(np.ascontiguousarray(a)) for a in args))
    assert got[0].to_numpy().tobytes() == want.tobytes()
    for i in range(RUN):
        assert pools[i].tobytes() == single[i].tobytes(), f"layer {i}'s pool"
