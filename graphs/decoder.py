"""The model's step graphs: a decoder layer stack over pagedkv's paged cache.

Two graphs share the layer code and the weights: a prefill graph (a ragged
batch of many tokens per request, causal attention through pagedkv's prefill
op) and a decode graph (one token per request, pagedkv's decode op). Each
layer appends its new K/V into its pool, a graph buffer written in place,
then attends over the pool; both take every count (batch, tokens, pages,
work items) as a symbolic dim, so one compile serves every step of a run.

The layer is a subgraph that each layer calls with its own pool and its
own weights (by name prefix), one per sliding window, so compiling 30
layers costs about what one does. Per layer (Llama's block; `DecoderConfig`
adds Qwen's and Gemma 3's choices): RMSNorm, fused QKV projection (its
bias added, then RMSNorm of each q and k head), RoPE on q and k with the
layer's base (the cache holds rotated keys), append, paged attention
(through the layer's window), output projection (then RMSNorm) and
residual, RMSNorm, SwiGLU or GELU-tanh MLP (then RMSNorm) and residual;
then a final norm and the logits of each request's last token. Each layer
group of the page manager (one per window) has its own page ids and work
list.

The weights come in one of two forms:

- float (`quantized=None`): float32 or bfloat16 weights, activations and
  cache in one dtype; the products go through graph_ops.linear (on the CPU
  pagedkv's op over weights packed in panels at load, on a GPU MAX's
  matmul). The exact path: it matches transformers token for token.
- quantized (a `QuantizedFormats`): the GGUF's own 4- and 8-bit blocks,
  multiplied by graph_ops.qlinear (CPU) with float32 activations quantized
  per block. A layer with every product quantized is one fused op, of any
  family (graph_ops.quantized_decoder_layer: each norm the prologue of the
  product after it, SwiGLU or GeGLU the down projection's, each residual
  add an epilogue, the Q|K|V bias, QK-norm and sandwich norms row phases
  of the op; a Q|K|V stored in two formats is two products in
  the op's one phase). Consecutive fused layers of one window and one set
  of formats are one op (`layer_runs`), their weights stacked in the
  registry under "runs.{first}.": SmolLM2's 30 layers are one op, not 30.
  Any other layer is built op by op, each product quantized or, where its
  format is one the product does not take, float32. The cache keeps its
  own dtype (`dtype`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from max.dtype import DType
from max.graph import (
    BufferType,
    BufferValue,
    DeviceRef,
    Graph,
    Module,
    TensorType,
    TensorValue,
    Weight,
    ops,
)

from pagedkv import graph_ops
from pagedkv._ops.contract import pool_row_width
from pagedkv._ops.kept_arrays import kept_array
from pagedkv._ops.linear_panels import (
    linear_panels_shape,
    pack_linear_weight,
    pack_linear_weight_cached,
)
from pagedkv._ops.paths import cache_root
from pagedkv._ops.quantized_panels import quantized_panels_shape

from .model import DecoderConfig, layer_weight_shapes, rope_tables

PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True)
class LayerFormats:
    """The packed GGUF layout of each product of one layer of a quantized
    graph: the fused Q|K|V projection, the output projection, the fused
    gate|up projection and the down projection; None where the product
    multiplies float32 weights instead (a format the quantized product does
    not take)."""

    wqkv: str | None
    """Also "{Q|K format}+{V format}": two packed products, "wqk" and "wv"
    (a file that stores V in another format than Q and K, as llama.cpp's
    Q4_K_M does in half the layers), their outputs side by side."""
    wo: str | None
    w_gate_up: str | None
    w_down: str | None

    def fused(self) -> bool:
        """Whether the layer is one fused op (`graph_ops.quantized_decoder_layer`):
        every product quantized."""
        return None not in (self.wqkv, self.wo, self.w_gate_up, self.w_down)

    def qkv_parts(self) -> tuple[str, str] | None:
        """(Q|K format, V format) of a Q|K|V product stored as two; else None."""
        if self.wqkv is None or QKV_SPLIT not in self.wqkv:
            return None
        qk, v = self.wqkv.split(QKV_SPLIT)
        return qk, v


@dataclass(frozen=True)
class QuantizedFormats:
    """The packed layouts of a quantized graph: each layer's (`LayerFormats`;
    a GGUF may store one product in different formats in different layers,
    as Q4_K_M files do) and the output head's (None: float32)."""

    layers: tuple[LayerFormats, ...]
    lm_head: str | None
    embed: str | None = None
    """The packed layout the token embedding's rows are looked up in
    (`graph_ops.packed_rows`); None: a float32 embedding."""
    embed_is_head: bool = False
    """The embedding's rows are the output head's panels (a model whose
    head is its embedding): the graph holds them once."""

    @property
    def products(self) -> frozenset[str]:
        """The quantized products (their activations are quantized): a
        product's name where every layer quantizes it, "layers.{i}.{name}"
        where only some do, and "lm_head"."""
        names = set()
        for name in LAYER_PRODUCTS:
            layers = [i for i, f in enumerate(self.layers) if getattr(f, name) is not None]
            if len(layers) == len(self.layers):
                names.add(name)
            else:
                names.update(f"layers.{i}.{name}" for i in layers)
        if self.lm_head is not None:
            names.add("lm_head")
        return frozenset(names)


