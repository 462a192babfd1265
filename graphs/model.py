"""A decoder's description (one dataclass for every model family) and
random weights for it.

A family is a set of choices in one block, not a copy of the graph code:
Llama (RMSNorm before attention and MLP, SwiGLU, one RoPE base, every layer
global) is the default; Qwen 2 adds a bias to the Q|K|V projection
(`qkv_bias`); Qwen 3 instead RMSNorm on each query and key head
(`qk_norm`); Gemma 3 adds that, norms after attention and MLP too
(`sandwich_norms`), a GELU-tanh MLP, embeddings scaled by sqrt(hidden), and
sliding-window layers (`windows`) with their own RoPE base
(`local_rope_theta`). The same weights
drive the max.graph step graphs (decoder.py) and the NumPy reference
(numpy_reference.py), so the demo can check every generated token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DecoderConfig:
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
    family: str = "llama"
    """The architecture's name (GGUF's `general.architecture`)."""
    activation: str = "silu"
    """The MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh GELU)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (weights q_norm, k_norm [D])
    before RoPE."""
    qkv_bias: bool = False
    """A bias added to the Q|K|V projection (weight bqkv [(Hq + 2 Hkv) D])."""
    sandwich_norms: bool = False
    """RMSNorm of the attention's and the MLP's outputs before each residual
    add (weights post_attn_norm, post_mlp_norm)."""
    norm_in_float32: bool = False
    """Norms multiply by their weight before casting back to the activations'
    dtype (Gemma's order; Llama casts first)."""
    embed_scale: float = 1.0
    """Token embeddings are multiplied by this (Gemma: sqrt(hidden_size))."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (a query at p sees keys p - window + 1 ..
    p) or None (global); empty: every layer global."""
    local_rope_theta: float | None = None
    """The RoPE base of the sliding-window layers (None: rope_theta)."""
    rope_scale: float = 1.0
    """Positions are divided by this before rotating (RoPE's linear
    scaling), in the layers at rope_theta (not Gemma 3's window layers)."""
    rope_freq_factors: tuple[float, ...] = ()
    """Each rotary pair's frequency is divided by its factor ([head_dim / 2],
    GGUF's `rope_freqs`: Llama 3.1's scaling), in the layers at rope_theta;
    empty: none."""
    rope_scaling: str = "linear"
    """How rope_scale applies in the layers at rope_theta: "linear" divides
    every position by it; "yarn" (YaRN, as llama.cpp and transformers
    compute it) divides the frequency of the pairs that turn fewer than
    yarn_beta_slow times over yarn_original_context positions, keeps those
    that turn more than yarn_beta_fast times, ramps linearly between, and
    multiplies cos and sin by 1 + 0.1 ln(rope_scale) where rope_scale > 1."""
    yarn_original_context: int = 0
    """The context the model was trained at, over which YaRN counts turns
    (GGUF's `rope.scaling.original_context_length`); at least 1 under YaRN."""
    yarn_beta_fast: float = 32.0
    """Pairs turning more often than this over the original context keep
    their frequency (YaRN)."""
    yarn_beta_slow: float = 1.0
    """Pairs turning less often than this over the original context are
    interpolated whole (YaRN)."""
    rope_attn_factor: float = 1.0
    """cos and sin are multiplied by this in every layer (GGUF's
    `rope.scaling.attn_factor`), besides YaRN's own factor."""
    attention_scale: float | None = None
    """What q . k is multiplied by (None: 1 / sqrt(head_dim); Gemma's 27B
    models: 1 / sqrt(hidden_size / num_qo_heads))."""
    attn_soft_cap: float | None = None
    """Scaled attention scores s become cap * tanh(s / cap) (Gemma 2); None:
    uncapped."""
    final_soft_cap: float | None = None
    """Logits z become cap * tanh(z / cap) (Gemma 2); None: uncapped."""

    def __post_init__(self) -> None:
        # A tuple whatever it came as (a JSON list): the config is a dict key.
        object.__setattr__(self, "windows", tuple(self.windows))
        object.__setattr__(self, "rope_freq_factors", tuple(map(float, self.rope_freq_factors)))
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be silu or gelu_tanh, got {self.activation!r}")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(
                f"windows has {len(self.windows)} entries for {self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"a window must be None or at least 1, got {self.windows}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {self.head_dim}")
        factors = self.rope_freq_factors
        if factors and len(factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors holds {len(factors)} factors for {self.head_dim // 2} pairs"
            )
        if not all(0 < f < math.inf for f in (self.rope_scale, self.rope_attn_factor, *factors)):
            raise ValueError(
                "rope_scale, rope_attn_factor and rope_freq_factors must be positive and finite"
            )
        if self.rope_scaling not in ("linear", "yarn"):
            raise ValueError(f"rope_scaling must be linear or yarn, got {self.rope_scaling!r}")
        if self.rope_scaling == "yarn" and not (
            self.yarn_original_context >= 1
            and 0 < self.yarn_beta_slow < self.yarn_beta_fast < math.inf
        ):
            raise ValueError(
                "YaRN needs yarn_original_context >= 1 and 0 < yarn_beta_slow < yarn_beta_fast, "
                f"got {self.yarn_original_context}, {self.yarn_beta_slow}, {self.yarn_beta_fast}"
            )
        scalars = (self.attention_scale, self.attn_soft_cap, self.final_soft_cap)
        if not all(f is None or 0 < f < math.inf for f in scalars):
            raise ValueError(
                "attention_scale, attn_soft_cap and final_soft_cap must be None or "
                "positive and finite"
            )

    @property
    def qkv_size(self) -> int:
        return (self.num_qo_heads + 2 * self.num_kv_heads) * self.head_dim

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None (global attention)."""
        return self.windows[layer] if self.windows else None

    @property
    def layer_groups(self) -> list[tuple[tuple[int, ...], int | None]] | None:
        """The page manager's layer groups: (layers, window) for each distinct
        window, global layers first; None when every layer is global (one
        group, the plain manager)."""
        if not any(w is not None for w in self.windows):
            return None
        order = sorted(set(self.windows), key=lambda w: (w is not None, w or 0))
        return [
            (tuple(i for i, w in enumerate(self.windows) if w == window), window)
            for window in order
        ]

    def rope_theta_of(self, window: int | None) -> float:
        """The RoPE base of a layer with this window."""
        if window is not None and self.local_rope_theta is not None:
            return self.local_rope_theta
        return self.rope_theta


def layer_weight_shapes(c: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's weights (x @ W convention)."""
    shapes = {
        "attn_norm": (c.hidden_size,),
        "wqkv": (c.hidden_size, c.qkv_size),
        "wo": (c.num_qo_heads * c.head_dim, c.hidden_size),
        "mlp_norm": (c.hidden_size,),
        "w_gate": (c.hidden_size, c.ffn_size),
        "w_up": (c.hidden_size, c.ffn_size),
        "w_down": (c.ffn_size, c.hidden_size),
    }
    if c.qk_norm:
        shapes |= {"q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    if c.qkv_bias:
        shapes["bqkv"] = (c.qkv_size,)
    if c.sandwich_norms:
        shapes |= {"post_attn_norm": (c.hidden_size,), "post_mlp_norm": (c.hidden_size,)}
    return shapes


def init_weights(c: DecoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights from a fixed seed: name -> array.

    Names: "embed" [V, H], "layers.{i}.{name}" (see layer_weight_shapes),
    "final_norm" [H], "lm_head" [H, V]. Matrices are N(0, 1/fan_in) so that
    activations keep their scale through the layers; norms start at 1,
    biases at 0, each with noise of 0.1.
    """
    rng = np.random.default_rng(seed)
    weights = {"embed": rng.standard_normal((c.vocab_size, c.hidden_size), dtype=np.float32)}
    for i in range(c.num_layers):
        for name, shape in layer_weight_shapes(c).items():
            if len(shape) == 1:
                w = ((name != "bqkv") + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                w = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
            weights[f"layers.{i}.{name}"] = w
    weights["final_norm"] = np.ones(c.hidden_size, np.float32)
    weights["lm_head"] = (
        rng.standard_normal((c.hidden_size, c.vocab_size)) / np.sqrt(c.hidden_size) * 4
    ).astype(np.float32)
    return weights


def rope_tables(c: DecoderConfig, window: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_positions, head_dim / 2] of the rotary embedding of
    a layer with this window, computed in float64 and rounded once: pair i
    of position p turns by p / rope_scale * base^(-2i / D) / factor_i, at
    base `rope_theta_of(window)` (under YaRN, `yarn_frequencies` instead of
    the division by rope_scale), and both are multiplied by
    rope_attn_factor; a window layer with a base of its own (Gemma 3's) is
    not scaled, as llama.cpp's is not."""
    theta = c.rope_theta_of(window)
    inv_freq = theta ** (-np.arange(0, c.head_dim // 2, dtype=np.float64) * 2 / c.head_dim)
    positions = np.arange(c.max_positions, dtype=np.float64)
    magnitude = c.rope_attn_factor
    if window is None or c.local_rope_theta is None:
        if c.rope_freq_factors:
            inv_freq /= np.asarray(c.rope_freq_factors, np.float64)
        if c.rope_scaling == "yarn":
            inv_freq = yarn_frequencies(c, theta, inv_freq)
            if c.rope_scale > 1:
                magnitude *= 1 + 0.1 * math.log(c.rope_scale)
        else:
            positions /= c.rope_scale
    angle = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
    return cos.astype(np.float32), sin.astype(np.float32)


def yarn_frequencies(c: DecoderConfig, theta: float, inv_freq: np.ndarray) -> np.ndarray:
    """YaRN's frequencies [head_dim / 2] from the unscaled ones at base
    `theta`: pair i keeps inv_freq[i] below the pair that turns
    yarn_beta_fast times over yarn_original_context positions (rounded
    down), takes inv_freq[i] / rope_scale past the one that turns
    yarn_beta_slow times (rounded up), and mixes the two linearly between
    (llama.cpp's `rope_yarn` with ext_factor 1; transformers' "yarn")."""

    def pair_turning(turns: float) -> float:
        ratio = c.yarn_original_context / (turns * 2 * math.pi)
        return c.head_dim * math.log(ratio) / (2 * math.log(theta))

    low = max(math.floor(pair_turning(c.yarn_beta_fast)), 0)
    high = min(math.ceil(pair_turning(c.yarn_beta_slow)), c.head_dim - 1)
    pairs = np.arange(c.head_dim // 2, dtype=np.float64)
    interpolated = np.clip((pairs - low) / max(high - low, 0.001), 0.0, 1.0)
    return inv_freq * (1 - interpolated) + inv_freq / c.rope_scale * interpolated


def quantize_weights(
    c: DecoderConfig, weights: dict[str, np.ndarray], fmt: str = "Q8_0"
) -> tuple[dict[str, np.ndarray], dict]:
    """The model with its matrices in a GGUF block format: (the weights with
    each matrix replaced by its dequantized blocks, the packed blocks under
    the quantized step graphs' names). Both serve the same model, so the
    float and quantized graphs of it can be compared.

    Names of the packed matrices: per layer "wqkv", "wo", "w_gate_up" (gate
    then up) and "w_down", then "lm_head" and "embed" (the embedding's rows;
    pagedkv.models.gguf_model).
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
    raw = quants.quantize(np.ascontiguousarray(weights["embed"], np.float32), kind)
    dense["embed"] = quants.dequantize(raw, kind)  # its rows, looked up
    packed["embed"] = pack_quantized_weight(raw, fmt, c.vocab_size, c.hidden_size)
    return dense, packed
