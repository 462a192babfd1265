"""Where the bfloat16 step graphs go wrong on a GPU: one short run that
tests each suspect apart (a minute or two of compiles on an H100; on the
CPU every line should read "ok").

What the H100 run of docs/gpu.md showed: the float32 step graphs serve
SmolLM2 token for token, the bfloat16 ones give garbage (max |logit diff|
25 on the random demo model, where the CPU's bfloat16 graphs stay at 0.14),
whichever decode kernel runs, with CUDA_LAUNCH_BLOCKING=1 too; in some runs
the append op's page-table check read zeros for its index arrays;
compute-sanitizer's memcheck found no access outside an allocation (MAX
sub-allocates an arena, so that proves little). A later run found two of
MAX's bfloat16 products wrong in one call and the same products right in
the next, and the demo still wrong with the weights transposed
(docs/gpu.md). The checks, in the order run:

0. ("layer") one decoder layer built by the step graphs' own code, every
   op's output in bfloat16 beside float32 (the first BAD line names the
   op);
1. the pool: the MAX buffer the engine makes of a bfloat16 torch pool must
   alias it (same address, the same bits read back);
2. MAX's own bfloat16 ops on the device (matmul with a [K, N] weight,
   at SmolLM2's product shapes too, [K, N] and [N, K] transposed;
   rms_norm; the RoPE gather and cast) against NumPy, and pagedkv's
   append op in a graph whose index arrays arrive as the engine sends
   them;
3. the step graphs' structure: a layer subgraph with bfloat16 placeholder
   weights, resolved by each call's prefix, appending to a pool per layer;
4. the step engine's prefill and decode logits against the float64
   reference: as it runs, with its index arrays sent through torch's stream
   instead of `Buffer.to`, and with the device synchronized after each
   upload.

    python benchmarks/kernel_investigations/bf16_step_bisect.py [--device gpu]
        [--parts layer,engine] [--max-16bit-products]

graph_ops.linear now multiplies a GPU's bfloat16 products in float32, around
MAX's 16-bit matmul on an H100, which reads memory it has not written
(docs/gpu.md). `--max-16bit-products` runs the checks with MAX's bfloat16
matmul instead: if that run goes wrong and the plain one does not, that
matmul was the fault.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import numpy as np


def check(name: str, diff: float, bound: float) -> None:
    print(f"{'ok  ' if diff <= bound else 'BAD '} {name}: {diff:.3g} (bound {bound:g})", flush=True)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (to nearest even), as float64."""
    import torch

    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).double().numpy()


def target_of(device: str):
    """MAX's driver device for "cpu" or "gpu"."""
    from max.driver import CPU

    from pagedkv._ops.tensors import Device, accelerator

    return accelerator(Device(device)) if device == "gpu" else CPU()


def upload(values: np.ndarray, target):
    """Host values as a buffer on target, sent as the engine sends its index
    arrays (`Buffer.to`)."""
    from max.driver import Buffer

    return Buffer.from_numpy(np.ascontiguousarray(values)).to(target)


def pool_aliases(torch_device: str) -> None:
    import torch
    from max.driver import CPU
    from max.dtype import DType

    from pagedkv._ops.tensors import to_buffer

    pool = torch.arange(4 * 2 * 16 * 2 * 64, dtype=torch.float32).reshape(4, 2, 16, 2, 64)
    pool = (pool / 7).to(torch.bfloat16).to(torch_device)
    buffer = to_buffer(pool, stream_ordered=True)
    if torch_device == "cuda":
        torch.cuda.synchronize()
    back = buffer.to(CPU()).view(DType.uint16).to_numpy()
    want = pool.cpu().view(torch.int16).numpy().view(np.uint16)
    check("pool: MAX's buffer reads the torch pool's bits", float((back != want).sum()), 0)
    check("pool: same address", float(buffer._data_ptr() != pool.data_ptr()), 0)