LAYER_PRODUCTS = ("wqkv", "wo", "w_gate_up", "w_down")
"""A quantized graph's products in each layer, by their names."""
QKV_SPLIT = "+"
"""Joins the two formats of a Q|K|V product stored as "wqk" and "wv"."""


def _product_format(quantized: dict, layer: int, name: str) -> str | None:
    """The packed format of product `name` of layer `layer` in `quantized`
    (`LayerFormats`' field), None where it is float."""
    prefix = f"layers.{layer}."
    if name == "wqkv" and prefix + "wqk" in quantized:
        return quantized[prefix + "wqk"].format + QKV_SPLIT + quantized[prefix + "wv"].format
    return getattr(quantized.get(prefix + name), "format", None)


def quantized_formats(quantized: dict, num_layers: int) -> QuantizedFormats:
    """The formats of a model's packed matrices (`QuantizedWeight`s by the
    names of `pagedkv.models.gguf_model.quantized_weight_names`, a product
    missing where its weights stay float; "embed", where present, is the
    "lm_head" object itself when the model ties them)."""
    layers = tuple(
        LayerFormats(**{name: _product_format(quantized, i, name) for name in LAYER_PRODUCTS})
        for i in range(num_layers)
    )
    head, embed = quantized.get("lm_head"), quantized.get("embed")
    return QuantizedFormats(
        layers,
        getattr(head, "format", None),
        getattr(embed, "format", None),
        embed is not None and embed is head,
    )


def layer_runs(c: DecoderConfig, quantized: QuantizedFormats | None) -> list[range]:
    """The layers in the step graph's ops: consecutive fused layers of the
    same window and formats run as one op (their weights stacked under
    "runs.{first}."), every other layer alone (under "layers.{i}.")."""
    runs: list[range] = []
    for i in range(c.num_layers):
        formats = quantized.layers[i] if quantized is not None else None
        if runs and formats is not None and formats.fused():
            last = runs[-1]
            if (c.window(last[0]), quantized.layers[last[0]]) == (c.window(i), formats):
                runs[-1] = range(last.start, i + 1)
                continue
        runs.append(range(i, i + 1))
    return runs


def run_prefix(run: range) -> str:
    """The prefix of a run's weights in the graph and its registry."""
    return f"layers.{run.start}." if len(run) == 1 else f"runs.{run.start}."


