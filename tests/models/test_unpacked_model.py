"""The unpacked copy of a GGUF: equal to the GGUF bit for bit, loaded by a
second process without reading the GGUF, and never used when partial or
made from another file. A tiny GGUF written here stands in for a model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A tiny GGUF outside the cache directory, which is tmp_path / "cache"
    here and in the processes the test starts."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path)
    return path


def test_the_unpacked_model_equals_the_gguf_and_is_loaded_after(gguf):
    from pagedkv.models import unpacked
    from pagedkv.models.gguf_model import read_gguf

    direct = read_gguf(gguf)
    first = unpacked.read_unpacked(gguf)
    assert (unpacked.unpacked_dir(gguf) / "model.json").is_file()
    code = f"""
import pagedkv.models.unpacked as u
def refuse(path):
    raise AssertionError("read the GGUF instead of its unpacked copy")
u.read_gguf = refuse
m = u.read_unpacked({str(gguf)!r})
print(repr(m.config), m.metadata["tokenizer.ggml.tokens"][-1])
"""
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.strip() == f"{direct.config!r} t7"
    again = unpacked.read_unpacked(gguf)
    for model in (first, again):
        assert model.config == direct.config
        assert list(model.weights) == list(direct.weights)
        for name, w in direct.weights.items():
            assert model.weights[name].dtype == w.dtype == np.float32
            assert np.array_equal(model.weights[name].view(np.uint32), w.view(np.uint32)), name
        assert model.metadata == direct.metadata


def test_a_gguf_outside_the_cache_is_unpacked_into_the_cache(gguf, tmp_path):
    """Nothing is written beside a user's own GGUF (`load(gguf=...)`,
    `--gguf`); a GGUF in the cache directory keeps its copy beside it."""
    from pagedkv.models import unpacked

    unpacked.read_unpacked(gguf)
    assert [p.name for p in gguf.parent.iterdir()] == ["tiny.gguf"]
    folder = unpacked.unpacked_dir(gguf)
    assert folder.is_relative_to(tmp_path / "cache" / "unpacked")
    assert (folder / "model.json").is_file()
    cached = tmp_path / "cache" / "models" / "tiny" / "tiny.gguf"
    cached.parent.mkdir(parents=True)
    write_tiny_gguf(cached)
    assert unpacked.unpacked_dir(cached).parent == cached.parent / "tiny.unpacked"


@pytest.mark.parametrize("fmt", ["Q2_K", "Q3_K", "IQ4_XS"])
def test_a_format_without_a_quantized_product_is_read_as_float32(tmp_path, fmt):
    """A matrix in a block format the quantized product does not take is
    dequantized by `gguf` (into the float weights, transposed as they all
    are) and left out of the quantized products; its neighbours in a packed
    format are multiplied in place."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from pagedkv.models.gguf_model import read_gguf

    path = tmp_path / "tiny.gguf"
    blocks = {"blk.0.ffn_down.weight": fmt, "blk.0.attn_output.weight": "Q4_K"}
    write_tiny_gguf(path, hidden=256, ffn=512, blocks=blocks)
    model = read_gguf(path)
    down = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    want = dequantize(down.data, down.tensor_type).T
    assert np.isfinite(want).all() and want.any()
    np.testing.assert_array_equal(model.weights["layers.0.w_down"], want)
    assert "layers.0.w_down" not in model.quantized
    assert model.quantized["layers.0.wo"].format == "Q4_K"


def test_a_partial_or_outdated_unpacked_copy_is_not_used(gguf, monkeypatch):
    from pagedkv.models import unpacked

    folder = unpacked.unpacked_dir(gguf)
    folder.mkdir(parents=True)
    np.save(folder / "0.npy", np.zeros(3, np.float32))  # weights, but no model.json
    calls = []
    real = unpacked.read_gguf
    monkeypatch.setattr(unpacked, "read_gguf", lambda p: calls.append(p) or real(p))
    model = unpacked.read_unpacked(gguf)
    assert calls == [gguf]
    assert model.weights["embed"].shape == (8, 128)
    assert (folder / "model.json").is_file()
    # A rewritten GGUF (new size and time) gets a copy of its own.
    os.utime(gguf, ns=(0, 0))
    assert unpacked.unpacked_dir(gguf) != folder
    unpacked.read_unpacked(gguf)
    assert calls == [gguf, gguf]
    assert not folder.exists()


def test_packed_matrices_are_dequantized_only_when_read(tmp_path, monkeypatch):
    """A model served from its packed blocks never dequantizes the matrices
    it multiplies packed, and its unpacked copy holds no float32 copy of
    them; the float weights still read them, dequantized from the GGUF on
    first use, equal to `read_gguf`'s."""
    import gguf.quants
    from max.dtype import DType
    from max.graph import DeviceRef

    from pagedkv.graphs.decoder import packed_float_names, weights_registry
    from pagedkv.models import unpacked
    from pagedkv.models.gguf_model import read_gguf

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "q8.gguf"
    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_tiny_gguf(path, blocks={f"blk.0.{m}.weight": "Q8_0" for m in matrices})
    kinds = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(
        gguf.quants, "dequantize", lambda data, kind: kinds.append(kind.name) or real(data, kind)
    )
    for _ in range(2):  # read from the GGUF, then from the unpacked copy
        model = unpacked.read_unpacked(path)
        weights_registry(
            model.config, model.weights, DType.float32, DeviceRef.CPU(), model.quantized
        )
    packed = packed_float_names(model.quantized)
    assert {"layers.0.wqkv", "layers.0.wo", "layers.0.w_gate", "layers.0.w_down"} <= packed
    assert "Q8_0" not in kinds
    stored = [p for p in unpacked.unpacked_dir(path).glob("*.npy") if p.stem.isdigit()]
    assert len(stored) == len(model.weights) - len(packed & set(model.weights))
    direct = read_gguf(path)
    for name in model.weights:
        np.testing.assert_array_equal(model.weights[name], direct.weights[name])
    assert "Q8_0" in kinds


