"""Scaled RoPE, as a GGUF describes it and llama.cpp reads it: linear
scaling (`{arch}.rope.scaling.factor`) divides positions, YaRN blends each
pair's frequency with its scaled one and multiplies cos and sin, a
`rope_freqs` tensor (Llama 3.1's scaling) divides each rotary pair's
frequency, all in the layers at the model's own base only; the other
scalings are refused. The angles are checked against float64 formulas
written here, and a YaRN model's logits against transformers'.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from served import served_logits
from tiny_gguf import write_tiny_gguf

from pagedkv.graphs.model import DecoderConfig, rope_tables
from pagedkv.graphs.numpy_reference import DenseDecoder
from pagedkv.models.errors import ModelError
from pagedkv.models.gguf_model import read_gguf

D = 64
FACTORS = np.exp(np.random.default_rng(3).uniform(np.log(0.25), np.log(4), D // 2))
YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}
"""A YaRN GGUF's keys (after its architecture's name), over the tiny
GGUF's own context of 256 tokens."""
TOKENS = [1, 5, 2, 7, 3, 3, 0, 6, 4, 1]


def angles(positions: int, theta: float, scale: float = 1.0, factors=None) -> np.ndarray:
    """[positions, D / 2] float64: p / scale * theta^(-2i / D) / factor_i."""
    i = np.arange(D // 2, dtype=np.float64)
    freq = 1.0 / (np.power(theta, 2 * i / D) * (1.0 if factors is None else np.asarray(factors)))
    return np.outer(np.arange(positions, dtype=np.float64) / scale, freq)


def yarn_angles(positions: int, theta: float, scale: float, original: int) -> np.ndarray:
    """[positions, D / 2] float64, pair by pair as llama.cpp's `rope_yarn`
    turns them (ext_factor 1, beta_fast 32, beta_slow 1)."""

    def corr_dim(turns: float) -> float:
        return D * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(0, math.floor(corr_dim(32))), min(D - 1, math.ceil(corr_dim(1)))
    out = np.empty((positions, D // 2))
    for i in range(D // 2):
        extrapolated = theta ** (-2 * i / D)
        mix = 1 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))  # ext_factor 1
        out[:, i] = np.arange(positions) * (extrapolated / scale * (1 - mix) + extrapolated * mix)
    return out


def assert_tables(
    tables: tuple[np.ndarray, np.ndarray], want: np.ndarray, magnitude: float = 1.0
) -> None:
    cos, sin = tables
    np.testing.assert_allclose(cos, magnitude * np.cos(want), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin, magnitude * np.sin(want), rtol=0, atol=1e-6)


def test_tables_divide_positions_and_each_pairs_frequency():
    c = DecoderConfig(
        head_dim=D, max_positions=300, rope_theta=5e5, rope_scale=4.0, rope_freq_factors=FACTORS
    )
    assert_tables(rope_tables(c), angles(300, 5e5, 4.0, FACTORS))
    assert not np.allclose(rope_tables(c)[1], np.sin(angles(300, 5e5)), atol=0.1)


def test_yarn_tables_turn_each_pair_as_llama_cpp_does():
    """The pairs that turn fast over the original context keep their
    frequency, the slow ones are divided by the factor, a ramp between; cos
    and sin times 1 + 0.1 ln(factor) and the GGUF's attention factor."""
    c = DecoderConfig(
        head_dim=D,
        max_positions=300,
        rope_theta=5e5,
        rope_scale=4.0,
        rope_scaling="yarn",
        yarn_original_context=128,
        rope_attn_factor=0.5,
    )
    want = yarn_angles(300, 5e5, 4.0, 128)
    assert_tables(rope_tables(c), want, 0.5 * (1 + 0.1 * math.log(4.0)))
    # Neither linear scaling nor none: some pairs keep their turn, others not.
    assert not np.allclose(want, angles(300, 5e5, 4.0)) and not np.allclose(want, angles(300, 5e5))


def test_window_layers_with_a_base_of_their_own_are_not_scaled():
    """Gemma 3's: its sliding layers keep base 10000 unscaled, its global
    layers are scaled (as llama.cpp's freq_scale_swa of 1)."""
    windows = (512, None)
    c = DecoderConfig(
        num_layers=2,
        head_dim=D,
        max_positions=300,
        rope_theta=1e6,
        rope_scale=8.0,
        windows=windows,
        local_rope_theta=1e4,
    )
    assert_tables(rope_tables(c, 512), angles(300, 1e4))
    assert_tables(rope_tables(c, None), angles(300, 1e6, 8.0))


def test_a_gguf_scaled_rope_is_read_as_llama_cpp_reads_it(tmp_path):
    cases = [
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, 2.0),
        ({"llama.rope.scaling.factor": 3.0}, 3.0),  # linear when no type is named
        ({"llama.rope.scale_linear": 5.0}, 5.0),  # the older key
        ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 2.0}, 1.0),
        ({}, 1.0),
    ]
    for i, (keys, scale) in enumerate(cases):
        path = tmp_path / f"scaled{i}.gguf"
        write_tiny_gguf(path, keys=keys, rope_freqs=FACTORS if i == 0 else None)
        config = read_gguf(path).config
        assert config.rope_scale == scale, keys
        want = tuple(FACTORS.astype(np.float32).astype(float)) if i == 0 else ()
        assert config.rope_freq_factors == want