def single_ops(device: str) -> None:
    """One graph: MAX's bf16 matmul, rms_norm, gather + cast, and the append op
    of rows from an input and of K and V split from a row of projections, as
    the step graphs append them on a GPU."""
    import torch
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, Graph, TensorType, Weight, ops

    from pagedkv import graph_ops
    from pagedkv._ops.tensors import Device, to_buffer

    ref = Device(device).graph_ref()
    rng = np.random.default_rng(0)
    m, k, n, pages, heads, dim = 5, 576, 960, 4, 2, 64
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    g = rng.standard_normal(k).astype(np.float32)
    table = rng.standard_normal((64, 32)).astype(np.float32)
    positions = np.array([3, 17, 0, 40, 9], np.int32)
    rows = rng.standard_normal((m, heads, dim)).astype(np.float32)
    # Five tokens appended at positions 0..4 of one request on pages [2, 0].
    index = {
        "batch_indices": np.zeros(m, np.int32),
        "positions": np.arange(m, dtype=np.int32),
        "kv_indices": np.array([2, 0], np.int32),
        "kv_indptr": np.array([0, 1], np.int32),
        "kv_last_page_len": np.array([m], np.int32),
    }
    f32, bf16, i32 = DType.float32, DType.bfloat16, DType.int32
    types = [
        TensorType(f32, [m, k], ref), TensorType(f32, [k, n], ref), TensorType(f32, [k], ref),
        TensorType(f32, [64, 32], ref), TensorType(i32, [m], ref),
        TensorType(f32, [m, heads, dim], ref),
        *[TensorType(i32, [len(v)], ref) for v in index.values()],
        BufferType(bf16, [pages, 2, 16, heads, dim], ref),
        BufferType(bf16, [pages, 2, 16, heads, dim], ref),
    ]  # fmt: skip
    with Graph("bisect", input_types=types, custom_extensions=graph_ops.custom_extensions()) as gr:
        xv, wv, gv, tv, pv, rv, bi, pos, ki, kp, kl, pool, split_pool = gr.inputs
        xb, wb = ops.cast(xv.tensor, bf16), ops.cast(wv.tensor, bf16)
        prod = ops.cast(xb @ wb, f32)
        # The step graphs' bfloat16 weights come as torch CPU tensors.
        wt = Weight("w", bf16, [k, n], device=ref)
        from_weight = ops.cast(xb @ wt, f32)
        rows_of_weight = ops.cast(ops.gather(wt, pv.tensor, 0), f32)
        norm = ops.cast(ops.rms_norm(xb, ops.cast(gv.tensor, bf16), 1e-5), f32)
        rope = ops.cast(ops.cast(ops.gather(tv.tensor, pv.tensor, 0), bf16), f32)
        rb = ops.cast(rv.tensor, bf16)
        table_values = (bi.tensor, pos.tensor, ki.tensor, kp.tensor, kl.tensor)
        graph_ops.append_paged_kv_cache(pool.buffer, rb, rb, *table_values)
        # x's last 2 * heads * dim columns as the step graph's K and V.
        nq = k - 2 * heads * dim
        _, xk, xv_ = ops.split(xb, [nq, heads * dim, heads * dim], axis=-1)
        xk, xv_ = (ops.reshape(t, [m, heads, dim]) for t in (xk, xv_))
        graph_ops.append_paged_kv_cache(split_pool.buffer, xk, xv_, *table_values)
        gr.output(prod, norm, rope, from_weight, rows_of_weight)
    target = target_of(device)
    w_torch = torch.from_numpy(w).to(torch.bfloat16)
    model = InferenceSession(devices=[target]).load(gr, weights_registry={"w": w_torch})
    torch_device = "cuda" if device == "gpu" else "cpu"
    pool_t = torch.zeros(pages, 2, 16, heads, dim, dtype=torch.bfloat16, device=torch_device)
    split_t = torch.zeros_like(pool_t)

    args = [upload(a, target) for a in (x, w, g, table, positions, rows, *index.values())]
    pools = (to_buffer(t, stream_ordered=True) for t in (pool_t, split_t))
    outs = model.execute(*args, *pools)
    prod, norm, rope, from_weight, rows_of_weight = (o.to(CPU()).to_numpy() for o in outs)
    xr, wr = bf16_round(x), bf16_round(w)
    check("MAX bf16 matmul x @ w[K, N]", np.abs(prod - xr @ wr).max(), 0.05)
    rms = xr / np.sqrt((xr**2).mean(-1, keepdims=True) + 1e-5) * bf16_round(g)
    check("MAX bf16 rms_norm", np.abs(norm - rms).max(), 0.05)
    check("MAX gather + bf16 cast", np.abs(rope - bf16_round(table[positions])).max(), 0)
    check("bf16 weight from torch: x @ w", np.abs(from_weight - xr @ wr).max(), 0.05)
    check("bf16 weight from torch: its rows", np.abs(rows_of_weight - wr[positions]).max(), 0)
    if device == "gpu":
        torch.cuda.synchronize()
    got = pool_t.float().cpu().numpy()
    want = bf16_round(rows)
    check("append op in a graph: keys", np.abs(got[2, 0, :m] - want).max(), 0)
    check("append op in a graph: values", np.abs(got[2, 1, :m] - want).max(), 0)
    split = split_t.float().cpu().numpy()
    xk, xv = (xr[:, k - (2 - i) * heads * dim :][:, : heads * dim] for i in range(2))
    check("append of split K", np.abs(split[2, 0, :m] - xk.reshape(m, heads, dim)).max(), 0)
    check("append of split V", np.abs(split[2, 1, :m] - xv.reshape(m, heads, dim)).max(), 0)
    check("append op in a graph: other pages untouched", np.abs(got[[0, 1, 3]]).max(), 0)


