"""Qwen 2 and Qwen 3 from their GGUFs, read as HF transformers reads the same
files: Llama's block in rotate-half order, with a bias on the Q|K|V
projection (Qwen 2) or RMSNorm over each query and key head and a head size
of its own (Qwen 3). Tiny random GGUFs written here stand in for the models;
Qwen 3's heads (128) are not hidden / heads (64), so a reader that guessed
the head size from the hidden size would load a wrong model without failing.
"""

from __future__ import annotations

import numpy as np
import pytest
from served import served_logits
from tiny_gguf import write_tiny_gguf

from pagedkv.graphs.numpy_reference import DenseDecoder
from pagedkv.models.errors import ModelError
from pagedkv.models.gguf_model import read_gguf

TOKENS = [1, 5, 2, 7, 3, 3, 0, 6, 4, 1]
HEAD_DIM = {"qwen2": 64, "qwen3": 128}


@pytest.fixture(scope="module", params=sorted(HEAD_DIM))
def qwen_gguf(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, hidden=128, ffn=192, arch=arch, head_dim=HEAD_DIM[arch], layers=2)
    return path


@pytest.fixture(scope="module")
def transformers_logits(qwen_gguf):
    """transformers' float32 logits [len(TOKENS), vocab] after each token."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(qwen_gguf.parent), gguf_file=qwen_gguf.name, dtype=torch.float32
    )
    arch = read_gguf(qwen_gguf).config.family
    assert type(model).__name__ == f"{arch.capitalize()}ForCausalLM"
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].double().numpy()


def test_the_description_is_read_from_the_metadata(qwen_gguf):
    c = read_gguf(qwen_gguf).config
    assert (c.num_layers, c.num_qo_heads, c.num_kv_heads) == (2, 2, 1)
    assert c.head_dim == HEAD_DIM[c.family]
    assert (c.qkv_bias, c.qk_norm) == (c.family == "qwen2", c.family == "qwen3")
    assert not c.sandwich_norms and c.activation == "silu"


def test_the_weights_compute_what_transformers_computes(qwen_gguf, transformers_logits):
    """The float64 NumPy model over the weights read (no permutation of the
    query and key rows, the biases or head norms in place) gives
    transformers' logits at every position."""
    model = read_gguf(qwen_gguf)
    ours = DenseDecoder(model.config, model.weights).feed_all(TOKENS)
    scale = np.abs(transformers_logits).max()
    np.testing.assert_allclose(ours, transformers_logits, rtol=0, atol=1e-5 * scale)


@pytest.mark.slow
def test_the_float_step_graphs_compute_what_transformers_computes(qwen_gguf, transformers_logits):
    """`load(gguf=...)` serves it: the prefill graph's last logits and each
    decode step's equal transformers' (float32 throughout)."""
    from pagedkv.models import load

    rows = served_logits(load(gguf=str(qwen_gguf), weights="f32", kv_dtype="float32"), TOKENS)
    scale = np.abs(transformers_logits).max()
    np.testing.assert_allclose(rows, transformers_logits[3:], rtol=0, atol=1e-4 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(HEAD_DIM))
def test_the_quantized_step_graphs_compute_what_the_numpy_model_computes(tmp_path, arch):
    """Every product in Q8_0 blocks, so each layer is one fused op (Qwen 2's
    bias and Qwen 3's QK-norm as its row phases): a prefill and decode steps
    give the logits of the NumPy model that quantizes each product's
    activations, within what an activation a rounding away from a code
    boundary costs (as tests/graphs/test_model_families.py allows)."""
    from pagedkv.graphs.decoder import quantized_formats
    from pagedkv.models import load

    products = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    blocks = {f"blk.{i}.{name}.weight": "Q8_0" for i in range(2) for name in products}
    path = tmp_path / f"{arch}-q8_0.gguf"
    write_tiny_gguf(
        path,
        hidden=128,
        ffn=192,
        arch=arch,
        head_dim=HEAD_DIM[arch],
        layers=2,
        blocks=blocks | {"token_embd.weight": "Q8_0"},
    )
    model = read_gguf(path)
    formats = quantized_formats(model.quantized, 2)
    assert all(layer.fused() for layer in formats.layers) and formats.lm_head == "Q8_0"
    reference = DenseDecoder(model.config, model.weights, quantized=True)
    got = served_logits(load(gguf=str(path), weights="gguf", kv_dtype="float32"), TOKENS)
    want = reference.feed_all(TOKENS)[3:]
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert (err < 2e-2).all(), err


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"qwen3.attention.value_length": 64}, "key and value heads of different sizes"),
        ({"qwen3.rope.dimension_count": 64}, "rotating part of each head"),
    ],
)
def test_what_is_not_implemented_is_refused(tmp_path, keys, message):
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, arch="qwen3", head_dim=128, keys=keys)
    with pytest.raises(ModelError, match=message):
        read_gguf(path)
