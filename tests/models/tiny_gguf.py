"""A tiny Llama, Qwen or Gemma 2 GGUF written for the tests that read one."""

from __future__ import annotations

import numpy as np

FLOAT16_SCALES = {
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_XS": (0,),
}
"""Byte offsets of the float16 scales in a block of each format that
`write_tiny_gguf` writes (ggml-common.h's block layouts)."""


def write_tiny_gguf(
    path,
    hidden=128,
    ffn=192,
    blocks=None,
    keys=None,
    rope_freqs=None,
    arch="llama",
    head_dim=None,
    layers=1,
):
    """A Llama GGUF (or Qwen 2, `arch="qwen2"`, with Q, K and V biases,
    Qwen 3, with per-head query and key norms, or Gemma 2, with norms after
    the attention and the MLP and no window or soft caps unless `keys` say
    so) of `layers` layers, random
    float32 tensors and a token list; `blocks` maps tensor names to a GGUF
    block format whose random bytes they hold instead (any bytes are valid
    blocks); `keys` adds metadata (name: value, a string, a uint32 or a float32),
    `rope_freqs` a `rope_freqs` tensor; `head_dim` (default hidden / heads)
    is written as the heads' key and value length."""
    import gguf

    rng = np.random.default_rng(0)
    heads, kv_heads, vocab = 2, 1, 8
    head_dim = head_dim or hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(256)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(3, vocab))])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template("{{ messages }}")
    for key, value in (keys or {}).items():
        kind = (
            gguf.GGUFValueType.STRING
            if isinstance(value, str)
            else gguf.GGUFValueType.UINT32
            if isinstance(value, int)
            else gguf.GGUFValueType.FLOAT32
        )
        w.add_key_value(key, value, kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    layer = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (heads * head_dim, hidden),
        "attn_k.weight": (kv_heads * head_dim, hidden),
        "attn_v.weight": (kv_heads * head_dim, hidden),
        "attn_output.weight": (hidden, heads * head_dim),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    if arch == "qwen3":
        layer |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    if arch == "qwen2":
        layer |= {f"attn_{p}.bias": (layer[f"attn_{p}.weight"][0],) for p in "qkv"}
    if arch == "gemma2":
        layer |= {"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)}
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    for name, shape in shapes.items():
        fmt = (blocks or {}).get(name)
        if fmt is None:
            w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
            continue
        kind = gguf.GGMLQuantizationType[fmt]
        inputs, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (shape[0], shape[1] // inputs * size), dtype=np.uint8)
        for at in FLOAT16_SCALES[fmt]:  # finite scales, not random bits
            raw.reshape(shape[0], -1, size)[..., at : at + 2] = np.array([0.01], np.float16).view(
                np.uint8
            )
        w.add_tensor(name, raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
