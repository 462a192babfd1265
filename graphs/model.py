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


def quantize_weights(
    c: LlamaConfig, weights: dict[str, np.ndarray], fmt: str = "Q8_0"
) -> tuple[dict[str, np.ndarray], dict]:
    """The model with its matrices in a GGUF block format: (the weights with
    each matrix replaced by its dequantized blocks, the packed blocks under
    the quantized step graphs' names). Both serve the same model, so the
    float and quantized graphs of it can be compared.

    Names of the packed matrices: per layer "wqkv", "wo", "w_gate_up" (gate
    then up) and "w_down", then "lm_head" (pagedkv.models.gguf_llama).
    """
    from gguf import GGMLQuantizationType, quants

    from pagedkv._ops.quantized_panels import pack_quantized_weight

    kind = GGMLQuantizationType[fmt]
    dense = dict(weights)
    packed = {}

    def quantize(name: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """w [K, N] (x @ w) as GGUF blocks of w^T and as its dequantized self."""
        raw = quants.quantize(np.ascontiguousarray(w.T, np.float32), kind)
        dense[name] = np.ascontiguousarray(quants.dequantize(raw, kind).T)
        return raw, dense[name]

    fused = {"wqkv": ("wqkv",), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up")}
    fused["w_down"] = ("w_down",)
    for i in range(c.num_layers):
        for target, parts in fused.items():
            raws = [quantize(f"layers.{i}.{p}", weights[f"layers.{i}.{p}"])[0] for p in parts]
            k = weights[f"layers.{i}.{parts[0]}"].shape[0]
            rows = sum(weights[f"layers.{i}.{p}"].shape[1] for p in parts)
            packed[f"layers.{i}.{target}"] = pack_quantized_weight(
                np.concatenate([r.reshape(-1) for r in raws]), fmt, rows, k
            )
    raw, _ = quantize("lm_head", weights["lm_head"])
    packed["lm_head"] = pack_quantized_weight(raw, fmt, c.vocab_size, c.hidden_size)
    return dense, packed