def quantized_weight_shapes(c: DecoderConfig) -> dict[str, tuple[int, int]]:
    """[out_features, in_features] of a quantized graph's matrices (GGUF's
    order); a layer's are named without their "layers.{i}." prefix."""
    return {
        "wqkv": (c.qkv_size, c.hidden_size),
        "wqk": ((c.num_qo_heads + c.num_kv_heads) * c.head_dim, c.hidden_size),
        "wv": (c.num_kv_heads * c.head_dim, c.hidden_size),
        "wo": (c.hidden_size, c.num_qo_heads * c.head_dim),
        "w_gate_up": (2 * c.ffn_size, c.hidden_size),
        "w_down": (c.hidden_size, c.ffn_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }


def group_windows(c: DecoderConfig) -> list[int | None]:
    """The window of each of the model's layer groups, in the page manager's
    order (`DecoderConfig.layer_groups`): [None] when every layer is global."""
    groups = c.layer_groups
    return [None] if groups is None else [window for _, window in groups]


@functools.cache
def step_input_names(kind: str, c: DecoderConfig) -> tuple[str, ...]:
    """The order of a step graph's inputs (what the engine feeds).

    Every layer group (`group_windows`) has its own page ids and work list
    ("kv_indices.{g}", "work_items.{g}", "request_items.{g}"); the page
    table's shape (kv_indptr, kv_last_page_len) is the same in every group.
    """
    common = ("tokens", "positions", "batch_indices", "kv_indptr", "kv_last_page_len")
    groups = tuple(
        f"{name}.{g}"
        for g in range(len(group_windows(c)))
        for name in ("kv_indices", "work_items", "request_items")
    )
    extra = ("last_rows",) if kind == PREFILL else ()
    # The pools come last (the engine passes its pool buffers as a block).
    return common + groups + extra + tuple(f"pool.{i}" for i in range(c.num_layers))


def _input_types(
    kind: str, c: DecoderConfig, page_size: int, dtype: DType, device: DeviceRef
) -> list:
    i32 = DType.int32
    rows = "tokens" if kind == PREFILL else "batch"

    def index(dim: str) -> TensorType:
        return TensorType(i32, [dim], device=device)

    types = [index(rows), index(rows), index(rows), index("batch_plus_1"), index("batch")]
    for g in range(len(group_windows(c))):
        types += [
            index(f"used_pages_{g}"),
            TensorType(i32, [f"items_{g}", 6], device=device),
            index("batch_plus_1"),
        ]
    if kind == PREFILL:
        # The rows whose logits come out: each request's last, or more
        # (prompt logprobs want every row of a prompt).
        types.append(index("out_rows"))
    # A window group's pool has one page more (its null page): each group's
    # pools have their own page count.
    windows = group_windows(c)
    row_width = pool_row_width(dtype, c.head_dim)
    return types + [
        BufferType(
            dtype,
            [f"pages_{windows.index(c.window(i))}", 2, page_size, c.num_kv_heads, row_width],
            device=device,
        )
        for i in range(c.num_layers)
    ]


def _rope(x: TensorValue, cos: TensorValue, sin: TensorValue) -> TensorValue:
    """Rotate-half RoPE of x [T, heads, D] with cos, sin [T, 1, D/2]."""
    half = int(x.shape[-1]) // 2
    lo, hi = ops.split(x, [half, half], axis=-1)
    return ops.concat([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


MATRICES = ("wqkv", "wo", "w_gate", "w_up", "w_down", "lm_head")
"""The weights multiplied through graph_ops.linear: packed in panels on the CPU."""


def _is_matrix(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in MATRICES


def _weight(
    name: str, dtype: DType, shape: tuple[int, ...], device: DeviceRef, placeholder: bool = False
) -> Weight:
    """The graph's Weight of a [K, N] (x @ W) weight, as packed on the CPU."""
    if _is_matrix(name) and device == DeviceRef.CPU():
        shape = linear_panels_shape(*shape)
    return Weight(name, dtype, shape, device, _placeholder=placeholder)


def _layer_weights(
    c: DecoderConfig,
    dtype: DType,
    device: DeviceRef,
    quantized: LayerFormats | None,
    placeholder: bool = True,
    layers: int = 1,
) -> dict[str, Weight]:
    """A layer's weights (placeholders, resolved by each layer's prefix), or
    a run's of `layers` fused layers, each weight stacked along its first
    axis.

    In a quantized graph the norms and the float products' weights are
    float32 and the quantized products' packed bytes."""
    shapes = layer_weight_shapes(c)
    if quantized is None:
        return {
            name: _weight(name, dtype, shape, device, placeholder) for name, shape in shapes.items()
        }
    floats = {"wqkv": ("wqkv",), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up")}
    floats["w_down"] = ("w_down",)
    names = [name for name in shapes if name not in MATRICES]
    w = {}
    packed = {product: getattr(quantized, product) for product in floats}
    if quantized.qkv_parts() is not None:
        del packed["wqkv"]
        packed["wqk"], packed["wv"] = quantized.qkv_parts()
    for product, fmt in packed.items():
        if fmt is None:
            names += floats[product]
        else:
            rows, row_bytes = quantized_panels_shape(fmt, *quantized_weight_shapes(c)[product])
            shape = (layers * rows, row_bytes)
            w[product] = Weight(product, DType.uint8, shape, device, _placeholder=placeholder)
    for name in names:
        shape = shapes[name] if layers == 1 else (layers * shapes[name][0], *shapes[name][1:])
        w[name] = _weight(name, DType.float32, shape, device, placeholder)
    return w


def _weights(
    c: DecoderConfig, dtype: DType, device: DeviceRef, quantized: QuantizedFormats | None
) -> dict[str, Weight]:
    """The weights outside the layers (the layers' come by prefix: _layer_subgraph)."""
    shapes = {
        "embed": (c.vocab_size, c.hidden_size),
        "final_norm": (c.hidden_size,),
        "lm_head": (c.hidden_size, c.vocab_size),
    }
    if quantized is None:
        return {name: _weight(name, dtype, shape, device) for name, shape in shapes.items()}
    w = {name: _weight(name, DType.float32, shapes[name], device) for name in shapes}
    rows = quantized_weight_shapes(c)["lm_head"]  # the head's and the embedding's
    if quantized.lm_head is not None:
        head = quantized_panels_shape(quantized.lm_head, *rows)
        w["lm_head"] = Weight("lm_head", DType.uint8, head, device)
    if quantized.embed_is_head:
        del w["embed"]
    elif quantized.embed is not None:
        embed = quantized_panels_shape(quantized.embed, *rows)
        w["embed"] = Weight("embed", DType.uint8, embed, device)
    return w


def _embedding(
    c: DecoderConfig,
    w: dict[str, Weight],
    tokens: TensorValue,
    quantized: QuantizedFormats | None,
) -> TensorValue:
    """The tokens' embedding rows [rows, H]: gathered from the float table,
    or dequantized from the packed rows (bit for bit the float table's)."""
    if quantized is None or quantized.embed is None:
        return ops.gather(w["embed"], tokens, 0)
    rows = w["lm_head"] if quantized.embed_is_head else w["embed"]
    return graph_ops.packed_rows(rows, tokens, quantized.embed, (c.vocab_size, c.hidden_size))


def _attention(
    kind: str,
    c: DecoderConfig,
    qkv: TensorValue,
    rope: tuple[TensorValue, TensorValue],
    pool: BufferValue,
    rows_index: tuple[TensorValue, TensorValue],
    table: tuple[TensorValue, TensorValue, TensorValue],
    work: tuple[TensorValue, TensorValue],
    window: int | None,
) -> TensorValue:
    """Attention of the rows' fused projections qkv [rows, (Hq + 2 Hkv) D]
    over their pool, after appending their rotated keys and values (in the
    pool's dtype); returns [rows, Hq D] in qkv's dtype. `window`: the
    layer's sliding window (None: global); the work list must be planned
    with the same window.

    rope: on the CPU the whole cos and sin tables [max_positions, D/2]
    (float32), which one op applies while it appends; on a GPU the rows'
    own [rows, 1, D/2] in qkv's dtype, applied by MAX's ops."""
    rows = qkv.shape[0]
    nq = c.num_qo_heads * c.head_dim
    nk = c.num_kv_heads * c.head_dim
    batch_indices, positions = rows_index
    if pool.device == DeviceRef.CPU():
        q = graph_ops.rope_append_paged_kv_cache(
            pool, qkv, *rope, c.num_qo_heads, batch_indices, positions, *table
        )
    else:
        q, k, v = ops.split(qkv, [nq, nk, nk], axis=-1)
        q = _rope(ops.reshape(q, [rows, c.num_qo_heads, c.head_dim]), *rope)
        k = _rope(ops.reshape(k, [rows, c.num_kv_heads, c.head_dim]), *rope)
        v = ops.reshape(v, [rows, c.num_kv_heads, c.head_dim])
        # The manager made the table: no host round trip per layer.
        graph_ops.append_paged_kv_cache(pool, k, v, batch_indices, positions, *table, checked=False)
    scores = {
        "window_left": -1 if window is None else window - 1,
        "logits_soft_cap": c.attn_soft_cap,
        "sm_scale": c.attention_scale,
    }
    if kind == PREFILL:
        attn, _ = graph_ops.batch_prefill(q, pool, *table, *work, causal=True, **scores)
    else:
        attn, _ = graph_ops.batch_decode(
            q, pool, *table, *work, num_kv_heads=c.num_kv_heads, **scores
        )
    return ops.reshape(attn, [rows, nq])


def _rms_norm(c: DecoderConfig, x: TensorValue, weight: TensorValue) -> TensorValue:
    """RMSNorm of x over its last axis, in the family's order of rounding."""
    return ops.rms_norm(x, weight, c.rms_eps, multiply_before_cast=c.norm_in_float32)


def _qk_norm(c: DecoderConfig, qkv: TensorValue, q_norm: TensorValue, k_norm: TensorValue):
    """qkv [rows, (Hq + 2 Hkv) D] with each query and key head RMS-normed."""
    rows = qkv.shape[0]
    nq, nk = c.num_qo_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = ops.split(qkv, [nq, nk, nk], axis=-1)
    q = _rms_norm(c, ops.reshape(q, [rows, c.num_qo_heads, c.head_dim]), q_norm)
    k = _rms_norm(c, ops.reshape(k, [rows, c.num_kv_heads, c.head_dim]), k_norm)
    return ops.concat([ops.reshape(q, [rows, nq]), ops.reshape(k, [rows, nk]), v], axis=-1)


def _layer(
    kind: str,
    c: DecoderConfig,
    w: dict[str, TensorValue],
    x: TensorValue,
    rope: tuple[TensorValue, TensorValue],
    pools: list[BufferValue],
    rows_index: tuple[TensorValue, TensorValue],
    table: tuple[TensorValue, TensorValue, TensorValue],
    work: tuple[TensorValue, TensorValue],
    quantized: LayerFormats | None,
    window: int | None,
) -> TensorValue:
    """One decoder layer on x [rows, H] (or a run of fused ones, one pool
    each): attention over its pool (appending the rows' K/V first), then
    the MLP; returns the new x."""
    if quantized is not None and quantized.fused():
        split = quantized.qkv_parts()
        qkv_name, qkv_format = ("wqkv", quantized.wqkv) if split is None else ("wqk", split[0])
        layer = graph_ops.QuantizedLayerWeights(
            *(w[name] for name in ("attn_norm", qkv_name, "wo", "mlp_norm", "w_gate_up", "w_down")),
            formats=(qkv_format, quantized.wo, quantized.w_gate_up, quantized.w_down),
            q_norm=w["q_norm"] if c.qk_norm else None,
            k_norm=w["k_norm"] if c.qk_norm else None,
            post_attn_norm=w["post_attn_norm"] if c.sandwich_norms else None,
            post_mlp_norm=w["post_mlp_norm"] if c.sandwich_norms else None,
            wv=None if split is None else w["wv"],
            v_format=None if split is None else split[1],
            bqkv=w["bqkv"] if c.qkv_bias else None,
        )
        return graph_ops.quantized_decoder_layer(
            x,
            pools,
            layer,
            *rope,
            c.num_qo_heads,
            c.ffn_size,
            c.rms_eps,
            *rows_index,
            *table,
            *work,
            decode=kind == DECODE,
            activation=c.activation,
            window_left=-1 if window is None else window - 1,
            logits_soft_cap=c.attn_soft_cap,
            sm_scale=c.attention_scale,
        )

    out_features = {name: shape[-1] for name, shape in layer_weight_shapes(c).items()}
    out_features["w_gate_up"] = 2 * c.ffn_size

    def linear(h: TensorValue, name: str) -> TensorValue:
        fmt = getattr(quantized, name, None) if quantized is not None else None
        if name == "wqkv" and quantized is not None and quantized.qkv_parts() is not None:
            shapes = quantized_weight_shapes(c)
            parts = zip(("wqk", "wv"), quantized.qkv_parts(), strict=True)
            outs = [graph_ops.qlinear(h, w[p], f, shapes[p][0]) for p, f in parts]
            return ops.concat(outs, axis=-1)
        if fmt is not None:
            return graph_ops.qlinear(h, w[name], fmt, out_features[name])
        return graph_ops.linear(h, w[name], out_features[name])

    def gate_and_up(h: TensorValue) -> tuple[TensorValue, TensorValue]:
        if quantized is not None and quantized.w_gate_up is not None:
            gate, up = ops.split(linear(h, "w_gate_up"), [c.ffn_size, c.ffn_size], axis=-1)
            return gate, up
        return linear(h, "w_gate"), linear(h, "w_up")

    def sandwich(h: TensorValue, name: str) -> TensorValue:
        return _rms_norm(c, h, w[name]) if c.sandwich_norms else h

    qkv = linear(_rms_norm(c, x, w["attn_norm"]), "wqkv")
    if c.qkv_bias:
        qkv = qkv + w["bqkv"]
    if c.qk_norm:
        qkv = _qk_norm(c, qkv, w["q_norm"], w["k_norm"])
    attn = _attention(kind, c, qkv, rope, pools[0], rows_index, table, work, window)
    x = x + sandwich(linear(attn, "wo"), "post_attn_norm")
    gate, up = gate_and_up(_rms_norm(c, x, w["mlp_norm"]))
    gate = ops.silu(gate) if c.activation == "silu" else ops.gelu(gate, approximate="tanh")
    return x + sandwich(linear(gate * up, "w_down"), "post_mlp_norm")


def _layer_subgraph(
    g: Graph,
    kind: str,
    c: DecoderConfig,
    dtype: DType,
    device: DeviceRef,
    args: list,
    quantized: LayerFormats | None,
    window: int | None,
    name: str,
    layers: int = 1,
) -> Graph:
    """The decoder layer of one window (and, quantized, one set of formats)
    as subgraph `name` of g, compiled once and called by every such layer
    (or by every run of `layers` fused ones, `layer_runs`): its weights are
    placeholders ("attn_norm", ...) that each call resolves under its own
    prefix (`run_prefix`)."""
    with g.add_subgraph(
        name,
        input_types=[a.type for a in args],
        custom_extensions=graph_ops.custom_extensions(),
        devices=[device],
    ) as sub:
        x, cos, sin = sub.inputs[:3]
        pools = [p.buffer for p in sub.inputs[3 : 3 + layers]]
        batch_indices, positions, *rest = sub.inputs[3 + layers :]
        w = _layer_weights(c, dtype, device, quantized, layers=layers)
        table = tuple(v.tensor for v in rest[:3])
        work = tuple(v.tensor for v in rest[3:])
        sub.output(
            _layer(
                kind,
                c,
                w,
                x.tensor,
                (cos.tensor, sin.tensor),
                pools,
                (batch_indices.tensor, positions.tensor),
                table,
                work,
                quantized,
                window,
            )
        )
    return sub


def step_graph_name(kind: str) -> str:
    """The name of the prefill or decode step graph in its module."""
    return f"decoder_{kind}"


_ROPE_SOURCE_DIGEST = hashlib.sha256(
    Path(inspect.getsourcefile(rope_tables)).read_bytes()
).hexdigest()[:16]
"""What the kept RoPE tables depend on besides the model: the module of
`rope_tables` and of the config's RoPE fields."""


def rope_dir() -> Path:
    """The folder of the kept RoPE tables this version computes: named by
    the digest of `rope_tables`' module, so that a change to the formula
    makes them afresh and the older folders beside it are never read."""
    return cache_root() / "rope" / _ROPE_SOURCE_DIGEST


def rope_weights(c: DecoderConfig) -> dict[str, np.ndarray]:
    """The RoPE tables of each layer group ("rope_cos.{g}", "rope_sin.{g}",
    float32 [max_positions, D / 2]): weights of the graph, not constants,
    so a long context does not grow the compiled module. They are kept in
    `rope_dir()` (`kept_array`), named by the model's config and the
    group's window: a long context's
    tables (Gemma 3's are 64 MB) are mapped and shared, not computed and
    held by every process."""
    shape = (c.max_positions, c.head_dim // 2)
    folder = rope_dir()
    tables = {}
    for g, window in enumerate(group_windows(c)):
        # Pickled: every float of the config keeps all its bits.
        key = hashlib.sha256(pickle.dumps((c, window), protocol=4)).hexdigest()[:20]
        pair = functools.cache(functools.partial(rope_tables, c, window))
        for i, name in enumerate(("cos", "sin")):
            path = folder / f"{key}.{name}.npy"
            tables[f"rope_{name}.{g}"] = kept_array(
                path, shape, np.dtype(np.float32), lambda i=i, pair=pair: pair()[i]
            )
    return tables


def build_step_graph(
    kind: str,
    c: DecoderConfig,
    page_size: int,
    dtype: DType = DType.float32,
    device: DeviceRef | None = None,
    module: Module | None = None,
    quantized: QuantizedFormats | None = None,
) -> Graph:
    """The prefill or decode step graph; see step_input_names for its inputs.

    The layer is one subgraph per layer group (per sliding window) and set
    of product formats, called by each of its layers, so the graph's
    compile cost does not grow with the number of layers. dtype is the
    pools' (and in the float form the weights' and activations') dtype;
    `quantized` selects the quantized form (CPU; a product whose format the
    quantized product does not take multiplies float32 weights).

    Output: logits [batch, vocab] (float32) of each request's last token
    (decode), or [out_rows, vocab] of the rows `last_rows` names (prefill).
    """
    if quantized is not None and device not in (None, DeviceRef.CPU()):
        raise ValueError("quantized step graphs run on the CPU")
    device = device or DeviceRef.CPU()
    windows = group_windows(c)
    with Graph(
        step_graph_name(kind),
        input_types=_input_types(kind, c, page_size, dtype, device),
        custom_extensions=graph_ops.custom_extensions(),
        module=module,
    ) as g:
        named = dict(zip(step_input_names(kind, c), g.inputs, strict=True))
        w = _weights(c, dtype, device, quantized)
        act = DType.float32 if quantized is not None else dtype
        t = {k: v.tensor for k, v in named.items() if not k.startswith("pool.")}
        positions = t["positions"]
        groups = []
        for gi in range(len(windows)):
            rope = [
                Weight(f"{name}.{gi}", DType.float32, (c.max_positions, c.head_dim // 2), device)
                for name in ("rope_cos", "rope_sin")
            ]
            if device != DeviceRef.CPU():
                rope = [ops.cast(ops.unsqueeze(ops.gather(r, positions, 0), 1), act) for r in rope]
            groups.append(
                (
                    rope,
                    [t[f"kv_indices.{gi}"], t["kv_indptr"], t["kv_last_page_len"]],
                    [t[f"work_items.{gi}"], t[f"request_items.{gi}"]],
                )
            )

        x = _embedding(c, w, t["tokens"], quantized)  # [rows, H]
        if c.embed_scale != 1.0:
            x = x * ops.constant(c.embed_scale, act, device=device)
        layers: dict[tuple, Graph] = {}
        for run in layer_runs(c, quantized):
            window = c.window(run.start)
            formats = quantized.layers[run.start] if quantized is not None else None
            rope, table, work = groups[windows.index(window)]
            args = [
                x,
                *rope,
                *(named[f"pool.{i}"].buffer for i in run),
                t["batch_indices"],
                positions,
                *table,
                *work,
            ]
            key = (window, formats, len(run))
            if key not in layers:
                name = f"decoder_{kind}_layer" + ("" if window is None else f"_window_{window}")
                name += f"_{len(layers)}" if layers else ""
                layers[key] = _layer_subgraph(
                    g, kind, c, dtype, device, args, formats, window, name, len(run)
                )
            x = ops.call(layers[key], *args, prefix=run_prefix(run))[0].tensor
        if kind == PREFILL:
            x = ops.gather(x, t["last_rows"], 0)
        if quantized is not None and quantized.lm_head is not None:
            norm = (w["final_norm"], c.rms_eps)
            logits = graph_ops.qlinear(
                x, w["lm_head"], quantized.lm_head, c.vocab_size, rms_norm=norm
            )
        else:
            x = _rms_norm(c, x, w["final_norm"])
            logits = ops.cast(graph_ops.linear(x, w["lm_head"], c.vocab_size), DType.float32)
        if c.final_soft_cap is not None:
            cap = ops.constant(c.final_soft_cap, DType.float32, device=device)
            logits = ops.tanh(logits / cap) * cap
        g.output(logits)
    return g


def packed_float_names(quantized: Iterable[str]) -> set[str]:
    """The float weights that the packed matrices named `quantized` stand
    for in a quantized graph (its "w_gate_up" for "w_gate" and "w_up", its
    "wqk" for "wqkv"): a quantized graph never reads them."""
    names = set(quantized)
    names |= {name.replace("w_gate_up", part) for name in names for part in ("w_gate", "w_up")}
    return names | {name.replace(".wqk", ".wqkv") for name in names if name.endswith(".wqk")}


def _stack_runs(
    c: DecoderConfig, registry: dict[str, np.ndarray], formats: QuantizedFormats
) -> dict[str, np.ndarray]:
    """`registry` with each run of fused layers' weights stacked under the
    run's prefix in place of each layer's ("runs.{first}.{name}": the
    layers' arrays one after another along their first axis)."""
    for run in layer_runs(c, formats):
        if len(run) == 1:
            continue
        names = _layer_weights(c, DType.float32, DeviceRef.CPU(), formats.layers[run.start])
        for name in names:
            parts = [registry.pop(f"layers.{i}.{name}") for i in run]
            registry[run_prefix(run) + name] = _stacked(parts)
    return registry


def _stacked(parts: list[np.ndarray]) -> np.ndarray:
    """The arrays one after another along axis 0. Where they already lie so,
    in order and without gaps, in the one array they are slices of (the
    unpacked copy stacks each matrix's layers in one memory-mapped file),
    that array's slice: the weights stay mapped, not copied. Else a copy."""
    root = _root(parts[0])
    row = root.strides[0] if root.ndim and root.flags.c_contiguous else 0
    start = at = (_address(parts[0]) - _address(root)) // row if row else 0
    for part in parts:
        if (
            not row
            or _root(part) is not root
            or part.dtype != root.dtype
            or part.shape[1:] != root.shape[1:]
            or not part.flags.c_contiguous
            or _address(part) != _address(root) + at * row
        ):
            return np.concatenate(parts)
        at += len(part)
    return root[start:at]


def _root(array: np.ndarray) -> np.ndarray:
    """The array whose memory `array` views (itself if it owns it)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def weights_registry(
    c: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    dtype: DType,
    device: DeviceRef,
    quantized: dict | None = None,
) -> dict:
    """The weights as the graphs' Weight values want them, the RoPE tables
    (`rope_weights`, float32 in every form) among them.

    The quantized form takes the packed matrices of `quantized` and, from
    `weights`, the float32 norms and token embedding. The float form: on the
    CPU the matrices packed in panels (float32 ones once, on disk beside a
    memory-mapped copy), and cast to dtype (once per load)."""
    rope = rope_weights(c)
    on_cpu = device == DeviceRef.CPU()
    if quantized is not None:
        # Float32 everything the packed products do not cover: norms, the
        # embedding, and the matrices of products left float (the others are
        # never read, so a lazily dequantized model never makes them).
        covered = packed_float_names(quantized)
        floats = {
            name: pack_linear_weight_cached(weights[name])
            if on_cpu and _is_matrix(name)
            else weights[name]
            for name in weights
            if name not in covered
        }
        registry = {**floats, **{name: q.panels for name, q in quantized.items()}}
        return {**_stack_runs(c, registry, quantized_formats(quantized, c.num_layers)), **rope}
    if dtype == DType.float32:
        return {
            **{
                name: pack_linear_weight_cached(w) if on_cpu and _is_matrix(name) else w
                for name, w in weights.items()
            },
            **rope,
        }
    import warnings

    import torch

    registry = {}
    with warnings.catch_warnings():
        # Read-only (memory-mapped) weights: the cast copies, nothing writes them.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        for name, array in weights.items():
            value = torch.from_numpy(array).to(getattr(torch, dtype.name))
            registry[name] = pack_linear_weight(value) if on_cpu and _is_matrix(name) else value
    return {**registry, **rope}
