"""The model in plain NumPy, with a dense (non-paged) KV cache per request.

Independent of pagedkv's kernels and of MAX: the demo's self-check runs the
same weights through it and compares every generated token. For the
quantized step graphs it quantizes each product's activations as they do
(`quantize_activations`: per block of 32, to int8 with a float32 scale) and
multiplies them by the dequantized weights in float64, so that it computes
what they compute up to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from .model import DecoderConfig, rope_tables


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMS norm of x [..., hidden] over its last axis, scaled by weight [hidden]."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [T, heads, D] with cos, sin [T, D/2]."""
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), elementwise."""
    return x / (1 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation, elementwise."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def quantize_activations(x: np.ndarray) -> np.ndarray:
    """x [..., K] (K a multiple of 32) as the quantized products see it: each
    block of 32 rounded in float32 to d * q with d = max|x| / 127 and q an
    integer in [-127, 127] (round half to even), returned in float64."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inverse)
    return (codes * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


class DenseDecoder:
    """One request at a time: feed() tokens, get the last token's logits.

    `quantized`: quantize the activations of every product (True) or of
    the products named ("wqkv", "wo", "w_gate_up", "w_down", "lm_head"; or
    "layers.{i}.w_down" for one layer's): the quantized step graphs'
    arithmetic, where the weights are the GGUF's, dequantized."""

    def __init__(
        self,
        config: DecoderConfig,
        weights: Mapping[str, np.ndarray],
        quantized: bool | Collection[str] = False,
    ) -> None:
        self.c = config
        self.w = weights
        if quantized is True:
            quantized = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")
        self.quantized = frozenset(quantized or ())
        self.rope = {
            window: rope_tables(config, window)
            for window in {config.window(i) for i in range(config.num_layers)}
        }
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.length = 0
        self.reset()

    def reset(self) -> None:
        c = self.c
        empty = np.zeros((0, c.num_kv_heads, c.head_dim), np.float32)
        self.k = [empty] * c.num_layers
        self.v = [empty] * c.num_layers
        self.length = 0

    def fork(self) -> DenseDecoder:
        """A copy sharing nothing mutable (the reference of a forked request)."""
        other = DenseDecoder.__new__(DenseDecoder)
        other.c, other.w, other.rope = self.c, self.w, self.rope
        other.quantized = self.quantized
        other.k, other.v, other.length = list(self.k), list(self.v), self.length
        return other

    def product(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ w[name], after quantizing x when that product is quantized."""
        layer, _, product = name.rpartition(".")
        product = "w_gate_up" if product in ("w_gate", "w_up") else product
        quantized = product in self.quantized or f"{layer}.{product}" in self.quantized
        return (quantize_activations(x) if quantized else x) @ self.w[name]

    def feed(self, tokens: list[int]) -> np.ndarray:
        """Appends tokens (causal attention over everything so far); returns
        the logits [vocab] after the last one."""
        return self.feed_all(tokens, last_only=True)[-1]

    def feed_all(self, tokens: list[int], last_only: bool = False) -> np.ndarray:
        """Appends tokens; returns the logits [len(tokens), vocab] after each
        (teacher forcing a whole sequence in one pass), or [1, vocab] after
        the last one with `last_only`."""
        c, w = self.c, self.w
        t = len(tokens)
        pos = np.arange(self.length, self.length + t)
        x = w["embed"][np.asarray(tokens)] * c.embed_scale
        group = c.num_qo_heads // c.num_kv_heads
        gate_of = silu if c.activation == "silu" else gelu_tanh
        nq, nk = c.num_qo_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i in range(c.num_layers):
            p = f"layers.{i}."
            window = c.window(i)
            cos, sin = (table[pos] for table in self.rope[window])
            h = rms_norm(x, w[p + "attn_norm"], c.rms_eps)
            qkv = self.product(h, p + "wqkv")
            if c.qkv_bias:
                qkv = qkv + w[p + "bqkv"]
            q = qkv[:, :nq].reshape(t, c.num_qo_heads, c.head_dim)
            k = qkv[:, nq : nq + nk].reshape(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, nq + nk :].reshape(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, w[p + "q_norm"], c.rms_eps)
                k = rms_norm(k, w[p + "k_norm"], c.rms_eps)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.k[i] = np.concatenate([self.k[i], k])
            self.v[i] = np.concatenate([self.v[i], v])
            keys = np.repeat(self.k[i], group, axis=1)  # [L, Hq, D]
            values = np.repeat(self.v[i], group, axis=1)
            scale = 1 / np.sqrt(c.head_dim) if c.attention_scale is None else c.attention_scale
            scores = np.einsum("thd,lhd->htl", q, keys) * scale
            if c.attn_soft_cap is not None:
                scores = c.attn_soft_cap * np.tanh(scores / c.attn_soft_cap)
            key_pos = np.arange(self.length + t)[None, :]
            visible = key_pos <= pos[:, None]
            if window is not None:
                visible &= key_pos > pos[:, None] - window
            scores = np.where(visible[None], scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            p_attn = np.exp(scores)
            p_attn /= p_attn.sum(axis=-1, keepdims=True)
            attn = np.einsum("htl,lhd->thd", p_attn, values).reshape(t, nq)
            out = self.product(attn, p + "wo")
            if c.sandwich_norms:
                out = rms_norm(out, w[p + "post_attn_norm"], c.rms_eps)
            x = x + out
            h = rms_norm(x, w[p + "mlp_norm"], c.rms_eps)
            gate, up = self.product(h, p + "w_gate"), self.product(h, p + "w_up")
            out = self.product(gate_of(gate) * up, p + "w_down")
            if c.sandwich_norms:
                out = rms_norm(out, w[p + "post_mlp_norm"], c.rms_eps)
            x = x + out
        self.length += t
        x = rms_norm(x[-1:] if last_only else x, w["final_norm"], c.rms_eps)
        logits = self.product(x, "lm_head")
        if c.final_soft_cap is not None:
            logits = c.final_soft_cap * np.tanh(logits / c.final_soft_cap)
        return logits
