"""Reads a GGUF (Llama, Qwen 2, Qwen 3, Gemma 2 or Gemma 3 architecture)
into the step graphs' description (`DecoderConfig`) and weights.

GGUF stores a linear layer as [out, in] (quantized Q4_1, Q8_0 or plain F32).
The weights come two ways: dequantized with the `gguf` package and
transposed to [in, out] float32 (the float graphs multiply x @ W), each on
first use, and, for the quantized graphs, the GGUF's own blocks packed for
pagedkv's quantized product (`pagedkv._ops.quantized_panels`), bit for bit.
llama.cpp's converter permutes the rows of the Q and K projections so that
its RoPE rotates interleaved pairs; the graphs rotate halves (as the
original checkpoint does), so the permutation is undone here, on the rows
of either form. A model with tied embeddings (no `output.weight`) reuses
the token embedding as its output head.

Qwen's blocks are Llama's stored in rotate-half order (llama.cpp's NEOX
RoPE), with a bias on the Q, K and V projections (Qwen 2) or RMSNorm over
each query and key head (Qwen 3), the head size in the metadata.
Gemma 2 and 3 differ in their metadata and in what the file may leave out:
their projections are stored in rotate-half order already (llama.cpp's NEOX
RoPE), their norm weights are stored as (1 + w), so the graphs multiply by
them as they are, and llama.cpp (like transformers) supplies what a file
does not state: which layers slide (Gemma 2 alternates, starting with a
sliding layer; every sixth Gemma 3 layer is global), Gemma 2's window
(4096) and soft caps (50 on the attention scores, 30 on the logits), the
RoPE base of Gemma 3's sliding layers (10000), and the query scale of each
family's 27B model (1 / sqrt(hidden / heads), where the others take
1 / sqrt(head_dim)).

RoPE scaling is read as llama.cpp reads it: `{arch}.rope.scaling.factor`
divides positions (linear scaling: the type named "linear", or not named;
"none" turns it off) or, with the type "yarn", the frequencies YaRN
interpolates over `rope.scaling.original_context_length` (the file's
context if absent; the model's context becomes that times the factor), and
a `rope_freqs` tensor divides each rotary pair's frequency (Llama 3.1's
scaling, which its converter writes as that tensor); all in the layers at
the model's own base, not in window layers with a base of their own
(Gemma 3's). `rope.scaling.attn_factor` multiplies cos and sin in every
layer. LongRoPE and YaRN's DeepSeek variants are refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pagedkv._ops.contract import QUANT_PANEL
from pagedkv._ops.quantized_panels import (
    PACKED_AS,
    ZERO_POINTS,
    QuantizedWeight,
    pack_quantized_weight,
)
from pagedkv.graphs.model import DecoderConfig

from .errors import ModelError

_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "ffn_norm": "mlp_norm",
    "attn_output": "wo",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}


@dataclass
class GGUFModel:
    """What a GGUF holds, in pagedkv's terms."""

    config: DecoderConfig
    weights: Mapping[str, np.ndarray]
    """float32 arrays named as `pagedkv.graphs.model.init_weights` names
    them, each dequantized on first use (`LazyWeights`)."""
    metadata: dict[str, object]
    """Every scalar and string field, and the tokenizer's arrays."""
    quantized: dict[str, QuantizedWeight]
    """The matrices in their GGUF block formats, packed, by the quantized
    graphs' names (`quantized_weight_names`): the products whose formats the
    quantized product takes (the others are multiplied in float32), and the
    token embedding in such a format ("embed": the "lm_head" object itself
    where the model ties them); empty when none is."""


