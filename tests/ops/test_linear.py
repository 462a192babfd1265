"""graph_ops.linear on the CPU: pagedkv's product over packed weight panels
against a float64 NumPy reference, at every remainder of the kernel's tiles
(rows not a multiple of the register tile, columns not a multiple of a
panel, odd K, many tasks), float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, Module, TensorType

from pagedkv import graph_ops
from pagedkv._ops.linear_panels import linear_panels_shape, pack_linear_weight
from suite_graphs import ops_graph, suite_graph, suite_model

# (K, N, dtype): a tail panel, whole panels, one column, and bfloat16.
PRODUCTS = [
    (37, 100, DType.float32),
    (64, 192, DType.float32),
    (5, 1, DType.float32),
    (48, 70, DType.bfloat16),
]
ROWS = [1, 2, 3, 4, 5, 6, 7, 11, 13, 50, 389]


@suite_graph("linear_products")
def linear_products(module: Module) -> None:
    cpu = DeviceRef.CPU()
    types = [TensorType(dt, ["m", k], cpu) for k, _, dt in PRODUCTS]
    types += [TensorType(dt, linear_panels_shape(k, n), cpu) for k, n, dt in PRODUCTS]
    with ops_graph(module, "linear_products", types) as g:
        xs, ws = g.inputs[: len(PRODUCTS)], g.inputs[len(PRODUCTS) :]
        g.output(
            *(
                graph_ops.linear(x.tensor, w.tensor, n)
                for x, w, (_, n, _) in zip(xs, ws, PRODUCTS, strict=True)
            )
        )


@pytest.fixture
def linear_model():
    return suite_model("linear_products")


def torch_dtype(dtype: DType) -> torch.dtype:
    return getattr(torch, dtype.name)


@pytest.mark.parametrize("rows", ROWS)
def test_linear_matches_float64(linear_model, rows):
    gen = torch.Generator().manual_seed(rows)
    xs, ws = [], []
    for k, n, dt in PRODUCTS:
        xs.append(torch.randn(rows, k, generator=gen).to(torch_dtype(dt)))
        ws.append(torch.randn(k, n, generator=gen).to(torch_dtype(dt)))
    args = [Buffer.from_dlpack(x) for x in xs]
    args += [Buffer.from_dlpack(pack_linear_weight(w)) for w in ws]
    outs = linear_model.execute(*args)
    for out, x, w, (k, n, dt) in zip(outs, xs, ws, PRODUCTS, strict=True):
        got = torch.from_dlpack(out)
        assert got.shape == (rows, n) and got.dtype == torch_dtype(dt)
        ref = x.double().numpy() @ w.double().numpy()
        # float32 sums over K; bfloat16 rounds the output once.
        rtol = 2e-6 * np.sqrt(k) if dt == DType.float32 else 2**-8
        scale = np.abs(x.double().numpy()) @ np.abs(w.double().numpy())
        np.testing.assert_array_less(np.abs(got.double().numpy() - ref), rtol * scale + 1e-30)


def test_packing_is_a_bitwise_permutation():
    w = np.random.default_rng(0).standard_normal((9, 130)).astype(np.float32)
    panels = pack_linear_weight(w)
    assert panels.shape == linear_panels_shape(9, 130) == (3, 9, 64)
    flat = panels.transpose(1, 0, 2).reshape(9, -1)
    assert flat[:, :130].tobytes() == w.tobytes()
    assert not flat[:, 130:].any()
    assert pack_linear_weight(torch.from_numpy(w)).numpy().tobytes() == panels.tobytes()


def test_bad_linear_operands_are_refused():
    with pytest.raises(ValueError, match="in_features, out_features"):
        pack_linear_weight(np.zeros(4, np.float32))
    cpu = DeviceRef.CPU()
    types = [
        TensorType(DType.float32, ["m", 8], cpu),
        TensorType(DType.float32, linear_panels_shape(8, 100), cpu),
        TensorType(DType.float32, [8, 100], cpu),
    ]
    with Graph("bad_linear", input_types=types) as g:
        x, panels, plain = (v.tensor for v in g.inputs)
        with pytest.raises(ValueError, match="out_features"):
            graph_ops.linear(x, panels)
        with pytest.raises(ValueError, match="out_features"):
            graph_ops.linear(x, panels, 129)
        with pytest.raises(ValueError, match="packed panels"):
            graph_ops.linear(x, plain, 100)
        with pytest.raises(ValueError, match="does not match"):
            graph_ops.linear(plain, panels, 100)


def test_a_memory_mapped_weight_is_packed_once(tmp_path, monkeypatch):
    import pagedkv._ops.linear_panels as linear_panels

    w = np.random.default_rng(1).standard_normal((7, 70)).astype(np.float32)
    np.save(tmp_path / "3.npy", w)
    mapped = np.load(tmp_path / "3.npy", mmap_mode="r")
    first = linear_panels.pack_linear_weight_cached(mapped)
    assert (tmp_path / "3.panels.npy").is_file()
    assert first.tobytes() == pack_linear_weight(w).tobytes()

    def refuse(_):
        raise AssertionError("packed again")

    monkeypatch.setattr(linear_panels, "pack_linear_weight", refuse)
    again = linear_panels.pack_linear_weight_cached(mapped)
    assert isinstance(again, np.memmap) and again.tobytes() == first.tobytes()
    with pytest.raises(AssertionError, match="packed again"):
        linear_panels.pack_linear_weight_cached(w)  # in memory: nothing to cache beside
