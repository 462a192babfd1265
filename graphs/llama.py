"""The model's step graphs: a decoder layer stack over pagedkv's paged cache.

Two graphs share the layer code and the weights: a prefill graph (a ragged
batch of many tokens per request, causal attention through pagedkv's prefill
op) and a decode graph (one token per request, pagedkv's decode op). Each
layer appends its new K/V into its pool, a graph buffer written in place,
then attends over the pool; both take every count (batch, tokens, pages,
work items) as a symbolic dim, so one compile serves every step of a run.

The layer is a subgraph that each layer calls with its own pool and its
own weights (by name prefix), so compiling 30 layers costs about what one
does. The products go through graph_ops.linear: on the CPU pagedkv's op
over weights packed in panels at load (MAX's CPU matmul would dominate a
cold compile: docs/performance.md), on a GPU MAX's matmul. Per layer:
RMSNorm, fused QKV projection, RoPE on q and k (the cache holds rotated
keys), append, paged attention, output projection and residual,
RMSNorm, SwiGLU MLP and residual; then a final norm and the logits of each
request's last token.
"""

from __future__ import annotations

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
from pagedkv.linear_panels import (
    linear_panels_shape,
    pack_linear_weight,
    pack_linear_weight_cached,
)

from .model import LlamaConfig, layer_weight_shapes, rope_tables

PREFILL = "prefill"
DECODE = "decode"


def step_input_names(kind: str, num_layers: int) -> tuple[str, ...]:
    """The order of a step graph's inputs (what the engine feeds)."""
    common = (
        "tokens",
        "positions",
        "batch_indices",
        "kv_indices",
        "kv_indptr",
        "kv_last_page_len",
        "work_items",
        "request_items",
    )
    extra = ("last_rows",) if kind == PREFILL else ()
    return common + extra + tuple(f"pool.{i}" for i in range(num_layers))


def _input_types(
    kind: str, c: LlamaConfig, page_size: int, dtype: DType, device: DeviceRef
) -> list:
    i32 = DType.int32
    rows = "tokens" if kind == PREFILL else "batch"

    def index(dim: str) -> TensorType:
        return TensorType(i32, [dim], device=device)

    types = [
        index(rows),
        index(rows),
        index(rows),
        index("used_pages"),
        index("batch_plus_1"),
        index("batch"),
        TensorType(i32, ["items", 6], device=device),
        index("batch_plus_1"),
    ]
    if kind == PREFILL:
        types.append(index("batch"))
    pool = BufferType(dtype, ["pages", 2, page_size, c.num_kv_heads, c.head_dim], device=device)
    return types + [pool] * c.num_layers


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


def _weights(c: LlamaConfig, dtype: DType, device: DeviceRef) -> dict[str, Weight]:
    """The weights outside the layers (the layers' come by prefix: _layer_subgraph)."""
    shapes = {
        "embed": (c.vocab_size, c.hidden_size),
        "final_norm": (c.hidden_size,),
        "lm_head": (c.hidden_size, c.vocab_size),
    }
    return {name: _weight(name, dtype, shape, device) for name, shape in shapes.items()}


def _layer(
    kind: str,
    c: LlamaConfig,
    w: dict[str, TensorValue],
    x: TensorValue,
    rope: tuple[TensorValue, TensorValue],
    pool: BufferValue,
    rows_index: tuple[TensorValue, TensorValue],
    table: tuple[TensorValue, TensorValue, TensorValue],
    work: tuple[TensorValue, TensorValue],
) -> TensorValue:
    """One decoder layer on x [rows, H]: attention over its pool (appending
    the rows' K/V first), then the MLP; returns the new x."""
    rows = x.shape[0]
    nq = c.num_qo_heads * c.head_dim
    nk = c.num_kv_heads * c.head_dim
    batch_indices, positions = rows_index
    out_features = {name: shape[-1] for name, shape in layer_weight_shapes(c).items()}

    def linear(h: TensorValue, name: str) -> TensorValue:
        return graph_ops.linear(h, w[name], out_features[name])

    h = ops.rms_norm(x, w["attn_norm"], c.rms_eps)
    q, k, v = ops.split(linear(h, "wqkv"), [nq, nk, nk], axis=-1)
    q = _rope(ops.reshape(q, [rows, c.num_qo_heads, c.head_dim]), *rope)
    k = _rope(ops.reshape(k, [rows, c.num_kv_heads, c.head_dim]), *rope)
    v = ops.reshape(v, [rows, c.num_kv_heads, c.head_dim])
    graph_ops.append_paged_kv_cache(pool, k, v, batch_indices, positions, *table)
    if kind == PREFILL:
        attn, _ = graph_ops.batch_prefill(q, pool, *table, *work, causal=True)
    else:
        attn, _ = graph_ops.batch_decode(q, pool, *table, *work, num_kv_heads=c.num_kv_heads)
    x = x + linear(ops.reshape(attn, [rows, nq]), "wo")
    h = ops.rms_norm(x, w["mlp_norm"], c.rms_eps)
    return x + linear(ops.silu(linear(h, "w_gate")) * linear(h, "w_up"), "w_down")


