"""Scaled RoPE, as a GGUF describes it and llama.cpp reads it: linear
scaling (`{arch}.rope.scaling.factor`) divides positions, a `rope_freqs`
tensor (Llama 3.1's scaling) divides each rotary pair's frequency, both in
the layers at the model's own base only; the other scalings are refused.
The angles are checked against a float64 formula written here.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from pagedkv.graphs.model import DecoderConfig, rope_tables
from pagedkv.models.errors import ModelError
from pagedkv.models.gguf_model import read_gguf

D = 64
FACTORS = np.exp(np.random.default_rng(3).uniform(np.log(0.25), np.log(4), D // 2))


def angles(positions: int, theta: float, scale: float = 1.0, factors=None) -> np.ndarray:
    """[positions, D / 2] float64: p / scale * theta^(-2i / D) / factor_i."""
    i = np.arange(D // 2, dtype=np.float64)
    freq = 1.0 / (np.power(theta, 2 * i / D) * (1.0 if factors is None else np.asarray(factors)))
    return np.outer(np.arange(positions, dtype=np.float64) / scale, freq)


def assert_tables(tables: tuple[np.ndarray, np.ndarray], want: np.ndarray) -> None:
    cos, sin = tables
    np.testing.assert_allclose(cos, np.cos(want), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(want), rtol=0, atol=1e-6)


def test_tables_divide_positions_and_each_pairs_frequency():
    c = DecoderConfig(
        head_dim=D, max_positions=300, rope_theta=5e5, rope_scale=4.0, rope_freq_factors=FACTORS
    )
    assert_tables(rope_tables(c), angles(300, 5e5, 4.0, FACTORS))
    assert not np.allclose(rope_tables(c)[1], np.sin(angles(300, 5e5)), atol=0.1)


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


@pytest.mark.parametrize(
    "keys,rope_freqs,message",
    [
        ({"llama.rope.scaling.type": "yarn"}, None, "'yarn' RoPE scaling"),
        ({"llama.rope.scaling.type": "longrope"}, None, "'longrope' RoPE scaling"),
        ({"llama.rope.scaling.attn_factor": 0.5}, None, "RoPE attention factor"),
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