def test_a_tied_embedding_stays_in_the_heads_blocks(tmp_path, monkeypatch):
    """A Q8_0 token embedding that is also the output head (no
    `output.weight`): its rows are looked up in the head's panels, one
    object in the model, one file in the copy, no float32 copy of it; the
    float embedding is still there for the float forms, dequantized from
    the GGUF on first use (`graph_ops.packed_rows` equals the same
    dequantization bit for bit: tests/ops/test_packed_rows.py)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from pagedkv.graphs.decoder import quantized_formats
    from pagedkv.models import unpacked

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, blocks={"token_embd.weight": "Q8_0"})
    embd = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    for _ in range(2):  # read from the GGUF, then from the unpacked copy
        model = unpacked.read_unpacked(path)
        assert model.quantized["embed"] is model.quantized["lm_head"]
        formats = quantized_formats(model.quantized, model.config.num_layers)
        assert (formats.embed, formats.embed_is_head) == ("Q8_0", True)
    folder = unpacked.unpacked_dir(path)
    assert len(list(folder.glob("q*.npy"))) == 1
    stored = {
        name
        for name, i in json.loads((folder / "model.json").read_text())["weights"]
        if i is not None
    }
    assert "embed" not in stored
    want = dequantize(embd.data, GGMLQuantizationType.Q8_0)
    assert np.array_equal(model.weights["embed"], want)


def test_a_run_of_layers_reads_its_weights_in_place(tmp_path, monkeypatch):
    """The unpacked copy stacks each matrix's layers in one file, so a run of
    fused layers (`layer_runs`) takes its stacked weights as one slice of the
    memory-mapped file, not a copy; read from the GGUF itself they are
    copied. Either way they are the layers' panels one after another."""
    from max.dtype import DType
    from max.graph import DeviceRef

    from pagedkv.graphs import decoder
    from pagedkv.models import unpacked

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "q8.gguf"
    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    blocks = {f"blk.{i}.{m}.weight": "Q8_0" for i in range(3) for m in matrices}
    write_tiny_gguf(path, layers=3, blocks=blocks)
    loads = []
    for _ in range(2):  # read from the GGUF, then from the unpacked copy
        model = unpacked.read_unpacked(path)
        formats = decoder.quantized_formats(model.quantized, model.config.num_layers)
        assert decoder.layer_runs(model.config, formats) == [range(3)]
        registry = decoder.weights_registry(
            model.config, model.weights, DType.float32, DeviceRef.CPU(), model.quantized
        )
        loads.append((model, registry))
    (direct, copied), (mapped, in_place) = loads
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        layers = [direct.quantized[f"layers.{i}.{name}"].panels for i in range(3)]
        assert copied[f"runs.0.{name}"].tobytes() == np.concatenate(layers).tobytes()
        assert in_place[f"runs.0.{name}"].tobytes() == np.concatenate(layers).tobytes()
        first = mapped.quantized[f"layers.0.{name}"].panels
        assert isinstance(first, np.memmap)
        assert np.shares_memory(in_place[f"runs.0.{name}"], first), name
    # Slices out of order are copied in the order given.
    parts = [mapped.quantized[f"layers.{i}.wo"].panels for i in (2, 1)]
    again = decoder._stacked(parts)
    assert not np.shares_memory(again, parts[0])
    assert again.tobytes() == np.concatenate(parts).tobytes()


def test_stale_copies_are_those_no_read_will_use_again(gguf, tmp_path):
    """A copy of a GGUF outside the cache or inside it is stale once its GGUF
    is gone or rewritten, or when it names no GGUF (an older version's), and
    not before; a copy being written is never listed."""
    from pagedkv.models import unpacked

    inside = tmp_path / "cache" / "models" / "tiny" / "inside.gguf"
    inside.parent.mkdir(parents=True)
    write_tiny_gguf(inside)
    gone = tmp_path / "models" / "gone.gguf"
    write_tiny_gguf(gone)
    for path in (gguf, inside, gone):
        unpacked.read_unpacked(path)
    copies = {p: unpacked.unpacked_dir(p) for p in (gguf, inside, gone)}
    assert copies[inside].parent.parent == inside.parent  # beside it, in the cache
    assert unpacked.stale_copies() == []
    gone.unlink()
    os.utime(inside, ns=(0, 0))
    unnamed = copies[gguf].parent.with_name("older-000000000000") / "key"
    unnamed.mkdir(parents=True)
    (copies[gguf].parent / "key.123.partial").mkdir()
    assert sorted(unpacked.stale_copies()) == sorted([copies[gone], copies[inside], unnamed])