def _layer_subgraph(
    g: Graph, kind: str, c: LlamaConfig, dtype: DType, device: DeviceRef, args: list
) -> Graph:
    """The decoder layer as a subgraph of g, compiled once and called once
    per layer: its weights are placeholders ("attn_norm", ...) that each
    call resolves under its own prefix ("layers.{i}.")."""
    with g.add_subgraph(
        f"llama_{kind}_layer",
        input_types=[a.type for a in args],
        custom_extensions=graph_ops.custom_extensions(),
        devices=[device],
    ) as sub:
        x, cos, sin, pool, batch_indices, positions, *rest = sub.inputs
        w = {
            name: _weight(name, dtype, shape, device, placeholder=True)
            for name, shape in layer_weight_shapes(c).items()
        }
        table = tuple(v.tensor for v in rest[:3])
        work = tuple(v.tensor for v in rest[3:])
        sub.output(
            _layer(
                kind,
                c,
                w,
                x.tensor,
                (cos.tensor, sin.tensor),
                pool.buffer,
                (batch_indices.tensor, positions.tensor),
                table,
                work,
            )
        )
    return sub


def step_graph_name(kind: str) -> str:
    """The name of the prefill or decode step graph in its module."""
    return f"llama_{kind}"


def build_step_graph(
    kind: str,
    c: LlamaConfig,
    page_size: int,
    dtype: DType = DType.float32,
    device: DeviceRef | None = None,
    module: Module | None = None,
) -> Graph:
    """The prefill or decode step graph; see step_input_names for its inputs.

    The layer is one subgraph called once per layer, so the graph's compile
    cost does not grow with the number of layers.

    Output: logits [batch, vocab] (float32) of each request's last token.
    """
    device = device or DeviceRef.CPU()
    cos_table, sin_table = rope_tables(c)
    with Graph(
        step_graph_name(kind),
        input_types=_input_types(kind, c, page_size, dtype, device),
        custom_extensions=graph_ops.custom_extensions(),
        module=module,
    ) as g:
        named = dict(zip(step_input_names(kind, c.num_layers), g.inputs, strict=True))
        w = _weights(c, dtype, device)
        t = {k: v.tensor for k, v in named.items() if not k.startswith("pool.")}
        positions = t["positions"]
        rope_cos = ops.unsqueeze(
            ops.gather(ops.constant(cos_table, DType.float32, device=device), positions, 0), 1
        )
        rope_sin = ops.unsqueeze(
            ops.gather(ops.constant(sin_table, DType.float32, device=device), positions, 0), 1
        )
        rope_cos, rope_sin = ops.cast(rope_cos, dtype), ops.cast(rope_sin, dtype)
        table = [t["kv_indices"], t["kv_indptr"], t["kv_last_page_len"]]
        work = [t["work_items"], t["request_items"]]

        x = ops.gather(w["embed"], t["tokens"], 0)  # [rows, H]
        layer = None
        for i in range(c.num_layers):
            args = [
                x,
                rope_cos,
                rope_sin,
                named[f"pool.{i}"].buffer,
                t["batch_indices"],
                positions,
                *table,
                *work,
            ]
            if layer is None:
                layer = _layer_subgraph(g, kind, c, dtype, device, args)
            x = ops.call(layer, *args, prefix=f"layers.{i}.")[0].tensor
        if kind == PREFILL:
            x = ops.gather(x, t["last_rows"], 0)
        x = ops.rms_norm(x, w["final_norm"], c.rms_eps)
        g.output(ops.cast(graph_ops.linear(x, w["lm_head"], c.vocab_size), DType.float32))
    return g


def weights_registry(weights: dict[str, np.ndarray], dtype: DType, device: DeviceRef) -> dict:
    """The weights as the graphs' Weight values want them: on the CPU the
    matrices packed in panels (float32 ones once, on disk beside a
    memory-mapped copy), and cast to dtype (once per load)."""
    on_cpu = device == DeviceRef.CPU()
    if dtype == DType.float32:
        return {
            name: pack_linear_weight_cached(w) if on_cpu and _is_matrix(name) else w
            for name, w in weights.items()
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
    return registry