def test_a_gguf_yarn_and_attention_factor_are_read_as_llama_cpp_reads_them(tmp_path):
    """YaRN over the file's context unless an original one is named (the
    model's context then that times the factor); the attention factor in
    any scaling."""
    cases = [
        ({}, 256),
        ({"rope.scaling.original_context_length": 64}, 64),
    ]
    for i, (more, original) in enumerate(cases):
        path = tmp_path / f"yarn{i}.gguf"
        write_tiny_gguf(path, keys={f"llama.{k}": v for k, v in (YARN | more).items()})
        c = read_gguf(path).config
        assert (c.rope_scaling, c.rope_scale, c.yarn_original_context) == ("yarn", 4.0, original)
        assert c.max_positions == max(256, 4 * original)
        assert (c.yarn_beta_fast, c.yarn_beta_slow, c.rope_attn_factor) == (32.0, 1.0, 1.0)
    path = tmp_path / "attn.gguf"
    write_tiny_gguf(path, keys={"llama.rope.scaling.attn_factor": 0.5})
    c = read_gguf(path).config
    assert (c.rope_scaling, c.rope_scale, c.rope_attn_factor) == ("linear", 1.0, 0.5)


@pytest.fixture(scope="module")
def yarn_qwen(tmp_path_factory):
    """(a tiny Qwen 2 GGUF with YaRN, transformers' float32 logits
    [len(TOKENS), vocab] of it with its rotary embedding made YaRN's:
    transformers' GGUF reader does not read the scaling)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("yarn") / "tiny-qwen2-yarn.gguf"
    keys = {f"qwen2.{k}": v for k, v in YARN.items()}
    write_tiny_gguf(path, hidden=128, ffn=192, arch="qwen2", head_dim=D, layers=2, keys=keys)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    with torch.no_grad():
        return path, model(torch.tensor([TOKENS])).logits[0].double().numpy()


def test_a_yarn_model_computes_what_transformers_computes(yarn_qwen):
    path, want = yarn_qwen
    model = read_gguf(path)
    got = DenseDecoder(model.config, model.weights).feed_all(TOKENS)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_the_step_graphs_serve_a_yarn_model_as_transformers_computes(yarn_qwen):
    from pagedkv.models import load

    path, want = yarn_qwen
    rows = served_logits(load(gguf=str(path), weights="f32", kv_dtype="float32"), TOKENS)
    np.testing.assert_allclose(rows, want[3:], rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize(
    "keys,rope_freqs,message",
    [
        ({"llama.rope.scaling.type": "longrope"}, None, "'longrope' RoPE scaling"),
        (
            {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
            | {"llama.rope.scaling.yarn_log_multiplier": 0.1},
            None,
            "YaRN log multiplier",
        ),
        (
            {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
            | {"llama.rope.scaling.yarn_beta_fast": 0.5},
            None,
            "0 < yarn_beta_slow < yarn_beta_fast",
        ),
        ({"llama.rope.scaling.attn_factor": -1.0}, None, "must be positive and finite"),
        ({}, FACTORS[:-1], "rope_freq_factors holds 31 factors for 32 pairs"),
        ({}, -FACTORS, "must be positive and finite"),
    ],
)
def test_a_rope_scaling_it_cannot_compute_is_refused(tmp_path, keys, rope_freqs, message):
    path = tmp_path / "refused.gguf"
    write_tiny_gguf(path, keys=keys, rope_freqs=rope_freqs)
    with pytest.raises(ModelError, match=message):
        read_gguf(path)


def test_the_graphs_tables_are_kept_on_disk_and_mapped(tmp_path, monkeypatch):
    """`rope_weights` computes a model's tables once into the cache
    directory and maps them after: bitwise `rope_tables`' own, a pair of
    files per layer group; a file of another shape (a broken cache) is made
    again, another base gets files of its own."""
    from pagedkv.graphs import decoder

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    c = DecoderConfig(head_dim=D, max_positions=300, rope_theta=5e5, rope_scale=4.0)
    cos, sin = rope_tables(c)

    def check(tables):
        assert isinstance(tables["rope_cos.0"], np.memmap)
        assert tables["rope_cos.0"].tobytes() == cos.tobytes()
        assert tables["rope_sin.0"].tobytes() == sin.tobytes()

    check(decoder.rope_weights(c))
    files = sorted(decoder.rope_dir().iterdir())
    assert decoder.rope_dir().parent == tmp_path / "rope"
    assert len(files) == 2
    with monkeypatch.context() as m:
        m.setattr(decoder, "rope_tables", lambda *a: pytest.fail("computed again"))
        check(decoder.rope_weights(c))
    # Put in place whole, so that the tables mapped above stay readable.
    np.save(tmp_path / "short.npy", np.zeros(3, np.float32))
    (tmp_path / "short.npy").replace(files[0])
    check(decoder.rope_weights(c))
    other = DecoderConfig(head_dim=D, max_positions=300, rope_theta=1e4, rope_scale=4.0)
    assert decoder.rope_weights(other)["rope_sin.0"].tobytes() == rope_tables(other)[1].tobytes()
    assert len(list(decoder.rope_dir().iterdir())) == 4
