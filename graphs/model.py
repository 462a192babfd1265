"""A small Llama-style decoder: its shape and its random weights.

The same weights drive the max.graph step graphs (llama.py) and the NumPy
reference (numpy_reference.py), so the demo can check every generated token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LlamaConfig:
    """The model's shape. Defaults: the demo's 4-layer model."""

    vocab_size: int = 4096
    hidden_size: int = 512
    num_layers: int = 4
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn_size: int = 1408
    rope_theta: float = 1e4
    rms_eps: float = 1e-5
    max_positions: int = 4096

    def __post_init__(self) -> None:
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {self.head_dim}")

    @property
    def qkv_size(self) -> int:
        return (self.num_qo_heads + 2 * self.num_kv_heads) * self.head_dim


def layer_weight_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's weights (x @ W convention)."""
    return {
        "attn_norm": (c.hidden_size,),
        "wqkv": (c.hidden_size, c.qkv_size),
        "wo": (c.num_qo_heads * c.head_dim, c.hidden_size),
        "mlp_norm": (c.hidden_size,),
        "w_gate": (c.hidden_size, c.ffn_size),
        "w_up": (c.hidden_size, c.ffn_size),
        "w_down": (c.ffn_size, c.hidden_size),
    }


def init_weights(c: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights from a fixed seed: name -> array.

    Names: "embed" [V, H], "layers.{i}.{name}" (see layer_weight_shapes),
    "final_norm" [H], "lm_head" [H, V]. Matrices are N(0, 1/fan_in) so that
    activations keep their scale through the layers; norms start at 1.
    """
    rng = np.random.default_rng(seed)
    weights = {"embed": rng.standard_normal((c.vocab_size, c.hidden_size), dtype=np.float32)}
    for i in range(c.num_layers):
        for name, shape in layer_weight_shapes(c).items():
            if len(shape) == 1:
                w = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                w = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
            weights[f"layers.{i}.{name}"] = w
    weights["final_norm"] = np.ones(c.hidden_size, np.float32)
    weights["lm_head"] = (
        rng.standard_normal((c.hidden_size, c.vocab_size)) / np.sqrt(c.hidden_size) * 4
    ).astype(np.float32)
    return weights


def rope_tables(c: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_positions, head_dim / 2] of Llama's rotary embedding,
    computed in float64 and rounded once."""
    inv_freq = c.rope_theta ** (-np.arange(0, c.head_dim // 2, dtype=np.float64) * 2 / c.head_dim)
    angle = np.arange(c.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