def undo_rope_permutation(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of a Q or K projection [heads * D, in] back from llama.cpp's
    interleaved-pair order to rotate-half order.

    llama.cpp's converter maps each head's rows [D] as
    reshape(2, D/2).swapaxes: row 2i holds original row i and row 2i+1
    original row i + D/2. This is its inverse.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized_weight_names(num_layers: int) -> list[str]:
    """The quantized graphs' matrices: per layer the fused Q|K|V projection
    (or, with V in another format, "wqk" and "wv"), the output projection,
    the fused gate|up projection and the down projection; then the output
    head, and the token embedding (its rows, looked up rather than
    multiplied; the head's own panels where the model ties them)."""
    per_layer = ("wqkv", "wo", "w_gate_up", "w_down")
    layers = [f"layers.{i}.{name}" for i in range(num_layers) for name in per_layer]
    return [*layers, "lm_head", "embed"]


class LazyWeights(Mapping[str, np.ndarray]):
    """Arrays by name, each made by its function on first use and kept: a
    model served from its packed blocks never dequantizes the matrices it
    multiplies packed (a 1B model's are 4 GB in float32), while its float
    form, or a reference, still finds every weight by name."""

    def __init__(self, makers: dict[str, Callable[[], np.ndarray]]) -> None:
        self._makers = makers
        self._made: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._made:
            self._made[name] = self._makers[name]()
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


def read_gguf(path: str | Path) -> GGUFModel:
    """Reads a Llama, Qwen or Gemma GGUF from `path`: its description and
    metadata, its packed products, and its float32 weights (dequantized on
    first use; the file stays memory-mapped until then).

    Raises:
        ModelError: the file is missing, not a GGUF, of another
            architecture, or lacks a tensor; the message names it and says
            to delete the file (it is fetched again on next use).
    """
    path = Path(path)
    config, metadata, tensors, weights = _read(path)
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    try:
        quantized = _quantized(config, tensors, head_name, permuted=config.family == "llama")
    except (ValueError, NotImplementedError) as e:
        raise ModelError(f"{path}: cannot pack ({e})") from None
    return GGUFModel(config, weights, metadata, quantized)


def read_float_weights(path: str | Path) -> LazyWeights:
    """The GGUF's float32 weights alone (as `read_gguf` gives them), for a
    model whose packed products come from elsewhere (its unpacked copy)."""
    return _read(Path(path))[3]


def _read(path: Path) -> tuple[DecoderConfig, dict[str, object], dict, LazyWeights]:
    """(config, metadata, tensors by name, float32 weights) of the GGUF."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file
        raise ModelError(
            f"{path} is not a readable GGUF ({type(e).__name__}: {e}); a file pagedkv fetched "
            "is fetched again once deleted"
        ) from None
    arch = metadata.get("general.architecture")
    if arch not in _CONFIGS:
        raise ModelError(
            f"{path} holds a {arch!r} model; pagedkv serves the architectures "
            f"{', '.join(sorted(_CONFIGS))}"
        )
    try:
        config = _CONFIGS[arch](metadata)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(
            f"{path} lacks or garbles metadata {e} that a {arch} model needs"
        ) from None
    try:
        tensors = {t.name: t for t in reader.tensors}
        unknown = sorted(
            {t.tensor_type.name for t in tensors.values()}
            - {"F32", "F16", "BF16", *_DEQUANTIZED_FORMATS}
        )
        if unknown:
            raise ModelError(
                f"{path} holds tensors in {', '.join(unknown)}, which pagedkv cannot read"
            )

        def matrix(name: str) -> Callable[[], np.ndarray]:
            """A maker of the tensor as a float32 array; the tensor must exist."""
            t = tensors[name]
            # Owned, writable copies, independent of the memory-mapped file.
            return lambda: np.require(
                dequantize(t.data, t.tensor_type), np.float32, ["C", "W", "O"]
            )

        factors = matrix("rope_freqs.weight")().ravel() if "rope_freqs.weight" in tensors else ()
        try:
            scaling = _rope_scaling(metadata, arch, config.max_positions)
            config = replace(config, **scaling, rope_freq_factors=factors)
        except ValueError as e:
            raise ModelError(f"{path}: {e}") from None
        weights = _float_weights(config, matrix, permuted=arch == "llama")
    except KeyError as e:
        raise ModelError(
            f"{path} lacks tensor {e}; delete it and it will be fetched again"
        ) from None
    except (ValueError, NotImplementedError) as e:
        raise ModelError(f"{path}: cannot dequantize ({e})") from None
    return config, metadata, tensors, weights


def _float_weights(
    config: DecoderConfig, matrix: Callable[[str], Callable[[], np.ndarray]], permuted: bool
) -> LazyWeights:
    """Every weight as float32, named as `pagedkv.graphs.model.init_weights`
    names them, from `matrix`'s makers (which fail at once on a missing
    tensor); `permuted`: the Q and K rows are in llama.cpp's interleaved
    order (undone here). A model with tied embeddings (no `output.weight`)
    reuses the token embedding as its output head."""

    def qkv(q: Callable, k: Callable, v: Callable) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            qs, ks = q(), k()
            if permuted:
                qs = undo_rope_permutation(qs, config.num_qo_heads)
                ks = undo_rope_permutation(ks, config.num_kv_heads)
            return np.ascontiguousarray(np.concatenate([qs, ks, v()]).T)

        return make

    def transposed(w: Callable) -> Callable[[], np.ndarray]:
        """A matrix as [in, out]; a vector as it is."""

        def make() -> np.ndarray:
            a = w()
            return np.ascontiguousarray(a.T if a.ndim == 2 else a)

        return make

    makers = {"embed": matrix("token_embd.weight")}  # [vocab, hidden]
    layer_tensors = dict(_LAYER_TENSORS)
    if config.qk_norm:
        layer_tensors |= {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
    if config.sandwich_norms:
        layer_tensors |= {"post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_mlp_norm"}

    def concatenated(*parts: Callable) -> Callable[[], np.ndarray]:
        return lambda: np.concatenate([part() for part in parts])

    for i in range(config.num_layers):
        blk = f"blk.{i}."
        makers[f"layers.{i}.wqkv"] = qkv(
            *(matrix(blk + f"attn_{part}.weight") for part in ("q", "k", "v"))
        )
        if config.qkv_bias:
            makers[f"layers.{i}.bqkv"] = concatenated(
                *(matrix(blk + f"attn_{part}.bias") for part in ("q", "k", "v"))
            )
        for gguf_name, name in layer_tensors.items():
            makers[f"layers.{i}.{name}"] = transposed(matrix(blk + gguf_name + ".weight"))
    makers["final_norm"] = matrix("output_norm.weight")
    try:
        makers["lm_head"] = transposed(matrix("output.weight"))
    except KeyError:  # tied embeddings
        makers["lm_head"] = lambda: np.ascontiguousarray(weights["embed"].T)
    weights = LazyWeights(makers)  # the tied head's maker reads it
    return weights


def _quantized(
    config: DecoderConfig, tensors: dict, head_name: str, permuted: bool
) -> dict[str, QuantizedWeight]:
    """The matrices packed in their own block formats (`PACKED_AS`), the Q,
    K and V projections fused into one product and the gate and up
    projections into another (their panels side by side; parts in different
    formats as Q8_0 where each packs so exactly). A Q|K|V product whose V
    packs in another layout than Q and K is two, "wqk" and "wv". A product
    whose parts are in a format the quantized product does not take, or
    pack to different layouts otherwise, is left out (its weights stay
    float), layer by layer: the step graphs build a layer subgraph per set
    of formats. Empty when no product is left."""

    def packed(
        name: str, heads: int | None = None, layout: str | None = None
    ) -> QuantizedWeight | None:
        t = tensors[name]
        if t.tensor_type.name not in PACKED_AS:
            return None
        k, n = (int(d) for d in t.shape)  # GGUF lists the inputs first
        data = np.asarray(t.data).reshape(n, -1)
        if heads is not None and permuted:
            data = undo_rope_permutation(data, heads)
        return pack_quantized_weight(data, t.tensor_type.name, n, k, layout)

    def fused(names: list[tuple[str, int | None]]) -> QuantizedWeight | None:
        """The products of `names` ((tensor, heads of a RoPE permutation))
        side by side, in one layout: their own, or Q8_0 where they differ
        and every one packs as Q8_0 (Gemma's Q5_0 queries and keys beside
        its Q8_0 values)."""
        parts = [packed(name, heads) for name, heads in names]
        if None in parts:
            return None
        if len({p.format for p in parts}) != 1:
            types = {tensors[name].tensor_type.name for name, _ in names}
            if not types <= {"Q8_0", *ZERO_POINTS}:
                return None
            parts = [packed(name, heads, "Q8_0") for name, heads in names]
        if any(p.out_features % QUANT_PANEL for p in parts[:-1]):
            return None
        return QuantizedWeight(
            parts[0].format,
            sum(p.out_features for p in parts),
            parts[0].in_features,
            np.concatenate([p.panels for p in parts]),
        )

    out: dict[str, QuantizedWeight | None] = {}
    for i in range(config.num_layers):
        blk = f"blk.{i}."
        qk = [
            (blk + "attn_q.weight", config.num_qo_heads),
            (blk + "attn_k.weight", config.num_kv_heads),
        ]
        v = (blk + "attn_v.weight", None)
        out[f"layers.{i}.wqkv"] = fused([*qk, v])
        if out[f"layers.{i}.wqkv"] is None:
            # V in another format than Q and K (llama.cpp's Q4_K_M stores
            # it in Q6_K in half the layers): two products, side by side.
            out[f"layers.{i}.wqk"], out[f"layers.{i}.wv"] = fused(qk), packed(*v)
            if out[f"layers.{i}.wqk"] is None or out[f"layers.{i}.wv"] is None:
                out[f"layers.{i}.wqk"] = out[f"layers.{i}.wv"] = None
        out[f"layers.{i}.wo"] = packed(blk + "attn_output.weight")
        out[f"layers.{i}.w_gate_up"] = fused(
            [(blk + "ffn_gate.weight", None), (blk + "ffn_up.weight", None)]
        )
        out[f"layers.{i}.w_down"] = packed(blk + "ffn_down.weight")
    out["lm_head"] = packed(head_name)
    # The embedding's rows are looked up in their own blocks; where the
    # head is the embedding, in the head's panels (one object, held once).
    tied = head_name == "token_embd.weight"
    out["embed"] = out["lm_head"] if tied else packed("token_embd.weight")
    return {name: q for name, q in out.items() if q is not None}


def _llama_config(metadata: dict[str, object]) -> DecoderConfig:
    """Llama's shape from llama.cpp's `llama.*` metadata keys."""
    heads = int(metadata["llama.attention.head_count"])
    hidden = int(metadata["llama.embedding_length"])
    return DecoderConfig(
        vocab_size=_vocab_size(metadata, "llama"),
        hidden_size=hidden,
        num_layers=int(metadata["llama.block_count"]),
        num_qo_heads=heads,
        num_kv_heads=int(metadata.get("llama.attention.head_count_kv", heads)),
        head_dim=int(metadata.get("llama.rope.dimension_count", hidden // heads)),
        ffn_size=int(metadata["llama.feed_forward_length"]),
        rope_theta=float(metadata.get("llama.rope.freq_base", 1e4)),
        rms_eps=float(metadata["llama.attention.layer_norm_rms_epsilon"]),
        max_positions=int(metadata["llama.context_length"]),
    )


def _qwen_config(metadata: dict[str, object], arch: str) -> DecoderConfig:
    """Qwen 2's or Qwen 3's block from llama.cpp's `qwen2.*` or `qwen3.*`
    metadata keys: Llama's, with projections stored in rotate-half order
    (llama.cpp's NEOX RoPE), heads whose size the file may state
    (`attention.key_length`), and a bias on the Q|K|V projection (Qwen 2)
    or RMSNorm over each query and key head (Qwen 3)."""
    heads = int(metadata[f"{arch}.attention.head_count"])
    hidden = int(metadata[f"{arch}.embedding_length"])
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    if int(metadata.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelError(f"{arch} GGUF with key and value heads of different sizes")
    if int(metadata.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ModelError(f"{arch} GGUF rotating part of each head: not implemented")
    return DecoderConfig(
        vocab_size=_vocab_size(metadata, arch),
        hidden_size=hidden,
        num_layers=int(metadata[f"{arch}.block_count"]),
        num_qo_heads=heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn_size=int(metadata[f"{arch}.feed_forward_length"]),
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 1e6)),
        rms_eps=float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_positions=int(metadata[f"{arch}.context_length"]),
        family=arch,
        qk_norm=arch == "qwen3",
        qkv_bias=arch == "qwen2",
    )


GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
"""Layers in each period of a Gemma file's sliding-window pattern where it
states none (`attention.sliding_window_pattern`): all but the period's last
layer slide (llama.cpp's defaults: Gemma 2 alternates, every sixth Gemma 3
layer is global)."""
GEMMA2_WINDOW = 4096
"""Gemma 2's sliding window where its file states none (llama.cpp's)."""
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
"""The RoPE base of Gemma 3's sliding-window layers where the file states
none (`rope.freq_base_swa`)."""
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The layer count of each family's 27B model, whose queries are scaled by
1 / sqrt(hidden / heads) instead of 1 / sqrt(head_dim) (llama.cpp's rule,
after gemma_pytorch)."""
GEMMA2_SOFT_CAPS = (50.0, 30.0)
"""Gemma 2's attention and final logit soft caps where its file states none."""


