"""Gemma 2 from its GGUF, read as llama.cpp and HF transformers read the
same file: Gemma 3's block without the query and key norms, alternating
sliding and global layers, and tanh soft caps on the attention scores and
on the logits. A tiny random GGUF written here stands in for the model; its
window (4 tokens) is shorter than the prompt and its caps (2 and 3) are
small enough that every capped value moves, so a reader that dropped the
window or either cap would load a wrong model without failing.
"""

from __future__ import annotations

import numpy as np
import pytest
from served import served_logits
from tiny_gguf import write_tiny_gguf

from pagedkv.graphs.numpy_reference import DenseDecoder
from pagedkv.models.gguf_model import _gemma_config, read_gguf

TOKENS = [1, 5, 2, 7, 3, 3, 0, 6, 4, 1]
WINDOW, ATTN_CAP, FINAL_CAP = 4, 2.0, 3.0
KEYS = {
    "gemma2.attention.sliding_window": WINDOW,
    "gemma2.attn_logit_softcapping": ATTN_CAP,
    "gemma2.final_logit_softcapping": FINAL_CAP,
}


def write_gemma2(path, blocks=None) -> None:
    # transformers scales queries by query_pre_attn_scalar ** -0.5 (256 by
    # default), llama.cpp by head_dim ** -0.5: heads of 256 agree.
    write_tiny_gguf(
        path, hidden=128, ffn=192, arch="gemma2", head_dim=256, layers=2, keys=KEYS, blocks=blocks
    )


@pytest.fixture(scope="module")
def gemma2_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2") / "tiny-gemma2.gguf"
    write_gemma2(path)
    return path


@pytest.fixture(scope="module")
def transformers_logits(gemma2_gguf):
    """transformers' float32 logits [len(TOKENS), vocab] after each token.
    Its GGUF reader maps the window but not the caps (it would take its
    config's defaults, 50 and 30), so they are passed as the file states
    them."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gemma2_gguf.parent),
        gguf_file=gemma2_gguf.name,
        dtype=torch.float32,
        attn_implementation="eager",
        attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP,
    )
    assert type(model).__name__ == "Gemma2ForCausalLM"
    assert model.config.sliding_window == WINDOW
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].double().numpy()


def test_the_description_is_read_from_the_metadata(gemma2_gguf):
    c = read_gguf(gemma2_gguf).config
    assert (c.family, c.num_layers, c.head_dim) == ("gemma2", 2, 256)
    assert c.windows == (WINDOW, None)  # the first layer slides
    assert (c.attn_soft_cap, c.final_soft_cap, c.attention_scale) == (ATTN_CAP, FINAL_CAP, None)
    assert c.sandwich_norms and not c.qk_norm and c.activation == "gelu_tanh"
    assert c.local_rope_theta is None and c.embed_scale == pytest.approx(np.sqrt(128))


def metadata(arch: str, layers: int, **keys) -> dict:
    """The keys a Gemma file of 2304-wide rows and 8 heads of 256 must hold."""
    base = {
        "attention.head_count": 8,
        "embedding_length": 2304,
        "block_count": layers,
        "attention.key_length": 256,
        "feed_forward_length": 9216,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "context_length": 8192,
        "vocab_size": 256000,
    }
    return {f"{arch}.{k}": v for k, v in {**base, **keys}.items()}


def test_what_a_file_leaves_out_is_llama_cpps_default():
    """Gemma 2's window 4096 and caps 50 and 30; the 27B models' query
    scale of 1 / sqrt(hidden / heads) (46 Gemma 2 layers, 62 Gemma 3); a
    file's own pattern, as a period or as flags."""
    c = _gemma_config(metadata("gemma2", 26), "gemma2")
    assert c.windows == (4096, None) * 13
    assert (c.attn_soft_cap, c.final_soft_cap, c.attention_scale) == (50.0, 30.0, None)
    big = _gemma_config(metadata("gemma2", 46), "gemma2")
    assert big.attention_scale == pytest.approx(1 / np.sqrt(2304 // 8), rel=1e-7)
    gemma3 = _gemma_config(metadata("gemma3", 62, **{"attention.sliding_window": 1024}), "gemma3")
    assert gemma3.attention_scale == pytest.approx(1 / np.sqrt(288), rel=1e-7)
    assert gemma3.windows[:6] == (1024,) * 5 + (None,)
    assert (gemma3.attn_soft_cap, gemma3.final_soft_cap, gemma3.local_rope_theta) == (
        None,
        None,
        1e4,
    )
    period = _gemma_config(
        metadata(
            "gemma3", 4, **{"attention.sliding_window": 8, "attention.sliding_window_pattern": 2}
        ),
        "gemma3",
    )
    assert period.windows == (8, None, 8, None)
    flags = [True, True, False, True]
    listed = _gemma_config(
        metadata(
            "gemma3",
            4,
            **{"attention.sliding_window": 8, "attention.sliding_window_pattern": flags},
        ),
        "gemma3",
    )
    assert listed.windows == (8, 8, None, 8)
    assert _gemma_config(metadata("gemma3", 4), "gemma3").windows == (None,) * 4


def test_the_weights_compute_what_transformers_computes(gemma2_gguf, transformers_logits):
    """The float64 NumPy model over the weights read (the window on the
    first layer, both caps) gives transformers' logits at every position;
    the logits are capped, so a missing cap shows as values past 3."""
    model = read_gguf(gemma2_gguf)
    ours = DenseDecoder(model.config, model.weights).feed_all(TOKENS)
    assert np.abs(transformers_logits).max() > 0.5 * FINAL_CAP
    np.testing.assert_allclose(ours, transformers_logits, rtol=0, atol=1e-5 * FINAL_CAP)


@pytest.mark.slow
def test_the_float_step_graphs_compute_what_transformers_computes(gemma2_gguf, transformers_logits):
    """`load(gguf=...)` serves it: the prefill graph's last logits and each
    decode step's equal transformers' (float32 throughout)."""
    from pagedkv.models import load

    rows = served_logits(load(gguf=str(gemma2_gguf), weights="f32", kv_dtype="float32"), TOKENS)
    np.testing.assert_allclose(rows, transformers_logits[3:], rtol=0, atol=1e-4 * FINAL_CAP)


@pytest.mark.slow
def test_the_quantized_step_graphs_compute_what_the_numpy_model_computes(tmp_path):
    """Every product and the embedding in Q8_0 blocks, so each layer is one
    fused op with the cap in its attention: a prefill and decode steps give
    the logits of the NumPy model that quantizes each product's
    activations, within what an activation a rounding away from a code
    boundary costs (as tests/graphs/test_model_families.py allows)."""
    from pagedkv.graphs.decoder import quantized_formats
    from pagedkv.models import load

    products = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    blocks = {f"blk.{i}.{name}.weight": "Q8_0" for i in range(2) for name in products}
    path = tmp_path / "gemma2-q8_0.gguf"
    write_gemma2(path, blocks=blocks | {"token_embd.weight": "Q8_0"})
    model = read_gguf(path)
    formats = quantized_formats(model.quantized, 2)
    assert all(layer.fused() for layer in formats.layers) and formats.embed_is_head
    reference = DenseDecoder(model.config, model.weights, quantized=True)
    got = served_logits(load(gguf=str(path), weights="gguf", kv_dtype="float32"), TOKENS)
    want = reference.feed_all(TOKENS)[3:]
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert (err < 2e-2).all(), err