@contextmanager
def captured_layer_ops(captured: list):
    """While inside, the step graphs' norms, RoPE, attention, products and
    SiLU append (name, output value) to `captured` as a graph is built."""
    from max.graph import ops

    from pagedkv import graph_ops
    from pagedkv.graphs import decoder

    def capture(name, fn):
        def wrapped(*call_args, **call_kwargs):
            out = fn(*call_args, **call_kwargs)
            first = out[0] if isinstance(out, tuple) else out
            captured.append((f"{name} {len(captured)}", first))
            return out

        return wrapped

    saved = {n: getattr(decoder, n) for n in ("_rms_norm", "_rope", "_attention")}
    saved_linear, saved_silu = graph_ops.linear, ops.silu
    for n, fn in saved.items():
        setattr(decoder, n, capture(n.strip("_"), fn))
    graph_ops.linear, ops.silu = capture("linear", saved_linear), capture("silu", saved_silu)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(decoder, n, fn)
        graph_ops.linear, ops.silu = saved_linear, saved_silu


def decode_inputs(c, device: str) -> dict:
    """A decode step of 3 requests (37, 20 and 5 tokens, the last one new)
    over a pool of 8 pages of 16 filled with bfloat16-exact values: the
    layer's input rows, their RoPE rows, the pool's values and the index
    arrays (batch_indices, positions, the page table, the work list)."""
    from pagedkv import graph_ops

    rng = np.random.default_rng(4)
    page, pages, half = 16, 8, c.head_dim // 2
    lens = np.array([37, 20, 5])
    counts = -(-lens // page)
    kv_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    kv_indices = rng.permutation(pages)[: kv_indptr[-1]].astype(np.int32)
    last = (lens - (counts - 1) * page).astype(np.int32)
    positions = (lens - 1).astype(np.int32)
    items, request_items = graph_ops.decode_work(
        kv_indptr, last, page, c.num_qo_heads, c.num_kv_heads, c.head_dim, gpu=device == "gpu"
    )
    angles = positions[:, None] / 10000.0 ** (np.arange(half) / half)
    pool_shape = (pages, 2, page, c.num_kv_heads, c.head_dim)
    return {
        "x": rng.standard_normal((len(lens), c.hidden_size)).astype(np.float32),
        "rope": [f(angles).astype(np.float32)[:, None] for f in (np.cos, np.sin)],
        "pool": bf16_round(rng.standard_normal(pool_shape)).astype(np.float32),
        "index": (
            np.arange(len(lens), dtype=np.int32),
            positions,
            kv_indices,
            kv_indptr,
            last,
            items,
            request_items,
        ),
    }


def layer_outputs(c, layer: dict, inputs: dict, dtype, device: str):
    """(names, values) of every op captured in one decoder layer's graph of
    `dtype`, run on `inputs` (decode_inputs)."""
    import torch
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, Graph, TensorType, ops

    from pagedkv import graph_ops
    from pagedkv._ops.tensors import Device, to_buffer
    from pagedkv.graphs import decoder

    ref = Device(device).graph_ref()
    i32, f32 = DType.int32, DType.float32
    x, rope_rows, index = inputs["x"], inputs["rope"], inputs["index"]
    types = [
        TensorType(f32, list(x.shape), ref),
        *[TensorType(f32, list(r.shape), ref) for r in rope_rows],
        BufferType(dtype, list(inputs["pool"].shape), ref),
        *[TensorType(i32, list(v.shape), ref) for v in index],
    ]
    captured: list = []
    with captured_layer_ops(captured), Graph(
        f"layer_{dtype.name}", input_types=types, custom_extensions=graph_ops.custom_extensions()
    ) as g:  # fmt: skip
        xv, cv, sv, pool, bi, pos, ki, kp, kl, wi, ri = g.inputs
        w = decoder._layer_weights(c, dtype, ref, None, placeholder=False)
        rope = (ops.cast(cv.tensor, dtype), ops.cast(sv.tensor, dtype))
        if ref == Device("cpu").graph_ref():
            # The CPU's fused op takes the whole tables.
            tables = decoder.rope_tables(c)
            rope = tuple(ops.constant(t, f32, device=ref) for t in tables)
        out = decoder._layer(
            decoder.DECODE, c, w, ops.cast(xv.tensor, dtype), rope, pool.buffer,
            (bi.tensor, pos.tensor), (ki.tensor, kp.tensor, kl.tensor), (wi.tensor, ri.tensor),
            None, None,
        )  # fmt: skip
        captured.append(("layer output", out))
        g.output(*(ops.cast(v, f32) for _, v in captured))
    target = target_of(device)
    registry = decoder.weights_registry(c, layer, dtype, ref)
    model = InferenceSession(devices=[target]).load(g, weights_registry=registry)
    pool_t = torch.from_numpy(inputs["pool"]).to(getattr(torch, dtype.name))
    pool_t = pool_t.to("cuda" if device == "gpu" else "cpu")
    outs = model.execute(
        *(upload(a, target) for a in (x, *rope_rows)),
        to_buffer(pool_t, stream_ordered=True),
        *(upload(a, target) for a in index),
    )
    return [n for n, _ in captured], [o.to(CPU()).to_numpy() for o in outs]


def layer_intermediates(device: str) -> None:
    """One decoder layer of the random demo model, built by the step graphs'
    own code (decoder._layer), decoding 3 requests over a filled pool, in
    bfloat16 beside float32: every product, norm, RoPE, attention and
    activation it computes is an output of the graph, and each bfloat16 one
    is held to its float32 twin (relative to the float32 values' largest).
    The first BAD line names the op that goes wrong; the float32 graph is
    the form verified on a GPU (SmolLM2 token-exact)."""
    from max.dtype import DType

    from pagedkv.graphs.demo import DemoOptions, plan_demo

    plan = plan_demo(DemoOptions(device="cpu", model="random", layers=1, weights="f32"))
    c = plan.config
    layer = {k.removeprefix("layers.0."): v for k, v in plan.weights.items() if "layers." in k}
    inputs = decode_inputs(c, device)
    names, want = layer_outputs(c, layer, inputs, DType.float32, device)
    got_names, got = layer_outputs(c, layer, inputs, DType.bfloat16, device)
    if names != got_names:
        print(f"BAD  the two graphs captured different ops: {names} / {got_names}")
        return
    for name, a, w in zip(names, got, want, strict=True):
        scale = float(np.abs(w).max()) or 1.0
        relative = np.abs(a - w).max() / scale
        check(f"layer {name} {list(w.shape)}: bf16 vs f32, relative", relative, 0.05)


def subgraph_layers(device: str) -> None:
    """The step graphs' structure in small: one layer subgraph whose weights
    are bfloat16 placeholders resolved by each call's prefix ("layers.{i}."),
    taking a pool buffer and appending K and V split from its product, called
    once per layer on a pool of its own."""
    import torch
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, Graph, TensorType, Weight, ops

    from pagedkv import graph_ops
    from pagedkv._ops.tensors import Device, to_buffer

    ref = Device(device).graph_ref()
    rng = np.random.default_rng(3)
    m, heads, dim, pages, layers = 5, 2, 64, 4, 2
    k = 2 * heads * dim
    x = rng.standard_normal((m, k)).astype(np.float32)
    ws = [(rng.standard_normal((k, k)) / np.sqrt(k)).astype(np.float32) for _ in range(layers)]
    index = (np.zeros(m, np.int32), np.arange(m, dtype=np.int32), np.array([2, 0], np.int32),
             np.array([0, 1], np.int32), np.array([m], np.int32))  # fmt: skip
    bf16, f32, i32 = DType.bfloat16, DType.float32, DType.int32
    pool_type = BufferType(bf16, [pages, 2, 16, heads, dim], ref)
    index_types = [TensorType(i32, [len(v)], ref) for v in index]
    types = [TensorType(f32, [m, k], ref), *index_types, *[pool_type] * layers]
    with Graph("layers", input_types=types, custom_extensions=graph_ops.custom_extensions()) as g:
        xv, *rest = g.inputs
        table, pools = [v.tensor for v in rest[:5]], rest[5:]
        sub_types = [TensorType(bf16, [m, k], ref), pool_type, *index_types]
        with g.add_subgraph(
            "layer", input_types=sub_types, custom_extensions=graph_ops.custom_extensions(),
            devices=[ref],
        ) as sub:  # fmt: skip
            sx, pool, *idx = sub.inputs
            w = Weight("w", bf16, [k, k], device=ref, _placeholder=True)
            y = sx.tensor @ w  # MAX's own bfloat16 matmul
            yk, yv = (ops.reshape(t, [m, heads, dim]) for t in ops.split(y, [k // 2, k // 2], -1))
            graph_ops.append_paged_kv_cache(pool.buffer, yk, yv, *(v.tensor for v in idx))
            sub.output(sx.tensor + y)
        h = ops.cast(xv.tensor, bf16)
        for i in range(layers):
            h = ops.call(sub, h, pools[i].buffer, *table, prefix=f"layers.{i}.")[0].tensor
        g.output(ops.cast(h, f32))
    target = target_of(device)
    registry = {f"layers.{i}.w": torch.from_numpy(w).to(torch.bfloat16) for i, w in enumerate(ws)}
    model = InferenceSession(devices=[target]).load(g, weights_registry=registry)
    torch_device = "cuda" if device == "gpu" else "cpu"
    pool_ts = [
        torch.zeros(pages, 2, 16, heads, dim, dtype=torch.bfloat16, device=torch_device)
        for _ in range(layers)
    ]
    args = [upload(a, target) for a in (x, *index)]
    (out,) = model.execute(*args, *(to_buffer(t, stream_ordered=True) for t in pool_ts))
    out = out.to(CPU()).to_numpy()
    if device == "gpu":
        torch.cuda.synchronize()
    h = bf16_round(x)
    for i, w in enumerate(ws):
        y = h @ bf16_round(w)
        got = pool_ts[i].float().cpu().numpy()
        kv = y.reshape(m, 2, heads, dim)
        for j, part in enumerate(("keys", "values")):
            check(
                f"subgraph layer {i}: appended {part}", np.abs(got[2, j, :m] - kv[:, j]).max(), 0.05
            )
        check(f"subgraph layer {i}: other pages untouched", np.abs(got[[0, 1, 3]]).max(), 0)
        h = h + y
    check("subgraph layers: output", np.abs(out - h).max(), 0.1)


def products(device: str) -> None:
    """MAX's bfloat16 matmuls at SmolLM2's shapes (bfloat16 weights handed
    over as torch tensors, as the step graphs' are) for several row counts,
    each weight two ways: [K, N] multiplied as it is, and [N, K] multiplied
    by its transpose (MAX's Linear form). A kernel choice that depends on
    the shape or the layout shows here."""
    import torch
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import Graph, TensorType, Weight, ops

    from pagedkv._ops.tensors import Device

    ref = Device(device).graph_ref()
    shapes = {"wqkv": (576, 960), "wo": (576, 576), "w_gate_up": (576, 3072),
              "w_down": (1536, 576), "lm_head": (576, 49152)}  # fmt: skip
    rng = np.random.default_rng(2)
    weights = {
        n: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for n, s in shapes.items()
    }
    types = [TensorType(DType.float32, ["m", k], ref) for k in (576, 1536)]
    with Graph("products", input_types=types) as g:
        x576, x1536 = (ops.cast(v.tensor, DType.bfloat16) for v in g.inputs)
        outs = []
        for name, (k, n) in shapes.items():
            x = x576 if k == 576 else x1536
            w = Weight(name, DType.bfloat16, [k, n], device=ref)
            wt = Weight(f"{name}.t", DType.bfloat16, [n, k], device=ref)
            outs += [ops.cast(x @ w, DType.float32), ops.cast(x @ wt.T, DType.float32)]
        g.output(*outs)
    target = target_of(device)
    registry = {}
    for name, w in weights.items():
        registry[name] = torch.from_numpy(w).to(torch.bfloat16)
        registry[f"{name}.t"] = registry[name].T.contiguous()
    model = InferenceSession(devices=[target]).load(g, weights_registry=registry)
    for m in (1, 5, 37, 64, 300):
        xs = [rng.standard_normal((m, k)).astype(np.float32) for k in (576, 1536)]
        got = [o.to(CPU()).to_numpy() for o in model.execute(*(upload(x, target) for x in xs))]
        for i, (name, (k, n)) in enumerate(shapes.items()):
            want = bf16_round(xs[0 if k == 576 else 1]) @ bf16_round(weights[name])
            for y, form in zip(got[2 * i : 2 * i + 2], ("[K, N]", "[N, K].T"), strict=True):
                diff = np.abs(y - want).max()
                check(f"MAX bf16 {name} [{m}, {k}] @ {form} of {(k, n)}", diff, 0.05)


def engine_logits(device: str) -> None:
    """The step engine on the random demo model, three ways of sending its
    index arrays; each way on prompts of its own (no prefix hits across)."""
    import torch

    from pagedkv._ops.tensors import accelerator, new_like, to_buffer
    from pagedkv.cache.manager import PagedKVCacheManager
    from pagedkv.graphs.demo import DemoOptions, plan_demo
    from pagedkv.graphs.engine import DecoderEngine
    from pagedkv.graphs.numpy_reference import DenseDecoder

    # The plan's weights are float32 whatever the form; the bfloat16 graphs
    # come from the manager's dtype.
    plan = plan_demo(DemoOptions(device=device, model="random", layers=2, weights="f32"))
    c = plan.config
    manager = PagedKVCacheManager(
        256, 16, c.num_kv_heads, c.head_dim, num_layers=c.num_layers, dtype="bfloat16",
        device="cuda" if device == "gpu" else "cpu",
    )  # fmt: skip
    engine = DecoderEngine(c, plan.weights, manager)
    as_is = engine._index_buffer
    pool = manager.pools[0]
    kept: list = []

    def through_torch(values):
        t = new_like(pool, np.ascontiguousarray(values, np.int32))
        kept.append(t)  # alive until the step's stream work is done (synchronized below)
        return to_buffer(t, stream_ordered=True)

    def synchronized(values):
        buffer = as_is(values)
        if engine.device.is_gpu:
            accelerator(engine.device).synchronize()
        return buffer

    rng = np.random.default_rng(1)
    for name, send in (("as is", as_is), ("via torch", through_torch), ("synced", synchronized)):
        engine._index_buffer = send
        prompts = [list(rng.integers(0, c.vocab_size, size)) for size in (37, 20, 5)]
        ids = [f"{name}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            manager.add(rid, p)
        refs = [DenseDecoder(c, plan.weights) for _ in prompts]
        want = np.stack([r.feed(p) for r, p in zip(refs, prompts, strict=True)])
        got = engine.prefill(ids, prompts)
        if engine.device.is_gpu:
            torch.cuda.synchronize()
        check(f"engine {name}: prefill logits", np.abs(got - want).max(), 1.0)
        for step in range(2):
            tokens = [int(t) for t in want.argmax(-1)]
            want = np.stack([r.feed([t]) for r, t in zip(refs, tokens, strict=True)])
            got = engine.decode(ids, tokens)
            if engine.device.is_gpu:
                torch.cuda.synchronize()
            check(f"engine {name}: decode {step + 1} logits", np.abs(got - want).max(), 1.0)
        for rid in ids:
            manager.release(rid)
        kept.clear()


def multiply_with_max_16bit() -> None:
    """From now on this process's graphs multiply GPU products of 16-bit
    operands with MAX's own 16-bit matmul, as the step graphs did before
    graph_ops.linear took them to float32: whether MAX's bfloat16 matmul
    alone made the step graphs go wrong. The disk compile cache is turned
    off, so that no graph compiled this way is kept or loaded under the
    plain graphs' names."""
    import os

    from max.graph import DeviceRef

    from pagedkv import graph_ops

    os.environ["PAGEDKV_COMPILE_CACHE"] = "0"
    plain = graph_ops.linear

    def linear(x, weight, out_features=None):
        if weight.device == DeviceRef.CPU():
            return plain(x, weight, out_features)
        return x @ weight

    graph_ops.linear = linear


PARTS = ("layer", "pool", "ops", "subgraph", "products", "engine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--parts", default=",".join(PARTS), help="a comma list of %(default)s")
    parser.add_argument(
        "--max-16bit-products",
        action="store_true",
        help="multiply bfloat16 products with MAX's bfloat16 matmul",
    )
    args = parser.parse_args()
    if args.max_16bit_products:
        multiply_with_max_16bit()
    parts = args.parts.split(",")
    if "layer" in parts:
        layer_intermediates(args.device)
    if "pool" in parts:
        pool_aliases("cuda" if args.device == "gpu" else "cpu")
    checks = {"ops": single_ops, "subgraph": subgraph_layers, "products": products}
    checks["engine"] = engine_logits
    for name, run in checks.items():
        if name in parts:
            run(args.device)


if __name__ == "__main__":
    main()