def _window_pattern(metadata: dict[str, object], arch: str, layers: int) -> list[bool]:
    """Which layers slide: the file's pattern, a list of flags or a period
    (all but each period's last layer; 0: all), else the family's period."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", GEMMA_WINDOW_PATTERN[arch])
    if isinstance(pattern, (list, tuple, np.ndarray)):
        if len(pattern) != layers:
            raise ModelError(f"{arch} GGUF with a sliding-window pattern of {len(pattern)} layers")
        return [bool(p) for p in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _gemma_config(metadata: dict[str, object], arch: str) -> DecoderConfig:
    """Gemma 2's or Gemma 3's block from llama.cpp's `gemma2.*` or
    `gemma3.*` metadata keys, with llama.cpp's defaults for what the file
    leaves out (see the module docstring)."""
    heads = int(metadata[f"{arch}.attention.head_count"])
    hidden = int(metadata[f"{arch}.embedding_length"])
    layers = int(metadata[f"{arch}.block_count"])
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    if int(metadata.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelError(f"{arch} GGUF with key and value heads of different sizes")
    theta = float(metadata.get(f"{arch}.rope.freq_base", 1e4 if arch == "gemma2" else 1e6))
    window = int(metadata.get(f"{arch}.attention.sliding_window", 0))
    if arch == "gemma2":
        window = window or GEMMA2_WINDOW
        caps = (
            float(metadata.get(f"{arch}.attn_logit_softcapping", GEMMA2_SOFT_CAPS[0])),
            float(metadata.get(f"{arch}.final_logit_softcapping", GEMMA2_SOFT_CAPS[1])),
        )
        # Its window layers rotate as the others unless the file says
        # otherwise (then, as Gemma 3's, without the scaling).
        local_theta = metadata.get(f"{arch}.rope.freq_base_swa")
        if local_theta is not None and float(local_theta) == theta:
            local_theta = None
    else:
        caps = (0.0, float(metadata.get(f"{arch}.final_logit_softcapping", 0.0)))
        local_theta = metadata.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)
    slides = _window_pattern(metadata, arch, layers) if window > 0 else [False] * layers
    return DecoderConfig(
        vocab_size=_vocab_size(metadata, arch),
        hidden_size=hidden,
        num_layers=layers,
        num_qo_heads=heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn_size=int(metadata[f"{arch}.feed_forward_length"]),
        rope_theta=theta,
        rms_eps=float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_positions=int(metadata[f"{arch}.context_length"]),
        family=arch,
        activation="gelu_tanh",
        qk_norm=arch == "gemma3",
        sandwich_norms=True,
        norm_in_float32=True,
        embed_scale=float(np.float32(np.sqrt(hidden))),
        windows=tuple(window if slide else None for slide in slides),
        local_rope_theta=None if local_theta is None else float(local_theta),
        attention_scale=float(np.float32(1 / np.sqrt(np.float32(hidden // heads))))
        if layers == GEMMA_27B_LAYERS[arch]
        else None,
        attn_soft_cap=caps[0] or None,
        final_soft_cap=caps[1] or None,
    )


def _rope_scaling(metadata: dict[str, object], arch: str, context: int) -> dict[str, object]:
    """DecoderConfig's RoPE scaling fields from `{arch}.rope.scaling.*` (see
    the module docstring), for a model whose file states `context` tokens;
    raises ModelError for a scaling pagedkv does not implement."""

    def key(name: str, default: object = None) -> object:
        return metadata.get(f"{arch}.rope.scaling.{name}", default)

    kind = str(key("type", "linear"))
    if kind not in ("linear", "none", "yarn"):
        raise ModelError(
            f"{arch} GGUF with {kind!r} RoPE scaling: pagedkv implements linear scaling, "
            "YaRN and Llama 3.1's rope_freqs"
        )
    fields: dict[str, object] = {"rope_attn_factor": float(key("attn_factor", 1.0))}
    factor = key("factor", metadata.get(f"{arch}.rope.scale_linear"))
    if kind == "none" or factor is None or float(factor) == 0.0:
        return fields | {"rope_scale": 1.0}
    fields["rope_scale"] = float(factor)
    if kind == "yarn":
        log_multiplier = float(key("yarn_log_multiplier", 0.0))
        if log_multiplier != 0.0 or float(key("yarn_ext_factor", -1.0)) not in (-1.0, 1.0):
            raise ModelError(
                f"{arch} GGUF with a YaRN log multiplier or extrapolation mix: not implemented"
            )
        original = int(key("original_context_length", context))
        fields |= {
            "rope_scaling": "yarn",
            "yarn_original_context": original,
            "yarn_beta_fast": float(key("yarn_beta_fast", 32.0)),
            "yarn_beta_slow": float(key("yarn_beta_slow", 1.0)),
            # The context YaRN stretches the original one to.
            "max_positions": max(context, round(original * float(factor))),
        }
    return fields


def _vocab_size(metadata: dict[str, object], arch: str) -> int:
    vocab = metadata.get(f"{arch}.vocab_size")
    return int(len(metadata["tokenizer.ggml.tokens"]) if vocab is None else vocab)


_CONFIGS = {
    "llama": _llama_config,
    "qwen2": functools.partial(_qwen_config, arch="qwen2"),
    "qwen3": functools.partial(_qwen_config, arch="qwen3"),
    "gemma2": functools.partial(_gemma_config, arch="gemma2"),
    "gemma3": functools.partial(_gemma_config, arch="gemma3"),
}
"""The architectures pagedkv describes, by GGUF's `general.architecture`."""
_DEQUANTIZED_FORMATS = (
    *PACKED_AS,
    "Q2_K",
    "Q3_K",
    "IQ1_S",
    "IQ1_M",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ4_NL",
    "IQ4_XS",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
)
"""The block formats read (dequantized with `gguf`, llama.cpp's own Python
reference) for the float graphs. Those in `PACKED_AS` are also multiplied
in place; a product in any other stays float32."""
